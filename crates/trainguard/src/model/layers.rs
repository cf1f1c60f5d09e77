//! The layers the architectures are assembled from, each a fallible function of tensors:
//! linear, LayerNorm, RMSNorm, rotary position embedding (by position in the window or in the
//! document), causal attention over `scaled_dot_product_attention` (grouped-query heads
//! included; within documents through a mask or the variable-length kernels), GELU and SwiGLU
//! MLPs.
use super::documents::DocumentAttention;
use super::params::Params;
use crate::ffi::norm::{residual_norm, Norm};
use tch::{Device, Kind, TchError, Tensor};

/// The parameter `name` of `params` (a handle to the same storage).
pub fn param(params: &Params, name: &str) -> Result<Tensor, TchError> {
    params
        .get(name)
        .map(Tensor::shallow_clone)
        .ok_or_else(|| TchError::Torch(format!("model: no parameter `{name}`")))
}

/// What a block's output is computed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Its values: the forward pass.
    Values,
    /// Only its graph: a block recomputed in backward (activation checkpointing), whose output is
    /// never read there; only the gradient flows back through it. Its last layer then skips its
    /// product ([`Linear::forward_for`]): GPT-2's MLP projection is a third of a block's linear
    /// layers' GEMM work, SmolLM2's down projection a quarter.
    GraphOnly,
}

pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// Through our linear node (`kernels.fused_linear`, where our CUDA kernels run).
    pub ours: bool,
}

impl Linear {
    /// `{prefix}.weight` and, with `bias`, `{prefix}.bias`.
    pub fn load(params: &Params, prefix: &str, bias: bool, ours: bool) -> Result<Self, TchError> {
        let (weight, bias) = weight_and_bias(params, prefix, bias)?;
        Ok(Self { weight, bias, ours })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        linear(x, &self.weight, self.bias.as_ref(), self.ours)
    }

    /// [`Linear::forward`] for `output`: with [`Output::GraphOnly`] zeros whose backward is the
    /// layer's (no product computed).
    pub fn forward_for(&self, x: &Tensor, output: Output) -> Result<Tensor, TchError> {
        match output {
            Output::Values => self.forward(x),
            Output::GraphOnly => {
                Ok(crate::ffi::linear::linear_graph_only(x, &self.weight, self.bias.as_ref(), self.ours)?)
            }
        }
    }

    /// GELU (without the tanh approximation) of the layer's output: in our linear node when
    /// `fused` (`kernels.fused_gelu`; the node must be this layer's), else ATen's gelu after it.
    pub fn forward_gelu(&self, x: &Tensor, fused: bool) -> Result<Tensor, TchError> {
        match fused && self.ours {
            true => Ok(crate::ffi::linear::linear_gelu(x, &self.weight, self.bias.as_ref())?),
            false => self.forward(x)?.f_gelu("none"),
        }
    }
}

/// `x` through the linear layers `layers` that all read it, as one matrix multiplication
/// (`kernels.merged_projections`): their weights (and biases) stacked in order, so the output
/// holds each layer's columns in turn. Through our node (where any layer's is on), which keeps
/// the stacked cast for a step and gives each weight its own gradient; else ATen's linear of the
/// weights concatenated.
pub fn merged_linear(x: &Tensor, layers: &[&Linear]) -> Result<Tensor, TchError> {
    let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
    let biases: Vec<&Tensor> = layers.iter().filter_map(|l| l.bias.as_ref()).collect();
    if !biases.is_empty() && biases.len() != layers.len() {
        return Err(TchError::Torch("merged_linear: the layers must all have a bias or none".into()));
    }
    if layers.iter().any(|l| l.ours) {
        return Ok(crate::ffi::linear::merged_linear(x, &weights, &biases)?);
    }
    let bias = (!biases.is_empty()).then(|| Tensor::f_cat(&biases, 0)).transpose()?;
    x.f_linear(&Tensor::f_cat(&weights, 0)?, bias.as_ref())
}

