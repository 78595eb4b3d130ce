//! Ledger time never runs faster than real time (issue 10 item 2), on a 3-node cluster of real
//! ledgers whose nodes each read their own manual clocks: a wall clock each test sets apart from
//! the others, and a monotonic clock that only moves when the test says real time passed.
//!
//! Which node leads next is decided by letting only that node start elections once the leader
//! is stopped; waiting for the election is a bounded poll, and every stamp is exact.

use std::collections::BTreeMap;
use std::sync::Arc;

use allot_allocator::daemon::skew_watch;
use allot_allocator::ledger::AllocationState;
use allot_allocator::raft::{GroupCommitConfig, ManualNodeClock, NodeClock, SkewCheck};
use allot_proto::allot::v1 as pb;

use crate::ledger_support::{
    acquire, exclusive, LedgerCluster, API_BURST, API_POLICY, API_RATE_PER_S, WAIT,
};

/// Every node's wall clock at the start, Unix ms.
const W: u64 = 1_700_000_000_000;
/// One token, microtokens.
const T: u64 = 1_000_000;
/// A day, ms.
const DAY_MS: u64 = 86_400_000;

/// One manual clock per node, all reading [`W`], each with its own monotonic origin (as
/// separate processes have), and the same clocks as the cluster takes them.
fn node_clocks(
    ids: &[u64],
) -> (
    BTreeMap<u64, ManualNodeClock>,
    BTreeMap<u64, Arc<dyn NodeClock>>,
) {
    let manual: BTreeMap<u64, ManualNodeClock> = ids
        .iter()
        .map(|&id| (id, ManualNodeClock::with_monotonic(W, id * 7_000_000_000)))
        .collect();
    let shared = manual
        .iter()
        .map(|(&id, c)| (id, Arc::new(c.clone()) as Arc<dyn NodeClock>))
        .collect();
    (manual, shared)
}

/// A cluster whose first leader drained api/tenant=acme at [`W`].
struct Drained {
    cluster: LedgerCluster,
    clocks: BTreeMap<u64, ManualNodeClock>,
    /// The first leader.
    first: u64,
    /// What it granted: the full bucket.
    drained: Vec<pb::Grant>,
}

impl Drained {
    /// Starts the cluster, installs the API policy and drains the key on the first leader.
    async fn start() -> Self {
        let (clocks, shared) = node_clocks(&[1, 2, 3]);
        let cluster =
            LedgerCluster::start_with_clocks(&[1, 2, 3], GroupCommitConfig::default(), shared)
                .await;
        let first = cluster.leader().await;
        cluster
            .client(first)
            .put_policy(pb::PutPolicyRequest {
                yaml: API_POLICY.into(),
                expected_version: 0,
                request_id: String::new(),
            })
            .await
            .expect("policy accepted");
        let drained = drain(&cluster, first, "first").await;
        assert_eq!(total(&drained), API_BURST, "the full bucket, at W");
        Self {
            cluster,
            clocks,
            first,
            drained,
        }
    }

    /// Stops `leader` while neither other running node may start an election, lets `real_ms`
    /// of real time pass on every clock, moves the wall clock of the node that is to lead next
    /// `skew_ms` ahead, lets only that node start an election and waits until it leads.
    /// Returns (next leader, the other node). The next leader is `prefer` unless the other
    /// node's log is longer (a candidate with a shorter log cannot win).
    async fn hand_over(
        &mut self,
        leader: u64,
        prefer: u64,
        real_ms: u64,
        skew_ms: u64,
    ) -> (u64, u64) {
        let mut rest: Vec<u64> = self
            .cluster
            .daemons
            .keys()
            .copied()
            .filter(|&id| id != leader)
            .collect();
        assert_eq!(rest.len(), 2, "two nodes stay");
        for &id in &rest {
            self.cluster.allow_election(id, false);
        }
        self.cluster.stop(leader).await;
        let log = |id: u64| {
            self.cluster.daemons[&id]
                .node()
                .raft()
                .metrics()
                .borrow()
                .last_log_index
        };
        // The preferred node first; the longer log wins (a stable sort keeps ties in order).
        rest.sort_by_key(|&id| id != prefer);
        rest.sort_by_key(|&id| std::cmp::Reverse(log(id)));
        let (next, idle) = (rest[0], rest[1]);
        for c in self.clocks.values() {
            c.advance(real_ms);
        }
        self.clocks[&next].advance_wall(skew_ms);
        self.cluster.allow_election(next, true);
        assert_eq!(self.cluster.leader().await, next);
        (next, idle)
    }
}

