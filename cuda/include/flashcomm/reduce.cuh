// Fixed-order fp32 accumulation of packed values, the same arithmetic as the CPU reference:
// acc = x_0, then acc = acc + x_s for s = 1..N-1 in rank order, rounded to the element type with
// round-to-nearest-even. Every rank reduces in the same order, so every rank's result is
// bitwise identical no matter in which order the peers' data arrived.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace fc {

// Values per 32-bit word and conversions for one element type.
template <typename T>
struct Word;

template <>
struct Word<float> {
  static constexpr int kVals = 1;
  __device__ static __forceinline__ void unpack(uint32_t w, float* v) { v[0] = __uint_as_float(w); }
  __device__ static __forceinline__ uint32_t pack(const float* v) { return __float_as_uint(v[0]); }
};

template <>
struct Word<__half> {
  static constexpr int kVals = 2;
  __device__ static __forceinline__ void unpack(uint32_t w, float* v) {
    v[0] = __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
    v[1] = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
  }
  __device__ static __forceinline__ uint32_t pack(const float* v) {
    return (uint32_t)__half_as_ushort(__float2half_rn(v[0])) |
           ((uint32_t)__half_as_ushort(__float2half_rn(v[1])) << 16);
  }
};

template <>
struct Word<__nv_bfloat16> {
  static constexpr int kVals = 2;
  __device__ static __forceinline__ void unpack(uint32_t w, float* v) {
    v[0] = __uint_as_float(w << 16);
    v[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ static __forceinline__ uint32_t pack(const float* v) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v[0])) |
           ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v[1])) << 16);
  }
};

// Accumulator over W 32-bit words.
template <typename T, int W>
struct Acc {
  float a[W * Word<T>::kVals];
  __device__ __forceinline__ void init(const uint32_t* w) {
#pragma unroll
    for (int i = 0; i < W; ++i) Word<T>::unpack(w[i], &a[i * Word<T>::kVals]);
  }
  __device__ __forceinline__ void add(const uint32_t* w) {
    float v[W * Word<T>::kVals];
#pragma unroll
    for (int i = 0; i < W; ++i) Word<T>::unpack(w[i], &v[i * Word<T>::kVals]);
#pragma unroll
    for (int i = 0; i < W * Word<T>::kVals; ++i) a[i] = __fadd_rn(a[i], v[i]);
  }
  __device__ __forceinline__ void out(uint32_t* w) const {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = Word<T>::pack(&a[i * Word<T>::kVals]);
  }
};

}  // namespace fc
