//! Paths nothing else drives end to end, on the real binary: `text:` and `tokens:` data (loss
//! falls, validation is the file's tail), checkpoints by time (`checkpoint.interval_minutes`),
//! `checkpoint.keep_best` surviving retention, a regrow that succeeds under a real memory cap,
//! a kill inside a checkpoint write (made to happen with `faults.pause_in_checkpoint_write_ms`),
//! every bad-input message starting with `error:`, and the out_dirs refused for what they hold
//! (another run's checkpoints, the user's own files).
use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use trainguard::checkpoint::store;

fn checkpoint_steps(out: &Path) -> Vec<u64> {
    store::list(&store::root(out)).into_iter().map(|(s, _)| s).collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// (step, val_loss) of every step that evaluated.
fn evals(metrics: &[Value]) -> Vec<(u64, f64)> {
    metrics
        .iter()
        .filter(|m| !m["val_loss"].is_null())
        .map(|m| (m["step"].as_u64().unwrap(), f(&m["val_loss"])))
        .collect()
}

/// A corpus whose training head and validation tail use disjoint tokens: the head cycles
/// through `head`, the tail through `tail`, each a deterministic sequence a model learns fast.
/// Training on the head must lower the training loss and raise the validation loss (the tail's
/// tokens become ever less likely); were validation drawn from the head, it would fall too.
fn head_and_tail(
    len: usize,
    val_fraction: f64,
    head: std::ops::Range<u16>,
    tail: std::ops::Range<u16>,
) -> Vec<u16> {
    let val_start = (len as f64 * (1.0 - val_fraction)).round() as usize;
    let cycle = |r: &std::ops::Range<u16>, i: usize| r.start + (i % (r.end - r.start) as usize) as u16;
    (0..len).map(|i| if i < val_start { cycle(&head, i) } else { cycle(&tail, i) }).collect()
}

fn assert_learns_head_not_tail(run: &Run) {
    let m = run.metrics();
    assert_eq!(m.len(), 30, "{}", run.stderr());
    let (first, last) = (f(&m[0]["loss"]), f(&m[m.len() - 1]["loss"]));
    assert!(last < first - 2.0, "training loss fell: {first:.3} → {last:.3}");
    let v = evals(&m);
    assert!(v.len() >= 3, "{v:?}");
    // Measured: text 5.57 → 5.69 → 5.99 → 6.09; tokens 6.97 → 7.00 → 7.10 → 7.17.
    let rising = v.windows(2).all(|w| w[1].1 > w[0].1);
    assert!(
        rising && v.last().unwrap().1 > v[0].1 + 0.1,
        "validation (the tail's unseen tokens) got worse at every evaluation as the head was learnt: {v:?}"
    );
}

const SHORT: [&str; 4] =
    ["train.max_steps=30", "train.warmup_steps=2", "train.eval_interval=10", "checkpoint.interval=0"];

#[test]
fn text_data_trains_and_validates_on_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    // Bytes are tokens: the head is lowercase letters, the tail digits and capitals.
    let bytes: Vec<u8> =
        head_and_tail(20_000, 0.1, b'a' as u16..b'z' as u16 + 1, b'0' as u16..b'Z' as u16 + 1)
            .into_iter()
            .map(|t| t as u8)
            .collect();
    let file = dir.path().join("corpus.txt");
    std::fs::write(&file, &bytes).unwrap();
    let source = format!("data.source=text:{}", file.display());
    let out = dir.path().join("run");
    let r = train(&out, "configs/debug.yaml", &[&SHORT[..], &[source.as_str()]].concat()).ok();
    assert_eq!(r.events_of("run_started")[0]["corpus"], format!("text:{}", file.display()));
    assert_learns_head_not_tail(&r);
}

