//! The fence: what a connection has started on the device, and the switch
//! that stops it from starting more.
//!
//! Every connection has an [`Activity`]. The dispatcher takes a [`Running`]
//! from it before a request touches the device and drops it when the device
//! call returns. [`Activity::stop`] is thrown when the connection dies (its
//! reader ends, its reply stream fails, or a reconnect of its session takes
//! its slot): from then on nothing more is dispatched from it, not even
//! frames already in its buffer. [`Activity::drained`] resolves once every
//! device call it started has returned.
//!
//! A BRP session re-opening a lost connection is answered only after the
//! session's stopped connections are drained (see [`crate::sessions`]), so
//! an initiator that retries after the reconnect can never be overtaken by a
//! write of the dead connection still queued on the target.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What one connection has in flight on the device, and whether it may start more.
#[derive(Debug, Default)]
pub struct Activity {
    stopped: AtomicBool,
    abandoned: AtomicBool,
    stop_token: CancellationToken,
    running: AtomicUsize,
    /// Waiters in [`Activity::drained`]: only then does the last call's
    /// return notify (a memory volume's calls end one by one, each taking
    /// the count to zero: a notification each was ~1% of the target's cycles).
    waiting: AtomicUsize,
    idle: Notify,
}

/// One device call of a connection, from dispatch to its return.
#[derive(Debug)]
pub struct Running(Arc<Activity>);

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity::default())
    }

    /// Stops the connection: nothing more is dispatched from it.
    pub fn stop(&self) {
        self.stopped.store(true, SeqCst);
        self.stop_token.cancel();
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(SeqCst)
    }

    /// Stops the connection and gives up on its peer: nobody will read its
    /// replies (a reconnect replaced it, or its reply stream broke), so the
    /// replies still to write are dropped and what they hold (credits,
    /// payload budget) comes back at once.
    pub fn abandon(&self) {
        self.abandoned.store(true, SeqCst);
        self.stop();
    }

    pub fn is_abandoned(&self) -> bool {
        self.abandoned.load(SeqCst)
    }

    /// Resolves when the connection is stopped.
    pub async fn stopped(&self) {
        self.stop_token.cancelled().await
    }

    /// Device calls started and not yet returned.
    pub fn running(&self) -> usize {
        self.running.load(SeqCst)
    }

    /// Registers a device call about to start; `None` once stopped. The
    /// count goes up before the stop flag is read and [`Activity::stop`] sets
    /// the flag before a fence reads the count, so a fence never misses a
    /// call that slipped in as the connection stopped.
    pub fn begin(self: &Arc<Self>) -> Option<Running> {
        self.running.fetch_add(1, SeqCst);
        let r = Running(self.clone());
        if self.is_stopped() {
            return None; // dropping `r` takes the count back down
        }
        Some(r)
    }

    /// Whether it is stopped and nothing it started is still running.
    pub fn is_drained(&self) -> bool {
        self.is_stopped() && self.running() == 0
    }

    /// Waits until every device call started has returned.
    pub async fn drained(&self) {
        // Counted before the notification is armed and the count read: a
        // call's return either sees the waiter (and notifies) or comes
        // before the read (which finds the count at zero).
        self.waiting.fetch_add(1, SeqCst);
        let _counted = Uncount(&self.waiting);
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Running {
    /// The activity of the connection this call belongs to.
    pub fn activity(&self) -> &Activity {
        &self.0
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, SeqCst) == 1 && self.0.waiting.load(SeqCst) > 0 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Takes a waiter out of a count of waiters (the fence's, the credits')
/// however its wait ends.
pub(crate) struct Uncount<'a>(pub(crate) &'a AtomicUsize);

impl Drop for Uncount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_stopped_activity_starts_nothing_and_drains_when_its_calls_return() {
        let a = Activity::new();
        let r1 = a.begin().expect("running");
        let r2 = a.begin().expect("running");
        a.stop();
        assert!(a.begin().is_none(), "stopped: nothing more starts");
        assert_eq!(a.running(), 2);
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.drained().await }
        });
        drop(r1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "one call still runs");
        drop(r2);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert!(a.is_drained());
    }
}
