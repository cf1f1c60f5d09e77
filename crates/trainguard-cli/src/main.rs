//! CLI entry: parse, run, map the error chain to a documented exit code (the codes are in
//! `trainguard::job::exit`; the mapping lives here, the one place that sees every error type).
use anyhow::Context;
use clap::Parser;
mod cli;
mod job;
use cli::{Cli, Command, ConfigArgs, ConfigCommand};
use trainguard::job::interrupt::Interrupter;
use trainguard::job::{attempts, deadline, exit};
use trainguard::train::TrainError;
use trainguard::{config, distributed, run_plan, train};

fn main() {
    deadline::process_start(); // train.max_duration counts from here
    trainguard::console::logging::init();
    let cli = parse_command_line();
    let training = matches!(cli.command, Command::Train(_));
    let result = match cli.command {
        Command::Train(args) => job::run_train(&args),
        Command::Config(ConfigCommand::Show(args)) => show_config(&args),
        Command::Env(args) => show_env(&args),
        Command::Plan(args) => trainguard::planner::run(&args).map_err(Into::into),
        Command::Report(args) => run_report(&args),
        Command::Prepare(args) => run_prepare(&args),
        Command::Sample(args) => run_sample(&args),
        Command::Export(args) => run_export(&args),
        Command::Eval(args) => run_eval(&args),
        Command::Trace(args) => run_trace(&args),
    };
    if let Err(err) = result {
        report(&err);
        let code = exit_code(&err);
        job::tell_the_launcher(&err, code, training);
        job::notify_end(code, &message(&err));
        end(code);
    }
    job::notify_end(exit::SUCCESS, "");
    end(exit::SUCCESS);
}

/// Ends the process once stdout is written. Not `std::process::exit`: it runs libtorch's static
/// destructors while a rank's heartbeat thread may be inside libtorch, which crashed finished
/// ranks now and then ([`trainguard::ffi::os::end_process`]).
fn end(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    trainguard::ffi::os::end_process(code)
}

/// The command line, or the process ends: `--help` and `--version` print (a failed write,
/// `> /dev/full`, is exit 1, which clap's own printing would hide), anything else that clap
/// refuses is its usage error (exit 2).
fn parse_command_line() -> Cli {
    use clap::error::ErrorKind;
    let e = match Cli::try_parse() {
        Ok(cli) => return cli,
        Err(e) => e,
    };
    if !matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    use std::io::IsTerminal;
    let text =
        if std::io::stdout().is_terminal() { e.render().ansi().to_string() } else { e.render().to_string() };
    if let Err(err) = out(&text) {
        report(&err);
        end(exit::FAILURE);
    }
    // `trainguard` alone prints the help and is a usage error, as clap has it.
    end(e.exit_code());
}

/// The continuation printed as it is drawn; on a terminal, a line end after it so the prompt
/// does not follow on its line (piped, nothing is added).
fn run_sample(args: &trainguard::sample::SampleArgs) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let text = trainguard::sample::run(args, &mut trainguard::console::output::print_part)?;
    if std::io::stdout().is_terminal() && !text.ends_with('\n') {
        out("\n")?;
    }
    Ok(())
}

/// The command's answer on stdout (a closed pipe ends it quietly; another failure is an error).
fn out(text: &str) -> anyhow::Result<()> {
    trainguard::console::output::print(text).context("cannot write to standard output")
}

/// The summary line of a command whose output (`written`: what, and where) is already whole:
/// one that cannot be printed (stdout on a full disk) is said on stderr, not made a failure,
/// whose retry (a job script's, after exit 1) would be refused for what this run left.
fn out_after_written(text: &str, written: &str) {
    if let Err(e) = out(text) {
        trainguard::console::logging::to_stderr(&format!(
            "{written}; only its summary line could not be printed: {e:#}"
        ));
    }
}

fn load(args: &ConfigArgs) -> anyhow::Result<config::Config> {
    Ok(config::load(args.config.as_deref(), &args.overrides)?)
}

