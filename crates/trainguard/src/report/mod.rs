//! Looking at runs outside the log: `trainguard report` (one self-contained HTML page of curves
//! and events for one or more run directories) and the TensorBoard event-file sink.
//!
//! `read` parses a run directory leniently, `series` decides what is drawn (panels, downsampling,
//! markers), `svg` draws a panel, `html` assembles the page. The page needs no network: SVG is
//! inline, the data is embedded as JSON, and a small inline script adds a hover readout.
pub mod html;
pub mod read;
pub mod series;
pub mod svg;
pub mod tensorboard;

use crate::fs::{run_files, whole_file};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{}: not a trainguard run directory: {why}", dir.display())]
    NotARun { dir: PathBuf, why: String },
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
    #[error("--out {}: exists and is not a report page; choose another path (the page would replace it)", path.display())]
    NotAPage { path: PathBuf },
    /// As `NotAPage`, for the path no flag named: the message must not blame a `--out` the user
    /// never typed, and says to give one.
    #[error("{} (where the page goes without --out) exists and is not a report page: give --out (the page would replace it)", path.display())]
    DefaultNotAPage { path: PathBuf },
}

impl ReportError {
    /// The user named something that is not a run (exit code 2).
    pub fn is_usage(&self) -> bool {
        // A run file that is not a regular file (a FIFO, a device) was put there, not written
        // by a run.
        matches!(self, Self::NotARun { .. } | Self::NotAPage { .. } | Self::DefaultNotAPage { .. })
            || matches!(self, Self::Read { source, .. } if source.kind() == std::io::ErrorKind::InvalidInput)
    }
}

/// Where the page goes when `--out` is not given: the first run's `report.html`.
pub fn default_out(runs: &[PathBuf]) -> PathBuf {
    runs.first().map_or_else(|| PathBuf::from(run_files::REPORT), |d| d.join(run_files::REPORT))
}

/// `path` is a file that begins as the pages [`html::page`] writes.
fn is_page(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 15];
    whole_file::open_regular(path).and_then(|(mut f, _)| f.read_exact(&mut head)).is_ok()
        && head.eq_ignore_ascii_case(b"<!doctype html>")
}

/// Reads every run, writes the page, and prints what was skipped on stderr. Returns the path.
pub fn run(dirs: &[PathBuf], out: Option<&Path>) -> Result<PathBuf, ReportError> {
    let mut runs = dirs.iter().map(|d| read::read_run(d)).collect::<Result<Vec<_>, _>>()?;
    // Named among each other: two runs' directories may both be called `run`.
    for (r, name) in
        runs.iter_mut().zip(read::run_names(&dirs.iter().map(PathBuf::as_path).collect::<Vec<_>>()))
    {
        r.name = name;
    }
    for r in &runs {
        const SHOWN: usize = 10;
        for s in r.skipped.iter().take(SHOWN) {
            crate::console::logging::to_stderr(&format!(
                "warning: {}: {} line {}: {}; skipped",
                r.dir.display(),
                s.file,
                s.line,
                s.reason
            ));
        }
        if r.skipped.len() > SHOWN {
            crate::console::logging::to_stderr(&format!(
                "warning: {}: {} more lines skipped (listed in the report)",
                r.dir.display(),
                r.skipped.len() - SHOWN
            ));
        }
    }
    // A page may replace an earlier page, nothing else (`--out RUN/metrics.jsonl` would have
    // replaced the run's metrics with the page drawn from them).
    let out = match out {
        Some(given) if given.exists() && !is_page(given) => {
            return Err(ReportError::NotAPage { path: given.to_path_buf() })
        }
        Some(given) => given.to_path_buf(),
        None => {
            let path = default_out(dirs);
            if path.exists() && !is_page(&path) {
                return Err(ReportError::DefaultNotAPage { path });
            }
            path
        }
    };
    let page = html::page(&runs);
    // Whole: a browser reloading the page never sees half.
    whole_file::replace(&out, page.as_bytes())
        .map_err(|source| ReportError::Write { path: out.clone(), source })?;
    Ok(out)
}
