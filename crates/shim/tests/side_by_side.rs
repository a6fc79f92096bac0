//! flashcomm side by side with the real NCCL, over bad input.
//!
//! Every case runs in a process of its own with a time limit, twice: once with the real library
//! of `.toolchain/` (`$FLASHCOMM_NCCL_LIB`) loaded directly, once with flashcomm loaded and
//! forwarding to it. Each run prints a transcript: every call's result, `ncclGetLastError` after
//! it, and anything the library printed to standard output; the test compares the transcripts
//! and how the processes ended. A case passes when flashcomm cannot be told apart from NCCL, or
//! differs only where docs/abi.md says it does on purpose; it fails when NCCL returns an error and
//! flashcomm success (or the reverse, undocumented), when flashcomm crashes or hangs where NCCL
//! does not, or when an error of flashcomm has no message.
//!
//! The table of the cases and their verdicts in docs/testing.md is generated from this test
//! (`FLASHCOMM_BLESS=1` rewrites it); the test fails when it is stale. `SXS_FILTER=<text>` runs
//! only the cases whose class or name contains the text (and checks no table).

mod common;

use std::ffi::{CStr, OsStr, OsString, c_char, c_int, c_void};
use std::fmt::Write as _;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flashcomm_codec::Collective;
use flashcomm_nccl_sys::*;

use common::*;

// ------------------------------------------------------------------------------------------
// Arguments of a call, chosen by type and parameter name.
// ------------------------------------------------------------------------------------------

/// What a handle argument is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handle {
    /// NULL.
    Null,
    /// Zeroed memory that is not a communicator (NCCL: "corrupted comm object detected").
    Foreign,
    /// An address that was mapped and no longer is.
    Dangling,
}

impl Handle {
    fn name(self) -> &'static str {
        match self {
            Handle::Null => "null",
            Handle::Foreign => "foreign",
            Handle::Dangling => "dangling",
        }
    }

    fn addr(self) -> usize {
        match self {
            Handle::Null => 0,
            Handle::Foreign => foreign_handle(),
            Handle::Dangling => dangling(),
        }
    }
}

/// An address where nothing can be read: a reserved range without access (a freed handle,
/// as the libraries find it: every touch faults). Reserved for the life of the process, so that
/// nothing the libraries map later lands there.
fn dangling() -> usize {
    static D: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        // SAFETY: an anonymous mapping without access rights; only its address is used. As
        // large as the foreign handle: NCCL reads fields far into its communicator struct.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                64 << 20,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as usize
    })
}

/// 1 MiB of zeroed, writable memory for every pointer argument that is not the handle under
/// test (out parameters, configs, strings: an empty one).
fn scratch_mem() -> usize {
    static S: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *S.get_or_init(|| Box::leak(vec![0u8; 1 << 20].into_boxed_slice()).as_mut_ptr() as usize)
}

/// How the arguments of one generic call are made.
struct Ctx {
    handle: Handle,
    /// Whether the function takes a `comm` (then the handle goes there; else to its first
    /// pointer argument).
    has_comm: bool,
    pointers: std::cell::Cell<usize>,
}

trait Arg {
    fn make(ctx: &Ctx, name: &str) -> Self;
}

fn pointer(ctx: &Ctx, name: &str) -> usize {
    let i = ctx.pointers.get();
    ctx.pointers.set(i + 1);
    if name == "comm" || (!ctx.has_comm && i == 0) {
        ctx.handle.addr()
    } else if name == "stream" {
        0
    } else {
        scratch_mem()
    }
}

impl<T> Arg for *mut T {
    fn make(ctx: &Ctx, name: &str) -> Self {
        pointer(ctx, name) as *mut T
    }
}

impl<T> Arg for *const T {
    fn make(ctx: &Ctx, name: &str) -> Self {
        pointer(ctx, name) as *const T
    }
}

impl Arg for c_int {
    fn make(_: &Ctx, _: &str) -> Self {
        0
    }
}

impl Arg for u32 {
    fn make(_: &Ctx, _: &str) -> Self {
        0
    }
}

impl Arg for usize {
    fn make(_: &Ctx, _: &str) -> Self {
        1
    }
}

impl Arg for ncclDataType_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclDataType_t::ncclFloat32
    }
}

impl Arg for ncclRedOp_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclRedOp_t::ncclSum
    }
}

impl Arg for ncclScalarResidence_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclScalarResidence_t(0)
    }
}

impl Arg for ncclResult_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclResult_t::ncclInvalidArgument
    }
}

impl Arg for ncclCftTeamMode_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclCftTeamMode_t(0)
    }
}

impl Arg for ncclCommMemStat_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclCommMemStat_t(0)
    }
}

impl Arg for ncclTeam_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclTeam_t {
            nRanks: 1,
            rank: 0,
            stride: 1,
        }
    }
}

impl Arg for ncclUniqueId {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclUniqueId { internal: [0; 128] }
    }
}

impl Arg for ncclMultimemHandle_t {
    fn make(_: &Ctx, _: &str) -> Self {
        ncclMultimemHandle_t {
            mcBasePtr: std::ptr::null_mut(),
        }
    }
}

/// A function's return value as the transcript shows it, and whether it is an error code.
trait Ret {
    fn show(self) -> (String, Option<bool>);
}

impl Ret for ncclResult_t {
    fn show(self) -> (String, Option<bool>) {
        (self.0.to_string(), Some(self.0 != 0 && self.0 != 7))
    }
}

impl Ret for c_int {
    fn show(self) -> (String, Option<bool>) {
        (self.to_string(), None)
    }
}

impl Ret for () {
    fn show(self) -> (String, Option<bool>) {
        ("void".into(), None)
    }
}

