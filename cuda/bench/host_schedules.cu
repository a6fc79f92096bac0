// Schedules of a two-rank two-shot AllReduce through pinned host memory, side by side: which one
// keeps the GPU's PCIe link busy in both directions at once. This is a stand-alone model of the
// host transport's traffic, not flashcomm's kernels: fp32, no codec, no epochs on the device, one
// process, two "ranks" on one GPU (two streams, each rank's kernel resident beside the other's).
// Its answer decides how the host transport's kernels are to be organised (docs/experiments.md, "Probes
// of the PCIe link", and docs/protocols.md).
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
//             stream after it; the kernel's warps do R : G = 2 : 1, beside one watcher warp (warp 0):
//             only the watcher polls host memory (the peer's chunk and frame flags, 32 lanes at a
//             time) and mirrors the progress into two device-memory counters, on which the R and G
//             warps wait. Hundreds of warps polling host memory at once starve the copy engine
//             (measured: a chunked D2H copy beside such a kernel ran at 0.0-0.2 GB/s, beside one
//             polling warp or a kernel polling device memory at full rate; docs/experiments.md).
//   ce_pipe   every byte across PCIe by the copy engines, the SMs only add in device memory; per
//             rank and chunk k: D2H of the peer's part -> own rs outbox, flag (cuStreamWriteValue32
//             into host memory); the peer waits for it (cuStreamWaitValue32 on host memory), H2D
//             into a device scratch, a reduce kernel (rank-ordered sum into recv), D2H of the
//             reduced chunk -> own ag outbox, flag; the peer waits, H2D into its recv. Streams per
//             rank: /3s one push (D2H), one pull (H2D), one reduce stream (every rs chunk before
//             any ag chunk on the push and pull streams); /5s rs push, ag push, rs pull, ag pull,
//             reduce. /graph: the same work captured once into a CUDA graph and launched per run
//             (no host enqueue inside the timed region). Cross-rank waits use host-memory flags,
//             as two processes would; within a rank, events.
// Before the checked (last) run of every row the host outboxes and scratch buffers are filled with
// NaNs, so a read of stale data from an earlier run shows as wrong elements.
// Beside them: ce_both (the copy engine moving S bytes each way at once, two streams); the AllReduce
// moves 2S each way, so its floor is twice that time.
#include <cuda.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "probe.cuh"

using probe::kFrameVecs;
using probe::kPerLane;

constexpr uint32_t kSpinLimit = 1u << 26;  // about a second of polling across PCIe

constexpr uint64_t kWaitNs = 2000000000ull;  // device-memory waits and the watcher: 2 s

enum Schedule : int { kLockstep = 0, kSplit = 1, kCeSplit = 2 };

__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

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
  uint32_t* rs_ready;  // ce+split: device memory, how many of the peer's rs chunks (in order) are in
  uint32_t* ag_ready;  // and how many of its ag frames (in order); written by the watcher warp only
};

// ce+split: lane 0 waits until the device counter exceeds `index` (bounded).
__device__ __forceinline__ void wait_ready(const RankArgs& a, const uint32_t* counter, uint32_t index) {
  if ((threadIdx.x & 31) == 0) {
    const uint64_t t0 = fc::globaltimer_ns();
    uint32_t spins = 0;
    while (ld_acquire_gpu_u32(counter) <= index) {
      if ((++spins & 1023u) == 0 &&
          (fc::globaltimer_ns() - t0 > kWaitNs || *(volatile uint32_t*)a.failed != 0)) {
        atomicExch_system(a.failed, 1u);
        break;
      }
    }
  }
  __syncwarp();
}

