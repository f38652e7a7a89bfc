//! Reply coalescing: the target-side twin of the initiator's adaptive merge.
//!
//! A client that is itself the bottleneck (fio's NBD engine at queue depth
//! 32 spends ~10 us of CPU per request, the target ~2) sends its requests
//! one at a time, each in its own segment, so every read of the target
//! brings one or two of them and every reply goes out in a `writev` of its
//! own, waking the client for one or two replies: a read, a write and a
//! wake-up per request on both sides. Holding the replies of such a read a
//! few microseconds, while the client's next requests arrive, lets one read,
//! one `writev` and one wake-up serve ten (docs/benchmarks.md, "Reply
//! coalescing").
//!
//! Holding replies is only right while the client keeps sending: a client
//! waiting for the very replies held (queue depth 1 to 4, or any client
//! whose requests are all here) would wait the whole window for nothing. So
//! the driver waits in *rounds* ([`ROUNDS`] of [`Coalesce`]'s window at most)
//! and the rule learns from each:
//! - a read that brought a few requests ([`FEW`] or less) opens a linger,
//!   unless it is backing off;
//! - each round that brings a few more requests ([`BURST`] or less) allows
//!   another, up to [`ROUNDS`]; then the replies go, and the next read may
//!   linger again;
//! - a round that brings nothing means the client has stopped sending (it
//!   waits for what is held), and one that brings a burst means a client
//!   quick to send, now waiting for the replies held: either way the
//!   replies go at once, and lingering backs off for [`FIRST_BACKOFF`]
//!   reads, twice as many after each such round, up to [`MOST_BACKOFF`]. A
//!   client at queue depth 1 thus pays one window every thousand requests
//!   or so, and a fast initiator at queue depth 32 about as little.
//!
//! The wait is a `timerfd` (the runtime's timers tick in milliseconds), one
//! per connection, made at its first linger and closed again when lingering
//! backs off for long (a client at queue depth 1 keeps no descriptor); the
//! thread runs other connections meanwhile. Replies the client needs before
//! it can go on (an NVMe/TCP R2T) are never held: a read that brought one
//! does not linger.

use std::io;
use std::time::Duration;

/// Requests in a read at most that open a linger: more, and the client's
/// requests come in batches already.
pub const FEW: u32 = 3;
/// Requests in one round at most that still look like a trickle: more, and
/// the client was quick to send them all, so it is not the bottleneck and
/// waits for the replies held.
pub const BURST: u32 = 12;
/// Rounds of one window at most that replies are held.
pub const ROUNDS: u32 = 2;
/// Reads without a linger after the first fruitless round.
pub const FIRST_BACKOFF: u32 = 8;
/// Reads without a linger at most, after fruitless rounds in a row.
pub const MOST_BACKOFF: u32 = 1024;
/// A backoff this long gives the connection's timer back.
const LONG_BACKOFF: u32 = 64;

/// One connection's coalescing state: what the driver asks after each read.
#[derive(Debug)]
pub struct Coalesce {
    /// One round's wait; zero: never linger.
    window: Duration,
    /// Reads left without a linger, and how many the next fruitless round sets.
    skip: u32,
    backoff: u32,
    /// Rounds waited and requests held in the current linger.
    rounds: u32,
    held: u32,
}

