//! Memory savers and precision on the real binary (CPU): the same training with each saver,
//! the guard escalating to checkpointing at the floor, fp16 loss scaling, bf16 paths.
use crate::common::*;

const SHORT: [&str; 4] =
    ["train.max_steps=12", "train.warmup_steps=2", "train.eval_interval=0", "model.dropout=0.1"];

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SHORT.iter().copied().chain(extra.iter().copied()).collect()
}

#[test]
fn checkpointing_offload_and_chunked_loss_train_like_the_plain_path() {
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = train(plain_dir.path(), "configs/debug.yaml", &sets(&[])).ok();
    for extra in [
        &["memory.activation_checkpointing=blocks"][..],
        &["memory.activation_checkpointing=every_n:2", "memory.offload_activations=true"],
        &["memory.loss_chunk_tokens=100"],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let r = train(dir.path(), "configs/debug.yaml", &sets(extra)).ok();
        assert_eq!(plain.metrics().len(), r.metrics().len(), "{extra:?}: every step logged");
        assert!(!plain.metrics().is_empty());
        for (a, b) in plain.metrics().iter().zip(r.metrics()) {
            let (x, y) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
            assert!((x - y).abs() < 1e-4, "{extra:?} step {}: loss {x} vs {y}", a["step"]);
        }
        let diff = max_weight_diff(plain_dir.path(), dir.path());
        assert!(diff < 1e-4, "{extra:?}: weights differ by {diff}");
    }
}

/// Peak above start-up at micro-batch 1 of a deep, narrow model (activations dominate).
fn peak(extra: &[&str]) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "model.n_layer=12",
        "model.seq_len=256",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.eval_interval=0",
        "memory.limit=1TiB",
    ];
    let r = train(dir.path(), "configs/debug.yaml", &[&base[..], extra].concat()).ok();
    r.summary()["peak_mapped_above_start_bytes"].as_u64().unwrap()
}

#[test]
fn at_the_floor_the_guard_switches_checkpointing_on_and_the_run_completes() {
    let (plain, ckpt) = (peak(&[]), peak(&["memory.activation_checkpointing=blocks"]));
    assert!(plain > ckpt + (4 << 20), "checkpointing must save memory here: {plain} vs {ckpt}");
    let base = [
        "model.n_layer=12",
        "model.seq_len=256",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        "train.max_steps=3",
        "train.warmup_steps=0",
        "train.eval_interval=0",
    ];
    let b = tempfile::tempdir().unwrap();
    let from_start = train(
        b.path(),
        "configs/debug.yaml",
        &[&base[..], &["memory.activation_checkpointing=blocks"]].concat(),
    )
    .ok();
    // Several caps between the two peaks: whether the first allocation the cap refuses is
    // oneDNN's JIT code for GELU (when it was on in fp32) depended on the cap, ~1 MiB apart;
    // after that refusal no kernel could be built again, and the run died.
    for tenth in 3..=7 {
        let cap = format!("memory.limit={}", ckpt + (plain - ckpt) * tenth / 10);
        let a = tempfile::tempdir().unwrap();
        let escalated = train(
            a.path(),
            "configs/debug.yaml",
            &[&base[..], &[cap.as_str(), "oom.escalate=[activation_checkpointing, offload_activations]"]]
                .concat(),
        )
        .ok();
        let esc = escalated.events_of("oom_escalated");
        assert_eq!(esc.len(), 1, "{cap}: {:?}", escalated.events());
        assert_eq!(esc[0]["switched_on"], "activation_checkpointing", "as the config spells it");
        let summary = escalated.summary();
        assert_eq!(
            (summary["oom_escalations"].as_u64(), summary["oom_recoveries"].as_u64()),
            (Some(1), Some(1)),
            "{cap}: the recovered OOM is counted: {summary}"
        );
        assert!(
            escalated.stderr().contains("OOM recoveries 1 (1 by oom.escalate)"),
            "{}",
            escalated.stderr()
        );
        assert_eq!(
            series(&escalated.metrics(), "loss"),
            series(&from_start.metrics(), "loss"),
            "{cap}: same as checkpointing from the start"
        );
    }
    // From micro-batch 2: the halving that did not recover is said before the escalation that
    // followed it. (Offload on the CPU holds more than checkpointing alone: not this cap's.)
    let accumulating = ["train.global_batch_size=2", "train.micro_batch_size=1"];
    let (plain2, ckpt2) = (
        peak(&accumulating),
        peak(&[&accumulating[..], &["memory.activation_checkpointing=blocks"]].concat()),
    );
    let cap = format!("memory.limit={}", ckpt2 + (plain2 - ckpt2) * 7 / 10);
    let d = tempfile::tempdir().unwrap();
    let two =
        ["train.global_batch_size=2", "train.micro_batch_size=2", "oom.escalate=[activation_checkpointing]"];
    let escalated =
        train(d.path(), "configs/debug.yaml", &[&base[..], &two[..], &[cap.as_str()]].concat()).ok();
    let order: Vec<String> = escalated
        .events()
        .iter()
        .filter_map(|e| e["event"].as_str().filter(|n| n.starts_with("oom_")).map(String::from))
        .collect();
    assert_eq!(order, ["oom_recovered", "oom_escalated"], "{:?}", escalated.events());
    let esc = &escalated.events_of("oom_escalated")[0];
    assert_eq!(
        (esc["switched_on"].as_str(), esc["micro_batch"].as_u64()),
        (Some("activation_checkpointing"), Some(1))
    );
    assert!(
        escalated.stderr().contains("switching on activation_checkpointing (every block) (escalation 1)"),
        "{}",
        escalated.stderr()
    );
    // Without escalation a cap between the two peaks is fatal.
    let cap = format!("memory.limit={}", (plain + ckpt) / 2);
    let c = tempfile::tempdir().unwrap();
    let r = train(c.path(), "configs/debug.yaml", &[&base[..], &[cap.as_str()]].concat());
    assert_eq!(r.code(), 3, "{}", r.stderr());
}

