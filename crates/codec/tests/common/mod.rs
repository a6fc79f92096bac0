//! Seeded data generators and independent checks shared by the codec tests.

#![allow(dead_code)]

use flashcomm_codec::{Element, Format};

/// The tree's one seeded generator.
pub use flashcomm_codec::rng::Rng;

/// Kinds of test data.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// Gaussian, unit scale.
    Gaussian,
    /// Gaussian bulk with rare outliers up to 10^4 times larger.
    Outliers,
    /// Values of widely varying magnitude (log-uniform over many binades, random sign).
    LogUniform,
    /// Tiny values, around the smallest normal of the type and below (subnormals).
    Tiny,
    /// Values near the largest finite value of the type.
    Huge,
    /// Few distinct values: constant runs, zeros of both signs.
    Plateaus,
    /// A mix of the above with infinities and signed zeros sprinkled in (no NaN).
    Specials,
}

pub const ALL_KINDS: [Kind; 7] = [
    Kind::Gaussian,
    Kind::Outliers,
    Kind::LogUniform,
    Kind::Tiny,
    Kind::Huge,
    Kind::Plateaus,
    Kind::Specials,
];

fn max_of<T: Element>() -> f64 {
    T::MAX
}

fn min_normal_of<T: Element>() -> f64 {
    2f64.powi(T::MIN_EXP)
}

/// One value of the given kind, as f64 (rounded to T by the caller).
fn sample<T: Element>(rng: &mut Rng, kind: Kind) -> f64 {
    let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
    match kind {
        Kind::Gaussian => rng.normal(),
        Kind::Outliers => {
            let x = rng.normal();
            if rng.below(100) == 0 {
                x * 10f64.powf(1.0 + 3.0 * rng.uniform())
            } else {
                x
            }
        }
        Kind::LogUniform => {
            let lo = (min_normal_of::<T>()).log2();
            let hi = max_of::<T>().log2() - 1.0;
            sign * (lo + (hi - lo) * rng.uniform()).exp2()
        }
        Kind::Tiny => {
            let scale = min_normal_of::<T>() * 4.0;
            match rng.below(4) {
                0 => 0.0,
                1 => sign * scale * rng.uniform() * 0.25,
                _ => sign * scale * rng.uniform(),
            }
        }
        Kind::Huge => {
            let m = max_of::<T>();
            sign * m * (0.25 + 0.75 * rng.uniform())
        }
        Kind::Plateaus => match rng.below(5) {
            0 => 0.0,
            1 => -0.0,
            2 => 1.5,
            3 => -2.0,
            _ => 1.5 + f64::from(rng.below(3) as u32) * 0.25,
        },
        Kind::Specials => match rng.below(40) {
            0 => f64::INFINITY,
            1 => f64::NEG_INFINITY,
            2 => -0.0,
            3 => 0.0,
            4 => min_normal_of::<T>() * rng.uniform(),
            5 => -max_of::<T>(),
            _ => rng.normal() * 3.0,
        },
    }
}

/// `n` values of `kind`, rounded to T.
pub fn gen_values<T: Element>(rng: &mut Rng, n: usize, kind: Kind) -> Vec<T> {
    (0..n)
        .map(|_| {
            let x = sample::<T>(rng, kind);
            to_elem::<T>(x)
        })
        .collect()
}

/// Rounds an f64 to T (through f32, which is exact enough for test data; infinities kept).
pub fn to_elem<T: Element>(x: f64) -> T {
    T::from_f32(x as f32)
}

/// Indices (inside a group of valid values `xs`) that the spec's spike selection picks, computed
/// independently of the codec by sorting.
pub fn expected_spikes(xs: &[f32], k: usize) -> Vec<usize> {
    let mut asc: Vec<usize> = (0..xs.len()).collect();
    asc.sort_by(|&a, &b| xs[a].partial_cmp(&xs[b]).unwrap().then(a.cmp(&b)));
    let mut desc: Vec<usize> = (0..xs.len()).collect();
    desc.sort_by(|&a, &b| xs[b].partial_cmp(&xs[a]).unwrap().then(a.cmp(&b)));
    let mut picked: Vec<usize> = Vec::new();
    let ke = k.min(xs.len());
    for p in 0..ke {
        let order = if p % 2 == 0 { &asc } else { &desc };
        let i = *order.iter().find(|i| !picked.contains(i)).unwrap();
        picked.push(i);
    }
    picked
}

/// Block size computed from the table in docs/codec.md, independently of the layout methods.
pub fn spec_block_bytes(fmt: &Format) -> usize {
    let g = 1024 / usize::from(fmt.group());
    let s = fmt.dtype().size();
    let k = usize::from(fmt.spikes());
    let raw = 16 + 128 * usize::from(fmt.bits()) + g * 2 * s + g * k * s + g * k;
    raw.div_ceil(16) * 16
}