impl Coalesce {
    pub fn new(window: Duration) -> Coalesce {
        Coalesce { window, skip: 0, backoff: FIRST_BACKOFF, rounds: 0, held: 0 }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    /// A read brought `requests`, all dispatched. Whether to hold their
    /// replies (and the ones held before) for another round.
    pub fn linger(&mut self, requests: u32) -> bool {
        if self.window.is_zero() {
            return false;
        }
        if self.rounds == 0 {
            // A new read: is it one of a client's trickle of requests?
            if requests == 0 || requests > FEW {
                return false;
            }
            if self.skip > 0 {
                self.skip -= 1;
                return false;
            }
        } else if requests == 0 || requests > BURST {
            // The round brought nothing: the client waits for what is held.
            // Or a burst: a client quick to send, which now waits for the
            // replies held (queue depth 32 from a fast initiator).
            self.backoff_more();
            return false;
        } else if self.rounds >= ROUNDS {
            // The client kept sending to the end: a linger worth its wait.
            self.backoff = FIRST_BACKOFF;
            return false;
        }
        self.rounds += 1;
        self.held += requests;
        true
    }

    /// The round ended without a request: the client closed, the read failed,
    /// or nothing came. (The next [`Coalesce::linger`] says the same for a
    /// round that brought bytes but no whole request.)
    pub fn nothing_came(&mut self) {
        self.backoff_more();
    }

    /// The replies go: every request since the linger began, `requests` of
    /// the last read with them; and whether any was held for a round.
    pub fn release(&mut self, requests: u32) -> (u32, bool) {
        let all = (self.held + requests, self.rounds > 0);
        (self.rounds, self.held) = (0, 0);
        all
    }

    /// Whether lingering backs off for long (several fruitless rounds in a
    /// row): the connection's timer is not worth its descriptor meanwhile.
    pub fn backed_off_long(&self) -> bool {
        self.skip >= LONG_BACKOFF
    }

    fn backoff_more(&mut self) {
        self.skip = self.backoff;
        self.backoff = (self.backoff * 2).min(MOST_BACKOFF);
    }
}

/// A one-shot timer the runtime can wait on (a `timerfd`), for waits finer
/// than the runtime's millisecond timers.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub struct Timer(tokio::io::unix::AsyncFd<TimerFd>);

#[cfg(any(target_os = "linux", target_os = "android"))]
struct TimerFd(nix::sys::timerfd::TimerFd);

#[cfg(any(target_os = "linux", target_os = "android"))]
impl std::os::fd::AsRawFd for TimerFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
impl Timer {
    /// Needs a runtime with I/O enabled; fails when out of descriptors.
    pub fn new() -> io::Result<Timer> {
        use nix::sys::timerfd::{ClockId, TimerFlags};
        let fd = nix::sys::timerfd::TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        // SAFETY: `TimerFd` owns the descriptor (an `OwnedFd` inside nix's
        // `TimerFd`) and always answers it; it is closed only when the
        // `AsyncFd` drops it.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(TimerFd(fd), tokio::io::Interest::READABLE)
        };
        Ok(Timer(fd?))
    }

    /// Waits `d` (more than zero).
    pub async fn sleep(&self, d: Duration) -> io::Result<()> {
        use nix::sys::time::TimeSpec;
        use nix::sys::timerfd::{Expiration, TimerSetTimeFlags};
        // Setting it anew also resets its count of expiries, so the
        // descriptor is not read: each expiry is a new edge for the runtime,
        // and the readiness it leaves is cleared here instead. (Reading it
        // cost two `read`s a round: the first met the readiness of the last
        // round's expiry, already read, and found nothing.)
        self.0
            .get_ref()
            .0
            .set(Expiration::OneShot(TimeSpec::from_duration(d)), TimerSetTimeFlags::empty())?;
        // A wait given up before its expiry would leave that expiry's
        // readiness to the next wait and cut it short (a shorter round,
        // never a wrong reply); the driver gives a wait up only when the
        // connection ends, and the timer goes with it.
        let mut ready = self.0.readable().await?;
        ready.clear_ready();
        Ok(())
    }
}

/// Elsewhere there is no timer: connections do not linger.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub struct Timer;

