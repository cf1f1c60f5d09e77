//! `trainguard plan` for `dist.shard` and `memory.offload_optimizer`: the per-rank estimate of
//! each level against the peak a real run measures on the CPU (2 Gloo ranks a level; offload on
//! one process), the level table and its choice, and the flags' errors.
use crate::common::*;
use crate::dist::{as_rank, wait_ok};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// A GPT-2 shape whose states (≈ 150 MiB a copy) dwarf what the process holds besides (the
/// process group, threads, code pages: ~10 MiB mapped, ~20 MiB resident above the start), with
/// tensors far above glibc's mmap threshold, and quick on a loaded CPU (2 blocks, 64 tokens).
/// Its token embedding (25.2M of 39.4M elements) is more than half the model: on 2 ranks rank 0
/// owns it, and rank 0 — the rank whose summary a run writes — is the busiest rank the plan is for.
/// `memory.limit` as `plan --profile` measures: glibc returns large blocks at once under the cap.
const SETS: [&str; 16] = [
    "model.n_layer=2",
    "model.n_embd=768",
    "model.n_head=12",
    "model.vocab_size=32768",
    "model.seq_len=64",
    "data.synthetic_tokens=65536",
    "data.val_fraction=0",
    "train.micro_batch_size=1",
    "train.max_steps=3",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "checkpoint.at_end=false",
    "train.threads=1",
    "device=cpu",
    "memory.limit=4GiB",
];

