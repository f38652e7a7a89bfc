//! The dirty-region log: bits durable before a write may leave, batched
//! updates, hot regions free, lazy clearing, regions missed by a leg kept
//! for the resync, and a log that belongs to another volume refused.

use fastsan_initiator::mirror::{DirtyLog, DirtyLogError, Generations};
use std::path::PathBuf;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A log's path in a directory of its own, removed when the returned guard drops.
fn path(name: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::Builder::new().prefix(&format!("fastsan-dirty-{name}-")).tempdir().expect("a temp dir");
    let p = d.path().join("log");
    (d, p)
}

/// The dirty regions as a fresh open of the file sees them: what a crash
/// leaves (through the page cache: the order of writes and syncs is the
/// code's to keep, and not observable here).
fn on_disk(p: &std::path::Path, _size: u64) -> Vec<u64> {
    DirtyLog::peek(p).unwrap().3
}

fn gens(legs: usize) -> Generations {
    Generations { uuid: [9; 16], current: 1, legs: vec![1; legs] }
}

#[tokio::test]
async fn a_region_is_durably_dirty_before_its_write_may_leave() {
    let (_dir, p) = path("durable");
    let log = DirtyLog::create(&p, 64 * MIB, MIB, &gens(2), false, Duration::from_secs(60)).unwrap();
    assert!(log.dirty().is_empty());
    // 3 MiB from 1.5 MiB: regions 1, 2, 3 and 4.
    let w = log.begin(3 * MIB / 2, 3 * MIB).await.unwrap();
    assert_eq!(on_disk(&p, 64 * MIB), vec![1, 2, 3, 4], "on disk when begin returns");
    w.done(true);
    // Not cleared before it has been idle for the delay.
    assert_eq!(log.clear_idle().await.unwrap(), 0);
    assert_eq!(on_disk(&p, 64 * MIB), vec![1, 2, 3, 4]);
}

#[tokio::test]
async fn concurrent_writes_share_updates_and_hot_regions_cost_none() {
    let (_dir, p) = path("batch");
    let log = DirtyLog::create(&p, 64 * MIB, MIB, &gens(2), false, Duration::from_secs(60)).unwrap();
    // 64 writes to 64 regions at once: the first update carries one, the
    // next carries the 63 that arrived while it was written.
    let intents = futures::future::join_all((0..64).map(|r| log.begin(r * MIB, 4096))).await;
    let st = log.stats();
    assert_eq!(st.set, 64);
    assert_eq!(st.updates, 2, "the first update carries one region, the second the 63 others: {st:?}");
    assert_eq!(on_disk(&p, 64 * MIB).len(), 64);
    // Writes to regions already dirty on disk: no update at all.
    let more = futures::future::join_all((0..64).map(|r| log.begin(r * MIB + 8192, 4096))).await;
    assert_eq!(log.stats().updates, st.updates, "hot regions take no bitmap I/O");
    assert_eq!(log.stats().hot, 64);
    for w in intents.into_iter().chain(more) {
        w.unwrap().done(true);
    }
}

#[tokio::test]
async fn idle_regions_are_cleared_lazily_in_one_update() {
    let (_dir, p) = path("clear");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::from_millis(100)).unwrap();
    let a = log.begin(0, 2 * MIB).await.unwrap();
    let b = log.begin(5 * MIB, 4096).await.unwrap();
    a.done(true);
    b.done(true);
    // Region 5 is written again before the delay: it stays dirty, and its
    // write finds it dirty already (no update).
    tokio::time::sleep(Duration::from_millis(60)).await;
    let updates = log.stats().updates;
    let c = log.begin(5 * MIB, 4096).await.unwrap();
    assert_eq!(log.stats().updates, updates);
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(log.clear_idle().await.unwrap(), 2, "regions 0 and 1, idle long enough");
    assert_eq!(log.stats().updates, updates + 1, "cleared in one update");
    assert_eq!(on_disk(&p, 16 * MIB), vec![5], "region 5 has a write in flight");
    c.done(true);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(log.clear_idle().await.unwrap(), 1);
    assert!(on_disk(&p, 16 * MIB).is_empty());
}

