//! Where events go: `metrics.jsonl` (one line per step), `events.jsonl` (the rest),
//! TensorBoard's event files when asked, the progress bar, and the log (words in `render.rs`).
//! Each line is flushed as written; a resumed run rewrites the files to its checkpoint first.
//! [`Subscriber`]s (the notifier) see every event after the files have it.
use super::Event;
use crate::fs::{run_files, whole_file};
use crate::memory::human;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

pub struct Reporter {
    pub(super) metrics: Option<BufWriter<File>>,
    /// Where `metrics` writes: [`Reporter::rewind`] rewrites it.
    metrics_path: Option<std::path::PathBuf>,
    pub(super) events: Option<BufWriter<File>>,
    pub(super) log_interval: u64,
    pub(super) max_steps: u64,
    bar: Option<indicatif::ProgressBar>,
    /// `metrics.tensorboard: true`: the same lines as TensorBoard event files.
    tensorboard: Option<crate::report::tensorboard::TensorBoardWriter>,
    /// The step a resumed run started at (a run resumed at or past max_steps trains nothing).
    pub(super) resume_at: Option<u64>,
    subscribers: Vec<Box<dyn Subscriber>>,
}

/// Something told of every event, numbered as the files have it (steps from 1). It runs on the
/// training thread, on every step: it must return at once (hand work to a thread of its own).
pub trait Subscriber: Send {
    fn event(&mut self, event: &Event);
}

/// A file of the run directory the reporter could not open or rewrite.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", .path.display())]
pub struct SinkError {
    pub path: std::path::PathBuf,
    pub source: std::io::Error,
}

