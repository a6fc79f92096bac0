//! Where a rank's arena lives and how its peers reach it: the two transports.
//!
//! * **Peer** (`p2p`): the arena is device memory; ranks of one process reach each other's
//!   arenas through peer access (one GPU, or GPUs with peer access between them), ranks of other
//!   processes through legacy CUDA IPC handles. Peers' stores cross NVLink (or the GPU's own
//!   memory, for ranks that share a GPU).
//! * **Host** (`host`): the arena is pinned host memory mapped into every rank's GPU: a POSIX
//!   shared-memory segment, registered with the driver in every process that maps it (ranks of
//!   the creator's own process reach it at the creator's device address, since the registration
//!   is portable). Every byte a peer pushes crosses the sender's PCIe link into host memory and
//!   the receiver's PCIe link back, as NCCL's SHM transport moves it, so this path serves GPUs
//!   without peer access, and it makes the PCIe link measurable on a machine of one GPU.
//!
//! The kernels do not know which transport they run on: they see every rank's arena as a device
//! address (`peer_base`), and readiness travels with the data either way (see docs/protocols.md
//! for why the orderings they rely on hold over PCIe).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;
use crate::gpu::{Device, DeviceMem, HostArena, IpcMapping, Stream};

/// Where the arenas live: the codec crate's word, declared there once.
pub use flashcomm_codec::Transport;

/// The transport's code in the set-up record.
pub(crate) fn code(t: Transport) -> u8 {
    match t {
        Transport::P2p => 1,
        Transport::Host => 2,
    }
}

/// The transport a set-up record's code names.
pub(crate) fn from_code(c: u8) -> Option<Transport> {
    match c {
        1 => Some(Transport::P2p),
        2 => Some(Transport::Host),
        _ => None,
    }
}

/// Bytes of a shared segment's name in the set-up record (NUL-padded).
pub(crate) const NAME_BYTES: usize = 40;

/// Bytes of a rank's epoch words (one `u32` per block index).
const EPOCH_BYTES: usize = crate::abi::MAX_BLOCKS as usize * 4;

/// A rank's own arena.
pub(crate) enum LocalArena {
    /// Device memory (the peer transport).
    Device(DeviceMem),
    /// Pinned host memory (the host transport), with the name peers of other processes open
    /// (shared with the copy-engine schedule's watchdog, which reads its abort word), and the
    /// rank's epoch words in device memory: only this rank's kernels read and advance them, and
    /// in host memory every kernel's first load would cross PCIe (docs/protocols.md, "Epochs").
    Host {
        mem: std::sync::Arc<HostArena>,
        name: [u8; NAME_BYTES],
        epochs: DeviceMem,
    },
    /// Nothing (what a communicator leaves in place of the arena it hands on to be freed).
    Empty,
}

/// The prefix of this process's segment names: `fc-<PID namespace>-`, the namespace's inode
/// number in 8 hex digits, so that names of creators that died can be told apart from those of
/// live processes of other namespaces (`remove_stale_segments`).
fn segment_prefix() -> String {
    // "pid:[4026531836]": the namespace's inode number (32 bits in the kernel; a wider one is
    // folded, keeping the prefix's width fixed).
    let ns = std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("pid:[")?
                .strip_suffix(']')?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0);
    format!("fc-{:08x}-", (ns ^ (ns >> 32)) as u32)
}

/// A unique segment name for this process's next arena: `/<prefix><pid>-<n>`, `n` in base 36.
/// `n` counts from the time the process made its first name, so a name a dead process of the
/// same id left behind (not swept: the id is alive again) is not made again.
pub(crate) fn segment_name() -> String {
    static FIRST: crate::gpu::PerProcess<u64> = crate::gpu::PerProcess::inherited();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let first = *FIRST.get(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let n = first.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed));
    segment_name_of(&segment_prefix(), std::process::id(), n)
}

