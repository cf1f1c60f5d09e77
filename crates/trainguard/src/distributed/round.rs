//! Which attempt's group a rank joins. Under torchrun's agent the TCPStore outlives a restart,
//! so the group's keys need a namespace that every rank of this attempt shares and no earlier
//! attempt used. `TORCHELASTIC_RESTART_COUNT` is not one on several nodes: it is per agent, and
//! after a worker fails on one node torchrun restarts another node's healthy workers with their
//! count unchanged. Namespaced by their counts, such ranks never met: each waited for the other
//! until the join timed out, and a restart was spent (seen with two agents on one machine).
//!
//! Instead the ranks agree on rank 0's nonce through the store. Each rank says hello with a
//! nonce of its own; rank 0 writes the attempt's id (its nonce) and then, for each rank, the
//! nonce it read there, until every rank has acknowledged its id. A rank takes the id once it
//! finds its own nonce written back: only this attempt's rank 0 can have written it, after the
//! id. Keys an earlier attempt left hold other nonces and are overwritten.
//!
//! The same store carries the job's deadline for `train.max_duration` ([`crate::job::deadline`]):
//! before it writes the id, rank 0 sets it when no earlier attempt has, and every rank reads it
//! once it has the id. Kept in the store it outlives the restarts of one launch, and only
//! those: a new launch (a requeued SLURM job under the same id) gets a new store and a new
//! budget. Restart counts cannot tell the two apart on several nodes (above).
//!
//! Pure over [`Counters`]: the store's atomic add, which is all the shim's client offers.
use std::time::{Duration, Instant};

/// A store of counters: `add` returns the value after adding (0 for a missing key).
pub trait Counters {
    fn add(&self, key: &str, delta: i64) -> Result<i64, String>;
}

/// Each request bounded by `dist.timeout_s`, like the agreement as a whole.
impl Counters for super::store::BoundedStore {
    fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
        super::store::BoundedStore::add(self, key, delta).map_err(|e| e.to_string())
    }
}

fn get(s: &impl Counters, key: &str) -> Result<i64, String> {
    s.add(key, 0)
}

/// Sets `key` to `value`; each key here has one writer, so read-then-add is enough.
fn set(s: &impl Counters, key: &str, value: i64) -> Result<(), String> {
    let now = get(s, key)?;
    if now != value {
        s.add(key, value - now)?;
    }
    Ok(())
}

/// A nonce no other process is likely to draw: positive, nonzero, below 2^62 (so that the
/// difference of two fits an i64).
pub fn nonce() -> i64 {
    use std::hash::BuildHasher;
    let hash = std::collections::hash_map::RandomState::new()
        .hash_one((std::process::id(), std::time::SystemTime::now()));
    (hash >> 2) as i64 | 1
}

const POLL: Duration = Duration::from_millis(20);

/// What the ranks of an attempt agree on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreed {
    /// This attempt's id (its rank 0's nonce): the namespace of its group's keys.
    pub id: i64,
    /// The job's deadline, if an attempt with a time limit set it.
    pub deadline: Option<JobDeadline>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobDeadline {
    pub unix_ms: i64,
    /// Set by an earlier attempt of this launch: this one is a restart and gets what is left.
    pub earlier: bool,
}

/// This attempt's id and the job's deadline, agreed by `world` ranks; an error names who did
/// not answer by `give_up`. `deadline_ms`, rank 0's own deadline (its start + the limit), is
/// the job's when no earlier attempt set one; other ranks' is not read.
pub fn agree(
    store: &impl Counters,
    rank: usize,
    world: usize,
    own: i64,
    deadline_ms: Option<i64>,
    give_up: Instant,
) -> Result<Agreed, String> {
    set(store, &format!("hello/{rank}"), own)?;
    if rank != 0 {
        loop {
            if get(store, &format!("round/{rank}"))? == own {
                let id = get(store, "round/id")?;
                set(store, &format!("ack/{rank}"), id)?;
                return Ok(Agreed { id, deadline: job_deadline(store, id)? });
            }
            if Instant::now() >= give_up {
                return Err("timeout: rank 0 of this attempt did not answer".into());
            }
            std::thread::sleep(POLL);
        }
    }
    // Set once per launch, by one rank 0 at a time: attempts do not overlap.
    if let Some(ms) = deadline_ms {
        if get(store, DEADLINE)? == 0 {
            set(store, DEADLINE, ms)?;
            set(store, DEADLINE_BY, own)?;
        }
    }
    let agreed = Agreed { id: own, deadline: job_deadline(store, own)? };
    set(store, "round/id", own)?;
    loop {
        let mut missing = Vec::new();
        for r in 1..world {
            let hello = get(store, &format!("hello/{r}"))?;
            if hello != 0 {
                set(store, &format!("round/{r}"), hello)?;
            }
            if get(store, &format!("ack/{r}"))? != own {
                missing.push(r);
            }
        }
        if missing.is_empty() {
            return Ok(agreed);
        }
        if Instant::now() >= give_up {
            return Err(format!("timeout: rank(s) {missing:?} of this attempt did not answer"));
        }
        std::thread::sleep(POLL);
    }
}

