//! The Llama family (Llama 3, SmolLM, TinyLlama, Qwen and Mistral share the shape): token
//! embedding, pre-RMSNorm blocks with rotary position embedding on queries and keys,
//! grouped-query causal attention and a SwiGLU MLP, a final RMSNorm and an LM head (tied to the
//! embedding or not). Names and layouts are Hugging Face's `LlamaForCausalLM`
//! (`model.layers.N.self_attn.q_proj.weight`, …), so import and export copy tensors as they are.
//! Initialisation as `transformers` does it: N(0, 0.02) for linear layers and the embedding,
//! ones for the norms.
use super::documents::Documents;
use super::layers::{
    causal_attention, linear, merged_linear, param, split_heads, swiglu, Linear, Output, ResidualNorm,
    RmsNorm, Rope, Stream,
};
use super::memory::{layers as saves, Activations, Count, Regime, Saved, Stored};
use super::params::{Init, Params};
use super::spec::{Part, TensorSpec};
use super::{Decoder, OurNodes};
use crate::config::{KernelsConfig, ModelConfig};
use tch::{Device, TchError, Tensor};

const STD: f64 = 0.02;

/// Llama's parameters in creation order.
pub fn tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let (h, v, f) = (cfg.n_embd as i64, cfg.padded_vocab() as i64, cfg.ffn() as i64);
    let user = cfg.vocab_size as i64;
    let d = cfg.head_dim() as i64;
    let (q, kv) = (cfg.n_head as i64 * d, cfg.kv_heads() as i64 * d);
    let embed_part = if cfg.tie_embeddings { Part::TiedEmbedding } else { Part::Embedding };
    let mut out =
        vec![TensorSpec::new("model.embed_tokens.weight", &[v, h], Init::Normal(STD), false, embed_part)
            .vocab_rows(user)];
    for i in 0..cfg.n_layer {
        let part = Part::Block(i);
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let linear = |out: &mut Vec<TensorSpec>, name: &str, o: i64, inp: i64| {
            out.push(TensorSpec::new(p(&format!("{name}.weight")), &[o, inp], Init::Normal(STD), true, part));
            if cfg.bias {
                out.push(TensorSpec::new(p(&format!("{name}.bias")), &[o], Init::Zeros, false, part));
            }
        };
        out.push(TensorSpec::new(p("input_layernorm.weight"), &[h], Init::Ones, false, part));
        linear(&mut out, "self_attn.q_proj", q, h);
        linear(&mut out, "self_attn.k_proj", kv, h);
        linear(&mut out, "self_attn.v_proj", kv, h);
        linear(&mut out, "self_attn.o_proj", h, q);
        out.push(TensorSpec::new(p("post_attention_layernorm.weight"), &[h], Init::Ones, false, part));
        linear(&mut out, "mlp.gate_proj", f, h);
        linear(&mut out, "mlp.up_proj", f, h);
        linear(&mut out, "mlp.down_proj", h, f);
    }
    out.push(TensorSpec::new("model.norm.weight", &[h], Init::Ones, false, Part::Head));
    if !cfg.tie_embeddings {
        out.push(
            TensorSpec::new("lm_head.weight", &[v, h], Init::Normal(STD), true, Part::Head).vocab_rows(user),
        );
    }
    out
}

