//! Fault class 4: the C API under a deterministic randomized harness, against the fake "older
//! real NCCL" (tests/fake/fake_nccl.c, which never dereferences buffers or handles). Many
//! threads make random sequences of calls with random buffer pointers, counts near overflow,
//! datatypes, operators and roots out of range (NCCL's newer datatype 12 among them), null,
//! stale and foreign communicator handles, unbalanced groups, random codec settings and string
//! buffers: no call may crash the process, hang, panic inside flashcomm (`ncclInternalError`), or
//! return a value outside `ncclResult_t`, and `ncclGetLastError` must always give a string. Out-pointers are always valid (NCCL's contract);
//! everything else is fair game. Runs in a child process, twice (with and without
//! `FLASHCOMM_GROUPED_ALLTOALL`, which holds grouped Send/Recv calls back).

mod common;

use std::ffi::{c_char, c_int, c_void};
use std::time::{Duration, Instant};

use common::*;

const THREADS: u64 = 8;
const CALLS: u64 = 3000;

/// xorshift64*: a deterministic stream per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct QuantConfig {
    rs_bits: c_int,
    ag_bits: c_int,
    group: c_int,
    spikes: c_int,
    min_bytes: usize,
    max_bytes: usize,
    allgather_bits: c_int,
    reducescatter_bits: c_int,
    alltoall_bits: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; 128]);

type Coll7 = unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize) -> c_int;
type Coll6 = unsafe extern "C" fn(usize, usize, usize, c_int, usize, usize) -> c_int;
type Rooted = unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize) -> c_int;
type Reduce8 =
    unsafe extern "C" fn(usize, usize, usize, c_int, c_int, c_int, usize, usize) -> c_int;
type P2p = unsafe extern "C" fn(usize, usize, c_int, c_int, usize, usize) -> c_int;
type CommFn = unsafe extern "C" fn(usize) -> c_int;
type CommInt = unsafe extern "C" fn(usize, *mut c_int) -> c_int;
type Void = unsafe extern "C" fn() -> c_int;

