//! `trainguard plan`: what fits on a GPU before a long run. Owns the command's flags
//! ([`PlanArgs`]), turning them into a model, a setup and a target, and the order of work:
//! estimate ([`estimate`], pure) → recommendation ([`recommend`], pure) → optional measurement
//! ([`profile`]) → optional edit of the config ([`apply`]) → table or JSON ([`report`]).
//! It does not train and never changes a config except through `--apply`.
pub mod apply;
pub mod estimate;
pub mod gpu;
pub mod optimizer_state;
pub mod presets;
pub mod profile;
pub mod recommend;
pub mod report;
pub mod shape;
pub mod sharding;

use crate::config::{self, Arch, Config, ConfigError};
use crate::run_plan::{self, RunPlan};
use apply::Applied;
use gpu::GpuTarget;
use profile::{Measured, ProfileError, ProfileReport};
use recommend::Budget;
use shape::{OptimizerName, Precision, Setup, Target, Transformer};
use std::path::{Path, PathBuf};

/// Share of the card an estimate may fill: the rest covers what estimating cannot see.
pub const ESTIMATE_MARGIN: f64 = 0.85;
/// Share of the card a measured size may fill: the profile counts what the allocator reserved
/// (CPU: peak resident memory under the same cap), so only step-to-step variation is left. On
/// an H200 that variation was not small: gpt2-124m bf16-mixed at micro-batch 161 of 480 (the
/// remainder step of 158 included) reserved up to 3.5% more in training than in the profile,
/// and at 0.95 the run reached 97% of the card and made the allocator retry every step.
pub const PROFILE_MARGIN: f64 = 0.90;

