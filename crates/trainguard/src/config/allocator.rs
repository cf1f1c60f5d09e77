//! `memory.allocator`: the CUDA caching allocator's options (what `PYTORCH_CUDA_ALLOC_CONF`
//! takes), checked with PyTorch 2.11's rules before anything runs, and rendered as the
//! `key:value,…` string libtorch parses. Pure; applying it is `memory::allocator`'s job.
use super::Problem;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllocatorConfig {
    /// Grow segments in place instead of allocating new ones: less fragmentation.
    pub expandable_segments: Option<bool>,
    /// Blocks larger than this (MB, >= 20) are never split.
    pub max_split_size_mb: Option<u64>,
    /// Reclaim cached blocks when usage passes this share of the memory fraction, in (0, 1).
    pub garbage_collection_threshold: Option<f64>,
    /// Round allocation sizes to this many divisions per power of two (a power of two), or per
    /// size interval: `{"64": 8, "256": 4, ">": 1}` (sizes in MB, powers of two).
    pub roundup_power2_divisions: Option<Roundup>,
    /// Requests above the split size are rounded to this (MB, >= 20).
    pub max_non_split_rounding_mb: Option<u64>,
    pub backend: Option<Backend>,
    pub release_lock_on_cudamalloc: Option<bool>,
    pub pinned_use_cuda_host_register: Option<bool>,
    /// Threads registering pinned memory (a power of two, <= 128).
    pub pinned_num_register_threads: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a power of two (every size), or a map of size to divisions like {256: 1, 1024: 4}"
)]
pub enum Roundup {
    All(u64),
    Intervals(#[serde(deserialize_with = "size_keys")] BTreeMap<String, u64>),
}

/// An interval map's keys as written: `{256: 1}` (YAML reads a number) as `{"256": 1}` and `">"`.
fn size_keys<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, u64>, D::Error> {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    struct SizeKey(String);
    impl<'de> Deserialize<'de> for SizeKey {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl serde::de::Visitor<'_> for Visitor {
                type Value = SizeKey;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a size in MB or `>`")
                }
                fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<SizeKey, E> {
                    Ok(SizeKey(v.to_string()))
                }
                fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<SizeKey, E> {
                    Ok(SizeKey(v.to_string()))
                }
                fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SizeKey, E> {
                    Ok(SizeKey(v.to_string()))
                }
            }
            d.deserialize_any(Visitor)
        }
    }
    Ok(BTreeMap::<SizeKey, u64>::deserialize(d)?.into_iter().map(|(k, v)| (k.0, v)).collect())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    #[serde(rename = "native")]
    Native,
    #[serde(rename = "cudaMallocAsync")]
    CudaMallocAsync,
}

impl Backend {
    /// The name PYTORCH_CUDA_ALLOC_CONF uses.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

pub const KEY: &str = "memory.allocator";

fn power_of_two(n: u64) -> bool {
    n > 0 && n & (n - 1) == 0
}

impl AllocatorConfig {
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// PyTorch 2.11's rules, each broken one a problem naming its key.
    pub fn problems(&self) -> Vec<Problem> {
        let mut p = Vec::new();
        let key = |k: &str| format!("{KEY}.{k}");
        if let Some(v) = self.max_split_size_mb {
            if v < 20 {
                p.push(Problem::new(&key("max_split_size_mb"), format!("must be >= 20 (MB), got {v}")));
            }
        }
        if let Some(v) = self.max_non_split_rounding_mb {
            if v < 20 {
                p.push(Problem::new(
                    &key("max_non_split_rounding_mb"),
                    format!("must be >= 20 (MB), got {v}"),
                ));
            }
        }
        if let Some(v) = self.garbage_collection_threshold {
            if !(v > 0.0 && v < 1.0) {
                p.push(Problem::new(
                    &key("garbage_collection_threshold"),
                    format!("must be in (0, 1) exclusive, got {v}"),
                ));
            }
        }
        match &self.roundup_power2_divisions {
            Some(Roundup::All(d)) if !power_of_two(*d) => p.push(Problem::new(
                &key("roundup_power2_divisions"),
                format!("must be a power of two, got {d}"),
            )),
            Some(Roundup::Intervals(m)) => {
                if m.is_empty() {
                    p.push(Problem::new(
                        &key("roundup_power2_divisions"),
                        "an interval map needs at least one entry",
                    ));
                }
                for (size, d) in m {
                    let k = key(&format!("roundup_power2_divisions.{size}"));
                    if size != ">" && !size.parse::<u64>().is_ok_and(power_of_two) {
                        p.push(Problem::new(
                            &k,
                            format!("interval sizes are powers of two in MB or `>`, got `{size}`"),
                        ));
                    }
                    if !power_of_two(*d) {
                        p.push(Problem::new(&k, format!("divisions must be a power of two, got {d}")));
                    }
                }
            }
            _ => {}
        }
        if let Some(n) = self.pinned_num_register_threads {
            if !power_of_two(n) || n > 128 {
                p.push(Problem::new(
                    &key("pinned_num_register_threads"),
                    format!("must be a power of two <= 128, got {n}"),
                ));
            }
        }
        p
    }

