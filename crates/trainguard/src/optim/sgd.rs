//! Stochastic gradient descent, with or without heavy-ball momentum: the maths of
//! `torch.optim.SGD` (dampening 0, no Nesterov), including its coupled weight decay (`wd·p` is
//! added to the gradient, unlike AdamW's decoupled decay), applied only to parameters whose
//! `decay` flag is set. Owns the momentum buffers. Two update paths with the same maths: ATen's
//! fused kernel (`at::_fused_sgd_` through the shim, as `torch.optim.SGD(fused=True)`: one pass
//! per tensor, two calls a step; the default) and one built from tch ops, where −lr and the decay
//! live in two 0-dim tensors so that every update is one in-place `addcmul_`. Neither makes a
//! full-size temporary.
use super::state::{bytes, check_lengths, decay_groups, pick, restore};
use crate::ffi::kernels;
use tch::{Device, Kind, TchError, Tensor};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// `None`: plain SGD, no state. `Some(μ)`: one momentum buffer per parameter, which the
    /// first step sets to the gradient (as PyTorch does) and later steps update as `μ·buf + g`.
    pub momentum: Option<f64>,
    /// Coupled L2 decay (PyTorch's `weight_decay`), for parameters whose `decay` flag is set.
    pub weight_decay: f64,
    /// Use ATen's fused kernel.
    pub fused: bool,
}

pub struct Sgd {
    pub cfg: SgdConfig,
    /// One per parameter with momentum; empty without.
    pub momentum_buffer: Vec<Tensor>,
    /// Updates applied so far.
    pub steps: u64,
    decay: Vec<bool>,
    /// 0-dim: −lr of the current step, refilled each step (a fill is a kernel, not an allocation).
    neg_lr: Tensor,
    /// 0-dim: the weight decay, for `buf += wd·p` in one kernel.
    weight_decay: Tensor,
}

