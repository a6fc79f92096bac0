//! GPU tests of the quantized AllGather, AllToAll and ReduceScatter (one quantization step each)
//! with virtual ranks on one GPU (N = 2, 4, 8): every width 2..8, group sizes 32..256, spikes
//! 0/2/4, f16 and bf16, blocks from 1 value to 2^20 + 3 (2^18 + 3 above 2 ranks), in place where
//! NCCL allows it, and graph replay. Every rank's whole output must equal the CPU reference of
//! the collective bit for bit (crates/codec's `reference`, the specification: this rank's part
//! of `alltoall_quant` is `allgather_quant` of the blocks sent to it, its part of
//! `reducescatter_quant` the one-shot all-reduce of its shards) and lie within the error bound it
//! predicts; AllGather's output is therefore identical on every rank.
#![cfg(feature = "gpu")]

mod common;

use std::sync::Mutex;

use common::*;
use flashcomm_codec::{Element, Format, reference};
use flashcomm_comm::Request;
use flashcomm_comm::{Bootstrap, Collective, DataType, QuantSpec};
use half::{bf16, f16};

/// Deterministic activation-like values: a Gaussian-ish bulk with a few large spikes.
fn inputs(seed: u64, count: usize) -> Vec<f32> {
    activations(seed, count, 613, 7, 200.0)
}

#[derive(Clone, Copy, Debug)]
struct Case {
    coll: Collective,
    q: QuantSpec,
    dtype: DataType,
    /// Values per block: AllGather's send count, AllToAll's per-peer count, ReduceScatter's
    /// receive count.
    count: usize,
    in_place: bool,
}

fn cases(n: u32) -> Vec<Case> {
    let groups = [32u16, 64, 128, 256];
    let spikes = [0u8, 2, 4];
    let counts = [1usize, 700, 1024, 50_001, 3 << 17];
    let mut v = Vec::new();
    let mut i = 0usize;
    for coll in [
        Collective::AllGather,
        Collective::AlltoAll,
        Collective::ReduceScatter,
    ] {
        for bits in 2..=8u8 {
            v.push(Case {
                coll,
                q: QuantSpec::new(bits, bits, groups[i % 4], spikes[(i + n as usize) % 3]).unwrap(),
                dtype: if i.is_multiple_of(2) {
                    DataType::Bf16
                } else {
                    DataType::F16
                },
                count: counts[i % counts.len()],
                // AllToAll in place too: one buffer, which NCCL lets a rank pass.
                in_place: i % 3 == 1,
            });
            i += 1;
        }
        // The largest block, every collective once.
        v.push(Case {
            coll,
            q: QuantSpec::new(4, 4, 128, 2).unwrap(),
            dtype: DataType::Bf16,
            count: if n == 2 { (1 << 20) + 3 } else { (1 << 18) + 3 },
            in_place: coll == Collective::ReduceScatter,
        });
    }
    v
}

/// Values each rank sends: AllGather `count`, the others `n * count`.
fn send_len(c: &Case, n: u32) -> usize {
    match c.coll {
        Collective::AllGather => c.count,
        _ => c.count * n as usize,
    }
}

/// Values each rank receives.
fn recv_len(c: &Case, n: u32) -> usize {
    match c.coll {
        Collective::ReduceScatter => c.count,
        _ => c.count * n as usize,
    }
}

fn to_bytes(dtype: DataType, v: &[f32]) -> Vec<u8> {
    half_bytes(dtype, v)
}

