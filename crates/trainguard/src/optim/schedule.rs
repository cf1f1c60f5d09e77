//! The learning rate of each step (`train.schedule`), pure: linear warmup, then either a cosine
//! decay to the floor (nanoGPT's schedule) or warmup-stable-decay (the rate held at its peak,
//! then the last `decay_fraction` of the run down to the floor, linear, cosine or 1 − √x).
use crate::config::{DecayShape, Schedule, TrainConfig};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub decay: Decay,
}

/// What follows the warmup, in the loop's step indices (from 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decay {
    /// Cosine from `max_lr` after warmup to `min_lr` at index `until`.
    Cosine { until: u64 },
    /// `max_lr` before index `from`, then `shape` down to `min_lr` at index `until - 1`: the
    /// decay's first step is already below the peak and its last one at the floor.
    Wsd { from: u64, until: u64, shape: DecayShape },
}

impl LrSchedule {
    pub fn from_config(t: &TrainConfig) -> Self {
        let decay = match t.schedule {
            Schedule::Cosine => Decay::Cosine { until: t.lr_decay_steps.unwrap_or(t.max_steps) },
            Schedule::Wsd => {
                let steps = (t.decay_fraction * t.max_steps as f64).round() as u64;
                let from = t.max_steps.saturating_sub(steps).max(t.warmup_steps);
                Decay::Wsd { from, until: t.max_steps, shape: t.decay_shape }
            }
        };
        Self { max_lr: t.lr, min_lr: t.min_lr, warmup_steps: t.warmup_steps, decay }
    }

    /// Learning rate of the optimizer step of loop index `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            // (step + 1) / (warmup + 1): never zero, reaches max_lr just after warmup. In f64:
            // `warmup + 1` as u64 wraps to 0 at u64::MAX, an infinite rate.
            return self.max_lr * (step as f64 + 1.0) / (self.warmup_steps as f64 + 1.0);
        }
        let (from, until) = match self.decay {
            Decay::Cosine { until } => (self.warmup_steps, until),
            Decay::Wsd { from, until, .. } => (from, until),
        };
        if step < from {
            return self.max_lr; // wsd's stable phase
        }
        if step >= until || until <= from {
            return self.min_lr;
        }
        // Cosine's x is 0 at its first step; a wsd decay's last step is at the floor.
        let x = match self.decay {
            Decay::Cosine { .. } => (step - from) as f64 / (until - from) as f64,
            Decay::Wsd { .. } => (step + 1 - from) as f64 / (until - from) as f64,
        };
        let left = match self.decay {
            Decay::Cosine { .. } | Decay::Wsd { shape: DecayShape::Cosine, .. } => {
                0.5 * (1.0 + (std::f64::consts::PI * x).cos())
            }
            Decay::Wsd { shape: DecayShape::Linear, .. } => 1.0 - x,
            Decay::Wsd { shape: DecayShape::Sqrt, .. } => 1.0 - x.sqrt(),
        };
        self.min_lr + left * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: LrSchedule =
        LrSchedule { max_lr: 1.0, min_lr: 0.1, warmup_steps: 10, decay: Decay::Cosine { until: 110 } };

    #[test]
    fn warmup_is_linear_and_never_zero() {
        assert!((S.at(0) - 1.0 / 11.0).abs() < 1e-12);
        assert!((S.at(9) - 10.0 / 11.0).abs() < 1e-12);
        assert!(S.at(0) < S.at(1) && S.at(1) < S.at(9));
        let endless = LrSchedule { warmup_steps: u64::MAX, decay: Decay::Cosine { until: u64::MAX }, ..S };
        assert!(
            endless.at(0).is_finite() && endless.at(0) > 0.0 && endless.at(u64::MAX - 1) <= 1.0,
            "{}",
            endless.at(0)
        );
    }

    #[test]
    fn cosine_goes_from_max_through_midpoint_to_min() {
        assert!((S.at(10) - 1.0).abs() < 1e-12);
        assert!((S.at(60) - 0.55).abs() < 1e-12);
        assert!((S.at(110) - 0.1).abs() < 1e-12);
        assert!((S.at(10_000) - 0.1).abs() < 1e-12);
        for s in 10..110 {
            assert!(S.at(s + 1) <= S.at(s));
        }
    }

    #[test]
    fn no_decay_window_means_floor_after_warmup() {
        let s = LrSchedule { decay: Decay::Cosine { until: 10 }, ..S };
        assert_eq!(s.at(10), 0.1);
    }

    /// Warmup-stable-decay over 100 steps, the last 20% decaying (indices 80..100): the peak
    /// from the end of warmup to index 79, then each shape's formula down to the floor at 99.
    #[test]
    fn wsd_holds_the_peak_then_decays_in_its_shape() {
        let t = |shape| TrainConfig {
            max_steps: 100,
            warmup_steps: 10,
            lr: 1.0,
            min_lr: 0.1,
            schedule: Schedule::Wsd,
            decay_fraction: 0.2,
            decay_shape: shape,
            ..TrainConfig::default()
        };
        for shape in [DecayShape::Linear, DecayShape::Cosine, DecayShape::Sqrt] {
            let s = LrSchedule::from_config(&t(shape));
            assert_eq!(s.decay, Decay::Wsd { from: 80, until: 100, shape });
            assert!((s.at(9) - 10.0 / 11.0).abs() < 1e-12, "warmup as cosine's");
            assert!((10..80).all(|i| s.at(i) == 1.0), "{shape:?}: stable at the peak");
            assert!(s.at(80) < 1.0, "{shape:?}: the decay's first step is below the peak");
            assert!(
                (s.at(99) - 0.1).abs() < 1e-12 && s.at(100) == 0.1,
                "{shape:?}: the last step at the floor"
            );
            // A quarter of the way into the decay (index 84: x = 5 / 20), by the formula.
            let left = match shape {
                DecayShape::Linear => 0.75,
                DecayShape::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * 0.25).cos()),
                DecayShape::Sqrt => 0.5,
            };
            assert!((s.at(84) - (0.1 + 0.9 * left)).abs() < 1e-12, "{shape:?}: {}", s.at(84));
            assert!((80..100).all(|i| s.at(i + 1) <= s.at(i)), "{shape:?}: falls");
        }
        // A decay longer than what follows the warmup starts when the warmup ends.
        let long = LrSchedule::from_config(&TrainConfig { decay_fraction: 1.0, ..t(DecayShape::Linear) });
        assert_eq!(long.decay, Decay::Wsd { from: 10, until: 100, shape: DecayShape::Linear });
    }
}
