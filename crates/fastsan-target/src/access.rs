//! Who a client is, and what it may open: the same rules for every protocol.
//!
//! - **Identities** come from a named secret (BRP's challenge-response:
//!   `--secrets-file`, or `--secret-file` whose one secret is named
//!   `default`) or from a verified TLS client certificate (its subject's CN).
//!   A client with neither is *anonymous*.
//! - **Grants** (`VOLUME:IDENTITY[:ro|rw]`, `*` for any volume or any
//!   authenticated identity, `anonymous` for a client without one) say which
//!   identities may open which volume, and how. A volume no grant names is
//!   open to every authenticated identity (to anyone when the target
//!   authenticates nobody); a volume some grant names is open only as granted.
//! - Failed authentications are counted per address ([`AuthLimiter`]); an
//!   address with too many in a minute is refused at the door for a while.

use crate::config::ConfigError;
use crate::tls::ServerTls;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The identity name a `--secret-file`'s one secret carries.
pub const DEFAULT_IDENTITY: &str = "default";
/// The name grants use for a client that proved no identity.
pub const ANONYMOUS: &str = "anonymous";

/// How a volume may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    ReadOnly,
    ReadWrite,
}

/// One access rule: `identity` may open `volume` in `mode`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// A volume name, or `*`.
    pub volume: String,
    /// An identity, `*` (any authenticated one) or `anonymous`.
    pub identity: String,
    pub mode: Mode,
}

impl Grant {
    /// `VOLUME:IDENTITY[:ro|rw]` (read-write when the mode is left out).
    pub fn parse(s: &str) -> Result<Grant, ConfigError> {
        let bad = |why: &str| {
            ConfigError::Invalid(format!("grant {s:?}: {why} (expected VOLUME:IDENTITY[:ro|rw])"))
        };
        let mut parts = s.split(':');
        let (Some(volume), Some(identity)) = (parts.next(), parts.next()) else {
            return Err(bad("missing ':'"));
        };
        let mode = match parts.next() {
            None | Some("rw") => Mode::ReadWrite,
            Some("ro") => Mode::ReadOnly,
            Some(_) => return Err(bad("the mode is ro or rw")),
        };
        if parts.next().is_some() {
            return Err(bad("too many ':'"));
        }
        if volume.is_empty() || identity.is_empty() {
            return Err(bad("empty volume or identity"));
        }
        Ok(Grant { volume: volume.into(), identity: identity.into(), mode })
    }

    fn matches(&self, volume: &str, identity: Option<&str>) -> bool {
        let who = match identity {
            Some(id) => self.identity == id || self.identity == "*",
            None => self.identity == ANONYMOUS,
        };
        who && (self.volume == volume || self.volume == "*")
    }
}

/// Reads a secrets file: one `IDENTITY SECRET` per line (the secret is the
/// rest of the line, spaces kept), `#` comments and blank lines skipped.
pub fn read_secrets(path: &Path) -> Result<HashMap<String, Arc<[u8]>>, ConfigError> {
    let err = |why: String| ConfigError::SecretFile { path: path.display().to_string(), why };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    crate::config::warn_if_others_read(path);
    let mut out = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((id, secret)) = line.split_once(char::is_whitespace) else {
            return Err(err(format!("line {}: expected IDENTITY SECRET", i + 1)));
        };
        let secret = secret.trim_start();
        if secret.is_empty() || id.len() > 255 {
            return Err(err(format!("line {}: empty secret or identity over 255 bytes", i + 1)));
        }
        if id == "*" || id == ANONYMOUS {
            return Err(err(format!("line {}: {id:?} is reserved for grants", i + 1)));
        }
        if id.contains(':') {
            let why = "has a ':', which separates a grant's fields (VOLUME:IDENTITY[:ro|rw])";
            return Err(err(format!("line {}: identity {id:?} {why}", i + 1)));
        }
        if out.insert(id.to_owned(), Arc::from(secret.as_bytes())).is_some() {
            return Err(err(format!("line {}: identity {id:?} given twice", i + 1)));
        }
    }
    if out.is_empty() {
        return Err(err("no identity in it".into()));
    }
    Ok(out)
}

