//! Engagement made visible: one line per process that says flashcomm is on, and a one-line
//! summary at exit when flashcomm forwarded calls it could have served.
//!
//! An interposer that fails silently looks exactly like one that works, so:
//!
//! * **The engagement line**, once per process, when the first communicator's set-up finished
//!   (`serve::finish` calls [`on_set_up`]): flashcomm's version, the real NCCL it forwards to and
//!   where it was found, whether that communicator is served by flashcomm's kernels (or why
//!   not), and what the configuration lets the kernels take. It is written under the target
//!   `flashcomm::engage` at INFO, which is shown from `NCCL_DEBUG=VERSION` up (like NCCL's own
//!   version line) and always when a quantization width (`FLASHCOMM_QUANT_BITS`,
//!   `FLASHCOMM_QUANT_RS_BITS`, `FLASHCOMM_QUANT_AG_BITS`) is set, whatever `NCCL_DEBUG` says
//!   (`logging::install` widens its filter for it). `FLASHCOMM_LOG` replaces all of
//!   this with its own directives.
//! * **The exit summary**: every call `dispatch::run` sent to NCCL is classified by [`on_routed`]; a
//!   call of a kind, operator and type flashcomm's kernels take that went to NCCL anyway
//!   ("could have been served": the communicator is not served, the call was grouped, outside
//!   the size window, refused by the kernels, a bad configuration, ...) is counted by reason.
//!   Calls the user kept from the kernels on purpose (`FLASHCOMM_DISABLE`, `FLASHCOMM_OPS`) are
//!   not. At exit (a C `atexit` handler registered with the engagement line), if any such call
//!   was counted, one line gives the calls per route and collective and the reasons: at INFO
//!   under `flashcomm::engage` when flashcomm's kernels took some calls, at WARN when they took
//!   none (the silent failure this module exists for). A fork child writes its own line and
//!   summary when it sets up a communicator of its own (its counts start from its parent's at the
//!   fork, as its memory does), nothing otherwise.
//!
//! Owns: the engagement line, the count of forwarded calls flashcomm could have served, the
//! exit summary. May import: `registry`, `policy`, `stats`, `init`, `logging`, `calls::real`,
//! `calls::os`, `types`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use flashcomm_config::{Bytes, Choice, Config, Transport, Value};
use flashcomm_nccl_sys::{HEADER_VERSION, version_string};

use crate::calls::os::PerProcess;
use crate::logging::{self, Subsys};
use crate::policy::Why;
use crate::registry::CommState;
use crate::stats::{self, Snapshot};
use crate::types::{Collective, CommHandle, Route};

/// Writes `msg` at INFO under `flashcomm::engage`.
fn engage_info(msg: &str) {
    tracing::info!(target: "flashcomm::engage", "{}", msg);
}

/// Why a call that flashcomm could have served went to NCCL: the slots of [`MISSED`].
const MISSED_REASONS: [&str; 9] = [
    "invalid configuration",
    "communicator not created through flashcomm",
    "communicator not served",
    "communicator finalized or revoked",
    "per-call ncclCollConfig_t",
    "below FLASHCOMM_MIN_BYTES",
    "above FLASHCOMM_MAX_BYTES",
    "quantization widths without kernels",
    "refused by the kernels",
];

/// Calls forwarded to NCCL that flashcomm could have served, per reason.
static MISSED: [AtomicU64; MISSED_REASONS.len()] = [const { AtomicU64::new(0) }; 9];

/// The slot of [`MISSED`] of a call that took `route` for `why`, if it is one that flashcomm could
/// have served: a kind, operator and type its kernels take, not kept from them on purpose.
fn missed_slot(route: Route, why: Why) -> Option<usize> {
    if route != Route::Nccl {
        return None;
    }
    match why {
        Why::NotOurs | Why::NotSum | Why::NotFloat | Why::Disabled | Why::OpsExclude => None,
        Why::PassthroughForced => Some(0),
        Why::UnknownComm => Some(1),
        Why::NotServed => Some(2),
        Why::Closed => Some(3),
        Why::CollConfig => Some(4),
        Why::BelowMin => Some(5),
        Why::AboveMax => Some(6),
        Why::QuantNoKernels => Some(7),
        // Decided for the kernels, which refused it when it ran.
        Why::Quantized | Why::Lossless(_) => Some(8),
    }
}

