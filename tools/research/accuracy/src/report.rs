//! Markdown and JSON output.

use std::fmt::Write as _;

use flashcomm_codec::{ALL_BITS, ALL_GROUPS, ALL_SPIKES};
use serde::Serialize;

use crate::{Algorithm, Record, Section, Stats};

/// `1.23e-2` style, `0` for zero, `inf`/`nan` spelled out.
pub fn sci(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        "inf".into()
    } else {
        format!("{x:.2e}")
    }
}

fn rel_snr(s: &Stats) -> String {
    if s.snr_db.is_infinite() && s.snr_db > 0.0 {
        "0 (exact)".into()
    } else {
        format!("{} ({:.1})", sci(s.rel_l2), s.snr_db)
    }
}

fn find(
    records: &[Record],
    algorithm: Algorithm,
    bits: u8,
    group: u16,
    spikes: u8,
) -> Option<&Record> {
    records.iter().find(|r| {
        r.algorithm == algorithm
            && r.format
                .is_some_and(|f| f.bits() == bits && f.group() == group && f.spikes() == spikes)
    })
}

fn header(out: &mut String, cols: &[String]) {
    let _ = writeln!(out, "| bits | group | {} |", cols.join(" | "));
    let _ = writeln!(out, "|---:|---:|{}", "---:|".repeat(cols.len()));
}

/// Per-k column titles.
fn per_k(titles: &[&str]) -> Vec<String> {
    ALL_SPIKES
        .iter()
        .flat_map(|k| titles.iter().map(move |t| format!("k={k} {t}")))
        .collect()
}

fn rows(
    out: &mut String,
    records: &[Record],
    cells: impl Fn(&[Record], u8, u16, u8) -> Vec<String>,
) {
    for bits in ALL_BITS {
        for group in ALL_GROUPS {
            let mut line = format!("| {bits} | {group} |");
            for k in ALL_SPIKES {
                for c in cells(records, bits, group, k) {
                    let _ = write!(line, " {c} |");
                }
            }
            let _ = writeln!(out, "{line}");
        }
    }
}

fn lossless_line(out: &mut String, s: &Section) {
    if let Some(r) = s
        .records
        .iter()
        .find(|r| r.algorithm == Algorithm::Lossless)
    {
        let _ = writeln!(
            out,
            "Lossless reference (f32 sum rounded to bf16): rel L2 {}, max abs {}.\n",
            rel_snr(&r.all),
            sci(r.all.max_abs)
        );
    }
}

/// Wire budgets (bits per value, payload and metadata) of the equal-cost comparison.
const BUDGETS: [f64; 7] = [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0];

fn setting(r: &Record) -> String {
    let f = r.format.expect("quantized");
    format!(
        "b{} g{} k{} ({:.3})",
        f.bits(),
        f.group(),
        f.spikes(),
        f.effective_bits()
    )
}

/// For each budget, the setting with the lowest error among those that fit, with and without
/// spikes.
fn budget(
    out: &mut String,
    s: &Section,
    a: Algorithm,
    metric: impl Fn(&Record) -> f64,
    what: &str,
) {
    let _ = writeln!(
        out,
        "Best {} setting within a wire budget (bits per value including metadata), by {what}:\n",
        a.name()
    );
    let _ = writeln!(
        out,
        "| budget | best setting (bits) | {what} | best without spikes (bits) | {what} |"
    );
    let _ = writeln!(out, "|---:|---|---:|---|---:|");
    let cands: Vec<&Record> = s
        .records
        .iter()
        .filter(|r| r.algorithm == a && r.format.is_some())
        .collect();
    for b in BUDGETS {
        let best = |spikes_ok: bool| {
            cands
                .iter()
                .filter(|r| {
                    let f = r.format.expect("quantized");
                    f.effective_bits() <= b && (spikes_ok || f.spikes() == 0)
                })
                .min_by(|x, y| metric(x).total_cmp(&metric(y)))
        };
        let cell = |r: Option<&&Record>| match r {
            Some(r) => (setting(r), sci(metric(r))),
            None => ("-".to_string(), "-".to_string()),
        };
        let (s1, m1) = cell(best(true));
        let (s0, m0) = cell(best(false));
        let _ = writeln!(out, "| {b} | {s1} | {m1} | {s0} | {m0} |");
    }
    out.push('\n');
}

fn notes(out: &mut String, s: &Section) {
    for n in &s.problem.notes {
        let _ = writeln!(out, "- {n}");
    }
    out.push('\n');
}

