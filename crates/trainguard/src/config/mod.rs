//! The raw run configuration: serde structs with their defaults, read from YAML and `--set`
//! overrides, then checked by [`validate`]. Owns parsing and per-key validation; it does not
//! derive anything from the environment (that is `plan`'s job).
pub mod allocator;
mod anchor;
pub mod diff;
pub mod limits;
mod load;
pub mod notify;
mod validate;

pub use load::{apply_override, load, parse_duration, parse_size, saved, yaml_tree, ConfigError};
pub use validate::{check_task_name, validate, Problem};

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Everything a run reads from its YAML file. Unknown keys are rejected at every level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Run directory: resolved config, metrics.jsonl, events.jsonl.
    pub out_dir: PathBuf,
    /// Seeds weight init, sampling and dropout.
    pub seed: u64,
    /// Same bits for the same inputs on CUDA as on CPU: libtorch's deterministic algorithms and
    /// `CUBLAS_WORKSPACE_CONFIG`; an op without a deterministic kernel ends the run (exit 6).
    /// Beside `seed` because both are about reproducing a run, and both cover evaluation too.
    pub deterministic: bool,
    /// `auto | cpu | cuda | cuda:N`.
    pub device: String,
    /// `fp32 | bf16-mixed | fp16-mixed | bf16-pure`.
    pub precision: Precision,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub optimizer: OptimizerConfig,
    pub oom: OomConfig,
    pub memory: MemoryConfig,
    pub kernels: KernelsConfig,
    pub checkpoint: CheckpointConfig,
    pub nan: NanConfig,
    /// The divergence guard: roll back past a loss spike and skip its data (off by default).
    pub divergence: DivergenceConfig,
    pub dist: DistConfig,
    /// Extra metric sinks beside metrics.jsonl.
    pub metrics: MetricsConfig,
    /// Webhook notifications of the run's end and of chosen events (rank 0 sends).
    pub notify: notify::NotifyConfig,
    /// Downstream evaluation in the loop: multiple-choice task files scored by log-likelihood.
    pub eval: EvalConfig,
    /// Test-only fault injection; leave empty in real runs.
    pub faults: FaultsConfig,
    /// A Hugging Face GPT-2 directory (`trainguard export --hf`, or transformers'
    /// `save_pretrained`) whose weights the model starts from instead of its random init.
    /// Top-level rather than under `model:` because `model` is the shape a resume compares.
    pub init_from: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            out_dir: PathBuf::from("runs/debug"),
            seed: 1337,
            deterministic: false,
            device: "auto".into(),
            precision: Precision::Fp32,
            model: ModelConfig::default(),
            data: DataConfig::default(),
            train: TrainConfig::default(),
            optimizer: OptimizerConfig::default(),
            oom: OomConfig::default(),
            memory: MemoryConfig::default(),
            kernels: KernelsConfig::default(),
            checkpoint: CheckpointConfig::default(),
            nan: NanConfig::default(),
            divergence: DivergenceConfig::default(),
            dist: DistConfig::default(),
            metrics: MetricsConfig::default(),
            notify: notify::NotifyConfig::default(),
            eval: EvalConfig::default(),
            faults: FaultsConfig::default(),
            init_from: None,
        }
    }
}

/// The decoder: its architecture and sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `gpt2` (learned positions, LayerNorm, GELU MLP, tied head) or `llama` (RoPE, RMSNorm,
    /// SwiGLU, grouped-query attention).
    pub arch: Arch,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    pub seq_len: usize,
    pub dropout: f64,
    /// Biases in linear layers (and, for gpt2, LayerNorms).
    pub bias: bool,
    /// llama: key/value heads (grouped-query attention); must divide n_head. None = n_head.
    pub n_kv_head: Option<usize>,
    /// MLP width: gpt2's hidden layer (default 4 × n_embd), llama's SwiGLU width (required).
    pub ffn_hidden: Option<usize>,
    /// llama: RoPE base frequency.
    pub rope_theta: f64,
    /// llama: RMSNorm epsilon.
    pub norm_eps: f64,
    /// llama: LM head shares the token embedding (gpt2 always does).
    pub tie_embeddings: bool,
    /// The embedding and LM-head rows are `vocab_size` rounded up to a multiple of this (aligned
    /// matrix shapes); the extra rows are zero and their logits masked. 1: no padding.
    pub pad_vocab_to: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            arch: Arch::Gpt2,
            n_layer: 2,
            n_head: 2,
            n_embd: 64,
            vocab_size: 256,
            seq_len: 64,
            dropout: 0.0,
            bias: true,
            n_kv_head: None,
            ffn_hidden: None,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            tie_embeddings: true,
            pad_vocab_to: 64,
        }
    }
}

impl ModelConfig {
    /// Key/value heads (n_head without grouped-query attention).
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }

    /// Channels per attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// The MLP's hidden width.
    pub fn ffn(&self) -> usize {
        self.ffn_hidden.unwrap_or(4 * self.n_embd)
    }

    /// Rows of the embedding and LM head: `vocab_size` rounded up to `pad_vocab_to`.
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.div_ceil(self.pad_vocab_to.max(1)) * self.pad_vocab_to.max(1)
    }
}

