//! Applying `memory.allocator` (and the CUDA memory cap) to libtorch's caching allocator,
//! merged with a `PYTORCH_CUDA_ALLOC_CONF` already in the environment.
//!
//! Merge rule: start from the environment's string (`PYTORCH_CUDA_ALLOC_CONF`, else
//! `PYTORCH_ALLOC_CONF`, as PyTorch 2.11 reads them); a key also set in the config takes the
//! config's value (the config is what the run directory and checkpoints record), and
//! `memory.limit` on CUDA sets `per_process_memory_fraction`. The effective string is written
//! back to `PYTORCH_CUDA_ALLOC_CONF` and handed to the allocator before its first allocation.
//!
//! Default on CUDA: `expandable_segments:True` (reserved memory stays close to allocated instead
//! of ~30% above it; torchtitan defaults to it too) unless the environment or the config names
//! `expandable_segments`, picks the `cudaMallocAsync` backend (which ignores it), or sets
//! `max_split_size_mb` (known to make reserved memory grow with it, pytorch/pytorch#123548).
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
    /// The variable the environment's settings came from ([`env_source`]), if any.
    pub env_var: Option<&'static str>,
    /// Keys trainguard set because neither the environment nor the config did.
    pub defaulted: Vec<String>,
    /// Keys the config set (the memory fraction included): the others in `conf` are the
    /// environment's or trainguard's defaults. Only for naming a key's source in [`Self::warnings`].
    #[serde(skip)]
    pub from_config: Vec<String>,
}

impl EffectiveSettings {
    /// Combinations in the settings libtorch is handed that do nothing or are known to break,
    /// whichever source set them (a `PYTORCH_CUDA_ALLOC_CONF` alone included), each key named
    /// where it came from. `fraction_set`: a memory fraction will be in force (`memory.limit`)
    /// though `conf` does not show it yet (`trainguard env` knows no GPU's size).
    pub fn warnings(&self, fraction_set: bool) -> Vec<String> {
        let pairs = split_pairs(&self.conf);
        let value = |k: &str| pairs.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        let on = |k: &str| value(k).is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let env = self.env_var.unwrap_or("PYTORCH_CUDA_ALLOC_CONF");
        let name = |k: &str| {
            if self.from_config.iter().any(|c| c == k) {
                format!("{}.{k}", crate::config::allocator::KEY)
            } else {
                format!("{env}'s {k}")
            }
        };
        let mut w = Vec::new();
        if value("backend") == Some("cudaMallocAsync") {
            for k in [
                "max_split_size_mb",
                "roundup_power2_divisions",
                "garbage_collection_threshold",
                "expandable_segments",
            ] {
                if value(k).is_some() {
                    w.push(format!("{} is ignored by backend cudaMallocAsync", name(k)));
                }
            }
        }
        if value("garbage_collection_threshold").is_some()
            && !fraction_set
            && value("per_process_memory_fraction").is_none()
        {
            w.push(format!(
                "{} only acts under a memory fraction: set memory.limit",
                name("garbage_collection_threshold")
            ));
        }
        if on("expandable_segments") && value("max_split_size_mb").is_some() {
            w.push(format!(
                "{} with {}: known to misbehave in some PyTorch versions; pick one",
                name("expandable_segments"),
                name("max_split_size_mb")
            ));
        }
        if value("pinned_num_register_threads").is_some() && !on("pinned_use_cuda_host_register") {
            w.push(format!(
                "{} does nothing without pinned_use_cuda_host_register: true",
                name("pinned_num_register_threads")
            ));
        }
        w
    }
}

#[derive(Debug, thiserror::Error)]
#[error("memory.allocator: the settings `{conf}`: {message}")]
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

/// trainguard's defaults for a CUDA run, given what the environment (`env`) and the config set.
pub fn cuda_defaults(env: Option<&str>, config: &[(String, String)]) -> Vec<(String, String)> {
    let set: Vec<(String, String)> =
        env.map(split_pairs).unwrap_or_default().into_iter().chain(config.iter().cloned()).collect();
    let has = |k: &str| set.iter().any(|(key, _)| key == k);
    let async_backend = set.iter().any(|(k, v)| k == "backend" && v == "cudaMallocAsync");
    if has("expandable_segments") || has("max_split_size_mb") || async_backend {
        return Vec::new();
    }
    vec![("expandable_segments".into(), "True".into())]
}

