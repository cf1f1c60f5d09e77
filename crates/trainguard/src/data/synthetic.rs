//! The built-in corpus: a first-order Markov chain over the vocabulary in which every token has
//! four possible successors with probabilities 0.5 / 0.25 / 0.15 / 0.10. Its conditional entropy
//! (1.21 nats) is far below its unigram entropy (about ln V), so a model that learns shows it
//! plainly. Fixed for a given vocabulary and length: every run sees the same corpus.
use super::sampler::mix;

const SUCCESSOR_PROBS: [f64; 4] = [0.5, 0.25, 0.15, 0.10];
const CORPUS_SEED: u64 = 0x7472_6169_6e67_7561; // "trainguа": any constant; fixed forever

/// The corpus of `len` tokens; `Err` when its memory cannot be had (a fallible reservation: the
/// length comes from the config).
pub fn generate(vocab: usize, len: usize) -> Result<Vec<u16>, std::collections::TryReserveError> {
    let successor = |tok: u64, j: u64| (mix(&[CORPUS_SEED, tok, j]) % vocab as u64) as u16;
    let mut out = Vec::new();
    out.try_reserve_exact(len)?;
    let mut cur: u16 = 0;
    for i in 0..len as u64 {
        out.push(cur);
        let u = (mix(&[CORPUS_SEED ^ 1, i]) >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        let mut pick = SUCCESSOR_PROBS.len() - 1;
        for (j, p) in SUCCESSOR_PROBS.iter().enumerate() {
            acc += p;
            if u < acc {
                pick = j;
                break;
            }
        }
        cur = successor(cur as u64, pick as u64);
    }
    Ok(out)
}

/// Entropy (nats) of the next token given the current one: the best loss a model can reach.
#[cfg(test)]
pub fn conditional_entropy() -> f64 {
    -SUCCESSOR_PROBS.iter().map(|p| p * p.ln()).sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_is_deterministic_and_in_vocab() {
        let a = generate(256, 10_000).unwrap();
        assert_eq!(a, generate(256, 10_000).unwrap());
        assert!(a.iter().all(|&t| (t as usize) < 256));
        let b = generate(50, 1000).unwrap();
        assert!(b.iter().all(|&t| (t as usize) < 50));
    }

    #[test]
    fn successors_follow_the_chain() {
        // Each token is followed by at most four distinct tokens.
        let a = generate(256, 200_000).unwrap();
        let mut next: std::collections::HashMap<u16, std::collections::HashSet<u16>> = Default::default();
        for w in a.windows(2) {
            next.entry(w[0]).or_default().insert(w[1]);
        }
        assert!(next.values().all(|s| s.len() <= 4));
        assert!((conditional_entropy() - 1.2080).abs() < 1e-3);
    }
}
