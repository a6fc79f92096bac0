//! The reference all-reduce algorithms: shard rule, accumulation order, equivalence with the
//! codec primitives, and the predicted error bound against the exact sum.

mod common;

use common::{ALL_KINDS, Kind, Rng, gen_values};
use flashcomm_codec::reference::{
    Outcome, allreduce_lossless, allreduce_oneshot, allreduce_oneshot_with_bound,
    allreduce_twostep, allreduce_twostep_with_bound, shard_blocks,
};
use flashcomm_codec::{
    DType, Element, Format, bf16, decode, decode_f32, encode_to_vec, f16, reduce_requantize,
};

#[test]
fn shards_partition_the_blocks() {
    for nranks in 1..=8 {
        for nb in 0..70 {
            let mut next = 0;
            for j in 0..nranks {
                let r = shard_blocks(nb, nranks, j);
                assert_eq!(r.start, next);
                assert_eq!(r.start, j * nb / nranks);
                assert_eq!(r.end, (j + 1) * nb / nranks);
                next = r.end;
            }
            assert_eq!(next, nb);
        }
    }
}

#[test]
fn lossless_is_f32_in_rank_order() {
    let a = [bf16::from_f32(1.0), bf16::from_f32(-0.0)];
    let b = [bf16::from_f32(2f32.powi(-8)), bf16::from_f32(-0.0)];
    let c = [bf16::from_f32(2f32.powi(-8)), bf16::from_f32(-0.0)];
    let out = allreduce_lossless(&[&a, &b, &c]);
    // 1 + 2^-8 + 2^-8 in f32 is exact, then rounds to bf16 1 + 2^-7 (exact in bf16).
    assert_eq!(out[0].to_f32(), 1.0 + 2f32.powi(-7));
    // acc = x0 keeps -0 when every rank has -0.
    assert_eq!(out[1].to_bits(), 0x8000);
    let x = [1.0f32, 1e8, -1e8];
    let y = allreduce_lossless(&[&x[..1], &x[1..2], &x[2..]]);
    assert_eq!(y[0], (1.0f32 + 1e8) - 1e8);
}

/// Checks both quantized algorithms against their definition in terms of the primitives and
/// their bound against the exact sum.
fn check<T: Element>(fmt_rs: Format, fmt_ag: Format, inputs: &[Vec<T>]) {
    let refs: Vec<&[T]> = inputs.iter().map(|x| x.as_slice()).collect();
    let n = inputs[0].len();

    // One-shot by hand: decode every rank to f32, acc = v0 + v1 + ..., round.
    let mut acc = vec![0f32; n];
    let mut v = vec![0f32; n];
    for (r, x) in inputs.iter().enumerate() {
        decode_f32::<T>(fmt_rs, &encode_to_vec(fmt_rs, x).unwrap(), n, &mut v).unwrap();
        for i in 0..n {
            acc[i] = if r == 0 { v[i] } else { acc[i] + v[i] };
        }
    }
    let by_hand: Vec<u32> = acc.iter().map(|&a| T::from_f32(a).to_bits()).collect();
    let one = allreduce_oneshot_with_bound(fmt_rs, &refs);
    assert_eq!(bits(&one.values), by_hand);
    assert_eq!(bits(&allreduce_oneshot(fmt_rs, &refs)), by_hand);

    // Two-step: the shard rule does not change the bytes, so it equals one fused call.
    let enc: Vec<Vec<u8>> = inputs
        .iter()
        .map(|x| encode_to_vec(fmt_rs, x).unwrap())
        .collect();
    let enc_refs: Vec<&[u8]> = enc.iter().map(|e| e.as_slice()).collect();
    let mut fused = vec![0u8; fmt_ag.encoded_len(n)];
    reduce_requantize::<T>(fmt_rs, &enc_refs, n, fmt_ag, &mut fused).unwrap();
    let mut two_by_hand = vec![T::default(); n];
    decode(fmt_ag, &fused, n, &mut two_by_hand).unwrap();
    let two = allreduce_twostep_with_bound(fmt_rs, fmt_ag, &refs);
    assert_eq!(bits(&two.values), bits(&two_by_hand));
    assert_eq!(
        bits(&allreduce_twostep(fmt_rs, fmt_ag, &refs)),
        bits(&two_by_hand)
    );

    check_bound(&one, inputs, "one-shot");
    check_bound(&two, inputs, "two-step");
}

