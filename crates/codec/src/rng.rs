//! The one seeded generator of the tree: SplitMix64, with the distributions that test data,
//! benchmark inputs and the accuracy studies draw from. Deterministic for a given seed on every
//! platform (the normals use libm's `ln`, `sqrt` and `sin_cos`; no statistic depends on their
//! last bit).
//!
//! * [`mix64`] is SplitMix64's finalizer, and [`splitmix64`] one step of it applied to a counter:
//!   counter-based generators (value i of rank r as a pure function of (seed, r, i)) and hashes
//!   build on them.
//! * [`Rng`] is the sequential generator.

/// SplitMix64's increment (the golden ratio in 64-bit fixed point).
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finalizer: a bijective mix of 64 bits.
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One SplitMix64 output for state `z` (the state advanced by [`GAMMA`], then mixed): a hash of
/// one 64-bit number.
pub const fn splitmix64(z: u64) -> u64 {
    mix64(z.wrapping_add(GAMMA))
}

/// Uniform in [0, 1) from the top 53 bits of `bits`.
pub fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// SplitMix64 with Box-Muller normals.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
    spare: Option<f64>,
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed ^ 0x6A09_E667_F3BC_C909,
            spare: None,
        }
    }

    /// A generator derived from `seed` and a stream number, independent of how much of any other
    /// stream was used.
    pub fn fork(seed: u64, stream: u64) -> Rng {
        let mut r = Rng::new(seed.wrapping_add(stream.wrapping_mul(GAMMA)));
        r.next_u64();
        r
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// Uniform in [-1, 1).
    pub fn signed_unit(&mut self) -> f64 {
        2.0 * self.uniform() - 1.0
    }

    /// Uniform integer in [0, n) (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }

    /// Standard normal (Box-Muller; the second value of each pair is kept for the next call).
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        self.spare = Some(r * s);
        r * c
    }

    /// Student-t with `nu` (integer) degrees of freedom.
    pub fn student_t(&mut self, nu: u32) -> f64 {
        let z = self.normal();
        let chi2: f64 = (0..nu).map(|_| self.normal().powi(2)).sum();
        z / (chi2 / f64::from(nu)).sqrt()
    }

    /// Log-normal: `exp(sigma * N(0, 1))`.
    pub fn log_normal(&mut self, sigma: f64) -> f64 {
        (sigma * self.normal()).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_its_published_first_outputs() {
        // The sequence from state 0: the first outputs of the reference SplitMix64.
        let mut r = Rng {
            state: 0,
            spare: None,
        };
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn distributions_stay_in_range() {
        let mut r = Rng::new(7);
        let mut sum = 0.0;
        for _ in 0..10_000 {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
            assert!(r.below(10) < 10);
            let s = r.signed_unit();
            assert!((-1.0..1.0).contains(&s));
            sum += r.normal();
        }
        assert!((sum / 10_000.0).abs() < 0.05);
        let a: Vec<u64> = (0..4).map(|_| Rng::fork(1, 2).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(Rng::fork(1, 2).next_u64(), Rng::fork(1, 3).next_u64());
    }
}
