//! Routing: where each collective goes, and everything the router needs to know.
//!
//! This is the one seam between the NCCL exports and flashcomm's own kernels:
//!
//! * [`run`] is called by every collective export after its arguments passed the checks (and
//!   `count > 0`): it decides ([`decide`]), runs the call on flashcomm's kernels or forwards it,
//!   and counts it in the statistics under the route it actually took.
//! * [`on_comms_created`] runs after communicators were created (InitRank, InitRankConfig,
//!   InitAll, InitRankScalable, Split, Shrink, Grow): it registers each one and, for blocking
//!   communicators, builds flashcomm's own communicator on it collectively (`crate::serve`).
//!   [`on_comm_destroying`] runs before one is finalized, revoked, destroyed or aborted. The
//!   communicator registry ([`comm`]) is the side table keyed by the real `ncclComm_t`, which is
//!   returned to callers unchanged.
//! * [`group_started`] / [`group_ending`] / [`group_ended`] track the per-thread
//!   `ncclGroupStart`/`End` depth; communicators created inside a group are set up when the
//!   outermost group ends.
//!
//! Decisions must be identical on every rank of a communicator, so they depend only on the
//! call's arguments, the configuration and state agreed at communicator set-up (whether
//! flashcomm serves it, its quantization settings), never on anything rank-local observed per
//! call. The rules are in `docs/architecture.md` ("Routing rules").
//!
//! No lock of this module is held while the real library runs, and nothing on the per-call path
//! allocates device memory or synchronizes, so routed calls may be captured into CUDA graphs.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock, RwLock};

use flashcomm_comm::{Communicator, DataType, QuantSpec};
use flashcomm_config::{Config, Dtype, Op, QuantSettings};
use flashcomm_nccl_sys::{
    cudaStream_t, ncclCollConfig_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
};

use crate::ffi::nccl::Identity;
use crate::logging::{self, Subsys};
use crate::serve::{self, Executed};

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

impl CommOrigin {
    /// The parent of a split, shrunk or grown communicator.
    fn parent(self) -> Option<CommHandle> {
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

/// Whether flashcomm's kernels serve a communicator, decided once, collectively, at set-up.
pub enum Setup {
    /// flashcomm's communicator, built on every rank.
    Served(Box<Communicator>),
    /// The communicator stays with NCCL, for this reason (the same on every rank).
    NotServed(String),
}

/// What flashcomm knows about one communicator.
pub struct CommState {
    /// How it was created.
    pub origin: CommOrigin,
    /// Its calls and bytes.
    pub counters: Counters,
    /// Whether its calls block (`ncclConfig_t::blocking`); non-blocking ones stay with NCCL.
    pub blocking: bool,
    identity: OnceLock<Identity>,
    setup: OnceLock<Setup>,
    /// Finalized or revoked: every later call goes to NCCL (which reports the misuse).
    closed: AtomicBool,
    /// Revoked: flashcomm's kernels were asked to stop.
    revoked: AtomicBool,
    /// `flashcommCommSetQuant`'s settings; `None`: the environment's.
    quant: RwLock<Option<QuantSettings>>,
    /// (kind, route) pairs already logged, one bit each.
    announced: AtomicU32,
    /// Whether a device error was already logged by `ncclCommGetAsyncError`.
    async_warned: AtomicBool,
}

impl std::fmt::Debug for CommState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommState")
            .field("origin", &self.origin)
            .field("blocking", &self.blocking)
            .field("identity", &self.identity.get())
            .field("served", &self.served().is_some())
            .field("why_not", &self.why_not())
            .field("closed", &self.closed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl CommState {
    /// A communicator that is not set up yet.
    pub fn new(origin: CommOrigin, blocking: bool) -> CommState {
        CommState {
            origin,
            counters: Counters::new(),
            blocking,
            identity: OnceLock::new(),
            setup: OnceLock::new(),
            closed: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            quant: RwLock::new(None),
            announced: AtomicU32::new(0),
            async_warned: AtomicBool::new(false),
        }
    }

    /// flashcomm's communicator, when flashcomm serves this one.
    pub fn served(&self) -> Option<&Communicator> {
        match self.setup.get() {
            Some(Setup::Served(c)) => Some(c),
            _ => None,
        }
    }

    /// Why flashcomm does not serve this communicator (`None` when it does).
    pub fn why_not(&self) -> Option<String> {
        match self.setup.get() {
            Some(Setup::Served(_)) => None,
            Some(Setup::NotServed(why)) => Some(why.clone()),
            None => Some(
                "set-up pending (created inside ncclGroupStart/ncclGroupEnd; it is set up when \
                 the outermost group ends)"
                    .into(),
            ),
        }
    }

    /// Records the outcome of the set-up (once; later calls are ignored).
    pub(crate) fn set_setup(&self, setup: Setup) {
        let _ = self.setup.set(setup);
    }

    /// Whether the set-up has been decided.
    pub(crate) fn is_set_up(&self) -> bool {
        self.setup.get().is_some()
    }

    /// Rank, size and device, as the real library reported them at set-up.
    pub(crate) fn identity(&self) -> Option<Identity> {
        self.identity.get().copied()
    }

    /// Records rank, size and device.
    pub(crate) fn set_identity(&self, id: Identity) {
        let _ = self.identity.set(id);
    }

    /// Whether the communicator was finalized or revoked.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Whether the communicator was revoked.
    pub(crate) fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Relaxed)
    }

    /// The quantization settings in force: `flashcommCommSetQuant`'s, else the environment's.
    pub fn quant_settings(&self, config: &Config) -> QuantSettings {
        self.quant
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or_else(|| config.quant_settings())
    }

    /// Gives this communicator its own quantization settings (`None`: the environment's again).
    pub fn set_quant(&self, q: Option<QuantSettings>) {
        *self.quant.write().unwrap_or_else(|e| e.into_inner()) = q;
    }

    /// What [`decide`] needs to know about this communicator.
    pub fn view(&self, config: &Config) -> CommView {
        let served = self.served();
        CommView {
            served: served.is_some(),
            nranks: served.map_or(0, |c| u64::from(c.nranks())),
            closed: self.is_closed(),
            quant: self.quant_settings(config),
        }
    }

    /// Whether this is the first time `route` is taken by `kind` on this communicator.
    fn first_time(&self, kind: Collective, route: Route) -> bool {
        first_time(&self.announced, kind, route)
    }

    /// Whether this is the first device error reported by `ncclCommGetAsyncError`.
    pub(crate) fn first_async_error(&self) -> bool {
        !self.async_warned.swap(true, Ordering::Relaxed)
    }
}

fn first_time(bits: &AtomicU32, kind: Collective, route: Route) -> bool {
    let bit = 1u32 << (kind as usize * Route::COUNT + route as usize);
    bits.fetch_or(bit, Ordering::Relaxed) & bit == 0
}

type Registry = RwLock<HashMap<CommHandle, Arc<CommState>>>;

static COMMS: LazyLock<Registry> = LazyLock::new(|| RwLock::new(HashMap::new()));

/// The registry entry of `comm`, if flashcomm saw it created and not yet destroyed.
pub fn comm(comm: ncclComm_t) -> Option<Arc<CommState>> {
    by_handle(CommHandle::of(comm))
}

fn by_handle(h: CommHandle) -> Option<Arc<CommState>> {
    COMMS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&h)
        .cloned()
}

