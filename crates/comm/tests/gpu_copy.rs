//! The copy-engine schedule of the host transport on the GPU (docs/protocols.md "The copy-engine
//! schedule"): its stream operations (flag waits in host memory released by another stream's
//! write, copies through pinned host memory), the whole schedule of 2 and 4 virtual ranks on one
//! GPU (several calls, many pieces, unaligned sizes, in place) through [`execute`] and the
//! driver's [`CopyStreams`], a missing rank released by the watchdog, and whether the stream
//! memory operations can be captured into a graph (printed; the schedule runs outside captures).
//!
//! The first tests drive the schedule directly, with the product's reduction
//! (`fc_copy_reduce_<type>`) or the verification kernels' (`fc_test_sum`, the same arithmetic);
//! the last ones through the communicator (`FLASHCOMM_HOST_COPY=on`): exact results, a captured
//! call taking the kernels between eager ones, and a missing peer released by the time limit or
//! by abort. Inputs are the verification kernels' integer values, so sums are exact in every
//! type.
//!
//! Run with `cargo test -p flashcomm-comm --features gpu --test gpu_copy` on a machine with a
//! CUDA device.
#![cfg(feature = "gpu")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{run_ranks, run_ranks_expecting_errors, test_device};
use flashcomm_comm::gpu::{
    CopyReduce, CopyStreams, Device, DeviceMem, DevicePtr, Event, HostArena, HostMapped, Kernels,
    Stream, copy_reduce_launcher,
};
use flashcomm_comm::plan::HostCopy;
use flashcomm_comm::plan::copy::{
    CopyAddrs, CopyGeom, copy_area_bytes, event_count, execute, schedule, waited_flags,
};
use flashcomm_comm::watch::{Reason, Watchdog, Watched};
use flashcomm_comm::{
    Bootstrap, Choice, Collective, CommConfig, DataType, Error, Request, Transport,
};
use flashcomm_testkit::verify::{TestType, Verifier};

