//! The one typed configuration of flashcomm.
//!
//! [`Config::from_vars`] reads every `FLASHCOMM_*` variable (and NCCL's `NCCL_DEBUG*`) once from
//! an iterator of `(name, value)` pairs, so tests need not touch the process environment; the
//! library calls [`Config::from_env`] once. Each variable is declared exactly once, in the
//! [`variables!`] invocations below: name, type, default, allowed values and meaning. The table in
//! `docs/env.md` is generated from those declarations (`cargo run -p xtask -- gen-env-doc`).
//!
//! A bad value never fails the job. It is reported as a [`Problem`] that names the variable, the
//! value and what is allowed; for a `FLASHCOMM_*` variable the library then passes every call
//! through to NCCL unchanged ([`Config::passthrough_forced`] holds the reason). A bad
//! `NCCL_DEBUG*` value only falls back to that variable's default, as NCCL itself does.
#![forbid(unsafe_code)]

mod quant;
pub mod testing;
pub mod values;

use std::ffi::OsStr;
use std::fmt;

pub use flashcomm_codec::{Collective, DType};
pub use quant::QuantSettings;
pub use values::{
    Algorithm, Bounded, Bytes, Choice, DebugLevel, Fault, FaultPoint, Faults, FunctionName, GIB,
    HostCopy, KIB, Keyword, LibPath, MIB, OneOf, Protocol, QuantBits, QuantChoice, Set, Subsystems,
    Text, Transport, Value,
};

/// The largest `FLASHCOMM_TIMEOUT_MS`: its nanoseconds still fit in the 64-bit timeout the
/// kernels receive.
pub const MAX_TIMEOUT_MS: u64 = u64::MAX / 1_000_000;

/// The declaration of one variable, as documented in `docs/env.md`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VarSpec {
    /// The environment variable.
    pub name: &'static str,
    /// Its type, for people.
    pub kind: &'static str,
    /// The default, in the variable's own syntax (`unset` when absent).
    pub default: String,
    /// The values it accepts.
    pub allowed: &'static str,
    /// What it does.
    pub meaning: String,
    /// Whether a bad value forces pass-through (`FLASHCOMM_*`) or only falls back to the default.
    pub strict: bool,
}