/// What a connection's handshake knows about its client.
#[derive(Debug, Clone, Default)]
pub struct Who {
    /// Proven identity (a secret or a certificate); `None`: anonymous.
    pub identity: Option<String>,
    /// The connection runs over TLS.
    pub tls: bool,
    /// The peer is this host (loopback address or unix socket).
    pub local: bool,
    /// The peer's address (TCP).
    pub ip: Option<IpAddr>,
    /// The address the peer connected to (TCP): NVMe's discovery log names it.
    pub via: Option<std::net::SocketAddr>,
}

impl Who {
    pub fn name(&self) -> &str {
        self.identity.as_deref().unwrap_or(ANONYMOUS)
    }
}

/// The target's security settings, shared by every front end.
#[derive(Default)]
pub struct Access {
    /// BRP's named secrets.
    pub secrets: HashMap<String, Arc<[u8]>>,
    pub grants: Vec<Grant>,
    pub tls: Option<Arc<ServerTls>>,
    /// Serve NBD clients that prove no identity although the target
    /// authenticates (the operator's explicit opt-out).
    pub nbd_insecure: bool,
    /// Allow authenticated sessions in plaintext from other hosts (BRP).
    pub insecure_plaintext: bool,
    pub limiter: AuthLimiter,
}

impl Access {
    /// Whether clients must prove who they are (a secret or a client certificate).
    pub fn authenticates(&self) -> bool {
        !self.secrets.is_empty() || self.tls.as_ref().is_some_and(|t| t.verify_clients)
    }

    /// How `who` may open `volume`, or why not. `anonymous_ok`: a client with
    /// no identity counts as authenticated (NBD with `--nbd-insecure`).
    pub fn mode_for(&self, who: &Who, volume: &str, anonymous_ok: bool) -> Result<Mode, String> {
        let id = who.identity.as_deref();
        let named = self.grants.iter().any(|g| g.volume == volume || g.volume == "*");
        if !named {
            if id.is_none() && self.authenticates() && !anonymous_ok {
                return Err("this target requires authentication".into());
            }
            return Ok(Mode::ReadWrite);
        }
        self.grants
            .iter()
            .filter(|g| g.matches(volume, id))
            .map(|g| g.mode)
            .max()
            .ok_or_else(|| format!("{} has no grant for volume {volume:?}", who.name()))
    }
}

/// Failed authentications allowed from one address in [`AuthLimiter::WINDOW`].
pub const MAX_FAILURES: u32 = 10;

/// Counts failed authentications per address (IPv6: per /64) and refuses
/// secret authentication to an address that had [`MAX_FAILURES`] within a
/// minute, until that minute is over: a guesser gets ten tries a minute, not
/// thousands a second. Each try counts as it begins, and a good one is
/// forgiven, so tries sent together on many connections are limited too.
/// Only the secret check is refused (checked when AUTH arrives, so
/// handshakes begun earlier count too): clients with
/// certificates, and targets without secrets, go on serving that address.
#[derive(Default)]
pub struct AuthLimiter {
    by_ip: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

impl AuthLimiter {
    pub const WINDOW: Duration = Duration::from_secs(60);
    /// Addresses remembered at most (the oldest windows are dropped first when full).
    const MAX_TRACKED: usize = 4096;

    /// `Err(wait)` when `ip` is refused for now.
    pub fn check(&self, ip: IpAddr) -> Result<(), Duration> {
        let map = self.by_ip.lock();
        match map.get(&Self::key(ip)) {
            Some(&(start, n)) if n >= MAX_FAILURES => {
                let left = Self::WINDOW.saturating_sub(start.elapsed());
                if left.is_zero() {
                    Ok(())
                } else {
                    Err(left)
                }
            }
            _ => Ok(()),
        }
    }