/// `trainguard plan` flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PlanArgs {
    /// YAML config (any architecture); without it (and without --layers …) the built-in defaults.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Override a config key: `--set model.seq_len=2048` (repeatable).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub overrides: Vec<String>,

    /// Architecture: gpt2 (LayerNorm, GELU MLP, learned positions) or llama (RMSNorm, SwiGLU,
    /// RoPE, grouped-query attention; no biases unless a config says so). Default: the config's
    /// model.arch, gpt2 without a config.
    #[arg(long, value_enum, help_heading = "Model (generic transformer; overrides the config)")]
    pub arch: Option<Arch>,
    /// Parameter count of a generic transformer (`124M`, `8B`, `8.03e9`) whose tensors differ
    /// from the architecture's layout; weights, gradients and optimizer state follow it.
    #[arg(long, value_name = "N", help_heading = "Model (generic transformer; overrides the config)")]
    pub params: Option<String>,
    /// Transformer blocks.
    #[arg(long, value_name = "N", help_heading = "Model (generic transformer; overrides the config)")]
    pub layers: Option<u64>,
    /// Hidden size.
    #[arg(long, value_name = "N", help_heading = "Model (generic transformer; overrides the config)")]
    pub hidden: Option<u64>,
    /// Attention heads (must divide --hidden).
    #[arg(long, value_name = "N", help_heading = "Model (generic transformer; overrides the config)")]
    pub heads: Option<u64>,
    /// Vocabulary size.
    #[arg(long, value_name = "N", help_heading = "Model (generic transformer; overrides the config)")]
    pub vocab: Option<u64>,
    /// Sequence length in tokens.
    #[arg(
        long = "seq-len",
        value_name = "N",
        help_heading = "Model (generic transformer; overrides the config)"
    )]
    pub seq_len: Option<u64>,
    /// MLP width: gpt2's hidden layer (default 4 × hidden); llama's SwiGLU width (required).
    #[arg(long, value_name = "N", help_heading = "Model (generic transformer; overrides the config)")]
    pub ffn: Option<u64>,
    /// llama: key/value heads of grouped-query attention (must divide --heads; default --heads).
    #[arg(
        long = "kv-heads",
        value_name = "N",
        help_heading = "Model (generic transformer; overrides the config)"
    )]
    pub kv_heads: Option<u64>,
    /// llama: a separate LM head (`lm_head.weight`) instead of the token embedding.
    #[arg(long, overrides_with = "tied", help_heading = "Model (generic transformer; overrides the config)")]
    pub untied: bool,
    /// llama: the LM head is the token embedding (the default).
    #[arg(
        long,
        overrides_with = "untied",
        help_heading = "Model (generic transformer; overrides the config)"
    )]
    pub tied: bool,
    /// No biases in linear layers and LayerNorms.
    #[arg(long, help_heading = "Model (generic transformer; overrides the config)")]
    pub no_bias: bool,

    /// Default: the config's `precision` (fp32 without a config).
    #[arg(long, value_enum, help_heading = "Training setup")]
    pub precision: Option<Precision>,
    /// Default: the config's `optimizer.name` (adamw without a config).
    #[arg(long, value_enum, help_heading = "Training setup")]
    pub optimizer: Option<OptimizerName>,
    /// Keep only each block's input and recompute the block in backward (also on when the
    /// config's memory.activation_checkpointing is).
    #[arg(long, help_heading = "Training setup")]
    pub activation_checkpointing: bool,
    /// Flash / memory-efficient attention (the default): no b·a·s² scores kept.
    #[arg(long, overrides_with = "no_flash", help_heading = "Training setup")]
    pub flash: bool,
    /// Materialised attention scores (eager attention).
    #[arg(long, overrides_with = "flash", help_heading = "Training setup")]
    pub no_flash: bool,
    /// Chunked loss: head and cross-entropy over chunks of N tokens (default: the config's
    /// memory.loss_chunk_tokens; none without a config).
    #[arg(long, value_name = "N", help_heading = "Training setup")]
    pub loss_chunk_tokens: Option<u64>,
    /// Micro-batch of the table (default: the config's, else 1).
    #[arg(long, value_name = "N", help_heading = "Training setup")]
    pub micro_batch: Option<u64>,
    /// Target global batch in sequences (default: the config's train.global_batch_size).
    #[arg(long, value_name = "N", help_heading = "Training setup")]
    pub global_batch: Option<u64>,

    /// `auto` (NVML), or a preset: t4, l4, a10, rtx6000, v100-16, v100-32, a100-40, a100-80, h100, h200, …
    #[arg(long, value_name = "NAME", help_heading = "GPU")]
    pub gpu: Option<String>,
    /// Memory per GPU (`24GiB`, `80GB`); overrides a preset; the fallback for `--gpu auto`.
    #[arg(long, value_name = "SIZE", help_heading = "GPU")]
    pub gpu_memory: Option<String>,
    /// Data-parallel GPUs, one rank each (the global batch is split over them; `--world-size`).
    #[arg(long, visible_alias = "world-size", value_name = "N", default_value_t = 1, help_heading = "GPU")]
    pub gpus: u64,
    /// `dist.shard` to plan for: none, optimizer (each rank keeps its parameters' optimizer
    /// state) or gradients (and receives only its own gradients). Default: the config's.
    #[arg(long, value_enum, value_name = "LEVEL", help_heading = "GPU")]
    pub shard: Option<crate::config::ShardLevel>,
    /// The optimizer state in host memory (`memory.offload_optimizer`; also on when the config's is).
    #[arg(long, help_heading = "GPU")]
    pub offload_optimizer: bool,
    /// Share of the GPU's memory a plan may fill [default: 0.85 for an estimate, 0.90 with
    /// --profile, which measures what the allocator reserved instead of estimating it].
    #[arg(long, value_name = "FRACTION", help_heading = "GPU")]
    pub margin: Option<f64>,
    /// CUDA context, cuBLAS/cuDNN workspaces and the like, per process.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", help_heading = "GPU")]
    pub cuda_overhead: String,
    /// Allocator fragmentation margin, as a share of the peak allocated.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.10, help_heading = "GPU")]
    pub fragmentation: f64,

    /// Print one JSON object instead of the table.
    #[arg(long, help_heading = "Output and actions")]
    pub json: bool,
    /// Measure: real steps at growing micro-batches on the device (CPU: the process's peak
    /// resident memory), estimate vs measured, and the largest micro-batch that fits.
    #[arg(long, help_heading = "Output and actions")]
    pub profile: bool,
    /// Device for --profile: cpu, cuda, cuda:N (default: the config's `device`).
    #[arg(long, value_name = "DEVICE", requires = "profile", help_heading = "Output and actions")]
    pub device: Option<String>,
    /// What the estimate is for: cuda (the default) or cpu — the figures a CPU run measures, with
    /// no allocator rounding, fragmentation or CUDA context (--profile sets it from its device).
    #[arg(
        long,
        value_enum,
        value_name = "TARGET",
        conflicts_with = "profile",
        help_heading = "Output and actions"
    )]
    pub target: Option<Target>,
    /// Measure exactly these micro-batches (`1,2,4`) instead of searching.
    #[arg(
        long,
        value_name = "N,N,…",
        value_delimiter = ',',
        requires = "profile",
        help_heading = "Output and actions"
    )]
    pub micro_batches: Vec<u64>,
    /// Optimizer steps per measured micro-batch.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        requires = "profile",
        help_heading = "Output and actions"
    )]
    pub profile_steps: u64,
    /// Write the chosen micro-batch (and --global-batch) into the config, keeping a backup.
    #[arg(long, help_heading = "Output and actions")]
    pub apply: bool,
    /// Run each profiled size in a child process (the fallback where clear_refs is refused).
    #[arg(long, hide = true)]
    pub profile_isolate: bool,
    /// Internal: measure one micro-batch and print it as JSON (the child of --profile-isolate).
    #[arg(long, hide = true, value_name = "N")]
    pub profile_one: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    /// Bad flags or values (exit code 2).
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--apply: {0}")]
    Edit(#[from] apply::EditError),
    #[error("--profile: {0}")]
    Profile(#[from] ProfileError),
    /// `--apply` with nothing that fits: nothing was written.
    #[error("{0}")]
    NothingFits(String),
    #[error("cannot write to standard output: {0}")]
    Stdout(std::io::Error),
    #[error("--apply: cannot {what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
}

impl PlannerError {
    /// Errors in what the user typed or wrote (exit code 2).
    pub fn is_usage(&self) -> bool {
        matches!(self, PlannerError::Usage(_) | PlannerError::Config(_) | PlannerError::Edit(_))
    }
}

fn usage(msg: impl Into<String>) -> PlannerError {
    PlannerError::Usage(msg.into())
}

/// Everything resolved from the flags.
struct Inputs {
    /// The config the plan is for: the file (or the built-in defaults) with `--set` and then the
    /// model and setup flags applied, as overrides, in one place. The estimate's model and setup
    /// and `--profile`'s run plan are all read from it.
    config: Config,
    source: String,
    model: Transformer,
    setup: Setup,
    micro: u64,
    global: Option<u64>,
    rank_batch: Option<u64>,
    /// Accumulation of the table (2 = "accumulating" when no global batch is known).
    accumulation: u64,
    target: Option<GpuTarget>,
}

const GENERIC_REQUIRED: [&str; 5] = ["--layers", "--hidden", "--heads", "--vocab", "--seq-len"];

/// The flags' own ranges, and the two sizes they give (CUDA's overhead, the card's memory).
fn check_flags(a: &PlanArgs) -> Result<(u64, Option<u64>), PlannerError> {
    if let Some(m) = a.margin.filter(|m| !(*m > 0.0 && *m <= 1.0)) {
        return Err(usage(format!("--margin must be in (0, 1], got {m}")));
    }
    if !(0.0..1.0).contains(&a.fragmentation) {
        return Err(usage(format!("--fragmentation must be in [0, 1), got {}", a.fragmentation)));
    }
    if a.gpus == 0 {
        return Err(usage("--gpus (--world-size) must be at least 1, got 0"));
    }
    if a.profile_steps == 0 {
        return Err(usage("--profile-steps must be at least 1, got 0"));
    }
    if a.micro_batches.contains(&0) {
        return Err(usage("--micro-batches must list sizes of at least 1"));
    }
    let size = |flag: &str, v: &str| match config::parse_size(v) {
        Ok(b) if b > config::limits::MAX_DEVICE_BYTES => {
            Err(usage(format!("{flag}: {v} is more than a PiB")))
        }
        r => r.map_err(|e| usage(format!("{flag}: {e}"))),
    };
    let cuda_overhead = size("--cuda-overhead", &a.cuda_overhead)?;
    let gpu_memory = a.gpu_memory.as_deref().map(|v| size("--gpu-memory", v)).transpose()?;
    if let (Some(b), Some(v)) = (gpu_memory, a.gpu_memory.as_deref()) {
        // A bare number is bytes: `--gpu-memory 24` planned for a 24-byte card.
        if b < 1 << 20 {
            let advice = if v.trim().chars().all(|c| c.is_ascii_digit() || c == '.') {
                format!("; give a unit, e.g. {v}GiB or {v}GB")
            } else {
                String::new()
            };
            // `1.5` is 1.5 bytes, not the 1 parse_size rounds it to.
            let bytes = if v.trim().parse::<f64>().is_ok() { v.trim().to_string() } else { b.to_string() };
            return Err(usage(format!("--gpu-memory: {v} is {bytes} bytes, too small for a GPU{advice}")));
        }
    }
    Ok((cuda_overhead, gpu_memory))
}

/// The config the flags name (or the built-in one), and where it came from in words; none for a
/// generic transformer the flags describe alone.
fn read_config(a: &PlanArgs, params_given: bool) -> Result<(Option<config::Config>, String), PlannerError> {
    let given = [a.layers, a.hidden, a.heads, a.vocab, a.seq_len];
    let generic = given.iter().any(Option::is_some)
        || a.ffn.is_some()
        || params_given
        || a.no_bias
        || a.arch.is_some()
        || a.kv_heads.is_some()
        || a.untied
        || a.tied;
    Ok(if a.config.is_some() || !generic {
        let cfg = config::load(a.config.as_deref(), &a.overrides)?;
        (
            Some(cfg),
            a.config
                .as_ref()
                .map_or("built-in defaults (the debug model)".into(), |p| p.display().to_string()),
        )
    } else {
        if !a.overrides.is_empty() {
            return Err(usage("--set edits a config: give --config, or describe the model with --layers, --hidden, --heads, --vocab, --seq-len"));
        }
        let missing: Vec<&str> =
            GENERIC_REQUIRED.iter().zip(given).filter(|(_, v)| v.is_none()).map(|(f, _)| *f).collect();
        if !missing.is_empty() {
            return Err(usage(format!(
                "a generic transformer needs {} (missing: {}), or a --config",
                GENERIC_REQUIRED.join(", "),
                missing.join(", ")
            )));
        }
        (None, "command line".into())
    })
}

/// The model, precision, optimizer and savers the flags set over the config's.
fn apply_model_flags(
    a: &PlanArgs,
    config: &mut config::Config,
    described_by_flags: bool,
) -> Result<(), PlannerError> {
    let m = &mut config.model;
    for (flag, key) in [
        (a.layers, &mut m.n_layer),
        (a.hidden, &mut m.n_embd),
        (a.heads, &mut m.n_head),
        (a.vocab, &mut m.vocab_size),
        (a.seq_len, &mut m.seq_len),
    ] {
        if let Some(v) = flag {
            *key = v as usize;
        }
    }
    if let Some(arch) = a.arch {
        m.arch = arch;
    }
    // The Llama family has no biases; a config may still say otherwise.
    let llama_from_flags = described_by_flags && m.arch == Arch::Llama;
    m.bias &= !(a.no_bias || llama_from_flags);
    if let Some(k) = a.kv_heads {
        m.n_kv_head = Some(k as usize);
    }
    if a.untied || a.tied {
        m.tie_embeddings = a.tied;
    }
    config.precision = a.precision.unwrap_or(config.precision);
    config.optimizer.name = a.optimizer.unwrap_or(config.optimizer.name);
    if a.activation_checkpointing && config.memory.activation_checkpointing == "none" {
        config.memory.activation_checkpointing = "blocks".into();
    }
    if a.loss_chunk_tokens == Some(0) {
        return Err(usage("--loss-chunk-tokens must be at least 1, got 0"));
    }
    config.memory.loss_chunk_tokens =
        a.loss_chunk_tokens.map(|n| n as usize).or(config.memory.loss_chunk_tokens);

    if let Some(f) = a.ffn {
        config.model.ffn_hidden = Some(f as usize);
    }
    if config.model.arch == Arch::Llama && config.model.ffn_hidden.is_none() {
        return Err(usage("--arch llama needs --ffn N: its SwiGLU width (e.g. 8192 for Llama 3.2 1B, 1536 for SmolLM2-135M)"));
    }
    Ok(())
}

/// What the estimate needs of the run besides the model.
fn setup_of(a: &PlanArgs, config: &config::Config, cuda_overhead: u64) -> Setup {
    let (segment, first) = match config::Checkpointing::parse(&config.memory.activation_checkpointing) {
        Ok(config::Checkpointing::Every(k)) => (Some(k as u64), None),
        Ok(config::Checkpointing::First(m)) => (Some(1), Some(m as u64)),
        _ => (None, None),
    };
    Setup {
        precision: config.precision,
        optimizer: config.optimizer.name,
        activation_checkpointing: segment.is_some(),
        checkpoint_blocks: segment.unwrap_or(1),
        checkpoint_first: first,
        flash: !a.no_flash,
        dropout: config.model.dropout > 0.0,
        loss_chunk_tokens: config.memory.loss_chunk_tokens.map(|n| n as u64),
        fused_rms_norm: config.kernels.fused_rms_norm,
        cuda_optimizers: config.kernels.cuda_optimizers,
        fused_optimizer: config.optimizer.fused,
        offload_activations: config.memory.offload_activations,
        fused_cross_entropy: config.kernels.fused_cross_entropy,
        fused_loss_gradient: config.kernels.fused_loss_gradient,
        fused_residual_norm: config.kernels.fused_residual_norm,
        fused_swiglu: config.kernels.fused_swiglu,
        fused_rope: config.kernels.fused_rope,
        cuda_graphs: config.kernels.cuda_graphs,
        merged_projections: config.kernels.merged_projections,
        document_mask: config.data.document_mask,
        fused_linear: config.kernels.fused_linear,
        target: Target::Cuda,
        gpus: a.gpus,
        shard: a.shard.unwrap_or(config.dist.shard),
        offload_optimizer: a.offload_optimizer || config.memory.offload_optimizer,
        bucket_mb: config.dist.bucket_mb,
        overlap: config.dist.overlap,
        overlap_in_backward: config.dist.overlap,
        cuda_overhead,
        fragmentation: a.fragmentation,
        background_checkpoint: config.checkpoint.r#async,
    }
}

/// The micro-batch, the busiest GPU's share of the global batch and the accumulation.
fn batch_split(
    a: &PlanArgs,
    config: &config::Config,
    model: &Transformer,
    global: Option<u64>,
    described_by_flags: bool,
) -> Result<(u64, Option<u64>, u64), PlannerError> {
    let mut micro =
        a.micro_batch.unwrap_or(if described_by_flags { 1 } else { config.train.micro_batch_size as u64 });
    if micro == 0 {
        return Err(usage("--micro-batch must be at least 1, got 0"));
    }
    // The config's bound on tokens a step (train.global_batch_size), for the flags too: past
    // it the byte counts wrapped and a plan of 2^64 sequences "fit" in 1.9 GiB.
    let max_tokens = config::limits::MAX_TOKENS_PER_STEP as u128;
    for (flag, n) in [("--micro-batch", Some(micro)), ("--global-batch", global)] {
        if let Some(n) = n.filter(|&n| n as u128 * model.seq_len as u128 > max_tokens) {
            return Err(usage(format!(
                "{flag} {n}: sequences of {} tokens make more than {max_tokens} tokens a step",
                model.seq_len
            )));
        }
    }
    let rank_batch = match global {
        Some(0) => return Err(usage("--global-batch must be at least 1, got 0")),
        Some(g) if g < a.gpus => {
            return Err(usage(format!(
                "--global-batch {g} cannot be shared by --gpus {}: every GPU needs at least one sequence",
                a.gpus
            )))
        }
        // The busiest GPU's share is what must fit (shares differ by one when uneven).
        Some(g) => crate::data::batch::rank_share(g as usize, a.gpus as usize).map(|r| r as u64),
        None => None,
    };
    match rank_batch {
        Some(r) if micro > r && a.micro_batch.is_some() => {
            return Err(usage(format!(
                "--micro-batch {micro} exceeds the per-GPU batch {r} (global batch / --gpus)"
            )));
        }
        // The config's micro-batch, for another global batch: the share is the most a step runs.
        Some(r) if micro > r => micro = r,
        _ => {}
    }
    if let Some(r) = rank_batch {
        if let Some(m) = a.micro_batches.iter().find(|&&m| m > r) {
            return Err(usage(format!("--micro-batches {m} exceeds the per-GPU batch {r} (global batch / --gpus): training would refuse it")));
        }
    }
    let accumulation = rank_batch.map_or(2, |r| r.div_ceil(micro));
    Ok((micro, rank_batch, accumulation))
}

impl Inputs {
    /// The plan's inputs from the flags and the config they name: each step a function of its own.
    fn resolve(a: &PlanArgs) -> Result<Self, PlannerError> {
        let (cuda_overhead, gpu_memory) = check_flags(a)?;
        let params = a.params.as_deref().map(parse_count).transpose()?;
        let (file, source) = read_config(a, params.is_some())?;
        let global = a.global_batch.or(file.as_ref().map(|c| c.train.global_batch_size as u64));
        // A generic transformer: the built-in defaults stand in for what the flags do not say
        // (no dropout, fp32, AdamW, no savers); every size comes from the flags.
        let described_by_flags = file.is_none();
        let mut config = file.unwrap_or_default();
        apply_model_flags(a, &mut config, described_by_flags)?;
        let model = Transformer { params_override: params, ..Transformer::from_config(&config.model) };
        check_model(&model)?;
        let mut setup = setup_of(a, &config, cuda_overhead);
        if a.target == Some(Target::Cpu) {
            // Gloo's ranks under a cap start no collective inside backward (train/run.rs).
            let overlap_in_backward = setup.overlap_in_backward && config.memory.limit.is_none();
            setup = Setup {
                target: Target::Cpu,
                cuda_overhead: 0,
                fragmentation: 0.0,
                overlap_in_backward,
                ..setup
            };
        }
        let (micro, rank_batch, accumulation) = batch_split(a, &config, &model, global, described_by_flags)?;
        let target = gpu::resolve(a.gpu.as_deref(), gpu_memory, gpu::detect).map_err(usage)?;
        Ok(Self { config, source, model, setup, micro, global, rank_batch, accumulation, target })
    }
}

fn check_model(m: &Transformer) -> Result<(), PlannerError> {
    use config::limits::*;
    let bounds = [
        ("--layers (model.n_layer)", m.layers, MAX_LAYERS),
        ("--hidden (model.n_embd)", m.hidden, MAX_WIDTH),
        ("--heads (model.n_head)", m.heads, MAX_WIDTH),
        ("--vocab (model.vocab_size)", m.vocab, MAX_VOCAB),
        ("--seq-len (model.seq_len)", m.seq_len, MAX_SEQ_LEN),
        ("--ffn (model.ffn_hidden)", m.ffn, MAX_FFN),
    ];
    for (flag, v, max) in bounds {
        if v == 0 || v > max as u64 {
            return Err(usage(format!("{flag} must be in 1..={max}, got {v}")));
        }
    }
    if !m.hidden.is_multiple_of(m.heads) {
        return Err(usage(format!(
            "--heads {} must divide --hidden {} (each head gets hidden / heads channels)",
            m.heads, m.hidden
        )));
    }
    let kv = m.kv();
    match m.arch {
        Arch::Gpt2 if kv != m.heads => {
            return Err(usage(format!(
                "model.n_kv_head {kv} (the config's, or --kv-heads) needs model.arch llama (the config's, or --arch): gpt2 has no grouped-query attention (its key/value heads are its {} heads)",
                m.heads
            )));
        }
        Arch::Gpt2 if !m.tied => return Err(usage("model.tie_embeddings: false (the config's, or --untied) needs model.arch llama (the config's, or --arch): gpt2 always ties its head to the token embedding")),
        Arch::Llama if !m.head_dim().is_multiple_of(2) => {
            return Err(usage(format!("llama's rotary embedding needs an even head size: --hidden {} / --heads {} = {}", m.hidden, m.heads, m.head_dim())));
        }
        _ => {}
    }
    if kv == 0 || !m.heads.is_multiple_of(kv) {
        return Err(usage(format!("--kv-heads {kv} must divide --heads {} (each key/value head serves heads / kv-heads query heads)", m.heads)));
    }
    if let Some(p) = m.params_override.filter(|&p| p == 0 || p > MAX_PARAMS) {
        return Err(usage(format!("--params must be in 1..={MAX_PARAMS:e}, got {p}")));
    }
    Ok(())
}

/// `124M`, `8B`, `1.5e9`, `350000000` → a parameter count.
pub fn parse_count(text: &str) -> Result<u64, PlannerError> {
    let t = text.trim();
    let bad =
        || usage(format!("--params: `{text}` is not a parameter count like 124M, 8B, 1.5e9 or 350000000"));
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') | Some('G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    let n: f64 = num.trim().parse().map_err(|_| bad())?;
    let count = (n * mult).round();
    if !(count >= 1.0 && count.is_finite()) {
        return Err(bad());
    }
    if count > config::limits::MAX_PARAMS as f64 {
        return Err(usage(format!("--params must be in 1..={:e}, got {text}", config::limits::MAX_PARAMS)));
    }
    Ok(count as u64)
}

/// The flags given that describe another model or setup than the config's (what `--apply`
/// must not be planned with; `--global-batch` is written with the micro-batch).
fn model_or_setup_flags(a: &PlanArgs) -> Vec<&'static str> {
    let given = [
        ("--arch", a.arch.is_some()),
        ("--params", a.params.is_some()),
        ("--layers", a.layers.is_some()),
        ("--hidden", a.hidden.is_some()),
        ("--heads", a.heads.is_some()),
        ("--vocab", a.vocab.is_some()),
        ("--seq-len", a.seq_len.is_some()),
        ("--ffn", a.ffn.is_some()),
        ("--kv-heads", a.kv_heads.is_some()),
        ("--shard", a.shard.is_some()),
        ("--offload-optimizer", a.offload_optimizer),
        ("--target", a.target.is_some()),
        ("--untied", a.untied),
        ("--tied", a.tied),
        ("--no-bias", a.no_bias),
        ("--precision", a.precision.is_some()),
        ("--optimizer", a.optimizer.is_some()),
        ("--activation-checkpointing", a.activation_checkpointing),
        ("--no-flash", a.no_flash),
        ("--loss-chunk-tokens", a.loss_chunk_tokens.is_some()),
    ];
    given.into_iter().filter(|(_, on)| *on).map(|(flag, _)| flag).collect()
}

