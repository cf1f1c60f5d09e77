//! The collectives of sharded data parallel (`dist.shard`), over the slot-per-rank layout of
//! [`Ownership`]: gradients summed over ranks with each rank receiving only its own parameters'
//! (reduce-scatter), and every rank's updated parameters put back on all (all-gather).
//!
//! Both run in pieces of at most `chunk` elements per rank, so what they allocate is bounded by
//! `dist.bucket_mb` × world size, not by the model: piece k is, on every rank's slot, the
//! elements `k·chunk ..` of that slot, which c10d's reduce-scatter and all-gather exchange as one
//! flat buffer of `world × len` elements. The buffers are fp32 whatever the precision (as the
//! all-reduce buckets are): a bf16 gradient summed over ranks in bf16 would round at every
//! rank's addition.
use super::shard::Ownership;
use super::{collective, torch_error, Dist, DistError};
use crate::ffi::dist::{ProcessGroup, Work};
use crate::ffi::ShimError;
use tch::{Device, Kind, TchError, Tensor};

/// Where a parameter's elements sit: its owner's slot, from `start` within that slot.
struct Placed {
    owner: usize,
    start: i64,
    len: i64,
}

fn placements(own: &Ownership, numels: &[i64]) -> Vec<Placed> {
    let slot = own.slot();
    own.offsets()
        .iter()
        .zip(numels)
        .enumerate()
        .map(|(i, (&off, &len))| {
            let owner = own.owner(i);
            Placed { owner, start: off - owner as i64 * slot, len }
        })
        .collect()
}

/// The part of `[p.start, p.start + p.len)` inside the piece `[from, from + len)` of a slot, as
/// (offset in the parameter, offset in the piece, length).
fn overlap(p: &Placed, from: i64, len: i64) -> Option<(i64, i64, i64)> {
    let lo = p.start.max(from);
    let hi = (p.start + p.len).min(from + len);
    (lo < hi).then(|| (lo - p.start, lo - from, hi - lo))
}

/// Everything the gradients' reduce-scatter writes into or reads through, allocated before the
/// ranks agree to run it: an out-of-memory making them is then one rank's failed attempt, which
/// every rank replays, and the collective itself allocates nothing.
pub struct ScatterOutputs {
    /// Each gradient flat (a view where it is contiguous).
    flats: Vec<Option<Tensor>>,
    /// Per parameter this rank owns: the fp32 sum, and the gradient returned in its dtype and
    /// shape (a view of the sum when that is fp32).
    sums: Vec<Option<Tensor>>,
    outs: Vec<Tensor>,
    pieces: Pieces,
}

/// The two buffers the pieces go through: `world × len` and `len` fp32 elements, len the piece's
/// (at most `chunk`, at most the slot).
pub struct Pieces {
    wide: Tensor,
    piece: Tensor,
}

impl Pieces {
    /// For `world` ranks and pieces of `len` elements a rank, on `device`.
    pub fn new(world: usize, len: i64, device: Device) -> Result<Self, TchError> {
        Ok(Self {
            wide: Tensor::f_zeros([world.max(1) as i64 * len], (Kind::Float, device))?,
            piece: Tensor::f_zeros([len], (Kind::Float, device))?,
        })
    }

    pub fn device(&self) -> Device {
        self.piece.device()
    }
}

/// Collectives started and left running ([`Dist::start_gather`], [`Dist::start_reduce`]), one
/// a parameter; [`Dist::finish`] waits for them. Dropped unfinished, each is waited for.
pub struct Started {
    works: Vec<Work>,
}

const GATHER: &str = "parameter all-gather";

fn numels_of(params: &[Tensor]) -> Vec<i64> {
    params.iter().map(|p| p.numel() as i64).collect()
}

impl Dist {
    /// What [`Dist::reduce_scatter_gradients`] needs for `grads` (one per parameter, laid out by
    /// `own`).
    pub fn scatter_outputs(
        &self,
        grads: &[Tensor],
        own: &Ownership,
        chunk: i64,
    ) -> Result<ScatterOutputs, TchError> {
        let _no_grad = tch::no_grad_guard();
        let flats = grads.iter().map(|g| g.f_reshape([-1]).map(Some)).collect::<Result<_, _>>()?;
        let device = grads.first().map_or(self.small, |g| g.device());
        let mut outs = Vec::new();
        let sums = grads
            .iter()
            .enumerate()
            .map(|(i, g)| {
                if own.owner(i) != self.rank {
                    return Ok(None);
                }
                let sum = Tensor::f_zeros([g.numel() as i64], (Kind::Float, device))?;
                outs.push(match g.kind() {
                    Kind::Float => sum.f_view(g.size().as_slice())?,
                    kind => Tensor::f_empty(g.size().as_slice(), (kind, device))?,
                });
                Ok(Some(sum))
            })
            .collect::<Result<_, TchError>>()?;
        Ok(ScatterOutputs { flats, sums, outs, pieces: self.pieces(own, chunk, device)? })
    }

