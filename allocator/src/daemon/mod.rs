//! One complete allocator node as the `allot-allocator` binary runs it: the Raft [`Node`] over
//! the [`Ledger`], the `allot.v1.Allocator` API on the same gRPC server as Raft, the leader's
//! [`ticker`], the [`skew_watch`] clock check, the [`policy_files`] installer and the release of freed heap
//! memory ([`heap::spawn_release`]). Tests and benchmarks start the same thing.

pub mod config_file;
pub mod policy_files;
pub mod skew_watch;
pub mod ticker;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tonic::transport::server::Connected;

use crate::heap;
use crate::ledger::Ledger;
use crate::raft::{
    ChannelFactory, Flush, GroupCommit, GroupCommitConfig, LazyTcpChannels, Node, NodeClock,
    NodeConfig, NodeError, NodeId, NodeStorage,
};
use crate::service::AllocatorService;
pub use policy_files::{load_policy_files, PolicyFile, PolicyFilesError};

/// How to start a [`Daemon`].
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// The Raft node: id, advertised address, data directory, timings.
    pub node: NodeConfig,
    /// The cluster's voters (id → advertised "host:port"), this node included; used by `init`.
    pub members: BTreeMap<NodeId, String>,
    /// Initialise a new cluster of `members` when this node's log is empty.
    pub init: bool,
    /// Period of the leader's `Tick` proposals, and of every node's clock skew check.
    pub tick_every: Duration,
    /// Policy documents to install when this node first leads (see
    /// [`policy_files::spawn_installer`]).
    pub policies: Vec<PolicyFile>,
}

/// The transport and storage a [`Daemon`] runs on: TCP and `data_dir` in production
/// ([`Daemon::start_with`]), a simulated network and a pre-opened database in a simulation
/// (issue 12 item 1).
pub struct DaemonIo<I> {
    /// Connections to serve Raft and the allocator API on.
    pub incoming: I,
    /// How to reach peers (Raft) and the leader (forwarded calls).
    pub channels: Arc<dyn ChannelFactory>,
    /// The opened database and its flush mode; `None` opens `data_dir` with background flushes.
    pub storage: Option<NodeStorage>,
}

/// Why a [`Daemon`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The Raft node failed to open, serve or initialise.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// A running allocator node. Stop it with [`Daemon::shutdown`].
pub struct Daemon {
    node: Arc<Node<Ledger>>,
    commit: Option<GroupCommit<Ledger>>,
    tasks: Vec<JoinHandle<()>>,
    /// The start-up policy installer (see [`policy_files::spawn_installer`]).
    installer: JoinHandle<()>,
    /// The install of the last SIGHUP, if any ([`Daemon::reinstall_policies`]).
    install_now: Option<JoinHandle<()>>,
}

impl Daemon {
    /// Opens the node's storage, starts Raft, serves Raft and the allocator API on `listener`,
    /// initialises the cluster if asked and the log is empty, and starts the ticker, the clock
    /// skew check and the policy installer. `clock` (wall and monotonic) bounds the stamps of
    /// proposals (see [`crate::raft::ledger_time`]), which status reads are computed at.
    ///
    /// # Errors
    /// [`DaemonError::Config`] when `init` is set but this node is not among `members` or the
    /// tick period is zero; [`DaemonError::Node`] when storage, Raft or the server fail.
    pub async fn start(
        config: DaemonConfig,
        clock: Arc<dyn NodeClock>,
        listener: TcpListener,
    ) -> Result<Self, DaemonError> {
        Self::start_with(config, clock, listener, Some(GroupCommitConfig::default())).await
    }

    /// [`Daemon::start`] with explicit group commit settings for the API's writes: `None`
    /// proposes every write as its own Raft entry (the unbatched path, for comparison).
    ///
    /// # Errors
    /// As [`Daemon::start`].
    pub async fn start_with(
        config: DaemonConfig,
        clock: Arc<dyn NodeClock>,
        listener: TcpListener,
        group_commit: Option<GroupCommitConfig>,
    ) -> Result<Self, DaemonError> {
        let io = DaemonIo {
            // tonic ignores its builder's `tcp_nodelay` for a caller's incoming stream: set it
            // on the accepted sockets, or Nagle's algorithm delays small answers to agents.
            incoming: tonic::transport::server::TcpIncoming::from(listener)
                .with_nodelay(Some(true)),
            channels: Arc::new(LazyTcpChannels::default()),
            storage: None,
        };
        Self::start_on(config, clock, io, group_commit).await
    }

