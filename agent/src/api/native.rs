//! The native gRPC service `allot.v1.Agent` (proto/allot/v1/agent.proto): Check, Reserve,
//! Settle and Done over the [`Decider`]. Costs are whole tokens; times milliseconds.

use super::{
    ms_ceil, rule_limit, ApiError, Decider, Verdict, WireDescriptor, WireEntry, WireRequest,
};
use allot_common::limiter::{Code, Reason};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::agent_server::{Agent, AgentServer};
use std::sync::Arc;
use tonic::{Request as TonicRequest, Response, Status};

impl WireEntry for pb::DescriptorEntry {
    fn key(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.value
    }
}

impl WireDescriptor for pb::RequestDescriptor {
    type Entry = pb::DescriptorEntry;
    fn entries(&self) -> &[Self::Entry] {
        &self.entries
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// The `allot.v1.Agent` service over a [`Decider`].
#[derive(Debug, Clone)]
pub struct NativeService {
    decider: Arc<Decider>,
}

/// The proto code of a core code.
pub fn pb_code(c: Code) -> pb::DecisionCode {
    match c {
        Code::Ok => pb::DecisionCode::Ok,
        Code::OverLimit => pb::DecisionCode::OverLimit,
    }
}

/// The proto reason of a core reason.
pub fn pb_reason(r: Reason) -> pb::DecisionReason {
    match r {
        Reason::NoRule => pb::DecisionReason::NoRule,
        Reason::Unlimited => pb::DecisionReason::Unlimited,
        Reason::WithinLimit => pb::DecisionReason::WithinLimit,
        Reason::OverLimit => pb::DecisionReason::OverLimit,
        Reason::CostExceedsCapacity => pb::DecisionReason::CostExceedsCapacity,
        Reason::KeyTableFull => pb::DecisionReason::KeyTableFull,
        Reason::ConcurrencyLimit => pb::DecisionReason::ConcurrencyLimit,
    }
}

/// Translates a verdict into the native decision.
pub fn decision(v: &Verdict) -> pb::Decision {
    let descriptors = v
        .statuses
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let rule = v.rule(i);
            let limit = rule.and_then(rule_limit).filter(|_| s.limit.is_some());
            // A descriptor that was within its limit in a denied request was denied by another.
            let reason = if !v.is_ok() && s.code == Code::Ok && s.reason == Reason::WithinLimit {
                pb::DecisionReason::OtherDescriptor
            } else {
                pb_reason(s.reason)
            };
            pb::DescriptorDecision {
                code: pb_code(s.code) as i32,
                reason: reason as i32,
                policy: rule.map(|r| r.name.clone()).unwrap_or_default(),
                remaining: limit.map(|_| s.remaining),
                requests_per_unit: limit.map_or(0, |l| l.0),
                unit: limit.map_or("", |l| l.1.envoy_name()).to_string(),
                reset_after_ms: ms_ceil(s.reset_after),
                shadow_over_limit: s.shadow_over_limit,
                max_in_flight: rule.and_then(|r| r.max_in_flight),
            }
        })
        .collect();
    let deciding = v.deciding();
    let ds = deciding.and_then(|i| v.statuses.get(i));
    pb::Decision {
        code: pb_code(v.outcome.code) as i32,
        reason: ds.map_or(
            if v.statuses.iter().all(|s| s.reason == Reason::Unlimited) {
                pb::DecisionReason::Unlimited
            } else {
                pb::DecisionReason::NoRule
            },
            |s| pb_reason(s.reason),
        ) as i32,
        policy: deciding
            .and_then(|i| v.rule(i))
            .map(|r| r.name.clone())
            .unwrap_or_default(),
        policy_version: v.outcome.policy_version,
        descriptors,
        retry_after_ms: v.retry_after_ns().map(ms_ceil),
        reset_after_ms: ds.map_or(0, |s| ms_ceil(s.reset_after)),
        remaining: ds.filter(|s| s.limit.is_some()).map(|s| s.remaining),
    }
}

impl NativeService {
    /// A service deciding with `decider`.
    pub fn new(decider: Arc<Decider>) -> Self {
        NativeService { decider }
    }

    /// The tonic server for this service.
    pub fn into_server(self) -> AgentServer<Self> {
        AgentServer::new(self)
    }

    fn invalid<T>(&self, r: Result<T, ApiError>) -> Result<T, ApiError> {
        r.inspect_err(|_| self.decider.count_invalid())
    }
}

#[tonic::async_trait]
impl Agent for NativeService {
    async fn check(
        &self,
        request: TonicRequest<pb::CheckRequest>,
    ) -> Result<Response<pb::CheckResponse>, Status> {
        let r = request.get_ref();
        let w = self.invalid(WireRequest::read(&r.domain, &r.descriptors, "cost", r.cost))?;
        let descriptors = w.descriptors();
        let req = w.request(&descriptors);
        let v = self.decider.check(&req, Some(&r.request_id)).await?;
        Ok(Response::new(pb::CheckResponse {
            decision: Some(decision(&v)),
        }))
    }

    async fn reserve(
        &self,
        request: TonicRequest<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        let r = request.get_ref();
        let w = self.invalid(WireRequest::read(
            &r.domain,
            &r.descriptors,
            "max_cost",
            r.max_cost,
        ))?;
        let descriptors = w.descriptors();
        let req = w.request(&descriptors);
        let res = self
            .decider
            .reserve(&req, Some(&r.request_id), r.ttl_ms)
            .await?;
        Ok(Response::new(pb::ReserveResponse {
            reservation_id: res.reservation_id,
            decision: Some(decision(&res.verdict)),
            expires_in_ms: res.expires_in / allot_common::units::NANOS_PER_MILLI,
        }))
    }

    async fn settle(
        &self,
        request: TonicRequest<pb::SettleRequest>,
    ) -> Result<Response<pb::SettleResponse>, Status> {
        let r = request.get_ref();
        if r.reservation_id.is_empty() {
            return Err(Status::invalid_argument("reservation_id is empty"));
        }
        let s = self.decider.settle(&r.reservation_id, r.actual_cost)?;
        Ok(Response::new(pb::SettleResponse {
            refunded: s.refunded,
            already_settled: s.already_settled,
            actual_cost: s.actual_cost,
        }))
    }

    async fn done(
        &self,
        request: TonicRequest<pb::DoneRequest>,
    ) -> Result<Response<pb::DoneResponse>, Status> {
        let r = request.get_ref();
        if r.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is empty"));
        }
        Ok(Response::new(pb::DoneResponse {
            released_slots: self.decider.done(&r.request_id),
        }))
    }
}
