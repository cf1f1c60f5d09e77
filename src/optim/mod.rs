//! Optimizers written over tensors (so their state can be saved and restored) and the
//! learning-rate schedule. Owns the update rules (AdamW; SGD with or without momentum) and
//! gradient clipping; not the gradients' computation.
mod adamw;
mod clip;
mod schedule;
mod sgd;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::clip_grad_norm;
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};
