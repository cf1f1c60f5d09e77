//! Names that tell several input paths apart, for tables and pages that show them side by side
//! (`trainguard trace --compare`'s columns, `trainguard report`'s runs). Pure: it reads no
//! file system; the callers decide what a path is (a file without its extension, a run
//! directory made canonical).
use std::path::{Component, Path, PathBuf};

/// For each path, the shortest suffix of its components that no other path ends with: each
/// name alone where the names differ (`a.json`, `b.json` → `a`, `b`); `A/trace/steps_1-2` and
/// `B/trace/steps_1-2` → `A/trace/steps_1-2`, `B/trace/steps_1-2` (their last name says nothing
/// about which is which, so neither does `trace/steps_1-2`). A path that every suffix of
/// leaves ambiguous (it ends another: `a/x` beside `b/a/x`, or it is given twice) is named
/// whole, as given.
pub fn shortest_distinct<P: AsRef<Path>>(paths: &[P]) -> Vec<String> {
    // Components as text, last first; `.` adds nothing to tell paths apart, and `..`, the root
    // and a prefix are left in: they are part of what was typed.
    let parts: Vec<Vec<String>> = paths
        .iter()
        .map(|p| {
            p.as_ref()
                .components()
                .rev()
                .filter(|c| !matches!(c, Component::CurDir))
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect()
        })
        .collect();
    parts
        .iter()
        .enumerate()
        .map(|(i, mine)| {
            let taken_by_another = |k: usize| {
                parts
                    .iter()
                    .enumerate()
                    .any(|(j, other)| j != i && other.len() >= k && other[..k] == mine[..k])
            };
            match (1..=mine.len()).find(|&k| !taken_by_another(k)) {
                // Joined as a path: a suffix that starts at the root keeps its one separator.
                Some(k) => mine[..k].iter().rev().collect::<PathBuf>().display().to_string(),
                None => paths[i].as_ref().display().to_string(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(paths: &[&str]) -> Vec<String> {
        shortest_distinct(paths)
    }

    #[test]
    fn distinct_last_names_are_the_names() {
        assert_eq!(names(&["runs/a", "runs/b"]), ["a", "b"]);
        assert_eq!(names(&["x/trace/steps_1-2", "y/profiles/gpt2-compile"]), ["steps_1-2", "gpt2-compile"]);
        assert_eq!(names(&["/work/runs/debug"]), ["debug"], "one path: its last name");
    }

    /// The suffixes are whole components, as long as it takes for each path on its own.
    #[test]
    fn a_shared_last_name_takes_the_components_that_differ() {
        assert_eq!(
            names(&["A/trace/steps_1-2", "B/trace/steps_1-2"]),
            ["A/trace/steps_1-2", "B/trace/steps_1-2"]
        );
        assert_eq!(names(&["/w/A/run", "/w/B/run", "/w/B/other"]), ["A/run", "B/run", "other"]);
        assert_eq!(names(&["./A/run", "B/run"]), ["A/run", "B/run"], "`.` tells nothing apart");
        assert_eq!(names(&["../A/run", "../B/run"]), ["A/run", "B/run"]);
        // The components are compared, not the text: `xa/run` does not end with `a/run`.
        assert_eq!(names(&["xa/run", "a/run"]), ["xa/run", "a/run"]);
    }

    /// No suffix of `a/x` is its own (`b/a/x` ends with it): it is named as given.
    #[test]
    fn a_path_that_ends_another_is_named_whole() {
        assert_eq!(names(&["a/x", "b/a/x"]), ["a/x", "b/a/x"]);
        assert_eq!(names(&["/a/x", "a/x"]), ["/a/x", "a/x"], "the root tells them apart");
        assert_eq!(names(&["a/x", "a/x"]), ["a/x", "a/x"], "the same path twice stays the same");
        assert_eq!(names(&["/", "/"]), ["/", "/"]);
    }
}
