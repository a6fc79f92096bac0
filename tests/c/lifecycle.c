/* Communicator lifecycles leak nothing, through the exported C API and the real NCCL: CYCLES
 * times (default 1000) this program creates a one-rank communicator (ncclCommInitRank), splits
 * it (ncclCommSplit, color 0) and, every other cycle, splits it with NCCL_SPLIT_NOCOLOR (no new
 * communicator), checks that flashcomm serves both communicators, runs an all-reduce on each
 * and destroys both. From cycle WARM (50) to the end it compares:
 *   - free device memory (cuMemGetInfo): within 4 MiB,
 *   - resident host memory (/proc/self/statm): within 16 MiB,
 *   - threads (/proc/self/status) and open file descriptors (/proc/self/fd): equal,
 *   - flashcomm's own CUDA streams, as flashcomm logs them when it releases a communicator
 *     (FLASHCOMM_LOG_FILE, set here): equal.
 *
 *   lifecycle PATH/libnccl.so [CYCLES]   (exit 0: flat; 1: a leak or a wrong route; 2: set-up)
 *
 * It also prints the mean time of each step. With FLASHCOMM_DISABLE=1 in the environment it runs
 * the same cycles with every communicator left to NCCL (for comparison; "served" is not required).
 *
 * GPU machine only (one GPU; the real NCCL of FLASHCOMM_NCCL_LIB).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { char internal[128]; } unique_id_t;
typedef struct {
  int served, rank, nranks, device;
  uint64_t arena_bytes;
  char reason[256];
} comm_info_t;
enum { F32 = 7, SUM = 0, SPLIT_NOCOLOR = -1 };

static void* need(void* h, const char* name) {
  void* p = dlsym(h, name);
  if (!p) { fprintf(stderr, "missing %s\n", name); exit(2); }
  return p;
}

#define CU(call)                                                        \
  do {                                                                  \
    int rc_ = (call);                                                   \
    if (rc_ != 0) { fprintf(stderr, "%s: %d\n", #call, rc_); exit(2); } \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static long rss_kib(void) {
  long pages = 0, resident = 0;
  FILE* f = fopen("/proc/self/statm", "r");
  if (!f || fscanf(f, "%ld %ld", &pages, &resident) != 2) exit(2);
  fclose(f);
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static long threads(void) {
  char line[256];
  long n = -1;
  FILE* f = fopen("/proc/self/status", "r");
  if (!f) exit(2);
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Threads: %ld", &n) == 1) break;
  fclose(f);
  return n;
}

static long fds(void) {
  long n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) exit(2);
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* The number in the last "streams of flashcomm's own live in the process: N" line of the log. */
static long logged_streams(const char* path) {
  static const char key[] = "streams of flashcomm's own live in the process: ";
  char line[1024];
  long n = -1;
  FILE* f = fopen(path, "r");
  if (!f) return -1;
  while (fgets(line, sizeof line, f)) {
    char* at = strstr(line, key);
    if (at) n = strtol(at + sizeof key - 1, NULL, 10);
  }
  fclose(f);
  return n;
}

