//! Events: recorded on a stream (or as nodes of a graph capture), waited on, queried and timed.

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::{CaptureRecord, Error, Stream, check, cuda};

/// A CUDA event (timing disabled unless asked for).
pub struct Event(sys::CUevent);

// SAFETY: an event handle may be recorded, queried and synchronized from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A value that owns no event (dropping it destroys nothing; it must not be used): what an
    /// owner leaves in place of an event it hands on.
    pub fn empty() -> Event {
        Event(std::ptr::null_mut())
    }

    /// Creates an event in the current context.
    pub fn new(timing: bool) -> Result<Event, Error> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        result::event::create(flags)
            .map(Event)
            .map_err(cuda("creating an event"))
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream of the current context.
        unsafe { result::event::record(self.0, stream.0) }.map_err(cuda("recording an event"))
    }

    /// Records the event on `stream`; in a graph capture, as an event-record node that records
    /// the event at every replay (`CU_EVENT_RECORD_EXTERNAL`), so that work outside the graph can
    /// wait for it.
    pub fn record_external(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream of the current context.
        check(
            unsafe {
                sys::cuEventRecordWithFlags(
                    self.0,
                    stream.0,
                    sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            },
            "recording an event",
        )
    }

    /// Makes `stream` wait for the event; in a graph capture, as an event-wait node that waits at
    /// every replay for the event's last record (`CU_EVENT_WAIT_EXTERNAL`).
    pub fn wait_on_external(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream.
        unsafe {
            result::stream::wait_event(
                stream.0,
                self.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL,
            )
        }
        .map_err(cuda("waiting on an event"))
    }

    /// On a capturing `stream`: an event-record node that records the event at every replay and
    /// depends on the capture's current dependencies, beside the captured chain: the stream's
    /// dependencies are left as they are, so no later captured node waits for the record (the
    /// next captured kernel keeps its direct, programmatic edge to the previous one). Later
    /// captured work joins it with [`CaptureRecord::join`].
    pub fn record_beside(&self, stream: Stream) -> Result<CaptureRecord, Error> {
        let cap = stream.capture()?;
        let mut node: sys::CUgraphNode = std::ptr::null_mut();
        // SAFETY: `cap.graph` is the graph being captured on `stream` (valid until the capture
        // ends); the node is created without dependencies and `node` is a local out-pointer.
        let r = unsafe {
            sys::cuGraphAddEventRecordNode(&mut node, cap.graph, std::ptr::null(), 0, self.0)
        };
        check(r, "adding an event-record node to a capture")?;
        let mut rec = CaptureRecord {
            id: cap.id,
            graph: cap.graph as usize,
            node: node as usize,
            linked: Vec::new(),
        };
        rec.join(stream, &[])?;
        Ok(rec)
    }

    /// Makes `stream` wait for the event.
    pub fn wait_on(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream.
        unsafe {
            result::stream::wait_event(
                stream.0,
                self.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda("waiting on an event"))
    }

    /// Whether the recorded work has finished.
    pub fn is_done(&self) -> Result<bool, Error> {
        // SAFETY: valid event.
        match unsafe { result::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(cuda("querying an event")(e)),
        }
    }

    /// Milliseconds between `start` and this event (both recorded with timing).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, Error> {
        // SAFETY: both events are valid and completed (callers synchronize first).
        unsafe { result::event::elapsed(start.0, self.0) }.map_err(cuda("reading event time"))
    }

    /// Blocks until the event has completed.
    pub fn synchronize(&self) -> Result<(), Error> {
        // SAFETY: valid event.
        unsafe { result::event::synchronize(self.0) }.map_err(cuda("waiting for an event"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.0.is_null() {
            return;
        }
        // SAFETY: destroys the event this value owns.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}
