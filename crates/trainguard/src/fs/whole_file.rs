//! Small files replaced whole: written beside their place under a temporary name, then renamed
//! (or linked) into it. A reader (a job script, a restarted worker, a browser) never sees half
//! of one, and a kill leaves the old file or the new one, never a truncated one. And files read
//! whole, which every reader of a file it did not write opens here ([`open_regular`],
//! [`read_regular`], [`read_at_most`]): a regular file only, and no more of it than its length
//! when opened, or a declared size.
use serde::{de::DeserializeOwned, Serialize};
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// `path` opened for reading, with its length, when it is a regular file. A FIFO would block
/// the read until a writer came, and a device (`/dev/zero`) never ends: each is refused as what
/// it is (`InvalidInput`). The type is that of the file opened, not of the name looked up
/// before: nothing can be swapped in between.
pub fn open_regular(path: &Path) -> io::Result<(File, u64)> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    // O_NONBLOCK: opening a FIFO for reading waits for a writer; with it the open returns and
    // the FIFO is refused. On a regular file the flag changes nothing.
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    let kind = meta.file_type();
    let what = match () {
        _ if kind.is_file() => return Ok((file, meta.len())),
        _ if kind.is_dir() => "a directory",
        _ if kind.is_fifo() => "a FIFO (named pipe)",
        _ if kind.is_char_device() => "a character device",
        _ if kind.is_block_device() => "a block device",
        _ if kind.is_socket() => "a socket",
        _ => "a special file",
    };
    Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{what}, not a regular file")))
}

/// The bytes of the regular file at `path`, as far as it reached when opened (a file still
/// being written, a run's metrics, is read as it was then).
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    let (file, len) = open_regular(path)?;
    read_up_to(file, len, len)
}

/// The bytes of the regular file at `path`, which may hold at most `max` (a size recorded when
/// it was written, or a limit): a longer file is refused (`InvalidInput`), never read to its end.
pub fn read_at_most(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let (file, len) = open_regular(path)?;
    if len > max {
        return Err(too_long(len, max));
    }
    // One byte more than it may hold tells a file that grew since it was opened.
    let bytes = read_up_to(file, len, max.saturating_add(1))?;
    if bytes.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("grew past the {max} bytes it may hold while it was read"),
        ));
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text (`InvalidData` where it is not, as `read_to_string` says).
pub fn read_regular_string(path: &Path) -> io::Result<String> {
    utf8(read_regular(path)?)
}

/// [`read_at_most`] as UTF-8 text.
pub fn read_string_at_most(path: &Path, max: u64) -> io::Result<String> {
    utf8(read_at_most(path, max)?)
}

/// At most `limit` bytes of `file`, `len` expected.
fn read_up_to(file: File, len: u64, limit: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    // A length no memory holds is an error, not an abort.
    bytes.try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX)).map_err(|_| {
        io::Error::new(io::ErrorKind::OutOfMemory, format!("{len} bytes: more than memory holds"))
    })?;
    file.take(limit).read_to_end(&mut bytes)?;
    Ok(bytes)
}

fn too_long(len: u64, max: u64) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{len} bytes, more than the {max} it may hold"))
}

fn utf8(bytes: Vec<u8>) -> io::Result<String> {
    String::from_utf8(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "stream did not contain valid UTF-8"))
}

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
    serde_json::from_str(&read_regular_string(path).ok()?).ok()
}

fn json_line(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("records are plain data and serialise") + "\n"
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

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

    /// A FIFO in `dir` (no writer: opening it for reading would block).
    pub(crate) fn fifo(dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        let made = std::process::Command::new("mkfifo").arg(&path).status().unwrap();
        assert!(made.success());
        path
    }

    #[test]
    fn only_regular_files_are_read_and_each_other_kind_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = fifo(dir.path(), "pipe");
        for (path, what) in [
            (pipe.as_path(), "a FIFO (named pipe), not a regular file"),
            (Path::new("/dev/zero"), "a character device, not a regular file"),
            (dir.path(), "a directory, not a regular file"),
        ] {
            for e in [read_regular(path).unwrap_err(), read_at_most(path, 0).unwrap_err()] {
                assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{}: {e}", path.display());
                assert_eq!(e.to_string(), what);
            }
        }
        assert_eq!(read_regular(&dir.path().join("absent")).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_file_longer_than_its_bound_is_refused_and_one_within_it_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"12345").unwrap();
        assert_eq!(read_at_most(&path, 5).unwrap(), b"12345");
        assert_eq!(read_regular(&path).unwrap(), b"12345");
        let e = read_at_most(&path, 4).unwrap_err();
        assert_eq!(
            (e.kind(), e.to_string()),
            (io::ErrorKind::InvalidInput, "5 bytes, more than the 4 it may hold".into())
        );
        std::fs::write(&path, [0xff]).unwrap();
        assert_eq!(read_regular_string(&path).unwrap_err().kind(), io::ErrorKind::InvalidData);
        // A file written on while it is read (a live run's metrics): as far as it was at the open.
        let (file, len) = open_regular(&path).unwrap();
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"more").unwrap();
        assert_eq!(read_up_to(file, len, len).unwrap(), [0xff]);
        let (file, len) = open_regular(&path).unwrap();
        assert_eq!(read_up_to(file, len, 3).unwrap(), [0xff, b'm', b'o'], "never past its limit");
    }
}
