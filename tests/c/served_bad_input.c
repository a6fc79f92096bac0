/* Bad input on a communicator flashcomm serves (GPU machine): a world-size-1 communicator
 * through flashcomm's libnccl.so on device 0, then
 *   - a NULL buffer with a count: refused by flashcomm (its kernels would fault), with a message;
 *   - count 0, a datatype past the pinned header, a negative operator: given to the real library
 *     as they are (its answer is the answer), and not counted;
 *   - a good call after them: still served by flashcomm's kernels.
 * Prints one line per check and exits 0 when every check passed.
 *
 *   served_bad_input PATH/libnccl.so
 *
 * The real NCCL is found by flashcomm as usual (FLASHCOMM_NCCL_LIB or its discovery); the
 * one-rank stand-in of tests/c/solo does. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef struct { char internal[128]; } unique_id_t;
typedef struct { uint64_t calls[3][8]; uint64_t bytes[3][8]; } stats_t;
typedef int (*coll_t)(const void*, void*, size_t, int, int, void*, void*);

static void* need(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) { fprintf(stderr, "missing %s\n", name); _exit(2); }
  return p;
}

static int failures;
#define CHECK(cond, ...)                     \
  do {                                       \
    if (cond) printf("PASS ");               \
    else { printf("FAIL "); failures++; }    \
    printf(__VA_ARGS__);                     \
    printf("\n");                            \
  } while (0)
#define CU(x) do { int r_ = (x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); return 2; } } while (0)

int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: served_bad_input PATH/libnccl.so\n"); return 2; }
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cuda) { fprintf(stderr, "no CUDA driver: %s\n", dlerror()); return 2; }
  int (*cuInit)(unsigned) = need(cuda, "cuInit");
  int (*cuDeviceGet)(int*, int) = need(cuda, "cuDeviceGet");
  int (*cuDevicePrimaryCtxRetain)(void**, int) = need(cuda, "cuDevicePrimaryCtxRetain");
  int (*cuCtxSetCurrent)(void*) = need(cuda, "cuCtxSetCurrent");
  int (*cuMemAlloc)(uint64_t*, size_t) = need(cuda, "cuMemAlloc_v2");
  int (*cuStreamCreate)(void**, unsigned) = need(cuda, "cuStreamCreate");
  int (*cuStreamSynchronize)(void*) = need(cuda, "cuStreamSynchronize");
  int dev = 0;
  void *ctx = NULL, *stream = NULL;
  uint64_t send = 0, recv = 0;
  CU(cuInit(0));
  CU(cuDeviceGet(&dev, 0));
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  CU(cuMemAlloc(&send, 1 << 20));
  CU(cuMemAlloc(&recv, 1 << 20));
  CU(cuStreamCreate(&stream, 1));

  void* nccl = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!nccl) { fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror()); return 2; }
  int (*get_uid)(unique_id_t*) = need(nccl, "ncclGetUniqueId");
  int (*init_rank)(void**, int, unique_id_t, int) = need(nccl, "ncclCommInitRank");
  coll_t all_reduce = need(nccl, "ncclAllReduce");
  int (*destroy)(void*) = need(nccl, "ncclCommDestroy");
  const char* (*last_error)(void*) = need(nccl, "ncclGetLastError");
  int (*get_stats)(void*, stats_t*) = need(nccl, "flashcommGetStats");
  typedef struct { int served, rank, nranks, device; uint64_t arena; char reason[256]; } info_t;
  int (*get_info)(void*, info_t*) = need(nccl, "flashcommCommGetInfo");

  unique_id_t id;
  void* comm = NULL;
  CU(get_uid(&id));
  CU(init_rank(&comm, 1, id, 0));
  info_t info;
  CU(get_info(comm, &info));
  CHECK(info.served == 1, "the communicator is served by flashcomm's kernels (%s)", info.reason);

  const int BF16 = 9, SUM = 0, LOSSLESS = 1, ALLREDUCE = 0;
  const size_t count = 4096;
  stats_t before, after;
  CU(get_stats(comm, &before));
  int rc = all_reduce(NULL, (void*)recv, count, BF16, SUM, comm, stream);
  CHECK(rc == 4 && strstr(last_error(NULL), "sendbuff is NULL with count 4096"),
        "a NULL send buffer is refused by flashcomm: %d, %s", rc, last_error(NULL));
  rc = all_reduce((void*)send, NULL, count, BF16, SUM, comm, stream);
  CHECK(rc == 4 && strstr(last_error(NULL), "recvbuff is NULL"),
        "a NULL receive buffer is refused by flashcomm: %d, %s", rc, last_error(NULL));
  rc = all_reduce(NULL, NULL, 0, BF16, SUM, comm, stream);
  int rc_dt = all_reduce((void*)send, (void*)recv, count, 12, SUM, comm, stream);
  int rc_op = all_reduce((void*)send, (void*)recv, count, BF16, -1, comm, stream);
  printf("     count 0 -> %d, datatype 12 -> %d, operator -1 -> %d (the real library's answers)\n",
         rc, rc_dt, rc_op);
  CU(get_stats(comm, &after));
  CHECK(after.calls[0][ALLREDUCE] == before.calls[0][ALLREDUCE]
            && after.calls[LOSSLESS][ALLREDUCE] == before.calls[LOSSLESS][ALLREDUCE],
        "refused and forwarded bad calls are not counted");
  rc = all_reduce((void*)send, (void*)recv, count, BF16, SUM, comm, stream);
  CU(cuStreamSynchronize(stream));
  CU(get_stats(comm, &after));
  CHECK(rc == 0 && after.calls[LOSSLESS][ALLREDUCE] == before.calls[LOSSLESS][ALLREDUCE] + 1,
        "a good call after them is served by flashcomm's kernels (%d)", rc);
  CU(destroy(comm));
  printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
