//! Hugging Face `transformers` directories: `trainguard export --hf` writes `config.json`,
//! `model.safetensors`, `generation_config.json` and the run's tokenizer files; `import` reads
//! such a directory back as a model config and trainguard-named weights (`init_from`,
//! `sample`). The name and layout mapping per architecture lives in its own table (`gpt2`).
//! Owns the files and the checks (architecture, sizes, every tensor's shape); not the model.
pub mod gpt2;

use crate::config::ModelConfig;
use crate::model::Model;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// The directory, its config or a tensor does not fit (exit 2).
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
    #[error("cannot write {path}: {message}")]
    Write { path: PathBuf, message: String },
}

pub fn is_usage(cause: &(dyn std::error::Error + 'static)) -> bool {
    matches!(cause.downcast_ref::<HfError>(), Some(HfError::Input { .. }))
}

fn bad(path: &Path, message: impl Into<String>) -> HfError {
    HfError::Input { path: path.into(), message: message.into() }
}

/// Biases and LayerNorm shifts GPT-2 always has, with their sizes, for a model with `bias: false`.
fn bias_shapes(cfg: &ModelConfig) -> Vec<(String, i64)> {
    let c = cfg.n_embd as i64;
    let mut out = vec![("ln_f.bias".to_string(), c)];
    for i in 0..cfg.n_layer {
        for (s, n) in [("ln_1.bias", c), ("attn.c_attn.bias", 3 * c), ("attn.c_proj.bias", c), ("ln_2.bias", c), ("mlp.c_fc.bias", 4 * c), ("mlp.c_proj.bias", c)] {
            out.push((format!("h.{i}.{s}"), n));
        }
    }
    out
}

/// Writes `model` (its weights in trainguard's names) as a `transformers` GPT-2 directory.
pub fn export(model: &Model, dataset: Option<&Path>, out: &Path) -> Result<Vec<String>, HfError> {
    let werr = |p: &Path, e: &dyn std::fmt::Display| HfError::Write { path: p.into(), message: e.to_string() };
    if out.join("model.safetensors").exists() {
        return Err(bad(out, "already holds model.safetensors; choose another directory"));
    }
    std::fs::create_dir_all(out).map_err(|e| werr(out, &e))?;
    let cfg = &model.cfg;
    let _no_grad = tch::no_grad_guard();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (name, t) in model.params.names.iter().zip(&model.params.tensors) {
        let (hf, transposed) = gpt2::hf_name(name);
        let t = t.to_device(Device::Cpu).to_kind(Kind::Float);
        tensors.push((hf, if transposed { t.tr().contiguous() } else { t.contiguous() }));
    }
    if !cfg.bias {
        for (name, n) in bias_shapes(cfg) {
            tensors.push((gpt2::hf_name(&name).0, Tensor::zeros([n], (Kind::Float, Device::Cpu))));
        }
    }
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let weights = out.join("model.safetensors");
    Tensor::write_safetensors(&refs, &weights).map_err(|e| werr(&weights, &e))?;

    let manifest: Option<crate::data::shards::Manifest> =
        dataset.and_then(|d| std::fs::read_to_string(d.join(crate::data::shards::MANIFEST_FILE)).ok()).and_then(|t| serde_json::from_str(&t).ok());
    let eos = manifest.as_ref().map(|m| m.eos_id);
    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_ctx": cfg.seq_len,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        // trainguard's MLP uses the exact (erf) GELU, not GPT-2's tanh approximation.
        "activation_function": "gelu",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    });
    let mut written = vec!["config.json".to_string(), "model.safetensors".into(), "generation_config.json".into()];
    write_json(&out.join("config.json"), &config)?;
    write_json(&out.join("generation_config.json"), &json!({"_from_model_config": true, "bos_token_id": eos, "eos_token_id": eos}))?;
    if let (Some(d), Some(m)) = (dataset, &manifest) {
        let tok = d.join(&m.tokenizer);
        std::fs::copy(&tok, out.join("tokenizer.json")).map_err(|e| werr(&out.join("tokenizer.json"), &e))?;
        let tc = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": m.eos_token, "eos_token": m.eos_token, "unk_token": m.eos_token,
            "model_max_length": cfg.seq_len,
        });
        write_json(&out.join("tokenizer_config.json"), &tc)?;
        written.extend(["tokenizer.json".into(), "tokenizer_config.json".into()]);
    }
    Ok(written)
}

fn write_json(path: &Path, v: &Value) -> Result<(), HfError> {
    std::fs::write(path, serde_json::to_string_pretty(v).expect("JSON values serialise") + "\n").map_err(|e| HfError::Write { path: path.into(), message: e.to_string() })
}

