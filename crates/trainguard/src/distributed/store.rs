//! The group's TCPStore as the heartbeats, the writer's fence and the restart rounds use it:
//! where it is, and connections whose every request gives up after a bound.
//!
//! c10d's client waits for an answer without a limit: its timeout bounds connecting and
//! `wait`/`get`, not `add`, `check` or the ping that ends a connect (seen in 2.11 with gdb:
//! blocked in `recv` under `TCPStore::ping` and `TCPStore::incrementValueBy`). Launched without
//! torchrun's agent, rank 0 hosts the store, and a frozen rank 0 (SIGSTOP, a machine that hangs)
//! keeps its socket open: a request to it neither returns nor fails, and its peer would wait
//! forever after the collective that named the problem timed out. c10d does not expose its
//! socket for a receive timeout of our own, so each request runs on a thread of its own and the
//! caller waits for its answer within the bound. A thread that never comes back is left behind
//! holding its connection: that store is then taken as silent and not asked again (each later
//! request fails at once), and the rank ends on the error anyway.
use crate::ffi::dist::Store;
use crate::ffi::ShimError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the group's store at {addr} did not answer within {:.1} s", .within.as_secs_f64())]
    NoAnswer { addr: String, within: Duration },
    #[error(transparent)]
    Shim(#[from] ShimError),
}

/// Where the group's store is and this group's keys in it: each reading or writing thread opens
/// a connection of its own. Once one request went unanswered, all of them know.
#[derive(Debug, Clone)]
pub struct StoreAddress {
    host: String,
    port: u16,
    prefix: String,
    silent: Arc<AtomicBool>,
}

impl StoreAddress {
    pub fn new(host: &str, port: u16, prefix: &str) -> Self {
        Self { host: host.into(), port, prefix: prefix.into(), silent: Arc::default() }
    }

    /// A new connection, made within `within`; each of its requests is bounded by it too.
    pub fn connect(&self, within: Duration) -> Result<BoundedStore, StoreError> {
        let (host, port, prefix) = (self.host.clone(), self.port, self.prefix.clone());
        let ms = within.as_millis() as u64;
        let store = self.bounded(within, move || Store::connect(&host, port, ms, &prefix))?;
        Ok(BoundedStore { store: Arc::new(Mutex::new(store)), address: self.clone(), within })
    }

    /// `request`'s answer if it comes within `within` (from a thread of its own, see above).
    fn bounded<T: Send + 'static>(
        &self,
        within: Duration,
        request: impl FnOnce() -> Result<T, ShimError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let no_answer = || StoreError::NoAnswer { addr: format!("{}:{}", self.host, self.port), within };
        if self.silent.load(Ordering::Relaxed) {
            return Err(no_answer());
        }
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("store-request".into())
            .spawn(move || {
                let _ = tx.send(request());
            })
            .map_err(|e| ShimError::Torch(format!("cannot start a thread for a store request: {e}")))?;
        match rx.recv_timeout(within) {
            Ok(answer) => Ok(answer?),
            Err(_) => {
                self.silent.store(true, Ordering::Relaxed);
                Err(no_answer())
            }
        }
    }
}

/// One connection to the store; each request gives up after the bound it was made with.
pub struct BoundedStore {
    /// Shared with the request's thread, which a request that never returns keeps.
    store: Arc<Mutex<Store>>,
    address: StoreAddress,
    within: Duration,
}

impl BoundedStore {
    /// Adds `delta` to the counter at `key` (0 when missing) and returns the new value; 0 reads.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let (store, key) = (self.store.clone(), key.to_string());
        self.address.bounded(self.within, move || {
            // A poisoned lock is a request that panicked: the connection is still whole.
            let store = store.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            store.add(&key, delta)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts a connection and then never answers, like a frozen rank 0: the
    /// connect gives up within its bound, and a second one at once.
    #[test]
    fn a_store_that_never_answers_is_given_up_on_within_the_bound() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let address = StoreAddress::new("127.0.0.1", port, "test/");
        let t0 = std::time::Instant::now();
        let err = address.connect(Duration::from_millis(500)).err().expect("no answer, no store");
        let waited = t0.elapsed();
        assert!(matches!(err, StoreError::NoAnswer { .. }), "{err}");
        assert!(err.to_string().contains(&format!("127.0.0.1:{port} did not answer within 0.5 s")), "{err}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
        let t1 = std::time::Instant::now();
        assert!(matches!(address.clone().connect(Duration::from_secs(5)), Err(StoreError::NoAnswer { .. })));
        assert!(t1.elapsed() < Duration::from_millis(100), "a silent store is not asked again");
        // Kept open: closing it would reset the abandoned connection, and c10d would log that.
        std::mem::forget(listener);
    }
}
