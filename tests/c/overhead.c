/* Per-call overhead of flashcomm's forwarding: times small calls through flashcomm's library and
 * through the real NCCL opened directly, and prints nanoseconds per call for both and the
 * difference. ncclGetVersion needs no GPU; with --gpu a world-size-1 communicator on device 0 is
 * created and ncclCommCount / ncclCommUserRank are timed too.
 *
 *   overhead --ours PATH/libnccl.so --real PATH/libnccl.so.2 [--gpu] [--iters N]
 *
 * flashcomm is pointed at the same real library (FLASHCOMM_NCCL_LIB) unless the variable is set.
 * Each figure is the best of 7 rounds of N calls. */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
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

typedef int (*cu_int_t)(unsigned);
typedef int (*cu_dev_t)(int*, int);
typedef int (*cu_retain_t)(void**, int);
typedef int (*cu_set_t)(void*);

int main(int argc, char** argv) {
  const char* ours_path = NULL;
  const char* real_path = NULL;
  int gpu = 0;
  long iters = 1000000;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--ours") && i + 1 < argc) ours_path = argv[++i];
    else if (!strcmp(argv[i], "--real") && i + 1 < argc) real_path = argv[++i];
    else if (!strcmp(argv[i], "--gpu")) gpu = 1;
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atol(argv[++i]);
    else { fprintf(stderr, "usage: %s --ours PATH --real PATH [--gpu] [--iters N]\n", argv[0]); return 2; }
  }
  if (!ours_path || !real_path) { fprintf(stderr, "--ours and --real are required\n"); return 2; }
  setenv("FLASHCOMM_NCCL_LIB", real_path, 0);

  void* real = open_lib(real_path);
  void* ours = open_lib(ours_path);
  get_version_t real_version = (get_version_t)sym(real, "ncclGetVersion");
  get_version_t ours_version = (get_version_t)sym(ours, "ncclGetVersion");
  int v1 = 0, v2 = 0;
  if (real_version(&v1) || ours_version(&v2) || v1 != v2) {
    fprintf(stderr, "version mismatch or failure: real %d, flashcomm %d\n", v1, v2);
    return 1;
  }
  printf("NCCL %d, %ld calls per round, best of 7 rounds\n", v1, iters);
  report("ncclGetVersion", time_version(real_version, iters), time_version(ours_version, iters));

  if (gpu) {
    void* cu = open_lib("libcuda.so.1");
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
    ((comm_t)sym(ours, "ncclCommDestroy"))(comm);
  }
  return 0;
}
