//! AdamW (Loshchilov & Hutter) with decoupled weight decay, written over tensors so that its
//! moments can be checkpointed. Two update paths with the same maths: ATen's fused kernel
//! (`at::_fused_adamw_` through the shim: one pass over each tensor; the default) and an
//! unfused one built from tch ops. Neither allocates on the device (the unfused path's one
//! temporary lives in a scratch buffer made at construction), so once gradients exist the
//! update cannot run out of memory half-way and leave some parameters updated and others not.
use super::state::{decay_groups, pick};
use crate::ffi::kernels::{self, AdamWHyper};
use tch::{Device, Kind, TchError, Tensor};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Use ATen's fused kernel.
    pub fused: bool,
}

pub struct AdamW {
    pub cfg: AdamWConfig,
    /// First and second moments, one per parameter.
    pub exp_avg: Vec<Tensor>,
    pub exp_avg_sq: Vec<Tensor>,
    /// Updates applied so far (bias correction uses it).
    pub steps: u64,
    decay: Vec<bool>,
    /// Unfused path: the update's one temporary. Fused path: unused (empty).
    scratch: Tensor,
    /// Fused path: the update count as the kernel wants it (a float scalar on the device). The
    /// kernel takes one per parameter but only reads them, so every parameter is given this one:
    /// one increment a step instead of one kernel launch per parameter (148 for GPT-2).
    state_step: Tensor,
}

impl AdamW {
    pub fn new(
        cfg: AdamWConfig,
        params: &[Tensor],
        decay: &[bool],
        device: Device,
    ) -> Result<Self, TchError> {
        let zeros = |p: &Tensor| Tensor::f_zeros_like(p);
        let scratch_len =
            if cfg.fused { 0 } else { params.iter().map(Tensor::numel).max().unwrap_or(1) as i64 };
        Ok(Self {
            cfg,
            exp_avg: params.iter().map(zeros).collect::<Result<_, _>>()?,
            exp_avg_sq: params.iter().map(zeros).collect::<Result<_, _>>()?,
            steps: 0,
            decay: decay.to_vec(),
            // Same dtype as the parameters (bf16 under precision bf16-pure).
            scratch: Tensor::f_empty(
                [scratch_len],
                (params.first().map_or(Kind::Float, Tensor::kind), device),
            )?,
            state_step: Tensor::f_zeros([], (Kind::Float, device))?,
        })
    }

