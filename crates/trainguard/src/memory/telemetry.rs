//! Per-step memory figures for the metrics line: the CUDA caching allocator's allocated /
//! reserved bytes and their peaks since the previous step (peaks are reset after each read, and
//! by the guard after a failed attempt: a recovered step shows the peaks of the attempt that worked),
//! allocation retries since the previous step, the process's resident size, and NVML's view of
//! the GPU, read at most once a second (between reads a line repeats the last). What cannot be
//! read is `null`, with one warning for the run.
use super::gpu::{GpuReading, Gpus};
use super::ProcessMemory;
use crate::ffi;
use serde::Serialize;
use std::time::{Duration, Instant};
use tch::Device;

/// How often NVML is asked. Its queries (memory, utilisation, temperature, power) cost the host
/// tenths of a millisecond each, and the step's end, where they run, is where the next step's
/// first launches wait; a fast run (tens of steps a second) would pay them every step.
const NVML_EVERY: Duration = Duration::from_secs(1);

/// Whether NVML is due again at `now`, its last reading taken at `last` (none yet: due).
fn nvml_due(last: Option<Instant>, now: Instant) -> bool {
    last.is_none_or(|t| now.saturating_duration_since(t) >= NVML_EVERY)
}

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
    /// NVML's last reading and when it was taken.
    gpu_read: Option<(Instant, GpuReading)>,
    last_retries: Option<i64>,
    pub total_retries: i64,
}

impl Telemetry {
    /// On CUDA devices NVML is opened here; if it cannot be, one warning and GPU fields null.
    pub fn new(device: Device) -> Self {
        let gpus = match device {
            Device::Cuda(_) => Gpus::open()
                .map_err(|why| tracing::warn!("{why}; GPU utilisation, temperature and power will be null"))
                .ok(),
            _ => None,
        };
        if let Device::Cuda(i) = device {
            let _ = ffi::reset_peak_stats(i);
        }
        Self { device, gpus, gpu_read: None, last_retries: None, total_retries: 0 }
    }

    pub fn sample(&mut self) -> MemoryMetrics {
        let mut m =
            MemoryMetrics { rss_bytes: ProcessMemory::read().map(|p| p.rss_bytes), ..Default::default() };
        if let Device::Cuda(i) = self.device {
            if let Ok(s) = ffi::device_stats(i) {
                let u = |v: i64| Some(v.max(0) as u64);
                m.allocated_bytes = u(s.allocated_current[0]);
                m.reserved_bytes = u(s.reserved_current[0]);
                m.peak_allocated_bytes = u(s.allocated_peak[0]);
                m.peak_reserved_bytes = u(s.reserved_peak[0]);
                m.alloc_retries =
                    Some(s.num_alloc_retries - self.last_retries.unwrap_or(s.num_alloc_retries));
                self.last_retries = Some(s.num_alloc_retries);
                self.total_retries = s.num_alloc_retries;
                let _ = ffi::reset_peak_stats(i);
            }
            let now = Instant::now();
            if let Some(g) =
                self.gpus.as_ref().filter(|_| nvml_due(self.gpu_read.as_ref().map(|(t, _)| *t), now))
            {
                match g.read(i) {
                    Ok(r) => self.gpu_read = Some((now, r)),
                    Err(why) => {
                        tracing::warn!("{why}; GPU fields will be null");
                        (self.gpus, self.gpu_read) = (None, None);
                    }
                }
            }
            m.gpu = self.gpu_read.as_ref().map(|(_, r)| r.clone()).unwrap_or_default();
        }
        m
    }

    /// The figure the leak detector watches: allocated bytes on CUDA, resident size on CPU.
    pub fn leak_figure(m: &MemoryMetrics) -> Option<u64> {
        m.allocated_bytes.or(m.rss_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_is_read_first_then_at_most_once_a_second() {
        let t0 = Instant::now();
        assert!(nvml_due(None, t0), "the first line reads NVML");
        assert!(!nvml_due(Some(t0), t0 + Duration::from_millis(999)));
        assert!(nvml_due(Some(t0), t0 + NVML_EVERY));
        assert!(nvml_due(Some(t0), t0 + Duration::from_secs(5)));
    }
}
