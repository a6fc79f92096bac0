//! Statistics: calls and bytes per route and collective kind, per communicator and for the
//! process, and the "first time" bits behind the one INFO line per (collective, route) pair.
//!
//! Everything here is an atomic counter or bit set: counting a call never locks or allocates.
//!
//! Owns: [`Counters`], [`Snapshot`], [`Announced`], the process totals ([`add_total`],
//! [`totals`]).
//! May import: `types`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::types::{Collective, Route};

/// Counters of calls and bytes per route and kind.
#[derive(Debug)]
pub(crate) struct Counters {
    calls: [[AtomicU64; Collective::COUNT]; Route::COUNT],
    bytes: [[AtomicU64; Collective::COUNT]; Route::COUNT],
}

/// A copy of [`Counters`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    /// Calls, indexed `[route][kind]`.
    pub(crate) calls: [[u64; Collective::COUNT]; Route::COUNT],
    /// Bytes, indexed `[route][kind]`.
    pub(crate) bytes: [[u64; Collective::COUNT]; Route::COUNT],
}

impl Counters {
    /// All zero.
    pub(crate) const fn new() -> Self {
        #[allow(clippy::declare_interior_mutable_const)]
        const Z: AtomicU64 = AtomicU64::new(0);
        #[allow(clippy::declare_interior_mutable_const)]
        const ROW: [AtomicU64; Collective::COUNT] = [Z; Collective::COUNT];
        Counters {
            calls: [ROW; Route::COUNT],
            bytes: [ROW; Route::COUNT],
        }
    }

    /// Counts one call of `bytes` bytes.
    pub(crate) fn add(&self, route: Route, kind: Collective, bytes: u64) {
        self.calls[route as usize][kind as usize].fetch_add(1, Ordering::Relaxed);
        self.bytes[route as usize][kind as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for r in 0..Route::COUNT {
            for k in 0..Collective::COUNT {
                s.calls[r][k] = self.calls[r][k].load(Ordering::Relaxed);
                s.bytes[r][k] = self.bytes[r][k].load(Ordering::Relaxed);
            }
        }
        s
    }
}

impl Default for Counters {
    fn default() -> Self {
        Counters::new()
    }
}

static TOTALS: Counters = Counters::new();

/// Counts one call in the process totals.
pub(crate) fn add_total(route: Route, kind: Collective, bytes: u64) {
    TOTALS.add(route, kind, bytes);
}

/// Process totals over every communicator, including destroyed ones.
pub(crate) fn totals() -> Snapshot {
    TOTALS.snapshot()
}

/// Which (kind, route) pairs were already announced, one bit each.
#[derive(Debug, Default)]
pub(crate) struct Announced(AtomicU32);

// One bit per pair must fit, and one more: an AllReduce asked to be quantized that ran on the
// lossless kernels (`Announced::first_unquantized`).
const _: () = assert!(Collective::COUNT * Route::COUNT < 32);
const UNQUANTIZED_BIT: u32 = 1 << 31;

impl Announced {
    /// None announced yet.
    pub(crate) const fn new() -> Self {
        Announced(AtomicU32::new(0))
    }

    /// Whether this is the first time `route` is taken by `kind` (and marks it taken).
    pub(crate) fn first_time(&self, kind: Collective, route: Route) -> bool {
        let bit = 1u32 << (kind as usize * Route::COUNT + route as usize);
        self.0.fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    /// Whether this is the first AllReduce asked to be quantized that ran on the lossless
    /// kernels (`FLASHCOMM_QUANT_CHOICE=auto`; and marks it taken): announced apart from the
    /// lossless route's own first call, whose reason differs.
    pub(crate) fn first_unquantized(&self) -> bool {
        self.0.fetch_or(UNQUANTIZED_BIT, Ordering::Relaxed) & UNQUANTIZED_BIT == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pair_is_announced_once() {
        let a = Announced::new();
        assert!(a.first_time(Collective::AllReduce, Route::Nccl));
        assert!(!a.first_time(Collective::AllReduce, Route::Nccl));
        assert!(a.first_time(Collective::AllReduce, Route::Lossless));
        assert!(a.first_time(Collective::Recv, Route::Quantized));
        assert!(!a.first_time(Collective::Recv, Route::Quantized));
        // A call asked to be quantized that ran lossless is announced once, apart.
        assert!(a.first_unquantized());
        assert!(!a.first_unquantized());
        assert!(a.first_time(Collective::AllGather, Route::Lossless));
    }

    #[test]
    fn counters_count_per_route_and_kind() {
        let c = Counters::new();
        c.add(Route::Lossless, Collective::AllGather, 10);
        c.add(Route::Lossless, Collective::AllGather, 6);
        let s = c.snapshot();
        assert_eq!(s.calls[1][2], 2);
        assert_eq!(s.bytes[1][2], 16);
        assert_eq!(s.calls[0][0], 0);
    }
}
