//! Sharded data parallel (`dist.shard`) and optimizer offload on CPU with Gloo ranks: each level
//! on 2, 3 and 4 ranks equals one process, checkpoints every rank writes its part of, resumed at
//! other world sizes and levels, and a rank killed inside a checkpoint write.
use crate::common::*;
use crate::dist::{args, overlapped_as_waited, spawn_rank, spawn_rank_with, wait_all, wait_ok};
use std::path::Path;
use std::time::{Duration, Instant};

/// 20 steps (a checkpoint at 10 and 20), uneven rank shares for 3 ranks (64 = 21 + 21 + 22).
const RUN: [&str; 7] = [
    "train.max_steps=20",
    "train.warmup_steps=2",
    "train.global_batch_size=64",
    "train.micro_batch_size=16",
    "train.eval_interval=10",
    "checkpoint.interval=10",
    "dist.timeout_s=30",
];

fn ranks(world: usize, dir: &Path, sets: &[&str]) {
    let port = free_port();
    wait_ok((0..world).map(|r| spawn_rank(r, world, port, dir, sets)).collect());
}

fn resumed_ranks(world: usize, dir: &Path, sets: &[&str]) {
    let port = free_port();
    let resume = |r| {
        spawn_rank_with(r, world, port, [args(dir, sets), vec!["--resume".into(), "auto".into()]].concat())
    };
    wait_ok((0..world).map(resume).collect());
}

/// `world` ranks (resuming when `resume`) that stop at `faults.interrupt_at_step` as on a
/// signal: each exits 4 (docs/exit-codes.md), its checkpoint written.
fn interrupted_ranks(world: usize, dir: &Path, sets: &[&str], resume: bool) {
    let port = free_port();
    let tail: Vec<String> = if resume { vec!["--resume".into(), "auto".into()] } else { Vec::new() };
    let children: Vec<_> = (0..world)
        .map(|r| spawn_rank_with(r, world, port, [args(dir, sets), tail.clone()].concat()))
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(4), "rank {r}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Loss and gradient norm of every step within 1e-5 of the one-process run's, and the weights.
fn assert_like(dir: &Path, single: &Path, what: &str) {
    let tol = 1e-5;
    let (a, b) = (read_jsonl(&dir.join("metrics.jsonl")), read_jsonl(&single.join("metrics.jsonl")));
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(&b) {
        for key in ["loss", "grad_norm"] {
            let (u, v) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!((u - v).abs() <= tol * v.abs().max(1.0), "{what}, step {}: {key} {u} vs {v}", x["step"]);
        }
    }
    let diff = max_weight_diff(dir, single);
    assert!(diff <= tol, "{what}: weights differ from one process by {diff}");
}

/// The optimizer files of the newest checkpoint of a run.
fn optimizer_files(dir: &Path) -> Vec<String> {
    let newest = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("step-"))
        .max()
        .unwrap();
    let mut files: Vec<String> = std::fs::read_dir(newest)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("optimizer"))
        .collect();
    files.sort();
    files
}

#[test]
fn each_shard_level_on_two_three_and_four_ranks_equals_one_process() {
    let s = tempfile::tempdir().unwrap();
    train(s.path(), "configs/debug.yaml", &RUN).ok();
    for level in ["optimizer", "gradients", "parameters"] {
        for world in [2, 3, 4] {
            let d = tempfile::tempdir().unwrap();
            let shard = format!("dist.shard={level}");
            ranks(world, d.path(), &[&RUN[..], &[shard.as_str()]].concat());
            assert_like(d.path(), s.path(), &format!("{level} on {world} ranks"));
            let want: Vec<String> =
                (0..world).map(|r| format!("optimizer.rank-{r:05}-of-{world:05}.safetensors")).collect();
            assert_eq!(optimizer_files(d.path()), want, "every rank wrote its own part");
        }
    }
}

