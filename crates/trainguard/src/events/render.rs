//! The human log's words for each [`Event`]: one line (or a few) through `tracing`, at the
//! level its news deserves (a warning for what lost time or memory, info for the rest).
use super::reporter::Reporter;
use super::{Event, LossScaleReason, StepMetrics, StopReason};
use crate::memory::{gib, human, MemorySnapshot};

impl Reporter {
    /// The log's lines for `event`, by what it is about.
    pub(super) fn log(&self, event: &Event) {
        match event {
            Event::RunStarted { .. } => run_started(event),
            Event::Step(m) => self.step_line(m),
            Event::Resumed { .. }
            | Event::CheckpointSkipped { .. }
            | Event::CheckpointPutBack { .. }
            | Event::CheckpointsSetAside { .. }
            | Event::FinalWeightsSetAside { .. }
            | Event::CheckpointSaved { .. }
            | Event::CheckpointFailed { .. }
            | Event::CheckpointWaited { .. }
            | Event::CheckpointWrittenInForeground { .. } => checkpoint_news(event),
            Event::Stopped { .. }
            | Event::TraceWritten(_)
            | Event::RanksCompared { .. }
            | Event::RunFinished(_) => self.ending(event),
            _ => step_news(event),
        }
    }

    /// Every `train.log_interval` steps, the last and any that evaluated.
    fn step_line(&self, m: &StepMetrics) {
        let (first, last) = (m.step == 1, m.step == self.max_steps);
        let scored = !m.downstream.is_empty();
        if first || m.step.is_multiple_of(self.log_interval) || last || m.val_loss.is_some() || scored {
            let by_source: Vec<String> = m
                .by_source
                .iter()
                .filter_map(|(k, v)| Some(format!("{} {:.4}", k.strip_prefix("val_loss/")?, v.as_f64()?)))
                .collect();
            let by_source = match by_source.is_empty() {
                true => String::new(),
                false => format!(" ({})", by_source.join(", ")),
            };
            let mut val = m.val_loss.map(|v| format!(" | val {v:.4}{by_source}")).unwrap_or_default();
            // Each task's accuracy, by sum and per character: `eval_NAME_acc` → `NAME`.
            for (k, acc) in m.downstream.iter().filter(|(k, _)| k.ends_with("_acc") && *k != "eval_acc") {
                let name = &k["eval_".len()..k.len() - "_acc".len()];
                let norm = m.downstream.get(&format!("{k}_norm")).copied().unwrap_or(f64::NAN);
                val.push_str(&format!(" | {name} {acc:.3}/{norm:.3}"));
            }
            let mem = &m.memory;
            let mem = match (mem.allocated_bytes, mem.reserved_bytes, mem.peak_allocated_bytes) {
                (Some(a), Some(r), Some(p)) => {
                    format!(" | mem {:.2}/{:.2}/{:.2} GiB alloc/reserved/peak", gib(a), gib(r), gib(p))
                }
                _ => mem.rss_bytes.map(|r| format!(" | rss {:.2} GiB", gib(r))).unwrap_or_default(),
            };
            tracing::info!(
                "step {:>5}/{} | loss {:.4}{val} | lr {:.2e} | {:.0} tok/s | micro {}×{}{mem} | {:.1}s",
                m.step,
                self.max_steps,
                m.loss,
                m.lr,
                m.tokens_per_s,
                m.micro_batch,
                m.accumulation,
                m.elapsed_s
            );
        }
    }

