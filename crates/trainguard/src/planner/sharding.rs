//! What `dist.shard` and `memory.offload_optimizer` change in one rank's memory, and what each
//! level sends over the wire a step (pure: a function of the model's tensors, the setup and the
//! world size). Owns the per-rank figures [`estimate`](super::estimate::estimate) adds up and
//! the choice of the cheapest level that fits ([`choose`]); it does not estimate activations.
//!
//! As the runtime lays it out (`distributed::shard`, `step::state_layout`, `distributed::zero`):
//! ownership is by whole tensor, [`Ownership::assign`] over the optimizer's parameters, and the
//! figures are for the rank with the largest share (its elements are the slot every rank pads
//! to). ψ = elements of all parameters, ψ_r = the largest share, N = world size, chunk =
//! [`LayoutSpec::chunk_for`]`(dist.bucket_mb, N)`:
//!
//! | level | device memory besides weights and activations | collectives (bytes sent a rank) |
//! |---|---|---|
//! | `none` | full gradients, fp32 all-reduce buckets 4ψ, all the optimizer state | all-reduce 2·4ψ·(N−1)/N |
//! | `optimizer` | as `none`, the owned parameters' state only; after the update fp32 (N+1)·chunk for the all-gather | that + all-gather 4·slot·(N−1) |
//! | `gradients` | full gradients through the micro-steps, no buckets; after the agreement the reduce-scatter: fp32 accumulators 4ψ_r + (N+1)·chunk beside the full gradients; owned state only; then the all-gather | reduce-scatter 4·slot·(N−1) + all-gather 4·slot·(N−1) |
//!
//! `memory.offload_optimizer` moves that state (and its scratch) to the host with copies of the
//! owned parameters in their dtype: on a GPU the device holds neither; on the CPU (host = device)
//! the copies add to the peak.
use super::shape::{Lever, PrecisionBytes, Setup, Target, Transformer};
use crate::config::ShardLevel;
use crate::distributed::shard::Ownership;
use crate::step::LayoutSpec;
use serde::Serialize;

/// Element counts of the parameters as the optimizer sees them (a padded vocabulary's real rows),
/// in the model's order: what [`Ownership::assign`] runs on.
pub fn optimizer_numels(m: &Transformer) -> Vec<i64> {
    m.specs()
        .iter()
        .map(|t| {
            let mut shape = t.shape.clone();
            if let (Some(rows), Some(first)) = (t.user_rows, shape.first_mut()) {
                *first = rows;
            }
            shape.iter().product()
        })
        .collect()
}

/// One rank's part of the model under a level: which parameters it owns.
#[derive(Debug, Clone, PartialEq)]
pub struct RankPart {
    /// Per parameter (the model's order): owned by the rank the figures are for.
    pub owned: Vec<bool>,
    /// Elements that rank owns (ψ_r: the slot every rank's piece is padded to).
    pub elements: u64,
    /// Elements of every parameter (ψ).
    pub total: u64,
}

impl RankPart {
    /// The rank with the largest share under `level` over `world` ranks (`none`: every parameter).
    pub fn of(m: &Transformer, level: ShardLevel, world: u64) -> Self {
        Self::for_rank(m, level, world, None)
    }

    /// Rank `rank`'s part (None: the rank with the largest share, the lowest on a tie).
    pub fn for_rank(m: &Transformer, level: ShardLevel, world: u64, rank: Option<usize>) -> Self {
        let numels = optimizer_numels(m);
        let total = numels.iter().sum::<i64>() as u64;
        if level == ShardLevel::None || world <= 1 {
            return Self { owned: vec![true; numels.len()], elements: total, total };
        }
        let own = Ownership::assign(&numels, world as usize);
        let busiest =
            || (0..world as usize).max_by_key(|&r| (own.elements(r), std::cmp::Reverse(r))).unwrap_or(0);
        let rank = rank.unwrap_or_else(busiest);
        let owned = (0..numels.len()).map(|i| own.owner(i) == rank).collect();
        Self { owned, elements: own.elements(rank) as u64, total }
    }

    /// The owned share of ψ (1.0 unsharded).
    pub fn share(&self) -> f64 {
        self.elements as f64 / self.total.max(1) as f64
    }
}

