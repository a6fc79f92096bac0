// Lossless collectives on the self-synchronizing transport: AllReduce (one-shot and two-shot),
// ReduceScatter, AllGather and AllToAll, each with the LL and the BLOCK protocol; AllReduce also
// with the PULL protocol, staged and direct (flashcomm/pull.cuh).
//
// Work decomposition (identical on every rank, so every rank's block b talks to every peer's
// block b): a message is cut into chunks of `chunk_bytes`; chunk k is handled by block
// k % gridDim.x in round k / gridDim.x, using sub-slot parity round & 1. Per round a block
//   one-shot AllReduce: pushes its chunk of the input to every peer (region A, slot = own rank),
//     then waits for every peer's chunk and reduces all N in rank order into the output;
//   two-shot AllReduce: for every shard owner j pushes chunk k of shard j to j (region A); reduces
//     chunk k of its own shard in rank order, writes it to the output and pushes the result to
//     every peer (region B); then copies every peer's reduced chunk from region B to the output;
//   ReduceScatter: the first half of two-shot, the reduced chunk going to the output only;
//   AllGather: pushes its chunk to every peer (region A) and copies every peer's chunk out;
//   AllToAll: the same, with chunk k of send block q pushed to peer q only.
// A rank never waits for anything but data, and the data carries its own readiness: there is no
// barrier before or after a collective.
//
// Preconditions (checked by the host): nranks <= FC_MAX_RANKS; all ranks launch the same kernel
// with the same grid, block size and params geometry; every rank's grid is resident at once
// (the host sizes grids to the occupancy it measured); for two-shot every shard is non-empty.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "flashcomm/params.h"
#include "flashcomm/pull.cuh"
#include "flashcomm/reduce.cuh"
#include "flashcomm/transport.cuh"

namespace fc {

constexpr int kThreads = 512;
constexpr int kFrameVecs = FC_FRAME_PAYLOAD / 16 / 32;  // 16-byte vectors per lane per frame
constexpr int kBatch = kFrameVecs / 2;                  // vectors per source loaded together in a reduction

__device__ __forceinline__ bool is_peer(const FcCollParams& p, uint32_t q, uint32_t mask) {
  return q != p.rank && ((mask >> q) & 1u);
}

// ===================================================================================== LL ====

// Host transport (FC_FLAG_HOST_ARENAS) only: waits until the first line of this block's sub-slot
// is ready from every source in `need` (source s's lines start at `lines + s * p.slot_bytes`), one
// polling thread per source, before the block's threads read their own lines. Every line is
// polled across PCIe there, and a thread per line polling at once (a thousand at 8 KiB) queues
// the polls behind each other and the writers' stores on the link: 44 us at 8 KiB against a
// 4.8 us round trip (docs/experiments.md, 2026-12-07 (fifth)). The gate only delays reading: each
// thread still checks its own lines' tags and waits for them. Every thread of the block calls it.
__device__ __forceinline__ void ll_gate(const FcCollParams& p, Ctx& c, const char* lines, uint32_t need) {
  if ((p.flags & FC_FLAG_HOST_ARENAS) == 0) return;
  const uint32_t s = threadIdx.x;
  if (s < FC_MAX_RANKS && ((need >> s) & 1u) && !c.dead) {
    const char* line = lines + (uint64_t)s * p.slot_bytes;
    Waiter w;
    while (true) {
      const uint4 l = ld_volatile_v4(line);
      if (ll_ready(l, c)) break;
      if (w.slow_next()) {
        const uint32_t foreign = ll_foreign(l, c);
        if (w.confirm_foreign(foreign != 0)) {
          give_up(p, c, FC_STATUS_MISMATCH, s, foreign);
          break;
        }
      }
      if (w.stop(p, c, s)) break;
    }
  }
  if (__syncthreads_or(c.dead)) c.dead = true;
}

// Pushes `len` bytes at `src` (user memory) to region `region` of every rank in `mask`.
__device__ __forceinline__ void ll_send(const FcCollParams& p, Ctx& c, const char* src, uint32_t len, uint64_t round,
                                        uint32_t region, uint32_t mask) {
  const uint32_t units = (len + FC_LL_PAYLOAD - 1) / FC_LL_PAYLOAD;
  for (uint32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const uint32_t n = min((uint32_t)FC_LL_PAYLOAD, len - u * FC_LL_PAYLOAD);
    const uint2 d = load_bytes8(src + (uint64_t)u * FC_LL_PAYLOAD, n);
#pragma unroll
    for (uint32_t q = 0; q < FC_MAX_RANKS; ++q) {
      if (q < p.nranks && is_peer(p, q, mask)) ll_store(sub_slot(p, c, q, region, p.rank, round) + (uint64_t)u * FC_LL_LINE, d, c);
    }
  }
}

// Waits for unit `u` of every source in `need` (region `region` of this rank's arena), filling v[s].
__device__ __forceinline__ void ll_gather(const FcCollParams& p, Ctx& c, uint32_t u, uint64_t round, uint32_t region,
                                          uint32_t need, uint2* v) {
  Waiter w;
  while (need != 0 && !c.dead) {
    const bool slow = w.slow_next();
    uint32_t foreign = 0;
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s) {
      if ((need >> s) & 1u) {
        const uint4 l = ld_volatile_v4(sub_slot(p, c, p.rank, region, s, round) + (uint64_t)u * FC_LL_LINE);
        if (ll_ready(l, c)) {
          v[s] = make_uint2(l.x, l.z);
          need &= ~(1u << s);
        } else if (slow && foreign == 0) {
          foreign = ll_foreign(l, c);
        }
      }
    }
    if (slow && w.confirm_foreign(foreign != 0)) {
      give_up(p, c, FC_STATUS_MISMATCH, __ffs(need) - 1, foreign);
      break;
    }
    if (need != 0 && w.stop(p, c, __ffs(need) - 1)) break;
  }
}

