//! The error columns of quantized rows, computed on the host.
//!
//! The GPU result of a quantized AllReduce is compared, element by element, with
//! * the exact sum of the inputs (fp64 sum of the inputs as rounded to the element type): relL2
//!   = ||y - s|| / ||s||, maxerr = max |y - s|;
//! * the per-element bound the codec predicts (`flashcomm_codec::reference::*_with_bound`):
//!   `#wrong` counts elements with |y - s| > bound (and non-finite results);
//! * the CPU reference of the same algorithm, bit for bit (`ref_mismatch`, in the JSON file):
//!   the kernels are specified to reproduce it exactly.
//!
//! The one-step quantized AllGather, AllToAll and ReduceScatter ([`QuantOp`], [`evaluate_op`])
//! are compared the same way with the exact values (the inputs themselves for AllGather and
//! AllToAll, the fp64 sum of the shards for ReduceScatter) and with their CPU references,
//! `flashcomm_codec::reference::{allgather_quant, alltoall_quant, reducescatter_quant}`; for
//! them `#wrong` counts both the values outside the bound and the bytes that differ from the
//! reference (`ref_mismatch_bytes`).
//!
//! Large calls are checked on a sample of whole 1024-value blocks (`--check-values`). Blocks are
//! independent in every algorithm (one-shot decodes each block on its own; two-step requantizes
//! each block by whichever rank owns it, with the same bytes as a whole-buffer
//! `reduce_requantize`; the one-step collectives encode each rank's input, per-peer block or
//! shard as a buffer of its own), so the reference of a window of blocks equals those blocks of
//! the reference of the whole buffer. For the one-step collectives the windows are counted from
//! the start of each output segment (one per source rank for AllGather and AllToAll, the shard
//! for ReduceScatter), where each encoded buffer starts.

use std::ops::Range;

pub use flashcomm_codec::QuantOp;
use flashcomm_codec::reference::{
    Outcome, allgather_quant, allreduce_oneshot_with_bound, allreduce_twostep_with_bound,
};
use flashcomm_codec::{BLOCK_VALUES, Element, Format};

use crate::inputs;

/// Which reference algorithm the plan ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantAlgo {
    /// Each rank's input encoded once; every rank decodes all of them.
    OneShot,
    /// Reduce-scatter with requantization, then all-gather.
    TwoStep,
}

/// What the checks need to know of a one-step quantized collective.
pub trait OpShape {
    /// Segments of `len` values in a rank's output: one per source rank, or the one shard.
    fn segments(self, nranks: u32) -> usize;
    /// Whether every rank's output is the same (so one rank checks it against the reference and
    /// the others are compared with it byte for byte).
    fn same_everywhere(self) -> bool;
}

impl OpShape for QuantOp {
    fn segments(self, nranks: u32) -> usize {
        match self {
            QuantOp::AllGather | QuantOp::AlltoAll => nranks.max(1) as usize,
            QuantOp::ReduceScatter => 1,
        }
    }

    fn same_everywhere(self) -> bool {
        self == QuantOp::AllGather
    }
}

/// What the check found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AccuracyStats {
    /// Elements compared.
    pub checked: u64,
    /// ||y - s||_2 / ||s||_2 over the compared elements.
    pub rel_l2: f64,
    /// max |y - s|.
    pub max_err: f64,
    /// Elements with |y - s| above the predicted bound, or not finite.
    pub outside_bound: u64,
    /// Elements whose bits differ from the CPU reference of the same algorithm.
    pub ref_mismatch: u64,
    /// Bytes of the compared elements that differ from the CPU reference.
    pub ref_mismatch_bytes: u64,
    /// sum |y - s|^2 over the finite errors (to combine the checks of several ranks).
    pub err2: f64,
    /// sum s^2 over the same elements.
    pub ref2: f64,
}