/// Whether the model and setup flags given only say what the file holds already (a script
/// that always passes `--precision bf16-mixed`): the plan is then the file's.
fn flags_restate_the_file(a: &PlanArgs, inputs: &Inputs) -> bool {
    let bare = PlanArgs {
        arch: None,
        params: None,
        layers: None,
        hidden: None,
        heads: None,
        vocab: None,
        seq_len: None,
        ffn: None,
        kv_heads: None,
        untied: false,
        tied: false,
        no_bias: false,
        precision: None,
        optimizer: None,
        activation_checkpointing: false,
        no_flash: false,
        loss_chunk_tokens: None,
        ..a.clone()
    };
    Inputs::resolve(&bare).is_ok_and(|b| b.model == inputs.model && b.setup == inputs.setup)
}

/// Runs `trainguard plan`.
pub fn run(args: &PlanArgs) -> Result<(), PlannerError> {
    let inputs = Inputs::resolve(args)?;
    if let Some(micro) = args.profile_one {
        return profile_child(args, &inputs, micro);
    }
    if args.apply {
        if args.config.is_none() {
            return Err(usage("--apply writes into a config file: give --config FILE"));
        }
        if !args.overrides.is_empty() {
            return Err(usage("--apply cannot be combined with --set: the plan would be for a config the file does not hold"));
        }
        let described = model_or_setup_flags(args);
        if !described.is_empty() && !flags_restate_the_file(args, &inputs) {
            return Err(usage(format!(
                "--apply cannot be combined with {}: the plan would be for a model or setup the file does not hold, and only the micro-batch is written",
                described.join(", ")
            )));
        }
        if inputs.target.is_none() && !args.profile {
            return Err(usage("--apply needs something to choose by: a GPU (--gpu NAME|auto, --gpu-memory SIZE) or --profile"));
        }
        if args.profile && !args.micro_batches.is_empty() {
            return Err(usage("--apply with --profile needs the search: drop --micro-batches"));
        }
    }
    let est = estimate::estimate(&inputs.model, &inputs.setup, inputs.micro, inputs.accumulation);
    let rec = inputs.target.as_ref().map(|t| {
        recommend::recommend(
            &inputs.model,
            &inputs.setup,
            inputs.rank_batch,
            Budget { capacity: t.capacity_bytes, margin: args.margin.unwrap_or(ESTIMATE_MARGIN) },
        )
    });
    // The level table where sharding or offload is in question: several ranks, a level or
    // offload asked for, or one GPU that does not fit as configured.
    let in_question = args.gpus > 1
        || inputs.setup.shard != config::ShardLevel::None
        || inputs.setup.offload_optimizer
        || rec.as_ref().is_some_and(|r| !r.fits);
    let levels = if in_question { plan_levels(args, &inputs) } else { None };
    let prof = if args.profile { Some(run_profile(args, &inputs)?) } else { None };

    let mut nothing_fits = None;
    let applied = if args.apply {
        let chosen = match &prof {
            Some(p) => p.micro_batch,
            None => rec.as_ref().and_then(|r| r.micro_batch),
        };
        match chosen {
            Some(micro) => Some(apply_choice(args, &inputs, micro)?),
            None => {
                nothing_fits = Some(format!(
                    "--apply: nothing fits even at micro-batch 1 ({}); {} left unchanged",
                    if prof.is_some() { "measured" } else { "estimated" },
                    args.config.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
                ));
                None
            }
        }
    } else {
        None
    };

    let out = report::Report {
        schema: report::SCHEMA,
        source: &inputs.source,
        model: &inputs.model,
        params: inputs.model.params(),
        setup: &inputs.setup,
        global_batch: inputs.global,
        gpus: args.gpus,
        micro_batch: inputs.micro,
        accumulation: inputs.rank_batch.map(|r| r.div_ceil(inputs.micro)),
        estimate: &est,
        gpu: inputs.target.as_ref(),
        recommendation: rec.as_ref(),
        levels: levels.as_ref(),
        profile: prof.as_ref(),
        applied: applied.as_ref(),
    };
    let text = if args.json {
        serde_json::to_string_pretty(&out).expect("the report always serialises") + "\n"
    } else {
        report::render(&out)
    };
    crate::console::output::print(&text).map_err(PlannerError::Stdout)?;
    match nothing_fits {
        Some(msg) => Err(PlannerError::NothingFits(msg)),
        None => Ok(()),
    }
}

