//! What a training step's forward pass keeps for backward, as data: each architecture lists the
//! tensors its forward saves (one block's, the final norm's, the embedding's, the buffers it
//! holds) with their sizes and how they are stored, and the planner turns the list into bytes for
//! a precision. The list follows the forward code in this directory (what autograd saves for each
//! op it runs, checked with `saved_tensors_hooks` and `trainguard plan --profile`), so the model
//! and the planner read one description per architecture. Adding an architecture: its `saved()`
//! beside its `tensors()`, and one arm in `model::saved_activations`.

/// How many elements a saved tensor has at micro-batch b and sequence length s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// n per token: n·b·s.
    Token(u64),
    /// One s × s score matrix per head: n·b·s².
    Scores(u64),
    /// n per position, shared by the batch (tables indexed by position): n·s.
    Position(u64),
    /// n whatever the batch and the sequence (a copy of weights).
    Fixed(u64),
}

/// The element type a saved tensor has, as a function of the precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The compute dtype: fp32, or 16 bits under autocast and in bf16-pure.
    Compute,
    /// The residual stream's dtype: fp32 except in bf16-pure (autocast keeps fp32 + 16-bit sums
    /// in fp32).
    Residual,
    /// fp32 whatever the precision (norm statistics, attention's log-sum-exp, RMSNorm's fp32
    /// computation).
    Fp32,
    /// A norm's output that `n` linear layers read: one tensor, except under autocast, which
    /// casts it to 16 bits once per linear layer (activation casts are not cached) and each
    /// layer keeps its own copy.
    LinearInput(u64),
    /// An fp32 table cast to the compute dtype where it is used: a view in fp32 (nothing new), a
    /// 16-bit copy otherwise.
    CastTable,
    /// A dropout mask.
    DropoutMask,
    /// Fixed bytes per element whatever the precision (token ids, positions, lengths: integers).
    Bytes(u64),
    /// Weights copied in the forward (concatenated, `kernels.merged_projections`): under
    /// autocast the copy is the 16-bit cast that replaces the ones counted with the weights
    /// (nothing new); otherwise a copy in the compute dtype.
    WeightCopy,
}

/// One saved tensor (or a group stored alike).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub what: &'static str,
    pub count: Count,
    pub stored: Stored,
}

impl Saved {
    pub const fn token(what: &'static str, n: u64, stored: Stored) -> Self {
        Self { what, count: Count::Token(n), stored }
    }

    /// Bytes at micro-batch `b` and sequence length `s`.
    pub fn bytes(&self, w: &Widths, b: u64, s: u64) -> u64 {
        let elements = match self.count {
            Count::Token(n) => n * b * s,
            Count::Scores(n) => n * b * s * s,
            Count::Position(n) => n * s,
            Count::Fixed(n) => n,
        };
        let per = match self.stored {
            Stored::Compute => w.compute,
            Stored::Residual => w.residual,
            Stored::Fp32 => 4,
            Stored::LinearInput(n) if w.autocast => n * w.compute,
            Stored::LinearInput(_) => w.compute,
            Stored::CastTable if w.compute == 4 => 0,
            Stored::CastTable => w.compute,
            Stored::DropoutMask => w.mask,
            Stored::Bytes(n) => n,
            Stored::WeightCopy if w.autocast => 0,
            Stored::WeightCopy => w.compute,
        };
        elements * per
    }
}

/// Bytes per element of each kind of saved tensor, for one precision and device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Widths {
    pub compute: u64,
    pub residual: u64,
    /// Mixed precision (autocast): linear layers cast their inputs.
    pub autocast: bool,
    /// A dropout mask element: a bool on CUDA, a scaled noise tensor of the compute dtype on CPU.
    pub mask: u64,
}

