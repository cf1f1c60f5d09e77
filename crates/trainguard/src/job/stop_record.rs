//! `out_dir/stop.json`: how the last run in a directory ended, for the job script that launched
//! it. Under torchrun an exit code other than 0 counts as a worker failure and triggers an
//! elastic restart (with a fresh process, a fresh time budget), so a planned stop (signal, time
//! limit) cannot be told by exit code there: every rank exits 0 and rank 0 leaves this record.
//!
//! - `{"status":"stopped","reason":…,"step":…,"checkpoint":…,"resumable":true}`: requeue with
//!   `--resume auto` (it continues from `checkpoint`; `"resumable":false` when none exists);
//! - `{"status":"finished","step":…,"resumable":false}`: done;
//! - no file: the run crashed, or a stop's checkpoint could not be written (exit 1): a requeue
//!   would not continue where it stopped (the record is removed once a run is built).
//!
//! Owns the record's format, where it lives and whether a launcher is present; not when to
//! stop (the trainer) nor the exit code mapping (job::exit).
use crate::fs::whole_file;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const FILE: &str = crate::fs::run_files::STOP;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Stopped,
    Finished,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopRecord {
    pub status: Status,
    /// `signal` or `time_limit` for a stop (every rank names the reason any rank saw); absent
    /// when finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Optimizer steps completed.
    pub step: u64,
    /// The checkpoint a `--resume auto` continues from: the stop's own, or after a second
    /// signal the newest complete one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// Whether a checkpoint exists to resume from.
    pub resumable: bool,
}

impl StopRecord {
    pub fn stopped(step: u64, reason: &str, checkpoint: Option<&Path>) -> Self {
        let resumable = checkpoint.is_some();
        Self {
            status: Status::Stopped,
            reason: Some(reason.into()),
            step,
            checkpoint: checkpoint.map(|c| c.display().to_string()),
            resumable,
        }
    }
    pub fn finished(step: u64) -> Self {
        Self { status: Status::Finished, reason: None, step, checkpoint: None, resumable: false }
    }
}

pub fn path(out_dir: &Path) -> PathBuf {
    out_dir.join(FILE)
}

/// At the start of a run: a crash from now on must leave no record.
pub fn clear(out_dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path(out_dir)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Written whole: a script never reads half a record.
pub fn write(out_dir: &Path, record: &StopRecord) -> std::io::Result<()> {
    std::fs::create_dir_all(out_dir)?;
    whole_file::replace_json(&path(out_dir), record)
}

pub fn read(out_dir: &Path) -> Option<StopRecord> {
    whole_file::read_json(&path(out_dir))
}

/// Started by torchrun's elastic agent (which sets these for every worker), so that a non-zero
/// exit would be taken for a failure and restarted.
pub fn under_elastic_agent(get: impl Fn(&str) -> Option<String>) -> bool {
    get("TORCHELASTIC_RUN_ID").is_some() || get("TORCHELASTIC_RESTART_COUNT").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_read_as_scripts_expect() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()), None, "no record: a crash");
        let r = StopRecord::stopped(12, "time_limit", Some(Path::new("runs/x/checkpoints/step-00000012")));
        write(d.path(), &r).unwrap();
        assert_eq!(read(d.path()), Some(r));
        let text = std::fs::read_to_string(path(d.path())).unwrap();
        // The scripts grep for these exact fragments.
        assert!(text.contains(r#""status":"stopped""#) && text.contains(r#""resumable":true"#), "{text}");
        let unsaved = StopRecord::stopped(12, "signal", None);
        assert!(!unsaved.resumable, "nothing to resume from");
        write(d.path(), &StopRecord::finished(20)).unwrap();
        let text = std::fs::read_to_string(path(d.path())).unwrap();
        assert!(text.contains(r#""status":"finished""#) && !text.contains("reason"), "{text}");
        clear(d.path()).unwrap();
        clear(d.path()).unwrap();
        assert_eq!(read(d.path()), None);
    }

    #[test]
    fn the_elastic_agent_is_recognised_by_its_variables() {
        assert!(!under_elastic_agent(|_| None));
        assert!(under_elastic_agent(|k| (k == "TORCHELASTIC_RUN_ID").then(|| "abc".into())));
        assert!(under_elastic_agent(|k| (k == "TORCHELASTIC_RESTART_COUNT").then(|| "0".into())));
    }
}
