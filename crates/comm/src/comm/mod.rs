//! The communicator: one rank's view of a group of GPUs that flashcomm's kernels serve.
//!
//! Set-up (collective: every rank calls [`Communicator::new`] at the same point):
//! 1. allocate this rank's arena (zeroed) and host-mapped abort/status words;
//! 2. exchange {process, host, device, arena address, IPC handle} with every rank;
//! 3. map every peer's arena: the same address within one process (enabling peer access across
//!    devices), a legacy IPC mapping across processes of one host; other hosts are refused;
//! 4. agree: if any rank failed, every rank returns [`Error::Unsupported`] (the shim then passes
//!    that communicator's calls through to the real NCCL);
//! 5. probe: every rank writes a word into every peer's arena; each rank checks that all arrived
//!    (peer access the driver reports is not always real), and all ranks agree again;
//! 6. agree on the largest grid every rank can keep resident, and (optionally) calibrate the cost
//!    model with a few timed collectives, agreeing on one model.
//!
//! Per call: plan (pure: same on every rank), order after this communicator's previous launch if
//! the stream changed, launch one kernel. Nothing allocates or synchronizes, so calls may be
//! captured into CUDA graphs; epochs live on the device.
//!
//! One file per responsibility: `setup` (set-up and the agreement between ranks), `calibrate`
//! (the timed collectives that give the cost model), `launch` (plans, buffer checks, the kernel
//! and its parameters: what a call enqueues, ready to go) and `order` (one call run in order:
//! the device's status, the prepared work ordered after the previous operation, launched and
//! recorded; ordering of forwarded operations, status, abort, idleness).
//! This file holds the communicator's state, its settings, its accessors and its release.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use flashcomm_kernels::Kernels;

use crate::abi::MAX_RANKS;
use crate::error::Error;
use crate::gpu::{CaptureRecord, Device, DeviceMem, Event, HostMapped, Stream};
use crate::plan::{
    Algorithm, Arena, Choice, CostModel, HostCopy, Protocol, QuantChoice, QuantModel, QuantSpec,
};
use crate::register::{RegistrationId, Registry};
use crate::release::{self, Releasable, Release};
use crate::transport::{self, LocalArena, PeerMapping, Transport};

mod calibrate;
mod copy;
mod launch;
mod order;
mod setup;

