//! The optimizer a run uses, chosen by `optimizer.name`: one enum over the implementations so
//! that the trainer steps, checkpoints and accounts for memory the same way whichever it is.
//! Owns the mapping from configuration to implementation; not the update rules.
use super::adafactor::{Adafactor, AdafactorConfig, Path as AdafactorPath};
use super::adamw::{AdamW, AdamWConfig};
use super::adamw8bit::{AdamW8bit, AdamW8bitConfig, Path as AdamW8bitPath};
use super::muon::{Muon, MuonConfig};
use super::sgd::{Sgd, SgdConfig};
use crate::config::{KernelsConfig, OptimizerConfig, OptimizerName, TrainConfig};
use crate::ffi::torch_panics::catch_torch_panics;
use tch::{Device, TchError, Tensor};

/// Everything that picks and parameterises an optimizer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerSpec {
    pub name: OptimizerName,
    /// AdamW and SGD: ATen's fused kernels. The other optimizers ignore it.
    pub fused: bool,
    /// 8-bit AdamW and Adafactor on CUDA: our NVRTC-compiled kernels (`kernels.cuda_optimizers`)
    /// instead of tensor ops. The others ignore it.
    pub cuda_kernel: bool,
    /// `sgd_momentum` only; `sgd` has none whatever this says.
    pub momentum: f64,
    /// AdamW and 8-bit AdamW. Adafactor has no first moment and its own decay schedule and
    /// epsilons (PyTorch's defaults), so it uses none of these three.
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled for AdamW, 8-bit AdamW and Adafactor; coupled (added to the gradient) for SGD,
    /// as in PyTorch. Only parameters whose `decay` flag is set decay.
    pub weight_decay: f64,
    /// Muon's own settings (the others ignore them).
    pub muon: MuonSettings,
}

/// `optimizer.muon_*`, with the matrices' rate as a multiple of `train.lr`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonSettings {
    pub lr_scale: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub ns_steps: usize,
}

impl OptimizerSpec {
    /// `name` with the config's default hyperparameters and no CUDA kernels: for measurements
    /// and tests, where the values do not matter but must be the same each time.
    pub fn with_defaults(name: OptimizerName, fused: bool) -> Self {
        let defaults = Self::from_config(
            &OptimizerConfig::default(),
            &TrainConfig::default(),
            &KernelsConfig::default(),
        );
        Self { name, fused, cuda_kernel: false, ..defaults }
    }

    pub fn from_config(optimizer: &OptimizerConfig, train: &TrainConfig, kernels: &KernelsConfig) -> Self {
        Self {
            name: optimizer.name,
            fused: optimizer.fused,
            cuda_kernel: kernels.cuda_optimizers,
            momentum: optimizer.momentum,
            beta1: train.beta1,
            beta2: train.beta2,
            eps: train.eps,
            weight_decay: train.weight_decay,
            muon: MuonSettings {
                lr_scale: optimizer.muon_lr / train.lr,
                momentum: optimizer.muon_momentum,
                nesterov: optimizer.muon_nesterov,
                ns_steps: optimizer.muon_ns_steps,
            },
        }
    }
}

pub enum Optimizer {
    AdamW(AdamW),
    /// `sgd` and `sgd_momentum`.
    Sgd(Sgd),
    Adafactor(Adafactor),
    AdamW8bit(AdamW8bit),
    Muon(Muon),
}

impl Optimizer {
    /// Builds the state for `params` (with their weight-decay flags) on `device`. Muon takes the
    /// 2-D parameters that decay for the matrices it orthogonalises: where a model is at hand,
    /// [`Optimizer::for_model`] tells the LM head (2-D, decayed, but AdamW's) apart.
    pub fn new(
        spec: &OptimizerSpec,
        params: &[Tensor],
        decay: &[bool],
        device: Device,
    ) -> Result<Self, TchError> {
        let matrices: Vec<bool> = params.iter().zip(decay).map(|(p, &d)| d && p.dim() == 2).collect();
        Self::with_matrices(spec, params, decay, &matrices, device)
    }

    /// The optimizer for `model`'s parameters (the user's rows of a padded vocabulary), Muon's
    /// matrices being the blocks' weight matrices.
    pub fn for_model(
        spec: &OptimizerSpec,
        model: &crate::model::Model,
        device: Device,
    ) -> Result<Self, TchError> {
        let params = model.optimizer_params()?;
        Self::with_matrices(spec, &params, &model.params.decay, &model.block_matrices(), device)
    }

