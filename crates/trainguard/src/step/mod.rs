//! One optimizer step, the only copy: training (`train::Run`) and `plan --profile` both call
//! [`optimizer_step`]. Owns the order of work inside a step — micro-batches under autocast with
//! the memory savers (or replayed as CUDA graphs: [`graphs`]), the ranks' agreement and gradient average, loss-scale unscaling, the
//! injected faults, clipping, the non-finite check, the update — and the building of what a step
//! works on ([`Trainable`]: model, optimizer, loss scaler). It does not own the loop across steps
//! (schedule, evaluation cadence, checkpoints, stops: `train`), nor the OOM policy (`guard`).
mod engine;
mod faults;
mod gathered;
pub mod graphs;
mod micro;
pub mod precision;
pub mod savers;
pub mod state_layout;

pub use engine::{optimizer_step, validation_loss, StepOutcome, StepSettings, Trainable};
pub use faults::{Faults, StepFault};
pub use micro::{evaluate, forward_backward, StepData};
pub use precision::{Autocast, LossScaler, ScaleChange};
pub use savers::Savers;
pub use state_layout::{LayoutSpec, StateLayout};
