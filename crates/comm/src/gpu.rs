//! The driver layer (`flashcomm-gpu`) as the communicator uses it, and its launch paths.
//!
//! The only module of the crate with `unsafe` code: the launch below, the write of a rank's
//! epoch words that tests use to cross the epoch's wrap-around, and the copy-engine schedule's
//! engine ([`CopyStreams`]).
#![allow(unsafe_code)]

/// The driver layer's error (the communicator's own [`crate::Error`] converts from it).
pub use flashcomm_gpu::Error;
pub use flashcomm_gpu::process::PerProcess;
pub use flashcomm_gpu::{
    CaptureRecord, CtxGuard, Device, DeviceMem, DevicePtr, Event, ExportKind, Function, Graph,
    HostArena, HostMapped, IpcMapping, LaunchConfig, OwnStream, Stream, UserAllocation, VmmMem,
    buffer_id, close_export, device_count, driver_present, init, mem_info, remove_stale_segments,
    user_allocation,
};

use flashcomm_kernels::Kernel;
/// The kernels of one context (the copy-engine schedule's reduction takes them).
pub use flashcomm_kernels::Kernels;
use flashcomm_kernels::abi::{self, KernelParams};

/// Launches catalogue kernel `k` (its parameter type is tied to it, so the layout is right by
/// construction); with `overlapped`, with programmatic stream serialization, which only the
/// collective kernels allow (each waits for the previous work of its stream before its first
/// memory access: transport.cuh, `wait_for_previous_work`).
///
/// Sound because of what the communicator guarantees for every launch it makes through this
/// function: every arena address in `params` belongs to an allocation or mapping the communicator
/// keeps alive until its last launch has finished; user buffers come in as [`DevicePtr`]s, whose
/// creators promised they are valid device memory of the right length; the stream belongs to
/// the current context (the communicator activated its device); `overlapped` is set only for
/// `FcCollParams` kernels, the collective kernels.
pub(crate) fn launch<P: KernelParams + 'static>(
    kernels: &Kernels,
    k: Kernel<P>,
    cfg: LaunchConfig,
    stream: Stream,
    params: &P,
    overlapped: bool,
) -> Result<(), crate::Error> {
    let overlapped =
        overlapped && std::any::TypeId::of::<P>() == std::any::TypeId::of::<abi::FcCollParams>();
    // SAFETY: see the function's documentation: lifetimes and stream are guaranteed by the
    // communicator (the only caller) and by the DevicePtr contract; `overlapped` holds only for
    // the collective kernels (checked above by the parameter type).
    unsafe { kernels.launch(k, cfg, stream, params, overlapped) }.map_err(crate::Error::from)
}

/// Sets all of a rank's epoch words (`abi::MAX_BLOCKS` u32 at `words_addr`, inside the
/// communicator's own arena) to `seq`, and waits for it. For tests only (the epoch's wrap-around);
/// no kernel of the communicator may be running.
pub(crate) fn write_epoch_words(
    dev: &std::sync::Arc<Device>,
    words_addr: u64,
    seq: u32,
) -> Result<(), crate::Error> {
    let bytes: Vec<u8> = (0..abi::MAX_BLOCKS)
        .flat_map(|_| seq.to_le_bytes())
        .collect();
    let tmp = DeviceMem::alloc_zeroed(dev, bytes.len())?;
    let stream = Stream::null();
    tmp.upload(0, &bytes, stream)?;
    // SAFETY: `words_addr` is the epoch area of the calling communicator's own arena
    // (abi::MAX_BLOCKS words, device-accessible: device memory or mapped pinned host memory),
    // which outlives this synchronous copy; `tmp` holds exactly that many bytes.
    let dst = unsafe { DevicePtr::from_raw(words_addr, bytes.len() as u64) };
    let _ctx = dev.activate()?;
    dst.copy_from(tmp.as_ptr(), bytes.len() as u64, stream)?;
    stream.synchronize()?;
    Ok(())
}

/// The reduction of the copy-engine schedule: sums `elems` elements of the type given of the
/// sources (one device address per rank, in rank order) into the destination, enqueued on the
/// stream given.
pub type CopyReduce =
    dyn FnMut(Stream, crate::DataType, &[u64], u64, usize) -> Result<(), crate::Error> + Send;

