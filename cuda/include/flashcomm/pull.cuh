// The PULL protocol (docs/protocols.md, "PULL: flags per block, loads from the peers"): every rank
// makes its data readable, says so with one flag line per (peer, block, stage), and every rank
// LOADS what it needs from its peers, instead of every rank storing into its peers' arenas.
//
// * Where the data lives. `FC_PROTO_PULL` (staged): each rank copies its input into the pull area
//   of its own arena (a local copy), and peers load from there; the reduced shard of two-shot is
//   written there too. `FC_PROTO_DIRECT` (ranks of one process on one device, where every device
//   pointer of a rank is a valid pointer of its peers): peers load straight from the user's send
//   buffer, and two-shot owners store the reduced shard straight into every rank's receive
//   buffer. A rank publishes to each peer q the address q's process sees its buffer at
//   (`send_view[q]`, `recv_view[q]`: the buffer itself for a rank of the same process, a mapping
//   of a registered buffer for a rank of another process). A rank whose send buffer peers cannot
//   read in place (not 16-byte aligned, a one-shot call in place, a peer of another process
//   without a mapping of it) stages its input instead (FLAG_PULL_STAGE_SEND), and a rank whose
//   receive buffer some peer cannot store into copies the reduced shards from their owners'
//   staging areas (FLAG_PULL_STAGE_RECV): both rank-local, they change only what the rank
//   publishes (kPullStaged), not the protocol its peers run.
// * Readiness. A flag line is an LL line {addr_lo, ll0, addr_hi, ll1} in the READER's arena
//   (pull flag area, slot [parity][stage][block][source]): the two 8-byte halves each carry the
//   call's 32-bit epoch tag, so a line is complete when both tags match, and the payload is the
//   address the source's data of this stage has in this process (direct), kPullStaged plus an
//   offset (direct, staged: the data is in the source's pull area, which the reader has mapped),
//   or 0 (PULL: the reader knows where a peer's pull area is). Data the source's kernel wrote (staging, reduced
//   shards): the source's block synchronizes (bar.sync), its threads 0..N-1 issue a
//   system-scope fence and store the lines, one per peer (a release), with bit 63 of the address
//   set; the reader's thread s polls source s's line with volatile loads and, seeing bit 63,
//   reads the line once more with an acquiring load (an acquire). Data written before the kernel (the user's send
//   buffer) and "done" lines need no fence on either side. The block synchronizes, and the data
//   is read through L2 (ld.global.cg).
// * Reuse without a barrier. Staged: the pull area and the flag slots have two halves by call
//   parity (seq & 1), like the push arena: a rank writes half h again at call e + 2 only after
//   it received data of call e + 1 from every peer, sent after that peer finished call e. Direct:
//   the user's buffers are reused by the application as soon as the kernel ends, so every block
//   ends with one more flag exchange: it returns only when every peer's block has finished with
//   this rank's buffers ("done", one-shot; "written", two-shot).
// * Every wait is bounded and checks the abort words (Waiter), like every other wait; a block in
//   which any thread gave up skips its data phase and finishes, so the kernel always ends.
// * Results are summed in rank order in f32 (Acc): bitwise identical on every rank.
#pragma once
#include <stdint.h>

#include "flashcomm/params.h"
#include "flashcomm/reduce.cuh"
#include "flashcomm/transport.cuh"

