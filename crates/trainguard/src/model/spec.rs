//! What a model is made of, as data: each parameter's name, shape, initialisation, whether
//! weight decay applies, and the part of the network it belongs to. The model creates its
//! tensors from this list (`Model::new`) and the planner counts weights, gradients and optimizer
//! state from the same list: one description per architecture, not two kept in sync by hand.
use super::params::Init;

#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// The checkpoint's name (Hugging Face's layout for each family).
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
    /// Weight decay applies (linear weights only: not biases, norms, embeddings).
    pub decay: bool,
    pub part: Part,
    /// A vocabulary matrix padded beyond the user's vocabulary (`model.pad_vocab_to`): its first
    /// dimension is the padded vocabulary, of which only these first rows are real tokens; the
    /// rest start at zero, receive no gradient, and are cut off on export.
    pub user_rows: Option<i64>,
}

/// Where a parameter sits, for the memory savers that run the network in pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Before the first block (token and position embeddings).
    Embedding,
    Block(usize),
    /// After the last block (final norm, LM head).
    Head,
    /// The token embedding when the head is tied to it: in both the embedding and the head.
    TiedEmbedding,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: &[i64], init: Init, decay: bool, part: Part) -> Self {
        Self { name: name.into(), shape: shape.to_vec(), init, decay, part, user_rows: None }
    }

    /// A `[padded vocabulary, …]` matrix whose first `rows` rows are the user's vocabulary.
    pub fn vocab_rows(self, rows: i64) -> Self {
        Self { user_rows: (rows < self.shape[0]).then_some(rows), ..self }
    }

    /// The shape the user sees (export, import): the padded vocabulary cut back to its rows.
    pub fn user_shape(&self) -> Vec<i64> {
        let mut s = self.shape.clone();
        if let Some(r) = self.user_rows {
            s[0] = r;
        }
        s
    }

    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// Indices into the parameter list of the embedding's, each block's and the head's parameters
/// (a tied embedding is in both the embedding's and the head's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamGroups {
    pub embed: Vec<usize>,
    pub blocks: Vec<Vec<usize>>,
    pub head: Vec<usize>,
}

impl ParamGroups {
    pub fn of(specs: &[TensorSpec], n_blocks: usize) -> Self {
        let mut g = ParamGroups { embed: vec![], blocks: vec![vec![]; n_blocks], head: vec![] };
        for (i, s) in specs.iter().enumerate() {
            match s.part {
                Part::Embedding => g.embed.push(i),
                Part::Block(b) => g.blocks[b].push(i),
                Part::Head => g.head.push(i),
                Part::TiedEmbedding => {
                    g.embed.push(i);
                    g.head.push(i);
                }
            }
        }
        g
    }
}
