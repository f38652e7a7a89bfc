//! What this host has attached: one small JSON file per attaching process
//! in the run directory (`$FASTSAN_RUN_DIR`, else `/run/fastsan/attach`),
//! rewritten every second with the process's state, removed when it ends.
//! `attach --list` reads them; `detach` finds the process to signal there.
//! A file whose process is gone (killed) is removed by the next reader.

use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Entry {
    pub pid: u32,
    /// When the process started (clock ticks after boot, as in
    /// /proc/PID/stat): a pid reused by another process is not taken for it.
    pub started: u64,
    pub url: String,
    /// `/dev/nbdN`, or the file under the FUSE mount.
    pub device: String,
    /// `nbd` or `fuse`.
    pub kind: String,
    /// `attaching`, `attached`, `reconnecting` (some connections down),
    /// `down` (all of them: I/O waits up to the reconnect timeout),
    /// `detaching`, or `failed: WHY` (left by a process that ended so).
    pub state: String,
    pub connections_up: usize,
    pub connections: usize,
    pub requests: u64,
    pub errors: u64,
    /// Requests of the kernel received and not yet answered (NBD devices;
    /// `None` where not counted). Up while nothing moves: a stuck request.
    #[serde(default)]
    pub in_flight: Option<u64>,
    pub retries: u64,
    pub reconnects: u64,
    /// Detaches refused (the device was in use, or its sync failed).
    pub refusals: u64,
    /// Why the last one was refused.
    pub note: String,
}

/// This process's entry, filled with what every entry says of it.
pub fn this_process(url: &str, kind: &str) -> Entry {
    let pid = std::process::id();
    Entry {
        pid,
        started: start_time(pid).unwrap_or(0),
        url: url.to_owned(),
        kind: kind.to_owned(),
        ..Default::default()
    }
}

/// Field 22 of /proc/PID/stat (after the parenthesised command name).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

pub fn dir() -> PathBuf {
    std::env::var_os("FASTSAN_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/fastsan/attach"))
}

/// This process's entry; the file goes when it is dropped, unless the
/// process [`Registration::fail`]ed.
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

impl Registration {
    /// Leaves the entry behind with `failed: WHY`, for `detach` (or the
    /// next `--list`) to report once.
    pub fn fail(self, mut e: Entry, why: &str) {
        e.state = format!("failed: {why}");
        let _ = self.update(&e);
        std::mem::forget(self);
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn alive(e: &Entry) -> bool {
    start_time(e.pid).is_some_and(|t| t == e.started)
}

/// Every live entry, by device; and, once, each entry a process left when
/// it failed (the file is removed as it is read).
pub fn list() -> Vec<Entry> {
    let Ok(rd) = std::fs::read_dir(dir()) else { return Vec::new() };
    let mut out: Vec<Entry> = rd
        .flatten()
        .filter(|f| f.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|f| {
            let e: Entry = serde_json::from_slice(&std::fs::read(f.path()).ok()?).ok()?;
            if alive(&e) {
                return Some(e);
            }
            let _ = std::fs::remove_file(f.path());
            e.state.starts_with("failed").then_some(e)
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
        let dir_of_file =
            e.kind == "fuse" && (dev.parent() == Some(want.as_path()) || dev.parent() == Some(target));
        dev == want || dev == target || dir_of_file
    })
}