/// Llama with Adafactor (factored rows: its state laid out per whole matrix), sharded over 3
/// ranks at both gradient levels, equals one process; a vocabulary of 250 padded to 256 rows
/// (the padded embedding's rows, which no gather writes, stay zero under `parameters`).
#[test]
fn llama_with_adafactor_sharded_over_three_ranks_equals_one_process() {
    let sets = [&RUN[..], &["optimizer.name=adafactor", "train.threads=1", "model.vocab_size=250"]].concat();
    let s = tempfile::tempdir().unwrap();
    train(s.path(), "configs/llama-debug.yaml", &sets).ok();
    for level in ["dist.shard=gradients", "dist.shard=parameters"] {
        let d = tempfile::tempdir().unwrap();
        let port = free_port();
        let rank = |r| {
            let mut a = args(d.path(), &[&sets[..], &[level]].concat());
            a[2] = repo().join("configs/llama-debug.yaml").display().to_string();
            spawn_rank_with(r, 3, port, a)
        };
        wait_ok(vec![rank(0), rank(1), rank(2)]);
        assert_like(d.path(), s.path(), &format!("llama with adafactor, {level}"));
    }
}

/// 8-bit AdamW's quantisation rounds a gradient's last-bit differences (another order of the
/// sum over ranks) into a visible step, so it is compared where the gradients are the same
/// bits: sharding only the optimizer state, the ranks average as replicated ranks do, and each
/// rank's blocks update exactly as there.
#[test]
fn adamw8bit_with_its_state_sharded_equals_replicated_ranks_bit_for_bit() {
    let sets = [&RUN[..], &["optimizer.name=adamw8bit"]].concat();
    let (r, d) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    ranks(3, r.path(), &sets);
    ranks(3, d.path(), &[&sets[..], &["dist.shard=optimizer"]].concat());
    assert_eq!(max_weight_diff(d.path(), r.path()), 0.0);
    assert_eq!(optimizer_files(d.path()).len(), 3);
}

/// Stopped at step 7 on 2 ranks sharding gradients, resumed by 3 ranks sharding the optimizer
/// state only, stopped at 14, and finished by one process without sharding: the straight run's
/// weights. Each resume reads the parts of whatever world and level wrote them.
#[test]
fn a_run_resumed_from_two_sharded_ranks_to_three_to_one_process_trains_as_the_straight_run() {
    let (s, d) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    train(s.path(), "configs/debug.yaml", &RUN).ok();
    interrupted_ranks(
        2,
        d.path(),
        &[&RUN[..], &["dist.shard=gradients", "faults.interrupt_at_step=7"]].concat(),
        false,
    );
    assert_eq!(optimizer_files(d.path()).len(), 2);
    interrupted_ranks(
        3,
        d.path(),
        &[&RUN[..], &["dist.shard=optimizer", "faults.interrupt_at_step=14"]].concat(),
        true,
    );
    assert_eq!(optimizer_files(d.path()).len(), 3);
    let mut c = command(d.path(), "configs/debug.yaml", &RUN);
    c.args(["--resume", "auto"]);
    run(c, d.path()).ok();
    assert_eq!(optimizer_files(d.path()), ["optimizer.safetensors"]);
    let diff = max_weight_diff(d.path(), s.path());
    assert!(diff <= 1e-5, "weights differ from the straight run by {diff}");
}

/// `memory.offload_optimizer`: the update on host copies of the weights gives the same weights
/// as the update in place, bit for bit, alone and under sharding.
#[test]
fn offloading_the_optimizer_trains_exactly_as_without() {
    let (s, o) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    train(s.path(), "configs/debug.yaml", &RUN).ok();
    train(o.path(), "configs/debug.yaml", &[&RUN[..], &["memory.offload_optimizer=true"]].concat()).ok();
    assert_eq!(max_weight_diff(o.path(), s.path()), 0.0);
    let d = tempfile::tempdir().unwrap();
    ranks(2, d.path(), &[&RUN[..], &["dist.shard=gradients", "memory.offload_optimizer=true"]].concat());
    assert_like(d.path(), s.path(), "offload under sharding");
    let p = tempfile::tempdir().unwrap();
    ranks(2, p.path(), &[&RUN[..], &["dist.shard=parameters", "memory.offload_optimizer=true"]].concat());
    assert_like(p.path(), s.path(), "offload with sharded parameters");
}

