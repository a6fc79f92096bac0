//! The arena's layout: the geometry every rank allocates alike, how a message is cut into blocks
//! and chunks, and the shards of two-shot.

use crate::abi::{
    ARENA_HEADER_BYTES, FRAME_BYTES, FRAME_PAYLOAD, LL_LINE, LL_PAYLOAD, MAX_RANKS,
    PULL_FLAG_BYTES, PULL_MAX_BLOCKS, THREADS,
};
use crate::error::Error;

use super::{Collective, Protocol};

/// The arena every rank allocates: a header, then two halves (collective parity), each with two
/// regions (A: first step, B: second step) of one slot per source rank. A slot has one area per
/// push protocol (LL first, a quarter of the slot; then BLOCK), so neither protocol ever reads
/// what the other left behind. After the halves, the pull area (when the communicator has one):
/// the PULL protocol's flag lines ([`PULL_FLAG_BYTES`]), then two staging halves, disjoint from
/// everything the push protocols write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arena {
    /// Ranks.
    pub nranks: u32,
    /// Bytes per source slot.
    pub slot_bytes: u64,
    /// Bytes of the LL area at the start of every slot (the BLOCK area follows).
    pub ll_bytes: u64,
    /// Bytes per region (`nranks * slot_bytes`).
    pub region_bytes: u64,
    /// Bytes per half (two regions).
    pub half_bytes: u64,
    /// Where the pull area starts (its flag lines; the staging halves follow them).
    pub pull_offset: u64,
    /// Bytes of one staging half of the pull area (0: no pull area, the PULL protocols are off).
    pub pull_half_bytes: u64,
    /// Whether every rank's user buffers are readable by its peers at the same address (ranks
    /// of one process on one device): the direct PULL protocol is possible. Set by the
    /// communicator after set-up, the same on every rank.
    pub direct: bool,
    /// Where the copy-engine schedule's area starts ([`super::copy`]; host transport with
    /// `FLASHCOMM_HOST_COPY` not `off`), 0 when the arena has none.
    pub copy_offset: u64,
    /// Total bytes including the header.
    pub total_bytes: u64,
}

