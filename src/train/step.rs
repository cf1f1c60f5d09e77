//! One optimizer step's gradient computation and the validation loss, each a pure function of
//! (weights, step, micro-batch): the guard can replay them at any micro-batch and get the same
//! samples. Gradients are returned, not left in `.grad`, so a failed attempt leaves nothing
//! behind: dropping the attempt's locals frees them ("set to none", not zeroed).
use crate::batch;
use crate::data::{Corpus, Sampler};
use crate::guard::Progress;
use crate::model::Gpt;
use tch::{Device, TchError, Tensor};

/// Where a rank's samples come from.
pub struct StepData<'a> {
    pub corpus: &'a Corpus,
    pub sampler: Sampler,
    pub device: Device,
    /// This rank's slice of each global batch: global indices `start .. start + len`.
    pub rank_start: usize,
    pub rank_batch: usize,
}

/// Gradients of the mean loss over this rank's batch of step `step`, computed in micro-batches
/// of `micro`, and that loss. Each micro-batch's loss is weighted by its share of the tokens,
/// so the result does not depend on the split.
pub fn forward_backward(model: &Gpt, data: &StepData, step: u64, micro: usize, progress: &mut Progress) -> Result<(Vec<Tensor>, f64), TchError> {
    let params = &model.params.tensors;
    let mut grads: Vec<Tensor> = Vec::new();
    let mut loss_sum: Option<Tensor> = None;
    for r in batch::split(data.rank_batch, micro) {
        let weight = batch::loss_weight(r.len(), data.rank_batch);
        let indices = data.rank_start + r.start..data.rank_start + r.end;
        let (x, y) = data.sampler.train_batch(data.corpus, step, indices, data.device)?;
        let loss = model.loss(&x, &y, true)?.f_mul_scalar(weight)?;
        let micro_grads = Tensor::f_run_backward(&[&loss], params, false, false)?;
        if grads.is_empty() {
            grads = micro_grads;
        } else {
            for (g, m) in grads.iter_mut().zip(&micro_grads) {
                let _ = g.f_add_(m)?;
            }
        }
        let loss = loss.f_detach()?;
        loss_sum = Some(match loss_sum {
            None => loss,
            Some(s) => s.f_add(&loss)?,
        });
        progress.micro_step_done();
    }
    // One host sync per step, after all micro-steps were queued.
    let loss = loss_sum.map(|l| l.f_double_value(&[])).transpose()?.unwrap_or(f64::NAN);
    Ok((grads, loss))
}

/// Mean validation loss over `batches` fixed batches of `batch_size` samples, evaluated in
/// chunks of `micro`.
pub fn evaluate(model: &Gpt, data: &StepData, batches: usize, micro: usize, progress: &mut Progress) -> Result<f64, TchError> {
    let _no_grad = tch::no_grad_guard();
    let mut total = 0.0;
    for b in 0..batches {
        for r in batch::split(data.rank_batch, micro) {
            let weight = batch::loss_weight(r.len(), data.rank_batch);
            let indices = data.rank_start + r.start..data.rank_start + r.end;
            let (x, y) = data.sampler.val_batch(data.corpus, b, indices, data.device)?;
            total += model.loss(&x, &y, false)?.f_double_value(&[])? * weight;
            progress.micro_step_done();
        }
    }
    Ok(total / batches as f64)
}
