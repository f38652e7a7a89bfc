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
/// requests and never replies (or, with `hang_up`, closes the connection at
/// the first); otherwise goes silent after HELLO_REPLY.
async fn silent_target(answer_open: bool) -> std::net::SocketAddr {
    target(answer_open, false).await
}

async fn target(answer_open: bool, hang_up: bool) -> std::net::SocketAddr {
    target_with(move |_| answer_open.then(info), hang_up).await
}

/// What the fake target's OPEN_REPLY says (unless a test changes it).
fn info() -> OpenInfo {
    OpenInfo {
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
    }
}

/// [`target`] answering the OPEN of its `n`-th connection (from 0) with
/// `open(n)`, or not at all.
async fn target_with(
    open: impl Fn(usize) -> Option<OpenInfo> + Send + Sync + 'static,
    hang_up: bool,
) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s, open(n), hang_up));
            n += 1;
        }
    });
    addr
}

async fn serve(mut s: TcpStream, open: Option<OpenInfo>, hang_up: bool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut answered = 0;
    loop {
        while let Ok(Some((m, n))) = parse_message(&buf) {
            buf.drain(..n);
            let reply = match (m, open) {
                (Message::Hello { .. }, _) => Message::HelloReply {
                    version: fastsan_brp::VERSION,
                    auth: AUTH_NONE,
                    features: 0,
                    challenge: [0; 32],
                },
                (Message::Open { .. }, Some(info)) => Message::OpenReply(info),
                _ => continue, // silent
            };
            s.write_all(&reply.to_vec()).await.unwrap();
            answered += 1;
            if answered == 2 {
                // Transmission: swallow requests forever.
                loop {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) if hang_up => return,
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
    // The error says why: the cause of the lost connection, and that none came back.
    assert_eq!(
        e.to_string(),
        "connection lost: no reply within the request timeout (400ms); \
         no connection came back within the reconnect timeout (1s)"
    );
}

/// Without reconnection a request fails as its connection goes, and says
/// how it went: a timeout, or the target closing the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_reconnection_a_lost_request_says_why() {
    for (hang_up, why) in
        [(false, "no reply within the request timeout (300ms)"), (true, "the target closed it")]
    {
        let addr = target(true, hang_up).await;
        let opts = Options {
            connections: 1,
            request_timeout: Duration::from_millis(300),
            reconnect_timeout: Duration::ZERO,
            ..Default::default()
        };
        let vol = Volume::connect(&format!("brp://{addr}/v"), opts).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), vol.write_at(&[1; 512], 0, false));
        let e = r.await.expect("no hang").expect_err("never answered");
        assert_eq!(e.to_string(), format!("connection lost: {why} (reconnection is off)"));
        // Still a retryable error (a caller may try again; a mirror's leg is not fresh).
        assert!(e.is_retryable());
    }
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

/// A connection lost, the reconnect is answered in another session (a
/// target that keeps none), or with a lower transfer limit: such a target
/// fenced nothing of the session's lost writes, or would refuse its
/// requests. The session ends with an error that says which, instead of
/// sending its writes again into another session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_into_another_session_or_smaller_limits_ends_the_session() {
    for (changed, says) in [
        (OpenInfo { session: 10, ..info() }, "in session"),
        (OpenInfo { max_transfer: 1 << 12, ..info() }, "transfer limit fell"),
    ] {
        let addr = target_with(move |n| Some(if n == 0 { info() } else { changed }), true).await;
        let opts = Options {
            connections: 1,
            reconnect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let vol = Volume::connect(&format!("brp://{addr}/v"), opts).await.unwrap();
        let t = Instant::now();
        match vol.write_at(&[1; 512], 0, false).await {
            Err(Error::SessionEnded(why)) => assert!(why.contains(says), "{why}"),
            other => panic!("expected the session to end ({says}), got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(4), "ended at once, not at the reconnect timeout");
    }
}