/// Each `dist.shard` level (and offload) at the plan's world size, planned as the
/// recommendation plans (the largest micro-batch that fits, with the config's savers), and the
/// cheapest that fits; with no GPU given, each at the table's micro-batch (none chosen).
fn plan_levels(args: &PlanArgs, inputs: &Inputs) -> Option<sharding::Levels> {
    let (m, micro, accumulation) = (&inputs.model, inputs.micro, inputs.accumulation);
    let rank_of = |s: &Setup| estimate::estimate(m, s, micro, accumulation).sharding;
    Some(match inputs.target.as_ref() {
        Some(t) => {
            let budget =
                Budget { capacity: t.capacity_bytes, margin: args.margin.unwrap_or(ESTIMATE_MARGIN) };
            let mut levels = sharding::choose(&inputs.setup, rank_of, |s| {
                let r = recommend::recommend(m, s, inputs.rank_batch, budget);
                let at = r.micro_batch.unwrap_or(1);
                let k = inputs.rank_batch.map_or(accumulation, |rb| rb.div_ceil(at));
                (r.micro_batch, r.total_bytes, estimate::estimate(m, s, at, k).peak_allocated, r.fits)
            });
            // Nothing fits: what else it would take on the most sharded level.
            if let (None, Some(last)) = (levels.chosen, levels.rows.last()) {
                let s = Setup {
                    shard: last.shard,
                    offload_optimizer: last.offload_optimizer,
                    ..inputs.setup.clone()
                };
                levels.levers = recommend::levers(m, &s, inputs.rank_batch, budget.bytes());
            }
            levels
        }
        None => sharding::choose(&inputs.setup, rank_of, |s| {
            let e = estimate::estimate(m, s, micro, accumulation);
            (Some(micro), e.total, e.peak_allocated, false)
        }),
    })
}