impl Arena {
    /// The largest arena within `cap` bytes for `nranks` ranks. Slots are multiples of 64 KiB.
    pub fn new(nranks: u32, cap: u64) -> Result<Arena, Error> {
        if nranks == 0 || nranks as usize > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{nranks} ranks (flashcomm kernels support 1..={MAX_RANKS})"
            )));
        }
        let per = 2 * 2 * nranks as u64;
        let slot = (cap.saturating_sub(ARENA_HEADER_BYTES) / per) & !(64 * 1024 - 1);
        if slot < 2 * FRAME_BYTES {
            return Err(Error::Unsupported(format!(
                "arena cap of {cap} bytes is too small for {nranks} ranks (need at least {} bytes)",
                ARENA_HEADER_BYTES + per * 64 * 1024
            )));
        }
        let region = slot * nranks as u64;
        Ok(Arena {
            nranks,
            slot_bytes: slot,
            ll_bytes: slot / 4,
            region_bytes: region,
            half_bytes: 2 * region,
            pull_offset: ARENA_HEADER_BYTES + 4 * region,
            pull_half_bytes: 0,
            direct: false,
            copy_offset: 0,
            total_bytes: ARENA_HEADER_BYTES + 4 * region,
        })
    }

    /// [`Arena::new`] followed by a pull area of about `pull_bytes` (two staging halves, each a
    /// multiple of 64 KiB, plus the flag lines); `pull_bytes` below 128 KiB gives no pull area.
    pub fn with_pull(nranks: u32, cap: u64, pull_bytes: u64) -> Result<Arena, Error> {
        let mut a = Arena::new(nranks, cap)?;
        let half = (pull_bytes / 2) & !(64 * 1024 - 1);
        if half > 0 {
            a.pull_half_bytes = half;
            a.total_bytes = a.pull_offset + PULL_FLAG_BYTES + 2 * half;
        }
        Ok(a)
    }

    /// This arena followed by the copy-engine schedule's area of `bytes` (page-aligned), which
    /// peers then map with the rest.
    pub fn with_copy_area(mut self, bytes: u64) -> Arena {
        self.copy_offset = self.total_bytes.next_multiple_of(4096);
        self.total_bytes = self.copy_offset + bytes;
        self
    }

    /// Bytes of the BLOCK area of every slot.
    pub fn block_bytes(&self) -> u64 {
        self.slot_bytes - self.ll_bytes
    }

    /// Offset of `proto`'s area inside every slot; for the PULL protocols, the offset of the pull
    /// area inside every arena.
    pub fn area_offset(&self, proto: Protocol) -> u64 {
        match proto {
            Protocol::Ll => 0,
            Protocol::Block => self.ll_bytes,
            Protocol::Pull | Protocol::Direct => self.pull_offset,
        }
    }

    /// Whether a PULL plan of `proto` exists for a call of `coll` with `count` elements of `elem`
    /// bytes (AllReduce and AllGather: the send count; ReduceScatter: the receive count;
    /// AllToAll: the count per peer): the communicator has a pull area whose staging half holds
    /// what a rank stages (AllReduce: the message, or for two-shot `nranks` shards of `shard`
    /// elements; AllGather: its input; ReduceScatter and AllToAll: `nranks` pieces, each rounded
    /// up to 16 bytes), and for `Direct`, user buffers readable by peers. (A direct rank may stage
    /// rank-locally, so the area must hold the call whichever PULL protocol runs.)
    pub fn pull_fits(
        &self,
        proto: Protocol,
        coll: Collective,
        count: u64,
        elem: u64,
        shard: Option<u64>,
    ) -> bool {
        let n = self.nranks as u64;
        let need = match (coll, shard) {
            (Collective::AllReduce, Some(s)) => s * elem * n,
            (Collective::ReduceScatter | Collective::AlltoAll, _) => {
                (count * elem).next_multiple_of(16) * n
            }
            _ => (count * elem).next_multiple_of(16),
        };
        let ok = self.pull_half_bytes > 0 && need <= self.pull_half_bytes;
        match proto {
            Protocol::Pull => ok,
            Protocol::Direct => ok && self.direct,
            Protocol::Ll | Protocol::Block => true,
        }
    }

    /// The most blocks a launch may use (each needs two sub-slots of at least one frame).
    pub fn max_grid(&self) -> u32 {
        (self.block_bytes() / (2 * FRAME_BYTES)).min(u32::MAX as u64) as u32
    }

    /// Sub-slot bytes and payload bytes per chunk for `proto` with `grid` blocks (PULL: the
    /// staging half; its chunks are cut by [`pull_shape`]).
    pub fn chunking(&self, proto: Protocol, grid: u32) -> (u64, u64) {
        match proto {
            Protocol::Pull | Protocol::Direct => (self.pull_half_bytes, self.pull_half_bytes),
            Protocol::Ll => {
                let sub = (self.ll_bytes / (2 * grid as u64)) & !(LL_LINE - 1);
                (sub, sub / LL_LINE * LL_PAYLOAD)
            }
            Protocol::Block => {
                let frames = (self.block_bytes() / (2 * grid as u64) / FRAME_BYTES).max(1);
                (frames * FRAME_BYTES, frames * FRAME_PAYLOAD)
            }
        }
    }
}

/// Elements per two-shot shard: `count / nranks` rounded up to 16 bytes; `None` when that would
/// leave the last shard empty (then two-shot is not valid for this count).
pub fn shard_elems(count: u64, nranks: u32, elem: u64) -> Option<u64> {
    let n = nranks as u64;
    let align = (16 / elem).max(1);
    let per = count.div_ceil(n).div_ceil(align) * align;
    ((n - 1) * per < count).then_some(per)
}

