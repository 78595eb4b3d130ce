//! One allocator node: sled storage, the Raft instance, its gRPC server (Raft plus any extra
//! services, such as the allocator API) and proposals.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use allot_proto::allot::v1::raft_service_server::RaftServiceServer;
use openraft::error::{
    CheckIsLeaderError, ClientWriteError, ForwardToLeader, InitializeError, RaftError,
};
use openraft::{BasicNode, Config, SnapshotPolicy};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tonic::service::Routes;
use tonic::transport::server::Connected;

use super::app::App;
use super::flush::Flush;
use super::group_commit::{Batching, GroupCommit, GroupCommitConfig};
use super::ledger_time::LedgerTime;
use super::log_store::SledLogStore;
use super::network_in::RaftServiceHandler;
use super::network_out::{ChannelFactory, GrpcNetworkFactory, LazyTcpChannels};
use super::node_clock::NodeClock;
use super::skew::{SkewCheck, SkewMonitor, SkewStatus};
use super::snapshot_schedule;
use super::state_machine::{SledStateMachine, StateMachineError, StateMachineHandle};
use super::types::typ::Raft;
use super::types::{AllotRaft, NodeId, Stamped};

/// Raft timing and log compaction settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaftTimings {
    /// Leader heartbeat period, ms.
    pub heartbeat_ms: u64,
    /// Lower bound of the randomised election timeout, ms; must exceed `heartbeat_ms`.
    pub election_timeout_min_ms: u64,
    /// Upper bound of the randomised election timeout, ms; must exceed the minimum.
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many entries since the last one.
    pub snapshot_every_logs: u64,
    /// Voters take turns to build their snapshots, a third of `snapshot_every_logs` apart in a
    /// cluster of three, instead of all at the same index ([`snapshot_schedule`]); off, openraft
    /// builds on every node at once (`SnapshotPolicy::LogsSinceLast`).
    ///
    /// [`snapshot_schedule`]: super::snapshot_schedule
    pub stagger_snapshots: bool,
    /// Entries kept in the log behind a snapshot, so slightly lagging followers catch up from
    /// the log instead of a snapshot.
    pub logs_kept_after_snapshot: u64,
}

impl Default for RaftTimings {
    fn default() -> Self {
        Self {
            heartbeat_ms: 150,
            election_timeout_min_ms: 750,
            election_timeout_max_ms: 1500,
            snapshot_every_logs: 5_000,
            stagger_snapshots: true,
            logs_kept_after_snapshot: 1_000,
        }
    }
}

/// How to start a [`Node`].
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's Raft id; unique in the cluster and stable across restarts.
    pub id: NodeId,
    /// Address ("host:port") peers use to reach this node's Raft service.
    pub advertise_addr: String,
    /// Directory of this node's sled database (created if missing) and of its state machine's
    /// snapshot file.
    pub data_dir: PathBuf,
    /// Name shared by all nodes of one cluster (appears in logs).
    pub cluster_name: String,
    /// Raft timings.
    pub timings: RaftTimings,
}

/// Why a node could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The sled database could not be opened (missing permissions, corrupt, or still locked by
    /// another process).
    #[error("cannot open sled database at {path}: {source}")]
    OpenDb {
        /// The data directory.
        path: PathBuf,
        /// sled's error.
        source: sled::Error,
    },
    /// The state machine could not be restored from its stored snapshot.
    #[error("cannot restore the state machine: {0}")]
    StateMachine(#[from] StateMachineError),
    /// The Raft timings are inconsistent (e.g. election timeout not above the heartbeat).
    #[error("invalid raft configuration: {0}")]
    Config(#[from] openraft::ConfigError),
    /// Raft stopped with a fatal error (usually a storage failure).
    #[error("raft stopped: {0}")]
    Fatal(String),
    /// The node could not be initialised as a new cluster.
    #[error("cannot initialise the cluster: {0}")]
    Initialize(String),
    /// The gRPC server ended with an error.
    #[error("raft server failed: {0}")]
    Server(String),
    /// Flushing the database on shutdown failed.
    #[error("cannot flush sled database: {0}")]
    Flush(sled::Error),
}

/// A node's opened sled database and how its stores flush: what [`Node::open_with_storage`]
/// runs on. [`Node::open`] opens `data_dir` itself with [`Flush::Background`]; a simulation
/// opens the database first (so a restart never waits on sled's lock in simulated time) and
/// flushes inline (issue 12 item 1).
#[derive(Debug, Clone)]
pub struct NodeStorage {
    /// The node's database.
    pub db: sled::Db,
    /// Where its stores flush.
    pub flush: Flush,
}

/// [`Node::serve`] was called on a node that already serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the node already serves")]
pub struct AlreadyServing;

/// Why a proposal did not produce a committed response.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// This node is not the leader; retry on the leader when it is known.
    #[error("not the leader; leader is {leader_id:?} at {leader_addr:?}")]
    NotLeader {
        /// The current leader's id, when known.
        leader_id: Option<NodeId>,
        /// The current leader's address ("host:port"), when known.
        leader_addr: Option<String>,
    },
    /// Raft stopped on this node (shut down or a fatal storage error); the entry may or may
    /// not have been committed.
    #[error("raft stopped: {0}")]
    Stopped(String),
    /// Raft rejected the write for another reason.
    #[error("raft rejected the write: {0}")]
    Rejected(String),
}

