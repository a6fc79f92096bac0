//! Pure planning: the arena geometry, how a call is cut into chunks, and the cost-guided choice
//! of algorithm and protocol. Nothing here touches the GPU, so every rank computes the same plan
//! from the same inputs, and everything here is unit-tested on the CPU.

use crate::abi::{
    ARENA_HEADER_BYTES, FRAME_BYTES, FRAME_PAYLOAD, LL_LINE, LL_PAYLOAD, MAX_RANKS,
    PULL_FLAG_BYTES, PULL_MAX_BLOCKS, THREADS,
};
use crate::error::Error;

/// The kind of a collective: the tree's one collective enum. flashcomm's kernels implement
/// AllReduce, ReduceScatter, AllGather and AllToAll ([`KERNEL_COLLECTIVES`]); the communicator
/// refuses the other kinds.
pub use flashcomm_codec::Collective;

/// The collectives flashcomm's kernels implement.
pub const KERNEL_COLLECTIVES: [Collective; 4] = [
    Collective::AllReduce,
    Collective::ReduceScatter,
    Collective::AllGather,
    Collective::AlltoAll,
];

/// Element types of the reducing collectives: the codec's, the one datatype enum of the tree.
pub use flashcomm_codec::DType as DataType;
/// How readiness travels with the data, and the AllReduce algorithms: the kernel catalogue's.
pub use flashcomm_kernels::catalog::{Algorithm, Protocol};

