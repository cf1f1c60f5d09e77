//! Where a run starts and what it leaves behind: choosing and checking the checkpoint to
//! resume from, restoring weights and optimizer state from it, and writing checkpoints on
//! schedule with retention applied (rank 0 only).
use super::precision::LossScaler;
use super::trainer::{Progress, Resume};
use crate::checkpoint::retention::{self, Retention};
use crate::checkpoint::state::*;
use crate::checkpoint::{compare, store, CheckpointError, Loaded};
use crate::config::Config;
use crate::events::{Event, Reporter};
use crate::guard::Guard;
use crate::model::Gpt;
use crate::optim::Optimizer;
use crate::plan::RunPlan;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub(super) fn corrupt_path(e: &CheckpointError) -> String {
    match e {
        CheckpointError::Corrupt { path, .. } | CheckpointError::Io { path, .. } => path.display().to_string(),
        CheckpointError::Incompatible { path, .. } | CheckpointError::Save { path, .. } => path.display().to_string(),
        CheckpointError::RunExists { out_dir, .. } => out_dir.display().to_string(),
    }
}

/// The checkpoint to start from, and the broken ones `auto` passed over.
pub(super) fn resolve_resume(resume: &Resume, root: &Path, writer: bool) -> Result<(Option<Loaded>, Vec<CheckpointError>), CheckpointError> {
    match resume {
        Resume::Fresh => {
            if writer {
                crate::checkpoint::fresh::refuse_if_occupied(root)?; // another run's checkpoints: exit 2
            }
            Ok((None, vec![]))
        }
        Resume::Auto => {
            if writer {
                store::clean_temporaries(root);
            }
            Ok(store::newest_valid(root))
        }
        Resume::Path(p) => Ok((Some(store::load(p)?), vec![])),
    }
}

/// Refuses a checkpoint whose model differs from the config; returns the safe changes.
pub(super) fn check_compatible(l: &Loaded, cfg: &Config) -> Result<Vec<String>, CheckpointError> {
    let (model, other) = compare::differences(&l.config, cfg);
    if !model.is_empty() {
        return Err(CheckpointError::Incompatible { path: l.path.clone(), differences: model });
    }
    Ok(other)
}

pub(super) fn restore(l: &Loaded, model: &Gpt, opt: &mut Optimizer) -> Result<(), CheckpointError> {
    let corrupt = |why: String| CheckpointError::Corrupt { path: l.path.clone(), why };
    let _no_grad = tch::no_grad_guard();
    for (name, p) in model.params.names.iter().zip(&model.params.tensors) {
        let src = l.weights.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| corrupt(format!("model.safetensors lacks `{name}`")))?;
        if src.size() != p.size() {
            return Err(corrupt(format!("`{name}` has shape {:?}, the model needs {:?}", src.size(), p.size())));
        }
        p.shallow_clone().f_copy_(src).map_err(|e| corrupt(e.to_string()))?;
    }
    if l.state.optimizer.kind != opt.kind() {
        return Err(CheckpointError::Incompatible {
            path: l.path.clone(),
            differences: vec![format!("optimizer: checkpoint {}, config {}", l.state.optimizer.kind, opt.kind())],
        });
    }
    opt.load_state(&model.params.names, &l.optimizer, l.state.optimizer.steps).map_err(corrupt)
}

/// When to checkpoint, and writing one with retention applied.
pub(super) struct Checkpointer {
    pub(super) root: PathBuf,
    pub(super) writer: bool,
    pub(super) retention: Retention,
    pub(super) keep_best: bool,
    pub(super) last_at: Instant,
    /// How long the last write took: the time-limit margin uses it.
    pub(super) last_seconds: f64,
}

impl Checkpointer {
    pub(super) fn due(&self, completed: u64, cfg: &Config) -> bool {
        let c = &cfg.checkpoint;
        (c.interval > 0 && completed % c.interval == 0)
            || c.interval_minutes.is_some_and(|m| self.last_at.elapsed().as_secs_f64() >= m * 60.0)
    }

    /// Writes a checkpoint of `completed` steps; a failure is reported and training goes on.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn save(
        &mut self,
        completed: u64,
        cfg: &Config,
        model: &Gpt,
        opt: &Optimizer,
        guard: &Guard,
        progress: &Progress,
        scaler: Option<&LossScaler>,
        started: Instant,
        plan: &RunPlan,
        reporter: &mut Reporter,
    ) -> Option<PathBuf> {
        if !self.writer {
            return None;
        }
        let t0 = Instant::now();
        let state = TrainerState {
            format: STATE_FORMAT,
            step: completed,
            micro_steps: progress.micro_steps,
            tokens_seen: completed * plan.tokens_per_step as u64,
            sampler: SamplerState { seed: cfg.seed, next_step: completed },
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
            elapsed_s: progress.elapsed_before + started.elapsed().as_secs_f64(),
            files: Default::default(),
        };
        let weights: Vec<(String, tch::Tensor)> = model.params.names.iter().cloned().zip(model.params.tensors.iter().map(|t| t.shallow_clone())).collect();
        match store::save(&self.root, &state, cfg, &weights, &opt.state_tensors(&model.params.names)) {
            Ok(path) => {
                let steps: Vec<u64> = store::list(&self.root).iter().map(|(s, _)| *s).collect();
                let best = if self.keep_best { progress.best_val.map(|b| b.1) } else { None };
                let deleted = retention::to_delete(&steps, self.retention, best);
                for s in &deleted {
                    if let Err(e) = store::remove(&self.root, *s) {
                        tracing::warn!("could not remove an old checkpoint: {e}");
                    }
                }
                self.last_at = Instant::now();
                self.last_seconds = t0.elapsed().as_secs_f64();
                reporter.emit(Event::CheckpointSaved { step: completed, path: path.display().to_string(), seconds: self.last_seconds, deleted });
                Some(path)
            }
            Err(e) => {
                reporter.emit(Event::CheckpointFailed { step: completed, error: e.to_string() });
                None
            }
        }
    }
}
