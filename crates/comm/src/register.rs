//! Registered buffers: user memory that peers of other processes read in place (zero-copy,
//! docs/protocols.md, "Zero-copy between processes: registered buffers", which this module
//! implements: the board, its words, who takes part, identity and lifetimes).
//!
//! Why a board and not a collective exchange per registration: registration is not collective
//! in effect (a buffer registered on some ranks only, or at different times, is read in place
//! where every peer mapped it and staged elsewhere, with the same bits), so a rank publishes a
//! peer the address of its buffer in that peer's process only once the peer acknowledged it, and
//! no rank ever waits on the normal path.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::abi::MAX_RANKS;
use crate::gpu::{HostArena, IpcMapping, UserAllocation};

/// Registrations a rank's board holds at once (further ones are served by staging).
pub(crate) const SLOTS: usize = 128;
/// Words of one slot: state, base, length, handle (8), the handle's kind.
const SLOT_WORDS: usize = 12;
/// The first slot's word (word 0 counts changes, word 1 the collective exchanges the owner began:
/// [`Registry::exchange`]).
const SLOTS_AT: usize = 8;
/// The word that counts the owner's collective exchanges.
const ROUNDS: usize = 1;
/// The first acknowledgement's word: `[slot][peer]` pairs of (generation, address).
const ACKS_AT: usize = SLOTS_AT + SLOTS * SLOT_WORDS;
/// Bytes of a board.
pub(crate) const BOARD_BYTES: usize = 32768;
const _: () = assert!((ACKS_AT + SLOTS * MAX_RANKS * 2) * 8 <= BOARD_BYTES);

/// A board's words: the shared segment, or plain memory in tests.
pub(crate) trait Words {
    fn load(&self, word: usize) -> u64;
    fn store(&self, word: usize, v: u64);
}

impl Words for HostArena {
    fn load(&self, word: usize) -> u64 {
        self.load_u64(word * 8)
    }
    fn store(&self, word: usize, v: u64) {
        self.store_u64(word * 8, v)
    }
}

fn state_word(slot: usize) -> usize {
    SLOTS_AT + slot * SLOT_WORDS
}

fn ack_word(slot: usize, peer: u32) -> usize {
    ACKS_AT + (slot * MAX_RANKS + peer as usize) * 2
}

/// What a slot announces: the allocation, its handle and the handle's kind (0: a legacy IPC
/// handle, 1: a file descriptor to take from the owner's process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Export {
    pub base: u64,
    pub len: u64,
    pub handle: [u8; 64],
    pub kind: u64,
}

/// Writes `e` into a free slot of board `b` (one whose state is not live) and returns the slot
/// and its new generation; `None` when every slot is live.
pub(crate) fn publish<W: Words + ?Sized>(b: &W, e: &Export) -> Option<(usize, u64)> {
    let slot = (0..SLOTS).find(|&s| b.load(state_word(s)) & 1 == 0)?;
    let w = state_word(slot);
    let gen_ = (b.load(w) >> 1) + 1;
    b.store(w + 1, e.base);
    b.store(w + 2, e.len);
    for (i, c) in e.handle.chunks_exact(8).enumerate() {
        b.store(
            w + 3 + i,
            u64::from_le_bytes(c.try_into().expect("8 bytes")),
        );
    }
    b.store(w + 11, e.kind);
    b.store(w, gen_ << 1 | 1);
    b.store(0, b.load(0).wrapping_add(1));
    Some((slot, gen_))
}

/// Marks `slot` of generation `gen_` free (its peers' mappings stay open: see the module).
pub(crate) fn retract<W: Words + ?Sized>(b: &W, slot: usize, gen_: u64) {
    let w = state_word(slot);
    if b.load(w) == gen_ << 1 | 1 {
        b.store(w, gen_ << 1);
        b.store(0, b.load(0).wrapping_add(1));
    }
}

