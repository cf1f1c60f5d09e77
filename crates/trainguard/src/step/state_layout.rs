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
        let layout =
            Self { base: spec, spec, agreed: spec, opt_spec: *opt_spec, shard, host: None, params: shards };
        let (opt, host) = layout.optimizer_for(opt_spec, model, &params, device)?;
        Ok((opt, Self { host, ..layout }))
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
        let next = Self { spec, shard, host: None, params: shards, ..*self };
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
                Ok((fresh, host))
            });
        let (fresh, host) = moved.map_err(|e| {
            // Not an out-of-memory the guard could replay: the old layout's state is gone.
            let text = e.to_string();
            let first = match crate::guard::classify(&text) {
                crate::guard::ErrorKind::OutOfMemory { .. } => "it ran out of memory".to_string(),
                _ => text.lines().next().unwrap_or_default().to_string(),
            };
            TchError::Torch(format!("oom.escalate could not move the optimizer state into its new layout ({first}); the part this rank gave up was freed, so the run stops here: resume from the newest checkpoint (--resume auto)"))
        })?;
        *opt = fresh;
        *self = Self { host, ..next };
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
