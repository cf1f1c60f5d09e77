//! The divergence guard on the real binary: a small model blown up for real by one destructive
//! update (`faults.lr_spike`: the step that draws data step 31 takes a learning rate 1000× too
//! large, as a poisoned batch's gradient would) diverges and stays diverged without the guard;
//! with it the run rolls back, skips that data and ends near the healthy run. A kill -9 right
//! after the rollback resumes bit for bit; non-finite streaks roll back too, and the rollbacks
//! are bounded (exit 5).
use crate::common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use trainguard::checkpoint::store;

const RUN: [&str; 4] =
    ["train.max_steps=80", "train.eval_interval=0", "checkpoint.interval=10", "train.log_interval=10"];
const SPIKE: &str = "faults.lr_spike={data_step: 31, factor: 1000}";
const GUARD: &str = "divergence.enabled=true";

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    RUN.iter().copied().chain(extra.iter().copied()).collect()
}

fn losses(r: &Run) -> Vec<f64> {
    r.metrics().iter().map(|m| m["loss"].as_f64().unwrap()).collect()
}

fn newest_state(out: &Path) -> serde_json::Value {
    let (_, dir) = store::list(&store::root(out)).pop().expect("a checkpoint");
    serde_json::from_str(&std::fs::read_to_string(dir.join(store::STATE_FILE)).unwrap()).unwrap()
}

#[test]
fn a_real_divergence_rolls_back_skips_its_data_and_ends_near_the_healthy_run() {
    let (h, u, g) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let healthy = train(h.path(), "configs/debug.yaml", &sets(&[])).ok();
    let unguarded = train(u.path(), "configs/debug.yaml", &sets(&[SPIKE])).ok();
    let guarded = train(g.path(), "configs/debug.yaml", &sets(&[SPIKE, GUARD])).ok();
    let healthy_final = *losses(&healthy).last().unwrap();

    // Without the guard: past 2× the healthy loss from the step after the spike to the end.
    let unguarded = losses(&unguarded);
    assert!(
        unguarded[31..].iter().zip(&losses(&healthy)[31..]).all(|(u, h)| *u > 2.0 * h),
        "the spike did not blow the model up for good: {:?}",
        &unguarded[28..]
    );

    // With it: the spike seen at step 32 (the update of step 31 broke the weights), the run
    // back at step 30's checkpoint, data steps 31 and 32 never drawn again.
    let diverged = guarded.events_of("diverged");
    assert_eq!(diverged.len(), 1, "{diverged:?}");
    assert_eq!((diverged[0]["step"].as_u64(), diverged[0]["statistic"].as_str()), (Some(32), Some("loss")));
    assert!(diverged[0]["value"].as_f64().unwrap() > diverged[0]["limit"].as_f64().unwrap());
    let rolled = guarded.events_of("rolled_back");
    assert_eq!(rolled.len(), 1);
    assert_eq!(
        (
            &rolled[0]["step"],
            &rolled[0]["diverged_step"],
            &rolled[0]["skipped_from"],
            &rolled[0]["skipped_to"]
        ),
        (&serde_json::json!(30), &serde_json::json!(32), &serde_json::json!(31), &serde_json::json!(32))
    );
    // Recorded for a resume: the skipped window (from 0, end excluded) and the rollback.
    let state = newest_state(g.path());
    assert_eq!(state["divergence"]["skipped"], serde_json::json!([{"from": 30, "to": 32}]));
    assert_eq!(state["divergence"]["rollbacks"].as_array().unwrap().len(), 1);
    assert_eq!(state["sampler"]["next_step"], 82, "step 80 draws past the two skipped data steps");
    // metrics.jsonl holds the line the run went on with: each step once.
    let steps: Vec<u64> = guarded.metrics().iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=80).collect::<Vec<_>>());
    let guarded_final = *losses(&guarded).last().unwrap();
    assert!(
        (guarded_final - healthy_final).abs() <= 0.05 * healthy_final,
        "guarded {guarded_final} against healthy {healthy_final}"
    );
}

#[test]
fn kill_9_right_after_a_rollback_resumes_bit_for_bit() {
    let (straight, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let run_sets = sets(&[SPIKE, GUARD, "train.max_steps=60"]);
    train(straight.path(), "configs/debug.yaml", &run_sets).ok();

    let mut cmd = command(killed.path(), "configs/debug.yaml", &run_sets);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let events = killed.path().join("events.jsonl");
    loop {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its rollback");
        if std::fs::read_to_string(&events).is_ok_and(|e| e.contains("\"rolled_back\"")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let mut cmd = command(killed.path(), "configs/debug.yaml", &run_sets);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, killed.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], 30, "killed before the next checkpoint");
    assert!(resumed.stderr().find("diverged").is_none(), "the resumed run met the spike again");
    assert_bitwise_equal(
        &straight.path().join("model.safetensors"),
        &killed.path().join("model.safetensors"),
    );
    assert_eq!(newest_state(straight.path())["divergence"], newest_state(killed.path())["divergence"]);
}

/// `nan.max_consecutive` non-finite updates roll back instead of ending the run; the injected
/// NaNs belong to step numbers, so they come back after each rollback, and the third divergence
/// within `divergence.rollback_window` stops the run with exit 5 at the last good checkpoint.
#[test]
fn nonfinite_streaks_roll_back_until_the_rollbacks_are_spent() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &sets(&[
            GUARD,
            "faults.nonfinite_loss_at_steps=[25,26,27]",
            "nan.max_consecutive=3",
            "divergence.max_rollbacks=2",
        ]),
    );
    assert_eq!(r.code(), 5, "{}", r.stderr());
    let diverged = r.events_of("diverged");
    assert_eq!(diverged.len(), 3);
    assert!(diverged.iter().all(|d| d["statistic"] == "nonfinite" && d["step"] == 27));
    assert_eq!(
        diverged.iter().map(|d| d["gives_up"].as_bool().unwrap()).collect::<Vec<_>>(),
        [false, false, true]
    );
    // Each rollback skips the data from step 20's checkpoint through the streak.
    let windows: Vec<(u64, u64)> = r
        .events_of("rolled_back")
        .iter()
        .map(|e| (e["skipped_from"].as_u64().unwrap(), e["skipped_to"].as_u64().unwrap()))
        .collect();
    assert_eq!(windows, [(21, 27), (28, 34)]);
    let stopped = r.events_of("stopped");
    assert_eq!(
        (&stopped[0]["reason"], &stopped[0]["step"]),
        (&serde_json::json!("diverged"), &serde_json::json!(20))
    );
    assert!(r.error_line().contains("divergence.max_rollbacks"), "{}", r.error_line());
    assert_eq!(
        store::list(&store::root(dir.path())).pop().unwrap().0,
        20,
        "the newest checkpoint is the last good one"
    );
}

#[test]
fn divergence_settings_out_of_range_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &["divergence.enabled=true", "checkpoint.interval=0", "divergence.lr_factor=2"],
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    let err = r.stderr();
    assert!(err.contains("divergence.enabled: a rollback returns to the last checkpoint"), "{err}");
    assert!(err.contains("divergence.lr_factor: must be in (0, 1]"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
