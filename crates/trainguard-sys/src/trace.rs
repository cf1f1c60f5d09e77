//! Wrapper over `trace.cpp`: PyTorch's profiler (Kineto) started and stopped from Rust, its
//! Chrome trace written; and named ranges ([`Range`]) that show in the trace. Reading the trace
//! is `crate::trace`'s business.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::Path;

extern "C" {
    fn tg_trace_start(cuda: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_trace_stop(path: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_trace_range_begin(name: *const c_char) -> *mut c_void;
    fn tg_trace_range_end(range: *mut c_void);
}

/// Starts the profiler on this thread (and the threads autograd's backward runs on): CPU
/// operators, and with `cuda` the GPU's kernels, copies and sets.
pub fn start(cuda: bool) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: a plain value; `err` is ERR_LEN bytes.
    result(unsafe { tg_trace_start(c_int::from(cuda), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// Stops the profiler and writes its Chrome trace to `path` (none without one).
pub fn stop(path: Option<&Path>) -> Result<(), ShimError> {
    let path = CString::new(path.map(|p| p.to_string_lossy().into_owned()).unwrap_or_default())
        .map_err(|_| ShimError::Torch("NUL in the trace path".into()))?;
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `path` is NUL-terminated and outlives the call; `err` is ERR_LEN bytes.
    result(unsafe { tg_trace_stop(path.as_ptr(), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// A named range in the trace while it lives (nothing when no profiler records).
pub struct Range(*mut c_void);

impl Range {
    pub fn new(name: &str) -> Self {
        let Ok(c) = CString::new(name) else { return Range(std::ptr::null_mut()) };
        // SAFETY: `c` is NUL-terminated and outlives the call; the shim catches everything.
        Range(unsafe { tg_trace_range_begin(c.as_ptr()) })
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the handle tg_trace_range_begin returned, ended once.
            unsafe { tg_trace_range_end(self.0) }
        }
    }
}
