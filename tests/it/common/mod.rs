//! Helpers for tests that run the real `trainguard` binary in a fresh directory.
#![allow(dead_code)]
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct Run {
    pub output: Output,
    pub dir: PathBuf,
}

impl Run {
    pub fn code(&self) -> i32 {
        self.output.status.code().unwrap_or(-1)
    }
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
    /// The `error:` line the binary prints when a run fails (empty when there is none).
    pub fn error_line(&self) -> String {
        self.stderr().lines().find(|l| l.starts_with("error:")).unwrap_or_default().to_string()
    }
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
    pub fn metrics(&self) -> Vec<Value> {
        read_jsonl(&self.dir.join("metrics.jsonl"))
    }
    pub fn events(&self) -> Vec<Value> {
        read_jsonl(&self.dir.join("events.jsonl"))
    }
    pub fn events_of(&self, kind: &str) -> Vec<Value> {
        self.events().into_iter().filter(|e| e["event"] == kind).collect()
    }
    pub fn summary(&self) -> Value {
        self.events_of("run_finished")
            .pop()
            .unwrap_or_else(|| panic!("no run_finished event; stderr:\n{}", self.stderr()))
    }
    /// Asserts success and returns self.
    pub fn ok(self) -> Self {
        assert_eq!(self.code(), 0, "trainguard failed:\n{}", self.stderr());
        self
    }
}

/// The complete lines of a JSON-lines file, each parsed (a bad one fails the test). A tail
/// without its newline is a line still being written and is left out: tests poll the files of a
/// live run, and a reader racing the writer can see part of a line once the line crosses a page
/// boundary (the kernel publishes a write page by page). Every line trainguard writes ends in a
/// newline, so a finished file loses nothing.
pub fn read_jsonl(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l}: {e}")))
        .collect()
}

/// The binary under test. `TRAINGUARD_BIN` overrides the path cargo baked in, so a test binary
/// built here can run on a machine without a Rust toolchain (scripts/gpu/gpu_checks.sh).
pub fn bin() -> String {
    std::env::var("TRAINGUARD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_trainguard").to_string())
}

/// The checkout whose configs the tests read; `TRAINGUARD_REPO` overrides it as `bin()`'s does.
pub fn repo() -> PathBuf {
    std::env::var_os("TRAINGUARD_REPO").map_or_else(checkout, PathBuf::from)
}

/// The repository root: two levels above this crate (crates/trainguard-cli).
fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/trainguard-cli sits two levels down")
        .to_path_buf()
}

/// The project venv's `torchrun`.
pub fn torchrun() -> PathBuf {
    repo().join(".venv/bin/torchrun")
}

/// A TCP port nothing listens on now, for a store or a rendezvous. Taken below the kernel's
/// ephemeral range (32768 and up) and above the bench scripts' 29xxx, each once per test
/// process: the OS's own pick came from the ephemeral range, where another test's outgoing
/// connection could take it as its local port before the rank listened (EADDRINUSE, seen in CI).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 21_000;
    const SPAN: u32 = 8_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(u32::MAX, std::process::id() % SPAN, Ordering::Relaxed, Ordering::Relaxed);
    (0..SPAN)
        .map(|_| (LOW + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port between 21000 and 28999")
}

/// `trainguard train --config <config> --set out_dir=<dir> --set train.threads=1 <sets…>`.
pub fn command(dir: &Path, config: &str, sets: &[&str]) -> Command {
    let mut cmd = Command::new(bin());
    cmd.arg("train").arg("--config").arg(repo().join(config));
    cmd.arg("--set").arg(format!("out_dir={}", dir.display()));
    cmd.arg("--set").arg("train.threads=1");
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd
}

pub fn run(mut cmd: Command, dir: &Path) -> Run {
    let output = cmd.output().expect("run trainguard");
    Run { output, dir: dir.to_path_buf() }
}

pub fn train(dir: &Path, config: &str, sets: &[&str]) -> Run {
    run(command(dir, config, sets), dir)
}

/// Loads `model.safetensors` of a run directory as (name, tensor) pairs.
pub fn weights(dir: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(dir.join("model.safetensors")).expect("read weights");
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// Largest absolute difference between two runs' final weights.
pub fn max_weight_diff(a: &Path, b: &Path) -> f64 {
    let (wa, wb) = (weights(a), weights(b));
    assert_eq!(wa.len(), wb.len());
    wa.iter()
        .zip(&wb)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// The per-step series of one metrics field.
pub fn series(metrics: &[Value], key: &str) -> Vec<Value> {
    metrics.iter().map(|m| m[key].clone()).collect()
}

/// The tensors of a safetensors file, sorted by name.
pub fn tensors(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut t = tch::Tensor::read_safetensors(path).unwrap();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

/// Two safetensors files hold the same tensors bit for bit.
pub fn assert_bitwise_equal(a: &Path, b: &Path) {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.len(), tb.len());
    for ((na, xa), (nb, xb)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        assert!(xa.equal(xb), "{na} differs between {} and {}", a.display(), b.display());
    }
}

/// Makes a write of more than `bytes` into one file fail with EFBIG in `cmd`'s process (a file
/// size limit, SIGXFSZ, which would end the process, ignored): a real failed write, as a full
/// disk gives one, for the paths that must clean up after it.
pub fn limit_file_size(cmd: &mut Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            match libc::setrlimit(libc::RLIMIT_FSIZE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
}
