//! A non-uniform code grid, an experiment on the codec's format: the same metadata (each
//! group's `k` spikes kept exactly with the codec's selection, the range `[lo, hi]` of the other
//! values), but the `2^b` codes stand for levels that are denser near the middle of the range
//! than at its ends.
//!
//! With `K = 2^b` codes and an exponent `p >= 1`, code `i` stands for
//! `lo + (hi - lo) * (1 + s(u) |u|^p) / 2` where `u = -1 + 2i / (K - 1)` and `s` is the sign:
//! `p = 1` is the codec's uniform grid, larger `p` moves the levels towards the middle (the ends
//! `lo` and `hi` stay levels). Every value gets the nearest level (computed in `f64`); the
//! reconstruction is rounded to `f32`. The wire cost is the codec's format of the same width,
//! group and spikes (same payload and metadata), so the study reports the codec's effective bits.
//!
//! Only the one-shot is simulated: each rank's partial is approximated group by group, the
//! approximations are summed in `f32` in rank order and rounded to `bf16`.

use crate::spec::Spec;
use crate::spike_rotation::select_spikes;
use half::bf16;

/// The levels of the grid on `[0, 1]`, ascending, for `codes` codes and exponent `p`.
pub fn levels(codes: usize, p: f64) -> Vec<f64> {
    let last = codes.max(2) - 1;
    (0..=last)
        .map(|i| {
            let u = -1.0 + 2.0 * i as f64 / last as f64;
            (1.0 + u.signum() * u.abs().powf(p)) / 2.0
        })
        .collect()
}

/// Approximates one group in place: spikes kept, the others moved to the nearest grid level of
/// the range of the non-spike values.
pub fn approximate_group(xs: &mut [f32], spikes: usize, grid: &[f64]) {
    let picked = select_spikes(xs, spikes);
    let mut is_spike = vec![false; xs.len()];
    picked.iter().for_each(|&i| is_spike[i] = true);
    let rest = || {
        xs.iter()
            .zip(&is_spike)
            .filter(|&(_, &s)| !s)
            .map(|(&v, _)| f64::from(v))
    };
    let lo = rest().fold(f64::INFINITY, f64::min);
    let hi = rest().fold(f64::NEG_INFINITY, f64::max);
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return; // no other value, or all equal: exact
    }
    let mids: Vec<f64> = grid.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    for (x, &s) in xs.iter_mut().zip(&is_spike) {
        if s {
            continue;
        }
        let t = (f64::from(*x) - lo) / (hi - lo);
        let i = mids.partition_point(|&m| m < t);
        *x = (lo + (hi - lo) * grid[i]) as f32;
    }
}

/// One rank's partial approximated group by group.
pub fn approximate(f: Spec, p: f64, values: &[bf16]) -> Vec<f32> {
    let grid = levels(1usize << f.bits, p);
    let mut out: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
    for g in out.chunks_mut(usize::from(f.group).max(1)) {
        approximate_group(g, f.spikes.into(), &grid);
    }
    out
}

/// The one-shot all-reduce with the grid: approximations summed in `f32` in rank order, rounded
/// to `bf16` (see [`crate::oracle::sum_approximations`]).
pub fn one_shot(f: Spec, p: f64, inputs: &[&[bf16]]) -> Vec<bf16> {
    crate::oracle::sum_approximations(inputs, |x| approximate(f, p, x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_ends_and_symmetry() {
        for p in [1.0, 1.5, 2.0] {
            let g = levels(16, p);
            assert_eq!(g.len(), 16);
            assert_eq!((g[0], g[15]), (0.0, 1.0));
            for i in 0..16 {
                assert!((g[i] + g[15 - i] - 1.0).abs() < 1e-12);
            }
            assert!(g.windows(2).all(|w| w[0] < w[1]));
        }
        let u = levels(4, 1.0);
        assert_eq!(u, vec![0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0]);
        // p = 2 puts the middle levels closer together than the outer ones.
        let q = levels(8, 2.0);
        assert!(q[4] - q[3] < q[1] - q[0]);
    }

    #[test]
    fn uniform_grid_is_close_to_the_codec() {
        // p = 1 is the codec's grid; the two differ only in rounding (f64 here, the codec's f32
        // arithmetic and round-half-even there), so their errors are nearly the same.
        let mut s = 5u64;
        let mut r = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let a: Vec<bf16> = (0..4096)
            .map(|i| bf16::from_f32(if i % 61 == 9 { 30.0 * r() } else { r() }))
            .collect();
        let b: Vec<bf16> = (0..4096).map(|_| bf16::from_f32(r())).collect();
        let inputs = [a.as_slice(), b.as_slice()];
        let exact: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(x.to_f32()) + f64::from(y.to_f32()))
            .collect();
        let err = |q: &[bf16]| {
            q.iter()
                .zip(&exact)
                .map(|(v, e)| (f64::from(v.to_f32()) - e).powi(2))
                .sum::<f64>()
        };
        let f = Spec {
            bits: 3,
            group: 64,
            spikes: 2,
        };
        let fmt = flashcomm_codec::Format::new(flashcomm_codec::DType::Bf16, 3, 64, 2).unwrap();
        let codec = err(&flashcomm_codec::reference::allreduce_oneshot(fmt, &inputs));
        let grid = err(&one_shot(f, 1.0, &inputs));
        assert!(
            (grid / codec - 1.0).abs() < 0.05,
            "grid {grid} codec {codec}"
        );
        // Spikes stay exact, and so do the ends of the range (they are levels).
        let mut g = vec![1.0f32, -250.0, 0.5, 0.25, 300.0, -0.5, 0.0, 0.75];
        approximate_group(&mut g, 2, &levels(4, 1.5));
        assert_eq!((g[1], g[4]), (-250.0, 300.0));
        assert_eq!((g[5], g[0]), (-0.5, 1.0));
        // 0.75 is at t = 5/6 of [-0.5, 1], above the last midpoint: it becomes hi.
        assert_eq!(g[7], 1.0);
    }
}