    /// Each of the gradients `o` was made for summed over the ranks and divided by the world
    /// size, returned for the parameters this rank owns only, in parameter order (each of its
    /// gradient's shape and dtype).
    pub fn reduce_scatter_gradients(
        &self,
        o: ScatterOutputs,
        own: &Ownership,
        chunk: i64,
    ) -> Result<Vec<Tensor>, DistError> {
        let torch = torch_error("gradient reduce-scatter");
        let _no_grad = tch::no_grad_guard();
        self.scatter_pieces(&o.flats, &o.sums, own, chunk, &o.pieces)?;
        // In place: an fp32 gradient is its accumulator, not a copy of it.
        let scale = 1.0 / self.world_size as f64;
        for (mut sum, out) in o.sums.into_iter().flatten().zip(&o.outs) {
            let _ = sum.f_mul_scalar_(scale).map_err(torch)?;
            if out.kind() != Kind::Float {
                out.shallow_clone()
                    .f_copy_(&sum.f_view(out.size().as_slice()).map_err(torch)?)
                    .map_err(torch)?;
            }
        }
        Ok(o.outs)
    }

    /// Under [`Dist::reduce_into_owners_in_backward`], once [`Dist::reduce_all`] returned: the
    /// gradients (`grads`, one per parameter) of the parameters this rank owns, which hold the
    /// sums over the ranks, divided by the world size in place. The others' are dropped.
    pub fn owned_means(
        &self,
        grads: &[Tensor],
        shard: &super::shard::Sharding,
    ) -> Result<Vec<Tensor>, DistError> {
        let torch = torch_error("gradient reduce");
        let _no_grad = tch::no_grad_guard();
        let owned = shard.pick_tensors(grads);
        for g in &owned {
            let _ = g.shallow_clone().f_mul_scalar_(1.0 / self.world_size as f64).map_err(torch)?;
        }
        Ok(owned)
    }

    /// The buffers [`Dist::all_gather_parameters`] goes through, made before the update is
    /// agreed on: after it, a rank that could not make them would leave its peers' updated
    /// parameters ungathered.
    pub fn pieces(&self, own: &Ownership, chunk: i64, device: Device) -> Result<Pieces, TchError> {
        Pieces::new(self.world_size, chunk.clamp(1, own.slot()), device)
    }

    /// Every rank's owned `params` (laid out by `own`) copied into the others' `params` through
    /// `pieces`: after each rank updated its own, all hold the same weights again.
    pub fn all_gather_parameters(
        &self,
        params: &[Tensor],
        own: &Ownership,
        chunk: i64,
        pieces: &Pieces,
    ) -> Result<(), DistError> {
        self.gather_pieces(params, own, chunk, pieces)
    }

    /// Each rank's `params` of `own` put into the others' (the pieces of `chunk` elements per
    /// rank through `pieces`, which nothing else uses meanwhile). Writes only: the destination
    /// parameters' memory must be there.
    pub(super) fn gather_pieces(
        &self,
        params: &[Tensor],
        own: &Ownership,
        chunk: i64,
        pieces: &Pieces,
    ) -> Result<(), DistError> {
        let Pieces { wide, piece } = pieces;
        let torch = torch_error(GATHER);
        let _no_grad = tch::no_grad_guard();
        let placed = placements(own, &numels_of(params));
        let (slot, world) = (own.slot(), self.world_size as i64);
        let chunk = chunk.clamp(1, slot);
        let mut from = 0;
        while from < slot {
            let len = chunk.min(slot - from);
            let mut mine = self.fill_piece(&placed, params, from, len, piece)?;
            let mut all = wide.f_narrow(0, 0, world * len).map_err(torch)?;
            self.group
                .all_gather(&mut all, &mut mine)
                .map_err(collective(GATHER, self.heartbeat.as_ref()))?;
            self.spread_piece(&placed, params, from, len, &all)?;
            from += len;
        }
        Ok(())
    }

    /// Each of `params` (contiguous) sent by its owner under `own` straight into the others'
    /// memory, one broadcast a parameter, started: the collectives run while the caller
    /// computes, through no buffer of ours, and [`Dist::finish`] waits for them. A unit's few
    /// large tensors, not the whole model's: [`Dist::gather_pieces`] does that.
    pub(super) fn start_gather(&self, params: &[Tensor], own: &Ownership) -> Result<Started, DistError> {
        self.start_each(params, own, GATHER, ProcessGroup::broadcast_start)
    }

    /// Each of `flats` (fp32, contiguous; one a parameter of `own`) summed over the ranks into
    /// its owner's, one reduce a parameter, started: once [`Dist::finish`] returns, the owner's
    /// tensor holds the sum (the others' are left undefined).
    pub(super) fn start_reduce(&self, flats: &[Tensor], own: &Ownership) -> Result<Started, DistError> {
        self.start_each(flats, own, "gradient reduce", ProcessGroup::reduce_start)
    }

