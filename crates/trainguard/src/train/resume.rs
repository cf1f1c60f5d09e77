//! Where a run starts: the state a checkpoint holds ([`TrainState`]: model, optimizer, loss
//! scaler, guard, counters), choosing and checking the checkpoint to resume from, and restoring
//! that state from it. Writing checkpoints on schedule is [`super::checkpointer`]'s.
use super::TrainError;
use crate::checkpoint::lineage;
use crate::checkpoint::state::*;
use crate::checkpoint::{compare, store, CheckpointError, Loaded};
use crate::config::Config;
use crate::guard::Guard;
use crate::optim::LrSchedule;
use crate::run_plan::RunPlan;
use crate::step::{LossScaler, Trainable};
use std::path::{Path, PathBuf};

/// Where a run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// From step 0.
    Fresh,
    /// From step 0, an earlier run's checkpoints in `out_dir` moved aside with its directory
    /// first (`--overwrite`).
    Overwrite,
    /// From the newest complete checkpoint in `out_dir`, else from step 0.
    Auto,
    /// From this checkpoint directory; failing to load it is an error.
    Path(PathBuf),
    /// From the newest complete checkpoint in `out_dir` if it is past this one's step, else from
    /// this one: a torchrun restart of a run that `--resume PATH` started (the path was for the
    /// job's first attempt; an older checkpoint in `out_dir` is another run's).
    AutoOr(PathBuf),
}

impl Resume {
    /// What the command asks: `--resume` (`auto`, `none`, a path; None when not given) and
    /// `--overwrite`. A process of the torchrun job that started the run in `out_dir`
    /// (`restart_of_its_run`, see [`crate::job::attempts`]) resumes that run whatever was asked:
    /// the command's choice was for how the job began, and a restart that started over (or from
    /// the older checkpoint named) would throw away, or refuse, what the job had trained.
    /// The second value is the log's account when a restart sets the command's choice aside.
    pub fn asked(resume: Option<&str>, overwrite: bool, restart_of_its_run: bool) -> (Self, Option<String>) {
        let first = match resume {
            Some("auto") => Self::Auto,
            Some("none") => Self::Fresh,
            Some(path) => Self::Path(path.into()),
            None if overwrite => Self::Overwrite,
            None => Self::Fresh,
        };
        if !restart_of_its_run || first == Self::Auto {
            return (first, None);
        }
        let what = match (&first, resume) {
            (Self::Path(p), _) => format!("--resume {}", p.display()),
            (Self::Overwrite, _) => "--overwrite".to_string(),
            (_, Some(r)) => format!("--resume {r}"),
            _ => "a fresh start (no --resume)".to_string(),
        };
        let (restart, from) = match first {
            Self::Path(p) => {
                let from = format!(
                    " from its newest checkpoint past {}'s step, else from that one again",
                    p.display()
                );
                (Self::AutoOr(p), from)
            }
            _ => (Self::Auto, String::new()),
        };
        (restart, Some(format!("a restart resumes it{from} ({what} was for the job's first attempt)")))
    }

    /// Whether this start may continue from a checkpoint.
    pub fn may_resume(&self) -> bool {
        matches!(self, Self::Auto | Self::Path(_) | Self::AutoOr(_))
    }
}

/// Counters that go into `trainer_state.json`.
#[derive(Debug, Clone, Default)]
pub(super) struct Progress {
    pub(super) micro_steps: u64,
    /// Tokens trained on over the whole run: summed step by step, since the global batch may
    /// change at a resume.
    pub(super) tokens_seen: u64,
    /// Of those, each mixture source's, by name (kept across changes of the mixture).
    pub(super) tokens_by_source: std::collections::BTreeMap<String, u64>,
    pub(super) best_val: Option<(f64, u64)>,
    pub(super) nonfinite_skips: u64,
    /// Non-finite updates in a row up to now (`nan.max_consecutive`).
    pub(super) nonfinite_streak: u64,
    pub(super) elapsed_before: f64,
    /// Other runs' checkpoints this run's line resumed from, oldest first.
    pub(super) lineage: Vec<lineage::Lineage>,
    /// The divergence guard's window, skipped data and rollbacks.
    pub(super) divergence: DivergenceRecord,
}

/// Everything a checkpoint saves and a resume restores.
pub(super) struct TrainState {
    pub(super) trainable: Trainable,
    pub(super) guard: Guard,
    pub(super) progress: Progress,
}

