//! CLI entry: parse, run, map the error chain to a documented exit code (the codes are in
//! `trainguard::job::exit`; the mapping lives here, the one place that sees every error type).
use anyhow::Context;
use clap::Parser;
mod cli;
use cli::{Cli, Command, ConfigArgs, ConfigCommand, TrainArgs};
use trainguard::job::interrupt::Interrupter;
use trainguard::job::{attempts, deadline, exit, stop_record};
use trainguard::train::{Resume, TrainError};
use trainguard::{checkpoint, config, distributed, run_plan, train};

fn main() {
    deadline::process_start(); // train.max_duration counts from here
    trainguard::console::logging::init();
    let cli = parse_command_line();
    let training = matches!(cli.command, Command::Train(_));
    let result = match cli.command {
        Command::Train(args) => run_train(&args),
        Command::Config(ConfigCommand::Show(args)) => show_config(&args),
        Command::Env(args) => show_env(&args),
        Command::Plan(args) => trainguard::planner::run(&args).map_err(Into::into),
        Command::Report(args) => run_report(&args),
        Command::Prepare(args) => run_prepare(&args),
        Command::Sample(args) => run_sample(&args),
        Command::Export(args) => run_export(&args),
        Command::Trace(args) => run_trace(&args),
    };
    if let Err(err) = result {
        report(&err);
        let code = exit_code(&err);
        // Under torchrun: tell the agent the real cause.
        if let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE") {
            let kind = exit::kind_name(code);
            if let Err(e) = distributed::write_error_file(std::path::Path::new(&path), kind, &message(&err)) {
                trainguard::console::logging::to_stderr(&format!(
                    "warning: cannot write TORCHELASTIC_ERROR_FILE {}: {e}",
                    path.to_string_lossy()
                ));
            }
        }
        // Under torchrun, what a restart would meet again ends the job (src/attempts.rs).
        if let Some(a) = attempts::Attempt::from_env(env)
            .filter(|_| training && attempts::ends_the_job(code) && !heard_from_a_peer(&err))
        {
            let file = failure_file(&a);
            if let Err(e) = attempts::record_failure(
                &file,
                &attempts::Failure { restart_count: a.restart_count, code, message: message(&err) },
            ) {
                trainguard::console::logging::to_stderr(&format!(
                    "warning: cannot record the failure in {}: {e}; torchrun will restart the group",
                    file.display()
                ));
            }
        }
        std::process::exit(code);
    }
    std::process::exit(exit::SUCCESS);
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
        std::process::exit(exit::FAILURE);
    }
    // `trainguard` alone prints the help and is a usage error, as clap has it.
    std::process::exit(e.exit_code());
}

fn env(key: &str) -> Option<String> {
    std::env::var(key).ok()
}

fn failure_file(a: &attempts::Attempt) -> std::path::PathBuf {
    let (uid, agent) = (trainguard::ffi::os::user_id(), trainguard::ffi::os::parent_pid());
    a.failure_file(env, &std::env::temp_dir(), uid, agent)
}