/// Bytes each rank sends in one optimizer step's collectives (ring algorithms: an all-reduce of
/// n bytes sends 2n(N−1)/N, a reduce-scatter or an all-gather of N pieces of p bytes p(N−1)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct Comm {
    pub all_reduce: u64,
    pub reduce_scatter: u64,
    pub all_gather: u64,
}

impl Comm {
    pub fn total(&self) -> u64 {
        self.all_reduce + self.reduce_scatter + self.all_gather
    }

    /// The step's collectives under `level` for `m` over `world` ranks, all in fp32 (as the
    /// runtime's buffers are, whatever the precision). The all-reduce buckets hold the
    /// parameters as the model allocates them (a padded vocabulary's rows too); the sharded
    /// collectives run over `world × slot` elements, slot = the largest share.
    pub fn per_step(m: &Transformer, level: ShardLevel, world: u64) -> Self {
        if world <= 1 {
            return Self::default();
        }
        let n = world;
        let all: u64 = m.specs().iter().map(|t| t.numel() as u64).sum();
        let slot = RankPart::of(m, ShardLevel::Gradients, world).elements.max(1);
        let all_reduce = 2 * 4 * all * (n - 1) / n;
        let piece = 4 * slot * (n - 1);
        match level {
            ShardLevel::None => Self { all_reduce, ..Self::default() },
            ShardLevel::Optimizer => Self { all_reduce, all_gather: piece, ..Self::default() },
            ShardLevel::Gradients => Self { reduce_scatter: piece, all_gather: piece, ..Self::default() },
            // Each block's (and the embeddings') parameters gathered for the forward, again for
            // the backward, and all of them after the update: three all-gathers of the model
            // (a micro-step more: two more, and its own reduce-scatter).
            ShardLevel::Parameters => {
                Self { reduce_scatter: piece, all_gather: 3 * piece, ..Self::default() }
            }
        }
    }
}

/// What a level and offload change in one rank's memory, in bytes (the busiest rank's).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankMemory {
    pub shard: ShardLevel,
    pub offload_optimizer: bool,
    pub world_size: u64,
    /// Elements the rank owns (ψ_r) and its share of all (1.0 unsharded).
    pub owned_elements: u64,
    pub owned_share: f64,
    /// The owned parameters' optimizer state (and the optimizer's scratch), wherever it lives.
    pub optimizer_state: u64,
    /// Of that, on the device (none under offload on a GPU).
    pub optimizer_on_device: u64,
    /// fp32 all-reduce buckets (`none` and `optimizer` with several ranks), or the piece of
    /// scratch of `gradients` reduced into their owners from inside backward.
    pub dp_buffers: u64,
    /// Under offload: the host copies of the owned parameters the update runs on (on the CPU
    /// they are on the "device" too).
    pub host_copies: u64,
    /// Under offload on a GPU: what host memory the rank holds (state, copies and the gradients
    /// copied down for the update).
    pub host_bytes: u64,
    /// The reduce-scatter's moment (`gradients`, several ranks): fp32 accumulators of the owned
    /// parameters, the largest owned gradient being scaled and cast, and the pieces' buffers,
    /// beside the full gradients.
    pub reduce_scatter_transient: u64,
    /// The all-gather's pieces after the update (`optimizer`, `gradients`, several ranks).
    pub all_gather_transient: u64,
    /// The gradients alive at the all-gather: the full ones (`none`, `optimizer`) or the owned
    /// ones (`gradients`).
    pub gradients_after_update: u64,
    pub comm: Comm,
}