/// What Llama's forward keeps for backward (see [`super::memory`]). Per block: the attention
/// RMSNorm read by q, k and v (three 16-bit copies under autocast), RoPE's cos and sin cast to
/// the compute dtype for q and for k (the rotation saves only them: the unrotated q and k are
/// freed), attention over the rotated q and k and the grouped key/value heads as they are, the MLP
/// RMSNorm read by gate and up, SwiGLU's gate output, up output, silu(gate) and their product
/// (down's input), two residual dropout masks. Besides: the fp32 cos and sin tables
/// (seq_len × head_dim each). With merged projections each norm has one reader, v is copied out
/// of the joint output (as wide as its own), and the concatenated weights are kept (their
/// gradient, which backward then writes whole, is not counted: a few MB for smollm2-135m, as
/// the separate layers' weight gradients are not).
pub fn saved(cfg: &ModelConfig, r: Regime) -> Activations {
    let (h, f, a, d) = (cfg.n_embd as u64, cfg.ffn() as u64, cfg.n_head as u64, cfg.head_dim() as u64);
    let kv = cfg.kv_heads() as u64 * d;
    let readers = |separate: u64| if r.merged_projections { 1 } else { separate };
    let mut block: Vec<Saved> = saves::rms_norm(h, readers(3), r);
    if r.merged_projections {
        let weights = (a * d + 2 * kv + 2 * f) * h;
        block.push(Saved {
            what: "q/k/v and gate/up weights, concatenated",
            count: Count::Fixed(weights),
            stored: Stored::WeightCopy,
        });
    }
    if r.documents.is_some() {
        // gathered at each token's position in its document, once per block for q and k
        // (ATen's ops: our node takes no positions)
        block.push(Saved::token("RoPE cos and sin at document positions", 2 * d, Stored::Compute));
    } else if !r.rope_node {
        // our node reads the fp32 tables (counted once, below) and keeps nothing
        block.push(Saved {
            what: "RoPE cos and sin for q and k",
            count: Count::Position(4 * d),
            stored: Stored::CastTable,
        });
    }
    block.extend(saves::attention(a * d, kv, a, r));
    block.extend(saves::document_mask_cast(r));
    block.extend(saves::dropout(h, r));
    block.extend(saves::rms_norm(h, readers(2), r));
    block.push(match r.swiglu_node {
        true => {
            Saved::token("SwiGLU gate, up, product (our node keeps no silu(gate))", 3 * f, Stored::Compute)
        }
        false => Saved::token("SwiGLU gate, up, silu(gate), product", 4 * f, Stored::Compute),
    });
    block.extend(saves::dropout(h, r));
    Activations {
        block,
        embedding: saves::dropout(h, r).into_iter().chain(saves::documents(r)).collect(),
        final_norm: saves::rms_norm(h, 1, r),
        buffers: vec![Saved {
            what: "RoPE cos and sin tables",
            count: Count::Position(2 * d),
            stored: Stored::Fp32,
        }],
        // The product's gradient splits into gate's and up's while the product itself (down's
        // saved input) is freed: two f-wide gradients net. Merged, the joint node (ours or of
        // ATen's ops) writes them into the joint output's gradient: two as well.
        block_backward: vec![
            Saved::token("SwiGLU gradients", 2 * f, Stored::Compute),
            Saved::token("residual gradient", h, Stored::Residual),
        ],
    }
}

