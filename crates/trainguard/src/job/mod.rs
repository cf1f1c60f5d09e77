//! The life of a job around the training loop: torchrun's attempts and what a restart does
//! ([`attempts`]), the wall-clock deadline a whole job shares ([`deadline`]), the record of how a
//! run stopped for the job script ([`stop_record`]), signals ([`interrupt`]) and the exit codes
//! a script branches on ([`exit`]).
pub mod attempts;
pub mod deadline;
pub mod exit;
pub mod interrupt;
pub mod stop_record;
