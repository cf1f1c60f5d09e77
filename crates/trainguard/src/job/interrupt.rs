//! Stopping a run from outside without a panic: SIGINT/SIGTERM set a flag that the training loop
//! reads between steps (it then checkpoints and exits with the "interrupted" code); a second
//! signal exits at once.
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// The bit [`Interrupter::request`] sets; the bits below count signals.
const REQUESTED_BY_CODE: u32 = 1 << 31;

#[derive(Debug, Clone, Default)]
pub struct Interrupter(Arc<AtomicU32>);

impl Interrupter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes SIGINT and SIGTERM here (ctrlc's `termination` feature), saying `first`. A
    /// second signal says `then` and exits at once with the code `second` returns, after
    /// whatever it does (the stop record).
    pub fn install_signal_handler(
        &self,
        first: &'static str,
        then: &'static str,
        second: impl Fn() -> i32 + Send + 'static,
    ) -> Result<(), ctrlc::Error> {
        let count = self.0.clone();
        ctrlc::set_handler(move || {
            if count.fetch_add(1, Ordering::SeqCst) & !REQUESTED_BY_CODE >= 1 {
                crate::console::logging::to_stderr(&format!("second signal: exiting now; {then}"));
                let code = second();
                // Not `exit`: it runs libtorch's static destructors on this thread while the
                // main thread may be inside libtorch (autograd, a kernel), which then crashed
                // (SIGSEGV, exit 139, which torchrun takes for a failure).
                crate::ffi::os::exit_now(code);
            }
            crate::console::logging::to_stderr(&format!(
                "signal received: {first} (send it again to exit at once)"
            ));
        })
    }

    /// A stop asked for by the run itself (`faults.interrupt_at_step`): not a signal, so a
    /// real one after it is still the first.
    pub fn request(&self) {
        self.0.fetch_or(REQUESTED_BY_CODE, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst) > 0
    }
}
