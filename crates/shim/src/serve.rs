//! Serving a communicator with flashcomm's kernels: building flashcomm's [`Communicator`] on a
//! new NCCL communicator (collectively, with every rank), running routed calls on it, and
//! releasing it.
//!
//! Set-up happens right after the real init returned (or when the outermost group that created
//! the communicator ended), on every rank at the same point:
//!
//! 1. Checks every rank answers alike: configuration (`FLASHCOMM_DISABLE`, a bad configuration),
//!    blocking mode (non-blocking communicators stay with NCCL), and the size reported by the real
//!    `ncclCommCount` against `FLASHCOMM_MAX_RANKS`.
//! 2. `Communicator::new` with the configuration of `FLASHCOMM_TIMEOUT_MS`, `FLASHCOMM_ARENA_BYTES`,
//!    `FLASHCOMM_PROTO` and `FLASHCOMM_ALGO` (calibration on), exchanging its set-up records over
//!    the real NCCL ([`NcclBootstrap`]), or, for `ncclCommInitAll`, over an in-process
//!    [`ThreadGroup`] with one thread per device. `Communicator::new` agrees on failures across
//!    ranks (several machines, no peer access, no kernels in this build, ...), so every rank ends
//!    up served or not served alike; the reason is logged at INFO and kept for
//!    `flashcommCommGetInfo`.
//!
//! The caller's current CUDA context is saved before and restored after set-up and teardown.
//!
//! Owns: [`set_up`], [`tear_down`], [`execute`], [`Executed`], [`comm_config`].
//! May import: `types`, `error`, `logging`, `init`, `calls::cuda`, `calls::nccl`, `policy`,
//! `registry`, `bootstrap`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use flashcomm_comm::{
    Algorithm, Choice, CommConfig, Communicator, Error as CommError, Protocol, Stream, ThreadGroup,
    Transport,
};
use flashcomm_config::{Algo, Config, Proto, Transport as ConfigTransport};
use flashcomm_nccl_sys::ncclResult_t;

use crate::bootstrap::NcclBootstrap;
use crate::calls::cuda::{SavedContext, user_buffers};
use crate::calls::nccl::{self, Identity};
use crate::error::Error;
use crate::logging::{self, Subsys};
use crate::policy::{self, Decision};
use crate::registry::{CommState, Setup};
use crate::types::{CollCall, Collective, CommHandle};

/// flashcomm's communicator settings from the configuration (identical on every rank when the
/// environment is, which flashcomm requires of every `FLASHCOMM_*` variable).
pub(crate) fn comm_config(config: &Config) -> CommConfig {
    let s = &config.settings;
    CommConfig {
        timeout: Duration::from_millis(s.timeout_ms.0),
        arena_bytes: s.arena_bytes.0,
        algo: match s.algo {
            Algo::Auto => Choice::Auto,
            Algo::Oneshot => Choice::Force(Algorithm::OneShot),
            Algo::Twoshot => Choice::Force(Algorithm::TwoShot),
        },
        proto: match s.proto {
            Proto::Auto => Choice::Auto,
            Proto::Ll => Choice::Force(Protocol::Ll),
            Proto::Block => Choice::Force(Protocol::Block),
        },
        transport: match s.transport {
            ConfigTransport::Auto => Choice::Auto,
            ConfigTransport::P2p => Choice::Force(Transport::P2p),
            ConfigTransport::Host => Choice::Force(Transport::Host),
        },
        calibrate: true,
        ..CommConfig::default()
    }
}