/// The name of segment `n` of process `pid`: at most 1 + 12 + 10 + 1 + 13 = 37 bytes, so it
/// always fits the set-up record's [`NAME_BYTES`] with its terminating NUL (the process id
/// stays decimal: `remove_stale_segments` reads it so).
fn segment_name_of(prefix: &str, pid: u32, mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut b36 = [0u8; 13];
    let mut i = b36.len();
    loop {
        i -= 1;
        b36[i] = DIGITS[(n % 36) as usize];
        n /= 36;
        if n == 0 {
            break;
        }
    }
    let n = std::str::from_utf8(&b36[i..]).unwrap_or("0");
    format!("/{prefix}{pid}-{n}")
}

impl LocalArena {
    /// Allocates `bytes` of arena, zero-filled, for `transport` on `dev` (its context current).
    pub(crate) fn alloc(
        transport: Transport,
        dev: &std::sync::Arc<Device>,
        bytes: usize,
    ) -> Result<LocalArena, Error> {
        match transport {
            Transport::P2p => Ok(LocalArena::Device(DeviceMem::alloc_zeroed(dev, bytes)?)),
            Transport::Host => {
                // A creator that died between creating its segment and its peers mapping it
                // (set-up round 2) could not remove the name: remove such names now.
                crate::gpu::remove_stale_segments(&segment_prefix());
                let s = segment_name();
                let mem =
                    std::sync::Arc::new(HostArena::create_shared(&s, bytes, dev.numa_node())?);
                let mut name = [0u8; NAME_BYTES];
                name[..s.len()].copy_from_slice(s.as_bytes());
                let epochs = DeviceMem::alloc_zeroed(dev, EPOCH_BYTES)?;
                Ok(LocalArena::Host { mem, name, epochs })
            }
        }
    }

    /// The transport this arena serves.
    pub(crate) fn transport(&self) -> Transport {
        match self {
            LocalArena::Device(_) | LocalArena::Empty => Transport::P2p,
            LocalArena::Host { .. } => Transport::Host,
        }
    }

    /// The device address of the arena (valid in every context of this process).
    pub(crate) fn addr(&self) -> u64 {
        match self {
            LocalArena::Device(m) => m.addr(),
            LocalArena::Host { mem, .. } => mem.dev_ptr(),
            LocalArena::Empty => 0,
        }
    }

    /// The device address of this rank's epoch words (one `u32` per block index): in the
    /// arena's header on the peer transport, in device memory of their own on the host
    /// transport.
    pub(crate) fn epochs_addr(&self) -> u64 {
        match self {
            LocalArena::Host { epochs, .. } => epochs.addr(),
            _ => self.addr() + crate::abi::HDR_EPOCHS,
        }
    }

    /// What a peer of another process needs to map it: the IPC handle of device memory, or the
    /// shared segment's name.
    pub(crate) fn export(&self) -> Option<[u8; 64]> {
        match self {
            LocalArena::Device(m) => m.ipc_handle().ok(),
            LocalArena::Host { name, .. } => {
                let mut h = [0u8; 64];
                h[..NAME_BYTES].copy_from_slice(name);
                Some(h)
            }
            LocalArena::Empty => None,
        }
    }

    /// Reads bytes at `offset` (device memory through `stream`, host memory directly).
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8], stream: Stream) -> Result<(), Error> {
        match self {
            LocalArena::Device(m) => Ok(m.download(offset, dst, stream)?),
            LocalArena::Host { mem, .. } => {
                mem.read(offset, dst);
                Ok(())
            }
            LocalArena::Empty => Err(Error::Internal("the arena was released".into())),
        }
    }

    /// Called once every peer has mapped the arena: the shared segment's name is removed, so that
    /// no name outlives a crashed job (the memory stays until the last process unmaps it).
    pub(crate) fn peers_mapped(&mut self) {
        if let LocalArena::Host { mem, .. } = self
            && let Some(m) = std::sync::Arc::get_mut(mem)
        {
            m.unlink();
        }
    }

    /// The host transport's arena, shared.
    pub(crate) fn host_arena(&self) -> Option<std::sync::Arc<HostArena>> {
        match self {
            LocalArena::Host { mem, .. } => Some(std::sync::Arc::clone(mem)),
            _ => None,
        }
    }
}

