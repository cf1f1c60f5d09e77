//! A corpus of uint16 tokens in memory or memory-mapped from disk, split into a training head
//! and a validation tail.
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

enum Tokens {
    Owned(Vec<u16>),
    /// A flat little-endian uint16 file (nanoGPT's `train.bin`), read in place.
    Mapped(Mmap),
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::Mapped(m) => m.len() / 2,
        }
    }

    fn copy_to(&self, start: usize, out: &mut [u16]) {
        match self {
            Tokens::Owned(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Tokens::Mapped(m) => {
                let bytes = &m[2 * start..2 * (start + out.len())];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]);
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
}

/// Files above this size are not scanned for out-of-vocabulary tokens at load time.
const SCAN_LIMIT_BYTES: u64 = 1 << 30;

impl Corpus {
    /// Loads `data.source` for a model with `vocab` tokens and windows of `seq_len + 1`.
    pub fn load(cfg: &DataConfig, vocab: usize, seq_len: usize) -> Result<Self, DataError> {
        let corpus = match cfg.source.split_once(':') {
            None => Self::synthetic(vocab, cfg.synthetic_tokens, cfg.val_fraction),
            Some(("text", path)) => Self::text(Path::new(path), cfg.val_fraction)?,
            Some((_, path)) => Self::token_file(Path::new(path), vocab, cfg.val_fraction)?,
        };
        let need = seq_len + 2;
        if corpus.val_start < need || corpus.tokens.len() - corpus.val_start < need {
            return Err(DataError::Format {
                path: PathBuf::from(&corpus.description),
                message: format!(
                    "too short: {} tokens give a training split of {} and a validation split of {}; \
                     each needs at least model.seq_len + 2 = {need}",
                    corpus.tokens.len(),
                    corpus.val_start,
                    corpus.tokens.len() - corpus.val_start
                ),
            });
        }
        Ok(corpus)
    }

    pub fn synthetic(vocab: usize, len: usize, val_fraction: f64) -> Self {
        // Stored as uint16: a larger vocabulary draws from its first 65,536 ids.
        let vocab = vocab.min(1 << 16);
        Self::split(Tokens::Owned(synthetic::generate(vocab, len)), val_fraction, format!("synthetic ({len} tokens)"))
    }

    fn text(path: &Path, val_fraction: f64) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Io { path: path.into(), source })?;
        let tokens = bytes.into_iter().map(u16::from).collect();
        Ok(Self::split(Tokens::Owned(tokens), val_fraction, format!("text:{}", path.display())))
    }

    fn token_file(path: &Path, vocab: usize, val_fraction: f64) -> Result<Self, DataError> {
        let io = |source| DataError::Io { path: path.into(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let format = |message: String| DataError::Format { path: path.into(), message };
        if size % 2 != 0 {
            return Err(format(format!("{size} bytes is not a whole number of uint16 tokens")));
        }
        let map = crate::ffi::os::map_readonly(&file).map_err(io)?;
        if size <= SCAN_LIMIT_BYTES {
            if let Some((i, tok)) =
                map.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).enumerate().find(|(_, t)| *t as usize >= vocab)
            {
                return Err(format(format!("token {tok} at index {i} is outside model.vocab_size = {vocab}")));
            }
        }
        Ok(Self::split(Tokens::Mapped(map), val_fraction, format!("tokens:{}", path.display())))
    }

    fn split(tokens: Tokens, val_fraction: f64, description: String) -> Self {
        let val_start = ((tokens.len() as f64) * (1.0 - val_fraction)).round() as usize;
        Self { tokens, val_start, description }
    }

    pub fn len(&self, split: Split) -> usize {
        match split {
            Split::Train => self.val_start,
            Split::Val => self.tokens.len() - self.val_start,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.len() == 0
    }

    /// Number of distinct start offsets for windows of `seq_len + 1` tokens in `split`.
    pub fn windows(&self, split: Split, seq_len: usize) -> usize {
        self.len(split) - seq_len
    }

    /// Copies `out.len()` tokens starting at `offset` within `split`.
    pub fn read(&self, split: Split, offset: usize, out: &mut [u16]) {
        let base = if split == Split::Train { 0 } else { self.val_start };
        self.tokens.copy_to(base + offset, out);
    }

    /// Entropy (nats) of the token distribution of `split`: the loss of a model that ignores
    /// context. A model that learns goes clearly below it.
    pub fn unigram_entropy(&self, split: Split) -> f64 {
        let n = self.len(split);
        let mut counts = vec![0u64; 1 << 16];
        let mut buf = vec![0u16; 1 << 16];
        let mut pos = 0;
        while pos < n {
            let chunk = (n - pos).min(buf.len());
            self.read(split, pos, &mut buf[..chunk]);
            for &t in &buf[..chunk] {
                counts[t as usize] += 1;
            }
            pos += chunk;
        }
        counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n as f64).map(|p| -p * p.ln()).sum()
    }
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
        let cfg = DataConfig { source: format!("tokens:{}", p.display()), val_fraction: 0.1, ..Default::default() };
        let c = Corpus::load(&cfg, 512, 16).unwrap();
        assert_eq!((c.len(Split::Train), c.len(Split::Val)), (900, 100));
        let mut w = [0u16; 3];
        c.read(Split::Val, 0, &mut w);
        assert_eq!(w, [0, 1, 2]); // token 900 is 900 % 300 = 0
        let err = Corpus::load(&cfg, 256, 16).err().unwrap().to_string();
        assert!(err.contains("outside model.vocab_size = 256"), "{err}");
        std::fs::write(&p, [1u8, 2, 3]).unwrap();
        assert!(Corpus::load(&cfg, 512, 16).is_err());
    }

    #[test]
    fn text_is_bytes_and_short_corpora_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "hello world ".repeat(100)).unwrap();
        let cfg = DataConfig { source: format!("text:{}", p.display()), val_fraction: 0.1, ..Default::default() };
        let c = Corpus::load(&cfg, 256, 8).unwrap();
        let mut w = [0u16; 5];
        c.read(Split::Train, 0, &mut w);
        assert_eq!(w, [104, 101, 108, 108, 111]);
        let err = Corpus::load(&cfg, 256, 200).err().unwrap().to_string();
        assert!(err.contains("too short"), "{err}");
    }

    #[test]
    fn synthetic_unigram_entropy_is_far_above_its_floor() {
        let c = Corpus::synthetic(256, 200_000, 0.1);
        let h = c.unigram_entropy(Split::Val);
        assert!(h > 4.0 && h <= (256f64).ln() + 1e-9, "{h}");
        assert!(h > super::synthetic::conditional_entropy() * 3.0);
    }
}
