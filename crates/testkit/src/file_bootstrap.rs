//! All-gather through files in a folder that every rank can see: how rank processes on one
//! machine (the GPU tests under MPS, `flashcomm-perf --mode procs`) build a communicator without
//! the real NCCL. A test and tool helper, not part of the product's API.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use flashcomm_comm::{Bootstrap, Error};

/// All-gather through files in a folder that every rank can see (processes on one machine):
/// round k of rank r is written to `<dir>/<k>.<r>` (atomically, by rename) and read by all.
pub struct FileBootstrap {
    dir: PathBuf,
    rank: u32,
    size: u32,
    timeout: Duration,
    round: Mutex<u64>,
}

impl FileBootstrap {
    /// Rank `rank` of `size` exchanging through `dir` (created if missing).
    pub fn new(
        dir: &Path,
        rank: u32,
        size: u32,
        timeout: Duration,
    ) -> Result<FileBootstrap, Error> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::Bootstrap(format!("cannot create {}: {e}", dir.display())))?;
        Ok(FileBootstrap {
            dir: dir.to_path_buf(),
            rank,
            size,
            timeout,
            round: Mutex::new(0),
        })
    }
}

impl Bootstrap for FileBootstrap {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let mut round = self.round.lock().unwrap_or_else(|e| e.into_inner());
        let k = *round;
        *round += 1;
        let io = |e: std::io::Error| {
            Error::Bootstrap(format!("file exchange in {}: {e}", self.dir.display()))
        };
        let tmp = self.dir.join(format!("{k}.{}.tmp", self.rank));
        std::fs::write(&tmp, mine).map_err(io)?;
        std::fs::rename(&tmp, self.dir.join(format!("{k}.{}", self.rank))).map_err(io)?;
        let deadline = Instant::now() + self.timeout;
        let mut out = Vec::with_capacity(self.size as usize);
        for r in 0..self.size {
            let path = self.dir.join(format!("{k}.{r}"));
            loop {
                match std::fs::read(&path) {
                    Ok(b) => {
                        out.push(b);
                        break;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        if Instant::now() >= deadline {
                            return Err(Error::Bootstrap(format!(
                                "rank {} waited {:?} for rank {r} (round {k})",
                                self.rank, self.timeout
                            )));
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(e) => return Err(io(e)),
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_bootstrap_exchanges_between_threads() {
        let dir = std::env::temp_dir().join(format!("flashcomm-fb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::thread::scope(|s| {
            for r in 0..3u32 {
                let dir = dir.clone();
                s.spawn(move || {
                    let b = FileBootstrap::new(&dir, r, 3, Duration::from_secs(10)).unwrap();
                    for k in 0..5u8 {
                        let all = b.all_gather(&[r as u8, k]).unwrap();
                        assert_eq!(all, (0..3u8).map(|i| vec![i, k]).collect::<Vec<_>>());
                    }
                });
            }
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
