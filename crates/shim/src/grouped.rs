//! The AllToAll a group of `ncclSend`/`ncclRecv` forms (`FLASHCOMM_GROUPED_ALLTOALL`), in one
//! place: the outermost group of a thread holds its Send/Recv calls back ([`hold_in_group`],
//! [`hold_group_call`]), recognizes at its end whether they form an all-to-all
//! ([`alltoall_of`]), and runs it as flashcomm's AllToAll when the routing rules take it
//! ([`execute`], through `dispatch::run_at`), or gives the held calls to the real library in
//! their order ([`group_ending`], [`released`]).
//!
//! With the setting off (the default) the per-call path reads no thread-local here.
//!
//! Owns: [`group_started`], [`hold_in_group`], [`stop_holding`], [`hold_group_call`],
//! [`released`], [`group_ending`], [`GroupedAlltoAll`], [`alltoall_of`], [`execute`], the calls
//! held back.
//! May import: `dispatch`, `serve`, `registry`, `policy`, `calls::cuda`, `types`.

use std::cell::RefCell;

use flashcomm_comm::Request;
use flashcomm_config::Config;
use flashcomm_nccl_sys::ncclResult_t;

use crate::dispatch;
use crate::policy::GROUPED_ALLTOALL;
use crate::registry;
use crate::serve;
use crate::types::{CollCall, Collective, Held, P2pCall};

thread_local! {
    /// `Some`: Send/Recv calls (and nested group calls) of the current outermost group held back
    /// so far, in call order (`FLASHCOMM_GROUPED_ALLTOALL`); `None`: not holding (off, outside a
    /// group, or the group already proved not to be an all-to-all and its calls went to NCCL).
    static HELD: RefCell<Option<Vec<Held>>> = const { RefCell::new(None) };
}

/// The outermost group started: hold its Send/Recv calls from now on.
fn hold_from_now() {
    HELD.with(|h| *h.borrow_mut() = Some(Vec::new()));
}

/// Whether this thread's group is holding its Send/Recv calls back.
pub(crate) fn holding() -> bool {
    HELD.with(|h| h.borrow().is_some())
}

/// Holds `p` back (when holding; returns whether it did).
fn hold(p: Held) -> bool {
    HELD.with(|h| match h.borrow_mut().as_mut() {
        Some(v) => {
            v.push(p);
            true
        }
        None => false,
    })
}

/// The calls held back so far, in call order; holding stops.
fn take_held() -> Vec<Held> {
    HELD.with(|h| h.borrow_mut().take().unwrap_or_default())
}

/// Hook of `ncclGroupStart` (after the real one succeeded, `depth` the depth now): the outermost
/// group of a thread holds its Send/Recv calls back when `FLASHCOMM_GROUPED_ALLTOALL` is on.
pub(crate) fn group_started(depth: u32, config: &Config) {
    if depth == 1 && config.settings.grouped_alltoall {
        hold_from_now();
    }
}

/// A checked call made inside a group while the group holds its Send/Recv calls back. Returns
/// true when the call was held (the export returns success; the real library sees it later, at
/// the group's end, unless the group runs as flashcomm's AllToAll). Anything else ends the
/// holding: the calls held so far go to the real library first, in their order, so NCCL
/// receives the group exactly as the caller wrote it. Held: a send or receive of a
/// communicator whose size the real library told, to a peer within it (NCCL itself answers a
/// peer out of range, so that call is not held).
pub(crate) fn hold_in_group(call: &CollCall, config: &Config) -> bool {
    // The setting first: with it off (the default) the per-call path reads no thread-local.
    if !config.settings.grouped_alltoall || !holding() {
        return false;
    }
    if matches!(call.req.coll, Collective::Send | Collective::Recv)
        && call.null_buffer().is_none()
        && let Some(peer) = call.root_or_peer
        && let Some(id) = registry::get(call.comm).and_then(|s| s.identity())
        && (0..id.nranks).contains(&peer)
    {
        return hold(Held::P2p(P2pCall { call: *call, peer }));
    }
    stop_holding(config);
    false
}

