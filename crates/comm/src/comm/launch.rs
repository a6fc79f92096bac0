//! Launch: the plan of a call, the checks of its buffers, the kernel chosen and its parameters
//! ([`Communicator::prepare`]: what a call enqueues, ready to go; `order.rs` checks the device's
//! status before it and orders, launches and records after it), and the scattered AllToAll.

use flashcomm_kernels::catalog::QuantOp;
use flashcomm_kernels::{Kernel, LaunchConfig};

use crate::abi::{self, FcCollParams};
use crate::error::Error;
use crate::gpu::{DeviceMem, DevicePtr, Stream};
use crate::plan::{
    self, Algorithm, Choice, Collective, DataType, Plan, Protocol, QuantChoice, QuantModel,
    QuantSpec,
};
use crate::release;
use crate::request::{Buffers, Request};
use crate::transport::Transport;

use super::{Communicator, HOST_ABORT, HOST_STATUS};

/// What a call's buffers need before the kernels can take them ([`buffer_staging`]): whether
/// the input is first copied into scratch (a send buffer that overlaps the receive buffer other
/// than in NCCL's in-place layout, or one the kernel cannot read at its alignment), and whether
/// the kernel writes into scratch that is copied to the receive buffer after (one it cannot
/// write at its alignment). `why` says what made it so.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Staging {
    pub(crate) input: bool,
    pub(crate) output: bool,
    pub(crate) why: Option<String>,
}

/// The staging a call's buffers need (issue 45, item 3: a refusal on one rank would leave its
/// peers waiting in their kernels, where NCCL runs such a call; staging is rank-local, so every
/// rank still runs the same kernel):
/// * send and receive ranges may overlap only in NCCL's in-place layout: the same buffer for
///   AllReduce and AllToAll; for ReduceScatter the receive buffer at `in_place` bytes (rank x
///   recvcount elements) into the send buffer; for AllGather the send buffer at `in_place` bytes
///   into the receive buffer; any other overlap would let one rank's writes race with another's
///   reads, so the input is staged;
/// * both buffers are aligned to `align` (the element size for the quantized kernels, which load
///   and store whole elements; the lossless kernels take any alignment), or are staged.
pub(crate) fn buffer_staging(
    coll: Collective,
    send: (u64, u64),
    recv: (u64, u64),
    in_place: u64,
    align: u64,
) -> Staging {
    let (s, sn) = send;
    let (r, rn) = recv;
    let overlap = s < r.saturating_add(rn) && r < s.saturating_add(sn);
    let layout_ok = match coll {
        // AllToAll in place: every thread (LL) or warp (BLOCK) of a round reads chunk k of every
        // block it sends before it writes chunk k of any block it receives, and no other part of
        // the kernel touches chunk k (the quantized kernel: a block barrier between the two).
        Collective::AllReduce | Collective::AlltoAll => s == r,
        Collective::ReduceScatter => s.checked_add(in_place) == Some(r),
        Collective::AllGather => r.checked_add(in_place) == Some(s),
        _ => false,
    };
    let mut st = Staging::default();
    if overlap && !layout_ok {
        let want = match coll {
            Collective::AllReduce | Collective::AlltoAll => "the same buffer".to_string(),
            Collective::ReduceScatter => {
                format!("recvbuff = sendbuff + {in_place} bytes (rank x recvcount elements)")
            }
            Collective::AllGather => {
                format!("sendbuff = recvbuff + {in_place} bytes (rank x sendcount elements)")
            }
            _ => "nothing: this collective has no in-place form here".to_string(),
        };
        st.input = true;
        st.why = Some(format!(
            "{coll:?}: send buffer {s:#x} ({sn} bytes) and receive buffer {r:#x} ({rn} bytes) \
             overlap, but not in place (in place means {want})"
        ));
    }
    if align > 1 && (s % align != 0 || r % align != 0) {
        st.input |= s % align != 0 || s == r;
        st.output |= r % align != 0;
        st.why.get_or_insert_with(|| {
            format!(
                "{coll:?}: buffers {s:#x} and {r:#x} are not aligned to the {align}-byte \
                 datatype the quantized kernels load and store"
            )
        });
    }
    st
}

/// The signature of a call that its tags carry (see `FLAG_SIG_SHIFT`): the collective, whether
/// it is quantized, and the datatype of a reducing or quantized collective (a lossless AllGather
/// or AllToAll moves bytes, so its datatype does not matter). Never more than 8 bits.
///
/// A quantized call's signature (top bit set; lossless ones stay below 0x80) also carries its
/// codec settings, which `flashcommCommSetQuant` sets per communicator (the shim has the ranks
/// agree on them; a program that drives this crate directly may not): two ranks that run one
/// collective with different widths, group or spikes then see a foreign tag and report a
/// mismatch instead of decoding each other's bytes in the wrong format. Bits 5..7: the collective; bit 4: f16 or
/// bf16; bits 0..4: `(rs - 2) + 5 (ag - 2) + 7 g + 3 s (mod 16)`, with `g` the group's index
/// (32, 64, 128, 256) and `s` the spikes' (0, 2, 4). A difference in any one of the settings
/// changes those four bits (each coefficient times any possible difference is not a multiple of
/// 16); of the 11,376 pairs of valid settings that differ in several, 689 share them (a test
/// counts them).
fn call_signature(p: &Plan, dtype: Option<DataType>) -> u32 {
    if let Some(q) = p.quant {
        let coll = match p.coll {
            Collective::AllReduce => 0,
            Collective::ReduceScatter => 1,
            Collective::AllGather => 2,
            _ => 3,
        };
        let ty = u32::from(dtype == Some(DataType::Bf16));
        let g = match q.group {
            32 => 0,
            64 => 1,
            128 => 2,
            _ => 3,
        };
        let sp = u32::from(q.spikes / 2);
        let h = (u32::from(q.rs_bits.saturating_sub(2))
            + 5 * u32::from(q.ag_bits.saturating_sub(2))
            + 7 * g
            + 3 * sp)
            % 16;
        return 0x80 | coll << 5 | ty << 4 | h;
    }
    let coll = match p.coll {
        Collective::AllReduce => 1,
        Collective::ReduceScatter => 2,
        Collective::AllGather => 3,
        Collective::AlltoAll => 4,
        // Never launched (`run` refuses them); distinct from every launched kind all the same.
        other => 5 + other.index() as u32 % 3,
    };
    let ty = match (p.coll, dtype) {
        (Collective::AllGather | Collective::AlltoAll, _) => 0,
        (_, None) => 0,
        (_, Some(DataType::F32)) => 1,
        (_, Some(DataType::F16)) => 2,
        (_, Some(DataType::Bf16)) => 3,
    };
    (coll << 4) | ty
}

