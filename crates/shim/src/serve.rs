//! Serving a communicator with flashcomm's kernels: building flashcomm's [`Communicator`] on a
//! new NCCL communicator (collectively, with every rank), running routed calls on it, and
//! releasing it.
//!
//! Set-up happens right after the real init returned (or when the outermost group that created
//! the communicator ended), on every rank at the same point, and ends served or not served alike
//! on every rank (docs/architecture.md, "Communicators flashcomm serves"); the reason is logged at
//! INFO and kept for `flashcommCommGetInfo`.
//!
//! The caller's current CUDA context is saved before and restored after set-up and teardown.
//!
//! `flashcommCommSetQuant` on a served communicator of several ranks is collective the same way:
//! its settings feed the routing decision, so the ranks agree on them in one round of the same
//! exchange before any rank applies them ([`set_quant`], [`agree_quant`]).
//!
//! Owns: [`set_up`], [`tear_down`], [`execute`], [`Executed`], [`comm_config`], [`set_quant`],
//! [`set_quant_at_group_end`], [`agree_quant`].
//! May import: `types`, `error`, `logging`, `init`, `calls::cuda`, `calls::nccl`, `policy`,
//! `registry`, `bootstrap`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use flashcomm_comm::{
    Agreement, Bootstrap, Buffers, Build, CommConfig, Communicator, Error as CommError, Request,
    ThreadGroup,
};
use flashcomm_config::{Config, FaultPoint, QuantSettings};
use flashcomm_nccl_sys::ncclResult_t;

use crate::bootstrap::{ExchangeFaults, NcclBootstrap};
use crate::calls::cuda::{OwnStream, SavedContext, check_pointers, user_blocks, user_buffers};
use crate::calls::nccl::{self, Identity};
use crate::error::Error;
use crate::logging::{self, Subsys};
use crate::policy::{self, Decision};
use crate::registry::{CommState, Setup};
use crate::types::{CollCall, Collective, CommHandle, CommOrigin, Held, P2pCall};

/// flashcomm's communicator settings from the configuration (identical on every rank when the
/// environment is, which flashcomm requires of every `FLASHCOMM_*` variable).
pub(crate) fn comm_config(config: &Config) -> CommConfig {
    let s = &config.settings;
    CommConfig {
        // Unset: zero, no time limit (the configuration caps the value so that its nanoseconds
        // fit in the kernels' 64-bit timeout).
        timeout: s
            .timeout_ms
            .map_or(Duration::ZERO, |ms| Duration::from_millis(ms.0)),
        arena_bytes: s.arena_bytes.0,
        pull_bytes: s.pull_bytes.0,
        algo: s.algo,
        proto: s.proto,
        transport: s.transport,
        host_copy: s.host_copy,
        calibrate: true,
        calibrate_moves: s.calibrate_moves,
        quant_calibrate: policy::allreduce_quant_spec(config).into_iter().collect(),
        quant_choice: s.quant_choice,
        graph_mixing: s.graph_mixing,
        early_launch: s.early_launch,
        zero_copy: s.zero_copy,
        ..CommConfig::default()
    }
}

/// Whether this rank can take part in the set-up exchange at all; `Ok`: the real library's
/// identity of the communicator. A communicator that cannot is one the exchange cannot run on:
/// not ready (non-blocking and still initializing, or its group failed), non-blocking, or one
/// whose rank, size and device the real NCCL does not tell.
fn reachable(h: CommHandle, state: &CommState, ready: bool) -> Result<Identity, String> {
    if !ready {
        return Err(
            "it is non-blocking and still initializing (ncclInProgress), or the group that \
             created it failed; flashcomm serves blocking communicators only"
                .into(),
        );
    }
    let id = nccl::identity(h.raw());
    if let Ok(id) = id {
        state.set_identity(id);
    }
    if !state.blocking {
        return Err(
            "it is non-blocking (ncclConfig_t.blocking = 0, or NCCL_COMM_BLOCKING=0); flashcomm \
             serves blocking communicators only"
                .into(),
        );
    }
    let id = id.map_err(|e| format!("the real NCCL cannot tell its rank, size and device: {e}"))?;
    if id.nranks < 1 || id.rank < 0 || id.rank >= id.nranks || id.device < 0 {
        return Err(format!(
            "the real NCCL reports rank {} of {} on device {}",
            id.rank, id.nranks, id.device
        ));
    }
    Ok(id)
}

/// This rank's verdict for the first round of the exchange: whether its own configuration lets
/// flashcomm serve the communicator. A rank that says no still takes part in that round (its
/// peers would otherwise wait for it), and every rank then keeps the communicator with NCCL.
pub(crate) fn entry_verdict(config: &Config, nranks: u32) -> Result<(), String> {
    if let Some(why) = &config.passthrough_forced {
        return Err(format!("pass-through is forced: {why}"));
    }
    if config.settings.disable {
        return Err("FLASHCOMM_DISABLE is set".into());
    }
    let max = config.settings.max_ranks.0;
    if u64::from(nranks) > max {
        return Err(format!(
            "it has {nranks} ranks, more than FLASHCOMM_MAX_RANKS={max}"
        ));
    }
    Ok(())
}

/// What a rank brings to the set-up: its verdict ([`entry_verdict`]), the digest of its
/// configuration ([`Config::agreement_digest`]) and the flashcomm build it runs ([`Build`]).
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub(crate) verdict: Result<(), String>,
    pub(crate) digest: u64,
    pub(crate) build: Build,
}

impl Entry {
    pub(crate) fn of(config: &Config, nranks: u32) -> Entry {
        Entry {
            verdict: entry_verdict(config, nranks),
            digest: config.agreement_digest(),
            build: Build::this(),
        }
    }
}