fn run_trace(args: &cli::TraceArgs) -> anyhow::Result<()> {
    // Each file read, and once for it on stderr what its figures leave out.
    let read = |file: &std::path::PathBuf| {
        let summary = trainguard::trace::read(file, args.top)?;
        if let Some(warning) = summary.skipped_warning() {
            trainguard::console::logging::to_stderr(&format!("warning: {warning}"));
        }
        Ok::<_, trainguard::trace::TraceError>(summary)
    };
    if args.compare {
        let summaries = args.files.iter().map(read).collect::<Result<Vec<_>, _>>()?;
        out(&trainguard::trace::compare(&summaries))?;
        return Ok(());
    }
    for file in &args.files {
        let summary = read(file)?;
        if args.json {
            out(&format!("{}\n", serde_json::to_string(&summary)?))?;
        } else {
            out(&format!("{}\n", trainguard::trace::table(&summary)))?;
        }
    }
    Ok(())
}

fn run_report(args: &cli::ReportArgs) -> anyhow::Result<()> {
    let out_path = trainguard::report::run(&args.runs, args.out.as_deref())?;
    out(&format!("{}\n", out_path.display()))
}

fn run_prepare(args: &trainguard::data::prepare::PrepareArgs) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let stop = Interrupter::new();
    stop.install_signal_handler(
        "stopping after the chunks being tokenized, then removing what was written",
        "the next prepare into this directory removes what this one left",
        || exit::INTERRUPTED,
    )
    .context("cannot install the SIGINT/SIGTERM handler")?;
    let m = trainguard::data::prepare::run(args, &stop)?;
    let secs = start.elapsed().as_secs_f64();
    // From here the dataset is in place: nothing may turn it into a failure.
    let dtype =
        serde_json::to_value(m.dtype).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let summary = format!(
        "prepared {}: {} documents, {} training tokens in {} shard(s), {} validation tokens, {}, vocab {} (EOS {} = {}); {:.1} MB/s, {:.2}M tokens/s\n",
        args.out.display(),
        m.documents,
        m.train_tokens,
        m.train.len(),
        m.val_tokens,
        dtype,
        m.vocab_size,
        m.eos_token,
        m.eos_id,
        m.input_bytes as f64 / 1e6 / secs,
        (m.train_tokens + m.val_tokens) as f64 / 1e6 / secs
    );
    out_after_written(
        &summary,
        &format!(
            "prepare: the dataset was written at {} ({})",
            args.out.display(),
            args.out.join("dataset.json").display()
        ),
    );
    Ok(())
}

fn run_eval(args: &trainguard::eval::command::EvalArgs) -> anyhow::Result<()> {
    let results = trainguard::eval::command::run(args)?;
    out(&trainguard::eval::command::render(&results, args.json))
}

fn run_export(args: &cli::ExportArgs) -> anyhow::Result<()> {
    let trained = trainguard::sample::open(&args.target)?;
    let model = trainguard::sample::build(&trained, tch::Device::Cpu)?;
    if let Some(why) = &trained.dataset_unusable {
        tracing::warn!("{why}: exporting without a tokenizer");
    }
    let file = trained.dataset.as_ref().map(|d| d.tokenizer_file());
    let tokenizer =
        trained.dataset.as_ref().zip(file.as_deref()).map(|(d, file)| trainguard::hf::Tokenizer {
            file,
            eos_token: &d.vocab.eos,
            eos_id: d.vocab.eos_id,
            specials: &d.specials,
        });
    let files = trainguard::hf::export(&model, tokenizer, &args.hf)?;
    out_after_written(
        &format!("exported {} to {}: {}\n", args.target.display(), args.hf.display(), files.join(", ")),
        &format!("export: {} was written", args.hf.display()),
    );
    Ok(())
}

fn show_config(args: &ConfigArgs) -> anyhow::Result<()> {
    let cfg = load(args)?;
    out(&serde_yaml::to_string(&cfg)?)
}

fn show_env(args: &ConfigArgs) -> anyhow::Result<()> {
    out(&trainguard::envinfo::report(&load(args)?))
}

/// One clear message on stderr, no backtrace; out-of-memory gets advice on what to change. A
/// rank other than 0 marks each line with `[rank N]`, as its log lines are.
fn report(err: &anyhow::Error) {
    // A planned stop (signal, time limit) is not a failure: it says where it stopped and how
    // to go on (exit code 4 all the same).
    let stopped = err
        .chain()
        .find_map(|c| c.downcast_ref::<TrainError>())
        .filter(|e| matches!(e, TrainError::Interrupted { .. }));
    let text = match stopped {
        Some(stopped) if err.chain().find_map(oom_in).is_none() => stopped.to_string(),
        _ => format!("error: {}", message(err)),
    };
    trainguard::console::logging::to_stderr(&text);
    trainguard::console::logging::in_file_only(&text);
}

