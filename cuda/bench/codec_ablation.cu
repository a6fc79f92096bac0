// Where the codec kernels' time goes: times encode, decode and reduce_requantize (bf16, width
// FC_BENCH_BITS) over one buffer, against a device-to-device copy and a memset of the same bf16
// bytes, for several "minimum CTAs per SM" launch bounds. Built by ci/codec-ablation.sh once per
// FC_CODEC_ABLATE setting (see flashcomm/codec.cuh): with a nonzero setting part of the work is
// skipped and the results are wrong, which is the point. Not part of the library.
//
// usage: codec_ablation [MiB of bf16 = 256] [spikes = 2] [group = 128] [reduce: 0|1 = 1]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "flashcomm/codec_kernels.cuh"

using namespace fc::codec;
using T = __nv_bfloat16;

#ifndef FC_BENCH_BITS
#define FC_BENCH_BITS 4
#endif
constexpr int kBits = FC_BENCH_BITS;

template <int MB>
__global__ void __launch_bounds__(FC_CODEC_THREADS, MB) enc(const __grid_constant__ FcCodecEncodeParams p) {
  kern::encode_kernel<T, kBits>(p);
}
template <int MB>
__global__ void __launch_bounds__(FC_CODEC_THREADS, MB) dec(const __grid_constant__ FcCodecDecodeParams p) {
  kern::decode_kernel<T, kBits>(p);
}
template <int MB>
__global__ void __launch_bounds__(FC_CODEC_THREADS, MB) red(const __grid_constant__ FcCodecReduceParams p) {
  kern::reduce_kernel<T, kBits, MB>(p);
}

// Roughly normal bf16 values from a hash of the index (Box-Muller).
__global__ void fill(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    uint32_t h2 = h * 747796405u + 2891336453u;
    h2 ^= h2 >> 16;
    const float u1 = ((h & 0xffffff) + 1) / 16777217.0f, u2 = (h2 & 0xffffff) / 16777216.0f;
    x[i] = __bfloat16_as_ushort(__float2bfloat16_rn(sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2)));
  }
}

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t err_ = (x);                                                                \
    if (err_ != cudaSuccess) {                                                             \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));                  \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

static int g_sms;
static cudaEvent_t g_a, g_b;

// Median time (ms) of `reps` launches after 3 warm-up launches.
template <class F>
static float median_ms(int reps, F launch) {
  std::vector<float> ts;
  for (int r = 0; r < reps + 3; ++r) {
    CK(cudaEventRecord(g_a));
    launch();
    CK(cudaEventRecord(g_b));
    CK(cudaEventSynchronize(g_b));
    float ms;
    CK(cudaEventElapsedTime(&ms, g_a, g_b));
    if (r >= 3) ts.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// Launches kernel k like the library does: grid = min(CTAs for one block per warp, SMs x occupancy).
template <class K, class P>
static float time_kernel(K k, const P& p, size_t smem, int reps, int& per_sm) {
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, FC_CODEC_THREADS, smem));
  const size_t ctas = ((p.n + 1023) / 1024 + kern::kWarps - 1) / kern::kWarps;
  const int grid = (int)std::min<size_t>(ctas, (size_t)g_sms * std::max(per_sm, 1));
  return median_ms(reps, [&] { k<<<grid, FC_CODEC_THREADS, smem>>>(p); });
}