impl AccuracyStats {
    /// The `#wrong` of a one-step quantized collective's check: values outside the reference's
    /// bound plus bytes that differ from the reference (the kernels are specified to reproduce
    /// it bit for bit).
    pub fn wrong_one_step(&self) -> u64 {
        self.outside_bound + self.ref_mismatch_bytes
    }

    /// The statistics of several checks together (the ranks of a call whose outputs differ):
    /// counts and sums add, relL2 is recomputed from the sums, maxerr is the largest. One check
    /// comes back unchanged; none gives `None`.
    pub fn combine<'a>(parts: impl IntoIterator<Item = &'a AccuracyStats>) -> Option<Self> {
        let parts: Vec<&AccuracyStats> = parts.into_iter().collect();
        match parts.as_slice() {
            [] => None,
            [one] => Some((*one).clone()),
            many => {
                let mut t = AccuracyStats::default();
                for p in many {
                    t.checked += p.checked;
                    t.err2 += p.err2;
                    t.ref2 += p.ref2;
                    t.max_err = t.max_err.max(p.max_err);
                    t.outside_bound += p.outside_bound;
                    t.ref_mismatch += p.ref_mismatch;
                    t.ref_mismatch_bytes += p.ref_mismatch_bytes;
                }
                t.rel_l2 = rel_l2(t.err2, t.ref2);
                Some(t)
            }
        }
    }
}

fn rel_l2(err2: f64, ref2: f64) -> f64 {
    if ref2 > 0.0 {
        (err2 / ref2).sqrt()
    } else {
        err2.sqrt()
    }
}