impl Ret for *const c_char {
    fn show(self) -> (String, Option<bool>) {
        (text(self), None)
    }
}

impl Ret for ncclTeam_t {
    fn show(self) -> (String, Option<bool>) {
        (
            format!("{{{}, {}, {}}}", self.nRanks, self.rank, self.stride),
            None,
        )
    }
}

fn text(p: *const c_char) -> String {
    if p.is_null() {
        return "(NULL)".into();
    }
    // SAFETY: the libraries return NUL-terminated strings that stay valid until the next call.
    format!("{:?}", unsafe { CStr::from_ptr(p) }.to_string_lossy())
}

/// What the transcript says of a function the library does not export (the real 2.32.3 lacks
/// one its headers declare, `ncclCftBarrierCreateRequirement`; a program linked against it
/// would not load).
const NOT_EXPORTED: &str = "(not exported)";

/// One function of the NCCL API, callable with made-up arguments.
struct Export {
    name: &'static str,
    call: fn(&Lib, Handle) -> (String, Option<bool>),
}

macro_rules! every_export {
    ($(
        pub fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)? ;
    )*) => {
        /// Every function of the NCCL API (the generated list).
        fn every_export() -> Vec<Export> {
            vec![$(
                Export {
                    name: stringify!($name),
                    call: |lib: &Lib, handle: Handle| {
                        type F = unsafe extern "C" fn($($ty),*) $(-> $ret)?;
                        if lib.addr(stringify!($name)).is_null() {
                            return (NOT_EXPORTED.into(), None);
                        }
                        let f: F = lib.get(stringify!($name));
                        let ctx = Ctx {
                            handle,
                            has_comm: [$(stringify!($arg)),*].contains(&"comm"),
                            pointers: std::cell::Cell::new(0),
                        };
                        $(let $arg = <$ty as Arg>::make(&ctx, stringify!($arg));)*
                        let _ = &ctx;
                        // SAFETY: the function of that name has this signature (the header's);
                        // the arguments are what a C caller could pass: NULL, zeroed scratch
                        // memory, a handle that is not a communicator, small integers. A crash is
                        // an outcome the test compares.
                        #[allow(clippy::let_unit_value)]
                        let r = unsafe { f($($arg),*) };
                        Ret::show(r)
                    },
                },
            )*]
        }
    };
}

#[allow(non_snake_case, clippy::too_many_arguments)]
mod generated {
    use super::*;
    include!("side_by_side/exports.rs");
    pub(super) fn exports() -> Vec<Export> {
        every_export()
    }
}

// ------------------------------------------------------------------------------------------
// Cases.
// ------------------------------------------------------------------------------------------