impl Reporter {
    /// `out_dir = None`: log lines only (non-writing ranks, tests). `resume_at`: the step a
    /// resumed run starts at; metrics of later steps (from before a kill) are dropped, since the
    /// run computes them again, and both files are appended to.
    pub fn new(
        out_dir: Option<&Path>,
        log_interval: u64,
        max_steps: u64,
        resume_at: Option<u64>,
    ) -> Result<Self, SinkError> {
        let open = |name: &str| -> Result<Option<BufWriter<File>>, SinkError> {
            let Some(d) = out_dir else { return Ok(None) };
            let path = d.join(name);
            let named = |source| SinkError { path: path.clone(), source };
            match (resume_at, name) {
                (Some(step), run_files::METRICS) => {
                    keep_lines(&path, |v| v["step"].as_u64().is_some_and(|s| s <= step)).map_err(named)?
                }
                // A run killed mid-write may have left half a line.
                (Some(_), _) => keep_lines(&path, |_| true).map_err(named)?,
                _ => {}
            }
            let file = if resume_at.is_some() {
                File::options().create(true).append(true).open(&path)
            } else {
                File::create(&path)
            }
            .map_err(named)?;
            Ok(Some(BufWriter::new(file)))
        };
        let bar = crate::console::logging::progress_bar_wanted().then(|| {
            let bar = indicatif::ProgressBar::new(max_steps);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | ETA {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_position(resume_at.unwrap_or(0));
            bar
        });
        Ok(Self {
            metrics: open(run_files::METRICS)?,
            metrics_path: out_dir.map(|d| d.join(run_files::METRICS)),
            events: open(run_files::EVENTS)?,
            log_interval,
            max_steps,
            bar,
            tensorboard: None,
            resume_at,
            subscribers: Vec::new(),
        })
    }

    /// Also writes TensorBoard event files into `dir` (the writing rank's `out_dir/tb`), starting
    /// with the resolved config as text.
    pub fn enable_tensorboard(&mut self, dir: &Path, config_yaml: &str) -> Result<(), SinkError> {
        let named = |source| SinkError { path: dir.to_path_buf(), source };
        // A resumed run's first line is the step after its checkpoint's: earlier files' lines from
        // there on are the ones it replays.
        let first_step = self.resume_at.map_or(0, |done| done + 1);
        let mut tb = crate::report::tensorboard::TensorBoardWriter::create(dir, first_step).map_err(named)?;
        tb.text("config", Some(0), &format!("```yaml\n{config_yaml}```")).map_err(named)?;
        self.tensorboard = Some(tb);
        Ok(())
    }

    /// Tells `subscriber` of every event from now on.
    pub fn subscribe(&mut self, subscriber: Box<dyn Subscriber>) {
        self.subscribers.push(subscriber);
    }

    /// Back to `step` steps done (a divergence rollback): `metrics.jsonl` keeps the lines up to
    /// it, as a run resumed from that checkpoint would, and the steps trained again follow.
    pub fn rewind(&mut self, step: u64) -> Result<(), SinkError> {
        let (Some(w), Some(path)) = (self.metrics.as_mut(), self.metrics_path.clone()) else { return Ok(()) };
        let named = |source| SinkError { path: path.clone(), source };
        w.flush().map_err(named)?;
        keep_lines(&path, |v| v["step"].as_u64().is_some_and(|s| s <= step)).map_err(named)?;
        // The rewrite replaced the file: appending goes on in the new one.
        let file = File::options().append(true).open(&path).map_err(named)?;
        self.metrics = Some(BufWriter::new(file));
        if let Some(bar) = &self.bar {
            bar.set_position(step);
        }
        Ok(())
    }

    pub fn emit(&mut self, event: Event) {
        let event = event.counted_from_one();
        self.log(&event);
        if let (Some(bar), Event::Step(m)) = (&self.bar, &event) {
            let mem = crate::memory::ProcessMemory::read()
                .map(|p| format!(" | rss {}", human(p.rss_bytes)))
                .unwrap_or_default();
            bar.set_position(m.step);
            bar.set_message(format!(
                "loss {:.4} | {:.0} tok/s | micro {}×{}{mem}",
                m.loss, m.tokens_per_s, m.micro_batch, m.accumulation
            ));
        }
        if let (Some(bar), Event::RunFinished(_) | Event::Stopped { .. }) = (&self.bar, &event) {
            bar.finish();
        }
        let sink = if matches!(event, Event::Step(_)) { &mut self.metrics } else { &mut self.events };
        if let Some(w) = sink {
            let line = match &event {
                Event::Step(m) => serde_json::to_string(m),
                e => serde_json::to_string(e),
            };
            // Flushed per line: a killed run keeps every line up to its last step.
            let written =
                line.map_err(std::io::Error::other).and_then(|l| writeln!(w, "{l}")).and_then(|_| w.flush());
            if let Err(e) = written {
                tracing::warn!("cannot write run files: {e}");
            }
        }
        if let Some(tb) = &mut self.tensorboard {
            let written = match &event {
                Event::Step(m) => {
                    serde_json::to_value(m).map_err(std::io::Error::other).and_then(|v| tb.scalars(&v))
                }
                e => serde_json::to_value(e)
                    .map_err(std::io::Error::other)
                    .and_then(|v| tb.text("events", v["step"].as_i64(), &v.to_string())),
            };
            if let Err(e) = written {
                tracing::warn!("cannot write TensorBoard files, no more will be written: {e}");
                self.tensorboard = None;
            }
        }
        for s in &mut self.subscribers {
            s.event(&event);
        }
    }
}

/// Rewrites a JSONL file keeping the complete lines that `keep` accepts.
/// Bytes, not text: a line cut inside a multi-byte character is dropped like any half line
/// (read as a string, the file failed whole and was left as it was).
fn keep_lines(path: &Path, keep: impl Fn(&serde_json::Value) -> bool) -> std::io::Result<()> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut kept = Vec::with_capacity(bytes.len());
    for line in bytes.split(|&b| b == b'\n') {
        if serde_json::from_slice::<serde_json::Value>(line).is_ok_and(|v| keep(&v)) {
            kept.extend_from_slice(line);
            kept.push(b'\n');
        }
    }
    // Whole: a kill during the rewrite leaves the old file or the new one, never a truncated
    // one (the run's whole history).
    whole_file::replace(path, &kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_half_line_is_dropped_even_when_cut_inside_a_character() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let mut bytes = b"{\"event\":\"a\",\"step\":1}\n{\"event\":\"b\",\"step\":2}\n".to_vec();
        bytes.extend_from_slice(b"{\"event\":\"checkpoint_saved\",\"path\":\"runs/\xc3");
        std::fs::write(&path, &bytes).unwrap();
        keep_lines(&path, |_| true).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"event\":\"a\",\"step\":1}\n{\"event\":\"b\",\"step\":2}\n"
        );
        keep_lines(&path, |v| v["step"].as_u64() == Some(2)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"event\":\"b\",\"step\":2}\n");
        keep_lines(&dir.path().join("absent.jsonl"), |_| true).unwrap();
    }
}
