//! The foundation, on the real binary: training learns, is deterministic, and bad configs are
//! refused with exit 2 and the key's path.
use crate::common::*;
use std::process::Command;

#[test]
fn debug_config_learns_below_the_unigram_entropy() {
    let dir = tempfile::tempdir().unwrap();
    let run = train(dir.path(), "configs/debug.yaml", &[]).ok();
    let started = &run.events_of("run_started")[0];
    let unigram = started["unigram_entropy"].as_f64().unwrap();
    let val = run.summary()["final_val_loss"].as_f64().unwrap();
    // The synthetic chain's floor is 1.21 nats; a uniform guess is ln 256 = 5.55.
    assert!(unigram > 4.0, "unigram entropy {unigram}");
    assert!(val < unigram - 2.5, "val loss {val} not clearly below unigram entropy {unigram}");
    let metrics = run.metrics();
    assert_eq!(metrics.len(), 200);
    let first = metrics[0]["loss"].as_f64().unwrap();
    assert!(first > val + 2.0, "loss went from {first} to {val}");
    for key in ["step", "loss", "lr", "grad_norm", "tokens_per_s", "micro_batch", "accumulation", "elapsed_s"]
    {
        assert!(!metrics[5][key].is_null(), "metrics line lacks {key}: {}", metrics[5]);
    }
    assert_eq!(metrics[5]["accumulation"], 4);
    assert!(dir.path().join("config.yaml").is_file());
    assert!(dir.path().join("model.safetensors").is_file());
}

/// Without evaluation every token may train: a corpus of one window (seq_len + 2 tokens), too
/// short to split, trains with `data.val_fraction: 0` and is refused with the default 0.1.
#[test]
fn without_evaluation_every_token_may_train() {
    let dir = tempfile::tempdir().unwrap();
    let sets =
        ["train.max_steps=3", "train.warmup_steps=0", "data.synthetic_tokens=66", "train.eval_interval=0"];
    let short = train(dir.path(), "configs/debug.yaml", &sets);
    assert_eq!(short.code(), 2, "{}", short.stderr());
    assert!(short.stderr().contains("data.synthetic_tokens: must be at least"), "{}", short.stderr());
    let run = train(dir.path(), "configs/debug.yaml", &[&sets[..], &["data.val_fraction=0"]].concat()).ok();
    assert!(run.stderr().contains("(no validation split)"), "{}", run.stderr());
    assert!(run.events_of("run_started")[0]["unigram_entropy"].is_null());
    assert_eq!(run.metrics().len(), 3);
    let with_eval = train(dir.path(), "configs/debug.yaml", &["data.val_fraction=0"]);
    assert_eq!(with_eval.code(), 2);
    assert!(
        with_eval.stderr().contains("data.val_fraction: must be above 0 while train.eval_interval evaluates"),
        "{}",
        with_eval.stderr()
    );
}

#[test]
fn same_seed_gives_identical_metrics_and_weights() {
    let (a, b, c) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = ["train.max_steps=25", "train.eval_interval=10", "model.dropout=0.1"];
    let ra = train(a.path(), "configs/debug.yaml", &sets).ok();
    let rb = train(b.path(), "configs/debug.yaml", &sets).ok();
    for key in ["loss", "lr", "grad_norm", "val_loss"] {
        assert_eq!(series(&ra.metrics(), key), series(&rb.metrics(), key), "{key} differs");
    }
    assert_eq!(max_weight_diff(a.path(), b.path()), 0.0);
    let rc = train(c.path(), "configs/debug.yaml", &[&sets[..], &["seed=7"]].concat()).ok();
    assert_ne!(series(&ra.metrics(), "loss"), series(&rc.metrics(), "loss"), "another seed must differ");
}

#[test]
fn an_uneven_split_equals_the_even_split_of_the_same_global_batch() {
    // 24 sequences: 3 × 8 against 5 + 5 + 5 + 5 + 4. Dropout off: its masks depend on where a
    // micro-batch starts. The two sum the same gradients in a different order (~1e-7 apart);
    // momentum SGD keeps that at its size, where Adam would turn it into lr-sized steps on
    // weights whose gradient is ~0 (the even/uneven maths is the same for every optimizer).
    let (even, uneven) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let base = [
        "train.global_batch_size=24",
        "train.max_steps=12",
        "train.warmup_steps=2",
        "train.eval_interval=6",
        "model.dropout=0",
        "optimizer.name=sgd_momentum",
        "train.lr=0.1",
    ];
    let a =
        train(even.path(), "configs/debug.yaml", &[&base[..], &["train.micro_batch_size=8"]].concat()).ok();
    let b =
        train(uneven.path(), "configs/debug.yaml", &[&base[..], &["train.micro_batch_size=5"]].concat()).ok();
    let (ma, mb) = (a.metrics(), b.metrics());
    assert_eq!((ma.len(), mb.len()), (12, 12));
    assert!(
        mb.iter().all(|m| m["micro_batch"] == 5 && m["accumulation"] == 5),
        "5 micro-steps, the last of 4"
    );
    assert_eq!(series(&ma, "tokens"), series(&mb, "tokens"), "the same global batch every step");
    for (ra, rb) in ma.iter().zip(&mb) {
        for key in ["loss", "grad_norm"] {
            let (x, y) = (ra[key].as_f64().unwrap(), rb[key].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "step {}: {key} {x} vs {y}", ra["step"]);
        }
    }
    let diff = max_weight_diff(even.path(), uneven.path());
    assert!(diff <= 1e-6, "final weights differ by {diff}");
}

