//! The routing policy: where one collective goes, and the words that explain why.
//!
//! [`decide`] is a pure function of what NCCL requires to match across the ranks of a correct
//! program: the call's collective, count, datatype, operator and per-call configuration, the
//! configuration (agreed at set-up) and what was agreed about the communicator ([`CommView`]).
//! Facts NCCL lets differ between ranks never enter it: where the buffers lie (in place or not),
//! and whether the call is made inside `ncclGroupStart`/`ncclGroupEnd` (a group of one call is
//! the call). So every rank of a correct program takes the same route for the same call (a
//! property test checks every permutation of those facts). It reads no global state, takes
//! no lock and allocates nothing, so it is tested here without a communicator, a GPU or the real
//! library. The rules are in `docs/architecture.md` ("Routing rules").
//!
//! Owns: [`CommView`], [`Decision`], [`Why`], [`NotQuantized`], [`decide`], [`explain`],
//! [`GROUPED_ALLTOALL`] (the name a grouped AllToAll's call carries; the group is `grouped`'s).
//! May import: `types`.

use flashcomm_comm::QuantSpec;
use flashcomm_config::{Config, QuantSettings};
use flashcomm_nccl_sys::{ncclDataType_t, ncclRedOp_t};

use crate::types::{CollCall, Collective, Route};

/// What [`decide`] knows about a communicator: state agreed at set-up (identical on every rank)
/// and its quantization settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CommView {
    /// Whether flashcomm's kernels serve it.
    pub(crate) served: bool,
    /// Its ranks (0 when not served).
    pub(crate) nranks: u64,
    /// Finalized or revoked.
    pub(crate) closed: bool,
    /// Its quantization settings.
    pub(crate) quant: QuantSettings,
}

/// Why an AllReduce that goes to the lossless kernels is not quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotQuantized {
    /// A step's width is `off` or `16`.
    Off,
    /// An all-to-all formed by a Send/Recv group: whether its blocks are contiguous may differ
    /// from rank to rank, and the scattered path is lossless, so the group never quantizes.
    Grouped,
    /// `FLASHCOMM_QUANT_OPS` excludes it.
    OpsExclude,
    /// `FLASHCOMM_QUANT_DTYPES` excludes the element type.
    DtypeExcluded,
    /// Below the quantization window.
    BelowWindow,
    /// Above the quantization window.
    AboveWindow,
    /// A communicator of one rank: nothing crosses a link, so the result is the input, exactly.
    OneRank,
}

/// Why a call goes where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// Bad configuration: every call goes to NCCL.
    PassthroughForced,
    /// `FLASHCOMM_DISABLE`.
    Disabled,
    /// flashcomm's kernels do not implement this kind of collective.
    NotOurs,
    /// The operator is not a sum.
    NotSum,
    /// A reducing collective of an element type other than f32, f16, bf16.
    NotFloat,
    /// The communicator was not created through flashcomm.
    UnknownComm,
    /// flashcomm does not serve the communicator (see its set-up reason).
    NotServed,
    /// Finalized or revoked.
    Closed,
    /// `FLASHCOMM_OPS` excludes the collective.
    OpsExclude,
    /// A per-call `ncclCollConfig_t` was given.
    CollConfig,
    /// Below `FLASHCOMM_MIN_BYTES`.
    BelowMin,
    /// Above `FLASHCOMM_MAX_BYTES` (or too large to address).
    AboveMax,
    /// The quantization widths asked for have no kernels.
    QuantNoKernels,
    /// Quantized.
    Quantized,
    /// Lossless, and why not quantized.
    Lossless(NotQuantized),
}

/// Where a call goes, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The route.
    pub(crate) route: Route,
    /// The reason.
    pub(crate) why: Why,
    /// The codec settings of a quantized call.
    pub(crate) quant: Option<QuantSpec>,
}

impl Decision {
    /// The NCCL route, for this reason.
    pub(crate) fn nccl(why: Why) -> Decision {
        Decision {
            route: Route::Nccl,
            why,
            quant: None,
        }
    }
}

/// The `api` name of the AllToAll a Send/Recv group forms ([`alltoall_of`]).
pub(crate) const GROUPED_ALLTOALL: &str = "ncclSend/ncclRecv group";

