//! The copy-engine schedule of the lossless AllReduce on the host transport, as pure logic.
//!
//! On a machine whose GPUs lack peer access the host transport moves every byte through pinned
//! host memory. Kernels that store to and load from host memory reach 21-62% of the PCIe floor;
//! the copy engines (`cuMemcpyAsync` device to host and host to device) reach 82-91% in the
//! probes. This schedule moves the bytes with copies only and synchronizes with flags in host
//! memory that the streams themselves write and wait for (`cuStreamWriteValue32`,
//! `cuStreamWaitValue32`): no kernel waits, and no stream waits on a kernel that waits.
//!
//! Each rank runs two streams. The **push** stream copies device to host into the rank's own
//! staging (in host memory), the **pull** stream copies host to device from the peers' staging
//! and runs the one reduction kernel of each piece. The message is cut into pieces; each piece
//! into `nranks` chunks, chunk `c` owned by rank `c`. Per piece `g` (global piece number, which
//! continues across calls; staging half `g & 1`), rank `r`:
//!
//! * push: copies its input's chunk `c` to staging slot `c` for every `c != r`
//!   (rotating from `r + 1`), each followed by a signal `Rs[r][c] = g + 1` and an event; waits for
//!   its own reduction of the piece (event), copies the reduced chunk `r` from its output to
//!   staging slot `r`, signals `Ag[r] = g + 1` and records an event.
//! * pull: for every peer `q` (rotating from `r - 1`), after its own push of the same step (event),
//!   waits for `Rs[q][r] >= g + 1` and copies `q`'s staging slot `r` into gather slot `q` (device
//!   memory); reduces chunk `r` in rank order (its own input for slot `r`) into its output; after
//!   its own all-gather push (event) waits for `Ag[q] >= g + 1` per peer, copies `q`'s slot `q`
//!   into its output's chunk `q`.
//!
//! No staging byte is written twice within a piece (slot `c != r` carries the input chunk for
//! its owner, slot `r` the reduced chunk for everyone), and a half is written again two pieces
//! later, only after the rank's reduction of the piece between, which needs every peer's push of
//! that piece, which each peer made after it read this half (its pull and push streams are
//! ordered by its events): the halves need no flag of their own. The output's chunk `q` is written only after the
//! rank's own push of its input's chunk `q` (the all-gather event), so the call may be in place.
//! Why no order of a rank's streams deadlocks is argued in docs/protocols.md and checked by the
//! simulator in this file's tests, which runs every rank's streams side by side and serialized in
//! random orders.
//!
//! Flag values are `g + 1` as u32 and compared as the driver compares them
//! (`CU_STREAM_WAIT_VALUE_GEQ`: `(flag - value) as i32 >= 0`), so the counters may wrap.

/// A 32-bit flag word in host memory, shared by every rank of the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flag {
    /// `from` has staged its input's chunk for `to` (reduce-scatter step).
    Rs {
        /// The rank that staged.
        from: usize,
        /// The chunk's owner.
        to: usize,
    },
    /// `from` has staged its reduced chunk (all-gather step).
    Ag {
        /// The rank that staged its reduced chunk.
        from: usize,
    },
}

impl Flag {
    /// Index of the word in the communicator's flag table ([`flag_words`] words).
    pub fn index(self, nranks: usize) -> usize {
        match self {
            Flag::Rs { from, to } => from * nranks + to,
            Flag::Ag { from } => nranks * nranks + from,
        }
    }
}

/// Words of the flag table of a communicator of `nranks`.
pub fn flag_words(nranks: usize) -> usize {
    nranks * nranks + nranks
}

/// The flags rank `rank` ever waits for: what a watchdog writes to release it.
pub fn waited_flags(nranks: usize, rank: usize) -> Vec<Flag> {
    let mut v = Vec::new();
    for q in (0..nranks).filter(|&q| q != rank) {
        v.push(Flag::Rs { from: q, to: rank });
        v.push(Flag::Ag { from: q });
    }
    v
}

/// Whether a flag holding `flag` satisfies a wait for `value` (the driver's GEQ, wrap-aware).
pub fn flag_reached(flag: u32, value: u32) -> bool {
    (flag.wrapping_sub(value) as i32) >= 0
}

