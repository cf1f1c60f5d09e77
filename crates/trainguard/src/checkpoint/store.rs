//! Checkpoints on disk: `out_dir/checkpoints/step-XXXXXXXX/` with `model.safetensors`,
//! `optimizer.safetensors`, `trainer_state.json` and `config.yaml`. Written into a temporary
//! directory, every file and the directory fsynced, then renamed into place: a checkpoint is
//! complete or it does not exist. Readers skip temporary leftovers and remove them, but put back a
//! checkpoint that a replacement of the same step had moved aside when the writer died between
//! its two renames. Each tensor file's size and CRC-32C are in `trainer_state.json`: a file
//! truncated or changed in place is corrupt, never loaded; so is one whose parts disagree with
//! its own config, or whose tensors hold NaN or ±inf ([`load`]).
//!
//! Under `dist.shard` each rank writes its own part of the optimizer state
//! (`optimizer.rank-RRRRR-of-WWWWW.safetensors`) in parallel, staged in a temporary directory of
//! its own ([`stage_shard`]); rank 0 moves the staged files into its temporary checkpoint, whose
//! `trainer_state.json` records every file's size and checksum, and renames it into place only
//! then: a rank killed at any moment leaves the previous checkpoint whole. Each state tensor is
//! named for its parameter, so a checkpoint loads into any world size and level ([`load`] reads
//! every optimizer file).
use super::state::{TrainerState, STATE_FORMAT};
use crate::config::Config;
use crate::fs::{run_files, whole_file};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

pub const MODEL_FILE: &str = run_files::WEIGHTS;
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = run_files::STATE;
pub const CONFIG_FILE: &str = run_files::CONFIG;
const TMP_PREFIX: &str = ".tmp-";
/// A checkpoint moved aside while the same step is written again.
const OLD_PREFIX: &str = ".tmp-old-";
/// A rank's optimizer shard waiting for rank 0 to take it into a checkpoint.
const SHARD_PREFIX: &str = ".tmp-shard-";

/// The optimizer file `rank` of `world` writes under `dist.shard`.
pub fn optimizer_shard_file(rank: usize, world: usize) -> String {
    format!("optimizer.rank-{rank:05}-of-{world:05}.safetensors")
}

/// Whether a checkpoint file holds optimizer state (the whole, or one rank's shard).
fn is_optimizer_file(name: &str) -> bool {
    name == OPTIMIZER_FILE || (name.starts_with("optimizer.rank-") && name.ends_with(".safetensors"))
}

/// One rank's optimizer shard, written and fsynced where rank 0 takes it from.
#[derive(Debug, Clone, PartialEq)]
pub struct StagedShard {
    pub path: PathBuf,
    pub size: u64,
    pub crc32c: u32,
}

impl StagedShard {
    /// Where `rank` stages its shard of the checkpoint of `step` under `root`.
    pub fn path(root: &Path, step: u64, rank: usize, world: usize) -> PathBuf {
        root.join(format!("{SHARD_PREFIX}{}-{rank}", dir_name(step))).join(optimizer_shard_file(rank, world))
    }
}

/// Writes this rank's optimizer shard of the checkpoint of `step` into its staging directory,
/// file and directory fsynced, and returns its size and checksum for rank 0's records.
pub fn stage_shard(
    root: &Path,
    step: u64,
    rank: usize,
    world: usize,
    optimizer: &[(String, Tensor)],
    pause: Option<std::time::Duration>,
) -> Result<StagedShard, CheckpointError> {
    let path = StagedShard::path(root, step, rank, world);
    let dir = path.parent().expect("a staged shard lies in a directory");
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    fs::create_dir_all(dir).map_err(io(dir))?;
    // Test-only (`faults.pause_in_checkpoint_write_ms`): a window inside the write, so a test
    // can kill this rank mid-checkpoint on purpose.
    if let Some(pause) = pause {
        std::thread::sleep(pause);
    }
    let (size, crc32c) = write_tensors(&path, optimizer)?;
    fsync(dir)?;
    Ok(StagedShard { path, size, crc32c })
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is incomplete or corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("no checkpoint at {}: `--resume` takes `auto`, `none` or a checkpoint directory (OUT_DIR/checkpoints/step-…)", .path.display())]
    Missing { path: PathBuf },
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
    #[error("{} is a run directory, not a checkpoint: `--resume auto` with out_dir there continues from its newest checkpoint, or give one of {}/step-…", .path.display(), .path.join("checkpoints").display())]
    RunNotCheckpoint { path: PathBuf },
    #[error("{} is a run's checkpoints directory, not a checkpoint: `--resume auto` with out_dir {} continues from its newest one, or give one of {}/step-…", .path.display(), .path.parent().unwrap_or(Path::new(".")).display(), .path.display())]
    CheckpointsNotCheckpoint { path: PathBuf },
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
    out_dir.join(crate::fs::run_files::CHECKPOINTS)
}

pub fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step a checkpoint directory's name gives, when it is the name [`dir_name`] writes (8
/// digits, more from step 100,000,000 on).
fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    let step: u64 = digits.bytes().all(|b| b.is_ascii_digit()).then(|| digits.parse().ok()).flatten()?;
    (dir_name(step) == name).then_some(step)
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

/// What [`clean_temporaries`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Directories removed: checkpoints half written or half deleted.
    pub removed: Vec<PathBuf>,
    /// Steps put back: a complete checkpoint that [`save`] had moved aside to replace it with
    /// the same step, the writer killed before the new one took its name.
    pub restored: Vec<u64>,
}

