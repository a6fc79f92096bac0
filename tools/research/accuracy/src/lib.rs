//! Error statistics of the flashcomm codec and of its quantized all-reduce algorithms, measured
//! with the CPU reference (`flashcomm-codec`) on synthetic activations:
//!
//! * (a) Gaussian values, codec round trip;
//! * (b) heavy-tailed partial sums with outlier channels, a massive activation in one rank,
//!   delimiter spikes and a cancellation, through the one-shot and two-step all-reduce;
//! * (c) the partial sums of a tensor-parallel row-linear layer for N = 2, 4, 8 ranks.
//!
//! Every error is measured against the exact (f64) sum of the ranks' bf16 inputs. The binary
//! `flashcomm-accuracy` prints markdown tables or JSON; docs/accuracy-model.md reads them.

pub mod data;
pub mod report;
pub mod rng;

use flashcomm_codec::reference::{allreduce_lossless, allreduce_oneshot, allreduce_twostep};
use flashcomm_codec::{ALL_BITS, ALL_GROUPS, ALL_SPIKES, DType, Format, bf16};

use crate::data::Problem;

/// Error statistics of a result against the exact values (in JSON, non-finite values are
/// `null`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Stats {
    /// `||y - x|| / ||x||` (L2 norms).
    pub rel_l2: f64,
    /// `10 log10(||x||^2 / ||y - x||^2)`, infinite when the result is exact.
    pub snr_db: f64,
    /// `max |y - x|`.
    pub max_abs: f64,
    /// `max |y - x| / |x|` over elements with `x != 0`.
    pub max_rel: f64,
    /// Number of elements measured.
    pub count: usize,
}

/// Statistics over the elements `i` where `keep(i)`; non-finite results count as infinite
/// error.
pub fn stats(out: &[bf16], exact: &[f64], keep: impl Fn(usize) -> bool) -> Stats {
    let (mut e2, mut x2, mut max_abs, mut max_rel, mut count) = (0f64, 0f64, 0f64, 0f64, 0);
    for (i, (&y, &x)) in out.iter().zip(exact).enumerate() {
        if !keep(i) {
            continue;
        }
        let y = f64::from(y.to_f32());
        let e = if y.is_finite() {
            (y - x).abs()
        } else {
            f64::INFINITY
        };
        e2 += e * e;
        x2 += x * x;
        max_abs = max_abs.max(e);
        if x != 0.0 {
            max_rel = max_rel.max(e / x.abs());
        }
        count += 1;
    }
    Stats {
        rel_l2: (e2 / x2).sqrt(),
        snr_db: 10.0 * (x2 / e2).log10(),
        max_abs,
        max_rel,
        count,
    }
}

/// The all-reduce algorithm a record measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// `allreduce_lossless`: f32 accumulation rounded to bf16 (the floor any result shares).
    Lossless,
    /// `allreduce_oneshot`; with one rank this is the codec round trip.
    OneShot,
    /// `allreduce_twostep` with the same format for both steps.
    TwoStep,
}

impl Algorithm {
    /// Name used in the report.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Lossless => "lossless",
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoStep => "two-step",
        }
    }
}

/// One measured setting.
#[derive(Clone, Debug)]
pub struct Record {
    /// Data set name.
    pub problem: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Algorithm.
    pub algorithm: Algorithm,
    /// The format, `None` for the lossless reference.
    pub format: Option<Format>,
    /// Over every element.
    pub all: Stats,
    /// Over the elements that are not planted spikes (data sets with spikes only).
    pub non_spike: Option<Stats>,
    /// Over the planted spike elements (data sets with spikes only).
    pub spike: Option<Stats>,
}

