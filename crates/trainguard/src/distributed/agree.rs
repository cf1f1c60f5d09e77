//! Data parallel around one guarded attempt: before the gradient all-reduce every rank says
//! whether it ran out of memory, so either all ranks go on together or all drop the attempt and
//! the guard replays it on every rank at the smaller micro-batch. A rank that waited alone in
//! the all-reduce while a peer replayed would hang the group. Without `Dist` both functions
//! return the local result.
//!
//! A second agreement follows the work each rank does alone after the all-reduce (unscaling,
//! clipping): all ranks update, or all replay. The update itself cannot be agreed on (a rank's
//! peers have applied theirs by the time it fails), so an out-of-memory inside it ends a
//! data-parallel run with that said, rather than a replay the peers would not join.
//!
//! A rank whose work failed with any other error still joins the agreement before it stops, so
//! its peers stop at once, naming why, instead of failing in their next collective with only "a
//! rank died or timed out" (on NCCL after `dist.timeout_s`).
use crate::distributed::shard::Sharding;
use crate::distributed::{Dist, LocalOutcome};
use crate::ffi::torch_panics::catch_torch_panics;
use crate::guard::{classify, ErrorKind, StepError};
use std::fmt;
use tch::{TchError, Tensor};

fn is_oom(e: &TchError) -> bool {
    matches!(classify(&e.to_string()), ErrorKind::OutOfMemory { .. })
}

/// What the ranks agreed on: go on with the agreed value, or the error that drops the attempt
/// (this rank's own out-of-memory, or a peer's), or ends the run (this rank's own other error,
/// or a peer's: then no rank replays, since the failed rank will not join the replay; or an
/// out-of-memory on a rank with nothing left to try: then every rank gives up with it).
/// `last_resort`: an out-of-memory here would end this rank's run ([`crate::guard::Progress`]).
fn settle<T>(
    d: &Dist,
    local: Result<T, StepError>,
    last_resort: bool,
    value: impl Fn(&T) -> f64,
) -> Result<(T, f64), StepError> {
    let outcome = match &local {
        Ok(v) => LocalOutcome::Done(value(v)),
        Err(StepError::Torch(e)) if is_oom(e) => LocalOutcome::OutOfMemory { last_resort },
        Err(_) => LocalOutcome::Failed,
    };
    let agreed = d.agree(outcome).map_err(|e| StepError::Fatal(Box::new(e)))?;
    match local {
        Err(e) if outcome == LocalOutcome::Failed => Err(e),
        _ if agreed.failed_ranks > 0 => {
            Err(StepError::Fatal(Box::new(PeerFailed { rank: d.rank, failed_ranks: agreed.failed_ranks })))
        }
        Err(StepError::Torch(e)) if agreed.oom_gives_up => {
            Err(StepError::GroupOutOfMemory { own: Some(e.to_string()) })
        }
        _ if agreed.oom_gives_up => Err(StepError::GroupOutOfMemory { own: None }),
        Err(e) => Err(e),
        Ok(_) if agreed.any_oom => Err(StepError::PeerOutOfMemory),
        Ok(v) => Ok((v, agreed.mean_value)),
    }
}

/// Peers that failed with an error other than an out-of-memory: this rank stops with them.
#[derive(Debug)]
pub struct PeerFailed {
    pub rank: usize,
    pub failed_ranks: usize,
}

impl fmt::Display for PeerFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} stops because {} other rank(s) failed with an error that is not an out-of-memory (their own log and torchelastic's error file name it); resume from the newest checkpoint (--resume auto) once it is fixed",
            self.rank, self.failed_ranks
        )
    }
}

impl std::error::Error for PeerFailed {}

/// This rank's move of its optimizer state into the layout an escalation asks for (`local`),
/// agreed on before any rank runs its attempt in it.
pub fn layout_moved(
    local: Result<(), TchError>,
    dist: Option<&Dist>,
    last_resort: bool,
) -> Result<(), StepError> {
    let Some(d) = dist else { return Ok(local?) };
    settle(d, local.map_err(StepError::Torch), last_resort, |_| 0.0).map(|_| ())
}