/// Where `call` goes. A pure function of the call's collective, count, datatype, operator and
/// per-call configuration, the configuration, and what was agreed about the communicator at
/// set-up (`comm`, `None` for a communicator flashcomm never saw), all identical on every rank of
/// a correct program; never of its buffers' addresses or of the thread's group depth.
///
/// In order: pass-through configuration; the kind (AllReduce, ReduceScatter, AllGather,
/// AllToAll); sum and f32/f16/bf16 for the reducing ones; a communicator flashcomm serves and
/// that is still open; `FLASHCOMM_OPS`; no per-call config; then an AllReduce is quantized when both
/// widths quantize, the type is in `FLASHCOMM_QUANT_DTYPES`, `allreduce` in `FLASHCOMM_QUANT_OPS`
/// and the size in the quantization window (widths without kernels go to NCCL); otherwise the size
/// must lie in `[FLASHCOMM_MIN_BYTES, FLASHCOMM_MAX_BYTES]` for the lossless kernels.
pub(crate) fn decide(call: &CollCall, config: &Config, comm: Option<&CommView>) -> Decision {
    let s = &config.settings;
    if config.passthrough_forced.is_some() {
        return Decision::nccl(Why::PassthroughForced);
    }
    if s.disable {
        return Decision::nccl(Why::Disabled);
    }
    if !Collective::KERNELS.contains(&call.req.coll) {
        return Decision::nccl(Why::NotOurs);
    }
    let op = call.req.coll;
    let dtype = call.req.dtype;
    if call.req.coll.reduces() {
        if call.op != Some(ncclRedOp_t::ncclSum) {
            return Decision::nccl(Why::NotSum);
        }
        if dtype.is_none() {
            return Decision::nccl(Why::NotFloat);
        }
    }
    let Some(view) = comm else {
        return Decision::nccl(Why::UnknownComm);
    };
    if !view.served {
        return Decision::nccl(Why::NotServed);
    }
    if view.closed {
        return Decision::nccl(Why::Closed);
    }
    if !s.ops.contains(&op) {
        return Decision::nccl(Why::OpsExclude);
    }
    if !call.config.is_null() {
        return Decision::nccl(Why::CollConfig);
    }
    if call.bytes.checked_mul(view.nranks.max(1)).is_none() {
        return Decision::nccl(Why::AboveMax);
    }
    // AllReduce: the widths of its two steps; the others: their one step's width.
    let widths = match call.req.coll {
        Collective::AllReduce => view.quant.widths(),
        other => view.quant.op_bits(other).map(|b| (b, b)),
    };
    let not_quantized = match (widths, dtype) {
        (None, _) => NotQuantized::Off,
        (Some(_), _) if view.nranks == 1 => NotQuantized::OneRank,
        (Some(_), _) if !s.quant_ops.contains(&op) => NotQuantized::OpsExclude,
        (Some(_), _) if call.api == GROUPED_ALLTOALL => NotQuantized::Grouped,
        (Some(_), Some(t)) if !s.quant_dtypes.contains(&t) => NotQuantized::DtypeExcluded,
        (Some(_), None) => NotQuantized::DtypeExcluded,
        (Some(_), _) if call.bytes < view.quant.min_bytes => NotQuantized::BelowWindow,
        (Some(_), _) if call.bytes > view.quant.max_bytes => NotQuantized::AboveWindow,
        (Some((rs, ag)), Some(_)) => {
            let q = &view.quant;
            let group = u16::try_from(q.group).unwrap_or(0);
            let spikes = u8::try_from(q.spikes).unwrap_or(u8::MAX);
            return match QuantSpec::new(rs, ag, group, spikes) {
                Ok(spec) => Decision {
                    route: Route::Quantized,
                    why: Why::Quantized,
                    quant: Some(spec),
                },
                Err(_) => Decision::nccl(Why::QuantNoKernels),
            };
        }
    };
    if call.bytes < s.min_bytes.0 {
        return Decision::nccl(Why::BelowMin);
    }
    if call.bytes > s.max_bytes.0 {
        return Decision::nccl(Why::AboveMax);
    }
    Decision {
        route: Route::Lossless,
        why: Why::Lossless(not_quantized),
        quant: None,
    }
}

fn dtype_name(t: ncclDataType_t) -> String {
    match t {
        ncclDataType_t::ncclFloat32 => "f32".into(),
        ncclDataType_t::ncclFloat16 => "f16".into(),
        ncclDataType_t::ncclBfloat16 => "bf16".into(),
        other => format!("datatype {}", other.0),
    }
}