/// One call of a case's script.
#[derive(Debug, Clone)]
enum Step {
    /// A function of the API with made-up arguments, the handle under test where a
    /// communicator goes.
    Export(&'static str, Handle),
    /// A collective export with these arguments (`comm` is the handle's address unless set).
    Coll(&'static str, Handle, CollArgs),
    GroupStart,
    GroupEnd,
    /// `ncclGroupSimulateEnd` with NULL (`false`) or zeroed scratch (`true`).
    SimulateEnd(bool),
    /// A standard sequence of bad calls (docs: "the probe script").
    Probe,
    /// `threads` threads, each running `steps` `rounds` times; the transcript counts results.
    Threads(usize, usize, Vec<Step>),
}

/// What a case may show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// flashcomm cannot be told from NCCL (messages may differ only where NCCL gives none).
    Parity,
    /// flashcomm is stricter on purpose: an unusable `FLASHCOMM_NCCL_LIB` stops every call that
    /// needs the real library, with a message.
    NoRealLibrary,
}

#[derive(Debug, Clone)]
struct Case {
    class: &'static str,
    name: String,
    /// Variables for both runs (NCCL ignores `FLASHCOMM_*`).
    env: Vec<(String, OsString)>,
    /// `FLASHCOMM_NCCL_LIB` of flashcomm's run (default: the real library).
    nccl_lib: Option<OsString>,
    steps: Vec<Step>,
    expect: Expect,
}

fn case(class: &'static str, name: impl Into<String>, steps: Vec<Step>) -> Case {
    Case {
        class,
        name: name.into(),
        env: Vec::new(),
        nccl_lib: None,
        steps,
        expect: Expect::Parity,
    }
}

const DATATYPES: [c_int; 5] = [-1, 12, 13, 64, i32::MAX];

fn coll_name(name: &str, handle: Handle, what: &str) -> String {
    format!("{name}(comm={}, {what})", handle.name())
}

/// Every case, in a fixed order (the child finds its case by index).
fn cases(paths: &Paths) -> Vec<Case> {
    let mut v = Vec::new();
    let exports = generated::exports();
    // Every export with null, dangling and foreign handles.
    for e in &exports {
        for h in [Handle::Null, Handle::Foreign, Handle::Dangling] {
            v.push(case(
                "every export, bad handles",
                format!("{}(handle={})", e.name, h.name()),
                vec![Step::Export(e.name, h)],
            ));
        }
    }
    // Every datatype value from -1 to 64 and 2^31-1, and every operator.
    let values: Vec<c_int> = (-1..=64).chain([i32::MAX]).collect();
    for &dt in &values {
        let a = CollArgs {
            dt,
            ..CollArgs::on(0)
        };
        v.push(case(
            "datatypes",
            coll_name("ncclAllReduce", Handle::Foreign, &format!("datatype={dt}")),
            vec![Step::Coll("ncclAllReduce", Handle::Foreign, a)],
        ));
    }
    for &op in &values {
        let a = CollArgs {
            op,
            ..CollArgs::on(0)
        };
        v.push(case(
            "operators",
            coll_name("ncclAllReduce", Handle::Foreign, &format!("op={op}")),
            vec![Step::Coll("ncclAllReduce", Handle::Foreign, a)],
        ));
    }
    for name in collective_exports() {
        for dt in DATATYPES {
            let a = CollArgs {
                dt,
                ..CollArgs::on(0)
            };
            v.push(case(
                "datatypes",
                coll_name(name, Handle::Foreign, &format!("datatype={dt}")),
                vec![Step::Coll(name, Handle::Foreign, a)],
            ));
        }
    }
    // Counts 0, 1 and near overflow, with null and foreign handles.
    for name in collective_exports() {
        for h in [Handle::Null, Handle::Foreign] {
            for count in [0usize, 1, 1 << 62, usize::MAX] {
                let a = CollArgs {
                    count,
                    dt: 10,
                    ..CollArgs::on(0)
                };
                v.push(case(
                    "counts",
                    coll_name(name, h, &format!("count={count}")),
                    vec![Step::Coll(name, h, a)],
                ));
            }
        }
    }
    // Null and overlapping buffers.
    for name in collective_exports() {
        let s = scratch_addr_placeholder();
        for (what, send, recv) in [
            ("null buffers", 0, 0),
            ("null send buffer", 0, s),
            ("null receive buffer", s, 0),
            ("in place", s, s),
            ("overlapping", s, s + 4),
        ] {
            let a = CollArgs {
                send,
                recv,
                count: 8,
                ..CollArgs::on(0)
            };
            for h in [Handle::Null, Handle::Foreign] {
                v.push(case(
                    "buffers",
                    coll_name(name, h, what),
                    vec![Step::Coll(name, h, a)],
                ));
            }
        }
    }
    // Roots and peers out of range.
    let rooted = [
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Send,
        Collective::Recv,
    ];
    for name in rooted
        .iter()
        .flat_map(|k| k.exports().iter().copied())
        .chain(["ncclGather", "ncclScatter"])
    {
        for root in [-1, 1, 8, i32::MAX, i32::MIN] {
            let a = CollArgs {
                root,
                ..CollArgs::on(0)
            };
            v.push(case(
                "roots and peers",
                coll_name(name, Handle::Foreign, &format!("root/peer={root}")),
                vec![Step::Coll(name, Handle::Foreign, a)],
            ));
        }
    }
    groups(&mut v);
    lifecycle(&mut v);
    environment(&mut v);
    library_paths(&mut v, paths);
    threads(&mut v);
    v
}

/// A stand-in for "a valid buffer" in case names; the child uses its scratch memory.
const fn scratch_addr_placeholder() -> usize {
    0x5ca7_c000
}

fn bad_calls() -> Vec<(&'static str, Step)> {
    let f = Handle::Foreign;
    vec![
        (
            "ncclAllReduce without a communicator",
            Step::Coll("ncclAllReduce", Handle::Null, CollArgs::on(0)),
        ),
        (
            "ncclAllReduce datatype 12 on a foreign handle",
            Step::Coll(
                "ncclAllReduce",
                f,
                CollArgs {
                    dt: 12,
                    ..CollArgs::on(0)
                },
            ),
        ),
        (
            "ncclSend without a communicator",
            Step::Coll("ncclSend", Handle::Null, CollArgs::on(0)),
        ),
        (
            "ncclRecv without a communicator",
            Step::Coll("ncclRecv", Handle::Null, CollArgs::on(0)),
        ),
        (
            "ncclAllGather count 0 on a foreign handle",
            Step::Coll(
                "ncclAllGather",
                f,
                CollArgs {
                    count: 0,
                    ..CollArgs::on(0)
                },
            ),
        ),
        (
            "ncclReduce op -1 on a foreign handle",
            Step::Coll(
                "ncclReduce",
                f,
                CollArgs {
                    op: -1,
                    ..CollArgs::on(0)
                },
            ),
        ),
        (
            "ncclBcast root -1 on a foreign handle",
            Step::Coll(
                "ncclBcast",
                f,
                CollArgs {
                    root: -1,
                    ..CollArgs::on(0)
                },
            ),
        ),
        (
            "ncclCommCount on a foreign handle",
            Step::Export("ncclCommCount", f),
        ),
        (
            "ncclCommInitRank",
            Step::Export("ncclCommInitRank", Handle::Null),
        ),
        (
            "ncclCommDestroy on a foreign handle",
            Step::Export("ncclCommDestroy", f),
        ),
    ]
}

fn groups(v: &mut Vec<Case>) {
    use Step::*;
    let class = "groups";
    v.push(case(class, "end without a start", vec![GroupEnd]));
    v.push(case(
        class,
        "start, end, end",
        vec![GroupStart, GroupEnd, GroupEnd],
    ));
    v.push(case(
        class,
        "nested: start, start, end, end, end",
        vec![GroupStart, GroupStart, GroupEnd, GroupEnd, GroupEnd],
    ));
    v.push(case(
        class,
        "simulated end without a start",
        vec![SimulateEnd(true)],
    ));
    v.push(case(
        class,
        "start, simulated end (NULL)",
        vec![GroupStart, SimulateEnd(false)],
    ));
    v.push(case(
        class,
        "start, simulated end (zeroed info), end",
        vec![GroupStart, SimulateEnd(true), GroupEnd],
    ));
    v.push(case(class, "start, never ended", vec![GroupStart]));
    for (what, bad) in bad_calls() {
        v.push(case(
            class,
            format!("{what} inside a group"),
            vec![GroupStart, bad.clone(), GroupEnd, GroupStart, GroupEnd],
        ));
        v.push(case(
            class,
            format!("{what} inside a nested group"),
            vec![GroupStart, GroupStart, bad.clone(), GroupEnd, GroupEnd],
        ));
        v.push(case(
            class,
            format!("{what} in the middle of a group, then more calls"),
            vec![
                GroupStart,
                Coll("ncclAllReduce", Handle::Foreign, CollArgs::on(0)),
                bad.clone(),
                Coll("ncclAllGather", Handle::Null, CollArgs::on(0)),
                GroupEnd,
            ],
        ));
        v.push(case(
            class,
            format!("{what} before a simulated end"),
            vec![GroupStart, bad, SimulateEnd(true), GroupEnd],
        ));
    }
}

fn lifecycle(v: &mut Vec<Case>) {
    use Step::*;
    let class = "abort, destroy, finalize";
    let ends = [
        "ncclCommFinalize",
        "ncclCommDestroy",
        "ncclCommAbort",
        "ncclCommRevoke",
        "ncclCommSuspend",
        "ncclCommResume",
    ];
    for h in [Handle::Null, Handle::Foreign] {
        for a in ends {
            for b in ends {
                if a <= b {
                    v.push(case(
                        class,
                        format!("{a} then {b} (handle={})", h.name()),
                        vec![Export(a, h), Export(b, h)],
                    ));
                }
            }
            v.push(case(
                class,
                format!("{a} inside a group (handle={})", h.name()),
                vec![GroupStart, Export(a, h), GroupEnd],
            ));
        }
    }
}

/// Variables whose values the environment cases set.
fn flashcomm_variables() -> Vec<&'static str> {
    flashcomm_config::variables()
        .into_iter()
        .map(|s| s.name)
        .filter(|n| n.starts_with("FLASHCOMM_") && *n != "FLASHCOMM_NCCL_LIB")
        .collect()
}

