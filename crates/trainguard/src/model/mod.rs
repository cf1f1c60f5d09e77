//! Models trainguard trains, behind one interface. Owns each architecture's parameter
//! description ([`describe`]: names, shapes, initialisation — what the planner counts too),
//! what the forward keeps for backward ([`saved_activations`], which the planner counts too),
//! parameter creation, the fallible forward pass in pieces (embedding, blocks, head: what
//! activation checkpointing and the chunked loss run separately) and the loss. It does not own
//! gradients or optimizer state. The vocabulary matrices are padded to `model.pad_vocab_to`
//! rows (aligned GEMM shapes) while the model's behaviour stays that of the user's vocabulary:
//! padded rows start at zero, [`Model::head`] masks their logits to -inf (so the loss, its
//! gradient and sampling never see them), [`Model::forward`] returns the user's columns only,
//! [`Model::user_tensor`] / [`Model::copy_user_tensor`] give import and export the user's
//! shapes, and [`Model::optimizer_params`] gives the optimizer the user's rows. Adding an architecture: one file with its `tensors()`, its
//! `saved()` and a [`Decoder`], and one arm in [`describe`], [`saved_activations`] and
//! [`Model::new`] — the only places that match on `model.arch`.
pub mod documents;
mod gpt2;
mod layers;
pub use layers::LAYER_NORM_EPS;
mod llama;
pub mod memory;
mod params;
mod spec;

pub use params::{Init, Params, HOST_ALLOCATION_FAILED};
pub use spec::{ParamGroups, Part, TensorSpec};

use crate::config::{Arch, KernelsConfig, ModelConfig};
use crate::ffi::linear::GemmSums;
use crate::ffi::ShimError;
use documents::Documents;
use layers::{Output, Stream};
use tch::{Device, Kind, Reduction, TchError, Tensor};

/// One architecture's network over its parameters. `dropout` is already 0 outside training.
trait Decoder: Send {
    /// Token ids `[b, t]` → hidden states `[b, t, c]`; with `documents`, positions inside them.
    fn embed(
        &self,
        idx: &Tensor,
        documents: Option<&Documents>,
        dropout: f64,
        train: bool,
    ) -> Result<Tensor, TchError>;
    /// Block `i` on the stream `[b, t, c]`: its first norm adds what the previous block left
    /// pending; its own output, computed for `output`, is left pending in turn.
    fn block(
        &self,
        i: usize,
        x: &Stream,
        documents: Option<&Documents>,
        dropout: f64,
        train: bool,
        output: Output,
    ) -> Result<Stream, TchError>;
    /// Final norm (adding what the last block left pending) and LM head: logits `[…, padded
    /// vocab]` for the stream `[…, c]`, `mask` (the padded vocabulary's) added as the head's bias.
    fn head(&self, x: &Stream, mask: Option<&Tensor>) -> Result<Tensor, TchError>;
    fn n_blocks(&self) -> usize;
}

/// The parameters of `cfg`'s architecture, in creation (and checkpoint) order.
pub fn describe(cfg: &ModelConfig) -> Vec<TensorSpec> {
    match cfg.arch {
        Arch::Gpt2 => gpt2::tensors(cfg),
        Arch::Llama => llama::tensors(cfg),
    }
}

/// What `cfg`'s architecture's forward keeps for backward in regime `r` (the planner counts it).
pub fn saved_activations(cfg: &ModelConfig, r: memory::Regime) -> memory::Activations {
    match cfg.arch {
        Arch::Gpt2 => gpt2::saved(cfg, r),
        Arch::Llama => llama::saved(cfg, r),
    }
}

/// Which of our autograd nodes a model's layers take (decided once, in [`Model::with_kernels`]:
/// the switch is on and the kernels run on the device).
#[derive(Debug, Clone, Copy, Default)]
pub struct OurNodes {
    /// The norms with their residual add and cast (`kernels.fused_residual_norm`).
    pub norms: bool,
    /// SwiGLU's product (`kernels.fused_swiglu`).
    pub swiglu: bool,
    /// RoPE's rotation of q and k (`kernels.fused_rope`).
    pub rope: bool,
    /// The linear layers and the LM head (`kernels.fused_linear`).
    pub linear: bool,
    /// GPT-2's MLP up-projection with its GELU (`kernels.fused_gelu`, inside the linear node).
    pub gelu: bool,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub params: Params,
    groups: ParamGroups,
    /// Per parameter: the user's vocabulary rows of a padded vocabulary matrix.
    user_rows: Vec<Option<i64>>,
    /// `[padded vocab]`: 0 for the user's tokens, -inf for the padding; none without padding.
    vocab_mask: Option<Tensor>,
    /// `kernels.fused_cross_entropy`: the loss as our own autograd node.
    fused_loss: bool,
    /// `kernels.fused_loss_gradient`: in training that node writes the logits' gradient in its
    /// forward.
    loss_gradient: crate::ffi::loss::Gradient,
    /// `kernels.accumulate_in_gemm`, where the linear node runs.
    weight_grads_in_gemm: bool,
    /// `data.document_mask`: the id that ends a document; attention stays inside documents.
    document_eos: Option<i64>,
    net: Box<dyn Decoder>,
}

impl Model {
    /// Builds the model on `device` with the default kernels; weights depend only on `seed`
    /// and the config.
    pub fn new(cfg: &ModelConfig, seed: u64, device: Device) -> Result<Self, TchError> {
        Self::with_kernels(cfg, KernelsConfig::default(), seed, device)
    }

