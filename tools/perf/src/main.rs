//! `flashcomm-perf`: see the library documentation and `docs/perf-tool.md`.

fn main() {
    // A rank process of the process modes holds one rank: it keeps the environment its launcher
    // gave it.
    if std::env::var_os(flashcomm_perf::app::PROCESS_ENV).is_none() {
        flashcomm_perf::ffi::use_all_hardware_queues();
    }
    let argv: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(flashcomm_perf::app::main_with(&argv));
}