/// A peer's arena mapped into this process.
pub(crate) enum PeerMapping {
    /// A peer's device memory opened through its IPC handle.
    Ipc(IpcMapping),
    /// A peer's shared host segment, mapped and registered here.
    Host(HostArena),
}

impl PeerMapping {
    /// Maps the arena of a peer in another process from what it exported.
    pub(crate) fn open(
        transport: Transport,
        export: &[u8; 64],
        bytes: usize,
    ) -> Result<PeerMapping, Error> {
        match transport {
            Transport::P2p => Ok(PeerMapping::Ipc(IpcMapping::open(export)?)),
            Transport::Host => {
                let end = export[..NAME_BYTES]
                    .iter()
                    .position(|&b| b == 0)
                    .unwrap_or(NAME_BYTES);
                let name = std::str::from_utf8(&export[..end]).map_err(|_| {
                    Error::Bootstrap("a peer's host arena name is not valid text".into())
                })?;
                Ok(PeerMapping::Host(HostArena::open_shared(name, bytes)?))
            }
        }
    }

    /// The mapped arena's device address in this process.
    pub(crate) fn ptr(&self) -> u64 {
        match self {
            PeerMapping::Ipc(m) => m.ptr(),
            PeerMapping::Host(m) => m.dev_ptr(),
        }
    }
}

/// Arena header, u32[MAX_RANKS] that no kernel touches: word `q` is set to [`CLOSED`] by rank `q`
/// once it has finished with the communicator (its last launch done, no launch to come), so the
/// arena's owner knows that no peer writes into it any more.
pub(crate) const HDR_CLOSED: u64 = 128;
const _: () = assert!(
    HDR_CLOSED >= crate::abi::HDR_PROBE + 4 * crate::abi::MAX_RANKS as u64
        && HDR_CLOSED + 4 * (crate::abi::MAX_RANKS as u64) <= crate::abi::HDR_EPOCHS
);
/// The value of a peer's closed word.
pub(crate) const CLOSED: u32 = 0xc105_ed01;

/// Tells every peer that this rank has finished with their communicator (`peers`: every rank's
/// arena as mapped here): writes this rank's closed word in each peer's header. Called once the
/// rank's last launch of the communicator has finished and before its peers' mappings close.
pub(crate) fn tell_closed(peers: &[u64], rank: u32) -> Result<(), Error> {
    let words: Vec<u64> = peers
        .iter()
        .enumerate()
        .filter(|&(q, &base)| q != rank as usize && base != 0)
        .map(|(_, &base)| base + HDR_CLOSED + 4 * u64::from(rank))
        .collect();
    crate::gpu::write_words(&words, CLOSED)
}

/// An arena whose peers have not all said they are done with it: freed by [`sweep`] once they
/// have (a peer that never does, because it died or never releases its communicator, leaves it
/// allocated, as before).
struct Kept {
    device: std::sync::Arc<Device>,
    arena: LocalArena,
    rank: u32,
    nranks: u32,
}

/// Per process: a fork child holds none of its parent's arenas.
static KEPT: crate::gpu::PerProcess<std::sync::Mutex<Vec<Kept>>> =
    crate::gpu::PerProcess::fresh_in_children();

