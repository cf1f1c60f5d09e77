//! What the ranks of a data-parallel run compare before they start together: rank 0's config
//! against each rank's (the [`PER_RANK_KEYS`] aside), the tokens each loaded (counts, and a
//! digest of tokens sampled across each split) and the trainguard version. A rank that differs
//! would train something else than its peers (another learning rate: weights that silently
//! diverge) or leave them waiting in a collective its own step never reaches (another model or
//! `max_steps`: a hang until `dist.timeout_s`, then an error that blames a slow rank). Instead
//! every rank stops at once, and the one that differs names the keys.
use super::DistError;
use crate::config::diff::{differing_keys, shared_by_ranks, PER_RANK_KEYS};
use crate::config::Config;
use crate::data::{Corpus, Split};
use crate::distributed::Dist;
use serde_json::{json, Value};

/// Why the ranks did not start together.
#[derive(Debug, thiserror::Error)]
pub enum StartMismatch {
    #[error("rank {rank}'s config differs from rank 0's: {}. Every rank must run the same config (the same YAML and --set) and the same trainguard build; only these may differ per rank: {}", .differences.join("; "), per_rank_keys())]
    DiffersFromRank0 { rank: usize, differences: Vec<String> },
    #[error("rank(s) {} stopped at the start comparison (each one's own error names why: config keys set differently from rank 0's, other tokens loaded, or a corpus it could not load); every rank stops", .ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "))]
    PeersDiffer { ranks: Vec<usize> },
    #[error(transparent)]
    Dist(#[from] DistError),
}

/// What a rank must share with rank 0; `corpus` is None where this rank could not load it.
fn start_document(cfg: &Config, corpus: Option<&Corpus>) -> Value {
    json!({
        "trainguard": env!("CARGO_PKG_VERSION"),
        "config": shared_by_ranks(cfg),
        "corpus": corpus.map(|c| json!({
            "train_tokens": c.len(Split::Train), "val_tokens": c.len(Split::Val),
            "train_sample": c.sample_digest(Split::Train), "val_sample": c.sample_digest(Split::Val),
        })),
    })
}

/// `key: rank 0 value, this rank value` for each key this rank sets differently. Nothing where
/// either could not load its corpus: that rank's own error says why.
fn differences_from_rank0(rank0: &Value, mine: &Value) -> Vec<String> {
    if rank0["corpus"].is_null() || mine["corpus"].is_null() {
        return vec![];
    }
    differing_keys(rank0, mine)
        .into_iter()
        .map(|d| format!("{}: rank 0 {}, this rank {}", d.key.trim_start_matches("config."), d.a, d.b))
        .collect()
}

/// The keys every rank may set on its own, for the error's advice.
pub fn per_rank_keys() -> String {
    PER_RANK_KEYS.map(|(k, _)| k).join(", ")
}

/// Every rank learns whether any differs from rank 0 or could not load its corpus; all of them
/// stop together if one does. Ok on the rank whose corpus failed: its caller reports that.
pub fn check_same_start(d: &Dist, cfg: &Config, corpus: Option<&Corpus>) -> Result<(), StartMismatch> {
    let mine = start_document(cfg, corpus);
    let rank0 = d.rank0_bytes(mine.to_string().as_bytes())?;
    let rank0: Value = serde_json::from_slice(&rank0).unwrap_or(Value::Null);
    let differences = differences_from_rank0(&rank0, &mine);
    let apart = d.flagged_ranks(!differences.is_empty() || corpus.is_none() || rank0.is_null())?;
    if corpus.is_none() {
        return Ok(());
    }
    if !differences.is_empty() {
        return Err(StartMismatch::DiffersFromRank0 { rank: d.rank, differences });
    }
    if !apart.is_empty() {
        return Err(StartMismatch::PeersDiffer { ranks: apart });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_names_the_keys_it_sets_differently_from_rank_0() {
        let corpus = Corpus::synthetic(256, 4096, 0.25).unwrap();
        let rank0 = Config::default();
        let mut mine = Config::default();
        let doc = |c: &Config, corpus: Option<&Corpus>| start_document(c, corpus);
        mine.train.micro_batch_size = 1; // may differ per rank
        assert_eq!(
            differences_from_rank0(&doc(&rank0, Some(&corpus)), &doc(&mine, Some(&corpus))),
            Vec::<String>::new()
        );
        mine.train.lr = 0.25;
        mine.model.n_layer = 5;
        assert_eq!(
            differences_from_rank0(&doc(&rank0, Some(&corpus)), &doc(&mine, Some(&corpus))),
            ["model.n_layer: rank 0 2, this rank 5", "train.lr: rank 0 0.003, this rank 0.25"]
        );
        // Other tokens under the same config: another corpus behind the same path.
        let other = Corpus::synthetic(256, 8192, 0.25).unwrap();
        let d = differences_from_rank0(&doc(&rank0, Some(&corpus)), &doc(&rank0, Some(&other)));
        assert_eq!(d.len(), 4, "{d:?}");
        for counts in [
            "corpus.train_tokens: rank 0 3072, this rank 6144",
            "corpus.val_tokens: rank 0 1024, this rank 2048",
        ] {
            assert!(d.iter().any(|line| line == counts), "{counts} in {d:?}");
        }
        // As many tokens, other ones: a node with another (or a stale) copy of the data.
        let dir = tempfile::tempdir().unwrap();
        let text = |name: &str, at: usize| {
            let mut bytes: Vec<u8> = (0..4096u32).map(|i| b'a' + (i % 26) as u8).collect();
            bytes[at] = b'!';
            std::fs::write(dir.path().join(name), bytes).unwrap();
            let data = crate::config::DataConfig {
                source: format!("text:{}", dir.path().join(name).display()),
                ..Default::default()
            };
            Corpus::load(&data, 256, 64, true).unwrap()
        };
        let (a, b) = (text("a.txt", 1000), text("b.txt", 2000));
        let d = differences_from_rank0(&doc(&rank0, Some(&a)), &doc(&rank0, Some(&b)));
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].starts_with("corpus.train_sample: rank 0 "), "{d:?}");
        // A rank that could not load its corpus, or rank 0 that could not: that rank's error speaks.
        assert!(differences_from_rank0(&doc(&rank0, None), &doc(&mine, Some(&corpus))).is_empty());
        assert!(differences_from_rank0(&doc(&rank0, Some(&corpus)), &doc(&mine, None)).is_empty());
    }
}
