//! Admission to a connection's first exchange: a protocol's handshake at
//! the target's listeners, a request head at the metrics endpoint.
//!
//! A [`Gate`] holds at most `total` exchanges at once and `per_addr` from
//! one address (an IPv6 host counted by its /64, as
//! [`AuthLimiter::key`](crate::access::AuthLimiter::key)), so that silent
//! or slow clients cannot crowd out the others. When there is no place for
//! a newcomer, it closes the oldest exchange still unsettled after the
//! gate's `evictable_after` and takes its place: one of its own address's
//! when that address has its share, else the oldest anywhere. Before, a
//! client holding its address's share (or four addresses holding every
//! place) kept every other client out, with one connection each per
//! timeout. An exchange that *settled* (its OPEN accepted, its request head
//! read) is never closed. A newcomer that finds nothing old enough is
//! refused at once: one that waited would hold its socket, and a flood
//! would hold as many as it sends.

use crate::access::AuthLimiter;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Places for first exchanges; see the module's documentation.
pub struct Gate {
    total: usize,
    per_addr: usize,
    evictable_after: Duration,
    places: Mutex<Places>,
}

#[derive(Default)]
struct Places {
    /// Places taken, settled or not.
    taken: usize,
    /// Places taken per address key; an address holding none is absent.
    by_addr: HashMap<IpAddr, usize>,
    /// Exchanges not yet settled, oldest first (by admission).
    unsettled: BTreeMap<u64, Unsettled>,
    next: u64,
}

struct Unsettled {
    since: Instant,
    addr: Option<IpAddr>,
    close: CancellationToken,
}

/// A connection's place at the [`Gate`]; given back when dropped, unless
/// the gate closed the exchange and gave the place to a newcomer.
pub struct Ticket {
    gate: Arc<Gate>,
    seq: u64,
    addr: Option<IpAddr>,
    /// Cancelled when the gate gave this place to a newcomer (only ever
    /// under the gate's lock, so that `Drop` can tell).
    closed: CancellationToken,
}

impl Gate {
    /// A gate of `total` places, `per_addr` of them at most from one address.
    pub fn new(total: usize, per_addr: usize, evictable_after: Duration) -> Gate {
        Gate { total: total.max(1), per_addr: per_addr.max(1), evictable_after, places: Default::default() }
    }

    /// A place for a connection from `ip` (`None`: a unix socket's, this
    /// host, counted in the total only), or `None` when there is none and
    /// no exchange it could close is old enough.
    pub fn enter(self: &Arc<Self>, ip: Option<IpAddr>) -> Option<Ticket> {
        let addr = ip.map(AuthLimiter::key);
        let mut p = self.places.lock();
        let addr_full = addr.is_some_and(|a| p.by_addr.get(&a).copied().unwrap_or(0) >= self.per_addr);
        if addr_full || p.taken >= self.total {
            // Whom to close: with the address full, one of its own (closing
            // another's would leave this one over its share).
            let victim = p
                .unsettled
                .iter()
                .take_while(|(_, u)| u.since.elapsed() >= self.evictable_after)
                .find(|(_, u)| !addr_full || u.addr == addr)
                .map(|(seq, _)| *seq)?;
            let u = p.unsettled.remove(&victim).expect("just found");
            u.close.cancel();
            // Its place is this newcomer's: the total is unchanged.
            p.taken -= 1;
            p.give_back(u.addr);
        }
        p.taken += 1;
        if let Some(a) = addr {
            *p.by_addr.entry(a).or_default() += 1;
        }
        let seq = p.next;
        p.next += 1;
        let closed = CancellationToken::new();
        p.unsettled.insert(seq, Unsettled { since: Instant::now(), addr, close: closed.clone() });
        Some(Ticket { gate: self.clone(), seq, addr, closed })
    }
}

impl Places {
    fn give_back(&mut self, addr: Option<IpAddr>) {
        if let Some(a) = addr {
            if let Some(n) = self.by_addr.get_mut(&a) {
                *n -= 1;
                if *n == 0 {
                    self.by_addr.remove(&a);
                }
            }
        }
    }
}

impl Ticket {
    /// The exchange is over (an OPEN or GO accepted, a request head read):
    /// the gate no longer closes it for a newcomer (a reconnect may wait
    /// for its session's fence with this place). False if it was closed
    /// just before: the exchange must end there.
    pub fn settle(&self) -> bool {
        self.gate.places.lock().unsettled.remove(&self.seq).is_some()
    }

    /// Cancelled when the gate closes this exchange for a newcomer.
    pub fn closed(&self) -> &CancellationToken {
        &self.closed
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut p = self.gate.places.lock();
        if self.closed.is_cancelled() {
            return; // its place went to the newcomer that closed it
        }
        p.unsettled.remove(&self.seq);
        p.taken -= 1;
        p.give_back(self.addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unsettled exchange becomes as old as the gate lets it be closed.
    fn age(g: &Gate) {
        for u in g.places.lock().unsettled.values_mut() {
            u.since -= g.evictable_after;
        }
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn a_full_address_closes_its_own_oldest_unsettled_exchange() {
        let g = Arc::new(Gate::new(8, 2, Duration::from_secs(60)));
        let a1 = g.enter(ip("10.0.0.1")).unwrap();
        let a2 = g.enter(ip("10.0.0.1")).unwrap();
        let b = g.enter(ip("10.0.0.2")).unwrap();
        assert!(g.enter(ip("10.0.0.1")).is_none(), "too young to close");
        age(&g);
        assert!(a1.settle(), "settled before anyone closed it");
        let a3 = g.enter(ip("10.0.0.1")).expect("a2 made room");
        assert!(!a1.closed().is_cancelled(), "settled: never closed");
        assert!(a2.closed().is_cancelled() && !a2.settle(), "a2 was closed and cannot settle");
        assert!(!b.closed().is_cancelled(), "another address's exchange is not touched");
        assert!(g.enter(ip("10.0.0.1")).is_none(), "a3 is young, a1 settled");
        drop(a2); // gives nothing back: its place is a3's
        assert!(g.enter(ip("10.0.0.1")).is_none());
        drop(a1);
        let a4 = g.enter(ip("10.0.0.1")).expect("a1's place came back");
        drop((a3, a4, b));
        let p = g.places.lock();
        assert_eq!((p.taken, p.by_addr.len(), p.unsettled.len()), (0, 0, 0), "every place given back");
    }

    #[test]
    fn a_full_gate_closes_the_oldest_unsettled_exchange_anywhere() {
        let g = Arc::new(Gate::new(3, 3, Duration::from_secs(60)));
        let local = g.enter(None).unwrap();
        let a = g.enter(ip("10.0.0.1")).unwrap();
        let b = g.enter(ip("::1")).unwrap();
        assert!(g.enter(ip("10.0.0.3")).is_none(), "every place young");
        age(&g);
        assert!(local.settle());
        let c = g.enter(ip("10.0.0.3")).expect("the oldest unsettled made room");
        assert!(a.closed().is_cancelled() && !b.closed().is_cancelled());
        drop(a);
        assert_eq!(g.places.lock().by_addr.get(&ip("10.0.0.1").unwrap()), None, "a's address holds nothing");
        drop((local, b, c));
        assert_eq!(g.places.lock().taken, 0);
    }
}
