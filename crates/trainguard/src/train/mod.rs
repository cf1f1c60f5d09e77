//! Training: a run's state and its loop across optimizer steps (schedule, evaluation,
//! checkpoints, stops, resume), reporting through [`events`](crate::events) only. The step
//! itself lives in [`step`](crate::step).
mod checkpointer;
mod config_file;
mod error;
mod finished;
mod placement;
mod resume;
mod run;
mod run_dir;
mod start;
mod trainer;
mod watch;

pub use error::TrainError;
pub use finished::finished_run;
pub use placement::PlacementError;
pub use resume::Resume;
pub use run::Run;
pub use trainer::train;