/// Memory a copy reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mem {
    /// This rank's input buffer (device).
    Input,
    /// This rank's output buffer (device; the input's address when in place).
    Output,
    /// This rank's gather buffer (device): `nranks` slots of [`CopyGeom::slot_bytes`].
    Gather,
    /// Rank `owner`'s staging in host memory: 2 halves of `nranks` slots.
    Stage {
        /// The rank whose staging it is (the only writer).
        owner: usize,
    },
}

/// A byte range of one memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The memory.
    pub mem: Mem,
    /// First byte.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Which stream of the rank runs an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Device-to-host copies into the rank's own staging, and their signals.
    Push,
    /// Waits, host-to-device copies from the peers' staging, and the reduction.
    Pull,
}

/// One operation of a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `cuMemcpyAsync(dst, src, len)`.
    Copy {
        /// Read.
        src: Span,
        /// Written.
        dst: Span,
    },
    /// `cuStreamWaitValue32(flag, value, GEQ)`.
    Wait {
        /// The flag.
        flag: Flag,
        /// The value it must reach.
        value: u32,
    },
    /// A system-scope flush of what the stream wrote, then `cuStreamWriteValue32(flag, value)`.
    Signal {
        /// The flag.
        flag: Flag,
        /// The value written.
        value: u32,
    },
    /// `cuEventRecord(event)` on this stream.
    Record {
        /// Event id, below [`event_count`].
        event: usize,
    },
    /// `cuStreamWaitEvent(event)`: the latest record of `event` enqueued before this operation.
    WaitEvent {
        /// Event id.
        event: usize,
    },
    /// Element-wise sum in rank order, `dst = src[0] + src[1] + ... + src[n-1]` (in f32, rounded
    /// once: the order of docs/protocols.md "Reduction order"); `elems` elements.
    Reduce {
        /// One span per rank, in rank order.
        srcs: Vec<Span>,
        /// Where the sum goes.
        dst: Span,
        /// Elements.
        elems: usize,
    },
}

/// The shape of one call of the schedule, the same on every rank but `rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyGeom {
    /// Ranks of the communicator.
    pub nranks: usize,
    /// This rank.
    pub rank: usize,
    /// Bytes per element.
    pub elem_bytes: usize,
    /// Elements of the call.
    pub count: usize,
    /// Elements per piece (the last piece may be shorter).
    pub piece_elems: usize,
    /// Global number of the call's first piece (the communicator's piece counter).
    pub first_piece: u32,
}

/// Alignment of a staging or gather slot.
pub const SLOT_ALIGN: usize = 256;

impl CopyGeom {
    /// The geometry of a call of `count` elements of `elem_bytes` with pieces of at most
    /// `piece_bytes` (rounded down to whole elements, at least `nranks` elements).
    pub fn new(
        nranks: usize,
        rank: usize,
        elem_bytes: usize,
        count: usize,
        piece_bytes: usize,
        first_piece: u32,
    ) -> CopyGeom {
        let piece_elems = (piece_bytes / elem_bytes).max(nranks);
        CopyGeom {
            nranks,
            rank,
            elem_bytes,
            count,
            piece_elems,
            first_piece,
        }
    }

    /// Pieces of the call (0 for an empty call).
    pub fn pieces(&self) -> usize {
        self.count.div_ceil(self.piece_elems)
    }

    /// Elements of a full piece's chunk.
    pub fn chunk_elems(&self) -> usize {
        self.piece_elems.div_ceil(self.nranks)
    }

    /// Bytes of a staging or gather slot.
    pub fn slot_bytes(&self) -> usize {
        (self.chunk_elems() * self.elem_bytes).next_multiple_of(SLOT_ALIGN)
    }

    /// Bytes of one rank's staging (two halves of `nranks` slots).
    pub fn stage_bytes(&self) -> usize {
        2 * self.nranks * self.slot_bytes()
    }

    /// Bytes of one rank's gather buffer.
    pub fn gather_bytes(&self) -> usize {
        self.nranks * self.slot_bytes()
    }

    /// First element and length of chunk `c` of piece `p` (a piece-local number).
    pub fn chunk(&self, p: usize, c: usize) -> (usize, usize) {
        let start = p * self.piece_elems;
        let len = self.piece_elems.min(self.count - start);
        let ce = self.chunk_elems();
        let a = (c * ce).min(len);
        let b = ((c + 1) * ce).min(len);
        (start + a, b - a)
    }

