//! Reading a config: YAML file → `--set` overrides applied to the YAML tree → typed [`Config`]
//! (type errors carry their key path) → [`validate`](super::validate) (every problem at once).
use super::limits::{MAX_CONFIG_BYTES, MAX_SET_DEPTH, MAX_YAML_EXPANSION, YAML_NODE_BYTES};
use super::{validate, Config, Problem};
use serde_yaml::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path} not found")]
    NotFound { path: PathBuf },
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid YAML: {message}")]
    Yaml { path: PathBuf, message: String },
    /// Valid YAML holding a number no config key can take (serde_yaml refuses it while parsing).
    #[error("{path}: {message}")]
    OutOfRange { path: PathBuf, message: String },
    /// YAML whose aliases would make a tree far larger than its text.
    #[error("{path}: {message}")]
    Expands { path: PathBuf, message: String },
    #[error("{path}: key `{key}`: {message}")]
    Type { path: PathBuf, key: String, message: String },
    /// The file is one value (a number, a list), not sections.
    #[error("{path}: its top level is {found}; a config is sections (indented `key: value` lines: `model:`, `train:`, …)")]
    NotSections { path: PathBuf, found: &'static str },
    #[error("bad --set `{arg}`: {why}")]
    Override { arg: String, why: String },
    #[error("bad {flag}: {why}")]
    Flag { flag: String, why: String },
    #[error("{path}: {} problem(s) in the config:\n{}", .problems.len(), Problem::list(.problems))]
    Invalid { path: PathBuf, problems: Vec<Problem> },
}

/// Reads `path` (or only defaults when `None`), applies `key.path=value` overrides in order and
/// validates the result.
pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
    let shown = path.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("<defaults>"));
    let (mut tree, out_of_range) = match path {
        Some(p) => read_yaml(p)?,
        None => (Value::Mapping(Default::default()), Vec::new()),
    };
    if tree.is_null() {
        tree = Value::Mapping(Default::default()); // an empty file means "all defaults"
    }
    // Before any --set: one would be refused as going into "``", a key of no name.
    let found = match &tree {
        Value::Mapping(_) => None,
        Value::Sequence(_) => Some("a list"),
        Value::Number(_) => Some("a number"),
        Value::String(_) => Some("a string"),
        Value::Bool(_) => Some("true or false"),
        Value::Tagged(_) => Some("a tagged value"),
        Value::Null => None,
    };
    if let Some(found) = found {
        return Err(ConfigError::NotSections { path: shown, found });
    }
    for arg in overrides {
        apply_override(&mut tree, arg)?;
    }
    // A file's value that a --set replaced does not matter.
    let out_of_range = out_of_range.into_iter().filter(|p| set_by(overrides, &p.key).is_none()).collect();
    let config = typed(tree, &shown, overrides, out_of_range)?;
    let mut problems = validate(&config);
    if problems.is_empty() {
        return Ok(config);
    }
    // A value the command line gave is blamed on the --set that gave it, not on the file. A
    // rule over two keys (`train.max_steps=2` under the file's `warmup_steps: 20`) names where
    // each came from.
    for p in &mut problems {
        if let Some(arg) = set_by(overrides, &p.key) {
            p.message.push_str(&format!(" (from --set `{arg}`)"));
        } else {
            let note = keys_named(&p.message).find_map(|k| {
                set_by(overrides, k)
                    .map(|a| format!(" ({k} from --set `{a}`, {} from {})", p.key, shown.display()))
            });
            p.message.push_str(&note.unwrap_or_default());
        }
    }
    Err(ConfigError::Invalid { path: shown, problems })
}

/// The config keys a problem's message names (`train.max_steps` in "must not exceed
/// train.max_steps (2)"): dotted lower-case paths of known sections.
fn keys_named(message: &str) -> impl Iterator<Item = &str> {
    message
        .split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.'))
        .map(|w| w.trim_end_matches('.'))
        .filter(|w| w.split_once('.').is_some_and(|(section, key)| !section.is_empty() && !key.is_empty()))
        .filter(|w| !w.chars().next().is_some_and(|c| c.is_ascii_digit()))
}

/// The last `--set` that gave `key`: one whose key is `key`, or above it with a value that holds
/// the rest (`model={n_head: 4}` gave model.n_head, not the file's model.n_layer), or below it
/// (`trainz.lr=3` fails at the unknown section `trainz`).
fn set_by<'a>(overrides: &'a [String], key: &str) -> Option<&'a String> {
    let gave = |k: &str, v: &str| {
        if k.starts_with(&format!("{key}.")) {
            return true;
        }
        let Some(rest) = key.strip_prefix(k) else { return false };
        if rest.is_empty() || rest.starts_with('[') {
            return true;
        }
        // `model.n` is not above `model.n_head`.
        let Some(rest) = rest.strip_prefix('.') else { return false };
        let value: Value = serde_yaml::from_str(v).unwrap_or(Value::Null);
        // A mapping's key as YAML read it: `{100: 4}`'s key is a number.
        fn child<'v>(v: &'v Value, part: &str) -> Option<&'v Value> {
            v.get(part).or_else(|| v.get(serde_yaml::from_str::<Value>(part).ok()?))
        }
        rest.split('.')
            .map(|part| part.split('[').next().unwrap_or(part))
            .try_fold(&value, |v, part| child(v, part))
            .is_some()
    };
    overrides.iter().rev().find(|arg| arg.split_once('=').is_some_and(|(k, v)| gave(k, v)))
}

/// Keys of switches since removed, each with why. A config.yaml saved by a run or checkpoint
/// before the removal holds them (every key is saved): [`saved`] drops them, so such a
/// checkpoint still resumes; a config that sets one is told it is gone.
const RETIRED: &[(&str, &str)] = &[
    (
        "kernels.loss_blocks_per_sm",
        "the loss kernel's grid walk ran 2.5-3.3% slower on an H100 than a block a row",
    ),
    (
        "kernels.loss_row_in_registers",
        "the loss row kept in registers ran 8.5% slower on an H100 than reading it twice",
    ),
];

/// A config.yaml that trainguard saved (a checkpoint's, a run's) as a [`Config`]: keys
/// retired since it was written are dropped. Not validated: it was when it was saved.
pub fn saved(yaml: &str) -> Result<Config, serde_yaml::Error> {
    let mut tree = yaml_tree(yaml)?;
    for (key, _) in RETIRED {
        let (section, name) = key.split_once('.').expect("retired keys are section.key");
        if let Some(Value::Mapping(m)) = tree.get_mut(section) {
            m.remove(name);
        }
    }
    serde_yaml::from_value(tree)
}