/// The copy-engine schedule's engine on the CUDA driver ([`crate::plan::copy::execute`]): a push
/// and a pull stream, the schedule's events, and the reduction to launch. The streams are
/// non-blocking streams of the context current when it was made, destroyed with the engine (a
/// communicator that uses the schedule makes one pair, and a thousand set-ups leave none
/// behind); the events are reused call after call (every wait is enqueued before the next record
/// of its event).
pub struct CopyStreams {
    /// The push stream (device-to-host copies and their signals).
    pub push: Stream,
    /// The pull stream (waits, host-to-device copies, the reduction).
    pub pull: Stream,
    /// The two streams' owners: `push`, then `pull`.
    _own: [OwnStream; 2],
    events: Vec<Event>,
    reduce: Box<CopyReduce>,
    dtype: crate::DataType,
}

impl CopyStreams {
    /// Two new streams and `events` events in the current context.
    ///
    /// # Safety
    /// Every address later handed to the engine (by [`crate::plan::copy::execute`], from a
    /// [`crate::plan::copy::CopyAddrs`]) must be mapped into this context, hold the bytes the
    /// operation touches, and stay valid until the streams have finished the operation; the flag
    /// words must be 4-byte aligned. The reduction must uphold the same for its operands.
    pub unsafe fn new(events: usize, reduce: Box<CopyReduce>) -> Result<CopyStreams, crate::Error> {
        let events = (0..events)
            .map(|_| Event::new(false))
            .collect::<Result<Vec<_>, _>>()?;
        let own = [OwnStream::create()?, OwnStream::create()?];
        Ok(CopyStreams {
            push: own[0].stream(),
            pull: own[1].stream(),
            _own: own,
            events,
            reduce,
            dtype: crate::DataType::F32,
        })
    }

    /// The element type the reductions of the operations executed next sum.
    pub fn set_dtype(&mut self, dtype: crate::DataType) {
        self.dtype = dtype;
    }

    fn stream(&self, lane: crate::plan::copy::Lane) -> Stream {
        match lane {
            crate::plan::copy::Lane::Push => self.push,
            crate::plan::copy::Lane::Pull => self.pull,
        }
    }
}

impl crate::plan::copy::Engine for CopyStreams {
    type Error = crate::Error;

    fn copy(
        &mut self,
        lane: crate::plan::copy::Lane,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), crate::Error> {
        // SAFETY: the addresses come from the CopyAddrs that `new`'s caller vouched for.
        unsafe { self.stream(lane).copy_async(dst, src, bytes) }.map_err(crate::Error::from)
    }

    fn wait(
        &mut self,
        lane: crate::plan::copy::Lane,
        addr: u64,
        value: u32,
    ) -> Result<(), crate::Error> {
        // SAFETY: as above; a flag word of a copy area (aligned, mapped).
        unsafe { self.stream(lane).wait_value32(addr, value) }.map_err(crate::Error::from)
    }

    fn signal(
        &mut self,
        lane: crate::plan::copy::Lane,
        addr: u64,
        value: u32,
    ) -> Result<(), crate::Error> {
        // SAFETY: as above; a flag word of this rank's own copy area (its only writer).
        unsafe { self.stream(lane).write_value32(addr, value) }.map_err(crate::Error::from)
    }

    fn record(&mut self, lane: crate::plan::copy::Lane, event: usize) -> Result<(), crate::Error> {
        let s = self.stream(lane);
        self.events[event].record(s).map_err(crate::Error::from)
    }

    fn wait_event(
        &mut self,
        lane: crate::plan::copy::Lane,
        event: usize,
    ) -> Result<(), crate::Error> {
        let s = self.stream(lane);
        self.events[event].wait_on(s).map_err(crate::Error::from)
    }

    fn reduce(
        &mut self,
        lane: crate::plan::copy::Lane,
        srcs: &[u64],
        dst: u64,
        elems: usize,
    ) -> Result<(), crate::Error> {
        let s = self.stream(lane);
        (self.reduce)(s, self.dtype, srcs, dst, elems)
    }
}

