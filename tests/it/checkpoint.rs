//! Unattended runs on the real binary: exact resume, kill -9 at random moments, SIGTERM, a
//! time limit, corrupt checkpoints, non-finite losses, a changed model.
use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use trainguard::checkpoint::store;

const RUN: [&str; 5] = [
    "train.max_steps=40",
    "train.warmup_steps=5",
    "train.eval_interval=10",
    "checkpoint.interval=10",
    "model.dropout=0.1",
];

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    RUN.iter().copied().chain(extra.iter().copied()).collect()
}

fn checkpoint_steps(out: &Path) -> Vec<u64> {
    store::list(&store::root(out)).into_iter().map(|(s, _)| s).collect()
}

fn newest_checkpoint(out: &Path) -> PathBuf {
    store::list(&store::root(out)).pop().expect("a checkpoint").1
}

#[test]
fn stop_and_resume_is_bitwise_identical_to_a_straight_run() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = train(a.path(), "configs/debug.yaml", &sets(&[])).ok();
    let first = train(b.path(), "configs/debug.yaml", &sets(&["faults.interrupt_at_step=20"]));
    assert_eq!(first.code(), 4, "{}", first.stderr());
    assert_eq!(checkpoint_steps(b.path()), [10, 20]);
    let mut cmd = command(b.path(), "configs/debug.yaml", &sets(&[]));
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, b.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], 20);
    for key in ["step", "loss", "lr", "grad_norm", "val_loss", "micro_batch"] {
        assert_eq!(series(&straight.metrics(), key), series(&resumed.metrics(), key), "{key} differs");
    }
    assert_eq!(resumed.metrics().len(), 40);
    let (ca, cb) = (newest_checkpoint(a.path()), newest_checkpoint(b.path()));
    assert_bitwise_equal(&ca.join("model.safetensors"), &cb.join("model.safetensors"));
    assert_bitwise_equal(&ca.join("optimizer.safetensors"), &cb.join("optimizer.safetensors"));
    assert_bitwise_equal(&a.path().join("model.safetensors"), &b.path().join("model.safetensors"));
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cb.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(
        (state["step"].as_u64(), state["optimizer"]["steps"].as_u64(), state["micro_steps"].as_u64()),
        (Some(40), Some(40), Some(160))
    );
    // The summary is the whole run's (its time continues metrics.jsonl's), and says what this
    // session ran beside it.
    let summary = &resumed.events_of("run_finished")[0];
    let last_elapsed = resumed.metrics()[39]["elapsed_s"].as_f64().unwrap();
    let elapsed = summary["elapsed_s"].as_f64().unwrap();
    assert!(elapsed >= last_elapsed && elapsed < last_elapsed + 5.0, "{elapsed} vs {last_elapsed}");
    assert_eq!(summary["session_steps"].as_u64(), Some(20));
    assert!(summary["session_elapsed_s"].as_f64().unwrap() < elapsed);
    let tokens: f64 = resumed.metrics().iter().map(|m| m["tokens"].as_f64().unwrap()).sum();
    assert!((summary["tokens_per_s"].as_f64().unwrap() - tokens / elapsed).abs() < 1e-6 * tokens / elapsed);
}

/// A checkpoint saved before a kernels switch was removed holds the switch in its config.yaml
/// (every key is saved): `--resume auto` still continues from it, rather than setting it aside
/// as corrupt and starting over at step 0.
#[test]
fn a_checkpoint_saved_with_a_since_removed_switch_still_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let base =
        ["train.max_steps=4", "train.warmup_steps=0", "train.eval_interval=0", "checkpoint.interval=2"];
    let first =
        train(dir.path(), "configs/debug.yaml", &[&base[..], &["faults.interrupt_at_step=2"]].concat());
    assert_eq!(first.code(), 4, "{}", first.stderr());
    let saved = newest_checkpoint(dir.path()).join(store::CONFIG_FILE);
    let yaml = std::fs::read_to_string(&saved).unwrap().replacen(
        "kernels:\n",
        "kernels:\n  loss_blocks_per_sm: 0\n  loss_row_in_registers: false\n",
        1,
    );
    std::fs::write(&saved, yaml).unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &base);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, dir.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], 2, "{}", resumed.stderr());
}

