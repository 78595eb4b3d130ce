//! Voters build their snapshots in turn (`RaftTimings::stagger_snapshots`): on a 3-node
//! loopback cluster every voter compacts its log, and no two voters build at the same index.
//! (With `stagger_snapshots: false` the test fails: all three build at the same indexes.)

use std::collections::{BTreeMap, BTreeSet};

use allot_allocator::raft::RaftTimings;

use crate::support::{add, timings, Cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voters_build_their_snapshots_in_turn_at_different_indexes() {
    // Turns 10 entries apart: a build that starts a few entries after its turn (the trigger
    // and the state machine's copy are asynchronous) still cannot reach the next voter's.
    let every = 30;
    let cluster_timings = RaftTimings {
        snapshot_every_logs: every,
        stagger_snapshots: true,
        ..timings()
    };
    let mut cluster = Cluster::start_with(&[1, 2, 3], cluster_timings).await;
    cluster.nodes[&1]
        .initialize(cluster.addrs.clone())
        .await
        .expect("initialise");

    // One entry at a time, each applied everywhere before the next, so that each voter's
    // build starts at its turn; every snapshot index each voter reaches is recorded.
    let mut built: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for _ in 0..(6 * every) {
        cluster.clock.advance(10);
        cluster.propose(add("k", 1)).await;
        let leader = cluster.leader().await;
        cluster.wait_applied(cluster.applied(leader)).await;
        for (id, node) in &cluster.nodes {
            if let Some(s) = node.raft().metrics().borrow().snapshot {
                built.entry(*id).or_default().insert(s.index);
            }
        }
    }

    for id in [1, 2, 3] {
        let mine = built.get(&id).cloned().unwrap_or_default();
        assert!(
            mine.len() >= 4,
            "voter {id} built {} snapshots over {} entries: {mine:?}",
            mine.len(),
            6 * every
        );
        for other in [1, 2, 3].into_iter().filter(|&o| o != id) {
            let theirs = built.get(&other).cloned().unwrap_or_default();
            let shared: Vec<_> = mine.intersection(&theirs).collect();
            assert!(
                shared.is_empty(),
                "voters {id} and {other} both built at {shared:?}: {built:?}"
            );
        }
    }
    cluster.stop_all().await;
}