/// Ends the holding of this thread's group, if it holds: the calls held so far go to the real
/// library now, in their order; a failure among them is returned again by the group's end.
pub(crate) fn stop_holding(config: &Config) {
    let r = release_held(take_held(), config);
    if r != ncclResult_t::ncclSuccess {
        // NCCL returns a failed call's error again from the group's end.
        RELEASE_FAILURE.with(|f| f.set(Some(f.get().unwrap_or(r))));
    }
}

thread_local! {
    /// The first failure of held calls given back before the group's end (returned by it).
    static RELEASE_FAILURE: std::cell::Cell<Option<ncclResult_t>> = const { std::cell::Cell::new(None) };
}

/// Gives held calls to the real library in their order, each Send/Recv through `p2p`; returns
/// the first failure, if any.
fn forward_held(held: &[Held], p2p: impl Fn(&P2pCall) -> ncclResult_t) -> ncclResult_t {
    let mut result = ncclResult_t::ncclSuccess;
    for h in held {
        let r = match h {
            Held::P2p(p) => p2p(p),
            Held::GroupStart | Held::GroupEnd => serve::forward_group_call(h),
        };
        if result == ncclResult_t::ncclSuccess {
            result = r;
        }
    }
    result
}

/// Ends the holding of this thread's group: the calls held so far go to the real library now,
/// in their order (before `ncclGroupSimulateEnd`). Returns the first failure, if any.
pub(crate) fn released(config: &Config) -> ncclResult_t {
    release_held(take_held(), config)
}

/// Gives held calls to the real library, in their order, each counted as the NCCL route of its
/// kind (inside the real group, which is still open). Returns the first failure, if any.
fn release_held(held: Vec<Held>, config: &Config) -> ncclResult_t {
    forward_held(&held, |p| {
        dispatch::run_at(&p.call, config, 1, true, None, || serve::forward_p2p(p))
    })
}

/// Hook of a nested `ncclGroupStart` (`start`) or `ncclGroupEnd` while the thread's group holds
/// its calls back: held too, so the real library receives every call in the caller's order.
/// Returns whether it was held (the export returns success without calling the real library).
pub(crate) fn hold_group_call(start: bool) -> bool {
    holding()
        && hold(if start {
            Held::GroupStart
        } else {
            Held::GroupEnd
        })
}

/// Hook of the outermost `ncclGroupEnd`, before the real one runs: the Send/Recv calls the group
/// held back run as flashcomm's AllToAll when they form one ([`alltoall_of`]) and the
/// routing rules send that AllToAll to flashcomm's kernels; otherwise they go to the real library
/// in their order. A recognized group counts as one `alltoall` call on the route it took.
/// `None` when nothing was held.
pub(crate) fn group_ending(config: &Config) -> Option<ncclResult_t> {
    let earlier = RELEASE_FAILURE.with(std::cell::Cell::take);
    let held = take_held();
    if held.is_empty() {
        return earlier;
    }
    let first = held.iter().find_map(|h| match h {
        Held::P2p(p) => Some(p.call.comm),
        Held::GroupStart | Held::GroupEnd => None,
    });
    let nranks = first
        .and_then(registry::get)
        .and_then(|s| s.identity())
        .map_or(0, |id| id.nranks);
    let r = match alltoall_of(&held, nranks) {
        Some(g) => dispatch::run_at(
            &g.call,
            config,
            0,
            true,
            (!g.contiguous).then_some((&g.send[..], &g.recv[..])),
            || forward_held(&held, serve::forward_p2p),
        ),
        None => release_held(held, config),
    };
    Some(earlier.unwrap_or(r))
}

/// An all-to-all formed by a group of `ncclSend`/`ncclRecv` ([`alltoall_of`]).
#[derive(Debug, Clone)]
pub(crate) struct GroupedAlltoAll {
    /// The AllToAll the routing rules judge (`api` [`GROUPED_ALLTOALL`]). When `contiguous`, its
    /// buffers are the send and receive buffers the blocks form; otherwise the first blocks.
    pub(crate) call: CollCall,
    /// Block p to send to rank p, and block p to receive from rank p.
    pub(crate) send: Vec<u64>,
    pub(crate) recv: Vec<u64>,
    /// The blocks form one send buffer and one receive buffer (block p at `p x bytes`), apart:
    /// flashcomm's AllToAll runs on them directly, otherwise through its scratch.
    pub(crate) contiguous: bool,
}

