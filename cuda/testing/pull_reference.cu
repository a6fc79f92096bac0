// The pull reference AllReduce of the benchmark (flashcomm-perf --impl pull-reference): the
// "pull" design of the custom all-reduce kernels that vLLM and SGLang ship, measured beside
// flashcomm as a competitor. A clean-room implementation, written from a description of the
// design, not from either project's code.
//
// * Zero copy: every rank's input is read by its peers where it lies. The buffers a call may use
//   are registered at set-up (every rank knows every peer's address of the same buffer; a call
//   passes every rank's address of its input at the same offset), as under CUDA graphs in vLLM.
// * Readiness by flags, not data: each rank owns a signal area in device memory. A block signals
//   barrier k by storing its epoch into slot [parity][k][block][own rank] of every rank's area
//   (thread q stores to rank q after __syncthreads), and waits until slot [parity][k][block][q]
//   of its own area holds the epoch (thread q), then __syncthreads. Only the 2-stage's middle
//   barrier orders data written in the call (the scratch): its flag is st.release.sys and its
//   read ld.acquire.sys, so every write the block made before is visible to whoever acquires it.
//   The start barrier (the inputs were written before the kernel) and the end barriers (which
//   only say "done reading") use volatile flags, as the serving stacks' kernels do. Peers' data is then loaded through L2 (ld.global.cg: L1 is not coherent with
//   peers' writes).
// * 1-stage: start barrier; every rank loads all N inputs at its elements (16-byte vectors), sums
//   them in rank order in f32 (acc = x_0, acc += x_s for s = 1..N-1; f16 and bf16 rounded once at
//   the end), writes its output; end barrier, so that no rank returns (and lets the application
//   overwrite its input) while a peer may still be loading it.
// * 2-stage: start barrier; reduce-scatter by loads (rank r sums shard r of all N inputs in rank
//   order into its scratch buffer, which the peers can read); middle barrier (after the scratch
//   writes); all-gather by loads (rank r copies shard s from rank s's scratch, its own from its
//   own scratch, into its output); end barrier. Shards hold count / N elements rounded up to 16
//   bytes (flashcomm's two-shot rule); the last non-empty shard may be shorter, later ones empty.
//   Every element is summed once, by its shard's owner, and copied: all ranks' results are
//   bitwise identical, as with 1-stage, where every rank sums in the same order.
//
// Barriers are per block: block b of a rank meets block b of every peer only. That suffices
// because a thread handles the same 16-byte vectors in every phase of a call and on every rank
// (vector j of a range belongs to thread j mod (blocks * THREADS), in block (j / THREADS) mod
// blocks), so whatever block b of a rank reads after a barrier was written, or is still read, by
// block b of its peers alone; and a rank's kernel ends only after each of its blocks passed the
// end barrier with the same block of every peer, that is after every peer's every block finished
// reading.
//
// Epochs: one u32 per rank and block in device memory, incremented by every call the block takes
// part in (calls of few elements use fewer blocks; every rank uses the same number), so a CUDA
// graph of calls replays correctly. Call e stores the value e into slots of parity e & 1 (one
// slot per barrier of a call). Why two parities suffice: block b of rank r stores call e+2's
// flags only after it passed call e+1's start barrier, that is after block b of every peer stored
// its call-e+1 start flag, which that peer's kernel did after the whole of its call e had ended
// (kernels of one stream run in order; one grid of every rank likewise), every read of call e's
// flags included. Epochs only grow, so a stale flag never matches.
//
// Launch: per rank, on the rank's stream (grid = blocks, rank = p.rank), or every rank in one
// grid launched by one thread (p.single: grid = N * blocks, rank-major: rank = blockIdx.x /
// blocks), which shows what launching per rank costs. Either way every block of every rank must
// be resident at once (on one GPU: N * blocks <= SMs; the host derives the blocks from the SM
// count), or the barriers wait for blocks that cannot start.
//
// Every wait is bounded: a deadline on %globaltimer; a thread that gives up raises its rank's
// failure flag (in one grid: the launcher's), which makes every other waiting thread of that rank
// stop too. The results are then wrong, and the host reports the timeout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FC_PULL_MAX_RANKS 8
#define FC_PULL_MAX_BLOCKS 36
#define FC_PULL_THREADS 512
#define FC_PULL_BARRIERS 3

