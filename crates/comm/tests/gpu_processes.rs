//! GPU tests with virtual ranks as separate processes on one GPU, exchanging IPC handles through a
//! folder (`FileBootstrap`), as under CUDA MPS (the GPU runner starts the MPS daemon around these
//! tests: without it, kernels of different processes time-slice and every exchange crawls).
//!
//! On a machine of several GPUs, `FLASHCOMM_TEST_GPUS=k` puts rank r on device `r % k` and
//! `FLASHCOMM_TEST_PROCESSES=n` (default 4) sets the number of rank processes: with n = k, one
//! rank process per GPU, which needs no MPS (`ci/multi-gpu-check.sh`).
//!
//! The parent test spawns one child per rank: this test binary again, running only
//! `child_process_entry` with `FLASHCOMM_TEST_CHILD=mps:<dir>:<rank>:<ranks>:<mode>`. That entry
//! point does nothing (and passes) when the variable is not set.
#![cfg(feature = "gpu")]

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use flashcomm_codec::reference;
use flashcomm_comm::Request;
use flashcomm_comm::{
    Agreement, Algorithm, Bootstrap, Choice, Collective, CommConfig, Communicator, DataType,
    DeviceMem, QuantSpec, Stream, Transport,
};
use flashcomm_testkit::FileBootstrap;
use flashcomm_testkit::verify::{TestType, Verifier};

const ENV: &str = "FLASHCOMM_TEST_CHILD";
/// Exit code of a child that saw the expected error in time (the "killed peer" mode).
const EXPECTED_ERROR: i32 = 3;
/// Exit code of a child whose communicator set-up was refused with an error (the "pidns" mode).
const SETUP_REFUSED: i32 = 4;

fn spawn(dir: &std::path::Path, rank: u32, n: u32, mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV, format!("mps:{}:{rank}:{n}:{mode}", dir.display()))
        .spawn()
        .expect("spawn a rank process")
}