    /// What failures are counted by: the address, or for IPv6 its /64 (one
    /// host commonly holds the whole /64). An IPv4 address in IPv6 form
    /// (`::ffff:a.b.c.d`, a dual-stack listener's) is its IPv4 address.
    pub fn key(ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
            v4 => v4,
        }
    }

    /// Reserves one try at a secret for `ip`, counted as a failure at once
    /// ([`AuthLimiter::succeeded`] forgives it): tries made in parallel are
    /// counted as they begin, so no more than [`MAX_FAILURES`] are checked in
    /// a window however many handshakes an address holds. `Err(wait)` when the
    /// address is refused for now.
    pub fn attempt(&self, ip: IpAddr) -> Result<(), Duration> {
        let mut map = self.by_ip.lock();
        let e = Self::entry(&mut map, Self::key(ip));
        if e.1 >= MAX_FAILURES {
            return Err(Self::WINDOW.saturating_sub(e.0.elapsed()));
        }
        e.1 += 1;
        Ok(())
    }

    /// The try [`AuthLimiter::attempt`] reserved for `ip` succeeded: it is
    /// not a failure.
    pub fn succeeded(&self, ip: IpAddr) {
        if let Some(e) = self.by_ip.lock().get_mut(&Self::key(ip)) {
            e.1 = e.1.saturating_sub(1);
        }
    }

    /// Records a failure from `ip` that no [`AuthLimiter::attempt`] counted
    /// (a refused certificate, a client that skipped AUTH); whether the
    /// address is now refused.
    pub fn failed(&self, ip: IpAddr) -> bool {
        let mut map = self.by_ip.lock();
        let e = Self::entry(&mut map, Self::key(ip));
        e.1 += 1;
        e.1 >= MAX_FAILURES
    }

