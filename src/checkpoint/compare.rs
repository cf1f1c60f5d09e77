//! A checkpoint's config against the config resuming it. Model shape and vocabulary must match
//! (the tensors would not fit); the rest (max_steps, intervals, schedule length, …) may change
//! and is reported so the log shows it. Pure.
use crate::config::diff::differing_keys;
use crate::config::Config;

/// `key: checkpoint value, config value` for every differing key, model keys and the rest
/// separately.
pub fn differences(saved: &Config, now: &Config) -> (Vec<String>, Vec<String>) {
    let json = |c: &Config| serde_json::to_value(c).expect("a Config always serialises");
    let (mut model, mut other) = (Vec::new(), Vec::new());
    for d in differing_keys(&json(saved), &json(now)) {
        let line = format!("{}: checkpoint {}, config {}", d.key, d.a, d.b);
        if d.key.starts_with("model.") { model.push(line) } else { other.push(line) }
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
