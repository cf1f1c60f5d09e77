//! Weighted mixtures (`data.sources`) on the real binary: a run stopped and resumed by another
//! number of ranks (Gloo, launched by hand as torchrun would) equals the straight run; tokens
//! per source in metrics, the checkpoint and the report; a change of weights on resume said;
//! bad entries refused naming their key (exit 2).
use crate::common::*;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Stdio};

const RUN: [&str; 6] = [
    "train.max_steps=10",
    "train.warmup_steps=2",
    "train.global_batch_size=32",
    "train.micro_batch_size=8",
    "train.eval_interval=5",
    "dist.timeout_s=20",
];

/// Two text corpora told apart by their bytes (letters, digits), and the `--set` of a mixture
/// of them at `web` / `digits` weights.
fn corpora(dir: &Path, web: f64, digits: f64) -> String {
    let letters: String = (0..40_000).map(|i| (b'a' + (i * 7 % 26) as u8) as char).collect();
    let numbers: String = (0..40_000).map(|i| (b'0' + (i * 3 % 10) as u8) as char).collect();
    std::fs::write(dir.join("web.txt"), letters).unwrap();
    std::fs::write(dir.join("digits.txt"), numbers).unwrap();
    format!(
        "data.sources=[{{source: \"text:{}\", weight: {web}}}, {{source: \"text:{}\", weight: {digits}}}]",
        dir.join("web.txt").display(),
        dir.join("digits.txt").display()
    )
}

/// Rank `rank` of `world`, started by hand with torchrun's environment.
fn spawn_rank(rank: usize, world: usize, port: u16, dir: &Path, sets: &[&str]) -> Child {
    crate::dist::as_rank(command(dir, "configs/debug.yaml", sets), rank, world, port)
}

