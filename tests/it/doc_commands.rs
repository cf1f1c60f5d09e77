//! Every multi-process command README.md, docs/ and scripts/ show must run as written: each names a
//! shipped config and a world size (processes per node × nodes), and that config must validate
//! and plan at that world size (global batch divisible by micro-batch × world). The commands are
//! read from the files themselves, so a new example or a changed config is checked too.
use crate::common::*;
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
    line.split([' ', '"', '=', '{', '}', ':', '-'].as_ref())
        .find(|t| t.starts_with("configs/") && t.ends_with(".yaml"))
        .map(str::to_string)
        .or_else(|| {
            // `${1:-configs/x.yaml}` splits on ':' and '-': find it whole instead.
            let at = line.find("configs/")?;
            let end = line[at..].find(".yaml")? + at + 5;
            Some(line[at..end].to_string())
        })
}

/// The world sizes and configs of every launcher command in `text` (from `file`).
fn shown_in(file: &str, text: &str) -> Vec<Shown> {
    // The SLURM script's own defaults: `#SBATCH --nodes=K`, `${GPUS_PER_NODE:-G}`, `${1:-CONFIG}`.
    let sbatch = std::fs::read_to_string(repo().join("scripts/launch/slurm.sbatch")).unwrap();
    let sb_nodes: usize =
        sbatch.lines().find_map(|l| l.strip_prefix("#SBATCH --nodes=")).unwrap().trim().parse().unwrap();
    let sb_gpus: usize =
        sbatch.split("GPUS_PER_NODE:-").nth(1).unwrap().split('}').next().unwrap().parse().unwrap();
    let sb_config = sbatch.lines().find(|l| l.starts_with("config=")).and_then(config_in).unwrap();
    let script_default =
        text.lines().find(|l| l.starts_with("cfg=") || l.starts_with("config=")).and_then(config_in);
    let defaults = [("GPUS_PER_NODE", sb_gpus), ("SLURM_NNODES", sb_nodes)];
    let mut found = Vec::new();
    for (i, line) in logical_lines(text).iter().enumerate() {
        let source = format!("{file}:{}", i + 1);
        let code = line.trim_start();
        if code.starts_with('#') && !file.ends_with(".md") {
            // A script's comment: only its usage examples count.
            if !code.contains("sbatch --nodes") && !code.contains("scripts/launch/torchrun.sh ") {
                continue;
            }
        }
        let world = if let Some(n) = flag(line, "--nproc_per_node").and_then(|v| number(&v, &defaults)) {
            let nodes = flag(line, "--nnodes").and_then(|v| number(&v, &defaults)).unwrap_or(1);
            Some(n * nodes)
        } else if let Some(rest) = line
            .find("sbatch ")
            .map(|at| &line[at + 7..])
            .filter(|r| r.contains("scripts/launch/slurm.sbatch"))
        {
            let nodes = flag(rest, "--nodes").and_then(|v| v.parse().ok()).unwrap_or(sb_nodes);
            Some(nodes * sb_gpus)
        } else {
            line.split("scripts/launch/torchrun.sh ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        };
        let Some(world) = world else { continue };
        let config = config_in(line)
            .or_else(|| line.contains("scripts/launch/slurm.sbatch").then(|| sb_config.clone()))
            .or(script_default.clone());
        if let Some(config) = config {
            found.push(Shown { source, config, world });
        }
    }
    found
}

/// The files under `dir` (relative to the repository, recursively) whose names end in one of
/// `endings`, sorted.
fn files_under(dir: &str, endings: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(repo().join(dir)).unwrap().flatten() {
        let path = format!("{dir}/{}", e.file_name().to_string_lossy());
        if e.file_type().unwrap().is_dir() {
            out.extend(files_under(&path, endings));
        } else if endings.iter().any(|end| path.ends_with(end)) {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// README.md and every page under docs/.
fn user_docs() -> Vec<String> {
    std::iter::once("README.md".to_string()).chain(files_under("docs", &[".md"])).collect()
}

fn everything_shown() -> Vec<Shown> {
    let files: Vec<String> =
        user_docs().into_iter().chain(files_under("scripts", &[".sh", ".sbatch"])).collect();
    files.iter().flat_map(|f| shown_in(f, &std::fs::read_to_string(repo().join(f)).unwrap())).collect()
}

/// The repository paths a page names (`scripts/…`, `configs/…`, `docs/…`, `tests/…`, `crates/…`),
/// with the line they are on. A path ends at a space, quote, backtick, bracket or `:`/`,`; a
/// glob or a placeholder (`*`, `<`, `NAME`) is not a path.
fn paths_named(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        for root in ["scripts/", "configs/", "docs/", "tests/", "crates/"] {
            for (at, _) in line.match_indices(root) {
                let before = line[..at].chars().last();
                if before.is_some_and(|c| c.is_alphanumeric() || matches!(c, '/' | '.' | '_' | '-')) {
                    continue; // inside another path or a URL (../shared/…, site/docs/…)
                }
                let end = line[at..]
                    .find(|c: char| c.is_whitespace() || "`'\"()[]<>:,;|*{}$#".contains(c))
                    .map_or(line.len(), |e| at + e);
                let path = line[at..end].trim_end_matches(['.', '/']);
                if path.len() > root.len() && !path.chars().any(|c| c.is_ascii_uppercase()) {
                    out.push((i + 1, path.to_string()));
                }
            }
        }
    }
    out
}

fn plans(config: &str, world: usize) -> Result<RunPlan, String> {
    let cfg = trainguard::config::load(Some(&repo().join(config)), &[]).map_err(|e| e.to_string())?;
    RunPlan::build(
        cfg,
        Environment {
            cuda_devices: 0,
            rank: 0,
            local_rank: 0,
            world_size: world,
            restart_count: 0,
            resuming: false,
        },
    )
    .map_err(|e| e.to_string())
}

#[test]
fn the_reader_finds_the_commands_the_docs_show() {
    let shown = everything_shown();
    let has = |file: &str, config: &str, world: usize| {
        shown.iter().any(|s| s.source.starts_with(file) && s.config == config && s.world == world)
    };
    // README: 8 GPUs on one node, 4 nodes × 8, and `sbatch --nodes=4` of the SLURM script.
    assert!(has("README.md", "configs/gpt2-124m.yaml", 8), "{shown:#?}");
    assert!(has("README.md", "configs/gpt2-124m.yaml", 32), "{shown:#?}");
    // The SLURM script as submitted without --nodes (2 × 8), and its usage line (4 × 8).
    assert!(has("scripts/launch/slurm.sbatch", "configs/gpt2-124m.yaml", 16), "{shown:#?}");
    assert!(has("scripts/launch/slurm.sbatch", "configs/gpt2-124m.yaml", 32), "{shown:#?}");
    assert!(has("scripts/launch/torchrun.sh", "configs/gpt2-124m.yaml", 8), "{shown:#?}");
    assert!(has("scripts/bench/bench_dist.sh", "configs/bench-10m.yaml", 2), "{shown:#?}");
}

/// A renamed or moved file breaks the page that names it: every repository path README.md and
/// docs/ name exists.
#[test]
fn every_path_the_docs_name_exists() {
    let mut missing = Vec::new();
    for file in user_docs() {
        let text = std::fs::read_to_string(repo().join(&file)).unwrap();
        for (line, path) in paths_named(&text) {
            if !repo().join(&path).exists() {
                missing.push(format!("{file}:{line}: {path}"));
            }
        }
    }
    assert!(missing.is_empty(), "paths in the docs that do not exist:\n{}", missing.join("\n"));
    let found = paths_named(
        "see scripts/launch/torchrun.sh, `configs/debug.yaml` and https://x.org/docs/a (docs/cli.md).",
    );
    assert_eq!(
        found.iter().map(|(_, p)| p.as_str()).collect::<Vec<_>>(),
        ["scripts/launch/torchrun.sh", "configs/debug.yaml", "docs/cli.md"]
    );
}

/// The code on a Markdown page with its line: fenced blocks' lines and inline `code` spans (a
/// span may go on over a line break, as Markdown allows; the line is where it begins).
fn code_in(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut span: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            span = None;
        } else if fenced {
            out.push((i + 1, line.to_string()));
        } else if line.trim().is_empty() {
            span = None; // a span ends with its paragraph
        } else {
            for (k, piece) in line.split('`').enumerate() {
                match (&mut span, k > 0) {
                    (Some((_, text)), false) => text.push_str(&format!(" {piece}")),
                    (Some(_), true) => {
                        out.extend(span.take());
                    }
                    (None, true) => span = Some((i + 1, piece.to_string())),
                    (None, false) => {}
                }
            }
        }
    }
    out
}

/// Every `trainguard SUBCOMMAND` the pages show names a subcommand the binary has.
#[test]
fn every_subcommand_the_docs_show_exists() {
    let help =
        String::from_utf8(std::process::Command::new(bin()).arg("--help").output().unwrap().stdout).unwrap();
    let known: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(known.contains(&"train") && known.contains(&"plan"), "{help}");
    let mut unknown = Vec::new();
    for file in user_docs() {
        for (line, code) in code_in(&std::fs::read_to_string(repo().join(&file)).unwrap()) {
            // A command: one that begins a line or follows `&&`, `;` or `|` (prose that names
            // trainguard, "a `trainguard step N` range", is no command).
            for part in code.split(['&', ';', '|']).map(str::trim_start) {
                let rest = ["trainguard ", "target/release/trainguard ", "cargo run --release -- "]
                    .iter()
                    .find_map(|p| part.strip_prefix(p));
                let sub = rest.and_then(|r| r.split_whitespace().next()).unwrap_or("");
                let word = !sub.is_empty() && sub.chars().all(|c| c.is_ascii_lowercase());
                if word && !known.contains(&sub) {
                    unknown.push(format!("{file}:{line}: trainguard {sub}"));
                }
            }
        }
    }
    assert!(unknown.is_empty(), "subcommands the docs show that the binary lacks:\n{}", unknown.join("\n"));
}

#[test]
fn every_command_shown_validates_at_its_world_size() {
    let shown = everything_shown();
    let bad: Vec<String> = shown
        .iter()
        .filter_map(|s| {
            plans(&s.config, s.world)
                .err()
                .map(|e| format!("{} ({} on {} processes): {e}", s.source, s.config, s.world))
        })
        .collect();
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
            assert_eq!(
                p.micro_batch * p.accumulation * w,
                p.config.train.global_batch_size,
                "{config} at {w}"
            );
        }
    }
}