    /// [`Daemon::start_with`] on any transport and storage ([`DaemonIo`]).
    ///
    /// # Errors
    /// As [`Daemon::start`].
    pub async fn start_on<I, IO, IE>(
        config: DaemonConfig,
        clock: Arc<dyn NodeClock>,
        io: DaemonIo<I>,
        group_commit: Option<GroupCommitConfig>,
    ) -> Result<Self, DaemonError>
    where
        I: Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
    {
        if config.tick_every.is_zero() {
            return Err(DaemonError::Config("the tick period must be > 0".into()));
        }
        let id = config.node.id;
        if config.init && !config.members.contains_key(&id) {
            return Err(DaemonError::Config(format!(
                "node {id} initialises the cluster but is not among its members"
            )));
        }
        let DaemonIo {
            incoming,
            channels,
            storage,
        } = io;
        let blocking = storage.as_ref().map_or(Flush::Background, |s| s.flush);
        let node = match storage {
            Some(storage) => {
                Node::open_with_storage(config.node, clock, channels.clone(), storage).await?
            }
            None => Node::open(config.node, clock, channels.clone()).await?,
        };
        let node = Arc::new(node);
        let commit = group_commit.map(|c| node.group_commit(c));
        let api = AllocatorService::new(node.clone(), commit.clone()).with_channels(channels);
        // A node opened just above cannot be serving already; the check is the node's own.
        if let Err(e) = node.serve(incoming, api.into_routes()) {
            let _ = node.shutdown().await;
            return Err(NodeError::Server(e.to_string()).into());
        }

        // Asked of Raft's own state: the metrics are published a moment after start and would
        // still show an empty log on a restarted node.
        let fresh = if config.init {
            match node.is_initialized().await {
                Ok(initialized) => !initialized,
                Err(e) => {
                    let _ = node.shutdown().await;
                    return Err(e.into());
                }
            }
        } else {
            false
        };
        if fresh {
            // Another member may have initialised the same cluster already; openraft accepts
            // identical initialisations, and refuses others without harm.
            match node.initialize(config.members.clone()).await {
                Ok(()) => tracing::info!(members = ?config.members, "cluster initialised"),
                Err(e) => tracing::warn!(error = %e, "cluster not initialised"),
            }
        } else if config.init {
            tracing::info!("log is not empty: the cluster exists, --init ignored");
        }

        let tasks = vec![
            ticker::spawn_ticker(node.clone(), config.tick_every),
            skew_watch::spawn_skew_watch(node.clone(), config.tick_every),
            heap::spawn_release(heap::RELEASE_EVERY, blocking),
        ];
        let installer = policy_files::spawn_installer(node.clone(), config.policies);
        Ok(Self {
            node,
            commit,
            tasks,
            installer,
            install_now: None,
        })
    }

    /// The Raft node (metrics, local state, proposals).
    pub fn node(&self) -> &Arc<Node<Ledger>> {
        &self.node
    }

    /// Makes `files` the policy folder's desired state again (the operator's SIGHUP after
    /// editing it). While the start-up installer still waits for this node to lead, it waits on
    /// with `files` instead of the folder as it was at start; after that, `files` are installed
    /// now if this node leads and ignored (logged) if it does not
    /// ([`policy_files::spawn_install_now`]). Documents deleted from the folder stay in force.
    pub fn reinstall_policies(&mut self, files: Vec<PolicyFile>) {
        if !self.installer.is_finished() {
            tracing::info!(
                "this node has not led since it started: the folder as read now is installed \
                 when it first leads"
            );
            self.installer.abort();
            self.installer = policy_files::spawn_installer(self.node.clone(), files);
            return;
        }
        if let Some(previous) = self.install_now.take() {
            previous.abort();
        }
        self.install_now = Some(policy_files::spawn_install_now(self.node.clone(), files));
    }

    /// The group commit of the API's writes (`None` when every write is its own entry).
    pub fn group_commit(&self) -> Option<&GroupCommit<Ledger>> {
        self.commit.as_ref()
    }

    /// Stops the background tasks, Raft and the server, then flushes the database.
    ///
    /// # Errors
    /// As [`Node::shutdown`].
    pub async fn shutdown(self) -> Result<(), NodeError> {
        self.installer.abort();
        let _ = self.installer.await;
        if let Some(t) = self.install_now {
            t.abort();
            let _ = t.await;
        }
        for task in &self.tasks {
            task.abort();
        }
        for task in self.tasks {
            let _ = task.await;
        }
        self.node.shutdown().await
    }
}
