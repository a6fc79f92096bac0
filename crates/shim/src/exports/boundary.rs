//! The boundary every export runs in, and the macros that define exports.
//!
//! * [`guard`] runs the body of an export inside `catch_unwind`: a panic becomes
//!   `ncclInternalError` (or the function's documented default) and a message for
//!   `ncclGetLastError`; nothing unwinds into C, and the process is never aborted.
//! * [`nccl_api!`] defines one NCCL function twice, as `ncclX` and `pncclX` (NCCL's profiling
//!   twin), both running the same body inside [`guard`], and proves at compile time that the
//!   signature equals bindgen's declaration of `ncclX` in `flashcomm_nccl_sys::decls`.
//! * [`forward!`] defines plain forwarders (used by the generated `forwarders.rs`).
//! * [`call_real!`] calls the real library's function of a [`Slot`](crate::calls::real::Slot).
//!
//! Owns: [`CReturn`], [`guard`], [`unavailable`], the export macros, the failure of a group
//! call flashcomm refused inside a group.
//! May import: `error`, `logging`, `last_error`, `init`, `group`, `calls::os`, `calls::real`,
//! `calls::nccl`.

use std::any::Any;
use std::ffi::c_char;
use std::panic::AssertUnwindSafe;

use flashcomm_nccl_sys::{ncclResult_t, ncclTeam_t};

use crate::calls::real::Slot;
use crate::error::Error;
use crate::logging::Subsys;
use crate::types::Collective;

/// What an export returns when it cannot run: after a panic, or when the real library (or its
/// function) is unavailable. `ncclResult_t` functions return an error code; the few others return
/// a documented safe default (listed in `docs/abi.md`).
pub(crate) trait CReturn: Copy {
    /// What [`on_panic`](CReturn::on_panic) returns, in words, for the panic's message.
    const ON_PANIC: &'static str;
    /// The value after a caught panic.
    fn on_panic() -> Self;
    /// The value when the call cannot be forwarded because of `e`.
    fn on_unavailable(e: &Error) -> Self;
    /// Runs after the real function of `slot` returned `self`.
    fn after_real(&self, _slot: &Slot) {}
    /// The error code, when `self` is one (`ncclResult_t` functions only).
    #[inline]
    fn failure(&self) -> Option<ncclResult_t> {
        None
    }
}

impl CReturn for ncclResult_t {
    const ON_PANIC: &'static str = "the call returned ncclInternalError";
    fn on_panic() -> Self {
        ncclResult_t::ncclInternalError
    }
    fn on_unavailable(e: &Error) -> Self {
        e.code()
    }
    #[inline]
    fn after_real(&self, slot: &Slot) {
        if *self != ncclResult_t::ncclSuccess && *self != ncclResult_t::ncclInProgress {
            crate::last_error::record_real_failure(slot.name(), self.0);
            // Inside a group, the real group saw this failure: it is the group's newest.
            if crate::group::depth() > 0 {
                crate::group::real_failed();
            }
        }
    }
    #[inline]
    fn failure(&self) -> Option<ncclResult_t> {
        (*self != ncclResult_t::ncclSuccess && *self != ncclResult_t::ncclInProgress)
            .then_some(*self)
    }
}

/// `void` functions (`ncclParamDumpAll`, `ncclResetDebugInit`): nothing happens.
impl CReturn for () {
    const ON_PANIC: &'static str = "the call did nothing";
    fn on_panic() -> Self {}
    fn on_unavailable(_: &Error) -> Self {}
}

/// `int` functions (`ncclTeamRankToWorld`, `ncclTeamRankToLsa`, `ncclLLA2ACalcSlots`): -1, which
/// is neither a rank nor a slot count.
impl CReturn for std::ffi::c_int {
    const ON_PANIC: &'static str = "the call returned -1";
    fn on_panic() -> Self {
        -1
    }
    fn on_unavailable(_: &Error) -> Self {
        -1
    }
}

/// Team functions (`ncclTeamWorld`, ...): the empty team `{nRanks 0, rank 0, stride 0}`.
impl CReturn for ncclTeam_t {
    const ON_PANIC: &'static str = "the call returned the empty team";
    fn on_panic() -> Self {
        ncclTeam_t {
            nRanks: 0,
            rank: 0,
            stride: 0,
        }
    }
    fn on_unavailable(_: &Error) -> Self {
        Self::on_panic()
    }
}

