//! Routing: where each collective goes, and everything the router needs to know.
//!
//! This is the one seam between the NCCL exports and flashcomm's own kernels. Today [`decide`]
//! always answers [`Route::Nccl`]; a later change teaches it to send eligible calls to the
//! kernels, and fills in the communicator hooks, without touching the exports:
//!
//! * [`run`] is called by every collective export after its arguments passed the checks (and
//!   `count > 0`): it decides, counts the call in the statistics, and runs it.
//! * [`on_comm_created`] runs after a communicator was created (InitRank, InitRankConfig,
//!   InitAll, InitRankScalable, Split, Shrink, Grow), [`on_comm_destroying`] before one is
//!   finalized, revoked, destroyed or aborted. The communicator registry ([`comm`]) is the side
//!   table keyed by the real `ncclComm_t`, which is returned to callers unchanged.
//! * [`group_started`] / [`group_ending`] track the per-thread `ncclGroupStart`/`End` depth.
//!
//! Decisions must be identical on every rank of a communicator, so they may depend only on the
//! call's arguments, the configuration and state agreed at communicator setup, never on
//! anything rank-local observed per call.
//!
//! No lock of this module is held while the real library runs.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, RwLock};

use flashcomm_config::Config;
use flashcomm_nccl_sys::{
    cudaStream_t, ncclCollConfig_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
};

use crate::logging::{self, Subsys};

/// Where a collective runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum Route {
    /// Forwarded to the real NCCL.
    Nccl = 0,
    /// flashcomm's lossless kernels.
    Lossless = 1,
    /// flashcomm's quantized kernels.
    Quantized = 2,
}

impl Route {
    /// Every route, in index order (the index of `flashcommStats_t`).
    pub const ALL: [Route; 3] = [Route::Nccl, Route::Lossless, Route::Quantized];
    /// Number of routes.
    pub const COUNT: usize = Self::ALL.len();

    /// The route's name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Route::Nccl => "nccl",
            Route::Lossless => "lossless",
            Route::Quantized => "quantized",
        }
    }
}

/// The kind of a collective (`ncclBcast` counts as `Broadcast`, `ncclXConfig` as `X`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum Collective {
    /// `ncclAllReduce`.
    AllReduce = 0,
    /// `ncclReduceScatter`.
    ReduceScatter = 1,
    /// `ncclAllGather`.
    AllGather = 2,
    /// `ncclAlltoAll`.
    AlltoAll = 3,
    /// `ncclBroadcast`, `ncclBcast`.
    Broadcast = 4,
    /// `ncclReduce`.
    Reduce = 5,
    /// `ncclSend`.
    Send = 6,
    /// `ncclRecv`.
    Recv = 7,
}

impl Collective {
    /// Every kind, in index order (the index of `flashcommStats_t`).
    pub const ALL: [Collective; 8] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::AlltoAll,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Send,
        Collective::Recv,
    ];
    /// Number of kinds.
    pub const COUNT: usize = Self::ALL.len();

    /// Whether the operation takes a reduction operator.
    pub fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    /// The log subsystem of this kind.
    pub(crate) fn subsys(self) -> Subsys {
        match self {
            Collective::Send | Collective::Recv => Subsys::P2p,
            _ => Subsys::Coll,
        }
    }
}

/// One collective call, as the export received it (arguments already checked).
#[derive(Debug, Clone, Copy)]
pub struct CollCall {
    /// The export's name (`ncclAllReduce`, `ncclBcast`, `ncclAllGatherConfig`, ...).
    pub api: &'static str,
    /// Its kind.
    pub kind: Collective,
    /// The caller's send buffer (null for `ncclRecv`; `ncclBcast`'s one buffer for both).
    pub sendbuff: *const c_void,
    /// The caller's receive buffer (null for `ncclSend`).
    pub recvbuff: *mut c_void,
    /// The element count as passed (per rank: `sendcount`, `recvcount`, per-peer for all-to-all).
    pub count: usize,
    /// Element type, a valid `ncclDataType_t` (below `ncclNumTypes`).
    pub datatype: ncclDataType_t,
    /// Reduction operator (built-in, or a PreMulSum handle `>= ncclNumOps`), for reducing kinds.
    pub op: Option<ncclRedOp_t>,
    /// Root rank (broadcast, reduce) or peer (send, receive).
    pub root_or_peer: Option<i32>,
    /// The real communicator.
    pub comm: ncclComm_t,
    /// The caller's stream.
    pub stream: cudaStream_t,
    /// The per-call configuration of `ncclXConfig` (may be null), never copied.
    pub config: *const ncclCollConfig_t,
    /// `count` x the element size.
    pub bytes: u64,
}

