//! `fastsan ls`: list a target's volumes.

use crate::ClientArgs;
use anyhow::Context;
use indicatif::HumanBytes;

/// List the volumes of a target, with their sizes (or one volume, if the
/// URL names it).
///
/// Examples:
///   fastsan ls brp://127.0.0.1:10810
///   fastsan ls brp://127.0.0.1:10810/vol0
///   fastsan ls 'brp+unix://?socket=/run/fastsan.sock'
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The target: brp://HOST[:PORT][/VOLUME] (brps:// with TLS) or brp+unix://[/VOLUME]?socket=PATH
    url: String,
    #[command(flatten)]
    client: ClientArgs,
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let volumes = fastsan_initiator::list(&a.url, &a.client.options()?)
        .await
        .with_context(|| format!("listing {}", a.url))?;
    let width = volumes.iter().map(|v| v.name.len()).max().unwrap_or(4).max(4);
    outln!("{:<width$}  {:>14}  {:>10}  {:>6}  FLAGS", "NAME", "BYTES", "SIZE", "BLOCK")?;
    for v in &volumes {
        let mut flags = Vec::new();
        if v.flags & fastsan_initiator::VOLUME_READ_ONLY != 0 {
            flags.push("read-only");
        }
        if v.flags & fastsan_initiator::VOLUME_VOLATILE != 0 {
            flags.push("volatile");
        }
        outln!(
            "{:<width$}  {:>14}  {:>10}  {:>6}  {}",
            v.name,
            v.size,
            HumanBytes(v.size).to_string(),
            v.block_size,
            flags.join(",")
        )?;
    }
    Ok(())
}