// Reduces `len` bytes: own contribution from `own` (user memory), the others from region
// `region`; writes the result to `out` and, when `fwd_mask` is not 0, pushes it to region
// `fwd_region` of those ranks.
template <typename T>
__device__ __forceinline__ void ll_reduce(const FcCollParams& p, Ctx& c, const char* own, char* out, uint32_t len,
                                          uint64_t round, uint32_t region, uint32_t fwd_region, uint32_t fwd_mask) {
  const uint32_t units = (len + FC_LL_PAYLOAD - 1) / FC_LL_PAYLOAD;
  const uint32_t others = ((1u << p.nranks) - 1u) & ~(1u << p.rank);
  ll_gate(p, c, sub_slot(p, c, p.rank, region, 0, round), others);
  for (uint32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const uint32_t n = min((uint32_t)FC_LL_PAYLOAD, len - u * FC_LL_PAYLOAD);
    uint2 v[FC_MAX_RANKS];
    const uint2 mine = load_bytes8(own + (uint64_t)u * FC_LL_PAYLOAD, n);
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s) v[s] = mine;
    ll_gather(p, c, u, round, region, others, v);
    Acc<T, 2> acc;
    acc.init(reinterpret_cast<const uint32_t*>(&v[0]));
#pragma unroll
    for (uint32_t s = 1; s < FC_MAX_RANKS; ++s) {
      if (s < p.nranks) acc.add(reinterpret_cast<const uint32_t*>(&v[s]));
    }
    uint2 r;
    acc.out(reinterpret_cast<uint32_t*>(&r));
    store_bytes8(out + (uint64_t)u * FC_LL_PAYLOAD, r, n);
    if (fwd_mask != 0) {
#pragma unroll
      for (uint32_t q = 0; q < FC_MAX_RANKS; ++q) {
        if (q < p.nranks && is_peer(p, q, fwd_mask))
          ll_store(sub_slot(p, c, q, fwd_region, p.rank, round) + (uint64_t)u * FC_LL_LINE, r, c);
      }
    }
    if (c.reuse) {
#pragma unroll
      for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
        if ((others >> s) & 1u) ll_clear(sub_slot(p, c, p.rank, region, s, round) + (uint64_t)u * FC_LL_LINE);
    }
  }
}

// Copies `len` bytes that source `s` pushed into region `region` to `out`.
__device__ __forceinline__ void ll_copy(const FcCollParams& p, Ctx& c, uint32_t s, char* out, uint32_t len, uint64_t round,
                                        uint32_t region) {
  const uint32_t units = (len + FC_LL_PAYLOAD - 1) / FC_LL_PAYLOAD;
  for (uint32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const uint32_t n = min((uint32_t)FC_LL_PAYLOAD, len - u * FC_LL_PAYLOAD);
    uint2 v[FC_MAX_RANKS];
#pragma unroll
    for (uint32_t i = 0; i < FC_MAX_RANKS; ++i) v[i] = make_uint2(0, 0);
    ll_gather(p, c, u, round, region, 1u << s, v);
    uint2 d = make_uint2(0, 0);
#pragma unroll
    for (uint32_t i = 0; i < FC_MAX_RANKS; ++i)
      if (i == s) d = v[i];
    store_bytes8(out + (uint64_t)u * FC_LL_PAYLOAD, d, n);
    if (c.reuse) ll_clear(sub_slot(p, c, p.rank, region, s, round) + (uint64_t)u * FC_LL_LINE);
  }
}