/// The tree as a [`Config`]. Every unknown key is reported at once, each with the known key it
/// most resembles (serde stops at the first: a config with three typos took three runs), and
/// with the file's own problems, `file_problems`.
fn typed(
    mut tree: Value,
    shown: &Path,
    overrides: &[String],
    file_problems: Vec<Problem>,
) -> Result<Config, ConfigError> {
    // Each problem, with the --set that gave its key when one did.
    let mut problems: Vec<(Problem, Option<&String>)> =
        file_problems.into_iter().map(|p| (p, None)).collect();
    loop {
        let e = match serde_path_to_error::deserialize::<_, Config>(tree.clone()) {
            Ok(config) if problems.is_empty() => return Ok(config),
            Ok(_) => break,
            Err(e) => e,
        };
        let key = e.path().to_string();
        let raw = readable(&e.inner().to_string());
        // `--set out_dir=2024`: YAML read a number where the key takes text. The command line's
        // own characters are the text meant (a file's `out_dir: 2024` is asked to be quoted).
        if let Some(text) = wants_text(&raw).then(|| set_exactly(overrides, &key)).flatten() {
            if let Some(slot) = node_mut(&mut tree, e.path()) {
                *slot = Value::String(text.to_string());
                continue;
            }
        }
        let message = match (RETIRED.iter().find(|(k, _)| *k == key), did_you_mean(&raw)) {
            (Some((_, why)), _) => format!("this switch was removed ({why}); delete it"),
            (None, Some(known)) => format!(
                "unknown field `{}`: did you mean `{known}`?",
                raw.split('`').nth(1).unwrap_or_default()
            ),
            (None, None) if wants_text(&raw) => format!(
                "{raw} (quote it to give it as text: `\"{}\"`)",
                raw.split('`').nth(1).unwrap_or_default()
            ),
            (None, None) => raw.clone(),
        };
        let from_set = set_by(overrides, &key);
        // Any key serde refused is taken out to look for the next (a type error beside unknown
        // keys was reported alone); what cannot be taken out ends the search.
        let another_may_follow = problems.len() < 64 && remove(&mut tree, e.path());
        problems.push((Problem::new(&key, message), from_set));
        if !another_may_follow {
            break;
        }
    }
    if let [(only, set)] = &problems[..] {
        return Err(match set {
            Some(arg) => ConfigError::Override {
                arg: arg.to_string(),
                why: format!("key `{}`: {}", only.key, only.message),
            },
            None => ConfigError::Type {
                path: shown.to_path_buf(),
                key: only.key.clone(),
                message: only.message.clone(),
            },
        });
    }
    let problems = problems
        .into_iter()
        .map(|(p, set)| match set {
            Some(arg) => Problem::new(&p.key, format!("{} (from --set `{arg}`)", p.message)),
            None => p,
        })
        .collect();
    Err(ConfigError::Invalid { path: shown.to_path_buf(), problems })
}

/// The known key that serde's "unknown field `lrr`, expected one of `lr`, …" most likely
/// meant, when one is close enough.
fn did_you_mean(message: &str) -> Option<&str> {
    let names: Vec<&str> = message.strip_prefix("unknown field ")?.split('`').skip(1).step_by(2).collect();
    let (typed, known) = names.split_first()?;
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(typed, k), *k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

/// serde's words for a number or a boolean where a key takes text (a path, a name).
fn wants_text(serde_message: &str) -> bool {
    let scalar = ["invalid type: integer", "invalid type: floating point", "invalid type: boolean"]
        .iter()
        .any(|t| serde_message.starts_with(t));
    scalar
        && (serde_message.ends_with("expected a string") || serde_message.ends_with("expected path string"))
}

/// The text of the last `--set` whose key is `key` itself, as typed (unquoted: a quoted value
/// is text already).
fn set_exactly<'a>(overrides: &'a [String], key: &str) -> Option<&'a str> {
    let (_, value) = overrides.iter().rev().filter_map(|arg| arg.split_once('=')).find(|(k, _)| *k == key)?;
    Some(value.trim()).filter(|v| !v.starts_with(['"', '\'']))
}

/// The value at `path` in the tree, where the path leads to one.
fn node_mut<'t>(tree: &'t mut Value, path: &serde_path_to_error::Path) -> Option<&'t mut Value> {
    walk(tree, &path.iter().collect::<Vec<_>>())
}

fn walk<'t>(tree: &'t mut Value, segments: &[&serde_path_to_error::Segment]) -> Option<&'t mut Value> {
    use serde_path_to_error::Segment;
    segments.iter().try_fold(tree, |node, s| match (s, node) {
        (Segment::Map { key }, Value::Mapping(m)) => m.get_mut(key.as_str()),
        (Segment::Seq { index }, Value::Sequence(v)) => v.get_mut(*index),
        _ => None,
    })
}

/// Removes the key at `path` from the tree; false where the path does not lead to one.
fn remove(tree: &mut Value, path: &serde_path_to_error::Path) -> bool {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let Some((Segment::Map { key: last }, parents)) = segments.split_last() else { return false };
    match walk(tree, parents) {
        Some(Value::Mapping(m)) => m.remove(last.as_str()).is_some(),
        _ => false,
    }
}

