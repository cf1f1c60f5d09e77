//! A GPT-2-style decoder: token + learned position embeddings, pre-LayerNorm blocks with causal
//! self-attention (`scaled_dot_product_attention`, which picks flash / memory-efficient kernels
//! on CUDA) and a GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
//! Initialisation follows GPT-2: N(0, 0.02), residual projections N(0, 0.02/√(2·n_layer)),
//! drawn from trainguard's own generator (see `Params`), the same on every device.
//! Every op is a fallible `f_*` call so that an allocator failure is an `Err`, never a panic.
use super::params::{Init, Params};
use crate::config::ModelConfig;
use tch::{Device, Kind, Reduction, TchError, Tensor};

struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
}

struct Block {
    ln_1: LayerNorm,
    attn_w: Tensor,
    attn_b: Option<Tensor>,
    attn_proj_w: Tensor,
    attn_proj_b: Option<Tensor>,
    ln_2: LayerNorm,
    fc_w: Tensor,
    fc_b: Option<Tensor>,
    mlp_proj_w: Tensor,
    mlp_proj_b: Option<Tensor>,
}

pub struct Gpt {
    pub cfg: ModelConfig,
    pub params: Params,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

impl Gpt {
    /// Builds the model on `device`; weights depend only on `seed` and the config.
    pub fn new(cfg: &ModelConfig, seed: u64, device: Device) -> Result<Self, TchError> {
        let (c, v, t) = (cfg.n_embd as i64, cfg.vocab_size as i64, cfg.seq_len as i64);
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        let mut p = Params { seed, ..Params::default() };
        let wte = p.add("wte.weight".into(), &[v, c], Init::Normal(std), false, device)?;
        let wpe = p.add("wpe.weight".into(), &[t, c], Init::Normal(std), false, device)?;
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("h.{i}.{s}");
            let linear = |p: &mut Params, name: &str, out: i64, inp: i64, std: f64| -> Result<_, TchError> {
                let w = p.add(n(&format!("{name}.weight")), &[out, inp], Init::Normal(std), true, device)?;
                let b = cfg.bias.then(|| p.add(n(&format!("{name}.bias")), &[out], Init::Zeros, false, device)).transpose()?;
                Ok((w, b))
            };
            let ln_1 = layer_norm(&mut p, &n("ln_1"), c, cfg.bias, device)?;
            let (attn_w, attn_b) = linear(&mut p, "attn.c_attn", 3 * c, c, std)?;
            let (attn_proj_w, attn_proj_b) = linear(&mut p, "attn.c_proj", c, c, proj_std)?;
            let ln_2 = layer_norm(&mut p, &n("ln_2"), c, cfg.bias, device)?;
            let (fc_w, fc_b) = linear(&mut p, "mlp.c_fc", 4 * c, c, std)?;
            let (mlp_proj_w, mlp_proj_b) = linear(&mut p, "mlp.c_proj", c, 4 * c, proj_std)?;
            blocks.push(Block { ln_1, attn_w, attn_b, attn_proj_w, attn_proj_b, ln_2, fc_w, fc_b, mlp_proj_w, mlp_proj_b });
        }
        let ln_f = layer_norm(&mut p, "ln_f", c, cfg.bias, device)?;
        Ok(Self { cfg: cfg.clone(), params: p, wte, wpe, blocks, ln_f })
    }

