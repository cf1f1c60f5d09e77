//! Unattended runs on the real binary: exact resume, kill -9 at random moments, SIGTERM, a
//! time limit, corrupt checkpoints, non-finite losses, a changed model.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use trainguard::checkpoint::store;

const RUN: [&str; 5] = ["train.max_steps=40", "train.warmup_steps=5", "train.eval_interval=10", "checkpoint.interval=10", "model.dropout=0.1"];

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
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cb.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!((state["step"].as_u64(), state["optimizer"]["steps"].as_u64(), state["micro_steps"].as_u64()), (Some(40), Some(40), Some(160)));
}

#[test]
fn kill_9_at_random_moments_never_loses_a_complete_checkpoint() {
    let (plain, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // An uneven split (30 = 8 + 8 + 8 + 6): exact resume holds for it too.
    let long = ["train.max_steps=200", "train.warmup_steps=10", "train.eval_interval=50", "checkpoint.interval=3", "checkpoint.keep_last=2", "train.global_batch_size=30"];
    let reference = train(plain.path(), "configs/debug.yaml", &long).ok();
    let mut kills = 0;
    let mut rng = 0x5eed_u64;
    const KILLS: usize = 12;
    for attempt in 0..KILLS + 1 {
        let newest_before = checkpoint_steps(killed.path()).last().copied();
        let resumed_before = run_events(killed.path(), "resumed");
        let mut cmd = command(killed.path(), "configs/debug.yaml", &long);
        let log_path = plain.path().join(format!("attempt-{attempt}.log"));
        cmd.args(["--resume", "auto"]).stdout(Stdio::null()).stderr(std::fs::File::create(&log_path).unwrap());
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
            if started.is_none() && std::fs::read_to_string(&log_path).is_ok_and(|l| l.contains("batch: global")) {
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
            store::load(&dir).unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
        }
        // A restart that got far enough to resume started from the newest complete checkpoint.
        let resumed = run_events(killed.path(), "resumed");
        if resumed.len() > resumed_before.len() {
            let step = resumed.last().unwrap()["step"].as_u64();
            assert_eq!(step, newest_before, "attempt {attempt} resumed from the wrong checkpoint");
        }
        if let Some(status) = finished {
            assert!(status.success(), "attempt {attempt} failed");
            break;
        }
    }
    assert!(kills >= 10, "only {kills} kills happened");
    // The kills landed while training, not only during start-up: most restarts resumed from a
    // checkpoint, each from a later step than the one before.
    let resumed: Vec<u64> = run_events(killed.path(), "resumed").iter().filter_map(|e| e["step"].as_u64()).collect();
    assert!(resumed.len() >= KILLS / 2, "only {} of {kills} restarts resumed from a checkpoint: {resumed:?}", resumed.len());
    assert!(resumed.windows(2).all(|w| w[0] <= w[1]) && resumed.iter().any(|&s| s >= 30), "{resumed:?}");
    assert_eq!(checkpoint_steps(killed.path()).last(), Some(&200), "the run finished");
    assert_bitwise_equal(&plain.path().join("model.safetensors"), &killed.path().join("model.safetensors"));
    let killed_metrics = read_jsonl(&killed.path().join("metrics.jsonl"));
    assert_eq!(series(&reference.metrics(), "loss"), series(&killed_metrics, "loss"), "metrics rebuilt step for step");
}

fn run_events(dir: &Path, kind: &str) -> Vec<serde_json::Value> {
    read_jsonl(&dir.join("events.jsonl")).into_iter().filter(|e| e["event"] == kind).collect()
}

#[test]
fn sigterm_checkpoints_the_last_completed_step_and_exits_4() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=100000", "checkpoint.interval=0"]);
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

/// The second signal does not wait for the step (seconds here): the process exits at once with
/// code 4, whatever it was doing, checkpoint write included, and `--resume auto` continues from
/// the newest complete checkpoint.
#[test]
fn a_second_signal_exits_at_once_and_resume_continues_from_the_last_complete_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["train.max_steps=4", "train.warmup_steps=1", "checkpoint.interval=1", "data.synthetic_tokens=262144"];
    let mut child = command(dir.path(), "configs/bench-10m.yaml", &sets).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let t0 = Instant::now();
    // The first step's metrics line comes before its checkpoint is renamed into place: wait for
    // both, or the signals can land inside that first write (CI failed on exactly that).
    while read_jsonl(&metrics).is_empty() || checkpoint_steps(dir.path()).is_empty() {
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
    assert_eq!(output.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&output.stderr).contains("second signal: exiting now"));
    assert!(took < step_time / 2.0, "exit took {took:.2}s after the second signal; a step takes {step_time:.2}s");
    let done = read_jsonl(&metrics).len() as u64;
    assert!(done < 4, "stopped before the end");
    let newest = *checkpoint_steps(dir.path()).last().expect("the checkpoint of step 1 stands");
    assert!(newest == done || newest + 1 == done, "newest checkpoint {newest} after {done} completed steps");
    let mut cmd = command(dir.path(), "configs/bench-10m.yaml", &sets);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, dir.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], newest);
    assert_eq!(series(&resumed.metrics(), "step"), (0..4).map(serde_json::Value::from).collect::<Vec<_>>());
}

