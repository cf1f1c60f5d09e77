//! GPT-2's names in `transformers` (`GPT2LMHeadModel`): trainguard's parameter `NAME` is
//! `transformer.NAME` there, and the four projection weights are `Conv1D`s stored `[in, out]`,
//! the transpose of a `Linear`'s `[out, in]`. The head is tied to `transformer.wte.weight`, so
//! `lm_head.weight` is not written (transformers ties it on load). Also GPT-2's `config.json`
//! both ways, and the zero biases a `bias: false` model exports (GPT-2 always has them).
use super::{bad, switch, whole, Family, HfError};
use crate::config::{Arch, ModelConfig};
use crate::model::LAYER_NORM_EPS;
use serde_json::{json, Value};
use std::path::Path;

pub const FAMILY: Family = Family {
    arch: Arch::Gpt2,
    model_type: "gpt2",
    hf_name,
    from_hf,
    config_json,
    model_config,
    zero_tensors,
    config_keys: &CONFIG_KEYS,
};

const CONFIG_KEYS: [(&str, &str); 6] = [
    ("n_layer", "n_layer"),
    ("n_head", "n_head"),
    ("n_embd", "n_embd"),
    ("vocab_size", "vocab_size"),
    ("seq_len", "n_positions"),
    ("dropout", "resid_pdrop"),
];

/// Prefix of every parameter's name in `transformers`.
pub const PREFIX: &str = "transformer.";
/// Suffixes of the `Conv1D` weights (transposed relative to trainguard's linear weights).
pub const CONV1D: [&str; 4] =
    ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];
/// Names `transformers` may write that trainguard has no parameter for (tied or buffers).
pub const IGNORED: [&str; 1] = ["lm_head.weight"];

/// The `transformers` name of trainguard parameter `name`, and whether its layout is transposed.
pub fn hf_name(name: &str) -> (String, bool) {
    (format!("{PREFIX}{name}"), CONV1D.iter().any(|s| name.ends_with(s)))
}

/// trainguard's name for a tensor `transformers` wrote; None: not a parameter here. Older
/// checkpoints (the Hub's `openai-community/gpt2` among them) keep each block's causal mask,
/// `h.N.attn.bias` and `h.N.attn.masked_bias`: buffers, which transformers does not load either.
fn from_hf(hf: &str, _: &ModelConfig) -> Option<String> {
    let name = hf.strip_prefix(PREFIX).unwrap_or(hf);
    let mask = name.strip_prefix("h.").and_then(|r| r.split_once('.')).is_some_and(|(i, rest)| {
        i.parse::<usize>().is_ok() && matches!(rest, "attn.bias" | "attn.masked_bias")
    });
    (!IGNORED.contains(&hf) && !mask).then(|| name.to_string())
}

/// Biases and LayerNorm shifts GPT-2 always has, with their sizes, for a model with `bias: false`.
fn zero_tensors(cfg: &ModelConfig) -> Vec<(String, i64)> {
    if cfg.bias {
        return vec![];
    }
    let c = cfg.n_embd as i64;
    let mut out = vec![("ln_f.bias".to_string(), c)];
    for i in 0..cfg.n_layer {
        for (s, n) in [
            ("ln_1.bias", c),
            ("attn.c_attn.bias", 3 * c),
            ("attn.c_proj.bias", c),
            ("ln_2.bias", c),
            ("mlp.c_fc.bias", 4 * c),
            ("mlp.c_proj.bias", c),
        ] {
            out.push((format!("h.{i}.{s}"), n));
        }
    }
    out
}

fn config_json(cfg: &ModelConfig) -> Value {
    json!({
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
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    })
}

