//! Input trainguard did not write, on the real binary: special files (a FIFO, `/dev/zero`) where
//! a file is read, YAML whose aliases expand, `--set` key paths and counts at their limits, and a
//! report of strings far longer than a run writes. Each is refused with its name and a documented
//! exit code, or shown cut short, within seconds: never a hang, an abort or gigabytes read.
use crate::common::*;
use crate::support::tokenizer;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `cmd`'s output, failing the test (and ending it) when it runs past `limit`: what this module
/// refuses used to hang on a FIFO or read `/dev/zero` until memory ran out.
fn within(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Exit 2, the error naming `needles`, and no panic.
fn refused(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for n in needles {
        assert!(err.contains(n), "lacks {n:?}: {err}");
    }
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{err}");
}

fn fifo(path: &Path) -> PathBuf {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
    path.to_path_buf()
}

fn tg(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    cmd
}

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn a_config_that_is_a_special_file_or_too_large_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let pipe = fifo(&dir.path().join("config.yaml"));
    for (path, what) in
        [(pipe.as_path(), "a FIFO (named pipe)"), (Path::new("/dev/zero"), "a character device")]
    {
        let out = within(tg(&["config", "show", "--config", path.to_str().unwrap()]), LIMIT);
        refused(&out, &[&format!("cannot read config file {}: {what}, not a regular file", path.display())]);
    }
    // A comment alone, over 4 MiB: refused before YAML reads it.
    let big = dir.path().join("big.yaml");
    std::fs::write(&big, format!("# {}\n", "x".repeat(4 << 20))).unwrap();
    let out = within(tg(&["config", "show", "--config", big.to_str().unwrap()]), LIMIT);
    refused(&out, &["big.yaml", "more than the 4194304 it may hold"]);
}

#[test]
fn yaml_aliases_that_expand_far_and_set_key_paths_too_deep_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    // 11 KB of text, two million values: 3000 aliases of a list of 700.
    let cfg = dir.path().join("aliases.yaml");
    let list = vec!["0"; 700].join(",");
    let uses = vec!["*a"; 3000].join(",");
    std::fs::write(&cfg, format!("x-a: &a [{list}]\nx-b: [{uses}]\ntrain:\n  lr: 0.001\n")).unwrap();
    let out = within(tg(&["config", "show", "--config", cfg.to_str().unwrap()]), LIMIT);
    refused(&out, &["aliases.yaml", "aliases (`*name`)", "16 times the size of the text"]);
    // An anchor or two, as a config uses them, still reads.
    std::fs::write(&cfg, "x-m: &m {n_layer: 3}\nmodel:\n  <<: *m\n  n_head: 2\n").unwrap();
    let out = within(tg(&["config", "show", "--config", cfg.to_str().unwrap()]), LIMIT);
    assert!(String::from_utf8_lossy(&out.stdout).contains("n_layer: 3"), "{}", stderr(&out));
    // 20,000 levels overflowed the stack (an abort); 65 were taken.
    for levels in [65, 20_000] {
        let set = format!("{}=1", vec!["a"; levels].join("."));
        let out = within(tg(&["config", "show", "--set", &set]), LIMIT);
        refused(&out, &[&format!("the key path has {levels} levels; a config's keys are at most 64 deep")]);
    }
}

#[test]
fn world_size_0_without_rank_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &["train.max_steps=1", "train.warmup_steps=0"]);
    cmd.env_remove("RANK").env("WORLD_SIZE", "0");
    let out = within(cmd, LIMIT);
    refused(&out, &["WORLD_SIZE=0"]);
    assert!(!dir.path().join("metrics.jsonl").exists(), "refused before it trained");
}

#[test]
fn report_refuses_a_run_file_that_is_a_fifo_and_cuts_a_long_string_short() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let metrics: String =
        (1..=3).map(|s| format!("{{\"step\":{s},\"loss\":{},\"elapsed_s\":{s}}}\n", 5 - s)).collect();
    std::fs::write(run.join("metrics.jsonl"), metrics).unwrap();
    let events = fifo(&run.join("events.jsonl"));
    let out = within(tg(&["report", run.to_str().unwrap()]), LIMIT);
    refused(&out, &[&format!("cannot read {}: a FIFO (named pipe), not a regular file", events.display())]);

    // A 5 MB reason, drawn on every panel, made a page of hundreds of MB.
    std::fs::remove_file(&events).unwrap();
    let reason = "x".repeat(5_000_000);
    std::fs::write(
        &events,
        format!("{}\n", serde_json::json!({"event": "stopped", "step": 3, "reason": reason})),
    )
    .unwrap();
    let out = within(tg(&["report", run.to_str().unwrap()]), LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let page = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(page.len() < 1_000_000, "the page is {} bytes", page.len());
    assert!(page.contains("… (5000000 characters in all)"));
}

#[test]
fn prepare_refuses_an_input_that_is_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    tokenizer::write(&dir.path().join("tokenizer.json"), 0);
    let input = fifo(&dir.path().join("corpus.txt"));
    let mut cmd = tg(&["prepare", "--tokenizer"]);
    cmd.arg(dir.path().join("tokenizer.json")).arg("--out").arg(dir.path().join("data")).arg(&input);
    let out = within(cmd, LIMIT);
    refused(&out, &["corpus.txt", "a FIFO (named pipe), not a regular file"]);
}

/// A trained run's export to a dangling link, its weights as a FIFO for `init_from`, and a
/// cooldown past the last step a run counts.
#[test]
fn export_init_from_and_cooldown_refuse_what_they_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    train(
        &run_dir,
        "configs/debug.yaml",
        &["train.max_steps=2", "train.warmup_steps=0", "checkpoint.interval=1"],
    )
    .ok();
    let link = dir.path().join("hf-link");
    std::os::unix::fs::symlink(dir.path().join("gone/away"), &link).unwrap();
    let out = within(tg(&["export", run_dir.to_str().unwrap(), "--hf", link.to_str().unwrap()]), LIMIT);
    refused(&out, &[&format!("{}: is a symbolic link to nothing", link.display())]);

    let hf = dir.path().join("hf");
    let out = within(tg(&["export", run_dir.to_str().unwrap(), "--hf", hf.to_str().unwrap()]), LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    std::fs::remove_file(hf.join("model.safetensors")).unwrap();
    let weights = fifo(&hf.join("model.safetensors"));
    let init = format!("init_from={}", hf.display());
    let out = within(command(&dir.path().join("init"), "configs/debug.yaml", &[&init]), LIMIT);
    refused(&out, &[&format!("{}: a FIFO (named pipe), not a regular file", weights.display())]);

    let checkpoint = run_dir.join("checkpoints/step-00000002");
    let mut cmd = command(&dir.path().join("branch"), "configs/debug.yaml", &[]);
    cmd.args(["--resume", checkpoint.to_str().unwrap(), "--cooldown", &u64::MAX.to_string()]);
    let out = within(cmd, LIMIT);
    refused(&out, &["the checkpoint is at step 2: the branch would end past step 18446744073709551615"]);
}
