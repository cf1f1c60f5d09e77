//! Whether a fresh run (`--resume none`) may start in an `out_dir`: one that already holds
//! checkpoints belongs to another run, and starting over there would leave that run's newer
//! checkpoints beside the new ones (a later `--resume auto` would pick them up). Also where
//! `--overwrite` moves an old run; the move itself (whatever the run holds) happens at the edge
//! (train::run_dir).
use super::store::{self, CheckpointError};
use std::path::{Path, PathBuf};

/// Where `--overwrite` moves the old run: `OUT_DIR.old-<unix seconds>` (`-2`, `-3`, … if taken).
pub fn aside_path(out_dir: &Path, unix_seconds: u64, taken: impl Fn(&Path) -> bool) -> PathBuf {
    store::free_path(format!("{}.old-{unix_seconds}", out_dir.display()), taken)
}

/// The error for a fresh start in `out_dir` (checkpoints under `root`) when another run is there.
pub fn refuse_if_occupied(root: &Path) -> Result<(), CheckpointError> {
    let steps: Vec<u64> = store::list(root).iter().map(|(s, _)| *s).collect();
    match steps.last() {
        None => Ok(()),
        Some(&newest) => Err(CheckpointError::RunExists {
            out_dir: root.parent().unwrap_or(root).to_path_buf(),
            newest,
            count: steps.len(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_aside_name_never_reuses_an_existing_one() {
        let out = Path::new("runs/x");
        assert_eq!(aside_path(out, 1700000000, |_| false), PathBuf::from("runs/x.old-1700000000"));
        let taken = |p: &Path| p == Path::new("runs/x.old-5") || p == Path::new("runs/x.old-5-2");
        assert_eq!(aside_path(out, 5, taken), PathBuf::from("runs/x.old-5-3"));
    }

    #[test]
    fn refusal_names_the_directory_the_newest_step_and_the_choices() {
        let d = tempfile::tempdir().unwrap();
        let root = store::root(d.path());
        assert!(refuse_if_occupied(&root).is_ok(), "no checkpoints directory at all");
        std::fs::create_dir_all(&root).unwrap();
        assert!(refuse_if_occupied(&root).is_ok(), "a checkpoints directory with none in it");
        for s in [10, 20] {
            std::fs::create_dir_all(root.join(store::dir_name(s))).unwrap();
        }
        let msg = refuse_if_occupied(&root).unwrap_err().to_string();
        for needle in [
            d.path().display().to_string(),
            "step 20".into(),
            "--resume auto".into(),
            "--overwrite".into(),
            "out_dir".into(),
        ] {
            assert!(msg.contains(&needle), "`{needle}` missing from: {msg}");
        }
    }
}
