//! Where a run starts, decided in one place: a fresh start, `--overwrite` (the old run moved
//! aside), a resume from `out_dir`'s newest complete checkpoint (`--resume auto`, a torchrun
//! restart) or from a named one (this run's or another's), or `init_from`'s weights. [`decide`]
//! returns the decision; [`Run::build`](super::run::Run::build) acts on it.
use super::resume::{check_compatible, resolve_resume, Resume, Start};
use super::run_dir::RunDir;
use super::TrainError;
use crate::checkpoint::state::DataRecord;
use crate::run_plan::RunPlan;
use std::path::Path;

/// Where the run starts: the checkpoint loaded (none: step 0, from `init_from` when set), the
/// broken ones passed over, and what changed since it was written.
pub(super) struct Decision {
    pub(super) start: Start,
    pub(super) changed: Vec<String>,
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
/// no checkpoint was found. The hold comes back even when the decision is a refusal: the ranks
/// compare their outcomes before any of them acts, and the directory is let go on drop.
pub(super) fn decide(
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
            Some(l) => check_compatible(l, cfg, data)?,
            None if !fresh => check_init().map(|()| vec![])?,
            None => vec![],
        };
        Ok(Decision { start, changed })
    })();
    (held, decided)
}