#[test]
fn kill_9_at_random_moments_never_loses_a_complete_checkpoint() {
    let (plain, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // An uneven split (30 = 8 + 8 + 8 + 6): exact resume holds for it too.
    let long = [
        "train.max_steps=200",
        "train.warmup_steps=10",
        "train.eval_interval=50",
        "checkpoint.interval=3",
        "checkpoint.keep_last=2",
        "train.global_batch_size=30",
    ];
    let reference = train(plain.path(), "configs/debug.yaml", &long).ok();
    let mut kills = 0;
    let mut rng = 0x5eed_u64;
    const KILLS: usize = 12;
    for attempt in 0..KILLS + 1 {
        let newest_before = checkpoint_steps(killed.path()).last().copied();
        let resumed_before = run_events(killed.path(), "resumed");
        let mut cmd = command(killed.path(), "configs/debug.yaml", &long);
        let log_path = plain.path().join(format!("attempt-{attempt}.log"));
        cmd.args(["--resume", "auto"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap());
        let mut child = cmd.spawn().unwrap();
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        // The delay counts from the attempt's "batch:" log line (model built, about to train): on
        // a loaded machine start-up alone can take longer than a fixed delay, and kills that only
        // ever land in start-up would test nothing about checkpoints.
        let delay = Duration::from_millis(20 + (rng >> 33) % 900);
        let mut started: Option<Instant> = None;
        let finished = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if started.is_none()
                && std::fs::read_to_string(&log_path).is_ok_and(|l| l.contains("batch: global"))
            {
                started = Some(Instant::now());
            }
            if kills < KILLS && started.is_some_and(|t| t.elapsed() >= delay) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if finished.is_none() {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            kills += 1;
        }
        // Every checkpoint directory on disk is complete and loads.
        for (_, dir) in store::list(&store::root(killed.path())) {
            store::load_checkpoint(&dir).unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
        }
        // A restart that got far enough to resume started from the newest complete checkpoint.
        let resumed = run_events(killed.path(), "resumed");
        if resumed.len() > resumed_before.len() {
            let step = resumed.last().unwrap()["step"].as_u64();
            assert_eq!(step, newest_before, "attempt {attempt} resumed from the wrong checkpoint");
        }
        if let Some(status) = finished {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            assert!(status.success(), "attempt {attempt} failed ({status}):\n{log}");
            break;
        }
    }
    assert!(kills >= 10, "only {kills} kills happened");
    // The kills landed while training, not only during start-up: most restarts resumed from a
    // checkpoint, each from a later step than the one before.
    let resumed: Vec<u64> =
        run_events(killed.path(), "resumed").iter().filter_map(|e| e["step"].as_u64()).collect();
    assert!(
        resumed.len() >= KILLS / 2,
        "only {} of {kills} restarts resumed from a checkpoint: {resumed:?}",
        resumed.len()
    );
    assert!(resumed.windows(2).all(|w| w[0] <= w[1]) && resumed.iter().any(|&s| s >= 30), "{resumed:?}");
    assert_eq!(checkpoint_steps(killed.path()).last(), Some(&200), "the run finished");
    assert_bitwise_equal(&plain.path().join("model.safetensors"), &killed.path().join("model.safetensors"));
    let killed_metrics = read_jsonl(&killed.path().join("metrics.jsonl"));
    assert_eq!(
        series(&reference.metrics(), "loss"),
        series(&killed_metrics, "loss"),
        "metrics rebuilt step for step"
    );
}

fn run_events(dir: &Path, kind: &str) -> Vec<serde_json::Value> {
    read_jsonl(&dir.join("events.jsonl")).into_iter().filter(|e| e["event"] == kind).collect()
}

#[test]
fn sigterm_checkpoints_the_last_completed_step_and_exits_4() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd =
        command(dir.path(), "configs/debug.yaml", &["train.max_steps=100000", "checkpoint.interval=0"]);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let t0 = Instant::now();
    while read_jsonl(&metrics).len() < 5 {
        assert!(t0.elapsed() < Duration::from_secs(60), "run did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = Instant::now();
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(sent.elapsed() < Duration::from_secs(10), "no exit within 10 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(4));
    let done = read_jsonl(&metrics).len() as u64;
    let stopped = run_events(dir.path(), "stopped");
    assert_eq!(stopped[0]["reason"], "signal");
    assert_eq!(checkpoint_steps(dir.path()), [done], "checkpoint at the last completed step");
}

/// Two SIGTERMs 100 ms apart once the first step's checkpoint is in place, `env` set: the
/// output, the steps completed, the newest complete checkpoint, and the time from the second
/// signal to the exit against a step's time.
fn two_signals(dir: &Path, sets: &[&str], env: &[(&str, &str)]) -> (std::process::Output, u64, u64) {
    let mut cmd = command(dir, "configs/bench-10m.yaml", sets);
    cmd.envs(env.iter().copied());
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = dir.join("metrics.jsonl");
    let t0 = Instant::now();
    // The first step's metrics line comes before its checkpoint is renamed into place: wait for
    // both, or the signals can land inside that first write (CI failed on exactly that).
    while read_jsonl(&metrics).is_empty() || checkpoint_steps(dir).is_empty() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(t0.elapsed() < Duration::from_secs(120), "run did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let step_time = read_jsonl(&metrics)[0]["step_time_s"].as_f64().unwrap();
    let term = || Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    term();
    std::thread::sleep(Duration::from_millis(100));
    let second = Instant::now();
    term();
    let output = child.wait_with_output().unwrap();
    let took = second.elapsed().as_secs_f64();
    assert!(String::from_utf8_lossy(&output.stderr).contains("second signal: exiting now"));
    assert!(
        took < step_time / 2.0,
        "exit took {took:.2}s after the second signal; a step takes {step_time:.2}s"
    );
    let done = read_jsonl(&metrics).len() as u64;
    assert!(done < 4, "stopped before the end");
    let newest = *checkpoint_steps(dir).last().expect("the checkpoint of step 1 stands");
    assert!(newest == done || newest + 1 == done, "newest checkpoint {newest} after {done} completed steps");
    (output, done, newest)
}

const SLOW_STEPS: [&str; 4] =
    ["train.max_steps=4", "train.warmup_steps=1", "checkpoint.interval=1", "data.synthetic_tokens=262144"];

/// The second signal does not wait for the step (seconds here): the process exits at once with
/// code 4, whatever it was doing, checkpoint write included, and `--resume auto` continues from
/// the newest complete checkpoint.
#[test]
fn a_second_signal_exits_at_once_and_resume_continues_from_the_last_complete_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (output, _, newest) = two_signals(dir.path(), &SLOW_STEPS, &[]);
    assert_eq!(output.status.code(), Some(4));
    let mut cmd = command(dir.path(), "configs/bench-10m.yaml", &SLOW_STEPS);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, dir.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], newest);
    assert_eq!(series(&resumed.metrics(), "step"), (1..=4).map(serde_json::Value::from).collect::<Vec<_>>());
}

/// The second signal exits from the signal thread while the main thread is inside libtorch
/// (autograd, a kernel). With `exit`, libtorch's static destructors ran under it and the
/// process died of SIGSEGV in 2 to 5 of 6 tries (exit 139, which torchrun takes for a crash
/// and restarts the group over); `_exit` skips them. Fast steps, so the signals land mid-step.
#[test]
fn a_second_signal_mid_step_exits_4_every_time() {
    for i in 0..6u64 {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = command(
            dir.path(),
            "configs/debug.yaml",
            &[
                "train.max_steps=100000",
                "train.warmup_steps=0",
                "checkpoint.interval=1",
                "train.eval_interval=0",
            ],
        );
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let t0 = Instant::now();
        while read_jsonl(&dir.path().join("metrics.jsonl")).len() < 2 {
            assert!(t0.elapsed() < Duration::from_secs(120), "run did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(7 * i));
        let int = || unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        int();
        std::thread::sleep(Duration::from_millis(10 + 5 * i));
        int();
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(4),
            "try {i}: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A run of steps of seconds that writes no checkpoint, stderr piped.
fn slow_run_without_checkpoints(dir: &Path) -> Command {
    let mut cmd = command(
        dir,
        "configs/bench-10m.yaml",
        &["train.max_steps=100", "train.warmup_steps=1", "checkpoint.interval=0", "train.eval_interval=0"],
    );
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    cmd
}

/// Two SIGINTs 100 ms apart once the run's first step is in `metrics.jsonl`.
fn two_sigints_once_it_trains(child: &std::process::Child, dir: &Path) {
    let t0 = Instant::now();
    while read_jsonl(&dir.join("metrics.jsonl")).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(120), "run did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..2 {
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Before any checkpoint exists a second signal leaves nothing to resume from: exit 1, saying
/// so, not the 4 that promises a checkpoint (and no stop record). Steps of seconds, so both
/// signals land inside one, before the stop's checkpoint.
#[test]
fn a_second_signal_before_any_checkpoint_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let child = slow_run_without_checkpoints(dir.path()).spawn().unwrap();
    two_sigints_once_it_trains(&child, dir.path());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("nothing to resume from"), "{stderr}");
    assert!(
        checkpoint_steps(dir.path()).is_empty() && trainguard::job::stop_record::read(dir.path()).is_none()
    );
}

/// The same with stderr closed under the run (`… 2>&1 | tee log`, the tee gone with the
/// Ctrl-C): the second signal still ends it at once with exit 1. Its message once went through
/// `eprintln!`, which panics on a closed stderr: the signal thread died before the exit, and the
/// run went on to its stop's checkpoint and exit 4, deaf to every later signal.
#[test]
fn a_second_signal_with_stderr_closed_still_exits_1_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = slow_run_without_checkpoints(dir.path()).spawn().unwrap();
    drop(child.stderr.take());
    two_sigints_once_it_trains(&child, dir.path());
    let t1 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t1.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running 60 s after the second signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.code(),
        Some(1),
        "exited {:?} after {:.1} s",
        status.code(),
        t1.elapsed().as_secs_f64()
    );
    assert!(
        checkpoint_steps(dir.path()).is_empty() && trainguard::job::stop_record::read(dir.path()).is_none()
    );
}

/// Under torchrun's agent a second signal is a planned stop too: exit 0 (any other code would
/// make torchrun restart the group), and the stop record names the newest complete checkpoint.
#[test]
fn a_second_signal_under_torchrun_exits_0_with_a_stop_record() {
    let dir = tempfile::tempdir().unwrap();
    let (output, _, newest) =
        two_signals(dir.path(), &SLOW_STEPS, &[("TORCHELASTIC_RUN_ID", "second-signal")]);
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let record = trainguard::job::stop_record::read(dir.path()).expect("stop.json");
    assert_eq!((record.step, record.resumable, record.reason.as_deref()), (newest, true, Some("signal")));
    assert!(record.checkpoint.unwrap().ends_with(&format!("step-{newest:08}")));
}

#[test]
fn max_duration_stops_in_time_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd =
        command(dir.path(), "configs/debug.yaml", &["train.max_steps=100000", "checkpoint.interval=0"]);
    cmd.args(["--max-duration", "3s"]);
    let t0 = Instant::now();
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 4, "{}", r.stderr());
    let stopped = run_events(dir.path(), "stopped");
    assert_eq!(stopped[0]["reason"], "time_limit");
    let elapsed = r.summary_or_last_step_elapsed();
    assert!(elapsed < 3.0, "training ran {elapsed:.2}s past a 3s limit");
    assert!(t0.elapsed() < Duration::from_secs(8));
    assert_eq!(checkpoint_steps(dir.path()), [r.metrics().len() as u64]);
}

/// `train.max_duration` counts from the process' start, not from the first step: a start-up
/// of ~2 s (100M synthetic tokens to generate) went uncounted. And a step followed by an
/// evaluation (here 300 batches, many steps' worth) is not started when the evaluation would
/// pass the limit: the first is guessed from the step time, later ones measured. Before, a
/// 12 s limit ran 38 s. The whole process, teardown included, ends within the limit (+0.5 s).
#[test]
fn max_duration_counts_start_up_and_the_evaluation_a_step_brings() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=100000",
        "checkpoint.interval=0",
        "train.eval_interval=5",
        "train.eval_batches=300",
        "data.synthetic_tokens=100000000",
    ];
    let mut cmd = command(dir.path(), "configs/debug.yaml", &sets);
    cmd.args(["--max-duration", "7s"]);
    let t0 = Instant::now();
    let r = run(cmd, dir.path());
    let wall = t0.elapsed().as_secs_f64();
    assert_eq!(r.code(), 4, "{}", r.stderr());
    assert!(wall < 7.5, "the process ran {wall:.2}s for a 7s limit");
    assert!(!r.metrics().is_empty(), "it trained before stopping");
    assert_eq!(checkpoint_steps(dir.path()), [r.metrics().len() as u64]);
}