/// Removes temporary directories left by a writer that was killed mid-write, and puts back a
/// replaced checkpoint whose replacement never took its name.
pub fn clean_temporaries(root: &Path) -> Leftovers {
    let mut found = Leftovers::default();
    let names: Vec<String> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| is_temporary(n))
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    for name in names {
        let path = root.join(&name);
        let replaced =
            name.strip_prefix(OLD_PREFIX).and_then(|n| parse_step(n).map(|step| (step, root.join(n))));
        match replaced {
            Some((step, home)) if !home.exists() && fs::rename(&path, &home).is_ok() => {
                found.restored.push(step)
            }
            _ => {
                let _ = fs::remove_dir_all(&path);
                found.removed.push(path);
            }
        }
    }
    if !found.restored.is_empty() {
        let _ = fsync(root);
    }
    found
}

/// Whether a name in the checkpoints directory is one of a run's temporaries, which
/// [`clean_temporaries`] removes or puts back.
pub fn is_temporary(name: &std::ffi::OsStr) -> bool {
    name.to_string_lossy().starts_with(TMP_PREFIX)
}

/// `base`, or `base-2`, `base-3`, … : the first that is not taken.
pub fn free_path(base: String, taken: impl Fn(&Path) -> bool) -> PathBuf {
    let mut candidate = PathBuf::from(&base);
    let mut n = 2;
    while taken(&candidate) {
        candidate = PathBuf::from(format!("{base}-{n}"));
        n += 1;
    }
    candidate
}

/// Moves the checkpoints of another line than the one a run continues out of the way, into
/// `root/set-aside-<unix seconds>/` (nothing is deleted): those of more steps than the one
/// `resumed` (a corrupt newest passed over, or an older checkpoint resumed on purpose), and the
/// one of the same step unless it is the checkpoint resumed (which may lie elsewhere: a
/// set-aside one, another run's); for a fresh start (`None`), every one. Among the run's own
/// checkpoints they would count as its newest, for retention (which would delete the run's own
/// instead) and for the next `--resume auto` (which would jump to them); and a stop checkpoint
/// of the step resumed would replace the one of that step. Returns the directory and the
/// steps moved, if any.
pub fn set_aside_after(
    root: &Path,
    resumed: Option<(u64, &Path)>,
    unix_seconds: u64,
) -> Result<Option<(PathBuf, Vec<u64>)>, CheckpointError> {
    let same =
        |a: &Path, b: &Path| matches!((fs::canonicalize(a), fs::canonicalize(b)), (Ok(a), Ok(b)) if a == b);
    let other_line = |s: u64, dir: &Path| match resumed {
        None => true,
        Some((step, path)) => s > step || (s == step && !same(dir, path)),
    };
    let newer: Vec<(u64, PathBuf)> = list(root).into_iter().filter(|(s, dir)| other_line(*s, dir)).collect();
    if newer.is_empty() {
        return Ok(None);
    }
    let aside = free_path(format!("{}/set-aside-{unix_seconds}", root.display()), |p| p.exists());
    fs::create_dir(&aside).map_err(io(&aside))?;
    for (_, dir) in &newer {
        let to = aside.join(dir.file_name().unwrap_or_default());
        fs::rename(dir, &to).map_err(io(dir))?;
    }
    fsync(root)?;
    Ok(Some((aside, newer.into_iter().map(|(s, _)| s).collect())))
}

/// Deletes a checkpoint so that it is never seen half-deleted: renamed out of the
/// `step-XXXXXXXX` namespace first (one atomic step), then removed.
pub fn remove(root: &Path, step: u64) -> Result<(), CheckpointError> {
    let dir = root.join(dir_name(step));
    let doomed = root.join(format!("{TMP_PREFIX}del-{}", dir_name(step)));
    fs::rename(&dir, &doomed).map_err(io(&dir))?;
    fs::remove_dir_all(&doomed).map_err(io(&doomed))
}

/// This writer's optimizer state and the file it goes to, and the other ranks' staged shards.
pub struct OptimizerParts<'a> {
    pub file: String,
    pub tensors: &'a [(String, Tensor)],
    pub staged: Vec<StagedShard>,
}

impl<'a> OptimizerParts<'a> {
    /// The whole state in `optimizer.safetensors`.
    pub fn whole(tensors: &'a [(String, Tensor)]) -> Self {
        Self { file: OPTIMIZER_FILE.into(), tensors, staged: Vec::new() }
    }
}

/// Writes one checkpoint atomically and returns its directory.
pub fn save(
    root: &Path,
    state: &TrainerState,
    config: &Config,
    weights: &[(String, Tensor)],
    optimizer: OptimizerParts,
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
        // renames the step is briefly absent, never half there; a writer killed there leaves
        // the old one under `.tmp-old-`, which `clean_temporaries` puts back.
        let old = root.join(format!("{OLD_PREFIX}{name}"));
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

fn write_files(
    dir: &Path,
    state: &TrainerState,
    config: &Config,
    weights: &[(String, Tensor)],
    optimizer: OptimizerParts,
) -> Result<(), CheckpointError> {
    let mut state = state.clone();
    for (file, tensors) in [(MODEL_FILE, weights), (optimizer.file.as_str(), optimizer.tensors)] {
        if file != MODEL_FILE {
            // Test-only: a window with the model file written and the rest missing, so a test
            // can kill the writer mid-checkpoint on purpose rather than by chance.
            if let Some(ms) = config.faults.pause_in_checkpoint_write_ms {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
        }
        let (size, crc) = write_tensors(&dir.join(file), tensors)?;
        state.files.insert(file.to_string(), size);
        state.checksums.insert(file.to_string(), crc);
    }
    for shard in &optimizer.staged {
        let name = shard.path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let to = dir.join(&name);
        fs::rename(&shard.path, &to).map_err(io(&shard.path))?;
        if let Some(staging) = shard.path.parent() {
            let _ = fs::remove_dir(staging);
        }
        state.files.insert(name.clone(), shard.size);
        state.checksums.insert(name, shard.crc32c);
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

/// Writes `tensors` (moved to the CPU) to `path` as safetensors, fsynced; returns the file's
/// size and its CRC-32C read back from the page cache: what the file holds, not what was meant
/// for it.
fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(u64, u32), CheckpointError> {
    let save_err = |why: String| CheckpointError::Save { path: path.to_path_buf(), why };
    let cpu: Vec<(&str, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.as_str(), t.f_detach()?.f_to_device(Device::Cpu)?)))
        .collect::<Result<_, tch::TchError>>()
        .map_err(|e| save_err(e.to_string()))?;
    Tensor::write_safetensors(&cpu, path).map_err(|e| save_err(super::write_error(&e)))?;
    fsync(path)?;
    let size = fs::metadata(path).map_err(io(path))?.len();
    Ok((size, checksum(path).map_err(io(path))?))
}

/// CRC-32C of a file's bytes, read in pieces small enough to come from the heap: a buffer
/// mapped of its own would raise the process's peak (what `memory.limit` caps on the CPU) at
/// every checkpoint.
fn checksum(path: &Path) -> std::io::Result<u32> {
    use std::io::Read;
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 64 << 10];
    let mut crc = 0;
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(crc),
            n => crc = crc32c::crc32c_append(crc, &buf[..n]),
        }
    }
}

