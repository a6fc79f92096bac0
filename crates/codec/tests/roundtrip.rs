//! Round trips of every format on seeded random data: exact sizes, the error bound on every
//! element, exact spikes, poisoned groups and padding as the spec says.

mod common;

use common::{ALL_KINDS, Kind, Rng, expected_spikes, gen_values, spec_block_bytes};
use flashcomm_codec::{
    BLOCK_VALUES, DType, Element, Format, bf16, decode, decode_accumulate, decode_f32, encode,
    encode_to_vec, error_bound, error_bound_f32, f16,
};
use proptest::prelude::*;

const LENGTHS: [usize; 7] = [1, 31, 32, 1023, 1024, 1025, 5000];

/// Whether a group of valid values is poisoned, computed from the spec's rules.
fn expect_poisoned(xs: &[f32], spikes: &[usize], bits: u8) -> bool {
    if xs.iter().any(|x| x.is_nan()) {
        return true;
    }
    let rest: Vec<f32> = (0..xs.len())
        .filter(|i| !spikes.contains(i))
        .map(|i| xs[i])
        .collect();
    if rest.is_empty() {
        return false;
    }
    let lo = rest.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = rest.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m = ((1u32 << bits) - 1) as f32;
    let top = lo + m * ((hi - lo) / m);
    lo.is_infinite() || hi.is_infinite() || (hi - lo).is_infinite() || top.is_infinite()
}

/// Encodes `input`, checks every property the spec promises, and returns the encoding.
fn check<T: Element>(fmt: Format, input: &[T]) -> Vec<u8> {
    let n = input.len();
    let enc = encode_to_vec(fmt, input).unwrap();
    assert_eq!(
        enc.len(),
        Format::blocks(n) * spec_block_bytes(&fmt),
        "{fmt}"
    );
    assert_eq!(enc.len(), fmt.encoded_len(n));

    let mut out = vec![T::default(); n];
    let mut v32 = vec![0f32; n];
    let mut bound = vec![0f64; n];
    let mut bound32 = vec![0f64; n];
    decode(fmt, &enc, n, &mut out).unwrap();
    decode_f32::<T>(fmt, &enc, n, &mut v32).unwrap();
    error_bound::<T>(fmt, &enc, n, &mut bound).unwrap();
    error_bound_f32::<T>(fmt, &enc, n, &mut bound32).unwrap();

    let g = usize::from(fmt.group());
    for (gi, xs_t) in input.chunks(g).enumerate() {
        let base = gi * g;
        let xs: Vec<f32> = xs_t.iter().map(|x| x.to_f32()).collect();
        let has_nan = xs.iter().any(|x| x.is_nan());
        let spikes = if has_nan {
            Vec::new()
        } else {
            expected_spikes(&xs, usize::from(fmt.spikes()))
        };
        if expect_poisoned(&xs, &spikes, fmt.bits()) {
            for i in 0..xs.len() {
                assert_eq!(
                    out[base + i].to_bits(),
                    T::CANONICAL_NAN_BITS,
                    "{fmt} poisoned group {gi}"
                );
                assert!(bound[base + i].is_nan());
            }
            continue;
        }
        for (i, (&x, &xt)) in xs.iter().zip(xs_t).enumerate() {
            let at = base + i;
            if spikes.contains(&i) {
                assert_eq!(out[at].to_bits(), xt.to_bits(), "{fmt} spike {at}");
                assert_eq!(bound[at], 0.0);
                continue;
            }
            let (b32, b) = (bound32[at], bound[at]);
            assert!(b32.is_finite() && b.is_finite(), "{fmt} bound at {at}");
            let e32 = (f64::from(v32[at]) - f64::from(x)).abs();
            let e = (f64::from(out[at].to_f32()) - f64::from(x)).abs();
            assert!(
                e32 <= b32,
                "{fmt} n={n} at {at}: x={x:e} v={:e} err {e32:e} > bound {b32:e}",
                v32[at]
            );
            assert!(
                e <= b,
                "{fmt} n={n} at {at}: x={x:e} out={:e} err {e:e} > bound {b:e}",
                out[at].to_f32()
            );
            assert_eq!(T::from_f32(v32[at]).to_bits(), out[at].to_bits());
        }
    }
    check_padding(&fmt, &enc, n);

    // decode_accumulate adds the f32 values onto whatever the accumulator holds.
    let mut acc: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
    decode_accumulate::<T>(fmt, &enc, n, &mut acc).unwrap();
    for i in 0..n {
        let want = (i as f32 * 0.5 - 7.0) + v32[i];
        assert!(want.to_bits() == acc[i].to_bits() || (want.is_nan() && acc[i].is_nan()));
    }
    enc
}