/// Settings of one communicator (the same on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct CommConfig {
    /// Bound on every device-side wait; zero (the default): no time limit, as in NCCL (a wait
    /// lasts until the peer arrives or [`Communicator::abort`] is called).
    pub timeout: Duration,
    /// Cap on the arena each rank allocates (its push protocols' part).
    pub arena_bytes: u64,
    /// Bytes of the pull area each rank allocates beside it (two staging halves; the PULL
    /// protocols take calls whose staged bytes fit in half of it; 0: no PULL protocols).
    pub pull_bytes: u64,
    /// AllReduce algorithm override.
    pub algo: Choice<Algorithm>,
    /// Protocol override.
    pub proto: Choice<Protocol>,
    /// Cap on blocks per launch (default: what keeps every rank of this GPU resident).
    pub max_blocks: Option<u32>,
    /// Measure the cost model at set-up (otherwise use defaults).
    pub calibrate: bool,
    /// Calibration also times ReduceScatter, AllGather and AllToAll with each protocol, so the
    /// planner chooses their protocol from their own times rather than the AllReduce's
    /// (`FLASHCOMM_CALIBRATE_MOVES`).
    pub calibrate_moves: bool,
    /// Codec settings whose quantized AllReduce calibration also times (the settings the
    /// communicator's calls will ask for; the same list on every rank).
    pub quant_calibrate: Vec<QuantSpec>,
    /// Whether a quantized AllReduce runs only where it pays (`FLASHCOMM_QUANT_CHOICE`).
    pub quant_choice: QuantChoice,
    /// Where arenas live: automatic (the peer transport where every pair of ranks has peer
    /// access, the host transport otherwise), or forced.
    pub transport: Choice<Transport>,
    /// Whether the lossless AllReduce on the host transport takes the copy-engine schedule
    /// (`FLASHCOMM_HOST_COPY`, [`crate::plan::copy`]); off by default.
    pub host_copy: HostCopy,
    /// Graph mixing (`FLASHCOMM_GRAPH_MIXING`): the first captured collective of each capture
    /// waits at each replay for the last eager operation, and each replay records an event (one
    /// node beside the captured chain, after every captured collective) that later eager
    /// operations wait for.
    pub graph_mixing: bool,
    /// Early launch (`FLASHCOMM_EARLY_LAUNCH`): each kernel lets the next kernel of its stream
    /// launch as soon as it starts, where twice the grid fits the resident share
    /// ([`abi::FLAG_EARLY_LAUNCH`](crate::abi::FLAG_EARLY_LAUNCH)).
    pub early_launch: bool,
    /// Zero-copy between processes (`FLASHCOMM_ZERO_COPY`): on the peer transport, the direct
    /// PULL protocol also serves ranks of different processes of one machine, reading registered
    /// buffers in place ([`Communicator::register`]); a rank whose buffer a peer has not mapped
    /// stages it. On by default.
    pub zero_copy: bool,
    /// Diagnostics (flashcomm-perf `--phase-trace`): every kernel of the communicator stamps the
    /// GPU's global timer where its blocks begin, find their peers' data ready (the PULL
    /// protocols) and finish, into device memory of the rank ([`Communicator::phase_trace`]).
    /// Off by default; rank-local (it changes no plan and no result).
    pub phase_trace: bool,
    /// Tests only: this rank fails set-up step `n` (0..=7, see [`Communicator::new_agreed`]), as
    /// an allocation, a driver call or a kernel launch failing there would.
    #[doc(hidden)]
    pub fail_at: Option<u32>,
    /// Tests only: this rank panics where set-up step `n` would run (0..=7), or, for `n = 8`,
    /// before the transport is chosen (the first thing set-up does): a bug in a local step.
    #[doc(hidden)]
    pub panic_at: Option<u32>,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: Duration::ZERO,
            arena_bytes: 64 << 20,
            pull_bytes: DEFAULT_PULL_BYTES,
            algo: Choice::Auto,
            proto: Choice::Auto,
            max_blocks: None,
            calibrate: true,
            calibrate_moves: false,
            quant_calibrate: Vec::new(),
            quant_choice: QuantChoice::Auto,
            transport: Choice::Auto,
            host_copy: HostCopy::Off,
            graph_mixing: true,
            early_launch: true,
            zero_copy: true,
            phase_trace: false,
            fail_at: None,
            panic_at: None,
        }
    }
}

/// The pull area's default size: two staging halves of 16 MiB, so the PULL protocols take
/// AllReduce calls up to 16 MiB.
pub const DEFAULT_PULL_BYTES: u64 = 32 << 20;

const HOST_ABORT: usize = 0;
const HOST_STATUS: usize = 64;
const HOST_BYTES: usize = 128;

/// The communicator's last eager launch: an event recorded after it, and the stream it went to.
/// Written only by the launching thread (NCCL allows one thread at a time per communicator), so
/// atomics suffice: no lock on the call path.
struct LastLaunch {
    /// The device the launches go to (its context answers queries of `event`).
    device: Arc<Device>,
    /// The stream of the last eager launch (its raw handle as an integer).
    stream: AtomicUsize,
    /// Whether any eager launch happened (`stream` is meaningful).
    launched: AtomicBool,
    /// Graph mixing: whether an operation of this communicator was captured into a graph (whose
    /// replays record `event`), so that every eager operation waits for `event`, whatever its
    /// stream.
    captured: AtomicBool,
    event: Event,
    /// Operations enqueued so far, eager ones (the release gate's sign of progress).
    launches: std::sync::atomic::AtomicU64,
    /// Several of its ranks are threads of this process.
    threads_here: bool,
    /// Graph mixing: the event-record node of the capture in progress (the last one this
    /// communicator was captured into), beside its chain, which every captured operation of
    /// that capture joins. Touched only while capturing, never on an eager call.
    capture: std::sync::Mutex<CaptureMark>,
}

