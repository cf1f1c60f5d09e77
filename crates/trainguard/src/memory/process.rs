//! The process's own memory figures from `/proc/self/status` (Linux).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Mapped address space now (VmSize) and at its peak (VmPeak).
    pub vm_bytes: u64,
    pub vm_peak_bytes: u64,
    /// Resident set now (VmRSS) and at its peak (VmHWM).
    pub rss_bytes: u64,
    pub rss_peak_bytes: u64,
}

impl ProcessMemory {
    pub fn read() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/self/status").ok()?)
    }

    fn parse(status: &str) -> Option<Self> {
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            let kb: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kb * 1024)
        };
        Some(Self {
            vm_bytes: field("VmSize:")?,
            vm_peak_bytes: field("VmPeak:")?,
            rss_bytes: field("VmRSS:")?,
            rss_peak_bytes: field("VmHWM:")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_status() {
        let s = "Name:\tx\nVmPeak:\t  200 kB\nVmSize:\t  100 kB\nVmHWM:\t 50 kB\nVmRSS:\t 40 kB\n";
        let m = ProcessMemory::parse(s).unwrap();
        assert_eq!(
            (m.vm_bytes, m.vm_peak_bytes, m.rss_bytes, m.rss_peak_bytes),
            (102_400, 204_800, 40_960, 51_200)
        );
        assert!(ProcessMemory::read().is_some());
    }
}