impl TrainState {
    /// Weights, optimizer state, loss scale, the guard's micro-batch, escalation and regrow
    /// history, and the counters, from checkpoint `l`. The guard's micro-batch comes back only
    /// while `train.micro_batch_size` is what the checkpoint's run configured: a new one is the
    /// user's choice, and the guard starts there (and halves again if it does not fit).
    /// `own_root`: this run's checkpoints directory; a checkpoint from elsewhere joins the
    /// lineage.
    pub(super) fn restore(&mut self, l: &Loaded, own_root: &Path) -> Result<(), CheckpointError> {
        restore(l, &mut self.trainable)?;
        if let (Some(s), Some(saved)) = (&mut self.trainable.scaler, l.state.loss_scaler.clone()) {
            if let Ok(saved) = serde_json::from_value::<LossScaler>(saved) {
                *s = saved;
            }
        }
        let g = &l.state.guard;
        let configured = self.guard.state.configured();
        // What regrow learnt (sizes that failed, the ladder climbed) is about the sizes of the
        // checkpoint's micro-batch: under another one it starts afresh, as the guard does.
        let (current, regrow) = match g.configured_micro_batch == configured {
            true => (g.micro_batch, g.regrow.clone()),
            false => (configured, Default::default()),
        };
        self.guard.state = self
            .guard
            .state
            .clone()
            .with_current(current)
            .with_regrow_memory(regrow)
            .with_level(g.escalation_level);
        self.progress = Progress {
            micro_steps: l.state.micro_steps,
            tokens_seen: l.state.tokens_seen,
            tokens_by_source: l.state.tokens_by_source.clone(),
            best_val: l.state.best_val_loss.zip(l.state.best_val_step),
            nonfinite_skips: l.state.nonfinite_skips,
            nonfinite_streak: l.state.nonfinite_streak,
            elapsed_before: l.state.elapsed_s,
            lineage: lineage::continued(&l.state.lineage, &l.path, l.state.step, own_root),
            divergence: l.state.divergence.clone().unwrap_or_default(),
        };
        Ok(())
    }
}

pub(super) fn corrupt_path(e: &CheckpointError) -> String {
    match e {
        CheckpointError::Corrupt { path, .. } | CheckpointError::Io { path, .. } => {
            path.display().to_string()
        }
        CheckpointError::Incompatible { path, .. } | CheckpointError::Save { path, .. } => {
            path.display().to_string()
        }
        CheckpointError::RunExists { out_dir, .. } => out_dir.display().to_string(),
        CheckpointError::RunNotCheckpoint { path }
        | CheckpointError::CheckpointsNotCheckpoint { path }
        | CheckpointError::Missing { path } => path.display().to_string(),
    }
}

/// Where a run starts, as [`resolve_resume`] found it.
#[derive(Default)]
pub(super) struct Start {
    pub(super) loaded: Option<Loaded>,
    /// The broken checkpoints `auto` passed over.
    pub(super) skipped: Vec<CheckpointError>,
    /// Steps whose checkpoint a killed replacement had left aside, put back.
    pub(super) restored: Vec<u64>,
}

/// The checkpoint to start from.
pub(super) fn resolve_resume(resume: &Resume, root: &Path, writer: bool) -> Result<Start, CheckpointError> {
    // Not a directory: no checkpoint would be found and none could be written, and the run would
    // go on from step 0 over the old run's final weights, with only a warning at each save.
    if root.exists() && !root.is_dir() && *resume != Resume::Overwrite {
        let source = std::io::Error::other("a file where the run keeps its checkpoints, a directory: move it away, or choose another out_dir");
        return Err(CheckpointError::Io { path: root.to_path_buf(), source });
    }
    match resume {
        Resume::Fresh => {
            if writer {
                crate::checkpoint::fresh::refuse_if_occupied(root)?; // another run's checkpoints: exit 2
            }
            Ok(Start::default())
        }
        Resume::Overwrite => Ok(Start::default()), // the directory was moved aside: nothing there
        Resume::Auto => Ok(newest(root, writer, None)),
        Resume::Path(p) if !p.join(store::STATE_FILE).exists() && store::root(p).is_dir() => {
            Err(CheckpointError::RunNotCheckpoint { path: p.clone() })
        }
        Resume::Path(p) if !p.join(store::STATE_FILE).exists() && !store::list(p).is_empty() => {
            Err(CheckpointError::CheckpointsNotCheckpoint { path: p.clone() })
        }
        Resume::Path(p) => Ok(Start { loaded: Some(store::load_checkpoint(p)?), ..Start::default() }),
        Resume::AutoOr(p) => {
            // The job's own checkpoints are past the step it began from (the first attempt set
            // aside any later one before the job was recorded); an older one is another run's.
            let began = store::load_state(p)?.step;
            match newest(root, writer, Some(began)) {
                Start { loaded: None, skipped, restored } => {
                    Ok(Start { skipped, restored, ..resolve_resume(&Resume::Path(p.clone()), root, writer)? })
                }
                own => Ok(own),
            }
        }
    }
}

