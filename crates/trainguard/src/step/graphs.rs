//! CUDA graphs of the micro-steps (`kernels.cuda_graphs`). Each micro-batch length of a step's
//! split runs once as usual (the warm-up: NVRTC compiles our kernels, cuBLAS and cuDNN pick
//! theirs), is captured the next time it comes, and from then on is replayed: one launch where
//! the forward and backward queue about a thousand kernels (GPT-2 124M), each a few µs of GPU
//! idle between kernels when launched one by one. A graph reads its batch from static input
//! tensors and adds its loss and gradients into accumulators that outlive it, which every
//! micro-step of a step in this mode adds into, graphed or not: the step's result is the eager
//! one.
//!
//! Graphs apply on CUDA, with activation checkpointing and a chunked loss too (their recomputed
//! forwards and chunked backwards are device work like the rest), but not with offload (its
//! copies go through host memory), loss scaling or dropout (which reseeds the generator per
//! block); the config refuses those three beside graphs, and a step the guard escalates to
//! offload runs eagerly. Each length is captured per set of savers (an escalation captures
//! again). What drops them: a step at another micro-batch (the guard halved or regrew), any
//! failed attempt (an out of memory inside a capture included: the guard then replays eagerly
//! at its smaller size and captures again later), and [`MicroGraphs::release`] before validation, whose activations would
//! otherwise sit beside the graphs' memory pool. A capture that fails for any other reason (an op
//! that cannot be captured) switches graphs off for the run, with its reason in a notice.
use super::savers::{loss_and_grads, Savers};
use crate::ffi::graph::{Capture, CudaGraph};
use crate::ffi::kernels;
use crate::ffi::linear::KeptCasts;
use crate::guard::{classify, ErrorKind};
use crate::model::Model;
use tch::{Device, Kind, TchError, Tensor};

/// What the next micro-step of one length does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Runs as usual (the first of its length, or graphs cannot be captured here).
    Eager,
    /// Recorded into a graph, then replayed.
    Capture,
    /// Replays the graph.
    Replay,
}

/// Where one micro-batch length stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Unseen,
    WarmedUp,
    Captured,
}

/// The decision for a length in `phase` where captures are possible (`can_capture`).
fn action(phase: Phase, can_capture: bool) -> Action {
    match (phase, can_capture) {
        (_, false) | (Phase::Unseen, true) => Action::Eager,
        (Phase::WarmedUp, true) => Action::Capture,
        (Phase::Captured, true) => Action::Replay,
    }
}

/// Something the step engine reports as an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    Captured { micro_batch: usize },
    Off { reason: String },
}

/// One micro-batch length (and loss weight, which the graph holds as a constant) under one set
/// of savers.
struct Length {
    rows: i64,
    weight_bits: u64,
    savers: Savers,
    phase: Phase,
    graph: Option<Graphed>,
}

/// A captured micro-step: the graph and the static tensors its batch is copied into.
struct Graphed {
    graph: CudaGraph,
    x: Tensor,
    y: Tensor,
}

/// The step's sums: the weighted loss and the gradients, in the model's parameter order.
struct Accumulators {
    loss: Tensor,
    grads: Vec<Tensor>,
}

/// The micro-step graphs of one run and the accumulators they add into.
pub struct MicroGraphs {
    on: bool,
    /// The micro-batch the current graphs were made for.
    micro: usize,
    lengths: Vec<Length>,
    acc: Option<Accumulators>,
    notices: Vec<Notice>,
    /// The linear node's 16-bit casts of the weights, kept for the run (declared last: dropped
    /// after the graphs that read them) and made again in place at each step's start, so that a
    /// captured micro-step reads the step's casts where it would cast every weight again.
    casts: Option<KeptCasts>,
}

impl MicroGraphs {
    /// Graphs switched on (`kernels.cuda_graphs`) or off. On the CPU nothing is ever captured,
    /// but an `on` set still adds every micro-step into its accumulators (what tests check).
    pub fn new(on: bool) -> Self {
        Self { on, micro: 0, lengths: Vec::new(), acc: None, notices: Vec::new(), casts: None }
    }

