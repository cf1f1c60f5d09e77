//! The divergence guard in the loop: each step judged (`crate::divergence` decides, pure), every
//! rank taking the same decision, and a rollback carried out: the last good checkpoint loaded
//! into the model, optimizer, scaler and guards, the checkpoints past it set aside, the data
//! since skipped, `metrics.jsonl` rewound, and the checkpoint rewritten with the new record so
//! that a run killed right after resumes exactly as this one goes on.
use super::Run;
use crate::checkpoint::{store, Loaded};
use crate::config::DivergenceConfig;
use crate::distributed::Dist;
use crate::divergence::{self, Decision, Spike, Statistic};
use crate::events::{Event, StopReason};
use crate::step::StepOutcome;
use crate::train::resume::Progress;
use crate::train::TrainError;
use std::path::Path;

impl Run<'_> {
    /// Step `step` (the loop's index), which drew data step `data_step`, diverged: roll back to
    /// the last good checkpoint and go on, or stop (exit 5) when the rollbacks are spent or no
    /// checkpoint precedes it.
    pub(super) fn on_divergence(
        &mut self,
        step: u64,
        data_step: u64,
        spike: Spike,
    ) -> Result<(), TrainError> {
        let plan = self.plan;
        let cfg = &plan.config.divergence;
        // A background write in flight finishes first: the checkpoints on disk are then all
        // this run will have, none renamed into place behind the rollback's back.
        self.wait_for_checkpoint()?;
        // The state this step's loss judged is the one after the previous update, which may be
        // what broke: the last good state is a checkpoint of fewer than `step` steps.
        let target = newest_before(self.ckpt.root(), step);
        if let Some(d) = self.dist.as_deref() {
            let mine = target.as_ref().map_or(-1.0, |l| l.state.step as f64);
            let (lowest, highest) = d.spread(mine)?;
            if lowest != highest {
                return Err(TrainError::ResumeDisagrees {
                    lowest: lowest.max(0.0) as u64,
                    highest: highest.max(0.0) as u64,
                });
            }
        }
        let record = &self.state.progress.divergence;
        let decision = match &target {
            Some(l) => {
                let to = l.state.step;
                let to_data = crate::data::skips::data_step(to, &record.skipped);
                divergence::decide(cfg, record, step, data_step, to, to_data)
            }
            None => Decision::GiveUp { recent: record.rollbacks.len() },
        };
        let gives_up = matches!(decision, Decision::GiveUp { .. });
        let recent = match decision {
            Decision::GiveUp { recent } => recent,
            Decision::RollBack { .. } => 0,
        };
        self.reporter.emit(Event::Diverged {
            step,
            data_step: data_step + 1,
            statistic: spike.statistic,
            value: spike.value,
            median: spike.median,
            mad: spike.mad,
            limit: spike.limit,
            recent,
            gives_up,
        });
        // Past the last good checkpoint, this line's checkpoints hold what diverged: a later
        // `--resume auto` must not pick them up (moved aside, nothing deleted).
        if let (true, Some(l)) = (plan.is_writer(), &target) {
            let now = crate::job::deadline::now_unix_s() as u64;
            if let Some((dir, steps)) =
                store::set_aside_after(self.ckpt.root(), Some((l.state.step, &l.path)), now)?
            {
                let to = dir.display().to_string();
                self.reporter.emit(Event::CheckpointsSetAside { resumed_step: l.state.step, steps, to });
            }
        }
        let loaded = match (target, gives_up) {
            (Some(l), false) => l,
            (target, _) => {
                let why = match &target {
                    Some(_) => format!("{recent} rollbacks within divergence.rollback_window already"),
                    None => "no checkpoint before it to roll back to".to_string(),
                };
                let (done, checkpoint) = target.map_or((self.step, None), |l| (l.state.step, Some(l.path)));
                self.reporter.emit(Event::Stopped {
                    step: done,
                    reason: StopReason::Diverged,
                    checkpoint: checkpoint.as_ref().map(|p| p.display().to_string()),
                });
                return Err(TrainError::Diverged { step: step + 1, why, checkpoint });
            }
        };
        self.roll_back_to(loaded, &decision)
    }

    /// Loads `loaded` into the run, with the record of `decision`, and rewrites it.
    fn roll_back_to(&mut self, loaded: Loaded, decision: &Decision) -> Result<(), TrainError> {
        let kept = self.state.progress.divergence.clone();
        // Time keeps running: the training time counted so far stays.
        let elapsed_before = self.state.progress.elapsed_before;
        self.state.restore(&loaded, self.ckpt.root())?;
        self.state.trainable.graphs.release();
        let progress = &mut self.state.progress;
        progress.elapsed_before = elapsed_before;
        progress.divergence = divergence::rolled_back(&kept, loaded.state.divergence.as_ref(), decision);
        let to_step = loaded.state.step;
        let path = loaded.path.clone();
        drop(loaded);
        self.step = to_step;
        if let Err(e) = self.reporter.rewind(to_step) {
            tracing::warn!("cannot rewind metrics.jsonl: {e}");
        }
        // Every rank read the checkpoint before rank 0 rewrites it.
        if let Some(d) = self.dist.as_deref() {
            d.barrier()?;
        }
        // The decision goes into the checkpoint it returned to: killed from here on, the run
        // resumes with the data skipped and the learning rate lowered, as it goes on now.
        self.save(to_step, true);
        // Written before training goes on (not in the background): a kill from here resumes
        // with the record.
        self.wait_for_checkpoint()?;
        let record = &self.state.progress.divergence;
        let (Decision::RollBack { skip, .. }, Some(rollback)) = (decision, record.rollbacks.last()) else {
            return Ok(());
        };
        self.reporter.emit(Event::RolledBack {
            step: to_step,
            diverged_step: rollback.diverged_step,
            checkpoint: path.display().to_string(),
            skipped_from: skip.from + 1,
            skipped_to: skip.to,
            lr_factor: self.plan.config.divergence.lr_factor,
            lr_lowered_until: record.lowered_lr_until.filter(|&u| u > to_step),
            rollbacks: record.rollbacks.len(),
        });
        Ok(())
    }
}

