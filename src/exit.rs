//! Exit codes a job script can branch on, and the mapping from an error chain to one.
use crate::config::ConfigError;
use crate::guard::GuardError;
use crate::plan::PlanError;
use crate::train::TrainError;

pub const SUCCESS: i32 = 0;
/// Anything not listed below (I/O, data files, libtorch errors that are not out-of-memory).
pub const FAILURE: i32 = 1;
/// Bad config, bad `--set`, bad command line (clap uses 2 as well).
pub const CONFIG: i32 = 2;
/// Out of memory even at the smallest allowed micro-batch (or with `oom.policy: fail`).
pub const OUT_OF_MEMORY: i32 = 3;
/// Stopped by SIGINT/SIGTERM or `train.max_duration` after writing a checkpoint: resumable.
pub const INTERRUPTED: i32 = 4;
/// Too many non-finite updates in a row (`nan.max_consecutive`); last good state checkpointed.
pub const NONFINITE: i32 = 5;

pub fn code_for(err: &anyhow::Error) -> i32 {
    for cause in err.chain() {
        if cause.is::<ConfigError>()
            || cause.is::<PlanError>()
            || cause.is::<crate::memory::allocator::AllocatorError>()
            || cause.is::<crate::dist::EnvError>()
            || matches!(cause.downcast_ref::<crate::dist::DistError>(), Some(crate::dist::DistError::Backend(_)))
        {
            return CONFIG;
        }
        if cause.downcast_ref::<crate::planner::PlannerError>().is_some_and(|e| e.is_usage()) {
            return CONFIG;
        }
        if cause.downcast_ref::<crate::data::DataError>().is_some_and(|e| e.is_usage()) || crate::prepare::is_usage(cause)
            || crate::sample::is_usage(cause)
            || crate::hf::is_usage(cause)
        {
            return CONFIG;
        }
        if oom_in(cause).is_some() {
            return OUT_OF_MEMORY;
        }
        match cause.downcast_ref::<TrainError>() {
            Some(TrainError::Interrupted { .. }) => return INTERRUPTED,
            Some(TrainError::NonFinite { .. }) => return NONFINITE,
            // A checkpoint named on the command line that cannot be used, or a model that
            // differs from the checkpoint's: the user's input is wrong.
            Some(TrainError::Checkpoint(_) | TrainError::Allocator(_)) => return CONFIG,
            Some(TrainError::Data(e)) if e.is_usage() => return CONFIG,
            Some(TrainError::InitFrom(_)) => return CONFIG,
            _ => {}
        }
    }
    FAILURE
}

/// The unrecoverable out-of-memory behind an error, wherever it sits in the chain.
pub fn oom_in<'a>(cause: &'a (dyn std::error::Error + 'static)) -> Option<&'a crate::guard::OomFailure> {
    if let Some(t) = cause.downcast_ref::<TrainError>() {
        return t.oom();
    }
    match cause.downcast_ref::<GuardError>() {
        Some(GuardError::OutOfMemory(f)) => Some(f),
        _ => None,
    }
}

/// A name for the error kind behind an exit code (torchelastic's error file).
pub fn kind_name(code: i32) -> &'static str {
    match code {
        CONFIG => "ConfigError",
        OUT_OF_MEMORY => "OutOfMemoryError",
        INTERRUPTED => "Interrupted",
        NONFINITE => "NonFiniteLoss",
        _ => "TrainguardError",
    }
}
