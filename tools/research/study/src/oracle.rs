//! A bound on what any per-group scalar codec can reach: the "oracle" all-reduce.
//!
//! For a format of `b` bits, group `g` and `k` spikes, every rank replaces each group of `g`
//! values of its `bf16` partial (the codec's groups of the flattened buffer, a last shorter group
//! included) by the best approximation that uses at most `2^b + k` distinct values, the values
//! chosen for that group alone: the optimal one-dimensional k-means clustering of the group into
//! `2^b + k` clusters, each value replaced by its cluster's mean, solved exactly (dynamic
//! programming over the sorted values, [`quantize_group`]). The ranks' approximations are summed
//! in `f32` in rank order and rounded to `bf16`, as the one-shot all-reduce does.
//!
//! Why it is a bound: a codec that gives every value one of `2^b` codes per group (any levels,
//! uniform or not, any range rule) and keeps `k` values per group exactly (any selection) maps the
//! group onto at most `2^b + k` distinct values, so its squared error on that group is at least
//! the k-means optimum. The levels' metadata is free here, and the spikes may be chosen freely, so
//! no real format of that shape is as accurate on any group. What it does not bound: codecs that
//! are not per-group scalar (vector quantization, entropy coding, error feedback across calls),
//! and the perplexity only through the all-reduce's squared error (the study measures both).
//!
//! Only the one-shot is simulated: a two-step quantizes twice and cannot do better than its first
//! step.

use crate::spec::Spec;
use half::bf16;

