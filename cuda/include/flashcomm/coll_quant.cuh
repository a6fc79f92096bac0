// Quantized AllReduce on the self-synchronizing transport (bodies; cuda/coll_quant_<dtype>.cu
// instantiate them).
//
// Payload: codec blocks (docs/codec.md), 1024 values each. Readiness: the BLOCK protocol's frame
// tag. A frame's 4096-byte payload carries m = 4096 / block_bytes whole codec blocks, so frame
// tags stay on the one 4112-byte grid that the lossless BLOCK protocol uses: a stale codec block
// of another format can never sit where a tag is expected. (The codec header's own tag word is
// therefore left at 0 by this transport.)
//
// One-shot (small messages): every rank encodes its input once, into its own slot of its own arena
// (a slot nobody else writes), copies those bytes to every peer, and then every rank decodes all N
// encodings in rank order 0..N-1 with f32 accumulation, its own from its own slot: every rank
// decodes the same bytes in the same order, so every rank's result is bitwise identical. In a
// round whose chunk has fewer frames than the block has warps, the warps share the chunk's codec
// blocks (block barriers before encoding from round 2 on, between encoding and publishing, waiting
// and decoding, decoding and clearing); a frame is still published, waited for and cleared by
// warp f mod kWarps.
//
// Two-step (large messages): codec blocks are sharded over ranks (shard j = blocks
// [j*nb/N, (j+1)*nb/N)). Per chunk: (1) each rank encodes its part of every shard straight into
// the owner's arena (its own shard into its own slot); (2) the owner decodes the N encodings of
// each block in rank order, accumulates in f32, rounds to the element type, encodes ONCE with the
// all-gather width into its own region-B slot, copies those bytes to every peer and decodes them
// itself for its own output; (3) every rank decodes the other owners' bytes. The reduced values
// are quantized once and the same bytes are decoded everywhere: bitwise identical on every rank.
//
// Geometry and epochs are those of the lossless collectives (transport.cuh); waits are bounded.
// Preconditions (host): nranks <= 8; same grid and params on every rank; for two-step every shard
// is non-empty (nb >= nranks).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "flashcomm/codec.cuh"
#include "flashcomm/codec_params.h"
#include "flashcomm/params.h"
#include "flashcomm/transport.cuh"

namespace fc {
namespace quant {

constexpr int kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;

using codec::HeaderMode;
using codec::kBlockValues;
using codec::Layout;
using codec::Vals;

// The lane's 32 input values of codec block `cb` (values cb*1024 + 32*lane ...), zero beyond n.
template <typename T>
__device__ __forceinline__ void load_lane(const char* in, uint64_t n, uint64_t cb, uint32_t lane, Vals<T>& x) {
  constexpr uint32_t E = sizeof(T);
  constexpr int kVecs = 32 * E / 16;
  const uint64_t first = cb * kBlockValues + 32ull * lane;
  const uint32_t valid = first >= n ? 0u : (uint32_t)min((uint64_t)32, n - first);
  const uint32_t bytes = valid * E;
  const char* src = in + first * E;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const uint32_t o = i * 16;
    const uint4 v = o < bytes ? load_bytes16(src + o, min(16u, bytes - o)) : make_uint4(0, 0, 0, 0);
    x.w[4 * i + 0] = v.x;
    x.w[4 * i + 1] = v.y;
    x.w[4 * i + 2] = v.z;
    x.w[4 * i + 3] = v.w;
  }
}

// Stores the lane's decoded values of codec block `cb` (only the valid ones).
template <typename T>
__device__ __forceinline__ void store_lane(char* out, uint64_t n, uint64_t cb, uint32_t lane, const float (&v)[32],
                                           bool may_nan) {
  constexpr uint32_t E = sizeof(T);
  constexpr int kVecs = 32 * E / 16;
  const uint64_t first = cb * kBlockValues + 32ull * lane;
  const uint32_t valid = first >= n ? 0u : (uint32_t)min((uint64_t)32, n - first);
  if (valid == 0) return;
  bool nan = may_nan;
#pragma unroll
  for (int i = 0; i < 32; ++i) nan |= isnan(v[i]);
  Vals<T> x;
  codec::to_elements<T>(v, nan, x);
  const uint32_t bytes = valid * E;
  char* dst = out + first * E;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const uint32_t o = i * 16;
    if (o < bytes) store_bytes16(dst + o, make_uint4(x.w[4 * i], x.w[4 * i + 1], x.w[4 * i + 2], x.w[4 * i + 3]), min(16u, bytes - o));
  }
}

