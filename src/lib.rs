//! trainguard: a training runtime on libtorch whose runs do not die of "CUDA out of memory".
//!
//! Data flows one way: YAML + `--set` → [`config`] → [`run_plan`] → [`train`] → [`events`] → sinks.
pub mod attempts;
pub mod batch;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod created_dirs;
pub mod data;
pub mod deadline;
pub mod determinism;
pub mod dir_lock;
pub mod dist;
pub mod envinfo;
pub mod events;
pub mod exit;
pub mod ffi;
pub mod guard;
pub mod hf;
pub mod interrupt;
pub mod lineage;
pub mod logging;
pub mod memory;
pub mod model;
pub mod optim;
pub mod output;
pub mod path_names;
pub mod run_plan;
pub mod step;
pub mod planner;
pub mod report;
pub mod stop_record;
pub mod trace;
pub mod prepare;
pub mod sample;
pub mod train;
pub mod whole_file;