/// Whether `FLASHCOMM_OPS` lets flashcomm's kernels take collectives of `kind`.
fn ops_allow(config: &Config, kind: Collective) -> bool {
    config.settings.ops.contains(&kind)
}

/// Hook of `dispatch::run`: a call of `kind` took `route` (after any refusal by the kernels)
/// because of `why` (the decision's reason). One branch for calls on flashcomm's routes; for a
/// forwarded call that could have been served, a check of `FLASHCOMM_OPS` (the routing rules
/// test it after the communicator, so `why` may not say it) and one relaxed atomic add.
#[inline]
pub(crate) fn on_routed(kind: Collective, route: Route, why: Why) {
    if let Some(slot) = missed_slot(route, why)
        && (why == Why::PassthroughForced || ops_allow(&crate::init::state().config, kind))
    {
        MISSED[slot].fetch_add(1, Ordering::Relaxed);
    }
}

fn missed() -> [u64; MISSED_REASONS.len()] {
    std::array::from_fn(|i| MISSED[i].load(Ordering::Relaxed))
}

/// What the configuration lets flashcomm's kernels take, in words.
fn serves(config: &Config) -> String {
    let s = &config.settings;
    if config.passthrough_forced.is_some() {
        return "takes nothing: the configuration is invalid (see the ENV warnings), every call \
                goes to NCCL"
            .into();
    }
    if s.disable {
        return "takes nothing: FLASHCOMM_DISABLE is set, every call goes to NCCL".into();
    }
    if s.ops.0.is_empty() {
        return "takes nothing: FLASHCOMM_OPS=none, every call goes to NCCL".into();
    }
    let mut out = format!(
        "takes {} of [{}, {}] bytes per rank",
        s.ops.show(),
        s.min_bytes,
        s.max_bytes
    );
    let quant = config.quant_settings();
    match quant.widths() {
        Some(_) => {
            let _ = write!(
                out,
                "; quantizes {} of {} ({quant}){}",
                s.quant_ops.show(),
                s.quant_dtypes.show(),
                if crate::policy::allreduce_quant_spec(config).is_some() {
                    match s.quant_choice {
                        flashcomm_config::QuantChoice::Auto => {
                            ", allreduce where the calibrated cost model predicts it faster"
                        }
                        flashcomm_config::QuantChoice::Always => ", allreduce always",
                    }
                } else {
                    ""
                }
            );
        }
        None => out.push_str("; quantization off (lossless)"),
    }
    out
}

/// The engagement line, from what is known when the first communicator was set up.
fn engagement_line(config: &Config, real: &str, comm: &str) -> String {
    format!(
        "flashcomm {} (NCCL API {HEADER_VERSION}) is on: {real}; {comm}; {}",
        env!("CARGO_PKG_VERSION"),
        serves(config)
    )
}

/// The real NCCL in words: version, file, how it was found.
fn real_nccl() -> String {
    match crate::calls::real::loaded() {
        Some(lib) => format!(
            "real NCCL {} at {} (found via {})",
            version_string(lib.version),
            lib.path.display(),
            lib.origin.describe()
        ),
        None => "no real NCCL loaded".into(),
    }
}

/// The first communicator in words, with the transport its kernels move data over (and why,
/// for the host transport: every byte then crosses PCIe twice).
fn first_comm(h: CommHandle, state: &CommState, config: &Config) -> String {
    match state.served() {
        Some(c) => format!(
            "communicator {h:?} (rank {} of {}, device {}) served by flashcomm's kernels {}",
            c.rank(),
            c.nranks(),
            c.device(),
            match (c.transport(), config.settings.transport) {
                _ if c.nranks() == 1 => "(one rank: nothing to exchange)",
                (Transport::P2p, _) => "over GPU peer access",
                (Transport::Host, Choice::Force(_)) => {
                    "through pinned host memory (FLASHCOMM_TRANSPORT=host)"
                }
                (Transport::Host, Choice::Auto) => {
                    "through pinned host memory (its GPUs have no peer access to each other)"
                }
            }
        ),
        None => format!(
            "communicator {h:?} not served by flashcomm's kernels: {}",
            state.why_not().unwrap_or_else(|| "unknown".into())
        ),
    }
}

