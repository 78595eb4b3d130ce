//! The allocator's gRPC API (`allot.v1.Allocator`): translates requests into ledger commands,
//! commits them through Raft and answers after commit.
//!
//! Writes go through the node's group commit ([`GroupCommit`], issue 9 item 3): commands of
//! concurrent calls share one Raft entry. `Batch` carries many lease items of one agent in one
//! call, answered item by item in order (a refused item gets an [`pb::ErrorDetail`]; the other
//! items are unaffected). Under overload a call is refused at once, unapplied: a unary call with
//! RESOURCE_EXHAUSTED and an ErrorDetail OVERLOADED in the status details, each Batch item with
//! that ErrorDetail; while the queue is nearly full, an agent's write (a Batch too) is refused
//! that way as a whole, before its body is decoded ([`Shed`]). The caller's `grpc-timeout`
//! travels with its commands: those still queued when it passes are dropped unapplied
//! (DEADLINE_EXCEEDED, the same way).
//!
//! A follower forwards writes, Batch and status reads to the leader once (marked with
//! [`FORWARDED_HEADER`], so a call is never forwarded twice, and with the caller's remaining
//! deadline); when it cannot, it answers FAILED_PRECONDITION with a NOT_LEADER ErrorDetail
//! (leader id and address) in the status details, or UNAVAILABLE while no leader is known.
//! A refused unary call gets the gRPC code of its [`LedgerError`] with the machine-readable
//! [`pb::ErrorDetail`] in the status details ([`allot_proto::error_detail`]: a
//! `google.rpc.Status` holding it), and changes nothing; a refused Batch item gets the same
//! detail as its result.
//!
//! One file per audience and concern (issue 11 item 3); this parent holds the service, its
//! commit path and the tonic trait, which hands each RPC to its audience:
//! - `data_plane`: the agents' calls: Acquire, Report, Release, Decide, Batch and Status;
//! - `admin`: the operators' calls: policies, shares, cluster membership and status;
//! - `forward`: a follower forwarding a call to the leader once;
//! - `convert`: pb ↔ ledger conversion;
//! - `errors`: every error on the wire, with the one mapping of a [`LedgerError`];
//! - `deadline`: the caller's `grpc-timeout`;
//! - `shed`: refusing the agents' writes from their headers while the commit queue is nearly
//!   full (load shedding before decoding).

mod admin;
mod convert;
mod data_plane;
mod deadline;
mod errors;
mod forward;
mod shed;

pub use convert::policy_key;
pub use data_plane::MAX_BATCH_ITEMS;
pub use deadline::{deadline_of, parse_grpc_timeout};
pub use errors::ledger_error;
pub use forward::FORWARDED_HEADER;
pub use shed::{LeaderShedding, Shed};

#[cfg(doc)]
use crate::ledger::LedgerError;
use crate::ledger::{Command, Ledger, Response as LResp};
use crate::raft::{ChannelFactory, ClientError, CommitError, GroupCommit, LazyTcpChannels, Node};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use allot_proto::allot::v1::allocator_server::{Allocator, AllocatorServer};
use errors::{commit_status, unexpected};
use forward::{forward_request, forwarded};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// A client of another allocator node (the leader a follower forwards to).
type Client = AllocatorClient<Channel>;

/// The `allot.v1.Allocator` service of one node.
pub struct AllocatorService {
    node: Arc<Node<Ledger>>,
    /// Channels to the leader for forwarded calls, by address.
    channels: Mutex<HashMap<String, Channel>>,
    /// Makes those channels (plain TCP unless told: [`AllocatorService::with_channels`]).
    connect: Arc<dyn ChannelFactory>,
    /// `None`: every write is its own Raft entry (the unbatched path, kept for comparison).
    commit: Option<GroupCommit<Ledger>>,
    /// Set when the leader refused a write this node forwarded OVERLOADED ([`Shed`]).
    leader_shedding: Arc<LeaderShedding>,
}

impl AllocatorService {
    /// A service committing through `node`'s group commit `commit` (or, with `None`, one entry
    /// per write). Status reads are computed at the stamp a write would get now (the node's
    /// ledger time, never ahead of real time: see [`crate::raft::ledger_time`]).
    pub fn new(node: Arc<Node<Ledger>>, commit: Option<GroupCommit<Ledger>>) -> Self {
        let hold = commit
            .as_ref()
            .map_or(std::time::Duration::ZERO, |c| c.follower_shed_hold());
        AllocatorService {
            node,
            channels: Mutex::new(HashMap::new()),
            connect: Arc::new(LazyTcpChannels {
                connect_timeout: std::time::Duration::from_secs(1),
            }),
            commit,
            leader_shedding: Arc::new(LeaderShedding::new(hold)),
        }
    }