/// A training split over 1 GiB is not scanned at load (tens of GB would take minutes at every
/// start): each step's windows are checked as the step reads them. An id outside the
/// vocabulary in step 1's windows stops the run there, exit 2, naming the file and the id's
/// index, with step 1 checkpointed: not libtorch's "index out of range" naming nothing (or on
/// CUDA a device-side assert). Validation shards are scanned at load whatever the size.
#[test]
fn ids_outside_the_vocabulary_in_a_large_split_are_caught_as_steps_read_them() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("big");
    std::fs::create_dir(&data).unwrap();
    // Sparse: 1.1 GiB of token 0 (flat uint16) that takes no disk.
    let train_file = data.join("x_train_000000.bin");
    std::fs::File::create(&train_file).unwrap().set_len(1100 << 20).unwrap();
    let val_file = data.join("x_val_000000.bin");
    let val: Vec<u16> = (0..5000).map(|i| (i % 200) as u16).collect();
    std::fs::write(&val_file, val.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let source = format!("tokens:{}", data.display());
    // Where step 1's first sample starts, by the library's own sampler over the same corpus.
    let cfg = trainguard::config::DataConfig { source: source.clone(), ..Default::default() };
    let corpus = trainguard::data::Corpus::load(&cfg, 256, 64, true).unwrap();
    assert!(corpus.check_as_read, "over 1 GiB: checked as read");
    let at = trainguard::data::Sampler { seed: 1337, seq_len: 64 }.train_offset(&corpus, 1, 0) + 10;
    drop(corpus);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&train_file)
        .unwrap()
        .write_all_at(&300u16.to_le_bytes(), at as u64 * 2)
        .unwrap();

    let sets = [
        format!("data.source={source}"),
        "train.max_steps=4".into(),
        "train.warmup_steps=0".into(),
        "train.eval_interval=0".into(),
        "checkpoint.interval=0".into(),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let out = dir.path().join("run");
    let r = train(&out, "configs/debug.yaml", &sets);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    let said = format!(
        "data {}: token 300 at index {at} is outside model.vocab_size = 256 (read by step 1",
        train_file.display()
    );
    assert!(r.stderr().contains(&said), "{said}\n{}", r.stderr());
    assert!(!r.stderr().contains("libtorch"), "{}", r.stderr());
    assert!(out.join("checkpoints/step-00000001").is_dir(), "step 1 kept");
    let stopped = read_jsonl(&out.join("events.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == "stopped")
        .collect::<Vec<_>>();
    assert_eq!((stopped[0]["reason"].as_str(), stopped[0]["step"].as_u64()), (Some("bad_data"), Some(1)));

    // A bad id in the validation shard is refused at load, before any step.
    let mut bad_val = val.clone();
    bad_val[4321] = 999;
    std::fs::write(&val_file, bad_val.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let r = train(&dir.path().join("run2"), "configs/debug.yaml", &sets);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains(&format!("data {}: token 999 at index 4321 is outside", val_file.display())),
        "{}",
        r.stderr()
    );
}

#[test]
fn uint16_token_files_train_and_validate_on_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    // Ids above 255: read as bytes they would be other tokens, and with the vocabulary of 1024
    // the file is accepted only if it is read as little-endian uint16.
    let tokens = head_and_tail(20_000, 0.1, 300..340, 700..740);
    let file = dir.path().join("train.bin");
    std::fs::write(&file, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let source = format!("data.source=tokens:{}", file.display());
    let out = dir.path().join("run");
    let r = train(
        &out,
        "configs/debug.yaml",
        &[&SHORT[..], &[source.as_str(), "model.vocab_size=1024"]].concat(),
    )
    .ok();
    assert_eq!(r.events_of("run_started")[0]["corpus"], format!("tokens:{} (uint16)", file.display()));
    assert_learns_head_not_tail(&r);
    // The same file with a vocabulary too small for its ids is refused, naming the token: the
    // config must change (exit 2, as a prepare dataset's larger vocabulary is).
    let r =
        train(&dir.path().join("small"), "configs/debug.yaml", &[&SHORT[..], &[source.as_str()]].concat());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("token 300 at index 0 is outside model.vocab_size = 256"), "{}", r.stderr());
}

/// `checkpoint.interval: 0` writes only at the end; `interval_minutes` adds checkpoints by time.
#[test]
fn interval_minutes_checkpoints_by_time() {
    let dir = tempfile::tempdir().unwrap();
    // 0.01 min = 0.6 s. 200 debug steps last several seconds even on a fast CI machine (60
    // took 1.45 s on one: too few intervals to test).
    let steps = 200;
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            &format!("train.max_steps={steps}"),
            "train.eval_interval=0",
            "checkpoint.interval=0",
            "checkpoint.interval_minutes=0.01",
            "checkpoint.keep_last=100",
        ],
    )
    .ok();
    let saved: Vec<u64> =
        r.events_of("checkpoint_saved").iter().map(|e| e["step"].as_u64().unwrap()).collect();
    let by_time: Vec<u64> = saved.iter().copied().filter(|&s| s < steps).collect();
    let m = r.metrics();
    let took = f(&m[steps as usize - 1]["elapsed_s"]) - f(&m[0]["elapsed_s"]);
    assert!(took > 1.5, "the run should last a few intervals: {took:.2}s");
    assert!(by_time.len() >= 2, "checkpoints by time before the end: {saved:?} in {took:.2}s");
    // Not more than one per interval either (a checkpoint after every step would pass the rest).
    assert!(by_time.len() as f64 <= took / 0.55 + 1.0, "{} checkpoints in {took:.2}s", by_time.len());
    assert_eq!(saved.last(), Some(&steps));
    // Each falls at least 0.6 s after the one before (elapsed_s of step s-1 is when checkpoint
    // s was written).
    let at = |s: u64| f(&m[s as usize - 1]["elapsed_s"]);
    for w in by_time.windows(2) {
        assert!(at(w[1]) - at(w[0]) >= 0.55, "checkpoints {w:?} only {:.2}s apart", at(w[1]) - at(w[0]));
    }
    assert_eq!(checkpoint_steps(dir.path()), saved, "all kept (keep_last=100)");
}

