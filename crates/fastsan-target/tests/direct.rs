//! `,direct` file volumes: reads and writes go to the device through the
//! volume's ring (io_uring), many in flight, and come back right (a regular
//! file's writes that allocate through the ring's threads that may wait);
//! FLUSH and FUA writes still take the I/O pool; a device that runs out of
//! space (a file's filesystem, or a block device's, where the ring itself
//! sees the error) fails the write that hit it and nothing acknowledged
//! before.

mod common;

use common::{disk_dir, pattern, round_trip, sparse, SmallFs, TestServer};
use fastsan_brp::Status;
use fastsan_initiator::{Error, Options, Volume};
use std::path::Path;
use std::process::Command;

const MIB: u64 = 1 << 20;

async fn connect(srv: &TestServer, connections: usize) -> Volume {
    Volume::connect(&srv.url("v"), Options { connections, ..Default::default() }).await.expect("connects")
}

/// Hundreds of writes in flight at once (more than the ring's 128 entries),
/// of 4 KiB to 1 MiB, then as many reads: every byte read is the byte
/// written, through the target and straight from the device too; a FUA
/// write and a FLUSH (the I/O pool's) mixed in. Twice: into a fresh (sparse)
/// volume, whose writes allocate, then over what the first round wrote.
async fn many_in_flight(path: &Path) {
    let spec = format!("v=file:{},direct", path.display());
    let srv = TestServer::start(&[spec.as_str()], |c| c.queue_depth = 256).await;
    let caps = srv.handle.catalog().get("v").unwrap().caps();
    assert!(caps.submit && caps.submit_writes, "a direct volume reads and writes through its ring");
    let vol = connect(&srv, 2).await;
    for seed in 1..=2 {
        round_trip(&vol, path, seed).await;
    }
    let st = srv.handle.volume_stats("v").unwrap();
    assert!(st.writes >= 600 && st.reads >= 600 && st.errors == 0, "counted through the ring: {st:?}");
    drop(vol);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_file_reads_and_writes_through_its_ring_with_hundreds_in_flight() {
    let dir = disk_dir("ring");
    let path = dir.path().join("v.img");
    sparse(&path, 64 * MIB);
    many_in_flight(&path).await;
}

/// A loop device over a file: a block device, whose writes take the ring too.
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).output();
    }
}

impl Loop {
    /// A loop device over `img` (`--direct-io=on`: its writes reach the
    /// file's filesystem at once, so that a full one fails them).
    fn over(img: &Path, direct_io: bool) -> Loop {
        let mut args = vec!["-f", "--show"];
        if direct_io {
            args.push("--direct-io=on");
        }
        args.push(img.to_str().unwrap());
        let out = Command::new("losetup").args(&args).output().expect("losetup");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        Loop(String::from_utf8(out.stdout).unwrap().trim().to_owned())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_block_device_reads_and_writes_through_its_ring_with_hundreds_in_flight() {
    let dir = disk_dir("ring-dev");
    let img = dir.path().join("dev.img");
    sparse(&img, 64 * MIB);
    let dev = Loop::over(&img, false);
    many_in_flight(Path::new(&dev.0)).await;
}

/// A direct volume on a filesystem with less room than the volume: writes
/// succeed until the device is full, the one that finds it full gets
/// NO_SPACE, every write acknowledged before reads back right (through the
/// ring), and the target goes on serving this client and a new one. A
/// regular file's allocating writes fail on the ring's waiting threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_device_fails_the_write_that_hit_it_and_keeps_every_acknowledged_one() {
    let fs = SmallFs::mount(16);
    let path = fs.mnt.join("v.img");
    sparse(&path, 64 * MIB);
    fills_up(&path).await;
}

/// The same on a block device (a loop device over a file of that small
/// filesystem): the write fails in the ring itself, as the device's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_block_device_fails_the_write_that_hit_it_in_the_ring_and_keeps_every_acknowledged_one() {
    let fs = SmallFs::mount(16);
    let img = fs.mnt.join("dev.img");
    sparse(&img, 64 * MIB);
    let dev = Loop::over(&img, true);
    fills_up(Path::new(&dev.0)).await;
}

async fn fills_up(path: &Path) {
    let spec = format!("v=file:{},direct", path.display());
    let srv = TestServer::start(&[spec.as_str()], |_| {}).await;
    let caps = srv.handle.catalog().get("v").unwrap().caps();
    assert!(caps.submit && caps.submit_writes, "through the ring");
    let vol = connect(&srv, 1).await;
    let mut acked = Vec::new();
    let mut full = None;
    for i in 0..64 {
        match vol.write_at(&pattern(2, i * MIB, MIB as usize), i * MIB, false).await {
            Ok(()) => acked.push(i),
            Err(e) => {
                full = Some((i, e));
                break;
            }
        }
    }
    let Some((at, e)) = full else { panic!("64 MiB fit on a 16 MiB filesystem") };
    assert!(matches!(e, Error::Status(Status::NO_SPACE)), "the write at {at} MiB: {e:?}");
    assert!(acked.len() >= 4, "only {} MiB written before the device was full", acked.len());
    // Every acknowledged write, through this client and a new one.
    let other = connect(&srv, 1).await;
    for v in [&vol, &other] {
        for &i in &acked {
            let got = v.read(i * MIB, MIB).await.unwrap_or_else(|e| panic!("read at {i} MiB: {e}"));
            assert!(got[..] == pattern(2, i * MIB, MIB as usize)[..], "{i} MiB: not the bytes acknowledged");
        }
    }
    assert!(srv.handle.volume_stats("v").unwrap().errors >= 1, "the failure is counted");
    drop((vol, other));
    srv.stop().await;
}

/// A block device another program holds (mounted, or opened exclusively)
/// is not served writable: two writers would corrupt it. Read-only, it is.
#[test]
fn a_block_device_in_use_is_refused_writable() {
    use fastsan_target::backend::FileBackend;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = disk_dir("held");
    let img = dir.path().join("dev.img");
    sparse(&img, 4 * MIB);
    let dev = Loop::over(&img, false);
    let held = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(&dev.0).unwrap();
    let e = FileBackend::open(Path::new(&dev.0), false, false).err().expect("refused while held");
    assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy, "{e}");
    assert!(e.to_string().contains("in use"), "{e}");
    FileBackend::open(Path::new(&dev.0), true, false).expect("read-only is fine");
    drop(held);
    FileBackend::open(Path::new(&dev.0), false, false).expect("served once let go");
}
