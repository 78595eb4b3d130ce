//! `allotctl cluster | policy | shares | status` against a real 3-node allocator cluster on
//! loopback (started in this process), run as an operator runs them.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::daemon::{Daemon, DaemonConfig};
use allot_allocator::raft::{NodeConfig, RaftTimings, SystemNodeClock};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use tokio::net::TcpListener;

const POLICY: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 100
      burst: 100
      name: api-tenant
      lease: {ttl_ms: 60000, max_grant: 10, max_drift_ms: 100}
      regions:
        - {region: eu-west, share: \"50%\"}
        - {region: us-east, share: \"50%\"}
";

/// Runs allotctl off the async runtime's threads.
async fn allotctl(dir: &Path, args: &[&str]) -> Output {
    let dir = dir.to_path_buf();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_allotctl"))
            .current_dir(dir)
            .args(args)
            .output()
            .expect("allotctl runs")
    })
    .await
    .expect("join")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_commands_drive_a_cluster() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("api.yaml"), POLICY).expect("write policy");
    let mut listeners = BTreeMap::new();
    let mut addrs = BTreeMap::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        addrs.insert(id, l.local_addr().expect("addr").to_string());
        listeners.insert(id, l);
    }
    let mut daemons = Vec::new();
    for (id, l) in listeners {
        let config = DaemonConfig {
            node: NodeConfig {
                id,
                advertise_addr: addrs[&id].clone(),
                data_dir: dir.path().join(format!("node-{id}")),
                cluster_name: "allotctl-test".into(),
                timings: RaftTimings {
                    heartbeat_ms: 50,
                    election_timeout_min_ms: 300,
                    election_timeout_max_ms: 600,
                    ..RaftTimings::default()
                },
            },
            members: addrs.clone(),
            init: false,
            tick_every: Duration::from_millis(250),
            policies: Vec::new(),
        };
        daemons.push(
            Daemon::start(config, Arc::new(SystemNodeClock), l)
                .await
                .expect("node starts"),
        );
    }
    let a = |id: u64| addrs[&id].clone();
    let members: Vec<String> = addrs.iter().map(|(id, ad)| format!("{id}={ad}")).collect();

    let mut init = vec!["cluster", "init", "--addr"];
    let a1 = a(1);
    init.push(&a1);
    for m in &members {
        init.extend(["--member", m]);
    }
    let out = allotctl(dir.path(), &init).await;
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Poll `cluster status --json` until a leader is known (an election takes a moment).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let leader = loop {
        let out = allotctl(
            dir.path(),
            &["cluster", "status", "--addr", &a(2), "--json"],
        )
        .await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        // Node 2 learns the membership and the leader from the leader's first messages.
        let voters = v["voters"].as_array().map_or(0, Vec::len);
        if let (3, Some(l)) = (voters, v["leader_id"].as_u64()) {
            break l;
        }
        assert!(tokio::time::Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let follower = if leader == 1 { 2 } else { 1 };
    let out = allotctl(dir.path(), &["cluster", "status", "--addr", &a(follower)]).await;
    let s = text(&out.stdout);
    assert!(
        s.contains(&format!("leader: node {leader} at {}", a(leader))),
        "{s}"
    );

    // Policy put through a follower (forwarded); a second put at version 0 is refused.
    let put = [
        "policy",
        "put",
        "--addr",
        &a(follower),
        "--file",
        "api.yaml",
    ];
    let out = allotctl(dir.path(), &put).await;
    assert_eq!(text(&out.stdout).trim(), "policy api is at version 1");
    let out = allotctl(dir.path(), &put).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("FailedPrecondition: domain \"api\" is at version 1, not 0"),
        "{}",
        text(&out.stderr)
    );

    let out = allotctl(
        dir.path(),
        &[
            "shares",
            "set",
            "--addr",
            &a(leader),
            "--policy",
            "api-tenant",
            "--share",
            "eu-west=25%",
            "--share",
            "us-east=75",
            "--config-version",
            "1",
        ],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = allotctl(
        dir.path(),
        &[
            "shares",
            "set",
            "--addr",
            &a(leader),
            "--policy",
            "api-tenant",
            "--share",
            "eu-west=80%",
            "--config-version",
            "2",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("InvalidArgument"),
        "{}",
        text(&out.stderr)
    );

    // Each successful write went with a fresh, non-empty request id: the ledger remembers both
    // answers for retries (an empty id is never remembered). `cluster status` shows the table.
    let out = allotctl(
        dir.path(),
        &["cluster", "status", "--addr", &a(leader), "--json"],
    )
    .await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let admin = v["tables"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["table"] == "admin_requests"))
        .unwrap_or_else(|| panic!("no admin_requests table: {v}"));
    assert_eq!(admin["entries"], 2, "{v}");
    let out = allotctl(dir.path(), &["cluster", "status", "--addr", &a(leader)]).await;
    let s = text(&out.stdout);
    assert!(
        s.contains("table policy_keys: 0 entries, 0 refused, 0 evicted"),
        "{s}"
    );

    // A grant and a report, then the status in tokens and in raw microtokens.
    let mut c = AllocatorClient::connect(format!("http://{}", a(leader)))
        .await
        .expect("connect");
    let key = pb::PolicyKey {
        domain: "api".into(),
        entries: vec![pb::DescriptorEntry {
            key: "tenant".into(),
            value: "acme".into(),
        }],
    };
    let r = c
        .acquire(pb::AcquireRequest {
            key: Some(key),
            region: "eu-west".into(),
            holder: "gw-1".into(),
            want: 4_000_000,
            demand_per_s: 0,
            want_rate_per_s: 0,
            request_id: "r1".into(),
        })
        .await
        .expect("acquire")
        .into_inner();
    let Some(pb::acquire_response::Outcome::Grant(g)) = r.outcome else {
        panic!("expected a grant: {r:?}");
    };
    c.report(pb::ReportRequest {
        incarnation: 0,
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        cumulative_spend: 1_500_000,
        holder: "gw-1".into(),
    })
    .await
    .expect("report");
    let status = [
        "status",
        "--addr",
        &a(follower),
        "--domain",
        "api",
        "--entry",
        "tenant=acme",
    ];
    let out = allotctl(dir.path(), &status).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let row = s
        .lines()
        .find(|l| l.starts_with("eu-west"))
        .unwrap_or_else(|| panic!("no eu-west row: {s}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells, ["eu-west", "1", "4", "1.5", "0", "2.5"], "{s}");
    let mut json = status.to_vec();
    json.push("--json");
    let out = allotctl(dir.path(), &json).await;
    assert!(out.status.success(), "status --json: {}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["regions"][0]["granted_micros"], 4_000_000);
    assert_eq!(v["regions"][0]["overshoot_bound_micros"], 2_500_000);

    // Membership changes are not forwarded: a follower answers with the leader hint.
    let out = allotctl(
        dir.path(),
        &[
            "cluster",
            "add-learner",
            "--addr",
            &a(follower),
            "--member",
            "4=127.0.0.1:1",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert!(e.contains("FailedPrecondition"), "{e}");
    assert!(
        e.contains(&format!("leader hint: node {leader} at {}", a(leader))),
        "{e}"
    );

    // Unknown key, unreachable node, bad share syntax.
    let out = allotctl(
        dir.path(),
        &[
            "status",
            "--addr",
            &a(leader),
            "--domain",
            "nope",
            "--entry",
            "tenant=acme",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("NotFound"),
        "{}",
        text(&out.stderr)
    );
    let out = allotctl(dir.path(), &["cluster", "status", "--addr", "127.0.0.1:1"]).await;
    assert_eq!(out.status.code(), Some(2));
    let out = allotctl(
        dir.path(),
        &[
            "shares",
            "set",
            "--addr",
            &a(leader),
            "--policy",
            "api-tenant",
            "--share",
            "eu-west=150%",
            "--config-version",
            "3",
        ],
    )
    .await;
    assert!(!out.status.success());

    for d in daemons {
        d.shutdown().await.expect("shutdown");
    }
}
