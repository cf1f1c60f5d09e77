//! What `prepare` reads: INPUT arguments expanded to files (a file, a directory searched
//! recursively, a glob; sorted, so the output does not depend on the file system's order) and
//! the documents in each file, read line by line so memory does not grow with the file.
//! A `.txt` file holds one document per blank-line-separated block; a `.jsonl` file one
//! document per line, the string under `--text-field`. A JSONL escape of an unpaired UTF-16
//! surrogate (`"\ud800"`, which Python's `json.dumps` writes for a string it could not
//! decode) is not Unicode: it is read as U+FFFD, and the lines that held one are counted in a
//! warning, rather than the whole corpus being refused for one character.
use super::PrepareError;
use std::io::BufRead;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    Jsonl,
}

fn kind_of(path: &Path) -> Option<Kind> {
    match path.extension()?.to_str()? {
        "txt" => Some(Kind::Text),
        "jsonl" => Some(Kind::Jsonl),
        _ => None,
    }
}

/// The input files in the order their tokens are written.
pub fn expand(inputs: &[String]) -> Result<Vec<(PathBuf, Kind)>, PrepareError> {
    let mut out = Vec::new();
    for input in inputs {
        let p = Path::new(input);
        if p.is_dir() {
            let mut found = Vec::new();
            walk(p, &mut found)?;
            found.sort();
            if found.is_empty() {
                return Err(PrepareError::input(p, None, "directory holds no .txt or .jsonl file"));
            }
            out.extend(found.into_iter().filter_map(|f| kind_of(&f).map(|k| (f, k))));
        } else if !p.exists() && input.contains(['*', '?', '[']) {
            let paths =
                glob::glob(input).map_err(|e| PrepareError::input(p, None, &format!("bad glob: {e}")))?;
            let mut found: Vec<PathBuf> = paths.filter_map(Result::ok).filter(|f| f.is_file()).collect();
            found.sort();
            let before = out.len();
            out.extend(found.into_iter().filter_map(|f| kind_of(&f).map(|k| (f, k))));
            if out.len() == before {
                return Err(PrepareError::input(p, None, "no .txt or .jsonl file matches this glob"));
            }
        } else {
            let kind = kind_of(p).ok_or_else(|| {
                PrepareError::input(
                    p,
                    None,
                    "unsupported input: expected a .txt or .jsonl file, a directory or a glob",
                )
            })?;
            std::fs::metadata(p).map_err(|e| PrepareError::input(p, None, &format!("cannot read: {e}")))?;
            out.push((p.to_path_buf(), kind));
        }
    }
    Ok(once_each(out))
}

