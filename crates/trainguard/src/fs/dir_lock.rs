//! One writer per output directory: `train`'s rank 0 holds an advisory lock on `out_dir/.lock`
//! for the life of the run, `prepare` on its `--out` until the dataset is published (with its
//! own message for a busy one). Two runs in one directory (a double launch, a requeue while the
//! old job still runs) deleted each other's checkpoints in progress and interleaved their
//! metrics lines. The lock goes with the process, however it ends (`flock`), so a killed run
//! never leaves it behind.
//! Where the filesystem cannot lock (Lustre mounted `noflock`, NFS without its lock daemon) the
//! run goes on with a warning: the lock is a guard, and training must not depend on it.
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = ".lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{} is in use by another trainguard run ({}): wait for it to end, or choose another out_dir. If that process is surely gone (NFS can keep a crashed host's lock), remove {} and start again", .dir.display(), .holder.as_deref().unwrap_or("its pid unknown"), .dir.join(LOCK_FILE).display())]
    Busy { dir: PathBuf, holder: Option<String> },
    #[error("cannot lock {}: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// The lock on a run directory, held until dropped.
#[derive(Debug)]
pub struct RunDirLock(#[allow(dead_code)] File);

impl RunDirLock {
    /// Locks `dir` when it exists (None when it does not: a fresh run locks it once created,
    /// and where the filesystem cannot lock, said once as a warning). Any other failure (the
    /// lock file a directory, no permission) is an error.
    pub fn take(dir: &Path) -> Result<Option<Self>, LockError> {
        if !dir.is_dir() {
            return Ok(None);
        }
        let mut taken = Self::try_take(dir);
        // A lock on a file unlinked meanwhile (a refused start removing the directory it had
        // created) guards nothing: take it again, on the file now at the path.
        for _ in 0..8 {
            match &taken {
                Err(LockError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound && !dir.is_dir() =>
                {
                    return Ok(None)
                }
                Err(LockError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    taken = Self::try_take(dir)
                }
                _ => break,
            }
        }
        match taken {
            Err(LockError::Io { path, source }) if cannot_lock_here(&source) => {
                static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!("cannot lock {} ({source}): this filesystem does not take locks, so nothing stops a second trainguard process from writing into {} at the same time", path.display(), dir.display());
                }
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    fn try_take(dir: &Path) -> Result<Self, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |source| LockError::Io { path: path.clone(), source };
        let mut file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = Some(holder.trim().to_string()).filter(|h| !h.is_empty());
                return Err(LockError::Busy { dir: dir.to_path_buf(), holder });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        use std::os::unix::fs::MetadataExt;
        let (held, named) = (file.metadata().map_err(io)?, std::fs::metadata(&path));
        if !named.is_ok_and(|n| (n.dev(), n.ino()) == (held.dev(), held.ino())) {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the lock file was removed while it was being locked",
            )));
        }
        // Who holds it, for the message a second run gets (the host: out_dir may be shared).
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| write!(file, "pid {} on {host}", std::process::id()))
            .map_err(io)?;
        Ok(Self(file))
    }
}

/// What `flock` answers where the filesystem has no locks: no lock daemon (ENOLCK), a mount
/// without them (EOPNOTSUPP), no such call (ENOSYS).
fn cannot_lock_here(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_is_refused_naming_the_holder_until_the_first_goes() {
        let dir = tempfile::tempdir().unwrap();
        assert!(RunDirLock::take(&dir.path().join("absent")).unwrap().is_none());
        let first = RunDirLock::take(dir.path()).unwrap().expect("the directory exists");
        let err = RunDirLock::take(dir.path()).unwrap_err();
        assert!(
            matches!(&err, LockError::Busy { holder: Some(h), .. } if h.starts_with(&format!("pid {} on ", std::process::id()))),
            "{err}"
        );
        assert!(err.to_string().contains("in use by another trainguard run"), "{err}");
        drop(first);
        assert!(RunDirLock::take(dir.path()).unwrap().is_some());
    }

    #[test]
    fn a_lock_left_by_a_gone_holder_is_ended_by_removing_the_file_the_refusal_names() {
        let dir = tempfile::tempdir().unwrap();
        // Held as a crashed NFS client's lock is: by no process that will let it go.
        let stale = RunDirLock::take(dir.path()).unwrap().expect("the directory exists");
        let err = RunDirLock::take(dir.path()).unwrap_err().to_string();
        let named = dir.path().join(LOCK_FILE);
        assert!(err.contains(&format!("remove {} and start again", named.display())), "{err}");
        std::fs::remove_file(&named).unwrap();
        assert!(RunDirLock::take(dir.path()).unwrap().is_some(), "a new file at the path is a new lock");
        drop(stale);
    }

    #[test]
    fn a_lock_file_that_cannot_be_opened_is_an_error_not_a_filesystem_without_locks() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(LOCK_FILE)).unwrap();
        let err = RunDirLock::take(dir.path()).unwrap_err();
        assert!(matches!(err, LockError::Io { .. }) && err.to_string().contains(".lock"), "{err}");
        assert!(cannot_lock_here(&std::io::Error::from_raw_os_error(libc::ENOLCK)));
    }
}
