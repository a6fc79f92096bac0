//! Set-up and agreement between ranks: what each rank tells the others, the arenas mapped, the
//! probe, the transport chosen, and [`Communicator::new`] itself (the steps of the module's
//! documentation).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use flashcomm_kernels::{Kernel, Kernels, LaunchConfig};

use crate::abi::{self, FcProbeParams, MAX_RANKS, THREADS};
use crate::bootstrap::{Agreement, Bootstrap};
use crate::error::Error;
use crate::gpu::{self, Device, DeviceMem, Event, HostArena, HostMapped, OwnStream};
use crate::identity;
use crate::plan::{Algorithm, Arena, Choice, CostModel, DataType, HostCopy, Protocol};
use crate::register::{self, Registry};
use crate::release;
use crate::residency::Share;
use crate::trace::TRACE_WORDS;
use crate::transport::{self, LocalArena, PeerMapping, Transport};

use super::copy::CopyPath;
use super::{CaptureMark, CommConfig, Communicator, HOST_BYTES, LastLaunch};

const INFO_MAGIC: u32 = 0x4643_4f4d; // "FCOM"
const INFO_BYTES: usize = 184;
const PROBE_MAGIC: u32 = 0x5052_0000;

/// A local step's outcome as the verdict of the next round.
pub(super) fn verdict<T, E: std::fmt::Display>(r: Result<T, E>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
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
    /// The name of the rank's registration board ([`crate::register`]), when it made one.
    board: Option<[u8; transport::NAME_BYTES]>,
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
        v.push(transport::code(self.transport));
        v.resize(120, 0);
        v.extend_from_slice(&self.token.to_le_bytes());
        v.extend_from_slice(&self.build.to_le_bytes());
        v.push(self.board.is_some() as u8);
        v.extend_from_slice(&self.board.unwrap_or([0; transport::NAME_BYTES]));
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
        let mut board = [0u8; transport::NAME_BYTES];
        board.copy_from_slice(&b[137..137 + transport::NAME_BYTES]);
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
            transport: transport::from_code(b[117]).ok_or_else(|| {
                Error::Bootstrap("a peer's set-up record names no transport".into())
            })?,
            board: (b[136] != 0).then_some(board),
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
    trace: Option<DeviceMem>,
    host: Arc<HostMapped>,
    kernels: Arc<Kernels>,
    grid: u32,
    /// This rank's registration board (zero-copy on the peer transport), with its name.
    board: Option<(HostArena, [u8; transport::NAME_BYTES])>,
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
                        board: ls.board.as_ref().map(|b| b.1),
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
                trace,
                host,
                kernels,
                grid: my_grid,
                board,
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
            let (peers, mappings, colocated) =
                Self::map_peers(rank, &dev, &arena, &local, &info, &infos)?;
            // This communicator's level of the device's ledger (crate::residency): one for its
            // ranks of this process, keyed by the arena of the lowest of them.
            let key = infos
                .iter()
                .filter(|p| p.same_process(&info) && p.uuid == info.uuid)
                .map(|p| p.arena)
                .min()
                .unwrap_or(info.arena);
            let share = Share::take(dev.ordinal(), key);
            let grid = share
                .grid((my_grid / colocated).max(1))
                .min(arena.max_grid().max(1));
            if grid == 0 {
                return Err(Error::Unsupported(format!(
                    "{} other communicators of this process are live on device {}: the GPU \
                     keeps no more of this one's blocks resident beside theirs",
                    share.level(),
                    dev.ordinal()
                )));
            }
            Ok((
                (peers, mappings, grid, share),
                Self::registry(rank, &info, &infos, board),
            ))
        });
        ag.check(verdict(mapped.as_ref().map(|_| ())))?;
        // Every peer has mapped this rank's arena (and board): a shared segment's name can go.
        let mut local = local;
        local.peers_mapped();
        let (peers, mappings, my_grid, share, mut registry) = match mapped {
            Ok(((peers, mappings, grid, share), reg)) => (peers, mappings, grid, share, reg),
            Err(e) => return Err(Error::Internal(format!("failed set-up step passed: {e}"))),
        };
        registry.peers_mapped();
        // The direct PULL protocol loads peers' user buffers at the addresses they publish: only
        // where every rank is a thread of this process on this device (every device pointer of
        // a rank is then one of its peers'). The records are the same on every rank, so every
        // rank decides alike.
        // With zero-copy on (`FLASHCOMM_ZERO_COPY`), also between processes of one machine: a
        // rank whose buffer a peer of another process has not mapped (a registered buffer,
        // `crate::register`) stages it, rank-locally.
        // Another rank of this communicator is a thread of this process (on this device or
        // another): a free of device memory in this process while its kernels run can deadlock
        // it (the release gate, `crate::release`).
        let threads_here = all
            .iter()
            .filter(|b| PeerInfo::decode(b).is_ok_and(|p| p.pid == info.pid && p.host == info.host))
            .count()
            > 1;
        let mut arena = arena;
        arena.direct = transport == Transport::P2p
            && all.iter().all(|b| {
                PeerInfo::decode(b).is_ok_and(|p| {
                    (p.pid == info.pid && p.host == info.host && p.uuid == info.uuid)
                        || (cfg.zero_copy && p.host == info.host)
                })
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
        let event = injected(4).and_then(|()| {
            let copy = match local.host_arena() {
                Some(own) if arena.copy_offset != 0 => Some(CopyPath::new(
                    &dev,
                    &kernels,
                    nranks,
                    &peers,
                    arena.copy_offset,
                    own,
                )?),
                _ => None,
            };
            Ok((Event::new(false)?, copy))
        });
        let grids = ag.round(verdict(
            event.as_ref().map(|_| my_grid.to_le_bytes().to_vec()),
        ))?;
        let (event, copy) =
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
            trace,
            peers,
            mappings,
            registry,
            host,
            kernels,
            copy,
            max_grid,
            share: Some(share),
            model: CostModel::default_for(nranks),
            quant_models: Vec::new(),
            cfg: cfg.clone(),
            scratch: std::sync::Mutex::new(Vec::new()),
            deferred: std::sync::Mutex::new(None),
            zero_copy_calls: std::sync::atomic::AtomicU64::new(0),
            last: Arc::new(LastLaunch {
                device: dev.clone(),
                stream: AtomicUsize::new(0),
                launched: AtomicBool::new(false),
                captured: AtomicBool::new(false),
                event,
                launches: std::sync::atomic::AtomicU64::new(0),
                threads_here,
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
        let mut arena = Arena::with_pull(nranks, cfg.arena_bytes, cfg.pull_bytes)?;
        // The copy-engine schedule's area after it, which peers map with the rest.
        if transport == Transport::Host && cfg.host_copy != HostCopy::Off && nranks > 1 {
            arena = arena.with_copy_area(crate::plan::copy::area_bytes(nranks as usize) as u64);
        }
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
        let trace = cfg
            .phase_trace
            .then(|| DeviceMem::alloc_zeroed(&dev, TRACE_WORDS * 8))
            .transpose()?;
        let host = Arc::new(HostMapped::alloc(HOST_BYTES)?);
        // A board where peers of other processes find this rank's registered buffers: only for
        // zero-copy on the peer transport (the host transport's peers cannot read device memory).
        // A rank that cannot make one stages its buffers for such peers: no failure.
        let board = (cfg.zero_copy && transport == Transport::P2p && nranks > 1)
            .then(|| {
                let name = transport::segment_name();
                HostArena::create_shared(&name, register::BOARD_BYTES, dev.numa_node())
                    .map_err(|e| tracing::debug!("no registration board ({e}): buffers are staged"))
                    .ok()
                    .map(|b| {
                        let mut n = [0u8; transport::NAME_BYTES];
                        n[..name.len()].copy_from_slice(name.as_bytes());
                        (b, n)
                    })
            })
            .flatten();
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
            Kernel::reducescatter(Protocol::Direct, DataType::F32),
            Kernel::allgather(Protocol::Direct),
            Kernel::alltoall(Protocol::Pull),
        ] {
            per_sm = per_sm.min(kernels.get(k).max_active_blocks_per_sm(THREADS, 0)?);
        }
        // (The arena's own limit, a rank's geometry, is applied to the rank's share after the
        // exchange: applied here it would be divided among the co-located ranks too.)
        let grid = (per_sm.max(1) * dev.sm_count()).min(abi::MAX_BLOCKS);
        let grid = cfg.max_blocks.map_or(grid, |m| grid.min(m.max(1)));
        Ok(LocalSetup {
            dev,
            arena,
            local,
            own_slots,
            trace,
            host,
            kernels,
            grid,
            board,
        })
    }

    /// The registry of this rank: which ranks share its process, its board and its peers'
    /// boards (opened here, while their creators keep the names). A board that cannot be opened
    /// leaves that peer's registrations unacknowledged by this rank, which then stages for it:
    /// rank-local, no failure.
    fn registry(
        rank: u32,
        info: &PeerInfo,
        infos: &[PeerInfo],
        board: Option<(HostArena, [u8; transport::NAME_BYTES])>,
    ) -> Registry {
        let mut local = [false; MAX_RANKS];
        for (r, p) in infos.iter().enumerate() {
            local[r] = p.same_process(info);
        }
        let nranks = infos.len() as u32;
        let mut tokens = [0u64; MAX_RANKS];
        for (t, p) in tokens.iter_mut().zip(infos) {
            *t = p.token;
        }
        let Some((mut own, _)) = board else {
            return Registry::local_only(rank, nranks, local);
        };
        if local.iter().take(infos.len()).all(|&l| l) {
            own.unlink();
            return Registry::local_only(rank, nranks, local);
        }
        let boards = infos
            .iter()
            .enumerate()
            .map(|(r, p)| {
                let name = p.board.filter(|_| !local[r])?;
                let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
                let s = std::str::from_utf8(&name[..end]).ok()?;
                HostArena::open_shared(s, register::BOARD_BYTES)
                    .map_err(|e| tracing::debug!("rank {r}'s registration board: {e}"))
                    .ok()
            })
            .collect();
        Registry::with_boards(rank, nranks, local, tokens, own, boards)
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
            board: None,
        }
    }

    /// The registration board's name travels in the record (and its absence too).
    #[test]
    fn the_board_name_travels_in_the_record() {
        let mut a = info(5, 9);
        assert_eq!(PeerInfo::decode(&a.encode()).unwrap().board, None);
        let mut name = [0u8; transport::NAME_BYTES];
        name[..12].copy_from_slice(b"/flashcomm-x");
        a.board = Some(name);
        assert_eq!(a.encode().len(), INFO_BYTES);
        assert_eq!(PeerInfo::decode(&a.encode()).unwrap(), a);
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
}
