//! Wrapper over `graph.cpp`: CUDA graphs through ATen's `CUDAGraph` (`kernels.cuda_graphs`).
//! [`Capture::begin`] starts recording every CUDA op this thread queues (on a side stream, with
//! autocast's cast cache off), [`Capture::end`] turns the recording into a [`CudaGraph`] that
//! [`CudaGraph::replay`] launches at once. A capture dropped before its end (the captured code
//! failed) is closed and thrown away. Unavailable on the CPU and in builds without libtorch_cuda
//! or the CUDA headers.
use super::ShimError;
#[cfg(tg_cuda_graphs)]
use super::{result, ERR_LEN};
use std::ffi::c_void;
#[cfg(tg_cuda_graphs)]
use std::ffi::{c_char, c_int};

#[cfg(tg_cuda_graphs)]
extern "C" {
    fn tg_graph_capture_begin(
        device: c_int,
        share: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_graph_capture_end(g: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_graph_replay(g: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_graph_free(g: *mut c_void);
}

/// An open capture: everything queued on the CUDA device from [`Capture::begin`] to
/// [`Capture::end`] is recorded, not run.
pub struct Capture {
    handle: *mut c_void,
}

/// A captured, instantiated graph; freeing the last graph of a pool frees the pool.
pub struct CudaGraph {
    handle: *mut c_void,
}

impl Capture {
    /// Starts capturing on CUDA device `device` (synchronises it and empties the allocator's
    /// cache first). With `share`, the graph allocates from that graph's private pool: the
    /// graphs must then run one after the other, never at once.
    pub fn begin(device: usize, share: Option<&CudaGraph>) -> Result<Capture, ShimError> {
        #[cfg(tg_cuda_graphs)]
        {
            if !super::accelerator_available() {
                return Err(ShimError::Unavailable);
            }
            let share = share.map_or(std::ptr::null_mut(), |g| g.handle);
            let (mut handle, mut err) = (std::ptr::null_mut(), [0u8; ERR_LEN]);
            // SAFETY: `share` is a live graph handle or null; `handle` receives a new one on
            // success, owned by the Capture (freed by end's CudaGraph or by Drop).
            result(
                unsafe {
                    tg_graph_capture_begin(
                        device as c_int,
                        share,
                        &mut handle,
                        err.as_mut_ptr().cast(),
                        ERR_LEN,
                    )
                },
                &err,
            )?;
            Ok(Capture { handle })
        }
        #[cfg(not(tg_cuda_graphs))]
        {
            let _ = (device, share);
            Err(ShimError::Unavailable)
        }
    }

    /// Ends the capture: the graph, instantiated and ready to replay. On failure (an op that
    /// cannot be captured) the recording is thrown away.
    pub fn end(self) -> Result<CudaGraph, ShimError> {
        let handle = self.handle;
        std::mem::forget(self);
        let graph = CudaGraph { handle };
        #[cfg(tg_cuda_graphs)]
        {
            let mut err = [0u8; ERR_LEN];
            // SAFETY: a live handle from begin; on failure `graph` drops and frees it.
            result(unsafe { tg_graph_capture_end(graph.handle, err.as_mut_ptr().cast(), ERR_LEN) }, &err)?;
        }
        Ok(graph)
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        // Closes the capture (the device's stream leaves capture mode) and frees the recording.
        drop(CudaGraph { handle: self.handle });
    }
}

impl CudaGraph {
    /// Launches the graph on the current stream.
    pub fn replay(&self) -> Result<(), ShimError> {
        #[cfg(tg_cuda_graphs)]
        {
            let mut err = [0u8; ERR_LEN];
            // SAFETY: a live, instantiated graph handle.
            result(unsafe { tg_graph_replay(self.handle, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
        }
        #[cfg(not(tg_cuda_graphs))]
        Err(ShimError::Unavailable)
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        #[cfg(tg_cuda_graphs)]
        // SAFETY: the handle is freed exactly once (end forgets the Capture that held it).
        unsafe {
            tg_graph_free(self.handle)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_capture_is_unavailable_not_an_abort() {
        if super::super::accelerator_available() {
            eprintln!("skipped: a CUDA device is present (tests/it/gpu.rs captures graphs)");
            return;
        }
        assert!(matches!(Capture::begin(0, None), Err(ShimError::Unavailable)));
    }
}
