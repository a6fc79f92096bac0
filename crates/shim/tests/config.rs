//! Configuration and logging, each scenario in a child process with its own environment.

mod common;

use common::*;

fn ours() -> Nccl {
    Nccl::open(&cdylib())
}

fn real() -> String {
    real_lib().to_str().unwrap().to_string()
}

#[test]
fn a_bad_value_is_reported_and_forces_passthrough() {
    let name = "a_bad_value_is_reported_and_forces_passthrough";
    if is_child(name) {
        let n = ours();
        // The job keeps running: calls are forwarded to NCCL.
        assert_eq!(n.version().0, SUCCESS, "{}", n.last_error());
        let cfg = n.config_string();
        assert!(
            cfg.contains("FLASHCOMM_PROTO=auto"),
            "the bad variable keeps its default: {cfg}"
        );
        assert!(cfg.contains("passthrough=forced: invalid configuration: FLASHCOMM_PROTO=\"fast\" is not valid; allowed: `auto`, `ll`, `block`"), "{cfg}");
        assert!(
            cfg.contains("FLASHCOMM_MAX_BYTES=\"lots\" is not valid"),
            "{cfg}"
        );
        return;
    }
    let out = run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("FLASHCOMM_PROTO", "fast"),
            ("FLASHCOMM_MAX_BYTES", "lots"),
        ],
        &[],
    );
    let err = stderr(&out);
    assert!(
        err.contains(
            "FLASHCOMM WARN FLASHCOMM_PROTO=\"fast\" is not valid; allowed: `auto`, `ll`, `block`"
        ),
        "{err}"
    );
    assert!(
        err.contains("flashcomm forwards every call to NCCL unchanged"),
        "{err}"
    );
}

#[test]
fn good_values_are_taken_and_disable_is_reported() {
    let name = "good_values_are_taken_and_disable_is_reported";
    if is_child(name) {
        let cfg = ours().config_string();
        assert!(cfg.contains("FLASHCOMM_QUANT_BITS=4\n"), "{cfg}");
        assert!(cfg.contains("FLASHCOMM_ARENA_BYTES=128M\n"), "{cfg}");
        assert!(cfg.contains("FLASHCOMM_DISABLE=1\n"), "{cfg}");
        assert!(cfg.ends_with("passthrough=FLASHCOMM_DISABLE\n"), "{cfg}");
        return;
    }
    run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_ARENA_BYTES", "131072K"),
            ("FLASHCOMM_DISABLE", "yes"),
        ],
        &[],
    );
}

#[test]
fn a_bad_log_filter_forces_passthrough() {
    let name = "a_bad_log_filter_forces_passthrough";
    if is_child(name) {
        let cfg = ours().config_string();
        assert!(
            cfg.contains("passthrough=forced: invalid configuration: FLASHCOMM_LOG="),
            "{cfg}"
        );
        return;
    }
    let out = run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("FLASHCOMM_LOG", "flashcomm=loud"),
        ],
        &[],
    );
    assert!(stderr(&out).contains("FLASHCOMM WARN FLASHCOMM_LOG=\"flashcomm=loud\" is not valid"));
}

#[test]
fn unknown_variables_are_warned_about() {
    let name = "unknown_variables_are_warned_about";
    if is_child(name) {
        assert!(ours().config_string().ends_with("passthrough=no\n"));
        return;
    }
    let out = run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("FLASHCOMM_QUANT_BIT", "4"),
        ],
        &[],
    );
    assert!(
        stderr(&out).contains("FLASHCOMM WARN FLASHCOMM_QUANT_BIT is not a flashcomm variable")
    );
}

/// `host:pid:tid [dev] FLASHCOMM LEVEL message`.
fn assert_nccl_format(line: &str, level: &str) {
    let (prefix, rest) = line
        .split_once(" [")
        .unwrap_or_else(|| panic!("no device in {line:?}"));
    let parts: Vec<&str> = prefix.split(':').collect();
    assert_eq!(parts.len(), 3, "{line:?}");
    assert!(!parts[0].is_empty());
    assert!(
        parts[1].parse::<u32>().is_ok() && parts[2].parse::<u32>().is_ok(),
        "{line:?}"
    );
    let (dev, rest) = rest.split_once("] ").unwrap();
    assert!(dev.parse::<i32>().is_ok(), "{line:?}");
    assert!(rest.starts_with(&format!("FLASHCOMM {level} ")), "{line:?}");
}

#[test]
fn nccl_debug_info_writes_nccl_style_lines() {
    let name = "nccl_debug_info_writes_nccl_style_lines";
    if is_child(name) {
        assert_eq!(ours().version().0, SUCCESS);
        return;
    }
    let out = run_child(
        name,
        &[("FLASHCOMM_NCCL_LIB", &real()), ("NCCL_DEBUG", "INFO")],
        &[],
    );
    let err = stderr(&out);
    let line = err
        .lines()
        .find(|l| l.contains("using the real NCCL"))
        .unwrap_or_else(|| panic!("{err}"));
    assert_nccl_format(line, "INFO");
    assert!(line.contains(&format!(":{}:", std::process::id())) || !line.is_empty());
    let env_line = err
        .lines()
        .find(|l| l.contains("NCCL_DEBUG set by environment"))
        .expect("ENV");
    assert_nccl_format(env_line, "INFO");
    assert!(err.contains("FLASHCOMM INFO flashcomm 0.1.0 (NCCL API 2.32.3) forwarding to NCCL"));
}

