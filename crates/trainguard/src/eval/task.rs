//! A multiple-choice task file, read and checked: JSON lines in the layout of HellaSwag's
//! validation file (`ctx`, or `ctx_a` and `ctx_b`; an `endings` list; the index of the right one
//! in `label`, a number or a string of digits as HellaSwag writes it). Other fields are ignored.
//! Reading is bounded (the file and each line); a malformed line is named by file and line. It
//! does not tokenize or score (`score.rs`).
use super::EvalError;
use serde_json::Value;
use std::path::Path;

/// The largest task file read (HellaSwag's validation file is 11 MB).
pub const MAX_TASK_BYTES: u64 = 512 << 20;
/// The longest line taken: one example.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// The most endings one example may have.
pub const MAX_ENDINGS: usize = 64;

/// One multiple-choice example: the context, the candidate endings, the index of the right one.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub context: String,
    pub endings: Vec<String>,
    pub label: usize,
    /// The line of the file it was read from (counted from 1), for messages.
    pub line: usize,
}

/// Reads every example of the file at `path` (blank lines skipped).
pub fn read(path: &Path) -> Result<Vec<Example>, EvalError> {
    let text = crate::fs::whole_file::read_string_at_most(path, MAX_TASK_BYTES)
        .map_err(|e| EvalError::Input(format!("{}: {e}", path.display())))?;
    parse(&text).map_err(|(line, why)| EvalError::Input(format!("{}:{line}: {why}", path.display())))
}

/// The examples of a task file's text; an error is (line, what is wrong).
pub fn parse(text: &str) -> Result<Vec<Example>, (usize, String)> {
    let mut examples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        if line.len() > MAX_LINE_BYTES {
            return Err((n, format!("{} bytes, more than the {MAX_LINE_BYTES} a line may hold", line.len())));
        }
        examples.push(example(line, n).map_err(|why| (n, why))?);
    }
    if examples.is_empty() {
        return Err((
            1,
            "no examples: expected one JSON object per line with `ctx`, `endings` and `label`".into(),
        ));
    }
    Ok(examples)
}

fn example(line: &str, n: usize) -> Result<Example, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
    let o = v.as_object().ok_or("expected a JSON object with `ctx`, `endings` and `label`")?;
    let text = |key: &str| -> Result<Option<&str>, String> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(format!("`{key}` must be a string, got {other}")),
        }
    };
    // HellaSwag's `ctx` is `ctx_a + " " + ctx_b` (without the space when ctx_b is empty).
    let context = match (text("ctx")?, text("ctx_a")?, text("ctx_b")?) {
        (Some(c), _, _) => c.to_string(),
        (None, Some(a), Some("")) | (None, Some(a), None) => a.to_string(),
        (None, Some(a), Some(b)) => format!("{a} {b}"),
        _ => return Err("expected `ctx` (or `ctx_a` and `ctx_b`): the context the endings continue".into()),
    };
    let endings: Vec<String> = match o.get("endings") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|e| {
                e.as_str().map(str::to_string).ok_or_else(|| format!("`endings` must hold strings, got {e}"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("`endings` must be a list of strings, got {other}")),
        None => return Err("expected `endings`: the list of candidate endings".into()),
    };
    if !(2..=MAX_ENDINGS).contains(&endings.len()) {
        return Err(format!("`endings` must hold 2..={MAX_ENDINGS} endings, got {}", endings.len()));
    }
    if let Some(i) = endings.iter().position(|e| e.trim().is_empty()) {
        return Err(format!("`endings`[{i}] is empty: an ending needs text to score"));
    }
    let label = match o.get("label") {
        Some(Value::Number(x)) => x.as_u64().map(|x| x as usize),
        Some(Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    };
    let label = label.filter(|&l| l < endings.len()).ok_or_else(|| {
        format!(
            "`label` must be the index of the right ending, 0..{} (a number or a string of digits), got {}",
            endings.len(),
            o.get("label").map_or("nothing".into(), Value::to_string)
        )
    })?;
    Ok(Example { context, endings, label, line: n })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_hellaswags_layout_and_its_string_labels() {
        let text = concat!(
            r#"{"ind": 24, "ctx_a": "A man is", "ctx_b": "then", "ctx": "A man is then", "endings": ["a", "b", "c", "d"], "label": 3, "split": "val"}"#,
            "\n\n",
            r#"{"ctx_a": "She sits", "ctx_b": "", "endings": ["x", "y"], "label": "1"}"#,
            "\n",
            r#"{"ctx_a": "One", "ctx_b": "two", "endings": ["x", "y"], "label": 0}"#,
            "\n"
        );
        let e = parse(text).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!((e[0].context.as_str(), e[0].label, e[0].line), ("A man is then", 3, 1));
        assert_eq!(e[0].endings, ["a", "b", "c", "d"]);
        assert_eq!((e[1].context.as_str(), e[1].label, e[1].line), ("She sits", 1, 3), "blank lines count");
        assert_eq!(e[2].context, "One two", "ctx_a + ' ' + ctx_b, as HellaSwag's ctx is");
    }

    #[test]
    fn a_malformed_line_is_named_with_what_was_expected() {
        let ok = r#"{"ctx": "c", "endings": ["a", "b"], "label": 0}"#;
        let cases = [
            ("{not json", "not a JSON object"),
            ("[1, 2]", "expected a JSON object"),
            (r#"{"endings": ["a", "b"], "label": 0}"#, "expected `ctx`"),
            (r#"{"ctx": 3, "endings": ["a", "b"], "label": 0}"#, "`ctx` must be a string, got 3"),
            (r#"{"ctx": "c", "label": 0}"#, "expected `endings`"),
            (r#"{"ctx": "c", "endings": "ab", "label": 0}"#, "`endings` must be a list"),
            (r#"{"ctx": "c", "endings": ["a", 1], "label": 0}"#, "`endings` must hold strings, got 1"),
            (r#"{"ctx": "c", "endings": ["a"], "label": 0}"#, "2..=64 endings, got 1"),
            (r#"{"ctx": "c", "endings": ["a", " "], "label": 0}"#, "`endings`[1] is empty"),
            (
                r#"{"ctx": "c", "endings": ["a", "b"], "label": 2}"#,
                "0..2 (a number or a string of digits), got 2",
            ),
            (r#"{"ctx": "c", "endings": ["a", "b"], "label": "x"}"#, "got \"x\""),
            (r#"{"ctx": "c", "endings": ["a", "b"]}"#, "got nothing"),
            (r#"{"ctx": "c", "endings": ["a", "b"], "label": -1}"#, "got -1"),
        ];
        for (bad, expected) in cases {
            let (line, why) = parse(&format!("{ok}\n{bad}\n")).unwrap_err();
            assert_eq!(line, 2, "{bad}");
            assert!(why.contains(expected), "{bad}: {why}");
        }
        assert_eq!(parse("\n \n").unwrap_err().0, 1);
        let long =
            format!(r#"{{"ctx": "{}", "endings": ["a", "b"], "label": 0}}"#, "x".repeat(MAX_LINE_BYTES));
        assert!(parse(&long).unwrap_err().1.contains("more than the"));
    }

    #[test]
    fn the_file_is_named_with_the_line() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("t.jsonl");
        std::fs::write(&f, "{\"ctx\": \"c\", \"endings\": [\"a\", \"b\"], \"label\": 0}\n{}\n").unwrap();
        let e = read(&f).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:2: expected `ctx`", f.display())), "{e}");
        let e = read(&d.path().join("absent.jsonl")).unwrap_err().to_string();
        assert!(e.contains("absent.jsonl"), "{e}");
    }
}