/// What a planned call enqueues on its stream ([`Communicator::prepare`]), ready to go: device
/// copies before, the call's one operation, device copies after, all ordered as one operation of
/// the communicator. Lives on the stack for the one call (boxing the kernel's parameters would
/// allocate per call).
pub(super) struct Work<'r> {
    pub(super) before: Copies<'r>,
    pub(super) run: Run,
    pub(super) after: Copies<'r>,
}

/// The call's one operation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Run {
    /// Nothing: no elements, or one rank in place.
    Nothing,
    /// One device copy: one rank out of place (every collective's result is its input).
    Copy {
        send: DevicePtr,
        recv: DevicePtr,
        bytes: u64,
    },
    /// One kernel.
    Kernel(Launch),
    /// The lossless AllReduce as the copy-engine schedule (`comm/copy.rs`).
    CopySchedule {
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        dtype: DataType,
    },
}

/// Device copies around the operation, through the communicator's scratch.
pub(super) enum Copies<'r> {
    None,
    /// One copy (destination, source, bytes): a buffer staged ([`Communicator::staged`]).
    One(DevicePtr, DevicePtr, u64),
    /// A scattered AllToAll's blocks of `block` bytes, one per rank, gathered into `at` (before
    /// the kernel) or scattered out of it (after).
    Blocks {
        blocks: &'r [DevicePtr],
        at: DevicePtr,
        block: u64,
    },
}

impl Work<'_> {
    /// Just `run`, with no copies around it.
    pub(super) fn only(run: Run) -> Work<'static> {
        Work {
            before: Copies::None,
            run,
            after: Copies::None,
        }
    }
}

/// One catalogue kernel with its launch configuration and parameters.
pub(super) struct Launch {
    pub(super) kernel: Kernel<FcCollParams>,
    pub(super) cfg: LaunchConfig,
    pub(super) params: FcCollParams,
    /// Launched with programmatic stream serialization (the device supports it).
    pub(super) overlapped: bool,
}