#[tokio::test]
async fn a_region_a_leg_missed_stays_dirty_until_a_resync_clears_it() {
    let (_dir, p) = path("degraded");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::ZERO).unwrap();
    log.begin(3 * MIB, 4096).await.unwrap().done(false);
    // A later write that reaches every leg does not make it clean.
    log.begin(3 * MIB, 4096).await.unwrap().done(true);
    // An abandoned write (dropped, never finished) counts as missed.
    drop(log.begin(7 * MIB, 4096).await.unwrap());
    log.begin(9 * MIB, 4096).await.unwrap().done(true);
    assert_eq!(log.clear_idle().await.unwrap(), 1, "only region 9");
    assert_eq!(on_disk(&p, 16 * MIB), vec![3, 7]);
    // An idle region a leg may lack (it was just degraded) is not cleared.
    log.begin(11 * MIB, 4096).await.unwrap().done(true);
    log.missed(&[11]);
    assert_eq!(log.clear_idle().await.unwrap(), 0);
    log.resynced(&[11]);
    assert_eq!(log.clear_idle().await.unwrap(), 1, "idle again once resynced");
    // A write begun (not sent yet) when the resync clears: the region
    // stays dirty until it is done, and then goes as that write says.
    let pending = log.begin(3 * MIB, 4096).await.unwrap();
    log.clear(&[3, 7]).await.unwrap();
    assert_eq!(on_disk(&p, 16 * MIB), vec![3]);
    pending.done(true);
    assert_eq!(log.clear_idle().await.unwrap(), 1);
    assert!(on_disk(&p, 16 * MIB).is_empty());
}

#[tokio::test]
async fn a_log_of_another_volume_or_no_log_is_refused() {
    let (_dir, p) = path("mismatch");
    // No log: an error, never a clean log (the regions it marked would be forgotten).
    assert!(matches!(DirtyLog::open(&p, Duration::ZERO), Err(DirtyLogError::Io { .. })));
    let held = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::ZERO).unwrap();
    assert_eq!((held.size(), held.region_size(), held.regions()), (16 * MIB, MIB, 16));
    assert!(
        DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::ZERO).is_err(),
        "an existing log is not replaced"
    );
    // One process at a time: a second user would keep a log of its own.
    let e = DirtyLog::open(&p, Duration::ZERO).err().unwrap();
    assert!(matches!(e, DirtyLogError::InUse { .. }), "{e}");
    drop(held);
    drop(DirtyLog::open(&p, Duration::ZERO).unwrap());
    std::fs::write(&p, vec![7u8; 8192]).unwrap();
    let e = DirtyLog::open(&p, Duration::ZERO).err().unwrap();
    assert!(matches!(e, DirtyLogError::NotALog { .. }), "{e}");
    std::fs::write(&p, b"short").unwrap();
    assert!(matches!(DirtyLog::open(&p, Duration::ZERO), Err(DirtyLogError::NotALog { .. })));
    std::fs::remove_file(&p).unwrap();
    assert!(matches!(
        DirtyLog::create(&p, 16 * MIB, 1000, &gens(2), false, Duration::ZERO),
        Err(DirtyLogError::RegionSize(1000))
    ));
    assert!(matches!(
        DirtyLog::create(&p, 16 * MIB, MIB, &gens(0), false, Duration::ZERO),
        Err(DirtyLogError::Legs(0))
    ));
}

/// The generation record is durable when set_generations returns, and a
/// torn write of the newer slot leaves the older record whole.
#[tokio::test]
async fn generations_survive_a_torn_update() {
    use std::os::unix::fs::FileExt;
    let (_dir, p) = path("gens");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(3), true, Duration::ZERO).unwrap();
    assert_eq!(log.generations(), gens(3));
    assert_eq!(log.dirty().len(), 16, "a log made for a full sync starts all dirty");
    let g2 = Generations { uuid: [9; 16], current: 2, legs: vec![2, 1, 2] };
    log.set_generations(&g2).await.unwrap();
    assert_eq!(DirtyLog::peek(&p).unwrap().2, g2);
    let g3 = Generations { uuid: [9; 16], current: 3, legs: vec![3, 1, 1] };
    log.set_generations(&g3).await.unwrap();
    assert_eq!(DirtyLog::peek(&p).unwrap().2, g3);
    drop(log);
    // The third record went to the slot at 512 + 512 * (3 % 2); tear it.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&[0xff; 100], 1024 + 20).unwrap();
    drop(f);
    assert_eq!(DirtyLog::open(&p, Duration::ZERO).unwrap().generations(), g2);
}

