//! Wrapper over `trace.cpp`: PyTorch's profiler (Kineto) started and stopped from Rust, its
//! Chrome trace written, its events handed back as [`TraceEvent`]s; and named ranges
//! ([`Range`]) that show in the trace. What the events mean is `crate::trace`'s business.
use super::{result, ShimError, ERR_LEN};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;

extern "C" {
    fn tg_trace_start(cuda: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_trace_stop(path: *const c_char, events: *mut *mut c_char, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_trace_free(p: *mut c_char);
    fn tg_trace_range_begin(name: *const c_char) -> *mut c_void;
    fn tg_trace_range_end(range: *mut c_void);
}

/// One event with a duration: an operator the CPU ran (`lane`: its thread) or, with
/// `device_side`, a kernel, copy or set the GPU ran (`lane`: its stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    pub device_side: bool,
    pub lane: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: String,
}

/// Starts the profiler on this thread (and the threads autograd's backward runs on): CPU
/// operators, and with `cuda` the GPU's kernels, copies and sets.
pub fn start(cuda: bool) -> Result<(), ShimError> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: a plain value; `err` is ERR_LEN bytes.
    result(unsafe { tg_trace_start(c_int::from(cuda), err.as_mut_ptr().cast(), ERR_LEN) }, &err)
}

/// Stops the profiler, writes its Chrome trace to `path` (none without one) and returns its
/// events.
pub fn stop(path: Option<&Path>) -> Result<Vec<TraceEvent>, ShimError> {
    let path = CString::new(path.map(|p| p.to_string_lossy().into_owned()).unwrap_or_default()).map_err(|_| ShimError::Torch("NUL in the trace path".into()))?;
    let mut text = std::ptr::null_mut::<c_char>();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `path` is NUL-terminated and outlives the call; on success `text` is a malloc'd
    // NUL-terminated buffer that we read once and release with tg_trace_free.
    let code = unsafe { tg_trace_stop(path.as_ptr(), &mut text, err.as_mut_ptr().cast(), ERR_LEN) };
    result(code, &err)?;
    let owned = unsafe {
        let s = CStr::from_ptr(text).to_string_lossy().into_owned();
        tg_trace_free(text);
        s
    };
    Ok(owned.lines().filter_map(parse_line).collect())
}

/// `device\tlane\tstart_ns\tend_ns\tname` (trace.cpp's format).
fn parse_line(line: &str) -> Option<TraceEvent> {
    let mut f = line.splitn(5, '\t');
    let device_side = match f.next()? {
        "cuda" => true,
        "cpu" => false,
        _ => return None,
    };
    Some(TraceEvent { device_side, lane: f.next()?.parse().ok()?, start_ns: f.next()?.parse().ok()?, end_ns: f.next()?.parse().ok()?, name: f.next()?.to_string() })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_and_junk_is_skipped() {
        let e = parse_line("cuda\t7\t100\t250\tvoid at::native::vectorized_elementwise_kernel<4, a\tb>").unwrap();
        assert_eq!(e, TraceEvent { device_side: true, lane: 7, start_ns: 100, end_ns: 250, name: "void at::native::vectorized_elementwise_kernel<4, a\tb>".into() });
        assert!(parse_line("gpu\t1\t2\t3\tx").is_none());
        assert!(parse_line("cpu\t1\t2").is_none());
    }
}
