//! What flashcomm reads from the arguments of a collective export before anything else happens:
//! whether the call is one flashcomm could route at all.
//!
//! flashcomm is an interposer: its own checks guard only what it serves. A call it cannot route
//! (no communicator, a datatype or operator its kernels do not know, nothing to move, a size that
//! overflows) goes to the real NCCL untouched, uncounted, and the real library's answer is the
//! answer, so a program cannot tell flashcomm is there: the same code, the same
//! `ncclGetLastError`, the same treatment inside a group, and datatypes or operators of a newer
//! real library reach it unchanged. Everything else ([`Checked::Routed`]) goes through the router,
//! which forwards it too unless flashcomm serves the communicator; only then do flashcomm's own
//! checks apply (`CollCall::null_buffer`, `serve::execute`).
//!
//! The call is typed here, once: its element size, its size in bytes and flashcomm's element
//! type ([`flashcomm_type`]), from which the export builds the call's one value (`CollCall`, with
//! flashcomm's `Request` inside); everything after reads them from the call.
//!
//! Owns: [`Args`], [`Checked`], [`check`], [`element_size`], [`flashcomm_type`].
//! May import: `types`.

use std::ffi::c_void;

use flashcomm_nccl_sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};

use crate::types::{Collective, DataType};

/// The arguments to check.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Args {
    /// The export's name.
    pub(crate) api: &'static str,
    /// Its kind.
    pub(crate) kind: Collective,
    /// Send buffer (`ncclBcast`'s only buffer; null where the kind has none).
    pub(crate) sendbuff: *const c_void,
    /// Receive buffer (null where the kind has none).
    pub(crate) recvbuff: *mut c_void,
    /// Element count.
    pub(crate) count: usize,
    /// Element type.
    pub(crate) datatype: ncclDataType_t,
    /// Operator of reducing kinds.
    pub(crate) op: Option<ncclRedOp_t>,
    /// Communicator.
    pub(crate) comm: ncclComm_t,
}

/// What the checks found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checked {
    /// Not a call flashcomm routes: it goes to the real library as it is, and the real library's
    /// answer is the answer.
    Forward,
    /// A call the router decides: its element size, `count` x element size bytes (per rank),
    /// and flashcomm's element type where it has one.
    Routed {
        /// Bytes of one element.
        elem: u64,
        /// Bytes per rank.
        bytes: u64,
        /// flashcomm's element type ([`flashcomm_type`]).
        dtype: Option<DataType>,
    },
}

/// Size of one element, for a datatype below `ncclNumTypes`.
pub(crate) fn element_size(datatype: ncclDataType_t) -> Option<u64> {
    Some(match datatype {
        ncclDataType_t::ncclInt8
        | ncclDataType_t::ncclUint8
        | ncclDataType_t::ncclFloat8e4m3
        | ncclDataType_t::ncclFloat8e5m2 => 1,
        ncclDataType_t::ncclFloat16 | ncclDataType_t::ncclBfloat16 => 2,
        ncclDataType_t::ncclInt32 | ncclDataType_t::ncclUint32 | ncclDataType_t::ncclFloat32 => 4,
        ncclDataType_t::ncclInt64 | ncclDataType_t::ncclUint64 | ncclDataType_t::ncclFloat64 => 8,
        _ => return None,
    })
}

/// flashcomm's element type of an NCCL datatype: the types its reducing kernels take.
pub(crate) fn flashcomm_type(t: ncclDataType_t) -> Option<DataType> {
    match t {
        ncclDataType_t::ncclFloat32 => Some(DataType::F32),
        ncclDataType_t::ncclFloat16 => Some(DataType::F16),
        ncclDataType_t::ncclBfloat16 => Some(DataType::Bf16),
        _ => None,
    }
}

