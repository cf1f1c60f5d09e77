//! A command's answer on standard output. Written whole and flushed; a reader that went away
//! (`trainguard trace … | head -1`) ends the output quietly, and a write that fails otherwise
//! (`> /dev/full`) is an error the caller reports — never `println!`'s panic and backtrace.
use std::io::{ErrorKind, Write};

/// Writes `text` to standard output. Ok when the pipe was closed: there is no one to tell.
pub fn print(text: &str) -> std::io::Result<()> {
    print_part(text).map(|_| ())
}

/// Writes one part of an answer given as it is made (`sample`'s tokens): false once the pipe
/// was closed, so that the maker stops.
pub fn print_part(text: &str) -> std::io::Result<bool> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(false),
        other => other.map(|_| true),
    }
}
