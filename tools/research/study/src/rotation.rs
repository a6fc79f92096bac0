//! The randomized Hadamard rotation of quantization groups, an experiment on top of the codec:
//! each rank rotates its partial group by group before encoding, the all-reduce runs unchanged in
//! the rotated domain, and the result is rotated back after the final decode. The rotation is
//! linear and orthogonal, so the sum of the rotated partials is the rotated sum.
//!
//! For a group `x` of `g` values (`g` a power of two, the format's group size):
//! `y = H_g · (s ⊙ x) / sqrt(g)` and back `x = s ⊙ (H_g · y) / sqrt(g)`, where `H_g` is the
//! unnormalized Walsh–Hadamard matrix (entries ±1, applied with the in-place butterfly) and `s` a
//! fixed ±1 pattern over the positions inside a group, derived from [`SEED`] with a SplitMix64
//! hash: the same on every rank, every group and every call. Everything is computed in `f32`
//! (the butterflies, then one multiplication by the `f32` value of `1/sqrt(g)`), as a GPU kernel
//! would. Groups are consecutive values of the flattened buffer, the codec's groups; a tail
//! shorter than a group is left as it is.

use flashcomm_codec::rng::splitmix64;

/// The seed of the sign pattern.
pub const SEED: u64 = 0x05EE_D0FC_0DEC;

/// The sign of position `i` inside a group: `+1` or `-1` from the top bit of a hash of the
/// seed and the position.
pub fn sign(seed: u64, i: usize) -> f32 {
    if splitmix64(seed ^ splitmix64(i as u64)) >> 63 == 0 {
        1.0
    } else {
        -1.0
    }
}

/// In-place unnormalized fast Walsh–Hadamard transform of a slice whose length is a power of
/// two (`n log2 n` additions and subtractions).
pub fn fwht(v: &mut [f32]) {
    let n = v.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for block in v.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
}

/// The rotation of groups of `g` values.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    signs: Vec<f32>,
    scale: f32,
}

impl Rotation {
    /// The rotation of groups of `group` values with the signs of [`SEED`]. Panics unless
    /// `group` is a power of two.
    pub fn new(group: usize) -> Rotation {
        Rotation::with_seed(group, SEED)
    }

    /// The rotation of groups of `group` values with the signs of `seed`.
    pub fn with_seed(group: usize, seed: u64) -> Rotation {
        assert!(
            group.is_power_of_two(),
            "rotation group {group} is not a power of two"
        );
        Rotation {
            signs: (0..group).map(|i| sign(seed, i)).collect(),
            scale: (group as f32).sqrt().recip(),
        }
    }

    /// The group size.
    pub fn group(&self) -> usize {
        self.signs.len()
    }

    /// Rotates every whole group of `buf` in place; a shorter tail is left unrotated.
    pub fn forward(&self, buf: &mut [f32]) {
        for g in buf.chunks_exact_mut(self.group()) {
            g.iter_mut().zip(&self.signs).for_each(|(v, &s)| *v *= s);
            fwht(g);
            g.iter_mut().for_each(|v| *v *= self.scale);
        }
    }

    /// The inverse of [`Rotation::forward`] (up to `f32` rounding).
    pub fn inverse(&self, buf: &mut [f32]) {
        for g in buf.chunks_exact_mut(self.group()) {
            fwht(g);
            g.iter_mut()
                .zip(&self.signs)
                .for_each(|(v, &s)| *v *= self.scale * s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = splitmix64(seed.wrapping_mul(1_000_003) ^ i as u64);
                // Uniform in [-1, 1), with a few large values like a massive activation.
                let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                if h.is_multiple_of(97) { u * 3000.0 } else { u }
            })
            .collect()
    }

    fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
        let (mut num, mut den) = (0f64, 0f64);
        for (&x, &y) in a.iter().zip(b) {
            num += (f64::from(x) - f64::from(y)).powi(2);
            den += f64::from(y).powi(2);
        }
        (num / den).sqrt()
    }

    #[test]
    fn hadamard_matches_the_matrix() {
        // H_4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]].
        let mut v = [1.0, 2.0, 3.0, 4.0];
        fwht(&mut v);
        assert_eq!(v, [10.0, -2.0, -4.0, 0.0]);
        // H_n H_n = n I.
        let x = data(256, 1);
        let mut y = x.clone();
        fwht(&mut y);
        fwht(&mut y);
        for (a, b) in y.iter().zip(&x) {
            assert!((a / 256.0 - b).abs() <= 1e-6 * 3000.0, "{a} {b}");
        }
    }

    #[test]
    fn signs_are_fixed_and_mixed() {
        let r = Rotation::new(256);
        assert_eq!(r, Rotation::new(256));
        let minus = r.signs.iter().filter(|&&s| s < 0.0).count();
        assert!((96..=160).contains(&minus), "{minus} negative signs of 256");
        // The pattern of a smaller group is the start of the larger one's.
        assert_eq!(Rotation::new(32).signs, r.signs[..32]);
        assert_ne!(Rotation::with_seed(256, 1).signs, r.signs);
    }

    #[test]
    fn rotation_round_trips_and_is_orthogonal() {
        for g in [32, 64, 128, 256] {
            let r = Rotation::new(g);
            let x = data(10 * g + 17, g as u64);
            let mut y = x.clone();
            r.forward(&mut y);
            assert_ne!(y, x);
            // The tail is left as it is.
            assert_eq!(y[10 * g..], x[10 * g..]);
            // Orthogonal: the norm is kept.
            let n2 = |v: &[f32]| v.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>();
            assert!((n2(&y) / n2(&x) - 1.0).abs() < 1e-5, "g{g}");
            // The massive values are spread: no rotated value is close to the largest input.
            let max = |v: &[f32]| v.iter().fold(0f32, |m, &a| m.max(a.abs()));
            assert!(max(&y[..10 * g]) < 0.7 * max(&x[..10 * g]), "g{g}");
            let mut z = y.clone();
            r.inverse(&mut z);
            let e = rel_l2(&z, &x);
            assert!(e < 1e-6, "g{g}: round-trip error {e}");
        }
    }

    #[test]
    fn rotation_commutes_with_summation() {
        for g in [32, 128, 256] {
            let r = Rotation::new(g);
            let parts: Vec<Vec<f32>> = (0..4).map(|k| data(8 * g, 100 + k)).collect();
            let sum = |vs: &[Vec<f32>]| {
                let mut s = vs[0].clone();
                for v in &vs[1..] {
                    s.iter_mut().zip(v).for_each(|(a, &b)| *a += b);
                }
                s
            };
            let mut rotated_sum = sum(&parts);
            r.forward(&mut rotated_sum);
            let rotated: Vec<Vec<f32>> = parts
                .iter()
                .map(|p| {
                    let mut p = p.clone();
                    r.forward(&mut p);
                    p
                })
                .collect();
            let sum_rotated = sum(&rotated);
            let e = rel_l2(&sum_rotated, &rotated_sum);
            assert!(e < 1e-6, "g{g}: {e}");
            // And back: the inverse of the sum of rotated partials is the plain sum.
            let mut back = sum_rotated;
            r.inverse(&mut back);
            let e = rel_l2(&back, &sum(&parts));
            assert!(e < 1e-6, "g{g}: {e}");
        }
    }
}
