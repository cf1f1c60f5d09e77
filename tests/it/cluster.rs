//! Overnight on a cluster, as README and scripts/ say: a fresh run refuses another run's
//! checkpoints, a planned stop under the real torchrun ends the job (no elastic restart, no fresh
//! time budget) with a stop record the job scripts read, and resuming past max_steps says so.
use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;
use trainguard::checkpoint::store;
use trainguard::job::stop_record::{self, Status};

const SHORT: [&str; 4] =
    ["train.warmup_steps=2", "train.eval_interval=0", "checkpoint.interval=5", "train.global_batch_size=16"];

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SHORT.iter().copied().chain(extra.iter().copied()).collect()
}

fn steps(out: &Path) -> Vec<u64> {
    store::list(&store::root(out)).into_iter().map(|(s, _)| s).collect()
}

#[test]
fn a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("run");
    train(&out, "configs/debug.yaml", &sets(&["train.max_steps=20"])).ok();
    assert_eq!(steps(&out), [10, 15, 20], "keep_last 3");
    assert_eq!(stop_record::read(&out).map(|r| (r.status, r.step)), Some((Status::Finished, 20)));

    // The same command again (README's first command run twice): the finished run is reported,
    // nothing is trained or touched, exit 0.
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let same = train(&out, "configs/debug.yaml", &sets(&["train.max_steps=20"])).ok();
    assert!(
        same.stderr().contains("holds this config's run, finished at step 20: nothing to train"),
        "{}",
        same.stderr()
    );
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics, "nothing trained");
    assert_eq!(steps(&out), [10, 15, 20]);

    // The issue's case: the default `--resume none`, fewer steps, same directory.
    let again = train(&out, "configs/debug.yaml", &sets(&["train.max_steps=10"]));
    assert_eq!(again.code(), 2, "{}", again.stderr());
    let err = again.stderr();
    for needle in [out.display().to_string().as_str(), "step 20", "--resume auto", "out_dir", "--overwrite"] {
        assert!(err.contains(needle), "`{needle}` missing: {err}");
    }
    assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "one error line: {err}");
    assert_eq!(steps(&out), [10, 15, 20], "nothing touched");

    // `--overwrite`: the old run is moved aside whole, the new one starts clean.
    let mut cmd = command(&out, "configs/debug.yaml", &sets(&["train.max_steps=10"]));
    cmd.arg("--overwrite");
    let fresh = run(cmd, &out).ok();
    assert_eq!(steps(&out), [5, 10]);
    assert_eq!(fresh.metrics().len(), 10);
    let aside: Vec<PathBuf> = std::fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains("run.old-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(steps(&aside[0]), [10, 15, 20], "the old run kept whole");
    assert_eq!(read_jsonl(&aside[0].join("metrics.jsonl")).len(), 20);

    // `--overwrite` with `--resume` is a contradiction: refused by the command line.
    let mut cmd = command(&out, "configs/debug.yaml", &sets(&["train.max_steps=10"]));
    cmd.args(["--overwrite", "--resume", "auto"]);
    assert_eq!(run(cmd, &out).code(), 2);
}

/// `--overwrite` by the path as typed: a trailing slash (tab completion) still moves the run
/// beside itself, not into itself; `.` (the current directory) is refused by name, exit 2.
#[test]
fn overwrite_moves_a_run_named_with_a_trailing_slash_and_refuses_the_current_directory() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("run");
    train(&out, "configs/debug.yaml", &sets(&["train.max_steps=10"])).ok();
    let slashed = PathBuf::from(format!("{}/", out.display()));
    let mut cmd = command(&slashed, "configs/debug.yaml", &sets(&["train.max_steps=5"]));
    cmd.arg("--overwrite");
    let r = run(cmd, &out).ok();
    assert_eq!(steps(&out), [5], "{}", r.stderr());
    let aside: Vec<PathBuf> = std::fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains("run.old-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(steps(&aside[0]), [5, 10], "the old run beside the new one");

    let mut cmd = command(Path::new("."), "configs/debug.yaml", &sets(&["train.max_steps=5"]));
    cmd.arg("--overwrite").current_dir(&out);
    let r = run(cmd, &out);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("holds the current directory"), "{}", r.stderr());
    assert_eq!(steps(&out), [5], "left as it was");
}

