//! trainguard: a training runtime on libtorch whose runs do not die of "CUDA out of memory".
//!
//! Data flows one way: YAML + `--set` → [`config`] → [`run_plan`] → [`train`] → [`events`] → sinks.
//! Every raw libtorch and OS call goes through `trainguard-sys` ([`ffi`]), the one crate allowed
//! to make them.
#![forbid(unsafe_code)]

pub use trainguard_sys as ffi;
pub mod checkpoint;
pub mod config;
pub mod console;
pub mod data;
pub mod determinism;
pub mod distributed;
pub mod divergence;
pub mod envinfo;
pub mod eval;
pub mod events;
pub mod fs;
pub mod guard;
pub mod hf;
pub mod job;
pub mod memory;
pub mod model;
pub mod notify;
pub mod optim;
pub mod planner;
pub mod report;
pub mod run_plan;
pub mod sample;
pub mod step;
pub mod trace;
pub mod train;
