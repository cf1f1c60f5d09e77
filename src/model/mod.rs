//! Models trainguard trains. Owns parameter creation (named, GPT-2 initialisation), the
//! fallible forward pass and the loss; it does not own gradients or optimizer state.
mod gpt;
mod params;

pub use gpt::{cross_entropy, Gpt, ParamGroups};
pub use params::Params;
