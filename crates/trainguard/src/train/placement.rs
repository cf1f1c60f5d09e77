//! Whether `out_dir` may take this run, decided before anything there is touched (no directory
//! created, no lock file): a refusal leaves the filesystem as it was. What a trainguard run
//! directory is ([`is_run`]), and the places a run would lose something that is not its own:
//! inside another run's checkpoints directory, or holding another run in its own (checkpoint
//! writes and retention delete there); `--overwrite` of a directory that is not a run (it would
//! move the user's directory, `$HOME` say, aside); a directory that is not a run but holds files
//! a run truncates or removes (the user's own `metrics.jsonl`). Refused rather than kept aside:
//! the user named that directory for a run, and their files beside a run's (read by `report`
//! as the run's) are a mistake to point out, not one to tidy up silently.
use crate::checkpoint::store;
use crate::fs::dir_lock::LOCK_FILE;
use crate::fs::run_files;
use crate::fs::whole_file::read_string_at_most;
use std::path::{Component, Path, PathBuf};

/// An `out_dir` refused for what is already there (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("out_dir {} is inside {}, the checkpoints directory of the run in {}, whose checkpoint writes and retention would delete it: choose an out_dir outside it", .out_dir.display(), .run.join(run_files::CHECKPOINTS).display(), .run.display())]
    InsideCheckpoints { out_dir: PathBuf, run: PathBuf },
    #[error("out_dir {}: its checkpoints directory holds another run's directory {}, which this run's checkpoint writes and retention would delete: move that run out of it, or choose another out_dir", .out_dir.display(), .run.display())]
    HoldsRun { out_dir: PathBuf, run: PathBuf },
    #[error("--overwrite: out_dir {} is not a trainguard run (no config.yaml trainguard wrote, no checkpoints), so it is not moved aside: choose another out_dir, or empty it yourself", .out_dir.display())]
    OverwriteNotARun { out_dir: PathBuf },
    #[error("out_dir {} is not a trainguard run (no config.yaml trainguard wrote, no checkpoints) but holds {}, which a run would overwrite: move them away, or choose another out_dir", .out_dir.display(), .files.join(", "))]
    HoldsUsersFiles { out_dir: PathBuf, files: Vec<String> },
}

/// The run files a fresh start truncates whose names other tools use too. The log and the final
/// weights are appended to or set aside, not lost; `stop.json` and `torchrun_job.json`, replaced,
/// are trainguard's own names (a stale stop record alone is an earlier run's leftover to clear).
const REPLACED: [&str; 2] = [run_files::METRICS, run_files::EVENTS];

/// A `config.yaml` larger than this is not one trainguard wrote (one is a few KiB).
const CONFIG_MAX_BYTES: u64 = 1 << 20;

/// Refuses `out_dir` where this run would delete, move or overwrite what is not its own.
/// `overwrite`: the directory is to be moved aside (`--overwrite`).
pub(super) fn check(out_dir: &Path, overwrite: bool) -> Result<(), PlacementError> {
    let real = resolved(out_dir);
    if let Some(run) = real.ancestors().find_map(run_owning_checkpoints) {
        return Err(PlacementError::InsideCheckpoints { out_dir: out_dir.to_path_buf(), run });
    }
    if !real.is_dir() {
        return Ok(());
    }
    let run = is_run(&real);
    if overwrite {
        // Moved aside whole, its checkpoints and whatever they hold with it: nothing is lost.
        return match run || !holds_anything_but_the_lock(&real) {
            true => Ok(()),
            false => Err(PlacementError::OverwriteNotARun { out_dir: out_dir.to_path_buf() }),
        };
    }
    let files: Vec<String> =
        REPLACED.iter().filter(|f| !run && real.join(f).is_file()).map(|f| f.to_string()).collect();
    if !files.is_empty() {
        return Err(PlacementError::HoldsUsersFiles { out_dir: out_dir.to_path_buf(), files });
    }
    match run_in_checkpoints(&store::root(&real)) {
        Some(run) => Err(PlacementError::HoldsRun { out_dir: out_dir.to_path_buf(), run }),
        None => Ok(()),
    }
}

