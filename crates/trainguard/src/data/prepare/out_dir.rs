//! `prepare`'s output directory, from the check that it may be written until the dataset is in
//! place: created with its missing parents ([`created_dirs`]), locked (`DIR/.lock`, the
//! helper `train` takes on its out_dir), checked under the lock (no dataset, no shards, no
//! `tokenizer.json` other than `--tokenizer`), the staging directory made, and, when dropped,
//! the staging, the lock file and (unless the dataset was published) the directories it
//! created removed. Two `prepare`s into one directory meet at the lock: the check made only at
//! the start let the one that finished last rename its files over the other's dataset. What
//! is written into the staging directory, and how it is published, is `prepare`'s.
use super::PrepareError;
use crate::data::shards;
use crate::fs::created_dirs::{self, CreateError};
use crate::fs::dir_lock::{LockError, RunDirLock, LOCK_FILE};
use std::path::{Path, PathBuf};

/// The file `prepare` copies `--tokenizer` to, and `dataset.json` names.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
const STAGING_PREFIX: &str = ".prepare-tmp-";

/// The output directory, held (locked) until dropped.
pub struct OutDir {
    path: PathBuf,
    lock: Option<RunDirLock>,
    /// The directories this `prepare` created (`path` and parents of it, outermost first),
    /// removed on drop unless the dataset was published.
    created: Vec<PathBuf>,
    staging: PathBuf,
}

impl OutDir {
    /// Creates `out` if it is new, locks it and checks it may be written, then makes this
    /// process's staging directory in it. `tokenizer`: the `--tokenizer` file, which may stand
    /// in `out` already as its `tokenizer.json` (byte for byte), but no other.
    pub fn hold(out: &Path, tokenizer: &Path) -> Result<Self, PrepareError> {
        let mut tries = 0;
        let (created, lock) = loop {
            let created = created_dirs::create_missing(out).map_err(|e| match e {
                CreateError::NotADirectory { path } => PrepareError::input(
                    &path,
                    None,
                    "exists and is not a directory; give a directory for --out (a new one is created)",
                ),
                CreateError::Io { path, source } => PrepareError::Write { path, source },
            })?;
            let lock = match RunDirLock::take(out) {
                Ok(lock) => lock,
                Err(e) => {
                    created_dirs::remove_created(&created);
                    return Err(match e {
                        LockError::Busy { dir, holder } => PrepareError::Busy { dir, holder },
                        io => PrepareError::Lock(io),
                    });
                }
            };
            // Gone between the two: another prepare into the same new directory failed and
            // removed what it had created. Create it again rather than go on without a lock.
            if lock.is_some() || out.is_dir() || tries == 8 {
                break (created, lock);
            }
            tries += 1;
        };
        let staging = out.join(format!("{STAGING_PREFIX}{}", std::process::id()));
        // From here a failure is undone by drop: the lock file, and what was created, go.
        let held = Self { path: out.to_path_buf(), lock, created, staging };
        check(out, tokenizer)?;
        remove_abandoned_staging(out);
        std::fs::create_dir(&held.staging)
            .map_err(|source| PrepareError::Write { path: held.staging.clone(), source })?;
        Ok(held)
    }

    pub fn staging(&self) -> &Path {
        &self.staging
    }

    /// The dataset is in place: the directory and the parents created for it stay.
    pub fn published(mut self) {
        self.created.clear();
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.staging);
        // Unlinked while still held: a prepare that takes the lock after this one sees the
        // dataset (or the directory as it was), and `RunDirLock` takes a file unlinked under it
        // again. A published dataset is left as its files, without a `.lock`. Where the
        // filesystem takes no locks (no lock held) the file guards nothing, and would keep a
        // directory this prepare created from being removed.
        let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
        drop(self.lock.take());
        created_dirs::remove_created(&self.created);
    }
}

