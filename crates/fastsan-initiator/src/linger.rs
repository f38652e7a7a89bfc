//! How long the adaptive sender lingers to gather a batch when its
//! connection is loaded: measured on the connection, not guessed.
//!
//! Lingering (a few scheduler turns before a send, so that the requesters
//! woken by the last replies can queue behind the first request) trades a
//! little latency per frame for fewer, larger frames. Which side of that
//! trade wins depends on the load, the machine and the target: on one host
//! 4 requesters ran 0.78-0.86x as fast lingering 2 turns as sending at once,
//! while 128 requesters ran 1.05x faster lingering 3 (docs/benchmarks.md,
//! "Adaptive merge"), and both moved from run to run. So each connection
//! measures: it runs its best choice, now and then tries a neighbouring
//! one, and moves when the neighbour carried more requests per second than
//! the best did right after it. Both are measured the same way: an epoch
//! after the change, not counted, then one counted. Any change disturbs
//! the requesters (a convoy breaks up, what had gathered drains) and runs
//! faster for a while whichever way it went; measured against the steady
//! epochs before a trial, every trial looked 3-10% better than its
//! baseline and the choice wandered (64 requesters: 0.80-0.85x of a fixed
//! choice). Against the epoch just after it, both sides carry the same
//! disturbance, and a load that drifts moves both alike.
//!
//! One pair of epochs decides nothing: on a 2-core machine shared by client
//! and target, the rate of one 10 ms epoch at 64 requesters moved by up to
//! 30% from the next. So each trial adds its log ratio to the evidence for
//! that neighbour (a sequential test), and the neighbour takes over only
//! when the evidence passes [`EVIDENCE`]: a neighbour 10% faster wins in
//! about three trials, while equal choices under that noise trade places
//! only seconds apart. Under a closed loop (requesters that
//! wait for their replies, as every benchmark and most applications)
//! requests sent per second is the throughput the choice gives; at a load
//! the choice cannot change (a rate-limited client) the rates tie and
//! nothing moves.

use std::time::{Duration, Instant};

/// The choices: from 0 (send what is queued at once) to the turns
/// always-merge lingers.
pub(crate) const MAX_TURNS: u8 = 3;
/// Where a connection starts (the fixed choice before the controller).
const START: u8 = 2;
/// An epoch ends after this long and this many requests, whichever is later.
const EPOCH: Duration = Duration::from_millis(20);
const EPOCH_REQUESTS: u64 = 64;
/// An epoch longer than this had a pause in it (the load stopped): its rate
/// says nothing about the choice, and a trial under way is dropped.
const STALE: Duration = Duration::from_millis(100);
/// Epochs at the best choice between two trials: an eighth of the time on
/// the neighbour tried (two epochs of sixteen), so a neighbour 20% slower
/// costs 2.5%.
const SETTLE: u32 = 12;
/// The evidence (the sum of ln(trial rate / best's rate) over a
/// neighbour's trials) that makes the neighbour the best. It is kept
/// between minus this and this: old evidence against a neighbour must not
/// outweigh a load that has changed.
const EVIDENCE: f64 = 0.3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Running the best choice for `SETTLE` epochs.
    Settle,
    /// An epoch on the neighbour being tried, not counted, then one counted.
    Trial { warm: bool },
    /// An epoch on the best choice again, not counted, then one counted to compare with.
    Check { warm: bool },
}

/// The per-connection controller; see the module docs.
#[derive(Debug)]
pub(crate) struct Linger {
    best: u8,
    now: u8,
    phase: Phase,
    /// Epochs left in [`Phase::Settle`].
    settle: u32,
    /// Which neighbour the next trial tries: up (`true`) or down.
    up: bool,
    started: Instant,
    requests: u64,
    /// The trial's rate.
    trial: f64,
    /// The evidence for the neighbour below and above the best.
    evidence: [f64; 2],
}

impl Linger {
    pub(crate) fn new(now: Instant) -> Linger {
        Linger {
            best: START,
            now: START,
            phase: Phase::Settle,
            settle: SETTLE,
            up: false,
            started: now,
            requests: 0,
            trial: 0.0,
            evidence: [0.0; 2],
        }
    }

    /// Turns to linger before the next send, when the connection is loaded.
    pub(crate) fn turns(&self) -> u8 {
        self.now
    }

    /// The choice the connection has settled on.
    #[cfg(test)]
    fn best(&self) -> u8 {
        self.best
    }

