// Codec kernels over whole buffers (the bodies; cuda/codec_<dtype>.cu instantiate them): encode,
// decode, decode_accumulate and the fused reduce_requantize, for every width 2..8
// (docs/codec.md; the device functions are in flashcomm/codec.cuh).
//
// Every kernel runs FC_CODEC_THREADS threads per CTA; each warp takes blocks of 1024 values
// grid-stride (block b goes to global warp b % warps, in order). Names:
//   fc_codec_encode_<dtype>_b<bits>              FcCodecEncodeParams
//   fc_codec_decode_<dtype>_b<bits>              FcCodecDecodeParams
//   fc_codec_decode_accumulate_<dtype>_b<bits>   FcCodecDecodeParams (output is f32[n], read and written)
//   fc_codec_reduce_requantize_<dtype>_b<bits>   FcCodecReduceParams (bits: output width; the input
//                                                width is a run-time parameter; 2 CTAs per SM)
//   fc_codec_reduce_requantize_1cta_<dtype>_b<bits>  the same for 1 CTA per SM (see FC_CODEC_MIN_CTAS)
// with dtype f32, f16, bf16. Dynamic shared memory per warp: see codec_params.h and
// crates/kernels/src/codec.rs (the kernels trap if the launch gave too little).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "flashcomm/codec.cuh"
#include "flashcomm/codec_params.h"