/// The first round of every set-up: every rank's verdict, configuration digest and build. Every
/// rank gets the same answer: `Ok` only when every rank may serve, every rank runs the same
/// flashcomm build (version, kernel sources and codec wire format: other kernels would read other
/// tags and layouts) and every digest is equal (ranks that run with different `FLASHCOMM_*`
/// settings would route or encode differently).
pub(crate) fn agree_on_entry(ag: &mut Agreement<'_>, entry: &Entry) -> Result<(), String> {
    let all = ag
        .round(entry.verdict.clone().map(|()| {
            let mut v = entry.digest.to_le_bytes().to_vec();
            v.extend_from_slice(&entry.build.to_bytes());
            v
        }))
        .map_err(|e| match e {
            CommError::Unsupported(m) => m,
            other => other.to_string(),
        })?;
    let build = |b: &Vec<u8>| b.get(8..).and_then(Build::from_bytes).map(|(b, _)| b);
    let first_build = all.first().and_then(build);
    for (r, b) in all.iter().enumerate() {
        let theirs = build(b);
        if theirs.is_none() || theirs != first_build {
            return Err(format!(
                "rank {r} runs {} and rank 0 runs {} (every rank must run the same flashcomm build)",
                theirs.map_or_else(|| "another flashcomm build".to_string(), |b| b.to_string()),
                first_build
                    .as_ref()
                    .map_or_else(|| "another flashcomm build".to_string(), |b| b.to_string()),
            ));
        }
    }
    let digest = |b: &Vec<u8>| b.get(..8).and_then(|d| <[u8; 8]>::try_from(d).ok());
    let first = all.first().and_then(digest);
    for (r, b) in all.iter().enumerate() {
        if digest(b).is_none() || digest(b) != first {
            return Err(format!(
                "rank {r} runs with different FLASHCOMM_* settings than rank 0 (every rank must \
                 use the same configuration)"
            ));
        }
    }
    Ok(())
}

/// The quantization settings `flashcommCommSetQuant` gives a communicator, agreed among its
/// ranks in one round: `mine` is what this rank was given (`Ok(None)`: NULL, the environment's;
/// `Err`: why its values are invalid). `Ok` on every rank when every rank was given the same
/// settings in force (NULL counts as the environment's, which set-up agreed on, and `off` as
/// `16`); otherwise the same `Err` on every rank, naming the lowest rank that differs, and the
/// caller changes nothing. The settings feed the routing decision (`policy::decide`: a width
/// pair without kernels or a call outside the window goes to NCCL, or to the lossless kernels),
/// so a rank given settings its peers were not would otherwise route its calls alone.
pub(crate) fn agree_quant(
    ag: &mut Agreement<'_>,
    mine: Result<Option<QuantSettings>, String>,
    config: &Config,
) -> Result<Option<QuantSettings>, String> {
    let record = mine
        .as_ref()
        .map(|q| quant_record(&q.unwrap_or_else(|| config.quant_settings())))
        .map_err(|why| format!("invalid {why}"));
    let all = ag.round(record).map_err(|e| match e {
        CommError::Unsupported(m) => m,
        other => other.to_string(),
    })?;
    let shown = |b: &[u8]| {
        quant_of_record(b).map_or_else(|| "unreadable settings".to_string(), |q| q.to_string())
    };
    if let Some(r) = all.iter().position(|b| *b != all[0]) {
        return Err(format!(
            "rank {r} was given other quantization settings ({}) than rank 0 ({}); every rank \
             must give the same",
            shown(&all[r]),
            shown(&all[0])
        ));
    }
    mine
}

/// The settings as [`agree_quant`] compares them: the five widths (`off` and `16` alike: both
/// keep a collective lossless), group, spikes and window, little-endian.
fn quant_record(q: &QuantSettings) -> Vec<u8> {
    use flashcomm_config::QuantBits;
    let code = |b: QuantBits| match b {
        QuantBits::Bits(n) => n,
        QuantBits::Off | QuantBits::Half => 16,
    };
    let mut v = vec![
        code(q.rs_bits),
        code(q.ag_bits),
        code(q.allgather_bits),
        code(q.reducescatter_bits),
        code(q.alltoall_bits),
    ];
    v.extend_from_slice(&q.group.to_le_bytes());
    v.extend_from_slice(&q.spikes.to_le_bytes());
    v.extend_from_slice(&q.min_bytes.to_le_bytes());
    v.extend_from_slice(&q.max_bytes.to_le_bytes());
    v
}

/// The settings of a [`quant_record`] (for messages).
fn quant_of_record(b: &[u8]) -> Option<QuantSettings> {
    use flashcomm_config::QuantBits;
    let bits = |i: usize| {
        b.get(i).map(|&n| match n {
            16 => QuantBits::Off,
            n => QuantBits::Bits(n),
        })
    };
    let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
    let u64_at = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
    Some(QuantSettings {
        rs_bits: bits(0)?,
        ag_bits: bits(1)?,
        allgather_bits: bits(2)?,
        reducescatter_bits: bits(3)?,
        alltoall_bits: bits(4)?,
        group: u32_at(5)?,
        spikes: u32_at(9)?,
        min_bytes: u64_at(13)?,
        max_bytes: u64_at(21)?,
    })
}

/// What one rank gave `flashcommCommSetQuant`: its settings (`None`: NULL, the environment's),
/// or why they are invalid (as `group` keeps it for a group's end).
pub(crate) type GivenQuant = Result<Option<QuantSettings>, String>;

/// `flashcommCommSetQuant` of communicator `h` on this rank, called outside any group (`given`:
/// its values, checked). A communicator that flashcomm serves with several ranks agrees on them
/// with its other ranks first ([`agree_quant`], one round over the real `ncclAllGather`, so the
/// call is collective): every rank takes them, or every rank fails and nothing changes. One that
/// is not served (every call goes to NCCL whatever the settings), has one rank or was finalized
/// or revoked takes them alone. The ranks of `ncclCommInitAll` are driven by one thread, which
/// would wait in the first one's round for ever: they are refused outside a group (alike, since
/// they all live in this process), and agreed when the group ends
/// ([`set_quant_at_group_end`]).
pub(crate) fn set_quant(h: CommHandle, state: &CommState, given: GivenQuant) -> Result<(), Error> {
    if state.origin == CommOrigin::InitAll && state.served().is_some_and(|c| c.nranks() > 1) {
        return Err(Error::invalid_usage(
            Subsys::Call,
            format!(
                "flashcommCommSetQuant: communicator {h:?} is one of ncclCommInitAll's, whose \
                 ranks one thread drives: call it for each of them inside \
                 ncclGroupStart/ncclGroupEnd (the settings are agreed when the group ends); \
                 nothing changed"
            ),
        ));
    }
    settle_quant(h, state, given)
}

