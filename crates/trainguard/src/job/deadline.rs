//! The wall-clock deadline of `train.max_duration` for a whole torchrun job. Each restart is a
//! new process whose own clock starts at zero; without this, every restart would get the full
//! duration again and a job with `--max-restarts=3` would overrun its allocation.
//! The first attempt's rank 0 sets the deadline (its start + the limit) in torchrun's agent
//! store, which lives as long as the launch, as the ranks meet; every rank of every attempt
//! reads it there (crates/trainguard/src/distributed/round.rs) and trains only for what is left. An attempt that died
//! before its ranks met set none: the next one's start counts. A new launch (a requeued SLURM
//! job) has a new store and a new budget. Pure, but for the clocks.
use std::time::Duration;

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

/// This process's start on the wall clock, in seconds since the epoch.
pub fn started_unix_s() -> f64 {
    now_unix_s() - process_start().elapsed().as_secs_f64()
}

/// This process's own deadline for `limit`, in milliseconds since the epoch: what the job's
/// first attempt proposes.
pub fn own_unix_ms(limit: Duration, started_unix_s: f64) -> i64 {
    ((started_unix_s + limit.as_secs_f64()) * 1000.0).round() as i64
}

/// The limit, counted from this process's start, that ends at the job's deadline: at least a
/// millisecond, so that an attempt that starts past it stops at once with a checkpoint.
pub fn limit_until(deadline_unix_ms: i64, started_unix_s: f64) -> Duration {
    Duration::from_secs_f64((deadline_unix_ms as f64 / 1000.0 - started_unix_s).max(0.001))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_gets_only_the_time_left_of_the_jobs_deadline() {
        // The first attempt started at t = 1000 s with a 90 s limit: its deadline, 1090 s.
        let deadline = own_unix_ms(Duration::from_secs(90), 1000.0);
        assert_eq!(deadline, 1_090_000);
        assert_eq!(limit_until(deadline, 1000.0), Duration::from_secs(90), "the first attempt's own");
        assert_eq!(limit_until(deadline, 1060.5), Duration::from_secs_f64(29.5), "a restart at 1060.5 s");
        assert_eq!(limit_until(deadline, 1200.0), Duration::from_millis(1), "past it: stop at once");
    }

    #[test]
    fn this_process_started_before_now() {
        let start = started_unix_s();
        assert!(start <= now_unix_s() && start > now_unix_s() - 3600.0);
    }
}
