/* Exercises flashcomm's libnccl.so.2 through NCCL's own header, as a C program linked with
 * -lnccl would. Without arguments it checks what works on any machine (versions, error strings,
 * argument checks, the last error); with --gpu it also creates a world-size-1 communicator on
 * device 0 and runs all-reduces (the CUDA driver is loaded at run time, so the program links
 * without CUDA libraries).
 *
 *   abi_smoke [--expect-version N] [--gpu]
 *
 * Prints one PASS/FAIL line per check and exits with the number of failures. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nccl.h"
/* flashcomm's extension header (include/), when the build passes it; else the two declarations
 * this program needs. */
#if defined(__has_include)
#if __has_include("flashcomm.h")
#include "flashcomm.h"
#define HAVE_FLASHCOMM_H 1
#endif
#endif
#ifndef HAVE_FLASHCOMM_H
typedef struct { uint64_t calls[3][8]; uint64_t bytes[3][8]; } flashcommStats_t;
#define FLASHCOMM_ROUTE_NCCL 0
#define FLASHCOMM_ROUTE_LOSSLESS 1
#define FLASHCOMM_COLL_ALLREDUCE 0
#define FLASHCOMM_COLL_ALLTOALL 3
#define FLASHCOMM_COLL_SEND 6
#define FLASHCOMM_COLL_RECV 7
#define FLASHCOMM_REASON_BYTES 256
typedef struct {
  int rs_bits, ag_bits, group, spikes;
  size_t min_bytes, max_bytes;
  int allgather_bits, reducescatter_bits, alltoall_bits;
} flashcommQuantConfig_t;
typedef struct {
  int served, rank, nranks, device;
  uint64_t arena_bytes;
  char reason[FLASHCOMM_REASON_BYTES];
} flashcommCommInfo_t;
ncclResult_t flashcommGetVersion(int* version);
ncclResult_t flashcommGetStats(ncclComm_t comm, flashcommStats_t* stats);
ncclResult_t flashcommGetConfigString(char* buf, size_t len);
ncclResult_t flashcommCommSetQuant(ncclComm_t comm, const flashcommQuantConfig_t* config);
ncclResult_t flashcommCommGetQuant(ncclComm_t comm, flashcommQuantConfig_t* config);
ncclResult_t flashcommCommGetInfo(ncclComm_t comm, flashcommCommInfo_t* info);
#endif