impl RankMemory {
    /// The figures for `s.shard`, `s.offload_optimizer` over `s.gpus` ranks. `round` rounds a
    /// tensor's bytes as the allocator does; `optimizer_of(target, owned)` is the optimizer state
    /// plus scratch of the owned parameters for a target (the estimate's own counting).
    pub fn of(
        m: &Transformer,
        s: &Setup,
        gradients: u64,
        optimizer_of: impl Fn(Target, &[bool]) -> u64,
        per_owned: impl Fn(&[bool], u64) -> u64,
    ) -> Self {
        let world = s.gpus.max(1);
        let several = world > 1;
        let part = RankPart::of(m, s.shard, world);
        let p = s.precision;
        let optimizer_state = optimizer_of(s.target, &part.owned);
        let offload_gpu = s.offload_optimizer && s.target == Target::Cuda;
        // The parameters' own dtype: fp32 masters under mixed precision.
        let param_bytes = if p.master_bytes() > 0 { p.master_bytes() } else { p.weight_bytes() };
        let host_copies = if s.offload_optimizer { per_owned(&part.owned, param_bytes) } else { 0 };
        let host_bytes = if offload_gpu {
            optimizer_of(Target::Cpu, &part.owned) + host_copies + per_owned(&part.owned, p.grad_bytes())
        } else {
            0
        };
        let dp_buffers =
            if several && s.shard < ShardLevel::Gradients { per_owned_all(m, &per_owned, 4) } else { 0 };
        let chunk = LayoutSpec::chunk_for(s.bucket_mb, world as usize).max(1) as u64;
        let slot = part.elements.max(1);
        let buffers = 4 * (world + 1) * chunk.min(slot);
        let owned_grads = per_owned(&part.owned, p.grad_bytes());
        let largest_owned = optimizer_numels(m)
            .iter()
            .zip(&part.owned)
            .filter(|(_, &o)| o)
            .map(|(&n, _)| n as u64)
            .max()
            .unwrap_or(0);
        let sharded = several && s.shard != ShardLevel::None;
        // fp32 gradients reduced into their owners in place from inside backward
        // (`Dist::reduce_into_owners_in_backward`): a piece of scratch kept, no reduce-scatter.
        let in_backward =
            sharded && s.shard == ShardLevel::Gradients && s.overlap_in_backward && p.grad_bytes() == 4;
        let reduce_scatter_transient = if sharded && s.shard == ShardLevel::Gradients && !in_backward {
            per_owned(&part.owned, 4) + buffers + largest_owned * (4 + p.grad_bytes())
        } else {
            0
        };
        let dp_buffers = if in_backward { 4 * chunk * world } else { dp_buffers };
        Self {
            shard: s.shard,
            offload_optimizer: s.offload_optimizer,
            world_size: world,
            owned_elements: part.elements,
            owned_share: part.share(),
            optimizer_state,
            optimizer_on_device: if offload_gpu { 0 } else { optimizer_state },
            dp_buffers,
            host_copies,
            host_bytes,
            reduce_scatter_transient,
            all_gather_transient: if sharded { buffers } else { 0 },
            gradients_after_update: if s.shard >= ShardLevel::Gradients && several {
                owned_grads
            } else {
                gradients
            },
            comm: Comm::per_step(m, s.shard, world),
        }
    }

    /// What the device holds through the step besides weights, gradients, activations: the
    /// optimizer state on it, the buckets and (CPU, offload) the host copies.
    pub fn resident(&self, target: Target) -> u64 {
        self.optimizer_on_device + self.dp_buffers + if target == Target::Cpu { self.host_copies } else { 0 }
    }

    /// The peak of the step after backward, above the resident part: the reduce-scatter beside
    /// the full gradients, or the all-gather beside the gradients kept (0 when no collective of
    /// the levels runs).
    pub fn after_backward(&self, gradients: u64) -> u64 {
        let scatter =
            if self.reduce_scatter_transient > 0 { gradients + self.reduce_scatter_transient } else { 0 };
        let gather = if self.all_gather_transient > 0 {
            self.gradients_after_update + self.all_gather_transient
        } else {
            0
        };
        scatter.max(gather)
    }
}

/// `dist.shard: parameters` on several ranks: the elements of weights a rank holds in the
/// middle of a micro-step (its own, the embeddings' and the head's for the micro-step's whole,
/// the largest block's while it runs), and of the gradients: fp32 accumulators of its own, the
/// embeddings' and head's full ones from the head's backward on, one block's until its
/// reduce-scatter. Between steps every parameter is whole (gathered after the update).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gathered {
    /// Elements the rank owns, of the embeddings and head, of the largest block.
    pub owned: u64,
    pub outer: u64,
    pub block: u64,
    /// Elements of weights resident through the micro-step (owned, or the embeddings' and
    /// head's), those a block's gather adds (its parameters not among them), and all.
    pub resident: u64,
    pub block_extra: u64,
    pub total: u64,
}

