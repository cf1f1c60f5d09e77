//! The loop over a run's steps ([`train`]).
//! What a step does is `step::optimizer_step`; what a run holds and when it checkpoints, evaluates
//! and stops is [`Run`](super::run::Run).
use super::resume::Resume;
use super::run::Run;
use super::TrainError;
use crate::distributed::Dist;
use crate::events::RunSummary;
use crate::job::interrupt::Interrupter;
use crate::notify::Notifier;
use crate::run_plan::RunPlan;

/// Trains `plan` from where `resume` says to `train.max_steps`, or until a stop; `notifier`
/// (rank 0's) is told of the run's events.
/// Rank 0 records how the run ended (`stop.json`) while it still holds `out_dir`: a run started
/// there the moment the lock went would otherwise have its record overwritten by this one's.
pub fn train(
    plan: &RunPlan,
    resume: &Resume,
    stop: &Interrupter,
    dist: Option<&mut Dist>,
    notifier: Option<&Notifier>,
) -> Result<RunSummary, TrainError> {
    let (run, held) = Run::build(plan, resume, dist, notifier)?;
    let ended = run_to_the_end(run, stop);
    if let Some(dir) = &held {
        dir.record_end(&ended);
    }
    ended
}

fn run_to_the_end(mut run: Run, stop: &Interrupter) -> Result<RunSummary, TrainError> {
    while run.has_next() {
        if let Err(e) = run.step(stop) {
            run.settle_checkpoint();
            return Err(run.peer_stopped(e));
        }
    }
    run.finish()
}
