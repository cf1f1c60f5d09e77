//! The guarded optimizer step and what it works on. [`optimizer_step`] is the step training runs
//! and `plan --profile` measures: each attempt (at the micro-batch the guard chooses) runs the
//! micro-batches under autocast with the memory savers, lets the ranks agree, unscales, applies
//! the injected faults, clips, and updates only when the loss and gradient norm are finite.
use super::faults::Faults;
use super::gathered;
use super::graphs::{MicroGraphs, Notice};
use super::micro::{evaluate, forward_backward, StepData};
use super::precision::{self, Autocast, LossScaler, ScaleChange};
use super::savers::Savers;
use super::state_layout::{LayoutSpec, StateLayout};
use crate::config::{Escalation, KernelsConfig, ModelConfig, Precision};
use crate::distributed::agree::{self, Prepared};
use crate::distributed::Dist;
use crate::events::{Event, LossScaleReason, Reporter};
use crate::ffi::torch_panics::catch_torch_panics;
use crate::guard::{Guard, GuardError, Progress, StepError};
use crate::model::Model;
use crate::optim::{clip_grad_norm, clip_to, scale_all, squared_norm, Optimizer, OptimizerSpec};
use tch::{Device, TchError, Tensor};

/// The model, its optimizer and (fp16-mixed) the loss scaler: the state a step changes, and
/// what a checkpoint saves with the step's counters; beside them the micro-step graphs
/// (`kernels.cuda_graphs`), which a checkpoint does not keep.
pub struct Trainable {
    pub model: Model,
    pub opt: Optimizer,
    /// Where `opt`'s state lives: all of it here, this rank's part (`dist.shard`), on the host.
    pub layout: StateLayout,
    pub scaler: Option<LossScaler>,
    pub graphs: MicroGraphs,
}

impl Trainable {
    /// A fresh model in `precision` on `device` and the optimizer for it; a loss scaler when
    /// `precision` is fp16-mixed.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        model: &ModelConfig,
        kernels: KernelsConfig,
        spec: &OptimizerSpec,
        layout: LayoutSpec,
        precision: Precision,
        scaler: LossScaler,
        seed: u64,
        device: Device,
    ) -> Result<Self, TchError> {
        let model = Model::with_kernels(model, kernels, seed, device)?;
        precision::prepare(&model.params.tensors, precision)?;
        let (opt, layout) = StateLayout::build(layout, spec, &model, device)?;
        let graphs = MicroGraphs::new(kernels.cuda_graphs && device.is_cuda());
        Ok(Self { model, opt, layout, scaler: (precision == Precision::Fp16Mixed).then_some(scaler), graphs })
    }

    pub fn params(&self) -> &[Tensor] {
        &self.model.params.tensors
    }
}

/// How a step is computed: the run plan's precision, clipping and memory savers.
#[derive(Debug, Clone)]
pub struct StepSettings {
    pub precision: Precision,
    pub device: Device,
    pub grad_clip: f64,
    /// The configured savers; the guard's escalation level adds `escalate[..level]`.
    pub savers: Savers,
    pub escalate: Vec<Escalation>,
}

impl StepSettings {
    fn savers_at(&self, level: usize) -> Savers {
        self.escalate[..level].iter().fold(self.savers, |s, e| s.escalated(*e))
    }
}

/// What one optimizer step produced.
#[derive(Debug, Clone, Copy)]
pub struct StepOutcome {
    /// Mean loss over the global batch (unscaled).
    pub loss: f64,
    pub grad_norm: f64,
    /// The update was applied (loss and gradient norm finite).
    pub applied: bool,
    /// fp16: the scaled gradients overflowed (the scaler backs off; not a bad batch).
    pub overflow: bool,
}

impl StepOutcome {
    /// Skipped for a non-finite loss or gradient that loss scaling does not explain.
    pub fn skipped_as_nonfinite(&self) -> bool {
        !self.applied && !self.overflow
    }
}

