//! The profiler switch: starts PyTorch's profiler before the first traced step, marks each
//! step as a range, stops it after the last and reads back what it wrote.
use super::read::{read, TraceSummary, OUR_STEP_RANGE, TOP};
use super::TraceError;
use crate::ffi::trace::{self as shim, Range};
use crate::ffi::ShimError;
use std::path::{Path, PathBuf};

/// Records the configured steps: [`Tracer::before_step`] starts the profiler at the first and
/// marks each step, [`Tracer::after_step`] stops it after the last and summarises.
pub struct Tracer {
    from: u64,
    to: u64,
    dir: PathBuf,
    device: tch::Device,
    running: bool,
}

impl Tracer {
    /// A tracer when `cfg` names steps and this process writes files.
    pub fn new(
        cfg: &crate::config::TraceConfig,
        out_dir: &Path,
        device: tch::Device,
        writes_files: bool,
    ) -> Option<Self> {
        let from = cfg.from_step.filter(|_| writes_files)?;
        Some(Self {
            from,
            to: from + cfg.steps,
            dir: out_dir.join(crate::fs::run_files::TRACE),
            device,
            running: false,
        })
    }

    /// Waits for the GPU's queue to drain, so the trace holds the traced steps' kernels whole:
    /// none of the step before (its optimizer update may still run when the next step starts),
    /// and each of the last one's finished before the profiler stops.
    fn drain(&self) -> Result<(), TraceError> {
        if let tch::Device::Cuda(i) = self.device {
            // tch raises a CUDA error here as a panic: brought back as the error it is.
            crate::ffi::torch_panics::catch_torch_panics(|| {
                tch::Cuda::synchronize(i as i64);
                Ok::<(), tch::TchError>(())
            })
            .map_err(|e| TraceError::Profiler(ShimError::Torch(e.to_string())))?;
        }
        Ok(())
    }

    /// Before the step of loop index `index` (step `index + 1`, as steps are counted): the
    /// profiler started if this is the first traced step, and the step's range in the trace
    /// while the returned value lives.
    pub fn before_step(&mut self, index: u64) -> Result<Option<Range>, TraceError> {
        let step = index + 1;
        if step == self.from && !self.running {
            std::fs::create_dir_all(&self.dir)
                .map_err(|error| TraceError::Dir { path: self.dir.clone(), error })?;
            self.drain()?;
            shim::start(self.device.is_cuda())?;
            self.running = true;
        }
        Ok(self.running.then(|| Range::new(&format!("{OUR_STEP_RANGE}{step}"))))
    }

    /// After the step of loop index `index`: after the last traced one, the trace written and
    /// summarised.
    pub fn after_step(&mut self, index: u64) -> Result<Option<TraceSummary>, TraceError> {
        if !self.running || index + 2 < self.to {
            return Ok(None);
        }
        let path = self.dir.join(format!("steps_{}-{}.json", self.from, self.to - 1));
        self.drain()?; // on an error the profiler still runs, and Drop stops it
        self.running = false;
        shim::stop(Some(&path))?;
        let summary = read(&path, TOP)?;
        if let Some(warning) = summary.skipped_warning() {
            tracing::warn!("metrics.trace: {warning}");
        }
        Ok(Some(summary))
    }
}

impl Drop for Tracer {
    /// A run that stops inside the traced steps leaves no profiler running (and no trace, which
    /// it says).
    fn drop(&mut self) {
        if self.running {
            let _ = shim::stop(None);
            tracing::warn!(
                "metrics.trace: the run ended inside the traced steps {}-{}: no trace written",
                self.from,
                self.to - 1
            );
        }
    }
}