/// The live slots of a board, with their generation and export, read consistently (a slot
/// rewritten while it was read is left for the next look, which the change count brings).
pub(crate) fn live_slots<W: Words + ?Sized>(b: &W) -> Vec<(usize, u64, Export)> {
    let mut out = Vec::new();
    for s in 0..SLOTS {
        let w = state_word(s);
        let st = b.load(w);
        if st & 1 == 0 {
            continue;
        }
        let mut handle = [0u8; 64];
        for i in 0..8 {
            handle[8 * i..8 * i + 8].copy_from_slice(&b.load(w + 3 + i).to_le_bytes());
        }
        let e = Export {
            base: b.load(w + 1),
            len: b.load(w + 2),
            handle,
            kind: b.load(w + 11),
        };
        if b.load(w) == st {
            out.push((s, st >> 1, e));
        }
    }
    out
}

/// Whether every board in `boards` announced exchange `k` (or a later one).
pub(crate) fn peers_reached<'a, W: Words + 'a>(
    boards: impl IntoIterator<Item = &'a W>,
    k: u64,
) -> bool {
    boards.into_iter().all(|b| b.load(ROUNDS) >= k)
}

/// Peer `peer` acknowledges generation `gen_` of `slot`: its process sees the allocation at
/// `addr` (0: it could not map it).
pub(crate) fn acknowledge<W: Words + ?Sized>(b: &W, slot: usize, gen_: u64, peer: u32, addr: u64) {
    let w = ack_word(slot, peer);
    b.store(w + 1, addr);
    b.store(w, gen_);
}

/// Where `peer` sees generation `gen_` of `slot`: `None` until it acknowledged, `Some(0)` when it
/// could not map it.
pub(crate) fn acknowledged<W: Words + ?Sized>(
    b: &W,
    slot: usize,
    gen_: u64,
    peer: u32,
) -> Option<u64> {
    let w = ack_word(slot, peer);
    (b.load(w) == gen_).then(|| b.load(w + 1))
}

/// Whether the owner of board `b` takes part in `rank`'s exchanges: it opened `rank`'s board at
/// set-up and has not withdrawn.
pub(crate) fn takes_part<W: Words + ?Sized>(b: &W, rank: u32) -> bool {
    b.load(OPENED) & 1 << rank != 0 && b.load(ROUNDS) != WITHDRAWN
}

/// One registration of this rank.
#[derive(Clone, Copy, Debug)]
struct Entry {
    id: u64,
    ptr: u64,
    len: u64,
    /// The allocation exported, with its board slot and generation (`None`: not exportable, or
    /// no peer of another process: served as any unregistered buffer).
    export: Option<Exported>,
    /// A call captured into a graph published it: its slot stays live (peers keep their mapping)
    /// until the communicator is released, since replays keep publishing it.
    pinned: bool,
}

/// An export of this rank: the allocation, its board slot and the slot's generation.
type Exported = (UserAllocation, usize, u64);

/// What a registration is: its id, to deregister it.
pub type RegistrationId = u64;

/// The value of a board's exchange word once its owner takes no more part in exchanges (one of
/// its exchanges timed out): peers no longer wait for it.
const WITHDRAWN: u64 = u64::MAX;
/// The word where a board's owner says whose boards it opened at set-up (bit q: rank q's):
/// only such peers acknowledge its registrations, so only they are waited for.
const OPENED: usize = 2;

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    next_id: u64,
    /// Collective exchanges begun ([`Registry::exchange`]).
    rounds: u64,
    /// An exchange of this rank timed out: it takes no more part in exchanges (its board says
    /// [`WITHDRAWN`]), so neither it nor its peers wait again.
    withdrawn: bool,
    /// Exports no longer registered and never captured: retracted (and so unmapped by the
    /// peers) once this rank's launches have finished, since peers may read them until then.
    pending: Vec<Exported>,
    /// Exports deregistered after a graph captured them: live until the communicator is
    /// released.
    pinned: Vec<Exported>,
    /// Per peer: the change count of its board last read.
    seen: [u64; MAX_RANKS],
    /// Per peer and slot: the generation acknowledged.
    imported: Vec<[u64; SLOTS]>,
    /// Mappings of peers' live exports: (peer, handle); closed once the owner retracts the
    /// export.
    maps: Vec<(u32, [u8; 64], IpcMapping)>,
}

