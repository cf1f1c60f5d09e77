//! GPT-2: token + learned position embeddings, pre-LayerNorm blocks with causal self-attention
//! (fused QKV) and a GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
//! Initialisation follows GPT-2: N(0, 0.02), residual projections N(0, 0.02/√(2·n_layer)).
//! Names are nanoGPT's (`wte.weight`, `h.N.attn.c_attn.weight`, …), Linear layout ([out, in]).
use super::documents::Documents;
use super::layers::{
    causal_attention, linear, param, split_heads, LayerNorm, Linear, Output, ResidualNorm, Stream,
};
use super::memory::{layers as saves, Activations, Regime, Saved, Stored};
use super::params::{Init, Params};
use super::spec::{Part, TensorSpec};
use super::{Decoder, OurNodes};
use crate::config::ModelConfig;
use tch::{Kind, TchError, Tensor};

/// GPT-2's parameters in creation order.
pub fn tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let (c, v, t, f) = (cfg.n_embd as i64, cfg.padded_vocab() as i64, cfg.seq_len as i64, cfg.ffn() as i64);
    let std = 0.02;
    let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    let mut out = vec![
        TensorSpec::new("wte.weight", &[v, c], Init::Normal(std), false, Part::TiedEmbedding)
            .vocab_rows(cfg.vocab_size as i64),
        TensorSpec::new("wpe.weight", &[t, c], Init::Normal(std), false, Part::Embedding),
    ];
    let norm = |out: &mut Vec<TensorSpec>, name: String, part: Part| {
        out.push(TensorSpec::new(format!("{name}.weight"), &[c], Init::Ones, false, part));
        if cfg.bias {
            out.push(TensorSpec::new(format!("{name}.bias"), &[c], Init::Zeros, false, part));
        }
    };
    for i in 0..cfg.n_layer {
        let part = Part::Block(i);
        let linear = |out: &mut Vec<TensorSpec>, name: &str, o: i64, inp: i64, std: f64| {
            out.push(TensorSpec::new(
                format!("h.{i}.{name}.weight"),
                &[o, inp],
                Init::Normal(std),
                true,
                part,
            ));
            if cfg.bias {
                out.push(TensorSpec::new(format!("h.{i}.{name}.bias"), &[o], Init::Zeros, false, part));
            }
        };
        norm(&mut out, format!("h.{i}.ln_1"), part);
        linear(&mut out, "attn.c_attn", 3 * c, c, std);
        linear(&mut out, "attn.c_proj", c, c, proj_std);
        norm(&mut out, format!("h.{i}.ln_2"), part);
        linear(&mut out, "mlp.c_fc", f, c, std);
        linear(&mut out, "mlp.c_proj", c, f, proj_std);
    }
    norm(&mut out, "ln_f".into(), Part::Head);
    out
}

/// What GPT-2's forward keeps for backward (see [`super::memory`]). Per block: two LayerNorms
/// (input, statistics, output), the fused QKV output that attention reads, the attention output
/// (the projection's input), GELU's input and output (the second projection's input), two
/// residual dropout masks.
pub fn saved(cfg: &ModelConfig, r: Regime) -> Activations {
    let (c, f, a) = (cfg.n_embd as u64, cfg.ffn() as u64, cfg.n_head as u64);
    let mut block: Vec<Saved> = saves::layer_norm(c, 1).into();
    block.extend(saves::attention(c, c, a, r));
    block.extend(saves::document_mask_cast(r));
    block.extend(saves::dropout(c, r));
    block.extend(saves::layer_norm(c, 1));
    block.push(Saved::token("GELU input and output", 2 * f, Stored::Compute));
    block.extend(saves::dropout(c, r));
    Activations {
        block,
        embedding: saves::dropout(c, r).into_iter().chain(saves::documents(r)).collect(),
        final_norm: saves::layer_norm(c, 1).into(),
        buffers: vec![],
        // GELU's input gradient replaces its output's, whose saved input is freed by then.
        block_backward: vec![
            Saved::token("GELU gradient", f, Stored::Compute),
            Saved::token("residual gradient", c, Stored::Residual),
        ],
    }
}

struct Block {
    ln_1: LayerNorm,
    attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    fc: Linear,
    mlp_proj: Linear,
}

pub struct Gpt2 {
    n_head: i64,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// The LM head through our linear node (`kernels.fused_linear`).
    our_head: bool,
    /// The MLP's GELU inside the up-projection's node (`kernels.fused_gelu`).
    our_gelu: bool,
}

