//! The recommendation, pure: the largest micro-batch that divides the per-GPU batch and fits
//! within `margin × capacity`, its accumulation and utilisation; when nothing fits even at
//! micro-batch 1, by how much, and which levers (optimizer, precision, activation checkpointing
//! of every block or of the fewest first blocks that suffice, flash attention, a shorter
//! sequence) close the gap, each with its estimated saving.
//! Also the search used by the measurement: double, then bisect.
use super::estimate::estimate;
use super::shape::{Lever, Precision, Setup, Transformer, OPTIMIZERS};
use serde::Serialize;

/// What a run may use on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Budget {
    pub capacity: u64,
    /// Share of the capacity a plan may fill (default 0.85).
    pub margin: f64,
}

impl Budget {
    pub fn bytes(&self) -> u64 {
        (self.capacity as f64 * self.margin).floor() as u64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recommendation {
    pub fits: bool,
    pub capacity_bytes: u64,
    pub margin: f64,
    pub budget_bytes: u64,
    /// Sequences per GPU per optimizer step (global batch / GPUs), when a global batch is known.
    pub rank_batch: Option<u64>,
    /// Largest micro-batch that fits (a last, shorter micro-batch takes the remainder).
    pub micro_batch: Option<u64>,
    pub accumulation: Option<u64>,
    /// Largest micro-batch that fits with accumulation (may exceed a `rank_batch`-bounded choice: none).
    pub largest_fitting: Option<u64>,
    /// Estimated total at the recommendation (at micro-batch 1 when nothing fits).
    pub total_bytes: u64,
    /// `total / capacity`.
    pub utilisation: f64,
    /// Nothing fits: total at micro-batch 1 minus the budget.
    pub over_by_bytes: Option<u64>,
    /// Nothing fits: what each change would save at micro-batch 1, largest saving first.
    pub levers: Vec<Lever>,
}

/// Largest `b` in `1..=limit` for which `fits(b)` holds, assuming that once a size does not fit
/// no larger one does: doubling from 1, then bisection between the last fit and the first miss.
/// `None` when 1 does not fit. Calls `fits` O(log limit) times.
pub fn largest_fitting(limit: u64, mut fits: impl FnMut(u64) -> bool) -> Option<u64> {
    if limit == 0 || !fits(1) {
        return None;
    }
    let mut lo = 1;
    let hi = loop {
        if lo == limit {
            return Some(lo);
        }
        let next = (lo * 2).min(limit);
        if !fits(next) {
            break next;
        }
        lo = next;
    };
    let mut hi = hi; // fits(lo), !fits(hi)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// The estimated total at micro-batch `b` for a per-GPU batch `rank_batch` (unknown: assume
/// accumulation, the conservative case).
pub fn total_at(model: &Transformer, setup: &Setup, rank_batch: Option<u64>, b: u64) -> u64 {
    let accumulation = rank_batch.map_or(2, |r| r.div_ceil(b));
    estimate(model, setup, b, accumulation).total
}

/// The micro-batch to run a per-GPU batch of `rank_batch` at, where `largest` is the largest
/// that fits: the size with as many micro-steps (as fast) that divides the batch, where one
/// does, else `largest` (its last micro-step takes the remainder). 25 fits a batch of 60:
/// 20 × 3 rather than 25 + 25 + 10, with less memory held.
pub fn dividing_size(rank_batch: u64, largest: u64) -> u64 {
    let k = rank_batch.div_ceil(largest.max(1)).max(1);
    if rank_batch.is_multiple_of(k) {
        rank_batch / k
    } else {
        largest
    }
}

pub fn recommend(
    model: &Transformer,
    setup: &Setup,
    rank_batch: Option<u64>,
    budget: Budget,
) -> Recommendation {
    let limit = budget.bytes();
    let cost = |b: u64| total_at(model, setup, rank_batch, b);
    // Divisibility aside, with accumulation (monotone in b).
    let search_limit = rank_batch.unwrap_or(1 << 20);
    let largest = largest_fitting(search_limit, |b| estimate(model, setup, b, 2).total <= limit);
    let chosen = match rank_batch {
        // Any size works (the last micro-batch takes the remainder). At b = rank_batch there is
        // no accumulation and the held gradients vanish, so that size can fit when a smaller
        // one does not; below it the cost grows with b.
        Some(r) if cost(r) <= limit => Some(r),
        Some(r) => largest_fitting(r.saturating_sub(1), |b| cost(b) <= limit).map(|b| dividing_size(r, b)),
        None => largest,
    };
    let base = Recommendation {
        fits: chosen.is_some(),
        capacity_bytes: budget.capacity,
        margin: budget.margin,
        budget_bytes: limit,
        rank_batch,
        micro_batch: chosen,
        accumulation: chosen.and_then(|b| rank_batch.map(|r| r.div_ceil(b))),
        largest_fitting: largest.max(chosen),
        total_bytes: 0,
        utilisation: 0.0,
        over_by_bytes: None,
        levers: Vec::new(),
    };
    let total = cost(chosen.unwrap_or(1));
    let utilisation = total as f64 / budget.capacity as f64;
    match chosen {
        Some(_) => Recommendation { total_bytes: total, utilisation, ..base },
        None => Recommendation {
            total_bytes: total,
            utilisation,
            over_by_bytes: Some(total - limit),
            levers: levers(model, setup, rank_batch, limit),
            ..base
        },
    }
}

/// Each change on its own at micro-batch 1, then the model-preserving ones together.
pub fn levers(model: &Transformer, setup: &Setup, rank_batch: Option<u64>, limit: u64) -> Vec<Lever> {
    let now = total_at(model, setup, rank_batch, 1);
    let mut options: Vec<(String, Transformer, Setup)> = Vec::new();
    for o in OPTIMIZERS.into_iter().filter(|&o| o != setup.optimizer) {
        options.push((
            format!("optimizer {} instead of {}", o.name(), setup.optimizer.name()),
            model.clone(),
            Setup { optimizer: o, ..setup.clone() },
        ));
    }
    let precisions: &[Precision] = match setup.precision {
        Precision::Fp32 => &[Precision::Bf16Mixed, Precision::Bf16Pure],
        Precision::Bf16Mixed | Precision::Fp16Mixed => &[Precision::Bf16Pure],
        Precision::Bf16Pure => &[],
    };
    for &p in precisions {
        options.push((
            format!("precision {} instead of {}", p.name(), setup.precision.name()),
            model.clone(),
            Setup { precision: p, ..setup.clone() },
        ));
    }
    let checkpointed = setup.checkpointed_blocks(model);
    if checkpointed < model.layers {
        let change = match checkpointed {
            0 => "activation checkpointing".to_string(),
            m => format!("activation checkpointing of every block instead of the first {m}"),
        };
        options.push((
            change,
            model.clone(),
            Setup { activation_checkpointing: true, checkpoint_first: None, ..setup.clone() },
        ));
        // The fewest first blocks that close the gap, when fewer than all do: less to recompute.
        // Each checkpointed block lowers the total, so the search counts the blocks left out
        // (k, f = layers - k) and bisects: a scan of every f, each estimate itself a walk over
        // the layers, took a minute at a thousand layers.
        let first = |f: u64| Setup {
            activation_checkpointing: true,
            checkpoint_first: Some(f),
            checkpoint_blocks: 1,
            ..setup.clone()
        };
        let left_out = largest_fitting(model.layers - 1 - checkpointed, |k| {
            total_at(model, &first(model.layers - k), rank_batch, 1) <= limit
        });
        if let Some(f) = left_out.map(|k| model.layers - k) {
            let change =
                format!("activation checkpointing, first {f} of {} blocks (first_n:{f})", model.layers);
            options.push((change, model.clone(), first(f)));
        }
    }
    if !setup.flash {
        options.push(("flash attention".into(), model.clone(), Setup { flash: true, ..setup.clone() }));
    }
    let chunk = (model.seq_len / 4).clamp(1, 1024);
    if setup.loss_chunk_tokens.is_none() && chunk < model.seq_len {
        let change = format!("chunked loss (memory.loss_chunk_tokens: {chunk})");
        options.push((change, model.clone(), Setup { loss_chunk_tokens: Some(chunk), ..setup.clone() }));
    }
    if !setup.fused_cross_entropy {
        // Same maths, less memory: the logits stay in their dtype, no fp32 log-probabilities.
        let change = "fused cross-entropy (kernels.fused_cross_entropy: true)".to_string();
        options.push((change, model.clone(), Setup { fused_cross_entropy: true, ..setup.clone() }));
    }
    if setup.fused_cross_entropy && !setup.fused_loss_gradient {
        // Same maths, one logits-sized buffer less: the gradient written over the logits.
        let change = "the loss's gradient in its forward (kernels.fused_loss_gradient: true)".to_string();
        options.push((change, model.clone(), Setup { fused_loss_gradient: true, ..setup.clone() }));
    }
    if model.seq_len >= 2 {
        let half = model.seq_len / 2;
        options.push((
            format!("sequence length {half} instead of {}", model.seq_len),
            Transformer { seq_len: half, ..model.clone() },
            setup.clone(),
        ));
    }
    let mut out: Vec<Lever> = options
        .into_iter()
        .map(|(change, m, s)| (change, total_at(&m, &s, rank_batch, 1)))
        .filter(|(_, total)| *total < now)
        .map(|(change, total)| Lever {
            change,
            saving_bytes: now - total,
            total_bytes: total,
            closes_gap: total <= limit,
        })
        .collect();
    out.sort_by(|a, b| b.saving_bytes.cmp(&a.saving_bytes).then_with(|| a.change.cmp(&b.change)));

    // Everything that keeps the model and the task: the lightest optimizer, the lightest
    // precision, checkpointing, flash, the fused cross-entropy with its gradient in the forward.
    let all = Setup {
        activation_checkpointing: true,
        checkpoint_first: None,
        flash: true,
        fused_cross_entropy: true,
        fused_loss_gradient: true,
        loss_chunk_tokens: setup.loss_chunk_tokens.or(Some(chunk)),
        precision: precisions.last().copied().unwrap_or(setup.precision),
        ..setup.clone()
    };
    let best = OPTIMIZERS
        .into_iter()
        .map(|o| (o, total_at(model, &Setup { optimizer: o, ..all.clone() }, rank_batch, 1)))
        .min_by_key(|&(_, t)| t)
        .expect("at least one optimizer");
    if best.1 < now {
        out.push(Lever {
            change: format!(
                "all together: optimizer {}, precision {}, activation checkpointing, flash attention, fused cross-entropy, loss in chunks of {} tokens",
                best.0.name(),
                all.precision.name(),
                all.loss_chunk_tokens.unwrap_or(chunk)
            ),
            saving_bytes: now - best.1,
            total_bytes: best.1,
            closes_gap: best.1 <= limit,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    use crate::planner::estimate::fixtures::{cuda_fp32_adamw as setup, gpt2_small as gpt2};

    #[test]
    fn search_doubles_then_bisects_to_the_exact_boundary() {
        for limit_fit in [1u64, 2, 3, 7, 8, 9, 100, 1000] {
            let mut calls = 0;
            let got = largest_fitting(1 << 20, |b| {
                calls += 1;
                b <= limit_fit
            });
            assert_eq!(got, Some(limit_fit));
            assert!(calls <= 2 * 64, "{calls} calls");
        }
        assert_eq!(largest_fitting(1 << 20, |_| false), None);
        assert_eq!(
            largest_fitting(48, |_| true),
            Some(48),
            "capped at the limit, which need not be a power of two"
        );
        assert_eq!(largest_fitting(48, |b| b <= 40), Some(40));
    }

    #[test]
    fn the_margin_decides_and_the_choice_need_not_divide_the_batch() {
        let (m, s) = (gpt2(), setup());
        // A capacity where the per-sample slope places the boundary at 25, which does not divide 60.
        let e = estimate(&m, &s, 1, 2);
        let capacity = ((e.fixed + 25 * e.per_sample + e.per_sample / 2) as f64 / 0.85) as u64;
        let tight = recommend(&m, &s, Some(60), Budget { capacity, margin: 0.85 });
        assert!(tight.fits);
        assert_eq!(tight.largest_fitting, Some(25));
        assert_eq!((tight.micro_batch, tight.accumulation), (Some(20), Some(3)), "20 × 3, not 25 + 25 + 10");
        // 61 has no size with three micro-steps that divides it: 25 + 25 + 11.
        let odd = recommend(&m, &s, Some(61), Budget { capacity, margin: 0.85 });
        assert_eq!((odd.micro_batch, odd.accumulation), (Some(25), Some(3)));
        assert!(tight.total_bytes <= tight.budget_bytes);
        assert!(total_at(&m, &s, Some(60), 26) > tight.budget_bytes, "the next size up does not fit");
        assert!(total_at(&m, &s, Some(60), 20) <= total_at(&m, &s, Some(60), 25));
        assert!((tight.utilisation - tight.total_bytes as f64 / capacity as f64).abs() < 1e-12);
        // The whole card: the budget grows by 15%, enough for more.
        let loose = recommend(&m, &s, Some(60), Budget { capacity, margin: 1.0 });
        assert!(loose.micro_batch.unwrap() > 25);
        assert_eq!(loose.accumulation, Some(60u64.div_ceil(loose.micro_batch.unwrap())));
    }

    #[test]
    fn the_whole_batch_in_one_micro_step_drops_the_held_gradients() {
        let (m, s) = (gpt2(), setup());
        let (two, one) = (estimate(&m, &s, 8, 2).total, estimate(&m, &s, 8, 1).total);
        assert!(one < two);
        // A budget between the two: 8 fits only as the whole per-GPU batch.
        let capacity = (one + two) / 2;
        let r = recommend(&m, &s, Some(8), Budget { capacity, margin: 1.0 });
        assert_eq!((r.micro_batch, r.accumulation), (Some(8), Some(1)));
    }

    #[test]
    fn without_a_global_batch_the_largest_fitting_size_is_recommended() {
        let (m, s) = (gpt2(), setup());
        let r = recommend(&m, &s, None, Budget { capacity: 80 * GIB, margin: 0.85 });
        let b = r.micro_batch.unwrap();
        assert!(estimate(&m, &s, b, 2).total <= r.budget_bytes);
        assert!(estimate(&m, &s, b + 1, 2).total > r.budget_bytes);
        assert_eq!(r.accumulation, None);
    }

    #[test]
    fn nothing_fits_says_by_how_much_and_which_levers_close_the_gap() {
        let m = Transformer {
            layers: 32,
            hidden: 4096,
            heads: 32,
            vocab: 128_256,
            seq_len: 8192,
            ffn: 14_336,
            bias: false,
            params_override: Some(8_030_261_248),
            ..Default::default()
        };
        let s = Setup { precision: Precision::Bf16Mixed, ..setup() };
        let r = recommend(&m, &s, Some(64), Budget { capacity: 40 * GIB, margin: 0.85 });
        assert!(!r.fits);
        assert_eq!(r.micro_batch, None);
        let now = total_at(&m, &s, Some(64), 1);
        assert_eq!(r.over_by_bytes, Some(now - r.budget_bytes));
        assert!(r.levers.len() >= 5, "{:#?}", r.levers);
        for l in &r.levers {
            assert_eq!(l.saving_bytes, now - l.total_bytes, "{}", l.change);
            assert_eq!(l.closes_gap, l.total_bytes <= r.budget_bytes);
        }
        let singles: Vec<_> = r.levers.iter().filter(|l| !l.change.starts_with("all")).collect();
        assert!(singles.windows(2).all(|w| w[0].saving_bytes >= w[1].saving_bytes), "largest saving first");
        let names: Vec<&str> = r.levers.iter().map(|l| l.change.as_str()).collect();
        for want in [
            "optimizer adamw8bit",
            "precision bf16-pure",
            "activation checkpointing",
            "sequence length 4096",
            "chunked loss (memory.loss_chunk_tokens: 1024)",
            "fused cross-entropy",
        ] {
            assert!(names.iter().any(|n| n.starts_with(want)), "{want} missing from {names:?}");
        }
        // The 8-bit optimizer saves 6 of AdamW's 8 bytes per parameter (less the block scales).
        let eight = r.levers.iter().find(|l| l.change.starts_with("optimizer adamw8bit")).unwrap();
        let p = 8_030_261_248f64;
        let with_margin = 6.0 * p * (1.0 + s.fragmentation);
        assert!(
            (eight.saving_bytes as f64 / with_margin - 1.0).abs() < 0.02,
            "{}",
            eight.saving_bytes as f64 / p
        );
        // 8B with mixed precision needs 18 bytes/param: no single lever fits it into 34 GiB.
        assert!(singles.iter().all(|l| !l.closes_gap));
        // The fused loss keeps 2 + 2 bytes a logit (bf16 logits and their gradient) and a
        // log-sum-exp a row where CUDA autocast's holds 4 + 4 + 2 (the logits' 2 are freed).
        // Here the head's backward (the 2-byte logit gradient beside the head's weight
        // gradient, 2 × 8192 × v bytes at 4096 wide, and the fp32 hidden gradient) is then the
        // larger moment: the saving is the 10 bytes a logit less that.
        let fused = r.levers.iter().find(|l| l.change.starts_with("fused cross-entropy")).unwrap();
        let logits = (8192 * m.padded_vocab()) as f64;
        let head_backward = 2.0 * logits + (m.padded_vocab() * 4096 * 4) as f64 + (8192 * 4096 * 4) as f64;
        let expected = (10.0 * logits - head_backward) * (1.0 + s.fragmentation);
        assert!(
            (fused.saving_bytes as f64 / expected - 1.0).abs() < 0.01,
            "saves {} of {expected}",
            fused.saving_bytes
        );
        let already = recommend(
            &m,
            &Setup { fused_cross_entropy: true, ..s.clone() },
            Some(64),
            Budget { capacity: 40 * GIB, margin: 0.85 },
        );
        assert!(already.levers.iter().all(|l| !l.change.starts_with("fused")), "no lever for what is on");
        // The head's backward, not the loss's second logits buffer, sets that moment here:
        // writing the gradient in the forward saves nothing, so it is no lever.
        assert!(
            already.levers.iter().all(|l| !l.change.starts_with("the loss's gradient")),
            "{:#?}",
            already.levers
        );
    }

    /// GPT-2 at sequence 8192 (768 wide, 16-bit logits) that does not fit even at micro-batch 1
    /// with the two-pass fused loss: writing the loss's gradient in the forward is a lever,
    /// saving a logits-sized buffer less what the head's backward holds beside the logits (its
    /// weight's and the hidden state's gradients); none once it is on.
    #[test]
    fn the_loss_gradient_in_the_forward_is_a_lever_where_the_logits_dominate() {
        let m = Transformer { seq_len: 8192, ..gpt2() };
        let s = Setup { precision: Precision::Bf16Mixed, fused_cross_entropy: true, ..setup() };
        let budget = Budget { capacity: total_at(&m, &s, Some(64), 1), margin: 0.85 };
        let r = recommend(&m, &s, Some(64), budget);
        assert!(!r.fits);
        let lever = r
            .levers
            .iter()
            .find(|l| l.change.starts_with("the loss's gradient in its forward"))
            .expect("the in-forward lever");
        let tokens = 8192;
        let expected = (2 * tokens * m.padded_vocab() + 4 * tokens
            - m.padded_vocab() * 768 * 4
            - tokens * 768 * 4) as f64
            * (1.0 + s.fragmentation);
        assert!(
            (lever.saving_bytes as f64 / expected - 1.0).abs() < 0.01,
            "saves {} of {expected}",
            lever.saving_bytes
        );
        let on = recommend(&m, &Setup { fused_loss_gradient: true, ..s.clone() }, Some(64), budget);
        assert!(
            on.levers.iter().all(|l| !l.change.starts_with("the loss's gradient")),
            "no lever for what is on"
        );
    }

    /// A budget between full checkpointing's total and no checkpointing's: the levers name the
    /// fewest first blocks whose checkpointing closes the gap, one block fewer does not.
    #[test]
    fn the_fewest_first_blocks_that_close_the_gap_are_a_lever() {
        let (m, s) = (gpt2(), setup());
        let full = Setup { activation_checkpointing: true, ..s.clone() };
        let (plain, all) = (total_at(&m, &s, Some(64), 1), total_at(&m, &full, Some(64), 1));
        let capacity = (plain + all) / 2;
        let r = recommend(&m, &s, Some(64), Budget { capacity, margin: 1.0 });
        assert!(!r.fits);
        let lever = r.levers.iter().find(|l| l.change.contains("first_n:")).expect("a first_n lever");
        let f: u64 = lever.change.rsplit("first_n:").next().unwrap().trim_end_matches(')').parse().unwrap();
        assert!(lever.closes_gap && (1..m.layers).contains(&f), "{lever:?}");
        let fewer = Setup { checkpoint_first: Some(f - 1), ..full.clone() };
        assert!(f == 1 || total_at(&m, &fewer, Some(64), 1) > capacity, "{} blocks would do", f - 1);
        assert!(r
            .levers
            .iter()
            .any(|l| l.change == "activation checkpointing" && l.saving_bytes > lever.saving_bytes));
    }
}
