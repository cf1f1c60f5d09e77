//! Wrapper over `linear_kernels.cpp`: a linear layer with fp32 weights under autocast as one
//! autograd node of ours (`kernels.fused_linear`), whose backward writes the weight's and the
//! bias's gradients in fp32 directly (the bias's by our column-sum kernels, `linear_kernels.cu`,
//! compiled by NVRTC once [`super::kernels::prepare_cuda`] has run for the device). Where the
//! kernels do not run (the CPU outside tests), or without a 16-bit autocast, it is ATen's linear.
use super::kernels::handles;
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_linear_keep_casts(on: c_int);
    fn tg_linear_refresh_casts(err: *mut c_char, err_len: usize) -> c_int;
    fn tg_linear_casts_reused() -> u64;
    fn tg_linear_casts_held() -> usize;
    fn tg_linear_casts_addresses(out: *mut usize, n: usize) -> usize;
    fn tg_linear_sum_weight_grads(
        params: *const *const c_void,
        accs: *const *const c_void,
        n: usize,
        held: *mut usize,
        scope: *mut u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_linear_end_weight_grad_sums(scope: u64);
    fn tg_linear_sums_attached() -> u64;
    fn tg_linear(
        x: *const c_void,
        weights: *const *const c_void,
        n_weights: usize,
        biases: *const *const c_void,
        n_biases: usize,
        gelu: c_int,
        graph_only: c_int,
        our_node: c_int,
        y_out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// `x` `[…, in]` · `weight`ᵀ (`[out, in]`) + `bias` (`[out]`), in autocast's dtype while
/// autocast is on (x's otherwise).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, ShimError> {
    call(x, &[weight], bias.as_slice(), Computed::Product)
}

/// [`linear`]'s graph without its product: the output is zeros (in the dtype [`linear`] gives)
/// and its backward is the linear layer's, through our node when `ours` (where it runs: the
/// weight's cast kept, its gradient added into a [`GemmSums`] accumulator) or ATen's maths. For
/// the last layer of a block recomputed in backward, whose output nobody reads there: only its
/// gradient flows, so its GEMM would be computed for nothing (`step::savers`).
pub fn linear_graph_only(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    ours: bool,
) -> Result<Tensor, ShimError> {
    call(x, &[weight], bias.as_slice(), Computed::GraphOnly { ours })
}

/// What [`call`] computes.
#[derive(Clone, Copy)]
enum Computed {
    Product,
    Gelu,
    GraphOnly { ours: bool },
}

/// GELU (without the tanh approximation) of [`linear`]'s output: GPT-2's MLP up-projection
/// (`kernels.fused_gelu`), whose backward takes GELU's gradient and the bias's in one kernel.
pub fn linear_gelu(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, ShimError> {
    call(x, &[weight], bias.as_slice(), Computed::Gelu)
}

/// Layers that all read `x` as one matrix multiplication (`kernels.merged_projections`): each
/// one's output columns in turn, as [`linear`] of their weights (`[out_i, in]`) and biases (one
/// each or none) concatenated. The node keeps their joint cast for a step as it keeps a weight's
/// ([`KeptCasts`]) and gives each weight its own gradient (or adds it into its sum, [`GemmSums`]).
pub fn merged_linear(x: &Tensor, weights: &[&Tensor], biases: &[&Tensor]) -> Result<Tensor, ShimError> {
    call(x, weights, biases, Computed::Product)
}

fn call(
    x: &Tensor,
    weights: &[&Tensor],
    biases: &[&Tensor],
    computed: Computed,
) -> Result<Tensor, ShimError> {
    let (gelu, graph_only, our_node) = match computed {
        Computed::Product => (false, false, true),
        Computed::Gelu => (true, false, true),
        Computed::GraphOnly { ours } => (false, true, ours),
    };
    let mut y = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    let weights: Vec<*const c_void> = weights.iter().map(|w| w.as_ptr().cast::<c_void>()).collect();
    let biases: Vec<*const c_void> = biases.iter().map(|b| b.as_ptr().cast::<c_void>()).collect();
    // SAFETY: the handles are live tensors, the arrays hold their counts; on success the shim
    // hands over a tensor it allocated with `new`, which tch's Tensor owns and frees.
    let code = unsafe {
        tg_linear(
            x.as_ptr().cast(),
            weights.as_ptr(),
            weights.len(),
            biases.as_ptr(),
            biases.len(),
            c_int::from(gelu),
            c_int::from(graph_only),
            c_int::from(our_node),
            &mut y,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: a non-null pointer the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(y.cast()) })
}

/// While one lives, the linear node casts each weight and bias to the compute dtype once on this
/// thread and reuses the cast until the source changes (its version counter): one optimizer
/// step's micro-steps share their weights' casts, where autocast makes them again in each. The
/// casts are freed when the last one on the thread drops. Only ATen's in-place ops bump a
/// version, so a scope that lives on after something wrote parameters through raw pointers (our
/// CUDA optimizers, a broadcast) must [`KeptCasts::refresh`] before the casts are read again:
/// the CUDA graphs' scope (`step::graphs`), which lives as long as the graphs that read its casts,
/// does at each step's start; a scope opened inside it refreshes as it opens.
pub struct KeptCasts {
    _per_thread: std::marker::PhantomData<*const ()>, // not Send: the casts are per thread
}

impl KeptCasts {
    pub fn start() -> Result<Self, ShimError> {
        // SAFETY: sets a thread-local switch.
        unsafe { tg_linear_keep_casts(1) };
        let scope = Self { _per_thread: std::marker::PhantomData };
        Self::refresh()?;
        Ok(scope)
    }

    /// Every kept cast on this thread made again in place from its source (the same addresses):
    /// the casts of a scope that outlived an optimizer update made current.
    pub fn refresh() -> Result<(), ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: the shim copies into tensors it holds; errors come back as a code and text.
        result(unsafe { tg_linear_refresh_casts(err.as_mut_ptr().cast(), ERR_LEN) }, &err)
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

    /// Where the casts held on this thread now lie, ascending (a refresh must not move them:
    /// CUDA graphs read them there).
    pub fn addresses() -> Vec<usize> {
        let mut out = vec![0usize; Self::held()];
        // SAFETY: the shim writes at most `out.len()` addresses into the buffer.
        let n = unsafe { tg_linear_casts_addresses(out.as_mut_ptr(), out.len()) };
        out.truncate(n);
        out
    }
}

impl Drop for KeptCasts {
    fn drop(&mut self) {
        // SAFETY: clears this thread's kept casts (the tensors they hold are freed).
        unsafe { tg_linear_keep_casts(0) };
    }
}

/// While one lives, the linear node adds the gradient of each weight it was given into that
/// weight's fp32 accumulator inside the weight-gradient GEMM (`kernels.accumulate_in_gemm`), for
/// the forwards run on this thread, and hands autograd no gradient for it (an undefined tensor
/// where a backward returns gradients). A step's later micro-steps then skip writing a new
/// gradient per weight and the multi-tensor add that reads it back. Only one scope at a time:
/// starting one replaces the last; dropping one ends it (if it is still the open one). A node
/// whose backward runs after its scope ended computes its weight's gradient as usual.
pub struct GemmSums {
    held: usize,
    number: u64,
    _per_thread: std::marker::PhantomData<*const ()>, // not Send: the targets are per thread
}

impl GemmSums {
    /// `params[i]`'s gradient added into `accs[i]` from now on, for the pairs that can be (a
    /// contiguous fp32 accumulator of the weight's shape, on its device; on CUDA a libtorch whose
    /// GEMM adds into fp32): [`GemmSums::held`] says how many.
    pub fn start(params: &[Tensor], accs: &[Tensor]) -> Result<Self, ShimError> {
        assert_eq!(params.len(), accs.len(), "tensor lists differ in length");
        let (p, a) = (handles(params), handles(accs));
        let (mut held, mut number, mut err) = (0usize, 0u64, [0u8; ERR_LEN]);
        // SAFETY: the handles are live tensors borrowed for the call; the shim keeps its own
        // (refcounted) references and catches every exception.
        let code = unsafe {
            tg_linear_sum_weight_grads(
                p.as_ptr(),
                a.as_ptr(),
                p.len(),
                &mut held,
                &mut number,
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        let scope = Self { held, number, _per_thread: std::marker::PhantomData };
        result(code, &err)?;
        Ok(scope)
    }

    /// The weights whose gradients this scope adds in the GEMM.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Weights given to linear nodes made on this thread since the process began with an
    /// accumulator for their gradient (each part of merged layers; a checkpointed block's forward
    /// without a graph counts too).
    pub fn attached() -> u64 {
        // SAFETY: reads a thread-local counter.
        unsafe { tg_linear_sums_attached() }
    }
}

impl Drop for GemmSums {
    fn drop(&mut self) {
        // SAFETY: clears this thread's targets if this scope is still the open one.
        unsafe { tg_linear_end_weight_grad_sums(self.number) };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! The node (its column-sum kernels emulated on the host) against autocast's linear on the
    //! CPU; tests/it/gpu.rs runs the same check on a GPU.
    use super::*;
    use crate::kernels::CudaEmulation;
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
        let wave = |shape: &[i64], k: f64, scale: f64| {
            (Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu))
                .view(shape)
                .f_mul_scalar(k)
                .unwrap()
                .sin()
                * scale)
                .to_device(device)
        };
        let x = wave(&[2, c.rows / 2, c.inputs], 0.731, 1.5);
        let x = if c.x_fp32 { x } else { x.to_kind(Kind::BFloat16) }.set_requires_grad(true);
        let w = wave(&[c.outputs, c.inputs], 0.37, 0.2).set_requires_grad(true);
        let b = c.bias.map(|grad| wave(&[c.outputs], 2.3, 0.1).set_requires_grad(grad));
        let gy = wave(&[2, c.rows / 2, c.outputs], 0.513, 1.0).to_kind(Kind::BFloat16);
        let emulation = (ours && device == Device::Cpu).then(CudaEmulation::start);
        crate::set_autocast(device != Device::Cpu, true, false).unwrap();
        let y = if ours { linear(&x, &w, b.as_ref()) } else { Ok(x.linear(&w, b.as_ref())) };
        crate::set_autocast(device != Device::Cpu, false, false).unwrap();
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
        let (a, b) =
            (a.to_kind(Kind::Double).to_device(Device::Cpu), b.to_kind(Kind::Double).to_device(Device::Cpu));
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
            let label =
                format!("{} x {} → {} bias {:?} x fp32 {}", c.rows, c.inputs, c.outputs, c.bias, c.x_fp32);
            let ((ours, launches), (aten, _)) = (run(c, true, Device::Cpu), run(c, false, Device::Cpu));
            assert_eq!(
                launches,
                if c.bias == Some(true) { 2 } else { 0 },
                "{label}: the column sums run only for a bias gradient"
            );
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
                assert!(
                    max_rel(db, plain) <= 1.0 / 128.0,
                    "{label}: bias gradient off by {:e}",
                    max_rel(db, plain)
                );
            }
        }
    }

    /// A graph-only layer gives zeros in the output's dtype and shape, and the layer's gradients:
    /// through our node (kernels emulated) bit for bit those of the node, its weight's gradient
    /// added into a GEMM sum where a scope names one; through ATen's maths within a rounding of
    /// autocast's linear under bf16, and fp32's linear without autocast.
    #[test]
    fn a_graph_only_layer_gives_zeros_and_the_layers_gradients() {
        let wave = |shape: &[i64], k: f64, scale: f64| {
            Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu))
                .view(shape)
                .f_mul_scalar(k)
                .unwrap()
                .sin()
                * scale
        };
        for c in &CASES {
            for (ours, bf16) in [(true, true), (false, true), (false, false)] {
                let label = format!(
                    "{} x {} → {} bias {:?} x fp32 {}, ours {ours}, bf16 {bf16}",
                    c.rows, c.inputs, c.outputs, c.bias, c.x_fp32
                );
                let x = wave(&[2, c.rows / 2, c.inputs], 0.731, 1.5);
                let x = if c.x_fp32 || !bf16 { x } else { x.to_kind(Kind::BFloat16) }.set_requires_grad(true);
                let w = wave(&[c.outputs, c.inputs], 0.37, 0.2).set_requires_grad(true);
                let b = c.bias.map(|grad| wave(&[c.outputs], 2.3, 0.1).set_requires_grad(grad));
                let gy = wave(&[2, c.rows / 2, c.outputs], 0.513, 1.0);
                // y and the gradients of x, w and b (where wanted), the layer made by `make`.
                let grads = |make: &dyn Fn() -> Tensor| {
                    let _emulation = ours.then(CudaEmulation::start);
                    crate::set_autocast(false, bf16, false).unwrap();
                    let y = make();
                    crate::set_autocast(false, false, false).unwrap();
                    let mut inputs = vec![&x, &w];
                    inputs.extend(b.iter().filter(|b| b.requires_grad()));
                    let mut out = vec![y.detach()];
                    out.extend(Tensor::run_backward(
                        &[&(y.to_kind(Kind::Float) * &gy).sum(Kind::Float)],
                        &inputs,
                        false,
                        false,
                    ));
                    out
                };
                let only = grads(&|| linear_graph_only(&x, &w, b.as_ref(), ours).unwrap());
                let full = grads(&|| {
                    if ours {
                        linear(&x, &w, b.as_ref()).unwrap()
                    } else {
                        x.linear(&w, b.as_ref())
                    }
                });
                assert_eq!(
                    (only[0].kind(), only[0].size()),
                    (full[0].kind(), full[0].size()),
                    "{label}: the output's dtype and shape"
                );
                assert_eq!(
                    only[0].abs().max().double_value(&[]),
                    0.0,
                    "{label}: the output is zeros (no product computed)"
                );
                assert_eq!(only.len(), full.len(), "{label}");
                for (i, (a, want)) in only.iter().zip(&full).enumerate().skip(1) {
                    assert_eq!((a.kind(), a.size()), (want.kind(), want.size()), "{label}: gradient {i}");
                    match ours {
                        true => assert!(
                            a.equal(want),
                            "{label}: gradient {i} is not the node's ({:e} off)",
                            max_rel(a, want)
                        ),
                        false => {
                            let tolerance = if bf16 { 1.0 / 128.0 } else { 1e-6 };
                            assert!(
                                max_rel(a, want) <= tolerance,
                                "{label}: gradient {i} off by {:e}",
                                max_rel(a, want)
                            );
                        }
                    }
                }
                if ours {
                    // In a step's GEMM-sum scope the weight's gradient goes into its sum.
                    let acc = w.ones_like();
                    let sums = GemmSums::start(std::slice::from_ref(&w), std::slice::from_ref(&acc)).unwrap();
                    let summed = grads(&|| linear_graph_only(&x, &w, b.as_ref(), true).unwrap());
                    drop(sums);
                    assert!(!summed[2].defined(), "{label}: no weight gradient handed to autograd");
                    assert!(
                        max_rel(&acc, &full[2].f_add_scalar(1.0).unwrap()) < 1e-6,
                        "{label}: the sum is 1 + the gradient"
                    );
                    assert!(summed[1].equal(&full[1]), "{label}: x's gradient");
                }
            }
        }
    }

    extern "C" {
        fn tg_linear_test_column_sum(
            dy: *const c_void,
            out: *mut c_void,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
        fn tg_linear_test_gelu_backward(
            da: *const c_void,
            h: *const c_void,
            dh: *mut c_void,
            db: *mut c_void,
            took: *mut c_int,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
    }

    /// The column sums of `dy` [rows, cols] through the emulated kernels.
    fn column_sum(dy: &Tensor) -> Tensor {
        let out = Tensor::zeros([dy.size()[1]], (Kind::Float, Device::Cpu));
        let mut err = [0u8; ERR_LEN];
        let _e = CudaEmulation::start();
        // SAFETY: live tensors; the shim writes into `out`.
        result(
            unsafe {
                tg_linear_test_column_sum(
                    dy.as_ptr().cast(),
                    out.as_ptr().cast_mut().cast(),
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            },
            &err,
        )
        .unwrap();
        out
    }

    /// `t`'s values in a tensor that starts one element past a 16-byte boundary (contiguous).
    fn off_16_bytes(t: &Tensor) -> Tensor {
        let buf = Tensor::zeros([t.numel() as i64 + 1], (t.kind(), Device::Cpu));
        let mut shifted = buf.narrow(0, 1, t.numel() as i64).view(t.size().as_slice());
        shifted.copy_(t);
        shifted
    }

    /// Values of every sign and size, without the global generator.
    fn wave(rows: i64, cols: i64, k: f64, scale: f64, kind: Kind) -> Tensor {
        (Tensor::arange(rows * cols, (Kind::Float, Device::Cpu))
            .view([rows, cols])
            .f_mul_scalar(k)
            .unwrap()
            .sin()
            * scale)
            .to_kind(kind)
    }

    /// Rows of a multiple of 8 values on 16 bytes are summed 8 columns a lane (the packed
    /// kernel); the same rows a value at a time (off 16 bytes: the other kernel) give the same
    /// bits, as the packed kernel adds each column's rows in the same order.
    #[test]
    fn packed_column_sums_give_the_one_column_a_lane_sums_bits() {
        // fp32's values carry 24 bits, so their sums round and the order of the adds shows in the
        // bits (16-bit values' short sums are exact in fp32 whatever the order).
        for (rows, cols, kind) in [
            (1000, 64, Kind::BFloat16),
            (513, 264, Kind::BFloat16),
            (300, 40, Kind::Half),
            (77, 16, Kind::Float),
            (2100, 8, Kind::BFloat16),
            (3000, 264, Kind::Float),
        ] {
            let dy = wave(rows, cols, 0.377, 3.0, kind);
            let suffix = match kind {
                Kind::Float => "f32",
                Kind::Half => "f16",
                _ => "bf16",
            };
            let ran = |f: &dyn Fn() -> Tensor, name: &str| {
                let before = CudaEmulation::launches_of(&format!("tg_col_sum_bands_{name}{suffix}"));
                let out = f();
                assert_eq!(
                    CudaEmulation::launches_of(&format!("tg_col_sum_bands_{name}{suffix}")) - before,
                    1,
                    "{rows} x {cols} {kind:?}: the {name}form ran"
                );
                out
            };
            let packed = ran(&|| column_sum(&dy), "packed_");
            let plain = ran(&|| column_sum(&off_16_bytes(&dy)), "");
            assert!(packed.equal(&plain), "{rows} x {cols} {kind:?}: {:e} apart", max_rel(&packed, &plain));
            let want = dy.to_kind(Kind::Double).sum_dim_intlist([0i64].as_slice(), false, Kind::Double);
            assert!(
                max_rel(&packed, &want) < 1e-5,
                "{rows} x {cols} {kind:?}: {:e} from the fp64 sums",
                max_rel(&packed, &want)
            );
        }
    }

    /// GELU's backward kernel: dh within a rounding of ATen's gelu_backward (computed in fp32,
    /// rounded once), and the bias's gradient in the bits of the column sums of dh as stored.
    /// Rows it cannot read 8 values a lane are left to ATen: nothing runs.
    #[test]
    fn the_gelu_backward_kernel_gives_atens_gradient_and_its_column_sums() {
        let gelu_backward = |da: &Tensor, h: &Tensor, db: Option<&Tensor>| {
            let dh = h.zeros_like();
            let (mut err, mut took) = ([0u8; ERR_LEN], 0);
            let _e = CudaEmulation::start();
            let db = db.map_or(std::ptr::null_mut(), |d| d.as_ptr().cast_mut().cast());
            // SAFETY: live tensors (db: or null); the shim writes into dh and db.
            let code = unsafe {
                tg_linear_test_gelu_backward(
                    da.as_ptr().cast(),
                    h.as_ptr().cast(),
                    dh.as_ptr().cast_mut().cast(),
                    db,
                    &mut took,
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            };
            result(code, &err).unwrap();
            (dh, took == 1)
        };
        for (rows, cols, kind) in [
            (600, 64, Kind::BFloat16),
            (257, 3072 / 8, Kind::BFloat16),
            (90, 24, Kind::Half),
            (40, 32, Kind::Float),
        ] {
            let label = format!("{rows} x {cols} {kind:?}");
            let (da, h) = (wave(rows, cols, 0.513, 2.0, kind), wave(rows, cols, 0.0731, 4.0, kind));
            let db = Tensor::zeros([cols], (Kind::Float, Device::Cpu));
            let (dh, took) = gelu_backward(&da, &h, Some(&db));
            assert!(took, "{label}: the kernel took the rows");
            let want = h.to_kind(Kind::Float).gelu_backward(&da.to_kind(Kind::Float), "none");
            // Within a rounding of D (ATen's CPU erf and exp are approximations of their own:
            // a few of fp32's last places, near zero too).
            let ulp = if kind == Kind::Float {
                1e-5
            } else if kind == Kind::Half {
                1.0 / 1024.0
            } else {
                1.0 / 128.0
            };
            let off = ((dh.to_kind(Kind::Float) - &want).abs() - want.abs() * ulp).max().double_value(&[]);
            assert!(off <= 1e-6, "{label}: dh off ATen's by more than a rounding ({off:e})");
            assert!(
                db.equal(&column_sum(&dh)),
                "{label}: the bias's gradient is the column sums of dh, bit for bit"
            );
            let (alone, _) = gelu_backward(&da, &h, None);
            assert!(alone.equal(&dh), "{label}: without the sums, the same dh");
        }
        let (da, h) = (wave(30, 70, 0.5, 2.0, Kind::BFloat16), wave(30, 70, 0.07, 4.0, Kind::BFloat16));
        let (dh, took) = gelu_backward(&da, &h, None);
        assert!(!took && dh.eq(0.0).all().int64_value(&[]) == 1, "70 columns: left to ATen, nothing written");
        let (da, h) = (wave(30, 64, 0.5, 2.0, Kind::BFloat16), wave(30, 64, 0.07, 4.0, Kind::BFloat16));
        assert!(!gelu_backward(&off_16_bytes(&da), &h, None).1, "rows off 16 bytes: left to ATen");
    }

    /// The node with GELU after it against autocast's linear and ATen's gelu: the same output,
    /// gradients within autocast's own distance; one launch backward (two with the bias's sums)
    /// where the kernel takes the rows, ATen's gelu_backward (and the column sums) elsewhere.
    #[test]
    fn the_linear_gelu_node_computes_autocasts_linear_and_gelu() {
        let case =
            |outputs: i64, bias: Option<bool>| Case { rows: 96, inputs: 40, outputs, bias, x_fp32: false };
        for (c, launches) in
            [(case(64, Some(true)), 2), (case(64, None), 1), (case(70, Some(true)), 2), (case(70, None), 0)]
        {
            let c = &c;
            let label = format!("{} x {} → {} bias {:?}", c.rows, c.inputs, c.outputs, c.bias);
            let ((ours, launched), (aten, _)) = (run_gelu(c, true), run_gelu(c, false));
            assert_eq!(launched, launches, "{label}: launches");
            assert!(ours[0].equal(&aten[0]), "{label}: y, bit for bit (the same GEMM and GELU)");
            for (i, (a, b)) in ours.iter().zip(&aten).enumerate().skip(1) {
                assert_eq!(a.size(), b.size(), "{label}: output {i}");
                assert!(max_rel(a, b) <= 1.0 / 128.0, "{label}: output {i} off by {:e}", max_rel(a, b));
            }
        }
    }

    /// As [`run`], through GELU after the layer.
    fn run_gelu(c: &Case, ours: bool) -> (Vec<Tensor>, u64) {
        let x = wave(c.rows, c.inputs, 0.731, 1.5, Kind::BFloat16).set_requires_grad(true);
        let w = wave(c.outputs, c.inputs, 0.37, 0.2, Kind::Float).set_requires_grad(true);
        let b = c
            .bias
            .map(|grad| wave(1, c.outputs, 2.3, 0.1, Kind::Float).view([c.outputs]).set_requires_grad(grad));
        let gy = wave(c.rows, c.outputs, 0.513, 1.0, Kind::BFloat16);
        let emulation = ours.then(CudaEmulation::start);
        crate::set_autocast(false, true, false).unwrap();
        let y = if ours {
            linear_gelu(&x, &w, b.as_ref()).unwrap()
        } else {
            x.linear(&w, b.as_ref()).gelu("none")
        };
        crate::set_autocast(false, false, false).unwrap();
        let objective = (y.to_kind(Kind::Float) * gy.to_kind(Kind::Float)).sum(Kind::Float);
        let mut inputs = vec![&x, &w];
        inputs.extend(b.iter().filter(|b| b.requires_grad()));
        let mut out = vec![y.detach().to_kind(Kind::Float)];
        out.extend(
            Tensor::run_backward(&[&objective], &inputs, false, false).iter().map(|g| g.to_kind(Kind::Float)),
        );
        (out, emulation.map_or(0, |e| e.launches()))
    }

    /// The column sums in fp32, in a fixed order: against fp64 sums, and the same bits twice.
    #[test]
    fn the_column_sums_are_fp32_sums_and_deterministic() {
        for (rows, cols, kind) in [
            (1000, 70, Kind::BFloat16),
            (513, 129, Kind::BFloat16),
            (7, 64, Kind::Half),
            (0, 5, Kind::BFloat16),
            (2500, 40, Kind::BFloat16),
        ] {
            let dy = (Tensor::arange(rows * cols, (Kind::Float, Device::Cpu))
                .view([rows, cols])
                .f_mul_scalar(0.377)
                .unwrap()
                .sin()
                * 3.0)
                .to_kind(kind);
            let sum = |emulated: bool| {
                let _e = emulated.then(CudaEmulation::start);
                let x = Tensor::ones([rows, 1], (kind, Device::Cpu)).set_requires_grad(true);
                let w = Tensor::zeros([cols, 1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let b = Tensor::zeros([cols], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                crate::set_autocast(false, true, kind == Kind::Half).unwrap();
                let y = linear(&x, &w, Some(&b)).unwrap();
                crate::set_autocast(false, false, false).unwrap();
                let g = Tensor::run_backward(
                    &[&(y.to_kind(Kind::Float) * dy.to_kind(Kind::Float)).sum(Kind::Float)],
                    &[&b],
                    false,
                    false,
                );
                g[0].shallow_clone()
            };
            let (a, b) = (sum(true), sum(true));
            assert!(a.equal(&b), "{rows} x {cols}: two runs differ");
            let want = dy.to_kind(Kind::Double).sum_dim_intlist([0i64].as_slice(), false, Kind::Double);
            assert!(
                max_rel(&a, &want) < 1e-6,
                "{rows} x {cols} {kind:?}: {:e} from the fp64 sums",
                max_rel(&a, &want)
            );
        }
    }

    /// Merged layers through one node: the output, x's gradient and each weight's and bias's
    /// gradient are, bit for bit, those of the node over the weights concatenated (the path it
    /// replaces: the joint GEMMs, then the concatenation's backward split); within a step's scope
    /// their joint cast is kept and reused, made anew after a part changed in place; each weight's
    /// gradient adds into its own sum in a GEMM of its rows.
    #[test]
    fn merged_layers_through_one_node_give_each_weight_its_gradient() {
        let _emulation = CudaEmulation::start();
        let wave = |shape: &[i64], k: f64, scale: f64| {
            Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu))
                .view(shape)
                .f_mul_scalar(k)
                .unwrap()
                .sin()
                * scale
        };
        let x = wave(&[2, 24, 32], 0.731, 1.5).set_requires_grad(true);
        let ws: Vec<Tensor> = [(40, 0.37), (16, 0.41), (24, 0.29)]
            .iter()
            .map(|&(o, k)| wave(&[o, 32], k, 0.2).set_requires_grad(true))
            .collect();
        let bs: Vec<Tensor> =
            [40, 16, 24].iter().map(|&o| wave(&[o], 2.3, 0.1).set_requires_grad(true)).collect();
        let gy = wave(&[2, 24, 80], 0.513, 1.0);
        let (w_refs, b_refs): (Vec<&Tensor>, Vec<&Tensor>) = (ws.iter().collect(), bs.iter().collect());
        // y and the gradients of x, each weight and each bias, under bf16 autocast.
        let run = |merged: bool, biases: bool| {
            let b_used: &[&Tensor] = if biases { &b_refs } else { &[] };
            crate::set_autocast(false, true, false).unwrap();
            let y = match merged {
                true => merged_linear(&x, &w_refs, b_used),
                false => linear(&x, &Tensor::cat(&ws, 0), biases.then(|| Tensor::cat(&bs, 0)).as_ref()),
            };
            crate::set_autocast(false, false, false).unwrap();
            let y = y.unwrap();
            let mut inputs = vec![&x];
            inputs.extend(&w_refs);
            inputs.extend(b_used);
            let mut out = vec![y.detach()];
            out.extend(Tensor::run_backward(
                &[&(y.to_kind(Kind::Float) * &gy).sum(Kind::Float)],
                &inputs,
                false,
                false,
            ));
            out
        };
        for biases in [true, false] {
            let (ours, joined) = (run(true, biases), run(false, biases));
            assert_eq!(
                ours.len(),
                2 + 3 + if biases { 3 } else { 0 },
                "y, x's gradient, the weights' and the biases'"
            );
            for (i, (a, b)) in ours.iter().zip(&joined).enumerate() {
                assert_eq!((a.kind(), a.size()), (b.kind(), b.size()), "bias {biases}: output {i}");
                assert!(a.equal(b), "bias {biases}: output {i} differs by {:e}", max_rel(a, b));
            }
        }
        // Kept: the second forward reuses the joint casts (weights, biases), a part changed in
        // place is cast anew, and the result is that of casting afresh.
        let scope = KeptCasts::start().unwrap();
        let first = run(true, true);
        assert_eq!(KeptCasts::held(), 2, "one joint cast for the weights, one for the biases");
        let before = KeptCasts::reused();
        let again = run(true, true);
        assert_eq!(KeptCasts::reused() - before, 2, "both reused");
        assert!(first.iter().zip(&again).all(|(a, b)| a.equal(b)));
        let _ = tch::no_grad(|| ws[1].shallow_clone().f_add_scalar_(0.25).unwrap());
        let before = KeptCasts::reused();
        let changed = run(true, true);
        assert_eq!(KeptCasts::reused() - before, 1, "the weights' joint cast made anew, the biases' reused");
        drop(scope);
        let fresh = run(true, true);
        assert!(!changed[0].equal(&first[0]), "the change shows");
        assert!(changed.iter().zip(&fresh).all(|(a, b)| a.equal(b)), "as cast afresh");
        // Summed in the GEMMs: each weight's gradient added into its accumulator (its rows of
        // the joint gradient: its own GEMM), none handed to autograd; the biases' as before.
        let accs: Vec<Tensor> = ws.iter().map(|w| w.ones_like()).collect();
        let sums = GemmSums::start(&ws, &accs).unwrap();
        assert_eq!(sums.held(), 3);
        crate::set_autocast(false, true, false).unwrap();
        let y = merged_linear(&x, &w_refs, &b_refs).unwrap();
        crate::set_autocast(false, false, false).unwrap();
        let objective = (y.to_kind(Kind::Float) * &gy).sum(Kind::Float);
        let mut inputs = vec![&x];
        inputs.extend(&w_refs);
        inputs.extend(&b_refs);
        let g = Tensor::run_backward(&[&objective], &inputs, false, false);
        drop(sums);
        for i in 0..3 {
            assert!(!g[1 + i].defined(), "weight {i}: no gradient handed to autograd");
            let want = fresh[2 + i].f_add_scalar(1.0).unwrap();
            assert!(
                max_rel(&accs[i], &want) < 1e-6,
                "weight {i}: the sum is 1 + its gradient ({:e} off)",
                max_rel(&accs[i], &want)
            );
            assert!(g[4 + i].equal(&fresh[5 + i]), "bias {i}");
        }
        assert!(g[0].equal(&fresh[1]), "x's gradient");
    }
}
