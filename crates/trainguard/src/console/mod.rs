//! What a person reads: human logs on stderr and in `train.log` ([`logging`]), a command's
//! answer on stdout ([`output`]) and short names for paths shown side by side ([`path_names`]).
pub mod logging;
pub mod output;
pub mod path_names;