fn environment(v: &mut Vec<Case>) {
    let values: [(&str, OsString); 6] = [
        ("empty", OsString::new()),
        ("overlong", OsString::from("9".repeat(100_000))),
        (
            "not UTF-8",
            OsStr::from_bytes(b"\xff\xfe4\x80").to_os_string(),
        ),
        ("whitespace", OsString::from(" \t\n ")),
        ("negative", OsString::from("-1")),
        ("huge", OsString::from("99999999999999999999999999999")),
    ];
    for var in flashcomm_variables() {
        for (what, value) in &values {
            let mut c = case("environment", format!("{var} {what}"), vec![Step::Probe]);
            c.env.push((var.to_string(), value.clone()));
            v.push(c);
        }
    }
    let mut c = case(
        "environment",
        "an unknown FLASHCOMM_ name",
        vec![Step::Probe],
    );
    c.env.push(("FLASHCOMM_PROTOCOL".into(), "ll".into()));
    v.push(c);
    let mut c = case(
        "environment",
        "every FLASHCOMM_ variable bad at once",
        vec![Step::Probe],
    );
    for var in flashcomm_variables() {
        c.env.push((var.to_string(), "-1".into()));
    }
    v.push(c);
}

/// Files the library-path cases point `FLASHCOMM_NCCL_LIB` at (made by the driver; a child
/// only needs the list's order, not the paths).
struct Paths {
    dir: PathBuf,
    real: PathBuf,
    ours: PathBuf,
}

impl Paths {
    fn get(&self, name: &str) -> OsString {
        self.dir.join(name).into_os_string()
    }

    fn in_child() -> Paths {
        Paths {
            dir: PathBuf::from("/nonexistent"),
            real: PathBuf::from("/nonexistent/real"),
            ours: PathBuf::from("/nonexistent/ours"),
        }
    }
}

fn make_paths() -> Paths {
    let dir = scratch("sxs-paths");
    let real = std::fs::read(real_lib()).unwrap();
    std::fs::write(dir.join("truncated.so"), &real[..real.len() / 2]).unwrap();
    std::fs::write(dir.join("header.so"), &real[..64]).unwrap();
    std::fs::write(dir.join("empty.so"), b"").unwrap();
    std::fs::write(dir.join("text.so"), b"INPUT(libnccl.so.2)\n").unwrap();
    std::fs::create_dir_all(dir.join("folder")).unwrap();
    for (link, target) in [
        ("flashcomm-link.so", cdylib()),
        ("real-link.so", real_lib()),
    ] {
        let _ = std::fs::remove_file(dir.join(link));
        std::os::unix::fs::symlink(target, dir.join(link)).unwrap();
    }
    std::fs::copy(cdylib(), dir.join("flashcomm-copy.so")).unwrap();
    std::fs::create_dir_all(dir.join("ld-path")).unwrap();
    let _ = std::fs::remove_file(dir.join("ld-path/libnccl.so.2"));
    std::os::unix::fs::symlink(real_lib(), dir.join("ld-path/libnccl.so.2")).unwrap();
    Paths {
        dir,
        real: real_lib(),
        ours: cdylib(),
    }
}