    /// Number of trainable parameters (the head is tied, so counted once).
    pub fn num_params(&self) -> i64 {
        self.params.count()
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]`. `seed`: reseeds the generator before the
    /// embedding and each block (dropout), so a recomputed block draws the same masks.
    pub fn forward(&self, idx: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        let mut x = self.embed(idx, train, seed)?;
        for i in 0..self.blocks.len() {
            x = self.block(i, &x, train, seed)?;
        }
        self.head(&x)
    }

    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn reseed(&self, train: bool, seed: Option<u64>, stage: u64) {
        if let (true, Some(s)) = (train && self.cfg.dropout > 0.0, seed) {
            tch::manual_seed(crate::data::mix(&[s, stage]) as i64);
        }
    }

    /// Token + position embeddings (and dropout): `[b, t, c]`.
    pub fn embed(&self, idx: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        let (_, t) = idx.size2()?;
        let p = if train { self.cfg.dropout } else { 0.0 };
        self.reseed(train, seed, 0);
        let pos = Tensor::f_arange(t, (Kind::Int64, idx.device()))?;
        let tok = Tensor::f_embedding(&self.wte, idx, -1, false, false)?;
        let pe = Tensor::f_embedding(&self.wpe, &pos, -1, false, false)?;
        tok.f_add(&pe)?.f_dropout(p, train)
    }

    /// Transformer block `i` on `x` `[b, t, c]`.
    pub fn block(&self, i: usize, x: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        let (b, t, c) = x.size3()?;
        let p = if train { self.cfg.dropout } else { 0.0 };
        let blk = &self.blocks[i];
        self.reseed(train, seed, 1 + i as u64);
        let a = self.attention(blk, &ln(x, &blk.ln_1, c)?, b, t, p, train)?;
        let x = x.f_add(&a)?;
        let h = ln(&x, &blk.ln_2, c)?.f_linear(&blk.fc_w, blk.fc_b.as_ref())?.f_gelu("none")?;
        let m = h.f_linear(&blk.mlp_proj_w, blk.mlp_proj_b.as_ref())?.f_dropout(p, train)?;
        x.f_add(&m)
    }

    /// Final LayerNorm and the tied LM head: logits `[…, vocab]` for hidden states `[…, c]`.
    pub fn head(&self, x: &Tensor) -> Result<Tensor, TchError> {
        ln(x, &self.ln_f, self.cfg.n_embd as i64)?.f_linear::<Tensor>(&self.wte, None)
    }

    fn attention(&self, blk: &Block, x: &Tensor, b: i64, t: i64, p: f64, train: bool) -> Result<Tensor, TchError> {
        let (c, h) = (self.cfg.n_embd as i64, self.cfg.n_head as i64);
        let qkv = x.f_linear(&blk.attn_w, blk.attn_b.as_ref())?;
        let heads = |i: i64| -> Result<Tensor, TchError> { qkv.f_narrow(2, i * c, c)?.f_view([b, t, h, c / h])?.f_transpose(1, 2) };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let y = Tensor::f_scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, p, true, None, false)?;
        let y = y.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, c])?;
        y.f_linear(&blk.attn_proj_w, blk.attn_proj_b.as_ref())?.f_dropout(p, train)
    }

    /// Mean cross-entropy of the next-token predictions for inputs `x` and targets `y`.
    pub fn loss(&self, x: &Tensor, y: &Tensor, train: bool, seed: Option<u64>) -> Result<Tensor, TchError> {
        cross_entropy(&self.forward(x, train, seed)?, y, Reduction::Mean)
    }

    /// Indices into `params` of the embedding's, each block's and the head's parameters (the
    /// tied `wte.weight` is in both the embedding's and the head's).
    pub fn param_groups(&self) -> ParamGroups {
        let idx = |pred: &dyn Fn(&str) -> bool| -> Vec<usize> { self.params.names.iter().enumerate().filter(|(_, n)| pred(n)).map(|(i, _)| i).collect() };
        ParamGroups {
            embed: idx(&|n| n == "wte.weight" || n == "wpe.weight"),
            blocks: (0..self.blocks.len()).map(|b| idx(&|n| n.starts_with(&format!("h.{b}.")))).collect(),
            head: idx(&|n| n.starts_with("ln_f.") || n == "wte.weight"),
        }
    }
}

/// See [`Gpt::param_groups`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamGroups {
    pub embed: Vec<usize>,
    pub blocks: Vec<Vec<usize>>,
    pub head: Vec<usize>,
}

/// Cross-entropy of logits `[…, v]` against targets `[…]`.
pub fn cross_entropy(logits: &Tensor, y: &Tensor, reduction: Reduction) -> Result<Tensor, TchError> {
    let v = *logits.size().last().unwrap_or(&1);
    logits.f_view([-1, v])?.f_cross_entropy_loss::<Tensor>(&y.f_reshape([-1])?, None, reduction, -100, 0.0)
}

fn layer_norm(p: &mut Params, name: &str, c: i64, bias: bool, device: Device) -> Result<LayerNorm, TchError> {
    let weight = p.add(format!("{name}.weight"), &[c], Init::Ones, false, device)?;
    let bias = bias.then(|| p.add(format!("{name}.bias"), &[c], Init::Zeros, false, device)).transpose()?;
    Ok(LayerNorm { weight, bias })
}

fn ln(x: &Tensor, n: &LayerNorm, c: i64) -> Result<Tensor, TchError> {
    x.f_layer_norm(&[c], Some(&n.weight), n.bias.as_ref(), 1e-5, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 32, seq_len: 8, dropout: 0.0, bias: true }
    }

    #[test]
    fn parameter_count_matches_the_gpt2_formula() {
        let c = cfg();
        let m = Gpt::new(&c, 0, Device::Cpu).unwrap();
        let (l, d, v, t) = (2i64, 16i64, 32i64, 8i64);
        // embeddings + per block (2 LN + qkv + proj + fc + proj, with biases) + final LN
        let per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        assert_eq!(m.num_params(), v * d + t * d + l * per_block + 2 * d);
        let no_bias = Gpt::new(&ModelConfig { bias: false, ..c }, 0, Device::Cpu).unwrap();
        assert_eq!(no_bias.num_params(), v * d + t * d + l * (2 * d + 12 * d * d) + d);
    }

    #[test]
    fn forward_shapes_and_initial_loss_near_uniform() {
        let m = Gpt::new(&cfg(), 0, Device::Cpu).unwrap();
        let x = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8, 8, 7, 6, 5, 4, 3, 2, 1]).view([2, 8]);
        assert_eq!(m.forward(&x, false, None).unwrap().size(), [2, 8, 32]);
        let loss = m.loss(&x, &x, false, None).unwrap().double_value(&[]);
        assert!((loss - (32f64).ln()).abs() < 0.3, "{loss}");
    }

    #[test]
    fn same_seed_same_weights_and_causality_holds() {
        let a = Gpt::new(&cfg(), 5, Device::Cpu).unwrap();
        let b = Gpt::new(&cfg(), 5, Device::Cpu).unwrap();
        for (x, y) in a.params.tensors.iter().zip(&b.params.tensors) {
            assert!(x.equal(y));
        }
        // Changing a later token must not change earlier logits.
        let x1 = Tensor::from_slice(&[1i64, 2, 3, 4]).view([1, 4]);
        let x2 = Tensor::from_slice(&[1i64, 2, 3, 9]).view([1, 4]);
        let l1 = a.forward(&x1, false, None).unwrap().narrow(1, 0, 3);
        let l2 = a.forward(&x2, false, None).unwrap().narrow(1, 0, 3);
        assert!(l1.allclose(&l2, 1e-6, 1e-6, false));
    }

    #[test]
    fn out_of_range_tokens_are_errors_not_panics() {
        let m = Gpt::new(&cfg(), 0, Device::Cpu).unwrap();
        let x = Tensor::from_slice(&[100i64]).view([1, 1]);
        assert!(m.forward(&x, false, None).is_err());
    }
}