trait LastElapsed {
    fn summary_or_last_step_elapsed(&self) -> f64;
}

impl LastElapsed for Run {
    fn summary_or_last_step_elapsed(&self) -> f64 {
        self.metrics().last().and_then(|m| m["elapsed_s"].as_f64()).unwrap_or(0.0)
    }
}

#[test]
fn a_truncated_checkpoint_is_skipped_by_auto_and_refused_by_path() {
    let dir = tempfile::tempdir().unwrap();
    train(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=30", "train.warmup_steps=5", "checkpoint.interval=10"],
    )
    .ok();
    let newest = newest_checkpoint(dir.path());
    let model = newest.join("model.safetensors");
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::File::options().write(true).open(&model).unwrap().set_len(len - 100).unwrap();

    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=40", "train.warmup_steps=5", "checkpoint.interval=10"],
    );
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path()).ok();
    let skipped = r.events_of("checkpoint_skipped");
    assert!(skipped[0]["path"].as_str().unwrap().ends_with("step-00000030"), "{skipped:?}");
    assert!(r.stderr().contains("skipping checkpoint") && r.stderr().contains("truncated"), "{}", r.stderr());
    assert_eq!(r.events_of("resumed")[0]["step"], 20);

    std::fs::File::options().write(true).open(&model).unwrap().set_len(len - 100).unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=40", "train.warmup_steps=5"]);
    cmd.arg("--resume").arg(&newest);
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("step-00000030") && r.stderr().contains("truncated"), "{}", r.stderr());
    assert!(!r.stderr().contains("panicked"));
    // The run directory itself given as the checkpoint: named as such, with the two ways on.
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=40", "train.warmup_steps=5"]);
    cmd.arg("--resume").arg(dir.path());
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("is a run directory, not a checkpoint") && r.stderr().contains("--resume auto"),
        "{}",
        r.stderr()
    );
    // Its checkpoints directory: the same two ways on, not "corrupt".
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=40", "train.warmup_steps=5"]);
    cmd.arg("--resume").arg(store::root(dir.path()));
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("is a run's checkpoints directory, not a checkpoint")
            && r.stderr().contains("step-…"),
        "{}",
        r.stderr()
    );
    assert!(!r.stderr().contains("corrupt"), "{}", r.stderr());
}

