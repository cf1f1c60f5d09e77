//! Data parallel on CPU with Gloo, launched by the project venv's real `torchrun` or by hand:
//! equivalence with one process, OOM agreement, a dead rank, a torchrun restart.
use crate::common::*;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RUN: [&str; 5] = [
    "train.max_steps=12",
    "train.warmup_steps=2",
    "train.global_batch_size=64",
    "train.eval_interval=5",
    "dist.timeout_s=20",
];

pub(crate) fn args(dir: &Path, sets: &[&str]) -> Vec<String> {
    let mut a =
        vec!["train".to_string(), "--config".into(), repo().join("configs/debug.yaml").display().to_string()];
    for s in [format!("out_dir={}", dir.display()), "train.threads=1".into()]
        .into_iter()
        .chain(sets.iter().map(|s| s.to_string()))
    {
        a.push("--set".into());
        a.push(s);
    }
    a
}

/// Starts rank `rank` of `world` by hand, as torchrun would.
pub(crate) fn spawn_rank(rank: usize, world: usize, port: u16, dir: &Path, sets: &[&str]) -> Child {
    spawn_rank_with(rank, world, port, args(dir, sets))
}

pub(crate) fn spawn_rank_with(rank: usize, world: usize, port: u16, args: Vec<String>) -> Child {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    as_rank(cmd, rank, world, port)
}

/// `cmd` started as rank `rank` of `world`, with the environment torchrun gives a rank.
pub(crate) fn as_rank(mut cmd: Command, rank: usize, world: usize, port: u16) -> Child {
    cmd.env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Every rank's output, whatever its exit.
pub(crate) fn wait_all(children: Vec<Child>) -> Vec<std::process::Output> {
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

/// Every rank's output, once each has exited 0.
pub(crate) fn wait_ok(children: Vec<Child>) -> Vec<std::process::Output> {
    let outs = wait_all(children);
    for (rank, out) in outs.iter().enumerate() {
        // Every rank's stderr: the first to fail explains why the others did.
        let all = outs
            .iter()
            .enumerate()
            .map(|(r, o)| {
                format!("--- rank {r} ({:?}):\n{}", o.status.code(), String::from_utf8_lossy(&o.stderr))
            })
            .collect::<String>();
        assert!(out.status.success(), "rank {rank} failed:\n{all}");
    }
    outs
}

fn assert_matches_single_process(dist_dir: &Path, single: &Run) {
    let metrics = read_jsonl(&dist_dir.join("metrics.jsonl"));
    assert_eq!(metrics.len(), single.metrics().len());
    for (a, b) in metrics.iter().zip(single.metrics()) {
        for key in ["loss", "grad_norm"] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "step {}: {key} {x} vs {y}", a["step"]);
        }
        assert_eq!(a["micro_batch"], b["micro_batch"]);
    }
    let diff = max_weight_diff(dist_dir, &single.dir);
    assert!(diff <= 1e-5, "weights differ from the single-process run by {diff}");
    let compared: Vec<_> = read_jsonl(&dist_dir.join("events.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == "ranks_compared")
        .collect();
    assert_eq!(compared[0]["checksum_spread"].as_f64(), Some(0.0), "both ranks hold identical weights");
}

#[test]
fn two_ranks_under_torchrun_equal_one_process() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let single =
        train(s.path(), "configs/debug.yaml", &[&RUN[..], &["train.micro_batch_size=16"]].concat()).ok();
    let out = Command::new(torchrun())
        .args([
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            &format!("--master_port={}", free_port()),
            "--no-python",
            &bin(),
        ])
        .args(args(d.path(), &[&RUN[..], &["train.micro_batch_size=16"]].concat()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_matches_single_process(d.path(), &single);
    let started = &read_jsonl(&d.path().join("events.jsonl"))[0];
    assert_eq!((started["world_size"].as_u64(), started["accumulation"].as_u64()), (Some(2), Some(2)));
}

/// A checkpoint of one process resumed by two ranks continues the same run: each step's samples
/// are the global batch's, whoever takes them. The change is said where the resume is.
#[test]
fn a_run_of_one_process_resumed_by_two_ranks_trains_as_if_never_stopped() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=16"]].concat();
    let single = train(s.path(), "configs/debug.yaml", &sets).ok();
    train(d.path(), "configs/debug.yaml", &[&sets[..], &["faults.interrupt_at_step=6"]].concat());
    let port = free_port();
    let resumed = |rank| {
        spawn_rank_with(
            rank,
            2,
            port,
            [args(d.path(), &sets), vec!["--resume".into(), "auto".into()]].concat(),
        )
    };
    wait_ok(vec![resumed(0), resumed(1)]);
    assert_matches_single_process(d.path(), &single);
    let events = read_jsonl(&d.path().join("events.jsonl"));
    let resumed = events.iter().find(|e| e["event"] == "resumed").expect("a resumed event");
    let said = "ranks: checkpoint 1, now 2 (the global batch of 64 and each step's samples stay the same: 32 per rank, 64 before)";
    assert!(resumed["changed"].as_array().unwrap().iter().any(|c| c == said), "{resumed}");
}

/// By hand, and with a global batch two ranks cannot share evenly: 63 = 31 + 32 sequences, each
/// split 8 + 8 + 8 + 7 (or + 8); the update is still the mean over all 63.
#[test]
fn two_ranks_launched_by_hand_work_the_same_with_uneven_shares() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=8", "train.global_batch_size=63"]].concat();
    let single = train(s.path(), "configs/debug.yaml", &sets).ok();
    let port = free_port();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets)]);
    assert_matches_single_process(d.path(), &single);
}

