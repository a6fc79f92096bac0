//! Errors of the codec functions.

use std::fmt;

use crate::format::{DType, FormatError};

/// Why an encode or decode call refused its arguments. Decoders return these for any malformed
/// input; they never panic on arbitrary bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CodecError {
    /// The format's parameters are invalid.
    Format(FormatError),
    /// The element type of the call is not the format's `dtype`.
    DType {
        /// The format's type.
        format: DType,
        /// The type of the slice passed in.
        element: DType,
    },
    /// An encoded buffer does not have the size the format and the value count imply.
    EncodedLength {
        /// `Format::encoded_len(n)`.
        expected: usize,
        /// The size passed in.
        actual: usize,
    },
    /// A value buffer does not have the expected number of elements.
    ValueLength {
        /// The expected number of elements.
        expected: usize,
        /// The number passed in.
        actual: usize,
    },
    /// The encoded size of `n` values does not fit in memory.
    TooLarge {
        /// The value count asked for.
        n: usize,
    },
    /// A fused or collective call was given no inputs.
    NoInputs,
    /// Bytes 4..16 of a block header do not match the expected format and value count.
    Header {
        /// Index of the block in the buffer.
        block: usize,
        /// Name of the first field that differs.
        field: &'static str,
        /// Value the format implies.
        expected: u32,
        /// Value found.
        found: u32,
    },
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::Format(e) => write!(f, "invalid format: {e}"),
            CodecError::DType { format, element } => {
                write!(
                    f,
                    "format is for {format} values but the call passes {element}"
                )
            }
            CodecError::EncodedLength { expected, actual } => {
                write!(f, "encoded buffer has {actual} bytes, expected {expected}")
            }
            CodecError::ValueLength { expected, actual } => {
                write!(f, "value buffer has {actual} elements, expected {expected}")
            }
            CodecError::TooLarge { n } => write!(f, "encoded size of {n} values overflows"),
            CodecError::NoInputs => f.write_str("no inputs"),
            CodecError::Header {
                block,
                field,
                expected,
                found,
            } => write!(
                f,
                "block {block}: header field {field} is {found}, expected {expected}"
            ),
        }
    }
}

impl std::error::Error for CodecError {}

impl From<FormatError> for CodecError {
    fn from(e: FormatError) -> Self {
        CodecError::Format(e)
    }
}
