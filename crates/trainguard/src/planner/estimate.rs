//! The memory estimate, pure: what one training step of a decoder-only transformer holds on a
//! device, part by part (weights, fp32 master weights, gradients, optimizer state, activations,
//! logits and cross-entropy, data-parallel buffers, allocator margin, CUDA context), and the peak.
//! No tensors, no device: every figure is a formula of the sizes, unit-tested against hand-computed
//! cases. What each architecture holds comes from the model's own descriptions: its parameters
//! (`model::describe`) and what its forward saves for backward (`model::saved_activations`); this
//! file adds what every decoder shares (logits, cross-entropy, the order of backward, optimizer
//! state, the device). The formulas and where they come from are in `/README.md` ("trainguard plan").
//!
//! Notation: L layers, h hidden, a heads, s sequence length, b micro-batch, v vocabulary,
//! f MLP width, e bytes per activation element (4 in fp32, 2 in 16-bit).
use super::shape::{OptimizerName, Precision, PrecisionBytes, Setup, Target, Transformer};
use super::sharding::RankMemory;
use crate::model::memory::Widths;
use crate::model::{Part, TensorSpec};
use crate::optim::{Adafactor, AdafactorPath, AdamW8bit, AdamW8bitPath};
use serde::Serialize;

/// The CUDA caching allocator hands out multiples of 512 bytes.
pub const CUDA_ROUND: u64 = 512;

/// Bytes per element of each kind of saved tensor, for the precision and the target.
fn widths(s: &Setup) -> Widths {
    let p = s.precision;
    Widths {
        compute: p.activation_bytes(),
        residual: p.residual_bytes(),
        autocast: p.is_mixed(),
        mask: mask_bytes(s),
    }
}

/// Optimizer state bytes per parameter tensor.
pub trait OptimizerState: Copy {
    fn state_for(self, tensor: &TensorSpec, state: u64) -> u64;
}

/// What Muon orthogonalises: the blocks' weight matrices (`Model::block_matrices`).
pub fn is_block_matrix(t: &TensorSpec) -> bool {
    t.decay && t.shape.len() == 2 && matches!(t.part, Part::Block(_))
}

impl OptimizerState for OptimizerName {
    /// State bytes for one parameter tensor, with `state` bytes per full-precision state element.
    fn state_for(self, tensor: &TensorSpec, state: u64) -> u64 {
        let shape: Vec<u64> = tensor.shape.iter().map(|&d| d as u64).collect();
        let n: u64 = shape.iter().product();
        match self {
            OptimizerName::Adamw => 2 * n * state,
            OptimizerName::Sgd => 0,
            OptimizerName::SgdMomentum => n * state,
            // Factored second moment (row and column means) for matrices, no first moment
            // (beta1 = None, the default); vectors keep a full second moment.
            OptimizerName::Adafactor => match shape[..] {
                [rows, cols] => (rows + cols) * state,
                _ => n * state,
            },
            // bitsandbytes blockwise 8-bit: one byte per element per moment plus an fp32 scale
            // per 2048-element block; tensors under 4096 elements keep 32-bit moments.
            OptimizerName::Adamw8bit => {
                if n < 4096 {
                    2 * n * 4
                } else {
                    2 * n + 2 * n.div_ceil(2048) * 4
                }
            }
            // A momentum for each block matrix, AdamW's two moments for everything else.
            OptimizerName::Muon if is_block_matrix(tensor) => n * state,
            OptimizerName::Muon => 2 * n * state,
        }
    }
}

/// One estimate at micro-batch `micro_batch` with `accumulation` micro-steps per optimizer step.
/// All figures in bytes, per GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub micro_batch: u64,
    pub accumulation: u64,
    pub params: u64,
    pub weights: u64,
    pub master_weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// One transformer block's saved activations.
    pub activations_per_layer: u64,
    /// Everything saved for backward: the blocks (with checkpointing: one recomputed segment)
    /// plus what lies outside them.
    pub activations: u64,
    /// Outside the blocks: final LayerNorm, input tokens, embedding dropout mask; with
    /// checkpointing also every segment's saved input.
    pub activations_outside: u64,
    /// b·s·v logits (or the log-probabilities that replace them), fp32 except in bf16-pure;
    /// one chunk's with a chunked loss. With `kernels.fused_cross_entropy` the logits in the
    /// head's dtype (16-bit under autocast) and a log-sum-exp per row.
    pub logits: u64,
    /// Cross-entropy's two gradient buffers alive with the log-probabilities at the start of
    /// backward: the log-probabilities' (as `logits`) and the logits' (16-bit under CUDA
    /// autocast, else as `logits`). With `kernels.fused_cross_entropy` the logits' alone (and
    /// on the CPU a block of fp32 working values); with `kernels.fused_loss_gradient` too
    /// nothing beside the logits (on the CPU two blocks of working values).
    pub cross_entropy: u64,
    /// Data-parallel gradient buckets (PyTorch DDP keeps a flat copy of the gradients).
    pub dp_buffers: u64,
    /// What `dist.shard` and `memory.offload_optimizer` change on this rank (the busiest one):
    /// its share, its optimizer state, host memory, the collectives' buffers and bytes sent.
    pub sharding: RankMemory,
    /// Tables the model holds besides its parameters: RoPE's fp32 cos and sin (2 × s × head
    /// dim); none for GPT-2.
    pub buffers: u64,
    /// Backward through the last block, after logits and cross-entropy are freed: the MLP's
    /// widest gradients (GELU input and output, f·s·b) and the residual stream's (h·s·b); with
    /// a saver on also the head's gradient and the hidden state's, held meanwhile.
    pub block_backward_transient: u64,
    /// End of backward: the tied token embedding's gradient arrives in two parts (from the head
    /// and from the embedding) that autograd sums out of place: 2·v·h extra gradient elements
    /// (v·h with a saver on: trainguard adds the second in place).
    pub embedding_grad_transient: u64,
    /// Which moment sets the peak: `start of backward` (activations, logits, cross-entropy),
    /// `last block's backward` (activations and that block's gradients; small vocabularies),
    /// `end of backward` (gradients complete, autocast's weight copies released) or, checkpointed, `first blocks' recomputed
    /// backward` (every later gradient held).
    pub peak_phase: &'static str,
    /// Peak of what the allocator hands out (what `allocated_peak` measures).
    pub peak_allocated: u64,
    pub fragmentation: u64,
    pub cuda_overhead: u64,
    /// What must fit on the device.
    pub total: u64,
    /// `total = fixed + per_sample · micro_batch` while accumulating (see [`Estimate::linear`]).
    pub fixed: u64,
    pub per_sample: u64,
    /// Host memory (not the GPU's; on the CPU beside `total`) that `checkpoint.async` keeps for
    /// its copy of what a checkpoint holds: weights, master weights, optimizer state.
    pub checkpoint_copy: u64,
}

fn round_up(bytes: u64, to: u64) -> u64 {
    bytes.div_ceil(to) * to
}

/// Working buffers an optimizer makes at construction (not checkpointed), as the optimizers
/// size them: 8-bit AdamW's fp32 runs of blocks (`AdamW8bit::scratch_elements`: 3 × 64 MiB on
/// CUDA for GPT-2; on the CPU, whose fused kernel needs none, and on CUDA under
/// `kernels.cuda_optimizers`, whose kernel needs none either, 3 × the largest unquantised tensor;
/// a fourth for the gradient's fp32 copy in bf16-pure) and Adafactor's band of the update, row
/// and column means on CUDA (`Adafactor::scratch_elements`: 16 MiB for GPT-2; nothing on the
/// CPU; under `kernels.cuda_optimizers` only its kernels' fp64 sums, `Adafactor::workspace_elements`). The
/// fused AdamW and SGD have none.
fn optimizer_scratch(m: &Transformer, s: &Setup) -> u64 {
    let device = match s.target {
        Target::Cuda => tch::Device::Cuda(0),
        Target::Cpu => tch::Device::Cpu,
    };
    let round = if s.target == Target::Cuda { CUDA_ROUND } else { 1 };
    let shapes = m.tensors().into_iter().map(|sh| sh.into_iter().map(|d| d as i64).collect::<Vec<i64>>());
    match s.optimizer {
        OptimizerName::Adamw8bit => {
            let elements = AdamW8bit::scratch_elements(
                shapes.map(|sh| sh.iter().product::<i64>()),
                AdamW8bitPath::for_device(device, s.cuda_optimizers),
            ) as u64;
            let buffers = if s.precision == Precision::Bf16Pure { 4 } else { 3 };
            buffers * round_up(elements * 4, round)
        }
        OptimizerName::Adafactor => {
            let param_bytes = if s.precision == Precision::Bf16Pure { 2 } else { 4 };
            let path = AdafactorPath::for_device(device, s.cuda_optimizers);
            let shapes: Vec<Vec<i64>> = shapes.collect();
            let workspace =
                round_up(8 * Adafactor::workspace_elements(shapes.clone(), path, device) as u64, round);
            workspace
                + Adafactor::scratch_elements(shapes, path)
                    .iter()
                    .map(|&n| round_up(n as u64 * param_bytes, round))
                    .sum::<u64>()
        }
        // The unfused update's one temporary, the parameters' dtype (`AdamW::new`).
        // The update buffer of each block matrix, in the parameters' dtype (`Muon::new`); its
        // AdamW's unfused temporary besides, when not fused.
        OptimizerName::Muon => {
            let bytes = if s.precision == Precision::Bf16Pure { 2 } else { 4 };
            let specs = m.specs();
            let matrices: u64 = specs
                .iter()
                .filter(|t| is_block_matrix(t))
                .map(|t| round_up(t.numel() as u64 * bytes, round))
                .sum();
            let largest_other =
                specs.iter().filter(|t| !is_block_matrix(t)).map(|t| t.numel() as u64).max().unwrap_or(0);
            matrices + if s.fused_optimizer { 0 } else { round_up(largest_other * bytes, round) }
        }
        OptimizerName::Adamw if !s.fused_optimizer => {
            let largest = m.tensors().iter().map(|sh| sh.iter().product::<u64>()).max().unwrap_or(0);
            round_up(largest * if s.precision == Precision::Bf16Pure { 2 } else { 4 }, round)
        }
        _ => 0,
    }
}