#[test]
fn max_duration_stops_in_time_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=100000", "checkpoint.interval=0"]);
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
    train(dir.path(), "configs/debug.yaml", &["train.max_steps=30", "train.warmup_steps=5", "checkpoint.interval=10"]).ok();
    let newest = newest_checkpoint(dir.path());
    let model = newest.join("model.safetensors");
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::File::options().write(true).open(&model).unwrap().set_len(len - 100).unwrap();

    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=40", "train.warmup_steps=5", "checkpoint.interval=10"]);
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
}

#[test]
fn a_changed_model_shape_is_refused_naming_the_keys_but_safe_changes_are_logged() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), "configs/debug.yaml", &["train.max_steps=10", "train.warmup_steps=2"]).ok();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=20", "train.warmup_steps=2", "model.n_layer=3", "model.vocab_size=300"]);
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("model.n_layer: checkpoint 2, config 3") && r.stderr().contains("model.vocab_size"), "{}", r.stderr());
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=20", "train.warmup_steps=2"]);
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path()).ok();
    assert!(r.stderr().contains("train.max_steps: checkpoint 10, config 20"), "{}", r.stderr());
}

#[test]
fn non_finite_losses_are_skipped_then_stop_with_exit_5() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(dir.path(), "configs/debug.yaml", &["train.max_steps=20", "train.warmup_steps=2", "faults.nonfinite_loss_at_steps=[5]"]).ok();
    assert_eq!(r.events_of("nonfinite_skipped").len(), 1);
    assert!(r.metrics()[5]["loss"].is_null(), "NaN is written as null");

    let dir = tempfile::tempdir().unwrap();
    let r = train(dir.path(), "configs/debug.yaml", &["train.max_steps=20", "train.warmup_steps=2", "faults.nonfinite_loss_at_steps=[5, 6, 7]", "nan.max_consecutive=3"]);
    assert_eq!(r.code(), 5, "{}", r.stderr());
    let skips = r.events_of("nonfinite_skipped");
    assert_eq!(skips.iter().map(|e| e["consecutive"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(run_events(dir.path(), "stopped")[0]["reason"], "nonfinite");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(newest_checkpoint(dir.path()).join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!((state["nonfinite_skips"].as_u64(), state["optimizer"]["steps"].as_u64()), (Some(3), Some(5)), "skipped updates left the optimizer untouched");
}

/// A stop right after an interval checkpoint: the checkpoint of that step is not written a second
/// time, and the stop is reported as a stop (with how to resume), not as an error.
#[test]
fn a_stop_right_after_an_interval_checkpoint_writes_it_once_and_is_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(dir.path(), "configs/debug.yaml", &["train.max_steps=10", "train.warmup_steps=0", "checkpoint.interval=5", "faults.interrupt_at_step=5"]);
    assert_eq!(r.code(), 4, "{}", r.stderr());
    let saved: Vec<u64> = r.events_of("checkpoint_saved").iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(saved, [5], "step 5 written once");
    let stopped = r.events_of("stopped");
    assert_eq!(stopped[0]["checkpoint"], r.events_of("checkpoint_saved")[0]["path"], "the stop points at the checkpoint just written");
    let err = r.stderr();
    assert!(err.contains("stopped at step 5 (signal); `--resume auto` continues from"), "{err}");
    assert!(!err.contains("error:") && !err.contains("training failed"), "a planned stop is not a failure:\n{err}");
}
