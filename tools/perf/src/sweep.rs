//! The size sweep and the byte and bandwidth arithmetic, as nccl-tests defines them.
//!
//! * Sizes go from `-b` to `-e`, multiplied by `-f` each step (or increased by `-i` when `-f`
//!   is 1): `-b 8 -e 128M -f 2` gives 8, 16, ..., 128M (25 sizes).
//! * The `size(B)` column is the whole vector: the buffer of AllReduce, the send buffer of
//!   ReduceScatter (all ranks' blocks), the receive buffer of AllGather. `count(elements)` is
//!   that size in elements. ReduceScatter and AllGather need a multiple of the rank count, so
//!   their sizes are rounded down to one (at least one element per rank).
//! * algbw = size / time; busbw = algbw x 2(n-1)/n for AllReduce, x (n-1)/n for the others.

use crate::args::Collective;

/// The sizes nccl-tests would visit for `-b min -e max -f factor -i step`.
pub fn sizes(min: u64, max: u64, factor: u64, step: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        let next = if factor > 1 {
            s.checked_mul(factor)
        } else {
            s.checked_add(step)
        };
        match next {
            Some(n) if n > s => s = n,
            _ => break,
        }
    }
    out
}

/// One point of the sweep for one collective, type and rank count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Bytes of the whole vector (the `size(B)` column).
    pub bytes: u64,
    /// Elements of the whole vector (the `count(elements)` column).
    pub count: u64,
    /// The count argument of the call: elements of AllReduce, receive count of ReduceScatter,
    /// send count of AllGather.
    pub call_count: u64,
    /// Bytes of each rank's send buffer.
    pub send_bytes: u64,
    /// Bytes of each rank's receive buffer.
    pub recv_bytes: u64,
}

/// The call for a requested size (rounded down to whole elements, and to a multiple of the
/// ranks for ReduceScatter and AllGather; never below one element per rank).
pub fn shape(coll: Collective, size: u64, elem: u64, nranks: u32) -> Shape {
    let n = u64::from(nranks.max(1));
    let elems = (size / elem).max(1);
    match coll {
        Collective::AllReduce => Shape {
            bytes: elems * elem,
            count: elems,
            call_count: elems,
            send_bytes: elems * elem,
            recv_bytes: elems * elem,
        },
        Collective::ReduceScatter => {
            let per = (elems / n).max(1);
            Shape {
                bytes: per * n * elem,
                count: per * n,
                call_count: per,
                send_bytes: per * n * elem,
                recv_bytes: per * elem,
            }
        }
        // AllGather sends one block; nccl-tests' alltoall_perf sends every rank's whole buffer,
        // `size / n` to each peer.
        Collective::AllGather | Collective::AlltoAll => {
            let per = (elems / n).max(1);
            let sent = if coll == Collective::AlltoAll {
                per * n
            } else {
                per
            };
            Shape {
                bytes: per * n * elem,
                count: per * n,
                call_count: per,
                send_bytes: sent * elem,
                recv_bytes: per * n * elem,
            }
        }
        // Never measured (`--coll` refuses them): the plain message.
        _ => Shape {
            bytes: elems * elem,
            count: elems,
            call_count: elems,
            send_bytes: elems * elem,
            recv_bytes: elems * elem,
        },
    }
}

/// The shapes of a sweep, with sizes that round to the same call dropped.
pub fn shapes(coll: Collective, sizes: &[u64], elem: u64, nranks: u32) -> Vec<Shape> {
    let mut out: Vec<Shape> = Vec::new();
    for &s in sizes {
        let sh = shape(coll, s, elem, nranks);
        if !out.iter().any(|o| o.call_count == sh.call_count) {
            out.push(sh);
        }
    }
    out
}

/// Algorithm bandwidth in GB/s (1e9 bytes per second) of `bytes` in `time_us` microseconds.
pub fn algbw(bytes: u64, time_us: f64) -> f64 {
    if time_us > 0.0 {
        bytes as f64 / time_us / 1e3
    } else {
        0.0
    }
}

/// Bus bandwidth in GB/s: algbw times the collective's factor.
pub fn busbw(coll: Collective, nranks: u32, bytes: u64, time_us: f64) -> f64 {
    algbw(bytes, time_us) * coll.busbw_factor(nranks)
}

/// Median of the samples (mean of the two middle ones for an even count); NaN when empty.
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

/// Summary of the per-call times of one measurement, microseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeStats {
    /// Median per-call time (the `time(us)` column).
    pub median_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Fastest sample.
    pub min_us: f64,
    /// Slowest sample.
    pub max_us: f64,
    /// Number of samples (calls, or graph replays).
    pub samples: usize,
}

impl TimeStats {
    /// Statistics of the samples.
    pub fn of(samples: &[f64]) -> TimeStats {
        let n = samples.len();
        let (mut lo, mut hi, mut sum) = (f64::INFINITY, f64::NEG_INFINITY, 0.0);
        for &s in samples {
            lo = lo.min(s);
            hi = hi.max(s);
            sum += s;
        }
        TimeStats {
            median_us: median(samples),
            mean_us: if n > 0 { sum / n as f64 } else { f64::NAN },
            min_us: if n > 0 { lo } else { f64::NAN },
            max_us: if n > 0 { hi } else { f64::NAN },
            samples: n,
        }
    }
}

