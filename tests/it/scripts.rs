//! The job scripts as a user runs them: scripts/launch/slurm.sbatch driven with fake `srun`, `scontrol`,
//! `squeue` and `torchrun` on PATH (what it runs, when it requeues), and scripts/launch/torchrun.sh with
//! the real torchrun (its exit code from the stop record), and scripts/bench/bench_vs_pytorch.sh on the
//! CPU (its table of tokens/s, MFU and ratios), and scripts/bench/bench_offload.sh on the CPU (its rows).
use crate::common::*;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Fakes {
    dir: tempfile::TempDir,
}

impl Fakes {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, format!("#!/bin/bash\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        // srun: log, drop its own options, run the command (as the job step's task).
        // A step that reads a file on every node also prints node2's copy, FAKE_NODE2_RECORD.
        write(
            "srun",
            r#"echo "srun $*" >> "$FAKE_LOG"; while [[ $1 == --* ]]; do shift; done
[ "$1" = cat ] && [ -n "${FAKE_NODE2_RECORD:-}" ] && cat "$FAKE_NODE2_RECORD"
exec "$@""#,
        );
        write(
            "scontrol",
            r#"echo "scontrol $*" >> "$FAKE_LOG"; [ "$1 $2" = "show hostnames" ] && printf 'node1\nnode2\n'; exit 0"#,
        );
        write("squeue", r#"echo "squeue $*" >> "$FAKE_LOG"; echo "$FAKE_SQUEUE""#);
        // torchrun: log its arguments, then end the way FAKE_OUTCOME says (as trainguard would
        // leave the run directory).
        write(
            "torchrun",
            r#"echo "torchrun $*" >> "$FAKE_LOG"; echo "failure-file $TRAINGUARD_FAILURE_FILE" >> "$FAKE_LOG"
rec="$FAKE_OUT/stop.json"
case $FAKE_OUTCOME in
  fail_here) echo '{"restart_count":0,"code":2,"message":"refused"}' > "$TRAINGUARD_FAILURE_FILE"; exit 1 ;;
  stopped) mkdir -p "$FAKE_OUT"; echo '{"status":"stopped","reason":"time_limit","step":7,"resumable":true}' > "$rec"; exit 0 ;;
  finished) mkdir -p "$FAKE_OUT"; echo '{"status":"finished","step":9,"resumable":false}' > "$rec"; exit 0 ;;
  crash) exit 1 ;;
  wait) trap 'mkdir -p "$FAKE_OUT"; echo "{\"status\":\"stopped\",\"reason\":\"signal\",\"step\":3,\"resumable\":true}" > "$rec"; echo got-term >> "$FAKE_LOG"; exit 1' TERM
        touch "$FAKE_LOG.ready"; while true; do sleep 0.05; done ;;