/// The keys a rank may set on its own (config::diff::PER_RANK_KEYS) change nothing: rank 1
/// on a smaller micro-batch with activation checkpointing and another thread count trains the
/// same updates as one process.
#[test]
fn a_rank_may_set_its_own_micro_batch_and_memory_savers() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=8"]].concat();
    let single = train(s.path(), "configs/debug.yaml", &sets).ok();
    let own = [
        &sets[..],
        &[
            "train.micro_batch_size=4",
            "memory.activation_checkpointing=blocks",
            "train.threads=2",
            "dist.timeout_s=25",
        ],
    ]
    .concat();
    let port = free_port();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &own)]);
    assert_matches_single_process(d.path(), &single);
}

/// A rank whose config differs from rank 0's (another learning rate: weights that silently
/// diverge; another depth: a hang until dist.timeout_s that blamed a slow rank) stops every
/// rank at the start, before anything is written, and names the keys.
#[test]
fn ranks_whose_configs_differ_stop_at_the_start_naming_the_keys() {
    let d = tempfile::tempdir().unwrap();
    let sets = ["train.max_steps=3", "train.warmup_steps=1", "dist.timeout_s=120"];
    let other = [&sets[..], &["train.lr=0.01", "model.n_layer=3"]].concat();
    let port = free_port();
    let started = Instant::now();
    let outs: Vec<_> = [spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &other)]
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let wall = started.elapsed().as_secs_f64();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
    assert_eq!(outs[1].status.code(), Some(2), "{}", err(1));
    assert!(err(1).contains("rank 1's config differs from rank 0's: model.n_layer: rank 0 2, this rank 3; train.lr: rank 0 0.003, this rank 0.01."), "{}", err(1));
    assert_eq!(outs[0].status.code(), Some(2), "{}", err(0));
    assert!(err(0).contains("rank(s) 1 stopped at the start comparison"), "{}", err(0));
    assert!(wall < 60.0, "stopped at the start, not after dist.timeout_s = 120 s: {wall:.1} s");
    assert!(!d.path().join("metrics.jsonl").exists(), "nothing was written");

    // A corpus only one rank cannot load (not whole uint16 tokens) stops the other the same way.
    let odd = d.path().join("odd.bin");
    std::fs::write(&odd, vec![7u8; 1001]).unwrap();
    let unreadable = format!("data.source=tokens:{}", odd.display());
    let port = free_port();
    let outs: Vec<_> = [
        spawn_rank(0, 2, port, d.path(), &sets),
        spawn_rank(1, 2, port, d.path(), &[&sets[..], &[unreadable.as_str()]].concat()),
    ]
    .into_iter()
    .map(|c| c.wait_with_output().unwrap())
    .collect();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
    assert!(err(1).contains("1001 bytes is not a whole number of uint16 tokens"), "{}", err(1));
    assert_eq!(outs[0].status.code(), Some(2), "{}", err(0));
    assert!(err(0).contains("rank(s) 1 stopped at the start comparison"), "{}", err(0));
}

/// A rank refused on its config never joins: its peer waits dist.timeout_s, then says that a
/// rank did not join and where to look, before libtorch's store text.
#[test]
fn a_rank_that_never_joins_is_named_as_the_cause_of_the_wait() {
    let d = tempfile::tempdir().unwrap();
    let sets = ["train.max_steps=3", "train.warmup_steps=1", "dist.timeout_s=4"];
    let port = free_port();
    let bad = [&sets[..], &["train.warmup_steps=9"]].concat();
    let outs: Vec<_> = [spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &bad)]
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
    assert_eq!(outs[1].status.code(), Some(2), "{}", err(1));
    assert_eq!(outs[0].status.code(), Some(1), "{}", err(0));
    assert!(
        err(0).contains("(not every rank joined within dist.timeout_s: one that failed before joining"),
        "{}",
        err(0)
    );
}

/// Peak mapped memory above start-up of one rank's share (32 sequences) at `micro`.
fn peak_at(micro: usize) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let m = format!("train.micro_batch_size={micro}");
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.global_batch_size=32",
            "train.warmup_steps=0",
            "train.max_steps=2",
            "train.eval_interval=0",
            "memory.limit=1TiB",
            &m,
        ],
    )
    .ok();
    r.summary()["peak_mapped_above_start_bytes"].as_u64().unwrap()
}

