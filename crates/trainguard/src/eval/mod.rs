//! Downstream evaluation: multiple-choice tasks in HellaSwag's layout (`task.rs`), encoded with
//! the run's tokenizer (`encode.rs`), scored by each ending's log-likelihood (`score.rs`), in the
//! training loop on `eval.tasks` and alone as `trainguard eval` (`command.rs`). The ranks split
//! a task's examples (rank r scores those whose index ≡ r mod world) and sum their counts. It
//! owns the tasks' results and their metrics names; where they are written is `events`'.
pub mod command;
pub mod encode;
pub mod score;
pub mod task;

use crate::distributed::{Dist, DistError};
use crate::model::Model;
use encode::{Encoded, Encoder};
use score::ExampleScore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::Device;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A task file, a flag or the model's files are not usable (exit 2).
    #[error("{0}")]
    Input(String),
    /// The model could not be opened (`sample` reads it).
    #[error(transparent)]
    Open(#[from] crate::sample::SampleError),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    #[error(transparent)]
    Dist(#[from] DistError),
    #[error("autocast for evaluation: {0}")]
    Autocast(crate::ffi::ShimError),
    #[error("cannot write {}: {source}", .path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

impl EvalError {
    pub fn is_usage(&self) -> bool {
        match self {
            EvalError::Input(_) => true,
            EvalError::Open(e) => crate::sample::is_usage(e),
            _ => false,
        }
    }
}

/// Whether an error chain's cause is evaluation's usage error (exit 2).
pub fn is_usage(cause: &(dyn std::error::Error + 'static)) -> bool {
    cause.downcast_ref::<EvalError>().is_some_and(EvalError::is_usage)
}

/// A task's name: it becomes part of metrics fields (`eval_NAME_acc`), so letters, digits, `_`
/// and `-` only. The message says what is expected.
pub use crate::config::check_task_name as check_name;

/// A task read and encoded, ready to score.
pub struct Task {
    pub name: String,
    pub path: PathBuf,
    pub examples: Vec<Encoded>,
}

impl Task {
    /// Reads `path` and encodes its first `max_examples` examples (all when None).
    pub fn load(
        name: &str,
        path: &Path,
        encoder: &Encoder,
        vocab: usize,
        seq_len: usize,
        max_examples: Option<usize>,
    ) -> Result<Self, EvalError> {
        let read = task::read(path)?;
        let examples = read
            .iter()
            .take(max_examples.unwrap_or(usize::MAX))
            .enumerate()
            .map(|(i, e)| encoder.encode(e, i, path, vocab, seq_len))
            .collect::<Result<_, _>>()?;
        Ok(Task { name: name.to_string(), path: path.to_path_buf(), examples })
    }
}

/// A run's `eval.tasks`, read and encoded with its `data.source`'s tokenizer (none: empty).
pub fn tasks_of(cfg: &crate::config::Config) -> Result<Vec<Task>, EvalError> {
    if cfg.eval.tasks.is_empty() {
        return Ok(Vec::new());
    }
    let encoder = Encoder::of_source(&cfg.data.source)?;
    let (m, max) = (&cfg.model, cfg.eval.max_examples);
    cfg.eval
        .tasks
        .iter()
        .map(|t| Task::load(&t.name, &t.path, &encoder, m.vocab_size, m.seq_len, max))
        .collect()
}

/// A task's accuracy, over all ranks.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TaskResult {
    pub task: String,
    pub examples: usize,
    /// Right by the summed log-likelihood, and by it per character.
    pub correct: usize,
    pub correct_norm: usize,
}

impl TaskResult {
    pub fn acc(&self) -> f64 {
        self.correct as f64 / self.examples.max(1) as f64
    }
    pub fn acc_norm(&self) -> f64 {
        self.correct_norm as f64 / self.examples.max(1) as f64
    }
}

/// Which rank scores example `index`.
pub fn owner(index: usize, world: usize) -> usize {
    index % world.max(1)
}

/// Scores this rank's share of `task` (`each` sees every score it computes) and sums the counts
/// over the ranks: every rank gets the whole task's result.
pub fn run_task(
    model: &Model,
    task: &Task,
    seq_len: usize,
    device: Device,
    dist: Option<&Dist>,
    each: &mut dyn FnMut(&ExampleScore) -> Result<(), EvalError>,
) -> Result<TaskResult, EvalError> {
    let (rank, world) = dist.map_or((0, 1), |d| (d.rank, d.world_size));
    let _no_grad = tch::no_grad_guard();
    let mut counts = [0.0f64; 3];
    for e in task.examples.iter().filter(|e| owner(e.index, world) == rank) {
        let s = score::score(model, e, seq_len, device)?;
        counts[0] += 1.0;
        counts[1] += f64::from(u8::from(s.pred == s.label));
        counts[2] += f64::from(u8::from(s.pred_norm == s.label));
        each(&s)?;
    }
    let counts = match dist {
        Some(d) => d.sum_each(&counts)?,
        None => counts.to_vec(),
    };
    Ok(TaskResult {
        task: task.name.clone(),
        examples: counts[0].round() as usize,
        correct: counts[1].round() as usize,
        correct_norm: counts[2].round() as usize,
    })
}

/// The metrics.jsonl fields of the tasks' results: `eval_NAME_acc` and `eval_NAME_acc_norm`
/// each, and their means over the tasks, `eval_acc` and `eval_acc_norm` (the report's curve).
pub fn metrics(results: &[TaskResult]) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    if results.is_empty() {
        return m;
    }
    for r in results {
        m.insert(format!("eval_{}_acc", r.task), r.acc());
        m.insert(format!("eval_{}_acc_norm", r.task), r.acc_norm());
    }
    let n = results.len() as f64;
    m.insert("eval_acc".into(), results.iter().map(TaskResult::acc).sum::<f64>() / n);
    m.insert("eval_acc_norm".into(), results.iter().map(TaskResult::acc_norm).sum::<f64>() / n);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_the_examples_without_overlap_or_gap() {
        for world in 1..=5 {
            let mut seen = vec![0; 23];
            for rank in 0..world {
                for (i, s) in seen.iter_mut().enumerate() {
                    *s += usize::from(owner(i, world) == rank);
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "world {world}: {seen:?}");
        }
    }

    #[test]
    fn metrics_name_each_task_and_their_mean() {
        let r = |task: &str, correct, correct_norm| TaskResult {
            task: task.into(),
            examples: 4,
            correct,
            correct_norm,
        };
        let m = metrics(&[r("hellaswag", 1, 2), r("mine", 3, 4)]);
        assert_eq!(m["eval_hellaswag_acc"], 0.25);
        assert_eq!(m["eval_hellaswag_acc_norm"], 0.5);
        assert_eq!(m["eval_mine_acc_norm"], 1.0);
        assert_eq!((m["eval_acc"], m["eval_acc_norm"]), (0.5, 0.75));
        assert!(metrics(&[]).is_empty());
    }

    #[test]
    fn task_names_are_what_a_metrics_field_can_hold() {
        for ok in ["hellaswag", "arc-easy", "my_task2"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "hella swag", "a.b", "x/y", &"n".repeat(65)] {
            assert!(check_name(bad).unwrap_err().contains("letters, digits"), "{bad}");
        }
    }
}