/// Bytes of the parameter-sized buffers: each tensor rounded as the allocator would, then scaled
/// to `--params` when given.
fn per_tensor(model: &Transformer, target: Target, bytes_of: impl Fn(&[u64]) -> u64) -> u64 {
    per_spec(model, target, |t| bytes_of(&t.shape.iter().map(|&d| d as u64).collect::<Vec<_>>()))
}

/// [`per_tensor`] from each parameter's description (its part, its decay flag).
fn per_spec(model: &Transformer, target: Target, bytes_of: impl Fn(&TensorSpec) -> u64) -> u64 {
    per_spec_owned(model, target, &vec![true; model.specs().len()], bytes_of)
}

/// The optimizer state (and scratch) of the parameters `owned` marks, for `s`'s target: what
/// a rank owning them holds.
pub fn owned_optimizer_bytes(m: &Transformer, s: &Setup, owned: &[bool]) -> u64 {
    per_spec_owned(m, s.target, owned, |t| s.optimizer.state_for(t, s.precision.state_bytes()))
        + optimizer_scratch(m, s)
}

/// [`per_spec`] over the parameters `owned` marks (all of them: the same figure).
fn per_spec_owned(
    model: &Transformer,
    target: Target,
    owned: &[bool],
    bytes_of: impl Fn(&TensorSpec) -> u64,
) -> u64 {
    let round = if target == Target::Cuda { CUDA_ROUND } else { 1 };
    let sum: u64 = model
        .specs()
        .iter()
        .zip(owned)
        .filter(|(_, &o)| o)
        .map(|(t, _)| bytes_of(t))
        .filter(|&b| b > 0)
        .map(|b| round_up(b, round))
        .sum();
    match model.params_override {
        Some(p) => (sum as f64 * p as f64 / model.layout_params().max(1) as f64).round() as u64,
        None => sum,
    }
}

/// The tied embedding's partial gradients are summed at the end of backward: 1 when the head is
/// tied, 0 when untied or when `--params` describes another layout.
fn tied(m: &Transformer) -> u64 {
    u64::from(m.params_override.is_none() && m.tied)
}

/// Bytes of a list of saved tensors at micro-batch `b`.
fn sum(list: &[crate::model::memory::Saved], w: &Widths, b: u64, seq: u64) -> u64 {
    list.iter().map(|t| t.bytes(w, b, seq)).sum()
}

/// Saved activations of one block at micro-batch `b`: the architecture's own list
/// (`model::saved_activations`), in bytes for the precision. For GPT-2 this is Korthikanti et
/// al. 2022 generalised to element size e and MLP width f: s·b·(8h + 2f)·e for the LayerNorm
/// inputs and outputs, QKV, attention output, GELU input and output; 2·s·b·h mask bytes with
/// dropout; fp32 LayerNorm statistics 16·b·s; attention: flash keeps its fp32 log-sum-exp
/// (4·b·a·s), materialised keeps the softmax output b·a·s²·e (and its dropout output and mask).
/// In 16-bit with dropout and f = 4h this is s·b·h·(34 + 5·a·s/h) + 16·b·s.
pub fn layer_activations(m: &Transformer, s: &Setup, b: u64) -> u64 {
    sum(&m.saved(s).block, &widths(s), b, m.seq_len)
}

/// Tables the model holds besides its parameters (RoPE's cos and sin): allocated once.
pub fn buffers(m: &Transformer, s: &Setup) -> u64 {
    sum(&m.saved(s).buffers, &widths(s), 1, m.seq_len)
}

/// A dropout mask element: a bool on CUDA; on CPU libtorch keeps a scaled noise tensor of the
/// activation's dtype.
fn mask_bytes(s: &Setup) -> u64 {
    match s.target {
        Target::Cuda => 1,
        Target::Cpu => s.precision.activation_bytes(),
    }
}

/// Activations outside the blocks at micro-batch `b`: the final norm's saved tensors (with a
/// chunked loss only its input, the hidden state: the rest exists per chunk), the int64 inputs
/// and targets, the embedding's (dropout mask).
pub fn outside_activations(m: &Transformer, s: &Setup, b: u64) -> u64 {
    let (w, saved) = (widths(s), m.saved(s));
    let r = s.precision.residual_bytes();
    let sbh = m.seq_len * b * m.hidden;
    let mut bytes = 2 * 8 * m.seq_len * b + sum(&saved.embedding, &w, b, m.seq_len);
    bytes += match s.loss_chunk_tokens {
        Some(_) => sbh * r,
        None => sum(&saved.final_norm, &w, b, m.seq_len),
    };
    if s.activation_checkpointing {
        // Each segment's input, kept to recompute it; offloaded, only the one back for its
        // segment's backward is on the device.
        let kept = match s.offload_activations && s.target == Target::Cuda {
            true => 1,
            false => s.checkpointed_blocks(m).div_ceil(s.segment()),
        };
        bytes += kept * sbh * r;
    }
    bytes
}