/// `plan` for the CPU with `SETS`, `extra` and two micro-steps a rank, as JSON.
fn planned(world: usize, extra: &[String]) -> Value {
    let mut cmd = Command::new(bin());
    cmd.arg("plan").arg("--config").arg(repo().join("configs/gpt2-124m.yaml"));
    let global = format!("train.global_batch_size={}", 2 * world);
    for s in SETS.iter().map(|s| s.to_string()).chain(extra.iter().cloned()).chain([global]) {
        cmd.arg("--set").arg(s);
    }
    cmd.args(["--target", "cpu", "--world-size", &world.to_string(), "--json"]);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "plan failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Rank 0's peak (resident, mapped) above the start in a real run of `world` ranks.
fn measured(world: usize, dir: &Path, extra: &[String]) -> (u64, u64) {
    let mut args = vec![
        "train".to_string(),
        "--config".into(),
        repo().join("configs/gpt2-124m.yaml").display().to_string(),
    ];
    let global = format!("train.global_batch_size={}", 2 * world);
    let out = format!("out_dir={}", dir.display());
    for s in SETS.iter().map(|s| s.to_string()).chain(extra.iter().cloned()).chain([global, out]) {
        args.push("--set".into());
        args.push(s);
    }
    // MKL's memory manager off: it keeps the buffers of each thread's largest products, whose
    // size follows the CPU's kernels and which no plan counts (the first case mapped 978.7 MiB
    // with it on an AVX-512 Xeon, 943.9 MiB without, against 943.3 MiB planned; 952.8 MiB with
    // it on another machine).
    let command = || {
        let mut cmd = Command::new(bin());
        cmd.args(&args[..]).env("MKL_DISABLE_FAST_MM", "1");
        cmd
    };
    if world == 1 {
        run(command(), dir).ok();
    } else {
        let port = free_port();
        wait_ok((0..world).map(|r| as_rank(command(), r, world, port)).collect());
    }
    let finished = read_jsonl(&dir.join("events.jsonl"))
        .into_iter()
        .rev()
        .find(|e| e["event"] == "run_finished")
        .expect("a run_finished event");
    let field = |k: &str| {
        finished[k]
            .as_u64()
            .or_else(|| finished["summary"][k].as_u64())
            .unwrap_or_else(|| panic!("{k} in {finished}"))
    };
    (field("peak_resident_above_start_bytes"), field("peak_mapped_above_start_bytes"))
}

/// Each level's per-rank estimate within ±3% of the mapped peak a real run measures (the
/// resident one printed beside it): 2 Gloo ranks for `none`, `optimizer`, `gradients` and
/// `parameters`, one process with `memory.offload_optimizer`.
#[test]
fn each_level_and_offload_is_planned_within_three_percent_of_the_measured_per_rank_peak() {
    // Held to ±3% of the mapped peak: the address space `memory.limit` caps on the CPU, and what
    // the plan's bytes count. The resident peak is printed beside it. Every level's estimate falls
    // short of it by the process's own threads and the code pages it touches after the start,
    // which no level changes and which the environment moves (the first case: 958–976 MiB
    // resident on three machines). Mapped, with MKL's buffers left out (`measured`), the first
    // case reads 943.9 MiB against 943.3 planned.
    let cases: [(&str, usize, bool); 6] = [
        ("none", 1, false),
        ("none", 1, true),
        ("none", 2, false),
        ("optimizer", 2, false),
        ("gradients", 2, false),
        ("parameters", 2, false),
    ];
    let (mut planned_peaks, mut outside) = (Vec::new(), Vec::new());
    for (level, world, offload) in cases {
        let extra = vec![format!("dist.shard={level}"), format!("memory.offload_optimizer={offload}")];
        let j = planned(world, &extra);
        let est = j["estimate"]["peak_allocated"].as_u64().unwrap();
        assert_eq!(j["setup"]["shard"], level, "plan reads dist.shard from the config");
        assert_eq!(j["setup"]["offload_optimizer"], offload);
        if level != "none" {
            // The plan is for the busiest rank: the one owning the embedding, rank 0 (the
            // largest tensor goes first, to the lowest rank), whose summary the run writes.
            let share = j["estimate"]["sharding"]["owned_share"].as_f64().unwrap();
            assert!(share > 0.6, "{level}: the busiest rank owns {share}");
        }
        let dir = tempfile::tempdir().unwrap();
        let (resident, mapped) = measured(world, dir.path(), &extra);
        for (what, m) in [("resident", resident), ("mapped", mapped)] {
            let err = est as f64 / m as f64 - 1.0;
            println!(
                "{level} on {world} rank(s), offload {offload}: planned {:.1} MiB, measured {what} {:.1} MiB ({:+.2}%)",
                est as f64 / 1048576.0,
                m as f64 / 1048576.0,
                err * 100.0
            );
            if what == "mapped" && err.abs() > 0.03 {
                outside.push(format!("{level} × {world}, offload {offload}: planned {est} vs {what} {m}"));
            }
        }
        planned_peaks.push(est);
    }
    // Every case is measured and printed before any is judged.
    assert!(outside.is_empty(), "outside ±3%: {outside:#?}");
    // What the levels change is real: offload adds the host copies on the CPU, every level
    // below holds less than the one above.
    assert!(planned_peaks[1] > planned_peaks[0]);
    assert!(planned_peaks[2] > planned_peaks[3] && planned_peaks[3] > planned_peaks[4]);
    assert!(planned_peaks[4] > planned_peaks[5], "parameters holds less than gradients");
}

fn plan_json(args: &[&str]) -> Value {
    let out = Command::new(bin()).arg("plan").args(args).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `plan --config configs/llama3-8b.yaml --gpu h100 --world-size 8`: every level's per-rank
/// figures and bytes sent a step. In bf16-mixed only `parameters` (ZeRO-3) fits an 80 GB card
/// (the fp32 parameters and the fp32 gradients alone are 8 bytes a parameter on every rank at the
/// other levels, 60 GiB): the plan chooses it, with its per-rank peak inside the budget. In
/// bf16-pure `gradients` fits, and, communicating less, is chosen.
#[test]
fn the_8b_shape_on_eight_h100s_lists_every_level_and_says_what_fits() {
    let cfg = repo().join("configs/llama3-8b.yaml").display().to_string();
    let base = ["--config", cfg.as_str(), "--gpu", "h100", "--world-size", "8"];
    let j = plan_json(&base);
    assert!((8.0e9..8.1e9).contains(&(j["params"].as_u64().unwrap() as f64)), "Llama-3-8B: {}", j["params"]);
    let levels = &j["levels"];
    let rows = levels["rows"].as_array().unwrap();
    let names: Vec<String> = rows
        .iter()
        .map(|r| {
            let offload = if r["offload_optimizer"] == true { "+offload" } else { "" };
            format!("{}{offload}", r["shard"].as_str().unwrap())
        })
        .collect();
    assert_eq!(names, ["none", "optimizer", "gradients", "parameters", "parameters+offload"]);
    let totals: Vec<u64> = rows.iter().map(|r| r["total_bytes"].as_u64().unwrap()).collect();
    assert!(totals.windows(2).all(|w| w[0] > w[1]), "each level holds less: {totals:?}");
    let sent = |r: &Value| {
        let c = &r["rank"]["comm"];
        ["all_reduce", "reduce_scatter", "all_gather"].iter().map(|k| c[k].as_u64().unwrap()).sum::<u64>()
    };
    assert!(sent(&rows[1]) > sent(&rows[0]), "ZeRO-1 adds the all-gather to the all-reduce");
    let share = rows[2]["rank"]["owned_share"].as_f64().unwrap();
    assert!((0.125..0.13).contains(&share), "8 ranks own an eighth each, within a tensor: {share}");
    assert!(
        sent(&rows[3]) > sent(&rows[2]),
        "ZeRO-3 gathers the parameters for the forward and the backward"
    );
    let chosen = &rows[levels["chosen"].as_u64().expect("bf16-mixed fits a level") as usize];
    assert_eq!(chosen["shard"], "parameters", "{levels}");
    let budget = j["recommendation"]["budget_bytes"].as_u64().unwrap();
    assert!(chosen["total_bytes"].as_u64().unwrap() <= budget);
    let gradients_total = rows[2]["total_bytes"].as_u64().unwrap();
    assert!(gradients_total > budget, "gradients does not fit bf16-mixed: {gradients_total}");

    let j = plan_json(&[&base[..], &["--precision", "bf16-pure"]].concat());
    let levels = &j["levels"];
    let chosen = &levels["rows"][levels["chosen"].as_u64().expect("a level fits") as usize];
    assert_eq!(chosen["shard"], "gradients");
    assert_eq!(chosen["offload_optimizer"], false);
    let budget = j["recommendation"]["budget_bytes"].as_u64().unwrap();
    assert!(chosen["total_bytes"].as_u64().unwrap() <= budget);
    assert!(chosen["micro_batch"].as_u64().unwrap() >= 1);
    let out = Command::new(bin()).arg("plan").args(base).args(["--precision", "bf16-pure"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("per rank by dist.shard over 8 rank(s)"), "{text}");
    assert!(text.contains("→ dist.shard: gradients fits: micro-batch"), "{text}");
}

#[test]
fn bad_shard_flags_are_one_clear_error_and_exit_code_2() {
    let out = Command::new(bin()).args(["plan", "--shard", "everything"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--shard") && err.contains("optimizer") && err.contains("gradients"), "{err}");
    let out = Command::new(bin()).args(["plan", "--world-size", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(bin()).args(["plan", "--target", "tpu"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--target"));
}