    /// `ip`'s count (keyed already), a new window when its last is over.
    fn entry(map: &mut HashMap<IpAddr, (Instant, u32)>, ip: IpAddr) -> &mut (Instant, u32) {
        let now = Instant::now();
        if map.len() >= Self::MAX_TRACKED && !map.contains_key(&ip) {
            map.retain(|_, (start, _)| now.duration_since(*start) < Self::WINDOW);
            // Still full: the oldest window goes, never the new count.
            if map.len() >= Self::MAX_TRACKED {
                if let Some(oldest) = map.iter().min_by_key(|(_, (start, _))| *start).map(|(k, _)| *k) {
                    map.remove(&oldest);
                }
            }
        }
        let e = map.entry(ip).or_insert((now, 0));
        if now.duration_since(e.0) >= Self::WINDOW {
            *e = (now, 0);
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(id: Option<&str>) -> Who {
        Who { identity: id.map(str::to_owned), ..Default::default() }
    }

    #[test]
    fn grants_parse() {
        assert_eq!(
            Grant::parse("v:alice:ro").unwrap(),
            Grant { volume: "v".into(), identity: "alice".into(), mode: Mode::ReadOnly }
        );
        assert_eq!(Grant::parse("*:admin").unwrap().mode, Mode::ReadWrite);
        for bad in ["v", "v:", ":a", "v:a:rx", "v:a:ro:x"] {
            assert!(Grant::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn grants_decide_per_volume_and_identity() {
        let mut a = Access { grants: vec![], ..Default::default() };
        // Nobody authenticates, no grants: everyone, read-write.
        assert_eq!(a.mode_for(&who(None), "v", false), Ok(Mode::ReadWrite));
        a.secrets.insert("alice".into(), Arc::from(&b"x"[..]));
        assert!(a.mode_for(&who(None), "v", false).is_err(), "anonymous, once the target authenticates");
        assert_eq!(a.mode_for(&who(None), "v", true), Ok(Mode::ReadWrite), "unless opted out");
        a.grants = ["v:alice:ro", "v:bob", "*:admin", "pub:anonymous:ro", "w:*:ro"]
            .iter()
            .map(|g| Grant::parse(g).unwrap())
            .collect();
        assert_eq!(a.mode_for(&who(Some("alice")), "v", false), Ok(Mode::ReadOnly));
        assert_eq!(a.mode_for(&who(Some("bob")), "v", false), Ok(Mode::ReadWrite));
        assert_eq!(a.mode_for(&who(Some("admin")), "v", false), Ok(Mode::ReadWrite));
        assert!(a.mode_for(&who(Some("carol")), "v", false).is_err());
        assert!(a.mode_for(&who(None), "v", true).is_err(), "a named volume needs a grant, even opted out");
        assert_eq!(a.mode_for(&who(None), "pub", false), Ok(Mode::ReadOnly));
        assert_eq!(a.mode_for(&who(Some("carol")), "w", false), Ok(Mode::ReadOnly));
        assert!(a.mode_for(&who(None), "w", false).is_err(), "* is any authenticated identity");
        // `*:admin` names every volume: carol, with no grant of her own, is out everywhere.
        assert!(a.mode_for(&who(Some("carol")), "other", false).is_err());
    }

    #[test]
    fn secrets_files() {
        let dir = std::env::temp_dir().join(format!("fastsan-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("s");
        std::fs::write(&p, "# who secret\nalice  open sesame\n\nbob b0b\n").unwrap();
        let s = read_secrets(&p).unwrap();
        assert_eq!(&*s["alice"], b"open sesame");
        assert_eq!(&*s["bob"], b"b0b");
        std::fs::write(&p, "alice x\nalice y\n").unwrap();
        assert!(read_secrets(&p).unwrap_err().to_string().contains("twice"));
        std::fs::write(&p, "lonely\n").unwrap();
        assert!(read_secrets(&p).is_err());
        // A grant could never name it alone (`v:a:b` reads as mode "b").
        std::fs::write(&p, "a:b x\n").unwrap();
        assert!(read_secrets(&p).unwrap_err().to_string().contains("':'"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_limiter_refuses_after_the_budget_and_only_that_address() {
        let l = AuthLimiter::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for i in 1..=MAX_FAILURES {
            assert!(l.check(a).is_ok());
            assert_eq!(l.failed(a), i == MAX_FAILURES);
        }
        let wait = l.check(a).unwrap_err();
        assert!(wait > Duration::from_secs(50) && wait <= AuthLimiter::WINDOW);
        assert!(l.check(b).is_ok());
        // IPv6: one /64 is one guesser.
        let (c, d): (IpAddr, IpAddr) = ("2001:db8::1".parse().unwrap(), "2001:db8::ffff:2".parse().unwrap());
        for _ in 0..MAX_FAILURES {
            l.failed(c);
        }
        assert!(l.check(d).is_err(), "another address of the same /64");
        assert!(l.check("2001:db8:0:1::1".parse().unwrap()).is_ok());
        // IPv4 in IPv6 form (a dual-stack listener's): each its own address,
        // not one /64 that every IPv4 client shares.
        let (e, f): (IpAddr, IpAddr) =
            ("::ffff:10.0.0.5".parse().unwrap(), "::ffff:10.0.0.6".parse().unwrap());
        for _ in 0..MAX_FAILURES {
            l.failed(e);
        }
        assert!(l.check(e).is_err() && l.check("10.0.0.5".parse().unwrap()).is_err());
        assert!(l.check(f).is_ok(), "another IPv4 client goes on");
    }

    #[test]
    fn tries_are_counted_as_they_begin_and_successes_forgiven() {
        let l = AuthLimiter::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        // Tries begun together (none finished yet): the budget, no more.
        for _ in 0..MAX_FAILURES {
            assert!(l.attempt(a).is_ok());
        }
        assert!(l.attempt(a).is_err(), "the eleventh try in flight");
        // Tries that succeed are forgiven: the address may go on.
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        for _ in 0..3 * MAX_FAILURES {
            assert!(l.attempt(b).is_ok());
            l.succeeded(b);
        }
        assert!(l.check(b).is_ok());
        // Failures of other kinds count toward the same budget.
        for _ in 0..MAX_FAILURES - 1 {
            l.failed(b);
        }
        assert!(l.attempt(b).is_ok());
        assert!(l.attempt(b).is_err());
    }
}