// ce+split's watcher warp: polls the peer's rs chunk flags and ag frame flags in host memory, 32 at
// a time, and publishes the length of each ready prefix in device memory. On a timeout (or another
// wait's failure) it marks the failure and releases every waiter.
__device__ void watch(const RankArgs& a) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t n_rs = (a.shard_frames + a.rs_frames_per_flag - 1) / a.rs_frames_per_flag;
  const uint32_t n_ag = a.shard_frames;
  uint32_t rs = 0, ag = 0;
  const uint64_t t0 = fc::globaltimer_ns();
  uint32_t rounds = 0;
  while (rs < n_rs || ag < n_ag) {
    const uint32_t i = rs + lane, j = ag + lane;
    const bool rs_in = i < n_rs && fc::ld_acquire_sys_u32(a.peer_rs_flags + i) == a.epoch;
    const bool ag_in = j < n_ag && fc::ld_acquire_sys_u32(a.peer_ag_flags + j) == a.epoch;
    const uint32_t mr = ~__ballot_sync(0xffffffffu, rs_in), mg = ~__ballot_sync(0xffffffffu, ag_in);
    const uint32_t dr = mr ? __ffs(mr) - 1 : 32, dg = mg ? __ffs(mg) - 1 : 32;
    if (lane == 0) {
      if (dr) st_release_gpu_u32(a.rs_ready, rs + dr);
      if (dg) st_release_gpu_u32(a.ag_ready, ag + dg);
    }
    rs += dr;
    ag += dg;
    if ((++rounds & 63u) == 0) {
      bool give_up = fc::globaltimer_ns() - t0 > kWaitNs || *(volatile uint32_t*)a.failed != 0;
      give_up = __shfl_sync(0xffffffffu, give_up, 0);
      if (give_up) {
        if (lane == 0) {
          atomicExch_system(a.failed, 1u);
          st_release_gpu_u32(a.rs_ready, n_rs);
          st_release_gpu_u32(a.ag_ready, n_ag);
        }
        return;
      }
    }
  }
}

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
  if (a.schedule == kCeSplit)
    wait_ready(a, a.rs_ready, j / a.rs_frames_per_flag);
  else
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
  if (a.schedule == kCeSplit)
    wait_ready(a, a.ag_ready, j);
  else
    wait_flag(a, a.peer_ag_flags + j);
  probe::load_frame(v, a.peer_ag + (size_t)j * kFrameVecs);
  probe::store_frame(a.recv + ((size_t)peer * a.shard_frames + j) * kFrameVecs, v);
}

