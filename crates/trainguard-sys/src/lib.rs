//! The only unsafe code: thin wrappers over `shim.cpp` (allocator statistics, cache control,
//! allocator settings, deterministic mode, autocast, versions, a backward from given gradients), over `optim_kernels.cpp` (the
//! optimizers' and clipping's kernels: [`kernels`]), over `loss_kernels.cpp` (the loss as one
//! autograd node: [`loss`]), over `norm_kernels.cpp` (LayerNorm and RMSNorm with their residual add: [`norm`]), over
//! `linear_kernels.cpp` (the linear layer with fp32 parameter gradients: [`linear`]),
//! over `attention.cpp` (variable-length attention over documents: [`attention`]),
//! over `shim_cuda.cpp` (the allocator's
//! history and snapshot), over `graph.cpp` (CUDA graphs: [`graph`]), over `dist.cpp` (c10d: [`dist`]), over `trace.cpp` (PyTorch's profiler:
//! [`trace`]) and over the few OS calls trainguard
//! makes ([`os`]). Each call returns a typed
//! result; "no accelerator" is [`ShimError::Unavailable`], never an abort. [`torch_panics`]
//! turns the libtorch errors tch itself raises as panics back into errors.
pub mod attention;
pub mod dist;
pub mod graph;
pub mod kernels;
pub mod linear;
pub mod llama_ops;
pub mod loss;
pub mod norm;
pub mod os;
pub mod torch_panics;
pub mod trace;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use tch::Tensor;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShimError {
    #[error("no CUDA device: allocator statistics are unavailable")]
    Unavailable,
    #[error("libtorch: {0}")]
    Torch(String),
}

/// Where a shim call sits among tch's own tensor ops (the optimizers, clipping): its error is a
/// libtorch error like theirs, and the guard reads its message the same way.
impl From<ShimError> for tch::TchError {
    fn from(e: ShimError) -> Self {
        tch::TchError::Torch(e.to_string())
    }
}

/// Caching-allocator statistics of one device, in bytes. Pools: `[aggregate, small, large]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    pub allocated_current: [i64; 3],
    pub allocated_peak: [i64; 3],
    pub reserved_current: [i64; 3],
    pub reserved_peak: [i64; 3],
    pub active_current: i64,
    pub active_peak: i64,
    pub requested_current: i64,
    pub requested_peak: i64,
    pub inactive_split_current: i64,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
}

/// Versions and capabilities of the libtorch this binary runs on.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Versions {
    pub torch_major: i32,
    pub torch_minor: i32,
    pub torch_patch: i32,
    pub cuda_available: i32,
    pub cudnn_available: i32,
    /// CUDA runtime as 13000 = 13.0; -1 unknown.
    pub cudart_version: i64,
    /// cuDNN as 91002 = 9.10.2; -1 unknown.
    pub cudnn_version: i64,
    pub cuda_devices: i32,
    pub intra_op_threads: i32,
}

