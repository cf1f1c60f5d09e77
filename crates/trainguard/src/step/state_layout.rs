//! Where the optimizer's state lives and how an update reaches it: whole on this rank (the
//! default), only this rank's parameters' under `dist.shard`, and in host memory under
//! `memory.offload_optimizer` (the update then runs on the host, on fp32 copies of the
//! parameters, and the new weights are copied back). Owns the building of the optimizer for
//! that layout, the update through it, the names of the state a checkpoint of this rank holds,
//! and moving an optimizer's state into another layout (the OOM guard's escalations).
use crate::config::{Escalation, ShardLevel};
use crate::distributed::shard::Sharding;
use crate::distributed::zero3::ParameterShards;
use crate::model::Model;
use crate::optim::{Optimizer, OptimizerSpec};
use tch::{Device, TchError, Tensor};

/// What a run asks for: `dist.shard` on this rank of `world`, and `memory.offload_optimizer`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayoutSpec {
    pub shard: ShardLevel,
    pub rank: usize,
    pub world: usize,
    /// Elements per rank in each piece of the sharded collectives (from `dist.bucket_mb`).
    pub chunk: i64,
    pub offload: bool,
    /// `dist.overlap`: under `parameters`, the next block's gather overlaps this one's compute.
    pub overlap: bool,
}

impl Default for LayoutSpec {
    fn default() -> Self {
        Self { shard: ShardLevel::None, rank: 0, world: 1, chunk: 1 << 20, offload: false, overlap: true }
    }
}

impl LayoutSpec {
    /// With the OOM guard's escalations `done` switched on (those that move optimizer state).
    pub fn escalated(self, done: &[Escalation]) -> Self {
        done.iter().fold(self, |s, e| match e {
            Escalation::OffloadOptimizer => Self { offload: true, ..s },
            Escalation::ShardOptimizer => Self { shard: s.shard.max(ShardLevel::Optimizer), ..s },
            Escalation::ShardGradients => Self { shard: s.shard.max(ShardLevel::Gradients), ..s },
            Escalation::ShardParameters => Self { shard: s.shard.max(ShardLevel::Parameters), ..s },
            Escalation::ActivationCheckpointing | Escalation::OffloadActivations => s,
        })
    }

    /// Elements per rank in a piece of about `bucket_mb` MiB of fp32 over all ranks.
    pub fn chunk_for(bucket_mb: f64, world: usize) -> i64 {
        ((bucket_mb * (1 << 20) as f64 / 4.0) as i64 / world.max(1) as i64).max(1)
    }
}

/// The layout a [`crate::step::Trainable`]'s optimizer was built for.
pub struct StateLayout {
    /// What the run configured; `spec` is that with the OOM guard's escalations applied.
    pub base: LayoutSpec,
    pub spec: LayoutSpec,
    /// The layout the ranks last agreed they all hold: a move that failed on one rank alone
    /// leaves their `spec`s apart until they agree again (crate::step::engine).
    pub agreed: LayoutSpec,
    opt_spec: OptimizerSpec,
    pub shard: Option<Sharding>,
    /// Under offload: the host copies of the parameters the optimizer updates (this rank's own
    /// under sharding), in the optimizer's order.
    host: Option<Vec<Tensor>>,
    /// Under offload on a GPU: pinned host buffers the gradients come down into, one a host copy,
    /// made once (a pageable copy each step would fault its pages in again, and cross the bus at
    /// a fraction of the pinned speed).
    staged: Option<Vec<Tensor>>,
    /// `dist.shard: parameters`: what each unit gathers, and the collectives' buffers.
    pub params: Option<ParameterShards>,
}

