//! The OOM guard. [`classify`] decides whether an error is an out-of-memory (one function, one
//! place); [`policy`] decides what to do next (pure: halve, back off, give up, regrow);
//! [`Guard::run`] acts: it runs an attempt, lets everything the attempt held be dropped, empties
//! the allocator cache, and replays the same step at the micro-batch the policy chose. At an
//! out-of-memory it also asks [`leak`] whether memory held between steps grew (then one halving at
//! most in one process: a leak is not fixed by a smaller micro-batch), and writes the allocator snapshot
//! (`memory.snapshot_on_oom`). An op that `deterministic: true` forbids ends the run, named.
//! A libtorch error that tch raises as a panic is turned back into that error first
//! ([`crate::ffi::torch_panics`]).
mod classify;
mod leak;
mod policy;

pub use crate::events::LeakDiagnosis;
pub use classify::{classify, nondeterministic_op, ErrorKind};
pub use leak::HeldMemory;
pub use policy::{BlockedSize, Decision, GuardState, RegrowMemory};

use crate::config::OomPolicy;
use crate::events::{Event, OomRecovery, Reporter};
use crate::ffi::torch_panics::catch_torch_panics;
use crate::memory::{self, MemorySnapshot};
use std::time::{Duration, Instant};
use tch::{Device, TchError};

/// An out-of-memory the guard could not recover from.
#[derive(Debug, Clone)]
pub struct OomFailure {
    /// The loop's index of the step (its texts say step `index + 1`); none while setting up.
    pub step: Option<u64>,
    pub micro_batch: usize,
    pub requested_bytes: Option<u64>,
    pub memory: MemorySnapshot,
    pub message: String,
    /// Memory held between steps grew since the first steps (see [`leak`]).
    pub leak: Option<LeakDiagnosis>,
    /// Why no smaller micro-batch was tried.
    pub gave_up: GaveUp,
}

/// Why the guard did not retry an out-of-memory at a smaller micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GaveUp {
    /// At `oom.min_micro_batch` (escalations spent).
    AtFloor,
    /// `oom.policy: fail` or `off`.
    Policy(OomPolicy),
    /// Outside any step: building the model, optimizer or data-parallel buckets.
    SettingUp,
}

impl OomFailure {
    /// What to tell a person whose run could not fit even the smallest micro-batch.
    pub fn advice(&self) -> String {
        if let Some(leak) = &self.leak {
            return self.leak_advice(leak);
        }
        let asked = self
            .requested_bytes
            .map(|b| format!(", asking for {}", crate::memory::human(b)))
            .unwrap_or_default();
        let mem = match (self.memory.allocated_bytes, self.memory.reserved_bytes) {
            (Some(a), Some(r)) => {
                format!("{} allocated, {} reserved", crate::memory::human(a), crate::memory::human(r))
            }
            _ => "memory figures unavailable".into(),
        };
        let (what, first_change) = match (self.gave_up, self.step) {
            (GaveUp::SettingUp, _) | (_, None) => (
                format!("out of memory while setting up (the model's weights, the optimizer's state, buffers){asked}: before any step, so no micro-batch can help"),
                "- a smaller model (model.n_layer, model.n_embd) or vocabulary (model.vocab_size)",
            ),
            (GaveUp::Policy(p), Some(s)) => (
                format!("out of memory at step {} at micro-batch {}{asked}; oom.policy is {}, so no smaller micro-batch was tried", s + 1, self.micro_batch, format!("{p:?}").to_lowercase()),
                "- oom.policy: adapt (the default): halve the micro-batch, double accumulation, replay the same samples",
            ),
            (GaveUp::AtFloor, Some(s)) => (
                format!("out of memory at step {} at micro-batch {}{asked}; nothing smaller is allowed (oom.min_micro_batch)", s + 1, self.micro_batch),
                "- a shorter sequence (model.seq_len): activations and logits grow with it",
            ),
        };
        let mut changes = vec![
            first_change,
            "- a smaller model (model.n_layer, model.n_embd) or vocabulary (model.vocab_size)",
            "- a larger memory.limit or a device with more memory",
            "- `trainguard plan --config <file>` to see what fits, or `--profile` to measure it",
        ];
        changes.dedup();
        format!(
            "{what}.\nmemory after freeing the failed attempt: {mem}\nfirst line of the error: {}\nwhat to change:\n{}",
            first_line(&self.message),
            changes.join("\n")
        )
    }
}