    /// The piece counter after this call.
    pub fn next_piece(&self) -> u32 {
        self.first_piece.wrapping_add(self.pieces() as u32)
    }

    fn buf(&self, mem: Mem, p: usize, c: usize) -> Span {
        let (e0, n) = self.chunk(p, c);
        Span {
            mem,
            offset: e0 * self.elem_bytes,
            len: n * self.elem_bytes,
        }
    }

    fn stage(&self, owner: usize, g: u32, slot: usize, len: usize) -> Span {
        let half = (g & 1) as usize;
        Span {
            mem: Mem::Stage { owner },
            offset: (half * self.nranks + slot) * self.slot_bytes(),
            len,
        }
    }

    fn gather(&self, slot: usize, len: usize) -> Span {
        Span {
            mem: Mem::Gather,
            offset: slot * self.slot_bytes(),
            len,
        }
    }
}

/// Events of a piece: `nranks - 1` reduce-scatter steps, the reduction, the all-gather push.
/// Ids are reused piece after piece; every wait is enqueued before the next record of its id.
pub fn event_count(nranks: usize) -> usize {
    nranks + 1
}

fn ev_rs(step: usize) -> usize {
    step - 1
}
fn ev_red(nranks: usize) -> usize {
    nranks - 1
}
fn ev_ag(nranks: usize) -> usize {
    nranks
}

/// The operations of one rank's call, in an order the host may enqueue them (each event is
/// recorded before it is waited for, and waited for before it is recorded again). Each lane's
/// operations, taken in this order, are that stream's program.
pub fn schedule(geom: &CopyGeom) -> Vec<(Lane, Op)> {
    let n = geom.nranks;
    let r = geom.rank;
    let mut ops = Vec::new();
    for p in 0..geom.pieces() {
        let g = geom.first_piece.wrapping_add(p as u32);
        let v = g.wrapping_add(1);
        // Push, reduce-scatter. The half was last written for piece g - 2; every reader is done
        // with it (docs/protocols.md: the halves need no flag of their own).
        let out = &mut ops;
        for k in 1..n {
            let c = (r + k) % n;
            let src = geom.buf(Mem::Input, p, c);
            out.push((
                Lane::Push,
                Op::Copy {
                    src,
                    dst: geom.stage(r, g, c, src.len),
                },
            ));
            out.push((
                Lane::Push,
                Op::Signal {
                    flag: Flag::Rs { from: r, to: c },
                    value: v,
                },
            ));
            out.push((Lane::Push, Op::Record { event: ev_rs(k) }));
        }
        // Pull, reduce-scatter: each step after the rank's own push of the same step.
        let mine = geom.buf(Mem::Input, p, r);
        let mut srcs: Vec<Span> = (0..n).map(|s| geom.gather(s, mine.len)).collect();
        srcs[r] = mine;
        for k in 1..n {
            let q = (r + n - k) % n;
            out.push((Lane::Pull, Op::WaitEvent { event: ev_rs(k) }));
            out.push((
                Lane::Pull,
                Op::Wait {
                    flag: Flag::Rs { from: q, to: r },
                    value: v,
                },
            ));
            out.push((
                Lane::Pull,
                Op::Copy {
                    src: geom.stage(q, g, r, mine.len),
                    dst: geom.gather(q, mine.len),
                },
            ));
        }
        let dst = geom.buf(Mem::Output, p, r);
        out.push((
            Lane::Pull,
            Op::Reduce {
                srcs,
                dst,
                elems: mine.len / geom.elem_bytes,
            },
        ));
        out.push((Lane::Pull, Op::Record { event: ev_red(n) }));
        // Push, all-gather: the reduced chunk, once reduced.
        out.push((Lane::Push, Op::WaitEvent { event: ev_red(n) }));
        out.push((
            Lane::Push,
            Op::Copy {
                src: dst,
                dst: geom.stage(r, g, r, dst.len),
            },
        ));
        out.push((
            Lane::Push,
            Op::Signal {
                flag: Flag::Ag { from: r },
                value: v,
            },
        ));
        out.push((Lane::Push, Op::Record { event: ev_ag(n) }));
        // Pull, all-gather: after the rank's own all-gather push (so after it pushed every input
        // chunk of the piece, which the output's chunks may overwrite in place).
        out.push((Lane::Pull, Op::WaitEvent { event: ev_ag(n) }));
        for k in 1..n {
            let q = (r + n - k) % n;
            let d = geom.buf(Mem::Output, p, q);
            out.push((
                Lane::Pull,
                Op::Wait {
                    flag: Flag::Ag { from: q },
                    value: v,
                },
            ));
            out.push((
                Lane::Pull,
                Op::Copy {
                    src: geom.stage(q, g, q, d.len),
                    dst: d,
                },
            ));
        }
    }
    ops
}

