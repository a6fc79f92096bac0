//! The plain reference AllReduce of the benchmark (`cuda/testing/reference.cu`, flashcomm-perf
//! `--impl reference`): an LL one-shot kernel of 16 blocks of 256 threads per rank, launched per
//! rank on the rank's stream. It is the yardstick of decode-size latency, kept exactly as plain as
//! its source describes; it is not part of the product. The same pattern adapted to AllToAll
//! ([`Reference::all_to_all`]) is the yardstick of `--coll alltoall`.
//!
//! Ranks are threads of one process whose devices can read and write each other's memory (virtual
//! ranks on one GPU, or GPUs with peer access enabled), or processes of their own that map each
//! other's inboxes through CUDA IPC ([`Reference::allocations`]: the inbox and the epochs, each a
//! whole `cuMemAlloc` allocation, so a legacy IPC handle maps exactly it): every rank allocates
//! an inbox, shares it, and takes every peer's address of it (in its own address space) with
//! [`Reference::set_peers`] before the first call.
//!
//! With every rank on one GPU, [`Reference::all_reduce_grid`] runs the same AllReduce for every
//! rank in one grid launched by one thread (flashcomm-perf `--ref-launch single`): what launching
//! per rank costs then shows beside the per-rank rows. It needs every rank's epochs
//! ([`Reference::set_grid_peers`]) and every buffer it reads or writes registered with every
//! rank's address of it ([`Reference::register`]).

use std::sync::Arc;
use std::time::Duration;

use flashcomm_comm::gpu::{Device, DeviceMem, DevicePtr, LaunchConfig, Stream};
use flashcomm_comm::{DataType, Error};
use flashcomm_gpu::Function;

use crate::TestKernels as Kernels;
use crate::peer_buffers::PeerBuffers;

/// Blocks per rank.
pub const BLOCKS: u32 = 16;
/// Threads per block.
pub const THREADS: u32 = 256;
/// Ranks the kernel supports.
pub const MAX_RANKS: usize = 8;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcRefParams {
    send: u64,
    recv: u64,
    bytes: u64,
    inbox: [u64; MAX_RANKS],
    half_bytes: u64,
    epochs: u64,
    fail: u64,
    timeout_ns: u64,
    rank: u32,
    nranks: u32,
    dtype: u32,
    pad: u32,
}

const _: () = assert!(std::mem::size_of::<FcRefParams>() == 136);

impl crate::codec_launch::TestParams for FcRefParams {}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcRefGridParams {
    send: [u64; MAX_RANKS],
    recv: [u64; MAX_RANKS],
    inbox: [u64; MAX_RANKS],
    epochs: [u64; MAX_RANKS],
    bytes: u64,
    half_bytes: u64,
    fail: u64,
    timeout_ns: u64,
    nranks: u32,
    dtype: u32,
}

const _: () = assert!(std::mem::size_of::<FcRefGridParams>() == 296);

impl crate::codec_launch::TestParams for FcRefGridParams {}

/// One rank's reference AllReduce.
pub struct Reference {
    device: Arc<Device>,
    function: Function,
    alltoall: Function,
    grid: Function,
    inbox: DeviceMem,
    /// Per-block epochs (u32 each), then the failure flag.
    state: DeviceMem,
    half_bytes: u64,
    max_bytes: u64,
    peers: [u64; MAX_RANKS],
    /// Every rank's epochs (one grid for every rank).
    epochs: [u64; MAX_RANKS],
    buffers: PeerBuffers,
    one_gpu: bool,
    sms: u32,
    rank: u32,
    nranks: u32,
    timeout: Duration,
}

