//! The pull reference AllReduce of the benchmark (`cuda/testing/pull_reference.cu`,
//! flashcomm-perf `--impl pull-reference`): a clean-room implementation of the "pull" design of
//! the custom all-reduce kernels that vLLM and SGLang ship, measured beside flashcomm as a
//! competitor. Not part of the product.
//!
//! Every rank reads its peers' inputs in place (zero copy) and synchronizes with them through
//! flags in per-rank signal areas (per-block epochs on the device, two parities of slots, bounded
//! waits; the CUDA source explains the protocol). Two kernels: [`Stages::One`] (every rank loads
//! all inputs and sums them) and [`Stages::Two`] (reduce-scatter by loads into a scratch shard,
//! then all-gather by loads). Blocks of [`THREADS`] threads, at most [`MAX_BLOCKS`] per rank and
//! never more than the rank's share of the GPU's multiprocessors, so that every rank's blocks are
//! resident at once; fewer for small messages (one block per [`THREADS`] 16-byte vectors).
//!
//! Ranks are threads of one process whose devices can read and write each other's memory
//! (virtual ranks on one GPU, or GPUs with peer access enabled), or processes of their own that
//! map each other's buffers through CUDA IPC at set-up, as vLLM's ranks do
//! ([`PullReference::allocations`]: each a whole `cuMemAlloc` allocation, so its legacy IPC handle
//! maps exactly it). Set-up, while every rank is idle: [`PullReference::new`] on every rank (it
//! allocates), then every rank takes every peer's [`PullReference::addrs`] (as mapped in its own
//! address space) with [`PullReference::set_peers`], and registers every buffer a call will read
//! or write with [`PullReference::register`] (with every rank's address of it). A call
//! is launched per rank on the rank's stream ([`PullReference::all_reduce`]), or, with every
//! rank on one GPU, for every rank in one grid by one thread ([`PullReference::all_reduce_grid`]).

use std::sync::Arc;
use std::time::Duration;

use flashcomm_comm::gpu::{Device, DeviceMem, DevicePtr, LaunchConfig, Stream};
use flashcomm_comm::{DataType, Error};
use flashcomm_gpu::Function;

use crate::TestKernels as Kernels;
use crate::peer_buffers::PeerBuffers;

/// Ranks the kernels support.
pub const MAX_RANKS: usize = 8;
/// Most blocks per rank (vLLM's custom all-reduce uses up to 36 blocks of 512 threads).
pub const MAX_BLOCKS: u32 = 36;
/// Threads per block.
pub const THREADS: u32 = 512;
/// Barriers of a call (start, middle of 2-stage, end), each with its own flag slots.
const BARRIERS: usize = 3;
/// Bytes of one rank's signal area: u32 slots [parity][barrier][block][source].
pub const SIGNAL_BYTES: usize = 2 * BARRIERS * MAX_BLOCKS as usize * MAX_RANKS * 4;
/// Bytes of one 16-byte vector, the kernels' unit.
const VECTOR: u64 = 16;

/// Which kernel a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stages {
    /// Start barrier, every rank loads and sums all inputs, end barrier.
    One,
    /// Start barrier, reduce-scatter by loads into the scratch shard, barrier, all-gather by
    /// loads, end barrier.
    Two,
}