int main(int argc, char** argv) {
  const size_t n = (size_t)(argc > 1 ? atoll(argv[1]) : 256) << 19;
  const uint32_t spikes = argc > 2 ? atoi(argv[2]) : 2, group = argc > 3 ? atoi(argv[3]) : 128;
  const bool do_reduce = argc > 4 ? atoi(argv[4]) != 0 : true;
  const int reps = 20;
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaEventCreate(&g_a));
  CK(cudaEventCreate(&g_b));
  const uint32_t groups = 1024 / group;
  const uint32_t bb = (16 + 128 * kBits + groups * (2 + spikes) * 2 + groups * spikes + 15) & ~15u;
  const size_t encb = (n + 1023) / 1024 * bb;
  constexpr int kInputs = 8;
  uint16_t* x[kInputs];
  uint8_t* e[kInputs];
  uint8_t *e2, *o;
  uint16_t* y;
  for (int i = 0; i < kInputs; ++i) {
    CK(cudaMalloc(&x[i], n * 2));
    CK(cudaMalloc(&e[i], encb));
    fill<<<1024, 256>>>(x[i], n, 1234 + i);
  }
  CK(cudaMalloc(&e2, encb));
  CK(cudaMalloc(&o, encb));
  CK(cudaMalloc(&y, n * 2));
  const float copy_ms = median_ms(reps, [&] { cudaMemcpyAsync(y, x[0], n * 2, cudaMemcpyDeviceToDevice); });
  const float set_ms = median_ms(reps, [&] { cudaMemsetAsync(y, 0, n * 2); });
  const double copy_bw = 2.0 * n * 2 / (copy_ms * 1e-3) / 1e9;
  printf("FC_CODEC_ABLATE=%d bits=%d group=%u spikes=%u n=%zu: copy %.1f us (%.0f GB/s), memset %.1f us (%.0f GB/s)\n",
         FC_CODEC_ABLATE, kBits, group, spikes, n, copy_ms * 1e3, copy_bw, set_ms * 1e3, n * 2.0 / (set_ms * 1e-3) / 1e9);
  auto report = [&](const char* name, int mb, float ms, double bytes, int per_sm) {
    const double bw = bytes / (ms * 1e-3) / 1e9;
    printf("%-26s min_ctas %d (resident %d): %8.1f us %6.0f GB/s %5.1f %% of copy\n", name, mb, per_sm, ms * 1e3, bw,
           100 * bw / copy_bw);
  };
  int per_sm = 0;
  FcCodecEncodeParams ep{};
  ep.n = n;
  ep.group = group;
  ep.spikes = spikes;
  const size_t esm = (size_t)FC_CODEC_STAGES_16BIT * 2048 * kern::kWarps;
  for (int i = 0; i < kInputs; ++i) {
    ep.input = (uint64_t)x[i];
    ep.output = (uint64_t)e[i];
    time_kernel(enc<2>, ep, esm, 1, per_sm);
  }
  ep.input = (uint64_t)x[0];
  ep.output = (uint64_t)e2;
  const double ebytes = n * 2.0 + encb;
#define FC_ENC(MB) { const float ms = time_kernel(enc<MB>, ep, esm, reps, per_sm); report("encode", MB, ms, ebytes, per_sm); }
  FC_ENC(2) FC_ENC(3) FC_ENC(4)
  FcCodecDecodeParams dp{};
  dp.input = (uint64_t)e[0];
  dp.output = (uint64_t)y;
  dp.n = n;
  dp.group = group;
  dp.spikes = spikes;
  const size_t dsm = (2048 + (size_t)FC_CODEC_IN_STAGES * bb) * kern::kWarps;
#define FC_DEC(MB) { const float ms = time_kernel(dec<MB>, dp, dsm, reps, per_sm); report("decode", MB, ms, encb + n * 2.0, per_sm); }
  FC_DEC(2) FC_DEC(3) FC_DEC(4)
  if (!do_reduce) return 0;
  uint64_t* ptrs;
  CK(cudaMalloc(&ptrs, sizeof(uint64_t) * kInputs));
  uint64_t hp[kInputs];
  for (int i = 0; i < kInputs; ++i) hp[i] = (uint64_t)e[i];
  CK(cudaMemcpy(ptrs, hp, sizeof hp, cudaMemcpyHostToDevice));
  for (uint32_t ni : {2u, 8u}) {
    FcCodecReduceParams rp{};
    rp.inputs = (uint64_t)ptrs;
    rp.output = (uint64_t)o;
    rp.n = n;
    rp.ninputs = ni;
    rp.in_bits = kBits;
    rp.in_group = rp.out_group = group;
    rp.in_spikes = rp.out_spikes = spikes;
    const size_t rsm = (FC_CODEC_SCRATCH_BYTES + (size_t)FC_CODEC_IN_STAGES * ni * bb) * kern::kWarps;
    char name[64];
    snprintf(name, sizeof name, "reduce_requantize N=%u", ni);
#define FC_RED(MB) { const float ms = time_kernel(red<MB>, rp, rsm, reps / 2, per_sm); report(name, MB, ms, (ni + 1.0) * encb, per_sm); }
    FC_RED(1) FC_RED(2)
  }
  return 0;
}
