//! The shim's module graph: read from the `crate::` paths of `src/**` (test modules left out),
//! it must have no cycle and must equal the table in `src/lib.rs` ("may import"), whose rows
//! run from the top (the exports) to the bottom (the call types), each importing only rows below
//! it. Items of modules other than the C API (`exports::ext`) are `pub(crate)`.
//!
//! CPU only: it reads the source files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, with its module path (`calls/os.rs` is `calls::os`,
/// `calls/mod.rs` is `calls`, `lib.rs` is the empty root).
fn module_files(dir: &Path, prefix: &str, out: &mut Vec<(String, PathBuf)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let name = p.file_stem().unwrap().to_str().unwrap().to_string();
        let join = |n: &str| {
            if prefix.is_empty() {
                n.to_string()
            } else {
                format!("{prefix}::{n}")
            }
        };
        if p.is_dir() {
            module_files(&p, &join(&name), out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let module = match name.as_str() {
                "lib" if prefix.is_empty() => String::new(),
                "mod" => prefix.to_string(),
                _ => join(&name),
            };
            out.push((module, p));
        }
    }
}

/// The code of a file without comments and without its `#[cfg(test)] mod tests` module (tests
/// may reach anywhere).
fn code_of(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim();
        if t == "#[cfg(test)]"
            && lines[i + 1..]
                .iter()
                .map(|l| l.trim())
                .find(|l| !l.is_empty())
                .is_some_and(|l| {
                    l.starts_with("mod tests") || l.starts_with("pub(crate) mod tests")
                })
        {
            break;
        }
        let code = line.split("//").next().unwrap_or_default();
        out.push_str(code);
        out.push('\n');
    }
    out
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Parses a path starting at `s` (after `crate::`): `a::b::c`, or a group `a::{b, c::d}`, into
/// full paths pushed on `out` (each prefixed with `prefix`). Returns the bytes consumed.
fn parse_path(s: &str, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let mut segs = prefix.to_vec();
    let mut i = 0;
    let b = s.as_bytes();
    loop {
        while i < b.len() && (b[i] as char).is_whitespace() {
            i += 1;
        }
        if i < b.len() && b[i] == b'{' {
            i += 1;
            loop {
                while i < b.len() && (b[i] == b',' || (b[i] as char).is_whitespace()) {
                    i += 1;
                }
                if i >= b.len() || b[i] == b'}' {
                    return i + 1;
                }
                i += parse_path(&s[i..], &segs, out);
            }
        }
        let start = i;
        while i < b.len() && is_ident_char(b[i] as char) {
            i += 1;
        }
        if i > start {
            segs.push(s[start..i].to_string());
        }
        if s[i..].starts_with("::") {
            i += 2;
            continue;
        }
        out.push(segs);
        // Skip a rename or glob (`as x`, `*`) up to the end of this item.
        while i < b.len() && !matches!(b[i], b',' | b'}' | b';' | b'(' | b')' | b'.') {
            if b[i] == b'{' {
                break;
            }
            i += 1;
        }
        return i;
    }
}

/// Every `crate::` path of `code` (also `$crate::` in macros).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(pos) = rest.find("crate::") {
        let before = rest[..pos].chars().next_back();
        let after = &rest[pos + "crate::".len()..];
        if before.is_none_or(|c| !is_ident_char(c)) {
            let n = parse_path(after, &[], &mut out);
            rest = &after[n.min(after.len())..];
        } else {
            rest = after;
        }
    }
    out
}