fn kept_list() -> std::sync::MutexGuard<'static, Vec<Kept>> {
    KEPT.get(|| std::sync::Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Keeps the arena of a released communicator with peers until every peer's closed word is set:
/// until then a peer that has not noticed a failure yet may still write into it, and freed, its
/// memory could be handed to another allocation and overwritten.
pub(crate) fn keep(device: std::sync::Arc<Device>, arena: LocalArena, rank: u32, nranks: u32) {
    kept_list().push(Kept {
        device,
        arena,
        rank,
        nranks,
    });
}

/// Frees every kept arena whose peers have all closed; returns how many stay. Frees wait for
/// the device's outstanding work: only a release thread that may free calls it.
pub(crate) fn sweep() -> usize {
    let mut kept = kept_list();
    kept.retain(|k| !k.all_closed());
    kept.len()
}

impl Kept {
    /// Whether every peer set its closed word (a device that cannot be read says no).
    fn all_closed(&self) -> bool {
        let Ok(_ctx) = self.device.activate() else {
            return false;
        };
        let Ok(own) = crate::gpu::OwnStream::create() else {
            return false;
        };
        let mut w = [0u8; 4 * crate::abi::MAX_RANKS];
        if self
            .arena
            .read(HDR_CLOSED as usize, &mut w, own.stream())
            .is_err()
        {
            return false;
        }
        (0..self.nranks as usize)
            .filter(|&q| q != self.rank as usize)
            .all(|q| {
                u32::from_le_bytes([w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]]) == CLOSED
            })
    }
}

/// Arenas kept for peers that have not closed yet (the GPU tests of releases).
pub fn kept_arenas() -> usize {
    kept_list().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for t in [Transport::P2p, Transport::Host] {
            assert_eq!(from_code(code(t)), Some(t));
        }
        assert_eq!(from_code(0), None);
    }

    #[test]
    fn segment_names_fit_and_differ() {
        let a = segment_name();
        let b = segment_name();
        assert_ne!(a, b);
        assert!(a.len() < NAME_BYTES && a.starts_with('/') && !a[1..].contains('/'));
        assert!(a[1..].starts_with(&segment_prefix()));
    }

    /// Every name fits the set-up record's field, however long the process lives: before, the
    /// 1,000th segment of a process with a 7-digit id overflowed it (a caught panic, and every
    /// later set-up of the process stayed with NCCL). The longest name possible, the largest
    /// process id and counter, leaves room for the field's terminating NUL. The stale-name
    /// sweep still reads the process id of every name.
    #[test]
    fn the_longest_segment_name_fits_its_field() {
        let prefix = segment_prefix();
        let longest = segment_name_of(&prefix, u32::MAX, u64::MAX);
        assert!(
            longest.len() < NAME_BYTES,
            "{longest}: {} bytes",
            longest.len()
        );
        assert_eq!(prefix.len(), "fc-01234567-".len(), "{prefix}");
        for (n, text) in [(0, "0"), (35, "z"), (36, "10"), (u64::MAX, "3w5e11264sgsf")] {
            assert_eq!(segment_name_of("p-", 7, n), format!("/p-7-{text}"));
        }
        for pid in [1, 4_194_304, i32::MAX as u32] {
            let n = segment_name_of(&prefix, pid, 1_000);
            let rest = n.strip_prefix('/').unwrap().strip_prefix(&prefix).unwrap();
            assert_eq!(
                rest.split('-').next().unwrap().parse::<i32>().ok(),
                Some(pid as i32),
                "{n}"
            );
        }
    }

    /// The sweep of names whose creator died reads this format: a dead creator's name goes, a
    /// live one's stays.
    #[test]
    fn names_of_dead_creators_are_swept_in_this_format() {
        let dead = {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            let pid = c.id();
            c.wait().unwrap();
            pid
        };
        let prefix = segment_prefix();
        let stale = segment_name_of(&prefix, dead, u64::MAX);
        let live = segment_name();
        let path = |n: &str| std::path::PathBuf::from(format!("/dev/shm{n}"));
        for n in [&stale, &live] {
            std::fs::write(path(n), b"").unwrap();
        }
        crate::gpu::remove_stale_segments(&prefix);
        assert!(
            !path(&stale).exists(),
            "{stale}: the dead creator's name is gone"
        );
        assert!(path(&live).exists(), "{live}: a live creator's name stays");
        std::fs::remove_file(path(&live)).unwrap();
    }
}
