//! Batch arithmetic, pure: how a global batch becomes per-rank batches, micro-batches and an
//! accumulation count, and how each micro-batch's loss is weighted so that the gradient is the
//! mean over the whole batch however it was split.
use std::ops::Range;

/// Accumulation steps for `global` sequences split over `world` ranks in micro-batches of
/// `micro`. The configured split must be exact; only the OOM guard may make the last
/// micro-batch smaller.
pub fn accumulation(global: usize, micro: usize, world: usize) -> Result<usize, String> {
    if micro == 0 || world == 0 {
        return Err("micro-batch and world size must be at least 1".into());
    }
    if global % (micro * world) != 0 {
        return Err(format!(
            "{global} is not divisible by micro_batch_size × world size ({micro} × {world} = {}); \
             pick a micro-batch that divides {}",
            micro * world,
            global / world.max(1)
        ));
    }
    Ok(global / (micro * world))
}

/// Sequences per rank when `global` is split over `world` ranks: every rank takes an equal share,
/// so `world` must divide `global`.
pub fn rank_share(global: usize, world: usize) -> Option<usize> {
    (world > 0 && global % world == 0).then(|| global / world)
}

/// The micro-batches of a per-rank batch of `n` sequences at micro-batch `micro`, as index
/// ranges into that batch. All but the last are exactly `micro` long.
/// Lazy: a batch of any size costs no host memory to split.
pub fn split(n: usize, micro: usize) -> impl Iterator<Item = Range<usize>> {
    assert!(micro > 0, "micro-batch must be positive");
    (0..n).step_by(micro).map(move |s| s..s.saturating_add(micro).min(n))
}

/// Number of micro-steps (accumulation) for `n` sequences at micro-batch `micro`.
pub fn micro_steps(n: usize, micro: usize) -> usize {
    n.div_ceil(micro)
}

/// The factor a micro-batch's mean loss is multiplied by: its share of the batch's tokens
/// (all sequences have the same length, so the share of sequences).
pub fn loss_weight(micro_len: usize, batch_len: usize) -> f64 {
    micro_len as f64 / batch_len as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulation_divides_the_global_batch() {
        assert_eq!(accumulation(32, 8, 1), Ok(4));
        assert_eq!(accumulation(32, 8, 2), Ok(2));
        assert_eq!(accumulation(32, 32, 1), Ok(1));
        let e = accumulation(30, 8, 1).unwrap_err();
        assert!(e.contains("30 is not divisible"), "{e}");
        assert!(accumulation(32, 8, 3).is_err());
        assert!(accumulation(32, 0, 1).is_err());
    }

    #[test]
    fn ranks_take_equal_shares() {
        assert_eq!(rank_share(32, 4), Some(8));
        assert_eq!(rank_share(30, 4), None);
        assert_eq!(rank_share(30, 0), None);
    }

    #[test]
    fn split_covers_every_index_once_with_a_short_tail() {
        let split = |n, m| super::split(n, m).collect::<Vec<_>>();
        assert_eq!(split(8, 4), vec![0..4, 4..8]);
        assert_eq!(split(12, 8), vec![0..8, 8..12]);
        assert_eq!(split(3, 8), vec![0..3]);
        for (n, m) in [(24, 5), (7, 1), (64, 16), (100, 33)] {
            let parts = split(n, m);
            assert_eq!(parts.len(), micro_steps(n, m));
            let covered: Vec<usize> = parts.into_iter().flatten().collect();
            assert_eq!(covered, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn loss_weights_sum_to_one_for_any_split() {
        for (n, m) in [(24, 5), (24, 24), (7, 2)] {
            let total: f64 = split(n, m).map(|r| loss_weight(r.len(), n)).sum();
            assert!((total - 1.0).abs() < 1e-12);
        }
    }
}
