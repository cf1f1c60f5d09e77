//! The memory estimate, pure: what one training step of a decoder-only transformer holds on a
//! device, part by part (weights, fp32 master weights, gradients, optimizer state, activations,
//! logits and cross-entropy, data-parallel buffers, allocator margin, CUDA context), and the peak.
//! No tensors, no device: every figure is a formula of the sizes, unit-tested against hand-computed
//! cases. The formulas and where they come from are in `/README.md` ("trainguard plan").
//!
//! Notation: L layers, h hidden, a heads, s sequence length, b micro-batch, v vocabulary,
//! f MLP width, e bytes per activation element (4 in fp32, 2 in 16-bit).
use crate::config::ModelConfig;
use serde::Serialize;

/// The CUDA caching allocator hands out multiples of 512 bytes.
pub const CUDA_ROUND: u64 = 512;

/// A decoder-only transformer in GPT-2's layout: token + learned position embeddings, pre-LN
/// blocks (fused QKV, output projection, MLP of width `ffn`), final LayerNorm, head tied to the
/// token embedding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Transformer {
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub vocab: u64,
    pub seq_len: u64,
    pub ffn: u64,
    /// Biases in linear layers and LayerNorms.
    pub bias: bool,
    /// `--params`: a count for an architecture whose tensors differ from GPT-2's (gated MLP,
    /// untied head, grouped-query attention). Weights, gradients and optimizer state then follow
    /// this count; activations still follow the sizes.
    pub params_override: Option<u64>,
}

impl Transformer {
    pub fn from_gpt(cfg: &ModelConfig) -> Self {
        Self {
            layers: cfg.n_layer as u64,
            hidden: cfg.n_embd as u64,
            heads: cfg.n_head as u64,
            vocab: cfg.vocab_size as u64,
            seq_len: cfg.seq_len as u64,
            ffn: 4 * cfg.n_embd as u64,
            bias: cfg.bias,
            params_override: None,
        }
    }

    /// Parameter shapes in the order `model::Gpt::new` creates them.
    pub fn tensors(&self) -> Vec<Vec<u64>> {
        let (h, f) = (self.hidden, self.ffn);
        let mut t = vec![vec![self.vocab, h], vec![self.seq_len, h]];
        let norm = |t: &mut Vec<Vec<u64>>| {
            t.push(vec![h]);
            if self.bias {
                t.push(vec![h]);
            }
        };
        let linear = |t: &mut Vec<Vec<u64>>, out: u64, inp: u64| {
            t.push(vec![out, inp]);
            if self.bias {
                t.push(vec![out]);
            }
        };
        for _ in 0..self.layers {
            norm(&mut t);
            linear(&mut t, 3 * h, h);
            linear(&mut t, h, h);
            norm(&mut t);
            linear(&mut t, f, h);
            linear(&mut t, h, f);
        }
        norm(&mut t);
        t
    }

    /// Parameters of the GPT-2 layout (what `model::Gpt::num_params` counts).
    pub fn layout_params(&self) -> u64 {
        self.tensors().iter().map(|s| s.iter().product::<u64>()).sum()
    }

    /// The parameter count the estimate uses: `--params` when given, else the layout's.
    pub fn params(&self) -> u64 {
        self.params_override.unwrap_or_else(|| self.layout_params())
    }
}

/// How weights, gradients, optimizer state and activations are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Everything in fp32 (what trainguard trains in today).
    Fp32,
    /// Autocast to bf16: fp32 parameters are the master copy, 16-bit copies of the weights live
    /// through forward and backward, gradients land on the fp32 parameters.
    Bf16Mixed,
    /// As bf16-mixed with fp16 (and a loss scaler, whose state is negligible).
    Fp16Mixed,
    /// Parameters, gradients and optimizer state all in bf16 (no master copy).
    Bf16Pure,
}