/// Acquires 10 tokens at a time for api/tenant=acme on `node` until it is denied; returns what
/// was granted, in order.
async fn drain(cluster: &LedgerCluster, node: u64, round: &str) -> Vec<pb::Grant> {
    let mut grants = Vec::new();
    for n in 0.. {
        let rid = format!("{round}-{n}");
        let r = cluster
            .client(node)
            .acquire(acquire("acme", "gw-a", 10 * T, &rid))
            .await
            .expect("acquire answered")
            .into_inner();
        match r.outcome {
            Some(pb::acquire_response::Outcome::Grant(g)) => grants.push(g),
            Some(pb::acquire_response::Outcome::Denial(_)) => break,
            None => panic!("empty acquire response"),
        }
        assert!(n < 100, "the bucket never ran dry");
    }
    grants
}

fn total(grants: &[pb::Grant]) -> u64 {
    grants.iter().map(|g| g.granted).sum()
}

/// Polls until node `id` applied a stamp above `above_ms` (an entry of the current leader);
/// returns the ledger's time then.
async fn stamp_above(cluster: &LedgerCluster, id: u64, above_ms: u64) -> u64 {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = cluster.daemons[&id].node().state().read(|l| l.last_ms());
        if now > above_ms {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {id} applied no stamp above {above_ms} in time"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// B + r·Δt for the API policy, microtokens.
fn bound(elapsed_ms: u64) -> u64 {
    API_BURST + API_RATE_PER_S * elapsed_ms / 1000
}

/// The test: a key drained on the old leader; 200 ms of real time later the leader is
/// gone and node 2 (or node 3, when node 2 leads first or its log is behind) leads with a wall
/// clock 3 s ahead. Its first Tick is stamped 200 ms after the last entry, not 3.2 s: the
/// bucket refilled by r·200 ms (total granted ≤ B + r·Δt over real time), and the allocation
/// granted on the old leader is still live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_whose_clock_is_ahead_neither_refills_early_nor_expires_live_allocations() {
    let _exclusive = exclusive().await;
    let mut t = Drained::start().await;
    let kept = t.drained[0].allocation_id;
    // The leader goes; 200 ms of real time pass; a node whose clock is 3 s ahead leads.
    let (ahead, third) = t.hand_over(t.first, 2, 200, 3_000).await;
    let cluster = &t.cluster;

    let first_tick = stamp_above(cluster, ahead, W).await;
    assert_eq!(
        first_tick,
        W + 200,
        "ledger time moved by the real time elapsed, not by the new leader's wall clock"
    );
    let a = cluster
        .ledger(ahead, |l| l.allocation(kept).cloned())
        .await
        .expect("the old allocation is kept");
    assert_eq!(a.state, AllocationState::Live, "{a:?}");

    let after = drain(cluster, ahead, "after").await;
    let granted = total(&t.drained) + total(&after);
    assert!(
        granted <= bound(200),
        "granted {granted} > B + r·Δt = {}",
        bound(200)
    );
    assert!(granted > API_BURST, "the bucket refilled at real rate");

    // The node whose clock is ahead says so; the others do not.
    let check = skew_watch::check_once(cluster.daemons[&ahead].node());
    assert!(
        matches!(check, SkewCheck::Beyond { skew_ms: 3_000, .. }),
        "{check:?}"
    );
    let status = cluster
        .client(ahead)
        .cluster_status(pb::ClusterStatusRequest {})
        .await
        .expect("cluster status")
        .into_inner();
    assert_eq!(status.clock_skew_ms, Some(3_000));
    assert!(status.clock_skew_beyond_max >= 1);
    let check = skew_watch::check_once(cluster.daemons[&third].node());
    assert_eq!(check, SkewCheck::Within { skew_ms: 0 });

    t.cluster.stop_all().await;
}

/// A leader whose wall clock is a day ahead neither pushes ledger time ahead while it leads nor
/// freezes it after: refill continues at real rate under it and under the next leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_far_future_leader_neither_jumps_nor_freezes_ledger_time() {
    let _exclusive = exclusive().await;
    let mut t = Drained::start().await;
    let first = t.first;
    let mut granted = total(&t.drained);

    // After 300 ms of real time, a node whose clock is a day ahead leads.
    let (far, _) = t.hand_over(first, 3, 300, DAY_MS).await;
    assert_eq!(stamp_above(&t.cluster, far, W).await, W + 300);
    let while_far = total(&drain(&t.cluster, far, "far").await);
    granted += while_far;
    assert!(granted <= bound(300), "granted {granted} > {}", bound(300));
    assert!(while_far > 0, "refill under the far-future leader");

    // It loses leadership: the first leader comes back (for a quorum) and catches up, the far
    // one goes, 300 ms more pass, and another node leads.
    t.cluster.restart(first).await;
    t.cluster.ledger(first, |_| ()).await;
    let (next, _) = t.hand_over(far, first, 300, 0).await;
    assert_eq!(stamp_above(&t.cluster, next, W + 300).await, W + 600);
    let after = total(&drain(&t.cluster, next, "after").await);
    granted += after;
    assert!(
        after > 0,
        "ledger time is not frozen at the far-future stamp"
    );
    assert!(granted <= bound(600), "granted {granted} > {}", bound(600));

    t.cluster.stop_all().await;
}