#[test]
fn a_changed_model_shape_is_refused_naming_the_keys_but_safe_changes_are_logged() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), "configs/debug.yaml", &["train.max_steps=10", "train.warmup_steps=2"]).ok();
    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=20", "train.warmup_steps=2", "model.n_layer=3", "model.vocab_size=300"],
    );
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("model.n_layer: checkpoint 2, config 3")
            && r.stderr().contains("model.vocab_size"),
        "{}",
        r.stderr()
    );
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=20", "train.warmup_steps=2"]);
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path()).ok();
    assert!(r.stderr().contains("train.max_steps: checkpoint 10, config 20"), "{}", r.stderr());
    // A longer schedule moves the learning rate at the step resumed: the log says by how much.
    assert!(
        r.stderr().contains("learning rate at step 10: 3.0000e-4 on the checkpoint's schedule"),
        "{}",
        r.stderr()
    );
}

#[test]
fn non_finite_losses_are_skipped_then_stop_with_exit_5() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=20", "train.warmup_steps=2", "faults.nonfinite_loss_at_steps=[6]"],
    )
    .ok();
    assert_eq!(r.events_of("nonfinite_skipped").len(), 1);
    assert_eq!(r.events_of("nonfinite_skipped")[0]["step"], 6, "step 6: counted from 1");
    assert!(r.metrics()[5]["loss"].is_null() && r.metrics()[5]["step"] == 6, "NaN is written as null");

    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=20",
            "train.warmup_steps=2",
            "faults.nonfinite_loss_at_steps=[6, 7, 8]",
            "nan.max_consecutive=3",
        ],
    );
    assert_eq!(r.code(), 5, "{}", r.stderr());
    let skips = r.events_of("nonfinite_skipped");
    assert_eq!(skips.iter().map(|e| e["consecutive"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(run_events(dir.path(), "stopped")[0]["reason"], "nonfinite");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(newest_checkpoint(dir.path()).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (state["nonfinite_skips"].as_u64(), state["optimizer"]["steps"].as_u64()),
        (Some(3), Some(5)),
        "skipped updates left the optimizer untouched"
    );
    // Every step the checkpoint counts has its metrics line, the last skipped one included: a
    // resume from it (at step 8) leaves no gap.
    assert_eq!(state["step"].as_u64(), Some(8));
    let logged: Vec<u64> = r.metrics().iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(logged, (1..=8).collect::<Vec<u64>>());
}

/// Muon through the real binary: it learns (the loss falls well below the uniform guess), and a
/// run stopped at step 20 and resumed equals the straight run bit for bit (the matrices'
/// momentum and AdamW's moments of the rest go through the checkpoint).
#[test]
fn muon_trains_and_resumes_bit_for_bit() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let muon = sets(&["optimizer.name=muon"]);
    let straight = train(a.path(), "configs/debug.yaml", &muon).ok();
    let losses = series(&straight.metrics(), "loss");
    let (first, last) = (losses[0].as_f64().unwrap(), losses.last().unwrap().as_f64().unwrap());
    assert!(last < 0.7 * first, "muon learns: loss {first} -> {last}");
    let stopped =
        train(b.path(), "configs/debug.yaml", &[&muon[..], &["faults.interrupt_at_step=20"]].concat());
    assert_eq!(stopped.code(), 4, "{}", stopped.stderr());
    let state = std::fs::read_to_string(newest_checkpoint(b.path()).join("trainer_state.json")).unwrap();
    assert!(state.contains("\"kind\": \"muon\""), "{state}");
    let mut cmd = command(b.path(), "configs/debug.yaml", &muon);
    cmd.args(["--resume", "auto"]);
    run(cmd, b.path()).ok();
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let (ca, cb) = (newest_checkpoint(a.path()), newest_checkpoint(b.path()));
        assert_bitwise_equal(&ca.join(file), &cb.join(file));
    }
    let optimizer = tensors(&newest_checkpoint(b.path()).join("optimizer.safetensors"));
    assert!(
        optimizer.iter().any(|(k, _)| k == "momentum_buffer.h.0.mlp.c_fc.weight"),
        "a block matrix's momentum"
    );
    assert!(optimizer.iter().any(|(k, _)| k == "exp_avg.wte.weight"), "the embedding is AdamW's");
}

/// `nan.max_consecutive` counts non-finite updates in a row across a stop and resume: a run
/// preempted between bad steps (here after steps 6 and 7 were skipped) stops at the third, as
/// the straight run does, instead of starting the count again at every restart.
#[test]
fn the_count_of_nonfinite_updates_in_a_row_goes_on_across_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let bad = [
        "train.max_steps=20",
        "train.warmup_steps=2",
        "faults.nonfinite_loss_at_steps=[6, 7, 8]",
        "nan.max_consecutive=3",
    ];
    let first =
        train(dir.path(), "configs/debug.yaml", &[&bad[..], &["faults.interrupt_at_step=7"]].concat());
    assert_eq!(first.code(), 4, "{}", first.stderr());
    let mut cmd = command(dir.path(), "configs/debug.yaml", &bad);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, dir.path());
    assert_eq!(resumed.code(), 5, "the third in a row stops the run: {}", resumed.stderr());
    let skips = run_events(dir.path(), "nonfinite_skipped");
    assert_eq!(skips.iter().map(|e| e["consecutive"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3]);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(newest_checkpoint(dir.path()).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!((state["step"].as_u64(), state["nonfinite_streak"].as_u64()), (Some(8), Some(3)));
}

/// A stop right after an interval checkpoint: the checkpoint of that step is not written a second
/// time, and the stop is reported as a stop (with how to resume), not as an error.
#[test]
fn a_stop_right_after_an_interval_checkpoint_writes_it_once_and_is_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=10",
            "train.warmup_steps=0",
            "checkpoint.interval=5",
            "faults.interrupt_at_step=5",
        ],
    );
    assert_eq!(r.code(), 4, "{}", r.stderr());
    let saved: Vec<u64> =
        r.events_of("checkpoint_saved").iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(saved, [5], "step 5 written once");
    let stopped = r.events_of("stopped");
    assert_eq!(
        stopped[0]["checkpoint"],
        r.events_of("checkpoint_saved")[0]["path"],
        "the stop points at the checkpoint just written"
    );
    let err = r.stderr();
    assert!(err.contains("stopped at step 5 (signal); `--resume auto` continues from"), "{err}");
    assert!(
        !err.contains("error:") && !err.contains("training failed"),
        "a planned stop is not a failure:\n{err}"
    );
}

fn resume_auto(dir: &Path, sets: &[&str]) -> Run {
    let mut cmd = command(dir, "configs/debug.yaml", sets);
    cmd.args(["--resume", "auto"]);
    run(cmd, dir)
}

