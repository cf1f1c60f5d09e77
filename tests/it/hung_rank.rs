//! A rank that stops answering (SIGSTOP: its sockets stay open, so nothing resets): the others
//! must give up within `dist.timeout_s` plus a small margin, name the silent rank, and say so in
//! torchelastic's error file.
use crate::common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn spawn_rank(
    rank: usize,
    world: usize,
    port: u16,
    dir: &std::path::Path,
    error_file: &std::path::Path,
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
    ] {
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

#[test]
fn a_stopped_rank_makes_the_others_fail_within_the_timeout() {
    let d = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let errs: Vec<_> = (0..2).map(|r| d.path().join(format!("error-{r}.json"))).collect();
    let mut r0 = spawn_rank(0, 2, port, &d.path().join("run"), &errs[0]);
    let mut r1 = spawn_rank(1, 2, port, &d.path().join("run"), &errs[1]);
    let metrics = d.path().join("run/metrics.jsonl");
    let t0 = Instant::now();
    while read_jsonl(&metrics).len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the group never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(r1.id() as i32, libc::SIGSTOP) };
    let stopped_at = Instant::now();
    let status = loop {
        if let Some(s) = r0.try_wait().unwrap() {
            break s;
        }
        if stopped_at.elapsed() > Duration::from_secs(30) {
            r0.kill().unwrap();
            r1.kill().unwrap();
            panic!("rank 0 still waiting 30 s after its peer went silent (dist.timeout_s=5)");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let waited = stopped_at.elapsed().as_secs_f64();
    r1.kill().unwrap();
    let _ = r1.wait();
    let mut err = String::new();
    std::io::Read::read_to_string(r0.stderr.as_mut().unwrap(), &mut err).unwrap();
    eprintln!("rank 0 exited {:?} {waited:.1}s after rank 1 went silent:\n{err}", status.code());
    assert!(!status.success());
    assert!(waited < 5.0 + 5.0, "within the 5 s timeout plus a margin: {waited:.1}s");
    assert!(waited > 4.0, "not before the timeout: {waited:.1}s");
    let text = std::fs::read_to_string(&errs[0]).expect("rank 0 wrote the error file");
    // Both say a collective timed out and, from the heartbeats in the store (Gloo's error does
    // not know), which rank went silent.
    for t in [&err, &text] {
        assert!(t.contains("collective") && t.contains("Timed out"), "says a collective timed out: {t}");
        assert!(
            t.contains("rank 1 stopped answering") && !t.contains("rank 0 stopped"),
            "names the silent rank: {t}"
        );
    }
}
