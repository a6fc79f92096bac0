//! The GPU codec against the CPU reference (`flashcomm-codec`), bit for bit.
//!
//! Run with `cargo test -p flashcomm-testkit --features gpu --release -- --nocapture` on a machine
//! with a CUDA device (`--release` makes the CPU reference fast; debug works too). Inputs are
//! fresh random data every run; the seed is printed with every failure and can be fixed with
//! `FLASHCOMM_TEST_SEED=<n>`. Each test prints one summary line per configuration family.
//!
//! What is compared:
//! * encode: GPU bytes == CPU `encode` bytes, for every format (dtype x width x group x spikes),
//!   staged and direct I/O, at lengths 1, 31, 1000, 1024, 1025, 4097, 100003 and one > 1 M;
//! * decode: GPU values == CPU `decode` values (bits); decode_accumulate: GPU f32 accumulators ==
//!   CPU ones (bits; any NaN equals any NaN, since the CPU's NaN payload after an addition is
//!   platform-defined);
//! * reduce_requantize for N = 2, 4, 8: GPU bytes == CPU bytes;
//! * headers that do not match are reported and their blocks left alone.
#![cfg(feature = "gpu")]

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use flashcomm_codec::{self as cpu, DType, Element, Format, bf16, f16};
use flashcomm_testkit::codec::{Codec, CodecFormat, CodecStatus, CodecValue, FLAG_DIRECT_IO};

// ------------------------------------------------------------------------------ randomness ----

use flashcomm_codec::rng::Rng;

fn base_seed() -> u64 {
    std::env::var("FLASHCOMM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}

/// Test values: mostly Gaussian blocks with a few spikes; the rest mixes exact zeros, negative
/// zeros, repeated values, constant and all-zero chunks, ReLU-like chunks, tiny (subnormal) and
/// huge values, and rare NaN and infinity chunks.
fn gen_values<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    let mut v = vec![0f64; n];
    for chunk in v.chunks_mut(32) {
        let scale = 10f64.powf(rng.uniform() * 8.0 - 4.0);
        let offset = if rng.chance(0.2) {
            rng.normal() * scale * 3.0
        } else {
            0.0
        };
        for x in chunk.iter_mut() {
            *x = rng.normal() * scale + offset;
        }
        let flavor = rng.below(100);
        match flavor {
            0..=59 => {}
            60..=69 => {
                for _ in 0..1 + rng.below(3) {
                    let i = rng.below(chunk.len());
                    chunk[i] = (50.0 + rng.uniform() * 1000.0)
                        * scale
                        * if rng.chance(0.5) { -1.0 } else { 1.0 };
                }
            }
            70..=74 => {
                for x in chunk.iter_mut() {
                    if rng.chance(0.3) {
                        *x = if rng.chance(0.5) { 0.0 } else { -0.0 };
                    }
                }
            }
            75..=78 => {
                let c = rng.normal() * scale;
                for x in chunk.iter_mut() {
                    if rng.chance(0.6) {
                        *x = c;
                    }
                }
            }
            79..=80 => {
                let c = if rng.chance(0.3) {
                    0.0
                } else {
                    rng.normal() * scale
                };
                chunk.fill(c);
            }
            81..=82 => {
                for x in chunk.iter_mut() {
                    *x = if rng.chance(0.5) { 0.0 } else { -0.0 };
                }
            }
            83..=87 => {
                for x in chunk.iter_mut() {
                    *x = x.max(0.0);
                }
            }
            88..=89 => {
                for x in chunk.iter_mut() {
                    *x *= 1e-40;
                }
            }
            90..=91 => {
                let i = rng.below(chunk.len());
                chunk[i] = f64::NAN;
            }
            92..=93 => {
                let i = rng.below(chunk.len());
                chunk[i] = if rng.chance(0.5) {
                    f64::INFINITY
                } else {
                    f64::NEG_INFINITY
                };
            }
            94..=95 => {
                // Near the top of the type: ranges that overflow.
                let big = T::MAX * 0.9;
                for x in chunk.iter_mut() {
                    if rng.chance(0.2) {
                        *x = if rng.chance(0.5) { big } else { -big };
                    }
                }
            }
            96..=97 => {
                // Two extremes and one more: the spike/range interplay.
                let i = rng.below(chunk.len());
                let j = rng.below(chunk.len());
                chunk[i] = 1e3 * scale;
                chunk[j] = -1e3 * scale;
            }
            _ => {
                let c = rng.normal() * scale;
                for x in chunk.iter_mut().step_by(2) {
                    *x = c;
                }
            }
        }
    }
    v.into_iter().map(|x| T::from_f32(x as f32)).collect()
}

// ------------------------------------------------------------------------------- plumbing ----

/// How a CPU element travels to the GPU.
trait Dev: Element {
    type D: CodecValue + cudarc::driver::ValidAsZeroBits + Copy + Default;
    fn to_dev(self) -> Self::D;
    fn from_dev(d: Self::D) -> Self;
}
impl Dev for f32 {
    type D = f32;
    fn to_dev(self) -> f32 {
        self
    }
    fn from_dev(d: f32) -> f32 {
        d
    }
}
impl Dev for f16 {
    type D = u16;
    fn to_dev(self) -> u16 {
        self.to_bits()
    }
    fn from_dev(d: u16) -> f16 {
        f16::from_bits(d)
    }
}
impl Dev for bf16 {
    type D = u16;
    fn to_dev(self) -> u16 {
        self.to_bits()
    }
    fn from_dev(d: u16) -> bf16 {
        bf16::from_bits(d)
    }
}

fn gpu_format(f: Format) -> CodecFormat {
    CodecFormat::new(f.dtype(), f.bits(), f.group(), f.spikes()).unwrap()
}

struct Gpu {
    stream: Arc<CudaStream>,
    codec: Codec,
}

fn gpu() -> Gpu {
    let ctx = CudaContext::new(0).expect("CUDA device 0");
    let stream = ctx.default_stream();
    let codec = Codec::new(&ctx).expect("codec kernels");
    Gpu { stream, codec }
}

fn formats_of(d: DType) -> Vec<Format> {
    Format::all().filter(|f| f.dtype() == d).collect()
}

/// Runs `f` over `items` on all cores, results in order.
fn par_map<I: Sync, R: Send>(items: &[I], f: impl Fn(&I) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .max(1);
    let chunk = items.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|c| {
                let f = &f;
                s.spawn(move || c.iter().map(f).collect::<Vec<R>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("worker"))
            .collect()
    })
}

