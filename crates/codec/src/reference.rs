//! The quantized collectives as the GPU kernels compute them (`docs/codec.md`, "Reference
//! algorithms"): the all-reduce algorithms, and the one-step quantized AllGather, AllToAll and
//! ReduceScatter, so that GPU tests and the accuracy study can compare results bit for bit.
//!
//! Every function here takes one input slice per rank (all of the same length) and returns the
//! single result that every rank ends up with. They panic on misuse (no ranks, ranks of different
//! lengths, a format whose `dtype` is not `T`): these are programming errors, not data errors.

use std::ops::Range;

use crate::codec::{
    decode, decode_f32, encode_to_vec, error_bound_f32, reduce_requantize, ulp_f32,
};
use crate::element::Element;
use crate::format::{DType, Format};

/// The result of a quantized all-reduce with its predicted per-element error bound.
#[derive(Clone, Debug)]
pub struct Outcome<T> {
    /// The values every rank holds after the all-reduce.
    pub values: Vec<T>,
    /// Upper bound on `|values[i] - sum_r x_r[i]|` against the exact (real-number) sum of the
    /// inputs. NaN where an input group was poisoned; infinite where rounding overflowed.
    pub bound: Vec<f64>,
}

/// Blocks owned by shard `shard` of `nranks` in a buffer of `nblocks` blocks:
/// `[shard * nblocks / nranks, (shard + 1) * nblocks / nranks)` (integer division).
pub fn shard_blocks(nblocks: usize, nranks: usize, shard: usize) -> Range<usize> {
    assert!(nranks > 0 && shard < nranks, "shard {shard} of {nranks}");
    // u128 keeps the products exact for any buffer size.
    let at = |j: usize| (j as u128 * nblocks as u128 / nranks as u128) as usize;
    at(shard)..at(shard + 1)
}

fn check_inputs<T: Element>(inputs: &[&[T]]) -> usize {
    assert!(!inputs.is_empty(), "all-reduce needs at least one rank");
    let n = inputs[0].len();
    assert!(
        inputs.iter().all(|x| x.len() == n),
        "every rank must pass the same number of values"
    );
    n
}

/// Error of rounding an f32 value to `T` (0 for f32 itself).
fn rounding_bound<T: Element>(v: f32) -> f64 {
    if T::DTYPE == DType::F32 {
        0.0
    } else {
        0.5 * T::ulp_at(f64::from(v))
    }
}

/// The lossless reference: `acc = x_0`, then `acc += x_i` in rank order, in f32, rounded to `T`.
pub fn allreduce_lossless<T: Element>(inputs: &[&[T]]) -> Vec<T> {
    let n = check_inputs(inputs);
    (0..n)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for x in &inputs[1..] {
                acc += x[i].to_f32();
            }
            T::from_f32(acc)
        })
        .collect()
}

/// Encodes every rank's input with `fmt` and sums the decoded values in f32 in rank order
/// (`acc = v_0; acc = acc + v_i`). Returns the accumulators and the bound on their error against
/// the exact sum: the decode bounds of the N contributions plus half an f32 ulp per addition.
fn quantized_sum<T: Element>(fmt: Format, inputs: &[&[T]]) -> (Vec<f32>, Vec<f64>) {
    let n = check_inputs(inputs);
    let mut acc = vec![0f32; n];
    let mut bound = vec![0f64; n];
    let mut vals = vec![0f32; n];
    let mut b = vec![0f64; n];
    for (r, x) in inputs.iter().enumerate() {
        let enc = encode_to_vec(fmt, x).expect("format must be for T");
        decode_f32::<T>(fmt, &enc, n, &mut vals).expect("own encoding decodes");
        error_bound_f32::<T>(fmt, &enc, n, &mut b).expect("own encoding decodes");
        for i in 0..n {
            if r == 0 {
                acc[i] = vals[i];
                bound[i] = b[i];
            } else {
                acc[i] += vals[i];
                bound[i] += b[i] + 0.5 * ulp_f32(f64::from(acc[i]));
            }
        }
    }
    (acc, bound)
}