/// Model architectures (`model.arch`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2: learned positions, pre-LayerNorm, GELU MLP, tied head.
    #[default]
    Gpt2,
    /// Llama family (Llama 3, SmolLM, TinyLlama, Qwen, Mistral shapes): RoPE, RMSNorm, SwiGLU,
    /// grouped-query attention.
    Llama,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `synthetic | text:<path> | tokens:<path>`.
    pub source: String,
    /// A weighted mixture of sources in place of `source` (docs/data.md#mixtures): each
    /// sample is drawn from one of them, chosen by weight. Empty: `source` alone.
    pub sources: Vec<SourceConfig>,
    /// Share of the corpus (its tail) held out for validation.
    pub val_fraction: f64,
    /// Length of the built-in synthetic corpus, in tokens.
    pub synthetic_tokens: usize,
    /// Attention stays inside each document of a packed sequence (documents end at the EOS id),
    /// and positions restart at each document's first token (`model::documents`).
    pub document_mask: bool,
    /// The id that ends a document, for sources whose metadata does not name one (synthetic,
    /// `text:`, llm.c shards without a `prepare` manifest); a `prepare` directory's
    /// `dataset.json` names it (`eos_id`), and a different value here is refused.
    pub eos_id: Option<u32>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            source: "synthetic".into(),
            sources: Vec::new(),
            val_fraction: 0.1,
            synthetic_tokens: 1 << 20,
            document_mask: false,
            eos_id: None,
        }
    }
}

/// One source of a mixture (`data.sources[i]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `synthetic | text:<path> | tokens:<path>`, as `data.source` takes.
    pub source: String,
    /// Its share of the samples, relative to the others' (any positive number).
    pub weight: f64,
    /// What metrics, the checkpoint and the report call it; by default the last part of its
    /// path (`synthetic` for the built-in corpus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl SourceConfig {
    /// [`Self::name`], or the last part of the source's path.
    pub fn label(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        let path = self.source.split_once(':').map_or(self.source.as_str(), |(_, p)| p);
        let last = path.trim_end_matches('/').rsplit('/').next().unwrap_or(path);
        if last.is_empty() {
            self.source.clone()
        } else {
            last.to_string()
        }
    }
}

/// Where the held-out tail of `val_fraction` of a corpus of `tokens` tokens starts.
pub fn val_start(tokens: usize, val_fraction: f64) -> usize {
    ((tokens as f64) * (1.0 - val_fraction)).round() as usize
}

impl DataConfig {
    /// The source whose ids the model reads: `data.source`, or a mixture's first `tokens:`
    /// entry (else its first `text:`, else `synthetic`): where `sample` and `export` find the
    /// tokenizer. A mixture's sources share one (`tokens:` and `text:` together are refused).
    pub fn primary_source(&self) -> &str {
        let first = |kind: &str| self.sources.iter().find(|s| s.source.starts_with(kind));
        match self.sources.is_empty() {
            true => &self.source,
            false => first("tokens:").or_else(|| first("text:")).map_or("synthetic", |s| &s.source),
        }
    }

    /// Each source's name and weight: the mixture's entries, or the one source at weight 1.
    pub fn weighted(&self) -> Vec<(String, f64)> {
        match self.sources.is_empty() {
            true => {
                vec![(SourceConfig { source: self.source.clone(), weight: 1.0, name: None }.label(), 1.0)]
            }
            false => self.sources.iter().map(|s| (s.label(), s.weight)).collect(),
        }
    }

    /// Where the held-out tail of a corpus of `tokens` tokens starts (no validation shards).
    pub fn val_start(&self, tokens: usize) -> usize {
        val_start(tokens, self.val_fraction)
    }

    /// The fewest tokens whose split leaves windows of `seq_len + 1` tokens, and one offset more,
    /// on both sides: what the corpus needs at least `seq_len + 2` tokens in each split for.
    pub fn min_tokens(&self, seq_len: usize) -> usize {
        let need = seq_len + 2;
        if self.val_fraction == 0.0 {
            return need; // no validation split: the training split alone
        }
        let smaller_share = self.val_fraction.min(1.0 - self.val_fraction);
        // Below this the smaller share holds at most need - 1 tokens (rounded, fewer than need).
        let start = ((need - 1) as f64 / smaller_share).floor();
        if start >= 1e15 {
            return usize::MAX; // a share so small that no corpus that fits in memory has a window
        }
        let mut n = (start as usize).max(2 * need);
        while self.val_start(n) < need || n - self.val_start(n) < need {
            n += 1;
        }
        n
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Sequences per optimizer step, summed over all ranks.
    pub global_batch_size: usize,
    /// Sequences per forward/backward pass on one rank.
    pub micro_batch_size: usize,
    pub max_steps: u64,
    /// Peak learning rate, reached at the end of warmup.
    pub lr: f64,
    /// Floor of the cosine decay.
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Steps over which the cosine decays to `min_lr`; default `max_steps`.
    pub lr_decay_steps: Option<u64>,
    /// `cosine` (warmup, then cosine decay to `min_lr`) or `wsd` (warmup, stable at `lr`, then
    /// the last `decay_fraction` of `max_steps` down to `min_lr` in `decay_shape`).
    pub schedule: Schedule,
    /// wsd: the share of `max_steps`, at the end, over which the rate decays; in (0, 1].
    pub decay_fraction: f64,
    /// wsd: how the rate falls over the decay.
    pub decay_shape: DecayShape,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip the global gradient norm to this; 0 turns clipping off.
    pub grad_clip: f64,
    /// Evaluate after every N completed steps (and after the last); 0 turns evaluation off.
    pub eval_interval: u64,
    pub eval_batches: usize,
    pub log_interval: u64,
    /// Intra-op CPU threads; default: libtorch's choice (one per core).
    pub threads: Option<usize>,
    /// Stop cleanly, with a checkpoint, before this much wall-clock time (`7h30m`, `45m`, `90s`).
    pub max_duration: Option<String>,
    /// fp16-mixed: the loss scale to start from, and clean steps before it doubles.
    pub loss_scale_initial: f64,
    pub loss_scale_growth_interval: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            global_batch_size: 32,
            micro_batch_size: 8,
            max_steps: 200,
            lr: 3.0e-3,
            min_lr: 3.0e-4,
            warmup_steps: 20,
            lr_decay_steps: None,
            schedule: Schedule::Cosine,
            decay_fraction: 0.2,
            decay_shape: DecayShape::Sqrt,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            eval_interval: 50,
            eval_batches: 4,
            log_interval: 10,
            threads: None,
            max_duration: None,
            loss_scale_initial: 65536.0,
            loss_scale_growth_interval: 2000,
        }
    }
}

