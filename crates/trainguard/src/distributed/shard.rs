//! Which rank owns which parameter under `dist.shard` (pure: every rank computes the same answer
//! from the parameter sizes alone, and the planner uses it to count a rank's bytes).
//!
//! Ownership is by whole parameter, as PyTorch's `ZeroRedundancyOptimizer` partitions: each
//! optimizer then sees whole tensors, so Adafactor's factored rows, 8-bit AdamW's blocks and
//! Muon's orthogonalisation (which needs the whole matrix) shard exactly as their state is laid
//! out, with no cut through a row or a quantisation block. The price is balance: a rank's share
//! is the parameters the greedy assignment gave it, not exactly 1/N (the largest tensor, often
//! the embedding, bounds how even it gets); `plan` prints the real share.
//!
//! For the collectives the owned parameters are laid out rank after rank in one flat buffer of
//! `world × slot` elements, each rank's slot padded to the largest rank's share: a reduce-scatter
//! of that buffer leaves each rank its own parameters' gradients, an all-gather of the slots
//! puts every rank's updated parameters back on all.

use crate::config::ShardLevel;

/// This rank's part under `dist.shard`: the level, who owns what, and this rank's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Sharding {
    pub level: ShardLevel,
    pub rank: usize,
    pub ownership: Ownership,
    /// The parameters this rank owns (indices into the optimizer's parameters), in order.
    pub owned: Vec<usize>,
    /// Elements per rank in each piece of the collectives (`dist.bucket_mb` over the world).
    pub chunk: i64,
}

impl Sharding {
    /// `level` over parameters of `numels` elements for `rank` of `world`; None for `none`.
    pub fn new(level: ShardLevel, numels: &[i64], rank: usize, world: usize, chunk: i64) -> Option<Self> {
        if level == ShardLevel::None {
            return None;
        }
        let ownership = Ownership::assign(numels, world);
        let owned = ownership.owned(rank);
        Some(Self { level, rank, ownership, owned, chunk })
    }

    /// `items[i]` for each parameter `i` this rank owns.
    pub fn pick<T: Clone>(&self, items: &[T]) -> Vec<T> {
        self.owned.iter().map(|&i| items[i].clone()).collect()
    }

    /// The tensors of the parameters this rank owns (shallow: the same storage).
    pub fn pick_tensors(&self, tensors: &[tch::Tensor]) -> Vec<tch::Tensor> {
        self.owned.iter().map(|&i| tensors[i].shallow_clone()).collect()
    }
}

/// Which rank owns each parameter, and where each sits in the flat, slot-per-rank layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    world: usize,
    /// Per parameter: its owner.
    owner: Vec<usize>,
    /// Per parameter: its element count.
    numel: Vec<i64>,
}

