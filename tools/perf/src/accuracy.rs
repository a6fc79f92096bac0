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
//! Large calls are checked on a sample of whole 1024-value blocks (`--check-values`). Blocks are
//! independent in both algorithms (one-shot decodes each block on its own; two-step requantizes
//! each block by whichever rank owns it, with the same bytes as a whole-buffer
//! `reduce_requantize`), so the reference of a window of blocks equals those blocks of the
//! reference of the whole buffer.

use std::ops::Range;

use flashcomm_codec::reference::{allreduce_oneshot_with_bound, allreduce_twostep_with_bound};
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

#[derive(Default)]
struct Partial {
    checked: u64,
    err2: f64,
    ref2: f64,
    max_err: f64,
    outside: u64,
    mismatch: u64,
}

/// Compares `gpu` (the values of `windows`, concatenated) with the references, regenerating
/// every rank's inputs from `seed` (see [`inputs`]). Uses up to `threads` threads.
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
    assert_eq!(
        gpu.len(),
        window_values(windows),
        "one GPU value per window value"
    );
    // Cut the windows into pieces of whole blocks so that the threads share the work.
    const PIECE: usize = 64 * BLOCK_VALUES;
    let mut pieces: Vec<(Range<usize>, usize)> = Vec::new();
    let mut offset = 0;
    for w in windows {
        let mut s = w.start;
        while s < w.end {
            let e = (s + PIECE).min(w.end);
            pieces.push((s..e, offset + (s - w.start)));
            s = e;
        }
        offset += w.len();
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
                        let Some((range, at)) = pieces.get(i) else {
                            break;
                        };
                        piece(
                            algo,
                            fmt_rs,
                            fmt_ag,
                            nranks,
                            seed,
                            range.clone(),
                            &gpu[*at..*at + range.len()],
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
    for p in partials {
        t.checked += p.checked;
        t.err2 += p.err2;
        t.ref2 += p.ref2;
        t.max_err = t.max_err.max(p.max_err);
        t.outside += p.outside;
        t.mismatch += p.mismatch;
    }
    AccuracyStats {
        checked: t.checked,
        rel_l2: if t.ref2 > 0.0 {
            (t.err2 / t.ref2).sqrt()
        } else {
            t.err2.sqrt()
        },
        max_err: t.max_err,
        outside_bound: t.outside,
        ref_mismatch: t.mismatch,
    }
}

#[allow(clippy::too_many_arguments)]
fn piece<T: Element>(
    algo: QuantAlgo,
    fmt_rs: Format,
    fmt_ag: Format,
    nranks: u32,
    seed: u64,
    range: Range<usize>,
    gpu: &[T],
    p: &mut Partial,
) {
    let ins: Vec<Vec<T>> = (0..nranks)
        .map(|r| {
            range
                .clone()
                .map(|i| inputs::element::<T>(seed, r, i as u64))
                .collect()
        })
        .collect();
    let slices: Vec<&[T]> = ins.iter().map(Vec::as_slice).collect();
    let reference = match algo {
        QuantAlgo::OneShot => allreduce_oneshot_with_bound(fmt_rs, &slices),
        QuantAlgo::TwoStep => allreduce_twostep_with_bound(fmt_rs, fmt_ag, &slices),
    };
    for (j, &y) in gpu.iter().enumerate() {
        let exact: f64 = ins.iter().map(|x| f64::from(x[j].to_f32())).sum();
        let yv = f64::from(y.to_f32());
        let e = (yv - exact).abs();
        p.checked += 1;
        if y.to_bits() != reference.values[j].to_bits() {
            p.mismatch += 1;
        }
        if !e.is_finite() {
            p.outside += 1;
            continue;
        }
        p.err2 += e * e;
        p.ref2 += exact * exact;
        p.max_err = p.max_err.max(e);
        // A NaN bound (a poisoned input group) promises nothing; our inputs are finite.
        if e > reference.bound[j] {
            p.outside += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashcomm_codec::reference::allreduce_oneshot;
    use flashcomm_codec::{DType, bf16};

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
}