/// The best checkpoint by validation loss survives retention though newer ones exist and are
/// worse; without `keep_best` the same run keeps only the newest.
#[test]
fn keep_best_keeps_the_best_validation_checkpoint_past_keep_last() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = head_and_tail(20_000, 0.1, 10..50, 100..140);
    let file = dir.path().join("train.bin");
    std::fs::write(&file, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let source = format!("data.source=tokens:{}", file.display());
    // Validation and checkpoints every 5 steps (the same weights), the newest 2 kept.
    let base = [
        "train.max_steps=20",
        "train.warmup_steps=2",
        "train.eval_interval=5",
        "checkpoint.interval=5",
        "checkpoint.keep_last=2",
        source.as_str(),
    ];
    let run = |keep_best: &str, out: &Path| {
        train(out, "configs/debug.yaml", &[&base[..], &[keep_best]].concat()).ok()
    };
    let best_dir = dir.path().join("best");
    let r = run("checkpoint.keep_best=true", &best_dir);
    let v = evals(&r.metrics());
    assert_eq!(
        v.iter().map(|e| e.0).collect::<Vec<_>>(),
        [5, 10, 15, 20],
        "validated after steps 5, 10, 15, 20"
    );
    let (best_step, best_val) =
        v.iter().copied().fold((0, f64::INFINITY), |a, b| if b.1 < a.1 { b } else { a });
    assert!(
        v.iter().filter(|(s, _)| *s > best_step).any(|(_, l)| *l > best_val),
        "a later validation is worse: {v:?}"
    );
    // Steps count from 1: the metrics line and the checkpoint name the same step.
    let best_ckpt = best_step;
    assert!(best_ckpt < 15, "the best is not among the newest two: {v:?}");
    assert_eq!(checkpoint_steps(&best_dir), [best_ckpt, 15, 20], "{v:?}");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(store::root(&best_dir).join(store::dir_name(20)).join("trainer_state.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(state["best_val_step"].as_u64(), Some(best_ckpt));
    assert!((f(&state["best_val_loss"]) - best_val).abs() < 1e-6, "{state}");
    // Checkpoints only at the end: with keep_best, the evaluation that finds a new best writes
    // one anyway — the same weights as the interval run's.
    let sparse_dir = dir.path().join("sparse");
    train(
        &sparse_dir,
        "configs/debug.yaml",
        &[&base[..], &["checkpoint.keep_best=true", "checkpoint.interval=0"]].concat(),
    )
    .ok();
    assert_eq!(checkpoint_steps(&sparse_dir), [best_ckpt, 20], "{v:?}");
    let weights = |d: &Path| store::root(d).join(store::dir_name(best_ckpt)).join("model.safetensors");
    assert_bitwise_equal(&weights(&best_dir), &weights(&sparse_dir));

    let plain_dir = dir.path().join("plain");
    run("checkpoint.keep_best=false", &plain_dir);
    assert_eq!(checkpoint_steps(&plain_dir), [15, 20]);
}

// --- regrow -----------------------------------------------------------------------------------

const OOM_BASE: [&str; 4] =
    ["train.global_batch_size=64", "train.warmup_steps=0", "train.eval_interval=0", "train.log_interval=1"];

/// Peak address space above start-up of a short run at `micro` (see tests/it/oom.rs).
fn to_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn peak_at(micro: usize) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let m = format!("train.micro_batch_size={micro}");
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[&OOM_BASE[..], &[m.as_str(), "train.max_steps=2", "memory.limit=1TiB"]].concat(),
    )
    .ok();
    r.summary()["peak_mapped_above_start_bytes"].as_u64().unwrap()
}