fn library_paths(v: &mut Vec<Case>, p: &Paths) {
    let stricter: [(&str, OsString); 12] = [
        ("missing", p.get("missing.so")),
        ("a folder", p.get("folder")),
        ("a text file", p.get("text.so")),
        ("an empty file", p.get("empty.so")),
        ("a truncated ELF file", p.get("truncated.so")),
        ("an ELF header only", p.get("header.so")),
        ("flashcomm itself", p.ours.clone().into_os_string()),
        ("a link to flashcomm", p.get("flashcomm-link.so")),
        ("a copy of flashcomm", p.get("flashcomm-copy.so")),
        ("a bare name", "libnccl.so.2".into()),
        ("a relative path", "./libnccl.so.2".into()),
        (
            "not UTF-8",
            OsStr::from_bytes(b"/tmp/\xff.so").to_os_string(),
        ),
    ];
    for (what, path) in stricter {
        let mut c = case("real library path", what, vec![Step::Probe]);
        c.nccl_lib = Some(path);
        c.expect = Expect::NoRealLibrary;
        v.push(c);
    }
    // Empty or blank counts as unset: the library looks for the real NCCL itself (here on
    // LD_LIBRARY_PATH).
    for (what, value) in [
        ("empty (unset: found on LD_LIBRARY_PATH)", ""),
        ("whitespace (unset: found on LD_LIBRARY_PATH)", " \t "),
    ] {
        let mut c = case("real library path", what, vec![Step::Probe]);
        c.nccl_lib = Some(value.into());
        c.env.push(("LD_LIBRARY_PATH".into(), p.get("ld-path")));
        v.push(c);
    }
    for (what, path) in [
        ("a link to the real library", p.get("real-link.so")),
        (
            "the real library by a path with `//`",
            p.real.to_string_lossy().replacen('/', "//", 1).into(),
        ),
    ] {
        let mut c = case("real library path", what, vec![Step::Probe]);
        c.nccl_lib = Some(path);
        v.push(c);
    }
}

fn threads(v: &mut Vec<Case>) {
    use Step::*;
    let bad = vec![
        Coll("ncclAllReduce", Handle::Null, CollArgs::on(0)),
        Coll("ncclAllReduce", Handle::Foreign, CollArgs::on(0)),
        GroupStart,
        Coll("ncclSend", Handle::Null, CollArgs::on(0)),
        GroupEnd,
        Export("ncclCommCount", Handle::Foreign),
        Export("ncclGetVersion", Handle::Foreign),
    ];
    for n in [2, 8, 32] {
        v.push(case(
            "threads",
            format!("{n} threads, bad calls and groups, 100 rounds"),
            vec![Threads(n, 100, bad.clone())],
        ));
    }
    v.push(case(
        "threads",
        "8 threads, first calls at once",
        vec![Threads(
            8,
            1,
            vec![Export("ncclGetVersion", Handle::Foreign), Probe],
        )],
    ));
}

// ------------------------------------------------------------------------------------------
// The child: runs one case against one library and prints the transcript.
// ------------------------------------------------------------------------------------------

struct Run<'a> {
    lib: &'a Lib,
    out: String,
}

