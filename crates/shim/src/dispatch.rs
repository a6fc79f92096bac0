//! Dispatch: the one seam between the NCCL exports and flashcomm's kernels.
//!
//! * [`run`] is called by every collective export after its arguments passed the checks (and
//!   `count > 0`): it looks the communicator up ([`crate::registry`]), decides
//!   ([`crate::policy::decide`]), runs the call on flashcomm's kernels ([`crate::serve`]) or
//!   forwards it, and counts it ([`crate::stats`]) under the route it actually took.
//! * [`on_comms_created`] runs after communicators were created (InitRank, InitRankConfig,
//!   InitAll, InitRankScalable, Split, Shrink, Grow): it registers each one and, for blocking
//!   communicators, sets flashcomm's own communicator up on it collectively (`crate::serve`),
//!   now or, inside a group, when the outermost group ends ([`group_ended`]).
//!   [`on_comm_destroying`] runs before one is finalized, revoked, destroyed or aborted.
//! * [`async_error`] is the device error `ncclCommGetAsyncError` merges.
//!
//! The per-call path ([`run`] up to the launch) takes no lock, allocates nothing and formats no
//! string: the registry lookup is an atomic generation check, the decision is pure, the counters
//! and the first-use bits are atomics, and the one INFO line per (collective, route) pair of a
//! communicator is written only the first time. No lock of flashcomm is held while the real
//! library runs, and nothing on the path allocates device memory or synchronizes, so routed
//! calls may be captured into CUDA graphs.
//!
//! Owns: the hooks the exports call ([`run`], [`run_at`], [`pass_through`],
//! [`on_comms_created`], [`on_comm_destroying`], [`on_comm_suspend`], [`on_comm_resumed`],
//! [`group_ended`], [`async_error`]).
//! May import: `types`, `logging`, `stats`, `policy`, `registry`, `group`, `serve`.

use std::borrow::Cow;
use std::sync::Arc;

use flashcomm_config::Config;
use flashcomm_nccl_sys::{ncclComm_t, ncclResult_t};

use crate::engage;
use crate::group;
use crate::logging::{self, Subsys};
use crate::policy::{self, decide};
use crate::registry::{self, CommState, Setup};
use crate::serve::{self, Executed};
use crate::stats::{self, Announced};
use crate::types::{CollCall, CommEnd, CommHandle, CommOrigin, Route};

/// Hook: the real library created `comms` (one, or `ncclCommInitAll`'s list) and returned success
/// (`ready`) or `ncclInProgress` (a non-blocking communicator still initializing).
/// `config_blocking` is the `blocking` field of the caller's `ncclConfig_t`, if it set one.
///
/// Registers each communicator, then sets it up (`crate::serve`): collectively with the other
/// ranks, right now, or, inside `ncclGroupStart`/`End`, when the outermost group ends.
pub(crate) fn on_comms_created(
    comms: &[ncclComm_t],
    origin: CommOrigin,
    ready: bool,
    config_blocking: Option<bool>,
) {
    let new: Vec<(CommHandle, Arc<CommState>)> = comms
        .iter()
        .filter(|c| !c.is_null())
        .map(|&c| {
            (
                CommHandle::of(c),
                registry::register(c, origin, config_blocking),
            )
        })
        .collect();
    if new.is_empty() {
        return;
    }
    crate::init::debug_panic_point("flashcommCreationHook");
    for (h, _) in &new {
        logging::info(
            Subsys::Init,
            &format!("communicator {h:?} created ({origin:?}, ready: {ready})"),
        );
    }
    if group::depth() > 0 && ready {
        group::defer(new.iter().map(|(h, _)| *h));
        return;
    }
    serve::set_up(&new, origin == CommOrigin::InitAll, ready);
}

