//! The one owner of "write a checkpoint directory completely": a [`WriteJob`] (trainer state,
//! config, the tensors on the host) becomes `step-XXXXXXXX/` through [`store::save`] (temporary
//! directory, every file fsynced, checksums, rename) and then retention runs. The same
//! [`write`] serves the synchronous path and the background one ([`InFlight`]: one thread per
//! write, at most one write at a time); a per-rank shard file would be added here, once.
//! What it does not own: when to write (the run's cadence) and taking the host copy
//! ([`super::snapshot`]).
use super::retention::{self, Retention};
use super::state::TrainerState;
use super::{store, CheckpointError};
use crate::config::Config;
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tch::Tensor;

/// Everything one checkpoint directory is written from.
pub struct WriteJob {
    pub root: PathBuf,
    pub state: TrainerState,
    pub config: Config,
    pub weights: Vec<(String, Tensor)>,
    /// This writer's optimizer state: the whole, or under `dist.shard` its own part.
    pub optimizer: Vec<(String, Tensor)>,
    /// The file it goes to (`optimizer.safetensors`, or this rank's shard file).
    pub optimizer_file: String,
    /// The other ranks' parts, staged for this write to take in (`dist.shard`).
    pub staged: Vec<store::StagedShard>,
    /// Seconds the ranks spent staging their parts before this write: a checkpoint's time.
    pub staging_s: f64,
    pub retention: Retention,
    /// The step of the best validation loss, kept whatever retention says (`keep_best`).
    pub keep_step: Option<u64>,
}

/// A checkpoint written and renamed into place.
#[derive(Debug, Clone)]
pub struct Written {
    pub step: u64,
    pub path: PathBuf,
    /// Steps retention deleted after it.
    pub deleted: Vec<u64>,
    /// Old checkpoints retention could not remove, with why (warnings, nothing lost).
    pub not_deleted: Vec<String>,
    /// The write alone: files, fsyncs, rename and retention.
    pub seconds: f64,
}

/// Writes `job`'s checkpoint completely, then applies retention (never to the one written).
pub fn write(job: &WriteJob) -> Result<Written, CheckpointError> {
    let t0 = Instant::now();
    let step = job.state.step;
    let parts = store::OptimizerParts {
        file: job.optimizer_file.clone(),
        tensors: &job.optimizer,
        staged: job.staged.clone(),
    };
    let path = store::save(&job.root, &job.state, &job.config, &job.weights, parts)?;
    let steps: Vec<u64> = store::list(&job.root).iter().map(|(s, _)| *s).collect();
    let doomed = retention::to_delete(&steps, job.retention, job.keep_step, step);
    let (mut deleted, mut not_deleted) = (vec![], vec![]);
    for s in doomed {
        match store::remove(&job.root, s) {
            Ok(()) => deleted.push(s),
            Err(e) => not_deleted.push(e.to_string()),
        }
    }
    Ok(Written { step, path, deleted, not_deleted, seconds: job.staging_s + t0.elapsed().as_secs_f64() })
}

/// What a background write hands back: its outcome, and the job (its host buffers, for the
/// next copy to reuse).
type Outcome = (Result<Written, CheckpointError>, WriteJob);

/// A checkpoint being written by a thread of its own while training goes on. It is complete
/// only once [`store::save`] renamed it; until then `--resume auto` sees the previous one.
pub struct InFlight {
    pub step: u64,
    handle: JoinHandle<Outcome>,
}

impl InFlight {
    pub fn start(job: WriteJob) -> Result<Self, std::io::Error> {
        let step = job.state.step;
        let handle = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || (write(&job), job))?;
        Ok(Self { step, handle })
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the write to end; returns its outcome, the job back, and how long this call
    /// blocked.
    pub fn wait(self) -> (Result<Written, CheckpointError>, Option<WriteJob>, Duration) {
        let t0 = Instant::now();
        let joined = self.handle.join();
        let waited = t0.elapsed();
        match joined {
            Ok((result, job)) => (result, Some(job), waited),
            // The writer panicked (a bug): nothing was renamed, so nothing half-written is seen.
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "the writer thread panicked".into());
                let path = PathBuf::from(store::dir_name(self.step));
                (Err(CheckpointError::Save { path, why }), None, waited)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::tests::{state, weights};

    fn job(root: &std::path::Path, step: u64) -> WriteJob {
        WriteJob {
            root: root.to_path_buf(),
            state: state(step),
            config: Config::default(),
            weights: weights(),
            optimizer: vec![("a".into(), Tensor::from_slice(&[step as f32]))],
            optimizer_file: store::OPTIMIZER_FILE.into(),
            staged: Vec::new(),
            staging_s: 0.0,
            retention: Retention { keep_last: 2, keep_every: 0 },
            keep_step: None,
        }
    }

    #[test]
    fn a_background_write_is_the_synchronous_one_with_retention_applied() {
        let dir = tempfile::tempdir().unwrap();
        let root = store::root(dir.path());
        let sync = write(&job(&root, 1)).unwrap();
        assert_eq!((sync.step, sync.deleted.len()), (1, 0));
        for step in [2, 3] {
            let flight = InFlight::start(job(&root, step)).unwrap();
            let (written, back, _) = flight.wait();
            let written = written.unwrap();
            assert_eq!(written.path, root.join(store::dir_name(step)));
            assert_eq!(back.unwrap().state.step, step, "the buffers come back");
            assert_eq!(written.deleted, if step == 3 { vec![1] } else { vec![] });
        }
        let loaded = store::load_checkpoint(&root.join(store::dir_name(3))).unwrap();
        assert_eq!(loaded.optimizer[0].1.double_value(&[0]), 3.0);
        assert_eq!(store::list(&root).iter().map(|(s, _)| *s).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn a_failed_background_write_reports_the_synchronous_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = store::root(dir.path());
        std::fs::create_dir_all(&root).unwrap();
        // A file where the temporary directory goes: the write fails with a real I/O error.
        std::fs::write(root.join(".tmp-step-00000004"), "in the way").unwrap();
        let sync = write(&job(&root, 4)).unwrap_err().to_string();
        let (background, _, _) = InFlight::start(job(&root, 4)).unwrap().wait();
        assert_eq!(background.unwrap_err().to_string(), sync);
        assert!(store::list(&root).is_empty());
    }
}