/// One running allocator node for application `A`.
pub struct Node<A: App> {
    id: NodeId,
    addr: String,
    raft: Raft<A>,
    state: StateMachineHandle<A>,
    /// Stamps proposals: this node's clocks bounded by what it applied (issue 10 item 2).
    time: Arc<LedgerTime>,
    skew: SkewMonitor,
    db: sled::Db,
    flush: Flush,
    server: Mutex<Option<Server>>,
    /// The task triggering this node's snapshots in its turn (when staggered).
    snapshots: Option<JoinHandle<()>>,
}

/// The running gRPC server of a node and the signal that stops it.
struct Server {
    task: JoinHandle<Result<(), tonic::transport::Error>>,
    stop: oneshot::Sender<()>,
}

impl<A: App> Node<A> {
    /// Starts a node serving Raft on `listener`, talking to peers over plain TCP.
    ///
    /// # Errors
    /// See [`Node::start`].
    pub async fn start_tcp(
        config: NodeConfig,
        clock: Arc<dyn NodeClock>,
        listener: TcpListener,
    ) -> Result<Self, NodeError> {
        // As the daemon: TCP_NODELAY on accepted sockets (tonic ignores its builder's setting
        // for a caller's incoming stream), so Raft answers are not held back by Nagle.
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        Self::start(
            config,
            clock,
            Arc::new(LazyTcpChannels::default()),
            incoming,
        )
        .await
    }

    /// Opens (or creates) the node's sled database in `config.data_dir`, restores its state,
    /// starts Raft, and serves `allot.v1.RaftService` on the connections of `incoming`. Peers
    /// are reached through `channels`. A restarted node with an existing database rejoins its
    /// cluster; a new one waits for [`Node::initialize`] or to be added by a leader.
    ///
    /// Equivalent to [`Node::open`] followed by [`Node::serve`] with no extra services.
    ///
    /// # Errors
    /// [`NodeError::OpenDb`], [`NodeError::StateMachine`] for unreadable storage,
    /// [`NodeError::Config`] for bad timings, [`NodeError::Fatal`] when Raft cannot start.
    pub async fn start<I, IO, IE>(
        config: NodeConfig,
        clock: Arc<dyn NodeClock>,
        channels: Arc<dyn ChannelFactory>,
        incoming: I,
    ) -> Result<Self, NodeError>
    where
        I: Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
    {
        let node = Self::open(config, clock, channels).await?;
        node.serve(incoming, Routes::default())
            .map_err(|e| NodeError::Server(e.to_string()))?;
        Ok(node)
    }

    /// Opens (or creates) the node's sled database, restores its state and starts Raft, without
    /// serving anything yet: call [`Node::serve`] next.
    ///
    /// The split lets services that need the node itself (the allocator API holds an
    /// `Arc<Node>`) be built after the node exists and still share its one gRPC server. Until
    /// `serve` runs, peers find this node unreachable, which Raft treats like a slow start.
    ///
    /// `clock` is this node's wall and monotonic time: the stamps it proposes follow its wall
    /// clock, held to the monotonic time elapsed since the stamps it applied
    /// ([`LedgerTime`], issue 10 item 2).
    ///
    /// # Errors
    /// As [`Node::start`].
    pub async fn open(
        config: NodeConfig,
        clock: Arc<dyn NodeClock>,
        channels: Arc<dyn ChannelFactory>,
    ) -> Result<Self, NodeError> {
        let db = open_db(&config.data_dir)
            .await
            .map_err(|source| NodeError::OpenDb {
                path: config.data_dir.clone(),
                source,
            })?;
        let storage = NodeStorage {
            db,
            flush: Flush::Background,
        };
        Self::open_with_storage(config, clock, channels, storage).await
    }

