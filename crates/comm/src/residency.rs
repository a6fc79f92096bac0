//! Co-residence of communicators: the blocks that every live communicator of a process may have
//! on a GPU at once stay under what the GPU keeps resident (docs/protocols.md, "Several
//! communicators at once").
//!
//! flashcomm's kernels wait for their peers' blocks. Two communicators in flight on two streams
//! (tensor- and expert-parallel micro-batches) deadlock when a grid that fills one GPU waits for a
//! peer whose GPU is full of the other communicator's blocks. So each communicator of a process
//! holds a level of a per-device ledger, taken at set-up and given back once its last kernel has
//! finished, and its grid is its rank's share of the GPU halved once per level: the first live
//! communicator may use half of it, the second a quarter, and so on. Whatever the order the GPUs
//! run their kernels in, all of them fit, with room to spare for NCCL's own. A communicator whose
//! share comes to no block stays with NCCL.
//!
//! Ranks of one communicator that are threads of one process hold one level together (their
//! grids must agree); the key is the arena of the lowest such rank, unique while it lives.

use std::sync::Mutex;

use crate::gpu::PerProcess;

/// A level of a device's ledger: (device, communicator key, level, ranks holding it).
type Level = (i32, u64, u32, u32);

/// The levels of every device. Per process: a fork child's GPUs run none of its parent's kernels.
static LEDGER: PerProcess<Mutex<Vec<Level>>> = PerProcess::fresh_in_children();

fn ledger() -> std::sync::MutexGuard<'static, Vec<Level>> {
    LEDGER
        .get(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A communicator's level on its device, given back when dropped.
#[derive(Debug)]
pub(crate) struct Share {
    device: i32,
    key: u64,
    level: u32,
}

impl Share {
    /// The level of the communicator `key` on `device`: the one its ranks of this process already
    /// hold, else the lowest free one.
    pub(crate) fn take(device: i32, key: u64) -> Share {
        let mut l = ledger();
        if let Some(e) = l.iter_mut().find(|e| e.0 == device && e.1 == key) {
            e.3 += 1;
            return Share {
                device,
                key,
                level: e.2,
            };
        }
        let level = (0..)
            .find(|&v| !l.iter().any(|e| e.0 == device && e.2 == v))
            .unwrap_or(u32::MAX);
        l.push((device, key, level, 1));
        Share { device, key, level }
    }

    /// Blocks this rank may launch from its `share` of the GPU (its part of what the GPU keeps
    /// resident): half of it at level 0 (rounded up: a share of one block stays usable), a
    /// quarter at level 1 (rounded down), ...; 0 means none. The levels together never take
    /// more than the share.
    pub(crate) fn grid(&self, share: u32) -> u32 {
        if self.level == 0 {
            return share.div_ceil(2);
        }
        share.checked_shr(self.level.saturating_add(1)).unwrap_or(0)
    }

    pub(crate) fn level(&self) -> u32 {
        self.level
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut l = ledger();
        if let Some(i) = l.iter().position(|e| e.0 == self.device && e.1 == self.key) {
            l[i].3 -= 1;
            if l[i].3 == 0 {
                l.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each device of the ledger is its own: these tests use devices no other test uses.
    #[test]
    fn live_communicators_never_hold_more_than_the_gpu_keeps_resident() {
        let dev = -101;
        let share = 132;
        let mut live: Vec<Share> = Vec::new();
        for key in 1..=10u64 {
            live.push(Share::take(dev, key));
            let used: u32 = live.iter().map(|s| s.grid(share)).sum();
            assert!(
                used < share,
                "{used} blocks of {share} with {} live",
                live.len()
            );
        }
        let grids: Vec<u32> = live.iter().map(|s| s.grid(share)).collect();
        assert_eq!(grids, [66, 33, 16, 8, 4, 2, 1, 0, 0, 0]);
        // A freed level is taken again by the next communicator, the lowest first.
        live.remove(1);
        live.remove(0);
        assert_eq!(Share::take(dev, 20).level(), 0);
        assert_eq!(
            Share::take(dev, 21).level(),
            0,
            "the level of a dropped share is free"
        );
    }

    #[test]
    fn a_small_share_keeps_its_first_communicator_and_never_overflows() {
        let dev = -104;
        for share in 1..=40u32 {
            let live: Vec<Share> = (1..=8u64).map(|k| Share::take(dev, k)).collect();
            let grids: Vec<u32> = live.iter().map(|s| s.grid(share)).collect();
            assert!(grids[0] >= 1, "share {share}: {grids:?}");
            assert!(
                grids.iter().sum::<u32>() <= share,
                "share {share}: {grids:?}"
            );
        }
    }

    #[test]
    fn ranks_of_one_communicator_in_one_process_hold_one_level() {
        let dev = -102;
        let a0 = Share::take(dev, 7);
        let b = Share::take(dev, 8);
        let a1 = Share::take(dev, 7);
        assert_eq!((a0.level(), a1.level(), b.level()), (0, 0, 1));
        drop(a0);
        assert_eq!(
            Share::take(dev, 9).level(),
            2,
            "rank 1 of key 7 still holds level 0"
        );
        drop(a1);
        assert_eq!(Share::take(dev, 10).level(), 0);
        assert_eq!(
            Share::take(-103, 8).level(),
            0,
            "another device has its own ledger"
        );
    }
}