/// A run squeezed to micro-batch 16 by a small cap is resumed under a cap that fits 32 but not
/// 64 (memory freed on the machine): the guard's regrow trials climb by bisection — first
/// halfway to 32, the size that failed before the restart (the checkpoint remembers it), then
/// to 32 itself once its wait is over and above it — and every step keeps the global batch of 64
/// and the loss of a run that never ran out of memory.
#[test]
fn regrow_succeeds_when_memory_frees_up_and_keeps_the_global_batch() {
    let (p16, p32, p64) = (peak_at(16), peak_at(32), peak_at(64));
    assert!(
        p32 > p16 + (4 << 20) && p64 > p32 + (4 << 20),
        "peaks should grow clearly with the micro-batch: {p16} {p32} {p64}"
    );
    let (small, fits_32) =
        (format!("memory.limit={}", (p16 + p32) / 2), format!("memory.limit={}", (p32 + p64) / 2));
    let regrow = ["train.micro_batch_size=64", "train.max_steps=20", "oom.regrow_after_steps=1"];
    let sets = |extra: &[&str]| -> Vec<String> {
        OOM_BASE.iter().chain(&regrow).chain(extra).map(|s| s.to_string()).collect()
    };
    let (dir, plain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());

    // Stopped after step 0 (64 → 32 → 16), before the first regrow trial.
    let first = train(
        dir.path(),
        "configs/debug.yaml",
        &to_refs(&sets(&[small.as_str(), "faults.interrupt_at_step=1"])),
    );
    assert_eq!(first.code(), 4, "{}", first.stderr());
    assert!(first.metrics().iter().all(|m| m["micro_batch"] == 16), "squeezed to 16: {:?}", first.metrics());

    let mut cmd = command(dir.path(), "configs/debug.yaml", &to_refs(&sets(&[fits_32.as_str()])));
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, dir.path()).ok();
    let attempts: Vec<(u64, u64)> = resumed
        .events_of("regrow_attempt")
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["to_micro_batch"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        attempts.first().map(|a| a.1),
        Some(24),
        "halfway to 32, which failed before the restart: {attempts:?}"
    );
    let m = resumed.metrics();
    assert_eq!(m.len(), 20);
    let micro: Vec<u64> = m.iter().map(|x| x["micro_batch"].as_u64().unwrap()).collect();
    assert!(micro[19] >= 32, "grew back to at least 32 once memory allowed: {micro:?} {attempts:?}");
    assert!(attempts.iter().any(|&(_, to)| to > 32), "and tried above it: {attempts:?}");
    assert!(micro.iter().all(|&b| b < 64), "never 64, which does not fit: {micro:?}");
    assert!(
        m.iter().all(
            |x| x["accumulation"].as_u64().unwrap() == 64u64.div_ceil(x["micro_batch"].as_u64().unwrap())
        ),
        "global batch kept every step"
    );

    let reference = train(plain.path(), "configs/debug.yaml", &to_refs(&sets(&[]))).ok();
    for (a, b) in m.iter().zip(reference.metrics()) {
        let (x, y) = (f(&a["loss"]), f(&b["loss"]));
        assert!(
            (x - y).abs() <= 1e-4 * y.abs(),
            "step {}: loss {x} vs {y} of a run that never ran out of memory",
            a["step"]
        );
    }
}

// --- a kill inside a checkpoint write ---------------------------------------------------------

