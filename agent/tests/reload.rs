//! `allot-agent` reloads its policies without a restart (design §10 "Config versions"): on
//! SIGHUP, which used to end the process, and when `--policy-reload-ms` finds the files
//! changed. A changed valid set decides the next request, with the key's state carried over; an
//! invalid one is refused and the running version keeps deciding. Checked on the real binary
//! through its HTTP API and `/metrics`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A local rule of `per_hour` requests an hour: no token refills while a test runs.
fn policy(per_hour: u32) -> String {
    format!(
        "domain: reload\ndescriptors:\n  - key: client\n    rate_limit: {{unit: hour, \
         requests_per_unit: {per_hour}, scope: local}}\n"
    )
}

/// The agent process; killed when dropped (a failed assertion leaves nothing running).
struct Agent {
    child: Child,
    http: SocketAddr,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn start(dir: &Path, reload_ms: u64) -> Agent {
        let ready = dir.join("ready");
        let child = Command::new(env!("CARGO_BIN_EXE_allot-agent"))
            .args(["--agent-id", "reload-test", "--region", "test"])
            .args([
                "--grpc-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .arg("--policies")
            .arg(dir.join("policies"))
            .args(["--policy-reload-ms", &reload_ms.to_string()])
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn allot-agent");
        let mut agent = Agent {
            child,
            http: "0.0.0.0:0".parse().expect("addr"),
        };
        let text = agent.wait_for("the ready file", || std::fs::read_to_string(&ready).ok());
        let http = text
            .lines()
            .find_map(|l| l.strip_prefix("http "))
            .expect("an http line");
        agent.http = http.parse().expect("HOST:PORT");
        agent
    }

    /// Polls `f` until it gives a value (30 s at most), failing if the agent exits.
    fn wait_for<T>(&mut self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let t0 = Instant::now();
        loop {
            if let Some(v) = f() {
                return v;
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("allot-agent exited ({status}) while waiting for {what}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no {what} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One HTTP/1.0 exchange: (status, body).
    fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(self.http).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        write!(
            s,
            "{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("a status line");
        let body = answer
            .split_once("\r\n\r\n")
            .map_or(String::new(), |(_, b)| b.to_string());
        (status, body)
    }

    /// POST /v1/check for `client`: (status, body).
    fn check(&self, client: &str) -> (u16, String) {
        self.http(
            "POST",
            "/v1/check",
            &format!(
                r#"{{"domain":"reload","descriptors":[{{"entries":[{{"key":"client","value":"{client}"}}]}}]}}"#
            ),
        )
    }

    /// A metric's value from /metrics (the first sample whose line starts with `series`).
    fn metric(&self, series: &str) -> Option<u64> {
        let (_, text) = self.http("GET", "/metrics", "");
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{name}");
    }

    /// Sends SIGHUP and waits until the agent has checked its files once more (its poll is off
    /// in these tests unless said): proof that the signal was handled, not fatal.
    fn hangup(&mut self) {
        let checks = "allot_agent_policy_checks_total";
        let before = self.metric(checks).expect("the checks counter");
        self.signal("HUP");
        self.wait_for_metric(checks, before + 1);
    }

    /// SIGTERM: the agent drains, releases and exits 0 (SIGHUP handling changed nothing there).
    fn terminate(mut self) {
        self.signal("TERM");
        let t0 = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no exit within 30 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "exit after SIGTERM: {status}");
    }

    /// Waits until `/metrics` shows `series` at `v` (30 s at most).
    fn wait_for_metric(&mut self, series: &str, v: u64) {
        let t0 = Instant::now();
        while self.metric(series) != Some(v) {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("allot-agent exited ({status}) while waiting for {series} = {v}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{series} is {:?}, not {v}, after 30 s",
                self.metric(series)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn write_policy(dir: &Path, text: &str) {
    let p = dir.join("policies");
    std::fs::create_dir_all(&p).expect("mkdir");
    // Written beside and renamed, as a deployment tool does: the agent never reads half a file.
    let tmp = dir.join("api.yaml.tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, p.join("api.yaml")).expect("rename");
}

#[test]
fn sighup_reloads_a_changed_policy_and_refuses_an_invalid_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_policy(dir.path(), &policy(2));
    let mut agent = Agent::start(dir.path(), 0);
    assert_eq!(agent.check("a").0, 200);
    assert_eq!(agent.check("a").0, 200);
    let (status, body) = agent.check("a");
    assert_eq!(status, 429);
    assert!(body.contains("-v1"), "{body}");

    // SIGHUP with the files unchanged: handled (the agent checked), still version 1.
    agent.hangup();
    assert_eq!(agent.metric("allot_agent_policy_reload_ok"), Some(1));
    assert_eq!(agent.metric("allot_agent_policy_version"), Some(1));

    // Raised to 5 an hour: the key's bucket carries over with 3 more tokens (design §10).
    write_policy(dir.path(), &policy(5));
    agent.hangup();
    assert_eq!(agent.metric("allot_agent_policy_version"), Some(2));
    assert_eq!(
        agent.metric("allot_agent_policy_reloads_total{result=\"applied\"}"),
        Some(1)
    );
    for _ in 0..3 {
        assert_eq!(agent.check("a").0, 200);
    }
    let (status, body) = agent.check("a");
    assert_eq!(status, 429);
    assert!(body.contains("-v2"), "{body}");

    // An invalid file: refused, counted, and version 2 keeps deciding.
    write_policy(dir.path(), "domain: reload\ndescriptors: [{key: client, rate_limit: {unit: fortnight, requests_per_unit: 1}}]\n");
    agent.hangup();
    assert_eq!(agent.metric("allot_agent_policy_reload_ok"), Some(0));
    assert_eq!(
        agent.metric("allot_agent_policy_reloads_total{result=\"rejected\"}"),
        Some(1)
    );
    assert_eq!(agent.metric("allot_agent_policy_version"), Some(2));
    for _ in 0..5 {
        assert_eq!(agent.check("b").0, 200);
    }
    assert_eq!(agent.check("b").0, 429, "version 2's limit of 5");
    agent.terminate();
}

#[test]
fn a_changed_file_is_picked_up_by_the_poll() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_policy(dir.path(), &policy(1));
    // Polled every 50 ms: a change is applied once two polls in a row read it.
    let mut agent = Agent::start(dir.path(), 50);
    assert_eq!(agent.check("a").0, 200);
    assert_eq!(agent.check("a").0, 429);
    write_policy(dir.path(), &policy(3));
    agent.wait_for_metric("allot_agent_policy_version", 2);
    assert_eq!(agent.check("a").0, 200);
    assert_eq!(agent.check("a").0, 200);
    assert_eq!(agent.check("a").0, 429);
    agent.terminate();
}
