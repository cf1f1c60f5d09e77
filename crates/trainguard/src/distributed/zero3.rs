//! `dist.shard: parameters` (ZeRO-3): through the step a rank holds only the parameters it owns.
//! The memory of the others is freed (their storage resized to nothing, as FSDP does; the tensor
//! objects stay, so the model and its views need not know) and gathered again from their owners
//! for the unit that needs them: the embeddings and the head for a micro-step's whole, each
//! block for its forward and again for its backward. A unit's gradients are reduce-scattered
//! into this rank's fp32 accumulators as soon as its backward is done, and the full ones freed.
//! Between steps every parameter is whole again (gathered after the update, as at the other
//! levels): checkpoints, validation and sampling read the whole model.
//!
//! **Lockstep.** A rank that runs out of memory in the middle of a micro-step must not leave its
//! peers waiting in a gather it will never join. Before every collective the ranks say whether
//! they are still well (one number, all-reduced): a rank whose work failed says so at its next
//! collective, and every rank leaves the attempt there, together, for the step's agreement and
//! the guard's replay. What a collective needs is allocated before that word (the gathered
//! parameters' memory; the pieces' buffers once, when the layout is built), so none of our own
//! work fails inside one (Gloo's temporaries inside its collectives are beyond our reach).
//!
//! **Overlap** (`dist.overlap`). A block's gather can be started before the block ahead of it
//! computes and waited for after ([`ParameterShards::start_gather`], [`ParameterShards::finish`]):
//! the collectives run on Gloo's threads or NCCL's stream meanwhile. They are broadcasts, one a
//! parameter from its owner straight into the others' memory: no buffer of ours, none shared
//! with the word or another collective. Likewise a block's gradients are reduced to their
//! owners, one a parameter, while the next block's backward runs, and added into the
//! accumulators before the next unit's reduce. A started collective completes on every rank,
//! whatever this rank's work did meanwhile (an unfinished one is waited for when dropped).
use super::shard::{Ownership, Sharding};
use super::zero::{Pieces, Started};
use super::{torch_error, Dist, DistError};
use crate::ffi::resize_storage;
use crate::model::Model;
use tch::{Device, Kind, TchError, Tensor};

/// Which parameters each unit gathers, who owns them, and the buffers the collectives reuse.
pub struct ParameterShards {
    /// The parameters of each unit: [`OUTER`] (embeddings, final norm, head), then each block.
    units: Vec<Vec<usize>>,
    /// Per unit: its parameters' owners, laid out slot per rank as [`Ownership`] lays out all.
    owns: Vec<Ownership>,
    /// The whole model's ownership (the gather after the update).
    all: Ownership,
    /// Per parameter (the model's, padded): its bytes, and whether its memory is here now.
    nbytes: Vec<usize>,
    whole: Vec<bool>,
    owned: Vec<bool>,
    chunk: i64,
    /// Every collective's pieces (of `chunk` elements a rank).
    pieces: Pieces,
    /// `dist.overlap` with peers: block gathers started ahead, block reduces left running.
    overlap: bool,
    pending: Option<Gathering>,
    reducing: Option<Reducing>,
}

/// A block's gather started by [`ParameterShards::prefetch`] and still running. Dropped
/// unfinished (an attempt that failed meanwhile), it is waited for.
struct Gathering {
    unit: usize,
    started: Started,
}

/// A block's gradients (flat fp32, one a parameter) being summed into their owners' by
/// [`ParameterShards::reduce_scatter`] under `dist.overlap`; [`ParameterShards::settle`] adds
/// this rank's sums into its accumulators. Dropped unfinished, it is waited for.
struct Reducing {
    unit: usize,
    flats: Vec<Tensor>,
    started: Started,
}

/// The unit of the embeddings and the head: gathered for a micro-step's whole.
pub const OUTER: usize = 0;

/// The unit of block `i`.
pub fn block_unit(i: usize) -> usize {
    1 + i
}

