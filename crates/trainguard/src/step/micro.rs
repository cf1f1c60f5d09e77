//! One optimizer step's gradient computation and the validation loss, each a pure function of
//! (weights, step, micro-batch): the guard can replay them at any micro-batch and get the same
//! samples. Gradients are returned, not left in `.grad`, so a failed attempt leaves nothing
//! behind: dropping the attempt's locals frees them ("set to none", not zeroed).
use super::graphs::MicroGraphs;
use super::savers::{loss_and_grads, Savers};
use crate::checkpoint::state::SkippedWindow;
use crate::data::batch;
use crate::data::{Corpus, Sampler};
use crate::distributed::Dist;
use crate::ffi::kernels;
use crate::ffi::linear::KeptCasts;
use crate::guard::Progress;
use crate::model::Model;
use tch::{Device, TchError, Tensor};

/// Where a rank's samples come from.
pub struct StepData<'a> {
    pub corpus: &'a Corpus,
    pub sampler: Sampler,
    pub device: Device,
    /// This rank's slice of each global batch: global indices `start .. start + len`.
    pub rank_start: usize,
    pub rank_batch: usize,
    /// The global batch and the ranks sharing it: the loss weights' denominator.
    pub global_batch: usize,
    pub world: usize,
    /// Data steps the divergence guard skipped: step `t` draws the samples (and dropout masks)
    /// of data step `data::skips::data_step(t, skipped)`.
    pub skipped: &'a [SkippedWindow],
}

impl StepData<'_> {
    /// One process taking a whole batch of `batch` sequences.
    pub fn single(corpus: &Corpus, sampler: Sampler, device: Device, batch: usize) -> StepData<'_> {
        StepData {
            corpus,
            sampler,
            device,
            rank_start: 0,
            rank_batch: batch,
            global_batch: batch,
            world: 1,
            skipped: &[],
        }
    }

    /// The data step optimizer step `step` draws.
    pub fn data_step(&self, step: u64) -> u64 {
        crate::data::skips::data_step(step, self.skipped)
    }

    fn weight(&self, micro_len: usize) -> f64 {
        batch::loss_weight(micro_len, self.global_batch, self.world)
    }
}

/// Gradients of the mean loss over this rank's batch of step `step` multiplied by `scale` (fp16
/// loss scaling; 1 otherwise), computed in micro-batches of `micro`, and that loss (unscaled).
/// Each micro-batch's loss is weighted by its share of the tokens, so the result does not depend
/// on the split. Where `graphs` apply, the micro-steps add into their accumulators (and replay
/// as CUDA graphs once captured). With `dist` under `dist.overlap`, the last micro-step's
/// backward starts the gradient all-reduce bucket by bucket ([`Dist::arm_overlap`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Model,
    data: &StepData,
    step: u64,
    micro: usize,
    savers: &Savers,
    scale: f64,
    graphs: &mut MicroGraphs,
    progress: &mut Progress,
    dist: Option<&Dist>,
) -> Result<(Vec<Tensor>, f64), TchError> {
    let (grads, loss_sum) = if graphs.applies(savers, scale) {
        graphs.begin_step(model, micro)?;
        // The linear node adds its weights' gradients into the accumulators in its GEMMs.
        let _sums = graphs.accumulators().map(|acc| model.sum_weight_grads_into(acc)).transpose()?;
        each_micro_batch(data, step, micro, progress, |x, y, weight, seed| {
            graphs.micro_step(model, x, y, weight * scale, seed, savers)
        })?;
        graphs.results().map(|(g, l)| (g, Some(l))).expect("begin_step made the accumulators")
    } else {
        graphs.forget();
        // The weights' 16-bit casts made once for all micro-steps (freed before the optimizer
        // writes the weights); not with checkpointing, whose forward would otherwise free each
        // block's casts as it goes.
        let _casts = (savers.checkpoint_every == 0).then(KeptCasts::start).transpose()?;
        let (mut grads, mut loss_sum): (Vec<Tensor>, Option<Tensor>) = (Vec::new(), None);
        let mut _sums = None;
        let last = batch::split(data.rank_batch, micro).count().saturating_sub(1);
        let mut index = 0;
        each_micro_batch(data, step, micro, progress, |x, y, weight, seed| {
            let mut armed = None;
            if let (true, Some(d)) = (index == last, dist) {
                if d.arm_overlap(loss_sum.is_some().then_some(grads.as_slice()))? {
                    // The last micro-step's weight gradients come out of backward, through the
                    // hooks that start their collectives, not added inside the GEMMs past them.
                    _sums = None;
                    armed = Some(d);
                }
            }
            index += 1;
            let (loss, micro_grads) = loss_and_grads(model, x, y, weight * scale, seed, savers)?;
            // What the hooks sent is in the sums already, which are being reduced: not added
            // again. (A step of one micro-step keeps its gradients: they are its sums.)
            let micro_grads = match armed.filter(|_| loss_sum.is_some()).and_then(Dist::overlap_arrived) {
                Some(sent) => micro_grads
                    .iter()
                    .zip(sent)
                    .map(|(g, sent)| if sent { Tensor::new() } else { g.shallow_clone() })
                    .collect(),
                None => micro_grads,
            };
            match loss_sum.take() {
                None => {
                    // The first micro-step's gradients are the sums; the later ones' linear
                    // nodes add their weights' gradients into them in their GEMMs.
                    _sums = model.sum_weight_grads_into(&micro_grads)?;
                    (grads, loss_sum) = (micro_grads, Some(loss));
                }
                Some(sum) => {
                    kernels::add_all(&grads, &micro_grads)?;
                    loss_sum = Some(sum.f_add(&loss)?);
                }
            }
            Ok(())
        })?;
        (grads, loss_sum)
    };
    // One host sync per step, after all micro-steps were queued.
    let loss = loss_sum.map(|l| l.f_double_value(&[])).transpose()?.map_or(f64::NAN, |l| l / scale);
    Ok((grads, loss))
}