/// The learning-rate schedule (`train.schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Cosine,
    /// Warmup, stable, decay: a run can be cooled down from any point of the stable phase.
    Wsd,
}

/// How a wsd schedule's decay falls from `lr` to `min_lr` over x ∈ [0, 1] of the decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayShape {
    /// 1 − x.
    Linear,
    /// (1 + cos πx) / 2.
    Cosine,
    /// 1 − √x (Hägele et al., 2024: as good as cosine at the end of a run).
    Sqrt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Precision {
    /// Everything in fp32 (TF32 matmuls on CUDA).
    #[serde(rename = "fp32")]
    #[value(name = "fp32")]
    Fp32,
    /// Autocast to bf16, fp32 master weights and optimizer state.
    #[serde(rename = "bf16-mixed")]
    #[value(name = "bf16-mixed")]
    Bf16Mixed,
    /// Autocast to fp16 with dynamic loss scaling, fp32 master weights and optimizer state.
    #[serde(rename = "fp16-mixed")]
    #[value(name = "fp16-mixed")]
    Fp16Mixed,
    /// Weights, gradients and optimizer state in bf16.
    #[serde(rename = "bf16-pure")]
    #[value(name = "bf16-pure")]
    Bf16Pure,
}

impl Precision {
    /// The name configs and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Fp16Mixed => "fp16-mixed",
            Precision::Bf16Pure => "bf16-pure",
        }
    }
}

/// The optimizer. Its betas, eps and weight decay are `train.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub name: OptimizerName,
    /// AdamW and SGD through ATen's fused kernels (one pass per tensor); false: the tensor-op paths.
    pub fused: bool,
    /// Momentum of `sgd_momentum`.
    pub momentum: f64,
    /// Muon: the peak learning rate of the orthogonalised matrices (the schedule scales it as it
    /// scales `train.lr`, which the AdamW-updated parameters use).
    pub muon_lr: f64,
    /// Muon: the matrices' momentum.
    pub muon_momentum: f64,
    /// Muon: Nesterov momentum (the published default).
    pub muon_nesterov: bool,
    /// Muon: Newton–Schulz iterations per update.
    pub muon_ns_steps: usize,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            name: OptimizerName::Adamw,
            fused: true,
            momentum: 0.9,
            muon_lr: 0.02,
            muon_momentum: 0.95,
            muon_nesterov: true,
            muon_ns_steps: 5,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerName {
    #[default]
    #[value(name = "adamw")]
    Adamw,
    #[value(name = "sgd")]
    Sgd,
    #[value(name = "sgd_momentum", alias = "sgd-momentum")]
    SgdMomentum,
    #[value(name = "adafactor")]
    Adafactor,
    #[value(name = "adamw8bit", alias = "adamw-8bit")]
    Adamw8bit,
    #[value(name = "muon")]
    Muon,
}

impl OptimizerName {
    /// The name configs and reports use.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerName::Adamw => "adamw",
            OptimizerName::Sgd => "sgd",
            OptimizerName::SgdMomentum => "sgd_momentum",
            OptimizerName::Adafactor => "adafactor",
            OptimizerName::Adamw8bit => "adamw8bit",
            OptimizerName::Muon => "muon",
        }
    }
}

/// What the OOM guard does when a step runs out of memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OomConfig {
    pub policy: OomPolicy,
    /// The guard never goes below this micro-batch.
    pub min_micro_batch: usize,
    /// After this many clean steps below the configured micro-batch, try doubling back; 0 = never.
    pub regrow_after_steps: u64,
    /// When allocation retries rise 3 steps in a row (CUDA): `warn`, or `shrink` the
    /// micro-batch before an OOM happens.
    pub on_thrash: ThrashAction,
    /// At `min_micro_batch`, still out of memory: switch these on, in order, before giving up.
    pub escalate: Vec<Escalation>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Escalation {
    ActivationCheckpointing,
    OffloadActivations,
    /// The optimizer state and its update move to host memory (`memory.offload_optimizer`).
    OffloadOptimizer,
    /// With several ranks: each keeps only its own parameters' optimizer state (`dist.shard: optimizer`).
    ShardOptimizer,
    /// With several ranks: and receives only its own parameters' gradients (`dist.shard: gradients`).
    ShardGradients,
    /// With several ranks: and holds only its own parameters through the step (`dist.shard: parameters`).
    ShardParameters,
}

