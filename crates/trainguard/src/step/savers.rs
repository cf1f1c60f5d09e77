//! Memory savers for one micro-batch's forward and backward, built by hand because tch has no
//! checkpoint API or saved-tensor hooks:
//!
//! - **Activation checkpointing**: the body runs under no-grad keeping only each segment's input
//!   (a segment is `k` consecutive blocks); the backward pass recomputes one segment at a time
//!   from its input, pushes the incoming gradient through it and hands the input's gradient to
//!   the segment before. Dropout draws the same masks in the recomputation because the model
//!   reseeds its generator per block. The recomputation never reads the segment's output, only
//!   pushes a gradient through it ([`crate::ffi::backward`], seeded with that gradient): so the
//!   segment's last block hands back its stream and its output without adding them, and its
//!   last layer's product is not computed (that layer's backward needs its input, not its
//!   output: [`Model::block_graph`]). With `first_n:<m>` only the first m blocks are
//!   checkpointed: the later ones run with their graph from a leaf whose gradient, after their
//!   backward, is what the checkpointed segments pass back.
//! - **Offload**: those segment inputs wait in (pinned) CPU memory until their segment's turn.
//! - **Chunked loss**: the final LayerNorm, the LM head and the cross-entropy run over chunks of
//!   tokens, each chunk's backward before the next chunk's forward, so the batch × seq × vocab
//!   logits never exist at once.
//!
//! The result is the same loss and gradients as the plain path (checked in the tests).
use crate::config::{Checkpointing, Escalation};
use crate::model::Model;
use tch::{Device, Reduction, TchError, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Savers {
    /// Blocks per checkpointed segment; 0 = no checkpointing.
    pub checkpoint_every: usize,
    /// Only the first this many blocks are checkpointed, the rest keep their activations;
    /// none: all.
    pub checkpoint_first: Option<usize>,
    pub offload: bool,
    pub loss_chunk_tokens: Option<usize>,
}

impl Savers {
    /// The savers `memory.*` asks for (`activation_checkpointing` already parsed).
    pub fn new(checkpointing: Checkpointing, offload: bool, loss_chunk_tokens: Option<usize>) -> Self {
        let (checkpoint_every, checkpoint_first) = match checkpointing {
            Checkpointing::Every(k) => (k, None),
            Checkpointing::First(m) => (1, Some(m)),
            Checkpointing::None => (0, None),
        };
        Self { checkpoint_every, checkpoint_first, offload, loss_chunk_tokens }
    }

    /// Nothing switched on: the plain forward + backward.
    pub fn plain(&self) -> bool {
        self.checkpoint_every == 0 && self.loss_chunk_tokens.is_none()
    }

    /// With one escalation step of the OOM guard applied.
    pub fn escalated(mut self, e: Escalation) -> Self {
        match e {
            Escalation::ActivationCheckpointing => {
                if self.checkpoint_every == 0 {
                    self.checkpoint_every = 1;
                }
                self.checkpoint_first = None;
            }
            Escalation::OffloadActivations => {
                if self.checkpoint_every == 0 {
                    self.checkpoint_every = 1; // offload applies to checkpointed inputs
                }
                self.checkpoint_first = None;
                self.offload = true;
            }
            // Where the optimizer state lives: the step's layout, not its savers.
            Escalation::OffloadOptimizer
            | Escalation::ShardOptimizer
            | Escalation::ShardGradients
            | Escalation::ShardParameters => {}
        }
        self
    }
}

/// Adds a backward's gradients `new` of the parameters `idx` into `grads`. An undefined one is
/// a gradient the linear node added into the step's accumulator itself (`ffi::linear::GemmSums`):
/// it adds nothing here, and where nothing else did it stays undefined, for the step to skip.
fn accumulate(grads: &mut [Option<Tensor>], idx: &[usize], new: Vec<Tensor>) -> Result<(), TchError> {
    for (&i, g) in idx.iter().zip(new) {
        match &mut grads[i] {
            Some(acc) if acc.defined() => {
                if g.defined() {
                    let _ = acc.f_add_(&g)?;
                }
            }
            slot => *slot = Some(g),
        }
    }
    Ok(())
}

/// `loss · weight` for one micro-batch and the gradients of every parameter (in the model's
/// parameter order), computed with `savers`. Returns the weighted loss, detached. Inside a
/// [`crate::ffi::linear::GemmSums`] scope the gradients it added into their accumulators are
/// undefined tensors.
pub fn loss_and_grads(
    model: &Model,
    x: &Tensor,
    y: &Tensor,
    weight: f64,
    seed: u64,
    savers: &Savers,
) -> Result<(Tensor, Vec<Tensor>), TchError> {
    let params = &model.params.tensors;
    if savers.plain() {
        let loss = model.weighted_loss(x, y, weight, Some(seed))?;
        let grads = Tensor::f_run_backward(&[&loss], params, false, false)?;
        return Ok((loss.f_detach()?, grads));
    }
    let groups = model.param_groups();
    // Once per micro-batch, for its forward and every recomputation.
    let documents = model.documents(x)?;
    let documents = documents.as_ref();
    let mut grads: Vec<Option<Tensor>> = (0..params.len()).map(|_| None).collect();
    let device = x.device();
    let (k, n) = (savers.checkpoint_every, model.n_blocks());
    // Blocks [0, checkpointed) are recomputed in segments of k; the later ones keep their graph.
    let checkpointed = if k == 0 { 0 } else { savers.checkpoint_first.map_or(n, |m| m.min(n)) };

    // Body forward: with its graph, or keeping only segment inputs, then the kept blocks from
    // a leaf that collects the gradient for the checkpointed ones.
    let mut saved: Vec<(usize, Tensor)> = Vec::new();
    let mut kept_from: Option<Tensor> = None;
    let body_out = if k == 0 {
        let mut h = model.embed(x, documents, true, Some(seed))?;
        for i in 0..n {
            h = model.block(i, &h, documents, true, Some(seed))?;
        }
        h
    } else {
        let mut h = {
            let _no_grad = tch::no_grad_guard();
            let mut h = model.embed(x, documents, true, Some(seed))?;
            for i in 0..checkpointed {
                if i % k == 0 {
                    let keep = if savers.offload { offload(&h)? } else { h.shallow_clone() };
                    saved.push((i, keep));
                }
                h = model.block(i, &h, documents, true, Some(seed))?;
            }
            h
        };
        if checkpointed < n {
            let leaf = h.f_detach()?.f_set_requires_grad(true)?;
            h = leaf.shallow_clone();
            kept_from = Some(leaf);
            for i in checkpointed..n {
                h = model.block(i, &h, documents, true, Some(seed))?;
            }
        }
        h
    };

    // Head and loss, from a detached copy of the body's output.
    let hidden = body_out.f_detach()?.f_set_requires_grad(true)?;
    let (loss, grad_hidden) =
        head_backward(model, &hidden, y, weight, savers.loss_chunk_tokens, &groups.head, &mut grads)?;

    // Body backward.
    let blocks = |range: std::ops::Range<usize>| -> Vec<usize> {
        groups.blocks[range].iter().flatten().copied().collect()
    };
    if k == 0 {
        let body_idx: Vec<usize> = groups.embed.iter().copied().chain(blocks(0..n)).collect();
        push_back(std::slice::from_ref(&body_out), &grad_hidden, params, &body_idx, None, &mut grads)?;
    } else {
        let mut grad_out = grad_hidden;
        if let Some(leaf) = kept_from {
            grad_out = push_back(
                std::slice::from_ref(&body_out),
                &grad_out,
                params,
                &blocks(checkpointed..n),
                Some(leaf),
                &mut grads,
            )?
            .expect("the kept blocks' input gradient");
        }
        for (start, input) in saved.into_iter().rev() {
            let input = reload(&input, device)?.f_detach()?.f_set_requires_grad(true)?;
            let mut h = input.shallow_clone();
            let end = (start + k).min(checkpointed);
            for i in start..end - 1 {
                h = model.block(i, &h, documents, true, Some(seed))?;
            }
            // The segment's output is not read, only its gradient pushed back: the last block's
            // stream and output stay apart, and its last product is not computed.
            let out = model.block_graph(end - 1, &h, documents, true, Some(seed))?;
            grad_out = push_back(&out, &grad_out, params, &blocks(start..end), Some(input), &mut grads)?
                .expect("the segment input's gradient");
        }
        let e = model.embed(x, documents, true, Some(seed))?;
        push_back(&[e], &grad_out, params, &groups.embed, None, &mut grads)?;
    }
    let grads = grads
        .into_iter()
        .zip(params)
        .map(|(g, p)| g.map_or_else(|| Tensor::f_zeros_like(p), Ok))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((loss, grads))
}

/// Pushes `grad_out` back through the graphs of `outs` (each of which it is the gradient of: a
/// block's output, or its stream and its output not yet added) into the parameters `idx` (added
/// to `grads`) and into the leaf `input` when there is one, whose gradient it returns.
pub(super) fn push_back(
    outs: &[Tensor],
    grad_out: &Tensor,
    params: &[Tensor],
    idx: &[usize],
    input: Option<Tensor>,
    grads: &mut [Option<Tensor>],
) -> Result<Option<Tensor>, TchError> {
    let with_input = input.is_some();
    let mut inputs: Vec<Tensor> = idx.iter().map(|&i| params[i].shallow_clone()).collect();
    inputs.extend(input);
    let roots: Vec<&Tensor> = outs.iter().collect();
    let mut g = crate::ffi::backward(&roots, &vec![grad_out; roots.len()], &inputs)?;
    let input_grad = if with_input { g.pop() } else { None };
    accumulate(grads, idx, g)?;
    Ok(input_grad)
}

/// Head + loss on `hidden` (requires grad): the head's gradients go into `grads`; returns the
/// weighted loss (detached) and the gradient with respect to `hidden`.
pub(super) fn head_backward(
    model: &Model,
    hidden: &Tensor,
    y: &Tensor,
    weight: f64,
    chunk: Option<usize>,
    head_idx: &[usize],
    grads: &mut [Option<Tensor>],
) -> Result<(Tensor, Tensor), TchError> {
    let head_params: Vec<Tensor> =
        head_idx.iter().map(|&i| model.params.tensors[i].shallow_clone()).collect();
    let Some(chunk) = chunk else {
        let loss = model.weighted_cross_entropy(model.head(hidden)?, y, Reduction::Mean, weight)?;
        let mut inputs = head_params;
        inputs.push(hidden.shallow_clone());
        let mut g = Tensor::f_run_backward(&[&loss], &inputs, false, false)?;
        let grad_hidden = g.pop().expect("hidden's gradient");
        accumulate(grads, head_idx, g)?;
        return Ok((loss.f_detach()?, grad_hidden));
    };
    let c = *hidden.size().last().expect("hidden has a last dimension");
    let flat = hidden.f_detach()?.f_reshape([-1, c])?;
    let targets = y.f_reshape([-1])?;
    let n = flat.size()[0];
    let mut total: Option<Tensor> = None;
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < n {
        let len = (chunk as i64).min(n - start);
        let inp = flat.f_narrow(0, start, len)?.f_detach()?.f_set_requires_grad(true)?;
        // Sum over the chunk ÷ all tokens: the chunks add up to the mean. (All tokens, not the
        // targets counted: our batches are token streams with no −100 targets, and the step's
        // token weights (`weight`) count every token too.)
        let loss = model.weighted_cross_entropy(
            model.head(&inp)?,
            &targets.f_narrow(0, start, len)?,
            Reduction::Sum,
            weight / n as f64,
        )?;
        let mut inputs: Vec<Tensor> = head_params.iter().map(|t| t.shallow_clone()).collect();
        inputs.push(inp);
        let mut g = Tensor::f_run_backward(&[&loss], &inputs, false, false)?;
        pieces.push(g.pop().expect("chunk input's gradient"));
        accumulate(grads, head_idx, g)?;
        let loss = loss.f_detach()?;
        total = Some(match total {
            None => loss,
            Some(t) => t.f_add(&loss)?,
        });
        start += len;
    }
    let grad_hidden = Tensor::f_cat(&pieces, 0)?.f_view(hidden.size().as_slice())?;
    Ok((total.expect("at least one chunk"), grad_hidden))
}

/// A copy of `t` in CPU memory: what an offloaded segment input is while it waits. Public so
/// tests can check where it lives. From a GPU the copy is asynchronous into pinned memory (ATen
/// pins a non-blocking copy's CPU result), so the forward does not wait for it; nothing reads it
/// on the host, and the copy back ([`reload`]) is queued after it on the same stream. Reading
/// it on the host needs the stream synchronised first.
pub fn offload(t: &Tensor) -> Result<Tensor, TchError> {
    match t.device().is_cuda() {
        true => t.f_to_device_(Device::Cpu, t.kind(), true, false),
        false => t.f_to_device(Device::Cpu),
    }
}

/// A kept segment input back on `device`, without waiting when it comes from pinned memory.
pub(super) fn reload(kept: &Tensor, device: Device) -> Result<Tensor, TchError> {
    kept.f_to_device_(device, kept.kind(), device.is_cuda(), false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    /// Dropout draws from libtorch's global generator, which the model reseeds per block; tests
    /// that run in parallel threads must not reseed it in between.
    static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn setup(dropout: f64) -> (Model, Tensor, Tensor) {
        let cfg = ModelConfig {
            n_layer: 4,
            n_head: 2,
            n_embd: 32,
            vocab_size: 64,
            seq_len: 16,
            dropout,
            bias: true,
            ..ModelConfig::default()
        };
        let m = Model::new(&cfg, 11, Device::Cpu).unwrap();
        let x = Tensor::f_randint(64, [3, 16], (tch::Kind::Int64, Device::Cpu)).unwrap();
        let y = Tensor::f_randint(64, [3, 16], (tch::Kind::Int64, Device::Cpu)).unwrap();
        (m, x, y)
    }

    fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max)
    }

    #[test]
    fn every_saver_gives_the_plain_gradients_with_and_without_dropout() {
        let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        for dropout in [0.0, 0.1] {
            let (m, x, y) = setup(dropout);
            let (loss0, plain) = loss_and_grads(&m, &x, &y, 0.5, 7, &Savers::default()).unwrap();
            let variants = [
                Savers { checkpoint_every: 1, ..Default::default() },
                Savers { checkpoint_every: 3, ..Default::default() },
                Savers { loss_chunk_tokens: Some(5), ..Default::default() },
                Savers {
                    checkpoint_every: 2,
                    offload: true,
                    loss_chunk_tokens: Some(16),
                    checkpoint_first: None,
                },
                Savers { checkpoint_every: 1, checkpoint_first: Some(1), ..Default::default() },
                Savers {
                    checkpoint_every: 1,
                    checkpoint_first: Some(2),
                    offload: true,
                    loss_chunk_tokens: Some(16),
                },
                Savers { checkpoint_every: 1, checkpoint_first: Some(9), ..Default::default() },
            ];
            for s in variants {
                let (loss, g) = loss_and_grads(&m, &x, &y, 0.5, 7, &s).unwrap();
                let dl = (loss.double_value(&[]) - loss0.double_value(&[])).abs();
                let dg = max_diff(&plain, &g);
                assert!(dl <= 1e-6 && dg <= 1e-5, "dropout {dropout} {s:?}: loss diff {dl}, grad diff {dg}");
            }
        }
    }

    /// Under bf16 autocast (a recomputed segment's last block then hands back an fp32 stream and
    /// a bf16 output, both seeded with the fp32 gradient) every saver gives the plain path's loss
    /// and gradients: the same kernels on the same inputs, so the same bits on the CPU.
    #[test]
    fn every_saver_gives_the_plain_gradients_under_bf16_autocast() {
        let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let (m, x, y) = setup(0.0);
        let run = |s: &Savers| {
            crate::ffi::set_autocast(false, true, false).unwrap();
            let out = loss_and_grads(&m, &x, &y, 0.5, 7, s);
            crate::ffi::set_autocast(false, false, false).unwrap();
            out.unwrap()
        };
        let (loss0, plain) = run(&Savers::default());
        for s in [
            Savers { checkpoint_every: 1, ..Default::default() },
            Savers { checkpoint_every: 3, ..Default::default() },
            Savers { checkpoint_every: 1, checkpoint_first: Some(2), ..Default::default() },
        ] {
            let (loss, g) = run(&s);
            assert!(loss.equal(&loss0), "{s:?}: loss {loss:?} vs {loss0:?}");
            assert_eq!(max_diff(&plain, &g), 0.0, "{s:?}: gradients");
        }
    }

    /// A recomputed segment's last block skips its last layer's product, the others recompute
    /// every one: counted as the CPU ran them (PyTorch's profiler), against the plain path.
    #[test]
    fn a_recomputed_segment_skips_its_last_layers_product() {
        let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let (m, x, y) = setup(0.0);
        let dir = tempfile::tempdir().unwrap();
        let products = |s: &Savers| {
            let path = dir.path().join("trace.json");
            crate::ffi::trace::start(false).unwrap();
            let ran = loss_and_grads(&m, &x, &y, 1.0, 7, s).map(|_| ());
            crate::ffi::trace::stop(Some(&path)).unwrap();
            ran.unwrap();
            let trace = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let events = crate::trace::parse(&trace).unwrap().events;
            events
                .iter()
                .filter(|e| {
                    !e.device_side && !e.launch && matches!(e.name.as_str(), "aten::mm" | "aten::addmm")
                })
                .count()
        };
        let plain = products(&Savers::default());
        // A GPT-2 block's forward: four products (q/k/v, the attention's projection, the MLP's
        // two); 4 blocks.
        assert_eq!(
            products(&Savers { checkpoint_every: 1, ..Default::default() }) - plain,
            4 * 3,
            "every block ends a segment"
        );
        assert_eq!(
            products(&Savers { checkpoint_every: 2, ..Default::default() }) - plain,
            2 * (4 + 3),
            "segments of two"
        );
        assert_eq!(
            products(&Savers { checkpoint_every: 1, checkpoint_first: Some(1), ..Default::default() })
                - plain,
            3,
            "the first block alone"
        );
    }

    #[test]
    fn offload_matches_checkpointing_alone() {
        let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let (m, x, y) = setup(0.1);
        let (_, a) =
            loss_and_grads(&m, &x, &y, 1.0, 3, &Savers { checkpoint_every: 1, ..Default::default() })
                .unwrap();
        let (_, b) = loss_and_grads(
            &m,
            &x,
            &y,
            1.0,
            3,
            &Savers { checkpoint_every: 1, offload: true, ..Default::default() },
        )
        .unwrap();
        assert_eq!(max_diff(&a, &b), 0.0);
    }

    #[test]
    fn escalation_switches_savers_on_in_order() {
        let s = Savers::default().escalated(Escalation::ActivationCheckpointing);
        assert_eq!((s.checkpoint_every, s.offload), (1, false));
        let s = s.escalated(Escalation::OffloadActivations);
        assert_eq!((s.checkpoint_every, s.offload), (1, true));
        let keep = Savers { checkpoint_every: 3, ..Default::default() }
            .escalated(Escalation::ActivationCheckpointing);
        assert_eq!(keep.checkpoint_every, 3, "an explicit segment length is kept");
        let part = Savers::new(Checkpointing::First(2), false, None);
        assert_eq!((part.checkpoint_every, part.checkpoint_first), (1, Some(2)));
        assert_eq!(
            part.escalated(Escalation::ActivationCheckpointing).checkpoint_first,
            None,
            "escalating checkpoints every block"
        );
    }
}