impl OomFailure {
    /// A leak: halving cannot fix it, so the advice is about what keeps tensors alive.
    fn leak_advice(&self, leak: &LeakDiagnosis) -> String {
        let at = self.step.map_or("while setting up".to_string(), |s| format!("at step {}", s + 1));
        format!(
            "out of memory {at} at micro-batch {}: {}.\n\
             held between steps: {} after step {}, {} now. A smaller micro-batch cannot give that memory back, \
             so the guard does not spend the halvings down to oom.min_micro_batch on it.\n\
             first line of the error: {}\n\
             what to change:\n\
             - find what keeps tensors from one step to the next: a loss, logits or outputs stored without \
             .detach() (or .item()), a list or cache that only grows\n\
             - memory.leak_check_steps warns about steady growth before memory runs out",
            self.micro_batch,
            leak.message,
            crate::memory::human(leak.baseline_bytes),
            leak.baseline_step,
            crate::memory::human(leak.held_bytes),
            first_line(&self.message)
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("out of memory at micro-batch {}: {}", .0.micro_batch, first_line(&.0.message))]
    OutOfMemory(Box<OomFailure>),
    #[error("libtorch error {at}: {error}")]
    Torch { error: TchError, at: String },
    /// `deterministic: true` met an op libtorch has no deterministic implementation of.
    #[error("deterministic: true, but {op} has no deterministic implementation in libtorch ({at}); set deterministic: false to run it, or avoid the op")]
    NotDeterministic { op: String, at: String },
    #[error(transparent)]
    Fatal(Box<dyn std::error::Error + Send + Sync>),
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// Why an attempt failed.
#[derive(Debug)]
pub enum StepError {
    /// A libtorch error on this rank (out-of-memory or not: [`classify`] decides).
    Torch(TchError),
    /// This rank was fine but another rank ran out of memory: all ranks replay together.
    PeerOutOfMemory,
    /// A rank ran out of memory with nothing left to try (at its floor, escalations spent): every
    /// rank gives up together, rather than some replaying into a collective the others never
    /// reach. `own`: this rank's own out-of-memory message, when it had one.
    GroupOutOfMemory { own: Option<String> },
    /// Anything else that must end the run (a failed collective, …), already typed.
    Fatal(Box<dyn std::error::Error + Send + Sync>),
}

impl From<TchError> for StepError {
    fn from(e: TchError) -> Self {
        StepError::Torch(e)
    }
}

/// Progress of one attempt, so the guard can time recovery to the first micro-step that
/// succeeds after a failure.
#[derive(Debug, Default)]
pub struct Progress {
    first_micro_done: Option<Instant>,
    level: usize,
    last_resort: bool,
}

impl Progress {
    /// How many of `oom.escalate`'s memory savers this attempt must switch on.
    pub fn escalation_level(&self) -> usize {
        self.level
    }

    /// An out-of-memory in this attempt would end the run (at the floor, escalations spent, or
    /// the policy does not adapt): what this rank tells its peers when they agree.
    pub fn last_resort(&self) -> bool {
        self.last_resort
    }

    pub fn micro_step_done(&mut self) {
        self.first_micro_done.get_or_insert_with(Instant::now);
    }
}

/// Totals the run summary reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardTotals {
    /// Out-of-memory errors recovered from, by a smaller micro-batch or by `escalations`.
    pub recoveries: u64,
    /// Those recovered by switching on a memory saver of `oom.escalate`.
    pub escalations: u64,
    pub time_lost: Duration,
    /// Time spent in the guard itself on steps that succeeded, outside the attempts: its cost.
    pub bookkeeping: Duration,
}

pub struct Guard {
    pub state: GuardState,
    escalate: Vec<crate::config::Escalation>,
    policy: OomPolicy,
    device: Device,
    rank_batch: usize,
    pub totals: GuardTotals,
    held: HeldMemory,
    /// A leak was found at an earlier out-of-memory and the micro-batch halved for it.
    halved_for_leak: bool,
    /// One of several ranks: see [`Guard::data_parallel`].
    data_parallel: bool,
    snapshot: SnapshotTarget,
    /// The micro-batch evaluation settled on after an out-of-memory of its own (see
    /// [`Guard::run_evaluation`]); none until one.
    eval_micro_batch: Option<usize>,
    /// Inside [`Guard::run_evaluation`]: its recoveries say so.
    evaluating: bool,
}

/// Where `memory.snapshot_on_oom` writes, and what it has written.
#[derive(Debug, Default)]
struct SnapshotTarget {
    /// The run directory, when this rank records the allocator's history.
    dir: Option<std::path::PathBuf>,
    /// Asked for but nothing to record (CPU): said once, at the first out-of-memory.
    unavailable: bool,
    first_written: bool,
}

/// An error met with no retry (outside any step, or with the guard off): an out-of-memory is
/// still reported as one.
pub fn unrecovered(err: TchError, step: Option<u64>, micro_batch: usize, device: Device) -> GuardError {
    let message = err.to_string();
    match classify(&message) {
        ErrorKind::OutOfMemory { requested_bytes } => GuardError::OutOfMemory(Box::new(OomFailure {
            step,
            micro_batch,
            requested_bytes,
            memory: memory::snapshot(device),
            message,
            leak: None,
            // Inside a step only with the guard off (`Guard::run`).
            gave_up: if step.is_some() { GaveUp::Policy(OomPolicy::Off) } else { GaveUp::SettingUp },
        })),
        ErrorKind::Other => other_error(err, &message, step),
    }
}

/// A libtorch error that is not an out-of-memory: named when deterministic mode refused an op.
fn other_error(err: TchError, message: &str, step: Option<u64>) -> GuardError {
    // `step`: the loop's index; a run reports steps counted from 1.
    let at = step.map_or("while setting up".into(), |s| format!("at step {}", s + 1));
    match nondeterministic_op(message) {
        Some(op) => GuardError::NotDeterministic { op, at },
        None => GuardError::Torch { error: err, at },
    }
}

const PEER_OOM: &str = "out of memory on another rank (this rank's attempt succeeded)";
const PEER_OOM_AT_FLOOR: &str =
    "out of memory on another rank with nothing left to try there (this rank's attempt succeeded)";

fn peer_oom(step: u64, micro_batch: usize, device: Device, message: &str) -> GuardError {
    GuardError::OutOfMemory(Box::new(OomFailure {
        step: Some(step),
        micro_batch,
        requested_bytes: None,
        memory: memory::snapshot(device),
        message: message.into(),
        leak: None,
        gave_up: GaveUp::Policy(OomPolicy::Off),
    }))
}

impl Guard {
    pub fn new(state: GuardState, policy: OomPolicy, device: Device, rank_batch: usize) -> Self {
        Self {
            state,
            escalate: Vec::new(),
            policy,
            device,
            rank_batch,
            totals: GuardTotals::default(),
            held: HeldMemory::default(),
            halved_for_leak: false,
            data_parallel: false,
            snapshot: SnapshotTarget::default(),
            eval_micro_batch: None,
            evaluating: false,
        }
    }