/// `{prefix}.weight` and, with `bias`, `{prefix}.bias`.
fn weight_and_bias(params: &Params, prefix: &str, bias: bool) -> Result<(Tensor, Option<Tensor>), TchError> {
    let bias = if bias { Some(param(params, &format!("{prefix}.bias"))?) } else { None };
    Ok((param(params, &format!("{prefix}.weight"))?, bias))
}

/// `x` · `weight`ᵀ + `bias`: through our linear node when `ours` (it is ATen's linear where the
/// node does not apply: no 16-bit autocast), else ATen's linear.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, ours: bool) -> Result<Tensor, TchError> {
    match ours {
        true => Ok(crate::ffi::linear::linear(x, weight, bias)?),
        false => x.f_linear(weight, bias),
    }
}

pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// Through our residual-norm node (`kernels.fused_residual_norm`, where our CUDA kernels
    /// run) for an fp32 residual stream (not bf16-pure's): its output comes rounded to the
    /// compute dtype, and [`LayerNorm::add_forward`] does the residual add in the same pass.
    pub ours: bool,
}

/// GPT-2's LayerNorm epsilon (`torch.nn.LayerNorm`'s default, and `transformers`' GPT-2's).
pub const LAYER_NORM_EPS: f64 = 1e-5;

impl LayerNorm {
    const EPS: f64 = LAYER_NORM_EPS;

    pub fn load(params: &Params, prefix: &str, bias: bool, ours: bool) -> Result<Self, TchError> {
        let (weight, bias) = weight_and_bias(params, prefix, bias)?;
        Ok(Self { weight, bias, ours })
    }
}

impl ResidualNorm for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        if self.ours && x.kind() == Kind::Float {
            return Ok(residual_norm(Norm::Layer, x, None, &self.weight, self.bias.as_ref(), Self::EPS)?.1);
        }
        let c = self.weight.size()[0];
        x.f_layer_norm([c], Some(&self.weight), self.bias.as_ref(), Self::EPS, true)
    }

    fn add_forward(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor), TchError> {
        if self.ours && x.kind() == Kind::Float {
            return residual_norm_with_sum(
                Norm::Layer,
                x,
                delta,
                &self.weight,
                self.bias.as_ref(),
                Self::EPS,
            );
        }
        let sum = x.f_add(delta)?;
        let y = self.forward(&sum)?;
        Ok((sum, y))
    }
}

/// The residual stream between blocks: `x`, and the last block's output not yet added to it
/// (`pending`), so that the next norm adds it in its own pass ([`ResidualNorm::stream_forward`]:
/// with our node, one kernel where ATen runs an add forward and an accumulation backward).
pub struct Stream {
    pub x: Tensor,
    pub pending: Option<Tensor>,
}

impl Stream {
    /// The stream `x` with nothing pending.
    pub fn settled_at(x: &Tensor) -> Self {
        Self { x: x.shallow_clone(), pending: None }
    }

    /// `x` with the pending output added (ATen's add: the same fp32 sum the node makes).
    pub fn settle(self) -> Result<Tensor, TchError> {
        match self.pending {
            Some(delta) => self.x.f_add(&delta),
            None => Ok(self.x),
        }
    }
}

/// A norm that can take a residual add in its pass.
pub trait ResidualNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError>;
    /// The residual add and the norm of its result: `(x + delta, norm(x + delta))`.
    fn add_forward(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor), TchError>;

    /// The stream settled (the pending output added) and its norm: `(x, norm(x))`.
    fn stream_forward(&self, s: &Stream) -> Result<(Tensor, Tensor), TchError> {
        match &s.pending {
            Some(delta) => self.add_forward(&s.x, delta),
            None => Ok((s.x.shallow_clone(), self.forward(&s.x)?)),
        }
    }
}