/// The `flashcommCommSetQuant` calls made inside the group that just ended (`ready`: the real
/// group end succeeded), agreed now, one thread per communicator (one thread may drive several
/// ranks, as with the set-ups of a group, which ran before). Returns the failures, for the group
/// end to return. After a failed group nothing is exchanged and nothing changes.
pub(crate) fn set_quant_at_group_end(
    calls: Vec<(CommHandle, GivenQuant)>,
    ready: bool,
) -> Vec<Error> {
    let todo: Vec<(CommHandle, Arc<CommState>, GivenQuant)> = calls
        .into_iter()
        .filter_map(|(h, given)| crate::registry::by_handle(h).map(|st| (h, st, given)))
        .collect();
    if !ready {
        for (h, _, _) in &todo {
            logging::warn(
                Subsys::Call,
                &format!(
                    "flashcommCommSetQuant of communicator {h:?} in a group that failed: nothing \
                     changed"
                ),
            );
        }
        return Vec::new();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .into_iter()
            .map(|(h, st, given)| {
                std::thread::Builder::new()
                    .name("flashcomm-setquant".into())
                    .spawn_scoped(s, move || settle_quant(h, &st, given))
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| {
                match h {
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        Err(Error::internal(
                            Subsys::Call,
                            format!(
                                "flashcommCommSetQuant: internal error in flashcomm ({})",
                                panic_text(p.as_ref())
                            ),
                        ))
                    }),
                    Err(e) => Err(Error::system(
                        Subsys::Call,
                        format!("flashcommCommSetQuant: cannot start a thread: {e}"),
                    )),
                }
                .err()
            })
            .collect()
    })
}

/// [`set_quant`]'s outcome on this rank, agreed where that is needed, applied when it is `Ok`.
fn settle_quant(h: CommHandle, state: &CommState, given: GivenQuant) -> Result<(), Error> {
    let config = &crate::init::state().config;
    let outcome = match state.served() {
        Some(c) if c.nranks() > 1 && !state.is_closed() => {
            agree_quant_over_nccl(h, state, c, given.clone(), config)
        }
        _ => given.clone(),
    };
    match (outcome, given) {
        (Ok(q), _) => {
            state.set_quant(q);
            let what = q.map_or_else(
                || "settings of the environment".to_string(),
                |q| format!("set to {q}"),
            );
            logging::info(
                Subsys::Coll,
                &format!("communicator {h:?}: quantization {what}"),
            );
            Ok(())
        }
        (Err(_), Err(why)) => Err(Error::invalid_argument(
            Subsys::Call,
            format!("flashcommCommSetQuant: invalid {why}; nothing changed"),
        )),
        (Err(why), Ok(_)) => Err(Error::invalid_usage(
            Subsys::Call,
            format!(
                "flashcommCommSetQuant of communicator {h:?}: the ranks did not agree: {why}; \
                 nothing changed on any rank"
            ),
        )),
    }
}

/// [`agree_quant`] with the other ranks of served communicator `c`, over the real NCCL.
fn agree_quant_over_nccl(
    h: CommHandle,
    state: &CommState,
    c: &Communicator,
    given: GivenQuant,
    config: &Config,
) -> GivenQuant {
    let _saved = SavedContext::save();
    let boot = NcclBootstrap::new(
        h,
        c.rank(),
        c.nranks(),
        c.device(),
        state.gate.clone(),
        ExchangeFaults::default(),
    )
    .map_err(|e| {
        format!(
            "this rank cannot take part in the exchange ({e}); the other ranks wait for it in \
             theirs"
        )
    })?;
    let mut ag = Agreement::new(&boot);
    // A panic (a bug) must not leave the round: the other ranks would wait for this one.
    let agreed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        agree_quant(&mut ag, given, config)
    }));
    agreed.unwrap_or_else(|payload| {
        Err(ag
            .abandon(format!(
                "internal error in flashcomm ({})",
                panic_text(payload.as_ref())
            ))
            .to_string())
    })
}

/// Builds one rank over `boot`: the entry round, then [`Communicator::new_agreed`]. A panic in
/// a local step (a bug in flashcomm) does not leave the exchange early: the rank takes part in
/// the next round saying so ([`Agreement::abandon`]), so every rank stops there alike.
fn build(
    boot: &dyn Bootstrap,
    device: i32,
    entry: &Entry,
    cfg: &CommConfig,
) -> Result<Communicator, String> {
    let message = |e: CommError| match e {
        CommError::Unsupported(m) => m,
        other => other.to_string(),
    };
    let mut ag = Agreement::new(boot);
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        agree_on_entry(&mut ag, entry)?;
        Communicator::new_agreed(&mut ag, device, cfg.clone()).map_err(message)
    }));
    match built {
        Ok(r) => r,
        Err(payload) => Err(message(ag.abandon(format!(
            "internal error in flashcomm's set-up ({})",
            panic_text(payload.as_ref())
        )))),
    }
}

/// The text of a caught panic (the hook's stash, else the payload).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    crate::init::take_panic_text().unwrap_or_else(|| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string())
    })
}

/// The faults `FLASHCOMM_DEBUG_FAULT` injects into rank `rank`'s set-up (tests only): those of
/// the exchange, and `cfg` with the communicator's own (`setup-panic`, `setup-step`).
fn faults_of(config: &Config, rank: u32, cfg: &CommConfig) -> (ExchangeFaults, CommConfig) {
    let Some(f) = &config.settings.debug_fault else {
        return (ExchangeFaults::default(), cfg.clone());
    };
    let ex = ExchangeFaults {
        prepare: f.at(FaultPoint::ExchangePrepare, rank).is_some(),
        upload: f.at(FaultPoint::ExchangeUpload, rank),
        enqueue: f.at(FaultPoint::ExchangeEnqueue, rank),
    };
    let cfg = CommConfig {
        panic_at: f
            .at(FaultPoint::SetupPanic, rank)
            .map(|n| if n == 0 { 8 } else { n - 1 }),
        fail_at: f.at(FaultPoint::SetupStep, rank).or(cfg.fail_at),
        ..cfg.clone()
    };
    (ex, cfg)
}

