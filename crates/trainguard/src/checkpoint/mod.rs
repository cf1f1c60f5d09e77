//! What a run leaves on disk to be resumed: checkpoints ([`store`]; written whole by
//! [`writer`], in the background from a host copy [`snapshot`]), their `trainer_state.json`
//! ([`state`]), which ones to keep ([`retention`], pure) and what may change between a
//! checkpoint and the config resuming it ([`compare`]). Also the final weights file.
pub mod compare;
pub mod fresh;
pub mod lineage;
pub mod retention;
pub mod snapshot;
pub mod state;
pub mod store;
pub mod writer;

use crate::model::Params;
use std::path::{Path, PathBuf};
use tch::Tensor;

pub use store::{CheckpointError, Loaded};

pub const WEIGHTS_FILE: &str = crate::fs::run_files::WEIGHTS;

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
    let written = Tensor::write_safetensors(&cpu, &tmp)
        .map_err(|e| write_error(&e))
        .and_then(|()| std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| e.to_string()))
        .and_then(|()| std::fs::rename(&tmp, &path).map_err(|e| e.to_string()));
    if let Err(message) = written {
        // Of no use half written, and on a full disk it holds the space the run needs.
        let _ = std::fs::remove_file(&tmp);
        return Err(err(message));
    }
    Ok(path)
}

/// The safetensors writer's error as a person reads it: an I/O error in its own words ("No
/// space left on device (os error 28)"), not tch's debug form of it.
pub fn write_error(e: &tch::TchError) -> String {
    match e {
        tch::TchError::SafeTensorError { path, err: safetensors::SafeTensorError::IoError(io) } => {
            format!("safetensors error {path}: {io}")
        }
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_of_the_writer_reads_as_its_own_words() {
        // As tch gives a full disk (captured from a write into a full tmpfs).
        let full = std::io::Error::from_raw_os_error(28);
        let e = tch::TchError::SafeTensorError {
            path: "/r/.model.safetensors.tmp".into(),
            err: safetensors::SafeTensorError::IoError(full),
        };
        assert_eq!(e.to_string(), "safetensors error /r/.model.safetensors.tmp: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })", "tch's words");
        assert_eq!(
            write_error(&e),
            "safetensors error /r/.model.safetensors.tmp: No space left on device (os error 28)"
        );
        let other = tch::TchError::FileFormat("something else".into());
        assert_eq!(write_error(&other), other.to_string());
    }
}