#[test]
fn the_old_batch_of_480_would_have_been_caught() {
    // The check above is not vacuous: GPT-2's 480 over 8 ranks plans (uneven splits are legal)
    // but not evenly: 60 sequences per rank in micro-batches of 16 leave a short last one.
    let cfg = trainguard::config::load(
        Some(&repo().join("configs/gpt2-124m.yaml")),
        &["train.global_batch_size=480".into()],
    )
    .unwrap();
    let p = RunPlan::build(
        cfg,
        Environment {
            cuda_devices: 0,
            rank: 0,
            local_rank: 0,
            world_size: 8,
            restart_count: 0,
            resuming: false,
        },
    )
    .unwrap();
    assert_ne!(p.micro_batch * p.accumulation * 8, 480);
}

/// The config reference cannot go stale: every key a config has (the default config's leaves,
/// as `config show` prints them) has its row in docs/config.md, and every row names a key.
#[test]
fn the_config_reference_lists_every_key() {
    fn leaves(prefix: &str, v: &serde_yaml::Value, out: &mut Vec<String>) {
        match v {
            serde_yaml::Value::Mapping(m) if !m.is_empty() => {
                for (k, v) in m {
                    let k = k.as_str().expect("config keys are text");
                    let path = if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
                    leaves(&path, v, out);
                }
            }
            _ => out.push(prefix.to_string()),
        }
    }
    let mut keys = Vec::new();
    leaves("", &serde_yaml::to_value(trainguard::config::Config::default()).unwrap(), &mut keys);
    assert!(keys.len() > 80 && keys.contains(&"train.lr".to_string()), "{keys:?}");
    let page = std::fs::read_to_string(repo().join("docs/config.md")).unwrap();
    let rows: Vec<String> = page
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| l.split('`').nth(1).map(str::to_string))
        .collect();
    let missing: Vec<&String> = keys.iter().filter(|k| !rows.contains(k)).collect();
    assert!(missing.is_empty(), "keys without a row in docs/config.md: {missing:?}");
    let known = |row: &String| keys.iter().any(|k| k == row || k.starts_with(&format!("{row}.")));
    let sections: Vec<&str> = keys.iter().filter_map(|k| k.split_once('.').map(|(s, _)| s)).collect();
    let stale: Vec<&String> = rows
        .iter()
        .filter(|r| r.split_once('.').is_some_and(|(s, _)| sections.contains(&s)) && !known(r))
        .collect();
    assert!(stale.is_empty(), "rows in docs/config.md for keys the config lacks: {stale:?}");
}
