//! What the guard does next, as a pure state machine over micro-batch sizes.
//!
//! - Out of memory at size m: retry at ⌈m/2⌉, never below the floor; at the floor, give up.
//! - Regrow (optional): after `regrow_after` clean steps below the configured size, bisect
//!   between the size that works and the smallest size that failed (the configured size + 1 when
//!   none has), so the guard settles on the largest size that fits, not on a power-of-two
//!   fraction of the configured one. An OOM on a trial backs off to the size that worked and
//!   blocks the failed size for `regrow_after · 2^failures` steps; a size next to the working one
//!   (nothing left to bisect) is retried only once its block has run out, so repeated failures
//!   at one size are tried ever more rarely (no oscillation). An OOM later at a size a trial
//!   reached steps back down the sizes regrow climbed, one at a time (a size at the edge of what
//!   fits can pass a few batches and fail on the next), and halves only below them.
//! - What regrow has learnt (clean steps so far, blocked sizes) is [`RegrowMemory`]: checkpoints
//!   keep it, so a resumed run does not retry at once a size that failed before the restart.
pub use crate::checkpoint::state::{BlockedSize, RegrowMemory};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Replay the step at this micro-batch. `backoff`: it is a regrow trial being undone.
    Retry {
        micro_batch: usize,
        backoff: bool,
    },
    /// At the floor: replay with the next memory saver switched on (`level` savers on now).
    Escalate {
        level: usize,
    },
    GiveUp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardState {
    configured: usize,
    floor: usize,
    current: usize,
    regrow_after: u64,
    clean_steps: u64,
    /// The sizes regrow climbed from, lowest first: an OOM at a size a trial reached (during
    /// the trial or any step after) steps down one rung instead of halving.
    ladder: Vec<usize>,
    blocked: Vec<BlockedSize>,
    /// Memory savers the guard may switch on at the floor, and how many are on.
    escalations: usize,
    level: usize,
}

impl GuardState {
    pub fn new(configured: usize, floor: usize, regrow_after: u64) -> Self {
        let floor = floor.clamp(1, configured.max(1));
        Self {
            configured,
            floor,
            current: configured,
            regrow_after,
            clean_steps: 0,
            ladder: Vec::new(),
            blocked: Vec::new(),
            escalations: 0,
            level: 0,
        }
    }

    /// Allows `n` escalation steps (oom.escalate) before giving up at the floor.
    pub fn with_escalations(mut self, n: usize) -> Self {
        self.escalations = n;
        self
    }

    /// Escalation steps taken (restored from a checkpoint with [`with_level`](Self::with_level)).
    pub fn level(&self) -> usize {
        self.level
    }

    pub fn with_level(mut self, level: usize) -> Self {
        self.level = level.min(self.escalations);
        self
    }

    /// Starts from a micro-batch settled on earlier (e.g. restored from a checkpoint).
    pub fn with_current(mut self, current: usize) -> Self {
        self.current = current.clamp(self.floor, self.configured);
        self
    }

    pub fn current(&self) -> usize {
        self.current
    }

    /// What a checkpoint keeps of the regrow rule (restore with
    /// [`with_regrow_memory`](Self::with_regrow_memory)).
    pub fn regrow_memory(&self) -> RegrowMemory {
        RegrowMemory {
            clean_steps: self.clean_steps,
            blocked: self.blocked.clone(),
            ladder: self.ladder.clone(),
        }
    }

    pub fn with_regrow_memory(mut self, memory: RegrowMemory) -> Self {
        self.clean_steps = memory.clean_steps;
        self.blocked = memory.blocked;
        self.ladder = memory.ladder.into_iter().filter(|&f| f < self.current).collect();
        self
    }

    pub fn configured(&self) -> usize {
        self.configured
    }

