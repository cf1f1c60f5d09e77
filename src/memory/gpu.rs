//! NVIDIA devices through NVML (`nvml-wrapper`, which loads libnvidia-ml at run time, so this
//! builds and runs on machines without a GPU). Every reading is optional: when NVML is missing
//! or a query fails the caller gets `None` and a reason, never an error that stops a run.
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::Nvml;
use serde::Serialize;

pub struct Gpus {
    nvml: Nvml,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GpuReading {
    pub gpu_memory_used_bytes: Option<u64>,
    pub gpu_memory_total_bytes: Option<u64>,
    pub gpu_utilization_pct: Option<u32>,
    pub gpu_temperature_c: Option<u32>,
    pub gpu_power_w: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
}

impl Gpus {
    /// NVML, or why not (no driver, no library).
    pub fn open() -> Result<Self, String> {
        Nvml::init().map(|nvml| Self { nvml }).map_err(|e| format!("NVML unavailable: {e}"))
    }

    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    pub fn list(&self) -> Vec<GpuInfo> {
        let n = self.nvml.device_count().unwrap_or(0);
        (0..n)
            .filter_map(|i| {
                let d = self.nvml.device_by_index(i).ok()?;
                let mem = d.memory_info().ok()?;
                Some(GpuInfo { index: i, name: d.name().unwrap_or_default(), memory_total_bytes: mem.total, memory_free_bytes: mem.free })
            })
            .collect()
    }

    /// One reading of device `index` (NVML's numbering, which follows CUDA's unless
    /// CUDA_VISIBLE_DEVICES reorders devices). `Err` when the device cannot be opened.
    pub fn read(&self, index: u32) -> Result<GpuReading, String> {
        let d = self.nvml.device_by_index(index).map_err(|e| format!("NVML device {index}: {e}"))?;
        let mem = d.memory_info().ok();
        Ok(GpuReading {
            gpu_memory_used_bytes: mem.as_ref().map(|m| m.used),
            gpu_memory_total_bytes: mem.as_ref().map(|m| m.total),
            gpu_utilization_pct: d.utilization_rates().ok().map(|u| u.gpu),
            gpu_temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            gpu_power_w: d.power_usage().ok().map(|mw| mw as f64 / 1000.0),
        })
    }
}
