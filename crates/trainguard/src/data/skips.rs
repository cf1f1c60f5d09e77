//! Which data a step draws once windows of it were skipped: the divergence guard marks the data
//! steps that led to a loss spike as never to be drawn again, and the sampler then maps each
//! optimizer step to the next data step past them. Pure; the windows themselves are recorded in
//! the checkpoints' `trainer_state.json`, so a resumed run draws exactly what the run that
//! skipped them would have drawn.
use serde::{Deserialize, Serialize};

/// Data steps `from..to` (the sampler's step index, from 0; `to` excluded), skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedWindow {
    pub from: u64,
    pub to: u64,
}

/// The data step (the step index the sampler draws samples for) of optimizer step `step` (the
/// loop's index, from 0): the `step`-th data step outside every window in `skipped`. Without
/// skipped windows the two are equal.
pub fn data_step(step: u64, skipped: &[SkippedWindow]) -> u64 {
    let mut windows: Vec<&SkippedWindow> = skipped.iter().filter(|w| w.to > w.from).collect();
    windows.sort_by_key(|w| w.from);
    // Walking the windows in order: each one that starts at or before the data step reached so
    // far pushes it past the window's length. Windows may overlap (two rollbacks to the same
    // checkpoint skip nested ranges), so only the part past what was skipped already counts.
    let mut data = step;
    let mut skipped_to = 0;
    for w in windows {
        let from = w.from.max(skipped_to);
        if w.to <= from {
            continue;
        }
        if from > data {
            break;
        }
        data += w.to - from;
        skipped_to = w.to;
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(from: u64, to: u64) -> SkippedWindow {
        SkippedWindow { from, to }
    }

    #[test]
    fn without_windows_a_step_draws_its_own_data() {
        for s in [0, 1, 7, 1_000_000] {
            assert_eq!(data_step(s, &[]), s);
        }
    }

    #[test]
    fn steps_jump_over_a_window_and_never_land_in_one() {
        // Steps 0..10 diverged at 9 and rolled back to 5: data steps 5..10 are skipped.
        let skipped = [w(5, 10)];
        let mapped: Vec<u64> = (0..8).map(|s| data_step(s, &skipped)).collect();
        assert_eq!(mapped, vec![0, 1, 2, 3, 4, 10, 11, 12]);
        // A second rollback, later, to step 6 (data step 11) after a spike at step 7 (data 12).
        let skipped = [w(5, 10), w(11, 13)];
        let mapped: Vec<u64> = (0..9).map(|s| data_step(s, &skipped)).collect();
        assert_eq!(mapped, vec![0, 1, 2, 3, 4, 10, 13, 14, 15]);
    }

    /// The mapping is strictly increasing and skips exactly the windows' steps, whatever order
    /// they were recorded in and however they overlap.
    #[test]
    fn the_mapping_is_the_sequence_of_data_steps_outside_the_windows() {
        let skipped = [w(20, 25), w(3, 4), w(22, 30), w(0, 0), w(40, 41)];
        let outside: Vec<u64> =
            (0..100u64).filter(|d| !skipped.iter().any(|w| (w.from..w.to).contains(d))).collect();
        let mapped: Vec<u64> = (0..outside.len() as u64).map(|s| data_step(s, &skipped)).collect();
        assert_eq!(mapped, outside);
    }
}