/// Reads a `transformers` GPT-2 directory: its model sizes and its weights in trainguard's
/// names and layouts.
pub fn import(dir: &Path) -> Result<(ModelConfig, Vec<(String, Tensor)>), HfError> {
    let cpath = dir.join("config.json");
    let text = std::fs::read_to_string(&cpath).map_err(|e| bad(&cpath, e.to_string()))?;
    let c: Value = serde_json::from_str(&text).map_err(|e| bad(&cpath, e.to_string()))?;
    if c["model_type"] != "gpt2" {
        return Err(bad(&cpath, format!("model_type {} is not supported (gpt2 is)", c["model_type"])));
    }
    let num = |k: &str| c[k].as_u64().map(|v| v as usize).ok_or_else(|| bad(&cpath, format!("`{k}` missing or not a number")));
    let n_embd = num("n_embd")?;
    if !c["n_inner"].is_null() && c["n_inner"].as_u64() != Some(4 * n_embd as u64) {
        return Err(bad(&cpath, format!("n_inner {} is not 4 × n_embd; trainguard's MLP is 4 × n_embd wide", c["n_inner"])));
    }
    if c["activation_function"] != "gelu" {
        tracing::warn!("{}: activation_function {} differs from trainguard's exact GELU; logits will differ slightly", cpath.display(), c["activation_function"]);
    }
    #[allow(clippy::needless_update)] // the lead's model restructure may add fields
    let cfg = ModelConfig {
        n_layer: num("n_layer")?,
        n_head: num("n_head")?,
        n_embd,
        vocab_size: num("vocab_size")?,
        seq_len: num("n_positions")?,
        dropout: c["resid_pdrop"].as_f64().unwrap_or(0.0),
        bias: true,
        ..ModelConfig::default() // fields a later model family adds keep their defaults
    };
    let wpath = dir.join("model.safetensors");
    let raw = Tensor::read_safetensors(&wpath).map_err(|e| bad(&wpath, e.to_string()))?;
    let weights = raw
        .into_iter()
        .filter(|(n, _)| !gpt2::IGNORED.contains(&n.as_str()))
        .map(|(n, t)| {
            let name = n.strip_prefix(gpt2::PREFIX).unwrap_or(&n).to_string();
            let t = t.to_kind(Kind::Float);
            let t = if gpt2::hf_name(&name).1 { t.tr().contiguous() } else { t };
            (name, t)
        })
        .collect();
    Ok((cfg, weights))
}

/// `init_from`: copies a `transformers` directory's weights into `model`. Every parameter must
/// be there with the model's shape; a bias the model does not have must be zero.
pub fn init_from(model: &Model, dir: &Path) -> Result<(), HfError> {
    let (_, weights) = import(dir)?;
    let wpath = dir.join("model.safetensors");
    let _no_grad = tch::no_grad_guard();
    for (name, p) in model.params.names.iter().zip(&model.params.tensors) {
        let hf = gpt2::hf_name(name).0;
        let src = weights.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| bad(&wpath, format!("no tensor `{hf}`")))?;
        let (want, got) = (p.size(), hf_shape(name, &src.size()));
        if src.size() != want {
            return Err(bad(&wpath, format!("`{hf}` has shape {got:?}; the model (its config) needs {:?}", hf_shape(name, &want))));
        }
        p.shallow_clone().f_copy_(src).map_err(|e| bad(&wpath, e.to_string()))?;
    }
    for (name, t) in &weights {
        if model.params.get(name).is_none() {
            let zero = name.ends_with(".bias") && t.abs().max().double_value(&[]) == 0.0;
            if !zero {
                return Err(bad(&wpath, format!("`{}` has no place in the model (model.bias = false drops only zero biases)", gpt2::hf_name(name).0)));
            }
        }
    }
    Ok(())
}

/// A shape as `transformers` writes the tensor (Conv1D weights transposed).
fn hf_shape(name: &str, shape: &[i64]) -> Vec<i64> {
    if gpt2::hf_name(name).1 {
        shape.iter().rev().copied().collect()
    } else {
        shape.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(bias: bool) -> ModelConfig {
        ModelConfig { bias, n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 40, seq_len: 8, ..ModelConfig::default() }
    }

    #[test]
    fn export_then_init_from_is_bit_exact_and_shapes_are_checked() {
        for bias in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let a = Model::new(&cfg(bias), 1, Device::Cpu).unwrap();
            export(&a, None, &d.path().join("hf")).unwrap();
            let b = Model::new(&cfg(bias), 2, Device::Cpu).unwrap();
            init_from(&b, &d.path().join("hf")).unwrap();
            for (x, y) in a.params.tensors.iter().zip(&b.params.tensors) {
                assert!(x.equal(y));
            }
            let raw = Tensor::read_safetensors(d.path().join("hf/model.safetensors")).unwrap();
            let qkv = raw.iter().find(|(n, _)| n == "transformer.h.0.attn.c_attn.weight").unwrap();
            assert_eq!(qkv.1.size(), [16, 48], "Conv1D layout [in, out]");
            let wide = Model::new(&ModelConfig { n_embd: 32, ..cfg(bias) }, 2, Device::Cpu).unwrap();
            let e = init_from(&wide, &d.path().join("hf")).unwrap_err().to_string();
            assert!(e.contains("`transformer.wte.weight` has shape [40, 16]; the model (its config) needs [40, 32]"), "{e}");
        }
    }
}
