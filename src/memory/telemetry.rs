//! Per-step memory figures for the metrics line: the CUDA caching allocator's allocated /
//! reserved bytes and their peaks since the previous step (peaks are reset after each read, and
//! by the guard after a failed attempt: a recovered step shows the peaks of the attempt that worked),
//! allocation retries since the previous step, the process's resident size, and NVML's view of
//! the GPU. What cannot be read is `null`, with one warning for the run.
use super::gpu::{GpuReading, Gpus};
use super::ProcessMemory;
use crate::ffi;
use serde::Serialize;
use tch::Device;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MemoryMetrics {
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    /// cudaMalloc retries (cache flushed to satisfy a request) since the previous line.
    pub alloc_retries: Option<i64>,
    /// The process's resident set: on CPU the memory figure that matters.
    pub rss_bytes: Option<u64>,
    #[serde(flatten)]
    pub gpu: GpuReading,
}

pub struct Telemetry {
    device: Device,
    gpus: Option<Gpus>,
    last_retries: Option<i64>,
    pub total_retries: i64,
}

impl Telemetry {
    /// On CUDA devices NVML is opened here; if it cannot be, one warning and GPU fields null.
    pub fn new(device: Device) -> Self {
        let gpus = match device {
            Device::Cuda(_) => Gpus::open().map_err(|why| tracing::warn!("{why}; GPU utilisation, temperature and power will be null")).ok(),
            _ => None,
        };
        if let Device::Cuda(i) = device {
            let _ = ffi::reset_peak_stats(i);
        }
        Self { device, gpus, last_retries: None, total_retries: 0 }
    }

    pub fn sample(&mut self) -> MemoryMetrics {
        let mut m = MemoryMetrics { rss_bytes: ProcessMemory::read().map(|p| p.rss_bytes), ..Default::default() };
        if let Device::Cuda(i) = self.device {
            if let Ok(s) = ffi::device_stats(i) {
                let u = |v: i64| Some(v.max(0) as u64);
                m.allocated_bytes = u(s.allocated_current[0]);
                m.reserved_bytes = u(s.reserved_current[0]);
                m.peak_allocated_bytes = u(s.allocated_peak[0]);
                m.peak_reserved_bytes = u(s.reserved_peak[0]);
                m.alloc_retries = Some(s.num_alloc_retries - self.last_retries.unwrap_or(s.num_alloc_retries));
                self.last_retries = Some(s.num_alloc_retries);
                self.total_retries = s.num_alloc_retries;
                let _ = ffi::reset_peak_stats(i);
            }
            if let Some(g) = &self.gpus {
                match g.read(i) {
                    Ok(r) => m.gpu = r,
                    Err(why) => {
                        tracing::warn!("{why}; GPU fields will be null");
                        self.gpus = None;
                    }
                }
            }
        }
        m
    }

    /// The figure the leak detector watches: allocated bytes on CUDA, resident size on CPU.
    pub fn leak_figure(m: &MemoryMetrics) -> Option<u64> {
        m.allocated_bytes.or(m.rss_bytes)
    }
}
