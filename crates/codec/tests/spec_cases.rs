//! Hand-checked cases of `docs/codec.md`: exact bytes of small blocks, rounding, tie-breaking,
//! NaN, infinities, signed zeros, subnormals, zero-range groups and the element conversions.

mod common;

use flashcomm_codec::{
    BLOCK_VALUES, DType, Element, Format, FormatError, HEADER_BYTES, bf16, decode, decode_f32,
    encode_to_vec, f16, reduce_requantize,
};

fn fmt(d: DType, b: u8, g: u16, k: u8) -> Format {
    Format::new(d, b, g, k).unwrap()
}

fn roundtrip<T: Element>(f: Format, xs: &[T]) -> (Vec<u8>, Vec<T>) {
    let enc = encode_to_vec(f, xs).unwrap();
    let mut out = vec![T::default(); xs.len()];
    decode(f, &enc, xs.len(), &mut out).unwrap();
    (enc, out)
}

fn bits<T: Element>(xs: &[T]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn format_validation() {
    assert_eq!(
        Format::new(DType::F32, 1, 128, 2),
        Err(FormatError::Bits(1))
    );
    assert_eq!(
        Format::new(DType::F32, 9, 128, 2),
        Err(FormatError::Bits(9))
    );
    assert_eq!(
        Format::new(DType::F32, 4, 16, 2),
        Err(FormatError::Group(16))
    );
    assert_eq!(
        Format::new(DType::F32, 4, 512, 2),
        Err(FormatError::Group(512))
    );
    assert_eq!(
        Format::new(DType::F32, 4, 128, 1),
        Err(FormatError::Spikes(1))
    );
    assert_eq!(
        Format::new(DType::F32, 4, 128, 3),
        Err(FormatError::Spikes(3))
    );
    assert_eq!(Format::all().count(), 252);
}

#[test]
fn layout_offsets() {
    // bf16, 4 bits, g = 128, k = 2: 16 + 512 + 32 + 32 + 16 = 608 bytes.
    let f = fmt(DType::Bf16, 4, 128, 2);
    assert_eq!(f.payload_offset(), HEADER_BYTES);
    assert_eq!(f.payload_bytes(), 512);
    assert_eq!(f.range_offset(), 528);
    assert_eq!(f.range_bytes(), 32);
    assert_eq!(f.spike_values_offset(), 560);
    assert_eq!(f.spike_values_bytes(), 32);
    assert_eq!(f.spike_positions_offset(), 592);
    assert_eq!(f.spike_positions_bytes(), 16);
    assert_eq!(f.padding_offset(), 608);
    assert_eq!(f.block_bytes(), 608);
    assert_eq!(f.effective_bits(), 4.75);
    // f32, 7 bits, g = 32, k = 4: planes 4, 2, 1.
    let f = fmt(DType::F32, 7, 32, 4);
    assert_eq!(f.units(), &[4, 2, 1]);
    assert_eq!(
        (f.plane_offset(0), f.plane_offset(1), f.plane_offset(2)),
        (16, 528, 784)
    );
    assert_eq!(f.plane_bytes(2), 128);
    assert_eq!(f.range_offset(), 912);
    assert_eq!(f.block_bytes(), 912 + 256 + 512 + 128);
    for f in Format::all() {
        assert_eq!(f.block_bytes(), common::spec_block_bytes(&f));
        assert_eq!(f.block_bytes() % 16, 0);
        assert!(f.padding_bytes() < 16);
        assert_eq!(
            f.units().iter().map(|&u| u32::from(u)).sum::<u32>(),
            u32::from(f.bits())
        );
        assert_eq!(f.plane_offset(f.units().len()), f.range_offset());
    }
    assert_eq!(Format::blocks(0), 0);
    assert_eq!(Format::blocks(1025), 2);
    assert_eq!(Format::block_values(1025, 1), 1);
    assert_eq!(Format::block_values(1025, 2), 0);
}

#[test]
fn exact_bytes_two_bits() {
    let f = fmt(DType::F32, 2, 32, 0);
    let (enc, out) = roundtrip(f, &[0.0f32, 1.0, 2.0, 3.0]);
    assert_eq!(enc.len(), 528);
    assert_eq!(
        &enc[..16],
        &[0, 0, 0, 0, 4, 0, 2, 5, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    // Codes 0, 1, 2, 3 in one byte, value 0 in the lowest bits.
    assert_eq!(enc[16], 0b11_10_01_00);
    assert!(enc[17..272].iter().all(|&b| b == 0));
    // Range table of group 0: lo = 0.0, hi = 3.0; the other 31 groups are padding.
    assert_eq!(&enc[272..280], &[0, 0, 0, 0, 0, 0, 0x40, 0x40]);
    assert!(enc[280..].iter().all(|&b| b == 0));
    assert_eq!(out, vec![0.0, 1.0, 2.0, 3.0]);
}

#[test]
fn exact_bytes_bit_splitting() {
    // 3 bits = a 2-bit plane (high bits) and a 1-bit plane (low bit).
    let f = fmt(DType::F32, 3, 32, 0);
    let xs: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let (enc, out) = roundtrip(f, &xs);
    assert_eq!(f.plane_offset(1), 16 + 256);
    assert_eq!(&enc[16..18], &[0x50, 0xFA]); // u2 = 0,0,1,1,2,2,3,3
    assert_eq!(enc[272], 0xAA); // u1 = 0,1,0,1,0,1,0,1
    assert_eq!(out, xs);
    // 7 bits: q = u4 << 3 | u2 << 1 | u1; with lo = 0, hi = 127 the code is the value.
    let f = fmt(DType::F32, 7, 32, 0);
    let xs: Vec<f32> = [0.0f32, 127.0, 0b101_1011 as f32].to_vec();
    let (enc, out) = roundtrip(f, &xs);
    let q = 0b101_1011_u8;
    assert_eq!(enc[16], 0xF0); // values 0 and 1 in the 4-bit plane
    assert_eq!(enc[17] & 0xF, q >> 3);
    assert_eq!(enc[f.plane_offset(1)], 0b11 << 2 | ((q >> 1) & 3) << 4);
    assert_eq!(enc[f.plane_offset(2)], 0b010 | (q & 1) << 2);
    assert_eq!(out, xs);
}

#[test]
fn codes_round_half_to_even() {
    // lo = 0, hi = 3, 2 bits: step 1, r 1.
    let f = fmt(DType::F32, 2, 32, 0);
    let xs = [0.0f32, 3.0, 0.5, 1.5, 2.5, 2.4999998];
    let (_, out) = roundtrip(f, &xs);
    assert_eq!(out, vec![0.0, 3.0, 0.0, 2.0, 2.0, 2.0]);
}

#[test]
fn spike_selection_order_and_ties() {
    let f = fmt(DType::F32, 8, 32, 4);
    // Smallest, largest, second smallest, second largest: 0 => -5 (index 3), 1 => 9 (index 1),
    // 2 => -5 (index 5, a tie with index 3, which is taken), 3 => 9 (index 6).
    let xs = [1.0f32, 9.0, 2.0, -5.0, 3.0, -5.0, 9.0, 4.0];
    let enc = encode_to_vec(f, &xs).unwrap();
    let pos = &enc[f.spike_positions_offset()..f.spike_positions_offset() + 4];
    assert_eq!(pos, &[3, 1, 5, 6]);
    let vals: Vec<f32> = (0..4)
        .map(|s| f32::read_le(&enc[f.spike_values_offset() + 4 * s..]))
        .collect();
    assert_eq!(vals, vec![-5.0, 9.0, -5.0, 9.0]);
    // The rest: lo = 1 (index 0), hi = 4 (index 7).
    assert_eq!(f32::read_le(&enc[f.range_offset()..]), 1.0);
    assert_eq!(f32::read_le(&enc[f.range_offset() + 4..]), 4.0);

    // All equal: the lowest indices are the spikes; the range is zero and decodes exactly.
    let xs = [7.25f32; 10];
    let (enc, out) = roundtrip(f, &xs);
    assert_eq!(
        &enc[f.spike_positions_offset()..f.spike_positions_offset() + 4],
        &[0, 1, 2, 3]
    );
    assert_eq!(out, xs.to_vec());

    // -0 and +0 tie: the lower index wins, and the spike keeps its sign.
    let f2 = fmt(DType::F32, 4, 32, 2);
    let xs = [-0.0f32, 0.0, 1.0, 0.5, 0.25];
    let (enc, out) = roundtrip(f2, &xs);
    assert_eq!(
        &enc[f2.spike_positions_offset()..f2.spike_positions_offset() + 2],
        &[0, 2]
    );
    assert_eq!(out[0].to_bits(), (-0.0f32).to_bits());
}

#[test]
fn fewer_values_than_spikes() {
    // A tail group of L <= k values is kept exactly; slots past L are +0 at position 0.
    let f = fmt(DType::Bf16, 2, 32, 4);
    let xs: Vec<bf16> = (0..35)
        .map(|i| bf16::from_f32((i as f32 * 0.37).sin() * 1e3))
        .collect();
    let (enc, out) = roundtrip(f, &xs);
    assert_eq!(bits(&out[32..]), bits(&xs[32..]));
    let sp = f.spike_positions_offset() + 4;
    // Values -664, -349, 13.7: smallest (0), largest (2), second smallest (1), empty slot.
    assert_eq!(&enc[sp..sp + 4], &[0, 2, 1, 0]);
    let sv = f.spike_values_offset() + 8;
    assert_eq!(&enc[sv + 6..sv + 8], &[0, 0]);
    // Rest empty: lo = hi = +0.
    let r = f.range_offset() + 4;
    assert_eq!(&enc[r..r + 4], &[0, 0, 0, 0]);
}

#[test]
fn nan_poisons_its_group_only() {
    for k in [0u8, 2, 4] {
        let f = fmt(DType::F16, 4, 32, k);
        let mut xs: Vec<f16> = (0..64).map(|i| f16::from_f32(i as f32 / 8.0)).collect();
        xs[40] = f16::from_bits(0xFE01); // a negative signalling-looking NaN
        let (enc, out) = roundtrip(f, &xs);
        for (i, o) in out.iter().enumerate() {
            if i >= 32 {
                assert_eq!(o.to_bits(), 0x7E00, "canonical NaN at {i}");
            } else {
                assert!((o.to_f32() - xs[i].to_f32()).abs() <= 4.0 / 15.0 / 2.0 + 1e-3);
            }
        }
        let r = f.range_offset() + 4;
        assert_eq!(&enc[r..r + 4], &[0x00, 0x7E, 0x00, 0x7E]);
        let sv = f.spike_values_offset() + usize::from(k) * 2;
        assert!(enc[sv..sv + usize::from(k) * 2].iter().all(|&b| b == 0));
        let codes_group1 = &enc[16 + 16..16 + 32];
        assert!(codes_group1.iter().all(|&b| b == 0));
    }
}

#[test]
fn infinities() {
    let xs = [1.0f32, f32::INFINITY, 2.0, 3.0, f32::NEG_INFINITY, 0.5];
    // Without spikes an infinity makes the range infinite: the group is poisoned.
    let (_, out) = roundtrip(fmt(DType::F32, 4, 32, 0), &xs);
    assert!(out.iter().all(|o| o.to_bits() == 0x7FC0_0000));
    // With two spikes both infinities are spikes and survive.
    let (_, out) = roundtrip(fmt(DType::F32, 4, 32, 2), &xs);
    assert_eq!(out[1], f32::INFINITY);
    assert_eq!(out[4], f32::NEG_INFINITY);
    assert!((out[0] - 1.0).abs() < 0.1 && (out[3] - 3.0).abs() < 0.1);
    // Three infinities with two spikes: one is left in the rest, the group is poisoned.
    let ys = [f32::INFINITY, f32::INFINITY, 1.0, f32::NEG_INFINITY];
    let (_, out) = roundtrip(fmt(DType::F32, 4, 32, 2), &ys);
    assert!(out.iter().all(|o| o.is_nan()));
    let (_, out) = roundtrip(fmt(DType::F32, 4, 32, 4), &ys);
    assert_eq!(bits(&out), bits(&ys));
    // bf16 infinities as spikes.
    let zs: Vec<bf16> = [1.0f32, f32::INFINITY, -3.0]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let (_, out) = roundtrip(fmt(DType::Bf16, 2, 64, 2), &zs);
    assert_eq!(bits(&out), bits(&zs));
}

#[test]
fn range_overflow_poisons() {
    // hi - lo overflows f32.
    let xs = [f32::MAX, -f32::MAX, 1.0];
    let (_, out) = roundtrip(fmt(DType::F32, 8, 32, 0), &xs);
    assert!(out.iter().all(|o| o.is_nan()));
    // hi - lo fits but the top code's value lo + (2^b - 1) * step rounds past f32::MAX.
    let ys = [-f32::MAX, 5.0, 1.0];
    let m = 31.0f32;
    assert!((-f32::MAX + m * ((5.0 + f32::MAX) / m)).is_infinite());
    let (_, out) = roundtrip(fmt(DType::F32, 5, 32, 0), &ys);
    assert!(out.iter().all(|o| o.is_nan()));
    // The same values with spikes: the extremes are kept, the rest is small.
    let (_, out) = roundtrip(fmt(DType::F32, 5, 32, 2), &ys);
    assert_eq!(out, ys.to_vec());
}

#[test]
fn signed_zeros_outside_spikes_decode_to_plus_zero() {
    // lo = -0: v = lo + 0 * step = -0 + +0 = +0 (IEEE), so a non-spike -0 becomes +0.
    let xs = [-0.0f32, 0.0, -0.0];
    let (_, out) = roundtrip(fmt(DType::F32, 4, 32, 0), &xs);
    assert!(out.iter().all(|o| o.to_bits() == 0));
    let (_, out) = roundtrip(fmt(DType::F32, 4, 32, 2), &xs);
    assert_eq!(out[0].to_bits(), (-0.0f32).to_bits());
    assert_eq!(out[1].to_bits(), 0);
    assert_eq!(out[2].to_bits(), 0);
}

#[test]
fn zero_range_groups_are_exact() {
    for d in [DType::F32, DType::F16, DType::Bf16] {
        for b in 2..=8 {
            let f = fmt(d, b, 64, 0);
            match d {
                DType::F32 => {
                    let xs = vec![-3.3e-3f32; 100];
                    assert_eq!(roundtrip(f, &xs).1, xs);
                }
                DType::F16 => {
                    let xs = vec![f16::from_bits(0x0003); 100]; // a subnormal
                    assert_eq!(bits(&roundtrip(f, &xs).1), bits(&xs));
                }
                DType::Bf16 => {
                    let xs = vec![bf16::from_f32(25654.0); 100];
                    assert_eq!(bits(&roundtrip(f, &xs).1), bits(&xs));
                }
            }
        }
    }
}

#[test]
fn subnormal_spikes_are_exact() {
    let xs = [
        f16::from_bits(0x0001),
        f16::from_bits(0x8001),
        f16::from_f32(0.5),
        f16::from_f32(0.25),
    ];
    let (_, out) = roundtrip(fmt(DType::F16, 3, 32, 2), &xs);
    assert_eq!(out[0].to_bits(), 0x0001);
    assert_eq!(out[1].to_bits(), 0x8001);
    let ys = [f32::from_bits(1), f32::from_bits(0x8000_0001), 0.0, 1e-3];
    let (_, out) = roundtrip(fmt(DType::F32, 3, 32, 2), &ys);
    assert_eq!(out[1].to_bits(), 0x8000_0001);
    assert_eq!(out[3], 1e-3);
}

#[test]
fn reduce_requantize_matches_its_definition() {
    let mut rng = common::Rng::new(11);
    let n = 2500;
    let fin = fmt(DType::Bf16, 3, 64, 2);
    let fout = fmt(DType::Bf16, 6, 128, 4);
    let inputs: Vec<Vec<bf16>> = (0..3)
        .map(|_| common::gen_values(&mut rng, n, common::Kind::Outliers))
        .collect();
    let enc: Vec<Vec<u8>> = inputs
        .iter()
        .map(|x| encode_to_vec(fin, x).unwrap())
        .collect();
    let refs: Vec<&[u8]> = enc.iter().map(|e| e.as_slice()).collect();
    let mut fused = vec![0u8; fout.encoded_len(n)];
    reduce_requantize::<bf16>(fin, &refs, n, fout, &mut fused).unwrap();
    // By hand: decode each to f32, acc = v0 + v1 + v2 in order, round, encode.
    let mut vs = vec![vec![0f32; n]; 3];
    for (e, v) in enc.iter().zip(vs.iter_mut()) {
        decode_f32::<bf16>(fin, e, n, v).unwrap();
    }
    let sum: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(vs[0][i] + vs[1][i] + vs[2][i]))
        .collect();
    assert_eq!(fused, encode_to_vec(fout, &sum).unwrap());
    // Errors: no inputs, a format for another type, a wrong input length.
    assert!(reduce_requantize::<bf16>(fin, &[], n, fout, &mut fused).is_err());
    assert!(
        reduce_requantize::<f16>(fin.with_dtype(DType::F16), &refs, n, fout, &mut fused).is_err()
    );
    assert!(reduce_requantize::<bf16>(fin, &[&enc[0][1..]], n, fout, &mut fused).is_err());
}

#[test]
fn element_conversions() {
    // Every 16-bit pattern converts to f32 exactly and back unchanged (NaN becomes canonical).
    for b in 0..=u16::MAX {
        let h = f16::from_bits(b);
        let back = <f16 as Element>::from_f32(Element::to_f32(h));
        if h.is_nan() {
            assert_eq!(back.to_bits(), 0x7E00);
        } else {
            assert_eq!(back.to_bits(), b);
            assert_eq!(f64::from(Element::to_f32(h)), h.to_f64());
        }
        let z = bf16::from_bits(b);
        let back = <bf16 as Element>::from_f32(Element::to_f32(z));
        if z.is_nan() {
            assert_eq!(back.to_bits(), 0x7FC0);
        } else {
            assert_eq!(back.to_bits(), b);
        }
    }
    // Rounding from f32 is to nearest, ties to even, checked against f64 arithmetic.
    let mut rng = common::Rng::new(5);
    for _ in 0..200_000 {
        let x = f32::from_bits(rng.next_u64() as u32);
        if x.is_nan() {
            assert_eq!(<bf16 as Element>::from_f32(x).to_bits(), 0x7FC0);
            assert_eq!(<f32 as Element>::from_f32(x).to_bits(), 0x7FC0_0000);
            continue;
        }
        check_rne::<bf16>(x);
        check_rne::<f16>(x);
    }
    for x in [
        65504.0f32,
        65519.99,
        65520.0,
        3.3895314e38,
        3.4e38,
        f32::MAX,
        5.96e-8,
        2.98e-8,
        2.99e-8,
    ] {
        check_rne::<bf16>(x);
        check_rne::<f16>(x);
        check_rne::<bf16>(-x);
        check_rne::<f16>(-x);
    }
    assert_eq!(f32::canonical_nan().to_bits(), 0x7FC0_0000);
    assert_eq!(<f16 as Element>::canonical_nan().to_bits(), 0x7E00);
    assert_eq!(<bf16 as Element>::canonical_nan().to_bits(), 0x7FC0);
}

/// `T::from_f32(x)` is a nearest value of T to x, and on a tie the one with an even last bit.
fn check_rne<T: Element>(x: f32) {
    let y = T::from_f32(x);
    let yf = f64::from(y.to_f32());
    let xf = f64::from(x);
    if yf.is_infinite() {
        assert!(
            xf.abs() >= T::MAX + 0.5 * T::ulp_at(T::MAX),
            "{x:e} overflowed"
        );
        return;
    }
    let err = (yf - xf).abs();
    let half = 0.5 * T::ulp_at(xf);
    assert!(err <= half, "{x:e} -> {yf:e}");
    if err == half && err > 0.0 {
        assert_eq!(y.to_bits() & 1, 0, "tie at {x:e} must go to even");
    }
}

#[test]
fn block_constants() {
    assert_eq!(BLOCK_VALUES, 1024);
    assert_eq!(HEADER_BYTES, 16);
}
