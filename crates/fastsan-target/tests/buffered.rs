//! Buffered file volumes whose kernel takes writes into the page cache
//! without waiting (`RWF_NOWAIT`: XFS does, ext4 refuses): such writes are
//! written on the thread that received them, the rest (one that would wait
//! for a timestamp update or writeback, 1 MiB ones, FUA) on the I/O pool.
//! Every byte acknowledged reads back, through the target and from the file;
//! a volume under a layer that acts on writes (faults) never skips it.
//! Needs root and loop devices (a small XFS of its own) and mkfs.xfs.

mod common;

use common::{pattern, round_trip, sparse, SmallFs, TestServer};
use fastsan_brp::Status;
use fastsan_initiator::{Error, Options, Volume};
use fastsan_target::backend::{Backend, FileBackend};

const MIB: u64 = 1 << 20;

/// The store itself: on XFS most 4K writes over an allocated, cached file
/// are taken at once (the others would wait for the inode's timestamp
/// update: declined, nothing half done that a whole rewrite would not
/// mend); on the ext4 beside it none is, and the store stops trying.
#[test]
fn xfs_takes_most_writes_at_once_and_ext4_none() {
    let xfs = SmallFs::mount_as("mkfs.xfs", &["-q", "-f"], 320);
    let path = xfs.mnt.join("v.img");
    std::fs::write(&path, vec![0u8; 8 * MIB as usize]).unwrap();
    let b = FileBackend::open(&path, false, false).unwrap();
    assert!(b.can_write_now(), "a buffered, writable file tries");
    let mut taken = 0;
    for i in 0..1000u64 {
        let at = (i * 7919 % 2048) * 4096;
        let data = pattern(i, at, 4096);
        if b.write_now(&data, at).unwrap() {
            taken += 1;
        } else {
            b.write_at(&data, at, false).unwrap();
        }
        let mut back = vec![0u8; 4096];
        b.read_at(&mut back, at).unwrap();
        assert!(back == data, "write {i} at {at}: not the bytes written");
    }
    assert!(taken >= 500, "XFS took {taken} of 1000 writes at once");
    assert!(b.can_write_now(), "and goes on trying");
    // A full file system: XFS would flush every inode before it answered
    // a write that finds no room, RWF_NOWAIT or not, so the store stops
    // trying at the first ENOSPC and leaves writes to the pool.
    let filler = xfs.mnt.join("filler");
    let fill = format!("dd if=/dev/zero of={} bs=1M 2>&1; sync", filler.display());
    let out = std::process::Command::new("sh").args(["-c", &fill]).output().unwrap();
    let sparse_path = xfs.mnt.join("sparse.img");
    sparse(&sparse_path, 64 * MIB);
    let s = FileBackend::open(&sparse_path, false, false).unwrap();
    // (A write may first be declined for its timestamp update, EAGAIN,
    // before it meets the full file system: so a few tries.)
    let mut at = 0;
    for _ in 0..1000 {
        if !s.can_write_now() || at >= 64 * MIB {
            break;
        }
        if s.write_now(&[7; 65536], at).unwrap() || s.write_at(&[7; 65536], at, false).is_ok() {
            at += 65536;
        }
    }
    assert!(!s.can_write_now(), "still trying on a full file system ({} MiB written; {out:?})", at >> 20);
    assert!(!FileBackend::open(&path, true, false).unwrap().can_write_now(), "a read-only file does not try");
    assert!(
        !FileBackend::open(&path, false, true).unwrap().can_write_now(),
        "O_DIRECT writes go to the device"
    );

    let ext4 = SmallFs::mount(16);
    let path = ext4.mnt.join("v.img");
    std::fs::write(&path, vec![0u8; MIB as usize]).unwrap();
    let b = FileBackend::open(&path, false, false).unwrap();
    assert_eq!(b.write_now(&[1; 4096], 0).ok(), Some(false), "ext4 refuses RWF_NOWAIT writes");
    assert!(!b.can_write_now(), "so the store stops trying");
    let mut back = vec![9u8; 4096];
    b.read_at(&mut back, 0).unwrap();
    assert!(back.iter().all(|&x| x == 0), "and wrote nothing");
}

