//! Rank 0's run directory as a run starts. Before anything in it is read: the directory checked
//! for what it holds ([`placement`](super::placement)), the old run moved aside
//! (`--overwrite`), the directory created when new and locked (one run per out_dir,
//! [`dir_lock`](crate::fs::dir_lock)). A directory or lock file this start created goes again
//! if the start is then refused: a refused command leaves nothing behind.
//! Once the ranks agree to start and the model is built (a resumed state restored into it):
//! an earlier run's stop record goes, the resolved config, the log file and (under torchrun)
//! the job that started the run are written. At the end, still held: the record of how the run
//! ended.
use super::config_file;
use super::TrainError;
use crate::checkpoint::fresh;
use crate::fs::created_dirs::{self, remove_created};
use crate::fs::dir_lock::{RunDirLock, LOCK_FILE};
use crate::fs::run_files;
use crate::fs::whole_file;
use crate::job::{deadline, stop_record};
use std::path::{Path, PathBuf};

/// The run directory, held from before the start is resolved until the run ends.
pub(super) struct RunDir {
    path: PathBuf,
    _lock: Option<RunDirLock>,
    /// The directories this start created (`path` and parents of it, outermost first), while
    /// not yet prepared: removed on drop, innermost first.
    provisional: Vec<PathBuf>,
    /// The lock file is this start's, while not yet prepared: removed on drop.
    provisional_lock: bool,
}

impl RunDir {
    /// Moves the old run aside when `overwrite` says so, then creates `dir` if it is new and
    /// locks it. Two runs launched at once into a new out_dir meet at the lock, and the one
    /// refused leaves the other's directory alone.
    pub(super) fn hold(dir: &Path, overwrite: bool) -> Result<Self, TrainError> {
        // `create_missing` refuses this too, but `--overwrite` first takes the old run's lock
        // inside it, which would fail on a file with an I/O error instead of this one.
        if dir.exists() && !dir.is_dir() {
            return Err(TrainError::OutDirNotADirectory { path: dir.to_path_buf() });
        }
        super::placement::check(dir, overwrite)?;
        let lock_was_there = dir.join(LOCK_FILE).exists();
        if overwrite {
            move_old_run_aside(dir)?;
        }
        let mut tries = 0;
        let (created, lock) = loop {
            let created = create_missing(dir)?;
            let lock = RunDirLock::take(dir)?;
            // Gone between the two: another start into the same new directory, refused, removed
            // what it had created. Create it again rather than run without a lock.
            if lock.is_some() || dir.is_dir() || tries == 8 {
                break (created, lock);
            }
            tries += 1;
        };
        let provisional_lock = !lock_was_there || !created.is_empty();
        Ok(Self { path: dir.to_path_buf(), _lock: lock, provisional: created, provisional_lock })
    }

    /// The ranks agreed to start and the model is built: from here the directory is this run's. An earlier run's stop
    /// record goes (a crash from here must leave none; a command refused before leaves the run
    /// it was refused over as it was).
    pub(super) fn prepare(&mut self, config: &crate::config::Config) -> Result<(), TrainError> {
        let dir = &self.path;
        let io = |source| TrainError::RunDir { path: dir.clone(), source };
        // The file, where the run directory holds something else under its name.
        let of = |file: &Path, source| TrainError::RunDirFile { file: file.to_path_buf(), source };
        stop_record::clear(dir).map_err(io)?;
        let yaml = config_file::text(config).map_err(|e| io(std::io::Error::other(e)))?;
        let (config_file, log_file) = (dir.join(run_files::CONFIG), dir.join(run_files::LOG));
        crate::console::logging::also_to_file(&log_file).map_err(|e| of(&log_file, e))?;
        if let Some(kept) = keep_a_written_config(&config_file).map_err(|e| of(&config_file, e))? {
            tracing::warn!("{} was not as trainguard writes it (written or edited by hand; --config may have named it): kept as {}", config_file.display(), kept.display());
        }
        // Whole: `sample` and `report` read it, and a truncated one still parses (defaults).
        whole_file::replace(&config_file, yaml.as_bytes()).map_err(|e| of(&config_file, e))?;
        self.provisional.clear();
        self.provisional_lock = false;
        Ok(())
    }