impl Sgd {
    pub fn new(cfg: SgdConfig, params: &[Tensor], decay: &[bool], device: Device) -> Result<Self, TchError> {
        let momentum_buffer = match cfg.momentum {
            Some(_) => params.iter().map(Tensor::f_zeros_like).collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        let mut weight_decay = Tensor::f_zeros([], (Kind::Float, device))?;
        let _ = weight_decay.f_fill_(cfg.weight_decay)?;
        Ok(Self {
            cfg,
            momentum_buffer,
            steps: 0,
            decay: decay.to_vec(),
            neg_lr: Tensor::f_zeros([], (Kind::Float, device))?,
            weight_decay,
        })
    }

    /// Applies one update with learning rate `lr` from `grads` (same order as `params`).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        check_lengths(params, grads, self.decay.len())?;
        let first = self.steps == 0;
        self.steps = self.steps.saturating_add(1);
        let wd = self.cfg.weight_decay;
        // ATen 2.11's CPU kernel leaves bf16 and fp16 tensors of 16 values or more unchanged
        // (its vectorised loop drops the update; `torch._fused_sgd_` shows it in Python): on
        // the CPU only fp32 parameters (every mixed precision's) take it.
        let fused_works = params.iter().all(|p| p.device().is_cuda() || p.kind() == Kind::Float);
        if self.cfg.fused && fused_works {
            // Momentum 0 is plain SGD's update, which ATen's kernel computes only without
            // buffers (with them it refuses momentum 0). The buffers still get what the
            // tensor-op path leaves in them, so that either path resumes the other.
            let mu = self.cfg.momentum.filter(|&mu| mu != 0.0);
            if self.cfg.momentum.is_some() && mu.is_none() {
                self.copy_gradients_with_decay_into_buffers(params, grads, wd)?;
            }
            for (with_decay, idx) in decay_groups(&self.decay) {
                let bufs = mu.map(|_| pick(&self.momentum_buffer, &idx));
                let wd = if with_decay { wd } else { 0.0 };
                kernels::fused_sgd(
                    &pick(params, &idx),
                    &pick(grads, &idx),
                    bufs.as_deref(),
                    wd,
                    mu.unwrap_or(0.0),
                    lr,
                    first,
                )?;
            }
            return Ok(());
        }
        let _ = self.neg_lr.f_fill_(-lr)?;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let mut p = p.shallow_clone();
            let decays = self.decay[i] && wd != 0.0;
            match self.cfg.momentum {
                // p − lr·(g + wd·p) = p·(1 − lr·wd) − lr·g: the same update without a temporary
                // for g + wd·p (the rounding differs from PyTorch's by an ulp or so).
                None => {
                    if decays {
                        let _ = p.f_mul_scalar_(1.0 - lr * wd)?;
                    }
                    let _ = p.f_addcmul_(g, &self.neg_lr)?;
                }
                Some(mu) => {
                    let buf = &mut self.momentum_buffer[i];
                    if first {
                        buf.f_copy_(g)?;
                    } else {
                        let _ = buf.f_mul_scalar_(mu)?;
                        let _ = buf.f_add_(g)?;
                    }
                    if decays {
                        let _ = buf.f_addcmul_(&p, &self.weight_decay)?;
                    }
                    let _ = p.f_addcmul_(buf, &self.neg_lr)?;
                }
            }
        }
        Ok(())
    }

    /// What the tensor-op path leaves in the buffers at momentum 0 (`0·buf + g + wd·p`, the
    /// weights before the update): read only by a resume at another momentum.
    fn copy_gradients_with_decay_into_buffers(
        &mut self,
        params: &[Tensor],
        grads: &[Tensor],
        wd: f64,
    ) -> Result<(), TchError> {
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let buf = &mut self.momentum_buffer[i];
            buf.f_copy_(g)?;
            if self.decay[i] && wd != 0.0 {
                let _ = buf.f_addcmul_(p, &self.weight_decay)?;
            }
        }
        Ok(())
    }

    /// The momentum buffers as `momentum_buffer.<param>` (nothing for plain SGD).
    pub fn state_tensors(&self, names: &[String]) -> Vec<(String, Tensor)> {
        self.momentum_buffer
            .iter()
            .zip(names)
            .map(|(b, n)| (format!("momentum_buffer.{n}"), b.shallow_clone()))
            .collect()
    }

    /// Restores buffers saved by [`state_tensors`](Self::state_tensors) and the update count.
    pub fn load_state(
        &mut self,
        names: &[String],
        saved: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), String> {
        let _no_grad = tch::no_grad_guard();
        for (buf, n) in self.momentum_buffer.iter_mut().zip(names) {
            restore(buf, saved, &format!("momentum_buffer.{n}"))?;
        }
        self.steps = steps;
        Ok(())
    }

    pub fn state_bytes(&self) -> u64 {
        self.momentum_buffer.iter().map(bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `p` decays, `q` does not; three steps with the gradients of `REFERENCE_*`.
    fn run(momentum: Option<f64>, fused: bool) -> (Vec<f32>, f32) {
        let (p, q) = (Tensor::from_slice(&[1.0f32, -2.0, 3.0]), Tensor::from_slice(&[0.5f32]));
        let params = [p.shallow_clone(), q.shallow_clone()];
        let mut opt =
            Sgd::new(SgdConfig { momentum, weight_decay: 0.1, fused }, &params, &[true, false], Device::Cpu)
                .unwrap();
        for g in [[0.5f32, -1.0, 2.0], [0.1, 0.2, -0.3], [-1.0, 0.0, 1.0]] {
            opt.step(&params, &[Tensor::from_slice(&g), Tensor::from_slice(&g[..1])], 0.1).unwrap();
        }
        (Vec::try_from(&p).unwrap(), q.double_value(&[0]) as f32)
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{what}: got {got:?}, want {want:?}");
        }
    }

    /// Reference numbers from PyTorch 2.11 (`torch.optim.SGD`, for-loop implementation):
    /// ```python
    /// p = torch.tensor([1.0, -2.0, 3.0], requires_grad=True); q = torch.tensor([0.5], requires_grad=True)
    /// opt = torch.optim.SGD([{"params": [p], "weight_decay": 0.1}, {"params": [q], "weight_decay": 0.0}],
    ///                       lr=0.1, momentum=MOMENTUM, foreach=False)   # MOMENTUM = 0.0, then 0.9
    /// for g in ([0.5, -1.0, 2.0], [0.1, 0.2, -0.3], [-1.0, 0.0, 1.0]):
    ///     p.grad = torch.tensor(g); q.grad = torch.tensor(g[:1]); opt.step()
    /// print(p.tolist(), q.tolist())
    /// ```
    #[allow(clippy::excessive_precision)] // PyTorch's printout, verbatim
    const REFERENCE_PLAIN: ([f32; 3], f32) = ([1.011_394_02, -1.862_388_01, 2.644_577_03], 0.540_000_021);
    #[allow(clippy::excessive_precision)]
    const REFERENCE_MOMENTUM: ([f32; 3], f32) = ([0.891_873_956, -1.659_348_01, 2.255_416_87], 0.445_499_986);

    #[test]
    fn plain_sgd_matches_torch_optim_sgd_with_coupled_decay_on_flagged_parameters_only() {
        for fused in [true, false] {
            let (p, q) = run(None, fused);
            assert_close(&p, &REFERENCE_PLAIN.0, &format!("decayed, fused={fused}"));
            assert_close(&[q], &[REFERENCE_PLAIN.1], &format!("not decayed, fused={fused}"));
        }
    }

    #[test]
    fn momentum_matches_torch_optim_sgd() {
        for fused in [true, false] {
            let (p, q) = run(Some(0.9), fused);
            assert_close(&p, &REFERENCE_MOMENTUM.0, &format!("decayed, fused={fused}"));
            assert_close(&[q], &[REFERENCE_MOMENTUM.1], &format!("not decayed, fused={fused}"));
        }
    }

    /// The fused kernel after a resume: buffers restored, the next step is not a first step (a
    /// first step would overwrite the buffers with the gradient).
    #[test]
    fn a_resumed_fused_run_continues_the_momentum() {
        let names = ["p".to_string(), "q".to_string()];
        let grads = [[0.5f32, -1.0, 2.0], [0.1, 0.2, -0.3], [-1.0, 0.0, 1.0]];
        let make = || [Tensor::from_slice(&[1.0f32, -2.0, 3.0]), Tensor::from_slice(&[0.5f32])];
        let cfg = SgdConfig { momentum: Some(0.9), weight_decay: 0.1, fused: true };
        let step = |opt: &mut Sgd, params: &[Tensor], g: &[f32; 3]| {
            opt.step(params, &[Tensor::from_slice(g), Tensor::from_slice(&g[..1])], 0.1).unwrap()
        };
        let (straight, resumed) = (make(), make());
        let mut a = Sgd::new(cfg, &straight, &[true, false], Device::Cpu).unwrap();
        grads.iter().for_each(|g| step(&mut a, &straight, g));
        let mut b = Sgd::new(cfg, &resumed, &[true, false], Device::Cpu).unwrap();
        step(&mut b, &resumed, &grads[0]);
        let mut c = Sgd::new(cfg, &resumed, &[true, false], Device::Cpu).unwrap();
        c.load_state(&names, &b.state_tensors(&names), b.steps).unwrap();
        grads[1..].iter().for_each(|g| step(&mut c, &resumed, g));
        assert!(
            straight.iter().zip(&resumed).all(|(x, y)| x.equal(y)),
            "a resumed run equals the straight one bit for bit"
        );
    }

    /// bf16 parameters (bf16-pure) on the CPU: the fused setting gives the tensor-op path's
    /// update, where ATen's CPU kernel left every tensor of 16 values or more unchanged.
    #[test]
    fn bf16_parameters_on_the_cpu_are_updated_with_the_fused_setting_too() {
        for momentum in [None, Some(0.9)] {
            let update = |fused: bool| {
                let p = [Tensor::ones([64], (Kind::BFloat16, Device::Cpu))];
                let mut opt =
                    Sgd::new(SgdConfig { momentum, weight_decay: 0.0, fused }, &p, &[true], Device::Cpu)
                        .unwrap();
                for _ in 0..2 {
                    opt.step(&p, &[Tensor::full([64], 0.25, (Kind::BFloat16, Device::Cpu))], 1.0).unwrap();
                }
                p[0].shallow_clone()
            };
            let (fused, plain) = (update(true), update(false));
            assert!(fused.equal(&plain), "momentum {momentum:?}: {fused} vs {plain}");
            assert!(plain.double_value(&[0]) < 0.75, "the weights moved: {plain}");
        }
    }

    /// `optimizer.momentum: 0`, which the config allows: ATen's fused kernel refuses buffers
    /// at momentum 0, so the fused path must give plain SGD's update without them.
    #[test]
    fn momentum_zero_is_plain_sgd_on_both_paths() {
        for fused in [true, false] {
            let (p, q) = run(Some(0.0), fused);
            assert_close(&p, &REFERENCE_PLAIN.0, &format!("decayed, fused={fused}"));
            assert_close(&[q], &[REFERENCE_PLAIN.1], &format!("not decayed, fused={fused}"));
        }
        let buffers = |fused: bool| {
            let params = [Tensor::from_slice(&[1.0f32, -2.0, 3.0])];
            let mut opt = Sgd::new(
                SgdConfig { momentum: Some(0.0), weight_decay: 0.1, fused },
                &params,
                &[true],
                Device::Cpu,
            )
            .unwrap();
            opt.step(&params, &[Tensor::from_slice(&[0.5f32, -1.0, 2.0])], 0.1).unwrap();
            opt.momentum_buffer[0].shallow_clone()
        };
        let (fused, plain) = (buffers(true), buffers(false));
        assert!(fused.equal(&plain), "the paths leave the same buffers: {fused} vs {plain}");
        assert!(plain.abs().sum(Kind::Float).double_value(&[]) > 0.0, "the buffers hold the gradient");
    }

    #[test]
    fn only_momentum_keeps_state() {
        let p = [Tensor::zeros([4, 3], (Kind::Float, Device::Cpu))];
        let plain =
            Sgd::new(SgdConfig { momentum: None, weight_decay: 0.0, fused: true }, &p, &[true], Device::Cpu)
                .unwrap();
        assert_eq!((plain.state_bytes(), plain.state_tensors(&["w".into()]).len()), (0, 0));
        let heavy = Sgd::new(
            SgdConfig { momentum: Some(0.9), weight_decay: 0.0, fused: true },
            &p,
            &[true],
            Device::Cpu,
        )
        .unwrap();
        assert_eq!(heavy.state_bytes(), 12 * 4);
        assert_eq!(heavy.state_tensors(&["w".into()])[0].0, "momentum_buffer.w");
    }
}
