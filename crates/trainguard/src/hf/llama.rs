//! The Llama family in `transformers` (`LlamaForCausalLM`): trainguard's Llama parameters
//! already carry its names and `Linear` layouts (`model.layers.N.self_attn.q_proj.weight`, …),
//! so the name table is the identity. A tied head is not written (`lm_head.weight`;
//! transformers ties it on load) and `rotary_emb` buffers some versions save are skipped on
//! import (trainguard recomputes RoPE). Also Llama's `config.json` both ways: import refuses
//! what trainguard's Llama does not compute (RoPE scaling, another activation, a head size
//! other than hidden_size / heads, biases in attention but not the MLP or the reverse).
use super::{bad, switch, whole, Family, HfError};
use crate::config::{Arch, ModelConfig};
use serde_json::{json, Value};
use std::path::Path;

pub const FAMILY: Family = Family {
    arch: Arch::Llama,
    model_type: "llama",
    hf_name,
    from_hf,
    config_json,
    model_config,
    zero_tensors,
    config_keys: &CONFIG_KEYS,
};

const CONFIG_KEYS: [(&str, &str); 10] = [
    ("n_layer", "num_hidden_layers"),
    ("n_head", "num_attention_heads"),
    ("n_kv_head", "num_key_value_heads"),
    ("n_embd", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("seq_len", "max_position_embeddings"),
    ("ffn_hidden", "intermediate_size"),
    ("rope_theta", "rope_theta"),
    ("norm_eps", "rms_norm_eps"),
    ("dropout", "attention_dropout"),
];

fn hf_name(name: &str) -> (String, bool) {
    (name.to_string(), false)
}

fn from_hf(hf: &str, cfg: &ModelConfig) -> Option<String> {
    let tied_head = cfg.tie_embeddings && hf == "lm_head.weight";
    (!tied_head && !hf.contains("rotary_emb")).then(|| hf.to_string())
}

/// Llama's biases follow `attention_bias` / `mlp_bias`, so a bias-free model writes none.
fn zero_tensors(_: &ModelConfig) -> Vec<(String, i64)> {
    vec![]
}

fn config_json(cfg: &ModelConfig) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn(),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        // Both spellings: `rope_theta` / `rope_scaling` (transformers 4) and `rope_parameters` (5).
        "rope_theta": cfg.rope_theta,
        "rope_scaling": null,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "hidden_act": "silu",
        "attention_dropout": cfg.dropout,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    })
}

