//! `--phase-trace`: where a flashcomm call's time goes, from every rank's phase trace
//! (`flashcomm_comm::trace`). Ranks on one GPU stamp one clock, so their stamps compare: how far
//! apart the ranks began a call, how long a rank waited for its peers' data, how long the rest of
//! its kernel took, and the gap between one kernel's end and the next one's begin on a rank (the
//! launch gap a graph or the stream leaves). Pure: the GPU part is in `run`.

use crate::sweep::median;

/// Words per call of a rank's list: sequence number, begin, ready (0: not stamped), end (ns).
pub const WORDS: usize = 4;

/// Medians over the calls every rank traced, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Phases {
    /// Calls every rank traced.
    pub calls: usize,
    /// From one call's first begin to the next call's (consecutive calls).
    pub period: f64,
    /// From a rank's begin to its end (the slowest rank's per call).
    pub kernel: f64,
    /// From the first rank's begin to the last rank's.
    pub skew: f64,
    /// From a rank's begin to its peers' data being ready (the slowest rank's); NaN where the
    /// kernels do not stamp it.
    pub wait: f64,
    /// From a rank's ready to its end (the slowest rank's); NaN as `wait`.
    pub after: f64,
    /// From a rank's end of one call to its begin of the next (every rank, consecutive calls).
    pub gap: f64,
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} calls; period {:.2} us, kernel {:.2}, begin skew {:.2}, wait for peers {:.2}, \
             after {:.2}, gap between kernels {:.2} (medians)",
            self.calls, self.period, self.kernel, self.skew, self.wait, self.after, self.gap
        )
    }
}

/// One call of one rank: (seq, begin, ready, end).
type Call = (u64, u64, u64, u64);

fn calls_of(words: &[u64]) -> Vec<Call> {
    words
        .chunks_exact(WORDS)
        .map(|c| (c[0], c[1], c[2], c[3]))
        .collect()
}

/// The phases of the calls in `all` (every rank's list of [`WORDS`] words per call, by sequence
/// number); `None` when no call was traced by every rank.
pub fn summarize(all: &[Vec<u64>]) -> Option<Phases> {
    let ranks: Vec<Vec<Call>> = all.iter().map(|w| calls_of(w)).collect();
    let first = ranks.first()?;
    // The sequence numbers every rank traced.
    let common: Vec<u64> = first
        .iter()
        .map(|c| c.0)
        .filter(|s| ranks.iter().all(|r| r.iter().any(|c| c.0 == *s)))
        .collect();
    if common.is_empty() {
        return None;
    }
    let us = |ns: u64| ns as f64 / 1e3;
    let of = |r: &[Call], s: u64| r.iter().find(|c| c.0 == s).copied();
    let (mut kernel, mut skew, mut wait, mut after, mut gap, mut period) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut first_begin = Vec::new();
    for &s in &common {
        let cs: Vec<Call> = ranks.iter().filter_map(|r| of(r, s)).collect();
        let b0 = cs.iter().map(|c| c.1).min().unwrap_or(0);
        let b1 = cs.iter().map(|c| c.1).max().unwrap_or(0);
        first_begin.push((s, b0));
        skew.push(us(b1 - b0));
        kernel.push(
            cs.iter()
                .map(|c| us(c.3.saturating_sub(c.1)))
                .fold(0.0, f64::max),
        );
        if cs.iter().all(|c| c.2 != 0) {
            wait.push(cs.iter().map(|c| us(c.2 - c.1)).fold(0.0, f64::max));
            after.push(
                cs.iter()
                    .map(|c| us(c.3.saturating_sub(c.2)))
                    .fold(0.0, f64::max),
            );
        }
    }
    for w in first_begin.windows(2) {
        if w[1].0 == w[0].0 + 1 {
            period.push(us(w[1].1.saturating_sub(w[0].1)));
        }
    }
    for r in &ranks {
        for w in r.windows(2) {
            if w[1].0 == w[0].0 + 1 && w[1].1 >= w[0].3 {
                gap.push(us(w[1].1 - w[0].3));
            }
        }
    }
    Some(Phases {
        calls: common.len(),
        period: median(&period),
        kernel: median(&kernel),
        skew: median(&skew),
        wait: median(&wait),
        after: median(&after),
        gap: median(&gap),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks, three consecutive calls each, rank 1 starting 500 ns after rank 0: the skew,
    /// the slowest rank's kernel, wait and after, the period of the first begins and the gaps of
    /// both ranks; a call only one rank traced is left out; no common call gives `None`.
    #[test]
    fn ranks_calls_fold_into_medians() {
        // Rank 0: begin 0, ready 1000, end 3000; next call 4000 later.
        let r0: Vec<u64> = (0..3u64)
            .flat_map(|k| [10 + k, 4000 * k, 4000 * k + 1000, 4000 * k + 3000])
            .chain([99, 50_000, 50_100, 50_200])
            .collect();
        // Rank 1: begins 500 later, waits 700, ends 3600 after its begin.
        let r1: Vec<u64> = (0..3u64)
            .flat_map(|k| [10 + k, 4000 * k + 500, 4000 * k + 1200, 4000 * k + 4100])
            .collect();
        let p = summarize(&[r0.clone(), r1]).unwrap();
        assert_eq!(p.calls, 3);
        assert!((p.skew - 0.5).abs() < 1e-9, "{p:?}");
        assert!((p.kernel - 3.6).abs() < 1e-9, "{p:?}");
        assert!((p.wait - 1.0).abs() < 1e-9, "{p:?}");
        assert!((p.after - 2.9).abs() < 1e-9, "{p:?}");
        assert!((p.period - 4.0).abs() < 1e-9, "{p:?}");
        // Gaps: rank 0 1.0 us twice, rank 1 0.4 us twice: median 0.7.
        assert!((p.gap - 0.7).abs() < 1e-9, "{p:?}");
        assert!(p.to_string().starts_with("3 calls; period 4.00 us"));
        // Kernels without the ready stamp: no wait, no after.
        let no_ready: Vec<u64> = vec![1, 0, 0, 900, 2, 1000, 0, 1900];
        let q = summarize(&[no_ready.clone(), no_ready]).unwrap();
        assert!(q.wait.is_nan() && q.after.is_nan() && (q.gap - 0.1).abs() < 1e-9);
        assert_eq!(summarize(&[r0, vec![5, 0, 0, 1]]), None);
    }
}