fn wait_all(children: &mut [Child], limit: Duration) -> Vec<Option<i32>> {
    let deadline = Instant::now() + limit;
    let mut codes = vec![None; children.len()];
    loop {
        let mut pending = false;
        for (i, c) in children.iter_mut().enumerate() {
            if codes[i].is_none() {
                match c.try_wait().unwrap() {
                    Some(st) => codes[i] = Some(st.code().unwrap_or(-1)),
                    None => pending = true,
                }
            }
        }
        if !pending {
            return codes;
        }
        if Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            return codes;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Rank processes of each test (`FLASHCOMM_TEST_PROCESSES`, default 4, at least 2).
fn process_ranks() -> u32 {
    std::env::var("FLASHCOMM_TEST_PROCESSES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &u32| (2..=8).contains(&n))
        .unwrap_or(4)
}

fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("flashcomm-mps-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Four processes on one GPU (or one per GPU) run AllReduce, AllGather, ReduceScatter and AllToAll
/// through IPC-mapped arenas, exact; the quantized AllReduce (one-shot, two-step, mixed widths) bit
/// for bit the CPU reference; and a CUDA graph of a lossless and a quantized AllReduce replayed.
#[test]
fn processes_exchange_through_ipc() {
    let n = process_ranks();
    let dir = scratch_dir("ok");
    let mut kids: Vec<Child> = (0..n).map(|r| spawn(&dir, r, n, "collectives")).collect();
    let codes = wait_all(&mut kids, Duration::from_secs(120));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "rank processes exited with {codes:?}"
    );
}

/// Zero-copy between processes (`zero_copy`, the direct PULL protocol forced): registered buffers
/// are read by peers in place, and every way a registration can be partial or stale gives exact
/// results: nothing registered (every rank stages), registration on the even ranks only (they read
/// in place, the odd ones stage), on every rank, a CUDA graph captured in place and replayed after
/// every rank deregistered its buffers, and a registered buffer freed and allocated again at the
/// same address without a new registration (staged), then registered again (in place).
#[test]
fn zero_copy_registered_buffers() {
    every_rank_passes("zerocopy", Duration::from_secs(120));
}

/// Zero-copy with allocator churn: every rank process registers (collectively), reads in place,
/// deregisters and frees 10,000 buffers (`FLASHCOMM_TEST_CHURN` sets another count); the peers'
/// mappings of retracted buffers are closed, so what a rank has mapped stays bounded, and every
/// checked call is exact.
#[test]
fn zero_copy_mappings_stay_bounded_under_churn() {
    every_rank_passes("churn", Duration::from_secs(280));
}

/// Issue 45, item 5, in the shape users run (one process per rank): 1,000 abort-and-reinit
/// cycles (the way elastic jobs recover) beside another communicator of the same processes that
/// is busy the whole time (`FLASHCOMM_TEST_CYCLES` sets another count). Each rank tells its
/// peers when it is done with their arenas, an arena is freed once all its peers have, and a busy
/// communicator whose ranks are processes of their own holds no free back: device memory stays
/// where it was after the first 50 cycles, no more than a few arenas wait for peers, and every
/// release completes in under a second. (With the ranks as threads of one process a free beside
/// the busy communicator would deadlock it: there it holds frees back, `crate::release`.)
#[test]
fn a_thousand_abort_and_reinit_cycles_beside_a_busy_communicator_stay_bounded() {
    every_rank_passes("reinit", Duration::from_secs(280));
}

/// Two rank processes, each in a PID namespace of its own (both pid 1 there, as in two
/// containers of one pod): a file-descriptor export names its owner by a pid that means the
/// importer itself in the importer's namespace. The importer must refuse it (the owner's identity
/// descriptor does not hold the owner's token) and stage, with exact results, never read its own
/// memory in place; or, where the driver refuses legacy CUDA IPC across PID namespaces (the
/// arenas), every rank's set-up fails with an error. Needs root (`unshare`); runs without MPS
/// (kernels of the two processes then time-slice: slow, but correct).
#[test]
fn zero_copy_refuses_an_owner_of_another_pid_namespace() {
    let dir = scratch_dir("pidns");
    // No MPS client: the daemon is not reached from a directory of its own.
    let pipes = dir.join("no-mps");
    std::fs::create_dir_all(&pipes).unwrap();
    let mut kids: Vec<Child> = (0..2)
        .map(|r| {
            Command::new("unshare")
                .args(["--pid", "--fork", "--kill-child"])
                .arg(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "child_process_entry",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ENV, format!("mps:{}:{r}:2:pidns", dir.display()))
                .env("CUDA_MPS_PIPE_DIRECTORY", &pipes)
                .env("CUDA_MPS_LOG_DIRECTORY", &pipes)
                .spawn()
                .expect("unshare (util-linux) runs the rank processes")
        })
        .collect();
    let codes = wait_all(&mut kids, Duration::from_secs(240));
    let _ = std::fs::remove_dir_all(&dir);
    // Either every rank refused the set-up with an error, or every rank ran exact (staging what
    // it could not authenticate): never a wrong result, never a hang.
    assert!(
        codes.iter().all(|c| *c == Some(0)) || codes.iter().all(|c| *c == Some(SETUP_REFUSED)),
        "rank processes in their own PID namespaces exited with {codes:?} (unshare needs root)"
    );
    println!(
        "ranks in two PID namespaces: {}",
        if codes[0] == Some(0) {
            "set up, descriptor exports refused and staged, exact"
        } else {
            "set-up refused with an error on every rank"
        }
    );
}

/// 100,000 back-to-back collectives of random sizes, kinds, types and protocols (the sequence of
/// `gpu_collectives`' stress test) across the rank processes, each verified on the device.
#[test]
fn stress_100k_random_collectives_across_processes() {
    every_rank_passes("stress", Duration::from_secs(280));
}

/// One of four processes is killed after set-up; the others' collective ends in an error within
/// the timeout plus one second, and they can destroy their communicators and exit cleanly.
#[test]
fn killed_process_gives_errors_not_hangs() {
    let n = process_ranks();
    let dir = scratch_dir("kill");
    let mut kids: Vec<Child> = (0..n)
        .map(|r| spawn(&dir, r, n, if r == n - 1 { "victim" } else { "survivor" }))
        .collect();
    // The victim announces that its set-up is done by creating a file; then it is killed.
    let ready = dir.join("victim-ready");
    let t0 = Instant::now();
    while !ready.exists() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ready.exists(), "the victim never finished its set-up");
    kids[(n - 1) as usize].kill().expect("kill the victim");
    let codes = wait_all(&mut kids, Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
    for (r, c) in codes.iter().enumerate().take((n - 1) as usize) {
        assert_eq!(
            *c,
            Some(EXPECTED_ERROR),
            "survivor {r} exited with {c:?} (3 = error reported in time)"
        );
    }
}

/// Runs the rank processes, all but the last in mode `others` and the last in `last`, and
/// returns their exit codes (`None`: still running after `limit`, then killed).
fn processes(tag: &str, others: &str, last: &str, limit: Duration) -> Vec<Option<i32>> {
    let n = process_ranks();
    let dir = scratch_dir(tag);
    let mut kids: Vec<Child> = (0..n)
        .map(|r| spawn(&dir, r, n, if r == n - 1 { last } else { others }))
        .collect();
    let codes = wait_all(&mut kids, limit);
    let _ = std::fs::remove_dir_all(&dir);
    codes
}

/// Every rank process runs `mode` and exits 0 within `limit`.
fn every_rank_passes(mode: &str, limit: Duration) {
    let codes = processes(mode, mode, mode, limit);
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "rank processes exited with {codes:?}"
    );
}

/// All processes but the last saw their wait end in time (`EXPECTED_ERROR`), the last exited 0.
fn others_ended_in_time(codes: &[Option<i32>], what: &str) {
    let last = codes.len() - 1;
    for (r, c) in codes.iter().enumerate().take(last) {
        assert_eq!(
            *c,
            Some(EXPECTED_ERROR),
            "rank {r} exited with {c:?} (3 = {what})"
        );
    }
    assert_eq!(codes[last], Some(0), "the absent rank");
}

/// Rank processes under MPS with no time limit: the last rank reaches the AllReduce
/// `FLASHCOMM_TEST_LATE_S` (default 30) seconds after the others, and every rank completes with
/// the right result.
#[test]
fn a_late_process_completes_without_a_timeout() {
    let codes = processes("late", "late", "late", Duration::from_secs(late_s() + 90));
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "rank processes exited with {codes:?} (0 = completed and checked)"
    );
}

/// Rank processes under MPS with no time limit: the last rank never calls; a watchdog thread of
/// every other rank aborts its communicator a second after its launch, and the wait ends within
/// 5 s with an error on every other rank (its own abort, or a peer's that came first).
#[test]
fn abort_from_a_watchdog_thread_ends_the_wait_in_every_process() {
    let codes = processes("watchdog", "watchdog", "absent", Duration::from_secs(90));
    others_ended_in_time(&codes, "the abort ended its wait in time");
}

/// As above, with every other rank's launch queued on its stream behind an operation that never
/// finishes by itself (a collective of a second communicator the last rank never joins, standing
/// for an NCCL operation stuck on a dead peer): the watchdog sets the abort flag, the "real
/// abort" ends the stuck operation, and the queued launch finishes within 5 s on every rank.
#[test]
fn abort_returns_in_every_process_when_the_launch_is_queued_behind_a_stuck_operation() {
    let codes = processes("queued", "queued", "absent2", Duration::from_secs(90));
    others_ended_in_time(&codes, "the abort ended its queued launch in time");
}

/// Fault class 1 across processes (MPS): set-up fails, or panics, at each step on the last of
/// four rank processes; every process ends with the same verdict after the same rounds (a panic
/// is caught and the rank takes part in the next round saying so: `Agreement::abandon`, as the
/// shim does).
#[test]
fn a_set_up_failure_or_panic_in_one_process_ends_alike_in_every_process() {
    let n = 4;
    for kind in ["fail", "panic"] {
        for step in 0..=7u32 {
            let dir = scratch_dir(&format!("setup-{kind}-{step}"));
            let mode = format!("setup:{kind}:{step}:{}", n - 1);
            let mut kids: Vec<Child> = (0..n).map(|r| spawn(&dir, r, n, &mode)).collect();
            let codes = wait_all(&mut kids, Duration::from_secs(180));
            let verdicts: Vec<String> = (0..n)
                .map(|r| {
                    std::fs::read_to_string(dir.join(format!("verdict-{r}"))).unwrap_or_default()
                })
                .collect();
            let _ = std::fs::remove_dir_all(&dir);
            assert!(codes.iter().all(|c| *c == Some(0)), "{mode}: {codes:?}");
            for v in &verdicts {
                assert_eq!(v, &verdicts[0], "{mode}: every process alike: {verdicts:?}");
            }
            assert!(
                verdicts[0].contains(&format!("rank {}", n - 1)),
                "{mode}: {}",
                verdicts[0]
            );
            println!("{mode}: {}", verdicts[0]);
        }
    }
}

/// A rank process of the set-up fault test: `spec` is `<kind>:<step>:<failing rank>`.
fn set_up_with_a_fault(dir: &std::path::Path, rank: u32, n: u32, spec: &str) {
    let parts: Vec<&str> = spec.split(':').collect();
    let (kind, step, failing): (&str, u32, u32) = (
        parts[0],
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
    );
    let boot = FileBootstrap::new(dir, rank, n, Duration::from_secs(120)).expect("bootstrap");
    let mut cfg = CommConfig {
        // Bounds the calibration kernels of the ranks whose peer failed before launching.
        timeout: Duration::from_secs(5),
        calibrate: true,
        arena_bytes: 8 << 20,
        ..CommConfig::default()
    };
    if rank == failing {
        match kind {
            "fail" => cfg.fail_at = Some(step),
            _ => cfg.panic_at = Some(step),
        }
    }
    let mut ag = Agreement::new(&boot);
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Communicator::new_agreed(&mut ag, 0, cfg)
    }));
    let verdict = match built {
        Ok(Ok(c)) => {
            drop(c);
            "served".to_string()
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => ag.abandon("a panic".into()).to_string(),
    };
    std::fs::write(
        dir.join(format!("verdict-{rank}")),
        format!("{} rounds: {verdict}", ag.rounds()),
    )
    .unwrap();
}