/// A checkpoint directory's `trainer_state.json` alone (its step, say), unchecked against the
/// files it lists.
pub fn load_state(dir: &Path) -> Result<TrainerState, CheckpointError> {
    let corrupt = |why: String| CheckpointError::Corrupt { path: dir.to_path_buf(), why };
    if dir.exists() && !dir.is_dir() {
        // `--resume out/checkpoints/step-00000010/model.safetensors`, say.
        return Err(corrupt(format!("a file, not a checkpoint directory (one holds {STATE_FILE}, {MODEL_FILE}, {OPTIMIZER_FILE} and {CONFIG_FILE})")));
    }
    if !dir.exists() {
        return Err(CheckpointError::Missing { path: dir.to_path_buf() });
    }
    let text = whole_file::read_regular_string(&dir.join(STATE_FILE))
        .map_err(|e| corrupt(format!("{STATE_FILE}: {e}")))?;
    serde_json::from_str(&text).map_err(|e| corrupt(format!("{STATE_FILE}: {e}")))
}

/// Reads and checks a checkpoint directory: state, sizes, both tensor files, config.
pub fn load_checkpoint(dir: &Path) -> Result<Loaded, CheckpointError> {
    let corrupt = |why: String| CheckpointError::Corrupt { path: dir.to_path_buf(), why };
    let state = load_state(dir)?;
    // A copy of a checkpoint may have any name; one named for a step must hold that step (the
    // resume sets aside every checkpoint past the step it loads).
    if let Some(named) =
        dir.file_name().and_then(|n| parse_step(&n.to_string_lossy())).filter(|&n| n != state.step)
    {
        return Err(corrupt(format!(
            "{STATE_FILE} holds step {}, its directory names step {named}",
            state.step
        )));
    }
    // What the small files alone can refuse is refused before the tensor files are read.
    let yaml =
        whole_file::read_string_at_most(&dir.join(CONFIG_FILE), crate::config::limits::MAX_CONFIG_BYTES)
            .map_err(|e| corrupt(format!("{CONFIG_FILE}: {e}")))?;
    let config: Config = crate::config::saved(&yaml).map_err(|e| corrupt(format!("{CONFIG_FILE}: {e}")))?;
    state_agrees(&state, &config).map_err(corrupt)?;
    for (file, size) in &state.files {
        let actual =
            fs::metadata(dir.join(file)).map(|m| m.len()).map_err(|e| corrupt(format!("{file}: {e}")))?;
        if actual != *size {
            return Err(corrupt(format!("{file} is {actual} bytes, {size} expected (truncated?)")));
        }
    }
    // Each tensor file is read once: its checksum and its tensors come from the same bytes, and
    // no more of them than the size recorded (a device or a file grown since would never end).
    let read = |file: &str| -> Result<Vec<(String, Tensor)>, CheckpointError> {
        let size = state
            .files
            .get(file)
            .ok_or_else(|| corrupt(format!("{STATE_FILE} records no size for {file}")))?;
        let bytes =
            whole_file::read_at_most(&dir.join(file), *size).map_err(|e| corrupt(format!("{file}: {e}")))?;
        if let Some(expected) = state.checksums.get(file) {
            let actual = crc32c::crc32c(&bytes);
            if actual != *expected {
                return Err(corrupt(format!(
                    "{file} has CRC-32C {actual:08x}, {expected:08x} when written (changed on disk)"
                )));
            }
        }
        tensors_of(&bytes).map_err(|why| corrupt(format!("{file}: {why}")))
    };
    let weights = read(MODEL_FILE)?;
    // The whole state in one file, or one shard per rank that wrote it (under `dist.shard`).
    let optimizer_files: Vec<&String> = state.files.keys().filter(|f| is_optimizer_file(f)).collect();
    if optimizer_files.is_empty() {
        return Err(corrupt(format!(
            "{STATE_FILE} records no optimizer file ({OPTIMIZER_FILE}, or optimizer.rank-…)"
        )));
    }
    let mut optimizer = Vec::new();
    for file in optimizer_files {
        let part = read(file)?;
        finite(file, &part).map_err(corrupt)?;
        optimizer.extend(part);
    }
    weights_agree(&config, &weights).map_err(corrupt)?;
    finite(MODEL_FILE, &weights).map_err(corrupt)?;
    Ok(Loaded { path: dir.to_path_buf(), state, config, weights, optimizer })
}

