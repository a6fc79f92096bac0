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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use flashcomm_kernels::catalog::QuantOp;
use flashcomm_kernels::{Kernel, Kernels, LaunchConfig};

use crate::abi::{self, FcCollParams, FcProbeParams, MAX_RANKS, THREADS};
use crate::bootstrap::{Agreement, Bootstrap};
use crate::error::Error;
use crate::gpu::{
    self, CaptureRecord, Device, DeviceMem, DevicePtr, Event, HostMapped, OwnStream, Stream,
};
use crate::identity;
use crate::plan::{
    self, Algorithm, Arena, Choice, Collective, CostModel, DataType, Plan, Protocol, QuantChoice,
    QuantModel, QuantSpec,
};
use crate::release::{self, Releasable, Release};
use crate::transport::{LocalArena, PeerMapping, Transport};

/// Settings of one communicator (the same on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct CommConfig {
    /// Bound on every device-side wait; zero (the default): no time limit, as in NCCL (a wait
    /// lasts until the peer arrives or [`Communicator::abort`] is called).
    pub timeout: Duration,
    /// Cap on the arena each rank allocates (its push protocols' part).
    pub arena_bytes: u64,
    /// Bytes of the pull area each rank allocates beside it (two staging halves; the PULL
    /// protocols take AllReduce calls up to half of it; 0: no PULL protocols).
    pub pull_bytes: u64,
    /// AllReduce algorithm override.
    pub algo: Choice<Algorithm>,
    /// Protocol override.
    pub proto: Choice<Protocol>,
    /// Cap on blocks per launch (default: what keeps every rank of this GPU resident).
    pub max_blocks: Option<u32>,
    /// Measure the cost model at set-up (otherwise use defaults).
    pub calibrate: bool,
    /// Codec settings whose quantized AllReduce calibration also times (the settings the
    /// communicator's calls will ask for; the same list on every rank).
    pub quant_calibrate: Vec<QuantSpec>,
    /// Whether a quantized AllReduce runs only where it pays (`FLASHCOMM_QUANT_CHOICE`).
    pub quant_choice: QuantChoice,
    /// Where arenas live: automatic (the peer transport where every pair of ranks has peer
    /// access, the host transport otherwise), or forced.
    pub transport: Choice<Transport>,
    /// Graph mixing (`FLASHCOMM_GRAPH_MIXING`): the first captured collective of each capture
    /// waits at each replay for the last eager operation, and each replay records an event (one
    /// node beside the captured chain, after every captured collective) that later eager
    /// operations wait for.
    pub graph_mixing: bool,
    /// Early launch (`FLASHCOMM_EARLY_LAUNCH`): each kernel lets the next kernel of its stream
    /// launch as soon as it starts, where twice the grid fits the resident share
    /// ([`abi::FLAG_EARLY_LAUNCH`]).
    pub early_launch: bool,
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
            quant_calibrate: Vec::new(),
            quant_choice: QuantChoice::Auto,
            transport: Choice::Auto,
            graph_mixing: true,
            early_launch: true,
            fail_at: None,
            panic_at: None,
        }
    }
}

/// The pull area's default size: two staging halves of 16 MiB, so the PULL protocols take
/// AllReduce calls up to 16 MiB.
pub const DEFAULT_PULL_BYTES: u64 = 32 << 20;

const INFO_MAGIC: u32 = 0x4643_4f4d; // "FCOM"
const INFO_BYTES: usize = 160;
const PROBE_MAGIC: u32 = 0x5052_0000;
const HOST_ABORT: usize = 0;
const HOST_STATUS: usize = 64;
const HOST_BYTES: usize = 128;

/// How long a set-up kernel (the calibration's timed collectives) waits for its peers when no
/// timeout is configured: every rank starts them right after the same exchange round, so only a
/// rank that failed to launch keeps its peers waiting, and they must not wait for ever.
pub const SETUP_WAIT: Duration = Duration::from_secs(60);

/// The buffers, events and stream the calibration times its plans with.
struct Timers<'a> {
    send: &'a DeviceMem,
    recv: &'a DeviceMem,
    start: &'a Event,
    end: &'a Event,
    stream: Stream,
}

