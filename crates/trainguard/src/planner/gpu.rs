//! The GPU a plan is for: `--gpu auto` (the first card NVML reports: name, total and free
//! memory), a preset name, or `--gpu-memory SIZE`. NVML is loaded at run time by
//! `nvml-wrapper`, so machines without an NVIDIA driver build and run; there `--gpu auto` is an
//! error unless `--gpu-memory` is given to fall back on.
use super::presets;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuTarget {
    pub name: String,
    /// Memory a run may count on, per GPU: the preset's or `--gpu-memory`; with `--gpu auto`,
    /// what is free now (other processes' memory is not ours to use).
    pub capacity_bytes: u64,
    /// NVML's total and free (auto only).
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// `preset`, `nvml` or `--gpu-memory`.
    pub source: String,
    /// A line to show the user (a fallback taken).
    pub note: Option<String>,
}

/// A card as NVML reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct DetectedGpu {
    pub name: String,
    pub total: u64,
    pub free: u64,
    pub count: u32,
}

/// The first GPU CUDA sees (`cuda:0`, after `CUDA_VISIBLE_DEVICES`) through NVML (the reader
/// telemetry uses), or why there is none.
pub fn detect() -> Result<DetectedGpu, String> {
    let gpus = crate::memory::gpu::Gpus::open().map_err(|e| format!("no NVIDIA GPU found: {e}"))?;
    let list = gpus.cuda_visible();
    let first = list.first().ok_or("NVML reports no NVIDIA GPU that CUDA_VISIBLE_DEVICES leaves visible")?;
    Ok(DetectedGpu {
        name: first.name.clone(),
        total: first.memory_total_bytes,
        free: first.memory_free_bytes,
        count: list.len() as u32,
    })
}

/// Resolves `--gpu` / `--gpu-memory` (already parsed to bytes). `detect` is injected so the
/// rules are tested without a GPU. `Ok(None)`: no target given.
pub fn resolve(
    gpu: Option<&str>,
    gpu_memory: Option<u64>,
    detect: impl FnOnce() -> Result<DetectedGpu, String>,
) -> Result<Option<GpuTarget>, String> {
    let custom = |name: String, note: Option<String>| GpuTarget {
        name,
        capacity_bytes: gpu_memory.unwrap_or_default(),
        total_bytes: None,
        free_bytes: None,
        source: "--gpu-memory".into(),
        note,
    };
    match gpu.map(str::trim) {
        None => Ok(gpu_memory.map(|_| custom("custom".into(), None))),
        Some(name) if name.eq_ignore_ascii_case("auto") => match detect() {
            Ok(d) => Ok(Some(GpuTarget {
                name: d.name,
                capacity_bytes: gpu_memory.unwrap_or(d.free),
                total_bytes: Some(d.total),
                free_bytes: Some(d.free),
                source: if gpu_memory.is_some() { "--gpu-memory".into() } else { "nvml".into() },
                note: (d.count > 1).then(|| {
                    format!("{} GPUs visible; planning for GPU 0 (use --gpus N for data parallel)", d.count)
                }),
            })),
            Err(why) => match gpu_memory {
                Some(_) => Ok(Some(custom(
                    "custom".into(),
                    Some(format!("--gpu auto: {why}; using --gpu-memory instead")),
                ))),
                None => Err(format!(
                    "--gpu auto: {why}. Name a GPU (--gpu a100-80; known: {}) or give --gpu-memory 24GiB",
                    presets::known_names()
                )),
            },
        },
        Some(name) => {
            if let Some(v) = presets::variants(name) {
                return Err(format!(
                    "--gpu: `{name}` comes in {}: name the one you have (or give --gpu-memory)",
                    v.join(" and ")
                ));
            }
            let p = presets::find(name).ok_or_else(|| {
                format!(
                    "--gpu: unknown GPU `{name}`; known: auto, {} (or give --gpu-memory 24GiB)",
                    presets::known_names()
                )
            })?;
            Ok(Some(match gpu_memory {
                Some(_) => custom(
                    p.name.into(),
                    Some(format!("--gpu-memory overrides the {} preset's {} MiB", p.name, p.mib)),
                ),
                None => GpuTarget {
                    name: p.name.into(),
                    capacity_bytes: p.bytes(),
                    total_bytes: None,
                    free_bytes: None,
                    source: "preset".into(),
                    note: None,
                },
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> Result<DetectedGpu, String> {
        Err("no NVIDIA GPU found".into())
    }

    #[test]
    fn presets_memory_and_auto_resolve() {
        let t = resolve(Some("a100-40"), None, none).unwrap().unwrap();
        assert_eq!(
            (t.name.as_str(), t.capacity_bytes, t.source.as_str()),
            ("a100-40", 40_960 << 20, "preset")
        );
        let t = resolve(None, Some(24 << 30), none).unwrap().unwrap();
        assert_eq!((t.capacity_bytes, t.source.as_str()), (24 << 30, "--gpu-memory"));
        let t = resolve(Some("h100"), Some(16 << 30), none).unwrap().unwrap();
        assert_eq!(t.capacity_bytes, 16 << 30, "--gpu-memory rehearses a smaller card");
        assert!(resolve(None, None, none).unwrap().is_none());
        let card = || {
            Ok(DetectedGpu {
                name: "NVIDIA H100 80GB HBM3".into(),
                total: 85 << 30,
                free: 80 << 30,
                count: 2,
            })
        };
        let t = resolve(Some("auto"), None, card).unwrap().unwrap();
        assert_eq!((t.capacity_bytes, t.total_bytes, t.source.as_str()), (80 << 30, Some(85 << 30), "nvml"));
        assert!(t.note.unwrap().contains("2 GPUs"));
    }

    #[test]
    fn auto_without_nvml_is_an_error_unless_memory_is_given() {
        let err = resolve(Some("auto"), None, none).unwrap_err();
        assert!(
            err.contains("--gpu auto") && err.contains("no NVIDIA GPU") && err.contains("--gpu-memory"),
            "{err}"
        );
        let t = resolve(Some("auto"), Some(12 << 30), none).unwrap().unwrap();
        assert_eq!(t.capacity_bytes, 12 << 30);
        assert!(t.note.unwrap().contains("using --gpu-memory"));
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = resolve(Some("rtx9090"), None, none).unwrap_err();
        assert!(err.contains("unknown GPU `rtx9090`"), "{err}");
        for name in ["t4", "a100-80", "h200", "auto"] {
            assert!(err.contains(name), "{name} not listed: {err}");
        }
    }
}
