//! Decoders never panic on arbitrary bytes: random buffers, mutated valid blocks, wrong headers
//! and wrong lengths all give a result or an error value.

mod common;

use common::{ALL_KINDS, Rng, gen_values};
use flashcomm_codec::{
    CodecError, DType, Element, Format, bf16, decode, decode_accumulate, decode_f32, encode_to_vec,
    error_bound, f16, reduce_requantize,
};
use proptest::prelude::*;

/// Runs every decoding entry point on `bytes`; only checks that none of them panics.
fn decode_all<T: Element>(fmt: Format, bytes: &[u8], n: usize) {
    let mut out = vec![T::default(); n];
    let _ = decode(fmt, bytes, n, &mut out);
    let mut acc = vec![0f32; n];
    let _ = decode_accumulate::<T>(fmt, bytes, n, &mut acc);
    let _ = decode_f32::<T>(fmt, bytes, n, &mut acc);
    let mut bound = vec![0f64; n];
    let _ = error_bound::<T>(fmt, bytes, n, &mut bound);
    let mut requant = vec![0u8; fmt.encoded_len(n)];
    let _ = reduce_requantize::<T>(fmt, &[bytes, bytes], n, fmt, &mut requant);
}

fn decode_all_dyn(fmt: Format, bytes: &[u8], n: usize) {
    match fmt.dtype() {
        DType::F32 => decode_all::<f32>(fmt, bytes, n),
        DType::F16 => decode_all::<f16>(fmt, bytes, n),
        DType::Bf16 => decode_all::<bf16>(fmt, bytes, n),
    }
}

fn encode_dyn(fmt: Format, rng: &mut Rng, n: usize) -> Vec<u8> {
    let kind = ALL_KINDS[rng.below(ALL_KINDS.len())];
    match fmt.dtype() {
        DType::F32 => encode_to_vec(fmt, &gen_values::<f32>(rng, n, kind)).unwrap(),
        DType::F16 => encode_to_vec(fmt, &gen_values::<f16>(rng, n, kind)).unwrap(),
        DType::Bf16 => encode_to_vec(fmt, &gen_values::<bf16>(rng, n, kind)).unwrap(),
    }
}

fn any_format() -> impl Strategy<Value = Format> {
    (0usize..252).prop_map(|i| Format::all().nth(i).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random bytes of random length, and random `n`.
    #[test]
    fn random_bytes(fmt in any_format(), bytes in proptest::collection::vec(any::<u8>(), 0..6000), n in 0usize..5000) {
        decode_all_dyn(fmt, &bytes, n);
    }

    /// Random bytes of exactly the right length behind a valid header, so that the metadata and
    /// payload decoding paths run on garbage.
    #[test]
    fn random_blocks_with_valid_headers(fmt in any_format(), n in 1usize..3000, seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let mut bytes: Vec<u8> = (0..fmt.encoded_len(n)).map(|_| rng.next_u64() as u8).collect();
        for (b, block) in bytes.chunks_exact_mut(fmt.block_bytes()).enumerate() {
            let nv = Format::block_values(n, b) as u16;
            block[4..16].copy_from_slice(&fmt.header_fields(nv));
        }
        decode_all_dyn(fmt, &bytes, n);
    }

    /// Valid encodings with a few bytes changed anywhere (header included).
    #[test]
    fn mutated_valid_blocks(fmt in any_format(), n in 1usize..2500, seed in any::<u64>(), flips in 1usize..12) {
        let mut rng = Rng::new(seed);
        let mut bytes = encode_dyn(fmt, &mut rng, n);
        for _ in 0..flips {
            let at = rng.below(bytes.len());
            bytes[at] ^= 1 << rng.below(8);
            if rng.below(4) == 0 {
                bytes[at] = rng.next_u64() as u8;
            }
        }
        decode_all_dyn(fmt, &bytes, n);
    }

    /// Valid encodings decoded with the wrong format or the wrong value count.
    #[test]
    fn mismatched_format_or_count(a in any_format(), b in any_format(), n in 1usize..2500, dn in 1usize..40, seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let bytes = encode_dyn(a, &mut rng, n);
        decode_all_dyn(b, &bytes, n);
        decode_all_dyn(a, &bytes, n + dn);
        decode_all_dyn(a, &bytes, n.saturating_sub(dn));
        decode_all_dyn(a, &bytes[..bytes.len() - 1], n);
    }
}

#[test]
fn huge_counts_are_errors() {
    let f = Format::new(DType::F32, 8, 32, 4).unwrap();
    let mut out: Vec<f32> = Vec::new();
    assert!(decode(f, &[], usize::MAX, &mut out).is_err());
    assert_eq!(f.checked_encoded_len(usize::MAX), None);
    assert_eq!(f.encoded_len(usize::MAX), usize::MAX);
}

#[test]
fn header_mismatches_are_reported() {
    let f = Format::new(DType::Bf16, 3, 64, 2).unwrap();
    let xs = vec![bf16::from_f32(0.5); 1500];
    let enc = encode_to_vec(f, &xs).unwrap();
    let mut out = vec![bf16::ZERO; 1500];
    decode(f, &enc, 1500, &mut out).unwrap();
    // Every header byte that the decoder checks, in each block.
    for block in 0..2 {
        for byte in 4..16 {
            let mut bad = enc.clone();
            bad[block * f.block_bytes() + byte] ^= 0x10;
            match decode(f, &bad, 1500, &mut out) {
                Err(CodecError::Header { block: b, .. }) => assert_eq!(b, block),
                other => panic!("byte {byte} of block {block}: {other:?}"),
            }
        }
    }
    // The tag word is the transport's: the codec ignores it.
    let mut tagged = enc.clone();
    tagged[0..4].copy_from_slice(&0xDEAD_BEEFu32.to_le_bytes());
    decode(f, &tagged, 1500, &mut out).unwrap();
    // A value count that disagrees with the tail's header.
    assert!(matches!(
        decode(f, &enc, 1499, &mut out[..1499]),
        Err(CodecError::Header {
            block: 1,
            field: "nvalues",
            ..
        })
    ));
    // Wrong element type.
    let mut out32 = vec![0f32; 1500];
    assert!(matches!(
        decode(f, &enc, 1500, &mut out32),
        Err(CodecError::DType { .. })
    ));
    // On error the output is untouched.
    let mut acc = vec![1f32; 1500];
    let mut bad = enc.clone();
    bad[f.block_bytes() + 6] = 9;
    assert!(decode_accumulate::<bf16>(f, &bad, 1500, &mut acc).is_err());
    assert!(acc.iter().all(|&a| a == 1.0));
}
