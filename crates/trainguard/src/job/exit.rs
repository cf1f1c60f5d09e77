//! Exit codes a job script can branch on. A leaf: the mapping from an error chain to a code
//! lives with the binary (`trainguard-cli`), which is the only place that sees every error type.
pub const SUCCESS: i32 = 0;
/// Anything not listed below (I/O, data files, libtorch errors that are not out-of-memory).
pub const FAILURE: i32 = 1;
/// Bad config, bad `--set`, bad command line (clap uses 2 as well).
pub const CONFIG: i32 = 2;
/// Out of memory even at the smallest allowed micro-batch (or with `oom.policy: fail`).
pub const OUT_OF_MEMORY: i32 = 3;
/// Stopped by SIGINT/SIGTERM or `train.max_duration` after writing a checkpoint: resumable.
pub const INTERRUPTED: i32 = 4;
/// Too many non-finite updates in a row (`nan.max_consecutive`); last good state checkpointed.
pub const NONFINITE: i32 = 5;
/// `deterministic: true` and an op libtorch has no deterministic implementation of (named).
pub const NOT_DETERMINISTIC: i32 = 6;

/// A name for the error kind behind an exit code (torchelastic's error file).
pub fn kind_name(code: i32) -> &'static str {
    match code {
        CONFIG => "ConfigError",
        OUT_OF_MEMORY => "OutOfMemoryError",
        INTERRUPTED => "Interrupted",
        NONFINITE => "NonFiniteLoss",
        NOT_DETERMINISTIC => "NotDeterministicError",
        _ => "TrainguardError",
    }
}
