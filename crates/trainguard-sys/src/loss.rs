//! Wrapper over `loss_kernels.cpp`: the language-model loss as one autograd node
//! (`kernels.fused_cross_entropy`). It keeps the logits in their own dtype and a log-sum-exp per
//! row, and its backward writes their gradient in that dtype: no fp32 copy of the logits, no
//! log-probabilities, no fp32 gradient. In training ([`weighted_cross_entropy`],
//! `kernels.fused_loss_gradient`) its forward writes that gradient over the logits instead. CUDA
//! runs our kernels (`loss_kernels.cu`, compiled by NVRTC once [`super::kernels::prepare_cuda`]
//! has run for the device); the CPU runs ATen's ops over blocks of rows.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_cross_entropy(
        logits: *const c_void,
        targets: *const c_void,
        mean: c_int,
        weight: f64,
        grad_now: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_cross_entropy_cpu_block_rows(cols: i64) -> i64;
}

/// Rows of logits `cols` wide that the CPU path converts to fp32 at a time (the planner counts
/// the block and its exponentials).
pub fn cpu_block_rows(cols: u64) -> u64 {
    // SAFETY: pure arithmetic in the shim.
    unsafe { tg_cross_entropy_cpu_block_rows(cols as i64) as u64 }
}

/// Where the training loss's node computes the logits' gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gradient {
    /// In its backward, a second pass over the logits.
    InBackward,
    /// In its forward, written over the logits (`kernels.fused_loss_gradient`); on CUDA a block
    /// a row, each row read twice.
    InForward,
}

/// Cross-entropy of `logits` `[…, v]` against int64 `targets` `[…]` (−100 ignored): the mean
/// over the rows counted (`mean`) or the sum, as a 0-dim fp32 tensor whose backward reaches
/// `logits`. A target outside `[0, v)` other than −100 makes the loss NaN.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, mean: bool) -> Result<Tensor, ShimError> {
    call(logits, targets, mean, 1.0, Gradient::InBackward)
}

/// `weight` · [`cross_entropy`], for training: it takes the logits, and where autograd will want
/// their gradient (grad mode on, `logits` requiring it) and `gradient` says so
/// (`kernels.fused_loss_gradient`) it writes that gradient over them in this pass, for a
/// backward from this loss (given 1); a backward given another gradient rescales it. Backward
/// then reads nothing more and allocates nothing.
pub fn weighted_cross_entropy(
    logits: Tensor,
    targets: &Tensor,
    mean: bool,
    weight: f64,
    gradient: Gradient,
) -> Result<Tensor, ShimError> {
    call(&logits, targets, mean, weight, gradient)
}

