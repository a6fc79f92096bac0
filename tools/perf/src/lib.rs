//! `flashcomm-perf`: the benchmark and accuracy tool of flashcomm, in the style of nccl-tests.
//!
//! It times flashcomm's collectives (lossless AllReduce, ReduceScatter, AllGather and AllToAll,
//! the quantized AllReduce and the one-step quantized AllGather, ReduceScatter and AllToAll) on
//! virtual ranks (several ranks sharing one GPU, one thread each) or on one GPU per rank, side by
//! side with the real NCCL (loaded by path) and with a device-to-device copy of the same bytes;
//! checks every result; prints nccl-tests' columns plus error and ratio columns; writes JSON and
//! an SVG plot. `docs/perf-tool.md` describes the usage and every column.
//!
//! Everything but the GPU driver ([`run`]) and the foreign calls ([`ffi`]) is pure and
//! unit-tested on the CPU. The GPU parts need a GPU only at run time and fail with a message
//! without one. `unsafe` code lives in [`ffi`] alone.
#![deny(unsafe_code)]

pub mod accuracy;
pub mod app;
pub mod args;
pub mod ffi;
pub mod inputs;
pub mod phases;
pub mod report;
pub mod run;
pub mod svg;
pub mod sweep;
