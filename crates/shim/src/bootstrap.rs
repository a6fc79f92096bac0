//! The set-up exchange of a communicator built from the shim: flashcomm's [`Bootstrap`] (an
//! all-gather of small host buffers) carried by the real NCCL's `ncclAllGather` on the very
//! communicator flashcomm is about to serve.
//!
//! Each round copies this rank's bytes, framed to a fixed length ([`encode_frame`]), into a small
//! device buffer, runs the real `ncclAllGather` (`ncclUint8`) on a stream of our own, waits for it
//! (until it completed or the communicator reports an asynchronous error: no time limit, like
//! NCCL's own init, so no round ever returns with its all-gather still queued), copies the
//! frames back and unpacks them ([`decode_frames`]). Every rank runs the same rounds at the same
//! point (right after the real init returned), so the exchange is collective.
//!
//! No rank leaves early: whatever fails locally, a rank that can still call the real all-gather
//! takes part in every round until all ranks stop, so no peer waits for it and every rank sees
//! the same frames (how, and what remains NCCL's own weakness: docs/protocols.md, "Set-up: all
//! or nothing, on every rank alike").
//!
//! A process that has not loaded the CUDA driver cannot be running the real NCCL (which loads it
//! before it creates a communicator): the library it calls is a stand-in that takes host buffers
//! (the shim's tests drive several ranks through one), and the exchange uses host memory.
//!
//! Owns: [`NcclBootstrap`], [`ExchangeFaults`] and the frame format.
//! May import: `types`, `calls::cuda`, `calls::nccl`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flashcomm_comm::{Bootstrap, DeviceMem, Error};
use flashcomm_gpu::{Device, HostMapped, Stream};
use flashcomm_nccl_sys::{ncclComm_t, ncclResult_t};

use crate::calls::cuda::{OwnStream, driver_loaded};
use crate::calls::nccl;
use crate::types::{CommHandle, ExchangeGate};

/// Bytes of one rank's frame in every round.
pub(crate) const FRAME_BYTES: usize = 4096;
/// Bytes of the frame header: magic, round, status, payload length (four little-endian u32).
const HEADER_BYTES: usize = 16;
/// The largest payload of one round.
pub(crate) const MAX_PAYLOAD: usize = FRAME_BYTES - HEADER_BYTES;
const MAGIC: u32 = 0x5342_4346; // "FCBS"
const STATUS_OK: u32 = 0;
const STATUS_TOO_LONG: u32 = 1;
const STATUS_FAILED: u32 = 2;

/// This rank's frame of round `round`: the header, the payload, zero padding to
/// [`FRAME_BYTES`]. A payload longer than [`MAX_PAYLOAD`] is not sent; the frame says how long it
/// was, and every rank's [`decode_frames`] fails.
pub(crate) fn encode_frame(round: u32, payload: &[u8]) -> Vec<u8> {
    frame(round, payload, false)
}

/// The frame of a rank that cannot take part in round `round` as usual, saying `why` (every rank
/// then fails the round, naming it).
pub(crate) fn failure_frame(round: u32, why: &str) -> Vec<u8> {
    let mut end = why.len().min(512);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    frame(round, &why.as_bytes()[..end], true)
}

fn frame(round: u32, payload: &[u8], failed: bool) -> Vec<u8> {
    let (status, body) = if failed {
        (STATUS_FAILED, payload)
    } else if payload.len() > MAX_PAYLOAD {
        (STATUS_TOO_LONG, &[][..])
    } else {
        (STATUS_OK, payload)
    };
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let mut v = Vec::with_capacity(FRAME_BYTES);
    for word in [MAGIC, round, status, len] {
        v.extend_from_slice(&word.to_le_bytes());
    }
    v.extend_from_slice(body);
    v.resize(FRAME_BYTES, 0);
    v
}

