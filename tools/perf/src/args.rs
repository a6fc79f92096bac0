//! Command-line options: nccl-tests' flags where they apply (`-b -e -f -i -n -w -c -d -o -G`,
//! short or long, `-b 8`, `-b8`, `--minbytes=8` and `--minbytes 8` alike) plus flashcomm's own.
//!
//! clap reads the command line (spellings, help text, unknown flags, missing values); this module
//! keeps what is flashcomm-perf's own: the value syntaxes (sizes with suffixes, type and width
//! lists), the `--preset` defaults that explicit flags override, and the rules between flags.
//! Parsing is pure (no GPU, no environment), so every rule here is unit-tested on the CPU.

use std::fmt;
use std::path::PathBuf;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, Parser, ValueEnum};

/// The collective under test: the tree's one collective enum.
pub use flashcomm_comm::Collective;

/// The collectives flashcomm-perf measures (flashcomm's kernels implement them).
pub const COLLECTIVES: [Collective; 4] = Collective::KERNELS;

/// Where the ranks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// N ranks share one GPU, one thread each (measures synchronization and compute, not links).
    Virtual,
    /// One GPU per rank, one thread per GPU, in this process.
    Gpus,
    /// One process per rank, rank r on GPU `--device + r` (as nccl-tests under a launcher).
    Procs,
    /// One process per rank, every rank on GPU `--device` (tests the process path on one GPU;
    /// needs CUDA MPS, or the processes' kernels time-slice and every wait crawls).
    ProcsOneGpu,
}

impl Mode {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Virtual => "virtual",
            Mode::Gpus => "gpus",
            Mode::Procs => "procs",
            Mode::ProcsOneGpu => "procs-one-gpu",
        }
    }

    /// Whether each rank is a process of its own.
    pub fn processes(self) -> bool {
        matches!(self, Mode::Procs | Mode::ProcsOneGpu)
    }

    /// Whether every rank uses the same GPU.
    pub fn one_gpu(self) -> bool {
        matches!(self, Mode::Virtual | Mode::ProcsOneGpu)
    }
}

/// Which library runs the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Impl {
    /// flashcomm's own kernels (lossless, plus the `--quant` widths).
    Flashcomm,
    /// The real NCCL, loaded by path.
    Nccl,
    /// The plain reference AllReduce (an LL one-shot kernel, the yardstick of decode latency).
    Reference,
    /// The pull reference AllReduce: the design of vLLM's and SGLang's custom all-reduce
    /// (peers' inputs loaded in place, flag barriers), written clean-room; 1-stage and 2-stage.
    PullReference,
}

impl Impl {
    /// The name on the command line and in the JSON file.
    pub fn name(self) -> &'static str {
        match self {
            Impl::Flashcomm => "flashcomm",
            Impl::Nccl => "nccl",
            Impl::Reference => "reference",
            Impl::PullReference => "pull-reference",
        }
    }

    /// Whether this is one of the reference kernels of the test kit.
    pub fn is_reference(self) -> bool {
        matches!(self, Impl::Reference | Impl::PullReference)
    }
}

/// How the reference kernels' ranks are launched (`--ref-launch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefLaunch {
    /// One launch per rank, on the rank's stream, from the rank's thread (as every
    /// implementation runs: an application's ranks launch their own kernels).
    PerRank,
    /// Every rank in one grid, launched by rank 0's thread on its stream (and under `-G`
    /// replayed from its one graph): what launching per rank costs shows beside the per-rank
    /// rows. Virtual ranks only.
    Single,
}

impl RefLaunch {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            RefLaunch::PerRank => "per-rank",
            RefLaunch::Single => "single",
        }
    }
}

/// Element types: the tree's one datatype enum (printed with nccl-tests' names, `long_name`).
pub use flashcomm_codec::DType as Dtype;

/// Every type, in the order `-d all` runs them.
pub const DTYPES: [Dtype; 3] = [Dtype::Bf16, Dtype::F16, Dtype::F32];

/// The words of the route a row forces (`--algo`, `--proto`, `--transport`, `--quant-choice`):
/// the library's own types, declared once in the codec crate.
pub use flashcomm_codec::{Algorithm, Choice, HostCopy, Keyword, Protocol, QuantChoice, Transport};

/// One quantized width: bits of the reduce-scatter step (the only step of one-shot) and of the
/// all-gather step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Width {
    /// Reduce-scatter (and one-shot) bits.
    pub rs: u8,
    /// All-gather bits.
    pub ag: u8,
}

impl fmt::Display for Width {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rs == self.ag {
            write!(f, "{}", self.rs)
        } else {
            write!(f, "{}/{}", self.rs, self.ag)
        }
    }
}

/// How the timed calls are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launch {
    /// One launch per call, CUDA events around each call.
    Eager,
    /// `-n` calls captured into one CUDA graph, replayed `-G` times, events around each replay.
    Graph,
}

impl Launch {
    /// The name in the table and the JSON file.
    pub fn name(self) -> &'static str {
        match self {
            Launch::Eager => "eager",
            Launch::Graph => "graph",
        }
    }
}

/// Named sets of defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// 8 virtual ranks, bf16, 8 KiB..1 MiB, one-shot AllReduce against a device copy of the same
    /// bytes, eager and under CUDA graphs.
    Latency,
}

