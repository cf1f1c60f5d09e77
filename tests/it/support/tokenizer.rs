//! A small byte-level BPE `tokenizer.json` written by hand (GPT-2's byte-to-unicode alphabet, a
//! few merges, `<|endoftext|>` as an added token), so tests need no download.
#![allow(dead_code)]
use serde_json::{json, Map, Value};
use std::path::Path;

/// GPT-2's printable stand-in for each byte.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// Writes the tokenizer; `pad_to`: extra never-produced vocabulary entries up to this size
/// (e.g. above 65,536 to get uint32 shards). Returns the vocabulary size (EOS is the last id).
pub fn write(path: &Path, pad_to: usize) -> usize {
    let mut vocab = Map::new();
    let add = |vocab: &mut Map<String, Value>, tok: String| {
        let id = vocab.len();
        vocab.insert(tok, json!(id));
    };
    for b in 0..=255u8 {
        add(&mut vocab, byte_char(b).to_string());
    }
    let g = byte_char(b' ');
    let merges: Vec<(String, String)> = vec![
        ("h".into(), "e".into()),
        (g.to_string(), "t".into()),
        (format!("{g}t"), "he".into()),
        ("i".into(), "n".into()),
        ("a".into(), "n".into()),
        ("e".into(), "r".into()),
        (g.to_string(), "a".into()),
        ("o".into(), "n".into()),
    ];
    for (a, b) in &merges {
        add(&mut vocab, format!("{a}{b}"));
    }
    while vocab.len() < pad_to.saturating_sub(1) {
        let n = vocab.len();
        add(&mut vocab, format!("<unused_{n}>"));
    }
    let eos = vocab.len();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": eos, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": true, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()}
    });
    std::fs::write(path, serde_json::to_string(&tok).unwrap()).unwrap();
    eos + 1
}