/// This rank's gradients and loss (`local`, from `forward_backward`), averaged over the ranks.
pub fn gradients(
    local: Result<(Vec<Tensor>, f64), TchError>,
    dist: Option<&mut Dist>,
    last_resort: bool,
) -> Result<(Vec<Tensor>, f64), StepError> {
    let Some(d) = dist else { return Ok(local?) };
    // Under `dist.overlap` the buckets' all-reduces began inside backward: every rank, its
    // attempt failed or not, starts the rest and waits for all before the agreement, which
    // would otherwise meet a peer's bucket. A failure in them cannot be replayed: fatal.
    fatal_on_error(|| d.reduce_all(local.as_ref().ok().map(|(g, _)| g.as_slice())))?;
    let local = local.and_then(|r| catch_torch_panics(|| d.check_room_to_all_reduce()).map(|()| r));
    let ((mut grads, _), loss) = settle(d, local.map_err(StepError::Torch), last_resort, |(_, loss)| *loss)?;
    // Past the agreement a failure cannot be replayed on one rank alone: any error is fatal.
    fatal_on_error(|| d.average_gradients(&mut grads))?;
    Ok((grads, loss))
}

/// A collective every rank entered after an agreement: any failure in it (a peer gone, an
/// out-of-memory in its buffers) ends the run, since no rank can replay alone.
fn fatal_on_error<T>(f: impl FnOnce() -> Result<T, super::DistError>) -> Result<T, StepError> {
    catch_torch_panics(|| f().map_err(|e| StepError::Fatal(Box::new(e)))).map_err(|e| match e {
        StepError::Torch(e) => StepError::Fatal(Box::new(e)),
        other => other,
    })
}

/// `dist.shard: gradients`: this rank's gradients and loss (`local`: one gradient per
/// optimizer parameter), summed over the ranks with each rank receiving only those of the
/// parameters it owns, averaged: reduce-scattered after the agreement, or under `dist.overlap`
/// reduced into their owners from inside backward. The full gradients are freed when this
/// returns.
pub fn owned_gradients(
    local: Result<(Vec<Tensor>, f64), TchError>,
    dist: Option<&mut Dist>,
    shard: &Sharding,
    last_resort: bool,
) -> Result<(Vec<Tensor>, f64), StepError> {
    let Some(d) = dist else {
        let (grads, loss) = local?;
        return Ok((shard.pick_tensors(&grads), loss));
    };
    if d.overlaps() {
        // Reduced into their owners from inside backward (`dist.overlap`): as with the buckets,
        // every rank starts the rest and waits for all before the agreement.
        fatal_on_error(|| d.reduce_all(local.as_ref().ok().map(|(g, _)| g.as_slice())))?;
        let ((grads, _), loss) = settle(d, local.map_err(StepError::Torch), last_resort, |(_, loss)| *loss)?;
        return Ok((fatal_on_error(|| d.owned_means(&grads, shard))?, loss));
    }
    let ((grads, _), loss) = settle(d, local.map_err(StepError::Torch), last_resort, |(_, loss)| *loss)?;
    // What the reduce-scatter writes into, agreed on before it runs: a rank that cannot make it
    // replays with every other, and the collective allocates nothing.
    let outputs = catch_torch_panics(|| Ok(d.scatter_outputs(&grads, &shard.ownership, shard.chunk)?));
    let (outputs, _) = settle(d, outputs, last_resort, |_| 0.0)?;
    let owned = fatal_on_error(|| d.reduce_scatter_gradients(outputs, &shard.ownership, shard.chunk))?;
    Ok((owned, loss))
}

/// `dist.shard: parameters`: this rank's gradients (its own parameters', summed over the ranks
/// unit by unit inside the micro-steps) and loss, agreed on like the others: every rank goes on,
/// or every rank drops the attempt.
pub fn reduced_gradients(
    local: Result<(Vec<Tensor>, f64), TchError>,
    dist: Option<&Dist>,
    last_resort: bool,
) -> Result<(Vec<Tensor>, f64), StepError> {
    let Some(d) = dist else { return Ok(local?) };
    let ((grads, _), loss) = settle(d, local.map_err(StepError::Torch), last_resort, |(_, loss)| *loss)?;
    Ok((grads, loss))
}

