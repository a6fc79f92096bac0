//! Launchers of the codec kernels: raw (device pointers, `unsafe`) and over cudarc slices (safe:
//! sizes and alignment are checked, pointers come from live slices on the launch stream).
//!
//! The crate's FFI module: its only `unsafe` code.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use flashcomm_gpu::{Function, LaunchConfig};
use flashcomm_kernels::Error;

use crate::TestKernels as Kernels;
use crate::codec::{
    CodecDtype, CodecFormat, CodecOp, CodecStatus, DecodeParams, EncodeParams, FLAG_DIRECT_IO,
    ReduceParams, THREADS, WARPS, kernel_name, reduce_one_cta_kernel_name, smem_per_warp,
};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u16 {}
}

/// Host-side storage of codec values: `f32` for f32 data, `u16` (the raw bits) for f16 and bf16.
pub trait CodecValue: sealed::Sealed + cudarc::driver::DeviceRepr {
    /// Bytes per value.
    const SIZE: usize;
}
impl CodecValue for f32 {
    const SIZE: usize = 4;
}
impl CodecValue for u16 {
    const SIZE: usize = 2;
}

/// The codec kernels of one CUDA context.
pub struct Codec {
    kernels: Arc<Kernels>,
    sms: u32,
    /// Largest dynamic shared memory one CTA may opt in to.
    smem_optin: u32,
    /// (function name, dynamic smem) -> (function, max resident CTAs per SM).
    cache: Mutex<HashMap<(String, u32), (Function, u32)>>,
    /// Function name -> the dynamic shared memory limit set on it (only ever raised: the
    /// attribute belongs to the function, and launches of other sizes must stay valid).
    smem_limit: Mutex<HashMap<String, u32>>,
}