namespace fc {

// Bit 63 of a flag line's address: the data it announces was written by the source's kernel.
constexpr uint64_t kPullFenced = 1ull << 63;
// Bit 62 of an address a direct rank publishes: its data is staged in its own pull area, at the
// offset in the low bits (the source's own address of it means nothing in a peer's process).
constexpr uint64_t kPullStaged = 1ull << 62;

// The flag line of (half, stage, block, src) in `owner`'s arena.
__device__ __forceinline__ char* pull_flag(const FcCollParams& p, uint32_t owner, uint32_t half, uint32_t stage,
                                           uint32_t src) {
  const uint64_t idx = (((uint64_t)half * FC_PULL_STAGES + stage) * FC_PULL_MAX_BLOCKS + blockIdx.x) * FC_MAX_RANKS + src;
  return reinterpret_cast<char*>(p.peer_base[owner]) + p.area_offset + idx * FC_LL_LINE;
}

// `owner`'s staging half `half`, as mapped in this process.
__device__ __forceinline__ char* pull_stage(const FcCollParams& p, uint32_t owner, uint32_t half) {
  return reinterpret_cast<char*>(p.peer_base[owner]) + p.area_offset + FC_PULL_FLAG_BYTES + (uint64_t)half * p.sub_bytes;
}

// Publishes stage `stage` of this block to every peer, carrying `addr + q * stride` to peer q
// (16-byte aligned; 0 when `addr` is 0: the reader knows where the data is). `stride` lets a
// rank point each peer at the piece that peer reads (ReduceScatter, AllToAll); 0 gives every
// peer the same address. `fenced`: the data this stage announces was written by this kernel, so
// the line is a release
// (a system-scope fence before it) and says so in bit 63 of its address (device addresses never
// reach it), which makes the reader acquire. Data written before this kernel started (the user's send buffer) needs neither: the
// previous kernel's completion made it visible, so such a line, and a "done" line (which
// announces no data), are plain stores. Every thread calls it.
// `sync`: the block synchronizes first (whenever its threads did something the line announces:
// wrote data, or finished loading; not for a line that only says where a user buffer is).
__device__ __forceinline__ void pull_publish(const FcCollParams& p, const Ctx& c, uint32_t stage, uint64_t addr,
                                             bool fenced, bool sync = true, uint64_t stride = 0) {
  if (sync) __syncthreads();
  const uint32_t q = threadIdx.x;
  if (q < p.nranks && q != p.rank) {
    if (fenced) fence_sys();
    const uint64_t a = (addr != 0 ? addr + q * stride : 0ull) | (fenced ? kPullFenced : 0ull);
    st_volatile_v4(pull_flag(p, q, c.half, stage, p.rank), make_uint4((uint32_t)a, c.ll0, (uint32_t)(a >> 32), c.ll1));
  }
}

// pull_publish for a direct rank: to peer q, `view[q] + q * stride` (where q's process sees this
// rank's buffer), or with `staged`, kPullStaged plus `q * stride` (the data is in this rank's pull
// area). Fenced (a release) exactly when staged: staged data was written by this kernel, a user
// buffer before it; the block synchronizes first then too.
__device__ __forceinline__ void pull_publish_direct(const FcCollParams& p, const Ctx& c, uint32_t stage,
                                                    const uint64_t* view, bool staged, uint64_t stride = 0) {
  if (staged) __syncthreads();
  const uint32_t q = threadIdx.x;
  if (q < p.nranks && q != p.rank) {
    if (staged) fence_sys();
    const uint64_t a = staged ? (kPullStaged | kPullFenced) + q * stride : view[q] + q * stride;
    st_volatile_v4(pull_flag(p, q, c.half, stage, p.rank), make_uint4((uint32_t)a, c.ll0, (uint32_t)(a >> 32), c.ll1));
  }
}

// Where the data source `s` published (pull_wait's `a`, bit 63 cleared) is in this process.
__device__ __forceinline__ char* pull_src(const FcCollParams& p, uint32_t half, uint32_t s, uint64_t a) {
  return (a & kPullStaged) ? pull_stage(p, s, half) + (a & ~kPullStaged) : reinterpret_cast<char*>(a);
}

// Waits for stage `stage` of this block from every peer; `addr[s]` receives what source s
// published (bit 63 cleared). A line whose bit 63 is set announces data written by the source's
// kernel: the reader acquires it. Every thread calls it; with `agree` (whenever the block goes on
// to use what the peers announced) the block synchronizes on return and agrees on c.dead; the
// last wait of a kernel, after which nothing is read, needs neither.
__device__ __forceinline__ void pull_wait(const FcCollParams& p, Ctx& c, uint32_t stage, uint64_t* addr,
                                          bool agree = true) {
  const uint32_t s = threadIdx.x;
  if (s < p.nranks && s != p.rank && !c.dead) {
    const char* line = pull_flag(p, p.rank, c.half, stage, s);
    Waiter w;
    while (true) {
      const uint4 l = ld_volatile_v4(line);
      if (ll_ready(l, c)) {
        const uint64_t a = (uint64_t)l.z << 32 | l.x;
        // The acquire: one acquiring load of the line's first half (which the source's release
        // ordered after its data), not a fence: each polling thread would fence on its own, and
        // their fences, issued at different times by diverged lanes of one warp, run one after
        // the other.
        if (a & kPullFenced) (void)ld_acquire_sys_u64(line);
        addr[s] = a & ~kPullFenced;
        break;
      }
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
  if (agree && __syncthreads_or(c.dead)) c.dead = true;
}

// Loads `n` (<= 16) bytes of peer-written memory at a 16-byte aligned `src` through L2 (an odd
// `n`, which only the byte-moving collectives have, byte by byte).
__device__ __forceinline__ uint4 ld_cg_bytes(const char* src, uint32_t n) {
  if (n == 16) return __ldcg(reinterpret_cast<const uint4*>(src));
  uint4 v = make_uint4(0, 0, 0, 0);
  if ((n & 1) == 0) {
    uint16_t* d = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) {
      if (2 * i < n) {
        unsigned short x;
        asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(x) : "l"(src + 2 * i) : "memory");
        d[i] = x;
      }
    }
  } else {
    unsigned char* d = reinterpret_cast<unsigned char*>(&v);
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i) {
      if (i < n) {
        uint32_t x;
        asm volatile("ld.global.cg.u8 %0, [%1];" : "=r"(x) : "l"(src + i) : "memory");
        d[i] = (unsigned char)x;
      }
    }
  }
  return v;
}

