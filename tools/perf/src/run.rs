//! The GPU part: one thread per rank, each with its own flashcomm communicator (and NCCL
//! communicator), stream, buffers and events, running the same list of jobs in lockstep. In the
//! process modes each rank is a process of its own running one such thread ([`run_process`]);
//! the team barrier, the gathering of every rank's measurements at rank 0 and the exchange of
//! the buffers peers reach into (CUDA IPC handles, [`Team::share`]) then go through files in a
//! folder that the launcher creates ([`FileBootstrap`]).
//!
//! Rules that keep virtual ranks (several ranks on one GPU) from deadlocking, as in the GPU
//! tests: everything is allocated before the first collective; no rank touches the legacy
//! default stream; calls that might synchronize the device (graph instantiation and
//! destruction, uploads) happen only while every rank's stream is idle, between team barriers.
//! A rank that fails poisons the team barrier and aborts its communicator, so the others stop
//! instead of waiting.
//!
//! Timing (CUDA events on the rank's stream):
//! * eager: an event pair around each of the `-n` calls; a call's time is the slowest rank's
//!   (a collective is done when its last rank is); the row shows the median over the calls;
//! * graph: the `-n` calls captured into one CUDA graph, replayed `-G` times with an event pair
//!   around each replay; per-call time = replay time / n; the row shows the median over replays.
//!
//! Every job is preceded by `-w` eager warm-up calls (at least one under graphs, then one untimed
//! replay).

use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::Sender;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use flashcomm_codec::{Element, Format, bf16, f16};
use flashcomm_comm::gpu::{Event, HostArena, IpcMapping};
use flashcomm_comm::{
    Algorithm, Bootstrap, Choice, Collective, CommConfig, Communicator, DeviceMem, DevicePtr, Plan,
    QuantSpec, Request, Stream, ThreadGroup, Transport,
};
use flashcomm_testkit::FileBootstrap;
use flashcomm_testkit::pull_reference::{PullReference, Stages};
use flashcomm_testkit::reference::Reference;
use flashcomm_testkit::verify::{TestType, Verifier};
use serde::{Deserialize, Serialize};

use crate::accuracy::{self, AccuracyStats, OpShape, QuantAlgo, QuantOp};
use crate::args::{Dtype, Impl, Launch, Mode, Options, RefLaunch, Width};
use crate::ffi::{self, Nccl, NcclComm};
use crate::inputs;
use crate::report::{Measure, Outcome, PullRow, QuantInfo, Row, Variant};
use crate::sweep::{self, Shape, TimeStats};

/// One measurement to make (every rank runs the same list).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Job {
    /// Element type.
    pub dtype: Dtype,
    /// The call.
    pub shape: Shape,
    /// What to run.
    pub variant: Variant,
    /// Eager or graph.
    pub launch: Launch,
}

/// The jobs of a run, in order: per type, per size, per launch mode: the copy baseline (and the
/// link baselines), the reference kernels (per `--ref-launch`: the plain reference, the pull
/// reference's 1-stage and 2-stage), NCCL, flashcomm lossless, then each quantized width
/// (baselines and competitors first, so that ratios can be printed with each flashcomm row).
pub fn jobs(o: &Options) -> Vec<Job> {
    let sizes = sweep::sizes(o.min_bytes, o.max_bytes, o.step_factor, o.step_bytes);
    let mut out = Vec::new();
    for &dtype in &o.dtypes {
        for shape in sweep::shapes(o.coll, &sizes, dtype.bytes(), o.ranks) {
            for &launch in &o.launches {
                let mut variants = Vec::new();
                if o.copy_baseline {
                    variants.push(Variant::Copy);
                }
                if o.transport == Choice::Force(Transport::Host) {
                    variants.push(Variant::Link);
                    variants.push(Variant::LinkBoth);
                    variants.push(Variant::LinkRtt);
                }
                for &l in &o.ref_launches {
                    if o.impls.contains(&Impl::Reference) {
                        variants.push(Variant::Reference(l));
                    }
                    if o.impls.contains(&Impl::PullReference) {
                        variants.push(Variant::Pull(PullRow::OneStage, l));
                        variants.push(Variant::Pull(PullRow::TwoStage, l));
                    }
                }
                if o.impls.contains(&Impl::Nccl) {
                    variants.push(Variant::Nccl);
                }
                if o.impls.contains(&Impl::Flashcomm) {
                    variants.push(Variant::Lossless);
                    variants.extend(o.quant.iter().map(|&w| Variant::Quant(w)));
                }
                out.extend(variants.into_iter().map(|variant| Job {
                    dtype,
                    shape,
                    variant,
                    launch,
                }));
            }
        }
    }
    out
}

/// The devices of the ranks: all on `--device` (virtual, procs-one-gpu), or `--device`,
/// `--device + 1`, ... (gpus, procs).
pub fn devices(o: &Options) -> Vec<i32> {
    if o.mode.one_gpu() {
        vec![o.device; o.ranks as usize]
    } else {
        (0..o.ranks as i32).map(|r| o.device + r).collect()
    }
}

/// The seed of the random inputs of quantized calls of one type and size.
pub fn quant_seed(seed: u64, dtype: Dtype, count: u64) -> u64 {
    let t = match dtype {
        Dtype::Bf16 => 1u64,
        Dtype::F16 => 2,
        Dtype::F32 => 3,
    };
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ count.rotate_left(17) ^ (t << 58)
}

fn test_type(d: Dtype) -> TestType {
    match d {
        Dtype::Bf16 => TestType::Bf16,
        Dtype::F16 => TestType::F16,
        Dtype::F32 => TestType::F32,
    }
}

/// The `plan` column: `oneshot/ll/g16` for AllReduce, `ll/g16` for the others.
pub fn plan_label(p: &Plan) -> String {
    // Blocks of other than the usual 512 threads (small LL messages) show their size.
    let threads = if p.threads == 512 {
        String::new()
    } else {
        format!("x{}", p.threads)
    };
    if p.copy_engines {
        return "copy-engines".into();
    }
    match p.coll {
        Collective::AllReduce => {
            format!("{}/{}/g{}{threads}", p.algo.name(), p.proto.name(), p.grid)
        }
        _ => format!("{}/g{}{threads}", p.proto.name(), p.grid),
    }
}

/// The codec settings of a quantized row.
pub fn quant_info(dtype: Dtype, w: Width, group: u16, spikes: u8) -> Option<QuantInfo> {
    let f = |b| Format::new(dtype, b, group, spikes).ok();
    Some(QuantInfo {
        width: w,
        group,
        spikes,
        effbits_rs: f(w.rs)?.effective_bits(),
        effbits_ag: f(w.ag)?.effective_bits(),
    })
}

/// What one rank reports for one job.
#[derive(Clone, Debug, Default)]
struct RankOut {
    skipped: Option<String>,
    plan: Option<String>,
    out: Option<RankMeasure>,
    inplace: Option<Result<RankMeasure, String>>,
}

#[derive(Clone, Debug, Default)]
struct RankMeasure {
    times: Vec<f64>,
    wrong: Option<u64>,
    mismatch: Option<u64>,
    accuracy: Option<AccuracyStats>,
}

/// The team: a barrier that a failing rank can poison, the slots where ranks leave their
/// results, and rank 0's receive buffer for the bitwise comparison. In the process modes it
/// holds this process's rank only, and `link` carries the barrier and the results to the other
/// rank processes (a failing process exits; the launcher then stops the others).
struct Team {
    n: usize,
    timeout: Duration,
    state: Mutex<TeamState>,
    cv: Condvar,
    slots: Mutex<Vec<Option<RankOut>>>,
    recv0: Mutex<Option<DevicePtr>>,
    /// What every rank published with [`Team::publish`] (threads of one process only).
    published: Mutex<Vec<Vec<u64>>>,
    link: Option<FileBootstrap>,
}

struct TeamState {
    arrived: usize,
    generation: u64,
    failed: Option<String>,
}

impl Team {
    fn new(n: usize, timeout: Duration) -> Team {
        Team {
            n,
            timeout,
            state: Mutex::new(TeamState {
                arrived: 0,
                generation: 0,
                failed: None,
            }),
            cv: Condvar::new(),
            slots: Mutex::new(vec![None; n]),
            recv0: Mutex::new(None),
            published: Mutex::new(vec![Vec::new(); n]),
            link: None,
        }
    }

    /// The team of one rank process, meeting the others through `link`.
    fn process(link: FileBootstrap, timeout: Duration) -> Team {
        Team {
            link: Some(link),
            ..Team::new(1, timeout)
        }
    }

    /// All-gathers `mine` across the rank processes (process modes only).
    fn exchange(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let link = self.link.as_ref().ok_or("not a rank process")?;
        if let Some(f) = self.failed() {
            return Err(f);
        }
        link.all_gather(mine).map_err(|e| {
            let msg = format!("rank processes: {e}");
            self.fail(msg.clone());
            msg
        })
    }

    /// All-gathers `mine` across the ranks, threads of this process or rank processes: every
    /// rank's list, in rank order. Collective.
    fn gather(&self, rank: u32, mine: Vec<u64>) -> Result<Vec<Vec<u64>>, String> {
        if self.link.is_none() {
            return self.publish(rank, mine);
        }
        let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
        Ok(self
            .exchange(&bytes)?
            .iter()
            .map(|b| {
                b.chunks_exact(8)
                    .map(|c| c.try_into().map_or(0, u64::from_le_bytes))
                    .collect()
            })
            .collect())
    }