    /// As [`Model::new`], with `kernels` choosing how the forward computes (not what: the
    /// weights and the maths are the same whatever it says).
    pub fn with_kernels(
        cfg: &ModelConfig,
        kernels: KernelsConfig,
        seed: u64,
        device: Device,
    ) -> Result<Self, TchError> {
        let specs = describe(cfg);
        let mut params = Params { seed, ..Params::default() };
        for s in &specs {
            let t = params.add(s.name.clone(), &s.shape, s.init, s.decay, device)?;
            // The user's rows were drawn first, exactly as without padding (each parameter's
            // values are one stream); the padded rows start at zero.
            if let Some(rows) = s.user_rows {
                let _no_grad = tch::no_grad_guard();
                let _ = t.f_narrow(0, rows, s.shape[0] - rows)?.f_zero_()?;
            }
        }
        // Our nodes where their kernels run (CUDA, or the host emulation in tests).
        let runs = crate::ffi::kernels::runs_cuda_kernels(device);
        let ours = OurNodes {
            norms: kernels.fused_residual_norm && runs,
            swiglu: kernels.fused_swiglu && runs,
            rope: kernels.fused_rope && runs,
            linear: kernels.fused_linear && runs,
            gelu: kernels.fused_gelu && kernels.fused_linear && runs,
        };
        let net: Box<dyn Decoder> = match cfg.arch {
            Arch::Gpt2 => Box::new(gpt2::Gpt2::new(cfg, &params, ours)?),
            Arch::Llama => Box::new(llama::Llama::new(cfg, kernels, &params, device, ours)?),
        };
        let groups = ParamGroups::of(&specs, cfg.n_layer);
        let user_rows = specs.iter().map(|s| s.user_rows).collect();
        let (v, vp) = (cfg.vocab_size as i64, cfg.padded_vocab() as i64);
        let vocab_mask = match vp > v {
            true => {
                let m = Tensor::f_zeros([vp], (tch::Kind::Float, device))?;
                let _ = m.f_narrow(0, v, vp - v)?.f_fill_(f64::NEG_INFINITY)?;
                Some(m)
            }
            false => None,
        };
        // Our NVRTC kernels are compiled for the device once; a failure names the first switch on.
        let switches = [
            (
                kernels.fused_cross_entropy,
                "the fused cross-entropy's CUDA kernels (kernels.fused_cross_entropy)",
            ),
            (kernels.fused_residual_norm, "the residual norm's CUDA kernels (kernels.fused_residual_norm)"),
            (kernels.fused_swiglu, "SwiGLU's CUDA kernels (kernels.fused_swiglu)"),
            (kernels.fused_rope, "RoPE's CUDA kernels (kernels.fused_rope)"),
            (kernels.fused_linear, "the linear node's CUDA kernels (kernels.fused_linear)"),
        ];
        if let Some((_, switch)) = switches.iter().find(|(on, _)| *on) {
            crate::ffi::kernels::prepare_cuda(device)
                .map_err(|e| TchError::Torch(format!("{switch} cannot be used: {e}")))?;
        }
        Ok(Self {
            cfg: cfg.clone(),
            params,
            groups,
            user_rows,
            vocab_mask,
            fused_loss: kernels.fused_cross_entropy,
            loss_gradient: match kernels.fused_loss_gradient {
                true => crate::ffi::loss::Gradient::InForward,
                false => crate::ffi::loss::Gradient::InBackward,
            },
            weight_grads_in_gemm: kernels.accumulate_in_gemm && ours.linear,
            document_eos: None,
            net,
        })
    }

    /// From now on attention stays inside documents, which end at `eos` (`data.document_mask`).
    pub fn mask_documents(&mut self, eos: u32) {
        self.document_eos = Some(eos as i64);
    }

    /// The documents of the batch `idx` `[b, t]` when documents are masked: what
    /// [`Model::embed`] and [`Model::block`] take, computed once per micro-batch.
    pub fn documents(&self, idx: &Tensor) -> Result<Option<Documents>, TchError> {
        self.document_eos.map(|eos| Documents::of(idx, eos)).transpose()
    }

    /// With `kernels.accumulate_in_gemm` where the linear node runs: a scope in which that node
    /// adds the weights' gradients into `accs` (one per parameter, in the model's order) inside
    /// its GEMMs, and backward returns none for them (undefined tensors). None otherwise.
    pub fn sum_weight_grads_into(&self, accs: &[Tensor]) -> Result<Option<GemmSums>, ShimError> {
        self.weight_grads_in_gemm.then(|| GemmSums::start(&self.params.tensors, accs)).transpose()
    }