/// Hook: a communicator is about to be finalized, revoked, destroyed or aborted (called before
/// the real library sees the call). Revoke and Abort first stop flashcomm's kernels of this
/// communicator; after `Destroy` and `Abort` it leaves the registry and flashcomm's communicator
/// is released (after its last kernel finished) before the real call runs.
pub(crate) fn on_comm_destroying(comm: ncclComm_t, end: CommEnd) {
    if comm.is_null() {
        return;
    }
    logging::info(Subsys::Init, &format!("communicator {comm:p}: {end:?}"));
    let h = CommHandle::of(comm);
    match end {
        CommEnd::Finalize | CommEnd::Revoke => {
            let Some(state) = registry::by_handle(h) else {
                return;
            };
            state.close();
            if end == CommEnd::Revoke {
                state.revoke();
                if let Some(c) = state.served() {
                    c.abort();
                }
            } else if let Some(c) = state.served() {
                // NCCL's finalize flushes the communicator's operations before it returns (a
                // blocking communicator; flashcomm serves no other kind): flashcomm's too. The
                // wait ends when the kernels finish, or when an abort (another thread's
                // ncclCommAbort) makes them leave their waits.
                let _saved = crate::calls::cuda::SavedContext::save();
                if let Err(e) = c.wait_idle() {
                    logging::info(
                        Subsys::Init,
                        &format!("communicator {comm:p}: finalize: flashcomm's last kernel: {e}"),
                    );
                }
            }
        }
        CommEnd::Destroy | CommEnd::Abort => {
            if let Some(state) = registry::remove(h) {
                serve::tear_down(h, state, end == CommEnd::Abort);
            }
        }
    }
}

/// Before `ncclCommSuspend` (`suspended` true): flashcomm's operations of the communicator are
/// flushed (NCCL's header: a suspended communicator cannot be used; flashcomm keeps its memory),
/// and every call from now on goes to NCCL, which answers it as it answers calls on a suspended
/// communicator, until [`on_comm_resumed`]. Returns the previous state, which the caller restores
/// (`suspended` = that state) when the real suspend failed.
pub(crate) fn on_comm_suspend(comm: ncclComm_t, suspended: bool) -> bool {
    let Some(state) = (!comm.is_null())
        .then(|| registry::by_handle(CommHandle::of(comm)))
        .flatten()
    else {
        return false;
    };
    let before = state.is_suspended();
    state.set_suspended(suspended);
    if suspended && let Some(c) = state.served() {
        let _saved = crate::calls::cuda::SavedContext::save();
        if let Err(e) = c.wait_idle() {
            logging::info(
                Subsys::Init,
                &format!("communicator {comm:p}: suspend: flashcomm's last kernel: {e}"),
            );
        }
    }
    before
}

/// After a successful `ncclCommResume`: flashcomm's kernels take the communicator's calls again.
pub(crate) fn on_comm_resumed(comm: ncclComm_t) {
    if comm.is_null() {
        return;
    }
    if let Some(state) = registry::by_handle(CommHandle::of(comm)) {
        state.set_suspended(false);
    }
}

/// A buffer the real NCCL registered (`ncclCommRegister`, or with `collective`,
/// `ncclCommWindowRegister`) under `handle`: for a communicator flashcomm serves it is registered
/// with flashcomm's communicator too, so that with `FLASHCOMM_ZERO_COPY` (the default) peers of
/// other processes read it in place. Nothing here changes the call's result: a buffer flashcomm cannot serve in
/// place is staged. A collective registration takes part in an exchange with the peers of other
/// processes, at most [`REGISTER_WAIT`], except inside a group (the real library may fill the
/// window in only at the group's end): there it is registered without waiting when the window is
/// filled in, and not at all when it is not.
pub(crate) fn on_registered(
    comm: ncclComm_t,
    buff: u64,
    size: u64,
    handle: usize,
    collective: bool,
) {
    if comm.is_null() || buff == 0 || size == 0 || handle == 0 {
        return;
    }
    let Some(state) = registry::by_handle(CommHandle::of(comm)) else {
        return;
    };
    let Some(c) = state.served() else { return };
    let got = if collective && group::depth() == 0 {
        c.register_collective(buff, size, REGISTER_WAIT)
            .map(|(id, mapped)| {
                if !mapped && c.serves_registered_buffers() {
                    logging::info(
                        Subsys::Init,
                        &format!(
                            "window {buff:#x} ({size} bytes): not every peer mapped it in time; \
                             it is staged until they do"
                        ),
                    );
                }
                id
            })
    } else {
        c.register(buff, size)
    };
    match got {
        Ok(id) => state
            .registrations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((handle, id)),
        Err(e) => logging::info(
            Subsys::Init,
            &format!("buffer {buff:#x} not registered with flashcomm ({e}): it is staged"),
        ),
    }
}

