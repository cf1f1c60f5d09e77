//! Document masking (`data.document_mask`): where the documents of a packed batch lie, computed
//! from its token ids alone, so a replayed, resumed or re-split micro-batch finds the same ones.
//! A document ends at the EOS id (`prepare` writes one after every document: it belongs to the
//! document it ends) and the next token starts the next; every row starts a document (a window
//! cut into a document's middle sees that part as a document of its own). Owns each token's
//! position inside its document and the two forms attention takes the documents in: an additive
//! block-diagonal causal mask (the CPU's reference path) or the documents' cumulative lengths
//! over the flattened batch (CUDA's variable-length fused kernels: no t × t mask). Which EOS id a
//! run uses ([`eos_id`]) is decided here too, from the corpus's metadata and the config.
use tch::{Kind, TchError, Tensor};

/// The documents of one batch of token ids `[b, t]`.
pub struct Documents {
    /// `[b, t]` int64: each token's position inside its document (0 at a document's first token).
    pub positions: Tensor,
    pub attention: DocumentAttention,
}

/// How attention is told which tokens share a document.
pub enum DocumentAttention {
    /// `[b, 1, t, t]` fp32: 0 where query i may read key j (same document, j ≤ i), -inf
    /// elsewhere; added to the scores (`scaled_dot_product_attention`'s `attn_mask`).
    Mask(Tensor),
    /// The documents of the flattened `[b·t]` tokens for the variable-length kernels:
    /// `cu_seqlens` int32 `[documents + 1]` (0, each document's end, b·t) and the longest one.
    Lengths { cu_seqlens: Tensor, max_len: i64 },
}

impl Documents {
    /// The documents of `idx` `[b, t]`, documents ending at `eos`; attention as lengths where
    /// the variable-length kernels run (CUDA), as a mask elsewhere.
    pub fn of(idx: &Tensor, eos: i64) -> Result<Self, TchError> {
        Self::with_form(idx, eos, idx.device().is_cuda())
    }

    /// As [`Documents::of`], the form chosen: `lengths` or the mask.
    pub fn with_form(idx: &Tensor, eos: i64, lengths: bool) -> Result<Self, TchError> {
        let _no_grad = tch::no_grad_guard();
        let (b, t) = idx.size2()?;
        let starts = starts(idx, eos)?;
        let steps = Tensor::f_arange(t, (Kind::Int64, idx.device()))?.f_expand([b, t], false)?;
        // Each token's document start: the last start at or before it (a running maximum of
        // the start indices, 0 elsewhere).
        let start_at = steps.f_where_scalarother(&starts, 0)?;
        let (first, _) = start_at.f_cummax(1)?;
        let positions = steps.f_sub(&first)?;
        let attention = match lengths {
            true => lengths_of(&starts)?,
            false => DocumentAttention::Mask(mask_of(&starts)?),
        };
        Ok(Self { positions, attention })
    }
}

/// `[b, t]` bool: where a document starts (each row's first token, and after every EOS).
fn starts(idx: &Tensor, eos: i64) -> Result<Tensor, TchError> {
    let (b, t) = idx.size2()?;
    let first = Tensor::f_ones([b, 1], (Kind::Bool, idx.device()))?;
    let after_eos = idx.f_narrow(1, 0, t - 1)?.f_eq(eos)?;
    Tensor::f_cat(&[&first, &after_eos], 1)
}

/// The additive mask of [`DocumentAttention::Mask`] from the starts `[b, t]`.
fn mask_of(starts: &Tensor) -> Result<Tensor, TchError> {
    let (_, t) = starts.size2()?;
    let document = starts.f_cumsum(1, Kind::Int64)?;
    let same = document.f_unsqueeze(2)?.f_eq_tensor(&document.f_unsqueeze(1)?)?;
    let causal = Tensor::f_ones([t, t], (Kind::Bool, starts.device()))?.f_tril(0)?;
    let allowed = same.f_logical_and(&causal)?;
    let zeros = Tensor::f_zeros(allowed.size(), (Kind::Float, starts.device()))?;
    zeros.f_masked_fill(&allowed.f_logical_not()?, f64::NEG_INFINITY)?.f_unsqueeze(1)
}

/// The cumulative lengths of [`DocumentAttention::Lengths`] from the starts `[b, t]`. Reading
/// the longest length back is the one host sync a micro-batch's documents cost.
fn lengths_of(starts: &Tensor) -> Result<DocumentAttention, TchError> {
    let flat = starts.f_reshape([-1])?;
    let n = flat.size()[0];
    let begins = flat.f_nonzero()?.f_reshape([-1])?;
    let end = Tensor::f_full([1], n, (Kind::Int64, starts.device()))?;
    let bounds = Tensor::f_cat(&[&begins, &end], 0)?;
    let max_len = bounds.f_diff(1, 0, None::<Tensor>, None::<Tensor>)?.f_max()?.f_int64_value(&[])?;
    Ok(DocumentAttention::Lengths { cu_seqlens: bounds.f_to_kind(Kind::Int)?, max_len })
}

