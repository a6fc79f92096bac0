//! Helpers for the GPU tests: N virtual ranks on one GPU, one thread and one stream each.
//!
//! `FLASHCOMM_TEST_GPUS=k` (default 1) places rank r on device `r % k` instead, in these helpers
//! and in the rank processes of `gpu_processes`, so the same tests run one rank per GPU on a
//! machine of several GPUs (`ci/multi-gpu-check.sh`).
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flashcomm_comm::plan::HostCopy;
use flashcomm_comm::{
    Algorithm, Bootstrap, Choice, Collective, CommConfig, Communicator, DataType, DeviceMem,
    DevicePtr, Plan, Protocol, Request, Stream, ThreadBootstrap, ThreadGroup, Transport,
};
use flashcomm_testkit::verify::{TestType, Verifier};

/// One virtual rank as a test sees it.
pub struct Rank<'a> {
    pub comm: Communicator,
    pub v: Verifier,
    pub stream: Stream,
    pub boot: &'a ThreadBootstrap,
    pub shared: Arc<Shared>,
}

impl Rank<'_> {
    pub fn rank(&self) -> u32 {
        self.comm.rank()
    }
    pub fn n(&self) -> u32 {
        self.comm.nranks()
    }
    /// Waits for the stream, checks the device status, and meets the other ranks.
    pub fn sync(&self) {
        self.stream.synchronize().expect("stream sync");
        self.comm.check_status().expect("device status");
        self.boot.barrier().expect("barrier");
    }
    pub fn alloc(&self, bytes: usize) -> DeviceMem {
        self.v.alloc(bytes).expect("alloc")
    }
    /// Checks on `stream` that `out` holds the AllReduce of `count` elements of `ty` whose inputs
    /// were filled with `salt` on every rank (recorded: [`Rank::assert_clean`] reads it).
    pub fn check_allreduce(
        &self,
        out: DevicePtr,
        count: u64,
        ty: TestType,
        salt: u32,
        stream: Stream,
    ) -> Result<(), flashcomm_comm::Error> {
        self.v.check(
            out,
            count,
            count,
            Collective::AllReduce,
            ty,
            self.n(),
            self.rank(),
            salt,
            stream,
        )
    }
    /// Asserts that no verification error was recorded, then clears the counter.
    pub fn assert_clean(&self, what: &str) {
        let (n, first) = self.v.errors().expect("read errors");
        assert_eq!(
            n,
            0,
            "rank {}: {what}: {n} wrong elements, first at index {first}",
            self.rank()
        );
        self.v.reset().unwrap();
    }
}

/// Addresses ranks publish to each other (all ranks live in this process).
#[derive(Default)]
pub struct Shared {
    pub addrs: Mutex<Vec<u64>>,
}

/// Default test configuration: short timeouts so a bug fails fast instead of hanging, on the
/// transport `FLASHCOMM_TRANSPORT` names (`p2p`, `host`; anything else: automatic), so the whole
/// GPU suite runs once per transport, and with the protocol `FLASHCOMM_PROTO` forces (`ll`,
/// `block`, `pull`, `direct`; anything else: the planner's choice) wherever a test does not
/// force one itself, so the suite also runs once with a PULL protocol forced, and with the
/// copy-engine schedule as `FLASHCOMM_HOST_COPY` asks ([`test_host_copy`]),
/// so the suite also runs with it forced on and off on the host transport.
pub fn test_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(10),
        calibrate: false,
        transport: test_transport(),
        proto: test_proto(),
        host_copy: test_host_copy(),
        ..CommConfig::default()
    }
}

/// The copy-engine schedule the tests run with (`FLASHCOMM_HOST_COPY`: `on`, `auto`, `off`;
/// else the default).
pub fn test_host_copy() -> HostCopy {
    match std::env::var("FLASHCOMM_HOST_COPY")
        .as_deref()
        .map(str::trim)
    {
        Ok("on") => HostCopy::On,
        Ok("auto") => HostCopy::Auto,
        Ok("off") => HostCopy::Off,
        _ => CommConfig::default().host_copy,
    }
}

/// The protocol the tests force where they do not choose one (`FLASHCOMM_PROTO`).
pub fn test_proto() -> Choice<Protocol> {
    let asked = std::env::var("FLASHCOMM_PROTO").unwrap_or_default();
    Protocol::ALL
        .into_iter()
        .find(|p| p.name() == asked.trim())
        .map_or(Choice::Auto, Choice::Force)
}

