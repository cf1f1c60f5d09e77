//! What the optimizers share about their state: restoring a saved tensor into place (checked
//! against the shape and kind the optimizer built), counting the bytes state occupies, checking
//! that a step was handed one matching gradient per parameter, and grouping tensors by their decay flag
//! for the fused kernels. No update rules here.
use tch::{TchError, Tensor};

/// Copies the tensor saved as `key` into `dst`. A missing key, another shape or another kind is
/// an error (a checkpoint from another optimizer or model must not load silently converted).
pub(crate) fn restore(dst: &mut Tensor, saved: &[(String, Tensor)], key: &str) -> Result<(), String> {
    let src = saved
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, t)| t)
        .ok_or_else(|| format!("optimizer state lacks `{key}`"))?;
    if src.size() != dst.size() {
        return Err(format!("`{key}` has shape {:?}, the model needs {:?}", src.size(), dst.size()));
    }
    if src.kind() != dst.kind() {
        return Err(format!("`{key}` holds {:?}, the optimizer keeps {:?}", src.kind(), dst.kind()));
    }
    dst.f_copy_(src).map_err(|e| e.to_string())
}

/// Bytes the tensor's elements occupy.
pub(crate) fn bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Each gradient has its parameter's shape, dtype and device. Checked before an update touches
/// anything: an update built from several ops would otherwise apply its first ops (a weight
/// decay) and fail in a later one, leaving a half-applied step behind.
pub(crate) fn check_gradients(params: &[Tensor], grads: &[Tensor]) -> Result<(), TchError> {
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        let (ps, gs) = (p.size(), g.size());
        if ps != gs || p.kind() != g.kind() || p.device() != g.device() {
            return Err(TchError::Shape(format!(
                "gradient {i} is {:?} {gs:?} on {:?}, its parameter {:?} {ps:?} on {:?}",
                g.kind(),
                g.device(),
                p.kind(),
                p.device()
            )));
        }
    }
    Ok(())
}

/// A step needs exactly one gradient per parameter, in the order the optimizer was built with.
pub(crate) fn check_lengths(params: &[Tensor], grads: &[Tensor], built_for: usize) -> Result<(), TchError> {
    if params.len() != built_for || grads.len() != built_for {
        return Err(TchError::Shape(format!(
            "the optimizer was built for {built_for} parameters, the step got {} parameters and {} gradients",
            params.len(),
            grads.len()
        )));
    }
    Ok(())
}

/// The indices of the tensors whose decay flag is set, then of the others, each group only when
/// it is not empty: a fused kernel takes one weight decay per call.
pub(crate) fn decay_groups(decay: &[bool]) -> Vec<(bool, Vec<usize>)> {
    [true, false]
        .into_iter()
        .map(|with| (with, (0..decay.len()).filter(|&i| decay[i] == with).collect::<Vec<_>>()))
        .filter(|(_, idx)| !idx.is_empty())
        .collect()
}

/// `ts[i]` for each `i` of `idx`.
pub(crate) fn pick<'a, T: std::borrow::Borrow<Tensor>>(ts: &'a [T], idx: &[usize]) -> Vec<&'a Tensor> {
    idx.iter().map(|&i| ts[i].borrow()).collect()
}