impl Gpt2 {
    /// `ours`: the LayerNorms through our residual-norm node, the linear layers through ours.
    pub fn new(cfg: &ModelConfig, params: &Params, ours: OurNodes) -> Result<Self, TchError> {
        let (bias, our_norms) = (cfg.bias, ours.norms);
        let lin = |name: &str| Linear::load(params, name, bias, ours.linear);
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let n = |s: &str| format!("h.{i}.{s}");
                Ok(Block {
                    ln_1: LayerNorm::load(params, &n("ln_1"), bias, our_norms)?,
                    attn: lin(&n("attn.c_attn"))?,
                    attn_proj: lin(&n("attn.c_proj"))?,
                    ln_2: LayerNorm::load(params, &n("ln_2"), bias, our_norms)?,
                    fc: lin(&n("mlp.c_fc"))?,
                    mlp_proj: lin(&n("mlp.c_proj"))?,
                })
            })
            .collect::<Result<_, TchError>>()?;
        Ok(Self {
            n_head: cfg.n_head as i64,
            wte: param(params, "wte.weight")?,
            wpe: param(params, "wpe.weight")?,
            blocks,
            ln_f: LayerNorm::load(params, "ln_f", bias, our_norms)?,
            our_head: ours.linear,
            our_gelu: ours.gelu,
        })
    }
}

impl Decoder for Gpt2 {
    fn embed(
        &self,
        idx: &Tensor,
        documents: Option<&Documents>,
        dropout: f64,
        train: bool,
    ) -> Result<Tensor, TchError> {
        let (_, t) = idx.size2()?;
        // Within documents, positions restart as they do for a document fed alone (sampling, an
        // exported model): the position embedding of a document's token does not depend on
        // where packing put the document.
        let pos = match documents {
            Some(d) => d.positions.shallow_clone(),
            None => Tensor::f_arange(t, (Kind::Int64, idx.device()))?,
        };
        let tok = Tensor::f_embedding(&self.wte, idx, -1, false, false)?;
        let pe = Tensor::f_embedding(&self.wpe, &pos, -1, false, false)?;
        tok.f_add(&pe)?.f_dropout(dropout, train)
    }

    fn block(
        &self,
        i: usize,
        stream: &Stream,
        documents: Option<&Documents>,
        dropout: f64,
        train: bool,
        output: Output,
    ) -> Result<Stream, TchError> {
        let blk = &self.blocks[i];
        let (x, normed) = blk.ln_1.stream_forward(stream)?;
        let qkv = blk.attn.forward(&normed)?;
        let c = qkv.size()[2] / 3;
        // One split, not three narrows: its backward writes the three gradients into one tensor,
        // where each narrow's backward zero-fills a tensor of qkv's full width and autograd then
        // adds the three (on the CPU that cost twice the split's time: `trainguard trace`).
        let parts = qkv.f_split(c, 2)?;
        let heads = |j: usize| split_heads(&parts[j], self.n_head);
        let y =
            causal_attention(&heads(0)?, &heads(1)?, &heads(2)?, dropout, documents.map(|d| &d.attention))?;
        let (x, normed) = blk.ln_2.add_forward(&x, &blk.attn_proj.forward(&y)?.f_dropout(dropout, train)?)?;
        let h = blk.fc.forward_gelu(&normed, self.our_gelu)?;
        Ok(Stream { x, pending: Some(blk.mlp_proj.forward_for(&h, output)?.f_dropout(dropout, train)?) })
    }

    fn head(&self, x: &Stream, mask: Option<&Tensor>) -> Result<Tensor, TchError> {
        linear(&self.ln_f.stream_forward(x)?.1, &self.wte, mask, self.our_head)
    }

    fn n_blocks(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Model;
    use crate::config::ModelConfig;
    use tch::{Device, Tensor};

    fn cfg() -> ModelConfig {
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

    #[test]
    fn parameter_count_matches_the_gpt2_formula() {
        let c = ModelConfig { pad_vocab_to: 1, ..cfg() };
        let m = Model::new(&c, 0, Device::Cpu).unwrap();
        let (l, d, v, t) = (2i64, 16i64, 32i64, 8i64);
        // Padded (the default, 64): the embedding holds 64 rows, 32 of them padding.
        assert_eq!(Model::new(&cfg(), 0, Device::Cpu).unwrap().num_params(), m.num_params() + 32 * d);
        // embeddings + per block (2 LN + qkv + proj + fc + proj, with biases) + final LN
        let per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        assert_eq!(m.num_params(), v * d + t * d + l * per_block + 2 * d);
        let no_bias = Model::new(&ModelConfig { bias: false, ..c }, 0, Device::Cpu).unwrap();
        assert_eq!(no_bias.num_params(), v * d + t * d + l * (2 * d + 12 * d * d) + d);
    }

    #[test]
    fn forward_shapes_and_initial_loss_near_uniform() {
        let m = Model::new(&cfg(), 0, Device::Cpu).unwrap();
        let x = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8, 8, 7, 6, 5, 4, 3, 2, 1]).view([2, 8]);
        assert_eq!(m.forward(&x, false, None).unwrap().size(), [2, 8, 32]);
        let loss = m.loss(&x, &x, false, None).unwrap().double_value(&[]);
        assert!((loss - (32f64).ln()).abs() < 0.3, "{loss}");
    }

    #[test]
    fn same_seed_same_weights_and_causality_holds() {
        let a = Model::new(&cfg(), 5, Device::Cpu).unwrap();
        let b = Model::new(&cfg(), 5, Device::Cpu).unwrap();
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
        let m = Model::new(&cfg(), 0, Device::Cpu).unwrap();
        let x = Tensor::from_slice(&[100i64]).view([1, 1]);
        assert!(m.forward(&x, false, None).is_err());
    }
}
