//! Notifications on the real binary against a webhook this test serves on loopback: one
//! well-formed POST per configured event of a run that finishes, one stopped by SIGTERM, and one
//! out of memory at the floor (exit 3, a real CPU cap as in oom.rs); and the URL, a secret,
//! nowhere in full in what the run writes or prints.
use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The URL's secret part: it must appear in no file or output of the run.
pub(crate) const TOKEN: &str = "T0KEN-s3cr3t-9f2c";

/// A webhook on 127.0.0.1: records each POST (path, content type, JSON body), answers 200.
pub(crate) struct Hook {
    pub(crate) port: u16,
    received: Arc<Mutex<Vec<(String, String, Value)>>>,
}

impl Hook {
    pub(crate) fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request_line = String::new();
                reader.read_line(&mut request_line).unwrap();
                let (mut length, mut content_type) = (0usize, String::new());
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    let line = line.trim_end();
                    if line.is_empty() {
                        break;
                    }
                    let (name, value) = line.split_once(':').unwrap();
                    match name.to_ascii_lowercase().as_str() {
                        "content-length" => length = value.trim().parse().unwrap(),
                        "content-type" => content_type = value.trim().to_string(),
                        _ => {}
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let path = request_line.split_whitespace().nth(1).unwrap_or_default().to_string();
                assert!(request_line.starts_with("POST "), "{request_line}");
                let json = serde_json::from_slice(&body).expect("the body is JSON");
                log.lock().unwrap().push((path, content_type, json));
                let _ =
                    stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
            }
        });
        Self { port, received }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook/{TOKEN}", self.port)
    }

    /// The bodies received, each checked for the shape Slack, Discord and ntfy read.
    pub(crate) fn bodies(&self) -> Vec<Value> {
        let received = self.received.lock().unwrap().clone();
        received
            .into_iter()
            .map(|(path, content_type, body)| {
                assert_eq!(path, format!("/hook/{TOKEN}"));
                assert_eq!(content_type, "application/json");
                let text = body["text"].as_str().expect("a text field (Slack, ntfy's template)");
                assert!(!text.is_empty());
                assert_eq!(body["content"], body["text"], "Discord's content");
                assert!(body["title"].as_str().is_some_and(|t| t.starts_with("trainguard ")), "{body}");
                body
            })
            .collect()
    }

    pub(crate) fn names(&self) -> Vec<String> {
        self.bodies().iter().map(|b| b["event"].as_str().unwrap().to_string()).collect()
    }
}

/// No file under `dir` (binary ones included) and none of `outputs` holds the URL's secret.
fn assert_secret_kept(dir: &Path, outputs: &[&str]) {
    for out in outputs {
        assert!(!out.contains(TOKEN), "the URL in full in the output:\n{out}");
    }
    let mut files = vec![dir.to_path_buf()];
    let mut seen = 0;
    while let Some(p) = files.pop() {
        if p.is_dir() {
            files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else {
            seen += 1;
            let bytes = std::fs::read(&p).unwrap();
            assert!(
                !bytes.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes()),
                "{} holds the URL",
                p.display()
            );
        }
    }
    assert!(seen >= 4, "the run wrote its files");
}

#[test]
fn a_finished_run_sends_one_notification_per_configured_event_and_keeps_the_url_secret() {
    let hook = Hook::start();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("notify.webhook={}", hook.url());
    let run = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=6",
            "train.warmup_steps=0",
            "checkpoint.interval=2",
            "metrics.tensorboard=true",
            &url,
            "notify.on=[run_started, checkpoint_saved, finished, stopped, crashed]",
        ],
    )
    .ok();
    let saved = run.events_of("checkpoint_saved").len();
    assert!(saved >= 3, "{saved}");
    let mut expected = vec!["run_started".to_string()];
    expected.extend(std::iter::repeat_n("checkpoint_saved".to_string(), saved));
    expected.push("finished".into());
    assert_eq!(hook.names(), expected, "one per event, in order, nothing else");
    let finished = hook.bodies().pop().unwrap();
    assert_eq!(finished["step"], 6);
    assert_eq!(finished["run"], dir.path().display().to_string());
    assert_eq!(finished["details"]["event"], "run_finished");
    assert!(finished["text"].as_str().unwrap().contains("finished 6 steps"), "{finished}");
    // Where it sends is logged (before train.log opens: on stderr), scheme and host only.
    let said = format!("notify: POST to http://127.0.0.1:{}/… on run_started, checkpoint_saved", hook.port);
    assert!(run.stderr().contains(&said), "{}", run.stderr());
    let shown = Command::new(bin())
        .args(["config", "show", "--config"])
        .arg(repo().join("configs/debug.yaml"))
        .args(["--set", &url])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(shown.contains(&format!("127.0.0.1:{}/…", hook.port)), "{shown}");
    assert_secret_kept(dir.path(), &[&run.stderr(), &run.stdout(), &shown]);
}

