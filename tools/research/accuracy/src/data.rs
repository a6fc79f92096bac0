//! The data sets: per-rank bf16 inputs of an all-reduce, their exact sum, and which elements are
//! planted spikes.

use flashcomm_codec::bf16;

use crate::rng::Rng;

/// One all-reduce problem: N ranks' bf16 inputs of `tokens x hidden` values (row-major, so
/// groups run along the hidden dimension as in a real message), and the exact sum.
#[derive(Clone, Debug)]
pub struct Problem {
    /// Short name used in the report.
    pub name: String,
    /// Rows of the message.
    pub tokens: usize,
    /// Columns of the message.
    pub hidden: usize,
    /// One input per rank.
    pub ranks: Vec<Vec<bf16>>,
    /// Exact (f64) sum of the ranks' bf16 values, the reference every error is measured against.
    pub exact: Vec<f64>,
    /// Planted spike elements (massive activations, delimiter spikes, cancellations); empty when
    /// the data set has none.
    pub spike_mask: Vec<bool>,
    /// One-line facts about the data (medians, maxima, kurtosis) for the report.
    pub notes: Vec<String>,
}

impl Problem {
    fn new(name: String, tokens: usize, hidden: usize, ranks: Vec<Vec<bf16>>) -> Problem {
        let n = tokens * hidden;
        let exact = (0..n)
            .map(|i| ranks.iter().map(|r| f64::from(r[i].to_f32())).sum())
            .collect();
        Problem {
            name,
            tokens,
            hidden,
            ranks,
            exact,
            spike_mask: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Number of values per rank.
    pub fn len(&self) -> usize {
        self.tokens * self.hidden
    }

    /// Whether the problem holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn describe(&mut self) {
        let d = describe(&self.exact);
        self.notes.push(format!(
            "sum: median |x| {:.3}, max |x| {:.1}, max/median {:.0}, kurtosis {:.1}, {:.3}% beyond 6 sigma",
            d.median_abs,
            d.max_abs,
            d.max_abs / d.median_abs,
            d.kurtosis,
            100.0 * d.beyond_6sigma
        ));
    }
}

/// Summary statistics of a data set.
#[derive(Clone, Copy, Debug)]
pub struct Description {
    /// Median of |x|.
    pub median_abs: f64,
    /// Largest |x|.
    pub max_abs: f64,
    /// Kurtosis (4th standardized moment; 3 for a Gaussian).
    pub kurtosis: f64,
    /// Fraction of values more than 6 standard deviations from the mean.
    pub beyond_6sigma: f64,
}

/// Describes `xs` (finite values).
pub fn describe(xs: &[f64]) -> Description {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let m2 = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    let m4 = xs.iter().map(|x| (x - mean).powi(4)).sum::<f64>() / n;
    let sd = m2.sqrt();
    let mut abs: Vec<f64> = xs.iter().map(|x| x.abs()).collect();
    abs.sort_by(f64::total_cmp);
    Description {
        median_abs: abs[abs.len() / 2],
        max_abs: abs[abs.len() - 1],
        kurtosis: m4 / (m2 * m2),
        beyond_6sigma: xs.iter().filter(|x| (*x - mean).abs() > 6.0 * sd).count() as f64 / n,
    }
}

fn median_abs(xs: &[f64]) -> f64 {
    let mut a: Vec<f64> = xs.iter().map(|x| x.abs()).collect();
    a.sort_by(f64::total_cmp);
    a[a.len() / 2]
}

fn to_bf16(xs: &[f64]) -> Vec<bf16> {
    xs.iter().map(|&x| bf16::from_f32(x as f32)).collect()
}

/// (a) Gaussian N(0, 1) values, one rank (the codec round trip).
pub fn gaussian(seed: u64, n: usize) -> Problem {
    let mut rng = Rng::fork(seed, 1);
    let xs: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
    let mut p = Problem::new("gaussian".into(), 1, n, vec![to_bf16(&xs)]);
    p.describe();
    p
}

/// Fixed channels of the heavy-tailed recipe, folded into `hidden`.
struct Channels {
    outliers: [(usize, f64); 3],
    massive: usize,
    cancel: usize,
}

fn channels(hidden: usize) -> Channels {
    Channels {
        // channel, magnitude in medians with its fixed sign
        outliers: [
            (17 % hidden, 30.0),
            (247 % hidden, -80.0),
            (2533 % hidden, 150.0),
        ],
        massive: 507 % hidden,
        cancel: 1415 % hidden,
    }
}

/// The massive activation of the recipe (SmolLM2-135M layer 11 down_proj, token 0).
pub const MASSIVE: f64 = 25_654.0;
/// The target median |x| of the sum.
pub const MEDIAN: f64 = 0.78;
/// The magnitude of each of the two cancelling partials.
pub const CANCEL: f64 = 14_301.0;

/// (b) Heavy-tailed partial sums following the synthetic recipe of the research notes
/// (`real-eval.md` 3.4): Student-t (nu = 5) bulk with log-normal channel scales (sigma 0.7),
/// three fixed outlier channels at 30, 80 and 150 times the median with fixed signs, a massive
/// activation of 25,654 at token 0 in one channel carried entirely by rank 0, delimiter tokens
/// (3% of positions) at 100-1000 times the median in the same channel, and at token 0 a second
/// channel where ranks 0 and 1 hold +-14,301 that cancel in the sum. bf16, median |sum| 0.78.
pub fn heavy_tailed(seed: u64, tokens: usize, hidden: usize, nranks: usize) -> Problem {
    let mut rng = Rng::fork(seed, 2);
    let ch = channels(hidden);
    let scale: Vec<f64> = (0..hidden).map(|_| rng.log_normal(0.7)).collect();
    let n = tokens * hidden;
    let per_rank = (nranks as f64).sqrt();
    let mut parts: Vec<Vec<f64>> = (0..nranks)
        .map(|_| {
            (0..n)
                .map(|i| scale[i % hidden] * rng.student_t(5) / per_rank)
                .collect()
        })
        .collect();
    // Normalize the bulk so that the median |sum| is 0.78.
    let sum: Vec<f64> = (0..n).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
    let k = MEDIAN / median_abs(&sum);
    for p in &mut parts {
        p.iter_mut().for_each(|x| *x *= k);
    }
    // Fixed outlier channels, on every token, split over the ranks with random shares.
    for t in 0..tokens {
        for &(c, mag) in &ch.outliers {
            let total = mag * MEDIAN * (0.75 + 0.5 * rng.uniform());
            let w: Vec<f64> = (0..nranks).map(|_| 0.2 + rng.uniform()).collect();
            let ws: f64 = w.iter().sum();
            for (p, wr) in parts.iter_mut().zip(&w) {
                p[t * hidden + c] += total * wr / ws;
            }
        }
    }
    let mut spikes = vec![false; n];
    // The massive activation lives in rank 0's partial only.
    parts[0][ch.massive] = MASSIVE;
    spikes[ch.massive] = true;
    // Delimiter tokens: 100-1000x the median in the massive channel, rank 0.
    let mut delimiters = 0;
    for t in 1..tokens {
        if rng.uniform() < 0.03 {
            parts[0][t * hidden + ch.massive] += MEDIAN * 10f64.powf(2.0 + rng.uniform());
            spikes[t * hidden + ch.massive] = true;
            delimiters += 1;
        }
    }
    // Cancellation: two ranks with large opposite partials.
    if nranks >= 2 {
        parts[0][ch.cancel] = CANCEL;
        parts[1][ch.cancel] = -CANCEL + 3.0;
        spikes[ch.cancel] = true;
    }
    let ranks: Vec<Vec<bf16>> = parts.iter().map(|p| to_bf16(p)).collect();
    let mut p = Problem::new(format!("heavy-tailed N={nranks}"), tokens, hidden, ranks);
    p.spike_mask = spikes;
    p.notes.push(format!(
        "{tokens} tokens x {hidden} channels, {nranks} ranks; massive channel {}, cancel channel {}, \
         outlier channels {:?}; {delimiters} delimiter tokens",
        ch.massive,
        ch.cancel,
        ch.outliers.map(|o| o.0)
    ));
    p.describe();
    p
}

/// (c) The partial sums of a tensor-parallel row-linear layer `Y = X W`, X of `tokens x k_dim`,
/// W of `k_dim x hidden`, K split into N contiguous shards (rank r holds `X_r W_r`), for each N in
/// `ranks`. X is Student-t (nu = 5) with log-normal channel scales (sigma 1) and log-normal token
/// scales (sigma 0.3); W is Gaussian with variance 1/K and log-normal output-column scales
/// (sigma 0.5). The result is scaled so that the median |Y| is 0.78. Partials are computed in f64
/// and rounded to bf16, as a kernel's output would be. There is no planted massive activation
/// here: (b) covers those, and a single massive row would dominate every norm.
pub fn row_linear(
    seed: u64,
    tokens: usize,
    k_dim: usize,
    hidden: usize,
    ranks: &[usize],
) -> Vec<Problem> {
    const SHARDS: usize = 8;
    assert!(k_dim.is_multiple_of(SHARDS) && ranks.iter().all(|&r| SHARDS.is_multiple_of(r)));
    let mut rng = Rng::fork(seed, 3);
    let kscale: Vec<f64> = (0..k_dim).map(|_| rng.log_normal(1.0)).collect();
    let tscale: Vec<f64> = (0..tokens).map(|_| rng.log_normal(0.3)).collect();
    let cscale: Vec<f64> = (0..hidden)
        .map(|_| rng.log_normal(0.5) / (k_dim as f64).sqrt())
        .collect();
    let x: Vec<f64> = (0..tokens * k_dim)
        .map(|i| tscale[i / k_dim] * kscale[i % k_dim] * rng.student_t(5))
        .collect();
    // Eight finest partials; W is generated one row at a time and never stored.
    let per = k_dim / SHARDS;
    let mut fine = vec![vec![0f64; tokens * hidden]; SHARDS];
    let mut w = vec![0f64; hidden];
    for kk in 0..k_dim {
        for (v, &c) in w.iter_mut().zip(&cscale) {
            *v = rng.normal() * c;
        }
        let part = &mut fine[kk / per];
        for t in 0..tokens {
            let xv = x[t * k_dim + kk];
            for (o, &wv) in part[t * hidden..(t + 1) * hidden].iter_mut().zip(&w) {
                *o += xv * wv;
            }
        }
    }
    let total: Vec<f64> = (0..tokens * hidden)
        .map(|i| fine.iter().map(|p| p[i]).sum())
        .collect();
    let k = MEDIAN / median_abs(&total);
    for p in &mut fine {
        p.iter_mut().for_each(|v| *v *= k);
    }
    ranks
        .iter()
        .map(|&nr| {
            let group = SHARDS / nr;
            let parts: Vec<Vec<bf16>> = (0..nr)
                .map(|r| {
                    let sum: Vec<f64> = (0..tokens * hidden)
                        .map(|i| fine[r * group..(r + 1) * group].iter().map(|p| p[i]).sum())
                        .collect();
                    to_bf16(&sum)
                })
                .collect();
            let mut p = Problem::new(format!("row-linear N={nr}"), tokens, hidden, parts);
            p.notes.push(format!(
                "Y = X W with X {tokens} x {k_dim}, W {k_dim} x {hidden}, K split over {nr} ranks"
            ));
            let d = describe(
                &p.ranks[0]
                    .iter()
                    .map(|v| f64::from(v.to_f32()))
                    .collect::<Vec<_>>(),
            );
            p.notes.push(format!(
                "rank 0 partial: median |x| {:.3}, max |x| {:.1}, kurtosis {:.1}",
                d.median_abs, d.max_abs, d.kurtosis
            ));
            p.describe();
            p
        })
        .collect()
}