impl Reference {
    /// Sets up rank `rank` of `devices.len()` ranks on `devices[rank]` for messages up to
    /// `max_bytes`, with access to every other rank's device enabled. Allocates (so it must run
    /// before any rank's collectives spin) and finds the kernel.
    pub fn new(
        devices: &[i32],
        rank: u32,
        max_bytes: u64,
        timeout: Duration,
    ) -> Result<Reference, Error> {
        let nranks = devices.len() as u32;
        if nranks == 0 || nranks as usize > MAX_RANKS || rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "reference: rank {rank} of {nranks} (1..={MAX_RANKS} ranks)"
            )));
        }
        let device = Device::open(devices[rank as usize])?;
        for &d in devices {
            let other = Device::open(d)?;
            if !device.can_access_peer(&other)? {
                return Err(Error::Unsupported(format!(
                    "reference: device {} cannot access device {d}",
                    device.ordinal()
                )));
            }
            device.enable_peer_access(&other)?;
        }
        let _ctx = device.activate()?;
        let kernels = Kernels::for_context(device.context())?;
        let function = kernels.function("fc_test_reference_allreduce")?;
        let alltoall = kernels.function("fc_test_reference_alltoall")?;
        let grid = kernels.function("fc_test_reference_allreduce_grid")?;
        // Blocks of the one-grid launch that fit on the GPU at once.
        let sms = device.sm_count() * grid.max_active_blocks_per_sm(THREADS, 0)?;
        let lines = max_bytes.div_ceil(8).max(1);
        let half_bytes = nranks as u64 * lines * 16;
        let inbox = DeviceMem::alloc_zeroed(&device, (2 * half_bytes) as usize)?;
        let state = DeviceMem::alloc_zeroed(&device, (BLOCKS as usize + 1) * 4)?;
        Ok(Reference {
            device,
            function,
            alltoall,
            grid,
            inbox,
            state,
            half_bytes,
            max_bytes,
            peers: [0; MAX_RANKS],
            epochs: [0; MAX_RANKS],
            buffers: PeerBuffers::new(nranks as usize),
            one_gpu: devices.iter().all(|&d| d == devices[0]),
            sms,
            rank,
            nranks,
            timeout,
        })
    }

    /// This rank's inbox address, for every peer's [`Reference::set_peers`].
    pub fn inbox_addr(&self) -> u64 {
        self.inbox.addr()
    }

    /// This rank's inbox and epochs ([`Reference::inbox_addr`], [`Reference::epochs_addr`]),
    /// each a whole allocation: what a rank process exports to its peers (CUDA IPC).
    pub fn allocations(&self) -> [&DeviceMem; 2] {
        [&self.inbox, &self.state]
    }

    /// Every rank's inbox address, in rank order.
    pub fn set_peers(&mut self, inboxes: &[u64]) -> Result<(), Error> {
        if inboxes.len() != self.nranks as usize {
            return Err(Error::InvalidArgument(format!(
                "reference: {} inboxes for {} ranks",
                inboxes.len(),
                self.nranks
            )));
        }
        self.peers[..inboxes.len()].copy_from_slice(inboxes);
        Ok(())
    }

    /// This rank's epochs, for every rank's [`Reference::set_grid_peers`].
    pub fn epochs_addr(&self) -> u64 {
        self.state.addr()
    }

    /// Every rank's [`Reference::epochs_addr`], in rank order (for [`Reference::all_reduce_grid`]).
    pub fn set_grid_peers(&mut self, epochs: &[u64]) -> Result<(), Error> {
        if epochs.len() != self.nranks as usize {
            return Err(Error::InvalidArgument(format!(
                "reference: {} epoch addresses for {} ranks",
                epochs.len(),
                self.nranks
            )));
        }
        self.epochs[..epochs.len()].copy_from_slice(epochs);
        Ok(())
    }

    /// Registers `buffer` (this rank's), whose counterpart on rank r starts at `all[r]`, for
    /// [`Reference::all_reduce_grid`]. Only while every rank is idle.
    pub fn register(&mut self, buffer: DevicePtr, all: &[u64]) -> Result<(), Error> {
        self.buffers
            .register(buffer.addr(), buffer.len(), all)
            .map_err(|e| Error::InvalidArgument(format!("reference: {e}")))
    }

    /// One AllReduce of `count` elements of `dtype` for every rank, in one grid of
    /// `nranks * BLOCKS` blocks launched on `stream` by this rank alone (every rank on one GPU):
    /// from every rank's range of `send`'s registered buffer into every rank's range of `recv`'s.
    /// The other ranks launch nothing; a timeout raises this rank's flag ([`Reference::failed`]).
    pub fn all_reduce_grid(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<(), Error> {
        let bytes = count * dtype.bytes();
        if !self.one_gpu {
            return Err(Error::Unsupported(
                "reference: one grid for every rank needs every rank on one GPU".into(),
            ));
        }
        if self.nranks * BLOCKS > self.sms {
            return Err(Error::Unsupported(format!(
                "reference: one grid of {} blocks cannot be resident at once ({} fit)",
                self.nranks * BLOCKS,
                self.sms
            )));
        }
        if bytes > self.max_bytes || send.len() < bytes || recv.len() < bytes {
            return Err(Error::InvalidArgument(format!(
                "reference: {bytes} bytes (set up for {}, buffers {} and {})",
                self.max_bytes,
                send.len(),
                recv.len()
            )));
        }
        let find = |p: DevicePtr, what: &str| {
            self.buffers.lookup(p.addr(), bytes).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "reference: the {what} {:#x} is not in a registered buffer",
                    p.addr()
                ))
            })
        };
        let (sends, recvs) = (find(send, "input")?, find(recv, "output")?);
        if bytes == 0 {
            return Ok(());
        }
        let p = FcRefGridParams {
            send: sends,
            recv: recvs,
            inbox: self.peers,
            epochs: self.epochs,
            bytes,
            half_bytes: self.half_bytes,
            fail: self.state.addr() + BLOCKS as u64 * 4,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            nranks: self.nranks,
            dtype: match dtype {
                DataType::F32 => 0,
                DataType::F16 => 1,
                DataType::Bf16 => 2,
            },
        };
        let _ctx = self.device.activate()?;
        crate::codec_launch::launch_test(
            self.grid,
            LaunchConfig {
                grid: self.nranks * BLOCKS,
                block: THREADS,
                smem: 0,
            },
            stream,
            &p,
        )
    }

    /// One AllReduce of `count` elements of `dtype` from `send` into `recv` on `stream`.
    pub fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<(), Error> {
        let bytes = count * dtype.bytes();
        if bytes > self.max_bytes || send.len() < bytes || recv.len() < bytes {
            return Err(Error::InvalidArgument(format!(
                "reference: {bytes} bytes (set up for {}, buffers {} and {})",
                self.max_bytes,
                send.len(),
                recv.len()
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        let dtype = match dtype {
            DataType::F32 => 0,
            DataType::F16 => 1,
            DataType::Bf16 => 2,
        };
        self.launch(self.function, send, recv, bytes, dtype, stream)
    }

    /// One AllToAll of `count` elements of `elem` bytes per peer (any datatype: nothing is
    /// reduced) from `send` (block q for rank q) into `recv` (block s from rank s) on `stream`.
    pub fn all_to_all(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        stream: Stream,
    ) -> Result<(), Error> {
        let bytes = count * elem;
        let all = bytes * u64::from(self.nranks);
        if bytes > self.max_bytes || send.len() < all || recv.len() < all {
            return Err(Error::InvalidArgument(format!(
                "reference: blocks of {bytes} bytes (set up for {}, buffers {} and {})",
                self.max_bytes,
                send.len(),
                recv.len()
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        self.launch(self.alltoall, send, recv, bytes, 0, stream)
    }

    fn launch(
        &self,
        function: Function,
        send: DevicePtr,
        recv: DevicePtr,
        bytes: u64,
        dtype: u32,
        stream: Stream,
    ) -> Result<(), Error> {
        let p = FcRefParams {
            send: send.addr(),
            recv: recv.addr(),
            bytes,
            inbox: self.peers,
            half_bytes: self.half_bytes,
            epochs: self.state.addr(),
            fail: self.state.addr() + BLOCKS as u64 * 4,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: self.rank,
            nranks: self.nranks,
            dtype,
            pad: 0,
        };
        let _ctx = self.device.activate()?;
        crate::codec_launch::launch_test(
            function,
            LaunchConfig {
                grid: BLOCKS,
                block: THREADS,
                smem: 0,
            },
            stream,
            &p,
        )
    }

    /// Whether a wait gave up (timeout): reads the flag after synchronizing `stream`.
    pub fn failed(&self, stream: Stream) -> Result<bool, Error> {
        let _ctx = self.device.activate()?;
        let mut b = [0u8; 4];
        self.state.download(BLOCKS as usize * 4, &mut b, stream)?;
        Ok(u32::from_le_bytes(b) != 0)
    }
}