    /// [`Node::open`] on a database already opened (in `config.data_dir`, which also holds the
    /// state machine's snapshot file), its stores flushing the `storage.flush` way.
    ///
    /// # Errors
    /// As [`Node::open`].
    pub async fn open_with_storage(
        config: NodeConfig,
        clock: Arc<dyn NodeClock>,
        channels: Arc<dyn ChannelFactory>,
        storage: NodeStorage,
    ) -> Result<Self, NodeError> {
        let raft_config = Config {
            cluster_name: config.cluster_name.clone(),
            heartbeat_interval: config.timings.heartbeat_ms,
            election_timeout_min: config.timings.election_timeout_min_ms,
            election_timeout_max: config.timings.election_timeout_max_ms,
            snapshot_policy: if config.timings.stagger_snapshots {
                SnapshotPolicy::Never
            } else {
                SnapshotPolicy::LogsSinceLast(config.timings.snapshot_every_logs)
            },
            max_in_snapshot_log_to_keep: config.timings.logs_kept_after_snapshot,
            // Keeps every InstallSnapshot message far below the transport's message limit.
            snapshot_max_chunk_size: 1024 * 1024,
            ..Config::default()
        }
        .validate()?;

        let open_err = |source| NodeError::OpenDb {
            path: config.data_dir.clone(),
            source,
        };
        let NodeStorage { db, flush } = storage;
        let log_store = SledLogStore::<AllotRaft<A>>::open(&db)
            .map_err(open_err)?
            .with_flush(flush);
        let state_machine =
            SledStateMachine::<A>::open_with_clock(&db, &config.data_dir, clock)?.with_flush(flush);
        let state = state_machine.handle();
        let time = state_machine.ledger_time();
        let network = GrpcNetworkFactory::<A>::new(config.id, channels);

        let raft = openraft::Raft::new(
            config.id,
            Arc::new(raft_config),
            network,
            log_store,
            state_machine,
        )
        .await
        .map_err(|e| NodeError::Fatal(e.to_string()))?;
        let snapshots = config.timings.stagger_snapshots.then(|| {
            snapshot_schedule::spawn(raft.clone(), config.id, config.timings.snapshot_every_logs)
        });

        Ok(Self {
            id: config.id,
            addr: config.advertise_addr,
            raft,
            state,
            time,
            skew: SkewMonitor::default(),
            db,
            flush,
            server: Mutex::new(None),
            snapshots,
        })
    }