#[test]
fn every_shipped_config_parses_and_validates() {
    let mut seen = 0;
    for entry in std::fs::read_dir(repo().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let out = Command::new(bin()).args(["config", "show", "--config"]).arg(&path).output().unwrap();
            assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
            seen += 1;
        }
    }
    assert!(seen >= 2);
}

fn expect_config_error(yaml: &str, sets: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    let mut cmd = Command::new(bin());
    cmd.args(["train", "--config"]).arg(&cfg);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "yaml {yaml:?} sets {sets:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "message lacks {n:?}: {err}");
    }
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{err}");
}

#[test]
fn bad_configs_exit_2_naming_the_key() {
    expect_config_error("model:\n  n_layers: 3\n", &[], &["n_layers"]);
    expect_config_error("train:\n  max_steps: lots\n", &[], &["train.max_steps"]);
    expect_config_error("model:\n  n_embd: 65\n  n_head: 2\n", &[], &["model.n_embd", "divisible"]);
    expect_config_error(
        "train:\n  global_batch_size: 30\n  micro_batch_size: 31\n",
        &[],
        &["train.micro_batch_size", "must not exceed train.global_batch_size (30)"],
    );
    expect_config_error("train: [unclosed\n", &[], &["not valid YAML"]);
    expect_config_error("", &["train.lr"], &["--set", "key.path=value"]);
    expect_config_error("", &["device=tpu"], &["device"]);
    // Every problem at once.
    expect_config_error(
        "model:\n  n_layer: 0\ntrain:\n  log_interval: 0\n",
        &[],
        &["model.n_layer", "train.log_interval", "2 problem"],
    );
    let out = Command::new(bin()).args(["train", "--config", "/no/such/file.yaml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/file.yaml"));
}

#[test]
fn version_and_config_show() {
    let out = Command::new(bin()).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
    let out = Command::new(bin()).args(["config", "show", "--set", "train.lr=1e-3"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("lr: 0.001"), "{text}");
    assert!(text.contains("micro_batch_size: 8"), "defaults are filled in: {text}");
    // A reader that goes away (`| head -c0` exits before reading) ends the output quietly; a
    // full device is an error with exit 1. Neither is println!'s panic (exit 101).
    let piped = format!("{} config show | head -c0; echo \"rc=${{PIPESTATUS[0]}}\"", bin());
    let out = Command::new("bash").args(["-c", &piped]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "rc=0",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    let full = Command::new(bin())
        .args(["config", "show"])
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    assert_eq!(full.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&full.stderr)
            .contains("cannot write to standard output: No space left on device"),
        "{}",
        String::from_utf8_lossy(&full.stderr)
    );
    // So are --version and --help, which clap would print and exit 0 from; a bad flag is still
    // clap's usage error.
    for args in [&["--version"][..], &["train", "--help"]] {
        let full = Command::new(bin())
            .args(args)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        assert_eq!(full.status.code(), Some(1), "{args:?}: {}", String::from_utf8_lossy(&full.stderr));
        let piped = format!("{} {} | head -c0; echo \"rc=${{PIPESTATUS[0]}}\"", bin(), args.join(" "));
        let out = Command::new("bash").args(["-c", &piped]).output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "rc=0",
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let bad = Command::new(bin()).args(["train", "--resume", ""]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr)
            .contains("an empty value: give `auto`, `none` or a checkpoint directory"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

/// A libtorch error that tch raises as a panic (a Scalar-taking op refused: shapes that do not
/// broadcast) ends the run like any other libtorch error: exit 1 with libtorch's message on the
/// `error:` line, no panic message, the steps before it complete.
#[test]
fn a_libtorch_error_raised_as_a_panic_is_an_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=3",
            "train.warmup_steps=0",
            "train.eval_interval=0",
            "train.log_interval=1",
            "faults.failing_scalar_op_at_step=2",
        ],
    );
    let err = r.stderr();
    assert_eq!(r.code(), 1, "{err}");
    let fatal = r.error_line();
    assert!(fatal.contains("must match the size of tensor b") && fatal.contains("step 2"), "{err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{err}");
    assert_eq!(r.metrics().len(), 1, "step 1 completed, step 2 did not");
}

/// Steps are counted from 1 everywhere: the log's last line is `step 20/20`, the metrics run
/// from step 1 to 20, the final evaluation is on step 20's line, and the last checkpoint is
/// `step-00000020` (the log once said "step 19/20" beside "checkpoint at step 20").
#[test]
fn steps_are_counted_from_one_in_the_log_metrics_events_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=20", "train.warmup_steps=2", "train.eval_interval=10", "checkpoint.interval=10"],
    )
    .ok();
    let err = r.stderr();
    for line in ["step     1/20 |", "step    10/20 |", "step    20/20 |", "checkpoint at step 20:"] {
        assert!(err.contains(line), "`{line}` missing: {err}");
    }
    assert!(!err.contains("step     0/20") && !err.contains("step    19/20"), "{err}");
    let steps: Vec<u64> = r.metrics().iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=20).collect::<Vec<_>>());
    let evaluated: Vec<u64> = r
        .metrics()
        .iter()
        .filter(|m| !m["val_loss"].is_null())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [10, 20], "evaluated after steps 10 and 20, as the checkpoints");
    let saved: Vec<u64> =
        r.events_of("checkpoint_saved").iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(saved, [10, 20]);
    assert!(dir.path().join("checkpoints/step-00000020").is_dir());
    assert_eq!(r.summary()["steps"], 20);
}
