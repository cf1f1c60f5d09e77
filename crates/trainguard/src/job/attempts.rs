//! torchrun's attempts of one job: the processes of one TORCHELASTIC_RUN_ID, a restart being
//! the next TORCHELASTIC_RESTART_COUNT. torchrun restarts after any failed worker, whatever
//! failed; two records decide what a restart does instead:
//! - **what it resumes**: only a run this job started. Rank 0 writes `out_dir/torchrun_job.json`
//!   (`{run_id}`) once the ranks agree to start; a process resumes it when it names this job,
//!   whatever `--resume` asked (`train::Resume::asked`) and its restart count (a node
//!   whose workers did not fail is restarted with its count unchanged), and otherwise does what
//!   the command asked: a fresh
//!   start in another run's directory is refused again, not turned into a resume of that run.
//!   torchrun's default run id, `none`, is every such job's: under it only a restart (a count
//!   above 0) resumes;
//! - **whether it starts at all**: an attempt that ended in a failure no restart mends (exit 2,
//!   3, 5 or 6: a refused config or directory, out of memory at the floor, non-finite losses, an
//!   op with no deterministic form) leaves a [`Failure`] outside `out_dir`, which may be another
//!   run's: in the file `$TRAINGUARD_FAILURE_FILE` names (the job scripts set a new one for each
//!   launch, and read it for the exit code), else in the temporary directory under this user,
//!   this torchrun agent (the parent process) and the run id. Every later attempt on the node
//!   exits with that code at once, so torchrun's restarts run out in seconds instead of
//!   repeating the failure (or skipping more non-finite steps) from the last checkpoint.
//!
//! Pure except the four functions that read and write the records.
use super::exit;
use crate::fs::whole_file;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const JOB_FILE: &str = crate::fs::run_files::JOB;
/// Where the job scripts ask for the failure record (a path; its directory must exist).
pub const FAILURE_FILE_ENV: &str = "TRAINGUARD_FAILURE_FILE";

/// This process's place among its job's attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub run_id: String,
    pub restart_count: u64,
}

impl Attempt {
    /// From torchrun's environment; None outside an elastic agent.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let run_id = var("TORCHELASTIC_RUN_ID").filter(|id| !id.is_empty())?;
        let restart_count = var("TORCHELASTIC_RESTART_COUNT").and_then(|c| c.parse().ok()).unwrap_or(0);
        Some(Self { run_id, restart_count })
    }

    /// Whether the run id names one job: torchrun's default, `none`, is every job's.
    pub fn names_a_job(&self) -> bool {
        self.run_id != "none"
    }

    /// What rank 0 warns of, on `nodes` nodes under torchrun's default run id: after a worker
    /// fails, torchrun restarts a node whose workers had not failed (yet) with its count
    /// unchanged, 0 at first (seen with two agents on one machine), and under `none` a count of 0
    /// is a new launch, so those workers do what the command asked while the failed node's
    /// resume. Without `--resume auto` the ranks then disagree and the job ends.
    pub fn unnamed_across(&self, nodes: usize) -> Option<String> {
        (nodes > 1 && !self.names_a_job()).then(|| {
            format!(
                "a torchrun job on {nodes} nodes under the default run id `none`: after a worker fails, torchrun may restart another node's workers with their restart count unchanged, as a new launch, and without `--resume auto` they then refuse the run the others resume. Name the job: torchrun --rdzv-id <id> (scripts/launch/slurm.sbatch passes the SLURM job id)"
            )
        })
    }

    /// The failure record's path: `$TRAINGUARD_FAILURE_FILE`, else one in `tmp` for this user
    /// (`uid`), torchrun agent (`agent`, the parent's pid) and run id: never another job's.
    pub fn failure_file(
        &self,
        var: impl Fn(&str) -> Option<String>,
        tmp: &Path,
        uid: u32,
        agent: u32,
    ) -> PathBuf {
        match var(FAILURE_FILE_ENV).filter(|p| !p.is_empty()) {
            Some(p) => PathBuf::from(p),
            None => {
                let id: String = self
                    .run_id
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
                    .collect();
                tmp.join(format!("trainguard-torchrun-{uid}-{agent}-{id}.failed.json"))
            }
        }
    }
}

/// An attempt's failure that no restart mends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// The attempt it ended.
    pub restart_count: u64,
    pub code: i32,
    pub message: String,
}

/// Whether a failure with this exit code ends the job: what a restart would meet again.
pub fn ends_the_job(code: i32) -> bool {
    matches!(code, exit::CONFIG | exit::OUT_OF_MEMORY | exit::NONFINITE | exit::NOT_DETERMINISTIC)
}

/// An earlier attempt's failure, as this attempt's reason not to start.
#[derive(Debug, thiserror::Error)]
#[error("attempt {} of this torchrun job (restart {}) ended with exit {}, which a restart would meet again; not started again: {}", .0.restart_count + 1, .0.restart_count, .0.code, .0.message)]
pub struct EarlierFailure(pub Failure);

/// The failure an earlier attempt of this job (on this node: torchrun's count is per agent)
/// recorded, if any. Nothing is removed here: a worker of this attempt may already have
/// recorded its own (the launcher gives each job a new file).
pub fn earlier_failure(file: &Path, attempt: &Attempt) -> Option<Failure> {
    let f: Failure = whole_file::read_json(file)?;
    (f.restart_count < attempt.restart_count).then_some(f)
}