    /// Whether an out-of-memory now would end the run rather than be replayed smaller.
    fn at_last_resort(&self) -> bool {
        match self.policy {
            OomPolicy::Adapt => self.state.gives_up_on_oom(),
            OomPolicy::Fail | OomPolicy::Off => true,
        }
    }

    /// Why an out-of-memory that ends the run was not retried smaller: the floor under `adapt`,
    /// else the policy.
    fn gave_up(&self) -> GaveUp {
        match self.policy {
            OomPolicy::Adapt => GaveUp::AtFloor,
            policy => GaveUp::Policy(policy),
        }
    }

    /// Evaluation inside the guard, apart from what training learnt: an out-of-memory in
    /// evaluation halves evaluation's own micro-batch (kept for the evaluations after it), never
    /// training's, and an evaluation is not a clean training step for regrow. Training's state
    /// comes back as it was whatever evaluation met.
    pub fn run_evaluation<T>(
        &mut self,
        step: u64,
        reporter: &mut Reporter,
        attempt: impl FnMut(usize, &mut Progress) -> Result<T, StepError>,
    ) -> Result<T, GuardError> {
        let training = self.state.clone();
        let micro = self.eval_micro_batch.map_or(training.current(), |m| m.min(training.current()));
        self.state = training.clone().with_current(micro);
        self.evaluating = true;
        let result = self.run(step, reporter, attempt);
        self.evaluating = false;
        if result.is_ok() && self.state.current() < training.current() {
            self.eval_micro_batch = Some(self.state.current());
        }
        self.state = training;
        result
    }

