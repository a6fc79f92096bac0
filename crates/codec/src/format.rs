//! Formats and the byte layout of a block (`docs/codec.md`, "Parameters" and "Blocks").

use std::fmt;

/// Values per block. Every block of a format has the same size in bytes.
pub const BLOCK_VALUES: usize = 1024;

/// Size of the block header in bytes.
pub const HEADER_BYTES: usize = 16;

/// Every payload width the format allows, in bits per value.
pub const ALL_BITS: [u8; 7] = [2, 3, 4, 5, 6, 7, 8];

/// Every group size the format allows, in values.
pub const ALL_GROUPS: [u16; 4] = [32, 64, 128, 256];

/// Every spike count the format allows, in values per group.
pub const ALL_SPIKES: [u8; 3] = [0, 2, 4];

/// Every element type the format allows.
pub const ALL_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

/// Element type of the values before encoding and after decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE-754 binary32.
    F32,
    /// IEEE-754 binary16.
    F16,
    /// bfloat16: the upper half of a binary32.
    Bf16,
}

impl DType {
    /// Size of one value in bytes (4, 2, 2).
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Size of one value in bytes, for byte arithmetic on buffer lengths.
    pub const fn bytes(self) -> u64 {
        self.size() as u64
    }

    /// The name nccl-tests prints in its `type` column (`float`, `half`, `bfloat16`).
    pub const fn long_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "half",
            DType::Bf16 => "bfloat16",
        }
    }

    /// The short name kernels and tools use (`f32`, `f16`, `bf16`).
    pub const fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    /// The code written in byte 9 of the header (0 = f32, 1 = f16, 2 = bf16).
    pub const fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Bf16 => 2,
        }
    }

    /// The type whose header code is `code`, if any.
    pub const fn from_code(code: u8) -> Option<DType> {
        match code {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::Bf16),
            _ => None,
        }
    }

    /// Lower-case name as used in the documentation (`f32`, `f16`, `bf16`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why [`Format::new`] refused its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatError {
    /// `bits` is not in 2..=8.
    Bits(u8),
    /// `group` is not 32, 64, 128 or 256.
    Group(u16),
    /// `spikes` is not 0, 2 or 4.
    Spikes(u8),
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::Bits(b) => write!(f, "bits must be 2..=8, got {b}"),
            FormatError::Group(g) => write!(f, "group must be 32, 64, 128 or 256, got {g}"),
            FormatError::Spikes(k) => write!(f, "spikes must be 0, 2 or 4, got {k}"),
        }
    }
}

impl std::error::Error for FormatError {}

/// A validated format: element type, payload bits, group size and spikes per group.
///
/// The fields are private so that every `Format` in existence is valid; read them with the
/// accessors of the same names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Format {
    dtype: DType,
    bits: u8,
    group: u16,
    spikes: u8,
}

/// Widths of the units a code of `bits` bits is split into, most significant unit first.
const fn units_of(bits: u8) -> &'static [u8] {
    match bits {
        2 => &[2],
        3 => &[2, 1],
        4 => &[4],
        5 => &[4, 1],
        6 => &[4, 2],
        7 => &[4, 2, 1],
        _ => &[8],
    }
}

impl Format {
    /// Checks the parameters against the table in `docs/codec.md` and builds the format.
    pub const fn new(
        dtype: DType,
        bits: u8,
        group: u16,
        spikes: u8,
    ) -> Result<Format, FormatError> {
        if bits < 2 || bits > 8 {
            return Err(FormatError::Bits(bits));
        }
        if !matches!(group, 32 | 64 | 128 | 256) {
            return Err(FormatError::Group(group));
        }
        if !matches!(spikes, 0 | 2 | 4) {
            return Err(FormatError::Spikes(spikes));
        }
        Ok(Format {
            dtype,
            bits,
            group,
            spikes,
        })
    }

    /// Every valid format (3 types x 7 widths x 4 groups x 3 spike counts = 252), in the order
    /// dtype, bits, group, spikes.
    pub fn all() -> impl Iterator<Item = Format> {
        ALL_DTYPES.into_iter().flat_map(|d| {
            ALL_BITS.into_iter().flat_map(move |b| {
                ALL_GROUPS.into_iter().flat_map(move |g| {
                    ALL_SPIKES
                        .into_iter()
                        .map(move |k| Format::new(d, b, g, k).expect("table values are valid"))
                })
            })
        })
    }

    /// This format with another element type (the layout depends on it through the value size).
    pub const fn with_dtype(self, dtype: DType) -> Format {
        Format { dtype, ..self }
    }

    /// Element type.
    pub const fn dtype(&self) -> DType {
        self.dtype
    }

    /// Payload bits per value (b), 2..=8.
    pub const fn bits(&self) -> u8 {
        self.bits
    }

    /// Values per group (g): 32, 64, 128 or 256.
    pub const fn group(&self) -> u16 {
        self.group
    }

    /// log2 of the group size, as written in byte 7 of the header.
    pub const fn group_log2(&self) -> u8 {
        self.group.trailing_zeros() as u8
    }

    /// Spike values kept exactly per group (k): 0, 2 or 4.
    pub const fn spikes(&self) -> u8 {
        self.spikes
    }

