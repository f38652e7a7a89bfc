//! Chunks of a whole-volume copy, as `fastsan cp` moves them: each is
//! retried while its error is retryable (a connection lost and
//! re-established meanwhile, a busy target), and a chunk that ends in a
//! partial block is padded with zeros, since a volume takes whole blocks.

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

/// Writes `data` at `offset`, padded with zeros to a whole number of blocks.
pub async fn write(vol: &Remote, offset: u64, data: Bytes) -> Result<(), Error> {
    let data = pad_to_block(data, vol.block_size());
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

/// `data`, grown with zeros to a multiple of `block_size`.
pub fn pad_to_block(data: Bytes, block_size: u32) -> Bytes {
    let bs = block_size.max(1) as usize;
    if data.len().is_multiple_of(bs) {
        return data;
    }
    let mut b = BytesMut::with_capacity(data.len().next_multiple_of(bs));
    b.extend_from_slice(&data);
    b.resize(data.len().next_multiple_of(bs), 0);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastsan_brp::Status;
    use std::cell::Cell;

    #[test]
    fn a_partial_last_block_is_padded_with_zeros() {
        let whole = Bytes::from(vec![7u8; 1024]);
        assert_eq!(pad_to_block(whole.clone(), 512).as_ptr(), whole.as_ptr(), "whole blocks are not copied");
        let tail = pad_to_block(Bytes::from(vec![7u8; 600]), 512);
        assert_eq!(tail.len(), 1024);
        assert!(tail[..600].iter().all(|&b| b == 7) && tail[600..].iter().all(|&b| b == 0));
        assert!(pad_to_block(Bytes::new(), 512).is_empty());
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
