//! Optimizers written over tensors (so their state can be saved and restored) and the
//! learning-rate schedule. Owns the update rule and gradient clipping; not the gradients'
//! computation.
mod adamw;
mod clip;
mod schedule;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::clip_grad_norm;
pub use schedule::LrSchedule;
