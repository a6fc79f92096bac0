//! The element types the codec accepts: `f32`, `half::f16` and `half::bf16`.

use half::{bf16, f16};

use crate::format::DType;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type of the codec. Sealed: implemented for `f32`, `half::f16` and `half::bf16` only.
///
/// Conversions to `f32` are exact; conversions from `f32` round to nearest, ties to even, keep
/// subnormals, and turn every NaN into the type's canonical quiet NaN (so results that are NaN
/// compare equal bit for bit, whatever NaN the arithmetic produced).
pub trait Element:
    sealed::Sealed + Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static
{
    /// The format's name for this type.
    const DTYPE: DType;
    /// Size in bytes.
    const BYTES: usize;
    /// Bits of the canonical quiet NaN: f32 `0x7FC00000`, f16 `0x7E00`, bf16 `0x7FC0`.
    const CANONICAL_NAN_BITS: u32;
    /// Explicit mantissa bits (23, 10, 7).
    const MANTISSA_BITS: i32;
    /// Exponent of the smallest normal value (-126, -14, -126).
    const MIN_EXP: i32;
    /// The largest finite value, as f64.
    const MAX: f64;

    /// Exact conversion to `f32`.
    fn to_f32(self) -> f32;
    /// Round-to-nearest-even conversion from `f32`; NaN becomes the canonical NaN.
    fn from_f32(v: f32) -> Self;
    /// Raw bits, zero-extended.
    fn to_bits(self) -> u32;
    /// The value with these raw bits (the upper bits are ignored for 16-bit types).
    fn from_bits(bits: u32) -> Self;

    /// The canonical quiet NaN.
    fn canonical_nan() -> Self {
        Self::from_bits(Self::CANONICAL_NAN_BITS)
    }

    /// Whether the value is NaN.
    fn is_nan(self) -> bool {
        self.to_f32().is_nan()
    }

    /// Reads a little-endian value from the first `BYTES` bytes of `b`.
    fn read_le(b: &[u8]) -> Self {
        let mut bits = 0u32;
        for (i, byte) in b[..Self::BYTES].iter().enumerate() {
            bits |= u32::from(*byte) << (8 * i);
        }
        Self::from_bits(bits)
    }

    /// Writes the value little-endian into the first `BYTES` bytes of `b`.
    fn write_le(self, b: &mut [u8]) {
        let bits = self.to_bits();
        for (i, byte) in b[..Self::BYTES].iter_mut().enumerate() {
            *byte = (bits >> (8 * i)) as u8;
        }
    }

    /// Unit in the last place of this type at magnitude `|y|` (the spacing of the values of this
    /// type around `y`; subnormal spacing below the smallest normal). Infinite beyond the largest
    /// finite value plus half an ulp, where rounding overflows.
    fn ulp_at(y: f64) -> f64 {
        ulp_generic(y, Self::MANTISSA_BITS, Self::MIN_EXP, Self::MAX)
    }
}

/// Spacing of a binary floating-point type with `mant` explicit mantissa bits and smallest normal
/// exponent `min_exp` around `|y|`.
pub(crate) fn ulp_generic(y: f64, mant: i32, min_exp: i32, max: f64) -> f64 {
    let a = y.abs();
    if a.is_nan() {
        return f64::NAN;
    }
    if a.is_infinite() {
        return f64::INFINITY;
    }
    let e = if a == 0.0 {
        min_exp
    } else {
        // floor(log2(a)) from the f64 exponent; every value of interest is a normal f64.
        let raw = ((a.to_bits() >> 52) & 0x7FF) as i32;
        (raw - 1023).max(min_exp)
    };
    let ulp = 2f64.powi(e - mant);
    if a >= max + ulp_max_half(max, mant) {
        f64::INFINITY
    } else {
        ulp
    }
}

/// Half an ulp of the largest finite value.
fn ulp_max_half(max: f64, mant: i32) -> f64 {
    let raw = ((max.to_bits() >> 52) & 0x7FF) as i32;
    2f64.powi(raw - 1023 - mant - 1)
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    const BYTES: usize = 4;
    const CANONICAL_NAN_BITS: u32 = 0x7FC0_0000;
    const MANTISSA_BITS: i32 = 23;
    const MIN_EXP: i32 = -126;
    const MAX: f64 = f32::MAX as f64;

    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        if v.is_nan() {
            f32::from_bits(Self::CANONICAL_NAN_BITS)
        } else {
            v
        }
    }
    fn to_bits(self) -> u32 {
        f32::to_bits(self)
    }
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    const BYTES: usize = 2;
    const CANONICAL_NAN_BITS: u32 = 0x7E00;
    const MANTISSA_BITS: i32 = 10;
    const MIN_EXP: i32 = -14;
    const MAX: f64 = 65504.0;

    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        if v.is_nan() {
            f16::from_bits(Self::CANONICAL_NAN_BITS as u16)
        } else {
            // `half` rounds to nearest, ties to even, with gradual underflow.
            f16::from_f32(v)
        }
    }
    fn to_bits(self) -> u32 {
        u32::from(f16::to_bits(self))
    }
    fn from_bits(bits: u32) -> Self {
        f16::from_bits(bits as u16)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    const BYTES: usize = 2;
    const CANONICAL_NAN_BITS: u32 = 0x7FC0;
    const MANTISSA_BITS: i32 = 7;
    const MIN_EXP: i32 = -126;
    const MAX: f64 = 3.3895313892515355e38;

    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(bf16::to_bits(self)) << 16)
    }
    fn from_f32(v: f32) -> Self {
        if v.is_nan() {
            return bf16::from_bits(Self::CANONICAL_NAN_BITS as u16);
        }
        // Round to nearest, ties to even, on the upper 16 bits; overflow carries into the
        // exponent and gives infinity, as IEEE rounding does.
        let x = v.to_bits();
        let lsb = (x >> 16) & 1;
        let rounded = x.wrapping_add(0x7FFF + lsb);
        bf16::from_bits((rounded >> 16) as u16)
    }
    fn to_bits(self) -> u32 {
        u32::from(bf16::to_bits(self))
    }
    fn from_bits(bits: u32) -> Self {
        bf16::from_bits(bits as u16)
    }
}
