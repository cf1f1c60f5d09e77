//! What the planner reasons about, below every figure it computes: the model by its sizes
//! ([`Transformer`]), the training setup ([`Setup`]: precision, optimizer, memory savers, kernels,
//! ranks and sharding, the [`Target`] device), the bytes a precision stores per element
//! ([`PrecisionBytes`]), and a change of the setup with what it saves ([`Lever`]). The estimate,
//! the sharding levels and the recommendation all import these from here.
use crate::config::{Arch, ModelConfig};
use crate::model::memory::{Activations, DocumentForm, Regime};
use crate::model::{Part, TensorSpec};
use serde::Serialize;

/// A decoder-only transformer of one of the model's architectures, by its sizes: GPT-2 (learned
/// positions, LayerNorm, fused QKV, GELU MLP of width `ffn`, tied head) or Llama (RoPE, RMSNorm,
/// grouped-query attention over `kv_heads`, SwiGLU of width `ffn`, tied or untied head).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Transformer {
    pub arch: Arch,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub vocab: u64,
    pub seq_len: u64,
    pub ffn: u64,
    /// Key/value heads (grouped-query attention); none: `heads`.
    pub kv_heads: Option<u64>,
    /// The LM head is the token embedding (always for GPT-2).
    pub tied: bool,
    /// Biases in linear layers and LayerNorms.
    pub bias: bool,
    /// `model.pad_vocab_to`: the embedding and LM head hold `vocab` rounded up to a multiple of
    /// it, and the logits are that wide.
    pub pad_vocab_to: u64,
    /// `--params`: a count for an architecture whose tensors differ from the layout's. Weights,
    /// gradients and optimizer state then follow this count; activations still follow the sizes.
    pub params_override: Option<u64>,
}

/// The built-in defaults' model (GPT-2 layout).
impl Default for Transformer {
    fn default() -> Self {
        Self::from_config(&ModelConfig::default())
    }
}

impl Transformer {
    pub fn from_config(cfg: &ModelConfig) -> Self {
        Self {
            arch: cfg.arch,
            layers: cfg.n_layer as u64,
            hidden: cfg.n_embd as u64,
            heads: cfg.n_head as u64,
            vocab: cfg.vocab_size as u64,
            seq_len: cfg.seq_len as u64,
            ffn: cfg.ffn() as u64,
            kv_heads: cfg.n_kv_head.map(|k| k as u64),
            tied: cfg.tie_embeddings,
            bias: cfg.bias,
            pad_vocab_to: cfg.pad_vocab_to as u64,
            params_override: None,
        }
    }

    /// The model config these sizes describe.
    pub fn model_config(&self) -> ModelConfig {
        ModelConfig {
            arch: self.arch,
            n_kv_head: self.kv_heads.map(|k| k as usize),
            tie_embeddings: self.tied,
            n_layer: self.layers as usize,
            n_head: self.heads as usize,
            n_embd: self.hidden as usize,
            vocab_size: self.vocab as usize,
            seq_len: self.seq_len as usize,
            bias: self.bias,
            ffn_hidden: Some(self.ffn as usize),
            pad_vocab_to: self.pad_vocab_to as usize,
            ..ModelConfig::default()
        }
    }

    /// The parameters in the order the model creates them: the model's own description
    /// (`model::describe`), not a copy of it.
    pub fn specs(&self) -> Vec<TensorSpec> {
        crate::model::describe(&self.model_config())
    }

    /// Parameter shapes in creation order.
    pub fn tensors(&self) -> Vec<Vec<u64>> {
        self.specs().iter().map(|t| t.shape.iter().map(|&d| d as u64).collect()).collect()
    }

    /// Parameters in `part` (counted from the description).
    pub(super) fn params_in(&self, part: Part) -> u64 {
        self.specs().iter().filter(|t| t.part == part).map(|t| t.numel() as u64).sum()
    }