#[test]
fn a_run_stopped_by_sigterm_sends_one_stopped_notification() {
    let hook = Hook::start();
    let dir = tempfile::tempdir().unwrap();
    // The URL from the environment's default variable; notify.on's default names the rest.
    let mut cmd =
        command(dir.path(), "configs/debug.yaml", &["train.max_steps=100000", "checkpoint.interval=0"]);
    cmd.env("TRAINGUARD_NOTIFY_WEBHOOK", hook.url());
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let t0 = Instant::now();
    while read_jsonl(&metrics).len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(60), "run did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(4));
    let bodies = hook.bodies();
    assert_eq!(hook.names(), ["stopped"], "{bodies:?}");
    let done = read_jsonl(&metrics).len() as u64;
    assert_eq!(bodies[0]["step"], done);
    assert_eq!(bodies[0]["details"]["reason"], "signal");
    assert!(bodies[0]["text"].as_str().unwrap().contains("--resume auto continues"), "{}", bodies[0]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_secret_kept(dir.path(), &[&stderr, &String::from_utf8_lossy(&out.stdout)]);
}

/// oom.rs's cap too small for micro-batch 1: out of memory at the floor, exit 3, told once.
#[test]
fn a_run_out_of_memory_at_the_floor_sends_one_crashed_notification_with_exit_3() {
    let hook = Hook::start();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("notify.webhook={}", hook.url());
    let run = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.warmup_steps=0",
            "train.max_steps=3",
            "model.seq_len=512",
            "model.vocab_size=4096",
            "model.n_embd=32",
            "model.n_layer=1",
            "memory.limit=12MiB",
            &url,
            "notify.on=[finished, stopped, crashed, escalated]",
        ],
    );
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert_eq!(hook.names(), ["crashed"]);
    let body = &hook.bodies()[0];
    assert_eq!(body["exit_code"], 3);
    let text = body["text"].as_str().unwrap();
    assert!(text.contains("crashed, exit 3 (OutOfMemoryError)") && text.contains("out of memory"), "{text}");
    assert_secret_kept(dir.path(), &[&run.stderr(), &run.stdout()]);
}

/// A hook that refuses every connection: the run finishes as without one, one warning says so
/// (the URL shown as scheme and host), and the end waits at most notify.timeout_s for it.
#[test]
fn a_dead_webhook_is_one_warning_and_the_run_finishes() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("notify.webhook=http://127.0.0.1:{port}/hook/{TOKEN}");
    let run = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=6",
            "train.warmup_steps=0",
            "checkpoint.interval=1",
            &url,
            "notify.on=[checkpoint_saved, finished]",
            "notify.retries=0",
            "notify.timeout_s=2",
        ],
    )
    .ok();
    let stderr = run.stderr();
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("notify: cannot send")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains(&format!("http://127.0.0.1:{port}/…")), "{stderr}");
    assert_secret_kept(dir.path(), &[&stderr, &run.stdout()]);
}

#[test]
fn a_named_variable_that_is_not_set_is_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["notify.webhook_env=TG_TEST_NO_SUCH_HOOK"]);
    cmd.env_remove("TG_TEST_NO_SUCH_HOOK");
    let run = run(cmd, dir.path());
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(
        run.error_line().contains("notify.webhook_env: names TG_TEST_NO_SUCH_HOOK, which is not set"),
        "{}",
        run.stderr()
    );
    let bad = train(dir.path(), "configs/debug.yaml", &["notify.on=[finish]"]);
    assert_eq!(bad.code(), 2);
    assert!(
        bad.stderr().contains("notify.on: expected a list of finished, stopped, crashed"),
        "{}",
        bad.stderr()
    );
}