fn heard_from_a_peer(err: &anyhow::Error) -> bool {
    err.chain().any(|c| c.downcast_ref::<TrainError>().is_some_and(TrainError::heard_from_a_peer))
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

fn run_train(args: &TrainArgs) -> anyhow::Result<()> {
    let attempt = attempts::Attempt::from_env(env);
    if let Some(failed) = attempt.as_ref().and_then(|a| attempts::earlier_failure(&failure_file(a), a)) {
        return Err(attempts::EarlierFailure(failed).into());
    }
    let mut overrides = args.config.overrides.clone();
    if let Some(d) = &args.max_duration {
        config::parse_duration(d)
            .map_err(|why| config::ConfigError::Flag { flag: format!("--max-duration `{d}`"), why })?;
        // As a YAML string, whatever it looks like (`90` would read as a number).
        overrides.push(format!("train.max_duration={}", serde_json::to_string(d)?));
    }
    let cfg = config::load(args.config.config.as_deref(), &overrides)?;
    let launch = distributed::from_process_env()?;
    let elastic = stop_record::under_elastic_agent(|k| std::env::var(k).ok());
    let writer = launch.as_ref().is_none_or(|l| l.rank == 0);
    // Under torchrun a process resumes the run its job started (a restart); after an attempt
    // refused or failed before that, it does what the command asked (src/attempts.rs).
    let resumes_its_run = attempt.as_ref().is_some_and(|a| attempts::started_by(&cfg.out_dir, a));
    // `--overwrite`: rank 0 moves the old run aside where the ranks compare their start (a
    // refusal there is one every rank hears of).
    let (resume, set_aside) = Resume::asked(args.resume.as_deref(), args.overwrite, resumes_its_run);
    let env = run_plan::Environment {
        resuming: resume.may_resume(),
        ..run_plan::Environment::detect(launch.as_ref())
    };
    let mut plan = run_plan::RunPlan::build(cfg, env)?;
    if let (Some(a), Some(l)) = (&attempt, launch.as_ref().filter(|l| l.rank == 0)) {
        if let Some(warning) = a.unnamed_across(l.world_size.div_ceil(l.local_world_size.max(1))) {
            tracing::warn!("{warning}");
        }
    }
    if let Some(note) = set_aside {
        tracing::info!("this torchrun job started the run in {}: {note}", plan.config.out_dir.display());
    }
    // An earlier run's stop record is removed once the ranks agree to start
    // (src/train/run_dir.rs): a command refused before then leaves it.
    if plan.memory_limit.is_some() && !plan.device.is_cuda() {
        trainguard::memory::prepare_cpu_limit(); // before the signal thread exists
    }
    // Before the signal thread and before CUDA creates a cuBLAS handle.
    trainguard::determinism::prepare_env(plan.config.deterministic);
    let stop = Interrupter::new();
    let out = plan.config.out_dir.clone();
    stop.install_signal_handler(
        "finishing the current step, then checkpointing",
        "--resume auto continues from the last complete checkpoint, if one was written",
        move || second_signal(&out, writer, elastic),
    )
    .context("cannot install the SIGINT/SIGTERM handler")?;
    if let tch::Device::Cuda(i) = plan.device {
        // Before the process group: NCCL and whatever CUDA work names no device use this one.
        trainguard::ffi::set_current_device(i)
            .with_context(|| format!("cannot make cuda:{i} the current device"))?;
    }
    // Under a launcher (RANK set) there is always a group, world size 1 included.
    let mut group = match &launch {
        Some(l) => {
            let backend = distributed::Dist::choose_backend(plan.config.dist.backend, plan.device)?;
            let group = distributed::Dist::init(
                l,
                backend,
                plan.device,
                plan.config.dist.timeout_s,
                plan.time_limit,
            )?;
            carry_deadline(&mut plan, l, &group);
            Some(group)
        }
        None => None,
    };
    if let Some(notice) = group.as_ref().and_then(|g| g.stop_notice()) {
        let _ = STOP_NOTICE.set(notice);
    }
    // Rank 0 has written `stop.json` (finished, or stopped and resumable) before `train` returns.
    let out_dir = &plan.config.out_dir;
    match train::train(&plan, &resume, &stop, group.as_mut()) {
        Ok(_) => Ok(()),
        Err(err @ TrainError::Interrupted { .. }) => {
            if elastic {
                // torchrun restarts a worker that exits non-zero: a planned stop must end the job.
                tracing::warn!(
                    "{err}; exiting 0 so that torchrun does not restart the group ({} says resumable)",
                    stop_record::path(out_dir).display()
                );
                return Ok(());
            }
            Err(anyhow::Error::new(err).context("training failed"))
        }
        Err(e) => Err(anyhow::Error::new(e).context("training failed")),
    }
}

/// How this rank tells its peers that a second signal ends it (set once the group exists).
static STOP_NOTICE: std::sync::OnceLock<distributed::StopNotice> = std::sync::OnceLock::new();

/// A second SIGINT/SIGTERM: the process exits at once, from the signal thread. Rank 0 records
/// the stop with the newest complete checkpoint (what `--resume auto` continues from; a write in
/// progress is not one; with none, no record: nothing to requeue), and under torchrun the exit
/// is 0, as for any planned stop.
fn second_signal(out_dir: &std::path::Path, writer: bool, elastic: bool) -> i32 {
    // Peers whose next collective fails on this exit read that it was a planned stop.
    if let Some(notice) = STOP_NOTICE.get() {
        notice.announce();
    }
    let newest = checkpoint::store::list(&checkpoint::store::root(out_dir)).pop();
    if let (Some((step, path)), true) = (&newest, writer) {
        if let Err(e) =
            stop_record::write(out_dir, &stop_record::StopRecord::stopped(*step, "signal", Some(path)))
        {
            trainguard::console::logging::to_stderr(&format!(
                "warning: cannot write the stop record {}: {e}",
                stop_record::path(out_dir).display()
            ));
        }
    }
    match (elastic, newest) {
        // Any other code would make torchrun restart the group the person stopped.
        (true, _) => exit::SUCCESS,
        (false, Some(_)) => exit::INTERRUPTED,
        // Exit 4 promises a checkpoint to resume from: with none yet, it is a failure.
        (false, None) => {
            // Not `eprintln!`: on a closed stderr (`| tee` gone with the Ctrl-C) it panics, and
            // the signal thread would die before the exit, deaf to every later signal.
            trainguard::console::logging::to_stderr(
                "no checkpoint was written yet: nothing to resume from (exit 1)",
            );
            exit::FAILURE
        }
    }
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

/// Under torchrun the time limit ends at the job's deadline, which its first attempt set: a
/// restart trains only for what is left of it (src/deadline.rs).
fn carry_deadline(plan: &mut run_plan::RunPlan, launch: &distributed::DistEnv, group: &distributed::Dist) {
    if plan.time_limit.is_none() {
        return;
    }
    match group.job_deadline {
        Some(job) => {
            let started = deadline::started_unix_s();
            plan.time_limit = Some(deadline::limit_until(job.unix_ms, started));
            if job.earlier && launch.rank == 0 {
                let left = (job.unix_ms as f64 / 1000.0 - deadline::now_unix_s()).max(0.001);
                tracing::info!("torchrun restart: train.max_duration {left:.3}s is what is left of the deadline the job's first attempt set");
            }
        }
        // Once per node that restarted: rank 0's node may not have (its count is its own).
        None if launch.restart_count > 0 && launch.local_rank == 0 => {
            tracing::warn!("torchrun restart {} without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1?): train.max_duration counts from this restart, not from the job's start", launch.restart_count);
        }
        None => {}
    }
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
        if cause.downcast_ref::<trainguard::planner::PlannerError>().is_some_and(|e| e.is_usage()) {
            return exit::CONFIG;
        }
        if cause.downcast_ref::<trainguard::data::DataError>().is_some_and(|e| e.is_usage())
            || trainguard::data::prepare::is_usage(cause)
            || trainguard::sample::is_usage(cause)
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
            Some(TrainError::NonFinite { .. }) => return exit::NONFINITE,
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
