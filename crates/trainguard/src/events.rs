//! What a run reports, and where it goes. The training loop emits [`Event`]s; the [`Reporter`]
//! turns them into human log lines (through `tracing`; a progress bar on a terminal), one
//! `metrics.jsonl` line per optimizer step and one `events.jsonl` line per everything else.
//! Only the writing rank opens files.
use crate::fs::whole_file;
use crate::memory::{gib, human, MemorySnapshot};
use serde::Serialize;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

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
    /// The run stops before max_steps (see [`StopReason`]).
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
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Signal => "signal",
            StopReason::TimeLimit => "time_limit",
            StopReason::Nonfinite => "nonfinite",
            StopReason::OutOfMemory => "out_of_memory",
            StopReason::BadData => "bad_data",
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

pub struct Reporter {
    metrics: Option<BufWriter<File>>,
    events: Option<BufWriter<File>>,
    log_interval: u64,
    max_steps: u64,
    bar: Option<indicatif::ProgressBar>,
    /// `metrics.tensorboard: true`: the same lines as TensorBoard event files.
    tensorboard: Option<crate::report::tensorboard::TensorBoardWriter>,
    /// The step a resumed run started at (a run resumed at or past max_steps trains nothing).
    resume_at: Option<u64>,
}

/// A file of the run directory the reporter could not open or rewrite.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", .path.display())]
pub struct SinkError {
    pub path: std::path::PathBuf,
    pub source: std::io::Error,
}