const LENGTHS: [usize; 7] = [1, 31, 1000, 1024, 1025, 4097, 100_003];
const BIG: usize = 1_048_576 + 4_001;

// -------------------------------------------------------------------------- diagnostics ----

/// Where byte `off` of an encoded buffer lies.
fn describe_byte(f: Format, off: usize) -> (usize, String, Option<usize>) {
    let bb = f.block_bytes();
    let (b, o) = (off / bb, off % bb);
    let s = f.dtype().size();
    let k = usize::from(f.spikes());
    let g = usize::from(f.group());
    if o < 16 {
        return (b, format!("header byte {o}"), None);
    }
    for (p, &u) in f.units().iter().enumerate() {
        let start = f.plane_offset(p);
        if o >= start && o < start + f.plane_bytes(p) {
            let v = (o - start) * 8 / usize::from(u);
            return (
                b,
                format!(
                    "plane {p} (unit {u}) byte {}, value {v} (lane {})",
                    o - start,
                    v / 32
                ),
                Some(v / g),
            );
        }
    }
    if o < f.spike_values_offset() {
        let j = (o - f.range_offset()) / (2 * s);
        let which = if (o - f.range_offset()) % (2 * s) < s {
            "lo"
        } else {
            "hi"
        };
        return (b, format!("range table, group {j} {which}"), Some(j));
    }
    if o < f.spike_positions_offset() {
        let r = o - f.spike_values_offset();
        let j = r / (k * s);
        return (
            b,
            format!("spike value, group {j} slot {}", (r % (k * s)) / s),
            Some(j),
        );
    }
    if o < f.padding_offset() {
        let r = o - f.spike_positions_offset();
        return (
            b,
            format!("spike position, group {j} slot {}", r % k, j = r / k),
            Some(r / k),
        );
    }
    (b, format!("padding byte {}", o - f.padding_offset()), None)
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn group_dump<T: Element>(input: &[T], f: Format, block: usize, group: usize) -> String {
    let g = usize::from(f.group());
    let start = block * 1024 + group * g;
    if start >= input.len() {
        return "group beyond the input".into();
    }
    let end = (start + g).min(input.len());
    input[start..end]
        .iter()
        .enumerate()
        .map(|(i, v)| format!("[{i}] {:#x} {:e}", v.to_bits(), v.to_f32()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn compare_encoded<T: Element>(
    what: &str,
    seed: u64,
    f: Format,
    n: usize,
    input: &[T],
    want: &[u8],
    got: &[u8],
) {
    if want == got {
        return;
    }
    let off = want
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .unwrap_or(want.len().min(got.len()));
    let (b, field, group) = describe_byte(f, off);
    let lo = off.saturating_sub(8);
    let hi = (off + 8).min(want.len());
    panic!(
        "{what} mismatch (seed {seed}): format {f}, n {n}, {} of {} bytes differ; first at byte {off} = block {b}, {field}\n  cpu [{lo}..{hi}]: {}\n  gpu [{lo}..{hi}]: {}\n  input group: {}",
        want.iter().zip(got).filter(|(a, b)| a != b).count(),
        want.len(),
        hex(&want[lo..hi]),
        hex(&got[lo..hi]),
        group.map_or("-".into(), |j| group_dump(input, f, b, j)),
    );
}

// ----------------------------------------------------------------------------- the tests ----

fn encode_family<T: Dev>(g: &Gpu, seed: u64) {
    let formats = formats_of(T::DTYPE);
    let t0 = Instant::now();
    let mut lengths: Vec<usize> = LENGTHS.to_vec();
    lengths.push(BIG);
    let mut checked = 0usize;
    for (li, &n) in lengths.iter().enumerate() {
        let mut rng = Rng::new(seed ^ (li as u64 * 0x1234_5678_9abc));
        let input: Vec<T> = gen_values(&mut rng, n);
        // > 1 M values: one format per width (group and spikes rotate with the seed).
        let fs: Vec<Format> = if n == BIG {
            cpu::ALL_BITS
                .iter()
                .enumerate()
                .map(|(i, &b)| {
                    let gsel = cpu::ALL_GROUPS[(seed as usize + i) % 4];
                    let ksel = cpu::ALL_SPIKES[(seed as usize / 4 + i) % 3];
                    Format::new(T::DTYPE, b, gsel, ksel).unwrap()
                })
                .collect()
        } else {
            formats.clone()
        };
        let want: Vec<Vec<u8>> = par_map(&fs, |&f| cpu::encode_to_vec(f, &input).unwrap());
        let dev_in: Vec<T::D> = input.iter().map(|v| v.to_dev()).collect();
        let d_in: CudaSlice<T::D> = g.stream.clone_htod(&dev_in).unwrap();
        for (f, want) in fs.iter().zip(&want) {
            let gf = gpu_format(*f);
            assert_eq!(gf.block_bytes(), f.block_bytes(), "block size of {f}");
            for flags in [0, FLAG_DIRECT_IO] {
                let mut d_out = g.stream.alloc_zeros::<u8>(want.len()).unwrap();
                // Poison the output so that unwritten bytes show up.
                g.stream
                    .memcpy_htod(&vec![0xA5u8; want.len()], &mut d_out)
                    .unwrap();
                g.codec
                    .encode(&g.stream, gf, &d_in, &mut d_out, flags)
                    .unwrap();
                let got = g.stream.clone_dtoh(&d_out).unwrap();
                let what = if flags == 0 {
                    "encode (staged)"
                } else {
                    "encode (direct)"
                };
                compare_encoded(what, seed, *f, n, &input, want, &got);
                checked += 1;
            }
        }
    }
    println!(
        "encode {}: {checked} (format, length, I/O mode) runs bit-identical to the CPU, lengths {lengths:?}, seed {seed}, {:.1} s",
        T::DTYPE,
        t0.elapsed().as_secs_f64()
    );
}

fn bits_eq_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn decode_family<T: Dev>(g: &Gpu, seed: u64) {
    let formats = formats_of(T::DTYPE);
    let t0 = Instant::now();
    let mut checked = 0usize;
    let mut lengths: Vec<usize> = LENGTHS.to_vec();
    lengths.push(BIG);
    for (li, &n) in lengths.iter().enumerate() {
        let mut rng = Rng::new(seed ^ 0xdec0de ^ (li as u64 * 0x9e37_79b9));
        let input: Vec<T> = gen_values(&mut rng, n);
        let acc0: Vec<f32> = (0..n)
            .map(|i| match i % 7 {
                0 => 0.0,
                1 => -0.0,
                _ => rng.normal() as f32 * 10f32.powi(rng.below(7) as i32 - 3),
            })
            .collect();
        let fs: Vec<Format> = if n == BIG {
            cpu::ALL_BITS
                .iter()
                .map(|&b| Format::new(T::DTYPE, b, 128, 2).unwrap())
                .collect()
        } else {
            formats.clone()
        };
        let cpu_res: Vec<(Vec<u8>, Vec<T>, Vec<f32>)> = par_map(&fs, |&f| {
            let enc = cpu::encode_to_vec(f, &input).unwrap();
            let mut dec = vec![T::default(); n];
            cpu::decode(f, &enc, n, &mut dec).unwrap();
            let mut acc = acc0.clone();
            cpu::decode_accumulate::<T>(f, &enc, n, &mut acc).unwrap();
            (enc, dec, acc)
        });
        let d_acc0 = g.stream.clone_htod(&acc0).unwrap();
        for (f, (enc, dec, acc)) in fs.iter().zip(&cpu_res) {
            let gf = gpu_format(*f);
            let d_enc = g.stream.clone_htod(enc).unwrap();
            for flags in [0, FLAG_DIRECT_IO] {
                let mut d_out = g.stream.alloc_zeros::<T::D>(n).unwrap();
                let mut st = g.stream.clone_htod(&[0u32, u32::MAX]).unwrap();
                g.codec
                    .decode(&g.stream, gf, &d_enc, &mut d_out, Some(&mut st), flags)
                    .unwrap();
                let got: Vec<T> = g
                    .stream
                    .clone_dtoh(&d_out)
                    .unwrap()
                    .into_iter()
                    .map(T::from_dev)
                    .collect();
                let status = CodecStatus::from_words(&g.stream.clone_dtoh(&st).unwrap());
                assert_eq!(
                    status,
                    CodecStatus::CLEAR,
                    "decode of {f}, n {n}: blocks rejected (seed {seed})"
                );
                if let Some(i) = (0..n).find(|&i| got[i].to_bits() != dec[i].to_bits()) {
                    panic!(
                        "decode mismatch (seed {seed}, flags {flags}): format {f}, n {n}, first at value {i} (block {}, group {}): cpu {:#x} ({:e}), gpu {:#x} ({:e}); input {:#x} ({:e}); {} values differ\n  input group: {}",
                        i / 1024,
                        (i % 1024) / usize::from(f.group()),
                        dec[i].to_bits(),
                        dec[i].to_f32(),
                        got[i].to_bits(),
                        got[i].to_f32(),
                        input[i].to_bits(),
                        input[i].to_f32(),
                        (0..n)
                            .filter(|&i| got[i].to_bits() != dec[i].to_bits())
                            .count(),
                        group_dump(&input, *f, i / 1024, (i % 1024) / usize::from(f.group())),
                    );
                }
                checked += 1;
            }
            let mut d_acc = d_acc0.clone();
            g.codec
                .decode_accumulate(&g.stream, gf, &d_enc, &mut d_acc, None)
                .unwrap();
            let got = g.stream.clone_dtoh(&d_acc).unwrap();
            if let Some(i) = (0..n).find(|&i| !bits_eq_f32(got[i], acc[i])) {
                panic!(
                    "decode_accumulate mismatch (seed {seed}): format {f}, n {n}, first at value {i} (block {}, group {}): acc0 {:e}, cpu {:#x} ({:e}), gpu {:#x} ({:e}), input {:e}",
                    i / 1024,
                    (i % 1024) / usize::from(f.group()),
                    acc0[i],
                    acc[i].to_bits(),
                    acc[i],
                    got[i].to_bits(),
                    got[i],
                    input[i].to_f32(),
                );
            }
            checked += 1;
        }
    }
    println!(
        "decode + decode_accumulate {}: {checked} runs bit-identical to the CPU, lengths {lengths:?}, seed {seed}, {:.1} s",
        T::DTYPE,
        t0.elapsed().as_secs_f64()
    );
}

fn reduce_family<T: Dev>(g: &Gpu, seed: u64) {
    let t0 = Instant::now();
    let mut checked = 0usize;
    let lengths = [1usize, 1000, 1025, 4097, 100_003];
    let mut rng = Rng::new(seed ^ 0x005e_ed0f_5eed);
    for &n in &lengths {
        for nin in [2usize, 4, 8] {
            // Every input width, with a random output width, groups and spikes each time.
            let cases: Vec<(Format, Format)> = cpu::ALL_BITS
                .iter()
                .map(|&b| {
                    let fi = Format::new(
                        T::DTYPE,
                        b,
                        cpu::ALL_GROUPS[rng.below(4)],
                        cpu::ALL_SPIKES[rng.below(3)],
                    )
                    .unwrap();
                    let fo = Format::new(
                        T::DTYPE,
                        cpu::ALL_BITS[rng.below(7)],
                        cpu::ALL_GROUPS[rng.below(4)],
                        cpu::ALL_SPIKES[rng.below(3)],
                    )
                    .unwrap();
                    (fi, fo)
                })
                .collect();
            let inputs: Vec<Vec<T>> = (0..nin).map(|_| gen_values(&mut rng, n)).collect();
            let cpu_res: Vec<(Vec<Vec<u8>>, Vec<u8>)> = par_map(&cases, |&(fi, fo)| {
                let enc: Vec<Vec<u8>> = inputs
                    .iter()
                    .map(|x| cpu::encode_to_vec(fi, x).unwrap())
                    .collect();
                let refs: Vec<&[u8]> = enc.iter().map(|e| e.as_slice()).collect();
                let mut out = vec![0u8; fo.encoded_len(n)];
                cpu::reduce_requantize::<T>(fi, &refs, n, fo, &mut out).unwrap();
                (enc, out)
            });
            for ((fi, fo), (enc, want)) in cases.iter().zip(&cpu_res) {
                let d_in: Vec<CudaSlice<u8>> = enc
                    .iter()
                    .map(|e| g.stream.clone_htod(e).unwrap())
                    .collect();
                let refs: Vec<&CudaSlice<u8>> = d_in.iter().collect();
                let table = g.codec.input_table(&g.stream, &refs).unwrap();
                // Staged (shared-memory prefetch) and direct reads of the inputs.
                for flags in [0, FLAG_DIRECT_IO] {
                    let mut d_out = g.stream.clone_htod(&vec![0xA5u8; want.len()]).unwrap();
                    let mut st = g.stream.clone_htod(&[0u32, u32::MAX]).unwrap();
                    g.codec
                        .reduce_requantize(
                            &g.stream,
                            gpu_format(*fi),
                            &table,
                            gpu_format(*fo),
                            n,
                            &mut d_out,
                            Some(&mut st),
                            flags,
                        )
                        .unwrap();
                    let got = g.stream.clone_dtoh(&d_out).unwrap();
                    let status = CodecStatus::from_words(&g.stream.clone_dtoh(&st).unwrap());
                    assert_eq!(
                        status,
                        CodecStatus::CLEAR,
                        "reduce {fi} -> {fo}, n {n}, flags {flags}: blocks rejected (seed {seed})"
                    );
                    if want != &got {
                        // Show the rounded sum of the group, the encoder's input.
                        let mut sum = vec![0f32; n];
                        for e in enc {
                            let mut v = vec![0f32; n];
                            cpu::decode_f32::<T>(*fi, e, n, &mut v).unwrap();
                            for (s, x) in sum.iter_mut().zip(&v) {
                                *s += x;
                            }
                        }
                        let rounded: Vec<T> = sum.iter().map(|&x| T::from_f32(x)).collect();
                        compare_encoded(
                            &format!("reduce_requantize N={nin} flags {flags} {fi} ->"),
                            seed,
                            *fo,
                            n,
                            &rounded,
                            want,
                            &got,
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    println!(
        "reduce_requantize {}: {checked} runs (N = 2, 4, 8; every input width, random output formats) bit-identical to the CPU, lengths {lengths:?}, seed {seed}, {:.1} s",
        T::DTYPE,
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn encode_matches_cpu() {
    let g = gpu();
    let seed = base_seed();
    encode_family::<f32>(&g, seed);
    encode_family::<f16>(&g, seed.wrapping_add(1));
    encode_family::<bf16>(&g, seed.wrapping_add(2));
}

#[test]
fn decode_matches_cpu() {
    let g = gpu();
    let seed = base_seed() ^ 0xd;
    decode_family::<f32>(&g, seed);
    decode_family::<f16>(&g, seed.wrapping_add(1));
    decode_family::<bf16>(&g, seed.wrapping_add(2));
}

#[test]
fn reduce_requantize_matches_cpu() {
    let g = gpu();
    let seed = base_seed() ^ 0xf;
    reduce_family::<f32>(&g, seed);
    reduce_family::<f16>(&g, seed.wrapping_add(1));
    reduce_family::<bf16>(&g, seed.wrapping_add(2));
}

/// Hand-made groups: NaN, infinities, overflowing ranges, constant and all-zero groups, -0 against
/// +0, and groups shorter than the spike count (tails).
#[test]
fn special_groups_match_cpu() {
    let g = gpu();
    let t0 = Instant::now();
    let mut cases: Vec<(&str, Vec<f32>)> = Vec::new();
    let ramp: Vec<f32> = (0..1024).map(|i| (i as f32 - 500.0) * 0.37).collect();
    let mut with = |name: &'static str, edit: &dyn Fn(&mut Vec<f32>)| {
        let mut v = ramp.clone();
        edit(&mut v);
        cases.push((name, v));
    };
    with("one NaN", &|v| v[77] = f32::NAN);
    with("all NaN", &|v| {
        v.iter_mut().take(256).for_each(|x| *x = f32::NAN)
    });
    with("+inf", &|v| v[3] = f32::INFINITY);
    with("-inf and +inf", &|v| {
        v[3] = f32::INFINITY;
        v[9] = f32::NEG_INFINITY
    });
    with("two +inf", &|v| {
        v[3] = f32::INFINITY;
        v[4] = f32::INFINITY
    });
    with("range overflow", &|v| {
        v[0] = 3.0e38;
        v[1] = -3.0e38;
        v[2] = 3.0e38;
        v[5] = -3.0e38;
        v[6] = 2.9e38;
        v[7] = -2.9e38
    });
    with("all zero, mixed signs", &|v| {
        for (i, x) in v.iter_mut().enumerate() {
            *x = if i % 3 == 0 { -0.0 } else { 0.0 }
        }
    });
    with("-0 first", &|v| {
        for (i, x) in v.iter_mut().enumerate() {
            *x = if i % 2 == 0 { -0.0 } else { (i % 5) as f32 }
        }
    });
    with("constant", &|v| v.fill(1.5));
    with("constant with one spike", &|v| {
        v.fill(-2.25);
        v[100] = 7.0
    });
    with("ties at the extremes", &|v| {
        for (i, x) in v.iter_mut().enumerate() {
            *x = [3.0, -3.0, 1.0, 3.0, -3.0, 0.5, 2.0][i % 7]
        }
    });
    with("subnormals", &|v| {
        for (i, x) in v.iter_mut().enumerate() {
            *x = f32::from_bits((i as u32 % 97) + 1) * if i % 2 == 0 { 1.0 } else { -1.0 }
        }
    });
    with("tiny range", &|v| {
        for (i, x) in v.iter_mut().enumerate() {
            *x = 1.0 + (i % 3) as f32 * f32::EPSILON
        }
    });
    let mut runs = 0;
    for (name, vals) in &cases {
        for d in cpu::ALL_DTYPES {
            for &n in &[1usize, 2, 3, 5, 33, 1024] {
                match d {
                    DType::F32 => runs += special::<f32>(&g, name, vals, n),
                    DType::F16 => runs += special::<f16>(&g, name, vals, n),
                    DType::Bf16 => runs += special::<bf16>(&g, name, vals, n),
                }
            }
        }
    }
    println!(
        "special groups: {} cases x dtypes x lengths x formats = {runs} encode/decode runs bit-identical to the CPU, {:.1} s",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
}

fn special<T: Dev>(g: &Gpu, name: &str, vals: &[f32], n: usize) -> usize {
    let input: Vec<T> = vals[..n].iter().map(|&x| T::from_f32(x)).collect();
    let dev_in: Vec<T::D> = input.iter().map(|v| v.to_dev()).collect();
    let d_in = g.stream.clone_htod(&dev_in).unwrap();
    let mut runs = 0;
    for f in formats_of(T::DTYPE) {
        let want = cpu::encode_to_vec(f, &input).unwrap();
        let mut d_out = g.stream.clone_htod(&vec![0xA5u8; want.len()]).unwrap();
        g.codec
            .encode(&g.stream, gpu_format(f), &d_in, &mut d_out, 0)
            .unwrap();
        let got = g.stream.clone_dtoh(&d_out).unwrap();
        compare_encoded(&format!("encode of '{name}'"), 0, f, n, &input, &want, &got);
        let mut dec = vec![T::default(); n];
        cpu::decode(f, &want, n, &mut dec).unwrap();
        let d_enc = g.stream.clone_htod(&want).unwrap();
        let mut d_dec = g.stream.alloc_zeros::<T::D>(n).unwrap();
        g.codec
            .decode(&g.stream, gpu_format(f), &d_enc, &mut d_dec, None, 0)
            .unwrap();
        let got: Vec<T> = g
            .stream
            .clone_dtoh(&d_dec)
            .unwrap()
            .into_iter()
            .map(T::from_dev)
            .collect();
        if let Some(i) = (0..n).find(|&i| got[i].to_bits() != dec[i].to_bits()) {
            panic!(
                "decode of '{name}': format {f}, n {n}, value {i}: cpu {:#x}, gpu {:#x}",
                dec[i].to_bits(),
                got[i].to_bits()
            );
        }
        runs += 1;
    }
    runs
}

#[test]
fn mismatching_headers_are_reported() {
    let g = gpu();
    let f = Format::new(DType::Bf16, 4, 128, 2).unwrap();
    let n = 5000;
    let mut rng = Rng::new(base_seed());
    let input: Vec<bf16> = gen_values(&mut rng, n);
    let mut enc = cpu::encode_to_vec(f, &input).unwrap();
    // Block 2: wrong width; block 4: wrong nvalues. The tag word (bytes 0..4) is not checked.
    let bb = f.block_bytes();
    enc[2 * bb + 6] = 5;
    enc[4 * bb + 4] ^= 1;
    enc[bb] = 0x77;
    let d_enc = g.stream.clone_htod(&enc).unwrap();
    let sentinel = 0x1234u16;
    let mut d_out = g.stream.clone_htod(&vec![sentinel; n]).unwrap();
    let mut st = g.stream.clone_htod(&[0u32, u32::MAX]).unwrap();
    g.codec
        .decode(
            &g.stream,
            gpu_format(f),
            &d_enc,
            &mut d_out,
            Some(&mut st),
            0,
        )
        .unwrap();
    let status = CodecStatus::from_words(&g.stream.clone_dtoh(&st).unwrap());
    assert_eq!(
        status,
        CodecStatus {
            bad_blocks: 2,
            first_bad_block: 2
        }
    );
    let out = g.stream.clone_dtoh(&d_out).unwrap();
    assert!(
        out[2048..3072].iter().all(|&x| x == sentinel),
        "rejected block 2 was written"
    );
    assert!(
        out[4096..].iter().all(|&x| x == sentinel),
        "rejected block 4 was written"
    );
    assert!(
        out[1024..2048].iter().any(|&x| x != sentinel),
        "block 1 (only its tag changed) was not decoded"
    );
    println!("mismatching headers: 2 of 5 blocks rejected and left alone, as expected");
}
