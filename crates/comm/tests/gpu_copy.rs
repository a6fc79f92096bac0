//! The copy-engine schedule of the host transport on the GPU (docs/protocols.md "The copy-engine
//! schedule"): its stream operations (flag waits in host memory released by another stream's
//! write, copies through pinned host memory), the whole schedule of 2 and 4 virtual ranks on one
//! GPU (several calls, many pieces, unaligned sizes, in place) through [`execute`] and the
//! driver's [`CopyStreams`], a missing rank released by the watchdog, and whether the stream
//! memory operations can be captured into a graph (printed; the schedule runs outside captures).
//!
//! The schedule is not in the call path yet (`FLASHCOMM_HOST_COPY` does nothing): these tests
//! drive it directly, with the product's reduction (`fc_copy_reduce_<type>`) or the verification
//! kernels' (`fc_test_sum`, the same arithmetic). Inputs are the verification kernels' integer
//! values, so sums are exact in every type.
//!
//! Run with `cargo test -p flashcomm-comm --features gpu --test gpu_copy` on a machine with a
//! CUDA device.
#![cfg(feature = "gpu")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::test_device;
use flashcomm_comm::Collective;
use flashcomm_comm::gpu::{
    CopyReduce, CopyStreams, Device, DeviceMem, DevicePtr, Event, HostMapped, Kernels, Stream,
    copy_reduce_launcher,
};
use flashcomm_comm::plan::copy::{
    CopyAddrs, CopyGeom, copy_area_bytes, event_count, execute, schedule, waited_flags,
};
use flashcomm_comm::watch::{Reason, Watchdog, Watched};
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
                        ty.dtype().expect("a reducing type"),
                        1024,
                    )
                },
            };
            // SAFETY: the addresses handed to the engine are this test's allocations (inputs,
            // outputs, gather buffers, the host-mapped copy areas), alive until its streams
            // drain; flag words are 4-byte aligned (the areas start 4 KiB aligned).
            let streams = unsafe { CopyStreams::new(event_count(n), reduce) }.unwrap();
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
