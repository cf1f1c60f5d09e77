//! `--apply`: writes the chosen batch sizes into the config file. The file is edited as text,
//! value by value (`train.micro_batch_size`, and `train.global_batch_size` when a different
//! target was asked for), so comments, key order and every other key survive; it is never
//! re-serialised. The edited text must load as a valid config with the new values before
//! anything is written; the original is then copied next to it (`<file>.bak`, or `.bak.N` when
//! that exists) and the new text replaces it through a rename.
use std::path::{Path, PathBuf};

/// What `--apply` did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Applied {
    pub path: PathBuf,
    /// None when the file already held these values (nothing written).
    pub backup: Option<PathBuf>,
    pub micro_batch: u64,
    pub global_batch: u64,
    pub accumulation: u64,
    pub diff: String,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EditError {
    #[error("`{section}` is written in flow style or as a scalar on one line; --apply edits block mappings only: set {section}.{key} by hand")]
    FlowStyle { section: String, key: String },
}

/// Sets `section.key` to `value` in YAML `text`, keeping everything else byte for byte: the
/// value token on the key's line is replaced (the trailing comment keeps its column when there
/// is room); a missing key is added as the section's first entry; a missing section at the end.
pub fn set_value(text: &str, section: &str, key: &str, value: &str) -> Result<String, EditError> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let eol = if text.contains("\r\n") { "\r\n" } else { "\n" };
    let Some(head) = lines.iter().position(|l| top_level_key(l) == Some(section)) else {
        let mut out = text.to_string();
        if !out.is_empty() && !out.ends_with('\n') {
            out.push_str(eol);
        }
        out.push_str(&format!("{section}:{eol}  {key}: {value}{eol}"));
        return Ok(out);
    };
    let after_colon = strip_comment(&lines[head][section.len()..]).trim_start_matches(':').trim();
    if !after_colon.is_empty() {
        return Err(EditError::FlowStyle { section: section.into(), key: key.into() });
    }
    // The section's block: until the next line that starts at column 0 (comments and blank lines
    // at column 0 do not end it).
    let end = lines[head + 1..]
        .iter()
        .position(|l| indent(l) == 0 && !is_blank_or_comment(l))
        .map_or(lines.len(), |i| head + 1 + i);
    let block = &lines[head + 1..end];
    let child_indent = block.iter().find(|l| !is_blank_or_comment(l)).map_or(2, |l| indent(l));
    let found = block.iter().position(|l| indent(l) == child_indent && key_of(l) == Some(key));
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    match found {
        Some(i) => out[head + 1 + i] = replace_value(block[i], value),
        None => out.insert(head + 1, format!("{}{key}: {value}{eol}", " ".repeat(child_indent))),
    }
    Ok(out.concat())
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

fn is_blank_or_comment(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

/// The part of a line before a ` #` comment (YAML needs whitespace before `#`).
fn strip_comment(s: &str) -> &str {
    let bytes = s.as_bytes();
    (0..bytes.len())
        .find(|&i| bytes[i] == b'#' && (i == 0 || bytes[i - 1] == b' ' || bytes[i - 1] == b'\t'))
        .map_or(s, |i| &s[..i])
}

fn key_of(line: &str) -> Option<&str> {
    let t = line.trim_start();
    let colon = t.find(':')?;
    let k = t[..colon].trim_end();
    (!k.is_empty()
        && !k.starts_with('#')
        && !k.starts_with('-')
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
    .then_some(k)
}

fn top_level_key(line: &str) -> Option<&str> {
    (indent(line) == 0).then(|| key_of(line)).flatten()
}

/// `  key: old   # comment\n` → `  key: new   # comment\n`, the comment at its column if it fits.
fn replace_value(line: &str, value: &str) -> String {
    let body_end = line.trim_end_matches(['\n', '\r']).len();
    let (body, ending) = line.split_at(body_end);
    let colon = body.find(':').expect("key lines have a colon");
    let (head, rest) = body.split_at(colon + 1);
    let lead = rest.len() - rest.trim_start().len();
    let content = strip_comment(rest);
    let old_value = content.trim();
    let comment = &rest[content.len()..];
    let lead = if lead == 0 { " " } else { &rest[..lead] };
    if comment.is_empty() {
        return format!("{head}{lead}{value}{ending}");
    }
    // Whitespace between the old value and the comment, resized to keep the comment's column.
    let gap = content.len() - content.trim_end().len();
    let new_gap = (gap + old_value.len()).saturating_sub(value.len()).max(1);
    format!("{head}{lead}{value}{}{comment}{ending}", " ".repeat(new_gap))
}

/// A line-level diff of `old` → `new` (longest common subsequence; config files are small):
/// `-N: line` / `+N: line` for the lines that changed, N the line number in the old / new text.
pub fn diff(old: &str, new: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    let (n, m) = (a.len(), b.len());
    let mut lcs = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] > lcs[i + 1][j]) {
            out.push_str(&format!("+{}: {}\n", j + 1, b[j]));
            j += 1;
        } else {
            out.push_str(&format!("-{}: {}\n", i + 1, a[i]));
            i += 1;
        }
    }
    out
}

