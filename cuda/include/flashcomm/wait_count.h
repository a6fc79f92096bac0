// The arithmetic of epochs and waits, on its own so that it compiles for the host too
// (crates/kernels/tests/wait_count.rs builds a host program of it with the C++ compiler and
// checks what the kernels rely on: the epoch's period, and a poll counter that never carries
// into its flag).
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define FC_HD __host__ __device__ __forceinline__
#else
#define FC_HD inline
#endif

namespace fc {

// The epoch after `seq`. The epoch is a u32 that never takes 0xffffffff (whose LL tag seq + 1
// would be 0, the value of a line never written): after 0xfffffffe comes 1. From then on the
// epochs cycle through 1..=0xfffffffe, a period of 2^32 - 2 calls (docs/protocols.md, "LL
// lines are never cleared"), so the half parity (seq & 1) still alternates at the wrap.
FC_HD uint32_t next_epoch(uint32_t seq) { return seq + 1u == 0xffffffffu ? 1u : seq + 1u; }

// A wait's poll counter and one flag in one register. The flag (bit 0: a foreign LL line was
// seen at the previous slow check) sits below the count, which advances in steps of 2: the
// count wraps around after 2^31 polls without ever carrying into the flag (with the flag on top,
// 2^31 polls set it by themselves, and the next torn read was judged a mismatch).
struct WaitCount {
  uint32_t v = 0;
  // Counts one poll; true when this poll runs the slow checks (every 128 polls).
  FC_HD bool tick() {
    v += 2u;
    return (v & 254u) == 0;
  }
  // Whether the next tick() runs the slow checks.
  FC_HD bool slow_next() const { return ((v + 2u) & 254u) == 0; }
  // At a slow check: also the host abort flag (every 4096 polls).
  FC_HD bool every_4096() const { return (v & 8190u) == 0; }
  // Whether a foreign line was seen now (`seen`) and at the previous slow check too.
  FC_HD bool confirm_foreign(bool seen) {
    const bool before = (v & 1u) != 0;
    v = seen ? (v | 1u) : (v & ~1u);
    return seen && before;
  }
  // Polls counted so far, modulo 2^31.
  FC_HD uint32_t polls() const { return v >> 1; }
};

}  // namespace fc
