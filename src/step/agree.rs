//! Data parallel around one guarded attempt: before the gradient all-reduce every rank says
//! whether it ran out of memory, so either all ranks go on together or all drop the attempt and
//! the guard replays it on every rank at the smaller micro-batch. A rank that waited alone in
//! the all-reduce while a peer replayed would hang the group. Without `Dist` both functions
//! return the local result.
use crate::dist::Dist;
use crate::guard::{classify, ErrorKind, StepError};
use tch::{TchError, Tensor};

fn is_oom<T>(local: &Result<T, TchError>) -> bool {
    matches!(local, Err(e) if matches!(classify(&e.to_string()), ErrorKind::OutOfMemory { .. }))
}

/// What the ranks agreed on: go on with the agreed value, or the error that drops the attempt
/// (this rank's own out-of-memory, or a peer's).
fn settle<T>(d: &Dist, local: Result<T, TchError>, value: impl Fn(&T) -> f64) -> Result<(T, f64), StepError> {
    let local_oom = is_oom(&local);
    let local = match local {
        Err(e) if !local_oom => return Err(e.into()),
        other => other,
    };
    let agreed = d.agree(local_oom, local.as_ref().map_or(0.0, value)).map_err(|e| StepError::Fatal(Box::new(e)))?;
    match (agreed.any_oom, local) {
        (false, Ok(v)) => Ok((v, agreed.mean_value)),
        (_, Err(e)) => Err(StepError::Torch(e)),
        (true, Ok(_)) => Err(StepError::PeerOutOfMemory),
    }
}

/// This rank's gradients and loss (`local`, from `forward_backward`), averaged over the ranks.
pub fn gradients(local: Result<(Vec<Tensor>, f64), TchError>, dist: Option<&mut Dist>) -> Result<(Vec<Tensor>, f64), StepError> {
    let Some(d) = dist else { return Ok(local?) };
    let ((mut grads, _), loss) = settle(d, local, |(_, loss)| *loss)?;
    d.average_gradients(&mut grads).map_err(|e| StepError::Fatal(Box::new(e)))?;
    Ok((grads, loss))
}

/// This rank's validation loss (`local`, from `evaluate`), averaged over the ranks.
pub fn validation_loss(local: Result<f64, TchError>, dist: Option<&Dist>) -> Result<f64, StepError> {
    let Some(d) = dist else { return Ok(local?) };
    Ok(settle(d, local, |v| *v)?.1)
}
