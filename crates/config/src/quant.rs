//! The quantization settings of one communicator, as `FLASHCOMM_QUANT_*` and the C API give them.

use std::fmt;

use crate::{Bytes, Collective, QuantBits, Value};

/// The quantization settings of one communicator: the widths of both steps, the group, the
/// spikes and the window of message sizes (bytes per rank) that may be quantized. Which
/// collectives and element types may be quantized stays process-wide (`FLASHCOMM_QUANT_OPS`,
/// `FLASHCOMM_QUANT_DTYPES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSettings {
    /// Width of the reduce-scatter step (the only step of one-shot).
    pub rs_bits: QuantBits,
    /// Width of the all-gather step.
    pub ag_bits: QuantBits,
    /// Width of the quantized AllGather collective.
    pub allgather_bits: QuantBits,
    /// Width of the quantized ReduceScatter collective.
    pub reducescatter_bits: QuantBits,
    /// Width of the quantized AllToAll collective.
    pub alltoall_bits: QuantBits,
    /// Values per group: 32, 64, 128 or 256.
    pub group: u32,
    /// Extreme values kept exactly per group: 0, 2 or 4.
    pub spikes: u32,
    /// Smallest message (bytes per rank) that may be quantized.
    pub min_bytes: u64,
    /// Largest message (bytes per rank) that may be quantized.
    pub max_bytes: u64,
}

impl QuantSettings {
    /// The group-quantization widths `(reduce-scatter, all-gather)`, when both steps quantize.
    /// `None` when either step is `off` or `16`: the AllReduce stays lossless.
    pub fn widths(&self) -> Option<(u8, u8)> {
        match (self.rs_bits, self.ag_bits) {
            (QuantBits::Bits(r), QuantBits::Bits(a)) => Some((r, a)),
            _ => None,
        }
    }

    /// The width of a one-step quantized collective (AllGather, ReduceScatter, AllToAll), when
    /// it quantizes; `None` when it stays lossless (and for AllReduce: see
    /// [`QuantSettings::widths`]).
    pub fn op_bits(&self, coll: Collective) -> Option<u8> {
        let b = match coll {
            Collective::AllGather => self.allgather_bits,
            Collective::ReduceScatter => self.reducescatter_bits,
            Collective::AlltoAll => self.alltoall_bits,
            _ => return None,
        };
        match b {
            QuantBits::Bits(n) => Some(n),
            _ => None,
        }
    }

    /// Whether a message of `bytes` (per rank) lies inside the quantization window.
    pub fn in_window(&self, bytes: u64) -> bool {
        (self.min_bytes..=self.max_bytes).contains(&bytes)
    }

    /// Checks values that came from outside the environment (the C API): widths, group, spikes
    /// and the window. The message says what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if ![32, 64, 128, 256].contains(&self.group) {
            return Err(format!("group {} (allowed: 32, 64, 128, 256)", self.group));
        }
        if ![0, 2, 4].contains(&self.spikes) {
            return Err(format!("spikes {} (allowed: 0, 2, 4)", self.spikes));
        }
        for b in [
            self.rs_bits,
            self.ag_bits,
            self.allgather_bits,
            self.reducescatter_bits,
            self.alltoall_bits,
        ] {
            if let QuantBits::Bits(n) = b
                && !(2..=8).contains(&n)
            {
                return Err(format!(
                    "width {n} bits (allowed: 2..=8, or 16 for lossless)"
                ));
            }
        }
        if self.min_bytes > self.max_bytes {
            return Err(format!(
                "min_bytes {} is larger than max_bytes {}",
                self.min_bytes, self.max_bytes
            ));
        }
        Ok(())
    }
}

impl fmt::Display for QuantSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rs {} bits, ag {} bits, allgather {} bits, reducescatter {} bits, alltoall {} bits, group {}, spikes {}, window [{}, {}]",
            self.rs_bits.show(),
            self.ag_bits.show(),
            self.allgather_bits.show(),
            self.reducescatter_bits.show(),
            self.alltoall_bits.show(),
            self.group,
            self.spikes,
            Bytes(self.min_bytes),
            Bytes(self.max_bytes)
        )
    }
}
