//! AdamW whose moments are stored in 8 bits: per block of 2048 values, one byte per value and one
//! fp32 absmax (codes in `quant`), about a quarter of fp32 AdamW's state. Tensors under 4096
//! elements keep fp32 moments and, when they are fp32, are updated together by ATen's fused
//! AdamW kernel (two launches for GPT-2's ~100 biases and norm weights instead of eight each).
//! Each step dequantises the others' blocks, applies exactly the AdamW update of `adamw`
//! (decoupled weight decay, bias correction), and requantises them with fresh scales. Owns the
//! quantised moments. Two paths compute that ([`Path`]):
//!
//! - The shim's fused kernel (`ffi::kernels::adamw8bit_update`) does a whole tensor in one pass:
//!   on the CPU block by block across threads, each block in registers and L1; on CUDA (with
//!   `kernels.cuda_optimizers`) one launch of our NVRTC-compiled kernel, a CUDA block per block of
//!   values. No scratch either way.
//! - Otherwise on CUDA, tensor ops over runs of blocks in fp32 scratch
//!   (first moment, second moment, one temporary, and a copy of the gradient when it is not
//!   fp32), allocated once at construction for a run of at most `chunk_blocks` blocks, so the
//!   update makes no allocation the size of a tensor and its memory does not grow with the
//!   largest tensor. A run costs ~25 kernel launches whatever its length, so runs are long (16 Mi
//!   values; 4 scratch buffers of 64 MiB at most) and the update is not bound by launches.
//!
//! The CPU tests check the two paths against each other.
use super::adamw::fused_update;
use super::quant::{self, BLOCK, MIN_QUANTISED};
use super::state::{bytes, check_lengths, pick, restore};
use crate::ffi::kernels::{self, AdamW8bitStep, AdamWHyper, QuantisedMoments};
use tch::{Device, Kind, TchError, Tensor};

/// How the quantised tensors are updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The shim's fused kernel (CPU, or CUDA through NVRTC): one pass per tensor, no scratch.
    Fused,
    /// Tensor ops over runs of at most `chunk_blocks` blocks in fp32 scratch.
    Runs { chunk_blocks: i64 },
}

impl Path {
    /// The fused kernel on the CPU, and on CUDA when `cuda_kernel` (`kernels.cuda_optimizers`);
    /// otherwise runs of 8192 blocks (16 Mi values).
    pub fn for_device(device: Device, cuda_kernel: bool) -> Path {
        if device == Device::Cpu || cuda_kernel {
            Path::Fused
        } else {
            Path::Runs { chunk_blocks: 8192 }
        }
    }