    /// Whether a step with `savers` and loss scale `scale` runs in this mode.
    pub fn applies(&self, savers: &Savers, scale: f64) -> bool {
        self.on && !savers.offload && scale == 1.0
    }

    /// Starts a step at `micro`: the accumulators zeroed (made on first use), the graphs of
    /// another micro-batch dropped, the kept casts made from the weights as they are now.
    pub fn begin_step(&mut self, model: &Model, micro: usize) -> Result<(), TchError> {
        if micro != self.micro {
            self.lengths.clear();
            self.micro = micro;
        }
        match &self.casts {
            Some(_) => KeptCasts::refresh()?,
            None => self.casts = Some(KeptCasts::start()?),
        }
        match &self.acc {
            Some(acc) => {
                kernels::zero_all(&acc.grads)?;
                kernels::zero_all(std::slice::from_ref(&acc.loss))?;
            }
            None => {
                let params = &model.params.tensors;
                let grads = params.iter().map(Tensor::f_zeros_like).collect::<Result<Vec<_>, _>>()?;
                let device = params.first().map_or(Device::Cpu, Tensor::device);
                self.acc = Some(Accumulators { loss: Tensor::f_zeros([], (Kind::Float, device))?, grads });
            }
        }
        Ok(())
    }

    /// One micro-step of `x`, `y` with loss weight `weight` (`seed`: the dropout seed, which
    /// only an eager run can use): run and added, captured and replayed, or replayed, as its
    /// length's phase says.
    pub fn micro_step(
        &mut self,
        model: &Model,
        x: &Tensor,
        y: &Tensor,
        weight: f64,
        seed: u64,
        savers: &Savers,
    ) -> Result<(), TchError> {
        let rows = x.size().first().copied().unwrap_or(0);
        let i = self.length(rows, weight, *savers);
        let can_capture = self.on && matches!(x.device(), Device::Cuda(_));
        match action(self.lengths[i].phase, can_capture) {
            Action::Eager => {
                self.run(model, x, y, weight, seed, savers)?;
                self.lengths[i].phase = Phase::WarmedUp;
            }
            Action::Capture => match self.capture(model, x, y, weight, savers)? {
                Some(graphed) => {
                    graphed.graph.replay()?;
                    self.lengths[i].graph = Some(graphed);
                    self.lengths[i].phase = Phase::Captured;
                    self.notices.push(Notice::Captured { micro_batch: rows as usize });
                }
                // Graphs are off now: this micro-step runs as usual.
                None => self.run(model, x, y, weight, seed, savers)?,
            },
            Action::Replay => {
                let g = self.lengths[i].graph.as_mut().expect("a captured length has its graph");
                g.x.f_copy_(x)?;
                g.y.f_copy_(y)?;
                g.graph.replay()?;
            }
        }
        Ok(())
    }

    /// The gradient accumulators of the step begun (zeroed by [`MicroGraphs::begin_step`]).
    pub fn accumulators(&self) -> Option<&[Tensor]> {
        self.acc.as_ref().map(|a| a.grads.as_slice())
    }

    /// The step's gradients and weighted loss sum (the accumulators themselves: zeroed when the
    /// next step begins).
    pub fn results(&self) -> Option<(Vec<Tensor>, Tensor)> {
        self.acc
            .as_ref()
            .map(|a| (a.grads.iter().map(Tensor::shallow_clone).collect(), a.loss.shallow_clone()))
    }

    /// Frees the graphs, their memory pool and the accumulators (a failed attempt, validation).
    /// The lengths stay warmed up: the next step of the same micro-batch captures them again.
    pub fn release(&mut self) {
        for l in &mut self.lengths {
            if l.graph.take().is_some() {
                l.phase = Phase::WarmedUp;
            }
        }
        self.acc = None;
    }

    /// Drops the graphs with their warm-ups and the kept casts they read, for a step that runs
    /// outside them (escalated to offload, or graphs off): such a step neither holds the casts
    /// beside its own memory nor reads casts the optimizer has since made stale (its writes go
    /// through raw pointers, which no version counter sees). The next step in this mode warms
    /// up again, so its casts are made before any capture reads them.
    pub fn forget(&mut self) {
        self.lengths.clear();
        self.casts = None;
    }