impl ParameterShards {
    /// For `model` under `sharding` (its ownership over the optimizer's parameters) on `world`
    /// ranks; the buffers on `device`. Every parameter is whole when this returns.
    pub fn new(
        model: &Model,
        sharding: &Sharding,
        world: usize,
        overlap: bool,
        device: Device,
    ) -> Result<Self, TchError> {
        let groups = model.param_groups();
        let mut outer: Vec<usize> = groups.embed.iter().chain(&groups.head).copied().collect();
        outer.sort_unstable();
        outer.dedup();
        let units: Vec<Vec<usize>> = std::iter::once(outer).chain(groups.blocks.iter().cloned()).collect();
        let own = &sharding.ownership;
        let owns: Vec<Ownership> = units.iter().map(|u| own.restricted(u)).collect();
        let tensors = &model.params.tensors;
        let chunk = sharding.chunk.max(1);
        Ok(Self {
            units,
            owns,
            all: own.clone(),
            nbytes: tensors.iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).collect(),
            whole: vec![true; tensors.len()],
            owned: (0..tensors.len()).map(|i| own.owner(i) == sharding.rank).collect(),
            chunk,
            pieces: Pieces::new(world, chunk, device)?,
            overlap: overlap && world > 1,
            pending: None,
            reducing: None,
        })
    }

    /// The parameters of `unit`.
    pub fn unit(&self, unit: usize) -> &[usize] {
        &self.units[unit]
    }

    /// Frees the memory of `unit`'s parameters this rank does not own.
    pub fn release(&mut self, model: &Model, unit: usize) -> Result<(), TchError> {
        for &i in &self.units[unit] {
            if !self.owned[i] && self.whole[i] {
                resize_storage(&model.params.tensors[i], 0).map_err(|e| TchError::Torch(e.to_string()))?;
                self.whole[i] = false;
            }
        }
        Ok(())
    }

    /// Frees every parameter this rank does not own (the start of an attempt).
    pub fn release_all(&mut self, model: &Model) -> Result<(), TchError> {
        (self.pending, self.reducing) = (None, None);
        (0..self.units.len()).try_for_each(|u| self.release(model, u))
    }

    /// Memory again for `params` that were freed, zeroed (a padded vocabulary's rows, which no
    /// gather writes, stay zero). An out-of-memory here is an ordinary failed attempt.
    fn allocate(&mut self, model: &Model, params: &[usize]) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        for &i in params {
            if !self.whole[i] {
                let t = &model.params.tensors[i];
                resize_storage(t, self.nbytes[i]).map_err(|e| TchError::Torch(e.to_string()))?;
                self.whole[i] = true;
                let _ = t.shallow_clone().f_zero_()?;
            }
        }
        Ok(())
    }

    /// `unit`'s parameters gathered from their owners into this rank's model: the gather
    /// [`ParameterShards::prefetch`] started for it, completed, or else memory for them, the
    /// ranks' word and the gather. Ok(false): a peer's attempt failed, leave it.
    pub fn gather(&mut self, model: &Model, lock: &mut Lockstep, unit: usize) -> Result<bool, TchError> {
        if let Some(g) = self.pending.take() {
            let prefetched = g.unit == unit;
            Self::finish(lock, g)?;
            if prefetched {
                return Ok(true);
            }
        }
        let params = self.units[unit].clone();
        self.allocate(model, &params)?;
        let Some(d) = lock.dist else { return Ok(true) };
        if !lock.well()? {
            return Ok(false);
        }
        let tensors = self.tensors(model, unit)?;
        lock.collective(d.gather_pieces(&tensors, &self.owns[unit], self.chunk, &self.pieces))?;
        Ok(true)
    }

    /// Under `dist.overlap` with peers: memory for block unit `unit`'s parameters, the ranks'
    /// word, and its gather started, left running while the caller computes; the next
    /// [`ParameterShards::gather`] of it completes it. Until then its parameters must not be
    /// read. Otherwise nothing (that gather does it all). Ok(false): a peer's attempt failed.
    pub fn prefetch(&mut self, model: &Model, lock: &mut Lockstep, unit: usize) -> Result<bool, TchError> {
        let (Some(d), true, true) = (lock.dist, self.overlap, unit != OUTER) else { return Ok(true) };
        if let Some(g) = self.pending.take() {
            Self::finish(lock, g)?;
        }
        let params = self.units[unit].clone();
        self.allocate(model, &params)?;
        if !lock.well()? {
            return Ok(false);
        }
        let tensors = self.tensors(model, unit)?;
        let started = lock.collective(d.start_gather(&tensors, &self.owns[unit]))?;
        self.pending = Some(Gathering { unit, started });
        Ok(true)
    }

    /// Waits for `gathering`: its parameters are in place.
    fn finish(lock: &mut Lockstep, gathering: Gathering) -> Result<(), TchError> {
        let d = lock.dist.expect("a gather started with peers");
        lock.collective(d.finish(gathering.started))
    }

    fn tensors(&self, model: &Model, unit: usize) -> Result<Vec<Tensor>, TchError> {
        self.units[unit].iter().map(|&i| model.user_tensor(i)).collect()
    }

    /// `grads` (one per parameter of `unit`, as the optimizer shapes them; None: no gradient
    /// here, or a micro-step this rank has no samples for) summed over the ranks into `accs`,
    /// the accumulators of the parameters this rank owns (indexed by parameter; None for the
    /// others). Under `dist.overlap` a block's are reduced to their owners one a parameter, and
    /// left running while the next block's backward computes: the next call, or
    /// [`ParameterShards::settle`], adds them in. Ok(false): a peer's attempt failed, leave it.
    pub fn reduce_scatter(
        &mut self,
        lock: &mut Lockstep,
        unit: usize,
        grads: &[Option<Tensor>],
        accs: &[Option<Tensor>],
    ) -> Result<bool, TchError> {
        let Some(d) = lock.dist else {
            // One process: its gradients are the sums.
            for (&i, g) in self.units[unit].iter().zip(grads) {
                if let (Some(acc), Some(g)) = (&accs[i], g) {
                    let _ = acc.shallow_clone().f_add_(&g.f_reshape([-1])?)?;
                }
            }
            return Ok(true);
        };
        // The previous block's sums first: the accumulators' order, and its memory back.
        self.settle(lock, accs)?;
        if self.overlap && unit != OUTER {
            // fp32 and flat before the word (a copy only for 16-bit gradients); zeros where this
            // rank has none, as the pieces' zeroed slots are.
            let device = self.pieces.device();
            let flats: Vec<Tensor> = grads
                .iter()
                .zip(self.owns[unit].numels())
                .map(|(g, &n)| match g {
                    Some(g) => g.f_to_kind(Kind::Float)?.f_contiguous()?.f_view([-1]),
                    None => Tensor::f_zeros([n], (Kind::Float, device)),
                })
                .collect::<Result<_, _>>()?;
            if !lock.well()? {
                return Ok(false);
            }
            let started = lock.collective(d.start_reduce(&flats, &self.owns[unit]))?;
            self.reducing = Some(Reducing { unit, flats, started });
            return Ok(true);
        }
        // Contiguous before the word: a flat view of each then allocates nothing.
        let flats: Vec<Option<Tensor>> = grads
            .iter()
            .map(|g| g.as_ref().map(|g| g.f_contiguous()?.f_view([-1])).transpose())
            .collect::<Result<_, _>>()?;
        if !lock.well()? {
            return Ok(false);
        }
        let mine: Vec<Option<Tensor>> =
            self.units[unit].iter().map(|&i| accs[i].as_ref().map(Tensor::shallow_clone)).collect();
        lock.collective(d.scatter_pieces(&flats, &mine, &self.owns[unit], self.chunk, &self.pieces))?;
        Ok(true)
    }

    /// The reduces [`ParameterShards::reduce_scatter`] left running, completed: this rank's
    /// sums added into `accs`.
    pub fn settle(&mut self, lock: &mut Lockstep, accs: &[Option<Tensor>]) -> Result<(), TchError> {
        let Some(Reducing { unit, flats, started }) = self.reducing.take() else { return Ok(()) };
        let d = lock.dist.expect("reduces started with peers");
        lock.collective(d.finish(started))?;
        for (&i, flat) in self.units[unit].iter().zip(&flats) {
            if let Some(acc) = &accs[i] {
                let _ = acc.shallow_clone().f_add_(flat)?;
            }
        }
        Ok(())
    }

    /// Every parameter whole on every rank again: memory for the freed ones and one gather of
    /// all from their owners (after the update, or after a failed attempt the ranks agreed on).
    pub fn restore_all(&mut self, model: &Model, dist: Option<&Dist>) -> Result<(), DistError> {
        // What a failed attempt left running completes first; this gather writes them all.
        (self.pending, self.reducing) = (None, None);
        let all: Vec<usize> = (0..self.whole.len()).collect();
        self.allocate(model, &all).map_err(torch_error("parameter gather"))?;
        let Some(d) = dist else { return Ok(()) };
        let params = model.optimizer_params().map_err(torch_error("parameter gather"))?;
        d.gather_pieces(&params, &self.all, self.chunk, &self.pieces)
    }

    /// Per parameter: an fp32 accumulator of its optimizer-shaped gradient when this rank owns
    /// it, zeroed.
    pub fn accumulators(&self, model: &Model) -> Result<Vec<Option<Tensor>>, TchError> {
        (0..self.whole.len())
            .map(|i| {
                let n: i64 = model.user_shape(i).iter().product();
                self.owned[i].then(|| Tensor::f_zeros([n], (Kind::Float, self.pieces.device()))).transpose()
            })
            .collect()
    }
}

