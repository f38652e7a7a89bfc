//! The faults layer (`,faults=RULE`, repeatable; `,faults=none` for a layer
//! with no rule yet): injects errors, delays and stalls on chosen operations
//! and ranges, for tests. Rules can be added and cleared while the target
//! runs, through [`Faults`] (see `ServerHandle::faults`).
//!
//! A rule is `OPS:EFFECT[@START-END]`:
//! - OPS: `read`, `write`, `flush`, `trim`, `zero`, `extents`, `cache` or
//!   `any`, joined with `+` (`read+write`);
//! - EFFECT: `eio`, `enospc`, `enotsup` (the call fails; `enotsup` as a
//!   store that cannot do it answers), `delay=DURATION` (the call
//!   waits, then runs), `stall` (the call waits until the rules are cleared);
//! - `@START-END`: only calls that touch this byte range (sizes take K, M, G
//!   suffixes; END exclusive). FLUSH touches no range: a ranged rule never
//!   matches it.
//!
//! Examples: `write:eio@1M-2M`, `read+write:delay=20ms`, `flush:eio`, `any:stall`.

use super::{Backend, BackendError, Layer, Result, ZeroFlags};
use crate::request::Extent;
use parking_lot::{Condvar, Mutex};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Which operations a rule applies to (a bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultOps(u8);

impl FaultOps {
    pub const READ: FaultOps = FaultOps(1);
    pub const WRITE: FaultOps = FaultOps(2);
    pub const FLUSH: FaultOps = FaultOps(4);
    pub const TRIM: FaultOps = FaultOps(8);
    pub const ZERO: FaultOps = FaultOps(16);
    pub const EXTENTS: FaultOps = FaultOps(32);
    pub const CACHE: FaultOps = FaultOps(64);
    pub const ANY: FaultOps = FaultOps(127);

    const NAMES: [(&'static str, FaultOps); 8] = [
        ("read", Self::READ),
        ("write", Self::WRITE),
        ("flush", Self::FLUSH),
        ("trim", Self::TRIM),
        ("zero", Self::ZERO),
        ("extents", Self::EXTENTS),
        ("cache", Self::CACHE),
        ("any", Self::ANY),
    ];

    pub fn contains(self, other: FaultOps) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for FaultOps {
    type Output = FaultOps;
    fn bitor(self, o: FaultOps) -> FaultOps {
        FaultOps(self.0 | o.0)
    }
}

/// What a matching call suffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// The call fails with this error and does nothing.
    Fail(BackendError),
    /// The call waits, then runs.
    Delay(Duration),
    /// The call waits until the rules are cleared (at most ten minutes), then runs.
    Stall,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRule {
    pub ops: FaultOps,
    pub effect: Effect,
    /// Only calls touching these bytes; `None`: every call.
    pub range: Option<Range<u64>>,
    /// How many more times the rule fires; `None`: forever.
    pub times: Option<u64>,
}

impl FaultRule {
    pub fn new(ops: FaultOps, effect: Effect) -> Self {
        FaultRule { ops, effect, range: None, times: None }
    }

    pub fn range(mut self, r: Range<u64>) -> Self {
        self.range = Some(r);
        self
    }

    /// The rule fires `n` times, then is removed (`0`: never).
    pub fn times(mut self, n: u64) -> Self {
        self.times = Some(n);
        self
    }

    /// Parses `OPS:EFFECT[@START-END]` (see the module docs).
    pub fn parse(s: &str) -> std::result::Result<FaultRule, String> {
        let (rule, range) = match s.split_once('@') {
            Some((r, range)) => (r, Some(range)),
            None => (s, None),
        };
        let (ops_s, effect_s) = rule
            .split_once(':')
            .ok_or_else(|| format!("fault rule {s:?}: expected OPS:EFFECT[@START-END]"))?;
        let mut ops = FaultOps(0);
        for name in ops_s.split('+') {
            let op = FaultOps::NAMES.iter().find(|(n, _)| *n == name).map(|(_, o)| *o).ok_or_else(|| {
                format!("fault rule {s:?}: unknown operation {name:?} (read, write, flush, trim, zero, extents, cache, any)")
            })?;
            ops = ops | op;
        }
        let effect = match effect_s {
            "eio" => Effect::Fail(BackendError::Io(libc::EIO)),
            "enospc" => Effect::Fail(BackendError::NoSpace),
            "enotsup" => Effect::Fail(BackendError::Unsupported),
            "stall" => Effect::Stall,
            d if d.starts_with("delay=") => Effect::Delay(
                crate::config::parse_duration(&d["delay=".len()..])
                    .map_err(|e| format!("fault rule {s:?}: {e}"))?,
            ),
            other => {
                return Err(format!(
                    "fault rule {s:?}: unknown effect {other:?} (eio, enospc, enotsup, delay=DURATION, stall)"
                ))
            }
        };
        let range = match range {
            None => None,
            Some(r) => {
                let (a, b) =
                    r.split_once('-').ok_or_else(|| format!("fault rule {s:?}: range is START-END"))?;
                let size =
                    |x: &str| crate::config::parse_size(x).map_err(|e| format!("fault rule {s:?}: {e}"));
                let (a, b) = (size(a)?, size(b)?);
                if a >= b {
                    return Err(format!("fault rule {s:?}: the range is empty"));
                }
                Some(a..b)
            }
        };
        Ok(FaultRule { ops, effect, range, times: None })
    }

    fn matches(&self, op: FaultOps, span: Option<(u64, u64)>) -> bool {
        if !self.ops.contains(op) || self.times == Some(0) {
            return false;
        }
        match (&self.range, span) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(r), Some((off, len))) => off < r.end && off.saturating_add(len) > r.start,
        }
    }
}

/// The rules of one faults layer, shared with whoever steers it (a test).
#[derive(Clone)]
pub struct Faults(Arc<State>);

struct State {
    rules: Mutex<Rules>,
    /// Fast path: false when there is no rule, so an idle layer costs one load.
    armed: AtomicBool,
    cleared: Condvar,
    injected: AtomicU64,
}

struct Rules {
    list: Vec<FaultRule>,
    /// Bumped by every clear, so stalled calls know to go on.
    generation: u64,
}

impl Faults {
    pub fn new(rules: Vec<FaultRule>) -> Faults {
        let armed = AtomicBool::new(!rules.is_empty());
        Faults(Arc::new(State {
            rules: Mutex::new(Rules { list: rules, generation: 0 }),
            armed,
            cleared: Condvar::new(),
            injected: AtomicU64::new(0),
        }))
    }

    /// Adds a rule; it applies to calls that start from now on.
    pub fn add(&self, rule: FaultRule) {
        self.0.rules.lock().list.push(rule);
        self.0.armed.store(true, Ordering::Release);
    }

    /// Removes every rule and releases stalled calls.
    pub fn clear(&self) {
        let mut r = self.0.rules.lock();
        r.list.clear();
        r.generation += 1;
        self.0.armed.store(false, Ordering::Release);
        self.0.cleared.notify_all();
    }

    /// How many calls a rule has hit so far.
    pub fn injected(&self) -> u64 {
        self.0.injected.load(Ordering::Relaxed)
    }

    /// Applies the first rule that matches this call, if any.
    fn check(&self, op: FaultOps, span: Option<(u64, u64)>) -> Result<()> {
        if !self.0.armed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut rules = self.0.rules.lock();
        let Some(i) = rules.list.iter().position(|r| r.matches(op, span)) else { return Ok(()) };
        let rule = &mut rules.list[i];
        let effect = rule.effect;
        if let Some(n) = rule.times.as_mut() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                rules.list.remove(i);
                if rules.list.is_empty() {
                    self.0.armed.store(false, Ordering::Release);
                }
            }
        }
        self.0.injected.fetch_add(1, Ordering::Relaxed);
        match effect {
            Effect::Fail(e) => Err(e),
            Effect::Delay(d) => {
                drop(rules);
                std::thread::sleep(d);
                Ok(())
            }
            Effect::Stall => {
                let gen = rules.generation;
                let deadline = std::time::Instant::now() + Duration::from_secs(600);
                while rules.generation == gen && std::time::Instant::now() < deadline {
                    self.0.cleared.wait_until(&mut rules, deadline);
                }
                Ok(())
            }
        }
    }
}

