//! Batch arithmetic, pure: how a global batch becomes per-rank batches, micro-batches and an
//! accumulation count, and how each micro-batch's loss is weighted so that the gradient is the
//! mean over the whole batch however it was split.
use std::ops::Range;

/// Accumulation steps for `global` sequences split over `world` ranks in micro-batches of
/// `micro`: the micro-steps of the largest rank share. Nothing has to divide anything: the last
/// micro-batch of a step takes the remainder (480 = 7 × 64 + 32), and ranks' shares differ by at
/// most one sequence; the loss weights keep the update the mean over the whole batch.
pub fn accumulation(global: usize, micro: usize, world: usize) -> Result<usize, String> {
    if micro == 0 || world == 0 {
        return Err("micro-batch and world size must be at least 1".into());
    }
    if global < world {
        return Err(format!(
            "{global} sequences cannot be shared by {world} ranks: every rank needs at least one"
        ));
    }
    let largest = global.div_ceil(world);
    if micro > largest {
        return Err(format!(
            "micro_batch_size {micro} exceeds each rank's share of the global batch ({global} / {world} ranks = {largest}); \
             pick a micro-batch of at most {largest}"
        ));
    }
    Ok(micro_steps(largest, micro))
}

/// How a step's batch is split, in words: `global 64 = micro 16 × accumulation 2 × world 2`
/// where that product holds, else the split of a global batch no product gives (7 over 2 ranks at
/// micro 3: shares of 4 and 3, each in micro-steps of 3 and the remainder).
pub fn describe(global: usize, micro: usize, accumulation: usize, world: usize) -> String {
    if micro * accumulation * world == global {
        return format!("global {global} = micro {micro} × accumulation {accumulation} × world {world}");
    }
    let (high, low) = (global.div_ceil(world.max(1)), global / world.max(1));
    let shares = if world <= 1 || high == low { format!("{high}") } else { format!("{high} or {low}") };
    format!("global {global} over world {world}: {shares} a rank, in up to {accumulation} micro-steps of {micro} (the last takes the remainder)")
}

/// A per-rank batch of `n` sequences in micro-steps of `micro`, in words: `20 × 3` where it
/// divides, else with the remainder the last micro-step takes: `21 × 12 + 4`; `n` alone when
/// it is under `micro`.
pub fn micro_steps_in_words(n: usize, micro: usize) -> String {
    let micro = micro.max(1);
    match n % micro {
        _ if n < micro => format!("{n}"),
        0 => format!("{micro} × {}", n / micro),
        rest => format!("{micro} × {} + {rest}", n / micro),
    }
}

/// The global sample indices rank `rank` of `world` takes from a batch of `global`:
/// `[rank·global/world, (rank+1)·global/world)`. Shares are equal when `world` divides `global`
/// and differ by one sequence otherwise.
pub fn rank_slice(global: usize, world: usize, rank: usize) -> Range<usize> {
    let edge = |r: usize| (r as u128 * global as u128 / world.max(1) as u128) as usize;
    edge(rank)..edge(rank + 1)
}

/// Sequences the busiest rank processes per step (what its memory must hold): ⌈global / world⌉.
pub fn rank_share(global: usize, world: usize) -> Option<usize> {
    (world > 0).then(|| global.div_ceil(world))
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

/// The factor a micro-batch's mean loss is multiplied by: its share of the tokens of a mean rank
/// share (`global / world` sequences; all sequences have the same length). Averaged over the ranks
/// this gives every sequence of the global batch the same weight, also when the ranks' shares
/// differ by one. With equal shares it is the micro-batch's share of its rank's batch.
pub fn loss_weight(micro_len: usize, global: usize, world: usize) -> f64 {
    micro_len as f64 / (global as f64 / world as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_steps_in_words_say_the_remainder() {
        assert_eq!(micro_steps_in_words(256, 21), "21 × 12 + 4");
        assert_eq!(micro_steps_in_words(60, 20), "20 × 3");
        assert_eq!(micro_steps_in_words(3, 8), "3", "one micro-step, smaller than the size");
    }

    #[test]
    fn a_split_is_described_as_a_product_only_where_it_is_one() {
        assert_eq!(describe(64, 16, 2, 2), "global 64 = micro 16 × accumulation 2 × world 2");
        assert_eq!(describe(7, 3, accumulation(7, 3, 2).unwrap(), 2), "global 7 over world 2: 4 or 3 a rank, in up to 2 micro-steps of 3 (the last takes the remainder)");
        assert_eq!(
            describe(9, 3, accumulation(9, 3, 3).unwrap(), 3),
            "global 9 = micro 3 × accumulation 1 × world 3"
        );
        assert_eq!(describe(480, 64, accumulation(480, 64, 1).unwrap(), 1), "global 480 over world 1: 480 a rank, in up to 8 micro-steps of 64 (the last takes the remainder)");
    }

    #[test]
    fn accumulation_takes_the_remainder_in_a_last_short_micro_batch() {
        assert_eq!(accumulation(32, 8, 1), Ok(4));
        assert_eq!(accumulation(32, 8, 2), Ok(2));
        assert_eq!(accumulation(32, 32, 1), Ok(1));
        assert_eq!(accumulation(480, 64, 1), Ok(8), "7 × 64 + 32");
        assert_eq!(accumulation(30, 8, 1), Ok(4));
        assert_eq!(accumulation(32, 8, 3), Ok(2), "shares 10, 11, 11: two micro-steps each");
        assert!(accumulation(32, 0, 1).is_err());
        let e = accumulation(32, 12, 3).unwrap_err();
        assert!(e.contains("exceeds each rank's share") && e.contains("at most 11"), "{e}");
        assert!(accumulation(2, 1, 3).unwrap_err().contains("at least one"));
    }

    #[test]
    fn rank_slices_tile_the_global_batch_and_differ_by_at_most_one() {
        assert_eq!(rank_slice(32, 4, 1), 8..16);
        for (g, w) in [(32, 4), (30, 4), (480, 7), (5, 5), (7, 3)] {
            let slices: Vec<_> = (0..w).map(|r| rank_slice(g, w, r)).collect();
            let covered: Vec<usize> = slices.iter().cloned().flatten().collect();
            assert_eq!(covered, (0..g).collect::<Vec<_>>());
            let (min, max) = (
                slices.iter().map(|s| s.len()).min().unwrap(),
                slices.iter().map(|s| s.len()).max().unwrap(),
            );
            assert!(max - min <= 1 && Some(max) == rank_share(g, w), "{g}/{w}: {slices:?}");
        }
        assert_eq!(rank_share(30, 0), None);
    }

    #[test]
    fn loss_weights_over_uneven_ranks_give_every_sequence_the_same_weight() {
        // Mean over ranks of each rank's weighted sum = the plain mean over the global batch.
        for (g, w, m) in [(30, 4, 3), (480, 7, 64), (24, 1, 5)] {
            let total: f64 = (0..w)
                .map(|r| split(rank_slice(g, w, r).len(), m).map(|p| loss_weight(p.len(), g, w)).sum::<f64>())
                .sum::<f64>()
                / w as f64;
            assert!((total - 1.0).abs() < 1e-12, "{g}/{w}/{m}: {total}");
        }
        assert_eq!(loss_weight(4, 32, 1), 0.125, "exact with equal shares");
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
}
