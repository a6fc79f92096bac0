//! How ranks exchange a few bytes while a communicator is set up. The communicator needs only
//! an all-gather of small host buffers; where it comes from depends on how the communicator is
//! made: the real NCCL (from the shim), or threads of one process (virtual ranks for tests and for
//! several GPUs in one process). Tests and tools add their own (`flashcomm-testkit`'s
//! `FileBootstrap`: files in a shared folder, for rank processes on one machine).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::Error;

/// An all-gather of small host buffers among the ranks of a communicator.
pub trait Bootstrap: Send + Sync {
    /// This rank.
    fn rank(&self) -> u32;
    /// Number of ranks.
    fn size(&self) -> u32;
    /// Every rank's `mine`, indexed by rank. Every rank must call it the same number of times.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error>;
    /// Waits until every rank has arrived.
    fn barrier(&self) -> Result<(), Error> {
        self.all_gather(&[]).map(|_| ())
    }
}

struct GroupState {
    generation: u64,
    arrived: u32,
    slots: Vec<Vec<u8>>,
    published: Arc<Vec<Vec<u8>>>,
}

/// The shared half of an in-process group; [`ThreadGroup::members`] hands out one
/// [`ThreadBootstrap`] per rank.
pub struct ThreadGroup {
    size: u32,
    timeout: Duration,
    state: Mutex<GroupState>,
    cv: Condvar,
}

impl ThreadGroup {
    /// A group of `size` ranks whose all-gathers give up after `timeout`.
    pub fn new(size: u32, timeout: Duration) -> Arc<ThreadGroup> {
        Arc::new(ThreadGroup {
            size,
            timeout,
            state: Mutex::new(GroupState {
                generation: 0,
                arrived: 0,
                slots: vec![Vec::new(); size as usize],
                published: Arc::new(Vec::new()),
            }),
            cv: Condvar::new(),
        })
    }

    /// One bootstrap per rank.
    pub fn members(self: &Arc<Self>) -> Vec<ThreadBootstrap> {
        (0..self.size)
            .map(|rank| ThreadBootstrap {
                group: self.clone(),
                rank,
            })
            .collect()
    }
}

/// One rank of a [`ThreadGroup`].
pub struct ThreadBootstrap {
    group: Arc<ThreadGroup>,
    rank: u32,
}

impl Bootstrap for ThreadBootstrap {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.group.size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let g = &self.group;
        let mut st = g.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.generation;
        st.slots[self.rank as usize] = mine.to_vec();
        st.arrived += 1;
        if st.arrived == g.size {
            let all = std::mem::replace(&mut st.slots, vec![Vec::new(); g.size as usize]);
            st.published = Arc::new(all);
            st.arrived = 0;
            st.generation += 1;
            g.cv.notify_all();
            return Ok((*st.published).clone());
        }
        let deadline = Instant::now() + g.timeout;
        while st.generation == generation {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Bootstrap(format!(
                    "rank {} waited {:?} for the other ranks",
                    self.rank, g.timeout
                )));
            }
            st =
                g.cv.wait_timeout(st, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
        }
        Ok((*st.published).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_group_gathers_in_rank_order_many_times() {
        let g = ThreadGroup::new(4, Duration::from_secs(10));
        let members = g.members();
        std::thread::scope(|s| {
            for m in &members {
                s.spawn(move || {
                    for round in 0..50u8 {
                        let all = m.all_gather(&[m.rank() as u8, round]).unwrap();
                        assert_eq!(all.len(), 4);
                        for (r, v) in all.iter().enumerate() {
                            assert_eq!(v, &vec![r as u8, round]);
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn thread_group_times_out_when_a_rank_is_missing() {
        let g = ThreadGroup::new(2, Duration::from_millis(50));
        let m = g.members();
        let e = m[0].all_gather(b"x").unwrap_err();
        assert!(matches!(e, Error::Bootstrap(_)));
    }
}