impl release::Activity for LastLaunch {
    fn idle(&self) -> Result<bool, String> {
        if !self.launched.load(Ordering::Acquire) {
            return Ok(true);
        }
        let _ctx = self.device.activate().map_err(|e| e.to_string())?;
        self.event.is_done().map_err(|e| e.to_string())
    }

    fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    fn threads_here(&self) -> bool {
        self.threads_here
    }
}

/// Graph mixing's state of the capture in progress.
#[derive(Default)]
struct CaptureMark {
    /// The record node of the last capture this communicator was captured into.
    record: Option<CaptureRecord>,
    /// The capture's dependencies when the operation being enqueued began (`order_before`):
    /// what a kernel launched next depends on.
    before: Vec<usize>,
}

/// A forwarded operation that [`Communicator::before_foreign`] ordered: whether its stream was
/// capturing, for [`Communicator::after_foreign`].
#[derive(Clone, Copy, Debug)]
pub struct Foreign {
    capturing: bool,
}

/// One rank of a flashcomm communicator.
pub struct Communicator {
    rank: u32,
    nranks: u32,
    device: Arc<Device>,
    arena: Arena,
    local: LocalArena,
    /// Host transport: this rank's own slots (regions A and B) in device memory, which only
    /// this rank's quantized kernels write and read (`FcCollParams::own_slots`).
    own_slots: Option<DeviceMem>,
    /// The phase trace's words (`cfg.phase_trace`, `FcCollParams::trace`).
    trace: Option<DeviceMem>,
    peers: [u64; MAX_RANKS],
    mappings: Vec<PeerMapping>,
    /// Registered buffers and the boards of peers of other processes (zero-copy).
    registry: Registry,
    /// The abort flag and the status record (shared with the copy-engine path's watchdog).
    host: Arc<HostMapped>,
    kernels: Arc<Kernels>,
    /// The copy-engine path's resources (`FLASHCOMM_HOST_COPY` not `off`, host transport).
    copy: Option<copy::CopyPath>,
    max_grid: u32,
    /// This communicator's level of its device's ledger (crate::residency), given back once its
    /// last kernel has finished.
    share: Option<crate::residency::Share>,
    model: CostModel,
    /// The measured quantized AllReduce per codec setting of `cfg.quant_calibrate` (agreed by
    /// every rank; empty without calibration).
    quant_models: Vec<QuantModel>,
    cfg: CommConfig,
    /// Shared with the release registry ([`release::LIVE`]), which asks it before any free.
    last: Arc<LastLaunch>,
    /// The scratch of a scattered AllToAll ([`Communicator::execute`]): the last is in use;
    /// earlier, smaller ones are kept until the communicator is dropped (freeing device memory
    /// synchronizes the device, which would wait for the kernels of ranks that share it and wait
    /// for this one).
    scratch: std::sync::Mutex<Vec<DeviceMem>>,
    /// Set by [`Communicator::defer_release`]: dropping hands the memory to a thread of its own
    /// instead of freeing it here.
    deferred: std::sync::Mutex<Option<Deferred>>,
    /// [`Communicator::zero_copy_calls`].
    zero_copy_calls: std::sync::atomic::AtomicU64,
}

/// How a communicator's drop releases its memory after [`Communicator::defer_release`].
struct Deferred {
    done: Release,
}

