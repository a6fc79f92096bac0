//! flashcomm's `libnccl.so.2`.
//!
//! A drop-in NCCL: it exports every function of the NCCL 2.32.3 API as `ncclX` and `pncclX`,
//! checks the arguments of the collectives, routes eligible AllReduce, ReduceScatter and
//! AllGather calls to flashcomm's own kernels (`flashcomm-comm`), and forwards everything else to
//! the real NCCL, which it finds and opens itself. See `docs/abi.md` and `docs/architecture.md`.
//!
//! `unsafe` code lives only in `exports` (what we export) and `calls` (what we call); every other
//! module is safe Rust.
//!
//! The modules, from the top (the C symbols) to the bottom (the call types). Each may import
//! only modules below it, exactly those listed (`tests/module_graph.rs` checks this table against
//! the `crate::` paths of the code, so the graph has no cycle and the table stays true, and
//! checks that `docs/architecture.md` shows the same table):
//!
//! | module | owns | may import |
//! |---|---|---|
//! | `exports::api` | the NCCL exports we inspect: versions, errors, collectives, communicator lifecycle, groups | `exports::collective`, `exports::boundary`, `grouped`, `dispatch`, `group`, `args`, `calls::real`, `error`, `logging`, `last_error`, `init`, `types` |
//! | `exports::forwarders` | the generated plain forwarders | `exports::boundary` |
//! | `exports::ext` | flashcomm's own C API (`include/flashcomm.h`) | `exports::boundary`, `serve`, `registry`, `group`, `stats`, `init`, `error`, `logging`, `types` |
//! | `exports::collective` | the common path of the collective exports: checks, then dispatch | `exports::boundary`, `grouped`, `dispatch`, `args`, `error`, `types` |
//! | `exports::boundary` | the panic boundary, the export macros, signature checks, a group call flashcomm fails inside a group | `calls::real`, `calls::nccl`, `group`, `init`, `error`, `logging`, `last_error`, `types` |
//! | `grouped` | the AllToAll a group of `ncclSend`/`ncclRecv` forms: its calls held back, recognized, run as flashcomm's AllToAll or given to NCCL in order | `dispatch`, `serve`, `registry`, `policy`, `types` |
//! | `dispatch` | the hooks of the exports: run one call (lookup, decision, serve or forward, count), communicator and group events | `serve`, `engage`, `registry`, `group`, `policy`, `stats`, `logging`, `init`, `calls::cuda`, `types` |
//! | `serve` | flashcomm's communicator behind a served NCCL communicator: set-up, routed calls, teardown | `engage`, `bootstrap`, `registry`, `policy`, `calls::nccl`, `init`, `error`, `logging`, `calls::cuda`, `types` |
//! | `engage` | the "flashcomm is on" line, the forwarded calls flashcomm could have served, the exit summary | `registry`, `policy`, `stats`, `calls::real`, `init`, `logging`, `calls::os`, `types` |
//! | `bootstrap` | the set-up exchange over the real NCCL's `ncclAllGather` | `calls::nccl`, `calls::cuda`, `types` |
//! | `registry` | the side table of communicators and what flashcomm knows of each | `policy`, `stats`, `calls::nccl`, `types`, `calls::os` |
//! | `group` | this thread's group depth and the set-ups deferred to the group's end | `types` |
//! | `policy` | the pure routing decision and its explanation | `types` |
//! | `stats` | calls and bytes per route and kind, the first-use bits | `types` |
//! | `args` | what a collective's arguments allow: routed, or forwarded as it is | `types` |
//! | `calls::nccl` | flashcomm's own calls to the real NCCL | `calls::real`, `error` |
//! | `calls::real` | finding, opening and resolving the real NCCL | `init`, `error`, `logging`, `discovery`, `calls::os` |
//! | `init` | lazy initialization: configuration, logging, fork detection, the panic hook | `logging`, `calls::os` |
//! | `error` | errors, their codes, NCCL's error strings | `logging`, `last_error` |
//! | `logging` | NCCL-style logging | `calls::cuda`, `calls::os`, `types` |
//! | `last_error` | `ncclGetLastError`'s messages | `calls::os` |
//! | `discovery` | where to look for the real NCCL | — |
//! | `calls::cuda` | the shim's CUDA needs, through `flashcomm-gpu` (saved context, own stream, current device), and the caller's buffers as device pointers | `types` |
//! | `calls::os` | thread id, fork generation and per-process state, exit handlers, lock-free standard error | — |
//! | `types` | the call types: route, collective kind, one call, communicator handle, origin and end | — |
#![deny(unsafe_code)]

mod args;
mod bootstrap;
mod calls;
mod discovery;
mod dispatch;
mod engage;
mod error;
mod exports;
mod group;
mod grouped;
mod init;
mod last_error;
mod logging;
mod policy;
mod registry;
mod serve;
mod stats;
mod types;