/// Through the target: hundreds of writes in flight (4 KiB and 64 KiB ones
/// taken at once or, when the kernel would wait, on the pool; 1 MiB ones
/// and every third a FUA write on the pool), three rounds over the same
/// blocks, each checked through the target and in the file (`round_trip`,
/// shared with the direct volumes' tests); the stats count
/// each write once, wherever it was written. A faults layer turns the path
/// off (it would be skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_file_on_xfs_writes_at_once_and_keeps_every_acknowledged_byte() {
    let fs = SmallFs::mount_as("mkfs.xfs", &["-q", "-f"], 320);
    let path = fs.mnt.join("v.img");
    sparse(&path, 16 * MIB);
    let spec = format!("v=file:{}", path.display());
    let other = fs.mnt.join("w.img");
    sparse(&other, MIB);
    let faulty = format!("w=file:{},faults=none", other.display());
    let srv = TestServer::start(&[spec.as_str(), faulty.as_str()], |c| c.queue_depth = 256).await;
    assert!(srv.handle.catalog().get("v").unwrap().caps().write_now, "XFS: writes at once");
    assert!(!srv.handle.catalog().get("w").unwrap().caps().write_now, "not under a faults layer");
    let vol = Volume::connect(&srv.url("v"), Options { connections: 2, ..Default::default() })
        .await
        .expect("connects");
    for seed in 1..=3u64 {
        round_trip(&vol, &path, seed).await;
    }
    let st = srv.handle.volume_stats("v").unwrap();
    let n = 3 * 300;
    assert_eq!((st.writes, st.errors), (n, 0), "each write counted once: {st:?}");
    srv.stop().await;
}

/// A full filesystem under writes taken at once: the write that finds no
/// room is declined there and fails on the pool with the store's own error
/// (NO_SPACE, not a retry or a hang), every write acknowledged before it
/// reads back, and the target serves this client and a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_xfs_fails_the_write_that_found_it_full_and_keeps_every_acknowledged_one() {
    let fs = SmallFs::mount_as("mkfs.xfs", &["-q", "-f"], 320);
    let path = fs.mnt.join("v.img");
    sparse(&path, 512 * MIB);
    let spec = format!("v=file:{}", path.display());
    let srv = TestServer::start(&[spec.as_str()], |_| {}).await;
    assert!(srv.handle.catalog().get("v").unwrap().caps().write_now);
    let url = srv.url("v");
    let connect = || Volume::connect(&url, Options::default());
    let vol = connect().await.expect("connects");
    const PIECE: u64 = 64 << 10;
    let mut acked = 0;
    let e = loop {
        match vol.write_at(&pattern(4, acked * PIECE, PIECE as usize), acked * PIECE, false).await {
            Ok(()) => acked += 1,
            Err(e) => break e,
        }
        assert!(acked * PIECE < 512 * MIB, "512 MiB fit on a 320 MiB filesystem");
    };
    assert!(matches!(e, Error::Status(Status::NO_SPACE)), "the write at {acked} x 64 KiB: {e:?}");
    assert!(acked * PIECE >= 100 * MIB, "only {acked} x 64 KiB written before the filesystem was full");
    let other = connect().await.expect("a new client connects");
    for v in [&vol, &other] {
        for i in (0..acked).step_by(97) {
            let got = v.read(i * PIECE, PIECE).await.unwrap_or_else(|e| panic!("read at {i} x 64 KiB: {e}"));
            assert!(
                got[..] == pattern(4, i * PIECE, PIECE as usize)[..],
                "{i} x 64 KiB: not the bytes acknowledged"
            );
        }
    }
    // An acknowledged block can still be written over (its room is taken).
    other.write_at(&pattern(5, 0, PIECE as usize), 0, false).await.expect("rewrites in place");
    assert!(vol.read(0, PIECE).await.unwrap()[..] == pattern(5, 0, PIECE as usize)[..]);
    drop((vol, other));
    srv.stop().await;
}
