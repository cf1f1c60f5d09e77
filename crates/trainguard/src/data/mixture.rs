//! Weighted mixtures of sources (`data.sources`). Owns which source each sample is drawn from —
//! a pure function of (seed, step, index), so a step's samples stay the same in any split of
//! the batch, at any world size, in a replay after an out-of-memory and after a resume — where
//! each source's tokens sit in the mixture's concatenated splits, and how many samples of a step
//! each source gave. It reads no tokens itself: each source is its own [`Corpus`].
use super::sampler::mix;
use super::{Corpus, Split};
use std::ops::Range;

/// Keeps the choice of source apart from the choice of window (which hashes the same words).
const CHOICE_SALT: u64 = 0x6d69_7874_7572_6573; // "mixtures"

/// Normalised weights as cumulative shares: source `k` takes draws in
/// `[cumulative[k-1], cumulative[k])` of [0, 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    cumulative: Vec<f64>,
}

impl Weights {
    /// From positive, finite weights (validated by the config: `data.sources[i].weight`).
    pub fn new(weights: &[f64]) -> Self {
        let total: f64 = weights.iter().sum();
        let mut sum = 0.0;
        let mut cumulative: Vec<f64> = weights
            .iter()
            .map(|w| {
                sum += w;
                sum / total
            })
            .collect();
        // Rounding may leave the last share a hair below 1: every draw must land somewhere.
        if let Some(last) = cumulative.last_mut() {
            *last = 1.0;
        }
        Self { cumulative }
    }

    /// The source of sample `index` of draw `draw` (a training step, or a validation batch
    /// under a salted seed).
    pub fn choose(&self, seed: u64, draw: u64, index: usize) -> usize {
        // The top 53 bits as a uniform number in [0, 1).
        let u = (mix(&[seed ^ CHOICE_SALT, draw, index as u64]) >> 11) as f64 / (1u64 << 53) as f64;
        self.cumulative.partition_point(|&c| c <= u).min(self.cumulative.len() - 1)
    }

    /// How many of samples `indices` of `draw` each source gives.
    pub fn counts(&self, seed: u64, draw: u64, indices: Range<usize>) -> Vec<u64> {
        let mut n = vec![0u64; self.cumulative.len()];
        for i in indices {
            n[self.choose(seed, draw, i)] += 1;
        }
        n
    }
}

/// A mixture's sources, their names and weights.
pub struct Mixture {
    pub names: Vec<String>,
    pub weights: Weights,
    pub sources: Vec<Corpus>,
}

impl Mixture {
    /// Where source `k`'s `split` starts in the concatenation of every source's `split`.
    pub fn base(&self, split: Split, k: usize) -> usize {
        self.sources[..k].iter().map(|c| c.len(split)).sum()
    }

    /// The source holding position `pos` of the concatenated `split`, and the position in it.
    pub fn locate(&self, split: Split, mut pos: usize) -> (usize, usize) {
        for (k, c) in self.sources.iter().enumerate() {
            if pos < c.len(split) {
                return (k, pos);
            }
            pos -= c.len(split);
        }
        panic!("position past the end of the mixture's {split:?} split")
    }

    /// Copies `out.len()` tokens from `offset` of the concatenated `split` (across sources when
    /// asked: a digest's or a count's runs, never a sample's window).
    pub fn read(&self, split: Split, offset: usize, out: &mut [u32]) {
        let mut done = 0;
        while done < out.len() {
            let (k, local) = self.locate(split, offset + done);
            let n = (out.len() - done).min(self.sources[k].len(split) - local);
            self.sources[k].read(split, local, &mut out[done..done + n]);
            done += n;
        }
    }

    /// Each source's name with its share of the weights, for the log.
    pub fn describe(&self) -> String {
        let mut before = 0.0;
        let parts: Vec<String> = (0..self.sources.len())
            .map(|k| {
                let share = self.weights.cumulative[k] - before;
                before = self.weights.cumulative[k];
                format!("{} {:.1}% ({})", self.names[k], 100.0 * share, self.sources[k].description)
            })
            .collect();
        format!("mixture of {}", parts.join(", "))
    }
}