/// The newest complete checkpoint in `root` (past step `past`), after the writer has cleaned
/// up what a killed writer left.
fn newest(root: &Path, writer: bool, past: Option<u64>) -> Start {
    let restored = if writer { store::clean_temporaries(root).restored } else { vec![] };
    let (loaded, skipped) = store::newest_valid_past(root, past);
    Start { loaded, skipped, restored }
}

/// What a resumed run moved out of its way in `out_dir`; nothing is deleted.
#[derive(Default)]
pub(super) struct LeftBehind {
    /// Checkpoints of a line the run left (beyond the step resumed, or of that step but not the
    /// one resumed; every one for a fresh start): the directory
    /// they went to, and their steps.
    pub checkpoints: Option<(PathBuf, Vec<u64>)>,
    /// The run's final weights, older than every checkpoint this run will write: where they went.
    pub final_weights: Option<PathBuf>,
}

/// What a run (resumed at `resumed`, None for a fresh start) moves out of its way in `out_dir`
/// (rank 0): checkpoints of the line it leaves into `root/set-aside-<time>/`; and, when it
/// will train, the final weights there, which `sample` and `export` of the run directory read
/// first, to `model.set-aside-<time>.safetensors` beside them (the same directory, so the same
/// file system). Nothing is deleted: where the newest checkpoint was corrupt and passed over,
/// those weights are the only copy of its step; where every checkpoint was, or they were
/// removed, a fresh start would otherwise write over the only copy of the run's model.
pub(super) fn leave_the_old_line(
    out_dir: &Path,
    root: &Path,
    resumed: Option<(u64, &Path)>,
    max_steps: u64,
) -> Result<LeftBehind, TrainError> {
    let now = crate::job::deadline::now_unix_s() as u64;
    let checkpoints = store::set_aside_after(root, resumed, now)?;
    let stale = out_dir.join(crate::checkpoint::WEIGHTS_FILE);
    let mut final_weights = None;
    if resumed.map_or(0, |(step, _)| step) < max_steps && stale.exists() {
        let to = store::free_path(format!("{}/model.set-aside-{now}.safetensors", out_dir.display()), |p| {
            p.exists()
        });
        std::fs::rename(&stale, &to)
            .map_err(|source| TrainError::RunDirFile { file: stale.clone(), source })?;
        final_weights = Some(to);
    }
    Ok(LeftBehind { checkpoints, final_weights })
}

/// The learning rate a changed schedule (`max_steps`, `lr`, warmup) gives the step resumed,
/// against the checkpoint's: a longer run can send it back up.
fn schedule_change(l: &Loaded, plan: &RunPlan) -> Option<String> {
    let step = l.state.step;
    let (before, now) = (LrSchedule::from_config(&l.config.train).at(step), plan.schedule.at(step));
    (before != now).then(|| {
        format!(
            "learning rate at step {step}: {before:.4e} on the checkpoint's schedule, {now:.4e} on this one"
        )
    })
}

/// Another number of ranks than the checkpoint's, said with each rank's share of the global
/// batch (the checkpoint's and this run's). Where the global batch is the same, so are each
/// step's samples (each rank takes its share of them): the update is the same sum in another
/// order; with dropout, the masks are drawn per micro-batch and differ.
fn ranks_change(saved: Option<usize>, now: usize, saved_global: usize, global: usize) -> Option<String> {
    let saved = saved.filter(|&s| s != now)?;
    let share = |g: usize, n: usize| {
        if g.is_multiple_of(n) {
            format!("{}", g / n)
        } else {
            format!("{}-{}", g / n, g.div_ceil(n))
        }
    };
    let samples = if saved_global == global {
        format!("the global batch of {global} and each step's samples stay the same")
    } else {
        format!("the global batch changed too, {saved_global} to {global}")
    };
    Some(format!(
        "ranks: checkpoint {saved}, now {now} ({samples}: {} per rank, {} before)",
        share(global, now),
        share(saved_global, saved)
    ))
}

