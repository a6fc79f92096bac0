// The GPU's host link, both directions at once: how much the copy engines and the SMs' own loads
// and stores into mapped pinned host memory carry, alone and together. The host transport's
// lossless kernels move every byte with SM stores (device to host) and SM loads (host to device);
// whether those two can keep the link busy both ways at once, as the copy engines can, decides
// how close to the link's both-ways floor such a kernel can come (docs/experiments.md).
//
// Built by ci/host-link.sh; run as `host_link [MiB...]` (default 4 16 64 256). One line per case
// and size: the bytes each direction carries, the median time of 9 runs (CUDA events) and the rate
// per direction.
//
// Cases (every SM kernel moves 4 KiB frames, one warp per frame, each lane's eight 16-byte loads
// issued before its first store, as the host transport's BLOCK kernels do):
//   ce_d2h, ce_h2d       one copy engine copy, one direction
//   ce_both              both at once, two streams
//   ce_both_1M           both at once, each as 1 MiB copies
//   sm_st_G, sm_ld_G     one kernel of G blocks of 256 threads, one direction
//   sm_both_G            a storing and a loading kernel of G blocks each, two streams
//   sm_st_fence_G        stores, then per frame a system fence and a flag store (BLOCK publish)
//   sm_both_fence_G      that beside a loading kernel that acquires each frame's flag first
//   ce_d2h+sm_ld_G       the copy engine writes host memory while the SMs read it
//   sm_st_G+ce_h2d       the SMs write host memory while the copy engine reads it
//   ce_*+poll_sys_W      the copy engine beside a kernel of W warps (132 blocks: 1056) whose lane 0s
//                        spin with ld.acquire.sys on one flag word in host memory until the copy
//                        stream writes it (cuStreamWriteValue32) after the copy; poll_dev_1056 spins
//                        on a device-memory word instead. Shows what a polling kernel costs the copy
//                        engine (ce+split in host_schedules.cu was slow for this; docs/experiments.md).
#include <cuda.h>

#include <functional>
#include <string>

#include "probe.cuh"

using probe::kFrameVecs;
using probe::kPerLane;

// Copies `frames` 4 KiB frames src -> dst, one warp per frame, grid-stride. With `publish`, lane 0
// fences at system scope after the warp's stores and stores `flag[f] = 1`; with `acquire`, lane 0
// first waits (bounded) for `flag[f] != 0`.
__global__ void frames_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t frames,
                            uint32_t* flags, int publish, int acquire) {
  const int lane = threadIdx.x & 31;
  const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
  const size_t warps = (gridDim.x * (size_t)blockDim.x) >> 5;
  for (size_t f = warp; f < frames; f += warps) {
    if (acquire) {
      if (lane == 0) {
        for (uint32_t spins = 0; spins < (1u << 24) && fc::ld_acquire_sys_u32(flags + f) == 0; ++spins) {
        }
      }
      __syncwarp();
    }
    uint4 v[kPerLane];
    probe::load_frame(v, src + f * kFrameVecs);
    probe::store_frame(dst + f * kFrameVecs, v);
    if (publish) {
      __syncwarp();
      if (lane == 0) {
        fc::fence_sys();
        fc::st_relaxed_sys_u32(flags + f, 1u);
      }
    }
  }
}

// Lane 0 of each of the first `warps` warps spins until `*flag == v` (at most 2 s): with
// ld.acquire.sys (host or device memory) or, with `dev`, ld.volatile (device memory).
__global__ void poll_flag(const uint32_t* flag, uint32_t v, uint32_t warps, int dev) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if ((threadIdx.x & 31) != 0 || warp >= warps) return;
  const uint64_t t0 = fc::globaltimer_ns();
  while ((dev ? fc::ld_volatile_u32(flag) : fc::ld_acquire_sys_u32(flag)) != v &&
         fc::globaltimer_ns() - t0 < 2000000000ull) {
  }
}

