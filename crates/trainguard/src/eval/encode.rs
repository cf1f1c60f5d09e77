//! Examples turned into token ids with the run's tokenizer: the one of its `prepare` dataset
//! (found as `sample` finds it) or of an exported directory, or bytes for byte-level runs. A
//! context starts after the end-of-document token, as a prepared document does; each ending is
//! encoded on its own with a leading space (as llm.c and lm-eval do), so every ending of an
//! example follows the same context tokens.
use super::task::Example;
use super::EvalError;
use std::path::Path;

/// How text becomes ids.
pub enum Encoder {
    /// A tokenizer and its end-of-document id, put before every context.
    Tokenizer(Box<tokenizers::Tokenizer>, i64),
    /// Byte-level data: id = byte, no start token.
    Bytes,
}

/// An example in ids, with what its scores are normalised by.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub index: usize,
    pub context: Vec<i64>,
    pub endings: Vec<Vec<i64>>,
    /// Characters of each ending as scored (its leading space included).
    pub chars: Vec<usize>,
    pub label: usize,
}

/// The continuation an ending is scored as.
pub fn continuation(ending: &str) -> String {
    format!(" {ending}")
}

impl Encoder {
    /// The encoder of a model `sample::open` read, or why it has none.
    pub fn of(trained: &crate::sample::Trained) -> Result<Self, EvalError> {
        if let Some(d) = &trained.dataset {
            return Ok(Encoder::Tokenizer(Box::new(d.vocab.tokenizer.clone()), d.vocab.eos_id as i64));
        }
        if trained.bytes {
            return Ok(Encoder::Bytes);
        }
        Err(EvalError::Input(match &trained.dataset_unusable {
            Some(why) => format!("{why}: downstream evaluation needs the run's tokenizer"),
            None => "the run's data has no tokenizer (a bare token shard): downstream evaluation needs one (a `prepare` directory as data.source, or an export with tokenizer.json)".into(),
        }))
    }

    /// The encoder of a run's `data.source` (the training loop's).
    pub fn of_source(source: &str) -> Result<Self, EvalError> {
        if !source.starts_with("tokens:") {
            return Ok(Encoder::Bytes);
        }
        match crate::sample::dataset_dir(source) {
            Ok(Some(d)) => Ok(Encoder::Tokenizer(Box::new(d.vocab.tokenizer), d.vocab.eos_id as i64)),
            Ok(None) => Err(EvalError::Input(format!("eval.tasks: data.source `{source}` has no tokenizer (no dataset.json): downstream evaluation needs the `prepare` directory's"))),
            Err(why) => Err(EvalError::Input(format!("eval.tasks: {why}"))),
        }
    }

    fn ids(&self, text: &str) -> Result<Vec<i64>, String> {
        match self {
            Encoder::Bytes => Ok(text.bytes().map(i64::from).collect()),
            Encoder::Tokenizer(t, _) => Ok(t
                .encode(text, false)
                .map_err(|e| e.to_string())?
                .get_ids()
                .iter()
                .map(|&i| i64::from(i))
                .collect()),
        }
    }

    /// `e` in ids, checked against the model: every id inside `vocab`, every ending within the
    /// `seq_len` window with a token before it. An error names the file and line.
    pub fn encode(
        &self,
        e: &Example,
        index: usize,
        file: &Path,
        vocab: usize,
        seq_len: usize,
    ) -> Result<Encoded, EvalError> {
        let at = |why: String| EvalError::Input(format!("{}:{}: {why}", file.display(), e.line));
        let mut context = match self {
            Encoder::Tokenizer(_, eos) => vec![*eos],
            Encoder::Bytes => Vec::new(),
        };
        context.extend(self.ids(&e.context).map_err(at)?);
        if context.is_empty() {
            return Err(at(
                "the context is empty and byte-level data has no start token: nothing conditions the endings"
                    .into(),
            ));
        }
        let mut endings = Vec::with_capacity(e.endings.len());
        for (i, ending) in e.endings.iter().enumerate() {
            let ids = self.ids(&continuation(ending)).map_err(at)?;
            if ids.is_empty() {
                return Err(at(format!("`endings`[{i}] gives no tokens with this tokenizer")));
            }
            if ids.len() > seq_len {
                return Err(at(format!(
                    "`endings`[{i}] is {} tokens, more than the model's window of {seq_len} (model.seq_len)",
                    ids.len()
                )));
            }
            endings.push(ids);
        }
        if let Some(bad) =
            context.iter().chain(endings.iter().flatten()).find(|&&i| i < 0 || i as usize >= vocab)
        {
            return Err(at(format!(
                "token id {bad} is outside the model's vocabulary of {vocab} (model.vocab_size)"
            )));
        }
        let chars = e.endings.iter().map(|s| continuation(s).chars().count()).collect();
        Ok(Encoded { index, context, endings, chars, label: e.label })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(context: &str, endings: &[&str]) -> Example {
        Example {
            context: context.into(),
            endings: endings.iter().map(|s| s.to_string()).collect(),
            label: 1,
            line: 7,
        }
    }

    #[test]
    fn byte_level_endings_get_a_leading_space_and_are_checked_against_the_model() {
        let f = Path::new("t.jsonl");
        let e = Encoder::Bytes.encode(&example("Hi", &["a", "bé"]), 3, f, 256, 8).unwrap();
        assert_eq!(e.context, [72, 105]);
        assert_eq!(e.endings, [vec![32, 97], vec![32, 98, 195, 169]]);
        assert_eq!(e.chars, [2, 3], "characters, not bytes");
        assert_eq!((e.index, e.label), (3, 1));
        let err = Encoder::Bytes.encode(&example("Hi", &["a", "bé"]), 0, f, 128, 8).unwrap_err().to_string();
        assert_eq!(
            err,
            "t.jsonl:7: token id 195 is outside the model's vocabulary of 128 (model.vocab_size)"
        );
        let err =
            Encoder::Bytes.encode(&example("Hi", &["a", "abcd"]), 0, f, 256, 4).unwrap_err().to_string();
        assert!(
            err.starts_with("t.jsonl:7: `endings`[1] is 5 tokens, more than the model's window of 4"),
            "{err}"
        );
        let err = Encoder::Bytes.encode(&example("", &["a", "b"]), 0, f, 256, 4).unwrap_err().to_string();
        assert!(err.contains("the context is empty"), "{err}");
    }
}