#[test]
fn an_oom_on_one_rank_makes_every_rank_replay_at_the_same_step() {
    let cap = format!("memory.limit={}", (peak_at(8) + peak_at(16)) / 2);
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=32"]].concat();
    let port = free_port();
    let rank1_sets = [&sets[..], &[cap.as_str()]].concat();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &rank1_sets)]);
    let events = read_jsonl(&d.path().join("events.jsonl"));
    let changes: Vec<(u64, u64, u64)> = events
        .iter()
        .filter(|e| e["event"] == "oom_recovered")
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["old_micro_batch"].as_u64().unwrap(),
                e["new_micro_batch"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(changes, [(1, 32, 16), (1, 16, 8)], "rank 0 (which had memory) followed rank 1 down");
    assert!(events
        .iter()
        .any(|e| e["event"] == "oom_recovered" && e["error"].as_str().unwrap().contains("another rank")));
    let metrics = read_jsonl(&d.path().join("metrics.jsonl"));
    assert!(
        metrics.iter().all(|m| m["micro_batch"] == 8 && m["accumulation"] == 4),
        "global batch kept: 8 × 4 × 2 ranks"
    );
    // The settled split, from the start, in one process: 8 × 8 = 64.
    let single =
        train(s.path(), "configs/debug.yaml", &[&RUN[..], &["train.micro_batch_size=8"]].concat()).ok();
    assert_matches_single_process(d.path(), &single);
}

/// Ranks may run different micro-batches (`train.micro_batch_size` per rank). Rank 1 runs out of
/// memory at 32 and can halve; rank 0 is at its floor (8) and its own attempt succeeded: it
/// replays the step as it is. (It gave up with exit 3 on an out-of-memory that was not its own,
/// with no checkpoint, and rank 1 then failed in a collective with exit 1.)
#[test]
fn a_rank_at_its_floor_replays_as_it_is_when_a_peer_runs_out_of_memory() {
    let cap = format!("memory.limit={}", (peak_at(8) + peak_at(16)) / 2);
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=8", "oom.min_micro_batch=8"]].concat();
    let rank1 = [&RUN[..], &["train.micro_batch_size=32", "oom.min_micro_batch=8", &cap]].concat();
    let port = free_port();
    let outs =
        wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &rank1)]);
    let rank0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        rank0.contains("another rank ran out of memory; replaying the step at this rank's micro-batch 8"),
        "{rank0}"
    );
    let single = train(s.path(), "configs/debug.yaml", &sets).ok();
    assert_matches_single_process(d.path(), &single);
}

/// A loss that turns non-finite on one rank only (`faults.fault_rank=1`, after the gradient
/// all-reduce) skips the update on every rank: the ranks agree on applying it, so the replicas
/// stay identical (rank 0 applied it alone, and the weights of the two ranks parted).
#[test]
fn a_nonfinite_loss_on_one_rank_skips_the_update_on_every_rank() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let fault = ["train.micro_batch_size=16", "faults.nonfinite_loss_at_steps=[3]"];
    let sets = [&RUN[..], &fault[..], &["faults.fault_rank=1"]].concat();
    let port = free_port();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets)]);
    let skipped: Vec<_> = read_jsonl(&d.path().join("events.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == "nonfinite_skipped")
        .map(|e| e["step"].clone())
        .collect();
    assert_eq!(skipped, [3], "rank 0, whose loss was finite, skipped step 3 with rank 1");
    let compared: Vec<_> = read_jsonl(&d.path().join("events.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == "ranks_compared")
        .collect();
    assert_eq!(compared[0]["checksum_spread"].as_f64(), Some(0.0), "both ranks hold identical weights");
    // The same updates as one process whose step 3 was skipped.
    let single = train(s.path(), "configs/debug.yaml", &[&RUN[..], &fault[..]].concat()).ok();
    let diff = max_weight_diff(d.path(), &single.dir);
    assert!(diff <= 1e-5, "weights differ from the single-process run by {diff}");
}

/// Muon with two ranks trains the updates of one process: every rank holds the whole averaged
/// gradient, so each orthogonalises whole matrices.
#[test]
fn muon_on_two_ranks_equals_one_process() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=16", "optimizer.name=muon"]].concat();
    let single = train(s.path(), "configs/debug.yaml", &sets).ok();
    let port = free_port();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets)]);
    assert_matches_single_process(d.path(), &single);
}

