// The reduction of the copy-engine schedule (docs/protocols.md "The copy-engine schedule"): on
// the host transport the copy engines move every byte; each rank's owner sums its chunk from
// every rank in device memory: dst[i] = src[0][i] + src[1][i] + ... in f32, in rank order, rounded
// once to the element type (the order and the bits of every reducing kernel, "Reduction order").
// dst may be one of the sources: each element is read from every source before it is written.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "flashcomm/instances.h"
#include "flashcomm/params.h"

namespace {

__device__ __forceinline__ float fc_to_f32(float v) { return v; }
__device__ __forceinline__ float fc_to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float fc_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T fc_from_f32(float v);
template <>
__device__ __forceinline__ float fc_from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half fc_from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 fc_from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__device__ __forceinline__ void copy_reduce(const FcReduceParams& p) {
  const uint32_t nsrc = p.nsrc < FC_MAX_RANKS ? p.nsrc : FC_MAX_RANKS;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.elems; i += stride) {
    float acc = fc_to_f32(reinterpret_cast<const T*>(p.src[0])[i]);
    for (uint32_t s = 1; s < nsrc; ++s) acc = __fadd_rn(acc, fc_to_f32(reinterpret_cast<const T*>(p.src[s])[i]));
    reinterpret_cast<T*>(p.dst)[i] = fc_from_f32<T>(acc);
  }
}

}  // namespace

#define FC_CRED(T, suffix)                                                                             \
  extern "C" __global__ void __launch_bounds__(256) fc_copy_reduce_##suffix(const __grid_constant__ FcReduceParams p) { \
    copy_reduce<T>(p);                                                                                 \
  }

FC_COPY_REDUCE_INSTANCES