/// String functions (`ncclGetErrorString`, `ncclGetLastError`): a static string; after a panic
/// one that says so, not an empty one (a caller asking `ncclGetLastError` about its failure must
/// not be left without a word).
impl CReturn for *const c_char {
    const ON_PANIC: &'static str = "the call returned a message saying so";
    fn on_panic() -> Self {
        PANIC_TEXT.as_ptr()
    }
    fn on_unavailable(_: &Error) -> Self {
        c"".as_ptr()
    }
}

/// Reports `e` (WARN log and last error) and returns the export's value for it.
#[cold]
pub(crate) fn unavailable<R: CReturn>(e: Error) -> R {
    e.report();
    R::on_unavailable(&e)
}

/// What a string function returns after a panic.
const PANIC_TEXT: &std::ffi::CStr =
    c"internal error in flashcomm (a panic); flashcomm's WARN line in the log says where";

fn panic_message(api: &str, payload: &(dyn Any + Send), returned: &str) -> String {
    let stashed = crate::init::take_panic_text();
    let text = stashed.unwrap_or_else(|| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string())
    });
    format!("{api}: internal error in flashcomm ({text}); {returned}")
}

/// Runs one export's body: the first call initializes configuration and logging, a panic is
/// caught and reported, and `FLASHCOMM_DEBUG_PANIC` can inject one for tests. The body receives
/// the process state read here (its configuration), which it then does not read again.
#[inline(always)]
pub(crate) fn guard<R: CReturn>(
    api: &'static str,
    body: impl FnOnce(&'static crate::init::State) -> R,
) -> R {
    let r = match std::panic::catch_unwind(AssertUnwindSafe(|| {
        body(crate::init::debug_panic_point(api))
    })) {
        Ok(r) => r,
        Err(payload) => {
            // Reporting must not unwind either, and the failure has a message for
            // `ncclGetLastError` even if describing the panic fails too.
            let reported = std::panic::catch_unwind(AssertUnwindSafe(|| {
                let msg = panic_message(api, payload.as_ref(), R::ON_PANIC);
                Error::internal(Subsys::Call, msg).report();
            }));
            if reported.is_err() {
                let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    crate::last_error::record(&format!(
                        "{api}: internal error in flashcomm (a panic, which could not be \
                         described); {}",
                        R::ON_PANIC
                    ));
                }));
            }
            R::on_panic()
        }
    };
    if let Some(code) = r.failure() {
        failed_in_group(api, code);
    }
    r
}

/// The exports whose calls take part in NCCL's groups besides those of a [`Collective`] kind
/// ([`Collective::exports`]): a failure of one inside a group is the group's error
/// (`ncclGroupErrCheck`).
const OTHER_GROUP_CALLS: &[&str] = &[
    "ncclGather",
    "ncclGatherConfig",
    "ncclScatter",
    "ncclScatterConfig",
    "ncclPutSignal",
    "ncclSignal",
    "ncclWaitSignal",
    "ncclCommInitRank",
    "ncclCommInitRankConfig",
    "ncclCommInitRankScalable",
    "ncclCommSplit",
    "ncclCommShrink",
    "ncclCommGrow",
];

/// An export of a group call returned `code`. When flashcomm itself failed it inside a group
/// (this thread's newest failure is flashcomm's: the real library's failures are recorded as
/// its own), the real group never saw the call: flashcomm makes the real group fail the way
/// NCCL's groups fail after a refused call (its other calls are discarded), and the outermost
/// `ncclGroupEnd` returns this failure (`group::take_failure`).
#[cold]
fn failed_in_group(api: &'static str, code: ncclResult_t) {
    let in_group = Collective::of_export(api).is_some() || OTHER_GROUP_CALLS.contains(&api);
    if crate::group::depth() == 0 || !in_group {
        return;
    }
    if let Some(crate::last_error::Last::Ours(msg)) = crate::last_error::thread_last() {
        crate::group::failed(code, &msg);
        crate::calls::nccl::fail_real_group();
    }
}

/// Forces two values to have the same type; used with fn pointers to compare signatures.
pub(crate) const fn same_signature<T: Copy>(_ours: T, _header: T) {}

