//! The call types: what one collective call is, where it can go, and how communicators begin and
//! end. Plain data shared by every layer above.
//!
//! Owns: [`Route`], [`Collective`], [`CollCall`], [`P2pCall`], [`Held`], [`CommHandle`], [`CommOrigin`], [`CommEnd`], [`ExchangeGate`].
//! May import: nothing of this crate (the bottom of the module graph). [`Collective`] is the
//! tree's one collective enum, re-exported from the configuration crate.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use flashcomm_comm::Request;
use flashcomm_nccl_sys::{ncclCollConfig_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};

/// Where a collective runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(usize)]
pub(crate) enum Route {
    /// Forwarded to the real NCCL.
    Nccl = 0,
    /// flashcomm's lossless kernels.
    Lossless = 1,
    /// flashcomm's quantized kernels.
    Quantized = 2,
}

impl Route {
    /// Every route, in index order (the first index of `flashcommStats_t`).
    pub(crate) const ALL: [Route; 3] = [Route::Nccl, Route::Lossless, Route::Quantized];
    /// Number of routes.
    pub(crate) const COUNT: usize = Self::ALL.len();

    /// The route's name in logs.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Nccl => "nccl",
            Route::Lossless => "lossless",
            Route::Quantized => "quantized",
        }
    }
}

/// The kind of a collective call: the tree's one collective enum.
pub(crate) use flashcomm_config::Collective;
/// flashcomm's element type: the tree's one element-type enum.
pub(crate) use flashcomm_config::DType as DataType;

/// One collective call, typed once where its arguments are checked (`args::check`): flashcomm's
/// [`Request`] (collective, count, flashcomm's element type and the element's size, stream),
/// which `serve` completes with the buffers' sizes and the quantization asked for and hands to
/// `Communicator::execute` as it is, beside what only NCCL's side reads (the export's name, the
/// buffers as passed, the NCCL datatype and operator, the communicator, the per-call
/// configuration, the root or peer) and the size in bytes. Everything after reads it; nothing
/// derives the type or the size again, and nothing converts it into another call value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CollCall {
    /// The export's name (`ncclAllReduce`, `ncclBcast`, `ncclAllGatherConfig`, ...).
    pub(crate) api: &'static str,
    /// The call as flashcomm's communicator runs it: `req.coll` its kind, `req.count` the
    /// element count as passed (per rank: `sendcount`, `recvcount`, per-peer for all-to-all),
    /// `req.dtype` flashcomm's element type (f32, f16, bf16; `None` for the other datatypes),
    /// `req.elem` the bytes of one element (0 for a call that is only forwarded), `req.stream`
    /// the caller's stream. Its buffers are empty until `serve` gives them their sizes.
    pub(crate) req: Request<'static>,
    /// The caller's send buffer (null for `ncclRecv`; `ncclBcast`'s one buffer for both).
    pub(crate) sendbuff: *const c_void,
    /// The caller's receive buffer (null for `ncclSend`).
    pub(crate) recvbuff: *mut c_void,
    /// Element type, a valid `ncclDataType_t` (below `ncclNumTypes`) unless the call is only
    /// forwarded.
    pub(crate) datatype: ncclDataType_t,
    /// Reduction operator (built-in, or a PreMulSum handle `>= ncclNumOps`), for reducing kinds.
    pub(crate) op: Option<ncclRedOp_t>,
    /// The real communicator.
    pub(crate) comm: ncclComm_t,
    /// The per-call configuration of `ncclXConfig` (may be null), never copied.
    pub(crate) config: *const ncclCollConfig_t,
    /// `count` x the element size (0 for a call that is only forwarded).
    pub(crate) bytes: u64,
    /// Root (broadcast, reduce) or peer (send, receive).
    pub(crate) root_or_peer: Option<i32>,
}

impl CollCall {
    /// The buffer this call needs that is NULL (`"sendbuff"` or `"recvbuff"`), if any: what
    /// flashcomm refuses before its kernels would touch it (NCCL itself does not look, unless
    /// `NCCL_CHECK_POINTERS=1`). A buffer used only on the root (broadcast's send buffer,
    /// reduce's receive buffer) is not required; neither kind runs on flashcomm's kernels.
    pub(crate) fn null_buffer(&self) -> Option<&'static str> {
        let (send, recv) = match self.req.coll {
            Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::AllGather
            | Collective::AlltoAll => (true, true),
            Collective::Broadcast => (false, true),
            Collective::Reduce | Collective::Send => (true, false),
            Collective::Recv => (false, true),
        };
        if self.req.count == 0 {
            None
        } else if send && self.sendbuff.is_null() {
            Some("sendbuff")
        } else if recv && self.recvbuff.is_null() {
            Some("recvbuff")
        } else {
            None
        }
    }
}

