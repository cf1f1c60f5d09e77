//! Human logs: `tracing` lines on stderr and, once a run directory exists, in
//! `out_dir/train.log`. On a terminal the progress bar shows each step, so stderr gets only
//! warnings and errors; elsewhere (CI, nohup, files) stderr gets plain info lines.
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use tracing_subscriber::{fmt, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

static LOG_FILE: OnceLock<Mutex<Option<File>>> = OnceLock::new();

struct FileWriter;

impl Write for FileWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match LOG_FILE.get().and_then(|m| m.lock().ok()).as_deref_mut() {
            Some(Some(f)) => f.write(buf),
            _ => Ok(buf.len()),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match LOG_FILE.get().and_then(|m| m.lock().ok()).as_deref_mut() {
            Some(Some(f)) => f.flush(),
            _ => Ok(()),
        }
    }
}

/// Whether a progress bar replaces the per-step log lines on stderr.
pub fn progress_bar_wanted() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("TRAINGUARD_NO_PROGRESS").is_none()
}

/// This process's rank under a launcher (`RANK`), when it is not 0: its lines are marked.
pub fn nonzero_rank() -> Option<usize> {
    std::env::var("RANK").ok().and_then(|r| r.parse::<usize>().ok()).filter(|&r| r > 0)
}

/// Prefixes each line a non-zero rank writes with `[rank N]`.
struct RankWriter(Option<usize>);

impl Write for RankWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut err = std::io::stderr().lock();
        if let Some(r) = self.0 {
            write!(err, "[rank {r}] ")?;
        }
        err.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Only rank 0 logs progress; other ranks (`RANK` > 0 under torchrun) log warnings and errors,
/// each line marked with its rank.
pub fn init() {
    let rank = nonzero_rank();
    let stderr_level = if progress_bar_wanted() || rank.is_some() { "warn" } else { "info" };
    let stderr_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| stderr_level.into());
    let stderr = fmt::layer()
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(move || RankWriter(rank))
        .with_filter(stderr_filter);
    let file = fmt::layer().with_target(false).with_ansi(false).with_writer(|| FileWriter).with_filter(EnvFilter::new("info"));
    let _ = tracing_subscriber::registry().with(stderr).with(file).try_init();
}

/// From now on, log lines also go to `path` (appended: a resumed run continues the file).
pub fn also_to_file(path: &Path) -> std::io::Result<()> {
    let file = File::options().create(true).append(true).open(path)?;
    let slot = LOG_FILE.get_or_init(|| Mutex::new(None));
    if let Ok(mut guard) = slot.lock() {
        *guard = Some(file);
    }
    Ok(())
}

/// `text` in `train.log` alone, when the run has one: the fatal error that `main` prints on
/// stderr itself (not as a log line) also ends the file, so the file tells how the run ended.
pub fn in_file_only(text: &str) {
    let _ = writeln!(FileWriter, "{text}").and_then(|_| FileWriter.flush());
}