int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: lifecycle PATH/libnccl.so [CYCLES]\n"); return 2; }
  const int cycles = argc > 2 ? atoi(argv[2]) : 1000;
  const int warm = cycles > 100 ? 50 : cycles / 2;
  char logpath[256];
  snprintf(logpath, sizeof logpath, "/tmp/flashcomm-lifecycle-%d.log", (int)getpid());
  /* Before the library's first call reads the configuration. */
  setenv("FLASHCOMM_LOG", "flashcomm::init=info", 1);
  setenv("FLASHCOMM_LOG_FILE", logpath, 1);

  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cuda) { fprintf(stderr, "no CUDA driver: %s\n", dlerror()); return 2; }
  int (*cuInit)(unsigned) = need(cuda, "cuInit");
  int (*cuDeviceGet)(int*, int) = need(cuda, "cuDeviceGet");
  int (*cuDevicePrimaryCtxRetain)(void**, int) = need(cuda, "cuDevicePrimaryCtxRetain");
  int (*cuCtxSetCurrent)(void*) = need(cuda, "cuCtxSetCurrent");
  int (*cuMemAlloc)(uint64_t*, size_t) = need(cuda, "cuMemAlloc_v2");
  int (*cuMemGetInfo)(size_t*, size_t*) = need(cuda, "cuMemGetInfo_v2");
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
  CU(cuMemAlloc(&send, 1 << 16));
  CU(cuMemAlloc(&recv, 1 << 16));
  CU(cuStreamCreate(&stream, 1));

  void* nccl = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!nccl) { fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror()); return 2; }
  int (*get_uid)(unique_id_t*) = need(nccl, "ncclGetUniqueId");
  int (*init_rank)(void**, int, unique_id_t, int) = need(nccl, "ncclCommInitRank");
  int (*split)(void*, int, int, void**, void*) = need(nccl, "ncclCommSplit");
  int (*all_reduce)(const void*, void*, size_t, int, int, void*, void*) = need(nccl, "ncclAllReduce");
  int (*destroy)(void*) = need(nccl, "ncclCommDestroy");
  int (*info)(void*, comm_info_t*) = need(nccl, "flashcommCommGetInfo");
  const char* (*last_error)(void*) = need(nccl, "ncclGetLastError");

  size_t free0 = 0, free1 = 0, total = 0;
  long rss0 = 0, threads0 = 0, fds0 = 0, streams0 = -1;
  const char* disabled = getenv("FLASHCOMM_DISABLE");
  const int want_served = !(disabled && strcmp(disabled, "0") != 0);
  /* Seconds spent in: init, split(s), all-reduces with their synchronization, destroys. */
  double spent[4] = {0, 0, 0, 0};
  const double t0 = now();
  for (int i = 0; i < cycles; i++) {
    double t = now();
    unique_id_t id;
    void* comm = NULL;
    void* child = NULL;
    void* none = (void*)1;
    comm_info_t a, b;
    CU(get_uid(&id));
    CU(init_rank(&comm, 1, id, 0));
    spent[0] += now() - t;
    t = now();
    if (split(comm, 0, 0, &child, NULL) != 0) {
      fprintf(stderr, "ncclCommSplit: %s\n", last_error(comm));
      return 2;
    }
    if (i % 2 == 1) {
      CU(split(comm, SPLIT_NOCOLOR, 0, &none, NULL));
      if (none != NULL) { fprintf(stderr, "FAIL a NOCOLOR split returned a communicator\n"); return 1; }
    }
    spent[1] += now() - t;
    CU(info(comm, &a));
    CU(info(child, &b));
    if (want_served && (!a.served || !b.served)) {
      fprintf(stderr, "FAIL cycle %d: not served (%s | %s)\n", i, a.reason, b.reason);
      return 1;
    }
    t = now();
    CU(all_reduce((void*)send, (void*)recv, 1024, F32, SUM, comm, stream));
    CU(all_reduce((void*)send, (void*)recv, 1024, F32, SUM, child, stream));
    CU(cuStreamSynchronize(stream));
    spent[2] += now() - t;
    t = now();
    CU(destroy(child));
    CU(destroy(comm));
    spent[3] += now() - t;
    if (i + 1 == warm) {
      CU(cuMemGetInfo(&free0, &total));
      rss0 = rss_kib();
      threads0 = threads();
      fds0 = fds();
      streams0 = logged_streams(logpath);
    }
  }
  const double secs = now() - t0;
  CU(cuMemGetInfo(&free1, &total));
  long rss1 = rss_kib(), threads1 = threads(), fds1 = fds(), streams1 = logged_streams(logpath);
  printf("%d cycles (init, split, all-reduce on both, destroy) in %.1f s; from cycle %d to the end:\n",
         cycles, secs, warm);
  printf("  mean per cycle: init %.1f ms, split(s) %.1f ms, all-reduces %.1f ms, destroys %.1f ms\n",
         1e3 * spent[0] / cycles, 1e3 * spent[1] / cycles, 1e3 * spent[2] / cycles,
         1e3 * spent[3] / cycles);
  printf("  device free %zu -> %zu MiB, resident %ld -> %ld MiB, threads %ld -> %ld, fds %ld -> %ld,\n"
         "  flashcomm's streams %ld -> %ld\n",
         free0 >> 20, free1 >> 20, rss0 >> 10, rss1 >> 10, threads0, threads1, fds0, fds1, streams0,
         streams1);
  int ok = free1 + (4u << 20) >= free0 && rss1 <= rss0 + 16 * 1024 && threads1 == threads0 &&
           fds1 == fds0 && (!want_served || (streams0 >= 0 && streams1 == streams0));
  unlink(logpath);
  printf("%s communicator lifecycles\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