/// The run plan (training's, for one process on the profiled device) and the comparison setup a
/// profile runs with.
fn profile_inputs(args: &PlanArgs, inputs: &Inputs) -> Result<(RunPlan, Setup), PlannerError> {
    let s = &inputs.setup;
    if !s.flash {
        return Err(usage(
            "--profile measures the built-in models, which use scaled_dot_product_attention: drop --no-flash, or plan without --profile",
        ));
    }
    let m = &inputs.model;
    if m.params_override.is_some() {
        return Err(usage("--profile builds the model it measures: --params describes one it cannot build (give its sizes instead)"));
    }
    let mut cfg = inputs.config.clone();
    let problems = config::validate(&cfg);
    if !problems.is_empty() {
        let list: Vec<String> = problems.iter().map(ToString::to_string).collect();
        return Err(usage(format!("--profile: the model cannot be built: {}", list.join("; "))));
    }
    let spec = args.device.clone().unwrap_or_else(|| cfg.device.clone());
    let cuda_devices = tch::Cuda::device_count().max(0) as usize;
    let device =
        run_plan::resolve_device(&spec, cuda_devices, 0).map_err(|e| usage(format!("--device: {e}")))?;
    cfg.device = spec;
    let env = run_plan::Environment {
        cuda_devices,
        rank: 0,
        local_rank: 0,
        world_size: 1,
        restart_count: 0,
        resuming: false,
    };
    let plan = RunPlan::build(cfg, env).map_err(|e| usage(format!("--profile: {e}")))?;
    let setup = Setup {
        // On CPU, scaled_dot_product_attention falls back to the unfused maths with dropout.
        flash: device.is_cuda() || plan.config.model.dropout == 0.0,
        target: if device.is_cuda() { Target::Cuda } else { Target::Cpu },
        // One process: no collectives (its optimizer owns every parameter).
        gpus: 1,
        cuda_overhead: 0,
        fragmentation: 0.0,
        ..s.clone()
    };
    Ok((plan, setup))
}