impl Gathered {
    pub fn of(m: &Transformer, world: u64) -> Self {
        use crate::model::Part;
        let part = RankPart::of(m, ShardLevel::Parameters, world);
        let numels = optimizer_numels(m);
        let specs = m.specs();
        let in_block = |b: usize| -> u64 {
            specs.iter().zip(&numels).filter(|(t, _)| t.part == Part::Block(b)).map(|(_, &n)| n as u64).sum()
        };
        let largest = (0..m.layers as usize).max_by_key(|&b| (in_block(b), std::cmp::Reverse(b)));
        let mut out =
            Self { owned: part.elements, outer: 0, block: 0, resident: 0, block_extra: 0, total: part.total };
        for ((t, &n), &owned) in specs.iter().zip(&numels).zip(&part.owned) {
            let n = n as u64;
            let outer = !matches!(t.part, Part::Block(_));
            let gathered_block = largest.is_some_and(|b| t.part == Part::Block(b));
            out.outer += if outer { n } else { 0 };
            out.block += if gathered_block { n } else { 0 };
            out.resident += if owned || outer { n } else { 0 };
            out.block_extra += if gathered_block && !owned { n } else { 0 };
        }
        out
    }

    /// `bytes` (of all the weights) scaled to `elements` of them.
    pub fn share_of(&self, bytes: u64, elements: u64) -> u64 {
        (bytes as f64 * elements as f64 / self.total.max(1) as f64).round() as u64
    }
}

/// Every parameter's bytes at `bytes` an element (the buckets: all of them, whatever the level).
fn per_owned_all(m: &Transformer, per_owned: &impl Fn(&[bool], u64) -> u64, bytes: u64) -> u64 {
    per_owned(&vec![true; m.specs().len()], bytes)
}

/// The order levels are tried in: cheapest communication and least host traffic first. Offload
/// comes last, on the most sharded level the world allows (at one rank, the only one): with
/// several ranks it holds the least on the device and on the host of all offloaded layouts.
pub fn candidates(world: u64) -> Vec<(ShardLevel, bool)> {
    if world <= 1 {
        return vec![(ShardLevel::None, false), (ShardLevel::None, true)];
    }
    vec![
        (ShardLevel::None, false),
        (ShardLevel::Optimizer, false),
        (ShardLevel::Gradients, false),
        (ShardLevel::Parameters, false),
        (ShardLevel::Parameters, true),
    ]
}

/// One row of the level table: a level's per-rank figures and what the planner chose with it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelPlan {
    pub shard: ShardLevel,
    pub offload_optimizer: bool,
    pub rank: RankMemory,
    /// The largest micro-batch that fits with this level (none: not even 1).
    pub micro_batch: Option<u64>,
    /// Per-rank total at that micro-batch (at 1 when nothing fits).
    pub total_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub fits: bool,
}

/// The level table and the level chosen: the first in [`candidates`]' order that fits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Levels {
    pub world_size: u64,
    pub rows: Vec<LevelPlan>,
    /// Index into `rows` of the cheapest level that fits; none when none does.
    pub chosen: Option<usize>,
    pub order: &'static str,
    /// When no level fits: the levers at micro-batch 1 on the last (most sharded) level.
    pub levers: Vec<Lever>,
}

pub const ORDER: &str = "none, optimizer, gradients, parameters (cheapest communication first), then optimizer offload on the most sharded level; the first with a micro-batch that fits is chosen";

