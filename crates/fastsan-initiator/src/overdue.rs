//! Request timeouts, the same for the three clients (BRP, NBD, NVMe/TCP):
//! one coarse clock per connection instead of a timer per request.
//!
//! A request notes the connection's [`Clock`] when it is sent (a load: the
//! hot path reads no time). The connection's reader advances the clock
//! [`TICKS`] times per request timeout while it waits for replies
//! ([`Ticker::read`]) and, at each tick, looks for a request sent more than
//! `TICKS` ticks ago: then the connection is cut (nobody can tell whether
//! that request landed) and every request on it fails. A request is thus
//! given up between its timeout and 1.25 times it.
//!
//! Until 2026-11-27 the NBD and NVMe/TCP clients wrapped every request in
//! `tokio::time::timeout`: a timer-wheel entry registered, re-registered and
//! cleared per request, and the clock read for each. Without it their CPU per
//! I/O fell 7-13% (docs/benchmarks.md, "One request clock per connection").

use bytes::BufMut;
use futures::FutureExt;
use std::io;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::{Instant, Interval, MissedTickBehavior};

/// Ticks of the clock per request timeout.
const TICKS: u32 = 4;

/// A connection's coarse clock, in ticks of a quarter of its request timeout.
#[derive(Default)]
pub(crate) struct Clock(AtomicU32);

impl Clock {
    /// The tick a request sent now notes.
    pub(crate) fn now(&self) -> u32 {
        self.0.load(Relaxed)
    }
}

/// Whether a request sent at tick `sent` has waited its whole timeout at `now`.
pub(crate) fn overdue(now: u32, sent: u32) -> bool {
    now.wrapping_sub(sent) > TICKS
}

/// A request has waited past its timeout: the connection is to be cut. The
/// error [`Ticker::read`] gives then (inside an `io::Error`: [`is_overdue`]).
#[derive(Debug, thiserror::Error)]
#[error("a request got no reply within the request timeout")]
pub(crate) struct Overdue;

/// Whether `e` is [`Ticker::read`]'s [`Overdue`] (and not the socket's own error).
pub(crate) fn is_overdue(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Overdue>())
}

/// Reads in a row that found data waiting, after which [`Ticker::read`]
/// looks at the clock first.
const CHECK_EVERY: u32 = 32;

/// The reader's side of a connection's [`Clock`].
pub(crate) struct Ticker {
    interval: Interval,
    /// Reads since the clock was last looked at.
    reads: u32,
}

impl Ticker {
    pub(crate) fn new(timeout: Duration) -> Ticker {
        let period = (timeout / TICKS).max(Duration::from_millis(1));
        let mut interval = tokio::time::interval_at(Instant::now() + period, period);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ticker { interval, reads: 0 }
    }

    /// Reads what `rd` has into `into` (`read_buf`: `Ok(0)` at the end of
    /// the stream), advancing `clock` at every tick while it waits; fails
    /// with [`Overdue`] as soon as `any_overdue` (given the new tick) finds a
    /// request past its timeout.
    pub(crate) async fn read<R, B>(
        &mut self,
        rd: &mut R,
        into: &mut B,
        clock: &Clock,
        any_overdue: impl Fn(u32) -> bool,
    ) -> io::Result<usize>
    where
        R: AsyncRead + Unpin,
        B: BufMut + ?Sized,
    {
        // The read goes first: when data is there, the clock is not even
        // looked at. But replies that stream without a pause (a reader
        // slower than its peer) must not keep the clock from ticking, or a
        // request never answered among them would wait for ever: every
        // CHECK_EVERY reads, the clock is looked at first.
        self.reads += 1;
        if self.reads >= CHECK_EVERY {
            self.reads = 0;
            if self.interval.tick().now_or_never().is_some() {
                self.ticked(clock, &any_overdue)?;
            }
        }
        loop {
            tokio::select! {
                biased;
                r = rd.read_buf(into) => return r,
                _ = self.interval.tick() => self.ticked(clock, &any_overdue)?,
            }
        }
    }

    /// A tick: advances `clock`; [`Overdue`] if a request is past its timeout.
    fn ticked(&mut self, clock: &Clock, any_overdue: &impl Fn(u32) -> bool) -> io::Result<()> {
        self.reads = 0;
        let now = clock.0.fetch_add(1, Relaxed).wrapping_add(1);
        match any_overdue(now) {
            true => Err(io::Error::new(io::ErrorKind::TimedOut, Overdue)),
            false => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_overdue_after_more_than_ticks_ticks_even_across_the_wrap() {
        assert!(!overdue(TICKS, 0));
        assert!(overdue(TICKS + 1, 0));
        let sent = u32::MAX - 1;
        assert!(!overdue(sent.wrapping_add(TICKS), sent));
        assert!(overdue(sent.wrapping_add(TICKS + 1), sent));
    }

    /// A silent peer: the reader gives up between the timeout and 1.25
    /// times it (plus a tick's slack), and not while nothing is in flight.
    #[tokio::test(start_paused = true)]
    async fn the_reader_gives_up_on_a_silent_peer_only_with_a_request_in_flight() {
        let (mut rd, _keep) = tokio::io::duplex(64);
        let clock = Clock::default();
        let timeout = Duration::from_secs(8);
        let mut ticker = Ticker::new(timeout);
        let mut buf = Vec::new();
        // Nothing in flight: ten timeouts pass without giving up.
        let idle =
            tokio::time::timeout(10 * timeout, ticker.read(&mut rd, &mut buf, &clock, |_| false)).await;
        assert!(idle.is_err(), "gave up with nothing in flight");
        let sent = clock.now();
        let start = Instant::now();
        let r = ticker.read(&mut rd, &mut buf, &clock, |now| overdue(now, sent)).await;
        assert!(r.as_ref().is_err_and(is_overdue), "{r:?}");
        let waited = start.elapsed();
        assert!(waited >= timeout && waited <= timeout * 5 / 4 + timeout / TICKS, "{waited:?}");
    }

    /// A peer whose data never stops (the read is always ready) cannot keep
    /// the clock from ticking: the request never answered is still given up.
    /// (Real time: paused time would never advance under a busy reader.)
    #[tokio::test]
    async fn replies_streaming_without_a_pause_do_not_stop_the_clock() {
        let mut rd = tokio::io::repeat(7);
        let clock = Clock::default();
        let timeout = Duration::from_millis(40);
        let mut ticker = Ticker::new(timeout);
        let sent = clock.now();
        let mut buf = Vec::with_capacity(64);
        let start = Instant::now();
        let gave_up = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                buf.clear();
                match ticker.read(&mut rd, &mut buf, &clock, |now| overdue(now, sent)).await {
                    Ok(n) => assert!(n > 0),
                    Err(e) => break e,
                }
            }
        })
        .await
        .expect("the clock never ticked while data streamed");
        assert!(is_overdue(&gave_up), "{gave_up:?}");
        assert!(start.elapsed() >= timeout);
    }
}
