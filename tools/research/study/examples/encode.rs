//! Prints the token ids of a text file, one per line, as the study's tokenizer encodes it: the
//! other half of the comparison with the reference tokenizer (`reference_tokenizer.py`).
//!
//!     cd tools/research && cargo run --release -p flashcomm-study --example encode -- \
//!         <model.gguf> <text> <ids-out>

use flashcomm_study::gguf::Gguf;
use flashcomm_study::tokenizer::Tokenizer;
use std::path::Path;
use std::process::ExitCode;

fn run(args: &[String]) -> Result<(), String> {
    let [model, text, out] = args else {
        return Err("usage: encode <model.gguf> <text> <ids-out>".into());
    };
    let g = Gguf::open(Path::new(model)).map_err(|e| format!("{model}: {e}"))?;
    let tok = Tokenizer::from_gguf(&g)?;
    let text = std::fs::read_to_string(text).map_err(|e| format!("{text}: {e}"))?;
    let mut lines = String::new();
    for id in tok.encode(&text) {
        lines.push_str(&id.to_string());
        lines.push('\n');
    }
    std::fs::write(out, lines).map_err(|e| format!("{out}: {e}"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("encode: {e}");
            ExitCode::FAILURE
        }
    }
}