fn measure(p: &Problem, algorithm: Algorithm, format: Option<Format>, out: &[bf16]) -> Record {
    let has_spikes = !p.spike_mask.is_empty();
    Record {
        problem: p.name.clone(),
        ranks: p.ranks.len(),
        algorithm,
        format,
        all: stats(out, &p.exact, |_| true),
        non_spike: has_spikes.then(|| stats(out, &p.exact, |i| !p.spike_mask[i])),
        spike: has_spikes.then(|| stats(out, &p.exact, |i| p.spike_mask[i])),
    }
}

/// Runs the lossless reference and, for every width, group and spike count, the given
/// quantized algorithms on `p` (bf16; the same format for both steps of the two-step).
pub fn run_problem(p: &Problem, algorithms: &[Algorithm]) -> Vec<Record> {
    let inputs: Vec<&[bf16]> = p.ranks.iter().map(|r| r.as_slice()).collect();
    let mut records = vec![measure(
        p,
        Algorithm::Lossless,
        None,
        &allreduce_lossless(&inputs),
    )];
    for bits in ALL_BITS {
        for group in ALL_GROUPS {
            for spikes in ALL_SPIKES {
                let f = Format::new(DType::Bf16, bits, group, spikes).expect("valid table");
                for &a in algorithms {
                    let out = match a {
                        Algorithm::Lossless => continue,
                        Algorithm::OneShot => allreduce_oneshot(f, &inputs),
                        Algorithm::TwoStep => allreduce_twostep(f, f, &inputs),
                    };
                    records.push(measure(p, a, Some(f), &out));
                }
            }
        }
    }
    records
}

/// Sizes of the data sets.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Values of the Gaussian set.
    pub gaussian: usize,
    /// Tokens x hidden of the heavy-tailed set.
    pub heavy: (usize, usize),
    /// Ranks of the heavy-tailed set.
    pub heavy_ranks: usize,
    /// Tokens, K and hidden of the row-linear layer.
    pub linear: (usize, usize, usize),
}

impl Sizes {
    /// The sizes of the recorded run (docs/accuracy-model.md, "Synthetic activations").
    pub const FULL: Sizes = Sizes {
        gaussian: 1 << 20,
        heavy: (256, 4096),
        heavy_ranks: 2,
        linear: (64, 8192, 4096),
    };
    /// Small sizes for a smoke test.
    pub const QUICK: Sizes = Sizes {
        gaussian: 1 << 13,
        heavy: (16, 1024),
        heavy_ranks: 2,
        linear: (8, 512, 1024),
    };
}

/// Which parts of the study to run.
#[derive(Clone, Copy, Debug)]
pub struct Parts {
    /// (a) Gaussian.
    pub gaussian: bool,
    /// (b) heavy-tailed.
    pub heavy: bool,
    /// (c) row-linear partial sums.
    pub linear: bool,
}

/// A data set with its records.
#[derive(Clone, Debug)]
pub struct Section {
    /// The data set (inputs dropped after the run).
    pub problem: Problem,
    /// Its records, the lossless reference first.
    pub records: Vec<Record>,
}

/// Runs the study.
pub fn run(seed: u64, sizes: Sizes, parts: Parts) -> Vec<Section> {
    let mut problems = Vec::new();
    let mut algos = Vec::new();
    if parts.gaussian {
        problems.push(data::gaussian(seed, sizes.gaussian));
        algos.push(vec![Algorithm::OneShot]);
    }
    if parts.heavy {
        let (t, h) = sizes.heavy;
        problems.push(data::heavy_tailed(seed, t, h, sizes.heavy_ranks));
        algos.push(vec![Algorithm::OneShot, Algorithm::TwoStep]);
    }
    if parts.linear {
        let (t, k, h) = sizes.linear;
        for p in data::row_linear(seed, t, k, h, &[2, 4, 8]) {
            problems.push(p);
            algos.push(vec![Algorithm::OneShot, Algorithm::TwoStep]);
        }
    }
    problems
        .into_iter()
        .zip(algos)
        .map(|(mut problem, a)| {
            let records = run_problem(&problem, &a);
            problem.ranks.clear();
            Section { problem, records }
        })
        .collect()
}
