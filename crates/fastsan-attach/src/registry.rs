//! What this host has attached: one small JSON file per attaching process
//! in the run directory (`$FASTSAN_RUN_DIR`, else `/run/fastsan/attach`),
//! rewritten every second with the process's state, removed when it ends.
//! `attach --list` reads them; `detach` finds the process to signal there.
//! A file whose process is gone (killed) is removed by the next reader.

use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Entry {
    pub pid: u32,
    pub url: String,
    /// `/dev/nbdN`, or the file under the FUSE mount.
    pub device: String,
    /// `nbd` or `fuse`.
    pub kind: String,
    /// `attached`, `reconnecting` (some connections down), `down` (all of
    /// them: I/O waits up to the reconnect timeout), `detaching`.
    pub state: String,
    pub connections_up: usize,
    pub connections: usize,
    pub requests: u64,
    pub errors: u64,
    pub retries: u64,
    pub reconnects: u64,
    /// Detaches refused because the device was in use (mounted, held).
    pub refusals: u64,
}

pub fn dir() -> PathBuf {
    std::env::var_os("FASTSAN_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/fastsan/attach"))
}

/// This process's entry; the file goes when it is dropped.
pub struct Registration {
    path: PathBuf,
}

impl Registration {
    pub fn new(e: &Entry) -> io::Result<Registration> {
        let d = dir();
        std::fs::create_dir_all(&d)?;
        let r = Registration { path: d.join(format!("{}.json", e.pid)) };
        r.update(e)?;
        Ok(r)
    }

    /// Rewrites the entry (whole: a reader never sees half of it).
    pub fn update(&self, e: &Entry) -> io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(e).map_err(io::Error::other)?)?;
        std::fs::rename(&tmp, &self.path)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 || *libc::__errno_location() == libc::EPERM }
}

/// Every live entry, by device.
pub fn list() -> Vec<Entry> {
    let Ok(rd) = std::fs::read_dir(dir()) else { return Vec::new() };
    let mut out: Vec<Entry> = rd
        .flatten()
        .filter(|f| f.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|f| {
            let e: Entry = serde_json::from_slice(&std::fs::read(f.path()).ok()?).ok()?;
            if alive(e.pid) {
                Some(e)
            } else {
                let _ = std::fs::remove_file(f.path());
                None
            }
        })
        .collect();
    out.sort_by(|a, b| a.device.cmp(&b.device));
    out
}

/// The entry serving `target`: a device, a FUSE directory, or its file.
pub fn find(target: &Path) -> Option<Entry> {
    let want = std::fs::canonicalize(target).unwrap_or_else(|_| target.to_path_buf());
    list().into_iter().find(|e| {
        let dev = Path::new(&e.device);
        dev == want || dev == target || dev.parent() == Some(want.as_path()) || dev.parent() == Some(target)
    })
}
