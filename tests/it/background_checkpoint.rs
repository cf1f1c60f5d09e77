//! `checkpoint.async` on the real binary: kill -9 while a background write is in flight never
//! costs a complete checkpoint and `--resume auto` ends bitwise where a straight synchronous run
//! does; a background write's failure is reported as a synchronous one's; a copy that cannot
//! be taken falls back to a synchronous write; the waits for the writer are events.
use crate::common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use trainguard::checkpoint::store;

/// A small model checkpointing after every step, each write held open (a slow disk) so that
/// one is in flight almost all the time.
const EVERY_STEP: [&str; 6] = [
    "train.max_steps=40",
    "train.warmup_steps=4",
    "train.eval_interval=20",
    "checkpoint.interval=1",
    "checkpoint.keep_last=2",
    "model.dropout=0.1",
];

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    EVERY_STEP.iter().copied().chain(extra.iter().copied()).collect()
}

fn events_of(dir: &Path, kind: &str) -> Vec<serde_json::Value> {
    read_jsonl(&dir.join("events.jsonl")).into_iter().filter(|e| e["event"] == kind).collect()
}

/// A temporary checkpoint directory: a write that had begun and not been renamed.
fn write_in_flight(dir: &Path) -> bool {
    std::fs::read_dir(store::root(dir))
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-step-"))
}