fn late_s() -> u64 {
    std::env::var("FLASHCOMM_TEST_LATE_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30)
}

/// Entry point of the rank processes (does nothing in a normal test run).
#[test]
fn child_process_entry() {
    let Ok(spec) = std::env::var(ENV) else { return };
    let parts: Vec<&str> = spec.splitn(5, ':').collect();
    let mode = parts[4];
    let dir = std::path::PathBuf::from(parts[1]);
    let (rank, n): (u32, u32) = (parts[2].parse().unwrap(), parts[3].parse().unwrap());
    if let Some(spec) = mode.strip_prefix("setup:") {
        set_up_with_a_fault(&dir, rank, n, spec);
        return;
    }
    // The late and watchdog modes run as NCCL does by default: with no time limit.
    let timeout = match mode {
        "late" | "watchdog" | "queued" | "absent" | "absent2" => Duration::ZERO,
        _ => Duration::from_secs(3),
    };
    let boot = FileBootstrap::new(&dir, rank, n, Duration::from_secs(60)).expect("bootstrap");
    // Zero-copy is a peer-transport matter (the host transport's peers cannot read device
    // memory), whatever transport the other modes take. The other modes run with the product's
    // default, or as `FLASHCOMM_ZERO_COPY` says (the runner runs them both ways).
    let forced_zero_copy = matches!(mode, "zerocopy" | "churn" | "pidns");
    let zero_copy = forced_zero_copy
        || std::env::var("FLASHCOMM_ZERO_COPY").map_or(CommConfig::default().zero_copy, |v| {
            !matches!(v.as_str(), "0" | "false" | "no" | "off")
        });
    let cfg = CommConfig {
        timeout,
        calibrate: false,
        zero_copy,
        transport: match std::env::var("FLASHCOMM_TRANSPORT").as_deref() {
            _ if forced_zero_copy => Choice::Force(Transport::P2p),
            Ok("host") => Choice::Force(Transport::Host),
            Ok("p2p") => Choice::Force(Transport::P2p),
            _ => Choice::Auto,
        },
        host_copy: common::test_host_copy(),
        ..CommConfig::default()
    };
    let dev = common::test_device(rank);
    let comm = match Communicator::new(&boot, dev, cfg.clone()) {
        Ok(c) => c,
        // Legacy CUDA IPC (the arenas) may be refused across PID namespaces: an error on every
        // rank, never a wrong mapping.
        Err(e) if mode == "pidns" => {
            println!("rank {rank}: set-up across PID namespaces refused: {e}");
            std::process::exit(SETUP_REFUSED);
        }
        Err(e) => panic!("communicator set-up across processes: {e}"),
    };
    // A second communicator of the same ranks (the "queued" mode's stuck operation).
    let second = matches!(mode, "queued" | "absent2").then(|| {
        let d = dir.join("second");
        let _ = std::fs::create_dir_all(&d);
        let b = FileBootstrap::new(&d, rank, n, Duration::from_secs(60)).expect("bootstrap");
        Communicator::new(&b, dev, cfg.clone()).expect("second communicator")
    });
    let v = Verifier::new(dev).expect("verifier");
    let _ctx = v.activate().unwrap();
    let s = v.stream().unwrap();
    let send = v.alloc(4 << 20).unwrap();
    let recv = v.alloc(4 * (4 << 20)).unwrap();
    boot.barrier().unwrap();
    match mode {
        "collectives" => {
            for (i, (coll, ty, count)) in [
                (Collective::AllReduce, TestType::Bf16, 100_001u64),
                (Collective::AllReduce, TestType::F32, 1_000_003),
                (Collective::AllGather, TestType::U8, 70_001),
                (Collective::ReduceScatter, TestType::F16, 50_001),
                (Collective::AlltoAll, TestType::Bf16, 30_001),
            ]
            .into_iter()
            .enumerate()
            {
                let salt = 40 + i as u32;
                let (se, re) = common::send_recv_elems(coll, count, u64::from(n));
                let elem = ty.bytes();
                v.fill(send.as_ptr(), se, ty, rank, salt, s).unwrap();
                let p = comm.plan(&Request::bytes(coll, count, elem)).unwrap();
                comm.execute_plan(
                    p,
                    &Request::for_plan(&p, count, ty.dtype(), elem)
                        .between(
                            send.slice(0, (se * elem) as usize),
                            recv.slice(0, (re * elem) as usize),
                        )
                        .on(s),
                )
                .unwrap();
                v.check(recv.as_ptr(), re, count, coll, ty, n, rank, salt, s)
                    .unwrap();
                s.synchronize().unwrap();
                comm.check_status().expect("device status");
                let (bad, first) = v.errors().unwrap();
                assert_eq!(
                    bad, 0,
                    "rank {rank}: {coll:?} {ty:?} count={count}: {bad} wrong, first at {first}"
                );
                boot.barrier().unwrap();
            }
            let eager = quantized_checks(&comm, s, &send, &recv, rank, n);
            boot.barrier().unwrap();
            graph_replay(&comm, &boot, &v, s, &send, &recv, rank, n, &eager);
            boot.barrier().unwrap();
        }
        "late" => {
            let count = 100_003u64;
            let t = TestType::Bf16;
            v.fill(send.as_ptr(), count, t, rank, 7, s).unwrap();
            s.synchronize().unwrap();
            if rank == n - 1 {
                std::thread::sleep(Duration::from_secs(late_s()));
            }
            let t0 = Instant::now();
            comm.execute(
                &Request::typed(Collective::AllReduce, count, DataType::Bf16)
                    .between(send.as_ptr(), recv.as_ptr())
                    .on(s),
            )
            .unwrap();
            v.check(
                recv.as_ptr(),
                count,
                count,
                Collective::AllReduce,
                t,
                n,
                rank,
                7,
                s,
            )
            .unwrap();
            s.synchronize().unwrap();
            comm.check_status().expect("no error for a late peer");
            let (bad, first) = v.errors().unwrap();
            assert_eq!(bad, 0, "rank {rank}: {bad} wrong, first at {first}");
            println!("rank {rank} completed after {:?}", t0.elapsed());
            boot.barrier().unwrap();
        }
        "absent" | "absent2" => {
            // Never calls; waits until every other rank has ended its wait, then leaves.
            while (0..n - 1).any(|r| !dir.join(format!("aborted-{r}")).exists()) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        "queued" => {
            let stuck = second.as_ref().expect("built above");
            stuck
                .execute(
                    &Request::typed(Collective::AllReduce, 1000, DataType::Bf16)
                        .between(send.as_ptr(), send.as_ptr())
                        .on(s),
                )
                .unwrap();
            comm.execute(
                &Request::typed(Collective::AllReduce, 1000, DataType::Bf16)
                    .between(send.as_ptr(), recv.as_ptr())
                    .on(s),
            )
            .unwrap();
            std::thread::sleep(Duration::from_millis(300));
            let queued = comm.wait_idle_for(Duration::from_millis(10)) == Ok(false);
            let t0 = Instant::now();
            let idle = std::thread::scope(|w| {
                w.spawn(|| {
                    // ncclCommAbort's order: our flag, the real abort, then a bounded wait.
                    comm.abort();
                    stuck.abort();
                    comm.wait_idle_for(Duration::from_secs(2))
                })
                .join()
                .unwrap()
            });
            let took = t0.elapsed();
            println!("rank {rank}: queued {queued}, idle {idle:?} {took:?} after the abort");
            std::fs::write(dir.join(format!("aborted-{rank}")), b"").unwrap();
            drop(second);
            drop(comm);
            std::process::exit(
                if queued && idle == Ok(true) && took < Duration::from_secs(5) {
                    EXPECTED_ERROR
                } else {
                    1
                },
            );
        }
        "watchdog" => {
            comm.execute(
                &Request::typed(Collective::AllReduce, 1000, DataType::Bf16)
                    .between(send.as_ptr(), recv.as_ptr())
                    .on(s),
            )
            .unwrap();
            let aborted_at = common::abort_from_another_thread(&comm, Duration::from_secs(1));
            let idle = comm.wait_idle_for(Duration::from_secs(5));
            let took = aborted_at.elapsed();
            let status = comm.check_status();
            println!("rank {rank}: idle {idle:?} {took:?} after the abort: {status:?}");
            std::fs::write(dir.join(format!("aborted-{rank}")), b"").unwrap();
            // Its own abort, or a peer's that came first (NCCL's ncclRemoteError).
            let reported = matches!(&status, Err(flashcomm_comm::Error::Remote(m))
                if m.contains("aborted") || m.contains("a peer gave up"));
            drop(comm);
            std::process::exit(
                if idle == Ok(true) && took < Duration::from_secs(5) && reported {
                    EXPECTED_ERROR
                } else {
                    1
                },
            );
        }
        "zerocopy" => zero_copy_checks(&comm, &boot, &v, s, rank, n),
        "churn" => zero_copy_churn(&comm, &boot, &v, s, rank, n),
        "reinit" => reinit_beside_a_busy_communicator(&dir, rank, n, dev, &cfg),
        "pidns" => zero_copy_other_namespace(&comm, &boot, &v, s, &recv, rank, n),
        "stress" => stress_calls(&comm, &v, s, &send, &recv, rank, n),
        "victim" => {
            std::fs::write(dir.join("victim-ready"), b"").unwrap();
            std::thread::sleep(Duration::from_secs(600));
        }
        _ => {
            // Survivor: wait until the victim is gone (the parent kills it after set-up), then
            // call a collective that can never complete.
            while !dir.join("victim-ready").exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
            std::thread::sleep(Duration::from_millis(500));
            let t = Instant::now();
            comm.execute(
                &Request::typed(Collective::AllReduce, 1000, DataType::Bf16)
                    .between(send.as_ptr(), recv.as_ptr())
                    .on(s),
            )
            .unwrap();
            // The error arrives as the device status (timeout) or, if the dead peer's memory
            // became unreachable, as a CUDA error of the stream.
            let err = s
                .synchronize()
                .map_err(flashcomm_comm::Error::from)
                .and_then(|()| comm.check_status());
            let took = t.elapsed();
            println!("rank {rank}: after {took:?}: {err:?}");
            drop(comm);
            std::process::exit(
                if err.is_err() && took <= timeout + Duration::from_secs(1) {
                    EXPECTED_ERROR
                } else {
                    1
                },
            );
        }
    }
}

/// The quantized AllReduces of the rank processes: (dtype, rs bits, ag bits, group, spikes,
/// algorithm, count).
const QUANT_CASES: [(DataType, u8, u8, u16, u8, Algorithm, usize); 3] = [
    (DataType::Bf16, 4, 4, 128, 2, Algorithm::OneShot, 100_003),
    (DataType::Bf16, 4, 4, 128, 2, Algorithm::TwoShot, 300_007),
    (DataType::F16, 3, 8, 64, 2, Algorithm::TwoShot, 200_001),
];

/// Rank `rk`'s inputs of quantized case `ci` (activation-like values with spikes, the same in
/// every process).
fn quant_inputs(ci: usize, rk: u32, count: usize) -> Vec<f32> {
    common::activations(((ci as u64) << 8) | 0x40 | rk as u64, count, 997, 13, 300.0)
}

/// The CPU reference output (little-endian bytes) of a quantized case.
fn quant_reference(ci: usize, n: u32) -> Vec<u8> {
    let (dtype, rs, ag, group, spikes, algo, count) = QUANT_CASES[ci];
    let q = QuantSpec::new(rs, ag, group, spikes).unwrap();
    let (fr, fa) = (q.format(dtype, rs).unwrap(), q.format(dtype, ag).unwrap());
    fn run<T: flashcomm_codec::Element + Copy>(
        algo: Algorithm,
        fr: flashcomm_codec::Format,
        fa: flashcomm_codec::Format,
        conv: impl Fn(f32) -> T,
        all: &[Vec<f32>],
    ) -> Vec<u8> {
        let typed: Vec<Vec<T>> = all
            .iter()
            .map(|v| v.iter().map(|x| conv(*x)).collect())
            .collect();
        let refs: Vec<&[T]> = typed.iter().map(|v| v.as_slice()).collect();
        let out = match algo {
            Algorithm::OneShot => reference::allreduce_oneshot_with_bound(fr, &refs),
            Algorithm::TwoShot => reference::allreduce_twostep_with_bound(fr, fa, &refs),
        };
        let mut bytes = Vec::new();
        for x in &out.values {
            let mut b = [0u8; 4];
            x.write_le(&mut b);
            bytes.extend_from_slice(&b[..T::BYTES]);
        }
        bytes
    }
    let all: Vec<Vec<f32>> = (0..n).map(|rk| quant_inputs(ci, rk, count)).collect();
    match dtype {
        DataType::F16 => run(algo, fr, fa, half::f16::from_f32, &all),
        _ => run(algo, fr, fa, half::bf16::from_f32, &all),
    }
}

/// Runs every quantized case eagerly; each rank's output must be the CPU reference bit for bit
/// (so every rank's output is the same). Returns the output bytes of the first case.
fn quantized_checks(
    comm: &Communicator,
    s: Stream,
    send: &DeviceMem,
    recv: &DeviceMem,
    rank: u32,
    n: u32,
) -> Vec<u8> {
    let mut first = Vec::new();
    for (ci, &(dtype, rs, ag, group, spikes, algo, count)) in QUANT_CASES.iter().enumerate() {
        let q = QuantSpec::new(rs, ag, group, spikes).unwrap();
        let bytes = count * 2;
        let mine = common::half_bytes(dtype, &quant_inputs(ci, rank, count));
        send.upload(0, &mine, s).unwrap();
        recv.fill(0xA5, s).unwrap();
        let p = comm
            .plan_forced(
                &Request::typed(Collective::AllReduce, count as u64, dtype).quantized(q, false),
                Choice::Force(algo),
                common::test_proto(),
            )
            .expect("quantized plan");
        comm.execute_plan(
            p,
            &Request::for_plan(&p, count as u64, Some(dtype), 2)
                .between(send.slice(0, bytes), recv.slice(0, bytes))
                .on(s),
        )
        .unwrap();
        let mut got = vec![0u8; bytes];
        recv.download(0, &mut got, s).unwrap();
        s.synchronize().unwrap();
        comm.check_status().expect("device status");
        let want = quant_reference(ci, n);
        let what = format!(
            "rank {rank} of {n}: {dtype:?} {rs}/{ag} bits g{group} k{spikes} {algo:?} count={count}"
        );
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!("{what}: byte {i} differs from the CPU reference");
        }
        println!("ok {what}: bit-identical to the CPU reference");
        if ci == 0 {
            first = got;
        }
    }
    first
}

/// A CUDA graph of a lossless AllReduce (checked on the device by the graph itself) and the first
/// quantized case, replayed 200 times: no lossless element wrong, and the quantized output the
/// eager bytes.
#[allow(clippy::too_many_arguments)]
fn graph_replay(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    send: &DeviceMem,
    recv: &DeviceMem,
    rank: u32,
    n: u32,
    eager: &[u8],
) {
    const REPLAYS: usize = 200;
    let (dtype, rs, ag, group, spikes, algo, qcount) = QUANT_CASES[0];
    let qbytes = qcount * 2;
    let (ty, count, salt) = (TestType::Bf16, 100_001u64, 90u32);
    let lbytes = (count * ty.bytes()) as usize;
    // The lossless inputs at 2 MiB, the quantized ones at 0; outputs at 0 and 8 MiB.
    let (lin, qout) = (2 << 20, 8 << 20);
    v.fill(send.slice(lin, lbytes), count, ty, rank, salt, s)
        .unwrap();
    send.upload(
        0,
        &common::half_bytes(dtype, &quant_inputs(0, rank, qcount)),
        s,
    )
    .unwrap();
    recv.fill(0xA5, s).unwrap();
    let lp = comm
        .plan(&Request::bytes(Collective::AllReduce, count, ty.bytes()))
        .unwrap();
    let q = QuantSpec::new(rs, ag, group, spikes).unwrap();
    let qp = comm
        .plan_forced(
            &Request::typed(Collective::AllReduce, qcount as u64, dtype).quantized(q, false),
            Choice::Force(algo),
            common::test_proto(),
        )
        .expect("quantized plan");
    s.synchronize().unwrap();
    boot.barrier().unwrap();
    s.begin_capture().unwrap();
    comm.execute_plan(
        lp,
        &Request::for_plan(&lp, count, ty.dtype(), ty.bytes())
            .between(send.slice(lin, lbytes), recv.slice(0, lbytes))
            .on(s),
    )
    .unwrap();
    v.check(
        recv.as_ptr(),
        count,
        count,
        Collective::AllReduce,
        ty,
        n,
        rank,
        salt,
        s,
    )
    .unwrap();
    comm.execute_plan(
        qp,
        &Request::for_plan(&qp, qcount as u64, Some(dtype), 2)
            .between(send.slice(0, qbytes), recv.slice(qout, qbytes))
            .on(s),
    )
    .unwrap();
    let graph = s.end_capture().expect("capture");
    // Every rank's graph is instantiated before any rank replays.
    boot.barrier().unwrap();
    for _ in 0..REPLAYS {
        graph.launch(s).unwrap();
    }
    s.synchronize().unwrap();
    comm.check_status().expect("device status");
    let (bad, first) = v.errors().unwrap();
    assert_eq!(
        bad, 0,
        "rank {rank}: {REPLAYS} graph replays: {bad} lossless elements wrong, first at {first}"
    );
    let mut got = vec![0u8; qbytes];
    recv.download(qout, &mut got, s).unwrap();
    s.synchronize().unwrap();
    assert!(
        got == eager,
        "rank {rank}: the quantized AllReduce replayed from a graph differs from the eager bytes"
    );
    println!(
        "ok rank {rank} of {n}: graph of a lossless and a quantized AllReduce replayed {REPLAYS} times"
    );
}

/// The calls of one zero-copy phase: (collective, type, count, algorithm), every piece a multiple
/// of 16 bytes (so that registration alone decides whether a rank stages).
const ZERO_COPY_CALLS: [(Collective, TestType, u64, Algorithm); 5] = [
    (
        Collective::AllReduce,
        TestType::Bf16,
        30_008,
        Algorithm::OneShot,
    ),
    (
        Collective::AllReduce,
        TestType::F32,
        200_000,
        Algorithm::TwoShot,
    ),
    (
        Collective::AllGather,
        TestType::U8,
        70_000,
        Algorithm::OneShot,
    ),
    (
        Collective::ReduceScatter,
        TestType::F16,
        50_000,
        Algorithm::OneShot,
    ),
    (
        Collective::AlltoAll,
        TestType::Bf16,
        30_000,
        Algorithm::OneShot,
    ),
];

/// Runs [`ZERO_COPY_CALLS`] with the direct protocol between `send` and `recv`, checks every
/// result on the device and returns how many calls read this rank's buffers in place.
#[allow(clippy::too_many_arguments)]
fn zero_copy_phase(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    send: flashcomm_comm::DevicePtr,
    recv: flashcomm_comm::DevicePtr,
    rank: u32,
    n: u32,
    what: &str,
) -> u64 {
    let before = comm.zero_copy_calls();
    for (i, (coll, ty, count, algo)) in ZERO_COPY_CALLS.into_iter().enumerate() {
        let salt = 60 + i as u32;
        let n64 = u64::from(n);
        let (se, re) = common::send_recv_elems(coll, count, n64);
        v.fill(send, se, ty, rank, salt, s).unwrap();
        comm.execute_plan(
            comm.plan_forced(
                &Request::shaped(coll, count, ty.dtype(), ty.bytes()),
                Choice::Force(algo),
                Choice::Force(flashcomm_comm::Protocol::Direct),
            )
            .unwrap(),
            &Request::shaped(coll, count, ty.dtype(), ty.bytes())
                .between(send, recv)
                .on(s),
        )
        .unwrap_or_else(|e| panic!("rank {rank}: {what}: {coll:?}: {e}"));
        v.check(recv, re, count, coll, ty, n, rank, salt, s)
            .unwrap();
    }
    s.synchronize().unwrap();
    comm.check_status().expect("device status");
    let (bad, first) = v.errors().unwrap();
    assert_eq!(bad, 0, "rank {rank}: {what}: {bad} wrong, first at {first}");
    boot.barrier().unwrap();
    comm.zero_copy_calls() - before
}

#[allow(clippy::too_many_arguments)]
fn zero_copy_checks(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    rank: u32,
    n: u32,
) {
    const BYTES: usize = 4 << 20;
    assert!(
        comm.serves_registered_buffers(),
        "rank {rank}: zero-copy set up but no registration board"
    );
    let calls = ZERO_COPY_CALLS.len() as u64;
    let send = v.alloc(BYTES).unwrap();
    let recv = v.alloc(BYTES).unwrap();
    let (sp, rp) = (send.as_ptr(), recv.as_ptr());
    let phase = |what: &str, sp, rp| {
        // The first round lets every peer map what was registered since the last one.
        zero_copy_phase(comm, boot, v, s, sp, rp, rank, n, what);
        zero_copy_phase(comm, boot, v, s, sp, rp, rank, n, what)
    };
    // Nothing registered: every rank stages.
    assert_eq!(
        phase("nothing registered", sp, rp),
        0,
        "rank {rank}: nothing registered"
    );
    // The even ranks register: they read in place, the odd ones stage.
    let mut ids = Vec::new();
    if rank.is_multiple_of(2) {
        ids.push(comm.register(send.addr(), BYTES as u64).unwrap());
        ids.push(comm.register(recv.addr(), BYTES as u64).unwrap());
    }
    boot.barrier().unwrap();
    let got = phase("even ranks registered", sp, rp);
    assert_eq!(
        got,
        if rank.is_multiple_of(2) { calls } else { 0 },
        "rank {rank}: even ranks registered"
    );
    // Every rank registers (a collective registration, on every rank: each returns once every
    // peer has mapped its buffer; the even ranks register theirs a second time, which is fine).
    for b in [&send, &recv] {
        let (id, mapped) = comm
            .register_collective(b.addr(), BYTES as u64, Duration::from_secs(30))
            .unwrap();
        assert!(
            mapped,
            "rank {rank}: a peer did not map a collective registration"
        );
        ids.push(id);
    }
    boot.barrier().unwrap();
    assert_eq!(
        phase("every rank registered", sp, rp),
        calls,
        "rank {rank}: every rank registered"
    );
    // A graph captured in place, replayed after every rank deregistered its buffers: the peers'
    // mappings stay, the replays read them, exact.
    let graph = zero_copy_graph(
        comm,
        boot,
        v,
        s,
        (sp, rp),
        rank,
        n,
        77,
        "registered buffers",
    );
    for id in ids.drain(..) {
        comm.deregister(id).unwrap();
    }
    zero_copy_replays(comm, boot, v, s, graph, rank, "graph after deregistration");
    assert_eq!(
        phase("deregistered", sp, rp),
        0,
        "rank {rank}: deregistered"
    );
    // Buffers never registered, captured into a graph on every rank: the capture registers the
    // allocations holding them and exchanges them (the exchange at capture), so the graph reads
    // in place.
    let (gs, gr) = (v.alloc(BYTES).unwrap(), v.alloc(BYTES).unwrap());
    let graph = zero_copy_graph(
        comm,
        boot,
        v,
        s,
        (gs.as_ptr(), gr.as_ptr()),
        rank,
        n,
        78,
        "unregistered buffers",
    );
    zero_copy_replays(
        comm,
        boot,
        v,
        s,
        graph,
        rank,
        "graph of unregistered buffers",
    );
    // A registered buffer freed and allocated again (at the same address, as the driver usually
    // does) without a new registration: staged, exact; registered again: in place.
    let id_recv = comm.register(recv.addr(), BYTES as u64).unwrap();
    let x = v.alloc(BYTES).unwrap();
    let x_addr = x.addr();
    let id = comm.register(x_addr, BYTES as u64).unwrap();
    boot.barrier().unwrap();
    assert_eq!(
        phase("scratch registered", x.as_ptr(), rp),
        calls,
        "rank {rank}: scratch registered"
    );
    drop(x);
    let x2 = v.alloc(BYTES).unwrap();
    println!(
        "rank {rank}: reallocated at {} address",
        if x2.addr() == x_addr {
            "the same"
        } else {
            "another"
        }
    );
    boot.barrier().unwrap();
    assert_eq!(
        phase("freed and reallocated", x2.as_ptr(), rp),
        0,
        "rank {rank}: stale registration"
    );
    comm.deregister(id).unwrap();
    let id2 = comm.register(x2.addr(), BYTES as u64).unwrap();
    boot.barrier().unwrap();
    assert_eq!(
        phase("registered again", x2.as_ptr(), rp),
        calls,
        "rank {rank}: registered again"
    );
    comm.deregister(id2).unwrap();
    // Memory of the virtual memory API, shareable as a file descriptor (what ncclMemAlloc
    // allocates): exported as a descriptor, which peers take with pidfd_getfd.
    let vm = flashcomm_comm::gpu::VmmMem::alloc(BYTES, s).expect("virtual memory API allocation");
    let (id_vm, mapped) = comm
        .register_collective(vm.addr(), BYTES as u64, Duration::from_secs(30))
        .unwrap();
    boot.barrier().unwrap();
    let got = phase("ncclMemAlloc-like memory", vm.as_ptr(), rp);
    println!(
        "rank {rank}: virtual memory API buffer: mapped by every peer {mapped}, {got} of {calls} calls in place"
    );
    assert_eq!(
        got,
        if mapped { calls } else { 0 },
        "rank {rank}: virtual memory API buffer"
    );
    assert!(
        mapped,
        "rank {rank}: peers could not map a file-descriptor export"
    );
    comm.deregister(id_vm).unwrap();
    comm.deregister(id_recv).unwrap();
    boot.barrier().unwrap();
    drop(vm);
    println!("ok rank {rank} of {n}: zero-copy registered buffers");
}

/// Captures a one-shot and a two-shot direct AllReduce of `send` into `recv` (each checked on the
/// device by the graph itself) on every rank, and checks that both read this rank's buffers in
/// place.
#[allow(clippy::too_many_arguments)]
fn zero_copy_graph(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    (send, recv): (flashcomm_comm::DevicePtr, flashcomm_comm::DevicePtr),
    rank: u32,
    n: u32,
    salt: u32,
    what: &str,
) -> flashcomm_comm::gpu::Graph {
    let (ty, count) = (TestType::Bf16, 100_000u64);
    v.fill(send, count, ty, rank, salt, s).unwrap();
    s.synchronize().unwrap();
    boot.barrier().unwrap();
    let before = comm.zero_copy_calls();
    s.begin_capture().unwrap();
    for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
        comm.execute_plan(
            comm.plan_forced(
                &Request::typed(Collective::AllReduce, count, DataType::Bf16),
                Choice::Force(algo),
                Choice::Force(flashcomm_comm::Protocol::Direct),
            )
            .unwrap(),
            &Request::typed(Collective::AllReduce, count, DataType::Bf16)
                .between(send, recv)
                .on(s),
        )
        .unwrap();
        v.check(
            recv,
            count,
            count,
            Collective::AllReduce,
            ty,
            n,
            rank,
            salt,
            s,
        )
        .unwrap();
    }
    let graph = s.end_capture().expect("capture");
    assert_eq!(
        comm.zero_copy_calls() - before,
        2,
        "rank {rank}: {what}: the captured calls read in place"
    );
    graph
}

