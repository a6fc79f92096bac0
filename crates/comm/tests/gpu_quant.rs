//! GPU tests of the quantized AllReduce with virtual ranks on one GPU (N = 2, 4, 8): every width
//! 2..8, group sizes 32..256, spikes 0/2/4, f16 and bf16, one-shot and two-step, sizes from 1 KiB
//! to 16 MiB, and 256 MiB (plus a tail) at N = 2 and 8. Every rank's output must be bitwise
//! identical to rank 0's, and rank 0's output must equal the CPU reference of the same algorithm
//! bit for bit (crates/codec, the specification) and lie within the error bound it predicts for
//! one or two quantization steps.
#![cfg(feature = "gpu")]

mod common;

use std::sync::Mutex;

use common::*;
use flashcomm_codec::reference;
use flashcomm_comm::Request;
use flashcomm_comm::{
    Algorithm, Bootstrap, Choice, Collective, CommConfig, DataType, DevicePtr, QuantChoice,
    QuantSpec, plan,
};
use half::{bf16, f16};

/// Deterministic activation-like values: a Gaussian-ish bulk with a few large spikes.
fn inputs(seed: u64, count: usize) -> Vec<f32> {
    activations(seed, count, 997, 13, 300.0)
}

struct Case {
    q: QuantSpec,
    dtype: DataType,
    count: usize,
    algo: Choice<Algorithm>,
}

fn cases(n: u32) -> Vec<Case> {
    let groups = [32u16, 64, 128, 256];
    let spikes = [0u8, 2, 4];
    let counts = [512usize, 1000, 50_001, 1 << 20];
    let mut v = Vec::new();
    let mut i = 0usize;
    for bits in 2..=8u8 {
        for algo in [
            Choice::Force(Algorithm::OneShot),
            Choice::Force(Algorithm::TwoShot),
        ] {
            v.push(Case {
                q: QuantSpec::new(bits, bits, groups[i % 4], spikes[(i + n as usize) % 3]).unwrap(),
                dtype: if i.is_multiple_of(2) {
                    DataType::Bf16
                } else {
                    DataType::F16
                },
                count: counts[i % 4],
                algo,
            });
            i += 1;
        }
    }
    for rs in [2u8, 3, 4] {
        v.push(Case {
            q: QuantSpec::new(rs, 8, 128, 2).unwrap(),
            dtype: DataType::Bf16,
            count: 300_007,
            algo: Choice::Auto,
        });
    }
    v.push(Case {
        q: QuantSpec::new(4, 4, 128, 2).unwrap(),
        dtype: DataType::Bf16,
        count: (8 << 20) + 5,
        algo: Choice::Auto,
    });
    v
}

fn to_bytes(dtype: DataType, v: &[f32]) -> Vec<u8> {
    half_bytes(dtype, v)
}

/// The CPU reference output bytes and per-element bounds, and the exact sums.
fn reference_of(
    case: &Case,
    plan_algo: Algorithm,
    all: &[Vec<f32>],
) -> (Vec<u8>, Vec<f64>, Vec<f64>) {
    let fr = case.q.format(case.dtype, case.q.rs_bits).unwrap();
    let fa = case.q.format(case.dtype, case.q.ag_bits).unwrap();
    fn run<T: flashcomm_codec::Element + Copy>(
        algo: Algorithm,
        fr: flashcomm_codec::Format,
        fa: flashcomm_codec::Format,
        conv: impl Fn(f32) -> T,
        all: &[Vec<f32>],
    ) -> (Vec<u8>, Vec<f64>, Vec<f64>) {
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
        let exact: Vec<f64> = (0..all[0].len())
            .map(|i| typed.iter().map(|v| v[i].to_f32() as f64).sum())
            .collect();
        (bytes, out.bound, exact)
    }
    match case.dtype {
        DataType::F16 => run(plan_algo, fr, fa, f16::from_f32, all),
        _ => run(plan_algo, fr, fa, bf16::from_f32, all),
    }
}

