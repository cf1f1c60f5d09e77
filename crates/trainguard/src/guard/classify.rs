//! The one place that decides whether a libtorch error means "out of memory" (and, beside it,
//! which op `deterministic: true` refused). tch loses the C++ exception type
//! (c10::OutOfMemoryError), so this reads the message.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// An allocation failed; the size asked for when the message says it.
    OutOfMemory {
        requested_bytes: Option<u64>,
    },
    Other,
}

/// Messages of allocation failures: the CUDA caching allocator, raw CUDA, the CPU allocator,
/// and cuBLAS/cuDNN workspace allocations. `CUDNN_STATUS_NOT_SUPPORTED`, which some libraries
/// also treat as OOM, is deliberately not here: it is usually a real unsupported configuration.
/// `std::bad_alloc`: a host allocation inside libtorch that is not the tensor allocator's (a
/// kernel's scratch vector, say) failing under the same memory cap.
const OOM_MARKERS: [&str; 7] = [
    "CUDA out of memory",
    "CUDA error: out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "std::bad_alloc",
    crate::model::HOST_ALLOCATION_FAILED,
];

pub fn classify(message: &str) -> ErrorKind {
    if OOM_MARKERS.iter().any(|m| message.contains(m)) {
        ErrorKind::OutOfMemory { requested_bytes: requested_bytes(message) }
    } else {
        ErrorKind::Other
    }
}

/// With `deterministic: true`, the op libtorch refused, from its messages: an op without a
/// deterministic variant (`alertNotDeterministic`: "<op> does not have a deterministic
/// implementation, but you set 'torch.use_deterministic_algorithms(True)'…"), cuBLAS without a
/// deterministic workspace setting, and the memory-efficient attention backward asked for key
/// splits.
pub fn nondeterministic_op(message: &str) -> Option<String> {
    const NO_IMPL: &str = " does not have a deterministic implementation";
    if let Some(at) = message.find(NO_IMPL) {
        let op = message[..at]
            .split_whitespace()
            .last()
            .unwrap_or("an op")
            .trim_matches(|c: char| c == '`' || c == '\'' || c == '"');
        return Some(format!("`{op}`"));
    }
    if message.contains("this operation is not deterministic because it uses CuBLAS") {
        return Some("cuBLAS with CUBLAS_WORKSPACE_CONFIG unset or not :4096:8 / :16:8".into());
    }
    if message.contains("makes the algorithm non-deterministic, and pytorch's deterministic mode is enabled")
    {
        return Some("memory-efficient attention backward with key splits".into());
    }
    None
}

