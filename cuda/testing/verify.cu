// Verification kernels for the GPU test suite and the benchmark tool.
//
// Inputs are integer-valued ("verifiable", as nccl-tests calls it): rank r's element i of test
// round k is value(r, i, k) in [-32, 31], so every sum over up to 8 ranks is exact in f32, f16 and
// bf16, and the expected output of every collective can be recomputed on the device from the
// indices alone. Byte buffers (u8) use (r*7 + i*13 + k*31) mod 256.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FC_TEST_F32 0
#define FC_TEST_F16 1
#define FC_TEST_BF16 2
#define FC_TEST_U8 3

#define FC_TEST_ALLREDUCE 0
#define FC_TEST_ALLGATHER 1
#define FC_TEST_REDUCESCATTER 2
#define FC_TEST_ALLTOALL 3

__device__ __forceinline__ int fc_test_value(uint32_t r, uint64_t i, uint32_t k) {
  return (int)((r * 7u + (uint32_t)(i & 63u) * 13u + k * 31u) & 63u) - 32;
}

__device__ __forceinline__ uint8_t fc_test_byte(uint32_t r, uint64_t i, uint32_t k) {
  return (uint8_t)((r * 7u + (uint32_t)(i & 255u) * 13u + k * 31u) & 255u);
}

struct FcTestFill {
  uint64_t buf;
  uint64_t n;  // elements
  uint32_t dtype;
  uint32_t rank;
  uint32_t salt;
  uint32_t pad;
};
static_assert(sizeof(FcTestFill) == 32, "FcTestFill layout");

extern "C" __global__ void fc_test_fill(const __grid_constant__ FcTestFill p) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.n; i += (uint64_t)gridDim.x * blockDim.x) {
    const int v = fc_test_value(p.rank, i, p.salt);
    switch (p.dtype) {
      case FC_TEST_F32: reinterpret_cast<float*>(p.buf)[i] = (float)v; break;
      case FC_TEST_F16: reinterpret_cast<__half*>(p.buf)[i] = __int2half_rn(v); break;
      case FC_TEST_BF16: reinterpret_cast<__nv_bfloat16*>(p.buf)[i] = __int2bfloat16_rn(v); break;
      default: reinterpret_cast<uint8_t*>(p.buf)[i] = fc_test_byte(p.rank, i, p.salt); break;
    }
  }
}

struct FcTestCheck {
  uint64_t out;
  uint64_t n;       // elements of `out` to check
  uint64_t chunk;   // AllGather: sendcount; ReduceScatter: recvcount; AllToAll: count per peer
  uint64_t errors;  // u64[2] in device memory: error count, first bad index (atomicMin)
  uint32_t kind;
  uint32_t dtype;
  uint32_t nranks;
  uint32_t rank;
  uint32_t salt;
  uint32_t pad;
};
static_assert(sizeof(FcTestCheck) == 56, "FcTestCheck layout");

extern "C" __global__ void fc_test_check(const __grid_constant__ FcTestCheck p) {
  unsigned long long* err = reinterpret_cast<unsigned long long*>(p.errors);
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.n; i += (uint64_t)gridDim.x * blockDim.x) {
    bool ok;
    // AllGather: element i comes from rank i / chunk, its index i % chunk. AllToAll: from rank
    // i / chunk too, but from that rank's block addressed to this rank.
    const uint32_t src = (uint32_t)(i / p.chunk);
    const uint64_t at = (p.kind == FC_TEST_ALLTOALL ? (uint64_t)p.rank * p.chunk : 0) + i % p.chunk;
    if (p.dtype == FC_TEST_U8) {
      // Only AllGather and AllToAll move bytes.
      ok = reinterpret_cast<const uint8_t*>(p.out)[i] == fc_test_byte(src, at, p.salt);
    } else {
      int expect = 0;
      if (p.kind == FC_TEST_ALLREDUCE) {
        for (uint32_t r = 0; r < p.nranks; ++r) expect += fc_test_value(r, i, p.salt);
      } else if (p.kind == FC_TEST_ALLGATHER || p.kind == FC_TEST_ALLTOALL) {
        expect = fc_test_value(src, at, p.salt);
      } else {
        for (uint32_t r = 0; r < p.nranks; ++r) expect += fc_test_value(r, (uint64_t)p.rank * p.chunk + i, p.salt);
      }
      float got;
      switch (p.dtype) {
        case FC_TEST_F32: got = reinterpret_cast<const float*>(p.out)[i]; break;
        case FC_TEST_F16: got = __half2float(reinterpret_cast<const __half*>(p.out)[i]); break;
        default: got = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.out)[i]); break;
      }
      ok = got == (float)expect;
    }
    if (!ok) {
      atomicAdd(&err[0], 1ull);
      atomicMin(&err[1], (unsigned long long)i);
    }
  }
}

