//! The launch environment torchrun (or a person, or SLURM via a wrapper) gives each worker:
//! `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
//! `TORCHELASTIC_USE_AGENT_STORE`, `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_ERROR_FILE`.
//! No `RANK` means a single process. Pure: the variables come in through a lookup function.
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// torchrun's agent already hosts the TCPStore: every rank connects as a client.
    pub use_agent_store: bool,
    pub restart_count: u64,
    pub error_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the launch environment is incomplete or inconsistent:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
pub struct EnvError(pub Vec<String>);

/// Reads the worker environment through `get`; `Ok(None)` when `RANK` is unset.
pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>, EnvError> {
    if get("RANK").is_none() {
        return alone(get("WORLD_SIZE")).map_err(|p| EnvError(vec![p])).map(|()| None);
    }
    let mut problems = Vec::new();
    let mut num = |name: &str, required: bool| -> Option<u64> {
        match get(name) {
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    problems.push(format!("{name}={v:?} is not a non-negative integer"));
                    None
                }
            },
            None if required => {
                problems.push(format!("{name} is not set (RANK is, so a multi-process launch is assumed)"));
                None
            }
            None => None,
        }
    };
    let rank = num("RANK", true);
    let world = num("WORLD_SIZE", true);
    let port = num("MASTER_PORT", true);
    let local_rank = num("LOCAL_RANK", false);
    let local_world = num("LOCAL_WORLD_SIZE", false);
    let restart_count = num("TORCHELASTIC_RESTART_COUNT", false).unwrap_or(0);
    let addr = get("MASTER_ADDR").filter(|a| !a.trim().is_empty());
    if addr.is_none() {
        problems.push("MASTER_ADDR is not set".into());
    }
    if let (Some(r), Some(w)) = (rank, world) {
        if w == 0 {
            problems.push("WORLD_SIZE=0".into());
        } else if r >= w {
            problems.push(format!("RANK={r} is not below WORLD_SIZE={w}"));
        }
    }
    if let Some(p) = port {
        if p == 0 || p > u16::MAX as u64 {
            problems.push(format!("MASTER_PORT={p} is not a TCP port"));
        }
    }
    if let (Some(lr), Some(lw)) = (local_rank, local_world) {
        if lr >= lw {
            problems.push(format!("LOCAL_RANK={lr} is not below LOCAL_WORLD_SIZE={lw}"));
        }
    }
    if let (Some(lw), Some(w)) = (local_world, world) {
        if lw > w {
            problems.push(format!("LOCAL_WORLD_SIZE={lw} exceeds WORLD_SIZE={w}"));
        }
    }
    if !problems.is_empty() {
        return Err(EnvError(problems));
    }
    let (rank, world) = (rank.unwrap() as usize, world.unwrap() as usize);
    Ok(Some(DistEnv {
        rank,
        local_rank: local_rank.map_or(rank, |v| v as usize),
        world_size: world,
        local_world_size: local_world.map_or(world, |v| v as usize),
        master_addr: addr.unwrap(),
        master_port: port.unwrap() as u16,
        use_agent_store: get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
        restart_count,
        error_file: get("TORCHELASTIC_ERROR_FILE").filter(|f| !f.is_empty()).map(PathBuf::from),
    }))
}

/// Without `RANK`, one process: a `WORLD_SIZE` beside it (a launcher's, a job script's) is
/// passed over, unless it cannot be a world's size at all: a typo that says no world is meant.
fn alone(world: Option<String>) -> Result<(), String> {
    match world.as_deref().map(str::trim).filter(|w| !w.is_empty()).map(str::parse::<u64>) {
        None | Some(Ok(1..)) => Ok(()),
        Some(Ok(0)) => Err("WORLD_SIZE=0 (without RANK: one process; a world has at least one rank)".into()),
        Some(Err(_)) => Err(format!(
            "WORLD_SIZE={:?} is not a non-negative integer (without RANK: one process)",
            world.unwrap_or_default()
        )),
    }
}

pub fn from_process_env() -> Result<Option<DistEnv>, EnvError> {
    from_env(|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    const TORCHRUN: [(&str, &str); 9] = [
        ("RANK", "1"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "1"),
        ("TORCHELASTIC_ERROR_FILE", "/tmp/err.json"),
    ];

    #[test]
    fn no_rank_means_one_process() {
        assert_eq!(from_env(env(&[("WORLD_SIZE", "4")])), Ok(None));
        assert_eq!(from_env(env(&[])), Ok(None));
        // Unless WORLD_SIZE cannot be a world's size at all.
        for (world, said) in [("0", "WORLD_SIZE=0"), ("two", "WORLD_SIZE=\"two\" is not")] {
            let e = from_env(env(&[("WORLD_SIZE", world)])).unwrap_err();
            assert!(e.to_string().contains(said), "{e}");
        }
    }

    #[test]
    fn torchrun_variables_are_read() {
        let d = from_env(env(&TORCHRUN)).unwrap().unwrap();
        assert_eq!((d.rank, d.local_rank, d.world_size, d.master_port), (1, 1, 2, 29500));
        assert!(d.use_agent_store);
        assert_eq!(d.restart_count, 1);
        assert_eq!(d.error_file, Some(PathBuf::from("/tmp/err.json")));
    }

    #[test]
    fn missing_and_inconsistent_variables_are_all_named() {
        let e = from_env(env(&[("RANK", "3"), ("WORLD_SIZE", "2")])).unwrap_err();
        let text = e.to_string();
        for needle in ["MASTER_PORT is not set", "MASTER_ADDR is not set", "RANK=3 is not below WORLD_SIZE=2"]
        {
            assert!(text.contains(needle), "{text}");
        }
        let e = from_env(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "x"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ]))
        .unwrap_err();
        assert_eq!(e.0.len(), 2, "{e}");
    }
}