/// The product's reduction for [`CopyStreams`]: a closure that launches `fc_copy_reduce_<dtype>`
/// of the type it is given (f32 in rank order, rounded once: the bits of every reducing kernel)
/// on the stream it is given.
/// `max_grid` caps the blocks of a launch (256 threads each, about four elements per thread).
///
/// # Safety
/// The closure must be called only with addresses that hold `elems` elements of its type in the
/// context of `kernels`, stay valid until the kernel has finished, and number at most
/// `abi::MAX_RANKS` sources: as [`CopyStreams`] calls it under the contract of
/// [`CopyStreams::new`].
pub unsafe fn copy_reduce_launcher(
    kernels: std::sync::Arc<Kernels>,
    max_grid: u32,
) -> Box<CopyReduce> {
    Box::new(move |stream, dtype, srcs, dst, elems| {
        if srcs.is_empty() || srcs.len() > abi::MAX_RANKS {
            return Err(crate::Error::Internal(format!(
                "a reduction of {} sources",
                srcs.len()
            )));
        }
        let mut p = abi::FcReduceParams {
            dst,
            elems: elems as u64,
            nsrc: srcs.len() as u32,
            ..Default::default()
        };
        p.src[..srcs.len()].copy_from_slice(srcs);
        let grid = (elems.div_ceil(256 * 4) as u64).clamp(1, max_grid.max(1) as u64) as u32;
        let cfg = LaunchConfig {
            grid,
            block: 256,
            smem: 0,
        };
        launch(&kernels, Kernel::copy_reduce(dtype), cfg, stream, &p, false)
    })
}

/// The communicator's engine of the copy-engine schedule for `nranks` ranks: two streams, the
/// schedule's events and the product's reduction.
pub(crate) fn copy_streams(
    kernels: std::sync::Arc<Kernels>,
    nranks: usize,
) -> Result<CopyStreams, crate::Error> {
    // SAFETY: the communicator (comm/copy.rs) hands the engine only the addresses of one call:
    // the user's buffers it checked (each holds the call's bytes), its gather buffer and every
    // rank's copy area (sized by `plan::copy::area_bytes`, mapped for the communicator's life),
    // whose flag words are 4-byte aligned (the areas are page-aligned); its memory is freed only
    // after the call's streams drained (the release waits for the last operation, which waits
    // for both streams) and the watchdog let go of the call. At most `abi::MAX_RANKS` sources.
    unsafe {
        CopyStreams::new(
            crate::plan::copy::event_count(nranks),
            copy_reduce_launcher(kernels, 1024),
        )
    }
}

/// Writes `value` into the 32-bit word at `addr` of each of `words` (peers' arena headers and
/// copy areas, as mapped in this process): a word of host memory (the host transport's arenas) by
/// a CPU store, which no work queued on the GPU can hold back; a word of device memory through a
/// stream of its own, waiting for those writes alone (never for other work of the device).
///
/// The CPU store is what lets the watchdog release a copy-engine call: a stream created for the
/// write may share one of the device's hardware queues with a stream blocked in the very wait it
/// is to release, and then the write never runs (with a few communicators of a process, each
/// with its copy streams, it did: docs/protocols.md, "The copy-engine schedule").
///
/// Sound because every caller passes words of arenas that stay mapped until this returns: the
/// communicator's release passes its peers' arenas before it closes their mappings, and a peer
/// frees its arena only after it has seen this write ([`crate::transport::sweep`]).
pub(crate) fn write_words(words: &[u64], value: u32) -> Result<(), crate::Error> {
    let mut own: Option<OwnStream> = None;
    for &addr in words {
        // SAFETY: see above: `addr` is a 4-byte aligned word of an arena mapped into this process
        // until this returns, which kernels, stream operations and peers access only with
        // volatile or atomic accesses.
        if unsafe { flashcomm_gpu::store_host_word(addr, value) } {
            continue;
        }
        let s = match own.as_ref() {
            Some(s) => s,
            None => own.insert(OwnStream::create()?),
        };
        // SAFETY: as above; `addr` is device memory of the current context.
        unsafe { s.stream().write_value32(addr, value) }?;
    }
    if let Some(s) = own {
        s.stream().synchronize()?;
    }
    Ok(())
}