/// Words for the log line of a decision. `comm` is what [`decide`] knew of the communicator
/// (its quantization settings are quoted; `None`: the environment's), `why_not` its set-up
/// reason when flashcomm does not serve it. Allocates: called once per (collective, route) pair
/// of a communicator, never per call.
pub(crate) fn explain(
    d: &Decision,
    call: &CollCall,
    config: &Config,
    comm: Option<&CommView>,
    why_not: Option<&str>,
) -> String {
    let s = &config.settings;
    let bytes = flashcomm_config::Bytes(call.bytes);
    let quant = comm.map_or_else(|| config.quant_settings(), |v| v.quant);
    match d.why {
        Why::PassthroughForced => {
            "the configuration is invalid, so every call goes to NCCL (see the ENV warning)".into()
        }
        Why::Disabled => "FLASHCOMM_DISABLE is set".into(),
        Why::NotOurs => {
            "flashcomm's kernels implement only AllReduce, ReduceScatter, AllGather and AllToAll"
                .into()
        }
        Why::NotSum => format!(
            "reduction operator {} is not ncclSum",
            call.op.map_or(-1, |o| o.0 as i64)
        ),
        Why::NotFloat => format!(
            "{} is not reduced by flashcomm's kernels (f32, f16, bf16 are)",
            dtype_name(call.datatype)
        ),
        Why::UnknownComm => "the communicator was not created through flashcomm".into(),
        Why::NotServed => format!(
            "flashcomm does not serve this communicator: {}",
            why_not.unwrap_or("unknown")
        ),
        Why::Closed => "the communicator was finalized, revoked or is suspended".into(),
        Why::OpsExclude => format!(
            "FLASHCOMM_OPS={} excludes it",
            s.ops
                .0
                .iter()
                .map(|o| o.name())
                .collect::<Vec<_>>()
                .join(",")
        ),
        Why::CollConfig => "a per-call ncclCollConfig_t was given".into(),
        Why::BelowMin => format!("{bytes} bytes is below FLASHCOMM_MIN_BYTES={}", s.min_bytes),
        Why::AboveMax => format!("{bytes} bytes is above FLASHCOMM_MAX_BYTES={}", s.max_bytes),
        Why::QuantNoKernels => format!("quantization {quant} has no kernels"),
        Why::Quantized => format!(
            "{} bytes of {} quantized with {quant}",
            bytes,
            dtype_name(call.datatype)
        ),
        Why::Lossless(nq) => {
            let why_not = match nq {
                NotQuantized::Off => "quantization is off".to_string(),
                NotQuantized::Grouped => {
                    "an all-to-all of Send/Recv calls stays lossless".to_string()
                }
                NotQuantized::OpsExclude => "FLASHCOMM_QUANT_OPS excludes it".to_string(),
                NotQuantized::DtypeExcluded => format!(
                    "FLASHCOMM_QUANT_DTYPES excludes {}",
                    dtype_name(call.datatype)
                ),
                NotQuantized::BelowWindow | NotQuantized::AboveWindow => {
                    format!("outside the quantization window of {quant}")
                }
                NotQuantized::OneRank => {
                    "a one-rank communicator has nothing to send, so the result is exact"
                        .to_string()
                }
            };
            format!(
                "{bytes} bytes within [FLASHCOMM_MIN_BYTES={}, FLASHCOMM_MAX_BYTES={}]; not \
                 quantized: {why_not}",
                s.min_bytes, s.max_bytes
            )
        }
    }
}

/// The codec settings the environment asks of a quantized AllReduce, if it asks for one the
/// kernels take (the settings the calibration times at set-up).
pub(crate) fn allreduce_quant_spec(config: &Config) -> Option<QuantSpec> {
    let s = &config.settings;
    let halves = [flashcomm_config::DType::Bf16, flashcomm_config::DType::F16];
    if !s
        .quant_ops
        .contains(&flashcomm_config::Collective::AllReduce)
        || !halves.iter().any(|t| s.quant_dtypes.contains(t))
    {
        return None;
    }
    let q = config.quant_settings();
    let (rs, ag) = q.widths()?;
    let spec = QuantSpec::new(
        rs,
        ag,
        u16::try_from(q.group).ok()?,
        u8::try_from(q.spikes).ok()?,
    )
    .ok()?;
    spec.has_kernels().then_some(spec)
}

