//! The program: parse, set up the GPU side (and the real NCCL), run, print the table as rows
//! arrive, then the footer, the latency table, the JSON file and the plot.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::args::{
    self, Algorithm, Choice, Command, Impl, Launch, Mode, Options, Preset, RefLaunch, Transport,
};
use crate::ffi::Nccl;
use crate::report::{self, Layout, Table};
use crate::run;
use crate::svg;

/// Set in the rank processes of `--mode procs` and `procs-one-gpu`: `<rank>:<folder>`.
pub const PROCESS_ENV: &str = "FLASHCOMM_PERF_PROCESS";

/// Exit status: 0 when every check passed, 1 when some element was wrong, 2 on errors.
pub fn main_with(argv: &[String]) -> i32 {
    let mut o = match args::parse(argv) {
        Ok(Command::Help) => {
            print!("{}", args::usage());
            return 0;
        }
        Ok(Command::Run(o)) => *o,
        Err(e) => {
            eprintln!("flashcomm-perf: {e}");
            return 2;
        }
    };
    if o.nccl_lib.is_none() {
        o.nccl_lib = std::env::var_os("FLASHCOMM_NCCL_LIB")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
    }
    if o.commit.is_none() {
        o.commit = find_commit();
    }
    let process = match std::env::var(PROCESS_ENV) {
        Ok(v) if o.mode.processes() => match parse_process(&v, o.ranks) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("flashcomm-perf: {e}");
                return 2;
            }
        },
        _ if o.mode.processes() => return launch(&o, argv),
        _ => None,
    };
    match run_program(&o, argv, process.as_ref()) {
        Ok(wrong) => i32::from(wrong > 0),
        Err(e) => {
            eprintln!("flashcomm-perf: {e}");
            2
        }
    }
}

/// `<rank>:<folder>` of a rank process.
fn parse_process(v: &str, ranks: u32) -> Result<(u32, PathBuf), String> {
    let bad = || format!("{PROCESS_ENV}='{v}': expected <rank>:<folder> with rank below {ranks}");
    let (r, dir) = v.split_once(':').ok_or_else(bad)?;
    let r: u32 = r.parse().map_err(|_| bad())?;
    if r >= ranks || dir.is_empty() {
        return Err(bad());
    }
    Ok((r, PathBuf::from(dir)))
}

