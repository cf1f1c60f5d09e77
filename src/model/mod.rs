//! Models trainguard trains, behind one interface. Owns each architecture's parameter
//! description ([`describe`]: names, shapes, initialisation — what the planner counts too),
//! what the forward keeps for backward ([`saved_activations`], which the planner counts too),
//! parameter creation, the fallible forward pass in pieces (embedding, blocks, head: what
//! activation checkpointing and the chunked loss run separately) and the loss. It does not own
//! gradients or optimizer state. Adding an architecture: one file with its `tensors()`, its
//! `saved()` and a [`Decoder`], and one arm in [`describe`], [`saved_activations`] and
//! [`Model::new`] — the only places that match on `model.arch`.
mod gpt2;
mod layers;
mod llama;
pub mod memory;
mod params;
mod spec;

pub use memory::saved_activations;
pub use params::{Init, Params, HOST_ALLOCATION_FAILED};
pub use spec::{ParamGroups, Part, TensorSpec};

use crate::config::{Arch, ModelConfig};
use tch::{Device, Reduction, TchError, Tensor};

/// One architecture's network over its parameters. `dropout` is already 0 outside training.
trait Decoder: Send {
    /// Token ids `[b, t]` → hidden states `[b, t, c]`.
    fn embed(&self, idx: &Tensor, dropout: f64, train: bool) -> Result<Tensor, TchError>;
    /// Block `i` on hidden states `[b, t, c]`.
    fn block(&self, i: usize, x: &Tensor, dropout: f64, train: bool) -> Result<Tensor, TchError>;
    /// Final norm and LM head: logits `[…, vocab]` for hidden states `[…, c]`.
    fn head(&self, x: &Tensor) -> Result<Tensor, TchError>;
    fn n_blocks(&self) -> usize;
}

/// The parameters of `cfg`'s architecture, in creation (and checkpoint) order.
pub fn describe(cfg: &ModelConfig) -> Vec<TensorSpec> {
    match cfg.arch {
        Arch::Gpt2 => gpt2::tensors(cfg),
        Arch::Llama => llama::tensors(cfg),
    }
}

pub struct Model {
    pub cfg: ModelConfig,
    pub params: Params,
    groups: ParamGroups,
    net: Box<dyn Decoder>,
}

impl Model {
    /// Builds the model on `device`; weights depend only on `seed` and the config.
    pub fn new(cfg: &ModelConfig, seed: u64, device: Device) -> Result<Self, TchError> {
        let specs = describe(cfg);
        let mut params = Params { seed, ..Params::default() };
        for s in &specs {
            let _ = params.add(s.name.clone(), &s.shape, s.init, s.decay, device)?;
        }
        let net: Box<dyn Decoder> = match cfg.arch {
            Arch::Gpt2 => Box::new(gpt2::Gpt2::new(cfg, &params)?),
            Arch::Llama => Box::new(llama::Llama::new(cfg, &params, device)?),
        };
        let groups = ParamGroups::of(&specs, cfg.n_layer);
        Ok(Self { cfg: cfg.clone(), params, groups, net })
    }

    /// Number of trainable parameters (a tied head counted once).
    pub fn num_params(&self) -> i64 {
        self.params.count()
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]`. `seed`: reseeds the generator before the
    /// embedding and each block (dropout), so a recomputed block draws the same masks.
    pub fn forward(&self, idx: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        let mut x = self.embed(idx, train, seed)?;
        for i in 0..self.n_blocks() {
            x = self.block(i, &x, train, seed)?;
        }
        self.head(&x)
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

    /// Embeddings (and dropout): `[b, t, c]`.
    pub fn embed(&self, idx: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        self.net.embed(idx, self.dropout(train, seed, 0), train)
    }

    /// Block `i` on `x` `[b, t, c]`.
    pub fn block(&self, i: usize, x: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        self.net.block(i, x, self.dropout(train, seed, 1 + i as u64), train)
    }

    /// Final norm and the LM head: logits `[…, vocab]` for hidden states `[…, c]`.
    pub fn head(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.net.head(x)
    }

    /// Mean cross-entropy of the next-token predictions for inputs `x` and targets `y`.
    pub fn loss(&self, x: &Tensor, y: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        cross_entropy(&self.forward(x, train, seed)?, y, Reduction::Mean)
    }

    /// Indices into `params` of the embedding's, each block's and the head's parameters.
    pub fn param_groups(&self) -> ParamGroups {
        self.groups.clone()
    }
}

/// Cross-entropy of logits `[…, v]` against targets `[…]`.
pub fn cross_entropy(logits: &Tensor, y: &Tensor, reduction: Reduction) -> Result<Tensor, TchError> {
    let v = *logits.size().last().unwrap_or(&1);
    logits.f_view([-1, v])?.f_cross_entropy_loss::<Tensor>(&y.f_reshape([-1])?, None, reduction, -100, 0.0)
}
