// Layouts shared between the host (Rust, crates/comm/src/abi.rs) and the kernels.
//
// Both sides assert every size and offset (static_assert here, const assertions in Rust), so a
// change on one side that is not made on the other fails the build.
#pragma once
#include <stdint.h>

#define FC_MAX_RANKS 8

// Bytes at the start of every rank's arena, before the data halves.
#define FC_ARENA_HEADER_BYTES 4096
// Offsets inside the arena header.
#define FC_HDR_ABORT_REQ 0      // u32: a peer (or this rank) asks every block of this rank to stop
#define FC_HDR_PROBE 64         // u32[FC_MAX_RANKS]: peer-write probe words written at set-up
#define FC_HDR_CTL 1024         // FcCtl: this rank's device-side epoch state

// Device-side state of one rank of one communicator. Only this rank's kernels touch it.
struct FcCtl {
  uint64_t seq;    // epoch of the next collective; its low 32 bits (never 0) tag the data
  uint32_t done;   // blocks of the running kernel that have finished (last one advances seq)
  uint32_t pad;
};

// Status words in host-mapped memory, written by a kernel that gives up waiting.
#define FC_STATUS_OK 0u
#define FC_STATUS_TIMEOUT 1u        // a peer's data did not arrive within the timeout
#define FC_STATUS_ABORTED 2u        // the host set the abort flag (ncclCommAbort)
#define FC_STATUS_PEER_ABORTED 3u   // a peer gave up and asked us to stop
#define FC_STATUS_MISMATCH 4u       // a peer's tag belongs to another collective: calls differ across ranks
#define FC_STATUS_CLAIMED 0xffffffffu  // a kernel is writing the record (an error, details follow)

struct FcStatus {
  uint32_t code;      // FC_STATUS_*; the first error wins
  uint32_t peer;      // the rank waited for
  uint32_t block;     // the block that gave up
  uint32_t observed;  // the tag seen (mismatch) or 0
  uint64_t seq;       // epoch of the failed collective
  uint64_t expected;  // tag expected
};

// Protocols (how readiness travels with the data).
#define FC_PROTO_LL 0     // 16-byte lines {4 B data, 4 B tag, 4 B data, 4 B tag}
#define FC_PROTO_BLOCK 1  // frames of payload with one tag in a 16-byte header, written last

// Flags.
#define FC_FLAG_SEND_ALIGNED 1u  // send buffer is 16-byte aligned
#define FC_FLAG_RECV_ALIGNED 2u  // recv buffer is 16-byte aligned

// Parameters of every collective kernel, passed by value.
struct FcCollParams {
  uint64_t send;                     // user send buffer
  uint64_t recv;                     // user receive buffer
  uint64_t count;                    // elements: AllReduce count, ReduceScatter recvcount, AllGather sendcount
  uint64_t peer_base[FC_MAX_RANKS];  // every rank's arena, as mapped in this process
  uint64_t ctl;                      // this rank's FcCtl
  uint64_t abort_flag;               // host-mapped u32 set by ncclCommAbort
  uint64_t status;                   // host-mapped FcStatus
  uint64_t timeout_ns;               // bound on every wait
  uint64_t half_bytes;               // bytes of one call-parity half
  uint64_t region_bytes;             // bytes of one region (region B starts this far into a half)
  uint64_t slot_bytes;               // bytes per source rank inside a region (LL area, then BLOCK area)
  uint64_t sub_bytes;                // bytes per (block, round parity) inside a slot
  uint64_t chunk_bytes;              // payload bytes carried per (block, round) per source
  uint64_t shard_elems;              // two-shot: elements per shard (last shard may be shorter)
  uint32_t rank;
  uint32_t nranks;
  uint32_t elem_bytes;               // bytes per element of the datatype
  uint32_t flags;                    // FC_FLAG_*
  // Quantized collectives (zero for lossless ones).
  uint32_t q_bits_rs;                // codec width of the first step (or the only step)
  uint32_t q_bits_ag;                // codec width of the all-gather step
  uint32_t q_group;                  // group size
  uint32_t q_spikes;                 // spikes per group
  uint32_t q_block_bytes_rs;         // encoded bytes per 1024-value block, first step
  uint32_t q_block_bytes_ag;         // encoded bytes per 1024-value block, second step
  uint64_t area_offset;              // where this protocol's area starts inside every slot
};

#ifdef __cplusplus
static_assert(sizeof(FcCtl) == 16, "FcCtl layout");
static_assert(sizeof(FcStatus) == 32, "FcStatus layout");
static_assert(sizeof(FcCollParams) == 216, "FcCollParams layout");
#endif
