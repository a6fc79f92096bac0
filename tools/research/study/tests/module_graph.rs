//! The study's modules import each other without a cycle (read from the `crate::` paths of
//! `src/*.rs`, comments left out, tests included).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut g = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_str().unwrap().to_string();
        if name == "lib" || name == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        let deps = code
            .split("crate::")
            .skip(1)
            .map(|s| {
                s.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .filter(|d| *d != name)
            .collect();
        g.insert(name, deps);
    }
    g
}

/// A cycle through `at`, if one is reachable from it.
fn cycle(
    g: &BTreeMap<String, BTreeSet<String>>,
    at: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(i) = path.iter().position(|p| p == at) {
        return Some(path[i..].to_vec());
    }
    if done.contains(at) {
        return None;
    }
    path.push(at.to_string());
    for d in g.get(at).into_iter().flatten() {
        if let Some(c) = cycle(g, d, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(at.to_string());
    None
}

#[test]
fn the_modules_import_each_other_without_a_cycle() {
    let g = graph();
    assert!(g.len() >= 10, "{} modules", g.len());
    let mut done = BTreeSet::new();
    for m in g.keys() {
        if let Some(c) = cycle(&g, m, &mut Vec::new(), &mut done) {
            panic!("import cycle: {}", c.join(" -> "));
        }
    }
}

#[test]
fn the_cycle_finder_finds_one() {
    let g: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "c"), ("c", "a")]
        .into_iter()
        .map(|(x, y)| (x.to_string(), BTreeSet::from([y.to_string()])))
        .collect();
    assert!(cycle(&g, "a", &mut Vec::new(), &mut BTreeSet::new()).is_some());
}