/// A rank's registrations, its board and its peers' boards.
pub(crate) struct Registry {
    rank: u32,
    /// Per rank: reached by address (a rank of this process: any buffer is readable).
    local: [bool; MAX_RANKS],
    nranks: u32,
    /// Per rank: its process's identity token (set-up records), which an import of a file
    /// descriptor from that process checks.
    tokens: [u64; MAX_RANKS],
    own: Option<HostArena>,
    boards: Vec<Option<HostArena>>,
    state: Mutex<State>,
}

impl Registry {
    /// A registry with no board (every peer of this process, or zero-copy off).
    pub(crate) fn local_only(rank: u32, nranks: u32, local: [bool; MAX_RANKS]) -> Registry {
        Registry {
            rank,
            local,
            nranks,
            tokens: [0; MAX_RANKS],
            own: None,
            boards: Vec::new(),
            state: Mutex::new(State::default()),
        }
    }

    /// A registry with this rank's board and its peers' (`boards[r]`: `None` for this rank,
    /// ranks of this process and boards that could not be opened); says on its own board whose
    /// boards it opened.
    pub(crate) fn with_boards(
        rank: u32,
        nranks: u32,
        local: [bool; MAX_RANKS],
        tokens: [u64; MAX_RANKS],
        own: HostArena,
        boards: Vec<Option<HostArena>>,
    ) -> Registry {
        let opened = boards
            .iter()
            .enumerate()
            .filter(|(_, b)| b.is_some())
            .fold(0u64, |m, (q, _)| m | 1 << q);
        own.store(OPENED, opened);
        let state = State {
            imported: vec![[0; SLOTS]; nranks as usize],
            ..State::default()
        };
        Registry {
            rank,
            local,
            nranks,
            tokens,
            own: Some(own),
            boards,
            state: Mutex::new(state),
        }
    }

    /// Every peer has opened this rank's board (set-up's next round passed): its name can go.
    pub(crate) fn peers_mapped(&mut self) {
        if let Some(b) = self.own.as_mut() {
            b.unlink();
        }
    }

