//! What the guard does next, as a pure state machine over micro-batch sizes.
//!
//! - Out of memory at size m: retry at ⌈m/2⌉, never below the floor; at the floor, give up.
//! - Regrow (optional): after `regrow_after` clean steps below the configured size, try twice
//!   the current size (capped at the configured one). An OOM on that trial backs off to the size
//!   that worked and blocks the failed size for `regrow_after · 2^failures` steps, so repeated
//!   failures at one size are tried ever more rarely (no oscillation).
//! - What regrow has learnt (clean steps so far, blocked sizes) is [`RegrowMemory`]: checkpoints
//!   keep it, so a resumed run does not retry at once a size that failed before the restart.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Replay the step at this micro-batch. `backoff`: it is a regrow trial being undone.
    Retry { micro_batch: usize, backoff: bool },
    /// At the floor: replay with the next memory saver switched on (`level` savers on now).
    Escalate { level: usize },
    GiveUp,
}

/// A size the regrow rule may not try before `until_step`, after `failures` failures there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedSize {
    pub micro_batch: usize,
    pub until_step: u64,
    pub failures: u32,
}

/// The regrow rule's history, carried across a resume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegrowMemory {
    /// Clean steps since the last out-of-memory or trial.
    pub clean_steps: u64,
    pub blocked: Vec<BlockedSize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardState {
    configured: usize,
    floor: usize,
    current: usize,
    regrow_after: u64,
    clean_steps: u64,
    /// During a regrow trial: the size to return to if it fails.
    trial_from: Option<usize>,
    blocked: Vec<BlockedSize>,
    /// Memory savers the guard may switch on at the floor, and how many are on.
    escalations: usize,
    level: usize,
}

impl GuardState {
    pub fn new(configured: usize, floor: usize, regrow_after: u64) -> Self {
        let floor = floor.clamp(1, configured.max(1));
        Self { configured, floor, current: configured, regrow_after, clean_steps: 0, trial_from: None, blocked: Vec::new(), escalations: 0, level: 0 }
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
        RegrowMemory { clean_steps: self.clean_steps, blocked: self.blocked.clone() }
    }

    pub fn with_regrow_memory(mut self, memory: RegrowMemory) -> Self {
        self.clean_steps = memory.clean_steps;
        self.blocked = memory.blocked;
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
        let candidate = (self.current * 2).min(self.configured);
        if self.blocked.iter().any(|b| b.micro_batch == candidate && step < b.until_step) {
            return None;
        }
        self.trial_from = Some(self.current);
        self.current = candidate;
        self.clean_steps = 0;
        Some(candidate)
    }

    pub fn on_success(&mut self) {
        self.trial_from = None;
        self.clean_steps += 1;
    }

    pub fn on_oom(&mut self, step: u64) -> Decision {
        let failed = self.current;
        self.clean_steps = 0;
        if let Some(prev) = self.trial_from.take() {
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

    /// Memory fits 16 but not 32; configured 32, regrow after 5 clean steps.
    fn simulate(steps: u64) -> (Vec<u64>, GuardState) {
        let mut s = GuardState::new(32, 1, 5);
        let mut trials = vec![];
        for step in 0..steps {
            if s.begin_step(step).is_some() {
                trials.push(step);
            }
            while s.current() > 16 {
                assert!(matches!(s.on_oom(step), Decision::Retry { .. }));
            }
            s.on_success();
        }
        (trials, s)
    }

    #[test]
    fn regrow_retries_then_backs_off_ever_more_rarely() {
        let (trials, s) = simulate(200);
        assert!(!trials.is_empty(), "regrow must try again");
        assert_eq!(s.current(), 16);
        let gaps: Vec<u64> = trials.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] > g[0]), "waits grow: {trials:?}");
        assert!(trials.len() <= 6, "no oscillation: {trials:?}");
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
        assert_eq!(s.begin_step(10), Some(32));
        assert_eq!(s.on_oom(10), Decision::Retry { micro_batch: 16, backoff: true });
        assert_eq!(s.current(), 16);
    }

    #[test]
    fn a_restored_regrow_memory_behaves_as_if_never_interrupted() {
        // Two failed trials at 32 by step 60, then a "restart": the resumed state must wait
        // exactly as long as the uninterrupted one before trying 32 again.
        let (_, before) = simulate(60);
        let resumed = GuardState::new(32, 1, 5).with_current(before.current()).with_regrow_memory(before.regrow_memory());
        let next_trial = |mut s: GuardState| (60..1000).find(|&step| s.begin_step(step).is_some());
        let (straight, restored) = (next_trial(before.clone()), next_trial(resumed));
        assert!(straight.is_some());
        assert_eq!(straight, restored);
        let fresh = next_trial(GuardState::new(32, 1, 5).with_current(16));
        assert!(fresh < straight, "without the memory the size is retried sooner: {fresh:?} vs {straight:?}");
    }
}
