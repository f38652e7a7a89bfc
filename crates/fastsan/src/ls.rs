//! `fastsan ls`: list a target's volumes.

use crate::AccessArgs;
use anyhow::Context;
use indicatif::HumanBytes;

/// List the volumes of a target, with their sizes (or one volume, if the
/// URL names it); the exports of any NBD server too.
///
/// Examples:
///   fastsan ls brp://127.0.0.1:10810
///   fastsan ls brp://127.0.0.1:10810/vol0
///   fastsan ls 'brp+unix://?socket=/run/fastsan.sock'
///   fastsan ls nbd://127.0.0.1:10809
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The target: brp://HOST[:PORT][/VOLUME] (brps:// with TLS),
    /// brp+unix://[/VOLUME]?socket=PATH or nbd://HOST[:PORT][/EXPORT]
    url: String,
    #[command(flatten)]
    access: AccessArgs,
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let opts = a.access.options()?;
    let volumes = if a.url.starts_with("nbd://") {
        fastsan_initiator::nbd::list(&a.url, &opts).await
    } else {
        fastsan_initiator::list(&a.url, &opts).await
    };
    let volumes = volumes.with_context(|| format!("listing {}", a.url))?;
    // A name is the server's to choose: its control characters are shown
    // escaped, never sent to the terminal.
    let shown = |name: &str| -> String {
        name.chars()
            .flat_map(|c| if c.is_control() { c.escape_default().collect() } else { vec![c] })
            .collect()
    };
    let width = volumes.iter().map(|v| shown(&v.name).chars().count()).max().unwrap_or(4).max(4);
    outln!("{:<width$}  {:>14}  {:>10}  {:>6}  FLAGS", "NAME", "BYTES", "SIZE", "BLOCK")?;
    for v in &volumes {
        let mut flags = Vec::new();
        if v.flags & fastsan_initiator::VOLUME_READ_ONLY != 0 {
            flags.push("read-only");
        }
        if v.flags & fastsan_initiator::VOLUME_VOLATILE != 0 {
            flags.push("volatile");
        }
        if v.flags & fastsan_initiator::VOLUME_FAILED != 0 {
            flags.push("FAILED (a flush failed: every request fails until the target restarts)");
        }
        if v.flags & fastsan_initiator::VOLUME_UNREADABLE != 0 {
            flags.push("unreadable (the server would not describe it: see the warning above)");
        }
        outln!(
            "{:<width$}  {:>14}  {:>10}  {:>6}  {}",
            shown(&v.name),
            v.size,
            HumanBytes(v.size).to_string(),
            v.block_size,
            flags.join(",")
        )?;
    }
    Ok(())
}