impl Precision {
    /// Bytes per element of the working weights.
    pub fn weight_bytes(self) -> u64 {
        if self == Precision::Fp32 { 4 } else { 2 }
    }
    /// Bytes per element of the fp32 master copy (0: none).
    pub fn master_bytes(self) -> u64 {
        if self.is_mixed() { 4 } else { 0 }
    }
    pub fn grad_bytes(self) -> u64 {
        if self == Precision::Bf16Pure { 2 } else { 4 }
    }
    /// Optimizer state follows the parameters it belongs to (`zeros_like(param)` in PyTorch).
    pub fn state_bytes(self) -> u64 {
        self.grad_bytes()
    }
    pub fn activation_bytes(self) -> u64 {
        if self == Precision::Fp32 { 4 } else { 2 }
    }
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::Fp16Mixed)
    }
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Fp16Mixed => "fp16-mixed",
            Precision::Bf16Pure => "bf16-pure",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum Optimizer {
    #[default]
    #[value(name = "adamw")]
    #[serde(rename = "adamw")]
    AdamW,
    #[value(name = "sgd")]
    #[serde(rename = "sgd")]
    Sgd,
    #[value(name = "sgd_momentum", alias = "sgd-momentum")]
    #[serde(rename = "sgd_momentum")]
    SgdMomentum,
    #[value(name = "adafactor")]
    #[serde(rename = "adafactor")]
    Adafactor,
    #[value(name = "adamw8bit", alias = "adamw-8bit")]
    #[serde(rename = "adamw8bit")]
    AdamW8bit,
}

impl Optimizer {
    pub const ALL: [Optimizer; 5] = [Optimizer::AdamW, Optimizer::AdamW8bit, Optimizer::Adafactor, Optimizer::SgdMomentum, Optimizer::Sgd];

    pub fn name(self) -> &'static str {
        match self {
            Optimizer::AdamW => "adamw",
            Optimizer::Sgd => "sgd",
            Optimizer::SgdMomentum => "sgd_momentum",
            Optimizer::Adafactor => "adafactor",
            Optimizer::AdamW8bit => "adamw8bit",
        }
    }

    /// State bytes for one parameter tensor of `shape`, with `state` bytes per full-precision
    /// state element.
    pub fn state_for(self, shape: &[u64], state: u64) -> u64 {
        let n: u64 = shape.iter().product();
        match self {
            Optimizer::AdamW => 2 * n * state,
            Optimizer::Sgd => 0,
            Optimizer::SgdMomentum => n * state,
            // Factored second moment (row and column means) for matrices, no first moment
            // (beta1 = None, the default); vectors keep a full second moment.
            Optimizer::Adafactor => match shape {
                [rows, cols] => (rows + cols) * state,
                _ => n * state,
            },
            // bitsandbytes blockwise 8-bit: one byte per element per moment plus an fp32 scale
            // per 2048-element block; tensors under 4096 elements keep 32-bit moments.
            Optimizer::AdamW8bit => {
                if n < 4096 {
                    2 * n * 4
                } else {
                    2 * n + 2 * n.div_ceil(2048) * 4
                }
            }
        }
    }
}

/// Where the figures are for: a CUDA device (allocator rounding, dropout masks as bytes,
/// fragmentation and context), or the CPU analogue of `--profile` (none of those).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Cuda,
    Cpu,
}

/// The training setup the estimate is for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Setup {
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub activation_checkpointing: bool,
    /// Flash / memory-efficient attention (no b·a·s² scores kept) vs materialised scores.
    pub flash: bool,
    /// Dropout > 0: masks are kept for backward.
    pub dropout: bool,
    pub target: Target,
    /// Data-parallel ranks (one GPU each).
    pub gpus: u64,
    /// CUDA context, cuBLAS/cuDNN workspaces and the like, per process.
    pub cuda_overhead: u64,
    /// Allocator fragmentation margin as a share of the peak allocated.
    pub fragmentation: f64,
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
    /// One transformer block's saved activations (with checkpointing: one recomputed block).
    pub activations_per_layer: u64,
    /// Everything saved for backward: the blocks plus what lies outside them.
    pub activations: u64,
    /// Outside the blocks: final LayerNorm, input tokens, embedding dropout mask; with
    /// checkpointing also every block's saved input.
    pub activations_outside: u64,
    /// b·s·v fp32 logits (or the log-probabilities that replace them).
    pub logits: u64,
    /// Cross-entropy's fp32 gradient buffers alive with the log-probabilities at the start of
    /// backward: 2·4·b·s·v.
    pub cross_entropy: u64,
    /// Data-parallel gradient buckets (PyTorch DDP keeps a flat copy of the gradients).
    pub dp_buffers: u64,
    /// Backward through the last block, after logits and cross-entropy are freed: the MLP's
    /// widest gradients (GELU input and output, f·s·b) and the residual stream's (h·s·b).
    pub block_backward_transient: u64,
    /// End of backward: the tied token embedding's gradient arrives in two parts (from the head
    /// and from the embedding) that autograd sums out of place: 2·v·h extra gradient elements.
    pub embedding_grad_transient: u64,
    /// Which moment sets the peak: `start of backward` (activations, logits, cross-entropy),
    /// `last block's backward` (activations and that block's gradients; small vocabularies) or
    /// `end of backward` (gradients complete).
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
}