/// One run per out_dir: a second one started while the first is inside a checkpoint write
/// (a double launch) is refused, exit 2, naming the first's pid. Before, its resume removed
/// the first's checkpoint in progress as a leftover, and both wrote metrics.jsonl, mixing lines.
/// The first finishes untouched; once it has ended, the directory is free again.
#[test]
fn a_second_run_in_a_busy_out_dir_is_refused_and_the_first_finishes_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let base =
        ["train.max_steps=6", "train.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=2"];
    let paused = [&base[..], &["faults.pause_in_checkpoint_write_ms=2000"]].concat();
    let first = command(dir.path(), "configs/debug.yaml", &paused)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Inside checkpoint 4's write, checkpoint 2 complete.
    let partial = store::root(dir.path()).join(".tmp-step-00000004");
    let t0 = Instant::now();
    while !partial.join(store::MODEL_FILE).is_file() {
        assert!(t0.elapsed() < Duration::from_secs(120), "checkpoint 4 never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let holder = format!("is in use by another trainguard run (pid {} on ", first.id());
    let mut cmd = command(dir.path(), "configs/debug.yaml", &base);
    cmd.args(["--resume", "auto"]);
    let second = run(cmd, dir.path());
    assert_eq!(second.code(), 2, "{}", second.stderr());
    assert!(second.stderr().contains(&holder), "{}", second.stderr());
    // `--overwrite` would move the directory aside from under it: refused too.
    let mut cmd = command(dir.path(), "configs/debug.yaml", &base);
    cmd.arg("--overwrite");
    let third = run(cmd, dir.path());
    assert_eq!(third.code(), 2, "{}", third.stderr());
    assert!(third.stderr().contains(&holder), "{}", third.stderr());
    assert!(dir.path().join("config.yaml").is_file(), "not moved aside");
    let first = first.wait_with_output().unwrap();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    assert_eq!(checkpoint_steps(dir.path()), [2, 4, 6]);
    let steps: Vec<u64> =
        read_jsonl(&dir.path().join("metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=6).collect::<Vec<_>>());
    let mut cmd = command(dir.path(), "configs/debug.yaml", &base);
    cmd.args(["--resume", "auto"]);
    assert!(run(cmd, dir.path()).ok().stderr().contains("nothing to do"));
}

/// `faults.interrupt_at_step` is the run's own stop, not a signal: a real SIGTERM while the
/// stop's checkpoint is being written is the first signal, so the write completes and the run
/// exits 4. Before, the injected stop counted as the first and the SIGTERM ended the process
/// at once, exit 1 ("nothing to resume from"), the checkpoint half written.
#[test]
fn a_signal_after_an_injected_interrupt_is_the_first_one() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=6",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "faults.interrupt_at_step=3",
        "faults.pause_in_checkpoint_write_ms=2000",
    ];
    let child = command(dir.path(), "configs/debug.yaml", &sets)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let partial = store::root(dir.path()).join(".tmp-step-00000003");
    let t0 = Instant::now();
    while !partial.join(store::MODEL_FILE).is_file() {
        assert!(t0.elapsed() < Duration::from_secs(120), "the stop's checkpoint never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("signal received") && !stderr.contains("second signal"), "{stderr}");
    assert_eq!(checkpoint_steps(dir.path()), [3]);
}

/// SIGKILL while checkpoint 10 is half written (its model file in the temporary directory, the
/// rest not): the completed checkpoint 5 stands, `--resume auto` resumes from it, removes the
/// leftover, and finishes bitwise equal to a straight run.
#[test]
fn a_kill_inside_a_checkpoint_write_resumes_from_the_previous_one() {
    let (straight, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let base = [
        "train.max_steps=15",
        "train.warmup_steps=2",
        "train.eval_interval=5",
        "checkpoint.interval=5",
        "model.dropout=0.1",
    ];
    let reference = train(straight.path(), "configs/debug.yaml", &base).ok();

    // Each checkpoint write pauses 2 s with its model file written: the window for the kill.
    let paused = [&base[..], &["faults.pause_in_checkpoint_write_ms=2000"]].concat();
    let mut child = command(killed.path(), "configs/debug.yaml", &paused)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let root = store::root(killed.path());
    let partial: PathBuf = root.join(".tmp-step-00000010");
    let t0 = Instant::now();
    // Checkpoint 5 pauses too: wait for it to be complete and checkpoint 10 half there.
    while !(partial.join(store::MODEL_FILE).is_file() && checkpoint_steps(killed.path()) == [5]) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its checkpoint 10");
        assert!(t0.elapsed() < Duration::from_secs(240), "checkpoint 10 never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!partial.join(store::STATE_FILE).exists(), "killed with the checkpoint half written");
    assert_eq!(checkpoint_steps(killed.path()), [5], "the half-written one is not a checkpoint");

    let mut cmd = command(killed.path(), "configs/debug.yaml", &base);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, killed.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], 5);
    assert!(!partial.exists(), "the leftover was removed");
    assert_eq!(checkpoint_steps(killed.path()), [5, 10, 15]);
    assert_eq!(series(&reference.metrics(), "loss"), series(&resumed.metrics(), "loss"));
    for file in ["model.safetensors", "checkpoints/step-00000015/optimizer.safetensors"] {
        let (a, b) = (tensors(&straight.path().join(file)), tensors(&killed.path().join(file)));
        assert_eq!(a.len(), b.len());
        for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(ta.equal(tb), "{file}: {na} differs from the straight run");
        }
    }
}

// --- error messages ---------------------------------------------------------------------------

/// Every way of getting the command line, the config or the data wrong: one message starting
/// with `error:` (lowercase, as clap's own), the documented exit code (2; 1 for a data file
/// that passes validation but cannot be read as tokens), no panic or backtrace.
#[test]
fn every_bad_input_says_error_lowercase_without_a_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let bad_yaml = dir.path().join("bad.yaml");
    std::fs::write(&bad_yaml, "train:\n  max_steps: [\n").unwrap();
    let odd = dir.path().join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let config = repo().join("configs/debug.yaml");
    let out = format!("out_dir={}", dir.path().join("run").display());
    let c = config.to_str().unwrap();
    let odd_source = format!("data.source=tokens:{}", odd.display());
    let nothing = dir.path().join("nothing");
    type Env<'a> = Vec<(&'a str, &'a str)>;
    let cases: Vec<(Vec<&str>, Env)> = vec![
        (vec!["train", "--config", "no/such.yaml"], vec![]),
        (vec!["train", "--config", bad_yaml.to_str().unwrap()], vec![]),
        (vec!["train", "--config", c, "--set", "no_such_key=1"], vec![]),
        (vec!["train", "--config", c, "--set", "train.max_steps=abc"], vec![]),
        (vec!["train", "--config", c, "--set", "train"], vec![]),
        (vec!["train", "--config", c, "--set", "model.n_head=3", "--set", &out], vec![]),
        (vec!["train", "--config", c, "--max-duration", "3x", "--set", &out], vec![]),
        (vec!["train", "--config", c, "--set", "device=cuda:7", "--set", &out], vec![]),
        (vec!["train", "--config", c, "--set", &out], vec![("RANK", "abc"), ("WORLD_SIZE", "2")]),
        (vec!["train", "--bogus"], vec![]),
        (vec!["frobnicate"], vec![]),
        (vec!["plan", "--config", c, "--gpu", "no-such-gpu"], vec![]),
        (vec!["plan", "--config", c, "--gpu-memory", "lots"], vec![]),
        (vec!["config", "show", "--config", c, "--set", "memory.limit=abc"], vec![]),
        (vec!["report", nothing.to_str().unwrap()], vec![]),
    ];
    for (args, env) in cases {
        let mut cmd = Command::new(bin());
        cmd.args(&args).envs(env.iter().copied()).env_remove("RUST_BACKTRACE").current_dir(dir.path());
        let o = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.starts_with("error: "), "{args:?} {env:?}: stderr does not start with `error: `:\n{err}");
        assert!(
            !err.contains("panicked") && !err.contains("backtrace") && !err.contains("Error:"),
            "{args:?}:\n{err}"
        );
        assert_eq!(o.status.code(), Some(2), "{args:?}:\n{err}");
    }
    let o = Command::new(bin())
        .args(["train", "--config", c, "--set", &odd_source, "--set", &out])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("3 bytes is not a whole number of uint16 tokens"),
        "{err}"
    );
    assert_eq!(o.status.code(), Some(1), "{err}");
}

