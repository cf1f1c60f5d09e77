//! Builders of test inputs that several modules share.
pub mod tokenizer;
