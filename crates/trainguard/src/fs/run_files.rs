//! The names of what a run directory (`out_dir`) holds, in one place: every writer and reader
//! (the trainer, the event sinks, `report`, `sample`, `export`, resume) takes them from here.
//! docs/checkpoints.md describes each file. A directory is a run by its [`CONFIG`] as trainguard
//! writes it, or a checkpoint under [`CHECKPOINTS`] (`train::placement`), not by the other names.

/// The resolved config, written at each start (`sample`, `report` and resume read it).
pub const CONFIG: &str = "config.yaml";
/// One JSON line per optimizer step.
pub const METRICS: &str = "metrics.jsonl";
/// One JSON line per event (start, OOM, checkpoint, stop, …).
pub const EVENTS: &str = "events.jsonl";
/// The human log, as printed.
pub const LOG: &str = "train.log";
/// How the run ended: finished, or stopped and resumable.
pub const STOP: &str = "stop.json";
/// The final weights (safetensors), written after the last step.
pub const WEIGHTS: &str = "model.safetensors";
/// The checkpoints, one `step-NNNNNNNN` directory each.
pub const CHECKPOINTS: &str = "checkpoints";
/// In each checkpoint: the trainer's state (step, progress, the files' sizes), beside the
/// weights ([`WEIGHTS`]), the optimizer's state and the config ([`CONFIG`]). A directory holding
/// one is a checkpoint.
pub const STATE: &str = "trainer_state.json";
/// TensorBoard's event files (`metrics.tensorboard`).
pub const TENSORBOARD: &str = "tb";
/// PyTorch profiler traces (`metrics.trace`).
pub const TRACE: &str = "trace";
/// `trainguard report`'s page when written into the run directory.
pub const REPORT: &str = "report.html";
/// The torchrun job that started the run (its restarts resume it).
pub const JOB: &str = "torchrun_job.json";