/// Everything a run needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// `-b`: smallest message (bytes).
    pub min_bytes: u64,
    /// `-e`: largest message (bytes).
    pub max_bytes: u64,
    /// `-f`: multiplicative step (1: use `step_bytes`).
    pub step_factor: u64,
    /// `-i`: additive step when `step_factor` is 1.
    pub step_bytes: u64,
    /// `-n`: timed calls per size.
    pub iters: u32,
    /// `-w`: untimed calls before timing.
    pub warmup: u32,
    /// `-c`: check results.
    pub check: bool,
    /// `-d`: element types.
    pub dtypes: Vec<Dtype>,
    /// `-G`: CUDA-graph replays (0: eager only unless `--launch` says otherwise).
    pub graph_replays: u32,
    /// `--launch`: eager, graph or both (derived from `-G` when not given).
    pub launches: Vec<Launch>,
    /// `--coll`.
    pub coll: Collective,
    /// `--ranks`.
    pub ranks: u32,
    /// `--mode`.
    pub mode: Mode,
    /// `--impl`.
    pub impls: Vec<Impl>,
    /// `--ref-launch`: how the reference kernels' ranks are launched (one set of rows each).
    pub ref_launches: Vec<RefLaunch>,
    /// `--nccl-lib` (or `FLASHCOMM_NCCL_LIB`, filled in by the caller).
    pub nccl_lib: Option<PathBuf>,
    /// `--quant`: quantized widths to run besides lossless.
    pub quant: Vec<Width>,
    /// `--group`: values per quantization group.
    pub group: u16,
    /// `--spikes`: extreme values kept exactly per group.
    pub spikes: u8,
    /// `--quant-choice`: quantized AllReduce rows quantize every call, or only where it pays.
    pub quant_choice: QuantChoice,
    /// `--algo`.
    pub algo: Choice<Algorithm>,
    /// `--proto`.
    pub proto: Choice<Protocol>,
    /// `--transport`.
    pub transport: Choice<Transport>,
    /// `--json`.
    pub json: Option<PathBuf>,
    /// `--svg`.
    pub svg: Option<PathBuf>,
    /// `--device`: the GPU of virtual ranks, or the first GPU of `--mode gpus`.
    pub device: i32,
    /// `--copy-baseline`.
    pub copy_baseline: bool,
    /// `--preset`.
    pub preset: Option<Preset>,
    /// `--commit`.
    pub commit: Option<String>,
    /// `--inplace`: also time and check the in-place variant.
    pub inplace: bool,
    /// `--timeout`: bound on every device-side wait, seconds.
    pub timeout_s: u64,
    /// `--calibrate`: let the communicator time its cost model at set-up.
    pub calibrate: bool,
    /// `--calibrate-moves`: the calibration also times ReduceScatter, AllGather and AllToAll.
    pub calibrate_moves: bool,
    /// `--zero-copy`: zero-copy between processes (the library's default: on).
    pub zero_copy: bool,
    /// `--host-copy`: the host transport's lossless AllReduce by the copy engines.
    pub host_copy: HostCopy,
    /// `--arena-bytes`: each rank's arena (FLASHCOMM_ARENA_BYTES).
    pub arena_bytes: u64,
    /// `--pull-bytes`: each rank's pull area (FLASHCOMM_PULL_BYTES).
    pub pull_bytes: u64,
    /// `--register`: every rank's send and receive buffers registered with the communicator,
    /// collectively, as `ncclCommWindowRegister` registers them.
    pub register: bool,
    /// `--early-launch`: each kernel lets the next one launch as soon as it starts.
    pub early_launch: bool,
    /// `--graph-mixing`: captured calls ordered with eager ones through graph nodes.
    pub graph_mixing: bool,
    /// `--phase-trace`: flashcomm's kernels stamp where their time goes; rank 0 prints the
    /// medians beside each flashcomm row (a `#` line before it).
    pub phase_trace: bool,
    /// `--check-values`: most output values per quantized call compared with the CPU reference.
    pub check_values: u64,
    /// `--seed`: seed of the random inputs of quantized calls.
    pub seed: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            min_bytes: 32 << 20,
            max_bytes: 32 << 20,
            step_factor: 1,
            step_bytes: 1 << 20,
            iters: 20,
            warmup: 1,
            check: true,
            dtypes: vec![Dtype::Bf16],
            graph_replays: 0,
            launches: vec![Launch::Eager],
            coll: Collective::AllReduce,
            ranks: 8,
            mode: Mode::Virtual,
            impls: vec![Impl::Flashcomm],
            ref_launches: vec![RefLaunch::PerRank],
            nccl_lib: None,
            quant: Vec::new(),
            group: 128,
            spikes: 2,
            quant_choice: QuantChoice::Always,
            algo: Choice::Auto,
            proto: Choice::Auto,
            transport: Choice::Auto,
            json: None,
            svg: None,
            device: 0,
            copy_baseline: false,
            preset: None,
            commit: None,
            inplace: false,
            timeout_s: 60,
            calibrate: true,
            calibrate_moves: false,
            zero_copy: true,
            host_copy: flashcomm_comm::CommConfig::default().host_copy,
            arena_bytes: flashcomm_comm::CommConfig::default().arena_bytes,
            pull_bytes: flashcomm_comm::CommConfig::default().pull_bytes,
            register: false,
            early_launch: true,
            phase_trace: false,
            graph_mixing: true,
            check_values: 1 << 20,
            seed: 1,
        }
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Print the usage text.
    Help,
    /// Run a benchmark.
    Run(Box<Options>),
}

/// The widths of `--quant sweep`.
pub const SWEEP_WIDTHS: [u8; 5] = [8, 6, 4, 3, 2];

/// A command-line error, printed with a hint to `--help`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0} (see --help)")]
pub struct ArgError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, ArgError> {
    Err(ArgError(msg.into()))
}

/// Parses a byte count: digits with an optional suffix `K`, `M`, `G` or `T` (powers of 1024, any
/// case, optionally followed by `B` or `iB`).
pub fn parse_size(s: &str) -> Result<u64, ArgError> {
    let t = s.trim();
    let digits = t.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 {
        return err(format!(
            "'{s}' is not a size (digits with an optional K, M or G)"
        ));
    }
    let (num, suffix) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| ArgError(format!("'{s}' is too large")))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return err(format!("'{s}': unknown size suffix '{suffix}'")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| ArgError(format!("'{s}' is too large")))
}

fn parse_int<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, ArgError> {
    v.trim()
        .parse()
        .map_err(|_| ArgError(format!("{flag}: '{v}' is not a valid number")))
}

/// Parses `-d`: one type name (nccl-tests' names and a few aliases) or `all`.
pub fn parse_dtypes(v: &str) -> Result<Vec<Dtype>, ArgError> {
    let mut out = Vec::new();
    for part in v.split(',') {
        let t = match part.trim().to_ascii_lowercase().as_str() {
            "all" => {
                out.extend(DTYPES);
                continue;
            }
            "bfloat16" | "bf16" => Dtype::Bf16,
            "half" | "float16" | "f16" | "fp16" => Dtype::F16,
            "float" | "float32" | "f32" | "fp32" => Dtype::F32,
            other => {
                return err(format!(
                    "-d: '{other}' is not supported (bfloat16, half, float or all)"
                ));
            }
        };
        out.push(t);
    }
    let mut seen = Vec::new();
    out.retain(|t| {
        let new = !seen.contains(t);
        seen.push(*t);
        new
    });
    Ok(out)
}

/// Parses `--quant`: `sweep`, or a comma list of `bits` / `rs/ag`. Widths must be 2..=8 and the
/// all-gather width must equal the reduce-scatter width or be 8 (what the kernels implement).
pub fn parse_quant(v: &str) -> Result<Vec<Width>, ArgError> {
    let mut out: Vec<Width> = Vec::new();
    for part in v.split(',') {
        let part = part.trim();
        if part.eq_ignore_ascii_case("sweep") {
            out.extend(SWEEP_WIDTHS.iter().map(|&b| Width { rs: b, ag: b }));
            continue;
        }
        let (rs, ag) = match part.split_once('/') {
            Some((a, b)) => (
                parse_int::<u8>("--quant", a)?,
                parse_int::<u8>("--quant", b)?,
            ),
            None => {
                let b = parse_int::<u8>("--quant", part)?;
                (b, b)
            }
        };
        for b in [rs, ag] {
            if !(2..=8).contains(&b) {
                return err(format!("--quant: {b} bits is not in 2..8"));
            }
        }
        if ag != rs && ag != 8 {
            return err(format!(
                "--quant {rs}/{ag}: the all-gather width must equal the reduce-scatter width or be 8"
            ));
        }
        out.push(Width { rs, ag });
    }
    let mut dedup: Vec<Width> = Vec::new();
    for w in out {
        if !dedup.contains(&w) {
            dedup.push(w);
        }
    }
    Ok(dedup)
}