fn cuda_err(during: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| {
        Error::Cuda(flashcomm_gpu::Error::Cuda {
            during,
            detail: format!("{e:?}"),
        })
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn check_aligned(ptr: u64, what: &str) -> Result<(), Error> {
    if ptr.is_multiple_of(16) {
        Ok(())
    } else {
        Err(invalid(format!("{what} must be 16-byte aligned")))
    }
}

impl Codec {
    /// Loads the kernels into `ctx` (made current on this thread).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Codec, Error> {
        ctx.bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let kernels = Kernels::for_context(ctx.cu_ctx())?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("querying the multiprocessor count"))?;
        let smem_optin = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(cuda_err("querying the shared memory limit"))?;
        Ok(Codec {
            kernels,
            sms: sms.max(1) as u32,
            smem_optin: smem_optin.max(0) as u32,
            cache: Mutex::new(HashMap::new()),
            smem_limit: Mutex::new(HashMap::new()),
        })
    }

    /// Multiprocessors of the device.
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// The function, launch geometry and effective flags for `op` over `n` values: one warp per
    /// block, at most as many CTAs as fit on the GPU at once (each warp then loops over blocks).
    /// `in_block_bytes` and `ninputs` size the staged input of decode and reduce_requantize; when
    /// the staging would not fit in shared memory the launch uses direct I/O instead (the result is
    /// the same, bit for bit).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_config(
        &self,
        op: CodecOp,
        dtype: CodecDtype,
        bits: u8,
        n: u64,
        flags: u32,
        in_block_bytes: u32,
        ninputs: u32,
    ) -> Result<(Function, LaunchConfig, u32), Error> {
        let name = kernel_name(op, dtype, bits);
        let mut flags = flags;
        let mut smem = WARPS * smem_per_warp(op, dtype, flags, in_block_bytes, ninputs);
        if smem > self.smem_optin && flags & FLAG_DIRECT_IO == 0 {
            flags |= FLAG_DIRECT_IO;
            smem = WARPS * smem_per_warp(op, dtype, flags, in_block_bytes, ninputs);
        }
        let lookup = |name: String| -> Result<(Function, u32), Error> {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(v) = cache.get(&(name.clone(), smem)) {
                return Ok(*v);
            }
            let f = self.kernels.function(&name)?;
            if smem > 48 * 1024 {
                let mut limits = self.smem_limit.lock().unwrap_or_else(|e| e.into_inner());
                let limit = limits.entry(name.clone()).or_insert(0);
                if smem > *limit {
                    f.set_max_dynamic_smem(smem)?;
                    *limit = smem;
                }
            }
            let per_sm = f.max_active_blocks_per_sm(THREADS, smem as usize)?.max(1);
            cache.insert((name, smem), (f, per_sm));
            Ok((f, per_sm))
        };
        let blocks = n.div_ceil(crate::codec::BLOCK_VALUES as u64);
        let (mut f, mut per_sm) = lookup(name)?;
        // The fused reduce is compiled for 2 CTAs per SM (128 registers, a few spilled words) and
        // for 1 (no register cap, no spills). The second is faster where shared memory admits only
        // one CTA anyway, and where one CTA per SM already gives every block its own warp.
        if op == CodecOp::ReduceRequantize
            && (per_sm < 2 || blocks <= u64::from(self.sms) * u64::from(WARPS))
        {
            (f, per_sm) = lookup(reduce_one_cta_kernel_name(dtype, bits))?;
        }
        let ctas = blocks.div_ceil(u64::from(WARPS)).max(1);
        let grid = ctas.min(u64::from(self.sms) * u64::from(per_sm)) as u32;
        Ok((
            f,
            LaunchConfig {
                grid,
                block: THREADS,
                smem,
            },
            flags,
        ))
    }

    /// Launches encode: `n` values at `input` (format's dtype) into `fmt.encoded_len(n)` bytes at
    /// `output`.
    ///
    /// # Safety
    /// `input` and `output` must be 16-byte aligned device pointers of the current context, valid
    /// for `n` values and `fmt.encoded_len(n)` bytes until the kernel has finished; `stream`
    /// belongs to the context.
    pub unsafe fn encode_raw(
        &self,
        stream: sys::CUstream,
        fmt: CodecFormat,
        input: u64,
        output: u64,
        n: u64,
        flags: u32,
    ) -> Result<(), Error> {
        let (f, cfg, flags) =
            self.launch_config(CodecOp::Encode, fmt.dtype(), fmt.bits(), n, flags, 0, 0)?;
        let p = EncodeParams {
            input,
            output,
            n,
            group: u32::from(fmt.group()),
            spikes: u32::from(fmt.spikes()),
            flags,
            reserved: 0,
        };
        // SAFETY: EncodeParams mirrors FcCodecEncodeParams (sizes asserted on both sides); the
        // caller guarantees the pointers and the stream.
        unsafe { flashcomm_gpu::launch(f, cfg, flashcomm_gpu::Stream(stream), &p) }
            .map_err(Error::from)
    }

    /// Launches decode (`accumulate` false: T values at `output`) or decode_accumulate (`true`:
    /// f32 accumulators at `output`, read and written).
    ///
    /// # Safety
    /// `input` (`fmt.encoded_len(n)` bytes) and `output` (`n` values) must be 16-byte aligned
    /// device pointers of the current context, valid until the kernel has finished; `status` is 0
    /// or a device pointer to a [`CodecStatus`]; `stream` belongs to the context.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode_raw(
        &self,
        stream: sys::CUstream,
        fmt: CodecFormat,
        accumulate: bool,
        input: u64,
        output: u64,
        n: u64,
        status: u64,
        flags: u32,
    ) -> Result<(), Error> {
        let op = if accumulate {
            CodecOp::DecodeAccumulate
        } else {
            CodecOp::Decode
        };
        let (f, cfg, flags) = self.launch_config(
            op,
            fmt.dtype(),
            fmt.bits(),
            n,
            flags,
            fmt.block_bytes() as u32,
            1,
        )?;
        let p = DecodeParams {
            input,
            output,
            n,
            status,
            group: u32::from(fmt.group()),
            spikes: u32::from(fmt.spikes()),
            flags,
            reserved: 0,
        };
        // SAFETY: DecodeParams mirrors FcCodecDecodeParams; the caller guarantees the pointers.
        unsafe { flashcomm_gpu::launch(f, cfg, flashcomm_gpu::Stream(stream), &p) }
            .map_err(Error::from)
    }

    /// Launches reduce_requantize: `ninputs` encoded buffers (format `fmt_in`) whose device
    /// pointers are the u64 array at `inputs`, into `output` (format `fmt_out`, same dtype).
    ///
    /// # Safety
    /// `inputs` must point to `ninputs` device pointers, each to `fmt_in.encoded_len(n)` bytes;
    /// `output` to `fmt_out.encoded_len(n)` bytes; all 16-byte aligned, of the current context and
    /// valid until the kernel has finished; `status` is 0 or a device [`CodecStatus`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_requantize_raw(
        &self,
        stream: sys::CUstream,
        fmt_in: CodecFormat,
        fmt_out: CodecFormat,
        inputs: u64,
        ninputs: u32,
        output: u64,
        n: u64,
        status: u64,
        flags: u32,
    ) -> Result<(), Error> {
        if fmt_in.dtype() != fmt_out.dtype() || ninputs == 0 {
            return Err(invalid(format!(
                "reduce_requantize needs one dtype and at least one input ({fmt_in} -> {fmt_out}, {ninputs} inputs)"
            )));
        }
        let (f, cfg, flags) = self.launch_config(
            CodecOp::ReduceRequantize,
            fmt_out.dtype(),
            fmt_out.bits(),
            n,
            flags,
            fmt_in.block_bytes() as u32,
            ninputs,
        )?;
        let p = ReduceParams {
            inputs,
            output,
            n,
            status,
            ninputs,
            in_bits: u32::from(fmt_in.bits()),
            in_group: u32::from(fmt_in.group()),
            in_spikes: u32::from(fmt_in.spikes()),
            out_group: u32::from(fmt_out.group()),
            out_spikes: u32::from(fmt_out.spikes()),
            flags,
            reserved: 0,
        };
        // SAFETY: ReduceParams mirrors FcCodecReduceParams; the caller guarantees the pointers.
        unsafe { flashcomm_gpu::launch(f, cfg, flashcomm_gpu::Stream(stream), &p) }
            .map_err(Error::from)
    }

    /// Encodes `input` (all of it) into `output`, which must hold exactly
    /// `fmt.encoded_len(input.len())` bytes.
    pub fn encode<E: CodecValue>(
        &self,
        stream: &Arc<CudaStream>,
        fmt: CodecFormat,
        input: &CudaSlice<E>,
        output: &mut CudaSlice<u8>,
        flags: u32,
    ) -> Result<(), Error> {
        check_value_type::<E>(fmt)?;
        let n = input.len();
        check_len("encoded output", fmt.encoded_len(n), output.len())?;
        if n == 0 {
            return Ok(());
        }
        let (inp, _r) = input.device_ptr(stream);
        let (out, _w) = output.device_ptr_mut(stream);
        check_aligned(inp, "input")?;
        check_aligned(out, "output")?;
        // SAFETY: both slices are live allocations of the stream's context with the checked sizes;
        // cudarc keeps them alive (and orders their reuse) on this stream.
        unsafe { self.encode_raw(stream.cu_stream(), fmt, inp, out, n as u64, flags) }
    }

    /// Decodes `input` (`fmt.encoded_len(output.len())` bytes) into `output`. Blocks whose header
    /// does not match are skipped and counted in `status` when given.
    pub fn decode<E: CodecValue>(
        &self,
        stream: &Arc<CudaStream>,
        fmt: CodecFormat,
        input: &CudaSlice<u8>,
        output: &mut CudaSlice<E>,
        status: Option<&mut CudaSlice<CodecStatusWords>>,
        flags: u32,
    ) -> Result<(), Error> {
        check_value_type::<E>(fmt)?;
        let n = output.len();
        check_len("encoded input", fmt.encoded_len(n), input.len())?;
        if n == 0 {
            return Ok(());
        }
        let (inp, _r) = input.device_ptr(stream);
        let (out, _w) = output.device_ptr_mut(stream);
        let (st, _s) = status_ptr(status, stream)?;
        check_aligned(inp, "input")?;
        check_aligned(out, "output")?;
        // SAFETY: live slices with checked sizes on this stream (see encode).
        unsafe {
            self.decode_raw(
                stream.cu_stream(),
                fmt,
                false,
                inp,
                out,
                n as u64,
                st,
                flags,
            )
        }
    }

    /// Decodes `input` and adds it into the f32 accumulators `acc` (`acc[i] = acc[i] + v[i]`).
    pub fn decode_accumulate(
        &self,
        stream: &Arc<CudaStream>,
        fmt: CodecFormat,
        input: &CudaSlice<u8>,
        acc: &mut CudaSlice<f32>,
        status: Option<&mut CudaSlice<CodecStatusWords>>,
    ) -> Result<(), Error> {
        let n = acc.len();
        check_len("encoded input", fmt.encoded_len(n), input.len())?;
        if n == 0 {
            return Ok(());
        }
        let (inp, _r) = input.device_ptr(stream);
        let (out, _w) = acc.device_ptr_mut(stream);
        let (st, _s) = status_ptr(status, stream)?;
        check_aligned(inp, "input")?;
        check_aligned(out, "accumulators")?;
        // SAFETY: live slices with checked sizes on this stream (see encode).
        unsafe { self.decode_raw(stream.cu_stream(), fmt, true, inp, out, n as u64, st, 0) }
    }

    /// A device table of the inputs' pointers for [`Codec::reduce_requantize`], copied on
    /// `stream`. The table borrows the inputs, so they outlive it.
    pub fn input_table<'a>(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &[&'a CudaSlice<u8>],
    ) -> Result<InputTable<'a>, Error> {
        if inputs.is_empty() {
            return Err(invalid("reduce_requantize needs at least one input".into()));
        }
        let mut ptrs = Vec::with_capacity(inputs.len());
        for input in inputs {
            let (p, _g) = input.device_ptr(stream);
            check_aligned(p, "input")?;
            ptrs.push(p);
        }
        let table = stream
            .clone_htod(&ptrs)
            .map_err(cuda_err("copying the input pointers"))?;
        Ok(InputTable {
            table,
            inputs: inputs.to_vec(),
        })
    }

    /// The fused reduce step over `n` values: decodes every input of `table` (format `fmt_in`)
    /// in order, accumulates in f32, rounds to the dtype and encodes with `fmt_out` into `output`.
    /// `flags`: 0 (inputs prefetched through shared memory) or [`FLAG_DIRECT_IO`].
    /// Launches only (no copies), so it can be captured into a CUDA graph.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_requantize(
        &self,
        stream: &Arc<CudaStream>,
        fmt_in: CodecFormat,
        table: &InputTable<'_>,
        fmt_out: CodecFormat,
        n: usize,
        output: &mut CudaSlice<u8>,
        status: Option<&mut CudaSlice<CodecStatusWords>>,
        flags: u32,
    ) -> Result<(), Error> {
        check_len("encoded output", fmt_out.encoded_len(n), output.len())?;
        for input in &table.inputs {
            check_len("encoded input", fmt_in.encoded_len(n), input.len())?;
        }
        if n == 0 {
            return Ok(());
        }
        let (pp, _p) = table.table.device_ptr(stream);
        let (out, _w) = output.device_ptr_mut(stream);
        let (st, _s) = status_ptr(status, stream)?;
        check_aligned(out, "output")?;
        // SAFETY: the table holds the device pointers of live input slices (borrowed by it) with
        // checked sizes, copied on this stream before any launch that uses it.
        unsafe {
            self.reduce_requantize_raw(
                stream.cu_stream(),
                fmt_in,
                fmt_out,
                pp,
                table.inputs.len() as u32,
                out,
                n as u64,
                st,
                flags,
            )
        }
    }
}

