// The self-synchronizing transport: how data and its readiness travel together, and how every
// wait is bounded. See docs/protocols.md for the full argument; the short version:
//
// * Every rank owns an arena (device memory, mapped into every peer). Peers PUSH data into it;
//   a rank only ever reads its own arena. The data area has two halves; collective number `seq`
//   uses half `seq & 1`. A half is divided into two regions (A: first step, B: second step), a
//   region into one slot per source rank. A slot has two disjoint areas, one per protocol (so an
//   LL line is never read where a frame's payload was left, and frame tags always sit on the same
//   4112-byte grid), and an area is divided into one sub-slot per (block, round parity).
// * LL protocol: a 16-byte line carries 8 payload bytes as {d0, f0, d1, f1}; the line is written
//   with one 16-byte store and read with one 16-byte load. f0 is the call's 32-bit epoch tag
//   `seq + 1` (never 0: the epoch skips the one value that would make it 0), f1 is f0 with the
//   call's signature (collective and datatype) xor-ed into its top 8 bits. Each 8-byte half
//   proves its own freshness with the whole 32-bit epoch, so a torn read is never mistaken for a
//   complete one, and lines are not cleared: a stale line carries an older epoch. (Only a block
//   whose sub-slot carries a later round of the same call clears what it read: c.reuse.) A line
//   whose f0 is this call's epoch but whose f1 carries another signature comes from a peer running a
//   different collective at this sequence number: a mismatch, judged on the slow path of a wait
//   and only when two consecutive slow checks (128 polls apart) see a foreign line, so a torn
//   read (a new first half beside an old second half) is not judged. No fence on the way out.
// * BLOCK protocol: a frame is a 16-byte header (u32 tag, rest reserved) followed by up to
//   FC_FRAME_PAYLOAD bytes. A warp writes the payload with plain stores, synchronizes, and lane 0
//   issues a system-scope fence before storing the tag `(seq % (2^24 - 1) + 1) << 8 | sig`.
//   The receiver acquires the tag, reads the payload through L2 and clears the tag back to 0, so
//   a non-zero tag that differs from the expected one is a mismatch.
// * Epochs live on the device (one word per block index in the arena header, advanced by every
//   block at its end; see finish), so a CUDA graph replays correctly any number of times.
// * Every wait polls with a budget: it checks this rank's abort word (set by peers that gave up),
//   the host abort flag (ncclCommAbort) and, when a timeout is set (timeout_ns != 0), how long
//   this wait has lasted (globaltimer, from its first slow check: the limit bounds each wait, not
//   the kernel, so a long collective whose every wait is short never times out). With no timeout
//   a wait lasts until the data arrives or an abort word is set, as NCCL's own waits do. A thread
//   that gives up
//   records why in the host-mapped status (first error wins), asks every peer to stop, and from
//   then on skips all waits, so the kernel always finishes.
#pragma once
#include <stdint.h>
#include "flashcomm/params.h"
#include "flashcomm/ptx.cuh"
#include "flashcomm/wait_count.h"

// Frame and line sizes (FC_FRAME_*, FC_LL_*) come from params.h, generated from the host's ABI.

