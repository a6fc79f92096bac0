//! The shipped modules contain exactly the catalogue's kernels: no test, benchmark or dead kernel
//! ships, and every kernel the host may launch exists.
//!
//! Run with `cargo test -p flashcomm-kernels --features gpu` on a machine with a CUDA device.
#![cfg(feature = "gpu")]

use flashcomm_kernels::{Kernels, catalog};

#[test]
fn shipped_kernels_are_the_catalogue() {
    let dev = flashcomm_gpu::Device::open(0).expect("a CUDA device");
    let _ctx = dev.activate().expect("context");
    let k = Kernels::for_context(dev.context()).expect("the product's modules load");
    let embedded = k.kernel_names().expect("kernel names");
    let mut expected: Vec<String> = (0..catalog::COUNT)
        .map(|i| {
            let mut s = String::new();
            catalog::name(i, &mut s);
            s
        })
        .collect();
    expected.sort();
    println!("the shipped modules embed {} kernels:", embedded.len());
    for n in &embedded {
        println!("  {n}");
    }
    assert_eq!(embedded, expected);
}