/// Replays `graph` 50 times once every rank is ready; every element exact.
fn zero_copy_replays(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    graph: flashcomm_comm::gpu::Graph,
    rank: u32,
    what: &str,
) {
    boot.barrier().unwrap();
    for _ in 0..50 {
        graph.launch(s).unwrap();
    }
    s.synchronize().unwrap();
    comm.check_status().expect("device status");
    let (bad, first) = v.errors().unwrap();
    assert_eq!(bad, 0, "rank {rank}: {what}: {bad} wrong, first at {first}");
    drop(graph);
    boot.barrier().unwrap();
}

/// The "stress" mode: [`common::stress_words`]'s 100,000 calls (`FLASHCOMM_TEST_STRESS_CALLS`
/// sets another count), each filled, run and checked on the device.
fn stress_calls(
    comm: &Communicator,
    v: &Verifier,
    s: Stream,
    send: &DeviceMem,
    recv: &DeviceMem,
    rank: u32,
    n: u32,
) {
    let calls: u32 = std::env::var("FLASHCOMM_TEST_STRESS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let n64 = u64::from(n);
    let t0 = Instant::now();
    for (i, x) in (0..calls).zip(common::stress_words()) {
        let (coll, ty, count) = common::stress_call(x, n64);
        // Buffers of 4 and 16 MiB: the sequence's largest calls fit.
        let p = common::stress_plan(comm, x, coll, ty, count);
        let (se, re) = common::send_recv_elems(coll, count, n64);
        let elem = ty.bytes();
        let salt = i % 1024;
        v.fill(send.as_ptr(), se, ty, rank, salt, s).unwrap();
        comm.execute_plan(
            p,
            &Request::for_plan(&p, count, ty.dtype(), elem)
                .between(
                    send.slice(0, (se * elem) as usize),
                    recv.slice(0, (re * elem) as usize),
                )
                .on(s),
        )
        .unwrap_or_else(|e| panic!("rank {rank}: stress call {i}: {e}"));
        v.check(recv.as_ptr(), re, count, coll, ty, n, rank, salt, s)
            .unwrap();
        if i % 10_000 == 9_999 || i + 1 == calls {
            s.synchronize().unwrap();
            comm.check_status().expect("device status");
            let (bad, first) = v.errors().unwrap();
            assert_eq!(
                bad, 0,
                "rank {rank}: stress up to call {i}: {bad} wrong, first at {first}"
            );
        }
    }
    println!(
        "ok rank {rank} of {n}: {calls} random collectives verified in {:.1} s ({} read in place)",
        t0.elapsed().as_secs_f64(),
        comm.zero_copy_calls()
    );
}

/// The "churn" mode: register (collectively), read in place, deregister and free buffers many
/// times; the peers' mappings stay bounded.
fn zero_copy_churn(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    rank: u32,
    n: u32,
) {
    const BYTES: usize = 64 << 10;
    let rounds: u32 = std::env::var("FLASHCOMM_TEST_CHURN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let (ty, count) = (TestType::Bf16, (BYTES / 2) as u64);
    let recv = v.alloc(BYTES).unwrap();
    let (mut most, mut in_place) = (0usize, 0u64);
    let t0 = Instant::now();
    for i in 0..rounds {
        let x = v.alloc(BYTES).unwrap();
        let (id, mapped) = comm
            .register_collective(x.addr(), BYTES as u64, Duration::from_secs(10))
            .unwrap();
        assert!(
            mapped,
            "rank {rank}: round {i}: a peer did not map the buffer"
        );
        let before = comm.zero_copy_calls();
        let salt = i % 1024;
        v.fill(x.as_ptr(), count, ty, rank, salt, s).unwrap();
        comm.execute_plan(
            comm.plan_forced(
                &Request::typed(Collective::AllReduce, count, DataType::Bf16),
                Choice::Force(Algorithm::OneShot),
                Choice::Force(flashcomm_comm::Protocol::Direct),
            )
            .unwrap(),
            &Request::typed(Collective::AllReduce, count, DataType::Bf16)
                .between(x.as_ptr(), recv.as_ptr())
                .on(s),
        )
        .unwrap();
        v.check(
            recv.as_ptr(),
            count,
            count,
            Collective::AllReduce,
            ty,
            n,
            rank,
            salt,
            s,
        )
        .unwrap();
        in_place += comm.zero_copy_calls() - before;
        most = most.max(comm.peer_mappings());
        comm.deregister(id).unwrap();
        // Freeing synchronizes the device: the call above has ended.
        drop(x);
        if i % 1000 == 999 || i + 1 == rounds {
            comm.check_status().expect("device status");
            let (bad, first) = v.errors().unwrap();
            assert_eq!(
                bad, 0,
                "rank {rank}: churn round {i}: {bad} wrong, first at {first}"
            );
        }
    }
    boot.barrier().unwrap();
    println!(
        "ok rank {rank} of {n}: {rounds} buffers registered, read in place ({in_place} calls), \
         freed in {:.1} s; at most {most} peer allocations mapped at once, {} now",
        t0.elapsed().as_secs_f64(),
        comm.peer_mappings()
    );
    assert_eq!(
        in_place,
        u64::from(rounds),
        "rank {rank}: calls read in place"
    );
    // At most each peer's live buffer and the one it retracts last.
    assert!(
        most <= 2 * (n as usize - 1),
        "rank {rank}: {most} peer allocations mapped at once"
    );
}

/// The "pidns" mode: each rank is pid 1 of its own PID namespace; memory of the virtual memory
/// API (exported as a file descriptor named by pid) is refused by the peer and staged, exact.
fn zero_copy_other_namespace(
    comm: &Communicator,
    boot: &FileBootstrap,
    v: &Verifier,
    s: Stream,
    recv: &DeviceMem,
    rank: u32,
    n: u32,
) {
    const BYTES: usize = 4 << 20;
    println!("rank {rank}: pid {} in its namespace", std::process::id());
    let vm = flashcomm_comm::gpu::VmmMem::alloc(BYTES, s).expect("virtual memory API allocation");
    let (id, mapped) = comm
        .register_collective(vm.addr(), BYTES as u64, Duration::from_secs(30))
        .unwrap();
    boot.barrier().unwrap();
    let calls = ZERO_COPY_CALLS.len() as u64;
    // Two rounds: the first lets every peer look at what was registered.
    let rp = recv.slice(0, BYTES);
    zero_copy_phase(
        comm,
        boot,
        v,
        s,
        vm.as_ptr(),
        rp,
        rank,
        n,
        "other namespace",
    );
    let got = zero_copy_phase(
        comm,
        boot,
        v,
        s,
        vm.as_ptr(),
        rp,
        rank,
        n,
        "other namespace",
    );
    println!(
        "rank {rank}: mapped by every peer {mapped}, {got} of {calls} calls in place, {} peer \
         allocations mapped",
        comm.peer_mappings()
    );
    assert_eq!(got, 0, "rank {rank}: read in place across PID namespaces");
    assert_eq!(
        comm.peer_mappings(),
        0,
        "rank {rank}: mapped a peer's descriptor export"
    );
    comm.deregister(id).unwrap();
    boot.barrier().unwrap();
    drop(vm);
    println!("ok rank {rank} of {n}: zero-copy refused across PID namespaces, exact");
}

/// The "reinit" mode: a busy communicator on a thread of its own, and abort-and-reinit cycles
/// of another on this thread (see the test).
fn reinit_beside_a_busy_communicator(
    dir: &std::path::Path,
    rank: u32,
    n: u32,
    dev: i32,
    cfg: &CommConfig,
) {
    let cycles: u32 = std::env::var("FLASHCOMM_TEST_CYCLES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1000);
    let warm = 50.min(cycles);
    let meet = |name: &str| {
        let d = dir.join(name);
        let _ = std::fs::create_dir_all(&d);
        FileBootstrap::new(&d, rank, n, Duration::from_secs(60)).expect("bootstrap")
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let t0 = Instant::now();
    std::thread::scope(|sc| {
        // The busy communicator: AllReduces of 1 MiB back to back, the ranks deciding together
        // when to stop.
        let busy = meet("busy");
        let stop = &stop;
        sc.spawn(move || {
            let comm = Communicator::new(&busy, dev, cfg.clone()).expect("busy communicator");
            let v = Verifier::new(dev).unwrap();
            let _ctx = v.activate().unwrap();
            let s = v.stream().unwrap();
            let buf = v.alloc(1 << 20).unwrap();
            let mut calls = 0u64;
            loop {
                for _ in 0..16 {
                    comm.execute(
                        &Request::typed(Collective::AllReduce, 1 << 18, DataType::F32)
                            .between(buf.as_ptr(), buf.as_ptr())
                            .on(s),
                    )
                    .unwrap();
                }
                calls += 16;
                s.synchronize().unwrap();
                comm.check_status().expect("busy communicator");
                let mine = [u8::from(stop.load(std::sync::atomic::Ordering::SeqCst))];
                if busy.all_gather(&mine).unwrap().iter().any(|b| b[0] == 1) {
                    break;
                }
            }
            println!("rank {rank}: busy communicator: {calls} AllReduces of 1 MiB meanwhile");
        });
        // The cycles: set up, one AllReduce, abort, release. The busy thread stops however
        // this one ends (a failed assertion too).
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let _stop = StopOnDrop(stop);
        let v = Verifier::new(dev).unwrap();
        let _ctx = v.activate().unwrap();
        let s = v.stream().unwrap();
        let buf = v.alloc(1 << 16).unwrap();
        // The cycles' communicators have arenas of 4 MiB: a leak of any of them still shows over
        // 950 cycles, and on the host transport each set-up pins its own arena and maps and
        // pins every peer's (at the default 64 MiB, 230 ms a cycle at 4 ranks on an H100).
        let cycle_cfg = CommConfig {
            arena_bytes: 4 << 20,
            ..cfg.clone()
        };
        let (mut start, mut slowest, mut arena) = (0u64, Duration::ZERO, 0u64);
        for i in 0..cycles {
            let b = meet(&format!("cycle{i}"));
            let comm = common::set_up_and_run_once(&b, dev, &cycle_cfg, &buf, s);
            arena = arena.max(comm.arena_bytes());
            let t = Instant::now();
            comm.abort();
            let released = comm.defer_release();
            drop(comm);
            assert!(
                released.wait(Duration::from_secs(5)),
                "rank {rank}, cycle {i}: not released within 5 s beside a busy communicator"
            );
            slowest = slowest.max(t.elapsed());
            b.barrier().unwrap();
            if rank == 0 && ((i + 1) % 100 == 0 || i + 1 == 10) {
                println!("{} cycles in {:.1} s", i + 1, t0.elapsed().as_secs_f64());
            }
            if i + 1 == warm {
                start = flashcomm_comm::gpu::mem_info().expect("cuMemGetInfo").0;
            }
        }
        let end = flashcomm_comm::gpu::mem_info().expect("cuMemGetInfo").0;
        let kept = flashcomm_comm::kept_arenas();
        println!(
            "rank {rank}: {cycles} abort-and-reinit cycles in {:.1} s; device free from cycle \
             {warm} to the end: {} -> {} MiB; arenas waiting for peers: {kept}; slowest release \
             {slowest:?}",
            t0.elapsed().as_secs_f64(),
            start >> 20,
            end >> 20
        );
        // Every rank process shares the one GPU, and each may keep its last cycle's arena until
        // its next release sweeps it (its peers had not all closed yet when it released): at
        // either reading, up to one arena per rank is allocated or not. Growth beyond that is
        // a leak (a thousand cycles would show one of any size).
        assert!(
            end + (arena + (16 << 20)) * u64::from(n) >= start,
            "device memory grew: {start} -> {end} bytes free (arenas of {arena} bytes)"
        );
        assert!(kept <= 4, "{kept} arenas still wait for peers that closed");
        assert!(
            slowest < Duration::from_secs(1),
            "a release took {slowest:?} beside a busy communicator"
        );
    });
}
