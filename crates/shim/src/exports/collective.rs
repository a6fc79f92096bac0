//! The common path of every collective export: what the arguments allow (`args::check`), the
//! call typed once (`CollCall`, whose `Request` is what flashcomm's communicator runs), then the
//! router, or the real library as it is for a call flashcomm does not route.
//!
//! Owns: [`Extra`], [`collective`].
//! May import: `exports::boundary`, `args`, `error`, `types`, `dispatch`, `grouped`.

use flashcomm_comm::{Request, Stream};
use flashcomm_config::Config;
use flashcomm_nccl_sys::{cudaStream_t, ncclCollConfig_t, ncclResult_t};

use crate::args::{self, Args, Checked};
use crate::dispatch;
use crate::error::Error;
use crate::exports::boundary::unavailable;
use crate::grouped;
use crate::types::CollCall;

/// What the checks do not look at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Extra {
    /// Root (broadcast, reduce) or peer (send, receive).
    pub(crate) root_or_peer: Option<i32>,
    /// The caller's stream.
    pub(crate) stream: cudaStream_t,
    /// `ncclXConfig`'s per-call configuration (null for the plain functions).
    pub(crate) config: *const ncclCollConfig_t,
}

/// Runs one collective export. `forward` calls the real library with the caller's arguments;
/// `config` is the configuration the boundary read for this call.
pub(crate) fn collective(
    config: &Config,
    a: Args,
    extra: Extra,
    forward: impl FnOnce() -> Result<ncclResult_t, Error>,
) -> ncclResult_t {
    let forward = || forward().unwrap_or_else(unavailable);
    if tracing::enabled!(target: "flashcomm::call", tracing::Level::TRACE) {
        tracing::trace!(
            target: "flashcomm::call",
            "{}: sendbuff {:p} recvbuff {:p} count {} datatype {} op {:?} root/peer {:?} comm {:p} \
             stream {:p} config {:p}",
            a.api, a.sendbuff, a.recvbuff, a.count, a.datatype.0, a.op.map(|o| o.0),
            extra.root_or_peer, a.comm, extra.stream, extra.config
        );
    }
    let checked = args::check(&a);
    let (elem, bytes, dtype) = match checked {
        Checked::Routed { elem, bytes, dtype } => (elem, bytes, dtype),
        Checked::Forward => (0, 0, None),
    };
    let call = CollCall {
        api: a.api,
        // flashcomm's request, typed here once (its buffers get their sizes in `serve`).
        req: Request {
            stream: Stream(extra.stream.cast()),
            ..Request::shaped(a.kind, a.count as u64, dtype, elem)
        },
        sendbuff: a.sendbuff,
        recvbuff: a.recvbuff,
        datatype: a.datatype,
        op: a.op,
        comm: a.comm,
        config: extra.config,
        bytes,
        root_or_peer: extra.root_or_peer,
    };
    if checked == Checked::Forward {
        // Not a call flashcomm routes: the real library answers it, as it would without us
        // (after the calls a group held back: NCCL receives the group as written).
        if config.settings.grouped_alltoall && grouped::holding() {
            grouped::stop_holding(config);
        }
        return dispatch::pass_through(&call, forward);
    }
    // Inside a group that holds its Send/Recv calls back (FLASHCOMM_GROUPED_ALLTOALL).
    if grouped::hold_in_group(&call, config) {
        return ncclResult_t::ncclSuccess;
    }
    dispatch::run(&call, config, forward)
}