impl StateLayout {
    /// The optimizer for `model` in the layout `spec` asks for, and that layout.
    pub fn build(
        spec: LayoutSpec,
        opt_spec: &OptimizerSpec,
        model: &Model,
        device: Device,
    ) -> Result<(Optimizer, Self), TchError> {
        let params = model.optimizer_params()?;
        let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        let shard = Sharding::new(spec.shard, &numels, spec.rank, spec.world, spec.chunk);
        let shards = parameter_shards(shard.as_ref(), spec, model, device)?;
        let layout = Self {
            base: spec,
            spec,
            agreed: spec,
            opt_spec: *opt_spec,
            shard,
            host: None,
            staged: None,
            params: shards,
        };
        let (opt, host) = layout.optimizer_for(opt_spec, model, &params, device)?;
        let staged = staging_for(host.as_deref(), device)?;
        Ok((opt, Self { host, staged, ..layout }))
    }

    /// Moves `opt`'s state into the layout `spec` (an escalation of the OOM guard): this rank's
    /// parameters' state is copied into an optimizer built for the new layout, which replaces
    /// `opt` only once it holds it, so a failure (an out-of-memory building it) leaves `opt`
    /// and this layout as they were, for the guard to handle.
    pub fn change_to(
        &mut self,
        spec: LayoutSpec,
        opt: &mut Optimizer,
        model: &Model,
        device: Device,
    ) -> Result<(), TchError> {
        let params = model.optimizer_params()?;
        let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        let shard = Sharding::new(spec.shard, &numels, spec.rank, spec.world, spec.chunk);
        let shards = parameter_shards(shard.as_ref(), spec, model, device)?;
        let next = Self { spec, shard, host: None, staged: None, params: shards, ..*self };
        let keep = next.state_names(&model.params.names);
        // Each state tensor is named `<kind>.<parameter name>`: what the new layout keeps.
        let saved: Vec<(String, Tensor)> = opt
            .state_tensors(&self.state_names(&model.params.names))
            .into_iter()
            .filter(|(key, _)| {
                keep.iter().any(|n| key.strip_suffix(n.as_str()).is_some_and(|k| k.ends_with('.')))
            })
            .collect();
        let steps = opt.steps();
        // The state this rank no longer keeps is freed before the new state is made (at the
        // micro-batch floor the two together may not fit): from here a failure cannot go back.
        let placeholder = Optimizer::for_owned(&self.opt_spec, model, &[], &[], device)?;
        drop(std::mem::replace(opt, placeholder));
        let moved =
            next.optimizer_for(&self.opt_spec, model, &params, device).and_then(|(mut fresh, host)| {
                fresh.load_state(&keep, &saved, steps).map_err(TchError::Torch)?;
                let staged = staging_for(host.as_deref(), device)?;
                Ok((fresh, host, staged))
            });
        let (fresh, host, staged) = moved.map_err(|e| {
            // Not an out-of-memory the guard could replay: the old layout's state is gone.
            let text = e.to_string();
            let first = match crate::guard::classify(&text) {
                crate::guard::ErrorKind::OutOfMemory { .. } => "it ran out of memory".to_string(),
                _ => text.lines().next().unwrap_or_default().to_string(),
            };
            TchError::Torch(format!("oom.escalate could not move the optimizer state into its new layout ({first}); the part this rank gave up was freed, so the run stops here: resume from the newest checkpoint (--resume auto)"))
        })?;
        *opt = fresh;
        *self = Self { host, staged, ..next };
        self.refresh_host(model)
    }

    /// An optimizer for this layout's parameters (fresh state), and the host copies it updates.
    fn optimizer_for(
        &self,
        opt_spec: &OptimizerSpec,
        model: &Model,
        params: &[Tensor],
        device: Device,
    ) -> Result<(Optimizer, Option<Vec<Tensor>>), TchError> {
        let owned: Vec<usize> = match &self.shard {
            Some(s) => s.owned.clone(),
            None => (0..params.len()).collect(),
        };
        let mine: Vec<Tensor> = owned.iter().map(|&i| params[i].shallow_clone()).collect();
        if !self.spec.offload {
            return Ok((Optimizer::for_owned(opt_spec, model, &owned, &mine, device)?, None));
        }
        let host = mine.iter().map(|p| host_copy(p, device)).collect::<Result<Vec<_>, _>>()?;
        let cpu_spec = OptimizerSpec { cuda_kernel: false, ..*opt_spec };
        Ok((Optimizer::for_owned(&cpu_spec, model, &owned, &host, Device::Cpu)?, Some(host)))
    }