/// Calls the real function of `$slot` with the export's own arguments. Evaluates to
/// `Result<R, Error>`: `Err` when the real library or the function is unavailable.
macro_rules! call_real {
    (@placeholder $e:expr) => { _ };
    ($slot:expr, ($($arg:expr),* $(,)?) $(-> $ret:ty)?) => {
        match $slot.get() {
            Ok(p) => {
                // SAFETY: `p` is the real library's function of the slot's name. Its C signature
                // is the header's, which the export shares (checked at compile time against
                // bindgen's declaration), and the arguments are the export's own parameters, so
                // the inferred pointer type is that signature.
                let f = unsafe {
                    ::core::mem::transmute::<
                        *mut ::core::ffi::c_void,
                        unsafe extern "C" fn(
                            $($crate::exports::boundary::call_real!(@placeholder $arg)),*
                        ) $(-> $ret)?,
                    >(p)
                };
                // SAFETY: the caller's arguments go through unchanged, so the caller's
                // obligations under NCCL's contract carry over to the real function.
                let r = unsafe { f($($arg),*) };
                $crate::exports::boundary::CReturn::after_real(&r, &$slot);
                Ok(r)
            }
            Err(e) => Err(e),
        }
    };
}
pub(crate) use call_real;

/// Defines NCCL exports: for each `fn ncclX(args) -> R { body }`, the symbols `ncclX` and
/// `pncclX`, both running `body` inside [`guard`], plus a compile-time check that the signature
/// is exactly bindgen's declaration `flashcomm_nccl_sys::decls::ncclX`.
macro_rules! nccl_api {
    ($(
        $(#[$meta:meta])*
        fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)? $([$state:ident])?
            $body:block
    )*) => {$(
        const _: () = {
            #[inline(always)]
            #[allow(non_snake_case, clippy::too_many_arguments, unused_unsafe)]
            fn body(
                $($arg: $ty,)*
                $($state: &'static $crate::init::State)?
            ) $(-> $ret)? $body

            $(#[$meta])*
            #[unsafe(no_mangle)]
            #[allow(non_snake_case, clippy::too_many_arguments)]
            unsafe extern "C" fn $name($($arg: $ty),*) $(-> $ret)? {
                $crate::exports::boundary::guard(stringify!($name), |_st| {
                    body($($arg,)* $({ let _ = stringify!($state); _st })?)
                })
            }

            /// NCCL's profiling twin (`pncclX`): the same function under the other name.
            #[unsafe(export_name = concat!("p", stringify!($name)))]
            #[allow(non_snake_case, clippy::too_many_arguments)]
            unsafe extern "C" fn profiling_twin($($arg: $ty),*) $(-> $ret)? {
                $crate::exports::boundary::guard(stringify!($name), |_st| {
                    body($($arg,)* $({ let _ = stringify!($state); _st })?)
                })
            }

            // Both symbols have exactly the header's signature: casting bindgen's declaration to
            // our parameter list fails to compile if any type differs.
            $crate::exports::boundary::same_signature(
                $name as unsafe extern "C" fn($($ty),*) $(-> $ret)?,
                ::flashcomm_nccl_sys::decls::$name as unsafe extern "C" fn($($ty),*) $(-> $ret)?,
            );
            $crate::exports::boundary::same_signature(
                profiling_twin as unsafe extern "C" fn($($ty),*) $(-> $ret)?,
                ::flashcomm_nccl_sys::decls::$name as unsafe extern "C" fn($($ty),*) $(-> $ret)?,
            );
        };
    )*};
}
pub(crate) use nccl_api;

/// Defines plain forwarders from declarations in bindgen's form (`pub fn ncclX(args) -> R;`):
/// resolve the real function once, call it with the arguments unchanged.
macro_rules! forward {
    ($(
        $(#[$meta:meta])*
        pub fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)? ;
    )*) => {$(
        $crate::exports::boundary::nccl_api! {
            $(#[$meta])*
            fn $name($($arg: $ty),*) $(-> $ret)? {
                static REAL: $crate::calls::real::Slot = $crate::calls::real::Slot::new(
                    match ::core::ffi::CStr::from_bytes_with_nul(
                        concat!(stringify!($name), "\0").as_bytes()
                    ) {
                        Ok(name) => name,
                        Err(_) => panic!("function names contain no NUL"),
                    },
                );
                match $crate::exports::boundary::call_real!(REAL, ($($arg),*) $(-> $ret)?) {
                    Ok(r) => r,
                    Err(e) => $crate::exports::boundary::unavailable(e),
                }
            }
        }
    )*};
}
pub(crate) use forward;
