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
