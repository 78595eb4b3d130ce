//! A 3-node loopback cluster: commits, leader failover, whole-cluster restart.

use allot_allocator::raft::ClientError;
use allot_proto::allot::v1::raft_service_client::RaftServiceClient;
use allot_proto::allot::v1::RaftPayload;

use crate::support::{add, Cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_survive_leader_failover_and_full_restart() {
    let mut cluster = Cluster::start(&[1, 2, 3]).await;
    cluster.nodes[&1]
        .initialize(cluster.addrs.clone())
        .await
        .expect("initialise");

    // Commit enough entries to cross the snapshot threshold (snapshots are built and the log
    // purged behind them).
    let mut expected = 0;
    let mut last_stamp = 0;
    for _ in 0..20 {
        cluster.clock.advance(10);
        let response = cluster.propose(add("k", 1)).await;
        expected += 1;
        assert_eq!(response.value, expected);
        assert!(response.applied_at_ms > last_stamp);
        last_stamp = response.applied_at_ms;
    }
    let old_leader = cluster.leader().await;
    cluster.wait_applied(cluster.applied(old_leader)).await;
    for node in cluster.nodes.values() {
        assert_eq!(
            node.state().read(|app| app.get("k", last_stamp)),
            Some(expected)
        );
    }

    // A malformed Raft payload from the network is refused, not a crash.
    let mut raw = RaftServiceClient::connect(format!("http://{}", cluster.addrs[&1]))
        .await
        .expect("connect");
    let status = raw
        .append_entries(RaftPayload {
            payload: vec![0xFF; 16],
        })
        .await
        .expect_err("garbage is rejected");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // A follower refuses to propose and names the leader and its address.
    let follower = *cluster
        .nodes
        .keys()
        .find(|&&id| id != old_leader)
        .expect("a follower");
    match cluster.nodes[&follower].propose(add("k", 1)).await {
        Err(ClientError::NotLeader {
            leader_id: Some(leader_id),
            leader_addr,
        }) => {
            assert_ne!(leader_id, follower);
            assert_eq!(
                leader_addr.as_deref(),
                Some(cluster.addrs[&leader_id].as_str())
            );
        }
        other => panic!("follower accepted a proposal: {other:?}"),
    }

    // Kill the leader: the other two elect a new one and keep committing.
    cluster.stop(old_leader).await;
    let new_leader = cluster.leader().await;
    assert_ne!(new_leader, old_leader);
    for _ in 0..10 {
        cluster.clock.advance(10);
        let response = cluster.propose(add("k", 1)).await;
        expected += 1;
        assert_eq!(response.value, expected);
        assert!(response.applied_at_ms > last_stamp);
        last_stamp = response.applied_at_ms;
    }

    // Restart the whole cluster from the same sled directories.
    cluster.stop_all().await;
    for id in [1, 2, 3] {
        cluster.restart(id).await;
    }
    cluster.leader().await;

    // Committed state survived; the stamped-time floor survived too: a clock that went back
    // still applies at the last stamped time.
    cluster.clock.set(1);
    let response = cluster.propose(add("k", 0)).await;
    assert_eq!(response.value, expected);
    assert_eq!(response.applied_at_ms, last_stamp);

    // A linearizable read on the leader sees every committed write; a follower cannot serve one.
    let leader = cluster.leader().await;
    cluster.nodes[&leader]
        .ensure_linearizable()
        .await
        .expect("leader confirms leadership");
    assert_eq!(
        cluster.nodes[&leader]
            .state()
            .read(|app| app.get("k", last_stamp)),
        Some(expected)
    );
    let follower = *cluster
        .nodes
        .keys()
        .find(|&&id| id != leader)
        .expect("a follower");
    assert!(matches!(
        cluster.nodes[&follower].ensure_linearizable().await,
        Err(ClientError::NotLeader { .. })
    ));

    // Every node, including the old leader that missed entries, converges on the same state.
    let leader = cluster.leader().await;
    assert_ne!(
        leader, old_leader,
        "a node with a stale log cannot win an election"
    );
    cluster.wait_applied(cluster.applied(leader)).await;
    for (id, node) in &cluster.nodes {
        assert_eq!(
            node.state().read(|app| app.get("k", last_stamp)),
            Some(expected),
            "node {id}"
        );
        assert_eq!(node.state().last_stamped_ms(), last_stamp, "node {id}");
    }

    // A fresh learner joins after the leader purged the log's start: it can only catch up
    // through InstallSnapshot over gRPC, and restores the same state from the snapshot.
    let purged = cluster.nodes[&leader].raft().metrics().borrow().purged;
    assert!(purged.is_some(), "the leader has purged part of its log");
    cluster.start_new(4).await;
    cluster.nodes[&leader]
        .add_learner(4, cluster.addrs[&4].clone(), true)
        .await
        .expect("learner added and caught up");
    cluster.wait_applied(cluster.applied(leader)).await;
    let learner = &cluster.nodes[&4];
    assert!(learner.raft().metrics().borrow().snapshot.is_some());
    assert_eq!(
        learner.state().read(|app| app.get("k", last_stamp)),
        Some(expected)
    );
    assert_eq!(learner.state().last_stamped_ms(), last_stamp);

    cluster.stop_all().await;
}
