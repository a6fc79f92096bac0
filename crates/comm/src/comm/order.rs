//! Ordering, status and abort: one call run in the communicator's order
//! ([`Communicator::execute`]: the device's status first, the plan and parameters from
//! `launch.rs`, then ordered after the communicator's previous operation, launched, and
//! recorded), operations forwarded to NCCL ordered alike (eager and captured), the device's
//! status words read, the abort flag, and waiting for the device to be idle.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::abi;
use crate::error::Error;
use crate::gpu::{self, Stream};
use crate::plan::Plan;
use crate::request::Request;

use super::launch::{Copies, Run, Work};
use super::{CaptureMark, Communicator, Foreign, HOST_ABORT, HOST_STATUS};

impl Communicator {
    /// Runs a request: a device error of an earlier call first, then its plan
    /// ([`Communicator::plan`]) and the work it enqueues (`launch.rs`: the kernel, and the copies
    /// through scratch that buffers it cannot take as they are need), ordered after this
    /// communicator's previous operation; returns the plan that ran. Every rank must run the same
    /// requests in the same order; results are bitwise identical on every rank (docs/protocols.md).
    pub fn execute(&self, req: &Request<'_>) -> Result<Plan, Error> {
        self.check_status()?;
        let (p, work) = self.prepare(req)?;
        self.enqueue(work, req.stream)?;
        Ok(p)
    }

    /// Runs plan `p` for `req`'s buffers and stream as it is, without selecting again: a plan
    /// of [`Communicator::plan_forced`] (flashcomm-perf's forced algorithm and protocol), or one
    /// a test changed. Every rank must run the same plan; `req` must be a call of `p`'s
    /// collective. Otherwise as [`Communicator::execute`].
    pub fn execute_plan(&self, p: Plan, req: &Request<'_>) -> Result<Plan, Error> {
        self.check_status()?;
        if req.coll != p.coll {
            return Err(Error::InvalidArgument(format!(
                "a plan of {} run for a call of {}",
                p.coll, req.coll
            )));
        }
        self.enqueue(self.work(&p, req)?, req.stream)?;
        Ok(p)
    }