namespace fc {
namespace codec {
namespace kern {

constexpr uint32_t kWarps = FC_CODEC_THREADS / 32;

template <typename T>
struct Io {
  static constexpr uint32_t kChunks = 32u * Elem<T>::kBytes / 16u;  // 16-byte chunks per lane (4 or 8)
  static constexpr uint32_t kBlockBytes = kBlockValues * Elem<T>::kBytes;
  static constexpr uint32_t kStages = Elem<T>::kBytes == 4 ? FC_CODEC_STAGES_32BIT : FC_CODEC_STAGES_16BIT;
};

// Position (in 16-byte chunks) of chunk `c` of a block of T staged in shared memory. Chunk c
// belongs to lane c / kChunks; the low bits are XOR-swizzled so that both the lane-contiguous
// accesses (a lane's own chunks) and the warp-contiguous ones (chunk r*32 + lane) are free of
// bank conflicts.
template <typename T>
__device__ __forceinline__ uint32_t stage_pos(uint32_t c) {
  constexpr uint32_t K = Io<T>::kChunks;
  const uint32_t l = c / K, j = c % K;
  const uint32_t swz = K == 8 ? (l & 7u) : ((l >> 1) & 3u);
  return l * K + (j ^ swz);
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// Traps when the launch gave less dynamic shared memory than the kernel uses (a host/device
// mismatch is a bug, not a run-time condition).
__device__ __forceinline__ void require_smem(uint32_t per_warp) {
  if (dynamic_smem_bytes() < per_warp * kWarps) __trap();
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, uint32_t src_bytes) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Bytes of a 16-byte chunk at byte offset `off` of a buffer of `total` bytes that lie inside it.
__device__ __forceinline__ uint32_t chunk_bytes(uint64_t off, uint64_t total) {
  return off >= total ? 0u : (uint32_t)min((uint64_t)16, total - off);
}

// Loads up to 16 bytes (zero-filled), 16-byte vector when complete. `src` is 16-byte aligned.
__device__ __forceinline__ uint4 load_chunk(const uint8_t* src, uint32_t nbytes) {
  if (nbytes == 16u) return *reinterpret_cast<const uint4*>(src);
  uint4 v = make_uint4(0, 0, 0, 0);
  uint16_t* d = reinterpret_cast<uint16_t*>(&v);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i)
    if (2 * i < nbytes) d[i] = s[i];
  return v;
}

__device__ __forceinline__ void store_chunk(uint8_t* dst, uint4 v, uint32_t nbytes) {
  if (nbytes == 16u) {
    *reinterpret_cast<uint4*>(dst) = v;
    return;
  }
  const uint16_t* s = reinterpret_cast<const uint16_t*>(&v);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i)
    if (2 * i < nbytes) d[i] = s[i];
}

__device__ __forceinline__ void report_bad_block(uint64_t status, uint64_t b) {
  if (status == 0) return;
  FcCodecStatus* st = reinterpret_cast<FcCodecStatus*>(status);
  atomicAdd(&st->bad_blocks, 1u);
  atomicMin(&st->first_bad_block, (uint32_t)min(b, (uint64_t)0xffffffffu));
}

// ================================================================================== encode ====

template <typename T, int B>
__device__ __forceinline__ void encode_kernel(const FcCodecEncodeParams& p) {
  using I = Io<T>;
  const uint32_t lane = lane_id(), wib = threadIdx.x >> 5;
  const uint64_t nblocks = (p.n + kBlockValues - 1) / kBlockValues;
  const uint64_t total = p.n * Elem<T>::kBytes;
  const uint64_t tw = (uint64_t)gridDim.x * kWarps;
  const Layout<T, B> L(p.group, p.spikes);
  const uint8_t* in = reinterpret_cast<const uint8_t*>(p.input);
  uint8_t* out = reinterpret_cast<uint8_t*>(p.output);
  uint64_t b = (uint64_t)blockIdx.x * kWarps + wib;

  // Staged (default): a ring of kStages blocks per warp, filled with coalesced cp.async; block
  // b + kStages * warps is in flight while block b is encoded. Direct: each lane loads its own
  // 16-byte chunks. One loop, so that the encoder is instantiated once.
  const bool direct = (p.flags & FC_CODEC_FLAG_DIRECT_IO) != 0;
  extern __shared__ uint4 smem[];
  uint4* ring = smem + (size_t)wib * I::kStages * (I::kBlockBytes / 16u);
  auto issue = [&](uint64_t blk, uint32_t slot) {
    if (blk < nblocks) {
      uint4* st = ring + slot * (I::kBlockBytes / 16u);
#pragma unroll
      for (uint32_t r = 0; r < I::kChunks; ++r) {
        const uint32_t c = r * 32u + lane;
        const uint64_t off = blk * I::kBlockBytes + 16u * c;
        const uint32_t nb = chunk_bytes(off, total);
        cp_async16(st + stage_pos<T>(c), nb ? in + off : in, nb);
      }
    }
    cp_async_commit();
  };
  if (!direct) {
    require_smem(I::kStages * I::kBlockBytes);
#pragma unroll
    for (uint32_t s = 0; s < I::kStages; ++s) issue(b + s * tw, s);
  }
  for (uint32_t it = 0; b < nblocks; b += tw, ++it) {
    Vals<T> x;
    if (direct) {
      const uint64_t base = b * I::kBlockBytes + (uint64_t)lane * I::kChunks * 16u;
#pragma unroll
      for (uint32_t c = 0; c < I::kChunks; ++c) {
        const uint4 v = load_chunk(in + base + 16u * c, chunk_bytes(base + 16u * c, total));
        x.w[4 * c] = v.x;
        x.w[4 * c + 1] = v.y;
        x.w[4 * c + 2] = v.z;
        x.w[4 * c + 3] = v.w;
      }
    } else {
      const uint32_t slot = it % I::kStages;
      cp_async_wait<I::kStages - 1>();
      __syncwarp();
      const uint4* st = ring + slot * (I::kBlockBytes / 16u);
#pragma unroll
      for (uint32_t c = 0; c < I::kChunks; ++c) {
        const uint4 v = st[stage_pos<T>(lane * I::kChunks + c)];
        x.w[4 * c] = v.x;
        x.w[4 * c + 1] = v.y;
        x.w[4 * c + 2] = v.z;
        x.w[4 * c + 3] = v.w;
      }
      __syncwarp();
      issue(b + I::kStages * tw, slot);
    }
    encode<T, B>(x, block_nvalues(p.n, b), L, out + b * L.block_bytes, HeaderMode::kZeroTag);
  }
  if (!direct) cp_async_wait<0>();
}

// ================================================================================== decode ====

// Issues, for the calling warp, cp.async copies of `bytes` (a multiple of 16) from `src` (global,
// 16-byte aligned) to `dst` (shared). The caller commits the group.
__device__ __forceinline__ void stage_block(uint4* dst, const uint8_t* src, uint32_t bytes) {
  for (uint32_t c = lane_id(); c < bytes / 16u; c += 32u) cp_async16(dst + c, src + 16u * c, 16u);
}

template <typename T, int B>
__device__ __forceinline__ void decode_kernel(const FcCodecDecodeParams& p) {
  using I = Io<T>;
  const Layout<T, B> L(p.group, p.spikes);
  const bool direct = (p.flags & FC_CODEC_FLAG_DIRECT_IO) != 0;
  // Per warp (staged): output stage (kBlockBytes) | input ring (FC_CODEC_IN_STAGES blocks).
  // Spikes are written over their decoded values in the output stage (or, direct, in the output
  // after the lane's own vector stores), so decode needs no spike scratch.
  const uint32_t per_warp = direct ? 0u : I::kBlockBytes + FC_CODEC_IN_STAGES * L.block_bytes;
  require_smem(per_warp);
  extern __shared__ uint4 smem[];
  const uint32_t lane = lane_id(), wib = threadIdx.x >> 5;
  uint4* stage = smem + (size_t)wib * (per_warp / 16u);
  uint4* ring = stage + I::kBlockBytes / 16u;
  const uint64_t nblocks = (p.n + kBlockValues - 1) / kBlockValues;
  const uint64_t total = p.n * Elem<T>::kBytes;
  const uint64_t tw = (uint64_t)gridDim.x * kWarps;
  const uint8_t* in = reinterpret_cast<const uint8_t*>(p.input);
  uint8_t* out = reinterpret_cast<uint8_t*>(p.output);
  const uint64_t first = (uint64_t)blockIdx.x * kWarps + wib;
  // Every call commits exactly one group (possibly empty), so "all but the newest group done"
  // means "the block of this iteration has arrived".
  auto issue = [&](uint64_t blk, uint32_t slot) {
    if (blk < nblocks) stage_block(ring + slot * (L.block_bytes / 16u), in + blk * L.block_bytes, L.block_bytes);
    cp_async_commit();
  };
  if (!direct) {
#pragma unroll
    for (uint32_t s = 0; s < FC_CODEC_IN_STAGES; ++s) issue(first + s * tw, s);
  }
  uint32_t it = 0;
  for (uint64_t b = first; b < nblocks; b += tw, ++it) {
    const uint32_t slot = it % FC_CODEC_IN_STAGES;
    const uint8_t* blk;
    if (direct) {
      blk = in + b * L.block_bytes;
    } else {
      cp_async_wait<FC_CODEC_IN_STAGES - 1>();
      __syncwarp();
      blk = reinterpret_cast<const uint8_t*>(ring + slot * (L.block_bytes / 16u));
    }
    const uint32_t nv = block_nvalues(p.n, b);
    if (!check_header<T, B>(blk, L, nv)) {
      if (lane == 0) report_bad_block(p.status, b);
    } else {
      float v[32];
      bool may_nan;
      LaneSpikes sp;
      decode_values<T, B>(blk, L, nv, v, sp, may_nan);
      if (FC_CODEC_ABLATE & 4) sp.owned = 0;
      Vals<T> y;
      to_elements<T>(v, may_nan, y);
      const uint64_t bbase = b * I::kBlockBytes;
      // Calls store(i, bits) for each spike slot of the lane: value i of the lane gets `bits`.
      auto put_spikes = [&](auto&& store) {
#pragma unroll
        for (int s = 3; s >= 0; --s)  // the first slot wins on a repeated position
          if ((sp.owned >> s) & 1u) store((sp.pos4 >> (8 * s)) & 31u, spike_bits<T>(sp.val[s]));
      };
      if (direct) {
#pragma unroll
        for (uint32_t c = 0; c < I::kChunks; ++c) {
          const uint64_t off = bbase + (uint64_t)(lane * I::kChunks + c) * 16u;
          const uint32_t nb = chunk_bytes(off, total);
          if (nb) store_chunk(out + off, make_uint4(y.w[4 * c], y.w[4 * c + 1], y.w[4 * c + 2], y.w[4 * c + 3]), nb);
        }
        // Same thread, same address, later in program order: the spike overwrites its value.
        if (sp.owned != 0u)
          put_spikes([&](uint32_t i, uint32_t bits) {
            uint8_t* dst = out + bbase + (uint64_t)(lane * 32u + i) * Elem<T>::kBytes;
            if constexpr (Elem<T>::kBytes == 4)
              *reinterpret_cast<uint32_t*>(dst) = bits;
            else
              *reinterpret_cast<uint16_t*>(dst) = (uint16_t)bits;
          });
      } else {
#pragma unroll
        for (uint32_t c = 0; c < I::kChunks; ++c)
          stage[stage_pos<T>(lane * I::kChunks + c)] = make_uint4(y.w[4 * c], y.w[4 * c + 1], y.w[4 * c + 2], y.w[4 * c + 3]);
        if (sp.owned != 0u)
          put_spikes([&](uint32_t i, uint32_t bits) {
            const uint32_t byte = i * Elem<T>::kBytes;
            uint8_t* dst = reinterpret_cast<uint8_t*>(stage + stage_pos<T>(lane * I::kChunks + byte / 16u)) + byte % 16u;
            if constexpr (Elem<T>::kBytes == 4)
              *reinterpret_cast<uint32_t*>(dst) = bits;
            else
              *reinterpret_cast<uint16_t*>(dst) = (uint16_t)bits;
          });
        __syncwarp();
#pragma unroll
        for (uint32_t r = 0; r < I::kChunks; ++r) {
          const uint32_t c = r * 32u + lane;
          const uint64_t off = bbase + 16u * c;
          const uint32_t nb = chunk_bytes(off, total);
          if (nb) store_chunk(out + off, stage[stage_pos<T>(c)], nb);
        }
      }
    }
    if (!direct) {
      // Every lane is done with this slot (and with the output stage) before it is refilled.
      __syncwarp();
      issue(b + FC_CODEC_IN_STAGES * tw, slot);
    }
  }
  if (!direct) cp_async_wait<0>();
}

template <typename T, int B>
__device__ __forceinline__ void decode_accumulate_kernel(const FcCodecDecodeParams& p) {
  require_smem(FC_CODEC_SCRATCH_BYTES);
  extern __shared__ uint4 smem[];
  const uint32_t lane = lane_id(), wib = threadIdx.x >> 5;
  float* scratch = reinterpret_cast<float*>(smem + (size_t)wib * (FC_CODEC_SCRATCH_BYTES / 16u));
  const uint64_t nblocks = (p.n + kBlockValues - 1) / kBlockValues;
  const uint64_t total = p.n * 4u;
  const uint64_t tw = (uint64_t)gridDim.x * kWarps;
  const Layout<T, B> L(p.group, p.spikes);
  const uint8_t* in = reinterpret_cast<const uint8_t*>(p.input);
  uint8_t* acc_buf = reinterpret_cast<uint8_t*>(p.output);
  for (uint64_t b = (uint64_t)blockIdx.x * kWarps + wib; b < nblocks; b += tw) {
    const uint8_t* blk = in + b * L.block_bytes;
    const uint32_t nv = block_nvalues(p.n, b);
    if (!check_header<T, B>(blk, L, nv)) {
      if (lane == 0) report_bad_block(p.status, b);
      continue;
    }
    const uint64_t base = b * (kBlockValues * 4u) + (uint64_t)lane * 128u;
    float acc[32];
#pragma unroll
    for (uint32_t c = 0; c < 8; ++c) {
      const uint4 a = load_chunk(acc_buf + base + 16u * c, chunk_bytes(base + 16u * c, total));
      acc[4 * c] = __uint_as_float(a.x);
      acc[4 * c + 1] = __uint_as_float(a.y);
      acc[4 * c + 2] = __uint_as_float(a.z);
      acc[4 * c + 3] = __uint_as_float(a.w);
    }
    decode_accumulate<T, B>(blk, L, nv, acc, scratch);
#pragma unroll
    for (uint32_t c = 0; c < 8; ++c) {
      const uint32_t nb = chunk_bytes(base + 16u * c, total);
      if (nb)
        store_chunk(acc_buf + base + 16u * c,
                    make_uint4(__float_as_uint(acc[4 * c]), __float_as_uint(acc[4 * c + 1]), __float_as_uint(acc[4 * c + 2]),
                               __float_as_uint(acc[4 * c + 3])),
                    nb);
    }
  }
}

// ====================================================================== reduce_requantize ====

#define FC_CODEC_IN_BITS_SWITCH(BITS, CALL) \
  switch (BITS) {                           \
    case 2: CALL(2); break;                 \
    case 3: CALL(3); break;                 \
    case 4: CALL(4); break;                 \
    case 5: CALL(5); break;                 \
    case 6: CALL(6); break;                 \
    case 7: CALL(7); break;                 \
    default: CALL(8); break;                \
  }

// The block loop of reduce_requantize for input width BI and output width BO, in the kernel
// compiled for MINB resident CTAs (a separate function in the 2-CTA kernel, inlined in the 1-CTA
// kernel: see FC_CODEC_MIN_CTAS and reduce_kernel). Per block: every
// input's header is checked, the inputs are decoded and accumulated in order 0..N-1 starting from
// -0 (the identity of IEEE addition: -0 + v == v for every v, -0 and NaN included, so acc = v_0
// exactly and one decode path serves all inputs), rounded to T and encoded. Staged (default):
// slot s of the warp's ring holds block b's encoded block of every input, copied with cp.async
// FC_CODEC_IN_STAGES iterations ahead.
template <typename T, int BI, int BO>
__device__ __forceinline__ void reduce_loop(const FcCodecReduceParams& p, float* scratch, uint4* ring, bool direct) {
  const Layout<T, BI> Lin(p.in_group, p.in_spikes);
  const Layout<T, BO> Lout(p.out_group, p.out_spikes);
  const uint64_t* ptrs = reinterpret_cast<const uint64_t*>(p.inputs);
  const uint32_t lane = lane_id(), wib = threadIdx.x >> 5;
  const uint64_t nblocks = (p.n + kBlockValues - 1) / kBlockValues;
  const uint64_t tw = (uint64_t)gridDim.x * kWarps;
  const uint32_t in16 = Lin.block_bytes / 16u, slot16 = in16 * p.ninputs;
  uint8_t* out = reinterpret_cast<uint8_t*>(p.output);
  const uint64_t first = (uint64_t)blockIdx.x * kWarps + wib;
  auto issue = [&](uint64_t blk, uint32_t slot) {
    if (blk < nblocks) {
      for (uint32_t i = 0; i < p.ninputs; ++i)
        stage_block(ring + slot * slot16 + i * in16, reinterpret_cast<const uint8_t*>(ptrs[i]) + blk * Lin.block_bytes,
                    Lin.block_bytes);
    }
    cp_async_commit();
  };
  if (!direct) {
#pragma unroll
    for (uint32_t s = 0; s < FC_CODEC_IN_STAGES; ++s) issue(first + s * tw, s);
  }
  uint32_t it = 0;
  for (uint64_t b = first; b < nblocks; b += tw, ++it) {
    const uint32_t slot = it % FC_CODEC_IN_STAGES;
    if (!direct) {
      cp_async_wait<FC_CODEC_IN_STAGES - 1>();
      __syncwarp();
    }
    auto input = [&](uint32_t i) -> const uint8_t* {
      return direct ? reinterpret_cast<const uint8_t*>(ptrs[i]) + b * Lin.block_bytes
                    : reinterpret_cast<const uint8_t*>(ring + slot * slot16 + i * in16);
    };
    const uint32_t nv = block_nvalues(p.n, b);
    bool ok = true;
    for (uint32_t i = 0; i < p.ninputs; ++i) ok = check_header<T, BI>(input(i), Lin, nv) && ok;
    if (!ok) {
      if (lane == 0) report_bad_block(p.status, b);
    } else {
      float acc[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) acc[k] = -0.0f;
      for (uint32_t i = 0; i < p.ninputs; ++i) decode_accumulate<T, BI>(input(i), Lin, nv, acc, scratch);
      Vals<T> x;
      round_to_vals<T>(acc, x);
      encode<T, BO>(x, nv, Lout, out + b * Lout.block_bytes, HeaderMode::kZeroTag);
    }
    if (!direct) {
      __syncwarp();
      issue(b + FC_CODEC_IN_STAGES * tw, slot);
    }
  }
  if (!direct) cp_async_wait<0>();
}

// reduce_loop as a call of its own, so that the register allocator of the 2-CTA kernel (128
// registers) handles each input width alone: inlined, all seven widths share one allocation and
// spill more than 1 KiB per thread. The 1-CTA kernel has the whole register file and inlines the
// loop instead, which saves the call's argument and stack traffic (measurable on small calls and
// at N = 8 with wide formats).
template <typename T, int BI, int BO>
__device__ __noinline__ void reduce_loop_call(const FcCodecReduceParams& p, float* scratch, uint4* ring, bool direct) {
  reduce_loop<T, BI, BO>(p, scratch, ring, direct);
}

// Encoded bytes of one block of width `bits` (the host's CodecFormat::block_bytes).
template <typename T>
__device__ __forceinline__ uint32_t block_bytes_of(uint32_t bits, uint32_t group, uint32_t spikes) {
  const uint32_t groups = kBlockValues / group;
  const uint32_t raw = kHeaderBytes + 128u * bits + groups * (2u + spikes) * Elem<T>::kBytes + groups * spikes;
  return (raw + 15u) & ~15u;
}

template <typename T, int BO, int MINB>
__device__ __forceinline__ void reduce_kernel(const FcCodecReduceParams& p) {
  if (p.ninputs == 0 || p.in_bits < 2 || p.in_bits > 8) return;
  const bool direct = (p.flags & FC_CODEC_FLAG_DIRECT_IO) != 0;
  // Per warp: spike scratch | input ring (FC_CODEC_IN_STAGES slots of ninputs blocks).
  const uint32_t per_warp =
      FC_CODEC_SCRATCH_BYTES +
      (direct ? 0u : FC_CODEC_IN_STAGES * p.ninputs * block_bytes_of<T>(p.in_bits, p.in_group, p.in_spikes));
  require_smem(per_warp);
  extern __shared__ uint4 smem[];
  const uint32_t wib = threadIdx.x >> 5;
  float* scratch = reinterpret_cast<float*>(smem + (size_t)wib * (per_warp / 16u));
  uint4* ring = smem + (size_t)wib * (per_warp / 16u) + FC_CODEC_SCRATCH_BYTES / 16u;
  if constexpr (MINB >= 2) {
#define FC_LOOP(BI) reduce_loop_call<T, BI, BO>(p, scratch, ring, direct)
    FC_CODEC_IN_BITS_SWITCH(p.in_bits, FC_LOOP)
#undef FC_LOOP
  } else {
#define FC_LOOP(BI) reduce_loop<T, BI, BO>(p, scratch, ring, direct)
    FC_CODEC_IN_BITS_SWITCH(p.in_bits, FC_LOOP)
#undef FC_LOOP
  }
}

}  // namespace kern
}  // namespace codec
}  // namespace fc

