//! The link arguments every crate that links a binary against libtorch needs, and that a
//! dependency's build script cannot give it (`cargo:rustc-link-arg` reaches only the package's
//! own binaries and tests): included by the build script of each crate of the workspace.
//!
//! - `-Wl,-rpath,<torch lib>` so `trainguard` and the test binaries start without
//!   `LD_LIBRARY_PATH`;
//! - `libtorch_cuda` / `libc10_cuda` linked with `--no-as-needed`: nothing in Rust calls them
//!   directly, so a plain link would drop them and CUDA would stay invisible on GPU machines
//!   ("Cannot initialize CUDA without ATen_cuda library").
use std::path::PathBuf;

/// torch-sys prints `cargo:libtorch_lib=…`; a crate sees it as DEP_TCH_LIBTORCH_LIB when torch-sys
/// is its direct dependency.
pub fn libtorch_lib() -> PathBuf {
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => {
            eprintln!(
                "torch-sys did not report its libtorch lib dir (DEP_TCH_LIBTORCH_LIB); see LIBTORCH.md"
            );
            std::process::exit(1)
        }
    }
}

pub fn emit() {
    let lib_dir = libtorch_lib();
    // The `-as-needed` link modifier is nightly-only, so the CUDA libraries go to the linker
    // directly, wrapped in --no-as-needed (order inside one -Wl is kept).
    let cuda: Vec<String> = ["torch_cuda", "c10_cuda"]
        .iter()
        .filter(|n| lib_dir.join(format!("lib{n}.so")).exists())
        .map(|n| format!("-l{n}"))
        .collect();
    if !cuda.is_empty() {
        println!(
            "cargo:rustc-link-arg=-Wl,--no-as-needed,-L{},{},--as-needed",
            lib_dir.display(),
            cuda.join(",")
        );
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
}