fn parse_impls(v: &str) -> Result<Vec<Impl>, ArgError> {
    let mut out = Vec::new();
    for part in v.split(',') {
        let i = match part.trim().to_ascii_lowercase().as_str() {
            "flashcomm" | "fc" => Impl::Flashcomm,
            "nccl" => Impl::Nccl,
            "reference" | "ref" => Impl::Reference,
            "pull-reference" | "pull" => Impl::PullReference,
            other => {
                return err(format!(
                    "--impl: '{other}' (flashcomm, nccl, reference, pull-reference)"
                ));
            }
        };
        if !out.contains(&i) {
            out.push(i);
        }
    }
    Ok(out)
}

/// Parses `--ref-launch`: `per-rank`, `single`, or both as a comma list (one set of reference
/// rows each, in the order given).
pub fn parse_ref_launches(v: &str) -> Result<Vec<RefLaunch>, ArgError> {
    let mut out = Vec::new();
    for part in v.split(',') {
        let l = match part.trim().to_ascii_lowercase().as_str() {
            "per-rank" | "perrank" => RefLaunch::PerRank,
            "single" | "one-grid" => RefLaunch::Single,
            other => return err(format!("--ref-launch: '{other}' (per-rank, single)")),
        };
        if !out.contains(&l) {
            out.push(l);
        }
    }
    Ok(out)
}

/// A list-valued flag's value (`-d`, `--impl`, `--quant`), kept whole: clap would otherwise read
/// a `Vec` field as a flag given several times.
#[derive(Clone, Debug)]
struct List<T>(Vec<T>);

fn coll_value(v: &str) -> Result<Collective, String> {
    Collective::from_name(v)
        .filter(|c| COLLECTIVES.contains(c))
        .ok_or_else(|| {
            format!("'{v}' is not a collective flashcomm-perf measures (allreduce, reducescatter, allgather, alltoall)")
        })
}

/// `auto`, or one of `T`'s keywords (ASCII case ignored).
fn choice_value<T: Keyword>(v: &str) -> Result<Choice<T>, String> {
    Choice::from_keyword(v).ok_or_else(|| {
        let names: Vec<&str> = T::KEYWORDS.iter().map(|k| k.keyword()).collect();
        format!("'{v}' is none of auto, {}", names.join(", "))
    })
}

/// `--algo`: as [`choice_value`], and `twostep` (the quantized AllReduce's name) for `twoshot`.
fn algo_value(v: &str) -> Result<Choice<Algorithm>, String> {
    if v.trim().eq_ignore_ascii_case("twostep") {
        return Ok(Choice::Force(Algorithm::TwoShot));
    }
    choice_value(v)
}

fn quant_choice_value(v: &str) -> Result<QuantChoice, String> {
    QuantChoice::from_keyword(v).ok_or_else(|| format!("'{v}' is none of always, auto"))
}

fn host_copy_value(v: &str) -> Result<HostCopy, String> {
    HostCopy::from_keyword(v).ok_or_else(|| format!("'{v}' is none of off, on, auto"))
}

fn size_value(v: &str) -> Result<u64, String> {
    parse_size(v).map_err(|e| e.0)
}

fn dtypes_value(v: &str) -> Result<List<Dtype>, String> {
    parse_dtypes(v).map(List).map_err(|e| e.0)
}

fn impls_value(v: &str) -> Result<List<Impl>, String> {
    parse_impls(v).map(List).map_err(|e| e.0)
}

fn ref_launches_value(v: &str) -> Result<List<RefLaunch>, String> {
    parse_ref_launches(v).map(List).map_err(|e| e.0)
}

fn quant_value(v: &str) -> Result<List<Width>, String> {
    parse_quant(v).map(List).map_err(|e| e.0)
}

fn bit_value(v: &str) -> Result<bool, String> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("'{v}' must be 0 or 1")),
    }
}

/// `--launch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LaunchArg {
    /// One launch per call.
    Eager,
    /// Calls captured into a CUDA graph and replayed.
    Graph,
    /// Both, one row each.
    Both,
}

const NCCL_TESTS: &str = "nccl-tests flags";
const FLASHCOMM: &str = "flashcomm flags";

/// The command line as clap reads it. Every field is optional: absent means "the default, or the
/// preset's value", so that [`parse`] can apply a `--preset` first and explicit flags over it.
#[derive(Debug, Parser)]
#[command(
    name = "flashcomm-perf",
    about = "flashcomm-perf: nccl-tests-style benchmark and accuracy tool for flashcomm",
    args_override_self = true,
    disable_version_flag = true,
    max_term_width = 100
)]
struct Cli {
    /// Smallest message, bytes; suffix K, M, G (powers of 1024) [32M]
    #[arg(short = 'b', long = "minbytes", value_name = "size", value_parser = size_value, help_heading = NCCL_TESTS)]
    min_bytes: Option<u64>,
    /// Largest message [32M]
    #[arg(short = 'e', long = "maxbytes", value_name = "size", value_parser = size_value, help_heading = NCCL_TESTS)]
    max_bytes: Option<u64>,
    /// Multiply the size by n each step [1: add --stepbytes]
    #[arg(short = 'f', long = "stepfactor", value_name = "n", help_heading = NCCL_TESTS)]
    step_factor: Option<u64>,
    /// Add this many bytes each step when -f is 1 [1M]
    #[arg(short = 'i', long = "stepbytes", value_name = "size", value_parser = size_value, help_heading = NCCL_TESTS)]
    step_bytes: Option<u64>,
    /// Timed calls per size [20]
    #[arg(short = 'n', long = "iters", value_name = "n", help_heading = NCCL_TESTS)]
    iters: Option<u32>,
    /// Untimed calls before timing [1]
    #[arg(short = 'w', long = "warmup_iters", value_name = "n", help_heading = NCCL_TESTS)]
    warmup: Option<u32>,
    /// Check every result (0: no) [1]
    #[arg(short = 'c', long = "check", value_name = "0|1", help_heading = NCCL_TESTS)]
    check: Option<u32>,
    /// bfloat16 | half | float | all (or a comma list) [bfloat16]
    #[arg(short = 'd', long = "datatype", value_name = "t", value_parser = dtypes_value, help_heading = NCCL_TESTS)]
    dtypes: Option<List<Dtype>>,
    /// sum (the only reduction flashcomm implements) [sum]
    #[arg(short = 'o', long = "op", value_name = "op", help_heading = NCCL_TESTS)]
    op: Option<String>,
    /// Capture the -n calls into a CUDA graph and replay it n times [0]
    #[arg(short = 'G', long = "cudagraph", value_name = "n", help_heading = NCCL_TESTS)]
    graph_replays: Option<u32>,