    /// The sharding of gradients (`dist.shard: gradients`): each rank receives its own only.
    pub fn shards_gradients(&self) -> Option<&Sharding> {
        self.shard.as_ref().filter(|s| s.level >= ShardLevel::Gradients)
    }

    /// `items` cut to what this rank's optimizer holds, in its order.
    pub fn mine(&self, tensors: Vec<Tensor>) -> Vec<Tensor> {
        match &self.shard {
            Some(s) => s.pick_tensors(&tensors),
            None => tensors,
        }
    }

    /// The parameters this rank's optimizer updates, as it sees them (views of the model's):
    /// only those, since under `dist.shard: parameters` the others' memory is freed mid-step.
    fn my_params(&self, model: &Model) -> Result<Vec<Tensor>, TchError> {
        match &self.shard {
            Some(s) => s.owned.iter().map(|&i| model.user_tensor(i)).collect(),
            None => model.optimizer_params(),
        }
    }

    /// The names of the parameters whose state this rank's optimizer holds.
    pub fn state_names(&self, names: &[String]) -> Vec<String> {
        match &self.shard {
            Some(s) => s.pick(names),
            None => names.to_vec(),
        }
    }

    /// One update of this rank's parameters with `grads` (theirs, in the optimizer's order). On
    /// the host under offload: the gradients go down, the updated weights come back.
    pub fn update(
        &self,
        model: &Model,
        opt: &mut Optimizer,
        grads: &[Tensor],
        lr: f64,
    ) -> Result<(), TchError> {
        let params = self.my_params(model)?;
        let Some(host) = &self.host else { return opt.step(&params, grads, lr) };
        if let Some(staged) = &self.staged {
            return update_through_pinned(&params, host, staged, opt, grads, lr);
        }
        let down: Vec<Tensor> = grads
            .iter()
            .zip(host)
            .map(|(g, h)| g.f_to_device(Device::Cpu)?.f_to_kind(h.kind()))
            .collect::<Result<_, _>>()?;
        opt.step(host, &down, lr)?;
        let _no_grad = tch::no_grad_guard();
        for (p, h) in params.iter().zip(host) {
            p.shallow_clone().f_copy_(h)?;
        }
        Ok(())
    }

    /// The host copies taken again from the parameters (after a checkpoint or `init_from` wrote
    /// new weights into the model): the update must start from what the model holds.
    pub fn refresh_host(&self, model: &Model) -> Result<(), TchError> {
        let Some(host) = &self.host else { return Ok(()) };
        let _no_grad = tch::no_grad_guard();
        for (h, p) in host.iter().zip(self.my_params(model)?) {
            h.shallow_clone().f_copy_(&p)?;
        }
        Ok(())
    }
}

/// The offloaded update on a GPU. The gradients' copies down are queued one after another into
/// the pinned buffers and waited for once; the host updates its copies; the new weights' copies
/// up are queued and not waited for: the next step's work queues behind them on the stream, and
/// the host writes its copies again only after the next step's wait for its gradients, by then
/// past every copy queued before it.
fn update_through_pinned(
    params: &[Tensor],
    host: &[Tensor],
    staged: &[Tensor],
    opt: &mut Optimizer,
    grads: &[Tensor],
    lr: f64,
) -> Result<(), TchError> {
    let shim = |e: crate::ffi::ShimError| TchError::Torch(e.to_string());
    let _no_grad = tch::no_grad_guard();
    for (g, s) in grads.iter().zip(staged) {
        crate::ffi::copy_async(s, g).map_err(shim)?;
    }
    if let Some(Device::Cuda(i)) = grads.first().map(Tensor::device) {
        tch::Cuda::synchronize(i as i64);
    }
    opt.step(host, staged, lr)?;
    for (p, h) in params.iter().zip(host) {
        crate::ffi::copy_async(p, h).map_err(shim)?;
    }
    Ok(())
}

