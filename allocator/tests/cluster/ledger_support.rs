//! A loopback cluster of complete allocator nodes ([`Daemon`]: the real [`Ledger`], the
//! `allot.v1.Allocator` API and Raft on one gRPC port), and gRPC helpers to drive it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::daemon::{Daemon, DaemonConfig};
use allot_allocator::ledger::Ledger;
use allot_allocator::raft::{
    GroupCommitConfig, NodeClock, NodeConfig, RaftTimings, SystemNodeClock,
};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Upper bound for any wait on cluster progress. Generous because the machine running the
/// tests may be shared and overloaded; a healthy run needs a small fraction of it.
pub const WAIT: Duration = Duration::from_secs(30);

/// Serialises the tests that run real-ledger clusters: run concurrently on a small machine,
/// their nodes starve each other's heartbeats into spurious elections.
static EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Holds the cluster tests' lock for as long as the guard lives.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    EXCLUSIVE.lock().await
}

/// Short timings for a fast failover, with an election timeout well above the heartbeat so a
/// loaded machine does not depose healthy leaders; snapshots now and then so restarts also go
/// through them.
pub fn timings() -> RaftTimings {
    RaftTimings {
        heartbeat_ms: 60,
        election_timeout_min_ms: 500,
        election_timeout_max_ms: 1000,
        snapshot_every_logs: 200,
        stagger_snapshots: true,
        logs_kept_after_snapshot: 50,
    }
}

/// A policy without regional shares: rate 100 tokens/s, burst 50, grants of at most 10 tokens.
pub const API_POLICY: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 100
      burst: 50
      name: api-tenant
      lease: {ttl_ms: 1000, max_grant: 10, max_drift_ms: 100}
";
/// `API_POLICY`'s burst B, microtokens.
pub const API_BURST: u64 = 50_000_000;
/// `API_POLICY`'s rate r, microtokens per second.
pub const API_RATE_PER_S: u64 = 100_000_000;