impl Run<'_> {
    fn last_error(&self) -> String {
        let f: unsafe extern "C" fn(*mut c_void) -> *const c_char =
            self.lib.get("ncclGetLastError");
        // SAFETY: NULL is a valid communicator argument of ncclGetLastError.
        text(unsafe { f(std::ptr::null_mut()) })
    }

    /// One call, then `ncclGetLastError`.
    fn call(&mut self, label: &str, (ret, is_error): (String, Option<bool>)) {
        let err = match is_error {
            Some(true) => "error",
            Some(false) => "ok",
            None => "value",
        };
        let last = self.last_error();
        let _ = writeln!(self.out, "{label} -> {ret} [{err}] | last error {last}");
        flush_stdout();
    }

    fn step(&mut self, s: &Step) {
        match s {
            Step::Export(name, h) => {
                let e = generated::exports()
                    .into_iter()
                    .find(|e| e.name == *name)
                    .unwrap();
                let r = (e.call)(self.lib, *h);
                self.call(&format!("{name}({})", h.name()), r);
            }
            Step::Coll(name, h, a) => {
                let s = scratch_mem();
                let fix = |p: usize| match p {
                    0 => 0,
                    x if x >= scratch_addr_placeholder() => s + (x - scratch_addr_placeholder()),
                    x => x,
                };
                let a = CollArgs {
                    comm: h.addr(),
                    send: fix(a.send),
                    recv: fix(a.recv),
                    ..*a
                };
                let rc = call_collective(self.lib, name, &a);
                self.call(name, (rc.to_string(), Some(rc != 0 && rc != 7)));
            }
            Step::GroupStart => self.simple("ncclGroupStart"),
            Step::GroupEnd => self.simple("ncclGroupEnd"),
            Step::SimulateEnd(info) => {
                let f: unsafe extern "C" fn(usize) -> c_int = self.lib.get("ncclGroupSimulateEnd");
                let p = if *info { zeroed_sim_info() } else { 0 };
                // SAFETY: NULL, or zeroed memory of the struct's size.
                let rc = unsafe { f(p) };
                self.call("ncclGroupSimulateEnd", (rc.to_string(), Some(rc != 0)));
            }
            Step::Probe => {
                for s in probe() {
                    self.step(&s);
                }
            }
            Step::Threads(n, rounds, steps) => self.threads(*n, *rounds, steps),
        }
    }

    fn simple(&mut self, name: &str) {
        let f: unsafe extern "C" fn() -> c_int = self.lib.get(name);
        // SAFETY: no arguments.
        let rc = unsafe { f() };
        self.call(name, (rc.to_string(), Some(rc != 0 && rc != 7)));
    }

    /// Many threads at once: each thread's transcript lines, without `ncclGetLastError` (one
    /// message for the whole process in NCCL, so which thread's failure it names is a race), are
    /// counted; the counts are the transcript.
    fn threads(&mut self, n: usize, rounds: usize, steps: &[Step]) {
        let lib = self.lib;
        let lines: Vec<Vec<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|_| {
                    s.spawn(move || {
                        let mut lines = Vec::new();
                        for _ in 0..rounds {
                            let mut r = Run {
                                lib,
                                out: String::new(),
                            };
                            for st in steps {
                                r.step(st);
                            }
                            lines.extend(r.out.lines().map(|l| {
                                // NCCL keeps one message for the process, which other threads
                                // rewrite while this one reads it: not compared.
                                let (call, _) = l.split_once(" | last error ").unwrap();
                                format!("{call} | last error (one per process, not compared)")
                            }));
                        }
                        lines
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut counts = std::collections::BTreeMap::new();
        for l in lines.into_iter().flatten() {
            *counts.entry(l).or_insert(0usize) += 1;
        }
        for (l, k) in counts {
            let _ = writeln!(self.out, "{k} x {l}");
        }
    }
}

/// `ncclSimInfo_t` sized zeroed memory (its magic is not NCCL_SIM_INFO_INITIALIZER's).
fn zeroed_sim_info() -> usize {
    scratch_mem() + 4096
}

/// The probe script of the environment and library cases.
fn probe() -> Vec<Step> {
    use Step::*;
    vec![
        Export("ncclGetVersion", Handle::Foreign),
        Export("ncclGetErrorString", Handle::Foreign),
        Coll("ncclAllReduce", Handle::Null, CollArgs::on(0)),
        Coll(
            "ncclAllReduce",
            Handle::Foreign,
            CollArgs {
                count: 0,
                ..CollArgs::on(0)
            },
        ),
        GroupStart,
        Coll("ncclSend", Handle::Null, CollArgs::on(0)),
        GroupEnd,
        Export("ncclCommCount", Handle::Foreign),
        Export("ncclGetUniqueId", Handle::Foreign),
        Export("ncclCommInitRank", Handle::Foreign),
    ]
}

fn flush_stdout() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

const CHILD: &str = "SXS_CASE";

/// The child's entry point (a test that does nothing unless the driver started it).
#[test]
fn side_by_side_case() {
    let Ok(index) = std::env::var(CHILD) else {
        return;
    };
    let index: usize = index.parse().unwrap();
    let lib = Lib::open(Path::new(&std::env::var_os("SXS_LIB").unwrap()));
    let c = &cases(&Paths::in_child())[index];
    let mut run = Run {
        lib: &lib,
        out: String::new(),
    };
    for s in &c.steps {
        run.step(s);
        // Each call's line as soon as it is made: a crash or hang keeps what came before.
        print!("{}", std::mem::take(&mut run.out));
        flush_stdout();
    }
    println!("END");
    flush_stdout();
    // SAFETY: leaves at once, without the libraries' exit handlers or the harness's report (the
    // same for both libraries; flashcomm's exit summary is not part of the comparison).
    unsafe { libc::_exit(0) };
}

// ------------------------------------------------------------------------------------------
// The driver.
// ------------------------------------------------------------------------------------------

/// How one run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    /// The transcript (stdout).
    transcript: String,
    ended: Ended,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Exited(i32),
    Signal(i32),
    Hung,
}

impl Ended {
    fn show(self) -> String {
        match self {
            Ended::Exited(0) => "exits".into(),
            Ended::Exited(c) => format!("exits with {c}"),
            Ended::Signal(s) => format!("dies of signal {s}"),
            Ended::Hung => "hangs".into(),
        }
    }
}

/// How long one run may take.
const LIMIT: Duration = Duration::from_secs(20);
/// More runs of a case whose two runs ended differently (neither hanging).
const RETRIES: usize = 20;

fn run_case(index: usize, c: &Case, ours: bool) -> Outcome {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    // A folder of its own as the working directory: a case's value may name a file (a log file
    // of "-1"), which must not land in the source tree.
    cmd.current_dir(scratch("sxs-cwd"));
    cmd.args([
        "side_by_side_case",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ]);
    // Nothing of this machine's environment decides where the real NCCL is found.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("FLASHCOMM_")
            || k.starts_with("NCCL_")
            || k == "LD_LIBRARY_PATH"
            || k == "CUDA_HOME"
        {
            cmd.env_remove(&*k);
        }
    }
    for (k, v) in &c.env {
        cmd.env(k, v);
    }
    cmd.env(CHILD, index.to_string());
    if ours {
        cmd.env("SXS_LIB", cdylib());
        cmd.env(
            "FLASHCOMM_NCCL_LIB",
            c.nccl_lib.clone().unwrap_or_else(|| real_lib().into()),
        );
    } else {
        cmd.env("SXS_LIB", real_lib());
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().expect("start a case");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut s);
        s
    });
    let deadline = Instant::now() + LIMIT;
    let ended = loop {
        match child.try_wait().unwrap() {
            Some(status) => {
                use std::os::unix::process::ExitStatusExt;
                break match status.signal() {
                    Some(s) => Ended::Signal(s),
                    None => Ended::Exited(status.code().unwrap_or(-1)),
                };
            }
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break Ended::Hung;
            }
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let raw = String::from_utf8_lossy(&reader.join().unwrap()).into_owned();
    // Only the case's own lines (the harness prints its own around them).
    let transcript = raw
        .lines()
        .map(|l| l.strip_prefix("test side_by_side_case ... ").unwrap_or(l))
        .filter(|l| !l.starts_with("running ") && !l.is_empty())
        .map(|l| format!("{}\n", without_addresses(l)))
        .collect();
    Outcome { transcript, ended }
}

/// `l` with every hexadecimal address (`0x7f...`) as `0x?`: where the libraries map memory
/// differs from process to process.
fn without_addresses(l: &str) -> String {
    let mut out = String::with_capacity(l.len());
    let mut rest = l;
    while let Some(i) = rest.find("0x") {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 2..];
        let n = tail.bytes().take_while(u8::is_ascii_hexdigit).count();
        out.push_str(if n > 0 { "0x?" } else { "0x" });
        rest = &tail[n..];
    }
    out.push_str(rest);
    out
}