fn run_profile(args: &PlanArgs, inputs: &Inputs) -> Result<ProfileReport, PlannerError> {
    let (run_plan, setup) = profile_inputs(args, inputs)?;
    let device = run_plan.device;
    let capacity =
        profile::capacity(device, profile_capacity(inputs.target.as_ref(), run_plan.memory_limit))?;
    let plan = profile::Plan {
        device,
        sizes: args.micro_batches.clone(),
        steps: args.profile_steps,
        rank_batch: inputs.rank_batch,
        margin: args.margin.unwrap_or(PROFILE_MARGIN),
        isolate: args.profile_isolate,
        model: &inputs.model,
        setup: &setup,
    };
    let in_process = device.is_cuda() || (!plan.isolate && profile::can_reset_peak());
    let mut report = if in_process {
        let mut session = profile::Session::open(run_plan, capacity)?;
        // On the CPU an out-of-memory leaves the process bigger: glibc cannot give back heap that
        // lies under a live block, and what the failed attempt grew counted against every later
        // size (micro-batch 33 of the debug model: 29.1 MiB in a fresh process, 32.6 MiB after an
        // out-of-memory at 36, over the budget). Sizes after one run in child processes.
        let mut after_oom = false;
        profile::run(&plan, capacity, |b| {
            if after_oom {
                return measure_in_child(b);
            }
            let m = session.measure(b, plan.steps)?;
            after_oom = m.oom && !device.is_cuda();
            Ok(m)
        })?
    } else {
        profile::run(&plan, capacity, measure_in_child)?
    };
    report.method = match (device.is_cuda(), in_process) {
        (true, _) => "CUDA caching allocator: allocated_peak above what was allocated before the model was built; \
                      fits when reserved_peak plus the memory in use before (context, other processes) is within the budget"
            .into(),
        (false, true) => "CPU analogue: peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident \
                          size before the model was built (sizes after an out-of-memory in child processes); compared with \
                          the estimate's parts that apply on CPU"
            .into(),
        (false, false) => "CPU analogue, one child process per micro-batch: each child's peak resident set above its \
                           resident size before the model was built; compared with the estimate's parts that apply on CPU"
            .into(),
    };
    Ok(report)
}

/// The memory a profile may fill: the card's (`--gpu`, `--gpu-memory`), else the config's
/// `memory.limit` — the cap training will run under — else the whole device. With `--gpu auto`
/// it is the card's total, not the free memory the estimate plans with: the profile measures what
/// is in use on the whole card (the context and other processes' memory included) against it,
/// and the free figure has other processes' memory taken off already; it would count twice.
fn profile_capacity(target: Option<&GpuTarget>, memory_limit: Option<u64>) -> Option<u64> {
    target
        .map(
            |t| if t.source == "nvml" { t.total_bytes.unwrap_or(t.capacity_bytes) } else { t.capacity_bytes },
        )
        .or(memory_limit)
}

/// Runs this binary again with the same flags plus `--profile-one B` and reads its JSON line.
fn measure_in_child(micro: u64) -> Result<Measured, ProfileError> {
    let child_err = |why: String| ProfileError::Child { micro, why };
    let exe = std::env::current_exe().map_err(|e| child_err(format!("cannot find this executable: {e}")))?;
    let out = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .arg("--profile-one")
        .arg(micro.to_string())
        .output()
        .map_err(|e| child_err(format!("cannot start: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(child_err(format!(
            "exited with {}: {}",
            out.status,
            stderr.lines().last().unwrap_or("")
        )));
    }
    let line = stdout.lines().last().unwrap_or("");
    serde_json::from_str(line).map_err(|e| child_err(format!("unreadable answer `{line}`: {e}")))
}

/// The child side of [`measure_in_child`]: one size, one JSON line on stdout.
fn profile_child(args: &PlanArgs, inputs: &Inputs, micro: u64) -> Result<(), PlannerError> {
    let (run_plan, _) = profile_inputs(args, inputs)?;
    let capacity =
        profile::capacity(run_plan.device, profile_capacity(inputs.target.as_ref(), run_plan.memory_limit))?;
    let mut session = profile::Session::open(run_plan, capacity)?;
    let m = session.measure(micro, args.profile_steps)?;
    crate::console::output::print(
        &(serde_json::to_string(&m).expect("a measurement always serialises") + "\n"),
    )
    .map_err(PlannerError::Stdout)
}