// Byte-wise comparison of two buffers (bitwise identity across ranks).
struct FcTestCompare {
  uint64_t a;
  uint64_t b;
  uint64_t n;  // bytes
  uint64_t errors;
};
static_assert(sizeof(FcTestCompare) == 32, "FcTestCompare layout");

extern "C" __global__ void fc_test_compare(const __grid_constant__ FcTestCompare p) {
  unsigned long long* err = reinterpret_cast<unsigned long long*>(p.errors);
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.n; i += (uint64_t)gridDim.x * blockDim.x) {
    if (reinterpret_cast<const uint8_t*>(p.a)[i] != reinterpret_cast<const uint8_t*>(p.b)[i]) {
      atomicAdd(&err[0], 1ull);
      atomicMin(&err[1], (unsigned long long)i);
    }
  }
}

// Holds the multiprocessors its blocks land on for up to `ns` nanoseconds (the global timer),
// then exits: launched on a stream of its own, it delays the blocks of kernels launched after it on
// other streams until SMs free up (the GPU tests' "delayed blocks"); launched ahead of a rank's
// collective on the rank's stream, it delays that rank.
struct FcTestHold {
  uint64_t ns;
  uint64_t pad;
};
static_assert(sizeof(FcTestHold) == 16, "FcTestHold layout");

__device__ __forceinline__ uint64_t fc_test_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Block b holds for ns x (1 + b mod 4) / 4: the blocks release their multiprocessors at four
// different times, so the blocks of the kernels waiting for them start at different times too.
extern "C" __global__ void fc_test_hold(const __grid_constant__ FcTestHold p) {
  if (threadIdx.x != 0) return;
  const uint64_t until = p.ns / 4 * (1 + blockIdx.x % 4);
  const uint64_t start = fc_test_now();
  while (fc_test_now() - start < until) {
  }
}

// One round trip of a flag through pinned host memory, the latency floor of the host transport
// (flashcomm-perf's link-rtt row): block 0 stores the call's value into word 0 of `host` and waits
// until word 1 holds it; block 1 waits for word 0 and answers in word 1. Every store and load
// crosses the host link (posted writes, reads of uncached host memory), as the host transport's
// flags do. The value is the call's number, kept in device memory (`epoch`, advanced by block 0
// once block 1 has answered, so both blocks read the same number), so that a CUDA graph of calls
// replays alike. A wait gives up after `timeout_ns` and sets `*fail` (the host reports it). Launch:
// 2 blocks of 32 threads.
struct FcTestPingPong {
  uint64_t host;        // two u32 words of pinned host memory (their device address)
  uint64_t epoch;       // u32 in device memory: calls so far
  uint64_t fail;        // u32 in device memory: set when a wait gave up
  uint64_t timeout_ns;  // bound on each wait
};
static_assert(sizeof(FcTestPingPong) == 32, "FcTestPingPong layout");