/// How long a collective registration waits for every peer's mapping.
const REGISTER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The registration `handle` (of `ncclCommRegister` or `ncclCommWindowRegister`) ends: flashcomm's
/// communicator stages the buffer from its next call.
pub(crate) fn on_deregistering(comm: ncclComm_t, handle: usize) {
    if comm.is_null() {
        return;
    }
    let Some(state) = registry::by_handle(CommHandle::of(comm)) else {
        return;
    };
    let id = {
        let mut regs = state
            .registrations
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(i) = regs.iter().position(|(h, _)| *h == handle) else {
            return;
        };
        regs.swap_remove(i).1
    };
    if let Some(c) = state.served() {
        let _ = c.deregister(id);
    }
}

/// The creation hook panicked (a bug in flashcomm). A communicator whose set-up exchange had not
/// begun takes part in its first round saying so (its peers wait in that round:
/// `serve::refuse`), and every new communicator not set up yet stays with NCCL; one whose set-up
/// was decided before the panic keeps that outcome (its peers decided alike; forgetting it here
/// would send this rank's calls elsewhere than theirs). A warning says what happened. The real
/// communicators stay the caller's, created as the real call returned (`ready`: it returned
/// success).
pub(crate) fn on_creation_hook_panicked(
    comms: &[ncclComm_t],
    ready: bool,
    payload: &(dyn std::any::Any + Send),
) {
    let text = crate::init::take_panic_text().unwrap_or_else(|| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string())
    });
    let why = format!("internal error in flashcomm's creation hook ({text})");
    let states: Vec<(CommHandle, Arc<CommState>)> = comms
        .iter()
        .filter(|c| !c.is_null())
        .filter_map(|&c| registry::by_handle(CommHandle::of(c)).map(|s| (CommHandle::of(c), s)))
        .collect();
    {
        let _saved = crate::calls::cuda::SavedContext::save();
        serve::refuse(&states, ready, &why);
    }
    for (h, st) in &states {
        if !st.is_set_up() {
            st.set_setup(Setup::NotServed(why.clone()));
        }
        let now = if st.served().is_some() {
            "it stays served (its set-up had completed)"
        } else {
            "it stays with NCCL"
        };
        logging::warn(
            Subsys::Init,
            &format!(
                "communicator {h:?}: internal error in flashcomm while setting it up ({text}); \
                 {now}"
            ),
        );
    }
}

/// A hook around a destroy, abort, finalize or revoke panicked (a bug in flashcomm): the real call
/// runs all the same (the export does not return early). The communicator leaves the registry,
/// so its later calls go to NCCL, which answers them (each of these calls closes it for routing
/// on every rank anyway); for an abort, flashcomm's kernels of it are told to leave their waits
/// first. flashcomm's communicator, if any, is released when the last reference goes.
pub(crate) fn on_end_hook_panicked(
    hook: &str,
    comm: ncclComm_t,
    payload: &(dyn std::any::Any + Send),
) {
    let text = crate::init::take_panic_text().unwrap_or_else(|| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string())
    });
    if !comm.is_null()
        && let Some(state) = registry::remove(CommHandle::of(comm))
    {
        state.close();
        if hook.contains("Abort")
            && let Some(c) = state.served()
        {
            c.abort();
        }
    }
    logging::warn(
        Subsys::Init,
        &format!(
            "communicator {comm:p}: internal error in flashcomm's {hook} ({text}); the real \
             library's call runs all the same"
        ),
    );
}

