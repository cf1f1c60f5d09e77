//! GPU presets, pure: name → memory per card as the driver reports it (`nvidia-smi`'s total,
//! which is a little under the marketing figure). Owns the table and the name lookup; reading a
//! real card (NVML) is `gpu.rs`.

/// One card model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    pub description: &'static str,
    /// Total memory in MiB as `nvidia-smi` reports it.
    pub mib: u64,
}

impl Preset {
    pub fn bytes(&self) -> u64 {
        self.mib << 20
    }
}

/// Sorted by memory, then name.
pub const PRESETS: &[Preset] = &[
    Preset { name: "t4", description: "NVIDIA T4 16 GB", mib: 15_360 },
    Preset { name: "v100-16", description: "NVIDIA V100 16 GB", mib: 16_160 },
    Preset { name: "a10", description: "NVIDIA A10 24 GB", mib: 23_028 },
    Preset { name: "a10g", description: "NVIDIA A10G 24 GB", mib: 23_028 },
    Preset { name: "l4", description: "NVIDIA L4 24 GB", mib: 23_034 },
    Preset { name: "rtx4090", description: "GeForce RTX 4090 24 GB", mib: 24_564 },
    Preset { name: "rtx3090", description: "GeForce RTX 3090 24 GB", mib: 24_576 },
    Preset { name: "rtx6000", description: "Quadro RTX 6000 24 GB", mib: 24_576 },
    Preset { name: "v100-32", description: "NVIDIA V100 32 GB", mib: 32_768 },
    Preset { name: "a100-40", description: "NVIDIA A100 40 GB", mib: 40_960 },
    Preset { name: "l40s", description: "NVIDIA L40S 48 GB", mib: 46_068 },
    Preset { name: "a6000", description: "RTX A6000 48 GB", mib: 49_140 },
    Preset { name: "rtx6000-ada", description: "RTX 6000 Ada 48 GB", mib: 49_140 },
    Preset { name: "h100", description: "NVIDIA H100 80 GB (SXM / PCIe)", mib: 81_559 },
    Preset { name: "a100-80", description: "NVIDIA A100 80 GB", mib: 81_920 },
    Preset { name: "h100-nvl", description: "NVIDIA H100 NVL 94 GB", mib: 95_830 },
    Preset { name: "h200", description: "NVIDIA H200 141 GB", mib: 143_771 },
];

/// Other spellings people type.
const ALIASES: &[(&str, &str)] =
    &[("a100-40gb", "a100-40"), ("a100-80gb", "a100-80"), ("h100-80", "h100"), ("quadro-rtx6000", "rtx6000")];

/// Family names that leave the memory open: `--apply` for an A100 40 GB planned as the 80 GB
/// card would write a micro-batch for twice its memory.
const AMBIGUOUS: &[(&str, &[&str])] = &[("a100", &["a100-40", "a100-80"]), ("v100", &["v100-16", "v100-32"])];

/// The presets a family name such as `a100` could mean, when it is one.
pub fn variants(name: &str) -> Option<&'static [&'static str]> {
    let key = name.trim().to_ascii_lowercase();
    AMBIGUOUS.iter().find(|(family, _)| *family == key).map(|(_, v)| *v)
}

/// Looks a preset up by name: case-insensitive, `_` and ` ` read as `-`.
pub fn find(name: &str) -> Option<&'static Preset> {
    let key: String = name
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c == '_' || c == ' ' { '-' } else { c })
        .collect();
    let key = ALIASES.iter().find(|(alias, _)| *alias == key).map_or(key.as_str(), |(_, to)| to);
    PRESETS.iter().find(|p| p.name == key)
}

/// `t4, v100-16, …` for error messages.
pub fn known_names() -> String {
    PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_in_any_spelling() {
        assert_eq!(find("a100-80").unwrap().mib, 81_920);
        assert_eq!(find("A100_80").unwrap().name, "a100-80");
        assert_eq!(find(" H100 ").unwrap().name, "h100");
        assert_eq!(find("A100-40GB").unwrap().name, "a100-40");
        assert!(find("a100-81").is_none());
        assert!(find("tpu-v5").is_none());
    }

    #[test]
    fn every_preset_the_issue_names_is_there_with_a_plausible_size() {
        for name in ["t4", "l4", "a10", "rtx6000", "v100-16", "v100-32", "a100-40", "a100-80", "h100", "h200"]
        {
            let p = find(name).unwrap_or_else(|| panic!("{name} missing"));
            // nvidia-smi's total lies within 10% of the marketing size in GB.
            let words: Vec<&str> = p.description.split_whitespace().collect();
            let gb: u64 = words[words.iter().position(|w| *w == "GB").unwrap() - 1].parse().unwrap();
            let ratio = p.bytes() as f64 / (gb as f64 * 1e9);
            assert!((0.93..1.1).contains(&ratio), "{name}: {} MiB for {gb} GB (ratio {ratio:.3})", p.mib);
        }
    }

    #[test]
    fn table_is_sorted_and_names_are_unique() {
        assert!(PRESETS.windows(2).all(|w| (w[0].mib, w[0].name) < (w[1].mib, w[1].name)));
        for (alias, to) in ALIASES {
            assert!(find(to).is_some() && PRESETS.iter().all(|p| p.name != *alias), "{alias} → {to}");
        }
        for (family, variants) in AMBIGUOUS {
            assert!(find(family).is_none() && variants.iter().all(|v| find(v).is_some()), "{family}");
        }
        assert_eq!(super::variants("A100"), Some(&["a100-40", "a100-80"][..]));
        let names = known_names();
        assert!(names.starts_with("t4, ") && names.ends_with("h200"), "{names}");
    }
}
