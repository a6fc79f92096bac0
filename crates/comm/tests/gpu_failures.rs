//! Failing like NCCL on the GPU, with virtual ranks: set-up that fails at any step on one rank
//! fails alike on every rank after the same rounds; no time limit by default (a late peer
//! completes); `abort` from a watchdog thread ends a wait for a peer that never comes, also when
//! our launch is queued behind a stuck operation on the same stream; many set-ups leak nothing.
//!
//! Run with `cargo test -p flashcomm-comm --features gpu --test gpu_failures` on a machine with
//! a CUDA device. `FLASHCOMM_TEST_LATE_S` sets how late the late peer is (default 30 s).
#![cfg(feature = "gpu")]

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::{TYPES, run_ranks, run_ranks_expecting_errors};
use flashcomm_comm::gpu::OwnStream;
use flashcomm_comm::{
    Bootstrap, CommConfig, Communicator, DataType, Error, ThreadBootstrap, ThreadGroup,
};
use flashcomm_comm::{Collective, Request};
use flashcomm_testkit::verify::{TestType, Verifier};

/// Counts the rounds a rank ran.
struct Counting<'a>(&'a ThreadBootstrap, AtomicU32);

impl Bootstrap for Counting<'_> {
    fn rank(&self) -> u32 {
        self.0.rank()
    }
    fn size(&self) -> u32 {
        self.0.size()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.all_gather(mine)
    }
}

