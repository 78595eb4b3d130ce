//! The allocator's gRPC API (`allot.v1.Allocator`): translates requests into ledger commands,
//! commits them through Raft and answers after commit.
//!
//! Writes go through the node's group commit ([`GroupCommit`], issue 9 item 3): commands of
//! concurrent calls share one Raft entry. `Batch` carries many lease items of one agent in one
//! call, answered item by item in order (a refused item gets an [`pb::ErrorDetail`]; the other
//! items are unaffected). Under overload a call is refused at once, unapplied: a unary call with
//! RESOURCE_EXHAUSTED and an ErrorDetail OVERLOADED in the status details, each Batch item with
//! that ErrorDetail. The caller's `grpc-timeout` travels with its commands: those still queued
//! when it passes are dropped unapplied (DEADLINE_EXCEEDED, the same way).
//!
//! A follower forwards writes, Batch and status reads to the leader once (marked with
//! [`FORWARDED_HEADER`], so a call is never forwarded twice, and with the caller's remaining
//! deadline); when it cannot, it answers FAILED_PRECONDITION with a NOT_LEADER ErrorDetail
//! (leader id and address) in the status details, or UNAVAILABLE while no leader is known.
//! A refused unary call gets the gRPC code of its [`LedgerError`] with the machine-readable
//! [`pb::ErrorDetail`] in the status details ([`allot_proto::error_detail`]: a
//! `google.rpc.Status` holding it), and changes nothing; a refused Batch item gets the same
//! detail as its result.

mod deadline;
mod errors;
mod items;

pub use deadline::{deadline_of, parse_grpc_timeout};
pub use errors::ledger_error;

use crate::ledger::{self, Command, Ledger, LedgerError, Response as LResp};
use crate::raft::{ClientError, CommitError, GroupCommit, Node};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use allot_proto::allot::v1::allocator_server::{Allocator, AllocatorServer};
use allot_proto::error_detail;
use errors::detail;
use items::{item_command, item_result};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Metadata header set on a call a follower forwarded to the leader.
pub const FORWARDED_HEADER: &str = "x-allot-forwarded";

/// How long a forwarded call may take.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// Most items in one `Batch` call; a larger call is INVALID_ARGUMENT.
pub const MAX_BATCH_ITEMS: usize = 4_096;

/// The `allot.v1.Allocator` service of one node.
pub struct AllocatorService {
    node: Arc<Node<Ledger>>,
    channels: Mutex<HashMap<String, Channel>>,
    /// `None`: every write is its own Raft entry (the unbatched path, kept for comparison).
    commit: Option<GroupCommit<Ledger>>,
}

