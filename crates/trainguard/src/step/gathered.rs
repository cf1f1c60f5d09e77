//! The micro-steps of `dist.shard: parameters`: the forward and backward of one rank's share of
//! a step while it holds only the parameters it owns ([`crate::distributed::zero3`] gathers the
//! others unit by unit and reduce-scatters each unit's gradients as soon as its backward is
//! done).
//!
//! The body runs as activation checkpointing runs it, at every block: the forward under no-grad
//! keeping each block's input (in host memory under `memory.offload_activations`), then block
//! by block from the last, the block's weights gathered again, its forward recomputed and its
//! gradient pushed through. A graph kept from the forward would hold every block's weights
//! until the backward, which is what this level is there to avoid. The head and the loss (in
//! chunks under `memory.loss_chunk_tokens`) are the savers' own.
//!
//! Every rank runs the same collectives in the same order, whatever its share of the batch: a
//! rank with fewer micro-batches than the busiest takes part in the missing ones' collectives
//! with nothing of its own to add.
use super::micro::{each_micro_batch, StepData};
use super::savers::{head_backward, offload, push_back, reload, Savers};
use crate::data::batch;
use crate::distributed::zero3::{block_unit, Lockstep, ParameterShards, OUTER};
use crate::distributed::Dist;
use crate::guard::Progress;
use crate::model::Model;
use tch::{TchError, Tensor};

/// Said by a rank that leaves its attempt because a peer's failed (never seen outside).
const PEER_LEFT: &str = "a peer's attempt failed";

/// The gradients of this rank's share of step `step` (micro-batches of `micro`, the loss scaled
/// by `scale`) summed over the ranks and averaged, for the parameters this rank owns only (in
/// parameter order, as the optimizer shapes them), and this rank's loss. A rank that left
/// because a peer's attempt failed returns no gradients and a NaN loss: the agreement that
/// follows drops the attempt on every rank.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Model,
    data: &StepData,
    step: u64,
    micro: usize,
    savers: &Savers,
    scale: f64,
    progress: &mut Progress,
    shards: &mut ParameterShards,
    dist: Option<&Dist>,
) -> Result<(Vec<Tensor>, f64), TchError> {
    let busiest = batch::rank_share(data.global_batch, data.world).unwrap_or(data.rank_batch);
    let (mine, all) = (batch::micro_steps(data.rank_batch, micro), batch::micro_steps(busiest, micro));
    // Per micro-step: the outer unit's gather, each block's two gathers and reduce-scatter, the
    // outer unit's reduce-scatter.
    let words = all * (3 * model.n_blocks() + 2);
    let mut lock = Lockstep::new(dist, words);
    let mut left = false;
    let result = (|| -> Result<Option<(Vec<Tensor>, f64)>, TchError> {
        shards.release_all(model)?;
        let accs = shards.accumulators(model)?;
        let mut loss_sum: Option<Tensor> = None;
        let ran = each_micro_batch(data, step, micro, progress, |x, y, weight, seed| {
            let step = MicroStep { model, savers, accs: &accs };
            match step.run(shards, &mut lock, Some((x, y, weight * scale, seed)))? {
                Some(loss) => {
                    loss_sum = Some(match loss_sum.take() {
                        None => loss,
                        Some(sum) => sum.f_add(&loss)?,
                    });
                    Ok(())
                }
                None => {
                    left = true;
                    Err(TchError::Torch(PEER_LEFT.into()))
                }
            }
        });
        match ran {
            Err(_) if left => return Ok(None),
            other => other?,
        }
        for _ in mine..all {
            if (MicroStep { model, savers, accs: &accs }).run(shards, &mut lock, None)?.is_none() {
                return Ok(None);
            }
        }
        let world = dist.map_or(1, |d| d.world_size) as f64;
        let mut grads = Vec::new();
        for (i, acc) in accs.into_iter().enumerate() {
            if let Some(mut acc) = acc {
                let _ = acc.f_mul_scalar_(1.0 / world)?;
                let p = model.user_tensor(i)?;
                grads.push(acc.f_to_kind(p.kind())?.f_view(p.size().as_slice())?);
            }
        }
        let loss = loss_sum.map(|l| l.f_double_value(&[])).transpose()?.map_or(f64::NAN, |l| l / scale);
        Ok(Some((grads, loss)))
    })();
    match result {
        Ok(Some(done)) => Ok(done),
        Ok(None) => Ok((Vec::new(), f64::NAN)),
        Err(e) => {
            lock.fail();
            Err(e)
        }
    }
}

