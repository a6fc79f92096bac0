//! The tables of docs/perf.md are generated from committed flashcomm-perf JSON by
//! `ci/perf-doc.py`: `--check` passes (every table and plot matches its JSON).
//! `ci/perf-host-table.py` agrees with it on a committed host-transport run (every row it prints
//! is in docs/perf.md verbatim), and its A/B form joins two committed runs row by row. Needs
//! `python3` (as the wheel's test does).

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(root().join("ci/perf-host-table.py"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("python3 runs ci/perf-host-table.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_table_and_plot_of_perf_md_matches_its_json() {
    let out = Command::new("python3")
        .arg(root().join("ci/perf-doc.py"))
        .arg("--check")
        .current_dir(root())
        .output()
        .expect("python3 runs ci/perf-doc.py");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

const RUN: &str = "docs/results/2026-12-04-h200-18177d6/ar2.json";
const ONESHOT: &str = "docs/results/2026-12-04-h200-18177d6/ar2-oneshot.json";

#[test]
fn the_table_of_a_committed_run_is_the_one_in_perf_md() {
    let table = script(&["--launch", "graph", RUN]);
    let doc = std::fs::read_to_string(root().join("docs/perf.md")).unwrap();
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| ")).collect();
    // The header and the seven sizes, 64 KiB to 256 MiB.
    assert_eq!(rows.len(), 8, "{table}");
    for row in rows {
        assert!(doc.contains(row), "not in docs/perf.md: {row}");
    }
    assert!(table.contains("every row #wrong 0"), "{table}");
}

#[test]
fn two_runs_join_row_by_row() {
    let ab = script(&[
        "--ab",
        "--launch",
        "graph",
        RUN,
        ONESHOT,
        "--labels",
        "auto,oneshot",
    ]);
    // The 4-bit AllReduce at 256 MiB: two-step, then forced one-shot (docs/experiments.md).
    let row = ab
        .lines()
        .find(|l| l.starts_with("| flashcomm-q4 | graph | 256 MiB |"))
        .unwrap_or_else(|| panic!("{ab}"));
    assert!(row.contains("| 6174.1 | 5705.2 | 0.92 |"), "{row}");
    assert!(
        row.contains("twoshot/block/g66x256 / oneshot/block/g66x256"),
        "{row}"
    );
}