/// The merge rule above, pure. `defaults` apply only to keys neither source names.
pub fn merge(
    env: Option<&str>,
    config: &[(String, String)],
    defaults: &[(String, String)],
    fraction: Option<f64>,
) -> EffectiveSettings {
    let mut pairs = env.map(split_pairs).unwrap_or_default();
    let from_env = !pairs.is_empty();
    let mut defaulted = Vec::new();
    for (k, v) in defaults {
        if !pairs.iter().any(|(ek, _)| ek == k) && !config.iter().any(|(ck, _)| ck == k) {
            pairs.push((k.clone(), v.clone()));
            defaulted.push(format!("{k}:{v}"));
        }
    }
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
    let mut source: Vec<&str> = Vec::new();
    for (on, name) in
        [(from_env, "environment"), (!own.is_empty(), "config"), (!defaulted.is_empty(), "default")]
    {
        if on {
            source.push(name);
        }
    }
    let source = if source.is_empty() { "none".to_string() } else { source.join("+") };
    let conf = pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(",");
    let from_config = own.into_iter().map(|(k, _)| k).collect();
    EffectiveSettings { conf, source, overridden, defaulted, env_var: None, from_config }
}

pub fn env_conf() -> Option<String> {
    env_source().map(|(_, value)| value)
}

/// The variable the environment's allocator settings come from, and its value: PyTorch 2.11
/// reads `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`.
pub fn env_source() -> Option<(&'static str, String)> {
    let read = |name: &'static str| std::env::var(name).ok().map(|v| (name, v));
    read("PYTORCH_CUDA_ALLOC_CONF")
        .or_else(|| read("PYTORCH_ALLOC_CONF"))
        .filter(|(_, s)| !s.trim().is_empty())
}

/// The settings a run would use: the environment's, `alloc`'s, trainguard's defaults when the run
/// is on CUDA (`cuda`), and the memory fraction.
pub fn effective(alloc: &AllocatorConfig, fraction: Option<f64>, cuda: bool) -> EffectiveSettings {
    let (source, config) = (env_source(), alloc.pairs());
    let env = source.as_ref().map(|(_, value)| value.as_str());
    let defaults = if cuda { cuda_defaults(env, &config) } else { Vec::new() };
    EffectiveSettings {
        env_var: source.as_ref().map(|(name, _)| *name),
        ..merge(env, &config, &defaults, fraction)
    }
}

/// [`effective`], applied; must run before the first CUDA allocation (and before other threads
/// read the environment: call it early in `main`).
pub fn configure(
    alloc: &AllocatorConfig,
    fraction: Option<f64>,
    cuda: bool,
) -> Result<EffectiveSettings, AllocatorError> {
    let eff = effective(alloc, fraction, cuda);
    if eff.source == "none" {
        return Ok(eff);
    }
    // The fraction (memory.limit on CUDA) is applied by libtorch when its allocator starts, never
    // after: a cap that would silently not hold is an error instead.
    if fraction.is_some() && cuda && ffi::allocator_initialized() {
        return Err(AllocatorError {
            conf: eff.conf,
            message: "not applied: the CUDA caching allocator has already started, so its per_process_memory_fraction (memory.limit) would not hold".into(),
        });
    }
    if let Some(message) = refused_backend(alloc) {
        return Err(AllocatorError { conf: eff.conf, message });
    }
    // libtorch parses the variable itself when the CUDA allocator starts: keep the two equal.
    std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", &eff.conf);
    // Everything but the backend (already in effect; parsing it again starts CUDA, which fails
    // on a machine without a driver) is handed over now.
    let settings = split_pairs(&eff.conf)
        .into_iter()
        .filter(|(k, _)| k != "backend")
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(",");
    if !settings.is_empty() {
        ffi::set_allocator_settings(&settings).map_err(|e| AllocatorError {
            conf: eff.conf.clone(),
            message: format!("libtorch refused them: {}", e.to_string().lines().next().unwrap_or_default()),
        })?;
    }
    Ok(eff)
}

