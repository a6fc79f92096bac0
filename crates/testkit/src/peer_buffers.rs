//! Buffers every rank registered with its peers, for kernels that read (or write) peers' memory
//! in place: the pull reference AllReduce ([`crate::pull_reference`]), which loads every peer's
//! input where it lies, and the reference kernels launched as one grid for every rank, which need
//! every rank's input and output.
//!
//! Each rank registers its own buffer (address and length) together with every rank's address of
//! the corresponding buffer, in rank order, while every rank is idle (registration is host-side
//! bookkeeping; the addresses come from the caller's exchange). A call then finds the registered
//! buffer that holds its range and takes every rank's address at the same offset: like vLLM's
//! registered buffers, it assumes that every rank of a call passes the same offset into the same
//! registered buffer (the benchmark's ranks always do). Pure host logic, unit-tested on the CPU.

/// The most ranks.
pub const MAX_RANKS: usize = 8;

/// One registered buffer: this rank's range and every rank's base address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    base: u64,
    len: u64,
    peers: [u64; MAX_RANKS],
}

/// The registered buffers of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerBuffers {
    entries: Vec<Entry>,
    nranks: usize,
}

impl PeerBuffers {
    /// An empty registry for `nranks` ranks.
    pub fn new(nranks: usize) -> PeerBuffers {
        PeerBuffers {
            entries: Vec::new(),
            nranks,
        }
    }

    /// Registers this rank's buffer `[base, base + len)`, whose counterpart on rank r starts at
    /// `all[r]` (`all[own rank]` is `base`). A buffer registered again replaces the earlier entry.
    pub fn register(&mut self, base: u64, len: u64, all: &[u64]) -> Result<(), String> {
        if all.len() != self.nranks || all.len() > MAX_RANKS {
            return Err(format!(
                "{} addresses for {} ranks (at most {MAX_RANKS})",
                all.len(),
                self.nranks
            ));
        }
        if !all.contains(&base) {
            return Err(format!(
                "buffer {base:#x} is not among the ranks' addresses"
            ));
        }
        if base.checked_add(len).is_none() {
            return Err(format!("buffer {base:#x} of {len} bytes wraps around"));
        }
        let mut peers = [0u64; MAX_RANKS];
        peers[..all.len()].copy_from_slice(all);
        self.entries.retain(|e| e.base != base);
        self.entries.push(Entry { base, len, peers });
        Ok(())
    }

    /// Every rank's address of the range `[addr, addr + bytes)` of this rank's registered
    /// buffers (rank order; unused ranks 0), or `None` when no registered buffer holds it.
    pub fn lookup(&self, addr: u64, bytes: u64) -> Option<[u64; MAX_RANKS]> {
        let e = self.entries.iter().find(|e| {
            addr >= e.base
                && addr
                    .checked_add(bytes)
                    .is_some_and(|end| end <= e.base + e.len)
        })?;
        let offset = addr - e.base;
        let mut out = [0u64; MAX_RANKS];
        for (o, p) in out.iter_mut().zip(&e.peers[..self.nranks]) {
            *o = p + offset;
        }
        Some(out)
    }

    /// Registered buffers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_gives_every_rank_the_same_offset() {
        let mut b = PeerBuffers::new(3);
        assert!(b.is_empty());
        b.register(0x2000, 0x1000, &[0x1000, 0x2000, 0x9000])
            .unwrap();
        b.register(0x5000, 0x100, &[0x4000, 0x5000, 0x6000])
            .unwrap();
        assert_eq!(b.len(), 2);
        let a = b.lookup(0x2010, 0x20).unwrap();
        assert_eq!(&a[..4], &[0x1010, 0x2010, 0x9010, 0]);
        let c = b.lookup(0x5000, 0x100).unwrap();
        assert_eq!(&c[..3], &[0x4000, 0x5000, 0x6000]);
        // Ranges that no registered buffer holds whole.
        assert_eq!(b.lookup(0x2ff0, 0x20), None);
        assert_eq!(b.lookup(0x1000, 0x10), None);
        assert_eq!(b.lookup(u64::MAX - 4, 8), None);
        // Registering a buffer again replaces it.
        b.register(0x2000, 0x2000, &[0x1000, 0x2000, 0x3000])
            .unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b.lookup(0x2ff0, 0x20).unwrap()[2], 0x3ff0);
    }

    #[test]
    fn bad_registrations_are_refused() {
        let mut b = PeerBuffers::new(2);
        assert!(b.register(0x1000, 16, &[0x1000]).is_err());
        assert!(b.register(0x1000, 16, &[0x2000, 0x3000]).is_err());
        assert!(b.register(u64::MAX, 16, &[u64::MAX, 0]).is_err());
        let mut nine = PeerBuffers::new(9);
        assert!(nine.register(0, 16, &[0; 9]).is_err());
        assert!(b.is_empty());
    }
}