/// `--overwrite` moves aside whatever an old run left, not only checkpoints: a benchmark's run
/// (`checkpoint.at_end: false`, no interval) keeps its metrics beside the new run's.
#[test]
fn overwrite_moves_aside_a_run_without_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("run");
    let quiet = ["checkpoint.interval=0", "checkpoint.at_end=false"];
    train(&out, "configs/debug.yaml", &sets(&[&["train.max_steps=15"][..], &quiet[..]].concat())).ok();
    assert!(steps(&out).is_empty());
    let mut cmd =
        command(&out, "configs/debug.yaml", &sets(&[&["train.max_steps=5"][..], &quiet[..]].concat()));
    cmd.arg("--overwrite");
    let r = run(cmd, &out).ok();
    assert_eq!(r.metrics().len(), 5);
    let aside: Vec<PathBuf> = std::fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains("run.old-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(read_jsonl(&aside[0].join("metrics.jsonl")).len(), 15, "the old run's metrics kept");
}

/// A directory where the run writes a file is named, not the run directory alone.
#[test]
fn a_directory_in_place_of_a_file_the_run_writes_is_named() {
    for file in ["config.yaml", "train.log", "metrics.jsonl", "events.jsonl"] {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join(file)).unwrap();
        let r = train(d.path(), "configs/debug.yaml", &sets(&["train.max_steps=3"]));
        assert_eq!(r.code(), 1, "{}", r.stderr());
        let named =
            format!("cannot write {} in the run directory: Is a directory", d.path().join(file).display());
        assert!(r.stderr().contains(&named), "`{named}` missing from:\n{}", r.stderr());
    }
}

/// A config written by hand in the run directory and named by --config is kept beside the
/// resolved one; the config.yaml a run wrote is replaced on a resume with changes, not kept.
#[test]
fn a_hand_written_config_in_the_run_directory_is_kept_and_a_runs_own_is_replaced() {
    let d = tempfile::tempdir().unwrap();
    let mine = d.path().join("config.yaml");
    let text = "# run 3 of the sweep: lower lr\nmodel:\n  n_layer: 2\n  n_head: 2\n  n_embd: 32\ntrain:\n  max_steps: 5\n  warmup_steps: 1\n";
    std::fs::write(&mine, text).unwrap();
    run(command(d.path(), mine.to_str().unwrap(), &["checkpoint.interval=5"]), d.path()).ok();
    let kept = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().contains("config.kept-"))
            .collect()
    };
    let found = kept(d.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(std::fs::read_to_string(&found[0]).unwrap(), text);
    assert!(
        std::fs::read_to_string(&mine).unwrap().contains("n_layer: 2"),
        "the resolved config in its place"
    );
    let mut cmd = command(d.path(), mine.to_str().unwrap(), &["train.max_steps=8"]);
    cmd.args(["--resume", "auto"]);
    run(cmd, d.path()).ok();
    assert_eq!(
        kept(d.path()).len(),
        1,
        "the run's own config.yaml, changed by --set, was replaced, not kept"
    );
    assert!(std::fs::read_to_string(&mine).unwrap().contains("max_steps: 8"));
}

#[test]
fn resuming_at_or_past_max_steps_says_so_without_nan() {
    let d = tempfile::tempdir().unwrap();
    train(d.path(), "configs/debug.yaml", &sets(&["train.max_steps=20"])).ok();
    let mut cmd = command(d.path(), "configs/debug.yaml", &sets(&["train.max_steps=10"]));
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, d.path()).ok();
    let err = r.stderr();
    assert!(err.contains("nothing to train: resumed at step 20, and train.max_steps is 10"), "{err}");
    assert!(!err.contains("NaN"), "{err}");
    assert_eq!(r.metrics().len(), 20, "no metrics lines invented");
}

fn torchrun(out: &Path, nproc: usize, restarts: usize, extra_args: &[&str], sets: &[&str]) -> (Output, f64) {
    let mut cmd = torchrun_command(out, nproc, restarts, extra_args, sets);
    let t0 = Instant::now();
    let o = cmd.output().unwrap();
    (o, t0.elapsed().as_secs_f64())
}

