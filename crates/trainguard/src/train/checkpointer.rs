//! Writing checkpoints on schedule (rank 0 only): when one is due, the trainer state it records,
//! and how it is written: synchronously, or (`checkpoint.async`) from a host copy taken at the
//! step boundary by a writer thread while training goes on. At most one write is in flight; the
//! next checkpoint, a stop, the end of training and a rollback wait for it, and its outcome is
//! reported at the next step boundary (a failure as a synchronous one's). What a checkpoint
//! directory holds and how it is made whole is [`crate::checkpoint::writer`]'s.
use super::resume::TrainState;
use crate::checkpoint::state::*;
use crate::checkpoint::writer::{self, InFlight, WriteJob, Written};
use crate::checkpoint::{snapshot, store, CheckpointError, Loaded};
use crate::events::{Event, Reporter};
use crate::run_plan::{CheckpointPlan, RunPlan};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tch::Tensor;

/// Tensors by name, as a checkpoint file holds them.
type Named = Vec<(String, Tensor)>;

/// What a wait for the write in flight is for (the `checkpoint_waited` event's `before`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WaitFor {
    NextCheckpoint,
    Stop,
    End,
    /// A caller that needs the newest complete checkpoint on disk (a rollback).
    Rollback,
}

impl WaitFor {
    fn name(self) -> &'static str {
        match self {
            Self::NextCheckpoint => "next checkpoint",
            Self::Stop => "stop",
            Self::End => "end of training",
            Self::Rollback => "rollback",
        }
    }
}

/// When to checkpoint, and writing one with retention applied.
pub(super) struct Checkpointer {
    root: PathBuf,
    writer: bool,
    rank: usize,
    world: usize,
    plan: CheckpointPlan,
    /// `checkpoint.async`, unless a CPU address-space cap is on: the writer thread's Rust
    /// allocations (safetensors serialises each tensor) would abort the process at the cap.
    background: bool,
    last_at: Instant,
    /// How long the last write took: the time-limit margin uses it.
    last_seconds: f64,
    /// The step of the newest complete checkpoint written (or resumed from) by this run.
    pub(super) last_saved: Option<u64>,
    last_path: Option<PathBuf>,
    /// What this run trains on, recorded in each checkpoint.
    data: DataRecord,
    in_flight: Option<InFlight>,
    /// The host buffers of the last background write, for the next copy.
    spare: (Named, Named),
    /// When the ranks began staging the checkpoint being written (under `dist.shard`): its
    /// time counts from there.
    staging_started: Option<Instant>,
}

impl Checkpointer {
    pub(super) fn new(plan: &RunPlan, data: DataRecord) -> Self {
        let capped_cpu = plan.memory_limit.is_some() && !plan.device.is_cuda();
        Self {
            data,
            root: store::root(&plan.config.out_dir),
            writer: plan.is_writer(),
            rank: plan.rank,
            world: plan.world_size,
            plan: plan.checkpoints,
            background: plan.config.checkpoint.r#async && !capped_cpu,
            last_at: Instant::now(),
            last_seconds: 0.0,
            last_saved: None,
            last_path: None,
            in_flight: None,
            spare: Default::default(),
            staging_started: None,
        }
    }

    pub(super) fn root(&self) -> &Path {
        &self.root
    }

    /// The checkpoint this run resumed from, when it lies under this run's root: a stop before
    /// any step then points at it instead of writing the same step again (a replacement, during
    /// which the step is briefly absent).
    pub(super) fn adopt(&mut self, l: &Loaded) {
        let canonical = |p: &Path| std::fs::canonicalize(p).ok();
        if l.path.parent().and_then(canonical).is_some_and(|p| Some(p) == canonical(&self.root)) {
            self.last_saved = Some(l.state.step);
            self.last_path = Some(l.path.clone());
        }
    }

    /// The checkpoint this run wrote (or resumed from) last, if it holds `completed` steps.
    pub(super) fn last_saved_path(&self, completed: u64) -> Option<PathBuf> {
        (self.last_saved == Some(completed)).then(|| self.last_path.clone()).flatten()
    }

    /// Whether a checkpoint of `completed` steps is due, `since_last` the time since the last
    /// one (under a group, rank 0's, agreed at the step's start: every rank decides alike and
    /// passes the fence after it).
    pub(super) fn due(&self, completed: u64, new_best: bool, since_last: Duration) -> bool {
        self.plan.due(completed, since_last, new_best)
    }

    /// The time since the last checkpoint this process wrote or copied (or since it started).
    pub(super) fn since_last(&self) -> Duration {
        self.last_at.elapsed()
    }

    /// What a stop's checkpoint may cost, for the time-limit margin: a write, after the one in
    /// flight.
    pub(super) fn stop_cost_s(&self) -> f64 {
        let writes = if self.in_flight.is_some() { 2.0 } else { 1.0 };
        1.5 * self.last_seconds * writes
    }

