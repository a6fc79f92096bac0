// Quantized AllGather, AllToAll and ReduceScatter on the self-synchronizing transport (bodies;
// cuda/coll_quant_ops_<dtype>.cu instantiate them). Each has exactly one quantization step, as
// the CPU references of crates/codec/src/reference.rs specify (allgather_quant, alltoall_quant,
// reducescatter_quant):
//
// * AllGather: every rank encodes its input once, into its own slot, copies those bytes to every
//   peer, and every rank (the owner too) decodes every rank's bytes into block s of its output.
// * AllToAll: block q of a rank's input (count values, encoded as a buffer of its own, so its
//   codec blocks restart at the block's start) is encoded straight into rank q's arena (its own
//   block into its own slot); every rank decodes what source s sent into block s of its output.
// * ReduceScatter: shard j of a rank's input is encoded straight into rank j's arena; the owner
//   decodes the N encodings of its shard in rank order 0..N-1, accumulates in f32 and rounds to
//   the element type: full precision out.
//
// Framing, epochs, rounds and waits are the quantized AllReduce's (coll_quant.cuh): codec blocks
// of 1024 values travel in BLOCK frames, m whole codec blocks per frame; a warp owns whole frames.
// Each round, every rank sends its part of chunk k to every rank before it receives chunk k from
// every rank, so a sender writes round r + 2 into a sub-slot only after its receiver has read
// round r from it (the receiver sent round r + 1 after reading round r, and the sender waited
// for that). The warps of a block share the (peer, frame) pairs of a chunk, so a small block per
// peer still keeps every warp busy; a barrier between sending and receiving makes every read of
// the input precede every write of the output, so the in-place layouts (ReduceScatter's receive
// buffer inside its send buffer, AllGather's send buffer inside its receive buffer) are safe, and
// a barrier at the end of each round orders every clear of a frame before the block's next sends
// (the warp that clears a frame is not the warp that next writes to that peer).
// Preconditions (host): nranks <= 8; same grid and params on every rank; buffers aligned to the
// element size. AllToAll may be in place: the barrier between sending and receiving orders every
// read of chunk k of every input block before every write of chunk k of any output block, and
// only this block touches chunk k.
#pragma once
#include "flashcomm/coll_quant.cuh"