static int failures = 0;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (cond) {                                            \
      printf("PASS %s\n", #cond);                          \
    } else {                                               \
      printf("FAIL %s: ", #cond);                          \
      printf(__VA_ARGS__);                                 \
      printf("\n");                                        \
      failures++;                                          \
    }                                                      \
  } while (0)

static int contains(const char* s, const char* part) { return s != NULL && strstr(s, part) != NULL; }

static void cpu_checks(int expect_version) {
  int v = 0, pv = 0;
  CHECK(ncclGetVersion(&v) == ncclSuccess, "%s", ncclGetLastError(NULL));
  if (expect_version) CHECK(v == expect_version, "got %d, expected %d", v, expect_version);
  else CHECK(v >= NCCL_VERSION(2, 18, 0), "got %d", v);
  CHECK(pncclGetVersion(&pv) == ncclSuccess && pv == v, "pnccl twin: %d", pv);

  CHECK(strcmp(ncclGetErrorString(ncclSuccess), "no error") == 0, "%s", ncclGetErrorString(ncclSuccess));
  CHECK(strcmp(ncclGetErrorString(ncclInvalidArgument),
               "invalid argument (run with NCCL_DEBUG=WARN for details)") == 0, "wording");
  CHECK(strcmp(ncclGetErrorString((ncclResult_t)99), "unknown result code") == 0, "unknown code");

  /* Bad calls are answered by the real NCCL, as without flashcomm: a handle that is not a
   * communicator (zeroed memory NCCL can read) is "corrupted", whatever else the call says. */
  float host[4] = {1, 2, 3, 4};
  ncclComm_t foreign = (ncclComm_t)calloc(1, 64u << 20);
  CHECK(foreign != NULL, "calloc");
  CHECK(ncclAllReduce(host, host, 4, ncclFloat32, ncclSum, NULL, NULL) == ncclInvalidArgument, "null comm");
  CHECK(contains(ncclGetLastError(NULL), "comm argument is NULL"), "%s", ncclGetLastError(NULL));
  CHECK(ncclAllReduce(host, host, 4, (ncclDataType_t)ncclNumTypes, ncclSum, foreign, NULL) == ncclInvalidArgument, "datatype");
  CHECK(contains(ncclGetLastError(NULL), "corrupted comm object"), "%s", ncclGetLastError(NULL));
  CHECK(ncclAllReduce(host, host, 4, ncclFloat32, (ncclRedOp_t)-1, foreign, NULL) == ncclInvalidArgument, "operator");
  CHECK(ncclAllReduce(NULL, NULL, 0, ncclFloat32, ncclSum, foreign, NULL) == ncclInvalidArgument, "count 0");
  CHECK(ncclBroadcast(host, NULL, 4, ncclFloat32, 0, foreign, NULL) == ncclInvalidArgument, "null recvbuff");
  CHECK(ncclReduceScatter(NULL, host, 1, ncclFloat32, ncclSum, foreign, NULL) == ncclInvalidArgument, "null sendbuff");
  CHECK(ncclSend(NULL, 0, ncclFloat32, 0, foreign, NULL) == ncclInvalidArgument, "send count 0");
  CHECK(ncclAllGatherConfig(host, host, 1, ncclFloat32, NULL, NULL, NULL) == ncclInvalidArgument, "config variant");
  CHECK(ncclGroupStart() == ncclSuccess, "group start");
  CHECK(ncclAllReduce(host, host, 4, ncclFloat32, ncclSum, NULL, NULL) == ncclInvalidArgument, "null comm in a group");
  CHECK(ncclGroupEnd() == ncclInvalidArgument, "the group's result is the failed call's");
  free(foreign);
  /* flashcomm's own API refuses what it does not know, with a message. */
  flashcommStats_t stats;
  CHECK(flashcommGetStats((ncclComm_t)(uintptr_t)0x10, &stats) == ncclInvalidArgument, "unknown communicator");
  CHECK(contains(ncclGetLastError(NULL), "is not known to flashcomm"), "%s", ncclGetLastError(NULL));

  int fv = 0;
  CHECK(flashcommGetVersion(&fv) == ncclSuccess && fv > 0, "flashcomm version %d", fv);
  char cfg[4096];
  CHECK(flashcommGetConfigString(cfg, sizeof cfg) == ncclSuccess && contains(cfg, "passthrough="), "%s", cfg);
}

/* CUDA driver API, loaded at run time. */
typedef int (*cuInit_t)(unsigned);
typedef int (*cuDeviceGet_t)(int*, int);
typedef int (*cuPrimaryCtxRetain_t)(void**, int);
typedef int (*cuCtxSetCurrent_t)(void*);
typedef int (*cuMemAlloc_t)(unsigned long long*, size_t);
typedef int (*cuMemFree_t)(unsigned long long);
typedef int (*cuMemcpyHtoD_t)(unsigned long long, const void*, size_t);
typedef int (*cuMemcpyDtoH_t)(void*, unsigned long long, size_t);
typedef int (*cuCtxSynchronize_t)(void);

static void* need(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) { printf("FAIL missing %s\n", name); exit(100); }
  return p;
}

