//! The copy-engine path of the host transport (`FLASHCOMM_HOST_COPY`, docs/protocols.md "The
//! copy-engine schedule"): the communicator's resources for it (made at set-up only where the
//! setting is not `off` and the transport is `host`), one call enqueued ([`crate::plan::copy`]'s
//! schedule on two streams of the communicator, joined to the caller's stream with events), and
//! the call as the process's watchdog sees it ([`crate::watch`]), which releases its stream waits
//! on abort, a peer's failure or the time limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::abi;
use crate::error::Error;
use crate::gpu::{
    self, CopyStreams, Device, DeviceMem, DevicePtr, Event, HostArena, HostMapped, Stream,
};
use crate::plan::DataType;
use crate::plan::copy::{self, CopyAddrs, CopyGeom, PIECE_BYTES};
use crate::watch::{Reason, Watchdog, Watched};

use super::{Communicator, HOST_ABORT, HOST_STATUS};

/// A communicator's resources for the schedule.
pub(super) struct CopyPath {
    state: Mutex<CopyState>,
    /// This rank's gather buffer ([`copy::gather_bytes`]).
    gather: DeviceMem,
    /// Every rank's copy area as this rank's device addresses it.
    areas: Vec<u64>,
    /// This rank's own arena (the host transport's), whose abort-request word peers that give
    /// up set.
    own: Arc<HostArena>,
    /// Calls the watchdog still holds: the communicator's memory is freed only once none is.
    watched: Arc<AtomicUsize>,
}

struct CopyState {
    streams: CopyStreams,
    /// The next call's first piece (the schedule's global piece number, the same on every rank).
    next_piece: u32,
}