/// One micro-step's work on this rank.
struct MicroStep<'a> {
    model: &'a Model,
    savers: &'a Savers,
    accs: &'a [Option<Tensor>],
}

impl MicroStep<'_> {
    /// The forward and backward of `batch` (inputs, targets, loss weight, dropout seed), or,
    /// without one, only the collectives, in the same order. Some(weighted loss; zero without a
    /// batch); None: a peer's attempt failed.
    fn run(
        &self,
        shards: &mut ParameterShards,
        lock: &mut Lockstep,
        batch: Option<(&Tensor, &Tensor, f64, u64)>,
    ) -> Result<Option<Tensor>, TchError> {
        let (model, n) = (self.model, self.model.n_blocks());
        let params = &model.params.tensors;
        let groups = model.param_groups();
        let documents = batch.map(|(x, ..)| model.documents(x)).transpose()?.flatten();
        let documents = documents.as_ref();
        if !shards.gather(model, lock, OUTER)? {
            return Ok(None);
        }
        let mut inputs = Vec::with_capacity(n);
        let mut h = batch
            .map(|(x, _, _, seed)| {
                let _no_grad = tch::no_grad_guard();
                model.embed(x, documents, true, Some(seed))
            })
            .transpose()?;
        for i in 0..n {
            // The next block's gather (dist.overlap) runs while this one computes.
            if !shards.gather(model, lock, block_unit(i))?
                || (i + 1 < n && !shards.prefetch(model, lock, block_unit(i + 1))?)
            {
                return Ok(None);
            }
            if let (Some(x), Some((_, _, _, seed))) = (h.take(), batch) {
                let _no_grad = tch::no_grad_guard();
                inputs.push(if self.savers.offload { offload(&x)? } else { x.shallow_clone() });
                h = Some(model.block(i, &x, documents, true, Some(seed))?);
            }
            shards.release(model, block_unit(i))?;
        }
        let mut grads: Vec<Option<Tensor>> = (0..params.len()).map(|_| None).collect();
        let mut head = None;
        if let (Some(h), Some((_, y, weight, _))) = (h, batch) {
            let hidden = h.f_detach()?.f_set_requires_grad(true)?;
            let groups = &groups.head;
            head = Some(head_backward(
                model,
                &hidden,
                y,
                weight,
                self.savers.loss_chunk_tokens,
                groups,
                &mut grads,
            )?);
        }
        for i in (0..n).rev() {
            // The block below's gather runs while this one's backward does.
            if !shards.gather(model, lock, block_unit(i))?
                || (i > 0 && !shards.prefetch(model, lock, block_unit(i - 1))?)
            {
                return Ok(None);
            }
            if let (Some((_, grad_out)), Some((x, _, _, seed))) = (head.as_mut(), batch) {
                let kept = inputs.pop().expect("one input kept per block");
                let input = reload(&kept, x.device())?.f_detach()?.f_set_requires_grad(true)?;
                drop(kept);
                let out = model.block_graph(i, &input, documents, true, Some(seed))?;
                *grad_out = push_back(&out, grad_out, params, &groups.blocks[i], Some(input), &mut grads)?
                    .expect("the block input's gradient");
            }
            shards.release(model, block_unit(i))?;
            if !self.scatter(shards, lock, block_unit(i), model, &mut grads)? {
                return Ok(None);
            }
        }
        let mut loss = Tensor::from(0.0f64);
        if let (Some((l, grad_out)), Some((x, _, _, seed))) = (head, batch) {
            let e = model.embed(x, documents, true, Some(seed))?;
            push_back(&[e], &grad_out, params, &groups.embed, None, &mut grads)?;
            loss = l;
        }
        if !self.scatter(shards, lock, OUTER, model, &mut grads)? {
            return Ok(None);
        }
        shards.release(model, OUTER)?;
        Ok(Some(loss))
    }

    /// `unit`'s gradients (taken out of `grads`, freed after) reduce-scattered.
    fn scatter(
        &self,
        shards: &mut ParameterShards,
        lock: &mut Lockstep,
        unit: usize,
        model: &Model,
        grads: &mut [Option<Tensor>],
    ) -> Result<bool, TchError> {
        let taken: Vec<Option<Tensor>> = shards
            .unit(unit)
            .to_vec()
            .into_iter()
            .map(|i| grads[i].take().map(|g| model.optimizer_grad(i, &g)).transpose())
            .collect::<Result<_, _>>()?;
        shards.reduce_scatter(lock, unit, &taken, self.accs)
    }
}
