//! The life of one call in docs/architecture.md, checked against the code: every step names
//! files that exist, no file is entered twice, the function a step names is defined in its file
//! and called from a file of an earlier step (the frames), and the communicator's files never
//! call back into a file the call has already passed through.
//!
//! CPU only: it reads the source files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One numbered step: its files (the paths before its first colon outside backticks, relative
/// ones in the crate of the last full path before them) and the first function it names after
/// that colon (`Type::name` counts as `name`), if any.
#[derive(Debug)]
struct Step {
    n: usize,
    files: Vec<String>,
    function: Option<String>,
}

fn steps() -> Vec<Step> {
    let text = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let section = text
        .split("\n## The life of one ncclAllReduce\n")
        .nth(1)
        .expect("docs/architecture.md has a section \"The life of one ncclAllReduce\"");
    let section = section.split("\n## ").next().unwrap();
    // Items: a line starting with "N. ", continued by indented lines.
    let mut items: Vec<(usize, String)> = Vec::new();
    for line in section.lines() {
        let t = line.trim_start();
        let number = t
            .split_once(". ")
            .and_then(|(d, _)| d.parse::<usize>().ok());
        match number {
            Some(n) if !line.starts_with(' ') => items.push((n, t.to_string())),
            _ if line.starts_with("   ") && !items.is_empty() => {
                let last = items.last_mut().unwrap();
                last.1.push(' ');
                last.1.push_str(t);
            }
            _ => {}
        }
    }
    items
        .into_iter()
        .map(|(n, body)| {
            // The head: up to the first ':' outside backticks.
            let mut tick = false;
            let split = body
                .char_indices()
                .find(|&(_, c)| {
                    if c == '`' {
                        tick = !tick;
                    }
                    c == ':' && !tick
                })
                .map_or(body.len(), |(i, _)| i);
            let (head, rest) = body.split_at(split);
            let ticks = |s: &str| -> Vec<String> {
                s.split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_string)
                    .collect()
            };
            let mut files: Vec<String> = Vec::new();
            for t in ticks(head).into_iter().filter(|t| t.ends_with(".rs")) {
                let path = if t.starts_with("crates/") || files.is_empty() {
                    t
                } else {
                    // `plan/arena.rs` after `crates/comm/src/plan/select.rs`: the same crate.
                    let last = files
                        .iter()
                        .rev()
                        .find(|f| f.starts_with("crates/"))
                        .unwrap();
                    let base = last.split("/src/").next().unwrap();
                    format!("{base}/src/{t}")
                };
                files.push(path);
            }
            let function = ticks(rest)
                .into_iter()
                .map(|t| t.rsplit("::").next().unwrap().to_string())
                .find(|t| {
                    t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        && t.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                });
            Step { n, files, function }
        })
        .collect()
}

/// A file's code without comments and without its test module.
fn code(path: &str) -> String {
    let text = std::fs::read_to_string(root().join(path))
        .unwrap_or_else(|e| panic!("{path}, named in the call's life: {e}"));
    let text = text.split("\n#[cfg(test)]\nmod tests").next().unwrap();
    text.lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

fn defines(code: &str, name: &str) -> bool {
    code.contains(&format!("fn {name}(")) || code.contains(&format!("fn {name}<"))
}

fn calls(code: &str, name: &str) -> bool {
    [".", "::", " ", "("]
        .iter()
        .any(|p| code.contains(&format!("{p}{name}(")))
}

#[test]
fn every_step_names_existing_files_each_entered_once() {
    let steps = steps();
    assert!(steps.len() >= 15, "{} steps", steps.len());
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s.n, i + 1, "steps are numbered in order");
        assert!(!s.files.is_empty(), "step {} names no file", s.n);
        for f in &s.files {
            code(f);
            if let Some(first) = seen.insert(f, s.n) {
                panic!("{f} is entered at step {first} and again at step {}", s.n);
            }
        }
    }
}

#[test]
fn each_named_function_is_defined_in_its_step_and_called_from_an_earlier_one() {
    let steps = steps();
    let mut checked = 0;
    for (i, s) in steps.iter().enumerate() {
        let Some(f) = &s.function else { continue };
        let here: Vec<String> = s.files.iter().map(|p| code(p)).collect();
        assert!(
            here.iter()
                .any(|c| defines(c, f) || c.contains(&format!("{f}!"))),
            "step {}: `{f}` is not defined in {:?}",
            s.n,
            s.files
        );
        if i > 0 {
            let earlier: Vec<String> = steps[..i]
                .iter()
                .flat_map(|e| e.files.iter())
                .map(|p| code(p))
                .collect();
            // A frame that wraps the earlier step's body: a macro of this step's file that an
            // earlier file invokes, and that calls the function.
            let by_macro = here.iter().any(|c| {
                calls(c, f)
                    && c.split("macro_rules! ").skip(1).any(|m| {
                        let name: String = m
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        earlier.iter().any(|e| e.contains(&format!("{name}!")))
                    })
            });
            assert!(
                by_macro || earlier.iter().any(|c| calls(c, f)),
                "step {}: no earlier step's file calls `{f}`",
                s.n
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "{checked} functions checked");
}

/// "A road without returns": a file of the communicator (`crates/comm/src/comm/`) on the path
/// calls no function that a file of an earlier step defines there.
#[test]
fn the_communicator_never_calls_back_into_a_file_it_passed() {
    let steps = steps();
    let comm: Vec<(usize, &str)> = steps
        .iter()
        .flat_map(|s| s.files.iter().map(move |f| (s.n, f.as_str())))
        .filter(|(_, f)| f.starts_with("crates/comm/src/comm/"))
        .collect();
    assert!(comm.len() >= 2);
    for (i, &(n, earlier)) in comm.iter().enumerate() {
        let defined: Vec<String> = code(earlier)
            .split("fn ")
            .skip(1)
            .filter_map(|s| {
                let name: String = s
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                (name.len() > 3).then_some(name)
            })
            .collect();
        for &(m, later) in &comm[i + 1..] {
            let later_code = code(later);
            for f in &defined {
                assert!(
                    !later_code.contains(&format!("self.{f}(")),
                    "{later} (step {m}) calls `{f}` of {earlier} (step {n})"
                );
            }
        }
    }
}