    /// Before step `step`: returns the new size if a regrow trial starts.
    pub fn begin_step(&mut self, step: u64) -> Option<usize> {
        if self.regrow_after == 0 || self.current >= self.configured || self.clean_steps < self.regrow_after {
            return None;
        }
        let candidate = self.regrow_candidate(step)?;
        self.ladder.push(self.current);
        self.current = candidate;
        self.clean_steps = 0;
        Some(candidate)
    }

    /// The next size to try above the working one: halfway to the smallest size that failed
    /// (the configured size + 1 when none has); that failed size itself once nothing lies
    /// between and its block has run out.
    fn regrow_candidate(&self, step: u64) -> Option<usize> {
        let lowest_failed =
            self.blocked.iter().filter(|b| b.micro_batch > self.current).min_by_key(|b| b.micro_batch);
        let ceiling = lowest_failed.map_or(self.configured + 1, |b| b.micro_batch.min(self.configured + 1));
        let candidate = self.current + (ceiling - self.current) / 2;
        if candidate > self.current {
            return Some(candidate);
        }
        lowest_failed
            .filter(|b| b.micro_batch <= self.configured && step >= b.until_step)
            .map(|b| b.micro_batch)
    }

    /// Whether [`on_oom`](Self::on_oom) would give up now: no rung to step down to, at the
    /// floor, every escalation spent. Peers are told before they agree on an attempt.
    pub fn gives_up_on_oom(&self) -> bool {
        !self.ladder.iter().any(|&p| p < self.current)
            && self.current <= self.floor
            && self.level >= self.escalations
    }

    pub fn on_success(&mut self) {
        self.clean_steps += 1;
    }

    pub fn on_oom(&mut self, step: u64) -> Decision {
        let failed = self.current;
        self.clean_steps = 0;
        self.ladder.retain(|&p| p < failed);
        if let Some(prev) = self.ladder.pop() {
            self.block(failed, step);
            self.current = prev;
            return Decision::Retry { micro_batch: prev, backoff: true };
        }
        if failed <= self.floor {
            if self.level < self.escalations {
                self.level += 1;
                return Decision::Escalate { level: self.level };
            }
            return Decision::GiveUp;
        }
        self.block(failed, step);
        self.current = failed.div_ceil(2).max(self.floor);
        Decision::Retry { micro_batch: self.current, backoff: false }
    }

    /// Halves the micro-batch ahead of an out-of-memory (allocator thrashing); `None` at the
    /// floor.
    pub fn shrink(&mut self, step: u64) -> Option<usize> {
        if self.current <= self.floor {
            return None;
        }
        self.block(self.current, step);
        self.current = self.current.div_ceil(2).max(self.floor);
        self.clean_steps = 0;
        Some(self.current)
    }