/// The first free backup name next to `path`: `<file>.bak`, then `<file>.bak.1`, ….
pub fn backup_path(path: &Path) -> PathBuf {
    let base = PathBuf::from(format!("{}.bak", path.display()));
    if !base.exists() {
        return base;
    }
    (1..)
        .map(|n| PathBuf::from(format!("{}.bak.{n}", path.display())))
        .find(|p| !p.exists())
        .expect("some name is free")
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "\
# top comment
model:
  n_layer: 2               # blocks
train:
  global_batch_size: 32    # sequences per step
  # micro_batch_size: 2    # a commented-out value stays as it is
  micro_batch_size: 8      # sequences per forward/backward
  lr: 3.0e-3

# trailing comment
oom:
  min_micro_batch: 1
";

    #[test]
    fn replaces_only_the_value_and_keeps_comments_and_columns() {
        let out = set_value(CONFIG, "train", "micro_batch_size", "16").unwrap();
        assert_eq!(diff(CONFIG, &out), "-7:   micro_batch_size: 8      # sequences per forward/backward\n+7:   micro_batch_size: 16     # sequences per forward/backward\n");
        let out = set_value(&out, "train", "micro_batch_size", "1024").unwrap();
        assert!(out.contains("  micro_batch_size: 1024   # sequences per forward/backward\n"), "{out}");
        let long = set_value(CONFIG, "train", "micro_batch_size", "123456789012").unwrap();
        assert!(long.contains("micro_batch_size: 123456789012 # sequences"), "{long}");
        let v: serde_yaml::Value = serde_yaml::from_str(&out).unwrap();
        assert_eq!(v["train"]["micro_batch_size"].as_u64(), Some(1024));
        assert_eq!(v["oom"]["min_micro_batch"].as_u64(), Some(1));
    }

    #[test]
    fn only_the_keys_own_section_is_touched() {
        let text = "oom:\n  micro_batch_size: 3\ntrain:\n  lr: 1\n";
        let out = set_value(text, "train", "micro_batch_size", "4").unwrap();
        assert_eq!(out, "oom:\n  micro_batch_size: 3\ntrain:\n  micro_batch_size: 4\n  lr: 1\n");
    }

    #[test]
    fn missing_keys_and_sections_are_added() {
        let out = set_value("train:\n    lr: 1 # x\n", "train", "micro_batch_size", "4").unwrap();
        assert_eq!(
            out, "train:\n    micro_batch_size: 4\n    lr: 1 # x\n",
            "the section's indentation is kept"
        );
        let out = set_value("seed: 1", "train", "micro_batch_size", "4").unwrap();
        assert_eq!(out, "seed: 1\ntrain:\n  micro_batch_size: 4\n");
        let out =
            set_value("seed: 1\r\ntrain:\r\n  micro_batch_size: 2\r\n", "train", "micro_batch_size", "4")
                .unwrap();
        assert_eq!(out, "seed: 1\r\ntrain:\r\n  micro_batch_size: 4\r\n", "CRLF kept");
    }

    #[test]
    fn flow_style_sections_are_refused_not_mangled() {
        let err = set_value("train: {micro_batch_size: 8}\n", "train", "micro_batch_size", "4").unwrap_err();
        assert!(err.to_string().contains("set train.micro_batch_size by hand"), "{err}");
        // A comment after the section header is fine.
        assert!(set_value("train:   # the loop\n  lr: 1\n", "train", "micro_batch_size", "4").is_ok());
    }

    #[test]
    fn diff_shows_insertions_and_changes_with_line_numbers() {
        assert_eq!(diff("a\nb\nc\n", "a\nB\nc\nd\n"), "-2: b\n+2: B\n+4: d\n");
        assert_eq!(diff("same\n", "same\n"), "");
    }

    #[test]
    fn backups_never_overwrite_an_earlier_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        assert_eq!(backup_path(&p), dir.path().join("c.yaml.bak"));
        std::fs::write(dir.path().join("c.yaml.bak"), "x").unwrap();
        assert_eq!(backup_path(&p), dir.path().join("c.yaml.bak.1"));
    }
}