    /// A frame of `n` requests left at `at`.
    pub(crate) fn sent(&mut self, n: usize, at: Instant) {
        self.requests += n as u64;
        let took = at.saturating_duration_since(self.started);
        if took < EPOCH || self.requests < EPOCH_REQUESTS {
            if took >= STALE {
                // Too few requests for too long: not a load to measure.
                self.restart(at);
            }
            return;
        }
        if took >= STALE {
            self.restart(at);
            return;
        }
        let rate = self.requests as f64 / took.as_secs_f64();
        (self.started, self.requests) = (at, 0);
        match self.phase {
            Phase::Settle => {
                self.settle = self.settle.saturating_sub(1);
                if self.settle > 0 {
                    return;
                }
                let Some(next) = self.neighbour() else { return };
                self.now = next;
                self.phase = Phase::Trial { warm: false };
            }
            Phase::Trial { warm: false } => self.phase = Phase::Trial { warm: true },
            Phase::Trial { warm: true } => {
                self.trial = rate;
                self.now = self.best;
                self.phase = Phase::Check { warm: false };
            }
            Phase::Check { warm: false } => self.phase = Phase::Check { warm: true },
            Phase::Check { warm: true } => {
                let tried = self.neighbour().expect("a trial had a neighbour");
                let e = &mut self.evidence[self.up as usize];
                *e = (*e + (self.trial / rate).ln()).max(-EVIDENCE);
                if *e >= EVIDENCE {
                    tracing::debug!(
                        from = self.best,
                        to = tried,
                        "lingering {tried} turns carried more requests ({:.0}/s against {rate:.0}/s at the last trial)",
                        self.trial
                    );
                    // Keep going the same way soon: the best may be further on.
                    self.best = tried;
                    self.evidence = [0.0; 2];
                    self.settle = SETTLE / 4;
                } else if *e > 0.0 {
                    // Promising: try it again soon, before the other side.
                    self.settle = SETTLE / 2;
                } else {
                    self.up = !self.up;
                    self.settle = SETTLE;
                }
                self.now = self.best;
                self.phase = Phase::Settle;
            }
        }
    }

    /// The choice next to the best in the direction of the next trial
    /// (turning around at either end).
    fn neighbour(&mut self) -> Option<u8> {
        if self.up && self.best == MAX_TURNS || !self.up && self.best == 0 {
            self.up = !self.up;
        }
        debug_assert!(self.best <= MAX_TURNS);
        match self.up {
            true => self.best.checked_add(1).filter(|&t| t <= MAX_TURNS),
            false => self.best.checked_sub(1),
        }
    }

    /// Forgets the epoch (and a trial under way) and starts afresh at `at`.
    fn restart(&mut self, at: Instant) {
        (self.started, self.requests) = (at, 0);
        self.now = self.best;
        self.phase = Phase::Settle;
        self.settle = SETTLE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives a controller under a closed loop whose throughput at each
    /// choice is `rate(turns, seconds since start)` requests per second
    /// (times a noise factor), one request per frame, for `secs`; returns
    /// the controller and the share of requests sent at each choice in the
    /// second half.
    fn drive(secs: f64, rate: impl FnMut(u8, f64) -> f64, noise: impl FnMut() -> f64) -> (Linger, [f64; 4]) {
        drive_with(secs, rate, noise, 1.0)
    }

    /// [`drive`], where for 25 ms after every change of choice the rate is
    /// `burst` times the steady one (the requesters disturbed).
    fn drive_with(
        secs: f64,
        mut rate: impl FnMut(u8, f64) -> f64,
        mut noise: impl FnMut() -> f64,
        burst: f64,
    ) -> (Linger, [f64; 4]) {
        let t0 = Instant::now();
        let mut l = Linger::new(t0);
        let (mut at, mut shares, mut total) = (0.0f64, [0.0; 4], 0.0);
        let mut factor = noise();
        let mut epoch = 0u64;
        let (mut last, mut changed) = (l.turns(), 0.0f64);
        while at < secs {
            if at < secs / 2.0 {
                // Shares count the second half: where it settled, not how it got there.
                (shares, total) = ([0.0; 4], 0.0);
            }
            // The noise changes per epoch-sized stretch of time.
            if (at / 0.010) as u64 != epoch {
                epoch = (at / 0.010) as u64;
                factor = noise();
            }
            if l.turns() != last {
                (last, changed) = (l.turns(), at);
            }
            let settling = if at - changed < 0.025 { burst } else { 1.0 };
            let r = rate(l.turns(), at) * factor * settling;
            at += 1.0 / r;
            shares[l.turns() as usize] += 1.0;
            total += 1.0;
            l.sent(1, t0 + Duration::from_secs_f64(at));
        }
        (l, shares.map(|s| s / total))
    }

    fn steady() -> f64 {
        1.0
    }

    /// A deterministic noise source: `spread` either way, uniform.
    fn jitter(spread: f64) -> impl FnMut() -> f64 {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1.0 + spread * ((x % 2001) as f64 / 1000.0 - 1.0)
        }
    }