/// What changed since checkpoint `l` was written, in the order said: the config's safe
/// changes and the data's ([`check_compatible`], which refuses the rest), the learning rate at
/// the step resumed, the number of ranks, the mixture's weights.
pub(super) fn changed_since(
    l: &Loaded,
    plan: &RunPlan,
    data: &DataRecord,
) -> Result<Vec<String>, CheckpointError> {
    let (cfg, t) = (&plan.config, &plan.config.train);
    let mut changed = check_compatible(l, cfg, data)?;
    changed.extend(schedule_change(l, plan));
    changed.extend(ranks_change(
        l.state.world_size,
        plan.world_size,
        l.config.train.global_batch_size,
        t.global_batch_size,
    ));
    changed.extend(mixture_change(&l.config.data, &cfg.data));
    Ok(changed)
}

/// The resumed run's mixture against its checkpoint's, when either is one.
fn mixture_change(then: &crate::config::DataConfig, now: &crate::config::DataConfig) -> Option<String> {
    if then.sources.is_empty() && now.sources.is_empty() {
        return None;
    }
    crate::data::mixture::weights_change(&then.weighted(), &now.weighted())
}

/// Refuses a checkpoint whose model differs from the config; returns the safe changes.
fn check_compatible(l: &Loaded, cfg: &Config, data: &DataRecord) -> Result<Vec<String>, CheckpointError> {
    let (mut model, mut other) = compare::differences(&l.config, cfg);
    match data_change(l.state.data.as_ref(), data, l.state.step) {
        Some(DataChange::Tokenizer(why)) => model.push(why),
        Some(DataChange::Tokens(note)) => other.push(note),
        None => {}
    }
    if !model.is_empty() {
        return Err(CheckpointError::Incompatible { path: l.path.clone(), differences: model });
    }
    Ok(other)
}

enum DataChange {
    /// Another tokenizer: the checkpoint's ids would mean other text (refused).
    Tokenizer(String),
    /// Other tokens under the same source and tokenizer (more shards, say): said, allowed.
    Tokens(String),
}

/// How the data a run resumes on differs from what its checkpoint of `step` trained on.
fn data_change(then: Option<&DataRecord>, now: &DataRecord, step: u64) -> Option<DataChange> {
    let then = then?;
    if let Some((a, b)) = then.tokenizer_crc32c.zip(now.tokenizer_crc32c).filter(|(a, b)| a != b) {
        return Some(DataChange::Tokenizer(format!(
            "data.source `{}`: its tokenizer.json is not the one step {step} trained with (CRC-32C {b:08x}, {a:08x} then; re-prepared in place?), so its ids would mean other text: give data.source the dataset the run trained on, or start a new run from these weights (export --hf, then init_from)",
            now.source
        )));
    }
    // A changed data.source is named by the config's comparison already.
    let moved = then.train_tokens != now.train_tokens || then.train_digest != now.train_digest;
    (then.source == now.source && moved).then(|| {
        DataChange::Tokens(format!("data.source `{}`: its training tokens are not those step {step} trained on ({} tokens then, {} now)", now.source, then.train_tokens, now.train_tokens))
    })
}

