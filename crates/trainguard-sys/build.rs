//! The C++ shim, compiled against the libtorch torch-sys links, and the link settings its
//! dependents need too (`link_args.rs`):
//!
//! - `cpp/shim.cpp` (allocator, versions, deterministic mode), `cpp/optim_kernels.cpp`
//!   (ATen's fused AdamW / SGD and multi-tensor norm, our fused CPU 8-bit AdamW and Adafactor),
//!   `cpp/loss_kernels.cpp` (the fused cross-entropy's autograd node), `cpp/norm_kernels.cpp`
//!   (the residual norm's), `cpp/llama_kernels.cpp` (SwiGLU's and RoPE's),
//!   `cpp/linear_kernels.cpp` (the linear layer's), `cpp/trace.cpp`
//!   (PyTorch's profiler, `metrics.trace`), `cpp/attention.cpp` (the variable-length
//!   attention of `data.document_mask`), `cpp/cuda_jit.cpp`
//!   (NVRTC and the CUDA driver, both opened at run time: no CUDA toolkit needed here),
//!   `cpp/cuda_emulation.cpp` (the `.cu` kernels compiled for the host, for tests without a
//!   GPU), `cpp/shim_cuda.cpp` (the allocator's history recorder; only against a libtorch
//!   with libtorch_cuda), `cpp/graph.cpp` (CUDA graphs through ATen's CUDAGraph; only with
//!   libtorch_cuda and the CUDA headers) and `cpp/dist.cpp` (c10d process groups) compiled against the same
//!   libtorch.
#[path = "link_args.rs"]
mod link_args;

