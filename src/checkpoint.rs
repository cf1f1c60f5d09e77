//! What a run leaves on disk besides its logs. For now: the final weights as safetensors
//! (`out_dir/model.safetensors`, tensor names as in [`Params`](crate::model::Params)), written
//! under a temporary name and renamed, so the file is complete or absent.
use crate::model::Params;
use std::path::{Path, PathBuf};
use tch::Tensor;

pub const WEIGHTS_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
#[error("cannot write weights to {path}: {message}")]
pub struct SaveError {
    pub path: PathBuf,
    pub message: String,
}

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