/// Each file once, where the inputs named it first (a file also under a directory or glob given,
/// or named twice): read twice, its documents would be trained on twice, and with `--val-tokens`
/// could sit in both splits. Each file dropped is named in a warning.
fn once_each(files: Vec<(PathBuf, Kind)>) -> Vec<(PathBuf, Kind)> {
    let mut seen = std::collections::HashSet::new();
    files
        .into_iter()
        .filter(|(f, _)| {
            let first = seen.insert(f.canonicalize().unwrap_or_else(|_| f.clone()));
            if !first {
                tracing::warn!("{}: named again by the inputs; read once", f.display());
            }
            first
        })
        .collect()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), PrepareError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| PrepareError::input(dir, None, &format!("cannot read directory: {e}")))?;
    for e in entries {
        let path =
            e.map_err(|e| PrepareError::input(dir, None, &format!("cannot read directory: {e}")))?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if kind_of(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

/// Streams the documents of one file.
pub struct Documents {
    path: PathBuf,
    kind: Kind,
    field: String,
    reader: Box<dyn BufRead + Send>,
    line: usize,
    buf: Vec<u8>,
    done: bool,
    /// Lines whose unpaired surrogate escapes were read as U+FFFD, and the first: (line, escape).
    lone_surrogates: usize,
    first_lone: Option<(usize, String)>,
}

impl Documents {
    pub fn open(path: &Path, kind: Kind, field: &str) -> Result<Self, PrepareError> {
        let (f, _) = crate::fs::whole_file::open_regular(path)
            .map_err(|e| PrepareError::input(path, None, &format!("cannot read: {e}")))?;
        let reader = Box::new(std::io::BufReader::with_capacity(1 << 20, f));
        Ok(Self {
            path: path.into(),
            kind,
            field: field.into(),
            reader,
            line: 0,
            buf: Vec::new(),
            done: false,
            lone_surrogates: 0,
            first_lone: None,
        })
    }

    /// The next line without its newline, checked to be UTF-8; None at the end.
    fn next_line(&mut self) -> Result<Option<&str>, PrepareError> {
        self.buf.clear();
        let n = self.reader.read_until(b'\n', &mut self.buf).map_err(|e| {
            PrepareError::input(&self.path, Some(self.line + 1), &format!("cannot read: {e}"))
        })?;
        if n == 0 {
            return Ok(None);
        }
        self.line += 1;
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
        }
        match std::str::from_utf8(&self.buf) {
            Ok(s) => Ok(Some(s)),
            Err(e) => Err(PrepareError::input(
                &self.path,
                Some(self.line),
                &format!("invalid UTF-8 at byte {} of the line", e.valid_up_to()),
            )),
        }
    }

    /// The next document, or None at the end of the file.
    pub fn next_doc(&mut self) -> Result<Option<String>, PrepareError> {
        if self.done {
            return Ok(None);
        }
        match self.kind {
            Kind::Jsonl => loop {
                let (path, field) = (self.path.clone(), self.field.clone());
                let line_no = self.line + 1; // the line next_line reads
                let Some(line) = self.next_line()? else {
                    self.done = true;
                    self.warn_lone_surrogates();
                    return Ok(None);
                };
                if line.trim().is_empty() {
                    continue;
                }
                let bad = |m: &str| PrepareError::input(&path, Some(line_no), m);
                // Repaired only when the line does not parse: the common line pays nothing.
                let (v, repaired): (serde_json::Value, _) = match serde_json::from_str(line) {
                    Ok(v) => (v, None),
                    Err(e) => match replace_lone_surrogates(line) {
                        // `\ufffd` is as long as the escape it replaces: a column named is the line's.
                        Some((fixed, first)) => (
                            serde_json::from_str(&fixed).map_err(|e| bad(&format!("not JSON: {e}")))?,
                            Some(first),
                        ),
                        None => return Err(bad(&format!("not JSON: {e}"))),
                    },
                };
                if let Some(first) = repaired {
                    self.lone_surrogates += 1;
                    self.first_lone.get_or_insert((line_no, first));
                }
                return match v.get(&field) {
                    // An empty text is no document (a lone EOS), as a blank .txt block is none.
                    Some(serde_json::Value::String(s)) if s.trim().is_empty() => continue,
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    Some(_) => Err(bad(&format!("field `{field}` is not a string"))),
                    None => Err(bad(&format!("no field `{field}` (set --text-field)"))),
                };
            },
            Kind::Text => {
                let mut doc = String::new();
                loop {
                    match self.next_line()? {
                        None => {
                            self.done = true;
                            break;
                        }
                        Some(l) if l.trim().is_empty() => {
                            if !doc.is_empty() {
                                break;
                            }
                        }
                        Some(l) => {
                            if !doc.is_empty() {
                                doc.push('\n');
                            }
                            doc.push_str(l.strip_suffix('\r').unwrap_or(l));
                        }
                    }
                }
                Ok((!doc.is_empty()).then_some(doc))
            }
        }
    }

    fn warn_lone_surrogates(&self) {
        if let Some((line, escape)) = &self.first_lone {
            tracing::warn!(
                "{}: {} line(s) hold an unpaired UTF-16 surrogate escape, not valid Unicode (the first: `{escape}` at line {line}); each is read as U+FFFD",
                self.path.display(),
                self.lone_surrogates
            );
        }
    }
}

/// `line` with every `\uXXXX` escape of an unpaired UTF-16 surrogate (a leading one not
/// followed by a trailing one's escape, or a trailing one alone) written as `\ufffd`, and the
/// first such escape as it was; None when there is none. A pair stays, and an escaped
/// backslash (`\\ud800` is text) is passed over whole.
fn replace_lone_surrogates(line: &str) -> Option<(String, String)> {
    let bytes = line.as_bytes();
    let escape_at = |i: usize| -> Option<u16> {
        let hex = bytes.get(i..i + 6).filter(|e| e.starts_with(b"\\u"))?;
        u16::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    };
    let (mut out, mut first, mut copied, mut i) = (String::with_capacity(line.len()), None, 0, 0);
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        let Some(unit) = escape_at(i) else {
            i += 2; // another escape, `\\` included
            continue;
        };
        let lone = match unit {
            0xD800..=0xDBFF if escape_at(i + 6).is_some_and(|u| (0xDC00..=0xDFFF).contains(&u)) => {
                i += 12;
                continue;
            }
            0xD800..=0xDFFF => true,
            _ => false,
        };
        if lone {
            out.push_str(&line[copied..i]);
            out.push_str("\\ufffd");
            first.get_or_insert_with(|| line[i..i + 6].to_string());
            copied = i + 6;
        }
        i += 6;
    }
    let first = first?;
    out.push_str(&line[copied..]);
    Some((out, first))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs(path: &Path, kind: Kind) -> Result<Vec<String>, PrepareError> {
        let mut d = Documents::open(path, kind, "text")?;
        let mut out = vec![];
        while let Some(doc) = d.next_doc()? {
            out.push(doc);
        }
        Ok(out)
    }

    #[test]
    fn text_blocks_and_jsonl_lines_are_documents() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("a.txt");
        std::fs::write(&t, "one\nline two\n\n\n  \nsecond\r\n\nthird").unwrap();
        assert_eq!(docs(&t, Kind::Text).unwrap(), ["one\nline two", "second", "third"]);
        let j = dir.path().join("b.jsonl");
        std::fs::write(
            &j,
            "{\"text\": \"x y\"}\n\n{\"text\": \"\"}\n{\"text\": \" \\n\"}\n{\"text\": \"z\", \"id\": 2}\n",
        )
        .unwrap();
        assert_eq!(docs(&j, Kind::Jsonl).unwrap(), ["x y", "z"]);
        std::fs::write(&j, "{\"text\": \"x\"}\n{\"body\": \"z\"}\n").unwrap();
        let e = docs(&j, Kind::Jsonl).unwrap_err().to_string();
        assert!(e.contains("b.jsonl:2") && e.contains("no field `text`"), "{e}");
        std::fs::write(&t, b"ok\n\xff\xfe\n").unwrap();
        let e = docs(&t, Kind::Text).unwrap_err().to_string();
        assert!(e.contains("a.txt:2") && e.contains("invalid UTF-8"), "{e}");
    }

    #[test]
    fn unpaired_surrogate_escapes_are_read_as_the_replacement_character() {
        let fix = |l: &str| replace_lone_surrogates(l);
        assert_eq!(fix(r#"{"text":"a\ud800b"}"#), Some((r#"{"text":"a\ufffdb"}"#.into(), r"\ud800".into())));
        // A trailing one alone, a leading one before another leading one (the second is paired).
        assert_eq!(fix(r#""\uDC00 \ud800\ud83d\ude00""#).unwrap().0, r#""\ufffd \ufffd\ud83d\ude00""#);
        assert_eq!(
            fix(r#""\ud83d\ude00 \u00e9 \\ud800 \n""#),
            None,
            "a pair, a plain escape, an escaped backslash"
        );
        assert_eq!(fix(r#""\ud800""#).unwrap().0, r#""\ufffd""#, "at the end of the string");

        let dir = tempfile::tempdir().unwrap();
        let j = dir.path().join("s.jsonl");
        std::fs::write(&j, "{\"text\": \"ok\"}\n{\"text\": \"a\\ud800b\"}\n{\"text\": \"\\udfff\\u00e9\"}\n")
            .unwrap();
        let mut d = Documents::open(&j, Kind::Jsonl, "text").unwrap();
        let mut got = vec![];
        while let Some(doc) = d.next_doc().unwrap() {
            got.push(doc);
        }
        assert_eq!(got, ["ok", "a\u{fffd}b", "\u{fffd}é"]);
        assert_eq!((d.lone_surrogates, d.first_lone), (2, Some((2, r"\ud800".to_string()))));
        // A line that is bad JSON besides is still refused, at its own column.
        std::fs::write(&j, "{\"text\": \"a\\ud800b\" x}\n").unwrap();
        let e = docs(&j, Kind::Jsonl).unwrap_err().to_string();
        assert!(e.contains("s.jsonl:1: not JSON") && e.contains("column 21"), "{e}");
    }

    #[test]
    fn inputs_expand_sorted_from_dirs_and_globs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for n in ["b.txt", "a.jsonl", "sub/c.txt", "skip.md"] {
            std::fs::write(dir.path().join(n), "x").unwrap();
        }
        let all = expand(&[dir.path().display().to_string()]).unwrap();
        let names: Vec<_> =
            all.iter().map(|(p, _)| p.strip_prefix(dir.path()).unwrap().display().to_string()).collect();
        assert_eq!(names, ["a.jsonl", "b.txt", "sub/c.txt"]);
        assert_eq!(expand(&[format!("{}/*.txt", dir.path().display())]).unwrap().len(), 1);
        assert!(expand(&[dir.path().join("skip.md").display().to_string()]).is_err());
        assert!(expand(&[dir.path().join("missing.txt").display().to_string()]).is_err());
        // Named by the directory, a glob, itself and another spelling: read once, where first named.
        let b = dir.path().join("b.txt").display().to_string();
        let twice = expand(&[
            b.clone(),
            dir.path().display().to_string(),
            format!("{}/*.txt", dir.path().display()),
            format!("{}/sub/../b.txt", dir.path().display()),
        ])
        .unwrap();
        let names: Vec<_> =
            twice.iter().map(|(p, _)| p.strip_prefix(dir.path()).unwrap().display().to_string()).collect();
        assert_eq!(names, ["b.txt", "a.jsonl", "sub/c.txt"]);
    }
}