/// Value ranges to check for a call of `count` values when at most `max_values` may be checked:
/// everything if it fits, else up to 64 windows of whole blocks spread evenly over the buffer,
/// the first starting at value 0 and the last ending at the last value. Sorted, disjoint.
pub fn windows(count: usize, max_values: usize) -> Vec<Range<usize>> {
    if count <= max_values.max(BLOCK_VALUES) {
        return std::iter::once(0..count).collect();
    }
    let nb = count.div_ceil(BLOCK_VALUES);
    let budget = (max_values / BLOCK_VALUES).max(1);
    let k = budget.min(64);
    let w = budget / k;
    let mut out: Vec<Range<usize>> = Vec::with_capacity(k);
    for i in 0..k {
        let first = if k == 1 { 0 } else { i * (nb - w) / (k - 1) };
        let r = first * BLOCK_VALUES..((first + w) * BLOCK_VALUES).min(count);
        match out.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Total values in `windows`.
pub fn window_values(windows: &[Range<usize>]) -> usize {
    windows.iter().map(|r| r.len()).sum()
}

/// The windows of one output segment that a rank of a one-step collective checks, for segments
/// of `len` values when at most `max_values` values of the rank's output may be checked: the
/// budget is shared evenly by the segments (at least one block each), and every segment is
/// checked at the same windows.
pub fn op_windows(op: QuantOp, nranks: u32, len: usize, max_values: usize) -> Vec<Range<usize>> {
    windows(len, max_values / op.segments(nranks))
}

/// Where the values of `windows` lie in a rank's output of a one-step collective: every
/// segment's windows, segment by segment. Their concatenation is what [`evaluate_op`] takes.
pub fn op_output_ranges(
    op: QuantOp,
    nranks: u32,
    len: usize,
    windows: &[Range<usize>],
) -> Vec<Range<usize>> {
    (0..op.segments(nranks))
        .flat_map(|s| {
            windows
                .iter()
                .map(move |w| s * len + w.start..s * len + w.end)
        })
        .collect()
}

#[derive(Default)]
struct Partial {
    checked: u64,
    err2: f64,
    ref2: f64,
    max_err: f64,
    outside: u64,
    mismatch: u64,
    mismatch_bytes: u64,
}

impl Partial {
    /// Compares the GPU values `gpu` with the reference and the exact values, element by element.
    fn tally<T: Element>(&mut self, gpu: &[T], reference: &Outcome<T>, exact: &[f64]) {
        for (j, &y) in gpu.iter().enumerate() {
            let yv = f64::from(y.to_f32());
            let e = (yv - exact[j]).abs();
            self.checked += 1;
            let diff = y.to_bits() ^ reference.values[j].to_bits();
            if diff != 0 {
                self.mismatch += 1;
                self.mismatch_bytes += (0..T::BYTES)
                    .filter(|b| (diff >> (8 * b)) & 0xFF != 0)
                    .count() as u64;
            }
            if !e.is_finite() {
                self.outside += 1;
                continue;
            }
            self.err2 += e * e;
            self.ref2 += exact[j] * exact[j];
            self.max_err = self.max_err.max(e);
            // A NaN bound (a poisoned input group) promises nothing; our inputs are finite.
            if e > reference.bound[j] {
                self.outside += 1;
            }
        }
    }

    fn add(&mut self, p: &Partial) {
        self.checked += p.checked;
        self.err2 += p.err2;
        self.ref2 += p.ref2;
        self.max_err = self.max_err.max(p.max_err);
        self.outside += p.outside;
        self.mismatch += p.mismatch;
        self.mismatch_bytes += p.mismatch_bytes;
    }

    fn stats(self) -> AccuracyStats {
        AccuracyStats {
            checked: self.checked,
            rel_l2: rel_l2(self.err2, self.ref2),
            max_err: self.max_err,
            outside_bound: self.outside,
            ref_mismatch: self.mismatch,
            ref_mismatch_bytes: self.mismatch_bytes,
            err2: self.err2,
            ref2: self.ref2,
        }
    }
}

/// Checks the GPU values of one piece: (segment, range of the segment, its GPU values, totals).
type CheckFn<'a, T> = dyn Fn(usize, Range<usize>, &[T], &mut Partial) + Sync + 'a;

/// A piece of work: `range` of output segment `segment`, whose GPU values start at `at`.
struct Piece {
    segment: usize,
    range: Range<usize>,
    at: usize,
}

/// Cuts `windows` of each of `segments` segments into pieces of whole blocks and runs `check`
/// on them with up to `threads` threads. `gpu` holds the values of the windows, segment by
/// segment.
fn run_pieces<T: Element>(
    segments: usize,
    windows: &[Range<usize>],
    gpu: &[T],
    threads: usize,
    check: &CheckFn<'_, T>,
) -> AccuracyStats {
    assert_eq!(
        gpu.len(),
        segments * window_values(windows),
        "one GPU value per window value"
    );
    // Cut the windows into pieces of whole blocks so that the threads share the work.
    const PIECE: usize = 64 * BLOCK_VALUES;
    let mut pieces: Vec<Piece> = Vec::new();
    let mut offset = 0;
    for segment in 0..segments {
        for w in windows {
            let mut s = w.start;
            while s < w.end {
                let e = (s + PIECE).min(w.end);
                pieces.push(Piece {
                    segment,
                    range: s..e,
                    at: offset + (s - w.start),
                });
                s = e;
            }
            offset += w.len();
        }
    }
    let threads = threads.clamp(1, 64).min(pieces.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let partials: Vec<Partial> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (pieces, next) = (&pieces, &next);
                sc.spawn(move || {
                    let mut p = Partial::default();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(pc) = pieces.get(i) else {
                            break;
                        };
                        let len = pc.range.len();
                        check(
                            pc.segment,
                            pc.range.clone(),
                            &gpu[pc.at..pc.at + len],
                            &mut p,
                        );
                    }
                    p
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("accuracy worker"))
            .collect()
    });
    let mut t = Partial::default();
    for p in &partials {
        t.add(p);
    }
    t.stats()
}

/// Rank `rank`'s inputs at indices `range` (see [`inputs`]).
fn rank_inputs<T: Element>(seed: u64, rank: u32, range: Range<usize>) -> Vec<T> {
    range
        .map(|i| inputs::element::<T>(seed, rank, i as u64))
        .collect()
}

/// Compares `gpu` (the values of `windows` of a quantized AllReduce, concatenated) with the
/// references, regenerating every rank's inputs from `seed` (see [`inputs`]). Uses up to
/// `threads` threads.
#[allow(clippy::too_many_arguments)]
pub fn evaluate<T: Element>(
    algo: QuantAlgo,
    fmt_rs: Format,
    fmt_ag: Format,
    nranks: u32,
    seed: u64,
    windows: &[Range<usize>],
    gpu: &[T],
    threads: usize,
) -> AccuracyStats {
    run_pieces(1, windows, gpu, threads, &|_, range, gpu, p| {
        let ins: Vec<Vec<T>> = (0..nranks)
            .map(|r| rank_inputs(seed, r, range.clone()))
            .collect();
        let slices: Vec<&[T]> = ins.iter().map(Vec::as_slice).collect();
        let reference = match algo {
            QuantAlgo::OneShot => allreduce_oneshot_with_bound(fmt_rs, &slices),
            QuantAlgo::TwoStep => allreduce_twostep_with_bound(fmt_rs, fmt_ag, &slices),
        };
        let exact = exact_sum(&slices);
        p.tally(gpu, &reference, &exact);
    })
}

/// The fp64 sum of the inputs, element by element.
fn exact_sum<T: Element>(ins: &[&[T]]) -> Vec<f64> {
    let n = ins.first().map_or(0, |x| x.len());
    (0..n)
        .map(|j| ins.iter().map(|x| f64::from(x[j].to_f32())).sum())
        .collect()
}

/// Compares `gpu` with the references of a one-step quantized collective at rank `me`: `gpu`
/// holds the values of `windows` (as from [`op_windows`]) of every output segment, segment by
/// segment (the ranges of [`op_output_ranges`]), for a call of `len` values per segment (the
/// call's count: AllGather's sendcount, AllToAll's count per peer, ReduceScatter's recvcount).
/// Every rank's inputs are regenerated from `seed` (see [`inputs`]; rank r's send buffer holds
/// its values 0.., one segment for AllGather, `nranks` for the others). Uses up to `threads`
/// threads.
///
/// The windows' references are those of `flashcomm_codec::reference`: a segment of AllGather
/// and of AllToAll is one buffer's round trip through the wire, which is what `allgather_quant`
/// of that buffer alone gives (and what `alltoall_quant` gives for each per-peer block); the
/// shard of ReduceScatter is `reducescatter_quant`'s, the one-shot sum of the N ranks' encoded
/// shards (`allreduce_oneshot_with_bound` of the shards). The tests check both against the
/// whole-buffer references.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_op<T: Element>(
    op: QuantOp,
    fmt: Format,
    nranks: u32,
    me: u32,
    seed: u64,
    len: usize,
    windows: &[Range<usize>],
    gpu: &[T],
    threads: usize,
) -> AccuracyStats {
    assert!(
        windows.iter().all(|w| w.end <= len),
        "windows lie inside a segment"
    );
    let base = me as usize * len;
    run_pieces(
        op.segments(nranks),
        windows,
        gpu,
        threads,
        &|segment, range, gpu, p| match op {
            QuantOp::AllGather | QuantOp::AlltoAll => {
                // Segment s is rank s's input (AllGather) or rank s's block for this rank.
                let at = if op == QuantOp::AllGather { 0 } else { base };
                let x: Vec<T> = rank_inputs(seed, segment as u32, at + range.start..at + range.end);
                let reference = allgather_quant(fmt, &[x.as_slice()]);
                let exact: Vec<f64> = x.iter().map(|v| f64::from(v.to_f32())).collect();
                p.tally(gpu, &reference, &exact);
            }
            QuantOp::ReduceScatter => {
                let ins: Vec<Vec<T>> = (0..nranks)
                    .map(|r| rank_inputs(seed, r, base + range.start..base + range.end))
                    .collect();
                let slices: Vec<&[T]> = ins.iter().map(Vec::as_slice).collect();
                let reference = allreduce_oneshot_with_bound(fmt, &slices);
                let exact = exact_sum(&slices);
                p.tally(gpu, &reference, &exact);
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashcomm_codec::reference::{allreduce_oneshot, alltoall_quant, reducescatter_quant};
    use flashcomm_codec::{DType, bf16, f16};

    #[test]
    fn small_calls_are_checked_whole() {
        assert_eq!(
            windows(10, 4 << 20),
            std::iter::once(0..10).collect::<Vec<_>>()
        );
        let one = windows(5000, 100);
        assert_eq!(
            (one.len(), one[0].clone()),
            (1, 0..1024),
            "at least one whole block"
        );
    }

    #[test]
    fn large_calls_are_sampled_in_whole_blocks_from_first_to_last() {
        let count = 100 * 1024 * 1024 + 77;
        let w = windows(count, 1 << 20);
        assert_eq!(w.first().unwrap().start, 0);
        assert_eq!(w.last().unwrap().end, count, "the tail block is included");
        for r in &w {
            assert_eq!(r.start % BLOCK_VALUES, 0);
            assert!(r.end == count || r.end % BLOCK_VALUES == 0);
        }
        assert!(
            w.windows(2).all(|p| p[0].end < p[1].start),
            "sorted and disjoint"
        );
        let n = window_values(&w);
        assert!(
            ((1 << 20) - 64 * BLOCK_VALUES..=1 << 20).contains(&n),
            "{n}"
        );
        // Windows that would touch merge.
        let m = windows(3 * 1024 + 5, 3 * 1024);
        assert_eq!(window_values(&m), m.iter().map(|r| r.len()).sum::<usize>());
        assert!(m.windows(2).all(|p| p[0].end < p[1].start));
    }

    #[test]
    fn exact_reference_results_have_no_wrong_elements() {
        let fmt = Format::new(DType::Bf16, 4, 128, 2).unwrap();
        let (nranks, seed, count) = (4u32, 9u64, 5000usize);
        let ins: Vec<Vec<bf16>> = (0..nranks)
            .map(|r| {
                (0..count)
                    .map(|i| inputs::element(seed, r, i as u64))
                    .collect()
            })
            .collect();
        let slices: Vec<&[bf16]> = ins.iter().map(Vec::as_slice).collect();
        let gpu = allreduce_oneshot(fmt, &slices);
        let w = windows(count, 1 << 20);
        let s = evaluate(QuantAlgo::OneShot, fmt, fmt, nranks, seed, &w, &gpu, 3);
        assert_eq!(s.checked, count as u64);
        assert_eq!((s.outside_bound, s.ref_mismatch), (0, 0));
        assert!(s.rel_l2 > 0.0 && s.rel_l2 < 0.1, "{}", s.rel_l2);
        assert!(s.max_err > 0.0);
        // The two-step reference differs from one-shot bit for bit in places.
        let t = evaluate(QuantAlgo::TwoStep, fmt, fmt, nranks, seed, &w, &gpu, 2);
        assert!(t.ref_mismatch > 0);
    }

    #[test]
    fn sampled_check_matches_the_whole_buffer_reference() {
        let fmt = Format::new(DType::Bf16, 3, 64, 2).unwrap();
        let fmt_ag = Format::new(DType::Bf16, 8, 64, 2).unwrap();
        let (nranks, seed, count) = (3u32, 4u64, 20 * 1024 + 300);
        let ins: Vec<Vec<bf16>> = (0..nranks)
            .map(|r| {
                (0..count)
                    .map(|i| inputs::element(seed, r, i as u64))
                    .collect()
            })
            .collect();
        let slices: Vec<&[bf16]> = ins.iter().map(Vec::as_slice).collect();
        let whole = allreduce_twostep_with_bound(fmt, fmt_ag, &slices).values;
        let w = windows(count, 4 * 1024);
        assert!(window_values(&w) < count);
        let gpu: Vec<bf16> = w.iter().flat_map(|r| whole[r.clone()].to_vec()).collect();
        let s = evaluate(QuantAlgo::TwoStep, fmt, fmt_ag, nranks, seed, &w, &gpu, 4);
        assert_eq!(
            s.ref_mismatch, 0,
            "windows of blocks reproduce the whole-buffer reference"
        );
        assert_eq!(s.outside_bound, 0);
    }

    #[test]
    fn wrong_values_are_counted() {
        let fmt = Format::new(DType::Bf16, 4, 128, 2).unwrap();
        let (nranks, seed, count) = (2u32, 3u64, 2048usize);
        let ins: Vec<Vec<bf16>> = (0..nranks)
            .map(|r| {
                (0..count)
                    .map(|i| inputs::element(seed, r, i as u64))
                    .collect()
            })
            .collect();
        let slices: Vec<&[bf16]> = ins.iter().map(Vec::as_slice).collect();
        let mut gpu = allreduce_oneshot(fmt, &slices);
        gpu[10] = bf16::from_f32(gpu[10].to_f32() + 100.0);
        gpu[11] = bf16::from_f32(f32::NAN);
        let whole = windows(count, count);
        let s = evaluate(QuantAlgo::OneShot, fmt, fmt, nranks, seed, &whole, &gpu, 1);
        assert_eq!((s.outside_bound, s.ref_mismatch), (2, 2));
        assert!(s.max_err >= 99.0);
    }
    /// Every rank's inputs of a one-step collective: `per_rank` values each.
    fn op_inputs<T: Element>(nranks: u32, seed: u64, per_rank: usize) -> Vec<Vec<T>> {
        (0..nranks)
            .map(|r| rank_inputs(seed, r, 0..per_rank))
            .collect()
    }

    /// The values of `ranges` of `out`, concatenated (what the GPU side downloads).
    fn take<T: Copy>(out: &[T], ranges: &[Range<usize>]) -> Vec<T> {
        ranges
            .iter()
            .flat_map(|r| out[r.clone()].to_vec())
            .collect()
    }

    /// Flips one byte of value `i` (its low byte) and returns the values.
    fn flip<T: Element>(mut v: Vec<T>, i: usize) -> Vec<T> {
        let mut b = vec![0u8; T::BYTES];
        v[i].write_le(&mut b);
        b[0] ^= 0x01;
        v[i] = T::read_le(&b);
        v
    }

    #[test]
    fn quant_op_shapes() {
        assert_eq!(QuantOp::AllGather.segments(4), 4);
        assert_eq!(QuantOp::AlltoAll.segments(8), 8);
        assert_eq!(QuantOp::ReduceScatter.segments(8), 1);
        assert!(QuantOp::AllGather.same_everywhere());
        assert!(!QuantOp::AlltoAll.same_everywhere() && !QuantOp::ReduceScatter.same_everywhere());
        // The budget is shared by the segments; each segment is checked at the same windows.
        let w = op_windows(QuantOp::AlltoAll, 4, 100 * 1024, 64 * 1024);
        assert_eq!(window_values(&w), 16 * 1024);
        let r = op_output_ranges(QuantOp::AlltoAll, 4, 100 * 1024, &w);
        assert_eq!(r.len(), 4 * w.len());
        assert_eq!(r[w.len()].start, 100 * 1024 + w[0].start);
        assert_eq!(
            op_output_ranges(QuantOp::ReduceScatter, 4, 5000, &windows(5000, 5000)),
            windows(5000, 5000)
        );
    }

    #[test]
    fn allgather_reference_output_has_no_wrong_values() {
        let fmt = Format::new(DType::Bf16, 4, 128, 2).unwrap();
        let (nranks, seed, len) = (4u32, 11u64, 2500usize);
        let ins: Vec<Vec<bf16>> = op_inputs(nranks, seed, len);
        let slices: Vec<&[bf16]> = ins.iter().map(Vec::as_slice).collect();
        let whole = allgather_quant(fmt, &slices).values;
        let w = op_windows(QuantOp::AllGather, nranks, len, 1 << 20);
        assert_eq!(w, vec![0..len], "small calls are checked whole");
        let gpu = take(
            &whole,
            &op_output_ranges(QuantOp::AllGather, nranks, len, &w),
        );
        assert_eq!(gpu, whole);
        // Every rank holds the same values: any `me` gives the same verdict.
        for me in [0, 3] {
            let s = evaluate_op(QuantOp::AllGather, fmt, nranks, me, seed, len, &w, &gpu, 3);
            assert_eq!(s.checked, (nranks as usize * len) as u64);
            assert_eq!(
                (s.outside_bound, s.ref_mismatch, s.ref_mismatch_bytes),
                (0, 0, 0)
            );
            assert_eq!(s.wrong_one_step(), 0);
            assert!(s.rel_l2 > 0.0 && s.rel_l2 < 0.2, "{}", s.rel_l2);
            assert!(s.max_err > 0.0);
        }
        // One flipped byte: one value and one byte off the reference.
        let bad = flip(gpu.clone(), len + 7);
        let s = evaluate_op(QuantOp::AllGather, fmt, nranks, 0, seed, len, &w, &bad, 2);
        assert_eq!((s.ref_mismatch, s.ref_mismatch_bytes), (1, 1));
        assert!(s.wrong_one_step() > 0);
        // A value far off: outside the bound too.
        let mut far = gpu;
        far[10] = bf16::from_f32(far[10].to_f32() + 100.0);
        let s = evaluate_op(QuantOp::AllGather, fmt, nranks, 0, seed, len, &w, &far, 2);
        assert_eq!(s.outside_bound, 1);
        assert!(s.ref_mismatch_bytes >= 1 && s.max_err >= 99.0);
    }

    #[test]
    fn alltoall_reference_outputs_have_no_wrong_values() {
        let fmt = Format::new(DType::F16, 3, 64, 2).unwrap();
        let (nranks, seed, len) = (3u32, 5u64, 20 * 1024 + 300);
        let ins: Vec<Vec<f16>> = op_inputs(nranks, seed, nranks as usize * len);
        let slices: Vec<&[f16]> = ins.iter().map(Vec::as_slice).collect();
        let outs = alltoall_quant(fmt, &slices);
        // Sampled: windows of whole blocks of every segment.
        let w = op_windows(QuantOp::AlltoAll, nranks, len, 12 * 1024);
        assert!(window_values(&w) < len && w.last().unwrap().end == len);
        let ranges = op_output_ranges(QuantOp::AlltoAll, nranks, len, &w);
        for (me, out) in outs.iter().enumerate() {
            let gpu = take(&out.values, &ranges);
            let s = evaluate_op(
                QuantOp::AlltoAll,
                fmt,
                nranks,
                me as u32,
                seed,
                len,
                &w,
                &gpu,
                4,
            );
            assert_eq!(s.checked, gpu.len() as u64);
            assert_eq!(
                (s.outside_bound, s.ref_mismatch_bytes),
                (0, 0),
                "rank {me}: windows reproduce the whole-buffer reference"
            );
            assert!(s.rel_l2 > 0.0 && s.rel_l2 < 0.3, "{}", s.rel_l2);
        }
        // Another rank's output is not this rank's.
        let gpu1 = take(&outs[1].values, &ranges);
        let s = evaluate_op(QuantOp::AlltoAll, fmt, nranks, 0, seed, len, &w, &gpu1, 2);
        assert!(s.ref_mismatch_bytes > 0 && s.outside_bound > 0);
        // One flipped byte of rank 2's output, checked whole.
        let whole = windows(len, len);
        let all = op_output_ranges(QuantOp::AlltoAll, nranks, len, &whole);
        let bad = flip(take(&outs[2].values, &all), 2 * len + 1023);
        let s = evaluate_op(
            QuantOp::AlltoAll,
            fmt,
            nranks,
            2,
            seed,
            len,
            &whole,
            &bad,
            3,
        );
        assert_eq!((s.ref_mismatch, s.ref_mismatch_bytes), (1, 1));
        assert!(s.wrong_one_step() > 0);
    }

    #[test]
    fn reducescatter_reference_outputs_have_no_wrong_values() {
        let fmt = Format::new(DType::Bf16, 4, 128, 2).unwrap();
        let (nranks, seed, len) = (4u32, 7u64, 9 * 1024 + 77);
        let ins: Vec<Vec<bf16>> = op_inputs(nranks, seed, nranks as usize * len);
        let slices: Vec<&[bf16]> = ins.iter().map(Vec::as_slice).collect();
        let outs = reducescatter_quant(fmt, &slices);
        for whole in [true, false] {
            let w = if whole {
                op_windows(QuantOp::ReduceScatter, nranks, len, 1 << 20)
            } else {
                op_windows(QuantOp::ReduceScatter, nranks, len, 3 * 1024)
            };
            assert_eq!(whole, window_values(&w) == len);
            let ranges = op_output_ranges(QuantOp::ReduceScatter, nranks, len, &w);
            for (me, out) in outs.iter().enumerate() {
                let gpu = take(&out.values, &ranges);
                let s = evaluate_op(
                    QuantOp::ReduceScatter,
                    fmt,
                    nranks,
                    me as u32,
                    seed,
                    len,
                    &w,
                    &gpu,
                    2,
                );
                assert_eq!(s.checked, gpu.len() as u64);
                assert_eq!(
                    (s.outside_bound, s.ref_mismatch, s.ref_mismatch_bytes),
                    (0, 0, 0)
                );
                assert!(s.rel_l2 > 0.0 && s.rel_l2 < 0.2, "{}", s.rel_l2);
            }
        }
        // The exact value is the sum of the shards: the unquantized sum is close but not the
        // reference (bits differ), and a value far off is outside the bound.
        let w = windows(len, len);
        let mut gpu = outs[1].values.clone();
        gpu[5] = bf16::from_f32(gpu[5].to_f32() - 50.0);
        let bad = flip(gpu, 9);
        let s = evaluate_op(
            QuantOp::ReduceScatter,
            fmt,
            nranks,
            1,
            seed,
            len,
            &w,
            &bad,
            1,
        );
        assert_eq!(s.ref_mismatch, 2);
        assert!(s.ref_mismatch_bytes >= 2);
        assert_eq!(s.outside_bound, 1);
        assert_eq!(s.wrong_one_step(), 1 + s.ref_mismatch_bytes);
    }

    #[test]
    fn checks_of_several_ranks_combine() {
        let a = AccuracyStats {
            checked: 10,
            max_err: 0.5,
            outside_bound: 1,
            ref_mismatch: 2,
            ref_mismatch_bytes: 3,
            err2: 1.0,
            ref2: 100.0,
            rel_l2: 0.1,
        };
        let b = AccuracyStats {
            checked: 30,
            max_err: 0.25,
            err2: 3.0,
            ref2: 300.0,
            rel_l2: 0.1,
            ..AccuracyStats::default()
        };
        assert_eq!(AccuracyStats::combine([]), None);
        assert_eq!(AccuracyStats::combine([&a]), Some(a.clone()));
        let c = AccuracyStats::combine([&a, &b]).unwrap();
        assert_eq!((c.checked, c.outside_bound, c.ref_mismatch), (40, 1, 2));
        assert_eq!((c.ref_mismatch_bytes, c.max_err), (3, 0.5));
        assert!((c.rel_l2 - 0.1).abs() < 1e-12);
    }
}