// Sums `len` bytes at offset `off` of every rank's data in rank order (this rank's from `own`,
// user memory of any alignment; source s's from src[s] + off, 16-byte aligned) and stores the sum
// at offset `off` of every destination in `dst` (`ndst` of them, any alignment). N is the rank
// count, a template argument so that every source's load is issued unconditionally: whole
// 16-byte vectors first (kU per thread in flight, no per-load branch), then the one partial
// vector at the end, if any, by one thread. WIDE: the sum goes to up to N destinations (the
// direct two-shot's broadcast), whose pointers take registers: fewer vectors in flight then.
template <typename T, int N, bool WIDE>
__device__ __forceinline__ void pull_reduce_n(const FcCollParams& p, char* const* src, const char* own, uint64_t off,
                                              uint32_t len, char* const* dst, uint32_t ndst) {
  constexpr int kU = N <= 2 ? 4 : (N <= 4 || !WIDE) ? 2 : 1;  // vectors per thread in flight
  const uint32_t full = len / 16;
  const uint32_t rank = p.rank;
  const bool own_aligned = ((reinterpret_cast<uintptr_t>(own) + off) & 15) == 0;
  auto sum_store = [&](uint4 (&v)[N], uint32_t o, uint32_t n) {
    Acc<T, 4> acc;
    acc.init(reinterpret_cast<const uint32_t*>(&v[0]));
#pragma unroll
    for (int s = 1; s < N; ++s) acc.add(reinterpret_cast<const uint32_t*>(&v[s]));
    uint4 r;
    acc.out(reinterpret_cast<uint32_t*>(&r));
#pragma unroll
    for (int d = 0; d < N; ++d) {
      if (d < (int)ndst) store_bytes16(dst[d] + off + o, r, n);
    }
  };
  for (uint32_t j0 = threadIdx.x; j0 < full; j0 += kU * blockDim.x) {
    uint4 v[kU][N];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t j = j0 + u * blockDim.x;
      if (j < full) {
        const uint32_t o = j * 16;
#pragma unroll
        for (int s = 0; s < N; ++s) {
          if ((uint32_t)s == rank)
            v[u][s] = own_aligned ? *reinterpret_cast<const uint4*>(own + off + o) : load_bytes16(own + off + o, 16);
          else
            v[u][s] = __ldcg(reinterpret_cast<const uint4*>(src[s] + off + o));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t j = j0 + u * blockDim.x;
      if (j < full) sum_store(v[u], j * 16, 16);
    }
  }
  const uint32_t tail = len - full * 16;
  if (tail != 0 && threadIdx.x == 0) {
    const uint32_t o = full * 16;
    uint4 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s)
      v[s] = (uint32_t)s == rank ? load_bytes16(own + off + o, tail) : ld_cg_bytes(src[s] + off + o, tail);
    sum_store(v, o, tail);
  }
}