/// The launcher of the process modes: starts one process of this program per rank (the same
/// arguments, [`PROCESS_ENV`] naming its rank and the exchange folder), lets rank 0 print, and
/// waits. When a rank fails the others get some seconds to report, then are stopped. Exit status:
/// rank 0's when every rank ended with 0 or 1 (only rank 0 counts wrong elements), else 2.
fn launch(o: &Options, argv: &[String]) -> i32 {
    use std::os::unix::fs::DirBuilderExt;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("flashcomm-perf: cannot find this program to start the ranks: {e}");
            return 2;
        }
    };
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("flashcomm-perf-{}-{stamp}", std::process::id()));
    // A new folder of this user's alone (the name is predictable: one that someone else made
    // first is refused, its records are not trusted).
    if let Err(e) = std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| e.to_string())
        .and_then(|()| flashcomm_testkit::private_folder(&dir).map_err(|e| e.to_string()))
    {
        eprintln!("flashcomm-perf: cannot create {}: {e}", dir.display());
        return 2;
    }
    let mut children = Vec::new();
    let mut code = None;
    for r in 0..o.ranks {
        let mut c = Command::new(&exe);
        c.args(argv)
            .env(PROCESS_ENV, format!("{r}:{}", dir.display()))
            .stdin(Stdio::null());
        if r != 0 {
            c.stdout(Stdio::null());
        }
        // One rank per process needs no extra hardware queues (and under CUDA MPS many queues
        // per client exhaust the server): only a value the user chose is passed on.
        if crate::ffi::queues_set_here() {
            c.env_remove("CUDA_DEVICE_MAX_CONNECTIONS");
        }
        match c.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                eprintln!("flashcomm-perf: cannot start rank {r}: {e}");
                code = Some(2);
                break;
            }
        }
    }
    let grace = Duration::from_secs(10);
    let mut codes: Vec<Option<i32>> = vec![None; children.len()];
    let mut stop_at: Option<Instant> = code.map(|_| Instant::now());
    loop {
        for (i, c) in children.iter_mut().enumerate() {
            if codes[i].is_none()
                && let Ok(Some(st)) = c.try_wait()
            {
                let k = st.code().unwrap_or(-1);
                codes[i] = Some(k);
                if !(0..=1).contains(&k) {
                    eprintln!("flashcomm-perf: rank {i} ended with status {k}");
                    stop_at.get_or_insert_with(|| Instant::now() + grace);
                }
            }
        }
        if codes.iter().all(Option::is_some) {
            break;
        }
        if stop_at.is_some_and(|t| Instant::now() >= t) {
            for (i, c) in children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    eprintln!("flashcomm-perf: stopping rank {i}");
                    let _ = c.kill();
                    codes[i] = Some(c.wait().ok().and_then(|s| s.code()).unwrap_or(-1));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
    if code.is_some() || codes.iter().any(|k| !matches!(k, Some(0 | 1))) {
        return 2;
    }
    codes.first().copied().flatten().unwrap_or(2)
}

/// The commit to record: `$FLASHCOMM_COMMIT`, the `COMMIT` file of a GPU bundle (next to
/// `bin/`), or `git rev-parse HEAD`.
fn find_commit() -> Option<String> {
    if let Some(c) = std::env::var("FLASHCOMM_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
    {
        return Some(c);
    }
    let exe = std::env::current_exe().ok()?;
    if let Some(bundle) = exe.parent().and_then(Path::parent)
        && let Ok(c) = std::fs::read_to_string(bundle.join("COMMIT"))
        && !c.trim().is_empty()
    {
        return Some(c.trim().to_string());
    }
    let out = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let c = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !c.is_empty()).then_some(c)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// How times are measured, in one line per launch mode.
pub fn timing_text(o: &Options) -> Vec<String> {
    let mut v = Vec::new();
    if o.launches.contains(&Launch::Eager) {
        v.push(format!(
            "eager: CUDA events around each call on every rank's stream; a call's time is the \
             slowest rank's; time(us) = median over -n {} calls (after -w {} warm-up calls)",
            o.iters, o.warmup
        ));
    }
    if o.launches.contains(&Launch::Graph) {
        v.push(format!(
            "graph: the -n {} calls captured into one CUDA graph, replayed -G {} times with CUDA \
             events around each replay; time(us) = median over replays of replay time / {}",
            o.iters, o.graph_replays, o.iters
        ));
    }
    v
}

/// The settings recorded in the JSON file.
#[derive(Debug, Serialize)]
pub struct Settings {
    commit: Option<String>,
    command_line: Vec<String>,
    host: String,
    gpu: Option<String>,
    gpus: Vec<String>,
    devices: Vec<i32>,
    ranks: u32,
    mode: &'static str,
    collective: &'static str,
    datatypes: Vec<&'static str>,
    min_bytes: u64,
    max_bytes: u64,
    step_factor: u64,
    step_bytes: u64,
    iters: u32,
    warmup_iters: u32,
    check: bool,
    graph_replays: u32,
    launches: Vec<&'static str>,
    impls: Vec<&'static str>,
    ref_launches: Vec<&'static str>,
    quant: Vec<String>,
    group: u16,
    spikes: u8,
    quant_choice: String,
    algo: String,
    proto: String,
    transport: String,
    inplace: bool,
    copy_baseline: bool,
    preset: Option<&'static str>,
    timeout_s: u64,
    calibrate: bool,
    calibrate_moves: bool,
    zero_copy: bool,
    host_copy: &'static str,
    arena_bytes: u64,
    pull_bytes: u64,
    register: bool,
    early_launch: bool,
    graph_mixing: bool,
    phase_trace: bool,
    check_values: u64,
    seed: u64,
    nccl: Option<NcclSettings>,
    timing: Vec<String>,
}

/// The real NCCL of a run, in the JSON file.
#[derive(Debug, Serialize)]
struct NcclSettings {
    path: String,
    version: String,
}

/// The settings of a run, as recorded in the JSON file.
pub fn settings(o: &Options, gpus: &[String], nccl: Option<&Nccl>, argv: &[String]) -> Settings {
    Settings {
        commit: o.commit.clone(),
        command_line: argv.to_vec(),
        host: host_name(),
        gpu: gpus.first().cloned(),
        gpus: gpus.to_vec(),
        devices: run::devices(o),
        ranks: o.ranks,
        mode: o.mode.name(),
        collective: o.coll.name(),
        datatypes: o.dtypes.iter().map(|d| d.long_name()).collect(),
        min_bytes: o.min_bytes,
        max_bytes: o.max_bytes,
        step_factor: o.step_factor,
        step_bytes: o.step_bytes,
        iters: o.iters,
        warmup_iters: o.warmup,
        check: o.check,
        graph_replays: o.graph_replays,
        launches: o.launches.iter().map(|l| l.name()).collect(),
        impls: o.impls.iter().map(|i| i.name()).collect(),
        ref_launches: o.ref_launches.iter().map(|l| l.name()).collect(),
        quant: o.quant.iter().map(|w| w.to_string()).collect(),
        group: o.group,
        spikes: o.spikes,
        quant_choice: o.quant_choice.name().to_string(),
        algo: o.algo.to_string(),
        proto: o.proto.to_string(),
        transport: o.transport.to_string(),
        inplace: o.inplace,
        copy_baseline: o.copy_baseline,
        preset: o.preset.map(|p| match p {
            Preset::Latency => "latency",
        }),
        timeout_s: o.timeout_s,
        calibrate: o.calibrate,
        calibrate_moves: o.calibrate_moves,
        zero_copy: o.zero_copy,
        host_copy: o.host_copy.name(),
        arena_bytes: o.arena_bytes,
        pull_bytes: o.pull_bytes,
        register: o.register,
        early_launch: o.early_launch,
        graph_mixing: o.graph_mixing,
        phase_trace: o.phase_trace,
        check_values: o.check_values,
        seed: o.seed,
        nccl: nccl.map(|n| NcclSettings {
            path: n.path().display().to_string(),
            version: flashcomm_nccl_sys::version_string(n.version()),
        }),
        timing: timing_text(o),
    }
}

/// The header lines printed before the table.
pub fn header_lines(o: &Options, gpus: &[String], nccl: Option<&Nccl>) -> Vec<String> {
    let devs = run::devices(o);
    let ngpus = if o.mode.one_gpu() { 1 } else { o.ranks };
    let step = if o.step_factor > 1 {
        format!("{}(factor)", o.step_factor)
    } else {
        format!("{}(bytes)", o.step_bytes)
    };
    let mut v = vec![
        format!(
            "# flashcomm-perf {}: {} of {} ranks ({}), {}, impl {}",
            env!("CARGO_PKG_VERSION"),
            o.coll.name(),
            o.ranks,
            o.mode.name(),
            o.dtypes
                .iter()
                .map(|d| d.long_name())
                .collect::<Vec<_>>()
                .join(","),
            o.impls
                .iter()
                .map(|i| i.name())
                .collect::<Vec<_>>()
                .join(",")
        ),
        format!(
            "# nThread {} nGpus {ngpus} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: {}",
            o.ranks,
            o.min_bytes,
            o.max_bytes,
            o.warmup,
            o.iters,
            u8::from(o.check),
            if o.launches.contains(&Launch::Graph) {
                o.graph_replays
            } else {
                0
            }
        ),
        "#".into(),
        "# Using devices".into(),
    ];
    let pid = std::process::id();
    let host = host_name();
    for (r, d) in devs.iter().enumerate() {
        let name = gpus
            .get(if o.mode.one_gpu() { 0 } else { r })
            .map_or("?", String::as_str);
        // In the process modes this is rank 0's process; the others have pids of their own.
        v.push(format!(
            "#  Rank {r:>2} Group  0 Pid {pid:>6} on {host} device {d:>2} [{name}]"
        ));
    }
    if o.mode.processes() {
        v.push(format!(
            "# NOTE: one process per rank ({}); the pid above is rank 0's",
            if o.mode.one_gpu() {
                format!("all on GPU {}, under CUDA MPS", o.device)
            } else {
                "one GPU each".to_string()
            }
        ));
    }
    if o.mode == Mode::Virtual && o.ranks > 1 {
        v.push(format!(
            "# NOTE: virtual ranks: {} ranks share GPU {}; times measure on-GPU synchronization and compute, not NVLink",
            o.ranks, o.device
        ));
    }
    for t in timing_text(o) {
        v.push(format!("# timing: {t}"));
    }
    v.extend(reference_notes(o));
    if let Some(n) = nccl {
        v.push(format!(
            "# NCCL: {} (version {})",
            n.path().display(),
            flashcomm_nccl_sys::version_string(n.version())
        ));
    }
    if !o.quant.is_empty() && o.coll != args::Collective::AllReduce {
        v.push(quant_op_note(o));
    } else if !o.quant.is_empty() {
        v.push(format!(
            "# quantized rows: group {}, spikes {}; inputs N(0,1) with spikes of +-{}..{} in about 1 of {} values (seed {}); relL2 and maxerr against the fp64 sum, on up to {} values per call; #wrong = values outside the codec's bound + bytes differing across ranks",
            o.group,
            o.spikes,
            crate::inputs::SPIKE_MIN,
            crate::inputs::SPIKE_MAX,
            crate::inputs::SPIKE_PERIOD,
            o.seed,
            o.check_values
        ));
        if o.quant_choice == args::QuantChoice::Auto {
            v.push("# --quant-choice auto: a quantized row whose plan reads lossless:<plan> ran the lossless kernels (the cost model timed at set-up predicts quantizing no more than 3% faster at that size); it is timed and checked as a lossless row, and its relL2, maxerr and effbits are N/A".into());
        }
    }
    if o.check {
        v.push("# lossless rows: #wrong = elements differing from the exact result (integer-valued inputs, checked on the device) + bytes differing from rank 0's result".into());
    }
    v
}

/// The header lines that say what the competitor rows are (with `--impl reference` or
/// `pull-reference`, and `--ref-launch single`), and what `vs_best` takes.
pub fn reference_notes(o: &Options) -> Vec<String> {
    let mut v = Vec::new();
    if o.impls.contains(&Impl::PullReference) {
        v.push(
            "# pull-reference: the pull design of vLLM's and SGLang's custom all-reduce (clean-room): \
             peers' inputs loaded in place, flag barriers; pull-1stage loads and sums every input, \
             pull-2stage reduce-scatters and all-gathers by loads, pull-best repeats the faster of \
             the two (plan: kernel/blocks per rank of 512 threads)"
                .to_string(),
        );
    }
    if o.ref_launches.contains(&RefLaunch::Single) {
        v.push(
            "# -1grid rows: every rank of the reference kernel in one grid launched by rank 0's \
             thread (replayed from its one graph under -G), timed on rank 0's stream; vs_ref is \
             over the reference launched per rank"
                .to_string(),
        );
    }
    let competitors: Vec<&str> = o
        .impls
        .iter()
        .filter(|i| **i != Impl::Flashcomm)
        .map(|i| match i {
            Impl::PullReference => "pull-1stage, pull-2stage",
            other => other.name(),
        })
        .collect();
    if o.impls.contains(&Impl::Flashcomm) && !competitors.is_empty() {
        v.push(format!(
            "# vs_best: flashcomm's time / the fastest of {} at the same size, type and launch mode{}",
            competitors.join(", "),
            if o.impls.iter().any(|i| i.is_reference()) {
                " (references launched per rank)"
            } else {
                ""
            }
        ));
    }
    v
}

/// The header line of quantized AllGather, ReduceScatter and AllToAll rows.
fn quant_op_note(o: &Options) -> String {
    let (exact, across) = match o.coll {
        args::Collective::ReduceScatter => ("the fp64 sum of the shards", ""),
        args::Collective::AllGather => ("the inputs", " + bytes differing across ranks"),
        _ => ("the inputs", ""),
    };
    format!(
        "# quantized rows: {} in one quantization step at the row's width, group {}, spikes {}; inputs N(0,1) with spikes of +-{}..{} in about 1 of {} values (seed {}); relL2 and maxerr against {exact}, on up to {} values per call; #wrong = values outside the bound of flashcomm_codec::reference::{}_quant + bytes differing from it{across}",
        o.coll.name(),
        o.group,
        o.spikes,
        crate::inputs::SPIKE_MIN,
        crate::inputs::SPIKE_MAX,
        crate::inputs::SPIKE_PERIOD,
        o.seed,
        o.check_values,
        o.coll.name()
    )
}

fn layout(o: &Options) -> Layout {
    Layout {
        inplace: o.inplace,
        quant: !o.quant.is_empty(),
        vs_nccl: o.impls.contains(&Impl::Nccl) && o.impls.contains(&Impl::Flashcomm),
        vs_copy: o.copy_baseline,
        vs_ref: o.impls.contains(&Impl::Reference),
        vs_link: o.transport == Choice::Force(Transport::Host),
        vs_best: o.impls.contains(&Impl::Flashcomm)
            && o.impls.iter().any(|i| *i != Impl::Flashcomm),
    }
}

/// Runs the benchmark in this process: all ranks (threads), or one rank of a process mode
/// (`process`: its rank and the exchange folder), which prints and writes files only at rank 0.
fn run_program(
    o: &Options,
    argv: &[String],
    process: Option<&(u32, PathBuf)>,
) -> Result<u64, String> {
    let ndev = flashcomm_comm::gpu::device_count()
        .map_err(|e| format!("needs a CUDA GPU and driver: {e}"))?;
    let devs = run::devices(o);
    if let Some(&max) = devs.iter().max()
        && max >= ndev
    {
        return Err(format!(
            "device {max} is needed but this machine has {ndev} CUDA device(s)"
        ));
    }
    // Device names (the contexts stay alive for the whole run; a rank process holds its own
    // device's only and reads the other names from the driver).
    let mut unique: Vec<i32> = match process {
        Some(&(r, _)) => vec![devs[r as usize]],
        None => devs.clone(),
    };
    unique.dedup();
    let mut contexts = Vec::new();
    let mut gpus = Vec::new();
    for &d in &unique {
        let ctx =
            cudarc::driver::CudaContext::new(d as usize).map_err(|e| format!("device {d}: {e}"))?;
        gpus.push(ctx.name().unwrap_or_else(|_| "unknown GPU".into()));
        contexts.push(ctx);
    }
    if process.is_some() && !o.mode.one_gpu() {
        use cudarc::driver::result::device;
        gpus = devs
            .iter()
            .map(|&d| {
                device::get(d)
                    .and_then(device::get_name)
                    .unwrap_or_else(|_| "unknown GPU".into())
            })
            .collect();
    }
    let prints = process.is_none_or(|&(r, _)| r == 0);
    let nccl = if o.impls.contains(&Impl::Nccl) {
        let path = o.nccl_lib.as_ref().ok_or(
            "--impl nccl needs --nccl-lib <path of the real libnccl.so.2> (or FLASHCOMM_NCCL_LIB); \
             with PyTorch installed: python3 -c 'import nvidia.nccl, os; print(os.path.join(next(iter(nvidia.nccl.__path__)), \"lib\", \"libnccl.so.2\"))'",
        )?;
        Some(Nccl::load(path)?)
    } else {
        None
    };
    let comms = match (&nccl, process) {
        (Some(n), None) => n.init_all(&devs)?,
        _ => Vec::new(),
    };
    let lay = layout(o);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut emit = |lines: &[String]| {
        if !prints {
            return;
        }
        for l in lines {
            let _ = writeln!(out, "{l}");
        }
        let _ = out.flush();
    };
    emit(&header_lines(o, &gpus, nccl.as_ref()));
    emit(&["#".to_string()]);
    emit(&report::header(&lay));
    let mut table = Table::default();
    let mut on_row = |row| {
        let lines = table.add(&lay, row);
        emit(&lines);
    };
    let result = match process {
        Some((r, dir)) => run::run_process(o, *r, dir, nccl.as_ref(), &mut on_row),
        None => run::run(o, nccl.as_ref(), comms, &mut on_row),
    };
    emit(&table.footer());
    let latency = (o.preset == Some(Preset::Latency)).then(|| report::latency_rows(&table.rows));
    if let Some(l) = &latency {
        emit(&["#".to_string()]);
        emit(&report::format_latency(
            &format!(
                "latency: flashcomm {} AllReduce vs a device-to-device copy of the same bytes ({} {} ranks, {}; per-call time; ratio = flashcomm / copy)",
                match o.algo {
                    Choice::Force(Algorithm::OneShot) => "one-shot",
                    Choice::Force(Algorithm::TwoShot) => "two-shot",
                    Choice::Auto => "(auto)",
                },
                o.ranks,
                o.mode.name(),
                o.dtypes.first().map_or("", |d| d.long_name())
            ),
            l,
        ));
    }
    drop(out);
    if !prints {
        drop(contexts);
        return result.map(|()| 0);
    }
    if let Some(path) = &o.json {
        let settings = settings(o, &gpus, nccl.as_ref(), argv);
        let doc = report::document(settings, &table, latency.as_deref());
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &o.svg {
        let title = format!(
            "flashcomm-perf: {} of {} ranks ({}), {}",
            o.coll.name(),
            o.ranks,
            o.mode.name(),
            o.dtypes
                .iter()
                .map(|d| d.long_name())
                .collect::<Vec<_>>()
                .join(",")
        );
        let subtitle = format!(
            "{}; commit {}; {}",
            gpus.first().map_or("GPU", String::as_str),
            o.commit.as_deref().unwrap_or("unknown"),
            if o.launches.contains(&Launch::Graph) && o.launches.len() == 1 {
                "per-call time under CUDA graphs"
            } else {
                "median per-call time"
            }
        );
        let doc = svg::render(&title, &subtitle, &svg::series_from_rows(&table.rows));
        std::fs::write(path, doc).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    drop(contexts);
    result?;
    Ok(table.wrong_total())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn opts(args: &str) -> Options {
        let v: Vec<String> = args.split_whitespace().map(String::from).collect();
        match args::parse(&v).unwrap() {
            Command::Run(o) => *o,
            Command::Help => unreachable!(),
        }
    }

    #[test]
    fn header_names_the_virtual_ranks_and_the_timing() {
        let o = opts("--preset latency");
        let h = header_lines(&o, &["NVIDIA H200".into()], None);
        assert!(h.iter().all(|l| l.starts_with('#')));
        assert!(h.iter().any(|l| l.contains("not NVLink")));
        assert!(h.iter().any(|l| l.starts_with("# timing: eager")));
        assert!(h.iter().any(|l| l.starts_with("# timing: graph")));
        assert_eq!(h.iter().filter(|l| l.contains("Rank ")).count(), 8);
        assert!(h[1].contains("step: 2(factor)") && h[1].contains("graph: 20"));
        let g = header_lines(
            &opts("--mode gpus --ranks 2"),
            &["A".into(), "B".into()],
            None,
        );
        assert!(!g.iter().any(|l| l.contains("not NVLink")));
        assert!(g.iter().any(|l| l.contains("device  1 [B]")));
    }

    #[test]
    fn settings_record_the_run() {
        let o = opts("--quant 4,4/8 --commit abc123 -b 4K -e 8K -f 2");
        let s = serde_json::to_value(settings(&o, &["NVIDIA H200".into()], None, &["-b".into()]))
            .unwrap();
        assert_eq!(s["commit"], "abc123");
        assert_eq!(s["gpu"], "NVIDIA H200");
        assert_eq!(s["ranks"], 8);
        assert_eq!(s["mode"], "virtual");
        assert_eq!(s["quant"], json!(["4", "4/8"]));
        assert_eq!(s["algo"], "auto");
        assert!(s["nccl"].is_null());
        assert!(s["timing"][0].as_str().unwrap().contains("median"));
    }

    #[test]
    fn quantized_rows_of_every_collective_are_described() {
        let ar = header_lines(&opts("--quant 4"), &["G".into()], None);
        let line = ar
            .iter()
            .find(|l| l.starts_with("# quantized rows"))
            .unwrap();
        assert!(line.contains("against the fp64 sum, on up to 1048576 values per call"));
        assert!(line.ends_with("bytes differing across ranks"));
        let rs = header_lines(&opts("--coll reducescatter --quant 4"), &["G".into()], None);
        let line = rs
            .iter()
            .find(|l| l.starts_with("# quantized rows"))
            .unwrap();
        assert!(line.contains("one quantization step") && line.contains("sum of the shards"));
        assert!(line.ends_with("reducescatter_quant + bytes differing from it"));
        let ag = header_lines(&opts("--coll allgather --quant 8,4"), &["G".into()], None);
        let line = ag
            .iter()
            .find(|l| l.starts_with("# quantized rows"))
            .unwrap();
        assert!(line.contains("allgather_quant") && line.ends_with("across ranks"));
        let a2a = header_lines(&opts("--coll alltoall --quant 8"), &["G".into()], None);
        assert!(a2a.iter().any(|l| l.contains("alltoall_quant")));
        let s = serde_json::to_value(settings(
            &opts("--coll alltoall --quant 8,4"),
            &["G".into()],
            None,
            &[],
        ))
        .unwrap();
        assert_eq!(s["collective"], args::Collective::AlltoAll.name());
        assert_eq!(s["quant"], json!(["8", "4"]));
    }

    #[test]
    fn competitors_are_described_and_recorded() {
        let o = opts("--impl flashcomm,reference,pull-reference --ref-launch per-rank,single");
        let h = header_lines(&o, &["NVIDIA H100".into()], None);
        assert!(h[0].ends_with("impl flashcomm,reference,pull-reference"));
        assert!(
            h.iter()
                .any(|l| l.starts_with("# pull-reference: the pull design"))
        );
        assert!(h.iter().any(|l| l.starts_with("# -1grid rows")));
        let best = h.iter().find(|l| l.starts_with("# vs_best")).unwrap();
        assert!(
            best.contains("reference, pull-1stage, pull-2stage")
                && best.ends_with("(references launched per rank)"),
            "{best}"
        );
        let lay = layout(&o);
        assert!(lay.vs_ref && lay.vs_best);
        let s = serde_json::to_value(settings(&o, &["G".into()], None, &[])).unwrap();
        assert_eq!(
            s["impls"],
            json!(["flashcomm", "reference", "pull-reference"])
        );
        assert_eq!(s["ref_launches"], json!(["per-rank", "single"]));
        // NCCL alone is a competitor too; without flashcomm there is no vs_best.
        let n = opts("--impl flashcomm,nccl --mode gpus --ranks 2");
        assert!(layout(&n).vs_best);
        let nb = header_lines(&n, &["G".into(), "G".into()], None);
        assert!(
            nb.iter()
                .any(|l| l.ends_with("the fastest of nccl at the same size, type and launch mode"))
        );
        let r = opts("--impl reference,pull-reference");
        assert!(!layout(&r).vs_best);
        assert!(
            !header_lines(&r, &["G".into()], None)
                .iter()
                .any(|l| l.starts_with("# vs_best"))
        );
        assert!(!layout(&opts("")).vs_best);
    }

    #[test]
    fn help_and_bad_flags_exit_codes() {
        assert_eq!(main_with(&["--help".to_string()]), 0);
        assert_eq!(main_with(&["--bogus".to_string()]), 2);
    }

    #[test]
    fn rank_process_variable() {
        assert_eq!(
            parse_process("2:/tmp/x", 4).unwrap(),
            (2, PathBuf::from("/tmp/x"))
        );
        for bad in ["4:/tmp/x", "x:/tmp/x", "1:", "1", ""] {
            assert!(parse_process(bad, 4).unwrap_err().contains(PROCESS_ENV));
        }
    }
}
