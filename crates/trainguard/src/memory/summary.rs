//! A memory summary table in the spirit of `torch.cuda.memory_summary`, printed when a run
//! ends and when it runs out of memory.
use super::{human, ProcessMemory};
use crate::ffi;
use tch::Device;

pub fn table(device: Device) -> String {
    match device {
        Device::Cuda(i) => match ffi::device_stats(i) {
            Ok(s) => {
                let row = |name: &str, cur: &[i64; 3], peak: &[i64; 3]| {
                    format!(
                        "| {name:<16} | {:>12} | {:>12} | {:>12} | {:>12} |\n",
                        human(cur[0].max(0) as u64),
                        human(peak[0].max(0) as u64),
                        human(cur[2].max(0) as u64),
                        human(cur[1].max(0) as u64)
                    )
                };
                let mut t = format!("memory summary, cuda:{i}\n| {:<16} | {:>12} | {:>12} | {:>12} | {:>12} |\n", "", "current", "peak", "large pool", "small pool");
                t += &row("allocated", &s.allocated_current, &s.allocated_peak);
                t += &row("reserved", &s.reserved_current, &s.reserved_peak);
                t += &format!(
                    "| {:<16} | {:>12} | {:>12} |\n| {:<16} | {:>12} |\n| {:<16} | {:>12} |\n| {:<16} | {:>12} |",
                    "active",
                    human(s.active_current.max(0) as u64),
                    human(s.active_peak.max(0) as u64),
                    "inactive split",
                    human(s.inactive_split_current.max(0) as u64),
                    "alloc retries",
                    s.num_alloc_retries,
                    "OOMs",
                    s.num_ooms
                );
                t
            }
            Err(e) => format!("memory summary unavailable: {e}"),
        },
        _ => match ProcessMemory::read() {
            Some(p) => format!(
                "memory summary, cpu (process)\n| {:<10} | {:>12} | {:>12} |\n| {:<10} | {:>12} | {:>12} |\n| {:<10} | {:>12} | {:>12} |",
                "",
                "current",
                "peak",
                "resident",
                human(p.rss_bytes),
                human(p.rss_peak_bytes),
                "mapped",
                human(p.vm_bytes),
                human(p.vm_peak_bytes)
            ),
            None => "memory summary unavailable: /proc/self/status unreadable".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_table_has_resident_and_mapped_rows() {
        let t = table(Device::Cpu);
        assert!(t.contains("| resident") && t.contains("| mapped"), "{t}");
    }
}