    /// The optimizer for the parameters of `model` that this rank owns under `dist.shard`
    /// (whole tensors: see [`crate::distributed::shard`]), holding their state alone. `params`:
    /// the tensors it updates (the owned parameters themselves, or their host copies under
    /// `memory.offload_optimizer`), on `device`.
    pub fn for_owned(
        spec: &OptimizerSpec,
        model: &crate::model::Model,
        owned: &[usize],
        params: &[Tensor],
        device: Device,
    ) -> Result<Self, TchError> {
        let pick = |v: &[bool]| owned.iter().map(|&i| v[i]).collect::<Vec<bool>>();
        Self::with_matrices(spec, params, &pick(&model.params.decay), &pick(&model.block_matrices()), device)
    }

    fn with_matrices(
        spec: &OptimizerSpec,
        params: &[Tensor],
        decay: &[bool],
        matrices: &[bool],
        device: Device,
    ) -> Result<Self, TchError> {
        let OptimizerSpec { name, fused, cuda_kernel, momentum, beta1, beta2, eps, weight_decay, muon } =
            *spec;
        Ok(match name {
            OptimizerName::Adamw => Self::AdamW(AdamW::new(
                AdamWConfig { beta1, beta2, eps, weight_decay, fused },
                params,
                decay,
                device,
            )?),
            OptimizerName::Sgd => {
                Self::Sgd(Sgd::new(SgdConfig { momentum: None, weight_decay, fused }, params, decay, device)?)
            }
            OptimizerName::SgdMomentum => Self::Sgd(Sgd::new(
                SgdConfig { momentum: Some(momentum), weight_decay, fused },
                params,
                decay,
                device,
            )?),
            OptimizerName::Adafactor => {
                let path = AdafactorPath::for_device(device, cuda_kernel);
                Self::Adafactor(Adafactor::with_path(
                    AdafactorConfig { weight_decay, ..AdafactorConfig::default() },
                    params,
                    decay,
                    device,
                    path,
                )?)
            }
            OptimizerName::Adamw8bit => {
                let path = AdamW8bitPath::for_device(device, cuda_kernel);
                Self::AdamW8bit(AdamW8bit::with_path(
                    AdamW8bitConfig { beta1, beta2, eps, weight_decay },
                    params,
                    decay,
                    device,
                    path,
                )?)
            }
            OptimizerName::Muon => Self::Muon(Muon::new(
                MuonConfig {
                    lr_scale: muon.lr_scale,
                    momentum: muon.momentum,
                    nesterov: muon.nesterov,
                    ns_steps: muon.ns_steps,
                    weight_decay,
                    adamw: AdamWConfig { beta1, beta2, eps, weight_decay, fused },
                },
                params,
                decay,
                matrices,
                device,
            )?),
        })
    }

