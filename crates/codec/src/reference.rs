//! The all-reduce algorithms as the GPU kernels compute them (`docs/codec.md`, "Reference
//! algorithms"), so that GPU tests and the accuracy study can compare results bit for bit.
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
