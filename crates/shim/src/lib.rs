//! flashcomm's `libnccl.so.2`.
//!
//! A drop-in NCCL: it exports every function of the NCCL 2.32.3 API as `ncclX` and `pncclX`,
//! checks the arguments of the collectives, routes eligible AllReduce, ReduceScatter and
//! AllGather calls to flashcomm's own kernels (`flashcomm-comm`), and forwards everything else to
//! the real NCCL, which it finds and opens itself. See `docs/abi.md` and `docs/architecture.md`.
//!
//! `unsafe` code lives only in the FFI modules `ffi`, `ext` and `engage`; every other module is safe
//! Rust.
//!
//! | module | role |
//! |---|---|
//! | `ffi::api` | hand-written exports (collectives, communicator lifecycle, groups, errors) |
//! | `ffi::forwarders` | generated plain forwarders |
//! | `ffi::boundary` | panic boundary, export macros, signature checks |
//! | `ffi::real` | loading the real NCCL |
//! | `ffi::nccl` | flashcomm's own calls to the real NCCL |
//! | `ffi::cuda` | CUDA context save/restore, the set-up stream, the caller's buffers as device pointers |
//! | `ext` | flashcomm's own API (`include/flashcomm.h`) |
//! | `route` | the routing seam: decisions, statistics, communicator and group hooks |
//! | `serve` | flashcomm's communicator behind a served NCCL communicator: set-up, routed calls, teardown |
//! | `bootstrap` | the set-up exchange over the real NCCL's `ncclAllGather` |
//! | `args` | argument checks of the collectives |
//! | `coll` | the common path of the collective exports |
//! | `discovery` | where to look for the real NCCL |
//! | `error`, `last_error` | errors, their codes, `ncclGetLastError` |
//! | `init`, `logging` | lazy initialization, NCCL-style logging |
//! | `engage` | the "flashcomm is on" line and the exit summary |
#![deny(unsafe_code)]

mod args;
mod bootstrap;
mod coll;
mod discovery;
mod engage;
mod error;
pub mod ext;
mod ffi;
mod init;
mod last_error;
mod logging;
pub mod route;
mod serve;