fn model_config(c: &Value, cpath: &Path) -> Result<ModelConfig, HfError> {
    let num = |k: &str| whole(c, k, cpath);
    let n_embd = num("n_embd")?;
    if !c["n_inner"].is_null() && c["n_inner"].as_u64() != Some(4 * n_embd as u64) {
        return Err(bad(
            cpath,
            format!("n_inner {} is not 4 × n_embd; trainguard's MLP is 4 × n_embd wide", c["n_inner"]),
        ));
    }
    // Keys that change the maths where trainguard computes one way: refused by name (the
    // activation alone is let through with a warning: GPT-2's own checkpoints use gelu_new).
    if switch(c, "tie_word_embeddings", cpath)? == Some(false) {
        return Err(bad(cpath, "`tie_word_embeddings` is false; trainguard's GPT-2 ties its head to the token embedding (an untied `lm_head.weight` has no place)"));
    }
    let eps = match &c["layer_norm_epsilon"] {
        Value::Null => LAYER_NORM_EPS,
        v => v.as_f64().ok_or_else(|| bad(cpath, format!("`layer_norm_epsilon` is {v}, not a number")))?,
    };
    if eps != LAYER_NORM_EPS {
        return Err(bad(
            cpath,
            format!("`layer_norm_epsilon` is {eps}; trainguard's LayerNorm uses {LAYER_NORM_EPS}"),
        ));
    }
    if switch(c, "scale_attn_weights", cpath)? == Some(false) {
        return Err(bad(
            cpath,
            "`scale_attn_weights` is false; trainguard scales attention scores by 1/sqrt(head size)",
        ));
    }
    if switch(c, "scale_attn_by_inverse_layer_idx", cpath)? == Some(true) {
        return Err(bad(
            cpath,
            "`scale_attn_by_inverse_layer_idx` is true; trainguard scales every layer's attention alike",
        ));
    }
    // transformers' names for GELU: exact ones, and tanh approximations (GPT-2's own `gelu_new`,
    // also what an absent key means) that differ from it in the fourth digit. Any other
    // activation (relu, quick_gelu's sigmoid, a name of none) is another model.
    let act = &c["activation_function"];
    let approximation = match act.as_str() {
        Some("gelu" | "gelu_python") => None,
        Some(tanh @ ("gelu_new" | "gelu_fast" | "gelu_pytorch_tanh" | "gelu_accurate")) => Some(tanh),
        None if act.is_null() => Some("gelu_new (transformers' default)"),
        _ => return Err(bad(cpath, format!("`activation_function` is {}; trainguard's GPT-2 computes GELU (exactly; its tanh approximations are let through with a warning)", act))),
    };
    if let Some(tanh) = approximation {
        super::warn_once(format!("{}: activation_function {tanh} approximates the exact GELU trainguard computes; logits will differ slightly", cpath.display()));
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
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_layouts_follow_gpt2lmheadmodel() {
        assert_eq!(hf_name("wte.weight"), ("transformer.wte.weight".into(), false));
        assert_eq!(hf_name("h.3.attn.c_attn.weight"), ("transformer.h.3.attn.c_attn.weight".into(), true));
        assert_eq!(hf_name("h.3.attn.c_attn.bias"), ("transformer.h.3.attn.c_attn.bias".into(), false));
        assert!(hf_name("h.0.mlp.c_proj.weight").1);
        assert!(!hf_name("ln_f.weight").1);
        assert_eq!(
            from_hf("transformer.h.0.ln_1.weight", &ModelConfig::default()).as_deref(),
            Some("h.0.ln_1.weight")
        );
        assert_eq!(from_hf("lm_head.weight", &ModelConfig::default()), None);
        // The Hub's layout: no prefix, and each block's causal mask buffers beside its weights.
        assert_eq!(
            from_hf("h.0.attn.c_attn.bias", &ModelConfig::default()).as_deref(),
            Some("h.0.attn.c_attn.bias")
        );
        for mask in ["h.0.attn.bias", "transformer.h.11.attn.bias", "h.3.attn.masked_bias"] {
            assert_eq!(from_hf(mask, &ModelConfig::default()), None, "{mask}");
        }
    }

    #[test]
    fn what_trainguard_does_not_compute_is_refused_by_key() {
        let p = Path::new("config.json");
        let cfg = ModelConfig::default();
        assert_eq!(model_config(&config_json(&cfg), p).unwrap().n_layer, cfg.n_layer);
        let with = |k: &str, val: Value| {
            let mut v = config_json(&cfg);
            v[k] = val;
            model_config(&v, p).map(|_| ()).unwrap_err().to_string()
        };
        assert!(with("tie_word_embeddings", json!(false)).contains("`tie_word_embeddings` is false"));
        assert!(with("layer_norm_epsilon", json!(0.01)).contains("`layer_norm_epsilon` is 0.01"));
        assert!(with("scale_attn_weights", json!(false)).contains("`scale_attn_weights`"));
        assert!(with("scale_attn_by_inverse_layer_idx", json!(true))
            .contains("`scale_attn_by_inverse_layer_idx`"));
        for (k, v) in [
            ("tie_word_embeddings", json!("no")),
            ("tie_word_embeddings", json!(0)),
            ("scale_attn_weights", json!(1)),
        ] {
            assert!(with(k, v.clone()).contains(&format!("`{k}` is {v}, not true or false")), "{k}: {v}");
        }
        assert!(with("layer_norm_epsilon", json!("1e-5"))
            .contains("`layer_norm_epsilon` is \"1e-5\", not a number"));
        let mut v = config_json(&cfg);
        v["activation_function"] = json!("gelu_new");
        assert!(
            model_config(&v, p).is_ok(),
            "GPT-2's own checkpoints use gelu_new: a warning, not a refusal"
        );
        v.as_object_mut().unwrap().remove("activation_function");
        assert!(model_config(&v, p).is_ok(), "absent: transformers' default, gelu_new");
        for other in [json!("relu"), json!("quick_gelu"), json!("totally_bogus"), json!(3)] {
            assert!(
                with("activation_function", other.clone()).contains("`activation_function` is"),
                "{other}"
            );
        }
        // A size that is no whole number is named as given; one left out is said to be missing.
        for (given, said) in [
            (json!(-1), "`n_layer` is -1: a size or count, so not below 0"),
            (json!(2.5), "`n_layer` is 2.5, not a whole number"),
            (json!("12"), "`n_layer` is \"12\", not a whole number"),
        ] {
            assert!(with("n_layer", given).ends_with(said), "{said}");
        }
        let mut v = config_json(&cfg);
        v.as_object_mut().unwrap().remove("n_embd");
        assert!(model_config(&v, p)
            .unwrap_err()
            .to_string()
            .ends_with("`n_embd` is missing (a whole number)"));
    }
}