/// One-shot quantized all-reduce: each rank's input is encoded once with `fmt`; every rank
/// decodes all N encodings in rank order 0..N-1, accumulates in f32 (`acc = v_0;
/// acc = acc + v_i`) and rounds to `T`.
pub fn allreduce_oneshot<T: Element>(fmt: Format, inputs_per_rank: &[&[T]]) -> Vec<T> {
    allreduce_oneshot_with_bound(fmt, inputs_per_rank).values
}

/// [`allreduce_oneshot`] with its predicted per-element error bound: the sum of the N decode
/// bounds, half an f32 ulp per addition, and the final rounding to `T`.
pub fn allreduce_oneshot_with_bound<T: Element>(fmt: Format, inputs: &[&[T]]) -> Outcome<T> {
    let (acc, mut bound) = quantized_sum(fmt, inputs);
    let values = acc
        .iter()
        .zip(bound.iter_mut())
        .map(|(&a, b)| {
            *b += rounding_bound::<T>(a);
            T::from_f32(a)
        })
        .collect();
    Outcome { values, bound }
}

/// Two-step quantized all-reduce (reduce-scatter, then all-gather). Each rank's input is encoded
/// with `fmt_rs`; the buffer's `nb = ceil(n / 1024)` blocks are split over N shards by
/// [`shard_blocks`]; for each block, its owner runs [`reduce_requantize`] over the N ranks'
/// encodings of that block (`fmt_rs` to `fmt_ag`); every rank decodes the same output bytes.
pub fn allreduce_twostep<T: Element>(fmt_rs: Format, fmt_ag: Format, inputs: &[&[T]]) -> Vec<T> {
    twostep_bytes(fmt_rs, fmt_ag, inputs).0
}

/// Runs the two-step algorithm; returns the decoded result and the gathered bytes.
fn twostep_bytes<T: Element>(fmt_rs: Format, fmt_ag: Format, inputs: &[&[T]]) -> (Vec<T>, Vec<u8>) {
    let n = check_inputs(inputs);
    let nranks = inputs.len();
    let encoded: Vec<Vec<u8>> = inputs
        .iter()
        .map(|x| encode_to_vec(fmt_rs, x).expect("fmt_rs must be for T"))
        .collect();
    let (bb_rs, bb_ag) = (fmt_rs.block_bytes(), fmt_ag.block_bytes());
    let nb = Format::blocks(n);
    let mut gathered = vec![0u8; fmt_ag.encoded_len(n)];
    for shard in 0..nranks {
        for b in shard_blocks(nb, nranks, shard) {
            let nv = Format::block_values(n, b);
            let parts: Vec<&[u8]> = encoded
                .iter()
                .map(|e| &e[b * bb_rs..(b + 1) * bb_rs])
                .collect();
            let out = &mut gathered[b * bb_ag..(b + 1) * bb_ag];
            reduce_requantize::<T>(fmt_rs, &parts, nv, fmt_ag, out).expect("fmt_ag must be for T");
        }
    }
    let mut values = vec![T::default(); n];
    decode(fmt_ag, &gathered, n, &mut values).expect("own encoding decodes");
    (values, gathered)
}

/// [`allreduce_twostep`] with its predicted per-element error bound: the first-step decode bounds
/// of the N contributions, half an f32 ulp per addition, the rounding of the sum to `T`, the
/// second-step decode bound, and the final rounding to `T`.
pub fn allreduce_twostep_with_bound<T: Element>(
    fmt_rs: Format,
    fmt_ag: Format,
    inputs: &[&[T]],
) -> Outcome<T> {
    let (values, gathered) = twostep_bytes(fmt_rs, fmt_ag, inputs);
    let n = values.len();
    let (acc, mut bound) = quantized_sum(fmt_rs, inputs);
    let mut v_ag = vec![0f32; n];
    let mut b_ag = vec![0f64; n];
    decode_f32::<T>(fmt_ag, &gathered, n, &mut v_ag).expect("own encoding decodes");
    error_bound_f32::<T>(fmt_ag, &gathered, n, &mut b_ag).expect("own encoding decodes");
    for i in 0..n {
        bound[i] += rounding_bound::<T>(acc[i]) + b_ag[i] + rounding_bound::<T>(v_ag[i]);
    }
    Outcome { values, bound }
}