/// A policy with two regions sharing it half and half.
pub const REGIONAL_POLICY: &str = "domain: regional
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 100
      burst: 100
      name: regional-tenant
      lease: {ttl_ms: 1000, max_grant: 10, max_drift_ms: 100}
      regions:
        - {region: eu-west, share: \"50%\"}
        - {region: us-east, share: \"50%\"}
";

/// `domain` / tenant=`tenant`.
pub fn key(domain: &str, tenant: &str) -> pb::PolicyKey {
    pb::PolicyKey {
        domain: domain.into(),
        entries: vec![pb::DescriptorEntry {
            key: "tenant".into(),
            value: tenant.into(),
        }],
    }
}

/// An Acquire request for api/tenant=`tenant`.
pub fn acquire(tenant: &str, holder: &str, want: u64, request_id: &str) -> pb::AcquireRequest {
    pb::AcquireRequest {
        key: Some(key("api", tenant)),
        region: "eu-west".into(),
        holder: holder.into(),
        want,
        demand_per_s: 0,
        want_rate_per_s: 0,
        request_id: request_id.into(),
    }
}

/// The grant of an Acquire response, or a panic naming what came instead.
pub fn grant(r: pb::AcquireResponse) -> pb::Grant {
    match r.outcome {
        Some(pb::acquire_response::Outcome::Grant(g)) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// The leader hint of a "not the leader" status, if it is one.
pub fn leader_hint(s: &Status) -> Option<pb::LeaderHint> {
    allot_proto::error_detail::leader_hint(s)
}

/// Whether a failed call may succeed on another node or later (leader lost, node down).
pub fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Cancelled | Code::Unknown
    ) || leader_hint(s).is_some()
}

/// Complete nodes with fixed ids and addresses; their sled directories outlive restarts.
pub struct LedgerCluster {
    root: TempDir,
    /// Advertised (= listen) address of each node.
    pub addrs: BTreeMap<u64, String>,
    /// Running nodes.
    pub daemons: BTreeMap<u64, Daemon>,
    /// Group commit settings of every node.
    commit: GroupCommitConfig,
    /// Each node's clocks (the system clocks for a node not listed), kept across restarts.
    clocks: BTreeMap<u64, Arc<dyn NodeClock>>,
}

impl LedgerCluster {
    /// Starts nodes `ids` on ephemeral loopback ports and initialises them as one cluster
    /// through the gRPC API of the first.
    pub async fn start(ids: &[u64]) -> Self {
        Self::start_with(ids, GroupCommitConfig::default()).await
    }

    /// [`LedgerCluster::start`] with these group commit settings on every node.
    pub async fn start_with(ids: &[u64], commit: GroupCommitConfig) -> Self {
        Self::start_with_clocks(ids, commit, BTreeMap::new()).await
    }

    /// [`LedgerCluster::start_with`] where node `id` reads `clocks[id]` (wall and monotonic)
    /// instead of the system clocks, also after a restart.
    pub async fn start_with_clocks(
        ids: &[u64],
        commit: GroupCommitConfig,
        clocks: BTreeMap<u64, Arc<dyn NodeClock>>,
    ) -> Self {
        let mut listeners = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for &id in ids {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            addrs.insert(id, l.local_addr().expect("addr").to_string());
            listeners.insert(id, l);
        }
        let mut c = Self {
            root: tempfile::tempdir().expect("tempdir"),
            addrs,
            daemons: BTreeMap::new(),
            commit,
            clocks,
        };
        for (id, l) in listeners {
            c.spawn(id, l).await;
        }
        let members = c
            .addrs
            .iter()
            .map(|(&node_id, addr)| pb::Member {
                node_id,
                addr: addr.clone(),
            })
            .collect();
        c.client(ids[0])
            .cluster_init(pb::ClusterInitRequest { members })
            .await
            .expect("cluster init over gRPC");
        c
    }

    fn dir(&self, id: u64) -> PathBuf {
        self.root.path().join(format!("node-{id}"))
    }

    async fn spawn(&mut self, id: u64, listener: TcpListener) {
        let config = DaemonConfig {
            node: NodeConfig {
                id,
                advertise_addr: self.addrs[&id].clone(),
                data_dir: self.dir(id),
                cluster_name: "ledger-test".into(),
                timings: timings(),
            },
            members: self.addrs.clone(),
            init: false,
            tick_every: Duration::from_millis(100),
            policies: Vec::new(),
        };
        let commit = Some(self.commit.clone());
        let clock = self
            .clocks
            .get(&id)
            .cloned()
            .unwrap_or_else(|| Arc::new(SystemNodeClock));
        let d = Daemon::start_with(config, clock, listener, commit)
            .await
            .expect("start node");
        self.daemons.insert(id, d);
    }

    /// A gRPC client of node `id` (connects lazily, so a stopped node answers UNAVAILABLE).
    pub fn client(&self, id: u64) -> AllocatorClient<Channel> {
        client_of(&self.addrs[&id])
    }

    /// Restarts node `id` on its old address and data directory.
    pub async fn restart(&mut self, id: u64) {
        assert!(!self.daemons.contains_key(&id), "node {id} is running");
        let l = TcpListener::bind(&self.addrs[&id]).await.expect("rebind");
        self.spawn(id, l).await;
    }

    /// Stops node `id` gracefully (Raft, server, flush); its data stays on disk.
    pub async fn stop(&mut self, id: u64) {
        let d = self.daemons.remove(&id).expect("running node");
        d.shutdown().await.expect("clean shutdown");
    }

    /// Stops every running node.
    pub async fn stop_all(&mut self) {
        let ids: Vec<u64> = self.daemons.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }

    /// Waits until every running node names the same running leader; returns it.
    pub async fn leader(&self) -> u64 {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen: Vec<Option<u64>> = self
                .daemons
                .values()
                .map(|d| d.node().raft().metrics().borrow().current_leader)
                .collect();
            if let Some(Some(l)) = seen.first() {
                if self.daemons.contains_key(l) && seen.iter().all(|s| *s == Some(*l)) {
                    return *l;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no agreed leader in time: {seen:?}"
            );
            let mut m = self
                .daemons
                .values()
                .next()
                .expect("a node")
                .node()
                .raft()
                .metrics();
            let _ = tokio::time::timeout(Duration::from_millis(50), m.changed()).await;
        }
    }

    /// Lets node `id` start elections (`true`, the default) or not: with only one running node
    /// allowed, a test decides who leads next once the leader is stopped.
    pub fn allow_election(&self, id: u64, allowed: bool) {
        self.daemons[&id]
            .node()
            .raft()
            .runtime_config()
            .elect(allowed);
    }

    /// A node other than the leader.
    pub async fn follower(&self) -> u64 {
        let leader = self.leader().await;
        *self
            .daemons
            .keys()
            .find(|&&id| id != leader)
            .expect("a follower")
    }

    /// Reads node `id`'s applied ledger after it applied everything the leader had committed.
    pub async fn ledger<R>(&self, id: u64, f: impl FnOnce(&Ledger) -> R) -> R {
        let deadline = tokio::time::Instant::now() + WAIT;
        let leader = loop {
            let leader = self.leader().await;
            // A leader may miss a quorum round on a loaded machine: ask again.
            match self.daemons[&leader].node().ensure_linearizable().await {
                Ok(()) => break leader,
                Err(e) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "no linearizable read in time: {e}"
                ),
            }
        };
        let index = self.daemons[&leader]
            .node()
            .state()
            .last_applied_index()
            .unwrap_or(0);
        self.daemons[&id]
            .node()
            .raft()
            .wait(Some(WAIT))
            .applied_index_at_least(Some(index), "catch up")
            .await
            .expect("replica catches up");
        self.daemons[&id].node().state().read(f)
    }
}

/// A lazily connecting client of `addr`.
pub fn client_of(addr: &str) -> AllocatorClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("valid address")
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    AllocatorClient::new(ch)
}
