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

/// `text`, each line marked `[rank N] ` when `rank` is given, every line ending in a newline.
fn marked(rank: Option<usize>, text: &str) -> String {
    let prefix = rank.map(|r| format!("[rank {r}] ")).unwrap_or_default();
    text.lines().map(|line| format!("{prefix}{line}\n")).collect()
}

/// `text` on stderr, each line marked with this process's rank when it is not 0, in one write.
/// Ranks under torchrun share one stderr, and a line written in pieces (as `eprintln!` writes
/// its arguments) can be cut by another rank's line.
pub fn to_stderr(text: &str) {
    let _ = std::io::stderr().lock().write_all(marked(nonzero_rank(), text).as_bytes());
}

/// Prefixes each line a non-zero rank writes with `[rank N]`, in one write (see `to_stderr`).
struct RankWriter(Option<usize>);

impl Write for RankWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut err = std::io::stderr().lock();
        match self.0 {
            Some(_) => err.write_all(marked(self.0, &String::from_utf8_lossy(buf)).as_bytes())?,
            None => err.write_all(buf)?,
        }
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
    let file = fmt::layer()
        .with_target(false)
        .with_ansi(false)
        .with_writer(|| FileWriter)
        .with_filter(EnvFilter::new("info"));
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

#[cfg(test)]
mod tests {
    use super::marked;

    #[test]
    fn every_line_of_a_nonzero_rank_is_marked_and_ends_in_a_newline() {
        assert_eq!(marked(Some(3), "error: a\nb"), "[rank 3] error: a\n[rank 3] b\n");
        assert_eq!(marked(None, "warning: x\n"), "warning: x\n");
        assert_eq!(marked(Some(1), ""), "");
    }
}