fn doc_text(lines: &[&str]) -> String {
    lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Declares a group of variables: a struct with one typed field per variable, its defaults, and
/// the parsing and documentation tables. Each entry reads
/// `/// meaning` `field: Type = default => { name, kind, allowed, strict }`.
macro_rules! variables {
    (
        $(#[$smeta:meta])*
        pub struct $group:ident;
        $(
            $(#[doc = $doc:literal])*
            $field:ident : $ty:ty = $default:expr => {
                name: $name:literal,
                kind: $kind:literal,
                allowed: $allowed:literal,
                strict: $strict:literal $(,)?
            }
        )*
    ) => {
        $(#[$smeta])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $group {
            $( $(#[doc = $doc])* #[doc = concat!("\n\nVariable: `", $name, "`.")] pub $field: $ty, )*
        }

        impl Default for $group {
            fn default() -> Self {
                $group { $( $field: $default, )* }
            }
        }

        impl $group {
            /// The declaration of every variable of this group, in declaration order.
            pub fn specs() -> Vec<VarSpec> {
                let d = Self::default();
                vec![$(VarSpec {
                    name: $name,
                    kind: $kind,
                    default: Value::show(&d.$field),
                    allowed: $allowed,
                    meaning: doc_text(&[$($doc),*]),
                    strict: $strict,
                }),*]
            }

            /// `(variable, value shown in the variable's syntax)` for every variable.
            pub fn shown(&self) -> Vec<(&'static str, String)> {
                vec![$(($name, Value::show(&self.$field))),*]
            }

            /// Parses `raw` into the field of variable `name`. `None`: not a variable of this group.
            fn apply(&mut self, name: &str, raw: &str) -> Option<Result<(), Option<String>>> {
                match name {
                    $($name => Some(<$ty as Value>::parse(raw).map(|v| self.$field = v)),)*
                    _ => None,
                }
            }
        }
    };
}

variables! {
    /// Everything that decides what the library does with a call.
    pub struct Settings;

    /// Path of the real `libnccl.so.2` to forward to. When unset, the library looks for it: an
    /// NCCL already loaded in the process, the one torch ships next to itself
    /// (`<site-packages>/nvidia/nccl/lib`), `LD_LIBRARY_PATH`, `$CUDA_HOME/lib64`, then the system
    /// folders (see `docs/abi.md`).
    nccl_lib: Option<LibPath> = None => {
        name: "FLASHCOMM_NCCL_LIB",
        kind: "path",
        allowed: "a file path containing `/` (a bare name is refused: it would find flashcomm itself)",
        strict: true,
    }
    /// Route every call to NCCL: flashcomm's own kernels take nothing.
    disable: bool = false => {
        name: "FLASHCOMM_DISABLE",
        kind: "bool",
        allowed: "`1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off`",
        strict: true,
    }
    /// Which collectives flashcomm's kernels may take; the others always go to NCCL.
    ops: Set<Collective> = Set(Collective::KERNELS.to_vec()) => {
        name: "FLASHCOMM_OPS",
        kind: "list",
        allowed: "comma list of `allreduce`, `reducescatter`, `allgather`, `alltoall`; or `none`",
        strict: true,
    }
    /// Device protocol of the kernels: chosen per call, or forced.
    proto: Choice<Protocol> = Choice::Auto => {
        name: "FLASHCOMM_PROTO",
        kind: "keyword",
        allowed: "`auto`, `ll`, `block`, `pull`, `direct`",
        strict: true,
    }
    /// Where the communicators' arenas live: device memory reached through peer access or CUDA
    /// IPC (`p2p`), pinned host memory every GPU maps (`host`, across PCIe, for GPUs without
    /// peer access), or `auto`: `p2p` where every pair of ranks has peer access, `host`
    /// otherwise.
    transport: Choice<Transport> = Choice::Auto => {
        name: "FLASHCOMM_TRANSPORT",
        kind: "keyword",
        allowed: "`auto`, `p2p`, `host`",
        strict: true,
    }
    /// Whether the lossless AllReduce (f16, bf16, f32) on the host transport moves its bytes with
    /// the copy engines (device-to-host and host-to-device copies synchronized by flags in host
    /// memory, docs/protocols.md "The copy-engine schedule") instead of kernels that store to and
    /// load from host memory. `on`: every such call made outside a graph capture; `auto`: those
    /// of at least 1 MiB (measured faster there at 2 and 4 ranks; not yet calibrated at set-up);
    /// `off` (the default while ranks whose calls disagree can leave a call of this path
    /// unreleased by the time limit, docs/protocols.md): never. Captured calls always take the
    /// kernels. Agreed by every rank like every `FLASHCOMM_*` setting.
    host_copy: HostCopy = HostCopy::Off => {
        name: "FLASHCOMM_HOST_COPY",
        kind: "keyword",
        allowed: "`off`, `on`, `auto`",
        strict: true,
    }
    /// All-reduce algorithm: chosen per call, or forced.
    algo: Choice<Algorithm> = Choice::Auto => {
        name: "FLASHCOMM_ALGO",
        kind: "keyword",
        allowed: "`auto`, `oneshot`, `twoshot`",
        strict: true,
    }
    /// Smallest message (bytes per rank) the lossless kernels take.
    min_bytes: Bytes = Bytes(0) => {
        name: "FLASHCOMM_MIN_BYTES",
        kind: "size",
        allowed: "bytes, with optional suffix `K`, `M`, `G` (powers of 1024); at most `FLASHCOMM_MAX_BYTES`",
        strict: true,
    }
    /// Largest message (bytes per rank) the lossless kernels take.
    max_bytes: Bytes = Bytes(GIB) => {
        name: "FLASHCOMM_MAX_BYTES",
        kind: "size",
        allowed: "bytes, with optional suffix `K`, `M`, `G` (powers of 1024)",
        strict: true,
    }
    /// Optional bound on every wait of a kernel for its peers, in milliseconds; when it expires
    /// the communicator reports `ncclTimeout` instead of waiting on. Unset: no time limit, as in
    /// NCCL (a wait lasts until the peer arrives or the application calls `ncclCommAbort`).
    timeout_ms: Option<Bounded<1, MAX_TIMEOUT_MS>> = None => {
        name: "FLASHCOMM_TIMEOUT_MS",
        kind: "integer",
        allowed: "unset (no time limit), or an integer in 1..=18446744073709 (the largest number of milliseconds whose nanoseconds fit in 64 bits, about 584 years)",
        strict: true,
    }
    /// Peer-visible memory flashcomm may allocate per communicator and rank.
    arena_bytes: Bytes = Bytes(64 * MIB) => {
        name: "FLASHCOMM_ARENA_BYTES",
        kind: "size",
        allowed: "bytes, with optional suffix `K`, `M`, `G` (powers of 1024)",
        strict: true,
    }
    /// Memory of the pull protocol per communicator and rank, beside the arena: two staging
    /// halves, so the pull protocol takes calls whose staged bytes (an AllReduce's message, an
    /// AllGather's input, a ReduceScatter's or AllToAll's whole input) fit in half of it (`0`:
    /// no pull protocol).
    pull_bytes: Bytes = Bytes(32 * MIB) => {
        name: "FLASHCOMM_PULL_BYTES",
        kind: "size",
        allowed: "bytes, with optional suffix `K`, `M`, `G` (powers of 1024)",
        strict: true,
    }
    /// Largest communicator (ranks) flashcomm's kernels serve; larger ones go to NCCL.
    max_ranks: Bounded<1, 8> = Bounded(8) => {
        name: "FLASHCOMM_MAX_RANKS",
        kind: "integer",
        allowed: "an integer in 1..=8",
        strict: true,
    }
    /// Payload width of the quantized AllReduce, for both steps (reduce-scatter and all-gather):
    /// 2..8 group-quantizes to that many bits per value; `off` and `16` keep the lossless kernels.
    /// `flashcommCommSetQuant` overrides it (and the other `FLASHCOMM_QUANT_*` widths, group,
    /// spikes and sizes) per communicator.
    quant_bits: QuantBits = QuantBits::Off => {
        name: "FLASHCOMM_QUANT_BITS",
        kind: "bits",
        allowed: "`off`, `16`, or an integer in 2..=8",
        strict: true,
    }
    /// Overrides `FLASHCOMM_QUANT_BITS` for the reduce-scatter step (the only step of one-shot).
    /// Kernels exist for equal widths and for an 8-bit all-gather after 2..4 bits; other pairs
    /// pass the AllReduce through to NCCL.
    quant_rs_bits: Option<QuantBits> = None => {
        name: "FLASHCOMM_QUANT_RS_BITS",
        kind: "bits",
        allowed: "`off`, `16`, or an integer in 2..=8",
        strict: true,
    }
    /// Overrides `FLASHCOMM_QUANT_BITS` for the all-gather step.
    quant_ag_bits: Option<QuantBits> = None => {
        name: "FLASHCOMM_QUANT_AG_BITS",
        kind: "bits",
        allowed: "`off`, `16`, or an integer in 2..=8",
        strict: true,
    }
    /// Overrides `FLASHCOMM_QUANT_BITS` for the quantized AllGather (one step: every rank's
    /// input encoded once, decoded by every rank). Applies when `allgather` is in
    /// `FLASHCOMM_QUANT_OPS`.
    quant_allgather_bits: Option<QuantBits> = None => {
        name: "FLASHCOMM_QUANT_ALLGATHER_BITS",
        kind: "bits",
        allowed: "`off`, `16`, or an integer in 2..=8",
        strict: true,
    }
    /// Overrides `FLASHCOMM_QUANT_BITS` for the quantized ReduceScatter (one step: each shard
    /// encoded once; its owner sums the decoded shards in f32 and writes full precision). Applies
    /// when `reducescatter` is in `FLASHCOMM_QUANT_OPS`.
    quant_reducescatter_bits: Option<QuantBits> = None => {
        name: "FLASHCOMM_QUANT_REDUCESCATTER_BITS",
        kind: "bits",
        allowed: "`off`, `16`, or an integer in 2..=8",
        strict: true,
    }
    /// Overrides `FLASHCOMM_QUANT_BITS` for the quantized AllToAll (one step: each per-peer block
    /// encoded once, decoded by its receiver). MoE dispatch and combine on one communicator share
    /// it; to give them different widths, call `flashcommCommSetQuant` between them (every rank
    /// alike) or use two communicators. Applies when `alltoall` is in `FLASHCOMM_QUANT_OPS`.
    quant_alltoall_bits: Option<QuantBits> = None => {
        name: "FLASHCOMM_QUANT_ALLTOALL_BITS",
        kind: "bits",
        allowed: "`off`, `16`, or an integer in 2..=8",
        strict: true,
    }
    /// Values per quantization group (one range per group).
    quant_group: OneOf<32, 64, 128, 256> = OneOf(128) => {
        name: "FLASHCOMM_QUANT_GROUP",
        kind: "integer",
        allowed: "`32`, `64`, `128`, `256`",
        strict: true,
    }
    /// Extreme values per group kept exactly (spike reserving); 0 switches it off.
    quant_spikes: OneOf<0, 2, 4, 4> = OneOf(2) => {
        name: "FLASHCOMM_QUANT_SPIKES",
        kind: "integer",
        allowed: "`0`, `2`, `4`",
        strict: true,
    }
    /// Smallest message (bytes per rank) that may be quantized.
    quant_min_bytes: Bytes = Bytes(0) => {
        name: "FLASHCOMM_QUANT_MIN_BYTES",
        kind: "size",
        allowed: "bytes, with optional suffix `K`, `M`, `G` (powers of 1024); at most `FLASHCOMM_QUANT_MAX_BYTES`",
        strict: true,
    }
    /// Largest message (bytes per rank) that may be quantized.
    quant_max_bytes: Bytes = Bytes(GIB) => {
        name: "FLASHCOMM_QUANT_MAX_BYTES",
        kind: "size",
        allowed: "bytes, with optional suffix `K`, `M`, `G` (powers of 1024)",
        strict: true,
    }
    /// Which collectives may be quantized (each at its width: `FLASHCOMM_QUANT_BITS`, or the
    /// collective's own `FLASHCOMM_QUANT_<COLLECTIVE>_BITS`). Every listed collective has
    /// quantized kernels for f16 and bf16.
    quant_ops: Set<Collective> = Set(vec![Collective::AllReduce]) => {
        name: "FLASHCOMM_QUANT_OPS",
        kind: "list",
        allowed: "comma list of `allreduce`, `reducescatter`, `allgather`, `alltoall`; or `none`",
        strict: true,
    }
    /// Element types that may be quantized; other types stay lossless. The kernels quantize
    /// `bf16` and `f16`; an `f32` AllReduce that asks for it passes through to NCCL.
    quant_dtypes: Set<DType> = Set(vec![DType::Bf16, DType::F16]) => {
        name: "FLASHCOMM_QUANT_DTYPES",
        kind: "list",
        allowed: "comma list of `bf16`, `f16`, `f32`",
        strict: true,
    }
    /// Which AllReduce calls that ask to be quantized run the quantized kernels: `auto` only
    /// those whose size the cost model, calibrated at communicator set-up with the quantized
    /// kernels too, predicts faster quantized than lossless (by more than 3%); the others run the
    /// lossless kernels (no quantization error, predicted at most 3% slower; on a fast link that
    /// can be every size), unless the size lies outside `FLASHCOMM_MIN_BYTES`..`FLASHCOMM_MAX_BYTES`,
    /// where they stay quantized. `always`: every one. Settings given by `flashcommCommSetQuant`
    /// that differ from the environment's were not timed at set-up and are always quantized.
    quant_choice: QuantChoice = QuantChoice::Auto => {
        name: "FLASHCOMM_QUANT_CHOICE",
        kind: "keyword",
        allowed: "`auto`, `always`",
        strict: true,
    }
    /// Folder of the kernel images (`<module>.fatbin`) for a library built without embedded
    /// kernels (the GPU test bundles, `FLASHCOMM_EMBED_KERNELS=0` at build time); when set, it
    /// is used instead of the embedded images. Read by the kernel loader, which refuses an image
    /// that is not the one this build compiled (its digest is embedded at build time): the
    /// communicator then stays with NCCL, saying which file.
    kernel_dir: Option<Text> = None => {
        name: "FLASHCOMM_KERNEL_DIR",
        kind: "path",
        allowed: "a folder holding the `.fatbin` files of the build",
        strict: true,
    }
    /// Fault injection for tests: the named API function panics inside flashcomm's panic
    /// boundary, which must turn it into `ncclInternalError` and a message.
    debug_panic: Option<FunctionName> = None => {
        name: "FLASHCOMM_DEBUG_PANIC",
        kind: "name",
        allowed: "an exported function name such as `ncclCommCount`",
        strict: true,
    }
    /// Fault injection for tests of the set-up's failure paths: a comma list of
    /// `point[:n][@rank]`, each making communicator set-up fail there on that rank (every rank
    /// without `@`): `hook-panic` (the creation hook panics first), `exchange-prepare` (the
    /// exchange's resources cannot be prepared as usual), `exchange-upload:n` (round `n`'s frame
    /// cannot be placed), `exchange-enqueue:n` (round `n`'s all-gather is refused once),
    /// `setup-panic:n` (a panic before the communicator's round `n`), `setup-step:n` (set-up step
    /// `n` fails). Whatever fails where, every rank must end served or with NCCL alike.
    debug_fault: Option<Faults> = None => {
        name: "FLASHCOMM_DEBUG_FAULT",
        kind: "list",
        allowed: "comma list of `point[:n][@rank]` with point `hook-panic`, `exchange-prepare`, `exchange-upload`, `exchange-enqueue`, `setup-panic`, `setup-step`",
        strict: true,
    }
    /// Order graph replays and eager calls of one communicator as NCCL's graph mixing does (on by
    /// default, as NCCL's `NCCL_GRAPH_MIXING_SUPPORT`): the first collective of the communicator
    /// captured into a CUDA graph waits, at each replay, for the communicator's last eager
    /// operation, and one event-record node beside the captured chain records, at each replay,
    /// an event that every later eager operation waits for. `0` leaves replays and eager calls
    /// on different streams unordered (docs/protocols.md, "Ordering with NCCL's own work and
    /// with graph replays").
    graph_mixing: bool = true => {
        name: "FLASHCOMM_GRAPH_MIXING",
        kind: "bool",
        allowed: "`1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off`",
        strict: true,
    }
    /// Let the next kernel of a stream launch as soon as a flashcomm kernel has started (compute
    /// capability 9.0 and later): a following flashcomm kernel, or any kernel launched with
    /// programmatic stream serialization, then waits on the GPU and starts the moment this one
    /// completes, without launch latency in between. Taken only where twice the grid fits the
    /// resident share of the GPU; `0` switches it off, and flashcomm's kernels are then launched
    /// plainly (without programmatic stream serialization).
    early_launch: bool = true => {
        name: "FLASHCOMM_EARLY_LAUNCH",
        kind: "bool",
        allowed: "`1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off`",
        strict: true,
    }
    /// Communicator set-up also times ReduceScatter, AllGather and AllToAll with each protocol
    /// (LL, BLOCK and the PULL protocol the communicator offers), so that their protocol is
    /// chosen from their own times rather than from the AllReduce's (on an H100 with 8 virtual
    /// ranks: within 5% of the fastest protocol at every size measured, against up to 1.4x
    /// slower). Set-up takes longer (H100): 34-286 ms more with 2-8 ranks as threads of one
    /// process, 0.2-0.5 s more with 4 rank processes, and about twice as long on the host
    /// transport (1.1-1.2 s to 2.4 s); hence off by default.
    calibrate_moves: bool = false => {
        name: "FLASHCOMM_CALIBRATE_MOVES",
        kind: "bool",
        allowed: "`1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off`",
        strict: true,
    }
    /// Zero-copy between processes: on the peer transport, the direct PULL protocol also
    /// serves ranks of different processes of one machine, and peers read a rank's buffers in
    /// place where it registered them (`ncclCommRegister`, `ncclCommWindowRegister`: memory of
    /// `cudaMalloc`, exported with legacy CUDA IPC, or of `ncclMemAlloc`, exported as a file
    /// descriptor that peers take with `pidfd_getfd`), and buffers of calls captured into a CUDA
    /// graph are exchanged at capture. An unregistered buffer, or one a peer has not mapped, is
    /// staged in the rank's own pull area, rank by rank, with the same results. Every import of
    /// a descriptor is authenticated (the owner's identity token), and peers close their
    /// mappings of deregistered buffers. `0` keeps the direct protocol to ranks of one process.
    zero_copy: bool = true => {
        name: "FLASHCOMM_ZERO_COPY",
        kind: "bool",
        allowed: "`1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off`",
        strict: true,
    }
    /// Run a group of `ncclSend`/`ncclRecv` that forms an all-to-all (one communicator, one
    /// stream, one datatype, exactly one send and one receive per rank, all of one count; the
    /// buffers may lie anywhere) as flashcomm's AllToAll. Off by default, because it is a promise
    /// the application makes: every rank's group of a call has that shape or none has (equal
    /// splits). A job whose groups differ between ranks (unequal splits that happen to be equal
    /// on one rank) would leave ranks on different libraries and hang. Other groups go to NCCL as
    /// written (docs/abi.md, "Send/Recv groups").
    grouped_alltoall: bool = false => {
        name: "FLASHCOMM_GROUPED_ALLTOALL",
        kind: "bool",
        allowed: "`1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off`",
        strict: true,
    }
    /// NCCL's pointer check, honoured on flashcomm's path too: the buffers of a call flashcomm's
    /// kernels take must be device memory of the communicator's device (or managed memory), or
    /// the call returns `ncclInvalidArgument`, as NCCL does.
    check_pointers: bool = false => {
        name: "NCCL_CHECK_POINTERS",
        kind: "bool",
        allowed: "`1`, `0` (NCCL's values; also `true`, `false`, `yes`, `no`, `on`, `off`)",
        strict: false,
    }
}

variables! {
    /// Where log lines go and which ones are written.
    pub struct Logging;

    /// NCCL's log level; flashcomm honours it for its own lines. Unset: warnings only.
    nccl_debug: Option<DebugLevel> = None => {
        name: "NCCL_DEBUG",
        kind: "keyword",
        allowed: "`VERSION`, `WARN`, `INFO`, `ABORT`, `TRACE`, `NONE` (any case)",
        strict: false,
    }
    /// Subsystems logged at INFO/TRACE (NCCL's default is `INIT,BOOTSTRAP,ENV`); `^` negates, `ALL`
    /// selects all. Each maps to the tracing target `flashcomm::<name in lower case>`.
    nccl_debug_subsys: Option<Subsystems> = None => {
        name: "NCCL_DEBUG_SUBSYS",
        kind: "list",
        allowed: "comma list of subsystem names (`INIT`, `COLL`, `P2P`, `ENV`, `ALLOC`, `CALL`, `TUNING`, ...), `ALL`, or `^` followed by a list",
        strict: false,
    }
    /// NCCL's log file (`%h` = host name, `%p` = process id). flashcomm writes its own lines to
    /// the same name with `.flashcomm` appended, because NCCL truncates and overwrites its file.
    nccl_debug_file: Option<Text> = None => {
        name: "NCCL_DEBUG_FILE",
        kind: "path",
        allowed: "a file path; `%h` and `%p` are expanded",
        strict: false,
    }
    /// `tracing` filter directives for flashcomm's lines (`EnvFilter` syntax, e.g.
    /// `flashcomm=info,flashcomm::coll=trace`); overrides `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS`.
    log: Option<Text> = None => {
        name: "FLASHCOMM_LOG",
        kind: "directives",
        allowed: "tracing `EnvFilter` directives",
        strict: true,
    }
    /// File for flashcomm's log lines (`%h` = host name, `%p` = process id); overrides
    /// `NCCL_DEBUG_FILE`. Default: standard error.
    log_file: Option<Text> = None => {
        name: "FLASHCOMM_LOG_FILE",
        kind: "path",
        allowed: "a file path; `%h` and `%p` are expanded",
        strict: true,
    }
}

/// `FLASHCOMM_*` variables that the build and the tests read; the library ignores them without
/// a warning.
pub const BUILD_VARIABLES: &[&str] = &[
    "FLASHCOMM_TOOLCHAIN",
    "FLASHCOMM_NCCL_HOME",
    "FLASHCOMM_CUDA_INCLUDE",
    "FLASHCOMM_CUDA_ARCHS",
    "FLASHCOMM_REQUIRE_KERNELS",
    "FLASHCOMM_NO_KERNELS",
    "FLASHCOMM_EMBED_KERNELS",
    "FLASHCOMM_CUDA_PTX",
    // Test and GPU-runner settings.
    "FLASHCOMM_SWEEP_MAX_MIB",
    "FLASHCOMM_DEADLINE",
    "FLASHCOMM_TEST_LIMIT",
    "FLASHCOMM_TEST_SEED",
    "FLASHCOMM_TEST_CHILD",
    "FLASHCOMM_BLESS",
    "FLASHCOMM_TEST_SKIPS",
];

/// A variable with a value the library cannot use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The variable.
    pub variable: &'static str,
    /// Its value as set.
    pub value: String,
    /// What the variable accepts.
    pub allowed: &'static str,
    /// More detail, when there is some.
    pub detail: Option<String>,
    /// Whether this problem forces pass-through (a `FLASHCOMM_*` variable).
    pub strict: bool,
}

/// How many characters of a bad value a message shows (a value may be arbitrarily long).
const SHOWN_CHARS: usize = 200;

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let chars = self.value.chars().count();
        if chars > SHOWN_CHARS {
            let head: String = self.value.chars().take(SHOWN_CHARS).collect();
            write!(
                f,
                "{}={head:?}... ({} bytes) is not valid",
                self.variable,
                self.value.len()
            )?;
        } else {
            write!(f, "{}={:?} is not valid", self.variable, self.value)?;
        }
        if let Some(d) = &self.detail {
            // A detail may quote the value too.
            if d.chars().count() > 2 * SHOWN_CHARS {
                let head: String = d.chars().take(2 * SHOWN_CHARS).collect();
                write!(f, " ({head}...)")?;
            } else {
                write!(f, " ({d})")?;
            }
        }
        write!(f, "; allowed: {}", self.allowed)
    }
}

/// `text` on one line (a value may hold line breaks; the problem text quotes it escaped, but
/// details from elsewhere may not).
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// The whole configuration, read once.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// What the library does with calls.
    pub settings: Settings,
    /// Logging.
    pub logging: Logging,
    /// `Some(reason)`: a setting was invalid, so every call is forwarded to NCCL unchanged.
    pub passthrough_forced: Option<String>,
    /// Every invalid value found, strict or not.
    pub problems: Vec<Problem>,
    /// `FLASHCOMM_*` variables that are set but not known (probably misspelt).
    pub unknown: Vec<String>,
    /// Variables that were set (to a non-empty value) and valid, in declaration order.
    pub set: Vec<&'static str>,
}

impl Default for Config {
    fn default() -> Self {
        Config::from_vars(std::iter::empty::<(&str, &str)>())
    }
}

/// Every variable the library reads, in declaration order: the settings, then logging.
pub fn variables() -> Vec<VarSpec> {
    let mut v = Settings::specs();
    v.extend(Logging::specs());
    v
}

impl Config {
    /// Reads the configuration from `(name, value)` pairs. Empty values count as unset.
    pub fn from_vars<I, K, V>(vars: I) -> Config
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let specs = variables();
        let mut settings = Settings::default();
        let mut logging = Logging::default();
        let mut problems = Vec::new();
        let mut unknown = Vec::new();
        let mut set_names = Vec::new();
        // The value of each variable read so far: a process's environment can hold two entries
        // of one name, and `getenv` (NCCL's, and every other reader's in the process) returns
        // the first; so does this.
        let mut first: Vec<(&'static str, std::ffi::OsString)> = Vec::new();
        for (k, v) in vars {
            let Some(key) = k.as_ref().to_str() else {
                continue;
            };
            let Some(spec) = specs.iter().find(|s| s.name == key) else {
                if key.starts_with("FLASHCOMM_") && !BUILD_VARIABLES.contains(&key) {
                    unknown.push(key.to_string());
                }
                continue;
            };
            if let Some((_, earlier)) = first.iter().find(|(n, _)| *n == spec.name) {
                if earlier.as_os_str() != v.as_ref() {
                    problems.push(Problem {
                        variable: spec.name,
                        value: v.as_ref().to_string_lossy().into_owned(),
                        allowed: spec.allowed,
                        detail: Some(format!(
                            "set twice in the environment; the first value, {:?}, is used, as \
                             getenv reads it",
                            earlier.to_string_lossy()
                        )),
                        strict: false,
                    });
                }
                continue;
            }
            first.push((spec.name, v.as_ref().to_os_string()));
            let Some(raw) = v.as_ref().to_str() else {
                problems.push(Problem {
                    variable: spec.name,
                    value: v.as_ref().to_string_lossy().into_owned(),
                    allowed: spec.allowed,
                    detail: Some("not valid UTF-8".into()),
                    strict: spec.strict,
                });
                continue;
            };
            if raw.trim().is_empty() {
                continue;
            }
            let result = settings
                .apply(key, raw)
                .or_else(|| logging.apply(key, raw))
                .expect("every spec belongs to a group");
            match result {
                Ok(()) => set_names.push(spec.name),
                Err(detail) => problems.push(Problem {
                    variable: spec.name,
                    value: raw.to_string(),
                    allowed: spec.allowed,
                    detail,
                    strict: spec.strict,
                }),
            }
        }
        // Keep declaration order, whatever the order of the environment.
        let set: Vec<&'static str> = specs
            .iter()
            .map(|s| s.name)
            .filter(|n| set_names.contains(n))
            .collect();
        unknown.sort();

        // Relations between variables.
        for (lo, hi, lo_name, hi_name) in [
            (
                settings.min_bytes,
                settings.max_bytes,
                "FLASHCOMM_MIN_BYTES",
                "FLASHCOMM_MAX_BYTES",
            ),
            (
                settings.quant_min_bytes,
                settings.quant_max_bytes,
                "FLASHCOMM_QUANT_MIN_BYTES",
                "FLASHCOMM_QUANT_MAX_BYTES",
            ),
        ] {
            if lo > hi {
                let spec = specs.iter().find(|s| s.name == lo_name).expect("declared");
                problems.push(Problem {
                    variable: spec.name,
                    value: lo.show(),
                    allowed: spec.allowed,
                    detail: Some(format!("larger than {hi_name}={}", hi.show())),
                    strict: true,
                });
            }
        }

        // Report in declaration order, whatever the order of the environment.
        problems.sort_by_key(|p: &Problem| specs.iter().position(|s| s.name == p.variable));
        let strict: Vec<String> = problems
            .iter()
            .filter(|p| p.strict)
            .map(ToString::to_string)
            .collect();
        let passthrough_forced = (!strict.is_empty()).then(|| {
            format!(
                "invalid configuration: {}; flashcomm forwards every call to NCCL unchanged",
                strict.join("; ")
            )
        });
        Config {
            settings,
            logging,
            passthrough_forced,
            problems,
            unknown,
            set,
        }
    }

    /// Reads the process environment (once, by the library).
    pub fn from_env() -> Config {
        Config::from_vars(std::env::vars_os())
    }

    /// Forces pass-through for a reason found outside this crate (for example a `FLASHCOMM_LOG`
    /// filter the logging library refuses). Reasons accumulate.
    pub fn force_passthrough(&mut self, reason: impl Into<String>) {
        let reason = reason.into();
        self.passthrough_forced = Some(match self.passthrough_forced.take() {
            Some(prev) => format!("{prev}; {reason}"),
            None => reason,
        });
    }

    /// Whether every call goes to NCCL: pass-through forced by a bad value, or `FLASHCOMM_DISABLE`.
    pub fn passthrough(&self) -> bool {
        self.passthrough_forced.is_some() || self.settings.disable
    }

    /// A digest of every setting that decides routing or what goes on the wire: every
    /// `FLASHCOMM_*` setting except `FLASHCOMM_NCCL_LIB` (where the real library lies may differ
    /// between ranks) and `FLASHCOMM_DISABLE` (sent separately, as the rank's verdict). Ranks
    /// compare digests when a communicator is set up; different digests keep the communicator
    /// with NCCL on every rank. FNV-1a over `name=value` lines, so it is the same on every
    /// machine and build.
    pub fn agreement_digest(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (name, value) in self.settings.shown() {
            if name == "FLASHCOMM_NCCL_LIB" || name == "FLASHCOMM_DISABLE" {
                continue;
            }
            for b in name
                .bytes()
                .chain([b'='])
                .chain(value.bytes())
                .chain([b'\n'])
            {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }

    /// Bits of the reduce-scatter step (`FLASHCOMM_QUANT_RS_BITS`, else `FLASHCOMM_QUANT_BITS`).
    pub fn quant_rs_bits(&self) -> QuantBits {
        self.settings
            .quant_rs_bits
            .unwrap_or(self.settings.quant_bits)
    }

    /// Bits of the all-gather step (`FLASHCOMM_QUANT_AG_BITS`, else `FLASHCOMM_QUANT_BITS`).
    pub fn quant_ag_bits(&self) -> QuantBits {
        self.settings
            .quant_ag_bits
            .unwrap_or(self.settings.quant_bits)
    }

    /// The quantization settings of the environment (what a communicator uses until
    /// `flashcommCommSetQuant` gives it its own).
    pub fn quant_settings(&self) -> QuantSettings {
        QuantSettings {
            rs_bits: self.quant_rs_bits(),
            ag_bits: self.quant_ag_bits(),
            allgather_bits: self
                .settings
                .quant_allgather_bits
                .unwrap_or(self.settings.quant_bits),
            reducescatter_bits: self
                .settings
                .quant_reducescatter_bits
                .unwrap_or(self.settings.quant_bits),
            alltoall_bits: self
                .settings
                .quant_alltoall_bits
                .unwrap_or(self.settings.quant_bits),
            group: self.settings.quant_group.0,
            spikes: self.settings.quant_spikes.0,
            min_bytes: self.settings.quant_min_bytes.0,
            max_bytes: self.settings.quant_max_bytes.0,
        }
    }

    /// The effective configuration, one `NAME=value` line per variable (`# default` marks values
    /// not set in the environment; `# not valid: ...` a value the library cannot use, which
    /// then keeps its default, with the variable, the value and what is allowed), then the
    /// pass-through state. The launcher reads these notes to refuse a bad setting before it
    /// starts a job (`python/flashcomm`), so the rules are the library's own.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for (name, value) in self
            .settings
            .shown()
            .into_iter()
            .chain(self.logging.shown())
        {
            let problems: Vec<String> = self
                .problems
                .iter()
                .filter(|p| p.variable == name)
                .map(|p| format!("  # not valid: {}", one_line(&p.to_string())))
                .collect();
            let note = if !problems.is_empty() {
                problems.concat()
            } else if self.set.contains(&name) {
                String::new()
            } else {
                "  # default".to_string()
            };
            s.push_str(&format!("{name}={value}{note}\n"));
        }
        match &self.passthrough_forced {
            Some(reason) => s.push_str(&format!("passthrough=forced: {reason}\n")),
            None if self.settings.disable => s.push_str("passthrough=FLASHCOMM_DISABLE\n"),
            None => s.push_str("passthrough=no\n"),
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        Config::from_vars(vars.iter().copied())
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]);
        assert_eq!(c.passthrough_forced, None);
        assert!(!c.passthrough());
        assert_eq!(c.settings.max_bytes, Bytes(GIB));
        assert_eq!(c.settings.arena_bytes, Bytes(64 * MIB));
        // No time limit unless asked for, as in NCCL.
        assert_eq!(c.settings.timeout_ms, None);
        assert_eq!(c.settings.max_ranks.0, 8);
        assert_eq!(c.settings.quant_group.0, 128);
        assert_eq!(c.settings.quant_spikes.0, 2);
        assert_eq!(c.quant_rs_bits(), QuantBits::Off);
        assert_eq!(
            c.settings.ops.show(),
            "allreduce,reducescatter,allgather,alltoall"
        );
        assert_eq!(c.settings.quant_dtypes.show(), "bf16,f16");
        assert_eq!(c.logging.nccl_debug, None);
    }

    #[test]
    fn timeout_is_unset_by_default_and_checked_against_overflow() {
        assert_eq!(cfg(&[]).settings.timeout_ms, None);
        let c = cfg(&[("FLASHCOMM_TIMEOUT_MS", "30000")]);
        assert_eq!(c.settings.timeout_ms, Some(Bounded(30_000)));
        let max = MAX_TIMEOUT_MS.to_string();
        let c = cfg(&[("FLASHCOMM_TIMEOUT_MS", max.as_str())]);
        assert_eq!(c.passthrough_forced, None, "{:?}", c.problems);
        // Its nanoseconds fit in the kernels' 64-bit timeout; one more would not.
        assert!(
            MAX_TIMEOUT_MS
                .checked_mul(1_000_000)
                .is_some_and(|ns| ns > 0)
        );
        assert!((MAX_TIMEOUT_MS + 1).checked_mul(1_000_000).is_none());
        for bad in [
            (MAX_TIMEOUT_MS + 1).to_string(),
            u64::MAX.to_string(),
            "0".to_string(),
            "-1".to_string(),
            "5s".to_string(),
        ] {
            let c = cfg(&[("FLASHCOMM_TIMEOUT_MS", bad.as_str())]);
            let why = c.passthrough_forced.as_deref().unwrap_or_default();
            assert!(why.contains("FLASHCOMM_TIMEOUT_MS"), "{bad}: {why}");
            assert!(why.contains(bad.as_str()), "{bad}: {why}");
            assert!(why.contains("18446744073709"), "{bad}: {why}");
        }
    }

    #[test]
    fn the_agreement_digest_covers_routing_and_wire_settings_only() {
        let base = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_MAX_BYTES", "16M"),
        ]);
        // Order of the environment, the real library's path, FLASHCOMM_DISABLE and logging do
        // not count.
        let same = cfg(&[
            ("FLASHCOMM_MAX_BYTES", "16M"),
            ("FLASHCOMM_NCCL_LIB", "/elsewhere/libnccl.so.2"),
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_DISABLE", "1"),
            ("NCCL_DEBUG", "INFO"),
        ]);
        assert_eq!(base.agreement_digest(), same.agreement_digest());
        // Writing a default explicitly is the same setting.
        let explicit = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_MAX_BYTES", "16M"),
            ("FLASHCOMM_PROTO", "auto"),
        ]);
        assert_eq!(base.agreement_digest(), explicit.agreement_digest());
        for (name, value) in [
            ("FLASHCOMM_QUANT_BITS", "8"),
            ("FLASHCOMM_PROTO", "ll"),
            ("FLASHCOMM_TIMEOUT_MS", "1000"),
            ("FLASHCOMM_ARENA_BYTES", "32M"),
            ("FLASHCOMM_OPS", "allreduce"),
            ("FLASHCOMM_QUANT_CHOICE", "always"),
            ("FLASHCOMM_CALIBRATE_MOVES", "1"),
            ("FLASHCOMM_ZERO_COPY", "0"),
        ] {
            let mut vars = vec![
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_MAX_BYTES", "16M"),
            ];
            vars.retain(|(n, _)| *n != name);
            vars.push((name, value));
            assert_ne!(
                base.agreement_digest(),
                cfg(&vars).agreement_digest(),
                "{name}={value}"
            );
        }
    }

    #[test]
    fn values_are_read() {
        let c = cfg(&[
            ("FLASHCOMM_PROTO", "ll"),
            ("FLASHCOMM_MAX_BYTES", "16M"),
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_AG_BITS", "8"),
            ("FLASHCOMM_NCCL_LIB", "/opt/nccl/libnccl.so.2"),
            ("NCCL_DEBUG", "info"),
            ("NCCL_DEBUG_SUBSYS", "INIT,COLL"),
            ("UNRELATED", "x"),
        ]);
        assert_eq!(c.passthrough_forced, None, "{:?}", c.problems);
        assert_eq!(c.settings.proto, Choice::Force(Protocol::Ll));
        assert_eq!(c.settings.max_bytes, Bytes(16 * MIB));
        assert_eq!(c.quant_rs_bits(), QuantBits::Bits(4));
        assert_eq!(c.quant_ag_bits(), QuantBits::Bits(8));
        // The one-step collectives follow FLASHCOMM_QUANT_BITS unless given their own width.
        let q = c.quant_settings();
        assert_eq!(
            (q.allgather_bits, q.reducescatter_bits, q.alltoall_bits),
            (QuantBits::Bits(4), QuantBits::Bits(4), QuantBits::Bits(4))
        );
        let own = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_ALLTOALL_BITS", "8"),
            ("FLASHCOMM_QUANT_REDUCESCATTER_BITS", "off"),
        ])
        .quant_settings();
        assert_eq!(own.op_bits(Collective::AlltoAll), Some(8));
        assert_eq!(own.op_bits(Collective::ReduceScatter), None);
        assert_eq!(own.op_bits(Collective::AllGather), Some(4));
        assert_eq!(own.op_bits(Collective::AllReduce), None);
        let bad = cfg(&[("FLASHCOMM_QUANT_ALLGATHER_BITS", "9")]);
        assert!(
            bad.passthrough_forced
                .as_deref()
                .is_some_and(|w| w.contains("FLASHCOMM_QUANT_ALLGATHER_BITS")),
            "{:?}",
            bad.passthrough_forced
        );
        assert_eq!(c.logging.nccl_debug, Some(DebugLevel::Info));
        // Declaration order, whatever the order of the environment.
        assert_eq!(
            c.set,
            [
                "FLASHCOMM_NCCL_LIB",
                "FLASHCOMM_PROTO",
                "FLASHCOMM_MAX_BYTES",
                "FLASHCOMM_QUANT_BITS",
                "FLASHCOMM_QUANT_AG_BITS",
                "NCCL_DEBUG",
                "NCCL_DEBUG_SUBSYS",
            ]
        );
    }

    #[test]
    fn a_bad_value_forces_passthrough_with_a_message_naming_it() {
        let c = cfg(&[("FLASHCOMM_PROTO", "fast"), ("FLASHCOMM_QUANT_BITS", "12")]);
        let reason = c.passthrough_forced.as_deref().expect("forced");
        assert!(
            reason.contains("FLASHCOMM_PROTO=\"fast\" is not valid"),
            "{reason}"
        );
        assert!(reason.contains("`auto`, `ll`, `block`"), "{reason}");
        assert!(reason.contains("FLASHCOMM_QUANT_BITS=\"12\""), "{reason}");
        assert!(reason.contains("forwards every call to NCCL"), "{reason}");
        assert!(c.passthrough());
        // The bad variables keep their defaults.
        assert_eq!(c.settings.proto, Choice::Auto);
        assert_eq!(c.problems.len(), 2);
    }

    #[test]
    fn a_bad_nccl_debug_is_only_a_warning() {
        let c = cfg(&[("NCCL_DEBUG", "LOUD")]);
        assert_eq!(c.passthrough_forced, None);
        assert_eq!(c.problems.len(), 1);
        assert!(!c.problems[0].strict);
        assert_eq!(c.logging.nccl_debug, None);
    }

    #[test]
    fn inverted_windows_are_problems() {
        let c = cfg(&[("FLASHCOMM_MIN_BYTES", "2M"), ("FLASHCOMM_MAX_BYTES", "1M")]);
        let reason = c.passthrough_forced.expect("forced");
        assert!(
            reason.contains("larger than FLASHCOMM_MAX_BYTES=1M"),
            "{reason}"
        );
    }

    #[test]
    fn empty_values_are_unset_and_unknown_names_are_listed() {
        let c = cfg(&[
            ("FLASHCOMM_PROTO", ""),
            ("FLASHCOMM_QUANT_BIT", "4"),
            ("FLASHCOMM_NCCL_HOME", "/x"),
        ]);
        assert_eq!(c.passthrough_forced, None);
        assert_eq!(c.unknown, vec!["FLASHCOMM_QUANT_BIT".to_string()]);
        assert!(c.set.is_empty());
    }

    #[test]
    fn bare_library_names_are_refused() {
        let c = cfg(&[("FLASHCOMM_NCCL_LIB", "libnccl.so.2")]);
        assert!(c.passthrough_forced.unwrap().contains("FLASHCOMM_NCCL_LIB"));
        assert_eq!(c.settings.nccl_lib, None);
    }

    #[test]
    fn describe_names_each_bad_value_on_its_variables_line() {
        let c = cfg(&[
            ("FLASHCOMM_PROTO", "fast"),
            ("FLASHCOMM_QUANT_BITS", "9"),
            ("NCCL_DEBUG", "LOUD"),
            ("FLASHCOMM_MIN_BYTES", "2M"),
            ("FLASHCOMM_MAX_BYTES", "1M"),
            ("FLASHCOMM_ALGO", "oneshot"),
        ]);
        let d = c.describe();
        let line = |name: &str| {
            d.lines()
                .find(|l| l.starts_with(&format!("{name}=")))
                .unwrap()
                .to_string()
        };
        assert_eq!(
            line("FLASHCOMM_PROTO"),
            "FLASHCOMM_PROTO=auto  # not valid: FLASHCOMM_PROTO=\"fast\" is not valid; allowed: \
             `auto`, `ll`, `block`, `pull`, `direct`"
        );
        assert!(
            line("FLASHCOMM_QUANT_BITS").contains("# not valid: FLASHCOMM_QUANT_BITS=\"9\""),
            "{d}"
        );
        assert!(
            line("NCCL_DEBUG").contains("# not valid: NCCL_DEBUG=\"LOUD\""),
            "{d}"
        );
        assert!(
            line("FLASHCOMM_MIN_BYTES").contains("larger than FLASHCOMM_MAX_BYTES"),
            "{d}"
        );
        assert_eq!(line("FLASHCOMM_ALGO"), "FLASHCOMM_ALGO=oneshot");
        assert_eq!(
            line("FLASHCOMM_TRANSPORT"),
            "FLASHCOMM_TRANSPORT=auto  # default"
        );
        // A value with a line break stays on its line.
        let c = cfg(&[("FLASHCOMM_PROTO", "a\nb")]);
        assert_eq!(c.describe().lines().count(), variables().len() + 1);
    }

    #[test]
    fn describe_lists_every_variable() {
        let mut c = cfg(&[("FLASHCOMM_ALGO", "twoshot")]);
        let d = c.describe();
        for spec in variables() {
            assert!(
                d.contains(&format!("{}=", spec.name)),
                "{} missing",
                spec.name
            );
        }
        assert!(d.contains("FLASHCOMM_ALGO=twoshot\n"));
        assert!(d.contains("FLASHCOMM_PROTO=auto  # default\n"));
        assert!(d.ends_with("passthrough=no\n"));
        c.force_passthrough("bad FLASHCOMM_LOG");
        assert!(
            c.describe()
                .contains("passthrough=forced: bad FLASHCOMM_LOG")
        );
    }

    #[test]
    fn quantization_defaults_are_lossless() {
        let q = cfg(&[]).quant_settings();
        assert_eq!(q.rs_bits, QuantBits::Off);
        assert_eq!(q.ag_bits, QuantBits::Off);
        assert_eq!((q.group, q.spikes), (128, 2));
        assert_eq!((q.min_bytes, q.max_bytes), (0, GIB));
        assert_eq!(q.widths(), None);
        assert!(q.in_window(0) && q.in_window(GIB) && !q.in_window(GIB + 1));
        assert_eq!(q.validate(), Ok(()));
        assert_eq!(
            q.to_string(),
            "rs off bits, ag off bits, allgather off bits, reducescatter off bits, alltoall off bits, group 128, spikes 2, window [0, 1G]"
        );
    }

    #[test]
    fn quantization_variables_are_read() {
        let c = cfg(&[
            ("FLASHCOMM_QUANT_BITS", "4"),
            ("FLASHCOMM_QUANT_GROUP", "64"),
            ("FLASHCOMM_QUANT_SPIKES", "0"),
            ("FLASHCOMM_QUANT_MIN_BYTES", "64K"),
            ("FLASHCOMM_QUANT_MAX_BYTES", "256M"),
            ("FLASHCOMM_QUANT_OPS", "allreduce,reducescatter"),
            ("FLASHCOMM_QUANT_DTYPES", "bf16,f32"),
        ]);
        assert_eq!(c.passthrough_forced, None, "{:?}", c.problems);
        let q = c.quant_settings();
        assert_eq!(q.widths(), Some((4, 4)));
        assert_eq!((q.group, q.spikes), (64, 0));
        assert_eq!((q.min_bytes, q.max_bytes), (64 * KIB, 256 * MIB));
        assert!(!q.in_window(64 * KIB - 1) && q.in_window(64 * KIB));
        assert_eq!(
            c.settings.quant_ops.0,
            vec![Collective::AllReduce, Collective::ReduceScatter]
        );
        assert_eq!(c.settings.quant_dtypes.0, vec![DType::Bf16, DType::F32]);
    }

    #[test]
    fn per_step_widths_override_the_common_one() {
        let q = |vars: &[(&str, &str)]| cfg(vars).quant_settings().widths();
        assert_eq!(q(&[("FLASHCOMM_QUANT_BITS", "3")]), Some((3, 3)));
        assert_eq!(
            q(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ]),
            Some((4, 8))
        );
        assert_eq!(
            q(&[
                ("FLASHCOMM_QUANT_RS_BITS", "2"),
                ("FLASHCOMM_QUANT_AG_BITS", "8")
            ]),
            Some((2, 8))
        );
        // Either step lossless (off or 16): the AllReduce stays lossless.
        assert_eq!(
            q(&[
                ("FLASHCOMM_QUANT_BITS", "4"),
                ("FLASHCOMM_QUANT_RS_BITS", "off")
            ]),
            None
        );
        assert_eq!(q(&[("FLASHCOMM_QUANT_BITS", "16")]), None);
        assert_eq!(
            q(&[
                ("FLASHCOMM_QUANT_BITS", "16"),
                ("FLASHCOMM_QUANT_AG_BITS", "4")
            ]),
            None
        );
        // A per-step variable alone does not switch quantization on for the other step.
        assert_eq!(q(&[("FLASHCOMM_QUANT_RS_BITS", "4")]), None);
    }

    #[test]
    fn bad_quantization_values_force_passthrough() {
        for (name, value) in [
            ("FLASHCOMM_QUANT_BITS", "1"),
            ("FLASHCOMM_QUANT_RS_BITS", "9"),
            ("FLASHCOMM_QUANT_AG_BITS", "four"),
            ("FLASHCOMM_QUANT_GROUP", "100"),
            ("FLASHCOMM_QUANT_SPIKES", "3"),
            ("FLASHCOMM_QUANT_MIN_BYTES", "-1"),
            ("FLASHCOMM_QUANT_OPS", "broadcast"),
            ("FLASHCOMM_QUANT_DTYPES", "fp8"),
        ] {
            let c = cfg(&[(name, value)]);
            let reason = c.passthrough_forced.clone().unwrap_or_default();
            assert!(reason.contains(name), "{name}={value}: {reason}");
            // The bad variable keeps its default.
            assert_eq!(c.quant_settings(), cfg(&[]).quant_settings(), "{name}");
        }
        let c = cfg(&[
            ("FLASHCOMM_QUANT_MIN_BYTES", "2M"),
            ("FLASHCOMM_QUANT_MAX_BYTES", "1M"),
        ]);
        assert!(
            c.passthrough_forced
                .unwrap()
                .contains("larger than FLASHCOMM_QUANT_MAX_BYTES=1M")
        );
    }

    #[test]
    fn quant_settings_from_outside_are_validated() {
        let good = cfg(&[("FLASHCOMM_QUANT_BITS", "4")]).quant_settings();
        assert_eq!(good.validate(), Ok(()));
        let bad = [
            QuantSettings { group: 100, ..good },
            QuantSettings { spikes: 3, ..good },
            QuantSettings {
                rs_bits: QuantBits::Bits(9),
                ..good
            },
            QuantSettings {
                ag_bits: QuantBits::Bits(1),
                ..good
            },
            QuantSettings {
                alltoall_bits: QuantBits::Bits(9),
                ..good
            },
            QuantSettings {
                allgather_bits: QuantBits::Bits(0),
                ..good
            },
            QuantSettings {
                min_bytes: 2,
                max_bytes: 1,
                ..good
            },
        ];
        for q in bad {
            assert!(q.validate().is_err(), "{q:?}");
        }
    }

    #[test]
    fn every_variable_is_documented_once() {
        let v = variables();
        let mut names: Vec<_> = v.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), v.len());
        for s in &v {
            assert!(!s.meaning.is_empty(), "{}", s.name);
            assert!(s.name.starts_with("FLASHCOMM_") == s.strict, "{}", s.name);
        }
    }
}