/// Markdown tables of every section. Cells "rel L2 (SNR dB)" are over all elements unless the
/// column says otherwise; `k` is the spike count.
pub fn markdown(sections: &[Section]) -> String {
    let mut out = String::new();
    for s in sections {
        let name = &s.problem.name;
        let single_rank = s.records.iter().all(|r| r.ranks == 1);
        let has_spikes = s.records.iter().any(|r| r.spike.is_some());
        let _ = writeln!(out, "### {name}\n");
        notes(&mut out, s);
        if single_rank {
            let _ = writeln!(out, "Codec round trip (encode, decode), bf16:\n");
            header(&mut out, &per_k(&["rel L2 (SNR dB)", "max abs"]));
            rows(&mut out, &s.records, |rs, b, g, k| {
                let r = find(rs, Algorithm::OneShot, b, g, k).expect("measured");
                vec![rel_snr(&r.all), sci(r.all.max_abs)]
            });
            out.push('\n');
            budget(&mut out, s, Algorithm::OneShot, |r| r.all.rel_l2, "rel L2");
            continue;
        }
        lossless_line(&mut out, s);
        if has_spikes {
            for a in [Algorithm::OneShot, Algorithm::TwoStep] {
                let _ = writeln!(
                    out,
                    "{} all-reduce, {} ranks: rel L2 (SNR dB) over all elements and over the \
                     non-spike elements, max abs error over the non-spike elements:\n",
                    a.name(),
                    s.records[0].ranks
                );
                header(&mut out, &per_k(&["all", "non-spike", "non-spike max abs"]));
                rows(&mut out, &s.records, |rs, b, g, k| {
                    let r = find(rs, a, b, g, k).expect("measured");
                    let ns = r.non_spike.as_ref().expect("spike data");
                    vec![rel_snr(&r.all), rel_snr(ns), sci(ns.max_abs)]
                });
                let spikes: Vec<&Stats> = s
                    .records
                    .iter()
                    .filter(|r| r.algorithm == a)
                    .filter_map(|r| r.spike.as_ref())
                    .collect();
                let lo = spikes
                    .iter()
                    .map(|x| x.max_abs)
                    .fold(f64::INFINITY, f64::min);
                let hi = spikes.iter().map(|x| x.max_abs).fold(0.0, f64::max);
                let rel = spikes.iter().map(|x| x.max_rel).fold(0.0, f64::max);
                let _ = writeln!(
                    out,
                    "\nPlanted spike elements ({} of them): max abs error {} to {} over all \
                     settings, max relative error {}.\n",
                    spikes.first().map_or(0, |x| x.count),
                    sci(lo),
                    sci(hi),
                    sci(rel)
                );
                budget(
                    &mut out,
                    s,
                    a,
                    |r| r.non_spike.expect("spike data").rel_l2,
                    "non-spike rel L2",
                );
            }
        } else {
            let _ = writeln!(
                out,
                "rel L2 (SNR dB) of the one-shot and two-step all-reduce, {} ranks:\n",
                s.records[0].ranks
            );
            header(&mut out, &per_k(&["one-shot", "two-step"]));
            rows(&mut out, &s.records, |rs, b, g, k| {
                [Algorithm::OneShot, Algorithm::TwoStep]
                    .iter()
                    .map(|&a| rel_snr(&find(rs, a, b, g, k).expect("measured").all))
                    .collect()
            });
            out.push('\n');
            budget(&mut out, s, Algorithm::TwoStep, |r| r.all.rel_l2, "rel L2");
        }
    }
    out
}

/// The JSON document of [`json`].
#[derive(Serialize)]
struct JsonDoc<'a> {
    sections: Vec<JsonSection<'a>>,
}

#[derive(Serialize)]
struct JsonSection<'a> {
    problem: &'a str,
    tokens: usize,
    hidden: usize,
    notes: &'a [String],
    records: Vec<JsonRecord<'a>>,
}

#[derive(Serialize)]
struct JsonRecord<'a> {
    algorithm: &'static str,
    ranks: usize,
    format: Option<JsonFormat>,
    all: &'a Stats,
    non_spike: Option<&'a Stats>,
    spike: Option<&'a Stats>,
}

#[derive(Serialize)]
struct JsonFormat {
    dtype: String,
    bits: u8,
    group: u16,
    spikes: u8,
    effective_bits: f64,
}

/// Every record as JSON: `{"sections": [{"problem", "notes", "records": [...]}]}`. Non-finite
/// numbers (an exact result's SNR) are `null`.
///
/// # Errors
///
/// Only if serde_json fails to serialize (it does not for these plain structs).
pub fn json(sections: &[Section]) -> Result<String, serde_json::Error> {
    let doc = JsonDoc {
        sections: sections
            .iter()
            .map(|s| JsonSection {
                problem: &s.problem.name,
                tokens: s.problem.tokens,
                hidden: s.problem.hidden,
                notes: &s.problem.notes,
                records: s
                    .records
                    .iter()
                    .map(|r| JsonRecord {
                        algorithm: r.algorithm.name(),
                        ranks: r.ranks,
                        format: r.format.map(|f| JsonFormat {
                            dtype: f.dtype().to_string(),
                            bits: f.bits(),
                            group: f.group(),
                            spikes: f.spikes(),
                            effective_bits: f.effective_bits(),
                        }),
                        all: &r.all,
                        non_spike: r.non_spike.as_ref(),
                        spike: r.spike.as_ref(),
                    })
                    .collect(),
            })
            .collect(),
    };
    serde_json::to_string_pretty(&doc).map(|t| t + "\n")
}
