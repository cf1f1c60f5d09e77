//! GPT-2's names in `transformers` (`GPT2LMHeadModel`): trainguard's parameter `NAME` is
//! `transformer.NAME` there, and the four projection weights are `Conv1D`s stored `[in, out]`,
//! the transpose of a `Linear`'s `[out, in]`. The head is tied to `transformer.wte.weight`, so
//! `lm_head.weight` is not written (transformers ties it on load). A Llama table would sit
//! beside this one with its own names.

/// Prefix of every parameter's name in `transformers`.
pub const PREFIX: &str = "transformer.";
/// Suffixes of the `Conv1D` weights (transposed relative to trainguard's linear weights).
pub const CONV1D: [&str; 4] = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];
/// Names `transformers` may write that trainguard has no parameter for (tied or buffers).
pub const IGNORED: [&str; 1] = ["lm_head.weight"];

/// The `transformers` name of trainguard parameter `name`, and whether its layout is transposed.
pub fn hf_name(name: &str) -> (String, bool) {
    (format!("{PREFIX}{name}"), CONV1D.iter().any(|s| name.ends_with(s)))
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
    }
}