/// The global gradient norm from each rank's squared norm of its own gradients (`local`), agreed
/// like the work before the update: a rank that ran out of memory computing its part replays
/// with every other.
pub fn global_norm(
    local: Result<f64, StepError>,
    dist: Option<&Dist>,
    last_resort: bool,
) -> Result<f64, StepError> {
    let Some(d) = dist else { return Ok(local?.sqrt()) };
    let (_, mean) = settle(d, local, last_resort, |sq| *sq)?;
    Ok((mean * d.world_size as f64).sqrt())
}

/// After every rank applied the update to its own parameters: each rank's put back on all,
/// through `pieces` (made before the update was agreed on).
pub fn parameters_gathered(
    model: &crate::model::Model,
    shard: &Sharding,
    dist: Option<&Dist>,
    pieces: Option<&super::zero::Pieces>,
) -> Result<(), StepError> {
    let (Some(d), Some(pieces)) = (dist, pieces) else { return Ok(()) };
    let params = model.optimizer_params()?;
    fatal_on_error(|| d.all_gather_parameters(&params, &shard.ownership, shard.chunk, pieces))
}

/// This rank's validation loss (`local`, from `evaluate`), averaged over the ranks.
pub fn validation_loss(
    local: Result<f64, TchError>,
    dist: Option<&Dist>,
    last_resort: bool,
) -> Result<f64, StepError> {
    let Some(d) = dist else { return Ok(local?) };
    Ok(settle(d, local.map_err(StepError::Torch), last_resort, |v| *v)?.1)
}

/// What a rank found between the gradient all-reduce and the update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prepared {
    pub grad_norm: f64,
    /// fp16: the scaled gradients overflowed.
    pub overflow: bool,
    /// Loss and gradient norm finite: this rank would apply the update.
    pub applied: bool,
}

/// The second agreement, after what each rank did alone between the gradient all-reduce and
/// the update (`local`: the clipping's result, or its error). The ranks also agree on the update
/// itself: all apply it or none does (a rank whose loss or gradients turned non-finite on its
/// own would otherwise skip while its peers apply: replicas that silently differ), and an
/// overflow on any rank is one on all (their loss scalers stay equal).
pub fn before_update(
    local: Result<Prepared, StepError>,
    dist: Option<&Dist>,
    last_resort: bool,
) -> Result<Prepared, StepError> {
    let Some(d) = dist else { return local };
    // Each rank's flags in one number: not applied counts 1, an overflow `world + 1`; the sum
    // over ranks then reads back both counts exactly.
    let radix = (d.world_size + 1) as f64;
    let flags = |p: &Prepared| f64::from(u8::from(!p.applied)) + radix * f64::from(u8::from(p.overflow));
    let (mine, mean) = settle(d, local, last_resort, flags)?;
    let sum = (mean * d.world_size as f64).round();
    let (overflows, skips) = ((sum / radix).floor(), sum % radix);
    Ok(Prepared { applied: mine.applied && skips == 0.0, overflow: mine.overflow || overflows > 0.0, ..mine })
}

/// An update that failed on one rank of several after its peers went on with theirs.
#[derive(Debug)]
pub struct UpdateOutOfMemory {
    pub rank: usize,
    pub message: String,
}

impl fmt::Display for UpdateOutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} ran out of memory inside the optimizer update, after the ranks had agreed to apply it: its peers applied theirs, so the step cannot be replayed on every rank; resume from the newest checkpoint (--resume auto), with a smaller train.micro_batch_size or an optimizer that needs less memory. libtorch: {}",
            self.rank,
            self.message.lines().next().unwrap_or_default()
        )
    }
}

impl std::error::Error for UpdateOutOfMemory {}

/// The update's result. One process replays an update that ran out of memory like any other
/// attempt (the optimizers count a step only once it succeeded); with peers that is impossible.
pub fn update_done(update: Result<(), TchError>, dist: Option<&Dist>) -> Result<(), StepError> {
    match (update, dist) {
        (Err(e), Some(d)) if is_oom(&e) => {
            Err(StepError::Fatal(Box::new(UpdateOutOfMemory { rank: d.rank, message: e.to_string() })))
        }
        (r, _) => Ok(r?),
    }
}
