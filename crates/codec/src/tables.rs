//! Tables generated from the code and pasted into the documentation.

use std::fmt::Write as _;

use crate::format::{ALL_BITS, ALL_GROUPS, ALL_SPIKES, DType, Format};

/// The effective-bits table of `docs/codec.md`: bits on the wire per value (payload, header and
/// metadata, `block_bytes * 8 / 1024`) for every width, group size and spike count, one table for
/// 16-bit inputs (f16, bf16) and one for 32-bit inputs (f32). Ends with a newline.
pub fn effective_bits_markdown() -> String {
    let mut s = String::new();
    for (title, dtype) in [
        ("16-bit inputs (f16, bf16)", DType::Bf16),
        ("32-bit inputs (f32)", DType::F32),
    ] {
        if !s.is_empty() {
            s.push('\n');
        }
        let _ = writeln!(s, "{title}, bits per value:\n");
        s.push_str("| group | spikes |");
        for b in ALL_BITS {
            let _ = write!(s, " b = {b} |");
        }
        s.push_str("\n|---:|---:|");
        for _ in ALL_BITS {
            s.push_str("---:|");
        }
        s.push('\n');
        for g in ALL_GROUPS {
            for k in ALL_SPIKES {
                let _ = write!(s, "| {g} | {k} |");
                for b in ALL_BITS {
                    let f = Format::new(dtype, b, g, k).expect("table values are valid");
                    let _ = write!(s, " {:.3} |", f.effective_bits());
                }
                s.push('\n');
            }
        }
    }
    s
}
