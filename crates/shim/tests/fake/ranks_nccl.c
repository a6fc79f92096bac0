/* A stand-in for the real NCCL with several ranks in one process (threads), for the tests of
 * communicator set-up (tests/setup_faults.rs): ncclCommInitRank makes rank r of a group named
 * by the unique id, and ncclAllGather of a group's ranks completes in the call once every rank
 * arrived (host buffers: no GPU is involved). ncclCommAbort wakes the ranks waiting in an
 * all-gather of the group (they return ncclRemoteError) and marks the communicator dead: any
 * later call on it is counted in fake_use_after_abort (the real NCCL frees it; a call after the
 * abort would be a use after free). Types are spelled with plain C types: the ABI is what
 * matters. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LIVE 0x11fe0000u
#define DEAD 0xdeadu
#define MAX_RANKS 16
#define MAX_ROUNDS 64

struct group {
  uint64_t key;
  int nranks;
  int aborted;
  unsigned arrived[MAX_ROUNDS];
  unsigned char* data[MAX_ROUNDS];
  size_t bytes[MAX_ROUNDS];
  struct group* next;
};

struct comm {
  unsigned magic;
  struct group* g;
  int rank;
  unsigned rounds;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static struct group* groups = 0;
static uint64_t next_key = 1;

/* Read by the tests (dlsym). */
int fake_rounds[MAX_RANKS];        /* all-gathers completed, per rank */
int fake_use_after_abort = 0;      /* calls made on a communicator after its abort */
int fake_abort_calls = 0;
int fake_allreduce_calls = 0;
/* Set by the tests: the next all-gather of this rank fails once (-1: none). */
int fake_fail_allgather_rank = -1;

static int live(struct comm* c) {
  if (c == 0 || c->magic != LIVE) {
    __atomic_add_fetch(&fake_use_after_abort, 1, __ATOMIC_SEQ_CST);
    return 0;
  }
  return 1;
}

int ncclGetVersion(int* version) { *version = 23203; return 0; }
const char* ncclGetErrorString(int result) { (void)result; return "ranks stand-in error"; }
const char* ncclGetLastError(void* comm) { (void)comm; return ""; }

int ncclGetUniqueId(void* id) {
  pthread_mutex_lock(&lock);
  uint64_t key = next_key++;
  pthread_mutex_unlock(&lock);
  memset(id, 0, 128);
  memcpy(id, &key, sizeof key);
  return 0;
}

typedef struct { char internal[128]; } fake_id;
int ncclCommInitRank(void** out, int nranks, fake_id id, int rank) {
  if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) return 4;
  uint64_t key;
  memcpy(&key, id.internal, sizeof key);
  pthread_mutex_lock(&lock);
  struct group* g = groups;
  while (g && g->key != key) g = g->next;
  if (!g) {
    g = calloc(1, sizeof *g);
    g->key = key;
    g->nranks = nranks;
    g->next = groups;
    groups = g;
  }
  pthread_mutex_unlock(&lock);
  struct comm* c = calloc(1, sizeof *c);
  c->magic = LIVE;
  c->g = g;
  c->rank = rank;
  *out = c;
  return 0;
}

int ncclCommCount(void* comm, int* count) {
  struct comm* c = comm;
  if (!live(c)) return 4;
  *count = c->g->nranks;
  return 0;
}

int ncclCommUserRank(void* comm, int* rank) {
  struct comm* c = comm;
  if (!live(c)) return 4;
  *rank = c->rank;
  return 0;
}

int ncclCommCuDevice(void* comm, int* device) {
  if (!live(comm)) return 4;
  *device = 0;
  return 0;
}

int ncclCommGetAsyncError(void* comm, int* state) {
  if (!live(comm)) return 4;
  *state = 0;
  return 0;
}

/* uint8 only (what flashcomm's set-up exchange sends); completes in the call. */
int ncclAllGather(const void* send, void* recv, size_t count, int dt, void* comm, void* stream) {
  (void)dt; (void)stream;
  struct comm* c = comm;
  if (!live(c)) return 4;
  pthread_mutex_lock(&lock);
  if (fake_fail_allgather_rank == c->rank) {
    fake_fail_allgather_rank = -1;
    pthread_mutex_unlock(&lock);
    return 2; /* ncclSystemError, once */
  }
  struct group* g = c->g;
  unsigned r = c->rounds;
  if (r >= MAX_ROUNDS) {
    pthread_mutex_unlock(&lock);
    return 3;
  }
  if (!g->data[r]) {
    g->data[r] = calloc((size_t)g->nranks, count);
    g->bytes[r] = count;
  }
  memcpy(g->data[r] + (size_t)c->rank * count, send, count);
  g->arrived[r]++;
  pthread_cond_broadcast(&cond);
  while (g->arrived[r] < (unsigned)g->nranks && !g->aborted) pthread_cond_wait(&cond, &lock);
  int rc = 0;
  if (g->arrived[r] < (unsigned)g->nranks) {
    rc = 6; /* ncclRemoteError: the group was aborted */
  } else {
    memcpy(recv, g->data[r], (size_t)g->nranks * count);
    c->rounds++;
    if (c->rank < MAX_RANKS) fake_rounds[c->rank]++;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

int ncclCommAbort(void* comm) {
  struct comm* c = comm;
  __atomic_add_fetch(&fake_abort_calls, 1, __ATOMIC_SEQ_CST);
  if (!live(c)) return 4;
  pthread_mutex_lock(&lock);
  c->magic = DEAD;
  c->g->aborted = 1;
  pthread_cond_broadcast(&cond);
  pthread_mutex_unlock(&lock);
  return 0;
}

int ncclCommDestroy(void* comm) {
  struct comm* c = comm;
  if (!live(c)) return 4;
  c->magic = DEAD;
  return 0;
}

int ncclCommFinalize(void* comm) { return live(comm) ? 0 : 4; }

int ncclAllReduce(const void* s, void* r, size_t count, int dt, int op, void* comm, void* stream) {
  (void)s; (void)r; (void)count; (void)dt; (void)op; (void)stream;
  if (!live(comm)) return 4;
  __atomic_add_fetch(&fake_allreduce_calls, 1, __ATOMIC_SEQ_CST);
  return 0;
}

int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