/// One line of a transcript: label, result, whether an error, the last error.
struct Line<'a> {
    call: &'a str,
    result: &'a str,
    kind: &'a str,
    last: &'a str,
}

fn parse(line: &str) -> Option<Line<'_>> {
    let (head, last) = line.split_once(" | last error ")?;
    let (call, rest) = head.split_once(" -> ")?;
    let (result, kind) = rest.rsplit_once(" [")?;
    Some(Line {
        call,
        result,
        kind: kind.trim_end_matches(']'),
        last,
    })
}

/// Whether `ncclGetLastError` said nothing.
fn no_message(last: &str) -> bool {
    last == "\"\""
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    /// Nothing tells them apart.
    Same,
    /// The same results; flashcomm gives a message where NCCL gives none.
    Message,
    /// A difference docs/abi.md lists: flashcomm stricter on purpose, or a function the real
    /// library lacks.
    Documented,
    /// A failure of flashcomm.
    Fail(String),
}

impl Verdict {
    fn word(&self) -> &str {
        match self {
            Verdict::Same => "same",
            Verdict::Message => "same results, flashcomm adds a message",
            Verdict::Documented => "documented difference",
            Verdict::Fail(_) => "FAIL",
        }
    }
}

/// The verdict of a case from NCCL's run, more runs of NCCL (when the first two runs
/// differed), and flashcomm's run.
fn judge(c: &Case, real: &Outcome, again: &[Outcome], ours: &Outcome) -> Verdict {
    // Every error flashcomm returns has a message.
    for l in ours.transcript.lines().filter_map(parse) {
        if l.kind == "error" && no_message(l.last) {
            return Verdict::Fail(format!("{} returned {} with no message", l.call, l.result));
        }
    }
    let bad_end = |e: Ended| !matches!(e, Ended::Exited(0));
    if bad_end(ours.ended) && ours.ended != real.ended {
        return Verdict::Fail(format!(
            "flashcomm {} where NCCL {}",
            ours.ended.show(),
            real.ended.show()
        ));
    }
    if c.expect == Expect::NoRealLibrary {
        let ok = ours.ended == Ended::Exited(0)
            && ours.transcript.lines().filter_map(parse).all(|l| {
                l.kind != "ok"
                    || l.call.starts_with("ncclGetErrorString")
                    || l.call == "ncclGroupStart"
            });
        return if ok {
            Verdict::Documented
        } else {
            Verdict::Fail("a call succeeded without a usable real library".into())
        };
    }
    if ours.ended != real.ended {
        return Verdict::Fail(format!(
            "flashcomm {} where NCCL {}",
            ours.ended.show(),
            real.ended.show()
        ));
    }
    let (a, b): (Vec<&str>, Vec<&str>) = (
        real.transcript.lines().collect(),
        ours.transcript.lines().collect(),
    );
    if a.len() != b.len() {
        return Verdict::Fail(format!(
            "{} lines from NCCL, {} from flashcomm",
            a.len(),
            b.len()
        ));
    }
    // Lines where another run of NCCL answered differently are NCCL's to vary (a value read
    // from memory that is not a communicator).
    let mut varies = vec![false; a.len()];
    for g in again.iter().filter(|g| g.ended == real.ended) {
        let g: Vec<&str> = g.transcript.lines().collect();
        for (i, v) in varies.iter_mut().enumerate() {
            *v |= g.get(i) != Some(&a[i]);
        }
    }
    let mut verdict = Verdict::Same;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if x == y {
            continue;
        }
        if varies[i] && parse(x).map(|p| p.call) == parse(y).map(|q| q.call) {
            continue;
        }
        match (parse(x), parse(y)) {
            // flashcomm exports every function of the headers; it fails one the real library
            // lacks, with a message (docs/abi.md, "When the real library lacks a function").
            (Some(p), Some(q))
                if p.call == q.call && p.result == NOT_EXPORTED && q.kind == "error" =>
            {
                verdict = verdict.max(Verdict::Documented);
            }
            (Some(p), Some(q)) if p.call == q.call => {
                if p.result != q.result {
                    return Verdict::Fail(format!(
                        "{}: NCCL {} [{}], flashcomm {} [{}]",
                        p.call, p.result, p.kind, q.result, q.kind
                    ));
                }
                if no_message(p.last) && !no_message(q.last) {
                    verdict = verdict.max(Verdict::Message);
                } else {
                    return Verdict::Fail(format!(
                        "{}: NCCL's message {}, flashcomm's {}",
                        p.call, p.last, q.last
                    ));
                }
            }
            _ => return Verdict::Fail(format!("NCCL printed {x:?}, flashcomm {y:?}")),
        }
    }
    verdict
}

/// The committed table: between these markers in docs/testing.md.
const START: &str = "<!-- BEGIN GENERATED: side-by-side -->\n";
const END: &str = "<!-- END GENERATED: side-by-side -->";
/// The committed list of every case, relative to the repository's root.
const CASES_FILE: &str = "docs/results/side-by-side-cases.md";