/// What changed between the mixture a checkpoint trained on and the one resuming it, by source
/// name (`name: weight then → now`, added or dropped sources), or None if nothing did.
pub fn weights_change(then: &[(String, f64)], now: &[(String, f64)]) -> Option<String> {
    let share = |all: &[(String, f64)], name: &str| {
        let total: f64 = all.iter().map(|(_, w)| w).sum();
        all.iter().find(|(n, _)| n == name).map(|(_, w)| w / total)
    };
    let mut names: Vec<&str> = then.iter().chain(now).map(|(n, _)| n.as_str()).collect();
    names.dedup();
    names.sort_unstable();
    names.dedup();
    let pct = |s: Option<f64>| s.map_or("absent".to_string(), |s| format!("{:.1}%", 100.0 * s));
    let changes: Vec<String> = names
        .into_iter()
        .filter_map(|n| {
            let (a, b) = (share(then, n), share(now, n));
            let same = match (a, b) {
                (Some(a), Some(b)) => (a - b).abs() < 1e-12,
                (None, None) => true,
                _ => false,
            };
            (!same).then(|| format!("{n} {} → {}", pct(a), pct(b)))
        })
        .collect();
    (!changes.is_empty()).then(|| format!("data mixture: {}", changes.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_follow_the_weights_within_one_percent_over_10000_samples() {
        let w = Weights::new(&[0.8, 0.2]);
        for seed in [0, 1, 1337] {
            let n = w.counts(seed, 7, 0..10_000);
            let share = n[0] as f64 / 10_000.0;
            assert!((share - 0.8).abs() < 0.01, "seed {seed}: {n:?}");
            assert_eq!(n[0] + n[1], 10_000);
        }
        // Over steps, as training draws them (64 samples per step).
        let mut n = [0u64; 2];
        for step in 0..157 {
            for (k, c) in w.counts(3, step, 0..64).into_iter().enumerate() {
                n[k] += c;
            }
        }
        assert!((n[1] as f64 / (157.0 * 64.0) - 0.2).abs() < 0.01, "{n:?}");
        // No bias: over 200 seeds the mean share is 0.8 within 0.1% (its standard error is 0.03%).
        let mean =
            (0..200).map(|seed| w.counts(seed, 0, 0..10_000)[0] as f64 / 10_000.0).sum::<f64>() / 200.0;
        assert!((mean - 0.8).abs() < 0.001, "{mean}");
        // Weights need not sum to one: 3 : 1 : 0.5 of 100,000.
        let n = Weights::new(&[3.0, 1.0, 0.5]).counts(9, 0, 0..100_000);
        for (k, want) in [3.0 / 4.5, 1.0 / 4.5, 0.5 / 4.5].into_iter().enumerate() {
            assert!((n[k] as f64 / 100_000.0 - want).abs() < 0.01, "{n:?}");
        }
    }

    #[test]
    fn the_choice_is_a_pure_function_of_seed_step_and_index() {
        let w = Weights::new(&[0.5, 0.5]);
        let a: Vec<usize> = (0..64).map(|i| w.choose(5, 11, i)).collect();
        // The same samples in any split of the batch (ranks, micro-batches, a replay).
        let halves: Vec<usize> = crate::data::batch::split(64, 3)
            .flat_map(|r| r.map(|i| w.choose(5, 11, i)).collect::<Vec<_>>())
            .collect();
        assert_eq!(a, halves);
        assert_ne!(a, (0..64).map(|i| w.choose(5, 12, i)).collect::<Vec<_>>(), "another step");
        assert_ne!(a, (0..64).map(|i| w.choose(6, 11, i)).collect::<Vec<_>>(), "another seed");
        // A single source always wins; a tiny weight still gets its share eventually.
        assert!((0..1000).all(|i| Weights::new(&[2.0]).choose(1, 1, i) == 0));
        assert!(Weights::new(&[1.0, 1e-3]).counts(1, 1, 0..100_000)[1] > 0);
    }

    #[test]
    fn a_mixture_reads_its_sources_as_one_sequence_per_split() {
        let m = Mixture {
            names: vec!["a".into(), "b".into()],
            weights: Weights::new(&[1.0, 1.0]),
            sources: vec![
                Corpus::synthetic(64, 1000, 0.1).unwrap(),
                Corpus::synthetic(64, 3000, 0.5).unwrap(),
            ],
        };
        assert_eq!((m.base(Split::Train, 1), m.base(Split::Val, 1)), (900, 100));
        assert_eq!(m.locate(Split::Val, 100), (1, 0));
        let mut across = [0u32; 6];
        m.read(Split::Train, 897, &mut across);
        let (mut a, mut b) = ([0u32; 3], [0u32; 3]);
        m.sources[0].read(Split::Train, 897, &mut a);
        m.sources[1].read(Split::Train, 0, &mut b);
        assert_eq!(across, [a, b].concat()[..]);
        assert!(m.describe().starts_with("mixture of a 50.0% (synthetic"), "{}", m.describe());
    }

    #[test]
    fn a_change_of_weights_is_said_by_source() {
        let w = |v: &[(&str, f64)]| v.iter().map(|(n, w)| (n.to_string(), *w)).collect::<Vec<_>>();
        assert_eq!(
            weights_change(&w(&[("web", 0.8), ("code", 0.2)]), &w(&[("web", 4.0), ("code", 1.0)])),
            None
        );
        assert_eq!(
            weights_change(&w(&[("web", 0.8), ("code", 0.2)]), &w(&[("web", 0.5), ("code", 0.5)])).unwrap(),
            "data mixture: code 20.0% → 50.0%, web 80.0% → 50.0%"
        );
        assert_eq!(
            weights_change(&w(&[("web", 1.0)]), &w(&[("web", 1.0), ("math", 1.0)])).unwrap(),
            "data mixture: math absent → 50.0%, web 100.0% → 50.0%"
        );
    }
}