/// The id at which a run's documents end: none when `data.document_mask` is off; `manifest`:
/// the `eos_id` of the source's `prepare` manifest.
pub fn run_eos(
    data: &crate::config::DataConfig,
    manifest: Option<u32>,
) -> Result<Option<u32>, DocumentsError> {
    data.document_mask.then(|| eos_id(data.eos_id, manifest, &data.source)).transpose()
}

/// The id that ends a document for `data.document_mask`: the `prepare` manifest's `eos_id`, or
/// `data.eos_id` where the source has no manifest; both given must agree.
pub fn eos_id(configured: Option<u32>, manifest: Option<u32>, source: &str) -> Result<u32, DocumentsError> {
    match (configured, manifest) {
        (Some(c), Some(m)) if c != m => Err(DocumentsError::Conflict { configured: c, manifest: m }),
        (_, Some(id)) | (Some(id), None) => Ok(id),
        (None, None) => Err(DocumentsError::NoEos { data_source: source.to_string() }),
    }
}

/// Why document masking cannot start: the user's config (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum DocumentsError {
    #[error("data.document_mask: true needs the id that ends a document, and data.source `{data_source}` has no dataset.json naming one (a `trainguard prepare` directory does): set data.eos_id to the tokenizer's EOS id (GPT-2's <|endoftext|> is 50256)")]
    NoEos { data_source: String },
    #[error("data.eos_id: {configured} differs from the eos_id {manifest} of the data's dataset.json (the id `prepare` wrote after every document): remove data.eos_id or set it to {manifest}")]
    Conflict { configured: u32, manifest: u32 },
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Positions and documents as the definition says, token by token.
    fn by_hand(row: &[i64], eos: i64) -> (Vec<i64>, Vec<usize>) {
        let (mut pos, mut doc, mut positions, mut docs) = (0, 0, vec![], vec![]);
        for i in 0..row.len() {
            if i > 0 && row[i - 1] == eos {
                pos = 0;
                doc += 1;
            }
            positions.push(pos);
            docs.push(doc);
            pos += 1;
        }
        (positions, docs)
    }

    const ROWS: [[i64; 8]; 3] = [
        [5, 9, 0, 4, 0, 0, 7, 3], // two EOS in a row: an empty-bodied document of one token
        [1, 2, 3, 4, 5, 6, 7, 8], // no EOS: one document
        [0, 1, 2, 0, 3, 4, 5, 0], // starts and ends with an EOS
    ];

    fn batch() -> Tensor {
        Tensor::from_slice(&ROWS.concat()).view([3, 8])
    }

    #[test]
    fn positions_restart_after_every_eos_and_at_each_row() {
        let d = Documents::with_form(&batch(), 0, false).unwrap();
        for (r, row) in ROWS.iter().enumerate() {
            let got: Vec<i64> = Vec::try_from(d.positions.get(r as i64)).unwrap();
            assert_eq!(got, by_hand(row, 0).0, "row {r}");
        }
    }

    #[test]
    fn the_mask_lets_a_token_read_its_own_document_up_to_itself() {
        let DocumentAttention::Mask(mask) = Documents::with_form(&batch(), 0, false).unwrap().attention
        else {
            panic!("asked for the mask");
        };
        assert_eq!(mask.size(), [3, 1, 8, 8]);
        for (r, row) in ROWS.iter().enumerate() {
            let docs = by_hand(row, 0).1;
            for i in 0..8 {
                for j in 0..8 {
                    let open = docs[i] == docs[j] && j <= i;
                    let v = mask.double_value(&[r as i64, 0, i as i64, j as i64]);
                    assert_eq!(v == 0.0, open, "row {r} query {i} key {j}: {v}");
                    assert!(v == 0.0 || v == f64::NEG_INFINITY);
                }
            }
        }
    }

    #[test]
    fn lengths_cover_the_flattened_batch_document_by_document() {
        let DocumentAttention::Lengths { cu_seqlens, max_len } =
            Documents::with_form(&batch(), 0, true).unwrap().attention
        else {
            panic!("asked for lengths");
        };
        assert_eq!(cu_seqlens.kind(), Kind::Int);
        let mut want = vec![0i64];
        for (r, row) in ROWS.iter().enumerate() {
            let docs = by_hand(row, 0).1;
            for i in 1..8 {
                if docs[i] != docs[i - 1] {
                    want.push((r * 8 + i) as i64);
                }
            }
            want.push((r as i64 + 1) * 8);
        }
        let got: Vec<i64> = Vec::try_from(cu_seqlens.to_kind(Kind::Int64)).unwrap();
        assert_eq!(got, want);
        assert_eq!(max_len, 8, "the row without an EOS is one document of 8");
    }

    #[test]
    fn the_eos_id_comes_from_the_manifest_or_the_config_and_both_must_agree() {
        assert_eq!(eos_id(None, Some(3), "tokens:d").unwrap(), 3);
        assert_eq!(eos_id(Some(3), Some(3), "tokens:d").unwrap(), 3);
        assert_eq!(eos_id(Some(7), None, "synthetic").unwrap(), 7);
        let e = eos_id(Some(7), Some(3), "tokens:d").unwrap_err().to_string();
        assert!(e.starts_with("data.eos_id: 7 differs from the eos_id 3"), "{e}");
        let e = eos_id(None, None, "synthetic").unwrap_err().to_string();
        assert!(e.contains("data.document_mask") && e.contains("set data.eos_id"), "{e}");
    }

    fn configs() -> Vec<crate::config::ModelConfig> {
        use crate::config::{Arch, ModelConfig};
        let gpt2 = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 32,
            seq_len: 12,
            ..Default::default()
        };
        let llama = ModelConfig {
            arch: Arch::Llama,
            n_head: 4,
            n_kv_head: Some(2),
            ffn_hidden: Some(24),
            bias: false,
            ..gpt2.clone()
        };
        vec![gpt2, llama]
    }

    /// A packed row read with the mask gives each document's logits as the plain model gives
    /// them for that document fed alone (positions from 0, nothing before it): the definition
    /// of document masking, for both architectures (GPT-2's learned positions restart too).
    #[test]
    fn a_packed_row_gives_each_documents_logits_as_if_it_were_alone() {
        use super::super::Model;
        let docs: [&[i64]; 3] = [&[5, 9, 3, 0], &[4, 7, 0], &[3, 8, 11, 2, 6]];
        let row: Vec<i64> = docs.concat();
        let x = Tensor::from_slice(&row).view([1, 12]);
        for cfg in configs() {
            let plain = Model::new(&cfg, 3, Device::Cpu).unwrap();
            let mut masked = Model::new(&cfg, 3, Device::Cpu).unwrap();
            masked.mask_documents(0);
            let packed = masked.forward(&x, false, None).unwrap();
            let mut start = 0;
            for doc in docs {
                let n = doc.len() as i64;
                let alone = plain.forward(&Tensor::from_slice(doc).view([1, n]), false, None).unwrap();
                let diff = (packed.narrow(1, start, n) - &alone).abs().max().double_value(&[]);
                assert!(diff < 1e-5, "{:?}: document at {start} differs from it alone by {diff:e}", cfg.arch);
                start += n;
            }
            // Without the mask the later documents read the earlier ones: the test can fail.
            let unmasked = plain.forward(&x, false, None).unwrap();
            assert!((unmasked.narrow(1, 4, 8) - packed.narrow(1, 4, 8)).abs().max().double_value(&[]) > 1e-3);
        }
    }

    /// Checkpointed blocks recompute with the same documents: the loss and gradients equal the
    /// plain path's (activation checkpointing and a chunked loss on).
    #[test]
    fn checkpointing_recomputes_with_the_same_documents() {
        use super::super::Model;
        use crate::step::savers::{loss_and_grads, Savers};
        let x =
            Tensor::from_slice(&[5i64, 9, 0, 4, 7, 0, 3, 8, 11, 2, 0, 6, 1, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 0])
                .view([2, 12]);
        let y = x.roll([-1], [1]);
        for cfg in configs() {
            let mut m = Model::new(&cfg, 3, Device::Cpu).unwrap();
            m.mask_documents(0);
            let (plain_loss, plain) = loss_and_grads(&m, &x, &y, 0.5, 1, &Savers::default()).unwrap();
            let savers = Savers { checkpoint_every: 1, loss_chunk_tokens: Some(5), ..Savers::default() };
            let (loss, grads) = loss_and_grads(&m, &x, &y, 0.5, 1, &savers).unwrap();
            assert!((loss - &plain_loss).abs().double_value(&[]) < 1e-6);
            for (a, b) in grads.iter().zip(&plain) {
                assert!((a - b).abs().max().double_value(&[]) < 1e-6, "{:?}", cfg.arch);
            }
        }
    }

    #[test]
    fn a_device_other_than_cuda_gets_the_mask() {
        let d = Documents::of(&batch().to_device(Device::Cpu), 0).unwrap();
        assert!(matches!(d.attention, DocumentAttention::Mask(_)));
    }
}
