//! CLI entry: parse, run, map the error chain to a documented exit code (see `exit`).
use anyhow::Context;
use clap::Parser;
use trainguard::cli::{Cli, Command, ConfigArgs, ConfigCommand};
use trainguard::{config, exit, plan, train};

fn main() {
    init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => run_train(&args),
        Command::Config(ConfigCommand::Show(args)) => show_config(&args),
        Command::Plan(args) => trainguard::planner::run(&args).map_err(Into::into),
    };
    if let Err(err) = result {
        report(&err);
        std::process::exit(exit::code_for(&err));
    }
    std::process::exit(exit::SUCCESS);
}

fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn load(args: &ConfigArgs) -> anyhow::Result<config::Config> {
    Ok(config::load(args.config.as_deref(), &args.overrides)?)
}

fn run_train(args: &ConfigArgs) -> anyhow::Result<()> {
    let cfg = load(args)?;
    let plan = plan::RunPlan::build(cfg, plan::Environment::detect())?;
    train::train(&plan).context("training failed")?;
    Ok(())
}

fn show_config(args: &ConfigArgs) -> anyhow::Result<()> {
    let cfg = load(args)?;
    print!("{}", serde_yaml::to_string(&cfg)?);
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
