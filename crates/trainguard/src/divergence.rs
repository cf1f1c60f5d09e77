//! The divergence guard's statistic and decisions (`divergence.*`), pure: whether a step's loss
//! (or gradient norm) is a spike against the median and MAD of the recent healthy steps, and
//! what to do about a divergence (a spike, or `nan.max_consecutive` non-finite updates): roll
//! back to the last checkpoint skipping the data steps since, with the learning rate lowered for
//! a while, or stop once the rollbacks are spent. The loop (`train::run`) carries it out: it
//! loads the checkpoint, emits the events and rewrites the checkpoint with the new record.
//!
//! Why median and MAD: a mean and standard deviation are dragged up by the spike itself and by
//! the steep first steps; the median moves by one rank per outlier and the MAD ignores a few
//! wild values, so a spike stands out by many robust standard deviations while ordinary noise
//! does not. The window holds only steps judged healthy, so a run of spikes cannot become the
//! normal it is judged against.
use crate::checkpoint::state::{DivergenceRecord, RollbackRecord};
use crate::config::DivergenceConfig;
use crate::data::skips::SkippedWindow;
use serde::Serialize;

/// MAD × this estimates the standard deviation of normally distributed values.
const MAD_TO_SIGMA: f64 = 1.4826;

/// What crossed its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Statistic {
    Loss,
    GradNorm,
    /// `nan.max_consecutive` non-finite updates in a row.
    Nonfinite,
}

impl Statistic {
    pub fn name(self) -> &'static str {
        match self {
            Self::Loss => "loss",
            Self::GradNorm => "grad_norm",
            Self::Nonfinite => "nonfinite",
        }
    }
}

/// A divergence as judged: the value, and the median, MAD and limit it was judged against (all
/// NaN for a non-finite streak, which has no window statistic).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spike {
    pub statistic: Statistic,
    pub value: f64,
    pub median: f64,
    pub mad: f64,
    pub limit: f64,
}

impl Spike {
    /// A streak of `count` non-finite updates.
    pub fn nonfinite(count: u64) -> Self {
        Self {
            statistic: Statistic::Nonfinite,
            value: count as f64,
            median: f64::NAN,
            mad: f64::NAN,
            limit: f64::NAN,
        }
    }
}

/// The median of `values` (NaN for none).
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Median and median absolute deviation.
fn median_mad(values: &[f64]) -> (f64, f64) {
    let m = median(values);
    let deviations: Vec<f64> = values.iter().map(|v| (v - m).abs()).collect();
    (m, median(&deviations))
}

/// `value` judged against `window`: a spike when above median + max(`threshold` robust standard
/// deviations, `min_rise` × |median|).
fn judge_one(
    statistic: Statistic,
    value: f64,
    window: &[f64],
    threshold: f64,
    min_rise: f64,
) -> Option<Spike> {
    let (median, mad) = median_mad(window);
    let limit = median + (threshold * MAD_TO_SIGMA * mad).max(min_rise * median.abs());
    (value > limit).then_some(Spike { statistic, value, median, mad, limit })
}

/// Whether a step whose update was applied (`loss` and `grad_norm` finite) is a spike. Nothing
/// is judged before `min_history` healthy steps are in the window.
pub fn judge(cfg: &DivergenceConfig, record: &DivergenceRecord, loss: f64, grad_norm: f64) -> Option<Spike> {
    if record.losses.len() < cfg.min_history {
        return None;
    }
    judge_one(Statistic::Loss, loss, &record.losses, cfg.threshold, cfg.min_rise).or_else(|| {
        let t = cfg.grad_norm_threshold?;
        judge_one(Statistic::GradNorm, grad_norm, &record.grad_norms, t, cfg.min_rise)
    })
}

/// A healthy step's values join the window (the oldest leave past `window`).
pub fn remember(cfg: &DivergenceConfig, record: &mut DivergenceRecord, loss: f64, grad_norm: f64) {
    for (values, v) in [(&mut record.losses, loss), (&mut record.grad_norms, grad_norm)] {
        values.push(v);
        let over = values.len().saturating_sub(cfg.window);
        values.drain(..over);
    }
}