extern "C" __global__ void fc_test_ping_pong(const __grid_constant__ FcTestPingPong p) {
  if (threadIdx.x != 0 || blockIdx.x > 1) return;
  volatile uint32_t* w = reinterpret_cast<volatile uint32_t*>(p.host);
  const uint32_t v = *reinterpret_cast<volatile uint32_t*>(p.epoch) + 1u;
  const uint32_t mine = blockIdx.x, theirs = 1u - blockIdx.x;
  if (mine == 0) {
    w[0] = v;
    __threadfence_system();
  }
  const uint64_t start = fc_test_now();
  while (w[theirs] != v) {
    if (fc_test_now() - start > p.timeout_ns) {
      atomicExch(reinterpret_cast<unsigned int*>(p.fail), 1u);
      return;
    }
  }
  if (mine == 1) {
    w[1] = v;
    __threadfence_system();
  } else {
    *reinterpret_cast<volatile uint32_t*>(p.epoch) = v;
  }
}

// The wait counter and the epoch of flashcomm/wait_count.h as the device compiles them, in the
// scenario of crates/kernels/tests/host/wait_count.cc: out[0] slow checks in 1024 polls from
// 2^31 - 8, out[1] spurious mismatches among them, out[2] the flag after them, out[3] whether
// two consecutive sightings across the wrap are confirmed, out[4..7] next_epoch(0xfffffffe),
// next_epoch(0xfffffffd), next_epoch(0).
#include "flashcomm/wait_count.h"

struct FcTestWaitCount {
  uint64_t out;
};
static_assert(sizeof(FcTestWaitCount) == 8, "FcTestWaitCount layout");

extern "C" __global__ void fc_test_wait_count(const __grid_constant__ FcTestWaitCount p) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  uint32_t* out = reinterpret_cast<uint32_t*>(p.out);
  fc::WaitCount w;
  w.v = 0xfffffff0u;
  uint32_t slow = 0, spurious = 0;
  for (int i = 0; i < 1024; ++i) {
    if (w.tick()) {
      ++slow;
      if (w.confirm_foreign(true)) ++spurious;
      w.confirm_foreign(false);
    }
  }
  out[0] = slow;
  out[1] = spurious;
  out[2] = w.v & 1u;
  w.v = 0xffffff00u;
  bool confirmed = false;
  for (int i = 0; i < 512; ++i)
    if (w.tick()) confirmed = w.confirm_foreign(true) || confirmed;
  out[3] = confirmed ? 1u : 0u;
  out[4] = fc::next_epoch(0xfffffffeu);
  out[5] = fc::next_epoch(0xfffffffdu);
  out[6] = fc::next_epoch(0u);
}

// The reduction of the copy-engine schedule's GPU tests (crates/comm/tests/gpu_copy.rs): dst[i] =
// src[0][i] + src[1][i] + ... in f32, in rank order, rounded once to the element type (the order of
// docs/protocols.md "Reduction order"). dst may be one of the sources (each element is read from
// every source before it is written).
struct FcTestSum {
  uint64_t src[8];
  uint64_t dst;
  uint64_t n;  // elements
  uint32_t nsrc;
  uint32_t dtype;
};
static_assert(sizeof(FcTestSum) == 88, "FcTestSum layout");

__device__ __forceinline__ float fc_test_load(uint64_t base, uint64_t i, uint32_t dtype) {
  switch (dtype) {
    case FC_TEST_F32: return reinterpret_cast<const float*>(base)[i];
    case FC_TEST_F16: return __half2float(reinterpret_cast<const __half*>(base)[i]);
    default: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
  }
}

extern "C" __global__ void fc_test_sum(const __grid_constant__ FcTestSum p) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.n; i += (uint64_t)gridDim.x * blockDim.x) {
    float acc = fc_test_load(p.src[0], i, p.dtype);
    for (uint32_t s = 1; s < p.nsrc && s < 8; ++s) acc = __fadd_rn(acc, fc_test_load(p.src[s], i, p.dtype));
    switch (p.dtype) {
      case FC_TEST_F32: reinterpret_cast<float*>(p.dst)[i] = acc; break;
      case FC_TEST_F16: reinterpret_cast<__half*>(p.dst)[i] = __float2half_rn(acc); break;
      default: reinterpret_cast<__nv_bfloat16*>(p.dst)[i] = __float2bfloat16_rn(acc); break;
    }
  }
}
