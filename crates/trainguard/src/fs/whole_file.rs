//! Small files replaced whole: written beside their place under a temporary name, then renamed
//! (or linked) into it. A reader (a job script, a restarted worker, a browser) never sees half
//! of one, and a kill leaves the old file or the new one, never a truncated one.
use serde::{de::DeserializeOwned, Serialize};
use std::io;
use std::path::{Path, PathBuf};

/// Beside `path`, hidden; `own`: with this process's id in it.
fn temporary(path: &Path, own: bool) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let pid = if own { format!(".{}", std::process::id()) } else { String::new() };
    path.with_file_name(format!(".{name}{pid}.tmp"))
}

/// `bytes` written at `path`, over whatever was there. For files of one writer (rank 0 in its
/// locked run directory): the temporary name is always the same, so one a kill left is
/// overwritten the next time, not left to pile up.
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temporary(path, false);
    let done = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp); // nothing half-done is left beside it
    }
    done
}

/// `bytes` written at `path` unless a file is there: the first writer's stays. False when one was.
/// Several processes may race (a node's workers): each writes under a name of its own.
pub fn create_once(path: &Path, bytes: &[u8]) -> io::Result<bool> {
    let tmp = temporary(path, true);
    std::fs::write(&tmp, bytes).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    // A link, unlike a rename, fails where the name exists.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// `value` as one JSON line, replacing the file at `path`.
pub fn replace_json(path: &Path, value: &impl Serialize) -> io::Result<()> {
    replace(path, json_line(value).as_bytes())
}

/// `value` as one JSON line at `path` unless a file is there (see [`create_once`]).
pub fn create_json_once(path: &Path, value: &impl Serialize) -> io::Result<bool> {
    create_once(path, json_line(value).as_bytes())
}

/// The record at `path`; None when it is absent or is not one (a record is a hint, never
/// something to fail on).
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Option<T> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

fn json_line(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("records are plain data and serialise") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn a_replaced_file_is_the_new_one_and_nothing_is_left_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stop.json");
        replace_json(&path, &serde_json::json!({"n": 1})).unwrap();
        replace_json(&path, &serde_json::json!({"n": 2})).unwrap();
        assert_eq!(read_json::<serde_json::Value>(&path).unwrap()["n"], 2);
        assert!(leftovers(dir.path()).is_empty(), "{:?}", leftovers(dir.path()));
    }

    #[test]
    fn the_first_record_created_once_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("failed.json");
        assert!(create_json_once(&path, &"first").unwrap());
        assert!(!create_json_once(&path, &"second").unwrap());
        assert_eq!(read_json::<String>(&path).as_deref(), Some("first"));
        assert!(leftovers(dir.path()).is_empty(), "{:?}", leftovers(dir.path()));
    }

    #[test]
    fn a_write_that_fails_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("record.json");
        replace(&path, b"old").unwrap();
        // The temporary name taken by a directory: the write fails, the old file stays.
        let tmp = temporary(&path, false);
        std::fs::create_dir(&tmp).unwrap();
        assert!(replace(&path, b"new").is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        std::fs::remove_dir(&tmp).unwrap();
        // A non-empty directory where the file goes: the rename fails, its temporary goes.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"").unwrap();
        assert!(replace(&blocked, b"new").is_err());
        assert!(blocked.join("x").exists());
        assert!(leftovers(dir.path()).is_empty(), "{:?}", leftovers(dir.path()));
        assert!(read_json::<String>(&dir.path().join("absent.json")).is_none());
    }
}