fn round_up(bytes: u64, to: u64) -> u64 {
    bytes.div_ceil(to) * to
}

/// Bytes of the parameter-sized buffers: each tensor rounded as the allocator would, then scaled
/// to `--params` when given.
fn per_tensor(model: &Transformer, target: Target, bytes_of: impl Fn(&[u64]) -> u64) -> u64 {
    let round = if target == Target::Cuda { CUDA_ROUND } else { 1 };
    let sum: u64 = model.tensors().iter().map(|s| bytes_of(s)).filter(|&b| b > 0).map(|b| round_up(b, round)).sum();
    match model.params_override {
        Some(p) => (sum as f64 * p as f64 / model.layout_params().max(1) as f64).round() as u64,
        None => sum,
    }
}

/// 1, or 0 when `--params` describes another layout (an untied head has no summed gradient).
fn layout_scale(m: &Transformer) -> u64 {
    u64::from(m.params_override.is_none())
}

/// Saved activations of one block at micro-batch `b` (Korthikanti et al. 2022, generalised to
/// element size e and MLP width f): s·b·(8h + 2f)·e for the LayerNorm inputs and outputs, QKV,
/// attention output, MLP input/GELU input/GELU output; 2·s·b·h mask bytes with dropout; fp32
/// LayerNorm statistics 16·b·s; attention: flash keeps its fp32 log-sum-exp (4·b·a·s),
/// materialised keeps the softmax output b·a·s²·e (and its dropout output and mask).
/// In 16-bit with dropout and f = 4h this is s·b·h·(34 + 5·a·s/h) + 16·b·s.
pub fn layer_activations(m: &Transformer, s: &Setup, b: u64) -> u64 {
    let e = s.precision.activation_bytes();
    let mask = mask_bytes(s);
    let (seq, h, a) = (m.seq_len, m.hidden, m.heads);
    let sb = seq * b;
    let dense = sb * (8 * h + 2 * m.ffn) * e;
    let masks = if s.dropout { 2 * sb * h * mask } else { 0 };
    let ln_stats = 2 * 2 * sb * 4;
    let attention = if s.flash {
        4 * b * a * seq
    } else {
        b * a * seq * seq * (e + if s.dropout { e + mask } else { 0 })
    };
    dense + masks + ln_stats + attention
}

/// A dropout mask element: a bool on CUDA; on CPU libtorch keeps a scaled noise tensor of the
/// activation's dtype.
fn mask_bytes(s: &Setup) -> u64 {
    match s.target {
        Target::Cuda => 1,
        Target::Cpu => s.precision.activation_bytes(),
    }
}

/// Activations outside the blocks at micro-batch `b`: final LayerNorm input and output (and its
/// statistics), the int64 inputs and targets, the embedding dropout mask.
pub fn outside_activations(m: &Transformer, s: &Setup, b: u64) -> u64 {
    let e = s.precision.activation_bytes();
    let sbh = m.seq_len * b * m.hidden;
    let mut bytes = 2 * sbh * e + 2 * 4 * m.seq_len * b + 2 * 8 * m.seq_len * b;
    if s.dropout {
        bytes += sbh * mask_bytes(s);
    }
    if s.activation_checkpointing {
        bytes += m.layers * sbh * e; // each block's input, kept to recompute it
    }
    bytes
}

