//! Each optimizer's state measured on a model's real parameters (built on the CPU), beside the
//! planner's estimate from the same shapes and the scratch its update uses besides: what
//! `tests/it/optimizers.rs` holds equal and `examples/optimizer_bench.rs state` prints.
use super::estimate::OptimizerState;
use crate::config::{ModelConfig, OptimizerName};
use crate::model::{Model, TensorSpec};
use crate::optim::{Optimizer, OptimizerSpec};
use tch::{Device, TchError};

/// One optimizer's state for one model.
pub struct StateBytes {
    pub kind: &'static str,
    pub measured: u64,
    pub estimate: u64,
    /// The device scratch the update uses besides its state (fused AdamW and SGD: none).
    pub scratch: u64,
}

/// Every optimizer's state for `model`, AdamW first.
pub fn measure(model: &ModelConfig) -> Result<Vec<StateBytes>, TchError> {
    let built = Model::new(model, 0, Device::Cpu)?;
    // What a run hands the optimizer: the user's rows of a padded vocabulary.
    let tensors = built.optimizer_params()?;
    let names = [
        OptimizerName::Adamw,
        OptimizerName::Sgd,
        OptimizerName::SgdMomentum,
        OptimizerName::Adafactor,
        OptimizerName::Adamw8bit,
        OptimizerName::Muon,
    ];
    let specs = crate::model::describe(model);
    names
        .into_iter()
        .map(|name| {
            // The hyperparameters do not change the state's size. Fused AdamW: no scratch the
            // size of the embedding.
            let opt = Optimizer::for_model(&OptimizerSpec::with_defaults(name, true), &built, Device::Cpu)?;
            // Each description with the shape the optimizer is handed (the user's rows).
            let estimate = specs
                .iter()
                .zip(&tensors)
                .map(|(s, t)| name.state_for(&TensorSpec { shape: t.size(), ..s.clone() }, 4))
                .sum();
            let scratch = match &opt {
                Optimizer::Adafactor(a) => a.scratch_bytes(),
                Optimizer::AdamW8bit(a) => a.scratch_bytes(),
                Optimizer::Muon(m) => m.scratch_bytes(),
                Optimizer::AdamW(_) | Optimizer::Sgd(_) => 0,
            };
            Ok(StateBytes { kind: opt.kind(), measured: opt.state_bytes(), estimate, scratch })
        })
        .collect()
}