    fn block(&mut self, size: usize, step: u64) {
        let i = match self.blocked.iter().position(|b| b.micro_batch == size) {
            Some(i) => i,
            None => {
                self.blocked.push(BlockedSize { micro_batch: size, until_step: 0, failures: 0 });
                self.blocked.len() - 1
            }
        };
        let b = &mut self.blocked[i];
        b.failures += 1;
        b.until_step = step.saturating_add(self.regrow_after.saturating_mul(1u64 << b.failures.min(20)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What peers are told before an attempt matches what `on_oom` then decides.
    #[test]
    fn gives_up_on_oom_foretells_on_oom() {
        for (configured, floor, escalations) in [(64, 1, 0), (8, 8, 0), (16, 4, 2), (5, 2, 1)] {
            let mut s = GuardState::new(configured, floor, 0).with_escalations(escalations);
            loop {
                let foretold = s.gives_up_on_oom();
                let decision = s.on_oom(0);
                assert_eq!(
                    foretold,
                    decision == Decision::GiveUp,
                    "{configured} {floor} {escalations}: {decision:?}"
                );
                if foretold {
                    break;
                }
            }
        }
        // A regrow trial that fails steps back down a rung, even at a floor-sized ladder.
        let mut s = GuardState::new(8, 2, 1);
        s.on_oom(0);
        s.on_oom(0);
        assert_eq!(s.current(), 2);
        s.on_success();
        assert_eq!(s.begin_step(5), Some(3));
        assert!(!s.gives_up_on_oom());
    }

    #[test]
    fn halves_down_to_the_floor_then_gives_up() {
        let mut s = GuardState::new(64, 1, 0);
        let mut seen = vec![];
        while let Decision::Retry { micro_batch, .. } = s.on_oom(0) {
            seen.push(micro_batch);
        }
        assert_eq!(seen, [32, 16, 8, 4, 2, 1]);
        let mut s = GuardState::new(24, 4, 0);
        assert_eq!(s.on_oom(0), Decision::Retry { micro_batch: 12, backoff: false });
        assert_eq!(s.on_oom(0), Decision::Retry { micro_batch: 6, backoff: false });
        assert_eq!(s.on_oom(0), Decision::Retry { micro_batch: 4, backoff: false });
        assert_eq!(s.on_oom(0), Decision::GiveUp);
    }

    #[test]
    fn at_the_floor_escalations_come_before_giving_up() {
        let mut s = GuardState::new(2, 1, 0).with_escalations(2);
        assert_eq!(s.on_oom(0), Decision::Retry { micro_batch: 1, backoff: false });
        assert_eq!(s.on_oom(0), Decision::Escalate { level: 1 });
        assert_eq!(s.on_oom(0), Decision::Escalate { level: 2 });
        assert_eq!(s.on_oom(0), Decision::GiveUp);
        assert_eq!((s.current(), s.level()), (1, 2));
    }

    #[test]
    fn without_regrow_the_size_never_grows() {
        let mut s = GuardState::new(32, 1, 0);
        s.on_oom(0);
        for step in 1..100 {
            assert_eq!(s.begin_step(step), None);
            s.on_success();
        }
        assert_eq!(s.current(), 16);
    }

    /// Memory fits up to `fits`; configured `configured`, regrow after 5 clean steps. Returns
    /// the (step, size) of every regrow trial.
    fn simulate_fitting(configured: usize, fits: usize, steps: u64) -> (Vec<(u64, usize)>, GuardState) {
        let mut s = GuardState::new(configured, 1, 5);
        let mut trials = vec![];
        for step in 0..steps {
            if let Some(size) = s.begin_step(step) {
                trials.push((step, size));
            }
            while s.current() > fits {
                assert!(matches!(s.on_oom(step), Decision::Retry { .. }));
            }
            s.on_success();
        }
        (trials, s)
    }

    fn simulate(steps: u64) -> (Vec<u64>, GuardState) {
        let (trials, s) = simulate_fitting(32, 16, steps);
        (trials.into_iter().map(|(step, _)| step).collect(), s)
    }

    #[test]
    fn regrow_bisects_to_the_largest_size_that_fits() {
        let (trials, s) = simulate_fitting(64, 40, 100);
        assert_eq!(s.current(), 40, "not 32: {trials:?}");
        let sizes: Vec<usize> = trials.iter().map(|t| t.1).collect();
        assert_eq!(sizes[..5], [48, 40, 44, 42, 41], "halfway to the smallest failure each time");
        let (_, odd) = simulate_fitting(100, 77, 200);
        assert_eq!(odd.current(), 77);
    }

    #[test]
    fn regrow_retries_then_backs_off_ever_more_rarely() {
        let (trials, s) = simulate_fitting(32, 16, 400);
        assert_eq!(s.current(), 16);
        let sizes: Vec<usize> = trials.iter().map(|t| t.1).collect();
        assert_eq!(sizes[..4], [24, 20, 18, 17], "bisection first");
        // Then only the size next to the working one, ever more rarely.
        let retries: Vec<u64> = trials[4..]
            .iter()
            .map(|t| {
                assert_eq!(t.1, 17);
                t.0
            })
            .collect();
        assert!(retries.len() >= 2, "regrow must try again: {trials:?}");
        let gaps: Vec<u64> = retries.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] > g[0]), "waits grow: {trials:?}");
        assert!(trials.len() <= 10, "no oscillation: {trials:?}");
    }