fn model_config(c: &Value, cpath: &Path) -> Result<ModelConfig, HfError> {
    let num = |k: &str| whole(c, k, cpath);
    // A key that may be left out (transformers' default then), but not given as another type.
    let optional = |v: &Value, k: &str| -> Result<Option<f64>, HfError> {
        match v {
            Value::Null => Ok(None),
            v => v.as_f64().map(Some).ok_or_else(|| bad(cpath, format!("`{k}` is {v}, not a number"))),
        }
    };
    if !c["rope_scaling"].is_null() {
        return Err(bad(
            cpath,
            format!(
                "`rope_scaling` is {}; trainguard applies plain RoPE, so it must be null",
                c["rope_scaling"]
            ),
        ));
    }
    let rope = &c["rope_parameters"];
    if !(rope["rope_type"].is_null() || rope["rope_type"] == "default") {
        return Err(bad(
            cpath,
            format!(
                "`rope_parameters.rope_type` is {}; trainguard applies plain RoPE (\"default\")",
                rope["rope_type"]
            ),
        ));
    }
    if !c["hidden_act"].is_null() && c["hidden_act"] != "silu" {
        return Err(bad(
            cpath,
            format!("`hidden_act` is {}; trainguard's SwiGLU uses silu", c["hidden_act"]),
        ));
    }
    let (attn_bias, mlp_bias) = (
        switch(c, "attention_bias", cpath)?.unwrap_or(false),
        switch(c, "mlp_bias", cpath)?.unwrap_or(false),
    );
    if attn_bias != mlp_bias {
        return Err(bad(cpath, format!("`attention_bias` {attn_bias} and `mlp_bias` {mlp_bias} differ; trainguard's `model.bias` sets both")));
    }
    let (n_embd, n_head) = (num("hidden_size")?, num("num_attention_heads")?);
    if !c["head_dim"].is_null() && c["head_dim"].as_u64() != Some((n_embd / n_head.max(1)) as u64) {
        return Err(bad(
            cpath,
            format!(
                "`head_dim` {} is not hidden_size / num_attention_heads = {}; trainguard derives it",
                c["head_dim"],
                n_embd / n_head.max(1)
            ),
        ));
    }
    // transformers 4 reads `rope_theta`, 5 `rope_parameters`: two bases would be two models.
    let (top, nested) = (
        optional(&c["rope_theta"], "rope_theta")?,
        optional(&rope["rope_theta"], "rope_parameters.rope_theta")?,
    );
    if let Some((a, b)) = top.zip(nested).filter(|(a, b)| a != b) {
        return Err(bad(cpath, format!("`rope_theta` {a} and `rope_parameters.rope_theta` {b} differ (transformers 4 reads the first, 5 the second): keep the one the model was trained with")));
    }
    let theta = top.or(nested).unwrap_or(10_000.0);
    let kv_heads = optional(&c["num_key_value_heads"], "num_key_value_heads")?;
    if kv_heads.is_some_and(|k| k.fract() != 0.0 || k < 0.0) {
        return Err(bad(
            cpath,
            format!("`num_key_value_heads` is {}, not a count", c["num_key_value_heads"]),
        ));
    }
    #[allow(clippy::needless_update)] // the lead's model restructure may add fields
    let cfg = ModelConfig {
        arch: Arch::Llama,
        n_layer: num("num_hidden_layers")?,
        n_head,
        n_embd,
        vocab_size: num("vocab_size")?,
        seq_len: num("max_position_embeddings")?,
        dropout: optional(&c["attention_dropout"], "attention_dropout")?.unwrap_or(0.0),
        bias: attn_bias,
        n_kv_head: Some(kv_heads.map_or(n_head, |k| k as usize)),
        ffn_hidden: Some(num("intermediate_size")?),
        rope_theta: theta,
        // transformers' LlamaConfig defaults, for configs that leave them out.
        norm_eps: optional(&c["rms_norm_eps"], "rms_norm_eps")?.unwrap_or(1e-6),
        tie_embeddings: switch(c, "tie_word_embeddings", cpath)?.unwrap_or(false),
        ..ModelConfig::default() // fields a later model change adds keep their defaults
    };
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            n_layer: 3,
            n_head: 4,
            n_kv_head: Some(2),
            n_embd: 32,
            ffn_hidden: Some(48),
            vocab_size: 40,
            seq_len: 16,
            bias: false,
            rope_theta: 5e5,
            norm_eps: 1e-6,
            tie_embeddings: false,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn config_json_reads_back_as_the_same_model_config() {
        let p = Path::new("config.json");
        assert_eq!(model_config(&config_json(&cfg()), p).unwrap(), cfg());
        // transformers 5 writes rope_parameters only.
        let mut v = config_json(&cfg());
        v.as_object_mut().unwrap().remove("rope_theta");
        assert_eq!(model_config(&v, p).unwrap().rope_theta, 5e5);
    }

    #[test]
    fn what_trainguard_does_not_compute_is_refused_by_key() {
        let p = Path::new("config.json");
        let with = |k: &str, val: Value| {
            let mut v = config_json(&cfg());
            v[k] = val;
            model_config(&v, p).unwrap_err().to_string()
        };
        let e = with("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0}));
        assert!(e.contains("`rope_scaling` is {") && e.contains("plain RoPE"), "{e}");
        let e = with("rope_parameters", json!({"rope_type": "yarn", "rope_theta": 1e4}));
        assert!(e.contains("`rope_parameters.rope_type` is \"yarn\""), "{e}");
        assert!(with("hidden_act", json!("gelu")).contains("`hidden_act`"));
        assert!(with("mlp_bias", json!(true)).contains("`attention_bias` false and `mlp_bias` true differ"));
        assert!(with("head_dim", json!(16)).contains("`head_dim` 16"));
        // A switch of another type is refused, not read as false (transformers refuses it too).
        for (k, v) in [
            ("tie_word_embeddings", json!(1)),
            ("tie_word_embeddings", json!("no")),
            ("attention_bias", json!(0)),
            ("mlp_bias", json!("false")),
        ] {
            assert!(with(k, v.clone()).contains(&format!("`{k}` is {v}, not true or false")), "{k}: {v}");
        }
        // Two RoPE bases: refused, where the top-level one was taken and transformers 5 takes
        // the other; equal ones load.
        let mut v = config_json(&cfg());
        v["rope_theta"] = json!(10000.0);
        let e = model_config(&v, p).unwrap_err().to_string();
        assert!(e.contains("`rope_theta` 10000 and `rope_parameters.rope_theta` 500000 differ"), "{e}");
        assert_eq!(model_config(&config_json(&cfg()), p).unwrap().rope_theta, 5e5);
        assert!(with("vocab_size", json!(-1)).contains("`vocab_size` is -1: a size or count, so not below 0"));
    }

    #[test]
    fn names_are_the_identity_and_a_tied_head_and_rope_buffers_are_skipped() {
        assert_eq!(
            hf_name("model.layers.0.self_attn.q_proj.weight"),
            ("model.layers.0.self_attn.q_proj.weight".into(), false)
        );
        assert_eq!(from_hf("lm_head.weight", &cfg()).as_deref(), Some("lm_head.weight"));
        assert_eq!(from_hf("lm_head.weight", &ModelConfig { tie_embeddings: true, ..cfg() }), None);
        assert_eq!(from_hf("model.rotary_emb.inv_freq", &cfg()), None);
    }
}