    /// Serves `allot.v1.RaftService` together with the services in `extra` on the connections
    /// of `incoming`, on one gRPC server, until [`Node::shutdown`]. Peers' advertised addresses
    /// are thereby also the addresses of the extra services (a leader hint names a usable
    /// client address).
    ///
    /// A service in `extra` that holds an `Arc` of this node keeps it alive while the server
    /// runs: stop such a node with [`Node::shutdown`], not by dropping it.
    ///
    /// # Errors
    /// [`AlreadyServing`] when the node already serves.
    pub fn serve<I, IO, IE>(&self, incoming: I, extra: Routes) -> Result<(), AlreadyServing>
    where
        I: Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
    {
        let mut slot = self.server.lock();
        if slot.is_some() {
            return Err(AlreadyServing);
        }
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let routes = extra.add_service(self.raft_service());
        let task = tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async {
                    // A dropped sender (node dropped without shutdown) also stops the server.
                    let _ = stop_rx.await;
                }),
        );
        *slot = Some(Server {
            task,
            stop: stop_tx,
        });
        Ok(())
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The address peers reach this node at ("host:port").
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The underlying openraft handle (metrics, membership changes, `wait()` helpers).
    pub fn raft(&self) -> &Raft<A> {
        &self.raft
    }

    /// A `RaftService` bound to this node's Raft, for serving it next to other services on one
    /// gRPC server.
    pub fn raft_service(&self) -> RaftServiceServer<RaftServiceHandler<A>> {
        RaftServiceHandler::new(self.raft.clone()).into_service()
    }

    /// Read access to the locally applied state (may lag the leader).
    pub fn state(&self) -> &StateMachineHandle<A> {
        &self.state
    }

    /// The current leader as known locally: id and address.
    pub fn leader(&self) -> Option<(NodeId, String)> {
        let metrics = self.raft.metrics().borrow().clone();
        let leader = metrics.current_leader?;
        let addr = metrics
            .membership_config
            .membership()
            .get_node(&leader)
            .map(|n| n.addr.clone())
            .unwrap_or_default();
        Some((leader, addr))
    }

    /// Whether this node already belongs to a cluster: it has log entries, a snapshot or a vote
    /// (so [`Node::initialize`] would be refused).
    ///
    /// # Errors
    /// [`NodeError::Fatal`] when Raft stopped.
    pub async fn is_initialized(&self) -> Result<bool, NodeError> {
        self.raft
            .is_initialized()
            .await
            .map_err(|e| NodeError::Fatal(e.to_string()))
    }

    /// Initialises a new cluster whose voters are `members` (id → address). Call on one node of
    /// a fresh cluster; calling again with the same members is harmless.
    ///
    /// # Errors
    /// [`NodeError::Initialize`] when the node already has log entries or a vote (the cluster
    /// exists), [`NodeError::Fatal`] when Raft stopped.
    pub async fn initialize(&self, members: BTreeMap<NodeId, String>) -> Result<(), NodeError> {
        let nodes: BTreeMap<NodeId, BasicNode> = members
            .into_iter()
            .map(|(id, addr)| (id, BasicNode::new(addr)))
            .collect();
        match self.raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotAllowed(e))) => {
                Err(NodeError::Initialize(e.to_string()))
            }
            Err(RaftError::APIError(InitializeError::NotInMembers(e))) => {
                Err(NodeError::Initialize(e.to_string()))
            }
            Err(RaftError::Fatal(e)) => Err(NodeError::Fatal(e.to_string())),
        }
    }

    /// Proposes `cmd` stamped with this node's ledger time ([`LedgerTime::stamp`]: its wall
    /// clock, never ahead of the real time elapsed since the stamps it applied, never behind
    /// the last one) and returns the application's response once the entry is committed and
    /// applied.
    ///
    /// # Errors
    /// [`ClientError::NotLeader`] (with the leader's id and address when known) if this node is
    /// not the leader, [`ClientError::Stopped`] if Raft stopped, [`ClientError::Rejected`]
    /// otherwise.
    pub async fn propose(&self, cmd: A::Command) -> Result<A::Response, ClientError> {
        let entry = Stamped {
            now_ms: self.time.stamp(),
            cmd,
        };
        let response = self.raft.client_write(entry).await.map_err(write_error)?;
        response.data.ok_or_else(|| {
            ClientError::Rejected("an application entry produced no response".into())
        })
    }

    /// Starts group commit for this node (issue 9 item 3): commands submitted to the returned
    /// queue from any number of concurrent callers are proposed together, one batch command per
    /// entry, stamped with this node's ledger time as [`Node::propose`] does. See [`GroupCommit`] for the flushing, overload
    /// and deadline rules. Proposals through [`Node::propose`] stay unbatched. Must be called
    /// inside a tokio runtime; the flusher stops when the last clone of the queue is dropped.
    pub fn group_commit(&self, config: GroupCommitConfig) -> GroupCommit<A>
    where
        A: Batching,
    {
        GroupCommit::start(self.raft.clone(), self.time.clone(), config)
    }

    /// This node's view of ledger time: the stamps it proposes and its clock skew.
    pub fn ledger_time(&self) -> &LedgerTime {
        &self.time
    }

    /// Measures this node's clock skew against ledger time now and records it in
    /// [`Node::clock_skew`]; warns (at most once per [`super::skew::WARN_EVERY_NS`]) when it
    /// exceeds `max_ms`, the drift the policies in force allow. Call it periodically.
    pub fn check_clock_skew(&self, max_ms: u64) -> SkewCheck {
        self.skew.check(&self.time, max_ms)
    }

    /// The last measured clock skew and how many checks found it beyond the allowed drift.
    pub fn clock_skew(&self) -> SkewStatus {
        self.skew.status()
    }

    /// Adds node `id` reachable at `addr` ("host:port") as a learner (a non-voting member that
    /// replicates the log). With `wait_caught_up`, returns only once the learner has caught up
    /// with the leader's log. Returns the log index of the membership entry.
    ///
    /// # Errors
    /// [`ClientError::NotLeader`] on a follower, [`ClientError::Rejected`] when a membership
    /// change is already in progress, [`ClientError::Stopped`] if Raft stopped.
    pub async fn add_learner(
        &self,
        id: NodeId,
        addr: String,
        wait_caught_up: bool,
    ) -> Result<u64, ClientError> {
        let response = self
            .raft
            .add_learner(id, BasicNode::new(addr), wait_caught_up)
            .await
            .map_err(write_error)?;
        Ok(response.log_id.index)
    }

    /// Makes `voters` the voting members (each must already be a member, e.g. a learner).
    /// With `retain`, removed voters stay as learners. Returns the log index of the final
    /// membership entry.
    ///
    /// # Errors
    /// [`ClientError::NotLeader`] on a follower, [`ClientError::Rejected`] for an unknown node
    /// or an empty voter set, [`ClientError::Stopped`] if Raft stopped.
    pub async fn change_membership(
        &self,
        voters: BTreeSet<NodeId>,
        retain: bool,
    ) -> Result<u64, ClientError> {
        let response = self
            .raft
            .change_membership(voters, retain)
            .await
            .map_err(write_error)?;
        Ok(response.log_id.index)
    }

    /// Confirms this node is still the leader (a heartbeat round with a quorum) and waits until
    /// its state machine has applied everything committed before the call, so that a following
    /// [`Node::state`] read is linearizable.
    ///
    /// # Errors
    /// [`ClientError::NotLeader`] on a follower or a deposed leader, [`ClientError::Rejected`]
    /// when no quorum answered, [`ClientError::Stopped`] if Raft stopped.
    pub async fn ensure_linearizable(&self) -> Result<(), ClientError> {
        match self.raft.ensure_linearizable().await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(forward))) => {
                Err(not_leader(forward))
            }
            Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e))) => {
                Err(ClientError::Rejected(e.to_string()))
            }
            Err(RaftError::Fatal(e)) => Err(ClientError::Stopped(e.to_string())),
        }
    }

    /// Stops Raft and the server, then flushes the database. Data stays on disk for a restart.
    /// Call it once; a second call reports Raft as already stopped.
    ///
    /// # Errors
    /// [`NodeError::Fatal`] if Raft had already failed, [`NodeError::Server`] if the server
    /// ended with an error, [`NodeError::Flush`] if the final flush failed. The node is stopped
    /// in every case.
    pub async fn shutdown(&self) -> Result<(), NodeError> {
        if let Some(task) = &self.snapshots {
            task.abort();
        }
        // Raft first: proposals still waiting for a commit fail now instead of holding their
        // gRPC calls (and with them the server's graceful drain) open.
        let raft_result = self.raft.shutdown().await;
        let server = self.server.lock().take();
        let server_result = match server {
            Some(Server { task, stop }) => {
                let _ = stop.send(());
                match task.await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(NodeError::Server(e.to_string())),
                    Err(e) => Err(NodeError::Server(e.to_string())),
                }
            }
            None => Ok(()),
        };
        self.flush.run(&self.db).await.map_err(NodeError::Flush)?;
        raft_result.map_err(|e| NodeError::Fatal(e.to_string()))?;
        server_result
    }
}

