// Schedules of a two-rank two-shot AllReduce through pinned host memory, side by side: which one
// keeps the GPU's PCIe link busy in both directions at once. This is a stand-alone model of the
// host transport's traffic, not flashcomm's kernels: fp32, no codec, no epochs on the device, one
// process, two "ranks" on one GPU (two streams, each rank's kernel resident beside the other's).
// Its answer decides how the host transport's kernels are to be organised (docs/perf.md, "The host
// transport", and docs/protocols.md).
//
// Built by ci/host-link.sh; run as `host_schedules [MiB...]` (default 4 16 64 256).
//
// Every rank r (peer p = 1 - r) owns an outbox in mapped pinned host memory with two areas:
//   rs: its input's part of the peer's shard, which the peer adds to its own part (D2H, then H2D);
//   ag: its reduced shard, which the peer copies into its output (D2H, then H2D).
// Readiness: one flag word per 4 KiB frame (SM stores: a warp stores its frame, fences at system
// scope and stores the flag) or per chunk (copy engine: a stream write of the flag after the
// chunk's copy, which the driver orders after the copy's writes). Readers acquire the flag at
// system scope. Every wait is bounded; a wait that runs out sets a failure word and the kernel
// finishes (the row then says FAILED).
//
// The work of one rank, in three parts:
//   P: push rs (send[p's shard] -> outbox rs)                  D2H
//   R: reduce (outbox_p rs + send[own shard] -> recv, outbox ag) H2D + D2H
//   G: gather (outbox_p ag -> recv[p's shard])                  H2D
// Schedules:
//   lockstep  every warp does P for its frames, then R, then G (flashcomm's kernels today, where a
//             message fits the arena in one round)
//   split     each warp has one part for the whole call: P : R : G warps = 1 : 2 : 1
//   ce+split  P by the copy engine on a second stream, in chunks, each chunk's flag written by the
//             stream after it; the kernel's warps do R : G = 2 : 1
// Beside them: ce_both (the copy engine moving S bytes each way at once, two streams); the AllReduce
// moves 2S each way, so its floor is twice that time.
#include <cuda.h>

#include <cstring>

#include "probe.cuh"

using probe::kFrameVecs;
using probe::kPerLane;

constexpr uint32_t kSpinLimit = 1u << 26;  // about a second of polling across PCIe

enum Schedule : int { kLockstep = 0, kSplit = 1, kCeSplit = 2 };

struct RankArgs {
  const uint4* send;  // device, whole message (fp32)
  uint4* recv;        // device, whole message
  uint4* out_rs;      // own outbox (device view of host memory), one shard
  uint4* out_ag;
  const uint4* peer_rs;  // peer's outbox
  const uint4* peer_ag;
  uint32_t* rs_flags;  // own flags (host memory)
  uint32_t* ag_flags;
  const uint32_t* peer_rs_flags;
  const uint32_t* peer_ag_flags;
  uint32_t* failed;         // host memory, shared by both ranks
  uint32_t shard_frames;    // frames per shard
  uint32_t rank;
  uint32_t epoch;
  uint32_t rs_frames_per_flag;  // 1 for SM pushes, the chunk's frames for copy-engine pushes
  int schedule;
};

// Lane 0 waits for `*flag == epoch` (bounded; gives up at once when another wait failed).
__device__ __forceinline__ void wait_flag(const RankArgs& a, const uint32_t* flag) {
  if ((threadIdx.x & 31) == 0) {
    uint32_t spins = 0;
    while (fc::ld_acquire_sys_u32(flag) != a.epoch) {
      if ((++spins & 1023u) == 0 && (spins >= kSpinLimit || *(volatile uint32_t*)a.failed != 0)) {
        atomicExch_system(a.failed, 1u);
        break;
      }
    }
  }
  __syncwarp();
}

__device__ __forceinline__ void publish(uint32_t* flag, uint32_t epoch) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    fc::fence_sys();
    fc::st_relaxed_sys_u32(flag, epoch);
  }
}

// P: frame j of the peer's shard of this rank's input into the own outbox.
__device__ __forceinline__ void part_p(const RankArgs& a, uint32_t j) {
  const uint32_t peer = 1 - a.rank;
  uint4 v[kPerLane];
  probe::load_frame(v, a.send + ((size_t)peer * a.shard_frames + j) * kFrameVecs);
  probe::store_frame(a.out_rs + (size_t)j * kFrameVecs, v);
  publish(a.rs_flags + j, a.epoch);
}