/// Builds flashcomm's communicator of one rank, exchanging over the real NCCL. The exchange's
/// all-gathers are complete when this returns (each round waits for its own).
fn build_over_nccl(
    h: CommHandle,
    state: &CommState,
    id: Identity,
    entry: &Entry,
    cfg: &CommConfig,
) -> Result<Communicator, String> {
    // A communicator of one rank has nobody to wait for it: its own verdict is the outcome.
    if id.nranks == 1
        && let Err(why) = &entry.verdict
    {
        return Err(why.clone());
    }
    let config = &crate::init::state().config;
    let (faults, cfg) = faults_of(config, id.rank as u32, cfg);
    state.exchange_begins();
    let boot = NcclBootstrap::new(
        h,
        id.rank as u32,
        id.nranks as u32,
        id.device,
        state.gate.clone(),
        faults,
    )
    .map_err(|e| {
        let why = format!("this rank cannot take part in the set-up exchange: {e}");
        logging::warn(
            Subsys::Init,
            &format!(
                "communicator {h:?}: {why}; the other ranks wait for it in their set-up, as they \
                 would for its next NCCL call"
            ),
        );
        why
    })?;
    build(&boot, id.device, entry, &cfg)
}

/// Ranks whose creation hook failed (panicked) before their set-up exchange began: each takes
/// part in its exchange's first round saying why, so that its peers, which wait in that round,
/// stop there too and keep the communicator with NCCL alike; one thread per communicator (some
/// may be ranks of one communicator, whose rounds must progress together). Nothing to do for a
/// communicator that has no exchange over NCCL (not ready, non-blocking, one rank,
/// `ncclCommInitAll`'s in-process ones) or whose exchange already began.
pub(crate) fn refuse(comms: &[(CommHandle, Arc<CommState>)], ready: bool, why: &str) {
    let todo: Vec<&(CommHandle, Arc<CommState>)> = comms
        .iter()
        .filter(|(_, st)| {
            ready
                && st.blocking
                && st.origin != CommOrigin::InitAll
                && !st.is_set_up()
                && st.exchange_begins()
        })
        .collect();
    std::thread::scope(|s| {
        for (h, st) in todo {
            let spawned = std::thread::Builder::new()
                .name("flashcomm-setup".into())
                .spawn_scoped(s, move || {
                    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let id = nccl::identity(h.raw())?;
                        if id.nranks <= 1 {
                            return Ok(());
                        }
                        let boot = NcclBootstrap::new(
                            *h,
                            id.rank as u32,
                            id.nranks as u32,
                            id.device,
                            st.gate.clone(),
                            ExchangeFaults::default(),
                        )?;
                        // Every rank stops in this round, naming the lowest failing rank.
                        let verdict = match Agreement::new(&boot).round(Err(why.to_string())) {
                            Err(CommError::Unsupported(m)) => m,
                            Err(e) => e.to_string(),
                            Ok(_) => why.to_string(),
                        };
                        st.set_setup(Setup::NotServed(verdict));
                        Ok::<(), String>(())
                    }));
                    if !matches!(refused, Ok(Ok(()))) {
                        logging::warn(
                            Subsys::Init,
                            &format!(
                                "communicator {h:?}: could not tell the other ranks that its \
                                 set-up failed; they may wait in theirs"
                            ),
                        );
                    }
                });
            if spawned.is_err() {
                logging::warn(
                    Subsys::Init,
                    &format!("communicator {h:?}: cannot start a thread to end its set-up"),
                );
            }
        }
    });
}

fn joined(r: std::thread::Result<Result<Communicator, String>>) -> Result<Communicator, String> {
    r.unwrap_or_else(|_| Err("the set-up thread panicked".into()))
}

/// Builds every rank of `ncclCommInitAll`'s communicators in this process: one thread per
/// device, exchanging through a [`ThreadGroup`].
fn build_in_process(
    todo: &[(CommHandle, Arc<CommState>, Identity)],
    entry: &Entry,
    cfg: &CommConfig,
) -> Vec<Result<Communicator, String>> {
    let n = todo.len();
    let mut ranks: Vec<usize> = todo.iter().map(|(_, _, id)| id.rank as usize).collect();
    ranks.sort_unstable();
    let consistent = todo.iter().all(|(_, _, id)| id.nranks as usize == n)
        && ranks.iter().enumerate().all(|(i, &r)| i == r);
    if !consistent {
        let why = "ncclCommInitAll's communicators do not form one group of ranks 0..n".to_string();
        return (0..n).map(|_| Err(why.clone())).collect();
    }
    let group = ThreadGroup::new(n as u32, cfg.timeout);
    let members = group.members();
    std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .iter()
            .map(|(_, _, id)| {
                let member = &members[id.rank as usize];
                let device = id.device;
                std::thread::Builder::new()
                    .name("flashcomm-setup".into())
                    .spawn_scoped(s, move || build(member, device, entry, cfg))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => joined(h.join()),
                Err(e) => Err(format!("cannot start a set-up thread: {e}")),
            })
            .collect()
    })
}

/// Builds communicators created together inside one group, each in its own thread (they may be
/// ranks of one communicator, whose exchanges must progress together).
fn build_concurrently(
    todo: &[(CommHandle, Arc<CommState>, Identity)],
    config: &Config,
    cfg: &CommConfig,
) -> Vec<Result<Communicator, String>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .iter()
            .map(|(h, st, id)| {
                let (h, id) = (*h, *id);
                std::thread::Builder::new()
                    .name("flashcomm-setup".into())
                    .spawn_scoped(s, move || {
                        // Communicators of one group may differ in size: each has its own verdict.
                        let entry = Entry::of(config, id.nranks as u32);
                        build_over_nccl(h, st, id, &entry, cfg)
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => joined(h.join()),
                Err(e) => Err(format!("cannot start a set-up thread: {e}")),
            })
            .collect()
    })
}

fn finish(h: CommHandle, state: &CommState, outcome: Result<Communicator, String>) {
    match outcome {
        Ok(c) => {
            logging::info(
                Subsys::Init,
                &format!(
                    "communicator {h:?}: rank {} of {} on device {} is served by flashcomm's \
                     kernels (arena {} per rank, largest grid {}, cost model {})",
                    c.rank(),
                    c.nranks(),
                    c.device(),
                    flashcomm_config::Bytes(c.arena_bytes()),
                    c.max_grid(),
                    if c.cost_model().calibrated {
                        "calibrated"
                    } else {
                        "default"
                    }
                ),
            );
            state.set_setup(Setup::Served(Box::new(c)));
        }
        Err(why) => {
            logging::info(
                Subsys::Init,
                &format!("communicator {h:?} stays with NCCL: {why}"),
            );
            state.set_setup(Setup::NotServed(why));
        }
    }
    crate::engage::on_set_up(h, state);
}