impl Escalation {
    /// As the config spells it (`oom.escalate`).
    pub fn name(self) -> &'static str {
        match self {
            Escalation::ActivationCheckpointing => "activation_checkpointing",
            Escalation::OffloadActivations => "offload_activations",
            Escalation::OffloadOptimizer => "offload_optimizer",
            Escalation::ShardOptimizer => "shard_optimizer",
            Escalation::ShardGradients => "shard_gradients",
            Escalation::ShardParameters => "shard_parameters",
        }
    }

    /// What switching it on does, for the guard's warning: offload moves checkpointed blocks'
    /// inputs, so it checkpoints every block too.
    pub fn effect(self) -> &'static str {
        match self {
            Escalation::ActivationCheckpointing => "activation_checkpointing (every block)",
            Escalation::OffloadActivations => {
                "offload_activations (with every block checkpointed: offload moves the checkpointed inputs)"
            }
            Escalation::OffloadOptimizer => {
                "offload_optimizer (the optimizer state and its update move to host memory)"
            }
            Escalation::ShardOptimizer => {
                "shard_optimizer (each rank keeps only its own parameters' optimizer state)"
            }
            Escalation::ShardGradients => {
                "shard_gradients (each rank keeps only its own parameters' optimizer state and gradients)"
            }
            Escalation::ShardParameters => {
                "shard_parameters (each rank also holds only its own parameters through the step, gathering the others block by block)"
            }
        }
    }
}

