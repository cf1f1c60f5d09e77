//! The loop: build what a run needs from its plan (resuming from a checkpoint when asked), then
//! for each optimizer step run the guarded step (gradients → clip → non-finite check → update),
//! evaluate and checkpoint on schedule, stop cleanly on a signal or time limit, and report.
use super::agree;
use super::precision::{Autocast, LossScaler, ScaleChange};
use super::resume::{check_compatible, corrupt_path, resolve_resume, restore, Checkpointer};
use super::savers::Savers;
use super::step::{evaluate, forward_backward, StepData};
use super::watch::MemoryWatch;
use crate::checkpoint::retention::Retention;
use crate::checkpoint::{store, CheckpointError};
use crate::config::{parse_duration, Precision};
use crate::data::{Corpus, DataError, Sampler, Split};
use crate::dist::Dist;
use crate::events::{Event, Reporter, RunSummary, StepMetrics};
use crate::guard::{unrecovered, Guard, GuardError, GuardState, OomFailure, StepError};
use crate::interrupt::Interrupter;
use crate::memory::summary::table as memory_summary;
use crate::memory::{apply_limit, LimitError, ProcessMemory};
use crate::model::Gpt;
use crate::optim::{clip_grad_norm, LrSchedule, Optimizer, OptimizerSpec};
use crate::plan::RunPlan;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where a run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// From step 0.
    Fresh,
    /// From the newest complete checkpoint in `out_dir`, else from step 0.
    Auto,
    /// From this checkpoint directory; failing to load it is an error.
    Path(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Guard(#[from] GuardError),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error(transparent)]
    Allocator(#[from] crate::memory::allocator::AllocatorError),
    #[error(transparent)]
    Save(#[from] crate::checkpoint::SaveError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    #[error("init_from: {0}")]
    InitFrom(#[from] crate::hf::HfError),
    #[error("injected failure at step {step} (faults.crash_at_step)")]
    InjectedCrash { step: u64 },
    #[error("cannot write run directory {path}: {source}")]
    RunDir { path: PathBuf, source: std::io::Error },
    #[error("stopped at step {step} ({reason}); `--resume auto` continues from {}", .checkpoint.as_ref().map_or("the last complete checkpoint".to_string(), |c| c.display().to_string()))]
    Interrupted { step: u64, reason: String, checkpoint: Option<PathBuf> },
    #[error("{count} updates in a row had a non-finite loss or gradient norm (last at step {step}); stopped with the last good state checkpointed. Lower train.lr, check the data, or raise nan.max_consecutive")]
    NonFinite { step: u64, count: u64 },
}

impl TrainError {
    /// The out-of-memory the run could not recover from, if that is what ended it.
    pub fn oom(&self) -> Option<&OomFailure> {
        match self {
            TrainError::Guard(GuardError::OutOfMemory(f)) => Some(f),
            _ => None,
        }
    }
}

/// What one guarded step produced.
struct StepOutcome {
    loss: f64,
    grad_norm: f64,
    applied: bool,
    /// fp16: the scaled gradients overflowed (the scaler handles it; not a bad batch).
    overflow: bool,
}

/// Counters that go into `trainer_state.json`.
#[derive(Debug, Clone, Default)]
pub(super) struct Progress {
    pub(super) micro_steps: u64,
    pub(super) best_val: Option<(f64, u64)>,
    pub(super) nonfinite_skips: u64,
    pub(super) elapsed_before: f64,
}

pub fn train(plan: &RunPlan, resume: &Resume, stop: &Interrupter, mut dist: Option<&mut Dist>) -> Result<RunSummary, TrainError> {
    let cfg = &plan.config;
    let t = &cfg.train;
    let device = plan.device;
    if let Some(n) = t.threads {
        tch::set_num_threads(n as i32);
    }
    let corpus = Corpus::load(&cfg.data, cfg.model.vocab_size, cfg.model.seq_len)?;
    let unigram_entropy = corpus.unigram_entropy(Split::Val);

    let run_dir = plan.is_writer().then_some(cfg.out_dir.as_path());
    let ckpt_root = store::root(&cfg.out_dir);
    let (loaded, skipped) = resolve_resume(resume, &ckpt_root, plan.is_writer())?;
    let changed = match &loaded {
        Some(l) => check_compatible(l, cfg)?,
        None => vec![],
    };
    if let Some(dir) = run_dir {
        let io = |source| TrainError::RunDir { path: dir.to_path_buf(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::write(dir.join("config.yaml"), serde_yaml::to_string(cfg).expect("a Config always serialises")).map_err(io)?;
        crate::logging::also_to_file(&dir.join("train.log")).map_err(io)?;
    }
    let start_step = loaded.as_ref().map_or(0, |l| l.state.step);
    let mut reporter = Reporter::new(run_dir, t.log_interval, t.max_steps, loaded.as_ref().map(|_| start_step))
        .map_err(|source| TrainError::RunDir { path: cfg.out_dir.clone(), source })?;
    for e in skipped {
        reporter.emit(Event::CheckpointSkipped { path: corrupt_path(&e), reason: e.to_string() });
    }

    // Before the first CUDA allocation: allocator options and the CUDA memory cap.
    let fraction = match (plan.memory_limit, device) {
        (Some(limit), tch::Device::Cuda(i)) => Some(crate::memory::cuda_fraction(limit, i)?),
        _ => None,
    };
    let allocator = crate::memory::allocator::configure(&cfg.memory.allocator, fraction)?;
    for w in cfg.memory.allocator.warnings(fraction.is_some()) {
        tracing::warn!("{w}");
    }
    for o in &allocator.overridden {
        tracing::warn!("PYTORCH_CUDA_ALLOC_CONF overridden by the config: {o}");
    }

    // The cap goes on after the corpus is loaded: it counts what training allocates.
    let baseline = match plan.memory_limit {
        Some(limit) => apply_limit(limit, device)?.baseline_bytes,
        None => ProcessMemory::read().map_or(0, |p| p.vm_bytes),
    };
    let baseline_rss = ProcessMemory::read().map_or(0, |p| p.rss_bytes);
    let model = Gpt::new(&cfg.model, cfg.seed, device).map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
    if let (Some(dir), None) = (&cfg.init_from, &loaded) {
        crate::hf::init_from(&model, dir)?; // a resumed run's weights come from its checkpoint
    }
    let params = model.params.tensors.as_slice();
    super::precision::prepare(params, cfg.precision, device).map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
    let mut scaler = (cfg.precision == Precision::Fp16Mixed).then(|| LossScaler::new(t.loss_scale_initial, t.loss_scale_growth_interval));
    if let (Some(s), Some(l)) = (&mut scaler, &loaded) {
        if let Some(saved) = l.state.loss_scaler.clone().and_then(|v| serde_json::from_value::<LossScaler>(v).ok()) {
            *s = saved;
        }
    }
    let spec = OptimizerSpec::from_config(&cfg.optimizer, t);
    let mut opt = Optimizer::new(&spec, params, &model.params.decay, device).map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
    let mut state = GuardState::new(plan.micro_batch, cfg.oom.min_micro_batch, cfg.oom.regrow_after_steps);
    let mut progress = Progress::default();
    if let Some(l) = &loaded {
        restore(l, &model, &mut opt)?;
        state = state.with_current(l.state.guard.micro_batch).with_regrow_memory(l.state.guard.regrow.clone());
        progress = Progress {
            micro_steps: l.state.micro_steps,
            best_val: l.state.best_val_loss.zip(l.state.best_val_step),
            nonfinite_skips: l.state.nonfinite_skips,
            elapsed_before: l.state.elapsed_s,
        };
    }
    if let Some(d) = dist.as_deref_mut() {
        // Every rank starts from rank 0's weights (equal anyway: init and checkpoints are
        // deterministic), and gradients are averaged in buckets laid out once.
        d.broadcast_params(params)?;
        d.plan_buckets(params, (cfg.dist.bucket_mb * (1 << 20) as f64) as usize, device)
            .map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
        tracing::info!("rank {} of {}: gradients averaged in {} bucket(s)", d.rank, d.world_size, d.bucket_count());
    }
    let mut guard = Guard::new(state, cfg.oom.policy, device, plan.rank_batch).with_escalation(cfg.oom.escalate.clone());
    if let Some(l) = &loaded {
        guard.state = guard.state.clone().with_level(l.state.guard.escalation_level);
    }
    let base_savers = Savers::from_config(&cfg.memory);
    let data = StepData {
        corpus: &corpus,
        sampler: Sampler { seed: cfg.seed, seq_len: cfg.model.seq_len },
        device,
        rank_start: plan.rank * plan.rank_batch,
        rank_batch: plan.rank_batch,
    };
    let schedule = LrSchedule::from_config(t);
    let time_limit = t.max_duration.as_deref().map(|d| parse_duration(d).expect("validated"));

    reporter.emit(Event::RunStarted {
        device: format!("{device:?}").to_lowercase(),
        params: model.num_params(),
        corpus: corpus.description.clone(),
        unigram_entropy,
        global_batch_size: t.global_batch_size,
        micro_batch_size: plan.micro_batch,
        accumulation: plan.accumulation,
        world_size: plan.world_size,
        tokens_per_step: plan.tokens_per_step,
        max_steps: t.max_steps,
        memory_limit_bytes: plan.memory_limit,
        allocator: allocator.clone(),
    });
    if let Some(l) = &loaded {
        reporter.emit(Event::Resumed { step: start_step, path: l.path.display().to_string(), changed });
    }

    let mut watch = MemoryWatch::new(cfg, device);
    // faults.leak_graphs: what a leaking training script keeps alive.
    let mut leaked: Vec<tch::Tensor> = Vec::new();
    let mut ckpt = Checkpointer {
        root: ckpt_root,
        writer: plan.is_writer(),
        retention: Retention { keep_last: cfg.checkpoint.keep_last, keep_every: cfg.checkpoint.keep_every },
        keep_best: cfg.checkpoint.keep_best,
        last_at: Instant::now(),
        last_seconds: 0.0,
    };
    let started = Instant::now();
    let (mut last_loss, mut last_val) = (f64::NAN, None);
    let (mut consecutive_bad, mut slowest_recent) = (0u64, 0.0f64);
    let mut last_saved: Option<u64> = None;
    let mut step = start_step;
    while step < t.max_steps {
        if cfg.faults.interrupt_at_step == Some(step) {
            stop.request();
        }
        if cfg.faults.crash_at_step == Some(step) && cfg.faults.crash_rank == plan.rank && plan.restart_count == 0 {
            return Err(TrainError::InjectedCrash { step });
        }
        let mut stop_reason = if stop.requested() {
            Some("signal")
        } else {
            time_limit
                .filter(|limit| started.elapsed() + Duration::from_secs_f64(slowest_recent + 1.5 * ckpt.last_seconds + 1.0) > *limit)
                .map(|_| "time_limit")
        };
        // All ranks stop at the same step, or the others would wait in a collective.
        if let Some(d) = dist.as_deref() {
            if d.any(stop_reason.is_some())? && stop_reason.is_none() {
                stop_reason = Some("peer_stop");
            }
        }
        if let Some(reason) = stop_reason {
            let path = ckpt.save(step, cfg, &model, &opt, &guard, &progress, scaler.as_ref(), started, plan, &mut reporter);
            reporter.emit(Event::Stopped { step, reason: reason.into(), checkpoint: path.as_ref().map(|p| p.display().to_string()) });
            return Err(TrainError::Interrupted { step, reason: reason.into(), checkpoint: path });
        }
        let step_started = Instant::now();
        let lr = schedule.at(step);
        guard.begin_step(step, &mut reporter);
        let outcome = guard.run(step, &mut reporter, |micro, p| {
            let savers = cfg.oom.escalate[..p.escalation_level()].iter().fold(base_savers, |s, e| s.escalated(*e));
            let scale = scaler.as_ref().map_or(1.0, |s| s.scale);
            let autocast = Autocast::enter(cfg.precision, device).map_err(|e| StepError::Fatal(Box::new(e)))?;
            let local = forward_backward(&model, &data, step, micro, &savers, scale, p);
            drop(autocast);
            let (mut grads, mut loss) = agree::gradients(local, dist.as_deref_mut())?;
            if cfg.faults.nonfinite_loss_at_steps.contains(&step) {
                loss = f64::NAN;
            }
            if scale != 1.0 {
                for g in grads.iter_mut() {
                    let _ = g.f_mul_scalar_(1.0 / scale)?;
                }
            }
            if cfg.faults.fp16_overflow_at_steps.contains(&step) && scaler.is_some() {
                let _ = grads[0].f_fill_(f64::INFINITY)?;
            }
            let grad_norm = clip_grad_norm(&mut grads, t.grad_clip)?;
            let overflow = scaler.is_some() && !grad_norm.is_finite();
            let applied = loss.is_finite() && grad_norm.is_finite();
            if applied {
                opt.step(params, &grads, lr)?;
            }
            if cfg.faults.leak_graphs {
                let (x, _) = data.sampler.train_batch(data.corpus, step, data.rank_start..data.rank_start + micro, data.device)?;
                leaked.push(model.forward(&x, true, None)?);
            }
            Ok(StepOutcome { loss, grad_norm, applied, overflow })
        });
        let outcome = match outcome {
            Ok(o) => o,
            Err(e @ GuardError::OutOfMemory(_)) => {
                tracing::warn!("{}", memory_summary(device));
                // The failed step changed nothing: the model is still the last good state.
                let path = ckpt.save(step, cfg, &model, &opt, &guard, &progress, scaler.as_ref(), started, plan, &mut reporter);
                reporter.emit(Event::Stopped { step, reason: "out_of_memory".into(), checkpoint: path.map(|p| p.display().to_string()) });
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        progress.micro_steps += guard.accumulation() as u64;
        if let Some(s) = &mut scaler {
            match s.update(outcome.overflow) {
                ScaleChange::BackedOff(scale) => reporter.emit(Event::LossScaleChanged { step, scale, reason: "overflow".into() }),
                ScaleChange::Grew(scale) => reporter.emit(Event::LossScaleChanged { step, scale, reason: "growth".into() }),
                ScaleChange::Unchanged => {}
            }
        }
        if outcome.applied || outcome.overflow {
            consecutive_bad = 0;
        } else {
            consecutive_bad += 1;
            progress.nonfinite_skips += 1;
            reporter.emit(Event::NonfiniteSkipped { step, loss: outcome.loss, grad_norm: outcome.grad_norm, consecutive: consecutive_bad });
            if consecutive_bad >= cfg.nan.max_consecutive {
                let path = ckpt.save(step + 1, cfg, &model, &opt, &guard, &progress, scaler.as_ref(), started, plan, &mut reporter);
                reporter.emit(Event::Stopped { step, reason: "nonfinite".into(), checkpoint: path.map(|p| p.display().to_string()) });
                return Err(TrainError::NonFinite { step, count: consecutive_bad });
            }
        }
        // Throughput counts the optimizer step only, not evaluation.
        let step_time = step_started.elapsed().as_secs_f64();
        let is_last = step + 1 == t.max_steps;
        let val_loss = if t.eval_interval > 0 && (step % t.eval_interval == 0 || is_last) {
            let v = guard.run(step, &mut reporter, |micro, p| {
                agree::validation_loss(evaluate(&model, &data, t.eval_batches, micro, p), dist.as_deref())
            })?;
            if progress.best_val.is_none_or(|(b, _)| v < b) {
                progress.best_val = Some((v, step + 1));
            }
            last_val = Some(v);
            Some(v)
        } else {
            None
        };
        last_loss = outcome.loss;
        // A slowly forgetting maximum of step times (eval included): the time-limit margin.
        slowest_recent = step_started.elapsed().as_secs_f64().max(slowest_recent * 0.95);
        let tokens = plan.tokens_per_step as u64;
        let memory = watch.after_step(step, &mut guard.state, &mut reporter);
        reporter.emit(Event::Step(StepMetrics {
            step,
            loss: outcome.loss,
            lr,
            grad_norm: outcome.grad_norm,
            val_loss,
            micro_batch: guard.micro_batch(),
            accumulation: guard.accumulation(),
            tokens,
            tokens_per_s: tokens as f64 / step_time,
            step_time_s: step_time,
            elapsed_s: progress.elapsed_before + started.elapsed().as_secs_f64(),
            memory,
        }));
        step += 1;
        if ckpt.due(step, cfg) || step == t.max_steps {
            ckpt.save(step, cfg, &model, &opt, &guard, &progress, scaler.as_ref(), started, plan, &mut reporter);
            last_saved = Some(step);
        }
    }
    if last_saved != Some(step) && loaded.is_some() {
        // Resumed at or past max_steps: the newest checkpoint already holds this state.
        tracing::info!("nothing to do: the checkpoint is at step {step}, train.max_steps is {}", t.max_steps);
    }

    if let Some(d) = dist.as_deref() {
        let spread = d.weight_spread(params)?;
        reporter.emit(Event::RanksCompared { world_size: d.world_size, checksum_spread: spread });
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(dir) = run_dir {
        crate::checkpoint::save_weights(dir, &model.params)?;
    }
    let steps_run = t.max_steps.saturating_sub(start_step);
    let summary = RunSummary {
        steps: t.max_steps,
        final_loss: last_loss,
        final_val_loss: last_val,
        oom_recoveries: guard.totals.recoveries,
        configured_micro_batch: plan.micro_batch,
        final_micro_batch: guard.micro_batch(),
        time_lost_s: guard.totals.time_lost.as_secs_f64(),
        guard_overhead_s: guard.totals.bookkeeping.as_secs_f64(),
        elapsed_s: elapsed,
        tokens_per_s: (steps_run as f64 * plan.tokens_per_step as f64) / elapsed,
        peak_mapped_above_start_bytes: (!device.is_cuda())
            .then(|| ProcessMemory::read().map(|p| p.vm_peak_bytes.saturating_sub(baseline)))
            .flatten(),
        peak_resident_above_start_bytes: (!device.is_cuda())
            .then(|| ProcessMemory::read().map(|p| p.rss_peak_bytes.saturating_sub(baseline_rss)))
            .flatten(),
    };
    tracing::info!("{}", memory_summary(device));
    reporter.emit(Event::RunFinished(summary.clone()));
    Ok(summary)
}
