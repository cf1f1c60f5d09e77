//! The loop: build what a run needs from its plan, then for each optimizer step run the
//! guarded step (gradients → clip → update), evaluate on schedule and report.
use super::step::{evaluate, forward_backward, StepData};
use crate::data::{mix, Corpus, DataError, Split};
use crate::events::{Event, Reporter, RunSummary, StepMetrics};
use crate::guard::{unrecovered, Guard, GuardError, GuardState, OomFailure};
use crate::memory::{apply_limit, LimitError, ProcessMemory};
use crate::model::Gpt;
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::plan::RunPlan;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Guard(#[from] GuardError),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error(transparent)]
    Save(#[from] crate::checkpoint::SaveError),
    #[error("cannot write run directory {path}: {source}")]
    RunDir { path: PathBuf, source: std::io::Error },
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

pub fn train(plan: &RunPlan) -> Result<RunSummary, TrainError> {
    let cfg = &plan.config;
    let t = &cfg.train;
    let device = plan.device;
    if let Some(n) = t.threads {
        tch::set_num_threads(n as i32);
    }
    let corpus = Corpus::load(&cfg.data, cfg.model.vocab_size, cfg.model.seq_len)?;
    let unigram_entropy = corpus.unigram_entropy(Split::Val);

    let run_dir = plan.is_writer().then_some(cfg.out_dir.as_path());
    if let Some(dir) = run_dir {
        let io = |source| TrainError::RunDir { path: dir.to_path_buf(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let yaml = serde_yaml::to_string(cfg).expect("a Config always serialises");
        std::fs::write(dir.join("config.yaml"), yaml).map_err(io)?;
    }
    let mut reporter = Reporter::new(run_dir, t.log_interval, t.max_steps)
        .map_err(|source| TrainError::RunDir { path: cfg.out_dir.clone(), source })?;

    // The cap goes on after the corpus is loaded: it counts what training allocates.
    let baseline = match plan.memory_limit {
        Some(limit) => apply_limit(limit, device)?.baseline_bytes,
        None => ProcessMemory::read().map_or(0, |p| p.vm_bytes),
    };

    let model = Gpt::new(&cfg.model, cfg.seed, device).map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
    let params = model.params.tensors.as_slice();
    let adamw = AdamWConfig { beta1: t.beta1, beta2: t.beta2, eps: t.eps, weight_decay: t.weight_decay, fused: t.fused_adamw };
    let mut opt = AdamW::new(adamw, params, &model.params.decay, device).map_err(|e| unrecovered(e, None, plan.micro_batch, device))?;
    let schedule = LrSchedule::from_config(t);
    let state = GuardState::new(plan.micro_batch, cfg.oom.min_micro_batch, cfg.oom.regrow_after_steps);
    let mut guard = Guard::new(state, cfg.oom.policy, device, plan.rank_batch);
    let data = StepData {
        corpus: &corpus,
        sampler: crate::data::Sampler { seed: cfg.seed, seq_len: cfg.model.seq_len },
        device,
        rank_start: plan.rank * plan.rank_batch,
        rank_batch: plan.rank_batch,
    };

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
    });

    let started = Instant::now();
    let (mut last_loss, mut last_val) = (f64::NAN, None);
    for step in 0..t.max_steps {
        let step_started = Instant::now();
        let lr = schedule.at(step);
        guard.begin_step(step, &mut reporter);
        let (loss, grad_norm) = guard.run(step, &mut reporter, |micro, progress| {
            // Dropout masks depend on (seed, step) only, so a replay draws the same ones.
            tch::manual_seed(mix(&[cfg.seed, step]) as i64);
            let (mut grads, loss) = forward_backward(&model, &data, step, micro, progress)?;
            let norm = clip_grad_norm(&mut grads, t.grad_clip)?;
            opt.step(params, &grads, lr)?;
            Ok((loss, norm))
        })?;
        // Throughput counts the optimizer step only, not evaluation.
        let step_time = step_started.elapsed().as_secs_f64();
        let is_last = step + 1 == t.max_steps;
        let val_loss = if t.eval_interval > 0 && (step % t.eval_interval == 0 || is_last) {
            let v = guard.run(step, &mut reporter, |micro, progress| evaluate(&model, &data, t.eval_batches, micro, progress))?;
            last_val = Some(v);
            Some(v)
        } else {
            None
        };
        last_loss = loss;
        let tokens = plan.tokens_per_step as u64;
        reporter.emit(Event::Step(StepMetrics {
            step,
            loss,
            lr,
            grad_norm,
            val_loss,
            micro_batch: guard.micro_batch(),
            accumulation: guard.accumulation(),
            tokens,
            tokens_per_s: tokens as f64 / step_time,
            step_time_s: step_time,
            elapsed_s: started.elapsed().as_secs_f64(),
        }));
    }

    let elapsed = started.elapsed().as_secs_f64();
    if let Some(dir) = run_dir {
        crate::checkpoint::save_weights(dir, &model.params)?;
    }
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
        tokens_per_s: (t.max_steps as f64 * plan.tokens_per_step as f64) / elapsed,
        peak_mapped_above_start_bytes: (!device.is_cuda())
            .then(|| ProcessMemory::read().map(|p| p.vm_peak_bytes.saturating_sub(baseline)))
            .flatten(),
    };
    reporter.emit(Event::RunFinished(summary.clone()));
    Ok(summary)
}
