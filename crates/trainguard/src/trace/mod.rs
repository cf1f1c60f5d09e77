//! Profiles (`metrics.trace`, `trainguard trace`): the profiler switch ([`Tracer`],
//! `profiler.rs`: PyTorch's own profiler records steps `from_step .. from_step + steps` on the
//! writing rank and writes a Chrome trace to `out_dir/trace/steps_A-B.json`, for
//! chrome://tracing or Perfetto) and the trace reader (`read.rs`: [`read`] takes that file, or
//! one PyTorch's `torch.profiler` wrote, and [`summarise`] says where the time went: by kind of
//! work ([`Work`]) and by the heaviest kernels). On CUDA it counts the GPU's kernels, copies and
//! sets; without them, each CPU operator's self time (its time less the operators it called).
mod profiler;
mod read;

use crate::ffi::ShimError;
pub use profiler::Tracer;
pub use read::*;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("metrics.trace: {0}")]
    Profiler(#[from] ShimError),
    // `error`, not `source`: the message is whole here, the chain would repeat it.
    #[error("metrics.trace: cannot create {path}: {error}")]
    Dir { path: PathBuf, error: std::io::Error },
    #[error("cannot read the trace {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{path} is not a Chrome trace of PyTorch's profiler: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{} is gzip-compressed (as torch.profiler's `tensorboard_trace_handler(use_gzip=True)` writes `*.pt.trace.json.gz`): gunzip it first, `gunzip -c {} > {}`, and give that file", path.display(), path.display(), unzipped.display())]
    Gzip { path: PathBuf, unzipped: PathBuf },
    #[error("{path} holds nothing to tabulate: {why}")]
    Empty { path: PathBuf, why: String },
}

impl TraceError {
    /// A file the user named that cannot be read or is not a trace (exit code 2).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            TraceError::Read { .. }
                | TraceError::Format { .. }
                | TraceError::Gzip { .. }
                | TraceError::Empty { .. }
        )
    }
}