/// How long a call being captured waits for its peers to map the buffers it registers.
const CAPTURE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Communicator {
    /// The plan of a request: exactly what [`Communicator::execute`] runs for it (pure; the
    /// same on every rank for the same request): [`Communicator::plan_forced`] with the
    /// communicator's algorithm and protocol settings.
    pub fn plan(&self, req: &Request<'_>) -> Result<Plan, Error> {
        self.plan_forced(req, self.cfg.algo, self.cfg.proto)
    }

    /// The plan of a request with `algo` and `proto` forced (each falls back where it is invalid
    /// for the call, as the communicator's settings do). A lossless call is planned by the cost
    /// model (or as forced); a quantized AllReduce runs the quantized kernels, or, under
    /// [`QuantChoice::Auto`] where quantizing does not pay ([`plan::quant_pays`]) and the request
    /// allows it, the lossless plan (whose `quant` is `None`); a quantized AllGather, AllToAll or
    /// ReduceScatter is one quantization step at `q.rs_bits`. Refuses what the kernels refuse
    /// (a quantized f32 call, widths without kernels).
    pub fn plan_forced(
        &self,
        req: &Request<'_>,
        algo: Choice<Algorithm>,
        proto: Choice<Protocol>,
    ) -> Result<Plan, Error> {
        let lossless = |coll, elem| {
            plan::plan(
                &self.arena,
                &self.model,
                coll,
                req.count,
                elem,
                self.max_grid,
                algo,
                proto,
            )
        };
        let Some(q) = req.quant else {
            return Ok(lossless(req.coll, req.elem));
        };
        let dtype = req.dtype.ok_or_else(|| {
            Error::InvalidArgument("a quantized call needs an element type".into())
        })?;
        if req.coll != Collective::AllReduce {
            return plan::plan_quant_op(&self.arena, req.coll, req.count, dtype, q, self.max_grid);
        }
        let quant = plan::plan_quant(
            &self.arena,
            &self.model,
            self.quant_model(q),
            req.count,
            dtype,
            q,
            self.max_grid,
            algo,
        )?;
        if self.cfg.quant_choice == QuantChoice::Always || !req.lossless_allowed {
            return Ok(quant);
        }
        let lossless = lossless(Collective::AllReduce, dtype.bytes());
        let bytes = req.count * dtype.bytes();
        Ok(
            if plan::quant_pays(&self.model, &lossless, self.quant_model(q), &quant, bytes) {
                quant
            } else {
                lossless
            },
        )
    }

    /// The first half of [`Communicator::execute`] (which checks the device's status before
    /// and orders and enqueues after: `order.rs`): the request's plan ([`Communicator::plan`])
    /// and what it enqueues ([`Communicator::work`]). Nothing is enqueued here.
    pub(super) fn prepare<'r>(&self, req: &Request<'r>) -> Result<(Plan, Work<'r>), Error> {
        let mut p = self.plan(req)?;
        p.copy_engines = self.takes_copy_engines(&p, req)?;
        let work = self.work(&p, req)?;
        Ok((p, work))
    }

    /// Plan `p` of `req` (from [`Communicator::plan_forced`]) with the copy-engine schedule where
    /// `FLASHCOMM_HOST_COPY` takes it, as [`Communicator::execute`] would run the call: for callers
    /// that plan first and run with [`Communicator::execute_plan`], which runs a plan as given.
    pub fn with_copy_engines(&self, p: Plan, req: &Request<'_>) -> Result<Plan, Error> {
        Ok(Plan {
            copy_engines: self.takes_copy_engines(&p, req)?,
            ..p
        })
    }

    /// Whether plan `p` of `req` runs as the copy-engine schedule instead (`FLASHCOMM_HOST_COPY`,
    /// [`plan::copy::takes`]): a lossless AllReduce of a type, on a communicator that has the copy
    /// area, eager. Nothing rank-local decides (buffers the schedule cannot take as they are are
    /// staged, as for the kernels), so every rank decides alike.
    fn takes_copy_engines(&self, p: &Plan, req: &Request<'_>) -> Result<bool, Error> {
        Ok(self.copy.is_some()
            && p.coll == Collective::AllReduce
            && p.quant.is_none()
            && req.dtype.is_some()
            && matches!(req.buffers, Buffers::Contiguous { .. })
            && plan::copy::takes(self.cfg.host_copy, req.count.saturating_mul(req.elem))
            && !req.stream.is_capturing()?)
    }

    /// What plan `p` of `req` enqueues: its buffers checked and, for a kernel, the kernel chosen
    /// and its parameters filled.
    pub(super) fn work<'r>(&self, p: &Plan, req: &Request<'r>) -> Result<Work<'r>, Error> {
        Ok(match req.buffers {
            Buffers::Contiguous { send, recv } => {
                self.contiguous(p, send, recv, req.count, req.elem, req.dtype, req.stream)?
            }
            Buffers::Scattered { send, recv } => {
                if p.coll != Collective::AlltoAll || p.quant.is_some() {
                    return Err(Error::Unsupported(
                        "scattered blocks are a lossless AllToAll's only".into(),
                    ));
                }
                self.scattered(p, send, recv, req.count, req.elem, req.stream)?
            }
        })
    }

    /// Whether this communicator's last eager launch has finished (or cannot be told: a failed
    /// device, whose work reads nothing any more).
    pub(super) fn idle_now(&self) -> bool {
        !matches!(release::Activity::idle(&*self.last), Ok(false))
    }

    /// The calibrated times of the quantized AllReduce with codec settings `q`, if measured.
    pub fn quant_model(&self, q: QuantSpec) -> Option<&QuantModel> {
        self.quant_models.iter().find(|m| m.spec == q)
    }

    /// A scattered AllToAll with plan `p`: the blocks gathered into the scratch, the AllToAll
    /// kernel between its two halves, the blocks scattered out.
    fn scattered<'r>(
        &self,
        p: &Plan,
        send: &'r [DevicePtr],
        recv: &'r [DevicePtr],
        count: u64,
        elem: u64,
        stream: Stream,
    ) -> Result<Work<'r>, Error> {
        let n = self.nranks as usize;
        let block = count
            .checked_mul(elem)
            .ok_or_else(|| Error::InvalidArgument("AllToAll block size overflows".into()))?;
        if send.len() != n || recv.len() != n {
            return Err(Error::InvalidArgument(format!(
                "{} send and {} receive blocks for {n} ranks",
                send.len(),
                recv.len()
            )));
        }
        if send.iter().chain(recv).any(|b| b.len() < block) {
            return Err(Error::InvalidArgument(format!(
                "an AllToAll block is smaller than {block} bytes"
            )));
        }
        if block == 0 {
            return Ok(Work::only(Run::Nothing));
        }
        let half = block
            .checked_mul(n as u64)
            .and_then(|t| usize::try_from(t).ok())
            .filter(|t| t.checked_mul(2).is_some())
            .ok_or_else(|| Error::InvalidArgument("AllToAll size overflows".into()))?;
        let mem = self.scratch(2 * half, stream, || {
            Error::Unsupported(format!(
                "a scattered AllToAll of {} bytes of scratch under graph capture, before any \
                 eager one of that size",
                2 * half
            ))
        })?;
        let (at_in, at_out) = (mem.part(0, half as u64), mem.part(half as u64, half as u64));
        let run = self
            .contiguous(p, at_in, at_out, count, elem, None, stream)?
            .run;
        Ok(Work {
            before: Copies::Blocks {
                blocks: send,
                at: at_in,
                block,
            },
            run,
            after: Copies::Blocks {
                blocks: recv,
                at: at_out,
                block,
            },
        })
    }

    /// The start of this communicator's scratch, at least `bytes` long: allocated (grown by
    /// powers of two, the earlier ones kept until the communicator is released, so that work
    /// already enqueued keeps its memory) unless an earlier call left enough; under graph
    /// capture, where allocating is not allowed, `refused()` instead.
    fn scratch(
        &self,
        bytes: usize,
        stream: Stream,
        refused: impl FnOnce() -> Error,
    ) -> Result<DevicePtr, Error> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let _ctx = self.device.activate()?;
        if scratch.last().is_none_or(|m| m.len() < bytes) {
            if stream.is_capturing()? {
                return Err(refused());
            }
            let size = bytes.checked_next_power_of_two().unwrap_or(bytes);
            scratch.push(DeviceMem::alloc_zeroed(&self.device, size)?);
        }
        Ok(scratch.last().expect("allocated above").slice(0, bytes))
    }

    /// What plan `p` of a call with contiguous buffers enqueues (every rank runs the same plan),
    /// once its buffers passed the checks the kernels need.
    fn contiguous(
        &self,
        p: &Plan,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        dtype: Option<DataType>,
        stream: Stream,
    ) -> Result<Work<'static>, Error> {
        if count == 0 {
            return Ok(Work::only(Run::Nothing));
        }
        let n = self.nranks as u64;
        if !Collective::KERNELS.contains(&p.coll) {
            return Err(Error::Unsupported(format!(
                "{}: not a collective of flashcomm's kernels",
                p.coll
            )));
        }
        let (send_bytes, recv_bytes) = count
            .checked_mul(elem)
            .and_then(|b| p.coll.buffer_bytes(b, n))
            .ok_or_else(|| Error::InvalidArgument("the call's size overflows".into()))?;
        if send.len() < send_bytes || recv.len() < recv_bytes {
            return Err(Error::InvalidArgument(format!(
                "buffers of {} and {} bytes are too small for {send_bytes} and {recv_bytes}",
                send.len(),
                recv.len()
            )));
        }
        let staging = buffer_staging(
            p.coll,
            (send.addr(), send_bytes),
            (recv.addr(), recv_bytes),
            u64::from(self.rank) * count * elem,
            // The quantized kernels and the copy-engine schedule's reduction load whole elements.
            if p.quant.is_some() || p.copy_engines {
                elem
            } else {
                1
            },
        );
        if p.coll.reduces() && dtype.is_none() {
            return Err(Error::InvalidArgument(
                "a reducing collective needs a datatype".into(),
            ));
        }
        if let Some(q) = p.quant {
            if !q.has_kernels_for(p.coll) || dtype.is_none_or(|d| d == DataType::F32) {
                return Err(Error::Unsupported(
                    "quantized plan for an unsupported call".into(),
                ));
            }
            if p.coll == Collective::AllReduce
                && p.algo == Algorithm::TwoShot
                && count.div_ceil(plan::CODEC_BLOCK_VALUES) < n
            {
                return Err(Error::InvalidArgument(
                    "two-step quantized plan with an empty shard".into(),
                ));
            }
        } else if p.algo == Algorithm::TwoShot
            && (p.shard_elems == 0 || (n - 1) * p.shard_elems >= count)
        {
            return Err(Error::InvalidArgument(
                "two-shot plan with an empty shard".into(),
            ));
        }
        if self.nranks == 1 {
            // Nothing to exchange: every collective's result is the input (quantization never
            // applies). In place that is free; out of place it is one device copy (between
            // overlapping ranges refused: no peer waits for this rank).
            if let Some(why) = staging.why {
                return Err(Error::InvalidArgument(why));
            }
            if send.addr() == recv.addr() {
                return Ok(Work::only(Run::Nothing));
            }
            return Ok(Work::only(Run::Copy {
                send,
                recv,
                bytes: recv_bytes,
            }));
        }
        if staging.input || staging.output {
            return self.staged(
                p,
                (send, send_bytes),
                (recv, recv_bytes),
                staging,
                count,
                elem,
                dtype,
                stream,
            );
        }
        Ok(Work::only(
            self.run_of(p, send, recv, count, elem, dtype, stream)?,
        ))
    }

    /// The operation of plan `p` on buffers that need no staging: the copy-engine schedule
    /// (`p.copy_engines`) or the plan's kernel.
    #[allow(clippy::too_many_arguments)]
    fn run_of(
        &self,
        p: &Plan,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        dtype: Option<DataType>,
        stream: Stream,
    ) -> Result<Run, Error> {
        match dtype {
            // Never under capture (a plan handed to `execute_plan` may say otherwise).
            Some(dtype) if p.copy_engines && !stream.is_capturing()? => Ok(Run::CopySchedule {
                send,
                recv,
                count,
                dtype,
            }),
            _ => Ok(Run::Kernel(self.launch_of(
                p,
                send,
                recv,
                count,
                elem,
                dtype,
                Some(stream),
            )?)),
        }
    }

    /// The call through this communicator's scratch ([`buffer_staging`]): the input copied into
    /// it first, and/or the output written there and copied out after, around the kernel (or the
    /// copy-engine schedule) every rank runs. Rank-local: the peers run the same operation on
    /// their own buffers. The scratch
    /// (the scattered AllToAll's, aligned, grown by powers of two, kept until the communicator is
    /// released) cannot be allocated under graph capture: a capture whose call needs more than an
    /// earlier eager call left is refused, as before.
    #[allow(clippy::too_many_arguments)]
    fn staged(
        &self,
        p: &Plan,
        send: (DevicePtr, u64),
        recv: (DevicePtr, u64),
        staging: Staging,
        count: u64,
        elem: u64,
        dtype: Option<DataType>,
        stream: Stream,
    ) -> Result<Work<'static>, Error> {
        let why = staging.why.clone().unwrap_or_default();
        let at = |b: u64| b.next_multiple_of(256);
        let need = if staging.input { at(send.1) } else { 0 }
            + if staging.output { at(recv.1) } else { 0 };
        let mem = self.scratch(need as usize, stream, || {
            Error::InvalidArgument(format!(
                "{why}; staging it needs {need} bytes of scratch, which cannot be allocated \
                 under graph capture (run the call once eagerly first)"
            ))
        })?;
        tracing::debug!("staged through scratch: {why}");
        let kin = if staging.input {
            mem.part(0, send.1)
        } else {
            send.0
        };
        let off = if staging.input { at(send.1) } else { 0 };
        let kout = if staging.output {
            mem.part(off, recv.1)
        } else {
            recv.0
        };
        let run = self.run_of(p, kin, kout, count, elem, dtype, stream)?;
        Ok(Work {
            before: if staging.input {
                Copies::One(kin, send.0, send.1)
            } else {
                Copies::None
            },
            run,
            after: if staging.output {
                Copies::One(recv.0, kout, recv.1)
            } else {
                Copies::None
            },
        })
    }

    /// [`abi::FLAG_HOST_ARENAS`] on the host transport: the LL kernels then gate their reads
    /// behind one poll per source (the same on every rank: the transport is agreed at set-up).
    fn host_arenas_flag(&self) -> u32 {
        if self.local.transport() == Transport::Host {
            abi::FLAG_HOST_ARENAS
        } else {
            0
        }
    }

    /// [`abi::FLAG_EARLY_LAUNCH`] for a lossless plan whose grid, doubled, still fits this rank's
    /// resident share (`max_grid`, the share of the GPU that keeps every co-located rank's blocks
    /// resident): the next kernel's blocks, launched early and waiting, then never keep a peer's
    /// blocks from being scheduled. (The quantized kernels' occupancy differs from the lossless
    /// ones' that `max_grid` was measured on, so they do not take it.)
    fn early_launch_flag(&self, p: &Plan) -> u32 {
        let fits = p.grid.saturating_mul(2) <= self.max_grid;
        if self.cfg.early_launch
            && fits
            && p.quant.is_none()
            && self.device.supports_overlapped_launch()
        {
            abi::FLAG_EARLY_LAUNCH
        } else {
            0
        }
    }

    /// Whether a direct PULL kernel must stage this rank's input rather than let its peers read
    /// it in place (rank-local: it changes the address this rank publishes, never the protocol
    /// its peers run). `piece` is `count * elem`: the AllReduce's message, the AllGather's input,
    /// the ReduceScatter's output, the AllToAll's block per peer. Staged are: a send buffer that
    /// is not 16-byte aligned (peers load 16-byte vectors); for ReduceScatter and AllToAll, pieces
    /// of a size that is not a multiple of 16 (peer q loads piece q at `send + q * piece`); and
    /// an input that overlaps the output where this rank could write what its peers still read:
    /// any overlap of a one-shot AllReduce or an AllToAll, and any overlap of an AllGather or a
    /// ReduceScatter other than NCCL's in-place layout (the input is block `rank` of the
    /// AllGather's output; the ReduceScatter's output is piece `rank` of its input), where a rank
    /// writes only what no peer reads.
    fn direct_staging(p: &Plan, rank: u32, nranks: u32, send: u64, recv: u64, piece: u64) -> u32 {
        // The sizes were checked when the call was prepared: no overflow here.
        let (send_len, recv_len) = p
            .coll
            .buffer_bytes(piece, u64::from(nranks))
            .unwrap_or((u64::MAX, u64::MAX));
        let (s, r) = (send, recv);
        let overlaps = s < r + recv_len && r < s + send_len;
        let at_rank = piece * u64::from(rank);
        let unsafe_overlap = overlaps
            && match p.coll {
                Collective::AllReduce => p.algo == Algorithm::OneShot,
                Collective::AllGather => s != r + at_rank,
                Collective::ReduceScatter => r != s + at_rank,
                _ => true,
            };
        let pieces_misaligned = matches!(p.coll, Collective::ReduceScatter | Collective::AlltoAll)
            && !piece.is_multiple_of(16);
        if !s.is_multiple_of(16) || pieces_misaligned || unsafe_overlap {
            abi::FLAG_PULL_STAGE_SEND
        } else {
            0
        }
    }

    /// What a direct PULL rank publishes: where each peer's process sees its send buffer (and,
    /// for the two-shot AllReduce, its receive buffer), or the flags that stage them instead
    /// (rank-local: [`Communicator::direct_staging`], and for peers of other processes a buffer
    /// they have not mapped: [`crate::register`]).
    /// A call being captured into a graph registers its unregistered buffers for good and waits
    /// for the peers' mappings ([`crate::register`]), so the graph reads them in place.
    fn direct_views(
        &self,
        p: &Plan,
        params: &mut FcCollParams,
        (send, recv): (u64, u64),
        piece: u64,
        stream: Option<Stream>,
    ) -> Result<(), Error> {
        params.flags |= Self::direct_staging(p, self.rank, self.nranks, send, recv, piece);
        let send_len = p
            .coll
            .buffer_bytes(piece, u64::from(self.nranks))
            .map_or(u64::MAX, |(send, _)| send);
        let two_shot = p.coll == Collective::AllReduce && p.algo == Algorithm::TwoShot;
        let remote = self.registry.has_boards();
        // Buffer ids and peers' new registrations need the context; ranks of one process only
        // need neither.
        let _ctx = if remote {
            Some(self.device.activate()?)
        } else {
            None
        };
        if remote {
            self.registry.refresh(&|| self.idle_now());
        }
        // Captured: every captured direct call takes part in the exchange at capture (every rank
        // captures the same calls, so every rank runs the same exchanges), registering what is
        // not registered yet.
        if remote && stream.is_some_and(|s| s.is_capturing().unwrap_or(false)) {
            let ptrs = [send, recv];
            self.registry
                .register_captured(&ptrs[..if two_shot { 2 } else { 1 }], CAPTURE_WAIT);
        }
        let views = |ptr: u64, len: u64| self.registry.views(ptr, len);
        if params.flags & abi::FLAG_PULL_STAGE_SEND == 0 {
            match views(send, send_len) {
                Some(v) => params.send_view = v,
                None => params.flags |= abi::FLAG_PULL_STAGE_SEND,
            }
        }
        if two_shot {
            match views(recv, piece) {
                Some(v) => params.recv_view = v,
                None => params.flags |= abi::FLAG_PULL_STAGE_RECV,
            }
        }
        let staged = abi::FLAG_PULL_STAGE_SEND | abi::FLAG_PULL_STAGE_RECV;
        if remote && params.flags & staged == 0 {
            self.zero_copy_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// The catalogue kernel of a plan: a few integer operations, no name and no lookup.
    fn kernel_for(p: &Plan, dtype: Option<DataType>) -> Result<Kernel<FcCollParams>, Error> {
        let (proto, algo) = (p.proto, p.algo);
        let quant_op = QuantOp::of(p.coll);
        let k = match (p.coll, dtype) {
            (_, Some(t)) if p.quant.is_some() && quant_op.is_some() => match (quant_op, p.quant) {
                (Some(op), Some(q)) => Kernel::quant_op(op, t, q.rs_bits),
                _ => None,
            },
            (Collective::AllGather, _) if p.quant.is_none() => Some(Kernel::allgather(proto)),
            (Collective::AlltoAll, _) if p.quant.is_none() => Some(Kernel::alltoall(proto)),
            (Collective::AllReduce, Some(t)) => match p.quant {
                Some(q) if algo == Algorithm::OneShot => Kernel::quant_oneshot(t, q.rs_bits),
                Some(q) => Kernel::quant_twostep(t, q.rs_bits, q.ag_bits),
                None => Some(Kernel::allreduce(algo, proto, t)),
            },
            (Collective::ReduceScatter, Some(t)) => Some(Kernel::reducescatter(proto, t)),
            _ => return Err(Error::InvalidArgument("missing datatype".into())),
        };
        k.ok_or_else(|| {
            Error::Unsupported(format!(
                "no {} kernel for this plan ({} protocol, codec {:?})",
                p.coll,
                proto.name(),
                p.quant
            ))
        })
    }

    /// The kernel of plan `p`, its launch configuration and its parameters (`stream`: the call's
    /// stream, which tells whether the call is being captured; `None` for calibration's own).
    pub(super) fn launch_of(
        &self,
        p: &Plan,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        elem: u64,
        dtype: Option<DataType>,
        stream: Option<Stream>,
    ) -> Result<Launch, Error> {
        let k = Self::kernel_for(p, dtype)?;
        let params = FcCollParams {
            send: send.addr(),
            recv: recv.addr(),
            count,
            peer_base: self.peers,
            epochs: self.local.epochs_addr(),
            abort_flag: self.host.dev_ptr() + HOST_ABORT as u64,
            status: self.host.dev_ptr() + HOST_STATUS as u64,
            timeout_ns: self.cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
            half_bytes: self.arena.half_bytes,
            region_bytes: self.arena.region_bytes,
            slot_bytes: self.arena.slot_bytes,
            sub_bytes: p.sub_bytes,
            chunk_bytes: p.chunk_bytes,
            shard_elems: p.shard_elems,
            rank: self.rank,
            nranks: self.nranks,
            elem_bytes: elem as u32,
            area_offset: self.arena.area_offset(p.proto),
            own_slots: self.own_slots.as_ref().map_or(0, |m| m.as_ptr().addr()),
            trace: self.trace.as_ref().map_or(0, |m| m.addr()),
            flags: call_signature(p, dtype) << abi::FLAG_SIG_SHIFT
                | self.early_launch_flag(p)
                | self.host_arenas_flag(),
            ..Default::default()
        };
        let mut params = params;
        if p.proto == Protocol::Direct {
            self.direct_views(
                p,
                &mut params,
                (send.addr(), recv.addr()),
                count * elem,
                stream,
            )?;
        }
        let threads = p.threads;
        if let (Some(q), Some(d)) = (p.quant, dtype) {
            params.q_bits_rs = q.rs_bits as u32;
            params.q_bits_ag = q.ag_bits as u32;
            params.q_group = q.group as u32;
            params.q_spikes = q.spikes as u32;
            params.q_block_bytes_rs = q.format(d, q.rs_bits)?.block_bytes() as u32;
            params.q_block_bytes_ag = q.format(d, q.ag_bits)?.block_bytes() as u32;
        }
        let cfg = LaunchConfig {
            grid: p.grid,
            block: threads,
            smem: 0,
        };
        Ok(Launch {
            kernel: k,
            cfg,
            params,
            // Without early launch no kernel of the communicator lets the next one start early,
            // so programmatic serialization would buy nothing: plain launches then.
            overlapped: self.cfg.early_launch && self.device.supports_overlapped_launch(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Arena, Choice, CostModel};

    /// `flashcommCommSetQuant` is per rank: ranks whose settings differ run one quantized
    /// collective in different wire formats. Their tags must differ so that the kernels report a
    /// mismatch rather than decode each other's bytes wrongly (before, the signature carried
    /// only "quantized", and every setting looked alike).
    /// The plan whose signature the signature tests vary: an AllReduce of 64 Ki 2-byte elements.
    fn signature_plan(nranks: u32) -> Plan {
        plan::plan(
            &Arena::new(nranks, 64 << 20).unwrap(),
            &CostModel::default_for(nranks),
            Collective::AllReduce,
            1 << 16,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        )
    }

    #[test]
    fn quantized_signatures_differ_by_codec_settings() {
        let base = signature_plan(4);
        let sig = |coll: Collective, q: QuantSpec, t: DataType| {
            let mut p = base;
            p.coll = coll;
            p.quant = Some(q);
            call_signature(&p, Some(t))
        };
        let spec = |rs, ag, group, spikes| QuantSpec::new(rs, ag, group, spikes).unwrap();
        let mut specs = Vec::new();
        for rs in 2..=8u8 {
            for ag in [rs, 8] {
                for group in [32, 64, 128, 256] {
                    for spikes in [0, 2, 4] {
                        specs.push(spec(rs, ag, group, spikes));
                    }
                }
            }
        }
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::AlltoAll,
        ] {
            for t in [DataType::F16, DataType::Bf16] {
                for a in &specs {
                    let sa = sig(coll, *a, t);
                    assert!((0x80..0x100).contains(&sa), "quantized: top bit, 8 bits");
                    for b in &specs {
                        let differ = [
                            a.rs_bits != b.rs_bits,
                            a.ag_bits != b.ag_bits,
                            a.group != b.group,
                            a.spikes != b.spikes,
                        ];
                        if differ.iter().filter(|d| **d).count() == 1 {
                            assert_ne!(sa, sig(coll, *b, t), "{coll:?} {t:?} {a:?} vs {b:?}");
                        }
                    }
                }
            }
        }
        // The collective and the datatype always show.
        let q = spec(4, 4, 128, 2);
        assert_ne!(
            sig(Collective::AllReduce, q, DataType::F16),
            sig(Collective::AllReduce, q, DataType::Bf16)
        );
        assert_ne!(
            sig(Collective::AllGather, q, DataType::F16),
            sig(Collective::AlltoAll, q, DataType::F16)
        );
        // Lossless signatures stay below the quantized ones.
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Broadcast,
        ] {
            let mut p = base;
            p.coll = coll;
            assert!(call_signature(&p, Some(DataType::F32)) < 0x80);
        }
    }

    /// What docs/protocols.md's failure table says of ranks that run one quantized collective
    /// with different codec settings: a difference in one setting always shows (above); of the
    /// pairs of valid settings that differ in more than one, 689 of 11,376 share a signature.
    #[test]
    fn settings_that_differ_in_several_share_a_signature_in_689_of_11376_pairs() {
        let mut p = signature_plan(2);
        let mut specs = Vec::new();
        for rs in 2..=8u8 {
            for ag in [rs, 8] {
                for group in [32, 64, 128, 256] {
                    for spikes in [0, 2, 4] {
                        let q = QuantSpec::new(rs, ag, group, spikes).unwrap();
                        if !specs.contains(&q) {
                            specs.push(q);
                        }
                    }
                }
            }
        }
        assert_eq!(specs.len(), 156, "the valid settings");
        let (mut pairs, mut same) = (0, 0);
        for (i, a) in specs.iter().enumerate() {
            for b in &specs[i + 1..] {
                let differ = [
                    a.rs_bits != b.rs_bits,
                    a.ag_bits != b.ag_bits,
                    a.group != b.group,
                    a.spikes != b.spikes,
                ];
                if differ.iter().filter(|d| **d).count() < 2 {
                    continue;
                }
                pairs += 1;
                p.quant = Some(*a);
                let sa = call_signature(&p, Some(DataType::Bf16));
                p.quant = Some(*b);
                same += u32::from(sa == call_signature(&p, Some(DataType::Bf16)));
            }
        }
        assert_eq!((same, pairs), (689, 11_376));
    }

    /// docs/protocols.md ("Zero-copy between processes") states how long the exchange at capture
    /// waits: the same number as the code's.
    #[test]
    fn the_documented_capture_wait_is_the_codes() {
        let secs = CAPTURE_WAIT.as_secs();
        assert_eq!(CAPTURE_WAIT, std::time::Duration::from_secs(secs));
        let path = format!("{}/../../docs/protocols.md", env!("CARGO_MANIFEST_DIR"));
        let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        for said in [
            format!("takes part in an exchange (at most {secs} s)"),
            format!("{secs} s at capture"),
        ] {
            assert!(doc.contains(&said), "docs/protocols.md should say: {said}");
        }
    }

    #[test]
    fn overlapping_buffers_are_staged_unless_in_place() {
        const MB: u64 = 1 << 20;
        let base = 0x7f00_0000_0000u64;
        // Disjoint buffers, and NCCL's in-place layouts, pass.
        for (coll, send, recv, in_place) in [
            (Collective::AllReduce, (base, MB), (base + MB, MB), 0),
            (Collective::AllReduce, (base, MB), (base, MB), 0),
            // ReduceScatter of 4 ranks, rank 2: recv is the third quarter of send.
            (
                Collective::ReduceScatter,
                (base, 4 * MB),
                (base + 2 * MB, MB),
                2 * MB,
            ),
            // AllGather of 4 ranks, rank 3: send is the last quarter of recv.
            (
                Collective::AllGather,
                (base + 3 * MB, MB),
                (base, 4 * MB),
                3 * MB,
            ),
            (
                Collective::AllGather,
                (base + 4 * MB, MB),
                (base, 4 * MB),
                MB,
            ),
            // AllToAll of 4 ranks in place: one buffer, NCCL's layout (each rank may choose).
            (Collective::AlltoAll, (base, 4 * MB), (base, 4 * MB), 0),
        ] {
            assert_eq!(
                buffer_staging(coll, send, recv, in_place, 1),
                Staging::default(),
                "{coll:?} {send:?} {recv:?}"
            );
        }
        // Overlaps at any other offset would race: the input is staged, and the reason said.
        for (coll, send, recv, in_place) in [
            (Collective::AllReduce, (base, MB), (base + 2, MB), 0),
            (Collective::AllReduce, (base + MB - 1, MB), (base, MB), 0),
            (
                Collective::ReduceScatter,
                (base, 4 * MB),
                (base + MB, MB),
                2 * MB,
            ),
            (
                Collective::ReduceScatter,
                (base, 4 * MB),
                (base, MB),
                2 * MB,
            ),
            (Collective::AllGather, (base, MB), (base, 4 * MB), 3 * MB),
            (
                Collective::AllGather,
                (base + 3 * MB + 8, MB),
                (base, 4 * MB),
                3 * MB,
            ),
            (Collective::AlltoAll, (base, 4 * MB), (base + MB, 4 * MB), 0),
        ] {
            let st = buffer_staging(coll, send, recv, in_place, 1);
            assert!(st.input && !st.output, "{coll:?} {send:?} {recv:?}: {st:?}");
            let m = st.why.unwrap_or_default();
            assert!(m.contains("overlap") && m.contains("in place"), "{m}");
        }
    }

    #[test]
    fn quantized_calls_stage_buffers_that_are_not_element_aligned() {
        let base = 0x7f00_0000_0000u64;
        assert_eq!(
            buffer_staging(Collective::AllReduce, (base, 64), (base + 4096, 64), 0, 2),
            Staging::default()
        );
        // (send, recv) -> (input staged, output staged); in place, both.
        for (s, r, want) in [
            (base + 1, base + 4096, (true, false)),
            (base, base + 4097, (false, true)),
            (base + 1, base + 4097, (true, true)),
            (base + 1, base + 1, (true, true)),
        ] {
            let st = buffer_staging(Collective::AllReduce, (s, 64), (r, 64), 0, 2);
            assert_eq!((st.input, st.output), want, "{s:#x} {r:#x}");
            assert!(st.why.is_some_and(|m| m.contains("aligned")));
        }
        // The lossless kernels take any alignment.
        assert_eq!(
            buffer_staging(
                Collective::AllReduce,
                (base + 1, 64),
                (base + 4097, 64),
                0,
                1
            ),
            Staging::default()
        );
    }

    #[test]
    fn call_signatures_differ_by_collective_datatype_and_quantization_and_fit_8_bits() {
        use std::collections::HashSet;
        let arena = Arena::new(2, 64 << 20).unwrap();
        let model = CostModel::default_for(2);
        let mut seen = HashSet::new();
        for coll in [Collective::AllReduce, Collective::ReduceScatter] {
            for t in [DataType::F32, DataType::F16, DataType::Bf16] {
                let p = plan::plan(
                    &arena,
                    &model,
                    coll,
                    4096,
                    t.bytes(),
                    16,
                    Choice::Auto,
                    Choice::Auto,
                );
                let sig = call_signature(&p, Some(t));
                assert!(sig > 0 && sig < 256);
                assert!(seen.insert(sig), "{coll:?} {t:?}");
                // The quantized kernels take f16 and bf16 only (f32 is refused before a launch).
                if t == DataType::F32 {
                    continue;
                }
                let mut q = p;
                q.quant = Some(QuantSpec::new(4, 4, 128, 2).unwrap());
                assert!(
                    seen.insert(call_signature(&q, Some(t))),
                    "quantized {coll:?} {t:?}"
                );
            }
        }
        let p = plan::plan(
            &arena,
            &model,
            Collective::AllGather,
            4096,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        // An AllGather moves bytes: its datatype does not count.
        assert_eq!(
            call_signature(&p, None),
            call_signature(&p, Some(DataType::F16))
        );
        assert!(seen.insert(call_signature(&p, None)));
    }

    /// A direct rank stages exactly where letting peers read its send buffer could go wrong:
    /// misaligned input, pieces peers cannot load as vectors, overlaps other than NCCL's in-place
    /// layouts of AllGather and ReduceScatter.
    #[test]
    fn direct_ranks_stage_where_peers_could_read_what_they_write() {
        let arena = Arena::with_pull(4, 64 << 20, 32 << 20).unwrap();
        let model = CostModel::default_for(4);
        let stage = abi::FLAG_PULL_STAGE_SEND;
        let plan_of = |coll: Collective, algo: Algorithm| {
            plan::plan(
                &arena,
                &model,
                coll,
                1024,
                2,
                64,
                Choice::Force(algo),
                Choice::Force(Protocol::Pull),
            )
        };
        let (rank, n, piece) = (2u32, 4u32, 4096u64);
        let (send, recv) = (1u64 << 32, 2u64 << 32);
        let ar1 = plan_of(Collective::AllReduce, Algorithm::OneShot);
        let ar2 = plan_of(Collective::AllReduce, Algorithm::TwoShot);
        let ag = plan_of(Collective::AllGather, Algorithm::OneShot);
        let rs = plan_of(Collective::ReduceScatter, Algorithm::OneShot);
        let a2a = plan_of(Collective::AlltoAll, Algorithm::OneShot);
        let f = Communicator::direct_staging;
        for p in [&ar1, &ar2, &ag, &rs, &a2a] {
            // Separate, aligned buffers: peers read in place.
            assert_eq!(f(p, rank, n, send, recv, piece), 0, "{p:?}");
            // A misaligned send buffer is staged.
            assert_eq!(f(p, rank, n, send + 2, recv, piece), stage, "{p:?}");
        }
        // In place: AllReduce one-shot stages, two-shot does not.
        assert_eq!(f(&ar1, rank, n, send, send, piece), stage);
        assert_eq!(f(&ar2, rank, n, send, send, piece), 0);
        // AllGather in NCCL's in-place layout reads what no one writes; other overlaps stage.
        assert_eq!(f(&ag, rank, n, recv + 2 * piece, recv, piece), 0);
        assert_eq!(f(&ag, rank, n, recv + piece, recv, piece), stage);
        // ReduceScatter likewise: the output is piece `rank` of the input.
        assert_eq!(f(&rs, rank, n, send, send + 2 * piece, piece), 0);
        assert_eq!(f(&rs, rank, n, send, send + piece, piece), stage);
        // ReduceScatter and AllToAll pieces peers cannot load as vectors are staged.
        assert_eq!(f(&rs, rank, n, send, recv, 4094), stage);
        assert_eq!(f(&a2a, rank, n, send, recv, 4094), stage);
        assert_eq!(f(&ag, rank, n, send, recv, 4094), 0);
        // AllToAll in place: peer s reads block s while this rank writes it.
        assert_eq!(f(&a2a, rank, n, send, send, piece), stage);
        // Buffers that merely touch do not overlap.
        assert_eq!(f(&a2a, rank, n, send, send + 4 * piece, piece), 0);
    }
}
