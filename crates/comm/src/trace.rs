//! The phase trace (`CommConfig::phase_trace`, flashcomm-perf `--phase-trace`): where the time of
//! a call goes on one rank. Thread 0 of each of the first [`abi::TRACE_BLOCKS`] blocks of every
//! kernel stamps the GPU's global timer into the rank's trace words
//! (`[TRACE_CALLS][TRACE_BLOCKS][TRACE_POINTS]`, `FcCollParams::trace`) where the block began,
//! where its peers' data was ready (the PULL protocols) and where it finished; this module folds
//! them into one record per call. Ranks on one GPU share the clock, so their records compare.

use crate::abi;

/// u64 words of one rank's trace.
pub const TRACE_WORDS: usize = (abi::TRACE_CALLS * abi::TRACE_BLOCKS * abi::TRACE_POINTS) as usize;

/// One call of one rank, from its traced blocks (global timer, ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallTrace {
    /// The call's sequence number (its epoch).
    pub seq: u64,
    /// When its first block began.
    pub begin: u64,
    /// When its last block had its peers' data ready; 0 for kernels that do not stamp it.
    pub ready: u64,
    /// When its last block finished.
    pub end: u64,
}

/// The calls held in `words` (one rank's trace), by sequence number. Block 0 of a slot holds the
/// slot's newest call (every grid has a block 0); blocks a smaller grid left from an earlier call
/// do not count, nor a ready stamp an earlier call left, nor a call that has not finished in every
/// one of its blocks (a slot a later call began to overwrite).
pub fn calls(words: &[u64]) -> Vec<CallTrace> {
    let points = abi::TRACE_POINTS as usize;
    let blocks = abi::TRACE_BLOCKS as usize;
    let mut out: Vec<CallTrace> = Vec::new();
    for slot in words.chunks_exact(blocks * points) {
        let tag = slot[0];
        if tag == 0 {
            continue;
        }
        let mut c = CallTrace {
            seq: tag - 1,
            begin: u64::MAX,
            ready: 0,
            end: 0,
        };
        let mut whole = true;
        for b in slot.chunks_exact(points).filter(|b| b[0] == tag) {
            let (begin, ready, end) = (b[1], b[2], b[3]);
            whole &= end >= begin;
            c.begin = c.begin.min(begin);
            // A kernel without the ready point leaves an earlier call's value there.
            if (begin..=end).contains(&ready) {
                c.ready = c.ready.max(ready);
            }
            c.end = c.end.max(end);
        }
        if whole {
            out.push(c);
        }
    }
    out.sort_by_key(|c| c.seq);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(words: &mut [u64], seq: u64, block: usize, stamps: [u64; 3]) {
        let points = abi::TRACE_POINTS as usize;
        let slot = (seq % abi::TRACE_CALLS as u64) as usize;
        let at = (slot * abi::TRACE_BLOCKS as usize + block) * points;
        words[at] = seq + 1;
        words[at + 1..at + 4].copy_from_slice(&stamps);
    }

    /// A call is its earliest begin and latest ready and end over its blocks; calls come out by
    /// sequence number; blocks of an earlier call left in a slot by a smaller grid do not count,
    /// nor a ready stamp an earlier call left, nor a call whose slot a later call began to
    /// overwrite; an empty trace has no calls.
    #[test]
    fn blocks_fold_into_calls() {
        let mut w = vec![0u64; TRACE_WORDS];
        assert!(calls(&w).is_empty());
        put(&mut w, 5, 0, [100, 150, 200]);
        put(&mut w, 5, 1, [90, 160, 210]);
        put(&mut w, 6, 0, [300, 0, 350]);
        // Call 69 (slot 5, a kernel without the ready point) on block 0 only, after call 5.
        put(&mut w, 69, 0, [4000, 150, 4100]);
        // Call 70 (slot 6) with one block overwrote call 6's block 0; call 6 had only block 0.
        put(&mut w, 70, 0, [5000, 0, 5100]);
        // Slot 7: call 7 on two blocks, then call 71 began on block 0 and has not finished.
        put(&mut w, 7, 0, [400, 0, 450]);
        put(&mut w, 7, 1, [405, 0, 455]);
        put(&mut w, 71, 0, [6000, 0, 0]);
        put(&mut w, 8, 0, [500, 520, 560]);
        put(&mut w, 8, 1, [495, 530, 555]);
        let c = calls(&w);
        assert_eq!(
            c,
            vec![
                CallTrace {
                    seq: 8,
                    begin: 495,
                    ready: 530,
                    end: 560
                },
                CallTrace {
                    seq: 69,
                    begin: 4000,
                    ready: 0,
                    end: 4100
                },
                CallTrace {
                    seq: 70,
                    begin: 5000,
                    ready: 0,
                    end: 5100
                },
            ]
        );
    }
}