/// How the forward runs attention and dropout (what it saves depends on both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Regime {
    /// `scaled_dot_product_attention`'s fused kernels (flash, memory-efficient, CPU flash): no
    /// score matrix kept, an fp32 log-sum-exp per query head and token instead. `false`: the
    /// scores are materialised (softmax output, and with dropout its dropped copy and mask).
    pub fused_attention: bool,
    pub dropout: bool,
    /// RMSNorm as ATen's fused CUDA kernel (`kernels.fused_rms_norm` on CUDA).
    pub fused_rms_norm: bool,
    /// Grouped key/value heads repeated to every query head before attention
    /// (`layers::repeats_grouped_heads`: CUDA in fp32), so attention keeps them repeated.
    pub repeated_kv_heads: bool,
    /// The norms as our residual-norm node (`kernels.fused_residual_norm` on CUDA, fp32
    /// weights): its output is already in the compute dtype, one tensor for every reader.
    pub residual_norm_node: bool,
    /// SwiGLU's product as our node (`kernels.fused_swiglu` on CUDA): silu(gate) is not kept.
    pub swiglu_node: bool,
    /// RoPE as our node (`kernels.fused_rope` on CUDA): no cast tables kept.
    pub rope_node: bool,
    /// Llama's q/k/v and gate/up each one matrix multiplication (`kernels.merged_projections`):
    /// each norm has one reader, and the concatenated weights are kept.
    pub merged_projections: bool,
    /// `data.document_mask`, and how attention takes the documents.
    pub documents: Option<DocumentForm>,
}

/// How attention takes the documents of `data.document_mask` (`model::documents`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentForm {
    /// The CPU's block-diagonal mask: an fp32 t × t matrix per sequence, shared by the blocks.
    Mask,
    /// CUDA's variable-length kernels: the documents' cumulative lengths, int32.
    Lengths,
}

/// What one architecture's forward keeps for backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activations {
    /// One block's saved tensors (every block alike).
    pub block: Vec<Saved>,
    /// Before the first block (embedding dropout's mask).
    pub embedding: Vec<Saved>,
    /// The final norm, whose output the LM head reads (with a chunked loss these exist per chunk;
    /// only its input, the hidden state, is kept for the batch).
    pub final_norm: Vec<Saved>,
    /// Tables the model holds besides its parameters (RoPE's cos and sin), allocated once.
    pub buffers: Vec<Saved>,
    /// Backward through a block, on top of its saved tensors: the widest gradients alive at once
    /// (the MLP's, net of the saved tensors freed by then, and the residual stream's).
    pub block_backward: Vec<Saved>,
}

/// Shared layers' saved tensors.
pub mod layers {
    use super::{Count, DocumentForm, Regime, Saved, Stored};

    /// LayerNorm over `h` channels read by `readers` linear layers: its input, fp32 mean and
    /// rstd per token, its output.
    pub fn layer_norm(h: u64, readers: u64) -> [Saved; 3] {
        [
            Saved::token("LayerNorm input", h, Stored::Residual),
            Saved::token("LayerNorm mean and rstd", 2, Stored::Fp32),
            Saved::token("LayerNorm output", h, Stored::LinearInput(readers)),
        ]
    }

    /// RMSNorm over `h` channels read by `readers` linear layers. Step by step in fp32
    /// (`layers::RmsNorm`): the input in fp32 (the residual stream itself, or its fp32 copy in
    /// bf16-pure, where the 16-bit input is then not kept), the fp32 rsqrt per token, the
    /// normalised input back in the input's dtype (what the weight multiplies) and the output.
    /// ATen's fused kernel (`FusedRmsNormBackward0` keeps input, weight and rstd): the input as
    /// it is, the fp32 rstd per token and the output.
    /// Our residual-norm node: the input, an fp32 mean (0) and rstd per token, one output in the
    /// compute dtype that every reader shares.
    pub fn rms_norm(h: u64, readers: u64, r: Regime) -> Vec<Saved> {
        if r.residual_norm_node {
            return vec![
                Saved::token("RMSNorm input", h, Stored::Residual),
                Saved::token("RMSNorm mean and rstd", 2, Stored::Fp32),
                Saved::token("RMSNorm output", h, Stored::Compute),
            ];
        }
        let output = Saved::token("RMSNorm output", h, Stored::LinearInput(readers));
        if r.fused_rms_norm {
            return vec![
                Saved::token("RMSNorm input", h, Stored::Residual),
                Saved::token("RMSNorm rstd", 1, Stored::Fp32),
                output,
            ];
        }
        vec![
            Saved::token("RMSNorm input in fp32", h, Stored::Fp32),
            Saved::token("RMSNorm rsqrt", 1, Stored::Fp32),
            Saved::token("RMSNorm normalised input", h, Stored::Residual),
            output,
        ]
    }

