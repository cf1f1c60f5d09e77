//! A run: everything built from the plan ([`Run::build`]: corpus, run directory, allocator
//! settings and memory cap, model and optimizer, resumed state, data-parallel group), one
//! optimizer step at a time with its stop checks, evaluation, metrics and checkpoint cadence
//! ([`Run::step`]), and the end ([`Run::finish`]: final weights, summary). The step itself is
//! `step::optimizer_step`, the same one `plan --profile` measures.
use super::checkpointer::{Checkpointer, WaitFor};
use super::resume::{corrupt_path, Progress, Resume, Start, TrainState};
use super::run_dir::RunDir;
use super::start::{self, Decision};
use super::watch::MemoryWatch;
use super::TrainError;
use crate::checkpoint::state::DataRecord;
use crate::checkpoint::store;
use crate::data::{Corpus, Sampler, Split};
use crate::distributed::{Dist, DistError};
use crate::events::{Event, Reporter, RunSummary, StepMetrics, StopReason};
use crate::guard::{unrecovered, Guard, GuardError, GuardState};
use crate::job::interrupt::Interrupter;
use crate::memory::summary::table as memory_summary;
use crate::memory::{apply_limit, ProcessMemory};
use crate::run_plan::RunPlan;
use crate::step::{optimizer_step, validation_loss, Faults, LossScaler, StepData, StepFault, Trainable};
use crate::trace::{TraceError, Tracer};
use std::path::Path;
use std::time::{Duration, Instant};

mod rollback;

pub struct Run<'a> {
    plan: &'a RunPlan,
    state: TrainState,
    corpus: Corpus,
    reporter: Reporter,
    ckpt: Checkpointer,
    watch: MemoryWatch,
    faults: Faults,
    dist: Option<&'a mut Dist>,
    started: Instant,
    start_step: u64,
    resumed: bool,
    /// The next step to run.
    step: u64,
    last_loss: f64,
    last_val: Option<f64>,
    /// A slowly forgetting maximum of step times (evaluation apart): the time-limit margin.
    slowest_recent: f64,
    /// Process memory at start-up (CPU runs' summary figures).
    baseline_vm: u64,
    baseline_rss: u64,
    /// `metrics.trace`'s profiler, on the writing rank.
    tracer: Option<Tracer>,
    /// Seconds the last evaluation took: the time limit's margin before a step that evaluates.
    last_eval_s: Option<f64>,
    /// `eval.tasks`, read and encoded at the start (a bad file stops the run before it trains).
    tasks: Vec<crate::eval::Task>,
    /// Seconds the last scoring of the tasks took: the time limit's margin before one.
    last_tasks_s: Option<f64>,
    /// Under a group: the time since rank 0's last checkpoint, as rank 0 read it at this
    /// step's start (the stop agreement carries it), so that every rank takes the same
    /// checkpoint steps and waits for them at the fence.
    since_checkpoint: Option<Duration>,
}

impl<'a> Run<'a> {
    /// Builds what the run needs, resuming from a checkpoint when asked; and the writing rank's
    /// hold on `out_dir`, for the caller to keep until the run's end is recorded. Wiring, in the
    /// order the start goes: what the run reads (its [`Inputs`]), the allocator's settings, where
    /// it starts ([`start::decide`]), the state it starts in, the run directory cleared for it
    /// ([`start::take_the_directory`]), the reporter, the group.
    pub(super) fn build(
        plan: &'a RunPlan,
        resume: &Resume,
        mut dist: Option<&'a mut Dist>,
        notifier: Option<&crate::notify::Notifier>,
    ) -> Result<(Self, Option<RunDir>), TrainError> {
        let (cfg, device) = (&plan.config, plan.device);
        if let Some(n) = cfg.train.threads {
            tch::set_num_threads(n as i32);
        }
        let Inputs { corpus, tasks, document_eos, data } = Inputs::load(plan, dist.as_deref())?;
        let mut ckpt = Checkpointer::new(plan, data.clone());
        // Before the first CUDA allocation (on NCCL the ranks' comparison of their starts is
        // one): allocator options and the CUDA memory cap.
        let allocator = allocator_settings(plan)?;
        let (mut held, mut decision) = start::decide(plan, resume, ckpt.root(), &data, dist.as_deref())?;
        let start_step = decision.step();
        let Started { state, baseline_vm, baseline_rss, deterministic } =
            Started::build(plan, &mut decision, ckpt.root(), document_eos)?;
        let left = start::take_the_directory(held.as_mut(), plan, ckpt.root(), &decision)?;
        let Decision { start: Start { loaded, skipped, restored }, changed, .. } = decision;
        let resumed_at = loaded.as_ref().map(|_| start_step);
        let mut reporter = open_reporter(plan, resumed_at, notifier)?;
        report_what_the_start_found(&mut reporter, start_step, restored, skipped, left);
        warn_of_allocator_settings(&allocator, device);
        if let Some(d) = deterministic {
            reporter.emit(Event::Deterministic(d));
        }
        if let Some(d) = dist.as_deref_mut() {
            join_group(d, plan, &state)?;
        }
        let micro = state.guard.micro_batch();
        let t = &cfg.train;
        reporter.emit(Event::RunStarted {
            device: format!("{device:?}").to_lowercase(),
            params: state.trainable.model.num_params(),
            corpus: corpus.description.clone(),
            unigram_entropy: corpus.val_entropy,
            global_batch_size: t.global_batch_size,
            micro_batch_size: micro,
            configured_micro_batch_size: plan.micro_batch,
            accumulation: crate::data::batch::accumulation(t.global_batch_size, micro, plan.world_size)
                .unwrap_or(plan.accumulation),
            world_size: plan.world_size,
            tokens_per_step: plan.tokens_per_step,
            max_steps: t.max_steps,
            memory_limit_bytes: plan.memory_limit,
            allocator,
        });
        if let Some(l) = &loaded {
            ckpt.adopt(l);
            reporter.emit(Event::Resumed {
                step: start_step,
                path: l.path.display().to_string(),
                changed,
                lineage: state.progress.lineage.clone(),
            });
        }
        let run = Self {
            plan,
            state,
            corpus,
            reporter,
            ckpt,
            watch: MemoryWatch::new(cfg, device),
            faults: Faults::new(&cfg.faults, plan.rank, plan.restart_count),
            dist,
            started: Instant::now(),
            start_step,
            resumed: loaded.is_some(),
            step: start_step,
            last_loss: f64::NAN,
            last_val: None,
            slowest_recent: 0.0,
            baseline_vm,
            baseline_rss,
            last_eval_s: None,
            tasks,
            last_tasks_s: None,
            since_checkpoint: None,
            tracer: Tracer::new(&cfg.metrics.trace, &cfg.out_dir, device, plan.is_writer()),
        };
        Ok((run, held))
    }