// Writes the lane's decoded spikes (codec::decode_values) over the values that store_lane wrote
// for block `cb`: same thread, same address, later in program order, so the spike wins. This
// replaces patching the values in registers (through shared memory) before the store.
template <typename T>
__device__ __forceinline__ void store_spikes(char* out, uint64_t cb, uint32_t lane, const codec::LaneSpikes& sp) {
  if (sp.owned == 0u) return;
  char* base = out + (cb * kBlockValues + 32ull * lane) * sizeof(T);
#pragma unroll
  for (int s = 3; s >= 0; --s) {  // the first slot wins on a repeated position
    if ((sp.owned >> s) & 1u) {
      char* dst = base + ((sp.pos4 >> (8 * s)) & 31u) * sizeof(T);
      const uint32_t bits = codec::spike_bits<T>(sp.val[s]);
      if constexpr (sizeof(T) == 4)
        *reinterpret_cast<uint32_t*>(dst) = bits;
      else
        *reinterpret_cast<uint16_t*>(dst) = (uint16_t)bits;
    }
  }
}

// Copies `bytes` (a multiple of 16) of a frame payload to another frame payload (peer memory).
__device__ __forceinline__ void copy_payload(const char* src, char* dst, uint32_t bytes, uint32_t lane) {
  // Every load of the frame first, then the stores: one memory latency per frame rather than one
  // per 16 bytes (each load and store is an ordered asm statement).
  constexpr int kVecs = FC_FRAME_PAYLOAD / 16 / 32;
  uint4 d[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const uint32_t o = (i * 32 + lane) * 16;
    if (o < bytes) d[i] = ld_cg_v4(src + o);
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const uint32_t o = (i * 32 + lane) * 16;
    if (o < bytes) st_v4(dst + o, d[i]);
  }
}

// The sub-slot that `src` writes into `owner`'s arena for this block and `round`, except this
// rank's own slots (owner and source this rank): on the host transport they live in device memory
// (p.own_slots, the arena's slot layout without the call-parity halves), since only this rank's
// kernels write and read them and the bytes need not cross PCIe. No half is needed there: the
// next kernel on this rank starts after this one completes (stream order), and no peer writes
// them.
__device__ __forceinline__ char* qslot(const FcCollParams& p, const Ctx& c, uint32_t owner, uint32_t region, uint32_t src,
                                       uint64_t round) {
  if (p.own_slots != 0 && owner == p.rank && src == p.rank)
    return reinterpret_cast<char*>(p.own_slots) + (uint64_t)region * p.slot_bytes + p.area_offset +
           ((uint64_t)blockIdx.x * 2 + (round & 1)) * p.sub_bytes;
  return sub_slot(p, c, owner, region, src, round);
}

// Lane 0 publishes frame `f` of every peer in `mask` (after the warp's payload stores).
__device__ __forceinline__ void publish(const FcCollParams& p, const Ctx& c, uint32_t region, uint32_t mask, uint64_t round,
                                        uint32_t f) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    fence_sys();
    for (uint32_t q = 0; q < p.nranks; ++q) {
      if (q != p.rank && ((mask >> q) & 1u))
        st_relaxed_sys_u32(frame_tag(sub_slot(p, c, q, region, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES), c.tag);
    }
  }
}

// Lane s waits for source s's frame f in `region` (every s in `srcs`); then the warp syncs.
__device__ __forceinline__ void wait_frames(const FcCollParams& p, Ctx& c, uint32_t region, uint32_t srcs, uint64_t round,
                                            uint32_t f) {
  const uint32_t lane = threadIdx.x & 31;
  if (lane < FC_MAX_RANKS && ((srcs >> lane) & 1u) && !c.dead)
    frame_wait(p, c, sub_slot(p, c, p.rank, region, lane, round) + (uint64_t)f * FC_FRAME_BYTES, lane);
  __syncwarp();
}

__device__ __forceinline__ void clear_frames(const FcCollParams& p, Ctx& c, uint32_t region, uint32_t srcs, uint64_t round,
                                             uint32_t f) {
  const uint32_t lane = threadIdx.x & 31;
  __syncwarp();
  if (lane < FC_MAX_RANKS && ((srcs >> lane) & 1u))
    st_volatile_u32(frame_tag(sub_slot(p, c, p.rank, region, lane, round) + (uint64_t)f * FC_FRAME_BYTES), 0u);
}