namespace fc {
namespace quant {

enum class Op { AllGather, AlltoAll, ReduceScatter };

template <typename T, int B, Op OP>
__device__ void exchange(const FcCollParams& p) {
  __shared__ __align__(16) float scratch_all[kWarps][FC_CODEC_SCRATCH_BYTES / 4];
  Ctx c = begin(p);
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* scratch = scratch_all[warp];
  const Layout<T, B> L(p.q_group, p.q_spikes);
  const uint32_t bb = L.block_bytes;
  const uint32_t m = FC_FRAME_PAYLOAD / bb;
  const uint64_t K = (uint64_t)(p.sub_bytes / FC_FRAME_BYTES) * m;
  // Values per block: AllGather's input, AllToAll's per-peer block, ReduceScatter's shard.
  const uint64_t count = p.count;
  const uint64_t block_stride = count * sizeof(T);
  const uint64_t nb = (count + kBlockValues - 1) / kBlockValues;
  const uint64_t nchunks = (nb + K - 1) / K;
  const uint32_t n = p.nranks;
  const uint32_t all = (1u << n) - 1u;
  const uint32_t others = all & ~(1u << p.rank);
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k < nchunks; k += gridDim.x, ++round) {
    if (round > 0) fence_sys();
    const uint64_t cb0 = k * K;
    const uint32_t ncb = (uint32_t)min(K, nb - cb0);
    const uint32_t nframes = (ncb + m - 1) / m;
    if constexpr (OP == Op::AllGather) {
      // Encode once into the own slot, then copy the bytes to every peer.
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        char* self = frame_payload(qslot(p, c, p.rank, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          Vals<T> x;
          load_lane<T>(in, count, cb, lane, x);
          codec::encode<T, B>(x, codec::block_nvalues(count, cb), L, reinterpret_cast<uint8_t*>(self) + (uint64_t)i * bb,
                              HeaderMode::kZeroTag);
        }
        __syncwarp();
        for (uint32_t q = 0; q < n; ++q) {
          if (q != p.rank)
            copy_payload(self, frame_payload(sub_slot(p, c, q, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES), nblk * bb, lane);
        }
        publish(p, c, 0, all, round, f);
      }
    } else {
      // Block (or shard) j of the input, encoded straight into rank j's arena: the warps share
      // the (rank, frame) pairs, the ranks visited from the next one on, so that not every rank
      // writes to rank 0 first.
      for (uint32_t t = warp; t < n * nframes; t += kWarps) {
        const uint32_t j = (p.rank + 1 + t / nframes) % n, f = t % nframes;
        const char* src = in + (uint64_t)j * block_stride;
        const uint32_t nblk = min(m, ncb - f * m);
        char* dst = frame_payload(qslot(p, c, j, 0, p.rank, round) + (uint64_t)f * FC_FRAME_BYTES);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          Vals<T> x;
          load_lane<T>(src, count, cb, lane, x);
          codec::encode<T, B>(x, codec::block_nvalues(count, cb), L, reinterpret_cast<uint8_t*>(dst) + (uint64_t)i * bb,
                              HeaderMode::kZeroTag);
        }
        if (j != p.rank)
          publish(p, c, 0, 1u << j, round, f);
        else
          __syncwarp();
      }
    }
    // Every encoding of this chunk (and every read of the input) is done before any warp writes
    // the output or decodes the own slot: the in-place layouts, and own frames another warp
    // encoded.
    __syncthreads();
    if constexpr (OP == Op::ReduceScatter) {
      // Receive: every source's frame f of chunk k, summed in rank order.
      for (uint32_t f = warp; f < nframes; f += kWarps) {
        const uint32_t nblk = min(m, ncb - f * m);
        wait_frames(p, c, 0, others, round, f);
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          const uint32_t nv = codec::block_nvalues(count, cb);
          float acc[32];
          bool may_nan = false;
          codec::decode<T, B, codec::LoadCg>(block_in(p, c, 0, 0, round, f, i, bb), L, nv, acc, scratch, may_nan);
          for (uint32_t s = 1; s < n; ++s)
            codec::decode_accumulate<T, B, codec::LoadCg>(block_in(p, c, 0, s, round, f, i, bb), L, nv, acc, scratch);
          store_lane<T>(out, count, cb, lane, acc, may_nan);
        }
        clear_frames(p, c, 0, others, round, f);
      }
    } else {
      // Receive: the warps share the (source, frame) pairs; source s goes to block s.
      for (uint32_t t = warp; t < n * nframes; t += kWarps) {
        const uint32_t s = t / nframes, f = t % nframes;
        const uint32_t nblk = min(m, ncb - f * m);
        if (s != p.rank) wait_frames(p, c, 0, 1u << s, round, f);
        char* dst = out + (uint64_t)s * block_stride;
        for (uint32_t i = 0; i < nblk; ++i) {
          const uint64_t cb = cb0 + (uint64_t)f * m + i;
          float v[32];
          bool may_nan = false;
          codec::LaneSpikes sp;
          codec::decode_values<T, B, codec::LoadCg>(block_in(p, c, 0, s, round, f, i, bb), L, codec::block_nvalues(count, cb),
                                                    v, sp, may_nan);
          store_lane<T>(dst, count, cb, lane, v, may_nan);
          store_spikes<T>(dst, cb, lane, sp);
        }
        if (s != p.rank) clear_frames(p, c, 0, 1u << s, round, f);
      }
    }
    // Every frame of this round is cleared before any warp sends the next round: a warp that
    // cleared a frame late, after another warp of this block had sent round r + 1 and the peer
    // had answered with round r + 2 in the same sub-slot, would erase that round's tag (found on
    // the GPU: a 64 MiB quantized AllGather over the host transport waited for ever).
    __syncthreads();
  }
  finish(p, c);
}

}  // namespace quant
}  // namespace fc

#define FC_QOP(T, SUF, B)                                                                                \
  extern "C" __global__ void __launch_bounds__(fc::quant::kThreads)                                     \
      fc_allgather_q_block_##SUF##_b##B(const __grid_constant__ FcCollParams p) {                       \
    fc::quant::exchange<T, B, fc::quant::Op::AllGather>(p);                                              \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(fc::quant::kThreads)                                     \
      fc_alltoall_q_block_##SUF##_b##B(const __grid_constant__ FcCollParams p) {                        \
    fc::quant::exchange<T, B, fc::quant::Op::AlltoAll>(p);                                               \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(fc::quant::kThreads)                                     \
      fc_reducescatter_q_block_##SUF##_b##B(const __grid_constant__ FcCollParams p) {                   \
    fc::quant::exchange<T, B, fc::quant::Op::ReduceScatter>(p);                                          \
  }
