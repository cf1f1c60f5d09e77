//! Where a line of training was trained before this run: the other runs' checkpoints it was
//! resumed from ([`Lineage`], kept in `trainer_state.json`) and the rule that adds one
//! ([`continued`]). Depends on nothing of the crate: the checkpoint's state and the `resumed`
//! event both carry it.
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A checkpoint of another run a later run resumed from: the steps before `step` were trained
/// there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lineage {
    /// The checkpoint's directory, absolute, as it was when it was resumed.
    pub checkpoint: String,
    pub step: u64,
}

/// The lineage of a run resuming checkpoint `path` (of `step`, with the lineage it saved): the
/// checkpoint joins it when it is not under `own_root`, this run's own checkpoints directory (a
/// resume of the run itself, a set-aside one of its own included, or of its copy moved into
/// another directory as a whole, adds nothing once the directory is the run's).
pub fn continued(saved: &[Lineage], path: &Path, step: u64, own_root: &Path) -> Vec<Lineage> {
    // Absolute before anything is compared: `--resume step-00000008` in the checkpoints
    // directory has an empty parent.
    let absolute = |p: &Path| {
        std::fs::canonicalize(p)
            .unwrap_or_else(|_| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()))
    };
    let checkpoint = absolute(path);
    let mut lineage = saved.to_vec();
    if !checkpoint.starts_with(absolute(own_root)) {
        lineage.push(Lineage { checkpoint: checkpoint.display().to_string(), step });
    }
    lineage
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run's checkpoints directory (as `checkpoint::store::root` names it, not imported: this
    /// module stays below everything).
    fn root(out_dir: &Path) -> std::path::PathBuf {
        out_dir.join(crate::fs::run_files::CHECKPOINTS)
    }

    #[test]
    fn another_runs_checkpoint_joins_the_lineage_and_the_runs_own_does_not() {
        let (mine, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (own_root, other_root) = (root(mine.path()), root(other.path()));
        for root in [&own_root, &other_root] {
            std::fs::create_dir_all(root.join("step-00000010")).unwrap();
        }
        let earlier = vec![Lineage { checkpoint: "/runs/first/checkpoints/step-00000004".into(), step: 4 }];
        // The run's own checkpoint, named directly or through another spelling of its path.
        assert_eq!(continued(&earlier, &own_root.join("step-00000010"), 10, &own_root), earlier);
        let dotted = mine.path().join(".").join("checkpoints").join("step-00000010");
        assert_eq!(continued(&[], &dotted, 10, &own_root), vec![]);
        // Named from the working directory (the crate's, under cargo test), and one the run set aside.
        let here = tempfile::tempdir_in(".").unwrap();
        let relative_root = root(Path::new(here.path().file_name().unwrap()));
        std::fs::create_dir_all(relative_root.join("set-aside-1/step-00000010")).unwrap();
        assert_eq!(
            continued(&[], &relative_root.join("set-aside-1/step-00000010"), 10, &root(here.path())),
            vec![]
        );
        assert_eq!(continued(&[], &relative_root.join("set-aside-1/step-00000010"), 10, &own_root).len(), 1);
        // Another run's: it follows what that run carried, by its absolute path.
        let theirs = other_root.join("step-00000010");
        let got = continued(&earlier, &theirs, 10, &own_root);
        let absolute = std::fs::canonicalize(&theirs).unwrap().display().to_string();
        assert_eq!(got, vec![earlier[0].clone(), Lineage { checkpoint: absolute, step: 10 }]);
    }
}