/// A choice that is either automatic or forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Choice<T> {
    /// Let the cost model decide.
    #[default]
    Auto,
    /// Always this one (where it is valid).
    Force(T),
}

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

    /// Whether a PULL plan of `proto` exists for an AllReduce of `count` elements of `elem`
    /// bytes: the communicator has a pull area that holds the message (two-shot: `nranks`
    /// shards of `shard` elements), and for `Direct`, user buffers readable by peers.
    pub fn pull_fits(&self, proto: Protocol, count: u64, elem: u64, shard: Option<u64>) -> bool {
        let need = match shard {
            Some(s) => s * elem * self.nranks as u64,
            None => (count * elem).next_multiple_of(16),
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

/// Message sizes (bytes of one rank) at which calibration times every (algorithm, protocol):
/// the decode range by factors of 2, then larger points up to the pull area's default reach
/// (16 MiB), where the protocols' bandwidths decide.
pub const CALIB_SIZES: [u64; 11] = [
    4 << 10,
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
];

/// From this message size on, calibration stops timing a combination that was measured more than
/// [`PRUNE_FACTOR`] times slower than the fastest at a size: it will not be chosen at larger
/// sizes either, and timing it there (LL at 16 MiB on 8 ranks takes milliseconds a call) is most of
/// what set-up would otherwise wait for. Below it every combination is timed everywhere: at the
/// smallest sizes a protocol that is slow there may still win later (PULL's fixed cost).
pub const PRUNE_FROM: u64 = 1 << 20;
/// See [`PRUNE_FROM`].
pub const PRUNE_FACTOR: f64 = 3.0;

/// The calibration's table while it is being measured, size by size: which combinations are
/// still timed, and each one's times. Fed the agreed (every rank's maximum) times of each size,
/// so every rank drops the same combinations at the same size and runs the same timed plans.
#[derive(Clone, Debug)]
pub struct Calibration {
    rows: Vec<[f64; CALIB_SIZES.len()]>,
    /// The size index at which a combination was dropped (`None`: still timed).
    dropped: Vec<Option<usize>>,
}

impl Calibration {
    /// A table for `n` combinations, all of them to be timed.
    pub fn new(n: usize) -> Calibration {
        Calibration {
            rows: vec![[0.0; CALIB_SIZES.len()]; n],
            dropped: vec![None; n],
        }
    }

    /// Whether combination `k` is still timed.
    pub fn live(&self, k: usize) -> bool {
        self.dropped[k].is_none()
    }

    /// Every rank's times of one size (as serialized by the caller: `n` little-endian f64 each)
    /// reduced to their element-wise maximum.
    pub fn agree_times(all: &[Vec<u8>], n: usize) -> Result<Vec<f64>, Error> {
        let mut out = vec![0f64; n];
        for b in all {
            if b.len() != 8 * n {
                return Err(Error::Bootstrap(
                    "malformed calibration times from a peer".into(),
                ));
            }
            for (k, t) in out.iter_mut().enumerate() {
                *t = t.max(f64::from_le_bytes(b[8 * k..8 * k + 8].try_into().unwrap()));
            }
        }
        Ok(out)
    }

    /// Records the agreed times of size `i` for the live combinations, then drops those more
    /// than [`PRUNE_FACTOR`] times slower than the fastest, from [`PRUNE_FROM`] on.
    pub fn record(&mut self, i: usize, agreed: &[f64]) {
        let mut fastest = f64::INFINITY;
        for (k, &t) in agreed.iter().enumerate() {
            if self.live(k) {
                self.rows[k][i] = t;
                fastest = fastest.min(t);
            }
        }
        if CALIB_SIZES[i] >= PRUNE_FROM {
            for (k, &t) in agreed.iter().enumerate() {
                if self.live(k) && t > PRUNE_FACTOR * fastest {
                    self.dropped[k] = Some(i);
                }
            }
        }
    }

    /// Combination `k`'s row: measured times, and past the size at which it was dropped, its last
    /// time scaled in proportion to the size (above the linear extension of any time with a fixed
    /// cost, so the estimate errs towards "slower": the planner keeps not choosing it).
    pub fn row(&self, k: usize) -> [f64; CALIB_SIZES.len()] {
        let mut r = self.rows[k];
        if let Some(last) = self.dropped[k] {
            for i in last + 1..CALIB_SIZES.len() {
                r[i] = r[last] * CALIB_SIZES[i] as f64 / CALIB_SIZES[last] as f64;
            }
        }
        r
    }
}

/// Candidates whose predicted time is within this factor of the fastest count as ties, and a
/// tie goes to the first in a fixed order (one-shot before two-shot, LL before BLOCK): noise
/// between two nearly equal plans then cannot flip the choice from one calibration to the next,
/// and the plan chosen is never more than this factor slower than the best one predicted.
pub const TIE_FACTOR: f64 = 1.03;

/// Whether a calibration table holds a measured time (positive and finite; 0: not measured).
fn measured(t: f64) -> bool {
    t > 0.0 && t.is_finite()
}

/// A time from a row measured at [`CALIB_SIZES`]: piecewise linear between the measured sizes,
/// the last segment's slope (never negative) beyond the largest. A row may leave its smallest
/// sizes unmeasured (0); from its first measured size on every entry must be measured. `None`
/// below the first measured size (unless that is the smallest of all, whose time then holds
/// below it too), or when fewer than two sizes are measured.
fn interpolate(row: &[f64; CALIB_SIZES.len()], bytes: u64) -> Option<f64> {
    let first = row.iter().position(|&t| measured(t))?;
    let last = CALIB_SIZES.len() - 1;
    if first == last || !row[first..].iter().all(|&t| measured(t)) {
        return None;
    }
    if bytes <= CALIB_SIZES[first] {
        return (first == 0 || bytes == CALIB_SIZES[first]).then_some(row[first]);
    }
    // The segment that holds `bytes` (the last one beyond the largest size).
    let i = CALIB_SIZES
        .iter()
        .position(|&s| bytes <= s)
        .unwrap_or(last)
        .max(first + 1);
    let (x0, x1) = (CALIB_SIZES[i - 1] as f64, CALIB_SIZES[i] as f64);
    let slope = ((row[i] - row[i - 1]) / (x1 - x0)).max(0.0);
    Some(row[i - 1] + slope * (bytes as f64 - x0))
}

/// Protocols the cost model has a row for (every one of [`Protocol::ALL`]).
const NPROTO: usize = Protocol::ALL.len();

/// The latency model per (algorithm, protocol), in microseconds for a message of `bytes` bytes
/// per rank: the times measured at [`CALIB_SIZES`] when calibrated (piecewise linear between
/// them, the last segment's slope beyond the largest, the smallest's time below it), otherwise
/// a linear model `t = a + b * bytes`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Fixed cost in microseconds, indexed [algorithm][protocol].
    pub a_us: [[f64; NPROTO]; 2],
    /// Cost per byte in microseconds, indexed [algorithm][protocol].
    pub b_us_per_byte: [[f64; NPROTO]; 2],
    /// Measured microseconds at [`CALIB_SIZES`], indexed [algorithm][protocol][size]; a row
    /// with any entry that is not positive is not used (the linear model applies).
    pub table_us: [[[f64; CALIB_SIZES.len()]; NPROTO]; 2],
    /// Whether the constants were measured on this machine (false: defaults).
    pub calibrated: bool,
}

/// Bytes of a serialized [`CostModel`].
const MODEL_BYTES: usize = 8 * (2 * NPROTO * 2 + 2 * NPROTO * CALIB_SIZES.len());

impl CostModel {
    /// Defaults for `nranks` ranks, used until calibration runs (or when it is disabled). They
    /// encode the structure: LL halves the density but saves a fence per frame; two-shot moves
    /// 2(N-1)/N of the message per rank instead of N-1 but takes two steps. The PULL protocols
    /// get a fixed cost no push plan reaches: they are chosen by measurement only.
    pub fn default_for(nranks: u32) -> CostModel {
        let n = nranks.max(1) as f64;
        let link = 150_000.0; // bytes per microsecond a rank can push (150 GB/s)
        let one = (n - 1.0).max(1.0) / link;
        let two = 2.0 * (n - 1.0).max(1.0) / n / link;
        CostModel {
            a_us: [[3.0, 6.0, 1e6, 1e6], [5.0, 10.0, 1e6, 1e6]],
            b_us_per_byte: [[2.0 * one, one, one, one], [2.0 * two, two, two, two]],
            table_us: [[[0.0; CALIB_SIZES.len()]; NPROTO]; 2],
            calibrated: false,
        }
    }

    /// Predicted microseconds.
    pub fn predict(&self, algo: Algorithm, proto: Protocol, bytes: u64) -> f64 {
        let row = &self.table_us[algo.index()][proto.index()];
        if row.iter().all(|&t| measured(t))
            && let Some(t) = interpolate(row, bytes)
        {
            return t;
        }
        self.a_us[algo.index()][proto.index()]
            + self.b_us_per_byte[algo.index()][proto.index()] * bytes as f64
    }

    /// Records the times measured at [`CALIB_SIZES`] for one combination (and the linear model
    /// through the smallest and largest, for whoever reads `a` and `b`).
    pub fn set_measured(&mut self, algo: Algorithm, proto: Protocol, us: [f64; CALIB_SIZES.len()]) {
        let last = CALIB_SIZES.len() - 1;
        self.fit(
            algo,
            proto,
            (CALIB_SIZES[0], us[0]),
            (CALIB_SIZES[last], us[last]),
        );
        self.table_us[algo.index()][proto.index()] = us;
    }

    /// Fits `a` and `b` of one combination from two measurements (bytes, microseconds).
    pub fn fit(&mut self, algo: Algorithm, proto: Protocol, small: (u64, f64), large: (u64, f64)) {
        let b = ((large.1 - small.1) / (large.0 as f64 - small.0 as f64)).max(1e-9);
        let a = (small.1 - b * small.0 as f64).max(0.0);
        self.a_us[algo.index()][proto.index()] = a;
        self.b_us_per_byte[algo.index()][proto.index()] = b;
    }

    /// Serializes for the exchange between ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(MODEL_BYTES);
        for i in 0..2 {
            for j in 0..NPROTO {
                v.extend_from_slice(&self.a_us[i][j].to_le_bytes());
                v.extend_from_slice(&self.b_us_per_byte[i][j].to_le_bytes());
            }
        }
        for i in 0..2 {
            for j in 0..NPROTO {
                for t in self.table_us[i][j] {
                    v.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        v
    }

    /// The element-wise maximum of every rank's model: one model all ranks agree on.
    pub fn agree(models: &[Vec<u8>]) -> Result<CostModel, Error> {
        let mut m = CostModel {
            a_us: [[0.0; NPROTO]; 2],
            b_us_per_byte: [[0.0; NPROTO]; 2],
            table_us: [[[0.0; CALIB_SIZES.len()]; NPROTO]; 2],
            calibrated: true,
        };
        for bytes in models {
            if bytes.len() != MODEL_BYTES {
                return Err(Error::Bootstrap("malformed cost model from a peer".into()));
            }
            let f = |k: usize| f64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().unwrap());
            for i in 0..2 {
                for j in 0..NPROTO {
                    let k = (i * NPROTO + j) * 2;
                    m.a_us[i][j] = m.a_us[i][j].max(f(k));
                    m.b_us_per_byte[i][j] = m.b_us_per_byte[i][j].max(f(k + 1));
                    let base = 2 * NPROTO * 2 + (i * NPROTO + j) * CALIB_SIZES.len();
                    for (s, t) in m.table_us[i][j].iter_mut().enumerate() {
                        *t = t.max(f(base + s));
                    }
                }
            }
        }
        Ok(m)
    }
}

/// Codec settings of a quantized AllReduce (the wire format of docs/codec.md): the width of the
/// first step (the only step of one-shot), the width of the all-gather step of two-step, the group
/// size and the spikes kept per group. The same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Bits per value of the reduce-scatter step (and of one-shot): 2..=8.
    pub rs_bits: u8,
    /// Bits per value of the all-gather step: 2..=8 (equal to `rs_bits`, or 8).
    pub ag_bits: u8,
    /// Values per group: 32, 64, 128 or 256.
    pub group: u16,
    /// Extreme values kept exactly per group: 0, 2 or 4.
    pub spikes: u8,
}

impl QuantSpec {
    /// Checks the combination (the kernels exist for equal widths and for an 8-bit all-gather).
    pub fn new(rs_bits: u8, ag_bits: u8, group: u16, spikes: u8) -> Result<QuantSpec, Error> {
        let ok_bits = |b: u8| (2..=8).contains(&b);
        if !ok_bits(rs_bits) || !ok_bits(ag_bits) {
            return Err(Error::InvalidArgument(format!(
                "quantization widths {rs_bits}/{ag_bits}: allowed 2..=8"
            )));
        }
        if ag_bits != rs_bits && ag_bits != 8 {
            return Err(Error::Unsupported(format!(
                "quantization widths {rs_bits}/{ag_bits}: the all-gather width must equal the reduce-scatter width or be 8"
            )));
        }
        if ![32, 64, 128, 256].contains(&group) {
            return Err(Error::InvalidArgument(format!(
                "group size {group}: allowed 32, 64, 128, 256"
            )));
        }
        if ![0, 2, 4].contains(&spikes) {
            return Err(Error::InvalidArgument(format!(
                "spikes {spikes}: allowed 0, 2, 4"
            )));
        }
        Ok(QuantSpec {
            rs_bits,
            ag_bits,
            group,
            spikes,
        })
    }
}

impl QuantSpec {
    /// Whether kernels exist for this pair of widths (the catalogue's
    /// `QUANT_TWOSTEP_BITS`: equal widths, or an 8-bit all-gather after a 2-, 3- or 4-bit
    /// reduce-scatter).
    pub fn has_kernels(&self) -> bool {
        flashcomm_kernels::catalog::twostep_pair(self.rs_bits, self.ag_bits).is_some()
    }

    /// The codec format of one step.
    pub fn format(&self, dtype: DataType, bits: u8) -> Result<flashcomm_codec::Format, Error> {
        flashcomm_codec::Format::new(dtype, bits, self.group, self.spikes)
            .map_err(|e| Error::InvalidArgument(format!("codec format: {e:?}")))
    }
}

/// Values per codec block.
pub const CODEC_BLOCK_VALUES: u64 = 1024;
/// Threads per block of the quantized kernels.
pub const QUANT_THREADS: u32 = 256;
/// Codec blocks below which a quantized AllReduce is one-shot whatever the cost model says
/// (64: 128 KiB of bf16). Two-step's three dependent steps cost more than one-shot's extra
/// decoding there, and the model, which scales the lossless rows by the compressed bytes, picked
/// two-step at 64 KiB now and then (host transport, 2 ranks, 4-bit: 78 us against one-shot's 44).
/// At 256 KiB it is not so: 8 ranks on the host transport, one-shot took 1.5-3x two-step's time
/// (docs/experiments.md, "A chunk's codec blocks shared by a block's warps").
pub const QUANT_TWO_STEP_MIN_BLOCKS: u64 = 64;

/// Whether a quantized AllReduce runs where the lossless kernels are predicted to be faster
/// (`FLASHCOMM_QUANT_CHOICE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QuantChoice {
    /// Quantize where it pays: a call asked to be quantized runs the quantized kernels only where
    /// the calibrated model ([`QuantModel`]) predicts them faster than the lossless plan by more
    /// than [`TIE_FACTOR`]; elsewhere it runs the lossless kernels, whose result carries no
    /// quantization error. Without a measurement for the call's codec settings (no calibration,
    /// or settings changed after set-up) every call is quantized.
    #[default]
    Auto,
    /// Every call asked to be quantized is.
    Always,
}