impl CopyPath {
    /// The resources of rank `rank`, whose peers' arenas are at `peers` (this process's device
    /// addresses) with their copy areas at `copy_offset`. Its context is current.
    pub(super) fn new(
        dev: &Arc<Device>,
        kernels: &Arc<gpu::Kernels>,
        nranks: u32,
        peers: &[u64],
        copy_offset: u64,
        own: Arc<HostArena>,
    ) -> Result<CopyPath, Error> {
        let n = nranks as usize;
        Ok(CopyPath {
            state: Mutex::new(CopyState {
                streams: gpu::copy_streams(kernels.clone(), n)?,
                next_piece: 0,
            }),
            gather: DeviceMem::alloc_zeroed(dev, copy::gather_bytes(n))?,
            areas: peers[..n].iter().map(|&p| p + copy_offset).collect(),
            own,
            watched: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Whether no call of this communicator is watched any more (its memory may go).
    pub(super) fn unwatched(&self) -> bool {
        self.watched.load(Ordering::Acquire) == 0
    }

    /// Waits (at most a second: a call whose streams drained is forgotten within the watchdog's
    /// next look) until [`CopyPath::unwatched`].
    pub(super) fn wait_unwatched(&self) {
        let t = Instant::now();
        while !self.unwatched() && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

impl Communicator {
    /// Enqueues a lossless AllReduce of `count` elements of `dtype` from `send` into `recv` (the
    /// same buffer in place) as the copy-engine schedule, ordered after `stream`'s work so far,
    /// with `stream` waiting for it, and hands the call to the watchdog.
    pub(super) fn run_copy(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
        stream: Stream,
    ) -> Result<(), Error> {
        let path = self
            .copy
            .as_ref()
            .ok_or_else(|| Error::Internal("a copy-engine call without its area".into()))?;
        let mut st = path.state.lock().unwrap_or_else(|e| e.into_inner());
        let (n, r) = (self.nranks as usize, self.rank as usize);
        let geom = CopyGeom::new(
            n,
            r,
            dtype.bytes() as usize,
            count as usize,
            PIECE_BYTES,
            st.next_piece,
        );
        let start = Event::new(false)?;
        start.record(stream)?;
        start.wait_on(st.streams.push)?;
        start.wait_on(st.streams.pull)?;
        st.streams.set_dtype(dtype);
        let addrs = CopyAddrs {
            input: send.addr(),
            output: recv.addr(),
            gather: path.gather.addr(),
            areas: path.areas.clone(),
        };
        // Whatever was enqueued, even after a failure half way, is joined and watched, so that an
        // abort or the time limit releases its waits.
        let ran = copy::execute(&copy::schedule(&geom), &addrs, &mut st.streams);
        st.next_piece = geom.next_piece();
        let ends = [Event::new(false)?, Event::new(false)?];
        ends[0].record(st.streams.push)?;
        ends[1].record(st.streams.pull)?;
        for e in &ends {
            e.wait_on(stream)?;
        }
        let flags = copy::waited_flags(n, r)
            .into_iter()
            .map(|f| addrs.flag(f))
            .collect();
        let call = CopyCall {
            device: self.device.clone(),
            host: self.host.clone(),
            own: path.own.clone(),
            abort_words: self.peers[..n]
                .iter()
                .map(|&p| p + abi::HDR_ABORT_REQ)
                .collect(),
            flags,
            value: geom.next_piece(),
            ends,
            rank: self.rank,
            first_piece: u64::from(geom.first_piece),
            _watched: WatchedCount::new(&path.watched),
        };
        let limit = (!self.cfg.timeout.is_zero()).then_some(self.cfg.timeout);
        Watchdog::process().watch(Arc::new(call), limit);
        ran
    }
}

/// Counts a call as watched while it lives.
struct WatchedCount(Arc<AtomicUsize>);

impl WatchedCount {
    fn new(c: &Arc<AtomicUsize>) -> WatchedCount {
        c.fetch_add(1, Ordering::AcqRel);
        WatchedCount(c.clone())
    }
}

impl Drop for WatchedCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One call in flight, as the watchdog sees it.
struct CopyCall {
    device: Arc<Device>,
    /// The communicator's host words: the abort flag, the status record.
    host: Arc<HostMapped>,
    own: Arc<HostArena>,
    /// Every rank's abort-request word (device addresses in this process).
    abort_words: Vec<u64>,
    /// The flags this rank's streams wait for (device addresses).
    flags: Vec<u64>,
    /// A value past every flag value of the call.
    value: u32,
    /// Recorded after the push and the pull stream's last operation of the call.
    ends: [Event; 2],
    rank: u32,
    first_piece: u64,
    /// Counts the call while it lives.
    _watched: WatchedCount,
}

impl Watched for CopyCall {
    fn done(&self) -> bool {
        let Ok(_ctx) = self.device.activate() else {
            return true;
        };
        // A device that fails the query runs nothing of the call any more.
        self.ends.iter().all(|e| e.is_done().unwrap_or(true))
    }

    fn abort_requested(&self) -> bool {
        self.host.read_u32(HOST_ABORT) != 0
    }

    fn failed_peer(&self) -> Option<usize> {
        let mut w = [0u8; 4];
        self.own.read(abi::HDR_ABORT_REQ as usize, &mut w);
        // Some rank gave up and asked every rank to stop (the word does not say which).
        (u32::from_le_bytes(w) != 0).then_some(self.rank as usize)
    }

    fn record(&self, reason: &Reason) {
        if self.host.read_u32(HOST_STATUS) != abi::status::OK {
            return;
        }
        let code = match reason {
            Reason::Abort => abi::status::ABORTED,
            Reason::PeerFailed(_) => abi::status::PEER_ABORTED,
            Reason::Timeout(_) => abi::status::TIMEOUT,
        };
        // The details first, the code last: the host never reads a code whose details are not
        // written yet.
        self.host.write_u32(HOST_STATUS + 4, self.rank);
        self.host
            .write_bytes(HOST_STATUS + 16, &self.first_piece.to_le_bytes());
        self.host.write_u32(HOST_STATUS, code);
        tracing::warn!(
            "rank {}: the copy-engine AllReduce from piece {} is released ({reason:?})",
            self.rank,
            self.first_piece
        );
    }

    fn set_abort_words(&self) {
        if let Ok(_ctx) = self.device.activate()
            && let Err(e) = gpu::write_words(&self.abort_words, 1)
        {
            tracing::warn!("rank {}: setting the abort words: {e}", self.rank);
        }
    }

    fn release_flags(&self) {
        if let Ok(_ctx) = self.device.activate()
            && let Err(e) = gpu::write_words(&self.flags, self.value)
        {
            tracing::warn!("rank {}: releasing the copy-engine waits: {e}", self.rank);
        }
    }
}