    /// Enqueues prepared work on `stream` as one operation of this communicator, ordered after
    /// its previous one: the copies before, the kernel (or copy), the copies after.
    pub(super) fn enqueue(&self, work: Work<'_>, stream: Stream) -> Result<(), Error> {
        let _ctx = match (&work.before, &work.run, &work.after) {
            (_, Run::Nothing, _) => return Ok(()),
            // One rank's copy between its own buffers uses nothing of the communicator's: no
            // order to keep (and no event to record: the call costs what NCCL's does).
            (Copies::None, Run::Copy { send, recv, bytes }, Copies::None) => {
                let _ctx = self.device.activate()?;
                return Ok(recv.copy_from(*send, *bytes, stream)?);
            }
            _ => self.device.activate()?,
        };
        let capturing = self.order_before(stream)?;
        let copies = |c: &Copies<'_>, gather: bool| -> Result<(), Error> {
            match *c {
                Copies::None => Ok(()),
                Copies::One(dst, src, n) => Ok(dst.copy_from(src, n, stream)?),
                Copies::Blocks { blocks, at, block } => {
                    for (q, b) in blocks.iter().enumerate() {
                        let mine = at.part(q as u64 * block, block);
                        let (dst, src) = if gather { (mine, *b) } else { (*b, mine) };
                        dst.copy_from(src, block, stream)?;
                    }
                    Ok(())
                }
            }
        };
        copies(&work.before, true)?;
        match &work.run {
            Run::Nothing => {}
            Run::Copy { send, recv, bytes } => recv.copy_from(*send, *bytes, stream)?,
            Run::Kernel(l) => gpu::launch(
                &self.kernels,
                l.kernel,
                l.cfg,
                stream,
                &l.params,
                l.overlapped,
            )?,
            Run::CopySchedule {
                send,
                recv,
                count,
                dtype,
            } => self.run_copy(*send, *recv, *count, *dtype, stream)?,
        }
        copies(&work.after, false)?;
        let one_kernel = matches!(
            (&work.before, &work.run, &work.after),
            (Copies::None, Run::Kernel(_), Copies::None)
        );
        self.order_after(stream, capturing, one_kernel)
    }

    /// Orders an operation of this communicator about to be enqueued on `stream` (either
    /// library's) after the communicator's previous ones, as NCCL orders all work of one
    /// communicator (docs/protocols.md, "Ordering"); returns whether `stream` is capturing.
    /// Eager: after the last eager operation when it went to another stream (and, with graph
    /// mixing once something was captured, always: a replay may have recorded the event since).
    /// Captured: the graph's own order applies; with graph mixing, the first operation of each
    /// capture also waits at each replay for the communicator's last eager operation (one
    /// event-wait node in the chain, before that operation only).
    pub(super) fn order_before(&self, stream: Stream) -> Result<bool, Error> {
        let last = &self.last;
        let capturing = stream.is_capturing()?;
        if capturing {
            if self.cfg.graph_mixing {
                let (id, before) = stream.capture_point()?;
                let mut mark = self.capture_mark();
                if mark.record.as_ref().is_none_or(|r| r.id != id) {
                    last.event.wait_on_external(stream)?;
                    mark.before.clear();
                } else {
                    mark.before = before;
                }
            }
        } else if last.launched.load(Ordering::Acquire)
            && (last.stream.load(Ordering::Relaxed) != stream.0 as usize
                || last.captured.load(Ordering::Relaxed))
        {
            last.event.wait_on(stream)?;
        }
        Ok(capturing)
    }

    /// After an operation of this communicator was enqueued on `stream`: eager, it becomes the
    /// last operation (recorded); captured with graph mixing, it joins the capture's one
    /// event-record node, which sits beside the captured chain and records the communicator's
    /// event at each replay once every captured operation of the communicator has completed.
    /// `one_kernel`: the operation was a single kernel launched right after `order_before`, so
    /// it depends on what the capture's dependencies were then, and their edges to the record
    /// node can go (back-to-back captured calls leave it one incoming edge).
    pub(super) fn order_after(
        &self,
        stream: Stream,
        capturing: bool,
        one_kernel: bool,
    ) -> Result<(), Error> {
        let last = &self.last;
        if capturing {
            if self.cfg.graph_mixing {
                let (id, _) = stream.capture_point()?;
                let mut guard = self.capture_mark();
                let mark = &mut *guard;
                let covered = if one_kernel {
                    std::mem::take(&mut mark.before)
                } else {
                    Vec::new()
                };
                match mark.record.as_mut() {
                    Some(r) if r.id == id => r.join(stream, &covered)?,
                    _ => mark.record = Some(last.event.record_beside(stream)?),
                }
                last.captured.store(true, Ordering::Relaxed);
                last.launched.store(true, Ordering::Release);
            }
            return Ok(());
        }
        last.event.record(stream)?;
        last.launches.fetch_add(1, Ordering::Relaxed);
        last.stream.store(stream.0 as usize, Ordering::Relaxed);
        last.launched.store(true, Ordering::Release);
        Ok(())
    }

    /// The graph-mixing record node of the capture in progress (a poisoned lock is taken over:
    /// the value is a plain record that a panic cannot leave half-written in a harmful way).
    fn capture_mark(&self) -> std::sync::MutexGuard<'_, CaptureMark> {
        self.last.capture.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Before another library's operation on this communicator (a collective forwarded to NCCL)
    /// is enqueued on `stream`: orders it after this communicator's previous operations as
    /// flashcomm's own launches are ordered (`order_before`), as NCCL orders all work of a
    /// communicator. Returns what to pass to [`Communicator::after_foreign`] once the operation
    /// was enqueued, or `None` when it is not to be recorded (captured without graph mixing,
    /// where the graph's own order applies).
    pub fn before_foreign(&self, stream: Stream) -> Result<Option<Foreign>, Error> {
        let _ctx = self.device.activate()?;
        let capturing = self.order_before(stream)?;
        Ok((!capturing || self.cfg.graph_mixing).then_some(Foreign { capturing }))
    }

    /// After another library's operation on this communicator was enqueued on `stream`: it is the
    /// communicator's last operation, which later operations of either library are ordered after.
    pub fn after_foreign(&self, stream: Stream, op: Foreign) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        self.order_after(stream, op.capturing, false)
    }

    /// The device-reported error, if a kernel of this communicator gave up.
    pub fn check_status(&self) -> Result<(), Error> {
        let mut code = self.host.read_u32(HOST_STATUS);
        if code == abi::status::OK {
            return Ok(());
        }
        // A kernel claimed the record and is filling it: give it a moment.
        for _ in 0..1000 {
            if code != abi::status::CLAIMED {
                break;
            }
            std::thread::sleep(Duration::from_micros(10));
            code = self.host.read_u32(HOST_STATUS);
        }
        let peer = self.host.read_u32(HOST_STATUS + 4);
        let seq = self.host.read_u64(HOST_STATUS + 16);
        if code == abi::status::TIMEOUT {
            return Err(Error::Timeout(format!(
                "rank {} waited longer than {:?} (FLASHCOMM_TIMEOUT_MS) for rank {peer} in \
                 collective #{seq}",
                self.rank, self.cfg.timeout
            )));
        }
        let what = match code {
            abi::status::ABORTED => format!(
                "rank {}: communicator aborted during collective #{seq}",
                self.rank
            ),
            abi::status::PEER_ABORTED => format!(
                "rank {}: a peer gave up during collective #{seq}",
                self.rank
            ),
            abi::status::MISMATCH => format!(
                "rank {}: rank {peer} ran a different collective than #{seq} (tag {:#x}): the ranks' call sequences differ",
                self.rank,
                self.host.read_u32(HOST_STATUS + 12)
            ),
            other => format!("rank {}: device status {other}", self.rank),
        };
        Err(Error::Remote(what))
    }

    /// Sets this rank's epoch (the sequence number of its next collective) to `seq`, so that a
    /// test can cross the epoch's wrap-around (docs/protocols.md, "Epochs") without four billion
    /// calls. Every rank must set the same value while no collective of the communicator runs.
    /// Only on a communicator that has run no collective yet: an epoch set below one already used
    /// would make lines left by the earlier calls look fresh again. `u32::MAX` is refused (the
    /// epoch never takes it: docs/protocols.md, "Epochs").
    #[doc(hidden)]
    pub fn set_epoch_for_testing(&self, seq: u32) -> Result<(), Error> {
        if seq == u32::MAX {
            return Err(Error::InvalidArgument(
                "the epoch never takes the value 0xffffffff".into(),
            ));
        }
        self.wait_idle()?;
        gpu::write_epoch_words(&self.device, self.local.epochs_addr(), seq)
    }

    /// Asks every running kernel of this communicator to stop (ncclCommAbort). Kernels leave
    /// their waits within microseconds; the communicator is unusable afterwards.
    pub fn abort(&self) {
        self.host.write_u32(HOST_ABORT, 1);
    }

    /// Whether [`Communicator::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.host.read_u32(HOST_ABORT) != 0
    }

    /// Waits until this communicator's last eager launch has finished (without a time limit,
    /// like NCCL's own destroy; see [`Communicator::wait_idle_for`]).
    pub fn wait_idle(&self) -> Result<(), Error> {
        if self.last.launched.load(Ordering::Acquire) {
            let _ctx = self.device.activate()?;
            self.last.event.synchronize()?;
        }
        Ok(())
    }

    /// Waits at most `limit` until this communicator's last eager launch has finished.
    /// `Ok(false)`: it had not (it may sit behind other work of its stream that does not finish,
    /// such as an NCCL operation waiting for a dead peer); the caller must then not free what the
    /// launch uses.
    pub fn wait_idle_for(&self, limit: Duration) -> Result<bool, Error> {
        if !self.last.launched.load(Ordering::Acquire) {
            return Ok(true);
        }
        let _ctx = self.device.activate()?;
        let start = std::time::Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if self.last.event.is_done()? {
                return Ok(true);
            }
            if start.elapsed() >= limit {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }
}
