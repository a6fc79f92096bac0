//! The per-call path of a served collective allocates nothing: a counting allocator watches the
//! calling thread around 1,000 calls of each collective (after a warm-up), lossless and
//! quantized, on 2 virtual ranks.
//!
//! Run with `cargo test -p flashcomm-comm --features gpu --test gpu_alloc` on a machine with a
//! CUDA device.
#![cfg(feature = "gpu")]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{run_ranks, test_config};
use flashcomm_comm::{Collective, Request};
use flashcomm_comm::{DataType, QuantSpec};

/// The system allocator, counting the allocations of threads that asked to be watched.
struct Counting;

thread_local! {
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counting touches only
// const-initialized thread-locals without destructors, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCHING.with(Cell::get) {
            ALLOCS.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if WATCHING.with(Cell::get) {
            ALLOCS.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: forwarded with the caller's arguments.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations made by this thread while `f` runs.
fn count_allocs(f: impl FnOnce()) -> u64 {
    ALLOCS.with(|c| c.set(0));
    WATCHING.with(|w| w.set(true));
    f();
    WATCHING.with(|w| w.set(false));
    ALLOCS.with(Cell::get)
}

const CALLS: usize = 1000;

#[test]
fn served_calls_do_not_allocate() {
    run_ranks(2, test_config(), |r| {
        let n = 4096u64; // 8 KiB of bf16: a decode-size AllReduce
        let send = r.alloc((n * 2 * 2) as usize);
        let recv = r.alloc((n * 2 * 2) as usize);
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        let s = r.stream;
        let ar = || {
            r.comm
                .execute(
                    &Request::typed(Collective::AllReduce, n, DataType::Bf16)
                        .between(send.as_ptr(), recv.as_ptr())
                        .on(s),
                )
                .unwrap();
        };
        let arq = || {
            r.comm
                .execute(
                    &Request::typed(Collective::AllReduce, n, DataType::Bf16)
                        .quantized(q, true)
                        .between(send.as_ptr(), recv.as_ptr())
                        .on(s),
                )
                .unwrap();
        };
        let rs = || {
            r.comm
                .execute(
                    &Request::typed(Collective::ReduceScatter, n / 2, DataType::Bf16)
                        .between(send.as_ptr(), recv.as_ptr())
                        .on(s),
                )
                .unwrap();
        };
        let ag = || {
            r.comm
                .execute(
                    &Request::bytes(Collective::AllGather, n / 2, 2)
                        .between(send.as_ptr(), recv.as_ptr())
                        .on(s),
                )
                .unwrap();
        };
        let calls: [(&str, &dyn Fn()); 4] = [
            ("AllReduce", &ar),
            ("quantized AllReduce", &arq),
            ("ReduceScatter", &rs),
            ("AllGather", &ag),
        ];
        for (what, call) in calls {
            for _ in 0..20 {
                call();
            }
            r.sync();
            let allocs = count_allocs(|| {
                for _ in 0..CALLS {
                    call();
                }
            });
            r.sync();
            println!("rank {}: {CALLS} x {what}: {allocs} allocations", r.rank());
            assert_eq!(
                allocs,
                0,
                "rank {}: {what} allocates on the call path",
                r.rank()
            );
        }
    });
}
