//! A named, ordered list of trainable tensors. Kept by hand rather than in a `nn::VarStore`
//! because every creation here is fallible (an allocator failure while building the model is an
//! `Err`, not a panic) and the names are the checkpoint's tensor names.
use tch::{Device, Kind, TchError, Tensor};

#[derive(Debug, Default)]
pub struct Params {
    pub names: Vec<String>,
    pub tensors: Vec<Tensor>,
    /// Whether weight decay applies (linear weights only: not biases, norms, embeddings).
    pub decay: Vec<bool>,
}

/// How a parameter starts.
pub enum Init {
    Normal(f64),
    Zeros,
    Ones,
}

impl Params {
    pub fn add(&mut self, name: String, shape: &[i64], init: Init, decay: bool, device: Device) -> Result<Tensor, TchError> {
        let opts = (Kind::Float, device);
        let t = match init {
            // Drawn on the CPU so that initial weights are the same on every device.
            Init::Normal(std) => Tensor::f_randn(shape, (Kind::Float, Device::Cpu))?.f_mul_scalar(std)?.f_to_device(device)?,
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