/// Tag word, groups past the tail, padding codes and the final padding are zero.
fn check_padding(fmt: &Format, enc: &[u8], n: usize) {
    let bb = fmt.block_bytes();
    let g = usize::from(fmt.group());
    let s = fmt.dtype().size();
    let k = usize::from(fmt.spikes());
    for (b, block) in enc.chunks_exact(bb).enumerate() {
        assert_eq!(&block[0..4], &[0, 0, 0, 0], "tag");
        let nv = Format::block_values(n, b);
        for j in nv.div_ceil(g)..fmt.groups_per_block() {
            let lo = fmt.range_offset() + 2 * j * s;
            assert!(block[lo..lo + 2 * s].iter().all(|&x| x == 0));
            let sv = fmt.spike_values_offset() + j * k * s;
            assert!(block[sv..sv + k * s].iter().all(|&x| x == 0));
            let sp = fmt.spike_positions_offset() + j * k;
            assert!(block[sp..sp + k].iter().all(|&x| x == 0));
        }
        for (p, &u) in fmt.units().iter().enumerate() {
            let plane = &block[fmt.plane_offset(p)..fmt.plane_offset(p) + fmt.plane_bytes(p)];
            let u = usize::from(u);
            for v in nv..BLOCK_VALUES {
                let bit = v * u;
                assert_eq!((plane[bit / 8] >> (bit % 8)) & ((1 << u) - 1) as u8, 0);
            }
        }
        assert!(block[fmt.padding_offset()..].iter().all(|&x| x == 0));
    }
}

fn sweep<T: Element>(dtype: DType, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut case = 0usize;
    for fmt in Format::all().filter(|f| f.dtype() == dtype) {
        for &n in &LENGTHS {
            let kind = ALL_KINDS[case % ALL_KINDS.len()];
            case += 1;
            let xs: Vec<T> = gen_values(&mut rng, n, kind);
            check(fmt, &xs);
        }
    }
}

#[test]
fn every_format_f32() {
    sweep::<f32>(DType::F32, 1);
}

#[test]
fn every_format_f16() {
    sweep::<f16>(DType::F16, 2);
}

#[test]
fn every_format_bf16() {
    sweep::<bf16>(DType::Bf16, 3);
}

/// Every kind of data through every width at the default group, for every type.
#[test]
fn every_kind_every_width() {
    let mut rng = Rng::new(4);
    for kind in ALL_KINDS {
        for b in 2..=8u8 {
            for k in [0u8, 2, 4] {
                let f = Format::new(DType::F32, b, 128, k).unwrap();
                check::<f32>(f, &gen_values(&mut rng, 1500, kind));
                check::<f16>(f.with_dtype(DType::F16), &gen_values(&mut rng, 1500, kind));
                check::<bf16>(f.with_dtype(DType::Bf16), &gen_values(&mut rng, 1500, kind));
            }
        }
    }
}

fn any_format() -> impl Strategy<Value = Format> {
    (0usize..252).prop_map(|i| Format::all().nth(i).unwrap())
}

fn any_kind() -> impl Strategy<Value = Kind> {
    (0usize..ALL_KINDS.len()).prop_map(|i| ALL_KINDS[i])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn random_roundtrip(fmt in any_format(), kind in any_kind(), n in 1usize..3000, seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        match fmt.dtype() {
            DType::F32 => { check::<f32>(fmt, &gen_values(&mut rng, n, kind)); }
            DType::F16 => { check::<f16>(fmt, &gen_values(&mut rng, n, kind)); }
            DType::Bf16 => { check::<bf16>(fmt, &gen_values(&mut rng, n, kind)); }
        }
    }

    #[test]
    fn arbitrary_f32_bits(fmt_i in 0usize..84, bits in proptest::collection::vec(any::<u32>(), 1..700)) {
        let fmt = Format::all().filter(|f| f.dtype() == DType::F32).nth(fmt_i).unwrap();
        let xs: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
        check::<f32>(fmt, &xs);
    }

    #[test]
    fn arbitrary_bf16_bits(fmt_i in 0usize..84, bits in proptest::collection::vec(any::<u16>(), 1..700)) {
        let fmt = Format::all().filter(|f| f.dtype() == DType::Bf16).nth(fmt_i).unwrap();
        let xs: Vec<bf16> = bits.into_iter().map(bf16::from_bits).collect();
        check::<bf16>(fmt, &xs);
    }

    #[test]
    fn arbitrary_f16_bits(fmt_i in 0usize..84, bits in proptest::collection::vec(any::<u16>(), 1..700)) {
        let fmt = Format::all().filter(|f| f.dtype() == DType::F16).nth(fmt_i).unwrap();
        let xs: Vec<f16> = bits.into_iter().map(f16::from_bits).collect();
        check::<f16>(fmt, &xs);
    }
}

#[test]
fn encode_checks_lengths_and_dtype() {
    let f = Format::new(DType::Bf16, 4, 128, 2).unwrap();
    let xs = vec![bf16::from_f32(1.0); 10];
    let mut short = vec![0u8; f.block_bytes() - 1];
    assert!(encode(f, &xs, &mut short).is_err());
    let mut long = vec![0u8; f.block_bytes() + 16];
    assert!(encode(f, &xs, &mut long).is_err());
    let mut ok = vec![0u8; f.block_bytes()];
    assert!(
        encode(f, &[1.0f32; 10], &mut ok).is_err(),
        "f32 slice with a bf16 format"
    );
    encode(f, &xs, &mut ok).unwrap();
    let mut empty: Vec<u8> = Vec::new();
    encode::<bf16>(f, &[], &mut empty).unwrap();
    decode::<bf16>(f, &[], 0, &mut []).unwrap();
}
