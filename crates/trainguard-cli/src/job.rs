//! A training job's life around the run: the command's config and resume choice, the launch
//! (one process, torchrun or SLURM's ranks), the process group, the signal handler and its
//! second signal, the deadline a torchrun restart carries, and what the launcher is told when
//! the job fails (torchelastic's error file, the failure record that ends a torchrun job a
//! restart could not mend). The run itself is `trainguard::train`.
use crate::cli::TrainArgs;
use anyhow::Context;
use trainguard::job::interrupt::Interrupter;
use trainguard::job::{attempts, deadline, exit, stop_record};
use trainguard::train::{Resume, TrainError};
use trainguard::{checkpoint, config, distributed, run_plan, train};

pub(crate) fn run_train(args: &TrainArgs) -> anyhow::Result<()> {
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
    if let Some(steps) = args.cooldown {
        overrides.extend(cooldown_sets(args.resume.as_deref(), steps)?);
    }
    // Inputs named relative to here are recorded absolute: the run directory reads from anywhere.
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let cfg = config::load(args.config.config.as_deref(), &overrides)?.anchored(&cwd);
    let launch = distributed::from_process_env()?;
    let elastic = stop_record::under_elastic_agent(|k| std::env::var(k).ok());
    let writer = launch.as_ref().is_none_or(|l| l.rank == 0);
    // Rank 0 alone notifies; from here on a failure can be told (the error path's `crashed`).
    // A webhook the environment gets wrong is refused now; the sender starts below.
    if writer && trainguard::notify::webhook(&cfg.notify, env)?.is_some() {
        let _ = NOTIFY_SETUP.set((cfg.notify.clone(), cfg.out_dir.clone()));
    }
    // Under torchrun a process resumes the run its job started (a restart); after an attempt
    // refused or failed before that, it does what the command asked (trainguard::job::attempts).
    let resumes_its_run = attempt.as_ref().is_some_and(|a| attempts::started_by(&cfg.out_dir, a));
    // `--overwrite`: rank 0 moves the old run aside where the ranks compare their start (a
    // refusal there is one every rank hears of).
    let (resume, set_aside) = Resume::asked(args.resume.as_deref(), args.overwrite, resumes_its_run);
    let env = run_plan::Environment {
        resuming: resume.may_resume(),
        ..run_plan::Environment::detect(launch.as_ref())
    };
    let mut plan = run_plan::RunPlan::build(cfg, env)?;
    // The same config's run, finished: answered, not refused (docs/checkpoints.md).
    if resume == Resume::Fresh && launch.is_none() {
        if let Some(steps) = train::finished_run(&plan.config) {
            tracing::info!(
                "{} holds this config's run, finished at step {steps}: nothing to train (--overwrite trains it \
                 again; a larger train.max_steps with --resume auto continues it)",
                plan.config.out_dir.display()
            );
            return Ok(());
        }
    }
    if let (Some(a), Some(l)) = (&attempt, launch.as_ref().filter(|l| l.rank == 0)) {
        if let Some(warning) = a.unnamed_across(l.world_size.div_ceil(l.local_world_size.max(1))) {
            tracing::warn!("{warning}");
        }
    }
    if let Some(note) = set_aside {
        tracing::info!("this torchrun job started the run in {}: {note}", plan.config.out_dir.display());
    }
    // An earlier run's stop record is removed once the ranks agree to start
    // (trainguard::train::run_dir): a command refused before then leaves it.
    if plan.memory_limit.is_some() && !plan.device.is_cuda() {
        trainguard::memory::prepare_cpu_limit(); // before the signal thread exists
    }
    // Before the signal thread and before CUDA creates a cuBLAS handle.
    trainguard::determinism::prepare_env(plan.config.deterministic);
    // After the CPU cap's allocator settings, as every thread of the process.
    if let Some(n) = start_notifier()? {
        let _ = NOTIFIER.set(n);
    }
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
    match train::train(&plan, &resume, &stop, group.as_mut(), NOTIFIER.get()) {
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
        // A refusal of the user's input comes before the first step: nothing was trained.
        Err(e) if e.is_usage() => Err(anyhow::Error::new(e).context("refused before training")),
        Err(e) => Err(anyhow::Error::new(e).context("training failed")),
    }
}

/// Rank 0's notifier, once its config names a webhook: the run's reporter feeds it, and the
/// error path tells it of a crash before the process exits.
static NOTIFIER: std::sync::OnceLock<trainguard::notify::Notifier> = std::sync::OnceLock::new();