#[test]
fn subsystems_select_lines() {
    let name = "subsystems_select_lines";
    if is_child(name) {
        let n = ours();
        assert_eq!(n.version().0, SUCCESS);
        // A failure of flashcomm's own (a communicator it does not know): one WARN line.
        assert_eq!(n.stats(0x40).0, INVALID_ARGUMENT);
        return;
    }
    // INIT is not selected: the library choice (INIT, INFO) is not logged; warnings always are.
    let out = run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("NCCL_DEBUG", "INFO"),
            ("NCCL_DEBUG_SUBSYS", "^INIT"),
        ],
        &[],
    );
    let err = stderr(&out);
    assert!(!err.contains("using the real NCCL"), "{err}");
    assert!(
        err.contains("NCCL_DEBUG_SUBSYS set by environment"),
        "ENV is still selected: {err}"
    );
    let warn = err
        .lines()
        .find(|l| l.contains("is not known to flashcomm"))
        .expect("warning");
    assert_nccl_format(warn, "WARN");
}

#[test]
fn nccl_debug_none_is_silent_and_version_prints_the_banner() {
    let name = "nccl_debug_none_is_silent_and_version_prints_the_banner";
    if is_child(name) {
        let n = ours();
        assert_eq!(n.version().0, SUCCESS);
        // A failure of flashcomm's own (a communicator it does not know): one WARN line.
        assert_eq!(n.stats(0x40).0, INVALID_ARGUMENT);
        return;
    }
    let out = run_child(
        name,
        &[("FLASHCOMM_NCCL_LIB", &real()), ("NCCL_DEBUG", "NONE")],
        &[],
    );
    assert!(!stderr(&out).contains("FLASHCOMM"), "{}", stderr(&out));
    let out = run_child(
        name,
        &[("FLASHCOMM_NCCL_LIB", &real()), ("NCCL_DEBUG", "VERSION")],
        &[],
    );
    let err = stderr(&out);
    assert!(
        err.contains("FLASHCOMM INFO flashcomm 0.1.0 (NCCL API 2.32.3)"),
        "{err}"
    );
    assert!(
        err.contains("FLASHCOMM WARN flashcommGetStats: communicator 0x40 is not known"),
        "{err}"
    );
    assert!(!err.contains("using the real NCCL"), "{err}");
}

#[test]
fn log_files_expand_host_and_pid() {
    let name = "log_files_expand_host_and_pid";
    if is_child(name) {
        let n = ours();
        // A failure of flashcomm's own (a communicator it does not know): one WARN line.
        assert_eq!(n.stats(0x40).0, INVALID_ARGUMENT);
        println!("CHILD_PID={}", std::process::id());
        return;
    }
    let dir = scratch("logs");
    // FLASHCOMM_LOG_FILE: exactly that file; FLASHCOMM_LOG overrides NCCL_DEBUG.
    let pattern = dir.join("fc.%h.%p.log");
    let out = run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("FLASHCOMM_LOG_FILE", pattern.to_str().unwrap()),
            ("FLASHCOMM_LOG", "flashcomm::call=warn,flashcomm::env=off"),
            ("NCCL_DEBUG", "TRACE"),
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid = stdout
        .lines()
        .find_map(|l| l.split("CHILD_PID=").nth(1))
        .expect("pid")
        .trim()
        .to_string();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let host = host.trim().split('.').next().unwrap().to_string();
    let file = dir.join(format!("fc.{host}.{pid}.log"));
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert!(
        !stderr(&out).contains("FLASHCOMM"),
        "lines go to the file only"
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert_nccl_format(lines[0], "WARN");
    assert!(lines[0].starts_with(&format!("{host}:{pid}:")));

    // NCCL_DEBUG_FILE: our lines go next to NCCL's, in <name>.flashcomm.
    let nccl_file = dir.join("nccl.%p.log");
    let out = run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", &real()),
            ("NCCL_DEBUG_FILE", nccl_file.to_str().unwrap()),
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid = stdout
        .lines()
        .find_map(|l| l.split("CHILD_PID=").nth(1))
        .unwrap()
        .trim()
        .to_string();
    let ours = dir.join(format!("nccl.{pid}.log.flashcomm"));
    let text = std::fs::read_to_string(&ours).unwrap_or_else(|e| panic!("{}: {e}", ours.display()));
    assert!(
        text.contains("FLASHCOMM WARN flashcommGetStats: communicator 0x40 is not known"),
        "{text}"
    );
}