/// A trainguard run directory: one holding a `config.yaml` trainguard wrote (every start writes
/// it before any other run file: metrics, events, checkpoints, final weights), or at least one
/// checkpoint (`checkpoints/step-NNNNNNNN`: a run whose config.yaml was removed). A checkpoint
/// directory is not one, though it holds the run's config.yaml. `metrics.jsonl` or
/// `events.jsonl` alone do not make one: other tools write files of those names.
pub(super) fn is_run(dir: &Path) -> bool {
    if dir.join(run_files::STATE).exists() {
        return false;
    }
    // A regular file only (a FIFO would block the read), and no larger than trainguard writes.
    let ours = read_string_at_most(&dir.join(run_files::CONFIG), CONFIG_MAX_BYTES)
        .is_ok_and(|text| super::config_file::by_trainguard(&text));
    ours || !store::list(&store::root(dir)).is_empty()
}

/// Whether `dir` holds anything but a lock file (an old run's, or one a refused start left).
pub(super) fn holds_anything_but_the_lock(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .is_ok_and(|mut entries| entries.any(|e| e.is_ok_and(|e| e.file_name() != LOCK_FILE)))
}

/// The run whose checkpoints directory `dir` is, if it is one.
fn run_owning_checkpoints(dir: &Path) -> Option<PathBuf> {
    let run = dir.parent().filter(|_| dir.file_name().is_some_and(|n| n == run_files::CHECKPOINTS))?;
    is_run(run).then(|| run.to_path_buf())
}

/// The first run directory in a checkpoints directory, passing over the run's own temporaries
/// (`.tmp-*`: a checkpoint a killed run left half written or half deleted, its config.yaml still
/// there): `store::clean_temporaries` removes or restores them before anything else is written.
fn run_in_checkpoints(root: &Path) -> Option<PathBuf> {
    subdirs(root).filter(|e| !store::is_temporary(&e.file_name())).find_map(|e| run_at_or_below(&e.path()))
}

/// The first run directory anywhere below `dir`.
fn run_below(dir: &Path) -> Option<PathBuf> {
    subdirs(dir).find_map(|e| run_at_or_below(&e.path()))
}

fn run_at_or_below(path: &Path) -> Option<PathBuf> {
    match is_run(path) {
        true => Some(path.to_path_buf()),
        false => run_below(path),
    }
}

/// The directories in `dir`. Links are not followed: deleting a checkpoint removes a link, not
/// what it points to.
fn subdirs(dir: &Path) -> impl Iterator<Item = std::fs::DirEntry> {
    std::fs::read_dir(dir).into_iter().flatten().flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
}