fn call(
    logits: &Tensor,
    targets: &Tensor,
    mean: bool,
    weight: f64,
    gradient: Gradient,
) -> Result<Tensor, ShimError> {
    let mut out = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    let now = gradient == Gradient::InForward;
    // SAFETY: both handles are live tensors; the shim catches every exception and on success
    // hands over a tensor it allocated with `new`, which tch's Tensor owns and frees.
    let code = unsafe {
        tg_cross_entropy(
            logits.as_ptr().cast(),
            targets.as_ptr().cast(),
            c_int::from(mean),
            weight,
            c_int::from(now),
            &mut out,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: `out` is the non-null tensor the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

#[cfg(test)]
mod tests {
    //! The node against PyTorch's `cross_entropy` on the CPU (tests/it/gpu.rs checks the CUDA
    //! kernels against this CPU path).
    use super::*;
    use tch::{Device, Kind, Reduction};

    fn logits(rows: i64, cols: i64, kind: Kind) -> Tensor {
        tch::manual_seed(7);
        (Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)) * 3.0).to_kind(kind).set_requires_grad(true)
    }

    /// Targets spread over the columns, every fifth row ignored (−100).
    fn targets(rows: i64, cols: i64) -> Tensor {
        let t: Vec<i64> = (0..rows).map(|i| if i % 5 == 3 { -100 } else { (i * 7919) % cols }).collect();
        Tensor::from_slice(&t)
    }

    /// PyTorch's loss and gradient for `x` (computed in fp64 from x's values).
    fn reference(x: &Tensor, t: &Tensor, mean: bool) -> (f64, Tensor) {
        let r = x.detach().to_kind(Kind::Double).set_requires_grad(true);
        let reduction = if mean { Reduction::Mean } else { Reduction::Sum };
        let loss = r.cross_entropy_loss::<Tensor>(t, None, reduction, -100, 0.0);
        loss.backward();
        (loss.double_value(&[]), r.grad())
    }

    fn ours(x: &Tensor, t: &Tensor, mean: bool) -> (f64, Tensor) {
        x.shallow_clone().zero_grad(); // the same tensor: its gradient from an earlier call is cleared
        let loss = cross_entropy(x, t, mean).unwrap();
        assert_eq!((loss.kind(), loss.dim()), (Kind::Float, 0), "a 0-dim fp32 loss");
        loss.backward();
        (loss.double_value(&[]), x.grad())
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
    }

    #[test]
    fn loss_and_gradient_are_pytorchs_in_fp32_mean_and_sum() {
        let (x, t) = (logits(23, 37, Kind::Float), targets(23, 37));
        for mean in [true, false] {
            let (l, g) = ours(&x, &t, mean);
            let (rl, rg) = reference(&x, &t, mean);
            assert!((l - rl).abs() <= 1e-5 * rl.abs(), "mean {mean}: loss {l} vs {rl}");
            assert!(max_diff(&g, &rg) < 1e-6, "mean {mean}: gradient differs by {:e}", max_diff(&g, &rg));
            assert_eq!(g.kind(), Kind::Float);
            let ignored = g.narrow(0, 3, 1).abs().max().double_value(&[]);
            assert_eq!(ignored, 0.0, "an ignored row gets no gradient");
        }
    }

    #[test]
    fn sixteen_bit_logits_get_an_fp32_loss_and_a_gradient_in_their_dtype() {
        for kind in [Kind::BFloat16, Kind::Half] {
            let (x, t) = (logits(19, 64, kind), targets(19, 64));
            let (l, g) = ours(&x, &t, true);
            let (rl, rg) = reference(&x, &t, true);
            assert!(
                (l - rl).abs() <= 1e-5 * rl.abs(),
                "{kind:?}: loss {l} vs {rl} (computed in fp32 from the 16-bit values)"
            );
            assert_eq!(g.kind(), kind, "the gradient keeps the logits' dtype");
            // One rounding to 16 bits of the fp32 gradient: 2^-8 relative for bf16, 2^-11 fp16.
            let ulp = if kind == Kind::BFloat16 { 1.0 / 256.0 } else { 1.0 / 2048.0 };
            let bound = (rg.abs() * ulp + 1e-7).to_kind(Kind::Double);
            let excess = ((g.to_kind(Kind::Double) - &rg).abs() - bound).max().double_value(&[]);
            assert!(excess <= 0.0, "{kind:?}: gradient beyond one rounding by {excess:e}");
        }
    }

    #[test]
    fn rows_wider_than_a_block_are_worked_through_in_blocks_with_the_same_result() {
        let cols = 300_000;
        let rows = 7;
        assert_eq!(cpu_block_rows(cols as u64), 3, "2^20 values a block: 3 rows, three blocks for 7");
        let (x, t) =
            (logits(rows, cols, Kind::Float), Tensor::from_slice(&[0i64, 299_999, -100, 5, 150_000, 7, 1]));
        let (l, g) = ours(&x, &t, true);
        let (rl, rg) = reference(&x, &t, true);
        assert!((l - rl).abs() <= 1e-5 * rl.abs(), "loss {l} vs {rl}");
        assert!(max_diff(&g, &rg) < 1e-7, "gradient differs by {:e}", max_diff(&g, &rg));
    }

    #[test]
    fn minus_infinity_columns_get_exactly_zero_gradient_and_leave_the_loss_alone() {
        let (x, t) = (logits(9, 40, Kind::Float), targets(9, 32));
        let masked = Tensor::cat(
            &[
                x.detach().narrow(1, 0, 32),
                Tensor::full([9, 8], f64::NEG_INFINITY, (Kind::Float, Device::Cpu)),
            ],
            1,
        )
        .set_requires_grad(true);
        let (l, g) = ours(&masked, &t, true);
        let (rl, _) = reference(&x.detach().narrow(1, 0, 32), &t, true);
        assert!((l - rl).abs() <= 1e-5 * rl.abs(), "the padded vocabulary changes nothing: {l} vs {rl}");
        assert_eq!(g.narrow(1, 32, 8).abs().max().double_value(&[]), 0.0);
    }

    #[test]
    fn leading_dimensions_are_flattened_and_the_gradient_keeps_the_shape() {
        let x = logits(12, 10, Kind::Float).detach().view([3, 4, 10]).set_requires_grad(true);
        let t = targets(12, 10).view([3, 4]);
        let loss = cross_entropy(&x, &t, true).unwrap();
        loss.backward();
        assert_eq!(x.grad().size(), [3, 4, 10]);
        let (rl, _) = reference(&x.detach().view([12, 10]), &t.view([12]), true);
        assert!((loss.double_value(&[]) - rl).abs() < 1e-5 * rl.abs());
    }

    #[test]
    fn without_grad_the_loss_is_computed_and_nothing_is_recorded() {
        let x = logits(5, 10, Kind::Float).detach();
        let loss = tch::no_grad(|| cross_entropy(&x, &targets(5, 10), true).unwrap());
        assert!(!loss.requires_grad() && loss.double_value(&[]).is_finite());
    }

    #[test]
    fn an_all_ignored_mean_is_nan_and_its_gradient_zero_as_pytorchs() {
        let x = logits(4, 10, Kind::Float);
        let t = Tensor::from_slice(&[-100i64; 4]);
        let loss = cross_entropy(&x, &t, true).unwrap();
        loss.backward();
        let (rl, rg) = reference(&x, &t, true);
        assert!(loss.double_value(&[]).is_nan() && rl.is_nan(), "0/0, as PyTorch's mean");
        // The scale is 1/0 here: multiplying the ignored rows by it would give NaN, not 0.
        assert_eq!(x.grad().abs().max().double_value(&[]), 0.0, "every row ignored: no gradient");
        assert_eq!(rg.abs().max().double_value(&[]), 0.0, "PyTorch agrees");
    }

    #[test]
    fn fp64_logits_are_computed_in_fp64() {
        let (x, t) = (logits(11, 29, Kind::Double), targets(11, 29));
        let loss = cross_entropy(&x, &t, true).unwrap();
        assert_eq!(loss.kind(), Kind::Double);
        loss.backward();
        let (rl, rg) = reference(&x, &t, true);
        assert!(
            (loss.double_value(&[]) - rl).abs() <= 1e-13 * rl.abs(),
            "{} vs {rl}",
            loss.double_value(&[])
        );
        assert!(max_diff(&x.grad(), &rg) < 1e-15, "gradient differs by {:e}", max_diff(&x.grad(), &rg));
    }

    #[test]
    fn a_second_derivative_is_refused_with_the_switch_named() {
        let x = logits(4, 10, Kind::Float);
        let loss = cross_entropy(&x, &targets(4, 10), true).unwrap();
        let err = Tensor::f_run_backward(&[&loss], &[&x], true, true).unwrap_err().to_string();
        assert!(
            err.contains("differentiable once") && err.contains("kernels.fused_cross_entropy: false"),
            "{err}"
        );
        // Without create_graph the same graph still differentiates.
        let grads = Tensor::f_run_backward(&[&loss], &[&x], false, false).unwrap();
        assert!(grads[0].abs().max().double_value(&[]) > 0.0);
    }

    #[test]
    fn bad_targets_give_nan_and_bad_inputs_a_clear_error() {
        let x = logits(4, 10, Kind::Float);
        let all_ignored = Tensor::from_slice(&[-100i64; 4]);
        assert!(
            cross_entropy(&x, &all_ignored, true).unwrap().double_value(&[]).is_nan(),
            "0/0, as PyTorch's mean"
        );
        assert_eq!(cross_entropy(&x, &all_ignored, false).unwrap().double_value(&[]), 0.0);
        for bad in [10i64, -1] {
            let t = Tensor::from_slice(&[0i64, bad, 2, 3]);
            assert!(
                cross_entropy(&x, &t, true).unwrap().double_value(&[]).is_nan(),
                "target {bad} outside the vocabulary"
            );
        }
        let err = |x: &Tensor, t: &Tensor| cross_entropy(x, t, true).unwrap_err().to_string();
        assert!(err(&x, &Tensor::from_slice(&[0i32, 1, 2, 3])).contains("targets must be int64"));
        assert!(err(&x, &Tensor::from_slice(&[0i64, 1, 2])).contains("one target per row"));
        assert!(err(&Tensor::ones([4, 10], (Kind::Int64, Device::Cpu)), &targets(4, 10))
            .contains("floating point"));
    }

    /// Loss and gradient of `weight · cross_entropy` on a copy of `x` (so that the node's input
    /// is, as in training, a fresh tensor of its own), through the two-pass node or, with
    /// `Gradient::InForward`, the one that writes the gradient over the logits. Also: whether the
    /// gradient came back in the logits' own memory.
    fn weighted(
        x: &Tensor,
        t: &Tensor,
        mean: bool,
        weight: f64,
        gradient: Gradient,
        loss_gradient: f64,
    ) -> (Tensor, Tensor, bool) {
        let fresh = x.detach().set_requires_grad(true) * 1.0;
        let (handle, logits_at) = (fresh.shallow_clone(), fresh.data_ptr());
        let loss = weighted_cross_entropy(fresh, t, mean, weight, gradient).unwrap();
        let g =
            Tensor::f_run_backward(&[&(&loss * loss_gradient)], &[&handle], false, false).unwrap().remove(0);
        let in_place = g.data_ptr() == logits_at;
        (loss.detach(), g, in_place)
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        a.size() == b.size() && a.kind() == b.kind() && a.eq_tensor(b).all().int64_value(&[]) == 1
    }

    /// `kernels.fused_loss_gradient`: the gradient written over the logits in the forward is the
    /// two-pass node's to the bit (fp32, bf16 and fp16; mean and sum; ignored rows; rows in
    /// packs and not), on the CPU and through the CUDA kernels (emulated), in one kernel and
    /// in the logits' own memory; and the weighted loss is the loss times the weight.
    #[test]
    fn the_gradient_written_in_the_forward_is_the_two_pass_nodes_to_the_bit() {
        for emulated in [false, true] {
            for (kind, cols) in [
                (Kind::Float, 37),
                (Kind::Float, 64),
                (Kind::BFloat16, 64),
                (Kind::BFloat16, 61),
                (Kind::Half, 72),
            ] {
                for mean in [true, false] {
                    let (x, t) = (logits(13, cols, kind), targets(13, cols));
                    let emulation = emulated.then(super::super::kernels::CudaEmulation::start);
                    let fused_before = super::super::kernels::CudaEmulation::launches_of(&format!(
                        "tg_ce_forward_grad_{}",
                        dtype_name(kind)
                    ));
                    let (l2, g2, in_place2) = weighted(&x, &t, mean, 0.375, Gradient::InBackward, 1.0);
                    let (l1, g1, in_place1) = weighted(&x, &t, mean, 0.375, Gradient::InForward, 1.0);
                    let what = format!("{kind:?}, {cols} columns, mean {mean}, emulated {emulated}");
                    if let Some(e) = &emulation {
                        let fused = super::super::kernels::CudaEmulation::launches_of(&format!(
                            "tg_ce_forward_grad_{}",
                            dtype_name(kind)
                        )) - fused_before;
                        assert_eq!(fused, 1, "{what}: one launch of the fused kernel");
                        assert!(
                            e.launches() >= 4,
                            "{what}: the kernels ran (two forward, a backward, a rescale check)"
                        );
                    }
                    assert!(same_bits(&l1, &l2), "{what}: loss {l1:?} vs {l2:?}");
                    assert!(same_bits(&g1, &g2), "{what}: gradients differ by {:e}", max_diff(&g1, &g2));
                    // And what training computed before the weight moved into the node: the
                    // node's loss times the weight, its backward given the weight.
                    let (l0, g0) = {
                        let fresh = x.detach().set_requires_grad(true) * 1.0;
                        let loss = cross_entropy(&fresh, &t, mean).unwrap().f_mul_scalar(0.375).unwrap();
                        (
                            loss.detach(),
                            Tensor::f_run_backward(&[&loss], &[&fresh], false, false).unwrap().remove(0),
                        )
                    };
                    assert!(
                        same_bits(&l1, &l0) && same_bits(&g1, &g0),
                        "{what}: not the bits of the loss times the weight"
                    );
                    assert!(
                        in_place1 && !in_place2,
                        "{what}: the gradient is the logits' memory only when written in the forward"
                    );
                    let (plain, _) = ours(&x, &t, mean);
                    assert_eq!(
                        l1.double_value(&[]),
                        (Tensor::from(plain as f32) * 0.375).double_value(&[]),
                        "{what}: the loss times the weight"
                    );
                }
            }
        }
    }

    fn dtype_name(kind: Kind) -> &'static str {
        match kind {
            Kind::BFloat16 => "bf16",
            Kind::Half => "f16",
            _ => "f32",
        }
    }

    /// A backward given another gradient than 1 (the loss not the root of backward) rescales
    /// what the forward wrote: the reference's gradient within two roundings, ignored rows still
    /// 0; on the CPU and with the CUDA kernel (emulated).
    #[test]
    fn a_backward_given_another_gradient_rescales_the_one_written_in_the_forward() {
        for emulated in [false, true] {
            for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
                let (x, t) = (logits(11, 48, kind), targets(11, 48));
                let _emulation = emulated.then(super::super::kernels::CudaEmulation::start);
                let (_, g, _) = weighted(&x, &t, true, 0.5, Gradient::InForward, 1.0 / 3.0);
                let (_, rg) = reference(&x, &t, true);
                let rg = rg * (0.5 / 3.0);
                let ulp = match kind {
                    Kind::BFloat16 => 2.0 / 256.0,
                    Kind::Half => 2.0 / 2048.0,
                    _ => 1e-6,
                };
                let excess =
                    ((g.to_kind(Kind::Double) - &rg).abs() - (rg.abs() * ulp + 1e-7)).max().double_value(&[]);
                assert!(excess <= 0.0, "{kind:?}, emulated {emulated}: beyond two roundings by {excess:e}");
                assert_eq!(g.narrow(0, 3, 1).abs().max().double_value(&[]), 0.0, "an ignored row stays 0");
            }
        }
    }

    /// Logits that another node kept for its backward (tanh keeps its output) are not silently
    /// read back as their gradient: writing over them counts as an in-place change, which
    /// autograd's version check refuses, on the CPU and through the CUDA kernel (emulated).
    #[test]
    fn logits_another_node_kept_fail_autograds_version_check() {
        for emulated in [false, true] {
            let (x, t) = (logits(4, 16, Kind::Float), targets(4, 16));
            let _emulation = emulated.then(super::super::kernels::CudaEmulation::start);
            let a = x.detach().set_requires_grad(true);
            let loss = weighted_cross_entropy(a.tanh(), &t, true, 1.0, Gradient::InForward).unwrap();
            let err = Tensor::f_run_backward(&[&loss], &[&a], false, false).unwrap_err().to_string();
            assert!(err.contains("modified by an inplace operation"), "emulated {emulated}: {err}");
        }
    }

    /// Without autograd wanting a gradient the logits are left as they are; a second backward
    /// through a retained graph (which would rescale the written gradient twice) is refused
    /// with the switch named.
    #[test]
    fn the_logits_are_written_only_for_a_gradient_and_backward_runs_once() {
        let (x, t) = (logits(6, 16, Kind::Float), targets(6, 16));
        let fresh = x.detach().copy().set_requires_grad(true);
        let kept = fresh.shallow_clone();
        let loss =
            tch::no_grad(|| weighted_cross_entropy(fresh, &t, true, 1.0, Gradient::InForward).unwrap());
        assert!(same_bits(&kept, &x.detach()), "no gradient wanted: the logits are untouched");
        assert!((loss.double_value(&[]) - ours(&x, &t, true).0).abs() < 1e-6);

        let a = x.detach().set_requires_grad(true);
        let loss = weighted_cross_entropy(&a * 1.0, &t, true, 1.0, Gradient::InForward).unwrap();
        let _ = Tensor::f_run_backward(&[&loss], &[&a], true, false).unwrap();
        let err = Tensor::f_run_backward(&[&loss], &[&a], false, false).unwrap_err().to_string();
        assert!(err.contains("kernels.fused_loss_gradient: false"), "{err}");
    }
}
