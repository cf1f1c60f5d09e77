//! Naming the rank that went silent. Gloo's timeout says only that a collective timed out; so
//! each rank's background thread adds 1 to its counter `heartbeat/<rank>` in the group's
//! TCPStore (a connection of its own) every `period`. When a collective fails, the ranks whose
//! counter does not move over a few periods are the silent ones: a process that is stopped,
//! killed or whose machine froze. A rank that is alive but stuck (a long step, a hung kernel)
//! keeps beating and is not named. Counters, not clocks: machines' clocks need not agree.
//! Every read and write of the store is bounded in time ([`super::store`]): launched without
//! torchrun's agent, rank 0 hosts the store, and a frozen rank 0 answers nothing.
use super::store::{BoundedStore, StoreAddress, StoreError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct Heartbeat {
    stop: Arc<AtomicBool>,
    store: StoreAddress,
    /// Launched without torchrun's agent: the store lives in rank 0's process, and goes silent
    /// or away with it.
    rank0_hosts_store: bool,
    rank: usize,
    world: usize,
    period: Duration,
    /// `dist.timeout_s`: how long a wait at the fence goes before it says so.
    timeout: Duration,
}

fn key(rank: usize) -> String {
    format!("heartbeat/{rank}")
}

/// The fence's count in the store: rank 0 adds 1 each time its work alone is done.
const FENCE_KEY: &str = "writer-done";

fn stopped_key(rank: usize) -> String {
    format!("stopped-by-signal/{rank}")
}

/// What a rank that ends at once on a second signal leaves in the group's store first: its
/// peers' next collective then fails, and they read here that it was a planned stop, not a
/// crash (torchrun would restart the group the person stopped).
#[derive(Debug, Clone)]
pub struct StopNotice {
    store: StoreAddress,
    rank: usize,
}

/// How long a best-effort request waits for the store: a notice on the way out, a diagnosis.
const BEST_EFFORT: Duration = Duration::from_secs(2);

impl StopNotice {
    /// Best effort, within 2 s each to connect and to add: the process exits right after,
    /// whatever the store says.
    pub fn announce(&self) {
        if let Ok(store) = self.store.connect(BEST_EFFORT) {
            let _ = store.add(&stopped_key(self.rank), 1);
        }
    }
}

/// Beat period for a collective timeout: a twentieth of it, between 0.1 s and 1 s (so the
/// check after a failure takes at most 3 s).
pub fn period_for(timeout_s: u64) -> Duration {
    Duration::from_millis((timeout_s * 1000 / 20).clamp(100, 1000))
}

impl Heartbeat {
    /// Starts this rank's beating thread (the store at `address`; `rank0_hosts_store` without
    /// torchrun's agent).
    pub fn start(
        address: StoreAddress,
        rank0_hosts_store: bool,
        rank: usize,
        world: usize,
        timeout_s: u64,
    ) -> Result<Self, StoreError> {
        let (period, timeout) = (period_for(timeout_s), Duration::from_secs(timeout_s.max(1)));
        let store = address.connect(timeout)?;
        store.add(&key(rank), 1)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(period);
                    if store.add(&key(rank), 1).is_err() {
                        return; // the store is gone or silent: nothing left to tell
                    }
                }
            })
            .map_err(|e| crate::ffi::ShimError::Torch(format!("cannot start the heartbeat thread: {e}")))?;
        Ok(Self { stop, store: address, rank0_hosts_store, rank, world, period, timeout })
    }

    pub fn stop_notice(&self) -> StopNotice {
        StopNotice { store: self.store.clone(), rank: self.rank }
    }

    /// The ranks that announced a stop on a second signal ([`StopNotice`]); none when the store
    /// is gone with them (rank 0 hosted it, without torchrun's agent).
    pub fn stopped_by_signal(&self) -> Vec<usize> {
        let Ok(store) = self.store.connect(BEST_EFFORT) else { return vec![] };
        (0..self.world).filter(|&r| store.add(&stopped_key(r), 0).is_ok_and(|n| n > 0)).collect()
    }

    /// Ranks whose heartbeat did not move over three periods, read through a new connection.
    pub fn silent_ranks(&self) -> Result<Vec<usize>, StoreError> {
        let store = self.store.connect(BEST_EFFORT)?;
        let read = |store: &BoundedStore| {
            (0..self.world).map(|r| store.add(&key(r), 0)).collect::<Result<Vec<i64>, _>>()
        };
        let before = read(&store)?;
        std::thread::sleep(self.period * 3);
        let after = read(&store)?;
        Ok(silent(&before, &after))
    }

    /// Rank 0's work alone (a checkpoint, the final weights) takes as long as its storage does;
    /// a collective waiting for it is bounded by `dist.timeout_s`, and a slow disk would end the
    /// job. So each rank passes this fence after it instead: rank 0 counts `writer-done` up;
    /// the others wait for the `n`-th count for as long as rank 0's heartbeat moves (its beats
    /// come from a thread of their own), and fail once it stands still for three periods. A
    /// write that hangs with rank 0 alive holds them here, so every `dist.timeout_s` they say
    /// how long they have waited: the job's log shows where it stands, not silence. With
    /// `writer_wait` (`dist.writer_wait_s`) they wait that long at most, then fail. Each read
    /// of the store gives up after `dist.timeout_s`.
    pub fn fence(&self, n: u64, writer_wait: Option<Duration>) -> Result<(), String> {
        if self.rank == 0 {
            let store = self.store.connect(self.timeout).map_err(|e| e.to_string())?;
            return store.add(FENCE_KEY, 1).map(|_| ()).map_err(|e| e.to_string());
        }
        // Without torchrun's agent rank 0 hosts the store: its end takes the store with it, and
        // a frozen rank 0 leaves it silent.
        let gone = |e: StoreError| {
            format!(
                "rank 0 stopped answering while it wrote alone (the store is unreachable: {})",
                e.to_string().lines().next().unwrap_or_default()
            )
        };
        let store = self.store.connect(self.timeout).map_err(gone)?;
        let (mut beat, mut moved, mut pause) =
            (store.add(&key(0), 0).map_err(gone)?, std::time::Instant::now(), Duration::from_millis(1));
        let (since, mut notices) = (std::time::Instant::now(), 0u32);
        loop {
            if store.add(FENCE_KEY, 0).map_err(gone)? >= n as i64 {
                return Ok(());
            }
            if let Some(most) = writer_wait.filter(|most| since.elapsed() >= *most) {
                return Err(format!(
                    "rank 0 is still writing alone (a checkpoint or the final weights) after {} s, dist.writer_wait_s: it is alive (its heartbeat moves), so its storage is slow or the write hangs; ending the job so that a restart resumes from the last complete checkpoint",
                    most.as_secs()
                ));
            }
            if since.elapsed() >= self.timeout * (notices + 1) {
                // Whole timeouts waited, so a stall past several says one notice, not a burst.
                notices = (since.elapsed().as_secs_f64() / self.timeout.as_secs_f64()) as u32;
                tracing::warn!(
                    "waiting {} s for rank 0 to finish writing alone (a checkpoint or the final weights), longer than dist.timeout_s = {}: rank 0 is alive (its heartbeat moves), so its storage is slow or the write hangs; rank 0's log says which",
                    (self.timeout * notices).as_secs(),
                    self.timeout.as_secs()
                );
            }
            let now = store.add(&key(0), 0).map_err(gone)?;
            if now != beat {
                (beat, moved) = (now, std::time::Instant::now());
            } else if moved.elapsed() > self.period * 3 {
                return Err(format!(
                    "rank 0 stopped answering while it wrote alone (heartbeat not moving for {:.1} s)",
                    moved.elapsed().as_secs_f64()
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(self.period / 2);
        }
    }

    /// A sentence for an error message: who went silent, or that every rank is alive.
    pub fn diagnosis(&self) -> String {
        match self.silent_ranks() {
            Ok(r) if r.is_empty() => {
                "every rank's heartbeat is alive: a rank is slow or stuck inside a step, not gone".into()
            }
            Ok(r) => {
                let names: Vec<String> = r.iter().map(|r| format!("rank {r}")).collect();
                format!(
                    "{} stopped answering (heartbeat not moving for {:.1} s)",
                    names.join(", "),
                    (self.period * 3).as_secs_f64()
                )
            }
            // The store lives in rank 0's process: unreachable or silent, rank 0 is gone or frozen.
            Err(e) if self.rank0_hosts_store => format!(
                "rank 0 stopped answering (it hosts the group's store: {})",
                e.to_string().lines().next().unwrap_or_default()
            ),
            Err(e) => format!(
                "which rank went silent is unknown (heartbeats unreadable: {})",
                e.to_string().lines().next().unwrap_or_default()
            ),
        }
    }
}

/// Ranks whose counter did not move between two readings.
fn silent(before: &[i64], after: &[i64]) -> Vec<usize> {
    before.iter().zip(after).enumerate().filter(|(_, (b, a))| a <= b).map(|(r, _)| r).collect()
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        // Not joined: a beat blocked on a dead store must not hold up the exit.
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_whose_counter_stood_still_are_silent() {
        assert_eq!(silent(&[10, 7, 3], &[13, 7, 5]), [1]);
        assert!(silent(&[1, 1], &[2, 2]).is_empty());
        assert_eq!(period_for(5), Duration::from_millis(250));
        assert_eq!(period_for(300), Duration::from_secs(1));
        assert_eq!(period_for(1), Duration::from_millis(100));
    }
}