/// A leak on rank 1 alone (`faults.leak_graphs` with `faults.fault_rank=1`), under a cap on rank
/// 1 only. Rank 1 finds the leak at its out-of-memory; rank 0 sees none. Were rank 1 to stop after
/// its one leak halving, rank 0 would replay alone and fail in its next collective (a
/// connection error on Gloo; on NCCL after `dist.timeout_s`). With peers the ranks halve
/// together to the floor, the leak named, and stop there together on the out-of-memory (exit 3).
#[test]
fn a_leak_on_one_rank_halves_every_rank_together_and_they_stop_together() {
    let model = [
        "model.vocab_size=4096",
        "model.seq_len=128",
        "train.micro_batch_size=16",
        "train.warmup_steps=0",
        "train.eval_interval=0",
        "checkpoint.interval=0",
    ];
    let probe = tempfile::tempdir().unwrap();
    let peak = train(
        probe.path(),
        "configs/debug.yaml",
        &[&model[..], &["train.global_batch_size=32", "train.max_steps=2", "memory.limit=1TiB"]].concat(),
    )
    .ok()
    .summary()["peak_mapped_above_start_bytes"]
        .as_u64()
        .unwrap();
    let cap = format!("memory.limit={}", peak + (200 << 20));
    let d = tempfile::tempdir().unwrap();
    let sets = [
        &model[..],
        &[
            "train.global_batch_size=64",
            "train.max_steps=400",
            "dist.timeout_s=120",
            "faults.leak_graphs=true",
            "faults.fault_rank=1",
        ],
    ]
    .concat();
    let rank1_sets = [&sets[..], &[cap.as_str()]].concat();
    let port = free_port();
    let started = Instant::now();
    let ranks = vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &rank1_sets)];
    let outs: Vec<_> = ranks.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let wall = started.elapsed().as_secs_f64();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
    assert_eq!(outs[1].status.code(), Some(3), "{}", err(1));
    assert!(err(1).contains("more is held between steps than at step"), "rank 1 names the leak: {}", err(1));
    assert_eq!(outs[0].status.code(), Some(3), "rank 0 stops with it: {}", err(0));
    let events = read_jsonl(&d.path().join("events.jsonl"));
    let halvings: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e["event"] == "oom_recovered")
        .map(|e| (e["old_micro_batch"].as_u64().unwrap(), e["new_micro_batch"].as_u64().unwrap()))
        .collect();
    assert!(
        halvings.len() > 1 && halvings.last() == Some(&(2, 1)),
        "both ranks halved together down to the floor: {halvings:?}"
    );
    assert!(wall < 90.0, "the ranks stopped together, not after dist.timeout_s = 120 s: {wall:.1} s");
}

#[test]
fn a_killed_rank_makes_the_survivor_fail_within_the_timeout() {
    let d = tempfile::tempdir().unwrap();
    let sets = ["train.max_steps=100000", "dist.timeout_s=5", "checkpoint.interval=0"];
    let port = free_port();
    let mut r0 = spawn_rank(0, 2, port, d.path(), &sets);
    let mut r1 = spawn_rank(1, 2, port, d.path(), &sets);
    let metrics = d.path().join("metrics.jsonl");
    let t0 = Instant::now();
    while read_jsonl(&metrics).len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the group never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    r1.kill().unwrap();
    r1.wait().unwrap();
    let killed_at = Instant::now();
    let status = loop {
        if let Some(s) = r0.try_wait().unwrap() {
            break s;
        }
        if killed_at.elapsed() > Duration::from_secs(30) {
            r0.kill().unwrap();
            panic!("rank 0 still running 30 s after its peer died");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(r0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("collective") || err.contains("Connection"), "a clear error: {err}");
    eprintln!("survivor exited {:?} after {:.1}s", status.code(), killed_at.elapsed().as_secs_f64());
}

/// Rank 0 writes checkpoints alone: the other ranks wait at a fence for as long as rank 0
/// lives, not `dist.timeout_s`, so writes slower than the timeout (slow storage) do not end the
/// job, and each timeout's worth of waiting is said; a rank 0 killed inside a write is named
/// by its peer within seconds. (Synchronous writes, `checkpoint.async: false`: the fence waits
/// for the write itself.)
#[test]
fn a_checkpoint_slower_than_the_timeout_is_waited_for_and_a_writer_killed_inside_it_is_named() {
    let d = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=6",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=3",
        "dist.timeout_s=1",
        "checkpoint.async=false",
        "faults.pause_in_checkpoint_write_ms=3000",
    ];
    let port = free_port();
    let outs =
        wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets)]);
    let saved: Vec<u64> = read_jsonl(&d.path().join("events.jsonl"))
        .iter()
        .filter(|e| e["event"] == "checkpoint_saved")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(saved, [3, 6], "two writes of 3 s each under a 1 s timeout");
    let waiting = String::from_utf8_lossy(&outs[1].stderr);
    let said: Vec<&str> =
        waiting.lines().filter(|l| l.contains("for rank 0 to finish writing alone")).collect();
    assert!(
        !said.is_empty() && said[0].contains("waiting 1 s") && said[0].contains("dist.timeout_s = 1"),
        "{waiting}"
    );
    // Once per second (the timeout) of each wait: the seconds said climb within a wait and start
    // again at the next; two writes, two waits (how long each is depends on the machine's load).
    let seconds: Vec<u64> = said
        .iter()
        .map(|l| {
            l.split("waiting ").nth(1).and_then(|t| t.split(' ').next()).and_then(|n| n.parse().ok()).unwrap()
        })
        .collect();
    let waits = 1 + seconds.windows(2).filter(|w| w[1] <= w[0]).count();
    assert!(waits == 2 && seconds.iter().all(|&s| s >= 1), "{seconds:?}: {waiting}");

    let e = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=100",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=3",
        "dist.timeout_s=1",
        "checkpoint.async=false",
        "faults.pause_in_checkpoint_write_ms=60000",
    ];
    let port = free_port();
    let (mut r0, r1) = (spawn_rank(0, 2, port, e.path(), &sets), spawn_rank(1, 2, port, e.path(), &sets));
    let partial = e.path().join("checkpoints/.tmp-step-00000003/model.safetensors");
    let t0 = Instant::now();
    while !partial.is_file() {
        assert!(t0.elapsed() < Duration::from_secs(60), "checkpoint 3 never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    r0.kill().unwrap();
    r0.wait().unwrap();
    let killed_at = Instant::now();
    let out = r1.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("rank 0 stopped answering while it wrote alone"), "{err}");
    assert!(
        killed_at.elapsed() < Duration::from_secs(20),
        "named after {:.1} s",
        killed_at.elapsed().as_secs_f64()
    );
}