/// The exit codes whose end is told as `crashed`: a failure the process lived to see (4 is a
/// planned stop, told by its `stopped` event; a killed process is the job script's to tell).
const CRASH_CODES: [i32; 5] =
    [exit::FAILURE, exit::CONFIG, exit::OUT_OF_MEMORY, exit::NONFINITE, exit::NOT_DETERMINISTIC];

/// Before the process exits with `code`: a failure is told as `crashed`, and what is queued is
/// given `notify.timeout_s` at most to go out.
pub(crate) fn notify_end(code: i32, message: &str) {
    // A failure before the sender started (the plan refused) starts it now.
    let started = match NOTIFIER.get() {
        Some(n) => Some(n.clone()),
        None if CRASH_CODES.contains(&code) => start_notifier().unwrap_or_else(|e| {
            trainguard::console::logging::to_stderr(&format!("warning: {e}"));
            None
        }),
        None => None,
    };
    let Some(n) = started else { return };
    if CRASH_CODES.contains(&code) {
        n.crashed(code, exit::kind_name(code), message);
    }
    if !n.flush() {
        trainguard::console::logging::to_stderr(
            "warning: notify: the last notifications did not go out in notify.timeout_s",
        );
    }
}

/// Rank 0's `notify` section and `out_dir`, once the webhook is known to be usable.
static NOTIFY_SETUP: std::sync::OnceLock<(config::notify::NotifyConfig, std::path::PathBuf)> =
    std::sync::OnceLock::new();

fn start_notifier() -> Result<Option<trainguard::notify::Notifier>, trainguard::notify::NotifyError> {
    match NOTIFY_SETUP.get() {
        Some((cfg, out_dir)) => trainguard::notify::Notifier::start(cfg, out_dir, env),
        None => Ok(None),
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

/// `--cooldown STEPS` from the checkpoint `--resume` names: the branch trains STEPS more steps
/// and decays over all of them (train.schedule wsd; the decay's share of max_steps is STEPS of
/// its step + STEPS).
fn cooldown_sets(resume: Option<&str>, steps: u64) -> anyhow::Result<Vec<String>> {
    let flag = |why: String| config::ConfigError::Flag { flag: format!("--cooldown {steps}"), why };
    let path = match resume {
        _ if steps == 0 => return Err(flag("a cooldown of at least one step".into()).into()),
        Some(p) if p != "auto" && p != "none" => std::path::Path::new(p),
        _ => {
            return Err(
                flag("needs --resume CHECKPOINT: the stable-phase checkpoint to branch from".into()).into()
            )
        }
    };
    let at = checkpoint::store::load_state(path)?.step;
    let total = at.checked_add(steps).ok_or_else(|| {
        flag(format!(
            "the checkpoint is at step {at}: the branch would end past step {}, the most a run counts",
            u64::MAX
        ))
    })?;
    Ok(vec![
        "train.schedule=wsd".into(),
        format!("train.max_steps={total}"),
        format!("train.decay_fraction={}", steps as f64 / total as f64),
    ])
}

/// Under torchrun, after a failure: the agent's error file gets the real cause, and what a
/// restart would meet again ends the job (trainguard::job::attempts).
pub(crate) fn tell_the_launcher(err: &anyhow::Error, code: i32, training: bool) {
    // Under torchrun: tell the agent the real cause.
    if let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE") {
        let kind = exit::kind_name(code);
        if let Err(e) = distributed::write_error_file(std::path::Path::new(&path), kind, &crate::message(err))
        {
            trainguard::console::logging::to_stderr(&format!(
                "warning: cannot write TORCHELASTIC_ERROR_FILE {}: {e}",
                path.to_string_lossy()
            ));
        }
    }
    // Under torchrun, what a restart would meet again ends the job (trainguard::job::attempts).
    if let Some(a) = attempts::Attempt::from_env(env)
        .filter(|_| training && attempts::ends_the_job(code) && !heard_from_a_peer(err))
    {
        let file = failure_file(&a);
        if let Err(e) = attempts::record_failure(
            &file,
            &attempts::Failure { restart_count: a.restart_count, code, message: crate::message(err) },
        ) {
            trainguard::console::logging::to_stderr(&format!(
                "warning: cannot record the failure in {}: {e}; torchrun will restart the group",
                file.display()
            ));
        }
    }
}

/// Under torchrun the time limit ends at the job's deadline, which its first attempt set: a
/// restart trains only for what is left of it (trainguard::job::deadline).
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
