//! A rank that stops answering (SIGSTOP: its sockets stay open, so nothing resets): the others
//! must give up within `dist.timeout_s` plus a small margin, name the silent rank, and say so in
//! torchelastic's error file. Launched by hand, rank 0 also hosts the group's store: frozen, it
//! takes the store with it, and every request to the store must give up too.
use crate::common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn spawn_rank(
    rank: usize,
    world: usize,
    port: u16,
    dir: &std::path::Path,
    error_file: &std::path::Path,
    extra: &[&str],
) -> Child {
    let mut cmd = Command::new(bin());
    cmd.args(["train", "--config"]).arg(repo().join("configs/debug.yaml"));
    for s in [
        format!("out_dir={}", dir.display()),
        "train.threads=1".into(),
        "train.max_steps=100000".into(),
        "dist.timeout_s=5".into(),
        "checkpoint.interval=0".into(),
        "train.eval_interval=0".into(),
    ]
    .into_iter()
    .chain(extra.iter().map(|s| s.to_string()))
    {
        cmd.arg("--set").arg(s);
    }
    cmd.env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_ERROR_FILE", error_file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Two ranks by hand, one of them to be stopped; both are killed at the end, whatever the test
/// found (SIGKILL ends a stopped process too).
struct Pair {
    ranks: Vec<Child>,
    errs: Vec<std::path::PathBuf>,
    run: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Pair {
    fn start(extra: &[&str]) -> Self {
        let d = tempfile::tempdir().unwrap();
        let (run, port) = (d.path().join("run"), free_port());
        let errs: Vec<_> = (0..2).map(|r| d.path().join(format!("error-{r}.json"))).collect();
        let ranks = (0..2).map(|r| spawn_rank(r, 2, port, &run, &errs[r], extra)).collect();
        Self { ranks, errs, run, _dir: d }
    }

    /// Waits (up to 60 s) until `ready` holds of the run directory.
    fn wait_for(&self, what: &str, ready: impl Fn(&std::path::Path) -> bool) {
        let t0 = Instant::now();
        while !ready(&self.run) {
            assert!(t0.elapsed() < Duration::from_secs(60), "{what} never happened");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOPs `stopped` and waits for the other rank to exit (at most `bound`): its exit code,
    /// seconds waited, stderr and error file.
    fn stop_and_wait(&mut self, stopped: usize, bound: Duration) -> (Option<i32>, f64, String, String) {
        unsafe { libc::kill(self.ranks[stopped].id() as i32, libc::SIGSTOP) };
        let (stopped_at, other) = (Instant::now(), 1 - stopped);
        let status = loop {
            if let Some(s) = self.ranks[other].try_wait().unwrap() {
                break s;
            }
            assert!(
                stopped_at.elapsed() < bound,
                "rank {other} still waiting {} s after rank {stopped} went silent (dist.timeout_s=5)",
                bound.as_secs()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let waited = stopped_at.elapsed().as_secs_f64();
        let mut err = String::new();
        std::io::Read::read_to_string(self.ranks[other].stderr.as_mut().unwrap(), &mut err).unwrap();
        eprintln!(
            "rank {other} exited {:?} {waited:.1}s after rank {stopped} went silent:\n{err}",
            status.code()
        );
        (status.code(), waited, err, std::fs::read_to_string(&self.errs[other]).unwrap_or_default())
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            let _ = r.kill();
            let _ = r.wait();
        }
    }
}

fn steps_logged(n: usize) -> impl Fn(&std::path::Path) -> bool {
    move |run| read_jsonl(&run.join("metrics.jsonl")).len() >= n
}

#[test]
fn a_stopped_rank_makes_the_others_fail_within_the_timeout() {
    let mut pair = Pair::start(&[]);
    pair.wait_for("the group's start", steps_logged(3));
    let (code, waited, err, text) = pair.stop_and_wait(1, Duration::from_secs(30));
    assert_eq!(code, Some(1));
    assert!(waited < 5.0 + 5.0, "within the 5 s timeout plus a margin: {waited:.1}s");
    assert!(waited > 4.0, "not before the timeout: {waited:.1}s");
    // Both say a collective timed out and, from the heartbeats in the store (Gloo's error does
    // not know), which rank went silent.
    for t in [&err, &text] {
        assert!(
            t.contains("collective") && t.contains("timed out after dist.timeout_s"),
            "says a collective timed out: {t}"
        );
        assert!(
            t.contains("rank 1 stopped answering") && !t.contains("rank 0 stopped"),
            "names the silent rank: {t}"
        );
    }
}

/// Rank 0 frozen: the collective times out as above, and the store it hosts answers nothing
/// (c10d's client waits for an answer without a limit): rank 1 still ends, naming rank 0.
#[test]
fn a_stopped_rank_0_hosting_the_store_makes_the_others_fail_within_the_timeout() {
    let mut pair = Pair::start(&[]);
    pair.wait_for("the group's start", steps_logged(3));
    let (code, waited, err, text) = pair.stop_and_wait(0, Duration::from_secs(30));
    assert_eq!(code, Some(1));
    assert!(waited < 5.0 + 6.0, "within the 5 s timeout plus a margin: {waited:.1}s");
    for t in [&err, &text] {
        assert!(
            t.contains("collective") && t.contains("timed out after dist.timeout_s"),
            "says a collective timed out: {t}"
        );
        assert!(t.contains("rank 0 stopped answering"), "names the silent rank: {t}");
    }
}

/// Rank 0 frozen inside a checkpoint write, its peer waiting at the fence behind it (where the
/// store is all it reads): the peer ends within the timeout, naming rank 0. (A synchronous
/// write: in the background the peer waits at the fence for the copy only.)
#[test]
fn a_rank_0_stopped_while_it_writes_alone_is_named_by_the_rank_waiting_for_it() {
    let mut pair = Pair::start(&[
        "checkpoint.interval=3",
        "checkpoint.async=false",
        "faults.pause_in_checkpoint_write_ms=60000",
    ]);
    pair.wait_for("checkpoint 3's write", |run| {
        run.join("checkpoints/.tmp-step-00000003/model.safetensors").is_file()
    });
    let (code, waited, err, text) = pair.stop_and_wait(0, Duration::from_secs(30));
    assert_eq!(code, Some(1));
    assert!(waited < 5.0 + 6.0, "within the 5 s timeout plus a margin: {waited:.1}s");
    for t in [&err, &text] {
        assert!(t.contains("rank 0 stopped answering while it wrote alone"), "names rank 0: {t}");
    }
}