    /// Whether some peer is of another process and this rank has a board (zero-copy possible).
    pub(crate) fn has_boards(&self) -> bool {
        self.own.is_some()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The peers this rank's exchanges wait for: of another process, with a board this rank
    /// opened, that opened this rank's board, and not withdrawn.
    fn partners(&self) -> Vec<u32> {
        (0..self.nranks)
            .filter(|&q| {
                let Some(Some(b)) = self.boards.get(q as usize) else {
                    return false;
                };
                !self.local[q as usize] && takes_part(b, self.rank)
            })
            .collect()
    }

    /// Registers `len` bytes at `ptr` (the device's context current): exported to the board when
    /// peers of other processes exist and the driver can export the allocation (otherwise the
    /// buffer is served as unregistered ones are, by staging, which is no error). A full board
    /// first gives up the slots of registered allocations that were freed since (retracted once
    /// `idle` says this rank's launches have finished).
    pub(crate) fn register(&self, ptr: u64, len: u64, idle: &dyn Fn() -> bool) -> RegistrationId {
        let export = self.own.as_ref().and_then(|b| {
            let a = crate::gpu::user_allocation(ptr, crate::identity::process_token())
                .map_err(|e| {
                    tracing::debug!(
                        "buffer {ptr:#x} ({len} bytes) registered but not exportable ({e}): \
                         peers of other processes read it staged"
                    )
                })
                .ok()?;
            let kind = match a.kind {
                crate::gpu::ExportKind::Legacy => 0,
                crate::gpu::ExportKind::Fd => 1,
            };
            let e = Export {
                base: a.base,
                len: a.len,
                handle: a.handle,
                kind,
            };
            let (slot, gen_) = publish(b, &e)
                .or_else(|| {
                    self.release_freed();
                    self.retire(idle);
                    publish(b, &e)
                })
                .or_else(|| {
                    crate::gpu::close_export(&a);
                    tracing::debug!("every registration slot is taken: buffer {ptr:#x} is staged");
                    None
                })?;
            Some((a, slot, gen_))
        });
        let mut st = self.state();
        st.next_id += 1;
        let id = st.next_id;
        st.entries.push(Entry {
            id,
            ptr,
            len,
            export,
            pinned: false,
        });
        id
    }

    /// Gives up the exports of registrations whose allocation was freed since (the driver's
    /// buffer id changed) and that no graph captured: their registrations stay (deregistering
    /// them is no error) but stage.
    fn release_freed(&self) {
        let mut st = self.state();
        let st = &mut *st;
        for e in st.entries.iter_mut() {
            if let Some(x) = e
                .export
                .filter(|(a, _, _)| !e.pinned && crate::gpu::buffer_id(e.ptr) != Some(a.buffer_id))
            {
                e.export = None;
                st.pending.push(x);
            }
        }
    }

    /// Retracts the exports given up ([`State::pending`]) once `idle` says this rank's launches
    /// have finished: every call that published one to a peer has then ended, and a direct
    /// call's kernel ends only after every peer stopped reading its buffers, so peers can close
    /// their mappings as soon as they see the slot retracted.
    fn retire(&self, idle: &dyn Fn() -> bool) {
        let Some(b) = self.own.as_ref() else { return };
        if self.state().pending.is_empty() || !idle() {
            return;
        }
        for (a, slot, gen_) in std::mem::take(&mut self.state().pending) {
            retract(b, slot, gen_);
            crate::gpu::close_export(&a);
        }
    }

    /// The exchange at capture: a direct call being captured into a CUDA graph registers the
    /// allocations holding `ptrs` that are not registered yet (or were freed since), for the rest
    /// of the communicator's life, pins their exports (replays keep publishing them), and takes
    /// part in a collective exchange ([`Registry::exchange`], at most `limit`), so that the
    /// graph's kernels read every peer's buffers in place at every replay. Every rank captures
    /// the same calls, so every rank runs the same exchanges in the same order.
    pub(crate) fn register_captured(&self, ptrs: &[u64], limit: Duration) {
        if self.own.is_none() {
            return;
        }
        let mut ids = Vec::with_capacity(ptrs.len());
        for &ptr in ptrs {
            let bid = crate::gpu::buffer_id(ptr);
            let existing = self.state().entries.iter().find_map(|e| {
                let (a, _, _) = e.export?;
                (ptr >= e.ptr && ptr < e.ptr + e.len && Some(a.buffer_id) == bid).then_some(e.id)
            });
            match existing {
                Some(id) => ids.push(id),
                None => {
                    if let Ok(a) =
                        crate::gpu::user_allocation(ptr, crate::identity::process_token())
                    {
                        crate::gpu::close_export(&a);
                        ids.push(self.register(a.base, a.len, &|| false));
                    }
                }
            }
        }
        for e in self.state().entries.iter_mut() {
            if ids.contains(&e.id) {
                e.pinned = true;
            }
        }
        self.exchange(&ids, limit);
    }

    /// A collective exchange of registrations `ids` (every rank calls it at the same point: a
    /// window registration, a captured call, the calibration): this rank announces that it
    /// began exchange k (after its registrations are on its board), then waits, at most `limit`,
    /// until (1) every partner ([`Registry::partners`]) announced exchange k and this rank has
    /// looked at the boards since, which maps and acknowledges everything they registered before
    /// it, and (2) every partner acknowledged `ids`. No rank leaves before it acknowledged every
    /// partner's registrations of the exchange, so a rank that finishes early never leaves a
    /// later peer waiting. A rank whose exchange times out withdraws from exchanges for good
    /// (later ones return at once, and its peers stop waiting for it): one bad exchange costs
    /// the job one wait, not one per call. Whether both held in time.
    pub(crate) fn exchange(&self, ids: &[RegistrationId], limit: Duration) -> bool {
        let Some(own) = self.own.as_ref() else {
            return true;
        };
        let k = {
            let mut st = self.state();
            if st.withdrawn {
                return false;
            }
            st.rounds += 1;
            st.rounds
        };
        own.store(ROUNDS, k);
        let t0 = Instant::now();
        let mut reached = false;
        loop {
            self.refresh(&|| false);
            let partners = self.partners();
            if reached && self.acknowledged_by(ids, &partners) {
                return true;
            }
            if !reached {
                reached = peers_reached(
                    partners
                        .iter()
                        .filter_map(|&q| self.boards.get(q as usize)?.as_ref()),
                    k,
                );
                if reached {
                    continue;
                }
            }
            if t0.elapsed() >= limit {
                tracing::debug!(
                    "a registration exchange timed out: this rank takes no more part in them \
                     (its peers stage for what they have not mapped)"
                );
                own.store(ROUNDS, WITHDRAWN);
                self.state().withdrawn = true;
                return false;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Whether every peer in `peers` acknowledged the current generation of each of `ids` that
    /// was exported (a registration that could not be exported has nothing to wait for).
    fn acknowledged_by(&self, ids: &[RegistrationId], peers: &[u32]) -> bool {
        let Some(own) = self.own.as_ref() else {
            return true;
        };
        let st = self.state();
        ids.iter().all(|id| {
            let export = st
                .entries
                .iter()
                .find(|e| e.id == *id)
                .and_then(|e| e.export);
            export.is_none_or(|(_, slot, gen_)| {
                peers
                    .iter()
                    .all(|&q| acknowledged(own, slot, gen_, q).is_some())
            })
        })
    }

    /// Removes registration `id`; false when there is none. Its export is retracted once `idle`
    /// says this rank's launches have finished (now, or at a later call), unless a graph
    /// captured it.
    pub(crate) fn deregister(&self, id: RegistrationId, idle: &dyn Fn() -> bool) -> bool {
        {
            let mut st = self.state();
            let Some(i) = st.entries.iter().position(|e| e.id == id) else {
                return false;
            };
            let e = st.entries.swap_remove(i);
            if let Some(x) = e.export {
                if e.pinned {
                    st.pinned.push(x);
                } else {
                    st.pending.push(x);
                }
            }
        }
        self.retire(idle);
        true
    }

    /// Opens what peers registered since the last look and acknowledges it, and closes the
    /// mappings of what they retracted (the device's context current); retracts this rank's
    /// given-up exports when `idle` ([`Registry::retire`]). Cheap when nothing changed: one load
    /// per peer's board.
    pub(crate) fn refresh(&self, idle: &dyn Fn() -> bool) {
        if self.own.is_none() {
            return;
        }
        self.retire(idle);
        let mut st = self.state();
        let st = &mut *st;
        for (r, b) in self.boards.iter().enumerate() {
            let Some(b) = b else { continue };
            let changes = b.load(0);
            if changes == st.seen[r] {
                continue;
            }
            st.seen[r] = changes;
            let live = live_slots(b);
            // What the owner retracted is read by no call any more (see `retire`).
            st.maps
                .retain(|(p, h, _)| *p != r as u32 || live.iter().any(|(_, _, e)| e.handle == *h));
            for (slot, gen_, e) in live {
                if st.imported[r][slot] == gen_ {
                    continue;
                }
                let addr = match st
                    .maps
                    .iter()
                    .find(|(p, h, _)| *p == r as u32 && *h == e.handle)
                {
                    Some((_, _, m)) => m.ptr(),
                    None => match if e.kind == 1 {
                        IpcMapping::open_fd(&e.handle, self.tokens[r])
                    } else {
                        IpcMapping::open(&e.handle)
                    } {
                        Ok(m) => {
                            let a = m.ptr();
                            st.maps.push((r as u32, e.handle, m));
                            a
                        }
                        Err(err) => {
                            tracing::debug!(
                                "rank {r}'s registered allocation {:#x} could not be mapped \
                                 ({err}): it stages for this rank",
                                e.base
                            );
                            0
                        }
                    },
                };
                acknowledge(b, slot, gen_, self.rank, addr);
                st.imported[r][slot] = gen_;
            }
        }
    }

    /// Peers' allocations this rank has mapped now.
    pub(crate) fn mapped(&self) -> usize {
        self.state().maps.len()
    }
    /// Where each rank's process sees the `len` bytes at `ptr` of this rank: `ptr` itself for
    /// ranks of this process, the mapping a peer acknowledged for the others; `None` when some
    /// peer of another process cannot read them in place (not registered, not yet acknowledged,
    /// or no longer the allocation registered). Needs the device's context current.
    pub(crate) fn views(&self, ptr: u64, len: u64) -> Option<[u64; MAX_RANKS]> {
        let mut v = [0u64; MAX_RANKS];
        let all_local = (0..self.nranks as usize).all(|q| self.local[q]);
        for (q, x) in v.iter_mut().enumerate().take(self.nranks as usize) {
            if self.local[q] {
                *x = ptr;
            }
        }
        if all_local {
            return Some(v);
        }
        let b = self.own.as_ref()?;
        let st = self.state();
        let end = ptr.checked_add(len)?;
        let (a, slot, gen_) = st.entries.iter().find_map(|e| {
            let (a, slot, gen_) = e.export?;
            (ptr >= e.ptr && end <= e.ptr + e.len).then_some((a, slot, gen_))
        })?;
        drop(st);
        if crate::gpu::buffer_id(ptr) != Some(a.buffer_id) {
            return None;
        }
        for q in 0..self.nranks {
            if self.local[q as usize] {
                continue;
            }
            let at = acknowledged(b, slot, gen_, q).filter(|&x| x != 0)?;
            v[q as usize] = at + (ptr - a.base);
        }
        Some(v)
    }

    /// Closes the peers' mappings and this rank's exported descriptors (the device's context
    /// current).
    pub(crate) fn close(&self) {
        let mut st = self.state();
        let st = &mut *st;
        st.maps.clear();
        let exports = st.entries.drain(..).filter_map(|e| e.export);
        for (a, _, _) in exports
            .chain(st.pending.drain(..))
            .chain(st.pinned.drain(..))
        {
            crate::gpu::close_export(&a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    struct Mem(Vec<AtomicU64>);
    impl Mem {
        fn new() -> Mem {
            Mem((0..BOARD_BYTES / 8).map(|_| AtomicU64::new(0)).collect())
        }
    }
    impl Words for Mem {
        fn load(&self, w: usize) -> u64 {
            self.0[w].load(Ordering::Acquire)
        }
        fn store(&self, w: usize, v: u64) {
            self.0[w].store(v, Ordering::Release)
        }
    }

    fn export(base: u64) -> Export {
        let mut handle = [0u8; 64];
        for (i, h) in handle.iter_mut().enumerate() {
            *h = (base as u8).wrapping_add(i as u8);
        }
        Export {
            base,
            len: 1 << 20,
            handle,
            kind: base & 1,
        }
    }

    #[test]
    fn a_slot_round_trips_and_counts_a_change() {
        let b = Mem::new();
        let (s, g) = publish(&b, &export(0x7000_0000)).unwrap();
        assert_eq!((s, g), (0, 1));
        assert_eq!(b.load(0), 1);
        assert_eq!(live_slots(&b), vec![(0, 1, export(0x7000_0000))]);
    }

    #[test]
    fn acknowledgements_name_their_generation() {
        let b = Mem::new();
        let (s, g) = publish(&b, &export(0x1000)).unwrap();
        assert_eq!(acknowledged(&b, s, g, 3), None);
        acknowledge(&b, s, g, 3, 0xabc0);
        assert_eq!(acknowledged(&b, s, g, 3), Some(0xabc0));
        assert_eq!(acknowledged(&b, s, g, 2), None);
        // The slot is freed and reused: the old acknowledgement does not count for the new buffer.
        retract(&b, s, g);
        assert!(live_slots(&b).is_empty());
        let (s2, g2) = publish(&b, &export(0x2000)).unwrap();
        assert_eq!((s2, g2), (s, g + 1));
        assert_eq!(acknowledged(&b, s2, g2, 3), None);
        // A peer that could not map it says so with address 0.
        acknowledge(&b, s2, g2, 3, 0);
        assert_eq!(acknowledged(&b, s2, g2, 3), Some(0));
    }

    #[test]
    fn a_stale_retraction_leaves_the_new_generation_alone() {
        let b = Mem::new();
        let (s, g) = publish(&b, &export(0x1000)).unwrap();
        retract(&b, s, g);
        let (_, g2) = publish(&b, &export(0x3000)).unwrap();
        retract(&b, s, g);
        assert_eq!(live_slots(&b), vec![(s, g2, export(0x3000))]);
    }

    #[test]
    fn an_exchange_is_reached_when_every_board_announced_it() {
        let (a, b) = (Mem::new(), Mem::new());
        assert!(peers_reached([&a, &b], 0));
        a.store(ROUNDS, 1);
        assert!(!peers_reached([&a, &b], 1));
        b.store(ROUNDS, 2);
        assert!(peers_reached([&a, &b], 1));
        assert!(!peers_reached([&a, &b], 2));
        assert!(peers_reached(std::iter::empty::<&Mem>(), 7));
    }

    #[test]
    fn a_full_board_refuses_more() {
        let b = Mem::new();
        for i in 0..SLOTS {
            assert_eq!(publish(&b, &export(i as u64 * 16)).map(|x| x.0), Some(i));
        }
        assert_eq!(publish(&b, &export(0xffff)), None);
        retract(&b, 5, 1);
        assert_eq!(publish(&b, &export(0xffff)), Some((5, 2)));
    }

    #[test]
    fn ranks_of_one_process_see_any_buffer_in_place() {
        let mut local = [false; MAX_RANKS];
        local[..4].fill(true);
        let r = Registry::local_only(1, 4, local);
        assert!(!r.has_boards());
        assert_eq!(r.views(0x5000, 64).unwrap()[..4], [0x5000; 4]);
        let id = r.register(0x5000, 64, &|| true);
        assert!(r.exchange(&[id], Duration::ZERO));
        assert!(r.deregister(id, &|| true));
        assert!(!r.deregister(id, &|| true));
        assert_eq!(r.mapped(), 0);
    }

    #[test]
    fn only_peers_that_opened_the_board_and_did_not_withdraw_take_part() {
        let b = Mem::new();
        assert!(!takes_part(&b, 1));
        b.store(OPENED, 0b101);
        assert!(takes_part(&b, 0) && takes_part(&b, 2) && !takes_part(&b, 1));
        b.store(ROUNDS, 7);
        assert!(takes_part(&b, 2));
        b.store(ROUNDS, WITHDRAWN);
        assert!(!takes_part(&b, 0) && !takes_part(&b, 2));
        // A withdrawn board counts as having reached every exchange: no one waits for it.
        assert!(peers_reached([&b], u64::MAX - 1));
    }

    #[test]
    fn peers_of_another_process_without_a_board_stage() {
        let mut local = [false; MAX_RANKS];
        local[0] = true;
        let r = Registry::local_only(0, 2, local);
        assert_eq!(r.views(0x5000, 64), None);
    }
}
