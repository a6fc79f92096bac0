// The plain reference AllReduce of the benchmark (flashcomm-perf --impl reference): the yardstick
// that flashcomm's decode-size latency is measured against. It is deliberately plain and must stay
// so (it is not a competitor to tune):
//
// * LL one-shot: every rank pushes its whole message to every rank (itself included) as 16-byte
//   lines {d0, epoch, d1, epoch}, one volatile 16-byte store per line and destination;
// * every rank polls its own inbox line by line (volatile 16-byte loads) until both epoch words
//   of every source's line are the expected epoch, with a bounded wait (a deadline on
//   %globaltimer; a thread that gives up raises a flag that makes every other thread stop too);
// * the sum is fixed-order in f32: acc = x_0, acc += x_s for s = 1..N-1, rounded once;
// * 16 blocks of 256 threads per rank; line l belongs to thread l mod 4096 on every rank.
//
// Epochs live on the device, one word per block (only block b of this rank touches word b), so a
// CUDA graph of calls replays correctly. Call e (e = 1, 2, ...) writes into inbox half e & 1. Why
// two halves suffice: block b of rank i writes call e+2 into rank j's half only after it received
// call e+1 from block b of j, which j sent after its whole call e (kernels of one stream run in
// order), including reading i's lines of call e. Epochs only grow, so a stale line never matches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FC_REF_BLOCKS 16
#define FC_REF_THREADS 256
#define FC_REF_MAX_RANKS 8

struct FcRefParams {
  uint64_t send;                       // this rank's input
  uint64_t recv;                       // this rank's output
  uint64_t bytes;                      // message bytes
  uint64_t inbox[FC_REF_MAX_RANKS];    // every rank's inbox (2 halves of nranks * lines lines)
  uint64_t half_bytes;                 // bytes of one inbox half
  uint64_t epochs;                     // this rank's u32[FC_REF_BLOCKS]
  uint64_t fail;                       // this rank's u32 failure flag (device memory)
  uint64_t timeout_ns;                 // bound on every wait
  uint32_t rank;
  uint32_t nranks;
  uint32_t dtype;                      // 0 f32, 1 f16, 2 bf16
  uint32_t pad;
};
static_assert(sizeof(FcRefParams) == 136, "FcRefParams layout");

__device__ __forceinline__ uint4 fc_ref_ld(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void fc_ref_st(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint64_t fc_ref_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Up to 8 bytes of a line's payload (the last line of a message may be short).
__device__ __forceinline__ uint2 fc_ref_load8(const unsigned char* src, uint32_t n) {
  if (n == 8) return *reinterpret_cast<const uint2*>(src);
  uint2 v = make_uint2(0, 0);
  unsigned char* b = reinterpret_cast<unsigned char*>(&v);
  for (uint32_t i = 0; i < n; ++i) b[i] = src[i];
  return v;
}

__device__ __forceinline__ void fc_ref_store8(unsigned char* dst, uint2 v, uint32_t n) {
  if (n == 8) {
    *reinterpret_cast<uint2*>(dst) = v;
    return;
  }
  const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
  for (uint32_t i = 0; i < n; ++i) dst[i] = b[i];
}

// f32 values of an 8-byte payload (2 f32 or 4 f16/bf16) and back.
__device__ __forceinline__ void fc_ref_unpack(uint32_t dtype, uint2 d, float* v) {
  const uint32_t w[2] = {d.x, d.y};
  for (int i = 0; i < 2; ++i) {
    if (dtype == 0) {
      v[i] = __uint_as_float(w[i]);
    } else if (dtype == 1) {
      v[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
      v[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    } else {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

__device__ __forceinline__ uint2 fc_ref_pack(uint32_t dtype, const float* v) {
  uint32_t w[2];
  for (int i = 0; i < 2; ++i) {
    if (dtype == 0) {
      w[i] = __float_as_uint(v[i]);
    } else if (dtype == 1) {
      w[i] = (uint32_t)__half_as_ushort(__float2half_rn(v[2 * i])) |
             ((uint32_t)__half_as_ushort(__float2half_rn(v[2 * i + 1])) << 16);
    } else {
      w[i] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i])) |
             ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1])) << 16);
    }
  }
  return make_uint2(w[0], w[1]);
}

