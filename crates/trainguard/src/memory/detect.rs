//! Warnings that catch real mistakes, as pure detectors fed one number per step.
//!
//! - [`LeakDetector`]: memory at the same point of consecutive steps (allocated on CUDA, resident
//!   on CPU) growing steadily over a window: tensors kept across steps.
//! - [`ThrashDetector`]: the CUDA allocator's `num_alloc_retries` rising step after step: it is
//!   freeing its cache and retrying to satisfy requests, which slows training without an OOM.
use std::collections::VecDeque;

#[derive(Debug, Clone)]
pub struct LeakDetector {
    window: usize,
    skip: usize,
    seen: usize,
    samples: VecDeque<u64>,
    warned: bool,
}

/// Growth over the window below this is noise (allocator caching, page faults).
const MIN_GROWTH_BYTES: u64 = 8 << 20;

impl LeakDetector {
    /// `window` steps; the first `skip` steps (warm-up: caches fill) are not looked at.
    pub fn new(window: usize, skip: usize) -> Self {
        Self { window, skip, seen: 0, samples: VecDeque::new(), warned: false }
    }

    /// Feeds one step's figure; returns the warning the first time a leak shows.
    pub fn observe(&mut self, bytes: u64) -> Option<String> {
        self.seen += 1;
        if self.window < 2 || self.warned || self.seen <= self.skip {
            return None;
        }
        self.samples.push_back(bytes);
        if self.samples.len() > self.window {
            self.samples.pop_front();
        }
        if self.samples.len() < self.window {
            return None;
        }
        let (first, last) = (self.samples[0], self.samples[self.window - 1]);
        let rising = self.samples.iter().zip(self.samples.iter().skip(1)).filter(|(a, b)| b > a).count();
        // Steady: memory went up on at least 3 of 4 steps and grew clearly overall.
        let steady = rising * 4 >= (self.window - 1) * 3;
        if last > first + MIN_GROWTH_BYTES && steady {
            self.warned = true;
            let per_step = (last - first) as f64 / (self.window - 1) as f64 / (1u64 << 20) as f64;
            return Some(format!(
                "memory grew {:.1} MiB over the last {} steps ({per_step:.2} MiB/step) and keeps growing: \
                 tensors are probably kept across steps (a loss, logits or trajectory stored without .detach(), \
                 or a list that only grows)",
                (last - first) as f64 / (1u64 << 20) as f64,
                self.window
            ));
        }
        None
    }
}

#[derive(Debug, Clone)]
pub struct ThrashDetector {
    steps: u32,
    rising_for: u32,
    last: Option<i64>,
}

impl ThrashDetector {
    /// Fires when the retry counter rose on `steps` consecutive steps.
    pub fn new(steps: u32) -> Self {
        Self { steps, rising_for: 0, last: None }
    }

    /// Feeds the cumulative `num_alloc_retries`; true when thrashing is established (then the
    /// count starts over, so it fires again only if it goes on).
    pub fn observe(&mut self, retries: i64) -> bool {
        let rose = self.last.is_some_and(|l| retries > l);
        self.last = Some(retries);
        self.rising_for = if rose { self.rising_for + 1 } else { 0 };
        if self.steps > 0 && self.rising_for >= self.steps {
            self.rising_for = 0;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_steady_climb_warns_once() {
        let mut d = LeakDetector::new(10, 3);
        let warnings: Vec<String> = (0..40).filter_map(|i| d.observe(500 * MIB + i * 2 * MIB)).collect();
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("without .detach()"));
    }

    #[test]
    fn flat_noisy_or_warm_up_growth_does_not_warn() {
        let mut d = LeakDetector::new(10, 5);
        // Warm-up growth, then flat with noise of +-1 MiB.
        for i in 0..5 {
            assert!(d.observe(100 * MIB + i * 50 * MIB).is_none());
        }
        for i in 0..100u64 {
            assert!(d.observe(400 * MIB + (i % 3) * MIB).is_none(), "step {i}");
        }
        // One jump then flat: not steady.
        let mut d = LeakDetector::new(10, 0);
        for i in 0..30u64 {
            assert!(d.observe(if i < 15 { 100 * MIB } else { 200 * MIB }).is_none());
        }
        // Slow creep under the noise floor.
        let mut d = LeakDetector::new(10, 0);
        assert!((0..30).all(|i| d.observe(100 * MIB + i * 1024).is_none()));
    }

    #[test]
    fn thrash_needs_consecutive_rises() {
        let mut t = ThrashDetector::new(3);
        assert_eq!([0, 1, 2, 2, 3, 4].map(|r| t.observe(r)), [false, false, false, false, false, false]);
        let mut t = ThrashDetector::new(3);
        assert_eq!([0, 1, 2, 3, 4].map(|r| t.observe(r)), [false, false, false, true, false]);
    }

    /// `oom.on_thrash: shrink` as src/train/watch.rs drives it, fed the cumulative
    /// `num_alloc_retries` a CUDA allocator reports: flat while memory is fine, then rising by
    /// uneven amounts under pressure. CPU runs have no allocator retries, so this chain cannot
    /// be set off on the real binary without a GPU (tests/it/gpu.rs does it there).
    #[test]
    fn rising_retries_shrink_the_micro_batch_once_per_established_run() {
        use crate::guard::GuardState;
        let counters: [i64; 14] = [0, 0, 0, 2, 7, 9, 9, 10, 14, 15, 21, 21, 21, 21];
        let mut detector = ThrashDetector::new(3);
        let mut guard = GuardState::new(32, 4, 0);
        let shrunk: Vec<(u64, Option<usize>)> = counters
            .iter()
            .enumerate()
            .filter(|&(_, &c)| detector.observe(c))
            .map(|(step, _)| (step as u64, guard.shrink(step as u64)))
            .collect();
        // Rises at steps 3, 4, 5 → fires at 5; flat at 6 resets; rises at 7, 8, 9 → fires at 9;
        // the rise at 10 alone is not three in a row.
        assert_eq!(shrunk, [(5, Some(16)), (9, Some(8))]);
        assert_eq!(guard.current(), 8);
        // At the floor a further thrash leaves the size alone (the caller only warns).
        let mut guard = GuardState::new(8, 8, 0);
        assert_eq!(guard.shrink(0), None);
    }
}
