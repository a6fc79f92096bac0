//! The registry of communicators: the side table keyed by the real `ncclComm_t` (which callers
//! get back unchanged), and what flashcomm knows about each one ([`CommState`]).
//!
//! Reads are on the per-call path, so they take no lock and allocate nothing in the steady
//! state: writers (a communicator created or destroyed, rare) publish an immutable table under a
//! generation number; each thread keeps the table it last used and checks one atomic generation
//! per lookup, fetching the new table (one short lock) only after a change. The tables hold weak
//! references, so a thread's old table never keeps a destroyed communicator's GPU state alive.
//! A communicator's own quantization settings sit behind a sequence lock of atomics: reading them
//! never blocks.
//!
//! Owns: [`CommState`], [`Setup`], the table ([`find`], [`Found`], [`get`], [`by_handle`],
//! [`register`], [`remove`]).
//! May import: `types`, `stats`, `policy`, `calls::nccl`, `calls::os`.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use flashcomm_comm::Communicator;
use flashcomm_config::{Config, QuantBits, QuantSettings};
use flashcomm_nccl_sys::ncclComm_t;

use crate::calls::nccl::Identity;
use crate::calls::os::PerProcess;
use crate::policy::CommView;
use crate::stats::{Announced, Counters};
use crate::types::{CommHandle, CommOrigin, ExchangeGate};

/// Whether flashcomm's kernels serve a communicator, decided once, collectively, at set-up.
pub(crate) enum Setup {
    /// flashcomm's communicator, built on every rank.
    Served(Box<Communicator>),
    /// The communicator stays with NCCL, for this reason (the same on every rank).
    NotServed(String),
}

