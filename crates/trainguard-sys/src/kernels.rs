//! Wrappers over `optim_kernels.cpp`, the optimizers' and clipping's kernels:
//! - ATen's multi-tensor ones that tch does not expose: fused AdamW and SGD, the global norm
//!   and scaling of a tensor list (`_foreach_norm`, `_foreach_mul_`), on the CPU and CUDA;
//! - our own fused updates for the optimizers ATen has no kernel for (8-bit AdamW, Adafactor),
//!   a few passes over a tensor instead of ~20: on the CPU, and on CUDA with the kernels of
//!   `optim_kernels.cu`, compiled at run time by NVRTC through `cuda_jit.cpp`. The tensor-op
//!   versions in `optim` compute the same maths and are what these are tested against.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_nvrtc_compile(
        src: *const c_char,
        major: c_int,
        minor: c_int,
        out: *mut *mut c_char,
        len: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_cuda_jit_free(p: *mut c_char);
    fn tg_nvrtc_info(
        major: *mut c_int,
        minor: *mut c_int,
        path: *mut c_char,
        path_len: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_cuda_jit_prepare(ordinal: c_int, src: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_cuda_emulation_set(on: c_int);
    fn tg_cuda_emulation_on() -> c_int;
    fn tg_cuda_emulation_launches() -> u64;
    fn tg_cuda_emulation_launches_of(name: *const c_char) -> u64;
    #[cfg(test)]
    fn tg_cuda_emulation_selftest(
        name: *const c_char,
        bytes: *mut u8,
        out: *mut f32,
        wrong: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_global_norm(
        ts: *const *const c_void,
        n: usize,
        out: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_scale_all(
        ts: *const *const c_void,
        n: usize,
        factor: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_add_all(
        dst: *const *const c_void,
        src: *const *const c_void,
        n: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_zero_all(ts: *const *const c_void, n: usize, err: *mut c_char, err_len: usize) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn tg_fused_adamw(
        params: *const *const c_void,
        grads: *const *const c_void,
        exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void,
        steps: *const *const c_void,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn tg_fused_sgd(
        params: *const *const c_void,
        grads: *const *const c_void,
        bufs: *const *const c_void,
        n: usize,
        weight_decay: f64,
        momentum: f64,
        lr: f64,
        is_first_step: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn tg_adamw8bit_update(
        param: *mut c_void,
        grad: *const c_void,
        exp_avg: *mut c_void,
        exp_avg_absmax: *mut c_void,
        exp_avg_sq: *mut c_void,
        exp_avg_sq_absmax: *mut c_void,
        beta1: f64,
        beta2: f64,
        shrink: f64,
        scale: f64,
        shift: f64,
        apply: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn tg_adafactor_update(
        param: *mut c_void,
        grad: *const c_void,
        a: *mut c_void,
        b: *mut c_void,
        workspace: *mut c_void,
        bands: std::ffi::c_longlong,
        one_minus_beta2: f64,
        rho: f64,
        eps1: f64,
        eps2: f64,
        d: f64,
        shrink: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// The constants of one 8-bit AdamW step: `p ← p·shrink + m / (√v·scale + shift)` after the
/// moments moved by `1 − beta1` / `1 − beta2` towards g / g²; `apply` false leaves `p` alone.
#[derive(Debug, Clone, Copy)]
pub struct AdamW8bitStep {
    pub beta1: f64,
    pub beta2: f64,
    pub shrink: f64,
    pub scale: f64,
    pub shift: f64,
    pub apply: bool,
}

/// The 8-bit moments of one parameter: int8 codes and fp32 scales of the first, uint8 codes and
/// fp32 scales of the second (`optim::quant`'s layout, one scale per 2048 values).
pub struct QuantisedMoments<'a> {
    pub exp_avg: &'a Tensor,
    pub exp_avg_absmax: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    pub exp_avg_sq_absmax: &'a Tensor,
}

/// One 8-bit AdamW update of `param` (flat, contiguous, on the CPU or on a CUDA device the
/// kernels were [prepared](prepare_cuda) for) from `grad` (same dtype), dequantising, updating
/// and requantising each block of 2048 values in one pass (on CUDA: one launch).
pub fn adamw8bit_update(
    param: &Tensor,
    grad: &Tensor,
    m: QuantisedMoments,
    s: AdamW8bitStep,
) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: every pointer is a live tch tensor handle (an at::Tensor*) borrowed for the call;
    // the shim checks devices, dtypes and lengths before it touches data, and catches every
    // exception. The tensors are written in place through their storage, as tch's `_` ops do.
    let code = unsafe {
        tg_adamw8bit_update(
            handle(param),
            handle(grad),
            handle(m.exp_avg),
            handle(m.exp_avg_absmax),
            handle(m.exp_avg_sq),
            handle(m.exp_avg_sq_absmax),
            s.beta1,
            s.beta2,
            s.shrink,
            s.scale,
            s.shift,
            c_int::from(s.apply),
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)
}

/// The constants of one Adafactor step (see `optim::adafactor`): the second moments move by
/// `one_minus_beta2` towards g²; α = max(eps2, RMS(p))·rho; u = g / √max(v̂, eps1²);
/// `p ← p·shrink − α·u / max(1, RMS(u)/d)`.
#[derive(Debug, Clone, Copy)]
pub struct AdafactorStep {
    pub one_minus_beta2: f64,
    pub rho: f64,
    pub eps1: f64,
    pub eps2: f64,
    pub d: f64,
    pub shrink: f64,
}

/// Adafactor's second moment of one parameter, in the parameter's dtype.
pub enum SecondMoments<'a> {
    /// A matrix [R, C]: row means [R, 1] and column means [1, C] of g².
    Factored { row_var: &'a Tensor, col_var: &'a Tensor },
    /// Anything else: one running mean of g² per value.
    Full { variance: &'a Tensor },
}

/// Where Adafactor's CUDA kernels keep their sums: an fp64 buffer on the parameter's device of at
/// least 4 + units + bands·C values (units: R for a matrix [R, C], else one per 2048 values;
/// `optim::adafactor` sizes it), and the runs of rows (bands) a matrix's column sums are split into.
pub struct AdafactorWorkspace<'a> {
    pub buffer: &'a Tensor,
    pub column_bands: i64,
}

/// One Adafactor update of `param` (contiguous) from `grad` (same dtype and shape): on the CPU in
/// four reads of the gradient and parameter and one write; on a CUDA device the kernels were
/// [prepared](prepare_cuda) for, in five to seven launches that need `workspace`.
pub fn adafactor_update(
    param: &Tensor,
    grad: &Tensor,
    moments: SecondMoments,
    s: AdafactorStep,
    workspace: Option<&AdafactorWorkspace>,
) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    let (a, b) = match moments {
        SecondMoments::Factored { row_var, col_var } => (handle(row_var), handle(col_var)),
        SecondMoments::Full { variance } => (handle(variance), std::ptr::null_mut()),
    };
    let (ws, bands) = workspace.map_or((std::ptr::null_mut(), 1), |w| (handle(w.buffer), w.column_bands));
    // SAFETY: as in `adamw8bit_update`; `b` is null exactly when the moment is full, `ws` when no
    // workspace is given (the shim refuses a CUDA parameter without one).
    let code = unsafe {
        tg_adafactor_update(
            handle(param),
            handle(grad),
            a,
            b,
            ws,
            bands,
            s.one_minus_beta2,
            s.rho,
            s.eps1,
            s.eps2,
            s.d,
            s.shrink,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)
}

/// Values per CUDA block of our kernels (`TG_BLOCK` in `optim_kernels.cu`): 8-bit AdamW's
/// quantisation block, and Adafactor's unit of anything but a matrix (whose unit is a row).
pub const CUDA_BLOCK_VALUES: i64 = 2048;

/// Our own CUDA kernels' source (`optim_kernels.cu`, then `loss_kernels.cu`, `norm_kernels.cu`,
/// `llama_kernels.cu` and `linear_kernels.cu`, which use its dtype loaders), NUL-terminated for the shim, which compiles it at run time with NVRTC
/// (`cuda_jit.cpp`): the build needs no CUDA toolkit.
const CUDA_SOURCE: &str = concat!(
    include_str!("../cuda/optim_kernels.cu"),
    include_str!("../cuda/loss_kernels.cu"),
    include_str!("../cuda/norm_kernels.cu"),
    include_str!("../cuda/llama_kernels.cu"),
    include_str!("../cuda/linear_kernels.cu"),
    "\0"
);

/// The machine code (an ELF cubin) of our CUDA kernels for compute capability `major.minor`, as
/// [`prepare_cuda`] compiles it. Needs NVRTC (the torch wheel's `nvidia/cu13/lib/libnvrtc.so.13`),
/// not a GPU: tests compile the source on machines without one.
pub fn cuda_binary(major: i32, minor: i32) -> Result<Vec<u8>, ShimError> {
    let (mut out, mut len) = (std::ptr::null_mut::<c_char>(), 0usize);
    let mut err = [0u8; ERR_LEN];
    // SAFETY: the source is NUL-terminated; on success the shim hands over a malloc'd buffer of
    // `len` bytes, copied here and released with tg_cuda_jit_free.
    let code = unsafe {
        tg_nvrtc_compile(
            CUDA_SOURCE.as_ptr().cast(),
            major,
            minor,
            &mut out,
            &mut len,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: as above; `out` is non-null after a successful call.
    let binary = unsafe { std::slice::from_raw_parts(out.cast::<u8>(), len).to_vec() };
    unsafe { tg_cuda_jit_free(out) };
    Ok(binary)
}

/// NVRTC's version and the library file loaded, as `trainguard env` reports them; the error says
/// where it was looked for.
pub fn nvrtc_info() -> Result<(i32, i32, String), ShimError> {
    let (mut major, mut minor) = (0, 0);
    let (mut path, mut err) = ([0u8; 1024], [0u8; ERR_LEN]);
    // SAFETY: plain out-parameters and buffers of the lengths given; the shim catches exceptions.
    let code = unsafe {
        tg_nvrtc_info(
            &mut major,
            &mut minor,
            path.as_mut_ptr().cast(),
            path.len(),
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    let path = std::ffi::CStr::from_bytes_until_nul(&path)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok((major, minor, path))
}

/// Compiles our CUDA kernels for `device`'s compute capability and loads them, once per device
/// (later calls return at once): what the CUDA paths of [`adamw8bit_update`],
/// [`adafactor_update`] and [`super::loss::cross_entropy`] need first. An
/// error names what failed (NVRTC missing, the compiler's log, the driver's error).
pub fn prepare_cuda(device: tch::Device) -> Result<(), ShimError> {
    let tch::Device::Cuda(ordinal) = device else { return Ok(()) };
    let mut err = [0u8; ERR_LEN];
    // SAFETY: the source is NUL-terminated and static; the shim catches every exception.
    result(
        unsafe {
            tg_cuda_jit_prepare(
                ordinal as c_int,
                CUDA_SOURCE.as_ptr().cast(),
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        },
        &err,
    )
}

/// For tests on machines without a GPU: while a `CudaEmulation` lives, CPU tensors on this
/// thread take the CUDA paths of [`adamw8bit_update`], [`adafactor_update`] and
/// [`super::loss::cross_entropy`], which run the `.cu` kernels' own source compiled for the host
/// (`cuda_emulation.cpp`: a block's threads as fibers, a warp at a time, its barriers and
/// shuffles emulated). So CI checks the kernels' logic against the CPU kernels; only a GPU can
/// check the device's arithmetic and speed. Never switched on in training.
pub struct CudaEmulation {
    was_on: bool,
    launches_before: u64,
    _per_thread: std::marker::PhantomData<*const ()>, // not Send: the switch is per thread
}

impl CudaEmulation {
    pub fn start() -> Self {
        // SAFETY: reads and sets thread-local values.
        let (was_on, launches_before) = unsafe {
            let was_on = tg_cuda_emulation_on() != 0;
            tg_cuda_emulation_set(1);
            (was_on, tg_cuda_emulation_launches())
        };
        Self { was_on, launches_before, _per_thread: std::marker::PhantomData }
    }

    /// Kernels launched (emulated) on this thread since `start`.
    pub fn launches(&self) -> u64 {
        // SAFETY: reads a thread-local counter.
        let now = unsafe { tg_cuda_emulation_launches() };
        now - self.launches_before
    }

    /// Launches of the kernel `name` (emulated) on this thread since the process began: where
    /// a launch may take one of two forms, which ran.
    pub fn launches_of(name: &str) -> u64 {
        let name = std::ffi::CString::new(name).expect("a kernel's name has no NUL");
        // SAFETY: a NUL-terminated string, read during the call; reads a thread-local map.
        unsafe { tg_cuda_emulation_launches_of(name.as_ptr()) }
    }
}

impl Drop for CudaEmulation {
    fn drop(&mut self) {
        // SAFETY: as in `start`. A guard inside another leaves the switch as it found it.
        unsafe { tg_cuda_emulation_set(c_int::from(self.was_on)) };
    }
}

/// Whether tensors on `device` go through our CUDA kernels: on a CUDA device, or on the CPU
/// under a [`CudaEmulation`].
pub fn runs_cuda_kernels(device: tch::Device) -> bool {
    // SAFETY: reads a thread-local flag.
    device.is_cuda() || (device == tch::Device::Cpu && unsafe { tg_cuda_emulation_on() } != 0)
}

/// Hyper-parameters of one fused AdamW call.
#[derive(Debug, Clone, Copy)]
pub struct AdamWHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// The tch handle (`at::Tensor*`) of `t`, as the shim's entry points take tensors.
fn handle(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

/// The handles of `tensors`, as the shim's list functions take them.
pub(crate) fn handles<T: std::borrow::Borrow<Tensor>>(tensors: &[T]) -> Vec<*const c_void> {
    tensors.iter().map(|t| handle(t.borrow()) as *const c_void).collect()
}

/// The global L2 norm of `tensors` written into the 0-dim `out` (any float dtype): per-tensor
/// norms in one multi-tensor launch on CUDA, then their norm.
pub fn global_norm(tensors: &[Tensor], out: &Tensor) -> Result<(), ShimError> {
    let ptrs = handles(tensors);
    let mut err = [0u8; ERR_LEN];
    // SAFETY: each pointer is a live tch tensor handle (an at::Tensor*) borrowed for the call, as
    // is `out`; the shim copies the handles (refcounted) and catches every exception.
    result(
        unsafe { tg_global_norm(ptrs.as_ptr(), ptrs.len(), handle(out), err.as_mut_ptr().cast(), ERR_LEN) },
        &err,
    )
}

/// Multiplies every one of `tensors` by `factor` in place (one multi-tensor launch on CUDA).
pub fn scale_all(tensors: &[Tensor], factor: f64) -> Result<(), ShimError> {
    let ptrs = handles(tensors);
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `global_norm`.
    result(unsafe { tg_scale_all(ptrs.as_ptr(), ptrs.len(), factor, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// `dst[i] += src[i]` in place for every pair (one multi-tensor launch on CUDA): gradient
/// accumulation over micro-batches. A pair whose `src` is undefined is skipped: a gradient
/// already added into its accumulator where it was computed (`ffi::linear::GemmSums`).
pub fn add_all(dst: &[Tensor], src: &[Tensor]) -> Result<(), ShimError> {
    assert_eq!(dst.len(), src.len(), "tensor lists differ in length");
    let (d, s): (Vec<_>, Vec<_>) = dst
        .iter()
        .zip(src)
        .filter(|(_, s)| s.defined())
        .map(|(d, s)| (handle(d) as *const c_void, handle(s) as *const c_void))
        .unzip();
    if d.is_empty() {
        return Ok(()); // ATen's multi-tensor ops refuse empty lists
    }
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `global_norm`.
    result(unsafe { tg_add_all(d.as_ptr(), s.as_ptr(), d.len(), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// Sets every one of `tensors` to zero in place (one multi-tensor launch on CUDA); unlike a
/// scaling by 0 it also clears a NaN or an infinity.
pub fn zero_all(tensors: &[Tensor]) -> Result<(), ShimError> {
    let ptrs = handles(tensors);
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `global_norm`.
    result(unsafe { tg_zero_all(ptrs.as_ptr(), ptrs.len(), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// `at::_fused_adamw_` over parallel lists of tensors (all the same length); `steps` are float
/// scalar tensors already incremented for this update.
pub fn fused_adamw(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    steps: &[&Tensor],
    h: AdamWHyper,
) -> Result<(), ShimError> {
    let n = params.len();
    assert!(
        [grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()].iter().all(|&l| l == n),
        "tensor lists differ in length"
    );
    let (p, g, m, v, s) =
        (handles(params), handles(grads), handles(exp_avgs), handles(exp_avg_sqs), handles(steps));
    let mut err = [0u8; ERR_LEN];
    // SAFETY: each pointer is a live tch tensor handle (an at::Tensor*) borrowed for the call;
    // the shim copies the handles (refcounted) and catches every exception.
    let code = unsafe {
        tg_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)
}

/// `at::_fused_sgd_` over parallel lists of tensors: coupled `weight_decay`, then heavy-ball
/// `momentum` when `momentum_buffers` is `Some` (one per parameter; `first_step` copies the
/// gradient into them, as PyTorch's first step does).
pub fn fused_sgd(
    params: &[&Tensor],
    grads: &[&Tensor],
    momentum_buffers: Option<&[&Tensor]>,
    weight_decay: f64,
    momentum: f64,
    lr: f64,
    first_step: bool,
) -> Result<(), ShimError> {
    let n = params.len();
    assert!(
        grads.len() == n && momentum_buffers.is_none_or(|b| b.len() == n),
        "tensor lists differ in length"
    );
    let (p, g, b) = (handles(params), handles(grads), momentum_buffers.map(handles));
    let b_ptr = b.as_ref().map_or(std::ptr::null(), |b| b.as_ptr());
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `fused_adamw`; `b_ptr` is null exactly when there are no buffers.
    let code = unsafe {
        tg_fused_sgd(
            p.as_ptr(),
            g.as_ptr(),
            b_ptr,
            n,
            weight_decay,
            momentum,
            lr,
            c_int::from(first_step),
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulation, CI's only run of our CUDA kernels, catches what would fault or race on a
    /// GPU: each check kernel used right gives CUDA's result, used wrong the report (or the wrong
    /// values) a GPU's undefined behaviour would hide.
    #[test]
    fn the_emulation_reports_what_would_fault_or_race_on_a_gpu() {
        #[repr(C, align(16))]
        struct Bytes([u8; 48]);
        let run = |name: &str, wrong: bool, out: &mut [f32; 256]| -> (Result<(), ShimError>, Bytes) {
            let mut bytes = Bytes(std::array::from_fn(|i| i as u8));
            let name = std::ffi::CString::new(name).unwrap();
            let mut err = [0u8; ERR_LEN];
            // SAFETY: 48 bytes and 256 floats, as the check kernels take; the shim catches exceptions.
            let code = unsafe {
                tg_cuda_emulation_selftest(
                    name.as_ptr(),
                    bytes.0.as_mut_ptr(),
                    out.as_mut_ptr(),
                    wrong as c_int,
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            };
            (result(code, &err), bytes)
        };
        let fails_with = |name: &str, what: &str| {
            let err = run(name, true, &mut [0.0; 256]).0.expect_err(name).to_string();
            assert!(err.contains(&format!("tg_test_{name}")) && err.contains(what), "{name}: {err}");
        };
        // A pack: copied where it starts on 16 bytes, reported where it does not.
        let (ok, bytes) = run("pack", false, &mut [0.0; 256]);
        ok.unwrap();
        assert_eq!(bytes.0[..16], bytes.0[16..32], "the pack was copied");
        fails_with("pack", "not a multiple of 16");
        // A shuffle that half a warp skips; threads leaving while the rest wait at a barrier.
        run("shuffle", false, &mut [0.0; 256]).0.unwrap();
        fails_with("shuffle", "a shuffle not met by its whole warp");
        run("leave", false, &mut [0.0; 256]).0.unwrap();
        fails_with("leave", "threads ended while");
        // A launch whose arguments are fewer than the kernel's parameters (a GPU would read past
        // the array), or one of another size than its parameter (a GPU would read it short or
        // with its neighbour's bytes): refused before any thread runs.
        let name = std::ffi::CString::new("barrier").unwrap();
        for (wrong, refused) in [
            (2, "tg_test_barrier takes 3 arguments; the launch passes 2"),
            (3, "tg_test_barrier's parameter 2 takes 4 bytes; the launch passes 8"),
        ] {
            let (mut bytes, mut out, mut err) = ([0u8; 48], [0f32; 256], [0u8; ERR_LEN]);
            // SAFETY: 48 bytes and 256 floats, as the check kernels take; the shim catches exceptions.
            let code = unsafe {
                tg_cuda_emulation_selftest(
                    name.as_ptr(),
                    bytes.as_mut_ptr(),
                    out.as_mut_ptr(),
                    wrong,
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            };
            let err = result(code, &err).expect_err(refused).to_string();
            assert!(err.contains(refused), "{err}");
        }
        // Shared memory read without the barrier after its writes: the later warps' values are
        // not there yet (this launch's inputs differ from any earlier one's).
        for wrong in [false, true] {
            let input: [f32; 256] = std::array::from_fn(|t| 1000.0 * (wrong as u8 as f32 + 1.0) + t as f32);
            let mut out = input;
            run("barrier", wrong, &mut out).0.unwrap();
            let passed = (0..256).all(|t| out[t] == input[(t + 32) % 256]);
            assert_eq!(
                passed,
                !wrong,
                "a barrier {}: each thread gets the value of the thread 32 on",
                if wrong { "missing" } else { "in place" }
            );
        }
    }

    /// The kernels that stream rows through memory issue a row's (or a batch's) loads together,
    /// in the machine code NVRTC makes for an H100: where ptxas waits for each few loads, the
    /// fourth H100 session measured half the memory's speed. `scripts/gpu/load_waits.py --check`
    /// disassembles them (nvdisasm from the pinned wheel scripts/setup.sh installs).
    #[test]
    fn the_streaming_kernels_have_a_batch_of_loads_in_flight_on_sm_90() {
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let out = std::process::Command::new(repo.join(".venv/bin/python"))
            .arg(repo.join("scripts/gpu/load_waits.py"))
            .arg("--check")
            .output()
            .expect("the venv's python (scripts/setup.sh)");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{report}\n{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(
            report.matches("(want a group of").count(),
            15,
            "every kernel the check names was found: {report}"
        );
    }

    /// The CUDA kernels run only on a GPU (tests/it/gpu.rs), but NVRTC compiles them to machine code
    /// anywhere, as a GPU run does: a source that no longer compiles or assembles, for any GPU
    /// generation CUDA 13 supports, or that lost a kernel the shim loads by name, fails here.
    #[test]
    fn the_cuda_kernels_compile_with_nvrtc_for_every_supported_gpu() {
        let mut entries = vec![
            "tg_adafactor_coef".to_string(),
            "tg_ln_param_sum".to_string(),
            "tg_col_sum_finish".to_string(),
        ];
        for dtype in ["f32", "bf16", "f16"] {
            entries.push(format!("tg_adamw8bit_{dtype}"));
            entries.extend(
                ["rows", "cols", "col_var", "scale", "usq", "apply"]
                    .map(|stage| format!("tg_adafactor_{stage}_{dtype}")),
            );
            entries.extend(
                ["forward", "backward", "forward_grad", "scale_grad"]
                    .map(|pass| format!("tg_ce_{pass}_{dtype}")),
            );
            entries.extend(
                ["forward", "forward_warp", "backward", "backward_warp", "param_grads"]
                    .map(|pass| format!("tg_ln_{pass}_{dtype}")),
            );
            entries.extend(["forward", "backward"].map(|pass| format!("tg_swiglu_{pass}_{dtype}")));
            entries.push(format!("tg_rope_{dtype}"));
            entries.extend(
                ["col_sum_bands", "col_sum_bands_packed", "gelu_backward_bands"]
                    .map(|k| format!("tg_{k}_{dtype}")),
            );
        }
        for (major, minor) in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
            let cubin = cuda_binary(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
            assert!(cubin.starts_with(b"\x7fELF"), "sm_{major}{minor}: not an ELF cubin");
            for entry in &entries {
                // A symbol name is NUL-terminated in the ELF string table: `tg_adafactor_cols_f32`
                // must not pass on the strength of `tg_adafactor_col_var_f32` or a longer name.
                let symbol = format!("{entry}\0");
                assert!(
                    cubin.windows(symbol.len()).any(|w| w == symbol.as_bytes()),
                    "sm_{major}{minor}: no kernel {entry}"
                );
            }
        }
        assert!(
            super::CUDA_SOURCE.contains(&format!("#define TG_BLOCK {}\n", super::CUDA_BLOCK_VALUES)),
            "the Rust side sizes buffers by the kernels' block"
        );
        let err = cuda_binary(1, 0).unwrap_err().to_string();
        assert!(
            err.contains("sm_10") && err.contains("NVRTC"),
            "an unknown GPU is refused with NVRTC's reason: {err}"
        );
    }
}
