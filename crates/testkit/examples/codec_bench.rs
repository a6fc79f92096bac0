//! Throughput and latency of the codec kernels on one GPU.
//!
//! ```text
//! cargo run --release -p flashcomm-testkit --features gpu --example codec_bench -- OUT.json [--quick]
//! ```
//!
//! Large buffers (64 MiB and 256 MiB of bf16 input): encode (quantize), decode (dequantize) and
//! the fused reduce_requantize with N = 2 and N = 8 inputs, for every width 2..8 with group 128
//! and 2 spikes, plus 4-bit rows with 0 and 4 spikes and with direct (unstaged) I/O. Each is timed
//! with CUDA events around single launches (median of 25 after 3 warm-ups, L2 flushed before each)
//! and reported as GB/s of bytes read plus written, and as a fraction of a device-to-device copy
//! of the bf16 input (cuMemcpyDtoDAsync, read + written) measured in the same run.
//!
//! Small buffers (16 KiB to 1 MiB of bf16): latency per call in microseconds, from a CUDA graph
//! of 100 back-to-back launches (best of 10 graph runs).
//!
//! The table goes to stdout, everything to OUT.json.

use std::fmt::Write as _;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use flashcomm_testkit::codec::{Codec, CodecDtype, CodecFormat, FLAG_DIRECT_IO};

const WARMUP: usize = 3;
const REPS: usize = 25;
const GRAPH_LAUNCHES: usize = 100;
const GRAPH_RUNS: usize = 10;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Bench {
    stream: Arc<CudaStream>,
    codec: Codec,
    flush: CudaSlice<u8>,
}

impl Bench {
    fn event(&self) -> Res<cudarc::driver::CudaEvent> {
        Ok(self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// Median time in ms of `f` over REPS launches after WARMUP, L2 flushed before each.
    fn time(&mut self, mut f: impl FnMut(&Self) -> Res<()>) -> Res<f64> {
        for _ in 0..WARMUP {
            f(self)?;
        }
        let mut times = Vec::with_capacity(REPS);
        for _ in 0..REPS {
            self.stream.memset_zeros(&mut self.flush)?;
            let a = self.event()?;
            f(self)?;
            let b = self.event()?;
            times.push(f64::from(a.elapsed_ms(&b)?));
        }
        times.sort_by(f64::total_cmp);
        Ok(times[REPS / 2])
    }

    /// Best per-launch time in µs of `f` launched GRAPH_LAUNCHES times inside a CUDA graph.
    fn latency(&self, f: impl Fn(&Self) -> Res<()>) -> Res<f64> {
        f(self)?; // first use: module and attribute set-up outside the capture
        self.stream.synchronize()?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        for _ in 0..GRAPH_LAUNCHES {
            f(self)?;
        }
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))?
            .ok_or("empty graph")?;
        graph.upload()?;
        graph.launch()?;
        self.stream.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..GRAPH_RUNS {
            let a = self.event()?;
            graph.launch()?;
            let b = self.event()?;
            best = best.min(f64::from(a.elapsed_ms(&b)?));
        }
        Ok(best * 1000.0 / GRAPH_LAUNCHES as f64)
    }
}

/// bf16 bits of roughly Gaussian values with a spike in about one group in four.
fn bf16_input(n: usize) -> Vec<u16> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = |k: u32| ((s >> k) & 0xffff) as f32 / 65536.0;
            let mut x = (u(0) + u(16) + u(32) + u(48) - 2.0) * 1.7;
            if i % 512 == 137 {
                x *= 40.0;
            }
            (x.to_bits() >> 16) as u16
        })
        .collect()
}

struct Row {
    op: &'static str,
    fmt: CodecFormat,
    flags: u32,
    mib: usize,
    bytes: f64,
    ms: f64,
    copy_gbs: f64,
}