/// One block of values through the wire: encoded once with `fmt`, decoded by its receiver, with
/// the per-element bound of that round trip against the block's own values (the decode bound
/// plus the rounding of the decoded f32 to `T`).
fn round_trip<T: Element>(fmt: Format, block: &[T]) -> (Vec<T>, Vec<f64>) {
    let n = block.len();
    let enc = encode_to_vec(fmt, block).expect("format must be for T");
    let mut vals = vec![0f32; n];
    let mut bound = vec![0f64; n];
    decode_f32::<T>(fmt, &enc, n, &mut vals).expect("own encoding decodes");
    error_bound_f32::<T>(fmt, &enc, n, &mut bound).expect("own encoding decodes");
    let values = vals
        .iter()
        .zip(bound.iter_mut())
        .map(|(&v, b)| {
            *b += rounding_bound::<T>(v);
            T::from_f32(v)
        })
        .collect();
    (values, bound)
}

/// Splits every rank's input into `nranks` equal blocks (the per-peer blocks of AllToAll, the
/// shards of ReduceScatter); returns the block length.
fn per_peer_len<T: Element>(inputs: &[&[T]]) -> usize {
    let n = check_inputs(inputs);
    let nranks = inputs.len();
    assert!(
        n.is_multiple_of(nranks),
        "{n} values do not split into {nranks} equal blocks"
    );
    n / nranks
}

/// Quantized AllGather: each rank's input is encoded once with `fmt`, and every rank (its owner
/// too) decodes every rank's bytes, so every rank holds the same values: the concatenation, in
/// rank order, of each input's round trip through the codec.
pub fn allgather_quant<T: Element>(fmt: Format, inputs: &[&[T]]) -> Outcome<T> {
    check_inputs(inputs);
    let mut out = Outcome {
        values: Vec::new(),
        bound: Vec::new(),
    };
    for x in inputs {
        let (v, b) = round_trip(fmt, x);
        out.values.extend(v);
        out.bound.extend(b);
    }
    out
}

/// Quantized AllToAll: every rank's input holds `nranks` blocks of equal length; block `p` of
/// rank `r` is encoded once with `fmt` (as a buffer of its own) and decoded by rank `p` (the same
/// for `p == r`), which places it at block `r` of its output. Returns every rank's output.
pub fn alltoall_quant<T: Element>(fmt: Format, inputs: &[&[T]]) -> Vec<Outcome<T>> {
    let len = per_peer_len(inputs);
    (0..inputs.len())
        .map(|p| {
            let mut out = Outcome {
                values: Vec::with_capacity(len * inputs.len()),
                bound: Vec::with_capacity(len * inputs.len()),
            };
            for x in inputs {
                let (v, b) = round_trip(fmt, &x[p * len..(p + 1) * len]);
                out.values.extend(v);
                out.bound.extend(b);
            }
            out
        })
        .collect()
}

/// Quantized ReduceScatter: every rank's input holds `nranks` shards of equal length; shard `j`
/// of every rank is encoded once with `fmt` (as a buffer of its own); its owner, rank `j`, decodes
/// the N encodings of its shard (its own included) and sums them in f32 in rank order
/// (`acc = v_0; acc = acc + v_i`), then rounds to `T`: full precision out, one quantization step.
/// Returns every rank's output with its bound against the exact sum.
pub fn reducescatter_quant<T: Element>(fmt: Format, inputs: &[&[T]]) -> Vec<Outcome<T>> {
    let len = per_peer_len(inputs);
    (0..inputs.len())
        .map(|j| {
            let shards: Vec<&[T]> = inputs.iter().map(|x| &x[j * len..(j + 1) * len]).collect();
            allreduce_oneshot_with_bound(fmt, &shards)
        })
        .collect()
}