#[test]
fn kill_9_during_background_writes_always_resumes_bitwise() {
    let (plain, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // The reference writes synchronously: the background path must give its very bytes.
    let reference = train(plain.path(), "configs/debug.yaml", &with(&["checkpoint.async=false"])).ok();
    let background = with(&["checkpoint.async=true", "faults.pause_in_checkpoint_write_ms=150"]);
    const KILLS: usize = 20;
    let (mut kills, mut rng) = (0, 0x5eed_u64);
    for attempt in 0..3 * KILLS {
        let newest_before = store::list(&store::root(killed.path())).last().map(|(s, _)| *s);
        let resumed_before = events_of(killed.path(), "resumed").len();
        let log_path = plain.path().join(format!("attempt-{attempt}.log"));
        let mut cmd = command(killed.path(), "configs/debug.yaml", &background);
        cmd.args(["--resume", "auto"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap());
        let mut child = cmd.spawn().unwrap();
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        // Counted from the moment training starts (start-up's length varies with the load).
        let delay = Duration::from_millis(20 + (rng >> 33) % 200);
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
            // Killed only while a background write is in flight, and once this attempt has
            // completed a checkpoint of its own (every attempt moves on, whatever the load).
            let moved_on =
                || store::list(&store::root(killed.path())).last().map(|(s, _)| *s) > newest_before;
            if kills < KILLS
                && started.is_some_and(|t| t.elapsed() >= delay)
                && write_in_flight(killed.path())
                && moved_on()
            {
                break None;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        if finished.is_none() {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            kills += 1;
        }
        for (_, dir) in store::list(&store::root(killed.path())) {
            store::load_checkpoint(&dir).unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
        }
        let resumed = events_of(killed.path(), "resumed");
        if resumed.len() > resumed_before {
            let step = resumed.last().unwrap()["step"].as_u64();
            assert_eq!(
                step, newest_before,
                "attempt {attempt} resumed from another than the newest complete"
            );
        }
        if let Some(status) = finished {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            assert!(status.success(), "attempt {attempt} failed:\n{log}");
            break;
        }
    }
    assert_eq!(kills, KILLS, "every kill landed inside a background write");
    let resumed: Vec<u64> =
        events_of(killed.path(), "resumed").iter().filter_map(|e| e["step"].as_u64()).collect();
    assert!(resumed.len() >= KILLS - 2 && resumed.windows(2).all(|w| w[0] <= w[1]), "{resumed:?}");
    assert!(
        !events_of(killed.path(), "checkpoint_waited").is_empty(),
        "the writer held training up at times"
    );
    assert_bitwise_equal(&plain.path().join("model.safetensors"), &killed.path().join("model.safetensors"));
    let (a, b) = (store::list(&store::root(plain.path())), store::list(&store::root(killed.path())));
    assert_eq!((a.last().unwrap().0, b.last().unwrap().0), (40, 40));
    assert_bitwise_equal(
        &a.last().unwrap().1.join("optimizer.safetensors"),
        &b.last().unwrap().1.join("optimizer.safetensors"),
    );
    assert_eq!(
        series(&reference.metrics(), "loss"),
        series(&read_jsonl(&killed.path().join("metrics.jsonl")), "loss"),
        "metrics rebuilt step for step"
    );
}

/// The next checkpoint waits for the one in flight (said, with how long), and so does the end;
/// the result is the synchronous path's, file for file.
#[test]
fn background_checkpoints_wait_for_each_other_and_equal_synchronous_ones() {
    let (sync, bg) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // No evaluation: the last step's would give the last write time to end unwaited.
    let short =
        ["train.max_steps=6", "train.eval_interval=0", "checkpoint.keep_last=10", "checkpoint.at_end=false"];
    let s =
        train(sync.path(), "configs/debug.yaml", &with(&[&short[..], &["checkpoint.async=false"]].concat()))
            .ok();
    let paused = ["checkpoint.async=true", "faults.pause_in_checkpoint_write_ms=300"];
    let b = train(bg.path(), "configs/debug.yaml", &with(&[&short[..], &paused[..]].concat())).ok();
    let steps = |r: &Run| {
        r.events_of("checkpoint_saved").iter().map(|e| e["step"].as_u64().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(steps(&s), [1, 2, 3, 4, 5, 6]);
    assert_eq!(steps(&b), [1, 2, 3, 4, 5, 6], "every background write reported");
    let waited = b.events_of("checkpoint_waited");
    let before: Vec<&str> = waited.iter().map(|e| e["before"].as_str().unwrap()).collect();
    assert!(before.contains(&"next checkpoint"), "{waited:?}");
    assert!(before.iter().all(|b| ["next checkpoint", "end of training"].contains(b)), "{waited:?}");
    assert!(waited
        .iter()
        .all(|e| e["seconds"].as_f64().unwrap() > 0.0 && e["seconds"].as_f64().unwrap() < 5.0));
    assert!(b.stderr().contains("for the background write of checkpoint"), "{}", b.stderr());
    for step in 1..=6 {
        let (x, y) = (
            sync.path().join(format!("checkpoints/step-{step:08}")),
            bg.path().join(format!("checkpoints/step-{step:08}")),
        );
        for file in [store::MODEL_FILE, store::OPTIMIZER_FILE] {
            assert_bitwise_equal(&x.join(file), &y.join(file));
        }
    }
    // The report shows the waits.
    let report = std::process::Command::new(bin()).arg("report").arg(bg.path()).output().unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let page = std::fs::read_to_string(bg.path().join("report.html")).unwrap();
    assert!(page.contains("waits for background checkpoints"), "summary row");
    assert!(page.contains("for the background write of checkpoint"), "markers");
}

/// A background write that fails (a file where its temporary directory goes: a real I/O error)
/// is reported at the next step boundary exactly as a synchronous failure is: a warning, the
/// same error, training goes on, the same exit code.
#[test]
fn a_failed_background_write_is_reported_as_a_synchronous_one() {
    let outcome = |background: bool| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("checkpoints")).unwrap();
        std::fs::write(dir.path().join("checkpoints/.tmp-step-00000003"), "not a directory").unwrap();
        let sets =
            ["train.max_steps=6", "train.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=3"];
        let r = train(
            dir.path(),
            "configs/debug.yaml",
            &[&sets[..], &[if background { "checkpoint.async=true" } else { "checkpoint.async=false" }]]
                .concat(),
        );
        let failed = r.events_of("checkpoint_failed");
        assert_eq!(failed.len(), 1, "{}", r.stderr());
        let error = failed[0]["error"].as_str().unwrap().replace(&dir.path().display().to_string(), "DIR");
        assert!(r.stderr().contains("checkpoint at step 3 failed, training goes on"), "{}", r.stderr());
        (r.code(), failed[0]["step"].clone(), failed[0]["training_goes_on"].clone(), error)
    };
    let (sync, background) = (outcome(false), outcome(true));
    assert_eq!(background, sync);
    assert_eq!(background.0, 0);
}

/// No host memory for the copy: each checkpoint is written synchronously, with a warning, and
/// is the same checkpoint.
#[test]
fn a_copy_that_cannot_be_taken_falls_back_to_a_synchronous_write() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=2",
        "checkpoint.async=true",
    ];
    train(a.path(), "configs/debug.yaml", &sets).ok();
    let r =
        train(b.path(), "configs/debug.yaml", &[&sets[..], &["faults.fail_checkpoint_copy=true"]].concat())
            .ok();
    let fallback = r.events_of("checkpoint_written_in_foreground");
    assert_eq!(fallback.len(), 1, "step 2's (step 4 is the last step's, written at once anyway)");
    assert_eq!(fallback[0]["step"], 2);
    assert!(fallback[0]["why"].as_str().unwrap().contains("no host copy of"), "{fallback:?}");
    assert!(r.stderr().contains("checkpoint at step 2 written synchronously"), "{}", r.stderr());
    assert!(r.events_of("checkpoint_waited").is_empty());
    for step in ["step-00000002", "step-00000004"] {
        let (x, y) = (a.path().join("checkpoints").join(step), b.path().join("checkpoints").join(step));
        assert_bitwise_equal(&x.join(store::MODEL_FILE), &y.join(store::MODEL_FILE));
    }
}
