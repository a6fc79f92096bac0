/* Per-call overhead of flashcomm's forwarding: times small calls through flashcomm's library and
 * through the real NCCL opened directly, and prints nanoseconds per call for both and the
 * difference. ncclGetVersion needs no GPU; when a GPU is there (or with --gpu) a world-size-1
 * communicator on device 0 is created and ncclCommCount / ncclCommUserRank are timed too.
 *
 *   overhead [--ours] PATH/libnccl.so [--real PATH/libnccl.so.2] [--gpu | --cpu] [--iters N]
 *
 * The real library is --real, else $FLASHCOMM_NCCL_LIB, else the one flashcomm itself found
 * (the other libnccl.so* loaded in the process after a first call through flashcomm). Each figure
 * is the best of 7 rounds of N calls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { char internal[128]; } uid_t128;
typedef int (*get_version_t)(int*);
typedef int (*get_uid_t)(uid_t128*);
typedef int (*init_rank_t)(void**, int, uid_t128, int);
typedef int (*comm_int_t)(void*, int*);
typedef int (*comm_t)(void*);

static void* open_lib(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "dlopen %s: %s\n", path, dlerror()); exit(2); }
  return h;
}

static void* sym(void* h, const char* name) {
  void* p = dlsym(h, name);
  if (!p) { fprintf(stderr, "missing %s\n", name); exit(2); }
  return p;
}

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static volatile int sink;

static double time_version(get_version_t f, long iters) {
  double best = 1e30;
  for (int round = 0; round < 7; round++) {
    int v = 0;
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) { f(&v); sink = v; }
    double per = (now_ns() - t0) / (double)iters;
    if (per < best) best = per;
  }
  return best;
}

static double time_comm_int(comm_int_t f, void* comm, long iters) {
  double best = 1e30;
  for (int round = 0; round < 7; round++) {
    int v = 0;
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) { f(comm, &v); sink = v; }
    double per = (now_ns() - t0) / (double)iters;
    if (per < best) best = per;
  }
  return best;
}

static void report(const char* name, double real, double ours) {
  printf("%-20s real %8.1f ns   flashcomm %8.1f ns   overhead %+8.1f ns\n", name, real, ours, ours - real);
}

/* The path of a loaded libnccl.so* that is not `ours` (the real library flashcomm opened). */
static char found_real[PATH_MAX];
static const char* ours_real_path;

static int find_other_nccl(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size; (void)data;
  const char* name = info->dlpi_name;
  if (!name || !*name) return 0;
  const char* base = strrchr(name, '/');
  base = base ? base + 1 : name;
  if (strncmp(base, "libnccl.so", 10) != 0) return 0;
  char resolved[PATH_MAX];
  if (!realpath(name, resolved) || strcmp(resolved, ours_real_path) == 0) return 0;
  snprintf(found_real, sizeof found_real, "%s", resolved);
  return 1;
}

typedef int (*cu_int_t)(unsigned);
typedef int (*cu_count_t)(int*);
typedef int (*cu_dev_t)(int*, int);
typedef int (*cu_retain_t)(void**, int);
typedef int (*cu_set_t)(void*);
typedef int (*cu_alloc_t)(unsigned long long*, size_t);
typedef int (*cu_stream_create_t)(void**, unsigned);
typedef int (*cu_stream_t)(void*);
typedef int (*all_reduce_t)(const void*, void*, size_t, int, int, void*, void*);

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

/* Eager host time of one ncclAllReduce (API entry to return), bf16 sum of `bytes`: the median
 * over 7 rounds of `calls` calls each, the stream drained between rounds (outside the timing).
 * Returns -1 when a call fails. */
/* Times `calls` eager AllReduces through `a` and through `b`, in 7 interleaved rounds (a, b, a,
 * b, ...: a drift of the machine's speed during the measurement falls on both alike); writes the
 * median time per call of each. Returns -1 if a call failed. */
static int time_all_reduce(all_reduce_t a, all_reduce_t b, void* comm, void* stream, cu_stream_t sync,
                           unsigned long long send, unsigned long long recv, size_t bytes, long calls,
                           double* ta, double* tb) {
  double per[2][7];
  all_reduce_t fs[2] = {a, b};
  for (int round = 0; round < 7; round++) {
    for (int w = 0; w < 2; w++) {
      double t0 = now_ns();
      for (long i = 0; i < calls; i++)
        if (fs[w]((const void*)send, (void*)recv, bytes / 2, 9 /* bf16 */, 0 /* sum */, comm, stream)) return -1;
      per[w][round] = (now_ns() - t0) / (double)calls;
      if (sync(stream)) return -1;
    }
  }
  qsort(per[0], 7, sizeof per[0][0], cmp_double);
  qsort(per[1], 7, sizeof per[1][0], cmp_double);
  *ta = per[0][3];
  *tb = per[1][3];
  return 0;
}