/// Whether a communicator without an explicit `blocking` setting blocks: NCCL's default, which
/// `NCCL_COMM_BLOCKING=0` turns off.
fn default_blocking() -> bool {
    std::env::var("NCCL_COMM_BLOCKING")
        .map(|v| v.trim() != "0")
        .unwrap_or(true)
}

/// Registers a new communicator and decides its blocking mode: `config_blocking` from its
/// `ncclConfig_t` (`None`: not set), else the parent's for a split, shrunk or grown one, else
/// NCCL's default.
fn register(comm: ncclComm_t, origin: CommOrigin, config_blocking: Option<bool>) -> Arc<CommState> {
    let blocking = config_blocking
        .or_else(|| origin.parent().and_then(by_handle).map(|p| p.blocking))
        .unwrap_or_else(default_blocking);
    let state = Arc::new(CommState::new(origin, blocking));
    COMMS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(CommHandle::of(comm), state.clone());
    state
}

/// Hook: one communicator was created by the real library (see [`on_comms_created`]).
pub fn on_comm_created(
    comm: ncclComm_t,
    origin: CommOrigin,
    ready: bool,
    config_blocking: Option<bool>,
) {
    on_comms_created(&[comm], origin, ready, config_blocking);
}

/// Hook: the real library created `comms` (one, or `ncclCommInitAll`'s list) and returned success
/// (`ready`) or `ncclInProgress` (a non-blocking communicator still initializing).
/// `config_blocking` is the `blocking` field of the caller's `ncclConfig_t`, if it set one.
///
/// Registers each communicator, then sets it up (`crate::serve`): collectively with the other
/// ranks, right now, or, inside `ncclGroupStart`/`End`, when the outermost group ends.
pub fn on_comms_created(
    comms: &[ncclComm_t],
    origin: CommOrigin,
    ready: bool,
    config_blocking: Option<bool>,
) {
    let new: Vec<(CommHandle, Arc<CommState>)> = comms
        .iter()
        .filter(|c| !c.is_null())
        .map(|&c| (CommHandle::of(c), register(c, origin, config_blocking)))
        .collect();
    if new.is_empty() {
        return;
    }
    for (h, _) in &new {
        logging::info(
            Subsys::Init,
            &format!("communicator {h:?} created ({origin:?}, ready: {ready})"),
        );
    }
    if group_depth() > 0 && ready {
        PENDING.with(|p| p.borrow_mut().extend(new.iter().map(|(h, _)| *h)));
        return;
    }
    serve::set_up(&new, origin == CommOrigin::InitAll, ready);
}

/// Hook: a communicator is about to be finalized, revoked, destroyed or aborted (called before
/// the real library sees the call). Revoke and Abort first stop flashcomm's kernels of this
/// communicator; after `Destroy` and `Abort` it leaves the registry and flashcomm's communicator
/// is released (after its last kernel finished) before the real call runs.
pub fn on_comm_destroying(comm: ncclComm_t, end: CommEnd) {
    if comm.is_null() {
        return;
    }
    logging::info(Subsys::Init, &format!("communicator {comm:p}: {end:?}"));
    let h = CommHandle::of(comm);
    match end {
        CommEnd::Finalize | CommEnd::Revoke => {
            let Some(state) = by_handle(h) else { return };
            state.closed.store(true, Ordering::Relaxed);
            if end == CommEnd::Revoke {
                state.revoked.store(true, Ordering::Relaxed);
                if let Some(c) = state.served() {
                    c.abort();
                }
            }
        }
        CommEnd::Destroy | CommEnd::Abort => {
            let removed = COMMS.write().unwrap_or_else(|e| e.into_inner()).remove(&h);
            if let Some(state) = removed {
                serve::tear_down(h, state, end == CommEnd::Abort);
            }
        }
    }
}