/// Rank `rank`'s expected output bytes, its per-element bounds and the exact values (the inputs
/// moved, or the exact f64 sum of the shards).
fn expected(c: &Case, rank: usize, all: &[Vec<f32>]) -> (Vec<u8>, Vec<f64>, Vec<f64>) {
    fn run<T: Element + Copy>(
        c: &Case,
        rank: usize,
        fmt: Format,
        conv: impl Fn(f32) -> T,
        all: &[Vec<f32>],
    ) -> (Vec<u8>, Vec<f64>, Vec<f64>) {
        let typed: Vec<Vec<T>> = all
            .iter()
            .map(|v| v.iter().map(|x| conv(*x)).collect())
            .collect();
        let refs: Vec<&[T]> = typed.iter().map(|v| v.as_slice()).collect();
        let n = all.len();
        let len = c.count;
        let f = |x: &T| f64::from(x.to_f32());
        let (out, exact): (_, Vec<f64>) = match c.coll {
            Collective::AllGather => (
                reference::allgather_quant(fmt, &refs),
                typed.iter().flatten().map(f).collect(),
            ),
            // This rank's part only: what every source sent it, each block a round trip.
            Collective::AlltoAll => (
                reference::allgather_quant(
                    fmt,
                    &refs
                        .iter()
                        .map(|x| &x[rank * len..(rank + 1) * len])
                        .collect::<Vec<_>>(),
                ),
                typed
                    .iter()
                    .flat_map(|x| x[rank * len..(rank + 1) * len].iter().map(f))
                    .collect(),
            ),
            _ => (
                reference::allreduce_oneshot_with_bound(
                    fmt,
                    &refs
                        .iter()
                        .map(|x| &x[rank * len..(rank + 1) * len])
                        .collect::<Vec<_>>(),
                ),
                (0..len)
                    .map(|i| (0..n).map(|r| f(&typed[r][rank * len + i])).sum())
                    .collect(),
            ),
        };
        let mut bytes = Vec::new();
        for x in &out.values {
            let mut b = [0u8; 4];
            x.write_le(&mut b);
            bytes.extend_from_slice(&b[..T::BYTES]);
        }
        (bytes, out.bound, exact)
    }
    let fmt = c.q.format(c.dtype, c.q.rs_bits).unwrap();
    match c.dtype {
        DataType::F16 => run(c, rank, fmt, f16::from_f32, all),
        _ => run(c, rank, fmt, bf16::from_f32, all),
    }
}

/// Compares `got` with the expected bytes and bounds; returns the first problem, if any, and the
/// worst error as a fraction of its bound.
fn compare(
    dtype: DataType,
    got: &[u8],
    (want, bound, exact): (Vec<u8>, Vec<f64>, Vec<f64>),
) -> (Option<String>, f64) {
    if got.len() != want.len() {
        return (
            Some(format!("{} bytes, expected {}", got.len(), want.len())),
            0.0,
        );
    }
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        return (
            Some(format!("byte {i} differs from the CPU reference")),
            0.0,
        );
    }
    let mut worst = 0f64;
    for (i, (e, b)) in exact.iter().zip(&bound).enumerate() {
        let raw = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
        let v = f64::from(match dtype {
            DataType::F16 => f16::from_bits(raw).to_f32(),
            _ => bf16::from_bits(raw).to_f32(),
        });
        if (v - e).abs() > *b {
            return (
                Some(format!("element {i} = {v}, exact {e}, bound {b}")),
                worst,
            );
        }
        worst = worst.max((v - e).abs() / b.max(1e-30));
    }
    (None, worst)
}

/// Runs one case on rank `r` (buffers `send`/`recv` large enough), through the public method of
/// the collective; returns the plan's grid.
fn launch(
    r: &Rank<'_>,
    c: &Case,
    send: flashcomm_comm::DevicePtr,
    recv: flashcomm_comm::DevicePtr,
) -> u32 {
    let count = c.count as u64;
    let p = match c.coll {
        Collective::AllGather => r.comm.execute(
            &Request::typed(Collective::AllGather, count, c.dtype)
                .quantized(c.q, false)
                .between(send, recv)
                .on(r.stream),
        ),
        Collective::AlltoAll => r.comm.execute(
            &Request::typed(Collective::AlltoAll, count, c.dtype)
                .quantized(c.q, false)
                .between(send, recv)
                .on(r.stream),
        ),
        _ => r.comm.execute(
            &Request::typed(Collective::ReduceScatter, count, c.dtype)
                .quantized(c.q, false)
                .between(send, recv)
                .on(r.stream),
        ),
    }
    .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert_eq!(p.quant.map(|q| q.rs_bits), Some(c.q.rs_bits));
    p.grid
}