// One-shot AllReduce with LL, fused per thread: a thread takes one 8-byte unit (line u of the
// sub-slot: the layout of ll_send), pushes it to every peer (starting with the next rank, so the
// ranks' first stores go to different arenas), then polls exactly that line of every peer (every
// source's load issued before any is checked), reduces in rank order and writes the result. A
// thread never waits for anything another thread of its rank sends, so a chunk costs one round
// trip of polls instead of a send phase and a reduce phase; lines are never cleared (their tags
// carry the whole epoch) unless the sub-slot carries a later round of this call. (One unit per
// thread measured faster on the H200 than two: docs/experiments.md, "The small-message path".)
// `pre` is this thread's first unit of round 0 when the caller loaded it already (`have_pre`).
template <typename T>
__device__ __forceinline__ void ll_oneshot_fused(const FcCollParams& p, Ctx& c, const char* in, char* out, uint32_t len,
                                                 uint64_t round, uint2 pre, bool have_pre) {
  const uint32_t units = (len + FC_LL_PAYLOAD - 1) / FC_LL_PAYLOAD;
  const uint32_t others = ((1u << p.nranks) - 1u) & ~(1u << p.rank);
  // This rank's slot of source 0 for this block and round; source s's is p.slot_bytes further.
  const char* inbox = sub_slot(p, c, p.rank, 0, 0, round);
  // Where this rank's lines go in rank 0's arena; rank q's is at the same offset of its arena.
  const uint64_t outbox = (uint64_t)(sub_slot(p, c, 0, 0, p.rank, round) - reinterpret_cast<char*>(p.peer_base[0]));
  // Host transport: the block pushes all its lines first, then waits at the gate (ll_gate), then
  // each thread reads its lines; the loop below then only reads.
  const bool host = (p.flags & FC_FLAG_HOST_ARENAS) != 0;
  if (host) {
    ll_send(p, c, in, len, round, 0, others);
    ll_gate(p, c, inbox, others);
  }
  for (uint32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const uint32_t n = min((uint32_t)FC_LL_PAYLOAD, len - u * FC_LL_PAYLOAD);
    const uint2 mine = (have_pre && u == threadIdx.x) ? pre : load_bytes8(in + (uint64_t)u * FC_LL_PAYLOAD, n);
    const uint64_t at = (uint64_t)u * FC_LL_LINE;
#pragma unroll
    for (uint32_t d = 1; d < FC_MAX_RANKS; ++d) {
      if (d < p.nranks && !host) {
        const uint32_t q = p.rank + d < p.nranks ? p.rank + d : p.rank + d - p.nranks;
        ll_store(reinterpret_cast<char*>(p.peer_base[q]) + outbox + at, mine, c);
      }
    }
    const char* mine_lines = inbox + at;
    uint4 got[FC_MAX_RANKS];
    uint32_t need = others;
    Waiter w;
    while (need != 0 && !c.dead) {
#pragma unroll
      for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
        if ((need >> s) & 1u) got[s] = ld_volatile_v4(mine_lines + (uint64_t)s * p.slot_bytes);
#pragma unroll
      for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
        if (((need >> s) & 1u) && ll_ready(got[s], c)) need &= ~(1u << s);
      if (need == 0) break;
      if (w.slow_next()) {
        uint32_t foreign = 0;
#pragma unroll
        for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
          if (((need >> s) & 1u) && foreign == 0) foreign = ll_foreign(got[s], c);
        if (w.confirm_foreign(foreign != 0)) {
          give_up(p, c, FC_STATUS_MISMATCH, __ffs(need) - 1, foreign);
          break;
        }
      }
      if (w.stop(p, c, __ffs(need) - 1)) break;
    }
    Acc<T, 2> acc;
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s) {
      if (s < p.nranks) {
        const uint2 x = s == p.rank ? mine : make_uint2(got[s].x, got[s].z);
        if (s == 0)
          acc.init(reinterpret_cast<const uint32_t*>(&x));
        else
          acc.add(reinterpret_cast<const uint32_t*>(&x));
      }
    }
    uint2 r;
    acc.out(reinterpret_cast<uint32_t*>(&r));
    store_bytes8(out + (uint64_t)u * FC_LL_PAYLOAD, r, n);
    if (c.reuse) {
#pragma unroll
      for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
        if ((others >> s) & 1u) ll_clear(const_cast<char*>(mine_lines) + (uint64_t)s * p.slot_bytes);
    }
  }
}