    /// A mixture's metrics by source: its validation losses `val` (when evaluation ran) and
    /// every source's tokens so far (those of sources an earlier mixture of this run had too).
    fn by_source(
        &self,
        mut val: std::collections::BTreeMap<String, serde_json::Value>,
    ) -> std::collections::BTreeMap<String, serde_json::Value> {
        for (name, n) in &self.state.progress.tokens_by_source {
            val.insert(format!("tokens_seen/{name}"), serde_json::json!(n));
        }
        val
    }

    /// Whether steps remain before `train.max_steps`.
    pub fn has_next(&self) -> bool {
        self.step < self.plan.config.train.max_steps
    }

    /// Runs the next optimizer step (or stops cleanly before it, with a checkpoint, when a
    /// signal or the time limit asks): the guarded step, the non-finite policy, evaluation on
    /// schedule, the step's metrics, a checkpoint when due.
    pub fn step(&mut self, stop: &Interrupter) -> Result<(), TrainError> {
        let (plan, step) = (self.plan, self.step);
        let t = &plan.config.train;
        match self.faults.before_step(step) {
            Some(StepFault::Interrupt) => stop.request(),
            Some(StepFault::Crash) => return Err(TrainError::InjectedCrash { step }),
            None => {}
        }
        // The step boundary: a background checkpoint that has ended is reported here, a failure
        // as a synchronous one's.
        self.ckpt.poll(&mut self.reporter);
        let (stop_now, since_checkpoint) = self.stop_reason(stop)?;
        self.since_checkpoint = since_checkpoint;
        if let Some(reason) = stop_now {
            let path = self.stop_checkpointed(step, reason);
            if path.is_none() && plan.is_writer() {
                // Exit 4 promises a checkpoint at this step: say what a requeue would get instead.
                let newest = store::list(self.ckpt.root()).pop();
                return Err(TrainError::StopNotCheckpointed { step, reason, newest });
            }
            return Err(TrainError::Interrupted { step, reason, checkpoint: path });
        }
        let traced_range = self.trace(|t| t.before_step(step)).flatten();
        let step_started = Instant::now();
        // The divergence guard's skipped data: this step draws the next data step past them.
        let skipped = self.state.progress.divergence.skipped.clone();
        let data = step_data(&self.corpus, plan, &skipped);
        let data_step = data.data_step(step);
        let lr = plan.schedule.at(step)
            * crate::divergence::lr_factor(&plan.config.divergence, &self.state.progress.divergence, step)
            * self.faults.lr_multiplier(data_step);
        if let Err(e) = data.sampler.check_train_step(&self.corpus, data_step, t.global_batch_size) {
            // The steps since the last checkpoint are kept: with the data mended, `--resume auto`
            // goes on from here (a changed model.vocab_size is another model: a fresh start).
            self.stop_checkpointed(step, StopReason::BadData);
            return Err(e.into());
        }
        let outcome = optimizer_step(
            &mut self.state.trainable,
            &mut self.state.guard,
            &plan.step,
            &data,
            step,
            lr,
            self.dist.as_deref_mut(),
            &mut self.faults,
            &mut self.reporter,
        );
        let outcome = match outcome {
            Ok(o) => o,
            Err(e @ GuardError::OutOfMemory(_)) => {
                tracing::warn!("{}", memory_summary(plan.device));
                // The failed step changed nothing: the model is still the last good state.
                self.stop_checkpointed(step, StopReason::OutOfMemory);
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        // Counters read back from a checkpoint's trainer_state.json (which no checksum covers):
        // one edited near u64::MAX stays there instead of wrapping to a small count.
        let progress = &mut self.state.progress;
        progress.micro_steps = progress.micro_steps.saturating_add(self.state.guard.accumulation() as u64);
        progress.tokens_seen = progress.tokens_seen.saturating_add(plan.tokens_per_step as u64);
        for (name, n) in data.sampler.tokens_by_source(&self.corpus, step, t.global_batch_size) {
            let seen = progress.tokens_by_source.entry(name).or_default();
            *seen = seen.saturating_add(n);
        }
        // Too many non-finite updates in a row: this step still gets its metrics line (the
        // checkpoint written below counts it), then the run stops.
        let mut give_up = false;
        if outcome.skipped_as_nonfinite() {
            let progress = &mut self.state.progress;
            progress.nonfinite_streak = progress.nonfinite_streak.saturating_add(1);
            progress.nonfinite_skips = progress.nonfinite_skips.saturating_add(1);
            let consecutive = progress.nonfinite_streak;
            self.reporter.emit(Event::NonfiniteSkipped {
                step,
                loss: outcome.loss,
                grad_norm: outcome.grad_norm,
                consecutive,
            });
            give_up = consecutive >= plan.config.nan.max_consecutive;
        } else {
            self.state.progress.nonfinite_streak = 0;
        }
        let (divergence, dist) = (&plan.config.divergence, self.dist.as_deref());
        if let Some(spike) = rollback::judge(divergence, &mut self.state.progress, &outcome, give_up, dist)? {
            // Nothing of this step is kept: no metrics line, no evaluation, no checkpoint.
            drop(traced_range);
            return self.on_divergence(step, data_step, spike);
        }
        // Throughput counts the optimizer step only, not evaluation.
        let step_time = step_started.elapsed().as_secs_f64();
        let mut new_best = false;
        // An out-of-memory evaluation could not recover from: the step's update is applied, so
        // the run stops below with that step checkpointed and its metrics line written.
        let mut eval_oom = None;
        let mut val_by_source = std::collections::BTreeMap::new();
        let val_loss = if plan.evaluates_after(step + 1) && !give_up {
            // Validation's activations would sit beside the graphs' pool: the next step
            // captures them again.
            self.state.trainable.graphs.release();
            let eval_started = Instant::now();
            let mut v = validation_loss(
                &self.state.trainable.model,
                &mut self.state.guard,
                &plan.step,
                &data,
                t.eval_batches,
                step,
                self.dist.as_deref(),
                &mut self.reporter,
            );
            // A mixture's sources, each on its own validation split, after the overall figure
            // (which draws its windows by weight, as training does).
            if let (Ok(_), Some(m)) = (&v, &self.corpus.mixture) {
                for (name, source) in m.names.iter().zip(&m.sources) {
                    let one = validation_loss(
                        &self.state.trainable.model,
                        &mut self.state.guard,
                        &plan.step,
                        &step_data(source, plan, &[]),
                        t.eval_batches,
                        step,
                        self.dist.as_deref(),
                        &mut self.reporter,
                    );
                    match one {
                        Ok(l) => {
                            val_by_source.insert(format!("val_loss/{name}"), serde_json::json!(l));
                        }
                        Err(e) => {
                            v = Err(e);
                            break;
                        }
                    }
                }
            }
            self.last_eval_s = Some(eval_started.elapsed().as_secs_f64());
            match v {
                Ok(v) => {
                    let best = &mut self.state.progress.best_val;
                    // A non-finite loss is no best (it was kept as one, and its checkpoint with it).
                    if v.is_finite() && best.is_none_or(|(b, _)| v < b) {
                        *best = Some((v, step + 1));
                        new_best = true;
                    }
                    self.last_val = Some(v);
                    Some(v)
                }
                Err(e @ GuardError::OutOfMemory(_)) => {
                    tracing::warn!("{}", memory_summary(plan.device));
                    eval_oom = Some(e);
                    None
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            None
        };
        let downstream = match plan.scores_tasks_after(step + 1) && !give_up && eval_oom.is_none() {
            true => self.score_tasks()?,
            false => Default::default(),
        };
        self.last_loss = outcome.loss;
        self.slowest_recent = step_time.max(self.slowest_recent * 0.95);
        let tokens = plan.tokens_per_step as u64;
        let memory = self.watch.after_step(step, &mut self.state.guard.state, &mut self.reporter);
        self.state
            .guard
            .held_between_steps(step + 1, crate::memory::telemetry::Telemetry::leak_figure(&memory));
        self.reporter.emit(Event::Step(StepMetrics {
            step,
            loss: outcome.loss,
            lr,
            grad_norm: outcome.grad_norm,
            val_loss,
            micro_batch: self.state.guard.micro_batch(),
            accumulation: self.state.guard.accumulation(),
            tokens,
            tokens_per_s: tokens as f64 / step_time,
            step_time_s: step_time,
            elapsed_s: self.state.progress.elapsed_before + self.started.elapsed().as_secs_f64(),
            memory,
            downstream,
            by_source: self.by_source(val_by_source),
        }));
        drop(traced_range);
        if let Some(e) = eval_oom {
            self.stop_checkpointed(step + 1, StopReason::OutOfMemory);
            return Err(e.into());
        }
        if give_up {
            let path = self.save(step + 1, false);
            self.reporter.emit(Event::Stopped {
                step: step + 1,
                reason: StopReason::Nonfinite,
                checkpoint: path.map(|p| p.display().to_string()),
            });
            return Err(TrainError::NonFinite {
                step: step + 1,
                count: self.state.progress.nonfinite_streak,
            });
        }
        if let Some(summary) = self.trace(|t| t.after_step(step)).flatten() {
            self.reporter.emit(Event::TraceWritten(summary));
        }
        self.step += 1;
        let since_checkpoint = self.since_checkpoint.unwrap_or_else(|| self.ckpt.since_last());
        if self.ckpt.due(self.step, new_best, since_checkpoint)
            || (self.step == t.max_steps && plan.config.checkpoint.at_end)
        {
            self.save(self.step, self.step < t.max_steps);
            self.after_writer()?;
        }
        Ok(())
    }

    /// `eval.tasks` scored on the current weights (each rank its share of the examples, the
    /// counts summed), under the training precision's autocast as validation is: the metrics
    /// fields.
    fn score_tasks(&mut self) -> Result<std::collections::BTreeMap<String, f64>, TrainError> {
        let plan = self.plan;
        self.state.trainable.graphs.release();
        let started = Instant::now();
        let autocast = crate::step::Autocast::enter(plan.config.precision, plan.device)
            .map_err(crate::eval::EvalError::Autocast)?;
        let mut results = Vec::with_capacity(self.tasks.len());
        for task in &self.tasks {
            let model = &self.state.trainable.model;
            let seq_len = plan.config.model.seq_len;
            results.push(crate::eval::run_task(
                model,
                task,
                seq_len,
                plan.device,
                self.dist.as_deref(),
                &mut |_| Ok(()),
            )?);
        }
        drop(autocast);
        self.last_tasks_s = Some(started.elapsed().as_secs_f64());
        Ok(crate::eval::metrics(&results))
    }

    /// `f` on the tracer, if any. The trace is a diagnosis: when the profiler fails the run goes
    /// on without it, and says so.
    fn trace<T>(&mut self, f: impl FnOnce(&mut Tracer) -> Result<T, TraceError>) -> Option<T> {
        let result = f(self.tracer.as_mut()?);
        result
            .map_err(|e| {
                tracing::warn!("{e}; training goes on without the trace");
                self.tracer = None;
            })
            .ok()
    }

    /// Why to stop before the next step, if anything says so; every rank agrees on it. Under a
    /// group, also the time since rank 0's last checkpoint, which decides time-based ones.
    fn stop_reason(&self, stop: &Interrupter) -> Result<(Option<StopReason>, Option<Duration>), TrainError> {
        // The next step, its evaluation when one follows it (the first one guessed as a third
        // of a step's time per evaluation batch: a forward over a global batch), a checkpoint.
        let eval = match self.plan.evaluates_after(self.step + 1) {
            true => self
                .last_eval_s
                .unwrap_or(self.slowest_recent * self.plan.config.train.eval_batches as f64 / 3.0),
            false => 0.0,
        };
        let tasks = match self.plan.scores_tasks_after(self.step + 1) {
            // The first scoring guessed as long as an evaluation.
            true => self
                .last_tasks_s
                .unwrap_or(self.slowest_recent * self.plan.config.train.eval_batches as f64 / 3.0),
            false => 0.0,
        };
        let margin =
            Duration::from_secs_f64(self.slowest_recent + eval + tasks + self.ckpt.stop_cost_s() + 1.0);
        let mut reason = if stop.requested() {
            Some(StopReason::Signal)
        } else {
            let elapsed = crate::job::deadline::process_start().elapsed();
            self.plan.time_limit.filter(|limit| elapsed + margin > *limit).map(|_| StopReason::TimeLimit)
        };
        // All ranks stop at the same step, or the others would wait in a collective; and every
        // rank names the same reason (a signal before a time limit), whichever rank saw it.
        let Some(d) = self.dist.as_deref() else { return Ok((reason, None)) };
        let code = |r: Option<StopReason>| match r {
            Some(StopReason::Signal) => 2.0,
            Some(_) => 1.0,
            None => 0.0,
        };
        let rank0_since = if d.rank == 0 { self.ckpt.since_last().as_secs_f64() } else { 0.0 };
        let agreed = d.max_each(&[code(reason), rank0_since])?;
        reason = match agreed[0] {
            c if c >= 2.0 => Some(StopReason::Signal),
            c if c >= 1.0 => Some(StopReason::TimeLimit),
            _ => None,
        };
        Ok((reason, Some(Duration::from_secs_f64(agreed[1].max(0.0)))))
    }

    /// Every rank waits for rank 0's writing alone, for as long as rank 0 lives rather than
    /// `dist.timeout_s` (or `dist.writer_wait_s` at most): a checkpoint slower than that on
    /// rank 0's storage would otherwise end the job in the next collective.
    fn after_writer(&mut self) -> Result<(), TrainError> {
        let writer_wait = self.plan.config.dist.writer_wait_s.map(std::time::Duration::from_secs);
        match self.dist.as_deref_mut() {
            Some(d) => d.after_writer(writer_wait).map_err(TrainError::from),
            None => Ok(()),
        }
    }

    fn save(&mut self, completed: u64, goes_on: bool) -> Option<std::path::PathBuf> {
        crate::memory::uncapped(|| {
            let shards =
                self.ckpt.stage_shards(completed, &self.state, self.dist.as_deref(), &self.plan.config);
            self.ckpt.save(
                completed,
                goes_on,
                &self.state,
                shards,
                self.started,
                self.plan,
                &mut self.reporter,
            )
        })
    }

    /// Waits for the checkpoint being written in the background, if any, and returns the step of
    /// the newest complete checkpoint of this run (written or resumed from; None when there is
    /// none), the same on every rank: under a group every rank calls it at the same step, rank 0
    /// waits for its writer, the others at the fence, and rank 0's answer is agreed. For a
    /// rollback to the last checkpoint on disk.
    pub fn wait_for_checkpoint(&mut self) -> Result<Option<u64>, TrainError> {
        self.ckpt.wait(WaitFor::Rollback, &mut self.reporter);
        self.after_writer()?;
        let mine = self.ckpt.last_saved;
        let Some(d) = self.dist.as_deref() else { return Ok(mine) };
        // Step + 1, so that "none" (0) is below every step; only rank 0 writes.
        let rank0 = if d.rank == 0 { mine.map_or(0.0, |s| (s + 1) as f64) } else { 0.0 };
        let agreed = d.max_each(&[rank0])?[0] as u64;
        Ok(agreed.checked_sub(1))
    }

    /// After a step failed: the background write in flight ends and is reported before the
    /// error does (a checkpoint copied before the failure is as good as a synchronous one).
    pub(super) fn settle_checkpoint(&mut self) {
        self.ckpt.wait(WaitFor::Stop, &mut self.reporter);
    }

    /// A collective that failed because a peer ended on a second signal (it said so in the
    /// store first) is that planned stop here too, from the newest complete checkpoint: under
    /// torchrun this rank then exits 0 like the peer, and the group the person stopped is not
    /// restarted. Without a checkpoint yet, the failure stands.
    pub(super) fn peer_stopped(&self, e: TrainError) -> TrainError {
        let collective = match &e {
            TrainError::Dist(d) => matches!(d, DistError::Collective { .. }),
            TrainError::Guard(GuardError::Fatal(inner)) => {
                matches!(inner.downcast_ref::<DistError>(), Some(DistError::Collective { .. }))
            }
            _ => false,
        };
        let Some(d) = self.dist.as_deref().filter(|_| collective) else { return e };
        let stopped = d.peers_stopped_by_signal();
        let newest = store::list(self.ckpt.root()).pop();
        match (stopped.is_empty(), newest) {
            (false, Some((step, path))) => {
                tracing::warn!("rank(s) {stopped:?} ended on a second signal: stopping too, from the newest checkpoint (step {step})");
                TrainError::Interrupted { step, reason: StopReason::Signal, checkpoint: Some(path) }
            }
            _ => e,
        }
    }

    /// A stop for `reason` with `completed` steps done: their checkpoint ([`save_for_stop`]) and
    /// the `stopped` event naming it.
    ///
    /// [`save_for_stop`]: Self::save_for_stop
    fn stop_checkpointed(&mut self, completed: u64, reason: StopReason) -> Option<std::path::PathBuf> {
        let path = self.save_for_stop(completed);
        self.reporter.emit(Event::Stopped {
            step: completed,
            reason,
            checkpoint: path.as_ref().map(|p| p.display().to_string()),
        });
        path
    }

    /// A checkpoint of `completed` steps for a stop: the one just written on schedule when it
    /// already holds this step (a stop right after an interval checkpoint writes nothing twice).
    fn save_for_stop(&mut self, completed: u64) -> Option<std::path::PathBuf> {
        // A stop waits for the background write first: it may be this very step's.
        self.ckpt.wait(WaitFor::Stop, &mut self.reporter);
        match self.ckpt.last_saved_path(completed) {
            Some(path) => Some(path),
            None => self.save(completed, false),
        }
    }

    /// After the last step: ranks compared, final weights written, the summary.
    pub fn finish(mut self) -> Result<RunSummary, TrainError> {
        let (plan, step) = (self.plan, self.step);
        let t = &plan.config.train;
        if step == self.start_step && self.resumed {
            // Resumed at or past max_steps: the newest checkpoint already holds this state.
            tracing::info!(
                "nothing to do: the checkpoint is at step {step}, train.max_steps is {}",
                t.max_steps
            );
        }
        self.ckpt.wait(WaitFor::End, &mut self.reporter);
        let elapsed = self.started.elapsed().as_secs_f64();
        // The weights first: a comparison that fails (a peer gone, memory short) loses nothing.
        if plan.is_writer() && plan.config.checkpoint.at_end {
            crate::memory::uncapped(|| {
                crate::checkpoint::save_weights(&plan.config.out_dir, &self.state.trainable.model.params)
            })?;
        }
        if plan.config.checkpoint.at_end {
            self.after_writer()?;
        }
        if let Some(d) = self.dist.as_deref() {
            let spread = d.weight_spread(self.state.trainable.params())?;
            self.reporter.emit(Event::RanksCompared { world_size: d.world_size, checksum_spread: spread });
        }
        let steps_run = step - self.start_step;
        let guard = &self.state.guard;
        let cpu = !plan.device.is_cuda();
        let summary = RunSummary {
            steps: step,
            final_loss: self.last_loss,
            final_val_loss: self.last_val,
            oom_recoveries: guard.totals.recoveries,
            oom_escalations: guard.totals.escalations,
            configured_micro_batch: plan.micro_batch,
            final_micro_batch: guard.micro_batch(),
            time_lost_s: guard.totals.time_lost.as_secs_f64(),
            guard_overhead_s: guard.totals.bookkeeping.as_secs_f64(),
            elapsed_s: self.state.progress.elapsed_before + elapsed,
            tokens_per_s: self.state.progress.tokens_seen as f64
                / (self.state.progress.elapsed_before + elapsed),
            session_steps: steps_run,
            session_elapsed_s: elapsed,
            peak_mapped_above_start_bytes: cpu
                .then(|| ProcessMemory::read().map(|p| p.vm_peak_bytes.saturating_sub(self.baseline_vm)))
                .flatten(),
            peak_resident_above_start_bytes: cpu
                .then(|| ProcessMemory::read().map(|p| p.rss_peak_bytes.saturating_sub(self.baseline_rss)))
                .flatten(),
        };
        tracing::info!("{}", memory_summary(plan.device));
        self.reporter.emit(Event::RunFinished(summary.clone()));
        Ok(summary)
    }
}

/// What the run reads before it decides where it starts: the corpus (the ranks compare theirs
/// and their configs first of all), `eval.tasks` encoded, where documents end
/// (`data.document_mask`) and the data as checkpoints record it.
struct Inputs {
    corpus: Corpus,
    tasks: Vec<crate::eval::Task>,
    document_eos: Option<u32>,
    data: DataRecord,
}

impl Inputs {
    fn load(plan: &RunPlan, dist: Option<&Dist>) -> Result<Self, TrainError> {
        let cfg = &plan.config;
        let corpus =
            Corpus::load(&cfg.data, cfg.model.vocab_size, cfg.model.seq_len, cfg.train.eval_interval > 0);
        if let Some(d) = dist {
            // First of all collectives: a rank whose config differs would meet its peers in
            // other ones, or train something else.
            crate::distributed::ranks::check_same_start(d, cfg, corpus.as_ref().ok())
                .map_err(TrainError::from_start)?;
        }
        let corpus = corpus?;
        let tasks = crate::eval::tasks_of(cfg)?;
        let document_eos =
            crate::model::documents::run_eos(&cfg.data, corpus.manifest.as_ref().map(|m| m.eos_id))?;
        let data = data_record(cfg, &corpus);
        Ok(Self { corpus, tasks, document_eos, data })
    }
}

/// The allocator's options and the CUDA memory cap (`memory.limit` as a share of the device),
/// set before the first CUDA allocation.
fn allocator_settings(plan: &RunPlan) -> Result<crate::memory::allocator::EffectiveSettings, TrainError> {
    let fraction = crate::memory::limit_fraction(plan.memory_limit, plan.device)?;
    Ok(crate::memory::allocator::configure(&plan.config.memory.allocator, fraction, plan.device.is_cuda())?)
}

/// The state the run starts in, and the memory it started with.
struct Started {
    state: TrainState,
    /// Process memory at start-up (CPU runs' summary figures), the checkpoint read not counted.
    baseline_vm: u64,
    baseline_rss: u64,
    deterministic: Option<crate::determinism::Determinism>,
}

impl Started {
    /// The model and optimizer, and the state resumed into them (or `init_from`'s weights), are
    /// built before the run directory is touched: a checkpoint refused only here (its optimizer
    /// state of another shape) leaves the run it was refused over as it was. The memory cap goes
    /// on first, after the corpus is loaded: it counts what training allocates. The loaded
    /// checkpoint's tensors are let go once copied.
    fn build(
        plan: &RunPlan,
        decision: &mut Decision,
        root: &Path,
        document_eos: Option<u32>,
    ) -> Result<Self, TrainError> {
        let (cfg, device) = (&plan.config, plan.device);
        let mut baseline_vm = match plan.memory_limit {
            Some(limit) => apply_limit(limit, device)?.baseline_bytes,
            None => ProcessMemory::read().map_or(0, |p| p.vm_bytes),
        };
        let baseline_rss = ProcessMemory::read().map_or(0, |p| p.rss_bytes);
        let deterministic = if cfg.deterministic { Some(crate::determinism::enable()?) } else { None };
        let recording =
            crate::memory::oom_snapshot::start(cfg.memory.snapshot_on_oom, device, plan.is_writer());
        let mut state = fresh_state(plan, recording)?;
        if let Some(eos) = document_eos {
            state.trainable.model.mask_documents(eos);
            say_how_documents_are_masked(plan, eos);
        }
        let loaded = &mut decision.start.loaded;
        match (loaded.as_ref(), &cfg.init_from) {
            (Some(l), _) => state.restore(l, root)?,
            (None, Some(dir)) => {
                crate::hf::init_from(&state.trainable.model, dir)?;
                let t = &state.trainable;
                t.layout
                    .refresh_host(&t.model)
                    .map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
            }
            (None, None) => {}
        }
        if let Some(l) = loaded.as_mut() {
            // Its tensors are copied into the model and optimizer: what they held goes back, and
            // the CPU cap no longer counts them as start-up memory.
            (l.weights, l.optimizer) = (Vec::new(), Vec::new());
            baseline_vm = baseline_vm.saturating_sub(decision.reading);
            if let (Some(limit), tch::Device::Cpu) = (plan.memory_limit, device) {
                crate::memory::rebase_cpu_limit(baseline_vm, limit)?;
            }
        }
        Ok(Self { state, baseline_vm, baseline_rss, deterministic })
    }
}

/// The log's word on `data.document_mask`: where documents end, and which attention path runs
/// (a fused RoPE node that cannot take positions inside documents is left out, and said so).
fn say_how_documents_are_masked(plan: &RunPlan, eos: u32) {
    let cfg = &plan.config;
    let path = match plan.device.is_cuda() {
        true => "variable-length fused attention (no t × t mask)",
        false => "a block-diagonal causal mask",
    };
    tracing::info!("data.document_mask: documents end at token id {eos}; attention within each through {path}, positions restarting per document");
    if cfg.model.arch == crate::config::Arch::Llama && cfg.kernels.fused_rope && plan.device.is_cuda() {
        tracing::info!("data.document_mask: RoPE rotates by position inside the document through ATen's ops (kernels.fused_rope's node rotates by position in the window only)");
    }
}

/// The model, optimizer, loss scaler and OOM guard as a fresh run starts them (a resume then
/// restores its checkpoint into them).
fn fresh_state(plan: &RunPlan, recording: bool) -> Result<TrainState, TrainError> {
    let (cfg, t, device) = (&plan.config, &plan.config.train, plan.device);
    let scaler = LossScaler::new(t.loss_scale_initial, t.loss_scale_growth_interval);
    crate::step::precision::configure_process(cfg.precision, device);
    let trainable = Trainable::build(
        &cfg.model,
        cfg.kernels,
        &plan.optimizer,
        plan.layout,
        cfg.precision,
        scaler,
        cfg.seed,
        device,
    )
    .map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
    let guard = Guard::new(
        GuardState::new(plan.micro_batch, cfg.oom.min_micro_batch, cfg.oom.regrow_after_steps),
        cfg.oom.policy,
        device,
        plan.rank_batch,
    )
    .with_escalation(cfg.oom.escalate.clone())
    .data_parallel(plan.world_size > 1)
    .with_oom_snapshot(cfg.memory.snapshot_on_oom && plan.is_writer(), recording, cfg.out_dir.clone());
    Ok(TrainState { trainable, guard, progress: Progress::default() })
}

/// Every rank starts from rank 0's weights (equal anyway: init and checkpoints are
/// deterministic), and gradients are averaged in buckets laid out once.
fn join_group(d: &mut Dist, plan: &RunPlan, state: &TrainState) -> Result<(), TrainError> {
    let (cfg, device) = (&plan.config, plan.device);
    let t = &state.trainable;
    let params = t.params();
    let unrecovered = |e| unrecovered(e, None, plan.micro_batch, device);
    d.broadcast_params(params)?;
    t.layout.refresh_host(&t.model).map_err(unrecovered)?;
    // Under dist.overlap the gradients of a block's parameters leave from inside backward
    // (made once there; the embeddings' and head's are not): all-reduced in buckets, or under
    // `dist.shard: gradients` reduced into their owners. Not where a rank runs under a CPU cap:
    // Gloo allocates each collective's scratch on its own thread, and one that met the cap
    // inside backward could not be replayed; after backward the room for the all-reduce is
    // checked before the agreement (Dist::check_room_to_all_reduce). The cap is each rank's
    // own: the ranks agree.
    let capped = match cfg.dist.overlap {
        true => d.flagged_ranks(plan.memory_limit.is_some() && !device.is_cuda())?,
        false => Vec::new(),
    };
    if !capped.is_empty() && d.rank == 0 {
        tracing::info!("dist.overlap: rank(s) {capped:?} run under memory.limit on the CPU: the gradients' collectives wait for the end of backward (the room for Gloo's scratch is then checked before the ranks agree)");
    }
    let hooked = (cfg.dist.overlap && capped.is_empty()).then(|| t.model.block_params());
    match (&t.layout.shard, t.layout.shards_gradients()) {
        // Reduce-scattered in pieces made per step, or reduced from inside backward: no buckets.
        (Some(s), Some(_)) => {
            if let (Some(hooked), None) = (&hooked, &t.layout.params) {
                if !d.reduce_into_owners_in_backward(params, hooked, s, device).map_err(unrecovered)?
                    && d.rank == 0
                {
                    tracing::info!("dist.overlap: bf16-pure gradients are reduce-scattered after backward, through fp32 pieces (summed in bf16 they would round at every rank's addition)");
                }
            }
            tracing::info!(
                "rank {} of {}: dist.shard {}: owns {} of {} parameters ({} elements; the largest share is {:.2}x an even one)",
                d.rank,
                d.world_size,
                s.level.name(),
                s.owned.len(),
                params.len(),
                s.ownership.elements(d.rank),
                s.ownership.imbalance()
            )
        }
        _ => {
            let bytes = (cfg.dist.bucket_mb * (1 << 20) as f64) as usize;
            d.plan_buckets(params, bytes, device, hooked.as_deref()).map_err(unrecovered)?;
            tracing::info!(
                "rank {} of {}: gradients averaged in {} bucket(s){}",
                d.rank,
                d.world_size,
                d.bucket_count(),
                t.layout.shard.as_ref().map_or(String::new(), |s| format!(
                    "; dist.shard optimizer: owns the state of {} of {} parameters",
                    s.owned.len(),
                    params.len()
                ))
            );
        }
    }
    Ok(())
}

/// The run's reporter: log lines on every rank, the run files on the writing one (appended to
/// from the step resumed at), TensorBoard's when asked, and the writing rank's notifier.
fn open_reporter(
    plan: &RunPlan,
    resumed_at: Option<u64>,
    notifier: Option<&crate::notify::Notifier>,
) -> Result<Reporter, TrainError> {
    let (cfg, t) = (&plan.config, &plan.config.train);
    let run_dir = plan.is_writer().then_some(cfg.out_dir.as_path());
    let file_error = |e: crate::events::SinkError| TrainError::RunDirFile { file: e.path, source: e.source };
    let mut reporter = Reporter::new(run_dir, t.log_interval, t.max_steps, resumed_at).map_err(file_error)?;
    if let (Some(dir), true) = (run_dir, cfg.metrics.tensorboard) {
        let yaml = serde_yaml::to_string(cfg).expect("a Config always serialises");
        reporter
            .enable_tensorboard(&dir.join(crate::fs::run_files::TENSORBOARD), &yaml)
            .map_err(file_error)?;
    }
    if let (Some(_), Some(n)) = (run_dir, notifier) {
        reporter.subscribe(Box::new(n.clone()));
    }
    Ok(reporter)
}

/// What the start found in `out_dir` and did about it: checkpoints put back or passed over as
/// broken, a line of checkpoints and final weights moved out of the way (nothing deleted).
fn report_what_the_start_found(
    reporter: &mut Reporter,
    start_step: u64,
    restored: Vec<u64>,
    skipped: Vec<crate::checkpoint::CheckpointError>,
    left: super::resume::LeftBehind,
) {
    for step in restored {
        reporter.emit(Event::CheckpointPutBack { step });
    }
    for e in skipped {
        reporter.emit(Event::CheckpointSkipped { path: corrupt_path(&e), reason: e.to_string() });
    }
    if let Some((dir, steps)) = left.checkpoints {
        let to = dir.display().to_string();
        reporter.emit(Event::CheckpointsSetAside { resumed_step: start_step, steps, to });
    }
    if let Some(to) = left.final_weights {
        reporter.emit(Event::FinalWeightsSetAside { resumed_step: start_step, to: to.display().to_string() });
    }
}

/// The allocator's warnings once the run's log is open: CUDA's only (a CPU run does not use the
/// settings, and their advice, "set memory.limit" for one, would not help).
fn warn_of_allocator_settings(allocator: &crate::memory::allocator::EffectiveSettings, device: tch::Device) {
    for w in allocator.warnings(false).into_iter().filter(|_| device.is_cuda()) {
        tracing::warn!("{w}");
    }
    for o in &allocator.overridden {
        let source = allocator.env_var.unwrap_or("the environment's allocator settings");
        tracing::warn!("{source} overridden by the config: {o}");
    }
    if !allocator.defaulted.is_empty() {
        tracing::info!(
            "allocator: {} by default on CUDA (memory.allocator.expandable_segments: false turns it off)",
            allocator.defaulted.join(",")
        );
    }
}

/// What the run trains on, as its checkpoints record it.
fn data_record(cfg: &crate::config::Config, corpus: &Corpus) -> DataRecord {
    let primary = cfg.data.primary_source();
    let manifest = match &corpus.mixture {
        None => corpus.manifest.as_ref(),
        Some(m) => cfg
            .data
            .sources
            .iter()
            .zip(&m.sources)
            .find(|(s, _)| s.source == primary)
            .and_then(|(_, c)| c.manifest.as_ref()),
    };
    let prepared = primary.strip_prefix("tokens:").zip(manifest);
    DataRecord {
        source: primary.to_string(),
        tokenizer_crc32c: prepared
            .and_then(|(dir, m)| crate::data::shards::tokenizer_checksum(std::path::Path::new(dir), m)),
        train_tokens: corpus.len(Split::Train) as u64,
        train_digest: corpus.sample_digest(Split::Train),
    }
}

/// Where this rank's samples come from, past the data steps the divergence guard skipped.
fn step_data<'c>(
    corpus: &'c Corpus,
    plan: &RunPlan,
    skipped: &'c [crate::data::skips::SkippedWindow],
) -> StepData<'c> {
    StepData {
        corpus,
        sampler: Sampler { seed: plan.config.seed, seq_len: plan.config.model.seq_len },
        device: plan.device,
        rank_start: plan.rank_start,
        rank_batch: plan.rank_batch,
        global_batch: plan.config.train.global_batch_size,
        world: plan.world_size,
        skipped,
    }
}