/// A dropped communicator's memory on its way to being freed ([`release::in_background`]): ready
/// once the communicator's last eager launch has finished.
struct Remains {
    device: Arc<Device>,
    last: Arc<LastLaunch>,
    rank: u32,
    nranks: u32,
    peers: [u64; MAX_RANKS],
    mappings: Vec<PeerMapping>,
    registry: Registry,
    local: LocalArena,
    own_slots: Option<DeviceMem>,
    host: Arc<HostMapped>,
    scratch: Vec<DeviceMem>,
    share: Option<crate::residency::Share>,
    copy: Option<copy::CopyPath>,
}

impl Releasable for Remains {
    fn ready(&mut self) -> Result<bool, String> {
        Ok(release::Activity::idle(&*self.last)?
            && self.copy.as_ref().is_none_or(|c| c.unwatched()))
    }

    /// Tells the peers this rank is done with their arenas, closes its mappings of them, and
    /// frees the rest; the arena itself waits until every peer has said the same of it
    /// (`transport::keep`: a peer that has not noticed a failure yet may still write into it),
    /// and arenas kept earlier whose peers have all closed since are freed now.
    fn free(self) {
        let Remains {
            device,
            last,
            rank,
            nranks,
            peers,
            mut mappings,
            registry,
            local,
            own_slots,
            host,
            scratch,
            share,
            copy,
        } = self;
        if let Some(c) = &copy {
            c.wait_unwatched();
        }
        // Its share of the arena goes first, so that the arena is freed where `keep` says.
        drop(copy);
        if let Ok(_ctx) = device.activate() {
            if nranks > 1
                && let Err(e) = transport::tell_closed(&peers, rank)
            {
                tracing::debug!("could not tell the peers this rank is done with them: {e}");
            }
            mappings.clear();
            registry.close();
        }
        if nranks > 1 {
            transport::keep(device.clone(), local, rank, nranks);
        } else {
            drop(local);
        }
        drop((own_slots, host, scratch, last, share));
        transport::sweep();
    }
}