/// The all-to-all a group of held-back `ncclSend`/`ncclRecv` calls forms, if it forms one: all
/// on one communicator of `nranks` ranks, one stream, one datatype, one count, no per-call
/// configuration; exactly one send and one receive for every rank (this one included); where
/// the buffers lie does not matter. A pure function of the shape of this rank's calls, never of
/// addresses: every rank whose group has the same shape finds the same answer (why
/// `FLASHCOMM_GROUPED_ALLTOALL` is a promise the application makes).
pub(crate) fn alltoall_of(held: &[Held], nranks: i32) -> Option<GroupedAlltoAll> {
    // Nested group calls are no-ops for the group's meaning.
    let held: Vec<P2pCall> = held
        .iter()
        .filter_map(|h| match h {
            Held::P2p(p) => Some(*p),
            Held::GroupStart | Held::GroupEnd => None,
        })
        .collect();
    let n = usize::try_from(nranks).ok().filter(|&n| n > 0)?;
    let first = held.first()?.call;
    if held.len() != 2 * n || first.req.count == 0 {
        return None;
    }
    let (mut send, mut recv) = (vec![None; n], vec![None; n]);
    for p in &held {
        let c = &p.call;
        let same = c.comm == first.comm
            && c.req.stream == first.req.stream
            && c.datatype == first.datatype
            && c.req.count == first.req.count
            && c.bytes == first.bytes
            && c.config.is_null();
        let slot = match c.req.coll {
            Collective::Send => send.get_mut(usize::try_from(p.peer).ok()?)?,
            Collective::Recv => recv.get_mut(usize::try_from(p.peer).ok()?)?,
            _ => return None,
        };
        if !same || slot.is_some() {
            return None;
        }
        *slot = Some(match c.req.coll {
            Collective::Send => c.sendbuff as u64,
            _ => c.recvbuff as u64,
        });
    }
    // 2n calls, none twice: every slot is filled.
    let send: Vec<u64> = send.into_iter().collect::<Option<_>>()?;
    let recv: Vec<u64> = recv.into_iter().collect::<Option<_>>()?;
    let b = first.bytes;
    let run = |v: &[u64]| (0..n as u64).all(|p| Some(v[p as usize]) == v[0].checked_add(p * b));
    let span = b.checked_mul(n as u64);
    let apart = span.is_some_and(|span| {
        send[0].saturating_add(span) <= recv[0] || recv[0].saturating_add(span) <= send[0]
    });
    let contiguous = run(&send) && run(&recv) && apart;
    Some(GroupedAlltoAll {
        call: CollCall {
            api: GROUPED_ALLTOALL,
            req: Request {
                coll: Collective::AlltoAll,
                ..first.req
            },
            sendbuff: send[0] as *const std::ffi::c_void,
            recvbuff: recv[0] as *mut std::ffi::c_void,
            datatype: first.datatype,
            op: None,
            comm: first.comm,
            config: std::ptr::null(),
            bytes: b,
            root_or_peer: None,
        },
        send,
        recv,
        contiguous,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::decide;
    use crate::policy::tests::{call, cfg, served};
    use crate::types::Route;
    use flashcomm_comm::Stream;
    use flashcomm_nccl_sys::{ncclComm_t, ncclDataType_t};

    /// PyTorch's equal-split pattern: for each peer, a send then a receive, 256 bytes each (64
    /// f32), from 0x10000 and into 0x20000, on communicator 0x1.
    fn pairs(n: i32) -> Vec<P2pCall> {
        let one = |kind, peer: i32| {
            let off = peer as usize * 256;
            P2pCall {
                call: CollCall {
                    api: "p2p",
                    req: Request {
                        coll: kind,
                        count: 64,
                        ..call(1 as ncclComm_t).req
                    },
                    sendbuff: if kind == Collective::Send {
                        (0x10000 + off) as *const _
                    } else {
                        std::ptr::null()
                    },
                    recvbuff: if kind == Collective::Recv {
                        (0x20000 + off) as *mut _
                    } else {
                        std::ptr::null_mut()
                    },
                    op: None,
                    bytes: 256,
                    ..call(1 as ncclComm_t)
                },
                peer,
            }
        };
        (0..n)
            .flat_map(|p| [one(Collective::Send, p), one(Collective::Recv, p)])
            .collect()
    }

    #[test]
    fn an_equal_send_recv_group_is_an_alltoall() {
        for n in [1, 2, 8] {
            let a = alltoall_of(&held(&pairs(n)), n).expect("an all-to-all");
            assert_eq!(
                (a.call.req.coll, a.call.req.count, a.call.bytes),
                (Collective::AlltoAll, 64, 256)
            );
            assert_eq!(
                (a.call.sendbuff as usize, a.call.recvbuff as usize),
                (0x10000, 0x20000)
            );
            assert!(a.contiguous);
            // Any order of the calls.
            let mut rev = pairs(n);
            rev.reverse();
            assert!(alltoall_of(&held(&rev), n).is_some_and(|a| a.contiguous));
            // Nested group calls among them change nothing.
            let mut nested = held(&pairs(n));
            nested.insert(1, Held::GroupStart);
            nested.push(Held::GroupEnd);
            assert!(alltoall_of(&nested, n).is_some_and(|a| a.contiguous));
        }
    }

    #[test]
    fn where_the_blocks_lie_decides_only_how_it_runs() {
        let n = 4;
        let mut scattered = pairs(n);
        scattered[2].call.sendbuff = 0x90000 as _;
        let mut overlapping = pairs(n);
        for p in overlapping
            .iter_mut()
            .filter(|p| p.call.req.coll == Collective::Recv)
        {
            p.call.recvbuff = (p.call.recvbuff as usize - 0x10000 + 0x100) as *mut _;
        }
        let mut aliased = pairs(n);
        for p in aliased
            .iter_mut()
            .filter(|p| p.call.req.coll == Collective::Recv)
        {
            p.call.recvbuff = (p.call.recvbuff as usize - 0x10000) as *mut _;
        }
        for g in [scattered, overlapping, aliased] {
            let a = alltoall_of(&held(&g), n).expect("an all-to-all still");
            assert!(!a.contiguous);
            assert_eq!(a.send.len(), 4);
            // The routing rules judge it like any AllToAll (an aliased first block is not an
            // in-place call).
            let c = cfg(&[]);
            assert_eq!(
                decide(&a.call, &c, Some(&served(&c))).route,
                Route::Lossless
            );
        }
    }

    fn held(calls: &[P2pCall]) -> Vec<Held> {
        calls.iter().copied().map(Held::P2p).collect()
    }

    #[test]
    fn any_other_group_is_not_an_alltoall() {
        let n = 4;
        type Change = Box<dyn Fn(&mut Vec<P2pCall>)>;
        let bad: Vec<(&str, Change)> = vec![
            (
                "a call missing",
                Box::new(|g| {
                    g.pop();
                }),
            ),
            (
                "a call twice",
                Box::new(|g| {
                    let x = g[0];
                    g[1] = x;
                }),
            ),
            (
                "one count differs",
                Box::new(|g| {
                    g[2].call.req.count = 32;
                    g[2].call.bytes = 128;
                }),
            ),
            (
                "another datatype",
                Box::new(|g| {
                    g[3].call.datatype = ncclDataType_t::ncclInt32;
                }),
            ),
            (
                "another stream",
                Box::new(|g| {
                    g[4].call.req.stream = Stream(8 as _);
                }),
            ),
            (
                "another communicator",
                Box::new(|g| {
                    g[5].call.comm = 2 as _;
                }),
            ),
            (
                "a peer out of range",
                Box::new(|g| {
                    g[1].peer = 4;
                }),
            ),
            (
                "a collective among them",
                Box::new(|g| {
                    g[0].call.req.coll = Collective::AllReduce;
                }),
            ),
        ];
        for (what, change) in bad {
            let mut g = pairs(n);
            change(&mut g);
            assert!(alltoall_of(&held(&g), n).is_none(), "{what}");
        }
        assert!(
            alltoall_of(&held(&pairs(4)), 8).is_none(),
            "fewer ranks than the communicator's"
        );
        assert!(alltoall_of(&[], 1).is_none());
    }
}