impl Ownership {
    /// Largest parameter first, each to the rank holding the fewest elements so far (the lowest
    /// rank on a tie): within one largest parameter of an even split.
    pub fn assign(numels: &[i64], world: usize) -> Self {
        let world = world.max(1);
        let mut order: Vec<usize> = (0..numels.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(numels[i]), i));
        let mut load = vec![0i64; world];
        let mut owner = vec![0usize; numels.len()];
        for i in order {
            let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            owner[i] = r;
            load[r] += numels[i];
        }
        Self { world, owner, numel: numels.to_vec() }
    }

    pub fn owner(&self, param: usize) -> usize {
        self.owner[param]
    }

    /// The parameters `rank` owns, in parameter order.
    pub fn owned(&self, rank: usize) -> Vec<usize> {
        (0..self.owner.len()).filter(|&i| self.owner[i] == rank).collect()
    }

    /// Elements of the parameters `rank` owns.
    pub fn elements(&self, rank: usize) -> i64 {
        self.owned(rank).iter().map(|&i| self.numel[i]).sum()
    }

    /// Each rank's slot in the flat buffer: the largest share (at least one element, so that a
    /// rank owning nothing still takes part in the collectives with a buffer of its own).
    pub fn slot(&self) -> i64 {
        (0..self.world).map(|r| self.elements(r)).max().unwrap_or(0).max(1)
    }

    /// Per parameter: its offset in the flat `world × slot` buffer (its owner's slot, then the
    /// owner's parameters in order).
    pub fn offsets(&self) -> Vec<i64> {
        let slot = self.slot();
        let mut next: Vec<i64> = (0..self.world as i64).map(|r| r * slot).collect();
        self.owner
            .iter()
            .zip(&self.numel)
            .map(|(&r, &n)| {
                let at = next[r];
                next[r] += n;
                at
            })
            .collect()
    }

    /// The ownership of the parameters `idx` alone (each keeps its owner), laid out as their own
    /// flat `world × slot` buffer: one unit's gather under `dist.shard: parameters`.
    pub fn restricted(&self, idx: &[usize]) -> Self {
        Self {
            world: self.world,
            owner: idx.iter().map(|&i| self.owner[i]).collect(),
            numel: idx.iter().map(|&i| self.numel[i]).collect(),
        }
    }

    /// Per parameter: its element count.
    pub fn numels(&self) -> &[i64] {
        &self.numel
    }

    /// How uneven the split is: the largest share over the even one (1.0 = perfectly even).
    pub fn imbalance(&self) -> f64 {
        let total: i64 = self.numel.iter().sum();
        if total == 0 {
            return 1.0;
        }
        self.slot() as f64 * self.world as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_one_owner_and_the_split_is_within_one_largest_parameter_of_even() {
        let numels: Vec<i64> = vec![38_597_376, 786_432, 2_359_296, 768, 768, 589_824, 2_359_296, 7, 3, 1];
        for world in 1..=5 {
            let o = Ownership::assign(&numels, world);
            let mut seen = vec![0; numels.len()];
            for r in 0..world {
                for i in o.owned(r) {
                    seen[i] += 1;
                    assert_eq!(o.owner(i), r);
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "world {world}: {seen:?}");
            let total: i64 = numels.iter().sum();
            assert_eq!((0..world).map(|r| o.elements(r)).sum::<i64>(), total);
            let even = (total + world as i64 - 1) / world as i64;
            assert!(o.slot() <= even.max(*numels.iter().max().unwrap()), "world {world}");
        }
        assert_eq!(Ownership::assign(&numels, 1).imbalance(), 1.0);
    }

    #[test]
    fn offsets_put_each_parameter_in_its_owners_slot_without_overlap() {
        let numels = vec![10, 3, 7, 7, 1, 5];
        let o = Ownership::assign(&numels, 3);
        let slot = o.slot();
        let offsets = o.offsets();
        let mut used = vec![false; (slot * 3) as usize];
        for (i, (&off, &n)) in offsets.iter().zip(&numels).enumerate() {
            let r = o.owner(i) as i64;
            assert!(off >= r * slot && off + n <= (r + 1) * slot, "parameter {i} outside rank {r}'s slot");
            for k in off..off + n {
                assert!(!used[k as usize], "parameter {i} overlaps another");
                used[k as usize] = true;
            }
        }
    }

    #[test]
    fn more_ranks_than_parameters_leaves_some_owning_nothing_with_a_slot_still() {
        let o = Ownership::assign(&[4, 4], 3);
        assert_eq!(o.owned(2), Vec::<usize>::new());
        assert_eq!(o.slot(), 4);
        assert_eq!(Ownership::assign(&[], 2).slot(), 1);
    }

    #[test]
    fn a_units_ownership_keeps_each_parameters_owner_and_pads_to_its_own_largest_share() {
        let numels = vec![10, 3, 7, 7, 1, 5];
        let all = Ownership::assign(&numels, 3);
        let unit = all.restricted(&[1, 3, 4]);
        assert_eq!(unit.numels(), &[3, 7, 1]);
        for (k, &i) in [1, 3, 4].iter().enumerate() {
            assert_eq!(unit.owner(k), all.owner(i), "parameter {i} keeps its owner");
        }
        let largest = (0..3).map(|r| unit.elements(r)).max().unwrap();
        assert_eq!(unit.slot(), largest.max(1));
        assert!(unit.slot() < all.slot(), "a unit's slot is its own, not the model's");
    }

    #[test]
    fn the_assignment_is_the_same_for_the_same_sizes() {
        let numels = vec![5, 5, 5, 5, 9, 1];
        assert_eq!(Ownership::assign(&numels, 4), Ownership::assign(&numels, 4));
        assert_eq!(Ownership::assign(&numels, 2).owned(0), vec![2, 4, 5]);
    }
}