impl Communicator {
    /// Where the arenas live (the same on every rank).
    pub fn transport(&self) -> Transport {
        self.local.transport()
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> u32 {
        self.nranks
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> i32 {
        self.device.ordinal()
    }

    /// Bytes of device memory this rank's arena takes.
    pub fn arena_bytes(&self) -> u64 {
        self.arena.total_bytes
    }

    /// The largest grid a launch uses.
    pub fn max_grid(&self) -> u32 {
        self.max_grid
    }

    /// The cost model in use.
    pub fn cost_model(&self) -> &CostModel {
        &self.model
    }
}

/// Registered buffers ([`crate::register`]: zero-copy for peers of other processes).
impl Communicator {
    /// Registers `len` bytes of device memory at `ptr` (`ncclCommRegister`: local, no peer
    /// takes part). With zero-copy on and peers in other processes, the allocation holding the
    /// buffer is exported to them, and once each has mapped it (at its next direct call) the
    /// direct PULL protocol lets it read the buffer in place; until then, or if the driver
    /// cannot export the memory, the buffer is staged as unregistered ones are. Never fails: what
    /// cannot be served in place is served by staging.
    pub fn register(&self, ptr: u64, len: u64) -> Result<RegistrationId, Error> {
        let _ctx = self.device.activate()?;
        Ok(self.registry.register(ptr, len, &|| self.idle_now()))
    }

    /// [`Communicator::register`] for a collective registration (`ncclCommWindowRegister`,
    /// which every rank calls): also takes part in a collective exchange
    /// ([`crate::register`]), waiting at most `limit` until every peer of another process that
    /// takes part has acknowledged the buffer (mapped it, or said it could not), so the first
    /// call after it already reads in place. Returns at once where no peer takes part. Whether
    /// the exchange completed in time.
    pub fn register_collective(
        &self,
        ptr: u64,
        len: u64,
        limit: Duration,
    ) -> Result<(RegistrationId, bool), Error> {
        let _ctx = self.device.activate()?;
        let id = self.registry.register(ptr, len, &|| self.idle_now());
        Ok((id, self.registry.exchange(&[id], limit)))
    }

    /// Ends registration `id`: later calls stage the buffer. Peers close their mappings of it
    /// once this rank's launches have finished, unless a captured graph may still publish it
    /// (then when the communicator is released).
    pub fn deregister(&self, id: RegistrationId) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        if self.registry.deregister(id, &|| self.idle_now()) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "no registration {id} on this communicator"
            )))
        }
    }

    /// The calls of this rank's phase trace (`cfg.phase_trace`; `None` without it), by sequence
    /// number: the last [`crate::abi::TRACE_CALLS`] at most ([`crate::trace::calls`]), copied
    /// on `stream`, the stream of the calls traced, after them.
    pub fn phase_trace(
        &self,
        stream: Stream,
    ) -> Result<Option<Vec<crate::trace::CallTrace>>, Error> {
        let Some(t) = &self.trace else {
            return Ok(None);
        };
        let _ctx = self.device.activate()?;
        let mut bytes = vec![0u8; crate::trace::TRACE_WORDS * 8];
        t.download(0, &mut bytes, stream)?;
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|b| b.try_into().map_or(0, u64::from_le_bytes))
            .collect();
        Ok(Some(crate::trace::calls(&words)))
    }

    /// Peers' allocations this rank has mapped now (registered buffers read in place).
    pub fn peer_mappings(&self) -> usize {
        self.registry.mapped()
    }

    /// Whether this rank has peers of other processes that may read its registered buffers in
    /// place (zero-copy on, the peer transport, a board made and mapped).
    pub fn serves_registered_buffers(&self) -> bool {
        self.registry.has_boards() && self.arena.direct
    }

    /// Calls whose direct PULL kernel let every peer read this rank's buffers in place with at
    /// least one peer of another process (zero-copy across processes; tests and statistics).
    pub fn zero_copy_calls(&self) -> u64 {
        self.zero_copy_calls.load(Ordering::Relaxed)
    }
}

impl Communicator {
    /// From now on, dropping this communicator (wherever its last reference goes) never blocks:
    /// its memory goes to a thread of its own that waits for the last eager launch and then
    /// frees it (`ncclCommAbort` and `ncclCommDestroy`: freeing waits for the device's
    /// outstanding work, which after a fault may never end). The returned [`Release`] says when
    /// the memory was freed (the arena, with peers, once they have closed too: `Remains::free`);
    /// a caller waits for it at most a bound.
    pub fn defer_release(&self) -> Release {
        let mut d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        let done = d.as_ref().map_or_else(release::pending, |d| d.done.clone());
        *d = Some(Deferred { done: done.clone() });
        done
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let deferred = self
            .deferred
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if deferred.is_none() {
            // The arena must outlive every kernel that uses it.
            let _ = self.wait_idle();
        }
        let remains = Remains {
            device: self.device.clone(),
            last: self.last.clone(),
            rank: self.rank,
            nranks: self.nranks,
            peers: self.peers,
            mappings: std::mem::take(&mut self.mappings),
            registry: std::mem::replace(
                &mut self.registry,
                Registry::local_only(self.rank, self.nranks, [true; MAX_RANKS]),
            ),
            local: std::mem::replace(&mut self.local, LocalArena::Empty),
            own_slots: self.own_slots.take(),
            host: std::mem::replace(&mut self.host, Arc::new(HostMapped::empty())),
            // The trace goes with the scratch: freed once the last kernel has finished.
            scratch: std::mem::take(self.scratch.get_mut().unwrap_or_else(|e| e.into_inner()))
                .into_iter()
                .chain(self.trace.take())
                .collect(),
            share: self.share.take(),
            copy: self.copy.take(),
        };
        match deferred {
            Some(d) => release::in_background(remains, d.done, &release::LIVE),
            None => remains.free(),
        }
    }
}
