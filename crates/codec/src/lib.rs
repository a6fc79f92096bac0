//! The flashcomm wire format and its CPU reference implementation.
//!
//! This crate is the executable form of `docs/codec.md`: any-bit (2 to 8) group quantization
//! with bit splitting (each code split into 4-, 2- and 1-bit planes) and spike reserving (the
//! extreme values of each group kept exactly). The CUDA codec reproduces it bit for bit.
//!
//! * [`Format`] and its layout methods describe a block of 1024 values.
//! * [`encode`], [`decode`], [`decode_accumulate`] and [`reduce_requantize`] are the codec.
//! * [`error_bound`] gives the per-element guarantee that the tests check.
//! * [`DType`] and [`Collective`] are the tree's one element-type and one collective enum, and
//!   [`rng`] its one seeded generator: they live here, in the lowest crate, so every crate above
//!   shares them; so do the other words of a call's route ([`Protocol`], [`Algorithm`],
//!   [`Transport`], [`QuantChoice`], [`Choice`]).
//! * [`reference`](mod@reference) holds the quantized all-reduce algorithms as the GPU computes them.
//!
//! Decoders validate lengths and headers and never panic on arbitrary bytes.

#![forbid(unsafe_code)]

mod codec;
mod collective;
mod element;
mod error;
mod format;
pub mod reference;
pub mod rng;
mod tables;
mod words;

pub use codec::{
    decode, decode_accumulate, decode_f32, encode, encode_to_vec, error_bound, error_bound_f32,
    reduce_requantize, select_spikes,
};
pub use collective::{Collective, QuantOp};
pub use element::Element;
pub use error::CodecError;
pub use format::{
    ALL_BITS, ALL_DTYPES, ALL_GROUPS, ALL_SPIKES, BLOCK_VALUES, DType, Format, FormatError,
    HEADER_BYTES,
};
pub use half::{bf16, f16};
pub use tables::{ErrorRow, effective_bits_markdown, error_rows, error_table_markdown};
pub use words::{Algorithm, Choice, HostCopy, Keyword, Protocol, QuantChoice, Transport};

/// The version of the wire format this crate specifies (`docs/codec.md`, "wire format, version
/// 1"). Ranks compare it at set-up: a rank that encodes another version never decodes with this
/// one.
pub const WIRE_FORMAT_VERSION: u32 = 1;
