//! NVIDIA devices through NVML (`nvml-wrapper`, which loads libnvidia-ml at run time, so this
//! builds and runs on machines without a GPU). Every reading is optional: when NVML is missing
//! or a query fails the caller gets `None` and a reason, never an error that stops a run.
//!
//! CUDA and NVML number devices differently: CUDA sees only what `CUDA_VISIBLE_DEVICES` lists,
//! in its order, by index or UUID (SLURM and container runtimes set it); NVML numbers every GPU
//! on the machine. [`cuda_to_nvml`] maps one to the other, so a run on `cuda:0` under
//! `CUDA_VISIBLE_DEVICES=3` reads GPU 3's utilisation, not GPU 0's.
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::{Device, Nvml};
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
        (0..n).filter_map(|i| info(&self.nvml.device_by_index(i).ok()?, i)).collect()
    }

    /// The NVML device behind CUDA's device `cuda_index` in this process.
    fn for_cuda(&self, cuda_index: usize) -> Result<Device<'_>, String> {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let at = |what: &str, e: nvml_wrapper::error::NvmlError| {
            format!("NVML device {what} (CUDA device {cuda_index}): {e}")
        };
        match cuda_to_nvml(cuda_index, visible.as_deref())? {
            NvmlDevice::Index(i) => self.nvml.device_by_index(i).map_err(|e| at(&i.to_string(), e)),
            // CUDA accepts a unique prefix of a UUID; NVML wants it whole.
            NvmlDevice::Uuid(prefix) => self.nvml.device_by_uuid(prefix.as_str()).or_else(|e| {
                let n = self.nvml.device_count().unwrap_or(0);
                (0..n)
                    .filter_map(|i| self.nvml.device_by_index(i).ok())
                    .find(|d| d.uuid().is_ok_and(|u| u.starts_with(&prefix)))
                    .ok_or_else(|| at(&prefix, e))
            }),
        }
    }

    /// The GPUs this process' CUDA sees, in CUDA's order (all of them without
    /// `CUDA_VISIBLE_DEVICES`).
    pub fn cuda_visible(&self) -> Vec<GpuInfo> {
        (0..self.nvml.device_count().unwrap_or(0) as usize)
            .map_while(|i| {
                let d = self.for_cuda(i).ok()?;
                info(&d, d.index().unwrap_or(i as u32))
            })
            .collect()
    }

    /// One reading of CUDA's device `cuda_index`. `Err` when its NVML device cannot be opened.
    pub fn read(&self, cuda_index: usize) -> Result<GpuReading, String> {
        let d = self.for_cuda(cuda_index)?;
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

/// NVML device `index`'s name and memory; `None` when its memory cannot be read.
fn info(d: &Device, index: u32) -> Option<GpuInfo> {
    let mem = d.memory_info().ok()?;
    Some(GpuInfo {
        index,
        name: d.name().unwrap_or_default(),
        memory_total_bytes: mem.total,
        memory_free_bytes: mem.free,
    })
}

/// Where NVML finds a CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlDevice {
    Index(u32),
    /// A GPU or MIG UUID, or a unique prefix of one (`GPU-8932f937`).
    Uuid(String),
}

/// The NVML device that CUDA numbers `cuda_index`, given `CUDA_VISIBLE_DEVICES` (`visible`),
/// read by CUDA's rules as PyTorch models them (`torch.cuda._parse_visible_devices`): a list
/// that starts with a `GPU-` (or `MIG-`) UUID holds such UUIDs up to the first entry that is
/// not one; otherwise it holds indices, each read as C's `strtoul` does (`1gpu` is 1), up to
/// the first that is not one (`0,1,-1,2` is `0,1`); a repeated entry hides every device.
/// Indices are NVML's when CUDA orders by PCI bus (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, or GPUs
/// that are all alike, where CUDA's fastest-first order is the bus order).
pub fn cuda_to_nvml(cuda_index: usize, visible: Option<&str>) -> Result<NvmlDevice, String> {
    let Some(list) = visible else { return Ok(NvmlDevice::Index(cuda_index as u32)) };
    let hidden = || format!("CUDA_VISIBLE_DEVICES=`{list}` lists no CUDA device {cuda_index}");
    let entries = list.split(',').map(str::trim);
    let devices: Vec<NvmlDevice> =
        match ["GPU-", "MIG-"].into_iter().find(|p| list.trim_start().starts_with(p)) {
            Some(prefix) => entries
                .take_while(|e| e.starts_with(prefix))
                .map(|e| NvmlDevice::Uuid(e.to_string()))
                .collect(),
            None => entries.map_while(strtoul).map(NvmlDevice::Index).collect(),
        };
    let repeated = devices.iter().enumerate().any(|(i, d)| devices[..i].contains(d));
    if repeated {
        return Err(format!("{}: it names a device twice, which hides every device", hidden()));
    }
    devices.into_iter().nth(cuda_index).ok_or_else(hidden)
}

/// The leading digits of `s` as a number, as C's `strtoul` reads them; `None` without any (or
/// for a negative number).
fn strtoul(s: &str) -> Option<u32> {
    let s = s.strip_prefix('+').unwrap_or(s);
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..digits].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_devices_map_to_nvml_through_cuda_visible_devices() {
        use NvmlDevice::*;
        assert_eq!(cuda_to_nvml(1, None), Ok(Index(1)), "no variable: the same numbering");
        assert_eq!(cuda_to_nvml(0, Some("3")), Ok(Index(3)), "SLURM's one GPU per task");
        assert_eq!(cuda_to_nvml(1, Some("6, 2")), Ok(Index(2)), "the list's order, not NVML's");
        assert_eq!(cuda_to_nvml(0, Some("1gpu,+4")), Ok(Index(1)), "strtoul's reading");
        assert_eq!(cuda_to_nvml(1, Some("1gpu,+4")), Ok(Index(4)));
        assert!(
            cuda_to_nvml(2, Some("0,1,-1,2")).unwrap_err().contains("lists no CUDA device 2"),
            "the list ends at an invalid entry"
        );
        assert!(cuda_to_nvml(0, Some("")).is_err(), "an empty list hides every device");
        assert!(cuda_to_nvml(1, Some("4")).is_err());
        assert!(cuda_to_nvml(0, Some("2,3,2")).unwrap_err().contains("names a device twice"));
        assert_eq!(cuda_to_nvml(0, Some("GPU-8932f937,GPU-aa1")), Ok(Uuid("GPU-8932f937".into())));
        assert_eq!(cuda_to_nvml(1, Some("GPU-8932f937,GPU-aa1")), Ok(Uuid("GPU-aa1".into())));
        assert!(cuda_to_nvml(1, Some("GPU-8932f937,1")).is_err(), "a UUID list ends at an index");
        assert!(cuda_to_nvml(1, Some("0,GPU-8932f937")).is_err(), "an index list ends at a UUID");
        assert_eq!(cuda_to_nvml(0, Some("MIG-4b3c7a0e-1d2f")), Ok(Uuid("MIG-4b3c7a0e-1d2f".into())));
    }
}
