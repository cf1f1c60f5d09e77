//! `deterministic: true`: the same inputs give the same bits on CUDA too, so a step the OOM guard
//! replays and a resumed run continue exactly. Two parts, at two moments:
//! - [`prepare_env`], before any thread or CUDA context exists: `CUBLAS_WORKSPACE_CONFIG=:4096:8`
//!   (cuBLAS reads it when it creates a handle; libtorch refuses cuBLAS calls in deterministic
//!   mode without it), unless the user set it.
//! - [`enable`], before the model is built: libtorch's switch through the shim, read back.
//!
//! Attention needs nothing of its own: with the switch on (warn-only off) libtorch 2.11 runs the
//! flash-attention backward in its deterministic mode, forces the memory-efficient backward to a
//! single key split, and leaves cuDNN attention out of SDPA's choice; the dense embedding
//! backward is not among the ops libtorch flags (read from PyTorch's sources, not yet run on a
//! GPU). An op with no deterministic variant throws; the guard turns that into
//! `GuardError::NotDeterministic` naming the op (exit code 6).
use crate::ffi::{self, DeterministicState, ShimError};
use serde::Serialize;

pub const CUBLAS_ENV: &str = "CUBLAS_WORKSPACE_CONFIG";
/// cuBLAS's deterministic workspace settings (NVIDIA's "results reproducibility"); PyTorch accepts
/// these two.
pub const CUBLAS_DETERMINISTIC: [&str; 2] = [":4096:8", ":16:8"];

/// What a deterministic run runs with (the `deterministic` event).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Determinism {
    #[serde(flatten)]
    pub libtorch: DeterministicState,
    pub cublas_workspace_config: Option<String>,
    /// `environment` (the user's value, kept) or `trainguard` (set because it was unset).
    pub cublas_workspace_config_from: &'static str,
}

/// Sets `CUBLAS_WORKSPACE_CONFIG` for a deterministic run unless the environment has it. Call it
/// before other threads start and before CUDA is initialised.
pub fn prepare_env(deterministic: bool) {
    if deterministic && std::env::var_os(CUBLAS_ENV).is_none() {
        std::env::set_var(CUBLAS_ENV, CUBLAS_DETERMINISTIC[0]);
    }
}

/// Turns libtorch's deterministic mode on and reports what libtorch and the environment say.
pub fn enable() -> Result<Determinism, ShimError> {
    ffi::set_deterministic(true)?;
    let cublas = std::env::var(CUBLAS_ENV).ok();
    // prepare_env only ever sets the first value; anything else came from the user.
    let from = match cublas.as_deref() {
        Some(v) if v == CUBLAS_DETERMINISTIC[0] && !user_set() => "trainguard",
        _ => "environment",
    };
    if let Some(v) = cublas.as_deref().filter(|v| !CUBLAS_DETERMINISTIC.contains(v)) {
        tracing::warn!("{CUBLAS_ENV}={v} from the environment is not one of {CUBLAS_DETERMINISTIC:?}: libtorch will refuse cuBLAS calls on CUDA in deterministic mode");
    }
    Ok(Determinism {
        libtorch: ffi::deterministic_state(),
        cublas_workspace_config: cublas,
        cublas_workspace_config_from: from,
    })
}

/// Whether the process started with the variable set (the initial environment, which
/// `set_var` does not change).
fn user_set() -> bool {
    std::fs::read("/proc/self/environ")
        .map(|env| env.split(|&b| b == 0).any(|kv| kv.starts_with(format!("{CUBLAS_ENV}=").as_bytes())))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    /// Turns libtorch's process-wide switch on for a moment (CPU tests elsewhere in this binary
    /// use no op it refuses) and reads it back through the shim getter; the refusal's real text
    /// goes through the classifier.
    #[test]
    fn libtorch_reports_the_switch_and_its_refusal_names_the_op() {
        ffi::set_deterministic(true).unwrap();
        let on = ffi::deterministic_state();
        let refused = Tensor::zeros([4], (Kind::Float, Device::Cpu))
            .f_put_(&Tensor::from_slice(&[1i64, 2]), &Tensor::from_slice(&[1f32, 2.0]), false)
            .map(|_| ());
        ffi::set_deterministic(false).unwrap();
        assert_eq!(
            on,
            DeterministicState {
                algorithms: true,
                warn_only: false,
                fill_uninitialized_memory: true,
                cudnn: true
            }
        );
        assert!(!ffi::deterministic_state().algorithms);
        let message = refused.unwrap_err().to_string();
        assert!(message.contains("does not have a deterministic implementation"), "{message}");
        assert_eq!(crate::guard::nondeterministic_op(&message).as_deref(), Some("`put_`"), "{message}");
    }
}