/// Bytes of the flag block at the start of a rank's copy area (its `nranks + 1` flag words, one
/// 256-byte block so the staging after it stays aligned).
pub const FLAG_BLOCK_BYTES: usize = 256;

impl Flag {
    /// Where the word lives: the rank whose copy area holds it (its only writer) and the word's
    /// index in that area's flag block.
    pub fn home(self, nranks: usize) -> (usize, usize) {
        match self {
            Flag::Rs { from, to } => (from, to),
            Flag::Ag { from } => (from, nranks),
        }
    }
}

/// Bytes of a rank's copy area in its host segment: the flag block, then the staging.
pub fn copy_area_bytes(geom: &CopyGeom) -> usize {
    FLAG_BLOCK_BYTES + geom.stage_bytes()
}

/// Bytes of the pieces the communicator cuts a call into: of 1, 2 and 4 MiB the largest was the
/// fastest at 2 and 4 ranks (docs/experiments.md, "The copy-engine schedule on the GPU"); each
/// piece is a round of stream operations, and the staging holds two of them.
pub const PIECE_BYTES: usize = 4 << 20;

/// Under `auto`, the smallest call that takes the schedule: from 1 MiB (the smallest size timed)
/// it was faster than the kernels at 2 and 4 ranks, eager, as threads and as processes
/// (docs/experiments.md, "The copy-engine schedule through calls"); smaller calls are
/// latency-bound, and the schedule's every piece costs a chain of stream operations.
pub const AUTO_MIN_BYTES: u64 = 1 << 20;

/// The element sizes the schedule reduces (f16, bf16: 2 bytes; f32: 4).
const ELEM_BYTES: [usize; 2] = [2, 4];

/// The largest `bytes` of the geometry of `nranks` ranks over the element sizes.
fn most(nranks: usize, bytes: impl Fn(&CopyGeom) -> usize) -> usize {
    ELEM_BYTES
        .iter()
        .map(|&eb| bytes(&CopyGeom::new(nranks, 0, eb, 1, PIECE_BYTES, 0)))
        .max()
        .unwrap_or(0)
}

/// Bytes of a rank's copy area for `nranks` ranks, enough for every element size.
pub fn area_bytes(nranks: usize) -> usize {
    most(nranks, copy_area_bytes)
}

/// Bytes of a rank's gather buffer (device memory) for `nranks` ranks, every element size.
pub fn gather_bytes(nranks: usize) -> usize {
    most(nranks, CopyGeom::gather_bytes)
}

/// Whether an eager lossless AllReduce of `bytes` bytes (a sum of f16, bf16 or f32, on a
/// communicator that has the copy area) takes the schedule under `setting`: `on`, every call;
/// `auto`, those of at least [`AUTO_MIN_BYTES`]; `off`, none. The caller asks whether the call is
/// being captured only after this (captured calls take the kernels: the schedule's flag values
/// are per call, docs/protocols.md, "Graphs"); every rank decides alike, as long as every rank
/// captures the same calls.
pub fn takes(setting: super::HostCopy, bytes: u64) -> bool {
    use super::HostCopy;
    bytes > 0
        && match setting {
            HostCopy::Off => false,
            HostCopy::On => true,
            HostCopy::Auto => bytes >= AUTO_MIN_BYTES,
        }
}

/// Device addresses one rank's call runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyAddrs {
    /// The user's input.
    pub input: u64,
    /// The user's output (the input's address when in place).
    pub output: u64,
    /// This rank's gather buffer ([`CopyGeom::gather_bytes`], device memory).
    pub gather: u64,
    /// Every rank's copy area as this rank's device addresses it ([`copy_area_bytes`] each).
    pub areas: Vec<u64>,
}

