//! What we call: the bindings to the operating system, the CUDA driver and the real NCCL. With
//! `exports`, the only place where `unsafe` code is allowed; every `unsafe` block carries a
//! `// SAFETY:` comment (`clippy::undocumented_unsafe_blocks` is denied workspace-wide).
//!
//! * `os`: the thread id, fork detection.
//! * `cuda`: every CUDA driver call of the shim (the caller's context around set-up, the
//!   set-up exchange's stream, the current device, the caller's buffers of a routed collective).
//! * `real`: finding, opening and resolving the real NCCL.
//! * `nccl`: flashcomm's own calls to the real NCCL (identity, set-up all-gather, async error).
//!
//! Nothing here imports the registry, the policy, serving, dispatch or the exports.
#![allow(unsafe_code)]

pub(crate) mod cuda;
pub(crate) mod nccl;
pub(crate) mod os;
pub(crate) mod real;
