//! The initiator's own metrics, for a process that keeps a volume open
//! (`fastsan attach --metrics ADDR`): per session, its connections, the
//! requests it sent, how it merged them, and what the target's losses cost
//! (reconnects, retries, timeouts). A prometheus-client [`Collector`] that
//! reads the session's counters at scrape time.

use crate::remote::Single;
use crate::{InitiatorStats, Remote};

/// A label value as the text format wants it: `\`, `"` and newlines escaped
/// (prometheus-client writes values as they are; a volume name may hold a quote).
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Reads an open volume's session counters for Prometheus.
#[derive(Clone)]
pub struct SessionCollector {
    pub volume: Remote,
    /// The `volume` label: the URL it was opened with.
    pub url: String,
}

impl std::fmt::Debug for SessionCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionCollector").field("url", &self.url).finish()
    }
}

impl Collector for SessionCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (up, all) = self.volume.connections();
        let url = escape(&self.url);
        let labels = [("volume", url.as_str())];
        let s: InitiatorStats = self.volume.stats();
        let counters: [(&str, &str, u64); 7] = [
            ("fastsan_initiator_requests", "Requests sent (a BATCH's each count)", s.requests),
            ("fastsan_initiator_frames", "Frames written (a BATCH counts once)", s.frames),
            ("fastsan_initiator_batches", "BATCH frames sent", s.batches),
            ("fastsan_initiator_batched_requests", "Requests sent inside BATCH frames", s.batched_requests),
            ("fastsan_initiator_reconnects", "Connections re-established after a loss", s.reconnects),
            ("fastsan_initiator_retries", "Requests sent again after their connection was lost", s.retries),
            (
                "fastsan_initiator_timeouts",
                "Connections taken for lost: a request got no reply in time",
                s.timeouts,
            ),
        ];
        // Only a BRP session keeps these (an NBD or mirrored volume reports its connections alone).
        let counters = if matches!(self.volume, Remote::One(Single::Brp(_))) { &counters[..] } else { &[] };
        for &(name, help, v) in counters {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
        }
        for (name, help, v) in [
            ("fastsan_initiator_connections_up", "Connections of the session up now (a mirror: legs)", up),
            ("fastsan_initiator_connections", "Connections of the session (a mirror: legs)", all),
        ] {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(v as i64).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The Prometheus text of `collector` now (the target's collector too).
pub fn render<C: Collector + Clone>(collector: &C) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector.clone()));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String cannot fail");
    out
}