/// Hook of `ncclCommShrink` with `NCCL_SHRINK_ABORT`, before the real shrink: NCCL aborts the
/// parent's operations in flight and leaves the parent usable only for destroy or abort; so
/// flashcomm's kernels of the parent leave their waits (the abort flag) and the parent's later
/// collectives go to NCCL, which reports its state.
pub(crate) fn on_comm_shrink_abort(comm: ncclComm_t) {
    if comm.is_null() {
        return;
    }
    logging::info(
        Subsys::Init,
        &format!(
            "communicator {comm:p}: shrink with NCCL_SHRINK_ABORT: flashcomm's kernels of it abort"
        ),
    );
    if let Some(state) = registry::by_handle(CommHandle::of(comm)) {
        state.close();
        if let Some(c) = state.served() {
            c.abort();
        }
    }
}

/// Hook of `ncclCommAbort`, before the real abort: the communicator leaves the registry and
/// flashcomm's kernels of it are told to leave their waits (the host abort flag they poll).
/// Nothing waits here: our last launch may sit behind a forwarded NCCL operation that only the
/// real abort ends. Pass the result to [`on_comm_aborted`] after the real abort returned.
pub(crate) fn on_comm_aborting(comm: ncclComm_t) -> Option<(CommHandle, Arc<CommState>)> {
    if comm.is_null() {
        return None;
    }
    logging::info(
        Subsys::Init,
        &format!("communicator {comm:p}: {:?}", CommEnd::Abort),
    );
    let h = CommHandle::of(comm);
    let state = registry::remove(h)?;
    state.close();
    // A set-up exchange in progress on another thread makes no more calls on the communicator
    // (the real abort frees it); one in progress may end first (the real abort ends the rest).
    if !state.gate.abort(ABORT_GATE_WAIT) {
        logging::info(
            Subsys::Init,
            &format!(
                "communicator {comm:p}: its set-up exchange is inside a call of the real \
                 library; the real abort ends it"
            ),
        );
    }
    if let Some(c) = state.served() {
        c.abort();
    }
    Some((h, state))
}

/// How long an abort waits for a call of the set-up exchange in progress (an enqueue or an error
/// query, microseconds; a call that blocks is one only the real abort ends).
const ABORT_GATE_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Hook: the real `ncclCommAbort` returned; flashcomm's side is released (bounded wait for the
/// last launch, see [`serve::release_aborted`]).
pub(crate) fn on_comm_aborted(pending: Option<(CommHandle, Arc<CommState>)>) {
    if let Some((h, state)) = pending {
        serve::release_aborted(h, state);
    }
}

/// The device error of `comm`'s kernels, if flashcomm serves it and a kernel gave up, as
/// `ncclCommGetAsyncError` merges it: `(code, message, first time)`, the code `ncclTimeout` for
/// a wait that outlasted `FLASHCOMM_TIMEOUT_MS`, `ncclRemoteError` for a peer that gave up, was
/// aborted or ran another collective. Cheap when there
/// is none (a registry lookup and a read of host memory) and takes no lock the real library
/// could wait on.
pub(crate) fn async_error(comm: ncclComm_t) -> Option<(ncclResult_t, String, bool)> {
    let state = registry::get(comm)?;
    if state.is_revoked() {
        return None;
    }
    let e = state.served()?.check_status().err()?;
    let code = match e {
        flashcomm_comm::Error::Timeout(_) => ncclResult_t::ncclTimeout,
        _ => ncclResult_t::ncclRemoteError,
    };
    Some((
        code,
        format!("flashcomm's kernels of communicator {comm:p} stopped: {e}"),
        state.first_async_error(),
    ))
}

/// Hook: the real `ncclGroupEnd` returned `result`, leaving depth `depth`. When the outermost
/// group ended, the communicators created inside it are set up now (collectively: every rank
/// reaches this point after the same group); if the group failed or is still in progress, they
/// stay with NCCL. Then the group's `flashcommCommSetQuant` calls are agreed on (after the
/// set-ups, which decide whether a communicator created in the group is served); their failures
/// are the group's.
pub(crate) fn group_ended(depth: u32, result: ncclResult_t) {
    if depth > 0 {
        return;
    }
    set_up_deferred(result);
    let quant = group::take_deferred_quant();
    if !quant.is_empty() {
        for e in serve::set_quant_at_group_end(quant, result == ncclResult_t::ncclSuccess) {
            group::failed(e.report(), e.message());
        }
    }
}