impl Default for OomConfig {
    fn default() -> Self {
        Self {
            policy: OomPolicy::Adapt,
            min_micro_batch: 1,
            regrow_after_steps: 0,
            on_thrash: ThrashAction::Warn,
            escalate: vec![],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThrashAction {
    Warn,
    Shrink,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OomPolicy {
    /// Halve the micro-batch, double accumulation, replay the step.
    Adapt,
    /// Treat out-of-memory as fatal (exit code 3) without retrying.
    Fail,
    /// No guard at all: each step runs once, unwrapped; an out-of-memory ends the run (exit 3).
    /// For measuring the guard's own cost.
    Off,
}

/// Which kernels compute the step: speed switches that change how the maths runs, never what it
/// is (at most the last bits of a rounding). Not under `model:` because a resume compares that
/// section: a checkpoint resumes under any of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KernelsConfig {
    /// Llama's RMSNorm on CUDA as ATen's fused kernel (`_fused_rms_norm`: one kernel forward,
    /// one backward, input and rstd saved) instead of step by step as `transformers` computes it
    /// (about seven kernels forward). On the CPU ATen has no such kernel and the step-by-step
    /// form runs either way.
    pub fused_rms_norm: bool,
    /// 8-bit AdamW's and Adafactor's updates on CUDA as our own kernels, compiled at run time by
    /// NVRTC: 8-bit AdamW in one launch per tensor with no scratch, instead of ~25 tensor ops per
    /// run of blocks through 64 MiB scratch buffers; Adafactor in five to seven launches per
    /// tensor with a 3 MiB fp64 workspace (GPT-2), instead of ~20 tensor ops through a 16 MiB
    /// band. The CPU always runs its fused kernels. On by default since their GPU checks passed
    /// on an H200 (8-bit AdamW: the CPU kernel's exact bits) and a gpt2-124m bf16-mixed step ran
    /// at 0.995× (8-bit AdamW) and 0.970× (Adafactor) of fused AdamW's speed, against 0.906× and
    /// 0.847× as tensor ops (BENCHMARKS.md, "GPU checks on an H200").
    pub cuda_optimizers: bool,
    /// The loss as one autograd node of our own (`ffi::loss`): it keeps the logits in their own
    /// dtype and a log-sum-exp per row, and its backward writes their gradient in that dtype.
    /// Under autocast PyTorch's cross-entropy keeps fp32 log-probabilities and writes fp32 and
    /// 16-bit gradients: 10 bytes per logit on CUDA in bf16-mixed where this needs 4. CUDA runs
    /// two NVRTC-compiled kernels, the CPU ATen's ops over blocks of rows. On by default since
    /// the CUDA kernels' checks passed on an H200, where gpt2-124m bf16-mixed (micro 16) ran
    /// 1.08× faster with a peak of 10.36 GiB instead of 14.97 (BENCHMARKS.md, "GPU checks on an H200").
    pub fused_cross_entropy: bool,
    /// With `fused_cross_entropy`, in training: the loss's node writes the logits' gradient over
    /// the logits in its forward, in the pass that computes the loss (one kernel on CUDA, each
    /// block of rows while it is in cache on the CPU), for a backward from the loss; its backward
    /// then reads nothing and allocates nothing. The two-pass node reads the logits twice and
    /// writes a gradient beside them: for gpt2-124m at micro 16 that is 1.65 GB of bf16 logits
    /// read again and a 1.65 GB gradient, which the peak (the start of backward) holds beside
    /// the logits. The same bits. On by default: the memory is saved whatever the device (the
    /// planner counts it); on the CPU it measured 1.08× faster where the logits weigh (a
    /// vocabulary of 8192), about 2% slower with a byte vocabulary (BENCHMARKS.md, "Kernels:
    /// the loss's gradient in its forward"); its CUDA speed is not yet measured.
    pub fused_loss_gradient: bool,
    /// The norms on CUDA (GPT-2's LayerNorms, Llama's RMSNorms) as one autograd node of our own
    /// (`ffi::norm`, NVRTC kernels), with the residual add before every norm (a block's output
    /// is added by the next block's first norm, or the final norm) and the rounding to the
    /// compute dtype after every norm inside it: one kernel forward where
    /// ATen runs an add, the norm and autocast's cast (one per reading matrix multiplication:
    /// three after Llama's first norm, so our one 16-bit output also saves memory), and backward
    /// the norm's gradient with the residual's added and rounded in the same pass. The same
    /// maths (the reductions' order differs in the last bits of fp32). On by default since an
    /// H200 measured it: gpt2-124m bf16-mixed (micro 16) 1.055× faster, smollm2-135m 1.098× with
    /// a peak of 15.62 GiB instead of 17.20 (BENCHMARKS.md, "GPU checks on an H200, second
    /// session"). On the CPU, and for 16-bit weights (`bf16-pure`), the usual ops run either way.
    /// Overrides `fused_rms_norm` where both are on.
    pub fused_residual_norm: bool,
    /// The Llama family's SwiGLU product silu(gate) · up on CUDA as one autograd node of our own
    /// (`ffi::llama_ops`, NVRTC kernels): forward reads gate and up and writes the product once,
    /// backward writes both gradients in one pass, in fp32 with one rounding; silu(gate) is not
    /// kept for backward (one f-wide tensor less per block, which the planner counts). ATen runs
    /// silu and a multiply forward and three kernels backward. On by default since an H100
    /// measured it: smollm2-135m bf16-mixed (micro 8) 1.026× faster, 1.41 GiB lower peak
    /// (BENCHMARKS.md, "GPU checks on an H100, third session"); on the CPU ATen's ops run either way.
    pub fused_swiglu: bool,
    /// The Llama family's rotary position embedding of q and k on CUDA as one autograd node of
    /// our own (`ffi::llama_ops`, an NVRTC kernel): one pass each way over the projection's
    /// output, in fp32 from the fp32 tables with one rounding, where ATen (as `transformers`)
    /// casts the tables to the compute dtype and multiplies, negates, concatenates, multiplies
    /// and adds, and keeps the cast tables for backward (which the planner counts). On by
    /// default since an H100 measured it beside the SwiGLU node: smollm2-135m bf16-mixed 1.194×
    /// faster with both than with neither, 1.026× with the SwiGLU node alone; on the CPU ATen's
    /// ops run either way.
    pub fused_rope: bool,
    /// The linear layers and the LM head on CUDA under bf16 or fp16 autocast as one autograd
    /// node of our own (`ffi::linear`): the same GEMMs forward, but backward the weight's
    /// gradient comes out of the GEMM in fp32 (cuBLAS, 16-bit in, fp32 out) and the bias's from
    /// our column-sum kernels in fp32, where autocast's linear writes both in 16 bits and its
    /// casts' backward returns them to fp32 (a pass and a kernel per parameter per micro-step),
    /// and ATen's general reduction takes the bias's column sums (7 ms of a 152 ms gpt2-124m
    /// step on an H200). The LM head's padding-mask gradient is not computed. On by default since
    /// an H100 measured it: gpt2-124m bf16-mixed (micro 16) 1.030× faster, smollm2-135m 1.014×,
    /// the same peaks; on the CPU ATen's linear runs either way.
    pub fused_linear: bool,
    /// With `fused_linear`, GPT-2's MLP up-projection and its GELU as one node: forward the same
    /// GEMM and GELU, backward GELU's gradient and the bias's column sums in one kernel that
    /// reads the output's gradient and GELU's input once and writes the GELU gradient once,
    /// where ATen's gelu_backward writes it and the column sums read it back (100 MB per layer
    /// and micro-step of gpt2-124m at micro 16). The same maths (the GELU gradient may differ
    /// in its last bit). Off by default until a GPU measures it (`TABLES=gelu
    /// scripts/bench/bench_kernels.sh --device cuda`); on the CPU ATen's ops run either way.
    pub fused_gelu: bool,
    /// With `fused_linear`, from a step's second micro-step on (in CUDA graphs' mode from its
    /// first): the linear node adds each weight's gradient into the step's fp32 accumulator
    /// inside the weight-gradient GEMM (cuBLAS with beta = 1, 16-bit in, fp32 out), where it
    /// would write a new fp32 gradient that a multi-tensor add then reads back and adds: for
    /// gpt2-124m 85M values a micro-step written, read twice and written again (an H100 trace
    /// put the adds at 2.2 ms of a 148 ms step of four micro-steps), and a gradient-sized buffer
    /// less at each micro-step's end. The same maths (the GEMM's epilogue adds once in fp32); on
    /// the CPU nothing changes. On by default; its CUDA speed is not yet measured (`TABLES=sums
    /// scripts/bench/bench_kernels.sh --device cuda`).
    pub accumulate_in_gemm: bool,
    /// Each micro-step's forward and backward on CUDA captured once as a CUDA graph (ATen's
    /// CUDAGraph, through the shim) and replayed with one launch, instead of about a thousand
    /// kernel launches each with a few µs of GPU idle behind it (`step::graphs`). Re-captured
    /// when the guard changes the micro-batch; an out of memory inside a capture is one the
    /// guard recovers from. With activation checkpointing and a chunked loss too; not with
    /// dropout, fp16 loss scaling or offload (the config refuses them together; a step the guard
    /// escalates to offload runs eagerly).
    /// The graphs keep their activations' memory between steps (a private pool, released
    /// before validation), and with the linear node the weights' 16-bit casts they read (made
    /// again in place at each step's start). Off by default: an H100 measured gpt2-124m
    /// bf16-mixed 1.017× and smollm2-135m 1.032× faster with the other kernels' defaults, too
    /// little to refuse dropout, fp16 and offload by default or to keep a pool between steps; on
    /// the CPU nothing changes.
    pub cuda_graphs: bool,
    /// The Llama family's q, k and v projections as one matrix multiplication, and gate and up
    /// as another: their weights (kept as `transformers`' separate tensors, so checkpoints,
    /// imports and exports do not change) are the parts of one GEMM. Under a 16-bit autocast
    /// with `fused_linear` our node casts them into one matrix kept for the step and gives each
    /// part its gradient; otherwise they are concatenated in each forward (a checkpointed
    /// block's recomputation included) and the joint gradient split. Each reads the
    /// norm's output once, in one GEMM with the widths added (smollm2-135m: 960 columns where
    /// k's and v's were 192 each), and backward takes the input's gradient in one GEMM where
    /// three (two) ran and their results were added. What it costs: without our node the
    /// concatenation and its cast in each forward; backward, the joining of q's, k's and v's
    /// gradients (which the RoPE node avoids; SwiGLU's joint node, ours or of ATen's ops, writes
    /// gate's and up's whole). The
    /// same maths (the sums' order differs in the last bits). Any device. On by default since an
    /// H100 measured smollm2-135m bf16-mixed 1.053× faster with the SwiGLU and RoPE nodes (whose
    /// kernels read the joint outputs' parts in place; without them the parts are copied out and
    /// it ran 0.970×); on the CPU the same speed within noise. GPT-2's attention projection is
    /// one matrix already.
    pub merged_projections: bool,
}

impl Default for KernelsConfig {
    fn default() -> Self {
        Self {
            fused_rms_norm: true,
            cuda_optimizers: true,
            fused_cross_entropy: true,
            fused_loss_gradient: true,
            fused_residual_norm: true,
            fused_swiglu: true,
            fused_rope: true,
            fused_linear: true,
            fused_gelu: false,
            accumulate_in_gemm: true,
            cuda_graphs: false,
            merged_projections: true,
        }
    }
}

impl KernelsConfig {
    /// Every switch off: ATen's ops throughout, each kernel launched on its own. The reference
    /// the fused paths are tested against.
    pub fn aten() -> Self {
        Self {
            fused_rms_norm: false,
            cuda_optimizers: false,
            fused_cross_entropy: false,
            fused_loss_gradient: false,
            fused_residual_norm: false,
            fused_swiglu: false,
            fused_rope: false,
            fused_linear: false,
            fused_gelu: false,
            accumulate_in_gemm: false,
            cuda_graphs: false,
            merged_projections: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// Make the real allocator fail at this size (`16GiB`, `512MiB`, bytes): a CUDA memory
    /// fraction on GPUs, an address-space limit on CPU. See docs/memory-and-precision.md.
    pub limit: Option<Size>,
    /// CUDA caching-allocator options (PYTORCH_CUDA_ALLOC_CONF keys); see docs/memory-and-precision.md.
    pub allocator: allocator::AllocatorConfig,
    /// Warn when memory grows steadily over this many steps (after 5 warm-up steps); 0 = off.
    pub leak_check_steps: usize,
    /// `none`, `blocks` (recompute every block in the backward pass), `every_n:<k>` (segments
    /// of k blocks: only their inputs are kept) or `first_n:<m>` (the first m blocks recomputed
    /// one by one, the later blocks' activations kept: a dial between memory and time).
    pub activation_checkpointing: String,
    /// Checkpointed segments' inputs wait in (pinned) CPU memory for the backward pass.
    pub offload_activations: bool,
    /// The optimizer state (under `dist.shard`, this rank's part of it) and the fp32 update live
    /// in (pinned) host memory: gradients go to the host, the update runs there with the CPU
    /// kernels, the new weights come back. See docs/sharding.md.
    pub offload_optimizer: bool,
    /// LM head and cross-entropy over chunks of this many tokens: the full logits are never
    /// materialised at once. None = one piece.
    pub loss_chunk_tokens: Option<usize>,
    /// CUDA: record the caching allocator's history and write `oom_snapshot.pickle` (+ `.txt`)
    /// on the first recovered and on an unrecoverable out-of-memory. Default on for CUDA; a
    /// no-op on CPU.
    pub snapshot_on_oom: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            limit: None,
            allocator: Default::default(),
            leak_check_steps: 20,
            activation_checkpointing: "none".into(),
            offload_activations: false,
            offload_optimizer: false,
            loss_chunk_tokens: None,
            snapshot_on_oom: true,
        }
    }
}

/// A size as written in YAML: `16GiB`, `512MiB`, `1.5GB`, or a plain number of bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a size like 16GiB, 512MiB or 1.5GB, or a whole number of bytes")]
pub enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    pub fn bytes(&self) -> Result<u64, String> {
        match self {
            Size::Bytes(0) => Err("0 must be at least one byte".into()),
            Size::Bytes(b) => Ok(*b),
            Size::Text(t) => parse_size(t),
        }
    }
}

/// When checkpoints are written and which are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Every N optimizer steps (and after the last step, unless `at_end` is false); 0 = only at
    /// the end (none at all with `at_end: false`).
    pub interval: u64,
    /// Also when this many minutes passed since the last one.
    pub interval_minutes: Option<f64>,
    /// Keep the newest N.
    pub keep_last: usize,
    /// Also keep every checkpoint whose step is a multiple of N; 0 = none.
    pub keep_every: u64,
    /// Also keep the one with the best validation loss (a new best is written when found).
    pub keep_best: bool,
    /// A checkpoint after the last step (unless the interval gives one) and the final weights
    /// file. `false` for benchmarks and smoke runs, whose result is their metrics: GPT-2's take
    /// seconds and gigabytes to write.
    pub at_end: bool,
    /// Write interval checkpoints in the background: the state is copied to host memory at the
    /// step boundary (pinned on CUDA) and a writer thread writes, fsyncs and renames it while
    /// training goes on. Stops and the last step's checkpoint are written at once.
    pub r#async: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            interval: 1000,
            interval_minutes: None,
            keep_last: 3,
            keep_every: 0,
            keep_best: false,
            at_end: true,
            r#async: true,
        }
    }
}

