//! Where a run starts, decided in one place: a fresh start, `--overwrite` (the old run moved
//! aside), a resume from `out_dir`'s newest complete checkpoint (`--resume auto`, a torchrun
//! restart) or from a named one (this run's or another's), or `init_from`'s weights. [`decide`]
//! returns the decision, once every rank agrees with it; [`take_the_directory`] clears the
//! run directory for it once the model is built. [`Run::build`](super::run::Run::build) wires
//! the two.
use super::resume::{changed_since, leave_the_old_line, resolve_resume, LeftBehind, Resume, Start};
use super::run_dir::RunDir;
use super::TrainError;
use crate::checkpoint::state::DataRecord;
use crate::distributed::Dist;
use crate::memory::ProcessMemory;
use crate::run_plan::RunPlan;
use std::path::Path;

/// Where the run starts: the checkpoint loaded (none: step 0, from `init_from` when set), the
/// broken ones passed over, and what changed since it was written.
pub(super) struct Decision {
    pub(super) start: Start,
    pub(super) changed: Vec<String>,
    /// What reading the checkpoint mapped (counted out of the CPU cap's baseline).
    pub(super) reading: u64,
}

impl Decision {
    /// The step the run starts at: the checkpoint's, else 0.
    pub(super) fn step(&self) -> u64 {
        self.start.loaded.as_ref().map_or(0, |l| l.state.step)
    }
}

/// The writing rank holds `out_dir` first (one run per directory; `--overwrite` moves the old
/// run aside under that hold), then the checkpoint is chosen and checked against the config and
/// the data, or `init_from`'s weights against the config. `init_from` is checked before the old
/// run is moved aside where a refusal must leave it as it was (a fresh start), else only once
/// no checkpoint was found. Under a group the ranks then compare their outcomes before any of
/// them acts ([`agree`]); a refusal lets the directory go (on drop).
pub(super) fn decide(
    plan: &RunPlan,
    resume: &Resume,
    root: &Path,
    data: &DataRecord,
    dist: Option<&Dist>,
) -> Result<(Option<RunDir>, Decision), TrainError> {
    let before_reading = ProcessMemory::read().map_or(0, |p| p.vm_bytes);
    let (held, decided) = decide_here(plan, resume, root, data);
    let reading = ProcessMemory::read().map_or(0, |p| p.vm_bytes).saturating_sub(before_reading);
    let decided = decided.map(|d| Decision { reading, ..d });
    if let Some(d) = dist {
        agree(d, decided.as_ref().ok().map(Decision::step))?;
    }
    Ok((held, decided?))
}

/// This rank's decision: the hold on `out_dir` (the writing rank's), and where it starts with
/// what changed (`reading` left to [`decide`]), or why it cannot.
fn decide_here(
    plan: &RunPlan,
    resume: &Resume,
    root: &Path,
    data: &DataRecord,
) -> (Option<RunDir>, Result<Decision, TrainError>) {
    let cfg = &plan.config;
    let check_init = || cfg.init_from.as_deref().map_or(Ok(()), |dir| crate::hf::check_init(&cfg.model, dir));
    let fresh = matches!(resume, Resume::Fresh | Resume::Overwrite);
    if fresh {
        if let Err(e) = check_init() {
            return (None, Err(e.into()));
        }
    }
    let held = match plan.is_writer().then(|| RunDir::hold(&cfg.out_dir, *resume == Resume::Overwrite)) {
        Some(Err(e)) => return (None, Err(e)),
        Some(Ok(h)) => Some(h),
        None => None,
    };
    let decided = (|| {
        let start = resolve_resume(resume, root, plan.is_writer())?;
        let changed = match &start.loaded {
            Some(l) => changed_since(l, plan, data)?,
            None if !fresh => check_init().map(|()| vec![])?,
            None => vec![],
        };
        Ok(Decision { start, changed, reading: 0 })
    })();
    (held, decided)
}

/// The ranks compare where they start (`step`; None: this rank cannot), before anything is
/// written. A rank that cannot start (rank 0 alone refuses an out_dir holding another run; a
/// checkpoint only one rank sees) says so (-1), rather than its peers failing later in a
/// collective without the cause (on NCCL after dist.timeout_s); without a shared filesystem a
/// rank may find no checkpoint, or an older one, and would silently train from another step.
fn agree(d: &Dist, step: Option<u64>) -> Result<(), TrainError> {
    let (lowest, highest) = d.spread(step.map_or(-1.0, |s| s as f64))?;
    match step {
        Some(_) if lowest < 0.0 => Err(TrainError::PeerCouldNotStart),
        Some(_) if lowest != highest => {
            Err(TrainError::ResumeDisagrees { lowest: lowest as u64, highest: highest as u64 })
        }
        _ => Ok(()),
    }
}

/// Once the model is built (a checkpoint refused only then leaves the run it was refused over
/// as it was), the writing rank clears `out_dir` for the run: the earlier run's stop record
/// goes and the resolved config and log are written ([`RunDir::prepare`]), checkpoints past the
/// step resumed and stale final weights are set aside, and under torchrun the job is recorded.
pub(super) fn take_the_directory(
    held: Option<&mut RunDir>,
    plan: &RunPlan,
    root: &Path,
    decision: &Decision,
) -> Result<LeftBehind, TrainError> {
    let Some(h) = held else { return Ok(LeftBehind::default()) };
    h.prepare(&plan.config)?;
    let resumed = decision.start.loaded.as_ref().map(|l| (decision.step(), l.path.as_path()));
    let left = leave_the_old_line(&plan.config.out_dir, root, resumed, plan.config.train.max_steps)?;
    h.mark_job()?;
    Ok(left)
}