/// The measured times of the quantized AllReduce with one codec setting: bf16 (f16 has the same
/// wire format sizes) at [`CALIB_SIZES`], one row per algorithm (indexed by
/// `Algorithm::index`); 0 where not measured (two-step below [`QUANT_TWO_STEP_MIN_BLOCKS`] or
/// with fewer codec blocks than ranks, where it is never planned).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantModel {
    /// The codec setting measured.
    pub spec: QuantSpec,
    /// Microseconds, indexed [algorithm][size].
    pub table_us: [[f64; CALIB_SIZES.len()]; 2],
}

/// Bytes of a serialized [`QuantModel`]'s table.
const QUANT_MODEL_BYTES: usize = 8 * 2 * CALIB_SIZES.len();

impl QuantModel {
    /// Predicted microseconds of `algo` for a message of `bytes` bytes per rank, where measured
    /// ([`interpolate`]).
    pub fn predict(&self, algo: Algorithm, bytes: u64) -> Option<f64> {
        interpolate(&self.table_us[algo.index()], bytes)
    }

    /// Serializes the tables of `models` (in their order) for the exchange between ranks.
    pub fn to_bytes(models: &[QuantModel]) -> Vec<u8> {
        let mut v = Vec::with_capacity(QUANT_MODEL_BYTES * models.len());
        for m in models {
            for row in &m.table_us {
                for t in row {
                    v.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        v
    }

    /// The element-wise maximum of every rank's tables for `specs` (every rank measured the same
    /// settings in the same order): one set of models all ranks agree on.
    pub fn agree(specs: &[QuantSpec], tables: &[Vec<u8>]) -> Result<Vec<QuantModel>, Error> {
        let mut models: Vec<QuantModel> = specs
            .iter()
            .map(|&spec| QuantModel {
                spec,
                table_us: [[0.0; CALIB_SIZES.len()]; 2],
            })
            .collect();
        for bytes in tables {
            if bytes.len() != QUANT_MODEL_BYTES * specs.len() {
                return Err(Error::Bootstrap(
                    "malformed quantized cost model from a peer".into(),
                ));
            }
            let f = |k: usize| f64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().unwrap());
            let mut k = 0;
            for m in &mut models {
                for row in &mut m.table_us {
                    for t in row.iter_mut() {
                        *t = t.max(f(k));
                        k += 1;
                    }
                }
            }
        }
        Ok(models)
    }
}

/// Whether the quantized plan `quant` of a message of `bytes` bytes per rank pays against the
/// lossless plan `lossless` of the same call ([`QuantChoice::Auto`]): predicted faster by more
/// than [`TIE_FACTOR`]; a tie goes to the lossless plan (about the same time, no quantization
/// error). Without a
/// calibrated model, or a measurement of the quantized plan's codec settings and algorithm at
/// this size, it pays (the call is quantized, as asked). Pure: every rank, holding the agreed
/// models, decides alike.
pub fn quant_pays(
    model: &CostModel,
    lossless: &Plan,
    measured: Option<&QuantModel>,
    quant: &Plan,
    bytes: u64,
) -> bool {
    let Some(tq) = measured.and_then(|m| m.predict(quant.algo, bytes)) else {
        return true;
    };
    if !model.calibrated {
        return true;
    }
    let tl = model.predict(lossless.algo, lossless.proto, bytes);
    tq * TIE_FACTOR < tl
}

/// Grid, sub-slot and chunk bytes of a quantized launch of up to `grid` blocks whose chunks
/// cover `frames` frames (per source: the codec blocks of the message, of a two-step shard, or of
/// one peer's block): the frames cut evenly over the grid, at most what a sub-slot holds, and the
/// grid trimmed to the chunks there are, so that every block has work. The quantized kernels take
/// a chunk's codec blocks from the sub-slot size (`sub_bytes / FRAME_BYTES` frames); a sub-slot
/// of a sub-slot's full capacity whatever the message left most of the grid idle below a few
/// MiB (4 MiB, 4-bit, 2 ranks, host transport: 5 of 22 blocks had work; docs/experiments.md,
/// "Quantized chunks cut to the message").
fn quant_chunking(arena: &Arena, grid: u32, frames: u64) -> (u32, u64, u64) {
    let capacity = arena.chunking(Protocol::Block, grid).0 / FRAME_BYTES;
    let per = frames
        .div_ceil(grid.max(1) as u64)
        .clamp(1, capacity.max(1));
    let grid = frames.div_ceil(per).clamp(1, grid.max(1) as u64) as u32;
    (grid, per * FRAME_BYTES, per * FRAME_PAYLOAD)
}

/// Plans a quantized AllReduce. The wire format is the codec's; readiness travels in BLOCK frames
/// that carry whole codec blocks. Two-step needs every shard non-empty (at least `nranks` codec
/// blocks); the cost model picks between one-shot and two-step from the bytes each moves after
/// compression and the decode work each does.
#[allow(clippy::too_many_arguments)]
pub fn plan_quant(
    arena: &Arena,
    model: &CostModel,
    measured: Option<&QuantModel>,
    count: u64,
    dtype: DataType,
    q: QuantSpec,
    max_grid: u32,
    algo_choice: Choice<Algorithm>,
) -> Result<Plan, Error> {
    if dtype == DataType::F32 {
        return Err(Error::Unsupported(
            "quantized AllReduce of f32 (use f16 or bf16; f32 stays lossless)".into(),
        ));
    }
    if !q.has_kernels() {
        return Err(Error::Unsupported(format!(
            "no kernels for widths {}/{}",
            q.rs_bits, q.ag_bits
        )));
    }
    let n = arena.nranks as u64;
    let fr = q.format(dtype, q.rs_bits)?;
    let fa = q.format(dtype, q.ag_bits)?;
    let nb = count.div_ceil(CODEC_BLOCK_VALUES);
    let two_ok = nb >= n;
    let bytes = count * dtype.bytes();
    // Bytes as the lossless model sees them, scaled by the compression of each step, plus the
    // codec work (decoding and encoding at roughly HBM speed: 1.5 MB/us of element data).
    let codec_us_per_byte = 1.0 / 1.5e6;
    let wire_one = bytes as f64 * fr.effective_bits() / 16.0;
    let wire_two = bytes as f64 * (fr.effective_bits() + fa.effective_bits()) / 32.0;
    let t_one = model.predict(Algorithm::OneShot, Protocol::Block, wire_one as u64)
        + codec_us_per_byte * bytes as f64 * (1.0 + n as f64);
    let t_two = model.predict(Algorithm::TwoShot, Protocol::Block, wire_two as u64)
        + codec_us_per_byte * bytes as f64 * (1.0 + 2.0 / n as f64 + 1.0);
    // Measured times, where these settings were calibrated: they decide, a tie going to
    // one-shot (the fixed order of TIE_FACTOR), and a size where two-step was not measured (just
    // above QUANT_TWO_STEP_MIN_BLOCKS, below the first calibration size it was timed at) stays
    // one-shot, so that no calibrated choice rests on the scaled lossless model.
    let timed = measured.map(|m| {
        (
            m.predict(Algorithm::OneShot, bytes),
            m.predict(Algorithm::TwoShot, bytes),
        )
    });
    let two_faster = match timed {
        Some((Some(one), Some(two))) => two * TIE_FACTOR < one,
        Some((Some(_), None)) => false,
        _ => t_two < t_one,
    };
    let algo = match algo_choice {
        Choice::Force(Algorithm::TwoShot) if two_ok => Algorithm::TwoShot,
        Choice::Force(_) => Algorithm::OneShot,
        Choice::Auto if two_ok && n > 1 && nb >= QUANT_TWO_STEP_MIN_BLOCKS && two_faster => {
            Algorithm::TwoShot
        }
        Choice::Auto => Algorithm::OneShot,
    };
    Ok(quant_shape(arena, count, dtype, q, max_grid, algo)?.0)
}

/// The quantized AllReduce of `algo`, whatever the cost model says: its grid, sub-slot and chunk
/// bytes, and the rounds its busiest block takes. [`plan_quant`] shapes its plans here; tests run
/// a one-shot of more than two rounds with it (every rank must run the same plan). Two-step needs
/// at least `nranks` codec blocks.
pub fn quant_shape(
    arena: &Arena,
    count: u64,
    dtype: DataType,
    q: QuantSpec,
    max_grid: u32,
    algo: Algorithm,
) -> Result<(Plan, u64), Error> {
    let n = arena.nranks as u64;
    let fr = q.format(dtype, q.rs_bits)?;
    let fa = q.format(dtype, q.ag_bits)?;
    let nb = count.div_ceil(CODEC_BLOCK_VALUES);
    // A frame carries FRAME_PAYLOAD / block_bytes codec blocks. Two-step: one warp per frame.
    // One-shot: the warps of a block share its chunk's codec blocks, so the grid is sized for
    // one codec block per warp.
    let per_frame = match algo {
        Algorithm::OneShot => FRAME_PAYLOAD / fr.block_bytes() as u64,
        Algorithm::TwoShot => FRAME_PAYLOAD / (fr.block_bytes().max(fa.block_bytes()) as u64),
    };
    let blocks = match algo {
        Algorithm::OneShot => nb,
        Algorithm::TwoShot => nb.div_ceil(n),
    };
    let frames = blocks.div_ceil(per_frame);
    let warp_units = match algo {
        Algorithm::OneShot => blocks,
        Algorithm::TwoShot => frames,
    };
    let grid = warp_units
        .div_ceil((QUANT_THREADS / 32) as u64)
        .clamp(1, max_grid.min(arena.max_grid()).max(1) as u64) as u32;
    let (grid, sub_bytes, chunk_bytes) = quant_chunking(arena, grid, frames);
    let chunks = frames.div_ceil((sub_bytes / FRAME_BYTES).max(1));
    let plan = Plan {
        coll: Collective::AllReduce,
        algo,
        proto: Protocol::Block,
        grid,
        threads: QUANT_THREADS,
        sub_bytes,
        chunk_bytes,
        shard_elems: 0,
        quant: Some(q),
    };
    Ok((plan, chunks.div_ceil(grid as u64)))
}

/// Plans a quantized AllGather, AllToAll or ReduceScatter: one quantization step at `q.rs_bits`
/// (`q.ag_bits` is not used), BLOCK frames of whole codec blocks. `count` is the values per
/// block: AllGather's send count, AllToAll's per-peer count, ReduceScatter's receive count; each
/// such block is encoded as a buffer of its own. Every block of the grid carries its chunk of
/// every peer's block, and its warps share the (peer, frame) pairs, so the grid is sized for the
/// frames of all N blocks, one warp each.
pub fn plan_quant_op(
    arena: &Arena,
    coll: Collective,
    count: u64,
    dtype: DataType,
    q: QuantSpec,
    max_grid: u32,
) -> Result<Plan, Error> {
    if !matches!(
        coll,
        Collective::AllGather | Collective::AlltoAll | Collective::ReduceScatter
    ) {
        return Err(Error::Unsupported(format!(
            "{coll}: no quantized kernel of one step"
        )));
    }
    if dtype == DataType::F32 {
        return Err(Error::Unsupported(format!(
            "quantized {coll} of f32 (use f16 or bf16; f32 stays lossless)"
        )));
    }
    let f = q.format(dtype, q.rs_bits)?;
    let per_frame = FRAME_PAYLOAD / f.block_bytes() as u64;
    let per_peer = count.div_ceil(CODEC_BLOCK_VALUES).div_ceil(per_frame);
    let frames = per_peer * arena.nranks as u64;
    let grid = frames
        .div_ceil((QUANT_THREADS / 32) as u64)
        .clamp(1, max_grid.min(arena.max_grid()).max(1) as u64) as u32;
    let (grid, sub_bytes, chunk_bytes) = quant_chunking(arena, grid, per_peer);
    Ok(Plan {
        coll,
        algo: Algorithm::OneShot,
        proto: Protocol::Block,
        grid,
        threads: QUANT_THREADS,
        sub_bytes,
        chunk_bytes,
        shard_elems: 0,
        quant: Some(QuantSpec {
            ag_bits: q.rs_bits,
            ..q
        }),
    })
}

/// Everything a launch needs besides buffers: chosen variant and geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The collective.
    pub coll: Collective,
    /// AllReduce algorithm (one-shot for the others).
    pub algo: Algorithm,
    /// Protocol.
    pub proto: Protocol,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub threads: u32,
    /// Sub-slot bytes.
    pub sub_bytes: u64,
    /// Payload bytes per chunk.
    pub chunk_bytes: u64,
    /// Two-shot shard elements (0 otherwise).
    pub shard_elems: u64,
    /// Codec settings when the call is quantized.
    pub quant: Option<QuantSpec>,
}

/// Chooses how to run one call. `bytes` is the per-rank message: AllReduce count*elem,
/// ReduceScatter recvcount*elem*nranks, AllGather sendcount*elem.
pub fn plan(
    arena: &Arena,
    model: &CostModel,
    coll: Collective,
    count: u64,
    elem: u64,
    max_grid: u32,
    algo_choice: Choice<Algorithm>,
    proto_choice: Choice<Protocol>,
) -> Plan {
    let n = arena.nranks;
    if n == 1 {
        // One rank exchanges nothing (`Communicator::run` copies, or does nothing in place): no
        // plan is weighed, so the trivial call costs no cost-model lookups.
        let (grid, threads) = shape_for(Protocol::Ll, 0, 1);
        let (sub_bytes, chunk_bytes) = arena.chunking(Protocol::Ll, grid);
        return Plan {
            coll,
            algo: Algorithm::OneShot,
            proto: Protocol::Ll,
            grid,
            threads,
            sub_bytes,
            chunk_bytes,
            shard_elems: 0,
            quant: None,
        };
    }
    let max_grid = max_grid.min(arena.max_grid()).max(1);
    let bytes = match coll {
        Collective::ReduceScatter | Collective::AlltoAll => count * elem * n as u64,
        _ => count * elem,
    };
    let shard = if coll == Collective::AllReduce {
        shard_elems(count, n, elem)
    } else {
        None
    };
    // Candidates as static slices: planning runs on every call and allocates nothing.
    const ONE_SHOT: &[Algorithm] = &[Algorithm::OneShot];
    const TWO_SHOT: &[Algorithm] = &[Algorithm::TwoShot];
    let algos: &[Algorithm] = match coll {
        Collective::AllReduce => match algo_choice {
            Choice::Force(Algorithm::TwoShot) if shard.is_some() && n > 1 => TWO_SHOT,
            Choice::Force(_) => ONE_SHOT,
            Choice::Auto if shard.is_some() && n > 1 => &Algorithm::ALL,
            Choice::Auto => ONE_SHOT,
        },
        // ReduceScatter has the cost structure of the first half of two-shot, AllGather and
        // AllToAll of one-shot's push; each uses the corresponding model row. (The other kinds
        // never reach a kernel: `Communicator::run` refuses them.)
        Collective::ReduceScatter => TWO_SHOT,
        _ => ONE_SHOT,
    };
    // The PULL protocols exist for AllReduce only, and only where the pull area holds the call
    // (for two-shot: its shards; for `Direct`: where peers can read the user's buffers). A
    // forced PULL protocol that does not apply to a call leaves the choice among the push
    // protocols to the model; a forced push protocol is taken as asked.
    let pull_ok = |a: Algorithm, p: Protocol| -> bool {
        !p.pulls()
            || (coll == Collective::AllReduce
                && arena.pull_fits(
                    p,
                    count,
                    elem,
                    if a == Algorithm::TwoShot { shard } else { None },
                ))
    };
    // Direct asked for where peers cannot read the user's buffers: the staged PULL protocol.
    let proto_choice = match proto_choice {
        Choice::Force(Protocol::Direct) if !arena.direct => Choice::Force(Protocol::Pull),
        other => other,
    };
    let forced = [match proto_choice {
        Choice::Force(p) => p,
        Choice::Auto => Protocol::Ll,
    }];
    let protos: &[Protocol] = match proto_choice {
        Choice::Force(p) if algos.iter().any(|&a| pull_ok(a, p)) => &forced,
        Choice::Force(_) => &Protocol::PUSH,
        Choice::Auto if coll == Collective::AllReduce => &Protocol::ALL,
        Choice::Auto => &Protocol::PUSH,
    };
    // The fastest prediction, then the first candidate (in the fixed order of the slices) within
    // TIE_FACTOR of it: see TIE_FACTOR.
    let mut fastest = f64::INFINITY;
    for &a in algos {
        for &p in protos {
            if pull_ok(a, p) {
                fastest = fastest.min(model.predict(a, p, bytes));
            }
        }
    }
    let mut best: Option<(Algorithm, Protocol)> = None;
    for &a in algos {
        for &p in protos {
            if best.is_none() && pull_ok(a, p) && model.predict(a, p, bytes) <= fastest * TIE_FACTOR
            {
                best = Some((a, p));
            }
        }
    }
    let (algo, proto) = best.unwrap_or((algos[0], Protocol::Ll));
    if proto.pulls() {
        let (target, over) = match algo {
            Algorithm::OneShot => (PULL_ONESHOT_BLOCK_BYTES, bytes),
            Algorithm::TwoShot => (PULL_TWOSHOT_BLOCK_BYTES, shard.unwrap_or(count) * elem),
        };
        let (grid, chunk_bytes) = pull_shape(over, target, max_grid);
        return Plan {
            coll,
            algo,
            proto,
            grid,
            threads: THREADS,
            sub_bytes: arena.pull_half_bytes,
            chunk_bytes,
            shard_elems: if algo == Algorithm::TwoShot {
                shard.unwrap_or(0)
            } else {
                0
            },
            quant: None,
        };
    }
    let per_block_bytes = match (coll, algo) {
        (Collective::AllReduce, Algorithm::TwoShot) => shard.unwrap_or(count) * elem,
        (Collective::ReduceScatter | Collective::AlltoAll, _) => count * elem,
        _ => bytes,
    };
    // AllToAll: each block carries its chunk of every peer's block, so the grid is sized for the
    // whole message (n blocks), not one block: sized for one, 1-32 KiB per peer ran on one or two
    // blocks (8 ranks: 1.5-6.5x the plain reference kernel, docs/experiments.md).
    let grid_bytes = if coll == Collective::AlltoAll {
        bytes
    } else {
        per_block_bytes
    };
    let (grid, threads) = shape_for(proto, grid_bytes, max_grid);
    let (sub_bytes, capacity) = arena.chunking(proto, grid);
    let chunk_bytes = chunk_for(per_block_bytes, grid, capacity);
    let coll_algo = if coll == Collective::AllReduce {
        algo
    } else {
        Algorithm::OneShot
    };
    Plan {
        coll,
        algo: coll_algo,
        proto,
        grid,
        threads,
        sub_bytes,
        chunk_bytes,
        shard_elems: if coll_algo == Algorithm::TwoShot {
            shard.unwrap_or(0)
        } else {
            0
        },
        quant: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_fits_cap_and_is_aligned() {
        for n in 1..=8 {
            let a = Arena::new(n, 64 << 20).unwrap();
            assert!(a.total_bytes <= 64 << 20);
            assert_eq!(a.slot_bytes % (64 * 1024), 0);
            assert_eq!(a.half_bytes, 2 * a.region_bytes);
            assert!(a.max_grid() >= 16);
        }
        assert!(Arena::new(9, 64 << 20).is_err());
        assert!(Arena::new(8, 1 << 20).is_err());
    }

    #[test]
    fn alltoall_grids_are_sized_for_the_whole_message() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        for per_peer in [1u64 << 10, 32 << 10] {
            let count = per_peer / 2;
            let a2a = plan(
                &a,
                &m,
                Collective::AlltoAll,
                count,
                2,
                64,
                Choice::Auto,
                Choice::Auto,
            );
            let (grid, _) = shape_for(a2a.proto, per_peer * 8, 64.min(a.max_grid()));
            assert_eq!(a2a.grid, grid, "{per_peer} bytes per peer");
            assert!(a2a.grid > shape_for(a2a.proto, per_peer, 64).0 || a2a.grid == 64);
            assert!(
                a2a.chunk_bytes * u64::from(a2a.grid) >= per_peer,
                "every byte has a block"
            );
        }
    }

    #[test]
    fn chunking_fits_sub_slots() {
        let a = Arena::new(8, 64 << 20).unwrap();
        for grid in [1, 7, 16, 64, a.max_grid()] {
            let (sub, chunk) = a.chunking(Protocol::Ll, grid);
            assert!(2 * grid as u64 * sub <= a.ll_bytes);
            assert_eq!(chunk * 2, sub);
            assert_eq!(chunk % 8, 0);
            let (sub, chunk) = a.chunking(Protocol::Block, grid);
            assert!(2 * grid as u64 * sub <= a.block_bytes());
            assert_eq!(a.area_offset(Protocol::Block) % FRAME_BYTES % 16, 0);
            assert_eq!(sub % FRAME_BYTES, 0);
            assert_eq!(chunk, sub / FRAME_BYTES * FRAME_PAYLOAD);
        }
    }

    #[test]
    fn launch_shapes_use_whole_blocks() {
        // (bytes, max_grid) -> (grid, threads)
        assert_eq!(shape_for(Protocol::Ll, 8 << 10, 66), (4, 256));
        assert_eq!(shape_for(Protocol::Ll, 64 << 10, 66), (32, 256));
        assert_eq!(shape_for(Protocol::Ll, 128 << 10, 66), (64, 256));
        assert_eq!(shape_for(Protocol::Ll, 256 << 10, 66), (66, 512));
        assert_eq!(shape_for(Protocol::Ll, 100, 66), (1, 256));
        assert_eq!(shape_for(Protocol::Block, 8 << 10, 66), (1, THREADS));
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        for bytes in [8u64 << 10, 64 << 10, 1 << 20] {
            let p = plan(
                &a,
                &m,
                Collective::AllReduce,
                bytes / 2,
                2,
                16,
                Choice::Force(Algorithm::OneShot),
                Choice::Force(Protocol::Ll),
            );
            assert!(p.grid <= 16 && p.threads <= THREADS && p.threads.is_multiple_of(32));
            assert!(p.sub_bytes >= LL_LINE);
            // Every block has work, and one round covers the message unless a chunk is as
            // large as a sub-slot carries.
            assert!(p.chunk_bytes * (p.grid as u64 - 1) < bytes);
            let capacity = a.chunking(Protocol::Ll, p.grid).1;
            assert!(p.chunk_bytes * p.grid as u64 >= bytes || p.chunk_bytes == capacity);
        }
    }

    #[test]
    fn chunks_spread_the_message_over_the_grid() {
        assert_eq!(chunk_for(8 << 10, 8, 1 << 20), 1024);
        assert_eq!(chunk_for(100, 1, 1 << 20), 112);
        assert_eq!(chunk_for(1 << 30, 4, 1 << 20), 1 << 20);
        assert_eq!(chunk_for(0, 4, 1 << 20), 16);
    }

    #[test]
    fn shards_are_aligned_and_never_empty() {
        for n in 1..=8u32 {
            for count in [1u64, 7, 8, 63, 64, 1000, 4097, 1 << 20] {
                for elem in [2u64, 4] {
                    if let Some(s) = shard_elems(count, n, elem) {
                        assert_eq!((s * elem) % 16, 0);
                        assert!(
                            (n as u64 - 1) * s < count,
                            "last shard empty n={n} count={count}"
                        );
                        assert!(n as u64 * s >= count);
                    }
                }
            }
        }
        assert!(shard_elems(8, 8, 2).is_none());
        assert!(shard_elems(1 << 20, 8, 2).is_some());
    }

    #[test]
    fn selector_prefers_ll_one_shot_small_and_two_shot_block_large() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        let small = plan(
            &a,
            &m,
            Collective::AllReduce,
            4096,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        assert_eq!(
            (small.algo, small.proto),
            (Algorithm::OneShot, Protocol::Ll)
        );
        let large = plan(
            &a,
            &m,
            Collective::AllReduce,
            64 << 20,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        assert_eq!(
            (large.algo, large.proto),
            (Algorithm::TwoShot, Protocol::Block)
        );
        let forced = plan(
            &a,
            &m,
            Collective::AllReduce,
            64 << 20,
            2,
            16,
            Choice::Force(Algorithm::OneShot),
            Choice::Force(Protocol::Ll),
        );
        assert_eq!(
            (forced.algo, forced.proto),
            (Algorithm::OneShot, Protocol::Ll)
        );
        // two-shot forced on a count too small for shards falls back to one-shot
        let tiny = plan(
            &a,
            &m,
            Collective::AllReduce,
            3,
            2,
            16,
            Choice::Force(Algorithm::TwoShot),
            Choice::Auto,
        );
        assert_eq!(tiny.algo, Algorithm::OneShot);
    }

    #[test]
    fn quantized_plans() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        // Fewer codec blocks than ranks: two-step impossible.
        let p = plan_quant(
            &a,
            &m,
            None,
            4000,
            DataType::Bf16,
            q,
            16,
            Choice::Force(Algorithm::TwoShot),
        )
        .unwrap();
        assert_eq!(p.algo, Algorithm::OneShot);
        let p = plan_quant(&a, &m, None, 64 << 20, DataType::Bf16, q, 16, Choice::Auto).unwrap();
        assert_eq!(
            (p.algo, p.proto, p.quant),
            (Algorithm::TwoShot, Protocol::Block, Some(q))
        );
        assert!(p.sub_bytes >= FRAME_BYTES);
        assert!(plan_quant(&a, &m, None, 1000, DataType::F32, q, 16, Choice::Auto).is_err());
        assert!(!QuantSpec::new(5, 8, 128, 2).unwrap().has_kernels());
        assert!(QuantSpec::new(4, 8, 128, 2).unwrap().has_kernels());
        assert!(QuantSpec::new(4, 6, 128, 2).is_err());
        assert!(QuantSpec::new(1, 1, 128, 2).is_err());
        assert!(QuantSpec::new(4, 4, 100, 2).is_err());
        assert!(QuantSpec::new(4, 4, 128, 3).is_err());
    }

    #[test]
    fn quantized_chunks_give_every_block_work() {
        // (ranks, values): the kernels cut a message (one-shot), a shard (two-step) or a peer's
        // block (one-step collectives) into chunks of `sub_bytes / FRAME_BYTES` frames, and
        // block b takes chunks b, b + grid, ...: every block must get one, and a chunk must
        // fit its sub-slot.
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        let m = CostModel::default_for(2);
        let per_frame = FRAME_PAYLOAD / q.format(DataType::Bf16, 4).unwrap().block_bytes() as u64;
        for n in [2u32, 4, 8] {
            let a = Arena::new(n, 64 << 20).unwrap();
            for values in [1u64 << 15, 1 << 19, 1 << 21, 1 << 23, 1 << 27] {
                for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                    let p = plan_quant(
                        &a,
                        &m,
                        None,
                        values,
                        DataType::Bf16,
                        q,
                        66,
                        Choice::Force(algo),
                    )
                    .unwrap();
                    let nb = values.div_ceil(CODEC_BLOCK_VALUES);
                    let blocks = if p.algo == Algorithm::TwoShot {
                        nb.div_ceil(n as u64)
                    } else {
                        nb
                    };
                    let frames = blocks.div_ceil(per_frame);
                    let per = p.sub_bytes / FRAME_BYTES;
                    let chunks = frames.div_ceil(per);
                    assert!(
                        chunks >= p.grid as u64,
                        "{n} ranks, {values} values, {algo:?}: {p:?}"
                    );
                    assert!(per * FRAME_BYTES <= a.chunking(Protocol::Block, p.grid).0);
                }
                for coll in [
                    Collective::AllGather,
                    Collective::ReduceScatter,
                    Collective::AlltoAll,
                ] {
                    let p =
                        plan_quant_op(&a, coll, values / n as u64, DataType::Bf16, q, 66).unwrap();
                    let frames = (values / n as u64)
                        .div_ceil(CODEC_BLOCK_VALUES)
                        .div_ceil(per_frame);
                    let chunks = frames.div_ceil(p.sub_bytes / FRAME_BYTES);
                    assert!(
                        chunks >= p.grid as u64,
                        "{coll} {n} ranks, {values} values: {p:?}"
                    );
                    assert!(p.sub_bytes <= a.chunking(Protocol::Block, p.grid).0);
                }
            }
        }
    }