/// `dist.writer_wait_s` bounds that wait: a write hanging with rank 0 alive ends the job on the
/// other ranks (exit 1, the setting named) once it has lasted that long, not once the write does
/// (under torchrun the group is then restarted from the last complete checkpoint).
#[test]
fn a_write_past_dist_writer_wait_s_ends_the_job_on_the_waiting_ranks() {
    let d = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=100",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=3",
        "dist.timeout_s=1",
        "dist.writer_wait_s=3",
        "faults.pause_in_checkpoint_write_ms=120000",
    ];
    let port = free_port();
    let (mut r0, r1) = (spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets));
    let partial = d.path().join("checkpoints/.tmp-step-00000003/model.safetensors");
    let t0 = Instant::now();
    let out = r1.wait_with_output().unwrap();
    let waited = t0.elapsed();
    let (writing, _) = (partial.is_file(), r0.kill());
    r0.wait().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(writing, "rank 0 was inside the write when rank 1 ended: {err}");
    assert!(
        err.contains(
            "rank 0 is still writing alone (a checkpoint or the final weights) after 3 s, dist.writer_wait_s"
        ),
        "{err}"
    );
    // Said every dist.timeout_s before that, and ended long before the 120 s write would.
    assert!(err.contains("waiting 1 s for rank 0 to finish writing alone"), "{err}");
    assert!(waited < Duration::from_secs(90), "ended after {:.1} s", waited.as_secs_f64());
    assert!(
        trainguard::checkpoint::store::list(&trainguard::checkpoint::store::root(d.path())).is_empty(),
        "the write cut short is no checkpoint"
    );
}

/// Checkpoints by time under a group: rank 0's clock decides for every rank (it travels in the
/// stop agreement), so every rank meets rank 0 at the same fences, and the ranks' own clocks,
/// which differ, cannot split them. At an interval of 1.2 ms most steps start past it (a step
/// that starts right after the fence may not): a rank that waited at a fence rank 0 never
/// passed would fail once rank 0 ended, and `wait_ok` would say so.
#[test]
fn checkpoints_by_time_are_taken_at_the_same_steps_by_every_rank() {
    let d = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=8",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.interval_minutes=0.00002",
        "checkpoint.keep_last=100",
        "dist.timeout_s=10",
    ];
    let port = free_port();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets)]);
    let saved: Vec<u64> = read_jsonl(&d.path().join("events.jsonl"))
        .iter()
        .filter(|e| e["event"] == "checkpoint_saved")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert!(
        saved.len() >= 3 && saved.last() == Some(&8) && saved.windows(2).all(|w| w[0] < w[1]),
        "checkpoints by time, once a step at most: {saved:?}"
    );
}

