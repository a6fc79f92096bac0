// What the host link probes (host_link.cu, host_schedules.cu) share: error checks, medians, and
// 4 KiB frames moved a warp at a time with flashcomm's own memory accesses (flashcomm/ptx.cuh),
// each lane's eight 16-byte loads issued before its first store, as the BLOCK kernels do.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "flashcomm/ptx.cuh"

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace probe {

constexpr int kFrameVecs = 256;  // 16-byte vectors per 4 KiB frame
constexpr int kPerLane = kFrameVecs / 32;

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The lane's eight vectors of a frame: all loads (ordered asm, L2-cached as the BLOCK kernels read
// peer frames) before any is used.
__device__ __forceinline__ void load_frame(uint4 (&v)[kPerLane], const uint4* f) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) v[i] = fc::ld_cg_v4(f + i * 32 + lane);
}

__device__ __forceinline__ void store_frame(uint4* f, const uint4 (&v)[kPerLane]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) fc::st_v4(f + i * 32 + lane, v[i]);
}

}  // namespace probe
