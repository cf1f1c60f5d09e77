//! Wrapper over `norm_kernels.cpp`: a norm (LayerNorm or RMSNorm) with the residual add before it
//! and the rounding to the compute dtype after it, as one autograd node over our CUDA kernels
//! (`kernels.fused_residual_norm`; `norm_kernels.cu`, compiled by NVRTC once
//! [`super::kernels::prepare_cuda`] has run for the device). Where the kernels do not run (the
//! CPU outside tests, inputs that are not fp32) it computes the same with ATen's ops.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_residual_norm(
        x: *const c_void,
        delta: *const c_void,
        weight: *const c_void,
        bias: *const c_void,
        eps: f64,
        rms: c_int,
        s_out: *mut *mut c_void,
        y_out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Which norm: LayerNorm (mean and variance, optional bias) or RMSNorm (root mean square, no bias).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    Layer,
    Rms,
}

/// `norm` over the last dimension of `x + delta` (of `x` without a delta) with `weight`, `bias`
/// (LayerNorm only) and `eps`. Returns the sum (with a delta: the residual stream after the add,
/// fp32) and the normalised output, rounded to autocast's dtype while autocast is on (x's
/// otherwise).
pub fn residual_norm(
    norm: Norm,
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor), ShimError> {
    let handle = |t: Option<&Tensor>| t.map_or(std::ptr::null(), |t| t.as_ptr().cast::<c_void>());
    let (mut s, mut y) = (std::ptr::null_mut::<c_void>(), std::ptr::null_mut::<c_void>());
    let mut err = [0u8; ERR_LEN];
    // SAFETY: every handle is a live tensor or null where the shim takes none; on success the
    // shim hands over tensors it allocated with `new` (s only with a delta), which tch's Tensor
    // owns and frees.
    let rms = c_int::from(norm == Norm::Rms);
    let code = unsafe {
        tg_residual_norm(
            handle(Some(x)),
            handle(delta),
            handle(Some(weight)),
            handle(bias),
            eps,
            rms,
            &mut s,
            &mut y,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: non-null pointers the shim returned with code 0.
    let sum = (!s.is_null()).then(|| unsafe { Tensor::from_ptr(s.cast()) });
    Ok((sum, unsafe { Tensor::from_ptr(y.cast()) }))
}

#[cfg(test)]
mod tests {
    //! The kernels (their source emulated on the host) against ATen's ops on the CPU;
    //! tests/it/gpu.rs runs the same checks on a GPU.
    use super::*;
    use crate::kernels::CudaEmulation;
    use tch::{Device, Kind};

    pub struct Case {
        pub norm: Norm,
        pub rows: i64,
        pub cols: i64,
        pub delta: bool,
        pub bias: bool,
        pub kind: Kind,
    }

    /// What one pass gives: s, y, and the gradients of x, δ, weight and bias for fixed output
    /// gradients (y's and, with a δ, s's).
    pub fn run(c: &Case, emulated: bool) -> Vec<Tensor> {
        // Irregular values without the global generator (tests run in parallel threads).
        let wave = |shape: &[i64], k: f64| {
            Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu))
                .view(shape)
                .f_mul_scalar(k)
                .unwrap()
                .sin()
        };
        let (rc, col) = ([c.rows, c.cols], [c.cols]);
        let x = (wave(&rc, 0.731) * 2.0 + 0.5).set_requires_grad(true);
        let delta = c.delta.then(|| wave(&rc, 1.917).to_kind(c.kind).set_requires_grad(true));
        let w = (wave(&col, 0.37) * 0.5 + 1.0).set_requires_grad(true);
        let b = c.bias.then(|| (wave(&col, 2.3) * 0.1).set_requires_grad(true));
        // y's gradient representable in its dtype: what reaches the node is exactly this.
        let gy = wave(&rc, 0.513).to_kind(c.kind).to_kind(Kind::Float);
        let gs = wave(&rc, 1.211);
        let emulation = emulated.then(CudaEmulation::start);
        // Autocast's dtype for the output: what the model gets under bf16-mixed on the CPU.
        let autocast = c.kind != Kind::Float;
        if autocast {
            crate::set_autocast(false, true, c.kind == Kind::Half).unwrap();
        }
        let (s, y) = residual_norm(c.norm, &x, delta.as_ref(), &w, b.as_ref(), 1e-5).unwrap();
        if autocast {
            crate::set_autocast(false, false, false).unwrap();
        }
        assert_eq!(y.kind(), c.kind, "y in the compute dtype");
        let mut objective = (y.to_kind(Kind::Float) * &gy).sum(Kind::Float);
        if let Some(s) = &s {
            objective += (s * &gs).sum(Kind::Float);
        }
        let mut inputs = vec![&x, &w];
        inputs.extend(delta.iter());
        inputs.extend(b.iter());
        let g = Tensor::run_backward(&[&objective], &inputs, false, false);
        if let Some(e) = &emulation {
            // Backward: a warp a row sums the parameters' bands in its pass, a block a row in
            // one of its own; then the bands are added.
            let backward = if c.cols <= 1024 { 2 } else { 3 };
            assert_eq!(
                e.launches(),
                1 + backward,
                "one launch forward, {backward} backward: the kernels ran"
            );
        }
        let mut out = vec![y.detach()];
        out.extend(s.map(|s| s.detach()));
        out.extend(g);
        out
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        ((&a - &b).abs().max() / (b.abs().max() + 1e-12)).double_value(&[])
    }

    #[test]
    fn the_kernels_compute_what_atens_add_norm_and_cast_do() {
        let (layer, rms) = (Norm::Layer, Norm::Rms);
        for c in [
            Case { norm: layer, rows: 37, cols: 300, delta: true, bias: true, kind: Kind::Float },
            Case { norm: layer, rows: 37, cols: 300, delta: false, bias: true, kind: Kind::Float },
            Case { norm: layer, rows: 9, cols: 64, delta: true, bias: false, kind: Kind::Float },
            Case { norm: layer, rows: 300, cols: 48, delta: true, bias: true, kind: Kind::BFloat16 },
            Case { norm: layer, rows: 21, cols: 520, delta: false, bias: true, kind: Kind::BFloat16 },
            Case { norm: layer, rows: 17, cols: 96, delta: true, bias: true, kind: Kind::Half },
            Case { norm: rms, rows: 37, cols: 300, delta: true, bias: false, kind: Kind::Float },
            Case { norm: rms, rows: 23, cols: 520, delta: false, bias: false, kind: Kind::Float },
            Case { norm: rms, rows: 300, cols: 48, delta: true, bias: false, kind: Kind::BFloat16 },
            // The widest row a warp takes (13 rows: a block's eight and five), then wider rows: a
            // block a row.
            Case { norm: layer, rows: 13, cols: 1024, delta: true, bias: true, kind: Kind::BFloat16 },
            Case { norm: layer, rows: 5, cols: 1100, delta: true, bias: true, kind: Kind::BFloat16 },
            Case { norm: rms, rows: 3, cols: 1030, delta: true, bias: false, kind: Kind::Float },
            Case { norm: layer, rows: 4, cols: 1025, delta: false, bias: true, kind: Kind::Float },
            // More bands (64 rows each, a block of the warp-a-row backward) than the bands' sum
            // loads at once (8 a warp, 8 warps); a last band of 40 rows, some warps' last rows
            // missing.
            Case { norm: layer, rows: 4200, cols: 8, delta: true, bias: true, kind: Kind::BFloat16 },
            Case { norm: rms, rows: 4200, cols: 40, delta: false, bias: false, kind: Kind::Half },
            // A last band of 3 rows and a single band of 3: warps 3 to 7 take no row.
            Case { norm: layer, rows: 4099, cols: 40, delta: true, bias: true, kind: Kind::BFloat16 },
            Case { norm: layer, rows: 3, cols: 64, delta: true, bias: true, kind: Kind::Float },
        ] {
            let (ours, aten) = (run(&c, true), run(&c, false));
            assert_eq!(ours.len(), aten.len());
            let label = format!(
                "{:?} {} x {} delta {} bias {} {:?}",
                c.norm, c.rows, c.cols, c.delta, c.bias, c.kind
            );
            for (i, (a, b)) in ours.iter().zip(&aten).enumerate() {
                assert_eq!((a.kind(), a.size()), (b.kind(), b.size()), "{label}: output {i}");
                // fp32 differs in the last bits (our reductions' order); a 16-bit value at most
                // by the one rounding those bits can tip.
                let tol = match a.kind() {
                    Kind::Float => 2e-5,
                    Kind::BFloat16 => 1.0 / 128.0,
                    _ => 1.0 / 1024.0,
                };
                let d = max_rel(a, b);
                assert!(d <= tol, "{label}: output {i} differs by {d:e} of its largest value");
            }
        }
    }

    #[test]
    fn the_kernels_are_deterministic_and_bad_inputs_are_errors() {
        // A warp a row, and a block a row.
        for cols in [96, 1100] {
            let c = Case {
                norm: Norm::Layer,
                rows: 300 * 96 / cols,
                cols,
                delta: true,
                bias: true,
                kind: Kind::BFloat16,
            };
            let (a, b) = (run(&c, true), run(&c, true));
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    x.equal(y),
                    "{cols} columns: two runs differ: {:?} {:?} by {}",
                    x.kind(),
                    x.size(),
                    (x.to_kind(Kind::Double) - y.to_kind(Kind::Double)).abs().max().double_value(&[])
                );
            }
        }
        // Bad inputs: a clear error, not a crash.
        let x = Tensor::ones([2, 8], (Kind::Int64, Device::Cpu));
        let w = Tensor::ones([8], (Kind::Float, Device::Cpu));
        let err = residual_norm(Norm::Layer, &x, None, &w, None, 1e-5).unwrap_err().to_string();
        assert!(err.contains("layer_norm") || err.contains("Long"), "an integer input is refused: {err}");
        let bad = residual_norm(
            Norm::Layer,
            &w.view([1, 8]),
            None,
            &Tensor::ones([7], (Kind::Float, Device::Cpu)),
            None,
            1e-5,
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("weight must be [c]"), "{bad}");
        let bias =
            residual_norm(Norm::Rms, &w.view([1, 8]), None, &w, Some(&w), 1e-5).unwrap_err().to_string();
        assert!(bias.contains("RMSNorm takes no bias"), "{bias}");
    }
}
