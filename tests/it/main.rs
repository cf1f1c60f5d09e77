//! The integration tests, in one binary (one link against libtorch): each module runs the real
//! `trainguard` binary or the library's public API. Shared helpers live in [`common`] (running the
//! binary in a fresh directory, reading its files) and [`support`] (test data builders).
mod common;
mod support;

mod background_checkpoint;
mod checkpoint;
mod cluster;
mod determinism;
mod dist;
mod divergence;
mod doc_commands;
mod document_mask;
mod eval;
mod generated_configs;
mod gpu;
mod hf;
mod hung_rank;
mod llama;
mod mixture;
mod notify;
mod oom;
mod optimizers;
mod paths;
mod plan;
mod plan_sharding;
mod prepare;
mod reference;
mod report;
mod savers;
mod scripts;
mod sharding;
mod telemetry;
mod train;
mod untrusted;
mod vocab;