/// The set-ups of [`group_ended`].
fn set_up_deferred(result: ncclResult_t) {
    let states: Vec<(CommHandle, Arc<CommState>)> = group::take_deferred()
        .into_iter()
        .filter_map(|h| registry::by_handle(h).map(|s| (h, s)))
        .filter(|(_, s)| !s.is_set_up())
        .collect();
    if states.is_empty() {
        return;
    }
    let ready = result == ncclResult_t::ncclSuccess;
    // As after a creating call outside a group (`exports::api::created`): the real group has
    // ended and its communicators are the caller's, so a panic of the set-up (a bug) must not
    // fail the group's end, and the ranks whose exchange had not begun tell their peers, which
    // wait for them in its first round.
    let set_up = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        serve::set_up(&states, false, ready);
    }));
    if let Err(payload) = set_up {
        let comms: Vec<ncclComm_t> = states.iter().map(|(h, _)| h.raw()).collect();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            on_creation_hook_panicked(&comms, ready, payload.as_ref());
        }));
    }
}

/// Hook: the real `ncclGroupSimulateEnd` returned, leaving depth `depth`. The group is over
/// (NCCL ended it without running it); communicators created inside it stay with NCCL.
pub(crate) fn group_simulated(depth: u32) {
    group_ended(depth, ncclResult_t::ncclInvalidUsage);
}

/// A call flashcomm does not route (`args::check`: no communicator, a datatype or operator the
/// pinned header does not know, nothing to move, a size that overflows): given to the real
/// library as it is, so its answer is the answer (calls a group held back went first:
/// `grouped::stop_holding`); on a communicator flashcomm serves, the call is ordered
/// after flashcomm's work like any forwarded call. Not counted in the statistics.
pub(crate) fn pass_through<F: FnOnce() -> ncclResult_t>(
    call: &CollCall,
    forward_real: F,
) -> ncclResult_t {
    let state = (!call.comm.is_null())
        .then(|| registry::get(call.comm))
        .flatten();
    let served = state.as_deref().and_then(CommState::served);
    serve::forward_in_order(served, call, group::depth() > 0, forward_real)
}

/// (kind, route) pairs already logged for communicators flashcomm never saw.
static UNKNOWN_ANNOUNCED: Announced = Announced::new();

/// Decides, runs and counts one checked collective (`count > 0`). `forward` calls the real
/// library with the caller's arguments unchanged. A call flashcomm's kernels refuse as
/// unsupported (a pure function of the arguments, so every rank refuses it) goes to NCCL instead.
pub(crate) fn run<F: FnOnce() -> ncclResult_t>(
    call: &CollCall,
    config: &Config,
    forward_real: F,
) -> ncclResult_t {
    let depth = group::depth();
    run_at(call, config, depth, depth > 0, None, forward_real)
}