fn torchrun_command(
    out: &Path,
    nproc: usize,
    restarts: usize,
    extra_args: &[&str],
    sets: &[&str],
) -> Command {
    let port = free_port();
    let mut cmd = Command::new(crate::common::torchrun());
    cmd.args([
        format!("--nproc_per_node={nproc}"),
        format!("--max-restarts={restarts}"),
        "--master_addr=127.0.0.1".into(),
        format!("--master_port={port}"),
        "--no-python".into(),
        bin(),
    ]);
    cmd.args(["train", "--config"]).arg(repo().join("configs/debug.yaml"));
    for s in [format!("out_dir={}", out.display()), "train.threads=1".into(), "dist.timeout_s=30".into()]
        .into_iter()
        .chain(sets.iter().map(|s| s.to_string()))
    {
        cmd.arg("--set").arg(s);
    }
    cmd.args(extra_args);
    cmd
}

/// Two torchrun agents on one machine, one worker each: a job on two nodes (c10d rendezvous),
/// `--max-restarts=<restarts>`, run id `id` (torchrun's default, `none`, without one), `env`
/// added to the agents'. Each worker first says `worker RANK=<rank> RESTART=<its restart
/// count>` on stderr. Returns both agents' outputs and their stderr together.
fn two_agents(
    out: &Path,
    id: Option<&str>,
    restarts: usize,
    env: &[(&str, &str)],
    sets: &[&str],
) -> ([Output; 2], String) {
    let port = free_port();
    let agent = || {
        let mut cmd = Command::new(crate::common::torchrun());
        cmd.envs(env.iter().copied());
        cmd.args([
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            &format!("--rdzv_endpoint=127.0.0.1:{port}"),
            &format!("--max-restarts={restarts}"),
        ]);
        cmd.args(id.map(|id| format!("--rdzv_id={id}")));
        cmd.args([
            "--no-python",
            "bash",
            "-c",
            r#"echo "worker RANK=$RANK RESTART=$TORCHELASTIC_RESTART_COUNT" >&2; exec "$@""#,
            "worker",
            &bin(),
            "train",
            "--config",
        ]);
        cmd.arg(repo().join("configs/debug.yaml"));
        for s in [format!("out_dir={}", out.display()), "train.threads=1".into()]
            .into_iter()
            .chain(sets.iter().map(|s| s.to_string()))
        {
            cmd.arg("--set").arg(s);
        }
        cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let outs = [agent(), agent()].map(|a| a.wait_with_output().unwrap());
    let err = outs.iter().map(|o| String::from_utf8_lossy(&o.stderr).to_string()).collect();
    (outs, err)
}

/// Under the default run id, rank 0 alone warns that a restart may look like a new launch;
/// named, no word.
#[test]
fn a_job_on_two_nodes_under_the_default_run_id_is_warned_of() {
    let run = |id: Option<&str>| {
        let d = tempfile::tempdir().unwrap();
        let (outs, err) = two_agents(
            d.path(),
            id,
            0,
            &[],
            &["train.max_steps=2", "train.warmup_steps=1", "dist.timeout_s=30"],
        );
        assert!(outs.iter().all(|o| o.status.success()), "{err}");
        err
    };
    let err = run(None);
    let warned = err
        .lines()
        .filter(|l| {
            l.contains("a torchrun job on 2 nodes under the default run id `none`") && l.contains("--rdzv-id")
        })
        .count();
    assert_eq!(warned, 1, "rank 0 warns, once: {err}");
    let err = run(Some("job-7"));
    assert!(!err.contains("default run id"), "{err}");
}

/// Rank 1 crashing at step 3: torchrun restarts the crashed node's worker with restart count 1
/// and the other node's healthy worker with its count unchanged, 0. The two still meet at once
/// (crates/trainguard/src/distributed/round.rs) and resume at step 3; namespaced by their counts they never met, each
/// join timed out and a further restart was spent.
#[test]
fn ranks_restarted_with_different_counts_on_two_nodes_meet_and_resume() {
    let d = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=8",
        "train.warmup_steps=1",
        "checkpoint.interval=1",
        "dist.timeout_s=20",
        "faults.crash_at_step=3",
        "faults.crash_rank=1",
    ];
    let t0 = Instant::now();
    let (outs, err) = two_agents(d.path(), Some("job-8"), 1, &[], &sets);
    let wall = t0.elapsed().as_secs_f64();
    assert!(outs.iter().all(|o| o.status.success()), "{err}");
    let restarted: Vec<&str> = err.lines().filter(|l| l.starts_with("worker RANK=")).skip(2).collect();
    eprintln!("restarted workers: {restarted:?}; {wall:.1} s");
    assert!(!err.contains("cannot join the process group"), "{err}");
    assert_eq!(err.matches("resuming at step 3").count(), 1, "rank 0 resumes, once: {err}");
    assert_eq!(
        read_jsonl(&d.path().join("metrics.jsonl")).last().map(|m| m["step"].clone()),
        Some(8.into()),
        "{err}"
    );
}

