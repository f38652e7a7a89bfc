//! The name of a mirrored volume, taken wherever a volume URL is:
//!
//! ```text
//! mirror:URL1,URL2[,URL3...],log=PATH[,region=SIZE][,rate=SIZE][,failover=SECS][,tracking=naive]
//! ```
//!
//! Each leg is a `brp://`, `brp+unix://` or `nbd://` URL; `log` is the
//! dirty-region log's file on this host (made by `fastsan mirror create`);
//! `region` is the region size for `create` (default 1M); `rate` bounds a
//! resync's copy in bytes per second (default 256M; 0 for no bound);
//! `failover` is how long a leg may stay unreachable before it is marked
//! degraded and I/O goes on without it (default 5 s); `tracking=naive`
//! turns the dirty-region log's optimizations off, for measuring them
//! (benchmarks only: it clears a region as soon as its write is done,
//! before any flush of the legs, so a leg's host crashing could lose
//! writes the log no longer marks).
//! Sizes take K, M, G.

use crate::Error;
use std::path::PathBuf;
use std::time::Duration;

pub const SCHEME: &str = "mirror:";

#[derive(Debug, Clone, PartialEq)]
pub struct MirrorSpec {
    pub legs: Vec<String>,
    pub log: PathBuf,
    pub region: u64,
    /// Bytes per second a resync may copy; 0 for no bound.
    pub rate: u64,
    pub failover: Duration,
    /// The dirty-region log without its optimizations (benchmarks only).
    pub naive: bool,
}

impl MirrorSpec {
    pub fn is_mirror(s: &str) -> bool {
        s.starts_with(SCHEME)
    }

    pub fn parse(s: &str) -> Result<MirrorSpec, Error> {
        let bad = |why: String| Error::InvalidArgument(format!("{s}: {why}"));
        let body = s.strip_prefix(SCHEME).ok_or_else(|| bad(format!("does not start with {SCHEME}")))?;
        let mut spec = MirrorSpec {
            legs: Vec::new(),
            log: PathBuf::new(),
            region: 1 << 20,
            rate: 256 << 20,
            failover: Duration::from_secs(5),
            naive: false,
        };
        for item in body.split(',') {
            if item.contains("://") {
                if !(item.starts_with("brp://")
                    || item.starts_with("brp+unix://")
                    || item.starts_with("nbd://"))
                {
                    return Err(bad(format!("a leg is brp://, brp+unix:// or nbd://, not {item}")));
                }
                spec.legs.push(item.to_string());
                continue;
            }
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| bad(format!("expected a leg URL or KEY=VALUE, not {item:?}")))?;
            match k {
                "log" if !v.is_empty() => spec.log = PathBuf::from(v),
                "region" => spec.region = size(v).ok_or_else(|| bad(format!("bad region size {v:?}")))?,
                "rate" => spec.rate = size(v).ok_or_else(|| bad(format!("bad rate {v:?}")))?,
                "failover" => {
                    spec.failover = v
                        .parse::<f64>()
                        .ok()
                        .filter(|f| f.is_finite() && *f > 0.0 && *f < 86400.0)
                        .map(Duration::from_secs_f64)
                        .ok_or_else(|| bad(format!("bad failover seconds {v:?}")))?
                }
                "tracking" if v == "naive" || v == "optimized" => spec.naive = v == "naive",
                _ => {
                    return Err(bad(format!(
                        "unknown or empty option {item:?} (log, region, rate, failover, tracking=optimized|naive)"
                    )))
                }
            }
        }
        if spec.legs.len() < 2 || spec.legs.len() > super::dirty_log::MAX_LEGS {
            return Err(bad(format!(
                "a mirror has 2 to {} legs, not {}",
                super::dirty_log::MAX_LEGS,
                spec.legs.len()
            )));
        }
        if spec.log.as_os_str().is_empty() {
            return Err(bad("log=PATH (the dirty-region log on this host) is required".into()));
        }
        if !spec.region.is_power_of_two() || spec.region < 4096 {
            return Err(bad(format!(
                "the region size must be a power of two of at least 4K, not {}",
                spec.region
            )));
        }
        Ok(spec)
    }
}

/// `4096`, `64K`, `1M`, `2G` (binary multiples).
fn size(v: &str) -> Option<u64> {
    let v = v.trim_end_matches(['B', 'b']).trim_end_matches('i');
    let (num, mult) = match v.char_indices().last()? {
        (i, 'k' | 'K') => (&v[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&v[..i], 1 << 20),
        (i, 'g' | 'G') => (&v[..i], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_legs_and_options() {
        let s = MirrorSpec::parse(
            "mirror:brp://a:1/v,nbd://b:2/e,brp+unix:///v?socket=/s,log=/l,region=64K,rate=0,failover=1.5",
        )
        .unwrap();
        assert_eq!(s.legs, ["brp://a:1/v", "nbd://b:2/e", "brp+unix:///v?socket=/s"]);
        assert_eq!((s.log.to_str().unwrap(), s.region, s.rate), ("/l", 65536, 0));
        assert_eq!(s.failover, Duration::from_millis(1500));
        assert!(!s.naive);
        assert!(MirrorSpec::parse("mirror:brp://a:1/v,brp://b:1/v,log=/l,tracking=naive").unwrap().naive);
    }

    #[test]
    fn refuses_what_it_cannot_use() {
        for (spec, why) in [
            ("mirror:brp://a:1/v,log=/l", "2 to"),
            ("mirror:brp://a:1/v,brp://b:1/v", "log=PATH"),
            ("mirror:brp://a:1/v,http://b/v,log=/l", "a leg is"),
            ("mirror:brp://a:1/v,brp://b:1/v,log=/l,region=3000", "power of two"),
            ("mirror:brp://a:1/v,brp://b:1/v,log=/l,speed=1", "unknown"),
            ("mirror:brp://a:1/v,brp://b:1/v,log=/l,failover=-1", "failover"),
            ("mirror:brp://a:1/v,brp://b:1/v,log=/l,rate=99999999999G", "rate"),
        ] {
            let e = MirrorSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(why), "{spec}: {e}");
        }
    }
}