extern "C" __global__ void __launch_bounds__(FC_REF_THREADS) fc_test_reference_allreduce(const __grid_constant__ FcRefParams p) {
  __shared__ uint32_t epoch_s;
  volatile uint32_t* epochs = reinterpret_cast<volatile uint32_t*>(p.epochs);
  volatile uint32_t* fail = reinterpret_cast<volatile uint32_t*>(p.fail);
  if (threadIdx.x == 0) epoch_s = epochs[blockIdx.x] + 1u;
  __syncthreads();
  const uint32_t e = epoch_s;
  const uint64_t half = (uint64_t)(e & 1u) * p.half_bytes;
  const uint64_t lines = (p.bytes + 7) / 8;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned char* in = reinterpret_cast<const unsigned char*>(p.send);
  unsigned char* out = reinterpret_cast<unsigned char*>(p.recv);
  // Push: line l of this rank goes to slot (rank, l) of every rank's inbox.
  for (uint64_t l = first; l < lines; l += stride) {
    const uint32_t n = (uint32_t)min((uint64_t)8, p.bytes - l * 8);
    const uint2 d = fc_ref_load8(in + l * 8, n);
    for (uint32_t q = 0; q < p.nranks; ++q) {
      char* line = reinterpret_cast<char*>(p.inbox[q]) + half + ((uint64_t)p.rank * lines + l) * 16;
      fc_ref_st(line, make_uint4(d.x, e, d.y, e));
    }
  }
  // Poll and reduce in rank order.
  const uint64_t deadline = fc_ref_now() + p.timeout_ns;
  bool dead = false;
  for (uint64_t l = first; l < lines; l += stride) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (uint32_t s = 0; s < p.nranks; ++s) {
      const char* line = reinterpret_cast<const char*>(p.inbox[p.rank]) + half + ((uint64_t)s * lines + l) * 16;
      uint4 v = fc_ref_ld(line);
      uint32_t spins = 0;
      while (!dead && (v.y != e || v.w != e)) {
        if ((++spins & 1023u) == 0 && (*fail != 0 || fc_ref_now() > deadline)) {
          *fail = 1u;
          dead = true;
          break;
        }
        v = fc_ref_ld(line);
      }
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      fc_ref_unpack(p.dtype, make_uint2(v.x, v.z), x);
      for (int i = 0; i < 4; ++i) acc[i] = s == 0 ? x[i] : __fadd_rn(acc[i], x[i]);
    }
    const uint32_t n = (uint32_t)min((uint64_t)8, p.bytes - l * 8);
    fc_ref_store8(out + l * 8, fc_ref_pack(p.dtype, acc), n);
  }
  __syncthreads();
  if (threadIdx.x == 0) epochs[blockIdx.x] = e;
}

