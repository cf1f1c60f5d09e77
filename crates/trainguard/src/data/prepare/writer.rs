//! Writes the token stream into shards inside a staging directory: the first `val_tokens`
//! tokens to `val_000000.bin`, the rest to `train_NNNNNN.bin` of `shard_tokens` each. A shard is
//! streamed to disk (header with a zero count first, patched when it is closed), so memory does
//! not depend on the shard size.
use crate::data::shards::{self, Dtype, ShardEntry};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

struct Open {
    name: String,
    file: BufWriter<File>,
    tokens: usize,
    limit: usize,
}

pub struct ShardWriter {
    dir: PathBuf,
    dtype: Dtype,
    shard_tokens: usize,
    val_tokens: usize,
    open: Option<Open>,
    pub train: Vec<ShardEntry>,
    pub val: Vec<ShardEntry>,
}

impl ShardWriter {
    pub fn new(dir: &Path, dtype: Dtype, shard_tokens: usize, val_tokens: usize) -> Self {
        Self { dir: dir.into(), dtype, shard_tokens, val_tokens, open: None, train: vec![], val: vec![] }
    }

    pub fn total(&self) -> u64 {
        self.train.iter().chain(&self.val).map(|s| s.tokens).sum::<u64>()
            + self.open.as_ref().map_or(0, |o| o.tokens as u64)
    }

    /// Appends `tokens`, opening and closing shards as they fill.
    pub fn write(&mut self, mut tokens: &[u32]) -> std::io::Result<()> {
        while !tokens.is_empty() {
            if self.open.is_none() {
                self.open_next()?;
            }
            let o = self.open.as_mut().expect("opened above");
            let n = (o.limit - o.tokens).min(tokens.len());
            let mut bytes = Vec::with_capacity(n * self.dtype.width());
            for &t in &tokens[..n] {
                match self.dtype {
                    Dtype::Uint16 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
                    Dtype::Uint32 => bytes.extend_from_slice(&t.to_le_bytes()),
                }
            }
            o.file.write_all(&bytes)?;
            o.tokens += n;
            tokens = &tokens[n..];
            if o.tokens == o.limit {
                self.close()?;
            }
        }
        Ok(())
    }

    fn open_next(&mut self) -> std::io::Result<()> {
        let (name, limit) = if self.val.is_empty() && self.val_tokens > 0 {
            ("val_000000.bin".to_string(), self.val_tokens)
        } else {
            (format!("train_{:06}.bin", self.train.len()), self.shard_tokens)
        };
        let mut file = BufWriter::with_capacity(1 << 20, File::create(self.dir.join(&name))?);
        file.write_all(&shards::header(self.dtype, 0))?;
        self.open = Some(Open { name, file, tokens: 0, limit });
        Ok(())
    }

    /// Writes the open shard's token count into its header and syncs it.
    pub fn close(&mut self) -> std::io::Result<()> {
        let Some(o) = self.open.take() else { return Ok(()) };
        let mut f = o.file.into_inner().map_err(|e| e.into_error())?;
        f.seek(SeekFrom::Start(0))?;
        f.write_all(&shards::header(self.dtype, o.tokens))?;
        f.sync_all()?;
        let entry = ShardEntry { file: o.name.clone(), tokens: o.tokens as u64 };
        if o.name.starts_with("val_") {
            self.val.push(entry);
        } else {
            self.train.push(entry);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn val_first_then_train_shards_of_the_asked_size() {
        let d = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::new(d.path(), Dtype::Uint16, 4, 3);
        w.write(&[1, 2]).unwrap();
        w.write(&[3, 4, 5, 6, 7, 8, 9, 10]).unwrap();
        w.close().unwrap();
        let files: Vec<_> = w.val.iter().chain(&w.train).map(|s| (s.file.as_str(), s.tokens)).collect();
        assert_eq!(files, [("val_000000.bin", 3), ("train_000000.bin", 4), ("train_000001.bin", 3)]);
        let bytes = std::fs::read(d.path().join("train_000001.bin")).unwrap();
        let l = shards::layout(&bytes, bytes.len() as u64).unwrap();
        assert_eq!(l.tokens, 3);
        assert_eq!(&bytes[1024..], &[8, 0, 9, 0, 10, 0]);
    }
}
