//! Numeric precision of a run: autocast (bf16 or fp16) around forward and backward with fp32
//! master weights and optimizer state, dynamic loss scaling for fp16, or pure bf16 weights.
use crate::config::Precision;
use crate::ffi;
use serde::{Deserialize, Serialize};
use tch::Device;

/// Puts freshly built parameters in the run's precision: bf16-pure casts them to bf16 (so
/// gradients and optimizer state follow; no fp32 master copy).
pub fn prepare(params: &[tch::Tensor], p: Precision) -> Result<(), tch::TchError> {
    if p == Precision::Bf16Pure {
        let _no_grad = tch::no_grad_guard();
        for t in params {
            let bf16 = t.f_to_kind(tch::Kind::BFloat16)?;
            t.shallow_clone().f_set_data(&bf16)?;
        }
    }
    Ok(())
}

/// The process-wide switches a run's precision wants, set by what owns the process (`train`,
/// `plan --profile`), not by each model built: libtorch has one of each per process, and a
/// library caller (a test among others) building an fp32 model beside a bf16 one must not
/// change the other's arithmetic from under it. Each is set both ways, so the last run
/// configured decides, whatever came before:
/// - fp32 on CUDA allows TF32 matmuls (PyTorch's "high" float32 matmul precision) on Ampere
///   and newer; other runs keep "highest", PyTorch's default;
/// - fp32 on the CPU runs without oneDNN (`torch.backends.mkldnn.enabled = False`); the 16-bit
///   precisions keep it: their CPU matmuls are oneDNN's (bf16 is 200× slower without).
///
/// Why no oneDNN in fp32: there it only serves GELU (`ONEDNN_VERBOSE=all` shows nothing else),
/// ATen's own GELU is faster (0.34 vs 1.13 ms for 256×3072, one thread), and oneDNN JIT-compiles
/// each kernel into a fresh memory map. Under a CPU memory cap that map can be refused like any
/// allocation, and oneDNN's code generator (Xbyak) then keeps the error and fails every later
/// kernel build ("could not create a primitive"): the guard's replay could never succeed (seen on
/// CI, tests/it/savers.rs). Off in every fp32 CPU run, not only capped ones, so a cap does not
/// change the numbers.
pub fn configure_process(p: Precision, device: Device) {
    if device.is_cuda() {
        let tf32 = p == Precision::Fp32;
        match ffi::set_matmul_precision(if tf32 { "high" } else { "highest" }) {
            Ok(()) if tf32 => {
                tracing::info!("fp32 run: TF32 matmuls allowed (float32 matmul precision `high`)")
            }
            Ok(()) => {}
            Err(e) => tracing::warn!("cannot set the float32 matmul precision: {e}"),
        }
    } else if let Err(e) = ffi::set_onednn_enabled(p != Precision::Fp32) {
        tracing::warn!("cannot switch oneDNN: {e}");
    }
}

/// Autocast on while this lives; off again on drop, errors included.
pub struct Autocast {
    cuda: bool,
}

impl Autocast {
    /// `None` for precisions without autocast (fp32, bf16-pure).
    pub fn enter(p: Precision, device: Device) -> Result<Option<Self>, ffi::ShimError> {
        let half = match p {
            Precision::Bf16Mixed => false,
            Precision::Fp16Mixed => true,
            Precision::Fp32 | Precision::Bf16Pure => return Ok(None),
        };
        ffi::set_autocast(device.is_cuda(), true, half)?;
        Ok(Some(Self { cuda: device.is_cuda() }))
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        let _ = ffi::set_autocast(self.cuda, false, false);
    }
}

/// Dynamic loss scaling (as torch.amp.GradScaler): the loss is multiplied by `scale` before
/// the backward pass so fp16 gradients do not underflow; gradients are divided by it again.
/// An overflow (non-finite gradient) skips the update and multiplies the scale by `backoff`;
/// `growth_interval` clean steps in a row multiply it by `growth`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_tracker: u64,
    pub growth_interval: u64,
    pub growth: f64,
    pub backoff: f64,
}

/// What [`LossScaler::update`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleChange {
    Unchanged,
    Grew(f64),
    BackedOff(f64),
}

impl LossScaler {
    pub fn new(initial: f64, growth_interval: u64) -> Self {
        Self { scale: initial, growth_tracker: 0, growth_interval, growth: 2.0, backoff: 0.5 }
    }

    /// After a step: `overflow` when the unscaled gradients were not finite.
    pub fn update(&mut self, overflow: bool) -> ScaleChange {
        if overflow {
            self.scale *= self.backoff;
            self.growth_tracker = 0;
            return ScaleChange::BackedOff(self.scale);
        }
        self.growth_tracker += 1;
        if self.growth_tracker >= self.growth_interval {
            self.growth_tracker = 0;
            self.scale *= self.growth;
            return ScaleChange::Grew(self.scale);
        }
        ScaleChange::Unchanged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_and_clean_steps_grow() {
        let mut s = LossScaler::new(1024.0, 3);
        assert_eq!(s.update(false), ScaleChange::Unchanged);
        assert_eq!(s.update(true), ScaleChange::BackedOff(512.0));
        assert_eq!(s.update(false), ScaleChange::Unchanged);
        assert_eq!(s.update(false), ScaleChange::Unchanged);
        assert_eq!(s.update(false), ScaleChange::Grew(1024.0));
    }

    #[test]
    fn autocast_guard_turns_it_off_again() {
        {
            let g = Autocast::enter(Precision::Bf16Mixed, Device::Cpu).unwrap();
            assert!(g.is_some());
            let a = tch::Tensor::ones([4, 4], (tch::Kind::Float, Device::Cpu));
            assert_eq!(a.matmul(&a).kind(), tch::Kind::BFloat16, "CPU autocast runs matmuls in bf16");
        }
        let a = tch::Tensor::ones([4, 4], (tch::Kind::Float, Device::Cpu));
        assert_eq!(a.matmul(&a).kind(), tch::Kind::Float, "off after the guard");
        assert!(Autocast::enter(Precision::Fp32, Device::Cpu).unwrap().is_none());
    }
}