/// The estimate at micro-batch `micro` (≥ 1) with `accumulation` (≥ 1) micro-steps per update.
///
/// On top of weights, master weights and optimizer state, the peak is the largest of three
/// moments: the start of backward (every saved activation, the log-probabilities and
/// cross-entropy's two gradient buffers), the last block's backward (every saved activation and
/// that block's MLP and residual gradients; it wins only with small vocabularies), and the end
/// of backward (the gradients complete, plus the tied embedding's partial gradients). The
/// gradients of earlier micro-steps are held through all three when accumulating.
///
/// With a memory saver on ([`Setup::split_backward`]) the head runs its own backward first: its
/// gradients (the tied embedding's v·h above all) are held from then on, the embedding's second
/// gradient is added in place, and with a chunked loss the logits are one chunk's, with the
/// head's gradient of the chunk before alive while the next chunk's arrives.
pub fn estimate(m: &Transformer, s: &Setup, micro: u64, accumulation: u64) -> Estimate {
    // `dist.shard: parameters` over several ranks: every block recomputed, the weights and the
    // gradients of a micro-step those of `Gathered`, and every weight whole between steps.
    let gathered = (s.shard == crate::config::ShardLevel::Parameters && s.gpus > 1)
        .then(|| super::sharding::Gathered::of(m, s.gpus));
    let every_block =
        Setup { activation_checkpointing: true, checkpoint_blocks: 1, checkpoint_first: None, ..s.clone() };
    let s = if gathered.is_some() { &every_block } else { s };
    let p = s.precision;
    let weights = per_tensor(m, s.target, |sh| sh.iter().product::<u64>() * p.weight_bytes());
    let master_weights = per_tensor(m, s.target, |sh| sh.iter().product::<u64>() * p.master_bytes());
    let gradients = per_tensor(m, s.target, |sh| sh.iter().product::<u64>() * p.grad_bytes());
    // The owned parameters' state (all of them unsharded) and the optimizer's scratch, for the
    // target the update runs on (the host under offload); the all-reduce buckets hold every
    // gradient in fp32 whatever the precision (`Dist::plan_buckets`).
    let sharding = RankMemory::of(
        m,
        s,
        gradients,
        |target, owned| owned_optimizer_bytes(m, &Setup { target, ..s.clone() }, owned),
        |owned, bytes| per_spec_owned(m, s.target, owned, |t| t.numel() as u64 * bytes),
    );
    let optimizer = sharding.optimizer_on_device;
    let dp_buffers = sharding.dp_buffers;
    let buffers = buffers(m, s);
    let host_copies = if s.target == Target::Cpu { sharding.host_copies } else { 0 };
    let between_steps = weights + master_weights + optimizer + dp_buffers + buffers + host_copies;
    // `block`: what a gathered block adds while it runs (its weights and its gradients).
    // `in_flight`: a block's gradients still being reduced (`dist.overlap`) when the embeddings'
    // backward ends the micro-step.
    let (base, gradients, held, block, in_flight) = match &gathered {
        Some(g) => {
            let resident = |bytes: u64| g.share_of(bytes, g.resident);
            // The collectives' pieces are allocated once, with the layout.
            let pieces = sharding.all_gather_transient;
            // The fp32 accumulators of the owned parameters' gradients live through the micro-steps
            // (holding the earlier ones' sum: nothing more is held).
            let accumulators = 4 * g.owned;
            // `dist.overlap`: the next block's weights gathered while this one runs, and the
            // block before's gradients (fp32) still being reduced.
            let (blocks_whole, reducing) = if s.overlap { (2, 4 * g.block) } else { (1, 0) };
            let base =
                resident(weights) + resident(master_weights) + optimizer + buffers + host_copies + pieces;
            let block = g.share_of(weights + master_weights, blocks_whole * g.block_extra)
                + g.block * p.grad_bytes()
                + reducing;
            (base + accumulators, g.outer * p.grad_bytes(), 0, block, reducing)
        }
        None => {
            // Earlier micro-steps' sum, or the graphs' accumulators (a single micro-step has them too).
            let graphs = s.cuda_graphs && s.target == Target::Cuda;
            (between_steps, gradients, if accumulation > 1 || graphs { gradients } else { 0 }, 0, 0)
        }
    };

    let at = Moments::at(m, s, micro);
    // At the end of backward autograd has released what the forward saved, autocast's 16-bit
    // copies of the weights with it (the embedding, the last to run, reads its fp32 weight):
    // `weights` counts those copies in mixed precision, so they leave this moment. (On the CPU
    // bf16-mixed's end of backward measured 2 bytes a parameter below the estimate that kept them.)
    // The linear node's kept casts stay to the step's end (with graphs, the run's).
    let copies_released = if p.is_mixed() && !s.keeps_casts() { weights } else { 0 };
    let grads_done = (gradients + at.embedding_grad_transient + in_flight).saturating_sub(copies_released);
    let first_blocks = first_segment_backward(m, s, micro, gradients, &at);
    // After the last micro-step (the earlier ones' sum added in): the sharded collectives
    // beside the gradients, autocast's copies released.
    // (Under `parameters` the accumulators and the pieces are in `base` already, and the gather
    // after the update is `whole_again` below.)
    let collectives = match gathered {
        Some(_) => 0,
        None => sharding.after_backward(gradients).saturating_sub(copies_released),
    };
    let during = held + at.transient.max(at.body + block).max(grads_done).max(first_blocks + block);
    let scatter_or_gather = if sharding.after_backward(gradients)
        > sharding.gradients_after_update + sharding.all_gather_transient
    {
        "gradients' reduce-scatter"
    } else {
        "parameters' all-gather"
    };
    // Under `parameters` the gather after the update, every weight whole, is a moment of its own.
    // On the CPU Gloo's all-gather also takes its output through a temporary of its own: the
    // world's pieces, `world / (world + 1)` of the two buffers (measured: 25 MiB at 4 ranks and
    // 25 MB pieces).
    let whole_again = match gathered {
        Some(_) => {
            let pieces = sharding.all_gather_transient;
            let gloo = match s.target {
                Target::Cpu => pieces * s.gpus / (s.gpus + 1),
                Target::Cuda => 0,
            };
            between_steps + pieces + gloo
        }
        None => 0,
    };
    let peak_allocated = (base + during.max(collectives)).max(whole_again);
    let (fragmentation, cuda_overhead) = match s.target {
        Target::Cuda => ((peak_allocated as f64 * s.fragmentation).round() as u64, s.cuda_overhead),
        Target::Cpu => (0, 0),
    };
    let scale = 1.0 + if s.target == Target::Cuda { s.fragmentation } else { 0.0 };
    // The peak while accumulating (earlier micro-steps' gradients held) at micro-batch b, in
    // whichever moment it is (it was the start of backward's transient only, so the line did
    // not add up when the peak was at the end of backward or in the first blocks' recomputation).
    let accumulating = |b: u64| {
        let at = Moments::at(m, s, b);
        let grads_done =
            (gradients + at.embedding_grad_transient + in_flight).saturating_sub(copies_released);
        base + gradients + at.transient.max(grads_done).max(first_segment_backward(m, s, b, gradients, &at))
    };
    // Its line through micro and 2·micro: the slope per sample, and what does not grow.
    let at_micro = accumulating(micro);
    let slope = accumulating(2 * micro).saturating_sub(at_micro) / micro;
    let per_sample = (slope as f64 * scale).round() as u64;
    let fixed = (at_micro.saturating_sub(slope * micro) as f64 * scale).round() as u64 + cuda_overhead;
    Estimate {
        micro_batch: micro,
        accumulation,
        params: m.params(),
        weights,
        master_weights,
        gradients,
        optimizer,
        activations_per_layer: at.per_layer,
        activations: at.activations,
        activations_outside: at.outside,
        logits: at.logits,
        cross_entropy: at.cross_entropy,
        dp_buffers,
        sharding,
        buffers,
        embedding_grad_transient: at.embedding_grad_transient,
        block_backward_transient: at.block_backward,
        peak_phase: if whole_again > base + during.max(collectives) {
            "weights gathered whole after the update"
        } else if collectives > during {
            scatter_or_gather
        } else if first_blocks > at.transient.max(grads_done) {
            "first blocks' recomputed backward"
        } else if at.transient < grads_done {
            "end of backward"
        } else if !at.head_wins {
            "last block's backward"
        } else {
            "start of backward"
        },
        peak_allocated,
        fragmentation,
        cuda_overhead,
        total: peak_allocated + fragmentation + cuda_overhead,
        fixed,
        per_sample,
        checkpoint_copy: if s.background_checkpoint { weights + master_weights + optimizer } else { 0 },
    }
}

/// Checkpointing only (else 0): the segment of the first blocks is recomputed and pushed
/// through last, so every later block's gradient and the head's are held while its activations
/// and their gradients exist: all gradients but that segment's and the position embedding's,
/// plus the segment's activations, the MLP's widest gradients and the incoming gradient.
fn first_segment_backward(m: &Transformer, s: &Setup, micro: u64, gradients: u64, at: &Moments) -> u64 {
    if !s.activation_checkpointing {
        return 0;
    }
    let k = s.recomputed_blocks(m);
    let r = s.precision.residual_bytes();
    let tokens = micro * m.seq_len;
    let block_params = m.params_in(Part::Block(0));
    // The segment's and the untied embedding's (GPT-2's wpe, an untied Llama's token embedding)
    // share of the gradients, in the same units (and rounding) as `gradients`.
    let not_yet = (gradients as f64 * (k * block_params + m.params_in(Part::Embedding)) as f64
        / m.layout_params().max(1) as f64) as u64;
    let widest = sum(&m.saved(s).block_backward, &widths(s), micro, m.seq_len);
    gradients.saturating_sub(not_yet) + at.outside + k * at.per_layer + widest + m.hidden * r * tokens
}

/// What one micro-batch adds on top of the states at the moments [`estimate`] compares.
struct Moments {
    per_layer: u64,
    outside: u64,
    activations: u64,
    logits: u64,
    cross_entropy: u64,
    /// The last block's backward on top of the activations (the head's, `head` in
    /// [`Moments::at`], is the start of backward).
    block_backward: u64,
    embedding_grad_transient: u64,
    /// The larger of the two moments with the activations each holds.
    transient: u64,
    /// The last block's moment alone (under `dist.shard: parameters` a block's gather adds to it).
    body: u64,
    /// Which of them: the head's backward (`start of backward`) or the last block's.
    head_wins: bool,
}

impl Moments {
    fn at(m: &Transformer, s: &Setup, micro: u64) -> Self {
        let p = s.precision;
        let per_layer = layer_activations(m, s, micro);
        let outside = outside_activations(m, s, micro);
        // During the head's backward only the blocks not checkpointed hold activations (none
        // unless `first_n`); during the body's, `live_blocks`.
        let in_head = (m.layers - s.checkpointed_blocks(m)) * per_layer;
        let in_body = s.live_blocks(m) * per_layer;
        let activations = in_body + outside;
        let tokens = micro * m.seq_len;
        let chunk = s.loss_chunk_tokens.map_or(tokens, |c| c.clamp(1, tokens.max(1)));
        let (logits, logit_grad, cross_entropy) = match s.fused_cross_entropy {
            false => {
                let logits = p.logit_bytes() * chunk * m.padded_vocab();
                // Cross-entropy's backward: the log-probabilities' gradient (their dtype) and the
                // logits' gradient. Under CUDA autocast log_softmax runs on the 16-bit logits with
                // dtype=float, and its backward writes the logits' gradient in their own 16-bit
                // dtype: 4 + 2 bytes, not 4 + 4 (the H100's bf16-mixed peaks were 2·b·s·v bytes
                // below the estimate that counted 4). CPU autocast casts the logits to fp32
                // first: 4 + 4 there.
                let logit_grad = chunk
                    * m.padded_vocab()
                    * if s.target == Target::Cuda { p.activation_bytes() } else { p.logit_bytes() };
                (logits, logit_grad, logits + logit_grad)
            }
            true => {
                // Our node keeps the head's logits as they are (16-bit under autocast) and an
                // fp32 log-sum-exp per row; its backward writes only the logits' gradient, in
                // their dtype, or with `fused_loss_gradient` its forward writes it over the
                // logits (no second buffer). On the CPU it works through blocks of rows, one fp32
                // block at a time (exponentiated in place); a forward that also writes the
                // gradient holds the block's copy beside logsumexp's working block.
                let logits = chunk * m.padded_vocab() * p.activation_bytes() + 4 * chunk;
                let logit_grad = chunk * m.padded_vocab() * p.activation_bytes();
                let in_forward = s.loss_gradient_in_forward();
                let blocks = if in_forward { 2 } else { 1 };
                let scratch = match s.target {
                    Target::Cpu => {
                        blocks
                            * 4
                            * chunk.min(crate::ffi::loss::cpu_block_rows(m.padded_vocab()))
                            * m.padded_vocab()
                    }
                    Target::Cuda => 0,
                };
                (logits, logit_grad, if in_forward { scratch } else { logit_grad + scratch })
            }
        };
        // The head's weight gradient (the token embedding's, tied; under --params an untied
        // head's, which has no second gradient to add at the end).
        let head_grad = m.padded_vocab() * m.hidden * p.grad_bytes();
        // The gradient of the hidden state the head reads.
        let hidden_grad = tokens * m.hidden * p.residual_bytes();
        let tied = tied(m);
        let mut block_backward = sum(&m.saved(s).block_backward, &widths(s), micro, m.seq_len);
        let (head, embedding_grad_transient) = if s.split_backward() {
            // Chunk after chunk: log-probabilities and their two gradients, then the chunk's
            // logit gradient with the head's new weight gradient, each next to the gradient
            // summed over the chunks before; the gradients of the chunk inputs pile up to the
            // hidden state's size. Afterwards the head's gradient and the hidden state's are
            // held through the body's backward.
            let later = u64::from(chunk < tokens);
            block_backward += head_grad + hidden_grad;
            (
                (logits + cross_entropy + later * head_grad).max(logit_grad + (1 + later) * head_grad)
                    + hidden_grad,
                tied * head_grad,
            )
        } else {
            // The loss's forward and backward (logits and cross-entropy's buffers), then the
            // head's backward: the logits' gradient (the loss's other buffers freed; with
            // `fused_loss_gradient` the logits themselves) with the head's weight gradient and the
            // hidden state's. The first is larger unless the head's gradients are as large as
            // the logits (a wide model, few tokens a micro-batch).
            ((logits + cross_entropy).max(logit_grad + head_grad + hidden_grad), tied * 2 * head_grad)
        };
        Self {
            per_layer,
            outside,
            activations,
            logits,
            cross_entropy,
            block_backward,
            embedding_grad_transient,
            transient: outside + (in_head + head).max(in_body + block_backward),
            body: outside + in_body + block_backward,
            head_wins: in_head + head >= in_body + block_backward,
        }
    }
}