    /// Every rank's address of each of `mine`, this rank's device allocations (every rank passes
    /// the same kinds, in the same order): in rank order, each rank's list in the order of
    /// `mine`, this rank's being the allocations' own addresses. The threads of one process
    /// publish their addresses ([`Team::publish`]); rank processes exchange each allocation's
    /// legacy CUDA IPC handle and open their peers' in the current context (the rank's
    /// device's), into `maps`, which the caller keeps open until no rank uses the addresses any
    /// more and closes before any peer frees its allocations. A handle names a whole allocation
    /// and opens at its base: a [`DeviceMem`] is a whole `cuMemAlloc` allocation, so the mapped
    /// address is the peer's own address of it (a sub-allocation would need its offset too).
    /// Collective.
    fn share(
        &self,
        rank: u32,
        mine: &[&DeviceMem],
        maps: &mut Vec<IpcMapping>,
    ) -> Result<Vec<Vec<u64>>, String> {
        let all = if self.link.is_none() {
            self.publish(rank, mine.iter().map(|m| m.addr()).collect())?
        } else {
            let handles = mine.iter().try_fold(Vec::new(), |mut hs, m| {
                hs.extend_from_slice(&m.ipc_handle().map_err(e2s("exporting a buffer"))?);
                Ok::<_, String>(hs)
            });
            // Every rank takes part in the exchange, even one whose export failed, so that none
            // waits in vain.
            let theirs = self.exchange(handles.as_deref().unwrap_or(&[]))?;
            handles?;
            let mut all = Vec::with_capacity(theirs.len());
            for (r, hs) in theirs.iter().enumerate() {
                if r == rank as usize {
                    all.push(mine.iter().map(|m| m.addr()).collect());
                    continue;
                }
                let mut addrs = Vec::with_capacity(mine.len());
                for h in hs.chunks_exact(64) {
                    let h: &[u8; 64] = h.try_into().expect("chunks of 64 bytes");
                    let m = IpcMapping::open(h).map_err(e2s(&format!("rank {r}'s buffer")))?;
                    addrs.push(m.ptr());
                    maps.push(m);
                }
                all.push(addrs);
            }
            all
        };
        match all.iter().position(|v| v.len() != mine.len()) {
            Some(r) => Err(format!(
                "rank {r} shared {} buffers, not {}",
                all[r].len(),
                mine.len()
            )),
            None => Ok(all),
        }
    }

    /// All-gathers `mine` across the rank threads of this process: every rank's list, in rank
    /// order. Collective; the lists may be read only after every rank has published, and
    /// published again only after every rank has read.
    fn publish(&self, rank: u32, mine: Vec<u64>) -> Result<Vec<Vec<u64>>, String> {
        self.published.lock().unwrap_or_else(|e| e.into_inner())[rank as usize] = mine;
        self.wait()?;
        let all = self
            .published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        self.wait()?;
        Ok(all)
    }

    fn wait(&self) -> Result<(), String> {
        if self.link.is_some() {
            return self.exchange(&[]).map(|_| ());
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = &st.failed {
            return Err(f.clone());
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.n {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        while st.generation == generation {
            if let Some(f) = &st.failed {
                return Err(f.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let msg = format!("ranks did not meet within {:?}", self.timeout);
                st.failed = Some(msg.clone());
                self.cv.notify_all();
                return Err(msg);
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    fn fail(&self, msg: String) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.failed.is_none() {
            st.failed = Some(msg);
        }
        self.cv.notify_all();
    }

    fn failed(&self) -> Option<String> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failed
            .clone()
    }
}

/// Buffers and objects of one rank.
struct Rank<'a> {
    o: &'a Options,
    team: &'a Team,
    rank: u32,
    nranks: u32,
    comm: Option<Communicator>,
    nccl: Option<(&'a Nccl, NcclComm)>,
    reference: Option<Reference>,
    pull: Option<PullReference>,
    /// Rank 0's pinned host buffer of the link baseline (`--transport host`).
    link: Option<HostArena>,
    /// Rank 0's second stream and fork/join events of the link-both baseline.
    side: Option<SideStream>,
    /// Rank 0's flag words of the link-rtt baseline: two in pinned host memory, two in device
    /// memory (calls so far, failure).
    ping: Option<(HostArena, DeviceMem)>,
    v: Verifier,
    stream: Stream,
    send: DeviceMem,
    recv: DeviceMem,
    fp: Option<DeviceMem>,
    fp_for: Option<(Dtype, u64)>,
    starts: Vec<Event>,
    ends: Vec<Event>,
    can_compare: bool,
    threads: usize,
    /// Peers' buffers mapped from other rank processes ([`Team::share`]): closed once every
    /// rank has run every job, before any rank frees its own.
    maps: Vec<IpcMapping>,
}

/// A second stream of rank 0, forked from its stream and joined back by two events.
struct SideStream {
    stream: Stream,
    fork: Event,
    join: Event,
}

fn e2s<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The most bytes any job needs in each rank's send, receive and quantized-input buffers.
fn buffer_bytes(o: &Options, jobs: &[Job]) -> (u64, u64, u64) {
    let (mut s, mut r, mut q) = (0u64, 0u64, 0u64);
    for j in jobs {
        s = s.max(j.shape.send_bytes);
        r = r.max(j.shape.recv_bytes);
        if j.variant.is_baseline() {
            s = s.max(j.shape.bytes);
            r = r.max(j.shape.bytes);
        }
        if o.inplace {
            r = r.max(j.shape.bytes);
        }
        if matches!(j.variant, Variant::Quant(_)) {
            q = q.max(j.shape.send_bytes);
        }
    }
    (s + 64, r + 64, q)
}

/// Runs every job, calling `on_row` on this thread with each row as soon as every rank has
/// finished it. Returns the first failure.
pub fn run(
    o: &Options,
    nccl: Option<&Nccl>,
    nccl_comms: Vec<NcclComm>,
    on_row: &mut dyn FnMut(Row),
) -> Result<(), String> {
    let (rows, rx) = std::sync::mpsc::channel::<Row>();
    let jobs = jobs(o);
    let devs = devices(o);
    let n = o.ranks as usize;
    let setup_timeout = Duration::from_secs(o.timeout_s + 300);
    let group = ThreadGroup::new(o.ranks, setup_timeout);
    let members = group.members();
    let team = Team::new(n, Duration::from_secs(4 * o.timeout_s + 900));
    let mut comms: Vec<Option<NcclComm>> = nccl_comms.into_iter().map(Some).collect();
    comms.resize_with(n, || None);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(r, (boot, nc))| {
                let (jobs, team, rows, dev) = (&jobs, &team, rows.clone(), devs[r]);
                let nccl = nccl.zip(nc);
                let nccl = NcclSetup::Ready(nccl);
                s.spawn(move || {
                    guarded(r as u32, team, || {
                        rank_main(o, jobs, team, boot, dev, nccl, (r == 0).then_some(rows))
                    })
                })
            })
            .collect();
        drop(rows);
        for row in rx.iter() {
            on_row(row);
        }
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank thread died".into())))
            .collect()
    });
    // Report the root cause: the first failure recorded, else any rank's error.
    if let Some(f) = team.failed() {
        return Err(f);
    }
    results.into_iter().collect()
}

/// Runs one rank's `body`, turning a panic into an error; either poisons the team.
fn guarded(
    rank: u32,
    team: &Team,
    body: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let res = std::panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        Err(format!("rank {rank} panicked: {msg}"))
    });
    if let Err(e) = &res {
        team.fail(e.clone());
    }
    res
}