/// Compares `got` (the output bytes of elements `first..`) with the CPU reference bytes and
/// bounds; records the first difference and the first element outside its bound in `errors`.
/// Returns the worst error as a fraction of its bound.
fn check_against_reference(
    what: &str,
    dtype: DataType,
    first: usize,
    got: &[u8],
    (want, bound, exact): &(Vec<u8>, Vec<f64>, Vec<f64>),
    errors: &Mutex<Vec<String>>,
) -> f64 {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        errors.lock().unwrap().push(format!(
            "{what}: byte {} differs from the CPU reference",
            2 * first + i
        ));
    }
    let mut worst = 0f64;
    for (i, (e, b)) in exact.iter().zip(bound).enumerate() {
        let raw = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
        let v = match dtype {
            DataType::F16 => f16::from_bits(raw).to_f32(),
            _ => bf16::from_bits(raw).to_f32(),
        } as f64;
        if (v - e).abs() > *b {
            errors.lock().unwrap().push(format!(
                "{what}: element {} = {v}, exact {e}, bound {b}",
                first + i
            ));
            break;
        }
        worst = worst.max((v - e).abs() / b.max(1e-30));
    }
    worst
}

/// This rank's `bytes` of output at `out` against rank 0's buffer at address `rank0`: the bytes
/// that differ and the first of them (0 and whatever when identical); the verifier's count is
/// cleared again. The caller keeps rank 0's buffer alive and unchanged until every rank has
/// compared.
fn differences_from_rank0(r: &Rank<'_>, out: DevicePtr, rank0: u64, bytes: usize) -> (u64, u64) {
    // SAFETY: rank 0's buffer holds at least `bytes` (every rank allocates the same sizes) and
    // outlives the comparison (the caller's contract).
    let theirs = unsafe { DevicePtr::from_raw(rank0, bytes as u64) };
    r.v.compare(out, theirs, bytes as u64, r.stream).unwrap();
    r.stream.synchronize().unwrap();
    let (wrong, first) = r.v.errors().unwrap();
    r.v.reset().unwrap();
    (wrong, first)
}

/// [`differences_from_rank0`], asserting that there are none.
fn assert_same_as_rank0(r: &Rank<'_>, out: DevicePtr, rank0: u64, bytes: usize, what: &str) {
    let (wrong, first) = differences_from_rank0(r, out, rank0, bytes);
    assert_eq!(
        wrong,
        0,
        "rank {}: bitwise identity with rank 0: {what}: {wrong} bytes differ, the first at {first}",
        r.rank()
    );
}