impl Estimate {
    /// Weights, master weights, gradients and optimizer state: what the run holds before the
    /// first activation.
    pub fn states(&self) -> u64 {
        self.weights + self.master_weights + self.gradients + self.optimizer
    }

    /// `fixed + per_sample · micro_batch`: the total while accumulating and while activations
    /// outweigh gradients (the regime a recommendation lands in).
    pub fn linear(&self, micro: u64) -> u64 {
        self.fixed + self.per_sample * micro
    }
}

/// Inputs the planner's tests share.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;
    use crate::config::Arch;

    /// GPT-2 small: 12 × 768, 12 heads, vocab 50257, seq 1024, biases.
    pub fn gpt2_small() -> Transformer {
        Transformer {
            layers: 12,
            hidden: 768,
            heads: 12,
            vocab: 50257,
            seq_len: 1024,
            ffn: 3072,
            bias: true,
            params_override: None,
            ..Default::default()
        }
    }

    /// Llama 3.2 1B: 16 × 2048, 32 heads sharing 8 KV heads, SwiGLU 8192, vocab 128256, tied, seq 2048.
    pub fn llama32_1b() -> Transformer {
        Transformer {
            arch: Arch::Llama,
            layers: 16,
            hidden: 2048,
            heads: 32,
            kv_heads: Some(8),
            vocab: 128_256,
            seq_len: 2048,
            ffn: 8192,
            tied: true,
            bias: false,
            pad_vocab_to: 64,
            params_override: None,
        }
    }

    /// fp32 AdamW on one CUDA GPU, flash attention, 1 GiB context, 10% fragmentation.
    pub fn cuda_fp32_adamw() -> Setup {
        Setup {
            precision: Precision::Fp32,
            optimizer: OptimizerName::Adamw,
            activation_checkpointing: false,
            checkpoint_blocks: 1,
            checkpoint_first: None,
            flash: true,
            dropout: false,
            loss_chunk_tokens: None,
            fused_rms_norm: true,
            cuda_optimizers: false,
            fused_optimizer: true,
            offload_activations: false,
            fused_cross_entropy: false,
            fused_loss_gradient: false,
            fused_residual_norm: false,
            fused_swiglu: false,
            fused_rope: false,
            cuda_graphs: false,
            merged_projections: false,
            document_mask: false,
            fused_linear: false,
            target: Target::Cuda,
            gpus: 1,
            shard: crate::config::ShardLevel::None,
            offload_optimizer: false,
            bucket_mb: 25.0,
            overlap: true,
            overlap_in_backward: true,
            cuda_overhead: 1 << 30,
            fragmentation: 0.1,
            background_checkpoint: false,
        }
    }

    /// The same on the CPU (the analogue `--profile` measures): no context, no fragmentation.
    pub fn cpu_fp32_adamw() -> Setup {
        Setup { target: Target::Cpu, cuda_overhead: 0, fragmentation: 0.0, ..cuda_fp32_adamw() }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::gpt2_small as gpt2;
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;
    /// GPT-2's 50257 tokens padded to a multiple of 64 (`model.pad_vocab_to`, default 64): the
    /// rows the embedding holds and the width of the logits.
    const V: u64 = 50304;

    fn setup(precision: Precision, optimizer: OptimizerName) -> Setup {
        Setup { precision, optimizer, ..super::fixtures::cpu_fp32_adamw() }
    }

    #[test]
    fn gpt2_small_has_124_439_808_parameters() {
        // nanoGPT prints 124.44M for GPT-2 small with the tied head counted once (vocab 50257).
        let unpadded = Transformer { pad_vocab_to: 1, ..gpt2() };
        assert_eq!(unpadded.params(), 124_439_808);
        // Padded to 50304 rows, the 47 extra embedding rows count: the memory holds them.
        assert_eq!(gpt2().padded_vocab(), V);
        assert_eq!(gpt2().params(), 124_439_808 + (V - 50257) * 768);
        // Without biases: 2h per block and one h at the end fewer LayerNorm entries, and no linear biases.
        let no_bias = Transformer { bias: false, ..unpadded };
        let (h, l) = (768u64, 12u64);
        let biases = l * (2 * h + 3 * h + h + 4 * h + h) + h;
        assert_eq!(no_bias.params(), 124_439_808 - biases);
    }

    #[test]
    fn states_per_precision_and_optimizer_match_bytes_per_parameter() {
        let m = Transformer { params_override: None, ..gpt2() };
        let p = m.params();
        let e = estimate(&m, &setup(Precision::Fp32, OptimizerName::Adamw), 1, 1);
        assert_eq!((e.weights, e.master_weights, e.gradients, e.optimizer), (4 * p, 0, 4 * p, 8 * p));
        let e = estimate(&m, &setup(Precision::Bf16Mixed, OptimizerName::Adamw), 1, 1);
        assert_eq!((e.weights, e.master_weights, e.gradients, e.optimizer), (2 * p, 4 * p, 4 * p, 8 * p));
        assert_eq!(e.states(), 18 * p, "mixed-precision AdamW: 16-18 bytes/param");
        let e = estimate(&m, &setup(Precision::Bf16Pure, OptimizerName::Adamw), 1, 1);
        assert_eq!(e.states(), 8 * p);
        assert_eq!(estimate(&m, &setup(Precision::Fp32, OptimizerName::Sgd), 1, 1).optimizer, 0);
        assert_eq!(estimate(&m, &setup(Precision::Fp32, OptimizerName::SgdMomentum), 1, 1).optimizer, 4 * p);
    }

    /// `checkpoint.async` keeps a host copy of what a checkpoint holds; the GPU's total is
    /// unchanged.
    #[test]
    fn a_background_checkpoint_counts_its_host_copy_outside_the_gpu_total() {
        let m = Transformer { params_override: None, ..gpt2() };
        let p = m.params();
        let sync = estimate(&m, &setup(Precision::Fp32, OptimizerName::Adamw), 1, 1);
        let s = Setup { background_checkpoint: true, ..setup(Precision::Fp32, OptimizerName::Adamw) };
        let background = estimate(&m, &s, 1, 1);
        assert_eq!(
            (sync.checkpoint_copy, background.checkpoint_copy),
            (0, 12 * p),
            "weights and both moments"
        );
        assert_eq!(background.total, sync.total);
        let s = Setup { background_checkpoint: true, ..setup(Precision::Bf16Mixed, OptimizerName::Adamw) };
        assert_eq!(estimate(&m, &s, 1, 1).checkpoint_copy, 14 * p, "16-bit weights, fp32 masters, moments");
    }

    #[test]
    fn adafactor_and_8bit_adamw_follow_the_tensor_shapes() {
        let tiny = Transformer {
            layers: 1,
            hidden: 64,
            heads: 2,
            vocab: 128,
            seq_len: 16,
            ffn: 256,
            bias: false,
            params_override: None,
            ..Default::default()
        };
        let s = |o| estimate(&tiny, &setup(Precision::Fp32, o), 1, 1).optimizer;
        // Matrices: wte 128×64, wpe 16×64, qkv 192×64, proj 64×64, fc 256×64, proj 64×256; vectors: 3 LN weights of 64.
        let factored = (128 + 64) + (16 + 64) + (192 + 64) + (64 + 64) + (256 + 64) + (64 + 256);
        // On the CPU Adafactor's fused kernel leaves three one-element buffers.
        assert_eq!(s(OptimizerName::Adafactor), 4 * (factored + 3 * 64) + 3 * 4);
        // 8-bit: tensors of ≥ 4096 elements take 2 bytes/element + 8 bytes per 2048-block; smaller ones 8 bytes/element.
        let big = [128 * 64, 192 * 64, 64 * 64, 256 * 64, 64 * 256];
        let small = 16 * 64 + 3 * 64;
        let eight: u64 = big.iter().map(|&n: &u64| 2 * n + 8 * n.div_ceil(2048)).sum::<u64>() + 8 * small;
        // And, on the CPU (whose fused kernel needs no runs of blocks), three fp32 scratch
        // buffers as long as the largest unquantised tensor (wpe, 16×64).
        assert_eq!(s(OptimizerName::Adamw8bit), eight + 3 * 4 * 16 * 64);
    }

    /// On CUDA Adafactor's tensor ops work in bands of at most 4 Mi values: for GPT-2 the
    /// embedding's band (5461 of its 50304 rows × 768), the row means of its 50304 rows and the
    /// column means of the widest matrix (3072), fp32: 16.2 MiB beside the state.
    #[test]
    fn adafactor_on_cuda_counts_its_band_and_row_and_column_buffers() {
        let m = gpt2();
        let s = Setup { target: Target::Cuda, ..setup(Precision::Fp32, OptimizerName::Adafactor) };
        let state = per_spec(&m, Target::Cuda, |t| OptimizerName::Adafactor.state_for(t, 4));
        let (band, rows, cols) = (5461 * 768 * 4, 50304 * 4, 3072 * 4);
        assert_eq!(band + rows + cols, 16_989_696);
        let rounded: u64 = [band, rows, cols].iter().map(|&b: &u64| b.div_ceil(512) * 512).sum();
        assert_eq!(estimate(&m, &s, 1, 1).optimizer, state + rounded);
    }

    /// `data.document_mask`: on the CPU the fp32 t × t mask per sequence (and per block its
    /// 16-bit copy in bf16), on CUDA 4 bytes of lengths a token, never a t × t matrix; both keep
    /// the int64 positions; Llama's RoPE tables become per token.
    #[test]
    fn document_masking_counts_the_cpus_mask_and_cudas_lengths() {
        let b = 4u64;
        for m in [gpt2(), super::fixtures::llama32_1b()] {
            let (l, d, seq) = (m.layers, m.hidden / m.heads, m.seq_len);
            for precision in [Precision::Fp32, Precision::Bf16Mixed] {
                for target in [Target::Cpu, Target::Cuda] {
                    let plain = Setup { target, ..setup(precision, OptimizerName::Adamw) };
                    let masked = Setup { document_mask: true, ..plain.clone() };
                    let outside = outside_activations(&m, &masked, b) - outside_activations(&m, &plain, b);
                    let form = match target {
                        Target::Cpu => seq * seq * b * 4,
                        Target::Cuda => seq * b * 4,
                    };
                    assert_eq!(outside, seq * b * 8 + form, "{:?} {target:?} {precision:?}", m.arch);
                    let per_block =
                        layer_activations(&m, &masked, b) as i64 - layer_activations(&m, &plain, b) as i64;
                    let e = precision.activation_bytes();
                    let cast = if target == Target::Cpu && e == 2 { seq * seq * b * e } else { 0 };
                    let rope = match m.arch {
                        // per-token tables replace the cast position tables (none in fp32) or the node's
                        crate::config::Arch::Llama => {
                            let before = if e == 4 { 0 } else { 4 * d * seq * e };
                            (2 * d * seq * b * e) as i64 - before as i64
                        }
                        crate::config::Arch::Gpt2 => 0,
                    };
                    assert_eq!(
                        per_block,
                        cast as i64 + rope,
                        "{:?} {target:?} {precision:?}: {l} blocks",
                        m.arch
                    );
                }
            }
        }
    }

    #[test]
    fn korthikanti_activations_in_16_bit_with_dropout_and_materialised_attention() {
        let m = gpt2();
        // Everything in 16 bits, the residual stream included, as in Megatron's accounting.
        let s = Setup {
            dropout: true,
            flash: false,
            target: Target::Cuda,
            ..setup(Precision::Bf16Pure, OptimizerName::Adamw)
        };
        let (seq, b, h, a) = (1024u64, 4u64, 768u64, 12u64);
        // s·b·h·(34 + 5·a·s/h) plus the fp32 LayerNorm statistics (2 norms × mean, rstd).
        let korthikanti = seq * b * h * 34 + 5 * a * seq * seq * b;
        assert_eq!(layer_activations(&m, &s, b), korthikanti + 16 * b * seq);
        // Flash keeps the fp32 log-sum-exp instead of the b·a·s² scores.
        let flash = Setup { flash: true, ..s.clone() };
        assert_eq!(layer_activations(&m, &flash, b), seq * b * h * 34 + 4 * b * a * seq + 16 * b * seq);
        // Under autocast the residual stream stays fp32: the two LayerNorm inputs take 4 bytes.
        let mixed = Setup { precision: Precision::Bf16Mixed, ..s.clone() };
        assert_eq!(layer_activations(&m, &mixed, b), korthikanti + 16 * b * seq + 2 * 2 * seq * b * h);
    }

    #[test]
    fn fp32_flash_without_dropout_keeps_sixteen_activations_per_token_and_channel() {
        let m = gpt2();
        let s = setup(Precision::Fp32, OptimizerName::Adamw);
        let (seq, b, h, a) = (1024u64, 2u64, 768u64, 12u64);
        assert_eq!(layer_activations(&m, &s, b), seq * b * h * 16 * 4 + 4 * b * a * seq + 16 * b * seq);
    }

    #[test]
    fn checkpointing_keeps_block_inputs_and_one_block() {
        let m = gpt2();
        let s = setup(Precision::Fp32, OptimizerName::Adamw);
        let ck = Setup { activation_checkpointing: true, ..s.clone() };
        let (plain, with) = (estimate(&m, &s, 8, 2), estimate(&m, &ck, 8, 2));
        let sbh = 1024 * 8 * 768;
        assert_eq!(
            with.activations,
            plain.activations - 12 * plain.activations_per_layer + plain.activations_per_layer + 12 * sbh * 4
        );
        assert!(with.activations * 4 < plain.activations);
    }

    #[test]
    fn segments_of_three_blocks_keep_four_inputs_and_recompute_three_blocks() {
        let m = gpt2();
        let s = Setup {
            activation_checkpointing: true,
            checkpoint_blocks: 3,
            ..setup(Precision::Fp32, OptimizerName::Adamw)
        };
        let e = estimate(&m, &s, 8, 2);
        let sbh = 1024 * 8 * 768;
        let blocks = Setup { checkpoint_blocks: 1, ..s.clone() };
        let one = estimate(&m, &blocks, 8, 2);
        assert_eq!(
            e.activations_outside,
            one.activations_outside - 8 * sbh * 4,
            "12 / 3 = 4 saved inputs instead of 12"
        );
        assert_eq!(e.activations, 3 * e.activations_per_layer + e.activations_outside);
    }

    /// `first_n:4` of 12 blocks: the later 8 keep their activations, the first 4 keep their
    /// inputs; the head's backward sees the 8 blocks; at least as much as full checkpointing,
    /// less than none, and `first_n` past the depth is full checkpointing.
    #[test]
    fn checkpointing_the_first_blocks_keeps_the_later_blocks_activations() {
        let m = gpt2();
        let s = setup(Precision::Fp32, OptimizerName::Adamw);
        let full = Setup { activation_checkpointing: true, ..s.clone() };
        let part = Setup { checkpoint_first: Some(4), ..full.clone() };
        let (plain, all, e) = (estimate(&m, &s, 8, 2), estimate(&m, &full, 8, 2), estimate(&m, &part, 8, 2));
        let sbh = 1024 * 8 * 768;
        assert_eq!(
            e.activations_outside,
            all.activations_outside - 8 * sbh * 4,
            "4 saved inputs instead of 12"
        );
        assert_eq!(e.activations, 8 * e.activations_per_layer + e.activations_outside);
        assert!(all.peak_allocated < e.peak_allocated && e.peak_allocated < plain.peak_allocated);
        assert_eq!(estimate(&m, &Setup { checkpoint_first: Some(40), ..full.clone() }, 8, 2), all);
        assert_eq!(part.checkpointed_blocks(&m), 4);
    }

    /// GPT-2 small, seq 1024, micro-batch 4, fp32: 4096 tokens in chunks of 1024.
    #[test]
    fn a_chunked_loss_holds_one_chunk_of_logits_and_the_heads_gradient() {
        let m = gpt2();
        let s = Setup { loss_chunk_tokens: Some(1024), ..setup(Precision::Fp32, OptimizerName::Adamw) };
        let e = estimate(&m, &s, 4, 1);
        let (l, g, hidden) = (4 * 1024 * V, V * 768 * 4, 4096 * 768 * 4);
        assert_eq!((e.logits, e.cross_entropy), (l, 2 * l));
        // Chunk after the first: three logit-sized buffers next to the head's summed gradient,
        // or one next to that and the chunk's new one; plus the chunk inputs' gradients.
        let head = (3 * l + g).max(l + 2 * g) + hidden;
        assert_eq!(e.peak_phase, "start of backward");
        assert_eq!(
            e.peak_allocated,
            e.weights + e.optimizer + 12 * e.activations_per_layer + e.activations_outside + head
        );
        // Without chunks: 3 × 4 × 4096 × 50304 bytes (2.30 GiB) of logits and their gradients
        // against 0.73 GiB with them.
        let plain = estimate(&m, &setup(Precision::Fp32, OptimizerName::Adamw), 4, 1);
        let saved = (plain.peak_allocated - e.peak_allocated) as f64 / GIB;
        assert!((saved - 1.58).abs() < 0.01, "{saved} GiB");
        // The final LayerNorm's output and statistics live per chunk, not for the batch.
        assert_eq!(plain.activations_outside - e.activations_outside, 4096 * 768 * 4 + 2 * 4 * 4096);
        // The tied embedding's second gradient is added in place: one copy at the end, not two.
        assert_eq!(e.embedding_grad_transient, g);
        assert_eq!(plain.embedding_grad_transient, 2 * g);
    }

    #[test]
    fn checkpointed_the_first_blocks_backward_holds_every_later_gradient() {
        // A short sequence with a 2-chunk loss: the logits are small, the gradients are not.
        let m = Transformer { seq_len: 256, ..gpt2() };
        let s = Setup {
            activation_checkpointing: true,
            checkpoint_blocks: 3,
            loss_chunk_tokens: Some(256),
            ..setup(Precision::Fp32, OptimizerName::Adamw)
        };
        let e = estimate(&m, &s, 8, 2);
        assert_eq!(e.peak_phase, "first blocks' recomputed backward");
        let block = (12 * 768 * 768 + 13 * 768) as f64; // 4h² + 2fh weights, 9h + f biases and LayerNorms
        let not_yet = (e.gradients as f64 * (3.0 * block + 256.0 * 768.0) / m.layout_params() as f64) as u64;
        let tokens = 8 * 256;
        let expected = e.gradients - not_yet
            + e.activations_outside
            + 3 * e.activations_per_layer
            + (3072 + 2 * 768) * tokens * 4;
        assert_eq!(e.peak_allocated, e.weights + e.optimizer + e.gradients + expected);
    }

    #[test]
    fn gpt2_at_512_by_512_is_dominated_by_49_gib_of_fp32_padded_logits() {
        let m = Transformer { seq_len: 512, ..gpt2() };
        let e = estimate(&m, &setup(Precision::Fp32, OptimizerName::Adamw), 512, 1);
        assert_eq!(e.logits, 4 * 512 * 512 * V);
        assert!((e.logits as f64 / GIB - 49.12).abs() < 0.01, "{}", e.logits as f64 / GIB);
        // The vocabulary term is the largest part: log-probabilities and cross-entropy's two
        // gradient buffers outweigh all twelve blocks' activations and the whole model state...
        assert!(e.logits + e.cross_entropy > e.activations);
        assert!(e.logits + e.cross_entropy > 50 * e.states());
        // ...and one logits tensor is more than three blocks' activations.
        assert!(e.logits > 3 * e.activations_per_layer);
    }

    #[test]
    fn llama_8b_in_bf16_needs_about_60_gb_before_activations() {
        // Llama-3-8B: 32 layers, hidden 4096, 32 heads, vocab 128256, SwiGLU width 14336; 8.03B parameters.
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
        let e = estimate(&m, &setup(Precision::Bf16Pure, OptimizerName::Adamw), 1, 1);
        let gb = e.states() as f64 / 1e9;
        assert!(
            (gb - 64.2).abs() < 0.5,
            "{gb} GB: 2 (weights) + 2 (grads) + 4 (two bf16 moments) bytes/param"
        );
        assert!(e.states() > 40 * (1 << 30), "does not fit a 40 GB card before the first activation");
    }

    /// `fixed + per_sample · b` is the total while accumulating in whichever moment holds the
    /// peak: it was the start of backward's line, off by 3.4 GiB for Llama 3.2 1B (peak in the
    /// first blocks' recomputed backward) and by 0.2 GiB for GPT-2 with `every_n:5`.
    #[test]
    fn the_fixed_and_per_sample_line_is_the_total_whatever_the_peak_moment() {
        let cuda = super::fixtures::cuda_fp32_adamw();
        let ck = Setup { activation_checkpointing: true, precision: Precision::Bf16Mixed, ..cuda.clone() };
        let cases = [
            (
                super::fixtures::llama32_1b(),
                Setup { fused_cross_entropy: true, fused_loss_gradient: true, ..ck.clone() },
                4,
            ),
            (gpt2(), Setup { checkpoint_blocks: 5, ..ck.clone() }, 8),
            (Transformer { seq_len: 1, ..gpt2() }, cuda.clone(), 1),
            (gpt2(), cuda, 8),
        ];
        let mut phases = std::collections::BTreeSet::new();
        for (m, s, micro) in cases {
            let e = estimate(&m, &s, micro, 2);
            phases.insert(e.peak_phase);
            assert!(
                e.linear(micro).abs_diff(e.total) <= 2 * micro,
                "{}: {} vs {}",
                e.peak_phase,
                e.linear(micro),
                e.total
            );
        }
        assert_eq!(phases.len(), 3, "{phases:?}");
    }

    #[test]
    fn peak_counts_held_gradients_only_when_accumulating() {
        let m = gpt2();
        let s = setup(Precision::Fp32, OptimizerName::Adamw);
        let (one, two) = (estimate(&m, &s, 4, 1), estimate(&m, &s, 4, 2));
        assert_eq!(two.peak_allocated - one.peak_allocated, one.gradients);
        // fixed + slope·b while accumulating, to the byte per sample (rounding of the margin).
        assert!(two.linear(4).abs_diff(two.total) <= 4);
        let nine = estimate(
            &m,
            &Setup { target: Target::Cuda, fragmentation: 0.1, cuda_overhead: 1 << 30, ..s.clone() },
            9,
            3,
        );
        assert!(nine.linear(9).abs_diff(nine.total) <= 9, "{} vs {}", nine.linear(9), nine.total);
        // A tiny batch: activations are smaller than the gradients, which then set the peak.
        let short = Transformer { seq_len: 1, ..gpt2() };
        let e = estimate(&short, &s, 1, 1);
        assert_eq!(e.embedding_grad_transient, 2 * V * 768 * 4);
        assert_eq!(e.peak_allocated, e.weights + e.optimizer + e.gradients + e.embedding_grad_transient);
        assert_eq!(e.peak_phase, "end of backward");
        assert_eq!(two.peak_phase, "start of backward");
        // In mixed precision autocast's 16-bit weight copies are gone by then; bf16-pure's
        // 16-bit weights are the parameters themselves and stay.
        for precision in [Precision::Bf16Mixed, Precision::Fp16Mixed, Precision::Bf16Pure] {
            let e = estimate(&short, &setup(precision, OptimizerName::Adamw), 1, 1);
            let copies = if precision == Precision::Bf16Pure { 0 } else { e.weights };
            assert_eq!(e.peak_phase, "end of backward", "{precision:?}");
            assert_eq!(
                e.peak_allocated,
                e.weights + e.master_weights + e.optimizer + e.gradients + e.embedding_grad_transient
                    - copies,
                "{precision:?}"
            );
        }
        // The linear node's casts kept through the step (CUDA, no checkpointing; with graphs,
        // checkpointing or not, for the run) are still there at its end.
        let cuda = Setup { target: Target::Cuda, ..setup(Precision::Bf16Mixed, OptimizerName::Adamw) };
        let kept = Setup { fused_linear: true, ..cuda.clone() };
        let (released, held) = (estimate(&short, &cuda, 1, 1), estimate(&short, &kept, 1, 1));
        assert_eq!(held.peak_allocated - released.peak_allocated, released.weights);
        for other in [
            Setup { activation_checkpointing: true, ..kept.clone() },
            Setup { target: Target::Cpu, ..kept.clone() },
            Setup { fused_linear: false, ..kept.clone() },
        ] {
            assert!(!other.keeps_casts(), "{other:?}");
        }
        assert!(
            Setup { activation_checkpointing: true, cuda_graphs: true, ..kept.clone() }.keeps_casts(),
            "the graphs keep them for the run"
        );
    }

    #[test]
    fn a_byte_vocabulary_puts_the_peak_in_the_last_blocks_backward() {
        // bench-10m: h = 384, f = 1536, v = 256: 12·v = 3072 bytes/token of logits and
        // cross-entropy against (f + h)·4 = 7680 bytes/token of the last block's gradients.
        let m = Transformer {
            layers: 6,
            hidden: 384,
            heads: 6,
            vocab: 256,
            seq_len: 256,
            ffn: 1536,
            bias: true,
            params_override: None,
            ..Default::default()
        };
        let e = estimate(&m, &setup(Precision::Fp32, OptimizerName::Adamw), 8, 2);
        assert_eq!(e.block_backward_transient, (1536 + 384) * 256 * 8 * 4);
        assert_eq!(e.peak_phase, "last block's backward");
        assert_eq!(
            e.peak_allocated,
            e.weights + e.optimizer + e.gradients + e.activations + e.block_backward_transient
        );
        assert_eq!(
            estimate(&gpt2(), &setup(Precision::Fp32, OptimizerName::Adamw), 8, 2).peak_phase,
            "start of backward"
        );
    }

    /// The H100's bf16-mixed figure (gpt2-124m, seq 1024, vocab 50257, two micro-steps per
    /// step; `scripts/bench/plan_accuracy.sh --device cuda`, ../shared/reference/gpu-measurements.md):
    /// the allocator's peak above the pre-model baseline at micro-batch 59 was 49.38 GiB, where
    /// the estimate that counted the logits' gradient in fp32 said 54.99 GiB (+11.4%; 2·b·s·v =
    /// 5.65 GiB of it). Counted in 16 bits, as CUDA autocast's log_softmax backward writes it:
    #[test]
    fn bf16_mixed_on_cuda_counts_the_logits_gradient_in_16_bits_and_meets_the_h100_peak() {
        let s = Setup { precision: Precision::Bf16Mixed, ..super::fixtures::cuda_fp32_adamw() };
        // Measured before model.pad_vocab_to existed: the unpadded 50257-wide head.
        let m = Transformer { vocab: 50257, seq_len: 1024, pad_vocab_to: 1, ..gpt2() };
        let e = estimate(&m, &s, 59, 2);
        let tokens_by_vocab = 59 * 1024 * 50257;
        assert_eq!((e.logits, e.cross_entropy), (4 * tokens_by_vocab, (4 + 2) * tokens_by_vocab));
        let error = e.peak_allocated as f64 / (49.38 * GIB) - 1.0;
        println!(
            "bf16-mixed at 59: estimate {:.2} GiB vs 49.38 GiB measured: {:+.2}%",
            e.peak_allocated as f64 / GIB,
            error * 100.0
        );
        assert!(
            error.abs() < 0.03,
            "estimate {:.2} GiB vs 49.38 GiB measured: {:+.1}%",
            e.peak_allocated as f64 / GIB,
            error * 100.0
        );
        // fp32 and the CPU analogue keep 4 + 4.
        let fp32 = estimate(&m, &super::fixtures::cuda_fp32_adamw(), 59, 2);
        assert_eq!(fp32.cross_entropy, 8 * tokens_by_vocab);
        let cpu = estimate(
            &m,
            &Setup { precision: Precision::Bf16Mixed, ..super::fixtures::cpu_fp32_adamw() },
            59,
            2,
        );
        assert_eq!(cpu.cross_entropy, 8 * tokens_by_vocab);
    }

    /// `kernels.fused_loss_gradient`: the logits become their gradient, so gpt2-124m's start of
    /// backward at micro 16 (bf16-mixed, CUDA) holds the logits, then the head's weight and
    /// hidden gradients beside them, where the two-pass node held a second logits-sized buffer:
    /// 1.44 GB lower. On the CPU two fp32 blocks of working values stay.
    #[test]
    fn the_loss_gradient_in_the_forward_drops_the_second_logits_buffer() {
        let two_pass = Setup {
            precision: Precision::Bf16Mixed,
            fused_cross_entropy: true,
            ..super::fixtures::cuda_fp32_adamw()
        };
        let in_forward = Setup { fused_loss_gradient: true, ..two_pass.clone() };
        assert!(in_forward.loss_gradient_in_forward() && !two_pass.loss_gradient_in_forward());
        assert!(
            !Setup { fused_cross_entropy: false, ..in_forward.clone() }.loss_gradient_in_forward(),
            "only with the fused loss"
        );
        let m = gpt2();
        let (a, b) = (estimate(&m, &two_pass, 16, 4), estimate(&m, &in_forward, 16, 4));
        let tokens = 16 * 1024;
        let logits = 2 * tokens * V;
        assert_eq!((a.cross_entropy, b.cross_entropy), (logits, 0));
        assert_eq!((a.peak_phase, b.peak_phase), ("start of backward", "start of backward"));
        let (head_grad, hidden_grad) = (V * 768 * 4, tokens * 768 * 4);
        assert_eq!(a.peak_allocated - b.peak_allocated, logits + 4 * tokens - head_grad - hidden_grad);
        println!(
            "gpt2-124m micro 16: peak {:.2} → {:.2} GiB",
            a.peak_allocated as f64 / GIB,
            b.peak_allocated as f64 / GIB
        );
        let cpu = |s: &Setup| estimate(&m, &Setup { target: Target::Cpu, ..s.clone() }, 16, 4).cross_entropy;
        let block = 4 * crate::ffi::loss::cpu_block_rows(V) * V;
        assert_eq!((cpu(&two_pass), cpu(&in_forward)), (logits + block, 2 * block));
    }

    #[test]
    fn cuda_target_adds_rounding_fragmentation_and_context() {
        let m = Transformer {
            layers: 1,
            hidden: 8,
            heads: 2,
            vocab: 16,
            seq_len: 4,
            ffn: 32,
            bias: true,
            params_override: None,
            ..Default::default()
        };
        let cpu = setup(Precision::Fp32, OptimizerName::Adamw);
        let cuda = Setup { target: Target::Cuda, cuda_overhead: 1 << 30, fragmentation: 0.1, ..cpu.clone() };
        let (a, b) = (estimate(&m, &cpu, 2, 2), estimate(&m, &cuda, 2, 2));
        // Every one of the 16 tensors rounds up to 512 bytes or more.
        assert_eq!(a.weights, 4 * m.params());
        assert_eq!(b.weights % 512, 0);
        assert!(b.weights >= 16 * 512);
        assert_eq!(b.fragmentation, (b.peak_allocated as f64 * 0.1).round() as u64);
        assert_eq!(b.total, b.peak_allocated + b.fragmentation + (1 << 30));
        assert_eq!((a.fragmentation, a.cuda_overhead), (0, 0));
    }

    #[test]
    fn data_parallel_adds_gradient_buckets() {
        let s = Setup { gpus: 4, ..setup(Precision::Fp32, OptimizerName::Adamw) };
        let e = estimate(&gpt2(), &s, 1, 1);
        assert_eq!(e.dp_buffers, e.gradients);
        // The buckets are fp32 whatever the precision: twice bf16-pure's gradients.
        let pure = estimate(&gpt2(), &Setup { precision: Precision::Bf16Pure, ..s }, 1, 1);
        assert_eq!(pure.dp_buffers, 2 * pure.gradients);
    }

    #[test]
    fn unfused_adamw_keeps_a_temporary_the_size_of_the_largest_parameter() {
        let (m, s) = (gpt2(), setup(Precision::Fp32, OptimizerName::Adamw));
        let largest = m.tensors().iter().map(|sh| sh.iter().product::<u64>()).max().unwrap();
        let (fused, unfused) =
            (estimate(&m, &s, 1, 1), estimate(&m, &Setup { fused_optimizer: false, ..s.clone() }, 1, 1));
        assert_eq!(unfused.optimizer - fused.optimizer, largest * 4);
        let pure = Setup { precision: Precision::Bf16Pure, ..s };
        assert_eq!(
            estimate(&m, &Setup { fused_optimizer: false, ..pure.clone() }, 1, 1).optimizer
                - estimate(&m, &pure, 1, 1).optimizer,
            largest * 2
        );
    }

    #[test]
    fn offloaded_segment_inputs_leave_the_gpu_but_one() {
        let m = gpt2();
        let ck = Setup { activation_checkpointing: true, ..super::fixtures::cuda_fp32_adamw() };
        let (kept, offloaded) =
            (estimate(&m, &ck, 8, 2), estimate(&m, &Setup { offload_activations: true, ..ck.clone() }, 8, 2));
        let sbh = 1024 * 8 * 768;
        assert_eq!(
            kept.activations_outside - offloaded.activations_outside,
            11 * sbh * 4,
            "12 inputs kept, 1 back at a time"
        );
        // On the CPU host memory is the device's: nothing moves.
        let cpu = Setup { target: Target::Cpu, cuda_overhead: 0, fragmentation: 0.0, ..ck };
        assert_eq!(
            estimate(&m, &cpu, 8, 2).activations_outside,
            estimate(&m, &Setup { offload_activations: true, ..cpu }, 8, 2).activations_outside
        );
    }

    #[test]
    fn llama_3_2_1b_has_1_235_814_400_parameters_and_its_untied_head_adds_an_embedding() {
        let m = super::fixtures::llama32_1b();
        let (h, v, f, kv, l) = (2048u64, 128_256u64, 8192u64, 512u64, 16u64);
        // Per layer: two RMSNorm weights, q and o (h × h), k and v (kv·d × h), gate, up, down (f × h).
        let per_layer = 2 * h + 2 * h * h + 2 * kv * h + 3 * f * h;
        assert_eq!(v * h + l * per_layer + h, 1_235_814_400);
        assert_eq!(m.params(), 1_235_814_400);
        let untied = Transformer { tied: false, ..m.clone() };
        assert_eq!(untied.params(), 1_235_814_400 + v * h);
        // Its gradient and AdamW moments follow: 4 + 8 bytes per parameter more in fp32.
        let s = setup(Precision::Fp32, OptimizerName::Adamw);
        let (a, b) = (estimate(&m, &s, 1, 1), estimate(&untied, &s, 1, 1));
        assert_eq!((b.gradients - a.gradients, b.optimizer - a.optimizer), (4 * v * h, 8 * v * h));
        // No second gradient of the token embedding to sum at the end of backward.
        assert_eq!((a.embedding_grad_transient, b.embedding_grad_transient), (2 * v * h * 4, 0));
    }

    #[test]
    fn grouped_query_attention_shrinks_k_and_v_weights_and_activations() {
        let m = super::fixtures::llama32_1b();
        let (h, d) = (2048u64, 64u64);
        // q_proj, k_proj, v_proj of layer 0 (after its input norm and the embedding).
        assert_eq!(m.tensors()[2..5], [vec![h, h], vec![8 * d, h], vec![8 * d, h]]);
        let mha = Transformer { kv_heads: None, ..m.clone() };
        assert_eq!(mha.params() - m.params(), 16 * 2 * (32 - 8) * d * h);
        // Saved k and v: 2 × (32 − 8) × 64 fewer channels per token, at 2 bytes under autocast.
        let s = setup(Precision::Bf16Mixed, OptimizerName::Adamw);
        let (b, seq) = (3u64, 2048u64);
        assert_eq!(layer_activations(&mha, &s, b) - layer_activations(&m, &s, b), 2 * 24 * d * b * seq * 2);
    }

    #[test]
    fn a_llama_block_saves_rmsnorm_in_fp32_rotated_q_k_and_four_swiglu_tensors() {
        let m = super::fixtures::llama32_1b();
        let (h, kv, f, a, d, seq, b) = (2048u64, 512u64, 8192u64, 32u64, 64u64, 2048u64, 2u64);
        let tokens = b * seq;
        // fp32: each RMSNorm keeps its input, rsqrt, normalised input and output (3h + 1, the
        // output once for all its readers); rotated q, rotated k, v, the attention output; the
        // log-sum-exp per head; gate, up, silu(gate) and their product. RoPE's tables are views.
        let fp32 = setup(Precision::Fp32, OptimizerName::Adamw);
        let per_token = 4 * (2 * (3 * h + 1) + (h + 2 * kv + h) + 4 * f) + 4 * a;
        assert_eq!(layer_activations(&m, &fp32, b), per_token * tokens);
        // bf16-mixed: the norms stay fp32 (input, rsqrt, normalised), each linear layer keeps its
        // own bf16 copy of the norm's output (3 for q, k, v; 2 for gate, up), the rest in bf16,
        // and cos and sin are cast to bf16 for q and for k in every block.
        let mixed = setup(Precision::Bf16Mixed, OptimizerName::Adamw);
        let norms = (4 * (2 * h + 1)) * 2 + 2 * h * (3 + 2);
        let per_token = norms + 2 * (h + 2 * kv + h) + 2 * 4 * f + 4 * a;
        assert_eq!(layer_activations(&m, &mixed, b), per_token * tokens + 4 * seq * d * 2);
        // bf16-pure: the fp32 copy of each norm's input, its rsqrt, the bf16 normalised input and one bf16 output.
        let pure = setup(Precision::Bf16Pure, OptimizerName::Adamw);
        let per_token = 2 * (4 * h + 4 + 2 * h + 2 * h) + 2 * (h + 2 * kv + h) + 2 * 4 * f + 4 * a;
        assert_eq!(layer_activations(&m, &pure, b), per_token * tokens + 4 * seq * d * 2);
        // The final RMSNorm outside the blocks, next to the int64 inputs and targets.
        assert_eq!(outside_activations(&m, &fp32, b), (4 * (3 * h + 1) + 16) * tokens);
        // The fp32 cos and sin tables, seq_len × head_dim each, held once.
        let e = estimate(&m, &fp32, b, 1);
        assert_eq!(e.buffers, 2 * seq * d * 4);
        assert_eq!(estimate(&gpt2(), &fp32, b, 1).buffers, 0);
        // Our SwiGLU node (CUDA) keeps gate, up and the product, not silu(gate): one f-wide
        // tensor less per block, in each precision's compute dtype.
        for (setup, bytes) in [(fp32, 4), (mixed, 2), (pure, 2)] {
            let (plain, ours) = (
                Setup { target: Target::Cuda, ..setup.clone() },
                Setup { target: Target::Cuda, fused_swiglu: true, ..setup.clone() },
            );
            assert_eq!(
                layer_activations(&m, &plain, b) - layer_activations(&m, &ours, b),
                bytes * f * tokens,
                "{:?}",
                setup.precision
            );
            let on_cpu = Setup { fused_swiglu: true, fused_rope: true, ..setup.clone() };
            assert_eq!(
                layer_activations(&m, &on_cpu, b),
                layer_activations(&m, &setup, b),
                "the CPU runs ATen's ops"
            );
            // Our RoPE node keeps no cast tables (fp32's casts are the tables themselves: none).
            let rope = Setup { target: Target::Cuda, fused_rope: true, ..setup.clone() };
            let tables = if bytes == 4 { 0 } else { 4 * seq * d * bytes };
            assert_eq!(
                layer_activations(&m, &plain, b) - layer_activations(&m, &rope, b),
                tables,
                "{:?}",
                setup.precision
            );
        }
    }

    /// `kernels.merged_projections`: each norm has one reader, so under autocast the first
    /// norm's three 16-bit copies become one and the second's two become one; in fp32 and
    /// bf16-pure the concatenated q/k/v and gate/up weights are kept per block (under autocast
    /// they are the 16-bit casts the weights already count). Backward the joint SwiGLU node (of
    /// ATen's ops here, ours on CUDA) writes the MLP's two gradients into the joint one: no
    /// more alive than with separate layers.
    #[test]
    fn merged_projections_have_one_reader_per_norm_and_keep_the_joined_weights() {
        let m = super::fixtures::llama32_1b();
        let (h, kv, f, seq, b) = (2048u64, 512u64, 8192u64, 2048u64, 2u64);
        let tokens = b * seq;
        let joined = (h + 2 * kv + 2 * f) * h;
        for (precision, weight_copy) in
            [(Precision::Fp32, 4 * joined), (Precision::Bf16Mixed, 0), (Precision::Bf16Pure, 2 * joined)]
        {
            let plain = setup(precision, OptimizerName::Adamw);
            let merged = Setup { merged_projections: true, ..plain.clone() };
            let casts = if precision == Precision::Bf16Mixed { 2 * h * (3 - 1 + 2 - 1) * tokens } else { 0 };
            assert_eq!(
                layer_activations(&m, &plain, b) + weight_copy - casts,
                layer_activations(&m, &merged, b),
                "{precision:?}"
            );
            let (e, em) = (estimate(&m, &plain, b, 1), estimate(&m, &merged, b, 1));
            assert_eq!(em.block_backward_transient, e.block_backward_transient, "{precision:?}");
            let node = Setup { target: Target::Cuda, fused_swiglu: true, ..plain.clone() };
            let (n, nm) = (
                estimate(&m, &node, b, 1),
                estimate(&m, &Setup { merged_projections: true, ..node.clone() }, b, 1),
            );
            assert_eq!(nm.block_backward_transient, n.block_backward_transient, "{precision:?}");
        }
        assert_eq!(
            layer_activations(
                &gpt2(),
                &Setup { merged_projections: true, ..setup(Precision::Bf16Mixed, OptimizerName::Adamw) },
                2
            ),
            layer_activations(&gpt2(), &setup(Precision::Bf16Mixed, OptimizerName::Adamw), 2),
            "GPT-2 is unchanged"
        );
    }

    /// `kernels.cuda_graphs`: the accumulators are a gradient-sized buffer held through the step
    /// where one micro-step would hold none; with accumulation the sum is held either way; the
    /// CPU captures nothing.
    #[test]
    fn cuda_graphs_hold_the_accumulators_beside_a_single_micro_step() {
        let m = gpt2();
        let cuda = Setup { precision: Precision::Bf16Mixed, ..super::fixtures::cuda_fp32_adamw() };
        let graphs = Setup { cuda_graphs: true, ..cuda.clone() };
        let (one, one_graphed) = (estimate(&m, &cuda, 4, 1), estimate(&m, &graphs, 4, 1));
        assert_eq!(one_graphed.peak_allocated - one.peak_allocated, one.gradients);
        assert_eq!(estimate(&m, &graphs, 4, 2).peak_allocated, estimate(&m, &cuda, 4, 2).peak_allocated);
        let cpu = Setup { target: Target::Cpu, ..graphs.clone() };
        assert_eq!(
            estimate(&m, &cpu, 4, 1).peak_allocated,
            estimate(&m, &Setup { cuda_graphs: false, ..cpu.clone() }, 4, 1).peak_allocated
        );
    }

    #[test]
    fn llama_3_2_1b_in_bf16_mixed_with_checkpointing_fits_an_h100_at_micro_batch_8() {
        let m = super::fixtures::llama32_1b();
        let s = Setup {
            precision: Precision::Bf16Mixed,
            activation_checkpointing: true,
            ..super::fixtures::cuda_fp32_adamw()
        };
        let e = estimate(&m, &s, 8, 32);
        // 16 + 2 bytes per parameter (bf16 weights, fp32 master, fp32 gradients, two fp32 moments).
        assert!((e.states() as f64 / 1e9 - 18.0 * 1.2358).abs() < 0.05, "{}", e.states());
        let budget = ((81_559u64 << 20) as f64 * 0.85) as u64; // the h100 preset's 79.65 GiB, 85% of it
        assert!(e.total < budget && estimate(&m, &s, 16, 16).total > budget, "{} GiB", e.total as f64 / GIB);
    }
}
