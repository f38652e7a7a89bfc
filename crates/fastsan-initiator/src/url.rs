//! Volume URLs, in three forms:
//! - `brp://HOST:PORT/VOLUME`, where HOST is a name, an IPv4 address or a
//!   bracketed IPv6 address and PORT defaults to 10810;
//! - `brps://HOST:PORT/VOLUME`, the same over TLS (the target's certificate
//!   is verified for HOST);
//! - `brp+unix:///VOLUME?socket=PATH`, a target on a unix socket, in the
//!   shape of qemu's `nbd+unix://`: no host, and the socket's path in the
//!   one query parameter, taken as written (no percent-decoding).
//!
//! VOLUME may be empty (for listing). Written by hand: the grammar is this
//! small, and a general URL crate would bring an IDNA stack along.

use crate::Error;
use std::fmt;
use std::path::PathBuf;

pub const DEFAULT_PORT: u16 = 10810;

const TCP_SCHEME: &str = "brp://";
const TLS_SCHEME: &str = "brps://";
const UNIX_SCHEME: &str = "brp+unix://";

/// Where the target listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tls`: over TLS (`brps://`).
    Tcp {
        host: String,
        port: u16,
        tls: bool,
    },
    Unix(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrpUrl {
    pub endpoint: Endpoint,
    pub volume: String,
}

impl BrpUrl {
    pub fn parse(s: &str) -> Result<Self, Error> {
        let bad = |why: &str| {
            Error::Url(format!(
                "{s:?}: {why} (expected brp://HOST:PORT/VOLUME, brps://HOST:PORT/VOLUME or brp+unix:///VOLUME?socket=PATH)"
            ))
        };
        let tcp = s.strip_prefix(TCP_SCHEME).map(|r| (r, false));
        let (endpoint, volume) = if let Some((rest, tls)) =
            tcp.or(s.strip_prefix(TLS_SCHEME).map(|r| (r, true)))
        {
            let (authority, volume) = rest.split_once('/').unwrap_or((rest, ""));
            (parse_authority(authority, tls).map_err(bad)?, volume)
        } else if let Some(rest) = s.strip_prefix(UNIX_SCHEME) {
            let (path, query) = rest.split_once('?').ok_or_else(|| bad("missing ?socket=PATH"))?;
            let socket = query.strip_prefix("socket=").ok_or_else(|| bad("the query must be socket=PATH"))?;
            if socket.is_empty() {
                return Err(bad("empty socket path"));
            }
            let volume = match path.strip_prefix('/') {
                Some(v) => v,
                None if path.is_empty() => "",
                None => return Err(bad("a brp+unix URL names no host")),
            };
            (Endpoint::Unix(PathBuf::from(socket)), volume)
        } else {
            return Err(bad("scheme must be brp://, brps:// or brp+unix://"));
        };
        if volume.contains('/') {
            return Err(bad("volume names have no '/'"));
        }
        Ok(BrpUrl { endpoint, volume: volume.to_owned() })
    }

    /// Whether `s` is meant as a BRP URL (it has one of the schemes), so a
    /// command line can tell it from a local path before parsing it.
    pub fn has_scheme(s: &str) -> bool {
        s.starts_with(TCP_SCHEME) || s.starts_with(TLS_SCHEME) || s.starts_with(UNIX_SCHEME)
    }
}

fn parse_authority(authority: &str, tls: bool) -> Result<Endpoint, &'static str> {
    let (host, port) = if let Some(r) = authority.strip_prefix('[') {
        let (h, after) = r.split_once(']').ok_or("unclosed '['")?;
        (h, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("missing host");
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse().map_err(|_| "bad port")?,
    };
    Ok(Endpoint::Tcp { host: host.to_owned(), port, tls })
}

/// `host:port` (IPv6 in brackets), ready for connecting, or the socket's path.
impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp { host, port, .. } if host.contains(':') => write!(f, "[{host}]:{port}"),
            Endpoint::Tcp { host, port, .. } => write!(f, "{host}:{port}"),
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

impl fmt::Display for BrpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.endpoint {
            Endpoint::Tcp { tls: false, .. } => write!(f, "{TCP_SCHEME}{}/{}", self.endpoint, self.volume),
            Endpoint::Tcp { tls: true, .. } => write!(f, "{TLS_SCHEME}{}/{}", self.endpoint, self.volume),
            Endpoint::Unix(path) => write!(f, "{UNIX_SCHEME}/{}?socket={}", self.volume, path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> Endpoint {
        Endpoint::Tcp { host: host.into(), port, tls: false }
    }

    #[test]
    fn parses_hosts_ports_and_volumes() {
        let u = BrpUrl::parse("brp://127.0.0.1:9000/vol0").unwrap();
        assert_eq!((&u.endpoint, u.volume.as_str()), (&tcp("127.0.0.1", 9000), "vol0"));
        let u = BrpUrl::parse("brp://[::1]/disk").unwrap();
        assert_eq!((&u.endpoint, u.volume.as_str()), (&tcp("::1", DEFAULT_PORT), "disk"));
        assert_eq!(u.endpoint.to_string(), "[::1]:10810");
        assert_eq!(u.to_string(), "brp://[::1]:10810/disk");
        let u = BrpUrl::parse("brp://localhost:1").unwrap();
        assert_eq!(u.volume, "");
        let u = BrpUrl::parse("brps://san.example:9/v").unwrap();
        assert_eq!(u.endpoint, Endpoint::Tcp { host: "san.example".into(), port: 9, tls: true });
        assert_eq!(u.to_string(), "brps://san.example:9/v");
    }

    #[test]
    fn parses_unix_sockets() {
        let u = BrpUrl::parse("brp+unix:///vol0?socket=/run/fastsan.sock").unwrap();
        assert_eq!(u.endpoint, Endpoint::Unix("/run/fastsan.sock".into()));
        assert_eq!(u.volume, "vol0");
        assert_eq!(u.to_string(), "brp+unix:///vol0?socket=/run/fastsan.sock");
        assert_eq!(BrpUrl::parse(&u.to_string()).unwrap(), u);
        // Relative paths are as the shell gives them; the path is not decoded.
        let u = BrpUrl::parse("brp+unix:///d?socket=my%20dir/s.sock").unwrap();
        assert_eq!(u.endpoint, Endpoint::Unix("my%20dir/s.sock".into()));
        // For listing, with or without the slash.
        for s in ["brp+unix://?socket=/s", "brp+unix:///?socket=/s"] {
            let u = BrpUrl::parse(s).unwrap();
            assert_eq!((&u.endpoint, u.volume.as_str()), (&Endpoint::Unix("/s".into()), ""), "{s}");
        }
    }

    #[test]
    fn refuses_malformed_urls() {
        for bad in [
            "nbd://h/v",
            "brp://",
            "brp://:1/v",
            "brp://h:x/v",
            "brp://h:99999/v",
            "brp://[::1/v",
            "brp://h/a/b",
            "brp+unix:///v",
            "brp+unix:///v?",
            "brp+unix:///v?socket=",
            "brp+unix:///v?path=/s",
            "brp+unix://host/v?socket=/s",
            "brp+unix:///a/b?socket=/s",
            "brp+unix:/v?socket=/s",
            "unix:///v?socket=/s",
        ] {
            assert!(BrpUrl::parse(bad).is_err(), "{bad}");
        }
        let Err(Error::Url(why)) = BrpUrl::parse("brp+unix://h/v?socket=/s") else { panic!() };
        assert!(why.contains("no host") && why.contains("brp+unix:///VOLUME?socket=PATH"), "{why}");
    }

    #[test]
    fn tells_urls_from_local_paths() {
        assert!(BrpUrl::has_scheme("brp://h/v") && BrpUrl::has_scheme("brp+unix:///v?socket=/s"));
        assert!(BrpUrl::has_scheme("brps://h/v"));
        assert!(!BrpUrl::has_scheme("disk.img") && !BrpUrl::has_scheme("/tmp/brp://x"));
    }
}