fn wait_all(children: Vec<Child>) -> Vec<std::process::Output> {
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

fn state(dir: &Path, step: u64) -> Value {
    let path = dir.join(format!("checkpoints/step-{step:08}/trainer_state.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn a_mixture_stopped_on_two_ranks_and_resumed_on_three_equals_the_straight_run() {
    let (data, straight, split) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mixture = corpora(data.path(), 0.8, 0.2);
    let sets = [&RUN[..], &[mixture.as_str()]].concat();
    let whole = train(straight.path(), "configs/debug.yaml", &sets).ok();

    // Two ranks stop after step 4 (exit 4, checkpointed); three ranks resume and finish.
    let port = free_port();
    let stop = [&sets[..], &["faults.interrupt_at_step=4"]].concat();
    for (rank, out) in wait_all((0..2).map(|r| spawn_rank(r, 2, port, split.path(), &stop)).collect())
        .into_iter()
        .enumerate()
    {
        assert_eq!(out.status.code(), Some(4), "rank {rank}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let port = free_port();
    let resume = sets.clone();
    let children = (0..3)
        .map(|r| {
            let mut c = command(split.path(), "configs/debug.yaml", &resume);
            c.args(["--resume", "auto"])
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    for (rank, out) in wait_all(children).into_iter().enumerate() {
        assert!(out.status.success(), "rank {rank}: {}", String::from_utf8_lossy(&out.stderr));
    }

    // The same losses, validation losses (overall and per source) and weights.
    let (a, b) = (read_jsonl(&split.path().join("metrics.jsonl")), whole.metrics());
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        for key in ["loss", "grad_norm", "val_loss", "val_loss/web.txt", "val_loss/digits.txt"] {
            match (x[key].as_f64(), y[key].as_f64()) {
                (Some(p), Some(q)) => {
                    assert!((p - q).abs() <= 1e-5 * q.abs().max(1.0), "step {}: {key} {p} vs {q}", x["step"])
                }
                (p, q) => assert_eq!(p, q, "step {}: {key}", x["step"]),
            }
        }
        for key in ["tokens_seen/web.txt", "tokens_seen/digits.txt"] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
    let diff = max_weight_diff(split.path(), straight.path());
    assert!(diff <= 1e-5, "weights differ from the straight run by {diff}");

    // Each source evaluated on its own: two figures, neither the overall one.
    let last = b.last().unwrap();
    let (v, w, d) =
        (last["val_loss"].as_f64(), last["val_loss/web.txt"].as_f64(), last["val_loss/digits.txt"].as_f64());
    assert!(w.is_some() && d.is_some() && w != d && v != w, "{last}");
    // Tokens by source: all of them, near the weights over 10 steps of 32 × 64 tokens.
    let (web, digits) =
        (last["tokens_seen/web.txt"].as_u64().unwrap(), last["tokens_seen/digits.txt"].as_u64().unwrap());
    assert_eq!(web + digits, 10 * 32 * 64);
    let share = web as f64 / (web + digits) as f64;
    assert!((share - 0.8).abs() < 0.06, "web's share {share}");
    let st = state(straight.path(), 10);
    assert_eq!(
        (st["tokens_by_source"]["web.txt"].as_u64(), st["tokens_by_source"]["digits.txt"].as_u64()),
        (Some(web), Some(digits))
    );
    let report = std::process::Command::new(bin()).arg("report").arg(straight.path()).output().unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let page = std::fs::read_to_string(String::from_utf8_lossy(&report.stdout).trim()).unwrap();
    assert!(page.contains("<caption>data mixture</caption>"), "no mixture table");
    assert!(page.contains(&format!("<td>web.txt</td><td>{web}</td>")), "web's tokens not on the page");
}

#[test]
fn new_weights_on_resume_are_said_and_the_tokens_seen_carry_on() {
    let (data, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let before = corpora(data.path(), 0.8, 0.2);
    let sets =
        ["train.max_steps=4", "train.warmup_steps=1", "train.eval_interval=0", "train.global_batch_size=16"];
    let stopped = train(
        dir.path(),
        "configs/debug.yaml",
        &[&sets[..], &[before.as_str(), "faults.interrupt_at_step=2"]].concat(),
    );
    assert_eq!(stopped.code(), 4, "{}", stopped.stderr());
    let seen = state(dir.path(), 2)["tokens_by_source"].clone();
    let after = corpora(data.path(), 0.5, 0.5);
    let r = run(
        {
            let mut c = command(dir.path(), "configs/debug.yaml", &[&sets[..], &[after.as_str()]].concat());
            c.args(["--resume", "auto"]);
            c
        },
        dir.path(),
    )
    .ok();
    let resumed = &r.events_of("resumed")[0];
    let said = "data mixture: digits.txt 20.0% → 50.0%, web.txt 80.0% → 50.0%";
    assert!(resumed["changed"].as_array().unwrap().iter().any(|c| c == said), "{resumed}");
    // Steps 3 and 4 add to what steps 1 and 2 had seen, under the new weights.
    let end = state(dir.path(), 4)["tokens_by_source"].clone();
    let total = |v: &Value| v["web.txt"].as_u64().unwrap() + v["digits.txt"].as_u64().unwrap();
    assert_eq!((total(&seen), total(&end)), (2 * 16 * 64, 4 * 16 * 64));
    assert!(end["digits.txt"].as_u64() >= seen["digits.txt"].as_u64());
}

#[test]
fn bad_mixture_entries_are_refused_naming_their_key() {
    let (data, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let web = data.path().join("web.txt");
    std::fs::write(&web, "a".repeat(10_000)).unwrap();
    let entry = |source: &str, weight: &str| format!("{{source: \"{source}\", weight: {weight}}}");
    let good = entry(&format!("text:{}", web.display()), "1");
    let cases = [
        (
            format!("data.sources=[{good}, {}]", entry("synthetic", "0")),
            "data.sources[1].weight: must be a positive",
        ),
        (
            format!("data.sources=[{}, {good}]", entry("synthetic", "-0.5")),
            "data.sources[0].weight: must be a positive",
        ),
        (
            format!(
                "data.sources=[{}, {}]",
                entry("synthetic", "0"),
                entry(&format!("text:{}", web.display()), "0")
            ),
            "data.sources[1].weight: must be a positive",
        ),
        (
            format!("data.sources=[{good}, {}]", entry("text:/no/such/file.txt", "1")),
            "data.sources[1].source: file `/no/such/file.txt` does not exist",
        ),
        (
            format!("data.sources=[{good}, {}]", entry("csv:x", "1")),
            "data.sources[1].source: unknown source kind",
        ),
    ];
    for (set, said) in cases {
        let r = train(dir.path(), "configs/debug.yaml", &[&set]);
        assert_eq!(r.code(), 2, "{set}: {}", r.stderr());
        assert!(r.stderr().contains(said), "{set}: wanted `{said}` in:\n{}", r.stderr());
        assert!(!r.stderr().contains("panicked"), "{}", r.stderr());
    }
    // Both ways of naming the data: both keys named.
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[&format!("data.sources=[{good}]"), "data.source=text:/x.txt"],
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("data.source: cannot be set together with data.sources"), "{}", r.stderr());
}