/// The same two nodes under a time limit: the healthy node's worker restarts with count 0,
/// like a new launch's, yet it too gets only what is left of the deadline the job's first
/// attempt set. Keyed on its own count (a deadline file, recorded at count 0) it started the
/// full budget again.
#[test]
fn a_worker_restarted_with_count_zero_on_a_healthy_node_keeps_the_jobs_deadline() {
    let d = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=100000",
        "train.warmup_steps=1",
        "checkpoint.interval=10",
        "dist.timeout_s=20",
        "faults.crash_at_step=30",
        "faults.crash_rank=1",
        "train.max_duration=\"20s\"",
    ];
    let t0 = Instant::now();
    let (outs, err) = two_agents(d.path(), Some("job-9"), 1, &[], &sets);
    let wall = t0.elapsed().as_secs_f64();
    assert!(outs.iter().all(|o| o.status.success()), "{err}");
    let restarted: Vec<&str> = err.lines().filter(|l| l.starts_with("worker RANK=")).skip(2).collect();
    assert!(
        restarted.iter().any(|l| l.ends_with("RESTART=0")),
        "a worker restarted with count 0: {restarted:?}"
    );
    // Rank 0 (no `[rank N]` mark), whichever node it is on after the restart, carries it.
    let left: Vec<f64> = err
        .lines()
        .filter(|l| !l.starts_with("[rank"))
        .filter_map(|l| {
            l.split("train.max_duration ")
                .nth(1)
                .and_then(|t| t.split('s').next())
                .and_then(|n| n.parse().ok())
        })
        .collect();
    assert_eq!(left.len(), 1, "rank 0 names the budget left, once: {err}");
    let trained = read_jsonl(&d.path().join("metrics.jsonl"))
        .iter()
        .find(|m| m["step"] == 30)
        .and_then(|m| m["elapsed_s"].as_f64())
        .expect("step 30 of the first attempt");
    assert!(
        left[0] > 0.0 && left[0] < 20.0 - trained,
        "left {}, first attempt trained {trained}s: {err}",
        left[0]
    );
    let rec = stop_record::read(d.path()).expect("stop.json");
    assert_eq!((rec.status, rec.reason.as_deref()), (Status::Stopped, Some("time_limit")), "{err}");
    eprintln!("restarted workers: {restarted:?}; left {:.1} s of 20 s; job wall {wall:.1} s", left[0]);
}

/// With torchrun's store not shared with the workers, no deadline outlives an attempt: a
/// node's restart says that its time limit counts from the restart.
#[test]
fn a_restart_without_the_agents_store_says_its_time_limit_counts_from_the_restart() {
    let d = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=100000",
        "train.warmup_steps=1",
        "checkpoint.interval=10",
        "dist.timeout_s=20",
        "faults.crash_at_step=30",
        "faults.crash_rank=1",
        "train.max_duration=\"12s\"",
    ];
    let (outs, err) =
        two_agents(d.path(), Some("job-10"), 1, &[("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")], &sets);
    assert!(outs.iter().all(|o| o.status.success()), "{err}");
    let warned = err
        .lines()
        .filter(|l| l.contains("without the agent's store") && l.contains("counts from this restart"))
        .count();
    let restarted =
        err.lines().filter(|l| l.starts_with("worker RANK=") && !l.ends_with("RESTART=0")).count();
    assert!(restarted >= 1 && warned == restarted, "once per node that restarted ({restarted}): {err}");
    assert_eq!(stop_record::read(d.path()).and_then(|r| r.reason), Some("time_limit".into()), "{err}");
}

/// The pid of worker `rank` of the run writing to `out` (its environment says RANK=<rank>).
fn worker_pid(rank: usize, out: &Path) -> Option<i32> {
    let want = format!("RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let environ = std::fs::read(e.path().join("environ")).ok()?;
        let ours = String::from_utf8_lossy(&cmdline).contains(&format!("out_dir={}", out.display()))
            && cmdline.starts_with(bin().as_bytes());
        (ours && environ.split(|&b| b == 0).any(|v| v == want.as_bytes())).then_some(pid)
    })
}