    /// What the forward keeps for backward in `setup`'s regime (`model::saved_activations`).
    pub fn saved(&self, s: &Setup) -> Activations {
        let fused_rms_norm = s.fused_rms_norm && s.target == Target::Cuda;
        // As `model::layers::repeats_grouped_heads`: fp32 is the only precision whose attention
        // runs outside 16-bit.
        let repeated_kv_heads = s.target == Target::Cuda && s.precision == Precision::Fp32;
        // As `model::Model`: our node where its kernels run, for fp32 weights (not bf16-pure).
        let residual_norm_node =
            s.fused_residual_norm && s.target == Target::Cuda && s.precision != Precision::Bf16Pure;
        // As `model::llama`: within documents RoPE takes ATen's ops whatever `fused_rope` says.
        let (swiglu_node, rope_node) = (
            s.fused_swiglu && s.target == Target::Cuda,
            s.fused_rope && s.target == Target::Cuda && !s.document_mask,
        );
        // As `model::documents::Documents::of`: lengths where the variable-length kernels run.
        let documents = s.document_mask.then_some(match s.target {
            Target::Cuda => DocumentForm::Lengths,
            Target::Cpu => DocumentForm::Mask,
        });
        let regime = Regime {
            fused_attention: s.flash,
            dropout: s.dropout,
            fused_rms_norm,
            repeated_kv_heads,
            residual_norm_node,
            swiglu_node,
            rope_node,
            merged_projections: s.merged_projections,
            documents,
        };
        crate::model::saved_activations(&self.model_config(), regime)
    }

    /// Rows of the embedding and LM head, and columns of the logits (the padded vocabulary).
    pub fn padded_vocab(&self) -> u64 {
        self.model_config().padded_vocab() as u64
    }

    /// Key/value heads (`heads` without grouped-query attention).
    pub fn kv(&self) -> u64 {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// Channels per attention head.
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads.max(1)
    }

    /// Parameters of the layout (what `model::Model::num_params` counts).
    pub fn layout_params(&self) -> u64 {
        self.tensors().iter().map(|s| s.iter().product::<u64>()).sum()
    }

    /// The parameter count the estimate uses: `--params` when given, else the layout's.
    pub fn params(&self) -> u64 {
        self.params_override.unwrap_or_else(|| self.layout_params())
    }
}

pub use crate::config::{OptimizerName, Precision};

/// The precisions the recommendation compares, in the order it lists them.
pub const PRECISIONS: [Precision; 4] =
    [Precision::Fp32, Precision::Bf16Mixed, Precision::Fp16Mixed, Precision::Bf16Pure];
/// The optimizers the recommendation compares, most memory first.
pub const OPTIMIZERS: [OptimizerName; 5] = [
    OptimizerName::Adamw,
    OptimizerName::Adamw8bit,
    OptimizerName::Adafactor,
    OptimizerName::SgdMomentum,
    OptimizerName::Sgd,
];

/// How a precision stores weights, gradients, optimizer state and activations, in bytes per
/// element. bf16-mixed / fp16-mixed: fp32 parameters are the master copy, 16-bit copies of the
/// weights live through forward and backward (released with the graph by its end), gradients
/// land on the fp32 parameters; bf16-pure:
/// parameters, gradients and optimizer state all in bf16, no master copy.
pub trait PrecisionBytes: Copy {
    fn weight_bytes(self) -> u64;
    fn master_bytes(self) -> u64;
    fn grad_bytes(self) -> u64;
    fn state_bytes(self) -> u64;
    fn activation_bytes(self) -> u64;
    fn residual_bytes(self) -> u64;
    fn logit_bytes(self) -> u64;
    fn is_mixed(self) -> bool;
}

