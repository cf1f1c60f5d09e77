//! CLI entry: parse, run, map the error chain to a documented exit code (see `exit`).
use anyhow::Context;
use clap::Parser;
use trainguard::cli::{Cli, Command, ConfigArgs, ConfigCommand, TrainArgs};
use trainguard::interrupt::Interrupter;
use trainguard::train::Resume;
use trainguard::{config, dist, exit, plan, train};

fn main() {
    trainguard::logging::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => run_train(&args),
        Command::Config(ConfigCommand::Show(args)) => show_config(&args),
        Command::Env(args) => show_env(&args),
        Command::Plan(args) => trainguard::planner::run(&args).map_err(Into::into),
        Command::Prepare(args) => run_prepare(&args),
        Command::Sample(args) => trainguard::sample::run(&args).map(|text| print!("{text}")).map_err(Into::into),
        Command::Export(args) => run_export(&args),
    };
    if let Err(err) = result {
        report(&err);
        let code = exit::code_for(&err);
        // Under torchrun: tell the agent the real cause.
        if let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE") {
            let kind = exit::kind_name(code);
            let text = err.chain().map(|c| c.to_string().lines().next().unwrap_or_default().to_string()).collect::<Vec<_>>().join(": ");
            if let Err(e) = dist::write_error_file(std::path::Path::new(&path), kind, &text) {
                eprintln!("warning: cannot write TORCHELASTIC_ERROR_FILE {}: {e}", path.to_string_lossy());
            }
        }
        std::process::exit(code);
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
    let launch = dist::from_process_env()?;
    let plan = plan::RunPlan::build(cfg, plan::Environment::detect(launch.as_ref()))?;
    let restarted = launch.as_ref().is_some_and(|l| l.restart_count > 0);
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
    // Under a launcher (RANK set) there is always a group, world size 1 included.
    let mut group = match &launch {
        Some(l) => {
            let backend = dist::Dist::choose_backend(plan.config.dist.backend, plan.device)?;
            Some(dist::Dist::init(l, backend, plan.device, plan.config.dist.timeout_s)?)
        }
        None => None,
    };
    train::train(&plan, &resume, &stop, group.as_mut()).context("training failed")?;
    Ok(())
}

fn run_prepare(args: &trainguard::prepare::PrepareArgs) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let m = trainguard::prepare::run(args)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "prepared {}: {} documents, {} training tokens in {} shard(s), {} validation tokens, {}, vocab {} (EOS {} = {}); {:.1} MB/s, {:.2}M tokens/s",
        args.out.display(),
        m.documents,
        m.train_tokens,
        m.train.len(),
        m.val_tokens,
        serde_json::to_value(m.dtype)?.as_str().unwrap_or_default(),
        m.vocab_size,
        m.eos_token,
        m.eos_id,
        m.input_bytes as f64 / 1e6 / secs,
        (m.train_tokens + m.val_tokens) as f64 / 1e6 / secs
    );
    Ok(())
}

fn run_export(args: &trainguard::cli::ExportArgs) -> anyhow::Result<()> {
    let trained = trainguard::sample::open(&args.target)?;
    let model = trainguard::sample::build(&trained, tch::Device::Cpu)?;
    let files = trainguard::hf::export(&model, trained.dataset.as_deref(), &args.hf)?;
    println!("exported {} to {}: {}", args.target.display(), args.hf.display(), files.join(", "));
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