template <typename T, bool WIDE = false>
__device__ __forceinline__ void pull_reduce(const FcCollParams& p, char* const* src, const char* own, uint64_t off,
                                            uint32_t len, char* const* dst, uint32_t ndst) {
  switch (p.nranks) {
    case 2: pull_reduce_n<T, 2, WIDE>(p, src, own, off, len, dst, ndst); break;
    case 3: pull_reduce_n<T, 3, WIDE>(p, src, own, off, len, dst, ndst); break;
    case 4: pull_reduce_n<T, 4, WIDE>(p, src, own, off, len, dst, ndst); break;
    case 5: pull_reduce_n<T, 5, WIDE>(p, src, own, off, len, dst, ndst); break;
    case 6: pull_reduce_n<T, 6, WIDE>(p, src, own, off, len, dst, ndst); break;
    case 7: pull_reduce_n<T, 7, WIDE>(p, src, own, off, len, dst, ndst); break;
    default: pull_reduce_n<T, 8, WIDE>(p, src, own, off, len, dst, ndst); break;
  }
}

// Copies `len` bytes at offset `off` of peer-written, 16-byte aligned `src` into `out`: whole
// vectors (four per thread in flight), then the partial one, if any, by one thread.
__device__ __forceinline__ void pull_copy(const char* src, uint64_t off, uint32_t len, char* out) {
  constexpr int kU = 4;
  const uint32_t full = len / 16;
  for (uint32_t j0 = threadIdx.x; j0 < full; j0 += kU * blockDim.x) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t j = j0 + u * blockDim.x;
      if (j < full) v[u] = __ldcg(reinterpret_cast<const uint4*>(src + off + j * 16));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t j = j0 + u * blockDim.x;
      if (j < full) store_bytes16(out + off + j * 16, v[u], 16);
    }
  }
  const uint32_t tail = len - full * 16;
  if (tail != 0 && threadIdx.x == 0)
    store_bytes16(out + off + full * 16, ld_cg_bytes(src + off + full * 16, tail), tail);
}

// Copies `len` bytes of user memory at `src + off` to the 16-byte aligned `dst + off`.
__device__ __forceinline__ void pull_stage_copy(const char* src, char* dst, uint64_t off, uint32_t len) {
  for (uint32_t o = threadIdx.x * 16; o < len; o += blockDim.x * 16)
    st_v4(dst + off + o, load_bytes16(src + off + o, min(16u, len - o)));
}