/// "Tried to allocate 2.00 GiB" (CUDA) or "you tried to allocate 40000000000 bytes" (CPU).
fn requested_bytes(message: &str) -> Option<u64> {
    let lower = message.to_ascii_lowercase();
    let at = lower.find("tried to allocate ")? + "tried to allocate ".len();
    let mut words = message[at..].split_whitespace();
    let number: f64 = words.next()?.parse().ok()?;
    let unit = words.next().unwrap_or("bytes").trim_end_matches(['.', ',', ';', ')']);
    let mult = match unit {
        "bytes" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024f64.powi(4),
        _ => return None,
    };
    Some((number * mult).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Texts as libtorch 2.x prints them (the CPU one captured on this project's build machine
    // under `ulimit -v`; the CUDA ones from PyTorch's c10 sources and user reports).
    const CUDA_CACHING: &str = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory 75.50 GiB is allocated by PyTorch, and 1.98 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\nException raised from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1353 (most recent call first):";
    const CUDA_RAW: &str = "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n";
    const CPU: &str = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)\nException raised from alloc_cpu at /pytorch/c10/core/impl/alloc_cpu.cpp:127 (most recent call first):";
    // Captured on this project's build machine: a run under `memory.limit=20MiB` on a loaded CPU.
    const BAD_ALLOC: &str = "Internal torch error: std::bad_alloc";
    const CUBLAS: &str = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`";
    const CUDNN: &str = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED\nException raised from operator() at /pytorch/aten/src/ATen/native/cudnn/Conv_v8.cpp:919";
    // Our NVRTC kernels' driver calls (crates/trainguard-sys/cpp/cuda_jit.cpp, check_cu) on CUDA_ERROR_OUT_OF_MEMORY.
    const DRIVER: &str = "cuModuleLoadData: CUDA error: out of memory, CUDA driver error 2 (out of memory)";

    #[test]
    fn every_allocation_failure_is_oom_with_its_size() {
        assert_eq!(classify(CUDA_CACHING), ErrorKind::OutOfMemory { requested_bytes: Some(2 << 30) });
        assert_eq!(classify(CPU), ErrorKind::OutOfMemory { requested_bytes: Some(40_000_000_000) });
        assert_eq!(classify(CUDA_RAW), ErrorKind::OutOfMemory { requested_bytes: None });
        assert_eq!(classify(CUBLAS), ErrorKind::OutOfMemory { requested_bytes: None });
        assert_eq!(classify(CUDNN), ErrorKind::OutOfMemory { requested_bytes: None });
        assert_eq!(classify(DRIVER), ErrorKind::OutOfMemory { requested_bytes: None });
        assert_eq!(
            classify("cuLaunchKernel: CUDA driver error 700 (an illegal memory access was encountered)"),
            ErrorKind::Other
        );
        assert_eq!(classify(BAD_ALLOC), ErrorKind::OutOfMemory { requested_bytes: None });
        let mib = "CUDA out of memory. Tried to allocate 20.50 MiB. GPU 0 has a total capacity of 15.77 GiB";
        assert_eq!(classify(mib), ErrorKind::OutOfMemory { requested_bytes: Some(21_495_808) });
    }

    /// Captured from this project's venv (torch 2.11.0, CPU): `torch.use_deterministic_algorithms(True)`
    /// then `torch.zeros(10).put_(torch.tensor([1, 2]), torch.tensor([1., 2.]))`; tch prefixes
    /// "Internal torch error: ".
    const NOT_DETERMINISTIC: &str = "Internal torch error: put_ does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, or you can use the 'warn_only=True' option, if that's acceptable for your application. You can also file an issue at https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic support for this operation.";
    // PyTorch's Context.cpp (checkCuBLASConfigDeterministic) and attention_backward.cu texts.
    const CUBLAS_NOT_DETERMINISTIC: &str = "Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or `at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because it uses CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must set an environment variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 or CUBLAS_WORKSPACE_CONFIG=:16:8.";
    const MEM_EFFICIENT_SPLITS: &str = "Using `num_splits_key > 1` makes the algorithm non-deterministic, and pytorch's deterministic mode is enabled";

    #[test]
    fn a_refused_nondeterministic_op_is_named_and_is_not_an_oom() {
        assert_eq!(nondeterministic_op(NOT_DETERMINISTIC).as_deref(), Some("`put_`"));
        assert_eq!(classify(NOT_DETERMINISTIC), ErrorKind::Other);
        let cuda = NOT_DETERMINISTIC.replace("put_", "index_add_cuda_");
        assert_eq!(nondeterministic_op(&cuda).as_deref(), Some("`index_add_cuda_`"));
        assert!(nondeterministic_op(CUBLAS_NOT_DETERMINISTIC).unwrap().contains("CUBLAS_WORKSPACE_CONFIG"));
        assert!(nondeterministic_op(MEM_EFFICIENT_SPLITS).unwrap().contains("memory-efficient attention"));
        assert_eq!(nondeterministic_op(CUDA_CACHING), None);
        assert_eq!(nondeterministic_op("shape '[2, 3]' is invalid for input of size 5"), None);
    }

    #[test]
    fn other_errors_are_not_swallowed() {
        for msg in [
            "index out of range in self",
            "CUDA error: device-side assert triggered",
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
            "mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)",
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
            "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
        ] {
            assert_eq!(classify(msg), ErrorKind::Other, "{msg}");
        }
    }
}
