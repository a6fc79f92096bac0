//! `gen-env-doc`: the variable table of `docs/env.md`, from the declarations in `crates/config`.

use crate::{Error, Generated, repo_root};

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The Markdown table: name | type | default | allowed | meaning.
pub fn table() -> String {
    let mut s =
        String::from("| name | type | default | allowed | meaning |\n|---|---|---|---|---|\n");
    for v in flashcomm_config::variables() {
        s.push_str(&format!(
            "| `{}` | {} | `{}` | {} | {}{} |\n",
            v.name,
            cell(v.kind),
            cell(&v.default),
            cell(v.allowed),
            cell(&v.meaning),
            if v.strict {
                ""
            } else {
                " A bad value is ignored with a warning."
            }
        ));
    }
    s
}

/// The generated section of `docs/env.md`.
pub fn outputs() -> Result<Vec<Generated>, Error> {
    Ok(vec![Generated::section(
        repo_root().join("docs/env.md"),
        "variables",
        table(),
    )])
}
