//! A target that stops answering (SIGSTOP, a hung host) must not hang its
//! callers: the handshake has a timeout at every step, a request without a
//! reply drops its connection after the request timeout, and the caller gets
//! an error once no connection comes back within the reconnect timeout.

use fastsan_brp::handshake::{parse_message, Message, OpenInfo, AUTH_NONE};
use fastsan_initiator::{Error, Options, Volume};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Answers the handshake of every connection when `answer_open`, then reads
/// requests and never replies; otherwise goes silent after HELLO_REPLY.
async fn silent_target(answer_open: bool) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s, answer_open));
        }
    });
    addr
}

async fn serve(mut s: TcpStream, answer_open: bool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut answered = 0;
    loop {
        while let Ok(Some((m, n))) = parse_message(&buf) {
            buf.drain(..n);
            let reply = match m {
                Message::Hello { .. } => Message::HelloReply {
                    version: fastsan_brp::VERSION,
                    auth: AUTH_NONE,
                    features: 0,
                    challenge: [0; 32],
                },
                Message::Open { .. } if answer_open => Message::OpenReply(OpenInfo {
                    session: 9,
                    size: 1 << 20,
                    block_size: 512,
                    max_transfer: 1 << 16,
                    queue_depth: 8,
                    max_batch: 8,
                    flags: 0,
                    instance: 1,
                    generation: 1,
                    boot: 1,
                }),
                _ => continue, // silent
            };
            s.write_all(&reply.to_vec()).await.unwrap();
            answered += 1;
            if answered == 2 {
                // Transmission: swallow requests forever.
                loop {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_reply_fails_in_time_instead_of_hanging() {
    let addr = silent_target(true).await;
    let opts = Options {
        connections: 2,
        request_timeout: Duration::from_millis(400),
        reconnect_timeout: Duration::from_secs(1),
        connect_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let vol = Volume::connect(&format!("brp://{addr}/v"), opts).await.unwrap();
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), vol.read(0, 4096)).await.expect("no hang");
    let e = r.expect_err("no reply ever comes");
    assert!(e.is_retryable(), "{e}");
    assert!(t.elapsed() >= Duration::from_millis(400), "not before the request timeout");
    let st = vol.stats();
    assert!(st.timeouts >= 1, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_silent_in_the_handshake_is_a_timeout() {
    let addr = silent_target(false).await;
    let opts = Options { connect_timeout: Duration::from_millis(300), ..Default::default() };
    let t = Instant::now();
    let e =
        fastsan_initiator::list(&format!("brp://{addr}/v"), &opts).await.expect_err("LIST is never answered");
    assert!(matches!(e, Error::Timeout("LIST")), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(3));
    let e = Volume::connect(&format!("brp://{addr}/v"), opts).await.err().expect("OPEN is never answered");
    assert!(matches!(e, Error::Timeout(_)), "{e:?}");
}