fn restore(l: &Loaded, t: &mut Trainable) -> Result<(), CheckpointError> {
    let (model, opt) = (&t.model, &mut t.opt);
    let corrupt = |why: String| CheckpointError::Corrupt { path: l.path.clone(), why };
    let _no_grad = tch::no_grad_guard();
    for (i, (name, p)) in model.params.names.iter().zip(&model.params.tensors).enumerate() {
        // `store::load_checkpoint` found each weight of the checkpoint's model in its shape, or with the
        // user's rows where written before model.pad_vocab_to; that model is this run's
        // (`check_compatible`). So a weight of another shape is the latter, whose optimizer
        // state is unpadded too.
        let Some(src) = l.weights.iter().find(|(n, t)| n == name && t.size() == p.size()).map(|(_, t)| t)
        else {
            let why = format!(
                "model.pad_vocab_to: checkpoint 1 (`{name}` has the unpadded {:?}), config {}",
                model.user_shape(i),
                model.cfg.pad_vocab_to
            );
            return Err(CheckpointError::Incompatible { path: l.path.clone(), differences: vec![why] });
        };
        p.shallow_clone().f_copy_(src).map_err(|e| corrupt(e.to_string()))?;
    }
    // Each saved state tensor is named for its parameter, whichever rank wrote it: a run takes
    // its own parameters' from a checkpoint of any world size and `dist.shard` level.
    let names = t.layout.state_names(&model.params.names);
    opt.load_state(&names, &l.optimizer, l.state.optimizer.steps).map_err(corrupt)?;
    t.layout.refresh_host(model).map_err(|e| corrupt(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_tokenizer_is_refused_and_other_tokens_are_said() {
        let then = DataRecord {
            source: "tokens:data".into(),
            tokenizer_crc32c: Some(7),
            train_tokens: 100,
            train_digest: "ab".into(),
        };
        assert!(data_change(Some(&then), &then, 5).is_none());
        assert!(data_change(None, &then, 5).is_none(), "a checkpoint from before the record");
        let retokenized = DataRecord { tokenizer_crc32c: Some(8), ..then.clone() };
        let Some(DataChange::Tokenizer(why)) = data_change(Some(&then), &retokenized, 5) else {
            panic!("not refused")
        };
        assert!(why.contains("not the one step 5 trained with (CRC-32C 00000008, 00000007 then"), "{why}");
        let more = DataRecord { train_tokens: 150, train_digest: "cd".into(), ..then.clone() };
        let Some(DataChange::Tokens(note)) = data_change(Some(&then), &more, 5) else { panic!("not said") };
        assert!(note.contains("100 tokens then, 150 now"), "{note}");
        // Another source is the config comparison's to name; without a tokenizer nothing to compare.
        assert!(data_change(Some(&then), &DataRecord { source: "tokens:other".into(), ..more.clone() }, 5)
            .is_none());
        assert!(data_change(Some(&then), &DataRecord { tokenizer_crc32c: None, ..then.clone() }, 5).is_none());
    }

    #[test]
    fn a_file_where_the_checkpoints_go_is_refused_unless_the_run_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let root = store::root(dir.path());
        std::fs::write(&root, b"not a directory").unwrap();
        for resume in [Resume::Auto, Resume::Fresh, Resume::AutoOr(root.join("step-00000002"))] {
            let err = resolve_resume(&resume, &root, true).err().unwrap().to_string();
            assert!(err.contains("a file where the run keeps its checkpoints"), "{resume:?}: {err}");
        }
        assert!(resolve_resume(&Resume::Overwrite, &root, true).is_ok());
        std::fs::remove_file(&root).unwrap();
        assert!(resolve_resume(&Resume::Auto, &root, true).unwrap().loaded.is_none());
    }

    #[test]
    fn a_restart_of_the_job_that_started_the_run_resumes_it_whatever_was_asked() {
        let path = || PathBuf::from("old/checkpoints/step-00000010");
        let p = "old/checkpoints/step-00000010";
        // The first attempt (or another job's process): what the command asked, nothing to say.
        for (resume, overwrite, first) in [
            (None, false, Resume::Fresh),
            (Some("none"), false, Resume::Fresh),
            (Some("auto"), false, Resume::Auto),
            (Some(p), false, Resume::Path(path())),
            (None, true, Resume::Overwrite),
        ] {
            assert_eq!(Resume::asked(resume, overwrite, false), (first, None), "{resume:?} {overwrite}");
        }
        // A restart of its own run: that run, never a fresh start, the old run moved aside, or
        // the older checkpoint the job began from (unless the run has none yet); the log says
        // which choice was set aside, unless it was that run's own `auto`.
        assert_eq!(Resume::asked(Some("auto"), false, true), (Resume::Auto, None));
        for (resume, overwrite, set_aside) in [
            (None, false, "a fresh start (no --resume)"),
            (Some("none"), false, "--resume none"),
            (None, true, "--overwrite"),
        ] {
            let (restart, note) = Resume::asked(resume, overwrite, true);
            assert_eq!(restart, Resume::Auto, "{resume:?} {overwrite}");
            assert_eq!(
                note.unwrap(),
                format!("a restart resumes it ({set_aside} was for the job's first attempt)")
            );
        }
        let (restart, note) = Resume::asked(Some(p), false, true);
        assert_eq!(restart, Resume::AutoOr(path()));
        assert_eq!(note.unwrap(), format!("a restart resumes it from its newest checkpoint past {p}'s step, else from that one again (--resume {p} was for the job's first attempt)"));
    }

    #[test]
    fn another_rank_count_than_the_checkpoints_is_said_with_each_ranks_share() {
        assert_eq!(ranks_change(Some(2), 2, 64, 64), None);
        assert_eq!(ranks_change(None, 4, 64, 64), None, "a checkpoint from before the count was kept");
        assert_eq!(
            ranks_change(Some(1), 2, 64, 64).as_deref(),
            Some("ranks: checkpoint 1, now 2 (the global batch of 64 and each step's samples stay the same: 32 per rank, 64 before)")
        );
        assert!(ranks_change(Some(2), 3, 64, 64).unwrap().contains(": 21-22 per rank, 32 before)"));
        assert_eq!(
            ranks_change(Some(1), 2, 32, 64).as_deref(),
            Some(
                "ranks: checkpoint 1, now 2 (the global batch changed too, 32 to 64: 32 per rank, 32 before)"
            )
        );
    }
}