/// Whether `out` may be written: it holds no dataset, no shards, and no `tokenizer.json` but
/// a copy of `tokenizer` (`prepare` writes its own under that name, over whatever is there).
fn check(out: &Path, tokenizer: &Path) -> Result<(), PrepareError> {
    if out.join(shards::MANIFEST_FILE).exists() {
        return Err(PrepareError::input(
            out,
            None,
            "already holds a dataset (dataset.json); choose another --out or remove it",
        ));
    }
    let entries = std::fs::read_dir(out)
        .map_err(|e| PrepareError::input(out, None, &format!("cannot read the directory: {e}")))?;
    if let Some(bin) =
        entries.filter_map(|e| e.ok()).find(|e| e.path().extension().is_some_and(|x| x == "bin"))
    {
        return Err(PrepareError::input(
            out,
            None,
            &format!(
                "already holds token shards ({}); choose another --out",
                bin.file_name().to_string_lossy()
            ),
        ));
    }
    let existing = out.join(TOKENIZER_FILE);
    let theirs = match std::fs::read(&existing) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(PrepareError::input(&existing, None, &format!("is in the way of the tokenizer copy prepare writes there, and cannot be read to compare with --tokenizer ({e}); move it away or choose another --out"))),
    };
    // `--tokenizer` was read a moment ago (it loaded): a failure here is the file changing.
    let ours = std::fs::read(tokenizer)
        .map_err(|e| PrepareError::input(tokenizer, None, &format!("cannot read the tokenizer: {e}")))?;
    if theirs != ours {
        return Err(PrepareError::input(
            &existing,
            None,
            &format!("already exists and differs from --tokenizer {}; prepare writes its copy of the tokenizer under this name and would replace it: move it away, or choose another --out", tokenizer.display()),
        ));
    }
    Ok(())
}

/// Removes the staging directories of earlier `prepare`s into `out` that are no longer
/// running (killed, or a second signal): their pid has no process here, or is this process's
/// own (not made yet: one left by an earlier process given the same pid, as in containers).
/// One still running keeps its (under the lock none is, but for a `prepare` on another host
/// of a shared filesystem without locks).
fn remove_abandoned_staging(out: &Path) {
    let Ok(entries) = std::fs::read_dir(out) else { return };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(STAGING_PREFIX).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!("removing {}, left by a prepare that did not finish", e.path().display());
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_directory_refuses_a_second_prepare_and_a_failed_one_leaves_what_was_there() {
        let d = tempfile::tempdir().unwrap();
        let tok = d.path().join("t.json");
        std::fs::write(&tok, "{}").unwrap();
        let out = d.path().join("new/a/out");
        let held = OutDir::hold(&out, &tok).unwrap();
        assert!(held.staging().is_dir() && out.join(LOCK_FILE).is_file());
        let busy = OutDir::hold(&out, &tok).err().expect("refused");
        assert!(matches!(&busy, PrepareError::Busy { .. }) && super::super::is_usage(&busy), "{busy}");
        assert!(busy.to_string().contains("another prepare is writing this directory"), "{busy}");
        assert!(held.staging().is_dir(), "the refused one left the holder's staging alone");
        drop(held);
        assert!(!d.path().join("new").exists(), "not published: every directory it created goes");
        // Published: the directory stays, with no lock file or staging in it.
        let held = OutDir::hold(&out, &tok).unwrap();
        std::fs::write(out.join("dataset.json"), "{}").unwrap();
        held.published();
        let left: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["dataset.json"]);
        let err = OutDir::hold(&out, &tok).err().expect("refused").to_string();
        assert!(err.contains("already holds a dataset"), "{err}");
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "a refused prepare leaves no lock file");
    }

    #[test]
    fn a_tokenizer_json_in_the_way_is_refused_unless_it_is_the_same_bytes() {
        let d = tempfile::tempdir().unwrap();
        let (tok, out) = (d.path().join("t.json"), d.path().join("out"));
        std::fs::write(&tok, "{\"a\": 1}").unwrap();
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join(TOKENIZER_FILE), "{\"a\": 2}").unwrap();
        let err = OutDir::hold(&out, &tok).err().expect("refused");
        assert!(super::super::is_usage(&err), "{err}");
        let err = err.to_string();
        assert!(
            err.starts_with(&format!(
                "{}: already exists and differs from --tokenizer",
                out.join(TOKENIZER_FILE).display()
            )),
            "{err}"
        );
        assert_eq!(
            std::fs::read_to_string(out.join(TOKENIZER_FILE)).unwrap(),
            "{\"a\": 2}",
            "left as it was"
        );
        std::fs::write(out.join(TOKENIZER_FILE), "{\"a\": 1}").unwrap();
        drop(OutDir::hold(&out, &tok).expect("the same bytes: taken"));
        assert!(out.join(TOKENIZER_FILE).is_file(), "an existing directory keeps its files");
    }
}