// ================================================================================== BLOCK ====

__device__ __forceinline__ char* frame_at(char* sub, uint32_t f) { return sub + (uint64_t)f * FC_FRAME_BYTES; }

__device__ __forceinline__ uint32_t frame_len(uint32_t len, uint32_t f) {
  return min((uint32_t)FC_FRAME_PAYLOAD, len - f * FC_FRAME_PAYLOAD);
}

// Loads this lane's part of frame f of `src` (user memory).
__device__ __forceinline__ void frame_load(const char* src, uint32_t fbytes, uint32_t lane, uint4* d) {
#pragma unroll
  for (int i = 0; i < kFrameVecs; ++i) {
    const uint32_t o = (i * 32 + lane) * 16;
    d[i] = o < fbytes ? load_bytes16(src + o, min(16u, fbytes - o)) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void frame_store_payload(char* frame, uint32_t fbytes, uint32_t lane, const uint4* d) {
#pragma unroll
  for (int i = 0; i < kFrameVecs; ++i) {
    const uint32_t o = (i * 32 + lane) * 16;
    if (o < fbytes) st_v4(frame_payload(frame) + o, d[i]);
  }
}

__device__ __forceinline__ void blk_send(const FcCollParams& p, Ctx& c, const char* src, uint32_t len, uint64_t round,
                                         uint32_t region, uint32_t mask) {
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const uint32_t nframes = (len + FC_FRAME_PAYLOAD - 1) / FC_FRAME_PAYLOAD;
  for (uint32_t f = warp; f < nframes; f += nwarps) {
    const uint32_t fbytes = frame_len(len, f);
    uint4 d[kFrameVecs];
    frame_load(src + (uint64_t)f * FC_FRAME_PAYLOAD, fbytes, lane, d);
#pragma unroll 1
    for (uint32_t q = 0; q < p.nranks; ++q) {
      if (is_peer(p, q, mask)) frame_store_payload(frame_at(sub_slot(p, c, q, region, p.rank, round), f), fbytes, lane, d);
    }
    __syncwarp();
    if (lane == 0) {
      fence_sys();
      for (uint32_t q = 0; q < p.nranks; ++q) {
        if (is_peer(p, q, mask)) st_relaxed_sys_u32(frame_tag(frame_at(sub_slot(p, c, q, region, p.rank, round), f)), c.tag);
      }
    }
  }
}

// Lane s waits for source s's frame f (for every source in `srcs`); then the warp is synchronized.
__device__ __forceinline__ void blk_wait_frames(const FcCollParams& p, Ctx& c, uint32_t f, uint64_t round, uint32_t region,
                                                uint32_t srcs) {
  const uint32_t lane = threadIdx.x & 31;
  if (lane < FC_MAX_RANKS && ((srcs >> lane) & 1u) && !c.dead)
    frame_wait(p, c, frame_at(sub_slot(p, c, p.rank, region, lane, round), f), lane);
  __syncwarp();
}

__device__ __forceinline__ void blk_clear_frames(const FcCollParams& p, Ctx& c, uint32_t f, uint64_t round, uint32_t region,
                                                 uint32_t srcs) {
  const uint32_t lane = threadIdx.x & 31;
  __syncwarp();
  if (lane < FC_MAX_RANKS && ((srcs >> lane) & 1u))
    st_volatile_u32(frame_tag(frame_at(sub_slot(p, c, p.rank, region, lane, round), f)), 0u);
}

template <typename T>
__device__ __forceinline__ void blk_reduce(const FcCollParams& p, Ctx& c, const char* own, char* out, uint32_t len,
                                           uint64_t round, uint32_t region, uint32_t fwd_region, uint32_t fwd_mask) {
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const uint32_t nframes = (len + FC_FRAME_PAYLOAD - 1) / FC_FRAME_PAYLOAD;
  const uint32_t others = ((1u << p.nranks) - 1u) & ~(1u << p.rank);
  for (uint32_t f = warp; f < nframes; f += nwarps) {
    const uint32_t fbytes = frame_len(len, f);
    blk_wait_frames(p, c, f, round, region, others);
    uint4 r[kFrameVecs];
    // kBatch vectors at a time: every source's kBatch loads are issued back to back before any
    // is used, so a frame read across PCIe (the host transport) costs two round trips per source
    // rather than one per vector; the sum stays in rank order.
#pragma unroll
    for (int i0 = 0; i0 < kFrameVecs; i0 += kBatch) {
      Acc<T, 4> acc[kBatch];
      for (uint32_t s = 0; s < p.nranks; ++s) {
        const char* src = frame_payload(frame_at(sub_slot(p, c, p.rank, region, s, round), f));
        uint4 v[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const uint32_t o = ((i0 + j) * 32 + lane) * 16;
          if (o >= fbytes)
            v[j] = make_uint4(0, 0, 0, 0);
          else if (s == p.rank)
            v[j] = load_bytes16(own + (uint64_t)f * FC_FRAME_PAYLOAD + o, min(16u, fbytes - o));
          else
            v[j] = ld_cg_v4(src + o);
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (s == 0)
            acc[j].init(reinterpret_cast<const uint32_t*>(&v[j]));
          else
            acc[j].add(reinterpret_cast<const uint32_t*>(&v[j]));
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint32_t o = ((i0 + j) * 32 + lane) * 16;
        acc[j].out(reinterpret_cast<uint32_t*>(&r[i0 + j]));
        if (o < fbytes) store_bytes16(out + (uint64_t)f * FC_FRAME_PAYLOAD + o, r[i0 + j], min(16u, fbytes - o));
      }
    }
    if (fwd_mask != 0) {
#pragma unroll 1
      for (uint32_t q = 0; q < p.nranks; ++q) {
        if (is_peer(p, q, fwd_mask)) frame_store_payload(frame_at(sub_slot(p, c, q, fwd_region, p.rank, round), f), fbytes, lane, r);
      }
      __syncwarp();
      if (lane == 0) {
        fence_sys();
        for (uint32_t q = 0; q < p.nranks; ++q) {
          if (is_peer(p, q, fwd_mask))
            st_relaxed_sys_u32(frame_tag(frame_at(sub_slot(p, c, q, fwd_region, p.rank, round), f)), c.tag);
        }
      }
    }
    blk_clear_frames(p, c, f, round, region, others);
  }
}

__device__ __forceinline__ void blk_copy(const FcCollParams& p, Ctx& c, uint32_t s, char* out, uint32_t len, uint64_t round,
                                         uint32_t region) {
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const uint32_t nframes = (len + FC_FRAME_PAYLOAD - 1) / FC_FRAME_PAYLOAD;
  for (uint32_t f = warp; f < nframes; f += nwarps) {
    const uint32_t fbytes = frame_len(len, f);
    blk_wait_frames(p, c, f, round, region, 1u << s);
    const char* payload = frame_payload(frame_at(sub_slot(p, c, p.rank, region, s, round), f));
    // Every load of the frame first, then the stores: one round trip across PCIe per frame.
    uint4 d[kFrameVecs];
#pragma unroll
    for (int i = 0; i < kFrameVecs; ++i) {
      const uint32_t o = (i * 32 + lane) * 16;
      d[i] = o < fbytes ? ld_cg_v4(payload + o) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kFrameVecs; ++i) {
      const uint32_t o = (i * 32 + lane) * 16;
      if (o < fbytes) store_bytes16(out + (uint64_t)f * FC_FRAME_PAYLOAD + o, d[i], min(16u, fbytes - o));
    }
    blk_clear_frames(p, c, f, round, region, 1u << s);
  }
}

// ============================================================================= dispatch ====

template <int PROTO>
__device__ __forceinline__ void send(const FcCollParams& p, Ctx& c, const char* src, uint32_t len, uint64_t round,
                                     uint32_t region, uint32_t mask) {
  if (PROTO == FC_PROTO_LL)
    ll_send(p, c, src, len, round, region, mask);
  else
    blk_send(p, c, src, len, round, region, mask);
}

template <int PROTO, typename T>
__device__ __forceinline__ void reduce(const FcCollParams& p, Ctx& c, const char* own, char* out, uint32_t len, uint64_t round,
                                       uint32_t region, uint32_t fwd_region, uint32_t fwd_mask) {
  if (PROTO == FC_PROTO_LL)
    ll_reduce<T>(p, c, own, out, len, round, region, fwd_region, fwd_mask);
  else
    blk_reduce<T>(p, c, own, out, len, round, region, fwd_region, fwd_mask);
}

template <int PROTO>
__device__ __forceinline__ void copy_from(const FcCollParams& p, Ctx& c, uint32_t s, char* out, uint32_t len, uint64_t round,
                                          uint32_t region) {
  if (PROTO == FC_PROTO_LL)
    ll_copy(p, c, s, out, len, round, region);
  else
    blk_copy(p, c, s, out, len, round, region);
}

// Host transport, LL: one gate (ll_gate) for every source in `need` that the block copies from next.
template <int PROTO>
__device__ __forceinline__ void gate_copies(const FcCollParams& p, Ctx& c, uint32_t need, uint64_t round, uint32_t region) {
  if (PROTO == FC_PROTO_LL) ll_gate(p, c, sub_slot(p, c, p.rank, region, 0, round), need);
}

// At the start of round `round` (chunk k) of a block whose chunks end at `limit` bytes: after the
// first round, the frame tags and LL lines this thread cleared must be cleared, and its reads of
// the last round performed, before any peer can see this round (which lets that peer reuse the
// sub-slot two rounds later); and whether this round's sub-slot carries round + 2 of this call
// too (c.reuse: LL readers then clear what they read).
__device__ __forceinline__ void begin_round(Ctx& c, uint64_t k, uint64_t round, uint64_t chunk, uint64_t limit) {
  if (round > 0) fence_sys();
  c.reuse = (k + 2ull * gridDim.x) * chunk < limit;
}

__device__ __forceinline__ void copy_local(const char* src, char* dst, uint32_t len) {
  if (src == dst) return;
  for (uint32_t o = threadIdx.x * 16; o < len; o += blockDim.x * 16)
    store_bytes16(dst + o, load_bytes16(src + o, min(16u, len - o)), min(16u, len - o));
}

template <typename T, int PROTO>
__device__ void allreduce_oneshot_push(const FcCollParams& p) {
  wait_for_previous_work();
  const uint64_t bytes = p.count * sizeof(T);
  const uint32_t all = (1u << p.nranks) - 1u;
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  // LL: this thread's first unit is loaded before the epoch word, so the two loads overlap.
  // (Chunk k exists while k * chunk_bytes < bytes: no division on the way to the first load.)
  uint2 pre = make_uint2(0, 0);
  bool have_pre = false;
  if (PROTO == FC_PROTO_LL && (uint64_t)blockIdx.x * p.chunk_bytes < bytes) {
    const uint64_t off = (uint64_t)blockIdx.x * p.chunk_bytes;
    const uint32_t len = (uint32_t)min((uint64_t)p.chunk_bytes, bytes - off);
    if (threadIdx.x * FC_LL_PAYLOAD < len) {
      pre = load_bytes8(in + off + (uint64_t)threadIdx.x * FC_LL_PAYLOAD, min((uint32_t)FC_LL_PAYLOAD, len - threadIdx.x * FC_LL_PAYLOAD));
      have_pre = true;
    }
  }
  Ctx c = begin_after_wait(p);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k * p.chunk_bytes < bytes; k += gridDim.x, ++round) {
    begin_round(c, k, round, p.chunk_bytes, bytes);
    const uint64_t off = k * p.chunk_bytes;
    const uint32_t len = (uint32_t)min((uint64_t)p.chunk_bytes, bytes - off);
    if (PROTO == FC_PROTO_LL) {
      ll_oneshot_fused<T>(p, c, in + off, out + off, len, round, pre, have_pre && round == 0);
    } else {
      send<PROTO>(p, c, in + off, len, round, 0, all);
      reduce<PROTO, T>(p, c, in + off, out + off, len, round, 0, 0, 0);
    }
  }
  finish(p, c);
}

template <typename T, int PROTO>
__device__ void allreduce_twoshot_push(const FcCollParams& p) {
  Ctx c = begin(p);
  const uint64_t shard_bytes = p.shard_elems * sizeof(T);
  const uint64_t total = p.count * sizeof(T);
  const uint32_t all = (1u << p.nranks) - 1u;
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k * p.chunk_bytes < shard_bytes; k += gridDim.x, ++round) {
    begin_round(c, k, round, p.chunk_bytes, shard_bytes);
    const uint64_t off = k * p.chunk_bytes;
    // Length of chunk k of shard j (0 when shard j is shorter than this chunk).
    auto len_of = [&](uint32_t j) -> uint32_t {
      const uint64_t start = (uint64_t)j * shard_bytes + off;
      const uint64_t end = min((uint64_t)j * shard_bytes + shard_bytes, total);
      return start < end ? (uint32_t)min((uint64_t)p.chunk_bytes, end - start) : 0u;
    };
    // Step 1: chunk k of every other shard goes to its owner.
    for (uint32_t j = 0; j < p.nranks; ++j) {
      const uint32_t lj = len_of(j);
      if (j != p.rank && lj > 0) send<PROTO>(p, c, in + (uint64_t)j * shard_bytes + off, lj, round, 0, 1u << j);
    }
    // Step 2: reduce chunk k of the own shard, write it and push it to everyone.
    const uint32_t li = len_of(p.rank);
    if (li > 0) {
      const uint64_t mine = (uint64_t)p.rank * shard_bytes + off;
      reduce<PROTO, T>(p, c, in + mine, out + mine, li, round, 0, 1, all);
    }
    // Step 3: collect the other owners' reduced chunks.
    uint32_t owners = 0;
    for (uint32_t j = 0; j < p.nranks; ++j)
      if (j != p.rank && len_of(j) > 0) owners |= 1u << j;
    gate_copies<PROTO>(p, c, owners, round, 1);
    for (uint32_t j = 0; j < p.nranks; ++j) {
      const uint32_t lj = len_of(j);
      if (j != p.rank && lj > 0) copy_from<PROTO>(p, c, j, out + (uint64_t)j * shard_bytes + off, lj, round, 1);
    }
  }
  finish(p, c);
}

template <typename T, int PROTO>
__device__ void reducescatter_push(const FcCollParams& p) {
  Ctx c = begin(p);
  const uint64_t bytes = p.count * sizeof(T);  // recvcount elements per rank
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k * p.chunk_bytes < bytes; k += gridDim.x, ++round) {
    begin_round(c, k, round, p.chunk_bytes, bytes);
    const uint64_t off = k * p.chunk_bytes;
    const uint32_t len = (uint32_t)min((uint64_t)p.chunk_bytes, bytes - off);
    for (uint32_t j = 0; j < p.nranks; ++j) {
      if (j != p.rank) send<PROTO>(p, c, in + (uint64_t)j * bytes + off, len, round, 0, 1u << j);
    }
    reduce<PROTO, T>(p, c, in + (uint64_t)p.rank * bytes + off, out + off, len, round, 0, 0, 0);
  }
  finish(p, c);
}

