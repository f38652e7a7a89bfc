//! A target as a gateway: `--volume g=brp://other/v` re-exports another
//! target's volume (the remote store, through the initiator). Bytes written
//! through the gateway are the remote volume's; the gateway rides out a
//! restart of the remote target; a missing remote volume is a clear error.

mod common;

use common::{pattern, temp_file, TestServer};
use fastsan_initiator::{Options, Volume};
use fastsan_target::config::{ServerConfig, VolumeSpec};
use fastsan_target::Server;
use std::time::Duration;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_serves_the_remote_volume_through_a_remote_restart() {
    let (_dir, img) = temp_file("gateway", 16 * MIB);
    let spec = format!("v=file:{}", img.display());
    let remote = TestServer::start(&[&spec], |_| {}).await;
    let remote_addr = remote.addr;
    let gw_spec = format!("g=brp://{remote_addr}/v");
    let gw = TestServer::start(&[&gw_spec], |_| {}).await;

    let through = Volume::connect(&gw.url("g"), Options::default()).await.unwrap();
    assert_eq!(through.size(), 16 * MIB);
    for i in 0..16u64 {
        through.write_at(&pattern(1, i * MIB, 65536), i * MIB, i % 4 == 0).await.unwrap();
    }
    through.flush().await.unwrap();
    through.write_zeroes(MIB, 65536, false).await.unwrap();
    // What the gateway acknowledged is on the remote volume.
    let direct = Volume::connect(&remote.url("v"), Options::default()).await.unwrap();
    for i in 0..16u64 {
        let want = if i == 1 { vec![0; 65536] } else { pattern(1, i * MIB, 65536) };
        assert!(direct.read(i * MIB, 65536).await.unwrap()[..] == want[..], "block {i} via the remote");
        assert!(through.read(i * MIB, 65536).await.unwrap()[..] == want[..], "block {i} via the gateway");
    }
    drop(direct);

    // The remote target goes away; a write through the gateway waits for it.
    remote.stop().await;
    let w = {
        let through = through.clone();
        tokio::spawn(async move { through.write_at(&pattern(2, 3 * MIB, 65536), 3 * MIB, true).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!w.is_finished(), "the write waits for the remote target");
    let remote = TestServer::start(&[&spec], |c| c.brp = remote_addr).await;
    tokio::time::timeout(Duration::from_secs(30), w)
        .await
        .unwrap()
        .unwrap()
        .expect("the write lands after the restart");
    let direct = Volume::connect(&remote.url("v"), Options::default()).await.unwrap();
    assert!(direct.read(3 * MIB, 65536).await.unwrap()[..] == pattern(2, 3 * MIB, 65536)[..]);
    gw.stop().await;
    remote.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_to_a_missing_volume_does_not_start() {
    let remote = TestServer::start(&["v=memory:1M"], |_| {}).await;
    for (spec, want) in [
        (format!("g=brp://{}/nope", remote.addr), "no such volume"),
        ("g=brp://127.0.0.1:1/v".to_string(), "cannot connect"),
        (format!("g=brp://{}/v,connections=0", remote.addr), "connections must be"),
    ] {
        let parsed = VolumeSpec::parse(&spec);
        let err = match parsed {
            Err(e) => e.to_string(),
            Ok(v) => {
                let c = ServerConfig {
                    brp: "127.0.0.1:0".parse().unwrap(),
                    nbd: None,
                    volumes: vec![v],
                    ..Default::default()
                };
                match Server::bind(c).await {
                    Err(e) => {
                        let mut s = e.to_string();
                        let mut cur = std::error::Error::source(&e);
                        while let Some(c) = cur {
                            s += &format!(": {c}");
                            cur = c.source();
                        }
                        s
                    }
                    Ok(_) => panic!("{spec} should not start"),
                }
            }
        };
        assert!(err.contains(want), "{spec}: {err}");
    }
    remote.stop().await;
}

/// A client's unflushed writes through a gateway live in the remote
/// target's host: the gateway reports that host's boot (as it was when the
/// gateway opened the volume), not its own, and a restarted gateway takes
/// over its predecessor's remote session assuming it may hold unflushed
/// writes. So a reboot of the remote host is never missed across a restart
/// of the gateway, whether the gateway was down when it rebooted or had
/// come back before; and a restart of the gateway alone says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_learns_of_the_remote_hosts_reboot_across_a_gateway_restart() {
    let (_dir, img) = temp_file("gateway-boot", 4 * MIB);
    let spec = format!("v=file:{}", img.display());
    let remote = TestServer::start(&[&spec], |c| c.boot_id = Some(1)).await;
    let remote_addr = remote.addr;
    let gw_spec = format!("g=brp://{remote_addr}/v");
    async fn gateway(spec: &str, at: Option<std::net::SocketAddr>) -> TestServer {
        TestServer::start(&[spec], move |c| {
            c.boot_id = Some(7);
            if let Some(a) = at {
                c.brp = a;
            }
        })
        .await
    }
    let gw = gateway(&gw_spec, None).await;
    let gw_addr = gw.addr;
    let opts = Options { connections: 1, reconnect_timeout: Duration::from_secs(20), ..Default::default() };
    let client = Volume::connect(&gw.url("g"), opts.clone()).await.unwrap();
    assert_eq!(client.info().boot, 1, "the remote host's boot, not the gateway's");
    client.write_at(&[2; 4096], 4096, false).await.unwrap();

    // The gateway restarts (on a host that did not reboot): nothing said.
    gw.stop().await;
    let gw = gateway(&gw_spec, Some(gw_addr)).await;
    client.flush().await.expect("a gateway's restart loses nothing");

    // Written, the gateway restarted, then the remote host reboots while the
    // new gateway is up: it cannot tell its predecessor's writes were
    // flushed, so it fails the flush.
    client.write_at(&[3; 4096], 4096, false).await.unwrap();
    gw.stop().await;
    let gw = gateway(&gw_spec, Some(gw_addr)).await;
    remote.stop().await;
    let remote = TestServer::start(&[&spec], |c| (c.brp, c.boot_id) = (remote_addr, Some(2))).await;
    assert!(client.flush().await.is_err(), "the remote host's reboot may have lost the write");
    drop(client);
    assert!(gw.stop_result().await.is_err(), "and the gateway's last flush says so too");

    // Written, then the remote host reboots while the gateway is down; the
    // gateway comes back: the client sees the remote's new boot.
    let gw = gateway(&gw_spec, Some(gw_addr)).await;
    let client = Volume::connect(&gw.url("g"), opts).await.unwrap();
    assert_eq!(client.info().boot, 2);
    client.write_at(&[4; 4096], 4096, false).await.unwrap();
    gw.stop().await;
    remote.stop().await;
    let remote = TestServer::start(&[&spec], |c| (c.brp, c.boot_id) = (remote_addr, Some(3))).await;
    let gw = gateway(&gw_spec, Some(gw_addr)).await;
    let e = client.flush().await.expect_err("its write may be lost with the remote host's memory");
    assert!(matches!(e, fastsan_initiator::Error::UnflushedWritesLost { .. }), "{e:?}");
    assert_eq!(client.read(4096, 4096).await.unwrap().len(), 4096, "reads go on");
    drop(client);
    gw.stop().await;
    remote.stop().await;
}
