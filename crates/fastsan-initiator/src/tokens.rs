//! Tokens taken and given back without a lock, for the target and the
//! initiator alike: a target connection's queue slots, its byte budget and
//! the server's; an initiator connection's credits. Taking is a
//! compare-and-swap on one word, giving back an add, and a wake-up only when
//! someone waits.
//!
//! Until 2026-11-26 the target's were tokio semaphores, whose every release
//! takes the waiters' lock: with the reference counts of three permits per
//! request, ~4% of the target's cycles under 4K loads (docs/benchmarks.md).
//! The initiator's credits followed on 2026-12-08 (one release per reply).
//!
//! First come, first served, as the semaphores were: while anyone waits,
//! nobody takes ahead of them ([`Tokens::try_take`] fails), and waiters
//! queue on a fair lock so that only the first waits for its count; else a
//! request for a large share of a budget (an 8 MiB read) could wait forever
//! behind a stream of small ones.
//!
//! Tokens can be closed (an initiator's connection that died): takers fail
//! from then on, waiters too, and what is given back is still counted.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use tokio::sync::Notify;

pub struct Tokens {
    free: AtomicUsize,
    /// Takers in [`Tokens::take`]: while there are any, a give notifies and
    /// nobody else takes.
    waiting: AtomicUsize,
    closed: AtomicBool,
    given: Notify,
    /// The waiters' queue (tokio's mutex is fair: first come, first served).
    turn: tokio::sync::Mutex<()>,
}

/// The tokens were closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

impl Tokens {
    pub fn new(n: usize) -> Tokens {
        Tokens {
            free: AtomicUsize::new(n),
            waiting: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            given: Notify::new(),
            turn: tokio::sync::Mutex::new(()),
        }
    }

    /// Tokens free now.
    pub fn available(&self) -> usize {
        self.free.load(SeqCst)
    }

    /// Takes `n` if that many are free now, nobody waits, and the tokens
    /// are open.
    pub fn try_take(&self, n: usize) -> bool {
        self.waiting.load(SeqCst) == 0 && !self.is_closed() && self.grab(n)
    }

    fn grab(&self, n: usize) -> bool {
        let mut free = self.free.load(SeqCst);
        loop {
            if free < n {
                return false;
            }
            match self.free.compare_exchange_weak(free, free - n, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
    }

    /// Takes `n` when that many are free, after those who waited before;
    /// fails once the tokens are closed.
    pub async fn take(&self, n: usize) -> Result<(), Closed> {
        // Counted first: from here on nobody takes ahead of this waiter.
        self.waiting.fetch_add(1, SeqCst);
        let _counted = Uncount(&self.waiting);
        let _turn = self.turn.lock().await;
        loop {
            // Armed before the count (and the close) is read: a give or a
            // close either comes before the read or notifies this waiter.
            let given = self.given.notified();
            tokio::pin!(given);
            given.as_mut().enable();
            if self.is_closed() {
                return Err(Closed);
            }
            if self.grab(n) {
                return Ok(());
            }
            given.await;
        }
    }

    pub fn give(&self, n: usize) {
        self.free.fetch_add(n, SeqCst);
        if self.waiting.load(SeqCst) > 0 {
            self.given.notify_waiters();
        }
    }

    /// Fails every taker from now on, and the one waiting.
    pub fn close(&self) {
        self.closed.store(true, SeqCst);
        self.given.notify_waiters();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    /// One token, given back when the [`Token`] drops, if one is free now
    /// ([`Tokens::try_take`]).
    pub fn try_take_one(self: &Arc<Self>) -> Option<Token> {
        self.try_take(1).then(|| Token(self.clone()))
    }

    /// One token, given back when the [`Token`] drops ([`Tokens::take`]).
    pub async fn take_one(self: &Arc<Self>) -> Result<Token, Closed> {
        self.take(1).await?;
        Ok(Token(self.clone()))
    }
}

/// One token of [`Tokens`], given back when dropped.
pub struct Token(Arc<Tokens>);

impl Drop for Token {
    fn drop(&mut self) {
        self.0.give(1);
    }
}

/// Takes a waiter out of a count of waiters (the tokens', a target's fence)
/// however its wait ends.
pub struct Uncount<'a>(pub &'a AtomicUsize);

impl Drop for Uncount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A taker waits until enough comes back; one whose wait is cancelled
    /// takes nothing; first come, first served.
    #[tokio::test]
    async fn tokens_come_back_to_waiters_first_come_first_served() {
        let t = Arc::new(Tokens::new(4));
        assert!(t.try_take(3));
        assert!(!t.try_take(2), "one left");
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.take(2).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits while one is free");
        t.give(3);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("woken").unwrap().unwrap();
        assert_eq!(t.available(), 2);
        // Cancelled while waiting: nothing taken, no waiter left counted.
        assert!(tokio::time::timeout(Duration::from_millis(20), t.take(3)).await.is_err());
        assert_eq!((t.available(), t.waiting.load(SeqCst)), (2, 0));

        // First come, first served: while a large taker waits, small ones
        // do not take what comes back ahead of it.
        let large = tokio::spawn({
            let t = t.clone();
            async move { t.take(4).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!t.try_take(1), "a small taker waits behind the large one");
        t.give(2);
        tokio::time::timeout(Duration::from_secs(5), large).await.expect("served first").unwrap().unwrap();
        assert_eq!(t.available(), 0);
        t.give(4);
    }

    /// Many takers and givers at once on a small pool, on several threads:
    /// none is left waiting with tokens free (a lost wake-up would hang it
    /// past the bound), and every token comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn tokens_lose_no_wake_up_under_contention() {
        let t = Arc::new(Tokens::new(5));
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let t = t.clone();
                tokio::spawn(async move {
                    for k in 0..2000 {
                        let n = 1 + (i + k) % 3;
                        t.take(n).await.unwrap();
                        if k % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                        t.give(n);
                    }
                })
            })
            .collect();
        let all = futures::future::join_all(tasks);
        for r in tokio::time::timeout(Duration::from_secs(30), all).await.expect("no taker left hanging") {
            r.unwrap();
        }
        assert_eq!((t.available(), t.waiting.load(SeqCst)), (5, 0));
    }

    #[tokio::test]
    async fn closing_fails_the_waiter_and_every_later_taker() {
        let t = Arc::new(Tokens::new(1));
        let held = t.try_take_one().expect("one free");
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.take_one().await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        t.close();
        assert_eq!(waiter.await.unwrap(), Err(Closed));
        drop(held);
        assert_eq!(t.available(), 1, "a token given back after the close is counted");
        assert!(t.try_take_one().is_none(), "closed tokens are not taken");
        assert!(t.is_closed());
    }
}