/// The file's YAML tree, and a problem for each integer in it beyond 64 bits. serde_yaml refuses
/// such an integer and reads no further, so each is put aside (its key left out, the default in
/// its place) and the file read again: the run that reports it reports the file's other
/// problems too, not one a run.
fn read_yaml(path: &Path) -> Result<(Value, Vec<Problem>), ConfigError> {
    let mut text =
        crate::fs::whole_file::read_string_at_most(path, MAX_CONFIG_BYTES).map_err(|source| match source
            .kind()
        {
            std::io::ErrorKind::NotFound => ConfigError::NotFound { path: path.to_path_buf() },
            _ => ConfigError::Read { path: path.to_path_buf(), source },
        })?;
    within_expansion(&text).map_err(|message| ConfigError::Expands { path: path.to_path_buf(), message })?;
    // Each put-aside integer: the string standing in its place, and what is wrong with it.
    let mut wide: Vec<(String, String)> = Vec::new();
    loop {
        let e = match serde_yaml::from_str::<Value>(&text) {
            Ok(mut tree) => {
                extend(&mut tree)
                    .map_err(|message| ConfigError::Yaml { path: path.to_path_buf(), message })?;
                let problems = wide
                    .iter()
                    .filter_map(|(stand_in, why)| {
                        Some(Problem::new(&take_out(&mut tree, stand_in)?, why.clone()))
                    })
                    .collect();
                return Ok((tree, problems));
            }
            Err(e) => e,
        };
        let message = readable(&e.to_string());
        if !message.contains(OUT_OF_RANGE) {
            let message = duplicate_key_lines(&text, &e).unwrap_or(message);
            return Err(ConfigError::Yaml { path: path.to_path_buf(), message });
        }
        let at = e.location().map(|l| l.index()).filter(|&i| {
            text.get(i..)
                .is_some_and(|rest| rest.starts_with(|c: char| c == '-' || c == '+' || c.is_ascii_digit()))
        });
        let Some(at) = at.filter(|_| wide.len() < 64) else {
            return Err(ConfigError::OutOfRange { path: path.to_path_buf(), message });
        };
        let end = text[at..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || "+-_".contains(c)))
            .map_or(text.len(), |n| at + n);
        let stand_in = format!("trainguard: out-of-range integer {}", wide.len());
        // The key path serde_yaml puts first is the stand-in's to say once the file reads.
        let why =
            message.split_once(": integer").map_or(message.clone(), |(_, rest)| format!("integer{rest}"));
        text.replace_range(at..end, &format!("\"{stand_in}\""));
        wide.push((stand_in, why));
    }
}

/// `text`'s YAML tree is at most [`MAX_YAML_EXPANSION`] times the size of the text (at least
/// 64 KiB): its aliases are counted as serde_yaml replays them, before a tree is built, and the
/// count stops where it passes the bound. Text that is not YAML passes: its parse says why.
fn within_expansion(text: &str) -> Result<(), String> {
    let budget = MAX_YAML_EXPANSION * (text.len() as u64).max(64 << 10);
    let count = Count { seen: &std::cell::Cell::new(0), budget };
    let _ = serde::de::DeserializeSeed::deserialize(count, serde_yaml::Deserializer::from_str(text));
    match count.seen.get() {
        n if n > budget => Err(format!(
            "its aliases (`*name`) repeat what their anchors name into a tree more than {MAX_YAML_EXPANSION} times the size of the text: write fewer of them"
        )),
        _ => Ok(()),
    }
}

/// `text` as a YAML tree, its aliases held to [`within_expansion`]: YAML read from a file that
/// trainguard wrote once but anyone may have changed since (a run's or a checkpoint's
/// `config.yaml`).
pub fn yaml_tree(text: &str) -> Result<Value, serde_yaml::Error> {
    within_expansion(text).map_err(<serde_yaml::Error as serde::de::Error>::custom)?;
    serde_yaml::from_str(text)
}

/// Visits a YAML document node by node, building nothing, adding each node's size to `seen`.
#[derive(Clone, Copy)]
struct Count<'c> {
    seen: &'c std::cell::Cell<u64>,
    budget: u64,
}

impl Count<'_> {
    /// One node, with `text` bytes of scalar; past the budget, an error ends the visit.
    fn add<E: serde::de::Error>(self, text: usize) -> Result<(), E> {
        self.seen.set(self.seen.get().saturating_add(YAML_NODE_BYTES + text as u64));
        match self.seen.get() > self.budget {
            true => Err(E::custom("over the expansion budget")),
            false => Ok(()),
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Count<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Count<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.add(0)
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.add(0)
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.add(0)
    }
    // Integers beyond 64 bits: read_yaml reports them, after this count.
    fn visit_i128<E: serde::de::Error>(self, _: i128) -> Result<(), E> {
        self.add(0)
    }
    fn visit_u128<E: serde::de::Error>(self, _: u128) -> Result<(), E> {
        self.add(0)
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.add(0)
    }
    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<(), E> {
        self.add(s.len())
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.add(0)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.add(0)?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.add(0)?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }
    /// A tagged value (`!tag value`).
    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        use serde::de::VariantAccess;
        let ((), value) = data.variant_seed(self)?;
        value.newtype_variant_seed(self)
    }
}

/// YAML's merge keys (`<<: *base`) applied, and the top level's `x-` keys taken out: they hold
/// what anchors name (docker-compose's convention), not settings.
fn extend(tree: &mut Value) -> Result<(), String> {
    tree.apply_merge().map_err(|e| format!("a merge key (`<<`): {}", readable(&e.to_string())))?;
    if let Value::Mapping(top) = tree {
        top.retain(|k, _| !k.as_str().is_some_and(|k| k.starts_with("x-")));
    }
    Ok(())
}

/// serde_yaml's "duplicate entry with key" error places the key at the start of its section
/// (or nowhere, at the top level): the lines that give the key, where a block section's lines
/// show them (a flow mapping `{lr: 1, lr: 2}` keeps serde_yaml's words).
fn duplicate_key_lines(text: &str, e: &serde_yaml::Error) -> Option<String> {
    let message = e.to_string();
    let (section, rest) = message.split_once("duplicate entry with key \"")?;
    let key = rest.split('"').next()?;
    let (first_line, indent) = e.location().map_or((1, 0), |l| (l.line(), l.column().saturating_sub(1)));
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate().skip(first_line - 1) {
        let content = line.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let at = line.len() - content.len();
        if at < indent {
            break; // the section ended
        }
        let names_key = [key.to_string(), format!("\"{key}\""), format!("'{key}'")]
            .iter()
            .any(|k| content.strip_prefix(k.as_str()).is_some_and(|r| r.trim_start().starts_with(':')));
        if at == indent && names_key {
            lines.push((i + 1).to_string());
        }
    }
    let (last, earlier) = lines.split_last().filter(|(_, earlier)| !earlier.is_empty())?;
    let section = section.trim_end_matches([':', ' ']);
    let within = if section.is_empty() { String::new() } else { format!(" in `{section}`") };
    Some(format!(
        "key `{key}`{within} is given more than once, on lines {} and {last}: keep one",
        earlier.join(", ")
    ))
}

