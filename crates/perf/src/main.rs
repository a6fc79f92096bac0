//! `flashcomm-perf`: see the library documentation and `docs/perf.md`.

fn main() {
    flashcomm_perf::ffi::use_all_hardware_queues();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(flashcomm_perf::app::main_with(&argv));
}