/// Our node with a residual add: `(x + delta, norm(x + delta))`.
fn residual_norm_with_sum(
    norm: Norm,
    x: &Tensor,
    delta: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor), TchError> {
    let (sum, y) = residual_norm(norm, x, Some(delta), weight, bias, eps)?;
    Ok((sum.ok_or_else(|| TchError::Torch("residual_norm: no sum returned for a residual add".into()))?, y))
}

/// Root-mean-square norm as the Llama family computes it: in fp32, then back to the input's
/// dtype, then scaled by the weight.
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
    /// Through ATen's `rms_norm` (`kernels.fused_rms_norm`, set on CUDA only, where it is one
    /// fused kernel each way instead of about seven forward and ten backward).
    pub fused: bool,
    /// Through our residual-norm node (`kernels.fused_residual_norm`, where our CUDA kernels
    /// run; before `fused`) for an fp32 residual stream: the output rounded to the compute dtype
    /// once for every reader, and [`RmsNorm::add_forward`] with the residual add in the same pass.
    pub ours: bool,
}

impl ResidualNorm for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        if self.ours && x.kind() == Kind::Float {
            return Ok(residual_norm(Norm::Rms, x, None, &self.weight, None, self.eps)?.1);
        }
        // ATen takes its fused path only when input and weight share a dtype, and warns on every
        // call otherwise: those calls stay step by step.
        if self.fused && x.kind() == self.weight.kind() {
            return self.aten(x);
        }
        self.step_by_step(x)
    }

    fn add_forward(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor), TchError> {
        if self.ours && x.kind() == Kind::Float {
            return residual_norm_with_sum(Norm::Rms, x, delta, &self.weight, None, self.eps);
        }
        let sum = x.f_add(delta)?;
        let y = self.forward(&sum)?;
        Ok((sum, y))
    }
}

impl RmsNorm {
    /// ATen's `rms_norm`: on CUDA `_fused_rms_norm`, which computes in fp32 and multiplies by the
    /// weight before rounding to the input's dtype once (the same maths; in bf16-pure the last
    /// bit can differ from `transformers`' order); on the CPU ATen decomposes it.
    fn aten(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let c = self.weight.size()[0];
        x.f_rms_norm([c], Some(&self.weight), Some(self.eps))
    }

    /// As `transformers`' `LlamaRMSNorm`: normalised in fp32, rounded to the input's dtype, then
    /// scaled by the weight.
    fn step_by_step(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let xf = x.f_to_kind(Kind::Float)?;
        let var = xf.f_square()?.f_mean_dim(&[-1i64][..], true, Kind::Float)?;
        let normed = xf.f_mul(&var.f_add_scalar(self.eps)?.f_rsqrt()?)?.f_to_kind(x.kind())?;
        self.weight.f_mul(&normed)
    }
}

/// Rotary position embedding (the "rotate half" layout of Hugging Face's Llama): cos and sin
/// tables for every position up to the sequence length, made once.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// Through our node (`kernels.fused_rope`, where our CUDA kernels run).
    ours: bool,
}

