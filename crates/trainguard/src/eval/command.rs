//! `trainguard eval TARGET --task NAME=FILE …`: a trained model (what `sample` opens: a run, a
//! checkpoint, an export) scored on multiple-choice task files, one process. Prints a line per
//! task (or JSON with `--json`); `--scores FILE` writes every example's scores as JSON lines.
use super::{run_task, EvalError, Task, TaskResult};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// A checkpoint directory, a run directory, or a directory written by `export --hf`.
    pub target: PathBuf,
    /// A task: its name and its JSONL file in HellaSwag's layout (`ctx`, `endings`, `label`);
    /// repeatable.
    #[arg(long = "task", value_name = "NAME=FILE.jsonl", required = true, value_parser = task_arg)]
    pub tasks: Vec<(String, PathBuf)>,
    /// Score only each task's first N examples.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_examples: Option<u64>,
    /// Write every example's scores (task, index, label, each ending's summed log-likelihood,
    /// tokens and characters, the choices) to this file as JSON lines.
    #[arg(long, value_name = "FILE")]
    pub scores: Option<PathBuf>,
    /// The results as JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// `auto` (CUDA when present), `cpu`, `cuda`, `cuda:N`.
    #[arg(long, default_value = "auto")]
    pub device: String,
}

/// `NAME=FILE`, the name checked as `eval.tasks[].name` is.
fn task_arg(text: &str) -> Result<(String, PathBuf), String> {
    let (name, file) = text
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=FILE.jsonl (e.g. hellaswag=val.jsonl), got `{text}`"))?;
    super::check_name(name)?;
    if file.is_empty() {
        return Err(format!("expected NAME=FILE.jsonl: no file after `{name}=`"));
    }
    Ok((name.to_string(), PathBuf::from(file)))
}

/// Runs the command: each task's result, in the order given; the lines to print are `render`'s.
pub fn run(args: &EvalArgs) -> Result<Vec<TaskResult>, EvalError> {
    let cuda_devices = tch::Cuda::device_count().max(0) as usize;
    let device = crate::run_plan::resolve_device(&args.device, cuda_devices, 0)
        .map_err(|e| EvalError::Input(format!("--device: {e}")))?;
    let trained = crate::sample::open(&args.target)?;
    let encoder = super::Encoder::of(&trained)?;
    let (vocab, seq_len) = (trained.model.vocab_size, trained.model.seq_len);
    let max = args.max_examples.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    // Every file read and encoded before the model is built: a bad line is named at once.
    let tasks = args
        .tasks
        .iter()
        .map(|(name, path)| Task::load(name, path, &encoder, vocab, seq_len, max))
        .collect::<Result<Vec<_>, _>>()?;
    let model = crate::sample::build(&trained, device)?;
    let mut scores = match &args.scores {
        Some(path) => Some((
            std::io::BufWriter::new(
                std::fs::File::create(path)
                    .map_err(|source| EvalError::Write { path: path.clone(), source })?,
            ),
            path,
        )),
        None => None,
    };
    let mut results = Vec::new();
    for task in &tasks {
        let r = run_task(&model, task, seq_len, device, None, &mut |s| {
            let Some((w, path)) = scores.as_mut() else { return Ok(()) };
            let mut line = serde_json::to_value(s).expect("scores serialise");
            line["task"] = task.name.clone().into();
            writeln!(w, "{line}").map_err(|source| EvalError::Write { path: path.to_path_buf(), source })
        })?;
        results.push(r);
    }
    if let Some((mut w, path)) = scores {
        w.flush().map_err(|source| EvalError::Write { path: path.clone(), source })?;
    }
    Ok(results)
}

/// What the command prints for its results.
pub fn render(results: &[TaskResult], json: bool) -> String {
    results
        .iter()
        .map(|r| match json {
            true => {
                let mut v = serde_json::to_value(r).expect("results serialise");
                v["acc"] = r.acc().into();
                v["acc_norm"] = r.acc_norm().into();
                format!("{v}\n")
            }
            false => format!(
                "{}: acc {:.4} ({}/{}), acc_norm {:.4} ({}/{}; per character)\n",
                r.task,
                r.acc(),
                r.correct,
                r.examples,
                r.acc_norm(),
                r.correct_norm,
                r.examples
            ),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_is_a_name_and_a_file() {
        assert_eq!(
            task_arg("hellaswag=data/val.jsonl").unwrap(),
            ("hellaswag".into(), "data/val.jsonl".into())
        );
        assert_eq!(task_arg("t=a=b.jsonl").unwrap().1, PathBuf::from("a=b.jsonl"), "the first `=` splits");
        assert!(task_arg("val.jsonl").unwrap_err().contains("expected NAME=FILE.jsonl"));
        assert!(task_arg("t=").unwrap_err().contains("no file"));
        assert!(task_arg("a b=x.jsonl").unwrap_err().contains("letters, digits"));
    }

    #[test]
    fn results_read_as_counts_and_fractions() {
        let r = TaskResult { task: "hs".into(), examples: 8, correct: 2, correct_norm: 3 };
        assert_eq!(
            render(std::slice::from_ref(&r), false),
            "hs: acc 0.2500 (2/8), acc_norm 0.3750 (3/8; per character)\n"
        );
        let v: serde_json::Value = serde_json::from_str(render(&[r], true).trim()).unwrap();
        assert_eq!(
            (v["task"].as_str(), v["acc"].as_f64(), v["correct_norm"].as_u64()),
            (Some("hs"), Some(0.25), Some(3))
        );
    }
}