/// The ranks' word before each collective of an attempt under `dist.shard: parameters`.
pub struct Lockstep<'a> {
    dist: Option<&'a Dist>,
    /// Words said so far, and in the whole attempt (the same on every rank).
    said: usize,
    total: usize,
    /// A collective failed: the group is broken, no word follows.
    broken: bool,
}

impl<'a> Lockstep<'a> {
    pub fn new(dist: Option<&'a Dist>, total: usize) -> Self {
        Self { dist, said: 0, total, broken: false }
    }

    /// This rank is well; whether every rank is.
    fn well(&mut self) -> Result<bool, TchError> {
        self.word(0.0)
    }

    fn word(&mut self, failed: f64) -> Result<bool, TchError> {
        self.said += 1;
        let Some(d) = self.dist else { return Ok(true) };
        let worst = d.max(failed).map_err(|e| {
            self.broken = true;
            TchError::Torch(e.to_string())
        })?;
        Ok(worst == 0.0)
    }

    fn collective<T>(&mut self, r: Result<T, DistError>) -> Result<T, TchError> {
        r.map_err(|e| {
            self.broken = true;
            TchError::Torch(e.to_string())
        })
    }

    /// This rank's work failed: its peers, waiting at the next word, hear it there (when the
    /// attempt has one left; past the last they meet this rank at the step's agreement).
    pub fn fail(&mut self) {
        if !self.broken && self.said < self.total && self.dist.is_some() {
            let _ = self.word(1.0);
        }
        self.said = self.total;
    }
}