static void gpu_checks(void) {
  void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  CHECK(cu != NULL, "libcuda.so.1: %s", dlerror());
  if (!cu) return;
  cuInit_t cuInit = (cuInit_t)need(cu, "cuInit");
  cuDeviceGet_t cuDeviceGet = (cuDeviceGet_t)need(cu, "cuDeviceGet");
  cuPrimaryCtxRetain_t retain = (cuPrimaryCtxRetain_t)need(cu, "cuDevicePrimaryCtxRetain");
  cuCtxSetCurrent_t setCurrent = (cuCtxSetCurrent_t)need(cu, "cuCtxSetCurrent");
  cuMemAlloc_t memAlloc = (cuMemAlloc_t)need(cu, "cuMemAlloc_v2");
  cuMemFree_t memFree = (cuMemFree_t)need(cu, "cuMemFree_v2");
  cuMemcpyHtoD_t htod = (cuMemcpyHtoD_t)need(cu, "cuMemcpyHtoD_v2");
  cuMemcpyDtoH_t dtoh = (cuMemcpyDtoH_t)need(cu, "cuMemcpyDtoH_v2");
  cuCtxSynchronize_t sync = (cuCtxSynchronize_t)need(cu, "cuCtxSynchronize");

  int dev = 0; void* ctx = NULL;
  CHECK(cuInit(0) == 0 && cuDeviceGet(&dev, 0) == 0 && retain(&ctx, dev) == 0 && setCurrent(ctx) == 0, "CUDA context");

  ncclUniqueId id;
  ncclComm_t comm = NULL;
  CHECK(ncclGetUniqueId(&id) == ncclSuccess, "%s", ncclGetLastError(NULL));
  CHECK(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess && comm != NULL, "%s", ncclGetLastError(NULL));
  int count = 0, rank = -1;
  CHECK(ncclCommCount(comm, &count) == ncclSuccess && count == 1, "count %d", count);
  CHECK(ncclCommUserRank(comm, &rank) == ncclSuccess && rank == 0, "rank %d", rank);

  enum { N = 1 << 20 };
  float* host = (float*)malloc(N * sizeof(float));
  float* back = (float*)malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) host[i] = (float)(i % 1000) * 0.5f;
  unsigned long long a = 0, b = 0;
  CHECK(memAlloc(&a, N * sizeof(float)) == 0 && memAlloc(&b, N * sizeof(float)) == 0, "alloc");
  htod(a, host, N * sizeof(float));
  CHECK(ncclAllReduce((void*)a, (void*)b, N, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess,
        "out of place: %s", ncclGetLastError(comm));
  CHECK(ncclAllReduce((void*)a, (void*)a, N, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess,
        "in place: %s", ncclGetLastError(comm));
  sync();
  dtoh(back, b, N * sizeof(float));
  CHECK(memcmp(back, host, N * sizeof(float)) == 0, "out-of-place result differs");
  dtoh(back, a, N * sizeof(float));
  CHECK(memcmp(back, host, N * sizeof(float)) == 0, "in-place result differs");

  /* A world-size-1 communicator of one GPU is served by flashcomm's kernels: both all-reduces
   * took the lossless route. */
  flashcommCommInfo_t info;
  memset(&info, 0, sizeof info);
  CHECK(flashcommCommGetInfo(comm, &info) == ncclSuccess, "%s", ncclGetLastError(NULL));
  CHECK(info.served == 1, "not served: %s", info.reason);
  CHECK(info.rank == 0 && info.nranks == 1 && info.device == 0, "rank %d of %d on device %d",
        info.rank, info.nranks, info.device);
  CHECK(info.served == 0 || info.arena_bytes > 0, "arena %llu", (unsigned long long)info.arena_bytes);
  int route = info.served ? FLASHCOMM_ROUTE_LOSSLESS : FLASHCOMM_ROUTE_NCCL;
  flashcommStats_t stats;
  CHECK(flashcommGetStats(comm, &stats) == ncclSuccess, "%s", ncclGetLastError(NULL));
  CHECK(stats.calls[route][FLASHCOMM_COLL_ALLREDUCE] == 2, "calls %llu on route %d",
        (unsigned long long)stats.calls[route][FLASHCOMM_COLL_ALLREDUCE], route);
  CHECK(stats.bytes[route][FLASHCOMM_COLL_ALLREDUCE] == 2ull * N * sizeof(float), "bytes");

  /* NCCL_CHECK_POINTERS=1 (read once, at the first call): a host buffer on flashcomm's path is
   * refused with ncclInvalidArgument and a message, as NCCL refuses it; device buffers pass. */
  const char* cp = getenv("NCCL_CHECK_POINTERS");
  if (cp && strcmp(cp, "1") == 0) {
    CHECK(ncclAllReduce(host, (void*)b, N, ncclFloat32, ncclSum, comm, NULL) == ncclInvalidArgument,
          "a host send buffer passed NCCL_CHECK_POINTERS");
    const char* msg = ncclGetLastError(comm);
    CHECK(strstr(msg, "sendbuff") != NULL && strstr(msg, "NCCL_CHECK_POINTERS") != NULL, "message: %s", msg);
    CHECK(ncclAllReduce((void*)a, host, N, ncclFloat32, ncclSum, comm, NULL) == ncclInvalidArgument,
          "a host receive buffer passed NCCL_CHECK_POINTERS");
    CHECK(ncclAllReduce((void*)a, (void*)b, N, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess,
          "device buffers refused: %s", ncclGetLastError(comm));
    sync();
    printf("NCCL_CHECK_POINTERS=1: host buffers refused, device buffers pass\n");
  }

  /* A Send/Recv group that forms an all-to-all (for one rank: one send to itself and one receive
   * from itself, as PyTorch's all_to_all_single with split sizes issues it). With
   * FLASHCOMM_GROUPED_ALLTOALL=1 flashcomm's AllToAll runs it (one alltoall call on the lossless
   * route, no send or receive reaches NCCL); without, NCCL runs it (one send and one receive on
   * the NCCL route). The result is exact either way. */
  {
    const char* ga = getenv("FLASHCOMM_GROUPED_ALLTOALL");
    const int grouped = ga && strcmp(ga, "1") == 0;
    flashcommStats_t s0, s1;
    float* zero = (float*)calloc(N, sizeof(float));
    htod(b, zero, N * sizeof(float));
    CHECK(flashcommGetStats(comm, &s0) == ncclSuccess, "%s", ncclGetLastError(NULL));
    CHECK(ncclGroupStart() == ncclSuccess, "group start");
    CHECK(ncclSend((void*)a, N, ncclFloat32, 0, comm, NULL) == ncclSuccess, "send: %s", ncclGetLastError(comm));
    CHECK(ncclRecv((void*)b, N, ncclFloat32, 0, comm, NULL) == ncclSuccess, "recv: %s", ncclGetLastError(comm));
    CHECK(ncclGroupEnd() == ncclSuccess, "group end: %s", ncclGetLastError(comm));
    sync();
    dtoh(back, b, N * sizeof(float));
    CHECK(memcmp(back, host, N * sizeof(float)) == 0, "the Send/Recv group's result differs");
    CHECK(flashcommGetStats(comm, &s1) == ncclSuccess, "%s", ncclGetLastError(NULL));
#define MOVED(r, k) (s1.calls[r][k] - s0.calls[r][k])
    if (grouped) {
      CHECK(MOVED(FLASHCOMM_ROUTE_LOSSLESS, FLASHCOMM_COLL_ALLTOALL) == 1 &&
                MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_SEND) == 0 &&
                MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_RECV) == 0,
            "grouped all-to-all: alltoall %llu, send %llu, recv %llu",
            (unsigned long long)MOVED(FLASHCOMM_ROUTE_LOSSLESS, FLASHCOMM_COLL_ALLTOALL),
            (unsigned long long)MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_SEND),
            (unsigned long long)MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_RECV));
    } else {
      CHECK(MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_SEND) == 1 &&
                MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_RECV) == 1 &&
                MOVED(FLASHCOMM_ROUTE_LOSSLESS, FLASHCOMM_COLL_ALLTOALL) == 0,
            "Send/Recv group: send %llu, recv %llu on NCCL",
            (unsigned long long)MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_SEND),
            (unsigned long long)MOVED(FLASHCOMM_ROUTE_NCCL, FLASHCOMM_COLL_RECV));
    }