/// What went wrong, whole: an out-of-memory's advice, or the error chain's messages without
/// libtorch's C++ backtrace (the lines from "Exception raised from" on), at most 21 lines.
/// Both stderr and torchrun's error file (whose summary shows it) get this text.
fn message(err: &anyhow::Error) -> String {
    if let Some(f) = err.chain().find_map(oom_in) {
        return f.advice();
    }
    let text = causes(err).join(": ");
    text.lines()
        .take_while(|l| !l.starts_with("Exception raised from"))
        .take(21)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The error chain's messages, outermost first, without a cause whose text its wrapper already
/// ends with (`#[error("init_from: {0}")]` shows its source, which the chain then lists again).
fn causes(err: &anyhow::Error) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for text in err.chain().map(|c| c.to_string()) {
        if !out.last().is_some_and(|outer| outer.ends_with(&text)) {
            out.push(text);
        }
    }
    out
}

/// The exit code for an error chain: the first cause that names one decides.
fn exit_code(err: &anyhow::Error) -> i32 {
    use trainguard::train::TrainError;
    for cause in err.chain() {
        if let Some(earlier) = cause.downcast_ref::<attempts::EarlierFailure>() {
            return earlier.0.code;
        }
        if cause.is::<config::ConfigError>()
            || cause.is::<run_plan::PlanError>()
            || cause.is::<trainguard::memory::allocator::AllocatorError>()
            || cause.is::<distributed::EnvError>()
            || matches!(
                cause.downcast_ref::<distributed::DistError>(),
                Some(distributed::DistError::Backend(_))
            )
        {
            return exit::CONFIG;
        }
        if cause.downcast_ref::<trainguard::planner::PlannerError>().is_some_and(|e| e.is_usage())
            || cause.downcast_ref::<trainguard::notify::NotifyError>().is_some_and(|e| e.is_usage())
        {
            return exit::CONFIG;
        }
        if cause.downcast_ref::<trainguard::data::DataError>().is_some_and(|e| e.is_usage())
            || trainguard::data::prepare::is_usage(cause)
            || trainguard::sample::is_usage(cause)
            || trainguard::eval::is_usage(cause)
            || trainguard::hf::is_usage(cause)
        {
            return exit::CONFIG;
        }
        if cause.downcast_ref::<trainguard::report::ReportError>().is_some_and(|e| e.is_usage())
            || cause.downcast_ref::<trainguard::trace::TraceError>().is_some_and(|e| e.is_usage())
        {
            return exit::CONFIG;
        }
        if matches!(
            cause.downcast_ref::<trainguard::data::prepare::PrepareError>(),
            Some(trainguard::data::prepare::PrepareError::Interrupted)
        ) {
            return exit::INTERRUPTED;
        }
        if oom_in(cause).is_some() {
            return exit::OUT_OF_MEMORY;
        }
        match cause.downcast_ref::<TrainError>() {
            Some(TrainError::Interrupted { .. }) => return exit::INTERRUPTED,
            Some(TrainError::NonFinite { .. } | TrainError::Diverged { .. }) => return exit::NONFINITE,
            Some(TrainError::Guard(trainguard::guard::GuardError::NotDeterministic { .. })) => {
                return exit::NOT_DETERMINISTIC
            }
            Some(t) if t.is_usage() => return exit::CONFIG,
            _ => {}
        }
    }
    exit::FAILURE
}

/// The unrecoverable out-of-memory behind an error, wherever it sits in the chain.
fn oom_in<'a>(cause: &'a (dyn std::error::Error + 'static)) -> Option<&'a trainguard::guard::OomFailure> {
    if let Some(t) = cause.downcast_ref::<train::TrainError>() {
        return t.oom();
    }
    match cause.downcast_ref::<trainguard::guard::GuardError>() {
        Some(trainguard::guard::GuardError::OutOfMemory(f)) => Some(f),
        _ => None,
    }
}