    /// `(key, value)` pairs in PYTORCH_CUDA_ALLOC_CONF syntax (booleans `True`/`False`).
    pub fn pairs(&self) -> Vec<(String, String)> {
        let b = |v: bool| if v { "True" } else { "False" }.to_string();
        let mut out = Vec::new();
        let mut put = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                out.push((k.to_string(), v));
            }
        };
        put("backend", self.backend.map(|x| x.name().to_string()));
        put("expandable_segments", self.expandable_segments.map(b));
        put("max_split_size_mb", self.max_split_size_mb.map(|v| v.to_string()));
        put("garbage_collection_threshold", self.garbage_collection_threshold.map(|v| v.to_string()));
        put(
            "roundup_power2_divisions",
            self.roundup_power2_divisions.as_ref().map(|r| match r {
                Roundup::All(d) => d.to_string(),
                Roundup::Intervals(m) => {
                    // Increasing sizes, `>` last, as PyTorch expects.
                    let mut items: Vec<(&String, &u64)> = m.iter().collect();
                    items.sort_by_key(|(k, _)| k.parse::<u64>().unwrap_or(u64::MAX));
                    format!(
                        "[{}]",
                        items.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(",")
                    )
                }
            }),
        );
        put("max_non_split_rounding_mb", self.max_non_split_rounding_mb.map(|v| v.to_string()));
        put("release_lock_on_cudamalloc", self.release_lock_on_cudamalloc.map(b));
        put("pinned_use_cuda_host_register", self.pinned_use_cuda_host_register.map(b));
        put("pinned_num_register_threads", self.pinned_num_register_threads.map(|v| v.to_string()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(a: &AllocatorConfig) -> Vec<String> {
        a.problems().into_iter().map(|p| p.key).collect()
    }

    #[test]
    fn each_rule_names_its_key() {
        let cases: Vec<(AllocatorConfig, &str)> = vec![
            (
                AllocatorConfig { max_split_size_mb: Some(19), ..Default::default() },
                "memory.allocator.max_split_size_mb",
            ),
            (
                AllocatorConfig { max_non_split_rounding_mb: Some(1), ..Default::default() },
                "memory.allocator.max_non_split_rounding_mb",
            ),
            (
                AllocatorConfig { garbage_collection_threshold: Some(1.0), ..Default::default() },
                "memory.allocator.garbage_collection_threshold",
            ),
            (
                AllocatorConfig { garbage_collection_threshold: Some(0.0), ..Default::default() },
                "memory.allocator.garbage_collection_threshold",
            ),
            (
                AllocatorConfig { roundup_power2_divisions: Some(Roundup::All(3)), ..Default::default() },
                "memory.allocator.roundup_power2_divisions",
            ),
            (
                AllocatorConfig { pinned_num_register_threads: Some(256), ..Default::default() },
                "memory.allocator.pinned_num_register_threads",
            ),
            (
                AllocatorConfig { pinned_num_register_threads: Some(6), ..Default::default() },
                "memory.allocator.pinned_num_register_threads",
            ),
        ];
        for (cfg, key) in cases {
            assert_eq!(keys(&cfg), [key], "{cfg:?}");
        }
        let intervals =
            Roundup::Intervals([("64".to_string(), 8), ("100".to_string(), 4), (">".to_string(), 3)].into());
        let k = keys(&AllocatorConfig { roundup_power2_divisions: Some(intervals), ..Default::default() });
        assert_eq!(
            k,
            ["memory.allocator.roundup_power2_divisions.100", "memory.allocator.roundup_power2_divisions.>"]
        );
    }

    #[test]
    fn valid_settings_render_as_pytorch_expects() {
        let a = AllocatorConfig {
            expandable_segments: Some(true),
            roundup_power2_divisions: Some(Roundup::Intervals(
                [(">".to_string(), 1), ("256".to_string(), 4), ("64".to_string(), 8)].into(),
            )),
            garbage_collection_threshold: Some(0.6),
            backend: Some(Backend::Native),
            ..Default::default()
        };
        assert!(a.problems().is_empty());
        let s: Vec<String> = a.pairs().into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
        assert_eq!(
            s,
            [
                "backend:native",
                "expandable_segments:True",
                "garbage_collection_threshold:0.6",
                "roundup_power2_divisions:[64:8,256:4,>:1]"
            ]
        );
    }

    #[test]
    fn interval_sizes_may_be_written_as_numbers_or_strings() {
        let read =
            |yaml: &str| serde_yaml::from_str::<AllocatorConfig>(yaml).unwrap().roundup_power2_divisions;
        let want = Some(Roundup::Intervals(
            [("256".to_string(), 1), ("1024".to_string(), 4), (">".to_string(), 1)].into(),
        ));
        assert_eq!(read("roundup_power2_divisions: {256: 1, 1024: 4, \">\": 1}"), want);
        assert_eq!(read("roundup_power2_divisions: {\"256\": 1, \"1024\": 4, \">\": 1}"), want);
        assert_eq!(read("roundup_power2_divisions: 4"), Some(Roundup::All(4)));
        assert!(serde_yaml::from_str::<AllocatorConfig>("roundup_power2_divisions: {256: x}").is_err());
    }
}
