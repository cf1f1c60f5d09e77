//! Which checkpoints to keep: a pure function of the steps on disk and the policy, tested
//! without touching disk.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    /// Keep the newest N (at least 1: the one just written is always kept).
    pub keep_last: usize,
    /// Also keep every checkpoint whose step is a multiple of this (0 = none).
    pub keep_every: u64,
}

/// Steps (of `existing`) to delete after a checkpoint of `written` steps was written: never
/// `written` itself, nor a step above it (not this run's line: the resume sets those aside, and
/// whatever is left there is no reason to drop the run's own). `best` (by validation loss), if
/// given, is kept too.
pub fn to_delete(existing: &[u64], policy: Retention, best: Option<u64>, written: u64) -> Vec<u64> {
    let mut steps: Vec<u64> = existing.iter().copied().filter(|&s| s <= written).chain([written]).collect();
    steps.sort_unstable();
    steps.dedup();
    let keep_last = policy.keep_last.max(1);
    let recent_from = steps.len().saturating_sub(keep_last);
    steps
        .iter()
        .enumerate()
        .filter(|&(i, &s)| {
            let recent = i >= recent_from;
            let milestone = policy.keep_every > 0 && s % policy.keep_every == 0;
            !(recent || milestone || best == Some(s))
        })
        .map(|(_, &s)| s)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_n() {
        let p = Retention { keep_last: 2, keep_every: 0 };
        assert_eq!(to_delete(&[10, 20, 30, 40], p, None, 40), [10, 20]);
        assert_eq!(to_delete(&[40, 10, 30, 20], p, None, 40), [10, 20], "order on disk does not matter");
        assert!(to_delete(&[10], p, None, 10).is_empty());
    }

    #[test]
    fn the_step_just_written_is_kept_whatever_lies_above_it() {
        // A corrupt or abandoned step-30 left beside a run resumed at 20 that just wrote 25:
        // 30 is not counted among the newest, 25 stays, and 30 is not this function's to drop.
        let p = Retention { keep_last: 1, keep_every: 0 };
        assert_eq!(to_delete(&[10, 20, 25, 30], p, None, 25), [10, 20]);
        let p = Retention { keep_last: 2, keep_every: 0 };
        assert_eq!(to_delete(&[10, 20, 25, 30, 40], p, None, 25), [10]);
    }

    #[test]
    fn keep_last_zero_still_keeps_the_newest() {
        let p = Retention { keep_last: 0, keep_every: 0 };
        assert_eq!(to_delete(&[1, 2, 3], p, None, 3), [1, 2]);
    }

    #[test]
    fn milestones_and_best_survive() {
        let p = Retention { keep_last: 1, keep_every: 100 };
        assert_eq!(to_delete(&[50, 100, 150, 200, 250], p, None, 250), [50, 150]);
        assert_eq!(to_delete(&[50, 100, 150, 200, 250], p, Some(150), 250), [50]);
    }
}
