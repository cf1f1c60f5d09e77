//! Reading a run directory leniently: `metrics.jsonl`, `events.jsonl`, `config.yaml` and the
//! memory summary table of `train.log`, as they are now (a run still writing, a resumed run, a
//! run killed mid-line, files of older versions). Lines are read as `serde_json::Value`, so a
//! missing or new field never fails the whole file; what cannot be read is recorded in
//! [`RunData::skipped`] with its file and line, never a panic.
use super::ReportError;
use crate::fs::run_files::{CONFIG, EVENTS, LOG, METRICS};
use crate::fs::whole_file;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One line left out, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Skipped {
    pub file: String,
    pub line: usize,
    pub reason: String,
}

#[derive(Debug, Clone, Default)]
pub struct RunData {
    pub dir: PathBuf,
    /// What the page calls the run ([`run_names`]).
    pub name: String,
    /// metrics.jsonl lines by step; a later line for the same step replaces an earlier one
    /// (a resumed run recomputes the steps after its checkpoint).
    pub steps: BTreeMap<u64, serde_json::Map<String, Value>>,
    /// events.jsonl lines in file order (identical repeats, from a replay after resume, dropped).
    pub events: Vec<Value>,
    pub config: Option<serde_yaml::Value>,
    /// The last `memory summary` table logged in train.log.
    pub memory_table: Option<String>,
    pub skipped: Vec<Skipped>,
}

impl RunData {
    /// A numeric field of the metrics lines as (step, elapsed_s, value), null and missing left out.
    pub fn series(&self, key: &str) -> Vec<(u64, f64, f64)> {
        self.steps
            .iter()
            .filter_map(|(&step, m)| {
                let v = m.get(key)?.as_f64()?;
                Some((step, self.elapsed_at(step, m), v))
            })
            .collect()
    }

    fn elapsed_at(&self, step: u64, m: &serde_json::Map<String, Value>) -> f64 {
        m.get("elapsed_s").and_then(Value::as_f64).unwrap_or(step as f64)
    }

    /// Wall time (elapsed_s) at an event's step: that of the last metrics line at or before it.
    pub fn wall_at(&self, step: u64) -> f64 {
        match self.steps.range(..=step).next_back().or_else(|| self.steps.iter().next()) {
            Some((&s, m)) => self.elapsed_at(s, m),
            None => 0.0,
        }
    }

    pub fn events_of<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.events.iter().filter(move |e| e["event"] == kind)
    }

    /// The last event of this kind.
    pub fn last_event(&self, kind: &str) -> Option<&Value> {
        self.events.iter().rfind(|e| e["event"] == kind)
    }

    /// A config value by dotted path (`train.micro_batch_size`).
    pub fn config_value(&self, path: &str) -> Option<&serde_yaml::Value> {
        path.split('.').try_fold(self.config.as_ref()?, |v, k| v.get(k))
    }
}

