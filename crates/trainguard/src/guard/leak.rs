//! Is this out-of-memory a leak? Pure: memory held between steps (allocated on CUDA, resident on
//! CPU: the figure the leak detector watches) is remembered at its lowest, from the first steps
//! on; at an out-of-memory the memory still held once the failed attempt is freed is compared with
//! it. Memory held between steps is weights, gradients and optimizer state: flat after the first
//! step. Clearly more means tensors kept across steps, which no smaller micro-batch fixes.
use crate::events::LeakDiagnosis;

/// Growth below this is noise (allocator caches, page faults, the resident size's slack) ...
const MIN_GROWTH_BYTES: u64 = 64 << 20;
/// ... and so is growth below this share of what the first steps held.
const MIN_GROWTH_SHARE: f64 = 0.10;

#[derive(Debug, Clone, Default)]
pub struct HeldMemory {
    baseline: Option<(u64, u64)>,
}

impl HeldMemory {
    /// Memory held after step `step` completed.
    pub fn between_steps(&mut self, step: u64, bytes: u64) {
        if self.baseline.is_none_or(|(_, b)| bytes < b) {
            self.baseline = Some((step, bytes));
        }
    }

    /// A diagnosis when `held_now` is clearly above what the first steps held; none before a
    /// step has completed (nothing to compare with) or without a memory figure.
    pub fn diagnose(&self, held_now: Option<u64>) -> Option<LeakDiagnosis> {
        let ((step, base), held) = (self.baseline?, held_now?);
        let grown = held.checked_sub(base)?;
        let threshold = MIN_GROWTH_BYTES.max((base as f64 * MIN_GROWTH_SHARE) as u64);
        (grown > threshold).then(|| LeakDiagnosis {
            baseline_step: step,
            baseline_bytes: base,
            held_bytes: held,
            grown_bytes: grown,
            message: format!(
                "{} more is held between steps than at step {step}: tensors are kept across steps",
                crate::memory::human(grown)
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn growth_over_the_first_steps_is_a_leak_and_flat_memory_is_not() {
        let mut h = HeldMemory::default();
        assert_eq!(h.diagnose(Some(10_000 * MIB)), None, "no step completed: nothing to compare");
        for (step, held) in [(0, 1490 * MIB), (1, 1489 * MIB), (2, 1490 * MIB)] {
            h.between_steps(step, held);
        }
        assert_eq!(h.diagnose(Some(1500 * MIB)), None, "flat within noise");
        assert_eq!(h.diagnose(None), None);
        // gpt2-124m with faults.leak_graphs on an H100: ~6.5 GB more per step.
        let d = h.diagnose(Some(1489 * MIB + 13 * 1024 * MIB)).unwrap();
        assert_eq!((d.baseline_step, d.grown_bytes), (1, 13 * 1024 * MIB));
        assert_eq!(
            d.message,
            "13.00 GiB more is held between steps than at step 1: tensors are kept across steps"
        );
    }

    #[test]
    fn the_threshold_is_the_larger_of_64_mib_and_a_tenth_of_the_baseline() {
        let mut small = HeldMemory::default();
        small.between_steps(0, 100 * MIB);
        assert!(small.diagnose(Some(164 * MIB)).is_none());
        assert!(small.diagnose(Some(165 * MIB)).is_some());
        let mut large = HeldMemory::default();
        large.between_steps(3, 10_000 * MIB);
        assert!(large.diagnose(Some(11_000 * MIB)).is_none(), "1 GiB on 10 GiB is within a tenth");
        assert!(large.diagnose(Some(11_001 * MIB)).is_some());
    }
}
