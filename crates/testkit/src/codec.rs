//! The codec kernels (`cuda/testing/codec_<dtype>.cu`, device functions in
//! `flashcomm/codec.cuh`): kernel names, parameter blocks, formats and launch geometry. The
//! launchers are [`Codec`], re-exported here from the crate's FFI module.
//!
//! The wire format is `docs/codec.md`; the CPU reference (`flashcomm-codec`) is its
//! specification, and the GPU kernels reproduce it bit for bit.

pub use crate::codec_launch::{Codec, CodecStatusWords, CodecValue, InputTable};
use flashcomm_kernels::Error;

/// Threads per CTA of every codec kernel (`FC_CODEC_THREADS`): 8 warps, one 1024-value block
/// per warp at a time.
pub const THREADS: u32 = 256;
/// Warps per CTA.
pub const WARPS: u32 = THREADS / 32;
/// Values per block.
pub const BLOCK_VALUES: usize = 1024;
/// `FC_CODEC_FLAG_DIRECT_IO`: lane-strided 16-byte loads (encode) and stores (decode) instead of
/// staging through shared memory.
pub const FLAG_DIRECT_IO: u32 = 1;
/// `FC_CODEC_SCRATCH_BYTES`: shared memory per warp for spike patching.
pub const SCRATCH_BYTES: u32 = 4096;
/// `FC_CODEC_STAGES_16BIT`: encode input stages per warp for f16/bf16.
pub const STAGES_16BIT: u32 = 3;
/// `FC_CODEC_STAGES_32BIT`: encode input stages per warp for f32.
pub const STAGES_32BIT: u32 = 2;
/// `FC_CODEC_IN_STAGES`: slots of encoded input blocks per warp of staged decode and
/// reduce_requantize (each slot holds one encoded block of every input).
pub const IN_STAGES: u32 = 2;

/// Element type of the values (the format's `dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodecDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl CodecDtype {
    /// Every element type.
    pub const ALL: [CodecDtype; 3] = [CodecDtype::F32, CodecDtype::F16, CodecDtype::Bf16];

    /// Bytes per value.
    pub const fn size(self) -> usize {
        match self {
            CodecDtype::F32 => 4,
            CodecDtype::F16 | CodecDtype::Bf16 => 2,
        }
    }

    /// The name used in kernel names (`f32`, `f16`, `bf16`).
    pub const fn name(self) -> &'static str {
        match self {
            CodecDtype::F32 => "f32",
            CodecDtype::F16 => "f16",
            CodecDtype::Bf16 => "bf16",
        }
    }
}

/// A codec format: element type, bits per value (2..=8), group size (32, 64, 128, 256) and spikes
/// per group (0, 2, 4). Mirrors `flashcomm_codec::Format` (the tests check that both agree on
/// every layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CodecFormat {
    dtype: CodecDtype,
    bits: u8,
    group: u16,
    spikes: u8,
}

impl CodecFormat {
    /// Validates the parameters.
    pub fn new(dtype: CodecDtype, bits: u8, group: u16, spikes: u8) -> Result<Self, Error> {
        if !(2..=8).contains(&bits)
            || !matches!(group, 32 | 64 | 128 | 256)
            || !matches!(spikes, 0 | 2 | 4)
        {
            return Err(Error::InvalidArgument(format!(
                "invalid codec format: bits {bits}, group {group}, spikes {spikes}"
            )));
        }
        Ok(CodecFormat {
            dtype,
            bits,
            group,
            spikes,
        })
    }

    /// Element type.
    pub const fn dtype(&self) -> CodecDtype {
        self.dtype
    }
    /// Bits per value.
    pub const fn bits(&self) -> u8 {
        self.bits
    }
    /// Values per group.
    pub const fn group(&self) -> u16 {
        self.group
    }
    /// Spikes per group.
    pub const fn spikes(&self) -> u8 {
        self.spikes
    }

    /// Bytes of one encoded block (a multiple of 16).
    pub const fn block_bytes(&self) -> usize {
        let groups = BLOCK_VALUES / self.group as usize;
        let s = self.dtype.size();
        let k = self.spikes as usize;
        let end = 16 + 128 * self.bits as usize + groups * 2 * s + groups * k * s + groups * k;
        end.div_ceil(16) * 16
    }