    /// `scaled_dot_product_attention` over `heads` query heads of `q` channels in all and
    /// `kv` key/value channels (grouped-query heads as they are, unless the regime repeats them:
    /// then k and v are q-wide; the repeat itself keeps nothing): q, k, v and the output, kept by
    /// the output projection too (the kernels write it token-major, so the transpose back is a
    /// view), plus either the log-sum-exp or the score matrices.
    pub fn attention(q: u64, kv: u64, heads: u64, r: Regime) -> Vec<Saved> {
        let kv = if r.repeated_kv_heads { q } else { kv };
        let mut out = vec![
            Saved::token("attention q, k, v", q + 2 * kv, Stored::Compute),
            Saved::token("attention output", q, Stored::Compute),
        ];
        if r.fused_attention {
            out.push(Saved::token("attention log-sum-exp", heads, Stored::Fp32));
        } else {
            out.push(Saved {
                what: "attention probabilities",
                count: Count::Scores(heads),
                stored: Stored::Compute,
            });
            if r.dropout {
                out.push(Saved {
                    what: "attention probabilities after dropout",
                    count: Count::Scores(heads),
                    stored: Stored::Compute,
                });
                out.push(Saved {
                    what: "attention dropout mask",
                    count: Count::Scores(heads),
                    stored: Stored::DropoutMask,
                });
            }
        }
        out
    }

    /// What `data.document_mask` holds through the step (before the first block, shared by
    /// all): each token's int64 position in its document, and the fp32 mask or the int32
    /// lengths (at most one document per token, plus one).
    pub fn documents(r: Regime) -> Vec<Saved> {
        let Some(form) = r.documents else { return vec![] };
        let mut out = vec![Saved::token("positions inside documents (int64)", 1, Stored::Bytes(8))];
        out.push(match form {
            DocumentForm::Mask => Saved {
                what: "document mask (fp32, t × t per sequence)",
                count: Count::Scores(1),
                stored: Stored::Fp32,
            },
            DocumentForm::Lengths => {
                Saved::token("documents' cumulative lengths (int32)", 1, Stored::Bytes(4))
            }
        });
        out
    }

    /// Per block with the mask of `data.document_mask`: its copy in a 16-bit compute dtype,
    /// which attention keeps for backward (none in fp32: the shared mask itself).
    pub fn document_mask_cast(r: Regime) -> Option<Saved> {
        (r.documents == Some(DocumentForm::Mask)).then_some(Saved {
            what: "document mask cast to the compute dtype",
            count: Count::Scores(1),
            stored: Stored::CastTable,
        })
    }