/// Once per process (a fork child that sets up a communicator writes its own line).
static ENGAGED: PerProcess<()> = PerProcess::fresh_in_children();
/// The process that registered the exit summary, and whether it was written: a fork child runs
/// its parent's `atexit` handlers too, and writes a summary only if it registered its own.
static SUMMARY_PID: AtomicU32 = AtomicU32::new(0);
static SUMMARY_WRITTEN: AtomicBool = AtomicBool::new(false);

/// Hook of `serve::finish`: communicator `h` was set up (served or not). The first time in the
/// process, writes the engagement line and registers the exit summary.
pub(crate) fn on_set_up(h: CommHandle, state: &CommState) {
    ENGAGED.get(|| {
        let config = &crate::init::state().config;
        engage_info(&engagement_line(
            config,
            &real_nccl(),
            &first_comm(h, state, config),
        ));
        SUMMARY_PID.store(std::process::id(), Ordering::Relaxed);
        if !crate::calls::os::at_exit(at_exit) {
            logging::info(
                Subsys::Init,
                "cannot register the exit summary (atexit failed)",
            );
        }
    });
}

/// One line: calls per route (each with its collectives), then the forwarded calls flashcomm
/// could have served and why. `None` when no such call was counted.
fn summary_line(totals: &Snapshot, missed: &[u64; MISSED_REASONS.len()]) -> Option<String> {
    let missed_total: u64 = missed.iter().sum();
    if missed_total == 0 {
        return None;
    }
    let mut line = String::from("flashcomm summary: calls per route:");
    for (i, route) in Route::ALL.iter().enumerate() {
        let row = &totals.calls[*route as usize];
        let n: u64 = row.iter().sum();
        let _ = write!(
            line,
            "{} {} {n}",
            if i == 0 { "" } else { "," },
            route.name()
        );
        let parts: Vec<String> = Collective::ALL
            .iter()
            .filter(|k| row[**k as usize] > 0)
            .map(|k| format!("{} {}", Collective::name(*k), row[*k as usize]))
            .collect();
        if !parts.is_empty() {
            let _ = write!(line, " ({})", parts.join(", "));
        }
    }
    let reasons: Vec<String> = MISSED_REASONS
        .iter()
        .zip(missed)
        .filter(|(_, n)| **n > 0)
        .map(|(r, n)| format!("{r} {n}"))
        .collect();
    let bytes: u64 = Route::ALL
        .iter()
        .filter(|r| **r != Route::Nccl)
        .flat_map(|r| totals.bytes[*r as usize])
        .sum();
    let _ = write!(
        line,
        "; {missed_total} call(s) went to NCCL that flashcomm's kernels could have taken ({}); \
         flashcomm's kernels moved {} bytes",
        reasons.join(", "),
        Bytes(bytes)
    );
    Some(line)
}