/// Removes the value equal to the string `stand_in` from the tree and returns its key path.
fn take_out(tree: &mut Value, stand_in: &str) -> Option<String> {
    let here = |v: &Value| v.as_str() == Some(stand_in);
    match tree {
        Value::Mapping(m) => {
            let key = m.iter().find(|(_, v)| here(v)).map(|(k, _)| k.clone());
            if let Some(key) = key {
                m.remove(&key);
                return Some(key_text(&key));
            }
            m.iter_mut().find_map(|(k, v)| {
                take_out(v, stand_in).map(|below| {
                    format!("{}{}{below}", key_text(k), if below.starts_with('[') { "" } else { "." })
                })
            })
        }
        Value::Sequence(items) => {
            if let Some(i) = items.iter().position(here) {
                items.remove(i);
                return Some(format!("[{i}]"));
            }
            items
                .iter_mut()
                .enumerate()
                .find_map(|(i, v)| take_out(v, stand_in).map(|below| format!("[{i}].{below}")))
        }
        _ => None,
    }
}

fn key_text(key: &Value) -> String {
    match key {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other).map_or_else(|_| "?".into(), |s| s.trim_end().to_string()),
    }
}

/// What [`readable`] says of an integer beyond 64 bits.
const OUT_OF_RANGE: &str = "is out of range";

/// serde's words for a type said in a config's: "expected struct TrainConfig" is a section,
/// "expected u64" a whole number, and an integer YAML cannot hold (serde_yaml's "as u128") is
/// out of range, not "not YAML".
fn readable(serde_message: &str) -> String {
    let mut m = serde_message.to_string();
    if let Some(at) = m.find("expected struct ") {
        let end = m[at + 16..].find(|c: char| !c.is_alphanumeric()).map_or(m.len(), |e| at + 16 + e);
        m.replace_range(at..end, "expected a section (indented key: value lines)");
    }
    for (rust, said) in [
        ("u64", "a whole number from 0"),
        ("usize", "a whole number from 0"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("f64", "a number"),
    ] {
        let pattern = format!("expected {rust}");
        if let Some(at) =
            m.find(&pattern).filter(|&at| !m[at + pattern.len()..].starts_with(|c: char| c.is_alphanumeric()))
        {
            m.replace_range(at..at + pattern.len(), &format!("expected {said}"));
        }
    }
    // Every integer key is unsigned; a number key (a float) takes a large value written with a
    // decimal point.
    let decimal = "a number key takes it with a decimal point";
    for (wide, range) in [
        ("u128", "whole-number keys go up to 18446744073709551615"),
        ("i128", "whole-number keys start at 0"),
    ] {
        let said = format!(" as {wide}, expected any YAML value");
        if let (Some(at), true) = (m.find(&said), m.contains("invalid type: integer")) {
            m.replace_range(
                at..at + said.len(),
                &format!(" {OUT_OF_RANGE} (beyond 64 bits): {range}; {decimal}"),
            );
            m = m.replacen("invalid type: integer", "integer", 1);
        }
    }
    m
}

/// The keys that take a path or a name: a `--set` of one is the text typed.
const TEXT_KEYS: [&str; 4] = ["out_dir", "init_from", "device", "data.source"];

/// Applies one `a.b.c=value` override to a YAML tree. The value is read as YAML, so numbers,
/// booleans and lists keep their types; `1e-3` (YAML would read a string) is taken as a number.
pub fn apply_override(tree: &mut Value, arg: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| ConfigError::Override { arg: arg.to_string(), why: why.to_string() };
    let (key, raw) = arg.split_once('=').ok_or_else(|| bad("expected key.path=value"))?;
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.trim().is_empty()) {
        return Err(bad("empty key segment"));
    }
    if parts.len() > MAX_SET_DEPTH {
        return Err(bad(&format!(
            "the key path has {} levels; a config's keys are at most {MAX_SET_DEPTH} deep",
            parts.len()
        )));
    }
    // A path or a name is the characters typed: YAML would end `runs/a #1` at its comment and
    // refuse `@runs`, `&a`, `*a`, `!x`. Quoted, it is YAML's (the quotes taken off); `~`, `null`
    // or nothing, the key's absence.
    let quoted = raw.trim_start().starts_with(['"', '\'']);
    let verbatim = TEXT_KEYS.contains(&key) && !quoted && !["", "~", "null"].contains(&raw.trim());
    let mut value: Value = if verbatim {
        Value::String(raw.trim().to_string())
    } else {
        within_expansion(raw).map_err(|why| bad(&format!("the value: {why}")))?;
        serde_yaml::from_str(raw).map_err(|e| {
            let m = readable(&e.to_string());
            bad(&if m.contains(OUT_OF_RANGE) { m } else { format!("value is not YAML: {m}") })
        })?
    };
    // Only what YAML 1.1 leaves a string for want of a dot (`1e-3`): not a quoted value
    // (`out_dir="123"`), nor words Rust reads as numbers (`inf`, `NaN`).
    if let (Value::String(s), false) = (&value, quoted) {
        let numeric = s.bytes().any(|b| b.is_ascii_digit())
            && s.bytes().all(|b| b.is_ascii_digit() || b"eE+-.".contains(&b));
        if let (true, Ok(x)) = (numeric, s.parse::<f64>()) {
            value = Value::Number(x.into());
        }
    }
    let mut node = tree;
    for (i, part) in parts.iter().enumerate() {
        let map = match node {
            Value::Mapping(m) => m,
            _ => return Err(bad(&format!("`{}` is not a section", parts[..i].join(".")))),
        };
        let k = Value::String(part.to_string());
        if i + 1 == parts.len() {
            let slot = map.entry(k).or_insert(Value::Null);
            // `--set model=` (a stray space before the value, `~`): the section would quietly
            // go back to every default, another model; so is a section the file does not have.
            if value.is_null() && (slot.is_mapping() || is_section(&parts)) {
                return Err(bad(&format!("`{key}` is a section and the value is empty: set its keys (`{key}.name=value`) or give a mapping (`{key}={{name: value}}`)")));
            }
            merge(slot, value);
            return Ok(());
        }
        node = map.entry(k).or_insert_with(|| Value::Mapping(Default::default()));
        if node.is_null() {
            *node = Value::Mapping(Default::default());
        }
    }
    unreachable!("split always yields at least one segment")
}

/// Whether `parts` names a section of the config (a mapping in the defaults' tree).
fn is_section(parts: &[&str]) -> bool {
    let defaults = serde_yaml::to_value(Config::default()).expect("the default config serialises");
    parts.iter().try_fold(&defaults, |node, part| node.get(*part)).is_some_and(Value::is_mapping)
}

/// Puts `value` in `slot`; a mapping into a mapping sets its keys and keeps the others:
/// `--set 'model={n_layer: 3}'` changes one key of the file's model, where replacing the section
/// would quietly put every other key back to its default (another model).
fn merge(slot: &mut Value, value: Value) {
    match (slot, value) {
        (Value::Mapping(old), Value::Mapping(new)) => {
            for (k, v) in new {
                merge(old.entry(k).or_insert(Value::Null), v);
            }
        }
        (slot, value) => *slot = value,
    }
}

