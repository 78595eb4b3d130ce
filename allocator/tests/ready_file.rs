//! `allot-allocator --listen 127.0.0.1:0 --ready-file PATH`: the node binds a port the system
//! picks, advertises that address, and reports it once it serves (issue 10, item 17: no
//! launcher picks a port for it).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;

/// Polls for the ready file; the node must not exit first.
fn read_ready(child: &mut Child, path: &Path) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!(
                "allot-allocator exited ({status}) before writing {}",
                path.display()
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no ready file within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn a_node_on_port_zero_reports_and_advertises_the_address_it_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("ready");
    let mut child = Command::new(env!("CARGO_BIN_EXE_allot-allocator"))
        .args(["--node-id", "1", "--listen", "127.0.0.1:0", "--init"])
        .arg("--ready-file")
        .arg(&ready)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn allot-allocator");
    let text = read_ready(&mut child, &ready);
    let addr = text
        .strip_prefix("grpc ")
        .and_then(|l| l.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("ready file {text:?} is not one \"grpc HOST:PORT\" line"));
    let sa: std::net::SocketAddr = addr.parse().expect("an IP address and port");
    assert_ne!(sa.port(), 0, "the reported port is the bound one, not 0");
    assert!(
        !dir.path().join("ready.tmp").exists(),
        "the temporary file is renamed"
    );

    // The node serves there, and the single-node cluster it initialised records that address.
    let mut c = AllocatorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the reported address");
    let t0 = Instant::now();
    let status = loop {
        let s = c
            .cluster_status(pb::ClusterStatusRequest {})
            .await
            .expect("cluster status")
            .into_inner();
        if s.leader_id.is_some() || t0.elapsed() > Duration::from_secs(20) {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    child.kill().expect("kill");
    child.wait().expect("wait");
    assert_eq!(status.node_id, 1);
    assert_eq!(status.leader_id, Some(1), "the node leads its cluster");
    assert_eq!(status.leader_addr, addr, "it advertises the bound address");
    assert_eq!(
        status.voters,
        vec![pb::Member {
            node_id: 1,
            addr: addr.to_string()
        }]
    );
}
