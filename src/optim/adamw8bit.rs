//! AdamW whose moments are stored in 8 bits: per block of 2048 values, one byte per value and one
//! fp32 absmax (codes in `quant`), about a quarter of fp32 AdamW's state. Tensors under 4096
//! elements keep fp32 moments. Each step dequantises a run of blocks into fp32 scratch, applies
//! exactly the AdamW update of `adamw` (unfused path: decoupled weight decay, bias correction),
//! and requantises with fresh scales. Owns the quantised moments.
//!
//! The fp32 scratch (first moment, second moment, one temporary, and a copy of the gradient when
//! it is not fp32) is allocated once, at construction, for a run of at most [`CHUNK_BLOCKS`]
//! blocks, so the update makes no allocation the size of a tensor (at most the few bytes of
//! workspace a CUDA reduction takes for the absmax) and its memory does not grow with the
//! largest tensor. Runs of blocks rather than single blocks: one block per kernel launch would
//! be ~60 000 launches per moment per step for GPT-2 124M.
use super::quant::{self, BLOCK, MIN_QUANTISED};
use super::state::{bytes, check_lengths, restore};
use tch::{Device, Kind, TchError, Tensor};

/// Blocks dequantised at once: 1 Mi values, 4 MiB of fp32 per scratch buffer.
pub const CHUNK_BLOCKS: i64 = 512;

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
}

impl AdamW8bit {
    pub fn new(cfg: AdamW8bitConfig, params: &[Tensor], decay: &[bool], device: Device) -> Result<Self, TchError> {
        let mut moments = Vec::with_capacity(params.len());
        let mut scratch_len = 1i64;
        for p in params {
            let n = p.numel() as i64;
            if n < MIN_QUANTISED {
                let zeros = || Tensor::f_zeros(p.size().as_slice(), (Kind::Float, device));
                moments.push(Moments::Full { exp_avg: zeros()?, exp_avg_sq: zeros()? });
                scratch_len = scratch_len.max(n);
            } else {
                let (exp_avg, exp_avg_absmax) = quant::zeros(n, Kind::Int8, device)?;
                let (exp_avg_sq, exp_avg_sq_absmax) = quant::zeros(n, Kind::Uint8, device)?;
                moments.push(Moments::Quantised { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax });
                scratch_len = scratch_len.max(n.min(CHUNK_BLOCKS * BLOCK));
            }
        }
        let buf = |len: i64| Tensor::f_empty([len], (Kind::Float, device));
        let grad32_len = if params.iter().all(|p| p.kind() == Kind::Float) { 0 } else { scratch_len };
        Ok(Self { cfg, moments, steps: 0, decay: decay.to_vec(), m: buf(scratch_len)?, v: buf(scratch_len)?, tmp: buf(scratch_len)?, grad32: buf(grad32_len)? })
    }