/// Payload bytes an LL thread takes per step: one 8-byte unit, one line per peer.
pub const LL_THREAD_BYTES: u64 = LL_PAYLOAD;

/// Threads an LL block aims for: a small message spread over several blocks, one unit per
/// thread (measured on the H200 with a one-shot kernel of this shape: 8 KiB over 4 blocks of 256
/// threads, 2 ranks, 1.82 us against the plain reference's 2.19 us; docs/experiments.md, "The
/// small-message path").
pub const LL_BLOCK_THREADS: u32 = 256;

/// Bytes of the message a one-shot PULL block takes: one 16-byte vector per thread of a block of
/// [`THREADS`] (8 KiB: one block; 64 KiB: eight).
pub const PULL_ONESHOT_BLOCK_BYTES: u64 = 16 * THREADS as u64;
/// Bytes of a shard a two-shot PULL block takes (it loads this from every rank, then copies this
/// from every owner).
pub const PULL_TWOSHOT_BLOCK_BYTES: u64 = 8 * THREADS as u64;

/// Bytes of a rank's piece a PULL block of ReduceScatter, AllGather or AllToAll takes (it loads
/// this from every peer).
pub const PULL_PIECE_BLOCK_BYTES: u64 = 8 * THREADS as u64;

/// Grid and per-block bytes of a PULL launch over `bytes` (the message, one-shot; a shard,
/// two-shot): `target` bytes per block, at most `max_grid` and [`PULL_MAX_BLOCKS`] blocks, every
/// block with work (a multiple of 16 bytes each).
pub fn pull_shape(bytes: u64, target: u64, max_grid: u32) -> (u32, u64) {
    let cap = max_grid.clamp(1, PULL_MAX_BLOCKS) as u64;
    let grid = bytes.div_ceil(target).clamp(1, cap);
    let chunk = bytes.div_ceil(grid).next_multiple_of(16).max(16);
    (bytes.div_ceil(chunk).max(1) as u32, chunk)
}

/// Blocks and threads per block of a launch that moves `bytes` per source with `proto`.
/// LL: one 8-byte unit per thread in blocks of [`LL_BLOCK_THREADS`] threads, as many blocks as
/// that takes up to `max_grid`; a capped grid gets larger blocks (up to [`THREADS`]) before its
/// threads loop. BLOCK: blocks of [`THREADS`] threads, one warp per frame.
pub fn shape_for(proto: Protocol, bytes: u64, max_grid: u32) -> (u32, u32) {
    let grid = grid_for(proto, bytes, max_grid);
    let threads = match proto {
        Protocol::Ll => {
            let per_block = bytes.div_ceil(grid as u64).div_ceil(LL_THREAD_BYTES);
            (per_block.next_multiple_of(32) as u32).clamp(LL_BLOCK_THREADS, THREADS)
        }
        Protocol::Block | Protocol::Pull | Protocol::Direct => THREADS,
    };
    (grid, threads)
}

/// Blocks for a launch that moves `bytes` per source with `proto`, capped at `max_grid`.
pub fn grid_for(proto: Protocol, bytes: u64, max_grid: u32) -> u32 {
    let per_block = match proto {
        Protocol::Ll => LL_BLOCK_THREADS as u64 * LL_THREAD_BYTES,
        Protocol::Block => (THREADS as u64 / 32) * FRAME_PAYLOAD,
        Protocol::Pull | Protocol::Direct => PULL_ONESHOT_BLOCK_BYTES,
    };
    bytes.div_ceil(per_block).clamp(1, max_grid.max(1) as u64) as u32
}

/// Payload bytes per chunk for a message of `bytes` per source over `grid` blocks: the message
/// cut evenly over the blocks (a multiple of 16 bytes), so that every block has work, at most
/// `capacity` (what one sub-slot carries).
pub fn chunk_for(bytes: u64, grid: u32, capacity: u64) -> u64 {
    bytes
        .div_ceil(grid.max(1) as u64)
        .next_multiple_of(16)
        .clamp(16, capacity.max(16))
}