/// Waits until every stream is idle; after `limit`, calls `release` once and keeps waiting
/// (another `limit`), then fails: a test never hangs.
fn drain(streams: &[Stream], limit: Duration, release: &dyn Fn()) -> bool {
    let t = Instant::now();
    let mut released = false;
    loop {
        if streams.iter().all(|s| s.is_idle().expect("stream query")) {
            return !released;
        }
        if t.elapsed() > limit && !released {
            release();
            released = true;
        }
        assert!(t.elapsed() < 2 * limit, "the streams did not drain");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn flag_wait_released_by_another_streams_write() {
    let dev = Device::open(test_device(0)).unwrap();
    let _ctx = dev.activate().unwrap();
    let v = Verifier::new(test_device(0)).unwrap();
    let n = 1 << 20;
    let src = DeviceMem::alloc_zeroed(&dev, n * 4).unwrap();
    let dst = DeviceMem::alloc_zeroed(&dev, n * 4).unwrap();
    let staging = HostMapped::alloc(n * 4).unwrap();
    let flags = HostMapped::alloc(256).unwrap();
    let (a, b) = (Stream::create().unwrap(), Stream::create().unwrap());
    v.fill(src.as_ptr(), n as u64, TestType::F32, 3, 7, b)
        .unwrap();
    // SAFETY: the flag word, the staging and both device buffers live until the streams drain
    // below; the flag is 4-byte aligned.
    unsafe {
        a.wait_value32(flags.dev_ptr(), 1).unwrap();
        a.copy_async(dst.addr(), staging.dev_ptr(), n * 4).unwrap();
        b.copy_async(staging.dev_ptr(), src.addr(), n * 4).unwrap();
        b.write_value32(flags.dev_ptr(), 1).unwrap();
    }
    assert!(drain(&[a, b], Duration::from_secs(20), &|| flags.write_u32(0, 1)));
    assert_eq!(flags.read_u32(0), 1);
    let (mut x, mut y) = (vec![0u8; n * 4], vec![0u8; n * 4]);
    src.download(0, &mut x, a).unwrap();
    dst.download(0, &mut y, a).unwrap();
    a.synchronize().unwrap();
    assert!(x == y, "the bytes copied through host memory differ");
}

/// How the watchdog releases a copy-engine call (`write_words`): a word of host memory is
/// stored with the CPU. 48 streams, more than the device has hardware queues, blocked in waits
/// on a word of pinned memory and 48 more on a word of a shared, registered host segment (a
/// host-transport arena), drain after one CPU store to each, and only then; a word of device memory is
/// not taken for host memory. (A stream write made for the release can share a hardware queue
/// with a blocked stream and never run: docs/protocols.md, "The copy-engine schedule".)
#[test]
fn a_cpu_store_releases_waits_on_host_memory_behind_any_number_of_streams() {
    let dev = Device::open(test_device(0)).unwrap();
    let _ctx = dev.activate().unwrap();
    let pinned = HostMapped::alloc(256).unwrap();
    let name = format!("/flashcomm-test-store-{}", std::process::id());
    let arena = HostArena::create_shared(&name, 4096, None).unwrap();
    let device_word = DeviceMem::alloc_zeroed(&dev, 256).unwrap();
    let words = [pinned.dev_ptr() + 64, arena.dev_ptr() + 128];
    let streams: Vec<Stream> = (0..96).map(|_| Stream::create().unwrap()).collect();
    for (i, s) in streams.iter().enumerate() {
        // SAFETY: both words live until the streams drained below; 4-byte aligned.
        unsafe { s.wait_value32(words[i % 2], 1) }.unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        streams.iter().all(|s| !s.is_idle().unwrap()),
        "every stream waits"
    );
    // SAFETY: every word lives until the end of the test; 4-byte aligned.
    assert!(!unsafe { flashcomm_gpu::store_host_word(device_word.addr(), 1) });
    for &w in &words {
        // SAFETY: as above.
        assert!(unsafe { flashcomm_gpu::store_host_word(w, 1) }, "{w:#x}");
    }
    let fallback = || {
        pinned.write_u32(64, 1);
        arena.store_u64(128, 1);
    };
    assert!(
        drain(&streams, Duration::from_secs(5), &fallback),
        "the CPU stores released every wait"
    );
    assert_eq!(pinned.read_u32(64), 1);
    let mut w = [0u8; 4];
    arena.read(128, &mut w);
    assert_eq!(u32::from_le_bytes(w), 1);
}

/// One virtual rank of the schedule.
struct CopyRank {
    input: DeviceMem,
    output: Option<DeviceMem>,
    _gather: DeviceMem,
    streams: CopyStreams,
    addrs: CopyAddrs,
}

/// Which reduction the engine launches.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sum {
    /// The product's `fc_copy_reduce_<type>` (`copy_reduce_launcher`).
    Product,
    /// The verification kernels' `fc_test_sum`.
    Test,
}

/// Builds `n` ranks on one GPU for calls of up to `count` elements of `ty` with pieces of
/// `piece_bytes`; the copy areas are `areas` (one host-mapped allocation per rank).
#[allow(clippy::too_many_arguments)]
fn ranks(
    dev: &Arc<Device>,
    v: &Arc<Verifier>,
    areas: &[HostMapped],
    count: usize,
    piece_bytes: usize,
    ty: TestType,
    in_place: bool,
    sum: Sum,
) -> Vec<CopyRank> {
    let n = areas.len();
    let eb = ty.bytes() as usize;
    let geom = CopyGeom::new(n, 0, eb, count, piece_bytes, 0);
    (0..n)
        .map(|_| {
            let input = DeviceMem::alloc_zeroed(dev, count * eb).unwrap();
            let output = (!in_place).then(|| DeviceMem::alloc_zeroed(dev, count * eb).unwrap());
            let gather = DeviceMem::alloc_zeroed(dev, geom.gather_bytes()).unwrap();
            let vv = Arc::clone(v);
            let test_reduce = Box::new(
                move |s: Stream,
                      _: DataType,
                      srcs: &[u64],
                      dst: u64,
                      elems: usize|
                      -> Result<(), flashcomm_comm::Error> {
                    let bytes = (elems * eb) as u64;
                    // SAFETY: every address is a chunk of a rank's input or output or a gather
                    // slot of this test, alive until the streams drain; each holds `bytes`.
                    let ptrs: Vec<DevicePtr> = srcs
                        .iter()
                        .map(|a| unsafe { DevicePtr::from_raw(*a, bytes) })
                        .collect();
                    // SAFETY: as above.
                    let d = unsafe { DevicePtr::from_raw(dst, bytes) };
                    vv.sum(&ptrs, d, elems as u64, ty, s)
                },
            );
            let reduce: Box<CopyReduce> = match sum {
                Sum::Test => test_reduce,
                // SAFETY: called by the engine only, with the addresses of this test's
                // allocations (see below), at most 8 sources.
                Sum::Product => unsafe {
                    copy_reduce_launcher(
                        Kernels::for_context(dev.context()).expect("the product's kernels"),
                        1024,
                    )
                },
            };
            // SAFETY: the addresses handed to the engine are this test's allocations (inputs,
            // outputs, gather buffers, the host-mapped copy areas), alive until its streams
            // drain; flag words are 4-byte aligned (the areas start 4 KiB aligned).
            let mut streams = unsafe { CopyStreams::new(event_count(n), reduce) }.unwrap();
            streams.set_dtype(ty.dtype().expect("a reducing type"));
            let addrs = CopyAddrs {
                input: input.addr(),
                output: output.as_ref().map_or(input.addr(), |o| o.addr()),
                gather: gather.addr(),
                areas: areas.iter().map(|a| a.dev_ptr()).collect(),
            };
            CopyRank {
                input,
                output,
                _gather: gather,
                streams,
                addrs,
            }
        })
        .collect()
}

fn exact(n: usize, ty: TestType, in_place: bool, sum: Sum) {
    let dev = Device::open(test_device(0)).unwrap();
    let _ctx = dev.activate().unwrap();
    let v = Arc::new(Verifier::new(test_device(0)).unwrap());
    let eb = ty.bytes() as usize;
    // Many pieces, sizes that split unevenly into pieces and chunks.
    let counts = [3 * (1 << 20) + 7, 1, 777_777, 5 * (1 << 20)];
    let max = *counts.iter().max().unwrap();
    let piece_bytes = 1 << 20;
    let area_bytes = copy_area_bytes(&CopyGeom::new(n, 0, eb, max, piece_bytes, 0));
    let areas: Vec<HostMapped> = (0..n)
        .map(|_| HostMapped::alloc(area_bytes).unwrap())
        .collect();
    let mut rs = ranks(&dev, &v, &areas, max, piece_bytes, ty, in_place, sum);
    let main = Stream::create().unwrap();
    let (start, end_push, end_pull) = (
        Event::new(false).unwrap(),
        Event::new(false).unwrap(),
        Event::new(false).unwrap(),
    );
    let mut first = 0u32;
    for (call, &count) in counts.iter().enumerate() {
        let salt = call as u32 * 5 + 1;
        for (r, rank) in rs.iter().enumerate() {
            v.fill(rank.input.as_ptr(), count as u64, ty, r as u32, salt, main)
                .unwrap();
        }
        start.record(main).unwrap();
        let mut next = first;
        for (r, rank) in rs.iter_mut().enumerate() {
            start.wait_on(rank.streams.push).unwrap();
            start.wait_on(rank.streams.pull).unwrap();
            let geom = CopyGeom::new(n, r, eb, count, piece_bytes, first);
            execute(&schedule(&geom), &rank.addrs, &mut rank.streams).unwrap();
            next = geom.next_piece();
        }
        first = next;
        let all: Vec<Stream> = rs
            .iter()
            .flat_map(|k| [k.streams.push, k.streams.pull])
            .collect();
        let release = || {
            for a in &areas {
                for w in 0..n + 1 {
                    a.write_u32(4 * w, u32::MAX / 2);
                }
            }
        };
        assert!(
            drain(&all, Duration::from_secs(30), &release),
            "{n} ranks, call {call}: the schedule did not finish by itself"
        );
        for (r, rank) in rs.iter().enumerate() {
            end_push.record(rank.streams.push).unwrap();
            end_pull.record(rank.streams.pull).unwrap();
            end_push.wait_on(main).unwrap();
            end_pull.wait_on(main).unwrap();
            let out = rank.output.as_ref().unwrap_or(&rank.input);
            v.check(
                out.as_ptr(),
                count as u64,
                0,
                Collective::AllReduce,
                ty,
                n as u32,
                r as u32,
                salt,
                main,
            )
            .unwrap();
        }
        main.synchronize().unwrap();
        let (bad, at) = v.errors().unwrap();
        assert_eq!(
            bad, 0,
            "{n} ranks {ty:?} in place {in_place}, call {call} ({count} elements): {bad} wrong, first at {at}"
        );
        v.reset().unwrap();
    }
}

#[test]
fn schedule_exact_two_ranks() {
    exact(2, TestType::Bf16, false, Sum::Test);
    exact(2, TestType::F32, true, Sum::Product);
    exact(2, TestType::Bf16, true, Sum::Product);
}

#[test]
fn schedule_exact_four_ranks() {
    exact(4, TestType::F16, false, Sum::Product);
    exact(4, TestType::Bf16, true, Sum::Product);
    exact(4, TestType::F32, false, Sum::Test);
}

/// A call whose peer never comes: its streams wait until the watchdog writes its flags.
struct Lonely {
    areas: Vec<HostMapped>,
    rank: usize,
    value: u32,
    streams: [Stream; 2],
    reason: Mutex<Option<Reason>>,
}

impl Watched for Lonely {
    fn done(&self) -> bool {
        self.streams.iter().all(|s| s.is_idle().unwrap_or(true))
    }
    fn abort_requested(&self) -> bool {
        false
    }
    fn failed_peer(&self) -> Option<usize> {
        None
    }
    fn record(&self, reason: &Reason) {
        *self.reason.lock().unwrap() = Some(reason.clone());
    }
    fn set_abort_words(&self) {}
    fn release_flags(&self) {
        let n = self.areas.len();
        for f in waited_flags(n, self.rank) {
            let (owner, word) = f.home(n);
            self.areas[owner].write_u32(4 * word, self.value);
        }
    }
}

#[test]
fn a_missing_rank_ends_by_timeout_without_a_hang() {
    let dev = Device::open(test_device(0)).unwrap();
    let _ctx = dev.activate().unwrap();
    let v = Arc::new(Verifier::new(test_device(0)).unwrap());
    let (n, count, piece) = (2, 1 << 20, 1 << 20);
    let area_bytes = copy_area_bytes(&CopyGeom::new(n, 0, 2, count, piece, 0));
    let areas: Vec<HostMapped> = (0..n)
        .map(|_| HostMapped::alloc(area_bytes).unwrap())
        .collect();
    let mut rs = ranks(
        &dev,
        &v,
        &areas,
        count,
        piece,
        TestType::Bf16,
        false,
        Sum::Product,
    );
    // Only rank 0 runs; rank 1 never comes.
    let geom = CopyGeom::new(n, 0, 2, count, piece, 0);
    let r0 = &mut rs[0];
    execute(&schedule(&geom), &r0.addrs, &mut r0.streams).unwrap();
    let streams = [rs[0].streams.push, rs[0].streams.pull];
    let lonely = Arc::new(Lonely {
        areas,
        rank: 0,
        value: geom.next_piece(),
        streams,
        reason: Mutex::new(None),
    });
    let w = Watchdog::new(Duration::from_millis(1));
    let t = Instant::now();
    w.watch(lonely.clone(), Some(Duration::from_millis(300)));
    let hung = || panic!("the watchdog did not release the call");
    assert!(drain(&streams, Duration::from_secs(20), &hung));
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        *lonely.reason.lock().unwrap(),
        Some(Reason::Timeout(Duration::from_millis(300)))
    );
}