// R: frame j of the own shard: the peer's part plus the own, into recv and the own outbox.
__device__ __forceinline__ void part_r(const RankArgs& a, uint32_t j) {
  uint4 mine[kPerLane], theirs[kPerLane];
  const size_t own = ((size_t)a.rank * a.shard_frames + j) * kFrameVecs;
  probe::load_frame(mine, a.send + own);
  wait_flag(a, a.peer_rs_flags + j / a.rs_frames_per_flag);
  probe::load_frame(theirs, a.peer_rs + (size_t)j * kFrameVecs);
  // Rank order (rank 0's part first) so both ranks' sums are bitwise equal.
  auto add = [](uint32_t x, uint32_t y) { return __float_as_uint(__fadd_rn(__uint_as_float(x), __uint_as_float(y))); };
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const uint4 x = a.rank == 0 ? mine[i] : theirs[i];
    const uint4 y = a.rank == 0 ? theirs[i] : mine[i];
    mine[i] = make_uint4(add(x.x, y.x), add(x.y, y.y), add(x.z, y.z), add(x.w, y.w));
  }
  probe::store_frame(a.recv + own, mine);
  probe::store_frame(a.out_ag + (size_t)j * kFrameVecs, mine);
  publish(a.ag_flags + j, a.epoch);
}

// G: frame j of the peer's reduced shard into recv.
__device__ __forceinline__ void part_g(const RankArgs& a, uint32_t j) {
  const uint32_t peer = 1 - a.rank;
  uint4 v[kPerLane];
  wait_flag(a, a.peer_ag_flags + j);
  probe::load_frame(v, a.peer_ag + (size_t)j * kFrameVecs);
  probe::store_frame(a.recv + ((size_t)peer * a.shard_frames + j) * kFrameVecs, v);
}

__global__ void __launch_bounds__(256) allreduce2(RankArgs a) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t n = a.shard_frames;
  if (a.schedule == kLockstep) {
    for (uint32_t j = warp; j < n; j += warps) part_p(a, j);
    for (uint32_t j = warp; j < n; j += warps) part_r(a, j);
    for (uint32_t j = warp; j < n; j += warps) part_g(a, j);
    return;
  }
  // Roles by warp index, so that every block (and SM) holds every role.
  const uint32_t parts = a.schedule == kSplit ? 4 : 3;  // split: P R R G; ce+split: R R G
  const uint32_t slot = warp % parts;
  const uint32_t lane_of_role = warp / parts;
  const uint32_t per_role = warps / parts;
  if (lane_of_role >= per_role) return;  // the warps left over when parts does not divide warps
  if (a.schedule == kSplit && slot == 0) {
    for (uint32_t j = lane_of_role; j < n; j += per_role) part_p(a, j);
  } else if (slot == parts - 1) {
    for (uint32_t j = lane_of_role; j < n; j += per_role) part_g(a, j);
  } else {
    const uint32_t r = a.schedule == kSplit ? slot - 1 : slot;  // 0 or 1: two R warps per group
    for (uint32_t j = lane_of_role * 2 + r; j < n; j += per_role * 2) part_r(a, j);
  }
}

