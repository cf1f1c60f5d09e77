//! The wall-clock deadline of `train.max_duration` across torchrun's elastic restarts. Each
//! restart is a new process whose own clock starts at zero; without this, every restart would get
//! the full duration again and a job with `--max-restarts=3` would overrun its allocation.
//! The first attempt (TORCHELASTIC_RESTART_COUNT = 0) records `out_dir/deadline.json`
//! `{run_id, deadline_unix_s}` (rank 0); a restart of the same torchrun run (same
//! TORCHELASTIC_RUN_ID) trains only for what is left of it. Pure except `record` and `load`.
use crate::whole_file;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const FILE: &str = "deadline.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deadline {
    pub run_id: String,
    pub deadline_unix_s: f64,
}

pub fn path(out_dir: &Path) -> PathBuf {
    out_dir.join(FILE)
}

/// What `train.max_duration` should be in this attempt: `None` keeps the configured one.
/// `restart_count > 0` with a record of the same run: the time left (at least a millisecond, so
/// that the run stops at once with a checkpoint rather than failing validation).
pub fn remaining(saved: Option<&Deadline>, run_id: &str, restart_count: u64, now_unix_s: f64) -> Option<String> {
    let d = saved.filter(|d| restart_count > 0 && d.run_id == run_id)?;
    Some(format!("{:.3}s", (d.deadline_unix_s - now_unix_s).max(0.001)))
}

/// When this process started, as near as trainguard can tell: the first call, which `main`
/// makes first thing. `train.max_duration` counts from here, start-up included (loading a
/// corpus, building the model, reading a checkpoint take a share of a job's allocation too).
pub fn process_start() -> std::time::Instant {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *START.get_or_init(std::time::Instant::now)
}

pub fn now_unix_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

pub fn load(out_dir: &Path) -> Option<Deadline> {
    whole_file::read_json(&path(out_dir))
}

pub fn record(out_dir: &Path, d: &Deadline) -> std::io::Result<()> {
    std::fs::create_dir_all(out_dir)?;
    whole_file::replace_json(&path(out_dir), d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_of_the_same_run_gets_only_the_time_left() {
        let d = Deadline { run_id: "job-7".into(), deadline_unix_s: 1000.0 };
        assert_eq!(remaining(Some(&d), "job-7", 1, 940.0).as_deref(), Some("60.000s"));
        assert_eq!(remaining(Some(&d), "job-7", 2, 1200.0).as_deref(), Some("0.001s"), "past it: stop at once");
    }

    #[test]
    fn a_first_attempt_or_another_run_keeps_the_configured_duration() {
        let d = Deadline { run_id: "job-7".into(), deadline_unix_s: 1000.0 };
        assert_eq!(remaining(Some(&d), "job-7", 0, 940.0), None, "a requeued job starts a new budget");
        assert_eq!(remaining(Some(&d), "job-8", 1, 940.0), None);
        assert_eq!(remaining(None, "job-7", 1, 940.0), None);
    }

    #[test]
    fn the_record_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let d = Deadline { run_id: "r".into(), deadline_unix_s: 12.5 };
        record(dir.path(), &d).unwrap();
        assert_eq!(load(dir.path()), Some(d));
    }
}