/// Sets up newly created communicators (see the module documentation). `init_all`: they are
/// `ncclCommInitAll`'s, every rank of one communicator in this thread. `ready`: the real library
/// returned success for them.
pub(crate) fn set_up(comms: &[(CommHandle, Arc<CommState>)], init_all: bool, ready: bool) {
    let config = &crate::init::state().config;
    let _saved = SavedContext::save();
    let mut todo = Vec::with_capacity(comms.len());
    let mut refused = None;
    for (h, st) in comms {
        match reachable(*h, st, ready) {
            Ok(id) => {
                // Fault injection (tests): the creation hook panics here, before the exchange.
                if let Some(f) = &config.settings.debug_fault
                    && f.at(FaultPoint::HookPanic, id.rank as u32).is_some()
                {
                    panic!("panic injected into the creation hook (FLASHCOMM_DEBUG_FAULT)");
                }
                todo.push((*h, st.clone(), id))
            }
            Err(why) => {
                refused.get_or_insert_with(|| why.clone());
                finish(*h, st, Err(why));
            }
        }
    }
    if todo.is_empty() {
        return;
    }
    if init_all && let Some(why) = refused {
        // The ranks of one in-process communicator are set up together or not at all.
        for (h, st, _) in &todo {
            finish(
                *h,
                st,
                Err(format!("another rank of ncclCommInitAll: {why}")),
            );
        }
        return;
    }
    let cfg = comm_config(config);
    // Every reachable rank takes part in the exchange, whatever its own verdict: a rank with
    // FLASHCOMM_DISABLE, a bad configuration or too many ranks says so in the first round.
    let results = if init_all {
        let entry = Entry::of(config, todo.len() as u32);
        build_in_process(&todo, &entry, &cfg)
    } else if let [(h, st, id)] = todo.as_slice() {
        let entry = Entry::of(config, id.nranks as u32);
        vec![build_over_nccl(*h, st, *id, &entry, &cfg)]
    } else {
        build_concurrently(&todo, config, &cfg)
    };
    for ((h, st, _), r) in todo.iter().zip(results) {
        finish(*h, st, r);
    }
}

/// Releases flashcomm's side of a communicator that is being destroyed (`abort`: aborted),
/// before the real library sees the call: an abort first asks the kernels to leave their waits.
/// The memory goes to a thread of its own, which frees it once the last launch has finished
/// (`Communicator::defer_release`); this waits for that at most [`DESTROY_WAIT`] and returns
/// either way, so a destroy never hangs in a free behind device work that does not end (another
/// communicator's kernel waiting for a dead peer). The arena is freed when no call in flight on
/// another thread still holds the communicator.
pub(crate) fn tear_down(h: CommHandle, state: Arc<CommState>, abort: bool) {
    let _saved = SavedContext::save();
    let Some(c) = state.served() else {
        return;
    };
    if abort {
        c.abort();
    }
    let released = c.defer_release();
    drop(state);
    if !released.wait(DESTROY_WAIT) {
        logging::warn(
            Subsys::Init,
            &format!(
                "communicator {h:?}: flashcomm's memory is not freed {DESTROY_WAIT:?} after the \
                 destroy (its last kernel has not finished, or freeing waits for device work that \
                 does not end); it is freed when that work ends, and the destroy goes on"
            ),
        );
        return;
    }
    // The count makes a leak visible from outside (tests/c/lifecycle.c reads these lines).
    logging::info(
        Subsys::Init,
        &format!(
            "communicator {h:?}: flashcomm's communicator released; streams of flashcomm's own \
             live in the process: {}",
            OwnStream::live()
        ),
    );
}

/// How long `ncclCommDestroy` waits for flashcomm's memory of the communicator to be freed (its
/// last kernel finished, then the frees) before it goes on without: NCCL's destroy flushes the
/// communicator's work, so a correct program's kernels have finished long before.
pub(crate) const DESTROY_WAIT: Duration = Duration::from_secs(10);

/// How long `ncclCommAbort` waits, after the real abort returned, for flashcomm's memory of the
/// communicator to be freed (its last launch left its waits when the abort flag was set; it only
/// stays when it is queued behind work the abort does not end).
pub(crate) const ABORT_WAIT: Duration = Duration::from_secs(2);

/// Releases flashcomm's side of an aborted communicator, after the real abort returned: its
/// memory goes to a thread of its own that frees it once the last launch has finished
/// (`Communicator::defer_release`), and this waits at most [`ABORT_WAIT`] for that: abort returns
/// whatever the device does (no free ever runs on this thread). The arena itself is kept for
/// good when there are peers: one that has not noticed the failure may still write into it.
pub(crate) fn release_aborted(h: CommHandle, state: Arc<CommState>) {
    let _saved = SavedContext::save();
    let Some(c) = state.served() else {
        return;
    };
    let released = c.defer_release();
    drop(state);
    if released.wait(ABORT_WAIT) {
        logging::info(
            Subsys::Init,
            &format!("communicator {h:?}: flashcomm's communicator released after abort"),
        );
    } else {
        logging::warn(
            Subsys::Init,
            &format!(
                "communicator {h:?}: flashcomm's last kernel is still queued {ABORT_WAIT:?} \
                 after ncclCommAbort (behind work that does not finish), or freeing waits for such \
                 work; its memory is freed when that work ends, or never, and abort returns"
            ),
        );
    }
}

/// Forwards a call on a communicator flashcomm serves to NCCL in the communicator's order: after
/// flashcomm's last launch if that went to another stream, and recorded as the communicator's
/// last operation, so that flashcomm's next launch on another stream comes after it (NCCL
/// orders all work of a communicator; flashcomm's kernels and NCCL's share it). Calls inside a
/// group are enqueued by NCCL only at the group's end and are not ordered here.
pub(crate) fn forward_in_order(
    served: Option<&Communicator>,
    call: &CollCall,
    grouped: bool,
    forward: impl FnOnce() -> ncclResult_t,
) -> ncclResult_t {
    let Some(c) = served.filter(|_| !grouped) else {
        return forward();
    };
    let stream = call.req.stream;
    let record = c.before_foreign(stream).ok().flatten();
    let r = forward();
    if let Some(op) = record
        && (r == ncclResult_t::ncclSuccess || r == ncclResult_t::ncclInProgress)
    {
        let _ = c.after_foreign(stream, op);
    }
    r
}