    /// allreduce | reducescatter | allgather | alltoall [allreduce]; each also quantized with
    /// --quant
    #[arg(long, value_name = "c", value_parser = coll_value, help_heading = FLASHCOMM)]
    coll: Option<Collective>,
    /// Ranks, 1..8 [8]
    #[arg(long, value_name = "n", help_heading = FLASHCOMM)]
    ranks: Option<u32>,
    /// virtual (n ranks on one GPU, one thread each) | gpus (n GPUs, one thread each) | procs
    /// (n GPUs, one process each) | procs-one-gpu (n processes on one GPU; needs CUDA MPS)
    /// [virtual]
    #[arg(long, value_name = "m", help_heading = FLASHCOMM)]
    mode: Option<Mode>,
    /// The GPU of virtual ranks, first GPU of --mode gpus/procs [0]
    #[arg(long, value_name = "d", allow_negative_numbers = true, help_heading = FLASHCOMM)]
    device: Option<i32>,
    /// flashcomm, nccl, reference (the plain LL one-shot AllReduce that decode latency is
    /// measured against), pull-reference (the pull design of vLLM's and SGLang's custom
    /// all-reduce, clean-room: rows pull-1stage, pull-2stage and the better of the two,
    /// pull-best; AllReduce only), or a comma list side by side; the references run in every
    /// --mode (rank processes map each other's buffers through CUDA IPC at set-up) [flashcomm]
    #[arg(long = "impl", value_name = "list", value_parser = impls_value, help_heading = FLASHCOMM)]
    impls: Option<List<Impl>>,
    /// How the reference kernels' ranks are launched: per-rank (each rank's thread on its
    /// stream, or its own process) | single (every rank in one grid launched by one thread;
    /// rows <impl>-1grid; --mode virtual, AllReduce) | per-rank,single [per-rank]
    #[arg(long = "ref-launch", value_name = "list", value_parser = ref_launches_value, help_heading = FLASHCOMM)]
    ref_launches: Option<List<RefLaunch>>,
    /// The real libnccl.so.2 for --impl nccl [$FLASHCOMM_NCCL_LIB]
    #[arg(long, value_name = "path", help_heading = FLASHCOMM)]
    nccl_lib: Option<PathBuf>,
    /// Quantized widths run besides lossless (bfloat16, half; float rows are skipped): bits,
    /// comma-separated (8,6,4), or sweep (= 8,6,4,3,2). AllReduce also takes rs/ag bits (4/8:
    /// reduce-scatter and all-gather steps of two-step); allgather, reducescatter and alltoall
    /// quantize in one step and take single widths only. Quantized rows call flashcomm's
    /// communicator in every --mode; --impl nccl rows stay lossless (NCCL's API cannot ask for a
    /// width per call)
    #[arg(long, value_name = "list", value_parser = quant_value, help_heading = FLASHCOMM)]
    quant: Option<List<Width>>,
    /// Values per quantization group: 32 | 64 | 128 | 256 [128]
    #[arg(long, value_name = "g", help_heading = FLASHCOMM)]
    group: Option<u16>,
    /// Extreme values kept exactly per group: 0 | 2 | 4 [2]
    #[arg(long, value_name = "k", help_heading = FLASHCOMM)]
    spikes: Option<u8>,
    /// Quantized AllReduce rows: always (every call quantized, timing the width's kernels) |
    /// auto (quantized only where the cost model calibrated at set-up predicts it faster than
    /// lossless, as FLASHCOMM_QUANT_CHOICE=auto does; a row that ran the lossless kernels has
    /// the plan lossless:<plan> and is checked as a lossless row) [always]
    #[arg(long = "quant-choice", value_name = "c", value_parser = quant_choice_value, help_heading = FLASHCOMM)]
    quant_choice: Option<QuantChoice>,
    /// Forced AllReduce algorithm: auto | oneshot | twoshot (twostep) [auto]
    #[arg(long, value_name = "a", value_parser = algo_value, help_heading = FLASHCOMM)]
    algo: Option<Choice<Algorithm>>,
    /// Forced device protocol: auto | ll | block | pull | direct [auto]
    #[arg(long, value_name = "p", value_parser = choice_value::<Protocol>, help_heading = FLASHCOMM)]
    proto: Option<Choice<Protocol>>,
    /// Where flashcomm's arenas live: auto | p2p | host (pinned host memory, across PCIe) [auto]
    #[arg(long, value_name = "t", value_parser = choice_value::<Transport>, help_heading = FLASHCOMM)]
    transport: Option<Choice<Transport>>,
    /// How the timed calls are issued [graph when -G > 0, else eager]
    #[arg(long, value_name = "l", help_heading = FLASHCOMM)]
    launch: Option<LaunchArg>,
    /// Also time and check in-place calls (lossless only) [0]
    #[arg(long, value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    inplace: Option<bool>,
    /// Add a device-to-device copy of the same bytes, timed the same way
    #[arg(long, help_heading = FLASHCOMM)]
    copy_baseline: bool,
    /// latency: 8 virtual ranks, bfloat16, 8K..1M, one-shot AllReduce against the copy baseline,
    /// eager and under CUDA graphs (flags given override it)
    #[arg(long, value_name = "name", help_heading = FLASHCOMM)]
    preset: Option<Preset>,
    /// Most values per quantized call compared with the CPU reference [1M]
    #[arg(long, value_name = "n", value_parser = size_value, help_heading = FLASHCOMM)]
    check_values: Option<u64>,
    /// Seed of the random inputs of quantized calls [1]
    #[arg(long, value_name = "n", help_heading = FLASHCOMM)]
    seed: Option<u64>,
    /// Bound on every device-side wait, seconds [60]
    #[arg(long = "timeout", value_name = "s", help_heading = FLASHCOMM)]
    timeout_s: Option<u64>,
    /// Time the cost model when the communicator is created [1]
    #[arg(long, value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    calibrate: Option<bool>,
    /// The calibration also times ReduceScatter, AllGather and AllToAll with each protocol
    /// (FLASHCOMM_CALIBRATE_MOVES) [0]
    #[arg(long = "calibrate-moves", value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    calibrate_moves: Option<bool>,
    /// Zero-copy between processes (FLASHCOMM_ZERO_COPY): graphs read every rank's buffers in
    /// place (exchanged at capture), eager calls stage unregistered buffers [1]
    #[arg(long = "zero-copy", value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    zero_copy: Option<bool>,
    /// The host transport's lossless AllReduce by the copy engines (FLASHCOMM_HOST_COPY): off |
    /// on (every eager call) | auto (eager calls from 1 MiB) [off]
    #[arg(long = "host-copy", value_name = "h", value_parser = host_copy_value, help_heading = FLASHCOMM)]
    host_copy: Option<HostCopy>,
    /// Each rank's arena, the push protocols' memory (FLASHCOMM_ARENA_BYTES) [64M]
    #[arg(long = "arena-bytes", value_name = "size", value_parser = size_value, help_heading = FLASHCOMM)]
    arena_bytes: Option<u64>,
    /// Each rank's pull area, two staging halves (FLASHCOMM_PULL_BYTES; 0: no PULL protocols)
    /// [32M]
    #[arg(long = "pull-bytes", value_name = "size", value_parser = size_value, help_heading = FLASHCOMM)]
    pull_bytes: Option<u64>,
    /// Register the send and receive buffers with the communicator, collectively
    /// (ncclCommWindowRegister's way), so eager calls read them in place too [0]
    #[arg(long = "register", value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    register: Option<bool>,
    /// Order captured calls with eager ones through graph nodes (FLASHCOMM_GRAPH_MIXING) [1]
    #[arg(long = "graph-mixing", value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    graph_mixing: Option<bool>,
    /// Let the next kernel launch as soon as a flashcomm kernel starts (FLASHCOMM_EARLY_LAUNCH) [1]
    #[arg(long = "early-launch", value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    early_launch: Option<bool>,
    /// flashcomm's kernels stamp the GPU's timer where each call begins, has its peers' data
    /// and ends; before each flashcomm row, rank 0 prints the medians over the last calls: begin
    /// skew across ranks, wait for peers, the rest of the kernel, the gap between kernels [0]
    #[arg(long = "phase-trace", value_name = "0|1", value_parser = bit_value, help_heading = FLASHCOMM)]
    phase_trace: Option<bool>,
    /// Write every row and the settings as JSON
    #[arg(long, value_name = "file", help_heading = FLASHCOMM)]
    json: Option<PathBuf>,
    /// Plot latency and algbw against size
    #[arg(long, value_name = "file", help_heading = FLASHCOMM)]
    svg: Option<PathBuf>,
    /// Commit recorded in the JSON [$FLASHCOMM_COMMIT, COMMIT file, git]
    #[arg(long, value_name = "id", help_heading = FLASHCOMM)]
    commit: Option<String>,
}

