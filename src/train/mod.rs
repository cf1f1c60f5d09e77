//! The training loop and one optimizer step. Owns the order of work within a step (micro-steps,
//! clipping, update) and across steps (schedule, evaluation, reporting); reports through
//! [`events`](crate::events) only.
mod agree;
pub mod precision;
mod resume;
pub mod savers;
mod step;
mod trainer;
mod watch;

pub use step::{evaluate, forward_backward, StepData};
pub use trainer::{train, Resume, TrainError};