fn bits<T: Element>(xs: &[T]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

fn check_bound<T: Element>(out: &Outcome<T>, inputs: &[Vec<T>], what: &str) {
    for i in 0..out.values.len() {
        let exact: f64 = inputs.iter().map(|x| f64::from(x[i].to_f32())).sum();
        let b = out.bound[i];
        if !exact.is_finite() || b.is_nan() {
            continue;
        }
        let err = (f64::from(out.values[i].to_f32()) - exact).abs();
        // The f64 sum of a few f32 values can itself be off by a few 2^-53 relative.
        assert!(
            err <= b * (1.0 + 1e-9) + exact.abs() * 1e-15,
            "{what} at {i}: got {:e}, exact {exact:e}, err {err:e} > bound {b:e}",
            out.values[i].to_f32()
        );
    }
}

fn run<T: Element>(dtype: DType, seed: u64) {
    let mut rng = Rng::new(seed);
    let settings = [
        (2u8, 32u16, 0u8, 4u8, 128u16, 2u8),
        (3, 128, 2, 3, 128, 2),
        (4, 128, 2, 8, 128, 0),
        (5, 64, 4, 5, 256, 4),
        (8, 256, 0, 2, 32, 4),
        (7, 32, 2, 6, 64, 2),
    ];
    for (case, &(b1, g1, k1, b2, g2, k2)) in settings.iter().enumerate() {
        let f1 = Format::new(dtype, b1, g1, k1).unwrap();
        let f2 = Format::new(dtype, b2, g2, k2).unwrap();
        for nranks in [1usize, 2, 3, 4, 8] {
            let n = [1usize, 1023, 1025, 5000][(case + nranks) % 4];
            let kind = ALL_KINDS[(case * 5 + nranks) % ALL_KINDS.len()];
            let inputs: Vec<Vec<T>> = (0..nranks).map(|_| gen_values(&mut rng, n, kind)).collect();
            check(f1, f2, &inputs);
        }
    }
}

#[test]
fn algorithms_f32() {
    run::<f32>(DType::F32, 21);
}

#[test]
fn algorithms_f16() {
    run::<f16>(DType::F16, 22);
}

#[test]
fn algorithms_bf16() {
    run::<bf16>(DType::Bf16, 23);
}

/// The spike case of the research data: one rank carries a massive value, the others are small;
/// with spikes it survives both steps, and the bound still holds.
#[test]
fn massive_value_in_one_rank() {
    let mut rng = Rng::new(9);
    let n = 4096;
    let mut inputs: Vec<Vec<bf16>> = (0..4)
        .map(|_| gen_values(&mut rng, n, Kind::Gaussian))
        .collect();
    inputs[2][0] = bf16::from_f32(25654.0);
    let f = Format::new(DType::Bf16, 2, 128, 2).unwrap();
    let refs: Vec<&[bf16]> = inputs.iter().map(|x| x.as_slice()).collect();
    let exact: f64 = inputs.iter().map(|x| f64::from(x[0].to_f32())).sum();
    for out in [
        allreduce_oneshot_with_bound(f, &refs),
        allreduce_twostep_with_bound(f, f, &refs),
    ] {
        let err = (f64::from(out.values[0].to_f32()) - exact).abs();
        assert!(err <= out.bound[0]);
        // The bf16 rounding of the sum (ulp 128 at 25,600) dominates.
        assert!(err <= 64.0 + 8.0, "err {err}");
    }
    check(f, f, &inputs);
}

/// The error table `ci/demo.sh` prints without a GPU: every bound holds, and more bits give a
/// smaller error.
#[test]
fn the_error_table_is_within_its_bounds_and_falls_with_the_width() {
    let rows = flashcomm_codec::error_rows(4, 4096);
    assert_eq!(rows.len(), 14);
    for r in &rows {
        assert!(r.worst_of_bound <= 1.0, "{r:?}");
        assert!(r.rel_l2 > 0.0 && r.rel_l2 < 1.0, "{r:?}");
    }
    for two_step in [false, true] {
        let errs: Vec<f64> = rows
            .iter()
            .filter(|r| r.two_step == two_step)
            .map(|r| r.rel_l2)
            .collect();
        assert!(errs.windows(2).all(|w| w[1] < w[0]), "{errs:?}");
    }
    let table = flashcomm_codec::error_table_markdown(2, 1024);
    assert!(table.contains("| 4 | one-shot |"), "{table}");
}