    /// At a step boundary: the outcome of a background write that has ended, reported as a
    /// synchronous one's (a failure is a warning and training goes on), without waiting.
    pub(super) fn poll(&mut self, reporter: &mut Reporter) {
        if self.in_flight.as_ref().is_some_and(InFlight::is_finished) {
            self.wait(WaitFor::NextCheckpoint, reporter);
        }
    }

    /// Waits for the write in flight, if any, and reports it (`checkpoint_waited` when this had
    /// to block). Afterwards every checkpoint this run started is complete or failed.
    pub(super) fn wait(&mut self, before: WaitFor, reporter: &mut Reporter) {
        let Some(flight) = self.in_flight.take() else { return };
        let (step, blocked) = (flight.step, !flight.is_finished());
        let (result, job, waited) = flight.wait();
        if blocked {
            let seconds = waited.as_secs_f64();
            reporter.emit(Event::CheckpointWaited { step, seconds, before: before.name().into() });
        }
        if let Some(job) = job {
            self.spare = (job.weights, job.optimizer);
        }
        // A background checkpoint is one of an interval: after it, training went on.
        self.report(step, result, true, reporter);
    }

    /// Under `dist.shard`, on every rank: this rank's optimizer part of the checkpoint of
    /// `completed` steps staged (rank 0 writes its own into the checkpoint), and every rank's
    /// size and checksum exchanged. Rank 0 gets the other ranks' staged parts, or why one
    /// failed; without sharding, or on the other ranks, None.
    pub(super) fn stage_shards(
        &mut self,
        completed: u64,
        s: &TrainState,
        dist: Option<&crate::distributed::Dist>,
        config: &crate::config::Config,
    ) -> Option<Result<Vec<store::StagedShard>, String>> {
        let (t, d) = (&s.trainable, dist?);
        t.layout.shard.as_ref()?;
        let (rank, world) = (self.rank, self.world);
        self.staging_started = Some(Instant::now());
        // Each rank's [written, size, CRC-32C]: all exact in an f64.
        let mine = if self.writer {
            [1.0, 0.0, 0.0]
        } else {
            let tensors = t.opt.state_tensors(&t.layout.state_names(&t.model.params.names));
            let pause = config.faults.pause_in_checkpoint_write_ms.map(Duration::from_millis);
            match store::stage_shard(&self.root, completed, rank, world, &tensors, pause) {
                Ok(staged) => [1.0, staged.size as f64, f64::from(staged.crc32c)],
                Err(e) => {
                    tracing::warn!("rank {rank}: could not stage its optimizer part: {e}");
                    [0.0, 0.0, 0.0]
                }
            }
        };
        let all = match d.each_rank(&mine) {
            Ok(all) => all,
            Err(e) => return self.writer.then(|| Err(e.to_string())),
        };
        if !self.writer {
            return None;
        }
        let failed: Vec<usize> = (0..world).filter(|&r| all[r][0] != 1.0).collect();
        if !failed.is_empty() {
            return Some(Err(format!(
                "rank(s) {failed:?} could not write their optimizer part (their log says why)"
            )));
        }
        Some(Ok((1..world)
            .map(|r| store::StagedShard {
                path: store::StagedShard::path(&self.root, completed, r, world),
                size: all[r][1] as u64,
                crc32c: all[r][2] as u32,
            })
            .collect()))
    }

