//! Tables generated from the code and pasted into the documentation.

use std::fmt::Write as _;

use crate::format::{ALL_BITS, ALL_GROUPS, ALL_SPIKES, DType, Format};
use crate::reference::{allreduce_oneshot_with_bound, allreduce_twostep_with_bound};
use crate::rng::Rng;

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

/// One row of [`error_table_markdown`]: a width, an algorithm and what it did to the sum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorRow {
    /// Bits per value of the payload (both steps of the two-step alike).
    pub bits: u8,
    /// `true`: two-step (reduce-scatter, then all-gather); `false`: one-shot.
    pub two_step: bool,
    /// Bits per value on the wire (payload, ranges and spikes).
    pub wire_bits: f64,
    /// `||result - exact|| / ||exact||` over every value.
    pub rel_l2: f64,
    /// The largest `|result - exact|`.
    pub max_err: f64,
    /// The largest `|result - exact| / bound` (at most 1: the bound holds).
    pub worst_of_bound: f64,
}

/// The quantized AllReduce of the CPU reference codec against the exact sum, for every width
/// 2..8 with bf16 values, group 128 and 2 spikes (the defaults), one-shot and two-step, over
/// `ranks` ranks of `values` synthetic activations each (normal values with rare large
/// outliers, seeded: the same numbers on every machine).
pub fn error_rows(ranks: usize, values: usize) -> Vec<ErrorRow> {
    let mut rng = Rng::new(0x00f1_a5c0_0000_0001);
    let inputs: Vec<Vec<half::bf16>> = (0..ranks)
        .map(|_| {
            (0..values)
                .map(|_| {
                    let v = if rng.chance(0.001) {
                        rng.student_t(3) * 20.0
                    } else {
                        rng.normal()
                    };
                    half::bf16::from_f32(v as f32)
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[half::bf16]> = inputs.iter().map(Vec::as_slice).collect();
    let exact: Vec<f64> = (0..values)
        .map(|i| refs.iter().map(|r| f64::from(r[i].to_f32())).sum())
        .collect();
    let mut rows = Vec::new();
    for bits in ALL_BITS {
        let fmt = Format::new(DType::Bf16, bits, 128, 2).expect("a valid format");
        for two_step in [false, true] {
            let out = if two_step {
                allreduce_twostep_with_bound(fmt, fmt, &refs)
            } else {
                allreduce_oneshot_with_bound(fmt, &refs)
            };
            let (mut err2, mut ref2, mut max_err, mut worst) = (0f64, 0f64, 0f64, 0f64);
            for ((v, x), b) in out.values.iter().zip(&exact).zip(&out.bound) {
                let e = (f64::from(v.to_f32()) - x).abs();
                err2 += e * e;
                ref2 += x * x;
                max_err = max_err.max(e);
                if *b > 0.0 {
                    worst = worst.max(e / b);
                }
            }
            rows.push(ErrorRow {
                bits,
                two_step,
                wire_bits: fmt.effective_bits(),
                rel_l2: (err2 / ref2.max(f64::MIN_POSITIVE)).sqrt(),
                max_err,
                worst_of_bound: worst,
            });
        }
    }
    rows
}

/// [`error_rows`] as a markdown table. Ends with a newline.
pub fn error_table_markdown(ranks: usize, values: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Quantized AllReduce of the CPU reference codec against the exact sum: {ranks} ranks x \
         {values} bf16 values, group 128, 2 spikes (the defaults)\n"
    );
    s.push_str("| bits | algorithm | bits/value on the wire | relative L2 error | max error | max error / bound |\n");
    s.push_str("|---:|---|---:|---:|---:|---:|\n");
    for r in error_rows(ranks, values) {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.2e} | {:.3e} | {:.3} |",
            r.bits,
            if r.two_step { "two-step" } else { "one-shot" },
            r.wire_bits,
            r.rel_l2,
            r.max_err,
            r.worst_of_bound
        );
    }
    s
}