fn quantized_ops(n: u32) {
    let all_cases = cases(n);
    let max_values = all_cases
        .iter()
        .map(|c| send_len(c, n).max(recv_len(c, n)))
        .max()
        .unwrap();
    let errors = Mutex::new(Vec::<String>::new());
    run_ranks(n, test_config(), |r| {
        let rank = r.rank() as usize;
        let send = r.alloc(max_values * 2 + 64);
        let recv = r.alloc(max_values * 2 + 64);
        for (ci, c) in all_cases.iter().enumerate() {
            let all: Vec<Vec<f32>> = (0..n)
                .map(|rk| inputs(((ci as u64) << 8) | rk as u64, send_len(c, n)))
                .collect();
            let (sbytes, rbytes) = (send_len(c, n) * 2, recv_len(c, n) * 2);
            // In place: ReduceScatter's receive buffer is shard `rank` of its send buffer;
            // AllGather's send buffer is block `rank` of its receive buffer.
            let (sp, rp) = if !c.in_place {
                recv.fill(0xA5, r.stream).unwrap();
                send.upload(0, &to_bytes(c.dtype, &all[rank]), r.stream)
                    .unwrap();
                (send.slice(0, sbytes), recv.slice(0, rbytes))
            } else if c.coll == Collective::ReduceScatter {
                send.upload(0, &to_bytes(c.dtype, &all[rank]), r.stream)
                    .unwrap();
                (send.slice(0, sbytes), send.slice(rank * rbytes, rbytes))
            } else if c.coll == Collective::AlltoAll {
                send.upload(0, &to_bytes(c.dtype, &all[rank]), r.stream)
                    .unwrap();
                (send.slice(0, sbytes), send.slice(0, rbytes))
            } else {
                recv.fill(0xA5, r.stream).unwrap();
                recv.upload(rank * sbytes, &to_bytes(c.dtype, &all[rank]), r.stream)
                    .unwrap();
                (recv.slice(rank * sbytes, sbytes), recv.slice(0, rbytes))
            };
            r.sync();
            let grid = launch(r, c, sp, rp);
            r.sync();
            let mut got = vec![0u8; rbytes];
            let (buf, at) = if c.in_place && c.coll == Collective::ReduceScatter {
                (&send, rank * rbytes)
            } else if c.in_place && c.coll == Collective::AlltoAll {
                (&send, 0)
            } else {
                (&recv, 0)
            };
            buf.download(at, &mut got, r.stream).unwrap();
            let (problem, worst) = compare(c.dtype, &got, expected(c, rank, &all));
            let what = format!(
                "N={n} rank {rank} {:?} {:?} {:?} count={} in_place={} grid={grid}",
                c.coll, c.q, c.dtype, c.count, c.in_place
            );
            match problem {
                Some(p) => errors.lock().unwrap().push(format!("{what}: {p}")),
                None if rank == 0 => println!(
                    "ok {what}: bit-identical to the CPU reference, worst error {worst:.2} of its bound"
                ),
                None => {}
            }
            r.boot.barrier().unwrap();
        }
    });
    let errors = errors.into_inner().unwrap();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn quantized_ops_2_ranks() {
    quantized_ops(2);
}

#[test]
fn quantized_ops_4_ranks() {
    quantized_ops(4);
}

#[test]
fn quantized_ops_8_ranks() {
    quantized_ops(8);
}

/// Each collective captured in a CUDA graph and replayed 100 times: every replay gives the bytes
/// of the eager call; and f32 is refused as unsupported (the shim sends it to NCCL).
#[test]
fn quantized_ops_graph_replay() {
    let n = 4;
    run_ranks(n, test_config(), |r| {
        let count = 70_001usize;
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        let send = r.alloc(count * 2 * n as usize);
        let eager = r.alloc(count * 2 * n as usize);
        let replay = r.alloc(count * 2 * n as usize);
        send.upload(
            0,
            &to_bytes(
                DataType::Bf16,
                &inputs(91 + r.rank() as u64, count * n as usize),
            ),
            r.stream,
        )
        .unwrap();
        r.sync();
        for coll in [
            Collective::AllGather,
            Collective::AlltoAll,
            Collective::ReduceScatter,
        ] {
            let c = Case {
                coll,
                q,
                dtype: DataType::Bf16,
                count,
                in_place: false,
            };
            let rbytes = (recv_len(&c, n) * 2) as u64;
            launch(r, &c, send.as_ptr(), eager.as_ptr());
            r.sync();
            r.stream.begin_capture().unwrap();
            launch(r, &c, send.as_ptr(), replay.as_ptr());
            r.v.compare(replay.as_ptr(), eager.as_ptr(), rbytes, r.stream)
                .unwrap();
            let g = r.stream.end_capture().unwrap();
            r.boot.barrier().unwrap();
            for _ in 0..100 {
                g.launch(r.stream).unwrap();
            }
            r.sync();
            r.assert_clean(&format!("100 replays of quantized {coll:?}"));
            let f32_refused = r
                .comm
                .plan(&Request::typed(coll, 1000, DataType::F32).quantized(q, false));
            assert!(
                matches!(f32_refused, Err(flashcomm_comm::Error::Unsupported(_))),
                "{coll:?} f32: {f32_refused:?}"
            );
        }
    });
}