/// What every rank decides alike before talking to the others; `Ok`: the real library's
/// identity of the communicator, and set-up may go on.
fn precheck(
    h: CommHandle,
    state: &CommState,
    ready: bool,
    config: &Config,
) -> Result<Identity, String> {
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
    if let Some(why) = &config.passthrough_forced {
        return Err(format!("pass-through is forced: {why}"));
    }
    if config.settings.disable {
        return Err("FLASHCOMM_DISABLE is set".into());
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
    let max = config.settings.max_ranks.0;
    if id.nranks as u64 > max {
        return Err(format!(
            "it has {} ranks, more than FLASHCOMM_MAX_RANKS={max}",
            id.nranks
        ));
    }
    Ok(id)
}

/// Builds flashcomm's communicator of one rank, exchanging over the real NCCL.
fn build_over_nccl(h: CommHandle, id: Identity, cfg: &CommConfig) -> Result<Communicator, String> {
    let boot = NcclBootstrap::new(h, id.rank as u32, id.nranks as u32, id.device, cfg.timeout)
        .map_err(|e| format!("cannot prepare the set-up exchange: {e}"))?;
    Communicator::new(&boot, id.device, cfg.clone()).map_err(|e| e.to_string())
}

fn joined(r: std::thread::Result<Result<Communicator, String>>) -> Result<Communicator, String> {
    r.unwrap_or_else(|_| Err("the set-up thread panicked".into()))
}

/// Builds every rank of `ncclCommInitAll`'s communicators in this process: one thread per
/// device, exchanging through a [`ThreadGroup`].
fn build_in_process(
    todo: &[(CommHandle, Arc<CommState>, Identity)],
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
                    .spawn_scoped(s, move || {
                        Communicator::new(member, device, cfg.clone()).map_err(|e| e.to_string())
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

/// Builds communicators created together inside one group, each in its own thread (they may be
/// ranks of one communicator, whose exchanges must progress together).
fn build_concurrently(
    todo: &[(CommHandle, Arc<CommState>, Identity)],
    cfg: &CommConfig,
) -> Vec<Result<Communicator, String>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .iter()
            .map(|&(h, _, id)| {
                std::thread::Builder::new()
                    .name("flashcomm-setup".into())
                    .spawn_scoped(s, move || build_over_nccl(h, id, cfg))
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
        match precheck(*h, st, ready, config) {
            Ok(id) => todo.push((*h, st.clone(), id)),
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
    let results = if init_all {
        build_in_process(&todo, &cfg)
    } else if let [(h, _, id)] = todo.as_slice() {
        vec![build_over_nccl(*h, *id, &cfg)]
    } else {
        build_concurrently(&todo, &cfg)
    };
    for ((h, st, _), r) in todo.iter().zip(results) {
        finish(*h, st, r);
    }
}

/// Releases flashcomm's side of a communicator that is being destroyed (`abort`: aborted),
/// before the real library sees the call: an abort first asks the kernels to leave their waits;
/// then the last launch is waited for and the state dropped (the arena is freed when no call in
/// flight on another thread still holds it).
pub(crate) fn tear_down(h: CommHandle, state: Arc<CommState>, abort: bool) {
    let _saved = SavedContext::save();
    if let Some(c) = state.served() {
        if abort {
            c.abort();
        }
        if let Err(e) = c.wait_idle() {
            logging::info(
                Subsys::Init,
                &format!("communicator {h:?}: waiting for flashcomm's last kernel failed: {e}"),
            );
        }
        logging::info(
            Subsys::Init,
            &format!("communicator {h:?}: flashcomm's communicator released"),
        );
    }
    drop(state);
}

/// The outcome of a routed call.
pub(crate) enum Executed {
    /// flashcomm ran it (or refused it with an error): this is the result.
    Done(ncclResult_t),
    /// flashcomm's kernels do not support this call: it goes to NCCL (the reason is logged the
    /// first time; static where flashcomm itself refuses, so that refusing allocates nothing).
    Refused(Cow<'static, str>),
}

fn report(call: &CollCall, e: CommError) -> ncclResult_t {
    let sub = Subsys::of(call.kind);
    let msg = format!("{} on communicator {:p}: {e}", call.api, call.comm);
    match e {
        CommError::InvalidArgument(_) => Error::invalid_argument(sub, msg),
        CommError::InvalidUsage(_) => Error::invalid_usage(sub, msg),
        CommError::Cuda { .. } => Error::cuda(sub, msg),
        CommError::Remote(_) => Error::remote(sub, msg),
        CommError::Bootstrap(_) => Error::system(sub, msg),
        CommError::Unsupported(_) | CommError::Internal(_) => Error::internal(sub, msg),
    }
    .report()
}

/// Runs a call [`policy::decide`] sent to flashcomm's kernels. Allocates no device memory and
/// does not synchronize (the communicator's collectives do neither), so it may be captured.
pub(crate) fn execute(state: &CommState, call: &CollCall, d: &Decision) -> Executed {
    let Some(c) = state.served() else {
        return Executed::Refused(Cow::Borrowed("flashcomm does not serve the communicator"));
    };
    if let Err(e) = c.check_status() {
        return Executed::Done(report(call, e));
    }
    let Some((send, recv)) = user_buffers(call, u64::from(c.nranks())) else {
        return Executed::Refused(Cow::Borrowed("the buffer sizes overflow"));
    };
    let stream = Stream(call.stream.cast());
    let count = call.count as u64;
    let dtype = policy::float_type(call.datatype);
    let r = match (call.kind, dtype, d.quant) {
        (Collective::AllReduce, Some(t), Some(q)) => {
            c.all_reduce_quant(send, recv, count, t, q, stream)
        }
        (Collective::AllReduce, Some(t), None) => c.all_reduce(send, recv, count, t, stream),
        (Collective::ReduceScatter, Some(t), _) => c.reduce_scatter(send, recv, count, t, stream),
        (Collective::AllGather, _, _) => {
            let elem = call.bytes / count.max(1);
            c.all_gather(send, recv, count, elem, stream)
        }
        (Collective::AlltoAll, _, _) => {
            let elem = call.bytes / count.max(1);
            c.all_to_all(send, recv, count, elem, stream)
        }
        _ => return Executed::Refused(Cow::Borrowed("not a call flashcomm's kernels take")),
    };
    match r {
        Ok(_) => Executed::Done(ncclResult_t::ncclSuccess),
        Err(CommError::Unsupported(why)) => Executed::Refused(Cow::Owned(why)),
        Err(e) => Executed::Done(report(call, e)),
    }
}