esac"#,
        );
        Self { dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    fn sbatch(&self, outcome: &str, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.current_dir(repo())
            .arg("scripts/launch/slurm.sbatch")
            .arg("configs/gpt2-124m.yaml")
            .arg("--set")
            .arg(format!("out_dir={}", self.out().display()));
        let path = format!("{}:{}", self.dir.path().display(), std::env::var("PATH").unwrap());
        cmd.env("PATH", path).env("TORCHRUN", self.dir.path().join("torchrun")).env("TRAINGUARD", bin());
        cmd.env("FAKE_LOG", self.dir.path().join("log"))
            .env("FAKE_OUT", self.out())
            .env("FAKE_OUTCOME", outcome);
        cmd.env("SLURM_JOB_ID", "42")
            .env("SLURM_JOB_NODELIST", "node[1-2]")
            .env("SLURM_NNODES", "2")
            .env_remove("SLURM_JOB_END_TIME");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn max_duration_s(log: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.starts_with("torchrun "))?;
    line.split("--max-duration ").nth(1)?.split('s').next()?.parse().ok()
}

#[test]
fn sbatch_runs_torchrun_under_srun_with_the_jobs_own_time_and_requeues_a_stop() {
    let f = Fakes::new();
    let end = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600;
    let o = f.sbatch("stopped", &[("SLURM_JOB_END_TIME", &end.to_string())]).output().unwrap();
    let log = f.log();
    assert_eq!(o.status.code(), Some(0), "{}\n{log}", text(&o));
    let srun = log
        .lines()
        .find(|l| l.starts_with("srun "))
        .expect("torchrun started through srun (a job step gets SLURM's signals)");
    assert!(srun.contains("--kill-on-bad-exit=1"), "{srun}");
    let tr = log.lines().find(|l| l.starts_with("torchrun ")).unwrap();
    for needle in [
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_endpoint=node1:29500",
        "--rdzv_id=42",
        "--resume auto",
        "train --config configs/gpt2-124m.yaml",
    ] {
        assert!(tr.contains(needle), "`{needle}` missing: {tr}");
    }
    // An hour left, 300 s kept for the last checkpoint (a second may pass in between).
    let d = max_duration_s(&log).expect("--max-duration from SLURM_JOB_END_TIME");
    assert!((3298..=3300).contains(&d), "{d}");
    assert!(log.contains("scontrol requeue 42"), "a stop record requeues: {log}");
}

/// A leg the time limit stopped where it began (its stop record at the step of the newest
/// checkpoint before it: no step fitted) is not requeued: every leg would do the same, for ever.
/// A signal's stop there still requeues (a preemption, say).
#[test]
fn sbatch_does_not_requeue_a_leg_the_time_limit_stopped_where_it_began() {
    let f = Fakes::new();
    std::fs::create_dir_all(f.out().join("checkpoints/step-00000007")).unwrap();
    let o = f.sbatch("stopped", &[]).output().unwrap();
    let log = f.log();
    assert_eq!(o.status.code(), Some(1), "{}\n{log}", text(&o));
    assert!(text(&o).contains("stopped it at step 7, where this leg began"), "{}", text(&o));
    assert!(!log.contains("requeue"), "{log}");
    // One step further on, the same stop requeues.
    std::fs::rename(f.out().join("checkpoints/step-00000007"), f.out().join("checkpoints/step-00000006"))
        .unwrap();
    let o = f.sbatch("stopped", &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(f.log().contains("scontrol requeue 42"), "{}", f.log());
}

#[test]
fn sbatch_reads_squeue_when_the_end_time_is_not_exported_and_does_not_requeue_a_finished_run() {
    let f = Fakes::new();
    let o = f.sbatch("finished", &[("FAKE_SQUEUE", "1-02:03:04")]).output().unwrap();
    let log = f.log();
    assert_eq!(o.status.code(), Some(0), "{}\n{log}", text(&o));
    assert!(log.contains("squeue -h -j 42 -o %L"), "{log}");
    assert_eq!(max_duration_s(&log), Some(86400 + 2 * 3600 + 3 * 60 + 4 - 300));
    assert!(!log.contains("requeue"), "finished: {log}");

    // No limit known: no --max-duration at all (not a made-up constant).
    let g = Fakes::new();
    let o = g.sbatch("finished", &[("FAKE_SQUEUE", "UNLIMITED")]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(max_duration_s(&g.log()), None, "{}", g.log());
}

#[test]
fn sbatch_reports_a_crash_and_does_not_requeue_even_with_an_old_stop_record() {
    let f = Fakes::new();
    std::fs::create_dir_all(f.out()).unwrap();
    std::fs::write(
        f.out().join("stop.json"),
        r#"{"status":"stopped","reason":"signal","step":1,"resumable":true}"#,
    )
    .unwrap();
    let o = f.sbatch("crash", &[("FAKE_SQUEUE", "10:00")]).output().unwrap();
    let log = f.log();
    assert_ne!(o.status.code(), Some(0));
    assert!(text(&o).contains("crashed"), "{}", text(&o));
    assert!(!log.contains("requeue"), "the earlier leg's record must not requeue a crash: {log}");
    assert_eq!(max_duration_s(&log), Some(600 - 300));
    // Not the script's to remove: trainguard removes it once a leg starts (this fake never did).
    assert!(f.out().join("stop.json").exists());
}

/// A run killed without a word (no stop record, no failure record) is the job script's to tell:
/// one `crashed` notice to the webhook in TRAINGUARD_NOTIFY_WEBHOOK, and the URL not printed.
#[test]
fn sbatch_tells_the_webhook_of_a_run_that_ended_without_a_word() {
    let hook = crate::notify::Hook::start();
    let f = Fakes::new();
    let url = hook.url();
    let o = f
        .sbatch("crash", &[("FAKE_SQUEUE", "10:00"), ("TRAINGUARD_NOTIFY_WEBHOOK", url.as_str())])
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
    assert_eq!(hook.names(), ["crashed"], "{}", text(&o));
    let body = &hook.bodies()[0];
    assert_eq!(body["exit_code"], 1);
    assert_eq!(body["run"], f.out().display().to_string());
    assert!(body["text"].as_str().unwrap().contains("killed"), "{body}");
    assert!(!text(&o).contains(crate::notify::TOKEN), "{}", text(&o));
}

/// A failure no restart mends ends the job with its code, not requeued, whichever node's worker
/// recorded it: the batch script's node keeps its own record; another node's is asked for with a
/// short job step. Each leg records in a new file (a requeue keeps the job id, and a record from
/// an earlier leg on another node would end this leg's first restart there).
#[test]
fn sbatch_exits_with_the_code_of_a_failure_a_restart_would_meet_again_on_any_node() {
    let f = Fakes::new();
    let o = f.sbatch("fail_here", &[("FAKE_SQUEUE", "10:00")]).output().unwrap();
    let log = f.log();
    assert_eq!(o.status.code(), Some(2), "{}\n{log}", text(&o));
    assert!(text(&o).contains("failed with exit 2, which a restart would meet again"), "{}", text(&o));
    assert!(
        !log.contains("requeue") && !log.contains(" cat "),
        "its own node's record, no step to ask: {log}"
    );

    // On node2: the batch script's node has none.
    let record = f.dir.path().join("node2.json");
    std::fs::write(&record, "{\"restart_count\":1,\"code\":3,\"message\":\"out of memory\"}\n").unwrap();
    let o = f
        .sbatch("crash", &[("FAKE_SQUEUE", "10:00"), ("FAKE_NODE2_RECORD", record.to_str().unwrap())])
        .output()
        .unwrap();
    let log = f.log();
    assert_eq!(o.status.code(), Some(3), "{}\n{log}", text(&o));
    assert!(text(&o).contains("failed with exit 3") && !log.contains("requeue"), "{}\n{log}", text(&o));
    assert!(log.contains("srun --nodes=2 --ntasks-per-node=1 cat "), "every node asked: {log}");

    let files: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("failure-file ")).collect();
    assert_eq!(files.len(), 2, "{log}");
    assert!(
        files[0] != files[1] && files.iter().all(|f| f.contains("trainguard-42-")),
        "a new file for each leg: {files:?}"
    );
}

#[test]
fn sbatch_forwards_slurms_sigterm_to_the_job_step_and_requeues() {
    let f = Fakes::new();
    let mut child = f
        .sbatch("wait", &[("FAKE_SQUEUE", "UNLIMITED")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = f.dir.path().join("log.ready");
    let t0 = Instant::now();
    while !ready.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30), "fake torchrun never started: {}", f.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // What `--signal=B:TERM@120` does: SIGTERM to the batch shell only.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let log = f.log();
    assert!(log.contains("got-term"), "the signal reached the job step: {log}\n{out}");
    assert!(log.contains("scontrol requeue 42"), "{log}\n{out}");
    assert_eq!(status.code(), Some(0), "{out}");
}

fn torchrun_sh(out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.current_dir(repo()).args(["scripts/launch/torchrun.sh", "2", "configs/debug.yaml"]);
    for s in [
        format!("out_dir={}", out.display()).as_str(),
        "train.threads=1",
        "train.global_batch_size=16",
        "train.warmup_steps=2",
        "train.eval_interval=0",
        "checkpoint.interval=5",
    ] {
        cmd.arg("--set").arg(s);
    }
    cmd.args(extra).env("TRAINGUARD", bin()).env("MAX_RESTARTS", "1");
    cmd
}

#[test]
fn torchrun_sh_exits_4_on_a_planned_stop_and_0_when_finished() {
    let d = tempfile::tempdir().unwrap();
    let o =
        torchrun_sh(d.path(), &["--set", "train.max_steps=100000", "--max-duration", "3s"]).output().unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("stopped, resumable"), "{}", text(&o));
    let o = torchrun_sh(
        d.path(),
        &["--set", "train.max_steps=100000", "--resume", "auto", "--max-duration", "3s"],
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(4), "a second leg resumes and stops again: {}", text(&o));
    let e = tempfile::tempdir().unwrap();
    let o = torchrun_sh(e.path(), &["--set", "train.max_steps=6"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

/// An out_dir another run holds (its `.lock` locked): refused at once, exit 2, naming the
/// holder, its stop record left alone. Before, each of torchrun's attempts was refused in turn
/// and the script said "crashed", exit 1, having removed the other run's stop.json.
#[test]
fn torchrun_sh_refuses_an_out_dir_another_run_holds_with_exit_2() {
    use std::io::Write;
    let d = tempfile::tempdir().unwrap();
    let mut lock = std::fs::File::create(d.path().join(".lock")).unwrap();
    lock.try_lock().unwrap();
    write!(lock, "pid 4242 on elsewhere").unwrap();
    std::fs::write(d.path().join("stop.json"), "{}").unwrap();
    let t0 = Instant::now();
    let o = torchrun_sh(d.path(), &["--set", "train.max_steps=6"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("is in use by another trainguard run (pid 4242 on elsewhere)"), "{}", text(&o));
    assert!(t0.elapsed() < Duration::from_secs(30), "refused before any launch");
    assert_eq!(std::fs::read_to_string(d.path().join("stop.json")).unwrap(), "{}");
    drop(lock);
    let o = torchrun_sh(d.path(), &["--set", "train.max_steps=6"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "free again: {}", text(&o));
}

#[test]
fn torchrun_sh_turns_sigterm_into_a_checkpointed_resumable_stop() {
    let d = tempfile::tempdir().unwrap();
    let child = torchrun_sh(d.path(), &["--set", "train.max_steps=100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = d.path().join("metrics.jsonl");
    let t0 = Instant::now();
    while read_jsonl(&metrics).len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(60), "training never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let rec = trainguard::job::stop_record::read(d.path()).expect("stop.json");
    assert_eq!(rec.reason.as_deref(), Some("signal"));
    assert!(rec.checkpoint.is_some_and(|c| Path::new(&c).join("trainer_state.json").exists()));
}

/// scripts/bench/bench_vs_pytorch.sh on the CPU, briefly: trainguard and the PyTorch references at the
/// same shapes, a row with tokens/s, MFU and ratios (torch.compile is opt-in on CPU: a `-`); with
/// `--trace`, two more steps of each side profiled and tabulated.
#[test]
fn bench_vs_pytorch_prints_throughput_mfu_and_ratios_on_cpu() {
    let bench = |extra: &[&str]| {
        let mut cmd = Command::new("bash");
        cmd.current_dir(repo()).arg("scripts/bench/bench_vs_pytorch.sh").args(["--threads", "1"]).args(extra);
        cmd.env("TRAINGUARD_BIN", bin()).env("STEPS", "2").env("ROUNDS", "1").output().unwrap()
    };
    let traces = tempfile::tempdir().unwrap();
    let o = bench(&["--pad-vocab-to", "1", "--trace", traces.path().to_str().unwrap(), "configs/debug.yaml"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        out.contains(
            "| work | debug-trainguard | debug-eager-fused | debug-eager-fused − debug-trainguard |"
        ),
        "the sides side by side: {out}"
    );
    for side in ["trainguard", "eager-fused"] {
        // STEPS=2 after 3 warm-up steps: steps 6 and 7 (counted from 1) are the profiled ones,
        // on both sides.
        let file = traces.path().join(format!("debug-{side}.json"));
        assert!(out.contains(&format!("{}: steps 6-7, cpu operators", file.display())), "{side}: {out}");
    }
    assert!(out.lines().next().unwrap().contains("pt-compile"), "{out}");
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("configs/debug.yaml"))
        .expect("a row for the config")
        .split_whitespace()
        .collect();
    assert_eq!(row[1..3], ["cpu", "fp32"], "{out}");
    for i in [3, 4, 5] {
        assert!(row[i].parse::<f64>().unwrap() > 100.0, "tokens/s in column {i}: {out}");
    }
    assert_eq!(row[6], "-", "no torch.compile on CPU unless asked: {out}");
    assert!(row[7].ends_with('%') && row[7].trim_end_matches('%').parse::<f64>().unwrap() > 0.0, "{out}");
    assert!(row[8].ends_with('x') && row[9].ends_with('x') && row[10] == "-", "{out}");
    let o = bench(&["--dtype", "fp16", "configs/debug.yaml"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--dtype must be fp32 or bf16"), "{}", text(&o));
}

/// scripts/bench/bench_offload.sh (the GPU checks' part `offload`) on the CPU, where it can only
/// show its mechanics: the runs with the optimizer state on the device and in host memory train
/// and print their step times and peaks; under a cap too small for either, each capped row gives
/// the run's exit status and its error's first line.
#[test]
fn bench_offload_prints_both_layouts_and_what_each_did_under_the_cap_on_cpu() {
    let tiny = ["--set", "model.n_embd=64", "--set", "model.n_head=2", "--set", "model.n_layer=2"];
    let o = Command::new("bash")
        .current_dir(repo())
        .arg("scripts/bench/bench_offload.sh")
        .args(["--device", "cpu", "--steps", "3", "--cap", "1"])
        .args(tiny)
        .env("TRAINGUARD_BIN", bin())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let row = |label: &str| -> Vec<String> {
        let line =
            out.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no row `{label}`: {out}"));
        line[label.len()..].split_whitespace().map(str::to_string).collect()
    };
    for label in ["optimizer on the device", "offload_optimizer"] {
        let r = row(label);
        assert_eq!(r[0], "0", "{label} trains: {out}");
        assert!(r[1].parse::<f64>().unwrap() > 0.0, "{label}'s median step time: {out}");
        assert!(
            r[2].parse::<u64>().unwrap() > 0 && r[3].parse::<u64>().unwrap() > 0,
            "{label}'s peaks: {out}"
        );
    }
    assert!(out.contains("step time with offload / without: "), "{out}");
    assert!(out.contains("memory.limit=1MiB, between the two peaks:"), "{out}");
    for label in ["  on the device", "  offload_optimizer", "  escalate to offload"] {
        let r = row(label);
        assert!(r[0] == "1" || r[0] == "3", "{label} cannot train under 1 MiB: {out}");
        let at = out.find(&format!("{label} ")).unwrap();
        let next = out[at..].lines().nth(1).unwrap_or_default();
        assert!(next.trim_start().starts_with("error: "), "{label}'s error under its row: {out}");
    }
}
