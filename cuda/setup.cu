// Communicator set-up: fc_probe_write writes one word into every peer's arena header so that set-up
// can check that peer writes really arrive (peer access that the driver reports as available does
// not always work). FcProbeParams is in flashcomm/params.h, generated from the host's ABI.
#include <stdint.h>

#include "flashcomm/instances.h"
#include "flashcomm/params.h"
#include "flashcomm/ptx.cuh"

extern "C" __global__ void fc_probe_write(const __grid_constant__ FcProbeParams p) {
  const uint32_t r = threadIdx.x;
  if (r < p.nranks) {
    char* hdr = reinterpret_cast<char*>(p.peer_base[r]);
    fc::st_volatile_u32(hdr + FC_HDR_PROBE + 4 * p.rank, p.value);
    fc::fence_sys();
  }
}
