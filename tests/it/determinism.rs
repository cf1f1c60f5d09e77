//! `deterministic: true` on the real binary, on CPU: libtorch's switches as libtorch reports them
//! back, `CUBLAS_WORKSPACE_CONFIG` set (or the user's kept), CPU results unchanged bit for bit, and
//! an op with no deterministic implementation ending the run with its name and exit code 6. What
//! it buys on CUDA (bitwise replay and resume) is checked in tests/it/gpu.rs.
use crate::common::*;

const SHORT: [&str; 4] =
    ["train.max_steps=3", "train.warmup_steps=0", "train.eval_interval=0", "train.log_interval=1"];

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SHORT.iter().copied().chain(extra.iter().copied()).collect()
}

#[test]
fn libtorch_reports_the_switches_on_and_cpu_results_stay_bitwise_the_same() {
    let (det, plain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cmd = command(det.path(), "configs/debug.yaml", &sets(&["deterministic=true"]));
    cmd.env_remove("CUBLAS_WORKSPACE_CONFIG");
    let a = run(cmd, det.path()).ok();
    let d = &a.events_of("deterministic")[0];
    assert_eq!(
        (d["algorithms"].as_bool(), d["warn_only"].as_bool(), d["fill_uninitialized_memory"].as_bool()),
        (Some(true), Some(false), Some(true)),
        "{d}"
    );
    assert_eq!(
        (d["cublas_workspace_config"].as_str(), d["cublas_workspace_config_from"].as_str()),
        (Some(":4096:8"), Some("trainguard")),
        "{d}"
    );
    assert!(a.stderr().contains("CUBLAS_WORKSPACE_CONFIG=:4096:8 (set by trainguard)"), "{}", a.stderr());
    let b = train(plain.path(), "configs/debug.yaml", &sets(&[])).ok();
    assert!(b.events_of("deterministic").is_empty());
    assert_bitwise_equal(&det.path().join("model.safetensors"), &plain.path().join("model.safetensors"));
}

#[test]
fn a_cublas_workspace_config_from_the_environment_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd =
        command(dir.path(), "configs/debug.yaml", &sets(&["deterministic=true", "train.max_steps=1"]));
    cmd.env("CUBLAS_WORKSPACE_CONFIG", ":16:8");
    let r = run(cmd, dir.path()).ok();
    let d = &r.events_of("deterministic")[0];
    assert_eq!(
        (d["cublas_workspace_config"].as_str(), d["cublas_workspace_config_from"].as_str()),
        (Some(":16:8"), Some("environment")),
        "{d}"
    );
}

/// `faults.nondeterministic_op_at_step` runs `put_` (no deterministic implementation on any
/// device) inside step 2.
#[test]
fn an_op_without_a_deterministic_implementation_ends_the_run_named_with_exit_6() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &sets(&["deterministic=true", "faults.nondeterministic_op_at_step=2"]),
    );
    let err = r.stderr();
    assert_eq!(r.code(), 6, "{err}");
    let fatal = r.error_line();
    assert!(
        fatal.contains("deterministic: true, but `put_` has no deterministic implementation")
            && fatal.contains("at step 2"),
        "{err}"
    );
    assert!(!err.contains("panicked") && !err.contains("Exception raised from"), "{err}");
    assert_eq!(r.metrics().len(), 1, "step 1 completed, step 2 did not");
    // The same op without deterministic mode is fine.
    let ok = tempfile::tempdir().unwrap();
    train(ok.path(), "configs/debug.yaml", &sets(&["faults.nondeterministic_op_at_step=2"])).ok();
}

/// The keys of issue 12 validate like every other: a wrong type is exit 2 naming the key.
#[test]
fn deterministic_and_snapshot_on_oom_take_booleans_only() {
    for (set, key) in
        [("deterministic=2", "`deterministic`"), ("memory.snapshot_on_oom=maybe", "`memory.snapshot_on_oom`")]
    {
        let dir = tempfile::tempdir().unwrap();
        let r = train(dir.path(), "configs/debug.yaml", &[set]);
        assert_eq!(r.code(), 2, "{}", r.stderr());
        assert!(r.stderr().contains(key) && r.stderr().contains("expected a boolean"), "{}", r.stderr());
    }
}
