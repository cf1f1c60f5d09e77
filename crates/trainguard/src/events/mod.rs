//! What a run reports, and where it goes. The training loop emits [`Event`]s (the types, here);
//! the [`Reporter`] (`reporter.rs`) writes one `metrics.jsonl` line per optimizer step and one
//! `events.jsonl` line per everything else, and logs each as `render.rs` words it (through
//! `tracing`; a progress bar on a terminal). Only the writing rank opens files.
mod render;
mod reporter;

use crate::memory::MemorySnapshot;
pub use reporter::{Reporter, SinkError, Subscriber};
use serde::Serialize;

/// One optimizer step's figures (a metrics.jsonl line).
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Validation loss, on steps where evaluation ran.
    pub val_loss: Option<f64>,
    pub micro_batch: usize,
    pub accumulation: usize,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub step_time_s: f64,
    pub elapsed_s: f64,
    #[serde(flatten)]
    pub memory: crate::memory::telemetry::MemoryMetrics,
    /// `eval.tasks`' accuracies on steps that scored them (`crate::eval::metrics` names the
    /// fields: `eval_NAME_acc`, `eval_NAME_acc_norm`, their means `eval_acc`, `eval_acc_norm`).
    #[serde(flatten)]
    pub downstream: std::collections::BTreeMap<String, f64>,
    /// A mixture's figures by source name (`data.sources`), as flat fields (TensorBoard groups
    /// them by the prefix): `tokens_seen/<name>`, tokens trained on from it over the whole run,
    /// and on steps where evaluation ran `val_loss/<name>`. Empty for one source.
    #[serde(flatten)]
    pub by_source: std::collections::BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OomRecovery {
    pub step: u64,
    pub old_micro_batch: usize,
    pub new_micro_batch: usize,
    pub old_accumulation: usize,
    pub new_accumulation: usize,
    /// A failed regrow trial being undone (rather than a halving).
    pub regrow_backoff: bool,
    pub requested_bytes: Option<u64>,
    pub before: MemorySnapshot,
    pub after: MemorySnapshot,
    /// From the failed allocation to the first micro-step that succeeded after it.
    pub recover_ms: f64,
    pub error: String,
    /// Memory held between steps grew since the first steps: tensors kept across steps.
    pub leak: Option<LeakDiagnosis>,
    /// In the evaluation after the step: its own micro-batch halved, training's stays.
    pub in_evaluation: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Optimizer steps completed: `train.max_steps`, or the step resumed at when past it.
    pub steps: u64,
    pub final_loss: f64,
    pub final_val_loss: Option<f64>,
    /// This session's (a resumed run's earlier sessions are in events.jsonl).
    pub oom_recoveries: u64,
    /// Of `oom_recoveries`, those recovered by a memory saver `oom.escalate` switched on.
    pub oom_escalations: u64,
    pub configured_micro_batch: usize,
    pub final_micro_batch: usize,
    /// This session's.
    pub time_lost_s: f64,
    /// The guard's own cost: its time outside the attempts on clean steps (this session's).
    pub guard_overhead_s: f64,
    /// Wall time to reach `steps`, a resumed run's sessions together (as metrics.jsonl's
    /// `elapsed_s`: steps a crash lost after the last checkpoint are not counted).
    pub elapsed_s: f64,
    /// The run's tokens over `elapsed_s`.
    pub tokens_per_s: f64,
    /// Steps this session ran, and its wall time: the whole run unless it was resumed.
    pub session_steps: u64,
    pub session_elapsed_s: f64,
    /// CPU runs: the most address space mapped above start-up (what `memory.limit` counts).
    pub peak_mapped_above_start_bytes: Option<u64>,
    /// CPU runs: the peak resident size above the resident size at start-up (memory touched).
    pub peak_resident_above_start_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    RunStarted {
        device: String,
        params: i64,
        corpus: String,
        unigram_entropy: f64,
        global_batch_size: usize,
        /// The micro-batch the run starts at: the guard's from a checkpoint it resumed, which can
        /// be below `configured_micro_batch_size`.
        micro_batch_size: usize,
        configured_micro_batch_size: usize,
        accumulation: usize,
        world_size: usize,
        tokens_per_step: usize,
        max_steps: u64,
        memory_limit_bytes: Option<u64>,
        allocator: crate::memory::allocator::EffectiveSettings,
    },
    Step(StepMetrics),
    /// `deterministic: true`: libtorch's switches as it reports them, and the cuBLAS setting.
    Deterministic(crate::determinism::Determinism),
    RegrowAttempt {
        step: u64,
        from_micro_batch: usize,
        to_micro_batch: usize,
    },
    /// Out of memory at the smallest micro-batch: a memory saver from `oom.escalate` switched on.
    /// `switched_on`: the `oom.escalate` entry; `effect`: what it switched on, said in full.
    OomEscalated {
        step: u64,
        micro_batch: usize,
        level: usize,
        switched_on: String,
        effect: String,
    },
    OomRecovered(OomRecovery),
    /// `lineage`: the other runs' checkpoints the line resumed from, oldest first (the one
    /// resumed now included when it is another run's).
    Resumed {
        step: u64,
        path: String,
        changed: Vec<String>,
        lineage: Vec<crate::checkpoint::lineage::Lineage>,
    },
    CheckpointSkipped {
        path: String,
        reason: String,
    },
    /// A checkpoint a killed replacement of the same step had left aside, put back in its place.
    CheckpointPutBack {
        step: u64,
    },
    /// Checkpoints of the line the run leaves moved out of its way (nothing deleted).
    CheckpointsSetAside {
        resumed_step: u64,
        steps: Vec<u64>,
        to: String,
    },
    /// The final weights of an earlier end of the run, which a resumed run trains past,
    /// renamed out of the way of `sample` and `export` (nothing deleted).
    FinalWeightsSetAside {
        resumed_step: u64,
        to: String,
    },
    CheckpointSaved {
        step: u64,
        path: String,
        seconds: f64,
        deleted: Vec<u64>,
    },
    CheckpointFailed {
        step: u64,
        error: String,
        training_goes_on: bool,
    },
    /// Training waited `seconds` for the background write of checkpoint `step` to end, before
    /// `before` (the next checkpoint, a stop, the end of training, a rollback).
    CheckpointWaited {
        step: u64,
        seconds: f64,
        before: String,
    },
    /// `checkpoint.async`, but this checkpoint was written at once: no host copy (`why`: out of
    /// host memory, say) or no writer thread.
    CheckpointWrittenInForeground {
        step: u64,
        why: String,
    },
    NonfiniteSkipped {
        step: u64,
        loss: f64,
        grad_norm: f64,
        consecutive: u64,
    },
    LeakSuspected {
        step: u64,
        message: String,
    },
    /// fp16 loss scaling: `overflow` (update skipped, scale backed off) or `growth`.
    LossScaleChanged {
        step: u64,
        scale: f64,
        reason: LossScaleReason,
    },
    /// Allocation retries rose step after step; `action`: `warn` or `shrink`.
    ThrashDetected {
        step: u64,
        total_retries: i64,
        action: String,
        new_micro_batch: Option<usize>,
    },
    /// `divergence.*`: step `step` diverged (its loss or gradient norm past `limit`, judged
    /// against the `median` and `mad` of the recent healthy steps; or `nan.max_consecutive`
    /// non-finite updates, `value` of them) after drawing data step `data_step` (from 1).
    /// `gives_up`: the rollbacks are spent (`recent` within `divergence.rollback_window`).
    Diverged {
        step: u64,
        data_step: u64,
        statistic: crate::divergence::Statistic,
        value: f64,
        median: f64,
        mad: f64,
        limit: f64,
        recent: usize,
        gives_up: bool,
    },
    /// After `diverged`: the model, optimizer, scaler and guards are back at checkpoint
    /// `checkpoint` (`step` steps done), data steps `skipped_from..=skipped_to` (from 1) are
    /// never drawn, and steps before `lr_lowered_until` train at the learning rate × `lr_factor`.
    /// `rollbacks`: the run's so far, this one included.
    RolledBack {
        step: u64,
        diverged_step: u64,
        checkpoint: String,
        skipped_from: u64,
        skipped_to: u64,
        lr_factor: f64,
        lr_lowered_until: Option<u64>,
        rollbacks: usize,
    },
    /// The run stops before max_steps (see [`StopReason`]), `step` steps done.
    Stopped {
        step: u64,
        reason: StopReason,
        checkpoint: Option<String>,
    },
    /// End of a multi-process run: spread of per-parameter checksums across ranks (0 = same).
    RanksCompared {
        world_size: usize,
        checksum_spread: f64,
    },
    /// `kernels.cuda_graphs`: this step captured its micro-steps of `micro_batch` sequences as
    /// a CUDA graph, replayed from then on.
    GraphCaptured {
        step: u64,
        micro_batch: usize,
    },
    /// `kernels.cuda_graphs`: a capture failed for a reason other than memory; the run goes on
    /// without graphs.
    GraphsOff {
        step: u64,
        reason: String,
    },
    /// `metrics.trace`: the profiled steps' Chrome trace is written; where their time went.
    TraceWritten(crate::trace::TraceSummary),
    RunFinished(RunSummary),
}