/// The longest module of `modules` that `path` names (a path may go on into an item).
fn resolve(path: &[String], modules: &BTreeSet<String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// The shim's module graph from the sources; also the parent modules (`calls`, `exports`),
/// which only declare their children.
fn shim_graph() -> (Graph, BTreeSet<String>) {
    let mut files = Vec::new();
    module_files(&src_dir(), "", &mut files);
    let all: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let parents: BTreeSet<String> = files
        .iter()
        .filter(|(_, p)| p.file_name().unwrap() == "mod.rs")
        .map(|(m, _)| m.clone())
        .collect();
    let mut graph = Graph::new();
    for (module, path) in &files {
        if module.is_empty() || parents.contains(module) {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(path).unwrap());
        assert!(
            !code.contains("super::"),
            "{}: write `crate::` paths instead of `super::`, so the graph can be read",
            path.display()
        );
        let mut deps = BTreeSet::new();
        for p in crate_paths(&code) {
            let target = resolve(&p, &all).unwrap_or_else(|| {
                panic!(
                    "{}: `crate::{}` names no module",
                    path.display(),
                    p.join("::")
                )
            });
            assert!(
                !parents.contains(&target),
                "{}: `crate::{}` names a parent module; import its child",
                path.display(),
                p.join("::")
            );
            if &target != module {
                deps.insert(target);
            }
        }
        graph.insert(module.clone(), deps);
    }
    (graph, parents)
}

/// A cycle of `g`, if it has one, as the list of its modules.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        OnPath,
        Done,
    }
    fn visit(
        g: &Graph,
        n: &str,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        marks.insert(n.to_string(), Mark::OnPath);
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            match marks.get(d).copied().unwrap_or(Mark::New) {
                Mark::OnPath => {
                    let start = path.iter().position(|p| p == d).unwrap();
                    let mut cycle = path[start..].to_vec();
                    cycle.push(d.clone());
                    return Some(cycle);
                }
                Mark::New => {
                    if let Some(c) = visit(g, d, marks, path) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        path.pop();
        marks.insert(n.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for n in g.keys() {
        if marks.get(n).copied().unwrap_or(Mark::New) == Mark::New
            && let Some(c) = visit(g, n, &mut marks, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

type Rows = Vec<(String, BTreeSet<String>)>;

/// Table rows (`| `module` | owns | `a`, `b` |`, the prefix already cut off): module and what it
/// may import ("—" or "nothing": none).
fn rows<'a>(lines: impl Iterator<Item = &'a str>) -> Rows {
    lines
        .map(|row| {
            let cells: Vec<&str> = row.trim_end_matches(" |").split(" | ").collect();
            let module = cells[0].trim_end_matches('`').to_string();
            let imports = cells
                .last()
                .unwrap()
                .split(", ")
                .filter(|c| *c != "—" && *c != "nothing")
                .map(|c| c.trim_matches('`').to_string())
                .collect();
            (module, imports)
        })
        .collect()
}

/// The rows of the module table of `src/lib.rs`, top to bottom.
fn documented() -> Rows {
    let lib = std::fs::read_to_string(src_dir().join("lib.rs")).unwrap();
    rows(lib.lines().filter_map(|l| l.strip_prefix("//! | `")))
}

/// The rows of the shim's module table in `docs/architecture.md`.
fn documented_in_architecture() -> Rows {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/architecture.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("The modules of the shim"))
        .expect("docs/architecture.md has a section \"The modules of the shim\"");
    rows(section.lines().filter_map(|l| l.strip_prefix("| `")))
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let g = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    let c = find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])).unwrap();
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4, "{c:?}");
}

#[test]
fn paths_are_read_from_uses_groups_and_expressions() {
    let code = code_of(
        "use crate::calls::{cuda, os::forked};\nuse crate::error::Error; // crate::x\n\
         fn f() { crate::init::state(); $crate::exports::boundary::guard(); }\n\
         #[cfg(test)]\nmod tests {\n    use crate::dispatch;\n}\n",
    );
    let paths: Vec<String> = crate_paths(&code).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "calls::cuda",
            "calls::os::forked",
            "error::Error",
            "init::state",
            "exports::boundary::guard"
        ]
    );
}

#[test]
fn the_module_graph_has_no_cycle() {
    let (graph, _) = shim_graph();
    assert!(graph.len() > 10, "the sources were found: {graph:?}");
    if let Some(c) = find_cycle(&graph) {
        panic!(
            "the shim's modules import each other in a circle: {}",
            c.join(" -> ")
        );
    }
}

#[test]
fn the_module_table_of_lib_rs_matches_the_code() {
    let (graph, _) = shim_graph();
    let rows = documented();
    let listed: BTreeSet<String> = rows.iter().map(|(m, _)| m.clone()).collect();
    let actual: BTreeSet<String> = graph.keys().cloned().collect();
    assert_eq!(listed, actual, "the table lists every module, once");
    assert_eq!(rows.len(), listed.len(), "no module listed twice");
    let mut problems = Vec::new();
    for (i, (module, may)) in rows.iter().enumerate() {
        let does = &graph[module];
        for d in does.difference(may) {
            problems.push(format!("{module} imports {d}, which its row does not list"));
        }
        for d in may.difference(does) {
            problems.push(format!(
                "{module}'s row lists {d}, which it does not import"
            ));
        }
        for d in may {
            if !rows[i + 1..].iter().any(|(m, _)| m == d) {
                problems.push(format!("{module} may import {d}, which is not below it"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn items_outside_the_c_api_are_crate_private() {
    let mut files = Vec::new();
    module_files(&src_dir(), "", &mut files);
    let mut public = Vec::new();
    for (module, path) in &files {
        // The C API's types and constants are public (cbindgen reads them); the forwarders'
        // `pub fn` lines are bindgen's declarations fed to a macro.
        if module == "exports::ext" || module == "exports::forwarders" {
            continue;
        }
        for (n, line) in std::fs::read_to_string(path).unwrap().lines().enumerate() {
            let t = line.trim_start();
            if t.starts_with("pub ") && !t.contains('$') {
                public.push(format!("{}:{}: {t}", path.display(), n + 1));
            }
        }
    }
    assert!(
        public.is_empty(),
        "make these pub(crate):\n{}",
        public.join("\n")
    );
}

#[test]
fn the_architecture_document_shows_the_same_table() {
    assert_eq!(documented_in_architecture(), documented());
}