struct Layer {
    input_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

pub struct Llama {
    n_head: i64,
    n_kv_head: i64,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Tensor,
    rope: Rope,
    /// SwiGLU through our node (`kernels.fused_swiglu`).
    our_swiglu: bool,
    /// The LM head through our linear node (`kernels.fused_linear`).
    our_head: bool,
    /// q, k and v as one matrix multiplication, gate and up as another
    /// (`kernels.merged_projections`).
    merged: bool,
}

impl Llama {
    /// `ours`: the RMSNorms through our residual-norm node, SwiGLU and RoPE through ours.
    pub fn new(
        cfg: &ModelConfig,
        kernels: KernelsConfig,
        params: &Params,
        device: Device,
        ours: OurNodes,
    ) -> Result<Self, TchError> {
        let (bias, eps) = (cfg.bias, cfg.norm_eps);
        let fused = kernels.fused_rms_norm && device.is_cuda();
        let norm = |name: &str| -> Result<RmsNorm, TchError> {
            Ok(RmsNorm { weight: param(params, name)?, eps, fused, ours: ours.norms })
        };
        let lin = |name: &str| Linear::load(params, name, bias, ours.linear);
        let layers = (0..cfg.n_layer)
            .map(|i| {
                let p = |s: &str| format!("model.layers.{i}.{s}");
                Ok(Layer {
                    input_norm: norm(&p("input_layernorm.weight"))?,
                    q: lin(&p("self_attn.q_proj"))?,
                    k: lin(&p("self_attn.k_proj"))?,
                    v: lin(&p("self_attn.v_proj"))?,
                    o: lin(&p("self_attn.o_proj"))?,
                    post_norm: norm(&p("post_attention_layernorm.weight"))?,
                    gate: lin(&p("mlp.gate_proj"))?,
                    up: lin(&p("mlp.up_proj"))?,
                    down: lin(&p("mlp.down_proj"))?,
                })
            })
            .collect::<Result<_, TchError>>()?;
        let embed = param(params, "model.embed_tokens.weight")?;
        let lm_head =
            if cfg.tie_embeddings { embed.shallow_clone() } else { param(params, "lm_head.weight")? };
        Ok(Self {
            n_head: cfg.n_head as i64,
            n_kv_head: cfg.kv_heads() as i64,
            embed,
            layers,
            norm: norm("model.norm.weight")?,
            lm_head,
            rope: Rope::new(cfg.head_dim() as i64, cfg.seq_len as i64, cfg.rope_theta, device, ours.rope)?,
            our_swiglu: ours.swiglu,
            our_head: ours.linear,
            merged: kernels.merged_projections,
        })
    }

    /// Layer `l`'s attention inputs from the normed `h`: q and k rotated, v, each `[b, heads, t, d]`.
    fn attention_inputs(&self, l: &Layer, h: &Tensor) -> Result<(Tensor, Tensor, Tensor), TchError> {
        if self.merged {
            return self.rope.rotate_joint_heads(
                &merged_linear(h, &[&l.q, &l.k, &l.v])?,
                self.n_head,
                self.n_kv_head,
            );
        }
        let (q, k, v) = (l.q.forward(h)?, l.k.forward(h)?, l.v.forward(h)?);
        Ok((
            self.rope.rotate_heads(&q, self.n_head)?,
            self.rope.rotate_heads(&k, self.n_kv_head)?,
            split_heads(&v, self.n_kv_head)?,
        ))
    }
}

impl Llama {
    /// [`Llama::attention_inputs`] with q and k rotated by each token's position inside its
    /// document (`positions` `[b, t]`), through ATen's ops whatever `kernels.fused_rope` says.
    fn document_attention_inputs(
        &self,
        l: &Layer,
        h: &Tensor,
        positions: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor), TchError> {
        let projected = match self.merged {
            true => {
                let qkv = merged_linear(h, &[&l.q, &l.k, &l.v])?;
                let d = qkv.size()[2] / (self.n_head + 2 * self.n_kv_head);
                let (q, kv) = (self.n_head * d, self.n_kv_head * d);
                qkv.f_split_with_sizes([q, kv, kv], -1)?
            }
            false => vec![l.q.forward(h)?, l.k.forward(h)?, l.v.forward(h)?],
        };
        let (cos, sin) = self.rope.tables_at(positions, projected[0].kind())?;
        Rope::rotate_at(
            [&projected[0], &projected[1], &projected[2]],
            self.n_head,
            self.n_kv_head,
            &cos,
            &sin,
        )
    }
}

impl Decoder for Llama {
    fn embed(
        &self,
        idx: &Tensor,
        _documents: Option<&Documents>,
        dropout: f64,
        train: bool,
    ) -> Result<Tensor, TchError> {
        Tensor::f_embedding(&self.embed, idx, -1, false, false)?.f_dropout(dropout, train)
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
        let l = &self.layers[i];
        let (x, normed) = l.input_norm.stream_forward(stream)?;
        let (q, k, v) = match documents {
            Some(d) => self.document_attention_inputs(l, &normed, &d.positions)?,
            None => self.attention_inputs(l, &normed)?,
        };
        let y = causal_attention(&q, &k, &v, dropout, documents.map(|d| &d.attention))?;
        let (x, normed) = l.post_norm.add_forward(&x, &l.o.forward(&y)?.f_dropout(dropout, train)?)?;
        let m = swiglu(&normed, &l.gate, &l.up, &l.down, self.our_swiglu, self.merged, output)?;
        Ok(Stream { x, pending: Some(m.f_dropout(dropout, train)?) })
    }

