//! The group's TCPStore as the heartbeats, the writer's fence and the restart rounds use it:
//! where it is, and connections whose every request gives up after a bound.
//!
//! c10d's client waits for an answer without a limit: its timeout bounds connecting and
//! `wait`/`get`, not `add`, `check` or the ping that ends a connect (seen in 2.11 with gdb:
//! blocked in `recv` under `TCPStore::ping` and `TCPStore::incrementValueBy`). Launched without
//! torchrun's agent, rank 0 hosts the store, and a frozen rank 0 (SIGSTOP, a machine that hangs)
//! keeps its socket open: a request to it neither returns nor fails, and its peer would wait
//! forever after the collective that named the problem timed out. c10d does not expose its
//! socket for a receive timeout of our own, so each connection's requests run on a thread of its
//! own and the caller waits for each answer within the bound. A thread that never comes back is
//! left behind holding its connection: that store is then taken as silent and not asked again
//! (each later request fails at once), and the rank ends on the error anyway.
use crate::ffi::dist::Store;
use crate::ffi::ShimError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
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

    fn no_answer(&self, within: Duration) -> StoreError {
        StoreError::NoAnswer { addr: format!("{}:{}", self.host, self.port), within }
    }

    /// What `receive` brings within `within`; past it the store is taken as silent.
    fn answer<T>(
        &self,
        receive: &mpsc::Receiver<Result<T, ShimError>>,
        within: Duration,
    ) -> Result<T, StoreError> {
        match receive.recv_timeout(within) {
            Ok(answer) => Ok(answer?),
            Err(_) => {
                self.silent.store(true, Ordering::Relaxed);
                Err(self.no_answer(within))
            }
        }
    }

    /// A new connection, made within `within`, on a thread of its own that then serves each of
    /// its requests, which are bounded by `within` too. One thread for the connection's life,
    /// not one per request: under a CPU `memory.limit` (an address-space cap) a stack mapped
    /// for every heartbeat would come and go in the middle of a step and fail its allocations
    /// at random.
    pub fn connect(&self, within: Duration) -> Result<BoundedStore, StoreError> {
        if self.silent.load(Ordering::Relaxed) {
            return Err(self.no_answer(within));
        }
        let (host, port, prefix) = (self.host.clone(), self.port, self.prefix.clone());
        let ms = within.as_millis() as u64;
        let (requests, incoming) = mpsc::channel::<Request>();
        let (ready, connected) = mpsc::channel();
        std::thread::Builder::new()
            .name("store-client".into())
            .spawn(move || {
                let store = match Store::connect(&host, port, ms, &prefix) {
                    Ok(store) => store,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(()));
                for request in incoming {
                    request(&store);
                }
            })
            .map_err(|e| ShimError::Torch(format!("cannot start a thread for the store's client: {e}")))?;
        self.answer(&connected, within)?;
        Ok(BoundedStore { requests, address: self.clone(), within })
    }
}

/// A request the connection's thread runs against its store.
type Request = Box<dyn FnOnce(&Store) + Send>;

/// One connection to the store; each request gives up after the bound it was made with.
pub struct BoundedStore {
    /// To the thread that holds the connection (a request that never returns keeps it).
    requests: mpsc::Sender<Request>,
    address: StoreAddress,
    within: Duration,
}

impl BoundedStore {
    /// Adds `delta` to the counter at `key` (0 when missing) and returns the new value; 0 reads.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        if self.address.silent.load(Ordering::Relaxed) {
            return Err(self.address.no_answer(self.within));
        }
        let (reply, answer) = mpsc::channel();
        let key = key.to_string();
        let request: Request = Box::new(move |store: &Store| {
            let _ = reply.send(store.add(&key, delta));
        });
        // A send fails only once the thread has ended, which it does only after a failed connect.
        self.requests.send(request).map_err(|_| self.address.no_answer(self.within))?;
        self.address.answer(&answer, self.within)
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
