//! Optimizers written over tensors (so their state can be saved and restored) and the
//! learning-rate schedule. Owns the update rules (AdamW, SGD with or without momentum, Adafactor,
//! 8-bit AdamW, Muon, and the [`Optimizer`] enum that picks one from the configuration) and gradient
//! clipping; not the gradients' computation.
mod adafactor;
mod adamw;
mod adamw8bit;
mod clip;
mod muon;
mod optimizer;
mod quant;
mod schedule;
mod sgd;
mod state;

pub use adafactor::{Adafactor, AdafactorConfig, Path as AdafactorPath, SecondMoment};
pub use adamw::{AdamW, AdamWConfig};
pub use adamw8bit::{AdamW8bit, AdamW8bitConfig, Moments, Path as AdamW8bitPath};
pub use clip::{clip_grad_norm, clip_to, scale_all, squared_norm};
pub use muon::{orthogonalise, Muon, MuonConfig};
pub use optimizer::{MuonSettings, Optimizer, OptimizerSpec};
pub use quant::{BLOCK as QUANT_BLOCK, MIN_QUANTISED};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};
