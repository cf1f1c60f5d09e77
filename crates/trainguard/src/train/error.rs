//! The errors that end a run ([`TrainError`]): each names what to change, and
//! [`TrainError::is_usage`] tells the CLI which are the user's input (exit 2).
use crate::checkpoint::CheckpointError;
use crate::data::DataError;
use crate::distributed::ranks::StartMismatch;
use crate::events::StopReason;
use crate::guard::{GuardError, OomFailure};
use crate::memory::LimitError;
use std::path::PathBuf;

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
    /// Another run holds `out_dir` (exit 2).
    #[error(transparent)]
    Lock(#[from] crate::fs::dir_lock::LockError),
    #[error(transparent)]
    Dist(#[from] crate::distributed::DistError),
    /// `data.document_mask` without an EOS id, or with two that differ (exit 2).
    #[error(transparent)]
    Documents(#[from] crate::model::documents::DocumentsError),
    #[error("deterministic: {0}")]
    Determinism(#[from] crate::ffi::ShimError),
    /// `eval.tasks`: a task file that cannot be used (exit 2), or scoring failed.
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
    #[error("init_from: {0}")]
    InitFrom(#[from] crate::hf::HfError),
    #[error("the ranks found different checkpoints to resume from (steps {lowest} to {highest}; 0 = none): put out_dir on a filesystem all nodes share, or pass --resume <checkpoint dir>")]
    ResumeDisagrees { lowest: u64, highest: u64 },
    /// The ranks did not start alike (another config, other tokens).
    #[error(transparent)]
    Start(StartMismatch),
    #[error("another rank could not start (its own error names why: an out_dir that holds another run, or a checkpoint it cannot use); every rank stops")]
    PeerCouldNotStart,
    #[error("injected failure after step {step} (faults.crash_at_step)")]
    InjectedCrash { step: u64 },
    #[error("out_dir: {path} exists and is not a directory; give a directory (a new one is created)")]
    OutDirNotADirectory { path: PathBuf },
    #[error("--overwrite: out_dir {path} holds the current directory, which cannot be moved aside from inside; run from elsewhere or name out_dir from its parent")]
    OverwriteHoldsCwd { path: PathBuf },
    /// An out_dir where the run would lose another run or the user's files.
    #[error(transparent)]
    Placement(#[from] super::PlacementError),
    #[error("cannot write run directory {path}: {source}")]
    RunDir { path: PathBuf, source: std::io::Error },
    /// A file of the run directory (a directory may stand where it goes).
    #[error("cannot write {} in the run directory: {source}", .file.display())]
    RunDirFile { file: PathBuf, source: std::io::Error },
    #[error("stopped at step {step} ({reason}); `--resume auto` continues from {}", .checkpoint.as_ref().map_or("the last complete checkpoint".to_string(), |c| c.display().to_string()))]
    Interrupted { step: u64, reason: StopReason, checkpoint: Option<PathBuf> },
    /// A planned stop whose checkpoint could not be written (the warning before it says why):
    /// not the "interrupted, resumable at this step" of exit 4, but a failure (exit 1, no stop
    /// record: job scripts must not requeue a run that cannot save).
    #[error("stopped at step {step} ({reason}), but its checkpoint could not be written (the warning above says why); {}", match .newest {
        Some((s, p)) => format!("`--resume auto` would continue from step {s} ({}), losing the steps after it", p.display()),
        None => "no complete checkpoint exists: `--resume auto` would start over at step 0".to_string(),
    })]
    StopNotCheckpointed { step: u64, reason: StopReason, newest: Option<(u64, PathBuf)> },
    #[error("{count} updates in a row had a non-finite loss or gradient norm (last at step {step}); stopped with the last good state checkpointed. Lower train.lr, check the data, or raise nan.max_consecutive")]
    NonFinite { step: u64, count: u64 },
    /// `divergence.*`: diverged and could not roll back (exit 5, as [`Self::NonFinite`]).
    #[error("step {step} diverged and the divergence guard cannot roll back: {why}; stopped with the last good state checkpointed ({}). Lower train.lr, check the data, or raise divergence.max_rollbacks", .checkpoint.as_ref().map_or("no checkpoint".to_string(), |c| c.display().to_string()))]
    Diverged { step: u64, why: String, checkpoint: Option<PathBuf> },
}

impl TrainError {
    /// A failed start comparison: a collective's failure stays a [`TrainError::Dist`], as any
    /// other collective's.
    pub fn from_start(e: StartMismatch) -> Self {
        match e {
            StartMismatch::Dist(d) => TrainError::Dist(d),
            other => TrainError::Start(other),
        }
    }

    /// The out-of-memory the run could not recover from, if that is what ended it.
    pub fn oom(&self) -> Option<&OomFailure> {
        match self {
            TrainError::Guard(GuardError::OutOfMemory(f)) => Some(f),
            _ => None,
        }
    }

    /// A failure this rank heard of from another (which reports its own cause), or one a
    /// restart may mend (ranks that found different checkpoints: a directory cache that lagged
    /// behind a crash's last checkpoint): not one to end a torchrun job on.
    pub fn heard_from_a_peer(&self) -> bool {
        matches!(
            self,
            TrainError::PeerCouldNotStart
                | TrainError::Start(StartMismatch::PeersDiffer { .. })
                | TrainError::ResumeDisagrees { .. }
        )
    }

    /// The user's input is wrong (exit 2): a checkpoint or model to start from that cannot be
    /// used, an allocator setting, an out_dir that cannot hold the run or is another's, a rank
    /// run differently from rank 0, or the corpus.
    pub fn is_usage(&self) -> bool {
        match self {
            TrainError::Data(e) => e.is_usage(),
            TrainError::Eval(e) => e.is_usage(),
            TrainError::Lock(l) => matches!(l, crate::fs::dir_lock::LockError::Busy { .. }),
            TrainError::Checkpoint(_)
            | TrainError::Allocator(_)
            | TrainError::InitFrom(_)
            | TrainError::OutDirNotADirectory { .. }
            | TrainError::OverwriteHoldsCwd { .. }
            | TrainError::Placement(_)
            | TrainError::Documents(_)
            | TrainError::Start(StartMismatch::DiffersFromRank0 { .. }) => true,
            _ => self.heard_from_a_peer(),
        }
    }
}