    /// One update with learning rate `lr`; `grads` in the order of `params`. Runs under
    /// `no_grad`; an allocator failure is an `Err`. Once the gradients exist the update makes no
    /// allocation the size of a tensor (scratch is made at construction; at most the few bytes
    /// of workspace a CUDA reduction takes), so it cannot run out of memory half-way with some
    /// parameters updated and others not.
    ///
    /// A failed update is not counted: the guard replays it, and a second count would change
    /// the bias corrections (and SGD's first-step momentum) of every update after it.
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        super::state::check_gradients(params, grads)?;
        let before = self.steps();
        // Caught here, not only in the guard, so a panicking op still counts the update back.
        let result = catch_torch_panics(|| match self {
            Self::AdamW(o) => o.step(params, grads, lr),
            Self::Sgd(o) => o.step(params, grads, lr),
            Self::Adafactor(o) => o.step(params, grads, lr),
            Self::AdamW8bit(o) => o.step(params, grads, lr),
            Self::Muon(o) => o.step(params, grads, lr),
        });
        if result.is_err() {
            self.count_back_to(before);
        }
        result
    }

    /// The update count back to `steps` (on the device too, where a fused kernel reads it).
    fn count_back_to(&mut self, steps: u64) {
        match self {
            Self::AdamW(o) => o.count_back_to(steps),
            Self::Sgd(o) => o.steps = steps,
            Self::Adafactor(o) => o.steps = steps,
            Self::AdamW8bit(o) => o.steps = steps, // its device counter is refilled each update
            Self::Muon(o) => o.count_back_to(steps),
        }
    }

    /// The state as named tensors for `optimizer.safetensors`: `<state kind>.<param name>`
    /// (`exp_avg.h.0.mlp.c_fc.weight`, `momentum_buffer.…`, `row_var.…`, `exp_avg_q8.…`).
    pub fn state_tensors(&self, names: &[String]) -> Vec<(String, Tensor)> {
        match self {
            Self::AdamW(o) => o.state_tensors(names),
            Self::Sgd(o) => o.state_tensors(names),
            Self::Adafactor(o) => o.state_tensors(names),
            Self::AdamW8bit(o) => o.state_tensors(names),
            Self::Muon(o) => o.state_tensors(names),
        }
    }

    /// Restores what [`state_tensors`](Self::state_tensors) saved, and the update count. A
    /// missing tensor, or one of another shape or dtype, is an error naming it.
    pub fn load_state(
        &mut self,
        names: &[String],
        saved: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), String> {
        match self {
            Self::AdamW(o) => o.load_state(names, saved, steps),
            Self::Sgd(o) => o.load_state(names, saved, steps),
            Self::Adafactor(o) => o.load_state(names, saved, steps),
            Self::AdamW8bit(o) => o.load_state(names, saved, steps),
            Self::Muon(o) => o.load_state(names, saved, steps),
        }
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        match self {
            Self::AdamW(o) => o.steps,
            Self::Sgd(o) => o.steps,
            Self::Adafactor(o) => o.steps,
            Self::AdamW8bit(o) => o.steps,
            Self::Muon(o) => o.steps,
        }
    }

    /// The configuration name (`optimizer.name`) of what was built.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::AdamW(_) => "adamw",
            Self::Sgd(o) if o.cfg.momentum.is_some() => "sgd_momentum",
            Self::Sgd(_) => "sgd",
            Self::Adafactor(_) => "adafactor",
            Self::AdamW8bit(_) => "adamw8bit",
            Self::Muon(_) => "muon",
        }
    }

    /// Bytes of the tensors [`state_tensors`](Self::state_tensors) returns (what a checkpoint
    /// holds). Scratch buffers and AdamW's fused-kernel step counters are not counted.
    pub fn state_bytes(&self) -> u64 {
        match self {
            Self::AdamW(o) => o.exp_avg.iter().chain(&o.exp_avg_sq).map(super::state::bytes).sum(),
            Self::Sgd(o) => o.state_bytes(),
            Self::Adafactor(o) => o.state_bytes(),
            Self::AdamW8bit(o) => o.state_bytes(),
            Self::Muon(o) => o.state_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn spec(name: OptimizerName) -> OptimizerSpec {
        OptimizerSpec::with_defaults(name, false)
    }

    #[test]
    fn a_refused_update_changes_and_counts_nothing_and_the_next_is_the_first() {
        for (name, fused) in [
            (OptimizerName::Adamw, true),
            (OptimizerName::Adamw, false),
            (OptimizerName::Sgd, false),
            (OptimizerName::SgdMomentum, false),
            (OptimizerName::Adafactor, false),
            (OptimizerName::Adamw8bit, false),
        ] {
            let fresh = || {
                (0..2)
                    .map(|i| {
                        Tensor::arange(300, (Kind::Float, Device::Cpu))
                            .f_mul_scalar(0.01 * (i + 1) as f64)
                            .unwrap()
                            .reshape([20, 15])
                    })
                    .collect::<Vec<_>>()
            };
            let grads: Vec<Tensor> = (0..2)
                .map(|i| Tensor::ones([20, 15], (Kind::Float, Device::Cpu)) * (0.5 + i as f64))
                .collect();
            let spec = OptimizerSpec { fused, ..spec(name) };
            let (a, b) = (fresh(), fresh());
            let mut failing = Optimizer::new(&spec, &a, &[true, false], Device::Cpu).unwrap();
            let mut plain = Optimizer::new(&spec, &b, &[true, false], Device::Cpu).unwrap();
            // A gradient that does not match its parameter (the decayed one: an update built
            // from ops would have applied the decay before failing) changes nothing.
            for wrong in [Tensor::ones([7], (Kind::Float, Device::Cpu)), grads[0].to_kind(Kind::Double)] {
                let err = failing.step(&a, &[wrong, grads[1].shallow_clone()], 1e-2).unwrap_err().to_string();
                assert!(err.contains("gradient 0 is"), "{name:?} fused {fused}: {err}");
            }
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.equal(y)),
                "{name:?} fused {fused}: a refused update moved a parameter"
            );
            assert_eq!(failing.steps(), 0, "{name:?} fused {fused}: the failed update was counted");
            failing.step(&a, &grads, 1e-2).unwrap();
            plain.step(&b, &grads, 1e-2).unwrap();
            for step in 0..2 {
                if step == 1 {
                    failing.step(&a, &grads, 1e-2).unwrap();
                    plain.step(&b, &grads, 1e-2).unwrap();
                }
                for (x, y) in a.iter().zip(&b) {
                    assert!(x.equal(y), "{name:?} fused {fused}: after the replay the parameters differ from a run that never failed");
                }
            }
            assert_eq!((failing.steps(), plain.steps()), (2, 2));
        }
    }

    /// A failure inside the update, after the count moved on (parameters of a shape AdamW's
    /// moments were not built for: the fused kernel's shape check, or the unfused path's
    /// `lerp_`, which tch raises as a panic): the count goes back, so the next update is the first.
    #[test]
    fn an_update_that_fails_inside_is_counted_back() {
        for fused in [true, false] {
            let spec = OptimizerSpec { fused, ..spec(OptimizerName::Adamw) };
            let fresh = || {
                vec![
                    Tensor::arange(12, (Kind::Float, Device::Cpu)).f_reshape([3, 4]).unwrap(),
                    Tensor::ones([5], (Kind::Float, Device::Cpu)),
                ]
            };
            let grads = [
                Tensor::ones([3, 4], (Kind::Float, Device::Cpu)),
                Tensor::ones([5], (Kind::Float, Device::Cpu)),
            ];
            let (a, b) = (fresh(), fresh());
            let mut failing = Optimizer::new(&spec, &a, &[true, false], Device::Cpu).unwrap();
            let mut plain = Optimizer::new(&spec, &b, &[true, false], Device::Cpu).unwrap();
            let other = [Tensor::zeros([2, 6], (Kind::Float, Device::Cpu)), a[1].shallow_clone()];
            let other_grads = [Tensor::ones([2, 6], (Kind::Float, Device::Cpu)), grads[1].shallow_clone()];
            assert!(failing.step(&other, &other_grads, 1e-2).is_err(), "fused {fused}");
            assert_eq!(failing.steps(), 0, "fused {fused}: the failed update was counted");
            failing.step(&a, &grads, 1e-2).unwrap();
            plain.step(&b, &grads, 1e-2).unwrap();
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.equal(y)),
                "fused {fused}: the next update is not the first"
            );
        }
    }

    #[test]
    fn each_name_builds_its_optimizer() {
        let params = [
            Tensor::zeros([64, 64], (Kind::Float, Device::Cpu)),
            Tensor::zeros([64], (Kind::Float, Device::Cpu)),
        ];
        let want = [
            (OptimizerName::Adamw, "adamw", 2 * 4160 * 4),
            (OptimizerName::Sgd, "sgd", 0),
            (OptimizerName::SgdMomentum, "sgd_momentum", 4160 * 4),
            (OptimizerName::Adafactor, "adafactor", (64 + 64 + 64) * 4),
            (OptimizerName::Adamw8bit, "adamw8bit", 2 * 4096 + 2 * 2 * 4 + 2 * 64 * 4),
        ];
        for (name, kind, bytes) in want {
            let opt = Optimizer::new(&spec(name), &params, &[true, false], Device::Cpu).unwrap();
            assert_eq!((opt.kind(), opt.state_bytes(), opt.steps()), (kind, bytes, 0), "{name:?}");
        }
    }

    #[test]
    fn plain_sgd_ignores_the_configured_momentum() {
        // optimizer.momentum defaults to 0.9 for every optimizer; only sgd_momentum uses it.
        let opt = Optimizer::new(
            &spec(OptimizerName::Sgd),
            &[Tensor::zeros([3], (Kind::Float, Device::Cpu))],
            &[true],
            Device::Cpu,
        )
        .unwrap();
        assert!(matches!(&opt, Optimizer::Sgd(s) if s.cfg.momentum.is_none()));
    }

    #[test]
    fn a_step_with_the_wrong_number_of_gradients_is_an_error() {
        let p = [Tensor::zeros([3], (Kind::Float, Device::Cpu))];
        for name in [OptimizerName::Sgd, OptimizerName::Adafactor, OptimizerName::Adamw8bit] {
            let mut opt = Optimizer::new(&spec(name), &p, &[true], Device::Cpu).unwrap();
            assert!(matches!(opt.step(&p, &[], 0.1), Err(TchError::Shape(_))), "{name:?}");
        }
    }
}