#[test]
fn a_torchrun_restart_resumes_from_the_checkpoint_and_finishes_identically() {
    let (d, plain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [&RUN[..], &["train.micro_batch_size=16", "checkpoint.interval=3"]].concat();
    let port = free_port().to_string();
    let tr = |dir: &Path, extra: &[&str]| {
        Command::new(torchrun())
            .args([
                "--nproc_per_node=2",
                "--max-restarts=1",
                "--master_addr=127.0.0.1",
                &format!("--master_port={port}"),
                "--no-python",
                &bin(),
            ])
            .args(args(dir, &[&sets[..], extra].concat()))
            .output()
            .unwrap()
    };
    let reference = tr(plain.path(), &[]);
    assert!(reference.status.success(), "{}", String::from_utf8_lossy(&reference.stderr));
    let out = tr(d.path(), &["faults.crash_at_step=7", "faults.crash_rank=1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let resumed: Vec<_> =
        read_jsonl(&d.path().join("events.jsonl")).into_iter().filter(|e| e["event"] == "resumed").collect();
    assert_eq!(resumed.len(), 1, "the restarted group resumed by itself: {err}");
    assert_eq!(resumed[0]["step"], 6, "from the newest complete checkpoint");
    let diff = max_weight_diff(d.path(), plain.path());
    assert_eq!(diff, 0.0, "same final weights as an uninterrupted run");
}

/// One rank fails with an error that is not an out-of-memory, after the gradient all-reduce:
/// deterministic mode refusing an op (an `Err`), or an op libtorch refuses that tch raises as a
/// panic. It still joins the agreement, so its peer stops at once, saying why, instead of
/// failing in its next collective with only "a rank died or timed out" (on NCCL after
/// `dist.timeout_s`).
#[test]
fn a_rank_that_fails_alone_stops_its_peers_at_once_not_after_the_timeout() {
    let cases: [(&[&str], i32, &str); 2] = [
        (
            &["deterministic=true", "faults.nondeterministic_op_at_step=3"],
            6,
            "`put_` has no deterministic implementation",
        ),
        (&["faults.failing_scalar_op_at_step=3"], 1, "must match the size of tensor b"),
    ];
    for (fault, code, named) in cases {
        let d = tempfile::tempdir().unwrap();
        let port = free_port();
        let base = [
            "train.max_steps=12",
            "train.warmup_steps=2",
            "train.global_batch_size=64",
            "dist.timeout_s=120",
            "faults.fault_rank=1",
        ];
        let sets = [&base[..], fault].concat();
        let started = Instant::now();
        let ranks: Vec<Child> = (0..2).map(|r| spawn_rank(r, 2, port, d.path(), &sets)).collect();
        let outs: Vec<_> = ranks.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
        let wall = started.elapsed().as_secs_f64();
        let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
        assert_eq!(
            outs[1].status.code(),
            Some(code),
            "{fault:?}: the failing rank names its own error: {}",
            err(1)
        );
        assert!(err(1).contains(named), "{fault:?}: {}", err(1));
        assert!(!outs[0].status.success(), "{fault:?}: {}", err(0));
        assert!(
            err(0).contains("1 other rank(s) failed with an error that is not an out-of-memory"),
            "{fault:?}: {}",
            err(0)
        );
        assert!(
            !err(0).contains("panicked") && !err(1).contains("panicked"),
            "{fault:?}: {}\n{}",
            err(0),
            err(1)
        );
        assert!(wall < 60.0, "{fault:?}: the peer stopped with the failing rank, not after dist.timeout_s = 120 s: {wall:.1} s");
    }
}

/// Without a shared filesystem, rank 1 finds no checkpoint where rank 0 finds step 6's: the
/// ranks would train from different steps. They compare before anything is written: exit 2.
#[test]
fn ranks_that_would_resume_from_different_steps_refuse_to_start() {
    let (shared, elsewhere) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = [
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.global_batch_size=64",
        "checkpoint.interval=3",
        "dist.timeout_s=30",
    ];
    let port = free_port();
    wait_ok((0..2).map(|r| spawn_rank(r, 2, port, shared.path(), &first)).collect());
    let port = free_port();
    let more = [
        "train.max_steps=12",
        "train.warmup_steps=2",
        "train.global_batch_size=64",
        "checkpoint.interval=3",
        "dist.timeout_s=30",
    ];
    let ranks: Vec<Child> = [shared.path(), elsewhere.path()]
        .iter()
        .enumerate()
        .map(|(r, dir)| {
            Command::new(bin())
                .args(args(dir, &more))
                .args(["--resume", "auto"])
                .envs([
                    ("RANK", r.to_string()),
                    ("LOCAL_RANK", r.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("LOCAL_WORLD_SIZE", "2".into()),
                ])
                .envs([("MASTER_ADDR", "127.0.0.1".to_string()), ("MASTER_PORT", port.to_string())])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for out in ranks.into_iter().map(|c| c.wait_with_output().unwrap()) {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("the ranks found different checkpoints to resume from (steps 0 to 6"), "{err}");
    }
    let resumed = read_jsonl(&shared.path().join("events.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == "resumed")
        .count();
    assert_eq!(resumed, 0, "nothing was resumed");
}

/// A fresh run into an out_dir that holds another run: rank 0 alone checks (it alone writes)
/// and refuses; rank 1 learns it at the start comparison and stops too, naming why, instead of
/// failing later in a collective without the cause.
#[test]
fn a_rank_that_cannot_start_stops_the_others_at_the_start() {
    let d = tempfile::tempdir().unwrap();
    let first = [
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.global_batch_size=64",
        "checkpoint.interval=3",
        "dist.timeout_s=120",
    ];
    let port = free_port();
    wait_ok((0..2).map(|r| spawn_rank(r, 2, port, d.path(), &first)).collect());
    let port = free_port();
    let started = Instant::now();
    let outs: Vec<_> = (0..2)
        .map(|r| spawn_rank(r, 2, port, d.path(), &first))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let wall = started.elapsed().as_secs_f64();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
    assert_eq!(outs[0].status.code(), Some(2), "{}", err(0));
    assert!(err(0).contains("already holds 1 checkpoint(s) of another run"), "{}", err(0));
    assert_eq!(outs[1].status.code(), Some(2), "{}", err(1));
    assert!(err(1).contains("another rank could not start"), "{}", err(1));
    assert!(
        wall < 60.0,
        "rank 1 stopped at the start comparison, not after dist.timeout_s = 120 s: {wall:.1} s"
    );

    // `--overwrite` while a run holds the directory: rank 0 refuses to move it aside, and rank 1
    // hears so at the same comparison. Before, rank 0 refused before joining the group and rank
    // 1 waited in its set-up until torchrun killed it.
    let mut lock = std::fs::File::options().write(true).truncate(true).open(d.path().join(".lock")).unwrap();
    lock.try_lock().unwrap();
    std::io::Write::write_all(&mut lock, b"pid 4242 on elsewhere").unwrap();
    let port = free_port();
    let started = Instant::now();
    let overwrite =
        |r| spawn_rank_with(r, 2, port, [args(d.path(), &first), vec!["--overwrite".into()]].concat());
    let outs: Vec<_> = (0..2)
        .map(overwrite)
        .collect::<Vec<_>>()
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let wall = started.elapsed().as_secs_f64();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
    assert_eq!(outs[0].status.code(), Some(2), "{}", err(0));
    assert!(err(0).contains("is in use by another trainguard run (pid 4242 on elsewhere)"), "{}", err(0));
    assert_eq!(outs[1].status.code(), Some(2), "{}", err(1));
    assert!(err(1).contains("another rank could not start"), "{}", err(1));
    assert!(wall < 60.0, "{wall:.1} s");
    assert!(d.path().join("checkpoints").is_dir(), "not moved aside");
}

#[test]
fn nccl_on_the_cpu_is_refused_clearly() {
    let d = tempfile::tempdir().unwrap();
    let mut c = spawn_rank(
        0,
        1,
        free_port(),
        d.path(),
        &["device=cpu", "dist.backend=nccl", "train.max_steps=1", "train.warmup_steps=0"],
    );
    let status = c.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(c.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("nccl needs CUDA devices"), "{err}");
}

/// A rank's fatal error is whole in torchelastic's error file (torchrun's summary shows it),
/// not only its first line, and a rank other than 0 marks each line on stderr as its log does.
#[test]
fn a_ranks_fatal_error_is_whole_in_the_error_file_and_marked_on_stderr() {
    let d = tempfile::tempdir().unwrap();
    let error_file = d.path().join("error.json");
    let mut cmd = command(d.path(), "configs/debug.yaml", &["train.max_steps=3", "train.warmup_steps=5"]);
    cmd.env("RANK", "1").env("WORLD_SIZE", "2").env("TORCHELASTIC_ERROR_FILE", &error_file);
    let r = run(cmd, d.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    let err = r.stderr();
    let lines: Vec<&str> = err.lines().collect();
    assert!(lines.len() >= 2 && lines.iter().all(|l| l.starts_with("[rank 1] ")), "{lines:?}");
    let written = std::fs::read_to_string(&error_file).unwrap();
    assert!(
        written.contains("train.warmup_steps: must not exceed train.max_steps (3), got 5"),
        "the problem itself, not just its header: {written}"
    );
}

/// The divergence guard under two ranks: both see the spike that one destructive update
/// (`faults.lr_spike`) causes, agree to roll back to the same checkpoint, skip the same data and
/// end with identical weights, those of one process doing the same.
#[test]
fn two_ranks_roll_back_together_from_a_divergence() {
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [
        "train.max_steps=40",
        "train.eval_interval=0",
        "checkpoint.interval=10",
        "dist.timeout_s=20",
        "divergence.enabled=true",
        "faults.lr_spike={data_step: 31, factor: 1000}",
    ];
    let single = train(s.path(), "configs/debug.yaml", &sets).ok();
    let port = free_port();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &sets)]);
    let events = read_jsonl(&d.path().join("events.jsonl"));
    let of = |kind: &str| events.iter().filter(|e| e["event"] == kind).cloned().collect::<Vec<_>>();
    let rolled = of("rolled_back");
    assert_eq!(rolled.len(), 1, "{events:?}");
    let window = |e: &serde_json::Value| {
        ["step", "diverged_step", "skipped_from", "skipped_to"].map(|k| e[k].as_u64().unwrap())
    };
    assert_eq!(window(&rolled[0]), [30, 32, 31, 32]);
    assert_eq!(window(&rolled[0]), window(&single.events_of("rolled_back")[0]), "as one process");
    assert_eq!(
        of("ranks_compared")[0]["checksum_spread"].as_f64(),
        Some(0.0),
        "both ranks hold identical weights"
    );
    let diff = max_weight_diff(d.path(), &single.dir);
    assert!(diff <= 1e-5, "weights differ from the single-process run by {diff}");
}

/// `checkpoint.async` with two ranks: rank 0 writes in the background while both train on.
/// Both killed while a background write is in flight (checkpoint 4 half written, 2 complete),
/// `--resume auto` on both resumes from checkpoint 2, agreed, and ends bitwise where a run that
/// was not killed does.
#[test]
fn two_ranks_killed_during_a_background_write_resume_from_the_last_complete_checkpoint() {
    let (straight, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = [
        "train.max_steps=8",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=2",
        "checkpoint.async=true",
    ];
    let port = free_port();
    wait_ok(vec![
        spawn_rank(0, 2, port, straight.path(), &sets),
        spawn_rank(1, 2, port, straight.path(), &sets),
    ]);
    let paused = [&sets[..], &["faults.pause_in_checkpoint_write_ms=1500"]].concat();
    let port = free_port();
    let mut ranks =
        vec![spawn_rank(0, 2, port, killed.path(), &paused), spawn_rank(1, 2, port, killed.path(), &paused)];
    let root = killed.path().join("checkpoints");
    let complete = |step: u64| root.join(format!("step-{step:08}")).is_dir();
    let t0 = Instant::now();
    while !(complete(2) && root.join(".tmp-step-00000004/model.safetensors").is_file()) {
        assert!(t0.elapsed() < Duration::from_secs(120), "checkpoint 4 never started");
        assert!(ranks.iter_mut().all(|r| r.try_wait().unwrap().is_none()), "a rank ended early");
        std::thread::sleep(Duration::from_millis(5));
    }
    for r in &mut ranks {
        r.kill().unwrap(); // SIGKILL
        r.wait().unwrap();
    }
    assert!(!complete(4), "checkpoint 4 was in flight");
    let port = free_port();
    let resume = |rank: usize| {
        spawn_rank_with(
            rank,
            2,
            port,
            [args(killed.path(), &sets), vec!["--resume".into(), "auto".into()]].concat(),
        )
    };
    wait_ok(vec![resume(0), resume(1)]);
    // Every rank started where rank 0 did (the start's agreement refuses any other step).
    let resumed: Vec<u64> = read_jsonl(&killed.path().join("events.jsonl"))
        .iter()
        .filter(|e| e["event"] == "resumed")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(resumed, [2]);
    assert_bitwise_equal(
        &straight.path().join("model.safetensors"),
        &killed.path().join("model.safetensors"),
    );
}

/// `dist.overlap` (the default): the last micro-step's backward all-reduces each block's bucket
/// as it fills, the earlier micro-steps' sums added on the way. Two ranks (32 + 31 samples at
/// micro-batch 8; rank 1 recomputing its blocks) train the same bits as with the all-reduce
/// after backward, and rank 0 (which alone logs) started its blocks' buckets (not the
/// embeddings' or the head's) inside backward.
#[test]
fn gradients_all_reduced_during_backward_train_bit_for_bit_as_after_it() {
    overlapped_as_waited(&RUN, "gradient buckets all-reduced");
}

/// Two ranks with `sets` and 32 + 31 samples at micro-batch 8 (rank 1 recomputing its blocks, so
/// that its gradients come in another order, and `dist.bucket_mb=0.01`), under `dist.overlap`
/// and then with each collective waited for: the same bits, and rank 0 (which alone logs) said
/// that some, not all, of its `units` (as it names them) left from inside backward.
pub(crate) fn overlapped_as_waited(sets: &[&str], units: &str) {
    let sets =
        [sets, &["train.micro_batch_size=8", "train.global_batch_size=63", "dist.bucket_mb=0.01"]].concat();
    let run = |dir: &Path, sets: &[&str]| {
        let port = free_port();
        let own = [sets, &["memory.activation_checkpointing=blocks"]].concat();
        wait_ok(vec![spawn_rank(0, 2, port, dir, sets), spawn_rank(1, 2, port, dir, &own)])
    };
    let (o, w) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let stderr = String::from_utf8_lossy(&run(o.path(), &sets)[0].stderr).into_owned();
    let tail = format!(" {units} during backward");
    let said = stderr
        .lines()
        .find_map(|l| l.split("dist.overlap: ").nth(1)?.strip_suffix(tail.as_str()))
        .unwrap_or_else(|| panic!("rank 0 did not say how many {units} overlapped:\n{stderr}"));
    let (early, all) = said.split_once(" of ").unwrap();
    let (early, all): (usize, usize) = (early.parse().unwrap(), all.parse().unwrap());
    assert!(early > 0 && early < all, "{early} of {all} {units} inside backward");
    run(w.path(), &[&sets[..], &["dist.overlap=false"]].concat());
    assert_eq!(max_weight_diff(o.path(), w.path()), 0.0, "{units} during backward against after it");
}