#[cfg(test)]
mod collective_tests {
    use super::*;
    use crate::rng::Rng;
    use half::bf16;

    fn inputs(nranks: usize, n: usize, seed: u64) -> Vec<Vec<bf16>> {
        let mut rng = Rng::new(seed);
        (0..nranks)
            .map(|_| {
                (0..n)
                    .map(|i| {
                        let v = rng.normal() as f32;
                        bf16::from_f32(if i % 997 == 5 { v * 50.0 } else { v })
                    })
                    .collect()
            })
            .collect()
    }

    fn fmt(bits: u8) -> Format {
        Format::new(DType::Bf16, bits, 128, 2).unwrap()
    }

    fn within(values: &[bf16], exact: &[f64], bound: &[f64]) {
        for i in 0..values.len() {
            let err = (f64::from(values[i].to_f32()) - exact[i]).abs();
            assert!(
                err <= bound[i] * (1.0 + 1e-9) + 1e-30,
                "element {i}: {err} > {}",
                bound[i]
            );
        }
    }

    #[test]
    fn allgather_is_every_block_round_tripped_in_rank_order() {
        let xs = inputs(4, 3000, 1);
        let refs: Vec<&[bf16]> = xs.iter().map(|v| v.as_slice()).collect();
        for bits in [2, 4, 8] {
            let out = allgather_quant(fmt(bits), &refs);
            assert_eq!(out.values.len(), 4 * 3000);
            let exact: Vec<f64> = xs.iter().flatten().map(|v| f64::from(v.to_f32())).collect();
            within(&out.values, &exact, &out.bound);
            // One rank's block is exactly its own round trip: independent of the other ranks.
            let alone = allgather_quant(fmt(bits), &refs[1..2]);
            assert_eq!(&out.values[3000..6000], &alone.values[..]);
        }
    }

    #[test]
    fn alltoall_moves_block_p_of_rank_r_to_block_r_of_rank_p() {
        let xs = inputs(3, 3 * 700, 2);
        let refs: Vec<&[bf16]> = xs.iter().map(|v| v.as_slice()).collect();
        let outs = alltoall_quant(fmt(4), &refs);
        assert_eq!(outs.len(), 3);
        for (p, out) in outs.iter().enumerate() {
            for (r, x) in xs.iter().enumerate() {
                let sent = &x[p * 700..(p + 1) * 700];
                let exact: Vec<f64> = sent.iter().map(|v| f64::from(v.to_f32())).collect();
                within(
                    &out.values[r * 700..(r + 1) * 700],
                    &exact,
                    &out.bound[r * 700..(r + 1) * 700],
                );
                let (alone, _) = round_trip(fmt(4), sent);
                assert_eq!(&out.values[r * 700..(r + 1) * 700], &alone[..]);
            }
        }
    }

    #[test]
    fn reducescatter_sums_decoded_shards_within_the_bound() {
        let xs = inputs(4, 4 * 1500, 3);
        let refs: Vec<&[bf16]> = xs.iter().map(|v| v.as_slice()).collect();
        for bits in [3, 5, 8] {
            let outs = reducescatter_quant(fmt(bits), &refs);
            for (j, out) in outs.iter().enumerate() {
                let exact: Vec<f64> = (0..1500)
                    .map(|i| {
                        xs.iter()
                            .map(|x| f64::from(x[j * 1500 + i].to_f32()))
                            .sum::<f64>()
                    })
                    .collect();
                within(&out.values, &exact, &out.bound);
            }
        }
    }

    #[test]
    #[should_panic(expected = "do not split")]
    fn uneven_blocks_are_a_programming_error() {
        let xs = inputs(3, 100, 4);
        let refs: Vec<&[bf16]> = xs.iter().map(|v| v.as_slice()).collect();
        let _ = alltoall_quant(fmt(4), &refs);
    }
}