/// [`run`] at group depth `depth` (what the decision sees), with `in_real_group` when a
/// forwarded call lands inside a group the real library still holds open (NCCL enqueues it at
/// the group's end, so it is not ordered here); `blocks`: the AllToAll a Send/Recv group forms
/// has its blocks apart, one per peer (the send and receive addresses, `call.bytes` each).
pub(crate) fn run_at<F: FnOnce() -> ncclResult_t>(
    call: &CollCall,
    config: &Config,
    depth: u32,
    in_real_group: bool,
    blocks: Option<(&[u64], &[u64])>,
    forward_real: F,
) -> ncclResult_t {
    let mut held = None;
    let found = registry::find(call.comm, config, &mut held);
    let (state, served, view) = match &found {
        Some(f) => (Some(f.state), f.served, Some(&f.view)),
        None => (None, None, None),
    };
    let d = decide(call, config, view);
    let forward = |f: F| serve::forward_in_order(served, call, in_real_group, f);
    let mut unquantized = false;
    let (route, result, refused) = match (d.route, state) {
        (Route::Lossless | Route::Quantized, Some(_)) => {
            match serve::execute(served, call, blocks, &d, config) {
                Executed::Done(r) => (d.route, r, None),
                Executed::Invalid(r) => return r,
                Executed::Unquantized(r) => {
                    unquantized = true;
                    (Route::Lossless, r, None)
                }
                Executed::Refused(why) => (Route::Nccl, forward(forward_real), Some(why)),
            }
        }
        _ => (Route::Nccl, forward(forward_real), None),
    };
    stats::add_total(route, call.req.coll, call.bytes);
    engage::on_routed(call.req.coll, route, d.why);
    let first = match state {
        Some(st) => {
            st.counters.add(route, call.req.coll, call.bytes);
            if unquantized {
                st.announced.first_unquantized()
            } else {
                st.announced.first_time(call.req.coll, route)
            }
        }
        None => UNKNOWN_ANNOUNCED.first_time(call.req.coll, route),
    };
    if first {
        announce(call, config, &d, route, view, state, refused);
    }
    if tracing::enabled!(target: "flashcomm::tuning", tracing::Level::TRACE) {
        tracing::trace!(
            target: "flashcomm::tuning",
            "{} count {} datatype {} bytes {} comm {:p} stream {:p} group depth {} -> {} ({:?})",
            call.api, call.req.count, call.datatype.0, call.bytes, call.comm, call.req.stream.0,
            depth, route.name(), d.why
        );
    }
    result
}

