//! `memory.limit`: make the real allocator fail at a chosen size, to rehearse a smaller device
//! and to test the OOM guard.
//!
//! - CUDA: the caching allocator's per-process memory fraction (`limit / device total`), set
//!   through the allocator settings before the first CUDA allocation. Counts what the caching
//!   allocator reserves on that device (not the CUDA context).
//! - CPU: an address-space limit (`RLIMIT_AS`) of *what the process maps after this point*:
//!   the limit is set to the current mapped size plus `limit`, so the libraries and thread
//!   pools already mapped do not count; weights, optimizer state, activations and batches do.
//!   Large blocks are forced onto `mmap` (fixed threshold, one malloc arena) so that freed
//!   memory goes back at once and the cap is reproducible. libtorch's CPU allocator then fails
//!   with "DefaultCPUAllocator: can't allocate memory", which the guard catches. (fp32 on the
//!   CPU runs without oneDNN, whose JIT code maps the cap would also refuse: `step::precision`.)
use super::ProcessMemory;
use crate::ffi;
use tch::Device;

#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error("memory.limit: cannot read this process's memory size from /proc/self/status")]
    NoProcStatus,
    #[error("memory.limit: setrlimit(RLIMIT_AS) failed: {0}")]
    Rlimit(std::io::Error),
    #[error("memory.limit: {0}")]
    Cuda(String),
    #[error("memory.limit: cannot turn libtorch's error stack traces off: {0}")]
    Backtraces(String),
}

/// What was applied, for the log.
#[derive(Debug, Clone, Copy)]
pub struct LimitReport {
    pub limit_bytes: u64,
    /// CPU: mapped bytes at the moment the cap was set (the cap is on top of this).
    pub baseline_bytes: u64,
    /// CUDA: the fraction of the device applied.
    pub fraction: Option<f64>,
}

pub fn apply_limit(limit_bytes: u64, device: Device) -> Result<LimitReport, LimitError> {
    match device {
        Device::Cuda(i) => apply_cuda(limit_bytes, i),
        _ => apply_cpu(limit_bytes),
    }
}

/// The share of CUDA device `device` that `limit_bytes` is. Applied together with the other
/// allocator settings (`allocator::configure`), before the first CUDA allocation.
pub fn cuda_fraction(limit_bytes: u64, device: usize) -> Result<f64, LimitError> {
    let total = ffi::memory_info(device).map_err(|e| LimitError::Cuda(e.to_string()))?.1;
    Ok((limit_bytes as f64 / total as f64).min(1.0))
}

fn apply_cuda(limit_bytes: u64, device: usize) -> Result<LimitReport, LimitError> {
    // The fraction itself went in with the allocator settings; this only reports it.
    let fraction = cuda_fraction(limit_bytes, device)?;
    Ok(LimitReport { limit_bytes, baseline_bytes: 0, fraction: Some(fraction) })
}

/// Runs `f` with the CPU cap lifted, then puts it back: for checkpoint writes, whose buffers
/// Rust allocates (`write_safetensors` copies each tensor), and a failed Rust allocation aborts
/// the process instead of returning an error: a run out of memory at the cap died (exit 134)
/// with no checkpoint. The cap rehearses a device's budget for training, not for writing files.
pub fn uncapped<T>(f: impl FnOnce() -> T) -> T {
    let capped = ffi::os::address_space_limit().filter(|&b| b != libc::RLIM_INFINITY);
    if capped.is_some() {
        let _ = ffi::os::limit_address_space(libc::RLIM_INFINITY);
    }
    let out = f();
    if let Some(bytes) = capped {
        let _ = ffi::os::limit_address_space(bytes);
    }
    out
}

/// Puts the CPU cap at `baseline_bytes + limit_bytes`, once memory the cap's baseline counted
/// has been given back (a checkpoint read before the cap went on, whose tensors are in the model
/// now): the cap then counts what training holds, as in a fresh run, instead of leaving the
/// checkpoint's size as extra room. Nothing to do without a CPU cap.
pub fn rebase_cpu_limit(baseline_bytes: u64, limit_bytes: u64) -> Result<(), LimitError> {
    if ffi::os::address_space_limit().is_none_or(|b| b == libc::RLIM_INFINITY) {
        return Ok(());
    }
    ffi::os::limit_address_space(baseline_bytes.saturating_add(limit_bytes)).map_err(LimitError::Rlimit)
}

/// Allocator settings a CPU cap needs, to be made before the process starts any thread of its
/// own: a thread's first allocation otherwise reserves a 64 MiB malloc arena, and one that
/// happens after the cap is set would count against it at random.
pub fn prepare_cpu_limit() {
    ffi::os::malloc_for_exact_accounting();
}

/// A matrix product of each transposition a linear layer uses (NN, NT, TN: a transposed view
/// reaches BLAS as a flag), on the intra-op threads.
fn warm_up_blas() {
    let products = || -> Result<(), tch::TchError> {
        let a = tch::Tensor::f_ones([512, 512], (tch::Kind::Float, Device::Cpu))?;
        for (x, y) in [
            (a.shallow_clone(), a.shallow_clone()),
            (a.shallow_clone(), a.f_transpose(0, 1)?),
            (a.f_transpose(0, 1)?, a.shallow_clone()),
        ] {
            let _ = x.f_matmul(&y)?.f_sum(tch::Kind::Float)?;
        }
        Ok(())
    };
    let _ = products();
}

/// Sets the CPU cap. libtorch's errors lose their C++ stack trace first: reading one symbolises
/// it, which allocates, and at the edge of the cap that failed and turned the allocator's
/// message into "<Error computing Error::what()>" — no longer recognisable as an OOM (seen on
/// CI, tests/it/oom.rs, about one cap in 30 between the peaks of micro-batch 16 and 32).
fn apply_cpu(limit_bytes: u64) -> Result<LimitReport, LimitError> {
    prepare_cpu_limit();
    ffi::errors_without_stack_traces().map_err(|e| LimitError::Backtraces(e.to_string()))?;
    // Start the intra-op thread pool first so its stacks count as baseline, not as training;
    // and BLAS's packing buffers, which MKL's AVX-512 sgemm allocates on each thread at its
    // first products and keeps (about 26 MiB on 2 threads: a 32 MiB cap then left room for
    // micro-batch 1 only). One product of each transposition a linear layer's forward and
    // backward use, large enough that every thread takes part.
    warm_up_blas();
    let baseline = ProcessMemory::read().ok_or(LimitError::NoProcStatus)?.vm_bytes;
    ffi::os::limit_address_space(baseline.saturating_add(limit_bytes)).map_err(LimitError::Rlimit)?;
    Ok(LimitReport { limit_bytes, baseline_bytes: baseline, fraction: None })
}