pub struct FaultLayer {
    next: Arc<dyn Backend>,
    faults: Faults,
}

impl FaultLayer {
    pub fn new(next: Arc<dyn Backend>, faults: Faults) -> Self {
        FaultLayer { next, faults }
    }
}

impl Layer for FaultLayer {
    fn next(&self) -> &dyn Backend {
        &*self.next
    }
    fn may_block(&self) -> bool {
        // Rules that delay or stall can be added at any time.
        true
    }
    fn describe(&self) -> String {
        format!("{}, with fault injection", self.next.describe())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.faults.check(FaultOps::READ, Some((offset, buf.len() as u64)))?;
        self.next.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.faults.check(FaultOps::WRITE, Some((offset, buf.len() as u64)))?;
        self.next.write_at(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.faults.check(FaultOps::FLUSH, None)?;
        self.next.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.faults.check(FaultOps::TRIM, Some((offset, len)))?;
        self.next.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.faults.check(FaultOps::ZERO, Some((offset, len)))?;
        self.next.write_zeroes(offset, len, flags)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.faults.check(FaultOps::EXTENTS, Some((offset, len)))?;
        self.next.extents(offset, len)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.faults.check(FaultOps::CACHE, Some((offset, len)))?;
        self.next.cache(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;

    fn layer(rules: &[&str]) -> (Arc<dyn Backend>, Faults) {
        let f = Faults::new(rules.iter().map(|r| FaultRule::parse(r).unwrap()).collect());
        (Arc::new(FaultLayer::new(Arc::new(MemoryBackend::new(4 << 20)), f.clone())), f)
    }

    #[test]
    fn rules_parse_and_bad_ones_say_why() {
        let r = FaultRule::parse("read+write:eio@1M-2M").unwrap();
        assert_eq!(r.ops, FaultOps::READ | FaultOps::WRITE);
        assert_eq!(r.effect, Effect::Fail(BackendError::Io(libc::EIO)));
        assert_eq!(r.range, Some((1 << 20)..(2 << 20)));
        assert_eq!(
            FaultRule::parse("flush:delay=20ms").unwrap().effect,
            Effect::Delay(Duration::from_millis(20))
        );
        for (bad, why) in [
            ("write", "OPS:EFFECT"),
            ("wrte:eio", "unknown operation"),
            ("write:boom", "unknown effect"),
            ("write:eio@2M-1M", "empty"),
            ("write:eio@1M", "START-END"),
            ("write:delay=soon", "duration"),
        ] {
            let e = FaultRule::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn an_error_hits_only_its_operations_and_range_and_changes_nothing() {
        let (l, f) = layer(&["write:eio@1M-2M"]);
        assert_eq!(l.write_at(&[1; 4096], (1 << 20) - 2048, false), Err(BackendError::Io(libc::EIO)));
        let mut back = [9u8; 4096];
        l.read_at(&mut back, (1 << 20) - 2048).unwrap();
        assert_eq!(back, [0; 4096], "a failed write wrote nothing, and reads are not hit");
        l.write_at(&[1; 4096], 2 << 20, false).unwrap();
        l.flush().unwrap();
        assert_eq!(f.injected(), 1);
        f.clear();
        l.write_at(&[1; 4096], 1 << 20, false).unwrap();
    }

    #[test]
    fn counted_rules_expire_and_rules_can_be_added_at_run_time() {
        let (l, f) = layer(&[]);
        l.flush().unwrap();
        f.add(FaultRule::new(FaultOps::FLUSH, Effect::Fail(BackendError::NoSpace)).times(0));
        l.flush().unwrap();
        f.add(FaultRule::new(FaultOps::FLUSH, Effect::Fail(BackendError::NoSpace)).times(2));
        assert_eq!(l.flush(), Err(BackendError::NoSpace));
        assert_eq!(l.flush(), Err(BackendError::NoSpace));
        l.flush().unwrap();
    }

    #[test]
    fn a_stall_holds_the_call_until_cleared() {
        let (l, f) = layer(&["read:stall"]);
        let l2 = l.clone();
        let t = std::thread::spawn(move || {
            let mut b = [0u8; 512];
            l2.read_at(&mut b, 0)
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!t.is_finished(), "the read is stalled");
        f.clear();
        assert_eq!(t.join().unwrap(), Ok(()));
    }
}