    /// How the run ended, or what its end found.
    fn ending(&self, event: &Event) {
        match event {
            Event::Stopped { step, reason, checkpoint } => {
                let ck = match checkpoint {
                    Some(c) => format!("; checkpoint {c}"),
                    // A rank that writes no files: the checkpoint, if any, is rank 0's to say.
                    None if self.events.is_none() => "; rank 0 writes the checkpoint".into(),
                    None => "; no checkpoint".into(),
                };
                // `step`: the steps done. The non-finite stop comes after the last of them (its
                // checkpoint counts it); every other stop before the next one.
                let (when, n) = if matches!(reason, StopReason::Nonfinite | StopReason::Diverged) {
                    ("after", *step)
                } else {
                    ("before", step + 1)
                };
                tracing::warn!("stopping {when} step {n} ({reason}){ck}");
            }
            Event::TraceWritten(s) => {
                let kinds: Vec<String> = s
                    .by_work
                    .iter()
                    .take(6)
                    .map(|w| format!("{} {:.0}%", w.work.name(), 100.0 * w.share))
                    .collect();
                let per = |ms: f64| ms / s.steps as f64;
                tracing::info!("trace written to {}: {} {:.1} ms per step of {} ({}); `trainguard trace {}` tabulates it", s.path, s.counted, per(s.busy_ms), s.steps, kinds.join(", "), s.path);
                for n in s.top.iter().take(5) {
                    let name: String = n.name.chars().take(100).collect();
                    tracing::info!("  {:>9.2} ms per step  {name}", per(n.ms));
                }
            }
            Event::RanksCompared { world_size, checksum_spread } => {
                if *checksum_spread == 0.0 {
                    tracing::info!("all {world_size} ranks hold identical weights");
                } else {
                    tracing::warn!("ranks' weights differ (checksum spread {checksum_spread:e}): data-parallel replicas diverged");
                }
            }
            Event::RunFinished(s) if self.resume_at.is_some_and(|r| r >= s.steps) => {
                tracing::info!(
                    "done: nothing to train: resumed at step {}, and train.max_steps is {}; raise train.max_steps (or start a new run) to train further",
                    self.resume_at.unwrap_or_default(),
                    self.max_steps
                );
            }
            Event::RunFinished(s) => {
                let val = s.final_val_loss.map(|v| format!(", val loss {v:.4}")).unwrap_or_default();
                let session = match self.resume_at {
                    Some(_) => {
                        format!("; this session: {} steps in {:.1}s, ", s.session_steps, s.session_elapsed_s)
                    }
                    None => "; ".into(),
                };
                let escalated = if s.oom_escalations > 0 {
                    format!(" ({} by oom.escalate)", s.oom_escalations)
                } else {
                    String::new()
                };
                tracing::info!(
                    "done: {} steps in {:.1}s ({:.0} tok/s), loss {:.4}{val}{session}OOM recoveries {}{escalated}, micro-batch {} (configured {}), time lost {:.2}s",
                    s.steps, s.elapsed_s, s.tokens_per_s, s.final_loss, s.oom_recoveries, s.final_micro_batch, s.configured_micro_batch, s.time_lost_s
                );
            }
            _ => {}
        }
    }
}

/// The run as it starts: model, corpus, batch, memory cap, allocator settings.
fn run_started(event: &Event) {
    let Event::RunStarted {
        device,
        params,
        corpus,
        unigram_entropy,
        global_batch_size,
        micro_batch_size,
        configured_micro_batch_size,
        accumulation,
        world_size,
        tokens_per_step,
        max_steps,
        memory_limit_bytes,
        allocator,
    } = event
    else {
        return;
    };
    tracing::info!(
        "run: {:.2}M parameters on {device}, corpus {corpus}{}",
        *params as f64 / 1e6,
        if unigram_entropy.is_finite() {
            format!(" (unigram entropy {unigram_entropy:.3} nats)")
        } else {
            " (no validation split)".into()
        }
    );
    let guarded = if micro_batch_size != configured_micro_batch_size {
        format!(" (configured micro {configured_micro_batch_size}: the OOM guard's size, resumed)")
    } else {
        String::new()
    };
    tracing::info!(
        "batch: {}{guarded}; {tokens_per_step} tokens/step; {max_steps} steps",
        crate::data::batch::describe(*global_batch_size, *micro_batch_size, *accumulation, *world_size)
    );
    if let Some(l) = memory_limit_bytes {
        tracing::info!("memory cap: {}", human(*l));
    }
    if allocator.source != "none" {
        // They configure the CUDA caching allocator: a CPU run has them, unused.
        let unused = if device.starts_with("cuda") {
            ""
        } else {
            "; CUDA's caching allocator only, unused on the CPU"
        };
        tracing::info!("allocator settings: {} (from {}{unused})", allocator.conf, allocator.source);
    }
}

