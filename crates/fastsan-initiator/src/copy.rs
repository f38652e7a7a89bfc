//! Chunks of a whole-volume copy, as `fastsan cp` moves them: each is
//! retried while its error is retryable (a connection lost and
//! re-established meanwhile, a busy target), and a chunk that ends inside a
//! block (a source whose size is not a multiple of the volume's block)
//! keeps the rest of that block as it was: a volume takes whole blocks.

use crate::{Error, Remote};
use bytes::{Bytes, BytesMut};
use std::future::Future;
use std::time::Duration;

/// Most tries of one chunk.
pub const TRIES: u32 = 5;

/// Reads `len` bytes at `offset`.
pub async fn read(vol: &Remote, offset: u64, len: u64) -> Result<Bytes, Error> {
    retry(|| vol.read(offset, len)).await
}

/// Writes `data` at `offset` (a block boundary). When it ends inside a
/// block, that block is read and `data`'s tail laid over it, so the bytes
/// of the block past the data stay what they were (padding them with zeros
/// wiped what followed a short source: a 446-byte boot loader copied onto
/// a disk took its partition table with it).
pub async fn write(vol: &Remote, offset: u64, data: Bytes) -> Result<(), Error> {
    let bs = u64::from(vol.block_size().max(1));
    let whole = data.len() as u64 / bs * bs;
    let data = if whole == data.len() as u64 {
        data
    } else {
        let block = read(vol, offset + whole, bs).await?;
        overlay_tail(data, &block)
    };
    retry(|| vol.write_bytes(data.clone(), offset, false)).await
}

/// Makes every chunk written durable.
pub async fn finish(vol: &Remote) -> Result<(), Error> {
    retry(|| vol.close()).await
}

/// Runs `op` until it succeeds, fails with an error that is not retryable,
/// or has failed [`TRIES`] times; waits 200 ms, then 400, 800 and 1600
/// between tries.
pub async fn retry<T, F, Fut>(mut op: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut tries = 1;
    loop {
        match op().await {
            Err(e) if e.is_retryable() && tries < TRIES => {
                tracing::warn!(error = &e as &dyn std::error::Error, tries, "retrying");
                tokio::time::sleep(Duration::from_millis(100 << tries)).await;
                tries += 1;
            }
            r => return r,
        }
    }
}

/// `data` whose last block is partial, completed with the rest of that
/// block as it is now (`block`, one whole block).
fn overlay_tail(data: Bytes, block: &[u8]) -> Bytes {
    let whole = data.len() / block.len() * block.len();
    let mut b = BytesMut::with_capacity(whole + block.len());
    b.extend_from_slice(&data);
    b.extend_from_slice(&block[data.len() - whole..]);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastsan_brp::Status;
    use std::cell::Cell;

    #[test]
    fn a_partial_last_block_keeps_the_rest_of_the_block() {
        let block = [9u8; 512];
        let tail = overlay_tail(Bytes::from(vec![7u8; 600]), &block);
        assert_eq!(tail.len(), 1024);
        assert!(tail[..600].iter().all(|&b| b == 7) && tail[600..].iter().all(|&b| b == 9));
        let short = overlay_tail(Bytes::from(vec![7u8; 100]), &block);
        assert_eq!(short.len(), 512);
        assert!(short[..100].iter().all(|&b| b == 7) && short[100..].iter().all(|&b| b == 9));
    }

    #[tokio::test(start_paused = true)]
    async fn retryable_errors_are_retried_until_success() {
        let calls = Cell::new(0);
        let r = retry(|| async {
            calls.set(calls.get() + 1);
            if calls.get() < 3 {
                Err(Error::ConnectionLost)
            } else {
                Ok(7)
            }
        })
        .await;
        assert_eq!((r.unwrap(), calls.get()), (7, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn other_errors_stop_at_once_and_retries_give_up() {
        let calls = Cell::new(0);
        let r: Result<(), _> = retry(|| async {
            calls.set(calls.get() + 1);
            Err(Error::Status(Status::READ_ONLY))
        })
        .await;
        assert!(matches!(r, Err(Error::Status(Status::READ_ONLY))) && calls.get() == 1);
        calls.set(0);
        let started = tokio::time::Instant::now();
        let r: Result<(), _> = retry(|| async {
            calls.set(calls.get() + 1);
            Err(Error::ConnectionLost)
        })
        .await;
        assert!(matches!(r, Err(Error::ConnectionLost)) && calls.get() == TRIES);
        assert_eq!(started.elapsed(), Duration::from_millis(200 + 400 + 800 + 1600));
    }
}