/// A checkpoint's parts agree with each other ([`state_agrees`], then [`weights_agree`]). The
/// checksums cover only the tensor files, and a run resuming checks its config against
/// `config.yaml` alone: what disagrees here (a file edited by hand, or written by a bug) is found
/// before a model is built or the run touches its directory, and `--resume auto` passes over it
/// to an older checkpoint.
///
/// `trainer_state.json`'s counts and scale are in range and its optimizer is the one its
/// `config.yaml` names.
fn state_agrees(state: &TrainerState, config: &Config) -> Result<(), String> {
    if state.format > STATE_FORMAT {
        return Err(format!(
            "{STATE_FILE} is format {}, written by a newer trainguard (this one reads format {STATE_FORMAT})",
            state.format
        ));
    }
    let g = &state.guard;
    let counts = [
        ("world_size", state.world_size.unwrap_or(1)),
        ("guard.micro_batch", g.micro_batch),
        ("guard.accumulation", g.accumulation),
        ("guard.configured_micro_batch", g.configured_micro_batch),
    ];
    if let Some((key, _)) = counts.iter().find(|(_, n)| *n == 0) {
        return Err(format!("{STATE_FILE}: {key} 0 (at least 1)"));
    }
    // fp16's loss scale multiplies the loss in fp32: 0 made every loss NaN, a scale past fp32's
    // range stopped the first step with libtorch's overflow.
    if let Some(scale) = state.loss_scaler.as_ref().map(|s| &s["scale"]) {
        if !scale.as_f64().is_some_and(|x| x > 0.0 && x <= f32::MAX as f64) {
            return Err(format!("{STATE_FILE}: loss_scaler.scale {scale} (a positive fp32 number)"));
        }
    }
    if !(state.elapsed_s.is_finite() && state.elapsed_s >= 0.0) {
        return Err(format!("{STATE_FILE}: elapsed_s {} (seconds trained, at least 0)", state.elapsed_s));
    }
    let named = config.optimizer.name.name();
    if state.optimizer.kind != named {
        return Err(format!(
            "{STATE_FILE} holds the state of optimizer `{}`, its {CONFIG_FILE} names `{named}`",
            state.optimizer.kind
        ));
    }
    Ok(())
}

/// `model.safetensors` holds each weight that `config.yaml`'s model describes, in its shape and
/// in floating point.
fn weights_agree(config: &Config, weights: &[(String, Tensor)]) -> Result<(), String> {
    // More blocks than tensors cannot be this file's model (and describing them would take
    // the memory of a model that size, for a number typed by hand).
    if config.model.n_layer > weights.len() {
        return Err(format!(
            "its {CONFIG_FILE} gives {} blocks; {MODEL_FILE} holds {} tensors",
            config.model.n_layer,
            weights.len()
        ));
    }
    // trainguard writes weights in floating point (fp32; bf16 in a bf16-pure run): integers
    // here would be cast and trained on as if they were weights.
    if let Some((name, t)) = weights.iter().find(|(_, t)| !t.is_floating_point()) {
        return Err(format!("`{name}` in {MODEL_FILE} holds {:?}, not floating point", t.kind()));
    }
    for spec in crate::model::describe(&config.model) {
        let shape =
            weights.iter().find(|(n, _)| *n == spec.name).map(|(_, t)| t.size()).ok_or_else(|| {
                format!("{MODEL_FILE} lacks `{}`, which its {CONFIG_FILE}'s model has", spec.name)
            })?;
        // Unpadded rows: written before model.pad_vocab_to (the resume says so, by name).
        let unpadded = spec.user_rows.map(|_| spec.user_shape());
        if shape != spec.shape && Some(&shape) != unpadded.as_ref() {
            return Err(format!(
                "`{}` has shape {shape:?}, its {CONFIG_FILE}'s model gives {:?}",
                spec.name, spec.shape
            ));
        }
    }
    Ok(())
}

/// A model file outside a checkpoint (a run's final weights, a Hugging Face directory's
/// `model.safetensors`), read whole and held to what a checkpoint's weights are: a file cut
/// short is said to be one, and NaN or ±inf in it is named by tensor, not computed with. The
/// error leaves the path to the caller.
pub fn read_model_file(path: &Path) -> Result<Vec<(String, Tensor)>, String> {
    // Mapped, as tch's reader maps it, from the file opened as a regular one.
    let (file, _) = whole_file::open_regular(path).map_err(|e| e.to_string())?;
    let map = crate::ffi::os::map_readonly(&file).map_err(|e| e.to_string())?;
    let tensors = tensors_of(&map)?;
    finite(&path.file_name().unwrap_or_default().to_string_lossy(), &tensors)?;
    Ok(tensors)
}

/// The tensors of a safetensors file's bytes.
fn tensors_of(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, String> {
    let parsed = safetensors::SafeTensors::deserialize(bytes).map_err(|e| not_whole(&e))?;
    parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| match Tensor::try_from(view) {
            Ok(t) => Ok((name, t)),
            Err(e) => Err(format!("{name}: {e}")),
        })
        .collect()
}

/// What a safetensors file that does not parse is, said once for every reader of one.
pub fn not_whole(err: &safetensors::SafeTensorError) -> String {
    format!("not a whole safetensors file (cut short, or another format): {err:?}")
}

/// Every floating-point tensor of `file` holds finite numbers. A run skips each update that is
/// not finite, so NaN or ±inf here was written by a bug or a hand, the checksums stamped to
/// match; resumed, the first step's loss is NaN and the run stops, with no word of why. As
/// corrupt, `--resume auto` passes over it to the newest checkpoint a run can train on.
fn finite(file: &str, tensors: &[(String, Tensor)]) -> Result<(), String> {
    for (name, t) in tensors.iter().filter(|(_, t)| t.is_floating_point()) {
        let finite =
            t.f_isfinite().and_then(|f| f.f_sum(tch::Kind::Int64)).and_then(|n| n.f_int64_value(&[]));
        match finite.map(|n| t.numel() as i64 - n) {
            Ok(0) => {}
            Ok(n) => return Err(format!("`{name}` in {file} holds {n} of {} values that are NaN or infinite: a model of them computes NaN (training from it, non-finite losses; sampling, arbitrary tokens)", t.numel())),
            Err(e) => return Err(format!("`{name}` in {file}: {e}")),
        }
    }
    Ok(())
}

