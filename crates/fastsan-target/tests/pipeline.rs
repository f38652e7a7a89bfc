//! End-to-end tests of the core path: the real target and the real
//! initiator over 127.0.0.1, in every merge mode.

mod common;

use common::{pattern, TestServer};
use fastsan_initiator::{MergeMode, Options, Volume};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

const REGION: u64 = 2 << 20;
const REQUESTERS: u64 = 64;

/// 64 concurrent requesters over 4 connections, random reads and writes of
/// 512 B to 1 MiB, each checked against a model of its own region.
async fn mixed_load(mode: MergeMode, digests: bool, ops: usize) {
    let srv = TestServer::start(&["v=memory:128M"], |_| {}).await;
    let opts = Options { connections: 4, merge: mode, digests, ..Default::default() };
    let vol = Volume::connect(&srv.url("v"), opts).await.unwrap();
    let mismatches = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for r in 0..REQUESTERS {
        let vol = vol.clone();
        let mismatches = mismatches.clone();
        tasks.push(tokio::spawn(async move {
            let base = r * REGION;
            let mut model = vec![0u8; REGION as usize];
            let mut rng = rand::rngs::StdRng::seed_from_u64(r);
            for i in 0..ops {
                // Sizes spread evenly on a log scale, 512 B to 1 MiB.
                let blocks = 1u64 << rng.gen_range(0..=11);
                let blocks = rng.gen_range(blocks..=blocks * 2).min(2048);
                let len = blocks * 512;
                let off = rng.gen_range(0..=(REGION - len) / 512) * 512;
                if rng.gen_bool(0.5) {
                    let data = pattern(r * 1000 + i as u64, off, len as usize);
                    vol.write_at(&data, base + off, rng.gen_bool(0.1)).await.unwrap();
                    model[off as usize..(off + len) as usize].copy_from_slice(&data);
                } else {
                    let got = vol.read(base + off, len).await.unwrap();
                    if got[..] != model[off as usize..(off + len) as usize] {
                        mismatches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                if i % 16 == 0 {
                    vol.flush().await.unwrap();
                }
            }
            let all = vol.read(base, REGION).await.unwrap();
            if all[..] != model[..] {
                mismatches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(mismatches.load(std::sync::atomic::Ordering::Relaxed), 0, "mode {mode:?}");
    let st = srv.handle.stats();
    assert_eq!(st.errors, 0);
    let ist = vol.stats();
    match mode {
        MergeMode::Off => assert_eq!(st.batches, 0, "merge off never sends BATCH"),
        // Requests above 128 KiB always travel alone; every small one goes in a BATCH.
        MergeMode::Always | MergeMode::Adaptive => {
            assert!(ist.batches > 0 && st.batches == ist.batches, "{ist:?} {st:?}");
        }
    }
    drop(vol);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_merge_off() {
    mixed_load(MergeMode::Off, false, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_merge_adaptive() {
    mixed_load(MergeMode::Adaptive, false, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_merge_always() {
    mixed_load(MergeMode::Always, false, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_with_digests() {
    mixed_load(MergeMode::Adaptive, true, 15).await;
}

/// Adaptive merge sends no BATCH at queue depth 1, and does under load; the
/// target sees the batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_appear_under_load_and_not_at_qd1() {
    let srv = TestServer::start(&["v=memory:64M"], |_| {}).await;
    let opts = Options { connections: 1, merge: MergeMode::Adaptive, ..Default::default() };
    let vol = Volume::connect(&srv.url("v"), opts).await.unwrap();
    for i in 0..300u64 {
        vol.write_at(&[i as u8; 4096], i * 4096, false).await.unwrap();
        assert_eq!(vol.read(i * 4096, 4096).await.unwrap()[..], [i as u8; 4096][..]);
    }
    let qd1 = srv.handle.stats();
    assert_eq!(qd1.requests, 600);
    assert_eq!(qd1.batches, 0, "no BATCH at queue depth 1");
    assert_eq!(vol.stats().batches, 0);

    let tasks: Vec<_> = (0..64u64)
        .map(|t| {
            let vol = vol.clone();
            tokio::spawn(async move {
                for i in 0..100u64 {
                    let off = ((t * 100 + i) % 16384) * 4096;
                    vol.read(off, 4096).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let load = srv.handle.stats();
    let batches = load.batches - qd1.batches;
    let batched = load.batched_requests - qd1.batched_requests;
    assert!(batches > 0, "BATCH frames under load: {load:?}");
    assert!(batched >= 2 * batches, "batches carry several requests: {batched} in {batches}");
    assert_eq!(vol.stats().batched_requests, load.batched_requests, "initiator and target agree");
    drop(vol);
    srv.stop().await;
}

/// Requests larger than the target's maximum transfer are split and come back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_io_is_split() {
    let srv = TestServer::start(&["v=memory:64M"], |c| c.max_transfer = 64 * 1024).await;
    let vol = Volume::connect(&srv.url("v"), Options::default()).await.unwrap();
    assert_eq!(vol.info().max_transfer, 64 * 1024);
    let data = pattern(5, 0, 3 << 20);
    vol.write_at(&data, 4096, true).await.unwrap();
    assert_eq!(vol.read(4096, data.len() as u64).await.unwrap()[..], data[..]);
    assert!(srv.handle.stats().requests >= 96);
    drop(vol);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trim_and_write_zeroes_read_back_zeros() {
    let srv = TestServer::start(&["v=memory:16M"], |_| {}).await;
    let vol = Volume::connect(&srv.url("v"), Options::default()).await.unwrap();
    vol.write_at(&[0xAB; 1 << 20], 0, false).await.unwrap();
    vol.trim(0, 256 * 1024).await.unwrap();
    vol.write_zeroes(512 * 1024, 4096, true).await.unwrap();
    let got = vol.read(0, 1 << 20).await.unwrap();
    assert!(got[..256 * 1024].iter().all(|&b| b == 0));
    assert!(got[256 * 1024..512 * 1024].iter().all(|&b| b == 0xAB));
    assert!(got[512 * 1024..512 * 1024 + 4096].iter().all(|&b| b == 0));
    assert!(got[512 * 1024 + 4096..].iter().all(|&b| b == 0xAB));
    drop(vol);
    srv.stop().await;
}

/// File volumes run on the I/O pool; the same model check holds, and
/// parallelism off (serial) gives the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_volume_pool_and_serial_mode() {
    let (_dir, img) = common::temp_file("pipeline", 32 << 20);
    for serial in [false, true] {
        let spec = format!("v=file:{}", img.display());
        let srv = TestServer::start(&[spec.as_str()], |c| c.serial = serial).await;
        let vol =
            Volume::connect(&srv.url("v"), Options { connections: 2, ..Default::default() }).await.unwrap();
        assert_eq!(vol.info().queue_depth, if serial { 1 } else { 256 });
        let tasks: Vec<_> = (0..16u64)
            .map(|t| {
                let vol = vol.clone();
                tokio::spawn(async move {
                    let data = pattern(t + serial as u64, t, 256 * 1024);
                    vol.write_at(&data, t << 20, false).await.unwrap();
                    assert_eq!(vol.read(t << 20, data.len() as u64).await.unwrap()[..], data[..]);
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        vol.flush().await.unwrap();
        drop(vol);
        srv.stop().await;
    }
}

/// A memory volume does not survive its target: when the target restarts,
/// the session is refused with an error that says so, and the data written
/// before is never read back as zeros with status OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_target_with_an_empty_memory_volume_is_refused() {
    let srv = TestServer::start(&["v=memory:16M"], |_| {}).await;
    let addr = srv.addr;
    let opts = Options { connections: 2, reconnect_timeout: Duration::from_secs(10), ..Default::default() };
    let vol = Volume::connect(&srv.url("v"), opts).await.unwrap();
    vol.write_at(&[1; 4096], 0, false).await.unwrap();
    srv.stop().await;
    let srv2 = TestServer::start(&["v=memory:16M"], |c| c.brp = addr).await;
    let e = tokio::time::timeout(Duration::from_secs(10), vol.read(0, 4096))
        .await
        .expect("an answer, not a hang")
        .expect_err("the volume behind the name is not the one written to");
    assert!(
        matches!(e, fastsan_initiator::Error::VolumeReplaced { restarted: true, volatile: true, .. }),
        "{e:?}"
    );
    assert!(!e.is_retryable());
    let text = e.to_string();
    assert!(text.contains("target restarted") && text.contains("volatile"), "{text}");
    // Every later request gets the same answer, never data.
    assert!(vol.write_at(&[2; 4096], 0, false).await.is_err());
    drop(vol);
    srv2.stop().await;
}

/// A file volume survives its target: requests issued while the target is
/// down wait for it (no error reaches the caller), and the session resumes
/// on the restarted target with the data intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_target_with_a_file_volume_is_resumed_and_requests_wait_for_it() {
    let (_dir, path) = common::temp_file("restart", 4 << 20);
    let spec = format!("v=file:{}", path.display());
    let srv = TestServer::start(&[spec.as_str()], |_| {}).await;
    let addr = srv.addr;
    let opts = Options { connections: 2, reconnect_timeout: Duration::from_secs(20), ..Default::default() };
    let vol = Volume::connect(&srv.url("v"), opts).await.unwrap();
    vol.write_at(&[1; 4096], 0, true).await.unwrap();
    srv.stop().await;
    // Issued while no target listens: it waits.
    let pending = tokio::spawn({
        let vol = vol.clone();
        async move {
            vol.write_at(&[2; 4096], 4096, false).await?;
            vol.read(0, 8192).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished(), "waits for the target instead of failing");
    let srv2 = TestServer::start(&[spec.as_str()], |c| c.brp = addr).await;
    let data = tokio::time::timeout(Duration::from_secs(15), pending).await.unwrap().unwrap().unwrap();
    assert_eq!(&data[..4096], &[1; 4096][..]);
    assert_eq!(&data[4096..], &[2; 4096][..]);
    assert!(vol.stats().reconnects >= 1);
    drop(vol);
    srv2.stop().await;
}

/// Writes acknowledged and never flushed survive a target process restart
/// (the host's page cache keeps them: the session resumes silently), but
/// may be lost when the target's host rebooted: then the resumed session's
/// FLUSH says so instead of promising them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_reboot_with_unflushed_writes_fails_the_next_flush() {
    let (_dir, path) = common::temp_file("unflushed", 4 << 20);
    let spec = format!("v=file:{}", path.display());
    let srv = TestServer::start(&[spec.as_str()], |c| c.boot_id = Some(1)).await;
    let addr = srv.addr;
    let opts = Options { connections: 1, reconnect_timeout: Duration::from_secs(20), ..Default::default() };
    let flushed = Volume::connect(&srv.url("v"), opts.clone()).await.unwrap();
    let unflushed = Volume::connect(&srv.url("v"), opts).await.unwrap();
    flushed.write_at(&[1; 4096], 0, false).await.unwrap();
    flushed.flush().await.unwrap();
    unflushed.write_at(&[2; 4096], 4096, false).await.unwrap();
    // The process restarts on the same boot: nothing lost, nothing said.
    srv.stop().await;
    let srv = TestServer::start(&[spec.as_str()], |c| (c.brp, c.boot_id) = (addr, Some(1))).await;
    unflushed.flush().await.expect("a process restart keeps the page cache");
    unflushed.write_at(&[3; 4096], 4096, false).await.unwrap();
    // The host reboots.
    srv.stop().await;
    let srv = TestServer::start(&[spec.as_str()], |c| (c.brp, c.boot_id) = (addr, Some(2))).await;
    flushed.flush().await.expect("everything it wrote was flushed before the reboot");
    let e = unflushed.flush().await.expect_err("its write may be lost");
    assert!(matches!(e, fastsan_initiator::Error::UnflushedWritesLost { .. }), "{e:?}");
    assert!(unflushed.flush().await.is_err(), "and stays so for the session");
    unflushed.write_at(&[4; 4096], 8192, true).await.expect("a FUA write promises only itself");
    assert_eq!(unflushed.read(0, 4096).await.unwrap()[..], [1; 4096][..], "reads go on");
    drop((flushed, unflushed));
    srv.stop().await;
}