/// What to do about a divergence.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Go back to the checkpoint, never draw `skip` again, and train below `lowered_lr_until`
    /// (the loop's step index) at the lowered learning rate.
    RollBack { skip: SkippedWindow, lowered_lr_until: Option<u64>, rollback: RollbackRecord },
    /// The rollbacks are spent: `recent` of them within `divergence.rollback_window` already.
    GiveUp { recent: usize },
}

/// The decision for a divergence at step `step` (the loop's index) that drew data step
/// `data_step`, when the newest checkpoint holds `to_step` steps and its next step would draw
/// data step `to_data_step`: the window skipped runs from there through the diverged step's.
pub fn decide(
    cfg: &DivergenceConfig,
    record: &DivergenceRecord,
    step: u64,
    data_step: u64,
    to_step: u64,
    to_data_step: u64,
) -> Decision {
    // Counted in data steps: they only go forward, where the step index goes back at each rollback.
    let recent = record.rollbacks.iter().filter(|r| r.data_step + cfg.rollback_window > data_step).count();
    if recent >= cfg.max_rollbacks {
        return Decision::GiveUp { recent };
    }
    let lowered = cfg.lr_factor < 1.0 && cfg.lr_steps > 0;
    Decision::RollBack {
        skip: SkippedWindow { from: to_data_step, to: data_step + 1 },
        lowered_lr_until: lowered.then_some(to_step + cfg.lr_steps),
        rollback: RollbackRecord { diverged_step: step + 1, data_step, to_step },
    }
}

/// The record after a rollback: the statistic's window as the checkpoint held it (`restored`),
/// the skipped windows and rollbacks of the whole run (`kept`) with this one added.
pub fn rolled_back(
    kept: &DivergenceRecord,
    restored: Option<&DivergenceRecord>,
    decision: &Decision,
) -> DivergenceRecord {
    let mut record = DivergenceRecord {
        losses: restored.map(|r| r.losses.clone()).unwrap_or_default(),
        grad_norms: restored.map(|r| r.grad_norms.clone()).unwrap_or_default(),
        ..kept.clone()
    };
    if let Decision::RollBack { skip, lowered_lr_until, rollback } = decision {
        record.skipped.push(*skip);
        record.rollbacks.push(*rollback);
        record.lowered_lr_until = lowered_lr_until.or(record.lowered_lr_until);
    }
    record
}