    /// Blocks that hold `n` values.
    pub const fn blocks(n: usize) -> usize {
        n.div_ceil(BLOCK_VALUES)
    }

    /// Encoded bytes of `n` values.
    pub const fn encoded_len(&self, n: usize) -> usize {
        Self::blocks(n) * self.block_bytes()
    }
}

impl std::fmt::Display for CodecFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} b{} g{} k{}",
            self.dtype.name(),
            self.bits,
            self.group,
            self.spikes
        )
    }
}

/// The kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodecOp {
    /// `fc_codec_encode_<dtype>_b<bits>`.
    Encode,
    /// `fc_codec_decode_<dtype>_b<bits>`.
    Decode,
    /// `fc_codec_decode_accumulate_<dtype>_b<bits>`.
    DecodeAccumulate,
    /// `fc_codec_reduce_requantize_<dtype>_b<bits>` (bits: the output width; 2 CTAs per SM), and
    /// `fc_codec_reduce_requantize_1cta_<dtype>_b<bits>` (1 CTA per SM).
    ReduceRequantize,
}

impl CodecOp {
    /// The name part of the kernel family.
    pub const fn name(self) -> &'static str {
        match self {
            CodecOp::Encode => "encode",
            CodecOp::Decode => "decode",
            CodecOp::DecodeAccumulate => "decode_accumulate",
            CodecOp::ReduceRequantize => "reduce_requantize",
        }
    }
}

/// The name of the kernel of `op` for `dtype` and `bits`.
pub fn kernel_name(op: CodecOp, dtype: CodecDtype, bits: u8) -> String {
    format!("fc_codec_{}_{}_b{bits}", op.name(), dtype.name())
}

/// The variant of the reduce_requantize kernel compiled for one resident CTA per SM (no register
/// cap), which the launcher uses when shared memory admits only one CTA of the default kernel.
pub fn reduce_one_cta_kernel_name(dtype: CodecDtype, bits: u8) -> String {
    format!("fc_codec_reduce_requantize_1cta_{}_b{bits}", dtype.name())
}

/// Dynamic shared memory per warp that the kernel of `op` needs with `flags`, when its encoded
/// input blocks are `in_block_bytes` long and it reads `ninputs` of them per block (decode: 1;
/// reduce_requantize: the number of inputs; ignored by encode and decode_accumulate).
pub const fn smem_per_warp(
    op: CodecOp,
    dtype: CodecDtype,
    flags: u32,
    in_block_bytes: u32,
    ninputs: u32,
) -> u32 {
    let direct = flags & FLAG_DIRECT_IO != 0;
    let block = (BLOCK_VALUES * dtype.size()) as u32;
    match op {
        CodecOp::Encode => {
            if direct {
                0
            } else if dtype.size() == 4 {
                STAGES_32BIT * block
            } else {
                STAGES_16BIT * block
            }
        }
        // Spikes are patched in the output stage (or the output), not in a scratch.
        CodecOp::Decode => {
            if direct {
                0
            } else {
                block + IN_STAGES * in_block_bytes
            }
        }
        CodecOp::DecodeAccumulate => SCRATCH_BYTES,
        CodecOp::ReduceRequantize => {
            SCRATCH_BYTES
                + if direct {
                    0
                } else {
                    IN_STAGES * ninputs * in_block_bytes
                }
        }
    }
}

/// `FcCodecEncodeParams` (codec_params.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EncodeParams {
    /// Device pointer to the `n` input values.
    pub input: u64,
    /// Device pointer to the encoded output.
    pub output: u64,
    /// Values.
    pub n: u64,
    /// Group size.
    pub group: u32,
    /// Spikes per group.
    pub spikes: u32,
    /// `FLAG_*`.
    pub flags: u32,
    /// Zero.
    pub reserved: u32,
}

/// `FcCodecDecodeParams` (codec_params.h), for decode and decode_accumulate.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeParams {
    /// Device pointer to the encoded input.
    pub input: u64,
    /// Device pointer to the `n` output values (T, or f32 accumulators).
    pub output: u64,
    /// Values.
    pub n: u64,
    /// Device pointer to a [`CodecStatus`], or 0.
    pub status: u64,
    /// Group size.
    pub group: u32,
    /// Spikes per group.
    pub spikes: u32,
    /// `FLAG_*`.
    pub flags: u32,
    /// Zero.
    pub reserved: u32,
}