/// Steps in `metrics.jsonl`, in file order: a resumed run rewrites from the step it resumed at.
fn metric_steps(dir: &Path) -> Vec<u64> {
    read_jsonl(&dir.join("metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect()
}

/// A newest checkpoint whose bytes changed in place (same size, header intact) is passed over by
/// its checksum; resumed at the one before, the run sets it aside, so `keep_last: 1` keeps the
/// run's own new checkpoint, and after a crash `--resume auto` continues from that one.
#[test]
fn a_corrupt_newest_is_set_aside_and_a_crash_after_resumes_from_the_runs_own() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["train.warmup_steps=5", "train.eval_interval=0"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    train(dir.path(), "configs/debug.yaml", &with(&["train.max_steps=30", "checkpoint.interval=10"])).ok();
    let thirty = newest_checkpoint(dir.path());
    let model = thirty.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let n = bytes.len();
    for b in &mut bytes[n - 64..] {
        *b ^= 0x5a;
    }
    std::fs::write(&model, &bytes).unwrap();

    let later = with(&["train.max_steps=40", "checkpoint.interval=5", "checkpoint.keep_last=1"]);
    let crashed = resume_auto(dir.path(), &[later.clone(), vec!["faults.crash_at_step=27"]].concat());
    assert_eq!(crashed.code(), 1, "{}", crashed.stderr());
    let skipped = crashed.events_of("checkpoint_skipped");
    assert!(skipped[0]["reason"].as_str().unwrap().contains("CRC-32C"), "{skipped:?}");
    assert_eq!(crashed.events_of("resumed")[0]["step"], 20);
    let aside = crashed.events_of("checkpoints_set_aside");
    assert_eq!(aside[0]["steps"], serde_json::json!([30]), "{aside:?}");
    let set_aside_dir = PathBuf::from(aside[0]["to"].as_str().unwrap());
    assert!(set_aside_dir.join("step-00000030/model.safetensors").exists(), "moved, not deleted");
    assert_eq!(checkpoint_steps(dir.path()), [25], "keep_last 1 kept the step just written");

    let r = resume_auto(dir.path(), &later).ok();
    assert_eq!(r.events_of("resumed").last().unwrap()["step"], 25);
    assert_eq!(metric_steps(dir.path()), (1..=40).collect::<Vec<_>>(), "every step once, in order");
}

/// `--resume <older checkpoint>` starts a new line from it: the newer checkpoints of the old
/// line are set aside, so a crash and `--resume auto` continue the new line, not the old one.
/// A stop before any step writes nothing (the resumed checkpoint stands), and a command refused
/// afterwards leaves the stop record as it was.
#[test]
fn resuming_an_older_checkpoint_sets_the_newer_ones_aside() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["train.warmup_steps=5", "train.eval_interval=0", "train.max_steps=40"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    train(dir.path(), "configs/debug.yaml", &with(&["train.max_steps=30", "checkpoint.interval=10"])).ok();
    let ten = store::root(dir.path()).join("step-00000010");
    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &with(&["checkpoint.interval=2", "train.lr=1e-3", "faults.crash_at_step=15"]),
    );
    cmd.arg("--resume").arg(&ten);
    let crashed = run(cmd, dir.path());
    assert_eq!(crashed.code(), 1, "{}", crashed.stderr());
    assert_eq!(crashed.events_of("checkpoints_set_aside")[0]["steps"], serde_json::json!([20, 30]));
    assert_eq!(checkpoint_steps(dir.path()), [10, 12, 14]);
    let saved_before = crashed.events_of("checkpoint_saved").len();

    let stopped = resume_auto(
        dir.path(),
        &with(&["checkpoint.interval=2", "train.lr=1e-3", "faults.interrupt_at_step=14"]),
    );
    assert_eq!(stopped.code(), 4, "{}", stopped.stderr());
    assert_eq!(stopped.events_of("resumed").last().unwrap()["step"], 14, "the new line, not the old step 30");
    assert_eq!(
        stopped.events_of("checkpoint_saved").len(),
        saved_before,
        "no step ran: step 14 was not written again"
    );
    assert!(stopped.events_of("stopped")[0]["checkpoint"].as_str().unwrap().ends_with("step-00000014"));
    let record = std::fs::read_to_string(dir.path().join("stop.json")).unwrap();
    assert!(record.contains(r#""resumable":true"#) && record.contains("step-00000014"), "{record}");

    let refused = train(dir.path(), "configs/debug.yaml", &with(&[]));
    assert_eq!(refused.code(), 2, "a fresh run over this one is refused: {}", refused.stderr());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("stop.json")).unwrap(),
        record,
        "the refusal left the stop record"
    );

    resume_auto(dir.path(), &with(&["checkpoint.interval=2", "train.lr=1e-3"])).ok();
    assert_eq!(metric_steps(dir.path()), (1..=40).collect::<Vec<_>>(), "no gap, no step of the old line");
}

/// Going back to a set-aside checkpoint of step S, where `out_dir` has another line's step S:
/// that one is set aside too, so a crash and `--resume auto` do not continue it, and a stop
/// before the first step writes its checkpoint beside it, not over it.
#[test]
fn resuming_a_set_aside_checkpoint_sets_aside_the_other_lines_checkpoint_of_its_step() {
    let base = ["train.warmup_steps=5", "train.eval_interval=0", "checkpoint.interval=10"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    let weights = |ckpt: &Path| std::fs::read(ckpt.join("model.safetensors")).unwrap();
    // Line 1 to step 20; line 2 from its step 10, with another learning rate, to step 20 too.
    let two_lines = |dir: &Path| {
        train(dir, "configs/debug.yaml", &with(&["train.max_steps=20"])).ok();
        let mut cmd = command(dir, "configs/debug.yaml", &with(&["train.max_steps=20", "train.lr=1e-3"]));
        cmd.arg("--resume").arg(store::root(dir).join("step-00000010"));
        let second = run(cmd, dir).ok();
        let first_line = PathBuf::from(second.events_of("checkpoints_set_aside")[0]["to"].as_str().unwrap())
            .join("step-00000020");
        let second_line = weights(&newest_checkpoint(dir));
        assert_ne!(weights(&first_line), second_line, "two lines");
        (first_line, second_line)
    };
    let back_to = |dir: &Path, ckpt: &Path, fault: &'static str| {
        let mut cmd = command(
            dir,
            "configs/debug.yaml",
            &with(&["train.max_steps=30", "checkpoint.interval=100", fault]),
        );
        cmd.arg("--resume").arg(ckpt);
        run(cmd, dir)
    };

    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (first_line, second_line) = two_lines(a.path());
    let crashed = back_to(a.path(), &first_line, "faults.crash_at_step=25");
    assert_eq!(crashed.code(), 1, "{}", crashed.stderr());
    let aside = crashed.events_of("checkpoints_set_aside").pop().unwrap(); // the log holds each run's events
    assert_eq!(aside["steps"], serde_json::json!([20]), "{aside:?}");
    assert_eq!(
        weights(&PathBuf::from(aside["to"].as_str().unwrap()).join("step-00000020")),
        second_line,
        "moved, not deleted"
    );
    let auto = resume_auto(a.path(), &with(&["train.max_steps=30", "faults.interrupt_at_step=10"]));
    assert_eq!(
        auto.events_of("resumed").last().unwrap()["step"],
        10,
        "not the other line's step 20: {}",
        auto.stderr()
    );

    let (first_line, second_line) = two_lines(b.path());
    let stopped = back_to(b.path(), &first_line, "faults.interrupt_at_step=20");
    assert_eq!(stopped.code(), 4, "{}", stopped.stderr());
    assert_eq!(
        weights(&newest_checkpoint(b.path())),
        weights(&first_line),
        "the stop checkpoint is of the line resumed"
    );
    let aside = stopped.events_of("checkpoints_set_aside").pop().unwrap();
    assert_eq!(
        weights(&PathBuf::from(aside["to"].as_str().unwrap()).join("step-00000020")),
        second_line,
        "the other line's step 20 kept"
    );
}

/// A finished run's final weights are renamed aside when a resume trains past them: `sample`
/// and `export` of the run directory then read the newest checkpoint, not weights older than it.
/// Renamed, not deleted: with the newest checkpoint corrupt and passed over, they are the only copy
/// of its step.
#[test]
fn a_resume_that_trains_on_moves_the_stale_final_weights_aside() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["train.warmup_steps=2", "train.eval_interval=0", "checkpoint.interval=5"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    train(dir.path(), "configs/debug.yaml", &with(&["train.max_steps=5"])).ok();
    let fin = dir.path().join("model.safetensors");
    let step5 = std::fs::read(&fin).unwrap();
    let past = resume_auto(dir.path(), &with(&["train.max_steps=5"])).ok();
    assert!(
        past.stderr().contains("nothing to train") && fin.exists(),
        "nothing trained: the final weights stand"
    );
    let r = resume_auto(dir.path(), &with(&["train.max_steps=10", "faults.interrupt_at_step=7"]));
    assert_eq!(r.code(), 4, "{}", r.stderr());
    assert!(!fin.exists(), "step 5's final weights outlived a run stopped at step 7");
    let aside = |d: &std::path::Path| -> Vec<std::path::PathBuf> {
        let mut found: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("model.set-aside-"))
            .map(|e| e.path())
            .collect();
        found.sort();
        found
    };
    let moved = aside(dir.path());
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_eq!(std::fs::read(&moved[0]).unwrap(), step5, "moved as they were");
    assert!(r.stderr().contains("nothing deleted"), "{}", r.stderr());
    let event = &r.events_of("final_weights_set_aside")[0];
    assert_eq!(
        (event["resumed_step"].as_u64(), event["to"].as_str()),
        (Some(5), moved[0].to_str()),
        "{event}"
    );
    resume_auto(dir.path(), &with(&["train.max_steps=10"])).ok();
    assert!(fin.exists(), "the final weights of step 10");

    // The newest checkpoint corrupt: the resume falls back to step 7, and step 10's final
    // weights, the only good copy of step 10, are kept aside with it.
    let step10 = std::fs::read(&fin).unwrap();
    let newest = dir.path().join("checkpoints/step-00000010/model.safetensors");
    std::fs::write(&newest, &std::fs::read(&newest).unwrap()[..1000]).unwrap();
    let r = resume_auto(dir.path(), &with(&["train.max_steps=8"]));
    assert_eq!(r.code(), 0, "{}", r.stderr());
    assert!(
        aside(dir.path()).iter().any(|p| std::fs::read(p).unwrap() == step10),
        "step 10's weights were lost: {}",
        r.stderr()
    );

    // Every checkpoint corrupt: `--resume auto` starts at step 0, and step 8's final weights,
    // the only good copy of the run's model, go aside, not under the new run's.
    let step8 = std::fs::read(&fin).unwrap();
    for (_, ckpt) in store::list(&store::root(dir.path())) {
        let weights = ckpt.join("model.safetensors");
        std::fs::write(&weights, &std::fs::read(&weights).unwrap()[..1000]).unwrap();
    }
    let r = resume_auto(dir.path(), &with(&["train.max_steps=3", "checkpoint.interval=0"]));
    assert_eq!(r.code(), 0, "{}", r.stderr());
    assert!(
        aside(dir.path()).iter().any(|p| std::fs::read(p).unwrap() == step8),
        "step 8's weights were lost: {}",
        r.stderr()
    );
    assert_eq!(r.events_of("final_weights_set_aside")[0]["resumed_step"].as_u64(), Some(0));

    // No checkpoints left (removed to save space): a fresh start keeps the final weights too.
    let step3 = std::fs::read(&fin).unwrap();
    std::fs::remove_dir_all(store::root(dir.path())).unwrap();
    let r = train(dir.path(), "configs/debug.yaml", &with(&["train.max_steps=2", "checkpoint.interval=0"]));
    assert_eq!(r.code(), 0, "{}", r.stderr());
    assert!(
        aside(dir.path()).iter().any(|p| std::fs::read(p).unwrap() == step3),
        "step 3's weights were lost: {}",
        r.stderr()
    );
}