    /// Under torchrun: marks the run as this job's, which its restarts resume whatever the
    /// command asked. Once the run left the old line (checkpoints past the step it resumed set
    /// aside): a restart before then meets the directory as the first attempt did.
    pub(super) fn mark_job(&self) -> Result<(), TrainError> {
        if let Some(attempt) = crate::job::attempts::Attempt::from_env(|k| std::env::var(k).ok()) {
            let file = self.path.join(crate::job::attempts::JOB_FILE);
            crate::job::attempts::record_job(&self.path, &attempt.run_id)
                .map_err(|source| TrainError::RunDirFile { file, source })?;
        }
        Ok(())
    }

    /// `stop.json` for a run that finished or stopped as planned (resumable); none for a failure.
    pub(super) fn record_end(&self, ended: &Result<crate::events::RunSummary, TrainError>) {
        let record = match ended {
            Ok(summary) => stop_record::StopRecord::finished(summary.steps),
            Err(TrainError::Interrupted { step, reason, checkpoint }) => {
                stop_record::StopRecord::stopped(*step, reason.as_str(), checkpoint.as_deref())
            }
            Err(_) => return,
        };
        if let Err(e) = stop_record::write(&self.path, &record) {
            tracing::warn!("cannot write the stop record {}: {e}", stop_record::path(&self.path).display());
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // Only what this start put there; a directory that holds more stays. The lock file
        // goes while still locked: a start waiting on it retries on a new one (`RunDirLock`).
        if self.provisional_lock {
            let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
        }
        remove_created(&self.provisional);
    }
}

/// A `config.yaml` in the run directory that trainguard did not write as it stands is renamed
/// `config.kept-<unix time>.yaml` before the run writes its own: comments and layout are what
/// the resolved config loses. Trainguard's own begins with [`config_file::header`]: this version's
/// is then as this version writes the config it reads as, another version's is YAML without
/// another comment. One written before the header is trainguard's when its text is as this
/// version writes the config it reads as.
fn keep_a_written_config(file: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::io::ErrorKind;
    let text = match whole_file::read_string_at_most(file, crate::config::limits::MAX_CONFIG_BYTES) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) if e.kind() == ErrorKind::InvalidData => String::new(), // not UTF-8: not ours
        // A regular file longer than any config loads: not ours either. A directory is refused as
        // the OS says it (a FIFO, a device, … as what it is).
        Err(e) if e.kind() == ErrorKind::InvalidInput => match file.metadata() {
            Ok(m) if m.is_file() => String::new(),
            Ok(m) if m.is_dir() => return Err(std::io::Error::from_raw_os_error(libc::EISDIR)),
            _ => return Err(e),
        },
        Err(e) => return Err(e),
    };
    let (first, body) = text.split_once('\n').unwrap_or((&text, ""));
    let ours = match config_file::header_version(first) {
        Some(env!("CARGO_PKG_VERSION")) => config_file::as_written(body),
        Some(_) => {
            !body.lines().any(|l| l.trim_start().starts_with('#'))
                && serde_yaml::from_str::<serde_yaml::Value>(body).is_ok()
        }
        None => config_file::as_written(&text),
    };
    if ours {
        return Ok(None);
    }
    let dir = file.parent().unwrap_or(Path::new("."));
    let kept = crate::checkpoint::store::free_path(
        format!("{}/config.kept-{}.yaml", dir.display(), deadline::now_unix_s() as u64),
        |p| p.exists(),
    );
    std::fs::rename(file, &kept)?;
    Ok(Some(kept))
}

/// Creates `dir` and whichever of its parents are missing ([`created_dirs`]): the directories
/// created, outermost first. A part of the path that is a file or a dangling link is the user's
/// out_dir mistake (exit 2).
fn create_missing(dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    created_dirs::create_missing(dir).map_err(|e| match e {
        created_dirs::CreateError::NotADirectory { path } => TrainError::OutDirNotADirectory { path },
        created_dirs::CreateError::Io { path, source } => TrainError::RunDir { path, source },
    })
}

