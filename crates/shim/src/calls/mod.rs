//! What we call: the operating system, the CUDA driver (through `flashcomm-gpu`) and the real
//! NCCL. With `exports`, the only place where `unsafe` code is allowed; every `unsafe` block
//! carries a `// SAFETY:` comment (`clippy::undocumented_unsafe_blocks` is denied
//! workspace-wide).
//!
//! * `os`: the thread id, fork detection.
//! * `cuda`: the shim's CUDA needs, through `flashcomm-gpu` (the caller's context around
//!   set-up, the set-up exchange's stream, the current device), and the caller's buffers of a
//!   routed collective as device pointers. The shim has no driver bindings of its own.
//! * `real`: finding, opening and resolving the real NCCL.
//! * `nccl`: flashcomm's own calls to the real NCCL (identity, set-up all-gather, async error).
//!
//! Nothing here imports the registry, the policy, serving, dispatch or the exports.
#![allow(unsafe_code)]

pub(crate) mod cuda;
pub(crate) mod nccl;
pub(crate) mod os;
pub(crate) mod real;