impl Rope {
    /// In fp32 step by step as `transformers` computes them, so positions far into the
    /// sequence rotate by the same angles.
    pub fn new(
        head_dim: i64,
        max_len: i64,
        theta: f64,
        device: Device,
        ours: bool,
    ) -> Result<Self, TchError> {
        let _no_grad = tch::no_grad_guard();
        let exponents = Tensor::f_arange_start_step(0, head_dim, 2, (Kind::Int64, device))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(head_dim as f64)?;
        let inv_freq = Tensor::f_pow_scalar(theta, &exponents)?.f_reciprocal()?;
        let pos = Tensor::f_arange(max_len, (Kind::Float, device))?;
        let freqs = pos.f_outer(&inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        Ok(Self { cos: emb.f_cos()?, sin: emb.f_sin()?, ours })
    }

    /// A q or k projection's output `x` `[b, t, heads·d]` split into heads `[b, heads, t, d]` and
    /// rotated by its positions: by our node on the projection's layout, or by ATen's ops.
    pub fn rotate_heads(&self, x: &Tensor, heads: i64) -> Result<Tensor, TchError> {
        match self.ours {
            true => split_heads(&crate::ffi::llama_ops::rope(x, &self.cos, &self.sin, heads)?, heads),
            false => self.apply(&split_heads(x, heads)?),
        }
    }

    /// q, k and v `[b, heads, t, d]` from the merged q/k/v output `qkv` `[b, t, (heads +
    /// 2·kv_heads)·d]`, q and k rotated: by our joint node in one launch each way (v copied out,
    /// the joint gradient written whole), or by ATen's ops on the parts.
    pub fn rotate_joint_heads(
        &self,
        qkv: &Tensor,
        heads: i64,
        kv_heads: i64,
    ) -> Result<(Tensor, Tensor, Tensor), TchError> {
        let (q, k, v) = match self.ours {
            true => {
                let (q, k, v) = crate::ffi::llama_ops::rope_qkv(qkv, &self.cos, &self.sin, heads, kv_heads)?;
                (split_heads(&q, heads)?, split_heads(&k, kv_heads)?, v)
            }
            false => {
                let d = qkv.size()[2] / (heads + 2 * kv_heads);
                let parts = qkv.f_split_with_sizes([heads * d, kv_heads * d, kv_heads * d], -1)?;
                // v copied out of the joint output: attention keeps it, and as a view it would
                // keep q's and k's columns alive too (the rotation writes new q and k).
                (
                    self.apply(&split_heads(&parts[0], heads)?)?,
                    self.apply(&split_heads(&parts[1], kv_heads)?)?,
                    parts[2].f_contiguous()?,
                )
            }
        };
        Ok((q, k, split_heads(&v, kv_heads)?))
    }

    /// `x` `[b, heads, t, head_dim]` rotated by its positions `0..t`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let t = x.size()[2];
        let cos = self.cos.f_narrow(0, 0, t)?.f_to_kind(x.kind())?;
        let sin = self.sin.f_narrow(0, 0, t)?.f_to_kind(x.kind())?;
        rotate(x, &cos, &sin)
    }

    /// The cos and sin of each token's position `positions` `[b, t]` (inside its document),
    /// `[b, 1, t, head_dim]` in `kind`: gathered once per block for q and k.
    pub fn tables_at(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor), TchError> {
        let (b, t) = positions.size2()?;
        let d = self.cos.size()[1];
        let flat = positions.f_reshape([-1])?;
        let gather = |table: &Tensor| table.f_index_select(0, &flat)?.f_view([b, 1, t, d])?.f_to_kind(kind);
        Ok((gather(&self.cos)?, gather(&self.sin)?))
    }

    /// q, k and v `[b, heads, t, d]` with q and k rotated by the positions whose tables are
    /// `cos` and `sin` ([`Rope::tables_at`]), from their projections' outputs `[b, t, heads·d]`
    /// (or the merged output `qkv`, split first). ATen's ops: our node rotates by the position in
    /// the window only.
    pub fn rotate_at(
        parts: [&Tensor; 3],
        heads: i64,
        kv_heads: i64,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor), TchError> {
        let [q, k, v] = parts;
        Ok((
            rotate(&split_heads(q, heads)?, cos, sin)?,
            rotate(&split_heads(k, kv_heads)?, cos, sin)?,
            split_heads(&v.f_contiguous()?, kv_heads)?,
        ))
    }
}

/// `x` `[b, heads, t, d]` rotated by the tables `cos` and `sin` (broadcast over heads).
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, TchError> {
    let d = x.size()[3];
    // Halves by one split (its backward is one concatenation; two narrows' would zero-fill a
    // full-width tensor each and add them).
    let halves = x.f_split(d / 2, -1)?;
    let rotated = Tensor::f_cat(&[&halves[1].f_neg()?, &halves[0]], -1)?;
    x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)
}

