//! A loopback cluster of [`Node`]s running the test counter app.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::raft::test_app::{CounterApp, CounterCmd, CounterResponse};
use allot_allocator::raft::{ClientError, ManualNodeClock, Node, NodeConfig, RaftTimings};
use tempfile::TempDir;
use tokio::net::TcpListener;

/// Upper bound for any wait on cluster progress (elections, replication).
pub const WAIT: Duration = Duration::from_secs(10);

/// Short timings keep the test fast; snapshots every few entries with nothing kept behind them
/// make a lagging node catch up through InstallSnapshot.
pub fn timings() -> RaftTimings {
    RaftTimings {
        heartbeat_ms: 50,
        election_timeout_min_ms: 250,
        election_timeout_max_ms: 500,
        snapshot_every_logs: 8,
        stagger_snapshots: true,
        logs_kept_after_snapshot: 0,
    }
}

pub type TestNode = Node<CounterApp>;

/// Nodes with fixed ids and addresses; their sled directories outlive restarts.
pub struct Cluster {
    root: TempDir,
    /// Every node's timings ([`timings`] unless [`Cluster::start_with`] says otherwise).
    timings: RaftTimings,
    pub addrs: BTreeMap<u64, String>,
    pub nodes: BTreeMap<u64, TestNode>,
    pub clock: ManualNodeClock,
}

impl Cluster {
    /// Starts nodes `ids` on ephemeral loopback ports (not yet initialised).
    pub async fn start(ids: &[u64]) -> Self {
        Self::start_with(ids, timings()).await
    }

    /// [`Cluster::start`] with other Raft timings.
    pub async fn start_with(ids: &[u64], timings: RaftTimings) -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let mut cluster = Self {
            root,
            timings,
            addrs: BTreeMap::new(),
            nodes: BTreeMap::new(),
            clock: ManualNodeClock::new(1_000_000),
        };
        for &id in ids {
            cluster.start_new(id).await;
        }
        cluster
    }

    /// Starts a new node `id` on a fresh ephemeral port and an empty data directory.
    pub async fn start_new(&mut self, id: u64) {
        assert!(!self.addrs.contains_key(&id), "node {id} already exists");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        self.addrs.insert(id, addr);
        self.spawn(id, listener).await;
    }

    fn dir(&self, id: u64) -> PathBuf {
        self.root.path().join(format!("node-{id}"))
    }

    async fn spawn(&mut self, id: u64, listener: TcpListener) {
        let config = NodeConfig {
            id,
            advertise_addr: self.addrs[&id].clone(),
            data_dir: self.dir(id),
            cluster_name: "test".into(),
            timings: self.timings.clone(),
        };
        let node = Node::start_tcp(config, Arc::new(self.clock.clone()), listener)
            .await
            .expect("start node");
        self.nodes.insert(id, node);
    }

    /// Restarts node `id` on its old address and data directory.
    pub async fn restart(&mut self, id: u64) {
        assert!(!self.nodes.contains_key(&id), "node {id} is still running");
        let listener = TcpListener::bind(&self.addrs[&id]).await.expect("rebind");
        self.spawn(id, listener).await;
    }

    /// Stops node `id` (Raft and its server); its data stays on disk.
    pub async fn stop(&mut self, id: u64) {
        let node = self.nodes.remove(&id).expect("running node");
        node.shutdown().await.expect("clean shutdown");
    }

    /// Waits until every running node agrees on one running leader and returns its id.
    pub async fn leader(&self) -> u64 {
        let running: Vec<u64> = self.nodes.keys().copied().collect();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let mut seen = None;
            let mut agreed = true;
            for node in self.nodes.values() {
                let metrics = node
                    .raft()
                    .wait(Some(deadline - tokio::time::Instant::now()))
                    .metrics(
                        |m| m.current_leader.is_some_and(|l| running.contains(&l)),
                        "a running leader",
                    )
                    .await
                    .expect("a leader is elected in time");
                let leader = metrics.current_leader;
                if seen.is_some() && seen != leader {
                    agreed = false;
                }
                seen = leader;
            }
            if agreed {
                if let Some(leader) = seen {
                    return leader;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nodes never agreed on a leader"
            );
            // Nodes disagree while an election settles; wait for the next metrics change.
            let mut metrics = self.nodes.values().next().expect("a node").raft().metrics();
            let _ = tokio::time::timeout(Duration::from_millis(100), metrics.changed()).await;
        }
    }

    /// Proposes `cmd` on the leader, following NotLeader hints until [`WAIT`] runs out.
    pub async fn propose(&self, cmd: CounterCmd) -> CounterResponse {
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut target = self.leader().await;
        loop {
            match self.nodes[&target].propose(cmd.clone()).await {
                Ok(response) => return response,
                Err(ClientError::NotLeader {
                    leader_id: Some(next),
                    ..
                }) if self.nodes.contains_key(&next) => target = next,
                Err(ClientError::NotLeader { .. }) => target = self.leader().await,
                Err(e) => panic!("proposal failed: {e}"),
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no leader accepted the proposal in time"
            );
        }
    }

    /// Waits until every running node has applied at least `index`.
    pub async fn wait_applied(&self, index: u64) {
        for (id, node) in &self.nodes {
            node.raft()
                .wait(Some(WAIT))
                .applied_index_at_least(Some(index), format!("node {id} applies {index}"))
                .await
                .expect("replication catches up in time");
        }
    }

    /// Last applied index on node `id`.
    pub fn applied(&self, id: u64) -> u64 {
        self.nodes[&id].state().last_applied_index().unwrap_or(0)
    }

    /// Stops every running node.
    pub async fn stop_all(&mut self) {
        let ids: Vec<u64> = self.nodes.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }
}

/// Adds `by` to counter `key` with a one-hour time to live.
pub fn add(key: &str, by: u64) -> CounterCmd {
    CounterCmd::Add {
        key: key.into(),
        by,
        ttl_ms: 3_600_000,
    }
}