/// Unpacks the `nranks` frames of round `round` (rank order, [`FRAME_BYTES`] each). Fails, with
/// the same message on every rank, when any frame is malformed, of another round, too long, or
/// marks a failure.
pub(crate) fn decode_frames(
    round: u32,
    bytes: &[u8],
    nranks: usize,
) -> Result<Vec<Vec<u8>>, String> {
    if bytes.len() != FRAME_BYTES * nranks {
        return Err(format!(
            "received {} bytes for {nranks} frames of {FRAME_BYTES}",
            bytes.len()
        ));
    }
    let mut out = Vec::with_capacity(nranks);
    for (r, f) in bytes.chunks_exact(FRAME_BYTES).enumerate() {
        let word =
            |i: usize| u32::from_le_bytes([f[4 * i], f[4 * i + 1], f[4 * i + 2], f[4 * i + 3]]);
        let (magic, got_round, status, len) = (word(0), word(1), word(2), word(3));
        if magic != MAGIC || got_round != round {
            return Err(format!(
                "rank {r} sent no valid frame for round {round} (its set-up failed, or it runs \
                 another flashcomm version)"
            ));
        }
        match status {
            STATUS_OK if (len as usize) <= MAX_PAYLOAD => {
                out.push(f[HEADER_BYTES..HEADER_BYTES + len as usize].to_vec());
            }
            STATUS_TOO_LONG | STATUS_OK => {
                return Err(format!(
                    "rank {r} had {len} bytes to send, more than a set-up frame holds \
                     ({MAX_PAYLOAD})"
                ));
            }
            STATUS_FAILED => {
                let why = f
                    .get(HEADER_BYTES..HEADER_BYTES + (len as usize).min(MAX_PAYLOAD))
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default();
                return Err(format!(
                    "rank {r} could not take part in round {round}{}{why}",
                    if why.is_empty() { "" } else { ": " }
                ));
            }
            other => return Err(format!("rank {r} sent a frame with unknown status {other}")),
        }
    }
    Ok(out)
}

/// Faults injected into this rank's exchange (`FLASHCOMM_DEBUG_FAULT`, tests only).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExchangeFaults {
    /// The resources cannot be prepared as usual.
    pub(crate) prepare: bool,
    /// This round's frame (and the failure frame) cannot be copied into the buffer.
    pub(crate) upload: Option<u32>,
    /// This round's all-gather is refused once.
    pub(crate) enqueue: Option<u32>,
}

/// A buffer of the exchange: device memory, pinned host memory mapped into the device, or (for a
/// stand-in NCCL, without the CUDA driver) plain host memory.
enum Mem {
    Device(DeviceMem),
    Mapped(HostMapped),
    Plain(Box<[u8]>),
}

impl Mem {
    fn alloc(dev: Option<&Arc<Device>>, bytes: usize) -> Result<Mem, String> {
        let Some(dev) = dev else {
            return Ok(Mem::Plain(vec![0; bytes].into_boxed_slice()));
        };
        match DeviceMem::alloc_zeroed(dev, bytes) {
            Ok(m) => Ok(Mem::Device(m)),
            Err(dev_err) => {
                let _ctx = dev.activate().map_err(|e| e.to_string())?;
                HostMapped::alloc(bytes)
                    .map(Mem::Mapped)
                    .map_err(|e| format!("{dev_err}; pinned host memory: {e}"))
            }
        }
    }

    fn addr(&mut self) -> u64 {
        match self {
            Mem::Device(m) => m.addr(),
            Mem::Mapped(m) => m.dev_ptr(),
            Mem::Plain(b) => b.as_mut_ptr() as u64,
        }
    }

    fn len(&self) -> usize {
        match self {
            Mem::Device(m) => m.len(),
            Mem::Mapped(m) => m.len(),
            Mem::Plain(b) => b.len(),
        }
    }

