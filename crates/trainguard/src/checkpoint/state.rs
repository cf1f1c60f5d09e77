//! `trainer_state.json`: everything besides tensors that a resumed run needs to continue
//! exactly where the checkpoint left off.
// Recorded here, defined with the sampler that skips them (`step` names it through this path).
pub use crate::data::skips::SkippedWindow;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const STATE_FORMAT: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: u32,
    /// Optimizer steps completed: the resumed run starts at this step.
    pub step: u64,
    /// Successful micro-steps so far (forward + backward passes).
    pub micro_steps: u64,
    pub tokens_seen: u64,
    /// Of those, the tokens each source of a mixture gave, by name (`data.sources`), summed
    /// over every mixture the run has trained under: a resume that changes the weights, or
    /// drops a source, keeps what was seen. Empty for a run of one source.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tokens_by_source: BTreeMap<String, u64>,
    /// The sampler is a pure function of (seed, step, sample): its position is the step.
    pub sampler: SamplerState,
    /// The ranks that trained it (absent in checkpoints written before it). Another count may
    /// resume it: each step's samples are the global batch's, whoever takes which share.
    #[serde(default)]
    pub world_size: Option<usize>,
    /// How random numbers are drawn: libtorch's generator is reseeded from (seed, step) before
    /// each step, so nothing else needs saving.
    pub rng: RngState,
    /// Dynamic loss scaling (fp16): none in fp32 runs.
    pub loss_scaler: Option<serde_json::Value>,
    /// What the OOM guard settled on.
    pub guard: GuardSnapshot,
    pub optimizer: OptimizerSnapshot,
    pub best_val_loss: Option<f64>,
    pub best_val_step: Option<u64>,
    /// Updates skipped for a non-finite loss or gradient norm, over the whole run.
    pub nonfinite_skips: u64,
    /// Of those, how many in a row up to this step: `nan.max_consecutive` counts on across a
    /// resume (a run preempted between bad steps would otherwise never reach it). Absent in
    /// checkpoints written before it: 0.
    #[serde(default)]
    pub nonfinite_streak: u64,
    /// Training time before this checkpoint, over all resumes.
    pub elapsed_s: f64,
    /// Size in bytes of each tensor file: a truncated file is caught before it is parsed.
    pub files: BTreeMap<String, u64>,
    /// CRC-32C of each tensor file: bytes changed in place (same size) are caught too. Absent in
    /// checkpoints written before it; those are checked by size alone.
    #[serde(default)]
    pub checksums: BTreeMap<String, u32>,
    /// What the run trained on, to tell a dataset changed under the same path (absent in
    /// checkpoints written before it: nothing is compared then).
    #[serde(default)]
    pub data: Option<DataRecord>,
    /// The other runs' checkpoints this line of training resumed from, oldest first: a run
    /// started with `--resume <another run's checkpoint>` adds it, and so keeps where its first
    /// steps were trained (absent in checkpoints written before it, and empty for a run that
    /// began here).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lineage: Vec<crate::checkpoint::lineage::Lineage>,
    /// The divergence guard's record (`divergence.*`): its statistic's recent values, the data
    /// windows skipped and the rollbacks. Absent when the guard is off and never rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence: Option<DivergenceRecord>,
}

/// The identity of a run's data: a `prepare` dataset re-made in place with another tokenizer
/// keeps its path, and its ids then mean other text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataRecord {
    /// `data.source` as the run gave it.
    pub source: String,
    /// CRC-32C of the dataset's tokenizer.json (a `prepare` directory only).
    pub tokenizer_crc32c: Option<u32>,
    pub train_tokens: u64,
    /// The corpus' sample digest of its training tokens (`Corpus::sample_digest`).
    pub train_digest: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplerState {
    pub seed: u64,
    pub next_step: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    pub scheme: String,
    pub seed: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuardSnapshot {
    pub micro_batch: usize,
    pub accumulation: usize,
    pub configured_micro_batch: usize,
    /// How many of `oom.escalate`'s savers the guard switched on.
    #[serde(default)]
    pub escalation_level: usize,
    /// The regrow rule's clean-step count and blocked sizes (absent in older checkpoints).
    #[serde(default)]
    pub regrow: RegrowMemory,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSnapshot {
    pub kind: String,
    /// Updates applied (AdamW's bias correction depends on it).
    pub steps: u64,
}

pub const RNG_SCHEME: &str = "libtorch generator reseeded with mix(seed, step) before each step";

// The OOM guard's regrow history (guard::policy) is defined here, as the record a checkpoint
// keeps, so that checkpoints sit below the guard that uses them.
/// A size the regrow rule may not try before `until_step`, after `failures` failures there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedSize {
    pub micro_batch: usize,
    pub until_step: u64,
    pub failures: u32,
}

/// The regrow rule's history, carried across a resume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegrowMemory {
    /// Clean steps since the last out-of-memory or trial.
    pub clean_steps: u64,
    pub blocked: Vec<BlockedSize>,
    /// The sizes regrow climbed from, lowest first (absent in older checkpoints).
    #[serde(default)]
    pub ladder: Vec<usize>,
}

// The divergence guard's record (`divergence`) is defined here too, as the record a checkpoint
// keeps; the guard's logic is in `crate::divergence`.
/// What the divergence guard knows at a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DivergenceRecord {
    /// The last `divergence.window` healthy steps' losses, oldest first: the median and MAD the
    /// next step is judged against. A rollback takes these from the checkpoint it returns to.
    pub losses: Vec<f64>,
    /// The same steps' gradient norms.
    pub grad_norms: Vec<f64>,
    /// Data steps never drawn again (`data::skips`). Kept across a rollback.
    pub skipped: Vec<SkippedWindow>,
    /// Every rollback of the run, oldest first. Kept across a rollback.
    pub rollbacks: Vec<RollbackRecord>,
    /// Steps (the loop's index, from 0) below this one train at `train.lr` × `divergence.lr_factor`.
    pub lowered_lr_until: Option<u64>,
}

/// One rollback: the step that diverged (counted from 1, as reported), the data step it drew
/// (from 0) and the step of the checkpoint the run went back to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackRecord {
    pub diverged_step: u64,
    pub data_step: u64,
    pub to_step: u64,
}