/// The level table for `setup`'s world size, each level planned by `plan(setup) -> (micro,
/// total, peak_allocated, fits)`.
pub fn choose(
    setup: &Setup,
    rank_of: impl Fn(&Setup) -> RankMemory,
    plan: impl Fn(&Setup) -> (Option<u64>, u64, u64, bool),
) -> Levels {
    let rows: Vec<LevelPlan> = candidates(setup.gpus)
        .into_iter()
        .map(|(shard, offload)| {
            let s = Setup { shard, offload_optimizer: offload, ..setup.clone() };
            let (micro_batch, total_bytes, peak_allocated_bytes, fits) = plan(&s);
            LevelPlan {
                shard,
                offload_optimizer: offload,
                rank: rank_of(&s),
                micro_batch,
                total_bytes,
                peak_allocated_bytes,
                fits,
            }
        })
        .collect();
    let chosen = rows.iter().position(|r| r.fits);
    Levels { world_size: setup.gpus, rows, chosen, order: ORDER, levers: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::estimate::fixtures::{cpu_fp32_adamw, cuda_fp32_adamw, gpt2_small, llama32_1b};
    use crate::planner::estimate::{estimate, owned_optimizer_bytes};
    use crate::planner::shape::Precision;

    fn at(s: &Setup, shard: ShardLevel, world: u64, offload: bool) -> Setup {
        Setup { shard, gpus: world, offload_optimizer: offload, ..s.clone() }
    }

    #[test]
    fn at_one_rank_every_level_holds_the_unsharded_state() {
        let m = llama32_1b();
        let s = Setup { precision: Precision::Bf16Mixed, ..cuda_fp32_adamw() };
        let none = estimate(&m, &s, 2, 4);
        for level in [ShardLevel::Optimizer, ShardLevel::Gradients] {
            let e = estimate(&m, &at(&s, level, 1, false), 2, 4);
            assert_eq!(e.optimizer, none.optimizer, "{level:?}");
            assert_eq!(e.peak_allocated, none.peak_allocated, "{level:?}");
            assert_eq!(e.sharding.owned_share, 1.0);
            assert_eq!(e.sharding.comm, Comm::default(), "one rank sends nothing");
        }
    }

    #[test]
    fn the_ranks_owned_state_adds_up_to_the_whole_and_the_busiest_holds_the_most() {
        for (m, s) in [(gpt2_small(), cpu_fp32_adamw()), (llama32_1b(), cuda_fp32_adamw())] {
            let whole = owned_optimizer_bytes(&m, &s, &RankPart::of(&m, ShardLevel::None, 1).owned);
            for world in [2u64, 3, 8] {
                let parts: Vec<RankPart> = (0..world as usize)
                    .map(|r| RankPart::for_rank(&m, ShardLevel::Optimizer, world, Some(r)))
                    .collect();
                let bytes: Vec<u64> = parts.iter().map(|p| owned_optimizer_bytes(&m, &s, &p.owned)).collect();
                assert_eq!(bytes.iter().sum::<u64>(), whole, "world {world}");
                assert_eq!(parts.iter().map(|p| p.elements).sum::<u64>(), parts[0].total);
                let busiest = RankPart::of(&m, ShardLevel::Optimizer, world);
                assert_eq!(busiest.elements, parts.iter().map(|p| p.elements).max().unwrap());
                let e = estimate(&m, &at(&s, ShardLevel::Optimizer, world, false), 1, 2);
                assert_eq!(e.sharding.optimizer_state, owned_optimizer_bytes(&m, &s, &busiest.owned));
                // Whole tensors: within one largest tensor of an even split.
                assert!(e.sharding.owned_share < 1.0 / world as f64 + 0.2, "world {world}");
            }
        }
    }

    #[test]
    fn each_level_drops_what_it_shards_and_adds_its_collectives_buffers() {
        let m = llama32_1b();
        // Under a CPU cap: `gradients` reduce-scatters after backward.
        let s = Setup { precision: Precision::Bf16Mixed, overlap_in_backward: false, ..cpu_fp32_adamw() };
        let (none, opt, grads) = (
            estimate(&m, &at(&s, ShardLevel::None, 4, false), 1, 2),
            estimate(&m, &at(&s, ShardLevel::Optimizer, 4, false), 1, 2),
            estimate(&m, &at(&s, ShardLevel::Gradients, 4, false), 1, 2),
        );
        let psi = RankPart::of(&m, ShardLevel::None, 1).total;
        assert_eq!(none.dp_buffers, 4 * m.specs().iter().map(|t| t.numel() as u64).sum::<u64>());
        assert_eq!(opt.dp_buffers, none.dp_buffers, "ZeRO-1 keeps the all-reduce buckets");
        assert_eq!(grads.dp_buffers, 0, "ZeRO-2 reduce-scatters in pieces: no buckets");
        assert_eq!(opt.optimizer, grads.optimizer);
        assert!(opt.optimizer < none.optimizer / 3, "AdamW's moments of a quarter of the parameters");
        let chunk = LayoutSpec::chunk_for(25.0, 4) as u64;
        assert_eq!(opt.sharding.all_gather_transient, 4 * 5 * chunk);
        assert_eq!(opt.sharding.reduce_scatter_transient, 0);
        assert!(grads.sharding.reduce_scatter_transient >= 4 * grads.sharding.owned_elements + 4 * 5 * chunk);
        assert!(none.peak_allocated > opt.peak_allocated && opt.peak_allocated > grads.peak_allocated);
        assert!(grads.sharding.owned_elements * 4 >= psi && grads.sharding.owned_elements * 4 < psi * 6 / 5);
    }

    /// `gradients` under `dist.overlap` (no CPU cap): fp32 gradients are summed into their
    /// owners in place from inside backward, so the reduce-scatter's fp32 sums and pieces are not
    /// made; a piece of scratch is kept instead. bf16-pure's gradients still reduce-scatter.
    #[test]
    fn gradients_reduced_in_backward_keep_a_piece_of_scratch_instead_of_the_reduce_scatter() {
        let m = llama32_1b();
        let after = Setup { precision: Precision::Bf16Mixed, overlap_in_backward: false, ..cpu_fp32_adamw() };
        let during = Setup { overlap_in_backward: true, ..after.clone() };
        let (a, d) = (
            estimate(&m, &at(&after, ShardLevel::Gradients, 4, false), 1, 2),
            estimate(&m, &at(&during, ShardLevel::Gradients, 4, false), 1, 2),
        );
        let piece = 4 * LayoutSpec::chunk_for(25.0, 4) as u64 * 4;
        assert_eq!((d.sharding.dp_buffers, d.sharding.reduce_scatter_transient), (piece, 0));
        assert!(a.sharding.reduce_scatter_transient > 4 * a.sharding.owned_elements);
        // The moment after backward loses the sums and pieces; the step's peak, where the
        // activations are, gains at most the scratch.
        let grads = 4 * RankPart::of(&m, ShardLevel::None, 1).total;
        assert!(d.sharding.after_backward(grads) < a.sharding.after_backward(grads));
        assert!(d.peak_allocated <= a.peak_allocated + piece, "{} vs {}", d.peak_allocated, a.peak_allocated);
        let pure = Setup { precision: Precision::Bf16Pure, ..during };
        let p = estimate(&m, &at(&pure, ShardLevel::Gradients, 4, false), 1, 2);
        assert_eq!(p.sharding.dp_buffers, 0, "bf16 gradients are reduce-scattered through fp32 pieces");
    }

    #[test]
    fn bytes_sent_a_step_follow_the_ring_collectives() {
        let m = gpt2_small();
        let all: u64 = m.specs().iter().map(|t| t.numel() as u64).sum();
        for n in [2u64, 8] {
            let none = Comm::per_step(&m, ShardLevel::None, n);
            assert_eq!(none.all_reduce, 2 * 4 * all * (n - 1) / n);
            assert_eq!(none.total(), none.all_reduce);
            let slot = RankPart::of(&m, ShardLevel::Gradients, n).elements;
            let opt = Comm::per_step(&m, ShardLevel::Optimizer, n);
            assert_eq!(opt.total(), none.all_reduce + 4 * slot * (n - 1));
            let grads = Comm::per_step(&m, ShardLevel::Gradients, n);
            assert_eq!((grads.reduce_scatter, grads.all_gather), (4 * slot * (n - 1), 4 * slot * (n - 1)));
            // The padded slot layout sends what the all-reduce does times the imbalance (GPT-2's
            // 38.6M-element embedding is more than an eighth: 2.5x at 8 ranks).
            let ratio = grads.total() as f64 / none.all_reduce as f64;
            let imbalance = (slot * n) as f64 / all as f64;
            assert!((ratio / imbalance - 1.0).abs() < 1e-6, "{n} ranks: {ratio} vs {imbalance}");
            assert!(imbalance >= 0.999);
        }
        assert_eq!(Comm::per_step(&m, ShardLevel::Gradients, 1).total(), 0);
    }

    #[test]
    fn offload_moves_the_state_to_the_host_on_a_gpu_and_adds_the_copies_on_the_cpu() {
        let m = gpt2_small();
        let gpu = cuda_fp32_adamw();
        let on = estimate(&m, &at(&gpu, ShardLevel::None, 1, true), 1, 2);
        let off = estimate(&m, &gpu, 1, 2);
        assert_eq!(on.optimizer, 0);
        assert_eq!(off.peak_allocated - on.peak_allocated, off.optimizer);
        let cpu_state =
            owned_optimizer_bytes(&m, &cpu_fp32_adamw(), &RankPart::of(&m, ShardLevel::None, 1).owned);
        // The state for the host's update, the fp32 copies and the gradients copied down (each
        // as the gradients are counted: fp32, per tensor).
        assert_eq!(on.sharding.host_bytes, cpu_state + 2 * on.gradients);
        let cpu = cpu_fp32_adamw();
        let (on, off) = (estimate(&m, &at(&cpu, ShardLevel::None, 1, true), 1, 2), estimate(&m, &cpu, 1, 2));
        assert_eq!(on.optimizer, off.optimizer, "host = device");
        assert_eq!(on.peak_allocated - off.peak_allocated, on.gradients, "the fp32 host copies");
    }

    /// Under `parameters` a rank holds through the step its own parameters, the embeddings and
    /// head, and one block: less than all, more than its share; a block's gather adds only what
    /// the rank does not own.
    #[test]
    fn the_parameters_level_holds_its_own_the_outer_unit_and_one_block() {
        let m = llama32_1b();
        let g = Gathered::of(&m, 8);
        let specs = m.specs();
        let block0: u64 = specs
            .iter()
            .zip(optimizer_numels(&m))
            .filter(|(t, _)| t.part == crate::model::Part::Block(0))
            .map(|(_, n)| n as u64)
            .sum();
        assert_eq!(g.block, block0, "every block of this shape is the same size");
        assert!(g.owned < g.resident && g.resident < g.total, "{g:?}");
        assert!(g.resident <= g.owned + g.outer && g.block_extra <= g.block);
        assert_eq!(g.total, optimizer_numels(&m).iter().sum::<i64>() as u64);
        let s = Setup { gpus: 8, shard: ShardLevel::Parameters, ..cuda_fp32_adamw() };
        let gradients = Setup { shard: ShardLevel::Gradients, ..s.clone() };
        assert!(
            estimate(&m, &s, 1, 2).peak_allocated < estimate(&m, &gradients, 1, 2).peak_allocated,
            "sharding the parameters holds less than sharding the gradients"
        );
    }

    /// `dist.overlap` holds the next block's weights while one runs, and the block before's fp32
    /// gradients while they are reduced: never less than waiting for each collective, at most
    /// one more block's weights that the rank does not own and one block's gradients, and more
    /// at one of these micro-batches of Llama-3.2-1B.
    #[test]
    fn overlapped_collectives_add_at_most_a_block_of_weights_and_one_of_gradients() {
        let m = llama32_1b();
        let g = Gathered::of(&m, 8);
        let on = Setup { gpus: 8, shard: ShardLevel::Parameters, overlap: true, ..cuda_fp32_adamw() };
        let off = Setup { overlap: false, ..on.clone() };
        let weights = estimate(&m, &off, 1, 2).weights;
        for micro in [1, 4, 16] {
            let (a, b) = (estimate(&m, &on, micro, 2), estimate(&m, &off, micro, 2));
            assert!(a.peak_allocated >= b.peak_allocated, "micro {micro}");
            let most = g.share_of(weights, g.block_extra) + 4 * g.block;
            assert!(a.peak_allocated - b.peak_allocated <= most, "micro {micro}");
        }
    }

    #[test]
    fn the_first_level_in_order_that_fits_is_chosen() {
        let m = llama32_1b();
        let s = Setup { gpus: 4, ..cuda_fp32_adamw() };
        let rank_of = |s: &Setup| estimate(&m, s, 1, 2).sharding;
        let levels = choose(&s, rank_of, |s| (Some(1), 0, 0, s.shard >= ShardLevel::Optimizer));
        assert_eq!(levels.rows.len(), 5);
        assert_eq!(levels.chosen, Some(1));
        let none_fits = choose(&s, rank_of, |_| (None, 0, 0, false));
        assert_eq!(none_fits.chosen, None);
        let last = choose(&s, rank_of, |s| (Some(1), 0, 0, s.offload_optimizer));
        assert_eq!(last.rows[last.chosen.unwrap()].shard, ShardLevel::Parameters);
        assert_eq!(candidates(1), vec![(ShardLevel::None, false), (ShardLevel::None, true)]);
    }
}