/// `--overwrite`: the old run's directory (a run: [`placement`](super::placement)) goes to
/// `OUT_DIR.old-<unix time>`, never deleted; not from under a run that is still writing there.
/// Refused, it leaves no lock file it created.
fn move_old_run_aside(out_dir: &Path) -> Result<(), TrainError> {
    let lock_was_there = out_dir.join(LOCK_FILE).exists();
    // Decided under the lock: another `--overwrite` launched at once may have moved it already.
    let live = RunDirLock::take(out_dir)?;
    let moved = move_held_run_aside(out_dir);
    if moved.is_err() && !lock_was_there {
        let _ = std::fs::remove_file(out_dir.join(LOCK_FILE)); // still held: see `RunDir`'s drop
    }
    drop(live);
    moved
}

/// [`move_old_run_aside`] under its lock.
fn move_held_run_aside(out_dir: &Path) -> Result<(), TrainError> {
    // Whatever an old run left, checkpoints or not (a benchmark's metrics, a run killed before
    // its first checkpoint): only the lock just taken is not one.
    if !super::placement::holds_anything_but_the_lock(out_dir) {
        return Ok(());
    }
    // By its real path: `runs/x/` or `.` would otherwise name the aside path inside itself.
    // The last component kept as written (a symlink is moved, not its target).
    let io = |source| TrainError::RunDir { path: out_dir.to_path_buf(), source };
    let trimmed: PathBuf = out_dir.components().collect();
    let real = match (trimmed.parent(), trimmed.file_name()) {
        (Some(parent), Some(name)) if !parent.as_os_str().is_empty() => {
            parent.canonicalize().map_err(io)?.join(name)
        }
        (_, Some(name)) => std::env::current_dir().and_then(|d| d.canonicalize()).map_err(io)?.join(name),
        _ => trimmed.canonicalize().map_err(io)?, // `.`, `..`
    };
    if std::env::current_dir().and_then(|d| d.canonicalize()).is_ok_and(|cwd| cwd.starts_with(&real)) {
        // Moved, the directory would stay this process's current one: the new run would write into the old.
        return Err(TrainError::OverwriteHoldsCwd { path: out_dir.to_path_buf() });
    }
    let aside = fresh::aside_path(&real, deadline::now_unix_s() as u64, |p| p.exists());
    std::fs::rename(&real, &aside).map_err(|e| TrainError::RunDir {
        path: out_dir.to_path_buf(),
        source: std::io::Error::new(e.kind(), format!("cannot move it aside to {}: {e}", aside.display())),
    })?;
    tracing::warn!("--overwrite: moved the old run {} to {}", out_dir.display(), aside.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_this_start_created_goes_if_the_start_is_refused_and_stays_once_prepared() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("run");
        drop(RunDir::hold(&dir, false).unwrap());
        assert!(!dir.exists(), "refused before prepare: removed");
        let nested = parent.path().join("a/b/run");
        std::fs::create_dir(parent.path().join("a")).unwrap();
        drop(RunDir::hold(&nested, false).unwrap());
        assert!(!parent.path().join("a/b").exists(), "the parents it created go too");
        assert!(parent.path().join("a").is_dir(), "a parent that was there stays");
        // Through `..`: x/y/../z is x/z; x and x/y are created on the way, and go again.
        drop(RunDir::hold(&parent.path().join("x/y/../z/"), false).unwrap());
        assert!(!parent.path().join("x").exists(), "the path's detour is undone too");
        let mut held = RunDir::hold(&dir, false).unwrap();
        let busy = RunDir::hold(&dir, false).err().unwrap();
        assert!(matches!(busy, TrainError::Lock(crate::fs::dir_lock::LockError::Busy { .. })), "{busy}");
        assert!(dir.join(LOCK_FILE).is_file(), "the refused one left the holder's lock alone");
        held.prepare(&crate::config::Config::default()).unwrap();
        drop(held);
        assert!(dir.join("config.yaml").is_file());
        // An existing directory is never removed, prepared or not.
        drop(RunDir::hold(&dir, false).unwrap());
        assert!(dir.join("config.yaml").is_file());
    }

    #[test]
    fn a_config_yaml_trainguard_did_not_write_as_it_stands_is_kept() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("config.yaml");
        assert_eq!(keep_a_written_config(&file).unwrap(), None, "none there");
        let ours = serde_yaml::to_string(&crate::config::Config::default()).unwrap();
        std::fs::write(&file, &ours).unwrap();
        assert_eq!(
            keep_a_written_config(&file).unwrap(),
            None,
            "as trainguard wrote it before the header: replaced"
        );
        let mut held = RunDir::hold(d.path(), false).unwrap();
        held.prepare(&crate::config::Config::default()).unwrap();
        let written = std::fs::read_to_string(&file).unwrap();
        assert!(
            written.starts_with(&format!("{}\n", config_file::header(env!("CARGO_PKG_VERSION")))),
            "{written}"
        );
        assert_eq!(crate::config::saved(&written).unwrap(), crate::config::Config::default());
        // Another version's: a key added since (absent), one retired since (present).
        let other_version = written
            .replacen(env!("CARGO_PKG_VERSION"), "0.0.1", 1)
            .replace("  fused_gelu: false\n", "")
            .replace("kernels:\n", "kernels:\n  loss_blocks_per_sm: 2\n");
        assert!(
            !other_version.contains("fused_gelu") && other_version.contains("loss_blocks_per_sm: 2"),
            "{other_version}"
        );
        std::fs::write(&file, &other_version).unwrap();
        assert_eq!(keep_a_written_config(&file).unwrap(), None, "another version's: replaced, not kept");
        // A newer version's, with a key this one does not know: still trainguard's.
        std::fs::write(&file, other_version.replacen("0.0.1", "99.0.0", 1) + "future:\n  key: 1\n").unwrap();
        assert_eq!(keep_a_written_config(&file).unwrap(), None, "a newer version's: replaced, not kept");
        // Hand-written: with a comment; this version's edited by hand; a header of one's own.
        let commented = written.replace("train:\n", "train:\n  # lr sweep, run 3\n");
        let edited = written.replace("  max_steps: 200\n", "  max_steps:  500\n");
        assert_ne!(edited, written);
        let own_header = "# trainguard sweep 3\ntrain:\n  lr: 0.001\n";
        for theirs in [
            "# lr sweep, run 3\ntrain:\n  lr: 3.0e-4\n".as_bytes(),
            &ours.as_bytes()[..ours.len() / 2],
            b"\xff\xfe",
            commented.as_bytes(),
            edited.as_bytes(),
            own_header.as_bytes(),
        ] {
            std::fs::write(&file, theirs).unwrap();
            let kept = keep_a_written_config(&file).unwrap().expect("kept");
            assert!(kept.file_name().unwrap().to_string_lossy().starts_with("config.kept-"), "{kept:?}");
            assert_eq!(std::fs::read(&kept).unwrap(), theirs);
            assert!(!file.exists());
        }
    }

    #[test]
    fn an_out_dir_that_is_a_file_is_refused_and_left_as_it_is() {
        let parent = tempfile::tempdir().unwrap();
        let file = parent.path().join("run");
        std::fs::write(&file, "notes").unwrap();
        for overwrite in [false, true] {
            let err = RunDir::hold(&file, overwrite).err().unwrap();
            assert!(matches!(err, TrainError::OutDirNotADirectory { .. }), "{err}");
            assert_eq!(std::fs::read_to_string(&file).unwrap(), "notes");
        }
        // A file on the way, or a dangling link: the same refusal, naming it.
        std::os::unix::fs::symlink(parent.path().join("nowhere"), parent.path().join("link")).unwrap();
        for (out_dir, named) in [("run/sub", "run"), ("link", "link"), ("link/sub", "link")] {
            let err = RunDir::hold(&parent.path().join(out_dir), false).err().unwrap();
            assert!(
                matches!(&err, TrainError::OutDirNotADirectory { path } if path == &parent.path().join(named)),
                "{out_dir}: {err}"
            );
        }
        // Directories created on the way to the file go again (`m`, through `m/..`).
        let err = RunDir::hold(&parent.path().join("m/../run/sub"), false).err().unwrap();
        assert!(matches!(err, TrainError::OutDirNotADirectory { .. }), "{err}");
        assert!(!parent.path().join("m").exists(), "what the refused start created is gone");
    }
}
