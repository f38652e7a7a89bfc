//! `fastsan mirror`: make a mirrored volume, see its legs, bring them in
//! sync. The mirror itself (fan-out, degraded legs, resync, the log) is
//! `fastsan_initiator::mirror`; a mirror's name works wherever a volume URL
//! does (`cp`, `bench`, `attach`).

use crate::ClientArgs;
use anyhow::Context;
use fastsan_initiator::mirror::{status_of, LegState, MirrorSpec, MirrorStatus};
use fastsan_initiator::Mirror;
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use std::time::{Duration, Instant};

/// Mirrored volumes: one volume kept on several targets (legs), with a
/// dirty-region log on this host.
///
/// A mirror is named, wherever a volume URL is taken, as
///   mirror:LEG1,LEG2[,LEG3...],log=PATH[,region=SIZE][,rate=SIZE][,failover=SECS]
/// where each leg is a brp://, brp+unix:// or nbd:// URL and log is the
/// dirty-region log's file on this host. See docs/mirror.md.
///
/// Examples:
///   fastsan mirror create --assume-clean mirror:brp://a:10810/v,brp://b:10810/v,log=/var/lib/fastsan/v.log
///   fastsan attach mirror:brp://a:10810/v,brp://b:10810/v,log=/var/lib/fastsan/v.log
///   fastsan mirror status mirror:brp://a:10810/v,brp://b:10810/v,log=/var/lib/fastsan/v.log
///   fastsan mirror replace --leg 1 mirror:brp://a:10810/v,brp://b:10810/v,log=/var/lib/fastsan/v.log
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// Make a new mirror: its log on this host and a record on every leg,
    /// then copy the first leg to the others (a full sync), unless
    /// --assume-clean.
    Create {
        /// mirror:LEG,LEG[,...],log=PATH[,region=SIZE]
        spec: String,
        /// The legs are identical already (fresh, zeroed volumes): no full sync.
        #[arg(long)]
        assume_clean: bool,
        /// Make a new mirror of legs that carry another mirror's record
        /// (their data is overwritten by the full sync).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show the legs (in sync, resyncing, degraded), the dirty regions and a
    /// resync's progress, from the process that has the mirror open or
    /// else from the log.
    Status {
        /// mirror:LEG,LEG[,...],log=PATH
        spec: String,
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
        /// Refresh every second until every leg is in sync.
        #[arg(long)]
        watch: bool,
    },
    /// Take back a leg whose volume was replaced or emptied (a memory target
    /// restarted, a new disk): it is copied whole from an in-sync leg.
    Replace {
        /// mirror:LEG,LEG[,...],log=PATH
        spec: String,
        /// The leg's index in the spec (0 is the first).
        #[arg(long, value_name = "N")]
        leg: usize,
        /// Also take a leg that carries a record (its data is overwritten).
        #[arg(long)]
        force: bool,
        /// Give up when a leg stays unreachable this many seconds.
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        timeout: f64,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Open the mirror and copy to every leg the regions it misses, until
    /// all legs are in sync (the mirror must not be open elsewhere).
    Resync {
        /// mirror:LEG,LEG[,...],log=PATH[,rate=SIZE]
        spec: String,
        /// Give up when a leg stays unreachable this many seconds.
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        timeout: f64,
        #[command(flatten)]
        client: ClientArgs,
    },
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    match a.cmd {
        Cmd::Create { spec, assume_clean, force, client } => {
            let m = Mirror::create(&spec, client.options()?, assume_clean, force)
                .await
                .with_context(|| format!("cannot make {spec}"))?;
            let s = m.status();
            outln!(
                "fastsan: mirror of {} legs made: {} in regions of {}",
                s.legs.len(),
                HumanBytes(s.size),
                HumanBytes(s.region)
            )?;
            wait_in_sync(&m, Duration::from_secs(30)).await
        }
        Cmd::Replace { spec, leg, force, timeout, client } => {
            anyhow::ensure!(timeout.is_finite() && timeout > 0.0, "--timeout must be more than 0");
            let m = Mirror::replace(&spec, client.options()?, leg, force)
                .await
                .with_context(|| format!("cannot replace leg {leg} of {spec}"))?;
            wait_in_sync(&m, Duration::from_secs_f64(timeout)).await
        }
        Cmd::Resync { spec, timeout, client } => {
            anyhow::ensure!(timeout.is_finite() && timeout > 0.0, "--timeout must be more than 0");
            let m = Mirror::open(&spec, client.options()?)
                .await
                .with_context(|| format!("cannot open {spec}"))?;
            wait_in_sync(&m, Duration::from_secs_f64(timeout)).await
        }
        Cmd::Status { spec, json, watch } => {
            let ms = MirrorSpec::parse(&spec)?;
            loop {
                let s = status_of(&ms)?;
                if json {
                    outln!("{}", serde_json::to_string_pretty(&s)?)?;
                } else {
                    out!("{}", render(&s))?;
                }
                if !watch || s.legs.iter().all(|l| l.state == LegState::InSync) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                outln!()?;
            }
        }
    }
}

/// Shows the resync's progress until every leg is in sync; fails when a
/// leg stays degraded for `timeout`.
async fn wait_in_sync(m: &Mirror, timeout: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let pb = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} regions, eta {eta}")
            .expect("valid template"),
    );
    let mut away_since: Option<Instant> = None;
    loop {
        let s = m.status();
        if s.legs.iter().all(|l| l.state == LegState::InSync) {
            pb.finish_and_clear();
            outln!(
                "fastsan: every leg in sync; {} regions ({}) copied in {:.1} s",
                s.resynced_regions,
                HumanBytes(s.resynced_bytes),
                started.elapsed().as_secs_f64()
            )?;
            // Nothing left dirty that every leg holds.
            m.close().await?;
            return Ok(());
        }
        let (total, copied, rate) = s
            .legs
            .iter()
            .filter_map(|l| l.resync)
            .fold((0, 0, 0.0), |a, p| (a.0 + p.total, a.1 + p.copied, a.2 + p.rate));
        pb.set_length(total.max(copied));
        pb.set_position(copied);
        pb.set_message(format!("resync {}/s", HumanBytes(rate as u64)));
        match s.legs.iter().position(|l| l.state == LegState::Degraded) {
            Some(i) => {
                if away_since.get_or_insert_with(Instant::now).elapsed() >= timeout {
                    pb.finish_and_clear();
                    anyhow::bail!(
                        "leg {i} ({}) stayed away for {:.0} s: {}",
                        s.legs[i].url,
                        timeout.as_secs_f64(),
                        s.legs[i].why.clone().unwrap_or_default()
                    );
                }
            }
            None => away_since = None,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn render(s: &MirrorStatus) -> String {
    let mut out = format!(
        "mirror: {} in regions of {}, generation {}, {} dirty region(s){}\n",
        HumanBytes(s.size),
        HumanBytes(s.region),
        s.generation,
        s.dirty,
        if s.open { format!(", open by pid {}", s.pid) } else { ", not open (from the log)".into() }
    );
    for (i, l) in s.legs.iter().enumerate() {
        let state = match l.state {
            LegState::InSync => "in sync",
            LegState::Resyncing => "resyncing",
            LegState::Degraded => "degraded",
        };
        out += &format!("  leg {i} {:<10} gen {:<4} {}", state, l.generation, l.url);
        if l.needs > 0 {
            out += &format!("  ({} region(s) to copy)", l.needs);
        }
        if s.open {
            out += &format!("  in flight {} reads {}", l.in_flight, l.reads);
        }
        out += "\n";
        if let (LegState::Resyncing, Some(p)) = (l.state, l.resync) {
            let done = if p.total == 0 { 1.0 } else { p.copied as f64 / p.total as f64 };
            let bar = (done * 30.0).round() as usize;
            out += &format!(
                "        [{}{}] {:.0}% {}/{} regions, {}/s\n",
                "#".repeat(bar),
                "-".repeat(30 - bar.min(30)),
                done * 100.0,
                p.copied,
                p.total,
                HumanBytes(p.rate as u64)
            );
        }
        if let Some(why) = &l.why {
            out += &format!("        {why}\n");
        }
    }
    if s.open || s.writes + s.reads > 0 {
        out += if s.open { "  " } else { "  last run: " };
        out += &format!(
            "resynced {} region(s) ({}), legs degraded {} time(s), log updates {} (hot writes {})\n",
            s.resynced_regions,
            HumanBytes(s.resynced_bytes),
            s.degraded_events,
            s.log_updates,
            s.log_hot
        );
    }
    out
}