/// Counters of calls and bytes per route and kind.
#[derive(Debug)]
pub struct Counters {
    calls: [[AtomicU64; Collective::COUNT]; Route::COUNT],
    bytes: [[AtomicU64; Collective::COUNT]; Route::COUNT],
}

/// A copy of [`Counters`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Calls, indexed `[route][kind]`.
    pub calls: [[u64; Collective::COUNT]; Route::COUNT],
    /// Bytes, indexed `[route][kind]`.
    pub bytes: [[u64; Collective::COUNT]; Route::COUNT],
}

impl Counters {
    /// All zero.
    pub const fn new() -> Self {
        #[allow(clippy::declare_interior_mutable_const)]
        const Z: AtomicU64 = AtomicU64::new(0);
        #[allow(clippy::declare_interior_mutable_const)]
        const ROW: [AtomicU64; Collective::COUNT] = [Z; Collective::COUNT];
        Counters {
            calls: [ROW; Route::COUNT],
            bytes: [ROW; Route::COUNT],
        }
    }

    fn add(&self, route: Route, kind: Collective, bytes: u64) {
        self.calls[route as usize][kind as usize].fetch_add(1, Ordering::Relaxed);
        self.bytes[route as usize][kind as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> Snapshot {
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

/// Process totals over every communicator, including destroyed ones.
pub fn totals() -> Snapshot {
    TOTALS.snapshot()
}

/// A communicator handle as a plain address (the registry key; `ncclComm_t` itself is a raw
/// pointer, which is neither `Send` nor `Sync`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommHandle(pub usize);

impl CommHandle {
    /// The handle of `comm`.
    pub fn of(comm: ncclComm_t) -> Self {
        CommHandle(comm as usize)
    }
}

impl std::fmt::Debug for CommHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// How a communicator came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommOrigin {
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

/// How a communicator ends (or pauses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommEnd {
    /// `ncclCommFinalize`: the communicator stays until destroyed.
    Finalize,
    /// `ncclCommRevoke`: in-flight work stops; the communicator stays until destroyed.
    Revoke,
    /// `ncclCommDestroy`: it is gone after this.
    Destroy,
    /// `ncclCommAbort`: it is gone after this.
    Abort,
}

/// What flashcomm knows about one communicator.
#[derive(Debug)]
pub struct CommState {
    /// How it was created.
    pub origin: CommOrigin,
    /// Its calls and bytes.
    pub counters: Counters,
}

type Registry = RwLock<HashMap<CommHandle, Arc<CommState>>>;

static COMMS: LazyLock<Registry> = LazyLock::new(|| RwLock::new(HashMap::new()));

/// The registry entry of `comm`, if flashcomm saw it created and not yet destroyed.
pub fn comm(comm: ncclComm_t) -> Option<Arc<CommState>> {
    COMMS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&CommHandle::of(comm))
        .cloned()
}

/// Hook: a communicator was created by the real library. `ready` is false when a non-blocking
/// communicator is still initializing (`ncclInProgress`): it becomes usable only once
/// `ncclCommGetAsyncError` reports success, so setup that talks to peers must wait until then.
pub fn on_comm_created(comm: ncclComm_t, origin: CommOrigin, ready: bool) {
    if comm.is_null() {
        return;
    }
    let state = Arc::new(CommState {
        origin,
        counters: Counters::new(),
    });
    COMMS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(CommHandle::of(comm), state);
    logging::info(
        Subsys::Init,
        &format!(
            "communicator {comm:p} created ({origin:?}, ready: {ready}); routing: all to NCCL"
        ),
    );
}

/// Hook: a communicator is about to be finalized, revoked, destroyed or aborted (called before
/// the real library sees the call). After `Destroy` and `Abort` it leaves the registry.
pub fn on_comm_destroying(comm: ncclComm_t, end: CommEnd) {
    if comm.is_null() {
        return;
    }
    if matches!(end, CommEnd::Destroy | CommEnd::Abort) {
        COMMS
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&CommHandle::of(comm));
    }
    logging::info(Subsys::Init, &format!("communicator {comm:p}: {end:?}"));
}

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Hook: `ncclGroupStart` succeeded on this thread.
pub fn group_started() {
    GROUP_DEPTH.with(|d| d.set(d.get().saturating_add(1)));
}

/// Hook: `ncclGroupEnd` is about to be forwarded. Returns the depth after it (0: the outermost
/// group ends, which is where deferred work would be launched).
pub fn group_ending() -> u32 {
    GROUP_DEPTH.with(|d| {
        let v = d.get().saturating_sub(1);
        d.set(v);
        v
    })
}

/// The current `ncclGroupStart` depth of this thread.
pub fn group_depth() -> u32 {
    GROUP_DEPTH.with(Cell::get)
}

/// Where `call` goes. Today: always NCCL.
pub fn decide(call: &CollCall, config: &Config) -> Route {
    let _ = (call, config);
    Route::Nccl
}

/// Decides, counts and runs one checked collective (`count > 0`). `forward` calls the real
/// library with the caller's arguments unchanged.
pub fn run(
    call: &CollCall,
    config: &Config,
    forward: impl FnOnce() -> ncclResult_t,
) -> ncclResult_t {
    let route = decide(call, config);
    TOTALS.add(route, call.kind, call.bytes);
    if let Some(state) = comm(call.comm) {
        state.counters.add(route, call.kind, call.bytes);
    }
    if tracing::enabled!(target: "flashcomm::tuning", tracing::Level::TRACE) {
        tracing::trace!(
            target: "flashcomm::tuning",
            "{} count {} datatype {} bytes {} comm {:p} stream {:p} group depth {} -> {}",
            call.api, call.count, call.datatype.0, call.bytes, call.comm, call.stream,
            group_depth(), route.name()
        );
    }
    match route {
        Route::Nccl => forward(),
        Route::Lossless | Route::Quantized => crate::error::Error::internal(
            call.kind.subsys(),
            format!(
                "{}: route {} is not available in this build",
                call.api,
                route.name()
            ),
        )
        .report(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(comm: ncclComm_t) -> CollCall {
        CollCall {
            api: "ncclAllReduce",
            kind: Collective::AllReduce,
            sendbuff: std::ptr::null(),
            recvbuff: std::ptr::null_mut(),
            count: 4,
            datatype: ncclDataType_t::ncclFloat32,
            op: Some(ncclRedOp_t::ncclSum),
            root_or_peer: None,
            comm,
            stream: std::ptr::null_mut(),
            config: std::ptr::null(),
            bytes: 16,
        }
    }

    #[test]
    fn everything_goes_to_nccl_today() {
        let c = call(std::ptr::null_mut());
        assert_eq!(decide(&c, &Config::default()), Route::Nccl);
    }

    #[test]
    fn run_counts_per_comm_and_in_total() {
        let comm = 0x5000usize as ncclComm_t;
        on_comm_created(comm, CommOrigin::InitRank, true);
        let before = totals().calls[0][0];
        let r = run(&call(comm), &Config::default(), || {
            ncclResult_t::ncclSuccess
        });
        assert_eq!(r, ncclResult_t::ncclSuccess);
        let s = self::comm(comm).unwrap().counters.snapshot();
        assert_eq!(
            s.calls[Route::Nccl as usize][Collective::AllReduce as usize],
            1
        );
        assert_eq!(
            s.bytes[Route::Nccl as usize][Collective::AllReduce as usize],
            16
        );
        assert!(totals().calls[0][0] > before);
        on_comm_destroying(comm, CommEnd::Finalize);
        assert!(self::comm(comm).is_some());
        on_comm_destroying(comm, CommEnd::Destroy);
        assert!(self::comm(comm).is_none());
    }

    #[test]
    fn group_depth_is_per_thread() {
        group_started();
        group_started();
        assert_eq!(group_depth(), 2);
        std::thread::spawn(|| assert_eq!(group_depth(), 0))
            .join()
            .unwrap();
        assert_eq!(group_ending(), 1);
        assert_eq!(group_ending(), 0);
        assert_eq!(group_ending(), 0);
    }
}