/// The device error of `comm`'s kernels, if flashcomm serves it and a kernel gave up, as
/// `ncclCommGetAsyncError` merges it: `(ncclRemoteError, message)`. Cheap (a registry lookup and
/// a read of host memory) and takes no lock the real library could wait on.
pub fn async_error(comm: ncclComm_t) -> Option<(ncclResult_t, String, bool)> {
    let state = self::comm(comm)?;
    if state.is_revoked() {
        return None;
    }
    let e = state.served()?.check_status().err()?;
    Some((
        ncclResult_t::ncclRemoteError,
        format!("flashcomm's kernels of communicator {comm:p} stopped: {e}"),
        state.first_async_error(),
    ))
}

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Communicators created inside the current group, set up when it ends.
    static PENDING: RefCell<Vec<CommHandle>> = const { RefCell::new(Vec::new()) };
}

/// Hook: `ncclGroupStart` succeeded on this thread.
pub fn group_started() {
    GROUP_DEPTH.with(|d| d.set(d.get().saturating_add(1)));
}

/// Hook: `ncclGroupEnd` is about to be forwarded. Returns the depth after it (0: the outermost
/// group ends, which is where deferred work is done).
pub fn group_ending() -> u32 {
    GROUP_DEPTH.with(|d| {
        let v = d.get().saturating_sub(1);
        d.set(v);
        v
    })
}

/// Hook: the real `ncclGroupEnd` returned `result`, leaving depth `depth`. When the outermost
/// group ended, the communicators created inside it are set up now (collectively: every rank
/// reaches this point after the same group); if the group failed or is still in progress, they
/// stay with NCCL.
pub fn group_ended(depth: u32, result: ncclResult_t) {
    if depth > 0 {
        return;
    }
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let states: Vec<(CommHandle, Arc<CommState>)> = pending
        .into_iter()
        .filter_map(|h| by_handle(h).map(|s| (h, s)))
        .filter(|(_, s)| !s.is_set_up())
        .collect();
    if states.is_empty() {
        return;
    }
    serve::set_up(&states, false, result == ncclResult_t::ncclSuccess);
}

/// The current `ncclGroupStart` depth of this thread.
pub fn group_depth() -> u32 {
    GROUP_DEPTH.with(Cell::get)
}

/// What [`decide`] knows about a communicator: state agreed at set-up (identical on every rank)
/// and its quantization settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommView {
    /// Whether flashcomm's kernels serve it.
    pub served: bool,
    /// Its ranks (0 when not served).
    pub nranks: u64,
    /// Finalized or revoked.
    pub closed: bool,
    /// Its quantization settings.
    pub quant: QuantSettings,
}

/// Why an AllReduce that goes to the lossless kernels is not quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotQuantized {
    /// A step's width is `off` or `16`.
    Off,
    /// Only AllReduce has quantized kernels.
    NoQuantizedKernels,
    /// `FLASHCOMM_QUANT_OPS` excludes it.
    OpsExclude,
    /// `FLASHCOMM_QUANT_DTYPES` excludes the element type.
    DtypeExcluded,
    /// Below the quantization window.
    BelowWindow,
    /// Above the quantization window.
    AboveWindow,
}

/// Why a call goes where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Bad configuration: every call goes to NCCL.
    PassthroughForced,
    /// `FLASHCOMM_DISABLE`.
    Disabled,
    /// flashcomm's kernels do not implement this kind of collective.
    NotOurs,
    /// The operator is not a sum.
    NotSum,
    /// A reducing collective of an element type other than f32, f16, bf16.
    NotFloat,
    /// The communicator was not created through flashcomm.
    UnknownComm,
    /// flashcomm does not serve the communicator (see its set-up reason).
    NotServed,
    /// Finalized or revoked.
    Closed,
    /// `FLASHCOMM_OPS` excludes the collective.
    OpsExclude,
    /// Inside `ncclGroupStart`/`End`.
    Grouped,
    /// A per-call `ncclCollConfig_t` was given.
    CollConfig,
    /// Below `FLASHCOMM_MIN_BYTES`.
    BelowMin,
    /// Above `FLASHCOMM_MAX_BYTES` (or too large to address).
    AboveMax,
    /// The quantization widths asked for have no kernels.
    QuantNoKernels,
    /// Quantized.
    Quantized,
    /// Lossless, and why not quantized.
    Lossless(NotQuantized),
}

/// Where a call goes, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The route.
    pub route: Route,
    /// The reason.
    pub why: Why,
    /// The codec settings of a quantized call.
    pub quant: Option<QuantSpec>,
}

impl Decision {
    fn nccl(why: Why) -> Decision {
        Decision {
            route: Route::Nccl,
            why,
            quant: None,
        }
    }
}

/// The element type of a reducing collective flashcomm's kernels take.
pub fn float_type(t: ncclDataType_t) -> Option<DataType> {
    match t {
        ncclDataType_t::ncclFloat32 => Some(DataType::F32),
        ncclDataType_t::ncclFloat16 => Some(DataType::F16),
        ncclDataType_t::ncclBfloat16 => Some(DataType::Bf16),
        _ => None,
    }
}

fn config_op(kind: Collective) -> Option<Op> {
    match kind {
        Collective::AllReduce => Some(Op::AllReduce),
        Collective::ReduceScatter => Some(Op::ReduceScatter),
        Collective::AllGather => Some(Op::AllGather),
        _ => None,
    }
}

fn config_dtype(t: DataType) -> Dtype {
    match t {
        DataType::F32 => Dtype::F32,
        DataType::F16 => Dtype::F16,
        DataType::Bf16 => Dtype::Bf16,
    }
}