/// Whether the step just run diverged: a spike against the window, or (`give_up`)
/// `nan.max_consecutive` non-finite updates. A healthy step's values join the window.
/// Under a group the ranks agree (the loss is already the group's mean; the decision is
/// agreed all the same, as the out-of-memory decision is, so no rank rolls back alone).
pub(super) fn judge(
    cfg: &DivergenceConfig,
    progress: &mut Progress,
    outcome: &StepOutcome,
    give_up: bool,
    dist: Option<&Dist>,
) -> Result<Option<Spike>, TrainError> {
    if !cfg.enabled {
        return Ok(None);
    }
    let record = &progress.divergence;
    let mut spike = match (give_up, outcome.applied) {
        (true, _) => Some(Spike::nonfinite(progress.nonfinite_streak)),
        (false, true) => divergence::judge(cfg, record, outcome.loss, outcome.grad_norm),
        (false, false) => None,
    };
    if let Some(d) = dist {
        let code = |s: &Option<Spike>| match s.map(|s| s.statistic) {
            None => 0.0,
            Some(Statistic::Loss) => 1.0,
            Some(Statistic::GradNorm) => 2.0,
            Some(Statistic::Nonfinite) => 3.0,
        };
        let agreed = d.max(code(&spike))?;
        if spike.is_none() && agreed > 0.0 {
            // A peer judged a spike this rank did not: its figures are the peer's to log.
            let statistic = if agreed >= 3.0 {
                Statistic::Nonfinite
            } else if agreed >= 2.0 {
                Statistic::GradNorm
            } else {
                Statistic::Loss
            };
            spike = Some(Spike {
                statistic,
                value: outcome.loss,
                median: f64::NAN,
                mad: f64::NAN,
                limit: f64::NAN,
            });
        }
    }
    if spike.is_none() && outcome.applied {
        divergence::remember(cfg, &mut progress.divergence, outcome.loss, outcome.grad_norm);
    }
    Ok(spike)
}

/// The newest checkpoint in `root` of fewer than `step` steps that loads; a broken one is
/// passed over, as `--resume auto` passes it over.
fn newest_before(root: &Path, step: u64) -> Option<Loaded> {
    store::list(root)
        .into_iter()
        .rev()
        .filter(|(s, _)| *s < step)
        .find_map(|(_, dir)| store::load_checkpoint(&dir).ok())
}