/// Non-finite losses and gradient norms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NanConfig {
    /// Skip at most this many updates in a row before stopping with exit code 5.
    pub max_consecutive: u64,
}

impl Default for NanConfig {
    fn default() -> Self {
        Self { max_consecutive: 10 }
    }
}

/// `divergence.*`: a loss spike (or `nan.max_consecutive` non-finite updates) rolls the run back
/// to its last checkpoint and skips the data that led to it (`crate::divergence`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DivergenceConfig {
    /// Off by default: a spike trains on, and non-finite streaks end the run with exit 5.
    pub enabled: bool,
    /// How many recent healthy steps the median and MAD are taken over.
    pub window: usize,
    /// No step is judged before this many healthy steps are in the window.
    pub min_history: usize,
    /// A loss more than this many robust standard deviations (1.4826 × MAD) above the median
    /// is a spike...
    pub threshold: f64,
    /// ...when it is also this fraction above the median (a floor for a flat, noiseless window).
    pub min_rise: f64,
    /// The same test on the gradient norm, in robust standard deviations; null: not watched.
    pub grad_norm_threshold: Option<f64>,
    /// After this many rollbacks within `rollback_window` steps of data, the next divergence
    /// stops the run (exit 5, the last good checkpoint kept).
    pub max_rollbacks: usize,
    pub rollback_window: u64,
    /// The learning rate is multiplied by this for `lr_steps` steps after a rollback (1: kept).
    pub lr_factor: f64,
    pub lr_steps: u64,
}