/// What flashcomm knows about one communicator.
pub(crate) struct CommState {
    /// How it was created.
    pub(crate) origin: CommOrigin,
    /// Its calls and bytes.
    pub(crate) counters: Counters,
    /// Whether its calls block (`ncclConfig_t::blocking`); non-blocking ones stay with NCCL.
    pub(crate) blocking: bool,
    identity: OnceLock<Identity>,
    setup: OnceLock<Setup>,
    /// Finalized or revoked: every later call goes to NCCL (which reports the misuse).
    closed: AtomicBool,
    /// Revoked: flashcomm's kernels were asked to stop.
    revoked: AtomicBool,
    /// Suspended (`ncclCommSuspend` until a successful `ncclCommResume`): calls go to NCCL.
    suspended: AtomicBool,
    /// `flashcommCommSetQuant`'s settings; `None`: the environment's.
    quant: QuantCell,
    /// (kind, route) pairs already logged.
    pub(crate) announced: Announced,
    /// Whether a device error was already logged by `ncclCommGetAsyncError`.
    async_warned: AtomicBool,
    /// Between the set-up exchange and an abort from another thread.
    pub(crate) gate: Arc<ExchangeGate>,
    /// Whether the set-up exchange began (its first round is, or was, under way).
    exchange: AtomicBool,
    /// Buffers registered with flashcomm's communicator too: (NCCL's handle or window, ours).
    pub(crate) registrations: std::sync::Mutex<Vec<(usize, flashcomm_comm::RegistrationId)>>,
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
    pub(crate) fn new(origin: CommOrigin, blocking: bool) -> CommState {
        CommState {
            origin,
            counters: Counters::new(),
            blocking,
            identity: OnceLock::new(),
            setup: OnceLock::new(),
            closed: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            suspended: AtomicBool::new(false),
            quant: QuantCell::new(),
            announced: Announced::new(),
            async_warned: AtomicBool::new(false),
            gate: Arc::new(ExchangeGate::default()),
            exchange: AtomicBool::new(false),
            registrations: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// flashcomm's communicator, when flashcomm serves this one.
    pub(crate) fn served(&self) -> Option<&Communicator> {
        match self.setup.get() {
            Some(Setup::Served(c)) => Some(c),
            _ => None,
        }
    }

    /// Why flashcomm does not serve this communicator (`None` when it does).
    pub(crate) fn why_not(&self) -> Option<String> {
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

    /// The set-up exchange begins now; `false` when it had begun already.
    pub(crate) fn exchange_begins(&self) -> bool {
        !self.exchange.swap(true, Ordering::SeqCst)
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
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Closes it for routing (`ncclCommFinalize`, `ncclCommRevoke`).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Whether the communicator was revoked.
    pub(crate) fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Relaxed)
    }

    /// Marks it revoked (`ncclCommRevoke`).
    pub(crate) fn revoke(&self) {
        self.revoked.store(true, Ordering::Relaxed);
    }

    /// Whether the communicator is suspended.
    pub(crate) fn is_suspended(&self) -> bool {
        self.suspended.load(Ordering::Relaxed)
    }

    /// Marks it suspended (`ncclCommSuspend`) or resumed (`ncclCommResume`).
    pub(crate) fn set_suspended(&self, on: bool) {
        self.suspended.store(on, Ordering::Relaxed);
    }

    /// The quantization settings in force: `flashcommCommSetQuant`'s, else the environment's.
    pub(crate) fn quant_settings(&self, config: &Config) -> QuantSettings {
        self.quant.load().unwrap_or_else(|| config.quant_settings())
    }

    /// Gives this communicator its own quantization settings (`None`: the environment's again).
    pub(crate) fn set_quant(&self, q: Option<QuantSettings>) {
        self.quant.store(q);
    }

    /// What [`crate::policy::decide`] needs to know about this communicator (the call path reads
    /// it through [`find`]).
    #[cfg(test)]
    pub(crate) fn view(&self, config: &Config) -> CommView {
        self.view_of(self.served(), config)
    }

    /// What [`crate::policy::decide`] needs to know about this communicator, flashcomm's
    /// communicator (`served`) already read.
    fn view_of(&self, served: Option<&Communicator>, config: &Config) -> CommView {
        CommView {
            served: served.is_some(),
            nranks: served.map_or(0, |c| u64::from(c.nranks())),
            closed: self.is_closed() || self.is_suspended(),
            quant: self.quant_settings(config),
        }
    }

    /// Whether this is the first device error reported by `ncclCommGetAsyncError`.
    pub(crate) fn first_async_error(&self) -> bool {
        !self.async_warned.swap(true, Ordering::Relaxed)
    }
}

/// An optional [`QuantSettings`] in atomics under a sequence number: readers never block and
/// retry only if a write overlapped; writers (`flashcommCommSetQuant`) take turns.
#[derive(Debug)]
struct QuantCell {
    /// Even: stable; odd: a write is in progress.
    seq: AtomicU64,
    /// Bit 0: set; bits 16..32 and 32..48: the reduce-scatter and all-gather widths' codes;
    /// bits 48..52, 52..56 and 56..60: the AllGather, ReduceScatter and AllToAll widths' codes.
    head: AtomicU64,
    /// Group (low 32 bits) and spikes (high 32 bits).
    group_spikes: AtomicU64,
    min_bytes: AtomicU64,
    max_bytes: AtomicU64,
}

fn bits_code(b: QuantBits) -> u64 {
    match b {
        QuantBits::Off => 0,
        QuantBits::Half => 1,
        QuantBits::Bits(n) => 2 + u64::from(n),
    }
}

fn bits_of_code(c: u64) -> QuantBits {
    match c {
        0 => QuantBits::Off,
        1 => QuantBits::Half,
        n => QuantBits::Bits(u8::try_from(n - 2).unwrap_or(u8::MAX)),
    }
}

impl QuantCell {
    const fn new() -> QuantCell {
        QuantCell {
            seq: AtomicU64::new(0),
            head: AtomicU64::new(0),
            group_spikes: AtomicU64::new(0),
            min_bytes: AtomicU64::new(0),
            max_bytes: AtomicU64::new(0),
        }
    }

    fn load(&self) -> Option<QuantSettings> {
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 0 {
                let head = self.head.load(Ordering::Relaxed);
                let gs = self.group_spikes.load(Ordering::Relaxed);
                let min_bytes = self.min_bytes.load(Ordering::Relaxed);
                let max_bytes = self.max_bytes.load(Ordering::Relaxed);
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == before {
                    return (head & 1 == 1).then(|| QuantSettings {
                        rs_bits: bits_of_code((head >> 16) & 0xffff),
                        ag_bits: bits_of_code((head >> 32) & 0xffff),
                        allgather_bits: bits_of_code((head >> 48) & 0xf),
                        reducescatter_bits: bits_of_code((head >> 52) & 0xf),
                        alltoall_bits: bits_of_code((head >> 56) & 0xf),
                        group: gs as u32,
                        spikes: (gs >> 32) as u32,
                        min_bytes,
                        max_bytes,
                    });
                }
            }
            std::hint::spin_loop();
        }
    }

    fn store(&self, q: Option<QuantSettings>) {
        let mut seq = self.seq.load(Ordering::Relaxed);
        loop {
            if seq & 1 == 1 {
                std::hint::spin_loop();
                seq = self.seq.load(Ordering::Relaxed);
                continue;
            }
            match self
                .seq
                .compare_exchange_weak(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => seq = now,
            }
        }
        fence(Ordering::Release);
        let (head, gs, min, max) = match q {
            None => (0, 0, 0, 0),
            Some(q) => (
                1 | bits_code(q.rs_bits) << 16
                    | bits_code(q.ag_bits) << 32
                    | bits_code(q.allgather_bits) << 48
                    | bits_code(q.reducescatter_bits) << 52
                    | bits_code(q.alltoall_bits) << 56,
                u64::from(q.group) | u64::from(q.spikes) << 32,
                q.min_bytes,
                q.max_bytes,
            ),
        };
        self.head.store(head, Ordering::Relaxed);
        self.group_spikes.store(gs, Ordering::Relaxed);
        self.min_bytes.store(min, Ordering::Relaxed);
        self.max_bytes.store(max, Ordering::Relaxed);
        self.seq.store(seq + 2, Ordering::Release);
    }
}

/// One published, immutable version of the table: what readers look communicators up in.
struct Table {
    generation: u64,
    /// Sorted by handle.
    entries: Vec<(CommHandle, Weak<CommState>)>,
}

impl Table {
    fn find(&self, h: CommHandle) -> Option<Arc<CommState>> {
        let i = self.entries.binary_search_by_key(&h, |(k, _)| *k).ok()?;
        self.entries[i].1.upgrade()
    }
}

/// The writers' side: the owning map and the table published from it.
struct Master {
    comms: BTreeMap<CommHandle, Arc<CommState>>,
    published: Arc<Table>,
}

/// The communicators of this process. A fork child starts with none: its parent's belong to the
/// parent (their calls in the child go to the real library, which answers for them), and a lock
/// a parent's thread held at the fork would stay held in the child.
static MASTER: PerProcess<Mutex<Master>> = PerProcess::fresh_in_children();

/// Changes of the table (creations and removals), counted across forks.
static CHANGES: AtomicU64 = AtomicU64::new(0);

/// The generation of the newest table of this process: the fork generation in the high bits,
/// the count of changes below, so that a fork child's threads never take a table cached in its
/// parent for the child's.
#[inline]
fn newest_generation() -> u64 {
    u64::from(crate::calls::os::fork_generation()) << 40 | CHANGES.load(Ordering::Acquire)
}

thread_local! {
    /// The table this thread used last.
    static CACHE: RefCell<Option<Arc<Table>>> = const { RefCell::new(None) };
}

fn master() -> std::sync::MutexGuard<'static, Master> {
    // A poisoned lock only means a thread panicked while holding it; the map is consistent
    // after every statement.
    MASTER
        .get(|| {
            Mutex::new(Master {
                comms: BTreeMap::new(),
                published: Arc::new(Table {
                    generation: newest_generation(),
                    entries: Vec::new(),
                }),
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn published() -> Arc<Table> {
    master().published.clone()
}

/// Publishes the table of the map as it is now (called with the lock held).
fn publish(m: &mut Master) {
    CHANGES.fetch_add(1, Ordering::AcqRel);
    let generation = newest_generation();
    m.published = Arc::new(Table {
        generation,
        entries: m
            .comms
            .iter()
            .map(|(h, s)| (*h, Arc::downgrade(s)))
            .collect(),
    });
}

/// The registry entry of handle `h`, if flashcomm saw it created and not yet destroyed.
/// No lock and no allocation unless the table changed since this thread's last lookup.
pub(crate) fn by_handle(h: CommHandle) -> Option<Arc<CommState>> {
    let newest = newest_generation();
    CACHE
        .try_with(|cache| {
            let Ok(mut cache) = cache.try_borrow_mut() else {
                return published().find(h);
            };
            if cache.as_ref().map(|t| t.generation) != Some(newest) {
                *cache = Some(published());
            }
            cache.as_ref().and_then(|t| t.find(h))
        })
        // This thread is exiting and its cache is gone.
        .unwrap_or_else(|_| published().find(h))
}

/// The registry entry of `comm`, if flashcomm saw it created and not yet destroyed.
pub(crate) fn get(comm: ncclComm_t) -> Option<Arc<CommState>> {
    by_handle(CommHandle::of(comm))
}

/// What one call needs of its communicator, found in one lookup ([`find`]).
pub(crate) struct Found<'s> {
    /// The registry entry (counters, first-use bits, why it is not served).
    pub(crate) state: &'s CommState,
    /// flashcomm's communicator, when flashcomm serves this one.
    pub(crate) served: Option<&'s Communicator>,
    /// What the decision reads ([`CommState::view`]).
    pub(crate) view: CommView,
}

/// Looks `comm` up for one call: its entry, flashcomm's communicator and the decision's view,
/// everything the call reads of the registry, in one visit. `held` keeps the entry alive for the
/// call (a slot on the caller's stack: no allocation, no lock, one atomic generation check as in
/// [`by_handle`]). `None`: flashcomm never saw `comm`, or it was destroyed.
pub(crate) fn find<'s>(
    comm: ncclComm_t,
    config: &Config,
    held: &'s mut Option<Arc<CommState>>,
) -> Option<Found<'s>> {
    *held = get(comm);
    let state = held.as_deref()?;
    let served = state.served();
    Some(Found {
        state,
        served,
        view: state.view_of(served, config),
    })
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
pub(crate) fn register(
    comm: ncclComm_t,
    origin: CommOrigin,
    config_blocking: Option<bool>,
) -> Arc<CommState> {
    let blocking = config_blocking
        .or_else(|| origin.parent().and_then(by_handle).map(|p| p.blocking))
        .unwrap_or_else(default_blocking);
    let state = Arc::new(CommState::new(origin, blocking));
    let mut m = master();
    m.comms.insert(CommHandle::of(comm), state.clone());
    publish(&mut m);
    state
}

/// Takes a communicator out of the registry (destroyed or aborted); the caller holds the last
/// owning reference.
pub(crate) fn remove(h: CommHandle) -> Option<Arc<CommState>> {
    let mut m = master();
    let removed = m.comms.remove(&h);
    if removed.is_some() {
        publish(&mut m);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::{AG, AR, BF16, F32, cfg, coll, lossless, quantized, served};
    use crate::policy::{Decision, NotQuantized, Why, decide, explain};
    use flashcomm_config::GIB;

    #[test]
    fn a_communicators_own_quantization_overrides_the_environment() {
        let config = cfg(&[]);
        let c = coll(AR, BF16, 4096);
        let own = QuantSettings {
            rs_bits: QuantBits::Bits(2),
            ag_bits: QuantBits::Bits(8),
            allgather_bits: QuantBits::Off,
            reducescatter_bits: QuantBits::Off,
            alltoall_bits: QuantBits::Off,
            group: 64,
            spikes: 0,
            min_bytes: 0,
            max_bytes: GIB,
        };
        let view = CommView {
            quant: own,
            ..served(&config)
        };
        assert_eq!(decide(&c, &config, Some(&view)), quantized(2, 8, 64, 0));
        let view = CommView {
            quant: QuantSettings {
                min_bytes: 8192,
                ..own
            },
            ..served(&config)
        };
        assert_eq!(
            decide(&c, &config, Some(&view)),
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
        let d = decide(&c, &config, Some(&served(&config)));
        let text = explain(&d, &c, &config, None, None);
        assert!(
            text.contains("4K bytes of bf16 quantized with rs 4 bits"),
            "{text}"
        );
        let small = coll(AG, F32, 4);
        let d = decide(&small, &config, Some(&served(&config)));
        let text = explain(&d, &small, &config, None, None);
        assert!(
            text.contains("4 bytes is below FLASHCOMM_MIN_BYTES=1K"),
            "{text}"
        );
        let st = CommState::new(CommOrigin::InitRank, true);
        st.set_setup(Setup::NotServed("no GPU driver".into()));
        let d = decide(&c, &config, Some(&st.view(&config)));
        assert_eq!(d, Decision::nccl(Why::NotServed));
        let text = explain(
            &d,
            &c,
            &config,
            Some(&st.view(&config)),
            st.why_not().as_deref(),
        );
        assert!(text.ends_with("no GPU driver"), "{text}");
    }

    #[test]
    fn quantization_settings_survive_the_atomic_cell() {
        let cell = QuantCell::new();
        assert_eq!(cell.load(), None);
        for (rs, ag, op) in [
            (QuantBits::Bits(2), QuantBits::Bits(8), QuantBits::Bits(8)),
            (QuantBits::Off, QuantBits::Half, QuantBits::Half),
            (QuantBits::Bits(255), QuantBits::Off, QuantBits::Off),
        ] {
            let q = QuantSettings {
                rs_bits: rs,
                ag_bits: ag,
                allgather_bits: op,
                reducescatter_bits: QuantBits::Bits(3),
                alltoall_bits: op,
                group: u32::MAX,
                spikes: 4,
                min_bytes: 1,
                max_bytes: u64::MAX,
            };
            cell.store(Some(q));
            assert_eq!(cell.load(), Some(q));
        }
        cell.store(None);
        assert_eq!(cell.load(), None);
    }

    #[test]
    fn lookups_see_every_change_on_every_thread() {
        let comm = 0x6100usize as ncclComm_t;
        let h = CommHandle::of(comm);
        assert!(get(comm).is_none());
        let st = register(comm, CommOrigin::InitRank, Some(true));
        assert!(Arc::ptr_eq(&get(comm).unwrap(), &st));
        // Another thread caches the table, then sees the removal.
        let (to_main, from_thread) = std::sync::mpsc::channel();
        let (to_thread, from_main) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            to_main.send(by_handle(h).is_some()).unwrap();
            from_main.recv().unwrap();
            by_handle(h).is_some()
        });
        assert!(from_thread.recv().unwrap(), "seen while registered");
        let removed = remove(h).unwrap();
        assert!(Arc::ptr_eq(&removed, &st));
        to_thread.send(()).unwrap();
        assert!(!t.join().unwrap(), "gone after removal");
        assert!(get(comm).is_none());
        assert!(remove(h).is_none());
        // An old table of this thread does not keep the state alive.
        drop((removed, st));
        assert!(by_handle(h).is_none());
    }
}
