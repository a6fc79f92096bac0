//! GPU tests of the lossless collectives with virtual ranks on one GPU (N = 2, 4, 8): a sweep of
//! sizes from 4 bytes to 256 MiB for every collective, type, algorithm and protocol, checked
//! element by element on the device and bitwise across ranks; CUDA-graph replay; a
//! 100,000-collective stress run; and faults (a rank that never calls, ranks that disagree).
#![cfg(feature = "gpu")]

mod common;

use std::time::{Duration, Instant};

use common::*;
use flashcomm_comm::Request;
use flashcomm_comm::{
    Algorithm, Bootstrap, Choice, Collective, CommConfig, Communicator, DeviceMem, DevicePtr, Plan,
    Protocol, ThreadGroup, Transport,
};
use flashcomm_testkit::verify::TestType;

/// Largest message of the sweeps (256 MiB; `FLASHCOMM_SWEEP_MAX_MIB` lowers it for quick runs).
fn max_bytes() -> u64 {
    std::env::var("FLASHCOMM_SWEEP_MAX_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(256)
        << 20
}

fn sweep(n: u32) {
    sweep_on(n, test_config(), max_bytes());
}

/// The sweep on `cfg`'s transport, messages up to `max` bytes.
fn sweep_on(n: u32, cfg: CommConfig, max: u64) {
    let t0 = Instant::now();
    let want = cfg.transport;
    run_ranks(n, cfg, |r| {
        if let Choice::Force(t) = want {
            assert_eq!(
                r.comm.transport(),
                t,
                "the communicator took another transport"
            );
        }
        let n = r.n() as u64;
        let send = r.alloc(max as usize + 64);
        let recv = r.alloc(max as usize * n as usize + 64);
        r.shared.addrs.lock().unwrap()[r.rank() as usize] = recv.addr();
        r.sync();
        let rank0_recv = r.shared.addrs.lock().unwrap()[0];
        let mut cases = 0;
        let mut salt = 0u32;
        let mut cover = |coll: Collective, ty: TestType, algo: Algorithm, proto: Protocol| {
            for count in sweep_counts(ty.bytes(), max) {
                // ReduceScatter and AllToAll sweep the send size: recvcount (count per peer)
                // = count / n.
                let count = if matches!(coll, Collective::ReduceScatter | Collective::AlltoAll) {
                    (count / n).max(1)
                } else {
                    count
                };
                salt += 1;
                let elem = ty.bytes();
                let (send_elems, recv_elems) = common::send_recv_elems(coll, count, n);
                r.v.fill(send.as_ptr(), send_elems, ty, r.rank(), salt, r.stream)
                    .unwrap();
                recv.fill(0xA5, r.stream).unwrap();
                let p = r
                    .comm
                    .plan_forced(
                        &Request::bytes(coll, count, elem),
                        Choice::Force(algo),
                        Choice::Force(proto),
                    )
                    .unwrap();
                r.comm
                    .execute_plan(
                        p,
                        &Request::for_plan(&p, count, ty.dtype(), elem)
                            .between(
                                send.slice(0, (send_elems * elem) as usize),
                                recv.slice(0, (recv_elems * elem) as usize),
                            )
                            .on(r.stream),
                    )
                    .unwrap();
                r.v.check(
                    recv.as_ptr(),
                    recv_elems,
                    count,
                    coll,
                    ty,
                    r.n(),
                    r.rank(),
                    salt,
                    r.stream,
                )
                .unwrap();
                r.sync();
                r.assert_clean(&format!("{coll:?} {ty:?} {p:?} count={count}"));
                // Every rank holds the same result, except ReduceScatter's shards and AllToAll's
                // blocks (each rank receives its own).
                let same_everywhere =
                    !matches!(coll, Collective::ReduceScatter | Collective::AlltoAll);
                if same_everywhere && r.rank() != 0 {
                    // SAFETY: rank 0's receive buffer lives until the group finishes (the barrier
                    // below keeps rank 0 from reusing it before every rank has compared).
                    let theirs = unsafe { DevicePtr::from_raw(rank0_recv, recv_elems * elem) };
                    r.v.compare(recv.as_ptr(), theirs, recv_elems * elem, r.stream)
                        .unwrap();
                    r.stream.synchronize().unwrap();
                    r.assert_clean(&format!(
                        "bitwise identity with rank 0: {coll:?} {ty:?} count={count}"
                    ));
                }
                r.boot.barrier().unwrap();
                cases += 1;
            }
        };
        for ty in TYPES {
            for algo in Algorithm::ALL {
                for proto in Protocol::ALL {
                    cover(Collective::AllReduce, ty, algo, proto);
                }
            }
            for proto in Protocol::ALL {
                cover(Collective::ReduceScatter, ty, Algorithm::OneShot, proto);
            }
        }
        for ty in [TestType::U8, TestType::Bf16] {
            for proto in Protocol::ALL {
                cover(Collective::AllGather, ty, Algorithm::OneShot, proto);
            }
        }
        for ty in [TestType::U8, TestType::F32] {
            for proto in Protocol::ALL {
                cover(Collective::AlltoAll, ty, Algorithm::OneShot, proto);
            }
        }
        if r.rank() == 0 {
            println!(
                "N={n} ({}): {cases} cases, sizes 4 B..{} MiB, all exact and bitwise identical across ranks ({:.1} s)",
                r.comm.transport().name(),
                max >> 20,
                t0.elapsed().as_secs_f64()
            );
        }
    });
}

/// One rank: every collective is a copy of the input (done by the one-rank path, no kernel).
#[test]
fn sweep_1_rank() {
    sweep(1);
}

/// One rank: in place nothing happens, and a quantized AllReduce is exact (quantization never
/// applies when there is nothing to exchange).
#[test]
fn one_rank_in_place_and_quantized_are_exact() {
    run_ranks(1, test_config(), |r| {
        let count = 1u64 << 20;
        let ty = TestType::Bf16;
        let bytes = (count * ty.bytes()) as usize;
        let send = r.alloc(bytes);
        let recv = r.alloc(bytes);
        let q = flashcomm_comm::QuantSpec::new(4, 4, 128, 2).unwrap();
        for (salt, quant) in [(1u32, false), (2, true)] {
            for inplace in [false, true] {
                r.v.fill(send.as_ptr(), count, ty, 0, salt, r.stream)
                    .unwrap();
                let out = if inplace { &send } else { &recv };
                if !inplace {
                    recv.fill(0xA5, r.stream).unwrap();
                }
                let dt = ty.dtype().unwrap();
                if quant {
                    r.comm
                        .execute(
                            &Request::typed(Collective::AllReduce, count, dt)
                                .quantized(q, true)
                                .between(send.as_ptr(), out.as_ptr())
                                .on(r.stream),
                        )
                        .unwrap();
                } else {
                    r.comm
                        .execute(
                            &Request::typed(Collective::AllReduce, count, dt)
                                .between(send.as_ptr(), out.as_ptr())
                                .on(r.stream),
                        )
                        .unwrap();
                }
                r.v.check(
                    out.as_ptr(),
                    count,
                    count,
                    Collective::AllReduce,
                    ty,
                    1,
                    0,
                    salt,
                    r.stream,
                )
                .unwrap();
                r.sync();
                r.assert_clean(&format!("one rank, quantized {quant}, in place {inplace}"));
            }
        }
    });
}

#[test]
fn sweep_2_ranks() {
    sweep(2);
}

/// The host transport (arenas in pinned host memory: every byte crosses PCIe twice), forced,
/// whatever `FLASHCOMM_TRANSPORT` says, so every GPU run covers it: the same sweep up to 16 MiB,
/// exact and bitwise identical across ranks.
#[test]
fn host_transport_sweep_2_ranks() {
    let cfg = CommConfig {
        transport: Choice::Force(Transport::Host),
        ..test_config()
    };
    sweep_on(2, cfg, 16 << 20);
}

/// The host transport with four ranks, up to 4 MiB.
#[test]
fn host_transport_sweep_4_ranks() {
    let cfg = CommConfig {
        transport: Choice::Force(Transport::Host),
        ..test_config()
    };
    sweep_on(4, cfg, 4 << 20);
}

#[test]
fn sweep_4_ranks() {
    sweep(4);
}

#[test]
fn sweep_8_ranks() {
    sweep(8);
}

/// Random (non-integer) inputs: every rank's AllReduce output equals the CPU reference (fp32
/// accumulation in rank order, rounded once) bit for bit, for every algorithm and protocol.
#[test]
fn random_values_match_cpu_reference() {
    use half::{bf16, f16};
    let n = 4u32;
    let counts = [1u64, 7, 1000, 4097, 100_003, 1 << 20];
    run_ranks(n, test_config(), |r| {
        let maxc = *counts.iter().max().unwrap() as usize;
        let send = r.alloc(maxc * 4);
        let recv = r.alloc(maxc * 4);
        r.sync();
        for (ci, &count) in counts.iter().enumerate() {
            for (ti, ty) in TYPES.iter().enumerate() {
                // Every rank generates every rank's input (same seeds), so each can compute the
                // reference itself.
                let make = |rank: u32| -> Vec<f32> {
                    let mut s = 0x9e37_79b9_7f4a_7c15u64
                        ^ ((ci as u64) << 32)
                        ^ ((ti as u64) << 16)
                        ^ rank as u64;
                    (0..count)
                        .map(|_| {
                            s ^= s << 13;
                            s ^= s >> 7;
                            s ^= s << 17;
                            ((s >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32
                        })
                        .collect()
                };
                let inputs: Vec<Vec<f32>> = (0..n).map(make).collect();
                let to_bytes = |v: &[f32]| -> Vec<u8> {
                    match ty {
                        TestType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                        TestType::F16 => v
                            .iter()
                            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                            .collect(),
                        _ => v
                            .iter()
                            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                            .collect(),
                    }
                };
                let as_f32 = |v: &[f32]| -> Vec<f32> {
                    match ty {
                        TestType::F32 => v.to_vec(),
                        TestType::F16 => v.iter().map(|x| f16::from_f32(*x).to_f32()).collect(),
                        _ => v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect(),
                    }
                };
                let rounded: Vec<Vec<f32>> = inputs.iter().map(|v| as_f32(v)).collect();
                let mut acc = rounded[0].clone();
                for x in &rounded[1..] {
                    for (a, b) in acc.iter_mut().zip(x) {
                        *a += *b;
                    }
                }
                let expect = to_bytes(&acc);
                send.upload(0, &to_bytes(&inputs[r.rank() as usize]), r.stream)
                    .unwrap();
                for algo in Algorithm::ALL {
                    for proto in Protocol::ALL {
                        recv.fill(0xA5, r.stream).unwrap();
                        let elem = ty.bytes();
                        let p = r
                            .comm
                            .plan_forced(
                                &Request::bytes(Collective::AllReduce, count, elem),
                                Choice::Force(algo),
                                Choice::Force(proto),
                            )
                            .unwrap();
                        r.comm
                            .execute_plan(
                                p,
                                &Request::for_plan(&p, count, ty.dtype(), elem)
                                    .between(
                                        send.slice(0, (count * elem) as usize),
                                        recv.slice(0, (count * elem) as usize),
                                    )
                                    .on(r.stream),
                            )
                            .unwrap();
                        r.sync();
                        let mut got = vec![0u8; (count * elem) as usize];
                        recv.download(0, &mut got, r.stream).unwrap();
                        if let Some(i) = got.iter().zip(&expect).position(|(a, b)| a != b) {
                            panic!(
                                "rank {} {ty:?} {p:?} count={count}: byte {i} differs from the CPU reference",
                                r.rank()
                            );
                        }
                    }
                }
            }
        }
    });
}

/// In-place AllReduce and AllGather (recvbuff + rank*count == sendbuff), and misaligned buffers.
#[test]
fn in_place_and_misaligned() {
    run_ranks(4, test_config(), |r| {
        let n = r.n() as u64;
        let buf = r.alloc(64 << 20);
        r.sync();
        let mut salt = 1000;
        for count in [1u64, 3, 1001, 65537, 3 << 20] {
            for proto in Protocol::ALL {
                for algo in Algorithm::ALL {
                    for offset in [0usize, 2, 6] {
                        salt += 1;
                        let ty = TestType::Bf16;
                        let bytes = (count * 2) as usize;
                        r.v.fill(
                            buf.slice(offset, bytes),
                            count,
                            ty,
                            r.rank(),
                            salt,
                            r.stream,
                        )
                        .unwrap();
                        let p = r
                            .comm
                            .plan_forced(
                                &Request::bytes(Collective::AllReduce, count, 2),
                                Choice::Force(algo),
                                Choice::Force(proto),
                            )
                            .unwrap();
                        let io = buf.slice(offset, bytes);
                        r.comm
                            .execute_plan(
                                p,
                                &Request::for_plan(&p, count, ty.dtype(), 2)
                                    .between(io, io)
                                    .on(r.stream),
                            )
                            .unwrap();
                        r.check_allreduce(io, count, ty, salt, r.stream).unwrap();
                        r.sync();
                        r.assert_clean(&format!(
                            "in-place AllReduce offset={offset} count={count} {p:?}"
                        ));
                    }
                }
                // In-place AllGather: the send buffer is this rank's block of the receive buffer.
                salt += 1;
                let ty = TestType::U8;
                let out = buf.slice(3, (count * n) as usize);
                let mine = buf.slice(3 + (count * r.rank() as u64) as usize, count as usize);
                r.v.fill(mine, count, ty, r.rank(), salt, r.stream).unwrap();
                let p = r
                    .comm
                    .plan_forced(
                        &Request::bytes(Collective::AllGather, count, 1),
                        Choice::Auto,
                        Choice::Force(proto),
                    )
                    .unwrap();
                r.comm
                    .execute_plan(
                        p,
                        &Request::for_plan(&p, count, None, 1)
                            .between(mine, out)
                            .on(r.stream),
                    )
                    .unwrap();
                r.v.check(
                    out,
                    count * n,
                    count,
                    Collective::AllGather,
                    ty,
                    r.n(),
                    r.rank(),
                    salt,
                    r.stream,
                )
                .unwrap();
                r.sync();
                r.assert_clean(&format!("in-place AllGather count={count} {proto:?}"));
            }
        }
    });
}

/// The PULL protocols where ranks' buffers differ: on some ranks in place, on others not, some
/// misaligned (so a direct rank stages what its peers would otherwise read from its buffers:
/// a rank-local choice that must not change what its peers run), sizes across one-shot and
/// two-shot, every result exact and the same on every rank.
#[test]
fn pull_with_rank_local_buffers() {
    run_ranks(4, test_config(), |r| {
        let send = r.alloc(8 << 20);
        let recv = r.alloc(8 << 20);
        // Each rank's result, copied to the start of a buffer of its own for the comparison.
        let result = r.alloc(8 << 20);
        r.shared.addrs.lock().unwrap()[r.rank() as usize] = result.addr();
        r.sync();
        let rank0_result = r.shared.addrs.lock().unwrap()[0];
        let mut salt = 5000;
        for count in [1u64, 7, 1000, 4099, 65536, 300_001] {
            for proto in [Protocol::Pull, Protocol::Direct] {
                for algo in Algorithm::ALL {
                    for layout in 0..4u32 {
                        salt += 1;
                        let ty = TestType::Bf16;
                        let bytes = (count * 2) as usize;
                        // Rank-local layouts: rank r is in place when (r + layout) is odd, and
                        // misaligned by 2 bytes when (r + layout) / 2 is odd.
                        let k = r.rank() + layout;
                        let off = if (k / 2) % 2 == 1 { 2 } else { 0 };
                        let input = send.slice(off, bytes);
                        let output = if k % 2 == 1 {
                            input
                        } else {
                            recv.slice(off, bytes)
                        };
                        r.v.fill(input, count, ty, r.rank(), salt, r.stream)
                            .unwrap();
                        let p = r
                            .comm
                            .plan_forced(
                                &Request::bytes(Collective::AllReduce, count, 2),
                                Choice::Force(algo),
                                Choice::Force(proto),
                            )
                            .unwrap();
                        r.comm
                            .execute_plan(
                                p,
                                &Request::for_plan(&p, count, ty.dtype(), 2)
                                    .between(input, output)
                                    .on(r.stream),
                            )
                            .unwrap();
                        r.check_allreduce(output, count, ty, salt, r.stream)
                            .unwrap();
                        r.sync();
                        r.assert_clean(&format!("{p:?} layout {layout} count={count}"));
                        // Bitwise identity: every rank copies its result to the start of its
                        // result buffer, rank 0's is compared by the others.
                        result
                            .as_ptr()
                            .copy_from(output, bytes as u64, r.stream)
                            .unwrap();
                        r.sync();
                        if r.rank() != 0 {
                            // SAFETY: rank 0's result buffer lives until the group finishes
                            // (the barrier below keeps rank 0 from reusing it first).
                            let theirs = unsafe { DevicePtr::from_raw(rank0_result, bytes as u64) };
                            r.v.compare(result.as_ptr(), theirs, bytes as u64, r.stream)
                                .unwrap();
                            r.stream.synchronize().unwrap();
                            r.assert_clean(&format!("identity with rank 0: {p:?} layout {layout}"));
                        }
                        r.boot.barrier().unwrap();
                    }
                }
            }
        }
    });
}

/// The phase trace (`CommConfig::phase_trace`, flashcomm-perf `--phase-trace`): 4 virtual ranks
/// run 20 AllReduces of 64 KiB by the direct PULL one-shot, then 20 by the LL one-shot, each
/// batch checked exact. Each rank's trace, read on its stream after the batch, holds the batch's
/// calls under consecutive sequence numbers, each begun before it ended, with the moment its
/// peers' data was ready in between for PULL and none for LL; and the ranks' records of one call
/// overlap (no rank can finish a one-shot call before every peer began it; the ranks share the
/// GPU's clock).
#[test]
fn the_phase_trace_stamps_every_call() {
    let cfg = CommConfig {
        phase_trace: true,
        transport: Choice::Force(Transport::P2p),
        ..test_config()
    };
    run_ranks(4, cfg, |r| {
        let (count, calls) = (32768u64, 20usize);
        let send = r.alloc(64 << 10);
        let recv = r.alloc(64 << 10);
        for (i, proto) in [Protocol::Direct, Protocol::Ll].into_iter().enumerate() {
            let salt = 7000 + i as u32;
            let ty = TestType::Bf16;
            r.v.fill(send.as_ptr(), count, ty, r.rank(), salt, r.stream)
                .unwrap();
            let p = r
                .comm
                .plan_forced(
                    &Request::bytes(Collective::AllReduce, count, 2),
                    Choice::Force(Algorithm::OneShot),
                    Choice::Force(proto),
                )
                .unwrap();
            for _ in 0..calls {
                r.comm
                    .execute_plan(
                        p,
                        &Request::for_plan(&p, count, ty.dtype(), 2)
                            .between(send.as_ptr(), recv.as_ptr())
                            .on(r.stream),
                    )
                    .unwrap();
            }
            r.check_allreduce(recv.as_ptr(), count, ty, salt, r.stream)
                .unwrap();
            r.sync();
            r.assert_clean(&format!("{p:?}"));
            let traced = r.comm.phase_trace(r.stream).unwrap().expect("traced");
            assert!(traced.len() >= calls, "{} calls traced", traced.len());
            let batch = &traced[traced.len() - calls..];
            for (k, c) in batch.iter().enumerate() {
                assert_eq!(c.seq, batch[0].seq + k as u64, "{p:?}: {batch:?}");
                assert!(0 < c.begin && c.begin <= c.end, "{p:?}: {c:?}");
                if proto == Protocol::Ll {
                    assert_eq!(c.ready, 0, "{p:?}: {c:?}");
                } else {
                    assert!(c.begin <= c.ready && c.ready <= c.end, "{p:?}: {c:?}");
                }
            }
            let mine: Vec<u8> = batch
                .iter()
                .flat_map(|c| [c.seq, c.begin, c.end])
                .flat_map(u64::to_le_bytes)
                .collect();
            let all = r.boot.all_gather(&mine).unwrap();
            let word =
                |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
            for k in 0..calls {
                let seqs: Vec<u64> = all.iter().map(|b| word(b, 3 * k)).collect();
                assert!(
                    seqs.iter().all(|&q| q == seqs[0]),
                    "{p:?}: call {k}: {seqs:?}"
                );
                let last_begin = all.iter().map(|b| word(b, 3 * k + 1)).max().unwrap();
                let first_end = all.iter().map(|b| word(b, 3 * k + 2)).min().unwrap();
                assert!(
                    last_begin <= first_end,
                    "{p:?}: call {k}: a rank ended at {first_end} before a peer began at {last_begin}"
                );
            }
        }
    });
}

/// ReduceScatter, AllGather and AllToAll by loads (PULL and direct) where ranks' buffers differ:
/// some ranks in NCCL's in-place layout (AllGather: the input is the rank's block of the output;
/// ReduceScatter: the output is the rank's piece of the input; AllToAll: one buffer), some
/// misaligned (a direct rank then stages: a rank-local choice), counts that leave pieces of odd
/// sizes; every result exact.
#[test]
fn pull_moves_with_rank_local_buffers() {
    run_ranks(4, test_config(), |r| {
        let n = r.n() as u64;
        let a = r.alloc(16 << 20);
        let b = r.alloc(16 << 20);
        r.sync();
        let mut salt = 9000;
        for coll in [
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AlltoAll,
        ] {
            let ty = if coll == Collective::ReduceScatter {
                TestType::Bf16
            } else {
                TestType::U8
            };
            let elem = ty.bytes();
            for count in [1u64, 7, 1000, 4099, 65536, 300_001] {
                for proto in [Protocol::Pull, Protocol::Direct] {
                    for layout in 0..4u32 {
                        salt += 1;
                        let k = r.rank() + layout;
                        let off = if (k / 2) % 2 == 1 {
                            3 * elem as usize
                        } else {
                            0
                        };
                        let in_place = k % 2 == 1;
                        let piece = (count * elem) as usize;
                        let whole = piece * n as usize;
                        let mine = piece * r.rank() as usize;
                        let (input, output, in_elems, out_elems) = match coll {
                            Collective::AllGather => {
                                let out = a.slice(off, whole);
                                let inp = if in_place {
                                    a.slice(off + mine, piece)
                                } else {
                                    b.slice(off, piece)
                                };
                                (inp, out, count, count * n)
                            }
                            Collective::ReduceScatter => {
                                let inp = a.slice(off, whole);
                                let out = if in_place {
                                    a.slice(off + mine, piece)
                                } else {
                                    b.slice(off, piece)
                                };
                                (inp, out, count * n, count)
                            }
                            _ => {
                                let inp = a.slice(off, whole);
                                let out = if in_place { inp } else { b.slice(off, whole) };
                                (inp, out, count * n, count * n)
                            }
                        };
                        r.v.fill(input, in_elems, ty, r.rank(), salt, r.stream)
                            .unwrap();
                        let p = r
                            .comm
                            .plan_forced(
                                &Request::bytes(coll, count, elem),
                                Choice::Auto,
                                Choice::Force(proto),
                            )
                            .unwrap();
                        assert!(p.proto.pulls(), "{coll} count={count}: {p:?}");
                        r.comm
                            .execute_plan(
                                p,
                                &Request::for_plan(&p, count, ty.dtype(), elem)
                                    .between(input, output)
                                    .on(r.stream),
                            )
                            .unwrap();
                        r.v.check(
                            output,
                            out_elems,
                            count,
                            coll,
                            ty,
                            r.n(),
                            r.rank(),
                            salt,
                            r.stream,
                        )
                        .unwrap();
                        r.sync();
                        r.assert_clean(&format!(
                            "{coll} {p:?} layout {layout} count={count} in_place={in_place}"
                        ));
                        r.boot.barrier().unwrap();
                    }
                }
            }
        }
    });
}

/// The same collectives captured into a CUDA graph on every rank and replayed 1,000 times, with
/// the verification kernels inside the graph so every replay is checked.
#[test]
fn graph_capture_and_replay() {
    run_ranks(4, test_config(), |r| {
        let n = r.n() as u64;
        let send = r.alloc(32 << 20);
        let recv = r.alloc(32 << 20);
        let recv2 = r.alloc(32 << 20);
        r.sync();
        type Case = (
            Collective,
            TestType,
            u64,
            Choice<Algorithm>,
            Choice<Protocol>,
        );
        let cases: Vec<Case> = vec![
            (
                Collective::AllReduce,
                TestType::Bf16,
                4097,
                Choice::Auto,
                Choice::Force(Protocol::Ll),
            ),
            (
                Collective::AllReduce,
                TestType::F32,
                300_001,
                Choice::Force(Algorithm::TwoShot),
                Choice::Force(Protocol::Block),
            ),
            (
                Collective::AllReduce,
                TestType::F16,
                100_001,
                Choice::Force(Algorithm::OneShot),
                Choice::Force(Protocol::Block),
            ),
            (
                Collective::AllGather,
                TestType::U8,
                70_001,
                Choice::Auto,
                Choice::Auto,
            ),
            (
                Collective::AlltoAll,
                TestType::Bf16,
                20_001,
                Choice::Auto,
                Choice::Auto,
            ),
            (
                Collective::ReduceScatter,
                TestType::Bf16,
                50_001,
                Choice::Auto,
                Choice::Force(Protocol::Ll),
            ),
        ];
        for (i, (coll, ty, count, _, _)) in cases.iter().enumerate() {
            let elems = if matches!(coll, Collective::ReduceScatter | Collective::AlltoAll) {
                count * n
            } else {
                *count
            };
            r.v.fill(
                send.slice(i * (4 << 20), (elems * ty.bytes()) as usize),
                elems,
                *ty,
                r.rank(),
                7 + i as u32,
                r.stream,
            )
            .unwrap();
        }
        r.sync();
        r.stream.begin_capture().unwrap();
        for (i, (coll, ty, count, algo, proto)) in cases.iter().enumerate() {
            let elem = ty.bytes();
            let (se, re) = common::send_recv_elems(*coll, *count, n);
            let out = if i % 2 == 0 { &recv } else { &recv2 };
            let p = r
                .comm
                .plan_forced(&Request::bytes(*coll, *count, elem), *algo, *proto)
                .unwrap();
            r.comm
                .execute_plan(
                    p,
                    &Request::for_plan(&p, *count, ty.dtype(), elem)
                        .between(
                            send.slice(i * (4 << 20), (se * elem) as usize),
                            out.slice(0, (re * elem) as usize),
                        )
                        .on(r.stream),
                )
                .unwrap();
            r.v.check(
                out.as_ptr(),
                re,
                *count,
                *coll,
                *ty,
                r.n(),
                r.rank(),
                7 + i as u32,
                r.stream,
            )
            .unwrap();
        }
        let graph = r.stream.end_capture().expect("capture");
        // Every rank's graph is instantiated and uploaded before any rank replays.
        r.boot.barrier().unwrap();
        for _ in 0..1000 {
            graph.launch(r.stream).unwrap();
        }
        r.sync();
        r.assert_clean("1000 graph replays");
        if r.rank() == 0 {
            println!(
                "graph of {} collectives replayed 1000 times, every replay verified",
                cases.len()
            );
        }
    });
}

/// Queues one verified call on `r`'s stream: fills the send buffer with round `salt`'s inputs,
/// runs plan `p` and checks the result on the device (errors accumulate in the verifier).
#[allow(clippy::too_many_arguments)]
fn fill_run_check(
    r: &Rank,
    p: &Plan,
    coll: Collective,
    ty: TestType,
    count: u64,
    salt: u32,
    send: &DeviceMem,
    recv: &DeviceMem,
) {
    let n = r.n() as u64;
    let (se, re) = common::send_recv_elems(coll, count, n);
    let elem = ty.bytes();
    r.v.fill(send.as_ptr(), se, ty, r.rank(), salt, r.stream)
        .unwrap();
    r.comm
        .execute_plan(
            *p,
            &Request::for_plan(p, count, ty.dtype(), elem)
                .between(
                    send.slice(0, (se * elem) as usize),
                    recv.slice(0, (re * elem) as usize),
                )
                .on(r.stream),
        )
        .unwrap();
    r.v.check(
        recv.as_ptr(),
        re,
        count,
        coll,
        ty,
        r.n(),
        r.rank(),
        salt,
        r.stream,
    )
    .unwrap();
}

/// The plan of one stress call ([`common::stress_plan`]).
fn stress_plan(r: &Rank, x: u64, coll: Collective, ty: TestType, count: u64) -> Plan {
    common::stress_plan(&r.comm, x, coll, ty, count)
}

/// The start of the stress sequence (its first 200 calls, with their input fills and result
/// checks) captured into one CUDA graph on each of 8 ranks and replayed 1,000 times: 200,000
/// collectives, every replay verified on the device.
#[test]
fn stress_sequence_graph_replayed_1000_times() {
    let calls = 200u32;
    run_ranks(8, test_config(), |r| {
        let n = r.n() as u64;
        let send = r.alloc(4 << 20);
        let recv = r.alloc(32 << 20);
        r.sync();
        let words: Vec<u64> = common::stress_words().take(calls as usize).collect();
        let seq: Vec<_> = words.iter().map(|&x| common::stress_call(x, n)).collect();
        // Plans are made (and any first use of a kernel happens) before the capture.
        let plans: Vec<_> = words
            .iter()
            .zip(&seq)
            .map(|(&x, &(coll, ty, count))| stress_plan(r, x, coll, ty, count))
            .collect();
        r.stream.begin_capture().unwrap();
        for (i, (&(coll, ty, count), p)) in seq.iter().zip(&plans).enumerate() {
            fill_run_check(r, p, coll, ty, count, i as u32 % 1024, &send, &recv);
        }
        let graph = r.stream.end_capture().expect("capture");
        // Every rank's graph is instantiated and uploaded before any rank replays.
        r.boot.barrier().unwrap();
        let t0 = Instant::now();
        for k in 0..1000 {
            graph.launch(r.stream).unwrap();
            if k % 100 == 99 {
                r.sync();
                r.assert_clean(&format!("stress graph, replay {k}"));
            }
        }
        r.sync();
        r.assert_clean("stress graph");
        if r.rank() == 0 {
            println!(
                "the first {calls} calls of the stress sequence in one graph, replayed 1000 times on 8 ranks ({} collectives), every replay verified, {:.1} s",
                calls * 1000,
                t0.elapsed().as_secs_f64()
            );
        }
    });
}

/// 100,000 back-to-back collectives of random sizes, kinds and types, each verified on the device.
#[test]
fn stress_100k_random_collectives() {
    let t0 = Instant::now();
    run_ranks(8, test_config(), |r| {
        let n = r.n() as u64;
        let send = r.alloc(4 << 20);
        let recv = r.alloc(32 << 20);
        r.sync();
        for (i, x) in (0..100_000u32).zip(common::stress_words()) {
            let (coll, ty, count) = common::stress_call(x, n);
            let p = stress_plan(r, x, coll, ty, count);
            fill_run_check(r, &p, coll, ty, count, i % 1024, &send, &recv);
            if i % 10_000 == 9_999 {
                r.sync();
                r.assert_clean(&format!("stress up to call {i}"));
            }
        }
        r.sync();
        r.assert_clean("stress");
    });
    println!(
        "100,000 random collectives on 8 ranks verified in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// One rank never calls: the others leave their kernels with an error within timeout + 1 s,
/// the communicators can be destroyed, and a new group works afterwards.
#[test]
fn missing_rank_times_out_and_process_goes_on() {
    let timeout = Duration::from_secs(2);
    let cfg = CommConfig {
        timeout,
        calibrate: false,
        transport: common::test_transport(),
        ..CommConfig::default()
    };
    let group = ThreadGroup::new(4, Duration::from_secs(60));
    let members = group.members();
    std::thread::scope(|s| {
        for m in &members {
            let cfg = cfg.clone();
            s.spawn(move || {
                let dev = test_device(m.rank());
                let comm = Communicator::new(m, dev, cfg).unwrap();
                let v = flashcomm_testkit::verify::Verifier::new(dev).unwrap();
                let _ctx = v.activate().unwrap();
                let stream = v.stream().unwrap();
                let buf = v.alloc(1 << 20).unwrap();
                m.barrier().unwrap();
                if m.rank() != 3 {
                    let t = Instant::now();
                    comm.execute(
                        &Request::typed(
                            Collective::AllReduce,
                            1000,
                            flashcomm_comm::DataType::Bf16,
                        )
                        .between(buf.as_ptr(), buf.as_ptr())
                        .on(stream),
                    )
                    .unwrap();
                    stream.synchronize().unwrap();
                    let took = t.elapsed();
                    let err = comm
                        .check_status()
                        .expect_err("a missing peer must be reported");
                    assert!(
                        took <= timeout + Duration::from_secs(1),
                        "rank {} took {took:?}",
                        m.rank()
                    );
                    println!("rank {} left after {took:?}: {err}", m.rank());
                    // The next call reports the failure too.
                    assert!(
                        comm.execute(
                            &Request::typed(
                                Collective::AllReduce,
                                1000,
                                flashcomm_comm::DataType::Bf16
                            )
                            .between(buf.as_ptr(), buf.as_ptr())
                            .on(stream)
                        )
                        .is_err()
                    );
                }
                m.barrier().unwrap();
                drop(comm);
            });
        }
    });
    // The process goes on: a fresh group works.
    run_ranks(4, test_config(), |r| {
        let buf = r.alloc(1 << 16);
        r.sync();
        r.v.fill(buf.as_ptr(), 1000, TestType::F32, r.rank(), 1, r.stream)
            .unwrap();
        r.comm
            .execute(
                &Request::typed(Collective::AllReduce, 1000, flashcomm_comm::DataType::F32)
                    .between(buf.as_ptr(), buf.as_ptr())
                    .on(r.stream),
            )
            .unwrap();
        r.check_allreduce(buf.as_ptr(), 1000, TestType::F32, 1, r.stream)
            .unwrap();
        r.sync();
        r.assert_clean("after a failed group");
    });
}

/// Ranks that disagree (different counts, hence different kernels) end in an error, never a hang.
#[test]
fn disagreeing_ranks_get_an_error() {
    let timeout = Duration::from_secs(2);
    let cfg = CommConfig {
        timeout,
        calibrate: false,
        transport: common::test_transport(),
        ..CommConfig::default()
    };
    run_ranks_expecting_errors(2, cfg, |comm, v, stream, m| {
        let buf = v.alloc(16 << 20).unwrap();
        m.barrier().unwrap();
        let count = if m.rank() == 0 { 1000 } else { 4 << 20 };
        let t = Instant::now();
        comm.execute(
            &Request::typed(Collective::AllReduce, count, flashcomm_comm::DataType::Bf16)
                .between(buf.as_ptr(), buf.as_ptr())
                .on(stream),
        )
        .unwrap();
        stream.synchronize().unwrap();
        let err = comm
            .check_status()
            .expect_err("disagreeing ranks must be reported");
        assert!(t.elapsed() <= timeout + Duration::from_secs(1));
        println!("rank {}: {err}", m.rank());
    });
}

/// The epoch crosses its wrap-around (0xfffffffe is followed by 1; docs/protocols.md, "Epochs")
/// on 2 and 4 ranks: 64 calls back to back, with no synchronization between them (so that two
/// consecutive calls that landed on the same half would race and show), starting 20 calls before
/// the wrap: the stress sequence (every collective and protocol the selector picks, sizes that
/// change the grid from call to call, so LL lines are read where calls of other geometries left
/// them), and every eighth call a 2 MiB LL one-shot AllReduce, whose blocks reuse their sub-slots
/// within the call (the lines they clear). Every call is verified on the device.
#[test]
fn epochs_wrap_around_without_a_wrong_result() {
    for n in [2u32, 4] {
        run_ranks(n, test_config(), |r| {
            let nn = r.n() as u64;
            let send = r.alloc(4 << 20);
            let recv = r.alloc(32 << 20);
            r.sync();
            r.comm.set_epoch_for_testing(0xffff_fffe - 20).unwrap();
            r.boot.barrier().unwrap();
            for (i, x) in (0..64u32).zip(common::stress_words().skip(777)) {
                let (coll, ty, count, p) = if i % 8 == 3 {
                    let (ty, count) = (TestType::Bf16, 1u64 << 20);
                    let p = r
                        .comm
                        .plan_forced(
                            &Request::bytes(Collective::AllReduce, count, ty.bytes()),
                            Choice::Force(Algorithm::OneShot),
                            Choice::Force(Protocol::Ll),
                        )
                        .unwrap();
                    (Collective::AllReduce, ty, count, p)
                } else {
                    let (coll, ty, count) = stress_call(x, nn);
                    (
                        coll,
                        ty,
                        count,
                        r.comm
                            .plan(&Request::bytes(coll, count, ty.bytes()))
                            .unwrap(),
                    )
                };
                fill_run_check(r, &p, coll, ty, count, i, &send, &recv);
            }
            r.sync();
            r.assert_clean("64 calls around the epoch's wrap");
        });
    }
}

/// Two ranks run one AllReduce of the same byte count with different datatypes (bf16 on rank 0,
/// f16 on rank 1) on the LL one-shot: lines of this call's epoch with the other signature are
/// reported as a mismatch (the rank that sees it first asks the other to stop), long before the
/// timeout, instead of summing bytes of different types.
#[test]
fn ranks_with_different_datatypes_report_a_mismatch() {
    let timeout = Duration::from_secs(60);
    let cfg = CommConfig {
        timeout,
        ..test_config()
    };
    let errors = std::sync::Mutex::new(Vec::new());
    run_ranks_expecting_errors(2, cfg, |comm, v, stream, m| {
        let buf = v.alloc(1 << 20).unwrap();
        let dt = if m.rank() == 0 {
            flashcomm_comm::DataType::Bf16
        } else {
            flashcomm_comm::DataType::F16
        };
        let count = 4096;
        let p = comm
            .plan_forced(
                &Request::bytes(Collective::AllReduce, count, 2),
                Choice::Force(Algorithm::OneShot),
                Choice::Force(Protocol::Ll),
            )
            .unwrap();
        m.barrier().unwrap();
        let t = Instant::now();
        comm.execute_plan(
            p,
            &Request::for_plan(&p, count, Some(dt), 2)
                .between(buf.slice(0, 8192), buf.slice(0, 8192))
                .on(stream),
        )
        .unwrap();
        stream.synchronize().unwrap();
        let err = comm
            .check_status()
            .expect_err("different datatypes must be reported");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the mismatch took {:?}",
            t.elapsed()
        );
        println!("rank {}: {err}", m.rank());
        errors.lock().unwrap().push(err.to_string());
    });
    let errors = errors.into_inner().unwrap();
    assert_eq!(errors.len(), 2);
    assert!(
        errors.iter().any(|e| e.contains("different collective")),
        "no rank reported the mismatch: {errors:?}"
    );
}

/// Graph mixing (`FLASHCOMM_GRAPH_MIXING`, on by default): on each of 2 ranks, a graph of three
/// verified AllReduces (bf16, two sizes) replayed on one stream and a verified eager AllReduce (f32, another size)
/// on a second stream, one after the other 10,000 times each, with no ordering by the caller
/// between the two streams: every call completes, with the right result (a replay and an eager
/// call that overlapped would share an epoch: a mismatch or wrong sums).
#[test]
fn graph_replays_and_eager_calls_on_two_streams() {
    let cfg = CommConfig {
        graph_mixing: true,
        ..test_config()
    };
    run_ranks(2, cfg, |r| {
        let eager = flashcomm_comm::Stream::create().unwrap();
        let (ga, gb) = (r.alloc(1 << 20), r.alloc(1 << 20));
        let (ea, eb) = (r.alloc(1 << 20), r.alloc(1 << 20));
        r.sync();
        let (gt, gcount) = (TestType::Bf16, 4096u64);
        let (et, ecount) = (TestType::F32, 3001u64);
        let gp = r
            .comm
            .plan(&Request::bytes(Collective::AllReduce, gcount, gt.bytes()))
            .unwrap();
        let ep = r
            .comm
            .plan(&Request::bytes(Collective::AllReduce, ecount, et.bytes()))
            .unwrap();
        let call = |p: &Plan,
                    ty: TestType,
                    count: u64,
                    salt: u32,
                    send: &DeviceMem,
                    recv: &DeviceMem,
                    s| {
            r.v.fill(send.as_ptr(), count, ty, r.rank(), salt, s)
                .unwrap();
            let bytes = (count * ty.bytes()) as usize;
            r.comm
                .execute_plan(
                    *p,
                    &Request::for_plan(p, count, ty.dtype(), ty.bytes())
                        .between(send.slice(0, bytes), recv.slice(0, bytes))
                        .on(s),
                )
                .unwrap();
            r.check_allreduce(recv.as_ptr(), count, ty, salt, s)
                .unwrap();
        };
        // Three collectives in the graph: the first waits for the last eager call at each
        // replay; the record node beside the chain must wait for all three.
        let gp2 = r
            .comm
            .plan(&Request::bytes(
                Collective::AllReduce,
                gcount / 2 + 5,
                gt.bytes(),
            ))
            .unwrap();
        r.stream.begin_capture().unwrap();
        call(&gp, gt, gcount, 7, &ga, &gb, r.stream);
        call(&gp2, gt, gcount / 2 + 5, 8, &ga, &gb, r.stream);
        call(&gp, gt, gcount, 9, &ga, &gb, r.stream);
        let graph = r.stream.end_capture().expect("capture");
        r.boot.barrier().unwrap();
        let t0 = Instant::now();
        for i in 0..10_000u32 {
            graph.launch(r.stream).unwrap();
            call(&ep, et, ecount, i % 1024, &ea, &eb, eager);
            if i % 1000 == 999 {
                eager.synchronize().unwrap();
                r.sync();
                r.assert_clean(&format!("graph and eager calls, iteration {i}"));
            }
        }
        eager.synchronize().unwrap();
        r.sync();
        r.assert_clean("graph and eager calls");
        if r.rank() == 0 {
            println!(
                "10,000 graph replays and 10,000 eager calls on two streams, verified, {:.1} s",
                t0.elapsed().as_secs_f64()
            );
        }
    });
}

/// AllToAll with blocks anywhere (what a group of `ncclSend`/`ncclRecv` with one buffer per
/// peer is, a scattered `Request`): send and receive blocks in shuffled places
/// with gaps between them, and blocks received in place of the blocks sent (a list all-to-all
/// with the same tensors); 2, 4 and 8 ranks, 2- and 4-byte elements, 1 to 256 Ki elements
/// per block; bitwise exact, and every rank's layout different from the others'.
#[test]
fn scattered_alltoall_blocks_anywhere() {
    for n in [2u32, 4, 8] {
        run_ranks(n, test_config(), |r| {
            let n = r.n() as u64;
            let max_block = (1u64 << 18) * 4;
            // Room for n blocks with a gap after each, twice (send and receive places).
            let stride = max_block + 4096;
            let space = r.alloc((2 * n * stride) as usize);
            let contiguous = r.alloc((n * max_block) as usize);
            let mut salt = 700u32;
            for ty in TYPES {
                for count in [1u64, 999, 1 << 18] {
                    salt += 1;
                    let elem = ty.bytes();
                    let block = count * elem;
                    // This rank's permutation of places (different on every rank).
                    let place = |q: u64, second: bool| -> u64 {
                        let slot = (q * 3 + u64::from(r.rank()) + if second { 1 } else { 0 }) % n;
                        (if second { n * stride } else { 0 }) + slot * stride + 64 * q
                    };
                    for aliased in [false, true] {
                        // Fill the blocks as a contiguous send buffer would be, then scatter.
                        r.v.fill(contiguous.as_ptr(), count * n, ty, r.rank(), salt, r.stream)
                            .unwrap();
                        let sends: Vec<_> = (0..n)
                            .map(|q| space.slice(place(q, false) as usize, block as usize))
                            .collect();
                        let recvs: Vec<_> = (0..n)
                            .map(|q| {
                                if aliased {
                                    sends[q as usize]
                                } else {
                                    space.slice(place(q, true) as usize, block as usize)
                                }
                            })
                            .collect();
                        for (q, b) in sends.iter().enumerate() {
                            b.copy_from(
                                contiguous.slice(q * block as usize, block as usize),
                                block,
                                r.stream,
                            )
                            .unwrap();
                        }
                        r.comm
                            .execute(
                                &Request::bytes(Collective::AlltoAll, count, elem)
                                    .scattered(&sends, &recvs)
                                    .on(r.stream),
                            )
                            .unwrap();
                        // Gather what arrived into one buffer and check it as an AllToAll result.
                        for (q, b) in recvs.iter().enumerate() {
                            contiguous
                                .slice(q * block as usize, block as usize)
                                .copy_from(*b, block, r.stream)
                                .unwrap();
                        }
                        r.v.check(
                            contiguous.as_ptr(),
                            count * n,
                            count,
                            Collective::AlltoAll,
                            ty,
                            r.n(),
                            r.rank(),
                            salt,
                            r.stream,
                        )
                        .unwrap();
                        r.sync();
                        r.assert_clean(&format!(
                            "scattered AllToAll {ty:?} count={count} aliased={aliased}"
                        ));
                    }
                }
            }
        });
    }
}

/// AllToAll in place (`send` = `recv`), which NCCL lets each rank choose while its peers pass two
/// buffers (routing no longer depends on it: docs/architecture.md, "Routing rules"): on 2, 4 and
/// 8 ranks, both protocols forced, sizes from one element to several rounds per block, every
/// type the kernels move; rank 0 runs in place and the others out of place on odd calls, every
/// rank in place on even ones. Exact, checked on the device.
#[test]
fn alltoall_in_place() {
    for n in [2u32, 4, 8] {
        run_ranks(n, test_config(), |r| {
            let nn = r.n() as u64;
            let max = 1u64 << 20;
            let a = r.alloc((max * nn * 4) as usize);
            let b = r.alloc((max * nn * 4) as usize);
            r.sync();
            let mut salt = 0u32;
            for proto in Protocol::ALL {
                for ty in [TestType::U8, TestType::Bf16, TestType::F32] {
                    for count in [1u64, 7, 4096, 100_003, max] {
                        salt += 1;
                        let in_place = salt.is_multiple_of(2) || r.rank() == 0;
                        let p = r
                            .comm
                            .plan_forced(
                                &Request::bytes(Collective::AlltoAll, count, ty.bytes()),
                                Choice::Auto,
                                Choice::Force(proto),
                            )
                            .unwrap();
                        let recv = if in_place { &a } else { &b };
                        fill_run_check(r, &p, Collective::AlltoAll, ty, count, salt, &a, recv);
                    }
                }
            }
            r.sync();
            r.assert_clean("in-place AllToAll");
        });
    }
}
