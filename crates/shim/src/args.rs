//! Argument checks of the collective exports, before anything else happens.
//!
//! Order: communicator, datatype, operator, then `count == 0` (a successful no-op, as in NCCL),
//! then buffers. Each failure is `ncclInvalidArgument` with a message naming the export and the
//! bad value. What depends on the communicator (root and peer ranges, whether this rank is the
//! root, whether a PreMulSum operator belongs to this communicator) is left to the real library,
//! which checks it with the same codes.
//!
//! Owns: [`Args`], [`Checked`], [`check`], [`element_size`].
//! May import: `error`, `logging`, `types`.

use std::ffi::c_void;

use flashcomm_nccl_sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};

use crate::error::Error;
use crate::logging::Subsys;
use crate::types::Collective;

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
    /// Nothing to do (`count == 0`): return `ncclSuccess` at once.
    Empty,
    /// A real call of this many bytes (`count` x element size).
    Bytes(u64),
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

/// Which buffers must be non-null when `count > 0`. A buffer that is only used on the root
/// (broadcast's send buffer, reduce's receive buffer) may be null elsewhere, and only the real
/// library knows this rank, so those are left to it.
fn required_buffers(kind: Collective) -> (bool, bool) {
    match kind {
        Collective::AllReduce
        | Collective::ReduceScatter
        | Collective::AllGather
        | Collective::AlltoAll => (true, true),
        Collective::Broadcast => (false, true),
        Collective::Reduce => (true, false),
        Collective::Send => (true, false),
        Collective::Recv => (false, true),
    }
}

/// Checks one collective call.
pub(crate) fn check(a: &Args) -> Result<Checked, Error> {
    let sub = Subsys::of(a.kind);
    if a.comm.is_null() {
        return Err(Error::invalid_argument(
            sub,
            format!("{}: comm argument is NULL", a.api),
        ));
    }
    let Some(size) = element_size(a.datatype) else {
        return Err(Error::invalid_argument(
            sub,
            format!(
                "{}: invalid datatype {} (valid: 0..={})",
                a.api,
                a.datatype.0 as i32,
                ncclDataType_t::ncclNumTypes.0 - 1
            ),
        ));
    };
    if let Some(op) = a.op
        && op.0 > ncclRedOp_t::ncclMaxRedOp.0
    {
        return Err(Error::invalid_argument(
            sub,
            format!(
                "{}: invalid reduction operation {} (valid: 0..={} built in, or a handle from \
                 ncclRedOpCreatePreMulSum up to ncclMaxRedOp)",
                a.api,
                op.0 as i32,
                ncclRedOp_t::ncclNumOps.0 - 1
            ),
        ));
    }
    if a.count == 0 {
        return Ok(Checked::Empty);
    }
    let (need_send, need_recv) = required_buffers(a.kind);
    if need_send && a.sendbuff.is_null() {
        return Err(Error::invalid_argument(
            sub,
            format!("{}: sendbuff is NULL with count {}", a.api, a.count),
        ));
    }
    if need_recv && a.recvbuff.is_null() {
        return Err(Error::invalid_argument(
            sub,
            format!("{}: recvbuff is NULL with count {}", a.api, a.count),
        ));
    }
    let bytes = (a.count as u64).checked_mul(size).ok_or_else(|| {
        Error::invalid_argument(
            sub,
            format!(
                "{}: count {} of datatype {} overflows",
                a.api, a.count, a.datatype.0
            ),
        )
    })?;
    Ok(Checked::Bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

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
        assert_eq!(check(&args()), Ok(Checked::Bytes(20)));
    }

    #[test]
    fn null_comm_first() {
        let e = check(&Args {
            comm: std::ptr::null_mut(),
            datatype: ncclDataType_t(99),
            ..args()
        })
        .unwrap_err();
        assert_eq!(e.kind(), Kind::InvalidArgument);
        assert_eq!(e.message(), "ncclAllReduce: comm argument is NULL");
    }

    #[test]
    fn datatypes() {
        for dt in [
            ncclDataType_t::ncclNumTypes,
            ncclDataType_t(u32::MAX),
            ncclDataType_t(1000),
        ] {
            let e = check(&Args {
                datatype: dt,
                ..args()
            })
            .unwrap_err();
            assert!(e.message().contains("invalid datatype"), "{}", e.message());
        }
        assert!(
            check(&Args {
                datatype: ncclDataType_t(u32::MAX),
                ..args()
            })
            .unwrap_err()
            .message()
            .contains("datatype -1")
        );
        for dt in 0..ncclDataType_t::ncclNumTypes.0 {
            assert!(
                check(&Args {
                    datatype: ncclDataType_t(dt),
                    ..args()
                })
                .is_ok(),
                "{dt}"
            );
        }
    }

    #[test]
    fn operators() {
        // PreMulSum handles (>= ncclNumOps) are legal and forwarded.
        for op in [0, 4, 5, 6, 1000, i32::MAX as u32] {
            assert!(
                check(&Args {
                    op: Some(ncclRedOp_t(op)),
                    ..args()
                })
                .is_ok(),
                "{op}"
            );
        }
        // Negative values (above ncclMaxRedOp as unsigned) are not.
        let e = check(&Args {
            op: Some(ncclRedOp_t(-1i32 as u32)),
            ..args()
        })
        .unwrap_err();
        assert!(
            e.message().contains("invalid reduction operation -1"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn zero_count_is_empty_even_with_null_buffers() {
        let a = Args {
            count: 0,
            sendbuff: std::ptr::null(),
            recvbuff: std::ptr::null_mut(),
            ..args()
        };
        assert_eq!(check(&a), Ok(Checked::Empty));
    }

    #[test]
    fn null_buffers() {
        let e = check(&Args {
            sendbuff: std::ptr::null(),
            ..args()
        })
        .unwrap_err();
        assert_eq!(e.message(), "ncclAllReduce: sendbuff is NULL with count 10");
        let e = check(&Args {
            recvbuff: std::ptr::null_mut(),
            ..args()
        })
        .unwrap_err();
        assert_eq!(e.message(), "ncclAllReduce: recvbuff is NULL with count 10");
        // Root-only buffers are the real library's to check.
        let b = Args {
            kind: Collective::Broadcast,
            op: None,
            sendbuff: std::ptr::null(),
            ..args()
        };
        assert!(check(&b).is_ok());
        let r = Args {
            kind: Collective::Reduce,
            recvbuff: std::ptr::null_mut(),
            ..args()
        };
        assert!(check(&r).is_ok());
        let s = Args {
            kind: Collective::Send,
            op: None,
            recvbuff: std::ptr::null_mut(),
            ..args()
        };
        assert!(check(&s).is_ok());
        let v = Args {
            kind: Collective::Recv,
            op: None,
            sendbuff: std::ptr::null(),
            ..args()
        };
        assert!(check(&v).is_ok());
    }

    #[test]
    fn element_sizes() {
        assert_eq!(element_size(ncclDataType_t::ncclFloat64), Some(8));
        assert_eq!(element_size(ncclDataType_t::ncclFloat8e5m2), Some(1));
        assert_eq!(element_size(ncclDataType_t::ncclNumTypes), None);
    }
}
