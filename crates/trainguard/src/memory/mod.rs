//! Memory as the runtime sees it: a snapshot of what the device's allocator holds (the CUDA
//! caching allocator through the shim; on CPU, the process's own figures), returning cached
//! blocks, the memory cap (`memory.limit`), allocator settings, per-step telemetry (with NVML),
//! leak and thrash detectors, the allocator snapshot on out-of-memory, and the summary table.
pub mod allocator;
pub mod detect;
pub mod gpu;
mod limit;
pub mod oom_snapshot;
mod process;
pub mod summary;
pub mod telemetry;

pub use limit::{apply_limit, prepare_cpu_limit, rebase_cpu_limit, uncapped, LimitError, LimitReport};
pub use process::ProcessMemory;

use crate::ffi;
use serde::Serialize;
use tch::Device;

/// Allocated / reserved bytes at one moment. On CUDA: the caching allocator's allocated and
/// reserved bytes. On CPU: resident set size and mapped address space of the process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemorySnapshot {
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
}

pub fn snapshot(device: Device) -> MemorySnapshot {
    match device {
        Device::Cuda(i) => match ffi::device_stats(i) {
            Ok(s) => MemorySnapshot {
                allocated_bytes: Some(s.allocated_current[0].max(0) as u64),
                reserved_bytes: Some(s.reserved_current[0].max(0) as u64),
            },
            Err(_) => MemorySnapshot::default(),
        },
        _ => {
            let p = ProcessMemory::read();
            MemorySnapshot { allocated_bytes: p.map(|p| p.rss_bytes), reserved_bytes: p.map(|p| p.vm_bytes) }
        }
    }
}

/// The CUDA memory fraction `limit` (`memory.limit`) is of `device`; none on CPU, where the cap
/// is an address-space limit instead.
pub fn limit_fraction(limit: Option<u64>, device: Device) -> Result<Option<f64>, LimitError> {
    match (limit, device) {
        (Some(l), Device::Cuda(i)) => limit::cuda_fraction(l, i).map(Some),
        _ => Ok(None),
    }
}

/// Returns cached, unused blocks to the device: the CUDA caching allocator's, or on CPU the free
/// top of glibc's heap (a failed attempt's blocks can land there when `mmap` was refused).
pub fn empty_cache(device: Device) {
    if device.is_cuda() {
        if let Err(e) = ffi::empty_cache() {
            tracing::warn!("could not empty the CUDA cache: {e}");
        }
    } else {
        ffi::os::release_free_heap();
    }
}

/// Starts the CUDA allocator's peak figures again from what is allocated now (nothing on CPU).
/// The guard calls it after a failed attempt: a recovered step's peaks are then those of the
/// attempt that worked, not the cap the failed one hit.
pub fn reset_peaks(device: Device) {
    if let Device::Cuda(i) = device {
        if let Err(e) = ffi::reset_peak_stats(i) {
            tracing::warn!("could not reset the CUDA allocator's peak figures: {e}");
        }
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `1.23 GiB` / `45.6 MiB`, for messages.
pub fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", gib(bytes))
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        // Below a MiB "0.0 MiB" would hide what was asked for.
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}