/// Where `call` goes. A pure function of the call's arguments, the configuration, what was agreed
/// about the communicator at set-up (`comm`, `None` for a communicator flashcomm never saw) and
/// this thread's group depth, all identical on every rank of a correct program.
///
/// In order: pass-through configuration; the kind (AllReduce, ReduceScatter, AllGather); sum and
/// f32/f16/bf16 for the reducing ones; a communicator flashcomm serves and that is still open;
/// `FLASHCOMM_OPS`; not grouped; no per-call config; then an AllReduce is quantized when both
/// widths quantize, the type is in `FLASHCOMM_QUANT_DTYPES`, `allreduce` in `FLASHCOMM_QUANT_OPS`
/// and the size in the quantization window (widths without kernels go to NCCL); otherwise the size
/// must lie in `[FLASHCOMM_MIN_BYTES, FLASHCOMM_MAX_BYTES]` for the lossless kernels.
pub fn decide(
    call: &CollCall,
    config: &Config,
    comm: Option<&CommView>,
    group_depth: u32,
) -> Decision {
    let s = &config.settings;
    if config.passthrough_forced.is_some() {
        return Decision::nccl(Why::PassthroughForced);
    }
    if s.disable {
        return Decision::nccl(Why::Disabled);
    }
    let Some(op) = config_op(call.kind) else {
        return Decision::nccl(Why::NotOurs);
    };
    let dtype = float_type(call.datatype);
    if call.kind != Collective::AllGather {
        if call.op != Some(ncclRedOp_t::ncclSum) {
            return Decision::nccl(Why::NotSum);
        }
        if dtype.is_none() {
            return Decision::nccl(Why::NotFloat);
        }
    }
    let Some(view) = comm else {
        return Decision::nccl(Why::UnknownComm);
    };
    if !view.served {
        return Decision::nccl(Why::NotServed);
    }
    if view.closed {
        return Decision::nccl(Why::Closed);
    }
    if !s.ops.contains(&op) {
        return Decision::nccl(Why::OpsExclude);
    }
    if group_depth > 0 {
        return Decision::nccl(Why::Grouped);
    }
    if !call.config.is_null() {
        return Decision::nccl(Why::CollConfig);
    }
    if call.bytes.checked_mul(view.nranks.max(1)).is_none() {
        return Decision::nccl(Why::AboveMax);
    }
    let not_quantized = match (view.quant.widths(), dtype) {
        (None, _) => NotQuantized::Off,
        (Some(_), _) if !s.quant_ops.contains(&op) => NotQuantized::OpsExclude,
        (Some(_), _) if call.kind != Collective::AllReduce => NotQuantized::NoQuantizedKernels,
        (Some(_), Some(t)) if !s.quant_dtypes.contains(&config_dtype(t)) => {
            NotQuantized::DtypeExcluded
        }
        (Some(_), None) => NotQuantized::DtypeExcluded,
        (Some(_), _) if call.bytes < view.quant.min_bytes => NotQuantized::BelowWindow,
        (Some(_), _) if call.bytes > view.quant.max_bytes => NotQuantized::AboveWindow,
        (Some((rs, ag)), Some(_)) => {
            let q = &view.quant;
            let group = u16::try_from(q.group).unwrap_or(0);
            let spikes = u8::try_from(q.spikes).unwrap_or(u8::MAX);
            return match QuantSpec::new(rs, ag, group, spikes) {
                Ok(spec) => Decision {
                    route: Route::Quantized,
                    why: Why::Quantized,
                    quant: Some(spec),
                },
                Err(_) => Decision::nccl(Why::QuantNoKernels),
            };
        }
    };
    if call.bytes < s.min_bytes.0 {
        return Decision::nccl(Why::BelowMin);
    }
    if call.bytes > s.max_bytes.0 {
        return Decision::nccl(Why::AboveMax);
    }
    Decision {
        route: Route::Lossless,
        why: Why::Lossless(not_quantized),
        quant: None,
    }
}

fn dtype_name(t: ncclDataType_t) -> String {
    match t {
        ncclDataType_t::ncclFloat32 => "f32".into(),
        ncclDataType_t::ncclFloat16 => "f16".into(),
        ncclDataType_t::ncclBfloat16 => "bf16".into(),
        other => format!("datatype {}", other.0),
    }
}