/// The estimate at micro-batch `micro` (≥ 1) with `accumulation` (≥ 1) micro-steps per update.
///
/// On top of weights, master weights and optimizer state, the peak is the largest of three
/// moments: the start of backward (every saved activation, the log-probabilities and
/// cross-entropy's two gradient buffers), the last block's backward (every saved activation and
/// that block's MLP and residual gradients; it wins only with small vocabularies), and the end
/// of backward (the gradients complete, plus the tied embedding's two partial gradients). The
/// gradients of earlier micro-steps are held through all three when accumulating.
pub fn estimate(m: &Transformer, s: &Setup, micro: u64, accumulation: u64) -> Estimate {
    let p = s.precision;
    let weights = per_tensor(m, s.target, |sh| sh.iter().product::<u64>() * p.weight_bytes());
    let master_weights = per_tensor(m, s.target, |sh| sh.iter().product::<u64>() * p.master_bytes());
    let gradients = per_tensor(m, s.target, |sh| sh.iter().product::<u64>() * p.grad_bytes());
    let optimizer = per_tensor(m, s.target, |sh| s.optimizer.state_for(sh, p.state_bytes()));
    let dp_buffers = if s.gpus > 1 { gradients } else { 0 };

    let per_layer = layer_activations(m, s, micro);
    let layers_held = if s.activation_checkpointing { 1 } else { m.layers };
    let outside = outside_activations(m, s, micro);
    let activations = layers_held * per_layer + outside;
    let logits = 4 * micro * m.seq_len * m.vocab;
    let cross_entropy = 2 * logits;

    let embedding_grad_transient = 2 * m.vocab * m.hidden * p.grad_bytes() * layout_scale(m);

    let base = weights + master_weights + optimizer + dp_buffers;
    let held = if accumulation > 1 { gradients } else { 0 };
    let block_backward_transient = (m.ffn + m.hidden) * m.seq_len * micro * p.activation_bytes();
    let transient = activations + (logits + cross_entropy).max(block_backward_transient);
    let grads_done = gradients + embedding_grad_transient;
    let peak_allocated = base + held + transient.max(grads_done);
    let (fragmentation, cuda_overhead) = match s.target {
        Target::Cuda => ((peak_allocated as f64 * s.fragmentation).round() as u64, s.cuda_overhead),
        Target::Cpu => (0, 0),
    };
    let scale = 1.0 + if s.target == Target::Cuda { s.fragmentation } else { 0.0 };
    // Every part of `transient` is proportional to the micro-batch.
    let per_sample = (transient as f64 / micro as f64 * scale).round() as u64;
    let fixed = ((base + gradients) as f64 * scale).round() as u64 + cuda_overhead;
    Estimate {
        micro_batch: micro,
        accumulation,
        params: m.params(),
        weights,
        master_weights,
        gradients,
        optimizer,
        activations_per_layer: per_layer,
        activations,
        activations_outside: outside,
        logits,
        cross_entropy,
        dp_buffers,
        embedding_grad_transient,
        block_backward_transient,
        peak_phase: if transient < grads_done {
            "end of backward"
        } else if block_backward_transient > logits + cross_entropy {
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

    /// GPT-2 small: 12 × 768, 12 heads, vocab 50257, seq 1024, biases.
    pub fn gpt2_small() -> Transformer {
        Transformer { layers: 12, hidden: 768, heads: 12, vocab: 50257, seq_len: 1024, ffn: 3072, bias: true, params_override: None }
    }

    /// fp32 AdamW on one CUDA GPU, flash attention, 1 GiB context, 10% fragmentation.
    pub fn cuda_fp32_adamw() -> Setup {
        Setup {
            precision: Precision::Fp32,
            optimizer: Optimizer::AdamW,
            activation_checkpointing: false,
            flash: true,
            dropout: false,
            target: Target::Cuda,
            gpus: 1,
            cuda_overhead: 1 << 30,
            fragmentation: 0.1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::gpt2_small as gpt2;
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;

    fn setup(precision: Precision, optimizer: Optimizer) -> Setup {
        Setup {
            precision,
            optimizer,
            activation_checkpointing: false,
            flash: true,
            dropout: false,
            target: Target::Cpu,
            gpus: 1,
            cuda_overhead: 0,
            fragmentation: 0.0,
        }
    }

    #[test]
    fn gpt2_small_has_124_439_808_parameters() {
        // nanoGPT prints 124.44M for GPT-2 small with the tied head counted once.
        assert_eq!(gpt2().params(), 124_439_808);
        // Without biases: 2h per block and one h at the end fewer LayerNorm entries, and no linear biases.
        let no_bias = Transformer { bias: false, ..gpt2() };
        let (h, l) = (768u64, 12u64);
        let biases = l * (2 * h + 3 * h + h + 4 * h + h) + h;
        assert_eq!(no_bias.params(), 124_439_808 - biases);
    }

    #[test]
    fn states_per_precision_and_optimizer_match_bytes_per_parameter() {
        let m = Transformer { params_override: None, ..gpt2() };
        let p = m.params();
        let e = estimate(&m, &setup(Precision::Fp32, Optimizer::AdamW), 1, 1);
        assert_eq!((e.weights, e.master_weights, e.gradients, e.optimizer), (4 * p, 0, 4 * p, 8 * p));
        let e = estimate(&m, &setup(Precision::Bf16Mixed, Optimizer::AdamW), 1, 1);
        assert_eq!((e.weights, e.master_weights, e.gradients, e.optimizer), (2 * p, 4 * p, 4 * p, 8 * p));
        assert_eq!(e.states(), 18 * p, "mixed-precision AdamW: 16-18 bytes/param");
        let e = estimate(&m, &setup(Precision::Bf16Pure, Optimizer::AdamW), 1, 1);
        assert_eq!(e.states(), 8 * p);
        assert_eq!(estimate(&m, &setup(Precision::Fp32, Optimizer::Sgd), 1, 1).optimizer, 0);
        assert_eq!(estimate(&m, &setup(Precision::Fp32, Optimizer::SgdMomentum), 1, 1).optimizer, 4 * p);
    }

    #[test]
    fn adafactor_and_8bit_adamw_follow_the_tensor_shapes() {
        let tiny = Transformer { layers: 1, hidden: 64, heads: 2, vocab: 128, seq_len: 16, ffn: 256, bias: false, params_override: None };
        let s = |o| estimate(&tiny, &setup(Precision::Fp32, o), 1, 1).optimizer;
        // Matrices: wte 128×64, wpe 16×64, qkv 192×64, proj 64×64, fc 256×64, proj 64×256; vectors: 3 LN weights of 64.
        let factored = (128 + 64) + (16 + 64) + (192 + 64) + (64 + 64) + (256 + 64) + (64 + 256);
        assert_eq!(s(Optimizer::Adafactor), 4 * (factored + 3 * 64));
        // 8-bit: tensors of ≥ 4096 elements take 2 bytes/element + 8 bytes per 2048-block; smaller ones 8 bytes/element.
        let big = [128 * 64, 192 * 64, 64 * 64, 256 * 64, 64 * 256];
        let small = 16 * 64 + 3 * 64;
        let eight: u64 = big.iter().map(|&n: &u64| 2 * n + 8 * n.div_ceil(2048)).sum::<u64>() + 8 * small;
        assert_eq!(s(Optimizer::AdamW8bit), eight);
    }

    #[test]
    fn korthikanti_activations_in_16_bit_with_dropout_and_materialised_attention() {
        let m = gpt2();
        let s = Setup { dropout: true, flash: false, target: Target::Cuda, ..setup(Precision::Bf16Mixed, Optimizer::AdamW) };
        let (seq, b, h, a) = (1024u64, 4u64, 768u64, 12u64);
        // s·b·h·(34 + 5·a·s/h) plus the fp32 LayerNorm statistics (2 norms × mean, rstd).
        let korthikanti = seq * b * h * 34 + 5 * a * seq * seq * b;
        assert_eq!(layer_activations(&m, &s, b), korthikanti + 16 * b * seq);
        // Flash keeps the fp32 log-sum-exp instead of the b·a·s² scores.
        let flash = Setup { flash: true, ..s.clone() };
        assert_eq!(layer_activations(&m, &flash, b), seq * b * h * 34 + 4 * b * a * seq + 16 * b * seq);
    }

    #[test]
    fn fp32_flash_without_dropout_keeps_sixteen_activations_per_token_and_channel() {
        let m = gpt2();
        let s = setup(Precision::Fp32, Optimizer::AdamW);
        let (seq, b, h, a) = (1024u64, 2u64, 768u64, 12u64);
        assert_eq!(layer_activations(&m, &s, b), seq * b * h * 16 * 4 + 4 * b * a * seq + 16 * b * seq);
    }

    #[test]
    fn checkpointing_keeps_block_inputs_and_one_block() {
        let m = gpt2();
        let s = setup(Precision::Fp32, Optimizer::AdamW);
        let ck = Setup { activation_checkpointing: true, ..s.clone() };
        let (plain, with) = (estimate(&m, &s, 8, 2), estimate(&m, &ck, 8, 2));
        let sbh = 1024 * 8 * 768;
        assert_eq!(with.activations, plain.activations - 12 * plain.activations_per_layer + plain.activations_per_layer + 12 * sbh * 4);
        assert!(with.activations * 4 < plain.activations);
    }

    #[test]
    fn gpt2_at_512_by_512_is_dominated_by_49_gib_of_fp32_logits() {
        let m = Transformer { seq_len: 512, ..gpt2() };
        let e = estimate(&m, &setup(Precision::Fp32, Optimizer::AdamW), 512, 1);
        assert_eq!(e.logits, 4 * 512 * 512 * 50257);
        assert!((e.logits as f64 / GIB - 49.07).abs() < 0.01, "{}", e.logits as f64 / GIB);
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
        };
        let e = estimate(&m, &setup(Precision::Bf16Pure, Optimizer::AdamW), 1, 1);
        let gb = e.states() as f64 / 1e9;
        assert!((gb - 64.2).abs() < 0.5, "{gb} GB: 2 (weights) + 2 (grads) + 4 (two bf16 moments) bytes/param");
        assert!(e.states() > 40 * (1 << 30), "does not fit a 40 GB card before the first activation");
    }

    #[test]
    fn peak_counts_held_gradients_only_when_accumulating() {
        let m = gpt2();
        let s = setup(Precision::Fp32, Optimizer::AdamW);
        let (one, two) = (estimate(&m, &s, 4, 1), estimate(&m, &s, 4, 2));
        assert_eq!(two.peak_allocated - one.peak_allocated, one.gradients);
        // fixed + slope·b while accumulating, to the byte per sample (rounding of the margin).
        assert!(two.linear(4).abs_diff(two.total) <= 4);
        let nine = estimate(&m, &Setup { target: Target::Cuda, fragmentation: 0.1, cuda_overhead: 1 << 30, ..s.clone() }, 9, 3);
        assert!(nine.linear(9).abs_diff(nine.total) <= 9, "{} vs {}", nine.linear(9), nine.total);
        // A tiny batch: activations are smaller than the gradients, which then set the peak.
        let short = Transformer { seq_len: 1, ..gpt2() };
        let e = estimate(&short, &s, 1, 1);
        assert_eq!(e.embedding_grad_transient, 2 * 50257 * 768 * 4);
        assert_eq!(e.peak_allocated, e.weights + e.optimizer + e.gradients + e.embedding_grad_transient);
        assert_eq!(e.peak_phase, "end of backward");
        assert_eq!(two.peak_phase, "start of backward");
    }

    #[test]
    fn a_byte_vocabulary_puts_the_peak_in_the_last_blocks_backward() {
        // bench-10m: h = 384, f = 1536, v = 256: 12·v = 3072 bytes/token of logits and
        // cross-entropy against (f + h)·4 = 7680 bytes/token of the last block's gradients.
        let m = Transformer { layers: 6, hidden: 384, heads: 6, vocab: 256, seq_len: 256, ffn: 1536, bias: true, params_override: None };
        let e = estimate(&m, &setup(Precision::Fp32, Optimizer::AdamW), 8, 2);
        assert_eq!(e.block_backward_transient, (1536 + 384) * 256 * 8 * 4);
        assert_eq!(e.peak_phase, "last block's backward");
        assert_eq!(e.peak_allocated, e.weights + e.optimizer + e.gradients + e.activations + e.block_backward_transient);
        assert_eq!(estimate(&gpt2(), &setup(Precision::Fp32, Optimizer::AdamW), 8, 2).peak_phase, "start of backward");
    }

    #[test]
    fn cuda_target_adds_rounding_fragmentation_and_context() {
        let m = Transformer { layers: 1, hidden: 8, heads: 2, vocab: 16, seq_len: 4, ffn: 32, bias: true, params_override: None };
        let cpu = setup(Precision::Fp32, Optimizer::AdamW);
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
        let s = Setup { gpus: 4, ..setup(Precision::Fp32, Optimizer::AdamW) };
        let e = estimate(&gpt2(), &s, 1, 1);
        assert_eq!(e.dp_buffers, e.gradients);
    }
}
