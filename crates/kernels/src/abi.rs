//! The kernels' ABI: constants and `#[repr(C)]` layouts shared by the host and the CUDA code.
//!
//! This file is the source of `cuda/include/flashcomm/params.h`, which `cargo run -p xtask --
//! gen-kernels` generates from it (every constant, every struct, and a `static_assert` of every
//! size and offset); `xtask check` fails when the committed header is stale. Keep it plain:
//! constants of integer type and structs of `u32`, `u64` and `[u64; MAX_RANKS]` fields.

/// Ranks a flashcomm communicator supports.
pub const MAX_RANKS: usize = 8;
/// Bytes at the start of every rank's arena, before the data halves.
pub const ARENA_HEADER_BYTES: u64 = 8192;
/// Arena header, u32: a peer (or this rank) asks every block of this rank to stop.
pub const HDR_ABORT_REQ: u64 = 0;
/// Arena header, u32[MAX_RANKS]: peer-write probe words written at set-up.
pub const HDR_PROBE: u64 = 64;
/// Arena header, u32[MAX_BLOCKS]: this rank's epochs, one word per block index. Word `b` is the
/// epoch (sequence number) of the next collective as block `b` sees it; only this rank's kernels
/// touch them. Every kernel of `G` blocks advances all words (block `b` writes the words
/// `b, b + G, b + 2G, ...`), so each block of the next kernel, whatever its grid, reads its own
/// word without an atomic or a grid-wide count.
pub const HDR_EPOCHS: u64 = 4096;
/// Blocks a collective kernel may have (the epoch words of the arena header).
pub const MAX_BLOCKS: u32 = 1024;
/// Frame header bytes of the BLOCK protocol.
pub const FRAME_HEADER: u64 = 16;
/// Frame payload bytes of the BLOCK protocol.
pub const FRAME_PAYLOAD: u64 = 4096;
/// Frame bytes of the BLOCK protocol.
pub const FRAME_BYTES: u64 = FRAME_HEADER + FRAME_PAYLOAD;
/// Bytes of one LL line.
pub const LL_LINE: u64 = 16;
/// Payload bytes of one LL line.
pub const LL_PAYLOAD: u64 = 8;
/// Threads per block of the lossless collective kernels.
pub const THREADS: u32 = 512;
/// Protocol LL: 16-byte lines {4 B data, 4 B tag, 4 B data, 4 B tag}.
pub const PROTO_LL: u32 = 0;
/// Protocol BLOCK: frames of payload with one tag in a 16-byte header, written last.
pub const PROTO_BLOCK: u32 = 1;
/// Protocol PULL (staged): each rank copies its input into its own arena's pull area, publishes
/// one flag line per (peer, block, stage), and every rank loads its peers' data from there.
pub const PROTO_PULL: u32 = 2;
/// Protocol PULL (direct): as PULL, but peers load straight from the user's buffers (ranks of one
/// process on one device), and every block ends with a "done" flag exchange.
pub const PROTO_DIRECT: u32 = 3;
/// Blocks a PULL kernel may have (the flag slots of the pull area).
pub const PULL_MAX_BLOCKS: u32 = 256;
/// Flag stages of the PULL protocol: data ready, reduced shard ready, done (direct).
pub const PULL_STAGES: u32 = 3;
/// Bytes of the pull area's flag lines at its start: LL lines indexed
/// `[parity 2][stage PULL_STAGES][block PULL_MAX_BLOCKS][source MAX_RANKS]`; the two staging
/// halves follow. A PULL kernel finds the pull area at `FcCollParams::area_offset` of every arena
/// and the bytes of one staging half in `FcCollParams::sub_bytes`.
pub const PULL_FLAG_BYTES: u64 = 196_608;
/// FcCollParams.flags: the send buffer is 16-byte aligned.
pub const FLAG_SEND_ALIGNED: u32 = 1;
/// FcCollParams.flags: the receive buffer is 16-byte aligned.
pub const FLAG_RECV_ALIGNED: u32 = 2;
/// FcCollParams.flags: every block lets the next kernel of the stream launch as soon as it has
/// started (`griddepcontrol.launch_dependents`, compute capability 9.0 and later): a kernel
/// launched with programmatic stream serialization (every flashcomm kernel) then sits resident
/// at its `griddepcontrol.wait` and starts the moment this one completes. The host sets it only
/// where twice the grid still fits the ranks' resident share, so the waiting blocks can never
/// keep a peer's kernel from being scheduled.
pub const FLAG_EARLY_LAUNCH: u32 = 4;
/// FcCollParams.flags: the arenas are pinned host memory (the host transport), where every poll
/// of a line crosses PCIe: LL readers then poll one line per block and source until it is
/// ready before reading their own lines (`ll_gate`, docs/protocols.md, "LL over host memory").
/// The same on every rank of a communicator (ranks agree on the transport at set-up).
pub const FLAG_HOST_ARENAS: u32 = 8;
/// FcCollParams.flags, direct PULL only: this rank's peers read its input from its staging area
/// rather than from its send buffer (the send buffer is not 16-byte aligned, or the one-shot call
/// is in place, where the kernel overwrites what its peers read). Rank-local: it changes the
/// address this rank publishes, not the protocol.
pub const FLAG_PULL_STAGE_SEND: u32 = 16;
/// FcCollParams.flags, direct two-shot AllReduce only: some peer cannot store into this rank's
/// receive buffer (a peer of another process that has not mapped it: [`FcCollParams::recv_view`]),
/// so this rank copies the reduced shards from their owners' staging areas instead. Rank-local,
/// like `FLAG_PULL_STAGE_SEND`: owners see it in the address this rank publishes.
pub const FLAG_PULL_STAGE_RECV: u32 = 32;
/// FcCollParams.flags: bits `FLAG_SIG_SHIFT..FLAG_SIG_SHIFT + 8` carry the call's signature
/// (collective and datatype), which every tag of the call carries too: ranks that run the same
/// sequence number with different collectives or datatypes see a foreign tag and report a
/// mismatch instead of summing bytes of different types.
pub const FLAG_SIG_SHIFT: u32 = 8;
/// Phase trace (flashcomm-perf `--phase-trace`, off unless `FcCollParams::trace` is set): calls
/// kept, by sequence number modulo this.
pub const TRACE_CALLS: u32 = 64;
/// Phase trace: blocks traced (blocks from this one on stamp nothing).
pub const TRACE_BLOCKS: u32 = 32;
/// Phase trace: u64 words per (call, block): the sequence number plus one (0: never written), and
/// the global timer (ns) where the block began, where its peers' data was ready (the PULL
/// protocols; 0 elsewhere) and where it finished.
pub const TRACE_POINTS: u32 = 4;