/// A short run with a checkpoint every 2 steps, for the out_dir refusals.
const TWO_CHECKPOINTS: [&str; 4] =
    ["train.max_steps=4", "train.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=2"];

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Issue 64: an out_dir inside another run's checkpoints directory was accepted, and that run's
/// retention deleted it with the checkpoint it sat in. Refused (exit 2) naming both directories,
/// nothing created; and the other way round, a run whose checkpoints directory holds a run.
#[test]
fn an_out_dir_inside_or_holding_another_runs_checkpoints_is_refused_naming_both() {
    let d = tempfile::tempdir().unwrap();
    let a = d.path().join("a");
    train(&a, "configs/debug.yaml", &TWO_CHECKPOINTS).ok();
    let b = store::root(&a).join(store::dir_name(2)).join("b");
    let r = train(&b, "configs/debug.yaml", &TWO_CHECKPOINTS);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    for needle in [b.display().to_string(), a.display().to_string(), "retention".into()] {
        assert!(r.error_line().contains(&needle), "`{needle}` missing: {}", r.stderr());
    }
    assert!(!b.exists(), "nothing created");
    assert_eq!(checkpoint_steps(&a), [2, 4]);

    let x = d.path().join("x");
    let inner = store::root(&x).join("kept").join("c");
    train(&inner, "configs/debug.yaml", &TWO_CHECKPOINTS).ok();
    let r = train(&x, "configs/debug.yaml", &TWO_CHECKPOINTS);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    for needle in [x.display().to_string(), inner.display().to_string()] {
        assert!(r.error_line().contains(&needle), "`{needle}` missing: {}", r.stderr());
    }
    assert_eq!(names(&x), ["checkpoints"], "no lock file, no run files");
    assert_eq!(checkpoint_steps(&inner), [2, 4]);
}