    /// The notices since the last call.
    pub fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    /// Graphs captured and alive now.
    pub fn captured(&self) -> usize {
        self.lengths.iter().filter(|l| l.graph.is_some()).count()
    }

    fn length(&mut self, rows: i64, weight: f64, savers: Savers) -> usize {
        let weight_bits = weight.to_bits();
        if let Some(i) = self
            .lengths
            .iter()
            .position(|l| l.rows == rows && l.weight_bits == weight_bits && l.savers == savers)
        {
            return i;
        }
        self.lengths.push(Length { rows, weight_bits, savers, phase: Phase::Unseen, graph: None });
        self.lengths.len() - 1
    }

    /// The micro-step's loss and gradients added into the accumulators.
    fn run(
        &self,
        model: &Model,
        x: &Tensor,
        y: &Tensor,
        weight: f64,
        seed: u64,
        savers: &Savers,
    ) -> Result<(), TchError> {
        let acc = self.acc.as_ref().expect("begin_step made the accumulators");
        let (loss, grads) = loss_and_grads(model, x, y, weight, seed, savers)?;
        kernels::add_all(std::slice::from_ref(&acc.loss), &[loss])?;
        kernels::add_all(&acc.grads, &grads)?;
        Ok(())
    }

    /// Records the micro-step of `x`, `y` (copied into new static inputs) as a graph sharing the
    /// pool of the graphs already made. An out of memory is the caller's error; any other
    /// failure switches graphs off (None).
    fn capture(
        &mut self,
        model: &Model,
        x: &Tensor,
        y: &Tensor,
        weight: f64,
        savers: &Savers,
    ) -> Result<Option<Graphed>, TchError> {
        let Device::Cuda(device) = x.device() else { return Ok(None) };
        let static_copy = |t: &Tensor| -> Result<Tensor, TchError> {
            let mut s = t.f_empty_like()?;
            s.f_copy_(t)?;
            Ok(s)
        };
        let (sx, sy) = (static_copy(x)?, static_copy(y)?);
        let share = self.lengths.iter().find_map(|l| l.graph.as_ref()).map(|g| &g.graph);
        let recorded = Capture::begin(device, share).map_err(TchError::from).and_then(|capture| {
            // A failure inside drops `capture`, which closes it and frees the recording. No
            // dropout here (the config refuses it with graphs): the seed is never read.
            self.run(model, &sx, &sy, weight, 0, savers)?;
            Ok(capture.end()?)
        });
        match recorded {
            Ok(graph) => Ok(Some(Graphed { graph, x: sx, y: sy })),
            Err(e) => {
                let message = e.to_string();
                if matches!(classify(&message), ErrorKind::OutOfMemory { .. }) {
                    return Err(e);
                }
                self.on = false;
                self.forget();
                self.notices.push(Notice::Off { reason: message });
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_length_warms_up_then_is_captured_then_replayed() {
        assert_eq!(action(Phase::Unseen, true), Action::Eager);
        assert_eq!(action(Phase::WarmedUp, true), Action::Capture);
        assert_eq!(action(Phase::Captured, true), Action::Replay);
        for phase in [Phase::Unseen, Phase::WarmedUp, Phase::Captured] {
            assert_eq!(action(phase, false), Action::Eager, "nothing is captured where graphs cannot be");
        }
    }

    #[test]
    fn unscaled_micro_steps_without_offload_are_graphed() {
        let on = MicroGraphs::new(true);
        let plain = Savers::default();
        assert!(on.applies(&plain, 1.0));
        assert!(
            on.applies(&Savers { checkpoint_every: 1, loss_chunk_tokens: Some(64), ..plain }, 1.0),
            "checkpointing and a chunked loss"
        );
        assert!(!on.applies(&plain, 1024.0), "fp16 loss scaling");
        assert!(!on.applies(&Savers { checkpoint_every: 1, offload: true, ..plain }, 1.0), "offload");
        assert!(!MicroGraphs::new(false).applies(&plain, 1.0), "switched off");
    }
}