/// Why the config's `memory.allocator.backend` cannot be had, when it cannot: the backend is
/// chosen once, when libtorch loads, from the environment, and another one asked for later would
/// stop libtorch on an internal assert.
fn refused_backend(alloc: &AllocatorConfig) -> Option<String> {
    let at_load = load_time_backend(env_conf().as_deref());
    let asked = alloc.backend.map(|b| b.name()).filter(|asked| *asked != at_load)?;
    Some(format!(
        "memory.allocator.backend: {asked} cannot be chosen from the config, libtorch picked its allocator backend ({at_load}) from the environment when it loaded; start trainguard with PYTORCH_CUDA_ALLOC_CONF=backend:{asked} instead"
    ))
}

/// The allocator backend libtorch chose when it loaded, from the environment's settings `env`:
/// the last `backend` key, else `native`.
fn load_time_backend(env: Option<&str>) -> String {
    env.map(split_pairs)
        .unwrap_or_default()
        .into_iter()
        .rev()
        .find(|(k, _)| k == "backend")
        .map(|(_, v)| v)
        .unwrap_or_else(|| "native".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(k: &str, v: &str) -> (String, String) {
        (k.into(), v.into())
    }

    #[test]
    fn config_wins_over_the_environment_key_by_key() {
        let e = merge(
            Some("expandable_segments:True,max_split_size_mb:128"),
            &[p("max_split_size_mb", "256")],
            &[],
            None,
        );
        assert_eq!(e.conf, "expandable_segments:True,max_split_size_mb:256");
        assert_eq!(e.source, "environment+config");
        assert_eq!(e.overridden, ["max_split_size_mb: environment 128, config 256"]);
    }

    #[test]
    fn sources_and_the_memory_fraction() {
        assert_eq!(merge(None, &[], &[], None).source, "none");
        assert_eq!(merge(Some("backend:native"), &[], &[], None).conf, "backend:native");
        let e = merge(None, &[p("expandable_segments", "True")], &[], Some(0.25));
        assert_eq!(
            (e.conf.as_str(), e.source.as_str()),
            ("expandable_segments:True,per_process_memory_fraction:0.250000", "config")
        );
    }

    #[test]
    fn expandable_segments_by_default_on_cuda_unless_told_otherwise() {
        let on = cuda_defaults(None, &[]);
        let e = merge(None, &[], &on, Some(0.5));
        assert_eq!(
            (e.conf.as_str(), e.source.as_str()),
            ("expandable_segments:True,per_process_memory_fraction:0.500000", "config+default")
        );
        assert_eq!(e.defaulted, ["expandable_segments:True"]);
        let env_other = cuda_defaults(Some("garbage_collection_threshold:0.6"), &[]);
        assert_eq!(
            merge(Some("garbage_collection_threshold:0.6"), &[], &env_other, None).conf,
            "garbage_collection_threshold:0.6,expandable_segments:True"
        );
        for (env, config) in [
            (Some("expandable_segments:False"), vec![]),
            (None, vec![p("expandable_segments", "False")]),
            (Some("backend:cudaMallocAsync"), vec![]),
            (None, vec![p("max_split_size_mb", "128")]),
            (Some("max_split_size_mb:128"), vec![]),
        ] {
            let d = cuda_defaults(env, &config);
            assert!(d.is_empty(), "{env:?} {config:?}");
            assert!(!merge(env, &config, &d, None).conf.contains("expandable_segments:True"));
        }
    }

    #[test]
    fn combinations_that_do_nothing_or_break_are_warned_of_whichever_source_set_them() {
        let warned = |env: Option<&str>, config: &[(String, String)], fraction_set: bool| {
            merge(env, config, &[], None).warnings(fraction_set)
        };
        // From the config alone, named by its keys.
        let w = warned(None, &[p("backend", "cudaMallocAsync"), p("max_split_size_mb", "128")], false);
        assert_eq!(w, ["memory.allocator.max_split_size_mb is ignored by backend cudaMallocAsync"]);
        let w = warned(None, &[p("expandable_segments", "True"), p("max_split_size_mb", "128")], false);
        assert_eq!(w, ["memory.allocator.expandable_segments with memory.allocator.max_split_size_mb: known to misbehave in some PyTorch versions; pick one"]);
        let gc = [p("garbage_collection_threshold", "0.8")];
        assert_eq!(warned(None, &gc, false), ["memory.allocator.garbage_collection_threshold only acts under a memory fraction: set memory.limit"]);
        assert!(warned(None, &gc, true).is_empty(), "with a memory fraction the threshold acts");
        assert!(
            merge(None, &gc, &[], Some(0.5)).warnings(false).is_empty(),
            "the fraction in the settings counts too"
        );
        assert_eq!(warned(None, &[p("pinned_num_register_threads", "8")], false).len(), 1);
        assert!(warned(
            None,
            &[p("pinned_num_register_threads", "8"), p("pinned_use_cuda_host_register", "True")],
            false
        )
        .is_empty());
        // From the environment alone, named as the environment's.
        let w = warned(Some("backend:cudaMallocAsync,expandable_segments:True"), &[], false);
        assert_eq!(
            w,
            ["PYTORCH_CUDA_ALLOC_CONF's expandable_segments is ignored by backend cudaMallocAsync"]
        );
        let w = warned(Some("expandable_segments:true,max_split_size_mb:256"), &[], false);
        assert_eq!(w, ["PYTORCH_CUDA_ALLOC_CONF's expandable_segments with PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb: known to misbehave in some PyTorch versions; pick one"]);
        // Half from each: each key named where it came from; a key the config replaced is the config's.
        let w = warned(
            Some("expandable_segments:True,max_split_size_mb:64"),
            &[p("max_split_size_mb", "128")],
            false,
        );
        assert_eq!(w, ["PYTORCH_CUDA_ALLOC_CONF's expandable_segments with memory.allocator.max_split_size_mb: known to misbehave in some PyTorch versions; pick one"]);
        // The config turning the environment's switch off ends the warning.
        assert!(warned(
            Some("expandable_segments:True,max_split_size_mb:64"),
            &[p("expandable_segments", "False")],
            false
        )
        .is_empty());
        // The environment's other variable is named as the one read.
        let named = EffectiveSettings {
            env_var: Some("PYTORCH_ALLOC_CONF"),
            ..merge(Some("garbage_collection_threshold:0.6"), &[], &[], None)
        };
        assert_eq!(named.warnings(false), ["PYTORCH_ALLOC_CONF's garbage_collection_threshold only acts under a memory fraction: set memory.limit"]);
        // trainguard's own default never warns, nor do no settings.
        let d = cuda_defaults(None, &[]);
        assert!(merge(None, &[], &d, None).warnings(false).is_empty());
        assert!(merge(None, &[], &[], None).warnings(false).is_empty());
    }

    #[test]
    fn the_backend_is_the_one_libtorch_loaded_with() {
        assert_eq!(load_time_backend(None), "native");
        assert_eq!(load_time_backend(Some("expandable_segments:True")), "native");
        assert_eq!(
            load_time_backend(Some("backend:cudaMallocAsync,max_split_size_mb:64")),
            "cudaMallocAsync"
        );
    }

    #[test]
    fn interval_lists_keep_their_commas() {
        let e = merge(Some("roundup_power2_divisions:[64:8,256:4,>:1],backend:native"), &[], &[], None);
        assert_eq!(e.conf, "roundup_power2_divisions:[64:8,256:4,>:1],backend:native");
    }

    #[test]
    fn libtorch_parses_what_the_config_renders() {
        let alloc: AllocatorConfig = serde_yaml::from_str(
            "{expandable_segments: true, roundup_power2_divisions: {'64': 8, '>': 1}, max_split_size_mb: 64}",
        )
        .unwrap();
        let eff = merge(None, &alloc.pairs(), &[], None);
        ffi::set_allocator_settings(&eff.conf).unwrap();
        assert!(ffi::set_allocator_settings("max_split_size_mb:10").is_err(), "libtorch's own range check");
    }
}
