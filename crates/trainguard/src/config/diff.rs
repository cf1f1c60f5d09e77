//! Which keys two configs set differently, by config key path: what a resume reports against
//! its checkpoint's config, and what a rank reports against rank 0's. Also which keys may
//! differ between the ranks of one run at all. Pure.
use super::Config;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// One key two documents set differently; a key one of them lacks reads `(unset)`.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDifference {
    pub key: String,
    pub a: String,
    pub b: String,
}

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

/// Every leaf key (`train.lr`, `oom.escalate`: lists compare whole) whose value differs, in
/// key order.
pub fn differing_keys(a: &Value, b: &Value) -> Vec<KeyDifference> {
    let (mut fa, mut fb) = (BTreeMap::new(), BTreeMap::new());
    flatten("", a, &mut fa);
    flatten("", b, &mut fb);
    let keys: BTreeSet<&String> = fa.keys().chain(fb.keys()).collect();
    let unset = "(unset)".to_string();
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (fa.get(k).unwrap_or(&unset), fb.get(k).unwrap_or(&unset));
            (x != y).then(|| KeyDifference { key: k.clone(), a: x.clone(), b: y.clone() })
        })
        .collect()
}

/// The keys the ranks of one run may set differently, with why (README's torchrun section
/// lists them). Every other key changes the maths, the collectives' shapes or when the ranks
/// meet, so a rank that differs there would train something else or hang its peers.
pub const PER_RANK_KEYS: [(&str, &str); 13] = [
    ("out_dir", "rank 0 alone writes; the ranks' resume points are compared on their own"),
    ("device", "each rank has its own GPU"),
    ("data.source", "nodes may mount the corpus at different paths; the tokens loaded are compared instead"),
    ("init_from", "every rank starts from rank 0's weights"),
    ("train.micro_batch_size", "a node with a smaller GPU may take smaller micro-batches: the rank's share and the update stay the same"),
    ("train.threads", "a node's CPU"),
    ("train.max_duration", "a torchrun restart gives each rank what is left of its own budget; the ranks agree on every stop"),
    ("memory", "memory savers and allocator settings change no result"),
    ("metrics", "rank 0 alone reports"),
    ("notify", "rank 0 alone notifies"),
    ("faults", "tests inject a failure on one rank"),
    ("dist.timeout_s", "how long a rank waits"),
    ("dist.writer_wait_s", "how long a rank waits for rank 0's writing"),
];

/// `cfg` as JSON with the [`PER_RANK_KEYS`] removed: what every rank of a run must agree on.
pub fn shared_by_ranks(cfg: &Config) -> Value {
    let mut v = serde_json::to_value(cfg).expect("a Config always serialises");
    for (key, _) in PER_RANK_KEYS {
        let mut path: Vec<&str> = key.split('.').collect();
        let last = path.pop().expect("a key has a name");
        let parent = path.iter().try_fold(&mut v, |node, k| node.get_mut(*k));
        if let Some(Value::Object(m)) = parent {
            m.remove(last);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(cfg: &Config) -> Value {
        serde_json::to_value(cfg).unwrap()
    }

    #[test]
    fn only_the_keys_set_differently_are_listed_in_order() {
        let a = Config::default();
        let mut b = Config::default();
        b.train.lr = 0.5;
        b.model.n_layer = 7;
        b.init_from = Some("hf".into());
        let d = differing_keys(&json(&a), &json(&b));
        let keys: Vec<&str> = d.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["init_from", "model.n_layer", "train.lr"]);
        assert_eq!(d[1], KeyDifference { key: "model.n_layer".into(), a: "2".into(), b: "7".into() });
        assert_eq!(d[0].a, "null");
        assert!(differing_keys(&json(&a), &json(&a)).is_empty());
        let lacking = serde_json::json!({"train": {}});
        assert_eq!(differing_keys(&lacking, &serde_json::json!({"train": {"lr": 1}}))[0].a, "(unset)");
    }

    #[test]
    fn the_per_rank_keys_are_left_out_and_nothing_else() {
        let a = Config::default();
        let mut b = Config {
            out_dir: "elsewhere".into(),
            device: "cuda:3".into(),
            init_from: Some("hf".into()),
            ..Config::default()
        };
        b.data.source = "tokens:/mnt/node7/corpus.bin".into();
        b.train.micro_batch_size = 1;
        b.train.threads = Some(3);
        b.train.max_duration = Some("15.2s".into());
        b.memory.activation_checkpointing = "full".into();
        b.metrics.tensorboard = true;
        b.faults.crash_at_step = Some(4);
        b.dist.timeout_s = 7;
        b.dist.writer_wait_s = Some(60);
        assert_eq!(differing_keys(&shared_by_ranks(&a), &shared_by_ranks(&b)), vec![]);
        // What stays: the same keys' neighbours.
        b.data.val_fraction = 0.3;
        b.train.global_batch_size = 3;
        b.dist.bucket_mb = 1.0;
        let keys: Vec<String> =
            differing_keys(&shared_by_ranks(&a), &shared_by_ranks(&b)).into_iter().map(|d| d.key).collect();
        assert_eq!(keys, ["data.val_fraction", "dist.bucket_mb", "train.global_batch_size"]);
        // Each listed key names a real one (a renamed key would silently be compared again).
        let full = json(&a);
        for (key, _) in PER_RANK_KEYS {
            assert!(
                key.split('.').try_fold(&full, |node, k| node.get(k)).is_some(),
                "{key} is not a config key"
            );
        }
    }
}
