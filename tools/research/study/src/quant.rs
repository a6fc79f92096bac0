//! Dequantization of the ggml block formats used by the model file into `f32`.
//!
//! * `F32`: little-endian floats.
//! * `F16`: little-endian IEEE halves.
//! * `Q8_0`: blocks of 32 values, 34 bytes: an f16 scale `d`, then 32 signed bytes `q`;
//!   value `i` is `d * q[i]`.
//! * `Q4_1`: blocks of 32 values, 20 bytes: an f16 scale `d`, an f16 minimum `m`, then 16 bytes.
//!   Byte `j` holds value `j` in its low nibble and value `j + 16` in its high nibble; a value is
//!   `d * q + m`.

use crate::gguf::GgmlType;
use half::f16;

/// Values per block of the quantized formats.
pub const QK: usize = 32;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes `Q4_1` blocks; `out.len()` must be `32 * data.len() / 20`.
pub fn dequant_q4_1(data: &[u8], out: &mut [f32]) {
    assert_eq!(
        data.len() % 20,
        0,
        "Q4_1 data is not a whole number of blocks"
    );
    assert_eq!(
        out.len(),
        data.len() / 20 * QK,
        "Q4_1 output has the wrong length"
    );
    for (blk, o) in data.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(blk, 0);
        let m = f16_at(blk, 2);
        let (lo, hi) = o.split_at_mut(QK / 2);
        for (j, &q) in blk[4..20].iter().enumerate() {
            lo[j] = f32::from(q & 0x0F) * d + m;
            hi[j] = f32::from(q >> 4) * d + m;
        }
    }
}

/// Dequantizes `Q8_0` blocks; `out.len()` must be `32 * data.len() / 34`.
pub fn dequant_q8_0(data: &[u8], out: &mut [f32]) {
    assert_eq!(
        data.len() % 34,
        0,
        "Q8_0 data is not a whole number of blocks"
    );
    assert_eq!(
        out.len(),
        data.len() / 34 * QK,
        "Q8_0 output has the wrong length"
    );
    for (blk, o) in data.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(blk, 0);
        for (x, &q) in o.iter_mut().zip(&blk[2..34]) {
            *x = f32::from(q as i8) * d;
        }
    }
}

/// Dequantizes a tensor's raw bytes of the given type to a new vector of `n` floats.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let mut out = vec![0f32; n];
    let check = |bytes: usize| {
        if data.len() == bytes {
            Ok(())
        } else {
            Err(format!(
                "{ty:?}: {} bytes for {n} values, expected {bytes}",
                data.len()
            ))
        }
    };
    match ty {
        GgmlType::F32 => {
            check(4 * n)?;
            for (x, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            check(2 * n)?;
            for (x, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *x = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q4_1 | GgmlType::Q8_0 => {
            if !n.is_multiple_of(QK) {
                return Err(format!("{ty:?}: {n} values is not a multiple of {QK}"));
            }
            if ty == GgmlType::Q4_1 {
                check(n / QK * 20)?;
                dequant_q4_1(data, &mut out);
            } else {
                check(n / QK * 34)?;
                dequant_q8_0(data, &mut out);
            }
        }
        GgmlType::Other(t) => return Err(format!("ggml type {t} is not supported")),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q4_1_block() {
        // d = 0.5, m = -4; byte j holds code j (low nibble, value j) and 15 - j (high nibble,
        // value j + 16).
        let mut blk = Vec::new();
        blk.extend(h(0.5));
        blk.extend(h(-4.0));
        blk.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequant_q4_1(&blk, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 4.0, "value {j}");
            assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 4.0, "value {}", j + 16);
        }
    }

    #[test]
    fn q8_0_blocks() {
        let mut data = Vec::new();
        for d in [0.25f32, -2.0] {
            data.extend(h(d));
            data.extend((0..32).map(|i: i32| (i * 8 - 128) as i8 as u8));
        }
        let v = dequantize(GgmlType::Q8_0, &data, 64).unwrap();
        for i in 0..32 {
            let q = (i * 8 - 128) as f32;
            assert_eq!(v[i as usize], 0.25 * q);
            assert_eq!(v[32 + i as usize], -2.0 * q);
        }
    }

    #[test]
    fn f16_f32_and_size_checks() {
        let v = dequantize(GgmlType::F16, &[h(1.5), h(-0.125)].concat(), 2).unwrap();
        assert_eq!(v, vec![1.5, -0.125]);
        assert!(dequantize(GgmlType::F32, &[0u8; 7], 2).is_err());
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 20], 16).is_err());
        assert!(dequantize(GgmlType::Other(12), &[0u8; 4], 1).is_err());
    }
}