__device__ __forceinline__ const uint8_t* block_in(const FcCollParams& p, const Ctx& c, uint32_t region, uint32_t src,
                                                   uint64_t round, uint32_t f, uint32_t i, uint32_t bb) {
  return reinterpret_cast<const uint8_t*>(frame_payload(qslot(p, c, p.rank, region, src, round) + (uint64_t)f * FC_FRAME_BYTES)) +
         (uint64_t)i * bb;
}

template <typename T, int B>
__device__ void allreduce_oneshot(const FcCollParams& p) {
  __shared__ __align__(16) float scratch_all[kWarps][FC_CODEC_SCRATCH_BYTES / 4];
  Ctx c = begin(p);
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* scratch = scratch_all[warp];
  const Layout<T, B> L(p.q_group, p.q_spikes);
  const uint32_t bb = L.block_bytes;
  const uint32_t m = FC_FRAME_PAYLOAD / bb;
  const uint64_t K = (uint64_t)(p.sub_bytes / FC_FRAME_BYTES) * m;
  const uint64_t nb = (p.count + kBlockValues - 1) / kBlockValues;
  const uint64_t nchunks = (nb + K - 1) / K;
  const uint32_t all = (1u << p.nranks) - 1u;
  const uint32_t others = all & ~(1u << p.rank);
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k < nchunks; k += gridDim.x, ++round) {
    if (round > 0) fence_sys();
    const uint64_t cb0 = k * K;
    const uint32_t ncb = (uint32_t)min(K, nb - cb0);
    const uint32_t nframes = (ncb + m - 1) / m;
    if (nframes >= kWarps) {
      // A chunk of at least one frame per warp: each warp takes whole frames and never waits
      // for another warp.
      // Encode once into the own slot, then copy to every peer.
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        char* self = frame_payload(qslot(p, c, p.rank, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          Vals<T> x;
          load_lane<T>(in, p.count, cb, lane, x);
          codec::encode<T, B>(x, codec::block_nvalues(p.count, cb), L, reinterpret_cast<uint8_t*>(self) + (uint64_t)i * bb,
                              HeaderMode::kZeroTag);
        }
        __syncwarp();
        for (uint32_t q = 0; q < p.nranks; ++q) {
          if (q != p.rank)
            copy_payload(self, frame_payload(sub_slot(p, c, q, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES), nblk * bb, lane);
        }
        publish(p, c, 0, all, round, f);
      }
      // Decode all N encodings of every block in rank order.
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        wait_frames(p, c, 0, others, round, f);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          const uint32_t nv = codec::block_nvalues(p.count, cb);
          float acc[32];
          bool may_nan = false;
          codec::decode<T, B, codec::LoadCg>(block_in(p, c, 0, 0, round, f, i, bb), L, nv, acc, scratch, may_nan);
          for (uint32_t s = 1; s < p.nranks; ++s)
            codec::decode_accumulate<T, B, codec::LoadCg>(block_in(p, c, 0, s, round, f, i, bb), L, nv, acc, scratch);
          store_lane<T>(out, p.count, cb, lane, acc, may_nan);
        }
        clear_frames(p, c, 0, others, round, f);
      }
    } else {
      // The own slot's sub-slot of this round was last used two rounds ago, when warp f % kWarps
      // alone encoded, copied and decoded its frame f, in a round of at least one frame per warp
      // (no block barrier): here any warp encodes into any frame, so every warp must be past that
      // round first. Without this barrier a warp with fewer frames per round (11 frames over 8
      // warps: warps 3-7 have one, 0-2 two) ran two rounds ahead and overwrote the own frames that
      // a slower warp was still decoding or copying to the peers (wrong values on that rank, or
      // on the peers), in the last round of the one block whose last chunk has fewer frames than
      // warps: 8-bit 16 MiB and 4-bit 32 MiB at 2 ranks. (Round 1 writes the other sub-slot, which
      // no earlier round of this call used; and where a full chunk has fewer frames than warps,
      // every round takes this branch, whose barriers already order round r - 2 before round r.)
      if (round >= 2 && p.sub_bytes / FC_FRAME_BYTES >= kWarps) __syncthreads();
      // Encode once into the own slot: codec block j of the chunk goes to warp j % kWarps, so a
      // chunk of a few frames keeps every warp busy (a warp per frame would encode its frame's m
      // codec blocks one after the other while the other warps wait).
      for (uint32_t j = warp; j < ncb; j += kWarps) {
        const uint32_t f = j / m, i = j % m;
        char* self = frame_payload(qslot(p, c, p.rank, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
        Vals<T> x;
        load_lane<T>(in, p.count, cb0 + j, lane, x);
        codec::encode<T, B>(x, codec::block_nvalues(p.count, cb0 + j), L, reinterpret_cast<uint8_t*>(self) + (uint64_t)i * bb,
                            HeaderMode::kZeroTag);
      }
      // Every frame is whole before warp f % kWarps copies frame f to every peer and publishes it
      // (the barrier orders the other warps' encodings before its loads and its fence).
      __syncthreads();
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        const char* self = frame_payload(qslot(p, c, p.rank, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
        for (uint32_t q = 0; q < p.nranks; ++q) {
          if (q != p.rank)
            copy_payload(self, frame_payload(sub_slot(p, c, q, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES), nblk * bb, lane);
        }
        publish(p, c, 0, all, round, f);
      }
      // Every peer's frames of the chunk, then (after the barrier) every warp decodes its codec
      // blocks: all N encodings of a block in rank order.
      for (uint32_t f = warp; f < nframes; f += kWarps) wait_frames(p, c, 0, others, round, f);
      __syncthreads();
      for (uint32_t j = warp; j < ncb; j += kWarps) {
        const uint32_t f = j / m, i = j % m;
        const uint64_t cb = cb0 + j;
        const uint32_t nv = codec::block_nvalues(p.count, cb);
        float acc[32];
        bool may_nan = false;
        codec::decode<T, B, codec::LoadCg>(block_in(p, c, 0, 0, round, f, i, bb), L, nv, acc, scratch, may_nan);
        for (uint32_t s = 1; s < p.nranks; ++s)
          codec::decode_accumulate<T, B, codec::LoadCg>(block_in(p, c, 0, s, round, f, i, bb), L, nv, acc, scratch);
        store_lane<T>(out, p.count, cb, lane, acc, may_nan);
      }
      // The frames are read (every warp's decodes) before their tags are cleared.
      __syncthreads();
      for (uint32_t f = warp; f < nframes; f += kWarps) clear_frames(p, c, 0, others, round, f);
    }
  }
  finish(p, c);
}

template <typename T, int BR, int BA>
__device__ void allreduce_twostep(const FcCollParams& p) {
  __shared__ __align__(16) float scratch_all[kWarps][FC_CODEC_SCRATCH_BYTES / 4];
  Ctx c = begin(p);
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* scratch = scratch_all[warp];
  const Layout<T, BR> LR(p.q_group, p.q_spikes);
  const Layout<T, BA> LA(p.q_group, p.q_spikes);
  const uint32_t m = FC_FRAME_PAYLOAD / max(LR.block_bytes, LA.block_bytes);
  const uint64_t K = (uint64_t)(p.sub_bytes / FC_FRAME_BYTES) * m;
  const uint64_t nb = (p.count + kBlockValues - 1) / kBlockValues;
  const uint32_t n = p.nranks;
  const uint64_t maxshard = (nb + n - 1) / n;
  const uint64_t nchunks = (maxshard + K - 1) / K;
  const uint32_t all = (1u << n) - 1u;
  const uint32_t others = all & ~(1u << p.rank);
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  auto shard_begin = [&](uint32_t j) -> uint64_t { return (uint64_t)j * nb / n; };
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k < nchunks; k += gridDim.x, ++round) {
    if (round > 0) fence_sys();
    // Step 1: my part of every shard, encoded with the first width, into the owner's arena.
    for (uint32_t j = 0; j < n; ++j) {
      const uint64_t s1 = shard_begin(j + 1), cb0 = shard_begin(j) + k * K;
      if (cb0 >= s1) continue;
      const uint32_t ncb = (uint32_t)min(K, s1 - cb0);
      const uint32_t nframes = (ncb + m - 1) / m;
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        char* dst = frame_payload(qslot(p, c, j, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          Vals<T> x;
          load_lane<T>(in, p.count, cb, lane, x);
          codec::encode<T, BR>(x, codec::block_nvalues(p.count, cb), LR,
                               reinterpret_cast<uint8_t*>(dst) + (uint64_t)i * LR.block_bytes, HeaderMode::kZeroTag);
        }
        if (j != p.rank)
          publish(p, c, 0, 1u << j, round, f);
        else
          __syncwarp();
      }
    }
    // Step 2: reduce my shard, re-encode once, send the bytes to everyone, decode them myself.
    {
      const uint64_t s1 = shard_begin(p.rank + 1), cb0 = shard_begin(p.rank) + k * K;
      if (cb0 < s1) {
        const uint32_t ncb = (uint32_t)min(K, s1 - cb0);
        const uint32_t nframes = (ncb + m - 1) / m;
        for (uint32_t f = warp; f < nframes; f += kWarps) {
          const uint32_t nblk = min(m, ncb - f * m);
          wait_frames(p, c, 0, others, round, f);
          char* mine = frame_payload(qslot(p, c, p.rank, 1, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
          for (uint32_t i = 0; i < nblk; ++i) {
            const uint64_t cb = cb0 + (uint64_t)f * m + i;
            const uint32_t nv = codec::block_nvalues(p.count, cb);
            float acc[32];
            bool may_nan = false;
            codec::decode<T, BR, codec::LoadCg>(block_in(p, c, 0, 0, round, f, i, LR.block_bytes), LR, nv, acc, scratch, may_nan);
            for (uint32_t s = 1; s < n; ++s)
              codec::decode_accumulate<T, BR, codec::LoadCg>(block_in(p, c, 0, s, round, f, i, LR.block_bytes), LR, nv, acc,
                                                             scratch);
            Vals<T> x;
            codec::round_to_vals<T>(acc, x);
            codec::encode<T, BA>(x, nv, LA, reinterpret_cast<uint8_t*>(mine) + (uint64_t)i * LA.block_bytes,
                                 HeaderMode::kZeroTag);
          }
          __syncwarp();
          for (uint32_t q = 0; q < n; ++q) {
            if (q != p.rank)
              copy_payload(mine, frame_payload(sub_slot(p, c, q, 1, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES),
                           nblk * LA.block_bytes, lane);
          }
          publish(p, c, 1, all, round, f);
          for (uint32_t i = 0; i < nblk; ++i) {
            const uint64_t cb = cb0 + (uint64_t)f * m + i;
            const uint32_t nv = codec::block_nvalues(p.count, cb);
            float v[32];
            bool may_nan = false;
            codec::LaneSpikes sp;
            codec::decode_values<T, BA, codec::LoadCg>(reinterpret_cast<const uint8_t*>(mine) + (uint64_t)i * LA.block_bytes, LA,
                                                       nv, v, sp, may_nan);
            store_lane<T>(out, p.count, cb, lane, v, may_nan);
            store_spikes<T>(out, cb, lane, sp);
          }
          clear_frames(p, c, 0, others, round, f);
        }
      }
    }
    // Step 3: every other owner's reduced bytes.
    for (uint32_t j = 0; j < n; ++j) {
      if (j == p.rank) continue;
      const uint64_t s1 = shard_begin(j + 1), cb0 = shard_begin(j) + k * K;
      if (cb0 >= s1) continue;
      const uint32_t ncb = (uint32_t)min(K, s1 - cb0);
      const uint32_t nframes = (ncb + m - 1) / m;
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        wait_frames(p, c, 1, 1u << j, round, f);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          const uint32_t nv = codec::block_nvalues(p.count, cb);
          float v[32];
          bool may_nan = false;
          codec::LaneSpikes sp;
          codec::decode_values<T, BA, codec::LoadCg>(block_in(p, c, 1, j, round, f, i, LA.block_bytes), LA, nv, v, sp, may_nan);
          store_lane<T>(out, p.count, cb, lane, v, may_nan);
          store_spikes<T>(out, cb, lane, sp);
        }
        clear_frames(p, c, 1, 1u << j, round, f);
      }
    }
  }
  finish(p, c);
}

}  // namespace quant
}  // namespace fc

#define FC_Q1(T, SUF, B)                                                                                 \
  extern "C" __global__ void __launch_bounds__(fc::quant::kThreads)                                     \
      fc_allreduce_q1_block_##SUF##_b##B(const __grid_constant__ FcCollParams p) {                      \
    fc::quant::allreduce_oneshot<T, B>(p);                                                               \
  }
#define FC_Q2(T, SUF, BR, BA)                                                                            \
  extern "C" __global__ void __launch_bounds__(fc::quant::kThreads)                                     \
      fc_allreduce_q2_block_##SUF##_r##BR##_a##BA(const __grid_constant__ FcCollParams p) {             \
    fc::quant::allreduce_twostep<T, BR, BA>(p);                                                          \
  }

// The instantiations are listed in flashcomm/instances.h (FC_QUANT_INSTANCES_<type>), generated
// from the host's kernel catalogue (crates/kernels/src/catalog.rs).
#include "flashcomm/instances.h"