typedef CUresult (*WriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Bufs {
  size_t bytes;
  uint4 *dev_a, *dev_b;    // device sources / destinations
  uint4 *host_w, *host_r;  // host memory written (D2H) and read (H2D), mapped
  uint4 *host_w_dev, *host_r_dev;
  uint32_t *flags, *flags_dev;  // one per frame, host memory
};

int main(int argc, char** argv) {
  std::vector<size_t> mib;
  for (int i = 1; i < argc; ++i) mib.push_back(std::strtoull(argv[i], nullptr, 10));
  if (mib.empty()) mib = {4, 16, 64, 256};
  size_t maxb = *std::max_element(mib.begin(), mib.end()) << 20;

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs, async engines %d\n", prop.name, prop.multiProcessorCount, prop.asyncEngineCount);

  Bufs b{};
  b.bytes = maxb;
  CK(cudaMalloc(&b.dev_a, maxb));
  CK(cudaMalloc(&b.dev_b, maxb));
  CK(cudaMemset(b.dev_a, 1, maxb));
  CK(cudaHostAlloc(&b.host_w, maxb, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostAlloc(&b.host_r, maxb, cudaHostAllocMapped | cudaHostAllocPortable));
  std::fill((char*)b.host_r, (char*)b.host_r + maxb, 2);
  CK(cudaHostGetDevicePointer(&b.host_w_dev, b.host_w, 0));
  CK(cudaHostGetDevicePointer(&b.host_r_dev, b.host_r, 0));
  const size_t max_frames = maxb / (kFrameVecs * 16);
  CK(cudaHostAlloc(&b.flags, (max_frames + 1) * 4, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostGetDevicePointer(&b.flags_dev, b.flags, 0));

  WriteValue32 write_value = nullptr;
  {
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", (void**)&write_value, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      write_value = nullptr;
  }
  // The polling cases' flag: one word past the frame flags (host), or a device word.
  uint32_t* poll_dev;
  CK(cudaMalloc(&poll_dev, 4));
  CK(cudaMemset(poll_dev, 0, 4));
  uint32_t poll_epoch = 0;
  cudaStream_t s0, s1, s2;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t start, stop, d1, d2;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  CK(cudaEventCreateWithFlags(&d1, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&d2, cudaEventDisableTiming));

  // A case: work for stream 1 and stream 2 (either may be empty), started together from s0.
  using Work = std::function<void(cudaStream_t)>;
  auto run = [&](const char* name, size_t bytes, Work w1, Work w2, std::function<void()> before) {
    std::vector<float> t;
    for (int rep = 0; rep < 11; ++rep) {
      if (before) before();
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(start, s0));
      CK(cudaStreamWaitEvent(s1, start));
      CK(cudaStreamWaitEvent(s2, start));
      if (w1) w1(s1);
      if (w2) w2(s2);
      CK(cudaEventRecord(d1, s1));
      CK(cudaEventRecord(d2, s2));
      CK(cudaStreamWaitEvent(s0, d1));
      CK(cudaStreamWaitEvent(s0, d2));
      CK(cudaEventRecord(stop, s0));
      CK(cudaEventSynchronize(stop));
      float ms;
      CK(cudaEventElapsedTime(&ms, start, stop));
      if (rep >= 2) t.push_back(ms);
    }
    const float ms = probe::median(t);
    std::printf("%-22s %6zu MiB  %10.1f us  %7.1f GB/s per direction\n", name, bytes >> 20, ms * 1e3,
                bytes / (ms * 1e-3) / 1e9);
    std::fflush(stdout);
  };

  for (size_t m : mib) {
    const size_t bytes = m << 20;
    const size_t frames = bytes / (kFrameVecs * 16);
    auto d2h = [&, bytes](cudaStream_t s) { CK(cudaMemcpyAsync(b.host_w, b.dev_a, bytes, cudaMemcpyDeviceToHost, s)); };
    auto h2d = [&, bytes](cudaStream_t s) { CK(cudaMemcpyAsync(b.dev_b, b.host_r, bytes, cudaMemcpyHostToDevice, s)); };
    auto chunked = [&, bytes](bool down) {
      return [&, bytes, down](cudaStream_t s) {
        const size_t c = 1u << 20;
        for (size_t o = 0; o < bytes; o += c) {
          const size_t n = std::min(c, bytes - o);
          if (down)
            CK(cudaMemcpyAsync((char*)b.host_w + o, (char*)b.dev_a + o, n, cudaMemcpyDeviceToHost, s));
          else
            CK(cudaMemcpyAsync((char*)b.dev_b + o, (char*)b.host_r + o, n, cudaMemcpyHostToDevice, s));
        }
      };
    };
    auto st = [&, frames](int g, int publish) {
      return [&, frames, g, publish](cudaStream_t s) {
        frames_copy<<<g, 256, 0, s>>>(b.dev_a, b.host_w_dev, frames, b.flags_dev, publish, 0);
        CK(cudaGetLastError());
      };
    };
    auto ld = [&, frames](int g, int acquire) {
      return [&, frames, g, acquire](cudaStream_t s) {
        frames_copy<<<g, 256, 0, s>>>(b.host_r_dev, b.dev_b, frames, b.flags_dev, 0, acquire);
        CK(cudaGetLastError());
      };
    };
    auto flags_set = [&, frames]() { std::fill(b.flags, b.flags + frames, 1u); };
    auto flags_clear = [&, frames]() { std::fill(b.flags, b.flags + frames, 0u); };

    run("ce_d2h", bytes, d2h, nullptr, nullptr);
    run("ce_h2d", bytes, h2d, nullptr, nullptr);
    run("ce_both", bytes, d2h, h2d, nullptr);
    run("ce_both_1M", bytes, chunked(true), chunked(false), nullptr);
    for (int g : {66, 132, 264}) {
      std::string n = std::to_string(g);
      run(("sm_st_" + n).c_str(), bytes, st(g, 0), nullptr, nullptr);
      run(("sm_ld_" + n).c_str(), bytes, ld(g, 0), nullptr, nullptr);
      run(("sm_both_" + n).c_str(), bytes, st(g, 0), ld(g, 0), nullptr);
    }
    run("sm_st_fence_132", bytes, st(132, 1), nullptr, flags_clear);
    run("sm_ld_acquire_132", bytes, ld(132, 1), nullptr, flags_set);
    // One flag array: set beforehand, so the loader never waits and the storer's flags (1 over
    // 1) change nothing; both pay their protocol's cost and nothing else.
    run("sm_both_fence_132", bytes, st(132, 1), ld(132, 1), flags_set);
    run("ce_d2h+sm_ld_132", bytes, d2h, ld(132, 0), nullptr);
    run("sm_st_132+ce_h2d", bytes, st(132, 0), h2d, nullptr);
    if (write_value) {
      // The copy, then a flag write that ends the poller.
      auto then_flag = [&](Work w, bool dev) {
        return [&, w, dev](cudaStream_t s) {
          w(s);
          uint32_t* f = dev ? poll_dev : b.flags_dev + max_frames;
          if (write_value((CUstream)s, (CUdeviceptr)f, poll_epoch, 0) != CUDA_SUCCESS) {
            std::fprintf(stderr, "cuStreamWriteValue32 failed\n");
            std::exit(1);
          }
        };
      };
      auto poll = [&](uint32_t warps, bool dev) {
        return [&, warps, dev](cudaStream_t s) {
          poll_flag<<<132, 256, 0, s>>>(dev ? poll_dev : b.flags_dev + max_frames, poll_epoch, warps, dev ? 1 : 0);
          CK(cudaGetLastError());
        };
      };
      auto next = [&]() { ++poll_epoch; };
      // The poller on stream 1 (launched first, so resident before the copy starts), the copy on 2.
      run("ce_d2h+poll_sys_1", bytes, poll(1, false), then_flag(d2h, false), next);
      run("ce_d2h+poll_sys_32", bytes, poll(32, false), then_flag(d2h, false), next);
      run("ce_d2h+poll_sys_1056", bytes, poll(1056, false), then_flag(d2h, false), next);
      run("ce_d2h+poll_dev_1056", bytes, poll(1056, true), then_flag(d2h, true), next);
      run("ce_h2d+poll_sys_1056", bytes, poll(1056, false), then_flag(h2d, false), next);
      run("ce_both_1M+poll_sys_32", bytes, poll(32, false),
          then_flag([&](cudaStream_t s) { chunked(true)(s); chunked(false)(s); }, false), next);
    }
  }
  return 0;
}