    /// The same service reaching the leader through `connect` (a simulated network, issue 12).
    #[must_use]
    pub fn with_channels(mut self, connect: Arc<dyn ChannelFactory>) -> Self {
        self.connect = connect;
        self
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> AllocatorServer<Self> {
        AllocatorServer::new(self)
    }

    /// This service as routes to pass to [`Node::serve`], next to the Raft service, behind the
    /// load-shedding gate of its group commit ([`Shed`]).
    pub fn into_routes(self) -> tonic::service::Routes {
        let (commit, leader) = (self.commit.clone(), self.leader_shedding.clone());
        tonic::service::Routes::new(Shed::new(self.into_server(), commit, leader))
    }

    /// Commits `cmds` in one entry (with other calls' commands when grouped) and returns their
    /// responses in order.
    async fn commit(
        &self,
        mut cmds: Vec<Command>,
        deadline: Option<Instant>,
    ) -> Result<Vec<LResp>, CommitError> {
        if let Some(g) = &self.commit {
            return g.submit(cmds, deadline).await;
        }
        if cmds.len() == 1 {
            let cmd = cmds.pop().ok_or(CommitError::DeadlineExceeded)?;
            return Ok(vec![self.node.propose(cmd).await?]);
        }
        match self.node.propose(Command::Batch(cmds)).await? {
            LResp::Batch(all) => Ok(all),
            other => Err(ClientError::Rejected(format!("a batch answered {other:?}")).into()),
        }
    }

    /// Commits `cmd`; on a follower, runs `forward` against the leader instead.
    async fn write<T, F, Fut>(
        &self,
        forwarded: bool,
        deadline: Option<Instant>,
        cmd: Command,
        forward: F,
    ) -> Result<Result<LResp, Response<T>>, Status>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        match self.commit(vec![cmd], deadline).await {
            Ok(mut r) => r
                .pop()
                .map(Ok)
                .ok_or_else(|| Status::internal("a committed write produced no response")),
            Err(CommitError::Client(ClientError::NotLeader {
                leader_id,
                leader_addr,
            })) => self
                .forward(forwarded, leader_id, leader_addr, forward)
                .await
                .map(Err),
            Err(e) => Err(commit_status(e)),
        }
    }

    /// One unary write (a lease item of the data plane, a policy or shares of the admin plane):
    /// `command` of the request's body committed through Raft and its ledger response turned
    /// into the answer by `answer`, or, on a follower, the body sent on to the
    /// leader by `forward` (with the caller's deadline) and the leader's answer returned.
    ///
    /// # Errors
    /// INVALID_ARGUMENT when the body has no key (`command` gives `None`); the commit's or the
    /// ledger's status otherwise.
    async fn unary_write<B, T, Fut>(
        &self,
        req: Request<B>,
        command: impl FnOnce(B) -> Option<Command>,
        forward: impl FnOnce(Client, Request<B>) -> Fut,
        answer: impl FnOnce(LResp) -> Result<T, LResp>,
    ) -> Result<Response<T>, Status>
    where
        B: Clone,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let body = req.into_inner();
        let cmd =
            command(body.clone()).ok_or_else(|| Status::invalid_argument("key is required"))?;
        let to_leader = |c| forward(c, forward_request(body, deadline));
        match self.write(fwd, deadline, cmd, to_leader).await? {
            Ok(r) => answer(r).map(Response::new).map_err(unexpected),
            Err(forwarded) => Ok(forwarded),
        }
    }
}

#[tonic::async_trait]
impl Allocator for AllocatorService {
    async fn acquire(
        &self,
        req: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        self.serve_acquire(req).await
    }

    async fn report(
        &self,
        req: Request<pb::ReportRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.serve_report(req).await
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.serve_release(req).await
    }

    async fn decide(
        &self,
        req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        self.serve_decide(req).await
    }

    async fn batch(
        &self,
        req: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        self.serve_batch(req).await
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.serve_status(req).await
    }

    async fn put_policy(
        &self,
        req: Request<pb::PutPolicyRequest>,
    ) -> Result<Response<pb::PutPolicyResponse>, Status> {
        self.serve_put_policy(req).await
    }

    async fn set_shares(
        &self,
        req: Request<pb::SetSharesRequest>,
    ) -> Result<Response<pb::SetSharesResponse>, Status> {
        self.serve_set_shares(req).await
    }

    async fn cluster_init(
        &self,
        req: Request<pb::ClusterInitRequest>,
    ) -> Result<Response<pb::ClusterInitResponse>, Status> {
        self.serve_cluster_init(req).await
    }

    async fn add_learner(
        &self,
        req: Request<pb::AddLearnerRequest>,
    ) -> Result<Response<pb::AddLearnerResponse>, Status> {
        self.serve_add_learner(req).await
    }

    async fn change_membership(
        &self,
        req: Request<pb::ChangeMembershipRequest>,
    ) -> Result<Response<pb::ChangeMembershipResponse>, Status> {
        self.serve_change_membership(req).await
    }

    async fn cluster_status(
        &self,
        req: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        self.serve_cluster_status(req).await
    }
}