struct FcPullParams {
  uint64_t in[FC_PULL_MAX_RANKS];       // every rank's input of this call
  uint64_t out[FC_PULL_MAX_RANKS];      // every rank's output (per-rank launch: out[rank] only)
  uint64_t scratch[FC_PULL_MAX_RANKS];  // every rank's scratch (2-stage: one shard)
  uint64_t signal[FC_PULL_MAX_RANKS];   // every rank's signal area
  uint64_t epochs[FC_PULL_MAX_RANKS];   // every rank's u32[FC_PULL_MAX_BLOCKS] (per rank: [rank] only)
  uint64_t fail[FC_PULL_MAX_RANKS];     // the u32 failure flag each rank's blocks raise
  uint64_t count;                       // elements
  uint64_t shard;                       // 2-stage: elements per shard (a multiple of 16 bytes)
  uint64_t timeout_ns;                  // bound on every wait
  uint32_t rank;                        // per-rank launch: this rank
  uint32_t nranks;
  uint32_t blocks;                      // blocks per rank
  uint32_t single;                      // 1: one grid of nranks * blocks blocks
};
static_assert(sizeof(FcPullParams) == 424, "FcPullParams layout");

__device__ __forceinline__ uint64_t fc_pull_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void fc_pull_st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t fc_pull_ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fc_pull_st_volatile(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t fc_pull_ld_volatile(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The element types: 16-byte vectors to f32 values and back (f16 and bf16 rounded to nearest
// even, once).
template <int DT>
struct FcPullType;

template <>
struct FcPullType<0> {  // f32
  static constexpr int kPer = 4;
  typedef unsigned int Bits;
  __device__ static __forceinline__ void unpack(uint4 v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ static __forceinline__ uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

template <>
struct FcPullType<1> {  // f16
  static constexpr int kPer = 8;
  typedef unsigned short Bits;
  __device__ static __forceinline__ void unpack(uint4 v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
  }
  __device__ static __forceinline__ uint4 pack(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = (uint32_t)__half_as_ushort(__float2half_rn(f[2 * i])) |
             ((uint32_t)__half_as_ushort(__float2half_rn(f[2 * i + 1])) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct FcPullType<2> {  // bf16
  static constexpr int kPer = 8;
  typedef unsigned short Bits;
  __device__ static __forceinline__ void unpack(uint4 v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static __forceinline__ uint4 pack(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i])) |
             ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i + 1])) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// The sum of N vectors in rank order, in f32.
template <int DT, int N>
__device__ __forceinline__ uint4 fc_pull_sum(const uint4* v) {
  typedef FcPullType<DT> Ty;
  float acc[Ty::kPer];
  Ty::unpack(v[0], acc);
#pragma unroll
  for (int s = 1; s < N; ++s) {
    float x[Ty::kPer];
    Ty::unpack(v[s], x);
#pragma unroll
    for (int i = 0; i < Ty::kPer; ++i) acc[i] = __fadd_rn(acc[i], x[i]);
  }
  return Ty::pack(acc);
}

// The first n (< kPer) elements of a vector, through L2; the rest zero.
template <int DT>
__device__ __forceinline__ uint4 fc_pull_load_part(const void* p, uint32_t n) {
  typedef typename FcPullType<DT>::Bits Bits;
  union {
    uint4 v;
    Bits b[FcPullType<DT>::kPer];
  } u;
  u.v = make_uint4(0, 0, 0, 0);
  for (uint32_t i = 0; i < n; ++i) u.b[i] = __ldcg(reinterpret_cast<const Bits*>(p) + i);
  return u.v;
}

template <int DT>
__device__ __forceinline__ void fc_pull_store_part(void* p, uint4 v, uint32_t n) {
  typedef typename FcPullType<DT>::Bits Bits;
  union {
    uint4 v;
    Bits b[FcPullType<DT>::kPer];
  } u;
  u.v = v;
  for (uint32_t i = 0; i < n; ++i) reinterpret_cast<Bits*>(p)[i] = u.b[i];
}

// One block's view of the call.
struct FcPullSync {
  volatile uint32_t* fail;
  uint64_t deadline;
  uint32_t epoch;
  uint32_t rank;
  uint32_t block;
  bool dead;  // this thread gave up waiting (then it waits no more)
};

__device__ __forceinline__ uint64_t fc_pull_slot(uint32_t parity, uint32_t k, uint32_t block, uint32_t src) {
  return (((uint64_t)parity * FC_PULL_BARRIERS + k) * FC_PULL_MAX_BLOCKS + block) * FC_PULL_MAX_RANKS + src;
}

// Barrier k of this call for block s.block: thread q (q < nranks) signals rank q and waits for
// rank q's signal. FENCED: the block wrote data in this call that peers read after the barrier
// (the 2-stage's scratch), so the flag is a release and its read an acquire; otherwise (the data
// was written before the kernel, or the barrier only says "done reading") plain volatile flags
// suffice, as in the serving stacks' kernels.
template <bool FENCED>
__device__ __forceinline__ void fc_pull_barrier(const FcPullParams& p, FcPullSync& s, uint32_t k) {
  __syncthreads();
  if (threadIdx.x < p.nranks) {
    const uint32_t q = threadIdx.x;
    const uint32_t parity = s.epoch & 1u;
    uint32_t* to = reinterpret_cast<uint32_t*>(p.signal[q]) + fc_pull_slot(parity, k, s.block, s.rank);
    if (FENCED)
      fc_pull_st_release_sys(to, s.epoch);
    else
      fc_pull_st_volatile(to, s.epoch);
    const uint32_t* from = reinterpret_cast<const uint32_t*>(p.signal[s.rank]) + fc_pull_slot(parity, k, s.block, q);
    uint32_t spins = 0;
    while (!s.dead && (FENCED ? fc_pull_ld_acquire_sys(from) : fc_pull_ld_volatile(from)) != s.epoch) {
      if ((++spins & 1023u) == 0 && (*s.fail != 0 || fc_pull_now() > s.deadline)) {
        *s.fail = 1u;
        s.dead = true;
      }
    }
  }
  __syncthreads();
}

// Vectors of a range of len elements: full ones, and one partial vector of len % kPer elements.
template <int DT>
struct FcPullRange {
  uint64_t full;
  uint64_t vecs;
  uint32_t tail;
  __device__ __forceinline__ explicit FcPullRange(uint64_t len) {
    full = len / FcPullType<DT>::kPer;
    tail = (uint32_t)(len % FcPullType<DT>::kPer);
    vecs = full + (tail != 0 ? 1 : 0);
  }
};

template <int DT, int N>
__device__ __forceinline__ void fc_pull_1stage(const FcPullParams& p, FcPullSync& s) {
  typedef typename FcPullType<DT>::Bits Bits;
  constexpr int kPer = FcPullType<DT>::kPer;
  const FcPullRange<DT> range(p.count);
  const uint64_t stride = (uint64_t)p.blocks * blockDim.x;
  const uint64_t first = (uint64_t)s.block * blockDim.x + threadIdx.x;
  char* out = reinterpret_cast<char*>(p.out[s.rank]);
  fc_pull_barrier<false>(p, s, 0);
  for (uint64_t j = first; j < range.vecs; j += stride) {
    uint4 v[N];
    if (j < range.full) {
#pragma unroll
      for (int q = 0; q < N; ++q) v[q] = __ldcg(reinterpret_cast<const uint4*>(p.in[q]) + j);
      reinterpret_cast<uint4*>(out)[j] = fc_pull_sum<DT, N>(v);
    } else {
#pragma unroll
      for (int q = 0; q < N; ++q) {
        v[q] = fc_pull_load_part<DT>(reinterpret_cast<const Bits*>(p.in[q]) + j * kPer, range.tail);
      }
      fc_pull_store_part<DT>(reinterpret_cast<Bits*>(out) + j * kPer, fc_pull_sum<DT, N>(v), range.tail);
    }
  }
  fc_pull_barrier<false>(p, s, 1);
}

// Elements of shard q: [min(count, q * shard), min(count, (q + 1) * shard)).
__device__ __forceinline__ uint64_t fc_pull_shard_lo(const FcPullParams& p, uint32_t q) {
  return min(p.count, (uint64_t)q * p.shard);
}

__device__ __forceinline__ uint64_t fc_pull_shard_len(const FcPullParams& p, uint32_t q) {
  const uint64_t lo = fc_pull_shard_lo(p, q);
  return min(p.count, lo + p.shard) - lo;
}

template <int DT, int N>
__device__ __forceinline__ void fc_pull_2stage(const FcPullParams& p, FcPullSync& s) {
  typedef typename FcPullType<DT>::Bits Bits;
  constexpr int kPer = FcPullType<DT>::kPer;
  const uint64_t stride = (uint64_t)p.blocks * blockDim.x;
  const uint64_t first = (uint64_t)s.block * blockDim.x + threadIdx.x;
  fc_pull_barrier<false>(p, s, 0);
  // Reduce-scatter: shard `rank` of every input, summed in rank order, into this rank's scratch
  // (whole vectors: a shard's bytes are a multiple of 16 and the scratch holds a whole shard).
  {
    const uint64_t lo = fc_pull_shard_lo(p, s.rank);
    const FcPullRange<DT> range(fc_pull_shard_len(p, s.rank));
    uint4* scratch = reinterpret_cast<uint4*>(p.scratch[s.rank]);
    for (uint64_t j = first; j < range.vecs; j += stride) {
      uint4 v[N];
      if (j < range.full) {
#pragma unroll
        for (int q = 0; q < N; ++q) {
          v[q] = __ldcg(reinterpret_cast<const uint4*>(reinterpret_cast<const Bits*>(p.in[q]) + lo) + j);
        }
      } else {
#pragma unroll
        for (int q = 0; q < N; ++q) {
          v[q] = fc_pull_load_part<DT>(reinterpret_cast<const Bits*>(p.in[q]) + lo + j * kPer, range.tail);
        }
      }
      __stcg(scratch + j, fc_pull_sum<DT, N>(v));
    }
  }
  fc_pull_barrier<true>(p, s, 1);
  // All-gather: shard q from rank q's scratch, every shard's vector j loaded before any is
  // stored. Shard 0 is the longest.
  {
    char* out = reinterpret_cast<char*>(p.out[s.rank]);
    uint64_t full[N], vecs[N];
    uint32_t tail[N];
#pragma unroll
    for (int q = 0; q < N; ++q) {
      const FcPullRange<DT> range(fc_pull_shard_len(p, q));
      full[q] = range.full;
      vecs[q] = range.vecs;
      tail[q] = range.tail;
    }
    for (uint64_t j = first; j < vecs[0]; j += stride) {
      uint4 v[N];
#pragma unroll
      for (int q = 0; q < N; ++q) {
        v[q] = j < vecs[q] ? __ldcg(reinterpret_cast<const uint4*>(p.scratch[q]) + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int q = 0; q < N; ++q) {
        Bits* dst = reinterpret_cast<Bits*>(out) + fc_pull_shard_lo(p, q);
        if (j < full[q]) {
          reinterpret_cast<uint4*>(dst)[j] = v[q];
        } else if (j < vecs[q]) {
          fc_pull_store_part<DT>(dst + j * kPer, v[q], tail[q]);
        }
      }
    }
  }
  fc_pull_barrier<false>(p, s, 2);
}

template <int DT, int STAGES, int N>
__device__ __forceinline__ void fc_pull_run(const FcPullParams& p, FcPullSync& s) {
  if (STAGES == 1) {
    fc_pull_1stage<DT, N>(p, s);
  } else {
    fc_pull_2stage<DT, N>(p, s);
  }
}

template <int DT, int STAGES>
__device__ __forceinline__ void fc_pull_main(const FcPullParams& p) {
  __shared__ uint32_t epoch_s;
  const uint32_t rank = p.single ? blockIdx.x / p.blocks : p.rank;
  const uint32_t block = p.single ? blockIdx.x % p.blocks : blockIdx.x;
  volatile uint32_t* epochs = reinterpret_cast<volatile uint32_t*>(p.epochs[rank]);
  if (threadIdx.x == 0) epoch_s = epochs[block] + 1u;
  __syncthreads();
  FcPullSync s;
  s.fail = reinterpret_cast<volatile uint32_t*>(p.fail[rank]);
  s.deadline = fc_pull_now() + p.timeout_ns;
  s.epoch = epoch_s;
  s.rank = rank;
  s.block = block;
  s.dead = false;
  // The rank count as a template argument: every peer's loads of a vector issued together.
  switch (p.nranks) {
    case 1: fc_pull_run<DT, STAGES, 1>(p, s); break;
    case 2: fc_pull_run<DT, STAGES, 2>(p, s); break;
    case 3: fc_pull_run<DT, STAGES, 3>(p, s); break;
    case 4: fc_pull_run<DT, STAGES, 4>(p, s); break;
    case 5: fc_pull_run<DT, STAGES, 5>(p, s); break;
    case 6: fc_pull_run<DT, STAGES, 6>(p, s); break;
    case 7: fc_pull_run<DT, STAGES, 7>(p, s); break;
    default: fc_pull_run<DT, STAGES, 8>(p, s); break;
  }
  // The last barrier ended with __syncthreads: every thread of the block is done.
  if (threadIdx.x == 0) epochs[block] = s.epoch;
}

#define FC_PULL_KERNEL(name, dt, stages)                                                              \
  extern "C" __global__ void __launch_bounds__(FC_PULL_THREADS, 1) name(const __grid_constant__ FcPullParams p) { \
    fc_pull_main<dt, stages>(p);                                                                      \
  }

FC_PULL_KERNEL(fc_test_pull_1stage_f32, 0, 1)
FC_PULL_KERNEL(fc_test_pull_1stage_f16, 1, 1)
FC_PULL_KERNEL(fc_test_pull_1stage_bf16, 2, 1)
FC_PULL_KERNEL(fc_test_pull_2stage_f32, 0, 2)
FC_PULL_KERNEL(fc_test_pull_2stage_f16, 1, 2)
FC_PULL_KERNEL(fc_test_pull_2stage_bf16, 2, 2)