/// What happened inside a step: out-of-memory, regrow, skipped updates, loss scale, leaks, graphs.
fn step_news(event: &Event) {
    match event {
        Event::OomEscalated { step, micro_batch, level, effect, .. } => {
            tracing::warn!("step {step}: out of memory at micro-batch {micro_batch}, the smallest allowed: switching on {effect} (escalation {level}) and replaying");
        }
        Event::Deterministic(d) => {
            let cublas = d.cublas_workspace_config.as_deref().unwrap_or("unset");
            let from = if d.cublas_workspace_config_from == "trainguard" {
                "set by trainguard"
            } else {
                "kept from the environment"
            };
            tracing::info!(
                "deterministic: libtorch deterministic algorithms {}, uninitialised memory filled {}; CUBLAS_WORKSPACE_CONFIG={cublas} ({from})",
                d.libtorch.algorithms, d.libtorch.fill_uninitialized_memory
            );
        }
        Event::RegrowAttempt { step, from_micro_batch, to_micro_batch } => {
            tracing::info!("step {step}: trying micro-batch {to_micro_batch} again (was {from_micro_batch})");
        }
        Event::OomRecovered(r) => {
            let fmt = |s: &MemorySnapshot| match (s.allocated_bytes, s.reserved_bytes) {
                (Some(a), Some(r)) => format!("{} allocated / {} reserved", human(a), human(r)),
                _ => "memory figures unavailable".into(),
            };
            let asked = r.requested_bytes.map(|b| format!(" (asked for {})", human(b))).unwrap_or_default();
            let what = match (r.regrow_backoff, r.in_evaluation) {
                (true, _) => "regrow failed, backing off",
                (false, true) => "out of memory in evaluation (training's micro-batch stays)",
                (false, false) => "out of memory",
            };
            let recovered = if r.recover_ms.is_finite() {
                format!("recovered in {:.0} ms", r.recover_ms)
            } else {
                "did not recover".into()
            };
            let leak = r.leak.as_ref().map(|l| format!("; {}", l.message)).unwrap_or_default();
            tracing::warn!(
                "step {}: {what}{asked}; micro-batch {} → {}, accumulation {} → {}; memory before {}, after {}{leak}; replaying the same samples ({recovered})",
                r.step, r.old_micro_batch, r.new_micro_batch, r.old_accumulation, r.new_accumulation, fmt(&r.before), fmt(&r.after)
            );
        }
        Event::NonfiniteSkipped { step, loss, grad_norm, consecutive } => {
            tracing::warn!("step {step}: non-finite loss {loss} or gradient norm {grad_norm}: update skipped ({consecutive} in a row)");
        }
        Event::Diverged { step, data_step, statistic, value, median, mad, limit, recent, gives_up } => {
            let what = match statistic {
                crate::divergence::Statistic::Nonfinite => format!("{value} non-finite updates in a row"),
                s => format!("{} {value:.4} past {limit:.4} (median {median:.4}, MAD {mad:.4})", s.name()),
            };
            let next = if *gives_up {
                format!("{recent} rollbacks within divergence.rollback_window already: stopping")
            } else {
                "rolling back".to_string()
            };
            tracing::warn!("step {step} diverged (data step {data_step}): {what}; {next}");
        }
        Event::RolledBack {
            step,
            diverged_step,
            checkpoint,
            skipped_from,
            skipped_to,
            lr_factor,
            lr_lowered_until,
            rollbacks,
        } => {
            let lr = lr_lowered_until
                .map(|u| format!("; learning rate × {lr_factor} up to step {u}"))
                .unwrap_or_default();
            tracing::warn!("rolled back from step {diverged_step} to step {step} ({checkpoint}); data steps {skipped_from}–{skipped_to} skipped{lr} (rollback {rollbacks} of the run)");
        }
        Event::LossScaleChanged { step, scale, reason } => match reason {
            LossScaleReason::Overflow => tracing::warn!(
                "step {step}: fp16 gradients overflowed: update skipped, loss scale lowered to {scale}"
            ),
            LossScaleReason::Growth => tracing::info!("step {step}: loss scale raised to {scale}"),
        },
        Event::LeakSuspected { step, message } => {
            tracing::warn!("step {step}: possible memory leak: {message}")
        }
        Event::GraphCaptured { step, micro_batch } => {
            tracing::info!("step {step}: micro-steps of {micro_batch} captured as a CUDA graph")
        }
        Event::GraphsOff { step, reason } => {
            tracing::warn!("step {step}: CUDA graphs off for the rest of the run, a capture failed: {reason}")
        }
        Event::ThrashDetected { step, total_retries, action, new_micro_batch } => {
            let what = new_micro_batch
                .map(|m| format!("micro-batch lowered to {m} before an out-of-memory"))
                .unwrap_or_else(|| format!("oom.on_thrash: {action}"));
            tracing::warn!("step {step}: the CUDA allocator keeps flushing its cache to satisfy requests ({total_retries} retries so far), which slows every step; {what}");
        }
        _ => {}
    }
}

