//! A named, ordered list of trainable tensors. Kept by hand rather than in a `nn::VarStore`
//! because every creation here is fallible (an allocator failure while building the model is an
//! `Err`, not a panic) and the names are the checkpoint's tensor names.
use crate::data::mix;
use tch::{Device, Kind, TchError, Tensor};

fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x1000_0000_01b3))
    // FNV-1a
}

/// `n` draws from N(0, std²): SplitMix64 uniforms through Box-Muller. `None` when the host
/// memory for them cannot be had (the size comes from the config: never an abort).
fn normal_values(key: u64, n: usize, std: f64) -> Option<Vec<f32>> {
    let mut state = key;
    let mut uniform = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        // 53 random bits in (0, 1]: never 0, so the logarithm is finite.
        (((z ^ (z >> 31)) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    let mut out = Vec::new();
    out.try_reserve_exact(n.checked_add(1)?).ok()?;
    while out.len() < n {
        let (u1, u2) = (uniform(), uniform());
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let theta = 2.0 * std::f64::consts::PI * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(n);
    Some(out)
}

/// Starts the message of an allocation failure of trainguard's own (host) buffers; the OOM
/// classifier (`guard::classify`) recognises it like libtorch's allocator messages.
pub const HOST_ALLOCATION_FAILED: &str = "host allocation failed";

#[derive(Debug, Default)]
pub struct Params {
    /// Seeds the initial values: each parameter draws from its own stream keyed by
    /// (seed, name), so weights do not depend on libtorch's global generator, the device or the
    /// order parameters are made in.
    pub seed: u64,
    pub names: Vec<String>,
    pub tensors: Vec<Tensor>,
    /// Whether weight decay applies (linear weights only: not biases, norms, embeddings).
    pub decay: Vec<bool>,
}

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal(f64),
    Zeros,
    Ones,
}

impl Params {
    pub fn add(
        &mut self,
        name: String,
        shape: &[i64],
        init: Init,
        decay: bool,
        device: Device,
    ) -> Result<Tensor, TchError> {
        let opts = (Kind::Float, device);
        let t = match init {
            Init::Normal(std) => {
                let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?));
                let values = n.and_then(|n| normal_values(mix(&[self.seed, name_key(&name)]), n, std)).ok_or_else(|| {
                    TchError::Torch(format!("{HOST_ALLOCATION_FAILED}: the initial values of `{name}` {shape:?} do not fit in host memory"))
                })?;
                Tensor::f_from_slice(&values)?.f_view(shape)?.f_to_device(device)?
            }
            Init::Zeros => Tensor::f_zeros(shape, opts)?,
            Init::Ones => Tensor::f_ones(shape, opts)?,
        };
        let t = t.f_set_requires_grad(true)?;
        self.names.push(name);
        self.tensors.push(t.shallow_clone());
        self.decay.push(decay);
        Ok(t)
    }

    pub fn count(&self) -> i64 {
        self.tensors.iter().map(Tensor::numel).sum::<usize>() as i64
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.names.iter().position(|n| n == name).map(|i| &self.tensors[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_draws_have_the_asked_moments_and_are_reproducible() {
        let v = normal_values(42, 200_001, 0.02).unwrap();
        assert_eq!(v.len(), 200_001);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 2e-4, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "{}", var.sqrt());
        assert_eq!(v[..10], normal_values(42, 10, 0.02).unwrap()[..]);
        assert_ne!(v[..10], normal_values(43, 10, 0.02).unwrap()[..]);
        assert!(
            normal_values(1, usize::MAX / 2, 0.02).is_none(),
            "an impossible size is an answer, not an abort"
        );
    }
}
