//! The command line (clap): what the user typed, parsed and nothing more.
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "trainguard",
    version,
    about = "Pretrain GPT models on libtorch; runs survive CUDA out of memory."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of the largest arguments does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model from a YAML config.
    Train(TrainArgs),
    /// Inspect configs.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Versions, CUDA, GPUs and allocator settings: what to paste into a bug report.
    Env(ConfigArgs),
    /// Estimate (and with --profile measure) what fits on a GPU; recommend a micro-batch.
    // `--margin -1` is a value, refused by name, not clap's "unexpected argument '-1'".
    #[command(allow_negative_numbers = true)]
    Plan(trainguard::planner::PlanArgs),
    /// One self-contained HTML page of a run's curves and events (several runs: overlaid).
    Report(ReportArgs),
    /// Tokenize text (.txt, .jsonl) with a tokenizer.json into token shards for `data.source: tokens:DIR`.
    Prepare(trainguard::data::prepare::PrepareArgs),
    /// Continue a prompt with a trained model (a checkpoint, a run directory or an exported directory).
    #[command(allow_negative_numbers = true)]
    Sample(trainguard::sample::SampleArgs),
    /// Score a trained model on multiple-choice tasks (HellaSwag's JSONL layout) by log-likelihood.
    Eval(trainguard::eval::command::EvalArgs),
    /// Write a run's or checkpoint's model as a Hugging Face transformers directory.
    Export(ExportArgs),
    /// Where a profiled step's time went: a Chrome trace of PyTorch's profiler (`metrics.trace`
    /// writes one; so does `torch.profiler`) as tables by kind of work and by kernel.
    #[command(allow_negative_numbers = true)]
    Trace(TraceArgs),
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Chrome trace files (`out_dir/trace/steps_A-B.json`, or `torch.profiler`'s export).
    #[arg(required = true, value_name = "TRACE_JSON")]
    pub files: Vec<PathBuf>,
    /// The summaries as JSON lines instead of Markdown tables.
    #[arg(long, conflicts_with = "compare")]
    pub json: bool,
    /// One table of the files side by side: ms per step by kind of work for each, and each
    /// one's difference from the first file's.
    #[arg(long)]
    pub compare: bool,
    /// How many of the heaviest kernels (operators) and launching operators to name.
    #[arg(long, default_value_t = trainguard::trace::TOP, value_name = "N", value_parser = at_least_one)]
    pub top: usize,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A run directory (its final weights, else its newest checkpoint) or a checkpoint directory.
    pub target: PathBuf,
    /// Output directory for config.json, model.safetensors, generation_config.json, tokenizer files.
    #[arg(long, value_name = "OUT_DIR")]
    pub hf: PathBuf,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Run directories (a run's out_dir); a running or resumed run works too.
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<PathBuf>,
    /// Where to write the page (default: RUN_DIR/report.html of the first run).
    #[arg(long, short, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the resolved config (file + overrides + defaults) as YAML.
    Show(ConfigArgs),
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Where to start: `auto` (newest complete checkpoint in out_dir, else step 0), a checkpoint
    /// directory, or `none`. Default `none`, or `auto` under a torchrun restart
    /// (TORCHELASTIC_RESTART_COUNT > 0).
    #[arg(long, value_name = "auto|PATH|none", value_parser = resume_value)]
    pub resume: Option<String>,
    /// Stop cleanly with a checkpoint before this wall-clock time (`7h30m`) from the process' start, start-up included; sets train.max_duration.
    #[arg(long, value_name = "DURATION")]
    pub max_duration: Option<String>,
    /// Start fresh even if out_dir holds checkpoints of another run: that run's directory is
    /// first moved aside to `OUT_DIR.old-<unix time>` (nothing is deleted). Without it such a
    /// start is refused (exit 2).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// With `--resume CHECKPOINT` (and another out_dir): a decay branch of STEPS steps from that
    /// checkpoint, all of them decaying (sets train.schedule wsd, train.max_steps and
    /// train.decay_fraction); the run it came from is left as it is.
    #[arg(long, value_name = "STEPS")]
    pub cooldown: Option<u64>,
}

/// `--resume ''` (an unset shell variable) names no checkpoint: refused here, as clap's own
/// usage errors are, before a config is read.
fn resume_value(text: &str) -> Result<String, String> {
    match text.trim() {
        "" => Err("an empty value: give `auto`, `none` or a checkpoint directory".into()),
        _ => Ok(text.to_string()),
    }
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// YAML config; without it, the built-in defaults (the debug model on the synthetic corpus).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Override a key: `--set train.lr=1e-3` (repeatable, applied in order).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub overrides: Vec<String>,
}

/// A count that must name at least one thing (`--top`).
fn at_least_one(text: &str) -> Result<usize, String> {
    text.parse::<usize>()
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| format!("expected a whole number from 1, got `{text}`"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_top_counts_from_one_and_a_negative_number_is_a_value() {
        let top = |n: &str| {
            Cli::try_parse_from(["trainguard", "trace", "--top", n, "t.json"]).map_err(|e| e.to_string())
        };
        assert!(matches!(top("3").unwrap().command, Command::Trace(TraceArgs { top: 3, .. })));
        for bad in ["0", "-1"] {
            let err = top(bad).unwrap_err();
            assert!(
                err.contains("'--top <N>'")
                    && err.contains(&format!("expected a whole number from 1, got `{bad}`")),
                "{err}"
            );
        }
        // Reaches sample's own rule (refused there by name), not clap's "unexpected argument".
        let parsed = Cli::try_parse_from(["trainguard", "sample", "run", "--temperature", "-1"]).unwrap();
        assert!(matches!(parsed.command, Command::Sample(a) if a.temperature == -1.0));
    }
}