impl PrecisionBytes for Precision {
    /// Bytes per element of the working weights.
    fn weight_bytes(self) -> u64 {
        if self == Precision::Fp32 {
            4
        } else {
            2
        }
    }
    /// Bytes per element of the fp32 master copy (0: none).
    fn master_bytes(self) -> u64 {
        if self.is_mixed() {
            4
        } else {
            0
        }
    }
    fn grad_bytes(self) -> u64 {
        if self == Precision::Bf16Pure {
            2
        } else {
            4
        }
    }
    /// Optimizer state follows the parameters it belongs to (`zeros_like(param)` in PyTorch).
    fn state_bytes(self) -> u64 {
        self.grad_bytes()
    }
    fn activation_bytes(self) -> u64 {
        if self == Precision::Fp32 {
            4
        } else {
            2
        }
    }
    /// Bytes per element of the residual stream (what the LayerNorms see): autocast runs
    /// LayerNorm in fp32 and fp32 + bf16 sums stay fp32, so only bf16-pure keeps it in 16 bits.
    fn residual_bytes(self) -> u64 {
        if self == Precision::Bf16Pure {
            2
        } else {
            4
        }
    }
    /// Bytes per logit and log-probability: autocast computes log-softmax in fp32; bf16-pure
    /// stays in bf16.
    fn logit_bytes(self) -> u64 {
        self.residual_bytes()
    }
    fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::Fp16Mixed)
    }
}

/// Where the figures are for: a CUDA device (allocator rounding, dropout masks as bytes,
/// fragmentation and context), or the CPU analogue of `--profile` (none of those).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Cuda,
    Cpu,
}

/// The training setup the estimate is for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Setup {
    pub precision: Precision,
    pub optimizer: OptimizerName,
    pub activation_checkpointing: bool,
    /// Blocks recomputed together when checkpointing (`every_n:k`; 1 for `blocks`).
    pub checkpoint_blocks: u64,
    /// `first_n:<m>`: only the first m blocks are checkpointed; none: all.
    pub checkpoint_first: Option<u64>,
    /// Flash / memory-efficient attention (no b·a·s² scores kept) vs materialised scores.
    pub flash: bool,
    /// Dropout > 0: masks are kept for backward.
    pub dropout: bool,
    /// `memory.loss_chunk_tokens`: the final LayerNorm, head and cross-entropy run over chunks
    /// of this many tokens, so only one chunk's logits exist at a time.
    pub loss_chunk_tokens: Option<u64>,
    /// `kernels.fused_rms_norm`: RMSNorm counted as ATen's fused kernel where it runs (CUDA).
    pub fused_rms_norm: bool,
    /// `kernels.cuda_optimizers`: 8-bit AdamW's and Adafactor's CUDA kernels, which need no
    /// scratch (Adafactor's, a small fp64 workspace).
    pub cuda_optimizers: bool,
    /// `optimizer.fused`: false makes AdamW keep one temporary the size of the largest parameter.
    pub fused_optimizer: bool,
    /// `memory.offload_activations` (CUDA): the checkpointed segments' inputs wait in host memory,
    /// one back on the device at a time in the backward.
    pub offload_activations: bool,
    /// `kernels.fused_cross_entropy`: the loss as our node, which keeps the logits in their own
    /// dtype and writes only their gradient in backward.
    pub fused_cross_entropy: bool,
    /// `kernels.fused_loss_gradient` (with `fused_cross_entropy`): the logits' gradient written
    /// over the logits in the loss's forward, so no gradient buffer beside them.
    pub fused_loss_gradient: bool,
    /// `kernels.fused_residual_norm`: the norms counted as our node where it runs (CUDA).
    pub fused_residual_norm: bool,
    /// `kernels.fused_swiglu`: SwiGLU counted as our node where it runs (CUDA).
    pub fused_swiglu: bool,
    /// `kernels.fused_rope`: RoPE counted as our node where it runs (CUDA).
    pub fused_rope: bool,
    /// `kernels.cuda_graphs` (CUDA): the micro-steps add into gradient accumulators held
    /// through the step, with one micro-step a step too.
    pub cuda_graphs: bool,
    /// `kernels.merged_projections`: Llama's q/k/v and gate/up each one matrix multiplication.
    pub merged_projections: bool,
    /// `data.document_mask`: positions per token, and the CPU's t × t mask or CUDA's lengths.
    pub document_mask: bool,
    /// `kernels.fused_linear`: the linear node, which under autocast keeps its weights' 16-bit
    /// casts through a step's micro-steps without checkpointing, and for the run with graphs.
    pub fused_linear: bool,
    pub target: Target,
    /// Data-parallel ranks (one GPU each).
    pub gpus: u64,
    /// `dist.shard`: what each rank keeps only its own part of (see [`super::sharding`]).
    pub shard: crate::config::ShardLevel,
    /// `memory.offload_optimizer`: the optimizer state in host memory.
    pub offload_optimizer: bool,
    /// `dist.bucket_mb`: the size of the sharded collectives' pieces.
    pub bucket_mb: f64,
    /// `dist.overlap`: under `parameters`, a second block gathered while one computes.
    pub overlap: bool,
    /// `dist.overlap` where its collectives start from inside backward: not on the CPU under
    /// `memory.limit` (Gloo's scratch there). Under `gradients`, fp32 gradients are then
    /// reduced into their owners in place, with no reduce-scatter buffers.
    pub overlap_in_backward: bool,
    /// CUDA context, cuBLAS/cuDNN workspaces and the like, per process.
    pub cuda_overhead: u64,
    /// Allocator fragmentation margin as a share of the peak allocated.
    pub fragmentation: f64,
    /// `checkpoint.async`: a host copy of the checkpointed state is kept for the writer.
    pub background_checkpoint: bool,
}