const DEADLINE: &str = "job/deadline-ms";
const DEADLINE_BY: &str = "job/deadline-set-by";

fn job_deadline(store: &impl Counters, id: i64) -> Result<Option<JobDeadline>, String> {
    let unix_ms = get(store, DEADLINE)?;
    Ok((unix_ms != 0).then_some(JobDeadline { unix_ms, earlier: get(store, DEADLINE_BY)? != id }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    #[derive(Default, Clone)]
    struct Memory(Arc<Mutex<HashMap<String, i64>>>);

    impl Counters for Memory {
        fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
            let mut m = self.0.lock().unwrap();
            let v = m.entry(key.to_string()).or_insert(0);
            *v += delta;
            Ok(*v)
        }
    }

    /// An earlier attempt's keys are all there (its hellos, the nonces rank 0 wrote back, its
    /// id, the acks); three ranks of a new attempt start at different times and agree on the new
    /// rank 0's nonce.
    #[test]
    fn ranks_agree_on_this_attempts_id_over_an_earlier_attempts_keys() {
        let store = Memory::default();
        for (k, v) in [
            ("hello/1", 11),
            ("hello/2", 12),
            ("round/1", 11),
            ("round/2", 12),
            ("round/id", 10),
            ("ack/1", 10),
            ("ack/2", 10),
        ] {
            store.add(k, v).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let ranks: Vec<_> = [(2, 202, 0), (0, 200, 60), (1, 201, 120)]
            .into_iter()
            .map(|(rank, own, delay_ms)| {
                let s = store.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(delay_ms));
                    agree(&s, rank, 3, own, None, deadline).map(|a| a.id)
                })
            })
            .collect();
        let ids: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(ids, [Ok(200), Ok(200), Ok(200)]);
    }

    /// Two ranks, each its own thread; rank 0 proposes `deadline_ms` (rank 1's proposal is
    /// not read).
    fn attempt(store: &Memory, ids: [i64; 2], deadline_ms: Option<i64>) -> [Agreed; 2] {
        let give_up = Instant::now() + Duration::from_secs(20);
        let ranks: Vec<_> = [0, 1]
            .map(|rank| {
                let s = store.clone();
                std::thread::spawn(move || {
                    agree(&s, rank, 2, ids[rank], deadline_ms.map(|ms| ms + rank as i64), give_up).unwrap()
                })
            })
            .into();
        let agreed: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        [agreed[0], agreed[1]]
    }

    /// The first attempt's rank 0 sets the job's deadline; a restart's, proposing its own
    /// later one, gets the first; a new launch (a new store) sets its own.
    #[test]
    fn every_attempt_of_a_launch_keeps_the_deadline_its_first_attempt_set() {
        let store = Memory::default();
        let first = attempt(&store, [10, 11], Some(5_000));
        let set = Some(JobDeadline { unix_ms: 5_000, earlier: false });
        assert_eq!(first.map(|a| (a.id, a.deadline)), [(10, set), (10, set)]);
        let restart = attempt(&store, [20, 21], Some(9_000));
        let kept = Some(JobDeadline { unix_ms: 5_000, earlier: true });
        assert_eq!(restart.map(|a| (a.id, a.deadline)), [(20, kept), (20, kept)]);
        let without = attempt(&store, [30, 31], None);
        assert_eq!(
            without.map(|a| a.deadline),
            [kept, kept],
            "an attempt with no limit of its own still reads the job's"
        );
        let launch = attempt(&Memory::default(), [40, 41], Some(9_000));
        assert_eq!(launch.map(|a| a.deadline), [Some(JobDeadline { unix_ms: 9_000, earlier: false }); 2]);
        assert_eq!(attempt(&Memory::default(), [50, 51], None).map(|a| a.deadline), [None, None]);
    }

    #[test]
    fn a_rank_alone_times_out_naming_who_did_not_answer() {
        let store = Memory::default();
        let soon = Instant::now() + Duration::from_millis(100);
        let err = agree(&store, 0, 3, 5, None, soon).unwrap_err();
        assert!(err.contains("timeout") && err.contains("[1, 2]"), "{err}");
        // An earlier attempt's id is not taken: rank 1 waits for its own nonce written back.
        store.add("round/1", 7).unwrap();
        let err = agree(&store, 1, 3, 8, None, Instant::now() + Duration::from_millis(100)).unwrap_err();
        assert!(err.contains("rank 0 of this attempt did not answer"), "{err}");
    }

    #[test]
    fn nonces_are_positive_and_differ() {
        let (a, b) = (nonce(), nonce());
        assert!(a > 0 && b > 0 && a != b && a < 1 << 62);
    }
}