#[cfg(test)]
pub(crate) mod tests {
    //! The decision table, and helpers the registry's and the dispatch's tests share.

    use super::*;
    use flashcomm_comm::{Request, Stream};
    use flashcomm_config::{KIB, MIB};
    use flashcomm_nccl_sys::{ncclCollConfig_t, ncclComm_t};

    pub(crate) fn call(comm: ncclComm_t) -> CollCall {
        CollCall {
            api: "ncclAllReduce",
            req: typed(Collective::AllReduce, 4, ncclDataType_t::ncclFloat32),
            sendbuff: std::ptr::null(),
            recvbuff: std::ptr::null_mut(),
            datatype: ncclDataType_t::ncclFloat32,
            op: Some(ncclRedOp_t::ncclSum),
            comm,
            config: std::ptr::null(),
            bytes: 16,
            root_or_peer: None,
        }
    }

    /// The request of a call of `count` elements of `dtype`, typed as the export types it.
    pub(crate) fn typed(kind: Collective, count: usize, dtype: ncclDataType_t) -> Request<'static> {
        Request::shaped(
            kind,
            count as u64,
            crate::args::flashcomm_type(dtype),
            crate::args::element_size(dtype).unwrap(),
        )
    }

    /// A call of `kind` on `bytes` bytes of `dtype` (sum for the reducing kinds), out of place
    /// for AllToAll.
    pub(crate) fn coll(kind: Collective, dtype: ncclDataType_t, bytes: u64) -> CollCall {
        let elem = crate::args::element_size(dtype).unwrap();
        let recv = if kind == Collective::AlltoAll {
            0x9000usize
        } else {
            0
        };
        CollCall {
            api: "test",
            req: typed(kind, (bytes / elem) as usize, dtype),
            recvbuff: recv as *mut std::ffi::c_void,
            datatype: dtype,
            op: kind.reduces().then_some(ncclRedOp_t::ncclSum),
            bytes,
            ..call(0x7000usize as ncclComm_t)
        }
    }

    pub(crate) fn cfg(vars: &[(&str, &str)]) -> Config {
        Config::from_vars(vars.iter().copied())
    }

    pub(crate) fn served(config: &Config) -> CommView {
        CommView {
            served: true,
            nranks: 4,
            closed: false,
            quant: config.quant_settings(),
        }
    }

    /// The decision for `c` on a served, open, ungrouped communicator with the settings of `vars`.
    pub(crate) fn route_of(vars: &[(&str, &str)], c: &CollCall) -> Decision {
        let config = cfg(vars);
        decide(c, &config, Some(&served(&config)))
    }

    pub(crate) const BF16: ncclDataType_t = ncclDataType_t::ncclBfloat16;
    pub(crate) const F16: ncclDataType_t = ncclDataType_t::ncclFloat16;
    pub(crate) const F32: ncclDataType_t = ncclDataType_t::ncclFloat32;
    pub(crate) const AR: Collective = Collective::AllReduce;
    pub(crate) const RS: Collective = Collective::ReduceScatter;
    pub(crate) const AG: Collective = Collective::AllGather;
    pub(crate) const A2A: Collective = Collective::AlltoAll;

    pub(crate) fn lossless(nq: NotQuantized) -> Decision {
        Decision {
            route: Route::Lossless,
            why: Why::Lossless(nq),
            quant: None,
        }
    }

    pub(crate) fn quantized(rs: u8, ag: u8, group: u16, spikes: u8) -> Decision {
        Decision {
            route: Route::Quantized,
            why: Why::Quantized,
            quant: Some(QuantSpec::new(rs, ag, group, spikes).unwrap()),
        }
    }

    #[test]
    fn eligible_calls_take_the_lossless_kernels_by_default() {
        for kind in [AR, RS, AG] {
            for dt in [BF16, F16, F32] {
                assert_eq!(
                    route_of(&[], &coll(kind, dt, 4096)),
                    lossless(NotQuantized::Off),
                    "{kind:?} {dt:?}"
                );
            }
        }
    }

    #[test]
    fn a_one_rank_communicator_is_never_quantized() {
        let config = cfg(&[("FLASHCOMM_QUANT_BITS", "4")]);
        let mut view = served(&config);
        let call = coll(AR, BF16, 1 << 20);
        assert_eq!(decide(&call, &config, Some(&view)).route, Route::Quantized);
        view.nranks = 1;
        assert_eq!(
            decide(&call, &config, Some(&view)),
            lossless(NotQuantized::OneRank)
        );
    }

    #[test]
    fn alltoall_is_served_of_any_type_in_place_or_not() {
        use Collective::AlltoAll;
        let a2a = |dt| CollCall {
            sendbuff: 0x1000 as *const std::ffi::c_void,
            recvbuff: 0x9000 as *mut std::ffi::c_void,
            ..coll(AlltoAll, dt, 4096)
        };
        for dt in [
            F32,
            BF16,
            ncclDataType_t::ncclInt8,
            ncclDataType_t::ncclUint64,
        ] {
            let d = route_of(&[], &a2a(dt));
            assert_eq!(d.route, Route::Lossless, "{dt:?}");
        }
        // In place as well: NCCL lets one rank pass one buffer and another two (before, the
        // in-place rank went to NCCL and its peers to flashcomm's kernels: a hang).
        let mut c = a2a(BF16);
        c.recvbuff = c.sendbuff.cast_mut();
        assert_eq!(route_of(&[], &c).route, Route::Lossless);
        assert_eq!(
            route_of(&[("FLASHCOMM_OPS", "allreduce")], &a2a(BF16)),
            Decision::nccl(Why::OpsExclude)
        );
    }

    #[test]
    fn other_kinds_operators_and_types_go_to_nccl() {
        use Collective::*;
        for kind in [Broadcast, Reduce, Send, Recv] {
            let d = route_of(&[], &coll(kind, F32, 4096));
            assert_eq!(d, Decision::nccl(Why::NotOurs), "{kind:?}");
        }
        for op in [
            ncclRedOp_t::ncclProd,
            ncclRedOp_t::ncclMax,
            ncclRedOp_t::ncclMin,
            ncclRedOp_t::ncclAvg,
            ncclRedOp_t(8), // a PreMulSum handle
        ] {
            for kind in [AR, RS] {
                let c = CollCall {
                    op: Some(op),
                    ..coll(kind, BF16, 4096)
                };
                assert_eq!(route_of(&[], &c), Decision::nccl(Why::NotSum), "{op:?}");
            }
        }
        for dt in [
            ncclDataType_t::ncclInt8,
            ncclDataType_t::ncclUint8,
            ncclDataType_t::ncclInt32,
            ncclDataType_t::ncclUint32,
            ncclDataType_t::ncclInt64,
            ncclDataType_t::ncclUint64,
            ncclDataType_t::ncclFloat64,
            ncclDataType_t::ncclFloat8e4m3,
            ncclDataType_t::ncclFloat8e5m2,
        ] {
            for kind in [AR, RS] {
                let d = route_of(&[], &coll(kind, dt, 4096));
                assert_eq!(d, Decision::nccl(Why::NotFloat), "{kind:?} {dt:?}");
            }
            // AllGather moves bytes: any type.
            assert_eq!(
                route_of(&[], &coll(AG, dt, 4096)),
                lossless(NotQuantized::Off),
                "{dt:?}"
            );
        }
    }

    #[test]
    fn configuration_can_send_everything_to_nccl() {
        let c = coll(AR, BF16, 4096);
        assert_eq!(
            route_of(&[("FLASHCOMM_DISABLE", "1")], &c),
            Decision::nccl(Why::Disabled)
        );
        assert_eq!(
            route_of(&[("FLASHCOMM_PROTO", "fast")], &c),
            Decision::nccl(Why::PassthroughForced)
        );
        // Pass-through wins over quantization.
        assert_eq!(
            route_of(
                &[("FLASHCOMM_DISABLE", "1"), ("FLASHCOMM_QUANT_BITS", "4")],
                &c
            ),
            Decision::nccl(Why::Disabled)
        );
        let ops = [("FLASHCOMM_OPS", "allgather")];
        assert_eq!(route_of(&ops, &c), Decision::nccl(Why::OpsExclude));
        assert_eq!(
            route_of(&ops, &coll(RS, BF16, 4096)),
            Decision::nccl(Why::OpsExclude)
        );
        assert_eq!(
            route_of(&ops, &coll(AG, BF16, 4096)),
            lossless(NotQuantized::Off)
        );
        for kind in [AR, RS, AG] {
            assert_eq!(
                route_of(&[("FLASHCOMM_OPS", "none")], &coll(kind, BF16, 4096)),
                Decision::nccl(Why::OpsExclude)
            );
        }
        // FLASHCOMM_OPS also gates the quantized kernels.
        assert_eq!(
            route_of(
                &[
                    ("FLASHCOMM_OPS", "allgather"),
                    ("FLASHCOMM_QUANT_BITS", "4")
                ],
                &c
            ),
            Decision::nccl(Why::OpsExclude)
        );
    }

    #[test]
    fn the_communicator_must_be_served_open_and_the_call_plain() {
        let config = cfg(&[("FLASHCOMM_QUANT_BITS", "4")]);
        let c = coll(AR, BF16, 4096);
        let view = served(&config);
        assert_eq!(decide(&c, &config, Some(&view)).route, Route::Quantized);
        assert_eq!(decide(&c, &config, None), Decision::nccl(Why::UnknownComm));
        let not_served = CommView {
            served: false,
            ..view
        };
        assert_eq!(
            decide(&c, &config, Some(&not_served)),
            Decision::nccl(Why::NotServed)
        );
        let closed = CommView {
            closed: true,
            ..view
        };
        assert_eq!(
            decide(&c, &config, Some(&closed)),
            Decision::nccl(Why::Closed)
        );
        let with_config = CollCall {
            config: 0x40usize as *const ncclCollConfig_t,
            ..c
        };
        assert_eq!(
            decide(&with_config, &config, Some(&view)),
            Decision::nccl(Why::CollConfig)
        );
    }

    #[test]
    fn the_lossless_window_bounds_the_bytes_per_rank() {
        let vars = [("FLASHCOMM_MIN_BYTES", "1K"), ("FLASHCOMM_MAX_BYTES", "1M")];
        for kind in [AR, RS, AG] {
            let at = |b: u64| route_of(&vars, &coll(kind, F16, b));
            assert_eq!(at(KIB - 2), Decision::nccl(Why::BelowMin));
            assert_eq!(at(KIB), lossless(NotQuantized::Off));
            assert_eq!(at(MIB), lossless(NotQuantized::Off));
            assert_eq!(at(MIB + 2), Decision::nccl(Why::AboveMax));
        }
        // Sizes that cannot be addressed across the ranks go to NCCL.
        let huge = CollCall {
            bytes: u64::MAX / 2,
            req: typed(AG, usize::MAX / 2, ncclDataType_t::ncclUint8),
            ..coll(AG, ncclDataType_t::ncclUint8, 1)
        };
        assert_eq!(route_of(&[], &huge), Decision::nccl(Why::AboveMax));
    }

    #[test]
    fn quantization_takes_allreduce_of_the_quantized_types() {
        let q4 = [("FLASHCOMM_QUANT_BITS", "4")];
        assert_eq!(
            route_of(&q4, &coll(AR, BF16, 4096)),
            quantized(4, 4, 128, 2)
        );
        assert_eq!(route_of(&q4, &coll(AR, F16, 4096)), quantized(4, 4, 128, 2));
        // f32 is not in the default FLASHCOMM_QUANT_DTYPES: lossless.
        assert_eq!(
            route_of(&q4, &coll(AR, F32, 4096)),
            lossless(NotQuantized::DtypeExcluded)
        );
        // Asked for, f32 is decided quantized; the kernels then refuse it (at run time, on
        // every rank alike) and the call goes to NCCL.
        let f32_too = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_DTYPES", "bf16,f16,f32"),
        ];
        assert_eq!(
            route_of(&f32_too, &coll(AR, F32, 4096)).route,
            Route::Quantized
        );
        let bf16_only = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_DTYPES", "bf16"),
        ];
        assert_eq!(
            route_of(&bf16_only, &coll(AR, F16, 4096)),
            lossless(NotQuantized::DtypeExcluded)
        );
        // AllReduce alone is quantized by default.
        for kind in [RS, AG, A2A] {
            assert_eq!(
                route_of(&q4, &coll(kind, BF16, 4096)),
                lossless(NotQuantized::OpsExclude)
            );
        }
        // The others once listed, each at its own width (FLASHCOMM_QUANT_BITS by default).
        let all_ops = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_ALLTOALL_BITS", "8"),
            ("FLASHCOMM_QUANT_REDUCESCATTER_BITS", "16"),
            (
                "FLASHCOMM_QUANT_OPS",
                "allreduce,reducescatter,allgather,alltoall",
            ),
        ];
        assert_eq!(
            route_of(&all_ops, &coll(AG, BF16, 4096)),
            quantized(4, 4, 128, 2)
        );
        assert_eq!(
            route_of(&all_ops, &coll(A2A, F16, 4096)),
            quantized(8, 8, 128, 2)
        );
        assert_eq!(
            route_of(&all_ops, &coll(RS, BF16, 4096)),
            lossless(NotQuantized::Off)
        );
        // A lossless AllGather of integers stays lossless; an f32 one is excluded by type.
        assert_eq!(
            route_of(&all_ops, &coll(AG, ncclDataType_t::ncclInt32, 4096)),
            lossless(NotQuantized::DtypeExcluded)
        );
        assert_eq!(
            route_of(&all_ops, &coll(AG, F32, 4096)),
            lossless(NotQuantized::DtypeExcluded)
        );
        // A Send/Recv group's all-to-all never quantizes (its layout may differ across ranks).
        let grouped = CollCall {
            api: GROUPED_ALLTOALL,
            ..coll(A2A, BF16, 4096)
        };
        assert_eq!(
            route_of(&all_ops, &grouped),
            lossless(NotQuantized::Grouped)
        );
        let rs_only = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_OPS", "reducescatter"),
        ];
        assert_eq!(
            route_of(&rs_only, &coll(AR, BF16, 4096)),
            lossless(NotQuantized::OpsExclude)
        );
        // Group and spikes come from the configuration.
        let g = [
            ("FLASHCOMM_QUANT_BITS", "3"),
            ("FLASHCOMM_QUANT_GROUP", "32"),
            ("FLASHCOMM_QUANT_SPIKES", "4"),
        ];
        assert_eq!(route_of(&g, &coll(AR, BF16, 4096)), quantized(3, 3, 32, 4));
    }

    #[test]
    fn quantization_widths_per_step() {
        let at = |vars: &[(&str, &str)]| route_of(vars, &coll(AR, BF16, 1 << 20));
        for off in ["off", "16"] {
            assert_eq!(
                at(&[("FLASHCOMM_QUANT_BITS", off)]),
                lossless(NotQuantized::Off)
            );
            assert_eq!(
                at(&[
                    ("FLASHCOMM_QUANT_BITS", "4"),
                    ("FLASHCOMM_QUANT_AG_BITS", off)
                ]),
                lossless(NotQuantized::Off)
            );
        }
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ]),
            quantized(4, 8, 128, 2)
        );
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_RS_BITS", "2"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ]),
            quantized(2, 8, 128, 2)
        );
        // Widths without kernels go to NCCL (decided from the configuration alone).
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_QUANT_AG_BITS", "6")
            ]),
            Decision::nccl(Why::QuantNoKernels)
        );
        // 5/8 is a valid codec pair; the communicator refuses it at run time (no kernels).
        assert_eq!(
            at(&[
                ("FLASHCOMM_QUANT_BITS", "5"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ])
            .route,
            Route::Quantized
        );
    }

    #[test]
    fn the_quantization_window_is_separate_from_the_lossless_one() {
        let vars = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_MIN_BYTES", "64K"),
            ("FLASHCOMM_QUANT_MAX_BYTES", "16M"),
            ("FLASHCOMM_MAX_BYTES", "1M"),
        ];
        let at = |b: u64| route_of(&vars, &coll(AR, BF16, b));
        assert_eq!(at(64 * KIB - 2), lossless(NotQuantized::BelowWindow));
        assert_eq!(at(64 * KIB), quantized(4, 4, 128, 2));
        // Above the lossless window but inside the quantized one: quantized.
        assert_eq!(at(8 * MIB), quantized(4, 4, 128, 2));
        assert_eq!(at(16 * MIB), quantized(4, 4, 128, 2));
        // Above both.
        assert_eq!(at(16 * MIB + 2), Decision::nccl(Why::AboveMax));
        let vars = [
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_MAX_BYTES", "1M"),
        ];
        assert_eq!(
            route_of(&vars, &coll(AR, BF16, 4 * MIB)),
            lossless(NotQuantized::AboveWindow)
        );
    }

    /// Fault class 6: the route is identical under every permutation of the facts NCCL does not
    /// require to match across ranks: where the buffers lie (distinct, in place, NCCL's in-place
    /// layouts of ReduceScatter and AllGather at any rank, odd addresses), the stream, and
    /// whether the call is made inside a group (a group of one call is the call). Before, an
    /// in-place AllToAll and a grouped call went to NCCL while their peers' ungrouped
    /// out-of-place twins went to flashcomm's kernels (a hang).
    #[test]
    fn the_route_is_the_same_under_every_fact_nccl_lets_differ() {
        let configs = [
            cfg(&[]),
            cfg(&[("FLASHCOMM_QUANT_BITS", "4")]),
            cfg(&[
                ("FLASHCOMM_QUANT_BITS", "3"),
                (
                    "FLASHCOMM_QUANT_OPS",
                    "allreduce,alltoall,allgather,reducescatter",
                ),
                ("FLASHCOMM_QUANT_MIN_BYTES", "2K"),
            ]),
            cfg(&[("FLASHCOMM_MIN_BYTES", "1K"), ("FLASHCOMM_MAX_BYTES", "1M")]),
            cfg(&[("FLASHCOMM_OPS", "allreduce,alltoall")]),
        ];
        let kinds = [AR, RS, AG, A2A, Collective::Broadcast, Collective::Reduce];
        let dtypes = [
            F32,
            F16,
            BF16,
            ncclDataType_t::ncclInt8,
            ncclDataType_t::ncclUint64,
        ];
        let counts: [usize; 4] = [1, 1000, 1 << 20, usize::MAX / 16];
        let ops = [
            ncclRedOp_t::ncclSum,
            ncclRedOp_t::ncclMax,
            ncclRedOp_t(ncclRedOp_t::ncclNumOps.0 + 3),
        ];
        let mut checked = 0u64;
        for config in &configs {
            let base = served(config);
            let mut views = vec![None];
            for nranks in [1u64, 2, 4, 8] {
                views.push(Some(CommView { nranks, ..base }));
            }
            views.push(Some(CommView {
                served: false,
                nranks: 0,
                ..base
            }));
            views.push(Some(CommView {
                closed: true,
                ..base
            }));
            for view in &views {
                let n = view.map_or(4, |v| v.nranks.max(1));
                for &kind in &kinds {
                    for &dt in &dtypes {
                        let elem = crate::args::element_size(dt).unwrap();
                        for &count in &counts {
                            for op in ops {
                                for coll_config in [0usize, 0x40] {
                                    let core = CollCall {
                                        api: "ncclTest",
                                        req: typed(kind, count, dt),
                                        datatype: dt,
                                        op: kind.reduces().then_some(op),
                                        config: coll_config as *const ncclCollConfig_t,
                                        bytes: count as u64 * elem,
                                        ..call(0x7000usize as ncclComm_t)
                                    };
                                    let first = decide(&core, config, view.as_ref());
                                    for local in rank_local_facts(&core, n) {
                                        // A group of one call is the call: the depth is not an
                                        // input of the decision at all.
                                        assert_eq!(
                                            decide(&local, config, view.as_ref()),
                                            first,
                                            "{kind:?} {dt:?} count {count} op {op:?} view \
                                             {view:?}: {local:?}"
                                        );
                                        checked += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100_000, "{checked}");
    }

    /// The same call as rank after rank of `n` may make it: buffers anywhere (apart, in place,
    /// in NCCL's in-place layouts at every rank, odd addresses, at the top of the address
    /// space), on any stream.
    fn rank_local_facts(core: &CollCall, n: u64) -> Vec<CollCall> {
        let mut out = Vec::new();
        let per_rank = core.bytes;
        for stream in [0usize, 0x5000] {
            let with = |send: u64, recv: u64| CollCall {
                sendbuff: send as usize as *const std::ffi::c_void,
                recvbuff: recv as usize as *mut std::ffi::c_void,
                req: Request {
                    stream: Stream(stream as *mut _),
                    ..core.req
                },
                ..*core
            };
            out.push(with(0x1000_0000, 0x9000_0000));
            out.push(with(0x1000_0000, 0x1000_0000));
            out.push(with(0x1000_0001, 0x2000_0003));
            out.push(with(u64::MAX - 15, 0x10));
            for r in 0..n {
                let at = r.saturating_mul(per_rank);
                // ReduceScatter: recvbuff inside sendbuff; AllGather: sendbuff inside recvbuff.
                out.push(with(0x4000_0000, 0x4000_0000u64.saturating_add(at)));
                out.push(with(0x4000_0000u64.saturating_add(at), 0x4000_0000));
            }
        }
        out
    }
}