impl Stages {
    /// `1stage` or `2stage`.
    pub fn name(self) -> &'static str {
        match self {
            Stages::One => "1stage",
            Stages::Two => "2stage",
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcPullParams {
    input: [u64; MAX_RANKS],
    out: [u64; MAX_RANKS],
    scratch: [u64; MAX_RANKS],
    signal: [u64; MAX_RANKS],
    epochs: [u64; MAX_RANKS],
    fail: [u64; MAX_RANKS],
    count: u64,
    shard: u64,
    timeout_ns: u64,
    rank: u32,
    nranks: u32,
    blocks: u32,
    single: u32,
}

const _: () = assert!(std::mem::size_of::<FcPullParams>() == 424);

impl crate::codec_launch::TestParams for FcPullParams {}

/// Blocks per rank so that every rank's blocks are resident at once: the smallest share of
/// multiprocessors among the GPUs, `(multiprocessors, ranks on that GPU)`, at most
/// [`MAX_BLOCKS`]; 0 when some GPU has more ranks than multiprocessors.
pub fn max_blocks(gpus: &[(u32, u32)]) -> u32 {
    gpus.iter()
        .filter(|&&(_, ranks)| ranks > 0)
        .map(|&(sms, ranks)| sms / ranks)
        .min()
        .unwrap_or(0)
        .min(MAX_BLOCKS)
}

/// Elements per 2-stage shard: `count / nranks` rounded up to 16 bytes, flashcomm's two-shot
/// rule (`flashcomm_comm::plan::shard_elems`). Where that rule refuses a count (the last shard
/// would be empty), the kernels still run it: trailing shards are then empty.
pub fn shard_elems(count: u64, nranks: u32, elem: u64) -> u64 {
    let per = (VECTOR / elem).max(1);
    count.div_ceil(u64::from(nranks.max(1))).div_ceil(per) * per
}

/// Blocks per rank of a call: one per [`THREADS`] vectors of what a rank reduces (the whole
/// message for 1-stage, a shard for 2-stage), at least 1 and at most `max_blocks`. Every rank
/// computes the same number (the per-block barriers need it).
pub fn blocks_for(stages: Stages, count: u64, nranks: u32, elem: u64, max_blocks: u32) -> u32 {
    let elems = match stages {
        Stages::One => count,
        Stages::Two => shard_elems(count, nranks, elem),
    };
    let vectors = (elems * elem).div_ceil(VECTOR);
    vectors
        .div_ceil(u64::from(THREADS))
        .clamp(1, u64::from(max_blocks.max(1))) as u32
}

/// Scratch bytes a rank needs for messages up to `max_bytes`: the largest shard, in whole
/// vectors (a shard of `count` elements of any type is at most `max_bytes / nranks` rounded up,
/// plus one element, rounded up to 16 bytes).
pub fn scratch_bytes(max_bytes: u64, nranks: u32) -> u64 {
    (max_bytes.div_ceil(u64::from(nranks.max(1))) + 2 * VECTOR).next_multiple_of(VECTOR)
}

fn dtype_index(dtype: DataType) -> usize {
    match dtype {
        DataType::F32 => 0,
        DataType::F16 => 1,
        DataType::Bf16 => 2,
    }
}

/// One rank's pull reference AllReduce.
pub struct PullReference {
    device: Arc<Device>,
    /// `[stages][f32, f16, bf16]`.
    functions: [[Function; 3]; 2],
    signal: DeviceMem,
    scratch: DeviceMem,
    /// Per-block epochs (u32 each), then the failure flag.
    state: DeviceMem,
    /// Every rank's (signal, scratch, state) addresses.
    peers: [[u64; 3]; MAX_RANKS],
    buffers: PeerBuffers,
    max_bytes: u64,
    rank: u32,
    nranks: u32,
    max_blocks: u32,
    one_gpu: bool,
    timeout: Duration,
}

impl PullReference {
    /// Sets up rank `rank` of `devices.len()` ranks on `devices[rank]` for messages up to
    /// `max_bytes`, with access to every other rank's device enabled. Allocates (so it must run
    /// before any rank's collectives spin), finds the kernels and derives the blocks per rank
    /// from every GPU's multiprocessors and the ranks it holds.
    pub fn new(
        devices: &[i32],
        rank: u32,
        max_bytes: u64,
        timeout: Duration,
    ) -> Result<PullReference, Error> {
        let nranks = devices.len() as u32;
        if nranks == 0 || nranks as usize > MAX_RANKS || rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "pull reference: rank {rank} of {nranks} (1..={MAX_RANKS} ranks)"
            )));
        }
        let device = Device::open(devices[rank as usize])?;
        let mut gpus: Vec<(i32, u32, u32)> = Vec::new();
        for &d in devices {
            let other = Device::open(d)?;
            if !device.can_access_peer(&other)? {
                return Err(Error::Unsupported(format!(
                    "pull reference: device {} cannot access device {d}",
                    device.ordinal()
                )));
            }
            device.enable_peer_access(&other)?;
            match gpus.iter_mut().find(|g| g.0 == d) {
                Some(g) => g.2 += 1,
                None => gpus.push((d, other.sm_count(), 1)),
            }
        }
        let max_blocks = max_blocks(
            &gpus
                .iter()
                .map(|&(_, sms, ranks)| (sms, ranks))
                .collect::<Vec<_>>(),
        );
        if max_blocks == 0 {
            return Err(Error::Unsupported(format!(
                "pull reference: {nranks} ranks on GPUs of {:?} multiprocessors: a block per rank \
                 cannot be resident at once",
                gpus.iter().map(|g| g.1).collect::<Vec<_>>()
            )));
        }
        let _ctx = device.activate()?;
        let kernels = Kernels::for_context(device.context())?;
        let f = |name: &str| kernels.function(name);
        let functions = [
            [
                f("fc_test_pull_1stage_f32")?,
                f("fc_test_pull_1stage_f16")?,
                f("fc_test_pull_1stage_bf16")?,
            ],
            [
                f("fc_test_pull_2stage_f32")?,
                f("fc_test_pull_2stage_f16")?,
                f("fc_test_pull_2stage_bf16")?,
            ],
        ];
        for g in functions.iter().flatten() {
            if g.max_active_blocks_per_sm(THREADS, 0)? == 0 {
                return Err(Error::Unsupported(
                    "pull reference: a block of 512 threads does not fit on a multiprocessor"
                        .into(),
                ));
            }
        }
        let signal = DeviceMem::alloc_zeroed(&device, SIGNAL_BYTES)?;
        let scratch = DeviceMem::alloc_zeroed(&device, scratch_bytes(max_bytes, nranks) as usize)?;
        let state = DeviceMem::alloc_zeroed(&device, (MAX_BLOCKS as usize + 1) * 4)?;
        Ok(PullReference {
            one_gpu: gpus.len() == 1,
            device,
            functions,
            signal,
            scratch,
            state,
            peers: [[0; 3]; MAX_RANKS],
            buffers: PeerBuffers::new(nranks as usize),
            max_bytes,
            rank,
            nranks,
            max_blocks,
            timeout,
        })
    }

    /// This rank's signal area, scratch and state addresses, for every rank's
    /// [`PullReference::set_peers`].
    pub fn addrs(&self) -> [u64; 3] {
        [self.signal.addr(), self.scratch.addr(), self.state.addr()]
    }

    /// This rank's signal area, scratch and state (in the order of [`PullReference::addrs`]),
    /// each a whole allocation: what a rank process exports to its peers (CUDA IPC).
    pub fn allocations(&self) -> [&DeviceMem; 3] {
        [&self.signal, &self.scratch, &self.state]
    }

    /// Every rank's [`PullReference::addrs`], in rank order.
    pub fn set_peers(&mut self, all: &[[u64; 3]]) -> Result<(), Error> {
        if all.len() != self.nranks as usize {
            return Err(Error::InvalidArgument(format!(
                "pull reference: {} peers for {} ranks",
                all.len(),
                self.nranks
            )));
        }
        self.peers[..all.len()].copy_from_slice(all);
        Ok(())
    }

    /// Registers `buffer` (this rank's), whose counterpart on rank r starts at `all[r]`: calls
    /// may then read and write ranges of it, each rank at the same offset of its own. Only while
    /// every rank is idle.
    pub fn register(&mut self, buffer: DevicePtr, all: &[u64]) -> Result<(), Error> {
        if let Some(a) = all.iter().find(|a| !a.is_multiple_of(VECTOR)) {
            return Err(Error::InvalidArgument(format!(
                "pull reference: buffer {a:#x} is not 16-byte aligned"
            )));
        }
        self.buffers
            .register(buffer.addr(), buffer.len(), all)
            .map_err(|e| Error::InvalidArgument(format!("pull reference: {e}")))
    }

    /// Blocks per rank of a call of `count` elements of `dtype`.
    pub fn blocks(&self, stages: Stages, count: u64, dtype: DataType) -> u32 {
        blocks_for(stages, count, self.nranks, dtype.bytes(), self.max_blocks)
    }

    /// The most blocks per rank.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// One AllReduce of `count` elements of `dtype` from `send` into `recv` on `stream`, this
    /// rank's part (every rank calls it, on its own stream). `send` must lie in a registered
    /// buffer (peers read it there).
    pub fn all_reduce(
        &self,
        stages: Stages,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<(), Error> {
        let bytes = count * dtype.bytes();
        let input = self.registered(send, bytes, "input")?;
        let mut out = [0u64; MAX_RANKS];
        out[self.rank as usize] = recv.addr();
        if recv.len() < bytes || !recv.addr().is_multiple_of(VECTOR) {
            return Err(Error::InvalidArgument(format!(
                "pull reference: output of {} bytes at {:#x} for {bytes} bytes (16-byte aligned)",
                recv.len(),
                recv.addr()
            )));
        }
        let mut epochs = [0u64; MAX_RANKS];
        epochs[self.rank as usize] = self.state.addr();
        let mut fail = [0u64; MAX_RANKS];
        fail[self.rank as usize] = self.fail_addr();
        self.launch(
            stages, input, out, epochs, fail, count, dtype, stream, false,
        )
    }

    /// One AllReduce of `count` elements of `dtype` for every rank, in one grid launched on
    /// `stream` by this rank alone (every rank on one GPU): from every rank's range of `send`'s
    /// registered buffer into every rank's range of `recv`'s. The other ranks launch nothing.
    pub fn all_reduce_grid(
        &self,
        stages: Stages,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<(), Error> {
        if !self.one_gpu {
            return Err(Error::Unsupported(
                "pull reference: one grid for every rank needs every rank on one GPU".into(),
            ));
        }
        let bytes = count * dtype.bytes();
        let input = self.registered(send, bytes, "input")?;
        let out = self.registered(recv, bytes, "output")?;
        let mut epochs = [0u64; MAX_RANKS];
        let mut fail = [0u64; MAX_RANKS];
        for r in 0..self.nranks as usize {
            epochs[r] = self.peers[r][2];
            fail[r] = self.fail_addr();
        }
        self.launch(stages, input, out, epochs, fail, count, dtype, stream, true)
    }

    /// Every rank's address of `[p, p + bytes)` (aligned, inside a registered buffer).
    fn registered(&self, p: DevicePtr, bytes: u64, what: &str) -> Result<[u64; MAX_RANKS], Error> {
        if bytes > self.max_bytes || p.len() < bytes {
            return Err(Error::InvalidArgument(format!(
                "pull reference: {bytes} bytes (set up for {}, {what} buffer {})",
                self.max_bytes,
                p.len()
            )));
        }
        if !p.addr().is_multiple_of(VECTOR) {
            return Err(Error::InvalidArgument(format!(
                "pull reference: the {what} {:#x} is not 16-byte aligned",
                p.addr()
            )));
        }
        self.buffers.lookup(p.addr(), bytes).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "pull reference: the {what} {:#x} is not in a registered buffer",
                p.addr()
            ))
        })
    }

    fn fail_addr(&self) -> u64 {
        self.state.addr() + u64::from(MAX_BLOCKS) * 4
    }

    fn launch(
        &self,
        stages: Stages,
        input: [u64; MAX_RANKS],
        out: [u64; MAX_RANKS],
        epochs: [u64; MAX_RANKS],
        fail: [u64; MAX_RANKS],
        count: u64,
        dtype: DataType,
        stream: Stream,
        single: bool,
    ) -> Result<(), Error> {
        if count == 0 {
            return Ok(());
        }
        let elem = dtype.bytes();
        let shard = shard_elems(count, self.nranks, elem);
        if stages == Stages::Two && shard * elem > self.scratch.len() as u64 {
            return Err(Error::Internal(format!(
                "pull reference: a shard of {} bytes exceeds the scratch of {}",
                shard * elem,
                self.scratch.len()
            )));
        }
        let blocks = self.blocks(stages, count, dtype);
        let mut p = FcPullParams {
            input,
            out,
            epochs,
            fail,
            count,
            shard,
            // Capped so that the device's deadline (%globaltimer + timeout) cannot wrap around.
            timeout_ns: self.timeout.as_nanos().min(1u128 << 62) as u64,
            rank: self.rank,
            nranks: self.nranks,
            blocks,
            single: u32::from(single),
            ..FcPullParams::default()
        };
        for r in 0..self.nranks as usize {
            p.signal[r] = self.peers[r][0];
            p.scratch[r] = self.peers[r][1];
        }
        let function = self.functions[match stages {
            Stages::One => 0,
            Stages::Two => 1,
        }][dtype_index(dtype)];
        let grid = if single { blocks * self.nranks } else { blocks };
        let _ctx = self.device.activate()?;
        crate::codec_launch::launch_test(
            function,
            LaunchConfig {
                grid,
                block: THREADS,
                smem: 0,
            },
            stream,
            &p,
        )
    }

    /// Whether a wait gave up (timeout): reads this rank's flag (in one grid: the launcher's)
    /// after synchronizing `stream`.
    pub fn failed(&self, stream: Stream) -> Result<bool, Error> {
        let _ctx = self.device.activate()?;
        let mut b = [0u8; 4];
        self.state
            .download(MAX_BLOCKS as usize * 4, &mut b, stream)?;
        Ok(u32::from_le_bytes(b) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_keep_every_rank_resident() {
        // One H100/H200 (132 multiprocessors) shared by 1..8 virtual ranks.
        let got: Vec<u32> = (1..=8).map(|n| max_blocks(&[(132, n)])).collect();
        assert_eq!(got, vec![36, 36, 36, 33, 26, 22, 18, 16]);
        for n in 1..=8 {
            assert!(n * max_blocks(&[(132, n)]) <= 132);
        }
        // One GPU per rank; the smallest share decides.
        assert_eq!(max_blocks(&[(132, 1), (132, 1)]), 36);
        assert_eq!(max_blocks(&[(132, 1), (20, 1)]), 20);
        assert_eq!(max_blocks(&[(4, 8)]), 0);
        assert_eq!(max_blocks(&[]), 0);
    }

    #[test]
    fn shards_follow_flashcomms_two_shot_rule() {
        for n in 1..=8u32 {
            for elem in [2u64, 4] {
                for count in [1u64, 7, 8, 63, 64, 1000, 4096, 4099, 1 << 20, (1 << 20) + 3] {
                    let s = shard_elems(count, n, elem);
                    assert_eq!((s * elem) % 16, 0, "whole vectors");
                    assert!(s * u64::from(n) >= count, "the shards cover the message");
                    if let Some(c) = flashcomm_comm::plan::shard_elems(count, n, elem) {
                        assert_eq!(s, c, "count {count}, {n} ranks, {elem}-byte elements");
                    }
                    // The scratch holds a shard of the largest message.
                    assert!(s * elem <= scratch_bytes(count * elem, n));
                }
            }
        }
    }

    #[test]
    fn blocks_grow_with_the_message() {
        let b = |s, count, n, elem| blocks_for(s, count, n, elem, 16);
        // 8 KiB of bf16: 512 vectors, one block; 2-stage over 8 ranks: a shard of 64 vectors.
        assert_eq!(b(Stages::One, 4096, 8, 2), 1);
        assert_eq!(b(Stages::Two, 4096, 8, 2), 1);
        assert_eq!(b(Stages::One, 1, 8, 2), 1);
        // 1 MiB: 65536 vectors, capped at 16 blocks; a shard of 8192 vectors: 16 blocks.
        assert_eq!(b(Stages::One, 1 << 19, 8, 2), 16);
        assert_eq!(b(Stages::Two, 1 << 19, 8, 2), 16);
        // 64 KiB over 2 ranks: 4096 vectors (8 blocks), shards of 2048 (4 blocks).
        assert_eq!(b(Stages::One, 1 << 15, 2, 2), 8);
        assert_eq!(b(Stages::Two, 1 << 15, 2, 2), 4);
        assert_eq!(blocks_for(Stages::One, 1 << 30, 2, 4, 0), 1);
        assert_eq!(Stages::One.name(), "1stage");
        assert_eq!(Stages::Two.name(), "2stage");
    }

    #[test]
    fn signal_area_matches_the_kernel() {
        let src = include_str!("../../../cuda/testing/pull_reference.cu");
        for (name, v) in [
            ("FC_PULL_MAX_RANKS", MAX_RANKS as u64),
            ("FC_PULL_MAX_BLOCKS", u64::from(MAX_BLOCKS)),
            ("FC_PULL_THREADS", u64::from(THREADS)),
            ("FC_PULL_BARRIERS", BARRIERS as u64),
        ] {
            assert!(
                src.contains(&format!("#define {name} {v}\n")),
                "{name} must be {v} in pull_reference.cu"
            );
        }
        assert!(src.contains("sizeof(FcPullParams) == 424"));
    }
}
