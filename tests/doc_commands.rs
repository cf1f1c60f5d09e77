//! Every multi-process command README.md and scripts/ show must run as written: each names a
//! shipped config and a world size (processes per node × nodes), and that config must validate
//! and plan at that world size (global batch divisible by micro-batch × world). The commands are
//! read from the files themselves, so a new example or a changed config is checked too.
mod common;
use common::*;
use trainguard::run_plan::{Environment, RunPlan};

/// A command as shown: where, which config, how many processes in all.
#[derive(Debug, Clone, PartialEq)]
struct Shown {
    source: String,
    config: String,
    world: usize,
}

/// Backslash-continued lines joined, comments kept (README's commands sit in code blocks).
fn logical_lines(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    for l in text.lines() {
        if let Some(head) = l.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(l);
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

fn flag(line: &str, name: &str) -> Option<String> {
    let rest = line.split(&format!("{name}=")).nth(1)?;
    Some(rest.split([' ', '"', '\\']).find(|s| !s.is_empty())?.to_string())
}

fn number(v: &str, defaults: &[(&str, usize)]) -> Option<usize> {
    v.parse().ok().or_else(|| defaults.iter().find(|(k, _)| v.contains(k)).map(|(_, n)| *n))
}

fn config_in(line: &str) -> Option<String> {
    line.split([' ', '"', '=', '{', '}', ':', '-'].as_ref()).find(|t| t.starts_with("configs/") && t.ends_with(".yaml")).map(str::to_string).or_else(|| {
        // `${1:-configs/x.yaml}` splits on ':' and '-': find it whole instead.
        let at = line.find("configs/")?;
        let end = line[at..].find(".yaml")? + at + 5;
        Some(line[at..end].to_string())
    })
}

/// The world sizes and configs of every launcher command in `text` (from `file`).
fn shown_in(file: &str, text: &str) -> Vec<Shown> {
    // The SLURM script's own defaults: `#SBATCH --nodes=K`, `${GPUS_PER_NODE:-G}`, `${1:-CONFIG}`.
    let sbatch = std::fs::read_to_string(repo().join("scripts/slurm.sbatch")).unwrap();
    let sb_nodes: usize = sbatch.lines().find_map(|l| l.strip_prefix("#SBATCH --nodes=")).unwrap().trim().parse().unwrap();
    let sb_gpus: usize = sbatch.split("GPUS_PER_NODE:-").nth(1).unwrap().split('}').next().unwrap().parse().unwrap();
    let sb_config = sbatch.lines().find(|l| l.starts_with("config=")).and_then(config_in).unwrap();
    let script_default = text.lines().find(|l| l.starts_with("cfg=") || l.starts_with("config=")).and_then(config_in);
    let defaults = [("GPUS_PER_NODE", sb_gpus), ("SLURM_NNODES", sb_nodes)];
    let mut found = Vec::new();
    for (i, line) in logical_lines(text).iter().enumerate() {
        let source = format!("{file}:{}", i + 1);
        let code = line.trim_start();
        if code.starts_with('#') && !file.ends_with(".md") {
            // A script's comment: only its usage examples count.
            if !code.contains("sbatch --nodes") && !code.contains("scripts/torchrun.sh ") {
                continue;
            }
        }
        let world = if let Some(n) = flag(line, "--nproc_per_node").and_then(|v| number(&v, &defaults)) {
            let nodes = flag(line, "--nnodes").and_then(|v| number(&v, &defaults)).unwrap_or(1);
            Some(n * nodes)
        } else if let Some(rest) = line.find("sbatch ").map(|at| &line[at + 7..]).filter(|r| r.contains("scripts/slurm.sbatch")) {
            let nodes = flag(rest, "--nodes").and_then(|v| v.parse().ok()).unwrap_or(sb_nodes);
            Some(nodes * sb_gpus)
        } else {
            line.split("scripts/torchrun.sh ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok())
        };
        let Some(world) = world else { continue };
        let config = config_in(line).or_else(|| line.contains("scripts/slurm.sbatch").then(|| sb_config.clone())).or(script_default.clone());
        if let Some(config) = config {
            found.push(Shown { source, config, world });
        }
    }
    found
}

fn everything_shown() -> Vec<Shown> {
    let mut files = vec!["README.md".to_string()];
    for e in std::fs::read_dir(repo().join("scripts")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".sh") || name.ends_with(".sbatch") {
            files.push(format!("scripts/{name}"));
        }
    }
    files.sort();
    files.iter().flat_map(|f| shown_in(f, &std::fs::read_to_string(repo().join(f)).unwrap())).collect()
}

fn plans(config: &str, world: usize) -> Result<RunPlan, String> {
    let cfg = trainguard::config::load(Some(&repo().join(config)), &[]).map_err(|e| e.to_string())?;
    RunPlan::build(cfg, Environment { cuda_devices: 0, rank: 0, local_rank: 0, world_size: world, restart_count: 0, resuming: false }).map_err(|e| e.to_string())
}

#[test]
fn the_reader_finds_the_commands_the_docs_show() {
    let shown = everything_shown();
    let has = |file: &str, config: &str, world: usize| shown.iter().any(|s| s.source.starts_with(file) && s.config == config && s.world == world);
    // README: 8 GPUs on one node, 4 nodes × 8, and `sbatch --nodes=4` of the SLURM script.
    assert!(has("README.md", "configs/gpt2-124m.yaml", 8), "{shown:#?}");
    assert!(has("README.md", "configs/gpt2-124m.yaml", 32), "{shown:#?}");
    // The SLURM script as submitted without --nodes (2 × 8), and its usage line (4 × 8).
    assert!(has("scripts/slurm.sbatch", "configs/gpt2-124m.yaml", 16), "{shown:#?}");
    assert!(has("scripts/slurm.sbatch", "configs/gpt2-124m.yaml", 32), "{shown:#?}");
    assert!(has("scripts/torchrun.sh", "configs/gpt2-124m.yaml", 8), "{shown:#?}");
    assert!(has("scripts/bench_dist.sh", "configs/bench-10m.yaml", 2), "{shown:#?}");
}

#[test]
fn every_command_shown_validates_at_its_world_size() {
    let shown = everything_shown();
    let bad: Vec<String> = shown.iter().filter_map(|s| plans(&s.config, s.world).err().map(|e| format!("{} ({} on {} processes): {e}", s.source, s.config, s.world))).collect();
    assert!(bad.is_empty(), "commands in the docs that exit 2:\n{}", bad.join("\n"));
}

#[test]
fn the_gpu_configs_split_at_every_world_size_the_docs_use() {
    let mut worlds: Vec<usize> = everything_shown().iter().map(|s| s.world).chain([1]).collect();
    worlds.sort();
    worlds.dedup();
    for config in ["configs/gpt2-124m.yaml", "configs/gpt2-350m.yaml"] {
        for &w in &worlds {
            let p = plans(config, w).unwrap_or_else(|e| panic!("{config} at {w} processes: {e}"));
            assert_eq!(p.micro_batch * p.accumulation * w, p.config.train.global_batch_size, "{config} at {w}");
        }
    }
}

#[test]
fn the_old_batch_of_480_would_have_been_caught() {
    // The check above is not vacuous: GPT-2's 480 over 8 ranks plans (uneven splits are legal)
    // but not evenly: 60 sequences per rank in micro-batches of 16 leave a short last one.
    let cfg = trainguard::config::load(Some(&repo().join("configs/gpt2-124m.yaml")), &["train.global_batch_size=480".into()]).unwrap();
    let p = RunPlan::build(cfg, Environment { cuda_devices: 0, rank: 0, local_rank: 0, world_size: 8, restart_count: 0, resuming: false }).unwrap();
    assert_ne!(p.micro_batch * p.accumulation * 8, 480);
}