/// The usage text (`-h`, `--help`).
pub fn usage() -> String {
    Cli::command().render_help().to_string()
}

/// A clap error in this tool's words: the flag and what is wrong with it.
fn from_clap(e: &clap::Error) -> ArgError {
    let context = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    // "--minbytes <size>" names the flag; the value name adds nothing to a message.
    let arg = context(ContextKind::InvalidArg);
    let flag = arg.split_whitespace().next().unwrap_or("").to_string();
    let value = context(ContextKind::InvalidValue);
    let msg = match e.kind() {
        ErrorKind::UnknownArgument if flag.starts_with('-') => format!("unknown option '{flag}'"),
        ErrorKind::UnknownArgument => format!("unexpected argument '{flag}'"),
        ErrorKind::InvalidValue if value.is_empty() => format!("{flag} needs a value"),
        ErrorKind::InvalidValue => {
            let valid = match e.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(v)) => v.join(", "),
                _ => String::new(),
            };
            format!("{flag}: '{value}' ({valid})")
        }
        ErrorKind::ValueValidation => {
            let why = std::error::Error::source(e).map_or(String::new(), |s| s.to_string());
            // Messages of this module's value parsers name the flag ("-d: ...") or the value
            // already; clap's number parsers name neither.
            if why.starts_with('-') {
                why
            } else if why.contains(&format!("'{value}'")) {
                format!("{flag}: {why}")
            } else {
                format!("{flag}: '{value}': {why}")
            }
        }
        _ => e
            .kind()
            .as_str()
            .map_or_else(|| e.to_string(), str::to_string),
    };
    ArgError(msg)
}

/// Parses the arguments (without the program name). A `--preset` supplies defaults; every flag
/// given explicitly overrides them, wherever it appears.
pub fn parse(args: &[String]) -> Result<Command, ArgError> {
    let argv = std::iter::once("flashcomm-perf").chain(args.iter().map(String::as_str));
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) if e.kind() == ErrorKind::DisplayHelp => return Ok(Command::Help),
        Err(e) => return Err(from_clap(&e)),
    };
    let mut o = Options::default();
    if let Some(Preset::Latency) = cli.preset {
        o.preset = Some(Preset::Latency);
        o.ranks = 8;
        o.mode = Mode::Virtual;
        o.dtypes = vec![Dtype::Bf16];
        o.min_bytes = 8 << 10;
        o.max_bytes = 1 << 20;
        o.step_factor = 2;
        o.coll = Collective::AllReduce;
        o.impls = vec![Impl::Flashcomm];
        o.algo = Choice::Force(Algorithm::OneShot);
        o.copy_baseline = true;
        o.iters = 100;
        o.warmup = 20;
        o.graph_replays = 20;
        o.launches = vec![Launch::Eager, Launch::Graph];
    }
    fn set<T>(field: &mut T, given: Option<T>) {
        if let Some(v) = given {
            *field = v;
        }
    }
    set(&mut o.min_bytes, cli.min_bytes);
    set(&mut o.max_bytes, cli.max_bytes);
    set(&mut o.step_factor, cli.step_factor);
    set(&mut o.step_bytes, cli.step_bytes);
    set(&mut o.iters, cli.iters);
    set(&mut o.warmup, cli.warmup);
    set(&mut o.check, cli.check.map(|c| c != 0));
    set(&mut o.dtypes, cli.dtypes.map(|l| l.0));
    if let Some(op) = &cli.op
        && !op.eq_ignore_ascii_case("sum")
    {
        return err(format!(
            "-o {op}: only sum is supported (flashcomm's kernels implement sum)"
        ));
    }
    set(&mut o.graph_replays, cli.graph_replays);
    set(&mut o.coll, cli.coll);
    set(&mut o.ranks, cli.ranks);
    set(&mut o.mode, cli.mode);
    set(&mut o.device, cli.device);
    set(&mut o.impls, cli.impls.map(|l| l.0));
    set(&mut o.ref_launches, cli.ref_launches.map(|l| l.0));
    o.nccl_lib = cli.nccl_lib.or(o.nccl_lib);
    set(&mut o.quant, cli.quant.map(|l| l.0));
    set(&mut o.group, cli.group);
    set(&mut o.spikes, cli.spikes);
    set(&mut o.quant_choice, cli.quant_choice);
    set(&mut o.algo, cli.algo);
    set(&mut o.proto, cli.proto);
    set(&mut o.transport, cli.transport);
    set(&mut o.inplace, cli.inplace);
    o.copy_baseline |= cli.copy_baseline;
    set(&mut o.check_values, cli.check_values);
    set(&mut o.seed, cli.seed);
    set(&mut o.timeout_s, cli.timeout_s);
    set(&mut o.calibrate, cli.calibrate);
    set(&mut o.calibrate_moves, cli.calibrate_moves);
    set(&mut o.zero_copy, cli.zero_copy);
    set(&mut o.host_copy, cli.host_copy);
    set(&mut o.arena_bytes, cli.arena_bytes);
    set(&mut o.pull_bytes, cli.pull_bytes);
    set(&mut o.register, cli.register);
    set(&mut o.early_launch, cli.early_launch);
    set(&mut o.graph_mixing, cli.graph_mixing);
    set(&mut o.phase_trace, cli.phase_trace);
    o.json = cli.json.or(o.json);
    o.svg = cli.svg.or(o.svg);
    o.commit = cli.commit.or(o.commit);
    // Launch modes: explicit --launch, else -G decides (a preset's choice stands unless -G is
    // given explicitly).
    match cli.launch {
        Some(LaunchArg::Eager) => o.launches = vec![Launch::Eager],
        Some(LaunchArg::Graph) => o.launches = vec![Launch::Graph],
        Some(LaunchArg::Both) => o.launches = vec![Launch::Eager, Launch::Graph],
        None => {
            if cli.graph_replays.is_some() || o.preset.is_none() {
                o.launches = if o.graph_replays > 0 {
                    vec![Launch::Graph]
                } else {
                    vec![Launch::Eager]
                };
            }
        }
    }
    if o.launches.contains(&Launch::Graph) && o.graph_replays == 0 {
        o.graph_replays = 20;
    }
    validate(&o)?;
    Ok(Command::Run(Box::new(o)))
}

