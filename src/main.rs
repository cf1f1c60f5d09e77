//! CLI entry: parse, run, map the error chain to a documented exit code (see `exit`).
use anyhow::Context;
use clap::Parser;
use trainguard::cli::{Cli, Command, ConfigArgs, ConfigCommand, TrainArgs};
use trainguard::interrupt::Interrupter;
use trainguard::train::Resume;
use trainguard::{config, exit, plan, train};

fn main() {
    trainguard::logging::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => run_train(&args),
        Command::Config(ConfigCommand::Show(args)) => show_config(&args),
        Command::Env(args) => show_env(&args),
    };
    if let Err(err) = result {
        report(&err);
        std::process::exit(exit::code_for(&err));
    }
    std::process::exit(exit::SUCCESS);
}

fn load(args: &ConfigArgs) -> anyhow::Result<config::Config> {
    Ok(config::load(args.config.as_deref(), &args.overrides)?)
}

fn run_train(args: &TrainArgs) -> anyhow::Result<()> {
    let mut overrides = args.config.overrides.clone();
    if let Some(d) = &args.max_duration {
        overrides.push(format!("train.max_duration={d}"));
    }
    let cfg = config::load(args.config.config.as_deref(), &overrides)?;
    let plan = plan::RunPlan::build(cfg, plan::Environment::detect())?;
    let restarted = std::env::var("TORCHELASTIC_RESTART_COUNT").ok().and_then(|v| v.parse::<u64>().ok()).is_some_and(|n| n > 0);
    let resume = match args.resume.as_deref() {
        Some("auto") => Resume::Auto,
        Some("none") => Resume::Fresh,
        Some(path) => Resume::Path(path.into()),
        None if restarted => Resume::Auto,
        None => Resume::Fresh,
    };
    if plan.memory_limit.is_some() && !plan.device.is_cuda() {
        trainguard::memory::prepare_cpu_limit(); // before the signal thread exists
    }
    let stop = Interrupter::new();
    stop.install_signal_handler().context("cannot install the SIGINT/SIGTERM handler")?;
    train::train(&plan, &resume, &stop).context("training failed")?;
    Ok(())
}

fn show_config(args: &ConfigArgs) -> anyhow::Result<()> {
    let cfg = load(args)?;
    print!("{}", serde_yaml::to_string(&cfg)?);
    Ok(())
}

fn show_env(args: &ConfigArgs) -> anyhow::Result<()> {
    print!("{}", trainguard::envinfo::report(&load(args)?));
    Ok(())
}

/// One clear message on stderr, no backtrace; out-of-memory gets advice on what to change.
fn report(err: &anyhow::Error) {
    if let Some(f) = err.chain().find_map(exit::oom_in) {
        eprintln!("error: {}", f.advice());
        return;
    }
    let chain: Vec<String> = err.chain().map(|c| c.to_string()).collect();
    // libtorch messages carry a C++ backtrace after their first line: keep the first line.
    let text = chain.join(": ");
    let mut lines = text.lines();
    eprintln!("error: {}", lines.next().unwrap_or_default());
    for l in lines.take_while(|l| !l.starts_with("Exception raised from")).take(20) {
        eprintln!("{l}");
    }
}
