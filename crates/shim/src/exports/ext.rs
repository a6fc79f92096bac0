//! flashcomm's own C API (`include/flashcomm.h`, generated from this file by
//! `cargo run -p xtask -- gen-header`). Small on purpose: the version, the routing statistics,
//! the effective configuration, per-communicator quantization settings and what flashcomm knows
//! of a communicator. Every function returns an `ncclResult_t` and runs inside the same panic
//! boundary as the NCCL exports.
//!
//! Owns: the `flashcomm*` exports and their C types and constants.
//! May import: `exports::boundary`, `serve`, `registry`, `group`, `stats`, `init`, `error`,
//! `logging`, `types`.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int};
use std::sync::Arc;

use flashcomm_config::{QuantBits, QuantSettings};
use flashcomm_nccl_sys::{ncclComm_t, ncclResult_t};

use crate::error::Error;
use crate::exports::boundary::guard;
use crate::group;
use crate::logging::Subsys;
use crate::registry::{self, CommState};
use crate::serve;
use crate::stats;
use crate::types::{Collective, CommHandle, Route};

/// flashcomm's version as `major * 10000 + minor * 100 + patch`.
pub const FLASHCOMM_VERSION_CODE: c_int = version_code();

const fn version_code() -> c_int {
    const fn num(s: &str) -> c_int {
        let b = s.as_bytes();
        let mut v = 0;
        let mut i = 0;
        while i < b.len() {
            v = v * 10 + (b[i] - b'0') as c_int;
            i += 1;
        }
        v
    }
    num(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + num(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + num(env!("CARGO_PKG_VERSION_PATCH"))
}

/// Number of routes: the first index of the arrays of `flashcommStats_t`.
pub const FLASHCOMM_NUM_ROUTES: usize = 3;
/// Route index: forwarded to the real NCCL.
pub const FLASHCOMM_ROUTE_NCCL: usize = 0;
/// Route index: flashcomm's lossless kernels.
pub const FLASHCOMM_ROUTE_LOSSLESS: usize = 1;
/// Route index: flashcomm's quantized kernels.
pub const FLASHCOMM_ROUTE_QUANTIZED: usize = 2;

/// Number of collective kinds: the second index of the arrays of `flashcommStats_t`.
pub const FLASHCOMM_NUM_COLLS: usize = 8;
/// Kind index: `ncclAllReduce` (and `ncclAllReduceConfig`).
pub const FLASHCOMM_COLL_ALLREDUCE: usize = 0;
/// Kind index: `ncclReduceScatter`.
pub const FLASHCOMM_COLL_REDUCESCATTER: usize = 1;
/// Kind index: `ncclAllGather`.
pub const FLASHCOMM_COLL_ALLGATHER: usize = 2;
/// Kind index: `ncclAlltoAll`.
pub const FLASHCOMM_COLL_ALLTOALL: usize = 3;
/// Kind index: `ncclBroadcast` and `ncclBcast`.
pub const FLASHCOMM_COLL_BROADCAST: usize = 4;
/// Kind index: `ncclReduce`.
pub const FLASHCOMM_COLL_REDUCE: usize = 5;
/// Kind index: `ncclSend`.
pub const FLASHCOMM_COLL_SEND: usize = 6;
/// Kind index: `ncclRecv`.
pub const FLASHCOMM_COLL_RECV: usize = 7;

const _: () = {
    assert!(FLASHCOMM_NUM_ROUTES == Route::COUNT);
    assert!(FLASHCOMM_NUM_COLLS == Collective::COUNT);
    assert!(FLASHCOMM_ROUTE_NCCL == Route::Nccl as usize);
    assert!(FLASHCOMM_ROUTE_LOSSLESS == Route::Lossless as usize);
    assert!(FLASHCOMM_ROUTE_QUANTIZED == Route::Quantized as usize);
    assert!(FLASHCOMM_COLL_ALLREDUCE == Collective::AllReduce as usize);
    assert!(FLASHCOMM_COLL_REDUCESCATTER == Collective::ReduceScatter as usize);
    assert!(FLASHCOMM_COLL_ALLGATHER == Collective::AllGather as usize);
    assert!(FLASHCOMM_COLL_ALLTOALL == Collective::AlltoAll as usize);
    assert!(FLASHCOMM_COLL_BROADCAST == Collective::Broadcast as usize);
    assert!(FLASHCOMM_COLL_REDUCE == Collective::Reduce as usize);
    assert!(FLASHCOMM_COLL_SEND == Collective::Send as usize);
    assert!(FLASHCOMM_COLL_RECV == Collective::Recv as usize);
};

/// Calls and bytes per route and collective kind, indexed `[FLASHCOMM_ROUTE_*][FLASHCOMM_COLL_*]`.
/// Bytes are `count x element size` as passed to each call (per rank; for all-gather the send
/// count, for reduce-scatter the receive count, for all-to-all the per-peer count). Calls with
/// `count == 0` and calls refused by the argument checks are not counted.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct flashcommStats_t {
    /// Number of calls.
    pub calls: [[u64; FLASHCOMM_NUM_COLLS]; FLASHCOMM_NUM_ROUTES],
    /// Number of bytes.
    pub bytes: [[u64; FLASHCOMM_NUM_COLLS]; FLASHCOMM_NUM_ROUTES],
}

/// Writes flashcomm's own version, `major * 10000 + minor * 100 + patch`, to `*version` (the
/// NCCL version is `ncclGetVersion`'s).
///
/// # Safety
/// `version` is NULL or points to writable memory for one `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommGetVersion(version: *mut c_int) -> ncclResult_t {
    guard("flashcommGetVersion", |_| {
        if version.is_null() {
            return Error::invalid_argument(Subsys::Call, "flashcommGetVersion: version is NULL")
                .report();
        }
        // SAFETY: checked non-null; the caller guarantees it points to a writable int.
        unsafe { version.write(FLASHCOMM_VERSION_CODE) };
        ncclResult_t::ncclSuccess
    })
}