/// Status codes in host-mapped memory, written by a kernel that gives up waiting.
pub mod status {
    /// No error.
    pub const OK: u32 = 0;
    /// A peer's data did not arrive within the timeout.
    pub const TIMEOUT: u32 = 1;
    /// The host set the abort flag (ncclCommAbort).
    pub const ABORTED: u32 = 2;
    /// A peer gave up and asked us to stop.
    pub const PEER_ABORTED: u32 = 3;
    /// A peer's tag belongs to another collective: calls differ across ranks.
    pub const MISMATCH: u32 = 4;
    /// A kernel is writing the record (an error, details follow).
    pub const CLAIMED: u32 = 0xffff_ffff;
}

/// What a kernel that gave up records (host-mapped; the first error wins).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FcStatus {
    /// status::*.
    pub code: u32,
    /// The rank waited for.
    pub peer: u32,
    /// The block that gave up.
    pub block: u32,
    /// The tag seen (mismatch) or 0.
    pub observed: u32,
    /// Epoch of the failed collective.
    pub seq: u64,
    /// Tag expected.
    pub expected: u64,
}

/// Parameters of every collective kernel, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FcCollParams {
    /// User send buffer.
    pub send: u64,
    /// User receive buffer.
    pub recv: u64,
    /// Elements: AllReduce count, ReduceScatter recvcount, AllGather sendcount.
    pub count: u64,
    /// Every rank's arena, as mapped in this process.
    pub peer_base: [u64; MAX_RANKS],
    /// This rank's epoch words (u32[MAX_BLOCKS] at HDR_EPOCHS of its arena).
    pub epochs: u64,
    /// Host-mapped u32 set by ncclCommAbort.
    pub abort_flag: u64,
    /// Host-mapped FcStatus.
    pub status: u64,
    /// Bound on every wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Bytes of one call-parity half.
    pub half_bytes: u64,
    /// Bytes of one region (region B starts this far into a half).
    pub region_bytes: u64,
    /// Bytes per source rank inside a region (LL area, then BLOCK area).
    pub slot_bytes: u64,
    /// Bytes per (block, round parity) inside a slot. PULL: bytes of one staging half.
    pub sub_bytes: u64,
    /// Payload bytes carried per (block, round) per source. PULL: bytes of the message (one-shot)
    /// or of a shard (two-shot) that one block takes.
    pub chunk_bytes: u64,
    /// Two-shot: elements per shard (the last shard may be shorter).
    pub shard_elems: u64,
    /// This rank.
    pub rank: u32,
    /// Ranks.
    pub nranks: u32,
    /// Bytes per element of the datatype.
    pub elem_bytes: u32,
    /// FLAG_*.
    pub flags: u32,
    /// Quantized collectives (zero for lossless ones): codec width of the first (or only) step.
    pub q_bits_rs: u32,
    /// Codec width of the all-gather step.
    pub q_bits_ag: u32,
    /// Codec group size.
    pub q_group: u32,
    /// Codec spikes per group.
    pub q_spikes: u32,
    /// Encoded bytes per 1024-value block, first step.
    pub q_block_bytes_rs: u32,
    /// Encoded bytes per 1024-value block, second step.
    pub q_block_bytes_ag: u32,
    /// Where this protocol's area starts inside every slot. PULL: where the pull area starts in
    /// every arena.
    pub area_offset: u64,
    /// Host transport: device memory that stands in for this rank's own slots (regions A and B,
    /// `2 * slot_bytes`), which only this rank's kernels write and read (the quantized kernels
    /// encode into them and copy or decode from there), so those bytes never cross PCIe. 0: the
    /// own slots are in the arena.
    pub own_slots: u64,
    /// Direct PULL: where peer q finds this rank's send buffer in its own process (the address
    /// this rank publishes to q; the send buffer itself for a peer of this process, a mapping of
    /// a registered buffer for a peer of another process). Unused with `FLAG_PULL_STAGE_SEND`.
    pub send_view: [u64; MAX_RANKS],
    /// Direct two-shot AllReduce: where peer q finds this rank's receive buffer (as `send_view`).
    /// Unused with `FLAG_PULL_STAGE_RECV`.
    pub recv_view: [u64; MAX_RANKS],
    /// Phase trace: this rank's u64 words `[TRACE_CALLS][TRACE_BLOCKS][TRACE_POINTS]` in device
    /// memory, which thread 0 of each traced block stamps; 0 (every call unless asked): none.
    pub trace: u64,
}