/// One optimizer step `step` at learning rate `lr`, replayed by the guard at smaller
/// micro-batches after an out-of-memory. Emits regrow trials, recoveries and loss-scale changes.
#[allow(clippy::too_many_arguments)]
pub fn optimizer_step(
    t: &mut Trainable,
    guard: &mut Guard,
    settings: &StepSettings,
    data: &StepData,
    step: u64,
    lr: f64,
    mut dist: Option<&mut Dist>,
    faults: &mut Faults,
    reporter: &mut Reporter,
) -> Result<StepOutcome, GuardError> {
    guard.begin_step(step, reporter);
    let scale = t.scaler.as_ref().map_or(1.0, |s| s.scale);
    let outcome = guard.run(step, reporter, |micro, p| {
        let result = move_layout(t, settings, p, dist.as_deref_mut()).and_then(|()| {
            let result = attempt(t, settings, data, step, lr, micro, scale, p, dist.as_deref_mut(), faults);
            whole_again(t, dist.as_deref(), result)
        });
        if result.is_err() {
            // Whatever the graphs held goes back with the failed attempt's memory.
            t.graphs.release();
        }
        result
    });
    for notice in t.graphs.take_notices() {
        reporter.emit(match notice {
            Notice::Captured { micro_batch } => Event::GraphCaptured { step, micro_batch },
            Notice::Off { reason } => Event::GraphsOff { step, reason },
        });
    }
    let outcome = outcome?;
    if let Some(s) = &mut t.scaler {
        match s.update(outcome.overflow) {
            ScaleChange::BackedOff(scale) => {
                reporter.emit(Event::LossScaleChanged { step, scale, reason: LossScaleReason::Overflow })
            }
            ScaleChange::Grew(scale) => {
                reporter.emit(Event::LossScaleChanged { step, scale, reason: LossScaleReason::Growth })
            }
            ScaleChange::Unchanged => {}
        }
    }
    Ok(outcome)
}

/// Under `dist.shard: parameters`, every parameter whole again after an attempt, whether it
/// updated or failed (the ranks agreed on the failure, so all gather together): the guard's replay
/// and a checkpoint for a stop read the whole model. Only a fatal error, after which nothing is
/// saved, leaves them as they are.
fn whole_again(
    t: &mut Trainable,
    dist: Option<&Dist>,
    outcome: Result<StepOutcome, StepError>,
) -> Result<StepOutcome, StepError> {
    let Some(shards) = &mut t.layout.params else { return outcome };
    if matches!(outcome, Err(StepError::Fatal(_))) {
        return outcome;
    }
    let restored =
        catch_torch_panics(|| shards.restore_all(&t.model, dist).map_err(|e| StepError::Fatal(Box::new(e))));
    match restored {
        Ok(()) => outcome,
        Err(StepError::Torch(e)) => Err(StepError::Fatal(format!("dist.shard parameters: the parameters could not be gathered whole again after the step ({e}); resume from the newest checkpoint (--resume auto)").into())),
        Err(e) => Err(e),
    }
}

/// The optimizer state moved into the layout the guard's escalations ask for (offloaded,
/// sharded), before the attempt. A move changes which collectives the attempt runs (sharded
/// gradients are reduce-scattered, sharded parameters gathered block by block), so whenever the
/// layout wanted is not the one the ranks last agreed on, they agree on it first: every rank
/// attempts in the new layout, or every rank drops the attempt, and one whose move failed (an
/// out-of-memory making the new state) tries again on the next.
fn move_layout(
    t: &mut Trainable,
    settings: &StepSettings,
    p: &Progress,
    dist: Option<&mut Dist>,
) -> Result<(), StepError> {
    let Trainable { model, opt, layout, .. } = t;
    let wanted = layout.base.escalated(&settings.escalate[..p.escalation_level()]);
    if wanted == layout.agreed {
        return Ok(());
    }
    let moved = match wanted == layout.spec {
        true => Ok(()),
        false => catch_torch_panics(|| layout.change_to(wanted, opt, model, settings.device)),
    };
    agree::layout_moved(moved, dist.as_deref(), p.last_resort())?;
    layout.agreed = wanted;
    if let (Some(s), Some(d)) = (layout.shards_gradients(), dist) {
        // Gradients go to their owners from now on: the all-reduce buckets go. Where they were
        // all-reduced from inside backward (`dist.overlap`), they are reduced from there,
        // unless each block gathers its own (`parameters`).
        let hooked = (d.overlaps() && layout.params.is_none()).then(|| model.block_params());
        d.release_buckets();
        if let Some(hooked) = hooked {
            // A piece of scratch, made where the buckets were just freed.
            let params = &model.params.tensors;
            d.reduce_into_owners_in_backward(params, &hooked, s, settings.device)
                .map_err(|e| StepError::Fatal(Box::new(e)))?;
        }
    }
    Ok(())
}

