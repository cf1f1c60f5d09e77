//! What a run leaves on disk to be resumed: checkpoints ([`store`]), their `trainer_state.json`
//! ([`state`]), which ones to keep ([`retention`], pure) and what may change between a
//! checkpoint and the config resuming it ([`compare`]). Also the final weights file.
pub mod compare;
pub mod fresh;
pub mod retention;
pub mod state;
pub mod store;

use crate::model::Params;
use std::path::{Path, PathBuf};
use tch::Tensor;

pub use store::{CheckpointError, Loaded};

pub const WEIGHTS_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
#[error("cannot write weights to {path}: {message}")]
pub struct SaveError {
    pub path: PathBuf,
    pub message: String,
}

/// `dir/model.safetensors`, written under a temporary name and renamed.
pub fn save_weights(dir: &Path, params: &Params) -> Result<PathBuf, SaveError> {
    let path = dir.join(WEIGHTS_FILE);
    let tmp = dir.join(format!(".{WEIGHTS_FILE}.tmp"));
    let err = |message: String| SaveError { path: path.clone(), message };
    let cpu: Vec<(&str, Tensor)> = params
        .names
        .iter()
        .zip(&params.tensors)
        .map(|(n, t)| Ok((n.as_str(), t.f_detach()?.f_to_device(tch::Device::Cpu)?)))
        .collect::<Result<_, tch::TchError>>()
        .map_err(|e| err(e.to_string()))?;
    Tensor::write_safetensors(&cpu, &tmp).map_err(|e| err(e.to_string()))?;
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, &path).map_err(|e| err(e.to_string()))?;
    Ok(path)
}
