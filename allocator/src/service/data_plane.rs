//! The data plane of the allocator API, the agents' audience: Acquire, Report, Release and
//! Decide (unary or many in one `Batch`) and Status. Every write is committed through Raft (the
//! group commit) before it is answered; a follower forwards it to the leader (`forward`).

use super::convert::{self, item_command, item_result, policy_key, region_status};
use super::deadline::deadline_of;
use super::errors::{commit_detail, commit_status, detail, ledger_error, ledger_status};
use super::forward::{forward_request, forwarded};
use super::{AllocatorService, Client};
use crate::ledger::{Command, LedgerError, Response as LResp, StatusLimit};
use crate::raft::{ClientError, CommitError};
use allot_proto::allot::v1 as pb;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

/// Most items in one `Batch` call; a larger call is INVALID_ARGUMENT.
pub const MAX_BATCH_ITEMS: usize = 4_096;

impl AllocatorService {
    /// Acquire: lease a batch of tokens (design §3), committed before the answer.
    pub(super) async fn serve_acquire(
        &self,
        req: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let forward = |mut c: Client, r| async move { c.acquire(r).await };
        self.unary_write(
            req,
            convert::acquire_command,
            forward,
            convert::acquire_response,
        )
        .await
    }

    /// Report: record an allocation's cumulative spend.
    pub(super) async fn serve_report(
        &self,
        req: Request<pb::ReportRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let command = |b| Some(convert::report_command(b));
        let forward = |mut c: Client, r| async move { c.report(r).await };
        self.unary_write(req, command, forward, convert::report_response)
            .await
    }

    /// Release: hand an allocation back with its final spend.
    pub(super) async fn serve_release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let command = |b| Some(convert::release_command(b));
        let forward = |mut c: Client, r| async move { c.release(r).await };
        self.unary_write(req, command, forward, convert::release_response)
            .await
    }

    /// Decide: one request decided centrally (design §2), committed before the answer.
    pub(super) async fn serve_decide(
        &self,
        req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        let forward = |mut c: Client, r| async move { c.decide(r).await };
        self.unary_write(
            req,
            convert::decide_command,
            forward,
            convert::decide_response,
        )
        .await
    }

    /// Batch: many lease items of one agent in one call and one group commit.
    pub(super) async fn serve_batch(
        &self,
        req: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        let (fwd, deadline) = (forwarded(&req), deadline_of(&req));
        self.batch_call(fwd, deadline, req.into_inner()).await
    }

    /// Status: one policy key's per-region state, from a linearizable read on the leader.
    pub(super) async fn serve_status(
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
                let status =
                    |mut c: Client| async move { c.status(forward_request(body, None)).await };
                return self.forward(fwd, leader_id, leader_addr, status).await;
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
        let limit = s.limit.unwrap_or(StatusLimit {
            requests_per_unit: 0,
            unit: String::new(),
            unit_multiplier: 0,
            capacity_tokens: 0,
        });
        Ok(Response::new(pb::StatusResponse {
            key: body.key,
            policy_version: s.policy_version,
            bucket_tokens: s.bucket_tokens,
            regions: s.regions.into_iter().map(region_status).collect(),
            policy: s.policy,
            requests_per_unit: limit.requests_per_unit,
            unit: limit.unit,
            unit_multiplier: limit.unit_multiplier,
            capacity_tokens: limit.capacity_tokens,
        }))
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
                let fwd =
                    |mut c: Client| async move { c.batch(forward_request(body, deadline)).await };
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
