//! Golden vectors: small inputs and their encoded bytes for every format, committed under
//! `tests/golden/`, so that any change of the wire format shows up as a diff.
//!
//! The test regenerates the files' text from the encoder and compares. After an intended format
//! change, rewrite them with
//!
//! ```text
//! FLASHCOMM_BLESS=1 cargo test -p flashcomm-codec --test golden
//! ```
//!
//! and review the diff. Each block is dumped region by region (header, bit planes, range table,
//! spike values, spike positions, padding), with trailing zero bytes of a region counted instead
//! of printed.

use std::fmt::Write as _;
use std::path::PathBuf;

use flashcomm_codec::{DType, Element, Format, bf16, encode_to_vec, f16};

/// Deterministic inputs built from integers only (no libm), so every platform agrees.
fn inputs<T: Element>() -> Vec<(&'static str, Vec<T>)> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let t = |x: f32| T::from_f32(x);

    // Smooth values k/256 with two outliers and a signed zero.
    let mut mixed: Vec<T> = (0..45)
        .map(|_| t(((next() % 2001) as f32 - 1000.0) / 256.0))
        .collect();
    mixed[3] = t(3000.5);
    mixed[7] = t(-0.0);
    mixed[40] = t(-1234.0);

    // Infinities, signed zeros, subnormals of the type, ties, a plateau, the extremes.
    let tiny = f32::from_bits(match T::DTYPE {
        DType::F32 => 0x0000_0003,
        DType::F16 => 0x3380_0000, // 2^-24 * 1 = the smallest f16 subnormal
        DType::Bf16 => 0x0001_0000,
    });
    let big = T::MAX as f32;
    let mut special: Vec<T> = (0..37).map(|i| t((i % 5) as f32 * 0.75)).collect();
    special[0] = t(-0.0);
    special[1] = t(0.0);
    special[2] = t(tiny);
    special[3] = t(-tiny);
    special[9] = t(f32::INFINITY);
    special[10] = t(-big);
    special[20] = t(-tiny * 2.0);
    special[33] = t(f32::NEG_INFINITY);

    let nan = vec![t(0.5), T::canonical_nan(), t(-2.0)];

    vec![("mixed", mixed), ("special", special), ("nan", nan)]
}

/// A larger input of two blocks (tail of 3), used with the default format only.
fn two_blocks<T: Element>() -> Vec<T> {
    (0..1027u32)
        .map(|i| {
            let k = (i.wrapping_mul(2_654_435_761) >> 20) as f32 - 2048.0;
            T::from_f32(if i % 97 == 5 { k * 64.0 } else { k / 512.0 })
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One region: its hex with trailing zero bytes counted, wrapped at 64 bytes a line.
fn region(out: &mut String, name: &str, bytes: &[u8]) {
    let used = bytes.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    let zeros = bytes.len() - used;
    let mut lines: Vec<String> = bytes[..used].chunks(64).map(hex).collect();
    if zeros > 0 {
        lines.push(format!("+{zeros} zero bytes"));
    }
    if lines.is_empty() {
        lines.push("(empty)".into());
    }
    for (i, l) in lines.iter().enumerate() {
        let label = if i == 0 { name } else { "" };
        let _ = writeln!(out, "  {label:<10} {l}");
    }
}

fn dump_block(out: &mut String, fmt: &Format, block: &[u8]) {
    let h = &block[..16];
    let _ = writeln!(
        out,
        "  {:<10} tag {} nvalues {} bits {} group_log2 {} spikes {} dtype {} reserved {}",
        "header",
        hex(&h[0..4]),
        u16::from_le_bytes([h[4], h[5]]),
        h[6],
        h[7],
        h[8],
        h[9],
        hex(&h[10..16])
    );
    for p in 0..fmt.units().len() {
        let name = format!("plane{p}/u{}", fmt.units()[p]);
        region(
            out,
            &name,
            &block[fmt.plane_offset(p)..fmt.plane_offset(p) + fmt.plane_bytes(p)],
        );
    }
    let r = |off: usize, len: usize| &block[off..off + len];
    region(out, "range", r(fmt.range_offset(), fmt.range_bytes()));
    if fmt.spikes() > 0 {
        region(
            out,
            "spikes",
            r(fmt.spike_values_offset(), fmt.spike_values_bytes()),
        );
        region(
            out,
            "positions",
            r(fmt.spike_positions_offset(), fmt.spike_positions_bytes()),
        );
    }
    region(out, "padding", r(fmt.padding_offset(), fmt.padding_bytes()));
}

fn dump_case<T: Element>(out: &mut String, fmt: &Format, name: &str, xs: &[T]) {
    let enc = encode_to_vec(*fmt, xs).unwrap();
    let _ = writeln!(
        out,
        "\n## {fmt} | {name} | n={} | {} bytes",
        xs.len(),
        enc.len()
    );
    for (b, block) in enc.chunks_exact(fmt.block_bytes()).enumerate() {
        let _ = writeln!(out, "block {b}");
        dump_block(out, fmt, block);
    }
}

fn generate<T: Element>() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Golden vectors of the flashcomm codec, {} inputs (docs/codec.md).\n\
         # Generated by crates/codec/tests/golden.rs; rewrite with FLASHCOMM_BLESS=1.\n\
         # Inputs are raw element bits in hex, little-endian fields elsewhere.",
        T::DTYPE
    );
    let ins = inputs::<T>();
    for (name, xs) in &ins {
        let _ = writeln!(out, "\ninput {name} n={}", xs.len());
        for chunk in xs.chunks(16) {
            let words: Vec<String> = chunk
                .iter()
                .map(|x| format!("{:0w$x}", x.to_bits(), w = 2 * T::BYTES))
                .collect();
            let _ = writeln!(out, "  {}", words.join(" "));
        }
    }
    for fmt in Format::all().filter(|f| f.dtype() == T::DTYPE) {
        for (name, xs) in &ins {
            dump_case(&mut out, &fmt, name, xs);
        }
    }
    let default = Format::new(T::DTYPE, 4, 128, 2).unwrap();
    let xs = two_blocks::<T>();
    let _ = writeln!(out, "\ninput two-blocks n={} (values elided)", xs.len());
    dump_case(&mut out, &default, "two-blocks", &xs);
    out
}

fn check_file(name: &str, text: &str) {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "golden", name]
        .iter()
        .collect();
    if std::env::var_os("FLASHCOMM_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, text).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed == text {
        return;
    }
    let line = committed
        .lines()
        .zip(text.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| committed.lines().count().min(text.lines().count()));
    panic!(
        "{} differs from the encoder's output at line {}:\n  committed: {:?}\n  generated: {:?}\n\
         If the format change is intended, rerun with FLASHCOMM_BLESS=1 and review the diff.",
        path.display(),
        line + 1,
        committed.lines().nth(line).unwrap_or("<end of file>"),
        text.lines().nth(line).unwrap_or("<end of file>"),
    );
}

#[test]
fn golden_f32() {
    check_file("f32.txt", &generate::<f32>());
}

#[test]
fn golden_f16() {
    check_file("f16.txt", &generate::<f16>());
}

#[test]
fn golden_bf16() {
    check_file("bf16.txt", &generate::<bf16>());
}
