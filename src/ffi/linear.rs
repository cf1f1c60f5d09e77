//! Wrapper over `linear_kernels.cpp`: a linear layer with fp32 weights under autocast as one
//! autograd node of ours (`kernels.fused_linear`), whose backward writes the weight's and the
//! bias's gradients in fp32 directly (the bias's by our column-sum kernels, `linear_kernels.cu`,
//! compiled by NVRTC once [`super::kernels::prepare_cuda`] has run for the device). Where the
//! kernels do not run (the CPU outside tests), or without a 16-bit autocast, it is ATen's linear.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_linear_keep_casts(on: c_int);
    fn tg_linear_casts_reused() -> u64;
    fn tg_linear_casts_held() -> usize;
    fn tg_linear(x: *const c_void, weight: *const c_void, bias: *const c_void, y_out: *mut *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
}

/// `x` `[…, in]` · `weight`ᵀ (`[out, in]`) + `bias` (`[out]`), in autocast's dtype while
/// autocast is on (x's otherwise).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, ShimError> {
    let mut y = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    let bias = bias.map_or(std::ptr::null(), |b| b.as_ptr().cast::<c_void>());
    // SAFETY: the handles are live tensors (bias: or null); on success the shim hands over a
    // tensor it allocated with `new`, which tch's Tensor owns and frees.
    let code = unsafe { tg_linear(x.as_ptr().cast(), weight.as_ptr().cast(), bias, &mut y, err.as_mut_ptr().cast(), ERR_LEN) };
    result(code, &err)?;
    // SAFETY: a non-null pointer the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(y.cast()) })
}

/// While one lives, the linear node casts each weight and bias to the compute dtype once on this
/// thread and reuses the cast until the source changes (its version counter): one optimizer
/// step's micro-steps share their weights' casts, where autocast makes them again in each. The
/// casts are freed when it drops.
pub struct KeptCasts {
    _per_thread: std::marker::PhantomData<*const ()>, // not Send: the casts are per thread
}

impl KeptCasts {
    pub fn start() -> Self {
        // SAFETY: sets a thread-local switch.
        unsafe { tg_linear_keep_casts(1) };
        Self { _per_thread: std::marker::PhantomData }
    }

    /// Casts reused on this thread since the process began.
    pub fn reused() -> u64 {
        // SAFETY: reads a thread-local counter.
        unsafe { tg_linear_casts_reused() }
    }

    /// Casts held on this thread now.
    pub fn held() -> usize {
        // SAFETY: reads a thread-local map's size.
        unsafe { tg_linear_casts_held() }
    }
}

