//! Wrapper over `attention.cpp`: causal attention inside documents laid end to end, through
//! ATen's variable-length fused kernels on CUDA (flash for 16-bit inputs, the memory-efficient
//! kernel in fp32), which take the documents as cumulative lengths (`data.document_mask`). The
//! CPU takes a mask instead (`model::layers::causal_attention`): here it is an error.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    fn tg_varlen_attention(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        cu_seqlens: *const c_void,
        max_len: i64,
        dropout: f64,
        out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Causal attention of `q` `[n, heads, d]` over `k`, `v` `[n, kv_heads, d]` within each of the
/// documents `cu_seqlens` (int32 `[documents + 1]`: 0, each document's end, n) cuts the n tokens
/// into, the longest `max_len` long: `[n, heads, d]`, differentiable.
pub fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    max_len: i64,
    dropout: f64,
) -> Result<Tensor, ShimError> {
    let mut out = std::ptr::null_mut::<c_void>();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: every handle is a live tensor; on success the shim hands over a tensor it allocated
    // with `new`, which tch's Tensor owns and frees.
    let code = unsafe {
        tg_varlen_attention(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            cu_seqlens.as_ptr().cast(),
            max_len,
            dropout,
            &mut out,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    result(code, &err)?;
    // SAFETY: a non-null pointer the shim returned with code 0.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// On the CPU the kernels do not run: an error that says so, not an abort.
    #[test]
    fn the_cpu_is_refused_with_its_reason() {
        let x = Tensor::zeros([4, 2, 8], (Kind::Float, Device::Cpu));
        let cu = Tensor::from_slice(&[0i32, 4]);
        let err = varlen_attention(&x, &x, &x, &cu, 4, 0.0).unwrap_err().to_string();
        assert!(err.contains("run on CUDA only"), "{err}");
    }
}
