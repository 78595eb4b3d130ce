//! The allocator's gRPC API (`allot.v1.Allocator`): translates requests into ledger commands,
//! proposes them through Raft and answers after commit.
//!
//! A follower forwards writes and status reads to the leader once (marked with
//! [`FORWARDED_HEADER`], so a call is never forwarded twice); when it cannot, it answers
//! FAILED_PRECONDITION with a [`LeaderHint`](pb::LeaderHint) (leader id and address) in the
//! status details, or UNAVAILABLE while no leader is known.
//! Bad input gets INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION / RESOURCE_EXHAUSTED with a
//! reason and changes nothing.

use crate::ledger::{self, Command, Ledger, LedgerError, Response as LResp};
use crate::raft::{ClientError, Clock, Node};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use allot_proto::allot::v1::allocator_server::{Allocator, AllocatorServer};
use parking_lot::Mutex;
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Metadata header set on a call a follower forwarded to the leader.
pub const FORWARDED_HEADER: &str = "x-allot-forwarded";

/// How long a forwarded call may take.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// The `allot.v1.Allocator` service of one node.
pub struct AllocatorService {
    node: Arc<Node<Ledger>>,
    clock: Arc<dyn Clock>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl AllocatorService {
    /// A service proposing through `node`; `clock` gives the time status reads are computed at.
    pub fn new(node: Arc<Node<Ledger>>, clock: Arc<dyn Clock>) -> Self {
        AllocatorService {
            node,
            clock,
            channels: Mutex::new(HashMap::new()),
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

    /// Proposes `cmd`; on a follower, runs `forward` against the leader instead.
    async fn write<T, F, Fut>(
        &self,
        forwarded: bool,
        cmd: Command,
        forward: F,
    ) -> Result<Result<LResp, Response<T>>, Status>
    where
        F: FnOnce(AllocatorClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        match self.node.propose(cmd).await {
            Ok(r) => Ok(Ok(r)),
            Err(ClientError::NotLeader {
                leader_id,
                leader_addr,
            }) => {
                let leader_addr = leader_addr.filter(|a| !a.is_empty());
                // A call forwarded once is not forwarded again (no loops while leadership
                // moves); its caller still learns where the leader is.
                let Some(addr) = leader_addr.clone().filter(|_| !forwarded) else {
                    return Err(not_leader(leader_id, leader_addr));
                };
                let client = self.client(&addr)?;
                match forward(client).await {
                    Ok(r) => Ok(Err(r)),
                    Err(s) if s.code() == Code::Unavailable => {
                        Err(not_leader(leader_id, Some(addr)))
                    }
                    Err(s) => Err(s),
                }
            }
            // Raft stopped under the write: it may or may not have committed.
            Err(e) => Err(Status::unavailable(format!("write outcome unknown: {e}"))),
        }
    }
}

/// FAILED_PRECONDITION carrying where the leader is; UNAVAILABLE while no leader is known (an
/// election is running), since only a retry later can help then.
fn not_leader(leader_id: Option<u64>, leader_addr: Option<String>) -> Status {
    if leader_id.is_none() {
        return Status::unavailable("not the leader, and no leader is known yet; retry shortly");
    }
    let hint = pb::LeaderHint {
        leader_id,
        leader_addr: leader_addr.clone().unwrap_or_default(),
    };
    Status::with_details(
        Code::FailedPrecondition,
        format!(
            "not the leader; leader is {} at {}",
            leader_id.map_or("unknown".into(), |i| i.to_string()),
            leader_addr.as_deref().unwrap_or("unknown")
        ),
        hint.encode_to_vec().into(),
    )
}

fn ledger_status(e: LedgerError) -> Status {
    match e {
        LedgerError::InvalidArgument(m) => Status::invalid_argument(m),
        LedgerError::NotFound(m) => Status::not_found(m),
        LedgerError::FailedPrecondition(m) => Status::failed_precondition(m),
        LedgerError::ResourceExhausted(m) => Status::resource_exhausted(m),
    }
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
    }
}

#[tonic::async_trait]
impl Allocator for AllocatorService {
    async fn acquire(
        &self,
        req: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let fwd = forwarded(&req);
        let body = req.get_ref().clone();
        let cmd = Command::Acquire(ledger::Acquire {
            key: policy_key(body.key.clone())?,
            region: body.region.clone(),
            holder: body.holder.clone(),
            want: body.want,
            request_id: body.request_id.clone(),
        });
        let r = self
            .write(fwd, cmd, |mut c| async move {
                c.acquire(mark(Request::new(body))).await
            })
            .await?;
        let r = match r {
            Ok(r) => r,
            Err(forwarded) => return Ok(forwarded),
        };
        let outcome = match r {
            LResp::Granted(g) => pb::acquire_response::Outcome::Grant(pb::Grant {
                allocation_id: g.allocation_id,
                epoch: g.epoch,
                granted: g.granted,
                expires_at_unix_ms: g.expires_at_ms,
                ttl_ms: g.expires_at_ms - g.issued_at_ms,
                policy_version: g.policy_version,
            }),
            LResp::Denied(d) => pb::acquire_response::Outcome::Denial(pb::Denial {
                retry_after_ms: d.retry_after_ms,
                reason: d.reason,
                policy_version: d.policy_version,
            }),
            other => return Err(unexpected(other)),
        };
        Ok(Response::new(pb::AcquireResponse {
            outcome: Some(outcome),
        }))
    }

    async fn report(
        &self,
        req: Request<pb::ReportRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let fwd = forwarded(&req);
        let b = *req.get_ref();
        let cmd = Command::Report {
            allocation_id: b.allocation_id,
            epoch: b.epoch,
            cumulative_spend: b.cumulative_spend,
        };
        match self
            .write(fwd, cmd, |mut c| async move {
                c.report(mark(Request::new(b))).await
            })
            .await?
        {
            Ok(LResp::Reported {
                recorded,
                expires_at_ms,
            }) => Ok(Response::new(pb::ReportResponse {
                recorded_spend: recorded,
                expires_at_unix_ms: expires_at_ms,
            })),
            Ok(other) => Err(unexpected(other)),
            Err(f) => Ok(f),
        }
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let fwd = forwarded(&req);
        let b = *req.get_ref();
        let cmd = Command::Release {
            allocation_id: b.allocation_id,
            epoch: b.epoch,
            final_spend: b.final_spend,
        };
        match self
            .write(fwd, cmd, |mut c| async move {
                c.release(mark(Request::new(b))).await
            })
            .await?
        {
            Ok(LResp::Released { returned }) => Ok(Response::new(pb::ReleaseResponse { returned })),
            Ok(other) => Err(unexpected(other)),
            Err(f) => Ok(f),
        }
    }

    async fn decide(
        &self,
        _req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        Err(Status::unimplemented("Decide: not yet served"))
    }

    async fn batch(
        &self,
        _req: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        Err(Status::unimplemented("Batch: not yet served"))
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
        let now = self.clock.now_ms();
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
        let fwd = forwarded(&req);
        let body = req.get_ref().clone();
        let cmd = Command::PutPolicy {
            yaml: body.yaml.clone(),
            expected_version: body.expected_version,
        };
        match self
            .write(fwd, cmd, |mut c| async move {
                c.put_policy(mark(Request::new(body))).await
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
        let fwd = forwarded(&req);
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
        };
        match self
            .write(fwd, cmd, |mut c| async move {
                c.set_shares(mark(Request::new(body))).await
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
        }))
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