/// A final-weights write that fails part-way (at a file-size limit, as on a full disk) leaves
/// no `.model.safetensors.tmp` behind to hold the space, and says why in the system's words,
/// not tch's debug form of the I/O error.
#[test]
fn a_final_weights_write_that_fails_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=2", "train.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=0"],
    );
    // The weights are ~480 KB (the checkpoint at the end fails first, a warning); every other file the run writes is far below the limit. A write
    // past it fails with EFBIG once SIGXFSZ, which would end the process, is ignored.
    limit_file_size(&mut cmd, 100_000);
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 1, "{}", r.stderr());
    let err = r.stderr();
    assert!(
        err.contains("cannot write weights")
            && err.contains("File too large (os error 27)")
            && !err.contains("IoError("),
        "{err}"
    );
    assert!(!dir.path().join(".model.safetensors.tmp").exists(), "the half-written file stayed");
    assert!(!dir.path().join("model.safetensors").exists());
}

/// A stop whose checkpoint cannot be written (here a file sits where step 3's write begins, a
/// directory, so the write fails with a real I/O error) is not exit 4's "resumable at this
/// step": exit 1, and no stop record, so job scripts do not requeue a run that cannot save.
/// (`checkpoints` itself a file is refused before the run starts.)
#[test]
fn a_stop_whose_checkpoint_cannot_be_written_exits_1_and_leaves_no_stop_record() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("checkpoints")).unwrap();
    std::fs::write(dir.path().join("checkpoints/.tmp-step-00000003"), "not a directory").unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=10",
            "train.warmup_steps=2",
            "checkpoint.interval=0",
            "faults.interrupt_at_step=3",
        ],
    );
    assert_eq!(r.code(), 1, "{}", r.stderr());
    assert!(
        r.stderr().contains("stopped at step 3 (signal), but its checkpoint could not be written"),
        "{}",
        r.stderr()
    );
    assert!(r.stderr().contains("start over at step 0"), "{}", r.stderr());
    assert!(!r.stderr().contains("training goes on"), "it stops: {}", r.stderr());
    assert_eq!(r.events_of("checkpoint_failed")[0]["training_goes_on"], false);
    assert_eq!(trainguard::job::stop_record::read(dir.path()), None);
}

