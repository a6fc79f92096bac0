//! Rules the crates share are declared once (docs/architecture.md, "Where each word is
//! declared"): this test looks through every Rust source of the tree for restatements of the
//! ones that were once copied (a list of a collective's exports, the bytes of its buffers, the
//! one-step quantized collectives and their mapping, the spike selection).

use std::path::{Path, PathBuf};

use flashcomm_codec::Collective;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir` (target folders and the toolchain left out).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap();
        if p.is_dir() {
            if !matches!(name, "target" | ".toolchain" | ".git" | "gpub") {
                sources(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// (file relative to the root, line number, line) of every line that `bad` flags, outside the
/// files `home` names (the rule's declaration, generated lists).
fn restatements(bad: impl Fn(&str) -> bool, home: &[&str]) -> Vec<String> {
    let root = root();
    let mut files = Vec::new();
    for d in ["crates", "tools"] {
        sources(&root.join(d), &mut files);
    }
    assert!(files.len() > 50, "{} sources", files.len());
    let mut found = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&root).unwrap().to_str().unwrap().to_string();
        if home.contains(&rel.as_str()) || rel == "crates/xtask/tests/rules_once.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, line) in text.lines().enumerate() {
            if bad(line) {
                found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    found
}

fn assert_once(what: &str, bad: impl Fn(&str) -> bool, home: &[&str]) {
    let found = restatements(bad, home);
    assert!(
        found.is_empty(),
        "{what} is restated outside {home:?}:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_list_of_a_collectives_exports_outside_the_codec() {
    let names: Vec<String> = Collective::ALL
        .iter()
        .flat_map(|k| k.exports())
        .map(|e| format!("\"{e}\","))
        .collect();
    // Two list entries in a row (a lone name is a test's example).
    let root = root();
    let mut files = Vec::new();
    for d in ["crates", "tools"] {
        sources(&root.join(d), &mut files);
    }
    let mut found = Vec::new();
    let home = [
        "crates/codec/src/collective.rs",
        // The generated list of every function of the API.
        "crates/nccl-sys/src/functions.rs",
    ];
    for f in files {
        let rel = f.strip_prefix(&root).unwrap().to_str().unwrap().to_string();
        if home.contains(&rel.as_str()) {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, w) in lines.windows(2).enumerate() {
            if w.iter().all(|l| names.iter().any(|n| l.trim() == n)) {
                found.push(format!("{rel}:{}: {}", i + 1, w[0].trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a list of collective exports outside {home:?}:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_buffer_sizes_of_a_collective_outside_the_codec() {
    assert_once(
        "the bytes of a collective's buffers",
        |l| {
            let t = l.trim_start();
            (t.starts_with("Collective::ReduceScatter => (")
                || t.starts_with("Collective::AllGather => (")
                || t.starts_with("Collective::AlltoAll => ("))
                && t.contains(',')
                && (t.ends_with("),") || t.ends_with(')'))
                && !t.contains('"')
        },
        &["crates/codec/src/collective.rs"],
    );
}

#[test]
fn the_one_step_quantized_collectives_are_declared_once() {
    assert_once(
        "QuantOp or its mapping from Collective",
        |l| l.contains("enum QuantOp") || l.contains("=> Some(QuantOp::"),
        &["crates/codec/src/collective.rs"],
    );
}

#[test]
fn the_spike_selection_is_the_codecs() {
    assert_once(
        "the spike selection",
        |l| l.contains("want_max"),
        &["crates/codec/src/codec.rs"],
    );
}

#[test]
fn the_search_finds_what_it_looks_for() {
    // The search itself reaches the declarations (else every test above would pass vacuously).
    let found = restatements(|l| l.contains("enum QuantOp"), &[]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("crates/codec/src/collective.rs:"));
}
