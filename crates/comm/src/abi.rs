//! Rust mirrors of the layouts in `cuda/include/flashcomm/params.h`. Sizes and offsets are
//! asserted at compile time here and with `static_assert` on the CUDA side.

/// Ranks a flashcomm communicator supports (`FC_MAX_RANKS`).
pub const MAX_RANKS: usize = 8;
/// Bytes of the arena header (`FC_ARENA_HEADER_BYTES`).
pub const ARENA_HEADER_BYTES: u64 = 4096;
/// Offset of the abort-request word in the arena header.
pub const HDR_ABORT_REQ: u64 = 0;
/// Offset of the probe words in the arena header.
pub const HDR_PROBE: u64 = 64;
/// Offset of the control block in the arena header.
pub const HDR_CTL: u64 = 1024;
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
/// Threads per block of the collective kernels.
pub const THREADS: u32 = 512;

/// Device status codes (`FC_STATUS_*`).
pub mod status {
    /// No error.
    pub const OK: u32 = 0;
    /// A peer did not arrive in time.
    pub const TIMEOUT: u32 = 1;
    /// The host asked to abort.
    pub const ABORTED: u32 = 2;
    /// A peer gave up and asked this rank to stop.
    pub const PEER_ABORTED: u32 = 3;
    /// A peer ran a different collective.
    pub const MISMATCH: u32 = 4;
    /// A kernel is writing the record; the code follows.
    pub const CLAIMED: u32 = 0xffff_ffff;
}

/// `FcCtl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FcCtl {
    /// Epoch of the next collective.
    pub seq: u64,
    /// Finished blocks of the running kernel.
    pub done: u32,
    /// Padding.
    pub pad: u32,
}

/// `FcStatus`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FcStatus {
    /// `status::*`.
    pub code: u32,
    /// Rank waited for.
    pub peer: u32,
    /// Block that gave up.
    pub block: u32,
    /// Tag observed (mismatch).
    pub observed: u32,
    /// Epoch of the failed collective.
    pub seq: u64,
    /// Tag expected.
    pub expected: u64,
}

/// `FcCollParams`: the single by-value parameter of every collective kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FcCollParams {
    /// User send buffer.
    pub send: u64,
    /// User receive buffer.
    pub recv: u64,
    /// Elements (AllReduce count, ReduceScatter recvcount, AllGather sendcount).
    pub count: u64,
    /// Every rank's arena as mapped in this process.
    pub peer_base: [u64; MAX_RANKS],
    /// This rank's `FcCtl`.
    pub ctl: u64,
    /// Host-mapped abort flag.
    pub abort_flag: u64,
    /// Host-mapped `FcStatus`.
    pub status: u64,
    /// Bound on every wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Bytes of one call-parity half.
    pub half_bytes: u64,
    /// Bytes of one region.
    pub region_bytes: u64,
    /// Bytes per source slot.
    pub slot_bytes: u64,
    /// Bytes per (block, round parity) sub-slot.
    pub sub_bytes: u64,
    /// Payload bytes per chunk.
    pub chunk_bytes: u64,
    /// Two-shot shard size in elements.
    pub shard_elems: u64,
    /// This rank.
    pub rank: u32,
    /// Ranks.
    pub nranks: u32,
    /// Bytes per element.
    pub elem_bytes: u32,
    /// `FC_FLAG_*`.
    pub flags: u32,
    /// Codec width, first step.
    pub q_bits_rs: u32,
    /// Codec width, all-gather step.
    pub q_bits_ag: u32,
    /// Codec group size.
    pub q_group: u32,
    /// Codec spikes per group.
    pub q_spikes: u32,
    /// Encoded bytes per block, first step.
    pub q_block_bytes_rs: u32,
    /// Encoded bytes per block, all-gather step.
    pub q_block_bytes_ag: u32,
    /// Offset of this protocol's area inside every slot.
    pub area_offset: u64,
}

/// `FcProbeParams`.
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

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<FcCtl>() == 16);
    assert!(size_of::<FcStatus>() == 32);
    assert!(size_of::<FcCollParams>() == 216);
    assert!(offset_of!(FcCollParams, peer_base) == 24);
    assert!(offset_of!(FcCollParams, ctl) == 88);
    assert!(offset_of!(FcCollParams, shard_elems) == 160);
    assert!(offset_of!(FcCollParams, rank) == 168);
    assert!(offset_of!(FcCollParams, q_bits_rs) == 184);
    assert!(offset_of!(FcCollParams, area_offset) == 208);
    assert!(size_of::<FcProbeParams>() == 80);
};

/// Marker for the parameter structs that kernels take by value.
pub(crate) trait KernelParams: Copy {}
impl KernelParams for FcCollParams {}
impl KernelParams for FcProbeParams {}

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
            ("FC_HDR_CTL", super::HDR_CTL),
        ] {
            let line = h
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} missing"));
            let val: u64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
            assert_eq!(val, v, "{name}");
        }
        assert!(h.contains("sizeof(FcCollParams) == 216"));
        let t = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../cuda/include/flashcomm/transport.cuh"
        ))
        .unwrap();
        assert!(t.contains("#define FC_FRAME_PAYLOAD 4096"));
        assert!(t.contains("#define FC_FRAME_HEADER 16"));
    }
}
