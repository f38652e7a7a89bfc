//! `fastsan ls`: list a target's volumes.

use crate::ClientArgs;

/// List the volumes of a target, with their sizes.
///
/// Examples:
///   fastsan ls brp://127.0.0.1:10810
///   fastsan ls 'brp+unix://?socket=/run/fastsan.sock'
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The target: brp://HOST[:PORT] or brp+unix://?socket=PATH
    url: String,
    #[command(flatten)]
    client: ClientArgs,
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let volumes = fastsan_initiator::list(&a.url, &a.client.options()?).await?;
    let width = volumes.iter().map(|v| v.name.len()).max().unwrap_or(4).max(4);
    println!("{:<width$}  {:>14}  {:>10}  {:>6}  FLAGS", "NAME", "BYTES", "SIZE", "BLOCK");
    for v in &volumes {
        let mut flags = Vec::new();
        if v.flags & fastsan_initiator::VOLUME_READ_ONLY != 0 {
            flags.push("read-only");
        }
        if v.flags & fastsan_initiator::VOLUME_VOLATILE != 0 {
            flags.push("volatile");
        }
        println!(
            "{:<width$}  {:>14}  {:>10}  {:>6}  {}",
            v.name,
            v.size,
            human(v.size),
            v.block_size,
            flags.join(",")
        );
    }
    Ok(())
}

/// `1.0 GiB`, `512.0 MiB`, `100 B`.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