/// One attempt of a step at micro-batch `micro`, as the guard runs it.
#[allow(clippy::too_many_arguments)]
fn attempt(
    t: &mut Trainable,
    settings: &StepSettings,
    data: &StepData,
    step: u64,
    lr: f64,
    micro: usize,
    scale: f64,
    p: &mut Progress,
    mut dist: Option<&mut Dist>,
    faults: &mut Faults,
) -> Result<StepOutcome, StepError> {
    let Trainable { model, opt, layout, scaler, graphs } = t;
    let scaled = scaler.is_some();
    let savers = settings.savers_at(p.escalation_level());
    let autocast =
        Autocast::enter(settings.precision, settings.device).map_err(|e| StepError::Fatal(Box::new(e)))?;
    // Each rank's own work is caught where it is done (a libtorch error tch raised as a
    // panic included), so a failing rank still joins the agreement that follows.
    // The injected leak allocates like the step's own work: before the ranks agree on it (under
    // `dist.shard: parameters` before the work, which leaves the parameters gathered by others
    // freed).
    let leak = |faults: &mut Faults| catch_torch_panics(|| faults.leak_graph(model, data, step, micro));
    let local = match &mut layout.params {
        None => catch_torch_panics(|| {
            forward_backward(model, data, step, micro, &savers, scale, graphs, p, dist.as_deref())
        })
        .and_then(|r| leak(faults).map(|()| r)),
        Some(shards) => leak(faults).and_then(|()| {
            catch_torch_panics(|| {
                gathered::forward_backward(
                    model,
                    data,
                    step,
                    micro,
                    &savers,
                    scale,
                    p,
                    shards,
                    dist.as_deref(),
                )
            })
        }),
    };
    drop(autocast);
    let last_resort = p.last_resort();
    // Replicated (and `dist.shard: optimizer`): every rank holds every averaged gradient and
    // computes the same norm alone. `dist.shard: gradients`: each rank receives its own
    // parameters' only, and the norm is summed over the ranks in an agreement of its own.
    let (mut grads, mut loss, sharded_norm) = match layout.shards_gradients() {
        // `dist.shard: parameters`: summed over the ranks already, unit by unit.
        Some(_) if layout.params.is_some() => {
            let (mut grads, mut loss) = agree::reduced_gradients(local, dist.as_deref(), last_resort)?;
            let local = catch_torch_panics(|| -> Result<f64, StepError> {
                unscale_and_corrupt(&mut grads, &mut loss, scale, faults, step, scaled)?;
                Ok(squared_norm(&grads)?)
            });
            let norm = agree::global_norm(local, dist.as_deref(), last_resort)?;
            (grads, loss, Some(norm))
        }
        None => {
            let (grads, loss) = agree::gradients(local, dist.as_deref_mut(), last_resort)?;
            (grads, loss, None)
        }
        Some(s) => {
            let local = local.and_then(|(g, l)| Ok((model.optimizer_grads(&g)?, l)));
            let (mut grads, mut loss) = agree::owned_gradients(local, dist.as_deref_mut(), s, last_resort)?;
            let local = catch_torch_panics(|| -> Result<f64, StepError> {
                unscale_and_corrupt(&mut grads, &mut loss, scale, faults, step, scaled)?;
                Ok(squared_norm(&grads)?)
            });
            let norm = agree::global_norm(local, dist.as_deref(), last_resort)?;
            (grads, loss, Some(norm))
        }
    };
    // What runs between the two agreements allocates on each rank alone (the clipping's
    // norms, above all): the second agreement lets every rank replay if one ran out.
    // The buffers of the parameters' all-gather after the update (`optimizer`, `gradients`):
    // made here, where a rank that cannot make them replays with every other, not after the
    // update, where its peers' updated parameters would stay ungathered.
    let mut pieces = None;
    let prepared = catch_torch_panics(|| -> Result<Prepared, StepError> {
        if let (Some(s), Some(d), None) = (&layout.shard, dist.as_deref(), &layout.params) {
            pieces = Some(d.pieces(&s.ownership, s.chunk, settings.device)?);
        }
        let grad_norm = match sharded_norm {
            None => {
                unscale_and_corrupt(&mut grads, &mut loss, scale, faults, step, scaled)?;
                clip_grad_norm(&mut grads, settings.grad_clip)?
            }
            Some(norm) => {
                clip_to(&mut grads, norm, settings.grad_clip)?;
                norm
            }
        };
        let overflow = scaled && !grad_norm.is_finite();
        let applied = loss.is_finite() && grad_norm.is_finite();
        Ok(Prepared { grad_norm, overflow, applied })
    });
    let Prepared { grad_norm, overflow, applied } =
        agree::before_update(prepared, dist.as_deref(), last_resort)?;
    if applied {
        let update = catch_torch_panics(|| {
            let grads = match layout.shards_gradients() {
                Some(_) => grads,
                None => layout.mine(model.optimizer_grads(&grads)?),
            };
            layout.update(model, opt, &grads, lr)
        });
        agree::update_done(update, dist.as_deref())?;
        match &layout.shard {
            // Gathered by `attempt`, into the memory freed through the step.
            Some(_) if layout.params.is_some() => {}
            Some(s) => agree::parameters_gathered(model, s, dist.as_deref(), pieces.as_ref())?,
            None => {}
        }
    }
    Ok(StepOutcome { loss, grad_norm, applied, overflow })
}