extern "C" {
    fn tg_versions(out: *mut Versions, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_accelerator_available() -> c_int;
    fn tg_allocator_initialized() -> c_int;
    fn tg_autocast(cuda: c_int, enabled: c_int, dtype: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_set_matmul_precision(p: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_device_stats(device: c_int, out: *mut AllocatorStats, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_memory_info(
        device: c_int,
        free: *mut i64,
        total: *mut i64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_empty_cache(err: *mut c_char, err_len: usize) -> c_int;
    fn tg_storage_resize(tensor: *mut c_void, nbytes: i64, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_copy_async(dst: *mut c_void, src: *const c_void, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_reset_peak_stats(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_set_current_device(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_set_onednn_enabled(on: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_errors_without_stack_traces(err: *mut c_char, err_len: usize) -> c_int;
    fn tg_set_deterministic(on: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_deterministic_state() -> c_int;
    fn tg_set_allocator_settings(settings: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_get_allocator_settings(out: *mut c_char, out_len: usize) -> c_int;
    fn tg_backward(
        roots: *const *const c_void,
        grads: *const *const c_void,
        n_roots: usize,
        inputs: *const *const c_void,
        n_inputs: usize,
        out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

const ERR_LEN: usize = 4096;

fn result(code: c_int, err: &[u8]) -> Result<(), ShimError> {
    match code {
        0 => Ok(()),
        2 => Err(ShimError::Unavailable),
        _ => {
            let msg =
                CStr::from_bytes_until_nul(err).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            Err(ShimError::Torch(msg))
        }
    }
}

pub fn versions() -> Result<Versions, ShimError> {
    let mut out = Versions::default();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `out` is a repr(C) mirror of tg_versions; `err` is ERR_LEN bytes.
    let code = unsafe { tg_versions(&mut out, err.as_mut_ptr().cast(), ERR_LEN) };
    result(code, &err).map(|_| out)
}

/// The gradients of `inputs` (each wanting one) from a backward through `roots` seeded with
/// `grads` (one each, of the root's shape; another dtype is cast to the root's), where tch's
/// `run_backward` seeds ones; undefined where the graph does not reach an input. The graph is
/// freed.
pub fn backward(roots: &[&Tensor], grads: &[&Tensor], inputs: &[Tensor]) -> Result<Vec<Tensor>, ShimError> {
    assert_eq!(roots.len(), grads.len(), "a gradient for each root");
    let (r, g, i) = (kernels::handles(roots), kernels::handles(grads), kernels::handles(inputs));
    let mut out = vec![std::ptr::null_mut::<c_void>(); inputs.len()];
    let mut err = [0u8; ERR_LEN];
    // SAFETY: the handles are live tensors borrowed for the call; `out` holds one slot per input,
    // which the shim fills with tensors it allocated with `new` (or leaves null on an error).
    let code = unsafe {
        tg_backward(
            r.as_ptr(),
            g.as_ptr(),
            r.len(),
            i.as_ptr(),
            i.len(),
            out.as_mut_ptr(),
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    // Taken over before the result is read, so none leaks on an error.
    // SAFETY: each non-null pointer is a tensor the shim handed over, owned from here by tch.
    let taken: Vec<Option<Tensor>> =
        out.into_iter().map(|p| (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p.cast()) })).collect();
    result(code, &err)?;
    Ok(taken.into_iter().map(|t| t.expect("the shim returns every input's gradient on success")).collect())
}

/// A second tensor over `t`'s own memory (same shape, strides and dtype) with its own version
/// counter: in-place writes through it are not seen by autograd's checks on `t`. For tests that
/// write weights the way a raw kernel does. `t` must be a live CPU tensor and outlive the alias.
pub fn alias_without_version(t: &Tensor) -> Tensor {
    assert_eq!(t.device(), tch::Device::Cpu, "aliases are made of CPU tensors");
    // SAFETY: the pointer, sizes and strides are t's own, so the view stays inside its storage.
    unsafe {
        Tensor::from_blob(t.data_ptr() as *const u8, &t.size(), &t.stride(), t.kind(), tch::Device::Cpu)
    }
}

/// Turns autocast on (to `half`: fp16, else bf16) or off for CUDA or CPU ops.
pub fn set_autocast(cuda: bool, enabled: bool, half: bool) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: plain values; `err` is ERR_LEN bytes.
    result(
        unsafe {
            tg_autocast(cuda as c_int, enabled as c_int, half as c_int, err.as_mut_ptr().cast(), ERR_LEN)
        },
        &err,
    )
}

/// `highest` (true fp32) or `high` (TF32 matmuls on Ampere and newer).
pub fn set_matmul_precision(p: &str) -> Result<(), ShimError> {
    let c = CString::new(p).map_err(|_| ShimError::Torch("NUL in precision".into()))?;
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `c` is NUL-terminated and outlives the call.
    result(unsafe { tg_set_matmul_precision(c.as_ptr(), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

pub fn accelerator_available() -> bool {
    // SAFETY: no arguments; the shim catches every exception.
    unsafe { tg_accelerator_available() == 1 }
}

pub fn device_stats(device: usize) -> Result<AllocatorStats, ShimError> {
    let mut out = AllocatorStats::default();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `out` is a repr(C) mirror of tg_stats; `err` is ERR_LEN bytes.
    let code = unsafe { tg_device_stats(device as c_int, &mut out, err.as_mut_ptr().cast(), ERR_LEN) };
    result(code, &err).map(|_| out)
}

/// Whether the accelerator's caching allocator has started (its per-device allocators exist):
/// from then on a memory fraction in the allocator settings no longer applies.
pub fn allocator_initialized() -> bool {
    // SAFETY: no arguments; the shim catches every exception.
    unsafe { tg_allocator_initialized() == 1 }
}

/// (free, total) bytes of a device as the driver reports them. Does not start the caching
/// allocator (see [`allocator_initialized`]).
pub fn memory_info(device: usize) -> Result<(u64, u64), ShimError> {
    let (mut free, mut total) = (0i64, 0i64);
    let mut err = [0u8; ERR_LEN];
    // SAFETY: both outputs are valid i64s; `err` is ERR_LEN bytes.
    let code =
        unsafe { tg_memory_info(device as c_int, &mut free, &mut total, err.as_mut_ptr().cast(), ERR_LEN) };
    result(code, &err).map(|_| (free as u64, total as u64))
}

/// Returns the caching allocator's unused cached blocks to the device.
pub fn empty_cache() -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `err` is ERR_LEN bytes.
    result(unsafe { tg_empty_cache(err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// Frees the memory under `t`'s storage (`nbytes` 0) or allocates it anew (contents undefined),
/// for every tensor sharing that storage: `dist.shard: parameters` frees the parameters a rank
/// does not own between their uses. Reading a tensor whose storage is freed is an error of the
/// caller's: it must be allocated again (and written) first.
pub fn resize_storage(t: &Tensor, nbytes: usize) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `t` is a live tensor whose C++ object outlives the call; `err` is ERR_LEN bytes.
    let code = unsafe {
        tg_storage_resize(t.as_ptr() as *mut c_void, nbytes as i64, err.as_mut_ptr().cast(), ERR_LEN)
    };
    result(code, &err)
}

/// Copies `src` into `dst` without waiting: between a CUDA device and pinned host memory the
/// copy is queued on the current stream (elsewhere it is an ordinary copy). Both must stay alive,
/// and the host must not read or write the pinned side, until the stream is synchronized.
pub fn copy_async(dst: &Tensor, src: &Tensor) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: both are live tensors whose C++ objects outlive the call; `err` is ERR_LEN bytes.
    let code = unsafe {
        tg_copy_async(
            dst.as_ptr() as *mut c_void,
            src.as_ptr() as *const c_void,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)
}

/// Makes `device` this thread's current CUDA device (see `tg_set_current_device`).
pub fn set_current_device(device: usize) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `err` is ERR_LEN bytes.
    result(unsafe { tg_set_current_device(device as c_int, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

pub fn reset_peak_stats(device: usize) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `err` is ERR_LEN bytes.
    result(unsafe { tg_reset_peak_stats(device as c_int, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// Applies a `PYTORCH_CUDA_ALLOC_CONF`-style string (`key:value,...`).
pub fn set_allocator_settings(settings: &str) -> Result<(), ShimError> {
    let c = CString::new(settings).map_err(|_| ShimError::Torch("settings contain a NUL byte".into()))?;
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `c` is NUL-terminated and outlives the call; `err` is ERR_LEN bytes.
    result(unsafe { tg_set_allocator_settings(c.as_ptr(), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// The last settings string the allocator accepted.
pub fn allocator_settings() -> String {
    let mut out = [0u8; ERR_LEN];
    // SAFETY: `out` is ERR_LEN bytes; the shim NUL-terminates.
    unsafe { tg_get_allocator_settings(out.as_mut_ptr().cast(), ERR_LEN) };
    CStr::from_bytes_until_nul(&out).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

/// libtorch's determinism switches as it reports them back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeterministicState {
    /// `torch.are_deterministic_algorithms_enabled()`.
    pub algorithms: bool,
    /// Only warn where an op has no deterministic implementation (trainguard never sets it).
    pub warn_only: bool,
    /// `torch.utils.deterministic.fill_uninitialized_memory`.
    pub fill_uninitialized_memory: bool,
    /// `torch.backends.cudnn.deterministic`.
    pub cudnn: bool,
}

/// `torch.backends.mkldnn.enabled = on`: whether CPU ops may use oneDNN kernels.
pub fn set_onednn_enabled(on: bool) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: a plain value; `err` is ERR_LEN bytes.
    result(unsafe { tg_set_onednn_enabled(on as c_int, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// libtorch's error messages without the C++ stack trace c10 appends (and symbolises, which
/// allocates, when the message is read).
pub fn errors_without_stack_traces() -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `err` is ERR_LEN bytes.
    result(unsafe { tg_errors_without_stack_traces(err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// `torch.use_deterministic_algorithms(on, warn_only=False)`, plus filled uninitialised memory and
/// deterministic cuDNN (benchmarking off) when on.
pub fn set_deterministic(on: bool) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: a plain value; `err` is ERR_LEN bytes.
    result(unsafe { tg_set_deterministic(on as c_int, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

pub fn deterministic_state() -> DeterministicState {
    // SAFETY: no arguments; reads libtorch's global context.
    let bits = unsafe { tg_deterministic_state() };
    DeterministicState {
        algorithms: bits & 1 != 0,
        warn_only: bits & 2 != 0,
        fill_uninitialized_memory: bits & 4 != 0,
        cudnn: bits & 8 != 0,
    }
}

#[cfg(tg_cuda_shim)]
extern "C" {
    fn tg_record_memory_history(on: c_int, max_entries: usize, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_memory_snapshot(out: *mut *mut c_char, len: *mut usize, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_free_buffer(p: *mut c_char);
}

/// Starts (or stops) the CUDA caching allocator's history recorder: alloc, free and OOM events
/// in a ring buffer of `max_entries`, without stack traces. Unavailable without a CUDA device or
/// when this build's libtorch has no CUDA library.
pub fn record_memory_history(on: bool, max_entries: usize) -> Result<(), ShimError> {
    #[cfg(tg_cuda_shim)]
    {
        if !accelerator_available() {
            return Err(ShimError::Unavailable);
        }
        let mut err = [0u8; ERR_LEN];
        // SAFETY: plain values; `err` is ERR_LEN bytes.
        result(
            unsafe { tg_record_memory_history(on as c_int, max_entries, err.as_mut_ptr().cast(), ERR_LEN) },
            &err,
        )
    }
    #[cfg(not(tg_cuda_shim))]
    {
        let _ = (on, max_entries);
        Err(ShimError::Unavailable)
    }
}

/// The allocator's snapshot as PyTorch pickles it (`torch.cuda.memory._snapshot()`, the file
/// pytorch.org/memory_viz opens).
pub fn memory_snapshot_pickled() -> Result<Vec<u8>, ShimError> {
    #[cfg(tg_cuda_shim)]
    {
        if !accelerator_available() {
            return Err(ShimError::Unavailable);
        }
        let (mut buf, mut len): (*mut c_char, usize) = (std::ptr::null_mut(), 0);
        let mut err = [0u8; ERR_LEN];
        // SAFETY: `buf`/`len` receive a malloc'd buffer of `len` bytes (or null on error), which
        // is copied and then released with tg_free_buffer exactly once.
        let code = unsafe { tg_memory_snapshot(&mut buf, &mut len, err.as_mut_ptr().cast(), ERR_LEN) };
        result(code, &err)?;
        let bytes = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        unsafe { tg_free_buffer(buf) };
        Ok(bytes)
    }
    #[cfg(not(tg_cuda_shim))]
    Err(ShimError::Unavailable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// A backward seeded with given gradients gives what the seeded sum's gives: two roots, one
    /// of them bf16 seeded in fp32 (cast to the root's dtype); an input the graph does not reach
    /// gets an undefined gradient; a root outside any graph, or a seed of another shape, is an
    /// error that says so.
    #[test]
    fn a_seeded_backward_gives_the_weighted_sums_gradients() {
        let w =
            Tensor::linspace(-1.0, 2.0, 12, (Kind::Float, Device::Cpu)).view([3, 4]).set_requires_grad(true);
        let unused = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::linspace(0.5, 1.5, 8, (Kind::Float, Device::Cpu)).view([2, 4]);
        let roots = || (x.matmul(&w.tr()), x.matmul(&w.tr()).sin().to_kind(Kind::BFloat16));
        let (ga, gb) = (
            Tensor::linspace(-2.0, 1.0, 6, (Kind::Float, Device::Cpu)).view([2, 3]),
            Tensor::linspace(3.0, -1.0, 6, (Kind::Float, Device::Cpu)).view([2, 3]),
        );
        let (a, b) = roots();
        let got = backward(&[&a, &b], &[&ga, &gb], &[w.shallow_clone(), unused.shallow_clone()]).unwrap();
        let (a, b) = roots();
        let sum = (&a * &ga).sum(Kind::Float)
            + (b.to_kind(Kind::Float) * gb.to_kind(Kind::BFloat16).to_kind(Kind::Float)).sum(Kind::Float);
        let want = Tensor::run_backward(&[&sum], &[&w], false, false);
        assert!(got[0].allclose(&want[0], 1e-6, 1e-6, false), "{:?} vs {:?}", got[0], want[0]);
        assert!(!got[1].defined(), "an input the graph does not reach");
        let err = backward(&[&x], &[&x.ones_like()], &[w.shallow_clone()]).unwrap_err().to_string();
        assert!(err.contains("root 0 is not part of a graph"), "{err}");
        let (a, _) = roots();
        let err = backward(&[&a], &[&ga.tr()], &[w.shallow_clone()]).unwrap_err().to_string();
        assert!(err.contains("must have its shape"), "{err}");
    }

    #[test]
    fn without_a_gpu_stats_are_unavailable_not_an_abort() {
        if accelerator_available() {
            eprintln!("skipped: a CUDA device is present (this test covers the no-GPU path)");
            return;
        }
        assert_eq!(device_stats(0), Err(ShimError::Unavailable));
        assert_eq!(empty_cache(), Err(ShimError::Unavailable));
        assert_eq!(reset_peak_stats(0), Err(ShimError::Unavailable));
        assert_eq!(set_current_device(0), Err(ShimError::Unavailable));
    }

    #[test]
    fn without_a_gpu_the_allocator_history_is_unavailable() {
        if accelerator_available() {
            eprintln!("skipped: a CUDA device is present (tests/it/gpu.rs covers the recorder)");
            return;
        }
        assert_eq!(record_memory_history(true, 1000), Err(ShimError::Unavailable));
        assert_eq!(memory_snapshot_pickled(), Err(ShimError::Unavailable));
    }

    #[test]
    fn versions_name_the_pinned_libtorch() {
        let v = versions().unwrap();
        assert_eq!((v.torch_major, v.torch_minor, v.torch_patch), (2, 11, 0));
        assert!(v.intra_op_threads >= 1);
        assert_eq!(v.cuda_available == 1, tch::Cuda::is_available());
    }

    #[test]
    fn allocator_settings_are_parsed_and_bad_keys_come_back_as_errors() {
        set_allocator_settings("expandable_segments:False").unwrap();
        let err = set_allocator_settings("no_such_key:1").unwrap_err();
        assert!(matches!(&err, ShimError::Torch(m) if m.contains("no_such_key")), "{err:?}");
    }
}