template <int PROTO>
__device__ void allgather_push(const FcCollParams& p) {
  Ctx c = begin(p);
  const uint64_t bytes = p.count * p.elem_bytes;  // sendcount elements
  const uint32_t all = (1u << p.nranks) - 1u;
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k * p.chunk_bytes < bytes; k += gridDim.x, ++round) {
    begin_round(c, k, round, p.chunk_bytes, bytes);
    const uint64_t off = k * p.chunk_bytes;
    const uint32_t len = (uint32_t)min((uint64_t)p.chunk_bytes, bytes - off);
    send<PROTO>(p, c, in + off, len, round, 0, all);
    copy_local(in + off, out + (uint64_t)p.rank * bytes + off, len);
    gate_copies<PROTO>(p, c, all & ~(1u << p.rank), round, 0);
    for (uint32_t s = 0; s < p.nranks; ++s) {
      if (s != p.rank) copy_from<PROTO>(p, c, s, out + (uint64_t)s * bytes + off, len, round, 0);
    }
  }
  finish(p, c);
}

// AllToAll: block q of the send buffer (`count` elements of `elem_bytes`) goes to rank q, which
// places it at block `rank` of its receive buffer. The structure of AllGather with a source per
// destination: per round, a block pushes chunk k of send block q to rank q (region A, slot = own
// rank), copies its own block's chunk locally, and copies every peer's chunk k out. Every rank's
// blocks are the same size, so each source's chunk k arrives in the same (block, round). In place
// (send = recv, which NCCL lets each rank choose) is safe: chunk k of every block is touched by
// this block only, and each thread (LL: unit u; BLOCK: lane l of the warp of frame f) reads its
// part of chunk k of every send block before it writes the same part of any receive block.
template <int PROTO>
__device__ void alltoall_push(const FcCollParams& p) {
  Ctx c = begin(p);
  const uint64_t bytes = p.count * p.elem_bytes;  // per peer
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  uint64_t round = 0;
  for (uint64_t k = blockIdx.x; k * p.chunk_bytes < bytes; k += gridDim.x, ++round) {
    begin_round(c, k, round, p.chunk_bytes, bytes);
    const uint64_t off = k * p.chunk_bytes;
    const uint32_t len = (uint32_t)min((uint64_t)p.chunk_bytes, bytes - off);
    for (uint32_t q = 0; q < p.nranks; ++q) {
      if (q != p.rank) send<PROTO>(p, c, in + (uint64_t)q * bytes + off, len, round, 0, 1u << q);
    }
    copy_local(in + (uint64_t)p.rank * bytes + off, out + (uint64_t)p.rank * bytes + off, len);
    gate_copies<PROTO>(p, c, ((1u << p.nranks) - 1u) & ~(1u << p.rank), round, 0);
    for (uint32_t s = 0; s < p.nranks; ++s) {
      if (s != p.rank) copy_from<PROTO>(p, c, s, out + (uint64_t)s * bytes + off, len, round, 0);
    }
  }
  finish(p, c);
}