// The same pattern adapted to AllToAll (flashcomm-perf --coll alltoall --impl reference): `bytes`
// is one block (what this rank sends to each rank); line l of block q goes to slot (rank, l) of
// rank q's inbox, and what arrives from rank s is copied, line by line once both epoch words
// match, to block s of the output. Nothing is reduced; the rest (lines, epochs, halves, bounded
// waits, 16 blocks of 256 threads) is the AllReduce's above, written out again on purpose: the
// AllReduce's text is frozen, because factoring the shared steps into helpers changes its SASS
// (register allocation, 8 more instructions with nvcc 13.0) and it is the yardstick every round
// is measured against.
extern "C" __global__ void __launch_bounds__(FC_REF_THREADS) fc_test_reference_alltoall(const __grid_constant__ FcRefParams p) {
  __shared__ uint32_t epoch_s;
  volatile uint32_t* epochs = reinterpret_cast<volatile uint32_t*>(p.epochs);
  volatile uint32_t* fail = reinterpret_cast<volatile uint32_t*>(p.fail);
  if (threadIdx.x == 0) epoch_s = epochs[blockIdx.x] + 1u;
  __syncthreads();
  const uint32_t e = epoch_s;
  const uint64_t half = (uint64_t)(e & 1u) * p.half_bytes;
  const uint64_t lines = (p.bytes + 7) / 8;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned char* in = reinterpret_cast<const unsigned char*>(p.send);
  unsigned char* out = reinterpret_cast<unsigned char*>(p.recv);
  for (uint64_t l = first; l < lines; l += stride) {
    const uint32_t n = (uint32_t)min((uint64_t)8, p.bytes - l * 8);
    for (uint32_t q = 0; q < p.nranks; ++q) {
      const uint2 d = fc_ref_load8(in + (uint64_t)q * p.bytes + l * 8, n);
      char* line = reinterpret_cast<char*>(p.inbox[q]) + half + ((uint64_t)p.rank * lines + l) * 16;
      fc_ref_st(line, make_uint4(d.x, e, d.y, e));
    }
  }
  const uint64_t deadline = fc_ref_now() + p.timeout_ns;
  bool dead = false;
  for (uint64_t l = first; l < lines; l += stride) {
    const uint32_t n = (uint32_t)min((uint64_t)8, p.bytes - l * 8);
    for (uint32_t s = 0; s < p.nranks; ++s) {
      const char* line = reinterpret_cast<const char*>(p.inbox[p.rank]) + half + ((uint64_t)s * lines + l) * 16;
      uint4 v = fc_ref_ld(line);
      uint32_t spins = 0;
      while (!dead && (v.y != e || v.w != e)) {
        if ((++spins & 1023u) == 0 && (*fail != 0 || fc_ref_now() > deadline)) {
          *fail = 1u;
          dead = true;
          break;
        }
        v = fc_ref_ld(line);
      }
      fc_ref_store8(out + (uint64_t)s * p.bytes + l * 8, make_uint2(v.x, v.z), n);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) epochs[blockIdx.x] = e;
}

// The AllReduce above with every rank in one grid (flashcomm-perf --ref-launch single), launched
// by one thread, so that what launching per rank costs shows beside it: rank r runs as blocks
// r * FC_REF_BLOCKS .. (r + 1) * FC_REF_BLOCKS - 1 of the grid, each as block b = blockIdx.x mod
// FC_REF_BLOCKS of that rank's launch above (the same lines, thread mapping, epochs and inbox
// halves: a rank's epochs are the same words whichever kernel runs it). One failure flag serves
// the whole grid. Written out again on purpose, like the AllToAll: the AllReduce's text is frozen.
// Every block of the grid waits for blocks of the other ranks, so the whole grid must be resident
// at once (nranks * FC_REF_BLOCKS blocks; the host checks).
struct FcRefGridParams {
  uint64_t send[FC_REF_MAX_RANKS];    // every rank's input
  uint64_t recv[FC_REF_MAX_RANKS];    // every rank's output
  uint64_t inbox[FC_REF_MAX_RANKS];   // every rank's inbox
  uint64_t epochs[FC_REF_MAX_RANKS];  // every rank's u32[FC_REF_BLOCKS]
  uint64_t bytes;                     // message bytes
  uint64_t half_bytes;                // bytes of one inbox half
  uint64_t fail;                      // the grid's u32 failure flag
  uint64_t timeout_ns;                // bound on every wait
  uint32_t nranks;
  uint32_t dtype;                     // 0 f32, 1 f16, 2 bf16
};
static_assert(sizeof(FcRefGridParams) == 296, "FcRefGridParams layout");

extern "C" __global__ void __launch_bounds__(FC_REF_THREADS) fc_test_reference_allreduce_grid(const __grid_constant__ FcRefGridParams p) {
  __shared__ uint32_t epoch_s;
  const uint32_t rank = blockIdx.x / FC_REF_BLOCKS;
  const uint32_t block = blockIdx.x % FC_REF_BLOCKS;
  volatile uint32_t* epochs = reinterpret_cast<volatile uint32_t*>(p.epochs[rank]);
  volatile uint32_t* fail = reinterpret_cast<volatile uint32_t*>(p.fail);
  if (threadIdx.x == 0) epoch_s = epochs[block] + 1u;
  __syncthreads();
  const uint32_t e = epoch_s;
  const uint64_t half = (uint64_t)(e & 1u) * p.half_bytes;
  const uint64_t lines = (p.bytes + 7) / 8;
  const uint64_t stride = (uint64_t)FC_REF_BLOCKS * blockDim.x;
  const uint64_t first = (uint64_t)block * blockDim.x + threadIdx.x;
  const unsigned char* in = reinterpret_cast<const unsigned char*>(p.send[rank]);
  unsigned char* out = reinterpret_cast<unsigned char*>(p.recv[rank]);
  for (uint64_t l = first; l < lines; l += stride) {
    const uint32_t n = (uint32_t)min((uint64_t)8, p.bytes - l * 8);
    const uint2 d = fc_ref_load8(in + l * 8, n);
    for (uint32_t q = 0; q < p.nranks; ++q) {
      char* line = reinterpret_cast<char*>(p.inbox[q]) + half + ((uint64_t)rank * lines + l) * 16;
      fc_ref_st(line, make_uint4(d.x, e, d.y, e));
    }
  }
  const uint64_t deadline = fc_ref_now() + p.timeout_ns;
  bool dead = false;
  for (uint64_t l = first; l < lines; l += stride) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (uint32_t s = 0; s < p.nranks; ++s) {
      const char* line = reinterpret_cast<const char*>(p.inbox[rank]) + half + ((uint64_t)s * lines + l) * 16;
      uint4 v = fc_ref_ld(line);
      uint32_t spins = 0;
      while (!dead && (v.y != e || v.w != e)) {
        if ((++spins & 1023u) == 0 && (*fail != 0 || fc_ref_now() > deadline)) {
          *fail = 1u;
          dead = true;
          break;
        }
        v = fc_ref_ld(line);
      }
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      fc_ref_unpack(p.dtype, make_uint2(v.x, v.z), x);
      for (int i = 0; i < 4; ++i) acc[i] = s == 0 ? x[i] : __fadd_rn(acc[i], x[i]);
    }
    const uint32_t n = (uint32_t)min((uint64_t)8, p.bytes - l * 8);
    fc_ref_store8(out + l * 8, fc_ref_pack(p.dtype, acc), n);
  }
  __syncthreads();
  if (threadIdx.x == 0) epochs[block] = e;
}