    fn head(&self, x: &Stream, mask: Option<&Tensor>) -> Result<Tensor, TchError> {
        linear(&self.norm.stream_forward(x)?.1, &self.lm_head, mask, self.our_head)
    }

    fn n_blocks(&self) -> usize {
        self.layers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Model;
    use crate::config::{Arch, ModelConfig};
    use tch::{Device, Kind, Tensor};

    fn cfg() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            n_layer: 2,
            n_head: 4,
            n_kv_head: Some(2),
            n_embd: 32,
            ffn_hidden: Some(48),
            vocab_size: 40,
            seq_len: 16,
            bias: false,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn parameters_follow_the_llama_layout_with_grouped_query_heads() {
        let m = Model::new(&ModelConfig { pad_vocab_to: 1, ..cfg() }, 0, Device::Cpu).unwrap();
        let (l, h, f, v, kv) = (2i64, 32i64, 48i64, 40i64, 16i64);
        let per_layer = 2 * h + h * h + 2 * kv * h + h * h + 3 * h * f;
        assert_eq!(m.num_params(), v * h + l * per_layer + h, "tied head counted once");
        assert_eq!(m.params.names[2], "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(m.params.get("model.layers.1.self_attn.k_proj.weight").unwrap().size(), [kv, h]);
        let untied =
            Model::new(&ModelConfig { tie_embeddings: false, pad_vocab_to: 1, ..cfg() }, 0, Device::Cpu)
                .unwrap();
        assert_eq!(untied.num_params(), m.num_params() + v * h);
        assert_eq!(untied.params.names.last().unwrap(), "lm_head.weight");
    }

    #[test]
    fn forward_is_causal_and_starts_near_uniform() {
        let m = Model::new(&cfg(), 1, Device::Cpu).unwrap();
        let x1 = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6]).view([1, 6]);
        let x2 = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 9]).view([1, 6]);
        let l1 = m.forward(&x1, false, None).unwrap();
        assert_eq!(l1.size(), [1, 6, 40]);
        let l2 = m.forward(&x2, false, None).unwrap();
        assert!(l1.narrow(1, 0, 5).allclose(&l2.narrow(1, 0, 5), 1e-6, 1e-6, false));
        let next = Tensor::from_slice(&[2i64, 3, 4, 5, 6, 7]).view([1, 6]);
        let loss = m.loss(&x1, &next, false, None).unwrap().double_value(&[]);
        assert!((loss - 40f64.ln()).abs() < 0.3, "{loss}");
    }

    #[test]
    fn grouped_query_attention_equals_repeating_the_key_value_heads() {
        // Each KV head serves n_head / n_kv_head consecutive query heads, as repeat_kv does.
        let q = Tensor::randn([1, 4, 5, 8], (Kind::Float, Device::Cpu));
        let k = Tensor::randn([1, 2, 5, 8], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([1, 2, 5, 8], (Kind::Float, Device::Cpu));
        let grouped = super::causal_attention(&q, &k, &v, 0.0, None).unwrap();
        let rep = |t: &Tensor| t.repeat_interleave_self_int(2, 1, None);
        let full = super::causal_attention(&q, &rep(&k), &rep(&v), 0.0, None).unwrap();
        assert!(grouped.allclose(&full, 1e-6, 1e-6, false));
    }
}
