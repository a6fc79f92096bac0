//! One collective call, typed once: what [`Communicator::plan`](crate::Communicator::plan)
//! plans and [`Communicator::execute`](crate::Communicator::execute) runs. The caller builds it
//! right after checking its arguments; nothing after re-derives the element type or the size.

use crate::gpu::{DevicePtr, Stream};
use crate::plan::{Collective, DataType, Plan, QuantSpec};

/// Where a call's data lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers<'a> {
    /// One send and one receive range, laid out as NCCL lays out the collective.
    Contiguous {
        /// The send buffer.
        send: DevicePtr,
        /// The receive buffer.
        recv: DevicePtr,
    },
    /// An AllToAll whose blocks lie anywhere (what a group of `ncclSend`/`ncclRecv` with one
    /// buffer per peer is): `send[q]` goes to rank q, `recv[r]` receives what rank r sent.
    Scattered {
        /// One block per peer, in rank order.
        send: &'a [DevicePtr],
        /// One block per peer, in rank order.
        recv: &'a [DevicePtr],
    },
}

/// One collective call: the collective, its element type (or only its size, for AllGather and
/// AllToAll of any datatype), the count, the buffers, the stream and the quantization asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// The collective.
    pub coll: Collective,
    /// Elements per rank: AllReduce `count`, ReduceScatter `recvcount`, AllGather `sendcount`,
    /// AllToAll `count` per peer.
    pub count: u64,
    /// flashcomm's element type; `None` for a datatype flashcomm has no type for, which only
    /// AllGather and AllToAll take (they move bytes).
    pub dtype: Option<DataType>,
    /// Bytes per element.
    pub elem: u64,
    /// The data.
    pub buffers: Buffers<'a>,
    /// The stream the call is enqueued on.
    pub stream: Stream,
    /// The codec settings of a call asked to be quantized.
    pub quant: Option<QuantSpec>,
    /// For an AllReduce asked to be quantized: whether the lossless kernels may run instead
    /// where quantizing does not pay (the communicator's [`QuantChoice`](crate::QuantChoice)
    /// decides). `false` keeps the quantized plan, as asked.
    pub lossless_allowed: bool,
}

impl<'a> Request<'a> {
    /// A call of `count` elements of type `dtype`, not yet given buffers (planning needs none).
    pub fn typed(coll: Collective, count: u64, dtype: DataType) -> Request<'a> {
        Request::shaped(coll, count, Some(dtype), dtype.bytes())
    }

    /// A call of `count` elements of `elem` bytes of a type flashcomm does not know (AllGather
    /// and AllToAll move bytes).
    pub fn bytes(coll: Collective, count: u64, elem: u64) -> Request<'a> {
        Request::shaped(coll, count, None, elem)
    }

    /// A call of `count` elements of `elem` bytes, of type `dtype` where flashcomm has one.
    pub fn shaped(coll: Collective, count: u64, dtype: Option<DataType>, elem: u64) -> Request<'a> {
        Request {
            coll,
            count,
            dtype,
            elem,
            buffers: Buffers::Contiguous {
                send: DevicePtr::empty(),
                recv: DevicePtr::empty(),
            },
            stream: Stream::null(),
            quant: None,
            lossless_allowed: false,
        }
    }

    /// A call of plan `p`'s collective and codec settings, for
    /// [`Communicator::execute_plan`](crate::Communicator::execute_plan).
    pub fn for_plan(p: &Plan, count: u64, dtype: Option<DataType>, elem: u64) -> Request<'a> {
        Request {
            quant: p.quant,
            ..Request::shaped(p.coll, count, dtype, elem)
        }
    }

    /// The call reads `send` and writes `recv`.
    pub fn between(self, send: DevicePtr, recv: DevicePtr) -> Request<'a> {
        Request {
            buffers: Buffers::Contiguous { send, recv },
            ..self
        }
    }

    /// The call's blocks lie anywhere: one per peer in `send` and in `recv` (AllToAll).
    pub fn scattered(self, send: &'a [DevicePtr], recv: &'a [DevicePtr]) -> Request<'a> {
        Request {
            buffers: Buffers::Scattered { send, recv },
            ..self
        }
    }

    /// The call is enqueued on `stream`.
    pub fn on(self, stream: Stream) -> Request<'a> {
        Request { stream, ..self }
    }

    /// The call is asked to be quantized with `q`; `lossless_allowed` as
    /// [`Request::lossless_allowed`] says.
    pub fn quantized(self, q: QuantSpec, lossless_allowed: bool) -> Request<'a> {
        Request {
            quant: Some(q),
            lossless_allowed,
            ..self
        }
    }
}
