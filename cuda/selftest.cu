// Device self-test and set-up helpers.
//
// fc_selftest writes a known pattern so a test can prove that the embedded fatbin loads and runs
// on the GPU at hand. fc_probe_write writes one word into every peer's arena header so that
// communicator set-up can check that peer writes really arrive (peer access that the driver
// reports as available does not always work).
#include <stdint.h>

#include "flashcomm/params.h"
#include "flashcomm/ptx.cuh"

__device__ __forceinline__ uint32_t fc_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

extern "C" __global__ void fc_selftest(uint32_t* out, uint32_t n, uint32_t seed) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = fc_mix(i ^ seed);
}

struct FcProbeParams {
  uint64_t peer_base[FC_MAX_RANKS];
  uint32_t rank;
  uint32_t nranks;
  uint32_t value;
  uint32_t pad;
};
static_assert(sizeof(FcProbeParams) == 80, "FcProbeParams layout");

extern "C" __global__ void fc_probe_write(const __grid_constant__ FcProbeParams p) {
  const uint32_t r = threadIdx.x;
  if (r < p.nranks) {
    char* hdr = reinterpret_cast<char*>(p.peer_base[r]);
    fc::st_volatile_u32(hdr + FC_HDR_PROBE + 4 * p.rank, p.value);
    fc::fence_sys();
  }
}
