// Parameter blocks of the codec kernels (cuda/codec.cu), shared with the host
// (crates/kernels/src/codec.rs mirrors every struct; both sides assert sizes and offsets).
//
// Every kernel takes exactly one of these by value (`const __grid_constant__`). Buffers are
// device pointers that must be 16-byte aligned; encoded buffers hold ceil(n / 1024) blocks of
// block_bytes(format) bytes each (docs/codec.md).
#pragma once
#include <stdint.h>

// Threads per CTA of every codec kernel (8 warps; one warp works on one 1024-value block).
#define FC_CODEC_THREADS 256

// Flags.
// Direct I/O: encode reads each lane's 32 values with its own 16-byte loads, decode writes them
// with its own 16-byte stores, and decode and reduce_requantize read their encoded inputs straight
// from global memory (no shared-memory staging). Without it, encode stages its input through
// shared memory with cp.async (coalesced, several blocks in flight per warp), decode stages its
// output through shared memory (coalesced stores), and decode and reduce_requantize prefetch
// their encoded input blocks (FC_CODEC_IN_STAGES).
#define FC_CODEC_FLAG_DIRECT_IO 1u

// Dynamic shared memory, per warp (the host sizes the launch with these; kernels check).
#define FC_CODEC_SCRATCH_BYTES 4096  // spike patching in registers (decode_accumulate, reduce): 32 lanes x 32 f32
#define FC_CODEC_STAGES_16BIT 3      // encode input stages of 2 KiB (f16, bf16)
#define FC_CODEC_STAGES_32BIT 2      // encode input stages of 4 KiB (f32)
// Staged decode and reduce_requantize (no FC_CODEC_FLAG_DIRECT_IO) also copy their encoded input
// blocks into shared memory with cp.async, FC_CODEC_IN_STAGES slots per warp, each slot holding
// one encoded block of every input (block_bytes(format) x ninputs): the next block's inputs are
// in flight while this one is decoded, instead of one dependent round trip to memory per field.
#define FC_CODEC_IN_STAGES 2

// encode: input T[n] -> output (encoded).
struct FcCodecEncodeParams {
  uint64_t input;   // T[n]
  uint64_t output;  // ceil(n / 1024) * block_bytes bytes
  uint64_t n;       // values
  uint32_t group;   // 32, 64, 128 or 256
  uint32_t spikes;  // 0, 2 or 4
  uint32_t flags;   // FC_CODEC_FLAG_*
  uint32_t reserved;
};

// decode: input (encoded) -> output T[n].
// decode_accumulate: input (encoded) -> output f32[n], output[i] = output[i] + decoded[i].
struct FcCodecDecodeParams {
  uint64_t input;   // encoded
  uint64_t output;  // T[n] (decode) or f32[n] (decode_accumulate)
  uint64_t n;       // values
  uint64_t status;  // FcCodecStatus* (device memory) or 0
  uint32_t group;
  uint32_t spikes;
  uint32_t flags;
  uint32_t reserved;
};

// reduce_requantize: ninputs encoded buffers (format: in_bits / in_group / in_spikes) -> output
// encoded with the kernel's width and out_group / out_spikes.
struct FcCodecReduceParams {
  uint64_t inputs;  // device array of ninputs u64 device pointers, each to an encoded buffer
  uint64_t output;  // encoded, output format
  uint64_t n;       // values
  uint64_t status;  // FcCodecStatus* (device memory) or 0
  uint32_t ninputs; // >= 1
  uint32_t in_bits; // 2..8
  uint32_t in_group;
  uint32_t in_spikes;
  uint32_t out_group;
  uint32_t out_spikes;
  uint32_t flags;
  uint32_t reserved;
};

// Written by decoders that meet a block whose header (bytes 4..16) does not match the format and
// value count they expect: that block's output is left unchanged. The host initializes it to
// {0, 0xFFFFFFFF}.
struct FcCodecStatus {
  uint32_t bad_blocks;       // number of rejected blocks (all inputs together)
  uint32_t first_bad_block;  // lowest rejected block index
};

#ifdef __cplusplus
#include <stddef.h>
static_assert(sizeof(FcCodecEncodeParams) == 40, "FcCodecEncodeParams layout");
static_assert(offsetof(FcCodecEncodeParams, n) == 16, "FcCodecEncodeParams layout");
static_assert(offsetof(FcCodecEncodeParams, group) == 24, "FcCodecEncodeParams layout");
static_assert(offsetof(FcCodecEncodeParams, flags) == 32, "FcCodecEncodeParams layout");
static_assert(sizeof(FcCodecDecodeParams) == 48, "FcCodecDecodeParams layout");
static_assert(offsetof(FcCodecDecodeParams, status) == 24, "FcCodecDecodeParams layout");
static_assert(offsetof(FcCodecDecodeParams, group) == 32, "FcCodecDecodeParams layout");
static_assert(offsetof(FcCodecDecodeParams, flags) == 40, "FcCodecDecodeParams layout");
static_assert(sizeof(FcCodecReduceParams) == 64, "FcCodecReduceParams layout");
static_assert(offsetof(FcCodecReduceParams, status) == 24, "FcCodecReduceParams layout");
static_assert(offsetof(FcCodecReduceParams, ninputs) == 32, "FcCodecReduceParams layout");
static_assert(offsetof(FcCodecReduceParams, out_group) == 48, "FcCodecReduceParams layout");
static_assert(offsetof(FcCodecReduceParams, flags) == 56, "FcCodecReduceParams layout");
static_assert(sizeof(FcCodecStatus) == 8, "FcCodecStatus layout");
#endif