impl Row {
    fn gbs(&self) -> f64 {
        self.bytes / self.ms / 1e6
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out_path = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .ok_or("usage: codec_bench OUT.json [--quick]")?
        .clone();
    let quick = args.iter().any(|a| a == "--quick");

    let ctx = CudaContext::new(0)?;
    let name = ctx.name()?;
    ffi::single_stream(&ctx);
    // A stream of its own: the legacy default stream cannot be captured into a graph.
    let stream = ctx.new_stream()?;
    let codec = Codec::new(&ctx)?;
    let flush = stream.alloc_zeros::<u8>(256 << 20)?;
    let mut bench = Bench {
        stream: stream.clone(),
        codec,
        flush,
    };
    println!("device: {name}, {} SMs", bench.codec.multiprocessors());

    let sizes_mib: Vec<usize> = if quick { vec![64] } else { vec![64, 256] };
    let mut rows: Vec<Row> = Vec::new();
    let mut copies: Vec<(usize, f64, f64)> = Vec::new();
    for &mib in &sizes_mib {
        let n = (mib << 20) / 2;
        let host = bf16_input(n);
        let input: CudaSlice<u16> = stream.clone_htod(&host)?;
        let mut copy_dst = stream.alloc_zeros::<u16>(n)?;
        let copy_ms = bench.time(|b| Ok(b.stream.memcpy_dtod(&input, &mut copy_dst)?))?;
        let copy_bytes = 2.0 * (mib << 20) as f64;
        let copy_gbs = copy_bytes / copy_ms / 1e6;
        copies.push((mib, copy_ms, copy_gbs));
        drop(copy_dst);
        println!("\n{mib} MiB bf16: device-to-device copy {copy_gbs:.0} GB/s (read + written)");

        let mut configs: Vec<(CodecFormat, u32)> = Vec::new();
        for bits in 2..=8u8 {
            configs.push((CodecFormat::new(CodecDtype::Bf16, bits, 128, 2)?, 0));
        }
        let b4 = |k| CodecFormat::new(CodecDtype::Bf16, 4, 128, k);
        configs.push((b4(0)?, 0));
        configs.push((b4(4)?, 0));
        configs.push((b4(2)?, FLAG_DIRECT_IO));
        for (fmt, flags) in configs {
            let enc_len = fmt.encoded_len(n);
            let mut enc: Vec<CudaSlice<u8>> = Vec::new();
            for _ in 0..8 {
                let mut e = stream.alloc_zeros::<u8>(enc_len)?;
                bench.codec.encode(&stream, fmt, &input, &mut e, 0)?;
                enc.push(e);
            }
            let mut out_enc = stream.alloc_zeros::<u8>(enc_len)?;
            let mut out_vals = stream.alloc_zeros::<u16>(n)?;
            let ms = bench.time(|b| {
                Ok(b.codec
                    .encode(&b.stream, fmt, &input, &mut out_enc, flags)?)
            })?;
            rows.push(Row {
                op: "encode",
                fmt,
                flags,
                mib,
                bytes: (2 * n + enc_len) as f64,
                ms,
                copy_gbs,
            });
            let ms = bench.time(|b| {
                Ok(b.codec
                    .decode(&b.stream, fmt, &enc[0], &mut out_vals, None, flags)?)
            })?;
            rows.push(Row {
                op: "decode",
                fmt,
                flags,
                mib,
                bytes: (2 * n + enc_len) as f64,
                ms,
                copy_gbs,
            });
            if flags == 0 || fmt.bits() == 4 && fmt.spikes() == 2 {
                for nin in [2usize, 8] {
                    let refs: Vec<&CudaSlice<u8>> = enc.iter().take(nin).collect();
                    let table = bench.codec.input_table(&stream, &refs)?;
                    let ms = bench.time(|b| {
                        Ok(b.codec.reduce_requantize(
                            &b.stream,
                            fmt,
                            &table,
                            fmt,
                            n,
                            &mut out_enc,
                            None,
                            flags,
                        )?)
                    })?;
                    rows.push(Row {
                        op: if nin == 2 {
                            "reduce_requantize N=2"
                        } else {
                            "reduce_requantize N=8"
                        },
                        fmt,
                        flags,
                        mib,
                        bytes: ((nin + 1) * enc_len) as f64,
                        ms,
                        copy_gbs,
                    });
                }
            }
            for r in rows
                .iter()
                .filter(|r| r.mib == mib && r.fmt == fmt && r.flags == flags)
            {
                println!(
                    "  {:<24} {:<16} {:<7} {:>9.3} ms {:>7.0} GB/s {:>6.1}% of copy",
                    r.op,
                    r.fmt.to_string(),
                    if r.flags & FLAG_DIRECT_IO != 0 {
                        "direct"
                    } else {
                        "staged"
                    },
                    r.ms,
                    r.gbs(),
                    100.0 * r.gbs() / r.copy_gbs
                );
            }
        }
    }

    // Latency of small calls, 4 bits, group 128, 2 spikes.
    let fmt = CodecFormat::new(CodecDtype::Bf16, 4, 128, 2)?;
    let mut lat: Vec<(usize, &'static str, f64)> = Vec::new();
    println!("\nlatency per call (CUDA graph of {GRAPH_LAUNCHES} launches), {fmt}:");
    for kib in [16usize, 64, 256, 1024] {
        let n = (kib << 10) / 2;
        let input: CudaSlice<u16> = stream.clone_htod(&bf16_input(n))?;
        let enc_len = fmt.encoded_len(n);
        let mut enc: Vec<CudaSlice<u8>> = Vec::new();
        for _ in 0..8 {
            let mut e = stream.alloc_zeros::<u8>(enc_len)?;
            bench.codec.encode(&stream, fmt, &input, &mut e, 0)?;
            enc.push(e);
        }
        let out_enc = std::cell::RefCell::new(stream.alloc_zeros::<u8>(enc_len)?);
        let out_vals = std::cell::RefCell::new(stream.alloc_zeros::<u16>(n)?);
        let us = bench.latency(|b| {
            Ok(b.codec
                .encode(&b.stream, fmt, &input, &mut out_enc.borrow_mut(), 0)?)
        })?;
        lat.push((kib, "encode", us));
        let us = bench.latency(|b| {
            Ok(b.codec
                .decode(&b.stream, fmt, &enc[0], &mut out_vals.borrow_mut(), None, 0)?)
        })?;
        lat.push((kib, "decode", us));
        for nin in [2usize, 8] {
            let refs: Vec<&CudaSlice<u8>> = enc.iter().take(nin).collect();
            let table = bench.codec.input_table(&stream, &refs)?;
            stream.synchronize()?;
            let us = bench.latency(|b| {
                Ok(b.codec.reduce_requantize(
                    &b.stream,
                    fmt,
                    &table,
                    fmt,
                    n,
                    &mut out_enc.borrow_mut(),
                    None,
                    0,
                )?)
            })?;
            lat.push((
                kib,
                if nin == 2 {
                    "reduce_requantize N=2"
                } else {
                    "reduce_requantize N=8"
                },
                us,
            ));
        }
        for (k, op, us) in lat.iter().filter(|l| l.0 == kib) {
            println!("  {k:>5} KiB  {op:<24} {us:>7.2} us");
        }
    }

    // JSON.
    let mut j = String::new();
    writeln!(j, "{{")?;
    writeln!(j, "  \"device\": {:?},", name)?;
    writeln!(
        j,
        "  \"multiprocessors\": {},",
        bench.codec.multiprocessors()
    )?;
    writeln!(
        j,
        "  \"repetitions\": {{\"warmup\": {WARMUP}, \"timed\": {REPS}, \"statistic\": \"median\"}},"
    )?;
    writeln!(j, "  \"copy\": [")?;
    for (i, (mib, ms, gbs)) in copies.iter().enumerate() {
        let sep = if i + 1 < copies.len() { "," } else { "" };
        writeln!(
            j,
            "    {{\"mib\": {mib}, \"ms\": {ms:.6}, \"gb_per_s\": {gbs:.3}}}{sep}"
        )?;
    }
    writeln!(j, "  ],")?;
    writeln!(j, "  \"throughput\": [")?;
    for (i, r) in rows.iter().enumerate() {
        let sep = if i + 1 < rows.len() { "," } else { "" };
        writeln!(
            j,
            "    {{\"op\": {:?}, \"format\": {:?}, \"io\": {:?}, \"input_mib\": {}, \"bytes\": {}, \"ms\": {:.6}, \"gb_per_s\": {:.3}, \"fraction_of_copy\": {:.4}}}{sep}",
            r.op,
            r.fmt.to_string(),
            if r.flags & FLAG_DIRECT_IO != 0 {
                "direct"
            } else {
                "staged"
            },
            r.mib,
            r.bytes,
            r.ms,
            r.gbs(),
            r.gbs() / r.copy_gbs
        )?;
    }
    writeln!(j, "  ],")?;
    writeln!(j, "  \"latency\": [")?;
    for (i, (kib, op, us)) in lat.iter().enumerate() {
        let sep = if i + 1 < lat.len() { "," } else { "" };
        writeln!(
            j,
            "    {{\"op\": {op:?}, \"format\": {:?}, \"input_kib\": {kib}, \"us_per_call\": {us:.3}}}{sep}",
            fmt.to_string()
        )?;
    }
    writeln!(j, "  ]")?;
    writeln!(j, "}}")?;
    std::fs::write(&out_path, j)?;
    println!("\nwrote {out_path}");
    Ok(())
}

mod ffi {
    use std::sync::Arc;

    use cudarc::driver::CudaContext;

    /// Turns off cudarc's per-slice event tracking, which would make captured launches wait on
    /// events recorded outside the capture (and so invalidate it).
    pub fn single_stream(ctx: &Arc<CudaContext>) {
        // SAFETY: this program uses exactly one stream: every slice is allocated, used and freed
        // on it, so no cross-stream synchronization is needed.
        unsafe { ctx.disable_event_tracking() };
    }
}
