//! `trainguard env`: what a user pastes into a bug report — trainguard and libtorch versions,
//! CUDA and cuDNN, every GPU NVML sees, and the allocator settings a run would use and where
//! they come from.
use crate::config::Config;
use crate::ffi;
use crate::memory::allocator::effective;
use crate::memory::gpu::Gpus;
use crate::memory::human;
use std::fmt::Write;

fn version(v: i64, parts: &[i64]) -> String {
    if v < 0 {
        return "unknown".into();
    }
    let (mut rest, mut out) = (v, Vec::new());
    for &p in parts {
        out.push((rest / p).to_string());
        rest %= p;
    }
    out.push(rest.to_string());
    out.join(".")
}

/// The report; `config` supplies the allocator settings a run of it would use.
pub fn report(config: &Config) -> String {
    // What a CUDA run would hand libtorch, handed over as a run does before CUDA starts: the
    // keys and values libtorch refuses (from the environment too) are found here, not at the run.
    // Read first: handing them over sets PYTORCH_CUDA_ALLOC_CONF to the merged settings.
    let (from_env, eff) =
        (crate::memory::allocator::env_source(), effective(&config.memory.allocator, None, true));
    let refused = crate::memory::allocator::configure(&config.memory.allocator, None, true).err();
    let mut r = String::new();
    let _ = writeln!(r, "[trainguard]\nversion: {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(r, "\n[libtorch]");
    match ffi::versions() {
        Ok(v) => {
            let _ = writeln!(r, "version: {}.{}.{}", v.torch_major, v.torch_minor, v.torch_patch);
            let _ = writeln!(r, "intra-op threads: {}", v.intra_op_threads);
            let _ = writeln!(r, "\n[cuda]");
            let _ = writeln!(r, "available: {}", if v.cuda_available == 1 { "yes" } else { "no" });
            let _ = writeln!(r, "devices: {}", v.cuda_devices);
            // cudaRuntimeGetVersion: 1000·major + 10·minor.
            let _ = writeln!(
                r,
                "cuda runtime: {}",
                if v.cudart_version < 0 {
                    "unknown".into()
                } else {
                    format!("{}.{}", v.cudart_version / 1000, (v.cudart_version % 1000) / 10)
                }
            );
            let _ = writeln!(
                r,
                "cudnn: {}",
                if v.cudnn_available == 1 {
                    version(v.cudnn_version, &[10000, 100])
                } else {
                    "not available".into()
                }
            );
        }
        Err(e) => {
            let _ = writeln!(r, "unavailable: {e}");
        }
    }
    // What `kernels.cuda_optimizers` compiles with.
    let _ = match ffi::kernels::nvrtc_info() {
        Ok((major, minor, path)) => writeln!(r, "nvrtc: {major}.{minor} ({path})"),
        Err(e) => writeln!(r, "nvrtc: unavailable ({e}); kernels.cuda_optimizers cannot be used"),
    };
    let _ = writeln!(
        r,
        "c10d backends: gloo{}",
        if ffi::dist::nccl_built() {
            ", nccl"
        } else {
            " (nccl not built: CUDA headers missing at build time)"
        }
    );
    let _ = writeln!(r, "\n[gpus]");
    match Gpus::open() {
        Ok(g) => {
            let _ = writeln!(r, "driver: {}", g.driver_version().unwrap_or_else(|| "unknown".into()));
            let list = g.list();
            if list.is_empty() {
                let _ = writeln!(r, "none");
            }
            for d in list {
                let _ = writeln!(
                    r,
                    "{}: {} ({} total, {} free)",
                    d.index,
                    d.name,
                    human(d.memory_total_bytes),
                    human(d.memory_free_bytes)
                );
            }
        }
        Err(why) => {
            let _ = writeln!(r, "{why}");
        }
    }
    let _ = writeln!(r, "\n[allocator]");
    let _ = match from_env {
        Some((name, value)) => writeln!(r, "{name} in the environment: {value}"),
        None => writeln!(r, "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF in the environment: (unset)"),
    };
    // What a CUDA run would use (trainguard's defaults apply only to CUDA runs).
    let shown = if eff.conf.is_empty() { "(libtorch defaults)".to_string() } else { eff.conf.clone() };
    let _ = writeln!(r, "effective (CUDA runs; a CPU run does not use them): {shown}");
    let _ = writeln!(
        r,
        "source: {} (memory.allocator of the config given with --config/--set, else defaults)",
        eff.source
    );
    // What a run with this config would refuse or warn of, said here too: this is the command
    // that diagnoses the settings.
    if let Some(e) = refused {
        let _ = writeln!(r, "refused (a run with this config exits 2): {e}");
    }
    for w in eff.warnings(config.memory.limit.is_some()) {
        let _ = writeln!(r, "warning: {w}");
    }
    for o in eff.overridden {
        let _ = writeln!(r, "overridden by the config: {o}");
    }
    for d in eff.defaulted {
        let _ = writeln!(r, "trainguard default on CUDA: {d} (set memory.allocator.expandable_segments: false to turn it off)");
    }
    r
}
