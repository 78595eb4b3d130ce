//! A complete single-node allocator as the binary runs it: `init` on an empty log, policy files
//! installed when it leads, the leader's tick expiring allocations without any client traffic,
//! and a restart that neither re-initialises nor re-installs an unchanged policy.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::daemon::{load_policy_files, Daemon, DaemonConfig, PolicyFilesError};
use allot_allocator::ledger::AllocationState;
use allot_allocator::raft::{NodeConfig, SystemNodeClock};
use allot_proto::allot::v1 as pb;
use tokio::net::TcpListener;

use crate::ledger_support::{acquire, client_of, grant, timings, WAIT};

const SHORT_LEASES: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 10
      burst: 10
      name: short-leases
      lease: {ttl_ms: 200, max_grant: 5, max_drift_ms: 50}
";

async fn start(dir: &std::path::Path, addr: &str, policies: &std::path::Path) -> Daemon {
    let listener = TcpListener::bind(addr).await.expect("bind");
    let config = DaemonConfig {
        node: NodeConfig {
            id: 1,
            advertise_addr: addr.to_string(),
            data_dir: dir.join("node-1"),
            cluster_name: "daemon-test".into(),
            timings: timings(),
        },
        members: BTreeMap::from([(1, addr.to_string())]),
        init: true,
        tick_every: Duration::from_millis(50),
        policies: load_policy_files(policies).expect("policy files load"),
    };
    Daemon::start(config, Arc::new(SystemNodeClock), listener)
        .await
        .expect("daemon starts")
}

/// Polls the node's applied ledger until `f` holds, for at most [`WAIT`].
async fn until(d: &Daemon, what: &str, f: impl Fn(&allot_allocator::ledger::Ledger) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !d.node().state().read(&f) {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_installs_policy_files_and_ticks() {
    let _exclusive = crate::ledger_support::exclusive().await;
    let root = tempfile::tempdir().expect("tempdir");
    let policies = root.path().join("policies");
    std::fs::create_dir(&policies).expect("mkdir");
    std::fs::write(policies.join("api.yaml"), SHORT_LEASES).expect("write policy");
    std::fs::write(policies.join("notes.txt"), "not a policy").expect("write other file");
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr").to_string()
    };

    let d = start(root.path(), &addr, &policies).await;
    until(&d, "policy file installed", |l| {
        l.policy_version("api") == 1
    })
    .await;

    // A grant with a 200 ms lease expires on the leader's ticks alone.
    let g = grant(
        client_of(&addr)
            .acquire(acquire("acme", "gw-1", 2_000_000, "r1"))
            .await
            .expect("acquire")
            .into_inner(),
    );
    until(&d, "allocation expired by ticks", |l| {
        l.allocation(g.allocation_id)
            .is_some_and(|a| a.state == AllocationState::Expired)
    })
    .await;
    let status = client_of(&addr)
        .status(pb::StatusRequest {
            key: Some(crate::ledger_support::key("api", "acme")),
        })
        .await
        .expect("status")
        .into_inner();
    assert_eq!(status.regions[0].live_allocations, 0);
    assert_eq!(status.regions[0].stranded, 2_000_000);
    d.shutdown().await.expect("shutdown");

    // Restart with init and the same files: the cluster exists, the policy is unchanged.
    let d = start(root.path(), &addr, &policies).await;
    let leader = d
        .node()
        .raft()
        .wait(Some(WAIT))
        .metrics(|m| m.current_leader == Some(1), "leads again")
        .await;
    assert!(leader.is_ok());
    d.node()
        .ensure_linearizable()
        .await
        .expect("linearizable read");
    assert_eq!(d.node().state().read(|l| l.policy_version("api")), 1);
    assert!(d
        .node()
        .state()
        .read(|l| l.allocation(g.allocation_id).is_some()));
    d.shutdown().await.expect("shutdown");

    // Bad folders are refused before anything starts.
    std::fs::write(policies.join("again.yml"), SHORT_LEASES).expect("write duplicate");
    assert!(matches!(
        load_policy_files(&policies),
        Err(PolicyFilesError::Duplicate { .. })
    ));
    std::fs::write(policies.join("again.yml"), "domain: [").expect("write invalid");
    assert!(matches!(
        load_policy_files(&policies),
        Err(PolicyFilesError::Invalid(_))
    ));
    assert!(matches!(
        load_policy_files(&root.path().join("missing")),
        Err(PolicyFilesError::Io { .. })
    ));
}

/// An operator's SIGHUP after editing the policy folder ([`Daemon::reinstall_policies`]): the
/// leader installs the changed documents through Raft at once; a follower whose start-up
/// installer is done installs nothing and keeps nothing to install at a later failover (where
/// it could replace a version put since with `allotctl policy put`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sighup_only_the_leader_installs_the_policy_folder() {
    let _exclusive = crate::ledger_support::exclusive().await;
    let mut c = crate::ledger_support::LedgerCluster::start(&[1, 2, 3]).await;
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::write(root.path().join("api.yaml"), SHORT_LEASES).expect("write policy");
    let files = load_policy_files(root.path()).expect("policy files load");
    let (leader, follower) = (c.leader().await, c.follower().await);

    c.daemons
        .get_mut(&follower)
        .expect("follower")
        .reinstall_policies(files.clone());
    // The follower's install looks at the leadership once and ends; give it time to (wrongly)
    // propose, then check that nothing was committed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.ledger(leader, |l| l.policy_version("api")).await, 0);

    c.daemons
        .get_mut(&leader)
        .expect("leader")
        .reinstall_policies(files);
    let deadline = tokio::time::Instant::now() + WAIT;
    while c.ledger(follower, |l| l.policy_version("api")).await != 1 {
        assert!(tokio::time::Instant::now() < deadline, "installed in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // An operator puts version 2; then the follower that was signalled becomes the leader. It
    // must not install the folder it read at its SIGHUP over version 2.
    c.client(leader)
        .put_policy(pb::PutPolicyRequest {
            yaml: SHORT_LEASES.replace("requests_per_unit: 10", "requests_per_unit: 20"),
            expected_version: 1,
            request_id: "put-v2".into(),
        })
        .await
        .expect("put version 2");
    for id in [1, 2, 3] {
        c.allow_election(id, id == follower);
    }
    c.stop(leader).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while c.leader().await != follower {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the follower leads in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Longer than an install takes once leading (see above), then the version is still 2.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(c.ledger(follower, |l| l.policy_version("api")).await, 2);
    c.stop_all().await;
}
