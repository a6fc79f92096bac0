//! Graphs: a stream's capture (begun, read, ended and instantiated), the record nodes an event
//! leaves beside a capture's chain, and the launch of an instantiated graph.

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::{Error, Stream, check, cuda};

/// A CUDA graph captured from a stream and instantiated.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles may be launched and destroyed from any thread.
unsafe impl Send for Graph {}

/// An event-record node beside a capture's chain ([`Event::record_beside`](crate::Event::record_beside)), kept as plain
/// integers (graph and node handles) so that a communicator can hold it between calls without
/// owning it; meaningful only while that capture lasts.
#[derive(Debug)]
pub struct CaptureRecord {
    /// The capture's unique id.
    pub id: u64,
    pub(crate) graph: usize,
    pub(crate) node: usize,
    /// The nodes with an edge to the record node.
    pub(crate) linked: Vec<usize>,
}

impl CaptureRecord {
    /// Makes the record node depend also on everything captured on `stream` so far (the
    /// capture's current dependencies), without changing the stream's dependencies. `covered`
    /// are nodes that every current dependency is known to depend on (for example the
    /// dependencies that the last captured kernel was launched after): their edges to the record
    /// node are removed, as the new edges imply them, so that back-to-back captured operations
    /// leave the record node with one incoming edge rather than one per operation.
    pub fn join(&mut self, stream: Stream, covered: &[usize]) -> Result<(), Error> {
        let cap = stream.capture()?;
        if cap.id != self.id || cap.graph as usize != self.graph {
            return Err(Error::Cuda {
                during: "joining a captured node",
                detail: "the stream's capture is another one".into(),
            });
        }
        let to_node = self.node as sys::CUgraphNode;
        let from: Vec<sys::CUgraphNode> = cap
            .deps
            .iter()
            .copied()
            .filter(|d| !self.linked.contains(&(*d as usize)) && *d as usize != self.node)
            .collect();
        if !from.is_empty() {
            let to = vec![to_node; from.len()];
            // SAFETY: `cap.graph` is the graph under capture; `from` are its nodes and `to` names
            // a node of the same graph, as many entries as `from`; default edges.
            let r = unsafe {
                sys::cuGraphAddDependencies(cap.graph, from.as_ptr(), to.as_ptr(), to.len())
            };
            check(r, "adding dependencies to a captured node")?;
            self.linked.extend(from.iter().map(|d| *d as usize));
        }
        let frontier: Vec<usize> = cap.deps.iter().map(|d| *d as usize).collect();
        let stale: Vec<sys::CUgraphNode> = self
            .linked
            .iter()
            .copied()
            .filter(|n| covered.contains(n) && !frontier.contains(n))
            .map(|n| n as sys::CUgraphNode)
            .collect();
        if !stale.is_empty() {
            let to = vec![to_node; stale.len()];
            // SAFETY: as above; every edge named exists (`linked`). Removing edges (not nodes) is
            // allowed while the capture is in progress.
            let r = unsafe {
                sys::cuGraphRemoveDependencies(cap.graph, stale.as_ptr(), to.as_ptr(), to.len())
            };
            check(r, "removing dependencies of a captured node")?;
            self.linked
                .retain(|n| !stale.contains(&(*n as sys::CUgraphNode)));
        }
        Ok(())
    }
}

/// What [`Stream::capture`] reports of a capture in progress.
pub(crate) struct Capture {
    pub(crate) id: u64,
    pub(crate) graph: sys::CUgraph,
    pub(crate) deps: Vec<sys::CUgraphNode>,
}

impl Stream {
    /// The capture in progress on this stream: its unique id, its graph and the nodes the next
    /// captured node will depend on (copied).
    pub(crate) fn capture(&self) -> Result<Capture, Error> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0u64;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let mut deps: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut n = 0usize;
        // SAFETY: valid stream; every out-pointer is a local; the array the driver returns stays
        // valid until the next capture operation on the stream and is copied before it. Edge
        // data is asked for so that the query is never lossy; it is not needed here.
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.0,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        };
        check(r, "reading a capture's state")?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            return Err(Error::Cuda {
                during: "reading a capture's state",
                detail: "the stream is not capturing".into(),
            });
        }
        let deps = if deps.is_null() || n == 0 {
            Vec::new()
        } else {
            // SAFETY: the driver returned `n` valid node handles at `deps` (see above).
            unsafe { std::slice::from_raw_parts(deps, n) }.to_vec()
        };
        Ok(Capture { id, graph, deps })
    }

    /// The capture in progress on this stream: its unique id (never reused in a process) and the
    /// nodes the next captured node will depend on, as integers (for [`CaptureRecord::join`]).
    pub fn capture_point(&self) -> Result<(u64, Vec<usize>), Error> {
        self.capture()
            .map(|c| (c.id, c.deps.iter().map(|d| *d as usize).collect()))
    }
}

impl Stream {
    /// Starts capturing the work of this stream (relaxed mode: other threads may keep making
    /// driver calls meanwhile).
    pub fn begin_capture(&self) -> Result<(), Error> {
        // SAFETY: valid stream of the current context.
        unsafe {
            result::stream::begin_capture(
                self.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(cuda("beginning stream capture"))
    }

    /// Ends the capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<Graph, Error> {
        // SAFETY: valid stream that is capturing.
        let graph = unsafe { result::stream::end_capture(self.0) }
            .map_err(cuda("ending stream capture"))?;
        // SAFETY: `graph` was just captured; no flags.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        let exec = match exec {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: destroys the graph captured above, which nothing else refers to.
                let _ = unsafe { result::graph::destroy(graph) };
                return Err(cuda("instantiating a graph")(e));
            }
        };
        let g = Graph { graph, exec };
        // Upload now, not at the first launch: the upload allocates device memory, and with
        // several ranks in one context that waits for the kernels already running, which may be
        // other ranks' replays waiting for this rank (a deadlock until the timeout). Callers meet
        // the other ranks after this returns and before launching.
        // SAFETY: valid instantiated graph and stream of the current context.
        unsafe { result::graph::upload(g.exec, self.0) }.map_err(cuda("uploading a graph"))?;
        self.synchronize()?;
        Ok(g)
    }
}

impl Graph {
    /// Launches the whole graph on `stream`.
    pub fn launch(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid instantiated graph and stream.
        unsafe { result::graph::launch(self.exec, stream.0) }.map_err(cuda("launching a graph"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: destroys the handles this value owns.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
