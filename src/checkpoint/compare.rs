//! A checkpoint's config against the config resuming it. Model shape and vocabulary must match
//! (the tensors would not fit); the rest (max_steps, intervals, schedule length, …) may change
//! and is reported so the log shows it. Pure.
use crate::config::Config;
use serde_json::Value;
use std::collections::BTreeMap;

fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// `key: checkpoint value → config value` for every differing key, model keys and the rest
/// separately.
pub fn differences(saved: &Config, now: &Config) -> (Vec<String>, Vec<String>) {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", &serde_json::to_value(saved).expect("Config serialises"), &mut a);
    flatten("", &serde_json::to_value(now).expect("Config serialises"), &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let (mut model, mut other) = (Vec::new(), Vec::new());
    for k in keys {
        let (x, y) = (a.get(k).map_or("(unset)", |s| s), b.get(k).map_or("(unset)", |s| s));
        if x != y {
            let line = format!("{k}: checkpoint {x}, config {y}");
            if k.starts_with("model.") { model.push(line) } else { other.push(line) }
        }
    }
    (model, other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_changes_are_separated_from_safe_ones() {
        let saved = Config::default();
        let mut now = Config::default();
        now.train.max_steps = 400;
        now.model.n_layer = 4;
        now.model.vocab_size = 512;
        let (model, other) = differences(&saved, &now);
        assert_eq!(model, ["model.n_layer: checkpoint 2, config 4", "model.vocab_size: checkpoint 256, config 512"]);
        assert_eq!(other, ["train.max_steps: checkpoint 200, config 400"]);
        assert_eq!(differences(&saved, &saved), (vec![], vec![]));
    }
}