    /// `start` on each of `tensors`, rooted at its owner under `own`.
    fn start_each(
        &self,
        tensors: &[Tensor],
        own: &Ownership,
        what: &'static str,
        start: impl Fn(&ProcessGroup, &mut Tensor, usize) -> Result<Work, ShimError>,
    ) -> Result<Started, DistError> {
        let works = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| start(&self.group, &mut t.shallow_clone(), own.owner(i)))
            .collect::<Result<_, _>>()
            .map_err(collective(what, self.heartbeat.as_ref()))?;
        Ok(Started { works })
    }

    /// Waits for `started`: what it sends is in place on every rank.
    pub(super) fn finish(&self, started: Started) -> Result<(), DistError> {
        for work in started.works {
            work.wait().map_err(collective("a started collective", self.heartbeat.as_ref()))?;
        }
        Ok(())
    }

    /// This rank's parameters' elements in the piece `[from, from + len)` of its slot, copied
    /// into `piece` (zero elsewhere): what it adds to the gather.
    fn fill_piece(
        &self,
        placed: &[Placed],
        params: &[Tensor],
        from: i64,
        len: i64,
        piece: &Tensor,
    ) -> Result<Tensor, DistError> {
        let torch = torch_error(GATHER);
        let mine = piece.f_narrow(0, 0, len).and_then(|mut p| p.f_zero_()).map_err(torch)?;
        for (i, p) in placed.iter().enumerate().filter(|(_, p)| p.owner == self.rank) {
            if let Some((at, to, n)) = overlap(p, from, len) {
                let src = params[i].f_reshape([-1]).and_then(|f| f.f_narrow(0, at, n)).map_err(torch)?;
                mine.f_narrow(0, to, n).and_then(|mut dst| dst.f_copy_(&src)).map_err(torch)?;
            }
        }
        Ok(mine)
    }

    /// The other ranks' parameters' elements of the piece `[from, from + len)`, gathered in
    /// `all` (rank after rank), written into `params`.
    fn spread_piece(
        &self,
        placed: &[Placed],
        params: &[Tensor],
        from: i64,
        len: i64,
        all: &Tensor,
    ) -> Result<(), DistError> {
        let torch = torch_error(GATHER);
        for (i, p) in placed.iter().enumerate().filter(|(_, p)| p.owner != self.rank) {
            if let Some((at, to, n)) = overlap(p, from, len) {
                let src = all.f_narrow(0, p.owner as i64 * len + to, n).map_err(torch)?;
                write_flat(&params[i], at, &src).map_err(torch)?;
            }
        }
        Ok(())
    }

    /// `flats` (flat gradients of the parameters of `own`; None: zeros) summed over the ranks,
    /// each rank's own added into its `accs` (flat fp32; None for the parameters it does not own).
    pub(super) fn scatter_pieces(
        &self,
        flats: &[Option<Tensor>],
        accs: &[Option<Tensor>],
        own: &Ownership,
        chunk: i64,
        pieces: &Pieces,
    ) -> Result<(), DistError> {
        let Pieces { wide, piece } = pieces;
        const WHAT: &str = "gradient reduce-scatter";
        let torch = torch_error(WHAT);
        let _no_grad = tch::no_grad_guard();
        let numels = own.numels();
        let placed = placements(own, numels);
        let (slot, world) = (own.slot(), self.world_size as i64);
        let chunk = chunk.clamp(1, slot);
        let mut from = 0;
        while from < slot {
            let len = chunk.min(slot - from);
            let mut input = wide.f_narrow(0, 0, world * len).and_then(|mut b| b.f_zero_()).map_err(torch)?;
            for (i, p) in placed.iter().enumerate() {
                if let (Some((at, to, n)), Some(g)) = (overlap(p, from, len), &flats[i]) {
                    input
                        .f_narrow(0, p.owner as i64 * len + to, n)
                        .and_then(|mut dst| dst.f_copy_(&g.f_narrow(0, at, n)?))
                        .map_err(torch)?;
                }
            }
            let mut out = piece.f_narrow(0, 0, len).map_err(torch)?;
            self.group
                .reduce_scatter(&mut out, &mut input)
                .map_err(collective(WHAT, self.heartbeat.as_ref()))?;
            for (i, p) in placed.iter().enumerate().filter(|(_, p)| p.owner == self.rank) {
                if let (Some((at, to, n)), Some(acc)) = (overlap(p, from, len), &accs[i]) {
                    let _ = acc
                        .f_narrow(0, at, n)
                        .and_then(|mut dst| dst.f_add_(&out.f_narrow(0, to, n)?))
                        .map_err(torch)?;
                }
            }
            from += len;
        }
        Ok(())
    }
}

/// Copies `src` into `param`'s elements `at..at + src.numel()` (in its row-major order), in
/// place: `param` may be a view (a padded embedding's rows), whose reshape would be a copy.
fn write_flat(param: &Tensor, at: i64, src: &Tensor) -> Result<(), tch::TchError> {
    if param.is_contiguous() {
        let mut dst = param.f_view([-1])?.f_narrow(0, at, src.numel() as i64)?;
        dst.f_copy_(src)?;
        return Ok(());
    }
    let whole = param.f_reshape([-1])?;
    whole.f_narrow(0, at, src.numel() as i64)?.f_copy_(src)?;
    param.shallow_clone().f_copy_(&whole.f_view(param.size().as_slice())?)?;
    Ok(())
}
