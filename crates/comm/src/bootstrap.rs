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

/// Rounds of a set-up that every rank finishes alike: each round carries this rank's verdict
/// (ok with a payload, or failed with a reason) beside its payload, and after each round every
/// rank computes the same outcome from the gathered verdicts. A rank that failed between two
/// rounds still takes part in the next one, saying so, so no rank waits for it in vain; and
/// since every rank stops at the first round in which any rank failed, every rank runs the same
/// number of rounds and gets the same verdict, wherever the failure happened.
pub struct Agreement<'a> {
    boot: &'a dyn Bootstrap,
    rounds: u32,
    /// The outcome of the last round on every rank: `Some(true)` every rank went on,
    /// `Some(false)` every rank stopped (or this rank left the exchange), `None` no round yet.
    last: Option<bool>,
    /// Inside a round (its outcome is not known yet).
    in_round: bool,
}

const VERDICT_OK: u8 = 0;
const VERDICT_FAILED: u8 = 1;

impl<'a> Agreement<'a> {
    /// Rounds over `boot`.
    pub fn new(boot: &'a dyn Bootstrap) -> Agreement<'a> {
        Agreement {
            boot,
            rounds: 0,
            last: None,
            in_round: false,
        }
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.boot.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> u32 {
        self.boot.size()
    }

    /// Rounds run so far.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// One round. `mine`: this rank's payload, or why this rank failed. Returns every rank's
    /// payload (rank order) when every rank succeeded; otherwise, on every rank, the same
    /// [`Error::Unsupported`] naming the lowest failing rank and its reason. A failure of the
    /// exchange itself comes back as [`Error::Bootstrap`].
    pub fn round(&mut self, mine: Result<Vec<u8>, String>) -> Result<Vec<Vec<u8>>, Error> {
        let mut frame = Vec::new();
        match &mine {
            Ok(p) => {
                frame.push(VERDICT_OK);
                frame.extend_from_slice(p);
            }
            Err(why) => {
                frame.push(VERDICT_FAILED);
                // Keep the reason short: it travels in a small set-up frame.
                let mut end = why.len().min(512);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                frame.extend_from_slice(&why.as_bytes()[..end]);
            }
        }
        self.rounds += 1;
        self.in_round = true;
        let gathered = self.boot.all_gather(&frame);
        self.in_round = false;
        // Unless every verdict says ok below, every rank stops at this round.
        self.last = Some(false);
        let all = gathered?;
        if all.len() != self.boot.size() as usize {
            return Err(Error::Bootstrap(format!(
                "the exchange returned {} records for {} ranks",
                all.len(),
                self.boot.size()
            )));
        }
        let mut out = Vec::with_capacity(all.len());
        for (r, f) in all.into_iter().enumerate() {
            match f.first() {
                Some(&VERDICT_OK) => out.push(f[1..].to_vec()),
                Some(&VERDICT_FAILED) => {
                    return Err(Error::Unsupported(format!(
                        "rank {r}: {}",
                        String::from_utf8_lossy(&f[1..])
                    )));
                }
                _ => {
                    return Err(Error::Unsupported(format!(
                        "rank {r} sent no verdict (a different flashcomm version?)"
                    )));
                }
            }
        }
        self.last = Some(true);
        Ok(out)
    }

    /// After this rank failed outside any round (a panic in a local step): makes sure no rank
    /// waits for it. When the last round went well on every rank (or none ran yet), every other
    /// rank is in, or on its way to, the next round: this rank takes part in it saying `why`, and
    /// every rank stops there with the same verdict. When the last round failed, every rank has
    /// stopped already and nothing is sent. Returns the verdict. (A failure inside a round, whose
    /// outcome this rank cannot know, is the exchange's own and is returned as it is.)
    pub fn abandon(&mut self, why: String) -> Error {
        if self.in_round {
            return Error::Bootstrap(format!(
                "rank {}: {why} (inside round {}: the other ranks may wait)",
                self.rank(),
                self.rounds
            ));
        }
        if self.last == Some(false) {
            return Error::Unsupported(format!("rank {}: {why}", self.rank()));
        }
        match self.round(Err(why.clone())) {
            Err(e) => e,
            Ok(_) => Error::Unsupported(format!("rank {}: {why}", self.rank())),
        }
    }

    /// A round with no payload: every rank learns whether any rank failed.
    pub fn check(&mut self, mine: Result<(), String>) -> Result<(), Error> {
        self.round(mine.map(|()| Vec::new())).map(|_| ())
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
    /// A group of `size` ranks whose all-gathers give up after `timeout` (zero: never).
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
        let deadline = (!g.timeout.is_zero()).then(|| Instant::now() + g.timeout);
        while st.generation == generation {
            let Some(deadline) = deadline else {
                st = g.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            };
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

    /// A bootstrap that counts the rounds it ran.
    struct Counting<'a> {
        inner: &'a ThreadBootstrap,
        rounds: std::sync::atomic::AtomicU32,
    }

    impl Bootstrap for Counting<'_> {
        fn rank(&self) -> u32 {
            self.inner.rank()
        }
        fn size(&self) -> u32 {
            self.inner.size()
        }
        fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
            self.rounds
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.all_gather(mine)
        }
    }

    /// A set-up of `steps` local steps, each followed by a round, the way
    /// `Communicator::new` runs: a failure at a step skips every later local step but still
    /// takes part in the next round.
    fn staged_setup(
        ag: &mut Agreement<'_>,
        steps: u32,
        fail: Option<(u32, u32)>,
    ) -> Result<u32, Error> {
        let mut sum = 0u32;
        for step in 0..steps {
            let local = if fail == Some((ag.rank(), step)) {
                Err(format!("injected failure at step {step}"))
            } else {
                Ok(vec![ag.rank() as u8, step as u8])
            };
            let all = ag.round(local)?;
            for (r, p) in all.iter().enumerate() {
                assert_eq!(p, &vec![r as u8, step as u8]);
                sum += u32::from(p[0]);
            }
        }
        Ok(sum)
    }

    #[test]
    fn agreement_every_rank_runs_the_same_rounds_and_gets_the_same_verdict() {
        const N: u32 = 4;
        const STEPS: u32 = 6;
        let mut cases = vec![None];
        for rank in 0..N {
            for step in 0..STEPS {
                cases.push(Some((rank, step)));
            }
        }
        for fail in cases {
            let g = ThreadGroup::new(N, Duration::from_secs(10));
            let members = g.members();
            let results: Vec<(u32, Result<u32, Error>)> = std::thread::scope(|s| {
                let hs: Vec<_> = members
                    .iter()
                    .map(|m| {
                        s.spawn(move || {
                            let c = Counting {
                                inner: m,
                                rounds: Default::default(),
                            };
                            let mut ag = Agreement::new(&c);
                            let r = staged_setup(&mut ag, STEPS, fail);
                            assert_eq!(
                                ag.rounds(),
                                c.rounds.load(std::sync::atomic::Ordering::Relaxed)
                            );
                            (ag.rounds(), r)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let (rounds0, verdict0) = &results[0];
            for (rounds, verdict) in &results {
                assert_eq!(
                    rounds, rounds0,
                    "{fail:?}: same number of rounds on every rank"
                );
                assert_eq!(verdict, verdict0, "{fail:?}: same verdict on every rank");
            }
            match fail {
                None => {
                    assert_eq!(*rounds0, STEPS);
                    assert_eq!(verdict0, &Ok(STEPS * (0..N).sum::<u32>()));
                }
                Some((rank, step)) => {
                    assert_eq!(
                        *rounds0,
                        step + 1,
                        "{fail:?}: everyone stops at the failed round"
                    );
                    assert_eq!(
                        verdict0,
                        &Err(Error::Unsupported(format!(
                            "rank {rank}: injected failure at step {step}"
                        )))
                    );
                }
            }
        }
    }

    /// A rank that panics in a local step (outside any round) runs one more round saying so, so
    /// every rank stops there with the same verdict, wherever the panic happened; after a round
    /// that failed it sends nothing (every rank has stopped).
    #[test]
    fn a_rank_that_fails_between_rounds_still_ends_the_exchange_alike() {
        const N: u32 = 3;
        const STEPS: u32 = 4;
        for panic_rank in 0..N {
            for panic_after in 0..STEPS {
                let g = ThreadGroup::new(N, Duration::from_secs(10));
                let members = g.members();
                let results: Vec<(u32, Error)> = std::thread::scope(|s| {
                    let hs: Vec<_> = members
                        .iter()
                        .map(|m| {
                            s.spawn(move || {
                                let c = Counting {
                                    inner: m,
                                    rounds: Default::default(),
                                };
                                let mut ag = Agreement::new(&c);
                                let r =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                        for step in 0..STEPS {
                                            if m.rank() == panic_rank && step == panic_after {
                                                panic!("injected");
                                            }
                                            ag.round(Ok(vec![step as u8]))?;
                                        }
                                        Ok::<(), Error>(())
                                    }));
                                let e = match r {
                                    Ok(Ok(())) => Error::Internal("finished".into()),
                                    Ok(Err(e)) => e,
                                    Err(_) => ag.abandon("a panic".into()),
                                };
                                (ag.rounds(), e)
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (rounds, e) in &results {
                    assert_eq!(*rounds, panic_after + 1, "{panic_rank} {panic_after}");
                    assert_eq!(
                        e,
                        &Error::Unsupported(format!("rank {panic_rank}: a panic")),
                        "{panic_rank} {panic_after}"
                    );
                }
            }
        }
    }

    #[test]
    fn agreement_names_the_lowest_failing_rank_and_bounds_the_reason() {
        let g = ThreadGroup::new(3, Duration::from_secs(10));
        let members = g.members();
        let long = "é".repeat(400);
        let results: Vec<Result<Vec<Vec<u8>>, Error>> = std::thread::scope(|s| {
            let hs: Vec<_> = members
                .iter()
                .map(|m| {
                    let long = long.clone();
                    s.spawn(move || {
                        let mine = match m.rank() {
                            0 => Ok(b"fine".to_vec()),
                            1 => Err(long),
                            _ => Err("out of memory".to_string()),
                        };
                        Agreement::new(m).round(mine)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            let Err(Error::Unsupported(msg)) = r else {
                panic!("{r:?}")
            };
            assert!(msg.starts_with("rank 1: é"), "{msg}");
            assert!(msg.len() <= 512 + "rank 1: ".len(), "{}", msg.len());
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn thread_group_times_out_when_a_rank_is_missing() {
        let g = ThreadGroup::new(2, Duration::from_millis(50));
        let m = g.members();
        let e = m[0].all_gather(b"x").unwrap_err();
        assert!(matches!(e, Error::Bootstrap(_)));
    }
}