namespace fc {

// Per-thread view of the running collective.
struct Ctx {
  uint64_t seq;
  uint32_t tag;     // BLOCK frames: (seq % (2^24 - 1) + 1) << 8 | sig
  uint32_t ll0;     // LL lines, first half: seq + 1 (never 0)
  uint32_t ll1;     // LL lines, second half: ll0 ^ sig << 24
  uint32_t half;
  bool reuse;  // this block's sub-slot of the current round is written again two rounds later in
               // this call (same tags): LL readers clear the lines they consumed
  bool dead;  // this thread gave up (or saw that another one did): skip every wait from now on
};

// The tag of call `seq` with signature `sig` (collective and datatype, FLAG_SIG_SHIFT of the
// flags): never 0, and different for two calls of one sequence number but different signature.
__device__ __forceinline__ uint32_t tag_of(uint64_t seq, uint32_t sig) {
  return (((uint32_t)seq % 16777215u + 1u) << 8) | (sig & 0xffu);
}

// The host may launch a collective kernel with programmatic stream serialization (compute
// capability 9.0 and later): wait here, before any memory access, until the previous work of the
// stream has completed and its memory is visible. Without that launch attribute this returns at
// once.
__device__ __forceinline__ void wait_for_previous_work() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream launch now (FC_FLAG_EARLY_LAUNCH): it waits on the GPU, at
// its own wait_for_previous_work, until this kernel has completed and its memory is visible.
__device__ __forceinline__ void allow_next_launch(const FcCollParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.flags & FC_FLAG_EARLY_LAUNCH) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The running collective as this block sees it, for kernels that called
// wait_for_previous_work() already (and may have issued loads of their input meanwhile, which
// then overlap the epoch's load).
// Phase trace (FcCollParams::trace, flashcomm-perf `--phase-trace`; off by default): thread 0 of
// a traced block stamps the global timer at point `k` (1: began, 2: peers' data ready, 3:
// finished) of its call, and at point 1 the call's sequence number plus one. Timer values of
// every rank on one GPU share one clock. Uniform branch on a parameter: nothing when off.
__device__ __forceinline__ void trace_mark(const FcCollParams& p, uint64_t seq, uint32_t k) {
  if (p.trace != 0 && threadIdx.x == 0 && blockIdx.x < FC_TRACE_BLOCKS) {
    uint64_t* w = reinterpret_cast<uint64_t*>(p.trace) +
                  ((seq % FC_TRACE_CALLS) * FC_TRACE_BLOCKS + blockIdx.x) * FC_TRACE_POINTS;
    if (k == 1) w[0] = seq + 1;
    w[k] = globaltimer_ns();
  }
}

__device__ __forceinline__ Ctx begin_after_wait(const FcCollParams& p) {
  Ctx c;
  // This block's epoch word: every block of the previous kernel on this rank advanced every word
  // (see finish), so all blocks of this kernel read the same epoch.
  c.seq = ld_volatile_u32(reinterpret_cast<const uint32_t*>(p.epochs) + blockIdx.x);
  c.tag = tag_of(c.seq, p.flags >> FC_FLAG_SIG_SHIFT);
  c.ll0 = (uint32_t)c.seq + 1u;
  c.ll1 = c.ll0 ^ (((p.flags >> FC_FLAG_SIG_SHIFT) & 0xffu) << 24);
  c.half = (uint32_t)(c.seq & 1);
  c.reuse = false;
  c.dead = false;
  trace_mark(p, c.seq, 1);
  allow_next_launch(p);
  return c;
}

__device__ __forceinline__ Ctx begin(const FcCollParams& p) {
  wait_for_previous_work();
  return begin_after_wait(p);
}

// Called by every thread of every block at the very end: block b advances the epoch words
// b, b + G, b + 2G, ... (G = gridDim.x) below FC_MAX_BLOCKS. No word is read by another block of
// this kernel (block b' < G reads only word b'), so no atomic and no grid-wide count is needed,
// and the next kernel on this rank (stream order) sees every word advanced whatever its grid.
// The epoch never reaches 0xffffffff (next_epoch, wait_count.h), and the frame tags of calls two
// apart still differ at its wrap (tag_of reduces modulo 2^24 - 1).

__device__ __forceinline__ void finish(const FcCollParams& p, const Ctx& c) {
  __syncthreads();
  trace_mark(p, c.seq, 3);
  uint32_t* words = reinterpret_cast<uint32_t*>(p.epochs);
  const uint32_t next = next_epoch((uint32_t)c.seq);
  for (uint32_t w = blockIdx.x + threadIdx.x * gridDim.x; w < FC_MAX_BLOCKS; w += blockDim.x * gridDim.x) words[w] = next;
}

__device__ __forceinline__ char* arena_local(const FcCollParams& p) {
  return reinterpret_cast<char*>(p.peer_base[p.rank]);
}

// Address of the sub-slot that `src` writes into `owner`'s arena, for region `region` (0 = A,
// 1 = B), this block, and `round`.
__device__ __forceinline__ char* sub_slot(const FcCollParams& p, const Ctx& c, uint32_t owner, uint32_t region,
                                          uint32_t src, uint64_t round) {
  uint64_t off = FC_ARENA_HEADER_BYTES + (uint64_t)c.half * p.half_bytes + (uint64_t)region * p.region_bytes +
                 (uint64_t)src * p.slot_bytes + p.area_offset + ((uint64_t)blockIdx.x * 2 + (round & 1)) * p.sub_bytes;
  return reinterpret_cast<char*>(p.peer_base[owner]) + off;
}

// Records the first error of this rank and asks every rank (including this one) to stop. Out of
// line, and given values only: a Ctx passed by reference to a call that is not inlined would live
// in local memory, and every poll would load its tags from there (measured: 0.1-0.2 us per call).
__device__ __noinline__ void record_failure(const FcCollParams& p, uint64_t seq, uint32_t tag, uint32_t code,
                                            uint32_t peer, uint32_t observed) {
  FcStatus* st = reinterpret_cast<FcStatus*>(p.status);
  // Claim the record, fill it, then publish the code: the host never sees a code whose details
  // are still being written.
  if (atomicCAS_system(&st->code, FC_STATUS_OK, FC_STATUS_CLAIMED) == FC_STATUS_OK) {
    st->peer = peer;
    st->block = blockIdx.x;
    st->observed = observed;
    st->seq = seq;
    st->expected = tag;
    __threadfence_system();
    st_volatile_u32(&st->code, code);
    __threadfence_system();
  }
  for (uint32_t r = 0; r < p.nranks; ++r) {
    st_volatile_u32(reinterpret_cast<char*>(p.peer_base[r]) + FC_HDR_ABORT_REQ, 1u);
  }
  __threadfence_system();
}

// This thread gives up: it records why (record_failure) and skips every wait from now on.
__device__ __forceinline__ void give_up(const FcCollParams& p, Ctx& c, uint32_t code, uint32_t peer, uint32_t observed) {
  c.dead = true;
  record_failure(p, c.seq, c.tag, code, peer, observed);
}

// Budget check inside a polling loop. Returns true when the thread must stop waiting.
struct Waiter {
  // Polls, and the foreign-line flag of the previous slow check (wait_count.h: the count never
  // carries into the flag, however long the wait).
  WaitCount n;
  // When this wait's first slow check ran (globaltimer), with a timeout set; 0 before.
  uint64_t since = 0;
  // The next call of stop() runs the slow checks (abort words, time limit): the caller may look
  // for a foreign LL line first.
  __device__ __forceinline__ bool slow_next() const { return n.slow_next(); }
  // At a slow check: whether a foreign LL line was seen now (`seen`) and at the previous slow
  // check too, 128 polls earlier. A torn read (a new first half beside an old second half, which
  // can pass ll_foreign when the epoch is a multiple of 2^24) does not last that long; a peer
  // running another collective does.
  __device__ __forceinline__ bool confirm_foreign(bool seen) { return n.confirm_foreign(seen); }
  __device__ __forceinline__ bool stop(const FcCollParams& p, Ctx& c, uint32_t peer) {
    if (c.dead) return true;
    if (!n.tick()) return false;
    if (ld_volatile_u32(arena_local(p) + FC_HDR_ABORT_REQ) != 0) {
      give_up(p, c, FC_STATUS_PEER_ABORTED, peer, 0);
      return true;
    }
    if (n.every_4096() && ld_volatile_u32(reinterpret_cast<const void*>(p.abort_flag)) != 0) {
      give_up(p, c, FC_STATUS_ABORTED, peer, 0);
      return true;
    }
    // timeout_ns == 0: no time limit (NCCL's behaviour: wait until the work completes or the
    // application aborts), and no clock read. Otherwise this wait's own time is measured (no sum
    // to overflow: the limit is compared with a difference of two clock reads).
    if (p.timeout_ns != 0) {
      const uint64_t now = globaltimer_ns();
      if (since == 0) {
        since = now;
      } else if (now - since > p.timeout_ns) {
        give_up(p, c, FC_STATUS_TIMEOUT, peer, 0);
        return true;
      }
    }
    return false;
  }
};

// ---- LL lines ----

__device__ __forceinline__ void ll_store(char* line, uint2 d, const Ctx& c) {
  st_volatile_v4(line, make_uint4(d.x, c.ll0, d.y, c.ll1));
}

__device__ __forceinline__ bool ll_ready(const uint4& v, const Ctx& c) { return v.y == c.ll0 && v.w == c.ll1; }

// A consumed line is cleared only when its sub-slot carries another round of this call (c.reuse),
// whose lines bear the same tags.
__device__ __forceinline__ void ll_clear(char* line) { st_volatile_v4(line, make_uint4(0, 0, 0, 0)); }

// A line of this call's epoch that carries another signature (see the header): 0 when it is not
// one, else the frame tag of this call with the peer's signature (what a mismatch reports).
// Called only on the slow path of a wait, and judged with Waiter::confirm_foreign.
__device__ __forceinline__ uint32_t ll_foreign(const uint4& v, const Ctx& c) {
  if (v.y != c.ll0 || ((v.w ^ v.y) & 0x00ffffffu) != 0 || v.w == c.ll1) return 0;
  return tag_of(c.seq, (v.w ^ v.y) >> 24);
}

// ---- BLOCK frames ----

__device__ __forceinline__ uint32_t* frame_tag(char* frame) { return reinterpret_cast<uint32_t*>(frame); }
__device__ __forceinline__ char* frame_payload(char* frame) { return frame + FC_FRAME_HEADER; }

// Lane 0 publishes a frame after the warp's payload stores: fence, then the tag.
__device__ __forceinline__ void frame_publish(char* frame, uint32_t tag) {
  fence_sys();
  st_relaxed_sys_u32(frame_tag(frame), tag);
}

// Waits until the frame's tag equals `tag`. Returns false if the thread gave up.
__device__ __forceinline__ bool frame_wait(const FcCollParams& p, Ctx& c, char* frame, uint32_t peer) {
  Waiter w;
  while (true) {
    uint32_t t = ld_acquire_sys_u32(frame_tag(frame));
    if (t == c.tag) return true;
    if (t != 0) {
      give_up(p, c, FC_STATUS_MISMATCH, peer, t);
      return false;
    }
    if (w.stop(p, c, peer)) return false;
  }
}

// ---- user memory, any alignment ----

// Loads `n` (<= 16) bytes at `src` into a 16-byte vector, zero-filling the rest.
__device__ __forceinline__ uint4 load_bytes16(const char* src, uint32_t n) {
  if (n == 16 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) return *reinterpret_cast<const uint4*>(src);
  uint4 v = make_uint4(0, 0, 0, 0);
  unsigned char* b = reinterpret_cast<unsigned char*>(&v);
  if ((reinterpret_cast<uintptr_t>(src) & 1) == 0 && (n & 1) == 0) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint16_t* d = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i)
      if (2 * i < n) d[i] = s[i];
  } else {
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i)
      if (i < n) b[i] = src[i];
  }
  return v;
}

__device__ __forceinline__ void store_bytes16(char* dst, uint4 v, uint32_t n) {
  if (n == 16 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = v;
    return;
  }
  if ((reinterpret_cast<uintptr_t>(dst) & 1) == 0 && (n & 1) == 0) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(&v);
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i)
      if (2 * i < n) d[i] = s[i];
  } else {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i)
      if (i < n) dst[i] = b[i];
  }
}

__device__ __forceinline__ uint2 load_bytes8(const char* src, uint32_t n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(src) & 7) == 0) return *reinterpret_cast<const uint2*>(src);
  uint4 v = load_bytes16(src, n);
  return make_uint2(v.x, v.y);
}

__device__ __forceinline__ void store_bytes8(char* dst, uint2 v, uint32_t n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst) = v;
    return;
  }
  store_bytes16(dst, make_uint4(v.x, v.y, 0, 0), n);
}

}  // namespace fc
