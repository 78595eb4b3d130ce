//! `allot-allocator --policies DIR` re-reads its folder on SIGHUP (which used to end the
//! process) and installs through Raft each document that changed; a folder that no longer
//! loads changes nothing and the node keeps serving. Checked on the real binary through the
//! allocator API's `Status` (the policy version in force).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use tonic::transport::Channel;

fn policy(per_second: u32) -> String {
    format!(
        "domain: reload\ndescriptors:\n  - key: tenant\n    rate_limit: {{unit: second, \
         requests_per_unit: {per_second}, scope: global}}\n"
    )
}

fn write_policy(dir: &Path, text: &str) {
    let tmp = dir.join("reload.yaml.tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, dir.join("policies").join("reload.yaml")).expect("rename");
}

/// The node process (its log in `log`); killed when dropped.
struct Node(Child, std::path::PathBuf);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Node {
    fn alive(&mut self) {
        if let Some(status) = self.0.try_wait().expect("try_wait") {
            panic!("allot-allocator exited ({status})");
        }
    }

    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.0.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{name}");
    }

    /// Lines of the node's log containing `text`.
    fn logged(&self, text: &str) -> usize {
        std::fs::read_to_string(&self.1)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(text))
            .count()
    }

    /// Sends SIGHUP and waits (30 s at most) until the node logs that it handled it with
    /// `outcome`: proof that the signal was taken, not fatal.
    async fn hangup(&mut self, outcome: &str) {
        let before = self.logged(outcome);
        self.signal("HUP");
        let t0 = Instant::now();
        while self.logged(outcome) == before {
            self.alive();
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no {outcome:?} logged after SIGHUP"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM: the node stops gracefully and exits 0.
    async fn terminate(mut self) {
        self.signal("TERM");
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                assert!(status.success(), "exit after SIGTERM: {status}");
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no exit within 30 s of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The version in force: the one that decides one token of tenant "t" now (0 while there is
/// no leader yet).
async fn version(c: &mut AllocatorClient<Channel>) -> u64 {
    decide(c, "t").await
}

/// Decides one token of tenant `tenant`; returns the policy version that decided (0 on error).
async fn decide(c: &mut AllocatorClient<Channel>, tenant: &str) -> u64 {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let key = tenant_key(tenant);
    let req = pb::DecideRequest {
        key: Some(key),
        region: "r".into(),
        holder: "test".into(),
        cost: 1_000_000,
        request_id: format!("d{n}"),
    };
    c.decide(req)
        .await
        .map_or(0, |r| r.into_inner().policy_version)
}

fn tenant_key(tenant: &str) -> pb::PolicyKey {
    pb::PolicyKey {
        domain: "reload".into(),
        entries: vec![pb::DescriptorEntry {
            key: "tenant".into(),
            value: tenant.into(),
        }],
    }
}

/// Waits (30 s at most) until the version in force is `v`, the node staying up.
async fn wait_for_version(node: &mut Node, c: &mut AllocatorClient<Channel>, v: u64) {
    let t0 = Instant::now();
    loop {
        node.alive();
        let now = version(c).await;
        if now == v {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "version {now}, not {v}, after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn sighup_installs_a_changed_policy_file_and_ignores_an_invalid_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("policies")).expect("mkdir");
    write_policy(dir.path(), &policy(10));
    let ready = dir.path().join("ready");
    let log = dir.path().join("node.log");
    let mut node = Node(
        Command::new(env!("CARGO_BIN_EXE_allot-allocator"))
            .args(["--node-id", "1", "--listen", "127.0.0.1:0", "--init"])
            .arg("--policies")
            .arg(dir.path().join("policies"))
            .arg("--ready-file")
            .arg(&ready)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn allot-allocator"),
        log,
    );
    let t0 = Instant::now();
    let addr = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text
                .trim()
                .strip_prefix("grpc ")
                .expect("grpc line")
                .to_string();
        }
        node.alive();
        assert!(t0.elapsed() < Duration::from_secs(30), "no ready file");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut c = AllocatorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    wait_for_version(&mut node, &mut c, 1).await;

    // Unchanged folder: handled, nothing proposed.
    node.hangup("SIGHUP: policies re-read").await;
    assert_eq!(version(&mut c).await, 1);

    // A key last touched under version 1.
    assert_eq!(decide(&mut c, "u").await, 1);
    write_policy(dir.path(), &policy(20));
    node.hangup("SIGHUP: policies re-read").await;
    wait_for_version(&mut node, &mut c, 2).await;
    // Status shows what is in force now, the rule and its new rate and capacity, also for the
    // key whose bucket takes them only at its next decision.
    let s = c
        .status(pb::StatusRequest {
            key: Some(tenant_key("u")),
        })
        .await
        .expect("status")
        .into_inner();
    assert_eq!(
        (
            s.policy_version,
            s.policy.as_str(),
            s.requests_per_unit,
            s.unit.as_str()
        ),
        (2, "reload|tenant", 20, "SECOND")
    );
    assert_eq!((s.unit_multiplier, s.capacity_tokens), (1, 20));

    // A folder that no longer loads: logged, nothing changes, the node serves on.
    write_policy(
        dir.path(),
        "domain: reload\ndescriptors: [{key: tenant}]\nnonsense: 1\n",
    );
    node.hangup("SIGHUP: policies not reloaded").await;
    assert_eq!(version(&mut c).await, 2);
    node.terminate().await;
}
