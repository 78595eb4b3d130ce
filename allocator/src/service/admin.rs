//! The admin plane of the allocator API, the operators' audience (`allotctl`): policies and
//! shares (committed through Raft like every write, forwarded by a follower), and the cluster's
//! membership and status.

use super::convert::{self, table_usage};
use super::errors::not_leader;
use super::{AllocatorService, Client};
use crate::ledger::{Command, Response as LResp};
use crate::raft::ClientError;
use allot_proto::allot::v1 as pb;
use std::collections::BTreeMap;
use tonic::{Request, Response, Status};

impl AllocatorService {
    /// PutPolicy: install a version of one domain's policy document.
    pub(super) async fn serve_put_policy(
        &self,
        req: Request<pb::PutPolicyRequest>,
    ) -> Result<Response<pb::PutPolicyResponse>, Status> {
        let command = |b: pb::PutPolicyRequest| {
            Some(Command::PutPolicy {
                yaml: b.yaml,
                expected_version: b.expected_version,
                request_id: b.request_id,
            })
        };
        let forward = |mut c: Client, r| async move { c.put_policy(r).await };
        let answer = |r| match r {
            LResp::PolicyPut { domain, version } => Ok(pb::PutPolicyResponse {
                policy: domain,
                version,
            }),
            other => Err(other),
        };
        self.unary_write(req, command, forward, answer).await
    }

    /// SetShares: set a policy's regional shares (versioned handoff, design §5).
    pub(super) async fn serve_set_shares(
        &self,
        req: Request<pb::SetSharesRequest>,
    ) -> Result<Response<pb::SetSharesResponse>, Status> {
        // Checked before anything is committed or forwarded: a bad share is the caller's error.
        let shares = convert::shares(&req.get_ref().shares)?;
        let command = |b: pb::SetSharesRequest| {
            Some(Command::SetShares {
                policy: b.policy,
                shares,
                config_version: b.config_version,
                request_id: b.request_id,
            })
        };
        let forward = |mut c: Client, r| async move { c.set_shares(r).await };
        let answer = |r| match r {
            LResp::SharesSet { config_version } => Ok(pb::SetSharesResponse { config_version }),
            other => Err(other),
        };
        self.unary_write(req, command, forward, answer).await
    }

    /// ClusterInit: initialise the Raft cluster with its first members.
    pub(super) async fn serve_cluster_init(
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

    /// AddLearner: add a non-voting member that catches up the log.
    pub(super) async fn serve_add_learner(
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

    /// ChangeMembership: change the voter set.
    pub(super) async fn serve_change_membership(
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

    /// ClusterStatus: Raft state, tables and clock skew as this node sees them.
    pub(super) async fn serve_cluster_status(
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

/// The status of a failed membership change.
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