/// Parses `16GiB`, `512MiB`, `1.5GB`, `100000` (bytes) into bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{text}` is not a size like 16GiB, 512MiB or 1000000"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        // Kubernetes' `Gi` and a bare `G` are GiB too; `GB` is 10^9, as on a disk's label.
        "kib" | "ki" | "k" => 1024.0,
        "mib" | "mi" | "m" => 1024f64.powi(2),
        "gib" | "gi" | "g" => 1024f64.powi(3),
        "tib" | "ti" | "t" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown size unit `{other}` in `{text}` (use B; KiB, MiB, GiB, TiB, also written Ki or K, …: powers of 1024; KB, MB, GB, TB: powers of 1000)")),
    };
    let bytes = n * mult;
    if bytes.is_nan() || bytes < 1.0 {
        return Err(format!("`{text}` must be at least one byte"));
    }
    // `as u64` would saturate: a cap of 16 EiB, no cap at all, said as one.
    if bytes >= u64::MAX as f64 {
        return Err(format!("`{text}` is more bytes than 64 bits count (16 EiB)"));
    }
    Ok(bytes as u64)
}

/// Parses `7h30m`, `45m`, `90s`, `1d2h`, `1.5h` into a duration.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("`{text}` is not a duration like 7h30m, 45m or 90s");
    let t = text.trim();
    if t.is_empty() {
        return Err(bad());
    }
    let (mut total, mut num) = (0.0f64, String::new());
    for c in t.chars() {
        if c.is_ascii_digit() || c == '.' {
            num.push(c);
            continue;
        }
        let unit = match c {
            'd' => 86400.0,
            'h' => 3600.0,
            'm' => 60.0,
            's' => 1.0,
            _ => return Err(bad()),
        };
        total += num.parse::<f64>().map_err(|_| bad())? * unit;
        num.clear();
    }
    if !num.is_empty() {
        return Err(bad()); // a number without a unit
    }
    if total <= 0.0 {
        return Err(format!("`{text}` must be longer than zero"));
    }
    // Beyond a century a limit means nothing; beyond u64 seconds it cannot be represented.
    if total > super::limits::MAX_DURATION_S {
        return Err(format!("`{text}` is longer than 100 years"));
    }
    Ok(std::time::Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_creates_sections_and_keeps_types() {
        let mut t: Value = serde_yaml::from_str("train: {lr: 0.1}").unwrap();
        apply_override(&mut t, "train.lr=1e-3").unwrap();
        apply_override(&mut t, "model.n_layer=4").unwrap();
        apply_override(&mut t, "model.bias=false").unwrap();
        assert_eq!(t["train"]["lr"].as_f64(), Some(1e-3));
        assert_eq!(t["model"]["n_layer"].as_u64(), Some(4));
        assert_eq!(t["model"]["bias"].as_bool(), Some(false));
        // Quoted, or a word Rust would parse as a number: a string stays a string.
        apply_override(&mut t, "out_dir=\"123\"").unwrap();
        apply_override(&mut t, "metrics.trace=inf").unwrap();
        apply_override(&mut t, "init_from=NaN").unwrap();
        assert_eq!(
            (t["out_dir"].as_str(), t["metrics"]["trace"].as_str(), t["init_from"].as_str()),
            (Some("123"), Some("inf"), Some("NaN"))
        );
        apply_override(&mut t, "train.eps=-2E+5").unwrap();
        assert_eq!(t["train"]["eps"].as_f64(), Some(-2e5));
        // A mapping sets its keys and keeps the section's others; a list or a value replaces.
        apply_override(&mut t, "model={n_layer: 3, n_head: 2}").unwrap();
        assert_eq!(
            (t["model"]["n_layer"].as_u64(), t["model"]["n_head"].as_u64(), t["model"]["bias"].as_bool()),
            (Some(3), Some(2), Some(false))
        );
        apply_override(&mut t, "faults.nonfinite_loss_at_steps=[1, 2]").unwrap();
        apply_override(&mut t, "faults.nonfinite_loss_at_steps=[5]").unwrap();
        assert_eq!(t["faults"]["nonfinite_loss_at_steps"].as_sequence().map(Vec::len), Some(1));
        apply_override(&mut t, "train=5").unwrap();
        assert_eq!(
            t["train"].as_u64(),
            Some(5),
            "a section replaced by a value is the type check's to refuse"
        );
    }

    #[test]
    fn override_rejects_malformed_arguments() {
        let mut t = Value::Mapping(Default::default());
        assert!(apply_override(&mut t, "train.lr").is_err());
        assert!(apply_override(&mut t, "train..lr=1").is_err());
        apply_override(&mut t, "seed=1").unwrap();
        let err = apply_override(&mut t, "seed.x=1").unwrap_err().to_string();
        assert!(err.contains("`seed` is not a section"), "{err}");
    }

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert!(parse_size("99999999999999999999GiB").unwrap_err().contains("more bytes than 64 bits"));
        assert_eq!(parse_size("1EiB").ok(), None, "no such unit");
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(
            (parse_size("16Gi").unwrap(), parse_size("16G").unwrap(), parse_size("16GB").unwrap()),
            (16 << 30, 16 << 30, 16_000_000_000)
        );
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("7h30m").unwrap().as_secs(), 27_000);
        assert_eq!(parse_duration("45m").unwrap().as_secs(), 2700);
        assert_eq!(parse_duration("90s").unwrap().as_secs(), 90);
        assert_eq!(parse_duration("1d2h").unwrap().as_secs(), 93_600);
        assert_eq!(parse_duration("1.5h").unwrap().as_secs(), 5400);
        for bad in ["", "7", "7x", "h", "0s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        // Too long for a Duration: an error, not std's panic.
        assert!(parse_duration("99999999999999999999s").unwrap_err().contains("100 years"));
        assert!(parse_duration("36500d").is_ok());
    }

    /// A checkpoint's config.yaml from before a switch was removed still loads (the key
    /// dropped); a config that sets the switch is told it is gone.
    #[test]
    fn retired_switches_are_dropped_from_saved_configs_and_refused_in_new_ones() {
        let mut old = serde_yaml::to_value(Config::default()).unwrap();
        for (key, _) in RETIRED {
            let (section, name) = key.split_once('.').unwrap();
            old[section].as_mapping_mut().unwrap().insert(name.into(), 0.into());
        }
        let yaml = serde_yaml::to_string(&old).unwrap();
        assert!(serde_yaml::from_str::<Config>(&yaml).is_err(), "the old keys are unknown to Config itself");
        assert_eq!(saved(&yaml).unwrap(), Config::default());
        let err = load(None, &["kernels.loss_blocks_per_sm=1".into()]).unwrap_err().to_string();
        assert!(
            err.contains("kernels.loss_blocks_per_sm")
                && err.contains("was removed")
                && err.contains("delete it"),
            "{err}"
        );
    }

    #[test]
    fn serde_type_names_are_said_in_config_words() {
        assert_eq!(
            readable("invalid type: integer `5`, expected struct FaultsConfig"),
            "invalid type: integer `5`, expected a section (indented key: value lines)"
        );
        assert_eq!(
            readable("invalid value: integer `-1`, expected u64"),
            "invalid value: integer `-1`, expected a whole number from 0"
        );
        assert_eq!(
            readable("a.b: invalid type: integer `99999999999999999999` as u128, expected any YAML value at line 2 column 33"),
            "a.b: integer `99999999999999999999` is out of range (beyond 64 bits): whole-number keys go up to 18446744073709551615; a number key takes it with a decimal point at line 2 column 33"
        );
        let err = load(None, &["faults.pause_in_checkpoint_write_ms=99999999999999999999".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("is out of range") && !err.contains("not YAML"), "{err}");
        let err = load(None, &["train.lr=-99999999999999999999".into()]).unwrap_err().to_string();
        assert!(
            err.contains("is out of range (beyond 64 bits): whole-number keys start at 0")
                && !err.contains("i128"),
            "{err}"
        );
        assert!(
            load(None, &["train.lr=-99999999999999999999.0".into()])
                .unwrap_err()
                .to_string()
                .contains("train.lr"),
            "parsed as a number, refused by validation"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, "train:\n  max_steps: 99999999999999999999\n").unwrap();
        let err = load(Some(&file), &[]).unwrap_err().to_string();
        assert!(err.contains("is out of range") && !err.contains("not valid YAML"), "{err}");
        let err = load(None, &["faults=5".into()]).unwrap_err().to_string();
        assert!(err.contains("key `faults`") && err.contains("expected a section"), "{err}");
        // A file of one value: its top level is named as such, not as a key `.`.
        for (text, found) in [("42\n", "a number"), ("- a\n", "a list"), ("just words\n", "a string")] {
            std::fs::write(&file, text).unwrap();
            for sets in [vec![], vec!["train.lr=1".to_string()]] {
                let err = load(Some(&file), &sets).unwrap_err().to_string();
                assert!(
                    err.starts_with(&format!(
                        "{}: its top level is {found}; a config is sections",
                        file.display()
                    )),
                    "{sets:?}: {err}"
                );
            }
        }
    }

    #[test]
    fn an_empty_value_does_not_wipe_a_section() {
        let mut tree: Value =
            serde_yaml::from_str("model: {arch: llama, n_layer: 3}\ntrain: {threads: 2}").unwrap();
        for arg in ["model=", "model=~", "model=null"] {
            let err = apply_override(&mut tree, arg).unwrap_err().to_string();
            assert!(err.contains("`model` is a section and the value is empty"), "{err}");
        }
        assert_eq!(tree["model"]["n_layer"], Value::from(3));
        // A key that takes null keeps taking it.
        apply_override(&mut tree, "train.threads=").unwrap();
        assert!(tree["train"]["threads"].is_null());
        // A section the file does not have, as one it has: not a command line that works with
        // one file and not another.
        for arg in ["data=", "memory.allocator="] {
            let err = apply_override(&mut tree, arg).unwrap_err().to_string();
            assert!(err.contains("is a section and the value is empty"), "{arg}: {err}");
        }
        assert!(load(None, &["model=".into()]).is_err());
    }

    #[test]
    fn integers_beyond_64_bits_are_reported_with_the_files_other_problems() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        let yaml = "# ×× (bytes, not characters)\ntrain:\n  max_steps: 99999999999999999999\n  lrr: 0.1\nmodel:\n  n_layer: -99999999999999999999\nmemory:\n  allocator:\n    roundup_power2_divisions: [1, 99999999999999999999]\n";
        std::fs::write(&file, yaml).unwrap();
        let err = load(Some(&file), &[]).unwrap_err();
        let ConfigError::Invalid { problems, .. } = &err else { panic!("{err}") };
        let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "train.max_steps",
                "model.n_layer",
                "memory.allocator.roundup_power2_divisions[1]",
                "train.lrr",
                "memory.allocator.roundup_power2_divisions"
            ],
            "{err}"
        );
        assert!(
            problems[0]
                .message
                .starts_with("integer `99999999999999999999` is out of range (beyond 64 bits)")
                && problems[0].message.contains("line 3"),
            "{err}"
        );
        assert!(problems[1].message.contains("whole-number keys start at 0"), "{err}");
        assert!(problems[3].message.contains("did you mean `lr`"), "{err}");
        // A value the command line replaces does not matter.
        let err =
            load(Some(&file), &["train.max_steps=5".into(), "train.lr=0.1".into()]).unwrap_err().to_string();
        assert!(
            !err.contains("max_steps") && err.contains("model.n_layer") && err.contains("train.lrr"),
            "{err}"
        );
        std::fs::write(&file, "train:\n  max_steps: 99999999999999999999\n").unwrap();
        let loaded = load(Some(&file), &["train.max_steps=50".into()]);
        assert_eq!(loaded.map(|c| c.train.max_steps).ok(), Some(50));
    }

    #[test]
    fn type_errors_name_the_key_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "train:\n  max_steps: many\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(err.contains("train.max_steps"), "{err}");
        std::fs::write(&p, "model:\n  n_layers: 3\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(err.contains("n_layers"), "{err}");
        // A bad value from the command line is the --set's, not the file's.
        std::fs::write(&p, "train:\n  max_steps: 5\n").unwrap();
        let err = load(Some(&p), &["model.n_layer=abc".into(), "train.max_steps=7".into()]).unwrap_err();
        assert!(matches!(&err, ConfigError::Override { arg, .. } if arg == "model.n_layer=abc"), "{err}");
        std::fs::write(&p, "train:\n  max_steps: many\n").unwrap();
        let err = load(Some(&p), &["model.n_layer=3".into()]).unwrap_err();
        assert!(matches!(&err, ConfigError::Type { key, .. } if key == "train.max_steps"), "{err}");
        // An untagged enum says what it expects, not serde's "did not match any variant".
        let err = load(None, &["memory.limit=1e30".into()]).unwrap_err().to_string();
        assert!(err.contains("memory.limit") && err.contains("a size like 16GiB"), "{err}");
    }

    #[test]
    fn a_set_number_where_a_key_takes_text_is_the_text_typed() {
        // YAML reads these as numbers and booleans; the keys take a path or a name.
        let sets = ["out_dir=2024".to_string(), "init_from=1e3".into(), "device=0".into()];
        let c = load(None, &sets[..2]).unwrap();
        assert_eq!(c.out_dir, Path::new("2024"));
        assert_eq!(
            c.init_from.as_deref(),
            Some(Path::new("1e3")),
            "the characters typed, not YAML's reading (1000)"
        );
        // Read as text, then judged by the key's own rule.
        let err = load(None, &sets).unwrap_err().to_string();
        assert!(
            err.contains("device")
                && err.contains("(from --set `device=0`)")
                && !err.contains("invalid type"),
            "{err}"
        );
        let err = load(None, &["train.max_duration=90".into()]).unwrap_err().to_string();
        assert!(err.contains("`90` is not a duration"), "{err}");
        // A number key keeps refusing text, and a file's number is asked to be quoted.
        assert!(load(None, &["train.lr=abc".into()]).is_err());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "out_dir: 2024\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(
            err.contains("key `out_dir`") && err.contains("quote it to give it as text: `\"2024\"`"),
            "{err}"
        );
        // The file's number replaced by a --set of the whole key's text loads.
        assert_eq!(load(Some(&p), &["out_dir=2025".into()]).unwrap().out_dir, Path::new("2025"));
        // What YAML would cut at a comment or refuse as an anchor, an alias, a tag or a reserved
        // character; a quoted value loses its quotes; `~` is no value.
        for typed in ["runs/a #1", "@runs", "&a", "*a", "!x", "a: b", "[x]"] {
            assert_eq!(load(None, &[format!("out_dir={typed}")]).unwrap().out_dir, Path::new(typed));
        }
        let c = load(None, &["data.source=text:/tmp/my file #2.txt".into(), "init_from='/w/x #3'".into()])
            .unwrap();
        assert_eq!(
            (c.data.source.as_str(), c.init_from.as_deref()),
            ("text:/tmp/my file #2.txt", Some(Path::new("/w/x #3")))
        );
        assert_eq!(load(None, &["init_from=/a".into(), "init_from=~".into()]).unwrap().init_from, None);
    }

    #[test]
    fn merge_keys_apply_and_the_top_levels_x_keys_hold_anchors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(
            &p,
            "x-small: &small {n_layer: 3, n_head: 2}\nmodel:\n  <<: *small\n  n_embd: 64\n  n_head: 4\n",
        )
        .unwrap();
        let c = load(Some(&p), &[]).unwrap();
        // The section's own key wins over the merged one, as YAML says.
        assert_eq!((c.model.n_layer, c.model.n_head, c.model.n_embd), (3, 4, 64));
        std::fs::write(&p, "model:\n  <<: 5\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(err.contains("c.yaml") && err.contains("merge key"), "{err}");
        // Elsewhere than the top level an `x-` key is a key like any other.
        std::fs::write(&p, "model:\n  x-n: 3\n").unwrap();
        assert!(load(Some(&p), &[]).unwrap_err().to_string().contains("x-n"));
    }

    #[test]
    fn every_unknown_key_is_named_at_once_with_the_key_it_resembles() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "train:\n  lrr: 1\n  max_stepz: 3\nmodel:\n  n_layr: 2\nmemory:\n  allocator:\n    expandable_segment: true\n  zzz: 1\n").unwrap();
        let ConfigError::Invalid { problems, .. } = load(Some(&p), &[]).unwrap_err() else {
            panic!("a list of problems")
        };
        let listed: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(
            listed[..4],
            [
                "train.lrr: unknown field `lrr`: did you mean `lr`?",
                "train.max_stepz: unknown field `max_stepz`: did you mean `max_steps`?",
                "model.n_layr: unknown field `n_layr`: did you mean `n_layer`?",
                "memory.allocator.expandable_segment: unknown field `expandable_segment`: did you mean `expandable_segments`?",
            ]
        );
        // Nothing close: serde's list of the keys it knows.
        assert!(
            listed[4].starts_with("memory.zzz: unknown field `zzz`, expected one of `limit`"),
            "{listed:?}"
        );
        assert_eq!(listed.len(), 5);
        // With a type error behind the unknown key, both; one unknown key alone stays one line.
        std::fs::write(&p, "train:\n  lrr: 1\n  lr: abc\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(err.contains("2 problem(s)") && err.contains("train.lr: invalid type"), "{err}");
        std::fs::write(&p, "train:\n  lrr: 1\n").unwrap();
        assert!(
            matches!(load(Some(&p), &[]).unwrap_err(), ConfigError::Type { key, .. } if key == "train.lrr")
        );
        // A typo on the command line is the --set's, and is listed with the file's own.
        let err = load(Some(&p), &["optimizer.nmae=adamw".into()]).unwrap_err().to_string();
        assert!(err.contains("2 problem(s)") && err.contains("train.lrr: unknown field"), "{err}");
        assert!(err.contains("optimizer.nmae: unknown field `nmae`: did you mean `name`? (from --set `optimizer.nmae=adamw`)"), "{err}");
        let err = load(None, &["optimizer.nmae=adamw".into()]).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Override { arg, why } if arg == "optimizer.nmae=adamw" && why.contains("did you mean `name`")),
            "{err}"
        );
        // An unknown section given by --set is the --set's too.
        let err = load(None, &["trainz.lr=3".into()]).unwrap_err();
        assert!(matches!(&err, ConfigError::Override { arg, .. } if arg == "trainz.lr=3"), "{err}");
        // The file's typo in a section a mapping --set merges into is the file's.
        std::fs::write(&p, "model:\n  n_layr: 2\n").unwrap();
        let err = load(Some(&p), &["model={n_head: 2}".into()]).unwrap_err();
        assert!(matches!(&err, ConfigError::Type { key, .. } if key == "model.n_layr"), "{err}");
        let err = load(Some(&p), &["model={n_layr: 3}".into()]).unwrap_err();
        assert!(matches!(&err, ConfigError::Override { arg, .. } if arg == "model={n_layr: 3}"), "{err}");
        // A type error and an unknown key: both, in one run.
        std::fs::write(&p, "train:\n  lr: abc\n  max_stepz: 3\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(
            err.contains("2 problem(s)")
                && err.contains("train.lr: invalid type")
                && err.contains("did you mean `max_steps`"),
            "{err}"
        );
    }

    #[test]
    fn a_rule_broken_by_a_set_value_names_the_set() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("c.yaml");
        std::fs::write(&file, "train:\n  lr: -1\n").unwrap();
        let sets = ["memory.limit=0GiB".to_string(), "model={n_layer: 0}".to_string()];
        let e = load(Some(&file), &sets).unwrap_err().to_string();
        assert!(e.contains("train.lr: must be a positive number, got -1\n"), "the file's own: {e}");
        assert!(
            e.contains("(from --set `memory.limit=0GiB`)")
                && e.contains("model.n_layer: must be in 1..=4096, got 0 (from --set `model={n_layer: 0}`)"),
            "{e}"
        );
        // A key YAML reads as a number: given by the mapping --set.
        let e = load(None, &["memory.allocator.roundup_power2_divisions={100: 4}".to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("got `100` (from --set `memory.allocator.roundup_power2_divisions={100: 4}`)"),
            "{e}"
        );
        // A mapping --set that did not give the key is not blamed for the file's value.
        std::fs::write(&file, "model:\n  n_layer: 0\n").unwrap();
        let e = load(Some(&file), &["model={n_head: 2}".to_string()]).unwrap_err().to_string();
        assert!(e.contains("got 0") && !e.contains("from --set"), "{e}");
    }

    #[test]
    fn a_key_given_twice_is_named_with_its_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        let said = |yaml: &str| {
            std::fs::write(&p, yaml).unwrap();
            load(Some(&p), &[]).unwrap_err().to_string()
        };
        let e = said(
            "model:\n  n_layer: 2\ntrain:\n  # lr\n  lr: 1\n  max_steps: 3\n  sub: {lr: 5}\n\n  lr: 2\n",
        );
        assert!(
            e.ends_with("key `lr` in `train` is given more than once, on lines 5 and 9: keep one"),
            "{e}"
        );
        let e = said("train:\n  lr: 1\nmodel:\n  n_layer: 2\ntrain:\n  lr: 2\n");
        assert!(e.ends_with("key `train` is given more than once, on lines 1 and 5: keep one"), "{e}");
        // A nested section's, and a flow mapping's (serde_yaml's words kept).
        let e = said(
            "memory:\n  allocator:\n    expandable_segments: true\n    \"expandable_segments\": false\n",
        );
        assert!(e.ends_with("key `expandable_segments` in `memory.allocator` is given more than once, on lines 3 and 4: keep one"), "{e}");
        let e = said("train: {lr: 1, lr: 2}\n");
        assert!(e.contains("duplicate entry with key \"lr\""), "{e}");
    }

    #[test]
    fn aliases_that_make_a_tree_far_larger_than_the_text_are_refused_before_it_is_built() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        // 11 KB of text, two million values (serde_yaml's own limit lets it through).
        let list = vec!["0"; 700].join(",");
        let uses = vec!["*a"; 3000].join(",");
        std::fs::write(&p, format!("x-a: &a [{list}]\nx-b: [{uses}]\n")).unwrap();
        let err = load(Some(&p), &[]).unwrap_err();
        assert!(matches!(err, ConfigError::Expands { .. }), "{err}");
        assert!(err.to_string().contains("more than 16 times the size of the text"), "{err}");
        // A --set value's aliases, and a saved config's, are held to the same bound.
        let mut t = Value::Mapping(Default::default());
        let err = apply_override(&mut t, &format!("x=[&a [{list}], {uses}]")).unwrap_err();
        assert!(err.to_string().contains("the value: its aliases"), "{err}");
        assert!(saved(&format!("x-a: &a [{list}]\nx-b: [{uses}]\n")).is_err());
        // Text without aliases, the densest YAML there is, is within the bound.
        assert_eq!(within_expansion(&format!("[{}]", vec!["[]"; 100_000].join(","))), Ok(()));
    }

    #[test]
    fn a_config_that_is_too_large_or_not_a_regular_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, format!("# {}\n", "x".repeat(MAX_CONFIG_BYTES as usize))).unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(err.contains("c.yaml") && err.contains("more than the 4194304 it may hold"), "{err}");
        let fifo = crate::fs::whole_file::tests::fifo(dir.path(), "pipe.yaml");
        let err = load(Some(&fifo), &[]).unwrap_err().to_string();
        assert!(err.ends_with("pipe.yaml: a FIFO (named pipe), not a regular file"), "{err}");
    }

    #[test]
    fn a_set_key_path_deeper_than_any_config_is_refused() {
        let mut t = Value::Mapping(Default::default());
        apply_override(&mut t, &format!("{}=1", vec!["a"; MAX_SET_DEPTH].join("."))).unwrap();
        let err = apply_override(&mut t, &format!("{}=1", vec!["a"; 20_000].join("."))).unwrap_err();
        assert!(
            err.to_string().ends_with("the key path has 20000 levels; a config's keys are at most 64 deep"),
            "{err}"
        );
    }

    #[test]
    fn missing_file_and_bad_yaml_are_one_line_errors() {
        let err = load(Some(Path::new("/nonexistent/x.yaml")), &[]).unwrap_err();
        assert!(matches!(err, ConfigError::NotFound { .. }));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "train: [unclosed\n").unwrap();
        assert!(matches!(load(Some(&p), &[]).unwrap_err(), ConfigError::Yaml { .. }));
    }

    #[test]
    fn a_conflict_a_set_caused_names_where_each_value_came_from_and_what_to_change() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.yaml");
        std::fs::write(&p, "train:\n  warmup_steps: 20\n").unwrap();
        let err = load(Some(&p), &["train.max_steps=2".into()]).unwrap_err().to_string();
        let want = format!(
            "train.warmup_steps: must not exceed train.max_steps (2), got 20: lower train.warmup_steps or raise \
             train.max_steps (train.max_steps from --set `train.max_steps=2`, train.warmup_steps from {})",
            p.display()
        );
        assert!(err.contains(&want), "{err}");
        // Both from the file: no --set is named.
        std::fs::write(&p, "train:\n  warmup_steps: 20\n  max_steps: 2\n").unwrap();
        let err = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(err.contains("got 20: lower train.warmup_steps") && !err.contains("--set"), "{err}");
    }
}