/// One thread's random calls. Returns how many calls it made.
fn hammer(ours: &Nccl, fake_comm: usize, seed: u64) -> u64 {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let all_reduce: Coll7 = ours.lib.get("ncclAllReduce");
    let reduce_scatter: Coll7 = ours.lib.get("ncclReduceScatter");
    let all_gather: Coll6 = ours.lib.get("ncclAllGather");
    let alltoall: Coll6 = ours.lib.get("ncclAlltoAll");
    let broadcast: Rooted = ours.lib.get("ncclBroadcast");
    let reduce: Reduce8 = ours.lib.get("ncclReduce");
    let send: P2p = ours.lib.get("ncclSend");
    let recv: P2p = ours.lib.get("ncclRecv");
    let group_start: Void = ours.lib.get("ncclGroupStart");
    let group_end: Void = ours.lib.get("ncclGroupEnd");
    let destroy: CommFn = ours.lib.get("ncclCommDestroy");
    let abort: CommFn = ours.lib.get("ncclCommAbort");
    let finalize: CommFn = ours.lib.get("ncclCommFinalize");
    let count: CommInt = ours.lib.get("ncclCommCount");
    let async_error: CommInt = ours.lib.get("ncclCommGetAsyncError");
    let init: unsafe extern "C" fn(*mut usize, c_int, UniqueId, c_int) -> c_int =
        ours.lib.get("ncclCommInitRank");
    let last_error: unsafe extern "C" fn(usize) -> *const c_char = ours.lib.get("ncclGetLastError");
    let error_string: unsafe extern "C" fn(c_int) -> *const c_char =
        ours.lib.get("ncclGetErrorString");
    let set_quant: unsafe extern "C" fn(usize, *const QuantConfig) -> c_int =
        ours.lib.get("flashcommCommSetQuant");
    let get_quant: unsafe extern "C" fn(usize, *mut QuantConfig) -> c_int =
        ours.lib.get("flashcommCommGetQuant");
    let stats: unsafe extern "C" fn(usize, *mut [u64; 48]) -> c_int =
        ours.lib.get("flashcommGetStats");
    let config_string: unsafe extern "C" fn(*mut c_char, usize) -> c_int =
        ours.lib.get("flashcommGetConfigString");

    let mut stale = Vec::new();
    let mut made = 0;
    for _ in 0..CALLS {
        let comm = match rng.below(6) {
            0 => 0,
            1 | 2 => fake_comm,
            3 => stale.last().copied().unwrap_or(0x40),
            4 => rng.next() as usize,
            _ => 0x10 + rng.below(64) as usize * 8,
        };
        let buf = |rng: &mut Rng| match rng.below(4) {
            0 => 0usize,
            1 => 0x1000,
            2 => rng.next() as usize,
            _ => usize::MAX - rng.below(4096) as usize,
        };
        let n = match rng.below(6) {
            0 => 0usize,
            1 => 1,
            2 => rng.below(1 << 20) as usize,
            3 => usize::MAX - rng.below(16) as usize,
            4 => usize::MAX / 2 + rng.below(16) as usize,
            _ => (1usize << 62) + rng.below(8) as usize,
        };
        let dt = rng.pick(&[-1, 0, 6, 7, 9, 11, 12, 13, 100, c_int::MAX, c_int::MIN]);
        let op = rng.pick(&[-5, 0, 1, 4, 5, 6, 8, 1000, c_int::MAX]);
        let root = rng.pick(&[-5, -1, 0, 1, 7, c_int::MAX]);
        let stream = rng.pick(&[0usize, 0x7000, usize::MAX]);
        let (s, r) = (buf(&mut rng), buf(&mut rng));
        let same = rng.below(4) == 0;
        let r = if same { s } else { r };
        // SAFETY: every pointer passed is either never dereferenced (buffers, streams and
        // handles are only forwarded to the fake, which ignores them, or checked by value) or a
        // valid out-pointer of this frame; that is the contract being exercised.
        let rc = unsafe {
            match rng.below(20) {
                0 => all_reduce(s, r, n, dt, op, comm, stream),
                1 => reduce_scatter(s, r, n, dt, op, comm, stream),
                2 => all_gather(s, r, n, dt, comm, stream),
                3 => alltoall(s, r, n, dt, comm, stream),
                4 => broadcast(s, r, n, dt, root, comm, stream),
                5 => reduce(s, r, n, dt, op, root, comm, stream),
                6 => send(s, n, dt, root, comm, stream),
                7 => recv(r, n, dt, root, comm, stream),
                8 => group_start(),
                9 => group_end(),
                10 => {
                    let mut c = 0i32;
                    count(comm, &mut c)
                }
                11 => {
                    let mut e = -1i32;
                    async_error(comm, &mut e)
                }
                12 if comm != fake_comm => {
                    // A stale or foreign handle: flashcomm does not know it.
                    let rc = rng.pick(&[destroy, abort, finalize])(comm);
                    stale.push(comm);
                    rc
                }
                13 => {
                    let mut c = 0usize;
                    let rc = init(&mut c, 1, UniqueId([rng.next() as u8; 128]), 0);
                    if rc == 0 {
                        stale.push(c);
                    }
                    rc
                }
                14 => {
                    let q = QuantConfig {
                        rs_bits: rng.pick(&[-1, 0, 1, 2, 4, 8, 9, 16, 17]),
                        ag_bits: rng.pick(&[0, 2, 8, 16, 255]),
                        group: rng.pick(&[0, 31, 32, 128, 256, 4096, -32]),
                        spikes: rng.pick(&[-1, 0, 2, 3, 4, 5]),
                        min_bytes: rng.next() as usize,
                        max_bytes: rng.next() as usize,
                        allgather_bits: rng.pick(&[0, 2, 8, 16, -1]),
                        reducescatter_bits: rng.pick(&[0, 3, 16, 99]),
                        alltoall_bits: rng.pick(&[0, 4, 16, c_int::MIN]),
                    };
                    if rng.below(4) == 0 {
                        set_quant(comm, std::ptr::null())
                    } else {
                        set_quant(comm, &q)
                    }
                }
                15 => {
                    let mut q = QuantConfig {
                        rs_bits: 0,
                        ag_bits: 0,
                        group: 0,
                        spikes: 0,
                        min_bytes: 0,
                        max_bytes: 0,
                        allgather_bits: 0,
                        reducescatter_bits: 0,
                        alltoall_bits: 0,
                    };
                    get_quant(comm, &mut q)
                }
                16 => {
                    let mut st = [0u64; 48];
                    stats(comm, &mut st)
                }
                17 => {
                    let len = rng.pick(&[0usize, 1, 7, 64, 8192]);
                    let mut b = vec![0x55 as c_char; len.max(1)];
                    let rc = config_string(b.as_mut_ptr(), len);
                    if len > 0 {
                        assert!(b[..len].contains(&0), "NUL-terminated within {len}");
                    }
                    rc
                }
                18 => {
                    let p = error_string(rng.next() as c_int);
                    assert!(!p.is_null());
                    0
                }
                _ => {
                    let p = last_error(comm);
                    assert!(!p.is_null(), "ncclGetLastError gave NULL");
                    let _ = std::ffi::CStr::from_ptr(p).to_bytes().len();
                    0
                }
            }
        };
        assert!(
            (0..=8).contains(&rc),
            "a call returned {rc}, not an ncclResult_t"
        );
        // ncclInternalError here could only come from a panic caught at the boundary (the fake
        // never returns it): a bug, whatever the arguments were.
        assert_ne!(rc, 3, "a panic inside flashcomm");
        made += 1;
    }
    // Leave the thread's groups balanced for the next thread's calls on this thread: none
    // (threads end here).
    let _ = group_end as *const c_void;
    made
}

#[test]
fn random_calls_on_many_threads_never_crash_or_hang() {
    let name = "random_calls_on_many_threads_never_crash_or_hang";
    if is_child(name) {
        let ours = Nccl::open(&cdylib());
        let fake = Lib::open(std::path::Path::new(
            &std::env::var("FLASHCOMM_NCCL_LIB").unwrap(),
        ));
        let fake_comm = fake.addr("fake_comm_object") as usize;
        let t0 = Instant::now();
        let made: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..THREADS)
                .map(|t| {
                    let ours = &ours;
                    s.spawn(move || hammer(ours, fake_comm, t + 1))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(60), "{made} calls took {took:?}");
        println!("{made} random calls on {THREADS} threads in {took:?}");
        // The library still works.
        assert_eq!(ours.version(), (SUCCESS, 21903));
        return;
    }
    let fake = fake_lib();
    for extra in [&[][..], &[("FLASHCOMM_GROUPED_ALLTOALL", "1")][..]] {
        let mut env = vec![("FLASHCOMM_NCCL_LIB", fake.to_str().unwrap())];
        env.extend_from_slice(extra);
        let out = run_child(name, &env, &[]);
        assert!(out.status.success());
    }
}