/// Builds a communicator of `n` virtual ranks with `cfgs[r]` on rank `r`; returns each rank's
/// rounds and outcome (the communicators are dropped).
fn set_up(cfgs: &[CommConfig]) -> Vec<(u32, Result<(), Error>)> {
    let group = ThreadGroup::new(cfgs.len() as u32, Duration::from_secs(120));
    let members = group.members();
    std::thread::scope(|s| {
        let hs: Vec<_> = members
            .iter()
            .zip(cfgs)
            .map(|(m, cfg)| {
                s.spawn(move || {
                    let c = Counting(m, AtomicU32::new(0));
                    let r = Communicator::new(&c, 0, cfg.clone()).map(drop);
                    (c.1.load(Ordering::Relaxed), r)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_set_up_failure_at_any_step_on_one_rank_fails_alike_on_every_rank() {
    let base = CommConfig {
        // Bounds the calibration kernels of the ranks whose peer failed before launching.
        timeout: Duration::from_secs(2),
        calibrate: true,
        arena_bytes: 8 << 20,
        ..CommConfig::default()
    };
    let ok = set_up(&[base.clone(), base.clone()]);
    assert!(ok.iter().all(|(_, r)| r.is_ok()), "{ok:?}");
    let full = ok[0].0;
    assert!(ok.iter().all(|(n, _)| *n == full));
    println!("a successful set-up runs {full} rounds");
    for step in 0..=7u32 {
        for failing in 0..2usize {
            let mut cfgs = vec![base.clone(), base.clone()];
            cfgs[failing].fail_at = Some(step);
            let got = set_up(&cfgs);
            let (rounds, verdict) = &got[0];
            for (n, r) in &got {
                assert_eq!(n, rounds, "step {step}: every rank runs the same rounds");
                assert_eq!(r, verdict, "step {step}: every rank gets the same verdict");
            }
            let Err(Error::Unsupported(why)) = verdict else {
                panic!("step {step}: {verdict:?}")
            };
            assert!(
                why.starts_with(&format!("rank {failing}: "))
                    && why.contains(&format!("failure injected at set-up step {step}")),
                "{why}"
            );
            assert!(*rounds <= full, "step {step}: {rounds} rounds");
            println!(
                "failure at step {step} on rank {failing}: {rounds} rounds on every rank: {why}"
            );
        }
    }
    // The device is fine afterwards.
    let ok = set_up(&[base.clone(), base]);
    assert!(ok.iter().all(|(_, r)| r.is_ok()), "{ok:?}");
}

/// A lossless AllReduce on two ranks where rank 1 arrives `late` after rank 0, with no timeout
/// configured: both complete with the right result.
#[test]
fn a_late_peer_completes_without_a_timeout() {
    let late = Duration::from_secs(
        std::env::var("FLASHCOMM_TEST_LATE_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30),
    );
    let cfg = CommConfig {
        calibrate: false,
        ..CommConfig::default()
    };
    assert_eq!(cfg.timeout, Duration::ZERO, "no time limit by default");
    let count = 1000u64;
    run_ranks(2, cfg, |r| {
        let t = TYPES[2];
        let buf = r.alloc((count * t.bytes()) as usize);
        r.v.fill(buf.as_ptr(), count, t, r.rank(), 1, r.stream)
            .unwrap();
        r.sync();
        if r.rank() == 1 {
            std::thread::sleep(late);
        }
        let t0 = Instant::now();
        r.comm
            .execute(
                &Request::typed(Collective::AllReduce, count, DataType::Bf16)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(r.stream),
            )
            .unwrap();
        r.stream.synchronize().unwrap();
        r.comm.check_status().expect("no error for a late peer");
        r.check_allreduce(buf.as_ptr(), count, t, 1, r.stream)
            .unwrap();
        r.stream.synchronize().unwrap();
        r.assert_clean("late peer");
        println!("rank {} completed after {:?}", r.rank(), t0.elapsed());
    });
}

/// Rank 0 waits for rank 1, which never calls; a watchdog thread aborts rank 0's communicator
/// after a second: rank 0's kernel leaves within 5 s and reports the abort.
#[test]
fn abort_from_a_watchdog_thread_ends_a_wait_for_a_peer_that_never_comes() {
    let cfg = CommConfig {
        calibrate: false,
        ..CommConfig::default()
    };
    run_ranks_expecting_errors(2, cfg, |comm, v, stream, m| {
        let buf = v.alloc(1 << 20).unwrap();
        m.barrier().unwrap();
        if m.rank() == 0 {
            comm.execute(
                &Request::typed(Collective::AllReduce, 1000, DataType::Bf16)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(stream),
            )
            .unwrap();
            let aborted_at = common::abort_from_another_thread(comm, Duration::from_secs(1));
            assert_eq!(comm.wait_idle_for(Duration::from_secs(5)), Ok(true));
            let took = aborted_at.elapsed();
            assert!(took < Duration::from_secs(5), "{took:?}");
            let e = comm.check_status().expect_err("the abort is reported");
            assert!(
                matches!(&e, Error::Remote(m) if m.contains("aborted")),
                "{e:?}"
            );
            println!("rank 0 left {took:?} after the abort: {e}");
        }
    });
}

/// Our launch is queued behind an operation that does not finish by itself (a kernel of another
/// communicator waiting for a peer that never comes stands in for an NCCL operation stuck on a
/// dead peer). Abort of our communicator sets our flag, the "real abort" ends the stuck
/// operation, and then our last launch finishes within the bound; when nothing ends the stuck
/// operation, the bounded wait says so instead of hanging. Ours is a two-rank communicator (a
/// one-rank one launches no kernel): rank A's launch is queued behind the stuck operation, rank
/// B's runs on a stream of its own and waits for A.
#[test]
fn abort_returns_when_our_launch_is_queued_behind_a_stuck_operation() {
    let cfg = CommConfig {
        calibrate: false,
        arena_bytes: 8 << 20,
        ..CommConfig::default()
    };
    for real_abort_ends_it in [true, false] {
        // Everything is created before anything spins (virtual-rank rule).
        let stuck_group = ThreadGroup::new(2, Duration::from_secs(60));
        let stuck_members = stuck_group.members();
        let ours_group = ThreadGroup::new(2, Duration::from_secs(60));
        let ours_members = ours_group.members();
        let (stuck, _other, ours, ours_b) = std::thread::scope(|s| {
            let a = s.spawn(|| Communicator::new(&stuck_members[0], 0, cfg.clone()).unwrap());
            let b = s.spawn(|| Communicator::new(&stuck_members[1], 0, cfg.clone()).unwrap());
            let c = s.spawn(|| Communicator::new(&ours_members[0], 0, cfg.clone()).unwrap());
            let d = s.spawn(|| Communicator::new(&ours_members[1], 0, cfg.clone()).unwrap());
            (
                a.join().unwrap(),
                b.join().unwrap(),
                c.join().unwrap(),
                d.join().unwrap(),
            )
        });
        let v = Verifier::new(0).unwrap();
        let _ctx = v.activate().unwrap();
        let stream = v.stream().unwrap();
        // A stream of its own (the verifier has one stream: asking twice gives the same one).
        let stream_b = flashcomm_comm::Stream::create().unwrap();
        let a = v.alloc(1 << 16).unwrap();
        let b = v.alloc(1 << 16).unwrap();
        let c = v.alloc(1 << 16).unwrap();
        stuck
            .execute(
                &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                    .between(a.as_ptr(), a.as_ptr())
                    .on(stream),
            )
            .unwrap();
        ours.execute(
            &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                .between(b.as_ptr(), b.as_ptr())
                .on(stream),
        )
        .unwrap();
        ours_b
            .execute(
                &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                    .between(c.as_ptr(), c.as_ptr())
                    .on(stream_b),
            )
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            ours.wait_idle_for(Duration::from_millis(10)),
            Ok(false),
            "queued behind the stuck operation"
        );
        let t0 = Instant::now();
        let idle = std::thread::scope(|w| {
            w.spawn(|| {
                ours.abort();
                ours_b.abort();
                if real_abort_ends_it {
                    stuck.abort();
                }
                ours.wait_idle_for(Duration::from_secs(2))
            })
            .join()
            .unwrap()
        });
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(5), "abort took {took:?}");
        assert_eq!(idle, Ok(real_abort_ends_it), "{took:?}");
        println!("real abort ends the stuck operation: {real_abort_ends_it}; abort took {took:?}");
        // Clean up: end the stuck operation, then everything may be freed.
        stuck.abort();
        stream.synchronize().unwrap();
        stream_b.synchronize().unwrap();
        assert!(ours.is_aborted());
        assert_eq!(ours_b.wait_idle_for(Duration::from_secs(2)), Ok(true));
    }
}

fn device_free_bytes() -> u64 {
    flashcomm_comm::gpu::mem_info().expect("cuMemGetInfo").0
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// 1,000 communicators of 2 virtual ranks are built, used once and destroyed: device memory and
/// resident host memory end where they were after the first 50 (a leak of one arena, stream or
/// pinned page per set-up would show as megabytes over 950 set-ups). On the transport and with
/// the copy-engine schedule the suite asks for (`FLASHCOMM_TRANSPORT`, `FLASHCOMM_HOST_COPY`),
/// so that the schedule's streams are counted too.
#[test]
fn a_thousand_set_ups_leak_nothing() {
    let cfg = CommConfig {
        calibrate: false,
        arena_bytes: 4 << 20,
        transport: common::test_transport(),
        host_copy: common::test_host_copy(),
        ..CommConfig::default()
    };
    let (warm, cycles) = (50u32, 1000u32);
    let group = ThreadGroup::new(2, Duration::from_secs(60));
    let members = group.members();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for m in &members {
            let cfg = cfg.clone();
            s.spawn(move || {
                let v = Verifier::new(0).unwrap();
                let _ctx = v.activate().unwrap();
                let stream = v.stream().unwrap();
                let buf = v.alloc(1 << 16).unwrap();
                let mut start = (0, 0);
                let mut streams = 0;
                for i in 0..cycles {
                    let comm = common::set_up_and_run_once(m, 0, &cfg, &buf, stream);
                    drop(comm);
                    // Both ranks are done with this communicator before either measures or
                    // builds the next (nothing allocates while a peer's kernel could spin).
                    m.barrier().unwrap();
                    if m.rank() == 0 && ((i + 1) % 100 == 0 || i + 1 == 10) {
                        println!("{} set-ups in {:.1} s", i + 1, t0.elapsed().as_secs_f64());
                    }
                    if m.rank() == 0 && i + 1 == warm {
                        start = (device_free_bytes(), rss_bytes());
                        streams = OwnStream::live();
                    }
                    m.barrier().unwrap();
                }
                if m.rank() == 0 {
                    let end = (device_free_bytes(), rss_bytes());
                    println!(
                        "{cycles} set-ups in {:.1} s; from set-up {warm} to the end: device free \
                         {} -> {} MiB, resident host memory {} -> {} MiB",
                        t0.elapsed().as_secs_f64(),
                        start.0 >> 20,
                        end.0 >> 20,
                        start.1 >> 20,
                        end.1 >> 20
                    );
                    assert!(
                        end.0 + (4 << 20) >= start.0,
                        "device memory leaked: {} -> {} bytes free",
                        start.0,
                        end.0
                    );
                    assert_eq!(
                        OwnStream::live(),
                        streams,
                        "streams leaked across {cycles} set-ups"
                    );
                    assert!(
                        end.1 <= start.1 + (16 << 20),
                        "host memory grew: {} -> {} bytes resident",
                        start.1,
                        end.1
                    );
                }
            });
        }
    });
}

/// Builds the communicators of `groups` two-rank groups of virtual ranks on device 0, every
/// rank in a thread of its own (set-up is collective), all before anything spins.
fn two_rank_groups(groups: usize, cfg: &CommConfig) -> Vec<(Communicator, Communicator)> {
    let gs: Vec<_> = (0..groups)
        .map(|_| ThreadGroup::new(2, Duration::from_secs(60)))
        .collect();
    let members: Vec<_> = gs.iter().map(|g| g.members()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = members
            .iter()
            .map(|m| {
                let a = s.spawn(|| Communicator::new(&m[0], 0, cfg.clone()).unwrap());
                let b = s.spawn(|| Communicator::new(&m[1], 0, cfg.clone()).unwrap());
                (a, b)
            })
            .collect();
        hs.into_iter()
            .map(|(a, b)| (a.join().unwrap(), b.join().unwrap()))
            .collect()
    })
}

/// Fault class 3 (H3): abort and destroy return within their bound while other device work is
/// stuck. A kernel of another communicator waits for a peer that never comes (an NCCL operation
/// stuck on a dead peer stands for it); freeing device memory waits for the device's outstanding
/// work, so before, dropping our (idle) communicator blocked in `cuMemFree` until that kernel
/// ended: for ever. Now the memory goes to a thread of its own: the caller returns at once, and
/// the memory is freed when the stuck work ends. Abort of a communicator whose own launch is
/// stuck returns too, and keeps the arena (peers may still write into it).
#[test]
fn abort_and_destroy_return_while_other_device_work_is_stuck() {
    let cfg = CommConfig {
        calibrate: false,
        arena_bytes: 8 << 20,
        ..CommConfig::default()
    };
    let mut comms = two_rank_groups(3, &cfg);
    let (mine_a, mine_b) = comms.pop().unwrap();
    let (ours_a, ours_b) = comms.pop().unwrap();
    let (stuck, stuck_peer) = comms.pop().unwrap();
    eprintln!("stage: set-up done");
    let v = Verifier::new(0).unwrap();
    let _ctx = v.activate().unwrap();
    // Two streams: each rank of a pair on its own (the verifier has one stream; on one stream,
    // rank 0's kernel would wait for rank 1's, queued behind it, for ever).
    let (s1, s2) = (
        v.stream().unwrap(),
        flashcomm_comm::Stream::create().unwrap(),
    );
    let buf = v.alloc(1 << 16).unwrap();
    let buf2 = v.alloc(1 << 16).unwrap();
    // Used once, completed: our communicator is idle.
    ours_a
        .execute(
            &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                .between(buf.as_ptr(), buf.as_ptr())
                .on(s1),
        )
        .unwrap();
    ours_b
        .execute(
            &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                .between(buf2.as_ptr(), buf2.as_ptr())
                .on(s2),
        )
        .unwrap();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    // The stuck kernel: rank 0 calls, rank 1 never does (no time limit).
    stuck
        .execute(
            &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                .between(buf.as_ptr(), buf.as_ptr())
                .on(s1),
        )
        .unwrap();
    eprintln!("stage: stuck kernel launched");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(stuck.wait_idle_for(Duration::from_millis(10)), Ok(false));
    eprintln!("stage: destroying ours");
    // Destroy ours (and our second rank), from a thread, with a watchdog on the caller.
    let t0 = Instant::now();
    let (released, returned) = std::thread::scope(|w| {
        w.spawn(|| {
            let r = ours_a.defer_release();
            let r_b = ours_b.defer_release();
            drop(ours_a);
            drop(ours_b);
            let t = t0.elapsed();
            (
                r.wait(Duration::from_millis(500)) && r_b.wait(Duration::ZERO),
                t,
            )
        })
        .join()
        .unwrap()
    });
    assert!(
        returned < Duration::from_secs(2),
        "destroy blocked {returned:?} behind the stuck kernel"
    );
    println!("destroy returned after {returned:?}; freed meanwhile: {released}");
    eprintln!("stage: aborting a queued launch");
    // Abort of a communicator whose own launch is queued behind the stuck kernel (same stream):
    // the flag is set, nothing ends the stuck kernel, and abort returns within its bound.
    mine_a
        .execute(
            &Request::typed(Collective::AllReduce, 1000, DataType::F32)
                .between(buf.as_ptr(), buf.as_ptr())
                .on(s1),
        )
        .unwrap();
    let t0 = Instant::now();
    mine_a.abort();
    let r = mine_a.defer_release();
    drop(mine_a);
    assert!(
        !r.wait(Duration::from_millis(300)),
        "queued behind the stuck kernel"
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
    eprintln!("stage: ending the stuck kernel");
    // End the stuck kernel: everything is freed, without anyone waiting in a free.
    stuck.abort();
    s1.synchronize().unwrap();
    assert!(r.wait(Duration::from_secs(10)), "freed once the work ended");
    mine_b.abort();
    drop((stuck, stuck_peer, mine_b));
}

/// A communicator's time limit (`FLASHCOMM_TIMEOUT_MS`) bounds each wait, not the kernel: a
/// collective that takes longer in total than the limit, but whose every wait is short (both
/// ranks present), completes. Before, the deadline ran from the kernel's start, and a long
/// message timed out halfway on a healthy pair of ranks.
#[test]
fn a_long_collective_with_short_waits_does_not_time_out() {
    let count = 64u64 << 20; // 256 MiB of f32 per rank
    // How long the collective takes without a limit (one block per rank: a long kernel whose
    // ranks advance in step, so that each wait is short).
    let untimed = CommConfig {
        calibrate: false,
        max_blocks: Some(1),
        ..CommConfig::default()
    };
    let took = std::sync::Mutex::new(Duration::ZERO);
    run_ranks(2, untimed.clone(), |r| {
        let buf = r.alloc((count * 4) as usize);
        r.sync();
        let t0 = Instant::now();
        r.comm
            .execute(
                &Request::typed(Collective::AllReduce, count, DataType::F32)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(r.stream),
            )
            .unwrap();
        r.stream.synchronize().unwrap();
        r.comm.check_status().unwrap();
        let mut t = took.lock().unwrap();
        *t = (*t).max(t0.elapsed());
    });
    let took = *took.lock().unwrap();
    // A limit of a quarter of that: the kernel outlives it, no wait does.
    let limit = took / 4;
    println!("256 MiB AllReduce on one block: {took:?}; limit per wait {limit:?}");
    assert!(
        limit >= Duration::from_millis(5),
        "the kernel ({took:?}) is too short to outlive a limit its ranks' launch skew cannot reach"
    );
    let timed = CommConfig {
        timeout: limit,
        ..untimed.clone()
    };
    run_ranks(2, timed, |r| {
        let buf = r.alloc((count * 4) as usize);
        r.sync();
        r.comm
            .execute(
                &Request::typed(Collective::AllReduce, count, DataType::F32)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(r.stream),
            )
            .unwrap();
        r.stream.synchronize().unwrap();
        r.comm
            .check_status()
            .expect("no wait lasted the limit, though the kernel did");
    });
}

/// Fault class 7: the wait counter and the epoch of `flashcomm/wait_count.h` as the device runs
/// them (the CPU test checks the host build of the same header): 1,024 polls from 2^31 - 8 make
/// 8 slow checks and no spurious mismatch, the flag stays clear, two sightings across the wrap
/// are confirmed, and the epoch skips 0xffffffff.
#[test]
fn the_wait_counter_and_the_epoch_behave_at_their_edges_on_the_device() {
    let v = Verifier::new(0).unwrap();
    assert_eq!(
        v.wait_count_on_device().unwrap(),
        [8, 0, 0, 1, 1, 0xffff_fffe, 1]
    );
}

/// Fault class 7, delayed blocks: the multiprocessors are held by blocks that release them at
/// four different times, so the blocks of both ranks' collectives start hundreds of
/// milliseconds apart, in no particular order. With no time limit (NCCL's default) every wait
/// simply lasts, and every collective is exact.
#[test]
fn delayed_blocks_still_give_exact_results() {
    let cfg = CommConfig {
        calibrate: false,
        ..CommConfig::default()
    };
    let hold_stream = std::sync::Mutex::new(None);
    run_ranks(2, cfg, |r| {
        let count = 1u64 << 20;
        let t = TYPES[0];
        let buf = r.alloc((count * t.bytes()) as usize);
        let sms = flashcomm_comm::gpu::Device::open(0).unwrap().sm_count();
        for round in 0..4u32 {
            r.v.fill(buf.as_ptr(), count, t, r.rank(), round, r.stream)
                .unwrap();
            r.stream.synchronize().unwrap();
            r.sync();
            if r.rank() == 0 {
                let mut s = hold_stream.lock().unwrap();
                let s = s.get_or_insert_with(|| {
                    let _ctx = r.v.activate().unwrap();
                    flashcomm_comm::gpu::Stream::create().unwrap()
                });
                r.v.hold(Duration::from_millis(400), sms * 32, *s).unwrap();
            }
            r.sync();
            r.comm
                .execute(
                    &Request::typed(Collective::AllReduce, count, DataType::F32)
                        .between(buf.as_ptr(), buf.as_ptr())
                        .on(r.stream),
                )
                .unwrap();
            r.check_allreduce(buf.as_ptr(), count, t, round, r.stream)
                .unwrap();
            r.stream.synchronize().unwrap();
            r.comm
                .check_status()
                .expect("no time limit: delayed blocks just wait");
            r.assert_clean("delayed blocks");
        }
    });
}

/// Fault class 7, reading outputs after a timeout: rank 1's collective is queued behind a kernel
/// that holds its stream for longer than the communicator's limit, so rank 0's wait times out
/// (and asks rank 1 to stop). Afterwards both ranks' outputs can be read back (nothing hangs or
/// faults), and every later call reports the error at once instead of launching.
#[test]
fn outputs_are_readable_after_a_timeout_and_later_calls_fail_at_once() {
    let limit = Duration::from_millis(200);
    let cfg = CommConfig {
        calibrate: false,
        timeout: limit,
        ..CommConfig::default()
    };
    run_ranks_expecting_errors(2, cfg, |comm, v, stream, m| {
        let count = 1u64 << 16;
        let buf = v.alloc((count * 4) as usize).unwrap();
        m.barrier().unwrap();
        if m.rank() == 1 {
            v.hold(Duration::from_secs(2), 1, stream).unwrap();
        }
        let t0 = Instant::now();
        comm.execute(
            &Request::typed(Collective::AllReduce, count, DataType::F32)
                .between(buf.as_ptr(), buf.as_ptr())
                .on(stream),
        )
        .unwrap();
        stream.synchronize().unwrap();
        let first = comm.check_status();
        if m.rank() == 0 {
            let e = first.as_ref().expect_err("the limit expired");
            assert!(matches!(e, Error::Timeout(_)), "{e:?}");
            assert!(
                t0.elapsed() < limit + Duration::from_secs(2),
                "{:?}",
                t0.elapsed()
            );
        }
        // The outputs can be read (their contents are undefined after an error).
        let mut host = vec![0u8; (count * 4) as usize];
        buf.download(0, &mut host, stream).unwrap();
        m.barrier().unwrap();
        // Later calls report the error: at once without launching, or (rank 1, whose first
        // call may have found all of rank 0's data before rank 0 gave up) from a kernel that
        // stops at its first check of the stop request rank 0 left.
        let t1 = Instant::now();
        let again = comm
            .execute(
                &Request::typed(Collective::AllReduce, count, DataType::F32)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(stream),
            )
            .and_then(|_| {
                stream.synchronize()?;
                comm.check_status()
            });
        assert!(
            again.is_err(),
            "rank {}: a later call reports the error",
            m.rank()
        );
        assert!(t1.elapsed() < Duration::from_secs(2), "{:?}", t1.elapsed());
        println!(
            "rank {}: {first:?}; later call: {:?}",
            m.rank(),
            again.err()
        );
        m.barrier().unwrap();
    });
}

/// Fault class 1 with virtual ranks: set-up panics at each step on one rank of two (a bug in a
/// local step); the panic is caught and the rank takes part in the next round saying so
/// (`Agreement::abandon`, as the shim does), so every rank ends with the same verdict after the
/// same rounds, and the device is fine afterwards.
#[test]
fn a_set_up_panic_at_any_step_on_one_rank_ends_alike_on_every_rank() {
    let base = CommConfig {
        timeout: Duration::from_secs(2),
        calibrate: true,
        arena_bytes: 8 << 20,
        ..CommConfig::default()
    };
    for step in 0..=8u32 {
        for panicking in 0..2u32 {
            let group = ThreadGroup::new(2, Duration::from_secs(120));
            let members = group.members();
            let got: Vec<(u32, String)> = std::thread::scope(|s| {
                let hs: Vec<_> = members
                    .iter()
                    .map(|m| {
                        let mut cfg = base.clone();
                        if m.rank() == panicking {
                            cfg.panic_at = Some(step);
                        }
                        s.spawn(move || {
                            let c = Counting(m, AtomicU32::new(0));
                            let mut ag = flashcomm_comm::Agreement::new(&c);
                            let built =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    Communicator::new_agreed(&mut ag, 0, cfg)
                                }));
                            let verdict = match built {
                                Ok(Ok(_)) => "served".to_string(),
                                Ok(Err(e)) => e.to_string(),
                                Err(_) => ag.abandon("a panic".into()).to_string(),
                            };
                            (c.1.load(Ordering::Relaxed), verdict)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(got[0], got[1], "step {step}, rank {panicking}: alike");
            assert!(
                got[0].1.contains(&format!("rank {panicking}: a panic")),
                "step {step}: {got:?}"
            );
            println!("panic at step {step} on rank {panicking}: {got:?}");
        }
    }
    let ok = set_up(&[base.clone(), base]);
    assert!(ok.iter().all(|(_, r)| r.is_ok()), "{ok:?}");
}

/// Issue 45, item 1: two and three communicators in flight at once on two streams never hang.
/// Two virtual ranks (threads) hold K communicators; communicator k runs on stream k % 2, and
/// each round every rank issues one 8 MiB AllReduce on each communicator in an order of its own
/// (rank 1 in another order than rank 0; calls that share a stream keep one order, as any correct
/// program's must). Before, each communicator's grid could fill the rank's share of the GPU: rank
/// 0's kernel of one communicator and rank 1's of another could fill it together and wait for
/// blocks that could not be scheduled (a timeout here). Now the live communicators' grids
/// together stay under what the GPU keeps resident (crate's residency ledger).
#[test]
fn two_and_three_communicators_in_flight_on_two_streams_never_hang() {
    let count = 2u64 << 20; // 8 MiB of f32: every plan takes its communicator's largest grid
    let rounds = 1000u32;
    let cfg = CommConfig {
        calibrate: false,
        timeout: Duration::from_secs(10),
        ..CommConfig::default()
    };
    for k in [2usize, 3] {
        // Every order of the K communicators in which communicator 0 comes before 2 (they share
        // stream 0).
        let orders: Vec<Vec<usize>> = [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ]
        .iter()
        .map(|o| o.iter().copied().filter(|&c| c < k).collect::<Vec<_>>())
        .filter(|o| {
            let at = |c| o.iter().position(|&x| x == c);
            at(2).is_none_or(|two| at(0).is_some_and(|zero| zero < two))
        })
        .fold(Vec::new(), |mut v, o| {
            if !v.contains(&o) {
                v.push(o);
            }
            v
        });
        let groups: Vec<_> = (0..k)
            .map(|_| ThreadGroup::new(2, Duration::from_secs(60)))
            .collect();
        let members: Vec<_> = groups.iter().map(|g| g.members()).collect();
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for rank in 0..2usize {
                let (members, orders, cfg) = (&members, &orders, cfg.clone());
                s.spawn(move || {
                    let v = Verifier::new(0).unwrap();
                    let _ctx = v.activate().unwrap();
                    // Two streams (the verifier has one: `v.stream()` is the same each time).
                    let streams = [
                        v.stream().unwrap(),
                        flashcomm_comm::Stream::create().unwrap(),
                    ];
                    let comms: Vec<Communicator> = (0..k)
                        .map(|c| Communicator::new(&members[c][rank], 0, cfg.clone()).unwrap())
                        .collect();
                    let grids: Vec<u32> = comms.iter().map(|c| c.max_grid()).collect();
                    if rank == 0 {
                        println!("{k} communicators: largest grids per rank {grids:?}");
                    }
                    let bufs: Vec<_> = (0..k)
                        .map(|c| {
                            let send = v.alloc((count * 4) as usize).unwrap();
                            let recv = v.alloc((count * 4) as usize).unwrap();
                            let st = streams[c % 2];
                            v.fill(
                                send.as_ptr(),
                                count,
                                TestType::F32,
                                rank as u32,
                                c as u32,
                                st,
                            )
                            .unwrap();
                            st.synchronize().unwrap();
                            (send, recv)
                        })
                        .collect();
                    members[0][rank].barrier().unwrap();
                    for i in 0..rounds as usize {
                        for &c in &orders[(i + rank) % orders.len()] {
                            let (send, recv) = &bufs[c];
                            comms[c]
                                .execute(
                                    &Request::typed(Collective::AllReduce, count, DataType::F32)
                                        .between(send.as_ptr(), recv.as_ptr())
                                        .on(streams[c % 2]),
                                )
                                .unwrap();
                        }
                        if i % 100 == 99 {
                            for (c, (_, recv)) in bufs.iter().enumerate() {
                                let st = streams[c % 2];
                                v.check(
                                    recv.as_ptr(),
                                    count,
                                    0,
                                    Collective::AllReduce,
                                    TestType::F32,
                                    2,
                                    rank as u32,
                                    c as u32,
                                    st,
                                )
                                .unwrap();
                            }
                            for (c, comm) in comms.iter().enumerate() {
                                streams[c % 2].synchronize().unwrap();
                                comm.check_status().unwrap_or_else(|e| {
                                    panic!("rank {rank}, communicator {c}, round {i}: {e}")
                                });
                            }
                            let (n, first) = v.errors().unwrap();
                            assert_eq!(
                                n, 0,
                                "rank {rank}, round {i}: {n} wrong elements, first {first}"
                            );
                        }
                    }
                    members[0][rank].barrier().unwrap();
                });
            }
        });
        println!(
            "{k} communicators, {rounds} rounds of {k} AllReduces of 8 MiB in every order: {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Issue 45, item 3: buffers that only one rank's kernel could not take as they are (send and
/// receive overlapping other than in place; for the quantized kernels, buffers not aligned to
/// the element) go through scratch on that rank alone, where before that rank returned
/// `ncclInvalidArgument` and its peers waited in their kernels for it. NCCL runs such a call
/// (an overlap races, an unaligned buffer is fine): now every rank completes, with the exact sum
/// of the inputs as they were before the call.
#[test]
fn a_buffer_layout_only_one_rank_uses_is_staged_on_that_rank() {
    let count = 1u64 << 16; // 256 KiB of f32
    let mut cfg = common::test_config();
    cfg.timeout = Duration::from_secs(10);
    run_ranks(2, cfg, |r| {
        let rank = r.rank();
        let mem = r.alloc((count * 4 * 2 + 4096) as usize);
        // Rank 0: the receive buffer starts 64 bytes into the send buffer; rank 1: apart.
        let send = mem.slice(0, (count * 4) as usize);
        let recv = if rank == 0 {
            mem.slice(64, (count * 4) as usize)
        } else {
            mem.slice((count * 4 + 4096) as usize, (count * 4) as usize)
        };
        for round in 0..3u32 {
            r.v.fill(send, count, TestType::F32, rank, round, r.stream)
                .unwrap();
            r.comm
                .execute(
                    &Request::typed(Collective::AllReduce, count, DataType::F32)
                        .between(send, recv)
                        .on(r.stream),
                )
                .unwrap_or_else(|e| panic!("rank {rank}, round {round}: {e}"));
            r.v.check(
                recv,
                count,
                0,
                Collective::AllReduce,
                TestType::F32,
                2,
                rank,
                round,
                r.stream,
            )
            .unwrap();
            r.sync();
            r.assert_clean(&format!("round {round}"));
        }
    });
}

/// Issue 45, item 7: fork children of a parent whose threads are inside set-up and release. Two
/// threads build, use and release two-rank communicators back to back (the devices, kernels,
/// identity, ledgers and release registry of the communicator crates locked all the time) while
/// the main thread forks 40 children; each child sets up a communicator of its own and leaves.
/// CUDA does not work in a fork child of a process that used it, so the child's set-up fails, but
/// it must fail at once: before, a child forked while a parent's thread held one of those locks
/// waited for it for ever.
#[test]
fn fork_children_of_a_parent_inside_set_up_and_release_never_hang() {
    let cfg = CommConfig {
        calibrate: false,
        arena_bytes: 4 << 20,
        ..CommConfig::default()
    };
    let group = ThreadGroup::new(2, Duration::from_secs(60));
    let members = group.members();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut ended = Vec::new();
    std::thread::scope(|s| {
        for m in &members {
            let (cfg, stop) = (cfg.clone(), &stop);
            s.spawn(move || {
                let v = Verifier::new(0).unwrap();
                let _ctx = v.activate().unwrap();
                let stream = v.stream().unwrap();
                let buf = v.alloc(1 << 16).unwrap();
                loop {
                    let comm = common::set_up_and_run_once(m, 0, &cfg, &buf, stream);
                    let released = comm.defer_release();
                    drop(comm);
                    assert!(released.wait(Duration::from_secs(5)));
                    let mine = [u8::from(stop.load(Ordering::SeqCst))];
                    if m.all_gather(&mine).unwrap().iter().any(|b| b[0] == 1) {
                        break;
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(200));
        for _ in 0..40 {
            // SAFETY: the child sets up a one-rank communicator and leaves with _exit.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let one = ThreadGroup::new(1, Duration::from_secs(5));
                let _ = flashcomm_comm::identity::process_token();
                let _ = Communicator::new(&one.members()[0], 0, cfg.clone());
                // SAFETY: ends the child without the parent's exit handlers.
                unsafe { libc::_exit(0) };
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut status = 0;
            loop {
                // SAFETY: our own child, without blocking.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    ended.push(if libc::WIFEXITED(status) {
                        "exited"
                    } else {
                        "killed by a signal"
                    });
                    break;
                }
                if Instant::now() > deadline {
                    // SAFETY: our own child, not reaped yet.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    ended.push("hung");
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::SeqCst);
    });
    let bad: Vec<_> = ended.iter().filter(|e| **e != "exited").collect();
    println!(
        "{} fork children: {} did not exit: {bad:?}",
        ended.len(),
        bad.len()
    );
    assert!(bad.is_empty(), "{bad:?}");
}
