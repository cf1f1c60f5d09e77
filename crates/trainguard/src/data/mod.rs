//! Token corpora and deterministic sampling. Owns where tokens come from (`synthetic`,
//! `text:<path>`, `tokens:<path>`: one file, a directory or glob of shards, or a `prepare`
//! directory; or a weighted mixture of them), the train/validation split and which windows make
//! up any optimizer step's batch.
//! It does not know about micro-batches or devices beyond building the input tensors it is asked
//! for.
pub mod batch;
mod corpus;
pub mod mixture;
pub mod prepare;
mod sampler;
pub mod shards;
pub mod skips;
mod synthetic;

pub use corpus::{Corpus, DataError, Split};
pub use sampler::{mix, Sampler};