impl Default for DivergenceConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            window: 100,
            min_history: 20,
            threshold: 6.0,
            min_rise: 0.2,
            grad_norm_threshold: None,
            max_rollbacks: 3,
            rollback_window: 1000,
            lr_factor: 1.0,
            lr_steps: 0,
        }
    }
}

/// Where metrics go besides `metrics.jsonl` (always written).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Also write TensorBoard event files to `out_dir/tb/` (rank 0): every numeric metric as a
    /// scalar, the config and the events as text.
    pub tensorboard: bool,
    /// PyTorch's profiler over chosen steps (rank 0): a Chrome trace and a summary of where the
    /// time went (`crate::trace`).
    pub trace: TraceConfig,
}

/// `eval`: downstream tasks scored during training (`crate::eval`; `trainguard eval` scores a
/// saved model the same way).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Multiple-choice task files in HellaSwag's JSONL layout, each named (the metrics fields
    /// `eval_NAME_acc` and `eval_NAME_acc_norm`).
    pub tasks: Vec<EvalTask>,
    /// Score the tasks after every N completed steps and after the last; none (the default):
    /// when validation runs (`train.eval_interval`).
    pub every_steps: Option<u64>,
    /// Score only each task's first N examples (all by default).
    pub max_examples: Option<usize>,
}

/// One `eval.tasks` entry.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalTask {
    /// Letters, digits, `_` and `-`: it names metrics fields.
    pub name: String,
    /// The task's JSONL file (relative: to the directory training starts in).
    pub path: PathBuf,
}

/// `metrics.trace`: which optimizer steps to record with PyTorch's profiler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TraceConfig {
    /// The first step recorded; none (the default) records nothing. Pick one after warm-up
    /// (the first steps pay for allocation and autotuning).
    pub from_step: Option<u64>,
    /// How many steps from there.
    pub steps: u64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self { from_step: None, steps: 2 }
    }
}

