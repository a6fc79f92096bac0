//! Gives the library the SONAME of NCCL, so that programs linked against `libnccl.so.2` and
//! `dlopen("libnccl.so.2")` both bind to it when it is preloaded or found first.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
}
