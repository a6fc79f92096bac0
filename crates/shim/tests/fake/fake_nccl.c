/* A tiny stand-in for an older real NCCL, used by the shim's tests. It reports version 2.19.3,
 * implements a handful of functions (recording what it received; its ncclAllReduce takes any datatype,
 * as a newer NCCL with more types would), and lacks many others
 * (ncclAllReduceConfig, ncclAllGather, ncclCommShrink, ncclTeamWorld, ncclTeamRankToWorld,
 * ncclParamDumpAll, ...), so that the tests can see what flashcomm does with a function the real library lacks.
 * Types are spelled with plain C types: the ABI is what matters. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct fake_comm { int magic; };
struct fake_comm fake_comm_object = { 0x5eed };

/* What the last calls received; read by the tests through dlsym. */
int fake_allreduce_calls = 0;
int fake_last_op = -1;
int fake_last_dt = -1;
size_t fake_last_count = 0;
void* fake_last_comm = 0;
const void* fake_last_config = 0;
int fake_send_calls = 0;
/* When nonzero, ncclSend succeeds (else it fails, for the error-message test). */
int fake_send_ok = 0;
/* Every group, send, receive and all-reduce call, in order: "start;", "end;", "allreduce;",
 * "send:PEER:COUNT:DT:BUF;", "recv:PEER:COUNT:DT:BUF;" (BUF in hex). */
char fake_log[8192] = "";

static void fake_note(const char* what, int peer, size_t count, int dt, const void* buf) {
  size_t used = strlen(fake_log);
  if (peer < 0)
    snprintf(fake_log + used, sizeof fake_log - used, "%s;", what);
  else
    snprintf(fake_log + used, sizeof fake_log - used, "%s:%d:%zu:%d:%lx;", what, peer, count, dt,
             (unsigned long)(uintptr_t)buf);
}

static const char* last_error = "";

int ncclGetVersion(int* version) { *version = 21903; return 0; }
const char* ncclGetErrorString(int result) { (void)result; return "fake error string"; }
const char* ncclGetLastError(void* comm) { (void)comm; return last_error; }

/* The rank and size of the newest communicator (each process of a multi-process test is one
 * rank of its own; the fake talks to nobody). */
static int fake_nranks = 1, fake_rank = 0;

int ncclCommInitRank(void** comm, int nranks, struct { char internal[128]; } id, int rank) {
  (void)id;
  fake_nranks = nranks;
  fake_rank = rank;
  *comm = &fake_comm_object;
  return 0;
}

int ncclCommInitRankConfig(void** comm, int nranks, struct { char internal[128]; } id, int rank,
                           const void* config) {
  (void)id;
  fake_nranks = nranks;
  fake_rank = rank;
  fake_last_config = config;
  *comm = &fake_comm_object;
  return 0;
}

int fake_destroy_calls = 0;
int fake_abort_calls = 0;
int ncclCommDestroy(void* comm) { (void)comm; fake_destroy_calls++; return 0; }
int ncclCommAbort(void* comm) { (void)comm; fake_abort_calls++; return 0; }
/* Fails without a message (as NCCL does for some bad arguments) when comm is NULL. */
int ncclCommFinalize(void* comm) { return comm ? 0 : 4; }
int ncclCommCount(void* comm, int* count) { (void)comm; *count = fake_nranks; return 0; }
int ncclCommUserRank(void* comm, int* rank) { (void)comm; *rank = fake_rank; return 0; }
int ncclCommCuDevice(void* comm, int* device) { (void)comm; *device = 0; return 0; }
int ncclCommGetAsyncError(void* comm, int* state) { (void)comm; *state = 0; return 0; }
/* Groups as NCCL's: a call that fails inside a group is the group's error (the newest one), and
 * the outermost end then returns it and discards the group's calls (logged as "discarded;"). */
static __thread int fake_group_depth = 0;
static __thread int fake_group_error = 0;
static int fake_fail(int rc) {
  if (fake_group_depth > 0) fake_group_error = rc;
  return rc;
}
int ncclGroupStart(void) { fake_group_depth++; fake_note("start", -1, 0, 0, 0); return 0; }
int ncclGroupEnd(void) {
  if (fake_group_depth == 0) { last_error = "fake: not in a group"; return 5; }
  fake_note("end", -1, 0, 0, 0);
  if (--fake_group_depth > 0) return 0;
  int e = fake_group_error;
  fake_group_error = 0;
  if (e) fake_note("discarded", -1, 0, 0, 0);
  return e;
}
/* Newer than 2.19, but present so that the tests can check that a simulated group end ends the
 * group for flashcomm too. */
int fake_simulate_calls = 0;
int ncclGroupSimulateEnd(void* sim_info) { (void)sim_info; fake_simulate_calls++; return 0; }

int ncclAllReduce(const void* s, void* r, size_t count, int dt, int op, void* comm, void* stream) {
  (void)s; (void)r; (void)stream;
  fake_allreduce_calls++;
  fake_note("allreduce", -1, 0, 0, 0);
  fake_last_op = op;
  fake_last_dt = dt;
  fake_last_count = count;
  fake_last_comm = comm;
  if (!comm) { last_error = "fake: comm argument is NULL"; return fake_fail(4); }
  return 0;
}

int ncclSend(const void* s, size_t count, int dt, int peer, void* comm, void* stream) {
  (void)comm; (void)stream;
  fake_send_calls++;
  fake_note("send", peer, count, dt, s);
  if (fake_send_ok) return 0;
  last_error = "fake: send refused";
  return fake_fail(5); /* ncclInvalidUsage */
}

int ncclRecv(void* r, size_t count, int dt, int peer, void* comm, void* stream) {
  (void)comm; (void)stream;
  fake_note("recv", peer, count, dt, r);
  return 0;
}