/// Where a rank's NCCL communicator comes from.
enum NcclSetup<'a> {
    /// Made beforehand (`ncclCommInitAll` for the threads of this process), or none.
    Ready(Option<(&'a Nccl, NcclComm)>),
    /// Made by the rank process itself (`ncclCommInitRank`, rank 0's id sent to the others).
    PerProcess(&'a Nccl),
}

/// Rank `rank` of a process mode, this process's only rank: exchanges through files in `dir`
/// (which every rank process of the run names), and calls `on_row` with each row at rank 0.
pub fn run_process(
    o: &Options,
    rank: u32,
    dir: &std::path::Path,
    nccl: Option<&Nccl>,
    on_row: &mut dyn FnMut(Row),
) -> Result<(), String> {
    let jobs = jobs(o);
    let device = devices(o)[rank as usize];
    let setup_timeout = Duration::from_secs(o.timeout_s + 300);
    let team_timeout = Duration::from_secs(4 * o.timeout_s + 900);
    let boot = FileBootstrap::new(&dir.join("comm"), rank, o.ranks, setup_timeout)
        .map_err(|e| e.to_string())?;
    let link = FileBootstrap::new(&dir.join("team"), rank, o.ranks, team_timeout)
        .map_err(|e| e.to_string())?;
    let team = Team::process(link, team_timeout);
    let (rows, rx) = std::sync::mpsc::channel::<Row>();
    let nccl = nccl.map_or(NcclSetup::Ready(None), NcclSetup::PerProcess);
    let result = std::thread::scope(|s| {
        let (jobs, team) = (&jobs, &team);
        let rows = (rank == 0).then_some(rows);
        let h = s.spawn(move || {
            guarded(rank, team, || {
                rank_main(o, jobs, team, &boot, device, nccl, rows)
            })
        });
        for row in rx.iter() {
            on_row(row);
        }
        h.join().unwrap_or_else(|_| Err("rank thread died".into()))
    });
    if let Some(f) = team.failed() {
        return Err(f);
    }
    result
}

/// The codec settings of the run's quantized AllReduce rows that have kernels (each once, in
/// the order of `--quant`): what the communicator's calibration times, as the library's does for
/// the environment's settings.
fn allreduce_quant_specs(o: &Options) -> Vec<QuantSpec> {
    let mut specs = Vec::new();
    if o.coll != Collective::AllReduce {
        return specs;
    }
    for w in &o.quant {
        if let Ok(q) = QuantSpec::new(w.rs, w.ag, o.group, o.spikes)
            && q.has_kernels()
            && !specs.contains(&q)
        {
            specs.push(q);
        }
    }
    specs
}

fn rank_main(
    o: &Options,
    jobs: &[Job],
    team: &Team,
    boot: &dyn Bootstrap,
    device: i32,
    nccl: NcclSetup<'_>,
    rows: Option<Sender<Row>>,
) -> Result<(), String> {
    let rank = boot.rank();
    let cfg = CommConfig {
        timeout: Duration::from_secs(o.timeout_s),
        algo: o.algo,
        proto: o.proto,
        transport: o.transport,
        calibrate: o.calibrate,
        calibrate_moves: o.calibrate_moves,
        zero_copy: o.zero_copy,
        host_copy: o.host_copy,
        arena_bytes: o.arena_bytes,
        pull_bytes: o.pull_bytes,
        quant_calibrate: allreduce_quant_specs(o),
        quant_choice: o.quant_choice,
        early_launch: o.early_launch,
        graph_mixing: o.graph_mixing,
        phase_trace: o.phase_trace,
        ..CommConfig::default()
    };
    let comm = if o.impls.contains(&Impl::Flashcomm) {
        let began = Instant::now();
        let c = Communicator::new(boot, device, cfg)
            .map_err(e2s(&format!("rank {rank}: flashcomm communicator set-up")))?;
        if rank == 0 {
            // Set-up time is part of what a user waits for (calibration included).
            eprintln!(
                "# flashcomm communicator set-up: {} ms on rank 0 (calibration {})",
                began.elapsed().as_millis(),
                if o.calibrate { "included" } else { "off" }
            );
        }
        Some(c)
    } else {
        None
    };
    let v = Verifier::new(device).map_err(e2s(&format!("rank {rank}: device {device}")))?;
    // Streams, events, copies and graphs of this thread use this device's context.
    let _ctx = v.activate().map_err(e2s("activating the context"))?;
    let nccl = match nccl {
        NcclSetup::Ready(n) => n,
        NcclSetup::PerProcess(lib) => {
            // Every rank takes part in the exchange, even one whose id failed, so that none waits
            // in vain; rank 0's id goes to all (NCCL then uses this thread's current device).
            let id = if rank == 0 {
                lib.unique_id()
            } else {
                Ok(Vec::new())
            };
            let all = team.exchange(id.as_deref().unwrap_or(&[]))?;
            id?;
            let comm = lib.init_rank(boot.size(), &all[0], rank)?;
            Some((lib, comm))
        }
    };
    // The link baseline's pinned host buffer: rank 0 alone times it.
    let link = if o.transport == Choice::Force(Transport::Host) && rank == 0 {
        let bytes = jobs
            .iter()
            .filter(|j| matches!(j.variant, Variant::Link | Variant::LinkBoth))
            .map(|j| j.shape.bytes)
            .max()
            .unwrap_or(0);
        // Two halves: link-both copies into one while it copies out of the other.
        let bytes = bytes * 2;
        Some(
            HostArena::alloc(bytes as usize)
                .map_err(e2s("allocating the link baseline's host buffer"))?,
        )
    } else {
        None
    };
    let reference_grid = jobs
        .iter()
        .any(|j| j.variant == Variant::Reference(RefLaunch::Single));
    // Peers' buffers that this rank's kernels reach into, mapped from other rank processes:
    // open until every rank has run every job.
    let mut maps = Vec::new();
    // The reference kernels: set up (it allocates) before any collective runs; every rank takes
    // every peer's inbox (and, for one grid, epochs).
    let mut reference = if o.impls.contains(&Impl::Reference) {
        let max = jobs
            .iter()
            .filter(|j| matches!(j.variant, Variant::Reference(_)))
            .map(|j| j.shape.bytes)
            .max()
            .unwrap_or(0);
        let mut rf = Reference::new(&devices(o), rank, max, Duration::from_secs(o.timeout_s))
            .map_err(e2s(&format!("rank {rank}: reference set-up")))?;
        let all = team.share(rank, &rf.allocations(), &mut maps)?;
        rf.set_peers(&column(&all, 0)).map_err(|e| e.to_string())?;
        rf.set_grid_peers(&column(&all, 1))
            .map_err(|e| e.to_string())?;
        Some(rf)
    } else {
        None
    };
    // The pull reference: set up (it allocates) before any collective runs; every rank takes
    // every peer's signal area, scratch and epochs.
    let mut pull = if o.impls.contains(&Impl::PullReference) {
        let max = jobs
            .iter()
            .filter(|j| matches!(j.variant, Variant::Pull(..)))
            .map(|j| j.shape.bytes)
            .max()
            .unwrap_or(0);
        let mut p = PullReference::new(&devices(o), rank, max, Duration::from_secs(o.timeout_s))
            .map_err(e2s(&format!("rank {rank}: pull reference set-up")))?;
        let all = team.share(rank, &p.allocations(), &mut maps)?;
        let peers: Vec<[u64; 3]> = all.iter().map(|v| [v[0], v[1], v[2]]).collect();
        p.set_peers(&peers).map_err(|e| e.to_string())?;
        Some(p)
    } else {
        None
    };
    let stream = v.stream().map_err(e2s("stream"))?;
    let (sb, rb, qb) = buffer_bytes(o, jobs);
    let alloc = |b: u64| {
        v.alloc(b as usize)
            .map_err(e2s(&format!("rank {rank}: allocating {b} bytes")))
    };
    let send = alloc(sb)?;
    let recv = alloc(rb)?;
    // Every rank's send and receive buffers, while every rank is idle: kernels that reach into
    // peers' buffers (the pull reference; the one-grid reference, which runs every rank's part)
    // register them, and every rank compares its output with rank 0's.
    let bufs = team.share(rank, &[&send, &recv], &mut maps)?;
    if pull.is_some() || reference_grid {
        for (k, buf) in [send.as_ptr(), recv.as_ptr()].into_iter().enumerate() {
            let addrs = column(&bufs, k);
            if let Some(p) = pull.as_mut() {
                p.register(buf, &addrs)
                    .map_err(e2s(&format!("rank {rank}: registering buffers")))?;
            }
            if let (Some(r), true) = (reference.as_mut(), reference_grid) {
                r.register(buf, &addrs)
                    .map_err(e2s(&format!("rank {rank}: registering buffers")))?;
            }
        }
    }
    // `--register`: the buffers registered with the communicator, collectively (every rank is
    // here), as a serving stack registers a window.
    if let (Some(c), true) = (comm.as_ref(), o.register) {
        for b in [&send, &recv] {
            let (_, mapped) = c
                .register_collective(b.addr(), b.len() as u64, Duration::from_secs(30))
                .map_err(e2s(&format!("rank {rank}: registering buffers")))?;
            if !mapped && c.serves_registered_buffers() {
                eprintln!("# rank {rank}: not every peer mapped the registered buffers in time");
            }
        }
    }
    let fp = if qb > 0 { Some(alloc(qb)?) } else { None };
    let nev = o.iters.max(o.graph_replays).max(1) as usize;
    let mut starts = Vec::with_capacity(nev);
    let mut ends = Vec::with_capacity(nev);
    for _ in 0..nev {
        starts.push(Event::new(true).map_err(e2s("creating events"))?);
        ends.push(Event::new(true).map_err(e2s("creating events"))?);
    }
    // Rank 0's output for the bitwise comparison: shared memory among threads, its CUDA IPC
    // mapping among processes (opened with peer access when the GPUs differ).
    let recv0 = if rank == 0 {
        Some(recv.as_ptr())
    } else {
        maps.iter()
            .find(|m| m.ptr() == bufs[0][1])
            .map(|m| ffi::peer_range(m, rb))
    };
    if let Some(p) = recv0 {
        *team.recv0.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .max(1);
    let can_compare = o.mode == Mode::Virtual || team.link.is_some() || comm.is_some();
    let side = match &link {
        Some(_) => Some(SideStream {
            stream: Stream::create().map_err(e2s("creating the link baseline's second stream"))?,
            fork: Event::new(false).map_err(e2s("creating events"))?,
            join: Event::new(false).map_err(e2s("creating events"))?,
        }),
        None => None,
    };
    let ping = match &link {
        Some(_) => Some((
            HostArena::alloc(64).map_err(e2s("allocating the link round trip's host words"))?,
            v.alloc(8)
                .map_err(e2s("allocating the link round trip's state"))?,
        )),
        None => None,
    };
    let mut r = Rank {
        o,
        team,
        rank,
        nranks: boot.size(),
        comm,
        nccl,
        reference,
        pull,
        link,
        side,
        ping,
        v,
        stream,
        send,
        recv,
        fp,
        fp_for: None,
        starts,
        ends,
        can_compare,
        threads,
        maps,
    };
    let mut result = r.jobs(jobs, rows);
    if team.link.is_some() && result.is_ok() {
        // Every rank's kernels are over (each job ends synchronized, then the team meets);
        // a rank frees its buffers only after every peer has closed its mappings of them.
        drop(std::mem::take(&mut r.maps));
        result = team.wait();
    }
    if let Err(e) = &result {
        team.fail(e.clone());
        if let Some(c) = &r.comm {
            c.abort();
        }
    }
    let _ = r.stream.synchronize();
    if let (Some(c), true) = (&r.comm, o.zero_copy)
        && r.rank == 0
    {
        eprintln!(
            "# flashcomm zero-copy: {} calls on rank 0 read by peers of other processes in place",
            c.zero_copy_calls()
        );
    }
    // After a failure NCCL's kernels may still wait for a peer that stopped; destroying the
    // communicator could then block, so it is left to the end of the process.
    if let Some((lib, nc)) = r.nccl.take()
        && result.is_ok()
    {
        lib.destroy(nc)?;
    }
    result
}

impl Rank<'_> {
    fn barrier(&self) -> Result<(), String> {
        self.team.wait()
    }

    fn sync(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(e2s("stream"))?;
        if let Some(c) = &self.comm {
            c.check_status().map_err(|e| e.to_string())?;
        }
        if let Some(r) = &self.reference
            && r.failed(self.stream).map_err(e2s("reference status"))?
        {
            return Err(format!(
                "rank {}: the reference kernel timed out waiting for a peer",
                self.rank
            ));
        }
        if let Some(p) = &self.pull
            && p.failed(self.stream)
                .map_err(e2s("pull reference status"))?
        {
            return Err(format!(
                "rank {}: the pull reference kernel timed out waiting for a peer",
                self.rank
            ));
        }
        Ok(())
    }

    fn jobs(&mut self, jobs: &[Job], rows: Option<Sender<Row>>) -> Result<(), String> {
        self.barrier()?;
        for (i, job) in jobs.iter().enumerate() {
            self.barrier()?;
            let out = self.job(job, i as u32 + 1)?;
            let gathered = if self.team.link.is_some() {
                let all = self.team.exchange(&wire(&out)?)?;
                let mut outs = Vec::with_capacity(all.len());
                for (r, bytes) in all.iter().enumerate() {
                    outs.push(if r == self.rank as usize {
                        out.clone()
                    } else {
                        unwire(bytes).map_err(|e| format!("rank {r}'s results: {e}"))?
                    });
                }
                Some(outs)
            } else {
                self.team.slots.lock().unwrap_or_else(|e| e.into_inner())[self.rank as usize] =
                    Some(out);
                self.barrier()?;
                None
            };
            if let Some(tx) = &rows {
                let outs: Vec<RankOut> = match gathered {
                    Some(outs) => outs,
                    None => self
                        .team
                        .slots
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .iter_mut()
                        .map(|s| s.take().unwrap_or_default())
                        .collect(),
                };
                let row = merge(self.o, job, &outs);
                // The receiver only goes away when the main thread is gone.
                let _ = tx.send(row);
            }
        }
        self.barrier()
    }

    fn job(&mut self, job: &Job, salt: u32) -> Result<RankOut, String> {
        match job.variant {
            Variant::Copy => self.copy_job(job),
            Variant::Link => self.link_job(job),
            Variant::LinkBoth => self.link_both_job(job),
            Variant::LinkRtt => self.link_rtt_job(job),
            Variant::Nccl | Variant::Lossless | Variant::Reference(_) | Variant::Pull(..) => {
                self.lossless_job(job, salt)
            }
            Variant::Quant(w) => self.quant_job(job, w, salt),
        }
    }

    /// Times `call` as the module documentation says; returns per-call microseconds of this rank.
    /// A rank that is not `active` (one grid for every rank, launched by rank 0) issues nothing
    /// and times nothing, but meets the others at the same barriers.
    fn time_calls(
        &self,
        launch: Launch,
        collective: bool,
        active: bool,
        call: &dyn Fn(Stream) -> Result<(), String>,
    ) -> Result<Vec<f64>, String> {
        if !active {
            if launch == Launch::Graph && collective {
                // Before the capture, before the first replay, after the replays.
                for _ in 0..3 {
                    self.barrier()?;
                }
            }
            return Ok(Vec::new());
        }
        let s = self.stream;
        let ev = |r: Result<(), flashcomm_comm::gpu::Error>| r.map_err(e2s("timing event"));
        // Under graphs at least one eager call comes first, so that one-time set-up (module
        // loading, NCCL's connections) never happens inside a capture.
        let warmup = match launch {
            Launch::Eager => self.o.warmup,
            Launch::Graph => self.o.warmup.max(1),
        };
        for _ in 0..warmup {
            call(s)?;
        }
        let n = self.o.iters as usize;
        match launch {
            Launch::Eager => {
                for i in 0..n {
                    ev(self.starts[i].record(s))?;
                    call(s)?;
                    ev(self.ends[i].record(s))?;
                }
                self.sync()?;
                (0..n)
                    .map(|i| {
                        self.ends[i]
                            .elapsed_ms_since(&self.starts[i])
                            .map(|ms| f64::from(ms) * 1e3)
                            .map_err(e2s("reading event times"))
                    })
                    .collect()
            }
            Launch::Graph => {
                self.sync()?;
                if collective {
                    self.barrier()?;
                }
                s.begin_capture().map_err(e2s("beginning graph capture"))?;
                let mut captured = Ok(());
                for _ in 0..n {
                    if let Err(e) = call(s) {
                        captured = Err(e);
                        break;
                    }
                }
                let graph = s.end_capture();
                captured?;
                let graph = graph.map_err(e2s("capturing the calls into a graph"))?;
                if collective {
                    self.barrier()?;
                }
                graph.launch(s).map_err(e2s("graph launch"))?;
                let g = self.o.graph_replays as usize;
                for j in 0..g {
                    ev(self.starts[j].record(s))?;
                    graph.launch(s).map_err(e2s("graph launch"))?;
                    ev(self.ends[j].record(s))?;
                }
                self.sync()?;
                let times = (0..g)
                    .map(|j| {
                        self.ends[j]
                            .elapsed_ms_since(&self.starts[j])
                            .map(|ms| f64::from(ms) * 1e3 / n as f64)
                            .map_err(e2s("reading event times"))
                    })
                    .collect();
                // Every rank's replays are over before any graph is destroyed.
                if collective {
                    self.barrier()?;
                }
                drop(graph);
                times
            }
        }
    }

    /// The host link's time for the job's bytes: rank 0 copies them into pinned host memory and
    /// back with the copy engine (one direction, then the other: the two PCIe crossings of every
    /// byte the host transport moves).
    fn link_job(&self, job: &Job) -> Result<RankOut, String> {
        let Some(host) = &self.link else {
            return Ok(RankOut::default());
        };
        let via = ffi::host_range(host);
        self.baseline_job(job, &|src, dst, b, s| {
            via.copy_from(src, b, s)?;
            dst.copy_from(via, b, s)
        })
    }

    /// The host link busy both ways: rank 0 copies the job's bytes into one half of pinned host
    /// memory on its stream while a second stream copies as many out of the other half, forked
    /// from and joined back into its stream with events (the same in a graph capture).
    fn link_both_job(&self, job: &Job) -> Result<RankOut, String> {
        let (Some(host), Some(side)) = (&self.link, &self.side) else {
            return Ok(RankOut::default());
        };
        let b = job.shape.bytes;
        let (into, out_of) = (ffi::host_part(host, 0, b), ffi::host_part(host, b, b));
        self.baseline_job(job, &|src, dst, b, s| {
            side.fork.record(s)?;
            side.fork.wait_on(side.stream)?;
            into.copy_from(src, b, s)?;
            dst.copy_from(out_of, b, side.stream)?;
            side.join.record(side.stream)?;
            side.join.wait_on(s)
        })
    }

    /// The host link's round trip: rank 0 bounces a flag through pinned host memory between two
    /// blocks of its GPU (one kernel per call, whatever the size); a wait that gave up fails the
    /// job.
    fn link_rtt_job(&self, job: &Job) -> Result<RankOut, String> {
        let Some((host, state)) = &self.ping else {
            return Ok(RankOut::default());
        };
        let timeout = Duration::from_secs(self.o.timeout_s);
        let out = self.baseline_job(job, &|_, _, _, s| {
            self.v
                .ping_pong(ffi::host_range(host), state.as_ptr(), timeout, s)
                .map_err(|e| flashcomm_comm::gpu::Error::Cuda {
                    during: "running the link round trip",
                    detail: e.to_string(),
                })
        })?;
        let mut words = [0u8; 8];
        state
            .download(0, &mut words, self.stream)
            .and_then(|()| self.stream.synchronize())
            .map_err(e2s("reading the link round trip's state"))?;
        if words[4..8] != [0; 4] {
            return Err("link-rtt: a flag wait through host memory gave up (--timeout)".into());
        }
        Ok(out)
    }

    /// The copy baseline: rank 0 copies the job's bytes on its GPU.
    fn copy_job(&self, job: &Job) -> Result<RankOut, String> {
        self.baseline_job(job, &|src, dst, b, s| dst.copy_from(src, b, s))
    }

    /// A baseline that rank 0 alone times: `copy(src, dst, bytes, stream)` over the job's bytes
    /// of its send and receive buffers.
    #[allow(clippy::type_complexity)]
    fn baseline_job(
        &self,
        job: &Job,
        copy: &dyn Fn(DevicePtr, DevicePtr, u64, Stream) -> Result<(), flashcomm_comm::gpu::Error>,
    ) -> Result<RankOut, String> {
        if self.rank != 0 {
            return Ok(RankOut::default());
        }
        let b = job.shape.bytes;
        let (src, dst) = (
            self.send.slice(0, b as usize),
            self.recv.slice(0, b as usize),
        );
        let call = |s: Stream| copy(src, dst, b, s).map_err(e2s("baseline copy"));
        let times = self.time_calls(job.launch, false, true, &call)?;
        Ok(RankOut {
            out: Some(RankMeasure {
                times,
                ..RankMeasure::default()
            }),
            ..RankOut::default()
        })
    }

    /// Issues one lossless call (flashcomm or NCCL) from `send` into `recv`.
    fn lossless_call(
        &self,
        job: &Job,
        req: Option<&(Plan, Request<'static>)>,
        send: DevicePtr,
        recv: DevicePtr,
        s: Stream,
    ) -> Result<(), String> {
        let sh = &job.shape;
        let elem = job.dtype.bytes();
        match (job.variant, req, &self.comm, &self.nccl) {
            (Variant::Lossless | Variant::Quant(_), Some((p, r)), Some(c), _) => c
                .execute_plan(*p, &r.between(send, recv).on(s))
                .map(|_| ())
                .map_err(|e| e.to_string()),
            (Variant::Reference(l), _, _, _) => match (&self.reference, self.o.coll, l) {
                (Some(r), Collective::AlltoAll, _) => r
                    .all_to_all(send, recv, sh.call_count, elem, s)
                    .map_err(|e| e.to_string()),
                (Some(r), _, RefLaunch::PerRank) => r
                    .all_reduce(send, recv, sh.call_count, job.dtype, s)
                    .map_err(|e| e.to_string()),
                // One grid for every rank: rank 0 launches it, the others issue nothing.
                (Some(_), _, RefLaunch::Single) if self.rank != 0 => Ok(()),
                (Some(r), _, RefLaunch::Single) => r
                    .all_reduce_grid(send, recv, sh.call_count, job.dtype, s)
                    .map_err(|e| e.to_string()),
                (None, _, _) => Err("the reference is not set up on this rank".into()),
            },
            (Variant::Pull(row, l), _, _, _) => {
                let stages = pull_stages(row).ok_or("pull-best is derived, not run")?;
                match (&self.pull, l) {
                    (Some(p), RefLaunch::PerRank) => p
                        .all_reduce(stages, send, recv, sh.call_count, job.dtype, s)
                        .map_err(|e| e.to_string()),
                    (Some(_), RefLaunch::Single) if self.rank != 0 => Ok(()),
                    (Some(p), RefLaunch::Single) => p
                        .all_reduce_grid(stages, send, recv, sh.call_count, job.dtype, s)
                        .map_err(|e| e.to_string()),
                    (None, _) => Err("the pull reference is not set up on this rank".into()),
                }
            }
            (Variant::Nccl, _, _, Some((lib, nc))) => {
                let t = job.dtype;
                match self.o.coll {
                    Collective::AllReduce => lib.all_reduce(nc, send, recv, sh.call_count, t, s),
                    Collective::ReduceScatter => {
                        lib.reduce_scatter(nc, send, recv, sh.call_count, self.nranks, t, s)
                    }
                    Collective::AllGather => {
                        lib.all_gather(nc, send, recv, sh.call_count, self.nranks, t, s)
                    }
                    Collective::AlltoAll => {
                        lib.all_to_all(nc, send, recv, sh.call_count, self.nranks, t, s)
                    }
                    other => Err(format!("{other} is not measured")),
                }
            }
            _ => Err(format!(
                "{} is not set up on this rank",
                job.variant.label()
            )),
        }
    }

    fn lossless_job(&self, job: &Job, salt: u32) -> Result<RankOut, String> {
        let (req, plan) = match (job.variant, &self.comm) {
            (Variant::Lossless, Some(c)) => {
                let req = Request::typed(self.o.coll, job.shape.call_count, job.dtype);
                let mut p = c
                    .plan_forced(&req, self.o.algo, self.o.proto)
                    .map_err(|e| e.to_string())?;
                // Eager calls take the copy-engine schedule where --host-copy says so.
                if job.launch == Launch::Eager {
                    p = c.with_copy_engines(p, &req).map_err(|e| e.to_string())?;
                }
                (Some((p, req)), Some(p))
            }
            _ => (None, None),
        };
        // The pull reference's plan: its kernel and blocks per rank.
        let pull_plan = match (job.variant, &self.pull) {
            (Variant::Pull(row, _), Some(p)) => pull_stages(row)
                .map(|st| pull_plan_label(st, p.blocks(st, job.shape.call_count, job.dtype))),
            _ => None,
        };
        let out = self.lossless_measure(job, req.as_ref(), salt, false)?;
        if self.o.phase_trace && req.is_some() {
            self.report_phases(job)?;
        }
        let inplace = if !self.o.inplace {
            None
        } else if matches!(job.variant, Variant::Pull(..)) {
            // Peers load a rank's input while it writes its output: in place, a rank could
            // overwrite input a slower peer has yet to read.
            Some(Err(
                "the pull reference reads peers' inputs in place: out-of-place only".into(),
            ))
        } else {
            Some(Ok(self.lossless_measure(job, req.as_ref(), salt, true)?))
        };
        Ok(RankOut {
            skipped: None,
            plan: plan.as_ref().map(plan_label).or(pull_plan),
            out: Some(out),
            inplace,
        })
    }

    /// `--phase-trace`: gathers every rank's traced calls of the job just timed and prints their
    /// phases at rank 0 ([`crate::phases`]). Collective.
    fn report_phases(&self, job: &Job) -> Result<(), String> {
        let mine: Vec<u64> = match &self.comm {
            Some(c) => c
                .phase_trace(self.stream)
                .map_err(e2s("reading the phase trace"))?
                .unwrap_or_default()
                .iter()
                .flat_map(|t| [t.seq, t.begin, t.ready, t.end])
                .collect(),
            None => Vec::new(),
        };
        let all = self.team.gather(self.rank, mine)?;
        if self.rank == 0 {
            match crate::phases::summarize(&all) {
                Some(p) => println!(
                    "# phases, {} bytes, {}: {p}",
                    job.shape.send_bytes,
                    job.launch.name()
                ),
                None => println!(
                    "# phases, {} bytes: no call traced by every rank",
                    job.shape.send_bytes
                ),
            }
        }
        Ok(())
    }

    /// The buffers of a lossless call: (where the input is filled, send, recv, output elements).
    fn lossless_buffers(&self, job: &Job, inplace: bool) -> (DevicePtr, DevicePtr, DevicePtr, u64) {
        let sh = &job.shape;
        let elem = job.dtype.bytes();
        let recv = self.recv.slice(0, sh.recv_bytes as usize);
        if !inplace {
            let send = self.send.slice(0, sh.send_bytes as usize);
            return (send, send, recv, sh.recv_bytes / elem);
        }
        match self.o.coll {
            Collective::AllGather => {
                let mine = self.recv.slice(
                    (u64::from(self.rank) * sh.send_bytes) as usize,
                    sh.send_bytes as usize,
                );
                (mine, mine, recv, sh.recv_bytes / elem)
            }
            _ => (recv, recv, recv, sh.recv_bytes / elem),
        }
    }

    fn lossless_measure(
        &self,
        job: &Job,
        req: Option<&(Plan, Request<'static>)>,
        salt: u32,
        inplace: bool,
    ) -> Result<RankMeasure, String> {
        let ty = test_type(job.dtype);
        let sh = &job.shape;
        let (fill, send, recv, out_elems) = self.lossless_buffers(job, inplace);
        let in_elems = sh.send_bytes / job.dtype.bytes();
        let v = &self.v;
        let s = self.stream;
        v.fill(fill, in_elems, ty, self.rank, salt, s)
            .map_err(e2s("filling inputs"))?;
        self.sync()?;
        self.barrier()?;
        let call = |st: Stream| self.lossless_call(job, req, send, recv, st);
        // One grid for every rank: rank 0 issues and times every call; the others meet it, and
        // touch their buffers again only once its calls are over.
        let single = job.variant.single_grid();
        let times = self.time_calls(job.launch, true, !single || self.rank == 0, &call)?;
        if single {
            self.barrier()?;
        }
        let (wrong, mismatch) = if self.o.check {
            // A fresh, checked call: inputs refilled (in-place calls overwrote them), output
            // cleared.
            if !inplace {
                self.recv
                    .fill(0xA5, s)
                    .map_err(e2s("clearing the output"))?;
            }
            v.fill(fill, in_elems, ty, self.rank, salt, s)
                .map_err(e2s("filling inputs"))?;
            self.sync()?;
            self.barrier()?;
            call(s)?;
            if single {
                // Rank 0's grid wrote every rank's output.
                self.sync()?;
                self.barrier()?;
            }
            v.check(
                recv,
                out_elems,
                sh.call_count,
                self.o.coll,
                ty,
                self.nranks,
                self.rank,
                salt,
                s,
            )
            .map_err(e2s("checking the output"))?;
            self.sync()?;
            let (wrong, _) = v.errors().map_err(e2s("reading the check"))?;
            v.reset().map_err(e2s("resetting the check"))?;
            let mismatch = self.compare_with_rank0(recv)?;
            (Some(wrong), mismatch)
        } else {
            (None, None)
        };
        Ok(RankMeasure {
            times,
            wrong,
            mismatch,
            accuracy: None,
        })
    }

    /// Bytes of `out` that differ from rank 0's output (AllReduce and AllGather, whose results
    /// are the same on every rank). Collective: every rank calls it after its output is final.
    fn compare_with_rank0(&self, out: DevicePtr) -> Result<Option<u64>, String> {
        self.barrier()?;
        let same_everywhere = matches!(self.o.coll, Collective::AllReduce | Collective::AllGather);
        let res = if same_everywhere && self.can_compare {
            if self.rank != 0 {
                let theirs = self
                    .team
                    .recv0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .ok_or("rank 0's buffer is not published")?;
                let theirs = theirs_slice(theirs, out.len())?;
                self.v
                    .compare(out, theirs, out.len(), self.stream)
                    .map_err(e2s("comparing with rank 0"))?;
                self.sync()?;
                let (n, _) = self.v.errors().map_err(e2s("reading the comparison"))?;
                self.v.reset().map_err(e2s("resetting the check"))?;
                Some(n)
            } else {
                Some(0)
            }
        } else {
            None
        };
        // Rank 0 keeps its output until every rank has compared.
        self.barrier()?;
        Ok(res)
    }

    fn quant_job(&mut self, job: &Job, w: Width, salt: u32) -> Result<RankOut, String> {
        let skipped = |why: String| {
            Ok(RankOut {
                skipped: Some(why),
                ..RankOut::default()
            })
        };
        let spec = match QuantSpec::new(w.rs, w.ag, self.o.group, self.o.spikes) {
            Ok(q) => q,
            Err(e) => return skipped(e.to_string()),
        };
        let dt = job.dtype;
        let count = job.shape.call_count;
        // AllReduce, or the one-step AllGather, ReduceScatter and AllToAll (single widths: the
        // arguments refuse pairs for them).
        let op = QuantOp::of(self.o.coll);
        // The same verdict on every rank: planning is pure.
        // AllReduce may run the lossless kernels where quantizing does not pay (`--quant-choice
        // auto`); the one-step collectives are quantized whatever the choice.
        let req = Request::typed(self.o.coll, count, dt).quantized(spec, op.is_none());
        let plan = match self.comm.as_ref() {
            None => return skipped("flashcomm is not set up".into()),
            Some(c) => c.plan_forced(&req, self.o.algo, self.o.proto),
        };
        let plan = match plan {
            Err(e) => return skipped(e.to_string()),
            Ok(p) => p,
        };
        if plan.quant.is_none() {
            // `--quant-choice auto` where quantizing does not pay: the call runs the lossless
            // kernels, timed and checked as a lossless row (the plan column says so).
            let out = self.lossless_measure(job, Some(&(plan, req)), salt, false)?;
            return Ok(RankOut {
                skipped: None,
                plan: Some(format!("lossless:{}", plan_label(&plan))),
                out: Some(out),
                inplace: self
                    .o
                    .inplace
                    .then(|| Err("in-place quantized calls are not measured".into())),
            });
        }
        let seed = quant_seed(self.o.seed, job.dtype, count);
        // The send buffer: the whole vector of AllReduce, one block of AllGather, every peer's
        // block of AllToAll and every shard of ReduceScatter.
        let send_bytes = job.shape.send_bytes as usize;
        let recv_bytes = job.shape.recv_bytes as usize;
        if self.fp_for != Some((job.dtype, count)) {
            let mut host = vec![0u8; send_bytes];
            let threads = (self.threads / self.nranks as usize).max(1);
            match job.dtype {
                Dtype::Bf16 => inputs::fill_le::<bf16>(seed, self.rank, 0, &mut host, threads),
                Dtype::F16 => inputs::fill_le::<f16>(seed, self.rank, 0, &mut host, threads),
                Dtype::F32 => inputs::fill_le::<f32>(seed, self.rank, 0, &mut host, threads),
            }
            let fp = self.fp.as_ref().ok_or("no buffer for quantized inputs")?;
            fp.upload(0, &host, self.stream)
                .map_err(e2s("uploading the inputs"))?;
            self.fp_for = Some((job.dtype, count));
        }
        let comm = self.comm.as_ref().ok_or("flashcomm is not set up")?;
        let fp = self.fp.as_ref().ok_or("no buffer for quantized inputs")?;
        let send = fp.slice(0, send_bytes);
        let recv = self.recv.slice(0, recv_bytes);
        let call = |s: Stream| {
            comm.execute_plan(plan, &req.between(send, recv).on(s))
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        self.sync()?;
        self.barrier()?;
        let times = self.time_calls(job.launch, true, true, &call)?;
        let mut m = RankMeasure {
            times,
            ..RankMeasure::default()
        };
        if self.o.check {
            self.recv
                .fill(0xA5, self.stream)
                .map_err(e2s("clearing the output"))?;
            self.sync()?;
            self.barrier()?;
            call(self.stream)?;
            self.sync()?;
            m.mismatch = self.compare_with_rank0(recv)?;
            let q = plan.quant.unwrap_or(spec);
            match op {
                None if self.rank == 0 => {
                    let algo = match plan.algo {
                        Algorithm::OneShot => QuantAlgo::OneShot,
                        Algorithm::TwoShot => QuantAlgo::TwoStep,
                    };
                    let windows = accuracy::windows(count as usize, self.o.check_values as usize);
                    let check = Check::AllReduce(algo);
                    let acc = self.check_output(check, q, job.dtype, seed, &windows)?;
                    m.wrong = Some(acc.outside_bound);
                    m.accuracy = Some(acc);
                }
                None => {}
                // AllGather: rank 0 checks its output (every rank's is the same, compared byte
                // for byte with rank 0's above); the others: every rank checks its own, with an
                // equal share of the values a call may check.
                Some(op) if !op.same_everywhere() || self.rank == 0 => {
                    let checkers = if op.same_everywhere() { 1 } else { self.nranks };
                    let budget = (self.o.check_values / u64::from(checkers)) as usize;
                    let windows = accuracy::op_windows(op, self.nranks, count as usize, budget);
                    let check = Check::Op {
                        op,
                        len: count as usize,
                    };
                    let acc = self.check_output(check, q, job.dtype, seed, &windows)?;
                    m.wrong = Some(acc.wrong_one_step());
                    m.accuracy = Some(acc);
                }
                Some(_) => {}
            }
        }
        Ok(RankOut {
            skipped: None,
            plan: Some(plan_label(&plan)),
            out: Some(m),
            inplace: self
                .o
                .inplace
                .then(|| Err("in-place quantized calls are not measured".into())),
        })
    }

    /// [`Rank::accuracy`] for the element type of `dtype`.
    fn check_output(
        &self,
        check: Check,
        q: QuantSpec,
        dtype: Dtype,
        seed: u64,
        windows: &[Range<usize>],
    ) -> Result<AccuracyStats, String> {
        match dtype {
            Dtype::Bf16 => self.accuracy::<bf16>(check, q, dtype, seed, windows),
            Dtype::F16 => self.accuracy::<f16>(check, q, dtype, seed, windows),
            Dtype::F32 => self.accuracy::<f32>(check, q, dtype, seed, windows),
        }
    }

    /// Downloads this rank's output at `windows` (of the whole output for AllReduce, of each
    /// segment for the one-step collectives) and checks it against the CPU references.
    fn accuracy<T: Element>(
        &self,
        check: Check,
        q: QuantSpec,
        dtype: Dtype,
        seed: u64,
        windows: &[Range<usize>],
    ) -> Result<AccuracyStats, String> {
        let elem = T::BYTES;
        let ranges = match check {
            Check::AllReduce(_) => windows.to_vec(),
            Check::Op { op, len } => accuracy::op_output_ranges(op, self.nranks, len, windows),
        };
        let mut values: Vec<T> = Vec::with_capacity(accuracy::window_values(&ranges));
        let mut buf = Vec::new();
        for w in &ranges {
            buf.resize(w.len() * elem, 0u8);
            self.recv
                .download(w.start * elem, &mut buf, self.stream)
                .map_err(e2s("downloading the output"))?;
            values.extend(buf.chunks_exact(elem).map(T::read_le));
        }
        let fmt = |b: u8| Format::new(dtype, b, q.group, q.spikes).map_err(|e| e.to_string());
        Ok(match check {
            Check::AllReduce(algo) => accuracy::evaluate(
                algo,
                fmt(q.rs_bits)?,
                fmt(q.ag_bits)?,
                self.nranks,
                seed,
                windows,
                &values,
                self.threads,
            ),
            // Every rank of AllToAll and ReduceScatter checks at once: a share of the threads.
            Check::Op { op, len } => accuracy::evaluate_op(
                op,
                fmt(q.rs_bits)?,
                self.nranks,
                self.rank,
                seed,
                len,
                windows,
                &values,
                if op.same_everywhere() {
                    self.threads
                } else {
                    (self.threads / self.nranks as usize).max(1)
                },
            ),
        })
    }
}

/// What a quantized row's output is checked as.
#[derive(Clone, Copy, Debug)]
enum Check {
    /// AllReduce by this algorithm.
    AllReduce(QuantAlgo),
    /// A one-step collective of `len` values per output segment (the call's count).
    Op {
        /// The collective.
        op: QuantOp,
        /// Values per segment.
        len: usize,
    },
}

/// The pull reference kernel of a measured row (`None` for the derived `pull-best`).
fn pull_stages(row: PullRow) -> Option<Stages> {
    match row {
        PullRow::OneStage => Some(Stages::One),
        PullRow::TwoStage => Some(Stages::Two),
        PullRow::Best => None,
    }
}

/// The `plan` column of a pull reference row: `1stage/g16`, `2stage/g36` (blocks per rank, of
/// 512 threads).
pub fn pull_plan_label(stages: Stages, blocks: u32) -> String {
    format!("{}/g{blocks}", stages.name())
}

/// Item `k` of every rank's list of [`Team::share`]: every rank's address of one buffer.
fn column(all: &[Vec<u64>], k: usize) -> Vec<u64> {
    all.iter().map(|v| v[k]).collect()
}

/// Rank 0's output as a range of `len` bytes (its buffer is at least as long as ours: every
/// rank allocates the same sizes).
fn theirs_slice(p: DevicePtr, len: u64) -> Result<DevicePtr, String> {
    if p.len() < len {
        return Err("rank 0's buffer is smaller than this rank's".into());
    }
    Ok(p)
}

/// What a rank process sends rank 0 of one job: the times, counts and accuracy checks that
/// [`merge`] combines across ranks (whether the job ran and its plan are rank 0's own).
fn wire(out: &RankOut) -> Result<Vec<u8>, String> {
    let m = |m: &RankMeasure| WireMeasure {
        times: m.times.clone(),
        wrong: m.wrong,
        mismatch: m.mismatch,
        accuracy: m.accuracy.as_ref().map(WireAccuracy::of),
    };
    let doc = Wire {
        skipped: out.skipped.clone(),
        out: out.out.as_ref().map(m),
        inplace: out.inplace.as_ref().and_then(|r| r.as_ref().ok()).map(m),
    };
    serde_json::to_vec(&doc).map_err(|e| format!("encoding this rank's results: {e}"))
}

/// The inverse of [`wire`].
fn unwire(bytes: &[u8]) -> Result<RankOut, String> {
    let doc: Wire = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let m = |w: WireMeasure| RankMeasure {
        times: w.times,
        wrong: w.wrong,
        mismatch: w.mismatch,
        accuracy: w.accuracy.map(WireAccuracy::stats),
    };
    Ok(RankOut {
        skipped: doc.skipped,
        plan: None,
        out: doc.out.map(m),
        inplace: doc.inplace.map(m).map(Ok),
    })
}

/// A rank's report of one job as it travels to rank 0 (JSON; a missing field reads as `None`).
#[derive(Debug, Serialize, Deserialize)]
struct Wire {
    skipped: Option<String>,
    out: Option<WireMeasure>,
    inplace: Option<WireMeasure>,
}

/// One measurement of a rank: its per-call times and counts, and its accuracy check where it
/// made one (the ranks of AllToAll and ReduceScatter each check their own output).
#[derive(Debug, Serialize, Deserialize)]
struct WireMeasure {
    times: Vec<f64>,
    wrong: Option<u64>,
    mismatch: Option<u64>,
    #[serde(default)]
    accuracy: Option<WireAccuracy>,
}

/// [`AccuracyStats`] as it travels: JSON has no NaN or infinity (serde_json writes `null`), so
/// the floats are optional, `None` standing for a value that is not finite.
#[derive(Debug, Serialize, Deserialize)]
struct WireAccuracy {
    checked: u64,
    rel_l2: Option<f64>,
    max_err: Option<f64>,
    outside_bound: u64,
    ref_mismatch: u64,
    ref_mismatch_bytes: u64,
    err2: Option<f64>,
    ref2: Option<f64>,
}

impl WireAccuracy {
    fn of(a: &AccuracyStats) -> WireAccuracy {
        let f = |v: f64| v.is_finite().then_some(v);
        WireAccuracy {
            checked: a.checked,
            rel_l2: f(a.rel_l2),
            max_err: f(a.max_err),
            outside_bound: a.outside_bound,
            ref_mismatch: a.ref_mismatch,
            ref_mismatch_bytes: a.ref_mismatch_bytes,
            err2: f(a.err2),
            ref2: f(a.ref2),
        }
    }

    fn stats(self) -> AccuracyStats {
        let f = |v: Option<f64>| v.unwrap_or(f64::NAN);
        AccuracyStats {
            checked: self.checked,
            rel_l2: f(self.rel_l2),
            max_err: f(self.max_err),
            outside_bound: self.outside_bound,
            ref_mismatch: self.ref_mismatch,
            ref_mismatch_bytes: self.ref_mismatch_bytes,
            err2: f(self.err2),
            ref2: f(self.ref2),
        }
    }
}

/// Combines every rank's report of a job into a row.
fn merge(o: &Options, job: &Job, outs: &[RankOut]) -> Row {
    let first = outs.first().cloned().unwrap_or_default();
    let combine = |pick: &dyn Fn(&RankOut) -> Option<RankMeasure>| -> Option<Measure> {
        let ms: Vec<RankMeasure> = if job.variant.is_baseline() {
            pick(&first).into_iter().collect()
        } else {
            outs.iter().filter_map(pick).collect()
        };
        if ms.is_empty() {
            return None;
        }
        // One grid for every rank: rank 0 timed it alone (the others report their checks only).
        let timed = if job.variant.single_grid() {
            &ms[..1]
        } else {
            &ms[..]
        };
        let times: Vec<Vec<f64>> = timed.iter().map(|m| m.times.clone()).collect();
        let sum = |f: &dyn Fn(&RankMeasure) -> Option<u64>| -> Option<u64> {
            ms.iter().filter_map(f).reduce(|a, b| a + b)
        };
        Some(Measure {
            time: TimeStats::of(&sweep::slowest_rank(&times)),
            wrong: sum(&|m| m.wrong),
            rank_mismatch_bytes: sum(&|m| m.mismatch),
            // Rank 0's check (AllReduce, AllGather), or every rank's together (AllToAll and
            // ReduceScatter, whose outputs differ).
            accuracy: AccuracyStats::combine(ms.iter().filter_map(|m| m.accuracy.as_ref())),
        })
    };
    let out = match &first.skipped {
        Some(why) => Outcome::Skipped(why.clone()),
        None => match combine(&|r| r.out.clone()) {
            Some(m) => Outcome::Done(m),
            None => Outcome::Skipped("no measurement".into()),
        },
    };
    let inplace = if o.inplace {
        Some(match &first.inplace {
            Some(Err(why)) => Outcome::Skipped(why.clone()),
            Some(Ok(_)) => combine(&|r| r.inplace.clone().and_then(Result::ok))
                .map_or_else(|| Outcome::Skipped("no measurement".into()), Outcome::Done),
            None => Outcome::Skipped("N/A".into()),
        })
    } else {
        None
    };
    Row {
        variant: job.variant,
        launch: job.launch,
        dtype: job.dtype,
        coll: o.coll,
        nranks: o.ranks,
        bytes: job.shape.bytes,
        count: job.shape.count,
        plan: first.plan.clone(),
        quant: match job.variant {
            Variant::Quant(w) => quant_info(job.dtype, w, o.group, o.spikes),
            _ => None,
        },
        out,
        inplace,
        vs_nccl: None,
        vs_copy: None,
        vs_ref: None,
        vs_link: None,
        vs_best: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{Command, parse};

    fn opts(args: &str) -> Options {
        let v: Vec<String> = args.split_whitespace().map(String::from).collect();
        match parse(&v).unwrap() {
            Command::Run(o) => *o,
            Command::Help => unreachable!(),
        }
    }

    #[test]
    fn jobs_put_baselines_first() {
        let o = opts(
            "-b 4K -e 16K -f 2 --mode gpus --ranks 2 --impl flashcomm,nccl --copy-baseline --quant 4,2",
        );
        let j = jobs(&o);
        assert_eq!(j.len(), 3 * 5);
        let v: Vec<String> = j[..5].iter().map(|j| j.variant.label()).collect();
        assert_eq!(
            v,
            ["copy", "nccl", "flashcomm", "flashcomm-q4", "flashcomm-q2"]
        );
        assert!(j[..5].iter().all(|x| x.shape.bytes == 4096));
        assert_eq!(j[14].shape.bytes, 16384);
    }

    #[test]
    fn competitor_jobs_per_reference_launch() {
        let o = opts("-b 8K -e 16K -f 2 --impl flashcomm,reference,pull-reference --ranks 2");
        let j = jobs(&o);
        let v: Vec<String> = j[..4].iter().map(|j| j.variant.label()).collect();
        assert_eq!(v, ["reference", "pull-1stage", "pull-2stage", "flashcomm"]);
        assert_eq!(j.len(), 2 * 4);
        let o = opts(
            "-b 8K -e 8K --impl pull-reference,reference,flashcomm --ref-launch per-rank,single",
        );
        let v: Vec<String> = jobs(&o).iter().map(|j| j.variant.label()).collect();
        assert_eq!(
            v,
            [
                "reference",
                "pull-1stage",
                "pull-2stage",
                "reference-1grid",
                "pull-1stage-1grid",
                "pull-2stage-1grid",
                "flashcomm"
            ]
        );
        // pull-best is derived by the table, never run.
        assert!(jobs(&o).iter().all(|j| !j.variant.derived()));
        assert_eq!(pull_plan_label(Stages::Two, 36), "2stage/g36");
        assert_eq!(pull_stages(PullRow::Best), None);
        assert_eq!(pull_stages(PullRow::OneStage), Some(Stages::One));
    }

    #[test]
    fn one_grid_rows_take_rank_zeros_times_and_every_ranks_checks() {
        let o = opts("-b 4K -e 4K --impl pull-reference --ref-launch single --ranks 3");
        let job = jobs(&o)[0];
        assert_eq!(
            job.variant,
            Variant::Pull(PullRow::OneStage, RefLaunch::Single)
        );
        let m = |t: Vec<f64>, w| RankMeasure {
            times: t,
            wrong: Some(w),
            mismatch: Some(0),
            accuracy: None,
        };
        let outs = vec![
            RankOut {
                plan: Some("1stage/g1".into()),
                out: Some(m(vec![2.0, 3.0, 4.0], 0)),
                ..RankOut::default()
            },
            RankOut {
                out: Some(m(Vec::new(), 1)),
                ..RankOut::default()
            },
            RankOut {
                out: Some(m(Vec::new(), 2)),
                ..RankOut::default()
            },
        ];
        let row = merge(&o, &job, &outs);
        let me = row.out.measure().unwrap();
        assert_eq!((me.time.samples, me.time.median_us), (3, 3.0));
        assert_eq!(me.wrong_total(), Some(3));
        // Launched per rank, a rank without times would leave no sample: every rank times.
        let per_rank = opts("-b 4K -e 4K --impl pull-reference --ranks 3");
        let row = merge(&per_rank, &jobs(&per_rank)[0], &outs);
        assert_eq!(row.out.measure().unwrap().time.samples, 0);
    }

    #[test]
    fn reference_rows_of_rank_processes_reach_vs_best() {
        use crate::report::{Layout, Table};
        let o = opts(
            "-b 8K -e 8K --mode procs-one-gpu --ranks 2 --impl reference,pull-reference,flashcomm",
        );
        let j = jobs(&o);
        let v: Vec<String> = j.iter().map(|j| j.variant.label()).collect();
        assert_eq!(v, ["reference", "pull-1stage", "pull-2stage", "flashcomm"]);
        let layout = Layout {
            inplace: false,
            quant: false,
            vs_nccl: false,
            vs_copy: false,
            vs_ref: true,
            vs_link: false,
            vs_best: true,
        };
        // Per job, rank 0's and rank 1's per-call times: rank 1's report crosses the processes'
        // wire, rank 0's is its own; a row takes the slowest rank per call, then the median.
        let times = [
            ([4.0, 5.0, 6.0], [5.0, 7.0, 5.0]),
            ([3.0, 3.0, 3.0], [4.0, 4.0, 4.0]),
            ([8.0, 8.0, 8.0], [2.0, 2.0, 2.0]),
            ([2.0, 2.0, 2.0], [2.0, 3.0, 2.0]),
        ];
        let mut table = Table::default();
        for (job, (t0, t1)) in j.iter().zip(times) {
            let out = |t: [f64; 3]| RankOut {
                plan: Some("plan".into()),
                out: Some(RankMeasure {
                    times: t.to_vec(),
                    wrong: Some(0),
                    mismatch: Some(0),
                    accuracy: None,
                }),
                ..RankOut::default()
            };
            let outs = vec![out(t0), unwire(&wire(&out(t1)).unwrap()).unwrap()];
            table.add(&layout, merge(&o, job, &outs));
        }
        let row = |label: &str| {
            table
                .rows
                .iter()
                .find(|r| r.variant.label() == label)
                .unwrap_or_else(|| panic!("no {label} row"))
        };
        let time = |label: &str| row(label).out.measure().unwrap().time.median_us;
        assert_eq!(time("reference"), 6.0);
        assert_eq!(time("pull-1stage"), 4.0);
        assert_eq!(time("pull-2stage"), 8.0);
        assert_eq!(time("pull-best"), 4.0);
        let fc = row("flashcomm");
        assert_eq!(fc.out.measure().unwrap().time.median_us, 2.0);
        assert_eq!(
            fc.vs_best,
            Some(0.5),
            "over pull-1stage, the fastest competitor"
        );
        assert_eq!(fc.vs_ref, Some(2.0 / 6.0));
    }

    #[test]
    fn latency_preset_jobs() {
        let j = jobs(&opts("--preset latency"));
        // 8K..1M: 8 sizes, eager and graph, copy and flashcomm.
        assert_eq!(j.len(), 8 * 2 * 2);
        assert_eq!(j[0].variant, Variant::Copy);
        assert_eq!(j[0].launch, Launch::Eager);
        assert_eq!(j[2].launch, Launch::Graph);
        assert!(j.iter().all(|x| x.dtype == Dtype::Bf16));
    }

    #[test]
    fn devices_per_mode() {
        assert_eq!(devices(&opts("--ranks 3 --device 1")), vec![1, 1, 1]);
        assert_eq!(
            devices(&opts("--ranks 3 --device 1 --mode gpus")),
            vec![1, 2, 3]
        );
        assert_eq!(
            devices(&opts("--ranks 3 --device 1 --mode procs")),
            vec![1, 2, 3]
        );
        assert_eq!(
            devices(&opts("--ranks 3 --device 1 --mode procs-one-gpu")),
            vec![1, 1, 1]
        );
    }

    #[test]
    fn buffers_cover_every_job() {
        let o = opts("-b 1K -e 1M -f 2 --coll allgather --copy-baseline --inplace 1 --ranks 8");
        let j = jobs(&o);
        let (s, r, q) = buffer_bytes(&o, &j);
        assert!(s >= 1 << 20, "the copy moves the whole vector");
        assert!(r >= 1 << 20);
        assert_eq!(q, 0);
        let o = opts("-b 1K -e 64K -f 2 --quant 4");
        let (_, _, q) = buffer_bytes(&o, &jobs(&o));
        assert_eq!(q, 64 << 10);
    }

    #[test]
    fn merge_takes_the_slowest_rank_and_sums_errors() {
        let o = opts("-b 4K -e 4K");
        let job = jobs(&o)[0];
        let m = |t: Vec<f64>, w| RankMeasure {
            times: t,
            wrong: Some(w),
            mismatch: Some(0),
            accuracy: None,
        };
        let outs = vec![
            RankOut {
                plan: Some("oneshot/ll/g8".into()),
                out: Some(m(vec![1.0, 4.0, 2.0], 0)),
                ..RankOut::default()
            },
            RankOut {
                out: Some(m(vec![3.0, 1.0, 2.0], 2)),
                ..RankOut::default()
            },
        ];
        let row = merge(&o, &job, &outs);
        let me = row.out.measure().unwrap();
        assert_eq!(me.time.median_us, 3.0, "slowest per call: 3, 4, 2");
        assert_eq!(me.wrong_total(), Some(2));
        assert_eq!(row.plan.as_deref(), Some("oneshot/ll/g8"));
        let skipped = merge(
            &o,
            &job,
            &[RankOut {
                skipped: Some("no kernels".into()),
                ..RankOut::default()
            }],
        );
        assert_eq!(skipped.out, Outcome::Skipped("no kernels".into()));
    }

    #[test]
    fn quantized_jobs_of_every_collective() {
        for (coll, send) in [
            ("allgather", 64 << 10),
            ("reducescatter", 512 << 10),
            ("alltoall", 512 << 10),
        ] {
            let o = opts(&format!(
                "-b 64K -e 512K -f 2 --coll {coll} --quant 8,4 --ranks 8 --transport host"
            ));
            let j = jobs(&o);
            // Per size: the link baselines (one way after the other, both at once, the round
            // trip), lossless, q8, q4.
            assert_eq!(j.len(), 4 * 6);
            let v: Vec<String> = j[..6].iter().map(|j| j.variant.label()).collect();
            assert_eq!(
                v,
                [
                    "link",
                    "link-both",
                    "link-rtt",
                    "flashcomm",
                    "flashcomm-q8",
                    "flashcomm-q4"
                ]
            );
            // The inputs buffer holds a rank's send buffer of the largest call.
            let (s, r, q) = buffer_bytes(&o, &j);
            assert_eq!(q, send, "{coll}");
            assert!(s >= q && r >= 512 << 10);
        }
    }

    #[test]
    fn merge_combines_every_ranks_check() {
        let o = opts("-b 64K -e 64K --coll alltoall --quant 4 --ranks 2");
        let job = *jobs(&o).last().unwrap();
        assert_eq!(job.variant, Variant::Quant(Width { rs: 4, ag: 4 }));
        let acc = |checked, err2, mx, bytes| AccuracyStats {
            checked,
            err2,
            ref2: 100.0 * checked as f64,
            max_err: mx,
            ref_mismatch_bytes: bytes,
            outside_bound: 0,
            ..AccuracyStats::default()
        };
        let m = |a: AccuracyStats| RankMeasure {
            times: vec![1.0],
            wrong: Some(a.outside_bound + a.ref_mismatch_bytes),
            mismatch: None,
            accuracy: Some(a),
        };
        let outs = vec![
            RankOut {
                plan: Some("block/g4x256".into()),
                out: Some(m(acc(100, 1.0, 0.25, 0))),
                ..RankOut::default()
            },
            RankOut {
                out: Some(m(acc(300, 3.0, 0.5, 2))),
                ..RankOut::default()
            },
        ];
        let row = merge(&o, &job, &outs);
        let me = row.out.measure().unwrap();
        let a = me.accuracy.as_ref().unwrap();
        assert_eq!((a.checked, a.max_err, a.ref_mismatch_bytes), (400, 0.5, 2));
        assert!((a.rel_l2 - 0.01).abs() < 1e-12);
        assert_eq!(me.wrong_total(), Some(2));
        assert_eq!(row.coll, Collective::AlltoAll);
        assert_eq!(row.quant.unwrap().width, Width { rs: 4, ag: 4 });
        // The same reports through the rank processes' wire.
        let back: Vec<RankOut> = outs
            .iter()
            .map(|o| unwire(&wire(o).unwrap()).unwrap())
            .collect();
        let again = merge(&o, &job, &back);
        assert_eq!(again.out.measure().unwrap().accuracy, me.accuracy);
    }

    #[test]
    fn quant_info_and_seeds() {
        let q = quant_info(Dtype::Bf16, Width { rs: 4, ag: 8 }, 128, 2).unwrap();
        assert_eq!((q.effbits_rs, q.effbits_ag), (4.75, 8.75));
        assert_ne!(
            quant_seed(1, Dtype::Bf16, 100),
            quant_seed(1, Dtype::Bf16, 200)
        );
        assert_ne!(
            quant_seed(1, Dtype::Bf16, 100),
            quant_seed(1, Dtype::F16, 100)
        );
    }

    #[test]
    fn rank_reports_cross_processes_intact() {
        let m = |t: f64, wrong| RankMeasure {
            times: vec![t, t + 0.5],
            wrong,
            mismatch: Some(3),
            accuracy: None,
        };
        let out = RankOut {
            skipped: None,
            plan: Some("plan not sent".into()),
            out: Some(m(1.25, Some(0))),
            inplace: Some(Ok(m(2.0, None))),
        };
        let back = unwire(&wire(&out).unwrap()).unwrap();
        let got = back.out.unwrap();
        assert_eq!(got.accuracy, None);
        assert_eq!(
            (got.times, got.wrong, got.mismatch),
            (vec![1.25, 1.75], Some(0), Some(3))
        );
        let ip = back.inplace.unwrap().unwrap();
        assert_eq!((ip.times, ip.wrong), (vec![2.0, 2.5], None));
        assert_eq!((back.skipped, back.plan), (None, None));
        let skipped = RankOut {
            skipped: Some("too small".into()),
            ..RankOut::default()
        };
        let back = unwire(&wire(&skipped).unwrap()).unwrap();
        assert_eq!(back.skipped.as_deref(), Some("too small"));
        assert!(back.out.is_none() && back.inplace.is_none());
        assert!(unwire(b"not json").is_err());
        // An accuracy check travels; a float that is not finite comes back as NaN.
        let a = AccuracyStats {
            checked: 7,
            rel_l2: 0.5,
            max_err: f64::INFINITY,
            outside_bound: 1,
            ref_mismatch: 2,
            ref_mismatch_bytes: 3,
            err2: 4.0,
            ref2: 16.0,
        };
        let with = RankOut {
            out: Some(RankMeasure {
                accuracy: Some(a.clone()),
                ..m(1.0, Some(4))
            }),
            ..RankOut::default()
        };
        let got = unwire(&wire(&with).unwrap()).unwrap().out.unwrap().accuracy;
        let got = got.unwrap();
        assert!(got.max_err.is_nan());
        assert_eq!(
            AccuracyStats {
                max_err: a.max_err,
                ..got
            },
            a
        );
        // Older reports without the field still read.
        let old = unwire(br#"{"out":{"times":[1.0],"wrong":null,"mismatch":null}}"#).unwrap();
        assert!(old.out.unwrap().accuracy.is_none());
        assert!(unwire(br#"{"out":{"times":["x"]}}"#).is_err());
    }

    #[test]
    fn rank_processes_meet_merge_and_time_out() {
        let dir = std::env::temp_dir().join(format!("flashcomm-perf-team-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let t = Duration::from_secs(5);
        let teams: Vec<Team> = (0..3)
            .map(|r| Team::process(FileBootstrap::new(&dir, r, 3, t).unwrap(), t))
            .collect();
        std::thread::scope(|s| {
            for (r, team) in teams.iter().enumerate() {
                s.spawn(move || {
                    team.wait().unwrap();
                    let all = team.exchange(&[r as u8]).unwrap();
                    assert_eq!(all, vec![vec![0u8], vec![1], vec![2]]);
                    team.wait().unwrap();
                });
            }
        });
        // A rank alone waits until the timeout, then the team stays failed.
        let lone = Team::process(
            FileBootstrap::new(&dir.join("lone"), 0, 2, Duration::from_millis(50)).unwrap(),
            t,
        );
        assert!(lone.wait().unwrap_err().contains("rank processes"));
        assert!(lone.failed().is_some() && lone.wait().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn team_barrier_meets_and_poisons() {
        let t = Team::new(3, Duration::from_secs(10));
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..20 {
                        t.wait().unwrap();
                    }
                });
            }
        });
        let t = Team::new(2, Duration::from_secs(10));
        std::thread::scope(|s| {
            s.spawn(|| {
                let e = t.wait().unwrap_err();
                assert_eq!(e, "rank 1 failed");
            });
            std::thread::sleep(Duration::from_millis(20));
            t.fail("rank 1 failed".into());
        });
        assert!(t.wait().is_err(), "a poisoned team stays poisoned");
        let t = Team::new(2, Duration::from_millis(20));
        assert!(t.wait().unwrap_err().contains("did not meet"));
    }
}