/// Writes the statistics of communicator `comm` to `*stats`, or the process totals (every
/// communicator, destroyed ones included) when `comm` is NULL. A communicator flashcomm did not
/// see created, or that was destroyed, is `ncclInvalidArgument`.
///
/// # Safety
/// `stats` is NULL or points to writable memory for one `flashcommStats_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommGetStats(
    comm: ncclComm_t,
    stats: *mut flashcommStats_t,
) -> ncclResult_t {
    guard("flashcommGetStats", |_| {
        if stats.is_null() {
            return Error::invalid_argument(Subsys::Call, "flashcommGetStats: stats is NULL")
                .report();
        }
        let snap = if comm.is_null() {
            stats::totals()
        } else {
            match registry::get(comm) {
                Some(state) => state.counters.snapshot(),
                None => {
                    return Error::invalid_argument(
                        Subsys::Call,
                        format!(
                            "flashcommGetStats: communicator {comm:p} is not known to flashcomm \
                             (not created through it, or already destroyed)"
                        ),
                    )
                    .report();
                }
            }
        };
        let out = flashcommStats_t {
            calls: snap.calls,
            bytes: snap.bytes,
        };
        // SAFETY: checked non-null; the caller guarantees it points to a writable
        // flashcommStats_t.
        unsafe { stats.write(out) };
        ncclResult_t::ncclSuccess
    })
}

/// Writes the effective configuration as text (`NAME=value` lines, then `passthrough=...`) to
/// `buf`, NUL-terminated, truncated to `len` bytes. Returns `ncclInvalidArgument` when `buf` is
/// NULL or too small (the message of `ncclGetLastError` gives the size needed).
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommGetConfigString(buf: *mut c_char, len: usize) -> ncclResult_t {
    guard("flashcommGetConfigString", |_| {
        let text = crate::init::state().config.describe();
        let need = text.len() + 1;
        if buf.is_null() || len == 0 {
            return Error::invalid_argument(
                Subsys::Call,
                format!("flashcommGetConfigString: no buffer; {need} bytes are needed"),
            )
            .report();
        }
        let n = text.len().min(len - 1);
        // SAFETY: `buf` is non-null and the caller guarantees `len` writable bytes; we write
        // `n + 1 <= len` bytes and the source is a distinct Rust string.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            buf.add(n).write(0);
        }
        if n < text.len() {
            return Error::invalid_argument(
                Subsys::Call,
                format!("flashcommGetConfigString: buffer of {len} bytes is too small; {need} are needed"),
            )
            .report();
        }
        ncclResult_t::ncclSuccess
    })
}