    /// Writes a checkpoint of `completed` steps (the run started at `started`), in the
    /// background when `checkpoint.async` and training goes on after it (`goes_on`; not a
    /// stop's, not the last step's), else at once; a failure is reported. Returns the
    /// checkpoint when it is complete on return. `shards`: the other ranks' staged optimizer
    /// parts under `dist.shard` ([`Checkpointer::stage_shards`]), which the write takes in.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn save(
        &mut self,
        completed: u64,
        goes_on: bool,
        s: &TrainState,
        shards: Option<Result<Vec<store::StagedShard>, String>>,
        started: Instant,
        plan: &RunPlan,
        reporter: &mut Reporter,
    ) -> Option<PathBuf> {
        let staging = self.staging_started.take();
        if !self.writer {
            return None;
        }
        let staged = match shards.transpose() {
            Ok(staged) => staged,
            Err(error) => {
                reporter.emit(Event::CheckpointFailed { step: completed, error, training_goes_on: goes_on });
                return None;
            }
        };
        let before = match (goes_on, completed == plan.config.train.max_steps) {
            (true, _) => WaitFor::NextCheckpoint,
            (false, true) => WaitFor::End,
            (false, false) => WaitFor::Stop,
        };
        self.wait(before, reporter);
        let staging_s = staging.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let mut job = self.job(completed, s, started, plan);
        if let Some(staged) = staged {
            job.optimizer_file = store::optimizer_shard_file(self.rank, self.world);
            (job.staged, job.staging_s) = (staged, staging_s);
        }
        if goes_on && self.background {
            let pinned = plan.device.is_cuda().then_some(plan.device);
            let spare = std::mem::take(&mut self.spare);
            let copied = match plan.config.faults.fail_checkpoint_copy {
                true => Err(snapshot::CopyError {
                    tensor: job.weights[0].0.clone(),
                    bytes: snapshot::size_of(&job.weights),
                    why: "injected by faults.fail_checkpoint_copy".into(),
                }),
                false => snapshot::copy(&job.weights, spare.0, pinned)
                    .and_then(|w| Ok((w, snapshot::copy(&job.optimizer, spare.1, pinned)?))),
            };
            match copied {
                Ok((weights, optimizer)) => {
                    (job.weights, job.optimizer) = (weights, optimizer);
                    let parts = (job.optimizer_file.clone(), job.staged.clone(), job.staging_s);
                    match InFlight::start(job) {
                        Ok(flight) => {
                            self.in_flight = Some(flight);
                            self.last_at = Instant::now();
                            return None;
                        }
                        Err(e) => {
                            let why = format!("no writer thread: {e}");
                            reporter.emit(Event::CheckpointWrittenInForeground { step: completed, why });
                            let (file, staged, staging_s) = parts;
                            job = self.job(completed, s, started, plan);
                            (job.optimizer_file, job.staged, job.staging_s) = (file, staged, staging_s);
                        }
                    }
                }
                Err(e) => {
                    reporter
                        .emit(Event::CheckpointWrittenInForeground { step: completed, why: e.to_string() });
                }
            }
        }
        let result = writer::write(&job);
        if result.is_ok() {
            self.last_at = Instant::now();
        }
        self.report(completed, result, goes_on, reporter)
    }

    fn report(
        &mut self,
        step: u64,
        result: Result<Written, CheckpointError>,
        goes_on: bool,
        reporter: &mut Reporter,
    ) -> Option<PathBuf> {
        match result {
            Ok(w) => {
                for why in &w.not_deleted {
                    tracing::warn!("could not remove an old checkpoint: {why}");
                }
                self.last_seconds = w.seconds;
                self.last_saved = Some(w.step);
                self.last_path = Some(w.path.clone());
                reporter.emit(Event::CheckpointSaved {
                    step: w.step,
                    path: w.path.display().to_string(),
                    seconds: w.seconds,
                    deleted: w.deleted,
                });
                Some(w.path)
            }
            Err(e) => {
                reporter.emit(Event::CheckpointFailed {
                    step,
                    error: e.to_string(),
                    training_goes_on: goes_on,
                });
                None
            }
        }
    }

    /// The trainer state and the live tensors of a checkpoint of `completed` steps.
    fn job(&self, completed: u64, s: &TrainState, started: Instant, plan: &RunPlan) -> WriteJob {
        let cfg = &plan.config;
        let (model, opt, guard, progress) = (&s.trainable.model, &s.trainable.opt, &s.guard, &s.progress);
        let scaler = s.trainable.scaler.as_ref();
        let state = TrainerState {
            format: STATE_FORMAT,
            step: completed,
            micro_steps: progress.micro_steps,
            tokens_seen: progress.tokens_seen,
            tokens_by_source: progress.tokens_by_source.clone(),
            sampler: SamplerState {
                seed: cfg.seed,
                next_step: crate::data::skips::data_step(completed, &progress.divergence.skipped),
            },
            world_size: Some(plan.world_size),
            rng: RngState { scheme: RNG_SCHEME.into(), seed: cfg.seed },
            loss_scaler: scaler.map(|s| serde_json::to_value(s).expect("LossScaler serialises")),
            guard: GuardSnapshot {
                micro_batch: guard.micro_batch(),
                accumulation: guard.accumulation(),
                configured_micro_batch: plan.micro_batch,
                escalation_level: guard.state.level(),
                regrow: guard.state.regrow_memory(),
            },
            optimizer: OptimizerSnapshot { kind: opt.kind().into(), steps: opt.steps() },
            best_val_loss: progress.best_val.map(|b| b.0),
            best_val_step: progress.best_val.map(|b| b.1),
            nonfinite_skips: progress.nonfinite_skips,
            nonfinite_streak: progress.nonfinite_streak,
            elapsed_s: progress.elapsed_before + started.elapsed().as_secs_f64(),
            files: Default::default(),
            checksums: Default::default(),
            data: Some(self.data.clone()),
            lineage: progress.lineage.clone(),
            divergence: (progress.divergence != DivergenceRecord::default())
                .then(|| progress.divergence.clone()),
        };
        let weights: Vec<(String, Tensor)> = model
            .params
            .names
            .iter()
            .cloned()
            .zip(model.params.tensors.iter().map(|t| t.shallow_clone()))
            .collect();
        WriteJob {
            root: self.root.clone(),
            state,
            config: cfg.clone(),
            weights,
            optimizer: opt.state_tensors(&s.trainable.layout.state_names(&model.params.names)),
            optimizer_file: store::OPTIMIZER_FILE.into(),
            staged: Vec::new(),
            staging_s: 0.0,
            retention: self.plan.retention,
            keep_step: if self.plan.keep_best { progress.best_val.map(|b| b.1) } else { None },
        }
    }
}