/// Reads `dir`. Not a directory, or a directory with none of `metrics.jsonl`, `events.jsonl`,
/// `config.yaml`: [`ReportError::NotARun`]. Anything else is read as far as it goes.
pub fn read_run(dir: &Path) -> Result<RunData, ReportError> {
    if !dir.is_dir() {
        let why = if dir.exists() { "a file, not a run directory" } else { "no such directory" };
        return Err(ReportError::NotARun { dir: dir.into(), why: why.into() });
    }
    let has = |f: &str| dir.join(f).is_file();
    if !has(METRICS) && !has(EVENTS) && !has(CONFIG) {
        return Err(ReportError::NotARun {
            dir: dir.into(),
            why: "it has no metrics.jsonl, events.jsonl or config.yaml (trainguard writes them to out_dir)"
                .into(),
        });
    }
    let name = run_names(&[dir]).remove(0);
    let mut run = RunData { dir: dir.into(), name, ..Default::default() };

    for (line, v) in jsonl(dir, METRICS, &mut run.skipped)? {
        match (v.get("step").and_then(Value::as_u64), v) {
            (Some(step), Value::Object(m)) => {
                run.steps.insert(step, m);
            }
            _ => run.skipped.push(Skipped {
                file: METRICS.into(),
                line,
                reason: "no numeric \"step\" field".into(),
            }),
        }
    }
    for (line, v) in jsonl(dir, EVENTS, &mut run.skipped)? {
        if v.get("event").and_then(Value::as_str).is_none() {
            run.skipped.push(Skipped { file: EVENTS.into(), line, reason: "no \"event\" field".into() });
        } else if !run.events.contains(&v) {
            run.events.push(v);
        }
    }
    let config = whole_file::read_string_at_most(&dir.join(CONFIG), crate::config::limits::MAX_CONFIG_BYTES);
    match config {
        Ok(text) => match crate::config::yaml_tree(&text) {
            Ok(v) => run.config = Some(v),
            Err(e) => run.skipped.push(Skipped {
                file: CONFIG.into(),
                line: e.location().map_or(0, |l| l.line()),
                reason: format!("not YAML: {e}"),
            }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(ReportError::Read { path: dir.join(CONFIG), source }),
    }
    let order = |f: &str| [METRICS, EVENTS, CONFIG].iter().position(|n| *n == f);
    run.skipped.sort_by_key(|s| (order(&s.file), s.line));
    run.memory_table = whole_file::read_regular(&dir.join(LOG))
        .ok()
        .and_then(|b| last_memory_table(&String::from_utf8_lossy(&b)));
    Ok(run)
}

/// What the page calls each of the runs in `dirs`: the directory's own name (that of `.` too),
/// with as many of its parents as tell it apart from the others' (`A/run`, `B/run`).
pub fn run_names(dirs: &[&Path]) -> Vec<String> {
    let canonical: Vec<PathBuf> =
        dirs.iter().map(|d| d.canonicalize().unwrap_or_else(|_| d.to_path_buf())).collect();
    crate::console::path_names::shortest_distinct(&canonical)
}

/// The parsed lines of a JSONL file with their 1-based numbers; a missing file is empty.
fn jsonl(dir: &Path, file: &str, skipped: &mut Vec<Skipped>) -> Result<Vec<(usize, Value)>, ReportError> {
    let path = dir.join(file);
    let bytes = match whole_file::read_regular(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(source) => return Err(ReportError::Read { path, source }),
    };
    // Lossy: a line cut inside a multi-byte character must not lose the lines before it.
    let text = String::from_utf8_lossy(&bytes);
    let mut out = vec![];
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(l) {
            Ok(mut v) => {
                shorten_strings(&mut v);
                out.push((i + 1, v))
            }
            Err(e) => {
                let what = if e.is_eof() { "truncated JSON" } else { "invalid JSON" };
                skipped.push(Skipped { file: file.into(), line: i + 1, reason: format!("{what} ({e})") });
            }
        }
    }
    Ok(out)
}

/// The most characters of one string of a run file the page shows (a label, a reason, a path):
/// a run's own strings are far shorter, and each is drawn on every panel, so a 50 MB string
/// made a 2.6 GB page.
pub const MAX_SHOWN_CHARS: usize = 2000;

/// `text` cut to [`MAX_SHOWN_CHARS`], saying how long it was.
pub fn shortened(text: &str) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(MAX_SHOWN_CHARS) {
        None => text.into(),
        Some((end, _)) => format!("{}… ({} characters in all)", &text[..end], text.chars().count()).into(),
    }
}