// One-shot: block b takes chunk b of the message (the host cuts the message into one chunk per
// block); it makes its chunk readable, waits for every peer's, sums all N in rank order. Direct
// ends with "done": every peer's block b has finished loading from this rank's send buffer.
template <typename T, bool DIRECT>
__device__ void pull_oneshot(const FcCollParams& p) {
  __shared__ uint64_t addr[FC_MAX_RANKS];
  Ctx c = begin(p);
  const uint64_t bytes = p.count * sizeof(T);
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  const uint64_t off = (uint64_t)blockIdx.x * p.chunk_bytes;
  const uint32_t len = off < bytes ? (uint32_t)min((uint64_t)p.chunk_bytes, bytes - off) : 0u;
  char* mine = pull_stage(p, p.rank, c.half);
  const bool stage = !DIRECT || (p.flags & FC_FLAG_PULL_STAGE_SEND);
  if (stage) pull_stage_copy(in, mine, off, len);
  if (DIRECT)
    pull_publish_direct(p, c, 0, p.send_view, stage);
  else
    pull_publish(p, c, 0, 0ull, true, true);
  pull_wait(p, c, 0, addr);
  trace_mark(p, c.seq, 2);
  if (!c.dead) {
    char* src[FC_MAX_RANKS];
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
      src[s] = s < p.nranks ? (DIRECT ? pull_src(p, c.half, s, addr[s]) : pull_stage(p, s, c.half)) : nullptr;
    pull_reduce<T>(p, src, in, off, len, &out, 1);
  }
  if (DIRECT) {
    pull_publish(p, c, 1, 0, false);
    pull_wait(p, c, 1, addr, false);
  }
  finish(p, c);
}

// Two-shot, staged: block b takes piece b of every shard (the host cuts a shard into one piece
// per block). Reduce-scatter by loads: the owner of shard i sums piece b of shard i from every
// rank's pull area and writes it to its output and to its own pull area; all-gather by loads:
// every rank copies piece b of every other shard from its owner's pull area.
template <typename T>
__device__ void pull_twoshot_staged(const FcCollParams& p) {
  __shared__ uint64_t addr[FC_MAX_RANKS];
  Ctx c = begin(p);
  const uint64_t shard = p.shard_elems * sizeof(T);
  const uint64_t total = p.count * sizeof(T);
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  const uint64_t poff = (uint64_t)blockIdx.x * p.chunk_bytes;
  auto len_of = [&](uint32_t j) -> uint32_t {
    const uint64_t start = (uint64_t)j * shard + poff;
    const uint64_t end = min((uint64_t)j * shard + shard, total);
    return start < end ? (uint32_t)min((uint64_t)p.chunk_bytes, end - start) : 0u;
  };
  char* mine = pull_stage(p, p.rank, c.half);
  for (uint32_t j = 0; j < p.nranks; ++j)
    if (j != p.rank) pull_stage_copy(in, mine, (uint64_t)j * shard + poff, len_of(j));
  pull_publish(p, c, 0, 0, true);
  pull_wait(p, c, 0, addr);
  trace_mark(p, c.seq, 2);
  if (!c.dead) {
    char* src[FC_MAX_RANKS];
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s) src[s] = s < p.nranks ? pull_stage(p, s, c.half) : nullptr;
    char* dst[2] = {out, mine};
    pull_reduce<T>(p, src, in, (uint64_t)p.rank * shard + poff, len_of(p.rank), dst, 2);
  }
  pull_publish(p, c, 1, 0, true);
  pull_wait(p, c, 1, addr);
  if (!c.dead) {
    for (uint32_t j = 0; j < p.nranks; ++j)
      if (j != p.rank) pull_copy(pull_stage(p, j, c.half), (uint64_t)j * shard + poff, len_of(j), out);
  }
  finish(p, c);
}

