//! A `,direct` file volume whose device fails part of the time. The device
//! is a real kernel file that can fail on demand: a volume of a second
//! target with a fault rule, mounted as a file through this crate's FUSE
//! filesystem. The errors come from the kernel, as a failing disk's would:
//! every I/O that touches the bad range fails, no other, and no failed
//! byte is ever served as data. (On FUSE the volume keeps its I/O threads:
//! io_uring reported a read there as whole whose second half had failed.)
//!
//! Needs root and /dev/fuse, as `fastsan attach --fuse` does.

use fastsan_attach::Remote;
use fastsan_initiator::{Error, Options, Status, Volume};
use fastsan_target::config::{ServerConfig, VolumeSpec};
use fastsan_target::{Server, ServerHandle};
use std::path::Path;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A target on 127.0.0.1 serving `volumes` over BRP: its URL base, its
/// handle, and its task (which ends once the handle shuts it down).
async fn target(volumes: &[&str]) -> (String, ServerHandle, tokio::task::JoinHandle<()>) {
    let c = ServerConfig {
        brp: "127.0.0.1:0".parse().unwrap(),
        nbd: None,
        volumes: volumes.iter().map(|v| VolumeSpec::parse(v).unwrap()).collect(),
        ..Default::default()
    };
    let server = Server::bind(c).await.unwrap();
    let (addr, handle) = (server.local_addr(), server.handle());
    let task = tokio::spawn(async move {
        let _ = server.run().await;
    });
    (format!("brp://{addr}"), handle, task)
}

fn pattern(seed: u64, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len).map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(0x9E37_79B9)) as u8).collect()
}

fn expect_io_error<T>(r: Result<T, Error>, what: &str) {
    match r {
        Err(Error::Status(s)) => assert_eq!(s, Status::IO_ERROR, "{what}"),
        Err(e) => panic!("{what}: {e}"),
        Ok(_) => panic!("{what}: succeeded"),
    }
}

/// Unmounts `dir`, waiting while a target closing its volume still holds the file.
fn umount(dir: &Path) {
    for _ in 0..100 {
        match fastsan_attach::fuse::umount(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::sleep(Duration::from_millis(50)),
            _ => return,
        }
    }
    panic!("{} still busy after 5 s: the volume's file was never closed", dir.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_direct_volume_on_a_failing_device_fails_only_the_ios_that_hit_it() {
    // The device: 16 MiB whose 4-5 MiB range fails every read and write.
    let (base, _device_target, _t) = target(&["bad=memory:16M,faults=read+write:eio@4M-5M"]).await;
    let remote = Remote::connect(&format!("{base}/bad"), Options::default()).await.expect("the device");
    let mnt = tempfile::tempdir().unwrap();
    let session = fastsan_attach::fuse::mount(remote, "disk", mnt.path(), 4).expect("mounted with FUSE");
    let disk = mnt.path().join("disk");

    let spec = format!("v=file:{},direct", disk.display());
    let (base2, h, task) = target(&[spec.as_str()]).await;
    let caps = h.catalog().get("v").unwrap().caps();
    assert!(!caps.submit && !caps.submit_writes, "no io_uring on FUSE: it can report failed reads as whole");
    let url = format!("{base2}/v");
    let one = Volume::connect(&url, Options::default()).await.unwrap();

    // Writes around the bad range land; the one into it fails, and only it.
    let good = [(0, MIB), (3 * MIB + 512 * 1024, 512 * 1024), (5 * MIB, 64 * 1024), (8 * MIB, 2 * MIB)];
    for &(at, len) in &good {
        one.write_at(&pattern(1, at, len), at, false).await.unwrap_or_else(|e| panic!("write at {at}: {e}"));
    }
    expect_io_error(
        one.write_at(&pattern(2, 4 * MIB, 64 * 1024), 4 * MIB, false).await,
        "a write into the bad range",
    );
    // Reads: the bad range fails, on its own and as part of a larger read.
    expect_io_error(one.read(4 * MIB + 8192, 4096).await, "a read of the bad range");
    expect_io_error(one.read(3 * MIB, 2 * MIB).await, "a read across the bad range");

    // Everything acknowledged reads back, through this client and a new one.
    let two = Volume::connect(&url, Options::default()).await.unwrap();
    for v in [&one, &two] {
        for &(at, len) in &good {
            let got = v.read(at, len).await.unwrap_or_else(|e| panic!("read at {at}: {e}"));
            assert!(got[..] == pattern(1, at, len)[..], "at {at}: not the bytes acknowledged");
        }
    }
    // Many at once after the errors: the ring goes on serving.
    let reads = (0..64u64).map(|i| two.read(8 * MIB + i * 32 * 1024, 32 * 1024));
    for (i, r) in futures::future::join_all(reads).await.into_iter().enumerate() {
        let at = 8 * MIB + i as u64 * 32 * 1024;
        assert!(r.expect("read")[..] == pattern(1, at, 32 * 1024)[..], "at {at}");
    }
    let st = h.volume_stats("v").unwrap();
    assert!(st.errors >= 3, "the failures are counted: {st:?}");

    drop((one, two));
    h.shutdown();
    tokio::time::timeout(Duration::from_secs(20), task).await.expect("the target stops").unwrap();
    // The last owner of the volume, and so of its file.
    drop(h);
    tokio::task::spawn_blocking({
        let dir = mnt.path().to_owned();
        move || umount(&dir)
    })
    .await
    .unwrap();
    drop(session);
}