/// Every string in `v` (keys too) [`shortened`].
fn shorten_strings(v: &mut Value) {
    match v {
        Value::String(s) => {
            if let std::borrow::Cow::Owned(short) = shortened(s) {
                *s = short;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(shorten_strings),
        Value::Object(map) => {
            let long = map.keys().any(|k| matches!(shortened(k), std::borrow::Cow::Owned(_)));
            if long {
                *map =
                    std::mem::take(map).into_iter().map(|(k, v)| (shortened(&k).into_owned(), v)).collect();
            }
            map.values_mut().for_each(shorten_strings);
        }
        _ => {}
    }
}

/// The block after the last `memory summary` line of the log: its title and the `|` rows.
fn last_memory_table(log: &str) -> Option<String> {
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.iter().rposition(|l| l.contains("memory summary"))?;
    let title = lines[start];
    let title = title.find("memory summary").map_or(title, |i| &title[i..]);
    let rows: Vec<&str> = lines[start + 1..].iter().take_while(|l| l.starts_with('|')).copied().collect();
    Some(std::iter::once(title).chain(rows).collect::<Vec<_>>().join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(d.path().join(name), text).unwrap();
        }
        d
    }

    #[test]
    fn later_line_for_a_step_wins_and_truncated_lines_are_reported() {
        let d = dir_with(&[(
            "metrics.jsonl",
            "{\"step\":0,\"loss\":5.0}\n{\"step\":1,\"loss\":4.0}\n{\"step\":1,\"loss\":3.5}\n{\"loss\":1}\n{\"step\":2,\"lo",
        )]);
        let r = read_run(d.path()).unwrap();
        assert_eq!(r.series("loss").iter().map(|p| (p.0, p.2)).collect::<Vec<_>>(), vec![(0, 5.0), (1, 3.5)]);
        assert_eq!(r.skipped.len(), 2);
        assert_eq!((r.skipped[0].line, r.skipped[1].line), (4, 5));
        assert!(r.skipped[1].reason.starts_with("truncated JSON"), "{:?}", r.skipped);
    }

    #[test]
    fn not_a_run() {
        let d = dir_with(&[("notes.txt", "hi")]);
        assert!(matches!(read_run(d.path()), Err(ReportError::NotARun { .. })));
        assert!(matches!(read_run(&d.path().join("missing")), Err(ReportError::NotARun { .. })));
    }

    #[test]
    fn memory_table_is_the_last_one_logged() {
        let log = "x INFO memory summary, cpu (process)\n| a | 1 |\nx INFO step\nx INFO memory summary, cpu (process)\n| a | 2 |\n| b | 3 |\nx INFO done";
        assert_eq!(last_memory_table(log).unwrap(), "memory summary, cpu (process)\n| a | 2 |\n| b | 3 |");
    }

    #[test]
    fn wall_time_of_an_event_step() {
        let d = dir_with(&[(
            "metrics.jsonl",
            "{\"step\":0,\"elapsed_s\":1.0}\n{\"step\":5,\"elapsed_s\":6.0}\n",
        )]);
        let r = read_run(d.path()).unwrap();
        assert_eq!((r.wall_at(0), r.wall_at(3), r.wall_at(9)), (1.0, 1.0, 6.0));
    }

    #[test]
    fn a_long_string_in_a_run_file_is_cut_and_says_its_length() {
        let long = "é".repeat(MAX_SHOWN_CHARS + 10);
        let line = serde_json::json!({"event": "stopped", "step": 3, "reason": long, "detail": ["ok"]});
        let d = dir_with(&[("events.jsonl", &format!("{line}\n"))]);
        let r = read_run(d.path()).unwrap();
        let reason = r.events[0]["reason"].as_str().unwrap();
        let end = format!("… ({} characters in all)", MAX_SHOWN_CHARS + 10);
        assert!(reason.ends_with(&end), "{}", &reason[reason.len() - 40..]);
        assert_eq!(reason.chars().count(), MAX_SHOWN_CHARS + end.chars().count());
        assert_eq!(r.events[0]["detail"][0], "ok");
        assert_eq!(shortened("short"), "short");
    }

    #[test]
    fn a_run_file_that_is_not_a_regular_file_is_refused_by_name() {
        let d = dir_with(&[("config.yaml", "seed: 1\n")]);
        crate::fs::whole_file::tests::fifo(d.path(), METRICS);
        let e = read_run(d.path()).unwrap_err();
        assert!(e.is_usage(), "{e}");
        assert!(e.to_string().contains("metrics.jsonl: a FIFO (named pipe), not a regular file"), "{e}");
    }
}
