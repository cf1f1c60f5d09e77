//! Upper bounds on sizes and durations, shared by config validation and `plan`'s flags. Far
//! beyond any model trained today, and low enough that the planner's byte counts (u64) and the
//! model's shapes (i64) cannot overflow: a typo of a few extra digits is an error, not an
//! allocation that runs the machine out of memory or a plan that wraps around to "fits".

/// Blocks (Llama 3.1 405B has 126).
pub const MAX_LAYERS: usize = 1 << 12;
/// Hidden size (405B: 16,384); also bounds the head count, which divides it.
pub const MAX_WIDTH: usize = 1 << 17;
/// MLP width (405B: 53,248).
pub const MAX_FFN: usize = 1 << 19;
/// Context length in tokens.
pub const MAX_SEQ_LEN: usize = 1 << 22;
/// Token ids are stored as uint16 or uint32 (`data::shards`); int32 keeps llm.c's counts valid.
pub const MAX_VOCAB: usize = i32::MAX as usize;
/// Tokens in one optimizer step, all ranks together.
pub const MAX_TOKENS_PER_STEP: usize = 1 << 32;
/// `plan --params`: a hundred trillion.
pub const MAX_PARAMS: u64 = 100_000_000_000_000;
/// A device's memory, or a share of it, as `plan` takes it (a PiB).
pub const MAX_DEVICE_BYTES: u64 = 1 << 50;
/// CPU threads (`train.threads`, `prepare --threads`): the largest machines have a few hundred
/// cores; a count with an extra digit or two spent minutes starting threads and held gigabytes.
pub const MAX_THREADS: usize = 1 << 12;
/// A duration (`train.max_duration`, `checkpoint.interval_minutes`): a century, in seconds.
pub const MAX_DURATION_S: f64 = 100.0 * 365.25 * 86400.0;
/// A config file (`--config`, a run's or a checkpoint's `config.yaml`), in bytes: configs are a
/// few KiB; what is read is bounded before YAML makes a tree of it.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;
/// How much larger than its text a YAML tree may be (each node counted as [`YAML_NODE_BYTES`],
/// each scalar as its text too; a text under 64 KiB counts as 64 KiB). An alias (`*base`)
/// repeats what its anchor names: serde_yaml allows 100 times the document's events, and a
/// 0.77 MB config of nested aliases became a 2.7 GB tree. Text without aliases stays under 9×.
pub const MAX_YAML_EXPANSION: u64 = 16;
/// What one node of a YAML tree counts towards [`MAX_YAML_EXPANSION`].
pub const YAML_NODE_BYTES: u64 = 16;
/// Levels of a `--set` key path (`train.lr` has 2): a config is a few levels deep; tens of
/// thousands overflowed the stack.
pub const MAX_SET_DEPTH: usize = 64;
/// `dist.timeout_s`: a week. The heartbeat's period and the fence's notices are multiples of it,
/// and c10d takes it in milliseconds: a value near 2^64 overflowed them.
pub const MAX_DIST_TIMEOUT_S: u64 = 7 * 24 * 3600;