/// Replaces `xs` by its optimal approximation with at most `levels` distinct values (minimum
/// sum of squared errors; each value becomes the mean of its cluster, rounded to `f32`). Exact:
/// the clusters of an optimal 1-D k-means solution are contiguous runs of the sorted values, and
/// the best split points are found by dynamic programming with the divide-and-conquer
/// optimization (the split point of the last cluster does not decrease as the prefix grows).
/// Values must not be NaN. `levels == 0` is treated as 1.
pub fn quantize_group(xs: &mut [f32], levels: usize) {
    let n = xs.len();
    let levels = levels.max(1);
    if n <= levels {
        return;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
    let sorted: Vec<f64> = order.iter().map(|&i| f64::from(xs[i])).collect();
    let mut s1 = vec![0f64; n + 1];
    let mut s2 = vec![0f64; n + 1];
    for (t, &v) in sorted.iter().enumerate() {
        s1[t + 1] = s1[t] + v;
        s2[t + 1] = s2[t] + v * v;
    }
    let inv: Vec<f64> = (0..=n)
        .map(|l| if l == 0 { 0.0 } else { 1.0 / l as f64 })
        .collect();
    // Squared error of one cluster holding sorted[i..j] (i < j) around its mean.
    let cost = |i: usize, j: usize| -> f64 {
        let (a, b) = (s1[j] - s1[i], s2[j] - s2[i]);
        (b - a * a * inv[j - i]).max(0.0)
    };
    // prev[j]: best error of sorted[..j] with c clusters; arg[c * (n + 1) + j]: start of the
    // last cluster in the best split of sorted[..j] into at most c + 1 clusters (row 0: 0).
    let mut prev: Vec<f64> = (0..=n)
        .map(|j| if j == 0 { 0.0 } else { cost(0, j) })
        .collect();
    let mut arg = vec![0usize; levels * (n + 1)];
    let mut cur = vec![0f64; n + 1];
    for row in arg.chunks_mut(n + 1).skip(1) {
        cur[0] = 0.0;
        solve(1, n, 0, n - 1, &prev, &cost, &mut cur, row);
        std::mem::swap(&mut prev, &mut cur);
    }
    let mut j = n;
    let mut c = levels - 1;
    while j > 0 {
        let i = arg[c * (n + 1) + j];
        let mean = (s1[j] - s1[i]) / (j - i) as f64;
        for &o in &order[i..j] {
            xs[o] = mean as f32;
        }
        j = i;
        c = c.saturating_sub(1);
    }
}

/// Fills `cur[j]` for `j` in `lo..=hi` with `min over i < j of prev[i] + cost(i, j)`, knowing that
/// the best `i` lies in `opt_lo..=opt_hi`, and records it in `arg[j]`.
#[allow(clippy::too_many_arguments)]
fn solve<F: Fn(usize, usize) -> f64>(
    lo: usize,
    hi: usize,
    opt_lo: usize,
    opt_hi: usize,
    prev: &[f64],
    cost: &F,
    cur: &mut [f64],
    arg: &mut [usize],
) {
    if lo > hi {
        return;
    }
    let mid = (lo + hi) / 2;
    let mut best = (f64::INFINITY, opt_lo);
    for (i, &p) in prev
        .iter()
        .enumerate()
        .take(opt_hi.min(mid - 1) + 1)
        .skip(opt_lo)
    {
        let v = p + cost(i, mid);
        if v < best.0 {
            best = (v, i);
        }
    }
    cur[mid] = best.0;
    arg[mid] = best.1;
    if mid > lo {
        solve(lo, mid - 1, opt_lo, best.1, prev, cost, cur, arg);
    }
    solve(mid + 1, hi, best.1, opt_hi, prev, cost, cur, arg);
}

/// One rank's partial as the oracle approximates it, group by group (see the module comment).
pub fn approximate(f: Spec, values: &[bf16]) -> Vec<f32> {
    let levels = (1usize << f.bits) + usize::from(f.spikes);
    let mut out: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
    for g in out.chunks_mut(usize::from(f.group).max(1)) {
        quantize_group(g, levels);
    }
    out
}

/// The oracle one-shot all-reduce: every rank's partial approximated (see [`approximate`]),
/// summed in `f32` in rank order and rounded to `bf16` (see [`sum_approximations`]).
pub fn one_shot(f: Spec, inputs: &[&[bf16]]) -> Vec<bf16> {
    sum_approximations(inputs, |x| approximate(f, x))
}

/// A one-shot all-reduce of per-rank approximations: `approx` of every rank's partial, summed in
/// `f32` in rank order (`acc = v_0; acc = acc + v_i`) and rounded to `bf16`.
pub fn sum_approximations(inputs: &[&[bf16]], approx: impl Fn(&[bf16]) -> Vec<f32>) -> Vec<bf16> {
    let mut acc = match inputs.first() {
        Some(first) => approx(first),
        None => return Vec::new(),
    };
    for x in &inputs[1..] {
        acc.iter_mut().zip(approx(x)).for_each(|(a, v)| *a += v);
    }
    acc.into_iter().map(bf16::from_f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimum by brute force: every way to cut the sorted values into at most `levels` runs.
    fn brute(xs: &[f32], levels: usize) -> f64 {
        let mut s: Vec<f64> = xs.iter().map(|&v| f64::from(v)).collect();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let sse = |a: &[f64]| {
            let m = a.iter().sum::<f64>() / a.len() as f64;
            a.iter().map(|v| (v - m) * (v - m)).sum::<f64>()
        };
        let mut best = f64::INFINITY;
        // Bit t of `cuts` set: a cluster starts at t + 1.
        for cuts in 0u32..(1 << (n - 1)) {
            if cuts.count_ones() as usize + 1 > levels {
                continue;
            }
            let (mut start, mut total) = (0, 0.0);
            for t in 0..n {
                if t == n - 1 || cuts >> t & 1 == 1 {
                    total += sse(&s[start..=t]);
                    start = t + 1;
                }
            }
            best = best.min(total);
        }
        best
    }

    fn sse(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
            .sum()
    }

    #[test]
    fn matches_brute_force_and_uses_at_most_levels_values() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        };
        for n in [1usize, 2, 5, 9, 14] {
            for levels in 1..=6 {
                let xs: Vec<f32> = (0..n)
                    .map(|i| if i == 3 { 100.0 } else { next() })
                    .collect();
                let mut q = xs.clone();
                quantize_group(&mut q, levels);
                let mut distinct = q.clone();
                distinct.sort_by(f32::total_cmp);
                distinct.dedup();
                assert!(distinct.len() <= levels, "n {n} levels {levels}");
                let (got, want) = (sse(&xs, &q), brute(&xs, levels));
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want),
                    "n {n} levels {levels}: {got} against {want}"
                );
            }
        }
    }

    /// The optimum by the plain O(levels * n^2) dynamic programme.
    fn plain_dp(xs: &[f32], levels: usize) -> f64 {
        let mut s: Vec<f64> = xs.iter().map(|&v| f64::from(v)).collect();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let cost = |i: usize, j: usize| {
            let m = s[i..j].iter().sum::<f64>() / (j - i) as f64;
            s[i..j].iter().map(|v| (v - m) * (v - m)).sum::<f64>()
        };
        let mut prev: Vec<f64> = (0..=n)
            .map(|j| if j == 0 { 0.0 } else { cost(0, j) })
            .collect();
        for _ in 1..levels {
            prev = (0..=n)
                .map(|j| {
                    let start = if j == 0 { 0.0 } else { f64::INFINITY };
                    (0..j).map(|i| prev[i] + cost(i, j)).fold(start, f64::min)
                })
                .collect();
        }
        prev[n]
    }

    #[test]
    fn matches_the_plain_programme_on_full_groups() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as f32 / (1u64 << 31) as f32 - 0.5
        };
        for (n, levels) in [(32usize, 6usize), (128, 18), (128, 6), (64, 10)] {
            let xs: Vec<f32> = (0..n)
                .map(|i| {
                    let u = next();
                    if i % 17 == 3 {
                        u * 300.0
                    } else {
                        u * u * u * 10.0
                    }
                })
                .collect();
            let mut q = xs.clone();
            quantize_group(&mut q, levels);
            let (got, want) = (sse(&xs, &q), plain_dp(&xs, levels));
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want),
                "n {n} levels {levels}: {got} against {want}"
            );
        }
    }

    #[test]
    fn no_error_when_the_group_has_few_values() {
        let xs = [3.0f32, -1.0, 3.0, 25_000.0, -1.0, 0.5];
        let mut q = xs;
        quantize_group(&mut q, 4);
        assert_eq!(q, xs);
    }

    #[test]
    fn bounds_the_codec() {
        // Heavy-tailed partials with a massive value: the oracle's squared error is below the
        // codec's one-shot at the same width, group and spikes.
        let mut state = 1u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as f32 / (1u64 << 31) as f32 - 0.5
        };
        let mk = |next: &mut dyn FnMut() -> f32| -> Vec<bf16> {
            (0..4096)
                .map(|i| {
                    let v = next() * if i % 97 == 5 { 40.0 } else { 1.0 };
                    bf16::from_f32(if i == 700 { 25_000.0 } else { v })
                })
                .collect()
        };
        let a = mk(&mut next);
        let b = mk(&mut next);
        let inputs = [a.as_slice(), b.as_slice()];
        let exact: Vec<f32> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| x.to_f32() + y.to_f32())
            .collect();
        for (bits, group, spikes) in [(2u8, 32u16, 2u8), (3, 64, 0), (4, 128, 2)] {
            let f = Spec {
                bits,
                group,
                spikes,
            };
            let fmt =
                flashcomm_codec::Format::new(flashcomm_codec::DType::Bf16, bits, group, spikes)
                    .unwrap();
            let codec: Vec<f32> = flashcomm_codec::reference::allreduce_oneshot(fmt, &inputs)
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let oracle: Vec<f32> = one_shot(f, &inputs).iter().map(|v| v.to_f32()).collect();
            let (eo, ec) = (sse(&oracle, &exact), sse(&codec, &exact));
            assert!(eo < ec, "{f}: oracle {eo} codec {ec}");
        }
    }
}
