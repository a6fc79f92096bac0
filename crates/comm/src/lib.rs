//! The flashcomm communicator: peer memory, device-side epochs, the self-synchronizing
//! collectives, the cost-guided selector, and the ways ranks find each other.
//!
//! A [`Communicator`] is one rank of a group of up to eight GPUs of one machine (or up to eight
//! "virtual ranks" sharing one GPU, for testing) that exchange data through each other's memory.
//! It is built collectively from a [`Bootstrap`] (an all-gather of small host buffers), runs
//! AllReduce, ReduceScatter and AllGather on flashcomm's kernels, and reports device-side
//! failures (a peer that never arrives, an abort, ranks calling different collectives) through
//! [`Communicator::check_status`]. It knows nothing of the NCCL ABI: the shim maps NCCL calls onto
//! it and passes everything else through to the real NCCL. A call is one [`Request`]; the
//! communicator has one entry to plan it ([`Communicator::plan`]) and one to run it
//! ([`Communicator::execute`]), and the plan is what `execute` runs.
//!
//! `unsafe` code is confined to the [`gpu`] module.
#![deny(unsafe_code)]

pub use flashcomm_kernels::abi;
pub mod bootstrap;
mod comm;
pub mod error;
pub mod gpu;
pub mod identity;
pub mod plan;
mod register;
mod release;
pub mod request;
mod residency;
pub mod trace;
mod transport;
pub mod watch;

pub use bootstrap::{Agreement, Bootstrap, ThreadBootstrap, ThreadGroup};
pub use comm::{CommConfig, Communicator, Foreign};
pub use error::Error;
pub use gpu::{DeviceMem, DevicePtr, Stream};
pub use identity::Build;
pub use plan::{
    Algorithm, Choice, Collective, CostModel, DataType, Plan, Protocol, QuantChoice, QuantModel,
    QuantSpec,
};
pub use register::RegistrationId;
pub use release::Release;
pub use request::{Buffers, Request};
pub use transport::Transport;
pub use transport::kept_arenas;