int main(int argc, char** argv) {
  const char* ours_path = NULL;
  const char* real_path = NULL;
  int gpu = -1; /* -1: if a GPU is there */
  long iters = 1000000;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--ours") && i + 1 < argc) ours_path = argv[++i];
    else if (!strcmp(argv[i], "--real") && i + 1 < argc) real_path = argv[++i];
    else if (!strcmp(argv[i], "--gpu")) gpu = 1;
    else if (!strcmp(argv[i], "--cpu")) gpu = 0;
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atol(argv[++i]);
    else if (argv[i][0] != '-' && !ours_path) ours_path = argv[i];
    else { fprintf(stderr, "usage: %s [--ours] PATH [--real PATH] [--gpu|--cpu] [--iters N]\n", argv[0]); return 2; }
  }
  if (!ours_path) { fprintf(stderr, "the path of flashcomm's library is required\n"); return 2; }
  if (!real_path) real_path = getenv("FLASHCOMM_NCCL_LIB");
  if (real_path) setenv("FLASHCOMM_NCCL_LIB", real_path, 0);

  static char ours_resolved[PATH_MAX];
  if (!realpath(ours_path, ours_resolved)) { perror(ours_path); return 2; }
  ours_real_path = ours_resolved;
  void* ours = open_lib(ours_path);
  if (!real_path) {
    int v = 0;
    if (((get_version_t)sym(ours, "ncclGetVersion"))(&v) != 0 ||
        !dl_iterate_phdr(find_other_nccl, NULL)) {
      fprintf(stderr, "flashcomm found no real NCCL; pass --real or set FLASHCOMM_NCCL_LIB\n");
      return 2;
    }
    real_path = found_real;
  }
  printf("flashcomm %s\nreal NCCL %s\n", ours_path, real_path);
  void* real = open_lib(real_path);
  get_version_t real_version = (get_version_t)sym(real, "ncclGetVersion");
  get_version_t ours_version = (get_version_t)sym(ours, "ncclGetVersion");
  int v1 = 0, v2 = 0;
  if (real_version(&v1) || ours_version(&v2) || v1 != v2) {
    fprintf(stderr, "version mismatch or failure: real %d, flashcomm %d\n", v1, v2);
    return 1;
  }
  printf("NCCL %d, %ld calls per round, best of 7 rounds\n", v1, iters);
  report("ncclGetVersion", time_version(real_version, iters), time_version(ours_version, iters));

  void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (gpu == -1) {
    int n = 0;
    gpu = cu && ((cu_int_t)sym(cu, "cuInit"))(0) == 0 && ((cu_count_t)sym(cu, "cuDeviceGetCount"))(&n) == 0 && n > 0;
  }
  if (gpu) {
    if (!cu) { fprintf(stderr, "libcuda.so.1: %s\n", dlerror()); return 1; }
    int dev = 0; void* ctx = NULL;
    if (((cu_int_t)sym(cu, "cuInit"))(0) || ((cu_dev_t)sym(cu, "cuDeviceGet"))(&dev, 0) ||
        ((cu_retain_t)sym(cu, "cuDevicePrimaryCtxRetain"))(&ctx, dev) || ((cu_set_t)sym(cu, "cuCtxSetCurrent"))(ctx)) {
      fprintf(stderr, "CUDA context creation failed\n");
      return 1;
    }
    uid_t128 id;
    void* comm = NULL;
    if (((get_uid_t)sym(ours, "ncclGetUniqueId"))(&id) ||
        ((init_rank_t)sym(ours, "ncclCommInitRank"))(&comm, 1, id, 0) || !comm) {
      fprintf(stderr, "communicator creation failed\n");
      return 1;
    }
    const char* calls[] = {"ncclCommCount", "ncclCommUserRank"};
    for (int c = 0; c < 2; c++) {
      comm_int_t r = (comm_int_t)sym(real, calls[c]);
      comm_int_t o = (comm_int_t)sym(ours, calls[c]);
      report(calls[c], time_comm_int(r, comm, iters), time_comm_int(o, comm, iters));
    }
    /* The per-call host cost of an eager AllReduce, through flashcomm and through the real
     * NCCL, on the same one-rank communicator and stream (the "host side of a call"). */
    unsigned long long send = 0, recv = 0;
    void* stream = NULL;
    cu_stream_t sync = (cu_stream_t)sym(cu, "cuStreamSynchronize");
    if (((cu_alloc_t)sym(cu, "cuMemAlloc_v2"))(&send, 1 << 20) || ((cu_alloc_t)sym(cu, "cuMemAlloc_v2"))(&recv, 1 << 20) ||
        ((cu_stream_create_t)sym(cu, "cuStreamCreate"))(&stream, 1 /* non-blocking */)) {
      fprintf(stderr, "buffer or stream creation failed\n");
      return 1;
    }
    all_reduce_t ar_real = (all_reduce_t)sym(real, "ncclAllReduce");
    all_reduce_t ar_ours = (all_reduce_t)sym(ours, "ncclAllReduce");
    int failed = 0;
    const size_t sizes[] = {8 << 10, 64 << 10, 1 << 20};
    for (int k = 0; k < 3; k++) {
      for (int inplace = 0; inplace < 2; inplace++) {
        unsigned long long r = inplace ? send : recv;
        long calls = 500;
        double tr = 0, to = 0;
        int rc = time_all_reduce(ar_real, ar_ours, comm, stream, sync, send, r, sizes[k], calls, &tr, &to);
        char name[64];
        snprintf(name, sizeof name, "ncclAllReduce %zuK%s", sizes[k] >> 10, inplace ? " in" : "");
        if (rc < 0) {
          fprintf(stderr, "%s failed\n", name);
          failed = 1;
          continue;
        }
        report(name, tr, to);
        printf("%-20s flashcomm / real %.2f (median of 7 interleaved rounds of %ld eager calls each)\n", name,
               to / tr, calls);
      }
    }
    ((comm_t)sym(ours, "ncclCommDestroy"))(comm);
    if (failed) return 1;
  }
  return 0;
}