/// Words for the log line of a decision.
pub fn explain(
    d: &Decision,
    call: &CollCall,
    config: &Config,
    state: Option<&CommState>,
) -> String {
    let s = &config.settings;
    let bytes = flashcomm_config::Bytes(call.bytes);
    let quant = state.map_or_else(|| config.quant_settings(), |st| st.quant_settings(config));
    match d.why {
        Why::PassthroughForced => {
            "the configuration is invalid, so every call goes to NCCL (see the ENV warning)".into()
        }
        Why::Disabled => "FLASHCOMM_DISABLE is set".into(),
        Why::NotOurs => {
            "flashcomm's kernels implement only AllReduce, ReduceScatter and AllGather".into()
        }
        Why::NotSum => format!(
            "reduction operator {} is not ncclSum",
            call.op.map_or(-1, |o| o.0 as i64)
        ),
        Why::NotFloat => format!(
            "{} is not reduced by flashcomm's kernels (f32, f16, bf16 are)",
            dtype_name(call.datatype)
        ),
        Why::UnknownComm => "the communicator was not created through flashcomm".into(),
        Why::NotServed => format!(
            "flashcomm does not serve this communicator: {}",
            state
                .and_then(CommState::why_not)
                .unwrap_or_else(|| "unknown".into())
        ),
        Why::Closed => "the communicator was finalized or revoked".into(),
        Why::OpsExclude => format!(
            "FLASHCOMM_OPS={} excludes it",
            s.ops
                .0
                .iter()
                .map(|o| o.as_str())
                .collect::<Vec<_>>()
                .join(",")
        ),
        Why::Grouped => "inside ncclGroupStart/ncclGroupEnd (grouped calls go to NCCL)".into(),
        Why::CollConfig => "a per-call ncclCollConfig_t was given".into(),
        Why::BelowMin => format!("{bytes} bytes is below FLASHCOMM_MIN_BYTES={}", s.min_bytes),
        Why::AboveMax => format!("{bytes} bytes is above FLASHCOMM_MAX_BYTES={}", s.max_bytes),
        Why::QuantNoKernels => format!("quantization {quant} has no kernels"),
        Why::Quantized => format!(
            "{} bytes of {} quantized with {quant}",
            bytes,
            dtype_name(call.datatype)
        ),
        Why::Lossless(nq) => {
            let why_not = match nq {
                NotQuantized::Off => "quantization is off".to_string(),
                NotQuantized::NoQuantizedKernels => {
                    "only AllReduce has quantized kernels".to_string()
                }
                NotQuantized::OpsExclude => "FLASHCOMM_QUANT_OPS excludes it".to_string(),
                NotQuantized::DtypeExcluded => format!(
                    "FLASHCOMM_QUANT_DTYPES excludes {}",
                    dtype_name(call.datatype)
                ),
                NotQuantized::BelowWindow | NotQuantized::AboveWindow => {
                    format!("outside the quantization window of {quant}")
                }
            };
            format!(
                "{bytes} bytes within [FLASHCOMM_MIN_BYTES={}, FLASHCOMM_MAX_BYTES={}]; not \
                 quantized: {why_not}",
                s.min_bytes, s.max_bytes
            )
        }
    }
}

/// (kind, route) pairs already logged for communicators flashcomm never saw.
static UNKNOWN_ANNOUNCED: AtomicU32 = AtomicU32::new(0);