/// Failures injected on purpose, to test recovery paths on the real binary.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultsConfig {
    /// Steps (counted from 1, as the log does) whose loss is replaced by NaN (the update must be
    /// skipped).
    pub nonfinite_loss_at_steps: Vec<u64>,
    /// Steps whose (fp16-mixed) gradients are made infinite after unscaling: an overflow.
    pub fp16_overflow_at_steps: Vec<u64>,
    /// Behave as if SIGTERM arrived once this many steps are done (checkpoint at that step, exit 4).
    pub interrupt_at_step: Option<u64>,
    /// Keep every step's forward graph alive, as a leaking training script would.
    pub leak_graphs: bool,
    /// Rank `crash_rank` fails with exit 1 once this many steps are done, on the first attempt of a
    /// torchrun group only (TORCHELASTIC_RESTART_COUNT = 0).
    pub crash_at_step: Option<u64>,
    pub crash_rank: usize,
    /// Sleep this long inside every checkpoint write, after the model file is in the temporary
    /// directory and before the rest: a window in which a kill leaves a half-written checkpoint.
    pub pause_in_checkpoint_write_ms: Option<u64>,
    /// The host copy of every background checkpoint fails as if out of host memory: each is
    /// written synchronously instead, with a warning.
    pub fail_checkpoint_copy: bool,
    /// Run an op that has no deterministic implementation (`put_`) inside this step: with
    /// `deterministic: true` libtorch refuses it.
    pub nondeterministic_op_at_step: Option<u64>,
    /// Run an op taking a scalar that libtorch refuses (shapes that do not broadcast) inside this
    /// step, after the gradient all-reduce: tch raises that error as a panic.
    pub failing_scalar_op_at_step: Option<u64>,
    /// A step whose learning rate is multiplied by `factor`, chosen by the data it draws
    /// (`data_step`, counted from 1: step N's data in a run that skipped none): a destructive
    /// update that a poisoned batch would cause, after which a small model diverges for real.
    /// A run that skipped that data never takes it.
    pub lr_spike: Option<LrSpikeFault>,
    /// Only this rank gets the non-finite losses and overflows, runs the two ops above and leaks
    /// (`leak_graphs`); default: every rank.
    pub fault_rank: Option<usize>,
}

/// `faults.lr_spike`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSpikeFault {
    pub data_step: u64,
    pub factor: f64,
}

/// Multi-process runs (torchrun).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// `auto` (Gloo: this build's c10d backend, for CPU and CUDA tensors), `gloo`, or `nccl`.
    pub backend: DistBackend,
    /// A collective that does not finish in this many seconds fails the run (a dead or hung rank).
    pub timeout_s: u64,
    /// Gradients are averaged in flat buckets of about this size.
    pub bucket_mb: f64,
    /// The longest the other ranks wait for rank 0's work alone (a checkpoint, the final
    /// weights) before they end the job (exit 1), so that a write hanging with rank 0 alive
    /// ends in a torchrun restart from the last complete checkpoint rather than holding the
    /// job's GPUs. None (default): as long as rank 0's heartbeat moves.
    pub writer_wait_s: Option<u64>,
    /// Sharded data parallel: `none` (every rank holds everything), `optimizer` (each rank keeps
    /// the optimizer state of the parameters it owns: ZeRO-1), `gradients` (and receives only
    /// its own parameters' averaged gradients, by reduce-scatter: ZeRO-2) or `parameters` (and
    /// holds only its own parameters during the step, each block's gathered for its forward and
    /// its backward: ZeRO-3). See docs/sharding.md.
    pub shard: ShardLevel,
    /// Communication beside compute. Replicated gradients (`none`, `optimizer`): the last
    /// micro-step's backward all-reduces each block's bucket as it fills. `gradients`: it sums
    /// each block gradient into its owner's, in place, as backward makes it (fp32 gradients; no
    /// reduce-scatter buffers). `parameters`: the next
    /// block's gather runs while this block computes (started before it, waited for after), and
    /// a block's gradient reduce while the next block's backward does, at the cost of a second
    /// block's weights and one block's fp32 gradients held at once. false: each collective is
    /// waited for where it is issued. See docs/sharding.md.
    pub overlap: bool,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self {
            backend: DistBackend::Auto,
            timeout_s: 300,
            bucket_mb: 25.0,
            writer_wait_s: None,
            shard: ShardLevel::None,
            overlap: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DistBackend {
    Auto,
    Gloo,
    Nccl,
}

/// `dist.shard`: what each rank keeps only its own part of, in the order the levels add up.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ShardLevel {
    #[default]
    None,
    Optimizer,
    Gradients,
    /// Also the parameters (ZeRO-3): each block's gathered for its forward and its backward.
    Parameters,
}

impl ShardLevel {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Optimizer => "optimizer",
            Self::Gradients => "gradients",
            Self::Parameters => "parameters",
        }
    }
}

/// `memory.activation_checkpointing`, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpointing {
    None,
    /// Segments of this many consecutive blocks, all blocks checkpointed.
    Every(usize),
    /// Only the first this many blocks, one by one; the later blocks keep their activations.
    /// The first ones, because their recomputation then comes after the kept activations were
    /// freed by the later blocks' backward, so only one block's activations are alive then.
    First(usize),
}

impl Checkpointing {
    pub fn parse(text: &str) -> Result<Self, String> {
        let count = |prefix: &str| {
            text.trim().strip_prefix(prefix).and_then(|k| k.trim().parse::<usize>().ok()).filter(|&k| k >= 1)
        };
        match text.trim() {
            "none" => Ok(Self::None),
            "blocks" => Ok(Self::Every(1)),
            _ => count("every_n:")
                .map(Self::Every)
                .or_else(|| count("first_n:").map(Self::First))
                .ok_or_else(|| {
                    format!("must be none, blocks, every_n:<k> or first_n:<m> with k, m >= 1, got `{text}`")
                }),
        }
    }
}