    /// One rank of several. Each rank measures its own memory, so a leak can be found on one
    /// rank and not on another: stopping on it would end that rank while its peers replay and
    /// wait for it. With peers a leak is named at every out-of-memory, but the ranks go on
    /// halving together, as the policy alone decides, and stop together at the floor.
    pub fn data_parallel(mut self, on: bool) -> Self {
        self.data_parallel = on;
        self
    }

    /// `memory.snapshot_on_oom`: `recording` when the allocator's history is being recorded
    /// (rank 0 on CUDA, [`memory::oom_snapshot::start`]); otherwise, if `asked`, the first
    /// out-of-memory logs that there is nothing to write.
    pub fn with_oom_snapshot(mut self, asked: bool, recording: bool, dir: std::path::PathBuf) -> Self {
        self.snapshot = SnapshotTarget {
            dir: recording.then_some(dir),
            unavailable: asked && !recording,
            first_written: false,
        };
        self
    }

    /// Memory held once `step` steps are done (the leak detector's figure): what an
    /// out-of-memory later compares with.
    pub fn held_between_steps(&mut self, step: u64, bytes: Option<u64>) {
        if let Some(b) = bytes {
            self.held.between_steps(step, b);
        }
    }

    /// The snapshot for this out-of-memory: the first recovered one and an unrecoverable one.
    fn write_snapshot(&mut self, fatal: bool) {
        if std::mem::take(&mut self.snapshot.unavailable) {
            let device = format!("{:?}", self.device).to_lowercase();
            tracing::info!(
                "memory.snapshot_on_oom: no allocator history to write on {device} (CUDA only): no snapshot"
            );
        }
        let Some(dir) = &self.snapshot.dir else { return };
        if !fatal && self.snapshot.first_written {
            return;
        }
        self.snapshot.first_written = true;
        match memory::oom_snapshot::write(dir) {
            Ok(path) => tracing::warn!("allocator snapshot at the out-of-memory: {} (open it at https://pytorch.org/memory_viz; summary in {})", path.display(), memory::oom_snapshot::SUMMARY),
            Err(e) => tracing::warn!("memory.snapshot_on_oom: {e}"),
        }
    }

    /// The memory savers to switch on, in order, at the floor (oom.escalate).
    pub fn with_escalation(mut self, escalate: Vec<crate::config::Escalation>) -> Self {
        self.state = self.state.with_escalations(escalate.len());
        self.escalate = escalate;
        self
    }

    pub fn micro_batch(&self) -> usize {
        self.state.current()
    }

    pub fn accumulation(&self) -> usize {
        crate::data::batch::micro_steps(self.rank_batch, self.state.current())
    }

    /// Called once before each optimizer step: lets the policy try a larger micro-batch.
    pub fn begin_step(&mut self, step: u64, reporter: &mut Reporter) {
        let from = self.state.current();
        if let Some(to) = self.state.begin_step(step) {
            reporter.emit(Event::RegrowAttempt { step, from_micro_batch: from, to_micro_batch: to });
        }
    }