    fn put(&mut self, bytes: &[u8], stream: Option<Stream>) -> Result<(), String> {
        match (self, stream) {
            (Mem::Device(m), Some(s)) => m.upload(0, bytes, s).map_err(|e| e.to_string()),
            (Mem::Mapped(m), _) => {
                m.write_bytes(0, bytes);
                Ok(())
            }
            (Mem::Plain(b), _) => {
                b[..bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
            (Mem::Device(_), None) => Err("no stream".into()),
        }
    }

    fn get(&self, dst: &mut [u8], stream: Option<Stream>) -> Result<(), String> {
        match (self, stream) {
            (Mem::Device(m), Some(s)) => m.download(0, dst, s).map_err(|e| e.to_string()),
            (Mem::Mapped(m), _) => {
                m.read_bytes(0, dst);
                Ok(())
            }
            (Mem::Plain(b), _) => {
                dst.copy_from_slice(&b[..dst.len()]);
                Ok(())
            }
            (Mem::Device(_), None) => Err("no stream".into()),
        }
    }
}

/// One exchange's buffers: its frame, and every rank's.
pub(crate) struct Buffers {
    /// The device ordinal, or -1 for plain host memory.
    device: i32,
    send: Mem,
    recv: Mem,
}

/// Buffers of finished exchanges, for the next ones (never freed: see the module documentation).
pub(crate) type Pool = Mutex<Vec<Buffers>>;

/// The process's pool.
static POOL: Pool = Mutex::new(Vec::new());

impl Buffers {
    /// Buffers for `nranks` frames on `dev` (plain host memory without one): from `pool`, else
    /// new.
    fn take(pool: &Pool, dev: Option<&Arc<Device>>, nranks: usize) -> Result<Buffers, String> {
        let need = FRAME_BYTES * nranks;
        let device = dev.map_or(-1, |d| d.ordinal());
        {
            let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = pool
                .iter()
                .position(|b| b.device == device && b.recv.len() >= need)
            {
                return Ok(pool.swap_remove(i));
            }
        }
        Ok(Buffers {
            device,
            send: Mem::alloc(dev, FRAME_BYTES)?,
            // Room for a few more ranks, so that a later, slightly larger communicator finds it.
            recv: Mem::alloc(dev, need.max(8 * FRAME_BYTES))?,
        })
    }
}

/// The stream the exchange's all-gathers run on.
enum ExStream {
    Own(OwnStream),
    /// The thread's per-thread default stream (no stream of our own could be made).
    PerThread,
}

impl ExStream {
    fn stream(&self) -> Stream {
        match self {
            ExStream::Own(s) => s.stream(),
            ExStream::PerThread => Stream::per_thread(),
        }
    }
}

/// Where this rank's frames are gathered: buffers on a stream of the device, or, for a stand-in
/// NCCL (no CUDA driver in the process: it completes the all-gather in the call), plain host
/// buffers and no stream.
pub(crate) struct Carrier {
    dev: Option<(Arc<Device>, ExStream)>,
    /// `None` once dropped (returned to the pool, or leaked while still in use).
    bufs: Option<Buffers>,
    pool: &'static Pool,
}

impl Carrier {
    /// The carrier of a rank of `nranks` on `device`; `Err`: the real all-gather cannot be
    /// called at all. `failed`: why the resources could not be prepared as usual (a fallback
    /// is used).
    fn prepare(
        pool: &'static Pool,
        device: i32,
        nranks: usize,
        faults: ExchangeFaults,
        failed: &mut Option<String>,
    ) -> Result<Carrier, String> {
        if faults.prepare {
            *failed = Some("its set-up exchange could not be prepared (fault injected)".into());
        }
        if !driver_loaded() {
            return Ok(Carrier {
                dev: None,
                bufs: Some(Buffers::take(pool, None, nranks)?),
                pool,
            });
        }
        let dev = Device::open(device).map_err(|e| e.to_string())?;
        let _ctx = dev.activate().map_err(|e| e.to_string())?;
        let stream = match OwnStream::create() {
            Ok(s) => ExStream::Own(s),
            Err(_) => ExStream::PerThread,
        };
        let bufs = Buffers::take(pool, Some(&dev), nranks)?;
        Ok(Carrier {
            dev: Some((dev, stream)),
            bufs: Some(bufs),
            pool,
        })
    }

    fn stream(&self) -> Option<Stream> {
        self.dev.as_ref().map(|(_, s)| s.stream())
    }

    /// Places this rank's frame where the all-gather reads it.
    fn put(&mut self, frame: &[u8]) -> Result<(), String> {
        let _ctx = match &self.dev {
            Some((d, _)) => Some(d.activate().map_err(|e| e.to_string())?),
            None => None,
        };
        let stream = self.stream();
        let b = self.bufs.as_mut().ok_or("no buffers")?;
        b.send.put(frame, stream)
    }

    /// Every rank's frame, after the all-gather completed.
    fn get(&mut self, all: &mut [u8]) -> Result<(), String> {
        let _ctx = match &self.dev {
            Some((d, _)) => Some(d.activate().map_err(|e| e.to_string())?),
            None => None,
        };
        let stream = self.stream();
        let b = self.bufs.as_ref().ok_or("no buffers")?;
        b.recv.get(all, stream)
    }

    /// Send buffer, receive buffer and stream as the real all-gather takes them.
    fn raw(&mut self) -> (u64, u64, *mut std::ffi::c_void) {
        let stream = self
            .stream()
            .map_or(std::ptr::null_mut(), |s| s.0.cast::<std::ffi::c_void>());
        match self.bufs.as_mut() {
            Some(b) => (b.send.addr(), b.recv.addr(), stream),
            None => (0, 0, stream),
        }
    }

    /// The host buffers of a carrier without a device: this rank's frame, and every rank's.
    #[cfg(test)]
    fn host(&mut self) -> Option<(&[u8], &mut [u8])> {
        match self.bufs.as_mut()? {
            Buffers {
                send: Mem::Plain(s),
                recv: Mem::Plain(r),
                ..
            } => Some((&s[..FRAME_BYTES], &mut r[..])),
            _ => None,
        }
    }

    /// Whether the all-gather enqueued last has completed (a stand-in completes in the call).
    fn idle(&self) -> Result<bool, String> {
        match &self.dev {
            None => Ok(true),
            Some((d, s)) => {
                let _ctx = d.activate().map_err(|e| e.to_string())?;
                s.stream().is_idle().map_err(|e| e.to_string())
            }
        }
    }
}

impl Drop for Carrier {
    fn drop(&mut self) {
        // Buffers go back to the pool once nothing queued can still use them; otherwise they
        // are leaked (an all-gather that never completed may still write them).
        let idle = self.idle().unwrap_or(false);
        if let Some(b) = self.bufs.take() {
            if idle {
                self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(b);
            } else {
                std::mem::forget(b);
            }
        }
    }
}

/// The rounds so far, and what this rank has to report.
struct Rounds {
    next: u32,
    carrier: Carrier,
    /// Why this rank cannot take part as usual: every frame it sends says so.
    failed: Option<String>,
    /// A failure found after this round's frame went out (it could not be placed): reported in
    /// the next round.
    report_next: Option<String>,
}

/// The calls of the real library the exchange makes on its communicator (a trait so that the
/// tests can stand in for it).
pub(crate) trait Gather: Send + Sync {
    /// `ncclAllGather` of [`FRAME_BYTES`] (`ncclUint8`) per rank from the carrier's send buffer
    /// into its receive buffer, on its stream.
    fn all_gather(&self, io: &mut Carrier) -> Result<ncclResult_t, String>;
    /// `ncclCommGetAsyncError`.
    fn async_error(&self) -> Result<ncclResult_t, String>;
}

/// The real library's communicator `.0`.
struct RealNccl(CommHandle);

impl Gather for RealNccl {
    fn all_gather(&self, io: &mut Carrier) -> Result<ncclResult_t, String> {
        let (send, recv, stream) = io.raw();
        nccl::all_gather_bytes(send, recv, FRAME_BYTES, self.0.0 as ncclComm_t, stream)
    }
    fn async_error(&self) -> Result<ncclResult_t, String> {
        nccl::async_error(self.0.0 as ncclComm_t)
    }
}

/// How often the real all-gather is called again after it refused the call.
const ENQUEUE_TRIES: u32 = 5;

/// The set-up exchange over the real NCCL (see the module documentation).
pub(crate) struct NcclBootstrap {
    gather: Box<dyn Gather>,
    rank: u32,
    nranks: u32,
    gate: Arc<ExchangeGate>,
    faults: ExchangeFaults,
    rounds: Mutex<Rounds>,
}

impl NcclBootstrap {
    /// The exchange of rank `rank` of `nranks` of the real communicator `comm` on `device`.
    /// `Err`: this rank cannot call the real all-gather at all (its peers will wait for it, as
    /// they would for its next NCCL call); every other failure is carried into the rounds.
    pub(crate) fn new(
        comm: CommHandle,
        rank: u32,
        nranks: u32,
        device: i32,
        gate: Arc<ExchangeGate>,
        faults: ExchangeFaults,
    ) -> Result<NcclBootstrap, String> {
        Self::over(
            Box::new(RealNccl(comm)),
            &POOL,
            rank,
            nranks,
            device,
            gate,
            faults,
        )
    }

    /// The exchange over `gather`, its buffers from `pool`.
    fn over(
        gather: Box<dyn Gather>,
        pool: &'static Pool,
        rank: u32,
        nranks: u32,
        device: i32,
        gate: Arc<ExchangeGate>,
        faults: ExchangeFaults,
    ) -> Result<NcclBootstrap, String> {
        let mut failed = None;
        let carrier = Carrier::prepare(pool, device, nranks as usize, faults, &mut failed)?;
        Ok(NcclBootstrap {
            gather,
            rank,
            nranks,
            gate,
            faults,
            rounds: Mutex::new(Rounds {
                next: 0,
                carrier,
                failed,
                report_next: None,
            }),
        })
    }

    /// A call of the real library on the communicator, unless an abort has begun.
    fn call<T>(&self, f: impl FnOnce() -> T) -> Result<T, String> {
        if !self.gate.enter() {
            return Err("the communicator is being aborted (ncclCommAbort)".into());
        }
        let r = f();
        self.gate.leave();
        Ok(r)
    }

    /// Runs round `round`'s all-gather, calling the real one again (a few times) when it
    /// refuses the call: a rank that gives up here leaves its peers waiting.
    fn enqueue(&self, round: u32, carrier: &mut Carrier) -> Result<(), String> {
        let mut pause = Duration::from_millis(1);
        let mut last = String::new();
        for attempt in 0..ENQUEUE_TRIES {
            let r = if attempt == 0 && self.faults.enqueue == Some(round) {
                Ok(ncclResult_t::ncclSystemError)
            } else {
                self.call(|| self.gather.all_gather(carrier))?
            };
            match r {
                Ok(ncclResult_t::ncclSuccess) | Ok(ncclResult_t::ncclInProgress) => return Ok(()),
                Ok(other) => last = format!("the real ncclAllGather returned {}", other.0),
                Err(e) => return Err(e),
            }
            std::thread::sleep(pause);
            pause *= 2;
        }
        Err(format!(
            "{last} {ENQUEUE_TRIES} times in round {round}: this rank cannot take part in the \
             set-up exchange (its peers may wait, as for a failed NCCL call)"
        ))
    }

    /// Waits until the all-gather on our stream has finished, watching the communicator's
    /// asynchronous error and an abort. No time limit: returning while the all-gather is still
    /// queued would leave it to pair with the caller's next NCCL call on a peer that is merely
    /// late.
    fn wait(&self, carrier: &Carrier) -> Result<(), String> {
        let mut pause = Duration::from_micros(20);
        loop {
            if self.gate.is_aborting() {
                return Err("the communicator is being aborted (ncclCommAbort)".into());
            }
            if carrier.idle()? {
                return Ok(());
            }
            match self.call(|| self.gather.async_error())?? {
                ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => {}
                other => {
                    return Err(format!(
                        "the communicator reported error {} during the set-up exchange",
                        other.0
                    ));
                }
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn round(&self, rounds: &mut Rounds, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        // What this rank sends: its payload, or why it cannot take part as usual.
        let frame = match &rounds.failed {
            Some(why) => failure_frame(round, why),
            None => encode_frame(round, mine),
        };
        let injected = self.faults.upload == Some(round);
        let placed = if injected {
            Err("fault injected".to_string())
        } else {
            rounds.carrier.put(&frame)
        };
        if let Err(e) = placed {
            let why = format!("its set-up frame of round {round} could not be placed ({e})");
            let fallback = if injected {
                Err(())
            } else {
                rounds
                    .carrier
                    .put(&failure_frame(round, &why))
                    .map_err(drop)
            };
            match fallback {
                // Every rank fails this round, naming this one.
                Ok(()) => rounds.failed = Some(why),
                // Whatever the buffer holds goes out; this rank says it failed next round.
                Err(()) => rounds.report_next = Some(why),
            }
        }
        self.enqueue(round, &mut rounds.carrier)
            .map_err(Error::Bootstrap)?;
        self.wait(&rounds.carrier).map_err(Error::Bootstrap)?;
        let mut all = vec![0u8; FRAME_BYTES * self.nranks as usize];
        rounds.carrier.get(&mut all).map_err(|e| {
            Error::Bootstrap(format!(
                "the gathered frames of round {round} could not be read back ({e}): this rank \
                 cannot tell the round's outcome (its peers may wait)"
            ))
        })?;
        let frames = decode_frames(round, &all, self.nranks as usize).map_err(Error::Bootstrap)?;
        if let Some(why) = rounds.report_next.take() {
            rounds.failed = Some(why);
        }
        Ok(frames)
    }
}

impl Bootstrap for NcclBootstrap {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.nranks
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let mut rounds = self.rounds.lock().unwrap_or_else(|e| e.into_inner());
        let round = rounds.next;
        rounds.next = rounds.next.wrapping_add(1);
        self.round(&mut rounds, round, mine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather(round: u32, payloads: &[Vec<u8>]) -> Vec<u8> {
        payloads
            .iter()
            .flat_map(|p| encode_frame(round, p))
            .collect()
    }

    use flashcomm_comm::Agreement;
    use std::sync::Condvar;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A stand-in for the real all-gather among threads: round k of every rank meets in slot k.
    struct Hall {
        n: usize,
        slots: Mutex<Vec<(usize, Vec<u8>)>>,
        cv: Condvar,
    }

    /// One rank of a [`Hall`]; `refuse`: its next call is refused (a transient error).
    struct Member {
        hall: Arc<Hall>,
        rank: usize,
        round: AtomicU32,
        refuse: AtomicU32,
    }

    impl Gather for Member {
        fn all_gather(&self, io: &mut Carrier) -> Result<ncclResult_t, String> {
            if self.refuse.swap(0, Ordering::SeqCst) == 1 {
                return Ok(ncclResult_t::ncclSystemError);
            }
            let (send, recv) = io.host().ok_or("host buffers expected")?;
            let k = self.round.fetch_add(1, Ordering::SeqCst) as usize;
            let mut slots = self.hall.slots.lock().unwrap();
            while slots.len() <= k {
                slots.push((0, vec![0; FRAME_BYTES * self.hall.n]));
            }
            let at = self.rank * FRAME_BYTES;
            slots[k].1[at..at + FRAME_BYTES].copy_from_slice(send);
            slots[k].0 += 1;
            self.hall.cv.notify_all();
            while slots[k].0 < self.hall.n {
                slots = self.hall.cv.wait(slots).unwrap();
            }
            recv[..FRAME_BYTES * self.hall.n].copy_from_slice(&slots[k].1);
            Ok(ncclResult_t::ncclSuccess)
        }
        fn async_error(&self) -> Result<ncclResult_t, String> {
            Ok(ncclResult_t::ncclSuccess)
        }
    }

    /// Runs `rounds` agreement rounds on `n` ranks over the exchange (buffers from `pool`), rank
    /// `r` with `faults[r]` and refusing its first all-gather when `refuse[r]`; returns every
    /// rank's (rounds run, verdict).
    fn exchange(
        pool: &'static Pool,
        n: usize,
        rounds: u32,
        faults: &[ExchangeFaults],
        refuse: &[bool],
    ) -> Vec<(u32, Result<(), String>)> {
        let hall = Arc::new(Hall {
            n,
            slots: Mutex::new(Vec::new()),
            cv: Condvar::new(),
        });
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let hall = hall.clone();
                    s.spawn(move || {
                        let member = Member {
                            hall,
                            rank: r,
                            round: AtomicU32::new(0),
                            refuse: AtomicU32::new(u32::from(refuse[r])),
                        };
                        let boot = NcclBootstrap::over(
                            Box::new(member),
                            pool,
                            r as u32,
                            n as u32,
                            0,
                            Arc::new(ExchangeGate::default()),
                            faults[r],
                        )
                        .unwrap();
                        let mut ag = Agreement::new(&boot);
                        let mut verdict = Ok(());
                        for k in 0..rounds {
                            if let Err(e) = ag.round(Ok(vec![r as u8, k as u8])) {
                                verdict = Err(e.to_string());
                                break;
                            }
                        }
                        (ag.rounds(), verdict)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn alike(got: &[(u32, Result<(), String>)]) -> (u32, Result<(), String>) {
        for g in got {
            assert_eq!(g, &got[0], "every rank: same rounds, same verdict: {got:?}");
        }
        got[0].clone()
    }

    /// Fault class 1, the exchange's own failure points, on every rank of three in turn: the
    /// resources that cannot be prepared, a frame that cannot be placed (at any round), the
    /// real all-gather refusing a call. Every rank takes part until every rank stops, and every
    /// rank ends with the same verdict after the same rounds. Before, a rank whose preparation
    /// failed left without a round, and its peers waited for ever.
    #[test]
    fn every_rank_ends_the_exchange_alike_wherever_it_fails() {
        static POOL_A: Pool = Mutex::new(Vec::new());
        let ok = [ExchangeFaults::default(); 3];
        assert_eq!(
            exchange(&POOL_A, 3, 4, &ok, &[false; 3]),
            vec![(4, Ok(())); 3]
        );
        for r in 0..3 {
            let mut f = ok;
            f[r].prepare = true;
            let (rounds, v) = alike(&exchange(&POOL_A, 3, 4, &f, &[false; 3]));
            assert_eq!(rounds, 1, "stops at the first round");
            let v = v.unwrap_err();
            assert!(
                v.contains(&format!("rank {r} could not take part in round 0"))
                    && v.contains("could not be prepared"),
                "{v}"
            );
            for k in 0..4 {
                let mut f = ok;
                f[r].upload = Some(k);
                let (rounds, v) = alike(&exchange(&POOL_A, 3, 4, &f, &[false; 3]));
                assert!(rounds == k + 1 || rounds == k + 2, "{rounds} at {k}");
                assert!(v.unwrap_err().contains(&format!("rank {r}")));
            }
            let mut refuse = [false; 3];
            refuse[r] = true;
            assert_eq!(
                exchange(&POOL_A, 3, 4, &ok, &refuse),
                vec![(4, Ok(())); 3],
                "a refused all-gather is called again"
            );
        }
    }

    /// A frame that cannot be placed leaves whatever the buffer holds; with buffers reused from
    /// an earlier exchange that can be a valid frame of the same round, which every rank
    /// accepts. The rank says it failed in the next round, where every rank stops (nothing is
    /// written to a peer before a round every rank agreed on).
    #[test]
    fn a_frame_that_could_not_be_placed_is_reported_the_round_after() {
        static POOL_B: Pool = Mutex::new(Vec::new());
        let ok = [ExchangeFaults::default(); 3];
        // An exchange of one round leaves three sets of buffers holding valid frames of round 0.
        assert_eq!(
            exchange(&POOL_B, 3, 1, &ok, &[false; 3]),
            vec![(1, Ok(())); 3]
        );
        let mut f = ok;
        f[1].upload = Some(0);
        let (rounds, v) = alike(&exchange(&POOL_B, 3, 4, &f, &[false; 3]));
        let v = v.unwrap_err();
        assert_eq!(rounds, 2, "{v}");
        assert!(
            v.contains("rank 1 could not take part in round 1")
                && v.contains("frame of round 0 could not be placed"),
            "{v}"
        );
    }

    #[test]
    fn frames_have_a_fixed_length_with_the_length_in_front() {
        let f = encode_frame(7, b"abc");
        assert_eq!(f.len(), FRAME_BYTES);
        assert_eq!(&f[0..4], &MAGIC.to_le_bytes());
        assert_eq!(&f[4..8], &7u32.to_le_bytes());
        assert_eq!(&f[8..12], &STATUS_OK.to_le_bytes());
        assert_eq!(&f[12..16], &3u32.to_le_bytes());
        assert_eq!(&f[16..19], b"abc");
        assert!(f[19..].iter().all(|&b| b == 0), "zero padding");
        assert_eq!(encode_frame(0, &[]).len(), FRAME_BYTES);
        assert_eq!(encode_frame(0, &[1; MAX_PAYLOAD]).len(), FRAME_BYTES);
    }

    #[test]
    fn frames_round_trip_in_rank_order_with_any_lengths() {
        let payloads = vec![
            vec![],
            vec![1u8; 160],
            vec![2u8; MAX_PAYLOAD],
            b"x".to_vec(),
        ];
        let got = decode_frames(3, &gather(3, &payloads), 4).unwrap();
        assert_eq!(got, payloads);
    }

    #[test]
    fn too_long_payloads_fail_on_every_rank() {
        let payloads = vec![vec![0u8; 4], vec![9u8; MAX_PAYLOAD + 1]];
        let f = encode_frame(0, &payloads[1]);
        assert_eq!(f.len(), FRAME_BYTES);
        assert_eq!(&f[8..12], &STATUS_TOO_LONG.to_le_bytes());
        let e = decode_frames(0, &gather(0, &payloads), 2).unwrap_err();
        assert!(e.contains("rank 1 had 4081 bytes"), "{e}");
    }

    #[test]
    fn failed_stale_and_foreign_frames_fail_the_round() {
        let mut bytes = gather(5, &[b"a".to_vec(), b"b".to_vec()]);
        bytes[FRAME_BYTES..].copy_from_slice(&failure_frame(5, "no memory"));
        let e = decode_frames(5, &bytes, 2).unwrap_err();
        assert!(
            e.contains("rank 1 could not take part in round 5: no memory"),
            "{e}"
        );

        // A frame left over from an earlier round (a rank that could not write this one).
        let mut bytes = gather(5, &[b"a".to_vec(), b"b".to_vec()]);
        bytes[..FRAME_BYTES].copy_from_slice(&encode_frame(4, b"a"));
        let e = decode_frames(5, &bytes, 2).unwrap_err();
        assert!(e.contains("rank 0 sent no valid frame for round 5"), "{e}");

        // Zeroed memory (nothing was ever written).
        let e = decode_frames(0, &vec![0u8; 2 * FRAME_BYTES], 2).unwrap_err();
        assert!(e.contains("rank 0 sent no valid frame"), "{e}");

        // A length that does not fit, or a wrong total size.
        let mut bytes = gather(1, &[b"a".to_vec()]);
        bytes[12..16].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(decode_frames(1, &bytes, 1).is_err());
        assert!(decode_frames(1, &bytes[..FRAME_BYTES - 1], 1).is_err());
    }
}