    /// The largest code, `2^b - 1`.
    pub const fn max_code(&self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// Unit widths of the bit planes, most significant first (for example `[4, 2, 1]` for 7 bits).
    pub const fn units(&self) -> &'static [u8] {
        units_of(self.bits)
    }

    /// Groups per block, `1024 / g`.
    pub const fn groups_per_block(&self) -> usize {
        BLOCK_VALUES / self.group as usize
    }

    /// Offset of the payload (the first bit plane) inside a block: 16.
    pub const fn payload_offset(&self) -> usize {
        HEADER_BYTES
    }

    /// Size of the payload, `128 * b` bytes.
    pub const fn payload_bytes(&self) -> usize {
        BLOCK_VALUES / 8 * self.bits as usize
    }

    /// Offset of bit plane `plane` (index into [`Format::units`]) inside a block.
    ///
    /// Planes past the last one give the end of the payload.
    pub const fn plane_offset(&self, plane: usize) -> usize {
        let units = self.units();
        let mut off = self.payload_offset();
        let mut p = 0;
        while p < plane && p < units.len() {
            off += BLOCK_VALUES / 8 * units[p] as usize;
            p += 1;
        }
        off
    }

    /// Size of bit plane `plane` in bytes, `128 * u` (0 past the last plane).
    pub const fn plane_bytes(&self, plane: usize) -> usize {
        let units = self.units();
        if plane < units.len() {
            BLOCK_VALUES / 8 * units[plane] as usize
        } else {
            0
        }
    }

    /// Offset of the range table (`lo, hi` per group, in the element type).
    pub const fn range_offset(&self) -> usize {
        self.payload_offset() + self.payload_bytes()
    }

    /// Size of the range table, `(1024 / g) * 2 * s` bytes.
    pub const fn range_bytes(&self) -> usize {
        self.groups_per_block() * 2 * self.dtype.size()
    }

    /// Offset of the spike values (`k` per group, in the element type).
    pub const fn spike_values_offset(&self) -> usize {
        self.range_offset() + self.range_bytes()
    }

    /// Size of the spike values, `(1024 / g) * k * s` bytes.
    pub const fn spike_values_bytes(&self) -> usize {
        self.groups_per_block() * self.spikes as usize * self.dtype.size()
    }

    /// Offset of the spike positions (`k` bytes per group).
    pub const fn spike_positions_offset(&self) -> usize {
        self.spike_values_offset() + self.spike_values_bytes()
    }

    /// Size of the spike positions, `(1024 / g) * k` bytes.
    pub const fn spike_positions_bytes(&self) -> usize {
        self.groups_per_block() * self.spikes as usize
    }

    /// Offset of the zero padding that rounds the block up to a multiple of 16 bytes.
    pub const fn padding_offset(&self) -> usize {
        self.spike_positions_offset() + self.spike_positions_bytes()
    }

    /// Size of the zero padding, 0..=15 bytes.
    pub const fn padding_bytes(&self) -> usize {
        self.block_bytes() - self.padding_offset()
    }

    /// Size of every block of this format in bytes (a multiple of 16).
    pub const fn block_bytes(&self) -> usize {
        self.padding_offset().div_ceil(16) * 16
    }

    /// Number of blocks that hold `n` values, `ceil(n / 1024)`.
    pub const fn blocks(n: usize) -> usize {
        n.div_ceil(BLOCK_VALUES)
    }

    /// Valid values in block `block` of a buffer of `n` values (0 for a block past the end).
    pub const fn block_values(n: usize, block: usize) -> usize {
        let start = block.saturating_mul(BLOCK_VALUES);
        if start >= n {
            0
        } else if n - start > BLOCK_VALUES {
            BLOCK_VALUES
        } else {
            n - start
        }
    }

    /// Encoded size of `n` values in bytes, `ceil(n / 1024) * block_bytes`.
    ///
    /// Saturates at `usize::MAX` for absurd `n`; use [`Format::checked_encoded_len`] to detect it.
    pub const fn encoded_len(&self, n: usize) -> usize {
        match self.checked_encoded_len(n) {
            Some(len) => len,
            None => usize::MAX,
        }
    }

    /// Encoded size of `n` values in bytes, or `None` when it does not fit in `usize`.
    pub const fn checked_encoded_len(&self, n: usize) -> Option<usize> {
        Format::blocks(n).checked_mul(self.block_bytes())
    }

    /// Bits on the wire per value: `block_bytes * 8 / 1024`, payload plus header and metadata.
    pub fn effective_bits(&self) -> f64 {
        (self.block_bytes() * 8) as f64 / BLOCK_VALUES as f64
    }

    /// Bytes 4..16 of the header of a block that holds `nvalues` values.
    pub const fn header_fields(&self, nvalues: u16) -> [u8; 12] {
        let nv = nvalues.to_le_bytes();
        [
            nv[0],
            nv[1],
            self.bits,
            self.group_log2(),
            self.spikes,
            self.dtype.code(),
            0,
            0,
            0,
            0,
            0,
            0,
        ]
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} b{} g{} k{}",
            self.dtype, self.bits, self.group, self.spikes
        )
    }
}