/// `path` absolute, its existing part with links resolved and `..` applied as the kernel does:
/// where the directory is, or will be created. Its ancestors are then the real ones
/// (`runs/x/../a/checkpoints/b`, or a link into another run's checkpoints, found as such).
fn resolved(path: &Path) -> PathBuf {
    let mut at = std::env::current_dir().unwrap_or_default();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                at.pop();
            }
            other => {
                at.push(other);
                if let Ok(real) = at.canonicalize() {
                    at = real;
                }
            }
        }
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run directory as a start leaves it: its config.yaml, with the header.
    fn make_run(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let text = super::super::config_file::text(&crate::config::Config::default()).unwrap();
        std::fs::write(dir.join(run_files::CONFIG), text).unwrap();
    }

    #[test]
    fn a_run_is_a_directory_with_trainguards_config_or_a_checkpoint_and_nothing_else_is() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        make_run(&run);
        assert!(is_run(&run));
        let users = d.path().join("users");
        std::fs::create_dir(&users).unwrap();
        for f in ["metrics.jsonl", "events.jsonl"] {
            std::fs::write(users.join(f), "{}\n").unwrap();
        }
        std::fs::write(users.join("config.yaml"), "# my sweep\ntrain:\n  lr: 0.1\n").unwrap();
        assert!(!is_run(&users), "the user's files of the same names");
        let step = store::root(&users).join(store::dir_name(2));
        std::fs::create_dir_all(&step).unwrap();
        assert!(is_run(&users), "a checkpoint makes a run");
        std::fs::copy(run.join("config.yaml"), step.join("config.yaml")).unwrap();
        std::fs::write(step.join(store::STATE_FILE), "{}").unwrap();
        assert!(!is_run(&step), "a checkpoint is not a run");
    }

    #[test]
    fn an_out_dir_inside_another_runs_checkpoints_is_refused_naming_both() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        make_run(&a);
        let step = store::root(&a).join(store::dir_name(2));
        std::fs::create_dir_all(&step).unwrap();
        let b = step.join("b");
        for (out_dir, overwrite) in [(b.clone(), false), (b.clone(), true), (store::root(&a), false)] {
            let err = check(&out_dir, overwrite).unwrap_err();
            assert!(matches!(&err, PlacementError::InsideCheckpoints { run, .. } if run == &a), "{err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&out_dir.display().to_string()) && msg.contains(&a.display().to_string()),
                "{msg}"
            );
        }
        // Through `..` and through a link: the real place counts.
        let detour = d.path().join("x/../a/checkpoints/c");
        assert!(matches!(check(&detour, false), Err(PlacementError::InsideCheckpoints { .. })));
        std::os::unix::fs::symlink(&step, d.path().join("link")).unwrap();
        assert!(matches!(
            check(&d.path().join("link/b"), false),
            Err(PlacementError::InsideCheckpoints { .. })
        ));
        // Beside the run, or in a checkpoints directory of no run: accepted.
        assert!(check(&d.path().join("b"), false).is_ok());
        assert!(check(&d.path().join("other/checkpoints/b"), false).is_ok());
        assert!(check(&a, false).is_ok(), "the run itself");
    }

    #[test]
    fn an_out_dir_whose_checkpoints_hold_another_run_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("x/checkpoints/kept/a");
        make_run(&a);
        let x = d.path().join("x");
        let err = check(&x, false).unwrap_err();
        assert!(matches!(&err, PlacementError::HoldsRun { run, .. } if run == &a), "{err}");
        assert!(matches!(check(&x, true), Err(PlacementError::OverwriteNotARun { .. })), "x is no run");
        std::fs::copy(a.join("config.yaml"), x.join("config.yaml")).unwrap();
        assert!(matches!(check(&x, false), Err(PlacementError::HoldsRun { .. })), "x a run too");
        assert!(check(&x, true).is_ok(), "--overwrite moves x aside whole, the run inside with it");
    }

    #[test]
    fn a_checkpoint_a_killed_run_left_half_deleted_is_not_another_run() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        make_run(&run);
        // Killed inside `store::remove`: the state file gone, config.yaml not yet.
        let doomed = store::root(&run).join(format!(".tmp-del-{}", store::dir_name(72)));
        make_run(&doomed);
        assert!(is_run(&doomed), "on its own it reads as a run");
        assert!(check(&run, false).is_ok(), "the run's own leftover, which its start removes");
        assert!(store::clean_temporaries(&store::root(&run)).removed.contains(&doomed));
        // The same directory under a name of the user's: refused.
        make_run(&store::root(&run).join("del-72"));
        assert!(matches!(check(&run, false), Err(PlacementError::HoldsRun { .. })));
    }

    #[test]
    fn overwrite_of_a_directory_that_is_not_a_run_is_refused_unless_empty() {
        let d = tempfile::tempdir().unwrap();
        let home = d.path().join("home");
        std::fs::create_dir_all(home.join(".ssh")).unwrap();
        let err = check(&home, true).unwrap_err();
        assert!(matches!(err, PlacementError::OverwriteNotARun { .. }), "{err}");
        assert!(err.to_string().contains(&home.display().to_string()), "{err}");
        let empty = d.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        std::fs::write(empty.join(LOCK_FILE), "").unwrap();
        assert!(check(&empty, true).is_ok(), "nothing to move");
        let run = d.path().join("run");
        make_run(&run);
        assert!(check(&run, true).is_ok());
    }

    #[test]
    fn a_directory_that_is_not_a_run_holding_files_a_run_replaces_is_refused_naming_them() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("metrics.jsonl"), "{\"step\": 1}\n").unwrap();
        std::fs::write(d.path().join("notes.txt"), "mine").unwrap();
        let err = check(d.path(), false).unwrap_err();
        assert!(
            matches!(&err, PlacementError::HoldsUsersFiles { files, .. } if files == &["metrics.jsonl"]),
            "{err}"
        );
        std::fs::remove_file(d.path().join("metrics.jsonl")).unwrap();
        assert!(check(d.path(), false).is_ok(), "other files: the run goes beside them");
        make_run(d.path());
        std::fs::write(d.path().join("metrics.jsonl"), "{\"step\": 1}\n").unwrap();
        assert!(check(d.path(), false).is_ok(), "a run's own metrics");
    }
}