/// A torn first update after create leaves create's record whole: until
/// 2026-11-29 both went to the same slot, the other slot was empty, and the
/// log (so the mirror) could not be opened any more.
#[tokio::test]
async fn a_torn_first_update_leaves_the_record_of_create() {
    use std::os::unix::fs::FileExt;
    let (_dir, p) = path("first");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::ZERO).unwrap();
    let g2 = Generations { uuid: [9; 16], current: 2, legs: vec![2, 1] };
    log.set_generations(&g2).await.unwrap();
    drop(log);
    // The second record went to the slot at 512 + 512 * (2 % 2); tear it.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&[0xff; 100], 512 + 20).unwrap();
    drop(f);
    assert_eq!(DirtyLog::open(&p, Duration::ZERO).unwrap().generations(), gens(2));
    // A second create of the same log is refused, the first left as it was.
    let again = DirtyLog::create(&p, 16 * MIB, MIB, &gens(3), false, Duration::ZERO);
    assert!(again.is_err(), "a log that exists is never replaced");
    assert_eq!(DirtyLog::peek(&p).unwrap().2, gens(2));
}

/// After a crash every region dirty in the log needs a resync: a write that
/// reaches every leg later does not make it clean (the rest of the region
/// may still differ between the legs); only a resync's clear does.
#[tokio::test]
async fn regions_dirty_at_open_wait_for_the_resync() {
    let (_dir, p) = path("reopen");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::ZERO).unwrap();
    let crashed = log.begin(2 * MIB, 4096).await.unwrap();
    // The process dies with the write in flight: the bit stays set on disk.
    crashed.done(false);
    drop(log);
    let log = DirtyLog::open(&p, Duration::ZERO).unwrap();
    assert_eq!(log.dirty(), vec![2]);
    log.begin(2 * MIB, 4096).await.unwrap().done(true);
    assert_eq!(log.clear_idle().await.unwrap(), 0);
    assert_eq!(on_disk(&p, 16 * MIB), vec![2]);
    log.clear(&[2]).await.unwrap();
    assert!(on_disk(&p, 16 * MIB).is_empty());
    // Past the end: refused, for writes and for clears.
    assert!(matches!(log.begin(16 * MIB, 4096).await, Err(DirtyLogError::OutOfRange { .. })));
    assert!(matches!(log.clear(&[16]).await, Err(DirtyLogError::OutOfRange { .. })));
}

/// A caller that gives up while its update is being written (a dropped
/// future) does not leave the log stuck: the update finishes on its own.
#[tokio::test]
async fn a_caller_giving_up_mid_update_leaves_the_log_working() {
    let (_dir, p) = path("cancel");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::ZERO).unwrap();
    {
        let mut f = Box::pin(log.begin(0, 4096));
        // Polled once: it sets its bit and starts the update, then is dropped.
        assert!(futures::poll!(f.as_mut()).is_pending());
    }
    let w =
        tokio::time::timeout(Duration::from_secs(5), log.begin(MIB, 4096)).await.expect("no hang").unwrap();
    w.done(true);
    assert_eq!(on_disk(&p, 16 * MIB), vec![0, 1]);
}

/// With the optimizations off (what the benchmark compares against), every
/// write costs its own update, hot or not, and its region is cleared as soon
/// as it is done.
#[tokio::test]
async fn naive_tracking_pays_an_update_per_write_and_clears_at_once() {
    let (_dir, p) = path("naive");
    let log = DirtyLog::create(&p, 16 * MIB, MIB, &gens(2), false, Duration::from_secs(60)).unwrap();
    log.set_naive(true);
    let (a, b) = futures::join!(log.begin(0, 4096), log.begin(4096, 4096));
    assert_eq!(log.stats().updates, 2, "no group commit");
    assert_eq!(on_disk(&p, 16 * MIB), vec![0]);
    a.unwrap().done(true);
    b.unwrap().done(true);
    // The clears go out on their own, right away (no delay, no clear_idle).
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while !on_disk(&p, 16 * MIB).is_empty() {
        assert!(std::time::Instant::now() < until, "never cleared");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = log.stats().updates;
    log.begin(0, 4096).await.unwrap().done(false);
    assert_eq!(log.stats().updates, before + 1);
    assert_eq!(on_disk(&p, 16 * MIB), vec![0], "a region a leg missed stays dirty");
}