    /// Values of a quantised tensor that pass through the scratch at once (0: none do).
    fn run_elements(self) -> i64 {
        match self {
            Path::Fused => 0,
            Path::Runs { chunk_blocks } => chunk_blocks * BLOCK,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW8bitConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Moments of one parameter.
pub enum Moments {
    /// Under [`MIN_QUANTISED`] elements: fp32, as AdamW keeps them.
    Full { exp_avg: Tensor, exp_avg_sq: Tensor },
    /// Flat codes (int8 for the first moment, uint8 for the second) and one fp32 absmax per block.
    Quantised { exp_avg: Tensor, exp_avg_absmax: Tensor, exp_avg_sq: Tensor, exp_avg_sq_absmax: Tensor },
}

pub struct AdamW8bit {
    pub cfg: AdamW8bitConfig,
    pub moments: Vec<Moments>,
    /// Updates applied so far (bias correction uses it).
    pub steps: u64,
    decay: Vec<bool>,
    /// fp32 scratch for one run of blocks: first moment, second moment, a temporary.
    m: Tensor,
    v: Tensor,
    tmp: Tensor,
    /// fp32 copy of a run of the gradient, for parameters that are not fp32 (empty otherwise).
    grad32: Tensor,
    path: Path,
    /// The update count for the fused kernel of the small fp32 tensors (it reads one per tensor).
    state_step: Tensor,
}

impl AdamW8bit {
    /// Elements of each fp32 scratch buffer for parameters of `sizes` (element counts) updated
    /// by `path`: the largest unquantised tensor or run of blocks. There are three buffers, four
    /// when the parameters are not fp32 (the planner counts the same).
    pub fn scratch_elements(sizes: impl IntoIterator<Item = i64>, path: Path) -> i64 {
        let run = path.run_elements();
        sizes.into_iter().map(|n| if n < MIN_QUANTISED { n } else { n.min(run) }).max().unwrap_or(0).max(1)
    }

    /// The default path for `device` (on CUDA the tensor ops; [`with_path`](Self::with_path)
    /// picks the kernel).
    pub fn new(
        cfg: AdamW8bitConfig,
        params: &[Tensor],
        decay: &[bool],
        device: Device,
    ) -> Result<Self, TchError> {
        Self::with_path(cfg, params, decay, device, Path::for_device(device, false))
    }

    /// [`new`](Self::new) with the update path chosen. The fused path on CUDA compiles and loads
    /// the kernel here, so that a missing NVRTC or a driver error stops the run before its first
    /// step, naming the cause.
    pub fn with_path(
        cfg: AdamW8bitConfig,
        params: &[Tensor],
        decay: &[bool],
        device: Device,
        path: Path,
    ) -> Result<Self, TchError> {
        if path == Path::Fused && device.is_cuda() {
            kernels::prepare_cuda(device).map_err(|e| {
                TchError::Torch(format!(
                    "8-bit AdamW's CUDA kernel (kernels.cuda_optimizers) cannot be used: {e}"
                ))
            })?;
        }
        let mut moments = Vec::with_capacity(params.len());
        for p in params {
            let n = p.numel() as i64;
            if n < MIN_QUANTISED {
                let zeros = || Tensor::f_zeros(p.size().as_slice(), (Kind::Float, device));
                moments.push(Moments::Full { exp_avg: zeros()?, exp_avg_sq: zeros()? });
            } else {
                let (exp_avg, exp_avg_absmax) = quant::zeros(n, Kind::Int8, device)?;
                let (exp_avg_sq, exp_avg_sq_absmax) = quant::zeros(n, Kind::Uint8, device)?;
                moments.push(Moments::Quantised { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax });
            }
        }
        let scratch_len = Self::scratch_elements(params.iter().map(|p| p.numel() as i64), path);
        let buf = |len: i64| Tensor::f_empty([len], (Kind::Float, device));
        let grad32_len = if params.iter().all(|p| p.kind() == Kind::Float) { 0 } else { scratch_len };
        Ok(Self {
            cfg,
            moments,
            steps: 0,
            decay: decay.to_vec(),
            m: buf(scratch_len)?,
            v: buf(scratch_len)?,
            tmp: buf(scratch_len)?,
            grad32: buf(grad32_len)?,
            path,
            state_step: Tensor::f_zeros([], (Kind::Float, device))?,
        })
    }

    /// Applies one update with learning rate `lr` from `grads` (same order as `params`).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        check_lengths(params, grads, self.moments.len())?;
        self.steps = self.steps.saturating_add(1);
        let AdamW8bitConfig { beta1, beta2, eps, weight_decay } = self.cfg;
        let (bc1, bc2) = (
            super::adamw::bias_correction(beta1, self.steps),
            super::adamw::bias_correction(beta2, self.steps),
        );
        // As in `AdamW::step`: p −= lr/bc1 · m / (√v/√bc2 + eps), written as p += m / tmp with
        // tmp = √v · (−bc1/(lr·√bc2)) − eps·bc1/lr.
        let rule = Rule {
            beta1,
            beta2,
            shrink: 1.0 - lr * weight_decay,
            scale: -bc1 / (lr * bc2.sqrt()),
            shift: -eps * bc1 / lr,
            apply: lr > 0.0,
        };
        self.fused_small(params, grads, lr)?;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            if self.takes_fused(i, p, g) {
                continue;
            }
            let p = p.f_view([-1])?;
            let g = g.f_view([-1])?;
            let decays = self.decay[i] && weight_decay != 0.0;
            match &mut self.moments[i] {
                Moments::Full { exp_avg, exp_avg_sq } => {
                    let n = p.numel() as i64;
                    let mut tmp = self.tmp.f_narrow(0, 0, n)?;
                    let g = as_fp32(&g, &self.grad32)?;
                    rule.apply(
                        &p,
                        &g,
                        &mut exp_avg.f_view([-1])?,
                        &mut exp_avg_sq.f_view([-1])?,
                        &mut tmp,
                        decays,
                    )?;
                }
                Moments::Quantised { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax } => match self
                    .path
                {
                    Path::Fused => {
                        let moments =
                            QuantisedMoments { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax };
                        let shrink = if decays { rule.shrink } else { 1.0 };
                        let step = AdamW8bitStep {
                            beta1,
                            beta2,
                            shrink,
                            scale: rule.scale,
                            shift: rule.shift,
                            apply: rule.apply,
                        };
                        kernels::adamw8bit_update(&p, &g, moments, step)?;
                    }
                    Path::Runs { chunk_blocks } => {
                        for (start, len, b0, nb) in quant::chunks(p.numel() as i64, chunk_blocks) {
                            let shape = [nb, len / nb];
                            let view = |t: &Tensor| t.f_narrow(0, 0, len)?.f_view(shape);
                            let (mut m, mut v, mut tmp) = (view(&self.m)?, view(&self.v)?, view(&self.tmp)?);
                            let q_m = exp_avg.f_narrow(0, start, len)?.f_view(shape)?;
                            let q_v = exp_avg_sq.f_narrow(0, start, len)?.f_view(shape)?;
                            let mut a_m = exp_avg_absmax.f_narrow(0, b0, nb)?.f_view([nb, 1])?;
                            let mut a_v = exp_avg_sq_absmax.f_narrow(0, b0, nb)?.f_view([nb, 1])?;
                            quant::dequantise_signed(&q_m, &a_m, &mut m, &mut tmp)?;
                            quant::dequantise_unsigned(&q_v, &a_v, &mut v)?;
                            let pc = p.f_narrow(0, start, len)?.f_view(shape)?;
                            let gc = as_fp32(&g.f_narrow(0, start, len)?.f_view(shape)?, &self.grad32)?;
                            rule.apply(&pc, &gc, &mut m, &mut v, &mut tmp, decays)?;
                            quant::quantise_signed(&mut m, &q_m, &mut a_m, &mut tmp)?;
                            quant::quantise_unsigned(&mut v, &q_v, &mut a_v)?;
                        }
                    }
                },
            }
        }
        Ok(())
    }

    /// Tensor `i` is small (fp32 moments) and it and its gradient are fp32: ATen's fused AdamW
    /// kernel updates it ([`fused_small`](Self::fused_small)), the loop leaves it.
    fn takes_fused(&self, i: usize, p: &Tensor, g: &Tensor) -> bool {
        matches!(self.moments[i], Moments::Full { .. }) && p.kind() == Kind::Float && g.kind() == Kind::Float
    }

    /// The small fp32 tensors ([`takes_fused`](Self::takes_fused)), updated by ATen's fused AdamW
    /// kernel (their moments are AdamW's; `adamw::fused_update`): two launches, with and without
    /// weight decay.
    fn fused_small(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let picked: Vec<usize> =
            (0..params.len()).filter(|&i| self.takes_fused(i, &params[i], &grads[i])).collect();
        if picked.is_empty() {
            return Ok(());
        }
        let _ = self.state_step.f_fill_(self.steps as f64)?;
        let (mut m, mut v) = (Vec::with_capacity(picked.len()), Vec::with_capacity(picked.len()));
        for &i in &picked {
            let Moments::Full { exp_avg, exp_avg_sq } = &self.moments[i] else {
                unreachable!("picked are unquantised")
            };
            m.push(exp_avg);
            v.push(exp_avg_sq);
        }
        let decay: Vec<bool> = picked.iter().map(|&i| self.decay[i]).collect();
        let AdamW8bitConfig { beta1, beta2, eps, weight_decay } = self.cfg;
        fused_update(
            &pick(params, &picked),
            &pick(grads, &picked),
            &m,
            &v,
            &decay,
            &self.state_step,
            AdamWHyper { lr, beta1, beta2, weight_decay, eps },
        )
    }

    /// `exp_avg.<param>` / `exp_avg_sq.<param>` (fp32) for small tensors; for quantised ones
    /// `exp_avg_q8.<param>` (int8), `exp_avg_absmax.<param>`, `exp_avg_sq_q8.<param>` (uint8)
    /// and `exp_avg_sq_absmax.<param>` (fp32, one per block). Codes are flat, `numel` long.
    pub fn state_tensors(&self, names: &[String]) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(4 * names.len());
        for (m, n) in self.moments.iter().zip(names) {
            for (kind, t) in Self::named(m) {
                out.push((format!("{kind}.{n}"), t.shallow_clone()));
            }
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
        for (m, n) in self.moments.iter_mut().zip(names) {
            let targets: Vec<(&str, &mut Tensor)> = match m {
                Moments::Full { exp_avg, exp_avg_sq } => {
                    vec![("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
                }
                Moments::Quantised { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax } => vec![
                    ("exp_avg_q8", exp_avg),
                    ("exp_avg_absmax", exp_avg_absmax),
                    ("exp_avg_sq_q8", exp_avg_sq),
                    ("exp_avg_sq_absmax", exp_avg_sq_absmax),
                ],
            };
            for (kind, dst) in targets {
                restore(dst, saved, &format!("{kind}.{n}"))?;
            }
        }
        self.steps = steps;
        Ok(())
    }

    pub fn state_bytes(&self) -> u64 {
        self.moments.iter().flat_map(Self::named).map(|(_, t)| bytes(t)).sum()
    }

    /// Device bytes of the fp32 scratch (not checkpointed).
    pub fn scratch_bytes(&self) -> u64 {
        [&self.m, &self.v, &self.tmp, &self.grad32].into_iter().map(bytes).sum()
    }

    fn named(m: &Moments) -> Vec<(&'static str, &Tensor)> {
        match m {
            Moments::Full { exp_avg, exp_avg_sq } => vec![("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)],
            Moments::Quantised { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax } => {
                vec![
                    ("exp_avg_q8", exp_avg),
                    ("exp_avg_absmax", exp_avg_absmax),
                    ("exp_avg_sq_q8", exp_avg_sq),
                    ("exp_avg_sq_absmax", exp_avg_sq_absmax),
                ]
            }
        }
    }
}

/// The constants of one AdamW step.
struct Rule {
    beta1: f64,
    beta2: f64,
    /// 1 − lr·wd, for decoupled weight decay.
    shrink: f64,
    scale: f64,
    shift: f64,
    /// lr > 0: at lr = 0 `scale` is infinite, and √v = 0 would make 0·∞ = NaN, so the moments
    /// are updated and the parameters left alone.
    apply: bool,
}

impl Rule {
    /// AdamW on fp32 moments `m`, `v` (updated in place); `tmp` is scratch of the same shape.
    fn apply(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        tmp: &mut Tensor,
        decays: bool,
    ) -> Result<(), TchError> {
        let _ = m.f_lerp_(g, 1.0 - self.beta1)?;
        let _ = g.f_mul_out(tmp, g)?;
        let _ = v.f_lerp_(tmp, 1.0 - self.beta2)?;
        if !self.apply {
            return Ok(());
        }
        let mut p = p.shallow_clone();
        if decays {
            let _ = p.f_mul_scalar_(self.shrink)?;
        }
        let _ = v.f_sqrt_out(tmp)?;
        let _ = tmp.f_mul_scalar_(self.scale)?;
        let _ = tmp.f_add_scalar_(self.shift)?;
        let _ = p.f_addcdiv_(m, tmp)?;
        Ok(())
    }
}

/// `g` itself when fp32, else its values copied into the front of `grad32` (the moments are
/// fp32, and `lerp_` wants one dtype).
fn as_fp32(g: &Tensor, grad32: &Tensor) -> Result<Tensor, TchError> {
    if g.kind() == Kind::Float {
        return Ok(g.shallow_clone());
    }
    let mut out = grad32.f_narrow(0, 0, g.numel() as i64)?.f_view(g.size().as_slice())?;
    out.f_copy_(g)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, AdamWConfig};

    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn small_tensors_keep_fp32_moments_and_match_fused_adamw_bit_for_bit() {
        // Two small tensors, one with weight decay and one without, beside a quantised one.
        let (w, b) = (pseudo(300, 1), pseudo(40, 2));
        let big = pseudo(5000, 3);
        let make =
            || [Tensor::from_slice(&w).view([20, 15]), Tensor::from_slice(&b), Tensor::from_slice(&big)];
        let (reference_params, eight_params) = (make(), make());
        let adamw_cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, fused: true };
        let cfg = AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let mut reference =
            AdamW::new(adamw_cfg, &reference_params[..2], &[true, false], Device::Cpu).unwrap();
        let mut eight = AdamW8bit::new(cfg, &eight_params, &[true, false, true], Device::Cpu).unwrap();
        assert!(
            matches!(eight.moments[0], Moments::Full { .. })
                && matches!(eight.moments[2], Moments::Quantised { .. })
        );
        for s in 0..5 {
            let g = [
                Tensor::from_slice(&pseudo(300, 10 + s)).view([20, 15]),
                Tensor::from_slice(&pseudo(40, 20 + s)),
                Tensor::from_slice(&pseudo(5000, 30 + s)),
            ];
            reference.step(&reference_params[..2], &g[..2], 0.01).unwrap();
            eight.step(&eight_params, &g, 0.01).unwrap();
        }
        for i in 0..2 {
            assert!(
                reference_params[i].equal(&eight_params[i]),
                "tensor {i}: the same kernel, the same numbers"
            );
        }
        assert!(!eight_params[2].equal(&make()[2]), "the quantised tensor was updated too");
        assert_eq!(eight.state_bytes(), 340 * 8 + 2 * 5000 + 2 * 3 * 4);
    }

    /// Both paths from the same state, one step at a time: the CPU kernel is the tensor-op path
    /// (CUDA's) fused, so each step must agree to rounding. Covers several runs of blocks, a
    /// partial last block, an all-zero gradient block, decay on and off, lr = 0, and bf16.
    #[test]
    fn the_fused_cpu_kernel_computes_what_the_tensor_op_path_does() {
        let cfg = AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let n = 5 * BLOCK as usize + 100;
        let names = ["a".to_string(), "b".to_string()];
        for kind in [Kind::Float, Kind::BFloat16] {
            let make = || {
                [
                    Tensor::from_slice(&pseudo(n, 1)).to_kind(kind),
                    Tensor::from_slice(&pseudo(n, 2)).to_kind(kind),
                ]
            };
            let (fused_p, runs_p) = (make(), make());
            let mut fused =
                AdamW8bit::with_path(cfg, &fused_p, &[true, false], Device::Cpu, Path::Fused).unwrap();
            let mut runs = AdamW8bit::with_path(
                cfg,
                &runs_p,
                &[true, false],
                Device::Cpu,
                Path::Runs { chunk_blocks: 2 },
            )
            .unwrap();
            for step in 0..6u64 {
                let mut g0 = pseudo(n, 10 + step);
                g0[BLOCK as usize..2 * BLOCK as usize].iter_mut().for_each(|x| *x = 0.0);
                let grads = [
                    Tensor::from_slice(&g0).to_kind(kind),
                    Tensor::from_slice(&pseudo(n, 20 + step)).to_kind(kind) * 1e-3,
                ];
                let lr = if step == 2 { 0.0 } else { 0.01 };
                // The tensor-op path starts from the fused path's state.
                for (f, r) in fused_p.iter().zip(&runs_p) {
                    r.shallow_clone().copy_(f);
                }
                runs.load_state(&names, &fused.state_tensors(&names), fused.steps).unwrap();
                let before: Vec<Tensor> = fused_p.iter().map(Tensor::copy).collect();
                fused.step(&fused_p, &grads, lr).unwrap();
                runs.step(&runs_p, &grads, lr).unwrap();
                for ((f, r), b) in fused_p.iter().zip(&runs_p).zip(&before) {
                    // fp32: last-bit differences (ATen's lerp may fuse a multiply-add); bf16: the
                    // tensor-op path rounds after the decay (an ulp of the old value) and again
                    // after the step, the kernel once. Beside that, the update itself (about lr)
                    // may differ in its last bits.
                    let ulps = if kind == Kind::Float { 4.0 * f32::EPSILON as f64 } else { 1.0 / 128.0 };
                    let worst = ((f - r).abs() - (r.abs() + b.abs()) * ulps).max().double_value(&[]);
                    assert!(
                        worst <= 1e-6 * lr,
                        "{kind:?} step {step}: parameters differ by {worst} beyond {ulps} relative"
                    );
                }
                let (fs, rs) = (fused.state_tensors(&names), runs.state_tensors(&names));
                for ((key, f), (_, r)) in fs.iter().zip(&rs) {
                    if f.kind() == Kind::Float {
                        let rel = ((f - r).abs() / r.abs().clamp_min(1e-30)).max().double_value(&[]);
                        assert!(rel < 1e-5, "{kind:?} step {step}: scales `{key}` differ by {rel} relative");
                    } else {
                        // A code can land one step over when its value sits on a rounding edge.
                        let diff = (f.to_kind(Kind::Int) - r.to_kind(Kind::Int)).abs();
                        let (worst, off) =
                            (diff.max().int64_value(&[]), diff.gt(0).sum(Kind::Int64).int64_value(&[]));
                        assert!(
                            worst <= 1 && off * 1000 <= n as i64,
                            "{kind:?} step {step}: codes `{key}` differ by up to {worst} in {off} of {n}"
                        );
                    }
                }
                if step == 2 {
                    assert!(fused_p[0].equal(&runs_p[0]), "lr 0 leaves the parameters alone on both paths");
                }
            }
        }
    }

    #[test]
    fn the_fused_kernels_need_no_scratch_and_cuda_runs_are_16_mi_values() {
        assert_eq!(Path::for_device(Device::Cpu, false), Path::Fused);
        assert_eq!(Path::for_device(Device::Cuda(0), true), Path::Fused, "kernels.cuda_optimizers");
        assert_eq!(Path::for_device(Device::Cuda(0), false).run_elements(), 1 << 24);
        let gpt2 = [38_597_376i64, 786_432, 2_359_296, 768, 3072];
        assert_eq!(
            AdamW8bit::scratch_elements(gpt2, Path::for_device(Device::Cpu, false)),
            3072,
            "the largest unquantised tensor"
        );
        assert_eq!(AdamW8bit::scratch_elements(gpt2, Path::for_device(Device::Cuda(0), false)), 1 << 24);
        assert_eq!(
            AdamW8bit::scratch_elements(gpt2, Path::for_device(Device::Cuda(0), true)),
            3072,
            "nor does the CUDA kernel"
        );
        assert_eq!(
            AdamW8bit::scratch_elements([3000, 100], Path::for_device(Device::Cuda(0), false)),
            3000,
            "unquantised tensors whole"
        );
    }

    #[test]
    fn large_tensors_are_stored_in_one_byte_per_moment_plus_a_scale_per_block() {
        let n = 3 * BLOCK + 100; // a partial last block
        let p = [Tensor::zeros([n], (Kind::Float, Device::Cpu))];
        let opt = AdamW8bit::new(
            AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 },
            &p,
            &[false],
            Device::Cpu,
        )
        .unwrap();
        assert_eq!(opt.state_bytes(), 2 * n as u64 + 2 * 4 * 4);
        let kinds: Vec<(String, Kind)> =
            opt.state_tensors(&["w".into()]).into_iter().map(|(k, t)| (k, t.kind())).collect();
        assert_eq!(
            kinds,
            [
                ("exp_avg_q8.w".into(), Kind::Int8),
                ("exp_avg_absmax.w".into(), Kind::Float),
                ("exp_avg_sq_q8.w".into(), Kind::Uint8),
                ("exp_avg_sq_absmax.w".into(), Kind::Float)
            ]
        );
    }

    #[test]
    fn zero_learning_rate_updates_moments_but_not_parameters() {
        // √v = 0 where a gradient was always zero: the unguarded formula would give 0·∞ = NaN.
        let mut g = pseudo(5000, 3);
        g[..2048].iter_mut().for_each(|x| *x = 0.0);
        let p = Tensor::from_slice(&pseudo(5000, 4));
        let before = p.copy();
        let mut opt = AdamW8bit::new(
            AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 },
            &[p.shallow_clone()],
            &[true],
            Device::Cpu,
        )
        .unwrap();
        opt.step(&[p.shallow_clone()], &[Tensor::from_slice(&g)], 0.0).unwrap();
        assert!(p.equal(&before));
        let Moments::Quantised { exp_avg_absmax, .. } = &opt.moments[0] else {
            panic!("5000 elements are quantised")
        };
        assert!(f64::try_from(exp_avg_absmax.get(1)).unwrap() > 0.0, "the first moment moved");
    }
}
