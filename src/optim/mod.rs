//! Optimizers written over tensors (so their state can be saved and restored) and the
//! learning-rate schedule. Owns the update rules (AdamW; SGD with or without momentum;
//! Adafactor) and gradient clipping; not the gradients' computation.
mod adafactor;
mod adamw;
mod clip;
mod schedule;
mod sgd;
mod state;

pub use adafactor::{Adafactor, AdafactorConfig, SecondMoment};
pub use adamw::{AdamW, AdamWConfig};
pub use clip::clip_grad_norm;
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};