#[test]
fn fp16_overflow_skips_the_update_and_halves_the_scale_then_it_grows_back() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "precision=fp16-mixed",
            "train.global_batch_size=8",
            "train.max_steps=9",
            "train.warmup_steps=0",
            "train.eval_interval=0",
            "train.loss_scale_initial=1024",
            "train.loss_scale_growth_interval=4",
            "faults.fp16_overflow_at_steps=[3]",
        ],
    );
    if r.code() != 0 && r.stderr().contains("autocast") {
        eprintln!("skipped: this libtorch has no fp16 autocast on CPU: {}", r.stderr());
        return;
    }
    let r = r.ok();
    let changes: Vec<(u64, f64, String)> = r
        .events_of("loss_scale_changed")
        .iter()
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["scale"].as_f64().unwrap(),
                e["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(changes, [(3, 512.0, "overflow".to_string()), (7, 1024.0, "growth".to_string())]);
    assert!(
        r.events_of("nonfinite_skipped").is_empty(),
        "an fp16 overflow is the scaler's business, not a bad batch"
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("checkpoints/step-00000009/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["optimizer"]["steps"], 8, "the overflowed step's update was skipped");
    assert_eq!(state["loss_scaler"]["scale"], 1024.0);
}

#[test]
fn bf16_mixed_and_pure_run_on_the_cpu() {
    for p in ["bf16-mixed", "bf16-pure"] {
        let dir = tempfile::tempdir().unwrap();
        let r = train(
            dir.path(),
            "configs/debug.yaml",
            &[
                &format!("precision={p}"),
                "train.global_batch_size=8",
                "train.max_steps=4",
                "train.warmup_steps=0",
                "train.eval_interval=0",
            ],
        );
        assert_eq!(r.code(), 0, "{p}: {}", r.stderr());
        let m = r.metrics();
        assert!(m.iter().all(|x| x["loss"].as_f64().is_some_and(f64::is_finite)), "{p}");
        assert!(m[3]["loss"].as_f64().unwrap() < m[0]["loss"].as_f64().unwrap(), "{p} learns");
        let w = tch::Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
        let kind = w[0].1.kind();
        assert_eq!(
            kind,
            if p == "bf16-pure" { tch::Kind::BFloat16 } else { tch::Kind::Float },
            "{p}: master weights"
        );
    }
}

#[test]
fn every_optimizer_trains_the_debug_model_and_8bit_adamw_tracks_adamw() {
    let mut finals = std::collections::HashMap::new();
    for (name, lr) in [
        ("adamw", "3e-3"),
        ("adamw8bit", "3e-3"),
        ("sgd", "0.3"),
        ("sgd_momentum", "0.1"),
        ("adafactor", "0.05"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let r = train(
            dir.path(),
            "configs/debug.yaml",
            &[
                &format!("optimizer.name={name}"),
                &format!("train.lr={lr}"),
                "train.min_lr=0",
                "train.max_steps=80",
                "train.eval_interval=0",
            ],
        )
        .ok();
        let m = r.metrics();
        let (first, last) = (m[0]["loss"].as_f64().unwrap(), m[79]["loss"].as_f64().unwrap());
        assert!(last < first - 1.0, "{name}: loss {first} -> {last}");
        let kind = serde_json::from_str::<serde_json::Value>(
            &std::fs::read_to_string(dir.path().join("checkpoints/step-00000080/trainer_state.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(kind["optimizer"]["kind"], name);
        finals.insert(name, last);
    }
    // Stated tolerance: 8-bit AdamW ends within 5% of fp32 AdamW's loss on the debug run.
    let (a, q) = (finals["adamw"], finals["adamw8bit"]);
    assert!((q - a).abs() / a < 0.05, "adamw {a} vs adamw8bit {q}");
}

#[test]
fn resuming_with_another_optimizer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    train(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=4", "train.warmup_steps=1", "optimizer.name=adamw8bit"],
    )
    .ok();
    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=8", "train.warmup_steps=1", "optimizer.name=adamw"],
    );
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("optimizer.name: checkpoint \"adamw8bit\", config \"adamw\""),
        "{}",
        r.stderr()
    );
    // Refused before the run directory is touched: the finished run's weights and stop record stay.
    for file in ["model.safetensors", "stop.json"] {
        assert!(dir.path().join(file).exists(), "{file} gone after a refused resume");
    }
    // The same optimizer resumes bit for bit.
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets =
        ["train.max_steps=8", "train.warmup_steps=1", "optimizer.name=adamw8bit", "checkpoint.interval=4"];
    let straight = train(a.path(), "configs/debug.yaml", &sets).ok();
    let first = train(b.path(), "configs/debug.yaml", &[&sets[..], &["faults.interrupt_at_step=4"]].concat());
    assert_eq!(first.code(), 4);
    let mut cmd = command(b.path(), "configs/debug.yaml", &sets);
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, b.path()).ok();
    assert_eq!(series(&straight.metrics(), "loss"), series(&resumed.metrics(), "loss"));
    assert_eq!(max_weight_diff(a.path(), b.path()), 0.0);
}
