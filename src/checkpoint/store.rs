//! Checkpoints on disk: `out_dir/checkpoints/step-XXXXXXXX/` with `model.safetensors`,
//! `optimizer.safetensors`, `trainer_state.json` and `config.yaml`. Written into a temporary
//! directory, every file and the directory fsynced, then renamed into place: a checkpoint is
//! complete or it does not exist. Readers skip temporary leftovers and remove them.
use super::state::TrainerState;
use crate::config::Config;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
pub const CONFIG_FILE: &str = "config.yaml";
const TMP_PREFIX: &str = ".tmp-";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is incomplete or corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("checkpoint {path} does not match the config: {}", .differences.join("; "))]
    Incompatible { path: PathBuf, differences: Vec<String> },
    #[error("cannot save a checkpoint at {path}: {why}")]
    Save { path: PathBuf, why: String },
    #[error(
        "{} already holds {count} checkpoint(s) of another run (newest: step {newest}); a fresh run (`--resume none`, the default) would mix with them. \
         Choose one: `--resume auto` to continue that run, another out_dir (`--set out_dir=...`), or `--overwrite` to move the old run aside to {}.old-<unix time>",
        .out_dir.display(), .out_dir.display()
    )]
    RunExists { out_dir: PathBuf, newest: u64, count: usize },
}

/// A checkpoint read back from disk.
pub struct Loaded {
    pub path: PathBuf,
    pub state: TrainerState,
    pub config: Config,
    pub weights: Vec<(String, Tensor)>,
    pub optimizer: Vec<(String, Tensor)>,
}

pub fn root(out_dir: &Path) -> PathBuf {
    out_dir.join("checkpoints")
}

pub fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok()).flatten()
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

fn fsync(path: &Path) -> Result<(), CheckpointError> {
    File::open(path).and_then(|f| f.sync_all()).map_err(io(path))
}

/// Complete checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| parse_step(&e.file_name().to_string_lossy()).map(|s| (s, e.path())))
        .filter(|(_, p)| p.is_dir())
        .collect();
    found.sort();
    found
}

/// Removes temporary directories left by a writer that was killed mid-write.
pub fn clean_temporaries(root: &Path) -> Vec<PathBuf> {
    let leftovers: Vec<PathBuf> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(TMP_PREFIX))
        .map(|e| e.path())
        .collect();
    for p in &leftovers {
        let _ = fs::remove_dir_all(p);
    }
    leftovers
}

/// Deletes a checkpoint so that it is never seen half-deleted: renamed out of the
/// `step-XXXXXXXX` namespace first (one atomic step), then removed.
pub fn remove(root: &Path, step: u64) -> Result<(), CheckpointError> {
    let dir = root.join(dir_name(step));
    let doomed = root.join(format!("{TMP_PREFIX}del-{}", dir_name(step)));
    fs::rename(&dir, &doomed).map_err(io(&dir))?;
    fs::remove_dir_all(&doomed).map_err(io(&doomed))
}