/// Bytes of `flashcommCommInfo_t::reason`, the terminating NUL included.
pub const FLASHCOMM_REASON_BYTES: usize = 256;

/// Quantization settings of one communicator (`flashcommCommSetQuant`, `flashcommCommGetQuant`).
/// Widths are bits per value: 2..8 group-quantize; 16 (or 0 when setting) keeps the collective
/// lossless. `rs_bits` and `ag_bits` are the two steps of the quantized AllReduce: both must
/// quantize for the AllReduce to be quantized; kernels exist for equal widths and for an 8-bit
/// all-gather after a 2-, 3- or 4-bit reduce-scatter, and other pairs send the AllReduce to NCCL.
/// `allgather_bits`, `reducescatter_bits` and `alltoall_bits` are the widths of those
/// collectives (one quantization step each). Which collectives may be quantized at all stays
/// `FLASHCOMM_QUANT_OPS`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct flashcommQuantConfig_t {
    /// Width of the reduce-scatter step (the only step of one-shot): 2..8, or 16 for lossless.
    pub rs_bits: c_int,
    /// Width of the all-gather step: 2..8, or 16 for lossless.
    pub ag_bits: c_int,
    /// Values per quantization group: 32, 64, 128 or 256.
    pub group: c_int,
    /// Extreme values per group kept exactly: 0, 2 or 4.
    pub spikes: c_int,
    /// Smallest message (bytes per rank) that is quantized.
    pub min_bytes: usize,
    /// Largest message (bytes per rank) that is quantized.
    pub max_bytes: usize,
    /// Width of the quantized AllGather: 2..8, or 16 for lossless.
    pub allgather_bits: c_int,
    /// Width of the quantized ReduceScatter: 2..8, or 16 for lossless.
    pub reducescatter_bits: c_int,
    /// Width of the quantized AllToAll: 2..8, or 16 for lossless.
    pub alltoall_bits: c_int,
}

/// What flashcomm knows about one communicator (`flashcommCommGetInfo`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct flashcommCommInfo_t {
    /// 1 when flashcomm's kernels serve the communicator, 0 when every call goes to NCCL.
    pub served: c_int,
    /// This rank (-1 when the real library could not tell).
    pub rank: c_int,
    /// Number of ranks (-1 when the real library could not tell).
    pub nranks: c_int,
    /// CUDA device ordinal (-1 when the real library could not tell).
    pub device: c_int,
    /// Bytes of device memory flashcomm's arena takes on this rank (0 when not served).
    pub arena_bytes: u64,
    /// Why flashcomm does not serve the communicator (empty when it does), NUL-terminated,
    /// truncated to fit.
    pub reason: [c_char; FLASHCOMM_REASON_BYTES],
}

fn known_comm(api: &str, comm: ncclComm_t) -> Result<Arc<CommState>, ncclResult_t> {
    if comm.is_null() {
        return Err(
            Error::invalid_argument(Subsys::Call, format!("{api}: comm argument is NULL")).report(),
        );
    }
    registry::get(comm).ok_or_else(|| {
        Error::invalid_argument(
            Subsys::Call,
            format!(
                "{api}: communicator {comm:p} is not known to flashcomm (not created through it, \
                 or already destroyed)"
            ),
        )
        .report()
    })
}

fn bits_from_c(v: c_int) -> Option<QuantBits> {
    match v {
        0 | 16 => Some(QuantBits::Off),
        2..=8 => Some(QuantBits::Bits(v as u8)),
        _ => None,
    }
}