/// Whether flashcomm's kernels took any call.
fn served_any(totals: &Snapshot) -> bool {
    totals.calls[Route::Lossless as usize]
        .iter()
        .chain(&totals.calls[Route::Quantized as usize])
        .any(|n| *n > 0)
}

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if SUMMARY_PID.load(Ordering::Relaxed) != std::process::id()
            || SUMMARY_WRITTEN.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let totals = stats::totals();
        if let Some(line) = summary_line(&totals, &missed()) {
            if served_any(&totals) {
                engage_info(&line);
            } else {
                logging::warn(
                    Subsys::Init,
                    &format!("{line}; none of the calls took flashcomm's kernels"),
                );
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::NotQuantized;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        Config::from_vars(vars.iter().copied())
    }

    #[test]
    fn servable_calls_sent_to_nccl_are_classified() {
        for why in [
            Why::NotOurs,
            Why::NotSum,
            Why::NotFloat,
            Why::Disabled,
            Why::OpsExclude,
        ] {
            assert_eq!(missed_slot(Route::Nccl, why), None, "{why:?}");
        }
        assert_eq!(
            missed_slot(Route::Lossless, Why::Lossless(NotQuantized::Off)),
            None
        );
        assert_eq!(missed_slot(Route::Quantized, Why::Quantized), None);
        assert_eq!(missed_slot(Route::Nccl, Why::NotServed), Some(2));
        assert_eq!(missed_slot(Route::Nccl, Why::Quantized), Some(8));
        assert_eq!(
            missed_slot(Route::Nccl, Why::Lossless(NotQuantized::BelowWindow)),
            Some(8)
        );
        // Every reason has a slot of its own.
        let slots: Vec<usize> = [
            Why::PassthroughForced,
            Why::UnknownComm,
            Why::NotServed,
            Why::Closed,
            Why::CollConfig,
            Why::BelowMin,
            Why::AboveMax,
            Why::QuantNoKernels,
            Why::Quantized,
        ]
        .into_iter()
        .map(|w| missed_slot(Route::Nccl, w).unwrap())
        .collect();
        assert_eq!(slots, (0..MISSED_REASONS.len()).collect::<Vec<_>>());
    }

    #[test]
    fn collectives_kept_from_the_kernels_by_flashcomm_ops_are_a_choice() {
        let c = cfg(&[("FLASHCOMM_OPS", "allgather")]);
        assert!(ops_allow(&c, Collective::AllGather));
        assert!(!ops_allow(&c, Collective::AllReduce));
        assert!(ops_allow(&cfg(&[]), Collective::ReduceScatter));
        assert!(!ops_allow(&cfg(&[]), Collective::Broadcast));
    }

    #[test]
    fn the_summary_names_routes_collectives_and_reasons() {
        let mut t = Snapshot::default();
        let none = [0; MISSED_REASONS.len()];
        assert_eq!(summary_line(&t, &none), None, "nothing missed: no line");
        t.calls[Route::Nccl as usize][Collective::AllReduce as usize] = 10;
        t.calls[Route::Nccl as usize][Collective::Broadcast as usize] = 2;
        t.calls[Route::Lossless as usize][Collective::AllGather as usize] = 5;
        t.bytes[Route::Lossless as usize][Collective::AllGather as usize] = 5 << 20;
        assert_eq!(summary_line(&t, &none), None);
        let mut missed = none;
        missed[2] = 8;
        missed[4] = 2;
        assert_eq!(
            summary_line(&t, &missed).unwrap(),
            "flashcomm summary: calls per route: nccl 12 (allreduce 10, broadcast 2), lossless 5 \
             (allgather 5), quantized 0; 10 call(s) went to NCCL that flashcomm's kernels could \
             have taken (communicator not served 8, per-call ncclCollConfig_t 2); flashcomm's kernels moved 5M bytes"
        );
        assert!(served_any(&t));
        t.calls[Route::Lossless as usize] = [0; Collective::COUNT];
        assert!(!served_any(&t));
    }

    #[test]
    fn what_is_served_in_words() {
        assert_eq!(
            serves(&cfg(&[])),
            "takes allreduce,reducescatter,allgather,alltoall of [0, 1G] bytes per rank; \
             quantization off (lossless)"
        );
        let q = serves(&cfg(&[("FLASHCOMM_QUANT_BITS", "4")]));
        assert!(
            q.ends_with(
                "; quantizes allreduce of bf16,f16 (rs 4 bits, ag 4 bits, allgather 4 bits, \
                 reducescatter 4 bits, alltoall 4 bits, group 128, spikes 2, window [0, 1G]), \
                 allreduce where the calibrated cost model predicts it faster"
            ),
            "{q}"
        );
        let q = serves(&cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_CHOICE", "always"),
        ]));
        assert!(q.ends_with(", allreduce always"), "{q}");
        let q = serves(&cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_OPS", "alltoall"),
        ]));
        assert!(q.ends_with("window [0, 1G])"), "{q}");
        assert!(serves(&cfg(&[("FLASHCOMM_DISABLE", "1")])).contains("FLASHCOMM_DISABLE"));
        assert!(serves(&cfg(&[("FLASHCOMM_OPS", "none")])).contains("takes nothing"));
        assert!(serves(&cfg(&[("FLASHCOMM_PROTO", "fast")])).contains("invalid"));
        let line = engagement_line(&cfg(&[]), "real NCCL 2.32.3 at /x", "communicator 0x1 ...");
        assert!(
            line.starts_with(&format!(
                "flashcomm {} (NCCL API {HEADER_VERSION}) is on: real NCCL 2.32.3 at /x; \
                 communicator 0x1 ...; takes ",
                env!("CARGO_PKG_VERSION")
            )),
            "{line}"
        );
    }
}
