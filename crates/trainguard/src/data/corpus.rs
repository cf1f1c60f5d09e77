//! A corpus of tokens in memory or memory-mapped from disk (one file or many shards read as
//! one sequence), split into a training head and a validation tail or validation shards.
use super::mixture::{Mixture, Weights};
use super::shards::{self, Dtype};
use super::synthetic;
use crate::config::DataConfig;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read data file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("data file {path}: {message}")]
    Format { path: PathBuf, message: String },
    /// Token ids that could fall outside the model's embedding: the config is wrong (exit 2).
    #[error("data {path}: {message}")]
    Vocab { path: PathBuf, message: String },
    /// The built-in corpus does not fit in memory (`data.synthetic_tokens` too large: exit 2).
    #[error("data.synthetic_tokens: {tokens} tokens ({} MiB) cannot be allocated: {why}", (.tokens * 2) >> 20)]
    TooLarge { tokens: usize, why: String },
}

impl DataError {
    /// Whether the user's config (not the data's bytes) is what must change.
    pub fn is_usage(&self) -> bool {
        matches!(self, DataError::Vocab { .. } | DataError::TooLarge { .. })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// One memory-mapped file's tokens, at position `start` of the concatenated sequence.
struct Piece {
    /// The file it maps, for messages.
    path: PathBuf,
    map: Mmap,
    offset: usize,
    dtype: Dtype,
    start: usize,
    len: usize,
}

impl Piece {
    fn get(&self, i: usize) -> u32 {
        let at = self.offset + i * self.dtype.width();
        let b = &self.map[at..at + self.dtype.width()];
        match self.dtype {
            Dtype::Uint16 => u16::from_le_bytes([b[0], b[1]]) as u32,
            Dtype::Uint32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

enum Tokens {
    Owned(Vec<u16>),
    /// Files read in place, in order, as one sequence (a window may cross a file boundary:
    /// shards are consecutive pieces of one token stream).
    Mapped(Vec<Piece>),
}

impl Tokens {
    /// Bytes per token as stored (the widest file's, for several).
    fn width(&self) -> usize {
        match self {
            Tokens::Owned(_) => 2,
            Tokens::Mapped(p) => p.iter().map(|p| p.dtype.width()).max().unwrap_or(2),
        }
    }

    fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::Mapped(p) => p.last().map_or(0, |p| p.start + p.len),
        }
    }

    fn copy_to(&self, start: usize, out: &mut [u32]) {
        match self {
            Tokens::Owned(v) => {
                let n = out.len();
                for (o, &t) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = t as u32;
                }
            }
            Tokens::Mapped(pieces) => {
                let mut k = pieces.partition_point(|p| p.start + p.len <= start);
                for (pos, o) in (start..).zip(out.iter_mut()) {
                    while pos >= pieces[k].start + pieces[k].len {
                        k += 1;
                    }
                    *o = pieces[k].get(pos - pieces[k].start);
                }
            }
        }
    }
}

pub struct Corpus {
    tokens: Tokens,
    /// Index of the first validation token.
    val_start: usize,
    pub description: String,
    /// The `prepare` manifest behind a `tokens:<dir>` source.
    pub manifest: Option<shards::Manifest>,
    /// `model.vocab_size`: every id read must be below it.
    vocab: usize,
    /// Whether training windows are checked for ids outside the vocabulary as steps read them:
    /// a training split too large to scan at load.
    pub check_as_read: bool,
    /// [`Self::unigram_entropy`] of the validation split, from the scan at load that also
    /// checks its ids.
    pub val_entropy: f64,
    /// A mixture's sources (`data.sources`), each a corpus of its own; its splits are theirs
    /// one after another. None for one source.
    pub mixture: Option<Mixture>,
}

/// A training split of more bytes than this is checked as steps read it, not at load (a
/// corpus of tens of GB would take minutes to scan at every start). Validation is always
/// scanned at load: its entropy is computed then anyway.
const SCAN_LIMIT_BYTES: u64 = 1 << 30;

impl Corpus {
    /// Loads `data.source` for a model with `vocab` tokens and windows of `seq_len + 1`; a
    /// validation split too short for one window is refused only when the run `evaluates`.
    pub fn load(cfg: &DataConfig, vocab: usize, seq_len: usize, evaluates: bool) -> Result<Self, DataError> {
        if cfg.sources.is_empty() {
            return Self::load_source(&cfg.source, cfg, vocab, seq_len, evaluates);
        }
        let sources = cfg
            .sources
            .iter()
            .map(|s| Self::load_source(&s.source, cfg, vocab, seq_len, evaluates))
            .collect::<Result<Vec<_>, _>>()?;
        let weights: Vec<f64> = cfg.sources.iter().map(|s| s.weight).collect();
        let mixture = Mixture {
            names: cfg.sources.iter().map(|s| s.label()).collect(),
            weights: Weights::new(&weights),
            sources,
        };
        let mut corpus = Self::split(Tokens::Owned(Vec::new()), 0.0, mixture.describe());
        corpus.vocab = vocab;
        corpus.check_as_read = mixture.sources.iter().any(|c| c.check_as_read);
        corpus.mixture = Some(mixture);
        // The sources' validation tokens pooled (each source's was checked as it loaded).
        if corpus.len(Split::Val) > 0 {
            corpus.val_entropy = corpus.unigram_entropy(Split::Val);
        }
        Ok(corpus)
    }

    /// One source (`data.source`, or an entry of `data.sources`), split and checked.
    fn load_source(
        source: &str,
        cfg: &DataConfig,
        vocab: usize,
        seq_len: usize,
        evaluates: bool,
    ) -> Result<Self, DataError> {
        let mut corpus = match source.split_once(':') {
            None => Self::synthetic(vocab, cfg.synthetic_tokens, cfg.val_fraction)?,
            Some(("text", path)) => Self::text(Path::new(path), cfg.val_fraction)?,
            Some((_, path)) => Self::token_source(path, vocab, cfg.val_fraction)?,
        };
        corpus.vocab = vocab;
        let need = seq_len + 2;
        // `data.val_fraction: 0` without validation shards: no validation split, by choice.
        let val_wanted = cfg.val_fraction > 0.0 || corpus.len(Split::Val) > 0;
        // Without evaluation nothing reads it (a prepare's `--val-tokens 10` does not stop training).
        if corpus.val_start < need || (evaluates && val_wanted && corpus.len(Split::Val) < need) {
            let (n, train) = (corpus.tokens.len(), corpus.val_start);
            let message = match val_wanted {
                true => format!("too short: {n} tokens give a training split of {train} and a validation split of {}; each needs at least model.seq_len + 2 = {need}", n - train),
                false => format!("too short: {n} tokens give a training split of {train}; it needs at least model.seq_len + 2 = {need}"),
            };
            return Err(DataError::Format { path: PathBuf::from(&corpus.description), message });
        }
        corpus.check_as_read = corpus.val_start as u64 * corpus.tokens.width() as u64 > SCAN_LIMIT_BYTES;
        if !corpus.check_as_read {
            corpus.check_vocab(0, corpus.val_start)?;
        }
        // One read of the validation split: its ids' counts give the entropy, and a count at or
        // beyond the vocabulary sends it to the check that names the file and index.
        let (counts, large) = corpus.id_counts(Split::Val);
        if !large.is_empty() || counts.iter().skip(vocab).any(|&c| c > 0) {
            corpus.check_vocab(corpus.val_start, corpus.len(Split::Val))?;
        }
        corpus.val_entropy = if val_wanted && corpus.len(Split::Val) > 0 {
            entropy(counts.iter().chain(large.values()), corpus.len(Split::Val))
        } else {
            f64::NAN
        };
        Ok(corpus)
    }

    /// The built-in corpus, or why its memory cannot be had.
    pub fn synthetic(vocab: usize, len: usize, val_fraction: f64) -> Result<Self, DataError> {
        // Stored as uint16: a larger vocabulary draws from its first 65,536 ids.
        let vocab = vocab.min(1 << 16);
        let tokens = synthetic::generate(vocab, len)
            .map_err(|e| DataError::TooLarge { tokens: len, why: e.to_string() })?;
        Ok(Self {
            vocab,
            ..Self::split(Tokens::Owned(tokens), val_fraction, format!("synthetic ({len} tokens)"))
        })
    }

    fn text(path: &Path, val_fraction: f64) -> Result<Self, DataError> {
        let bytes = crate::fs::whole_file::read_regular(path)
            .map_err(|source| DataError::Io { path: path.into(), source })?;
        let tokens = bytes.into_iter().map(u16::from).collect();
        Ok(Self::split(Tokens::Owned(tokens), val_fraction, format!("text:{}", path.display())))
    }

    /// `tokens:<path>`: a `prepare` directory, a directory or glob of shards, or one file.
    fn token_source(path: &str, vocab: usize, val_fraction: f64) -> Result<Self, DataError> {
        let sources =
            shards::resolve(path).map_err(|message| DataError::Format { path: path.into(), message })?;
        if let Some(m) = &sources.manifest {
            if m.vocab_size > vocab {
                return Err(DataError::Vocab {
                    path: path.into(),
                    message: format!(
                        "its tokenizer has {} tokens (ids up to {}) but model.vocab_size = {vocab}: set model.vocab_size to at least {}",
                        m.vocab_size,
                        m.vocab_size - 1,
                        m.vocab_size
                    ),
                });
            }
        }
        let mut pieces = Vec::new();
        let mut start = 0;
        for file in sources.train.iter().chain(&sources.val) {
            let piece = map_piece(file, start)?;
            start += piece.len;
            pieces.push(piece);
        }
        // Shards come from one writer: one file without the others' llm.c header is a damaged or
        // stray one, whose bytes would train as tokens.
        if let (Some(flat), Some(headed)) =
            (pieces.iter().find(|p| p.offset == 0), pieces.iter().find(|p| p.offset != 0))
        {
            let message = format!("has no llm.c header, where {} and the source's other shards have one: a damaged shard, or a file of another dataset", headed.path.display());
            return Err(DataError::Format { path: flat.path.clone(), message });
        }
        let train_len: usize = pieces.iter().take(sources.train.len()).map(|p| p.len).sum();
        let width = match pieces.iter().map(|p| p.dtype).max_by_key(|d| d.width()) {
            Some(Dtype::Uint32) => "uint32",
            _ => "uint16",
        };
        let description = match (sources.train.len(), sources.val.len()) {
            (1, 0) => format!("tokens:{path} ({width})"),
            (n, 0) => format!("tokens:{path} ({n} files, {width})"),
            (n, v) => format!("tokens:{path} ({n} training + {v} validation files, {width})"),
        };
        let tokens = Tokens::Mapped(pieces);
        let mut corpus = if sources.val.is_empty() {
            Self::split(tokens, val_fraction, description)
        } else {
            Self {
                tokens,
                val_start: train_len,
                description,
                manifest: None,
                vocab: usize::MAX,
                check_as_read: false,
                val_entropy: f64::NAN,
                mixture: None,
            }
        };
        corpus.manifest = sources.manifest;
        Ok(corpus)
    }

    fn split(tokens: Tokens, val_fraction: f64, description: String) -> Self {
        let val_start = crate::config::val_start(tokens.len(), val_fraction);
        Self {
            tokens,
            val_start,
            description,
            manifest: None,
            vocab: usize::MAX,
            check_as_read: false,
            val_entropy: f64::NAN,
            mixture: None,
        }
    }

    pub fn len(&self, split: Split) -> usize {
        if let Some(m) = &self.mixture {
            return m.sources.iter().map(|c| c.len(split)).sum();
        }
        match split {
            Split::Train => self.val_start,
            Split::Val => self.tokens.len() - self.val_start,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len(Split::Train) + self.len(Split::Val) == 0
    }

    /// Number of distinct start offsets for windows of `seq_len + 1` tokens in `split`.
    pub fn windows(&self, split: Split, seq_len: usize) -> usize {
        self.len(split) - seq_len
    }

    /// Copies `out.len()` tokens starting at `offset` within `split`.
    pub fn read(&self, split: Split, offset: usize, out: &mut [u32]) {
        if let Some(m) = &self.mixture {
            return m.read(split, offset, out);
        }
        let base = if split == Split::Train { 0 } else { self.val_start };
        self.tokens.copy_to(base + offset, out);
    }

    /// A digest (FNV-1a) of `split`'s tokens in 64 runs of 64 spread evenly over it, its first
    /// and last included: what ranks compare to see they loaded the same data (a node with
    /// another or a stale copy of equal size) without reading all of it.
    pub fn sample_digest(&self, split: Split) -> String {
        let n = self.len(split);
        let mut run = [0u32; 64];
        let len = run.len().min(n);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for k in 0..64 {
            self.read(split, (n - len) * k / 63, &mut run[..len]);
            for b in run[..len].iter().flat_map(|t| t.to_le_bytes()) {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("{h:016x}")
    }

    /// Entropy (nats) of the token distribution of `split`: the loss of a model that ignores
    /// context. A model that learns goes clearly below it.
    pub fn unigram_entropy(&self, split: Split) -> f64 {
        let (counts, large) = self.id_counts(split);
        entropy(counts.iter().chain(large.values()), self.len(split))
    }

    /// How often each id occurs in `split`: densely below the vocabulary's size, the rest in
    /// the map.
    fn id_counts(&self, split: Split) -> (Vec<u64>, std::collections::HashMap<u32, u64>) {
        let n = self.len(split);
        // Dense up to the vocabulary (ids are checked below it; Llama 3's 128,256 included), at
        // most 2^21 counters (16 MiB); any beyond, sparsely: a corpus's largest id never sizes
        // an allocation.
        let mut counts = vec![0u64; self.vocab.clamp(1 << 16, 1 << 21)];
        let mut large: std::collections::HashMap<u32, u64> = Default::default();
        let mut buf = vec![0u32; 1 << 16];
        let mut pos = 0;
        while pos < n {
            let chunk = (n - pos).min(buf.len());
            self.read(split, pos, &mut buf[..chunk]);
            for &t in &buf[..chunk] {
                match counts.get_mut(t as usize) {
                    Some(c) => *c += 1,
                    None => *large.entry(t).or_default() += 1,
                }
            }
            pos += chunk;
        }
        (counts, large)
    }

    /// Refuses an id outside the vocabulary in the `len` tokens from position `start` of the
    /// whole sequence (training then validation), naming the file and the id's index in it.
    fn check_vocab(&self, start: usize, len: usize) -> Result<(), DataError> {
        let outside = |tok: u32| tok as usize >= self.vocab;
        let error = |path: PathBuf, tok: u32, i: usize| DataError::Vocab {
            path,
            message: format!("token {tok} at index {i} is outside model.vocab_size = {}", self.vocab),
        };
        match &self.tokens {
            Tokens::Owned(v) => match (start..start + len).find(|&i| outside(v[i] as u32)) {
                Some(i) => Err(error(PathBuf::from(&self.description), v[i] as u32, i)),
                None => Ok(()),
            },
            Tokens::Mapped(pieces) => {
                let end = start + len;
                for p in pieces.iter().filter(|p| p.start < end && start < p.start + p.len) {
                    let local = start.saturating_sub(p.start)..(end - p.start).min(p.len);
                    if let Some(i) = local.into_iter().find(|&i| outside(p.get(i))) {
                        return Err(error(p.path.clone(), p.get(i), i));
                    }
                }
                Ok(())
            }
        }
    }

    /// [`check_vocab`](Self::check_vocab) of the training window of `seq_len + 1` tokens at
    /// `offset` (for a training split too large to scan at load: [`Self::check_as_read`]).
    pub fn check_train_window(&self, offset: usize, seq_len: usize) -> Result<(), DataError> {
        if let Some(m) = &self.mixture {
            let (k, local) = m.locate(Split::Train, offset);
            return m.sources[k].check_train_window(local, seq_len);
        }
        self.check_vocab(offset, seq_len + 1)
    }
}

/// Entropy (nats) of the distribution with these counts over `n` draws.
fn entropy<'a>(counts: impl Iterator<Item = &'a u64>, n: usize) -> f64 {
    counts.filter(|&&c| c > 0).map(|&c| c as f64 / n as f64).map(|p| -p * p.ln()).sum()
}

fn map_piece(file: &Path, start: usize) -> Result<Piece, DataError> {
    let io = |source| DataError::Io { path: file.into(), source };
    let (f, size) = crate::fs::whole_file::open_regular(file).map_err(io)?;
    let map = crate::ffi::os::map_readonly(&f).map_err(io)?;
    let l = shards::layout(&map[..map.len().min(shards::HEADER_BYTES)], size)
        .map_err(|message| DataError::Format { path: file.into(), message })?;
    Ok(Piece { path: file.into(), map, offset: l.offset, dtype: l.dtype, start, len: l.tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_are_read_little_endian_and_split() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("train.bin");
        let toks: Vec<u16> = (0..1000u16).map(|i| i % 300).collect();
        std::fs::write(&p, toks.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let cfg =
            DataConfig { source: format!("tokens:{}", p.display()), val_fraction: 0.1, ..Default::default() };
        let c = Corpus::load(&cfg, 512, 16, true).unwrap();
        assert_eq!((c.len(Split::Train), c.len(Split::Val)), (900, 100));
        let mut w = [0u32; 3];
        c.read(Split::Val, 0, &mut w);
        assert_eq!(w, [0, 1, 2]); // token 900 is 900 % 300 = 0
        let err = Corpus::load(&cfg, 256, 16, true).err().unwrap().to_string();
        assert!(
            err.contains("outside model.vocab_size = 256") && err.contains(&p.display().to_string()),
            "names the file: {err}"
        );
        std::fs::write(&p, [1u8, 2, 3]).unwrap();
        assert!(Corpus::load(&cfg, 512, 16, true).is_err());
    }

    #[test]
    fn shards_are_one_sequence_with_val_shards_last() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, dtype: Dtype, toks: &[u32]| {
            let mut bytes = shards::header(dtype, toks.len());
            for &t in toks {
                match dtype {
                    Dtype::Uint16 => bytes.extend((t as u16).to_le_bytes()),
                    Dtype::Uint32 => bytes.extend(t.to_le_bytes()),
                }
            }
            std::fs::write(dir.path().join(name), bytes).unwrap();
        };
        write("d_train_000000.bin", Dtype::Uint32, &(0..40).map(|i| 70_000 + i).collect::<Vec<_>>());
        write("d_train_000001.bin", Dtype::Uint32, &(40..100).map(|i| 70_000 + i).collect::<Vec<_>>());
        write("d_val_000000.bin", Dtype::Uint32, &(0..30).collect::<Vec<_>>());
        let cfg = DataConfig { source: format!("tokens:{}", dir.path().display()), ..Default::default() };
        let c = Corpus::load(&cfg, 70_100, 8, true).unwrap();
        assert_eq!((c.len(Split::Train), c.len(Split::Val)), (100, 30));
        let mut w = [0u32; 4];
        c.read(Split::Train, 38, &mut w); // crosses the shard boundary
        assert_eq!(w, [70_038, 70_039, 70_040, 70_041]);
        c.read(Split::Val, 26, &mut w);
        assert_eq!(w, [26, 27, 28, 29]);
        let err = Corpus::load(&cfg, 70_050, 8, true).err().unwrap();
        assert!(err.is_usage() && err.to_string().contains("outside model.vocab_size = 70050"), "{err}");
        // A file among headed shards without their header is refused, not read as tokens.
        std::fs::write(dir.path().join("d_train_000002.bin"), [1u8, 0, 2, 0]).unwrap();
        let err = Corpus::load(&cfg, 70_100, 8, true).err().unwrap().to_string();
        assert!(
            err.contains("d_train_000002.bin")
                && err.contains("has no llm.c header, where")
                && err.contains("d_train_000000.bin"),
            "{err}"
        );
    }

    #[test]
    fn the_validation_split_read_once_at_load_refuses_outside_ids_and_gives_the_entropy() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, toks: &[u32]| {
            let mut bytes = shards::header(Dtype::Uint32, toks.len());
            bytes.extend(toks.iter().flat_map(|t| t.to_le_bytes()));
            std::fs::write(dir.path().join(name), bytes).unwrap();
        };
        let cfg = DataConfig { source: format!("tokens:{}", dir.path().display()), ..Default::default() };
        write("d_train_000000.bin", &(0..100).map(|i| i % 7).collect::<Vec<_>>());
        // Below the dense counters' 2^16 and beyond them: both found, the index named.
        for bad in [300, 70_000] {
            let mut val: Vec<u32> = (0..30).map(|i| i % 5).collect();
            val[17] = bad;
            write("d_val_000000.bin", &val);
            let err = Corpus::load(&cfg, 256, 8, true).err().unwrap().to_string();
            let file = dir.path().join("d_val_000000.bin");
            assert!(
                err.contains(&format!("{}: token {bad} at index 17 is outside", file.display())),
                "{err}"
            );
        }
        write("d_val_000000.bin", &(0..30).map(|i| i % 5).collect::<Vec<_>>());
        let c = Corpus::load(&cfg, 256, 8, true).unwrap();
        assert!((c.val_entropy - 5f64.ln()).abs() < 1e-12, "{}", c.val_entropy);
        assert_eq!(c.val_entropy, c.unigram_entropy(Split::Val));
        // A validation shard too short for a window stops only a run that evaluates; its ids
        // are still checked.
        write("d_val_000000.bin", &[1, 2, 3]);
        assert!(Corpus::load(&cfg, 256, 8, true)
            .err()
            .unwrap()
            .to_string()
            .contains("a validation split of 3"));
        assert_eq!(Corpus::load(&cfg, 256, 8, false).unwrap().len(Split::Val), 3);
        write("d_val_000000.bin", &[1, 300, 3]);
        assert!(Corpus::load(&cfg, 256, 8, false)
            .err()
            .unwrap()
            .to_string()
            .contains("token 300 at index 1"));
    }

    #[test]
    fn text_is_bytes_and_short_corpora_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "hello world ".repeat(100)).unwrap();
        let cfg =
            DataConfig { source: format!("text:{}", p.display()), val_fraction: 0.1, ..Default::default() };
        let c = Corpus::load(&cfg, 256, 8, true).unwrap();
        let mut w = [0u32; 5];
        c.read(Split::Train, 0, &mut w);
        assert_eq!(w, [104, 101, 108, 108, 111]);
        let err = Corpus::load(&cfg, 256, 200, true).err().unwrap().to_string();
        assert!(err.contains("too short") && err.contains("validation split"), "{err}");
        // No validation asked for: the message speaks of training alone.
        let err = Corpus::load(&DataConfig { val_fraction: 0.0, ..cfg }, 256, 2000, true)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("a training split of 1200; it needs at least model.seq_len + 2 = 2002"),
            "{err}"
        );
    }

    #[test]
    fn the_validated_minimum_of_synthetic_tokens_is_what_loading_needs() {
        for (f, seq) in [(0.1, 64), (0.5, 8), (0.9, 30), (0.013, 100), (0.37, 1)] {
            let cfg = DataConfig { val_fraction: f, ..Default::default() };
            let n = cfg.min_tokens(seq);
            let with = |n| Corpus::load(&DataConfig { synthetic_tokens: n, ..cfg.clone() }, 256, seq, true);
            assert!(with(n).is_ok(), "{f} {seq}: {n}");
            assert!(with(n - 1).is_err(), "{f} {seq}: {n} is not the least");
        }
        // No validation split: the training split's windows alone.
        let cfg = DataConfig { val_fraction: 0.0, ..Default::default() };
        let n = cfg.min_tokens(64);
        let with = |n| Corpus::load(&DataConfig { synthetic_tokens: n, ..cfg.clone() }, 256, 64, true);
        let all = with(n).unwrap();
        assert_eq!((all.len(Split::Train), all.len(Split::Val)), (n, 0));
        assert!(all.val_entropy.is_nan(), "no split to measure");
        assert!(with(n - 1).is_err());
        // A share too small for any corpus in memory: at once, not a loop that wraps around.
        for f in [1e-300, 3e-18] {
            assert_eq!(DataConfig { val_fraction: f, ..Default::default() }.min_tokens(64), usize::MAX);
        }
    }

    #[test]
    fn ids_beyond_uint16_count_in_the_entropy_without_sizing_an_allocation() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = shards::header(Dtype::Uint32, 40);
        for i in 0..40u32 {
            bytes.extend(if i % 2 == 0 { 7u32 } else { 4_000_000_000 }.to_le_bytes());
        }
        std::fs::write(dir.path().join("t_val.bin"), &bytes).unwrap();
        std::fs::write(dir.path().join("t_train.bin"), &bytes).unwrap();
        let cfg = DataConfig { source: format!("tokens:{}", dir.path().display()), ..Default::default() };
        let c = Corpus::load(&cfg, 4_000_000_001, 8, true).unwrap();
        assert!((c.unigram_entropy(Split::Val) - 2f64.ln()).abs() < 1e-12);
        assert!(c.description.contains("1 training + 1 validation files, uint32"), "{}", c.description);
    }

    #[test]
    fn synthetic_unigram_entropy_is_far_above_its_floor() {
        let c = Corpus::synthetic(256, 200_000, 0.1).unwrap();
        let h = c.unigram_entropy(Split::Val);
        assert!(h > 4.0 && h <= (256f64).ln() + 1e-9, "{h}");
        assert!(h > super::synthetic::conditional_entropy() * 3.0);
    }
}