    #[test]
    fn regrow_succeeds_when_memory_allows_and_never_exceeds_configured() {
        let mut s = GuardState::new(32, 1, 3).with_current(8);
        for step in 0..50 {
            s.begin_step(step);
            s.on_success();
            assert!(s.current() <= 32);
        }
        assert_eq!(s.current(), 32);
    }

    #[test]
    fn shrink_halves_ahead_of_an_oom_until_the_floor() {
        let mut s = GuardState::new(8, 2, 0);
        assert_eq!(s.shrink(0), Some(4));
        assert_eq!(s.shrink(1), Some(2));
        assert_eq!(s.shrink(2), None);
        assert_eq!(s.current(), 2);
    }

    #[test]
    fn backoff_returns_to_the_size_that_worked() {
        let mut s = GuardState::new(32, 1, 2).with_current(16);
        s.on_success();
        s.on_success();
        assert_eq!(s.begin_step(10), Some(24), "halfway to the configured size");
        assert_eq!(s.on_oom(10), Decision::Retry { micro_batch: 16, backoff: true });
        assert_eq!(s.current(), 16);
    }

    #[test]
    fn an_oom_after_a_successful_trial_backs_off_once_then_halves() {
        let mut s = GuardState::new(64, 1, 3).with_current(40);
        for _ in 0..3 {
            s.on_success();
        }
        assert_eq!(s.begin_step(10), Some(52));
        for _ in 0..5 {
            s.on_success();
        }
        assert_eq!(
            s.on_oom(15),
            Decision::Retry { micro_batch: 40, backoff: true },
            "back to the size before the trial"
        );
        assert_eq!(
            s.on_oom(15),
            Decision::Retry { micro_batch: 20, backoff: false },
            "that failed too: halve"
        );
    }

    #[test]
    fn an_oom_steps_down_the_sizes_regrow_climbed_one_at_a_time() {
        let mut s = GuardState::new(64, 1, 1).with_current(32);
        s.on_success();
        assert_eq!(s.begin_step(1), Some(48));
        s.on_success();
        assert_eq!(s.begin_step(2), Some(56));
        s.on_success();
        let memory = s.regrow_memory();
        assert_eq!(memory.ladder, [32, 48]);
        let mut resumed = GuardState::new(64, 1, 1).with_current(56).with_regrow_memory(memory);
        for g in [&mut s, &mut resumed] {
            assert_eq!(g.on_oom(3), Decision::Retry { micro_batch: 48, backoff: true });
            assert_eq!(g.on_oom(3), Decision::Retry { micro_batch: 32, backoff: true });
            assert_eq!(g.on_oom(3), Decision::Retry { micro_batch: 16, backoff: false });
        }
    }

    #[test]
    fn a_restored_regrow_memory_behaves_as_if_never_interrupted() {
        // Two failed trials at 32 by step 60, then a "restart": the resumed state must wait
        // exactly as long as the uninterrupted one before trying 32 again.
        let (_, before) = simulate(60);
        let resumed = GuardState::new(32, 1, 5)
            .with_current(before.current())
            .with_regrow_memory(before.regrow_memory());
        let next_trial = |mut s: GuardState| (60..1000).find(|&step| s.begin_step(step).is_some());
        let (straight, restored) = (next_trial(before.clone()), next_trial(resumed));
        assert!(straight.is_some());
        assert_eq!(straight, restored);
        let fresh = next_trial(GuardState::new(32, 1, 5).with_current(16));
        assert!(fresh < straight, "without the memory the size is retried sooner: {fresh:?} vs {straight:?}");
    }
}