/// The newest checkpoint under `root` that loads; the ones skipped on the way, with why.
pub fn newest_valid(root: &Path) -> (Option<Loaded>, Vec<CheckpointError>) {
    newest_valid_past(root, None)
}

/// [`newest_valid`] among the checkpoints past step `past` (by their directory's name: the
/// older ones are not read).
pub fn newest_valid_past(root: &Path, past: Option<u64>) -> (Option<Loaded>, Vec<CheckpointError>) {
    let mut skipped = Vec::new();
    for (_, dir) in list(root).into_iter().rev().take_while(|(step, _)| past.is_none_or(|p| *step > p)) {
        match load_checkpoint(&dir) {
            Ok(l) => return (Some(l), skipped),
            Err(e) => skipped.push(e),
        }
    }
    (None, skipped)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::checkpoint::state::*;

    pub(crate) fn state(step: u64) -> TrainerState {
        TrainerState {
            format: STATE_FORMAT,
            step,
            micro_steps: 4 * step,
            tokens_seen: 100 * step,
            tokens_by_source: Default::default(),
            sampler: SamplerState { seed: 1, next_step: step },
            world_size: Some(1),
            rng: RngState { scheme: RNG_SCHEME.into(), seed: 1 },
            loss_scaler: None,
            guard: GuardSnapshot {
                micro_batch: 8,
                accumulation: 4,
                configured_micro_batch: 8,
                escalation_level: 0,
                regrow: Default::default(),
            },
            optimizer: OptimizerSnapshot { kind: "adamw".into(), steps: step },
            best_val_loss: Some(1.5),
            best_val_step: Some(step),
            nonfinite_skips: 0,
            nonfinite_streak: 0,
            elapsed_s: 1.0,
            files: Default::default(),
            checksums: Default::default(),
            data: None,
            lineage: vec![],
            divergence: None,
        }
    }

    pub(crate) fn tensors() -> Vec<(String, Tensor)> {
        vec![("a".into(), Tensor::from_slice(&[1.0f32, 2.0])), ("b".into(), Tensor::from_slice(&[3.0f32]))]
    }

    /// The weights of `Config::default()`'s model, each filled with its index.
    pub(crate) fn weights() -> Vec<(String, Tensor)> {
        let specs = crate::model::describe(&Config::default().model);
        specs
            .into_iter()
            .enumerate()
            .map(|(i, s)| (s.name, Tensor::full(&s.shape, i as f64, (tch::Kind::Float, Device::Cpu))))
            .collect()
    }

    #[test]
    fn round_trip_and_listing() {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        for step in [5, 10] {
            save(&root, &state(step), &Config::default(), &weights(), OptimizerParts::whole(&tensors()))
                .unwrap();
        }
        assert_eq!(list(&root).iter().map(|(s, _)| *s).collect::<Vec<_>>(), [5, 10]);
        let l = load_checkpoint(&root.join("step-00000010")).unwrap();
        assert_eq!(l.state.step, 10);
        assert_eq!(l.state.files.len(), 2);
        assert_eq!(l.config, Config::default());
        assert_eq!(l.weights.len(), weights().len());
        assert!(weights().iter().all(|(m, u)| l.weights.iter().any(|(n, t)| n == m && t.equal(u))));
        let a = &l.optimizer.iter().find(|(n, _)| n == "a").unwrap().1;
        assert!(a.equal(&Tensor::from_slice(&[1.0f32, 2.0])));
        // Saving the same step again replaces it.
        save(&root, &state(10), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        assert_eq!(list(&root).len(), 2);
        // A file of one given for the checkpoint, and a path to nothing, are told apart.
        let why = |p: &Path| match load_checkpoint(p) {
            Err(CheckpointError::Corrupt { why, .. }) => why,
            other => panic!("loaded: {:?}", other.map(|l| l.path)),
        };
        assert!(why(&root.join("step-00000010").join(MODEL_FILE))
            .starts_with("a file, not a checkpoint directory"));
        let missing =
            load_checkpoint(&root.join("step-00000011")).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            missing.starts_with("no checkpoint at ")
                && missing.contains("`--resume` takes `auto`, `none` or a checkpoint directory"),
            "{missing}"
        );
    }

    #[test]
    fn step_names_past_eight_digits_are_checkpoints() {
        for step in [0, 7, 99_999_999, 100_000_000, 123_456_789_012] {
            assert_eq!(parse_step(&dir_name(step)), Some(step));
        }
        for name in ["step-1", "step-000000001", "step-0100000000", "step-1234567a", "step-", "x-00000001"] {
            assert_eq!(parse_step(name), None, "{name}");
        }
    }

    /// Checkpoints of steps 5 and 10 in a fresh directory: (the directory, root, step 10's).
    fn five_and_ten() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        save(&root, &state(5), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        let newest =
            save(&root, &state(10), &Config::default(), &weights(), OptimizerParts::whole(&tensors()))
                .unwrap();
        (dir, root, newest)
    }

    /// A weights file swapped for a FIFO or `/dev/zero`, the manifest saying 0 bytes as either's
    /// length is: refused as what it is, not read until memory runs out (or forever).
    #[test]
    fn a_tensor_file_that_is_not_a_regular_file_is_refused_not_read() {
        let (_dir, root, newest) = five_and_ten();
        let state_path = newest.join(STATE_FILE);
        let mut st: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&state_path).unwrap()).unwrap();
        st["files"][MODEL_FILE] = serde_json::json!(0);
        st.as_object_mut().unwrap().remove("checksums");
        fs::write(&state_path, st.to_string()).unwrap();
        let model = newest.join(MODEL_FILE);
        fs::remove_file(&model).unwrap();
        crate::fs::whole_file::tests::fifo(&newest, MODEL_FILE);
        for what in ["a FIFO (named pipe)", "a character device"] {
            match load_checkpoint(&newest) {
                Err(CheckpointError::Corrupt { why, .. }) => {
                    assert_eq!(why, format!("{MODEL_FILE}: {what}, not a regular file"))
                }
                other => panic!("{what} loaded: {:?}", other.map(|l| l.path)),
            }
            fs::remove_file(&model).unwrap();
            std::os::unix::fs::symlink("/dev/zero", &model).unwrap();
        }
        assert_eq!(newest_valid(&root).0.unwrap().state.step, 5, "auto passes over it");
    }

    #[test]
    fn truncated_files_and_leftovers_are_never_loaded() {
        let (_dir, root, newest) = five_and_ten();
        let model = newest.join(MODEL_FILE);
        let len = fs::metadata(&model).unwrap().len();
        File::options().write(true).open(&model).unwrap().set_len(len / 2).unwrap();
        assert!(matches!(load_checkpoint(&newest), Err(CheckpointError::Corrupt { .. })));
        let (found, skipped) = newest_valid(&root);
        assert_eq!(found.unwrap().state.step, 5);
        assert_eq!(skipped.len(), 1);
        // Past step 5, only step 10's counts, and it is broken: nothing, and step 5 not read.
        fs::remove_file(root.join("step-00000005").join(STATE_FILE)).unwrap();
        let (found, skipped) = newest_valid_past(&root, Some(5));
        assert!(found.is_none());
        assert_eq!(skipped.len(), 1, "step 5's missing state is not reported");
        assert!(newest_valid_past(&root, Some(10)).1.is_empty());
        fs::create_dir(root.join(".tmp-step-00000015")).unwrap();
        assert_eq!(list(&root).len(), 2, "temporaries are not checkpoints");
        assert_eq!(clean_temporaries(&root).removed.len(), 1);
        assert!(!root.join(".tmp-step-00000015").exists());
    }

    #[test]
    fn bytes_changed_in_place_are_caught_by_the_checksum() {
        let (_dir, root, newest) = five_and_ten();
        for file in [MODEL_FILE, OPTIMIZER_FILE] {
            let path = newest.join(file);
            let good = fs::read(&path).unwrap();
            // The last byte is data, not the header: safetensors alone reads the file fine.
            let mut bad = good.clone();
            *bad.last_mut().unwrap() ^= 0x40;
            fs::write(&path, &bad).unwrap();
            assert!(!Tensor::read_safetensors(&path).unwrap().is_empty(), "still parses");
            match load_checkpoint(&newest) {
                Err(CheckpointError::Corrupt { why, .. }) => {
                    assert!(why.contains(file) && why.contains("CRC-32C"), "{why}")
                }
                other => panic!("{file} changed in place loaded: {:?}", other.map(|l| l.path)),
            }
            assert_eq!(newest_valid(&root).0.unwrap().state.step, 5, "auto passes over it");
            fs::write(&path, &good).unwrap();
            assert!(load_checkpoint(&newest).is_ok());
        }
        // Written before checksums: checked by size alone, still loads.
        let text = fs::read_to_string(newest.join(STATE_FILE)).unwrap();
        let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
        old.as_object_mut().unwrap().remove("checksums");
        fs::write(newest.join(STATE_FILE), old.to_string()).unwrap();
        assert!(load_checkpoint(&newest).unwrap().state.checksums.is_empty());
    }

    #[test]
    fn a_replacement_killed_between_its_renames_puts_the_old_checkpoint_back() {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        let ten = save(&root, &state(10), &Config::default(), &weights(), OptimizerParts::whole(&tensors()))
            .unwrap();
        // What save() leaves when killed between renaming step-10 aside and the new one in.
        fs::rename(&ten, root.join(".tmp-old-step-00000010")).unwrap();
        fs::create_dir(root.join(".tmp-step-00000010")).unwrap();
        // A half-deleted checkpoint, and an old one whose step is back in place: both go.
        fs::create_dir(root.join(".tmp-del-step-00000005")).unwrap();
        save(&root, &state(20), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        fs::create_dir(root.join(".tmp-old-step-00000020")).unwrap();
        assert_eq!(list(&root).len(), 1);
        let found = clean_temporaries(&root);
        assert_eq!(found.restored, [10]);
        assert_eq!(found.removed.len(), 3, "{:?}", found.removed);
        assert_eq!(load_checkpoint(&ten).unwrap().state.step, 10, "complete, loads");
        assert_eq!(list(&root).iter().map(|(s, _)| *s).collect::<Vec<_>>(), [10, 20]);
        assert!(fs::read_dir(&root)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with(TMP_PREFIX)));
    }

    #[test]
    fn checkpoints_beyond_the_resumed_step_are_set_aside_whole() {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        for step in [10, 20, 30] {
            save(&root, &state(step), &Config::default(), &weights(), OptimizerParts::whole(&tensors()))
                .unwrap();
        }
        let ckpt = |step: u64| root.join(dir_name(step));
        assert_eq!(
            set_aside_after(&root, Some((30, &ckpt(30))), 1700000000).unwrap(),
            None,
            "nothing beyond the newest"
        );
        let (aside, steps) = set_aside_after(&root, Some((10, &ckpt(10))), 1700000000).unwrap().unwrap();
        assert_eq!(steps, [20, 30]);
        assert_eq!(aside, root.join("set-aside-1700000000"));
        assert_eq!(list(&root).iter().map(|(s, _)| *s).collect::<Vec<_>>(), [10]);
        assert_eq!(list(&aside).iter().map(|(s, _)| *s).collect::<Vec<_>>(), [20, 30], "moved, not deleted");
        assert!(load_checkpoint(&aside.join("step-00000030")).is_ok());
        save(&root, &state(20), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        let (again, steps) = set_aside_after(&root, None, 1700000000).unwrap().unwrap();
        assert_eq!(
            again,
            root.join("set-aside-1700000000-2"),
            "a second move in the same second gets its own directory"
        );
        assert_eq!(steps, [10, 20], "a fresh start continues no checkpoint");
        assert!(clean_temporaries(&root).removed.is_empty(), "set-aside directories are not leftovers");
    }

    /// A checkpoint resumed from elsewhere (a set-aside one, another run's) at a step this run's
    /// directory also has: that step's own checkpoint belongs to the line left, and stays.
    #[test]
    fn the_same_steps_checkpoint_is_set_aside_when_another_one_is_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let (root, elsewhere) = (root(dir.path()), dir.path().join("other"));
        for step in [10, 20] {
            save(&root, &state(step), &Config::default(), &weights(), OptimizerParts::whole(&tensors()))
                .unwrap();
        }
        let theirs =
            save(&elsewhere, &state(10), &Config::default(), &weights(), OptimizerParts::whole(&tensors()))
                .unwrap();
        let (aside, steps) = set_aside_after(&root, Some((10, &theirs)), 1700000000).unwrap().unwrap();
        assert_eq!(steps, [10, 20]);
        assert!(list(&root).is_empty(), "{:?}", list(&root));
        assert_eq!(list(&aside).len(), 2, "moved, not deleted");
        assert!(load_checkpoint(&theirs).is_ok(), "the checkpoint resumed stays where it is");
        // Named through another path (`./`, a symlinked directory), the resumed one is still the same.
        save(&root, &state(10), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        let roundabout = root.join("..").join("checkpoints").join(dir_name(10));
        assert_eq!(set_aside_after(&root, Some((10, &roundabout)), 1700000001).unwrap(), None);
    }

    fn consistent(state: &TrainerState, config: &Config, weights: &[(String, Tensor)]) -> Result<(), String> {
        state_agrees(state, config).and_then(|()| weights_agree(config, weights))
    }

    #[test]
    fn a_checkpoint_that_disagrees_with_its_own_config_is_corrupt_and_auto_passes_over_it() {
        let (dir, root, newest) = five_and_ten();
        let cfg = Config::default();
        let refused =
            |st: &TrainerState, cfg: &Config, w: &[(String, Tensor)]| consistent(st, cfg, w).unwrap_err();
        assert!(consistent(&state(10), &cfg, &weights()).is_ok());
        let zero_ranks = TrainerState { world_size: Some(0), ..state(10) };
        assert!(refused(&zero_ranks, &cfg, &weights()).contains("world_size 0"));
        let mut zero_micro = state(10);
        zero_micro.guard.accumulation = 0;
        assert!(refused(&zero_micro, &cfg, &weights()).contains("guard.accumulation 0"));
        assert!(refused(&TrainerState { elapsed_s: -4.0, ..state(10) }, &cfg, &weights())
            .contains("elapsed_s -4"));
        let scaled = |scale: f64| TrainerState {
            loss_scaler: Some(serde_json::json!({"scale": scale, "growth_tracker": 0})),
            ..state(10)
        };
        assert!(consistent(&scaled(65536.0), &cfg, &weights()).is_ok());
        for bad in [0.0, 1e308] {
            assert!(refused(&scaled(bad), &cfg, &weights()).contains("loss_scaler.scale"), "{bad}");
        }
        assert!(refused(&TrainerState { format: STATE_FORMAT + 1, ..state(10) }, &cfg, &weights())
            .contains("newer trainguard"));
        assert!(
            consistent(&TrainerState { world_size: None, ..state(10) }, &cfg, &weights()).is_ok(),
            "written before world_size"
        );
        let sgd =
            TrainerState { optimizer: OptimizerSnapshot { kind: "sgd".into(), steps: 10 }, ..state(10) };
        assert!(refused(&sgd, &cfg, &weights()).contains("optimizer `sgd`, its config.yaml names `adamw`"));
        let mut w = weights();
        let (name, _) = w.remove(3);
        assert!(refused(&state(10), &cfg, &w).contains(&format!("lacks `{name}`")));
        let mut w = weights();
        w[3].1 = Tensor::zeros([3, 5], (tch::Kind::Float, Device::Cpu));
        assert!(refused(&state(10), &cfg, &w).contains("has shape [3, 5]"));
        let mut w = weights();
        w[3].1 = w[3].1.to_kind(tch::Kind::Int64);
        assert!(refused(&state(10), &cfg, &w).contains("holds Int64, not floating point"));
        w[3].1 = w[3].1.to_kind(tch::Kind::BFloat16);
        assert!(consistent(&state(10), &cfg, &w).is_ok(), "a bf16-pure run's weights");
        let mut huge = cfg.clone();
        huge.model.n_layer = 1 << 40;
        assert!(refused(&state(10), &huge, &weights()).contains("1099511627776 blocks"));
        // A vocabulary matrix of the user's rows, written before model.pad_vocab_to: the resume
        // names that change (not corrupt).
        let mut padded = cfg.clone();
        padded.model.pad_vocab_to = 64;
        padded.model.vocab_size = 250;
        let w: Vec<(String, Tensor)> = crate::model::describe(&padded.model)
            .into_iter()
            .map(|s| (s.name.clone(), Tensor::zeros(s.user_shape(), (tch::Kind::Float, Device::Cpu))))
            .collect();
        assert!(consistent(&state(10), &padded, &w).is_ok());
        // On disk: the newest, its state edited by hand, is named and step 5 resumed.
        let path = newest.join(STATE_FILE);
        let mut edited: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        edited["world_size"] = 0.into();
        fs::write(&path, edited.to_string()).unwrap();
        // Refused by its state before its tensor files are read (here one is cut short too).
        let model = fs::read(newest.join(MODEL_FILE)).unwrap();
        fs::write(newest.join(MODEL_FILE), &model[..model.len() / 2]).unwrap();
        match load_checkpoint(&newest) {
            Err(CheckpointError::Corrupt { why, .. }) => assert!(why.contains("world_size 0"), "{why}"),
            other => panic!("loaded: {:?}", other.map(|l| l.path)),
        }
        let (found, skipped) = newest_valid(&root);
        assert_eq!((found.unwrap().state.step, skipped.len()), (5, 1));
        // A copy under another step's name is not that step; under a name of its own it loads.
        let five = root.join("step-00000005");
        let renamed = root.join("step-00000007");
        fs::rename(&five, &renamed).unwrap();
        assert!(
            matches!(load_checkpoint(&renamed), Err(CheckpointError::Corrupt { why, .. }) if why.contains("holds step 5, its directory names step 7"))
        );
        let copy = dir.path().join("mine");
        fs::rename(&renamed, &copy).unwrap();
        assert_eq!(load_checkpoint(&copy).unwrap().state.step, 5);
    }

    #[test]
    fn a_model_file_cut_short_or_holding_nan_is_refused_by_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MODEL_FILE);
        let w = weights();
        Tensor::write_safetensors(&w, &path).unwrap();
        assert_eq!(read_model_file(&path).unwrap().len(), w.len());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let why = read_model_file(&path).unwrap_err();
        assert!(why.starts_with("not a whole safetensors file (cut short, or another format)"), "{why}");
        let _ = w[1].1.get(0).f_fill_(f64::NAN).unwrap();
        Tensor::write_safetensors(&w, &path).unwrap();
        let why = read_model_file(&path).unwrap_err();
        assert!(
            why.contains(&format!("`{}` in model.safetensors holds", w[1].0))
                && why.contains("NaN or infinite"),
            "{why}"
        );
    }

    /// A model file that does not parse, its size and checksum stamped to match (a bug's
    /// write): said in the words every safetensors reader here uses.
    #[test]
    fn a_checkpoints_model_file_that_does_not_parse_is_named_as_not_whole() {
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        save(&root, &state(5), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        let ckpt = root.join("step-00000005");
        let size = fs::metadata(ckpt.join(MODEL_FILE)).unwrap().len() as usize;
        let garbage = vec![0xffu8; size];
        fs::write(ckpt.join(MODEL_FILE), &garbage).unwrap();
        let mut st: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(ckpt.join(STATE_FILE)).unwrap()).unwrap();
        st["checksums"][MODEL_FILE] = serde_json::json!(crc32c::crc32c(&garbage));
        fs::write(ckpt.join(STATE_FILE), st.to_string()).unwrap();
        match load_checkpoint(&ckpt) {
            Err(CheckpointError::Corrupt { why, .. }) => assert!(
                why.starts_with(
                    "model.safetensors: not a whole safetensors file (cut short, or another format)"
                ),
                "{why}"
            ),
            other => panic!("loaded: {:?}", other.map(|l| l.path)),
        }
    }

    /// NaN or ±inf in a weight or an optimizer moment, written with checksums that match: the
    /// checkpoint is corrupt, named with the tensor and the count, and `auto` passes over it.
    #[test]
    fn non_finite_values_in_a_checkpoint_make_it_corrupt() {
        assert!(finite(MODEL_FILE, &weights()).is_ok());
        let integer = vec![("codes".to_string(), Tensor::zeros([4], (tch::Kind::Uint8, Device::Cpu)))];
        assert!(finite(OPTIMIZER_FILE, &integer).is_ok(), "8-bit codes are not checked as numbers");
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let w = weights();
            let _ = w[2].1.get(0).f_fill_(bad).unwrap();
            let why = finite(MODEL_FILE, &w).unwrap_err();
            let expected = format!(
                "`{}` in model.safetensors holds {} of {} values that are NaN or infinite",
                w[2].0,
                w[2].1.size()[1..].iter().product::<i64>().max(1),
                w[2].1.numel()
            );
            assert!(why.starts_with(&expected), "{bad}: {why}");
            let bf16: Vec<(String, Tensor)> =
                w.iter().map(|(n, t)| (n.clone(), t.to_kind(tch::Kind::BFloat16))).collect();
            assert!(finite(MODEL_FILE, &bf16).is_err(), "{bad} in bf16");
        }
        let dir = tempfile::tempdir().unwrap();
        let root = root(dir.path());
        save(&root, &state(5), &Config::default(), &weights(), OptimizerParts::whole(&tensors())).unwrap();
        let mut moments = tensors();
        let _ = moments[0].1.f_fill_(f64::NAN).unwrap();
        save(&root, &state(10), &Config::default(), &weights(), OptimizerParts::whole(&moments)).unwrap();
        match load_checkpoint(&root.join("step-00000010")) {
            Err(CheckpointError::Corrupt { why, .. }) => {
                assert!(why.contains(&format!("`{}` in optimizer.safetensors holds", moments[0].0)), "{why}")
            }
            other => panic!("loaded: {:?}", other.map(|l| l.path)),
        }
        let (found, skipped) = newest_valid(&root);
        assert_eq!((found.unwrap().state.step, skipped.len()), (5, 1));
    }
}