/// The transport the tests run on (`FLASHCOMM_TRANSPORT`).
pub fn test_transport() -> Choice<Transport> {
    match std::env::var("FLASHCOMM_TRANSPORT").as_deref() {
        Ok("host") => Choice::Force(Transport::Host),
        Ok("p2p") => Choice::Force(Transport::P2p),
        _ => Choice::Auto,
    }
}

/// How many GPUs the ranks are spread over (`FLASHCOMM_TEST_GPUS`, default 1).
pub fn test_gpus() -> u32 {
    std::env::var("FLASHCOMM_TEST_GPUS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&k: &u32| k >= 1)
        .unwrap_or(1)
}

/// The device of rank `rank`: `rank % FLASHCOMM_TEST_GPUS` (device 0 by default).
pub fn test_device(rank: u32) -> i32 {
    (rank % test_gpus()) as i32
}

/// With ranks on several GPUs of one process, lets `device` read every other test GPU's memory
/// (the tests compare a rank's output with rank 0's buffer in place; the peer transport enables
/// this itself, the host transport does not).
pub fn enable_test_peer_access(device: i32) {
    use flashcomm_comm::gpu::Device;
    let me = Device::open(device).expect("open device");
    for d in 0..test_gpus() as i32 {
        let other = Device::open(d).expect("open device");
        if d != device && me.can_access_peer(&other).unwrap_or(false) {
            me.enable_peer_access(&other).expect("enable peer access");
        }
    }
}

/// Runs `f` on `n` virtual ranks of device 0 (or of [`test_device`]), each in its own thread.
pub fn run_ranks<F>(n: u32, cfg: CommConfig, f: F)
where
    F: Fn(&Rank) + Sync,
{
    let group = ThreadGroup::new(n, Duration::from_secs(30));
    let members = group.members();
    let shared = Arc::new(Shared {
        addrs: Mutex::new(vec![0; n as usize]),
    });
    std::thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .map(|m| {
                let cfg = cfg.clone();
                let shared = shared.clone();
                let f = &f;
                s.spawn(move || {
                    let dev = test_device(m.rank());
                    let comm = Communicator::new(m, dev, cfg).expect("communicator set-up");
                    if test_gpus() > 1 {
                        enable_test_peer_access(dev);
                    }
                    let v = Verifier::new(dev).expect("verifier");
                    // Streams, graphs and copies in this thread use this device's context.
                    let _ctx = v.activate().expect("context");
                    let stream = v.stream().expect("stream");
                    let r = Rank {
                        comm,
                        v,
                        stream,
                        boot: m,
                        shared,
                    };
                    f(&r);
                    r.sync();
                })
            })
            .collect();
        for h in handles {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e);
            }
        }
    });
}

/// Runs `f` on `n` virtual ranks (of [`test_device`]) whose communicators are expected to end in
/// an error: no final status check, only a barrier once `f` returned on every rank.
pub fn run_ranks_expecting_errors<F>(n: u32, cfg: CommConfig, f: F)
where
    F: Fn(&Communicator, &Verifier, Stream, &ThreadBootstrap) + Sync,
{
    let group = ThreadGroup::new(n, Duration::from_secs(60));
    let members = group.members();
    std::thread::scope(|s| {
        for m in &members {
            let cfg = cfg.clone();
            let f = &f;
            s.spawn(move || {
                let dev = test_device(m.rank());
                let comm = Communicator::new(m, dev, cfg).unwrap();
                let v = Verifier::new(dev).unwrap();
                let _ctx = v.activate().unwrap();
                let stream = v.stream().unwrap();
                f(&comm, &v, stream, m);
                m.barrier().unwrap();
            });
        }
    });
}

pub const TYPES: [TestType; 3] = [TestType::F32, TestType::F16, TestType::Bf16];

/// Counts for a sweep from 4 bytes to `max_bytes`, odd where the type allows.
pub fn sweep_counts(elem: u64, max_bytes: u64) -> Vec<u64> {
    let mut v: Vec<u64> = [
        4u64, 6, 14, 62, 1026, 4098, 32770, 262146, 1048578, 8388610, 67108866, 268435458,
    ]
    .iter()
    .filter(|&&b| b <= max_bytes)
    .map(|&b| {
        let c = (b / elem).max(1);
        if c > 1 && c.is_multiple_of(2) {
            c - 1
        } else {
            c
        }
    })
    .collect();
    v.dedup();
    v
}