impl Drop for KeptCasts {
    fn drop(&mut self) {
        // SAFETY: clears this thread's kept casts (the tensors they hold are freed).
        unsafe { tg_linear_keep_casts(0) };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! The node (its column-sum kernels emulated on the host) against autocast's linear on the
    //! CPU; tests/gpu.rs runs the same check on a GPU.
    use super::*;
    use crate::ffi::kernels::CudaEmulation;
    use tch::{Device, Kind};

    pub struct Case {
        pub rows: i64,
        pub inputs: i64,
        pub outputs: i64,
        /// None: no bias; Some(false): a bias without gradient (the LM head's padding mask).
        pub bias: Option<bool>,
        /// The input in fp32 (autocast rounds it) or already in the compute dtype.
        pub x_fp32: bool,
    }

    /// y (fp32) and the gradients of x, the weight and the bias (where one is asked for) for a
    /// fixed gradient of y, under bf16 autocast on `device`: through our node (with the kernels
    /// emulated on the CPU) or autocast's linear. Also the kernel launches made.
    pub fn run(c: &Case, ours: bool, device: Device) -> (Vec<Tensor>, u64) {
        // Irregular values without the global generator (tests run in parallel threads).
        let wave = |shape: &[i64], k: f64, scale: f64| (Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu)).view(shape).f_mul_scalar(k).unwrap().sin() * scale).to_device(device);
        let x = wave(&[2, c.rows / 2, c.inputs], 0.731, 1.5);
        let x = if c.x_fp32 { x } else { x.to_kind(Kind::BFloat16) }.set_requires_grad(true);
        let w = wave(&[c.outputs, c.inputs], 0.37, 0.2).set_requires_grad(true);
        let b = c.bias.map(|grad| wave(&[c.outputs], 2.3, 0.1).set_requires_grad(grad));
        let gy = wave(&[2, c.rows / 2, c.outputs], 0.513, 1.0).to_kind(Kind::BFloat16);
        let emulation = (ours && device == Device::Cpu).then(CudaEmulation::start);
        crate::ffi::set_autocast(device != Device::Cpu, true, false).unwrap();
        let y = if ours { linear(&x, &w, b.as_ref()) } else { Ok(x.linear(&w, b.as_ref())) };
        crate::ffi::set_autocast(device != Device::Cpu, false, false).unwrap();
        let y = y.unwrap();
        assert_eq!(y.kind(), Kind::BFloat16, "y in the compute dtype");
        let objective = (y.to_kind(Kind::Float) * gy.to_kind(Kind::Float)).sum(Kind::Float);
        let mut inputs = vec![&x, &w];
        inputs.extend(b.iter().filter(|b| b.requires_grad()));
        let g = Tensor::run_backward(&[&objective], &inputs, false, false);
        let mut out = vec![y.detach().to_kind(Kind::Float)];
        out.extend(g);
        (out, emulation.map_or(0, |e| e.launches()))
    }

    pub fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double).to_device(Device::Cpu), b.to_kind(Kind::Double).to_device(Device::Cpu));
        ((&a - &b).abs().max() / (b.abs().max() + 1e-12)).double_value(&[])
    }

    pub const CASES: [Case; 4] = [
        Case { rows: 300, inputs: 48, outputs: 100, bias: Some(true), x_fp32: true },
        Case { rows: 64, inputs: 96, outputs: 130, bias: Some(true), x_fp32: false },
        Case { rows: 40, inputs: 32, outputs: 64, bias: None, x_fp32: false },
        Case { rows: 30, inputs: 64, outputs: 70, bias: Some(false), x_fp32: false },
    ];

    #[test]
    fn the_node_computes_what_autocasts_linear_does_with_fp32_parameter_gradients() {
        for c in &CASES {
            let label = format!("{} x {} → {} bias {:?} x fp32 {}", c.rows, c.inputs, c.outputs, c.bias, c.x_fp32);
            let ((ours, launches), (aten, _)) = (run(c, true, Device::Cpu), run(c, false, Device::Cpu));
            assert_eq!(launches, if c.bias == Some(true) { 2 } else { 0 }, "{label}: the column sums run only for a bias gradient");
            assert_eq!(ours.len(), aten.len(), "{label}");
            // y, x's and the weight's gradients: the same GEMMs in bf16 on the CPU, bit for bit.
            for (i, (a, b)) in ours.iter().zip(&aten).enumerate().take(3) {
                assert_eq!((a.kind(), a.size()), (b.kind(), b.size()), "{label}: output {i}");
                assert!(a.equal(b), "{label}: output {i} differs by {:e}", max_rel(a, b));
            }
            if c.bias == Some(true) {
                let (db, plain) = (&ours[3], &aten[3]);
                assert_eq!(db.kind(), Kind::Float, "{label}: the bias gradient in fp32");
                // Ours is the fp32 column sum; autocast's is that sum rounded to bf16.
                assert!(max_rel(db, plain) <= 1.0 / 128.0, "{label}: bias gradient off by {:e}", max_rel(db, plain));
            }
        }
    }

    /// The column sums in fp32, in a fixed order: against fp64 sums, and the same bits twice.
    #[test]
    fn the_column_sums_are_fp32_sums_and_deterministic() {
        for (rows, cols, kind) in [(1000, 70, Kind::BFloat16), (513, 129, Kind::BFloat16), (7, 64, Kind::Half), (0, 5, Kind::BFloat16), (2500, 40, Kind::BFloat16)] {
            let dy = (Tensor::arange(rows * cols, (Kind::Float, Device::Cpu)).view([rows, cols]).f_mul_scalar(0.377).unwrap().sin() * 3.0).to_kind(kind);
            let sum = |emulated: bool| {
                let _e = emulated.then(CudaEmulation::start);
                let x = Tensor::ones([rows, 1], (kind, Device::Cpu)).set_requires_grad(true);
                let w = Tensor::zeros([cols, 1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let b = Tensor::zeros([cols], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                crate::ffi::set_autocast(false, true, kind == Kind::Half).unwrap();
                let y = linear(&x, &w, Some(&b)).unwrap();
                crate::ffi::set_autocast(false, false, false).unwrap();
                let g = Tensor::run_backward(&[&(y.to_kind(Kind::Float) * dy.to_kind(Kind::Float)).sum(Kind::Float)], &[&b], false, false);
                g[0].shallow_clone()
            };
            let (a, b) = (sum(true), sum(true));
            assert!(a.equal(&b), "{rows} x {cols}: two runs differ");
            let want = dy.to_kind(Kind::Double).sum_dim_intlist([0i64].as_slice(), false, Kind::Double);
            assert!(max_rel(&a, &want) < 1e-6, "{rows} x {cols} {kind:?}: {:e} from the fp64 sums", max_rel(&a, &want));
        }
    }
}
