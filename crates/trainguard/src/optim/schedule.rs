//! Linear warmup then cosine decay to a floor (nanoGPT's schedule). Pure.
use crate::config::TrainConfig;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
}

impl LrSchedule {
    pub fn from_config(t: &TrainConfig) -> Self {
        Self {
            max_lr: t.lr,
            min_lr: t.min_lr,
            warmup_steps: t.warmup_steps,
            decay_steps: t.lr_decay_steps.unwrap_or(t.max_steps),
        }
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            // (step + 1) / (warmup + 1): never zero, reaches max_lr just after warmup. In f64:
            // `warmup + 1` as u64 wraps to 0 at u64::MAX, an infinite rate.
            return self.max_lr * (step as f64 + 1.0) / (self.warmup_steps as f64 + 1.0);
        }
        if step >= self.decay_steps || self.decay_steps <= self.warmup_steps {
            return self.min_lr;
        }
        let ratio = (step - self.warmup_steps) as f64 / (self.decay_steps - self.warmup_steps) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: LrSchedule = LrSchedule { max_lr: 1.0, min_lr: 0.1, warmup_steps: 10, decay_steps: 110 };

    #[test]
    fn warmup_is_linear_and_never_zero() {
        assert!((S.at(0) - 1.0 / 11.0).abs() < 1e-12);
        assert!((S.at(9) - 10.0 / 11.0).abs() < 1e-12);
        assert!(S.at(0) < S.at(1) && S.at(1) < S.at(9));
        let endless = LrSchedule { warmup_steps: u64::MAX, decay_steps: u64::MAX, ..S };
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
        let s = LrSchedule { decay_steps: 10, ..S };
        assert_eq!(s.at(10), 0.1);
    }
}