#[cfg(not(any(target_os = "linux", target_os = "android")))]
impl Timer {
    pub fn new() -> io::Result<Timer> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "no timerfd here"))
    }
    pub async fn sleep(&self, _d: Duration) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_micros(20);

    /// One linger whose reads brought `reads` requests each (the first is
    /// the read that opened it); how many rounds it waited.
    fn linger(c: &mut Coalesce, reads: &[u32]) -> u32 {
        let mut waited = 0;
        for &r in reads {
            if !c.linger(r) {
                break;
            }
            waited += 1;
        }
        c.release(0);
        waited
    }

    /// Reads of one request each that pass without a linger before one
    /// lingers (its rounds then end at once).
    fn reads_until_it_lingers(c: &mut Coalesce) -> u32 {
        let mut skipped = 0;
        while !c.linger(1) {
            skipped += 1;
            assert!(skipped <= MOST_BACKOFF, "never lingers again");
        }
        c.release(0);
        skipped
    }

    #[test]
    fn a_trickle_of_requests_lingers_its_rounds_and_again_at_the_next_read() {
        let mut c = Coalesce::new(W);
        for _ in 0..100 {
            assert_eq!(linger(&mut c, &[1, 2, 3, 1]), ROUNDS);
        }
    }

    #[test]
    fn reads_of_many_requests_or_none_never_linger_and_zero_turns_it_off() {
        let mut c = Coalesce::new(W);
        assert!(!c.linger(FEW + 1));
        assert!(!c.linger(0));
        let mut off = Coalesce::new(Duration::ZERO);
        assert!(!off.linger(1));
    }

    #[test]
    fn the_replies_released_are_every_request_held_and_the_last_reads() {
        let mut c = Coalesce::new(W);
        assert!(c.linger(2) && c.linger(BURST));
        assert!(!c.linger(3), "the rounds are over");
        assert_eq!(c.release(3), (2 + BURST + 3, true));
        assert_eq!(c.release(FEW + 1), (FEW + 1, false));
        assert!(c.linger(1), "and the next read lingers again");
    }

    #[test]
    fn a_round_that_brings_a_burst_backs_off() {
        let mut c = Coalesce::new(W);
        assert!(c.linger(1));
        assert!(!c.linger(BURST + 1));
        assert_eq!(c.release(BURST + 1), (BURST + 2, true));
        assert_eq!(reads_until_it_lingers(&mut c), FIRST_BACKOFF);
    }

    #[test]
    fn a_client_that_waits_for_its_replies_makes_lingering_back_off_longer_each_time() {
        let mut c = Coalesce::new(W);
        // Queue depth 1: the linger's round brings nothing.
        let mut gaps = Vec::new();
        for _ in 0..6 {
            assert_eq!(linger(&mut c, &[1, 0]), 1);
            gaps.push(reads_until_it_lingers(&mut c));
        }
        assert_eq!(gaps, [8, 16, 32, 64, 128, 256]);
        // A linger that pays resets the backoff.
        let mut c = Coalesce::new(W);
        assert_eq!(linger(&mut c, &[1, 0]), 1);
        (0..FIRST_BACKOFF).for_each(|_| assert!(!c.linger(1)));
        assert_eq!(linger(&mut c, &[1, 1, 1]), ROUNDS);
        assert_eq!(linger(&mut c, &[1, 0]), 1);
        assert_eq!(reads_until_it_lingers(&mut c), FIRST_BACKOFF);
    }

    #[test]
    fn only_a_long_backoff_gives_the_timer_back() {
        let mut c = Coalesce::new(W);
        let mut long = Vec::new();
        for _ in 0..5 {
            assert_eq!(linger(&mut c, &[1, 0]), 1);
            long.push(c.backed_off_long());
            reads_until_it_lingers(&mut c);
        }
        assert_eq!(long, [false, false, false, true, true], "backoffs of 8, 16, 32, 64, 128 reads");
    }

    #[test]
    fn a_round_that_brought_no_request_backs_off() {
        let mut c = Coalesce::new(W);
        assert!(c.linger(1));
        c.nothing_came();
        c.release(0);
        assert!(!c.linger(1));
    }

    #[tokio::test]
    async fn the_timer_waits_about_its_time_and_can_be_set_again() {
        let t = Timer::new().expect("a timerfd");
        for us in [50u64, 2000, 50] {
            let at = std::time::Instant::now();
            t.sleep(Duration::from_micros(us)).await.expect("waited");
            assert!(at.elapsed() >= Duration::from_micros(us), "woke early after {:?}", at.elapsed());
        }
    }
}