/// The INFO line of the first use of `route` by this kind of call on its communicator.
#[cold]
fn announce(
    call: &CollCall,
    config: &Config,
    d: &policy::Decision,
    route: Route,
    view: Option<&policy::CommView>,
    state: Option<&CommState>,
    refused: Option<Cow<'static, str>>,
) {
    let why = match refused {
        Some(r) => format!(
            "flashcomm's {} kernels refused it ({r}; every rank refuses it alike)",
            d.route.name()
        ),
        None if d.route == Route::Quantized && route == Route::Lossless => format!(
            "asked to be quantized, it ran on the lossless kernels: the cost model calibrated at \
             set-up predicts the quantized ones no more than 3% faster at {} bytes \
             (FLASHCOMM_QUANT_CHOICE=auto; `always` quantizes every such call)",
            call.bytes
        ),
        None => {
            let why_not = state.and_then(CommState::why_not);
            policy::explain(d, call, config, view, why_not.as_deref())
        }
    };
    // Under INIT (once per communicator, kind and route), so that NCCL_DEBUG=INFO shows it with
    // NCCL's default subsystems.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::call;
    use crate::stats::totals;
    use crate::types::Collective;

    /// One communicator was created by the real library (see [`on_comms_created`]).
    fn on_comm_created(
        comm: ncclComm_t,
        origin: CommOrigin,
        ready: bool,
        config_blocking: Option<bool>,
    ) {
        on_comms_created(&[comm], origin, ready, config_blocking);
    }

    #[test]
    fn run_counts_per_comm_and_in_total() {
        let comm = 0x5000usize as ncclComm_t;
        // Not ready (a non-blocking communicator still initializing): registered, not served,
        // and nothing asks the real library.
        on_comm_created(comm, CommOrigin::InitRank, false, None);
        let state = registry::get(comm).unwrap();
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
        assert!(
            !state
                .announced
                .first_time(Collective::AllReduce, Route::Nccl)
        );
        assert!(
            state
                .announced
                .first_time(Collective::AllGather, Route::Nccl)
        );
        on_comm_destroying(comm, CommEnd::Finalize);
        assert!(registry::get(comm).unwrap().is_closed());
        on_comm_destroying(comm, CommEnd::Destroy);
        assert!(registry::get(comm).is_none());
    }

    #[test]
    fn a_suspended_communicator_routes_to_nccl_until_it_is_resumed() {
        let comm = 0x5050usize as ncclComm_t;
        on_comm_created(comm, CommOrigin::InitRank, false, None);
        let state = registry::get(comm).unwrap();
        let config = Config::default();
        assert!(!state.view(&config).closed);
        on_comm_suspend(comm, true);
        assert!(state.is_suspended() && state.view(&config).closed);
        // As a served communicator would be decided (this one is not: no GPU in unit tests).
        let mut view = state.view(&config);
        view.served = true;
        view.nranks = 2;
        let d = policy::decide(&call(comm), &config, Some(&view));
        assert_eq!(d.route, Route::Nccl);
        let why = policy::explain(&d, &call(comm), &config, Some(&view), None);
        assert!(why.contains("suspended"), "{why}");
        // A second suspend that fails leaves it suspended (the state before it is restored).
        let before = on_comm_suspend(comm, true);
        assert!(before);
        on_comm_suspend(comm, before);
        assert!(state.is_suspended());
        on_comm_resumed(comm);
        assert!(!state.view(&config).closed);
        // A first suspend that fails: flashcomm routes as before.
        let before = on_comm_suspend(comm, true);
        assert!(!before);
        on_comm_suspend(comm, before);
        assert!(!state.view(&config).closed);
        on_comm_suspend(comm, true);
        on_comm_resumed(comm);
        assert!(!state.is_suspended() && !state.view(&config).closed);
        // Unknown and null communicators are ignored.
        on_comm_suspend(std::ptr::null_mut(), true);
        on_comm_resumed(0x5051usize as ncclComm_t);
        on_comm_destroying(comm, CommEnd::Destroy);
    }

    #[test]
    fn blocking_mode_comes_from_the_config_or_the_parent() {
        let parent = 0x5100usize as ncclComm_t;
        on_comm_created(parent, CommOrigin::InitRankConfig, false, Some(false));
        assert!(!registry::get(parent).unwrap().blocking);
        let child = 0x5200usize as ncclComm_t;
        let origin = CommOrigin::Split {
            parent: CommHandle::of(parent),
        };
        on_comm_created(child, origin, false, None);
        assert!(!registry::get(child).unwrap().blocking, "inherited");
        let other = 0x5300usize as ncclComm_t;
        on_comm_created(other, origin, false, Some(true));
        assert!(
            registry::get(other).unwrap().blocking,
            "its own config wins"
        );
        for c in [parent, child, other] {
            on_comm_destroying(c, CommEnd::Abort);
            assert!(registry::get(c).is_none());
        }
    }

    #[test]
    fn communicators_created_in_a_group_are_set_up_when_it_ends() {
        let comm = 0x5400usize as ncclComm_t;
        group::started();
        group::started();
        on_comm_created(comm, CommOrigin::InitRank, true, None);
        let state = registry::get(comm).unwrap();
        assert!(!state.is_set_up());
        assert!(state.why_not().unwrap().contains("pending"));
        group_ended(group::ending(), ncclResult_t::ncclSuccess);
        assert!(!state.is_set_up(), "only the outermost group end sets up");
        // The group failed: the communicator stays with NCCL (without asking the real library).
        group_ended(group::ending(), ncclResult_t::ncclInternalError);
        assert!(state.is_set_up());
        assert!(state.served().is_none());
        on_comm_destroying(comm, CommEnd::Destroy);
    }

    /// How long `ncclCommWindowRegister` may wait is stated in docs/abi.md (the support matrix,
    /// generated from `crates/xtask/src/abi.rs`) and in docs/protocols.md ("Windows"): the
    /// same number as the code's.
    #[test]
    fn the_documented_window_wait_is_the_codes() {
        let secs = REGISTER_WAIT.as_secs();
        assert_eq!(REGISTER_WAIT, std::time::Duration::from_secs(secs));
        let doc = |name: &str| {
            let path = format!("{}/../../docs/{name}", env!("CARGO_MANIFEST_DIR"));
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
        };
        let abi = doc("abi.md");
        let said = format!("outside a group the call then waits, at most {secs} s,");
        assert!(abi.contains(&said), "docs/abi.md should say: {said}");
        let protocols = doc("protocols.md");
        let said = format!("or after {secs} s (`REGISTER_WAIT` in `crates/shim/src/dispatch.rs`)");
        assert!(
            protocols.contains(&said),
            "docs/protocols.md should say: {said}"
        );
    }
}
