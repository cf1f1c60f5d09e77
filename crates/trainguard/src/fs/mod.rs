//! Files and directories written so that a kill never leaves half of one: small files replaced
//! whole ([`whole_file`]), one writer per output directory ([`dir_lock`]) and output directories
//! removed again when the command that made them fails ([`created_dirs`]); and the names of
//! a run directory's files ([`run_files`]).
pub mod created_dirs;
pub mod dir_lock;
pub mod run_files;
pub mod whole_file;
