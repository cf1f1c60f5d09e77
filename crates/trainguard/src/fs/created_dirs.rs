//! An output directory made with whichever of its parents are missing, and undone: a command
//! that fails (`train` refused at its start, `prepare` given inputs of no tokens) removes the
//! directories it created on the way, and only those, so a typo'd `--out new/x/y` leaves
//! nothing. What goes into the directory, and its lock, are the command's own.
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// A part of the path is a file or a dangling link: the user's path is wrong.
    #[error("{} exists and is not a directory", .path.display())]
    NotADirectory { path: PathBuf },
    #[error("cannot create {}: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// Creates `dir` and whichever of its parents are missing, one at a time (so that a path with
/// `..` in it is undone as it was made): the directories this call created, outermost first.
/// One another process created meanwhile is not this call's. On an error, what this call had
/// created is removed again.
pub fn create_missing(dir: &Path) -> Result<Vec<PathBuf>, CreateError> {
    let mut created = Vec::new();
    let mut at = PathBuf::new();
    for part in dir.components() {
        at.push(part);
        if at.is_dir() {
            continue;
        }
        let failed = match std::fs::create_dir(&at) {
            Ok(()) => {
                created.push(at.clone());
                continue;
            }
            Err(_) if at.is_dir() => continue, // another process created it meanwhile
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                CreateError::NotADirectory { path: at }
            }
            Err(source) => CreateError::Io { path: at, source },
        };
        remove_created(&created);
        return Err(failed);
    }
    Ok(created)
}

/// Removes what [`create_missing`] created, innermost first, up to the first that is not empty
/// (something else was put there: it and its parents stay).
pub fn remove_created(created: &[PathBuf]) {
    for dir in created.iter().rev() {
        if std::fs::remove_dir(dir).is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_directories_created_are_listed_and_removed_while_empty() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("there")).unwrap();
        let created = create_missing(&d.path().join("there/a/b")).unwrap();
        assert_eq!(created, [d.path().join("there/a"), d.path().join("there/a/b")]);
        std::fs::write(d.path().join("there/a/kept.txt"), "x").unwrap();
        remove_created(&created);
        assert!(
            !d.path().join("there/a/b").exists() && d.path().join("there/a/kept.txt").is_file(),
            "a directory holding something stays"
        );
        std::fs::remove_file(d.path().join("there/a/kept.txt")).unwrap();
        let created = create_missing(&d.path().join("there/a/b")).unwrap();
        assert_eq!(created, [d.path().join("there/a/b")], "`a` was there this time");
        let created = [d.path().join("there/a"), created[0].clone()];
        remove_created(&created);
        assert!(
            !d.path().join("there/a").exists() && d.path().join("there").is_dir(),
            "one that was there stays"
        );
        std::fs::write(d.path().join("file"), "x").unwrap();
        let err = create_missing(&d.path().join("new/../file/sub")).unwrap_err();
        assert!(matches!(&err, CreateError::NotADirectory { path } if path.ends_with("file")), "{err}");
        assert!(!d.path().join("new").exists(), "what the failed call created is removed");
    }
}