/// `FcCodecReduceParams` (codec_params.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReduceParams {
    /// Device pointer to `ninputs` u64 device pointers of encoded inputs.
    pub inputs: u64,
    /// Device pointer to the encoded output.
    pub output: u64,
    /// Values.
    pub n: u64,
    /// Device pointer to a [`CodecStatus`], or 0.
    pub status: u64,
    /// Inputs (>= 1).
    pub ninputs: u32,
    /// Width of the inputs.
    pub in_bits: u32,
    /// Group size of the inputs.
    pub in_group: u32,
    /// Spikes of the inputs.
    pub in_spikes: u32,
    /// Group size of the output.
    pub out_group: u32,
    /// Spikes of the output.
    pub out_spikes: u32,
    /// `FLAG_*`.
    pub flags: u32,
    /// Zero.
    pub reserved: u32,
}

/// `FcCodecStatus`: what decoders report about blocks whose header did not match.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodecStatus {
    /// Rejected blocks.
    pub bad_blocks: u32,
    /// Lowest rejected block index (`u32::MAX` when none).
    pub first_bad_block: u32,
}

impl CodecStatus {
    /// The initial value: no rejected block.
    pub const CLEAR: CodecStatus = CodecStatus {
        bad_blocks: 0,
        first_bad_block: u32::MAX,
    };
}

// Same sizes and offsets as the static_asserts of codec_params.h.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<EncodeParams>() == 40);
    assert!(offset_of!(EncodeParams, n) == 16);
    assert!(offset_of!(EncodeParams, group) == 24);
    assert!(offset_of!(EncodeParams, flags) == 32);
    assert!(size_of::<DecodeParams>() == 48);
    assert!(offset_of!(DecodeParams, status) == 24);
    assert!(offset_of!(DecodeParams, group) == 32);
    assert!(offset_of!(DecodeParams, flags) == 40);
    assert!(size_of::<ReduceParams>() == 64);
    assert!(offset_of!(ReduceParams, status) == 24);
    assert!(offset_of!(ReduceParams, ninputs) == 32);
    assert!(offset_of!(ReduceParams, out_group) == 48);
    assert!(offset_of!(ReduceParams, flags) == 56);
    assert!(size_of::<CodecStatus>() == 8);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_constants_match_the_cuda_header() {
        let h = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../cuda/include/flashcomm/codec_params.h"),
        )
        .unwrap();
        let define = |name: &str| -> u32 {
            let line = h
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} not in codec_params.h"));
            let v = line.split_whitespace().nth(2).unwrap();
            v.trim_end_matches('u').parse().unwrap()
        };
        assert_eq!(define("FC_CODEC_THREADS"), THREADS);
        assert_eq!(define("FC_CODEC_FLAG_DIRECT_IO"), FLAG_DIRECT_IO);
        assert_eq!(define("FC_CODEC_SCRATCH_BYTES"), SCRATCH_BYTES);
        assert_eq!(define("FC_CODEC_STAGES_16BIT"), STAGES_16BIT);
        assert_eq!(define("FC_CODEC_STAGES_32BIT"), STAGES_32BIT);
        assert_eq!(define("FC_CODEC_IN_STAGES"), IN_STAGES);
    }

    #[test]
    fn names_and_sizes() {
        assert_eq!(
            kernel_name(CodecOp::DecodeAccumulate, CodecDtype::Bf16, 4),
            "fc_codec_decode_accumulate_bf16_b4"
        );
        let f = CodecFormat::new(CodecDtype::Bf16, 4, 128, 2).unwrap();
        assert_eq!(f.block_bytes(), 16 + 512 + 32 + 32 + 16);
        assert_eq!(f.encoded_len(1025), 2 * f.block_bytes());
        assert!(CodecFormat::new(CodecDtype::F32, 9, 128, 2).is_err());
        assert!(CodecFormat::new(CodecDtype::F32, 4, 16, 2).is_err());
        assert!(CodecFormat::new(CodecDtype::F32, 4, 32, 3).is_err());
    }
}
