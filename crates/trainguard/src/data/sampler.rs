//! Which windows of the corpus make up a batch. Sample `i` of optimizer step `t` starts at an
//! offset that is a pure function of (seed, t, i), so the samples of any step can be produced
//! again in any split: the OOM guard replays a step at a smaller micro-batch, a resumed run
//! continues exactly, and rank r of N reads indices [r·B/N, (r+1)·B/N) of the same global batch.
//! In a mixture the source of each sample is chosen by weight from the same (seed, t, i)
//! (`mixture.rs`), then the window within that source. A batch's inputs and targets reach a GPU
//! together, by one asynchronous copy from pinned memory.
use super::{Corpus, DataError, Split};
use std::ops::Range;
use tch::{Device, Kind, TchError, Tensor};

const EVAL_SALT: u64 = 0x6576_616c; // keeps validation windows apart from training windows

/// SplitMix64 finaliser over a sequence of words: a fast, well-mixed, stateless hash.
pub fn mix(words: &[u64]) -> u64 {
    let mut h: u64 = 0x9E37_79B9_7F4A_7C15;
    for &w in words {
        let mut z = h ^ w.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h = z ^ (z >> 31);
    }
    h
}

#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    pub seed: u64,
    pub seq_len: usize,
}

impl Sampler {
    /// Start offset (within the split) of global sample `index` of training step `step`.
    pub fn train_offset(&self, corpus: &Corpus, step: u64, index: usize) -> usize {
        let h = mix(&[self.seed, step, index as u64]);
        self.place(corpus, Split::Train, h, self.seed, step, index)
    }

    /// Start offset of sample `index` of validation batch `batch` (the same at every eval).
    pub fn val_offset(&self, corpus: &Corpus, batch: usize, index: usize) -> usize {
        let h = mix(&[self.seed ^ EVAL_SALT, batch as u64, index as u64]);
        self.place(corpus, Split::Val, h, self.seed ^ EVAL_SALT, batch as u64, index)
    }

    /// The window hash `h` as an offset into `split`: of the whole corpus, or, in a mixture, of
    /// the source chosen for sample `index` of `draw` (a window never crosses into another
    /// source). One source reads exactly as before mixtures existed.
    fn place(&self, corpus: &Corpus, split: Split, h: u64, seed: u64, draw: u64, index: usize) -> usize {
        match &corpus.mixture {
            None => (h % corpus.windows(split, self.seq_len) as u64) as usize,
            Some(m) => {
                let k = m.weights.choose(seed, draw, index);
                m.base(split, k) + (h % m.sources[k].windows(split, self.seq_len) as u64) as usize
            }
        }
    }

    /// Tokens each source of a mixture gives step `step`'s global batch, by name (empty for
    /// one source): every rank can count the whole batch, so rank 0 reports it alone.
    pub fn tokens_by_source(&self, corpus: &Corpus, step: u64, global_batch: usize) -> Vec<(String, u64)> {
        let Some(m) = &corpus.mixture else { return Vec::new() };
        let counts = m.weights.counts(self.seed, step, 0..global_batch);
        m.names.iter().cloned().zip(counts.into_iter().map(|n| n * self.seq_len as u64)).collect()
    }

    /// Refuses an id outside the vocabulary in any window of step `step`, every rank's samples
    /// included (so all ranks stop at the same step, saying the same), when the training split
    /// was too large to scan at load. Without it a bad id reaches the embedding: an index error
    /// naming no file, or on CUDA a device-side assert.
    pub fn check_train_step(&self, corpus: &Corpus, step: u64, global_batch: usize) -> Result<(), DataError> {
        if !corpus.check_as_read {
            return Ok(());
        }
        for i in 0..global_batch {
            corpus.check_train_window(self.train_offset(corpus, step, i), self.seq_len).map_err(|e| match e {
                DataError::Vocab { path, message } => DataError::Vocab { path, message: format!("{message} (read by step {step}: a training split over 1 GiB is checked as steps read it)") },
                other => other,
            })?;
        }
        Ok(())
    }

    /// Inputs and targets `[n, seq_len]` (int64) for global samples `indices` of step `step`.
    pub fn train_batch(
        &self,
        corpus: &Corpus,
        step: u64,
        indices: Range<usize>,
        device: Device,
    ) -> Result<(Tensor, Tensor), TchError> {
        let offsets: Vec<usize> = indices.map(|i| self.train_offset(corpus, step, i)).collect();
        self.build(corpus, Split::Train, &offsets, device)
    }

    /// Inputs and targets for samples `indices` of validation batch `batch`.
    pub fn val_batch(
        &self,
        corpus: &Corpus,
        batch: usize,
        indices: Range<usize>,
        device: Device,
    ) -> Result<(Tensor, Tensor), TchError> {
        let offsets: Vec<usize> = indices.map(|i| self.val_offset(corpus, batch, i)).collect();
        self.build(corpus, Split::Val, &offsets, device)
    }

    fn build(
        &self,
        corpus: &Corpus,
        split: Split,
        offsets: &[usize],
        device: Device,
    ) -> Result<(Tensor, Tensor), TchError> {
        let t = self.seq_len;
        let mut x = Vec::with_capacity(offsets.len() * t);
        let mut y = Vec::with_capacity(offsets.len() * t);
        let mut window = vec![0u32; t + 1];
        for &off in offsets {
            corpus.read(split, off, &mut window);
            x.extend(window[..t].iter().map(|&v| v as i64));
            y.extend(window[1..].iter().map(|&v| v as i64));
        }
        // Inputs and targets in one tensor, so a GPU gets them in one copy.
        x.extend(y);
        let both = Tensor::f_from_slice(&x)?.f_view([2, offsets.len() as i64, t as i64])?;
        let both = upload(both, device)?;
        debug_assert_eq!(both.kind(), Kind::Int64);
        Ok((both.f_get(0)?, both.f_get(1)?))
    }
}

