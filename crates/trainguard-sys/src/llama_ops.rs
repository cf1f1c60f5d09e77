//! Wrappers over `llama_kernels.cpp`: the Llama block's elementwise steps as autograd nodes over
//! our CUDA kernels (`llama_kernels.cu`, compiled by NVRTC once [`super::kernels::prepare_cuda`]
//! has run for the device): SwiGLU's product silu(gate) · up (`kernels.fused_swiglu`; where the
//! kernels do not run, the CPU outside tests or mixed dtypes, ATen's ops compute it) and RoPE's
//! rotation (`kernels.fused_rope`, of q or k alone or of a merged q/k/v output's parts; only
//! where the kernels run: `model::layers::Rope` takes ATen's ops elsewhere).
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_swiglu(
        gate: *const c_void,
        up: *const c_void,
        h_out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_swiglu_joint(
        joint: *const c_void,
        kernels: c_int,
        h_out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_rope(
        x: *const c_void,
        cos: *const c_void,
        sin: *const c_void,
        heads: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_rope_qkv(
        qkv: *const c_void,
        cos: *const c_void,
        sin: *const c_void,
        heads: i64,
        kv_heads: i64,
        outs: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// silu(`gate`) · `up`, elementwise, in their dtype.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor, ShimError> {
    let mut h = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: both handles are live tensors; on success the shim hands over a tensor it allocated
    // with `new`, which tch's Tensor owns and frees.
    let code = unsafe {
        tg_swiglu(gate.as_ptr().cast(), up.as_ptr().cast(), &mut h, err.as_mut_ptr().cast(), ERR_LEN)
    };
    result(code, &err)?;
    // SAFETY: a non-null pointer the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(h.cast()) })
}

/// silu(gate) · up from their joint output `gu` `[.., 2f]` (gate's f columns, then up's: gate
/// and up as one matrix multiplication), `[.., f]` in its dtype; backward writes the joint
/// gradient in one piece. Through our kernels when `kernels` (`kernels.fused_swiglu`) where
/// they run; else through ATen's ops, which give `silu(g) · u` on the halves to the bit.
pub fn swiglu_joint(gu: &Tensor, kernels: bool) -> Result<Tensor, ShimError> {
    let mut h = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `swiglu`.
    let code = unsafe {
        tg_swiglu_joint(gu.as_ptr().cast(), c_int::from(kernels), &mut h, err.as_mut_ptr().cast(), ERR_LEN)
    };
    result(code, &err)?;
    // SAFETY: a non-null pointer the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(h.cast()) })
}

/// `x` `[b, t, heads·d]` (a q or k projection's output) rotated by positions `0..t` with the
/// fp32 tables `cos` and `sin` `[≥ t, d]` ("rotate half", as `model::layers::Rope`), in x's
/// dtype. An error where our kernels do not run.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: i64) -> Result<Tensor, ShimError> {
    let mut out = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `swiglu`.
    let code = unsafe {
        tg_rope(
            x.as_ptr().cast(),
            cos.as_ptr().cast(),
            sin.as_ptr().cast(),
            heads,
            &mut out,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: a non-null pointer the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

/// The merged q/k/v output `qkv` `[b, t, (heads + 2·kv_heads)·d]` as q and k rotated by
/// positions `0..t` (as [`rope`]) and v, each `[b, t, its heads·d]`, in one launch; backward
/// writes `qkv`'s gradient whole in one. An error where our kernels do not run.
pub fn rope_qkv(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: i64,
    kv_heads: i64,
) -> Result<(Tensor, Tensor, Tensor), ShimError> {
    let mut outs = [std::ptr::null_mut::<c_void>(); 3];
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `swiglu`; on success the shim fills all three with tensors it allocated.
    let code = unsafe {
        tg_rope_qkv(
            qkv.as_ptr().cast(),
            cos.as_ptr().cast(),
            sin.as_ptr().cast(),
            heads,
            kv_heads,
            outs.as_mut_ptr(),
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: non-null pointers the shim returned with code 0, each handed over once.
    let [q, k, v] = outs.map(|p| unsafe { Tensor::from_ptr(p.cast()) });
    Ok((q, k, v))
}

#[cfg(test)]
mod tests {
    //! The kernels (their source emulated on the host) against ATen's ops on the CPU;
    //! tests/it/gpu.rs runs the same check on a GPU.
    use super::*;
    use crate::kernels::CudaEmulation;
    use tch::{Device, Kind};

    /// h, and the gradients of gate and up for a fixed gradient of h: through the kernels
    /// (emulated) or ATen's ops. `offset` starts the tensors one value into their storage, so
    /// that nothing is on 16 bytes and the kernels take their one-value loads.
    pub fn run(len: i64, kind: Kind, offset: bool, emulated: bool) -> Vec<Tensor> {
        // Irregular values without the global generator (tests run in parallel threads), wide
        // enough to reach silu's flat tail (−12) and its linear side (+12).
        let wave = |k: f64, scale: f64| {
            let start = i64::from(offset);
            let t = Tensor::arange(len + start, (Kind::Float, Device::Cpu)).f_mul_scalar(k).unwrap().sin()
                * scale;
            t.to_kind(kind).narrow(0, start, len).set_requires_grad(true)
        };
        let (g, u) = (wave(0.731, 12.0), wave(1.917, 2.0));
        let dh = wave(0.513, 1.0).detach();
        let emulation = emulated.then(CudaEmulation::start);
        let h = swiglu(&g, &u).unwrap();
        // h · dh summed: h's gradient is dh exactly (representable in h's dtype).
        let objective = (h.to_kind(Kind::Float) * dh.to_kind(Kind::Float)).sum(Kind::Float);
        let grads = Tensor::run_backward(&[&objective], &[&g, &u], false, false);
        if let Some(e) = &emulation {
            assert_eq!(e.launches(), 2, "one launch forward, one backward: the kernels ran");
        }
        let mut out = vec![h.detach()];
        out.extend(grads);
        out
    }

    #[test]
    fn the_kernels_compute_what_atens_silu_and_multiply_do() {
        for (len, kind, offset) in [
            (5000, Kind::Float, false),
            (4099, Kind::Float, false),
            (5000, Kind::Float, true),
            (6000, Kind::BFloat16, false),
            (6001, Kind::BFloat16, true),
            (2048, Kind::Half, false),
        ] {
            let (ours, aten) = (run(len, kind, offset, true), run(len, kind, offset, false));
            for (i, (a, b)) in ours.iter().zip(&aten).enumerate() {
                assert_within_roundings(&format!("{len} {kind:?} offset {offset}: output {i}"), a, b);
            }
        }
    }

    /// `ours` against ATen's `aten`: fp32 differs in the last bits (σ and the products in
    /// another order); a 16-bit value by the roundings ATen makes between its steps and we do not.
    fn assert_within_roundings(label: &str, ours: &Tensor, aten: &Tensor) {
        assert_eq!((ours.kind(), ours.size()), (aten.kind(), aten.size()), "{label}");
        let ulp = match aten.kind() {
            Kind::Float => 1e-6,
            Kind::BFloat16 => 1.0 / 64.0,
            _ => 1.0 / 512.0,
        };
        let (a, b) = (ours.to_kind(Kind::Double), aten.to_kind(Kind::Double));
        let excess = ((&a - &b).abs() - b.abs() * ulp - 1e-6).max().double_value(&[]);
        assert!(excess <= 0.0, "{label}: differs beyond {ulp:e} relative by {excess:e}");
    }

    /// The joint form (gate and up as one matrix multiplication's output `[rows, 2f]`) against
    /// ATen's ops on its halves: h and the joint gradient, with rows that take the 16-byte packs
    /// (f a multiple of 8) and rows that do not.
    #[test]
    fn the_joint_kernels_compute_what_atens_ops_on_the_halves_do() {
        for (rows, f, kind) in
            [(7, 64, Kind::BFloat16), (5, 13, Kind::Float), (9, 24, Kind::Half), (3, 40, Kind::Float)]
        {
            let (gu32, dh) = joint_inputs(rows, f);
            let run = |emulated: bool| {
                let gu = gu32.view([rows, 2 * f]).to_kind(kind).set_requires_grad(true);
                let emulation = emulated.then(CudaEmulation::start);
                let h = match emulated {
                    true => swiglu_joint(&gu, true).unwrap(),
                    false => split_swiglu(&gu),
                };
                let g = Tensor::run_backward(
                    &[&(h.to_kind(Kind::Float) * &dh).sum(Kind::Float)],
                    &[&gu],
                    false,
                    false,
                );
                if let Some(e) = &emulation {
                    assert_eq!(e.launches(), 2, "one launch forward, one backward: the kernels ran");
                }
                [h.detach(), g[0].shallow_clone()]
            };
            for (what, (a, b)) in ["h", "the joint gradient"].iter().zip(run(true).iter().zip(&run(false))) {
                assert_within_roundings(&format!("{rows} × 2·{f} {kind:?}: {what}"), a, b);
            }
        }
        for kernels in [true, false] {
            let err = swiglu_joint(&Tensor::ones([4, 7], (Kind::Float, Device::Cpu)), kernels)
                .unwrap_err()
                .to_string();
            assert!(err.contains("even last dimension"), "{err}");
        }
    }

    /// A joint gate/up output `[rows · 2f]` in fp32 (irregular values up to ±8, silu's both
    /// sides) and a gradient of h `[rows, f]` for it.
    fn joint_inputs(rows: i64, f: i64) -> (Tensor, Tensor) {
        let gu32 =
            Tensor::arange(rows * 2 * f, (Kind::Float, Device::Cpu)).f_mul_scalar(0.731).unwrap().sin() * 8.0;
        let dh = Tensor::arange(rows * f, (Kind::Float, Device::Cpu))
            .f_mul_scalar(0.513)
            .unwrap()
            .cos()
            .view([rows, f]);
        (gu32, dh)
    }

    /// silu(g) · u on the halves of `gu` by ATen's differentiable ops: what autograd joins.
    fn split_swiglu(gu: &Tensor) -> Tensor {
        let halves = gu.split(gu.size().last().unwrap() / 2, -1);
        halves[0].silu() * &halves[1]
    }

    /// The joint node of ATen's ops (the CPU's, and CUDA's with `kernels.fused_swiglu` off)
    /// gives the split ops' product and joint gradient to the bit, in every dtype, also where
    /// the emulated kernels would run, and with the gradient recorded (create_graph). The second
    /// derivative through it agrees in fp32 to rounding (autograd sums its paths in another
    /// order). Under no_grad it computes the product alone.
    #[test]
    fn the_joint_node_of_atens_ops_gives_the_split_ops_bits() {
        for (rows, f, kind) in
            [(7, 64, Kind::Float), (5, 13, Kind::Float), (6, 40, Kind::BFloat16), (9, 24, Kind::Half)]
        {
            let (gu32, dh) = joint_inputs(rows, f);
            let run = |joint: bool, emulated: bool| {
                let gu = gu32.view([rows, 2 * f]).to_kind(kind).set_requires_grad(true);
                let emulation = emulated.then(CudaEmulation::start);
                let h = if joint { swiglu_joint(&gu, false).unwrap() } else { split_swiglu(&gu) };
                let objective = (h.to_kind(Kind::Float) * &dh).sum(Kind::Float);
                let g = Tensor::run_backward(&[&objective], &[&gu], true, false)[0].shallow_clone();
                // A second derivative (the gradient recorded, create_graph): of the gradient's
                // weighted sum, again with respect to gu.
                let recorded = Tensor::run_backward(&[&objective], &[&gu], true, true)[0].shallow_clone();
                let gg = Tensor::run_backward(
                    &[&(recorded.to_kind(Kind::Float) * &gu32.view([rows, 2 * f]).cos()).sum(Kind::Float)],
                    &[&gu],
                    false,
                    false,
                );
                if let Some(e) = &emulation {
                    assert_eq!(e.launches(), 0, "the switch is off: no kernel ran");
                }
                [h.detach(), g, recorded.detach(), gg[0].shallow_clone()]
            };
            let plain = run(false, false);
            for emulated in [false, true] {
                let joint = run(true, emulated);
                for (what, (a, b)) in
                    ["h", "the joint gradient", "the recorded gradient"].iter().zip(joint.iter().zip(&plain))
                {
                    assert!(a.equal(b), "{rows} × 2·{f} {kind:?}, emulated {emulated}: {what} differs");
                }
                if kind == Kind::Float {
                    // in 16 bits the two orders' roundings pile up where terms cancel
                    assert_within_roundings(
                        &format!("{rows} × 2·{f}: the second derivative"),
                        &joint[3],
                        &plain[3],
                    );
                }
            }
        }
        let gu = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([2, 6]).set_requires_grad(true);
        let h = tch::no_grad(|| swiglu_joint(&gu, false).unwrap());
        assert!(!h.requires_grad() && h.equal(&tch::no_grad(|| split_swiglu(&gu))));
    }

    #[test]
    fn the_kernels_are_deterministic_and_bad_inputs_are_errors() {
        let (a, b) = (run(6000, Kind::BFloat16, false, true), run(6000, Kind::BFloat16, false, true));
        for (x, y) in a.iter().zip(&b) {
            assert!(x.equal(y), "two runs differ");
        }
        let g = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
        let err = swiglu(&g, &Tensor::ones([4, 7], (Kind::Float, Device::Cpu))).unwrap_err().to_string();
        assert!(err.contains("one shape"), "{err}");
    }
}