/// Two signals to one worker alone, while it is inside a step: it ends at once, saying so in
/// the group's store first; its peer's next collective fails, reads that, and stops as planned
/// from the newest checkpoint, writing the record. torchrun sees both workers exit 0 and does
/// not restart the group the person stopped. Before, the peer failed (exit 1) and torchrun
/// restarted the group, which trained on.
#[test]
fn a_second_signal_to_one_worker_stops_the_group_without_a_restart() {
    let d = tempfile::tempdir().unwrap();
    // Steps of 0.4 s or more (1,024 sequences), so that both signals land inside one.
    let mut cmd = torchrun_command(
        d.path(),
        2,
        1,
        &[],
        &sets(&["train.max_steps=40", "train.global_batch_size=1024", "checkpoint.interval=2"]),
    );
    let mut child =
        cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    // The workers' log, read as it comes: the second signal is sent once rank 1 has taken the
    // first. Two sent blind 5 ms apart could arrive while the first was still pending, and Linux
    // delivers one of two pending SIGTERMs (seen under load: the group stopped at the step's end).
    let (took_first, heard) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.starts_with("[rank 1]") && line.contains("signal received") {
                let _ = took_first.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let t0 = Instant::now();
    while steps(d.path()).is_empty() {
        assert!(t0.elapsed().as_secs() < 120, "no checkpoint within 120 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let rank1 = worker_pid(1, d.path()).expect("rank 1's process");
    // The checkpoint shows at a step boundary, where rank 1 may be about to agree on stopping;
    // a signal there stops the group before the second arrives. 150 ms later it is mid-step
    // (steps take 0.4 s or more), and the second follows as soon as the first is taken.
    std::thread::sleep(std::time::Duration::from_millis(150));
    unsafe { libc::kill(rank1, libc::SIGTERM) };
    heard.recv_timeout(std::time::Duration::from_secs(30)).expect("rank 1 takes the first signal");
    unsafe { libc::kill(rank1, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let err = reader.join().unwrap();
    assert!(status.success(), "{err}");
    assert!(err.contains("ended on a second signal: stopping too"), "the peer's path: {err}");
    let started =
        read_jsonl(&d.path().join("events.jsonl")).iter().filter(|e| e["event"] == "run_started").count();
    assert_eq!(started, 1, "not restarted: {err}");
    let rec = stop_record::read(d.path()).expect("stop.json");
    assert_eq!((rec.status, rec.reason.as_deref(), rec.resumable), (Status::Stopped, Some("signal"), true));
    let newest = *steps(d.path()).last().unwrap();
    assert_eq!(
        (rec.step, rec.checkpoint),
        (newest, Some(store::root(d.path()).join(store::dir_name(newest)).display().to_string()))
    );
}

#[test]
fn a_time_limit_under_torchrun_ends_the_job_once_with_a_stop_record() {
    let d = tempfile::tempdir().unwrap();
    // The limit counts start-up (rendezvous, the corpus, the model): 6 s leaves steps to run.
    let (o, wall) = torchrun(d.path(), 2, 1, &["--max-duration", "6s"], &sets(&["train.max_steps=100000"]));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "torchrun exits 0 on a planned stop (no restart): {err}");
    let events = read_jsonl(&d.path().join("events.jsonl"));
    let started = events.iter().filter(|e| e["event"] == "run_started").count();
    assert_eq!(started, 1, "one attempt: torchrun did not restart it: {err}");
    let rec = stop_record::read(d.path()).expect("stop.json");
    assert_eq!(
        (rec.status, rec.reason.as_deref(), rec.resumable),
        (Status::Stopped, Some("time_limit"), true)
    );
    assert_eq!(
        Some(rec.checkpoint.clone().unwrap()),
        steps(d.path()).last().map(|s| store::root(d.path()).join(store::dir_name(*s)).display().to_string())
    );
    assert!(rec.step > 0 && rec.step == *steps(d.path()).last().unwrap());
    eprintln!("torchrun wall {wall:.1}s for a 6 s budget");
}

#[test]
fn a_torchrun_restart_gets_only_what_is_left_of_the_time_budget() {
    let d = tempfile::tempdir().unwrap();
    // Rank 1 dies at step 60 of the first attempt; torchrun restarts the group, which resumes.
    let (o, wall) = torchrun(
        d.path(),
        2,
        1,
        &["--max-duration", "20s"],
        &sets(&["train.max_steps=100000", "faults.crash_at_step=60", "faults.crash_rank=1"]),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let left: f64 = err
        .lines()
        .find_map(|l| {
            l.split("train.max_duration ")
                .nth(1)
                .and_then(|t| t.split('s').next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("the restart names its remaining budget: {err}"));
    // The deadline was set before the first attempt trained, so what is left is at most the
    // budget less the time the first attempt had trained when it checkpointed step 60.
    let metrics = read_jsonl(&d.path().join("metrics.jsonl"));
    let trained = metrics
        .iter()
        .find(|m| m["step"] == 60)
        .and_then(|m| m["elapsed_s"].as_f64())
        .expect("step 60 of the first attempt");
    assert!(left > 0.0 && left < 20.0 - trained, "left {left}, first attempt trained {trained}s");
    eprintln!("restart left with {left:.1}s of 20 s; job wall {wall:.1}s");
    let rec = stop_record::read(d.path()).expect("stop.json");
    assert_eq!((rec.status, rec.reason.as_deref()), (Status::Stopped, Some("time_limit")));
    let resumed =
        read_jsonl(&d.path().join("events.jsonl")).into_iter().filter(|e| e["event"] == "resumed").count();
    assert_eq!(resumed, 1);
}

/// A restart of the job that started the run resumes it whatever `--resume` the command gave:
/// with `none` the restart was refused (the run's own checkpoints "another run's") and the job
/// ended with exit 2; with a path it went back to that older checkpoint, setting aside what the
/// job had trained since.
#[test]
fn a_torchrun_restart_resumes_its_own_run_whatever_resume_was_asked() {
    let crash =
        ["train.max_steps=40", "checkpoint.interval=10", "faults.crash_at_step=25", "faults.crash_rank=1"];
    let resumed_at = |dir: &Path| -> Vec<u64> {
        read_jsonl(&dir.join("events.jsonl"))
            .iter()
            .filter(|e| e["event"] == "resumed")
            .map(|e| e["step"].as_u64().unwrap())
            .collect()
    };
    let d = tempfile::tempdir().unwrap();
    let (o, _) = torchrun(d.path(), 2, 1, &["--resume", "none"], &sets(&crash));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr)
        .contains("a restart resumes it (--resume none was for the job's first attempt)"));
    assert_eq!(resumed_at(d.path()), [20]);
    assert_eq!(read_jsonl(&d.path().join("metrics.jsonl")).last().unwrap()["step"], 40);
    // Begun from another run's checkpoint: the restart continues this run from its own.
    let old = tempfile::tempdir().unwrap();
    train(old.path(), "configs/debug.yaml", &sets(&["train.max_steps=10"])).ok();
    let from = old.path().join("checkpoints/step-00000010");
    let b = d.path().join("b");
    let (o, _) = torchrun(&b, 2, 1, &["--resume", from.to_str().unwrap()], &sets(&crash));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        resumed_at(&b),
        [10, 20],
        "the first attempt from the old run's step 10, the restart from its own step 20"
    );
    assert!(
        !b.join("checkpoints")
            .read_dir()
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("set-aside")),
        "nothing of this job's set aside"
    );
    // Dead before a checkpoint of its own, in a directory holding an older run's step 5: the
    // restart loads the path again, not that run's checkpoint.
    let c = d.path().join("c");
    train(&c, "configs/debug.yaml", &sets(&["train.max_steps=5"])).ok();
    let (o, _) = torchrun(
        &c,
        2,
        1,
        &["--resume", from.to_str().unwrap()],
        &sets(&[
            "train.max_steps=40",
            "checkpoint.interval=10",
            "faults.crash_at_step=12",
            "faults.crash_rank=1",
        ]),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(resumed_at(&c), [10, 10], "{}", String::from_utf8_lossy(&o.stderr));
}

/// `scripts/launch/torchrun.sh 2 CONFIG --set out_dir=OUT --set …` (torchrun with 3 restarts), run in
/// `cwd`: the config and out_dir may be relative to it.
fn torchrun_script(cwd: &Path, config: &str, out: &Path, sets: &[&str]) -> Output {
    let mut cmd = Command::new("bash");
    cmd.current_dir(cwd).arg(repo().join("scripts/launch/torchrun.sh")).args(["2", config]);
    for s in [format!("out_dir={}", out.display()), "train.threads=1".into(), "dist.timeout_s=30".into()]
        .into_iter()
        .chain(sets.iter().map(|s| s.to_string()))
    {
        cmd.arg("--set").arg(s);
    }
    cmd.env("TORCHRUN", crate::common::torchrun()).env("TRAINGUARD", bin()).output().unwrap()
}

/// What a torchrun restart would meet again ends the job with its own code. A fresh start
/// refused in another run's out_dir stays refused and leaves that run as it was (the first
/// restart had resumed it, with the new settings, and the script said finished); non-finite
/// losses end the job at the first attempt's (each restart had skipped more steps from the last
/// checkpoint, and the script said crashed, exit 1). A crash (exit 1) still restarts and
/// resumes: `a_torchrun_restart_gets_only_what_is_left_of_the_time_budget`.
#[test]
fn failures_a_restart_would_meet_again_end_a_torchrun_job_with_their_code() {
    let d = tempfile::tempdir().unwrap();
    train(d.path(), "configs/debug.yaml", &sets(&["train.max_steps=10"])).ok();
    let files = |dir: &Path| {
        ["metrics.jsonl", "events.jsonl", "config.yaml", "stop.json", "model.safetensors"]
            .map(|f| std::fs::read(dir.join(f)).ok())
    };
    let before = files(d.path());
    let debug = repo().join("configs/debug.yaml");
    let o = torchrun_script(
        &repo(),
        &debug.display().to_string(),
        d.path(),
        &sets(&["train.max_steps=20", "train.lr=1e-3"]),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("not started again") && err.contains("failed with exit 2"), "{err}");
    assert!(before == files(d.path()), "the other run's files changed: {err}");
    assert!(!d.path().join(trainguard::job::attempts::JOB_FILE).exists(), "refused: not this job's run");
    // With no failure record (its file cannot be written), the restart is refused as the first
    // attempt was: it resumes only a run its own job started.
    let mut cmd = torchrun_command(d.path(), 2, 1, &[], &sets(&["train.max_steps=20"]));
    let o = cmd
        .env(trainguard::job::attempts::FAILURE_FILE_ENV, d.path().join("no/such/dir/f.json"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("cannot record the failure"), "{err}");
    let refused = err
        .lines()
        .filter(|l| {
            l.starts_with("error: refused before training:")
                && l.contains("already holds 2 checkpoint(s) of another run")
        })
        .count();
    assert!(refused == 2 && !err.contains("resuming at step"), "both attempts refused: {err}");
    assert!(before == files(d.path()), "the other run's files changed: {err}");

    // Run from the caller's directory, with its config and out_dir relative to it.
    let e = tempfile::tempdir().unwrap();
    std::fs::copy(&debug, e.path().join("mine.yaml")).unwrap();
    let nan = [
        "train.max_steps=12",
        "checkpoint.interval=1",
        "faults.nonfinite_loss_at_steps=[3,4,5,6,7,8,9,10,11,12]",
        "nan.max_consecutive=2",
    ];
    let o = torchrun_script(e.path(), "mine.yaml", Path::new("run"), &sets(&nan));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "{err}");
    let events = read_jsonl(&e.path().join("run/events.jsonl"));
    let count = |kind: &str| events.iter().filter(|v| v["event"] == kind).count();
    assert_eq!(
        (count("run_started"), count("resumed"), count("nonfinite_skipped")),
        (1, 0, 2),
        "one attempt trained: {err}"
    );
}

#[test]
fn a_crash_under_torchrun_leaves_no_stop_record_and_a_finish_says_finished() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path()).unwrap();
    // A stale record from an earlier job must not survive into this one.
    stop_record::write(d.path(), &stop_record::StopRecord::stopped(3, "signal", None)).unwrap();
    let (o, _) = torchrun(
        d.path(),
        2,
        0,
        &[],
        &sets(&["train.max_steps=100000", "faults.crash_at_step=3", "faults.crash_rank=1"]),
    );
    assert!(!o.status.success());
    assert_eq!(stop_record::read(d.path()), None, "a crash leaves no record");

    let e = tempfile::tempdir().unwrap();
    let (o, _) = torchrun(e.path(), 2, 0, &[], &sets(&["train.max_steps=6"]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        stop_record::read(e.path()).map(|r| (r.status, r.step, r.resumable)),
        Some((Status::Finished, 6, false))
    );
}