fn table(cases: &[Case], verdicts: &[Verdict]) -> String {
    let mut classes: Vec<&str> = Vec::new();
    for c in cases {
        if !classes.contains(&c.class) {
            classes.push(c.class);
        }
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} cases. Each runs in a process of its own, once on the real NCCL and once on flashcomm \
         in front of it.\n",
        cases.len()
    );
    s.push_str("| class | cases | same | same results, flashcomm adds a message | documented difference | failed |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|\n");
    for class in &classes {
        let vs: Vec<&Verdict> = cases
            .iter()
            .zip(verdicts)
            .filter(|(c, _)| c.class == *class)
            .map(|(_, v)| v)
            .collect();
        let n = |f: fn(&Verdict) -> bool| vs.iter().filter(|v| f(v)).count();
        let _ = writeln!(
            s,
            "| {class} | {} | {} | {} | {} | {} |",
            vs.len(),
            n(|v| *v == Verdict::Same),
            n(|v| *v == Verdict::Message),
            n(|v| *v == Verdict::Documented),
            n(|v| matches!(v, Verdict::Fail(_))),
        );
    }
    let _ = writeln!(
        s,
        "\nEvery case and its verdict: [{CASES_FILE}]({}).",
        &CASES_FILE[5..]
    );
    s
}

/// Every case and its verdict: the whole of [`CASES_FILE`].
fn case_list(cases: &[Case], verdicts: &[Verdict]) -> String {
    let mut s = String::from(
        "# Side by side with the real NCCL: every case\n\nGenerated by \
         `crates/shim/tests/side_by_side.rs` (`FLASHCOMM_BLESS=1` rewrites it); what the classes \
         and verdicts mean: [docs/testing.md](../testing.md), \"Side by side with the real NCCL\".\n\n\
         | # | class | case | verdict |\n|---:|---|---|---|\n",
    );
    for (i, (c, v)) in cases.iter().zip(verdicts).enumerate() {
        let _ = writeln!(
            s,
            "| {i} | {} | `{}` | {} |",
            c.class,
            c.name.replace('|', "\\|"),
            v.word()
        );
    }
    s
}

#[test]
fn flashcomm_answers_bad_input_as_the_real_nccl_does() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let paths = make_paths();
    let all = cases(&paths);
    assert!(all.len() >= 600, "{} cases", all.len());
    // SXS_FILTER=<text>: only the cases whose class or name contains it (no table check).
    let filter = std::env::var("SXS_FILTER").ok();
    let chosen: Vec<usize> = (0..all.len())
        .filter(|&i| {
            filter
                .as_deref()
                .is_none_or(|f| all[i].class.contains(f) || all[i].name.contains(f))
        })
        .collect();
    let started = Instant::now();
    let next = AtomicUsize::new(0);
    type Runs = (Outcome, Vec<Outcome>, Outcome);
    let results: Mutex<Vec<Option<Runs>>> = Mutex::new(vec![None; all.len()]);
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 4);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while let Some(&i) = chosen.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let mut real = run_case(i, &all[i], false);
                    let mut ours = run_case(i, &all[i], true);
                    // Some bad handles make NCCL itself fault in one run and not in the next
                    // (what it reads there is not the same from run to run): such a case
                    // passes when flashcomm ends in a way NCCL also ends.
                    for _ in 0..RETRIES {
                        if real.ended == ours.ended
                            || real.ended == Ended::Hung
                            || ours.ended == Ended::Hung
                        {
                            break;
                        }
                        let r = run_case(i, &all[i], false);
                        if r.ended == ours.ended {
                            real = r;
                            break;
                        }
                        let o = run_case(i, &all[i], true);
                        if o.ended == real.ended {
                            ours = o;
                            break;
                        }
                    }
                    // Where the transcripts differ, a second run of NCCL shows which of its
                    // answers are its own to vary (values it reads from memory that is not a
                    // communicator).
                    let again: Vec<Outcome> =
                        if real.transcript != ours.transcript && real.ended == ours.ended {
                            (0..4).map(|_| run_case(i, &all[i], false)).collect()
                        } else {
                            Vec::new()
                        };
                    results.lock().unwrap()[i] = Some((real, again, ours));
                }
            });
        }
    });
    let results = results.into_inner().unwrap();
    let mut verdicts = Vec::new();
    let mut failures = String::new();
    for (i, (c, r)) in all.iter().zip(&results).enumerate() {
        let Some((real, again, ours)) = r.as_ref() else {
            verdicts.push(Verdict::Same);
            continue;
        };
        let v = judge(c, real, again, ours);
        if let Verdict::Fail(why) = &v {
            let _ = writeln!(
                failures,
                "#{i} {} / {}: {why}\n--- NCCL ({}):\n{}--- flashcomm ({}):\n{}",
                c.class,
                c.name,
                real.ended.show(),
                real.transcript,
                ours.ended.show(),
                ours.transcript
            );
        }
        verdicts.push(v);
    }
    println!(
        "{} cases, {} runs in {:.1} s",
        chosen.len(),
        2 * chosen.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{failures}");
    if filter.is_some() {
        return;
    }

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc_path = root.join("docs/testing.md");
    let doc = std::fs::read_to_string(&doc_path).unwrap();
    let want = format!("\n{}\n", table(&all, &verdicts));
    let start = doc.find(START).expect("start marker in docs/testing.md") + START.len();
    let end = start
        + doc[start..]
            .find(END)
            .expect("end marker in docs/testing.md");
    let cases_path = root.join(CASES_FILE);
    let cases_want = case_list(&all, &verdicts);
    let cases_now = std::fs::read_to_string(&cases_path).unwrap_or_default();
    if doc[start..end] == want && cases_now == cases_want {
        return;
    }
    if std::env::var_os("FLASHCOMM_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&doc_path, format!("{}{want}{}", &doc[..start], &doc[end..])).unwrap();
        std::fs::write(&cases_path, cases_want).unwrap();
        return;
    }
    panic!(
        "the side-by-side table in docs/testing.md or {CASES_FILE} is stale; rerun this test \
         with FLASHCOMM_BLESS=1 to rewrite them"
    );
}
