/* The per-call path of a served collective allocates nothing, measured through the exported C
 * API: this program replaces malloc and its relatives (the executable's definitions take
 * precedence over libc's for every library in the process, flashcomm's Rust allocator
 * included), creates a world-size-1 communicator through flashcomm's libnccl.so on device 0,
 * warms up, then counts the allocations this thread makes during 1,000 calls of each of
 * ncclAllReduce, ncclReduceScatter and ncclAllGather (bf16, 8 KiB), and checks with
 * flashcommGetStats that flashcomm's lossless kernels took every one of them.
 *
 *   alloc_count PATH/libnccl.so        (exit 0: no allocation; 1: allocations or wrong route)
 *
 * The real NCCL is found by flashcomm as usual (FLASHCOMM_NCCL_LIB or its discovery). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- counting allocator ---- */
extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static __thread int counting;
static __thread long allocations;

static inline void note(void) {
  if (counting) allocations++;
}
void* malloc(size_t n) { note(); return __libc_malloc(n); }
void* calloc(size_t a, size_t b) { note(); return __libc_calloc(a, b); }
void* realloc(void* p, size_t n) { note(); return __libc_realloc(p, n); }
void* memalign(size_t a, size_t n) { note(); return __libc_memalign(a, n); }
void* aligned_alloc(size_t a, size_t n) { note(); return __libc_memalign(a, n); }
int posix_memalign(void** out, size_t a, size_t n) {
  note();
  void* p = __libc_memalign(a, n);
  if (!p) return 12; /* ENOMEM */
  *out = p;
  return 0;
}
void free(void* p) { __libc_free(p); }

/* ---- the bits of the CUDA driver and NCCL APIs this program needs ---- */
typedef struct { char internal[128]; } unique_id_t;
typedef int (*get_uid_t)(unique_id_t*);
typedef int (*init_rank_t)(void**, int, unique_id_t, int);
typedef int (*coll_t)(const void*, void*, size_t, int, int, void*, void*);
typedef int (*gather_t)(const void*, void*, size_t, int, void*, void*);
typedef int (*destroy_t)(void*);
typedef struct { uint64_t calls[3][8]; uint64_t bytes[3][8]; } stats_t;
typedef int (*stats_fn_t)(void*, stats_t*);
enum { BF16 = 9, SUM = 0, LOSSLESS = 1, ALLREDUCE = 0, REDUCESCATTER = 1, ALLGATHER = 2 };

static void* need(void* h, const char* name) {
  void* p = dlsym(h, name);
  if (!p) { fprintf(stderr, "missing %s\n", name); exit(2); }
  return p;
}

#define CU(call)                                                   \
  do {                                                             \
    int rc_ = (call);                                              \
    if (rc_ != 0) { fprintf(stderr, "%s: %d\n", #call, rc_); exit(2); } \
  } while (0)

int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: alloc_count PATH/libnccl.so\n"); return 2; }
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
  void* ctx = NULL;
  void* stream = NULL;
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
  get_uid_t get_uid = need(nccl, "ncclGetUniqueId");
  init_rank_t init_rank = need(nccl, "ncclCommInitRank");
  coll_t all_reduce = need(nccl, "ncclAllReduce");
  coll_t reduce_scatter = need(nccl, "ncclReduceScatter");
  gather_t all_gather = need(nccl, "ncclAllGather");
  destroy_t destroy = need(nccl, "ncclCommDestroy");
  stats_fn_t get_stats = need(nccl, "flashcommGetStats");

  unique_id_t id;
  void* comm = NULL;
  CU(get_uid(&id));
  CU(init_rank(&comm, 1, id, 0));
  const size_t count = 4096; /* 8 KiB of bf16: a decode-size message */
  const char* names[3] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather"};
  const int kinds[3] = {ALLREDUCE, REDUCESCATTER, ALLGATHER};
  int failures = 0;
  for (int k = 0; k < 3; k++) {
    stats_t before, after;
    for (int round = 0; round < 2; round++) {
      int calls = round == 0 ? 20 : 1000; /* warm-up (first-use log lines), then measured */
      if (round == 1) CU(get_stats(comm, &before));
      counting = round;
      allocations = 0;
      for (int i = 0; i < calls; i++) {
        int rc;
        if (k == 0) rc = all_reduce((void*)send, (void*)recv, count, BF16, SUM, comm, stream);
        else if (k == 1) rc = reduce_scatter((void*)send, (void*)recv, count, BF16, SUM, comm, stream);
        else rc = all_gather((void*)send, (void*)recv, count, BF16, comm, stream);
        if (rc != 0) { counting = 0; fprintf(stderr, "%s: %d\n", names[k], rc); return 2; }
      }
      counting = 0;
      CU(cuStreamSynchronize(stream));
    }
    CU(get_stats(comm, &after));
    uint64_t served = after.calls[LOSSLESS][kinds[k]] - before.calls[LOSSLESS][kinds[k]];
    int ok = allocations == 0 && served == 1000;
    printf("%s %s: 1000 calls, %ld allocations, %llu on flashcomm's lossless kernels\n",
           ok ? "PASS" : "FAIL", names[k], allocations, (unsigned long long)served);
    if (!ok) failures++;
  }
  CU(destroy(comm));
  printf("%d passed, %d failed\n", 3 - failures, failures);
  return failures == 0 ? 0 : 1;
}
