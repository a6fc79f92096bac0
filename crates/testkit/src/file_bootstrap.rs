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
    /// Rank `rank` of `size` exchanging through `dir` (created if missing, readable and
    /// writable by this user only). What the folder holds is trusted (it carries the set-up
    /// records: IPC handles, segment names), so a folder that already exists must be a real
    /// folder, not a symbolic link, owned by this user and writable by nobody else: one made in
    /// a shared place such as `/tmp` under a predictable name by someone else is refused.
    pub fn new(
        dir: &Path,
        rank: u32,
        size: u32,
        timeout: Duration,
    ) -> Result<FileBootstrap, Error> {
        private_folder(dir)?;
        Ok(FileBootstrap {
            dir: dir.to_path_buf(),
            rank,
            size,
            timeout,
            round: Mutex::new(0),
        })
    }
}

/// The user of this process (the owner of `/proc/self`).
fn this_user() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

/// Creates `dir` (mode 0700, parents as needed), or checks that the folder already there is one
/// this user alone controls (see [`FileBootstrap::new`]).
pub fn private_folder(dir: &Path) -> Result<(), Error> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let fail = |why: String| Error::Bootstrap(format!("exchange folder {}: {why}", dir.display()));
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| fail(format!("cannot create: {e}")))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(format!("cannot create: {e}"))),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| fail(e.to_string()))?;
    if m.file_type().is_symlink() || !m.is_dir() {
        return Err(fail(
            "not a folder (a symbolic link or a file): refused".into(),
        ));
    }
    if this_user().is_some_and(|me| me != m.uid()) {
        return Err(fail(format!(
            "owned by user {}, not by this user: refused",
            m.uid()
        )));
    }
    if m.permissions().mode() & 0o022 != 0 {
        return Err(fail(format!(
            "writable by other users (mode {:o}): refused",
            m.permissions().mode() & 0o777
        )));
    }
    Ok(())
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

    /// The folder carries the set-up records that ranks trust (IPC handles, segment names): one
    /// that someone else could have made or can write is refused, not used.
    #[test]
    fn a_folder_others_control_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("flashcomm-fb-trust-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let t = Duration::from_secs(1);
        // Pre-created, writable by everyone (what a folder made in /tmp by another user allows).
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = FileBootstrap::new(&open, 0, 1, t).err().expect("refused");
        assert!(e.to_string().contains("writable by other users"), "{e}");
        // A symbolic link to a folder elsewhere.
        let target = base.join("target");
        std::fs::create_dir(&target).unwrap();
        let link = base.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = FileBootstrap::new(&link, 0, 1, t).err().expect("refused");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // A new folder is made private; an existing private one is fine.
        let fresh = base.join("a/b/fresh");
        FileBootstrap::new(&fresh, 0, 1, t).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        FileBootstrap::new(&fresh, 0, 1, t).unwrap();
        let _ = std::fs::remove_dir_all(&base);
    }
}