/// Decides, runs and counts one checked collective (`count > 0`). `forward` calls the real
/// library with the caller's arguments unchanged. A call flashcomm's kernels refuse as
/// unsupported (a pure function of the arguments, so every rank refuses it) goes to NCCL instead.
pub fn run(
    call: &CollCall,
    config: &Config,
    forward: impl FnOnce() -> ncclResult_t,
) -> ncclResult_t {
    let state = comm(call.comm);
    let view = state.as_deref().map(|s| s.view(config));
    let depth = group_depth();
    let d = decide(call, config, view.as_ref(), depth);
    let (route, result, refused) = match (d.route, state.as_deref()) {
        (Route::Lossless | Route::Quantized, Some(st)) => match serve::execute(st, call, &d) {
            Executed::Done(r) => (d.route, r, None),
            Executed::Refused(why) => (Route::Nccl, forward(), Some(why)),
        },
        _ => (Route::Nccl, forward(), None),
    };
    TOTALS.add(route, call.kind, call.bytes);
    crate::engage::on_routed(call.kind, route, d.why);
    let first = match state.as_deref() {
        Some(st) => {
            st.counters.add(route, call.kind, call.bytes);
            st.first_time(call.kind, route)
        }
        None => first_time(&UNKNOWN_ANNOUNCED, call.kind, route),
    };
    if first {
        let mut why = explain(&d, call, config, state.as_deref());
        if let Some(r) = refused {
            why = format!(
                "flashcomm's {} kernels refused it ({r}; every rank refuses it alike)",
                d.route.name()
            );
        }
        // Under INIT (once per communicator, kind and route), so that NCCL_DEBUG=INFO shows it
        // with NCCL's default subsystems.
        logging::info(
            Subsys::Init,
            &format!(
                "{} on communicator {:p}: route {} (first time on this communicator): {why}",
                call.api,
                call.comm,
                route.name()
            ),
        );
    }
    if tracing::enabled!(target: "flashcomm::tuning", tracing::Level::TRACE) {
        tracing::trace!(
            target: "flashcomm::tuning",
            "{} count {} datatype {} bytes {} comm {:p} stream {:p} group depth {} -> {} ({:?})",
            call.api, call.count, call.datatype.0, call.bytes, call.comm, call.stream,
            depth, route.name(), d.why
        );
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashcomm_config::{GIB, KIB, MIB, QuantBits};

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

    /// A call of `kind` on `bytes` bytes of `dtype` (sum for the reducing kinds).
    fn coll(kind: Collective, dtype: ncclDataType_t, bytes: u64) -> CollCall {
        let elem = crate::args::element_size(dtype).unwrap();
        CollCall {
            api: "test",
            kind,
            datatype: dtype,
            op: kind.reduces().then_some(ncclRedOp_t::ncclSum),
            count: (bytes / elem) as usize,
            bytes,
            ..call(0x7000usize as ncclComm_t)
        }
    }

    fn cfg(vars: &[(&str, &str)]) -> Config {
        Config::from_vars(vars.iter().copied())
    }

    fn served(config: &Config) -> CommView {
        CommView {
            served: true,
            nranks: 4,
            closed: false,
            quant: config.quant_settings(),
        }
    }

    /// The decision for `c` on a served, open, ungrouped communicator with the settings of `vars`.
    fn route_of(vars: &[(&str, &str)], c: &CollCall) -> Decision {
        let config = cfg(vars);
        decide(c, &config, Some(&served(&config)), 0)
    }

    const BF16: ncclDataType_t = ncclDataType_t::ncclBfloat16;
    const F16: ncclDataType_t = ncclDataType_t::ncclFloat16;
    const F32: ncclDataType_t = ncclDataType_t::ncclFloat32;
    const AR: Collective = Collective::AllReduce;
    const RS: Collective = Collective::ReduceScatter;
    const AG: Collective = Collective::AllGather;

    fn lossless(nq: NotQuantized) -> Decision {
        Decision {
            route: Route::Lossless,
            why: Why::Lossless(nq),
            quant: None,
        }
    }

    fn quantized(rs: u8, ag: u8, group: u16, spikes: u8) -> Decision {
        Decision {
            route: Route::Quantized,
            why: Why::Quantized,
            quant: Some(QuantSpec::new(rs, ag, group, spikes).unwrap()),
        }
    }

    #[test]
    fn eligible_calls_take_the_lossless_kernels_by_default() {
        for kind in [AR, RS, AG] {
            for dt in [BF16, F16, F32] {
                assert_eq!(
                    route_of(&[], &coll(kind, dt, 4096)),
                    lossless(NotQuantized::Off),
                    "{kind:?} {dt:?}"
                );
            }
        }
    }

    #[test]
    fn other_kinds_operators_and_types_go_to_nccl() {
        use Collective::*;
        for kind in [AlltoAll, Broadcast, Reduce, Send, Recv] {
            let d = route_of(&[], &coll(kind, F32, 4096));
            assert_eq!(d, Decision::nccl(Why::NotOurs), "{kind:?}");
        }
        for op in [
            ncclRedOp_t::ncclProd,
            ncclRedOp_t::ncclMax,
            ncclRedOp_t::ncclMin,
            ncclRedOp_t::ncclAvg,
            ncclRedOp_t(8), // a PreMulSum handle
        ] {
            for kind in [AR, RS] {
                let c = CollCall {
                    op: Some(op),
                    ..coll(kind, BF16, 4096)
                };
                assert_eq!(route_of(&[], &c), Decision::nccl(Why::NotSum), "{op:?}");
            }
        }
        for dt in [
            ncclDataType_t::ncclInt8,
            ncclDataType_t::ncclUint8,
            ncclDataType_t::ncclInt32,
            ncclDataType_t::ncclUint32,
            ncclDataType_t::ncclInt64,
            ncclDataType_t::ncclUint64,
            ncclDataType_t::ncclFloat64,
            ncclDataType_t::ncclFloat8e4m3,
            ncclDataType_t::ncclFloat8e5m2,
        ] {
            for kind in [AR, RS] {
                let d = route_of(&[], &coll(kind, dt, 4096));
                assert_eq!(d, Decision::nccl(Why::NotFloat), "{kind:?} {dt:?}");
            }
            // AllGather moves bytes: any type.
            assert_eq!(
                route_of(&[], &coll(AG, dt, 4096)),
                lossless(NotQuantized::Off),
                "{dt:?}"
            );
        }
    }

    #[test]
    fn configuration_can_send_everything_to_nccl() {
        let c = coll(AR, BF16, 4096);
        assert_eq!(
            route_of(&[("FLASHCOMM_DISABLE", "1")], &c),
            Decision::nccl(Why::Disabled)
        );
        assert_eq!(
            route_of(&[("FLASHCOMM_PROTO", "fast")], &c),
            Decision::nccl(Why::PassthroughForced)
        );
        // Pass-through wins over quantization.
        assert_eq!(
            route_of(
                &[("FLASHCOMM_DISABLE", "1"), ("FLASHCOMM_QUANT_BITS", "4")],
                &c
            ),
            Decision::nccl(Why::Disabled)
        );
        let ops = [("FLASHCOMM_OPS", "allgather")];
        assert_eq!(route_of(&ops, &c), Decision::nccl(Why::OpsExclude));
        assert_eq!(
            route_of(&ops, &coll(RS, BF16, 4096)),
            Decision::nccl(Why::OpsExclude)
        );
        assert_eq!(
            route_of(&ops, &coll(AG, BF16, 4096)),
            lossless(NotQuantized::Off)
        );
        for kind in [AR, RS, AG] {
            assert_eq!(
                route_of(&[("FLASHCOMM_OPS", "none")], &coll(kind, BF16, 4096)),
                Decision::nccl(Why::OpsExclude)
            );
        }
        // FLASHCOMM_OPS also gates the quantized kernels.
        assert_eq!(
            route_of(
                &[
                    ("FLASHCOMM_OPS", "allgather"),
                    ("FLASHCOMM_QUANT_BITS", "4")
                ],
                &c
            ),
            Decision::nccl(Why::OpsExclude)
        );
    }

    #[test]
    fn the_communicator_must_be_served_open_and_the_call_plain() {
        let config = cfg(&[("FLASHCOMM_QUANT_BITS", "4")]);
        let c = coll(AR, BF16, 4096);
        let view = served(&config);
        assert_eq!(decide(&c, &config, Some(&view), 0).route, Route::Quantized);
        assert_eq!(
            decide(&c, &config, None, 0),
            Decision::nccl(Why::UnknownComm)
        );
        let not_served = CommView {
            served: false,
            ..view
        };
        assert_eq!(
            decide(&c, &config, Some(&not_served), 0),
            Decision::nccl(Why::NotServed)
        );
        let closed = CommView {
            closed: true,
            ..view
        };
        assert_eq!(
            decide(&c, &config, Some(&closed), 0),
            Decision::nccl(Why::Closed)
        );
        for depth in [1, 2] {
            assert_eq!(
                decide(&c, &config, Some(&view), depth),
                Decision::nccl(Why::Grouped)
            );
        }
        let with_config = CollCall {
            config: 0x40usize as *const ncclCollConfig_t,
            ..c
        };
        assert_eq!(
            decide(&with_config, &config, Some(&view), 0),
            Decision::nccl(Why::CollConfig)
        );
    }

    #[test]
    fn the_lossless_window_bounds_the_bytes_per_rank() {
        let vars = [("FLASHCOMM_MIN_BYTES", "1K"), ("FLASHCOMM_MAX_BYTES", "1M")];
        for kind in [AR, RS, AG] {
            let at = |b: u64| route_of(&vars, &coll(kind, F16, b));
            assert_eq!(at(KIB - 2), Decision::nccl(Why::BelowMin));
            assert_eq!(at(KIB), lossless(NotQuantized::Off));
            assert_eq!(at(MIB), lossless(NotQuantized::Off));
            assert_eq!(at(MIB + 2), Decision::nccl(Why::AboveMax));
        }
        // Sizes that cannot be addressed across the ranks go to NCCL.
        let huge = CollCall {
            bytes: u64::MAX / 2,
            count: usize::MAX / 2,
            ..coll(AG, ncclDataType_t::ncclUint8, 1)
        };
        assert_eq!(route_of(&[], &huge), Decision::nccl(Why::AboveMax));
    }

    #[test]
    fn quantization_takes_allreduce_of_the_quantized_types() {
        let q4 = [("FLASHCOMM_QUANT_BITS", "4")];
        assert_eq!(
            route_of(&q4, &coll(AR, BF16, 4096)),
            quantized(4, 4, 128, 2)
        );
        assert_eq!(route_of(&q4, &coll(AR, F16, 4096)), quantized(4, 4, 128, 2));
        // f32 is not in the default FLASHCOMM_QUANT_DTYPES: lossless.
        assert_eq!(
            route_of(&q4, &coll(AR, F32, 4096)),
            lossless(NotQuantized::DtypeExcluded)
        );
        // Asked for, f32 is decided quantized; the kernels then refuse it (at run time, on
        // every rank alike) and the call goes to NCCL.
        let f32_too = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_DTYPES", "bf16,f16,f32"),
        ];
        assert_eq!(
            route_of(&f32_too, &coll(AR, F32, 4096)).route,
            Route::Quantized
        );
        let bf16_only = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_DTYPES", "bf16"),
        ];
        assert_eq!(
            route_of(&bf16_only, &coll(AR, F16, 4096)),
            lossless(NotQuantized::DtypeExcluded)
        );
        // Only AllReduce has quantized kernels.
        assert_eq!(
            route_of(&q4, &coll(RS, BF16, 4096)),
            lossless(NotQuantized::OpsExclude)
        );
        let all_ops = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_OPS", "allreduce,reducescatter,allgather"),
        ];
        for kind in [RS, AG] {
            assert_eq!(
                route_of(&all_ops, &coll(kind, BF16, 4096)),
                lossless(NotQuantized::NoQuantizedKernels)
            );
        }
        let rs_only = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_OPS", "reducescatter"),
        ];
        assert_eq!(
            route_of(&rs_only, &coll(AR, BF16, 4096)),
            lossless(NotQuantized::OpsExclude)
        );
        // Group and spikes come from the configuration.
        let g = [
            ("FLASHCOMM_QUANT_BITS", "3"),
            ("FLASHCOMM_QUANT_GROUP", "32"),
            ("FLASHCOMM_QUANT_SPIKES", "4"),
        ];
        assert_eq!(route_of(&g, &coll(AR, BF16, 4096)), quantized(3, 3, 32, 4));
    }

    #[test]
    fn quantization_widths_per_step() {
        let at = |vars: &[(&str, &str)]| route_of(vars, &coll(AR, BF16, 1 << 20));
        for off in ["off", "16"] {
            assert_eq!(
                at(&[("FLASHCOMM_QUANT_BITS", off)]),
                lossless(NotQuantized::Off)
            );
            assert_eq!(
                at(&[
                    ("FLASHCOMM_QUANT_BITS", "4"),
                    ("FLASHCOMM_QUANT_AG_BITS", off)
                ]),
                lossless(NotQuantized::Off)
            );
        }
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ]),
            quantized(4, 8, 128, 2)
        );
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_RS_BITS", "2"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ]),
            quantized(2, 8, 128, 2)
        );
        // Widths without kernels go to NCCL (decided from the configuration alone).
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_QUANT_AG_BITS", "6")
            ]),
            Decision::nccl(Why::QuantNoKernels)
        );
        // 5/8 is a valid codec pair; the communicator refuses it at run time (no kernels).
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_BITS", "5"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ])
            .route,
            Route::Quantized
        );
    }

    #[test]
    fn the_quantization_window_is_separate_from_the_lossless_one() {
        let vars = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_MIN_BYTES", "64K"),
            ("FLASHCOMM_QUANT_MAX_BYTES", "16M"),
            ("FLASHCOMM_MAX_BYTES", "1M"),
        ];
        let at = |b: u64| route_of(&vars, &coll(AR, BF16, b));
        assert_eq!(at(64 * KIB - 2), lossless(NotQuantized::BelowWindow));
        assert_eq!(at(64 * KIB), quantized(4, 4, 128, 2));
        // Above the lossless window but inside the quantized one: quantized.
        assert_eq!(at(8 * MIB), quantized(4, 4, 128, 2));
        assert_eq!(at(16 * MIB), quantized(4, 4, 128, 2));
        // Above both.
        assert_eq!(at(16 * MIB + 2), Decision::nccl(Why::AboveMax));
        let vars = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_MAX_BYTES", "1M"),
        ];
        assert_eq!(
            route_of(&vars, &coll(AR, BF16, 4 * MIB)),
            lossless(NotQuantized::AboveWindow)
        );
    }

    #[test]
    fn a_communicators_own_quantization_overrides_the_environment() {
        let config = cfg(&[]);
        let c = coll(AR, BF16, 4096);
        let own = QuantSettings {
            rs_bits: QuantBits::Bits(2),
            ag_bits: QuantBits::Bits(8),
            group: 64,
            spikes: 0,
            min_bytes: 0,
            max_bytes: GIB,
        };
        let view = CommView {
            quant: own,
            ..served(&config)
        };
        assert_eq!(decide(&c, &config, Some(&view), 0), quantized(2, 8, 64, 0));
        let view = CommView {
            quant: QuantSettings {
                min_bytes: 8192,
                ..own
            },
            ..served(&config)
        };
        assert_eq!(
            decide(&c, &config, Some(&view), 0),
            lossless(NotQuantized::BelowWindow)
        );
        // And through the registry state.
        let st = CommState::new(CommOrigin::InitRank, true);
        assert_eq!(st.quant_settings(&config), config.quant_settings());
        st.set_quant(Some(own));
        assert_eq!(st.view(&config).quant, own);
        assert!(!st.view(&config).served, "not set up");
        st.set_quant(None);
        assert_eq!(st.quant_settings(&config), config.quant_settings());
    }

    #[test]
    fn decisions_explain_themselves() {
        let config = cfg(&[("FLASHCOMM_QUANT_BITS", "4"), ("FLASHCOMM_MIN_BYTES", "1K")]);
        let c = coll(AR, BF16, 4096);
        let d = decide(&c, &config, Some(&served(&config)), 0);
        let text = explain(&d, &c, &config, None);
        assert!(
            text.contains("4K bytes of bf16 quantized with rs 4 bits"),
            "{text}"
        );
        let d = decide(&c, &config, Some(&served(&config)), 1);
        assert!(explain(&d, &c, &config, None).contains("ncclGroupStart"));
        let small = coll(AG, F32, 4);
        let d = decide(&small, &config, Some(&served(&config)), 0);
        let text = explain(&d, &small, &config, None);
        assert!(
            text.contains("4 bytes is below FLASHCOMM_MIN_BYTES=1K"),
            "{text}"
        );
        let st = CommState::new(CommOrigin::InitRank, true);
        st.set_setup(Setup::NotServed("no GPU driver".into()));
        let d = decide(&c, &config, Some(&st.view(&config)), 0);
        assert_eq!(d, Decision::nccl(Why::NotServed));
        let text = explain(&d, &c, &config, Some(&st));
        assert!(text.ends_with("no GPU driver"), "{text}");
    }

    #[test]
    fn run_counts_per_comm_and_in_total() {
        let comm = 0x5000usize as ncclComm_t;
        // Not ready (a non-blocking communicator still initializing): registered, not served,
        // and nothing asks the real library.
        on_comm_created(comm, CommOrigin::InitRank, false, None);
        let state = self::comm(comm).unwrap();
        assert!(state.served().is_none());
        assert!(state.why_not().unwrap().contains("non-blocking"));
        let before = totals().calls[0][0];
        let r = run(&call(comm), &Config::default(), || {
            ncclResult_t::ncclSuccess
        });
        assert_eq!(r, ncclResult_t::ncclSuccess);
        let s = state.counters.snapshot();
        assert_eq!(
            s.calls[Route::Nccl as usize][Collective::AllReduce as usize],
            1
        );
        assert_eq!(
            s.bytes[Route::Nccl as usize][Collective::AllReduce as usize],
            16
        );
        assert!(totals().calls[0][0] > before);
        // Each (kind, route) pair is announced once.
        assert!(!state.first_time(Collective::AllReduce, Route::Nccl));
        assert!(state.first_time(Collective::AllGather, Route::Nccl));
        on_comm_destroying(comm, CommEnd::Finalize);
        assert!(self::comm(comm).unwrap().is_closed());
        on_comm_destroying(comm, CommEnd::Destroy);
        assert!(self::comm(comm).is_none());
    }

    #[test]
    fn blocking_mode_comes_from_the_config_or_the_parent() {
        let parent = 0x5100usize as ncclComm_t;
        on_comm_created(parent, CommOrigin::InitRankConfig, false, Some(false));
        assert!(!self::comm(parent).unwrap().blocking);
        let child = 0x5200usize as ncclComm_t;
        let origin = CommOrigin::Split {
            parent: CommHandle::of(parent),
        };
        on_comm_created(child, origin, false, None);
        assert!(!self::comm(child).unwrap().blocking, "inherited");
        let other = 0x5300usize as ncclComm_t;
        on_comm_created(other, origin, false, Some(true));
        assert!(self::comm(other).unwrap().blocking, "its own config wins");
        for c in [parent, child, other] {
            on_comm_destroying(c, CommEnd::Abort);
            assert!(self::comm(c).is_none());
        }
    }

    #[test]
    fn communicators_created_in_a_group_are_set_up_when_it_ends() {
        let comm = 0x5400usize as ncclComm_t;
        group_started();
        group_started();
        on_comm_created(comm, CommOrigin::InitRank, true, None);
        let state = self::comm(comm).unwrap();
        assert!(!state.is_set_up());
        assert!(state.why_not().unwrap().contains("pending"));
        group_ended(group_ending(), ncclResult_t::ncclSuccess);
        assert!(!state.is_set_up(), "only the outermost group end sets up");
        // The group failed: the communicator stays with NCCL (without asking the real library).
        group_ended(group_ending(), ncclResult_t::ncclInternalError);
        assert!(state.is_set_up());
        assert!(state.served().is_none());
        on_comm_destroying(comm, CommEnd::Destroy);
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
