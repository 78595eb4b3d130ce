//! The native gRPC service `allot.v1.Agent` (proto/allot/v1/agent.proto): Check, Reserve,
//! Settle and Done over the [`Decider`]. Costs are whole tokens; times milliseconds.

use super::proto_out::{
    message_header, message_len, opt_str, opt_varint, opt_varint_len, some_varint, some_varint_len,
    str_len,
};
use super::{
    ms_ceil, rule_limit, ApiError, Decider, Verdict, WireDescriptor, WireEntry, WireRequest,
};
use allot_common::limiter::{Code, Reason};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::agent_server::Agent;
use prost::bytes::BufMut;
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

mod server;
pub use server::NativeServer;

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
        Reason::AllocatorUnreachable => pb::DecisionReason::AllocatorUnreachable,
    }
}

/// The fields of one `DescriptorDecision` of a verdict (borrowed: no string is copied); the
/// HTTP adapter writes its JSON from them too.
pub(super) struct DescriptorFields<'a> {
    pub(super) code: i32,
    pub(super) reason: i32,
    pub(super) policy: &'a str,
    pub(super) remaining: Option<u64>,
    pub(super) requests_per_unit: u64,
    pub(super) unit: &'static str,
    pub(super) reset_after_ms: u64,
    pub(super) shadow_over_limit: bool,
    pub(super) max_in_flight: Option<u64>,
}

impl<'a> DescriptorFields<'a> {
    pub(super) fn of(v: &'a Verdict, i: usize) -> Self {
        let s = &v.statuses[i];
        let rule = v.rule(i);
        let limit = rule.and_then(rule_limit).filter(|_| s.limit.is_some());
        // A descriptor that was within its limit in a denied request was denied by another.
        let reason = if !v.is_ok() && s.code == Code::Ok && s.reason == Reason::WithinLimit {
            pb::DecisionReason::OtherDescriptor
        } else {
            pb_reason(s.reason)
        };
        DescriptorFields {
            code: pb_code(s.code) as i32,
            reason: reason as i32,
            policy: rule.map_or("", |r| r.name.as_str()),
            remaining: limit.map(|_| s.remaining),
            requests_per_unit: limit.map_or(0, |l| l.0),
            unit: limit.map_or("", |l| l.1.envoy_name()),
            reset_after_ms: ms_ceil(s.reset_after),
            shadow_over_limit: s.shadow_over_limit,
            max_in_flight: rule.and_then(|r| r.max_in_flight),
        }
    }

    fn len(&self) -> usize {
        opt_varint_len(1, self.code as u64)
            + opt_varint_len(2, self.reason as u64)
            + str_len(3, self.policy)
            + some_varint_len(4, self.remaining)
            + opt_varint_len(5, self.requests_per_unit)
            + str_len(6, self.unit)
            + opt_varint_len(7, self.reset_after_ms)
            + opt_varint_len(8, u64::from(self.shadow_over_limit))
            + some_varint_len(9, self.max_in_flight)
    }

    fn encode(&self, buf: &mut impl BufMut) {
        opt_varint(1, self.code as u64, buf);
        opt_varint(2, self.reason as u64, buf);
        opt_str(3, self.policy, buf);
        some_varint(4, self.remaining, buf);
        opt_varint(5, self.requests_per_unit, buf);
        opt_str(6, self.unit, buf);
        opt_varint(7, self.reset_after_ms, buf);
        opt_varint(8, u64::from(self.shadow_over_limit), buf);
        some_varint(9, self.max_in_flight, buf);
    }
}

/// The fields of a verdict's `Decision` besides its descriptors.
pub(super) struct DecisionFields<'a> {
    pub(super) code: i32,
    pub(super) reason: i32,
    pub(super) policy: &'a str,
    pub(super) policy_version: u64,
    pub(super) retry_after_ms: Option<u64>,
    pub(super) reset_after_ms: u64,
    pub(super) remaining: Option<u64>,
}

impl<'a> DecisionFields<'a> {
    pub(super) fn of(v: &'a Verdict) -> Self {
        let deciding = v.deciding();
        let ds = deciding.and_then(|i| v.statuses.get(i));
        let reason = ds.map_or(
            if v.statuses.iter().all(|s| s.reason == Reason::Unlimited) {
                pb::DecisionReason::Unlimited
            } else {
                pb::DecisionReason::NoRule
            },
            |s| pb_reason(s.reason),
        );
        DecisionFields {
            code: pb_code(v.outcome.code) as i32,
            reason: reason as i32,
            policy: deciding
                .and_then(|i| v.rule(i))
                .map_or("", |r| r.name.as_str()),
            policy_version: v.outcome.policy_version,
            retry_after_ms: v.retry_after_ns().map(ms_ceil),
            reset_after_ms: ds.map_or(0, |s| ms_ceil(s.reset_after)),
            remaining: ds.filter(|s| s.limit.is_some()).map(|s| s.remaining),
        }
    }
}