/// Records this attempt's failure unless one is there: the first worker's to fail stays.
pub fn record_failure(file: &Path, failure: &Failure) -> std::io::Result<()> {
    whole_file::create_json_once(file, failure).map(|_| ())
}

#[derive(Serialize, Deserialize)]
struct Job {
    run_id: String,
}

/// Marks `out_dir` as started by this job (rank 0, once the ranks agree to start).
pub fn record_job(out_dir: &Path, run_id: &str) -> std::io::Result<()> {
    whole_file::replace_json(&out_dir.join(JOB_FILE), &Job { run_id: run_id.into() })
}

/// Whether this job started the run in `out_dir`: what its processes resume by themselves.
pub fn started_by(out_dir: &Path, attempt: &Attempt) -> bool {
    let job: Option<Job> = whole_file::read_json(&out_dir.join(JOB_FILE));
    // torchrun's default id is every such job's: only a restart (of the one launched) resumes.
    (attempt.names_a_job() || attempt.restart_count > 0) && job.is_some_and(|j| j.run_id == attempt.run_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn an_attempt_is_read_from_torchruns_environment() {
        assert_eq!(Attempt::from_env(env(&[])), None, "not under torchrun");
        let a =
            Attempt::from_env(env(&[("TORCHELASTIC_RUN_ID", "job/7"), ("TORCHELASTIC_RESTART_COUNT", "2")]))
                .unwrap();
        assert_eq!(a, Attempt { run_id: "job/7".into(), restart_count: 2 });
        assert_eq!(
            a.failure_file(env(&[]), Path::new("/tmp"), 1000, 42),
            PathBuf::from("/tmp/trainguard-torchrun-1000-42-job_7.failed.json")
        );
        assert_eq!(
            a.failure_file(env(&[(FAILURE_FILE_ENV, "/jobs/f.json")]), Path::new("/tmp"), 1000, 42),
            PathBuf::from("/jobs/f.json")
        );
    }

    #[test]
    fn a_job_on_several_nodes_under_the_default_run_id_is_warned_of() {
        let at = |id: &str| Attempt { run_id: id.into(), restart_count: 0 };
        assert!(at("none")
            .unnamed_across(2)
            .is_some_and(|w| w.contains("on 2 nodes") && w.contains("--rdzv-id")));
        assert_eq!(at("none").unnamed_across(1), None, "one node restarts as a whole, its count raised");
        assert_eq!(at("job-7").unnamed_across(4), None, "a named job");
    }

    #[test]
    fn what_a_restart_meets_again_ends_the_job_and_a_crash_or_stop_does_not() {
        for code in [exit::CONFIG, exit::OUT_OF_MEMORY, exit::NONFINITE, exit::NOT_DETERMINISTIC] {
            assert!(ends_the_job(code), "{code}");
        }
        for code in [exit::SUCCESS, exit::FAILURE, exit::INTERRUPTED] {
            assert!(!ends_the_job(code), "{code}");
        }
    }

    #[test]
    fn a_later_attempt_finds_the_first_failure_recorded_and_it_stays() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("f.json");
        let at = |restart_count| Attempt { run_id: "j".into(), restart_count };
        let first = Failure { restart_count: 0, code: 5, message: "non-finite".into() };
        record_failure(&file, &first).unwrap();
        record_failure(&file, &Failure { restart_count: 0, code: 2, message: "a peer".into() }).unwrap();
        assert_eq!(earlier_failure(&file, &at(1)), Some(first.clone()), "the first one recorded stays");
        assert_eq!(earlier_failure(&file, &at(3)), Some(first));
        let later = Failure { restart_count: 2, code: 2, message: "m".into() };
        std::fs::write(&file, serde_json::to_string(&later).unwrap()).unwrap();
        assert_eq!(earlier_failure(&file, &at(2)), None, "this attempt's own, not an earlier one's");
        assert!(file.exists(), "never removed by a worker: a sibling may have written it");
        assert_eq!(earlier_failure(&d.path().join("none.json"), &at(1)), None);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temporary file left");
        let msg =
            EarlierFailure(Failure { restart_count: 0, code: 2, message: "refused".into() }).to_string();
        assert!(
            msg.starts_with("attempt 1 of this torchrun job (restart 0) ended with exit 2")
                && msg.ends_with(": refused"),
            "{msg}"
        );
    }

    #[test]
    fn only_the_job_that_started_a_run_resumes_it_by_itself() {
        let d = tempfile::tempdir().unwrap();
        let job = |id: &str| Attempt { run_id: id.into(), restart_count: 0 };
        assert!(!started_by(d.path(), &job("a")), "no record: another run, or none");
        record_job(d.path(), "a").unwrap();
        assert!(started_by(d.path(), &job("a")), "whatever the restart count");
        assert!(!started_by(d.path(), &job("b")));
        record_job(d.path(), "none").unwrap();
        assert!(!started_by(d.path(), &job("none")), "torchrun's default id: a new launch is not a restart");
        assert!(started_by(d.path(), &Attempt { run_id: "none".into(), restart_count: 1 }));
    }
}