impl CopyAddrs {
    /// The device address of a span's first byte.
    pub fn span(&self, s: Span) -> u64 {
        let base = match s.mem {
            Mem::Input => self.input,
            Mem::Output => self.output,
            Mem::Gather => self.gather,
            Mem::Stage { owner } => self.areas[owner] + FLAG_BLOCK_BYTES as u64,
        };
        base + s.offset as u64
    }

    /// The device address of a flag word.
    pub fn flag(&self, f: Flag) -> u64 {
        let (owner, word) = f.home(self.areas.len());
        self.areas[owner] + 4 * word as u64
    }
}

/// What executes a schedule's operations: the CUDA driver on two streams, or a test's model.
pub trait Engine {
    /// The engine's error.
    type Error;
    /// Copies `bytes` bytes from `src` to `dst` on `lane`.
    fn copy(&mut self, lane: Lane, dst: u64, src: u64, bytes: usize) -> Result<(), Self::Error>;
    /// Waits on `lane` until the word at `addr` reaches `value` ([`flag_reached`]).
    fn wait(&mut self, lane: Lane, addr: u64, value: u32) -> Result<(), Self::Error>;
    /// Fences what `lane` wrote, then writes `value` to the word at `addr`.
    fn signal(&mut self, lane: Lane, addr: u64, value: u32) -> Result<(), Self::Error>;
    /// Records event `event` on `lane`.
    fn record(&mut self, lane: Lane, event: usize) -> Result<(), Self::Error>;
    /// Makes `lane` wait for the latest record of `event`.
    fn wait_event(&mut self, lane: Lane, event: usize) -> Result<(), Self::Error>;
    /// Sums `elems` elements of `srcs` (one address per rank, in rank order) into `dst`.
    fn reduce(
        &mut self,
        lane: Lane,
        srcs: &[u64],
        dst: u64,
        elems: usize,
    ) -> Result<(), Self::Error>;
}

/// Enqueues `ops` (one rank's [`schedule`]) on `engine` at the addresses of `addrs`, in order.
/// Empty copies and reductions of no element are skipped; their signals are not.
pub fn execute<E: Engine>(
    ops: &[(Lane, Op)],
    addrs: &CopyAddrs,
    engine: &mut E,
) -> Result<(), E::Error> {
    for (lane, op) in ops {
        let lane = *lane;
        match op {
            Op::Copy { src, dst } if src.len > 0 => {
                engine.copy(lane, addrs.span(*dst), addrs.span(*src), src.len)?
            }
            Op::Copy { .. } => {}
            Op::Wait { flag, value } => engine.wait(lane, addrs.flag(*flag), *value)?,
            Op::Signal { flag, value } => engine.signal(lane, addrs.flag(*flag), *value)?,
            Op::Record { event } => engine.record(lane, *event)?,
            Op::WaitEvent { event } => engine.wait_event(lane, *event)?,
            Op::Reduce { srcs, dst, elems } if *elems > 0 => {
                let srcs: Vec<u64> = srcs.iter().map(|s| addrs.span(*s)).collect();
                engine.reduce(lane, &srcs, addrs.span(*dst), *elems)?
            }
            Op::Reduce { .. } => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod sim;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::HostCopy;

    #[test]
    fn the_area_and_gather_buffer_hold_every_element_size() {
        for n in 2..=8 {
            for eb in ELEM_BYTES {
                let g = CopyGeom::new(n, n - 1, eb, 1 << 30, PIECE_BYTES, 0);
                assert!(
                    copy_area_bytes(&g) <= area_bytes(n),
                    "{n} ranks, {eb}-byte elements"
                );
                assert!(g.gather_bytes() <= gather_bytes(n));
            }
            // About twice the piece in host memory, one piece on the device.
            assert!(area_bytes(n) <= 2 * PIECE_BYTES + 2 * n * SLOT_ALIGN + FLAG_BLOCK_BYTES + 64);
            assert!(gather_bytes(n) <= PIECE_BYTES + n * SLOT_ALIGN + 64);
        }
    }

    #[test]
    fn which_calls_take_the_schedule() {
        for bytes in [0, 1, AUTO_MIN_BYTES - 1, AUTO_MIN_BYTES, 1 << 30] {
            assert!(!takes(HostCopy::Off, bytes));
            assert_eq!(takes(HostCopy::On, bytes), bytes > 0);
            assert_eq!(takes(HostCopy::Auto, bytes), bytes >= AUTO_MIN_BYTES);
        }
    }
}
