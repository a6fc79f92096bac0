//! Device-side verification for the GPU tests and the benchmark tool (`cuda/testing/verify.cu`):
//! integer-valued inputs whose collective results are exact in every supported type and can be
//! recomputed from indices on the device, so sweeps up to hundreds of MiB check every element
//! without copying anything back.

use std::sync::Arc;

use flashcomm_comm::gpu::{Device, DeviceMem, DevicePtr, LaunchConfig, Stream};
use flashcomm_comm::{Collective, DataType, Error};

use crate::TestKernels as Kernels;

/// Element types the verification kernels know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestType {
    /// binary32
    F32,
    /// binary16
    F16,
    /// bfloat16
    Bf16,
    /// bytes (AllGather only)
    U8,
}

impl TestType {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            TestType::F32 => 4,
            TestType::F16 | TestType::Bf16 => 2,
            TestType::U8 => 1,
        }
    }

    fn code(self) -> u32 {
        match self {
            TestType::F32 => 0,
            TestType::F16 => 1,
            TestType::Bf16 => 2,
            TestType::U8 => 3,
        }
    }

    /// The reducing datatype, if any.
    pub fn dtype(self) -> Option<DataType> {
        match self {
            TestType::F32 => Some(DataType::F32),
            TestType::F16 => Some(DataType::F16),
            TestType::Bf16 => Some(DataType::Bf16),
            TestType::U8 => None,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestFill {
    buf: u64,
    n: u64,
    dtype: u32,
    rank: u32,
    salt: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestCheck {
    out: u64,
    n: u64,
    chunk: u64,
    errors: u64,
    kind: u32,
    dtype: u32,
    nranks: u32,
    rank: u32,
    salt: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestCompare {
    a: u64,
    b: u64,
    n: u64,
    errors: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestHold {
    ns: u64,
    pad: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestWaitCount {
    out: u64,
}

/// `fc_test_sum`: the copy-engine schedule's reduction in the GPU tests.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestSum {
    src: [u64; 8],
    dst: u64,
    n: u64,
    nsrc: u32,
    dtype: u32,
}

/// `fc_test_ping_pong`: one round trip of a flag through pinned host memory.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FcTestPingPong {
    host: u64,
    epoch: u64,
    fail: u64,
    timeout_ns: u64,
}

const _: () = {
    assert!(std::mem::size_of::<FcTestPingPong>() == 32);
    assert!(std::mem::size_of::<FcTestSum>() == 88);
    assert!(std::mem::size_of::<FcTestHold>() == 16);
    assert!(std::mem::size_of::<FcTestWaitCount>() == 8);
    assert!(std::mem::size_of::<FcTestFill>() == 32);
    assert!(std::mem::size_of::<FcTestCheck>() == 56);
    assert!(std::mem::size_of::<FcTestCompare>() == 32);
};

impl crate::codec_launch::TestParams for FcTestSum {}
impl crate::codec_launch::TestParams for FcTestPingPong {}
impl crate::codec_launch::TestParams for FcTestFill {}
impl crate::codec_launch::TestParams for FcTestCheck {}
impl crate::codec_launch::TestParams for FcTestCompare {}
impl crate::codec_launch::TestParams for FcTestHold {}
impl crate::codec_launch::TestParams for FcTestWaitCount {}

const GRID: u32 = 264;
const BLOCK: u32 = 256;

/// Fills, checks and compares buffers on one device, accumulating mismatches in device memory.
pub struct Verifier {
    device: Arc<Device>,
    kernels: Arc<Kernels>,
    errors: DeviceMem,
    stream: Stream,
}

impl Verifier {
    /// A verifier on CUDA device `device`.
    pub fn new(device: i32) -> Result<Verifier, Error> {
        let device = Device::open(device)?;
        let _ctx = device.activate()?;
        let kernels = Kernels::for_context(device.context())?;
        // Found now, before any collective spins: a lookup is then a map read.
        for name in [
            "fc_test_fill",
            "fc_test_check",
            "fc_test_compare",
            "fc_test_hold",
            "fc_test_wait_count",
            "fc_test_sum",
            "fc_test_ping_pong",
        ] {
            kernels.function(name)?;
        }
        let errors = DeviceMem::alloc_zeroed(&device, 16)?;
        let stream = Stream::create()?;
        let v = Verifier {
            device,
            kernels,
            errors,
            stream,
        };
        v.reset()?;
        Ok(v)
    }

    fn launch<P: crate::codec_launch::TestParams>(
        &self,
        name: &str,
        stream: Stream,
        p: &P,
    ) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        let f = self.kernels.function(name)?;
        crate::codec_launch::launch_test(
            f,
            LaunchConfig {
                grid: GRID,
                block: BLOCK,
                smem: 0,
            },
            stream,
            p,
        )
    }

    /// Enqueues `dst[i] = srcs[0][i] + srcs[1][i] + ...` for `n` elements (in f32, in the order
    /// given, rounded once): the reduction of the copy-engine schedule's GPU tests. `dst` may be
    /// one of the sources.
    pub fn sum(
        &self,
        srcs: &[DevicePtr],
        dst: DevicePtr,
        n: u64,
        ty: TestType,
        stream: Stream,
    ) -> Result<(), Error> {
        assert!((1..=8).contains(&srcs.len()) && ty != TestType::U8);
        assert!(
            srcs.iter().chain([&dst]).all(|b| n * ty.bytes() <= b.len()),
            "sum out of bounds"
        );
        let mut p = FcTestSum {
            dst: dst.addr(),
            n,
            nsrc: srcs.len() as u32,
            dtype: ty.code(),
            ..FcTestSum::default()
        };
        for (d, s) in p.src.iter_mut().zip(srcs) {
            *d = s.addr();
        }
        self.launch("fc_test_sum", stream, &p)
    }

    /// Writes value(rank, i, salt) into the `n` elements at `buf`.
    pub fn fill(
        &self,
        buf: DevicePtr,
        n: u64,
        ty: TestType,
        rank: u32,
        salt: u32,
        stream: Stream,
    ) -> Result<(), Error> {
        assert!(n * ty.bytes() <= buf.len(), "fill out of bounds");
        let p = FcTestFill {
            buf: buf.addr(),
            n,
            dtype: ty.code(),
            rank,
            salt,
            pad: 0,
        };
        self.launch("fc_test_fill", stream, &p)
    }

    /// Checks the `n` output elements at `out` of collective `coll` (for AllGather,
    /// ReduceScatter and AllToAll `chunk` is the per-rank count) against the exact result.
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &self,
        out: DevicePtr,
        n: u64,
        chunk: u64,
        coll: Collective,
        ty: TestType,
        nranks: u32,
        rank: u32,
        salt: u32,
        stream: Stream,
    ) -> Result<(), Error> {
        assert!(n * ty.bytes() <= out.len(), "check out of bounds");
        let kind = match coll {
            Collective::AllReduce => 0,
            Collective::AllGather => 1,
            Collective::ReduceScatter => 2,
            Collective::AlltoAll => 3,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "the verifier has no expectation for {other}"
                )));
            }
        };
        let p = FcTestCheck {
            out: out.addr(),
            n,
            chunk: chunk.max(1),
            errors: self.errors.addr(),
            kind,
            dtype: ty.code(),
            nranks,
            rank,
            salt,
            pad: 0,
        };
        self.launch("fc_test_check", stream, &p)
    }

    /// Counts differing bytes between `a` and `b` (first `n` bytes).
    pub fn compare(&self, a: DevicePtr, b: DevicePtr, n: u64, stream: Stream) -> Result<(), Error> {
        assert!(n <= a.len() && n <= b.len(), "compare out of bounds");
        let p = FcTestCompare {
            a: a.addr(),
            b: b.addr(),
            n,
            errors: self.errors.addr(),
        };
        self.launch("fc_test_compare", stream, &p)
    }

    /// (mismatches, first bad index) accumulated since the last reset (synchronizes the device).
    pub fn errors(&self) -> Result<(u64, u64), Error> {
        let _ctx = self.device.activate()?;
        let mut b = [0u8; 16];
        self.errors.download(0, &mut b, self.stream)?;
        Ok((
            u64::from_le_bytes(b[0..8].try_into().unwrap()),
            u64::from_le_bytes(b[8..16].try_into().unwrap()),
        ))
    }

    /// Clears the accumulated mismatches.
    pub fn reset(&self) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        let mut b = [0u8; 16];
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        Ok(self.errors.upload(0, &b, self.stream)?)
    }

    /// Launches `grid` blocks on `stream` that each hold their multiprocessor for `hold` (they
    /// delay the blocks of kernels launched after them on other streams, and everything after
    /// them on `stream`).
    pub fn hold(&self, hold: std::time::Duration, grid: u32, stream: Stream) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        let f = self.kernels.function("fc_test_hold")?;
        let p = FcTestHold {
            ns: hold.as_nanos().min(u64::MAX as u128) as u64,
            pad: 0,
        };
        crate::codec_launch::launch_test(
            f,
            LaunchConfig {
                grid: grid.max(1),
                block: 32,
                smem: 0,
            },
            stream,
            &p,
        )
    }

    /// Enqueues one round trip of a flag through pinned host memory (`fc_test_ping_pong`):
    /// `host`, two u32 words of pinned host memory (as the device addresses them); `state`, two
    /// u32 words of device memory (the calls so far, then a failure flag that a wait past
    /// `timeout` sets). Both zeroed before the first call and used by no one else.
    pub fn ping_pong(
        &self,
        host: DevicePtr,
        state: DevicePtr,
        timeout: std::time::Duration,
        stream: Stream,
    ) -> Result<(), Error> {
        if host.len() < 8 || state.len() < 8 {
            return Err(Error::InvalidArgument(
                "ping_pong needs two words of host memory and two of device memory".into(),
            ));
        }
        let _ctx = self.device.activate()?;
        let f = self.kernels.function("fc_test_ping_pong")?;
        let p = FcTestPingPong {
            host: host.addr(),
            epoch: state.addr(),
            fail: state.addr() + 4,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
        };
        crate::codec_launch::launch_test(
            f,
            LaunchConfig {
                grid: 2,
                block: 32,
                smem: 0,
            },
            stream,
            &p,
        )
    }

    /// The wait counter and epoch arithmetic of `flashcomm/wait_count.h` as the device runs it
    /// (see `fc_test_wait_count`): seven numbers.
    pub fn wait_count_on_device(&self) -> Result<[u32; 7], Error> {
        let _ctx = self.device.activate()?;
        let out = DeviceMem::alloc_zeroed(&self.device, 32)?;
        let f = self.kernels.function("fc_test_wait_count")?;
        let p = FcTestWaitCount { out: out.addr() };
        crate::codec_launch::launch_test(
            f,
            LaunchConfig {
                grid: 1,
                block: 32,
                smem: 0,
            },
            self.stream,
            &p,
        )?;
        let mut b = [0u8; 28];
        out.download(0, &mut b, self.stream)?;
        let mut v = [0u32; 7];
        for (i, x) in v.iter_mut().enumerate() {
            *x = u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
        }
        Ok(v)
    }

    /// Allocates device memory on this verifier's device.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceMem, Error> {
        Ok(DeviceMem::alloc_zeroed(&self.device, bytes)?)
    }

    /// The verifier's own stream (non-blocking; use it for the rank's work so that reading the
    /// error counters is ordered after everything the rank queued). It is the same stream at
    /// every call: work that must not queue behind other work of this verifier (a second
    /// communicator of the rank, a second rank) needs a stream of its own (`Stream::create`);
    /// two collectives issued in opposite orders by two ranks on one stream each deadlock.
    pub fn stream(&self) -> Result<Stream, Error> {
        Ok(self.stream)
    }

    /// Makes the device's context current for the caller's scope.
    pub fn activate(&self) -> Result<flashcomm_comm::gpu::CtxGuard, Error> {
        Ok(self.device.activate()?)
    }
}
