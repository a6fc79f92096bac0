// Host program of cuda/include/flashcomm/wait_count.h (built and run by tests/wait_count.rs).
// Prints what the kernels' epoch and wait arithmetic does at its edges; the Rust test checks it.
#include <cstdio>
#include "flashcomm/wait_count.h"

int main() {
  // The epoch's period after its first wrap: from 1 back to 1 (counted by closed form pieces:
  // 1..=0xfffffffe is visited once per cycle, and next_epoch(0xfffffffe) is 1).
  unsigned long long period = 0xfffffffeull;  // values 1..=0xfffffffe
  std::printf("next_epoch(0xfffffffe)=%u next_epoch(0xfffffffd)=%u next_epoch(0)=%u period=%llu\n",
              fc::next_epoch(0xfffffffeu), fc::next_epoch(0xfffffffdu), fc::next_epoch(0u), period);
  // A wait that polls past 2^31 times with no foreign line ever seen: the flag must stay clear.
  fc::WaitCount w;
  w.v = 0xfffffff0u;  // 2^31 - 8 polls counted, flag clear
  unsigned slow = 0, spurious = 0;
  for (int i = 0; i < 1024; ++i) {
    if (w.tick()) {
      ++slow;
      // A torn read at this slow check must not be confirmed as a mismatch on its own.
      if (w.confirm_foreign(true)) ++spurious;
      w.confirm_foreign(false);
    }
  }
  std::printf("wrapped_polls=%u slow_checks=%u spurious_mismatches=%u flag=%u\n", w.polls(), slow,
              spurious, w.v & 1u);
  // Two consecutive sightings are confirmed, also across the wrap.
  w.v = 0xffffff00u;
  bool confirmed = false;
  for (int i = 0; i < 512; ++i)
    if (w.tick()) confirmed = w.confirm_foreign(true) || confirmed;
  std::printf("confirmed_across_wrap=%d\n", confirmed ? 1 : 0);
  return 0;
}