/// The loss scale taken out of `grads` and the injected faults applied: the work between the
/// gradients' exchange and the norm.
fn unscale_and_corrupt(
    grads: &mut [Tensor],
    loss: &mut f64,
    scale: f64,
    faults: &mut Faults,
    step: u64,
    scaled: bool,
) -> Result<(), StepError> {
    if scale != 1.0 {
        scale_all(grads, 1.0 / scale)?;
    }
    faults.corrupt(step, loss, grads, scaled)?;
    Ok(())
}

/// The mean validation loss over `batches` fixed batches, inside the guard (apart from training's
/// micro-batch: [`Guard::run_evaluation`]), averaged over ranks, the loss in chunks of
/// `memory.loss_chunk_tokens` as training computes it.
/// Under the same autocast as training: a bf16-mixed run validates in bf16 as it trains, not in
/// fp32 at a fraction of the speed and with a loss of another precision.
#[allow(clippy::too_many_arguments)]
pub fn validation_loss(
    model: &Model,
    guard: &mut Guard,
    settings: &StepSettings,
    data: &StepData,
    batches: usize,
    step: u64,
    dist: Option<&Dist>,
    reporter: &mut Reporter,
) -> Result<f64, GuardError> {
    guard.run_evaluation(step, reporter, |micro, p| {
        let autocast = Autocast::enter(settings.precision, settings.device)
            .map_err(|e| StepError::Fatal(Box::new(e)))?;
        let chunk = settings.savers.loss_chunk_tokens;
        let local = catch_torch_panics(|| evaluate(model, data, batches, micro, chunk, p));
        drop(autocast);
        agree::validation_loss(local, dist, p.last_resort())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OomPolicy;
    use crate::data::{Corpus, Sampler};
    use crate::guard::{GuardState, Progress};

    /// The step with `kernels.cuda_graphs`' accumulators (on the CPU every micro-step runs
    /// eagerly into them) trains exactly as the usual step: the same weights after steps with
    /// clipping, uneven accumulation and a change of micro-batch, and a failed attempt (an
    /// injected non-finite loss skips the update) leaves nothing behind.
    #[test]
    fn steps_through_the_graphs_accumulators_train_as_the_usual_steps() {
        use crate::config::{FaultsConfig, OptimizerConfig, TrainConfig};
        let cfg = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            vocab_size: 64,
            seq_len: 16,
            dropout: 0.0,
            bias: true,
            ..ModelConfig::default()
        };
        let spec = OptimizerSpec::from_config(
            &OptimizerConfig::default(),
            &TrainConfig::default(),
            &KernelsConfig::default(),
        );
        let corpus = Corpus::synthetic(64, 20_000, 0.1).unwrap();
        let data = StepData::single(&corpus, Sampler { seed: 2, seq_len: 16 }, Device::Cpu, 10);
        let settings = StepSettings {
            precision: Precision::Fp32,
            device: Device::Cpu,
            grad_clip: 0.5,
            savers: Savers::default(),
            escalate: Vec::new(),
        };
        let faults_cfg = FaultsConfig { nonfinite_loss_at_steps: vec![4], ..FaultsConfig::default() };
        let train = |graphs: bool| {
            let mut t = Trainable::build(
                &cfg,
                KernelsConfig::default(),
                &spec,
                LayoutSpec::default(),
                Precision::Fp32,
                LossScaler::new(1.0, 1),
                7,
                Device::Cpu,
            )
            .unwrap();
            t.graphs = MicroGraphs::new(graphs);
            let mut guard = Guard::new(GuardState::new(4, 1, 0), OomPolicy::Fail, Device::Cpu, 10);
            let mut faults = Faults::new(&faults_cfg, 0, 0);
            let mut reporter = Reporter::new(None, 1, 1, None).unwrap();
            let mut outcomes = Vec::new();
            for step in 0..6u64 {
                if step == 4 {
                    guard = Guard::new(GuardState::new(3, 1, 0), OomPolicy::Fail, Device::Cpu, 10);
                }
                outcomes.push(
                    optimizer_step(
                        &mut t,
                        &mut guard,
                        &settings,
                        &data,
                        step,
                        1e-3,
                        None,
                        &mut faults,
                        &mut reporter,
                    )
                    .unwrap(),
                );
            }
            (t.params().iter().map(Tensor::copy).collect::<Vec<_>>(), outcomes)
        };
        let ((usual, a), (graphed, b)) = (train(false), train(true));
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (x.loss.to_bits(), x.grad_norm.to_bits(), x.applied),
                (y.loss.to_bits(), y.grad_norm.to_bits(), y.applied)
            );
        }
        assert!(!a[3].applied, "the injected non-finite loss skipped step 4 (index 3)");
        for (p, q) in usual.iter().zip(&graphed) {
            assert!(p.equal(q), "the weights differ");
        }
    }

    #[test]
    fn validation_runs_under_the_training_precisions_autocast() {
        let cfg = ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 32,
            vocab_size: 64,
            seq_len: 16,
            dropout: 0.0,
            bias: true,
            ..ModelConfig::default()
        };
        let model = Model::new(&cfg, 5, Device::Cpu).unwrap();
        let corpus = Corpus::synthetic(64, 20_000, 0.1).unwrap();
        let data = StepData::single(&corpus, Sampler { seed: 2, seq_len: 16 }, Device::Cpu, 4);
        let mut reporter = Reporter::new(None, 1, 1, None).unwrap();
        let validate = |precision, reporter: &mut Reporter| {
            let settings = StepSettings {
                precision,
                device: Device::Cpu,
                grad_clip: 0.0,
                savers: Savers::default(),
                escalate: Vec::new(),
            };
            let mut guard = Guard::new(GuardState::new(4, 1, 0), OomPolicy::Fail, Device::Cpu, 4);
            validation_loss(&model, &mut guard, &settings, &data, 2, 0, None, reporter).unwrap()
        };
        let bf16 = validate(Precision::Bf16Mixed, &mut reporter);
        let fp32 = validate(Precision::Fp32, &mut reporter);
        let under_autocast = {
            let _autocast = Autocast::enter(Precision::Bf16Mixed, Device::Cpu).unwrap();
            evaluate(&model, &data, 2, 4, None, &mut Progress::default()).unwrap()
        };
        assert_eq!(
            bf16.to_bits(),
            under_autocast.to_bits(),
            "bf16-mixed validation is the loss computed under bf16 autocast"
        );
        assert_eq!(
            fp32.to_bits(),
            evaluate(&model, &data, 2, 4, None, &mut Progress::default()).unwrap().to_bits()
        );
        assert_ne!(bf16, fp32, "bf16 autocast changes the loss: validation did not run under it");
    }
}