fn quantized(n: u32) {
    let all_cases = cases(n);
    let max_count = all_cases.iter().map(|c| c.count).max().unwrap();
    let errors = Mutex::new(Vec::<String>::new());
    run_ranks(n, test_config(), |r| {
        let send = r.alloc(max_count * 2 + 64);
        let recv = r.alloc(max_count * 2 + 64);
        r.shared.addrs.lock().unwrap()[r.rank() as usize] = recv.addr();
        r.sync();
        let rank0 = r.shared.addrs.lock().unwrap()[0];
        for (ci, case) in all_cases.iter().enumerate() {
            let all: Vec<Vec<f32>> = (0..n)
                .map(|rk| inputs(((ci as u64) << 8) | rk as u64, case.count))
                .collect();
            let bytes = case.count * 2;
            send.upload(0, &to_bytes(case.dtype, &all[r.rank() as usize]), r.stream)
                .unwrap();
            recv.fill(0xA5, r.stream).unwrap();
            let p = r
                .comm
                .plan_forced(
                    &Request::typed(Collective::AllReduce, case.count as u64, case.dtype)
                        .quantized(case.q, false),
                    case.algo,
                    common::test_proto(),
                )
                .expect("plan");
            r.comm
                .execute_plan(
                    p,
                    &Request::for_plan(&p, case.count as u64, Some(case.dtype), 2)
                        .between(send.slice(0, bytes), recv.slice(0, bytes))
                        .on(r.stream),
                )
                .unwrap();
            r.sync();
            let what = format!(
                "N={n} {:?} {:?} count={} {:?} grid={}",
                case.q, case.dtype, case.count, p.algo, p.grid
            );
            if r.rank() != 0 {
                // Rank 0's buffer lives until the group ends; the barrier below keeps it unchanged
                // until every rank has compared.
                assert_same_as_rank0(r, recv.as_ptr(), rank0, bytes, &what);
            } else {
                let mut got = vec![0u8; bytes];
                recv.download(0, &mut got, r.stream).unwrap();
                let worst = check_against_reference(
                    &what,
                    case.dtype,
                    0,
                    &got,
                    &reference_of(case, p.algo, &all),
                    &errors,
                );
                println!(
                    "ok {what}: bit-identical to the CPU reference, worst error {:.2} of its bound",
                    worst
                );
            }
            r.boot.barrier().unwrap();
        }
    });
    let errors = errors.into_inner().unwrap();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn quantized_2_ranks() {
    quantized(2);
}

#[test]
fn quantized_4_ranks() {
    quantized(4);
}

#[test]
fn quantized_8_ranks() {
    quantized(8);
}

/// 256 MiB messages (plus an odd tail): every rank's whole output must be bitwise identical to
/// rank 0's, and three windows of rank 0's output (the first, a middle and the last 2^20 values,
/// block-aligned) must equal the CPU reference bit for bit and lie within its bound. The codec
/// works block by block (1024 values) in both algorithms, so the reference of a block-aligned
/// window of the inputs is the full reference restricted to that window.
fn quantized_large(n: u32, q: QuantSpec, dtype: DataType) {
    let count = (128usize << 20) + 3;
    let bytes = count * 2;
    let case = Case {
        q,
        dtype,
        count,
        algo: Choice::Auto,
    };
    let win = 1usize << 20;
    let last = (count - 1) / 1024 * 1024 - win;
    let windows = [0usize, count / 2 / 1024 * 1024, last];
    let errors = Mutex::new(Vec::<String>::new());
    run_ranks(n, test_config(), |r| {
        let send = r.alloc(bytes + 64);
        let recv = r.alloc(bytes + 64);
        r.shared.addrs.lock().unwrap()[r.rank() as usize] = recv.addr();
        let seed = |rk: u32| (0xB16u64 << 8) | rk as u64;
        let mine = inputs(seed(r.rank()), count);
        send.upload(0, &to_bytes(dtype, &mine), r.stream).unwrap();
        drop(mine);
        recv.fill(0xA5, r.stream).unwrap();
        r.sync();
        let rank0 = r.shared.addrs.lock().unwrap()[0];
        let p = r
            .comm
            .plan_forced(
                &Request::typed(Collective::AllReduce, count as u64, dtype).quantized(q, false),
                Choice::Auto,
                common::test_proto(),
            )
            .expect("plan");
        r.comm
            .execute_plan(
                p,
                &Request::for_plan(&p, count as u64, Some(dtype), 2)
                    .between(send.slice(0, bytes), recv.slice(0, bytes))
                    .on(r.stream),
            )
            .unwrap();
        r.sync();
        let what = format!(
            "N={n} {q:?} {dtype:?} count={count} {:?} grid={}",
            p.algo, p.grid
        );
        if r.rank() != 0 {
            // Rank 0's buffer lives until the group ends; the barrier below keeps it unchanged
            // until every rank has compared.
            assert_same_as_rank0(r, recv.as_ptr(), rank0, bytes, &what);
        } else {
            let all: Vec<Vec<f32>> = (0..n).map(|rk| inputs(seed(rk), count)).collect();
            let mut worst = 0f64;
            for &w0 in &windows {
                let w1 = if w0 == last { count } else { w0 + win };
                let part: Vec<Vec<f32>> = all.iter().map(|v| v[w0..w1].to_vec()).collect();
                let mut got = vec![0u8; (w1 - w0) * 2];
                recv.download(w0 * 2, &mut got, r.stream).unwrap();
                worst = worst.max(check_against_reference(
                    &what,
                    dtype,
                    w0,
                    &got,
                    &reference_of(&case, p.algo, &part),
                    &errors,
                ));
            }
            println!(
                "ok {what}: all ranks bitwise identical over 256 MiB; values {windows:?} (+{win} each, the last to the end) bit-identical to the CPU reference, worst error {worst:.2} of its bound"
            );
        }
        r.boot.barrier().unwrap();
    });
    let errors = errors.into_inner().unwrap();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn quantized_256mib_2_ranks() {
    quantized_large(2, QuantSpec::new(4, 4, 128, 2).unwrap(), DataType::Bf16);
}

#[test]
fn quantized_256mib_8_ranks() {
    quantized_large(8, QuantSpec::new(3, 8, 64, 4).unwrap(), DataType::F16);
}

/// Quantized AllReduces captured in a CUDA graph and replayed: every replay gives the same bytes
/// as the eager call.
#[test]
fn quantized_graph_replay() {
    let n = 4;
    run_ranks(n, test_config(), |r| {
        let count = 200_001usize;
        let send = r.alloc(count * 2);
        let eager = r.alloc(count * 2);
        let replay = r.alloc(count * 2);
        r.sync();
        send.upload(
            0,
            &to_bytes(DataType::Bf16, &inputs(77 + r.rank() as u64, count)),
            r.stream,
        )
        .unwrap();
        let specs = [
            (QuantSpec::new(4, 4, 128, 2).unwrap(), Algorithm::OneShot),
            (QuantSpec::new(4, 8, 128, 2).unwrap(), Algorithm::TwoShot),
        ];
        for (q, algo) in specs {
            let p = r
                .comm
                .plan_forced(
                    &Request::typed(Collective::AllReduce, count as u64, DataType::Bf16)
                        .quantized(q, false),
                    Choice::Force(algo),
                    common::test_proto(),
                )
                .unwrap();
            r.comm
                .execute_plan(
                    p,
                    &Request::for_plan(&p, count as u64, Some(DataType::Bf16), 2)
                        .between(send.as_ptr(), eager.as_ptr())
                        .on(r.stream),
                )
                .unwrap();
            r.sync();
            r.stream.begin_capture().unwrap();
            r.comm
                .execute_plan(
                    p,
                    &Request::for_plan(&p, count as u64, Some(DataType::Bf16), 2)
                        .between(send.as_ptr(), replay.as_ptr())
                        .on(r.stream),
                )
                .unwrap();
            r.v.compare(
                replay.as_ptr(),
                eager.as_ptr(),
                (count * 2) as u64,
                r.stream,
            )
            .unwrap();
            let g = r.stream.end_capture().unwrap();
            r.boot.barrier().unwrap();
            for _ in 0..100 {
                g.launch(r.stream).unwrap();
            }
            r.sync();
            r.assert_clean(&format!("100 replays of {q:?} {algo:?}"));
        }
    });
}

/// `FLASHCOMM_QUANT_CHOICE=auto` on 2 virtual ranks: set-up times the quantized AllReduce of both
/// settings asked for (one-shot at every calibration size, two-step from 64 codec blocks); every
/// call asked to be quantized runs the plan the agreed models choose, the same plan on every
/// rank; a call that runs quantized gives the CPU reference's bytes, one that runs lossless the
/// exact sum (two bf16 values add exactly in f32). Under `always` every call is quantized.
#[test]
fn quantized_where_it_pays() {
    let n = 2;
    let specs = [
        QuantSpec::new(4, 4, 128, 2).unwrap(),
        QuantSpec::new(8, 8, 128, 2).unwrap(),
    ];
    let counts: Vec<usize> = (0..7).map(|i| 2048usize << (2 * i)).collect(); // 4 KiB .. 16 MiB
    let max_count = *counts.iter().max().unwrap();
    let chosen = Mutex::new(Vec::<(u32, String)>::new());
    let errors = Mutex::new(Vec::<String>::new());
    let cfg = CommConfig {
        calibrate: true,
        quant_calibrate: specs.to_vec(),
        quant_choice: QuantChoice::Auto,
        ..test_config()
    };
    let began = std::time::Instant::now();
    run_ranks(n, cfg, |r| {
        let c = &r.comm;
        if r.rank() == 0 {
            // What calibrating the two settings adds to set-up (with the lossless calibration
            // and the rest of set-up; the `always` run below times the same with one setting).
            println!(
                "set-up with 2 quantized settings timed: {:?}",
                began.elapsed()
            );
        }
        for q in specs {
            let m = c.quant_model(q).expect("the settings were timed at set-up");
            for (i, &size) in plan::CALIB_SIZES.iter().enumerate() {
                let one = m.table_us[Algorithm::OneShot.index()][i];
                let two = m.table_us[Algorithm::TwoShot.index()][i];
                assert!(
                    one > 0.0 && one.is_finite(),
                    "{q:?} one-shot at {size}: {one}"
                );
                let blocks = size / 2 / plan::CODEC_BLOCK_VALUES;
                if blocks >= plan::QUANT_TWO_STEP_MIN_BLOCKS {
                    assert!(
                        two > 0.0 && two.is_finite(),
                        "{q:?} two-step at {size}: {two}"
                    );
                } else {
                    assert_eq!(two, 0.0, "{q:?} two-step at {size} is never planned");
                }
            }
        }
        assert!(c.cost_model().calibrated);
        let send = r.alloc(max_count * 2);
        let recv = r.alloc(max_count * 2);
        r.shared.addrs.lock().unwrap()[r.rank() as usize] = recv.addr();
        r.sync();
        let rank0 = r.shared.addrs.lock().unwrap()[0];
        for (qi, &q) in specs.iter().enumerate() {
            for (ci, &count) in counts.iter().enumerate() {
                let case = Case {
                    q,
                    dtype: DataType::Bf16,
                    count,
                    algo: Choice::Auto,
                };
                let all: Vec<Vec<f32>> = (0..n)
                    .map(|rk| inputs(((qi as u64) << 16) | ((ci as u64) << 8) | rk as u64, count))
                    .collect();
                let bytes = count * 2;
                let p = c
                    .plan_forced(
                        &Request::typed(Collective::AllReduce, count as u64, DataType::Bf16)
                            .quantized(q, true),
                        Choice::Auto,
                        common::test_proto(),
                    )
                    .unwrap();
                // Outside the lossless window (the shim's FLASHCOMM_MIN_BYTES/MAX_BYTES) the
                // call stays quantized.
                let kept = c
                    .plan_forced(
                        &Request::typed(Collective::AllReduce, count as u64, DataType::Bf16)
                            .quantized(q, false),
                        Choice::Auto,
                        common::test_proto(),
                    )
                    .unwrap();
                assert!(
                    kept.quant.is_some(),
                    "{q:?} {count}: quantized outside the window"
                );
                // The rule, from the agreed models.
                let quant = c
                    .plan_forced(
                        &Request::typed(Collective::AllReduce, count as u64, DataType::Bf16)
                            .quantized(q, false),
                        Choice::Auto,
                        common::test_proto(),
                    )
                    .unwrap();
                let lossless = c
                    .plan(&Request::bytes(Collective::AllReduce, count as u64, 2))
                    .unwrap();
                let pays = plan::quant_pays(
                    c.cost_model(),
                    &lossless,
                    c.quant_model(q),
                    &quant,
                    bytes as u64,
                );
                assert_eq!(p, if pays { quant } else { lossless }, "{q:?} {count}");
                let what = format!(
                    "{q:?} count={count}: {}",
                    match p.quant {
                        Some(_) => format!("quantized {:?} grid {}", p.algo, p.grid),
                        None => format!("lossless {:?} {:?} grid {}", p.algo, p.proto, p.grid),
                    }
                );
                chosen.lock().unwrap().push((r.rank(), what.clone()));
                send.upload(
                    0,
                    &to_bytes(DataType::Bf16, &all[r.rank() as usize]),
                    r.stream,
                )
                .unwrap();
                recv.fill(0xA5, r.stream).unwrap();
                let ran = c
                    .execute(
                        &Request::typed(Collective::AllReduce, count as u64, DataType::Bf16)
                            .quantized(q, true)
                            .between(send.slice(0, bytes), recv.slice(0, bytes))
                            .on(r.stream),
                    )
                    .unwrap();
                assert_eq!(ran, p, "the call runs the plan chosen: {what}");
                r.sync();
                if r.rank() != 0 {
                    // Rank 0's buffer lives until the group ends; the barrier below keeps it unchanged
                    // until every rank has compared.
                    assert_same_as_rank0(r, recv.as_ptr(), rank0, bytes, &what);
                } else {
                    let mut got = vec![0u8; bytes];
                    recv.download(0, &mut got, r.stream).unwrap();
                    match p.quant {
                        Some(_) => {
                            let worst = check_against_reference(
                                &what,
                                DataType::Bf16,
                                0,
                                &got,
                                &reference_of(&case, p.algo, &all),
                                &errors,
                            );
                            println!(
                                "ok {what}: bit-identical to the CPU reference, worst {worst:.2} of its bound"
                            );
                        }
                        None => {
                            let typed: Vec<Vec<bf16>> = all
                                .iter()
                                .map(|v| v.iter().map(|&x| bf16::from_f32(x)).collect())
                                .collect();
                            let wrong = (0..count).find(|&i| {
                                let sum = typed[0][i].to_f32() + typed[1][i].to_f32();
                                let g = bf16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
                                g.to_bits() != bf16::from_f32(sum).to_bits()
                            });
                            if let Some(i) = wrong {
                                errors
                                    .lock()
                                    .unwrap()
                                    .push(format!("{what}: element {i} is not the exact sum"));
                            } else {
                                println!("ok {what}: the exact sum");
                            }
                        }
                    }
                }
                r.boot.barrier().unwrap();
            }
        }
    });
    let errors = errors.into_inner().unwrap();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // Every rank chose the same plans.
    let chosen = chosen.into_inner().unwrap();
    let of = |rank: u32| -> Vec<&String> {
        chosen
            .iter()
            .filter(|(r, _)| *r == rank)
            .map(|(_, w)| w)
            .collect()
    };
    assert_eq!(of(0), of(1), "every rank plans alike");
    for w in of(0) {
        println!("chosen: {w}");
    }

    // `always`: every call quantized, whatever the models say.
    let cfg = CommConfig {
        calibrate: true,
        quant_calibrate: specs[..1].to_vec(),
        quant_choice: QuantChoice::Always,
        ..test_config()
    };
    let began = std::time::Instant::now();
    run_ranks(n, cfg, |r| {
        if r.rank() == 0 {
            println!(
                "set-up with 1 quantized setting timed: {:?}",
                began.elapsed()
            );
        }
        for &count in &counts {
            let p = r
                .comm
                .plan_forced(
                    &Request::typed(Collective::AllReduce, count as u64, DataType::Bf16)
                        .quantized(specs[0], true),
                    Choice::Auto,
                    common::test_proto(),
                )
                .unwrap();
            assert!(p.quant.is_some(), "always quantized: count {count}");
        }
    });
}

/// A quantized one-shot that takes more than two rounds per block, run on a plan of
/// `plan::quant_shape` (one-shot whatever the cost model prefers): the case that gave wrong values on the GPU (8-bit from 16 MiB,
/// 4-bit from 32 MiB, 2 and 8 ranks, both transports). The block whose last chunk has fewer
/// frames than warps shares that chunk's codec blocks among its warps in its last round, and
/// without a block barrier there its faster warps overwrote the own frames of round r - 2 that
/// a slower warp was still decoding or copying. The count is adjusted (by whole codec blocks) so
/// that such a last chunk exists in the fourth round or later. Each call's output must be bitwise
/// identical on every rank and, on rank 0, equal the CPU reference bit for bit, within its bound.
fn quantized_oneshot_rounds(n: u32, max_blocks: u32, specs: &[(QuantSpec, usize)]) {
    use flashcomm_comm::abi::{FRAME_BYTES, FRAME_PAYLOAD};
    use flashcomm_comm::plan::{self, Arena};
    use flashcomm_comm::{CommConfig, Transport};
    const CALLS: usize = 8;
    let transports = match test_transport() {
        Choice::Force(t) => vec![t],
        Choice::Auto => vec![Transport::P2p, Transport::Host],
    };
    let dtype = DataType::Bf16;
    // Rank 0's CPU reference of each (spec, count), computed once for every transport.
    type Reference = std::sync::Arc<(Vec<u8>, Vec<f64>, Vec<f64>)>;
    let references = Mutex::new(Vec::<(usize, usize, Reference)>::new());
    for transport in transports {
        let cfg = CommConfig {
            transport: Choice::Force(transport),
            max_blocks: Some(max_blocks),
            ..test_config()
        };
        let arena = Arena::new(n, cfg.arena_bytes).unwrap();
        let errors = Mutex::new(Vec::<String>::new());
        run_ranks(n, cfg.clone(), |r| {
            // The plan and the count, the same on every rank (same arena and agreed grid).
            let shape = |count: usize, q: QuantSpec| {
                plan::quant_shape(
                    &arena,
                    count as u64,
                    dtype,
                    q,
                    r.comm.max_grid(),
                    Algorithm::OneShot,
                )
                .unwrap()
            };
            // (count, plan, rounds, last chunk's block, round and frames) of each spec.
            let picked: Vec<_> = specs
                .iter()
                .map(|&(q, bytes)| {
                    let fr = q.format(dtype, q.rs_bits).unwrap();
                    let m = (FRAME_PAYLOAD / fr.block_bytes() as u64) as usize;
                    (0..4096usize)
                        .find_map(|extra| {
                            let count = bytes / 2 + extra * 1024;
                            let (p, rounds) = shape(count, q);
                            let k = (p.sub_bytes / FRAME_BYTES) as usize * m;
                            let nb = count.div_ceil(1024);
                            let last = nb.div_ceil(k) - 1;
                            let frames = (nb - last * k).div_ceil(m);
                            let round = last / p.grid as usize;
                            let per = (p.sub_bytes / FRAME_BYTES) as usize;
                            (per >= 8 && frames < 8 && round >= 3).then_some((
                                count,
                                p,
                                rounds,
                                last % p.grid as usize,
                                round,
                                frames,
                            ))
                        })
                        .unwrap_or_else(|| {
                            panic!("N={n} {q:?}: no count near {bytes} bytes ends in a chunk of fewer frames than warps in round 3 or later")
                        })
                })
                .collect();
            let max_count = picked.iter().map(|x| x.0).max().unwrap();
            let send = r.alloc(max_count * 2 + 64);
            let recv = r.alloc(max_count * 2 + 64);
            r.shared.addrs.lock().unwrap()[r.rank() as usize] = recv.addr();
            r.sync();
            let rank0 = r.shared.addrs.lock().unwrap()[0];
            for (si, (&(q, _), &(count, p, rounds, block, round, frames))) in
                specs.iter().zip(&picked).enumerate()
            {
                assert_eq!(p.algo, Algorithm::OneShot);
                let bytes = count * 2;
                let seed = |rk: u32| (0x05u64 << 16) | ((si as u64) << 8) | rk as u64;
                let mine = inputs(seed(r.rank()), count);
                send.upload(0, &to_bytes(dtype, &mine), r.stream).unwrap();
                drop(mine);
                let case = Case {
                    q,
                    dtype,
                    count,
                    algo: Choice::Force(Algorithm::OneShot),
                };
                let reference = (r.rank() == 0).then(|| {
                    let mut refs = references.lock().unwrap();
                    if let Some((_, _, x)) = refs.iter().find(|x| (x.0, x.1) == (si, count)) {
                        return x.clone();
                    }
                    let all: Vec<Vec<f32>> = (0..n).map(|rk| inputs(seed(rk), count)).collect();
                    let x = Reference::new(reference_of(&case, Algorithm::OneShot, &all));
                    refs.push((si, count, x.clone()));
                    x
                });
                let what = format!(
                    "N={n} {transport:?} {q:?} {dtype:?} count={count} one-shot grid={} sub={} frames, {rounds} rounds, last chunk on block {block} in round {round} with {frames} frames",
                    p.grid,
                    p.sub_bytes / FRAME_BYTES
                );
                for call in 0..CALLS {
                    recv.fill(0xA5, r.stream).unwrap();
                    r.sync();
                    r.comm
                        .execute_plan(
                            p,
                            &Request::for_plan(&p, count as u64, Some(dtype), 2)
                                .between(send.slice(0, bytes), recv.slice(0, bytes))
                                .on(r.stream),
                        )
                        .unwrap();
                    r.sync();
                    if r.rank() != 0 {
                        // Rank 0's buffer lives until the group ends; the barrier below keeps it
                        // from being overwritten before every rank has compared.
                        let (wrong, first) = differences_from_rank0(r, recv.as_ptr(), rank0, bytes);
                        if wrong != 0 {
                            errors.lock().unwrap().push(format!(
                                "rank {}: {what}, call {call}: {wrong} bytes differ from rank 0's, the first at byte {first} (element {}, codec block {})",
                                r.rank(),
                                first / 2,
                                first / 2 / 1024
                            ));
                        }
                    } else {
                        let mut got = vec![0u8; bytes];
                        recv.download(0, &mut got, r.stream).unwrap();
                        let worst = check_against_reference(
                            &format!("{what}, call {call}"),
                            dtype,
                            0,
                            &got,
                            reference.as_deref().unwrap(),
                            &errors,
                        );
                        println!(
                            "{what}, call {call}: rank 0 checked against the CPU reference, worst error {worst:.2} of its bound"
                        );
                    }
                    r.boot.barrier().unwrap();
                }
            }
        });
        let errors = errors.into_inner().unwrap();
        assert!(errors.is_empty(), "{}", errors.join("\n"));
    }
}

/// 2 ranks, 66 blocks (the H200's grid of 2 virtual ranks): 8-bit from 16 MiB, 4-bit from 32 MiB.
#[test]
fn quantized_oneshot_past_two_rounds_2_ranks() {
    quantized_oneshot_rounds(
        2,
        66,
        &[
            (QuantSpec::new(8, 8, 128, 2).unwrap(), 16 << 20),
            (QuantSpec::new(4, 4, 128, 2).unwrap(), 32 << 20),
        ],
    );
}

/// 8 ranks, 16 blocks (the H200's grid of 8 virtual ranks): 8-bit and 4-bit at 16 MiB.
#[test]
fn quantized_oneshot_past_two_rounds_8_ranks() {
    quantized_oneshot_rounds(
        8,
        16,
        &[
            (QuantSpec::new(8, 8, 128, 2).unwrap(), 16 << 20),
            (QuantSpec::new(4, 4, 128, 2).unwrap(), 16 << 20),
        ],
    );
}