impl Reporter {
    /// `out_dir = None`: log lines only (non-writing ranks, tests). `resume_at`: the step a
    /// resumed run starts at; metrics of later steps (from before a kill) are dropped, since the
    /// run computes them again, and both files are appended to.
    pub fn new(
        out_dir: Option<&Path>,
        log_interval: u64,
        max_steps: u64,
        resume_at: Option<u64>,
    ) -> Result<Self, SinkError> {
        let open = |name: &str| -> Result<Option<BufWriter<File>>, SinkError> {
            let Some(d) = out_dir else { return Ok(None) };
            let path = d.join(name);
            let named = |source| SinkError { path: path.clone(), source };
            match (resume_at, name) {
                (Some(step), "metrics.jsonl") => {
                    keep_lines(&path, |v| v["step"].as_u64().is_some_and(|s| s < step)).map_err(named)?
                }
                // A run killed mid-write may have left half a line.
                (Some(_), _) => keep_lines(&path, |_| true).map_err(named)?,
                _ => {}
            }
            let file = if resume_at.is_some() {
                File::options().create(true).append(true).open(&path)
            } else {
                File::create(&path)
            }
            .map_err(named)?;
            Ok(Some(BufWriter::new(file)))
        };
        let bar = crate::console::logging::progress_bar_wanted().then(|| {
            let bar = indicatif::ProgressBar::new(max_steps);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | ETA {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_position(resume_at.unwrap_or(0));
            bar
        });
        Ok(Self {
            metrics: open("metrics.jsonl")?,
            events: open("events.jsonl")?,
            log_interval,
            max_steps,
            bar,
            tensorboard: None,
            resume_at,
        })
    }

    /// Also writes TensorBoard event files into `dir` (the writing rank's `out_dir/tb`), starting
    /// with the resolved config as text.
    pub fn enable_tensorboard(&mut self, dir: &Path, config_yaml: &str) -> Result<(), SinkError> {
        let named = |source| SinkError { path: dir.to_path_buf(), source };
        let mut tb = crate::report::tensorboard::TensorBoardWriter::create(dir, self.resume_at.unwrap_or(0))
            .map_err(named)?;
        tb.text("config", Some(0), &format!("```yaml\n{config_yaml}```")).map_err(named)?;
        self.tensorboard = Some(tb);
        Ok(())
    }

    pub fn emit(&mut self, event: Event) {
        self.log(&event);
        if let (Some(bar), Event::Step(m)) = (&self.bar, &event) {
            let mem = crate::memory::ProcessMemory::read()
                .map(|p| format!(" | rss {}", human(p.rss_bytes)))
                .unwrap_or_default();
            bar.set_position(m.step + 1);
            bar.set_message(format!(
                "loss {:.4} | {:.0} tok/s | micro {}×{}{mem}",
                m.loss, m.tokens_per_s, m.micro_batch, m.accumulation
            ));
        }
        if let (Some(bar), Event::RunFinished(_) | Event::Stopped { .. }) = (&self.bar, &event) {
            bar.finish();
        }
        let sink = if matches!(event, Event::Step(_)) { &mut self.metrics } else { &mut self.events };
        if let Some(w) = sink {
            let line = match &event {
                Event::Step(m) => serde_json::to_string(m),
                e => serde_json::to_string(e),
            };
            // Flushed per line: a killed run keeps every line up to its last step.
            let written =
                line.map_err(std::io::Error::other).and_then(|l| writeln!(w, "{l}")).and_then(|_| w.flush());
            if let Err(e) = written {
                tracing::warn!("cannot write run files: {e}");
            }
        }
        if let Some(tb) = &mut self.tensorboard {
            let written = match &event {
                Event::Step(m) => {
                    serde_json::to_value(m).map_err(std::io::Error::other).and_then(|v| tb.scalars(&v))
                }
                e => serde_json::to_value(e)
                    .map_err(std::io::Error::other)
                    .and_then(|v| tb.text("events", v["step"].as_i64(), &v.to_string())),
            };
            if let Err(e) = written {
                tracing::warn!("cannot write TensorBoard files, no more will be written: {e}");
                self.tensorboard = None;
            }
        }
    }

    fn log(&self, event: &Event) {
        match event {
            Event::RunStarted { device, params, corpus, unigram_entropy, global_batch_size, micro_batch_size, configured_micro_batch_size, accumulation, world_size, tokens_per_step, max_steps, memory_limit_bytes, allocator } => {
                tracing::info!(
                    "run: {:.2}M parameters on {device}, corpus {corpus}{}",
                    *params as f64 / 1e6,
                    if unigram_entropy.is_finite() { format!(" (unigram entropy {unigram_entropy:.3} nats)") } else { " (no validation split)".into() }
                );
                let guarded = if micro_batch_size != configured_micro_batch_size { format!(" (configured micro {configured_micro_batch_size}: the OOM guard's size, resumed)") } else { String::new() };
                tracing::info!(
                    "batch: {}{guarded}; {tokens_per_step} tokens/step; {max_steps} steps",
                    crate::data::batch::describe(*global_batch_size, *micro_batch_size, *accumulation, *world_size)
                );
                if let Some(l) = memory_limit_bytes {
                    tracing::info!("memory cap: {}", human(*l));
                }
                if allocator.source != "none" {
                    // They configure the CUDA caching allocator: a CPU run has them, unused.
                    let unused = if device.starts_with("cuda") { "" } else { "; CUDA's caching allocator only, unused on the CPU" };
                    tracing::info!("allocator settings: {} (from {}{unused})", allocator.conf, allocator.source);
                }
            }
            Event::Step(m) => {
                let last = m.step + 1 == self.max_steps;
                if m.step % self.log_interval == 0 || last || m.val_loss.is_some() {
                    let val = m.val_loss.map(|v| format!(" | val {v:.4}")).unwrap_or_default();
                    let mem = &m.memory;
                    let mem = match (mem.allocated_bytes, mem.reserved_bytes, mem.peak_allocated_bytes) {
                        (Some(a), Some(r), Some(p)) => format!(" | mem {:.2}/{:.2}/{:.2} GiB alloc/reserved/peak", gib(a), gib(r), gib(p)),
                        _ => mem.rss_bytes.map(|r| format!(" | rss {:.2} GiB", gib(r))).unwrap_or_default(),
                    };
                    tracing::info!(
                        "step {:>5}/{} | loss {:.4}{val} | lr {:.2e} | {:.0} tok/s | micro {}×{}{mem} | {:.1}s",
                        m.step, self.max_steps, m.loss, m.lr, m.tokens_per_s, m.micro_batch, m.accumulation, m.elapsed_s
                    );
                }
            }
            Event::OomEscalated { step, micro_batch, level, effect, .. } => {
                tracing::warn!("step {step}: out of memory at micro-batch {micro_batch}, the smallest allowed: switching on {effect} (escalation {level}) and replaying");
            }
            Event::Deterministic(d) => {
                let cublas = d.cublas_workspace_config.as_deref().unwrap_or("unset");
                let from = if d.cublas_workspace_config_from == "trainguard" { "set by trainguard" } else { "kept from the environment" };
                tracing::info!(
                    "deterministic: libtorch deterministic algorithms {}, uninitialised memory filled {}; CUBLAS_WORKSPACE_CONFIG={cublas} ({from})",
                    d.libtorch.algorithms, d.libtorch.fill_uninitialized_memory
                );
            }
            Event::RegrowAttempt { step, from_micro_batch, to_micro_batch } => {
                tracing::info!("step {step}: trying micro-batch {to_micro_batch} again (was {from_micro_batch})");
            }
            Event::OomRecovered(r) => {
                let fmt = |s: &MemorySnapshot| match (s.allocated_bytes, s.reserved_bytes) {
                    (Some(a), Some(r)) => format!("{} allocated / {} reserved", human(a), human(r)),
                    _ => "memory figures unavailable".into(),
                };
                let asked = r.requested_bytes.map(|b| format!(" (asked for {})", human(b))).unwrap_or_default();
                let what = if r.regrow_backoff { "regrow failed, backing off" } else { "out of memory" };
                let recovered = if r.recover_ms.is_finite() { format!("recovered in {:.0} ms", r.recover_ms) } else { "did not recover".into() };
                let leak = r.leak.as_ref().map(|l| format!("; {}", l.message)).unwrap_or_default();
                tracing::warn!(
                    "step {}: {what}{asked}; micro-batch {} → {}, accumulation {} → {}; memory before {}, after {}{leak}; replaying the same samples ({recovered})",
                    r.step, r.old_micro_batch, r.new_micro_batch, r.old_accumulation, r.new_accumulation, fmt(&r.before), fmt(&r.after)
                );
            }
            Event::Resumed { step, path, changed, lineage } => {
                tracing::info!("resuming at step {step} from {path}");
                if !lineage.is_empty() {
                    let runs: Vec<String> = lineage.iter().map(|l| format!("{} (to step {})", l.checkpoint, l.step)).collect();
                    tracing::info!("this run continues other runs' training: {}", runs.join(" → "));
                }
                for c in changed {
                    tracing::info!("changed since the checkpoint: {c}");
                }
            }
            Event::CheckpointSkipped { path, reason } => tracing::warn!("skipping checkpoint {path}: {reason}"),
            Event::CheckpointPutBack { step } => {
                tracing::warn!("checkpoint at step {step} put back: a run killed while writing the same step again had moved it aside");
            }
            Event::CheckpointsSetAside { resumed_step, steps, to } => tracing::warn!(
                "checkpoints of steps {steps:?} moved to {to}: they belong to a line this run leaves, which it does not continue from step {resumed_step} (nothing deleted)"
            ),
            Event::FinalWeightsSetAside { resumed_step, to } => tracing::warn!(
                "moved the final weights found in the run directory to {to}: this run, starting at step {resumed_step}, trains past them (nothing deleted)"
            ),
            Event::CheckpointSaved { step, path, seconds, deleted } => {
                let gone = if deleted.is_empty() { String::new() } else { format!(", removed steps {deleted:?}") };
                tracing::info!("checkpoint at step {step}: {path} ({seconds:.2}s{gone})");
            }
            Event::CheckpointFailed { step, error, training_goes_on } => match training_goes_on {
                true => tracing::warn!("checkpoint at step {step} failed, training goes on: {error}"),
                false => tracing::warn!("checkpoint at step {step} failed: {error}"),
            },
            Event::NonfiniteSkipped { step, loss, grad_norm, consecutive } => {
                tracing::warn!("step {step}: non-finite loss {loss} or gradient norm {grad_norm}: update skipped ({consecutive} in a row)");
            }
            Event::LossScaleChanged { step, scale, reason } => match reason {
                LossScaleReason::Overflow => tracing::warn!("step {step}: fp16 gradients overflowed: update skipped, loss scale lowered to {scale}"),
                LossScaleReason::Growth => tracing::info!("step {step}: loss scale raised to {scale}"),
            },
            Event::LeakSuspected { step, message } => tracing::warn!("step {step}: possible memory leak: {message}"),
            Event::GraphCaptured { step, micro_batch } => tracing::info!("step {step}: micro-steps of {micro_batch} captured as a CUDA graph"),
            Event::GraphsOff { step, reason } => tracing::warn!("step {step}: CUDA graphs off for the rest of the run, a capture failed: {reason}"),
            Event::ThrashDetected { step, total_retries, action, new_micro_batch } => {
                let what = new_micro_batch.map(|m| format!("micro-batch lowered to {m} before an out-of-memory")).unwrap_or_else(|| format!("oom.on_thrash: {action}"));
                tracing::warn!("step {step}: the CUDA allocator keeps flushing its cache to satisfy requests ({total_retries} retries so far), which slows every step; {what}");
            }
            Event::Stopped { step, reason, checkpoint } => {
                let ck = match checkpoint {
                    Some(c) => format!("; checkpoint {c}"),
                    // A rank that writes no files: the checkpoint, if any, is rank 0's to say.
                    None if self.events.is_none() => "; rank 0 writes the checkpoint".into(),
                    None => "; no checkpoint".into(),
                };
                // The non-finite stop comes after its step (whose checkpoint counts it); every
                // other stop comes before the step it names, which its checkpoint has not run.
                let when = if matches!(reason, StopReason::Nonfinite) { "after" } else { "before" };
                tracing::warn!("stopping {when} step {step} ({reason}){ck}");
            }
            Event::TraceWritten(s) => {
                let kinds: Vec<String> = s.by_work.iter().take(6).map(|w| format!("{} {:.0}%", w.work.name(), 100.0 * w.share)).collect();
                let per = |ms: f64| ms / s.steps as f64;
                tracing::info!("trace written to {}: {} {:.1} ms per step of {} ({}); `trainguard trace {}` tabulates it", s.path, s.counted, per(s.busy_ms), s.steps, kinds.join(", "), s.path);
                for n in s.top.iter().take(5) {
                    let name: String = n.name.chars().take(100).collect();
                    tracing::info!("  {:>9.2} ms per step  {name}", per(n.ms));
                }
            }
            Event::RanksCompared { world_size, checksum_spread } => {
                if *checksum_spread == 0.0 {
                    tracing::info!("all {world_size} ranks hold identical weights");
                } else {
                    tracing::warn!("ranks' weights differ (checksum spread {checksum_spread:e}): data-parallel replicas diverged");
                }
            }
            Event::RunFinished(s) if self.resume_at.is_some_and(|r| r >= s.steps) => {
                tracing::info!(
                    "done: nothing to train: resumed at step {}, and train.max_steps is {}; raise train.max_steps (or start a new run) to train further",
                    self.resume_at.unwrap_or_default(),
                    self.max_steps
                );
            }
            Event::RunFinished(s) => {
                let val = s.final_val_loss.map(|v| format!(", val loss {v:.4}")).unwrap_or_default();
                let session = match self.resume_at {
                    Some(_) => format!("; this session: {} steps in {:.1}s, ", s.session_steps, s.session_elapsed_s),
                    None => "; ".into(),
                };
                let escalated = if s.oom_escalations > 0 { format!(" ({} by oom.escalate)", s.oom_escalations) } else { String::new() };
                tracing::info!(
                    "done: {} steps in {:.1}s ({:.0} tok/s), loss {:.4}{val}{session}OOM recoveries {}{escalated}, micro-batch {} (configured {}), time lost {:.2}s",
                    s.steps, s.elapsed_s, s.tokens_per_s, s.final_loss, s.oom_recoveries, s.final_micro_batch, s.configured_micro_batch, s.time_lost_s
                );
            }
        }
    }
}

/// Rewrites a JSONL file keeping the complete lines that `keep` accepts.
/// Bytes, not text: a line cut inside a multi-byte character is dropped like any half line
/// (read as a string, the file failed whole and was left as it was).
fn keep_lines(path: &Path, keep: impl Fn(&serde_json::Value) -> bool) -> std::io::Result<()> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut kept = Vec::with_capacity(bytes.len());
    for line in bytes.split(|&b| b == b'\n') {
        if serde_json::from_slice::<serde_json::Value>(line).is_ok_and(|v| keep(&v)) {
            kept.extend_from_slice(line);
            kept.push(b'\n');
        }
    }
    // Whole: a kill during the rewrite leaves the old file or the new one, never a truncated
    // one (the run's whole history).
    whole_file::replace(path, &kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_half_line_is_dropped_even_when_cut_inside_a_character() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let mut bytes = b"{\"event\":\"a\",\"step\":1}\n{\"event\":\"b\",\"step\":2}\n".to_vec();
        bytes.extend_from_slice(b"{\"event\":\"checkpoint_saved\",\"path\":\"runs/\xc3");
        std::fs::write(&path, &bytes).unwrap();
        keep_lines(&path, |_| true).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"event\":\"a\",\"step\":1}\n{\"event\":\"b\",\"step\":2}\n"
        );
        keep_lines(&path, |v| v["step"].as_u64() == Some(2)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"event\":\"b\",\"step\":2}\n");
        keep_lines(&dir.path().join("absent.jsonl"), |_| true).unwrap();
    }
}