    #[test]
    fn it_finds_the_fastest_choice_from_the_start_either_way() {
        // Sending at once is best (few requesters): 2 -> 1 -> 0.
        let (l, shares) = drive(3.0, |t, _| [60e3, 52e3, 46e3, 44e3][t as usize], steady);
        assert_eq!(l.best(), 0);
        assert!(shares[0] > 0.8, "{shares:?}");
        // Lingering longest is best (many requesters): 2 -> 3.
        let (l, shares) = drive(3.0, |t, _| [230e3, 300e3, 410e3, 450e3][t as usize], steady);
        assert_eq!(l.best(), 3);
        assert!(shares[3] > 0.8, "{shares:?}");
        // The start is best: it stays, and trials take an eighth of the time.
        let (l, shares) = drive(3.0, |t, _| [300e3, 380e3, 420e3, 380e3][t as usize], steady);
        assert_eq!(l.best(), 2);
        assert!(shares[2] > 0.85, "{shares:?}");
    }

    #[test]
    fn it_follows_a_load_that_changes() {
        // Heavy for a second (linger longest), then light (send at once).
        let rate = |t: u8, s: f64| {
            if s < 1.0 {
                [230e3, 300e3, 410e3, 450e3][t as usize]
            } else {
                [80e3, 70e3, 60e3, 50e3][t as usize]
            }
        };
        let (l, _) = drive(3.0, rate, steady);
        assert_eq!(l.best(), 0);
    }

    #[test]
    fn noise_neither_hides_a_better_choice_nor_makes_one_up() {
        // ±10% per epoch, choices 12% apart: the best carries most of the load.
        let (l, shares) = drive(4.0, |t, _| [100e3, 112e3, 125e3, 140e3][t as usize], jitter(0.10));
        assert_eq!(l.best(), 3);
        assert!(shares[3] > 0.7, "{shares:?}");
        // Equal choices under that noise: the start keeps the load, no wandering.
        let (l, shares) = drive(4.0, |_, _| 100e3, jitter(0.10));
        assert_eq!(l.best(), START);
        assert!(shares[START as usize] > 0.8, "{shares:?}");
    }

    #[test]
    fn the_burst_after_a_change_is_not_taken_for_a_better_choice() {
        // Every choice alike, but 25 ms after any change run 10% fast: the start keeps the load.
        let (l, shares) = drive_with(4.0, |_, _| 400e3, steady, 1.10);
        assert_eq!(l.best(), START);
        assert!(shares[START as usize] > 0.75, "{shares:?}");
        // And a real difference still wins through it.
        let (l, _) = drive_with(4.0, |t, _| [230e3, 300e3, 410e3, 450e3][t as usize], steady, 1.10);
        assert_eq!(l.best(), 3);
    }

    #[test]
    fn a_pause_drops_the_trial_and_a_light_load_measures_nothing() {
        let t0 = Instant::now();
        let mut l = Linger::new(t0);
        // A steady load until the first trial begins (after the settled epochs).
        let mut at = t0;
        let mut sent = 0;
        while l.phase == Phase::Settle {
            at += Duration::from_micros(110);
            l.sent(1, at);
            sent += 1;
        }
        assert!(sent as f64 * 110e-6 >= SETTLE as f64 * EPOCH.as_secs_f64(), "{sent}");
        assert_eq!(l.phase, Phase::Trial { warm: false });
        assert_ne!(l.turns(), l.best());
        // The load stops for a second: the trial is dropped, the best runs again.
        at += Duration::from_secs(1);
        l.sent(1, at);
        assert_eq!((l.phase, l.turns()), (Phase::Settle, START));
        // A request every 5 ms never makes an epoch: nothing changes.
        for _ in 0..1000 {
            at += Duration::from_millis(5);
            l.sent(1, at);
            assert_eq!(l.turns(), START);
        }
    }
}