/// Checkpoints written, skipped, put back or set aside, and the resume.
fn checkpoint_news(event: &Event) {
    match event {
        Event::Resumed { step, path, changed, lineage } => {
            tracing::info!("resuming at step {step} from {path}");
            if !lineage.is_empty() {
                let runs: Vec<String> = lineage.iter().map(|l| format!("{} (to step {})", l.checkpoint, l.step)).collect();
                tracing::info!("this run continues other runs' training: {}", runs.join(" → "));
            }
            for c in changed {
                tracing::info!("changed since the checkpoint: {c}");
            }
        }
        Event::CheckpointSkipped { path, reason } => tracing::warn!("skipping checkpoint {path}: {reason}"),
        Event::CheckpointPutBack { step } => {
            tracing::warn!("checkpoint at step {step} put back: a run killed while writing the same step again had moved it aside");
        }
        Event::CheckpointsSetAside { resumed_step, steps, to } => tracing::warn!(
            "checkpoints of steps {steps:?} moved to {to}: they belong to a line this run leaves, which it does not continue from step {resumed_step} (nothing deleted)"
        ),
        Event::FinalWeightsSetAside { resumed_step, to } => tracing::warn!(
            "moved the final weights found in the run directory to {to}: this run, starting at step {resumed_step}, trains past them (nothing deleted)"
        ),
        Event::CheckpointSaved { step, path, seconds, deleted } => {
            let gone = if deleted.is_empty() { String::new() } else { format!(", removed steps {deleted:?}") };
            tracing::info!("checkpoint at step {step}: {path} ({seconds:.2}s{gone})");
        }
        Event::CheckpointFailed { step, error, training_goes_on } => match training_goes_on {
            true => tracing::warn!("checkpoint at step {step} failed, training goes on: {error}"),
            false => tracing::warn!("checkpoint at step {step} failed: {error}"),
        },
        Event::CheckpointWaited { step, seconds, before } => tracing::info!(
            "waited {seconds:.2}s for the background write of checkpoint {step} to end (before the {before})"
        ),
        Event::CheckpointWrittenInForeground { step, why } => tracing::warn!(
            "checkpoint at step {step} written synchronously, training waits for it ({why}); checkpoint.async goes on with the next one"
        ),
        _ => {}
    }
}
