//! `allot-agent --grpc-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --ready-file PATH`: both
//! servers bind ports the system picks and the agent reports them once it listens (issue 10,
//! item 17: no launcher picks a port for it).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const POLICY: &str = "domain: ready\ndescriptors:\n  - key: client\n    rate_limit: {unit: minute, requests_per_unit: 3, scope: local}\n";

#[test]
fn an_agent_on_port_zero_reports_the_addresses_it_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).expect("policy");
    let ready = dir.path().join("ready");
    let mut child = Command::new(env!("CARGO_BIN_EXE_allot-agent"))
        .args(["--agent-id", "ready-test", "--region", "test"])
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .arg("--policies")
        .arg(&policy)
        .arg("--ready-file")
        .arg(&ready)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn allot-agent");
    let t0 = Instant::now();
    let text = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text;
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("allot-agent exited ({status}) before writing its ready file");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no ready file within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let lines: Vec<(&str, &str)> = text
        .lines()
        .map(|l| l.split_once(' ').expect("NAME HOST:PORT"))
        .collect();
    assert_eq!(
        lines.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        ["grpc", "http"],
        "one line per server: {text:?}"
    );
    let addrs: Vec<std::net::SocketAddr> = lines
        .iter()
        .map(|(_, a)| a.parse().expect("an IP address and port"))
        .collect();
    assert!(
        addrs.iter().all(|a| a.port() != 0),
        "bound ports, not 0: {addrs:?}"
    );
    assert_ne!(addrs[0], addrs[1]);

    // The HTTP server answers /healthz at the reported address; the gRPC port accepts.
    let mut http = TcpStream::connect(addrs[1]).expect("connect to the reported HTTP address");
    http.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    http.write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
        .expect("send");
    let mut answer = String::new();
    let _ = http.read_to_string(&mut answer);
    TcpStream::connect(addrs[0]).expect("connect to the reported gRPC address");
    child.kill().expect("kill");
    child.wait().expect("wait");
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "healthz answered {answer:?}"
    );
}