    #[test]
    fn calibrated_table_drives_the_choice_and_ties_are_stable() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let mut m = CostModel::default_for(8);
        let n = CALIB_SIZES.len();
        // One-shot LL best up to 48 KiB, two-shot BLOCK beyond; the others never.
        let mut ll = [0.0; CALIB_SIZES.len()];
        let mut blk2 = [0.0; CALIB_SIZES.len()];
        for i in 0..n {
            ll[i] = 4.0 + CALIB_SIZES[i] as f64 / 4000.0;
            blk2[i] = 15.0 + CALIB_SIZES[i] as f64 / 40000.0;
        }
        m.set_measured(Algorithm::OneShot, Protocol::Ll, ll);
        m.set_measured(Algorithm::TwoShot, Protocol::Block, blk2);
        let slow = CALIB_SIZES.map(|s| 1e3 + s as f64 / 100.0);
        m.set_measured(Algorithm::OneShot, Protocol::Block, slow);
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, slow);
        let pick = |bytes: u64| {
            let p = plan(
                &a,
                &m,
                Collective::AllReduce,
                bytes / 2,
                2,
                64,
                Choice::Auto,
                Choice::Auto,
            );
            (p.algo, p.proto)
        };
        assert_eq!(pick(8 << 10), (Algorithm::OneShot, Protocol::Ll));
        assert_eq!(pick(32 << 10), (Algorithm::OneShot, Protocol::Ll));
        assert_eq!(pick(64 << 10), (Algorithm::TwoShot, Protocol::Block));
        assert_eq!(pick(256 << 10), (Algorithm::TwoShot, Protocol::Block));
        assert_eq!(pick(64 << 20), (Algorithm::TwoShot, Protocol::Block));
        // Interpolation between measured points, the smallest point below the range.
        let t = m.predict(Algorithm::OneShot, Protocol::Ll, 6 << 10);
        assert!(t > ll[0] && t < ll[1]);
        assert_eq!(m.predict(Algorithm::OneShot, Protocol::Ll, 100), ll[0]);
        // Within TIE_FACTOR the fixed order decides: a slightly faster two-shot loses.
        let mut tie = m;
        tie.set_measured(Algorithm::TwoShot, Protocol::Ll, ll.map(|t| t / 1.02));
        assert_eq!(
            {
                let p = plan(
                    &a,
                    &tie,
                    Collective::AllReduce,
                    4096,
                    2,
                    64,
                    Choice::Auto,
                    Choice::Auto,
                );
                (p.algo, p.proto)
            },
            (Algorithm::OneShot, Protocol::Ll)
        );
        // The table survives the exchange.
        let back = CostModel::agree(&[m.to_bytes()]).unwrap();
        assert_eq!(back.table_us, m.table_us);
    }

    #[test]
    fn agreed_model_is_the_elementwise_max() {
        let mut a = CostModel::default_for(4);
        let mut b = CostModel::default_for(4);
        a.fit(
            Algorithm::OneShot,
            Protocol::Ll,
            (1000, 5.0),
            (100_000, 20.0),
        );
        b.fit(
            Algorithm::OneShot,
            Protocol::Ll,
            (1000, 6.0),
            (100_000, 15.0),
        );
        let m = CostModel::agree(&[a.to_bytes(), b.to_bytes()]).unwrap();
        assert!(m.calibrated);
        assert!(m.a_us[0][0] >= a.a_us[0][0] && m.a_us[0][0] >= b.a_us[0][0]);
        assert_eq!(
            CostModel::agree(&[a.to_bytes(), b.to_bytes()]).unwrap(),
            CostModel::agree(&[b.to_bytes(), a.to_bytes()]).unwrap()
        );
    }

    #[test]
    fn a_forced_quantized_one_shot_stays_one_shot_past_two_rounds() {
        // From the kernel's block barrier before a shared round (docs/experiments.md, "The
        // quantized one-shot's third round"), a one-shot of any number of rounds is planned as
        // asked.
        let a = Arena::new(2, 64 << 20).unwrap();
        let q = QuantSpec::new(8, 8, 128, 2).unwrap();
        let m = CostModel::default_for(2);
        let forced = Choice::Force(Algorithm::OneShot);
        for count in [2u64 << 20, 8 << 20, 32 << 20] {
            let p = plan_quant(&a, &m, None, count, DataType::Bf16, q, 66, forced).unwrap();
            assert_eq!(p.algo, Algorithm::OneShot, "{count}");
        }
    }

    /// A calibrated lossless model of one row (one-shot LL at `lossless(bytes)` us; the other
    /// combinations slower) and the quantized model of `q` at `one(bytes)` / `two(bytes)` us
    /// (two-step measured from 128 KiB, as the calibration does).
    fn models(
        q: QuantSpec,
        lossless: impl Fn(u64) -> f64,
        one: impl Fn(u64) -> f64,
        two: impl Fn(u64) -> f64,
    ) -> (CostModel, QuantModel) {
        let mut m = CostModel::default_for(2);
        m.set_measured(Algorithm::OneShot, Protocol::Ll, CALIB_SIZES.map(&lossless));
        let slow = CALIB_SIZES.map(|s| 2.0 * lossless(s));
        m.set_measured(Algorithm::OneShot, Protocol::Block, slow);
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, slow);
        m.set_measured(Algorithm::TwoShot, Protocol::Block, slow);
        m.calibrated = true;
        let mut qm = QuantModel {
            spec: q,
            table_us: [CALIB_SIZES.map(&one), CALIB_SIZES.map(&two)],
        };
        for (i, &s) in CALIB_SIZES.iter().enumerate() {
            if s / 2 / CODEC_BLOCK_VALUES < QUANT_TWO_STEP_MIN_BLOCKS {
                qm.table_us[Algorithm::TwoShot.index()][i] = 0.0;
            }
        }
        (m, qm)
    }

    #[test]
    fn rows_measured_from_a_size_on_interpolate_there_only() {
        let mut row = CALIB_SIZES.map(|s| s as f64 / 1000.0);
        assert_eq!(interpolate(&row, 1), Some(row[0]));
        row[0] = 0.0;
        row[1] = 0.0;
        // Below the first measured size: not measured; at it and beyond: the table's values.
        assert_eq!(interpolate(&row, CALIB_SIZES[1]), None);
        assert_eq!(interpolate(&row, CALIB_SIZES[2]), Some(row[2]));
        let mid = (CALIB_SIZES[2] + CALIB_SIZES[3]) / 2;
        let t = interpolate(&row, mid).unwrap();
        assert!(t > row[2] && t < row[3]);
        // Beyond the largest: the last slope.
        let last = CALIB_SIZES.len() - 1;
        let far = interpolate(&row, 2 * CALIB_SIZES[last]).unwrap();
        assert!((far - 2.0 * row[last]).abs() < 1e-9);
        // A hole after the first measured size, or one measured size: not used.
        row[5] = 0.0;
        assert_eq!(interpolate(&row, CALIB_SIZES[6]), None);
        let mut one = [0.0; CALIB_SIZES.len()];
        one[last] = 3.0;
        assert_eq!(interpolate(&one, CALIB_SIZES[last]), None);
        assert_eq!(interpolate(&[0.0; CALIB_SIZES.len()], 4096), None);
    }

    #[test]
    fn quantized_calls_run_lossless_where_quantizing_does_not_pay() {
        let a = Arena::new(2, 64 << 20).unwrap();
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        // The shape measured on the host transport (docs/perf.md, "The PCIe machine"): lossless
        // cheaper at the small sizes (64 KiB, 256 KiB), quantized cheaper from 1 MiB; two-step
        // cheaper at large sizes.
        let (m, qm) = models(
            q,
            |s| 30.0 + s as f64 / 5000.0,
            |s| 70.0 + s as f64 / 12000.0,
            |s| 90.0 + s as f64 / 16000.0,
        );
        let choose = |bytes: u64, measured: Option<&QuantModel>, model: &CostModel| {
            let count = bytes / 2;
            let quant = plan_quant(
                &a,
                model,
                measured,
                count,
                DataType::Bf16,
                q,
                66,
                Choice::Auto,
            )
            .unwrap();
            let lossless = plan(
                &a,
                model,
                Collective::AllReduce,
                count,
                2,
                66,
                Choice::Auto,
                Choice::Auto,
            );
            let pays = quant_pays(model, &lossless, measured, &quant, bytes);
            (pays, quant.algo)
        };
        assert_eq!(choose(64 << 10, Some(&qm), &m), (false, Algorithm::OneShot));
        assert_eq!(
            choose(256 << 10, Some(&qm), &m),
            (false, Algorithm::OneShot)
        );
        assert_eq!(choose(4 << 20, Some(&qm), &m), (true, Algorithm::TwoShot));
        assert_eq!(choose(4 << 20, Some(&qm), &m), (true, Algorithm::TwoShot));
        // Without a measurement of these settings, or without calibration: quantized as asked,
        // the algorithm from the lossless model's scaled bytes.
        assert!(choose(64 << 10, None, &m).0);
        let mut uncalibrated = m;
        uncalibrated.calibrated = false;
        assert!(choose(64 << 10, Some(&qm), &uncalibrated).0);
        // A tie (within TIE_FACTOR) goes to lossless, and between the quantized algorithms to
        // one-shot.
        let (m, qm) = models(
            q,
            |s| 50.0 + s as f64 / 1e4,
            |s| 49.0 + s as f64 / 1e4,
            |s| 48.5 + s as f64 / 1e4,
        );
        assert_eq!(choose(1 << 20, Some(&qm), &m), (false, Algorithm::OneShot));
        // The measured times decide between the algorithms, not the lossless model's scaled
        // bytes (which, at two ranks, see the same bytes for both and keep one-shot).
        let (m, qm) = models(
            q,
            |s| 1e3 + s as f64,
            |s| 20.0 + s as f64 / 1e4,
            |s| 10.0 + s as f64 / 1e6,
        );
        assert_eq!(choose(4 << 20, Some(&qm), &m), (true, Algorithm::TwoShot));
        assert_eq!(choose(4 << 20, None, &m), (true, Algorithm::OneShot));
        // Two-step's smallest message (64 codec blocks, the last one partial), below the first
        // size it was timed at: one-shot, even where two-step would be faster beyond.
        let just_above = ((QUANT_TWO_STEP_MIN_BLOCKS - 1) * CODEC_BLOCK_VALUES + 1) * 2;
        assert!(just_above < 128 << 10);
        assert_eq!(choose(just_above, Some(&qm), &m).1, Algorithm::OneShot);
        assert_eq!(choose(128 << 10, Some(&qm), &m).1, Algorithm::TwoShot);
    }

    #[test]
    fn quantized_models_agree_as_the_elementwise_max() {
        let q4 = QuantSpec::new(4, 4, 128, 2).unwrap();
        let q8 = QuantSpec::new(8, 8, 128, 2).unwrap();
        let (_, a4) = models(q4, |_| 1.0, |s| s as f64 / 1e3, |s| s as f64 / 2e3);
        let (_, b4) = models(q4, |_| 1.0, |s| s as f64 / 1e3 + 1.0, |s| s as f64 / 4e3);
        let (_, a8) = models(q8, |_| 1.0, |s| s as f64 / 5e2, |s| s as f64 / 5e2);
        let specs = [q4, q8];
        let agreed = QuantModel::agree(
            &specs,
            &[
                QuantModel::to_bytes(&[a4, a8]),
                QuantModel::to_bytes(&[b4, a8]),
            ],
        )
        .unwrap();
        assert_eq!(agreed.len(), 2);
        assert_eq!((agreed[0].spec, agreed[1].spec), (q4, q8));
        assert_eq!(agreed[0].table_us[0], b4.table_us[0]);
        assert_eq!(agreed[0].table_us[1], a4.table_us[1]);
        assert_eq!(agreed[1].table_us, a8.table_us);
        // No settings: nothing to agree on; a peer's table of another length is refused.
        assert_eq!(QuantModel::agree(&[], &[Vec::new()]).unwrap(), Vec::new());
        assert!(QuantModel::agree(&specs, &[QuantModel::to_bytes(&[a4])]).is_err());
    }

    #[test]
    fn quant_shape_is_the_plan_before_the_round_rule() {
        // plan_quant's plans are quant_shape's; at 16 MiB, 8-bit, 2 ranks on 66 blocks, the
        // one-shot (which the GPU test runs through quant_shape) takes 4 rounds of 11-frame
        // chunks (33 codec blocks) and its last chunk, on block 50 in round 3, has 8 codec
        // blocks in 3 frames: the case that gave wrong values before the kernel's barrier.
        let a = Arena::new(2, 64 << 20).unwrap();
        let q = QuantSpec::new(8, 8, 128, 2).unwrap();
        let m = CostModel::default_for(2);
        for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
            for count in [1000, 2 << 20, 8 << 20] {
                let forced = Choice::Force(algo);
                let p = plan_quant(&a, &m, None, count, DataType::Bf16, q, 66, forced).unwrap();
                let (s, _) = quant_shape(&a, count, DataType::Bf16, q, 66, p.algo).unwrap();
                assert_eq!(p, s, "{algo:?} {count}");
            }
        }
        let (p, rounds) =
            quant_shape(&a, 8 << 20, DataType::Bf16, q, 66, Algorithm::OneShot).unwrap();
        assert_eq!(p.algo, Algorithm::OneShot);
        assert_eq!((p.grid, p.sub_bytes / FRAME_BYTES, rounds), (66, 11, 4));
        let k = p.sub_bytes / FRAME_BYTES * 3;
        let nb = (8u64 << 20) / CODEC_BLOCK_VALUES;
        let last = nb.div_ceil(k) - 1;
        assert_eq!((last % 66, last / 66, nb - last * k), (50, 3, 8));
    }

    #[test]
    fn pull_plans_are_forced_or_measured_and_cover_the_message() {
        let mut a = Arena::with_pull(4, 64 << 20, 32 << 20).unwrap();
        assert_eq!(a.pull_half_bytes, 16 << 20);
        assert_eq!(a.total_bytes, a.pull_offset + PULL_FLAG_BYTES + (32 << 20));
        let m = CostModel::default_for(4);
        let ar = |a: &Arena, m: &CostModel, bytes: u64, algo, proto| {
            plan(a, m, Collective::AllReduce, bytes / 2, 2, 64, algo, proto)
        };
        // The default model never picks a PULL protocol.
        for bytes in [8u64 << 10, 1 << 20, 16 << 20] {
            assert!(!ar(&a, &m, bytes, Choice::Auto, Choice::Auto).proto.pulls());
        }
        // Forced: taken where the pull area holds the call, with every block working.
        for bytes in [16u64, 8 << 10, 100_002, 1 << 20, 16 << 20] {
            for algo in Algorithm::ALL {
                let p = ar(
                    &a,
                    &m,
                    bytes,
                    Choice::Force(algo),
                    Choice::Force(Protocol::Pull),
                );
                assert_eq!(p.proto, Protocol::Pull, "{bytes} {algo:?}");
                assert!(p.grid >= 1 && p.grid <= PULL_MAX_BLOCKS && p.grid <= 64);
                assert_eq!(p.chunk_bytes % 16, 0);
                assert_eq!(p.sub_bytes, a.pull_half_bytes);
                let over = if p.algo == Algorithm::TwoShot {
                    p.shard_elems * 2
                } else {
                    bytes
                };
                assert!(p.chunk_bytes * p.grid as u64 >= over, "{p:?}");
                assert!(p.chunk_bytes * (p.grid as u64 - 1) < over, "{p:?}");
            }
        }
        // Too large for the pull area: the push protocols take it.
        let big = ar(
            &a,
            &m,
            32 << 20,
            Choice::Auto,
            Choice::Force(Protocol::Pull),
        );
        assert!(!big.proto.pulls());
        // Other collectives have no PULL kernels.
        let ag = plan(
            &a,
            &m,
            Collective::AllGather,
            4096,
            2,
            64,
            Choice::Auto,
            Choice::Force(Protocol::Pull),
        );
        assert!(!ag.proto.pulls());
        // Direct only where peers can read the user's buffers; elsewhere it is the staged PULL.
        let d = ar(
            &a,
            &m,
            64 << 10,
            Choice::Auto,
            Choice::Force(Protocol::Direct),
        );
        assert_eq!(d.proto, Protocol::Pull);
        a.direct = true;
        let d = ar(
            &a,
            &m,
            64 << 10,
            Choice::Auto,
            Choice::Force(Protocol::Direct),
        );
        assert_eq!(d.proto, Protocol::Direct);
        // Without a pull area, no PULL protocol at all.
        let none = Arena::with_pull(4, 64 << 20, 0).unwrap();
        assert_eq!(
            none.total_bytes,
            Arena::new(4, 64 << 20).unwrap().total_bytes
        );
        assert!(
            !ar(
                &none,
                &m,
                8 << 10,
                Choice::Auto,
                Choice::Force(Protocol::Pull)
            )
            .proto
            .pulls()
        );
    }

    #[test]
    fn measured_pull_wins_where_it_is_faster() {
        let mut a = Arena::with_pull(8, 64 << 20, 32 << 20).unwrap();
        a.direct = true;
        let mut m = CostModel::default_for(8);
        // LL fastest small, direct two-shot fastest large, staged pull in between.
        let row = |f: &dyn Fn(f64) -> f64| CALIB_SIZES.map(|s| f(s as f64));
        m.set_measured(Algorithm::OneShot, Protocol::Ll, row(&|s| 3.0 + s / 2e4));
        m.set_measured(Algorithm::OneShot, Protocol::Block, row(&|s| 6.0 + s / 4e4));
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, row(&|s| 5.0 + s / 3e4));
        m.set_measured(Algorithm::TwoShot, Protocol::Block, row(&|s| 8.0 + s / 8e4));
        m.set_measured(Algorithm::OneShot, Protocol::Pull, row(&|s| 4.0 + s / 6e4));
        m.set_measured(Algorithm::TwoShot, Protocol::Pull, row(&|s| 9.0 + s / 1e5));
        m.set_measured(
            Algorithm::OneShot,
            Protocol::Direct,
            row(&|s| 6.0 + s / 6e4),
        );
        m.set_measured(
            Algorithm::TwoShot,
            Protocol::Direct,
            row(&|s| 7.0 + s / 2e5),
        );
        m.calibrated = true;
        let pick = |bytes: u64| {
            let p = plan(
                &a,
                &m,
                Collective::AllReduce,
                bytes / 2,
                2,
                64,
                Choice::Auto,
                Choice::Auto,
            );
            (p.algo, p.proto)
        };
        assert_eq!(pick(4 << 10), (Algorithm::OneShot, Protocol::Ll));
        assert_eq!(pick(256 << 10), (Algorithm::OneShot, Protocol::Pull));
        assert_eq!(pick(16 << 20), (Algorithm::TwoShot, Protocol::Direct));
        // Direct is not a candidate where peers cannot read the user's buffers.
        a.direct = false;
        let p = plan(
            &a,
            &m,
            Collective::AllReduce,
            8 << 20,
            2,
            64,
            Choice::Auto,
            Choice::Auto,
        );
        assert_ne!(p.proto, Protocol::Direct);
        // The model round-trips its PULL rows through the exchange.
        let back = CostModel::agree(&[m.to_bytes()]).unwrap();
        assert_eq!(back.table_us, m.table_us);
    }

    #[test]
    fn calibration_drops_slow_combinations_alike_and_extends_their_rows() {
        let mut cal = Calibration::new(3);
        let serialize = |t: &[f64]| -> Vec<u8> { t.iter().flat_map(|x| x.to_le_bytes()).collect() };
        for (i, &size) in CALIB_SIZES.iter().enumerate() {
            let s = size as f64;
            // Combination 0: fast; 1: 4x slower throughout; 2: slow small, fastest large.
            let rank0 = [1.0 + s / 1e5, 4.0 * (1.0 + s / 1e5), 20.0 + s / 4e5];
            let rank1 = rank0.map(|t| t * 1.01);
            let all = vec![serialize(&rank0), serialize(&rank1)];
            let agreed = Calibration::agree_times(&all, 3).unwrap();
            assert_eq!(agreed[0], rank1[0]);
            let before: Vec<bool> = (0..3).map(|k| cal.live(k)).collect();
            cal.record(i, &agreed);
            // Nothing is dropped below PRUNE_FROM, whatever the ratio.
            if size < PRUNE_FROM {
                assert!((0..3).all(|k| cal.live(k)));
            }
            if !before[1] {
                assert!(!cal.live(1));
            }
        }
        assert!(cal.live(0));
        assert!(!cal.live(1), "4x slower from PRUNE_FROM on: dropped");
        assert!(
            cal.live(2),
            "slow at small sizes, never 3x slower past PRUNE_FROM: kept"
        );
        let r1 = cal.row(1);
        assert!(
            r1.iter().all(|&t| t > 0.0),
            "the dropped row is complete: {r1:?}"
        );
        let first = CALIB_SIZES.iter().position(|&s| s >= PRUNE_FROM).unwrap();
        for i in first + 1..CALIB_SIZES.len() {
            assert!(r1[i] >= 4.0 * (1.0 + CALIB_SIZES[i] as f64 / 1e5));
        }
        assert!(Calibration::agree_times(&[vec![0u8; 7]], 1).is_err());
    }
}