    /// Dropout on `n` channels per token: its mask, when dropout is on.
    pub fn dropout(n: u64, r: Regime) -> Option<Saved> {
        r.dropout.then(|| Saved::token("dropout mask", n, Stored::DropoutMask))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP32: Widths = Widths { compute: 4, residual: 4, autocast: false, mask: 4 };
    const MIXED: Widths = Widths { compute: 2, residual: 4, autocast: true, mask: 2 };
    const PURE: Widths = Widths { compute: 2, residual: 2, autocast: false, mask: 2 };

    fn per_token(list: &[Saved], w: &Widths) -> u64 {
        list.iter().map(|s| s.bytes(w, 1, 1)).sum()
    }

    #[test]
    fn rms_norm_keeps_fp32_statistics_whatever_the_precision() {
        let r = Regime {
            fused_attention: true,
            dropout: false,
            fused_rms_norm: false,
            repeated_kv_heads: false,
            residual_norm_node: false,
            swiglu_node: false,
            rope_node: false,
            merged_projections: false,
            documents: None,
        };
        let n = layers::rms_norm(10, 3, r);
        // input 4h, rsqrt 4, normalised h·r, output: one tensor, or a 16-bit copy per reader.
        assert_eq!(per_token(&n, &FP32), 40 + 4 + 40 + 40);
        assert_eq!(per_token(&n, &MIXED), 40 + 4 + 40 + 3 * 20);
        assert_eq!(per_token(&n, &PURE), 40 + 4 + 20 + 20);
        // The fused kernel keeps the input as it comes (no fp32 copy, no normalised input).
        let fused = layers::rms_norm(10, 3, Regime { fused_rms_norm: true, ..r });
        assert_eq!(per_token(&fused, &FP32), 40 + 4 + 40);
        assert_eq!(per_token(&fused, &MIXED), 40 + 4 + 3 * 20);
        assert_eq!(per_token(&fused, &PURE), 20 + 4 + 20);
        // Our node: one 16-bit output for the three readers, two fp32 statistics.
        let ours = layers::rms_norm(10, 3, Regime { residual_norm_node: true, fused_rms_norm: true, ..r });
        assert_eq!(per_token(&ours, &MIXED), 40 + 8 + 20);
        assert_eq!(per_token(&ours, &FP32), 40 + 8 + 40);
    }

    #[test]
    fn cast_tables_cost_nothing_in_fp32_and_scores_grow_with_the_square_of_the_sequence() {
        let t = Saved { what: "cos", count: Count::Position(8), stored: Stored::CastTable };
        assert_eq!((t.bytes(&FP32, 4, 16), t.bytes(&MIXED, 4, 16)), (0, 8 * 16 * 2));
        let s = Saved { what: "p", count: Count::Scores(2), stored: Stored::Compute };
        assert_eq!(s.bytes(&FP32, 3, 16), 2 * 3 * 16 * 16 * 4);
    }

    /// The CPU's document mask costs b·s² fp32 once (and a 16-bit copy per block in 16 bits);
    /// CUDA's lengths cost 4 bytes a token at most; both add the int64 positions.
    #[test]
    fn the_document_mask_grows_with_the_square_of_the_sequence_and_lengths_with_the_tokens() {
        let r = |documents| Regime {
            fused_attention: true,
            dropout: false,
            fused_rms_norm: false,
            repeated_kv_heads: false,
            residual_norm_node: false,
            swiglu_node: false,
            rope_node: false,
            merged_projections: false,
            documents,
        };
        let bytes = |list: &[Saved], w: &Widths| list.iter().map(|s| s.bytes(w, 3, 16)).sum::<u64>();
        assert!(layers::documents(r(None)).is_empty());
        let mask = layers::documents(r(Some(DocumentForm::Mask)));
        assert_eq!(bytes(&mask, &FP32), 3 * 16 * 8 + 3 * 16 * 16 * 4);
        assert_eq!(bytes(&mask, &MIXED), 3 * 16 * 8 + 3 * 16 * 16 * 4, "the shared mask stays fp32");
        let lengths = layers::documents(r(Some(DocumentForm::Lengths)));
        assert_eq!(bytes(&lengths, &MIXED), 3 * 16 * 8 + 3 * 16 * 4);
        let cast = layers::document_mask_cast(r(Some(DocumentForm::Mask))).unwrap();
        assert_eq!((cast.bytes(&FP32, 3, 16), cast.bytes(&MIXED, 3, 16)), (0, 3 * 16 * 16 * 2));
        assert!(layers::document_mask_cast(r(Some(DocumentForm::Lengths))).is_none());
    }
}