    /// Number of trainable parameters (a tied head counted once).
    pub fn num_params(&self) -> i64 {
        self.params.count()
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]`: the user's vocabulary only (a view of
    /// the padded logits). `seed`: reseeds the generator before the embedding and each block
    /// (dropout), so a recomputed block draws the same masks.
    pub fn forward(&self, idx: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        self.padded_logits(idx, train, seed)?.f_narrow(-1, 0, self.cfg.vocab_size as i64)
    }

    /// Logits `[b, t, padded vocab]`, the padded columns -inf. Each block's output stays pending
    /// for the next norm to add (one pass with our node).
    fn padded_logits(&self, idx: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        let documents = self.documents(idx)?;
        let documents = documents.as_ref();
        let mut x = Stream::settled_at(&self.embed(idx, documents, train, seed)?);
        for i in 0..self.n_blocks() {
            x = self.stream_block(i, &x, documents, train, seed, Output::Values)?;
        }
        self.net.head(&x, self.vocab_mask(x.x.kind())?.as_ref())
    }

    pub fn n_blocks(&self) -> usize {
        self.net.n_blocks()
    }

    fn dropout(&self, train: bool, seed: Option<u64>, stage: u64) -> f64 {
        let p = if train { self.cfg.dropout } else { 0.0 };
        if let (true, Some(s)) = (p > 0.0, seed) {
            tch::manual_seed(crate::data::mix(&[s, stage]) as i64);
        }
        p
    }

    /// Embeddings (and dropout): `[b, t, c]`; `documents`: [`Model::documents`] of `idx`.
    pub fn embed(
        &self,
        idx: &Tensor,
        documents: Option<&Documents>,
        train: bool,
        seed: Option<u64>,
    ) -> Result<Tensor, TchError> {
        self.net.embed(idx, documents, self.dropout(train, seed, 0), train)
    }

    /// Block `i` on `x` `[b, t, c]`, its output added to the stream (what a checkpointed segment
    /// keeps; [`Model::forward`] leaves it for the next norm to add).
    pub fn block(
        &self,
        i: usize,
        x: &Tensor,
        documents: Option<&Documents>,
        train: bool,
        seed: Option<u64>,
    ) -> Result<Tensor, TchError> {
        self.stream_block(i, &Stream::settled_at(x), documents, train, seed, Output::Values)?.settle()
    }

    /// Block `i` on `x` for a recomputation that only pushes a gradient back through it: the
    /// stream and the block's output, not added, the output's last product not computed
    /// ([`Output::GraphOnly`]). The block's output gradient is each one's.
    pub fn block_graph(
        &self,
        i: usize,
        x: &Tensor,
        documents: Option<&Documents>,
        train: bool,
        seed: Option<u64>,
    ) -> Result<Vec<Tensor>, TchError> {
        let s = self.stream_block(i, &Stream::settled_at(x), documents, train, seed, Output::GraphOnly)?;
        Ok([s.x].into_iter().chain(s.pending).collect())
    }

    /// Block `i` on the stream `x`, its own output left pending (its dropout stage `1 + i`).
    fn stream_block(
        &self,
        i: usize,
        x: &Stream,
        documents: Option<&Documents>,
        train: bool,
        seed: Option<u64>,
        output: Output,
    ) -> Result<Stream, TchError> {
        self.net.block(i, x, documents, self.dropout(train, seed, 1 + i as u64), train, output)
    }

    /// Final norm and the LM head: logits `[…, padded vocab]` for hidden states `[…, c]`, the
    /// columns past the user's vocabulary -inf (a softmax gives them exactly 0 and their
    /// gradient is exactly 0, so the loss and every gradient equal the unpadded model's and the
    /// padded rows stay zero). The mask is the head's bias, added inside the GEMM (addmm, a
    /// cuBLASLt epilogue): no second logits tensor, and unlike an in-place fill of the padded
    /// columns no logits-sized copy in backward. What the loss reads: a contiguous, aligned matrix.
    pub fn head(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.net.head(&Stream::settled_at(x), self.vocab_mask(x.kind())?.as_ref())
    }

    /// The padded vocabulary's mask in the stream's dtype `kind` (bf16-pure's; autocast casts
    /// an fp32 one itself).
    fn vocab_mask(&self, kind: Kind) -> Result<Option<Tensor>, TchError> {
        self.vocab_mask.as_ref().map(|m| m.f_to_kind(kind)).transpose()
    }

    /// Mean cross-entropy of the next-token predictions for inputs `x` and targets `y`.
    pub fn loss(&self, x: &Tensor, y: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        self.cross_entropy(&self.padded_logits(x, train, seed)?, y, Reduction::Mean)
    }

    /// [`Model::loss`] for evaluation (no dropout, no graph) with the final norm, the head and
    /// the cross-entropy over `chunk` tokens at a time (`memory.loss_chunk_tokens`), as the
    /// chunked training step computes it: never the batch × seq × vocab logits at once.
    pub fn loss_in_chunks(&self, x: &Tensor, y: &Tensor, chunk: usize) -> Result<Tensor, TchError> {
        let documents = self.documents(x)?;
        let mut hidden = self.embed(x, documents.as_ref(), false, None)?;
        for i in 0..self.n_blocks() {
            hidden = self.block(i, &hidden, documents.as_ref(), false, None)?;
        }
        let c = *hidden.size().last().expect("hidden states have a last dimension");
        let (flat, targets) = (hidden.f_reshape([-1, c])?, y.f_reshape([-1])?);
        let n = flat.size()[0];
        let mut total = Tensor::f_zeros([], (tch::Kind::Double, flat.device()))?;
        let mut start = 0;
        while start < n {
            let len = (chunk as i64).min(n - start);
            let logits = self.head(&flat.f_narrow(0, start, len)?)?;
            let sum = self.cross_entropy(&logits, &targets.f_narrow(0, start, len)?, Reduction::Sum)?;
            total = total.f_add(&sum.f_to_kind(tch::Kind::Double)?)?;
            start += len;
        }
        total.f_div_scalar(n as f64)
    }

    /// `weight` · the mean cross-entropy of the next-token predictions for inputs `x` and
    /// targets `y`, for training: a backward from it gives the step's gradients
    /// ([`Model::weighted_cross_entropy`]).
    pub fn weighted_loss(
        &self,
        x: &Tensor,
        y: &Tensor,
        weight: f64,
        seed: Option<u64>,
    ) -> Result<Tensor, TchError> {
        self.weighted_cross_entropy(self.padded_logits(x, true, seed)?, y, Reduction::Mean, weight)
    }

    /// `weight` · [`Model::cross_entropy`] of `logits`, which it takes: with our node and
    /// `kernels.fused_loss_gradient`, and autograd wanting the logits' gradient, the node writes
    /// it over them in its forward, for a backward from this loss.
    pub fn weighted_cross_entropy(
        &self,
        logits: Tensor,
        y: &Tensor,
        reduction: Reduction,
        weight: f64,
    ) -> Result<Tensor, TchError> {
        match (self.fused_loss, our_node_mean(reduction)) {
            (true, Some(mean)) => {
                Ok(crate::ffi::loss::weighted_cross_entropy(logits, y, mean, weight, self.loss_gradient)?)
            }
            _ => cross_entropy(&logits, y, reduction)?.f_mul_scalar(weight),
        }
    }

    /// Cross-entropy of `logits` `[…, v]` against targets `[…]` (`Mean` or `Sum`) as
    /// `kernels.fused_cross_entropy` says: our autograd node, or PyTorch's ([`cross_entropy`]).
    pub fn cross_entropy(
        &self,
        logits: &Tensor,
        y: &Tensor,
        reduction: Reduction,
    ) -> Result<Tensor, TchError> {
        match (self.fused_loss, our_node_mean(reduction)) {
            (true, Some(mean)) => Ok(crate::ffi::loss::cross_entropy(logits, y, mean)?),
            _ => cross_entropy(logits, y, reduction),
        }
    }

    /// Parameter `i` as the user's vocabulary shapes it: a padded vocabulary matrix cut to its
    /// user rows (a view), any other parameter as it is.
    pub fn user_tensor(&self, i: usize) -> Result<Tensor, TchError> {
        let t = &self.params.tensors[i];
        match self.user_rows[i] {
            Some(rows) => t.f_narrow(0, 0, rows),
            None => Ok(t.shallow_clone()),
        }
    }

    /// Which parameters are the blocks' weight matrices (2-D, decayed, inside a block): what
    /// Muon orthogonalises; the embeddings and the LM head are not.
    pub fn block_matrices(&self) -> Vec<bool> {
        let mut out = vec![false; self.params.tensors.len()];
        for &i in self.groups.blocks.iter().flatten() {
            out[i] = self.params.decay[i] && self.params.tensors[i].dim() == 2;
        }
        out
    }

    /// Which parameters are inside a block (whose gradient backward makes once, in one piece:
    /// `dist.overlap` all-reduces their buckets from inside backward).
    pub fn block_params(&self) -> Vec<bool> {
        let mut out = vec![false; self.params.tensors.len()];
        self.groups.blocks.iter().flatten().for_each(|&i| out[i] = true);
        out
    }

    /// What the optimizer updates: every parameter, a padded vocabulary matrix as its user rows
    /// (a contiguous view of the same storage). Per-tensor statistics (Adafactor's RMS terms,
    /// 8-bit AdamW's blocks) then see exactly the unpadded model's tensors, the optimizer state
    /// has the user's shapes, and the padded rows are never written.
    pub fn optimizer_params(&self) -> Result<Vec<Tensor>, TchError> {
        (0..self.params.tensors.len()).map(|i| self.user_tensor(i)).collect()
    }

    /// `grads` (one per parameter, full shapes) cut as [`Model::optimizer_params`] cuts them.
    pub fn optimizer_grads(&self, grads: &[Tensor]) -> Result<Vec<Tensor>, TchError> {
        grads.iter().enumerate().map(|(i, g)| self.optimizer_grad(i, g)).collect()
    }

    /// Parameter `i`'s gradient `g` cut as [`Model::optimizer_params`] cuts the parameter.
    pub fn optimizer_grad(&self, i: usize, g: &Tensor) -> Result<Tensor, TchError> {
        match self.user_rows[i] {
            Some(r) => g.f_narrow(0, 0, r),
            None => Ok(g.shallow_clone()),
        }
    }

    /// The shape [`Model::user_tensor`] has.
    pub fn user_shape(&self, i: usize) -> Vec<i64> {
        let mut s = self.params.tensors[i].size();
        if let Some(rows) = self.user_rows[i] {
            s[0] = rows;
        }
        s
    }

    /// Copies `src` into parameter `i`: the padded shape as it is (a checkpoint), or the user's
    /// shape (an import: the padded rows are then set to zero). `Err` with both shapes otherwise.
    pub fn copy_user_tensor(&self, i: usize, src: &Tensor) -> Result<(), String> {
        let _no_grad = tch::no_grad_guard();
        let p = self.params.tensors[i].shallow_clone();
        let (got, full, user) = (src.size(), p.size(), self.user_shape(i));
        let res = if got == full {
            p.shallow_clone().f_copy_(src).map(drop)
        } else if got == user {
            let rows = user[0];
            p.f_narrow(0, 0, rows)
                .and_then(|mut d| d.f_copy_(src))
                .and_then(|_| p.f_narrow(0, rows, full[0] - rows)?.f_zero_())
                .map(drop)
        } else {
            return Err(format!("shape {got:?}, the model needs {user:?}"));
        };
        res.map_err(|e| e.to_string())
    }

    /// Indices into `params` of the embedding's, each block's and the head's parameters.
    pub fn param_groups(&self) -> ParamGroups {
        self.groups.clone()
    }
}

/// Our loss node's reduction for `reduction`: mean (true) or sum (false); none for per-token
/// losses, which PyTorch's computes.
fn our_node_mean(reduction: Reduction) -> Option<bool> {
    match reduction {
        Reduction::Mean => Some(true),
        Reduction::Sum => Some(false),
        _ => None,
    }
}

/// Cross-entropy of logits `[…, v]` against targets `[…]`, as PyTorch computes it.
pub fn cross_entropy(logits: &Tensor, y: &Tensor, reduction: Reduction) -> Result<Tensor, TchError> {
    let v = *logits.size().last().unwrap_or(&1);
    logits.f_view([-1, v])?.f_cross_entropy_loss::<Tensor>(&y.f_reshape([-1])?, None, reduction, -100, 0.0)
}

#[cfg(test)]
mod padding_tests {
    //! The padded vocabulary (`model.pad_vocab_to`) against the unpadded model: same initial
    //! user rows, same loss and gradients (plain and chunked), padded rows zero and unused.
    use super::Model;
    use crate::config::{Arch, Checkpointing, KernelsConfig, ModelConfig};
    use crate::step::savers::{loss_and_grads, Savers};
    use tch::{Device, Kind, Tensor};

    /// Vocabulary 61: 64 rows with the default padding, 61 with `pad_vocab_to: 1`.
    fn configs() -> Vec<ModelConfig> {
        let gpt2 = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 61,
            seq_len: 8,
            ..ModelConfig::default()
        };
        let llama = ModelConfig {
            arch: Arch::Llama,
            n_kv_head: Some(1),
            ffn_hidden: Some(40),
            bias: false,
            ..gpt2.clone()
        };
        vec![gpt2, llama.clone(), ModelConfig { tie_embeddings: false, ..llama }]
    }

    fn pair(cfg: &ModelConfig) -> (Model, Model) {
        let padded = Model::new(cfg, 3, Device::Cpu).unwrap();
        let plain = Model::new(&ModelConfig { pad_vocab_to: 1, ..cfg.clone() }, 3, Device::Cpu).unwrap();
        (padded, plain)
    }

    fn batch() -> (Tensor, Tensor) {
        let x = Tensor::arange(48, (Kind::Int64, Device::Cpu)).remainder(61).view([6, 8]);
        let y = (x.shallow_clone() * 7 + 3).remainder(61);
        (x, y)
    }

    /// Max |a - b| between a padded tensor's user rows and the unpadded one.
    fn user_diff(padded: &Tensor, plain: &Tensor) -> f64 {
        let rows = plain.size()[0];
        (padded.narrow(0, 0, rows) - plain).abs().max().double_value(&[])
    }

    fn padding_max(padded: &Tensor, rows: i64) -> f64 {
        padded.narrow(0, rows, padded.size()[0] - rows).abs().max().double_value(&[])
    }

    #[test]
    fn user_rows_start_bit_identical_and_padded_rows_at_zero() {
        for cfg in configs() {
            let (padded, plain) = pair(&cfg);
            assert_eq!(padded.params.names, plain.params.names);
            for (i, (a, b)) in padded.params.tensors.iter().zip(&plain.params.tensors).enumerate() {
                if a.size() == b.size() {
                    assert!(a.equal(b), "{}", padded.params.names[i]);
                } else {
                    assert_eq!(a.size()[0], 64, "{}", padded.params.names[i]);
                    assert!(
                        a.narrow(0, 0, 61).equal(b),
                        "{}: the user rows are drawn as without padding",
                        padded.params.names[i]
                    );
                    assert_eq!(padding_max(a, 61), 0.0);
                    assert!(padded.user_tensor(i).unwrap().equal(b));
                }
            }
        }
    }

    #[test]
    fn loss_and_gradients_equal_the_unpadded_models_plain_and_chunked() {
        let (x, y) = batch();
        for cfg in configs() {
            let (padded, plain) = pair(&cfg);
            let logits = padded.forward(&x, false, None).unwrap();
            assert_eq!(logits.size(), [6, 8, 61], "forward returns the user's vocabulary");
            for chunk in [None, Some(10)] {
                let savers = Savers::new(Checkpointing::None, false, chunk);
                let (la, ga) = loss_and_grads(&padded, &x, &y, 1.0, 0, &savers).unwrap();
                let (lb, gb) = loss_and_grads(&plain, &x, &y, 1.0, 0, &savers).unwrap();
                let dl = (la.double_value(&[]) - lb.double_value(&[])).abs();
                assert!(dl < 1e-6, "{:?} chunk {chunk:?}: loss differs by {dl:e}", cfg.arch);
                for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
                    let d = user_diff(a, b);
                    assert!(
                        d < 1e-6,
                        "{:?} chunk {chunk:?}: gradient of {} differs by {d:e}",
                        cfg.arch,
                        padded.params.names[i]
                    );
                    if a.size() != b.size() {
                        assert_eq!(padding_max(a, 61), 0.0, "padded rows get exactly zero gradient");
                    }
                }
            }
        }
    }

    /// The fused node through its CPU path and through its CUDA kernels' source emulated on the
    /// host (`ffi::kernels::CudaEmulation`): the CUDA path on real model shapes, with a padded
    /// vocabulary's −inf columns, a chunked loss and checkpointing.
    #[test]
    fn the_fused_loss_gives_pytorchs_loss_and_gradients_plain_chunked_and_checkpointed() {
        let (x, y) = batch();
        let fused_kernels = KernelsConfig { fused_cross_entropy: true, ..KernelsConfig::default() };
        for cfg in configs() {
            let plain = Model::with_kernels(
                &cfg,
                KernelsConfig { fused_cross_entropy: false, ..KernelsConfig::default() },
                3,
                Device::Cpu,
            )
            .unwrap();
            let fused = Model::with_kernels(&cfg, fused_kernels, 3, Device::Cpu).unwrap();
            for (checkpointing, chunk) in [
                (Checkpointing::None, None),
                (Checkpointing::None, Some(10)),
                (Checkpointing::Every(1), Some(16)),
            ] {
                let savers = Savers::new(checkpointing, false, chunk);
                let (lb, gb) = loss_and_grads(&plain, &x, &y, 0.5, 0, &savers).unwrap();
                for emulated in [false, true] {
                    let what = format!(
                        "{:?} {checkpointing:?} chunk {chunk:?}{}",
                        cfg.arch,
                        if emulated { " (CUDA kernels, emulated)" } else { "" }
                    );
                    let emulation = emulated.then(crate::ffi::kernels::CudaEmulation::start);
                    let fused_before =
                        crate::ffi::kernels::CudaEmulation::launches_of("tg_ce_forward_grad_f32");
                    let (la, ga) = loss_and_grads(&fused, &x, &y, 0.5, 0, &savers).unwrap();
                    if let Some(e) = emulation {
                        // Per chunk of the loss one kernel writing the loss and the gradient
                        // (`kernels.fused_loss_gradient`, on by default) and the backward's
                        // rescale check: none fell back to the CPU path.
                        let chunks = chunk.map_or(1, |c| x.numel().div_ceil(c)) as u64;
                        assert_eq!(e.launches(), 2 * chunks, "{what}: kernel launches");
                        assert_eq!(
                            crate::ffi::kernels::CudaEmulation::launches_of("tg_ce_forward_grad_f32")
                                - fused_before,
                            chunks,
                            "{what}: the gradient written in the forward"
                        );
                    }
                    let dl = (la.double_value(&[]) - lb.double_value(&[])).abs();
                    assert!(dl < 1e-6, "{what}: loss differs by {dl:e}");
                    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
                        let d = (a - b).abs().max().double_value(&[]);
                        assert!(d < 1e-6, "{what}: gradient of {} differs by {d:e}", fused.params.names[i]);
                    }
                }
            }
            // Which node ran: PyTorch's refuses a target outside the vocabulary, ours gives NaN.
            let outside = y.full_like(70);
            assert!(plain.loss(&x, &outside, false, None).is_err());
            assert!(
                fused.loss(&x, &outside, false, None).unwrap().double_value(&[]).is_nan(),
                "the fused model computes its loss with the fused node"
            );
        }
    }

    #[test]
    fn the_optimizer_sees_the_user_rows_as_views_of_the_parameters() {
        let (padded, plain) = pair(&configs()[2]);
        let views = padded.optimizer_params().unwrap();
        let grads: Vec<Tensor> = padded.params.tensors.iter().map(|t| t.ones_like()).collect();
        let cut = padded.optimizer_grads(&grads).unwrap();
        for ((v, g), p) in views.iter().zip(&cut).zip(&plain.params.tensors) {
            assert_eq!((v.size(), g.size()), (p.size(), p.size()));
            assert!(v.is_contiguous() && g.is_contiguous(), "fused kernels take them as they are");
        }
        let _no_grad = tch::no_grad_guard();
        let _ = views[0].shallow_clone().fill_(2.0);
        assert_eq!(
            padded.params.tensors[0].narrow(0, 0, 61).min().double_value(&[]),
            2.0,
            "the same storage"
        );
        assert_eq!(padding_max(&padded.params.tensors[0], 61), 0.0, "the padded rows are not in the view");
    }

    #[test]
    fn padded_logits_are_masked_even_if_the_padded_rows_were_not_zero() {
        let (x, _) = batch();
        for cfg in configs() {
            let (padded, _) = pair(&cfg);
            let _no_grad = tch::no_grad_guard();
            for (i, t) in padded.params.tensors.iter().enumerate() {
                if padded.user_shape(i) != t.size() {
                    let _ = t.narrow(0, 61, 3).fill_(1.0);
                }
            }
            let hidden = padded.embed(&x, None, false, None).unwrap();
            let logits = padded.head(&hidden).unwrap();
            assert_eq!(logits.size(), [6, 8, 64]);
            let tail = logits.narrow(-1, 61, 3);
            assert!(tail.eq(f64::NEG_INFINITY).all().int64_value(&[]) == 1, "padded columns are -inf");
            assert!(logits.narrow(-1, 0, 61).isfinite().all().int64_value(&[]) == 1);
        }
    }

    #[test]
    fn user_shaped_tensors_load_into_the_padded_model_and_wrong_shapes_are_refused() {
        let (padded, plain) = pair(&configs()[2]);
        for (i, t) in plain.params.tensors.iter().enumerate() {
            let src = t.detach() + 1.0;
            padded.copy_user_tensor(i, &src).unwrap();
            assert!(padded.user_tensor(i).unwrap().equal(&src));
            if padded.user_shape(i) != padded.params.tensors[i].size() {
                assert_eq!(
                    padding_max(&padded.params.tensors[i], 61),
                    0.0,
                    "an import leaves the padding at zero"
                );
            }
        }
        let err =
            padded.copy_user_tensor(0, &Tensor::zeros([60, 16], (Kind::Float, Device::Cpu))).unwrap_err();
        assert!(err.contains("[60, 16]") && err.contains("[61, 16]"), "{err}");
    }
}

#[cfg(test)]
mod node_tests {
    //! Our autograd nodes on model shapes (`kernels.fused_residual_norm`, `kernels.fused_swiglu`,
    //! `kernels.fused_rope`, `kernels.fused_linear`), with their CUDA kernels (the source emulated on the host: `ffi::kernels::CudaEmulation`).
    use super::Model;
    use crate::config::{Arch, Checkpointing, KernelsConfig, ModelConfig};
    use crate::ffi::kernels::CudaEmulation;
    use crate::step::savers::{loss_and_grads, Savers};
    use tch::{Device, Kind, Tensor};

    fn gpt2() -> ModelConfig {
        ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 32,
            seq_len: 8,
            dropout: 0.0,
            bias: true,
            ..ModelConfig::default()
        }
    }

    fn llama() -> ModelConfig {
        ModelConfig { arch: Arch::Llama, n_kv_head: Some(1), ffn_hidden: Some(40), bias: false, ..gpt2() }
    }

    /// The model `c` built with `on` gives the loss and gradients of the one built with `off`
    /// (the same less the node under test), in fp32 and under bf16 autocast, with
    /// blocks recomputed (checkpointing) too; `launches(bf16, recomputed)` is how many kernel
    /// launches a forward and backward make (every node ran the kernels).
    fn gives_the_plain_models_loss_and_gradients(
        c: &ModelConfig,
        on: KernelsConfig,
        off: KernelsConfig,
        launches: impl Fn(bool, bool) -> u64,
    ) {
        let x = Tensor::arange(32, (Kind::Int64, Device::Cpu)).remainder(32).view([4, 8]);
        let y = (x.shallow_clone() * 5 + 1).remainder(32);
        let plain = Model::with_kernels(c, off, 3, Device::Cpu).unwrap();
        let emulation = CudaEmulation::start();
        let ours = Model::with_kernels(c, on, 3, Device::Cpu).unwrap();
        drop(emulation);
        for (bf16, checkpointing) in [
            (false, Checkpointing::None),
            (true, Checkpointing::None),
            (false, Checkpointing::Every(1)),
            (true, Checkpointing::Every(1)),
        ] {
            let what = format!("{:?}, bf16 autocast {bf16}, {checkpointing:?}", c.arch);
            let savers = Savers::new(checkpointing, false, None);
            let run = |m: &Model, emulated: bool| {
                let emulation = emulated.then(CudaEmulation::start);
                crate::ffi::set_autocast(false, bf16, false).unwrap();
                let out = loss_and_grads(m, &x, &y, 1.0, 0, &savers);
                crate::ffi::set_autocast(false, false, false).unwrap();
                (out.unwrap(), emulation.map(|e| e.launches()))
            };
            let ((lb, gb), _) = run(&plain, false);
            let ((la, ga), launched) = run(&ours, true);
            let recomputed = !matches!(checkpointing, Checkpointing::None);
            assert_eq!(launched, Some(launches(bf16, recomputed)), "{what}: every node ran the kernels");
            let rel =
                |a: &Tensor, b: &Tensor| ((a - b).abs().max() / (b.abs().max() + 1e-12)).double_value(&[]);
            if !bf16 {
                // fp32: the same maths; only the order of operations differs.
                assert!(
                    (la.double_value(&[]) - lb.double_value(&[])).abs() < 1e-5 * lb.double_value(&[]).abs(),
                    "{what}: loss"
                );
                for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
                    assert!(
                        rel(a, b) < 1e-5,
                        "{what}: gradient of {} differs by {:e}",
                        ours.params.names[i],
                        rel(a, b)
                    );
                }
                continue;
            }
            // bf16: both against the fp32 run. The nodes round where autocast rounds, or less
            // often, but autograd sums a residual norm's readers' 16-bit gradients in 16 bits
            // where autocast's casts sum them in fp32 (the Llama's first norm has three readers):
            // ours may be off by a rounding more, not by more than autocast itself.
            let (_, truth) = loss_and_grads(&plain, &x, &y, 1.0, 0, &savers).unwrap();
            for (i, ((a, b), t)) in ga.iter().zip(&gb).zip(&truth).enumerate() {
                let (ours_err, autocast_err) = (rel(a, t), rel(b, t));
                assert!(
                    ours_err <= 2.0 * autocast_err + 1e-3,
                    "{what}: gradient of {}: {ours_err:e} from fp32 against autocast's {autocast_err:e}",
                    ours.params.names[i]
                );
            }
            assert!(
                (la.double_value(&[]) - lb.double_value(&[])).abs() < 1e-3 * lb.double_value(&[]).abs(),
                "{what}: loss"
            );
        }
    }

    /// The residual-norm node: GPT-2's LayerNorms and a Llama's RMSNorms. One launch forward,
    /// three backward per norm; recomputed blocks run their two norms' forwards again.
    #[test]
    fn the_residual_norm_node_gives_the_plain_models_loss_and_gradients() {
        let plain = KernelsConfig::aten();
        for c in [gpt2(), llama()] {
            let norms = 2 * c.n_layer as u64 + 1;
            let on = KernelsConfig { fused_residual_norm: true, ..plain };
            // A norm: one launch forward, two backward (the parameters' bands summed in its pass).
            gives_the_plain_models_loss_and_gradients(&c, on, plain, |_, recomputed| {
                3 * norms + if recomputed { 2 * c.n_layer as u64 } else { 0 }
            });
        }
    }

    /// Each block's output left pending for the next norm to add (what a forward does: with the
    /// node, the add runs in its kernel both ways) gives the bits of the stream settled after
    /// every block (a checkpointed segment's path: ATen's add and autograd's accumulation), loss
    /// and gradients, in fp32 and under bf16 autocast.
    #[test]
    fn a_pending_residual_add_gives_the_settled_streams_bits() {
        let x = Tensor::arange(32, (Kind::Int64, Device::Cpu)).view([4, 8]);
        let y = (x.shallow_clone() * 5 + 1).remainder(32);
        for c in [gpt2(), llama()] {
            let _emulation = CudaEmulation::start();
            let m = Model::with_kernels(
                &c,
                KernelsConfig { fused_residual_norm: true, ..KernelsConfig::aten() },
                3,
                Device::Cpu,
            )
            .unwrap();
            for bf16 in [false, true] {
                crate::ffi::set_autocast(false, bf16, false).unwrap();
                let pending = m.loss(&x, &y, true, None).unwrap();
                let mut h = m.embed(&x, None, true, None).unwrap();
                for i in 0..m.n_blocks() {
                    h = m.block(i, &h, None, true, None).unwrap();
                }
                let settled = m.cross_entropy(&m.head(&h).unwrap(), &y, tch::Reduction::Mean).unwrap();
                crate::ffi::set_autocast(false, false, false).unwrap();
                let params: Vec<&Tensor> = m.params.tensors.iter().collect();
                let (ga, gb) = (
                    Tensor::run_backward(&[&pending], &params, false, false),
                    Tensor::run_backward(&[&settled], &params, false, false),
                );
                assert!(pending.equal(&settled), "{:?} bf16 {bf16}: loss {pending:?} vs {settled:?}", c.arch);
                for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
                    assert!(a.equal(b), "{:?} bf16 {bf16}: gradient of {}", c.arch, m.params.names[i]);
                }
            }
        }
    }

    /// The SwiGLU node and the RoPE node in a Llama, each alone: SwiGLU one launch forward and
    /// one backward per block, RoPE two each (q and k); recomputed blocks run their forwards again.
    #[test]
    fn the_swiglu_and_rope_nodes_give_the_plain_llamas_loss_and_gradients() {
        let plain = KernelsConfig::aten();
        let c = llama();
        let blocks = c.n_layer as u64;
        let swiglu = KernelsConfig { fused_swiglu: true, ..plain };
        gives_the_plain_models_loss_and_gradients(&c, swiglu, plain, |_, recomputed| {
            2 * blocks + if recomputed { blocks } else { 0 }
        });
        let rope = KernelsConfig { fused_rope: true, ..plain };
        gives_the_plain_models_loss_and_gradients(&c, rope, plain, |_, recomputed| {
            4 * blocks + if recomputed { 2 * blocks } else { 0 }
        });
    }

    /// `kernels.merged_projections`: a Llama's q/k/v and gate/up each as one matrix
    /// multiplication give the separate layers' loss and gradients, with biases (Qwen's) and
    /// without, alone and with the SwiGLU and RoPE nodes reading the joint outputs' parts. With
    /// the linear node the column sums count the linear layers that ran: four a biased block
    /// merged (q/k/v, o, gate/up, down), seven separate.
    #[test]
    fn merged_projections_give_the_separate_layers_loss_and_gradients() {
        let plain = KernelsConfig::aten();
        let merged = KernelsConfig { merged_projections: true, ..plain };
        let blocks = llama().n_layer as u64;
        for bias in [false, true] {
            let c = ModelConfig { bias, ..llama() };
            gives_the_plain_models_loss_and_gradients(&c, merged, plain, |_, _| 0);
            let nodes = KernelsConfig { fused_swiglu: true, fused_rope: true, ..merged };
            // SwiGLU's and the joint RoPE node's one launch each way a block.
            gives_the_plain_models_loss_and_gradients(&c, nodes, plain, |_, recomputed| {
                4 * blocks + if recomputed { 2 * blocks } else { 0 }
            });
        }
        let biased = ModelConfig { bias: true, ..llama() };
        let linear = KernelsConfig { fused_linear: true, ..plain };
        gives_the_plain_models_loss_and_gradients(
            &biased,
            KernelsConfig { merged_projections: true, ..linear },
            plain,
            |bf16, _| if bf16 { 4 * 2 * blocks } else { 0 },
        );
        gives_the_plain_models_loss_and_gradients(&biased, linear, plain, |bf16, _| {
            if bf16 {
                7 * 2 * blocks
            } else {
                0
            }
        });
    }

    /// The linear node (only under a 16-bit autocast): in GPT-2 its four biased layers a block
    /// launch the column sums twice each in backward, recomputed or not; the LM head's padding
    /// mask takes none. The Llama's layers have no bias: no launch, the same gradients.
    #[test]
    fn the_linear_node_gives_the_plain_models_loss_and_gradients() {
        let plain = KernelsConfig::aten();
        let on = KernelsConfig { fused_linear: true, ..plain };
        let g = gpt2();
        assert!(g.padded_vocab() > g.vocab_size, "the head has its padding mask");
        gives_the_plain_models_loss_and_gradients(&g, on, plain, |bf16, _| {
            if bf16 {
                4 * 2 * g.n_layer as u64
            } else {
                0
            }
        });
        gives_the_plain_models_loss_and_gradients(&llama(), on, plain, |_, _| 0);
    }

    /// `kernels.fused_gelu`: GPT-2's MLP up-projection with its GELU in the linear node. With
    /// biases its GELU kernel takes the place of the layer's column sums (the same count of
    /// launches); without, it is the one launch a block; recomputed blocks run it again only in
    /// backward, as the rest.
    #[test]
    fn the_linear_gelu_node_gives_the_plain_gpt2s_loss_and_gradients() {
        let plain = KernelsConfig::aten();
        let on = KernelsConfig { fused_linear: true, fused_gelu: true, ..plain };
        let g = gpt2();
        assert_eq!(4 * g.n_embd % 8, 0, "the up-projection's rows fit the GELU kernel");
        let gelu_launches = || CudaEmulation::launches_of("tg_gelu_backward_bands_bf16");
        let before = gelu_launches();
        gives_the_plain_models_loss_and_gradients(&g, on, plain, |bf16, _| {
            if bf16 {
                4 * 2 * g.n_layer as u64
            } else {
                0
            }
        });
        assert!(gelu_launches() > before, "the GELU kernel ran, in place of the up-projection's column sums");
        let unbiased = ModelConfig { bias: false, ..g };
        gives_the_plain_models_loss_and_gradients(&unbiased, on, plain, |bf16, _| {
            if bf16 {
                unbiased.n_layer as u64
            } else {
                0
            }
        });
        // Without the linear node the switch has nothing to fuse into: ATen's ops, no launch.
        gives_the_plain_models_loss_and_gradients(
            &unbiased,
            KernelsConfig { fused_gelu: true, ..plain },
            plain,
            |_, _| 0,
        );
    }
}