// Two-shot, direct: reduce by loads, broadcast by stores. Every rank publishes where its send
// and receive buffers are (stage 0 and stage 2, plain lines: the data was written before the
// kernel); the owner of shard i loads piece b of shard i from every rank's send buffer, sums in
// rank order and stores the sum straight into every rank's receive buffer; then it tells every
// rank so (stage 1, a release). A block returns once every owner has written its piece b here,
// which each did after loading this rank's piece b of its shard: nothing reads or writes this
// rank's buffers after its kernel ends. In place is safe: owner j writes shard j of this rank's
// buffer after it alone has read it, and the other owners read other shards. Each byte is loaded
// once and stored once per rank: about 2 N S bytes of traffic for a message of S bytes.
template <typename T>
__device__ void pull_twoshot_direct(const FcCollParams& p) {
  __shared__ uint64_t sends[FC_MAX_RANKS];
  __shared__ uint64_t recvs[FC_MAX_RANKS];
  Ctx c = begin(p);
  const uint64_t shard = p.shard_elems * sizeof(T);
  const uint64_t total = p.count * sizeof(T);
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  const uint64_t poff = (uint64_t)blockIdx.x * p.chunk_bytes;
  auto len_of = [&](uint32_t j) -> uint32_t {
    const uint64_t start = (uint64_t)j * shard + poff;
    const uint64_t end = min((uint64_t)j * shard + shard, total);
    return start < end ? (uint32_t)min((uint64_t)p.chunk_bytes, end - start) : 0u;
  };
  char* mine = pull_stage(p, p.rank, c.half);
  const bool stage_in = (p.flags & FC_FLAG_PULL_STAGE_SEND) != 0;
  const bool stage_out = (p.flags & FC_FLAG_PULL_STAGE_RECV) != 0;
  if (stage_in) {
    for (uint32_t j = 0; j < p.nranks; ++j)
      if (j != p.rank) pull_stage_copy(in, mine, (uint64_t)j * shard + poff, len_of(j));
  }
  pull_publish_direct(p, c, 0, p.send_view, stage_in);
  // The receive buffer: where peers store (written before this kernel: a plain line, no sync),
  // or, staged, "copy from the owners' staging areas" (announces nothing written yet).
  {
    const uint32_t q = threadIdx.x;
    if (q < p.nranks && q != p.rank) {
      const uint64_t a = stage_out ? kPullStaged : p.recv_view[q];
      st_volatile_v4(pull_flag(p, q, c.half, 2, p.rank), make_uint4((uint32_t)a, c.ll0, (uint32_t)(a >> 32), c.ll1));
    }
  }
  pull_wait(p, c, 0, sends);
  pull_wait(p, c, 2, recvs);
  trace_mark(p, c.seq, 2);
  if (!c.dead) {
    char* src[FC_MAX_RANKS];
    char* dst[FC_MAX_RANKS];
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s) {
      src[s] = s < p.nranks ? pull_src(p, c.half, s, sends[s]) : nullptr;
      // A rank that copies from the owners' staging areas gets this owner's sum in its own
      // staging half, at the shard's place (free: a rank stages only the other shards).
      dst[s] = s >= p.nranks ? nullptr : s == p.rank ? out : (recvs[s] & kPullStaged) ? mine : reinterpret_cast<char*>(recvs[s]);
    }
    pull_reduce<T, true>(p, src, in, (uint64_t)p.rank * shard + poff, len_of(p.rank), dst, p.nranks);
  }
  pull_publish(p, c, 1, 0, true);
  pull_wait(p, c, 1, sends, stage_out);
  if (stage_out && !c.dead) {
    for (uint32_t j = 0; j < p.nranks; ++j)
      if (j != p.rank) pull_copy(pull_stage(p, j, c.half), (uint64_t)j * shard + poff, len_of(j), out);
  }
  finish(p, c);
}

template <typename T, bool DIRECT>
__device__ void pull_twoshot(const FcCollParams& p) {
  if constexpr (DIRECT)
    pull_twoshot_direct<T>(p);
  else
    pull_twoshot_staged<T>(p);
}

// The byte-moving and reducing collectives besides AllReduce, by loads.
constexpr int kPullAllGather = 0;
constexpr int kPullReduceScatter = 1;
constexpr int kPullAllToAll = 2;