// AllReduce of either family: the push protocols above, or PULL (flashcomm/pull.cuh).
template <typename T, int PROTO>
__device__ void allreduce_oneshot(const FcCollParams& p) {
  if constexpr (PROTO == FC_PROTO_PULL || PROTO == FC_PROTO_DIRECT)
    pull_oneshot<T, PROTO == FC_PROTO_DIRECT>(p);
  else
    allreduce_oneshot_push<T, PROTO>(p);
}

template <typename T, int PROTO>
__device__ void allreduce_twoshot(const FcCollParams& p) {
  if constexpr (PROTO == FC_PROTO_PULL || PROTO == FC_PROTO_DIRECT)
    pull_twoshot<T, PROTO == FC_PROTO_DIRECT>(p);
  else
    allreduce_twoshot_push<T, PROTO>(p);
}

// ReduceScatter, AllGather and AllToAll of either family (PULL: pull_move, flashcomm/pull.cuh).
template <typename T, int PROTO>
__device__ void reducescatter(const FcCollParams& p) {
  if constexpr (PROTO == FC_PROTO_PULL || PROTO == FC_PROTO_DIRECT)
    pull_move<kPullReduceScatter, T, PROTO == FC_PROTO_DIRECT>(p);
  else
    reducescatter_push<T, PROTO>(p);
}