/// Causal attention of `q` `[b, heads, t, d]` over `k`, `v` `[b, kv_heads, t, d]`; when there
/// are fewer key/value heads each serves `heads / kv_heads` query heads. Returns `[b, t, heads·d]`.
/// With `documents` each token reads only its own document's tokens (`data.document_mask`):
/// through the variable-length fused kernels given the documents' lengths, or through
/// `scaled_dot_product_attention` with the block-diagonal mask.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dropout: f64,
    documents: Option<&DocumentAttention>,
) -> Result<Tensor, TchError> {
    let (b, h, t, d) = q.size4()?;
    let groups = h / k.size()[1];
    match documents {
        None => {}
        Some(DocumentAttention::Lengths { cu_seqlens, max_len }) => {
            // [b, heads, t, d] → [b·t, heads, d]: the documents laid end to end.
            let tokens = |x: &Tensor| -> Result<Tensor, TchError> {
                let heads = x.size()[1];
                x.f_transpose(1, 2)?.f_contiguous()?.f_view([b * t, heads, d])
            };
            let y = crate::ffi::attention::varlen_attention(
                &tokens(q)?,
                &tokens(k)?,
                &tokens(v)?,
                cu_seqlens,
                *max_len,
                dropout,
            )?;
            return y.f_view([b, t, h * d]);
        }
        Some(DocumentAttention::Mask(mask)) => {
            let mask = mask.f_to_kind(q.kind())?;
            let y = Tensor::f_scaled_dot_product_attention(
                q,
                k,
                v,
                Some(&mask),
                dropout,
                false,
                None,
                groups > 1,
            )?;
            return y.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, h * d]);
        }
    }
    let y = if groups > 1 && repeats_grouped_heads(q.device(), q.kind()) {
        let (k, v) = (
            k.f_repeat_interleave_self_int(groups, 1, None)?,
            v.f_repeat_interleave_self_int(groups, 1, None)?,
        );
        Tensor::f_scaled_dot_product_attention::<Tensor>(q, &k, &v, None, dropout, true, None, false)?
    } else {
        Tensor::f_scaled_dot_product_attention::<Tensor>(q, k, v, None, dropout, true, None, groups > 1)?
    };
    y.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, h * d])
}

/// Whether attention repeats grouped key/value heads to every query head before the kernel (as
/// `transformers`' `repeat_kv`) instead of passing them grouped. On CUDA in fp32 (or fp64): the
/// only fused CUDA kernel that takes grouped heads, flash, needs 16-bit inputs, and the grouped
/// call falls back to the math path, which keeps a t × t score matrix per head (an H200 measured
/// twice the planned peak on a small Llama); repeated heads run the memory-efficient kernel. The
/// CPU's fused kernel takes grouped heads in every dtype.
pub fn repeats_grouped_heads(device: Device, compute: Kind) -> bool {
    device.is_cuda() && !matches!(compute, Kind::Half | Kind::BFloat16)
}

/// `[b, t, heads·d]` → `[b, heads, t, d]`.
pub fn split_heads(x: &Tensor, heads: i64) -> Result<Tensor, TchError> {
    let (b, t, c) = x.size3()?;
    x.f_view([b, t, heads, c / heads])?.f_transpose(1, 2)
}