fn main() {
    // torch-sys prints `cargo:libtorch_lib=…`; we see it because torch-sys is a direct dependency.
    let lib_dir = link_args::libtorch_lib();
    let torch_dir = lib_dir.parent().expect("libtorch lib dir has a parent").to_path_buf();
    let include = torch_dir.join("include");

    println!("cargo:rerun-if-changed=link_args.rs");
    println!("cargo:rerun-if-changed=cpp/shim.cpp");
    println!("cargo:rerun-if-changed=cpp/dist.cpp");
    println!("cargo:rerun-if-changed=cpp/optim_kernels.cpp");
    println!("cargo:rerun-if-changed=cpp/loss_kernels.cpp");
    println!("cargo:rerun-if-changed=cpp/trace.cpp");
    println!("cargo:rerun-if-changed=cpp/norm_kernels.cpp");
    println!("cargo:rerun-if-changed=cuda/norm_kernels.cu");
    println!("cargo:rerun-if-changed=cpp/llama_kernels.cpp");
    println!("cargo:rerun-if-changed=cuda/llama_kernels.cu");
    println!("cargo:rerun-if-changed=cpp/linear_kernels.cpp");
    println!("cargo:rerun-if-changed=cuda/linear_kernels.cu");
    println!("cargo:rerun-if-changed=cpp/guarded.h");
    println!("cargo:rerun-if-changed=cpp/node.h");
    println!("cargo:rerun-if-changed=cpp/cuda_jit.cpp");
    println!("cargo:rerun-if-changed=cpp/cuda_jit.h");
    println!("cargo:rerun-if-changed=cpp/cuda_emulation.cpp");
    println!("cargo:rerun-if-changed=cuda/optim_kernels.cu");
    println!("cargo:rerun-if-changed=cuda/loss_kernels.cu");
    println!("cargo:rerun-if-changed=cpp/shim_cuda.cpp");
    println!("cargo:rerun-if-changed=cpp/graph.cpp");
    println!("cargo:rerun-if-changed=cpp/attention.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH");

    let mut shim = cc::Build::new();
    shim.cpp(true)
        .file("cpp/shim.cpp")
        .file("cpp/optim_kernels.cpp")
        .file("cpp/loss_kernels.cpp")
        .file("cpp/trace.cpp")
        .file("cpp/norm_kernels.cpp")
        .file("cpp/llama_kernels.cpp")
        .file("cpp/linear_kernels.cpp")
        .file("cpp/cuda_jit.cpp")
        .file("cpp/cuda_emulation.cpp")
        .file("cpp/attention.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-Wno-unused-parameter")
        // sqrt without errno, so the optimizer kernels' loops vectorise (nothing reads errno);
        // no multiply-add contraction, so their AVX-512, AVX2 and x86-64 clones round alike and
        // a CPU's features never change the numbers (GCC contracts by default, even in ISO mode).
        .flag("-fno-math-errno")
        .flag("-ffp-contract=off")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false);
    // TG_SANITIZE=address: the shim, and with it the host emulation of our CUDA kernels, built
    // with AddressSanitizer, so that an emulated kernel reading or writing past a tensor fails its
    // test (on a GPU: an illegal address, or garbage). scripts/test/asan_kernels.sh runs it.
    println!("cargo:rerun-if-env-changed=TG_SANITIZE");
    match std::env::var("TG_SANITIZE").as_deref() {
        Err(_) | Ok("") => {}
        Ok("address") => {
            shim.flag("-fsanitize=address").flag("-fno-omit-frame-pointer");
            println!("cargo:rustc-link-lib=dylib=asan");
        }
        Ok(other) => panic!("TG_SANITIZE must be `address` (or unset), got `{other}`"),
    }
    shim.compile("trainguard_shim");

    // The CUDA headers (PyPI wheels nvidia-cuda-crt/-cccl, installed by scripts/setup.sh) beside
    // the torch wheel's NCCL headers: NCCL's process group and the CUDA graphs need them.
    let site = torch_dir.canonicalize().unwrap_or_else(|_| torch_dir.clone());
    let nvidia = site.parent().map(|p| p.join("nvidia")).unwrap_or_default();
    let (cuda_inc, nccl_inc) = (nvidia.join("cu13/include"), nvidia.join("nccl/include"));
    let cuda_headers =
        cuda_inc.join("crt/host_defines.h").exists() && cuda_inc.join("cuda_runtime_api.h").exists();

    // The allocator's history recorder and snapshot (`memory.snapshot_on_oom`) live in
    // libtorch_cuda: compiled only when it exists, so a CPU-only libtorch still builds and links.
    if lib_dir.join("libtorch_cuda.so").exists() {
        cc::Build::new()
            .cpp(true)
            .file("cpp/shim_cuda.cpp")
            .include(&include)
            .include(include.join("torch/csrc/api/include"))
            .flag("-std=c++17")
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .warnings(false)
            .compile("trainguard_shim_cuda");
        println!("cargo:rustc-cfg=tg_cuda_shim");
    }
    println!("cargo:rustc-check-cfg=cfg(tg_cuda_shim)");
    // CUDA graphs (`kernels.cuda_graphs`): ATen's CUDAGraph, whose header includes CUDA's.
    if lib_dir.join("libtorch_cuda.so").exists() && cuda_headers {
        cc::Build::new()
            .cpp(true)
            .file("cpp/graph.cpp")
            .include(&include)
            .include(include.join("torch/csrc/api/include"))
            .include(&cuda_inc)
            .flag("-std=c++17")
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .warnings(false)
            .compile("trainguard_graph");
        println!("cargo:rustc-cfg=tg_cuda_graphs");
    }
    println!("cargo:rustc-check-cfg=cfg(tg_cuda_graphs)");

    // c10d (process groups). ProcessGroupGloo.hpp needs gloo's headers, which the torch wheel
    // does not ship: Debian's libgloo-dev provides them (scripts/setup.sh installs it).
    let mut dist = cc::Build::new();
    dist.cpp(true)
        .file("cpp/dist.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("USE_C10D_GLOO", None)
        .warnings(false);
    // NCCL's process group needs the CUDA headers and NCCL's; without them the build has Gloo only.
    if cuda_headers && nccl_inc.join("nccl.h").exists() {
        dist.include(&cuda_inc).include(&nccl_inc).define("USE_C10D_NCCL", None).define("TG_WITH_NCCL", None);
        println!("cargo:rustc-cfg=tg_nccl");
    } else {
        println!(
            "cargo:warning=NCCL process groups not built: CUDA/NCCL headers not found under {}",
            nvidia.display()
        );
    }
    println!("cargo:rustc-check-cfg=cfg(tg_nccl)");
    dist.compile("trainguard_dist");

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    for name in ["torch", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={name}");
    }
    link_args::emit();
}