/// How long [`open_db`] waits for a previous holder to release the database lock.
pub const DB_LOCK_WAIT: Duration = Duration::from_secs(10);

/// Opens the sled database at `path`, waiting up to [`DB_LOCK_WAIT`] while its file lock is
/// still held.
///
/// sled releases the lock only when its last background thread lets go of the database, a
/// moment after the handle is dropped, so reopening in the same process right after a shutdown
/// (a restart in tests or in a simulation) can find it still locked.
///
/// # Errors
/// sled's error when the database cannot be opened, including a lock still held after
/// [`DB_LOCK_WAIT`] (another process uses the directory).
pub async fn open_db(path: &Path) -> Result<sled::Db, sled::Error> {
    let deadline = tokio::time::Instant::now() + DB_LOCK_WAIT;
    loop {
        match sled::Config::new().path(path).open() {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            result => return result,
        }
    }
}

fn not_leader(forward: ForwardToLeader<NodeId, BasicNode>) -> ClientError {
    ClientError::NotLeader {
        leader_id: forward.leader_id,
        leader_addr: forward.leader_node.map(|n| n.addr),
    }
}

/// Classifies a failed client write.
pub(super) fn write_error(
    e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>,
) -> ClientError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => not_leader(forward),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
            ClientError::Rejected(e.to_string())
        }
        RaftError::Fatal(e) => ClientError::Stopped(e.to_string()),
    }
}

impl<A: App> Drop for Node<A> {
    fn drop(&mut self) {
        // Without an async drop, a node dropped without shutdown() at least stops serving, and
        // its snapshot task lets go of the Raft handle (so openraft's core can stop).
        if let Some(server) = self.server.lock().take() {
            server.task.abort();
        }
        if let Some(task) = &self.snapshots {
            task.abort();
        }
    }
}