/// `checkpoint.at_end: false` (benchmarks): no checkpoint after the last step and no final
/// weights, while interval checkpoints and a stop's still come.
#[test]
fn at_end_false_writes_nothing_after_the_last_step_but_keeps_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=6",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=4",
        "checkpoint.at_end=false",
    ];
    let r = train(dir.path(), "configs/debug.yaml", &sets).ok();
    assert_eq!(r.metrics().len(), 6);
    assert_eq!(checkpoint_steps(dir.path()), [4]);
    assert!(!dir.path().join("model.safetensors").exists());
    let stopped = tempfile::tempdir().unwrap();
    let r =
        train(stopped.path(), "configs/debug.yaml", &[&sets[..], &["faults.interrupt_at_step=5"]].concat());
    assert_eq!(r.code(), 4, "{}", r.stderr());
    assert_eq!(checkpoint_steps(stopped.path()), [4, 5]);
}

/// A new `train.micro_batch_size` at a resume takes effect (the checkpoint's guard size comes
/// back only while the configured size is unchanged), and `tokens_seen` adds each step's own
/// tokens when the global batch changes.
#[test]
fn a_resume_takes_a_new_micro_batch_and_counts_tokens_across_a_batch_change() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["train.warmup_steps=2", "train.eval_interval=0", "checkpoint.interval=5"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    let first =
        train(dir.path(), "configs/debug.yaml", &with(&["train.max_steps=5", "train.micro_batch_size=4"]))
            .ok();
    assert_eq!(series(&first.metrics(), "micro_batch")[0], 4);
    let r = resume_auto(
        dir.path(),
        &with(&["train.max_steps=7", "train.micro_batch_size=8", "train.global_batch_size=16"]),
    )
    .ok();
    let metrics = r.metrics();
    assert_eq!(series(&metrics[5..], "micro_batch"), [8, 8]);
    assert_eq!(series(&metrics[5..], "accumulation"), [2, 2]);
    let tokens: u64 = metrics.iter().map(|m| m["tokens"].as_u64().unwrap()).sum();
    assert_eq!(tokens, 5 * 32 * 64 + 2 * 16 * 64);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(newest_checkpoint(dir.path()).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["tokens_seen"].as_u64(), Some(tokens));
}

