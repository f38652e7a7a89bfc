//! A gateway (`fastsan serve --volume g=brp://REMOTE/v`) killed while the
//! remote target still runs a write it sent: the gateway started again on
//! the same address takes over its predecessor's session on the remote, so
//! the remote's fence holds its start until that write has landed, and
//! nothing the dead gateway sent can land over what the new one
//! acknowledges. (With a new session each start, the old write landed last.)

mod common;

use common::Served;
use fastsan_initiator::{Options, Volume};
use fastsan_target::backend::{Effect, FaultOps, FaultRule};
use fastsan_target::config::{ServerConfig, VolumeSpec};
use fastsan_target::Server;
use std::time::{Duration, Instant};

const BLOCK: usize = 4096;

#[test]
fn a_restarted_gateway_lets_its_predecessors_writes_land_before_it_serves() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // The remote target, in this process so that its faults can be steered.
    let config = ServerConfig {
        brp: "127.0.0.1:0".parse().unwrap(),
        nbd: None,
        volumes: vec![VolumeSpec::parse("v=memory:16M,faults=none").unwrap()],
        // A handshake (an OPEN held by the fence too) is cut after 3 s.
        handshake_timeout: Duration::from_secs(3),
        ..Default::default()
    };
    let server = rt.block_on(Server::bind(config)).expect("the remote target binds");
    let (remote, handle) = (server.local_addr(), server.handle());
    rt.spawn(server.run());
    let gateway =
        |addr: &str| Served::start(&["--brp", addr, "--no-nbd", "--volume", &format!("g=brp://{remote}/v")]);
    let g1 = gateway("127.0.0.1:0");
    let addr = g1.addr.clone();

    // The first write to block 0 takes 8 s on the remote's device: longer
    // than the remote lets a handshake wait (3 s here; the gateway's own
    // connect timeout is 10 s, and CI met either first), so the new
    // gateway's takeover is tried again (its start failed before).
    let delay = Duration::from_secs(8);
    handle
        .faults("v")
        .unwrap()
        .add(FaultRule::new(FaultOps::WRITE, Effect::Delay(delay)).range(0..BLOCK as u64).times(1));
    let old = vec![0xAA; BLOCK];
    let client = rt.block_on(async {
        // No retries: this client's write dies with its gateway.
        let opts = Options { reconnect_timeout: Duration::ZERO, ..Default::default() };
        Volume::connect(&format!("brp://{addr}/g"), opts).await.expect("connects to the gateway")
    });
    let write = {
        let (client, old) = (client.clone(), old.clone());
        rt.spawn(async move { client.write_at(&old, 0, false).await })
    };
    std::thread::sleep(Duration::from_millis(500));
    let sent = Instant::now();
    assert!(!write.is_finished(), "the write waits on the remote's device");
    drop(g1); // kill -9

    // The same gateway again, at once: its start waits for that write.
    let g2 = gateway(&addr);
    assert!(
        sent.elapsed() >= delay - Duration::from_millis(600),
        "started {:?} after the kill",
        sent.elapsed()
    );
    let new = vec![0x55; BLOCK];
    rt.block_on(async {
        let v = Volume::connect(&g2.url("g"), Options::default()).await.expect("connects to the new gateway");
        v.write_at(&new, 0, false).await.expect("the new gateway acknowledges");
        v.flush().await.unwrap();
        // Past the old write's delay: the remote holds the new bytes.
        tokio::time::sleep(delay.saturating_sub(sent.elapsed()) + Duration::from_millis(500)).await;
        let direct = Volume::connect(&format!("brp://{remote}/v"), Options::default()).await.unwrap();
        assert!(
            direct.read(0, BLOCK as u64).await.unwrap()[..] == new[..],
            "the dead gateway's write landed last"
        );
    });
    assert!(rt.block_on(write).unwrap().is_err(), "the dead gateway never acknowledged its write");
    let (status, log) = g2.signal("TERM");
    assert!(status.success(), "{log}");
    handle.shutdown();
}