/// Writes one checkpoint atomically and returns its directory.
pub fn save(
    root: &Path,
    state: &TrainerState,
    config: &Config,
    weights: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(root).map_err(io(root))?;
    let name = dir_name(state.step);
    let tmp = root.join(format!("{TMP_PREFIX}{name}"));
    let final_dir = root.join(&name);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir(&tmp).map_err(io(&tmp))?;
    let written = write_files(&tmp, state, config, weights, optimizer);
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    fsync(&tmp)?;
    if final_dir.exists() {
        // The same step again (a resumed run re-checkpointing): replace it. Between the two
        // renames the step is briefly absent, never half there.
        let old = root.join(format!("{TMP_PREFIX}old-{name}"));
        if old.exists() {
            fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        fs::rename(&final_dir, &old).map_err(io(&final_dir))?;
        fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
    }
    fsync(root)?;
    Ok(final_dir)
}

fn write_files(dir: &Path, state: &TrainerState, config: &Config, weights: &[(String, Tensor)], optimizer: &[(String, Tensor)]) -> Result<(), CheckpointError> {
    let mut state = state.clone();
    for (file, tensors) in [(MODEL_FILE, weights), (OPTIMIZER_FILE, optimizer)] {
        if file == OPTIMIZER_FILE {
            // Test-only: a window with the model file written and the rest missing, so a test
            // can kill the writer mid-checkpoint on purpose rather than by chance.
            if let Some(ms) = config.faults.pause_in_checkpoint_write_ms {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
        }
        let path = dir.join(file);
        let save_err = |why: String| CheckpointError::Save { path: path.clone(), why };
        let cpu: Vec<(&str, Tensor)> = tensors
            .iter()
            .map(|(n, t)| Ok((n.as_str(), t.f_detach()?.f_to_device(Device::Cpu)?)))
            .collect::<Result<_, tch::TchError>>()
            .map_err(|e| save_err(e.to_string()))?;
        Tensor::write_safetensors(&cpu, &path).map_err(|e| save_err(e.to_string()))?;
        fsync(&path)?;
        state.files.insert(file.to_string(), fs::metadata(&path).map_err(io(&path))?.len());
    }
    let json = serde_json::to_string_pretty(&state).expect("TrainerState serialises");
    let yaml = serde_yaml::to_string(config).expect("Config serialises");
    for (file, text) in [(STATE_FILE, json), (CONFIG_FILE, yaml)] {
        let path = dir.join(file);
        fs::write(&path, text).map_err(io(&path))?;
        fsync(&path)?;
    }
    Ok(())
}

/// Reads and checks a checkpoint directory: state, sizes, both tensor files, config.
pub fn load(dir: &Path) -> Result<Loaded, CheckpointError> {
    let corrupt = |why: String| CheckpointError::Corrupt { path: dir.to_path_buf(), why };
    if !dir.is_dir() {
        return Err(corrupt("no such checkpoint directory".into()));
    }
    let text = fs::read_to_string(dir.join(STATE_FILE)).map_err(|e| corrupt(format!("{STATE_FILE}: {e}")))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| corrupt(format!("{STATE_FILE}: {e}")))?;
    for (file, size) in &state.files {
        let actual = fs::metadata(dir.join(file)).map(|m| m.len()).map_err(|e| corrupt(format!("{file}: {e}")))?;
        if actual != *size {
            return Err(corrupt(format!("{file} is {actual} bytes, {size} expected (truncated?)")));
        }
    }
    let read = |file: &str| Tensor::read_safetensors(dir.join(file)).map_err(|e| corrupt(format!("{file}: {e}")));
    let (weights, optimizer) = (read(MODEL_FILE)?, read(OPTIMIZER_FILE)?);
    let yaml = fs::read_to_string(dir.join(CONFIG_FILE)).map_err(|e| corrupt(format!("{CONFIG_FILE}: {e}")))?;
    let config: Config = serde_yaml::from_str(&yaml).map_err(|e| corrupt(format!("{CONFIG_FILE}: {e}")))?;
    Ok(Loaded { path: dir.to_path_buf(), state, config, weights, optimizer })
}

/// The newest checkpoint under `root` that loads; the ones skipped on the way, with why.
pub fn newest_valid(root: &Path) -> (Option<Loaded>, Vec<CheckpointError>) {
    let mut skipped = Vec::new();
    for (_, dir) in list(root).into_iter().rev() {
        match load(&dir) {
            Ok(l) => return (Some(l), skipped),
            Err(e) => skipped.push(e),
        }
    }
    (None, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::state::*;

    fn state(step: u64) -> TrainerState {
        TrainerState {
            format: STATE_FORMAT,
            step,
            micro_steps: 4 * step,
            tokens_seen: 100 * step,
            sampler: SamplerState { seed: 1, next_step: step },
            rng: RngState { scheme: RNG_SCHEME.into(), seed: 1 },
            loss_scaler: None,
            guard: GuardSnapshot { micro_batch: 8, accumulation: 4, configured_micro_batch: 8, escalation_level: 0, regrow: Default::default() },
            optimizer: OptimizerSnapshot { kind: "adamw".into(), steps: step },
            best_val_loss: Some(1.5),
            best_val_step: Some(step),
            nonfinite_skips: 0,
            elapsed_s: 1.0,
            files: Default::default(),
        }
    }

    fn tensors() -> Vec<(String, Tensor)> {
        vec![("a".into(), Tensor::from_slice(&[1.0f32, 2.0])), ("b".into(), Tensor::from_slice(&[3.0f32]))]
    }

    #[test]
    fn round_trip_and_listing() {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        for step in [5, 10] {
            save(&root, &state(step), &Config::default(), &tensors(), &tensors()).unwrap();
        }
        assert_eq!(list(&root).iter().map(|(s, _)| *s).collect::<Vec<_>>(), [5, 10]);
        let l = load(&root.join("step-00000010")).unwrap();
        assert_eq!(l.state.step, 10);
        assert_eq!(l.state.files.len(), 2);
        assert_eq!(l.config, Config::default());
        assert_eq!(l.weights.len(), 2);
        let a = &l.weights.iter().find(|(n, _)| n == "a").unwrap().1;
        assert!(a.equal(&Tensor::from_slice(&[1.0f32, 2.0])));
        // Saving the same step again replaces it.
        save(&root, &state(10), &Config::default(), &tensors(), &tensors()).unwrap();
        assert_eq!(list(&root).len(), 2);
    }

    #[test]
    fn truncated_files_and_leftovers_are_never_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        save(&root, &state(5), &Config::default(), &tensors(), &tensors()).unwrap();
        let newest = save(&root, &state(10), &Config::default(), &tensors(), &tensors()).unwrap();
        let model = newest.join(MODEL_FILE);
        let len = fs::metadata(&model).unwrap().len();
        File::options().write(true).open(&model).unwrap().set_len(len / 2).unwrap();
        assert!(matches!(load(&newest), Err(CheckpointError::Corrupt { .. })));
        let (found, skipped) = newest_valid(&root);
        assert_eq!(found.unwrap().state.step, 5);
        assert_eq!(skipped.len(), 1);
        fs::create_dir(root.join(".tmp-step-00000015")).unwrap();
        assert_eq!(list(&root).len(), 2, "temporaries are not checkpoints");
        assert_eq!(clean_temporaries(&root).len(), 1);
        assert!(!root.join(".tmp-step-00000015").exists());
    }
}