/// Counters edited near u64::MAX in `trainer_state.json` (no checksum covers it) stay at the
/// top on resume instead of wrapping to a small count.
#[test]
fn counters_near_their_limit_stay_there_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["train.warmup_steps=2", "train.eval_interval=0", "checkpoint.interval=5"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    train(dir.path(), "configs/debug.yaml", &with(&["train.max_steps=5"])).ok();
    let state_file = newest_checkpoint(dir.path()).join("trainer_state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state_file).unwrap()).unwrap();
    state["tokens_seen"] = (u64::MAX - 10).into();
    state["micro_steps"] = (u64::MAX - 1).into();
    std::fs::write(&state_file, state.to_string()).unwrap();
    resume_auto(dir.path(), &with(&["train.max_steps=7"])).ok();
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(newest_checkpoint(dir.path()).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (state["step"].as_u64(), state["tokens_seen"].as_u64(), state["micro_steps"].as_u64()),
        (Some(7), Some(u64::MAX), Some(u64::MAX))
    );
}

/// A checkpoint refused only once its state is in the model (optimizer state of another shape,
/// its checksum and size stamped to match, as a bug or a hand would leave them) leaves the run
/// it was refused over as it was: the final weights and the stop record stay, and so does the
/// checkpoint (`--resume auto` names it, exit 2).
#[test]
fn a_checkpoint_refused_as_its_state_is_restored_leaves_the_run_directory_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["train.max_steps=4", "train.warmup_steps=1", "checkpoint.interval=2"];
    train(dir.path(), "configs/debug.yaml", &sets).ok();
    let ck = dir.path().join("checkpoints/step-00000004");
    let file = ck.join("optimizer.safetensors");
    let mut tensors = tch::Tensor::read_safetensors(&file).unwrap();
    tensors[0].1 = tch::Tensor::zeros([3, 5], (tch::Kind::Float, tch::Device::Cpu));
    tch::Tensor::write_safetensors(&tensors, &file).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let state_file = ck.join("trainer_state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state_file).unwrap()).unwrap();
    state["files"]["optimizer.safetensors"] = bytes.len().into();
    state["checksums"]["optimizer.safetensors"] = crc32c::crc32c(&bytes).into();
    std::fs::write(&state_file, state.to_string()).unwrap();
    let before = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    let (weights, record) = (before("model.safetensors"), before("stop.json"));
    let r = resume_auto(dir.path(), &["train.max_steps=6", "train.warmup_steps=1", "checkpoint.interval=2"]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("step-00000004 is incomplete or corrupt")
            && r.stderr().contains("has shape [3, 5]"),
        "{}",
        r.stderr()
    );
    assert_eq!((before("model.safetensors"), before("stop.json")), (weights, record), "{}", r.stderr());
    assert_eq!(checkpoint_steps(dir.path()), [2, 4], "nothing set aside");
}

/// A run resumed from another run's checkpoint keeps where its first steps were trained: the
/// checkpoint joins the lineage its own checkpoints carry, a later run from them adds theirs,
/// a resume of the run itself adds nothing, and the log, the `resumed` event and `report` say it.
#[test]
fn a_resume_from_another_runs_checkpoint_keeps_the_lineage() {
    let (a, b, c) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let short = |steps: &'static str| {
        vec![steps, "train.warmup_steps=2", "train.eval_interval=0", "checkpoint.interval=4"]
    };
    train(a.path(), "configs/debug.yaml", &short("train.max_steps=8")).ok();
    let from_a = store::root(a.path()).join("step-00000004");
    let lineage = |ckpt: &Path| -> Vec<(String, u64)> {
        let state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap()).unwrap();
        state["lineage"].as_array().map_or(vec![], |l| {
            l.iter()
                .map(|e| (e["checkpoint"].as_str().unwrap().to_string(), e["step"].as_u64().unwrap()))
                .collect()
        })
    };
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap().display().to_string();
    assert!(lineage(&newest_checkpoint(a.path())).is_empty(), "a run that began here has none");

    let mut cmd = command(b.path(), "configs/debug.yaml", &short("train.max_steps=12"));
    cmd.arg("--resume").arg(&from_a);
    let rb = run(cmd, b.path()).ok();
    let want_b = vec![(canon(&from_a), 4)];
    assert_eq!(lineage(&newest_checkpoint(b.path())), want_b);
    let ev = &rb.events_of("resumed")[0]["lineage"];
    assert_eq!(
        (ev[0]["checkpoint"].as_str(), ev[0]["step"].as_u64()),
        (Some(canon(&from_a).as_str()), Some(4)),
        "{ev}"
    );
    assert!(
        rb.stderr()
            .contains(&format!("this run continues other runs' training: {} (to step 4)", canon(&from_a))),
        "{}",
        rb.stderr()
    );

    // The run resumed in its own directory: the same lineage, nothing added.
    let again = resume_auto(b.path(), &short("train.max_steps=16")).ok();
    let resumed = again.events_of("resumed");
    assert_eq!(
        (resumed.len(), &resumed[1]["step"], resumed[1]["lineage"].as_array().map(Vec::len)),
        (2, &serde_json::json!(12), Some(1)),
        "{resumed:?}"
    );
    assert_eq!(lineage(&newest_checkpoint(b.path())), want_b);

    // From b's checkpoint into c: a's, then b's.
    let from_b = store::root(b.path()).join("step-00000016");
    let mut cmd = command(c.path(), "configs/debug.yaml", &short("train.max_steps=20"));
    cmd.arg("--resume").arg(&from_b);
    run(cmd, c.path()).ok();
    assert_eq!(lineage(&newest_checkpoint(c.path())), vec![(canon(&from_a), 4), (canon(&from_b), 16)]);
    let o = Command::new(bin()).arg("report").arg(c.path()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(String::from_utf8_lossy(&o.stdout).trim()).unwrap();
    assert!(
        html.contains("<th>continues</th>")
            && html.contains(&format!("{} (to step 4) → {} (to step 16)", canon(&from_a), canon(&from_b))),
        "report names the lineage"
    );
}

/// Warmup-stable-decay, and a cooldown branch from a stable-phase checkpoint (`--cooldown`): the
/// main line's rate is the peak from the end of warmup to the decay; the branch starts from the
/// checkpoint's state (its first loss is the main line's at that step, to the bit), decays over
/// all of its steps by the formula (1 − √x by default, the last at the floor), names the branch
/// point in its lineage,
/// and leaves the main line's files as they were.
#[test]
fn a_cooldown_branch_decays_from_a_stable_checkpoint_and_leaves_the_main_line_alone() {
    let (main, branch) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [
        "train.schedule=wsd",
        "train.max_steps=40",
        "train.warmup_steps=5",
        "train.decay_fraction=0.25",
        "checkpoint.interval=10",
        "train.eval_interval=0",
    ];
    let m = train(main.path(), "configs/debug.yaml", &sets).ok();
    let (peak, floor) = (3.0e-3, 3.0e-4); // configs/debug.yaml's lr and min_lr
    let lr_of = |metrics: &[serde_json::Value], step: u64| {
        metrics.iter().find(|x| x["step"] == step).and_then(|x| x["lr"].as_f64()).unwrap()
    };
    let main_metrics = m.metrics();
    assert!((6..=30).all(|s| lr_of(&main_metrics, s) == peak), "stable after the warmup");
    assert!(
        lr_of(&main_metrics, 31) < peak && (lr_of(&main_metrics, 40) - floor).abs() < 1e-15,
        "decays to the floor"
    );
    let before = (std::fs::read(main.path().join("metrics.jsonl")).unwrap(), checkpoint_steps(main.path()));

    let from = store::root(main.path()).join(store::dir_name(20));
    let mut cmd = command(branch.path(), "configs/debug.yaml", &sets);
    cmd.args(["--resume", from.to_str().unwrap(), "--cooldown", "10"]);
    let b = run(cmd, branch.path()).ok();
    let bm = b.metrics();
    assert_eq!(
        bm.iter().map(|x| x["step"].as_u64().unwrap()).collect::<Vec<_>>(),
        (21..=30).collect::<Vec<_>>()
    );
    assert_eq!(
        bm[0]["loss"].as_f64().map(f64::to_bits),
        main_metrics[20]["loss"].as_f64().map(f64::to_bits),
        "step 21 starts from the same weights on both lines"
    );
    for (k, x) in bm.iter().enumerate() {
        let want = floor + (peak - floor) * (1.0 - ((k + 1) as f64 / 10.0).sqrt());
        let got = x["lr"].as_f64().unwrap();
        assert!((got - want).abs() <= 1e-15 * peak, "step {}: lr {got}, formula {want}", x["step"]);
    }
    let resumed = &b.events_of("resumed")[0];
    assert_eq!(resumed["step"], 20);
    assert!(resumed["lineage"].to_string().contains("step-00000020"), "the branch point: {resumed}");
    let after = (std::fs::read(main.path().join("metrics.jsonl")).unwrap(), checkpoint_steps(main.path()));
    assert!(before == after, "the main line is left as it was");
    // Without a checkpoint to branch from, the flag is refused by name.
    let mut cmd = command(branch.path(), "configs/debug.yaml", &sets);
    cmd.args(["--cooldown", "10"]);
    let refused = run(cmd, branch.path());
    assert_eq!(refused.code(), 2, "{}", refused.stderr());
    assert!(refused.stderr().contains("--cooldown 10: needs --resume CHECKPOINT"), "{}", refused.stderr());
}