    /// Applies one update with learning rate `lr` from `grads` (same order as `params`).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        self.steps = self.steps.saturating_add(1);
        if self.cfg.fused {
            return self.fused_step(params, grads, lr);
        }
        let AdamWConfig { beta1, beta2, eps, weight_decay, .. } = self.cfg;
        let (bc1, bc2) = (bias_correction(beta1, self.steps), bias_correction(beta2, self.steps));
        // p -= lr/bc1 · m / (√v/√bc2 + eps), written as p += m / tmp with
        // tmp = √v · (-bc1/(lr·√bc2)) − eps·bc1/lr, since addcdiv_ takes no scalar here.
        let scale = -bc1 / (lr * bc2.sqrt());
        let shift = -eps * bc1 / lr;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let mut p = p.shallow_clone();
            let tmp = self.scratch.f_narrow(0, 0, p.numel() as i64)?.f_view(p.size().as_slice())?;
            let _ = self.exp_avg[i].f_lerp_(g, 1.0 - beta1)?;
            let _ = g.f_mul_out(&tmp, g)?;
            let _ = self.exp_avg_sq[i].f_lerp_(&tmp, 1.0 - beta2)?;
            if lr <= 0.0 {
                continue; // moments move, parameters do not (and 0 · ∞ below would make NaN)
            }
            if self.decay[i] && weight_decay > 0.0 {
                let _ = p.f_mul_scalar_(1.0 - lr * weight_decay)?;
            }
            let mut tmp = self.exp_avg_sq[i].f_sqrt_out(&tmp)?;
            let _ = tmp.f_mul_scalar_(scale)?;
            let _ = tmp.f_add_scalar_(shift)?;
            let _ = p.f_addcdiv_(&self.exp_avg[i], &tmp)?;
        }
        Ok(())
    }

    /// The moments as named tensors for a checkpoint: `exp_avg.<param>`, `exp_avg_sq.<param>`.
    pub fn state_tensors(&self, names: &[String]) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * names.len());
        for (i, n) in names.iter().enumerate() {
            out.push((format!("exp_avg.{n}"), self.exp_avg[i].shallow_clone()));
            out.push((format!("exp_avg_sq.{n}"), self.exp_avg_sq[i].shallow_clone()));
        }
        out
    }

    /// Restores moments saved by [`state_tensors`](Self::state_tensors) and the update count.
    pub fn load_state(
        &mut self,
        names: &[String],
        saved: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), String> {
        let _no_grad = tch::no_grad_guard();
        let find = |key: &str| {
            saved
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, t)| t)
                .ok_or_else(|| format!("optimizer state lacks `{key}`"))
        };
        for (i, n) in names.iter().enumerate() {
            for (kind, dst) in [("exp_avg", &mut self.exp_avg[i]), ("exp_avg_sq", &mut self.exp_avg_sq[i])] {
                let src = find(&format!("{kind}.{n}"))?;
                if src.size() != dst.size() {
                    return Err(format!(
                        "`{kind}.{n}` has shape {:?}, the model needs {:?}",
                        src.size(),
                        dst.size()
                    ));
                }
                dst.f_copy_(src).map_err(|e| e.to_string())?;
            }
        }
        self.steps = steps;
        let _ = self.state_step.f_fill_(steps as f64).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// The update count back to `steps` after a failed update, the fused kernel's device
    /// counter with it (a failure to refill it is the failure already being reported).
    pub(crate) fn count_back_to(&mut self, steps: u64) {
        self.steps = steps;
        let _ =
            crate::ffi::torch_panics::catch_torch_panics(|| self.state_step.f_fill_(steps as f64).map(drop));
    }

    fn fused_step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _ = self.state_step.f_add_scalar_(1.0)?;
        let AdamWConfig { beta1, beta2, eps, weight_decay, .. } = self.cfg;
        fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
            ts.iter().collect()
        }
        let h = AdamWHyper { lr, beta1, beta2, weight_decay, eps };
        fused_update(
            &refs(params),
            &refs(grads),
            &refs(&self.exp_avg),
            &refs(&self.exp_avg_sq),
            &self.decay,
            &self.state_step,
            h,
        )
    }
}

/// One AdamW update of the parallel lists `params`, `grads` and their moments (fp32, as AdamW
/// keeps them) by ATen's fused kernel, at the update count in `step`: two kernel calls, the
/// tensors whose `decay` flag is set with `h.weight_decay`, then the others without.
/// `1 − beta^steps`, Adam's bias correction. `steps as i32` wrapped from step 2^31 (a count
/// restored from a checkpoint's `optimizer.steps`): a negative power, a correction below 0 and
/// updates of the wrong sign. Past 2^31 steps `beta^steps` is 0 in f64 for any beta below 1.
pub(super) fn bias_correction(beta: f64, steps: u64) -> f64 {
    1.0 - beta.powi(i32::try_from(steps).unwrap_or(i32::MAX))
}