#undef MOVED
    printf("Send/Recv all-to-all group of one rank: %s, exact\n",
           grouped ? "flashcomm's AllToAll" : "NCCL");
    free(zero);
  }

  /* Per-communicator quantization settings: set, read back, invalid ones refused, reset. */
  flashcommQuantConfig_t q = {4, 8, 64, 2, 4096, 1 << 20, 8, 16, 4}, got;
  CHECK(flashcommCommSetQuant(comm, &q) == ncclSuccess, "%s", ncclGetLastError(NULL));
  memset(&got, 0, sizeof got);
  CHECK(flashcommCommGetQuant(comm, &got) == ncclSuccess && got.rs_bits == 4 && got.ag_bits == 8 &&
            got.group == 64 && got.spikes == 2 && got.min_bytes == 4096 && got.max_bytes == (1 << 20) &&
            got.allgather_bits == 8 && got.reducescatter_bits == 16 && got.alltoall_bits == 4,
        "got %d/%d/%d/%d, %d/%d/%d", got.rs_bits, got.ag_bits, got.group, got.spikes, got.allgather_bits,
        got.reducescatter_bits, got.alltoall_bits);
  q.group = 100;
  CHECK(flashcommCommSetQuant(comm, &q) == ncclInvalidArgument, "group 100 accepted");
  CHECK(flashcommCommSetQuant(comm, NULL) == ncclSuccess, "%s", ncclGetLastError(NULL));
  CHECK(flashcommCommGetQuant(comm, &got) == ncclSuccess && got.rs_bits == 16, "reset: %d", got.rs_bits);

  CHECK(ncclCommDestroy(comm) == ncclSuccess, "%s", ncclGetLastError(NULL));
  CHECK(flashcommCommGetInfo(comm, &info) == ncclInvalidArgument, "destroyed communicator still known");
  memFree(a); memFree(b);
  free(host); free(back);
}

int main(int argc, char** argv) {
  int gpu = 0, expect_version = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--gpu") == 0) gpu = 1;
    else if (strcmp(argv[i], "--expect-version") == 0 && i + 1 < argc) expect_version = atoi(argv[++i]);
    else { fprintf(stderr, "usage: %s [--expect-version N] [--gpu]\n", argv[0]); return 2; }
  }
  cpu_checks(expect_version);
  if (gpu) gpu_checks();
  printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
  return failures;
}