/// SwiGLU: `down(silu(gate(x)) · up(x))`; the product through our node (`ffi::llama_ops`) with
/// `ours`, gate and up as one matrix multiplication with `merged` (a joint node, ours or of
/// ATen's ops, then reads their joint output as it is and writes its gradient whole); `down` for
/// `output`.
pub fn swiglu(
    x: &Tensor,
    gate: &Linear,
    up: &Linear,
    down: &Linear,
    ours: bool,
    merged: bool,
    output: Output,
) -> Result<Tensor, TchError> {
    let product = match (merged, ours) {
        // The joint node in both cases (ATen's ops where ours is off): it writes the joint
        // gradient, where autograd would join the halves' gradients by a copy.
        (true, _) => crate::ffi::llama_ops::swiglu_joint(&merged_linear(x, &[gate, up])?, ours)?,
        (false, true) => crate::ffi::llama_ops::swiglu(&gate.forward(x)?, &up.forward(x)?)?,
        (false, false) => gate.forward(x)?.f_silu()?.f_mul(&up.forward(x)?)?,
    };
    down.forward_for(&product, output)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(fused: bool, kind: Kind) -> RmsNorm {
        let weight = Tensor::linspace(0.5, 1.5, 48, (kind, Device::Cpu)).set_requires_grad(true);
        RmsNorm { weight, eps: 1e-5, fused, ours: false }
    }

    /// The fused path hands ATen the weight, the width and the epsilon (on the CPU ATen
    /// decomposes it into what the step-by-step form does, so fp32 agrees to the bit).
    #[test]
    fn aten_rms_norm_gets_the_weight_and_epsilon_of_the_step_by_step_form() {
        let x = (Tensor::randn([3, 5, 48], (Kind::Float, Device::Cpu)) * 1e-3).set_requires_grad(true);
        let run = |n: &RmsNorm| {
            let y = n.forward(&x).unwrap();
            let (gx, gw) = {
                let g = Tensor::run_backward(&[&(&y * &y).sum(Kind::Float)], &[&x, &n.weight], false, false);
                (g[0].shallow_clone(), g[1].shallow_clone())
            };
            (y.detach(), gx, gw)
        };
        let (a, b) = (run(&norm(false, Kind::Float)), run(&norm(true, Kind::Float)));
        assert!(a.0.equal(&b.0) && a.1.equal(&b.1) && a.2.equal(&b.2), "fp32: fused and step by step differ");
        // An epsilon lost on the way would show here: the inputs are small enough for it to matter.
        let loose = RmsNorm { eps: 1e-3, ..norm(true, Kind::Float) };
        assert!(!run(&loose).0.equal(&a.0));
    }

    /// Merged layers give each layer's columns (biases included); a mix of layers with and
    /// without a bias is refused, not computed without the biases.
    #[test]
    fn merged_linear_gives_each_layers_columns_and_refuses_mixed_biases() {
        let layer = |out: i64, bias: bool| Linear {
            weight: Tensor::randn([out, 6], (Kind::Float, Device::Cpu)),
            bias: bias.then(|| Tensor::randn([out], (Kind::Float, Device::Cpu))),
            ours: false,
        };
        let x = Tensor::randn([2, 3, 6], (Kind::Float, Device::Cpu));
        let (a, b) = (layer(4, true), layer(2, true));
        let parts = merged_linear(&x, &[&a, &b]).unwrap().split_with_sizes([4, 2], -1);
        for (part, l) in parts.iter().zip([&a, &b]) {
            assert!(part.allclose(&l.forward(&x).unwrap(), 1e-6, 1e-6, false));
        }
        let err = merged_linear(&x, &[&a, &layer(2, false)]).unwrap_err().to_string();
        assert!(err.contains("a bias or none"), "{err}");
    }

    /// Our RoPE node (the kernel's source emulated on the host) rotates as ATen's ops do, and its
    /// backward rotates the gradient back: fp32 to float rounding; under bf16 no further from the
    /// fp32 result than ATen's bf16 ops (which round the tables and each step) are. Two heads of
    /// 8 (a value a thread) and of 16 (8 pairs a thread, in 16-byte packs) over 5 positions of a
    /// table made for 7.
    #[test]
    fn the_rope_node_rotates_as_atens_ops_do() {
        use crate::ffi::kernels::CudaEmulation;
        for d in [8, 16] {
            let (plain, ours) = (
                Rope::new(d, 7, 10000.0, Device::Cpu, false).unwrap(),
                Rope::new(d, 7, 10000.0, Device::Cpu, true).unwrap(),
            );
            let x32 = Tensor::arange(3 * 5 * 2 * d, (Kind::Float, Device::Cpu))
                .view([3, 5, 2 * d])
                .f_mul_scalar(0.37)
                .unwrap()
                .sin()
                * 3.0;
            let dy = Tensor::arange(3 * 2 * 5 * d, (Kind::Float, Device::Cpu))
                .view([3, 2, 5, d])
                .f_mul_scalar(0.91)
                .unwrap()
                .cos();
            let run = |rope: &Rope, kind: Kind| {
                let x = x32.to_kind(kind).set_requires_grad(true);
                let emulation = rope.ours.then(CudaEmulation::start);
                let y = rope.rotate_heads(&x, 2).unwrap();
                let g = Tensor::run_backward(
                    &[&(y.to_kind(Kind::Float) * &dy).sum(Kind::Float)],
                    &[&x],
                    false,
                    false,
                );
                if let Some(e) = emulation {
                    assert_eq!(e.launches(), 2, "one launch forward, one backward");
                }
                (y.detach().to_kind(Kind::Float), g[0].to_kind(Kind::Float))
            };
            let ((ya, ga), (yb, gb)) = (run(&plain, Kind::Float), run(&ours, Kind::Float));
            assert_eq!(yb.size(), [3, 2, 5, d]);
            assert!(
                rel(&yb, &ya) < 1e-6 && rel(&gb, &ga) < 1e-6,
                "d {d} fp32: {} {}",
                rel(&yb, &ya),
                rel(&gb, &ga)
            );
            let ((yp, gp), (yo, go)) = (run(&plain, Kind::BFloat16), run(&ours, Kind::BFloat16));
            assert!(
                rel(&yo, &ya) <= rel(&yp, &ya) + 1e-3 && rel(&go, &ga) <= rel(&gp, &ga) + 1e-3,
                "d {d} bf16: ours {} {}, ATen's {} {}",
                rel(&yo, &ya),
                rel(&go, &ga),
                rel(&yp, &ya),
                rel(&gp, &ga)
            );
            // A wrong rotation would be far off: the halves swapped give O(1) differences.
            assert!(rel(&yo, &ya) < 1e-2);
            // q's columns of a merged q/k/v output are read where they are (rows 3·d apart here),
            // and from a start off 16 bytes (a value a thread).
            let wide = Tensor::cat(&[&x32, &x32.narrow(2, 0, d).f_mul_scalar(-2.0).unwrap()], 2);
            let emulation = CudaEmulation::start();
            for view in [wide.narrow(2, 0, 2 * d), wide.narrow(2, 1, 2 * d)] {
                let (strided, copied) =
                    (ours.rotate_heads(&view, 2).unwrap(), ours.rotate_heads(&view.contiguous(), 2).unwrap());
                assert!(strided.equal(&copied), "d {d}: the node read a strided q wrongly");
            }
            assert_eq!(emulation.launches(), 4);
        }
        // Where the kernels do not run, the node is refused with its reason.
        let ours = Rope::new(8, 7, 10000.0, Device::Cpu, true).unwrap();
        let err = crate::ffi::llama_ops::rope(
            &Tensor::ones([3, 5, 16], (Kind::Float, Device::Cpu)),
            &ours.cos,
            &ours.sin,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("do not run on this device"), "{err}");
    }

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        ((a - b).abs().max() / b.abs().max()).double_value(&[])
    }

    /// The joint node (q, k and v from a merged q/k/v output in one launch each way) gives what
    /// the single node gives on q's and k's columns and v's copy, to the bit, and the joint
    /// gradient that ATen's ops on the parts give (fp32 to float rounding); with a part's output
    /// unused, that part's gradient is zero. Three query heads, one key/value head.
    #[test]
    fn the_joint_rope_node_gives_q_k_and_v_and_the_joint_gradient() {
        use crate::ffi::kernels::CudaEmulation;
        let (heads, kv) = (3, 1);
        for (d, kind) in [(8, Kind::Float), (16, Kind::Float), (16, Kind::BFloat16), (32, Kind::Half)] {
            let (plain, ours) = (
                Rope::new(d, 7, 10000.0, Device::Cpu, false).unwrap(),
                Rope::new(d, 7, 10000.0, Device::Cpu, true).unwrap(),
            );
            let width = (heads + 2 * kv) * d;
            let qkv32 = Tensor::arange(2 * 6 * width, (Kind::Float, Device::Cpu))
                .view([2, 6, width])
                .f_mul_scalar(0.37)
                .unwrap()
                .sin()
                * 3.0;
            let dys: Vec<Tensor> = [heads, kv, kv]
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    Tensor::arange(2 * n * 6 * d, (Kind::Float, Device::Cpu))
                        .view([2, n, 6, d])
                        .f_mul_scalar(0.91 + i as f64)
                        .unwrap()
                        .cos()
                })
                .collect();
            let run = |rope: &Rope, used: usize| {
                let qkv = qkv32.to_kind(kind).set_requires_grad(true);
                let emulation = rope.ours.then(CudaEmulation::start);
                let (q, k, v) = rope.rotate_joint_heads(&qkv, heads, kv).unwrap();
                let parts = [&q, &k, &v];
                let objective = (0..used)
                    .map(|i| (parts[i].to_kind(Kind::Float) * &dys[i]).sum(Kind::Float))
                    .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b);
                let g = Tensor::run_backward(&[&objective], &[&qkv], false, false);
                if let Some(e) = emulation {
                    assert_eq!(e.launches(), 2, "one launch forward, one backward");
                }
                let out: Vec<Tensor> = parts.iter().map(|p| p.detach().to_kind(Kind::Float)).collect();
                (out, g[0].to_kind(Kind::Float))
            };
            let what = format!("d {d} {kind:?}");
            let ((joint, gj), (aten, ga)) = (run(&ours, 3), run(&plain, 3));
            // The single node on the same columns: the same arithmetic.
            let qkv = qkv32.to_kind(kind);
            let single = {
                let _emulation = CudaEmulation::start();
                [
                    ours.rotate_heads(&qkv.narrow(2, 0, heads * d), heads).unwrap(),
                    ours.rotate_heads(&qkv.narrow(2, heads * d, kv * d), kv).unwrap(),
                ]
            };
            for (i, s) in single.iter().enumerate() {
                assert!(
                    joint[i].equal(&s.to_kind(Kind::Float)),
                    "{what}: part {i} differs from the single node's"
                );
            }
            assert!(
                joint[2].equal(
                    &split_heads(&qkv.narrow(2, (heads + kv) * d, kv * d), kv).unwrap().to_kind(Kind::Float)
                ),
                "{what}: v is not copied"
            );
            let tolerance = if kind == Kind::Float { 1e-6 } else { 1e-2 };
            for (i, (a, b)) in joint.iter().zip(&aten).enumerate() {
                assert!(rel(a, b) < tolerance, "{what}: part {i} from ATen's by {}", rel(a, b));
            }
            assert!(rel(&gj, &ga) < tolerance, "{what}: the joint gradient from ATen's by {}", rel(&gj, &ga));
            // v's output unused: its columns of the gradient are zero, the rest as before.
            let (_, g2) = run(&ours, 2);
            assert_eq!(g2.narrow(2, (heads + kv) * d, kv * d).abs().max().double_value(&[]), 0.0, "{what}");
            assert!(g2.narrow(2, 0, (heads + kv) * d).equal(&gj.narrow(2, 0, (heads + kv) * d)), "{what}");
        }
        let ours = Rope::new(8, 7, 10000.0, Device::Cpu, true).unwrap();
        let err = crate::ffi::llama_ops::rope_qkv(
            &Tensor::ones([2, 6, 40], (Kind::Float, Device::Cpu)),
            &ours.cos,
            &ours.sin,
            3,
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be positive"), "{err}");
    }
}