/// Classifies one collective call. Pure: a few comparisons, no allocation.
///
/// Forwarded as they are: a NULL communicator, a datatype outside the pinned header's
/// `0..ncclNumTypes` (a newer real library may know it), an operator above `ncclMaxRedOp` (a
/// negative one), `count == 0`, and a byte size that overflows. Operators `>= ncclNumOps` are
/// `ncclRedOpCreatePreMulSum` handles: routed (the router sends them to NCCL, which knows
/// whether the handle belongs to the communicator).
#[inline]
pub(crate) fn check(a: &Args) -> Checked {
    if a.comm.is_null() || a.count == 0 {
        return Checked::Forward;
    }
    let Some(size) = element_size(a.datatype) else {
        return Checked::Forward;
    };
    if let Some(op) = a.op
        && op.0 > ncclRedOp_t::ncclMaxRedOp.0
    {
        return Checked::Forward;
    }
    match (a.count as u64).checked_mul(size) {
        Some(bytes) => Checked::Routed {
            elem: size,
            bytes,
            dtype: flashcomm_type(a.datatype),
        },
        None => Checked::Forward,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten bf16 elements.
    const BF16_20: Checked = Checked::Routed {
        elem: 2,
        bytes: 20,
        dtype: Some(DataType::Bf16),
    };

    fn args() -> Args {
        Args {
            api: "ncclAllReduce",
            kind: Collective::AllReduce,
            sendbuff: 0x1000 as *const c_void,
            recvbuff: 0x2000 as *mut c_void,
            count: 10,
            datatype: ncclDataType_t::ncclBfloat16,
            op: Some(ncclRedOp_t::ncclSum),
            comm: 0x3000 as ncclComm_t,
        }
    }

    #[test]
    fn good_call() {
        assert_eq!(check(&args()), BF16_20);
    }

    #[test]
    fn a_null_communicator_is_the_real_librarys_to_answer() {
        let a = Args {
            comm: std::ptr::null_mut(),
            ..args()
        };
        assert_eq!(check(&a), Checked::Forward);
    }

    #[test]
    fn datatypes_past_the_pinned_header_are_forwarded() {
        for dt in [
            ncclDataType_t::ncclNumTypes,
            ncclDataType_t(u32::MAX),
            ncclDataType_t(1000),
            ncclDataType_t(i32::MAX as u32),
        ] {
            let a = Args {
                datatype: dt,
                ..args()
            };
            assert_eq!(check(&a), Checked::Forward, "{}", dt.0);
        }
        for dt in 0..ncclDataType_t::ncclNumTypes.0 {
            let a = Args {
                datatype: ncclDataType_t(dt),
                ..args()
            };
            assert!(matches!(check(&a), Checked::Routed { .. }), "{dt}");
        }
    }

    #[test]
    fn operators() {
        // PreMulSum handles (>= ncclNumOps) are routed (to NCCL, by the router).
        for op in [0, 4, 5, 6, 1000, i32::MAX as u32] {
            let a = Args {
                op: Some(ncclRedOp_t(op)),
                ..args()
            };
            assert_eq!(check(&a), BF16_20, "{op}");
        }
        // Negative values (above ncclMaxRedOp as unsigned) are the real library's to answer.
        for op in [-1i32, -5, i32::MIN] {
            let a = Args {
                op: Some(ncclRedOp_t(op as u32)),
                ..args()
            };
            assert_eq!(check(&a), Checked::Forward, "{op}");
        }
    }

    #[test]
    fn zero_count_is_forwarded_whatever_the_buffers() {
        let a = Args {
            count: 0,
            sendbuff: std::ptr::null(),
            recvbuff: std::ptr::null_mut(),
            ..args()
        };
        assert_eq!(check(&a), Checked::Forward);
    }

    #[test]
    fn null_buffers_are_routed_and_overflows_forwarded() {
        // Buffers matter only where flashcomm serves the call (`CollCall::null_buffer`).
        let a = Args {
            sendbuff: std::ptr::null(),
            recvbuff: std::ptr::null_mut(),
            ..args()
        };
        assert_eq!(check(&a), BF16_20);
        let a = Args {
            count: usize::MAX,
            datatype: ncclDataType_t::ncclFloat64,
            ..args()
        };
        assert_eq!(check(&a), Checked::Forward);
        let a = Args {
            count: usize::MAX,
            datatype: ncclDataType_t::ncclUint8,
            ..args()
        };
        assert_eq!(
            check(&a),
            Checked::Routed {
                elem: 1,
                bytes: u64::MAX,
                dtype: None
            }
        );
    }

    #[test]
    fn element_sizes() {
        assert_eq!(element_size(ncclDataType_t::ncclFloat64), Some(8));
        assert_eq!(element_size(ncclDataType_t::ncclFloat8e5m2), Some(1));
        assert_eq!(element_size(ncclDataType_t::ncclNumTypes), None);
    }
}