/// `host` on `device`. To a GPU from pinned memory without waiting: a copy from pageable memory
/// makes the host wait until the GPU has finished all queued work, at every micro-step, so the
/// next kernels would be launched onto an idle GPU. The pinned block is not reused before the
/// copy has run (PyTorch's host allocator records the copy's stream). `_pin_memory`, because
/// `pin_memory` warns at every call that its device argument (which tch always passes) is
/// deprecated.
fn upload(host: Tensor, device: Device) -> Result<Tensor, TchError> {
    match device.is_cuda() {
        true => host.f_internal_pin_memory(device)?.f_to_device_(device, host.kind(), true, false),
        false => Ok(host),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_deterministic_and_sensitive_to_each_word() {
        assert_eq!(mix(&[1, 2, 3]), mix(&[1, 2, 3]));
        assert_ne!(mix(&[1, 2, 3]), mix(&[1, 2, 4]));
        assert_ne!(mix(&[1, 2, 3]), mix(&[2, 1, 3]));
    }

    #[test]
    fn a_step_has_the_same_samples_in_any_split() {
        let corpus = Corpus::synthetic(256, 50_000, 0.1).unwrap();
        let s = Sampler { seed: 7, seq_len: 16 };
        let whole: Vec<usize> = (0..32).map(|i| s.train_offset(&corpus, 3, i)).collect();
        let halves: Vec<usize> = crate::data::batch::split(32, 5)
            .flat_map(|r| r.map(|i| s.train_offset(&corpus, 3, i)).collect::<Vec<_>>())
            .collect();
        assert_eq!(whole, halves);
        let other_step: Vec<usize> = (0..32).map(|i| s.train_offset(&corpus, 4, i)).collect();
        assert_ne!(whole, other_step);
        let other_seed = Sampler { seed: 8, seq_len: 16 };
        assert_ne!(
            whole[0..4],
            (0..4).map(|i| other_seed.train_offset(&corpus, 3, i)).collect::<Vec<_>>()[..]
        );
    }

    #[test]
    fn a_mixtures_samples_come_whole_from_the_source_chosen_for_them() {
        let dir = tempfile::tempdir().unwrap();
        // Two sources told apart by their ids: all of `low` below 100, all of `high` above.
        let write = |name: &str, base: u16| {
            let p = dir.path().join(name);
            let toks: Vec<u8> = (0..4000u16).flat_map(|i| (base + i % 50).to_le_bytes()).collect();
            std::fs::write(&p, toks).unwrap();
            format!("tokens:{}", p.display())
        };
        let source = |s: String, weight: f64| crate::config::SourceConfig { source: s, weight, name: None };
        let cfg = crate::config::DataConfig {
            sources: vec![source(write("low.bin", 0), 0.8), source(write("high.bin", 200), 0.2)],
            ..Default::default()
        };
        let corpus = Corpus::load(&cfg, 256, 16, true).unwrap();
        let m = corpus.mixture.as_ref().unwrap();
        assert_eq!(m.names, ["low.bin", "high.bin"]);
        let s = Sampler { seed: 4, seq_len: 16 };
        let (x, y) = s.train_batch(&corpus, 9, 0..256, Device::Cpu).unwrap();
        let both = Tensor::cat(&[x, y], 1);
        let mut high = 0;
        for i in 0..256 {
            let row: Vec<i64> = Vec::try_from(both.get(i)).unwrap();
            let from_high = m.weights.choose(4, 9, i as usize) == 1;
            assert!(row.iter().all(|&t| (t >= 200) == from_high), "sample {i} mixes sources: {row:?}");
            high += from_high as u64;
        }
        assert_eq!(
            s.tokens_by_source(&corpus, 9, 256),
            [("low.bin".to_string(), (256 - high) * 16), ("high.bin".to_string(), high * 16)]
        );
        // Validation draws by weight too, each window inside its source's validation split.
        for i in 0..64 {
            let off = s.val_offset(&corpus, 2, i);
            let (k, local) = m.locate(Split::Val, off);
            assert!(local + 17 <= m.sources[k].len(Split::Val));
            assert_eq!(k, m.weights.choose(4 ^ EVAL_SALT, 2, i));
        }
        // One source samples exactly as it always did.
        let single = Corpus::load(
            &crate::config::DataConfig { source: cfg.sources[0].source.clone(), ..Default::default() },
            256,
            16,
            true,
        )
        .unwrap();
        let h = mix(&[4, 9, 3]);
        assert_eq!(s.train_offset(&single, 9, 3), (h % single.windows(Split::Train, 16) as u64) as usize);
    }

    #[test]
    fn batches_are_shifted_windows_of_the_corpus() {
        let corpus = Corpus::synthetic(256, 50_000, 0.1).unwrap();
        let s = Sampler { seed: 1, seq_len: 8 };
        let (x, y) = s.train_batch(&corpus, 0, 0..4, Device::Cpu).unwrap();
        assert_eq!(x.size(), [4, 8]);
        let x0: Vec<i64> = Vec::try_from(x.get(0)).unwrap();
        let y0: Vec<i64> = Vec::try_from(y.get(0)).unwrap();
        assert_eq!(x0[1..], y0[..7]);
        let mut w = vec![0u32; 9];
        corpus.read(Split::Train, s.train_offset(&corpus, 0, 0), &mut w);
        assert_eq!(x0, w[..8].iter().map(|&v| v as i64).collect::<Vec<_>>());
    }
}