/// Combines per-rank samples of the same calls: sample i is the slowest rank's time of call i
/// (a collective is done when its last rank is done).
pub fn slowest_rank(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let len = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..len)
        .map(|i| {
            per_rank
                .iter()
                .map(|v| v[i])
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_tests_sweep_8_to_128m_by_2() {
        let s = sizes(8, 128 << 20, 2, 1 << 20);
        assert_eq!(s.len(), 25);
        assert_eq!(s[0], 8);
        assert_eq!(s[1], 16);
        assert_eq!(*s.last().unwrap(), 128 << 20);
        assert!(s.windows(2).all(|w| w[1] == 2 * w[0]));
    }

    #[test]
    fn sweeps_that_miss_the_end_stop_below_it() {
        assert_eq!(sizes(3, 100, 4, 0), vec![3, 12, 48]);
        assert_eq!(sizes(4 << 10, 256 << 20, 2, 0).len(), 17);
        assert_eq!(
            sizes(1 << 20, 4 << 20, 1, 1 << 20),
            vec![1 << 20, 2 << 20, 3 << 20, 4 << 20]
        );
        assert_eq!(sizes(32 << 20, 32 << 20, 1, 1 << 20), vec![32 << 20]);
        // No overflow near the top of u64.
        assert_eq!(sizes(u64::MAX / 2 + 1, u64::MAX, 2, 0).len(), 1);
        assert_eq!(sizes(5, 5, 1, 0), vec![5]);
    }

    #[test]
    fn shapes_per_collective() {
        let ar = shape(Collective::AllReduce, 1 << 20, 2, 8);
        assert_eq!(
            (ar.bytes, ar.count, ar.call_count),
            (1 << 20, 1 << 19, 1 << 19)
        );
        assert_eq!((ar.send_bytes, ar.recv_bytes), (1 << 20, 1 << 20));
        let rs = shape(Collective::ReduceScatter, 1 << 20, 4, 8);
        assert_eq!(
            (rs.bytes, rs.count, rs.call_count),
            (1 << 20, 1 << 18, 1 << 15)
        );
        assert_eq!((rs.send_bytes, rs.recv_bytes), (1 << 20, 1 << 17));
        let ag = shape(Collective::AllGather, 1 << 20, 2, 8);
        assert_eq!((ag.send_bytes, ag.recv_bytes), (1 << 17, 1 << 20));
        // Rounded down to a multiple of the ranks, at least one element each.
        let a2a = shape(Collective::AlltoAll, 1 << 20, 2, 8);
        assert_eq!(
            (a2a.call_count, a2a.send_bytes, a2a.recv_bytes),
            (1 << 16, 1 << 20, 1 << 20)
        );
        let odd = shape(Collective::AllGather, 100, 2, 8);
        assert_eq!((odd.count, odd.bytes, odd.call_count), (48, 96, 6));
        let tiny = shape(Collective::ReduceScatter, 8, 4, 8);
        assert_eq!((tiny.count, tiny.bytes, tiny.call_count), (8, 32, 1));
        let sub = shape(Collective::AllReduce, 1, 4, 8);
        assert_eq!(sub.count, 1);
        // Sizes that collapse onto the same call appear once.
        let sw = shapes(Collective::AllGather, &sizes(8, 128, 2, 0), 4, 8);
        assert_eq!(
            sw.iter().map(|s| s.bytes).collect::<Vec<_>>(),
            vec![32, 64, 128]
        );
    }

    #[test]
    fn bandwidth_maths() {
        // 1 MiB in 10 us: 104.8576 GB/s.
        let a = algbw(1 << 20, 10.0);
        assert!((a - 104.8576).abs() < 1e-9);
        assert!((busbw(Collective::AllReduce, 8, 1 << 20, 10.0) - a * 1.75).abs() < 1e-9);
        assert!((busbw(Collective::AllGather, 8, 1 << 20, 10.0) - a * 0.875).abs() < 1e-9);
        assert!((busbw(Collective::ReduceScatter, 2, 1 << 20, 10.0) - a * 0.5).abs() < 1e-9);
        assert_eq!(busbw(Collective::AllReduce, 1, 1 << 20, 10.0), 0.0);
        assert_eq!(algbw(100, 0.0), 0.0);
    }

    #[test]
    fn medians_and_stats() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
        let s = TimeStats::of(&[5.0, 1.0, 3.0]);
        assert_eq!(
            (s.median_us, s.mean_us, s.min_us, s.max_us, s.samples),
            (3.0, 3.0, 1.0, 5.0, 3)
        );
        assert!(TimeStats::of(&[]).median_us.is_nan());
        let slow = slowest_rank(&[vec![1.0, 5.0, 2.0], vec![2.0, 1.0, 2.5]]);
        assert_eq!(slow, vec![2.0, 5.0, 2.5]);
        assert!(slowest_rank(&[]).is_empty());
    }
}