    /// Runs `attempt(micro_batch, progress)` until it succeeds, replaying it at a smaller
    /// micro-batch after each out-of-memory. The attempt must be a pure function of the micro-
    /// batch (same samples, same state) and must leave no side effect behind when it fails.
    pub fn run<T>(
        &mut self,
        step: u64,
        reporter: &mut Reporter,
        mut attempt: impl FnMut(usize, &mut Progress) -> Result<T, StepError>,
    ) -> Result<T, GuardError> {
        if self.policy == OomPolicy::Off {
            let micro = self.state.current();
            let mut progress =
                Progress { first_micro_done: None, level: self.state.level(), last_resort: true };
            return catch_torch_panics(|| attempt(micro, &mut progress)).map_err(|e| match e {
                StepError::Torch(e) => unrecovered(e, Some(step), micro, self.device),
                StepError::PeerOutOfMemory => peer_oom(step, micro, self.device, PEER_OOM),
                StepError::GroupOutOfMemory { own } => {
                    peer_oom(step, micro, self.device, own.as_deref().unwrap_or(PEER_OOM_AT_FLOOR))
                }
                StepError::Fatal(e) => GuardError::Fatal(e),
            });
        }
        // Recoveries waiting for the first micro-step that succeeds after them.
        let mut pending: Vec<(OomRecovery, Instant)> = Vec::new();
        let entered = Instant::now();
        let mut in_attempts = Duration::ZERO;
        loop {
            let micro = self.state.current();
            let mut progress = Progress {
                first_micro_done: None,
                level: self.state.level(),
                last_resort: self.at_last_resort(),
            };
            let started = Instant::now();
            // Everything the attempt allocated (activations, losses, partial gradients) is owned
            // inside it and dropped when it returns: the error below holds only a message. A
            // libtorch error tch raised as a panic is caught and comes back as that error.
            let outcome = catch_torch_panics(|| attempt(micro, &mut progress));
            in_attempts += started.elapsed();
            if let Some(done) = progress.first_micro_done.or_else(|| outcome.is_ok().then(Instant::now)) {
                for (mut rec, failed_at) in pending.drain(..) {
                    rec.recover_ms = done.duration_since(failed_at).as_secs_f64() * 1e3;
                    reporter.emit(Event::OomRecovered(rec));
                }
            }
            let err = match outcome {
                Ok(v) => {
                    self.state.on_success();
                    if pending.is_empty() && self.totals.recoveries == 0 {
                        self.totals.bookkeeping += entered.elapsed().saturating_sub(in_attempts);
                    }
                    return Ok(v);
                }
                Err(e) => e,
            };
            let failed_at = Instant::now();
            let (message, requested_bytes, own) = match err {
                StepError::Torch(e) => {
                    let message = e.to_string();
                    let ErrorKind::OutOfMemory { requested_bytes } = classify(&message) else {
                        return Err(other_error(e, &message, Some(step)));
                    };
                    (message, requested_bytes, true)
                }
                StepError::PeerOutOfMemory => (PEER_OOM.to_string(), None, false),
                StepError::GroupOutOfMemory { own } => {
                    // The group gives up together: what this rank's own policy says no longer matters.
                    for (rec, _) in pending.drain(..) {
                        reporter.emit(Event::OomRecovered(rec));
                    }
                    let message = own.unwrap_or_else(|| PEER_OOM_AT_FLOOR.to_string());
                    return Err(GuardError::OutOfMemory(Box::new(OomFailure {
                        step: Some(step),
                        micro_batch: micro,
                        requested_bytes: None,
                        memory: memory::snapshot(self.device),
                        message,
                        leak: None,
                        gave_up: self.gave_up(),
                    })));
                }
                StepError::Fatal(e) => return Err(GuardError::Fatal(e)),
            };
            if !own && self.at_last_resort() {
                // A peer ran out of memory and will replay smaller; this rank's attempt succeeded
                // and it has nothing smaller to go to (its own micro-batch may differ): it
                // replays as it is, rather than giving up on an out-of-memory that was not its own.
                tracing::info!(
                    "step {}: another rank ran out of memory; replaying the step at this rank's micro-batch {micro}",
                    step + 1
                );
                self.totals.time_lost += started.elapsed();
                continue;
            }
            let before = memory::snapshot(self.device);
            memory::empty_cache(self.device);
            memory::reset_peaks(self.device);
            let after = memory::snapshot(self.device);
            let leak = self.held.diagnose(after.allocated_bytes);
            let decision = match self.policy {
                // A leak found again after one halving for it: more halvings cannot help.
                OomPolicy::Adapt if leak.is_some() && self.halved_for_leak && !self.data_parallel => {
                    Decision::GiveUp
                }
                OomPolicy::Adapt => self.state.on_oom(step),
                OomPolicy::Fail | OomPolicy::Off => Decision::GiveUp,
            };
            if own {
                self.write_snapshot(!matches!(decision, Decision::Retry { .. } | Decision::Escalate { .. }));
            }
            // The failed attempt's work is lost, and so is the time spent recovering.
            self.totals.time_lost += started.elapsed();
            if let Decision::Escalate { level } = decision {
                // The halvings that led here never recovered: said first, in the order they came.
                for (rec, _) in pending.drain(..) {
                    reporter.emit(Event::OomRecovered(rec));
                }
                let (switched_on, effect) = self
                    .escalate
                    .get(level - 1)
                    .map(|e| (e.name().to_string(), e.effect().to_string()))
                    .unwrap_or_default();
                reporter.emit(Event::OomEscalated { step, micro_batch: micro, level, switched_on, effect });
                self.totals.recoveries += 1;
                self.totals.escalations += 1;
                continue;
            }
            let Decision::Retry { micro_batch: new, backoff } = decision else {
                for (rec, _) in pending.drain(..) {
                    reporter.emit(Event::OomRecovered(rec)); // never recovered: recover_ms null
                }
                if let (Some(l), true, false) = (&leak, self.halved_for_leak, self.data_parallel) {
                    tracing::warn!("step {step}: {}; halving the micro-batch did not give the memory back: stopping instead of halving further", l.message);
                }
                return Err(GuardError::OutOfMemory(Box::new(OomFailure {
                    step: Some(step),
                    micro_batch: micro,
                    requested_bytes,
                    memory: after,
                    message,
                    leak,
                    gave_up: self.gave_up(),
                })));
            };
            self.totals.recoveries += 1;
            self.halved_for_leak |= leak.is_some() && !backoff;
            pending.push((
                OomRecovery {
                    step,
                    old_micro_batch: micro,
                    new_micro_batch: new,
                    old_accumulation: crate::data::batch::micro_steps(self.rank_batch, micro),
                    new_accumulation: crate::data::batch::micro_steps(self.rank_batch, new),
                    regrow_backoff: backoff,
                    requested_bytes,
                    before,
                    after,
                    recover_ms: f64::NAN,
                    error: first_line(&message).to_string(),
                    leak,
                    in_evaluation: self.evaluating,
                },
                failed_at,
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real allocator failure (libtorch's CPU allocator refusing 4 PiB) when `micro` is above
    /// `fits`: what an attempt meets when its micro-batch does not fit.
    fn attempt_fitting(fits: usize) -> impl FnMut(usize, &mut Progress) -> Result<usize, StepError> {
        move |micro, _| {
            if micro > fits {
                let _ = tch::Tensor::f_empty([1i64 << 50], (tch::Kind::Float, Device::Cpu))?;
            }
            Ok(micro)
        }
    }

    /// An out-of-memory in evaluation halves evaluation's micro-batch (kept for the next one),
    /// never training's, and an evaluation is no clean step for regrow.
    #[test]
    fn an_evaluation_out_of_memory_leaves_training_as_it_was() {
        let mut reporter = Reporter::new(None, 1, 1, None).unwrap();
        let mut guard = Guard::new(GuardState::new(8, 1, 2), OomPolicy::Adapt, Device::Cpu, 32);
        assert_eq!(guard.run(0, &mut reporter, attempt_fitting(8)).unwrap(), 8);
        let before = guard.state.clone();
        assert_eq!(guard.run_evaluation(0, &mut reporter, attempt_fitting(2)).unwrap(), 2);
        assert_eq!(guard.state, before, "training's micro-batch and regrow history are as they were");
        assert_eq!(guard.micro_batch(), 8);
        // The next evaluation starts where the last one fitted.
        let mut tried = Vec::new();
        guard
            .run_evaluation(1, &mut reporter, |micro, _| -> Result<(), StepError> {
                tried.push(micro);
                Ok(())
            })
            .unwrap();
        assert_eq!(tried, [2]);
        assert_eq!(guard.state, before);
        // Training's own out-of-memory still halves training's.
        assert_eq!(guard.run(1, &mut reporter, attempt_fitting(4)).unwrap(), 4);
        assert_eq!(guard.micro_batch(), 4);
    }
}