/// Writes `micro` (and `--global-batch`, when it differs) into the config file.
fn apply_choice(args: &PlanArgs, inputs: &Inputs, micro: u64) -> Result<Applied, PlannerError> {
    let path = args.config.as_deref().expect("checked before");
    let cfg = &inputs.config;
    let global = inputs.global.unwrap_or(cfg.train.global_batch_size as u64);
    let io = |what: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| PlannerError::Io { what, path: p, source }
    };
    let old = std::fs::read_to_string(path).map_err(io("read", path))?;
    let mut new = apply::set_value(&old, "train", "micro_batch_size", &micro.to_string())?;
    if global != cfg.train.global_batch_size as u64 {
        new = apply::set_value(&new, "train", "global_batch_size", &global.to_string())?;
    }
    let accumulation = crate::data::batch::accumulation(global as usize, micro as usize, args.gpus as usize)
        .map_err(|e| usage(format!("--apply: {e}")))? as u64;
    let mut applied = Applied {
        path: path.to_path_buf(),
        backup: None,
        micro_batch: micro,
        global_batch: global,
        accumulation,
        diff: apply::diff(&old, &new),
    };
    if new == old {
        return Ok(applied);
    }
    // The file itself, through any symbolic link (renaming over the link replaced it with a
    // copy and left the file it pointed to as it was), keeping its permissions.
    let target = std::fs::canonicalize(path).map_err(io("resolve", path))?;
    // The edited text must load, as a valid config holding the new values, before anything is written.
    let name =
        target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "config.yaml".into());
    let tmp = target.with_file_name(format!(".{name}.trainguard-apply"));
    if let Err(e) = std::fs::write(&tmp, &new) {
        let _ = std::fs::remove_file(&tmp); // half written on a full disk
        return Err(io("write", &tmp)(e));
    }
    if let Ok(meta) = std::fs::metadata(&target) {
        let _ = std::fs::set_permissions(&tmp, meta.permissions());
    }
    let check = config::load(Some(&tmp), &[]).map_err(|e| e.to_string()).and_then(|c| {
        let got = (c.train.micro_batch_size as u64, c.train.global_batch_size as u64);
        if got == (micro, global) {
            Ok(())
        } else {
            Err(format!("the edited file reads back as micro-batch {} and global batch {}", got.0, got.1))
        }
    });
    if let Err(why) = check {
        let _ = std::fs::remove_file(&tmp);
        return Err(usage(format!(
            "--apply: the edited {} would not be valid, nothing written: {why}",
            path.display()
        )));
    }
    let backup = apply::backup_path(path);
    let replaced = std::fs::copy(path, &backup)
        .map_err(io("back up to", &backup))
        .and_then(|_| std::fs::rename(&tmp, &target).map_err(io("replace", &target)));
    if let Err(e) = replaced {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    applied.backup = Some(backup);
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_parse_with_suffixes() {
        assert_eq!(parse_count("124M").unwrap(), 124_000_000);
        assert_eq!(parse_count("8B").unwrap(), 8_000_000_000);
        assert_eq!(parse_count("8.03e9").unwrap(), 8_030_000_000);
        assert_eq!(parse_count("350000000").unwrap(), 350_000_000);
        assert_eq!(parse_count("1.5k").unwrap(), 1500);
        for bad in ["", "lots", "0", "-5M", "M"] {
            let err = parse_count(bad).unwrap_err();
            assert!(err.is_usage() && err.to_string().contains("--params"), "{bad}: {err}");
        }
    }

    /// Other processes' memory counts once: `--gpu auto`'s free figure leaves it out, so the
    /// profile, which adds everything in use on the card to its own peak, fills the total.
    #[test]
    fn a_profile_fills_the_cards_total_under_gpu_auto_and_the_named_size_otherwise() {
        let gib = 1u64 << 30;
        let detected =
            || Ok(gpu::DetectedGpu { name: "H100".into(), total: 80 * gib, free: 60 * gib, count: 1 });
        let auto = gpu::resolve(Some("auto"), None, detected).unwrap().unwrap();
        assert_eq!(auto.capacity_bytes, 60 * gib, "the estimate plans with what is free");
        assert_eq!(profile_capacity(Some(&auto), Some(gib)), Some(80 * gib));
        let rehearsed = gpu::resolve(Some("auto"), Some(16 * gib), detected).unwrap().unwrap();
        assert_eq!(
            profile_capacity(Some(&rehearsed), None),
            Some(16 * gib),
            "--gpu-memory rehearses a smaller card"
        );
        let preset = gpu::resolve(Some("a100-40"), None, detected).unwrap().unwrap();
        assert_eq!(profile_capacity(Some(&preset), None), Some(preset.capacity_bytes));
        assert_eq!(
            profile_capacity(None, Some(3 * gib)),
            Some(3 * gib),
            "memory.limit, the cap training runs under"
        );
        assert_eq!(profile_capacity(None, None), None);
    }

    fn args() -> PlanArgs {
        PlanArgs {
            margin: None,
            fragmentation: 0.1,
            gpus: 1,
            profile_steps: 2,
            cuda_overhead: "1GiB".into(),
            ..Default::default()
        }
    }

    #[test]
    fn generic_flags_need_the_core_sizes_and_name_what_is_missing() {
        let a = PlanArgs { layers: Some(12), hidden: Some(768), ..args() };
        let err = Inputs::resolve(&a).err().unwrap().to_string();
        assert!(err.contains("missing: --heads, --vocab, --seq-len"), "{err}");
        let a = PlanArgs { heads: Some(12), vocab: Some(50257), seq_len: Some(1024), ..a };
        let i = Inputs::resolve(&a).unwrap();
        assert_eq!(
            (i.model.ffn, i.model.params()),
            (3072, 124_439_808 + 47 * 768),
            "50257 padded to 50304 rows"
        );
        assert_eq!((i.micro, i.global, i.accumulation), (1, None, 2));
    }

    #[test]
    fn the_configs_micro_batch_gives_way_to_a_smaller_global_batch() {
        // The built-in config says micro 8; asked about a global batch of 4, one step runs 4.
        let i = Inputs::resolve(&PlanArgs { global_batch: Some(4), ..args() }).unwrap();
        assert_eq!((i.micro, i.accumulation), (4, 1));
    }

    #[test]
    fn bad_shapes_and_batches_are_usage_errors_naming_the_flag() {
        let gpt = || PlanArgs {
            layers: Some(2),
            hidden: Some(64),
            heads: Some(2),
            vocab: Some(256),
            seq_len: Some(64),
            ..args()
        };
        let cases: Vec<(PlanArgs, &str)> = vec![
            (PlanArgs { layers: Some(0), ..gpt() }, "--layers (model.n_layer) must be in 1..=4096, got 0"),
            (
                PlanArgs { layers: Some(u64::MAX), ..gpt() },
                "--layers (model.n_layer) must be in 1..=4096, got 18446744073709551615",
            ),
            (
                PlanArgs { seq_len: Some(1 << 40), ..gpt() },
                "--seq-len (model.seq_len) must be in 1..=4194304",
            ),
            (PlanArgs { params: Some("1e30".into()), ..gpt() }, "--params must be in 1..=1e14"),
            (
                PlanArgs { cuda_overhead: "2000000TiB".into(), ..gpt() },
                "--cuda-overhead: 2000000TiB is more than a PiB",
            ),
            (
                PlanArgs { cuda_overhead: "99999999999999999999GiB".into(), ..gpt() },
                "--cuda-overhead: `99999999999999999999GiB` is more bytes than 64 bits count",
            ),
            (PlanArgs { heads: Some(3), ..gpt() }, "--heads 3 must divide --hidden 64"),
            (PlanArgs { margin: Some(1.5), ..gpt() }, "--margin must be in (0, 1]"),
            (
                PlanArgs { global_batch: Some(3), gpus: 4, ..gpt() },
                "--global-batch 3 cannot be shared by --gpus 4",
            ),
            (
                PlanArgs { global_batch: Some(8), micro_batch: Some(16), ..gpt() },
                "--micro-batch 16 exceeds the per-GPU batch 8",
            ),
            (
                PlanArgs { global_batch: Some(8), micro_batches: vec![4, 16], ..gpt() },
                "--micro-batches 16 exceeds the per-GPU batch 8",
            ),
            (PlanArgs { gpu: Some("a100-50".into()), ..gpt() }, "unknown GPU `a100-50`"),
            (PlanArgs { gpu_memory: Some("lots".into()), ..gpt() }, "--gpu-memory:"),
            (PlanArgs { gpu_memory: Some("24".into()), ..gpt() }, "give a unit, e.g. 24GiB"),
            (
                PlanArgs { gpu_memory: Some("500KiB".into()), ..gpt() },
                "500KiB is 512000 bytes, too small for a GPU",
            ),
            (PlanArgs { params: Some("1e30".into()), ..gpt() }, "got 1e30"),
            (
                PlanArgs { micro_batch: Some(u64::MAX), ..gpt() },
                "--micro-batch 18446744073709551615: sequences of",
            ),
            (
                PlanArgs { global_batch: Some(100_000_000_000_000), ..gpt() },
                "--global-batch 100000000000000: sequences of",
            ),
        ];
        for (a, want) in cases {
            let err = Inputs::resolve(&a).err().unwrap();
            assert!(err.is_usage() && err.to_string().contains(want), "want `{want}`, got `{err}`");
        }
    }

    #[test]
    fn config_values_are_the_defaults_and_flags_override_them() {
        let i = Inputs::resolve(&args()).unwrap();
        let d = Config::default();
        assert_eq!((i.model.layers, i.model.seq_len), (d.model.n_layer as u64, d.model.seq_len as u64));
        assert_eq!((i.micro, i.global, i.accumulation), (8, Some(32), 4));
        // With a config, generic flags override its sizes; without one they describe the whole model.
        let debug = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs/debug.yaml");
        let i = Inputs::resolve(&PlanArgs {
            config: Some(debug),
            seq_len: Some(32),
            global_batch: Some(64),
            gpus: 2,
            ..args()
        })
        .unwrap();
        assert_eq!((i.model.seq_len, i.rank_batch, i.accumulation), (32, Some(32), 4));
        assert_eq!(i.model.layers, d.model.n_layer as u64, "other sizes still come from the config");
    }

    #[test]
    fn llama_flags_describe_grouped_query_heads_swiglu_and_an_untied_head() {
        let llama = || PlanArgs {
            arch: Some(Arch::Llama),
            layers: Some(16),
            hidden: Some(2048),
            heads: Some(32),
            kv_heads: Some(8),
            ffn: Some(8192),
            vocab: Some(128_256),
            seq_len: Some(2048),
            ..args()
        };
        let i = Inputs::resolve(&llama()).unwrap();
        assert_eq!((i.model.arch, i.model.kv(), i.model.tied, i.model.bias), (Arch::Llama, 8, true, false));
        assert_eq!(i.model.params(), 1_235_814_400, "Llama 3.2 1B");
        let untied = Inputs::resolve(&PlanArgs { untied: true, ..llama() }).unwrap();
        assert_eq!(untied.model.params(), 1_235_814_400 + 128_256 * 2048);
        // On a config they override its keys like the other flags.
        let cfg = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs/llama-debug.yaml");
        let i = Inputs::resolve(&PlanArgs {
            config: Some(cfg.clone()),
            kv_heads: Some(1),
            ffn: Some(96),
            untied: true,
            ..args()
        })
        .unwrap();
        assert_eq!(
            (i.config.model.n_kv_head, i.config.model.ffn_hidden, i.config.model.tie_embeddings),
            (Some(1), Some(96), false)
        );
        assert_eq!((i.model.arch, i.model.kv(), i.model.ffn, i.model.tied), (Arch::Llama, 1, 96, false));
        let cases: Vec<(PlanArgs, &str)> = vec![
            (PlanArgs { ffn: None, ..llama() }, "--arch llama needs --ffn N"),
            (PlanArgs { kv_heads: Some(5), ..llama() }, "--kv-heads 5 must divide --heads 32"),
            (PlanArgs { kv_heads: Some(0), ..llama() }, "--kv-heads 0 must divide --heads 32"),
            (PlanArgs { hidden: Some(2080), heads: Some(32), ..llama() }, "even head size"),
            (
                PlanArgs { arch: Some(Arch::Gpt2), ..llama() },
                "model.n_kv_head 8 (the config's, or --kv-heads) needs model.arch llama",
            ),
            (
                PlanArgs { arch: Some(Arch::Gpt2), kv_heads: None, untied: true, ..llama() },
                "model.tie_embeddings: false (the config's, or --untied) needs model.arch llama",
            ),
        ];
        for (a, want) in cases {
            let err = Inputs::resolve(&a).err().unwrap_or_else(|| panic!("`{want}`: resolved"));
            assert!(err.is_usage() && err.to_string().contains(want), "want `{want}`, got `{err}`");
        }
    }
}
