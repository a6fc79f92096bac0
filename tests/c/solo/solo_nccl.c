/* A one-rank stand-in for the real NCCL, for lifecycle tests on a GPU machine: communicators of
 * one rank whose collectives are device copies on the caller's stream. The real ncclCommDestroy
 * takes about half a second per communicator, which makes a thousand create/split/destroy cycles
 * through the real NCCL last a quarter of an hour; with this library in its place
 * (FLASHCOMM_NCCL_LIB) the same cycles exercise everything flashcomm does per communicator (set-up
 * exchange, arena, streams, events, teardown) in seconds. Only what a one-rank job calls exists;
 * every communicator is a heap object freed by destroy or abort, so the stand-in itself leaks
 * nothing. Built by ci/gpu-bundle.sh as c/libsolo_nccl.so; never used outside tests.
 *
 *   cc -O2 -shared -fPIC -o libsolo_nccl.so tests/c/solo/solo_nccl.c -ldl
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OK = 0, UNHANDLED_CUDA = 1, INVALID_ARGUMENT = 4 };
enum { MAGIC = 0x50105010 };

typedef struct { char internal[128]; } unique_id_t;
typedef struct { int magic, device; } solo_comm;

static int (*cu_ctx_get_device)(int*);
static int (*cu_copy)(uint64_t, uint64_t, size_t, void*);
static const char* last_error = "";

static int load_cuda(void) {
  if (cu_copy) return 1;
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cuda) return 0;
  cu_ctx_get_device = (int (*)(int*))dlsym(cuda, "cuCtxGetDevice");
  cu_copy = (int (*)(uint64_t, uint64_t, size_t, void*))dlsym(cuda, "cuMemcpyDtoDAsync_v2");
  return cu_ctx_get_device && cu_copy;
}

static int fail(int code, const char* why) {
  last_error = why;
  return code;
}

static int valid(void* comm) { return comm && ((solo_comm*)comm)->magic == MAGIC; }

static size_t type_bytes(int dt) {
  switch (dt) {
    case 0: case 1: case 10: case 11: return 1; /* int8, uint8, fp8 e4m3, fp8 e5m2 */
    case 6: case 9: return 2;                   /* float16, bfloat16 */
    case 2: case 3: case 7: return 4;           /* int32, uint32, float32 */
    case 4: case 5: case 8: return 8;           /* int64, uint64, float64 */
    default: return 0;
  }
}

int ncclGetVersion(int* version) { *version = 22809; return OK; }
const char* ncclGetErrorString(int result) { return result == OK ? "no error" : "solo NCCL error"; }
const char* ncclGetLastError(void* comm) { (void)comm; return last_error; }

int ncclGetUniqueId(unique_id_t* id) {
  static uint64_t next = 1;
  memset(id, 0, sizeof *id);
  memcpy(id->internal, &next, sizeof next);
  next++;
  return OK;
}

static int new_comm(void** out, int nranks, int rank) {
  if (!out) return fail(INVALID_ARGUMENT, "solo NCCL: null communicator pointer");
  if (nranks != 1 || rank != 0) return fail(INVALID_ARGUMENT, "solo NCCL: one rank only");
  if (!load_cuda()) return fail(UNHANDLED_CUDA, "solo NCCL: no CUDA driver");
  int device = 0;
  if (cu_ctx_get_device(&device) != 0) return fail(UNHANDLED_CUDA, "solo NCCL: no current CUDA context");
  solo_comm* c = malloc(sizeof *c);
  if (!c) return fail(UNHANDLED_CUDA, "solo NCCL: out of memory");
  c->magic = MAGIC;
  c->device = device;
  *out = c;
  return OK;
}

int ncclCommInitRank(void** comm, int nranks, unique_id_t id, int rank) {
  (void)id;
  return new_comm(comm, nranks, rank);
}

int ncclCommInitRankConfig(void** comm, int nranks, unique_id_t id, int rank, void* config) {
  (void)id;
  (void)config;
  return new_comm(comm, nranks, rank);
}

int ncclCommSplit(void* comm, int color, int key, void** newcomm, void* config) {
  (void)key;
  (void)config;
  if (!valid(comm) || !newcomm) return fail(INVALID_ARGUMENT, "solo NCCL: bad split arguments");
  if (color < 0) { /* NCCL_SPLIT_NOCOLOR */
    *newcomm = NULL;
    return OK;
  }
  return new_comm(newcomm, 1, 0);
}

static int release(void* comm) {
  if (!valid(comm)) return fail(INVALID_ARGUMENT, "solo NCCL: not a communicator");
  ((solo_comm*)comm)->magic = 0;
  free(comm);
  return OK;
}

int ncclCommDestroy(void* comm) { return release(comm); }
int ncclCommAbort(void* comm) { return release(comm); }
int ncclCommFinalize(void* comm) { return valid(comm) ? OK : fail(INVALID_ARGUMENT, "solo NCCL: not a communicator"); }
int ncclCommCount(void* comm, int* count) { if (!valid(comm)) return INVALID_ARGUMENT; *count = 1; return OK; }
int ncclCommUserRank(void* comm, int* rank) { if (!valid(comm)) return INVALID_ARGUMENT; *rank = 0; return OK; }
int ncclCommCuDevice(void* comm, int* device) {
  if (!valid(comm)) return INVALID_ARGUMENT;
  *device = ((solo_comm*)comm)->device;
  return OK;
}
int ncclCommGetAsyncError(void* comm, int* state) { if (!valid(comm)) return INVALID_ARGUMENT; *state = OK; return OK; }
int ncclGroupStart(void) { return OK; }
int ncclGroupEnd(void) { return OK; }

/* One rank: every collective's result is its input. */
static int copy(const void* s, void* r, size_t count, int dt, void* comm, void* stream) {
  const size_t b = type_bytes(dt);
  if (!valid(comm) || b == 0) return fail(INVALID_ARGUMENT, "solo NCCL: bad collective arguments");
  if (s == r || count == 0) return OK;
  return cu_copy((uint64_t)(uintptr_t)r, (uint64_t)(uintptr_t)s, count * b, stream) == 0
             ? OK
             : fail(UNHANDLED_CUDA, "solo NCCL: cuMemcpyDtoDAsync failed");
}

int ncclAllGather(const void* s, void* r, size_t count, int dt, void* comm, void* stream) {
  return copy(s, r, count, dt, comm, stream);
}
int ncclAllReduce(const void* s, void* r, size_t count, int dt, int op, void* comm, void* stream) {
  (void)op;
  return copy(s, r, count, dt, comm, stream);
}
int ncclReduceScatter(const void* s, void* r, size_t count, int dt, int op, void* comm, void* stream) {
  (void)op;
  return copy(s, r, count, dt, comm, stream);
}
int ncclBroadcast(const void* s, void* r, size_t count, int dt, int root, void* comm, void* stream) {
  if (root != 0) return fail(INVALID_ARGUMENT, "solo NCCL: root must be 0");
  return copy(s, r, count, dt, comm, stream);
}