/// Translates a verdict into the native decision.
pub fn decision(v: &Verdict) -> pb::Decision {
    let descriptors = (0..v.statuses.len())
        .map(|i| {
            let f = DescriptorFields::of(v, i);
            pb::DescriptorDecision {
                code: f.code,
                reason: f.reason,
                policy: f.policy.to_string(),
                remaining: f.remaining,
                requests_per_unit: f.requests_per_unit,
                unit: f.unit.to_string(),
                reset_after_ms: f.reset_after_ms,
                shadow_over_limit: f.shadow_over_limit,
                max_in_flight: f.max_in_flight,
            }
        })
        .collect();
    let f = DecisionFields::of(v);
    pb::Decision {
        code: f.code,
        reason: f.reason,
        policy: f.policy.to_string(),
        policy_version: f.policy_version,
        descriptors,
        retry_after_ms: f.retry_after_ms,
        reset_after_ms: f.reset_after_ms,
        remaining: f.remaining,
    }
}

/// A native `Check` answer: the verdict, written as `CheckResponse` bytes straight into the
/// transport's buffer ([`encode_into`](Self::encode_into)) without building the message, so a
/// Check allocates nothing from the decoded request to the answer (`tests/allocations.rs`).
#[derive(Debug)]
pub struct NativeAnswer(pub Verdict);

impl NativeAnswer {
    /// The answer as prost's message (allocates).
    pub fn to_response(&self) -> pb::CheckResponse {
        pb::CheckResponse {
            decision: Some(decision(&self.0)),
        }
    }

    /// Appends the protobuf encoding of [`to_response`](Self::to_response)'s message (the bytes
    /// prost writes for it) to `buf`, allocating nothing.
    pub fn encode_into(&self, buf: &mut impl BufMut) {
        let v = &self.0;
        let f = DecisionFields::of(v);
        let descriptors = (0..v.statuses.len())
            .map(|i| message_len(5, DescriptorFields::of(v, i).len()))
            .sum::<usize>();
        let len = opt_varint_len(1, f.code as u64)
            + opt_varint_len(2, f.reason as u64)
            + str_len(3, f.policy)
            + opt_varint_len(4, f.policy_version)
            + descriptors
            + some_varint_len(6, f.retry_after_ms)
            + opt_varint_len(7, f.reset_after_ms)
            + some_varint_len(8, f.remaining);
        message_header(1, len, buf);
        opt_varint(1, f.code as u64, buf);
        opt_varint(2, f.reason as u64, buf);
        opt_str(3, f.policy, buf);
        opt_varint(4, f.policy_version, buf);
        for i in 0..v.statuses.len() {
            let d = DescriptorFields::of(v, i);
            message_header(5, d.len(), buf);
            d.encode(buf);
        }
        some_varint(6, f.retry_after_ms, buf);
        opt_varint(7, f.reset_after_ms, buf);
        some_varint(8, f.remaining, buf);
    }
}

impl NativeService {
    /// A service deciding with `decider`.
    pub fn new(decider: Arc<Decider>) -> Self {
        NativeService { decider }
    }

    /// The tonic server for this service ([`NativeServer`]: `Check` answers are encoded
    /// without building the response message).
    pub fn into_server(self) -> NativeServer {
        NativeServer::new(self)
    }

    /// Decides a decoded `Check` request: the whole translation from the decoded message to
    /// the answer the server encodes, which allocates nothing for a valid request
    /// (`tests/allocations.rs`).
    ///
    /// # Errors
    /// [`ApiError`] for invalid input or too many tracked requests; nothing is spent.
    pub async fn check_answer(&self, r: &pb::CheckRequest) -> Result<NativeAnswer, ApiError> {
        let w = self.invalid(WireRequest::read(&r.domain, &r.descriptors, "cost", r.cost))?;
        let descriptors = w.descriptors();
        let req = w.request(&descriptors);
        let v = self.decider.check(&req, Some(&r.request_id)).await?;
        Ok(NativeAnswer(v))
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
        let answer = self.check_answer(request.get_ref()).await?;
        Ok(Response::new(answer.to_response()))
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