/// The learning rate's multiplier at step `step` (the loop's index).
pub fn lr_factor(cfg: &DivergenceConfig, record: &DivergenceRecord, step: u64) -> f64 {
    match record.lowered_lr_until {
        Some(until) if step < until => cfg.lr_factor,
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DivergenceConfig {
        DivergenceConfig { enabled: true, window: 5, min_history: 3, ..DivergenceConfig::default() }
    }

    #[test]
    fn median_and_mad_ignore_a_wild_value() {
        assert_eq!(median_mad(&[1.0, 2.0, 3.0, 4.0, 100.0]), (3.0, 1.0));
        assert_eq!(median_mad(&[4.0, 1.0, 3.0, 2.0]), (2.5, 1.0));
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn a_spike_stands_out_and_noise_does_not() {
        let c = cfg();
        let mut r = DivergenceRecord::default();
        for loss in [3.0, 3.1, 2.9] {
            assert_eq!(judge(&c, &r, 50.0, 1.0), None, "nothing is judged before min_history");
            remember(&c, &mut r, loss, 1.0);
        }
        assert_eq!(judge(&c, &r, 3.2, 1.0), None, "noise");
        let spike = judge(&c, &r, 7.0, 1.0).expect("a spike");
        // median 3.0, MAD 0.1: 6 robust sigmas are 0.89, above the 20% floor of 0.6.
        assert_eq!((spike.statistic, spike.median, spike.value), (Statistic::Loss, 3.0, 7.0));
        assert!((spike.mad - 0.1).abs() < 1e-12 && (spike.limit - 3.88956).abs() < 1e-9, "{spike:?}");
        assert_eq!(judge(&c, &r, 3.85, 1.0), None, "within 6 robust sigmas");
        // A flat window (MAD 0): the 20% floor decides.
        let flat = DivergenceRecord { losses: vec![3.0; 3], grad_norms: vec![1.0; 3], ..Default::default() };
        assert_eq!(judge(&c, &flat, 3.59, 1.0), None, "below the min_rise floor");
        assert!((judge(&c, &flat, 3.61, 1.0).unwrap().limit - 3.6).abs() < 1e-12);
        // The gradient norm is watched only when asked.
        assert_eq!(judge(&c, &r, 3.0, 1e6), None);
        let watched = DivergenceConfig { grad_norm_threshold: Some(10.0), ..c.clone() };
        assert_eq!(judge(&watched, &r, 3.0, 1e6).map(|s| s.statistic), Some(Statistic::GradNorm));
    }

    #[test]
    fn the_window_keeps_the_newest_healthy_steps() {
        let c = cfg();
        let mut r = DivergenceRecord::default();
        for i in 0..8 {
            remember(&c, &mut r, i as f64, 10.0 + i as f64);
        }
        assert_eq!(r.losses, vec![3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!(r.grad_norms, vec![13.0, 14.0, 15.0, 16.0, 17.0]);
    }

    /// A divergence at step index 49 (data step 49) with the newest checkpoint at 40 steps skips
    /// data steps 40..50; the learning rate is lowered from step 40 for `lr_steps`; the window of
    /// values comes from the checkpoint, the skipped windows and rollbacks from the run.
    #[test]
    fn a_rollback_skips_from_the_checkpoint_through_the_diverged_step() {
        let c = DivergenceConfig { lr_factor: 0.5, lr_steps: 20, ..cfg() };
        let now = DivergenceRecord { losses: vec![9.0; 5], grad_norms: vec![9.0; 5], ..Default::default() };
        let d = decide(&c, &now, 49, 49, 40, 40);
        let Decision::RollBack { skip, lowered_lr_until, rollback } = &d else { panic!("{d:?}") };
        assert_eq!(*skip, SkippedWindow { from: 40, to: 50 });
        assert_eq!(*lowered_lr_until, Some(60));
        assert_eq!(*rollback, RollbackRecord { diverged_step: 50, data_step: 49, to_step: 40 });
        let at_checkpoint =
            DivergenceRecord { losses: vec![3.0; 5], grad_norms: vec![1.0; 5], ..Default::default() };
        let after = rolled_back(&now, Some(&at_checkpoint), &d);
        assert_eq!((after.losses.clone(), after.grad_norms.clone()), (vec![3.0; 5], vec![1.0; 5]));
        assert_eq!(after.skipped, vec![SkippedWindow { from: 40, to: 50 }]);
        assert_eq!(after.rollbacks.len(), 1);
        assert_eq!(
            (lr_factor(&c, &after, 40), lr_factor(&c, &after, 59), lr_factor(&c, &after, 60)),
            (0.5, 0.5, 1.0)
        );
        // Without lowering the learning rate stays.
        let Decision::RollBack { lowered_lr_until, .. } = decide(&cfg(), &now, 49, 49, 40, 40) else {
            panic!()
        };
        assert_eq!(lowered_lr_until, None);
    }

    #[test]
    fn rollbacks_are_bounded_within_the_window_of_data_steps() {
        let c = DivergenceConfig { max_rollbacks: 2, rollback_window: 100, ..cfg() };
        let at = |data_step| RollbackRecord { diverged_step: 0, data_step, to_step: 0 };
        let r = DivergenceRecord { rollbacks: vec![at(10), at(80)], ..Default::default() };
        assert_eq!(decide(&c, &r, 60, 105, 50, 95), Decision::GiveUp { recent: 2 });
        // Once the first has left the window, the next divergence rolls back again.
        assert!(matches!(decide(&c, &r, 60, 110, 50, 95), Decision::RollBack { .. }));
        let none = DivergenceConfig { max_rollbacks: 0, ..c };
        assert_eq!(decide(&none, &DivergenceRecord::default(), 5, 5, 0, 0), Decision::GiveUp { recent: 0 });
    }
}