/// `bytes` of bf16 calibration inputs for `rank`: values spread over [-1, 1) in a pattern that
/// differs between ranks and between codec groups, as activations do (an integer hash, so
/// every run times the same data).
fn calibration_inputs(bytes: usize, rank: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes);
    for i in 0..(bytes / 2) as u32 {
        let h = (i ^ rank.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
        let x = ((h >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0;
        v.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
    v
}

/// A local step's outcome as the verdict of the next round.
fn verdict<T, E: std::fmt::Display>(r: Result<T, E>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

/// The checks of a call's buffers that the kernels need, with NCCL's answer
/// (`InvalidArgument`, and a message) where a kernel would otherwise race or fault:
/// * send and receive ranges overlap only in NCCL's in-place layout: the same buffer for
///   AllReduce and AllToAll; for ReduceScatter the receive buffer at `in_place` bytes (rank x recvcount
///   elements) into the send buffer; for AllGather the send buffer at `in_place` bytes into the
///   receive buffer; any other overlap would let one rank's writes race with another's reads;
/// * both buffers are aligned to `align` (the element size for the quantized kernels, which store
///   whole elements; the lossless kernels take any alignment).
pub(crate) fn check_buffers(
    coll: Collective,
    send: (u64, u64),
    recv: (u64, u64),
    in_place: u64,
    align: u64,
) -> Result<(), Error> {
    let (s, sn) = send;
    let (r, rn) = recv;
    let overlap = s < r.saturating_add(rn) && r < s.saturating_add(sn);
    let layout_ok = match coll {
        // AllToAll in place: every thread (LL) or warp (BLOCK) of a round reads chunk k of every
        // block it sends before it writes chunk k of any block it receives, and no other part of
        // the kernel touches chunk k (the quantized kernel: a block barrier between the two).
        Collective::AllReduce | Collective::AlltoAll => s == r,
        Collective::ReduceScatter => s.checked_add(in_place) == Some(r),
        Collective::AllGather => r.checked_add(in_place) == Some(s),
        _ => false,
    };
    if overlap && !layout_ok {
        let want = match coll {
            Collective::AllReduce | Collective::AlltoAll => "the same buffer".to_string(),
            Collective::ReduceScatter => {
                format!("recvbuff = sendbuff + {in_place} bytes (rank x recvcount elements)")
            }
            Collective::AllGather => {
                format!("sendbuff = recvbuff + {in_place} bytes (rank x sendcount elements)")
            }
            _ => "nothing: this collective has no in-place form here".to_string(),
        };
        return Err(Error::InvalidArgument(format!(
            "{coll:?}: send buffer {s:#x} ({sn} bytes) and receive buffer {r:#x} ({rn} bytes) \
             overlap, but not in place (in place means {want})"
        )));
    }
    if align > 1 && (s % align != 0 || r % align != 0) {
        return Err(Error::InvalidArgument(format!(
            "{coll:?}: buffers {s:#x} and {r:#x} must be aligned to the {align}-byte datatype for \
             the quantized kernels"
        )));
    }
    Ok(())
}

/// The signature of a call that its tags carry (see `FLAG_SIG_SHIFT`): the collective, whether
/// it is quantized, and the datatype of a reducing or quantized collective (a lossless AllGather
/// or AllToAll moves bytes, so its datatype does not matter). Never more than 8 bits.
///
/// A quantized call's signature (top bit set; lossless ones stay below 0x80) also carries its
/// codec settings, which `flashcommCommSetQuant` sets per rank: two ranks that run one collective
/// with different widths, group or spikes then see a foreign tag and report a mismatch instead of
/// decoding each other's bytes in the wrong format. Bits 5..7: the collective; bit 4: f16 or
/// bf16; bits 0..4: `(rs - 2) + 5 (ag - 2) + 7 g + 3 s (mod 16)`, with `g` the group's index
/// (32, 64, 128, 256) and `s` the spikes' (0, 2, 4). A difference in any one of the settings
/// changes those four bits (each coefficient times any possible difference is not a multiple of
/// 16); ranks that differ in several at once still differ with probability 15/16.
fn call_signature(p: &Plan, dtype: Option<DataType>) -> u32 {
    if let Some(q) = p.quant {
        let coll = match p.coll {
            Collective::AllReduce => 0,
            Collective::ReduceScatter => 1,
            Collective::AllGather => 2,
            _ => 3,
        };
        let ty = u32::from(dtype == Some(DataType::Bf16));
        let g = match q.group {
            32 => 0,
            64 => 1,
            128 => 2,
            _ => 3,
        };
        let sp = u32::from(q.spikes / 2);
        let h = (u32::from(q.rs_bits.saturating_sub(2))
            + 5 * u32::from(q.ag_bits.saturating_sub(2))
            + 7 * g
            + 3 * sp)
            % 16;
        return 0x80 | coll << 5 | ty << 4 | h;
    }
    let coll = match p.coll {
        Collective::AllReduce => 1,
        Collective::ReduceScatter => 2,
        Collective::AllGather => 3,
        Collective::AlltoAll => 4,
        // Never launched (`run` refuses them); distinct from every launched kind all the same.
        other => 5 + other.index() as u32 % 3,
    };
    let ty = match (p.coll, dtype) {
        (Collective::AllGather | Collective::AlltoAll, _) => 0,
        (_, None) => 0,
        (_, Some(DataType::F32)) => 1,
        (_, Some(DataType::F16)) => 2,
        (_, Some(DataType::Bf16)) => 3,
    };
    (coll << 4) | ty
}

/// What one rank tells the others at set-up.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PeerInfo {
    pid: u32,
    /// [`identity::process_token`]: what tells processes apart (process ids of different PID
    /// namespaces of one machine can be equal).
    token: u64,
    /// [`identity::Build::id`] of the rank's flashcomm.
    build: u64,
    host: u64,
    uuid: [u8; 16],
    arena: u64,
    arena_bytes: u64,
    ipc: Option<[u8; 64]>,
    max_grid: u32,
    transport: Transport,
}

impl PeerInfo {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(INFO_BYTES);
        v.extend_from_slice(&INFO_MAGIC.to_le_bytes());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.host.to_le_bytes());
        v.extend_from_slice(&self.uuid);
        v.extend_from_slice(&self.arena.to_le_bytes());
        v.extend_from_slice(&self.arena_bytes.to_le_bytes());
        v.push(self.ipc.is_some() as u8);
        v.extend_from_slice(&self.ipc.unwrap_or([0; 64]));
        v.extend_from_slice(&self.max_grid.to_le_bytes());
        v.push(self.transport.code());
        v.resize(120, 0);
        v.extend_from_slice(&self.token.to_le_bytes());
        v.extend_from_slice(&self.build.to_le_bytes());
        v.resize(INFO_BYTES, 0);
        v
    }

    /// Whether `other` is a rank of this rank's process (then its arena is reached by address).
    fn same_process(&self, other: &PeerInfo) -> bool {
        self.host == other.host && self.pid == other.pid && self.token == other.token
    }

    fn decode(b: &[u8]) -> Result<PeerInfo, Error> {
        if b.len() != INFO_BYTES || b[0..4] != INFO_MAGIC.to_le_bytes() {
            return Err(Error::Bootstrap(
                "malformed set-up record from a peer (different flashcomm version?)".into(),
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let mut ipc = [0u8; 64];
        ipc.copy_from_slice(&b[49..113]);
        Ok(PeerInfo {
            pid: u32_at(4),
            token: u64_at(120),
            build: u64_at(128),
            host: u64_at(8),
            uuid,
            arena: u64_at(32),
            arena_bytes: u64_at(40),
            ipc: (b[48] != 0).then_some(ipc),
            max_grid: u32_at(113),
            transport: Transport::from_code(b[117]).ok_or_else(|| {
                Error::Bootstrap("a peer's set-up record names no transport".into())
            })?,
        })
    }
}

/// A stable identity of this machine: hostname and boot id.
fn host_id() -> u64 {
    let hostname = std::fs::read("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in hostname.iter().chain(boot.iter()) {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// What a rank sets up before talking to the others.
struct LocalSetup {
    dev: Arc<Device>,
    arena: Arena,
    local: LocalArena,
    own_slots: Option<DeviceMem>,
    host: HostMapped,
    kernels: Arc<Kernels>,
    grid: u32,
}

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
    peers: [u64; MAX_RANKS],
    mappings: Vec<PeerMapping>,
    host: HostMapped,
    kernels: Arc<Kernels>,
    max_grid: u32,
    model: CostModel,
    /// The measured quantized AllReduce per codec setting of `cfg.quant_calibrate` (agreed by
    /// every rank; empty without calibration).
    quant_models: Vec<QuantModel>,
    cfg: CommConfig,
    /// Shared with the release registry ([`release::LIVE`]), which asks it before any free.
    last: Arc<LastLaunch>,
    /// The scratch of [`Communicator::all_to_all_scattered`]: the last is in use; earlier, smaller
    /// ones are kept until the communicator is dropped (freeing device memory synchronizes the
    /// device, which would wait for the kernels of ranks that share it and wait for this one).
    scratch: std::sync::Mutex<Vec<DeviceMem>>,
    /// Set by [`Communicator::defer_release`]: dropping hands the memory to a thread of its own
    /// instead of freeing it here.
    deferred: std::sync::Mutex<Option<Deferred>>,
}

/// How a communicator's drop releases its memory after [`Communicator::defer_release`].
struct Deferred {
    done: Release,
    keep_arena: bool,
}

/// A dropped communicator's memory on its way to being freed ([`release::in_background`]): ready
/// once the communicator's last eager launch has finished.
struct Remains {
    device: Arc<Device>,
    last: Arc<LastLaunch>,
    mappings: Vec<PeerMapping>,
    local: LocalArena,
    keep_arena: bool,
    own_slots: Option<DeviceMem>,
    host: HostMapped,
    scratch: Vec<DeviceMem>,
}

impl Releasable for Remains {
    fn ready(&mut self) -> Result<bool, String> {
        release::Activity::idle(&*self.last)
    }

    fn free(self) {
        let Remains {
            device,
            last,
            mut mappings,
            local,
            keep_arena,
            own_slots,
            host,
            scratch,
            ..
        } = self;
        // Peers' mappings are closed with this device's context current.
        if let Ok(_ctx) = device.activate() {
            mappings.clear();
        }
        if keep_arena {
            // Aborted while peers may still run collectives that write into this arena (a
            // rank that has not noticed the failure yet): freed, its memory could be handed to
            // another allocation and overwritten. It stays allocated for the life of the process.
            std::mem::forget(local);
        } else {
            drop(local);
        }
        drop((own_slots, host, scratch, last));
    }
}

impl Communicator {
    /// Builds rank `boot.rank()` of a communicator on CUDA device `device`. Collective: every rank
    /// must call it at the same point, with the same `cfg`.
    ///
    /// All or nothing, on every rank alike: every exchange round carries each rank's verdict
    /// ([`Agreement`]), a rank whose local step failed still takes part in the next round and
    /// says so, and every rank stops at the first round in which any rank failed, with the same
    /// [`Error::Unsupported`]. Only a failure of the exchange itself ([`Error::Bootstrap`]) is
    /// not symmetric.
    pub fn new(boot: &dyn Bootstrap, device: i32, cfg: CommConfig) -> Result<Communicator, Error> {
        Self::new_agreed(&mut Agreement::new(boot), device, cfg)
    }

    /// [`Communicator::new`] continuing the rounds of `ag` (a caller that agreed on something
    /// first, such as the shim's configuration digest).
    pub fn new_agreed(
        ag: &mut Agreement<'_>,
        device: i32,
        cfg: CommConfig,
    ) -> Result<Communicator, Error> {
        let (fail_at, panic_at) = (cfg.fail_at, cfg.panic_at);
        if panic_at == Some(8) {
            panic!("panic injected before the transport is chosen");
        }
        let injected = |step: u32| -> Result<(), Error> {
            if panic_at == Some(step) {
                panic!("panic injected at set-up step {step}");
            }
            if fail_at == Some(step) {
                return Err(Error::Internal(format!(
                    "failure injected at set-up step {step}"
                )));
            }
            Ok(())
        };
        let rank = ag.rank();
        let nranks = ag.size();

        // The transport (two more rounds first when it is automatic; `cfg` is the same on every
        // rank, so every rank runs them).
        let transport = Self::choose_transport(ag, device, cfg.transport)?;

        // Step 0 (round 1): local resources and this rank's record.
        let local = injected(0)
            .and_then(|()| Self::local_setup(nranks, device, &cfg, transport))
            .and_then(|ls| {
                let info = {
                    let _ctx = ls.dev.activate()?;
                    PeerInfo {
                        pid: std::process::id(),
                        token: identity::process_token(),
                        build: identity::Build::this().id(),
                        host: host_id(),
                        uuid: ls.dev.uuid(),
                        arena: ls.local.addr(),
                        arena_bytes: ls.arena.total_bytes,
                        ipc: ls.local.export(),
                        max_grid: ls.grid,
                        transport,
                    }
                };
                Ok((ls, info))
            });
        let all = ag.round(verdict(local.as_ref().map(|(_, i)| i.encode())))?;
        let (
            LocalSetup {
                dev,
                arena,
                local,
                own_slots,
                host,
                kernels,
                grid: my_grid,
            },
            info,
        ) = local.map_err(|e| Error::Internal(format!("failed set-up step passed: {e}")))?;

        // Step 1 (round 2): map every peer.
        let ctx = dev.activate();
        let mapped = injected(1).and_then(|()| {
            ctx.as_ref().map_err(|e| Error::from(e.clone()))?;
            let infos = all
                .iter()
                .map(|b| PeerInfo::decode(b))
                .collect::<Result<Vec<_>, _>>()?;
            Self::map_peers(rank, &dev, &arena, &local, &info, &infos)
        });
        ag.check(verdict(mapped.as_ref().map(|_| ())))?;
        // Every peer has mapped this rank's arena: a shared segment's name can go.
        let mut local = local;
        local.peers_mapped();
        let (peers, mappings, my_grid) = match mapped {
            Ok((peers, mappings, colocated)) => (peers, mappings, (my_grid / colocated).max(1)),
            Err(e) => return Err(Error::Internal(format!("failed set-up step passed: {e}"))),
        };
        // The direct PULL protocol loads peers' user buffers at the addresses they publish: only
        // where every rank is a thread of this process on this device (every device pointer of
        // a rank is then one of its peers'). The records are the same on every rank, so every
        // rank decides alike.
        let mut arena = arena;
        arena.direct = transport == Transport::P2p
            && all.iter().all(|b| {
                PeerInfo::decode(b)
                    .is_ok_and(|p| p.pid == info.pid && p.host == info.host && p.uuid == info.uuid)
            });

        // Step 2 (round 3): probe: every rank writes into every arena. The stream is this
        // set-up's own and is destroyed when set-up ends.
        let probe_value = PROBE_MAGIC | rank;
        let probed = injected(2).and_then(|()| {
            let stream = OwnStream::create()?;
            let params = FcProbeParams {
                peer_base: peers,
                rank,
                nranks,
                value: probe_value,
                pad: 0,
            };
            gpu::launch(
                &kernels,
                Kernel::probe(),
                LaunchConfig {
                    grid: 1,
                    block: 32,
                    smem: 0,
                },
                stream.stream(),
                &params,
                false,
            )?;
            stream.stream().synchronize()?;
            Ok(stream)
        });
        ag.check(verdict(probed.as_ref().map(|_| ())))?;
        let stream =
            probed.map_err(|e| Error::Internal(format!("failed set-up step passed: {e}")))?;

        // Step 3 (round 4): each rank checks what arrived (peer access the driver reports is not
        // always real).
        let arrived = injected(3).and_then(|()| {
            let mut words = vec![0u8; 4 * MAX_RANKS];
            local.read(abi::HDR_PROBE as usize, &mut words, stream.stream())?;
            for r in 0..nranks as usize {
                let got = u32::from_le_bytes([
                    words[4 * r],
                    words[4 * r + 1],
                    words[4 * r + 2],
                    words[4 * r + 3],
                ]);
                if got != PROBE_MAGIC | r as u32 {
                    return Err(Error::Unsupported(format!(
                        "rank {r}'s probe write did not arrive (peer access is not working)"
                    )));
                }
            }
            Ok(())
        });
        ag.check(verdict(arrived))?;

        // Step 4 (round 5): the communicator, and one grid limit for all.
        let event = injected(4).and_then(|()| Ok(Event::new(false)?));
        let grids = ag.round(verdict(
            event.as_ref().map(|_| my_grid.to_le_bytes().to_vec()),
        ))?;
        let event =
            event.map_err(|e| Error::Internal(format!("failed set-up step passed: {e}")))?;
        let max_grid = grids
            .iter()
            .map(|b| {
                b.get(0..4)
                    .map(|x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                    .unwrap_or(1)
            })
            .min()
            .unwrap_or(1)
            .max(1);

        let mut comm = Communicator {
            rank,
            nranks,
            device: dev.clone(),
            arena,
            local,
            own_slots,
            peers,
            mappings,
            host,
            kernels,
            max_grid,
            model: CostModel::default_for(nranks),
            quant_models: Vec::new(),
            cfg: cfg.clone(),
            scratch: std::sync::Mutex::new(Vec::new()),
            deferred: std::sync::Mutex::new(None),
            last: Arc::new(LastLaunch {
                device: dev.clone(),
                stream: AtomicUsize::new(0),
                launched: AtomicBool::new(false),
                captured: AtomicBool::new(false),
                event,
                capture: std::sync::Mutex::new(CaptureMark::default()),
            }),
        };
        let watched: Arc<dyn release::Activity> = comm.last.clone();
        release::LIVE.watch(Arc::downgrade(&watched));
        // Steps 5 and 6 (rounds 6, 7 and, with codec settings to time, 7q), the same on every
        // rank since `cfg` is.
        if cfg.calibrate && nranks > 1 {
            comm.calibrate(ag, stream.stream(), &injected)?;
        }
        // Step 7 (round 8): every rank is done before any returns.
        ag.check(verdict(injected(7)))?;
        drop(ctx);
        Ok(comm)
    }

    /// Maps every peer's arena: the same address within one process (enabling peer access across
    /// devices), a legacy IPC mapping across processes of one host; other hosts are refused.
    /// Returns the peers' addresses, the mappings, and how many ranks share this GPU.
    fn map_peers(
        rank: u32,
        dev: &Arc<Device>,
        arena: &Arena,
        local: &LocalArena,
        info: &PeerInfo,
        infos: &[PeerInfo],
    ) -> Result<([u64; MAX_RANKS], Vec<PeerMapping>, u32), Error> {
        // Ranks that share this GPU share its multiprocessors: each may keep only its share of
        // blocks resident, or ranks would wait on blocks that cannot be scheduled.
        let colocated = infos
            .iter()
            .filter(|p| p.host == info.host && p.uuid == info.uuid)
            .count()
            .max(1) as u32;
        let mut peers = [0u64; MAX_RANKS];
        let mut mappings = Vec::new();
        for (r, p) in infos.iter().enumerate() {
            let fail = |m: String| Err(Error::Unsupported(m));
            if p.build != info.build {
                return fail(format!(
                    "rank {r} runs another flashcomm build than this rank ({}; build ids {:016x} \
                     and {:016x}): every rank must run the same build",
                    identity::Build::this(),
                    p.build,
                    info.build
                ));
            }
            if p.transport != info.transport {
                return fail(format!(
                    "rank {r} chose the {} transport, this rank {}",
                    p.transport.name(),
                    info.transport.name()
                ));
            }
            if p.arena_bytes != arena.total_bytes {
                return fail(format!(
                    "rank {r} has a different arena size (different settings?)"
                ));
            }
            if r as u32 == rank {
                peers[r] = local.addr();
            } else if p.host != info.host {
                return fail(format!(
                    "rank {r} is on another machine (flashcomm kernels serve one node)"
                ));
            } else if p.same_process(info) && info.transport == Transport::Host {
                // A portable registration: the creator's address is valid in every context.
                peers[r] = p.arena;
            } else if p.same_process(info) {
                match Self::in_process_peer(dev, &p.uuid) {
                    Ok(()) => peers[r] = p.arena,
                    Err(e) => return fail(format!("rank {r} (same process): {e}")),
                }
            } else {
                match p
                    .ipc
                    .as_ref()
                    .map(|h| PeerMapping::open(info.transport, h, arena.total_bytes as usize))
                {
                    Some(Ok(m)) => {
                        peers[r] = m.ptr();
                        mappings.push(m);
                    }
                    Some(Err(e)) => return fail(format!("rank {r}: {e}")),
                    None => return fail(format!("rank {r} could not export its arena")),
                }
            }
        }
        Ok((peers, mappings, colocated))
    }

    fn local_setup(
        nranks: u32,
        device: i32,
        cfg: &CommConfig,
        transport: Transport,
    ) -> Result<LocalSetup, Error> {
        let arena = Arena::with_pull(nranks, cfg.arena_bytes, cfg.pull_bytes)?;
        let dev = Device::open(device)?;
        let _ctx = dev.activate()?;
        let kernels = Kernels::for_context(dev.context())?;
        let local = LocalArena::alloc(transport, &dev, arena.total_bytes as usize)?;
        let own_slots = match transport {
            Transport::Host => Some(DeviceMem::alloc_zeroed(
                &dev,
                2 * arena.slot_bytes as usize,
            )?),
            Transport::P2p => None,
        };
        let host = HostMapped::alloc(HOST_BYTES)?;
        // Largest grid that keeps all co-located ranks resident at once (the kernels wait on one
        // another across ranks): occupancy of the heaviest kernel times SMs, shared among the
        // ranks of this GPU. The count of co-located ranks is not known yet; the caller's cap and
        // the per-device share are applied after the exchange in `resident_grid`.
        let mut per_sm = u32::MAX;
        for k in [
            Kernel::allreduce(Algorithm::TwoShot, Protocol::Block, DataType::F32),
            Kernel::allreduce(Algorithm::OneShot, Protocol::Ll, DataType::F32),
            Kernel::allreduce(Algorithm::TwoShot, Protocol::Ll, DataType::Bf16),
            Kernel::allreduce(Algorithm::OneShot, Protocol::Pull, DataType::F32),
            Kernel::allreduce(Algorithm::TwoShot, Protocol::Direct, DataType::Bf16),
        ] {
            per_sm = per_sm.min(kernels.get(k).max_active_blocks_per_sm(THREADS, 0)?);
        }
        let grid = (per_sm.max(1) * dev.sm_count())
            .min(arena.max_grid())
            .min(abi::MAX_BLOCKS);
        let grid = cfg.max_blocks.map_or(grid, |m| grid.min(m.max(1)));
        Ok(LocalSetup {
            dev,
            arena,
            local,
            own_slots,
            host,
            kernels,
            grid,
        })
    }

    /// The transport of this communicator, the same on every rank. Forced: as asked, with no
    /// round. Automatic: two rounds: where each rank is, then each rank's answer to "does my GPU
    /// have peer access to every other rank's GPU of this machine?"; the peer transport is taken
    /// only when every rank says yes. A rank whose device cannot be opened says so in the first
    /// round, and every rank fails there.
    fn choose_transport(
        ag: &mut Agreement<'_>,
        device: i32,
        choice: Choice<Transport>,
    ) -> Result<Transport, Error> {
        if let Choice::Force(t) = choice {
            return Ok(t);
        }
        let dev = Device::open(device);
        let me = dev.as_ref().map(|d| {
            let mut v = d.uuid().to_vec();
            v.extend_from_slice(&host_id().to_le_bytes());
            v
        });
        let all = ag.round(verdict(me))?;
        let dev = dev.map_err(|e| Error::Internal(format!("failed set-up step passed: {e}")))?;
        let reachable = |b: &Vec<u8>| -> bool {
            if b.len() != 24 || b[16..24] != host_id().to_le_bytes() {
                return false;
            }
            let uuid: [u8; 16] = b[0..16].try_into().unwrap_or([0; 16]);
            Self::peer_device_access(&dev, &uuid).unwrap_or(false)
        };
        let ok = all.iter().all(reachable);
        let answers = ag.round(Ok(vec![u8::from(ok)]))?;
        Ok(if answers.iter().all(|a| a.first() == Some(&1)) {
            Transport::P2p
        } else {
            Transport::Host
        })
    }

    /// Whether `me` can map memory of the device with `uuid` (true for itself; false when that
    /// device is not visible in this process).
    fn peer_device_access(me: &Arc<Device>, uuid: &[u8; 16]) -> Result<bool, Error> {
        if *uuid == me.uuid() {
            return Ok(true);
        }
        for ordinal in 0..gpu::device_count()? {
            let d = Device::open(ordinal)?;
            if d.uuid() == *uuid {
                return Ok(me.can_access_peer(&d)?);
            }
        }
        Ok(false)
    }

    fn in_process_peer(me: &Arc<Device>, uuid: &[u8; 16]) -> Result<(), Error> {
        if *uuid == me.uuid() {
            return Ok(());
        }
        for ordinal in 0..gpu::device_count()? {
            let d = Device::open(ordinal)?;
            if d.uuid() == *uuid {
                if !me.can_access_peer(&d)? {
                    return Err(Error::Unsupported(format!(
                        "device {} cannot access device {ordinal}",
                        me.ordinal()
                    )));
                }
                return Ok(me.enable_peer_access(&d)?);
            }
        }
        Err(Error::Unsupported(
            "peer device not found in this process".into(),
        ))
    }

    /// Times each (algorithm, protocol) at every size of [`plan::CALIB_SIZES`], then the
    /// quantized AllReduce of every codec setting of `cfg.quant_calibrate`, and agrees on one
    /// model with every rank (the element-wise maximum, so every rank plans alike; one round for
    /// the lossless table, one more for the quantized tables when there are settings to time):
    /// the rounds after set-up step 4. The timed kernels wait at most [`SETUP_WAIT`] (or the
    /// configured timeout, if shorter) for their peers: a rank whose launch failed here cannot
    /// leave its peers' kernels waiting for ever. A failure of any timed kernel, quantized ones
    /// included, fails set-up on every rank (the shim then leaves the communicator to NCCL).
    fn calibrate(
        &mut self,
        ag: &mut Agreement<'_>,
        stream: Stream,
        injected: &dyn Fn(u32) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let buf_bytes = *plan::CALIB_SIZES.iter().max().unwrap_or(&(1 << 20)) as usize;
        let buffers = injected(5).and_then(|()| {
            let send = DeviceMem::alloc_zeroed(&self.device, buf_bytes)?;
            let recv = DeviceMem::alloc_zeroed(&self.device, buf_bytes)?;
            // Inputs of varied values, so that the quantized kernels' timed encoding does the
            // work it does on activations (zeros would take its shortest path).
            if !self.cfg.quant_calibrate.is_empty() {
                send.upload(0, &calibration_inputs(buf_bytes, self.rank), stream)?;
            }
            let events = (Event::new(true)?, Event::new(true)?);
            Ok((send, recv, events))
        });
        // Allocation (and its zeroing) must be over on every rank before any rank launches: a
        // rank still clearing its buffers while a peer's kernel already waits for it could be
        // queued behind that kernel when ranks share a GPU.
        ag.check(verdict(buffers.as_ref().map(|_| ())))?;
        let (send, recv, (start, end)) =
            buffers.map_err(|e| Error::Internal(format!("failed set-up step passed: {e}")))?;
        let configured = self.cfg.timeout;
        self.cfg.timeout = if configured.is_zero() {
            SETUP_WAIT
        } else {
            configured.min(SETUP_WAIT)
        };
        let timers = Timers {
            send: &send,
            recv: &recv,
            start: &start,
            end: &end,
            stream,
        };
        let began = std::time::Instant::now();
        let measured = self.time_plans(ag, &timers, injected).and_then(|m| {
            let lossless_ms = began.elapsed().as_millis();
            let quant = self.time_quant(ag, &timers)?;
            Ok((m, quant, lossless_ms))
        });
        self.cfg.timeout = configured;
        // A failure here was agreed in one of the timing rounds: every rank returns it there.
        let (measured, quant, lossless_ms) = measured?;
        let all = ag.round(Ok(measured.to_bytes()))?;
        self.model = CostModel::agree(&all)?;
        tracing::info!(target: "flashcomm::tuning", rank = self.rank, ms = lossless_ms, model = ?self.model, "calibrated cost model");
        if !self.cfg.quant_calibrate.is_empty() {
            let all = ag.round(Ok(QuantModel::to_bytes(&quant)))?;
            self.quant_models = QuantModel::agree(&self.cfg.quant_calibrate, &all)?;
            let ms = began.elapsed().as_millis() - lossless_ms;
            tracing::info!(target: "flashcomm::tuning", rank = self.rank, ms, models = ?self.quant_models, "calibrated quantized AllReduce");
        }
        Ok(())
    }

    /// The timed runs of [`Communicator::calibrate`]: this rank's measured table of the lossless
    /// AllReduce, every (algorithm, protocol) at every size of [`plan::CALIB_SIZES`].
    fn time_plans(
        &self,
        ag: &mut Agreement<'_>,
        t: &Timers<'_>,
        injected: &dyn Fn(u32) -> Result<(), Error>,
    ) -> Result<CostModel, Error> {
        // A rank that cannot start says so before anything is launched: a launch its peers made
        // would wait for it (and end in their timeout, a different verdict).
        ag.check(verdict(injected(6)))?;
        let mut model = CostModel::default_for(self.nranks);
        // A PULL protocol is timed only where it can serve every calibration size (the same on
        // every rank: the arena is); otherwise its row keeps the defaults, which the planner never
        // picks.
        let combos: Vec<(Algorithm, Protocol)> = Algorithm::ALL
            .iter()
            .flat_map(|&a| Protocol::ALL.iter().map(move |&p| (a, p)))
            .filter(|&(algo, proto)| {
                plan::CALIB_SIZES.iter().all(|&bytes| {
                    let count = bytes / 2;
                    let shard = plan::shard_elems(count, self.nranks, 2);
                    let two = (algo == Algorithm::TwoShot).then_some(shard).flatten();
                    self.arena.pull_fits(proto, count, 2, two)
                })
            })
            .collect();
        // Size by size, every combination still in the running; the times of a size are agreed
        // (the element-wise maximum) before the next, so that every rank drops the same
        // combinations (plan::Calibration).
        let mut cal = plan::Calibration::new(combos.len());
        for (i, &bytes) in plan::CALIB_SIZES.iter().enumerate() {
            let mut times = vec![0f64; combos.len()];
            for (k, &(algo, proto)) in combos.iter().enumerate() {
                if !cal.live(k) {
                    continue;
                }
                let p = plan::plan(
                    &self.arena,
                    &self.model,
                    Collective::AllReduce,
                    bytes / 2,
                    2,
                    self.max_grid,
                    Choice::Force(algo),
                    Choice::Force(proto),
                );
                times[k] = self.time_plan(ag, t, &p, bytes / 2)?;
            }
            let all = ag.round(Ok(times.iter().flat_map(|t| t.to_le_bytes()).collect()))?;
            let agreed = plan::Calibration::agree_times(&all, combos.len())?;
            cal.record(i, &agreed);
        }
        for (k, &(algo, proto)) in combos.iter().enumerate() {
            model.set_measured(algo, proto, cal.row(k));
        }
        Ok(model)
    }

    /// The timed runs of the quantized AllReduce for every codec setting of
    /// `cfg.quant_calibrate` (in that order): each algorithm at every size of
    /// [`plan::CALIB_SIZES`] where the planner may choose it (two-step from
    /// [`plan::QUANT_TWO_STEP_MIN_BLOCKS`] codec blocks and at least one per rank; 0 elsewhere).
    /// A setting without kernels is left unmeasured (its calls go to NCCL).
    fn time_quant(&self, ag: &mut Agreement<'_>, t: &Timers<'_>) -> Result<Vec<QuantModel>, Error> {
        let mut models = Vec::with_capacity(self.cfg.quant_calibrate.len());
        for &spec in &self.cfg.quant_calibrate {
            let mut m = QuantModel {
                spec,
                table_us: [[0.0; plan::CALIB_SIZES.len()]; 2],
            };
            if spec.has_kernels() {
                for algo in Algorithm::ALL {
                    for (i, &bytes) in plan::CALIB_SIZES.iter().enumerate() {
                        let count = bytes / 2;
                        let blocks = count.div_ceil(plan::CODEC_BLOCK_VALUES);
                        if algo == Algorithm::TwoShot
                            && blocks < plan::QUANT_TWO_STEP_MIN_BLOCKS.max(self.nranks.into())
                        {
                            continue;
                        }
                        let p = plan::plan_quant(
                            &self.arena,
                            &self.model,
                            None,
                            count,
                            DataType::Bf16,
                            spec,
                            self.max_grid,
                            Choice::Force(algo),
                        )?;
                        m.table_us[algo.index()][i] = self.time_plan(ag, t, &p, count)?;
                    }
                }
            }
            models.push(m);
        }
        Ok(models)
    }

    /// Times one plan of a bf16 AllReduce of `count` values for calibration, in microseconds per
    /// call. The plan is timed as a CUDA graph of `reps` calls, as decode loops run them (eager
    /// launches would measure the host's launch spread across ranks, not the plan), between three
    /// checked rounds: instantiation and destruction happen only while every rank is idle (with
    /// ranks sharing a GPU they can wait for running kernels), and a rank whose step failed says
    /// so in the next round, where every rank stops.
    fn time_plan(
        &self,
        ag: &mut Agreement<'_>,
        t: &Timers<'_>,
        p: &Plan,
        count: u64,
    ) -> Result<f64, Error> {
        let stream = t.stream;
        let launch = || {
            self.launch_plan(
                p,
                t.send.as_ptr(),
                t.recv.as_ptr(),
                count,
                2,
                Some(DataType::Bf16),
                stream,
            )
        };
        // Warm-up, then every rank is idle.
        let warm = (|| {
            launch()?;
            launch()?;
            stream.synchronize()?;
            self.check_status()
        })();
        ag.check(verdict(warm))?;
        // Large messages need fewer calls to time well (and calibration stays short).
        let reps = if count * 2 > 1 << 20 { 4 } else { 16 };
        let graph = (|| {
            stream.begin_capture()?;
            let mut captured = Ok(());
            for _ in 0..reps {
                captured = launch();
                if captured.is_err() {
                    break;
                }
            }
            let graph = stream.end_capture();
            captured?;
            Ok::<_, Error>(graph?)
        })();
        ag.check(verdict(graph.as_ref().map(|_| ())))?;
        let graph = graph.map_err(|e| Error::Internal(format!("failed step passed: {e}")))?;
        // The fastest of a few replays: calibration should see what the plan costs, not the
        // noise of one replay, so that two calibrations agree.
        let timed = (|| {
            graph.launch(stream)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                t.start.record(stream)?;
                graph.launch(stream)?;
                t.end.record(stream)?;
                t.end.synchronize()?;
                self.check_status()?;
                best = best.min(t.end.elapsed_ms_since(t.start)? as f64 * 1000.0 / reps as f64);
            }
            stream.synchronize()?;
            Ok::<_, Error>(best)
        })();
        ag.check(verdict(timed.as_ref().map(|_| ())))?;
        drop(graph);
        timed.map_err(|e| Error::Internal(format!("failed step passed: {e}")))
    }

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

    /// The plan for a call (pure; identical on every rank for identical arguments).
    pub fn plan(&self, coll: Collective, count: u64, elem: u64) -> Plan {
        plan::plan(
            &self.arena,
            &self.model,
            coll,
            count,
            elem,
            self.max_grid,
            self.cfg.algo,
            self.cfg.proto,
        )
    }

    /// The plan for a call with the algorithm and protocol forced (falls back where the forced
    /// choice is invalid for this count, exactly as the overrides in [`CommConfig`] do).
    pub fn plan_forced(
        &self,
        coll: Collective,
        count: u64,
        elem: u64,
        algo: Choice<Algorithm>,
        proto: Choice<Protocol>,
    ) -> Plan {
        plan::plan(
            &self.arena,
            &self.model,
            coll,
            count,
            elem,
            self.max_grid,
            algo,
            proto,
        )
    }

    /// Sum AllReduce of `count` elements.
    pub fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let p = self.plan(Collective::AllReduce, count, dtype.bytes());
        self.run(&p, send, recv, count, dtype.bytes(), Some(dtype), stream)?;
        Ok(p)
    }

    /// Sum AllReduce of `count` f16 or bf16 elements with a quantized wire format. Every rank's
    /// result is bitwise identical (each rank decodes the same bytes in the same order); the error
    /// against the exact sum is bounded as docs/codec.md states for one or two quantization steps.
    /// Under [`QuantChoice::Auto`], where quantizing does not pay and `lossless_allowed` (the
    /// caller's windows let the lossless kernels take this size), the lossless kernels run
    /// instead ([`Communicator::plan_all_reduce_quant`]); the returned plan says which ran.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_quant(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        q: QuantSpec,
        lossless_allowed: bool,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let p = self.plan_all_reduce_quant(count, dtype, q, self.cfg.algo, lossless_allowed)?;
        self.run(&p, send, recv, count, dtype.bytes(), Some(dtype), stream)?;
        Ok(p)
    }

    /// The plan of a quantized AllReduce (algorithm forced or chosen by the cost model, from
    /// the calibrated times of `q` where measured).
    pub fn plan_quant(
        &self,
        count: u64,
        dtype: DataType,
        q: QuantSpec,
        algo: Choice<Algorithm>,
    ) -> Result<Plan, Error> {
        plan::plan_quant(
            &self.arena,
            &self.model,
            self.quant_model(q),
            count,
            dtype,
            q,
            self.max_grid,
            algo,
        )
    }

    /// The plan of an AllReduce asked to be quantized with `q`: the quantized plan
    /// ([`Communicator::plan_quant`]) or, under [`QuantChoice::Auto`] where it does not pay
    /// ([`plan::quant_pays`]) and `lossless_allowed`, the lossless plan of the call (its `quant`
    /// is `None`). `lossless_allowed` false (the shim: the size lies outside the lossless
    /// kernels' window, `FLASHCOMM_MIN_BYTES`..`FLASHCOMM_MAX_BYTES`) keeps the quantized plan, as
    /// asked. Pure and identical on every rank (the models are agreed at set-up, the windows are
    /// the same everywhere). Refuses what the quantized kernels refuse (f32, widths without
    /// kernels) whichever it would choose.
    pub fn plan_all_reduce_quant(
        &self,
        count: u64,
        dtype: DataType,
        q: QuantSpec,
        algo: Choice<Algorithm>,
        lossless_allowed: bool,
    ) -> Result<Plan, Error> {
        let quant = self.plan_quant(count, dtype, q, algo)?;
        if self.cfg.quant_choice == QuantChoice::Always || !lossless_allowed {
            return Ok(quant);
        }
        let lossless = self.plan(Collective::AllReduce, count, dtype.bytes());
        let bytes = count * dtype.bytes();
        Ok(
            if plan::quant_pays(&self.model, &lossless, self.quant_model(q), &quant, bytes) {
                quant
            } else {
                lossless
            },
        )
    }

    /// The calibrated times of the quantized AllReduce with codec settings `q`, if measured.
    pub fn quant_model(&self, q: QuantSpec) -> Option<&QuantModel> {
        self.quant_models.iter().find(|m| m.spec == q)
    }

    /// The plan of a quantized AllGather, AllToAll or ReduceScatter of `count` values per block
    /// (one quantization step at `q.rs_bits`).
    pub fn plan_quant_op(
        &self,
        coll: Collective,
        count: u64,
        dtype: DataType,
        q: QuantSpec,
    ) -> Result<Plan, Error> {
        plan::plan_quant_op(&self.arena, coll, count, dtype, q, self.max_grid)
    }

    /// AllGather of `sendcount` f16 or bf16 elements with a quantized wire format (width
    /// `q.rs_bits`, one step): every rank's input is encoded once and every rank, its owner too,
    /// decodes every rank's bytes, so every rank holds the same values
    /// (`flashcomm_codec::reference::allgather_quant`). In place as NCCL's (the send buffer at
    /// rank x sendcount elements into the receive buffer) or out of place.
    pub fn all_gather_quant(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        sendcount: u64,
        dtype: DataType,
        q: QuantSpec,
        stream: Stream,
    ) -> Result<Plan, Error> {
        self.run_quant_op(
            Collective::AllGather,
            send,
            recv,
            sendcount,
            dtype,
            q,
            stream,
        )
    }

    /// AllToAll of `count` f16 or bf16 elements per peer with a quantized wire format (width
    /// `q.rs_bits`, one step): each per-peer block is encoded once, as a buffer of its own, and
    /// decoded by its receiver (`flashcomm_codec::reference::alltoall_quant`). In place or out
    /// of place.
    pub fn all_to_all_quant(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        q: QuantSpec,
        stream: Stream,
    ) -> Result<Plan, Error> {
        self.run_quant_op(Collective::AlltoAll, send, recv, count, dtype, q, stream)
    }

    /// Sum ReduceScatter of `recvcount` f16 or bf16 elements per rank with a quantized wire
    /// format (width `q.rs_bits`, one step): each shard is encoded once; its owner decodes the N
    /// encodings in rank order, sums them in f32 and rounds to the element type
    /// (`flashcomm_codec::reference::reducescatter_quant`).
    pub fn reduce_scatter_quant(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recvcount: u64,
        dtype: DataType,
        q: QuantSpec,
        stream: Stream,
    ) -> Result<Plan, Error> {
        self.run_quant_op(
            Collective::ReduceScatter,
            send,
            recv,
            recvcount,
            dtype,
            q,
            stream,
        )
    }

    /// Plans and runs one of the one-step quantized collectives.
    #[allow(clippy::too_many_arguments)]
    fn run_quant_op(
        &self,
        coll: Collective,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        q: QuantSpec,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let p = self.plan_quant_op(coll, count, dtype, q)?;
        self.run(&p, send, recv, count, dtype.bytes(), Some(dtype), stream)?;
        Ok(p)
    }

    /// Sum ReduceScatter: `recvcount` elements per rank.
    pub fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recvcount: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let p = self.plan(Collective::ReduceScatter, recvcount, dtype.bytes());
        self.run(
            &p,
            send,
            recv,
            recvcount,
            dtype.bytes(),
            Some(dtype),
            stream,
        )?;
        Ok(p)
    }

    /// AllGather of `sendcount` elements of `elem` bytes each (any datatype).
    pub fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        sendcount: u64,
        elem: u64,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let p = self.plan(Collective::AllGather, sendcount, elem);
        self.run(&p, send, recv, sendcount, elem, None, stream)?;
        Ok(p)
    }

    /// AllToAll of `count` elements of `elem` bytes per peer (any datatype): block q of `send`
    /// goes to rank q, block r of `recv` comes from rank r. In place (`send` = `recv`) or out of
    /// place, as NCCL lets each rank choose (see [`check_buffers`]).
    pub fn all_to_all(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let p = self.plan(Collective::AlltoAll, count, elem);
        self.run(&p, send, recv, count, elem, None, stream)?;
        Ok(p)
    }

    /// AllToAll whose blocks lie anywhere: `send[q]` (`count` elements of `elem` bytes) goes to
    /// rank q, `recv[r]` receives what rank r sent to this rank; blocks may overlap one another.
    /// What a group of `ncclSend`/`ncclRecv` with one buffer per peer is. The blocks are gathered
    /// into a scratch buffer of the communicator's device, exchanged by the AllToAll kernel, and
    /// scattered out: 2 x nranks device copies more than [`Communicator::all_to_all`], all on
    /// `stream`, ordered after the communicator's previous operation like a launch. The scratch
    /// (2 x nranks x count x elem bytes) is allocated at the first call that needs more than the
    /// last one and kept; under graph capture, where allocating is not allowed, a call that needs
    /// more is refused as [`Error::Unsupported`] (the caller sends it to NCCL, which every rank
    /// does alike: the scratch's size follows the calls, which are the same on every rank).
    pub fn all_to_all_scattered(
        &self,
        send: &[DevicePtr],
        recv: &[DevicePtr],
        count: u64,
        elem: u64,
        stream: Stream,
    ) -> Result<Plan, Error> {
        let n = self.nranks as usize;
        let block = count
            .checked_mul(elem)
            .ok_or_else(|| Error::InvalidArgument("AllToAll block size overflows".into()))?;
        if send.len() != n || recv.len() != n {
            return Err(Error::InvalidArgument(format!(
                "{} send and {} receive blocks for {n} ranks",
                send.len(),
                recv.len()
            )));
        }
        if send.iter().chain(recv).any(|b| b.len() < block) {
            return Err(Error::InvalidArgument(format!(
                "an AllToAll block is smaller than {block} bytes"
            )));
        }
        let p = self.plan(Collective::AlltoAll, count, elem);
        self.check_status()?;
        if block == 0 {
            return Ok(p);
        }
        let total = block
            .checked_mul(n as u64)
            .and_then(|t| usize::try_from(t.checked_mul(2)?).ok())
            .ok_or_else(|| Error::InvalidArgument("AllToAll size overflows".into()))?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let _ctx = self.device.activate()?;
        if scratch.last().is_none_or(|m| m.len() < total) {
            if stream.is_capturing()? {
                return Err(Error::Unsupported(format!(
                    "a scattered AllToAll of {total} bytes of scratch under graph capture, \
                     before any eager one of that size"
                )));
            }
            // Powers of two: the kept scratches add up to less than twice the largest.
            let bytes = total.checked_next_power_of_two().unwrap_or(total);
            scratch.push(DeviceMem::alloc_zeroed(&self.device, bytes)?);
        }
        let mem = scratch.last().expect("allocated above");
        let half = total / 2;
        let (s_in, s_out) = (mem.slice(0, half), mem.slice(half, half));
        let capturing = self.order_before(stream)?;
        for (q, b) in send.iter().enumerate() {
            mem.slice(q * block as usize, block as usize)
                .copy_from(*b, block, stream)?;
        }
        self.run(&p, s_in, s_out, count, elem, None, stream)?;
        for (r, b) in recv.iter().enumerate() {
            b.copy_from(
                mem.slice(half + r * block as usize, block as usize),
                block,
                stream,
            )?;
        }
        self.order_after(stream, capturing, false)?;
        Ok(p)
    }

    /// Runs a plan (from [`Communicator::plan`], possibly with the algorithm or protocol changed
    /// for testing; every rank must run the same plan).
    pub fn run(
        &self,
        p: &Plan,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        dtype: Option<DataType>,
        stream: Stream,
    ) -> Result<(), Error> {
        self.check_status()?;
        if count == 0 {
            return Ok(());
        }
        let n = self.nranks as u64;
        let (send_bytes, recv_bytes) = match p.coll {
            Collective::AllReduce => (count * elem, count * elem),
            Collective::ReduceScatter => (count * elem * n, count * elem),
            Collective::AllGather => (count * elem, count * elem * n),
            Collective::AlltoAll => (count * elem * n, count * elem * n),
            other => {
                return Err(Error::Unsupported(format!(
                    "{other}: not a collective of flashcomm's kernels"
                )));
            }
        };
        if send.len() < send_bytes || recv.len() < recv_bytes {
            return Err(Error::InvalidArgument(format!(
                "buffers of {} and {} bytes are too small for {send_bytes} and {recv_bytes}",
                send.len(),
                recv.len()
            )));
        }
        check_buffers(
            p.coll,
            (send.addr(), send_bytes),
            (recv.addr(), recv_bytes),
            u64::from(self.rank) * count * elem,
            if p.quant.is_some() { elem } else { 1 },
        )?;
        if p.coll.reduces() && dtype.is_none() {
            return Err(Error::InvalidArgument(
                "a reducing collective needs a datatype".into(),
            ));
        }
        if let Some(q) = p.quant {
            let has_kernels = match p.coll {
                Collective::AllReduce => q.has_kernels(),
                Collective::AllGather | Collective::AlltoAll | Collective::ReduceScatter => {
                    (2..=8).contains(&q.rs_bits)
                }
                _ => false,
            };
            if !has_kernels || dtype.is_none_or(|d| d == DataType::F32) {
                return Err(Error::Unsupported(
                    "quantized plan for an unsupported call".into(),
                ));
            }
            if p.coll == Collective::AllReduce
                && p.algo == Algorithm::TwoShot
                && count.div_ceil(plan::CODEC_BLOCK_VALUES) < n
            {
                return Err(Error::InvalidArgument(
                    "two-step quantized plan with an empty shard".into(),
                ));
            }
        } else if p.algo == Algorithm::TwoShot
            && (p.shard_elems == 0 || (n - 1) * p.shard_elems >= count)
        {
            return Err(Error::InvalidArgument(
                "two-shot plan with an empty shard".into(),
            ));
        }
        if self.nranks == 1 {
            // Nothing to exchange: every collective's result is the input (quantization never
            // applies). In place that is free; out of place it is one device copy.
            if send.addr() == recv.addr() {
                return Ok(());
            }
            let _ctx = self.device.activate()?;
            return Ok(recv.copy_from(send, recv_bytes, stream)?);
        }
        self.launch_plan(p, send, recv, count, elem, dtype, stream)
    }

    /// [`abi::FLAG_EARLY_LAUNCH`] for a lossless plan whose grid, doubled, still fits this rank's
    /// resident share (`max_grid`, the share of the GPU that keeps every co-located rank's blocks
    /// resident): the next kernel's blocks, launched early and waiting, then never keep a peer's
    /// blocks from being scheduled. (The quantized kernels' occupancy differs from the lossless
    /// ones' that `max_grid` was measured on, so they do not take it.)
    fn early_launch_flag(&self, p: &Plan) -> u32 {
        let fits = p.grid.saturating_mul(2) <= self.max_grid;
        if self.cfg.early_launch
            && fits
            && p.quant.is_none()
            && self.device.supports_overlapped_launch()
        {
            abi::FLAG_EARLY_LAUNCH
        } else {
            0
        }
    }

    /// Whether a direct PULL kernel must stage this rank's input rather than let its peers read
    /// it in place (rank-local: it changes the address this rank publishes, never the protocol
    /// its peers run): a send buffer that is not 16-byte aligned (peers load 16-byte vectors),
    /// and, one-shot, an input that overlaps the output (this rank writes its result while its
    /// peers may still be reading its input).
    fn direct_staging(p: &Plan, send: DevicePtr, recv: DevicePtr, bytes: u64) -> u32 {
        let overlaps = send.addr() < recv.addr() + bytes && recv.addr() < send.addr() + bytes;
        if !send.addr().is_multiple_of(16) || (p.algo == Algorithm::OneShot && overlaps) {
            abi::FLAG_PULL_STAGE_SEND
        } else {
            0
        }
    }

    /// The catalogue kernel of a plan: a few integer operations, no name and no lookup.
    fn kernel_for(p: &Plan, dtype: Option<DataType>) -> Result<Kernel<FcCollParams>, Error> {
        let (proto, algo) = (p.proto, p.algo);
        let quant_op = match p.coll {
            Collective::AllGather => Some(QuantOp::AllGather),
            Collective::AlltoAll => Some(QuantOp::AlltoAll),
            Collective::ReduceScatter => Some(QuantOp::ReduceScatter),
            _ => None,
        };
        let k = match (p.coll, dtype) {
            (_, Some(t)) if p.quant.is_some() && quant_op.is_some() => match (quant_op, p.quant) {
                (Some(op), Some(q)) => Kernel::quant_op(op, t, q.rs_bits),
                _ => None,
            },
            (Collective::AllGather, _) if p.quant.is_none() => Kernel::allgather(proto),
            (Collective::AlltoAll, _) if p.quant.is_none() => Kernel::alltoall(proto),
            (Collective::AllReduce, Some(t)) => match p.quant {
                Some(q) if algo == Algorithm::OneShot => Kernel::quant_oneshot(t, q.rs_bits),
                Some(q) => Kernel::quant_twostep(t, q.rs_bits, q.ag_bits),
                None => Some(Kernel::allreduce(algo, proto, t)),
            },
            (Collective::ReduceScatter, Some(t)) => Kernel::reducescatter(proto, t),
            _ => return Err(Error::InvalidArgument("missing datatype".into())),
        };
        k.ok_or_else(|| {
            Error::Unsupported(format!(
                "no {} kernel for this plan ({} protocol, codec {:?})",
                p.coll,
                proto.name(),
                p.quant
            ))
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_plan(
        &self,
        p: &Plan,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        dtype: Option<DataType>,
        stream: Stream,
    ) -> Result<(), Error> {
        let k = Self::kernel_for(p, dtype)?;
        let params = FcCollParams {
            send: send.addr(),
            recv: recv.addr(),
            count,
            peer_base: self.peers,
            epochs: self.local.addr() + abi::HDR_EPOCHS,
            abort_flag: self.host.dev_ptr() + HOST_ABORT as u64,
            status: self.host.dev_ptr() + HOST_STATUS as u64,
            timeout_ns: self.cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
            half_bytes: self.arena.half_bytes,
            region_bytes: self.arena.region_bytes,
            slot_bytes: self.arena.slot_bytes,
            sub_bytes: p.sub_bytes,
            chunk_bytes: p.chunk_bytes,
            shard_elems: p.shard_elems,
            rank: self.rank,
            nranks: self.nranks,
            elem_bytes: elem as u32,
            area_offset: self.arena.area_offset(p.proto),
            own_slots: self.own_slots.as_ref().map_or(0, |m| m.as_ptr().addr()),
            flags: call_signature(p, dtype) << abi::FLAG_SIG_SHIFT | self.early_launch_flag(p),
            ..Default::default()
        };
        let mut params = params;
        if p.proto == Protocol::Direct {
            params.flags |= Self::direct_staging(p, send, recv, count * elem);
        }
        let threads = p.threads;
        if let (Some(q), Some(d)) = (p.quant, dtype) {
            params.q_bits_rs = q.rs_bits as u32;
            params.q_bits_ag = q.ag_bits as u32;
            params.q_group = q.group as u32;
            params.q_spikes = q.spikes as u32;
            params.q_block_bytes_rs = q.format(d, q.rs_bits)?.block_bytes() as u32;
            params.q_block_bytes_ag = q.format(d, q.ag_bits)?.block_bytes() as u32;
        }
        let _ctx = self.device.activate()?;
        let capturing = self.order_before(stream)?;
        let cfg = LaunchConfig {
            grid: p.grid,
            block: threads,
            smem: 0,
        };
        let overlapped = self.device.supports_overlapped_launch();
        gpu::launch(&self.kernels, k, cfg, stream, &params, overlapped)?;
        self.order_after(stream, capturing, true)
    }

    /// Orders an operation of this communicator about to be enqueued on `stream` (either
    /// library's) after the communicator's previous ones, as NCCL orders all work of one
    /// communicator (docs/protocols.md, "Ordering"); returns whether `stream` is capturing.
    /// Eager: after the last eager operation when it went to another stream (and, with graph
    /// mixing once something was captured, always: a replay may have recorded the event since).
    /// Captured: the graph's own order applies; with graph mixing, the first operation of each
    /// capture also waits at each replay for the communicator's last eager operation (one
    /// event-wait node in the chain, before that operation only).
    fn order_before(&self, stream: Stream) -> Result<bool, Error> {
        let last = &self.last;
        let capturing = stream.is_capturing()?;
        if capturing {
            if self.cfg.graph_mixing {
                let (id, before) = stream.capture_point()?;
                let mut mark = self.capture_mark();
                if mark.record.as_ref().is_none_or(|r| r.id != id) {
                    last.event.wait_on_external(stream)?;
                    mark.before.clear();
                } else {
                    mark.before = before;
                }
            }
        } else if last.launched.load(Ordering::Acquire)
            && (last.stream.load(Ordering::Relaxed) != stream.0 as usize
                || last.captured.load(Ordering::Relaxed))
        {
            last.event.wait_on(stream)?;
        }
        Ok(capturing)
    }

    /// After an operation of this communicator was enqueued on `stream`: eager, it becomes the
    /// last operation (recorded); captured with graph mixing, it joins the capture's one
    /// event-record node, which sits beside the captured chain and records the communicator's
    /// event at each replay once every captured operation of the communicator has completed.
    /// `one_kernel`: the operation was a single kernel launched right after `order_before`, so
    /// it depends on what the capture's dependencies were then, and their edges to the record
    /// node can go (back-to-back captured calls leave it one incoming edge).
    fn order_after(&self, stream: Stream, capturing: bool, one_kernel: bool) -> Result<(), Error> {
        let last = &self.last;
        if capturing {
            if self.cfg.graph_mixing {
                let (id, _) = stream.capture_point()?;
                let mut guard = self.capture_mark();
                let mark = &mut *guard;
                let covered = if one_kernel {
                    std::mem::take(&mut mark.before)
                } else {
                    Vec::new()
                };
                match mark.record.as_mut() {
                    Some(r) if r.id == id => r.join(stream, &covered)?,
                    _ => mark.record = Some(last.event.record_beside(stream)?),
                }
                last.captured.store(true, Ordering::Relaxed);
                last.launched.store(true, Ordering::Release);
            }
            return Ok(());
        }
        last.event.record(stream)?;
        last.stream.store(stream.0 as usize, Ordering::Relaxed);
        last.launched.store(true, Ordering::Release);
        Ok(())
    }

    /// The graph-mixing record node of the capture in progress (a poisoned lock is taken over:
    /// the value is a plain record that a panic cannot leave half-written in a harmful way).
    fn capture_mark(&self) -> std::sync::MutexGuard<'_, CaptureMark> {
        self.last.capture.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Before another library's operation on this communicator (a collective forwarded to NCCL)
    /// is enqueued on `stream`: orders it after this communicator's previous operations as
    /// flashcomm's own launches are ordered (`order_before`), as NCCL orders all work of a
    /// communicator. Returns what to pass to [`Communicator::after_foreign`] once the operation
    /// was enqueued, or `None` when it is not to be recorded (captured without graph mixing,
    /// where the graph's own order applies).
    pub fn before_foreign(&self, stream: Stream) -> Result<Option<Foreign>, Error> {
        let _ctx = self.device.activate()?;
        let capturing = self.order_before(stream)?;
        Ok((!capturing || self.cfg.graph_mixing).then_some(Foreign { capturing }))
    }

    /// After another library's operation on this communicator was enqueued on `stream`: it is the
    /// communicator's last operation, which later operations of either library are ordered after.
    pub fn after_foreign(&self, stream: Stream, op: Foreign) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        self.order_after(stream, op.capturing, false)
    }

    /// The device-reported error, if a kernel of this communicator gave up.
    pub fn check_status(&self) -> Result<(), Error> {
        let mut code = self.host.read_u32(HOST_STATUS);
        if code == abi::status::OK {
            return Ok(());
        }
        // A kernel claimed the record and is filling it: give it a moment.
        for _ in 0..1000 {
            if code != abi::status::CLAIMED {
                break;
            }
            std::thread::sleep(Duration::from_micros(10));
            code = self.host.read_u32(HOST_STATUS);
        }
        let peer = self.host.read_u32(HOST_STATUS + 4);
        let seq = self.host.read_u64(HOST_STATUS + 16);
        if code == abi::status::TIMEOUT {
            return Err(Error::Timeout(format!(
                "rank {} waited longer than {:?} (FLASHCOMM_TIMEOUT_MS) for rank {peer} in \
                 collective #{seq}",
                self.rank, self.cfg.timeout
            )));
        }
        let what = match code {
            abi::status::ABORTED => format!(
                "rank {}: communicator aborted during collective #{seq}",
                self.rank
            ),
            abi::status::PEER_ABORTED => format!(
                "rank {}: a peer gave up during collective #{seq}",
                self.rank
            ),
            abi::status::MISMATCH => format!(
                "rank {}: rank {peer} ran a different collective than #{seq} (tag {:#x}): the ranks' call sequences differ",
                self.rank,
                self.host.read_u32(HOST_STATUS + 12)
            ),
            other => format!("rank {}: device status {other}", self.rank),
        };
        Err(Error::Remote(what))
    }

    /// Sets this rank's epoch (the sequence number of its next collective) to `seq`, so that a
    /// test can cross the epoch's wrap-around (docs/protocols.md, "Epochs") without four billion
    /// calls. Every rank must set the same value while no collective of the communicator runs.
    /// Only on a communicator that has run no collective yet: an epoch set below one already used
    /// would make lines left by the earlier calls look fresh again. `u32::MAX` is refused (the
    /// epoch never takes it: docs/protocols.md, "Epochs").
    #[doc(hidden)]
    pub fn set_epoch_for_testing(&self, seq: u32) -> Result<(), Error> {
        if seq == u32::MAX {
            return Err(Error::InvalidArgument(
                "the epoch never takes the value 0xffffffff".into(),
            ));
        }
        self.wait_idle()?;
        gpu::write_epoch_words(&self.device, self.local.addr() + abi::HDR_EPOCHS, seq)
    }

    /// Asks every running kernel of this communicator to stop (ncclCommAbort). Kernels leave
    /// their waits within microseconds; the communicator is unusable afterwards.
    pub fn abort(&self) {
        self.host.write_u32(HOST_ABORT, 1);
    }

    /// Whether [`Communicator::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.host.read_u32(HOST_ABORT) != 0
    }

    /// Waits until this communicator's last eager launch has finished (without a time limit,
    /// like NCCL's own destroy; see [`Communicator::wait_idle_for`]).
    pub fn wait_idle(&self) -> Result<(), Error> {
        if self.last.launched.load(Ordering::Acquire) {
            let _ctx = self.device.activate()?;
            self.last.event.synchronize()?;
        }
        Ok(())
    }

    /// Waits at most `limit` until this communicator's last eager launch has finished.
    /// `Ok(false)`: it had not (it may sit behind other work of its stream that does not finish,
    /// such as an NCCL operation waiting for a dead peer); the caller must then not free what the
    /// launch uses.
    pub fn wait_idle_for(&self, limit: Duration) -> Result<bool, Error> {
        if !self.last.launched.load(Ordering::Acquire) {
            return Ok(true);
        }
        let _ctx = self.device.activate()?;
        let start = std::time::Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if self.last.event.is_done()? {
                return Ok(true);
            }
            if start.elapsed() >= limit {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }
}

impl Communicator {
    /// From now on, dropping this communicator (wherever its last reference goes) never blocks:
    /// its memory goes to a thread of its own that waits for the last eager launch and then
    /// frees it (`ncclCommAbort` and `ncclCommDestroy`: freeing waits for the device's
    /// outstanding work, which after a fault may never end). The returned [`Release`] says when
    /// the memory was freed; a caller waits for it at most a bound. `keep_arena`: the arena is
    /// never freed (an abort with peers that may still write into it).
    pub fn defer_release(&self, keep_arena: bool) -> Release {
        let mut d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        let done = d.as_ref().map_or_else(release::pending, |d| d.done.clone());
        *d = Some(Deferred {
            done: done.clone(),
            keep_arena,
        });
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
        if let Some(d) = deferred {
            let remains = Remains {
                device: self.device.clone(),
                last: self.last.clone(),
                mappings: std::mem::take(&mut self.mappings),
                local: std::mem::replace(&mut self.local, LocalArena::Empty),
                keep_arena: d.keep_arena,
                own_slots: self.own_slots.take(),
                host: std::mem::replace(&mut self.host, HostMapped::empty()),
                scratch: std::mem::take(self.scratch.get_mut().unwrap_or_else(|e| e.into_inner())),
            };
            release::in_background(remains, d.done, &release::LIVE);
            return;
        }
        // The arena must outlive every kernel that uses it; peers' mappings are closed with this
        // device's context current. The arena itself and the host words are freed when the fields
        // drop right after (freeing needs no particular current context).
        let _ = self.wait_idle();
        if let Ok(_ctx) = self.device.activate() {
            self.mappings.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pid: u32, token: u64) -> PeerInfo {
        PeerInfo {
            pid,
            token,
            build: identity::Build::this().id(),
            host: host_id(),
            uuid: [7; 16],
            arena: 0x7f00_0000_0000,
            arena_bytes: 64 << 20,
            ipc: Some([3; 64]),
            max_grid: 132,
            transport: Transport::Host,
        }
    }

    /// Two processes of one machine in different PID namespaces (containers of one pod: same
    /// host name, same boot id) can have the same process id. Taken for one process, the peer's
    /// arena would be used at the address it has in the other process (memory of this process
    /// that is something else). The random process token tells them apart.
    #[test]
    fn equal_process_ids_of_different_processes_are_not_one_process() {
        let a = info(1, identity::process_token());
        let b = info(1, identity::process_token() ^ 0x5a5a);
        assert!(!a.same_process(&b), "pid 1 in two containers");
        assert!(a.same_process(&a.clone()));
        let back = PeerInfo::decode(&b.encode()).unwrap();
        assert_eq!(back, b, "the token and the build travel in the record");
        assert!(!a.same_process(&back));
        // Another machine with an equal pid and token is not this process either.
        let far = PeerInfo {
            host: a.host ^ 1,
            ..a.clone()
        };
        assert!(!a.same_process(&far));
    }

    /// `flashcommCommSetQuant` is per rank: ranks whose settings differ run one quantized
    /// collective in different wire formats. Their tags must differ so that the kernels report a
    /// mismatch rather than decode each other's bytes wrongly (before, the signature carried
    /// only "quantized", and every setting looked alike).
    #[test]
    fn quantized_signatures_differ_by_codec_settings() {
        let arena = Arena::new(4, 64 << 20).unwrap();
        let model = CostModel::default_for(4);
        let base = plan::plan(
            &arena,
            &model,
            Collective::AllReduce,
            1 << 16,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        let sig = |coll: Collective, q: QuantSpec, t: DataType| {
            let mut p = base;
            p.coll = coll;
            p.quant = Some(q);
            call_signature(&p, Some(t))
        };
        let spec = |rs, ag, group, spikes| QuantSpec::new(rs, ag, group, spikes).unwrap();
        let mut specs = Vec::new();
        for rs in 2..=8u8 {
            for ag in [rs, 8] {
                for group in [32, 64, 128, 256] {
                    for spikes in [0, 2, 4] {
                        specs.push(spec(rs, ag, group, spikes));
                    }
                }
            }
        }
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::AlltoAll,
        ] {
            for t in [DataType::F16, DataType::Bf16] {
                for a in &specs {
                    let sa = sig(coll, *a, t);
                    assert!((0x80..0x100).contains(&sa), "quantized: top bit, 8 bits");
                    for b in &specs {
                        let differ = [
                            a.rs_bits != b.rs_bits,
                            a.ag_bits != b.ag_bits,
                            a.group != b.group,
                            a.spikes != b.spikes,
                        ];
                        if differ.iter().filter(|d| **d).count() == 1 {
                            assert_ne!(sa, sig(coll, *b, t), "{coll:?} {t:?} {a:?} vs {b:?}");
                        }
                    }
                }
            }
        }
        // The collective and the datatype always show.
        let q = spec(4, 4, 128, 2);
        assert_ne!(
            sig(Collective::AllReduce, q, DataType::F16),
            sig(Collective::AllReduce, q, DataType::Bf16)
        );
        assert_ne!(
            sig(Collective::AllGather, q, DataType::F16),
            sig(Collective::AlltoAll, q, DataType::F16)
        );
        // Lossless signatures stay below the quantized ones.
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Broadcast,
        ] {
            let mut p = base;
            p.coll = coll;
            assert!(call_signature(&p, Some(DataType::F32)) < 0x80);
        }
    }

    #[test]
    fn overlapping_buffers_are_refused_unless_in_place() {
        const MB: u64 = 1 << 20;
        let base = 0x7f00_0000_0000u64;
        // Disjoint buffers, and NCCL's in-place layouts, pass.
        for (coll, send, recv, in_place) in [
            (Collective::AllReduce, (base, MB), (base + MB, MB), 0),
            (Collective::AllReduce, (base, MB), (base, MB), 0),
            // ReduceScatter of 4 ranks, rank 2: recv is the third quarter of send.
            (
                Collective::ReduceScatter,
                (base, 4 * MB),
                (base + 2 * MB, MB),
                2 * MB,
            ),
            // AllGather of 4 ranks, rank 3: send is the last quarter of recv.
            (
                Collective::AllGather,
                (base + 3 * MB, MB),
                (base, 4 * MB),
                3 * MB,
            ),
            (
                Collective::AllGather,
                (base + 4 * MB, MB),
                (base, 4 * MB),
                MB,
            ),
            // AllToAll of 4 ranks in place: one buffer, NCCL's layout (each rank may choose).
            (Collective::AlltoAll, (base, 4 * MB), (base, 4 * MB), 0),
        ] {
            assert_eq!(
                check_buffers(coll, send, recv, in_place, 1),
                Ok(()),
                "{coll:?} {send:?} {recv:?}"
            );
        }
        // Overlaps at any other offset race: refused with a message.
        for (coll, send, recv, in_place) in [
            (Collective::AllReduce, (base, MB), (base + 2, MB), 0),
            (Collective::AllReduce, (base + MB - 1, MB), (base, MB), 0),
            (
                Collective::ReduceScatter,
                (base, 4 * MB),
                (base + MB, MB),
                2 * MB,
            ),
            (
                Collective::ReduceScatter,
                (base, 4 * MB),
                (base, MB),
                2 * MB,
            ),
            (Collective::AllGather, (base, MB), (base, 4 * MB), 3 * MB),
            (
                Collective::AllGather,
                (base + 3 * MB + 8, MB),
                (base, 4 * MB),
                3 * MB,
            ),
            (Collective::AlltoAll, (base, 4 * MB), (base + MB, 4 * MB), 0),
        ] {
            let e = check_buffers(coll, send, recv, in_place, 1).unwrap_err();
            let Error::InvalidArgument(m) = e else {
                panic!("{e:?}")
            };
            assert!(m.contains("overlap") && m.contains("in place"), "{m}");
        }
    }

    #[test]
    fn quantized_calls_need_element_aligned_buffers() {
        let base = 0x7f00_0000_0000u64;
        assert_eq!(
            check_buffers(Collective::AllReduce, (base, 64), (base + 4096, 64), 0, 2),
            Ok(())
        );
        for (s, r) in [(base + 1, base + 4096), (base, base + 4097)] {
            let e = check_buffers(Collective::AllReduce, (s, 64), (r, 64), 0, 2).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("aligned")),
                "{e:?}"
            );
        }
        // The lossless kernels take any alignment.
        assert_eq!(
            check_buffers(
                Collective::AllReduce,
                (base + 1, 64),
                (base + 4097, 64),
                0,
                1
            ),
            Ok(())
        );
    }

    #[test]
    fn call_signatures_differ_by_collective_datatype_and_quantization_and_fit_8_bits() {
        use std::collections::HashSet;
        let arena = Arena::new(2, 64 << 20).unwrap();
        let model = CostModel::default_for(2);
        let mut seen = HashSet::new();
        for coll in [Collective::AllReduce, Collective::ReduceScatter] {
            for t in [DataType::F32, DataType::F16, DataType::Bf16] {
                let p = plan::plan(
                    &arena,
                    &model,
                    coll,
                    4096,
                    t.bytes(),
                    16,
                    Choice::Auto,
                    Choice::Auto,
                );
                let sig = call_signature(&p, Some(t));
                assert!(sig > 0 && sig < 256);
                assert!(seen.insert(sig), "{coll:?} {t:?}");
                // The quantized kernels take f16 and bf16 only (f32 is refused before a launch).
                if t == DataType::F32 {
                    continue;
                }
                let mut q = p;
                q.quant = Some(QuantSpec::new(4, 4, 128, 2).unwrap());
                assert!(
                    seen.insert(call_signature(&q, Some(t))),
                    "quantized {coll:?} {t:?}"
                );
            }
        }
        let p = plan::plan(
            &arena,
            &model,
            Collective::AllGather,
            4096,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        // An AllGather moves bytes: its datatype does not count.
        assert_eq!(
            call_signature(&p, None),
            call_signature(&p, Some(DataType::F16))
        );
        assert!(seen.insert(call_signature(&p, None)));
    }
}
