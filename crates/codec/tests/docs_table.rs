//! The effective-bits table in `docs/codec.md` equals the one the code generates
//! (`cargo run -p flashcomm-codec --example effective_bits`). `FLASHCOMM_BLESS=1` rewrites it.

use std::path::PathBuf;

const START: &str = "<!-- EFFECTIVE-BITS-TABLE -->\n";
const END: &str = "<!-- /EFFECTIVE-BITS-TABLE -->";

#[test]
fn effective_bits_table_is_current() {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "..", "docs", "codec.md"]
        .iter()
        .collect();
    let doc = std::fs::read_to_string(&path).expect("docs/codec.md");
    let start = doc.find(START).expect("start marker in docs/codec.md") + START.len();
    let end = start + doc[start..].find(END).expect("end marker in docs/codec.md");
    let table = flashcomm_codec::effective_bits_markdown();
    let want = format!("\n{table}\n");
    if doc[start..end] == want {
        return;
    }
    if std::env::var_os("FLASHCOMM_BLESS").is_some_and(|v| v == "1") {
        let new = format!("{}{want}{}", &doc[..start], &doc[end..]);
        std::fs::write(&path, new).unwrap();
        return;
    }
    panic!(
        "the effective-bits table in docs/codec.md is stale; paste the output of \
         `cargo run -p flashcomm-codec --example effective_bits` between the markers, or rerun \
         with FLASHCOMM_BLESS=1"
    );
}