fn bits_to_c(b: QuantBits) -> c_int {
    match b {
        QuantBits::Bits(n) => c_int::from(n),
        QuantBits::Off | QuantBits::Half => 16,
    }
}

/// The settings of a C struct, or what is wrong with them.
fn settings_from_c(q: &flashcommQuantConfig_t) -> Result<QuantSettings, String> {
    let bits = |name: &str, v: c_int| {
        bits_from_c(v).ok_or_else(|| format!("{name} {v} (allowed: 2..=8, or 16 for lossless)"))
    };
    let settings = QuantSettings {
        rs_bits: bits("rs_bits", q.rs_bits)?,
        ag_bits: bits("ag_bits", q.ag_bits)?,
        allgather_bits: bits("allgather_bits", q.allgather_bits)?,
        reducescatter_bits: bits("reducescatter_bits", q.reducescatter_bits)?,
        alltoall_bits: bits("alltoall_bits", q.alltoall_bits)?,
        group: u32::try_from(q.group).unwrap_or(0),
        spikes: u32::try_from(q.spikes).unwrap_or(u32::MAX),
        min_bytes: q.min_bytes as u64,
        max_bytes: q.max_bytes as u64,
    };
    settings.validate()?;
    Ok(settings)
}

fn settings_to_c(q: &QuantSettings) -> flashcommQuantConfig_t {
    flashcommQuantConfig_t {
        rs_bits: bits_to_c(q.rs_bits),
        ag_bits: bits_to_c(q.ag_bits),
        allgather_bits: bits_to_c(q.allgather_bits),
        reducescatter_bits: bits_to_c(q.reducescatter_bits),
        alltoall_bits: bits_to_c(q.alltoall_bits),
        group: c_int::try_from(q.group).unwrap_or(c_int::MAX),
        spikes: c_int::try_from(q.spikes).unwrap_or(c_int::MAX),
        min_bytes: usize::try_from(q.min_bytes).unwrap_or(usize::MAX),
        max_bytes: usize::try_from(q.max_bytes).unwrap_or(usize::MAX),
    }
}

/// Gives communicator `comm` its own quantization settings, overriding the `FLASHCOMM_QUANT_*`
/// widths, group, spikes and window of the environment for it; `config == NULL` returns it to the
/// environment's. Which collectives and element types may be quantized stays
/// `FLASHCOMM_QUANT_OPS` and `FLASHCOMM_QUANT_DTYPES`.
///
/// Collective: the settings decide where calls go, so on a communicator flashcomm serves with
/// several ranks every rank must call this at the same point of its sequence of calls (no call of
/// `comm` in flight on another thread meanwhile), and the ranks agree on the values before any
/// rank applies them: when every rank gave the same settings they take effect on every rank;
/// otherwise every rank returns `ncclInvalidUsage` (a rank whose own values are invalid,
/// `ncclInvalidArgument`) and nothing changes on any rank. Like an NCCL collective, a thread that
/// drives several ranks (the communicators of `ncclCommInitAll`, which are refused outside a
/// group) calls it for each inside `ncclGroupStart`/`ncclGroupEnd`: the settings are then agreed
/// and take effect when the outermost group ends, which returns the error of a disagreement.
///
/// # Safety
/// `config` is NULL or points to a readable `flashcommQuantConfig_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommCommSetQuant(
    comm: ncclComm_t,
    config: *const flashcommQuantConfig_t,
) -> ncclResult_t {
    guard("flashcommCommSetQuant", |_| {
        let state = match known_comm("flashcommCommSetQuant", comm) {
            Ok(s) => s,
            Err(r) => return r,
        };
        let given = if config.is_null() {
            Ok(None)
        } else {
            // SAFETY: checked non-null; the caller guarantees it points to a readable struct.
            settings_from_c(&unsafe { config.read() }).map(Some)
        };
        if group::depth() > 0 {
            // Agreed when the outermost group ends; an invalid value fails here too.
            group::defer_quant(CommHandle::of(comm), given.clone());
            return match given {
                Ok(_) => ncclResult_t::ncclSuccess,
                Err(why) => Error::invalid_argument(
                    Subsys::Call,
                    format!("flashcommCommSetQuant: invalid {why}; nothing changed"),
                )
                .report(),
            };
        }
        match serve::set_quant(CommHandle::of(comm), &state, given) {
            Ok(()) => ncclResult_t::ncclSuccess,
            Err(e) => e.report(),
        }
    })
}