fn validate(o: &Options) -> Result<(), ArgError> {
    if o.min_bytes == 0 {
        return err("-b: the smallest size must be at least 1 byte");
    }
    if o.max_bytes < o.min_bytes {
        return err(format!(
            "-e {} is smaller than -b {}",
            o.max_bytes, o.min_bytes
        ));
    }
    if o.step_factor == 0 {
        return err("-f: the step factor must be at least 1");
    }
    if o.step_factor == 1 && o.step_bytes == 0 && o.max_bytes > o.min_bytes {
        return err("-i: a step of 0 bytes never reaches -e");
    }
    if o.iters == 0 {
        return err("-n: at least one timed call");
    }
    if !(1..=8).contains(&o.ranks) {
        return err(format!("--ranks {}: flashcomm serves 1..8 ranks", o.ranks));
    }
    if o.dtypes.is_empty() {
        return err("-d: no datatype");
    }
    if o.impls.is_empty() {
        return err("--impl: nothing to run");
    }
    if ![32, 64, 128, 256].contains(&o.group) {
        return err(format!("--group {}: 32, 64, 128 or 256", o.group));
    }
    if o.quant_choice == QuantChoice::Auto && !o.calibrate {
        return err(
            "--quant-choice auto needs --calibrate 1: the choice comes from the quantized \
             AllReduce timed at set-up (without it every call is quantized)",
        );
    }
    if ![0, 2, 4].contains(&o.spikes) {
        return err(format!("--spikes {}: 0, 2 or 4", o.spikes));
    }
    if !o.quant.is_empty() {
        if !o.impls.contains(&Impl::Flashcomm) {
            return err("--quant needs --impl flashcomm (quantization is flashcomm's)");
        }
        match o.coll {
            Collective::AllReduce => {}
            Collective::AllGather | Collective::ReduceScatter | Collective::AlltoAll => {
                if let Some(w) = o.quant.iter().find(|w| w.rs != w.ag) {
                    return err(format!(
                        "--quant {w}: rs/ag pairs are the two steps of the quantized AllReduce; \
                         a quantized {} has one step: give single widths (for example 8,4)",
                        o.coll.name()
                    ));
                }
            }
            other => {
                return err(format!(
                    "--quant: {} is not quantized (allreduce, allgather, reducescatter, alltoall are)",
                    other.name()
                ));
            }
        }
    }
    if o.impls.contains(&Impl::Nccl) && o.mode.one_gpu() && o.ranks > 1 {
        return err(
            "--impl nccl needs --mode gpus or procs: NCCL refuses several ranks on one GPU \
             (virtual ranks and procs-one-gpu are flashcomm's)",
        );
    }
    // The references run in every mode: rank processes map each other's buffers through CUDA
    // IPC at set-up.
    if o.impls.contains(&Impl::Reference)
        && !matches!(o.coll, Collective::AllReduce | Collective::AlltoAll)
    {
        return err("--impl reference: the reference kernels are an AllReduce and an AllToAll");
    }
    if o.impls.contains(&Impl::PullReference) && o.coll != Collective::AllReduce {
        return err("--impl pull-reference: the pull reference kernels are an AllReduce");
    }
    if o.ref_launches.is_empty() {
        return err("--ref-launch: no launch mode");
    }
    if o.ref_launches.contains(&RefLaunch::Single) {
        if !o.impls.iter().any(|i| i.is_reference()) {
            return err(
                "--ref-launch single launches the reference kernels: add --impl reference or \
                 pull-reference",
            );
        }
        if o.mode.processes() {
            return err(format!(
                "--ref-launch single: one grid for every rank is launched by one thread, so it \
                 needs every rank in one process on one GPU (--mode virtual); in --mode {} each \
                 rank is a process of its own: use --ref-launch per-rank",
                o.mode.name()
            ));
        }
        if o.mode != Mode::Virtual {
            return err(format!(
                "--ref-launch single: one grid for every rank needs every rank on one GPU \
                 (--mode virtual), not --mode {}",
                o.mode.name()
            ));
        }
        if o.coll != Collective::AllReduce {
            return err("--ref-launch single: the one-grid kernels are AllReduces");
        }
    }
    if o.inplace && matches!(o.coll, Collective::ReduceScatter | Collective::AlltoAll) {
        return err(
            "--inplace: in-place ReduceScatter and AllToAll are not measured (AllReduce, AllGather)",
        );
    }
    if o.timeout_s == 0 {
        return err("--timeout: at least 1 second");
    }
    if o.device < 0 {
        return err("--device: a CUDA device ordinal (0, 1, ...)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &str) -> Options {
        let v: Vec<String> = args.split_whitespace().map(String::from).collect();
        match parse(&v).unwrap() {
            Command::Run(o) => *o,
            Command::Help => panic!("help"),
        }
    }

    fn fails(args: &str) -> String {
        let v: Vec<String> = args.split_whitespace().map(String::from).collect();
        parse(&v).unwrap_err().0
    }

    #[test]
    fn sizes_with_suffixes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128M").unwrap(), 128 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("16KB").unwrap(), 16 << 10);
        assert!(parse_size("M").is_err());
        assert!(parse_size("4X").is_err());
        assert!(parse_size("-4").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("99999999999G").is_err());
    }

    #[test]
    fn defaults_follow_nccl_tests() {
        let o = run("");
        assert_eq!((o.min_bytes, o.max_bytes), (32 << 20, 32 << 20));
        assert_eq!((o.iters, o.warmup, o.check), (20, 1, true));
        assert_eq!((o.step_factor, o.step_bytes), (1, 1 << 20));
        assert_eq!(o.launches, vec![Launch::Eager]);
        assert_eq!(o.graph_replays, 0);
    }

    #[test]
    fn nccl_tests_short_flags_in_both_spellings() {
        let o = run("-b 8 -e 128M -f 2 -n 50 -w 5 -c 0 -d half -o sum -G 10");
        assert_eq!((o.min_bytes, o.max_bytes, o.step_factor), (8, 128 << 20, 2));
        assert_eq!((o.iters, o.warmup, o.check), (50, 5, false));
        assert_eq!(o.dtypes, vec![Dtype::F16]);
        assert_eq!(o.graph_replays, 10);
        assert_eq!(o.launches, vec![Launch::Graph]);
        let p = run("-b8 -e1M -f2 -n7 -dfloat");
        assert_eq!((p.min_bytes, p.max_bytes, p.iters), (8, 1 << 20, 7));
        assert_eq!(p.dtypes, vec![Dtype::F32]);
        let q = run("--minbytes=4K --maxbytes 8K --stepfactor=4 --datatype all");
        assert_eq!((q.min_bytes, q.max_bytes, q.step_factor), (4096, 8192, 4));
        assert_eq!(q.dtypes, DTYPES.to_vec());
    }

    #[test]
    fn flashcomm_flags() {
        let o = run(
            "--coll reducescatter --ranks 4 --mode gpus --impl flashcomm,nccl --nccl-lib /x/libnccl.so.2 \
             --algo twoshot --proto ll --json out.json --svg out.svg --device 2 --copy-baseline \
             --commit abc --timeout 30 --calibrate 0 --seed 7",
        );
        assert_eq!(o.coll, Collective::ReduceScatter);
        assert_eq!((o.ranks, o.mode), (4, Mode::Gpus));
        assert_eq!(o.impls, vec![Impl::Flashcomm, Impl::Nccl]);
        assert_eq!(o.nccl_lib, Some(PathBuf::from("/x/libnccl.so.2")));
        assert_eq!(
            (o.algo, o.proto),
            (
                Choice::Force(Algorithm::TwoShot),
                Choice::Force(Protocol::Ll)
            )
        );
        assert_eq!(o.transport, Choice::Auto);
        assert_eq!(o.json, Some(PathBuf::from("out.json")));
        assert_eq!(o.svg, Some(PathBuf::from("out.svg")));
        assert_eq!(o.device, 2);
        assert!(o.copy_baseline);
        assert_eq!(o.commit.as_deref(), Some("abc"));
        assert_eq!((o.timeout_s, o.calibrate, o.seed), (30, false, 7));
    }

    #[test]
    fn quant_lists() {
        let w = |rs, ag| Width { rs, ag };
        assert_eq!(parse_quant("4").unwrap(), vec![w(4, 4)]);
        assert_eq!(parse_quant("4/8").unwrap(), vec![w(4, 8)]);
        assert_eq!(
            parse_quant("sweep").unwrap(),
            vec![w(8, 8), w(6, 6), w(4, 4), w(3, 3), w(2, 2)]
        );
        assert_eq!(
            parse_quant("4,4/8,4").unwrap(),
            vec![w(4, 4), w(4, 8)],
            "duplicates dropped, order kept"
        );
        assert!(parse_quant("1").is_err());
        assert!(parse_quant("9").is_err());
        assert!(parse_quant("4/6").is_err());
        assert!(parse_quant("x").is_err());
        assert_eq!(w(4, 8).to_string(), "4/8");
        assert_eq!(w(3, 3).to_string(), "3");
        let o = run("--quant sweep --group 64 --spikes 4");
        assert_eq!(o.quant.len(), 5);
        assert_eq!((o.group, o.spikes), (64, 4));
    }

    #[test]
    fn quant_widths_of_every_collective() {
        let w = |b| Width { rs: b, ag: b };
        for coll in ["allgather", "reducescatter", "alltoall"] {
            let o = run(&format!("--coll {coll} --quant 8,4 -d half"));
            assert_eq!(o.coll, Collective::from_name(coll).unwrap());
            assert_eq!(o.quant, vec![w(8), w(4)]);
            assert_eq!(o.dtypes, vec![Dtype::F16]);
            assert_eq!(run(&format!("--coll {coll} --quant sweep")).quant.len(), 5);
            assert_eq!(
                run(&format!("--coll {coll} --quant 4,4/4")).quant,
                vec![w(4)]
            );
            // rs/ag pairs are AllReduce's two steps: refused with the collective named.
            let e = fails(&format!("--coll {coll} --quant 8,4/8"));
            assert!(
                e.contains("--quant 4/8") && e.contains("one step") && e.contains(coll),
                "{e}"
            );
            assert!(fails(&format!("--coll {coll} --quant 4/8")).contains("single widths"));
            // Widths are checked as for AllReduce; quantization stays flashcomm's.
            assert!(fails(&format!("--coll {coll} --quant 9")).contains("2..8"));
            assert!(
                fails(&format!("--coll {coll} --quant 4 --impl nccl --mode gpus"))
                    .contains("--impl flashcomm")
            );
            // Side by side with NCCL's lossless rows.
            let o = run(&format!(
                "--coll {coll} --quant 4 --impl nccl,flashcomm --mode procs --ranks 2"
            ));
            assert_eq!(o.impls, vec![Impl::Nccl, Impl::Flashcomm]);
        }
        // AllReduce keeps its pairs.
        assert_eq!(run("--quant 4/8").quant, vec![Width { rs: 4, ag: 8 }]);
        assert_eq!(run("--coll allreduce --quant 4/8,4").quant.len(), 2);
        // The AllToAll reference and quantized AllToAll rows in one run.
        let o = run("--coll alltoall --impl reference,flashcomm --quant 8,4 --ranks 8");
        assert_eq!(o.quant, vec![w(8), w(4)]);
        assert!(usage().contains("single widths"));
        // Quantized AllReduce rows time the width's kernels unless asked to route as the library.
        assert_eq!(run("--quant 4").quant_choice, QuantChoice::Always);
        assert_eq!(
            run("--quant 4 --quant-choice auto").quant_choice,
            QuantChoice::Auto
        );
        assert!(fails("--quant 4 --quant-choice sometimes").contains("--quant-choice"));
        assert!(fails("--quant 4 --quant-choice auto --calibrate 0").contains("--calibrate 1"));
    }

    #[test]
    fn latency_preset_and_overrides() {
        let o = run("--preset latency");
        assert_eq!(o.preset, Some(Preset::Latency));
        assert_eq!((o.ranks, o.mode), (8, Mode::Virtual));
        assert_eq!(o.dtypes, vec![Dtype::Bf16]);
        assert_eq!(
            (o.min_bytes, o.max_bytes, o.step_factor),
            (8 << 10, 1 << 20, 2)
        );
        assert_eq!(o.algo, Choice::Force(Algorithm::OneShot));
        assert!(o.copy_baseline);
        assert_eq!(o.launches, vec![Launch::Eager, Launch::Graph]);
        assert!(o.graph_replays > 0);
        // Explicit flags win, before or after the preset.
        let p = run("-n 7 --preset latency -e 64K");
        assert_eq!((p.iters, p.max_bytes), (7, 64 << 10));
        let q = run("--preset latency -G 0");
        assert_eq!(q.launches, vec![Launch::Eager]);
        let r = run("--preset latency --launch graph");
        assert_eq!(r.launches, vec![Launch::Graph]);
    }

    #[test]
    fn launch_modes() {
        assert_eq!(
            run("--launch both").launches,
            vec![Launch::Eager, Launch::Graph]
        );
        let o = run("--launch graph");
        assert_eq!(o.launches, vec![Launch::Graph]);
        assert_eq!(o.graph_replays, 20, "graph launches need replays");
        assert!(fails("--launch sometimes").contains("--launch"));
    }

    #[test]
    fn help_and_errors() {
        assert_eq!(parse(&["-h".to_string()]).unwrap(), Command::Help);
        assert_eq!(parse(&["--help".to_string()]).unwrap(), Command::Help);
        assert!(fails("-x 3").contains("unknown option"));
        assert!(fails("--bogus 3").contains("unknown option"));
        assert!(fails("-b").contains("needs a value"));
        assert!(fails("-o prod").contains("only sum"));
        assert!(fails("-d int8").contains("not supported"));
        assert!(fails("-b 1M -e 4K").contains("smaller"));
        assert!(fails("-b 0").contains("at least 1 byte"));
        assert!(fails("--ranks 9").contains("1..8"));
        assert!(fails("--ranks 0").contains("1..8"));
        assert!(fails("--impl nccl --ranks 4").contains("--mode gpus"));
        assert!(fails("--quant 4 --impl nccl --mode gpus").contains("--impl flashcomm"));
        assert!(fails("--quant 4/8 --coll allgather").contains("single widths"));
        assert!(
            fails("--impl reference --coll allgather").contains("an AllReduce and an AllToAll")
        );
        assert_eq!(
            run("--impl reference --coll alltoall").coll,
            Collective::AlltoAll
        );
        // The references run in the process modes too (buffers exchanged through CUDA IPC).
        for mode in ["procs", "procs-one-gpu"] {
            let o = run(&format!(
                "--impl reference,flashcomm --mode {mode} --ranks 4"
            ));
            assert_eq!(o.impls, vec![Impl::Reference, Impl::Flashcomm]);
            assert_eq!(o.ref_launches, vec![RefLaunch::PerRank]);
            assert!(o.mode.processes());
            let o = run(&format!(
                "--impl reference --coll alltoall --mode {mode} --ranks 2"
            ));
            assert_eq!(o.coll, Collective::AlltoAll);
        }
        assert_eq!(
            run("--impl reference,flashcomm --ranks 8").impls,
            vec![Impl::Reference, Impl::Flashcomm]
        );
        assert!(fails("--group 100").contains("--group"));
        assert!(fails("--spikes 3").contains("--spikes"));
        assert!(fails("--inplace 1 --coll reducescatter").contains("in-place"));
        assert!(fails("--inplace 1 --coll alltoall").contains("in-place"));
        assert_eq!(run("--coll all_to_all").coll, Collective::AlltoAll);
        assert!(fails("--coll broadcast").contains("not a collective flashcomm-perf measures"));
        assert!(fails("--inplace 2").contains("0 or 1"));
        assert!(fails("-n 0").contains("-n"));
        assert!(fails("stray").contains("unexpected"));
        assert!(fails("--mode cloud").contains("--mode"));
        assert!(
            fails("--impl nccl --ranks 2 --mode procs-one-gpu").contains("--mode gpus or procs")
        );
        assert_eq!(run("--mode procs --ranks 4").mode, Mode::Procs);
        assert!(Mode::Procs.processes() && !Mode::Procs.one_gpu());
        assert!(Mode::ProcsOneGpu.processes() && Mode::ProcsOneGpu.one_gpu());
        assert!(!Mode::Gpus.processes() && Mode::Virtual.one_gpu());
        assert!(fails("-f 1 -i 0 -b 1K -e 2K").contains("-i"));
        let e = ArgError("x".into()).to_string();
        assert!(e.contains("--help"));
    }

    #[test]
    fn pull_reference_and_one_grid_launches() {
        let o = run("--impl flashcomm,reference,pull-reference --ranks 4");
        assert_eq!(
            o.impls,
            vec![Impl::Flashcomm, Impl::Reference, Impl::PullReference]
        );
        assert_eq!(o.ref_launches, vec![RefLaunch::PerRank], "the default");
        assert_eq!(run("--impl pull").impls, vec![Impl::PullReference]);
        assert_eq!(
            run("--impl pull-reference --mode gpus --ranks 2").mode,
            Mode::Gpus
        );
        assert_eq!(Impl::PullReference.name(), "pull-reference");
        assert!(Impl::PullReference.is_reference() && !Impl::Nccl.is_reference());
        // AllReduce only; in every mode, launched per rank in the process modes.
        for coll in ["alltoall", "allgather", "reducescatter"] {
            let e = fails(&format!("--impl pull-reference --coll {coll}"));
            assert!(e.contains("pull reference kernels are an AllReduce"), "{e}");
            let e = fails(&format!(
                "--impl pull-reference --coll {coll} --mode procs-one-gpu"
            ));
            assert!(e.contains("pull reference kernels are an AllReduce"), "{e}");
        }
        for mode in ["procs", "procs-one-gpu"] {
            let o = run(&format!(
                "--impl flashcomm,reference,pull-reference --mode {mode} --ranks 8 \
                 --ref-launch per-rank"
            ));
            assert_eq!(
                o.impls,
                vec![Impl::Flashcomm, Impl::Reference, Impl::PullReference]
            );
            assert_eq!(o.ref_launches, vec![RefLaunch::PerRank]);
            for launch in ["single", "per-rank,single"] {
                let e = fails(&format!(
                    "--impl pull-reference --mode {mode} --ranks 2 --ref-launch {launch}"
                ));
                assert!(e.contains("each rank is a process of its own"), "{e}");
                assert!(e.contains("--ref-launch per-rank"), "{e}");
            }
        }
        assert!(fails("--impl pullish").contains("pull-reference"));
        // --ref-launch: per-rank, single, or both (one set of rows each, in the order given).
        let o = run("--impl reference,pull-reference --ref-launch single");
        assert_eq!(o.ref_launches, vec![RefLaunch::Single]);
        let o = run("--impl pull-reference --ref-launch per-rank,single,per-rank");
        assert_eq!(o.ref_launches, vec![RefLaunch::PerRank, RefLaunch::Single]);
        assert_eq!(
            parse_ref_launches("single,per-rank").unwrap(),
            vec![RefLaunch::Single, RefLaunch::PerRank]
        );
        assert_eq!(
            run("--ref-launch per-rank").ref_launches,
            vec![RefLaunch::PerRank]
        );
        assert!(fails("--ref-launch sometimes").contains("--ref-launch: 'sometimes'"));
        // Refusals: nothing to launch, ranks on several GPUs, a collective without a grid kernel.
        assert!(fails("--ref-launch single").contains("--impl reference or pull-reference"));
        assert!(
            fails("--impl flashcomm,nccl --mode gpus --ranks 2 --ref-launch single")
                .contains("--impl reference or pull-reference")
        );
        let e = fails("--impl reference --mode gpus --ranks 2 --ref-launch single");
        assert!(e.contains("every rank on one GPU (--mode virtual)"), "{e}");
        assert!(e.contains("not --mode gpus"), "{e}");
        assert!(
            fails("--impl reference --coll alltoall --ref-launch single")
                .contains("one-grid kernels are AllReduces")
        );
        assert_eq!(RefLaunch::Single.name(), "single");
        let help = usage();
        assert!(help.contains("--ref-launch") && help.contains("pull-reference"));
    }

    #[test]
    fn busbw_factors() {
        assert_eq!(Collective::AllReduce.busbw_factor(8), 1.75);
        assert_eq!(Collective::AllReduce.busbw_factor(2), 1.0);
        assert_eq!(Collective::ReduceScatter.busbw_factor(8), 0.875);
        assert_eq!(Collective::AllGather.busbw_factor(4), 0.75);
        assert_eq!(Collective::AllReduce.busbw_factor(1), 0.0);
    }
}
