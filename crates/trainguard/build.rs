//! Links this crate's binaries and tests against libtorch the way `trainguard-sys` does (an
//! rpath, the CUDA libraries kept): see `crates/trainguard-sys/link_args.rs`.
#[path = "../trainguard-sys/link_args.rs"]
mod link_args;

fn main() {
    println!("cargo:rerun-if-changed=../trainguard-sys/link_args.rs");
    link_args::emit();
}