/// Whether the stream memory operations can be captured into a graph. Printed, not asserted:
/// the schedule runs outside captures either way (a captured call takes the kernels), since the
/// flag values a capture would freeze are per call.
#[test]
fn capture_of_stream_memory_operations() {
    let dev = Device::open(test_device(0)).unwrap();
    let _ctx = dev.activate().unwrap();
    let flags = HostMapped::alloc(256).unwrap();
    let s = Stream::create().unwrap();
    s.begin_capture().unwrap();
    // SAFETY: the flag word lives until the end of the test (the graph is launched and drained
    // below); nothing runs while the stream captures.
    let r = unsafe {
        s.write_value32(flags.dev_ptr(), 1)
            .and_then(|()| s.wait_value32(flags.dev_ptr(), 1))
    };
    let g = s.end_capture();
    eprintln!(
        "stream memory operations under capture: {r:?}; graph: {}",
        if g.is_ok() { "instantiated" } else { "refused" }
    );
    if let (Ok(()), Ok(g)) = (r, g) {
        g.launch(s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(
            flags.read_u32(0),
            1,
            "the replayed write reached host memory"
        );
    }
}

/// The schedule's speed, printed beside what it moves: 2 and 4 ranks, bf16, out of place, with
/// the product's reduction, 4-64 MiB in pieces of 1, 2 and 4 MiB; each size's calls (3 warm-up,
/// then 10 timed back to back, eager) run on every rank's two streams. The last call's result is
/// checked. Compare with `flashcomm-perf --mode virtual --transport host` (the kernels, the
/// link's floors) run on the same machine: issue 44 keeps the schedule only if it beats them.
#[test]
fn schedule_speed() {
    let dev = Device::open(test_device(0)).unwrap();
    let _ctx = dev.activate().unwrap();
    let v = Arc::new(Verifier::new(test_device(0)).unwrap());
    let ty = TestType::Bf16;
    let eb = ty.bytes() as usize;
    for n in [2usize, 4] {
        for piece in [1usize << 20, 2 << 20, 4 << 20] {
            let max = (64usize << 20) / eb;
            let area_bytes = copy_area_bytes(&CopyGeom::new(n, 0, eb, max, piece, 0));
            let areas: Vec<HostMapped> = (0..n)
                .map(|_| HostMapped::alloc(area_bytes).unwrap())
                .collect();
            let mut rs = ranks(&dev, &v, &areas, max, piece, ty, false, Sum::Product);
            let main = Stream::create().unwrap();
            let (start, end) = (Event::new(true).unwrap(), Event::new(true).unwrap());
            let mut first = 0u32;
            for bytes in [4usize << 20, 16 << 20, 64 << 20] {
                let count = bytes / eb;
                for (r, rank) in rs.iter().enumerate() {
                    v.fill(rank.input.as_ptr(), count as u64, ty, r as u32, 3, main)
                        .unwrap();
                }
                let mut run = |calls: usize, first: &mut u32| {
                    start.record(main).unwrap();
                    for rank in rs.iter() {
                        start.wait_on(rank.streams.push).unwrap();
                        start.wait_on(rank.streams.pull).unwrap();
                    }
                    for _ in 0..calls {
                        let mut next = *first;
                        for (r, rank) in rs.iter_mut().enumerate() {
                            let geom = CopyGeom::new(n, r, eb, count, piece, *first);
                            execute(&schedule(&geom), &rank.addrs, &mut rank.streams).unwrap();
                            next = geom.next_piece();
                        }
                        *first = next;
                    }
                    for rank in rs.iter() {
                        for s in [rank.streams.push, rank.streams.pull] {
                            let e = Event::new(false).unwrap();
                            e.record(s).unwrap();
                            e.wait_on(main).unwrap();
                        }
                    }
                    end.record(main).unwrap();
                    main.synchronize().unwrap();
                    end.elapsed_ms_since(&start).unwrap() as f64
                };
                run(3, &mut first);
                let ms = run(10, &mut first) / 10.0;
                for (r, rank) in rs.iter().enumerate() {
                    let out = rank.output.as_ref().unwrap();
                    v.check(
                        out.as_ptr(),
                        count as u64,
                        0,
                        Collective::AllReduce,
                        ty,
                        n as u32,
                        r as u32,
                        3,
                        main,
                    )
                    .unwrap();
                }
                main.synchronize().unwrap();
                let (bad, at) = v.errors().unwrap();
                assert_eq!(
                    bad, 0,
                    "{n} ranks, {bytes} bytes: {bad} wrong, first at {at}"
                );
                v.reset().unwrap();
                eprintln!(
                    "copy-schedule ranks {n} piece {} MiB bytes {bytes}: {:.1} us, algbw {:.2} GB/s",
                    piece >> 20,
                    ms * 1e3,
                    bytes as f64 / (ms * 1e-3) / 1e9
                );
            }
        }
    }
}

/// A communicator of the host transport whose eager lossless AllReduce takes the schedule.
fn copy_config(timeout: Duration) -> CommConfig {
    CommConfig {
        timeout,
        calibrate: false,
        transport: Choice::Force(Transport::Host),
        host_copy: HostCopy::On,
        ..CommConfig::default()
    }
}

/// Through the communicator (`FLASHCOMM_HOST_COPY=on`): 2 and 4 ranks, every type, in place and
/// out, sizes from one element to several pieces; every eager call takes the schedule and is
/// exact and bitwise identical on every rank; a call captured into a graph takes the kernels, and
/// eager calls before and after it stay in order.
#[test]
fn the_communicator_runs_the_schedule_exactly() {
    for n in [2u32, 4] {
        run_ranks(n, copy_config(Duration::from_secs(10)), |r| {
            let counts = [1u64, 1000, 777_777, (5 << 20) + 3];
            let max = (*counts.iter().max().unwrap() * 4) as usize;
            let send = r.alloc(max);
            let recv = r.alloc(max);
            r.shared.addrs.lock().unwrap()[r.rank() as usize] = recv.addr();
            r.sync();
            let rank0 = r.shared.addrs.lock().unwrap()[0];
            // Every rank's output holds the exact sum of the inputs filled with `salt`.
            let check = |count: u64, ty: TestType, salt: u32| {
                r.v.check(
                    recv.as_ptr(),
                    count,
                    0,
                    Collective::AllReduce,
                    ty,
                    r.n(),
                    r.rank(),
                    salt,
                    r.stream,
                )
                .unwrap()
            };
            let mut salt = 0;
            for ty in common::TYPES {
                let dt = ty.dtype().unwrap();
                for count in counts {
                    for in_place in [false, true] {
                        salt += 1;
                        let bytes = (count * ty.bytes()) as usize;
                        let input = if in_place { &recv } else { &send };
                        r.v.fill(input.as_ptr(), count, ty, r.rank(), salt, r.stream)
                            .unwrap();
                        let p = r
                            .comm
                            .execute(
                                &Request::typed(Collective::AllReduce, count, dt)
                                    .between(input.slice(0, bytes), recv.slice(0, bytes))
                                    .on(r.stream),
                            )
                            .unwrap();
                        assert!(p.copy_engines, "{ty:?} {count}: {p:?}");
                        check(count, ty, salt);
                        r.sync();
                        r.assert_clean(&format!("{ty:?} count {count} in place {in_place}"));
                        if r.rank() != 0 {
                            // SAFETY: rank 0's buffer lives until the group ends; the barrier
                            // below keeps rank 0 from reusing it before every rank compared.
                            let theirs = unsafe { DevicePtr::from_raw(rank0, bytes as u64) };
                            r.v.compare(recv.as_ptr(), theirs, bytes as u64, r.stream)
                                .unwrap();
                            r.stream.synchronize().unwrap();
                            r.assert_clean(&format!("identity with rank 0: {ty:?} {count}"));
                        }
                        r.boot.barrier().unwrap();
                    }
                }
            }
            // A captured call takes the kernels; replayed between two eager (schedule) calls.
            let (ty, count) = (TestType::Bf16, 777_777u64);
            let bytes = (count * 2) as usize;
            let call = |s: Stream| {
                r.comm
                    .execute(
                        &Request::typed(Collective::AllReduce, count, DataType::Bf16)
                            .between(send.slice(0, bytes), recv.slice(0, bytes))
                            .on(s),
                    )
                    .unwrap()
            };
            r.stream.begin_capture().unwrap();
            let captured = call(r.stream);
            let g = r.stream.end_capture().unwrap();
            assert!(!captured.copy_engines, "{captured:?}");
            salt += 1;
            r.v.fill(send.as_ptr(), count, ty, r.rank(), salt, r.stream)
                .unwrap();
            assert!(call(r.stream).copy_engines);
            g.launch(r.stream).unwrap();
            assert!(call(r.stream).copy_engines);
            check(count, ty, salt);
            r.sync();
            r.assert_clean("eager, replayed, eager");
            println!(
                "rank {}: {n} ranks exact, captured plan {captured:?}",
                r.rank()
            );
        });
    }
}

/// Two ranks whose calls disagree across the size rule (`auto`): rank 0's 1,000 elements on the
/// kernels, rank 1's 4 Mi elements on the schedule, with a 2 s time limit. Both calls must end
/// (the kernel's by its time limit, the schedule's by the watchdog, released by the time limit or
/// by rank 0's abort word) and report an error. In the host transport's suite on the H100 the
/// same disagreement, then in `gpu_collectives::disagreeing_ranks_get_an_error`, left the
/// schedule's rank waiting forever (docs/results/2026-12-07-h100-b541c40); the bounded wait and
/// the lines printed here say where it stops.
#[test]
fn ranks_that_disagree_across_the_schedule_and_the_kernels_both_end() {
    let cfg = CommConfig {
        host_copy: HostCopy::Auto,
        ..copy_config(Duration::from_secs(2))
    };
    run_ranks_expecting_errors(2, cfg, |comm, v, stream, m| {
        let buf = v.alloc(8 << 20).unwrap();
        m.barrier().unwrap();
        let (rank, count) = (m.rank(), if m.rank() == 0 { 1000 } else { 4 << 20 });
        let t = Instant::now();
        let p = comm
            .execute(
                &Request::typed(Collective::AllReduce, count, DataType::Bf16)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(stream),
            )
            .unwrap();
        assert_eq!(p.copy_engines, rank == 1);
        println!("rank {rank}: enqueued after {:?}", t.elapsed());
        let idle = comm.wait_idle_for(Duration::from_secs(10));
        println!(
            "rank {rank}: idle {idle:?} after {:?}, {} calls watched",
            t.elapsed(),
            Watchdog::process().watched()
        );
        assert_eq!(idle, Ok(true));
        let e = comm
            .check_status()
            .expect_err("the disagreement ends in an error");
        println!("rank {rank}: {e}");
    });
}

/// A copy-engine call whose peer never comes: with a time limit the watchdog releases it (the
/// stream drains, the call reports a timeout, the next call fails at once); without one,
/// `abort` from another thread does (the call reports the abort).
#[test]
fn a_missing_peer_is_released_by_the_time_limit_or_by_abort() {
    for limit in [Duration::from_millis(300), Duration::ZERO] {
        run_ranks_expecting_errors(2, copy_config(limit), |comm, v, stream, m| {
            let buf = v.alloc(8 << 20).unwrap();
            m.barrier().unwrap();
            if m.rank() == 0 {
                let t = Instant::now();
                let p = comm
                    .execute(
                        &Request::typed(Collective::AllReduce, 4 << 20, DataType::Bf16)
                            .between(buf.as_ptr(), buf.as_ptr())
                            .on(stream),
                    )
                    .unwrap();
                assert!(p.copy_engines);
                if limit.is_zero() {
                    common::abort_from_another_thread(comm, Duration::from_millis(300));
                }
                assert_eq!(comm.wait_idle_for(Duration::from_secs(10)), Ok(true));
                let took = t.elapsed();
                assert!(took < Duration::from_secs(5), "{took:?}");
                let e = comm.check_status().expect_err("the release is reported");
                if limit.is_zero() {
                    assert!(
                        matches!(&e, Error::Remote(m) if m.contains("aborted")),
                        "{e:?}"
                    );
                } else {
                    assert!(matches!(e, Error::Timeout(_)), "{e:?}");
                }
                assert!(
                    comm.execute(
                        &Request::typed(Collective::AllReduce, 4 << 20, DataType::Bf16)
                            .between(buf.as_ptr(), buf.as_ptr())
                            .on(stream),
                    )
                    .is_err(),
                    "a later call fails at once"
                );
                println!("released after {took:?}: {e}");
            }
        });
    }
}