/// `f(x, y, loss weight, dropout seed)` for each micro-batch of this rank's share of step `step`
/// split into `micro`, in order.
pub(super) fn each_micro_batch(
    data: &StepData,
    step: u64,
    micro: usize,
    progress: &mut Progress,
    mut f: impl FnMut(&Tensor, &Tensor, f64, u64) -> Result<(), TchError>,
) -> Result<(), TchError> {
    let step = data.data_step(step);
    for r in batch::split(data.rank_batch, micro) {
        let weight = data.weight(r.len());
        let indices = data.rank_start + r.start..data.rank_start + r.end;
        // Dropout masks are a function of (seed, step, first sample): replays draw the same.
        let seed = crate::data::mix(&[data.sampler.seed, step, indices.start as u64]);
        let (x, y) = data.sampler.train_batch(data.corpus, step, indices, data.device)?;
        f(&x, &y, weight, seed)?;
        progress.micro_step_done();
    }
    Ok(())
}

/// Mean validation loss over `batches` fixed batches of `batch_size` samples, evaluated in
/// chunks of `micro`.
pub fn evaluate(
    model: &Model,
    data: &StepData,
    batches: usize,
    micro: usize,
    loss_chunk_tokens: Option<usize>,
    progress: &mut Progress,
) -> Result<f64, TchError> {
    let _no_grad = tch::no_grad_guard();
    let _casts = KeptCasts::start()?;
    let mut total = 0.0;
    for b in 0..batches {
        for r in batch::split(data.rank_batch, micro) {
            let weight = data.weight(r.len());
            let indices = data.rank_start + r.start..data.rank_start + r.end;
            let (x, y) = data.sampler.val_batch(data.corpus, b, indices, data.device)?;
            let loss = match loss_chunk_tokens {
                Some(chunk) => model.loss_in_chunks(&x, &y, chunk)?,
                None => model.loss(&x, &y, false, None)?,
            };
            total += loss.f_double_value(&[])? * weight;
            progress.micro_step_done();
        }
    }
    Ok(total / batches as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::ffi::kernels::CudaEmulation;
    use crate::step::savers::loss_and_grads;

    fn setup() -> (Model, Corpus) {
        let cfg = ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            vocab_size: 64,
            seq_len: 8,
            dropout: 0.0,
            bias: true,
            ..ModelConfig::default()
        };
        (Model::new(&cfg, 3, Device::Cpu).unwrap(), Corpus::synthetic(64, 20_000, 0.1).unwrap())
    }

    #[test]
    fn gradients_do_not_depend_on_the_split_even_with_a_short_last_micro_batch() {
        let (model, corpus) = setup();
        let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 10);
        let plain = Savers::default();
        let off = &mut MicroGraphs::new(false);
        let (whole, loss_whole) =
            forward_backward(&model, &data, 4, 10, &plain, 1.0, off, &mut Progress::default(), None).unwrap();
        for micro in [3, 4, 7] {
            let (split, loss_split) =
                forward_backward(&model, &data, 4, micro, &plain, 1.0, off, &mut Progress::default(), None)
                    .unwrap();
            assert!(
                (loss_whole - loss_split).abs() < 1e-5,
                "micro {micro}: loss {loss_whole} vs {loss_split}"
            );
            for (a, b) in whole.iter().zip(&split) {
                let diff = (a - b).abs().max().double_value(&[]);
                assert!(diff < 1e-5, "micro {micro}: gradient differs by {diff}");
            }
        }
        assert!(model.params.tensors.iter().all(|p| !p.grad().defined()), "nothing is left in .grad");
    }

    /// Evaluation with `memory.loss_chunk_tokens` (chunks that do not divide the tokens, the
    /// last one short) gives the whole-logits loss.
    #[test]
    fn a_chunked_evaluation_gives_the_whole_logits_loss() {
        let (model, corpus) = setup();
        let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 10);
        let whole = evaluate(&model, &data, 2, 4, None, &mut Progress::default()).unwrap();
        for chunk in [1, 7, 24, 1000] {
            let chunked = evaluate(&model, &data, 2, 4, Some(chunk), &mut Progress::default()).unwrap();
            assert!((whole - chunked).abs() < 1e-6, "chunk {chunk}: {chunked} vs {whole}");
        }
    }

    /// `kernels.cuda_graphs`' accumulators (what the graphs add into; on the CPU every
    /// micro-step runs eagerly into them) give the usual step's loss and gradients to the bit,
    /// step after step (zeroed in between), across a change of micro-batch, after a release, and
    /// with checkpointing and a chunked loss.
    #[test]
    fn the_graphs_accumulators_give_the_usual_steps_result() {
        let (model, corpus) = setup();
        let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 10);
        let plain = Savers::default();
        let (usual, graphed) = (&mut MicroGraphs::new(false), &mut MicroGraphs::new(true));
        for (step, micro) in [(4, 3), (5, 3), (6, 4), (7, 4)] {
            if step == 7 {
                graphed.release();
            }
            let run = |graphs: &mut MicroGraphs| {
                forward_backward(
                    &model,
                    &data,
                    step,
                    micro,
                    &plain,
                    1.0,
                    graphs,
                    &mut Progress::default(),
                    None,
                )
                .unwrap()
            };
            let (want, want_loss) = run(usual);
            let (got, got_loss) = run(graphed);
            assert_eq!(got_loss.to_bits(), want_loss.to_bits(), "step {step}: loss");
            assert_eq!(got.len(), want.len());
            for (a, b) in got.iter().zip(&want) {
                assert!(a.equal(b), "step {step}: a gradient differs");
            }
            assert_eq!(graphed.captured(), 0, "nothing is captured on the CPU");
        }
        // Checkpointing and a chunked loss go through the accumulators as well, to the bit.
        let savers = Savers { checkpoint_every: 1, loss_chunk_tokens: Some(16), ..plain };
        let (want, want_loss) =
            forward_backward(&model, &data, 8, 4, &savers, 1.0, usual, &mut Progress::default(), None)
                .unwrap();
        let (got, got_loss) =
            forward_backward(&model, &data, 8, 4, &savers, 1.0, graphed, &mut Progress::default(), None)
                .unwrap();
        assert_eq!(got_loss.to_bits(), want_loss.to_bits(), "savers: loss");
        assert!(got.iter().zip(&want).all(|(a, b)| a.equal(b)), "savers: a gradient differs");
        let (held, _) = graphed.results().unwrap();
        assert!(got[0].equal(&held[0]), "the savers' step went through the accumulators");
        // Offload runs as usual, outside them.
        let offload = Savers { offload: true, ..savers };
        let (a, _) =
            forward_backward(&model, &data, 9, 4, &offload, 1.0, graphed, &mut Progress::default(), None)
                .unwrap();
        let (held, _) = graphed.results().unwrap();
        assert!(!a[0].equal(&held[0]), "offload's step did not go through the accumulators");
    }

    /// A 2-block GPT-2 through the linear node (built while the caller's `CudaEmulation` lives,
    /// so that its kernels run), its corpus, and the casts a micro-step makes: four weights and
    /// four biases a block, and the LM head's weight.
    fn linear_node_gpt2() -> (ModelConfig, Model, Corpus, u64) {
        linear_node_gpt2_with(crate::config::KernelsConfig {
            fused_linear: true,
            ..crate::config::KernelsConfig::aten()
        })
    }

    fn linear_node_gpt2_with(kernels: crate::config::KernelsConfig) -> (ModelConfig, Model, Corpus, u64) {
        let cfg = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 64,
            seq_len: 8,
            dropout: 0.0,
            bias: true,
            ..ModelConfig::default()
        };
        let model = Model::with_kernels(&cfg, kernels, 3, Device::Cpu).unwrap();
        let casts = 8 * cfg.n_layer as u64 + 1;
        (cfg, model, Corpus::synthetic(64, 20_000, 0.1).unwrap(), casts)
    }

    /// A Llama of the same size with merged projections through the linear node; the casts a
    /// forward makes: per block o, down and the joint q/k/v and gate/up casts, and the head's.
    fn merged_llama_with(kernels: crate::config::KernelsConfig) -> (ModelConfig, Model, Corpus, u64) {
        let cfg = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 64,
            seq_len: 8,
            dropout: 0.0,
            bias: false,
            ..ModelConfig::default()
        };
        let cfg =
            ModelConfig { arch: crate::config::Arch::Llama, n_kv_head: Some(1), ffn_hidden: Some(40), ..cfg };
        let model = Model::with_kernels(
            &cfg,
            crate::config::KernelsConfig { merged_projections: true, ..kernels },
            3,
            Device::Cpu,
        )
        .unwrap();
        let casts = 4 * cfg.n_layer as u64 + 1;
        (cfg, model, Corpus::synthetic(64, 20_000, 0.1).unwrap(), casts)
    }

    /// Under bf16 autocast the linear node (its kernels emulated) casts each weight and bias
    /// once per step: a step's later micro-steps reuse the first's casts, with the same loss and
    /// gradients to the bit as casting afresh; a weight changed in place is cast again; the casts
    /// are freed when the step returns.
    #[test]
    fn a_steps_micro_steps_share_their_weights_casts() {
        use crate::config::KernelsConfig;
        let _emulation = CudaEmulation::start();
        let (cfg, model, corpus, casts) = linear_node_gpt2();
        let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 8);
        let plain = Savers::default();
        let step = |micro: usize| {
            crate::ffi::set_autocast(false, true, false).unwrap();
            let before = KeptCasts::reused();
            let out = forward_backward(
                &model,
                &data,
                4,
                micro,
                &plain,
                1.0,
                &mut MicroGraphs::new(false),
                &mut Progress::default(),
                None,
            );
            crate::ffi::set_autocast(false, false, false).unwrap();
            let (grads, loss) = out.unwrap();
            (grads, loss, KeptCasts::reused() - before)
        };
        let (whole, whole_loss, reused) = step(8);
        assert_eq!(reused, 0, "one micro-step: nothing to reuse");
        let (split, split_loss, reused) = step(2);
        assert_eq!(reused, 3 * casts, "micro-steps 2 to 4 reuse the first's casts");
        assert_eq!(KeptCasts::held(), 0, "the casts are freed when the step returns");
        // The same as each micro-step casting afresh: the usual micro-steps summed, in order.
        let (mut fresh, mut fresh_loss) = (None::<Vec<Tensor>>, None::<Tensor>);
        for r in batch::split(8, 2) {
            let seed = crate::data::mix(&[1, 4, r.start as u64]);
            let (x, y) = data.sampler.train_batch(&corpus, 4, r.clone(), Device::Cpu).unwrap();
            crate::ffi::set_autocast(false, true, false).unwrap();
            let (loss, g) = loss_and_grads(&model, &x, &y, data.weight(r.len()), seed, &plain).unwrap();
            crate::ffi::set_autocast(false, false, false).unwrap();
            fresh_loss = Some(fresh_loss.map_or(loss.shallow_clone(), |sum| sum + loss));
            fresh = Some(match fresh {
                None => g,
                Some(acc) => acc.iter().zip(&g).map(|(a, b)| a + b).collect(),
            });
        }
        assert_eq!(split_loss, fresh_loss.unwrap().double_value(&[]), "loss");
        assert!(split.iter().zip(fresh.as_ref().unwrap()).all(|(a, b)| a.equal(b)), "gradients, to the bit");
        assert!(
            (whole_loss - split_loss).abs() < 1e-2 * whole_loss.abs(),
            "the split changes only roundings"
        );
        drop(whole);
        // A weight changed in place (as the optimizer does) is cast again.
        let scope = KeptCasts::start().unwrap();
        crate::ffi::set_autocast(false, true, false).unwrap();
        let (x, y) = data.sampler.train_batch(&corpus, 4, 0..2, Device::Cpu).unwrap();
        let first = model.loss(&x, &y, false, None).unwrap().double_value(&[]);
        let _ = tch::no_grad(|| {
            model.params.get("h.0.mlp.c_fc.weight").unwrap().shallow_clone().f_add_scalar_(0.5).unwrap()
        });
        let before = KeptCasts::reused();
        let changed = model.loss(&x, &y, false, None).unwrap().double_value(&[]);
        assert_eq!(KeptCasts::reused() - before, casts - 1, "all but the changed tensor reused");
        drop(scope);
        let recast = model.loss(&x, &y, false, None).unwrap().double_value(&[]);
        crate::ffi::set_autocast(false, false, false).unwrap();
        assert_ne!(first, changed, "the change shows");
        assert_eq!(changed, recast, "as cast afresh");
        // Merged projections' joint casts are kept as the parameters' are: one set, which the
        // second forward reuses whole.
        let llama = ModelConfig {
            arch: crate::config::Arch::Llama,
            n_kv_head: Some(1),
            ffn_hidden: Some(40),
            bias: false,
            ..cfg
        };
        let merged = Model::with_kernels(
            &llama,
            KernelsConfig { fused_linear: true, merged_projections: true, ..KernelsConfig::aten() },
            3,
            Device::Cpu,
        )
        .unwrap();
        let _scope = KeptCasts::start().unwrap();
        crate::ffi::set_autocast(false, true, false).unwrap();
        let held_reused: Vec<(usize, u64)> = (0..2)
            .map(|_| {
                let before = KeptCasts::reused();
                merged
                    .loss(&x, &y, false, None)
                    .map(|_| (KeptCasts::held(), KeptCasts::reused() - before))
                    .unwrap()
            })
            .collect();
        crate::ffi::set_autocast(false, false, false).unwrap();
        // Per block o and down, the joint q/k/v and gate/up, and the (tied) head.
        let kept = 4 * llama.n_layer + 1;
        assert_eq!(held_reused, [(kept, 0), (kept, kept as u64)]);
    }

    /// In CUDA graphs' mode the linear node's casts are kept for the run (a captured micro-step
    /// reads them) and made again in place at each step's start: after the weights changed,
    /// half through a raw pointer that no version counter sees (as our CUDA optimizers write
    /// them), half by ATen's in-place op, each step still gives, to the bit, what a thread that
    /// casts afresh every step gives, a step the guard escalated outside the graphs (which drops
    /// them and their casts) included. GPT-2, and a Llama whose merged layers' joint casts are
    /// made again part by part.
    #[test]
    fn the_graphs_kept_casts_follow_the_weights_from_step_to_step() {
        fn steps(graphs: bool, merged: bool) -> Vec<(f64, Vec<Tensor>)> {
            let _emulation = CudaEmulation::start();
            let kernels =
                crate::config::KernelsConfig { fused_linear: true, ..crate::config::KernelsConfig::aten() };
            let (_, model, corpus, casts) =
                if merged { merged_llama_with(kernels) } else { linear_node_gpt2_with(kernels) };
            let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 8);
            let mut mode = MicroGraphs::new(graphs);
            let mut out = Vec::new();
            // Step 2 as the guard escalates it (offload, checkpointing): outside the graphs.
            let escalated = Savers { checkpoint_every: 1, offload: true, ..Savers::default() };
            let (mut where_kept, mut reused_before, mut reused_at_step_0) =
                (Vec::new(), KeptCasts::reused(), 0);
            for step in 0..4u64 {
                let savers = if step == 2 { escalated } else { Savers::default() };
                crate::ffi::set_autocast(false, true, false).unwrap();
                let (grads, loss) = forward_backward(
                    &model,
                    &data,
                    step,
                    2,
                    &savers,
                    1.0,
                    &mut mode,
                    &mut Progress::default(),
                    None,
                )
                .unwrap();
                crate::ffi::set_autocast(false, false, false).unwrap();
                assert_eq!(
                    KeptCasts::held() > 0,
                    graphs && step != 2,
                    "step {step}: kept for the graphs, none after a step outside them"
                );
                if graphs && step == 1 {
                    // Step 1's refresh made the casts again where step 0 had put them, and as
                    // current: step 1 reused every one of them, none was cast anew.
                    assert_eq!(
                        KeptCasts::addresses(),
                        where_kept,
                        "the casts stay where captured graphs read them"
                    );
                    assert_eq!(
                        KeptCasts::reused() - reused_before,
                        reused_at_step_0 + casts,
                        "step 1 reused every cast"
                    );
                }
                if step == 0 {
                    where_kept = KeptCasts::addresses();
                    reused_at_step_0 = KeptCasts::reused() - reused_before;
                    reused_before = KeptCasts::reused();
                }
                out.push((loss, grads.iter().map(|g| g.copy()).collect()));
                // Half the weights through a raw pointer, half by ATen's in-place op (which bumps
                // their version, as fused AdamW does).
                for (i, p) in model.params.tensors.iter().enumerate() {
                    let delta = 0.01 * (step + 1) as f64;
                    let mut target = match i % 2 {
                        0 => crate::ffi::alias_without_version(p),
                        _ => p.shallow_clone(),
                    };
                    let _ = tch::no_grad(|| target.f_add_scalar_(delta).unwrap());
                }
            }
            drop(mode);
            assert_eq!(KeptCasts::held(), 0, "freed with the graphs");
            out
        }
        for merged in [false, true] {
            // Each on its own thread: the casts are kept per thread.
            let eager = std::thread::spawn(move || steps(false, merged)).join().unwrap();
            let graphed = std::thread::spawn(move || steps(true, merged)).join().unwrap();
            for (step, ((la, ga), (lb, gb))) in graphed.iter().zip(&eager).enumerate() {
                assert_eq!(la.to_bits(), lb.to_bits(), "merged {merged}, step {step}: loss");
                assert!(
                    ga.iter().zip(gb).all(|(a, b)| a.equal(b)),
                    "merged {merged}, step {step}: a gradient differs"
                );
            }
        }
    }

    /// `kernels.accumulate_in_gemm` (the linear node's kernels emulated, bf16 autocast): from a
    /// step's second micro-step on, and in the graphs' mode from its first, each weight through
    /// the node has its gradient added into the step's sum in the node's backward, and autograd
    /// returns none for it; the step's loss and gradients are those of adding afterwards, to the
    /// bit, plain, with checkpointing and a chunked loss, and in the graphs' mode.
    #[test]
    fn the_linear_node_adds_weight_gradients_into_the_steps_sums() {
        use crate::config::KernelsConfig;
        use crate::ffi::linear::GemmSums;
        let _emulation = CudaEmulation::start();
        let kernels =
            |on: bool| KernelsConfig { fused_linear: true, accumulate_in_gemm: on, ..KernelsConfig::aten() };
        // Four weights a block and the (tied) head's go through the node.
        let weights = 4 * 2 + 1;
        let step = |on: bool, graphs: bool, savers: Savers, merged: bool| {
            let (_, model, corpus, _) =
                if merged { merged_llama_with(kernels(on)) } else { linear_node_gpt2_with(kernels(on)) };
            let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 8);
            let before = GemmSums::attached();
            crate::ffi::set_autocast(false, true, false).unwrap();
            let out = forward_backward(
                &model,
                &data,
                4,
                2,
                &savers,
                1.0,
                &mut MicroGraphs::new(graphs),
                &mut Progress::default(),
                None,
            );
            crate::ffi::set_autocast(false, false, false).unwrap();
            let (grads, loss) = out.unwrap();
            let tied = model
                .params
                .names
                .iter()
                .position(|n| n == "wte.weight" || n == "model.embed_tokens.weight")
                .unwrap();
            (grads, loss, GemmSums::attached() - before, tied)
        };
        let plain = Savers::default();
        let savers = Savers { checkpoint_every: 1, loss_chunk_tokens: Some(16), ..plain };
        // A merged Llama's block: q, k and v through one node, o, gate and up through one, down.
        let merged_weights = 7 * 2 + 1;
        let cases = [
            ("plain", false, plain, 3 * weights, false),
            ("graphs' mode", true, plain, 4 * weights, false),
            ("savers", false, savers, 0, false),
            ("merged, plain", false, plain, 3 * merged_weights, true),
            ("merged, graphs' mode", true, plain, 4 * merged_weights, true),
        ];
        for (what, graphs, s, attached, merged) in cases {
            let (want, want_loss, none, tied) = step(false, graphs, s, merged);
            let (got, got_loss, n, _) = step(true, graphs, s, merged);
            assert_eq!(none, 0, "{what}: switched off, nothing is added in the node");
            // Checkpointing runs each block's forward twice (without and with its graph).
            assert!(if attached > 0 { n == attached } else { n > 0 }, "{what}: {n} nodes added into a sum");
            assert_eq!(got_loss.to_bits(), want_loss.to_bits(), "{what}: loss");
            assert!(got.iter().all(Tensor::defined), "{what}: every sum is there");
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                // The tied embedding's two gradients are added one at a time, not summed first:
                // another rounding order, within fp32's last bits of the largest value.
                let diff = (a - b).abs().max().double_value(&[]);
                let within = if i == tied { 1e-6 * b.abs().max().double_value(&[]) } else { 0.0 };
                assert!(a.equal(b) || diff <= within, "{what}: gradient {i} differs by {diff}");
            }
        }
        // Inside a scope a micro-step's backward gives no gradient for the node's weights: it is
        // in the sums, which held zeros.
        let (_, model, corpus, _) = linear_node_gpt2_with(kernels(true));
        let (x, y) = Sampler { seed: 1, seq_len: 8 }.train_batch(&corpus, 4, 0..2, Device::Cpu).unwrap();
        let sums: Vec<Tensor> = model.params.tensors.iter().map(Tensor::zeros_like).collect();
        let scope = model.sum_weight_grads_into(&sums).unwrap().expect("the switch is on");
        assert_eq!(scope.held(), sums.len(), "every parameter can take a sum; the node looks up its weights");
        crate::ffi::set_autocast(false, true, false).unwrap();
        let out = loss_and_grads(&model, &x, &y, 1.0, 0, &plain);
        crate::ffi::set_autocast(false, false, false).unwrap();
        drop(scope);
        let (_, grads) = out.unwrap();
        let added: Vec<bool> = grads.iter().map(|g| !g.defined()).collect();
        assert_eq!(
            added.iter().filter(|&&a| a).count() as u64,
            weights - 1,
            "the blocks' weights (the tied head's also gets the embedding's)"
        );
        for ((g, sum), added) in grads.iter().zip(&sums).zip(added) {
            assert_eq!(
                sum.abs().sum(tch::Kind::Float).double_value(&[]) > 0.0,
                added || g.dim() == 2 && g.size()[0] == 64,
                "a sum is written where the node added"
            );
        }
        // A graph made inside a scope whose backward runs after it ended: the usual gradient.
        let scope = model.sum_weight_grads_into(&sums).unwrap().expect("the switch is on");
        crate::ffi::set_autocast(false, true, false).unwrap();
        let loss = model.loss(&x, &y, true, None);
        crate::ffi::set_autocast(false, false, false).unwrap();
        drop(scope);
        let late = Tensor::f_run_backward(&[&loss.unwrap()], &model.params.tensors, false, false).unwrap();
        assert!(late.iter().all(Tensor::defined), "a scope that ended adds nothing");
        // A scope started replaces the last; dropping the replaced one leaves the new one open.
        let (first, second) = (
            model.sum_weight_grads_into(&sums).unwrap().unwrap(),
            model.sum_weight_grads_into(&sums).unwrap().unwrap(),
        );
        drop(first);
        crate::ffi::set_autocast(false, true, false).unwrap();
        let out = loss_and_grads(&model, &x, &y, 1.0, 0, &plain);
        crate::ffi::set_autocast(false, false, false).unwrap();
        drop(second);
        assert!(out.unwrap().1.iter().any(|g| !g.defined()), "the second scope is still open");
        let off = linear_node_gpt2_with(kernels(false)).1;
        assert!(off.sum_weight_grads_into(&sums).unwrap().is_none(), "switched off: no scope");
    }

    /// Under `dist.overlap` the last micro-step runs outside `kernels.accumulate_in_gemm`'s
    /// sums, so that every block weight's gradient reaches its bucket's hook inside backward:
    /// with the node's kernels emulated, every block bucket starts there (none would with the
    /// sums: the node adds past the hooks), and the step's gradients are those without overlap.
    #[test]
    fn overlapped_buckets_see_every_block_gradient_with_the_sums_in_the_gemms() {
        use crate::config::KernelsConfig;
        let _emulation = CudaEmulation::start();
        let kernels = KernelsConfig { fused_linear: true, accumulate_in_gemm: true, ..KernelsConfig::aten() };
        let (_, model, corpus, _) = linear_node_gpt2_with(kernels);
        let data = StepData::single(&corpus, Sampler { seed: 1, seq_len: 8 }, Device::Cpu, 8);
        let run = |dist: Option<&crate::distributed::Dist>| {
            crate::ffi::set_autocast(false, true, false).unwrap();
            let out = forward_backward(
                &model,
                &data,
                4,
                3,
                &Savers::default(),
                1.0,
                &mut MicroGraphs::new(false),
                &mut Progress::default(),
                dist,
            );
            crate::ffi::set_autocast(false, false, false).unwrap();
            out.unwrap().0
        };
        let want = run(None);
        let mut d = crate::distributed::overlap_tests::alone();
        let hooked = model.block_params();
        // Four bytes a bucket at least: one parameter each.
        d.plan_buckets(&model.params.tensors, 4, Device::Cpu, Some(&hooked)).unwrap();
        let mut got = run(Some(&d));
        let early = d.reduce_all(Some(&got)).unwrap();
        assert_eq!(early, Some(hooked.iter().filter(|&&h| h).count()), "every block parameter's bucket");
        d.average_gradients(&mut got).unwrap();
        let tied = model.params.names.iter().position(|n| n == "wte.weight").unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            // The tied embedding's gradients are added in another order with the sums than
            // without (the head's in the GEMM, or after): fp32's last bits of the largest value.
            let diff = (a - b).abs().max().double_value(&[]);
            let within = if i == tied { 1e-6 * b.abs().max().double_value(&[]) } else { 0.0 };
            assert!(
                a.equal(b) || diff <= within,
                "gradient {i} ({}) differs by {diff}",
                model.params.names[i]
            );
        }
    }

    #[test]
    fn a_real_allocation_failure_comes_back_as_an_oom_error() {
        // 2^50 floats: the CPU allocator refuses, libtorch raises, tch returns Err.
        let err = Tensor::f_empty([1i64 << 50], (tch::Kind::Float, Device::Cpu)).unwrap_err().to_string();
        assert!(
            matches!(crate::guard::classify(&err), crate::guard::ErrorKind::OutOfMemory { requested_bytes: Some(b) } if b == 1 << 52),
            "{err}"
        );
    }
}