/// Gives a held-back `ncclSend`/`ncclRecv` to the real library, unchanged (see
/// `grouped::hold_in_group`).
pub(crate) fn forward_p2p(p: &P2pCall) -> ncclResult_t {
    let c = &p.call;
    let (send, buf) = match c.req.coll {
        Collective::Send => (true, c.sendbuff.cast_mut()),
        _ => (false, c.recvbuff),
    };
    nccl::send_recv(
        send,
        buf,
        c.req.count as usize,
        c.datatype,
        p.peer,
        c.comm,
        c.req.stream.0.cast(),
    )
    .unwrap_or_else(|why| {
        Error::invalid_usage(
            Subsys::of(c.req.coll),
            format!("{}: the real library cannot take it: {why}", c.api),
        )
        .report()
    })
}

/// Gives a held-back nested `ncclGroupStart`/`ncclGroupEnd` to the real library.
pub(crate) fn forward_group_call(h: &Held) -> ncclResult_t {
    let start = matches!(h, Held::GroupStart);
    nccl::group_call(start).unwrap_or_else(|why| {
        Error::invalid_usage(Subsys::Init, format!("a held group call: {why}")).report()
    })
}

/// The outcome of a routed call.
pub(crate) enum Executed {
    /// flashcomm ran it (or refused it with an error): this is the result.
    Done(ncclResult_t),
    /// flashcomm refused its arguments before its kernels would touch them (a NULL buffer):
    /// this is the result, and the call is not counted (as `flashcommGetStats` documents).
    Invalid(ncclResult_t),
    /// Asked to be quantized, flashcomm ran it on the lossless kernels, which the calibrated
    /// cost model predicts faster at this size (`FLASHCOMM_QUANT_CHOICE=auto`): this is the
    /// result.
    Unquantized(ncclResult_t),
    /// flashcomm's kernels do not support this call: it goes to NCCL (the reason is logged the
    /// first time; static where flashcomm itself refuses, so that refusing allocates nothing).
    Refused(Cow<'static, str>),
}

/// The NCCL error of a failed served call, reported (message and `ncclGetLastError`).
pub(crate) fn report(call: &CollCall, e: CommError) -> ncclResult_t {
    let sub = Subsys::of(call.req.coll);
    let msg = format!("{} on communicator {:p}: {e}", call.api, call.comm);
    match e {
        CommError::InvalidArgument(_) => Error::invalid_argument(sub, msg),
        CommError::InvalidUsage(_) => Error::invalid_usage(sub, msg),
        CommError::Cuda(_) => Error::cuda(sub, msg),
        CommError::Remote(_) => Error::remote(sub, msg),
        CommError::Timeout(_) => Error::timeout(sub, msg),
        CommError::Bootstrap(_) => Error::system(sub, msg),
        CommError::Unsupported(_) | CommError::Internal(_) => Error::internal(sub, msg),
    }
    .report()
}

/// Runs a call [`policy::decide`] sent to flashcomm's kernels (`served`: the communicator the
/// call's lookup found). Allocates no device memory and does not synchronize (the
/// communicator's collectives do neither), so it may be captured.
///
/// A device error of an earlier call comes first (`ncclRemoteError` or `ncclTimeout`, without
/// launching): `Communicator::execute` checks it before anything else, and a call refused here
/// before reaching it checks it first too.
pub(crate) fn execute(
    served: Option<&Communicator>,
    call: &CollCall,
    blocks: Option<(&[u64], &[u64])>,
    d: &Decision,
    config: &Config,
) -> Executed {
    let Some(c) = served else {
        return Executed::Refused(Cow::Borrowed("flashcomm does not serve the communicator"));
    };
    let (send, recv);
    let req = match blocks {
        // The AllToAll of a Send/Recv group with its blocks apart: lossless (its element type,
        // when flashcomm has one, changes neither the plan nor the kernel).
        Some((s, r)) => {
            (send, recv) = (user_blocks(s, call.bytes), user_blocks(r, call.bytes));
            call.req.scattered(&send, &recv)
        }
        None => match request(c, call, d, config) {
            Ok(req) => req,
            Err(refusal) => {
                return match c.check_status() {
                    Err(e) => Executed::Done(report(call, e)),
                    Ok(()) => refusal.executed(call),
                };
            }
        },
    };
    match c.execute(&req) {
        Ok(p) if d.quant.is_some() && p.quant.is_none() => {
            Executed::Unquantized(ncclResult_t::ncclSuccess)
        }
        Ok(_) => Executed::Done(ncclResult_t::ncclSuccess),
        Err(CommError::Unsupported(why)) => Executed::Refused(Cow::Owned(why)),
        Err(e) => Executed::Done(report(call, e)),
    }
}

/// Why a routed call does not reach flashcomm's communicator, found before the device's status
/// is read (which comes first: [`execute`]); nothing is reported until then.
enum Refusal {
    /// A buffer flashcomm's kernels would touch is NULL (its name).
    Null(&'static str),
    /// The buffers' sizes overflow.
    Overflow,
    /// `NCCL_CHECK_POINTERS=1` found a buffer that is not the communicator's device memory.
    Pointers(String),
    /// Not a call flashcomm's kernels take.
    NotOurs,
}

impl Refusal {
    /// The outcome, reported.
    fn executed(self, call: &CollCall) -> Executed {
        match self {
            Refusal::Null(name) => Executed::Invalid(
                Error::invalid_argument(
                    Subsys::of(call.req.coll),
                    format!("{}: {name} is NULL with count {}", call.api, call.req.count),
                )
                .report(),
            ),
            Refusal::Overflow => Executed::Refused(Cow::Borrowed("the buffer sizes overflow")),
            Refusal::Pointers(msg) => Executed::Done(report(call, CommError::InvalidArgument(msg))),
            Refusal::NotOurs => {
                Executed::Refused(Cow::Borrowed("not a call flashcomm's kernels take"))
            }
        }
    }
}

/// The request `c` runs for `call` as decided (`d`): the call's own request ([`CollCall::req`],
/// typed where its arguments were checked) completed with its buffers, of the sizes NCCL's
/// contract gives them, the quantization asked for and whether the lossless kernels may take it
/// instead.
fn request(
    c: &Communicator,
    call: &CollCall,
    d: &Decision,
    config: &Config,
) -> Result<Request<'static>, Refusal> {
    // flashcomm's kernels would touch it: refused here, where NCCL would launch on it (its own
    // check of the buffers runs only with NCCL_CHECK_POINTERS=1, which is honoured below).
    if let Some(name) = call.null_buffer() {
        return Err(Refusal::Null(name));
    }
    let Some((send, recv)) = user_buffers(call, u64::from(c.nranks())) else {
        return Err(Refusal::Overflow);
    };
    if config.settings.check_pointers
        && let Err(msg) = check_pointers(call, &send, &recv, c.device())
    {
        return Err(Refusal::Pointers(msg));
    }
    // The lossless AllGather and AllToAll move bytes of any datatype (their element type, when
    // flashcomm has one, changes neither their plan nor their kernel); the reducing kinds need
    // flashcomm's element type.
    let req = call.req;
    match (req.coll, req.dtype) {
        (Collective::AllReduce | Collective::ReduceScatter, Some(_))
        | (Collective::AllGather | Collective::AlltoAll, _) => {}
        _ => return Err(Refusal::NotOurs),
    }
    let (quant, lossless_allowed) = match (d.quant, req.dtype) {
        (Some(q), Some(_)) => {
            // Outside the lossless kernels' window a call asked to be quantized stays quantized
            // whatever the cost model says: the window says the lossless kernels must not take it.
            let s = &config.settings;
            let lossless_allowed = req.coll == Collective::AllReduce
                && (s.min_bytes.0..=s.max_bytes.0).contains(&call.bytes);
            (Some(q), lossless_allowed)
        }
        _ => (req.quant, req.lossless_allowed),
    };
    // The same value, its remaining fields filled in (plain data: `Request::quantized` and
    // `Request::between` set exactly these).
    Ok(Request {
        buffers: Buffers::Contiguous { send, recv },
        quant,
        lossless_allowed,
        ..req
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use flashcomm_comm::ThreadBootstrap;

    /// Counts the rounds a rank ran.
    struct Counting<'a>(&'a ThreadBootstrap, AtomicU32);

    impl Bootstrap for Counting<'_> {
        fn rank(&self) -> u32 {
            self.0.rank()
        }
        fn size(&self) -> u32 {
            self.0.size()
        }
        fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.all_gather(mine)
        }
    }

