//! Development tasks for flashcomm, run as `cargo run -p xtask -- <task>`.
//!
//! Every task produces text that is committed to the repository. Each task has a pure
//! "generate" function so that tests can compare the committed files with a fresh run
//! (`tests/fresh.rs`), and a writer used by the command line.
//!
//! | task | writes |
//! |---|---|
//! | `gen-bindings` | `crates/nccl-sys/src/bindings.rs`, `crates/nccl-sys/src/functions.rs` (needs libclang and the pinned headers) |
//! | `gen-exports` | `crates/shim/src/exports/forwarders.rs`, the support matrix in `docs/abi.md` |
//! | `gen-env-doc` | the variable table in `docs/env.md` |
//! | `gen-header` | `include/flashcomm.h` (cbindgen over `crates/shim/src/exports/ext.rs`) |
//! | `gen-kernels` | `cuda/include/flashcomm/params.h` (from `crates/kernels/src/abi.rs`) and `cuda/include/flashcomm/instances.h` (from `crates/kernels/src/catalog.rs`) |
//! | `gen-all` | all of the above |
//! | `check` | nothing; fails when a committed file differs from a fresh run |

pub mod abi;
pub mod bindings;
pub mod envdoc;
pub mod exports;
pub mod header;
pub mod kernels;

use std::fmt;
use std::path::{Path, PathBuf};

/// An error of a task, with a message for people.
#[derive(Debug, Clone)]
pub struct Error(String);

impl Error {
    /// Wraps a message.
    pub fn new(msg: impl Into<String>) -> Self {
        Error(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The repository root (two levels above this crate's manifest).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .expect("crates/xtask has two parents")
}

/// One generated product: a whole file, or the part of a file between two marker lines.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The file.
    pub path: PathBuf,
    /// The generated text.
    pub text: String,
    /// `Some(name)`: the text replaces what lies between `<!-- BEGIN GENERATED: name -->` and
    /// `<!-- END GENERATED: name -->` (lines of their own); the rest of the file is hand-written.
    pub section: Option<&'static str>,
}

impl Generated {
    /// A whole generated file.
    pub fn whole(path: PathBuf, text: String) -> Self {
        Generated {
            path,
            text,
            section: None,
        }
    }

    /// A generated section of a hand-written file.
    pub fn section(path: PathBuf, name: &'static str, text: String) -> Self {
        Generated {
            path,
            text,
            section: Some(name),
        }
    }

    /// What the file should contain, given what it contains now.
    pub fn render(&self, current: &str) -> Result<String, Error> {
        let Some(name) = self.section else {
            return Ok(self.text.clone());
        };
        let begin = format!("<!-- BEGIN GENERATED: {name} -->");
        let end = format!("<!-- END GENERATED: {name} -->");
        let b = current.find(&begin).ok_or_else(|| {
            Error::new(format!(
                "{}: marker `{begin}` is missing",
                self.path.display()
            ))
        })?;
        let e = current.find(&end).ok_or_else(|| {
            Error::new(format!(
                "{}: marker `{end}` is missing",
                self.path.display()
            ))
        })?;
        if e < b {
            return Err(Error::new(format!(
                "{}: markers out of order",
                self.path.display()
            )));
        }
        let head = &current[..b + begin.len()];
        let tail = &current[e..];
        Ok(format!("{head}\n{}{tail}", self.text))
    }

    /// `Ok(None)` when the file is current, else `Ok(Some(reason))`.
    pub fn check(&self) -> Result<Option<String>, Error> {
        let current = std::fs::read_to_string(&self.path).unwrap_or_default();
        let wanted = self.render(&current)?;
        if wanted == current {
            Ok(None)
        } else {
            Ok(Some(format!(
                "{} is stale{}; run `cargo run -p xtask -- {}`\n{}",
                self.path.display(),
                self.section
                    .map(|s| format!(" (section {s})"))
                    .unwrap_or_default(),
                task_for(&self.path),
                first_difference(&current, &wanted)
            )))
        }
    }

    /// Writes the file if it changed; returns whether it did.
    pub fn write(&self) -> Result<bool, Error> {
        let current = std::fs::read_to_string(&self.path).unwrap_or_default();
        let wanted = self.render(&current)?;
        if wanted == current {
            return Ok(false);
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::new(format!("creating {}: {e}", dir.display())))?;
        }
        std::fs::write(&self.path, wanted)
            .map_err(|e| Error::new(format!("writing {}: {e}", self.path.display())))?;
        Ok(true)
    }
}

fn task_for(path: &Path) -> &'static str {
    let p = path.to_string_lossy();
    if p.contains("nccl-sys") {
        "gen-bindings"
    } else if p.contains("cuda/include") {
        "gen-kernels"
    } else if p.ends_with("env.md") {
        "gen-env-doc"
    } else if p.ends_with(".h") {
        "gen-header"
    } else {
        "gen-exports"
    }
}

fn first_difference(current: &str, wanted: &str) -> String {
    for (i, (a, b)) in current.lines().zip(wanted.lines()).enumerate() {
        if a != b {
            return format!(
                "first difference at line {}:\n  committed: {a}\n  generated: {b}",
                i + 1
            );
        }
    }
    format!(
        "committed has {} lines, generated has {}",
        current.lines().count(),
        wanted.lines().count()
    )
}