typedef CUresult (*WriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

__global__ void write_flag(uint32_t* flag, uint32_t v) {
  fc::fence_sys();
  fc::st_relaxed_sys_u32(flag, v);
}

int main(int argc, char** argv) {
  std::vector<size_t> mib;
  for (int i = 1; i < argc; ++i) mib.push_back(std::strtoull(argv[i], nullptr, 10));
  if (mib.empty()) mib = {4, 16, 64, 256};
  const size_t maxb = *std::max_element(mib.begin(), mib.end()) << 20;
  const int grid = 66;  // each rank's share of 132 SMs, as flashcomm's max_grid gives two ranks

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs; 2 ranks, grid %d x 256 per rank, fp32\n", prop.name, prop.multiProcessorCount, grid);

  WriteValue32 write_value = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", (void**)&write_value, 12000, cudaEnableDefault, &q) !=
          cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    write_value = nullptr;

  const size_t max_frames = maxb / (kFrameVecs * 16);
  uint4 *send[2], *recv[2], *out_rs[2], *out_ag[2], *out_rs_dev[2], *out_ag_dev[2];
  uint32_t *flags, *flags_dev;  // [rank][rs|ag][frame], then the failure word
  CK(cudaHostAlloc(&flags, (4 * max_frames + 1) * 4, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostGetDevicePointer(&flags_dev, flags, 0));
  std::vector<float> h(maxb / 4);
  for (int r = 0; r < 2; ++r) {
    CK(cudaMalloc(&send[r], maxb));
    CK(cudaMalloc(&recv[r], maxb));
    CK(cudaHostAlloc(&out_rs[r], maxb / 2, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostAlloc(&out_ag[r], maxb / 2, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostGetDevicePointer(&out_rs_dev[r], out_rs[r], 0));
    CK(cudaHostGetDevicePointer(&out_ag_dev[r], out_ag[r], 0));
    for (size_t i = 0; i < h.size(); ++i) h[i] = (float)((i * 7 + r * 3) % 1024) * (r + 1);
    CK(cudaMemcpy(send[r], h.data(), maxb, cudaMemcpyHostToDevice));
  }
  cudaStream_t s0, main_s[2], side_s[2];
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  for (int r = 0; r < 2; ++r) {
    CK(cudaStreamCreateWithFlags(&main_s[r], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&side_s[r], cudaStreamNonBlocking));
  }
  cudaEvent_t start, stop, done[4];
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  for (auto& e : done) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  uint32_t epoch = 0;
  for (size_t m : mib) {
    const size_t bytes = m << 20;
    const uint32_t shard_frames = (uint32_t)(bytes / 2 / (kFrameVecs * 16));
    auto flag_ptr = [&](uint32_t* base, int r, int area) { return base + ((size_t)r * 2 + area) * max_frames; };
    uint32_t* failed_dev = flags_dev + 4 * max_frames;
    uint32_t* failed = flags + 4 * max_frames;

    // The floor: the copy engine, S bytes each way at once.
    {
      std::vector<float> t;
      for (int rep = 0; rep < 11; ++rep) {
        CK(cudaDeviceSynchronize());
        CK(cudaEventRecord(start, s0));
        for (int r = 0; r < 2; ++r) CK(cudaStreamWaitEvent(main_s[r], start));
        CK(cudaMemcpyAsync(out_rs[0], send[0], bytes / 2, cudaMemcpyDeviceToHost, main_s[0]));
        CK(cudaMemcpyAsync(out_ag[0], send[1], bytes / 2, cudaMemcpyDeviceToHost, main_s[0]));
        CK(cudaMemcpyAsync(recv[0], out_rs[1], bytes / 2, cudaMemcpyHostToDevice, main_s[1]));
        CK(cudaMemcpyAsync(recv[1], out_ag[1], bytes / 2, cudaMemcpyHostToDevice, main_s[1]));
        for (int r = 0; r < 2; ++r) {
          CK(cudaEventRecord(done[r], main_s[r]));
          CK(cudaStreamWaitEvent(s0, done[r]));
        }
        CK(cudaEventRecord(stop, s0));
        CK(cudaEventSynchronize(stop));
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (rep >= 2) t.push_back(ms);
      }
      const float us = probe::median(t) * 1e3f;
      std::printf("%-14s %4zu MiB  %10.1f us  %6.1f GB/s each way   AllReduce floor %.1f us\n", "ce_both", m, us,
                  bytes / (us * 1e-6) / 1e9, 2 * us);
    }

    struct Variant {
      const char* name;
      int schedule;
      size_t chunk;  // copy-engine chunk (ce+split)
      bool memop;
    };
    std::vector<Variant> variants = {{"lockstep", kLockstep, 0, false}, {"split", kSplit, 0, false}};
    for (size_t c : {256u << 10, 1u << 20, 4u << 20}) {
      if (c > bytes / 2) continue;
      variants.push_back({"ce+split", kCeSplit, c, true});
    }
    variants.push_back({"ce+split", kCeSplit, std::min<size_t>(1u << 20, bytes / 2), false});
    for (const Variant& v : variants) {
      if (v.memop && !write_value) {
        std::printf("%-14s %4zu MiB  no cuStreamWriteValue32\n", v.name, m);
        continue;
      }
      std::vector<float> t;
      bool ok = true;
      for (int rep = 0; rep < 11 && ok; ++rep) {
        ++epoch;
        CK(cudaDeviceSynchronize());
        *failed = 0;
        CK(cudaMemset(recv[0], 0, bytes));
        CK(cudaMemset(recv[1], 0, bytes));
        CK(cudaDeviceSynchronize());
        CK(cudaEventRecord(start, s0));
        for (int r = 0; r < 2; ++r) {
          const int p = 1 - r;
          RankArgs a{};
          a.send = send[r];
          a.recv = recv[r];
          a.out_rs = out_rs_dev[r];
          a.out_ag = out_ag_dev[r];
          a.peer_rs = out_rs_dev[p];
          a.peer_ag = out_ag_dev[p];
          a.rs_flags = flag_ptr(flags_dev, r, 0);
          a.ag_flags = flag_ptr(flags_dev, r, 1);
          a.peer_rs_flags = flag_ptr(flags_dev, p, 0);
          a.peer_ag_flags = flag_ptr(flags_dev, p, 1);
          a.failed = failed_dev;
          a.shard_frames = shard_frames;
          a.rank = r;
          a.epoch = epoch;
          a.rs_frames_per_flag = v.schedule == kCeSplit ? (uint32_t)(v.chunk / (kFrameVecs * 16)) : 1;
          a.schedule = v.schedule;
          CK(cudaStreamWaitEvent(main_s[r], start));
          if (v.schedule == kCeSplit) {
            CK(cudaStreamWaitEvent(side_s[r], start));
            const size_t shard = bytes / 2;
            for (size_t o = 0, k = 0; o < shard; o += v.chunk, ++k) {
              const size_t nb = std::min(v.chunk, shard - o);
              CK(cudaMemcpyAsync((char*)out_rs[r] + o, (const char*)send[r] + (size_t)p * shard + o, nb,
                                 cudaMemcpyDeviceToHost, side_s[r]));
              uint32_t* f = flag_ptr(flags_dev, r, 0) + k;
              if (v.memop) {
                if (write_value((CUstream)side_s[r], (CUdeviceptr)f, epoch, 0) != CUDA_SUCCESS) {
                  std::fprintf(stderr, "cuStreamWriteValue32 failed\n");
                  return 1;
                }
              } else {
                write_flag<<<1, 1, 0, side_s[r]>>>(f, epoch);
                CK(cudaGetLastError());
              }
            }
            CK(cudaEventRecord(done[2 + r], side_s[r]));
          }
          allreduce2<<<grid, 256, 0, main_s[r]>>>(a);
          CK(cudaGetLastError());
          CK(cudaEventRecord(done[r], main_s[r]));
        }
        for (int r = 0; r < 2; ++r) {
          CK(cudaStreamWaitEvent(s0, done[r]));
          if (v.schedule == kCeSplit) CK(cudaStreamWaitEvent(s0, done[2 + r]));
        }
        CK(cudaEventRecord(stop, s0));
        CK(cudaEventSynchronize(stop));
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (*failed) ok = false;
        if (rep >= 2) t.push_back(ms);
      }
      // Check: both ranks' outputs equal, element for element, the rank-ordered sum.
      size_t wrong = 0;
      if (ok) {
        std::vector<float> a(bytes / 4), b(bytes / 4);
        CK(cudaMemcpy(a.data(), recv[0], bytes, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), recv[1], bytes, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < a.size(); ++i) {
          const float x = (float)((i * 7) % 1024), y = (float)((i * 7 + 3) % 1024) * 2;
          if (a[i] != x + y || std::memcmp(&a[i], &b[i], 4) != 0) ++wrong;
        }
      }
      char label[64];
      if (v.schedule == kCeSplit)
        std::snprintf(label, sizeof label, "%s/%zuK%s", v.name, v.chunk >> 10, v.memop ? "" : "/kflag");
      else
        std::snprintf(label, sizeof label, "%s", v.name);
      if (!ok) {
        std::printf("%-22s %4zu MiB  FAILED (a wait ran out)\n", label, m);
        continue;
      }
      const float us = probe::median(t) * 1e3f;
      std::printf("%-22s %4zu MiB  %10.1f us  %6.1f GB/s each way  wrong %zu\n", label, m, us,
                  2.0 * bytes / (us * 1e-6) / 1e9, wrong);
      std::fflush(stdout);
    }
  }
  return 0;
}
