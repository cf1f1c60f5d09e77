//! Applying `memory.allocator` (and the CUDA memory cap) to libtorch's caching allocator,
//! merged with a `PYTORCH_CUDA_ALLOC_CONF` already in the environment.
//!
//! Merge rule: start from the environment's string (`PYTORCH_CUDA_ALLOC_CONF`, else
//! `PYTORCH_ALLOC_CONF`, as PyTorch 2.11 reads them); a key also set in the config takes the
//! config's value (the config is what the run directory and checkpoints record), and
//! `memory.limit` on CUDA sets `per_process_memory_fraction`. The effective string is written
//! back to `PYTORCH_CUDA_ALLOC_CONF` and handed to the allocator before its first allocation.
use crate::config::allocator::AllocatorConfig;
use crate::ffi;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EffectiveSettings {
    /// What the allocator was given, `key:value,…`.
    pub conf: String,
    /// `none`, `environment`, `config` or `environment+config`.
    pub source: String,
    /// Environment keys the config replaced.
    pub overridden: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("memory.allocator: libtorch refused the settings `{conf}`: {message}")]
pub struct AllocatorError {
    pub conf: String,
    pub message: String,
}

fn split_pairs(conf: &str) -> Vec<(String, String)> {
    // Commas inside `[…]` (roundup intervals) do not separate pairs.
    let (mut out, mut depth, mut cur) = (Vec::new(), 0i32, String::new());
    for c in conf.chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| match p.split_once(':') {
            Some((k, v)) => (k.trim().to_string(), v.trim().to_string()),
            None => (p.trim().to_string(), String::new()),
        })
        .collect()
}

/// The merge rule above, pure.
pub fn merge(env: Option<&str>, config: &[(String, String)], fraction: Option<f64>) -> EffectiveSettings {
    let mut pairs = env.map(split_pairs).unwrap_or_default();
    let from_env = !pairs.is_empty();
    let mut overridden = Vec::new();
    let mut own = config.to_vec();
    if let Some(f) = fraction {
        own.push(("per_process_memory_fraction".into(), format!("{f:.6}")));
    }
    for (k, v) in &own {
        match pairs.iter_mut().find(|(ek, _)| ek == k) {
            Some(slot) => {
                if slot.1 != *v {
                    overridden.push(format!("{k}: environment {}, config {v}", slot.1));
                }
                slot.1 = v.clone();
            }
            None => pairs.push((k.clone(), v.clone())),
        }
    }
    let source = match (from_env, !own.is_empty()) {
        (false, false) => "none",
        (true, false) => "environment",
        (false, true) => "config",
        (true, true) => "environment+config",
    };
    let conf = pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(",");
    EffectiveSettings { conf, source: source.into(), overridden }
}

pub fn env_conf() -> Option<String> {
    std::env::var("PYTORCH_CUDA_ALLOC_CONF").ok().or_else(|| std::env::var("PYTORCH_ALLOC_CONF").ok()).filter(|s| !s.trim().is_empty())
}

/// Merges and applies; must run before the first CUDA allocation (and before other threads
/// read the environment: call it early in `main`).
pub fn configure(alloc: &AllocatorConfig, fraction: Option<f64>) -> Result<EffectiveSettings, AllocatorError> {
    let eff = merge(env_conf().as_deref(), &alloc.pairs(), fraction);
    if eff.source == "none" {
        return Ok(eff);
    }
    // libtorch parses the variable itself when the CUDA allocator starts: keep the two equal.
    std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", &eff.conf);
    ffi::set_allocator_settings(&eff.conf).map_err(|e| AllocatorError { conf: eff.conf.clone(), message: e.to_string() })?;
    Ok(eff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(k: &str, v: &str) -> (String, String) {
        (k.into(), v.into())
    }

    #[test]
    fn config_wins_over_the_environment_key_by_key() {
        let e = merge(Some("expandable_segments:True,max_split_size_mb:128"), &[p("max_split_size_mb", "256")], None);
        assert_eq!(e.conf, "expandable_segments:True,max_split_size_mb:256");
        assert_eq!(e.source, "environment+config");
        assert_eq!(e.overridden, ["max_split_size_mb: environment 128, config 256"]);
    }

    #[test]
    fn sources_and_the_memory_fraction() {
        assert_eq!(merge(None, &[], None).source, "none");
        assert_eq!(merge(Some("backend:native"), &[], None).conf, "backend:native");
        let e = merge(None, &[p("expandable_segments", "True")], Some(0.25));
        assert_eq!((e.conf.as_str(), e.source.as_str()), ("expandable_segments:True,per_process_memory_fraction:0.250000", "config"));
    }

    #[test]
    fn interval_lists_keep_their_commas() {
        let e = merge(Some("roundup_power2_divisions:[64:8,256:4,>:1],backend:native"), &[], None);
        assert_eq!(e.conf, "roundup_power2_divisions:[64:8,256:4,>:1],backend:native");
    }

    #[test]
    fn libtorch_parses_what_the_config_renders() {
        let alloc: AllocatorConfig = serde_yaml::from_str("{expandable_segments: true, roundup_power2_divisions: {'64': 8, '>': 1}, max_split_size_mb: 64}").unwrap();
        let eff = merge(None, &alloc.pairs(), None);
        ffi::set_allocator_settings(&eff.conf).unwrap();
        assert!(ffi::set_allocator_settings("max_split_size_mb:10").is_err(), "libtorch's own range check");
    }
}