    /// Runs the entry round on one thread per rank, rank `r` with environment `envs[r]`;
    /// returns every rank's (rounds run, outcome).
    fn entry_round(envs: &[Vec<(&str, &str)>]) -> Vec<(u32, Result<(), String>)> {
        entry_round_built(envs, &vec![Build::this(); envs.len()])
    }

    /// [`entry_round`] with rank `r` running build `builds[r]`.
    fn entry_round_built(
        envs: &[Vec<(&str, &str)>],
        builds: &[Build],
    ) -> Vec<(u32, Result<(), String>)> {
        let n = envs.len() as u32;
        let group = ThreadGroup::new(n, Duration::ZERO);
        let members = group.members();
        std::thread::scope(|s| {
            let hs: Vec<_> = members
                .iter()
                .zip(envs)
                .zip(builds)
                .map(|((m, env), build)| {
                    s.spawn(move || {
                        let config = Config::from_vars(env.iter().copied());
                        let entry = Entry {
                            build: build.clone(),
                            ..Entry::of(&config, n)
                        };
                        let c = Counting(m, AtomicU32::new(0));
                        let mut ag = Agreement::new(&c);
                        let r = agree_on_entry(&mut ag, &entry);
                        (c.1.load(Ordering::Relaxed), r)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn all_alike(results: &[(u32, Result<(), String>)]) -> Result<(), String> {
        for r in results {
            assert_eq!(
                r, &results[0],
                "every rank runs the same rounds and gets the same verdict"
            );
        }
        assert_eq!(results[0].0, 1, "one round");
        results[0].1.clone()
    }

    /// Runs [`agree_quant`] on one thread per rank, rank `r` given `given[r]`.
    fn quant_round(given: &[GivenQuant], config: &Config) -> Vec<GivenQuant> {
        let group = ThreadGroup::new(given.len() as u32, Duration::ZERO);
        let members = group.members();
        std::thread::scope(|s| {
            let hs: Vec<_> = members
                .iter()
                .zip(given)
                .map(|(m, g)| {
                    s.spawn(move || agree_quant(&mut Agreement::new(m), g.clone(), config))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn set_quant_agrees_or_fails_alike_naming_the_rank() {
        let config = Config::from_vars([("FLASHCOMM_QUANT_BITS", "4")]);
        let env = config.quant_settings();
        let q2 = QuantSettings {
            rs_bits: flashcomm_config::QuantBits::Bits(2),
            ag_bits: flashcomm_config::QuantBits::Bits(8),
            max_bytes: 1 << 20,
            ..env
        };
        // The same settings, NULL beside the environment's own values included: each rank keeps
        // what it was given.
        let got = quant_round(&[Ok(Some(q2)), Ok(Some(q2)), Ok(Some(q2))], &config);
        assert!(got.iter().all(|g| *g == Ok(Some(q2))), "{got:?}");
        let got = quant_round(&[Ok(None), Ok(Some(env)), Ok(None)], &config);
        assert_eq!(got, vec![Ok(None), Ok(Some(env)), Ok(None)]);
        // `off` and `16` are one setting.
        let off = QuantSettings {
            rs_bits: flashcomm_config::QuantBits::Off,
            ..env
        };
        let half = QuantSettings {
            rs_bits: flashcomm_config::QuantBits::Half,
            ..env
        };
        let got = quant_round(&[Ok(Some(off)), Ok(Some(half))], &config);
        assert!(got.iter().all(Result::is_ok), "{got:?}");
        // Rank 2 differs: every rank fails with the same message, naming it and both settings.
        let got = quant_round(&[Ok(Some(q2)), Ok(Some(q2)), Ok(None)], &config);
        let why = got[0].clone().unwrap_err();
        assert!(got.iter().all(|g| *g == Err(why.clone())), "{got:?}");
        assert!(
            why.starts_with("rank 2 was given other quantization settings")
                && why.contains(&env.to_string())
                && why.contains(&q2.to_string()),
            "{why}"
        );
        // Rank 1's values are invalid: every rank fails, saying so.
        let got = quant_round(
            &[
                Ok(Some(q2)),
                Err("group 100 (allowed: 32, 64, 128, 256)".into()),
            ],
            &config,
        );
        assert!(
            got.iter()
                .all(|g| *g == Err("rank 1: invalid group 100 (allowed: 32, 64, 128, 256)".into())),
            "{got:?}"
        );
        // The record is the settings, exactly.
        for q in [env, q2, off] {
            assert_eq!(quant_of_record(&quant_record(&q)), Some(q));
        }
    }

    #[test]
    fn ranks_with_the_same_configuration_go_on() {
        let env = vec![
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_NCCL_LIB", "/a/libnccl.so.2"),
        ];
        let mut envs = vec![env.clone(); 4];
        // Where the real library lies and logging may differ.
        envs[2] = vec![
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_NCCL_LIB", "/b/libnccl.so.2"),
            ("NCCL_DEBUG", "INFO"),
        ];
        assert_eq!(all_alike(&entry_round(&envs)), Ok(()));
    }

    #[test]
    fn flashcomm_disable_on_some_ranks_keeps_every_rank_with_nccl() {
        for disabled in 0..4 {
            let mut envs = vec![vec![]; 4];
            envs[disabled] = vec![("FLASHCOMM_DISABLE", "1")];
            let why = all_alike(&entry_round(&envs)).unwrap_err();
            assert_eq!(why, format!("rank {disabled}: FLASHCOMM_DISABLE is set"));
        }
        // On every rank: the lowest one is named.
        let envs = vec![vec![("FLASHCOMM_DISABLE", "1")]; 3];
        assert_eq!(
            all_alike(&entry_round(&envs)),
            Err("rank 0: FLASHCOMM_DISABLE is set".into())
        );
    }

    #[test]
    fn different_settings_or_a_bad_value_on_one_rank_keep_every_rank_with_nccl() {
        let mut envs = vec![vec![("FLASHCOMM_QUANT_BITS", "4")]; 3];
        envs[1] = vec![("FLASHCOMM_QUANT_BITS", "8")];
        let why = all_alike(&entry_round(&envs)).unwrap_err();
        assert!(
            why.contains("rank 1 runs with different FLASHCOMM_* settings"),
            "{why}"
        );

        let mut envs = vec![vec![]; 3];
        envs[2] = vec![("FLASHCOMM_TIMEOUT_MS", "30000")];
        let why = all_alike(&entry_round(&envs)).unwrap_err();
        assert!(why.contains("rank 2 runs with different"), "{why}");

        let mut envs = vec![vec![]; 2];
        envs[1] = vec![("FLASHCOMM_PROTO", "fast")];
        let why = all_alike(&entry_round(&envs)).unwrap_err();
        assert!(why.starts_with("rank 1: pass-through is forced"), "{why}");
        assert!(why.contains("FLASHCOMM_PROTO"), "{why}");

        // Too many ranks for FLASHCOMM_MAX_RANKS: every rank says so.
        let envs = vec![vec![("FLASHCOMM_MAX_RANKS", "2")]; 3];
        let why = all_alike(&entry_round(&envs)).unwrap_err();
        assert!(why.contains("more than FLASHCOMM_MAX_RANKS=2"), "{why}");
    }

    /// Ranks of one communicator that run different flashcomm builds (another version, other
    /// kernel sources, another codec wire format, other Rust sources of the library) would read
    /// each other's tags and layouts wrongly, whatever their settings: every rank stays with NCCL
    /// and says which builds met.
    #[test]
    fn a_different_flashcomm_build_on_one_rank_keeps_every_rank_with_nccl() {
        let this = Build::this();
        let others = [
            Build {
                version: "0.0.9".into(),
                ..this.clone()
            },
            Build {
                kernels: this.kernels ^ 0x10,
                ..this.clone()
            },
            Build {
                codec: this.codec + 1,
                ..this.clone()
            },
            Build {
                library: this.library ^ 0x10,
                ..this.clone()
            },
        ];
        for other in others {
            let mut builds = vec![this.clone(); 3];
            builds[2] = other.clone();
            let why =
                all_alike(&entry_round_built(&[vec![], vec![], vec![]], &builds)).unwrap_err();
            assert!(
                why.contains("rank 2 runs") && why.contains(&other.to_string()),
                "{why}"
            );
            assert!(why.contains("the same flashcomm build"), "{why}");
        }
    }

    #[test]
    fn the_timeout_is_unset_by_default_and_zero_means_no_limit() {
        assert_eq!(comm_config(&Config::default()).timeout, Duration::ZERO);
        let c = Config::from_vars([("FLASHCOMM_TIMEOUT_MS", "1500")]);
        assert_eq!(comm_config(&c).timeout, Duration::from_millis(1500));
        let max = flashcomm_config::MAX_TIMEOUT_MS.to_string();
        let c = Config::from_vars([("FLASHCOMM_TIMEOUT_MS", max.as_str())]);
        let ns = comm_config(&c).timeout.as_nanos();
        assert!(
            ns <= u128::from(u64::MAX),
            "fits the kernels' 64-bit timeout: {ns}"
        );
    }

    #[test]
    fn calibration_times_the_quantized_allreduce_the_environment_asks_for() {
        use flashcomm_comm::QuantSpec;
        let cfg = |vars: &[(&str, &str)]| comm_config(&Config::from_vars(vars.iter().copied()));
        let none = cfg(&[]);
        assert!(none.quant_calibrate.is_empty());
        assert_eq!(none.quant_choice, flashcomm_comm::QuantChoice::Auto);
        let q4 = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_GROUP", "64"),
        ]);
        assert_eq!(
            q4.quant_calibrate,
            vec![QuantSpec::new(4, 4, 64, 2).unwrap()]
        );
        let pair = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "3"),
            ("FLASHCOMM_QUANT_AG_BITS", "8"),
            ("FLASHCOMM_QUANT_CHOICE", "always"),
        ]);
        assert_eq!(
            pair.quant_calibrate,
            vec![QuantSpec::new(3, 8, 128, 2).unwrap()]
        );
        assert_eq!(pair.quant_choice, flashcomm_comm::QuantChoice::Always);
        // Not for AllReduce, or a pair without kernels (it goes to NCCL): nothing to time.
        let ops = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_OPS", "alltoall"),
        ]);
        assert!(ops.quant_calibrate.is_empty());
        let bad = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "6"),
            ("FLASHCOMM_QUANT_AG_BITS", "8"),
        ]);
        assert!(bad.quant_calibrate.is_empty());
        let f32_only = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_DTYPES", "f32"),
        ]);
        assert!(f32_only.quant_calibrate.is_empty());
    }
}