impl Setup {
    /// The loss's node writes the logits' gradient in its forward (`kernels.fused_loss_gradient`
    /// with `kernels.fused_cross_entropy`).
    pub fn loss_gradient_in_forward(&self) -> bool {
        self.fused_cross_entropy && self.fused_loss_gradient
    }

    /// Any memory saver on: trainguard then runs the head and the body as separate backward
    /// passes and adds the tied embedding's two gradients in place (one transient copy, not two).
    pub fn split_backward(&self) -> bool {
        self.activation_checkpointing || self.loss_chunk_tokens.is_some()
    }

    /// The linear node keeps the weights' 16-bit casts until the step's gradients are complete
    /// (`KeptCasts` in src/step/micro.rs; mixed precision on CUDA, without checkpointing) or, with
    /// CUDA graphs, for the run (step::graphs).
    pub fn keeps_casts(&self) -> bool {
        self.fused_linear
            && self.precision.is_mixed()
            && self.target == Target::Cuda
            && (self.cuda_graphs || !self.activation_checkpointing)
    }

    /// Blocks per checkpointed segment (at least one).
    pub(super) fn segment(&self) -> u64 {
        self.checkpoint_blocks.max(1)
    }

    /// Blocks recomputed in the backward pass: all with checkpointing (the first m with
    /// `first_n:<m>`), none without.
    pub fn checkpointed_blocks(&self, m: &Transformer) -> u64 {
        match self.activation_checkpointing {
            true => self.checkpoint_first.map_or(m.layers, |f| f.min(m.layers)),
            false => 0,
        }
    }

    /// Blocks whose activations exist at once while checkpointed blocks are recomputed: one
    /// segment.
    pub fn recomputed_blocks(&self, m: &Transformer) -> u64 {
        self.checkpointed_blocks(m).min(self.segment())
    }

    /// Blocks whose activations the body's backward holds at most at once: every block without
    /// checkpointing; with it the kept blocks (`first_n`: their backward comes first) or one
    /// recomputed segment, whichever is more.
    pub fn live_blocks(&self, m: &Transformer) -> u64 {
        match self.activation_checkpointing {
            true => (m.layers - self.checkpointed_blocks(m)).max(self.recomputed_blocks(m)),
            false => m.layers,
        }
    }
}

/// A change of the setup that would bring micro-batch 1 closer to the budget, and what it saves.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lever {
    pub change: String,
    pub saving_bytes: u64,
    pub total_bytes: u64,
    /// The change alone brings micro-batch 1 within the budget.
    pub closes_gap: bool,
}