/// Writes the quantization settings in force for communicator `comm` (its own, or the
/// environment's) to `*config`. Lossless steps read as 16.
///
/// # Safety
/// `config` is NULL or points to writable memory for one `flashcommQuantConfig_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommCommGetQuant(
    comm: ncclComm_t,
    config: *mut flashcommQuantConfig_t,
) -> ncclResult_t {
    guard("flashcommCommGetQuant", |_| {
        if config.is_null() {
            return Error::invalid_argument(Subsys::Call, "flashcommCommGetQuant: config is NULL")
                .report();
        }
        let state = match known_comm("flashcommCommGetQuant", comm) {
            Ok(s) => s,
            Err(r) => return r,
        };
        let q = state.quant_settings(&crate::init::state().config);
        // SAFETY: checked non-null; the caller guarantees it points to a writable struct.
        unsafe { config.write(settings_to_c(&q)) };
        ncclResult_t::ncclSuccess
    })
}

fn info_of(state: &CommState) -> flashcommCommInfo_t {
    let mut info = flashcommCommInfo_t {
        served: 0,
        rank: -1,
        nranks: -1,
        device: -1,
        arena_bytes: 0,
        reason: [0; FLASHCOMM_REASON_BYTES],
    };
    if let Some(id) = state.identity() {
        (info.rank, info.nranks, info.device) = (id.rank, id.nranks, id.device);
    }
    match state.served() {
        Some(c) => {
            info.served = 1;
            info.rank = c_int::try_from(c.rank()).unwrap_or(-1);
            info.nranks = c_int::try_from(c.nranks()).unwrap_or(-1);
            info.device = c.device();
            info.arena_bytes = c.arena_bytes();
        }
        None => {
            let why = state.why_not().unwrap_or_default();
            let mut n = why.len().min(FLASHCOMM_REASON_BYTES - 1);
            while !why.is_char_boundary(n) {
                n -= 1;
            }
            for (d, s) in info.reason.iter_mut().zip(why.as_bytes()[..n].iter()) {
                *d = *s as c_char;
            }
        }
    }
    info
}