// Minimum resident CTAs per SM the kernels are compiled for: 2 caps registers at 128 per thread
// (16 warps per SM). f32 encode (32 words of input per lane) keeps 1 CTA rather than spill at 3,
// 5 bits. The fused reduce keeps 64 values per lane live (accumulators and one decoded input) on
// top of the encoder and comes twice: fc_codec_reduce_requantize_* for 2 CTAs (128 registers;
// its block loop is one non-inlined function per input width, reduce_loop_call, so that each width
// is register-allocated alone and spills only a few words) and fc_codec_reduce_requantize_1cta_*
// (the whole register file of 1 CTA, the loop inlined, no spills). The host launches the second where shared memory
// admits only one CTA of the first (many inputs of a wide format) or where the buffer has no more
// blocks than 1 CTA per SM has warps (small calls), and the first otherwise (docs/codec.md, "GPU kernels").
#define FC_CODEC_MIN_CTAS 2
#define FC_CODEC_MIN_CTAS_ENCODE_f32 1
#define FC_CODEC_MIN_CTAS_ENCODE_f16 2
#define FC_CODEC_MIN_CTAS_ENCODE_bf16 2

#define FC_CODEC_KERNELS(T, SUFFIX, B)                                                                             \
  extern "C" __global__ void __launch_bounds__(FC_CODEC_THREADS, FC_CODEC_MIN_CTAS_ENCODE_##SUFFIX)                                                  \
      fc_codec_encode_##SUFFIX##_b##B(const __grid_constant__ FcCodecEncodeParams p) {                             \
    fc::codec::kern::encode_kernel<T, B>(p);                                                                       \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(FC_CODEC_THREADS, FC_CODEC_MIN_CTAS)                                                  \
      fc_codec_decode_##SUFFIX##_b##B(const __grid_constant__ FcCodecDecodeParams p) {                             \
    fc::codec::kern::decode_kernel<T, B>(p);                                                                       \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(FC_CODEC_THREADS, FC_CODEC_MIN_CTAS)                                                  \
      fc_codec_decode_accumulate_##SUFFIX##_b##B(const __grid_constant__ FcCodecDecodeParams p) {                  \
    fc::codec::kern::decode_accumulate_kernel<T, B>(p);                                                            \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(FC_CODEC_THREADS, 2)                                              \
      fc_codec_reduce_requantize_##SUFFIX##_b##B(const __grid_constant__ FcCodecReduceParams p) {                  \
    fc::codec::kern::reduce_kernel<T, B, 2>(p);                                                                    \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(FC_CODEC_THREADS, 1)                                              \
      fc_codec_reduce_requantize_1cta_##SUFFIX##_b##B(const __grid_constant__ FcCodecReduceParams p) {             \
    fc::codec::kern::reduce_kernel<T, B, 1>(p);                                                                    \
  }

#define FC_CODEC_ALL_WIDTHS(T, SUFFIX) \
  FC_CODEC_KERNELS(T, SUFFIX, 2)       \
  FC_CODEC_KERNELS(T, SUFFIX, 3)       \
  FC_CODEC_KERNELS(T, SUFFIX, 4)       \
  FC_CODEC_KERNELS(T, SUFFIX, 5)       \
  FC_CODEC_KERNELS(T, SUFFIX, 6)       \
  FC_CODEC_KERNELS(T, SUFFIX, 7)       \
  FC_CODEC_KERNELS(T, SUFFIX, 8)