impl AllocatorService {
    /// A service committing through `node`'s group commit `commit` (or, with `None`, one entry
    /// per write). Status reads are computed at the stamp a write would get now (the node's
    /// ledger time, never ahead of real time: see [`crate::raft::ledger_time`]).
    pub fn new(node: Arc<Node<Ledger>>, commit: Option<GroupCommit<Ledger>>) -> Self {
        AllocatorService {
            node,
            channels: Mutex::new(HashMap::new()),
            commit,
        }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> AllocatorServer<Self> {
        AllocatorServer::new(self)
    }

    /// This service as routes to pass to [`Node::serve`], next to the Raft service.
    pub fn into_routes(self) -> tonic::service::Routes {
        tonic::service::Routes::new(self.into_server())
    }

    fn client(&self, addr: &str) -> Result<AllocatorClient<Channel>, Status> {
        let mut m = self.channels.lock();
        if let Some(c) = m.get(addr) {
            return Ok(AllocatorClient::new(c.clone()));
        }
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::internal(format!("bad leader address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(1))
            .timeout(FORWARD_TIMEOUT);
        let ch = ep.connect_lazy();
        m.insert(addr.to_string(), ch.clone());
        Ok(AllocatorClient::new(ch))
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

    /// On a follower: runs `forward` against the leader once, or answers where the leader is.
    async fn forward<T, F, Fut>(
        &self,
        forwarded: bool,
        leader_id: Option<u64>,
        leader_addr: Option<String>,
        forward: F,
    ) -> Result<Response<T>, Status>
    where
        F: FnOnce(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let leader_addr = leader_addr.filter(|a| !a.is_empty());
        // A call forwarded once is not forwarded again (no loops while leadership moves); its
        // caller still learns where the leader is.
        let Some(addr) = leader_addr.clone().filter(|_| !forwarded) else {
            return Err(not_leader(leader_id, leader_addr));
        };
        match forward(self.client(&addr)?).await {
            Err(s) if s.code() == Code::Unavailable => Err(not_leader(leader_id, Some(addr))),
            other => other,
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
        F: FnOnce(AllocatorClient<Channel>) -> Fut,
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

    /// Answers one Batch call: its valid items committed together, each answered in order.
    async fn batch_call(
        &self,
        forwarded: bool,
        deadline: Option<Instant>,
        body: pb::BatchRequest,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        if body.items.len() > MAX_BATCH_ITEMS {
            return Err(Status::invalid_argument(format!(
                "a batch holds at most {MAX_BATCH_ITEMS} items, got {}",
                body.items.len()
            )));
        }
        let parsed: Vec<Result<Command, LedgerError>> =
            body.items.iter().cloned().map(item_command).collect();
        let cmds: Vec<Command> = parsed.iter().filter_map(|p| p.clone().ok()).collect();
        let responses = match self.commit(cmds, deadline).await {
            Ok(r) => Ok(r),
            Err(CommitError::Client(ClientError::NotLeader {
                leader_id,
                leader_addr,
            })) => {
                let fwd = |mut c: AllocatorClient<Channel>| async move {
                    c.batch(forward_request(body, deadline)).await
                };
                return self.forward(forwarded, leader_id, leader_addr, fwd).await;
            }
            // Nothing was applied: every valid item carries the reason.
            Err(e @ (CommitError::Overloaded { .. } | CommitError::DeadlineExceeded)) => {
                Err(commit_detail(&e))
            }
            Err(e) => return Err(commit_status(e)),
        };
        let results = self.merge(parsed, responses);
        Ok(Response::new(pb::BatchResponse { results }))
    }
}

impl AllocatorService {
    /// The results of a Batch call in its items' order: an item that had no command gets its
    /// parse error; the others get their committed response, or the commit's refusal.
    fn merge(
        &self,
        parsed: Vec<Result<Command, LedgerError>>,
        responses: Result<Vec<LResp>, pb::ErrorDetail>,
    ) -> Vec<pb::BatchResult> {
        use pb::batch_result::Outcome;
        let error = |d: pb::ErrorDetail| pb::BatchResult {
            outcome: Some(Outcome::Error(d)),
        };
        let mut responses = responses.map(Vec::into_iter);
        parsed
            .into_iter()
            .map(|p| match (p, &mut responses) {
                (Err(e), _) => error(ledger_error(&e).1),
                (Ok(_), Err(d)) => error(d.clone()),
                (Ok(cmd), Ok(rs)) => match rs.next() {
                    Some(r) => item_result(&cmd, r),
                    None => error(detail(
                        pb::ErrorReason::Unspecified,
                        "the batch entry answered fewer items than it carried",
                    )),
                },
            })
            .collect()
    }
}

/// FAILED_PRECONDITION carrying where the leader is; UNAVAILABLE while no leader is known (an
/// election is running), since only a retry later can help then. Either carries a NOT_LEADER
/// [`pb::ErrorDetail`] (with the leader's id and address when known) in its details.
fn not_leader(leader_id: Option<u64>, leader_addr: Option<String>) -> Status {
    let Some(id) = leader_id else {
        let d = detail(
            pb::ErrorReason::NotLeader,
            "not the leader, and no leader is known yet; retry shortly",
        );
        return error_detail::status(Code::Unavailable, &d);
    };
    let d = pb::ErrorDetail {
        leader_id: Some(id),
        leader_addr: leader_addr.clone().unwrap_or_default(),
        ..detail(
            pb::ErrorReason::NotLeader,
            format!(
                "not the leader; leader is {id} at {}",
                leader_addr.as_deref().unwrap_or("unknown")
            ),
        )
    };
    error_detail::status(Code::FailedPrecondition, &d)
}

/// The ErrorDetail of a call refused unapplied by the group commit.
fn commit_detail(e: &CommitError) -> pb::ErrorDetail {
    let reason = match e {
        CommitError::Overloaded { .. } => pb::ErrorReason::Overloaded,
        CommitError::DeadlineExceeded => pb::ErrorReason::DeadlineExceeded,
        CommitError::Client(_) => pb::ErrorReason::Unspecified,
    };
    detail(reason, e.to_string())
}

/// The status of a failed commit (not-leader forwarding is the caller's).
fn commit_status(e: CommitError) -> Status {
    match e {
        CommitError::Overloaded { .. } => {
            error_detail::status(Code::ResourceExhausted, &commit_detail(&e))
        }
        CommitError::DeadlineExceeded => {
            error_detail::status(Code::DeadlineExceeded, &commit_detail(&e))
        }
        CommitError::Client(ClientError::NotLeader {
            leader_id,
            leader_addr,
        }) => not_leader(leader_id, leader_addr),
        // Raft stopped under the write: it may or may not have committed.
        CommitError::Client(e) => Status::unavailable(format!("write outcome unknown: {e}")),
    }
}

/// The status of a unary call the ledger refused: the code and, in its details, the
/// [`pb::ErrorDetail`] of [`ledger_error`].
fn ledger_status(e: LedgerError) -> Status {
    let (code, d) = ledger_error(&e);
    error_detail::status(code, &d)
}

fn unexpected(r: LResp) -> Status {
    match r {
        LResp::Rejected(e) => ledger_status(e),
        other => Status::internal(format!("unexpected ledger response {other:?}")),
    }
}

fn forwarded<T>(r: &Request<T>) -> bool {
    r.metadata().contains_key(FORWARDED_HEADER)
}

fn mark<T>(mut r: Request<T>) -> Request<T> {
    r.metadata_mut().insert(
        FORWARDED_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    r
}

/// `body` as a call forwarded to the leader, with what is left of the caller's deadline.
fn forward_request<T>(body: T, deadline: Option<Instant>) -> Request<T> {
    let mut r = mark(Request::new(body));
    if let Some(d) = deadline {
        r.set_timeout(d.saturating_duration_since(Instant::now()));
    }
    r
}

/// Proto policy key → ledger policy key.
pub fn policy_key(k: Option<pb::PolicyKey>) -> Result<ledger::PolicyKey, Status> {
    let k = k.ok_or_else(|| Status::invalid_argument("key is required"))?;
    Ok(ledger::PolicyKey {
        domain: k.domain,
        entries: k.entries.into_iter().map(|e| (e.key, e.value)).collect(),
    })
}

fn region_status(r: ledger::RegionStatus) -> pb::RegionStatus {
    pb::RegionStatus {
        region: r.region,
        live_allocations: r.live_allocations,
        granted: r.granted,
        reported: r.reported,
        stranded: r.stranded,
        overshoot_bound: r.overshoot_bound,
        part_ppm: r.share_ppm,
        share_ppm: r.guarantee_ppm,
        reserved_ppm: r.reserved_ppm,
    }
}

#[tonic::async_trait]
impl Allocator for AllocatorService {
    async fn acquire(
        &self,
        req: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let body = req.into_inner();
        let cmd = items::acquire_command(body.clone())
            .ok_or_else(|| Status::invalid_argument("key is required"))?;
        let r = self
            .write(fwd, deadline, cmd, |mut c| async move {
                c.acquire(forward_request(body, deadline)).await
            })
            .await?;
        match r {
            Ok(r) => items::acquire_response(r)
                .map(Response::new)
                .map_err(unexpected),
            Err(forwarded) => Ok(forwarded),
        }
    }

    async fn report(
        &self,
        req: Request<pb::ReportRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let b = req.into_inner();
        let cmd = items::report_command(b.clone());
        match self
            .write(fwd, deadline, cmd, |mut c| async move {
                c.report(forward_request(b, deadline)).await
            })
            .await?
        {
            Ok(r) => items::report_response(r)
                .map(Response::new)
                .map_err(unexpected),
            Err(f) => Ok(f),
        }
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let b = req.into_inner();
        let cmd = items::release_command(b.clone());
        match self
            .write(fwd, deadline, cmd, |mut c| async move {
                c.release(forward_request(b, deadline)).await
            })
            .await?
        {
            Ok(r) => items::release_response(r)
                .map(Response::new)
                .map_err(unexpected),
            Err(f) => Ok(f),
        }
    }

    async fn decide(
        &self,
        req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let body = req.into_inner();
        let cmd = items::decide_command(body.clone())
            .ok_or_else(|| Status::invalid_argument("key is required"))?;
        match self
            .write(fwd, deadline, cmd, |mut c| async move {
                c.decide(forward_request(body, deadline)).await
            })
            .await?
        {
            Ok(r) => items::decide_response(r)
                .map(Response::new)
                .map_err(unexpected),
            Err(f) => Ok(f),
        }
    }

    async fn batch(
        &self,
        req: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        self.batch_call(fwd, deadline, req.into_inner()).await
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let fwd = forwarded(&req);
        let body = req.get_ref().clone();
        let key = policy_key(body.key.clone())?;
        match self.node.ensure_linearizable().await {
            Ok(()) => {}
            Err(ClientError::NotLeader {
                leader_id,
                leader_addr,
            }) => {
                let leader_addr = leader_addr.filter(|a| !a.is_empty());
                let Some(addr) = leader_addr.clone().filter(|_| !fwd) else {
                    return Err(not_leader(leader_id, leader_addr));
                };
                let mut c = self.client(&addr)?;
                return match c.status(mark(Request::new(body))).await {
                    Err(s) if s.code() == Code::Unavailable => {
                        Err(not_leader(leader_id, Some(addr)))
                    }
                    other => other,
                };
            }
            // A stopped node or a leader without a quorum must not answer from a state that
            // may be stale.
            Err(e) => return Err(Status::unavailable(format!("no linearizable read: {e}"))),
        }
        // The time a write would be stamped with now: a wall clock running ahead must not show
        // a bucket refilled beyond what the ledger will grant.
        let now = self.node.ledger_time().stamp();
        let s = self
            .node
            .state()
            .read(|l| l.status(&key, now))
            .map_err(ledger_status)?;
        Ok(Response::new(pb::StatusResponse {
            key: body.key,
            policy_version: s.policy_version,
            bucket_tokens: s.bucket_tokens,
            regions: s.regions.into_iter().map(region_status).collect(),
        }))
    }

    async fn put_policy(
        &self,
        req: Request<pb::PutPolicyRequest>,
    ) -> Result<Response<pb::PutPolicyResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let body = req.get_ref().clone();
        let cmd = Command::PutPolicy {
            yaml: body.yaml.clone(),
            expected_version: body.expected_version,
            request_id: body.request_id.clone(),
        };
        match self
            .write(fwd, deadline, cmd, |mut c| async move {
                c.put_policy(forward_request(body, deadline)).await
            })
            .await?
        {
            Ok(LResp::PolicyPut { domain, version }) => Ok(Response::new(pb::PutPolicyResponse {
                policy: domain,
                version,
            })),
            Ok(other) => Err(unexpected(other)),
            Err(f) => Ok(f),
        }
    }

    async fn set_shares(
        &self,
        req: Request<pb::SetSharesRequest>,
    ) -> Result<Response<pb::SetSharesResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        let body = req.get_ref().clone();
        let mut shares = Vec::with_capacity(body.shares.len());
        for s in &body.shares {
            let share = match s.share {
                Some(pb::region_share::Share::FractionPpm(p)) => ledger::Share::Ppm(p),
                Some(pb::region_share::Share::AbsoluteRate(r)) => ledger::Share::Rate(r),
                None => {
                    return Err(Status::invalid_argument(format!(
                        "share of region {:?} is missing",
                        s.region
                    )))
                }
            };
            shares.push(ledger::ShareSpec {
                region: s.region.clone(),
                share,
            });
        }
        let cmd = Command::SetShares {
            policy: body.policy.clone(),
            shares,
            config_version: body.config_version,
            request_id: body.request_id.clone(),
        };
        match self
            .write(fwd, deadline, cmd, |mut c| async move {
                c.set_shares(forward_request(body, deadline)).await
            })
            .await?
        {
            Ok(LResp::SharesSet { config_version }) => {
                Ok(Response::new(pb::SetSharesResponse { config_version }))
            }
            Ok(other) => Err(unexpected(other)),
            Err(f) => Ok(f),
        }
    }

    async fn cluster_init(
        &self,
        req: Request<pb::ClusterInitRequest>,
    ) -> Result<Response<pb::ClusterInitResponse>, Status> {
        let mut members = BTreeMap::new();
        for m in req.into_inner().members {
            if m.addr.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "member {} has no address",
                    m.node_id
                )));
            }
            if members.insert(m.node_id, m.addr).is_some() {
                return Err(Status::invalid_argument("a node id is listed twice"));
            }
        }
        if members.is_empty() {
            return Err(Status::invalid_argument("members must not be empty"));
        }
        self.node
            .initialize(members)
            .await
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        Ok(Response::new(pb::ClusterInitResponse {}))
    }

    async fn add_learner(
        &self,
        req: Request<pb::AddLearnerRequest>,
    ) -> Result<Response<pb::AddLearnerResponse>, Status> {
        let m = req
            .into_inner()
            .member
            .ok_or_else(|| Status::invalid_argument("member is required"))?;
        if m.addr.is_empty() {
            return Err(Status::invalid_argument("member address is required"));
        }
        let idx = self
            .node
            .add_learner(m.node_id, m.addr, true)
            .await
            .map_err(membership_status)?;
        Ok(Response::new(pb::AddLearnerResponse { log_index: idx }))
    }

    async fn change_membership(
        &self,
        req: Request<pb::ChangeMembershipRequest>,
    ) -> Result<Response<pb::ChangeMembershipResponse>, Status> {
        let b = req.into_inner();
        if b.voter_ids.is_empty() {
            return Err(Status::invalid_argument("voter_ids must not be empty"));
        }
        let idx = self
            .node
            .change_membership(b.voter_ids.into_iter().collect(), b.retain)
            .await
            .map_err(membership_status)?;
        Ok(Response::new(pb::ChangeMembershipResponse {
            log_index: idx,
        }))
    }

    async fn cluster_status(
        &self,
        _req: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        let m = self.node.raft().metrics().borrow().clone();
        let skew = self.node.clock_skew();
        let membership = m.membership_config.membership();
        let voter_ids: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
        let mut voters = Vec::new();
        let mut learners = Vec::new();
        for (id, n) in membership.nodes() {
            let member = pb::Member {
                node_id: *id,
                addr: n.addr.clone(),
            };
            if voter_ids.contains(id) {
                voters.push(member);
            } else {
                learners.push(member);
            }
        }
        let leader_addr = m
            .current_leader
            .and_then(|l| membership.get_node(&l).map(|n| n.addr.clone()))
            .unwrap_or_default();
        Ok(Response::new(pb::ClusterStatusResponse {
            node_id: m.id,
            state: format!("{:?}", m.state),
            current_term: m.current_term,
            leader_id: m.current_leader,
            leader_addr,
            voters,
            learners,
            last_log_index: m.last_log_index,
            last_applied_index: m.last_applied.map(|l| l.index),
            tables: self
                .node
                .state()
                .read(|l| l.tables())
                .iter()
                .map(table_usage)
                .collect(),
            clock_skew_ms: skew.skew_ms,
            clock_skew_beyond_max: skew.beyond_max,
        }))
    }
}

fn table_usage(u: &ledger::TableUsage) -> pb::TableUsage {
    pb::TableUsage {
        table: u.table.name().to_string(),
        entries: u.entries,
        refused: u.counters.refused,
        evicted: u.counters.evicted,
    }
}

fn membership_status(e: ClientError) -> Status {
    match e {
        ClientError::NotLeader {
            leader_id,
            leader_addr,
        } => not_leader(leader_id, leader_addr),
        ClientError::Stopped(m) => Status::unavailable(m),
        ClientError::Rejected(m) => Status::failed_precondition(m),
    }
}
