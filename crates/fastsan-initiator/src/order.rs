//! The order of writes to overlapping ranges.
//!
//! A write (or TRIM, WRITE_ZEROES) whose connection is lost is sent again
//! after the target's fence. A later write to the same bytes, issued while
//! the first was in flight, must not land before that retry and be undone by
//! it. So a write enters [`WriteOrder`] when it is issued and leaves when its
//! final result is known; it waits only while an earlier write that overlaps
//! it is still inside. Writes to distinct bytes never wait for each other.
//! Reads are not ordered, as on any block device: a read concurrent with a
//! write may see either.
//!
//! Entries are kept per 1 MiB bucket, so a check looks at the few writes
//! near its own range; a write spanning many buckets (a large TRIM) is kept
//! on a short list every check reads.

use crate::Error;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Notify;

const BUCKET_SHIFT: u32 = 20;
/// A range over more buckets than this goes to the wide list.
const WIDE: u64 = 16;

#[derive(Debug, Clone, Copy)]
struct Entry {
    seq: u64,
    start: u64,
    end: u64,
}

impl Entry {
    fn blocks(&self, later: &Entry) -> bool {
        self.seq < later.seq && self.start < later.end && later.start < self.end
    }
    fn buckets(&self) -> Option<std::ops::RangeInclusive<u64>> {
        let (a, b) = (self.start >> BUCKET_SHIFT, (self.end - 1) >> BUCKET_SHIFT);
        (b - a < WIDE).then_some(a..=b)
    }
}

#[derive(Default)]
struct Inner {
    next: u64,
    buckets: HashMap<u64, Vec<Entry>>,
    wide: Vec<Entry>,
    /// Writes waiting in [`Ticket::wait`]: only then does a leaving write
    /// notify (the notification takes a lock of its own, one more shared
    /// cache line per write otherwise).
    waiting: usize,
}

impl Inner {
    fn blocked(&self, e: &Entry) -> bool {
        if self.wide.iter().any(|w| w.blocks(e)) {
            return true;
        }
        match e.buckets() {
            Some(r) => {
                r.into_iter().any(|b| self.buckets.get(&b).is_some_and(|v| v.iter().any(|o| o.blocks(e))))
            }
            // A wide range: every bucket's entries are candidates.
            None => self.buckets.values().flatten().any(|o| o.blocks(e)),
        }
    }

    fn remove(&mut self, e: &Entry) {
        match e.buckets() {
            Some(r) => {
                for b in r {
                    if let Some(v) = self.buckets.get_mut(&b) {
                        v.retain(|o| o.seq != e.seq);
                        if v.is_empty() {
                            self.buckets.remove(&b);
                        }
                    }
                }
            }
            None => self.wide.retain(|o| o.seq != e.seq),
        }
    }
}

/// The writes in flight of a session, by range.
#[derive(Default)]
pub(crate) struct WriteOrder {
    inner: Mutex<Inner>,
    left: Notify,
}

/// A write's place in the order; it leaves when dropped.
pub(crate) struct Ticket {
    order: Arc<WriteOrder>,
    entry: Entry,
}

impl WriteOrder {
    /// Enters a write of `[offset, offset + len)`, and says whether an
    /// earlier overlapping write is in flight (then [`Ticket::wait`]). Not
    /// async: a write that does not wait carries no wait in its future.
    #[must_use = "a blocked write must wait for its turn (Ticket::wait)"]
    pub fn enter(self: Arc<Self>, offset: u64, len: u64) -> (Ticket, bool) {
        let (entry, blocked) = {
            let mut g = self.inner.lock();
            let seq = g.next;
            g.next += 1;
            let e = Entry { seq, start: offset, end: offset.saturating_add(len.max(1)) };
            match e.buckets() {
                Some(r) => {
                    for b in r {
                        g.buckets.entry(b).or_default().push(e);
                    }
                }
                None => g.wide.push(e),
            }
            (e, g.blocked(&e))
        };
        (Ticket { order: self, entry }, blocked)
    }
}

impl Ticket {
    /// Waits until no earlier write overlapping this one is in flight, or
    /// fails with [`Error::ConnectionLost`] at `until` (an earlier write
    /// waits for a target that does not come back).
    pub async fn wait(&self, until: Instant) -> Result<(), Error> {
        let order = &self.order;
        order.inner.lock().waiting += 1;
        // Uncounted however this ends, also when the caller gives up.
        let _waiting = Waiting(order);
        loop {
            // Made before the check: a write that leaves after it notifies
            // this (it sees `waiting` under the lock the check takes).
            let left = order.left.notified();
            tokio::pin!(left);
            left.as_mut().enable();
            if !order.inner.lock().blocked(&self.entry) {
                return Ok(());
            }
            if tokio::time::timeout_at(until.into(), left).await.is_err() {
                return Err(Error::ConnectionLost);
            }
        }
    }
}

/// A write counted in [`Inner::waiting`] until dropped.
struct Waiting<'a>(&'a WriteOrder);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.inner.lock().waiting -= 1;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let waiting = {
            let mut g = self.order.inner.lock();
            g.remove(&self.entry);
            g.waiting > 0
        };
        if waiting {
            self.order.left.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Enters and waits, as a write does.
    async fn enter(o: &Arc<WriteOrder>, offset: u64, len: u64, until: Instant) -> Result<Ticket, Error> {
        let (t, blocked) = o.clone().enter(offset, len);
        if blocked {
            t.wait(until).await?;
        }
        Ok(t)
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[tokio::test]
    async fn a_later_overlapping_write_waits_and_others_do_not() {
        let o = Arc::new(WriteOrder::default());
        let first = enter(&o, 4096, 8192, later()).await.unwrap();
        // Disjoint, in the same bucket and far away: no wait.
        drop(enter(&o, 0, 4096, later()).await.unwrap());
        drop(enter(&o, 1 << 30, 4096, later()).await.unwrap());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (i, (off, len)) in [(8192u64, 512u64), (0, 1 << 40)].into_iter().enumerate() {
            let (o, tx) = (o.clone(), tx.clone());
            tokio::spawn(async move {
                let _t = enter(&o, off, len, later()).await.unwrap();
                tx.send(i).unwrap();
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(rx.try_recv().is_err(), "both overlap the first write and wait");
        drop(first);
        let mut got = vec![rx.recv().await.unwrap(), rx.recv().await.unwrap()];
        got.sort();
        assert_eq!(got, [0, 1]);
        assert!(o.inner.lock().buckets.is_empty() && o.inner.lock().wide.is_empty());
        // Behind a write that never leaves: an error at the deadline, not a hang.
        let _stuck = enter(&o, 0, 4096, later()).await.unwrap();
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(matches!(enter(&o, 0, 512, soon).await, Err(Error::ConnectionLost)));
        assert_eq!(o.inner.lock().waiting, 0, "a wait that timed out is uncounted");
    }

    #[tokio::test]
    async fn overlapping_writes_leave_in_the_order_they_came() {
        let o = Arc::new(WriteOrder::default());
        let first = enter(&o, 0, 4096, later()).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3u64 {
            let (o, tx) = (o.clone(), tx.clone());
            tokio::spawn(async move {
                let t = enter(&o, 0, 4096, later()).await.unwrap();
                tx.send(i).unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(t);
            });
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(first);
        for want in 0..3 {
            assert_eq!(rx.recv().await.unwrap(), want);
        }
    }
}