/// A rank killed inside a checkpoint write (rank 1 while it stages its part, or rank 0 while it
/// writes the checkpoint) leaves the previous checkpoint whole: both ranks resume from it and
/// finish with the weights of a run that was never killed, bit for bit.
#[test]
fn a_rank_killed_inside_a_sharded_checkpoint_write_leaves_the_previous_one_whole() {
    let reference = tempfile::tempdir().unwrap();
    let sets = [&RUN[..], &["dist.shard=gradients"]].concat();
    ranks(2, reference.path(), &sets);
    for victim in [1usize, 0] {
        let d = tempfile::tempdir().unwrap();
        let slow =
            [&sets[..], &["faults.pause_in_checkpoint_write_ms=8000", "checkpoint.interval=5"]].concat();
        let port = free_port();
        let mut children: Vec<_> = (0..2).map(|r| spawn_rank(r, 2, port, d.path(), &slow)).collect();
        // Rank 1 pauses once its staging directory exists; rank 0 once model.safetensors is in
        // its temporary checkpoint. Checkpoint 5 is written first: kill inside checkpoint 10.
        let inside = match victim {
            1 => d.path().join("checkpoints/.tmp-shard-step-00000010-1"),
            _ => d.path().join("checkpoints/.tmp-step-00000010/model.safetensors"),
        };
        let t0 = Instant::now();
        while !inside.exists() {
            assert!(t0.elapsed() < Duration::from_secs(300), "checkpoint 10 never started");
            std::thread::sleep(Duration::from_millis(20));
        }
        children[victim].kill().unwrap();
        for c in &mut children {
            let _ = c.wait();
        }
        assert!(d.path().join("checkpoints/step-00000005/trainer_state.json").is_file());
        assert!(!d.path().join("checkpoints/step-00000010").exists(), "victim {victim}");
        // Without the pause, resumed from 5 (leftovers removed), to the end.
        resumed_ranks(2, d.path(), &[&sets[..], &["checkpoint.interval=5"]].concat());
        let resumed: Vec<_> = read_jsonl(&d.path().join("events.jsonl"))
            .into_iter()
            .filter(|e| e["event"] == "resumed")
            .collect();
        assert_eq!(resumed.last().unwrap()["step"], 5, "victim {victim}");
        assert_eq!(max_weight_diff(d.path(), reference.path()), 0.0, "victim {victim}");
    }
}

/// A model whose AdamW state and all-reduce buckets weigh more than its activations (13M
/// parameters: ~200 MB of state and buckets per replicated rank), at its micro-batch floor with
/// every block checkpointed already: only moving state away can make it fit.
const HEAVY: [&str; 13] = [
    "model.n_embd=512",
    "model.n_head=8",
    "model.n_layer=4",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "oom.min_micro_batch=2",
    "memory.activation_checkpointing=blocks",
    "train.max_steps=4",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "dist.timeout_s=60",
    // Pieces of 2 MiB: the collectives' buffers are then small beside the 50 MB of weights.
    "dist.bucket_mb=2",
];

/// Rank 0's peak mapped memory above its start on 2 ranks, with `sets`, training alone (a
/// checkpoint's write buffers, outside the cap, would be the peak).
fn rank_peak(sets: &[&str]) -> u64 {
    let d = tempfile::tempdir().unwrap();
    ranks(2, d.path(), &[sets, &["memory.limit=1TiB", "checkpoint.at_end=false"]].concat());
    let finished =
        read_jsonl(&d.path().join("events.jsonl")).into_iter().find(|e| e["event"] == "run_finished");
    finished.unwrap()["peak_mapped_above_start_bytes"].as_u64().unwrap()
}