impl Event {
    /// Steps are counted from 1 in everything a run reports (log, metrics, events, checkpoints,
    /// report): step N is the Nth optimizer step, and a checkpoint at step N holds the state
    /// after it. The loop counts from 0 (the index the sampler and the schedule take), so the
    /// events about a step in progress carry that index until here; the others (checkpoints,
    /// resume, stops, the end) carry a count of steps completed already.
    pub(crate) fn counted_from_one(mut self) -> Self {
        match &mut self {
            Event::Step(StepMetrics { step, .. })
            | Event::OomRecovered(OomRecovery { step, .. })
            | Event::RegrowAttempt { step, .. }
            | Event::OomEscalated { step, .. }
            | Event::NonfiniteSkipped { step, .. }
            | Event::Diverged { step, .. }
            | Event::LeakSuspected { step, .. }
            | Event::LossScaleChanged { step, .. }
            | Event::ThrashDetected { step, .. }
            | Event::GraphCaptured { step, .. }
            | Event::GraphsOff { step, .. } => *step += 1,
            _ => {}
        }
        self
    }
}

/// The leak the guard found at an out-of-memory (the `leak` field of `oom_recovered`;
/// `guard::leak` diagnoses it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeakDiagnosis {
    /// The step after which the least memory was held between steps.
    pub baseline_step: u64,
    pub baseline_bytes: u64,
    /// Held now, with the failed attempt freed.
    pub held_bytes: u64,
    pub grown_bytes: u64,
    pub message: String,
}

/// Why a run stopped before `train.max_steps` (`events.jsonl` spells it in snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// SIGINT/SIGTERM (or `faults.interrupt_at_step`).
    Signal,
    /// `train.max_duration` would be passed before the next step and checkpoint end.
    TimeLimit,
    /// `nan.max_consecutive` non-finite updates in a row.
    Nonfinite,
    /// Out of memory even at the smallest micro-batch.
    OutOfMemory,
    /// A token id outside the vocabulary in the step's windows (a training split over 1 GiB).
    BadData,
    /// Diverged again with `divergence.max_rollbacks` spent.
    Diverged,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Signal => "signal",
            StopReason::TimeLimit => "time_limit",
            StopReason::Nonfinite => "nonfinite",
            StopReason::OutOfMemory => "out_of_memory",
            StopReason::BadData => "bad_data",
            StopReason::Diverged => "diverged",
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the fp16 loss scale changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossScaleReason {
    /// Gradients overflowed: update skipped, scale backed off.
    Overflow,
    /// `train.loss_scale_growth_interval` clean steps in a row.
    Growth,
}