/// Writes what flashcomm knows about communicator `comm` to `*info`: whether its kernels serve
/// it, rank, ranks, device, the arena's bytes, and why not when they do not.
///
/// # Safety
/// `info` is NULL or points to writable memory for one `flashcommCommInfo_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommCommGetInfo(
    comm: ncclComm_t,
    info: *mut flashcommCommInfo_t,
) -> ncclResult_t {
    guard("flashcommCommGetInfo", |_| {
        if info.is_null() {
            return Error::invalid_argument(Subsys::Call, "flashcommCommGetInfo: info is NULL")
                .report();
        }
        let state = match known_comm("flashcommCommGetInfo", comm) {
            Ok(s) => s,
            Err(r) => return r,
        };
        let out = info_of(&state);
        // SAFETY: checked non-null; the caller guarantees it points to a writable struct.
        unsafe { info.write(out) };
        ncclResult_t::ncclSuccess
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::registry::Setup;
    use crate::types::CommOrigin;

    fn c(rs: c_int, ag: c_int) -> flashcommQuantConfig_t {
        flashcommQuantConfig_t {
            rs_bits: rs,
            ag_bits: ag,
            group: 128,
            spikes: 2,
            min_bytes: 0,
            max_bytes: 1 << 30,
            allgather_bits: 6,
            reducescatter_bits: 0,
            alltoall_bits: 3,
        }
    }

    #[test]
    fn quant_settings_cross_the_c_boundary() {
        let q = settings_from_c(&c(4, 8)).unwrap();
        assert_eq!(q.widths(), Some((4, 8)));
        let back = settings_to_c(&q);
        assert_eq!(
            (back.rs_bits, back.ag_bits, back.group, back.spikes),
            (4, 8, 128, 2)
        );
        assert_eq!(
            (
                back.allgather_bits,
                back.reducescatter_bits,
                back.alltoall_bits
            ),
            (6, 16, 3)
        );
        assert_eq!(q.op_bits(flashcomm_config::Collective::AlltoAll), Some(3));
        // 16 and 0 mean lossless; lossless reads back as 16.
        for lossless in [0, 16] {
            let q = settings_from_c(&c(lossless, lossless)).unwrap();
            assert_eq!(q.widths(), None);
            assert_eq!(settings_to_c(&q).rs_bits, 16);
        }
        for bad in [
            c(1, 4),
            c(4, 9),
            c(-1, 4),
            flashcommQuantConfig_t {
                group: 100,
                ..c(4, 4)
            },
            flashcommQuantConfig_t {
                alltoall_bits: 9,
                ..c(4, 4)
            },
            flashcommQuantConfig_t {
                allgather_bits: 1,
                ..c(4, 4)
            },
            flashcommQuantConfig_t {
                spikes: 3,
                ..c(4, 4)
            },
            flashcommQuantConfig_t {
                spikes: -2,
                ..c(4, 4)
            },
            flashcommQuantConfig_t {
                min_bytes: 2,
                max_bytes: 1,
                ..c(4, 4)
            },
        ] {
            assert!(settings_from_c(&bad).is_err(), "{bad:?}");
        }
    }

    /// What each rank of a served communicator of two ranks ends up with after every rank
    /// called `flashcommCommSetQuant` (`None`: with NULL) with its own `given[r]`: the call's
    /// outcome on rank `r` (`Ok` with the settings now in force), decided as the export decides
    /// (the values checked, then agreed with the other ranks: `serve::agree_quant`).
    fn set_on_ranks(
        given: &[Option<flashcommQuantConfig_t>],
        config: &flashcomm_config::Config,
    ) -> Vec<Result<QuantSettings, String>> {
        let group = flashcomm_comm::ThreadGroup::new(given.len() as u32, Duration::ZERO);
        let members = group.members();
        std::thread::scope(|s| {
            let hs: Vec<_> = members
                .iter()
                .zip(given)
                .map(|(m, q)| {
                    s.spawn(move || {
                        let mine = q.as_ref().map(settings_from_c).transpose();
                        let mut ag = flashcomm_comm::Agreement::new(m);
                        crate::serve::agree_quant(&mut ag, mine, config)
                            .map(|q| q.unwrap_or_else(|| config.quant_settings()))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Issue 45, item 2: `flashcommCommSetQuant` is per rank, and before, a rank given settings
    /// its peers were not (a width pair without kernels, another size window, widths off) routed
    /// its calls alone: to NCCL while its peers ran flashcomm's kernels and waited for it, an
    /// undetected hang. For every setting a rank can give differently from its peer (each field
    /// of the C struct through valid and invalid values, NULL): either the call fails on every
    /// rank, changing nothing, or every rank's routing decision is the same for every call.
    #[test]
    fn every_rank_routes_alike_whatever_settings_each_rank_gives() {
        use crate::policy::tests::coll;
        use crate::policy::{CommView, decide};
        use flashcomm_nccl_sys::ncclDataType_t;
        let base = flashcommQuantConfig_t {
            rs_bits: 4,
            ag_bits: 4,
            group: 128,
            spikes: 2,
            min_bytes: 0,
            max_bytes: 1 << 30,
            allgather_bits: 4,
            reducescatter_bits: 4,
            alltoall_bits: 4,
        };
        let mut given = vec![None, Some(base)];
        let with = |f: &dyn Fn(&mut flashcommQuantConfig_t)| {
            let mut q = base;
            f(&mut q);
            Some(q)
        };
        for v in [0, 2, 3, 5, 8, 9, 16, -1] {
            given.push(with(&|q| q.rs_bits = v));
            given.push(with(&|q| q.ag_bits = v));
            given.push(with(&|q| q.allgather_bits = v));
            given.push(with(&|q| q.reducescatter_bits = v));
            given.push(with(&|q| q.alltoall_bits = v));
        }
        for v in [32, 64, 100, 256, -1] {
            given.push(with(&|q| q.group = v));
        }
        for v in [0, 1, 4] {
            given.push(with(&|q| q.spikes = v));
        }
        for v in [4096usize, 1 << 20, usize::MAX] {
            given.push(with(&|q| q.min_bytes = v));
            given.push(with(&|q| q.max_bytes = v >> 1));
        }
        given.push(with(&|q| {
            (q.rs_bits, q.ag_bits) = (2, 8);
            q.max_bytes = 1 << 20;
        }));
        let configs = [
            crate::policy::tests::cfg(&[]),
            crate::policy::tests::cfg(&[("FLASHCOMM_QUANT_BITS", "4")]),
            crate::policy::tests::cfg(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                (
                    "FLASHCOMM_QUANT_OPS",
                    "allreduce,reducescatter,allgather,alltoall",
                ),
                ("FLASHCOMM_MAX_BYTES", "1M"),
            ]),
        ];
        let kinds = [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::AlltoAll,
        ];
        let dtypes = [
            ncclDataType_t::ncclBfloat16,
            ncclDataType_t::ncclFloat16,
            ncclDataType_t::ncclFloat32,
        ];
        let sizes = [16u64, 4096, 64 << 10, 2 << 20, 64 << 20];
        let mut checked = 0u64;
        for config in &configs {
            for a in &given {
                for b in &given {
                    let out = set_on_ranks(&[*a, *b], config);
                    assert_eq!(
                        out[0].is_ok(),
                        out[1].is_ok(),
                        "the call fails on one rank only: {a:?} / {b:?}: {out:?}"
                    );
                    // A failed call changes nothing: the environment's settings stay.
                    let view = |r: &Result<QuantSettings, String>| CommView {
                        served: true,
                        nranks: 2,
                        closed: false,
                        quant: r.clone().unwrap_or_else(|_| config.quant_settings()),
                    };
                    let views = [view(&out[0]), view(&out[1])];
                    for kind in kinds {
                        for dt in dtypes {
                            for bytes in sizes {
                                let call = coll(kind, dt, bytes);
                                let d0 = decide(&call, config, Some(&views[0]));
                                let d1 = decide(&call, config, Some(&views[1]));
                                assert_eq!(
                                    d0, d1,
                                    "{kind:?} {dt:?} {bytes} bytes routed apart after \
                                     {a:?} / {b:?}"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100_000, "{checked}");
    }

    #[test]
    fn info_says_why_not_and_truncates() {
        let st = CommState::new(CommOrigin::InitRank, true);
        let i = info_of(&st);
        assert_eq!((i.served, i.rank, i.nranks, i.arena_bytes), (0, -1, -1, 0));
        let text: Vec<u8> = i
            .reason
            .iter()
            .take_while(|&&b| b != 0)
            .map(|&b| b as u8)
            .collect();
        assert!(
            String::from_utf8(text)
                .unwrap()
                .starts_with("set-up pending")
        );

        let st = CommState::new(CommOrigin::InitRank, true);
        st.set_setup(Setup::NotServed("é".repeat(300)));
        let i = info_of(&st);
        assert_eq!(i.reason[FLASHCOMM_REASON_BYTES - 1], 0, "NUL-terminated");
        let text: Vec<u8> = i
            .reason
            .iter()
            .take_while(|&&b| b != 0)
            .map(|&b| b as u8)
            .collect();
        let text = String::from_utf8(text).expect("cut at a character boundary");
        assert_eq!(text.len(), 254);
    }
}