/// An `ncclSend` or `ncclRecv` held back inside a group (`FLASHCOMM_GROUPED_ALLTOALL`): the
/// checked call and its peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct P2pCall {
    pub(crate) call: CollCall,
    pub(crate) peer: i32,
}

/// What a group that holds its Send/Recv calls back holds, in call order: the calls, and the
/// nested `ncclGroupStart`/`ncclGroupEnd` made between them (given to the real library in the same
/// order, or dropped with the calls when the group runs as flashcomm's AllToAll). Stored by
/// value in the group's list (boxing each call would add an allocation per held call).
#[derive(Debug, Clone, Copy)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Held {
    P2p(P2pCall),
    GroupStart,
    GroupEnd,
}

/// A communicator handle as a plain address (the registry key; `ncclComm_t` itself is a raw
/// pointer, which is neither `Send` nor `Sync`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct CommHandle(pub(crate) usize);

impl CommHandle {
    /// The handle of `comm`.
    pub(crate) fn of(comm: ncclComm_t) -> Self {
        CommHandle(comm as usize)
    }

    /// The real library's handle.
    pub(crate) fn raw(self) -> ncclComm_t {
        self.0 as ncclComm_t
    }
}

impl std::fmt::Debug for CommHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// How a communicator came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommOrigin {
    /// `ncclCommInitRank`.
    InitRank,
    /// `ncclCommInitRankConfig`.
    InitRankConfig,
    /// `ncclCommInitAll` (one of its communicators).
    InitAll,
    /// `ncclCommInitRankScalable`.
    InitRankScalable,
    /// `ncclCommSplit` of this parent.
    Split {
        /// The parent communicator.
        parent: CommHandle,
    },
    /// `ncclCommShrink` of this parent.
    Shrink {
        /// The parent communicator.
        parent: CommHandle,
    },
    /// `ncclCommGrow` (parent null on a joining rank).
    Grow {
        /// The parent communicator, or null.
        parent: CommHandle,
    },
}

impl CommOrigin {
    /// The parent of a split, shrunk or grown communicator.
    pub(crate) fn parent(self) -> Option<CommHandle> {
        match self {
            CommOrigin::Split { parent }
            | CommOrigin::Shrink { parent }
            | CommOrigin::Grow { parent } => Some(parent),
            _ => None,
        }
    }
}

/// How a communicator ends (or pauses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommEnd {
    /// `ncclCommFinalize`: the communicator stays until destroyed.
    Finalize,
    /// `ncclCommRevoke`: in-flight work stops; the communicator stays until destroyed.
    Revoke,
    /// `ncclCommDestroy`: it is gone after this.
    Destroy,
    /// `ncclCommAbort`: it is gone after this.
    Abort,
}

/// Between a communicator's set-up exchange (which calls the real library on it from the
/// creating thread) and an `ncclCommAbort` of it from another thread (a watchdog): once the abort
/// has begun, the exchange makes no more calls on the communicator (the real abort frees it), and
/// the abort lets a call in progress end first, for a bounded time.
#[derive(Debug, Default)]
pub(crate) struct ExchangeGate {
    aborting: AtomicBool,
    in_call: AtomicBool,
}

impl ExchangeGate {
    /// Before the exchange calls the real library: `false` when the communicator is being
    /// aborted (then the call must not be made).
    pub(crate) fn enter(&self) -> bool {
        self.in_call.store(true, Ordering::SeqCst);
        if self.aborting.load(Ordering::SeqCst) {
            self.in_call.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// After such a call returned.
    pub(crate) fn leave(&self) {
        self.in_call.store(false, Ordering::SeqCst);
    }

    /// Whether an abort has begun.
    pub(crate) fn is_aborting(&self) -> bool {
        self.aborting.load(Ordering::SeqCst)
    }

    /// An abort begins: no new call is made from now on; waits at most `limit` for a call in
    /// progress to return. `false`: one had not (it may be one that only the real abort ends).
    pub(crate) fn abort(&self, limit: Duration) -> bool {
        self.aborting.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + limit;
        while self.in_call.load(Ordering::SeqCst) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abort_waits_for_the_call_in_progress_and_stops_the_next() {
        let g = std::sync::Arc::new(ExchangeGate::default());
        assert!(g.enter());
        let g2 = g.clone();
        let t = std::thread::spawn(move || g2.abort(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(g.is_aborting());
        g.leave();
        assert!(t.join().unwrap(), "the call in progress ended first");
        assert!(!g.enter(), "no call after the abort began");
        // A call that never returns (one only the real abort ends) bounds the wait.
        let g = ExchangeGate::default();
        assert!(g.enter());
        let t0 = Instant::now();
        assert!(!g.abort(Duration::from_millis(50)));
        assert!(t0.elapsed() < Duration::from_secs(2));
    }
}