    /// Applies one update with learning rate `lr` from `grads` (same order as `params`).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        check_lengths(params, grads, self.moments.len())?;
        self.steps += 1;
        let AdamW8bitConfig { beta1, beta2, eps, weight_decay } = self.cfg;
        let bc1 = 1.0 - beta1.powi(self.steps as i32);
        let bc2 = 1.0 - beta2.powi(self.steps as i32);
        // As in `AdamW::step`: p −= lr/bc1 · m / (√v/√bc2 + eps), written as p += m / tmp with
        // tmp = √v · (−bc1/(lr·√bc2)) − eps·bc1/lr.
        let rule = Rule { beta1, beta2, shrink: 1.0 - lr * weight_decay, scale: -bc1 / (lr * bc2.sqrt()), shift: -eps * bc1 / lr, apply: lr > 0.0 };
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let p = p.f_view([-1])?;
            let g = g.f_view([-1])?;
            let decays = self.decay[i] && weight_decay != 0.0;
            match &mut self.moments[i] {
                Moments::Full { exp_avg, exp_avg_sq } => {
                    let n = p.numel() as i64;
                    let mut tmp = self.tmp.f_narrow(0, 0, n)?;
                    let g = as_fp32(&g, &self.grad32)?;
                    rule.apply(&p, &g, &mut exp_avg.f_view([-1])?, &mut exp_avg_sq.f_view([-1])?, &mut tmp, decays)?;
                }
                Moments::Quantised { exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax } => {
                    for (start, len, b0, nb) in quant::chunks(p.numel() as i64, CHUNK_BLOCKS) {
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
            }
        }
        Ok(())
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
    pub fn load_state(&mut self, names: &[String], saved: &[(String, Tensor)], steps: u64) -> Result<(), String> {
        let _no_grad = tch::no_grad_guard();
        for (m, n) in self.moments.iter_mut().zip(names) {
            let targets: Vec<(&str, &mut Tensor)> = match m {
                Moments::Full { exp_avg, exp_avg_sq } => vec![("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)],
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
                vec![("exp_avg_q8", exp_avg), ("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_q8", exp_avg_sq), ("exp_avg_sq_absmax", exp_avg_sq_absmax)]
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
    fn apply(&self, p: &Tensor, g: &Tensor, m: &mut Tensor, v: &mut Tensor, tmp: &mut Tensor, decays: bool) -> Result<(), TchError> {
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
    fn small_tensors_keep_fp32_moments_and_match_adamw_bit_for_bit() {
        let init = pseudo(300, 1);
        let (a, b) = (Tensor::from_slice(&init).view([20, 15]), Tensor::from_slice(&init).view([20, 15]));
        let adamw_cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, fused: false };
        let cfg = AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let mut reference = AdamW::new(adamw_cfg, &[a.shallow_clone()], &[true], Device::Cpu).unwrap();
        let mut eight = AdamW8bit::new(cfg, &[b.shallow_clone()], &[true], Device::Cpu).unwrap();
        assert!(matches!(eight.moments[0], Moments::Full { .. }));
        for s in 0..5 {
            let g = Tensor::from_slice(&pseudo(300, 10 + s)).view([20, 15]);
            reference.step(&[a.shallow_clone()], &[g.shallow_clone()], 0.01).unwrap();
            eight.step(&[b.shallow_clone()], &[g], 0.01).unwrap();
        }
        assert!(a.equal(&b), "same maths, same order of operations");
        assert_eq!(eight.state_bytes(), 300 * 8);
    }

    #[test]
    fn large_tensors_are_stored_in_one_byte_per_moment_plus_a_scale_per_block() {
        let n = 3 * BLOCK + 100; // a partial last block
        let p = [Tensor::zeros([n], (Kind::Float, Device::Cpu))];
        let opt = AdamW8bit::new(AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 }, &p, &[false], Device::Cpu).unwrap();
        assert_eq!(opt.state_bytes(), 2 * n as u64 + 2 * 4 * 4);
        let kinds: Vec<(String, Kind)> = opt.state_tensors(&["w".into()]).into_iter().map(|(k, t)| (k, t.kind())).collect();
        assert_eq!(
            kinds,
            [("exp_avg_q8.w".into(), Kind::Int8), ("exp_avg_absmax.w".into(), Kind::Float), ("exp_avg_sq_q8.w".into(), Kind::Uint8), ("exp_avg_sq_absmax.w".into(), Kind::Float)]
        );
    }

    #[test]
    fn zero_learning_rate_updates_moments_but_not_parameters() {
        // √v = 0 where a gradient was always zero: the unguarded formula would give 0·∞ = NaN.
        let mut g = pseudo(5000, 3);
        g[..2048].iter_mut().for_each(|x| *x = 0.0);
        let p = Tensor::from_slice(&pseudo(5000, 4));
        let before = p.copy();
        let mut opt = AdamW8bit::new(AdamW8bitConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }, &[p.shallow_clone()], &[true], Device::Cpu).unwrap();
        opt.step(&[p.shallow_clone()], &[Tensor::from_slice(&g)], 0.0).unwrap();
        assert!(p.equal(&before));
        let Moments::Quantised { exp_avg_absmax, .. } = &opt.moments[0] else { panic!("5000 elements are quantised") };
        assert!(f64::try_from(exp_avg_absmax.get(1)).unwrap() > 0.0, "the first moment moved");
    }
}