/// Issue 64: `--overwrite` moved any directory aside that held something (`$HOME` in the
/// report). Only a trainguard run is moved now: another directory is refused (exit 2), left as
/// it was, without a `.lock`; a refusal after the lock is taken (a checkpoint to resume from
/// that is not there) removes the lock file it created too.
#[test]
fn overwrite_refuses_a_directory_that_is_not_a_run_and_a_refusal_leaves_no_lock() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path().join("home");
    std::fs::create_dir_all(home.join(".ssh")).unwrap();
    std::fs::write(home.join("notes.txt"), "mine").unwrap();
    let mut cmd = command(&home, "configs/debug.yaml", &TWO_CHECKPOINTS);
    cmd.arg("--overwrite");
    let r = run(cmd, &home);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    for needle in [home.display().to_string(), "--overwrite".into(), "not a trainguard run".into()] {
        assert!(r.error_line().contains(&needle), "`{needle}` missing: {}", r.stderr());
    }
    assert_eq!(names(&home), [".ssh", "notes.txt"]);
    assert_eq!(names(d.path()), ["home"], "nothing moved aside");

    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let mut cmd = command(&empty, "configs/debug.yaml", &TWO_CHECKPOINTS);
    cmd.arg("--resume").arg(d.path().join("missing"));
    let r = run(cmd, &empty);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(names(&empty).is_empty(), "left: {:?}", names(&empty));
}

/// Issue 64: a fresh run truncated the user's own `metrics.jsonl` and `events.jsonl` in an
/// out_dir that is not a run. Refused (exit 2, naming them), the files as they were, whatever
/// `--resume` says (`auto` finds no checkpoint there and would start fresh).
#[test]
fn a_directory_that_is_not_a_run_keeps_its_own_metrics_and_events() {
    let d = tempfile::tempdir().unwrap();
    let (metrics, events) = ("{\"step\": 1, \"loss\": 0.5}\n", "{\"event\": \"mine\"}\n");
    std::fs::write(d.path().join("metrics.jsonl"), metrics).unwrap();
    std::fs::write(d.path().join("events.jsonl"), events).unwrap();
    for resume in ["none", "auto"] {
        let mut cmd = command(d.path(), "configs/debug.yaml", &TWO_CHECKPOINTS);
        cmd.args(["--resume", resume]);
        let r = run(cmd, d.path());
        assert_eq!(r.code(), 2, "--resume {resume}: {}", r.stderr());
        for needle in [d.path().display().to_string(), "metrics.jsonl, events.jsonl".into()] {
            assert!(r.error_line().contains(&needle), "`{needle}` missing: {}", r.stderr());
        }
        assert_eq!(std::fs::read_to_string(d.path().join("metrics.jsonl")).unwrap(), metrics);
        assert_eq!(std::fs::read_to_string(d.path().join("events.jsonl")).unwrap(), events);
        assert_eq!(names(d.path()), ["events.jsonl", "metrics.jsonl"], "--resume {resume}");
    }
}