/// Parameters of the set-up probe, which writes one word into every peer's arena header.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FcProbeParams {
    /// Every rank's arena.
    pub peer_base: [u64; MAX_RANKS],
    /// This rank.
    pub rank: u32,
    /// Ranks.
    pub nranks: u32,
    /// Value to write.
    pub value: u32,
    /// Padding.
    pub pad: u32,
}

/// Parameters of the copy-engine schedule's reduction (`fc_copy_reduce_<type>`, docs/protocols.md
/// "The copy-engine schedule"): `dst[i] = src[0][i] + ... + src[nsrc - 1][i]`, in f32 in rank
/// order, rounded once (the order of every reducing kernel). `dst` may be one of the sources.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FcReduceParams {
    /// One device address per rank, in rank order.
    pub src: [u64; MAX_RANKS],
    /// Where the sums go.
    pub dst: u64,
    /// Elements.
    pub elems: u64,
    /// Sources used (the communicator's ranks, at most `MAX_RANKS`).
    pub nsrc: u32,
    /// Padding.
    pub pad: u32,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<FcStatus>() == 32);
    assert!(size_of::<FcCollParams>() == 360);
    assert!(offset_of!(FcCollParams, peer_base) == 24);
    assert!(offset_of!(FcCollParams, epochs) == 88);
    assert!(offset_of!(FcCollParams, shard_elems) == 160);
    assert!(offset_of!(FcCollParams, rank) == 168);
    assert!(offset_of!(FcCollParams, q_bits_rs) == 184);
    assert!(offset_of!(FcCollParams, area_offset) == 208);
    assert!(offset_of!(FcCollParams, own_slots) == 216);
    assert!(offset_of!(FcCollParams, send_view) == 224);
    assert!(offset_of!(FcCollParams, recv_view) == 288);
    assert!(offset_of!(FcCollParams, trace) == 352);
    assert!(size_of::<FcProbeParams>() == 80);
    assert!(size_of::<FcReduceParams>() == 88);
    assert!(offset_of!(FcReduceParams, dst) == 64);
    assert!(offset_of!(FcReduceParams, nsrc) == 80);
    assert!(
        PULL_FLAG_BYTES
            == 2 * PULL_STAGES as u64 * PULL_MAX_BLOCKS as u64 * MAX_RANKS as u64 * LL_LINE
    );
};

/// The parameter structs that kernels take by value (sealed: only the `#[repr(C)]` mirrors of
/// this module, whose layouts are asserted against the CUDA header).
pub trait KernelParams: Copy + sealed::Sealed {}
impl KernelParams for FcCollParams {}
impl KernelParams for FcProbeParams {}
impl KernelParams for FcReduceParams {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::FcCollParams {}
    impl Sealed for super::FcProbeParams {}
    impl Sealed for super::FcReduceParams {}
}

#[cfg(test)]
mod tests {
    /// The CUDA header and this file must agree; the header's static_asserts pin the C side, and
    /// this test pins that the header still says what this file assumes.
    #[test]
    fn header_constants_match() {
        let h = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../cuda/include/flashcomm/params.h"
        ))
        .unwrap();
        for (name, v) in [
            ("FC_MAX_RANKS", super::MAX_RANKS as u64),
            ("FC_ARENA_HEADER_BYTES", super::ARENA_HEADER_BYTES),
            ("FC_HDR_ABORT_REQ", super::HDR_ABORT_REQ),
            ("FC_HDR_PROBE", super::HDR_PROBE),
            ("FC_HDR_EPOCHS", super::HDR_EPOCHS),
            ("FC_MAX_BLOCKS", super::MAX_BLOCKS as u64),
        ] {
            let line = h
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} missing"));
            let val: u64 = line
                .split_whitespace()
                .nth(2)
                .unwrap()
                .trim_end_matches('u')
                .parse()
                .unwrap();
            assert_eq!(val, v, "{name}");
        }
        assert!(h.contains("sizeof(FcCollParams) == 360"));
        // The frame sizes moved from transport.cuh into the generated params.h.
        assert!(h.contains("#define FC_FRAME_PAYLOAD 4096"));
        assert!(h.contains("#define FC_FRAME_HEADER 16"));
    }
}
