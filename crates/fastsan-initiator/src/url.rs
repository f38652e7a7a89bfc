//! Volume URLs: `brp://HOST:PORT/VOLUME`, where HOST is a name, an IPv4
//! address or a bracketed IPv6 address, PORT defaults to 10810 and VOLUME
//! may be empty (for listing). Written by hand: the grammar is this small, and
//! a general URL crate would bring an IDNA stack along.

use crate::Error;
use std::fmt;

pub const DEFAULT_PORT: u16 = 10810;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrpUrl {
    pub host: String,
    pub port: u16,
    pub volume: String,
}

impl BrpUrl {
    pub fn parse(s: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::Url(format!("{s:?}: {why} (expected brp://HOST:PORT/VOLUME)"));
        let rest = s.strip_prefix("brp://").ok_or_else(|| bad("scheme must be brp://"))?;
        let (authority, volume) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = if let Some(r) = authority.strip_prefix('[') {
            let (h, after) = r.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
            (h, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(p) => p.parse().map_err(|_| bad("bad port"))?,
        };
        if volume.contains('/') {
            return Err(bad("volume names have no '/'"));
        }
        Ok(BrpUrl { host: host.to_owned(), port, volume: volume.to_owned() })
    }

    /// `host:port` for connecting.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for BrpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "brp://{}/{}", self.authority(), self.volume)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_ports_and_volumes() {
        let u = BrpUrl::parse("brp://127.0.0.1:9000/vol0").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.volume.as_str()), ("127.0.0.1", 9000, "vol0"));
        let u = BrpUrl::parse("brp://[::1]/disk").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.volume.as_str()), ("::1", DEFAULT_PORT, "disk"));
        assert_eq!(u.authority(), "[::1]:10810");
        let u = BrpUrl::parse("brp://localhost:1").unwrap();
        assert_eq!(u.volume, "");
        for bad in [
            "nbd://h/v",
            "brp://",
            "brp://:1/v",
            "brp://h:x/v",
            "brp://h:99999/v",
            "brp://[::1/v",
            "brp://h/a/b",
        ] {
            assert!(BrpUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
