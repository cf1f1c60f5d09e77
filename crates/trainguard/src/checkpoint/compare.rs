//! A checkpoint's config against the config resuming it. What defines the model must match: its
//! shapes and vocabulary (the tensors would not fit) and what its architecture computes with (the
//! same weights under another head count or RoPE base are another model); so must the optimizer
//! (its state is another's). The rest (max_steps, intervals, schedule length, dropout, …) may
//! change and is reported so the log shows it. Pure.
use crate::config::diff::differing_keys;
use crate::config::{Arch, Config};

/// `key: checkpoint value, config value` for every differing key: those that define the model
/// or name the optimizer (refused) and the rest, separately.
pub fn differences(saved: &Config, now: &Config) -> (Vec<String>, Vec<String>) {
    // Defaults resolved: `ffn_hidden` unset and 4 × n_embd written out are the same model, as
    // are `n_kv_head` unset and n_head.
    let json = |c: &Config| {
        let mut c = c.clone();
        (c.model.ffn_hidden, c.model.n_kv_head) = (Some(c.model.ffn()), Some(c.model.kv_heads()));
        serde_json::to_value(c).expect("a Config always serialises")
    };
    let (mut model, mut other) = (Vec::new(), Vec::new());
    for d in differing_keys(&json(saved), &json(now)) {
        let line = format!("{}: checkpoint {}, config {}", d.key, d.a, d.b);
        if refused(&d.key, saved.model.arch) {
            model.push(line)
        } else {
            other.push(line)
        }
    }
    (model, other)
}

/// A key whose change the checkpoint cannot be resumed under: the optimizer's name (its state
/// is another optimizer's), and a `model.` key whose change makes the weights another model or
/// unfit. Not dropout (training's), not a key `arch` does not read (GPT-2's RoPE base, norm
/// epsilon, tied head and key/value heads, which validation holds to GPT-2's), not a Llama's
/// sequence length (no weight depends on it: a longer context continues from the same weights).
fn refused(key: &str, arch: Arch) -> bool {
    if key == "optimizer.name" {
        return true;
    }
    let Some(name) = key.strip_prefix("model.") else { return false };
    !matches!(
        (name, arch),
        ("dropout", _)
            | ("rope_theta" | "norm_eps" | "tie_embeddings" | "n_kv_head", Arch::Gpt2)
            | ("seq_len", Arch::Llama)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_changes_are_separated_from_safe_ones() {
        let saved = Config::default();
        let mut now = Config::default();
        now.train.max_steps = 400;
        now.model.n_layer = 4;
        now.model.vocab_size = 512;
        let (model, other) = differences(&saved, &now);
        assert_eq!(
            model,
            ["model.n_layer: checkpoint 2, config 4", "model.vocab_size: checkpoint 256, config 512"]
        );
        assert_eq!(other, ["train.max_steps: checkpoint 200, config 400"]);
        assert_eq!(differences(&saved, &saved), (vec![], vec![]));
        now.optimizer.name = crate::config::OptimizerName::Sgd;
        now.optimizer.fused = false;
        let (refused, other) = differences(&saved, &now);
        assert!(
            refused.contains(&"optimizer.name: checkpoint \"adamw\", config \"sgd\"".to_string()),
            "{refused:?}"
        );
        assert!(other.contains(&"optimizer.fused: checkpoint true, config false".to_string()), "{other:?}");
    }

    #[test]
    fn dropout_keys_gpt2_does_not_read_and_a_llamas_context_may_change() {
        let saved = Config::default();
        let mut now = Config::default();
        now.model.dropout = 0.1;
        now.model.rope_theta = 500_000.0;
        now.model.norm_eps = 1e-6;
        now.model.n_kv_head = Some(1);
        let (model, other) = differences(&saved, &now);
        assert!(model.is_empty(), "{model:?}");
        assert_eq!(other.len(), 4, "{other:?}");
        // A Llama computes with RoPE's base and the norm's epsilon; its seq_len shapes no weight.
        let mut llama = Config::default();
        llama.model.arch = Arch::Llama;
        let mut now = llama.clone();
        now.model.rope_theta = 500_000.0;
        now.model.seq_len *= 2;
        let (model, other) = differences(&llama, &now);
        assert_eq!(model, ["model.rope_theta: checkpoint 10000.0, config 500000.0"]);
        assert_eq!(
            other,
            [format!("model.seq_len: checkpoint {}, config {}", llama.model.seq_len, now.model.seq_len)]
        );
        // A default written out is the same model: nothing to refuse, nothing to report.
        let mut spelled = llama.clone();
        spelled.model.n_kv_head = Some(llama.model.n_head);
        let mut gpt2 = Config::default();
        gpt2.model.ffn_hidden = Some(4 * gpt2.model.n_embd);
        assert_eq!(differences(&llama, &spelled), (vec![], vec![]));
        assert_eq!(differences(&gpt2, &Config::default()), (vec![], vec![]));
        gpt2.model.ffn_hidden = Some(100);
        assert_eq!(
            differences(&Config::default(), &gpt2).0,
            ["model.ffn_hidden: checkpoint 256, config 100"],
            "another width names the default's value"
        );
        // GPT-2's positions are a weight of seq_len rows.
        let mut now = Config::default();
        now.model.seq_len *= 2;
        assert_eq!(differences(&Config::default(), &now).0.len(), 1);
    }
}