/// Device pointers of the inputs of a reduce step (see [`Codec::input_table`]).
pub struct InputTable<'a> {
    table: CudaSlice<u64>,
    inputs: Vec<&'a CudaSlice<u8>>,
}

impl InputTable<'_> {
    /// Number of inputs.
    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Whether the table is empty (never: tables have at least one input).
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }
}

/// Device storage of a [`CodecStatus`]: two u32 words (`bad_blocks`, `first_bad_block`).
pub type CodecStatusWords = u32;

impl CodecStatus {
    /// Reads a status from its two device words.
    pub fn from_words(w: &[u32]) -> CodecStatus {
        CodecStatus {
            bad_blocks: w[0],
            first_bad_block: w[1],
        }
    }
}

fn status_ptr<'a>(
    status: Option<&'a mut CudaSlice<u32>>,
    stream: &'a Arc<CudaStream>,
) -> Result<(u64, Option<cudarc::driver::SyncOnDrop<'a>>), Error> {
    match status {
        None => Ok((0, None)),
        Some(s) => {
            if s.len() < 2 {
                return Err(invalid("status needs 2 u32 words".into()));
            }
            let (p, g) = s.device_ptr_mut(stream);
            Ok((p, Some(g)))
        }
    }
}

fn check_value_type<E: CodecValue>(fmt: CodecFormat) -> Result<(), Error> {
    if E::SIZE == fmt.dtype().size() {
        Ok(())
    } else {
        Err(invalid(format!(
            "format {fmt} needs {}-byte values, got {}-byte ones",
            fmt.dtype().size(),
            E::SIZE
        )))
    }
}

fn check_len(what: &str, expected: usize, actual: usize) -> Result<(), Error> {
    if expected == actual {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what} has {actual} elements, expected {expected}"
        )))
    }
}

/// The parameter blocks of the verification kernels of [`crate::verify`] (layouts asserted
/// against `cuda/testing/verify.cu` there).
pub(crate) trait TestParams: Copy {}

/// Launches a verification kernel found by name.
///
/// Sound because `P` is the `#[repr(C)]` mirror of the named kernel's parameter (the callers in
/// `verify` pair them), and the buffers in it are
/// [`flashcomm_gpu::DevicePtr`]s of live allocations.
pub(crate) fn launch_test<P: TestParams>(
    f: Function,
    cfg: LaunchConfig,
    stream: flashcomm_gpu::Stream,
    params: &P,
) -> Result<(), flashcomm_comm::Error> {
    // SAFETY: see the function's documentation.
    unsafe { flashcomm_gpu::launch(f, cfg, stream, params) }.map_err(flashcomm_comm::Error::from)
}