/// A watchdog: another thread sleeps `after`, then aborts `comm` (as PyTorch's watchdog calls
/// `ncclCommAbort`); returns when it did.
pub fn abort_from_another_thread(comm: &Communicator, after: Duration) -> std::time::Instant {
    std::thread::scope(|w| {
        w.spawn(move || {
            std::thread::sleep(after);
            comm.abort();
            std::time::Instant::now()
        })
        .join()
        .unwrap()
    })
}

/// Deterministic activation-like values: a Gaussian-ish bulk (sum of four uniforms) with a large
/// spike, uniform in `[-spike / 2, spike / 2)`, at every index `i` with `i % every == at`.
pub fn activations(seed: u64, count: usize, every: usize, at: usize, spike: f64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..count)
        .map(|i| {
            let g = (0..4).map(|_| next()).sum::<f64>() - 2.0;
            let big = if i % every == at {
                spike * (next() - 0.5)
            } else {
                0.0
            };
            (g * 1.5 + big) as f32
        })
        .collect()
}

/// `v` as little-endian f16 or bf16 bytes (round to nearest even).
pub fn half_bytes(dtype: flashcomm_comm::DataType, v: &[f32]) -> Vec<u8> {
    match dtype {
        flashcomm_comm::DataType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// The stress sequence's random words (the same on every rank).
pub fn stress_words() -> impl Iterator<Item = u64> {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    std::iter::from_fn(move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        Some(rng)
    })
}

/// The plan of one stress call: every call takes a protocol from the word (the PULL protocols
/// included, which the default cost model never picks for them), AllReduce calls an algorithm
/// too; one word in five leaves the choice to the communicator.
pub fn stress_plan(
    comm: &Communicator,
    x: u64,
    coll: Collective,
    ty: TestType,
    count: u64,
) -> Plan {
    if (x >> 48).is_multiple_of(5) {
        return comm.plan(&Request::bytes(coll, count, ty.bytes())).unwrap();
    }
    let proto = Protocol::ALL[((x >> 40) % 4) as usize];
    let algo = Algorithm::ALL[((x >> 44) % 2) as usize];
    comm.plan_forced(
        &Request::bytes(coll, count, ty.bytes()),
        Choice::Force(algo),
        Choice::Force(proto),
    )
    .unwrap()
}

/// One call of the stress sequence from a random word: the collective (AllReduce twice as often
/// as each of AllGather, ReduceScatter and AllToAll), the type and the count (mostly up to 64 KiB,
/// one in 64 up to 2 MiB).
pub fn stress_call(x: u64, n: u64) -> (Collective, TestType, u64) {
    let coll = [
        Collective::AllReduce,
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AlltoAll,
    ][(x % 5) as usize];
    let moves_bytes = matches!(coll, Collective::AllGather | Collective::AlltoAll);
    let ty = if moves_bytes && (x >> 8).is_multiple_of(2) {
        TestType::U8
    } else {
        TYPES[((x >> 4) % 3) as usize]
    };
    let big = (x >> 12).is_multiple_of(64);
    let max_bytes: u64 = if big { 2 << 20 } else { 64 << 10 };
    let count = 1
        + (x >> 20) % (max_bytes / ty.bytes() / if coll == Collective::AllReduce { 1 } else { n });
    (coll, ty, count)
}

/// Elements of a rank's send and receive buffers for a call of `count` elements on `n` ranks
/// (NCCL's layouts; AllToAll: `count` per peer).
pub fn send_recv_elems(coll: Collective, count: u64, n: u64) -> (u64, u64) {
    coll.buffer_bytes(count, n)
        .expect("test sizes do not overflow")
}

/// Sets up a communicator of `boot`'s group on `device` and runs one small AllReduce on it,
/// checked (the cycle of the set-up, release, fork and abort-and-reinit tests).
pub fn set_up_and_run_once(
    boot: &dyn Bootstrap,
    device: i32,
    cfg: &CommConfig,
    buf: &DeviceMem,
    stream: Stream,
) -> Communicator {
    let comm = Communicator::new(boot, device, cfg.clone()).expect("communicator set-up");
    comm.execute(
        &Request::typed(Collective::AllReduce, 256, DataType::F32)
            .between(buf.as_ptr(), buf.as_ptr())
            .on(stream),
    )
    .unwrap();
    stream.synchronize().unwrap();
    comm.check_status().unwrap();
    comm
}