/// The pinned buffers the gradients come down into under offload on a GPU (None elsewhere: on
/// the CPU the gradients already are in host memory).
fn staging_for(host: Option<&[Tensor]>, device: Device) -> Result<Option<Vec<Tensor>>, TchError> {
    match host {
        Some(host) if device.is_cuda() => Ok(Some(
            host.iter()
                .map(|h| Tensor::f_empty(h.size().as_slice(), (h.kind(), Device::Cpu))?.f_pin_memory(device))
                .collect::<Result<_, _>>()?,
        )),
        _ => Ok(None),
    }
}

/// The units and buffers of `dist.shard: parameters`; None at the other levels.
fn parameter_shards(
    shard: Option<&Sharding>,
    spec: LayoutSpec,
    model: &Model,
    device: Device,
) -> Result<Option<ParameterShards>, TchError> {
    match shard {
        Some(s) if s.level == ShardLevel::Parameters => {
            Ok(Some(ParameterShards::new(model, s, spec.world, spec.overlap, device)?))
        }
        _ => Ok(None),
    }
}

/// An fp32-master copy of `p` in host memory: a tensor of its own (also on a CPU run, where the
/// update then works on it as it would on a GPU's), pinned when `p` is on a GPU so the copies
/// back and forth run at the bus's speed.
fn host_copy(p: &Tensor, device: Device) -> Result<Tensor, TchError> {
    let _no_grad = tch::no_grad_guard();
    let mut host = Tensor::f_empty(p.size().as_slice(), (p.kind(), Device::Cpu))?;
    if device.is_cuda() {
        host = host.f_pin_memory(device)?;
    }
    host.f_copy_(p)?;
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OptimizerName;
    use tch::Kind;

    /// The offloaded update through the staging buffers (a GPU's path; on the CPU its copies are
    /// the ordinary ones) equals the optimizer's update of the weights themselves: the gradients
    /// reach the host's update through the buffers, and the weights the host computed come back.
    #[test]
    fn the_update_through_the_staging_buffers_is_the_update_of_the_weights() {
        // Values without the global generator, which other tests seed and draw from.
        let values = |shape: &[i64], k: f64| {
            Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu))
                .g_mul_scalar(k)
                .sin()
                .view(shape)
        };
        let spec = OptimizerSpec::with_defaults(OptimizerName::Adamw, true);
        let shapes: [&[i64]; 2] = [&[8, 4], &[4]];
        let weights: Vec<Tensor> = shapes.iter().map(|s| values(s, 0.7)).collect();
        let direct: Vec<Tensor> = weights.iter().map(Tensor::copy).collect();
        let (offloaded, host): (Vec<Tensor>, Vec<Tensor>) =
            weights.iter().map(|w| (w.copy(), w.copy())).unzip();
        let staged: Vec<Tensor> = weights.iter().map(Tensor::zeros_like).collect();
        let decay = [true, false];
        let mut opt_direct = Optimizer::new(&spec, &direct, &decay, Device::Cpu).unwrap();
        let mut opt_host = Optimizer::new(&spec, &host, &decay, Device::Cpu).unwrap();
        for step in 0..3 {
            let grads: Vec<Tensor> = shapes.iter().map(|s| values(s, 1.3 + step as f64)).collect();
            opt_direct.step(&direct, &grads, 1e-2).unwrap();
            update_through_pinned(&offloaded, &host, &staged, &mut opt_host, &grads, 1e-2).unwrap();
        }
        for (d, o) in direct.iter().zip(&offloaded) {
            assert!(d.equal(o), "the weights after three offloaded updates");
        }
        assert!(!direct[0].equal(&weights[0]), "the updates moved the weights");
    }
}