/// Two replicated ranks at their floor under a per-rank cap between the replicated and the
/// sharded peak: without escalation they stop with exit 3; with `oom.escalate: [shard_gradients]`
/// both move to sharded gradients at the same step and train on, the global batch kept, the
/// level in trainer_state.json.
#[test]
fn replicated_ranks_at_their_floor_escalate_to_sharding_instead_of_exiting_3() {
    let (replicated, sharded) =
        (rank_peak(&HEAVY), rank_peak(&[&HEAVY[..], &["dist.shard=gradients"]].concat()));
    assert!(sharded + (40 << 20) < replicated, "sharding saves state and buckets: {sharded} vs {replicated}");
    let cap = format!("memory.limit={}", (replicated + sharded) / 2);
    let capped = [&HEAVY[..], &[cap.as_str()]].concat();

    let d = tempfile::tempdir().unwrap();
    let port = free_port();
    let outs = wait_all((0..2).map(|r| spawn_rank(r, 2, port, d.path(), &capped)).collect());
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(3), "rank {r}: {}", String::from_utf8_lossy(&o.stderr));
    }

    let e = tempfile::tempdir().unwrap();
    ranks(2, e.path(), &[&capped[..], &["oom.escalate=[shard_gradients]"]].concat());
    let events = read_jsonl(&e.path().join("events.jsonl"));
    let escalated: Vec<_> = events.iter().filter(|e| e["event"] == "oom_escalated").collect();
    assert_eq!(escalated.len(), 1, "{events:?}");
    let metrics = read_jsonl(&e.path().join("metrics.jsonl"));
    assert_eq!(metrics.len(), 4);
    assert!(
        metrics.iter().all(|m| m["micro_batch"] == 2 && m["accumulation"] == 1),
        "global batch kept: 2 × 1 × 2 ranks"
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(e.path().join("checkpoints/step-00000004/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["guard"]["escalation_level"], 1);
    assert_eq!(optimizer_files(e.path()).len(), 2, "each rank wrote its part");

    // Resumed to step 6 without the cap, and a copy of the run resumed under it: the level comes
    // back in both, and with no rank capped the gradients are reduced into their owners from
    // inside backward (the escalation set up where the replicated buckets were). The weights
    // are those of the capped resume (reduce-scattered after backward), within 1e-5.
    let f = tempfile::tempdir().unwrap();
    let copied = std::process::Command::new("cp").arg("-rT").arg(e.path()).arg(f.path()).status().unwrap();
    assert!(copied.success());
    let escalating = [&HEAVY[..], &["oom.escalate=[shard_gradients]", "train.max_steps=6"]].concat();
    let resumed = |dir: &Path, sets: &[&str]| {
        let port = free_port();
        let rank = |r| {
            spawn_rank_with(r, 2, port, [args(dir, sets), vec!["--resume".into(), "auto".into()]].concat())
        };
        String::from_utf8_lossy(&wait_ok(vec![rank(0), rank(1)])[0].stderr).into_owned()
    };
    let said = resumed(e.path(), &escalating);
    assert!(said.contains("gradients reduced into their owners during backward"), "{said}");
    let said = resumed(f.path(), &[&escalating[..], &[cap.as_str()]].concat());
    assert!(!said.contains("during backward"), "{said}");
    let diff = max_weight_diff(e.path(), f.path());
    assert!(diff <= 1e-5, "resumed and overlapped against resumed under the cap: {diff}");
}

/// `dist.shard: parameters`: rank 1 alone, under a cap between the peaks at micro-batch 16 and
/// 32 (measured here), runs out of memory in the middle of a micro-step, between two of its
/// gathers. Both ranks leave the attempt at the next collective (rank 0 was waiting there),
/// replay step 1 at 16 together, and train on to the weights of one process at 16.
#[test]
fn an_oom_on_one_rank_between_the_gathers_of_a_micro_step_replays_on_every_rank() {
    let base = [
        "dist.shard=parameters",
        "train.global_batch_size=64",
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        "dist.timeout_s=30",
    ];
    let peak = |micro: &str| rank_peak(&[&base[..], &[micro]].concat());
    let (at16, at32) = (peak("train.micro_batch_size=16"), peak("train.micro_batch_size=32"));
    assert!(at16 + (2 << 20) < at32, "a larger micro-batch needs more: {at16} vs {at32}");
    let cap = format!("memory.limit={}", (at16 + at32) / 2);
    let sets = [&base[..], &["train.micro_batch_size=32"]].concat();
    let (d, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let port = free_port();
    let rank1 = [&sets[..], &[cap.as_str()]].concat();
    wait_ok(vec![spawn_rank(0, 2, port, d.path(), &sets), spawn_rank(1, 2, port, d.path(), &rank1)]);
    let events = read_jsonl(&d.path().join("events.jsonl"));
    let recovered: Vec<_> = events.iter().filter(|e| e["event"] == "oom_recovered").collect();
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    assert_eq!(
        (recovered[0]["step"].as_u64(), recovered[0]["new_micro_batch"].as_u64()),
        (Some(1), Some(16))
    );
    assert!(recovered[0]["error"].as_str().unwrap().contains("another rank"), "rank 0 followed rank 1");
    let metrics = read_jsonl(&d.path().join("metrics.jsonl"));
    assert!(metrics.iter().all(|m| m["micro_batch"] == 16 && m["accumulation"] == 2), "global batch kept");
    train(s.path(), "configs/debug.yaml", &[&base[1..], &["train.micro_batch_size=16"]].concat()).ok();
    assert_like(d.path(), s.path(), "after the replay");
}

/// The escalation to `shard_parameters`: two replicated ranks at their floor under the per-rank
/// cap of the test above (between the replicated and the `gradients` peak: the replicated set-up
/// fits, its step does not) train on once every rank holds only its own parameters through the
/// step, the global batch kept; between steps the model is whole and the same on both ranks (the
/// run's closing comparison).
#[test]
fn replicated_ranks_at_their_floor_escalate_to_sharded_parameters() {
    let (replicated, sharded) =
        (rank_peak(&HEAVY), rank_peak(&[&HEAVY[..], &["dist.shard=gradients"]].concat()));
    let parameters = rank_peak(&[&HEAVY[..], &["dist.shard=parameters"]].concat());
    assert!(parameters < sharded, "ZeRO-3 holds less than ZeRO-2: {parameters} vs {sharded}");
    let cap = format!("memory.limit={}", (replicated + sharded) / 2);
    let capped = [&HEAVY[..], &[cap.as_str(), "oom.escalate=[shard_parameters]"]].concat();
    let e = tempfile::tempdir().unwrap();
    ranks(2, e.path(), &capped);
    let events = read_jsonl(&e.path().join("events.jsonl"));
    let escalated: Vec<_> = events.iter().filter(|e| e["event"] == "oom_escalated").collect();
    assert_eq!(escalated.len(), 1, "{events:?}");
    let metrics = read_jsonl(&e.path().join("metrics.jsonl"));
    assert_eq!(metrics.len(), 4);
    assert!(metrics.iter().all(|m| m["micro_batch"] == 2 && m["accumulation"] == 1), "global batch kept");
    let compared = events.iter().find(|e| e["event"] == "ranks_compared").expect("ranks compared");
    assert_eq!(compared["checksum_spread"], 0.0, "both ranks hold the same whole weights");
}

/// Two replicated ranks escalating to `parameters` under caps spread from the sharded peak to
/// the replicated one: wherever a cap falls (in the setup, in the replicated step, in the move
/// of the optimizer state, after it), the ranks agree. Both finish, or both stop with the same
/// documented code and its reason, never a collective that failed under them: the all-reduce's
/// scratch met the cap inside backward (Gloo allocates it on its own thread), or one rank moved
/// to the new layout and gathered while the other, its move failed, waited at the agreement.
#[test]
fn ranks_escalating_under_any_cap_finish_or_stop_together() {
    let (replicated, sharded) =
        (rank_peak(&HEAVY), rank_peak(&[&HEAVY[..], &["dist.shard=gradients"]].concat()));
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..8u64 {
        let cap = format!("memory.limit={}", sharded + (replicated - sharded) * i / 7);
        let capped = [&HEAVY[..], &[cap.as_str(), "oom.escalate=[shard_parameters]"]].concat();
        let d = tempfile::tempdir().unwrap();
        let port = free_port();
        let outs = wait_all((0..2).map(|r| spawn_rank(r, 2, port, d.path(), &capped)).collect());
        let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).to_string();
        let code = outs[0].status.code();
        assert_eq!(outs[1].status.code(), code, "{cap}: the ranks stop together:\n{}\n{}", err(0), err(1));
        for r in 0..2 {
            assert!(!err(r).contains("collective `"), "{cap}, rank {r}: no collective fails: {}", err(r));
        }
        match code {
            Some(0) => assert_eq!(read_jsonl(&d.path().join("metrics.jsonl")).len(), 4, "{cap}"),
            Some(3) => assert!(err(0).contains("out of memory") && err(1).contains("out of memory"), "{cap}"),
            // The move freed the state it gave up before making the new one: one rank names
            // that, the other its peer's failure.
            Some(1) => {
                let (a, b) = (err(0), err(1));
                let moved = |e: &str| e.contains("could not move the optimizer state");
                let peer = |e: &str| e.contains("other rank(s) failed");
                assert!(
                    (moved(&a) || moved(&b)) && (moved(&a) || peer(&a)) && (moved(&b) || peer(&b)),
                    "{cap}:\n{a}\n{b}"
                );
            }
            other => panic!("{cap}: exit {other:?}:\n{}\n{}", err(0), err(1)),
        }
        *seen.entry(code).or_insert(0) += 1;
    }
    assert!(seen.get(&Some(0)).is_some_and(|&n| n >= 3), "most caps above the sharded peak train: {seen:?}");
}

/// `parameters` with the loss in chunks and the kept block inputs offloaded, on 2 and 3 ranks,
/// equals one process with the same savers within 1e-5. In bf16-mixed the fp32 sums' other order
/// moves a weight's last bit after the first step and bf16 carries it (AdamW turns a gradient
/// near zero into an update of the learning rate's size): replicated ranks part from one process
/// too, so `parameters` is held to them: loss and gradient norm within 1e-3 of one process, the
/// weights no further from it than twice the replicated ranks'.
#[test]
fn sharded_parameters_with_the_savers_and_bf16_equal_one_process() {
    let savers = [
        &RUN[..],
        &[
            "memory.activation_checkpointing=blocks",
            "memory.offload_activations=true",
            "memory.loss_chunk_tokens=256",
        ],
    ]
    .concat();
    let s = tempfile::tempdir().unwrap();
    train(s.path(), "configs/debug.yaml", &savers).ok();
    for world in [2, 3] {
        let d = tempfile::tempdir().unwrap();
        ranks(world, d.path(), &[&savers[..], &["dist.shard=parameters"]].concat());
        assert_like(d.path(), s.path(), &format!("the savers on {world} ranks"));
    }
    let bf16 = [&savers[..], &["precision=bf16-mixed"]].concat();
    let s = tempfile::tempdir().unwrap();
    train(s.path(), "configs/debug.yaml", &bf16).ok();
    let (r, p) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    ranks(2, r.path(), &[&bf16[..], &["dist.shard=none"]].concat());
    ranks(2, p.path(), &[&bf16[..], &["dist.shard=parameters"]].concat());
    let (replicated, sharded) = (max_weight_diff(r.path(), s.path()), max_weight_diff(p.path(), s.path()));
    assert!(sharded <= 2.0 * replicated.max(1e-6), "bf16: parameters {sharded} vs replicated {replicated}");
    let (a, b) = (read_jsonl(&p.path().join("metrics.jsonl")), read_jsonl(&s.path().join("metrics.jsonl")));
    for (x, y) in a.iter().zip(&b) {
        for key in ["loss", "grad_norm"] {
            let (u, v) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!((u - v).abs() <= 1e-3 * v.abs().max(1.0), "bf16, step {}: {key} {u} vs {v}", x["step"]);
        }
    }
}

/// The other optimizers at `parameters` on 2 ranks: SGD and Muon (whose Newton–Schulz needs each
/// whole matrix, which its owner has) equal one process within 1e-5. 8-bit AdamW's quantisation
/// turns the sums' other order into visible steps, as it does for replicated ranks: its weights
/// stay within three times the replicated ranks' own distance from one process.
#[test]
fn sgd_muon_and_adamw8bit_with_sharded_parameters_train_as_one_process() {
    for name in ["sgd", "muon"] {
        let opt = format!("optimizer.name={name}");
        let sets = [&RUN[..], &[opt.as_str()]].concat();
        let (s, d) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        train(s.path(), "configs/debug.yaml", &sets).ok();
        ranks(2, d.path(), &[&sets[..], &["dist.shard=parameters"]].concat());
        assert_like(d.path(), s.path(), &format!("{name} at parameters"));
    }
    let sets = [&RUN[..], &["optimizer.name=adamw8bit"]].concat();
    let (s, r, p) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    train(s.path(), "configs/debug.yaml", &sets).ok();
    ranks(2, r.path(), &[&sets[..], &["dist.shard=none"]].concat());
    ranks(2, p.path(), &[&sets[..], &["dist.shard=parameters"]].concat());
    let (replicated, sharded) = (max_weight_diff(r.path(), s.path()), max_weight_diff(p.path(), s.path()));
    assert!(
        sharded <= 3.0 * replicated.max(1e-6),
        "adamw8bit: parameters {sharded} vs replicated {replicated}"
    );
}

/// `dist.overlap` (the default) starts each block's gather before the block ahead of it
/// computes and reduces a block's gradients while the next block's backward runs. On 2 ranks
/// each sum is one addition, so overlapped and waited collectives give the same bits; 33 samples
/// (17 and 16) at micro-batch 16 leave rank 1 a micro-step with nothing of its own, whose
/// collectives it still runs. On 3 ranks (16, 17, 17) the run equals one process.
#[test]
fn overlapped_gathers_train_bit_for_bit_as_waited_ones() {
    let sets = [
        "dist.shard=parameters",
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.global_batch_size=33",
        "train.micro_batch_size=16",
        "train.eval_interval=0",
        "checkpoint.interval=6",
        "dist.timeout_s=30",
    ];
    let (o, w) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    ranks(2, o.path(), &sets);
    ranks(2, w.path(), &[&sets[..], &["dist.overlap=false"]].concat());
    assert_eq!(max_weight_diff(o.path(), w.path()), 0.0, "overlapped against waited collectives");
    let fifty = [&sets[..], &["train.global_batch_size=50"]].concat();
    let (t, s) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    ranks(3, t.path(), &fifty);
    train(s.path(), "configs/debug.yaml", &fifty[1..]).ok();
    assert_like(t.path(), s.path(), "overlapped collectives on 3 ranks");
}

/// `dist.shard: gradients` under `dist.overlap` (the default): the last micro-step's backward
/// sums each block parameter's gradient into its owner's as soon as it is made, in place, in
/// pieces (`dist.bucket_mb=0.01`: several a tensor). Two ranks (32 + 31 samples at micro-batch
/// 8; rank 1 recomputing its blocks, so its gradients come in another order) train the same
/// bits as with the reduce-scatter after backward, and rank 0 (which alone logs) sent its
/// blocks' gradients (not the embeddings' or the head's) from inside backward.
#[test]
fn gradients_reduced_into_their_owners_during_backward_train_bit_for_bit_as_after_it() {
    overlapped_as_waited(
        &[&RUN[..], &["dist.shard=gradients"]].concat(),
        "gradients reduced into their owners",
    );
}

/// The reduces during backward in both 16-bit precisions, on 2 ranks at `gradients`: bf16-mixed's
/// fp32 gradients are summed in place, and train the same bits as the reduce-scatter after
/// backward; bf16-pure's bf16 gradients are not (bf16 would round at each rank's addition):
/// rank 0 says so, and they go through the fp32 pieces after backward as without overlap.
#[test]
fn sixteen_bit_gradients_reduced_during_backward_or_after_it_as_their_dtype_allows() {
    let short = ["train.max_steps=6", "train.eval_interval=0", "checkpoint.interval=6"];
    for precision in ["bf16-mixed", "bf16-pure"] {
        let p = format!("precision={precision}");
        let sets = [&RUN[..], &short[..], &["dist.shard=gradients", p.as_str()]].concat();
        let (o, w) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let port = free_port();
        let outs = wait_ok((0..2).map(|r| spawn_rank(r, 2, port, o.path(), &sets)).collect());
        let said = String::from_utf8_lossy(&outs[0].stderr).into_owned();
        let in_backward = said.contains("gradients reduced into their owners during backward");
        let after = said.contains("bf16-pure gradients are reduce-scattered after backward");
        assert_eq!((in_backward, after), (precision == "bf16-mixed", precision == "bf16-pure"), "{said}");
        ranks(2, w.path(), &[&sets[..], &["dist.overlap=false"]].concat());
        assert_eq!(max_weight_diff(o.path(), w.path()), 0.0, "{precision}: during backward against after it");
    }
}