pub(super) fn fused_update(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avg: &[&Tensor],
    exp_avg_sq: &[&Tensor],
    decay: &[bool],
    step: &Tensor,
    h: AdamWHyper,
) -> Result<(), TchError> {
    for (with_decay, idx) in decay_groups(decay) {
        let h = AdamWHyper { weight_decay: if with_decay { h.weight_decay } else { 0.0 }, ..h };
        kernels::fused_adamw(
            &pick(params, &idx),
            &pick(grads, &idx),
            &pick(exp_avg, &idx),
            &pick(exp_avg_sq, &idx),
            &vec![step; idx.len()],
            h,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused kernel refuses mismatched shapes (the shim's check) after the device counter
    /// moved on: counting back puts it where it was, so the replayed update is the first.
    #[test]
    fn counting_back_after_a_failed_fused_update_restores_the_device_counter() {
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, fused: true };
        let fresh = || {
            vec![
                Tensor::arange(12, (Kind::Float, Device::Cpu)).f_reshape([3, 4]).unwrap(),
                Tensor::ones([5], (Kind::Float, Device::Cpu)),
            ]
        };
        let grads =
            [Tensor::ones([3, 4], (Kind::Float, Device::Cpu)), Tensor::ones([5], (Kind::Float, Device::Cpu))];
        let (a, b) = (fresh(), fresh());
        let mut failing = AdamW::new(cfg, &a, &[true, false], Device::Cpu).unwrap();
        let mut plain = AdamW::new(cfg, &b, &[true, false], Device::Cpu).unwrap();
        let wrong = [Tensor::ones([4, 3], (Kind::Float, Device::Cpu)), grads[1].shallow_clone()];
        assert!(failing.step(&a, &wrong, 1e-2).is_err());
        assert_eq!(
            failing.state_step.double_value(&[]),
            1.0,
            "the kernel's counter moved before the failure"
        );
        failing.count_back_to(0);
        failing.step(&a, &grads, 1e-2).unwrap();
        plain.step(&b, &grads, 1e-2).unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| x.equal(y)), "the replayed update is the first update");
    }

    /// Reference numbers from PyTorch 2.11 (`torch.optim.AdamW`, default for-loop implementation):
    /// ```python
    /// p = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    /// opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    /// for g in ([0.5, -1.0, 2.0], [0.1, 0.2, -0.3], [-1.0, 0.0, 1.0]):
    ///     p.grad = torch.tensor(g); opt.step()
    /// print(p.tolist())
    /// ```
    /// An update count near 2^64 (a checkpoint's `optimizer.steps`) updates as any large one
    /// does: its bias correction is 1, not a wrapped power.
    #[test]
    fn a_huge_update_count_updates_as_a_large_one_does() {
        assert_eq!(bias_correction(0.9, 1 << 31), 1.0);
        assert_eq!(bias_correction(0.9, u64::MAX), 1.0);
        for fused in [false, true] {
            let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, fused };
            let updated = |steps: u64| {
                let p = Tensor::from_slice(&[1.0f32, -2.0]);
                let mut opt = AdamW::new(cfg, &[p.shallow_clone()], &[true], Device::Cpu).unwrap();
                opt.count_back_to(steps);
                opt.step(&[p.shallow_clone()], &[Tensor::from_slice(&[0.5f32, -1.0])], 0.1).unwrap();
                Vec::<f32>::try_from(&p).unwrap()
            };
            for steps in [(1 << 31) - 1, u64::MAX - 1, u64::MAX] {
                assert_eq!(updated(steps), updated(1_000_000), "fused={fused}, {steps} steps before");
            }
        }
    }

    #[test]
    fn a_zero_learning_rate_leaves_parameters_finite_and_unchanged() {
        for fused in [false, true] {
            let p = Tensor::from_slice(&[1.0f32, 2.0]);
            let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, fused };
            let mut opt = AdamW::new(cfg, &[p.shallow_clone()], &[true], Device::Cpu).unwrap();
            opt.step(&[p.shallow_clone()], &[Tensor::from_slice(&[0.5f32, 0.0])], 0.0).unwrap();
            assert_eq!(Vec::<f32>::try_from(&p).unwrap(), [1.0, 2.0], "fused={fused}");
        }
    }

    #[test]
    fn both_paths_match_torch_optim_adamw() {
        for fused in [false, true] {
            let p = Tensor::from_slice(&[1.0f32, -2.0, 3.0]);
            let q = Tensor::from_slice(&[0.5f32]); // no decay: checks the second group too
            let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, fused };
            let params = [p.shallow_clone(), q.shallow_clone()];
            let mut opt = AdamW::new(cfg, &params, &[true, false], Device::Cpu).unwrap();
            for g in [[0.5f32, -1.0, 2.0], [0.1, 0.2, -0.3], [-1.0, 0.0, 1.0]] {
                opt.step(&params, &[Tensor::from_slice(&g), Tensor::from_slice(&g[..1])], 0.1).unwrap();
            }
            let got: Vec<f32> = Vec::try_from(&p).unwrap();
            for (a, b) in got.iter().zip(REFERENCE) {
                assert!((a - b).abs() < 1e-5, "fused={fused}: got {got:?}, want {REFERENCE:?}");
            }
            let q: Vec<f32> = Vec::try_from(&q).unwrap();
            assert!((q[0] - REFERENCE_NO_DECAY).abs() < 1e-5, "fused={fused}: {q:?}");
        }
    }

    const REFERENCE: [f32; 3] = [0.820_167_8, -1.750_912_7, 2.689_962_1];
    /// The same three steps on `q = [0.5]` with gradients 0.5, 0.1, -1.0 and weight_decay=0.
    const REFERENCE_NO_DECAY: f32 = 0.347_066_2;
}