template <int PROTO>
__device__ void allgather(const FcCollParams& p) {
  if constexpr (PROTO == FC_PROTO_PULL || PROTO == FC_PROTO_DIRECT)
    pull_move<kPullAllGather, char, PROTO == FC_PROTO_DIRECT>(p);
  else
    allgather_push<PROTO>(p);
}

template <int PROTO>
__device__ void alltoall(const FcCollParams& p) {
  if constexpr (PROTO == FC_PROTO_PULL || PROTO == FC_PROTO_DIRECT)
    pull_move<kPullAllToAll, char, PROTO == FC_PROTO_DIRECT>(p);
  else
    alltoall_push<PROTO>(p);
}

}  // namespace fc

// The instantiations: exactly the host's kernel catalogue (flashcomm/instances.h is generated
// from crates/kernels/src/catalog.rs).
#define FC_AR(ALGO, PROTO, PROTO_ID, T, SUFFIX)                                                          \
  extern "C" __global__ void __launch_bounds__(fc::kThreads)                                            \
      fc_allreduce_##ALGO##_##PROTO##_##SUFFIX(const __grid_constant__ FcCollParams p) {                \
    fc::allreduce_##ALGO<T, PROTO_ID>(p);                                                               \
  }
#define FC_RS(PROTO, PROTO_ID, T, SUFFIX)                                                                \
  extern "C" __global__ void __launch_bounds__(fc::kThreads)                                            \
      fc_reducescatter_##PROTO##_##SUFFIX(const __grid_constant__ FcCollParams p) {                     \
    fc::reducescatter<T, PROTO_ID>(p);                                                                  \
  }
#define FC_AG(PROTO, PROTO_ID)                                                                           \
  extern "C" __global__ void __launch_bounds__(fc::kThreads)                                            \
      fc_allgather_##PROTO(const __grid_constant__ FcCollParams p) {                                    \
    fc::allgather<PROTO_ID>(p);                                                                         \
  }

#define FC_A2A(PROTO, PROTO_ID)                                                                          \
  extern "C" __global__ void __launch_bounds__(fc::kThreads)                                            \
      fc_alltoall_##PROTO(const __grid_constant__ FcCollParams p) {                                     \
    fc::alltoall<PROTO_ID>(p);                                                                          \
  }

#include "flashcomm/instances.h"

FC_LOSSLESS_INSTANCES