__global__ void __launch_bounds__(256) allreduce2(RankArgs a) {
  uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  uint32_t warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t n = a.shard_frames;
  if (a.schedule == kLockstep) {
    for (uint32_t j = warp; j < n; j += warps) part_p(a, j);
    for (uint32_t j = warp; j < n; j += warps) part_r(a, j);
    for (uint32_t j = warp; j < n; j += warps) part_g(a, j);
    return;
  }
  if (a.schedule == kCeSplit) {  // warp 0 watches; the others take the roles
    if (warp == 0) {
      watch(a);
      return;
    }
    --warp;
    --warps;
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

typedef CUresult (*StreamValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
typedef CUresult (*DeviceAttribute)(int*, CUdevice_attribute, CUdevice);

__global__ void write_flag(uint32_t* flag, uint32_t v) {
  fc::fence_sys();
  fc::st_relaxed_sys_u32(flag, v);
}

// ce_pipe's device-local reduce: out = rank-ordered sum of mine and theirs (fp32), all in device memory.
__global__ void __launch_bounds__(256) reduce2(const uint4* mine, const uint4* theirs, uint4* out, size_t vecs,
                                               uint32_t rank) {
  auto add = [](uint32_t x, uint32_t y) { return __float_as_uint(__fadd_rn(__uint_as_float(x), __uint_as_float(y))); };
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vecs; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 m = mine[i], t = theirs[i];
    const uint4 x = rank == 0 ? m : t, y = rank == 0 ? t : m;
    out[i] = make_uint4(add(x.x, y.x), add(x.y, y.y), add(x.z, y.z), add(x.w, y.w));
  }
}

static void* driver_entry(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return nullptr;
  return f;
}

int main(int argc, char** argv) {
  // More hardware queues than streams (15), so that no stream waiting in cuStreamWaitValue32 holds
  // up an unrelated stream that shares its queue (which could deadlock the ce_pipe rows). Read at
  // context creation; a value in the environment wins.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_DEVICE_MAX_COPY_CONNECTIONS", "32", 0);
  // Lazy loading of a kernel may synchronise the context; the first ce_pipe row, whose streams sit
  // in cuStreamWaitValue32 on work queued behind reduce2's first launch, deadlocked that way (a
  // FAILED row on the H200). Load every kernel up front (and launch each once below as well).
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  std::vector<size_t> mib;
  for (int i = 1; i < argc; ++i) mib.push_back(std::strtoull(argv[i], nullptr, 10));
  if (mib.empty()) mib = {4, 16, 64, 256};
  const size_t maxb = *std::max_element(mib.begin(), mib.end()) << 20;
  const int grid = 66;  // each rank's share of 132 SMs, as flashcomm's max_grid gives two ranks

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs, async engines %d; 2 ranks, grid %d x 256 per rank, fp32; "
              "CUDA_DEVICE_MAX_CONNECTIONS=%s\n",
              prop.name, prop.multiProcessorCount, prop.asyncEngineCount, grid, std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"));

  // Stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32, 32-bit, GEQ): part of the
  // driver API from CUDA 12 on without any opt-in; the flag words live in mapped pinned host memory
  // (cudaHostAllocMapped), which is what cuStreamWaitValue32 needs for a host address.
  auto write_value = (StreamValue32)driver_entry("cuStreamWriteValue32");
  auto wait_value = (StreamValue32)driver_entry("cuStreamWaitValue32");
  auto device_attribute = (DeviceAttribute)driver_entry("cuDeviceGetAttribute");
  {
    int nor = -1, flush = -1;
    if (device_attribute) {
      device_attribute(&nor, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 0);
      device_attribute(&flush, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, 0);
    }
    std::printf("# cuStreamWriteValue32 %s, cuStreamWaitValue32 %s (wait NOR %d, flush remote writes %d)\n",
                write_value ? "yes" : "no", wait_value ? "yes" : "no", nor, flush);
  }

  const size_t max_frames = maxb / (kFrameVecs * 16);
  uint4 *send[2], *recv[2], *out_rs[2], *out_ag[2], *out_rs_dev[2], *out_ag_dev[2], *scratch[2];
  uint32_t *flags, *flags_dev;  // [rank][rs|ag][frame], then the failure word
  CK(cudaHostAlloc(&flags, (4 * max_frames + 1) * 4, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostGetDevicePointer(&flags_dev, flags, 0));
  uint32_t* ready;  // ce+split's device counters: [rank][rs|ag]
  CK(cudaMalloc(&ready, 4 * sizeof(uint32_t)));
  std::vector<float> h(maxb / 4);
  for (int r = 0; r < 2; ++r) {
    CK(cudaMalloc(&send[r], maxb));
    CK(cudaMalloc(&recv[r], maxb));
    CK(cudaMalloc(&scratch[r], maxb / 2));
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
  // ce_pipe: per rank rs push, ag push, rs pull, ag pull, reduce (the /3s rows use the first pair
  // for both areas), and per chunk two events (pulled, reduced).
  enum { kPushRs, kPushAg, kPullRs, kPullAg, kReduce, kPipeStreams };
  cudaStream_t pipe_s[2][kPipeStreams];
  for (auto& rs : pipe_s)
    for (auto& st : rs) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const size_t min_chunk = 256u << 10;
  const size_t max_chunks = (maxb / 2 + min_chunk - 1) / min_chunk;
  std::vector<cudaEvent_t> pulled[2], reduced[2];
  for (int r = 0; r < 2; ++r) {
    pulled[r].resize(max_chunks);
    reduced[r].resize(max_chunks);
    for (auto& e : pulled[r]) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    for (auto& e : reduced[r]) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  cudaEvent_t start, stop, done[4], fork, joined[2 * kPipeStreams];
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  for (auto& e : done) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (auto& e : joined) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  uint32_t* failed = flags + 4 * max_frames;
  uint32_t* failed_dev = flags_dev + 4 * max_frames;
  // Every kernel launched once before any timed row (see CUDA_MODULE_LOADING above).
  reduce2<<<1, 256, 0, s0>>>(send[0], send[1], scratch[0], 0, 0);
  write_flag<<<1, 1, 0, s0>>>(failed_dev, 0);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  // Waits for `stop` with a deadline; past it, releases every host-memory flag wait (all flags and
  // the failure word set), drains the device and reports false.
  auto wait_stop = [&](double seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    while (true) {
      const cudaError_t e = cudaEventQuery(stop);
      if (e == cudaSuccess) return true;
      if (e != cudaErrorNotReady) CK(e);
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
        std::fprintf(stderr, "timeout after %.0f s: releasing every flag\n", seconds);
        std::fill(flags, flags + 4 * max_frames, 0x7fffffffu);
        *(volatile uint32_t*)failed = 1;
        CK(cudaDeviceSynchronize());
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  };

  uint32_t epoch = 0;
  for (size_t m : mib) {
    const size_t bytes = m << 20;
    const size_t shard = bytes / 2;
    const uint32_t shard_frames = (uint32_t)(shard / (kFrameVecs * 16));
    auto flag_ptr = [&](uint32_t* base, int r, int area) { return base + ((size_t)r * 2 + area) * max_frames; };

    // NaNs into every buffer a schedule passes data through, so a stale read shows as wrong.
    auto poison = [&]() {
      for (int r = 0; r < 2; ++r) {
        std::memset(out_rs[r], 0xff, shard);
        std::memset(out_ag[r], 0xff, shard);
        CK(cudaMemset(scratch[r], 0xff, shard));
      }
      CK(cudaDeviceSynchronize());
    };
    // Both ranks' outputs equal, element for element, the rank-ordered sum.
    auto check = [&]() {
      size_t wrong = 0;
      std::vector<float> a(bytes / 4), b(bytes / 4);
      CK(cudaMemcpy(a.data(), recv[0], bytes, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), recv[1], bytes, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < a.size(); ++i) {
        const float x = (float)((i * 7) % 1024), y = (float)((i * 7 + 3) % 1024) * 2;
        if (a[i] != x + y || std::memcmp(&a[i], &b[i], 4) != 0) ++wrong;
      }
      return wrong;
    };

    // The floor: the copy engine, S bytes each way at once.
    float floor_us;
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
      floor_us = 2 * us;
      std::printf("%-22s %4zu MiB  %10.1f us  %6.1f GB/s each way   AllReduce floor %.1f us\n", "ce_both", m, us,
                  bytes / (us * 1e-6) / 1e9, floor_us);
    }
    // One result line: median time, the AllReduce's bytes each way (2 x message) per second, the
    // copy-engine floor over the time, and the median host time to enqueue one run.
    auto report = [&](const char* label, const std::vector<float>& t, size_t wrong, double enqueue_us) {
      const float us = probe::median(t) * 1e3f;
      std::printf("%-22s %4zu MiB  %10.1f us  %6.1f GB/s each way  %5.1f%% of floor  wrong %zu  enqueue %.0f us\n",
                  label, m, us, 2.0 * bytes / (us * 1e-6) / 1e9, 100.0 * floor_us / us, wrong, enqueue_us);
      std::fflush(stdout);
    };

    struct Variant {
      const char* name;
      int schedule;
      size_t chunk;  // copy-engine chunk (ce+split)
      bool memop;
    };
    std::vector<Variant> variants = {{"lockstep", kLockstep, 0, false}, {"split", kSplit, 0, false}};
    for (size_t c : {256u << 10, 1u << 20, 4u << 20}) {
      if (c > shard) continue;
      variants.push_back({"ce+split", kCeSplit, c, true});
    }
    variants.push_back({"ce+split", kCeSplit, std::min<size_t>(1u << 20, shard), false});
    for (const Variant& v : variants) {
      char label[64];
      if (v.schedule == kCeSplit)
        std::snprintf(label, sizeof label, "%s/%zuK%s", v.name, v.chunk >> 10, v.memop ? "" : "/kflag");
      else
        std::snprintf(label, sizeof label, "%s", v.name);
      if (v.memop && !write_value) {
        std::printf("%-22s %4zu MiB  no cuStreamWriteValue32\n", label, m);
        continue;
      }
      std::vector<float> t;
      std::vector<double> enq;
      bool ok = true;
      for (int rep = 0; rep < 11 && ok; ++rep) {
        ++epoch;
        CK(cudaDeviceSynchronize());
        if (rep == 10) poison();
        *failed = 0;
        CK(cudaMemset(recv[0], 0, bytes));
        CK(cudaMemset(recv[1], 0, bytes));
        CK(cudaMemset(ready, 0, 4 * sizeof(uint32_t)));
        CK(cudaDeviceSynchronize());
        const auto h0 = std::chrono::steady_clock::now();
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
          a.rs_ready = ready + 2 * r;
          a.ag_ready = ready + 2 * r + 1;
          CK(cudaStreamWaitEvent(main_s[r], start));
          if (v.schedule == kCeSplit) {
            CK(cudaStreamWaitEvent(side_s[r], start));
            for (size_t o = 0, k = 0; o < shard; o += v.chunk, ++k) {
              const size_t nb = std::min(v.chunk, shard - o);
              CK(cudaMemcpyAsync((char*)out_rs[r] + o, (const char*)send[r] + (size_t)p * shard + o, nb,
                                 cudaMemcpyDeviceToHost, side_s[r]));
              uint32_t* f = flag_ptr(flags_dev, r, 0) + k;
              if (v.memop) {
                if (write_value((CUstream)side_s[r], (CUdeviceptr)f, epoch, CU_STREAM_WRITE_VALUE_DEFAULT) !=
                    CUDA_SUCCESS) {
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
        const double hus = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
        if (!wait_stop(10.0)) ok = false;
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (*failed) ok = false;
        if (rep >= 2) {
          t.push_back(ms);
          enq.push_back(hus);
        }
      }
      if (!ok) {
        std::printf("%-22s %4zu MiB  FAILED (a wait ran out)\n", label, m);
        continue;
      }
      std::sort(enq.begin(), enq.end());
      report(label, t, check(), enq[enq.size() / 2]);
    }

    // ce_pipe: the copy engines move every byte, the SMs only add in device memory.
    if (!write_value || !wait_value) {
      std::printf("%-22s %4zu MiB  no stream memory operations\n", "ce_pipe", m);
      continue;
    }
    struct Pipe {
      size_t chunk;
      int streams;  // 3 or 5
      bool graph;
    };
    std::vector<Pipe> pipes;
    for (size_t c : {256u << 10, 512u << 10, 1u << 20, 2u << 20, 4u << 20}) {
      if (c > shard) continue;
      pipes.push_back({c, 5, false});
      pipes.push_back({c, 3, false});
      pipes.push_back({c, 5, true});
    }
    for (const Pipe& pp : pipes) {
      char label[64];
      std::snprintf(label, sizeof label, "ce_pipe/%zuK/%ds%s", pp.chunk >> 10, pp.streams, pp.graph ? "/graph" : "");
      const size_t nchunks = (shard + pp.chunk - 1) / pp.chunk;
      // The flags: 1 = written; the host clears them before every run (the device is idle then),
      // so a graph can hold constant values.
      bool api_ok = true;
      auto soft = [&](cudaError_t e) {
        if (e != cudaSuccess) api_ok = false;
      };
      auto memop = [&](StreamValue32 f, cudaStream_t st, uint32_t* addr, unsigned fl) {
        if (f((CUstream)st, (CUdeviceptr)addr, 1u, fl) != CUDA_SUCCESS) api_ok = false;
      };
      // One run's work, into the rank streams (which have waited for `start` or the graph's fork).
      auto enqueue = [&]() {
        for (int phase = 0; phase < (pp.streams == 3 ? 2 : 1); ++phase) {
          for (size_t k = 0; k < nchunks; ++k) {
            const size_t o = k * pp.chunk, nb = std::min(pp.chunk, shard - o);
            for (int r = 0; r < 2; ++r) {
              const int p = 1 - r;
              cudaStream_t push_rs = pipe_s[r][kPushRs], pull_rs = pipe_s[r][kPullRs], red = pipe_s[r][kReduce];
              cudaStream_t push_ag = pp.streams == 3 ? push_rs : pipe_s[r][kPushAg];
              cudaStream_t pull_ag = pp.streams == 3 ? pull_rs : pipe_s[r][kPullAg];
              char* own = (char*)recv[r] + (size_t)r * shard + o;
              if (pp.streams == 5 || phase == 0) {
                // rs: own input's part of the peer's shard out; the peer's part of the own shard in; add.
                soft(cudaMemcpyAsync((char*)out_rs[r] + o, (const char*)send[r] + (size_t)p * shard + o, nb,
                                   cudaMemcpyDeviceToHost, push_rs));
                memop(write_value, push_rs, flag_ptr(flags_dev, r, 0) + k, CU_STREAM_WRITE_VALUE_DEFAULT);
                memop(wait_value, pull_rs, flag_ptr(flags_dev, p, 0) + k, CU_STREAM_WAIT_VALUE_GEQ);
                soft(cudaMemcpyAsync((char*)scratch[r] + o, (const char*)out_rs[p] + o, nb, cudaMemcpyHostToDevice,
                                   pull_rs));
                soft(cudaEventRecord(pulled[r][k], pull_rs));
                soft(cudaStreamWaitEvent(red, pulled[r][k]));
                const size_t vecs = nb / 16;
                const int blocks = (int)std::min<size_t>((vecs + 255) / 256, 528);
                reduce2<<<blocks, 256, 0, red>>>((const uint4*)((const char*)send[r] + (size_t)r * shard + o),
                                                 (const uint4*)((const char*)scratch[r] + o), (uint4*)own, vecs,
                                                 (uint32_t)r);
                soft(cudaGetLastError());
                soft(cudaEventRecord(reduced[r][k], red));
              }
              if (pp.streams == 5 || phase == 1) {
                // ag: the reduced chunk out; the peer's reduced chunk in.
                soft(cudaStreamWaitEvent(push_ag, reduced[r][k]));
                soft(cudaMemcpyAsync((char*)out_ag[r] + o, own, nb, cudaMemcpyDeviceToHost, push_ag));
                memop(write_value, push_ag, flag_ptr(flags_dev, r, 1) + k, CU_STREAM_WRITE_VALUE_DEFAULT);
                memop(wait_value, pull_ag, flag_ptr(flags_dev, p, 1) + k, CU_STREAM_WAIT_VALUE_GEQ);
                soft(cudaMemcpyAsync((char*)recv[r] + (size_t)p * shard + o, (const char*)out_ag[p] + o, nb,
                                   cudaMemcpyHostToDevice, pull_ag));
              }
            }
          }
        }
      };
      auto fork_join = [&](cudaStream_t origin, bool join) {
        if (!join) {
          soft(cudaEventRecord(fork, origin));
          for (auto& rs : pipe_s)
            for (auto& st : rs) soft(cudaStreamWaitEvent(st, fork));
        } else {
          int i = 0;
          for (auto& rs : pipe_s)
            for (auto& st : rs) {
              soft(cudaEventRecord(joined[i], st));
              soft(cudaStreamWaitEvent(origin, joined[i]));
              ++i;
            }
        }
      };
      cudaGraphExec_t exec = nullptr;
      if (pp.graph) {
        cudaGraph_t g = nullptr;
        CK(cudaStreamBeginCapture(side_s[0], cudaStreamCaptureModeThreadLocal));
        fork_join(side_s[0], false);
        enqueue();
        fork_join(side_s[0], true);
        const cudaError_t e = cudaStreamEndCapture(side_s[0], &g);
        if (e != cudaSuccess || !api_ok || cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) {
          std::printf("%-22s %4zu MiB  graph capture failed (%s%s)\n", label, m, cudaGetErrorString(e),
                      api_ok ? "" : ", a stream memory operation was refused");
          (void)cudaGetLastError();
          if (g) cudaGraphDestroy(g);
          continue;
        }
        CK(cudaGraphDestroy(g));
      }
      std::vector<float> t;
      std::vector<double> enq;
      bool ok = true;
      for (int rep = 0; rep < 11 && ok; ++rep) {
        CK(cudaDeviceSynchronize());
        if (rep == 10) poison();
        std::fill(flags, flags + 4 * max_frames, 0u);
        *failed = 0;
        CK(cudaMemset(recv[0], 0, bytes));
        CK(cudaMemset(recv[1], 0, bytes));
        CK(cudaDeviceSynchronize());
        const auto h0 = std::chrono::steady_clock::now();
        CK(cudaEventRecord(start, s0));
        if (pp.graph) {
          CK(cudaGraphLaunch(exec, s0));
        } else {
          fork_join(s0, false);
          enqueue();
          fork_join(s0, true);
        }
        CK(cudaEventRecord(stop, s0));
        const double hus = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
        if (!api_ok) {
          std::fprintf(stderr, "a stream memory operation was refused\n");
          ok = false;
        }
        if (!wait_stop(10.0)) ok = false;
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (rep >= 2) {
          t.push_back(ms);
          enq.push_back(hus);
        }
      }
      if (exec) CK(cudaGraphExecDestroy(exec));
      if (!ok) {
        std::printf("%-22s %4zu MiB  FAILED (%s)\n", label, m, api_ok ? "a wait ran out" : "memop refused");
        continue;
      }
      std::sort(enq.begin(), enq.end());
      report(label, t, check(), enq[enq.size() / 2]);
    }
  }
  return 0;
}