// AllGather, ReduceScatter and AllToAll by loads, in one pass: every rank's data is cut into N
// pieces of `piece` bytes (AllGather: one piece, read by every peer; ReduceScatter: piece j is
// what rank j sums; AllToAll: piece j goes to rank j), and block b takes chunk b of every piece
// (the host cuts a piece into one chunk per block). A rank makes its pieces readable (staged: a
// copy into its pull area, piece j at j * pstride, pstride = piece rounded up to 16 bytes;
// direct: its send buffer in place) and publishes, to each peer q, the address of the piece q
// reads (stage 0); then every rank loads its piece from every peer: AllGather and AllToAll copy
// it to block s of the output, ReduceScatter sums the N pieces in rank order (f32, bitwise
// identical on every rank). Direct ends with "done" (stage 1), as the one-shot AllReduce does:
// no peer reads this rank's send buffer after its kernel ends. In place: AllGather (the send
// buffer is block `rank` of the output) and ReduceScatter (the output is piece `rank` of the
// send buffer) write only what no peer reads, and a thread reads its own element before it
// writes it; an AllToAll in place, or any other overlap, is staged (the host's
// FLAG_PULL_STAGE_SEND, rank-local).
template <int KIND, typename T, bool DIRECT>
__device__ void pull_move(const FcCollParams& p) {
  __shared__ uint64_t addr[FC_MAX_RANKS];
  Ctx c = begin(p);
  constexpr bool kOne = KIND == kPullAllGather;
  const uint64_t piece = p.count * p.elem_bytes;
  const uint64_t pstride = (piece + 15) & ~15ull;
  const char* in = reinterpret_cast<const char*>(p.send);
  char* out = reinterpret_cast<char*>(p.recv);
  const uint64_t off = (uint64_t)blockIdx.x * p.chunk_bytes;
  const uint32_t len = off < piece ? (uint32_t)min((uint64_t)p.chunk_bytes, piece - off) : 0u;
  char* mine = pull_stage(p, p.rank, c.half);
  const bool stage = !DIRECT || (p.flags & FC_FLAG_PULL_STAGE_SEND);
  if (stage) {
    if (kOne) {
      pull_stage_copy(in, mine, off, len);
    } else {
      for (uint32_t j = 0; j < p.nranks; ++j)
        if (j != p.rank) pull_stage_copy(in + (uint64_t)j * piece, mine + (uint64_t)j * pstride, off, len);
    }
  }
  // Peer q loads piece q: from this rank's send buffer as q sees it (direct) or from this rank's
  // pull area (staged; PULL's line carries no address, the reader knows the place).
  const uint64_t stride = kOne ? 0ull : stage ? pstride : piece;
  if (DIRECT)
    pull_publish_direct(p, c, 0, p.send_view, stage, stride);
  else
    pull_publish(p, c, 0, 0ull, true, true);
  pull_wait(p, c, 0, addr);
  if (!c.dead) {
    char* src[FC_MAX_RANKS];
#pragma unroll
    for (uint32_t s = 0; s < FC_MAX_RANKS; ++s)
      src[s] = s >= p.nranks ? nullptr
               : DIRECT     ? pull_src(p, c.half, s, addr[s])
                            : pull_stage(p, s, c.half) + (kOne ? 0ull : (uint64_t)p.rank * pstride);
    if constexpr (KIND == kPullReduceScatter) {
      pull_reduce<T>(p, src, in + (uint64_t)p.rank * piece, off, len, &out, 1);
    } else {
      const char* own = kOne ? in : in + (uint64_t)p.rank * piece;
      char* own_out = out + (uint64_t)p.rank * piece;
      if (own != own_out) {
        for (uint32_t o = threadIdx.x * 16; o < len; o += blockDim.x * 16)
          store_bytes16(own_out + off + o, load_bytes16(own + off + o, min(16u, len - o)), min(16u, len - o));
      }
      for (uint32_t s = 0; s < p.nranks; ++s)
        if (s != p.rank) pull_copy(src[s], off, len, out + (uint64_t)s * piece);
    }
  }
  if (DIRECT) {
    pull_publish(p, c, 1, 0, false);
    pull_wait(p, c, 1, addr, false);
  }
  finish(p, c);
}

}  // namespace fc
