//! Envoy's rate limit service v3 (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`),
//! wire-compatible with Envoy's HTTP and network rate-limit filters.
//!
//! Translation only: the request is borrowed into the decision core's form (no string copied)
//! and decided by the [`Decider`]; the answer carries one status per descriptor
//! (`current_limit`, `limit_remaining`, `duration_until_reset`), the overall code, the RateLimit
//! headers of the most restrictive descriptor and `retry-after` on OVER_LIMIT.
//!
//! Envoy's rate-limit filter lets a request through when the service answers with an error
//! (its `failure_mode_deny` defaults to false), so an answer that must refuse is never an error
//! (issue 10 item 16): a cost beyond the limit's capacity is OVER_LIMIT with no `retry-after`
//! (it can never pass, as in the decision core's answer). An unknown domain is OK with one status
//! per descriptor and no limit, as envoyproxy/ratelimit answers it: no configured limit applies.
//! Invalid input (empty or oversized descriptors, a cost beyond `u32`, `is_negative_hits`) is
//! refused the same way, never as an error: descriptor values usually come from request headers,
//! so an INVALID_ARGUMENT for a 2 KB `x-tenant` header would let that client past every limit.
//! It is OVER_LIMIT on every descriptor, without `retry-after`, with
//! `{"error":"invalid_argument","message":…}` naming the problem as `raw_body` (the body Envoy
//! sends with its 429); nothing is spent and the agent counts it as invalid. A string field that
//! is not UTF-8 (Envoy copies HTTP/1 header bytes 0x80–0xFF into them unchecked) is refused the
//! same way, naming the field: the server's decoder (`rls/wire.rs`) hands the handler an
//! [`RlsRequest::NotUtf8`] instead of failing the call. Only a body that is not a protobuf at
//! all is INVALID_ARGUMENT (refused by that decoder; Envoy never sends one). A descriptor's `limit`
//! override is ignored: the configured limit always applies (an override from the data plane
//! would let any client raise its own limit).

use super::{
    borrow_descriptors, borrow_entries, rate_limit_headers, request_cost, rule_limit, ApiError,
    Decider, Verdict, WireDescriptor, WireEntry,
};
use allot_common::config::Unit;
use allot_common::descriptor::{Request, RequestError};
use allot_common::limiter::Code;
use allot_common::units::NANOS_PER_SEC;
use allot_proto::envoy::config::core::v3::HeaderValue;
use allot_proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor, RateLimitDescriptor,
};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::{
    self, rate_limit::Unit as PbUnit, DescriptorStatus as PbStatus, RateLimit as PbLimit,
};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use allot_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use allot_proto::prost_types::Duration as PbDuration;
use std::sync::Arc;
use tonic::{Request as TonicRequest, Response, Status};

mod answer;
mod wire;
pub use answer::RlsAnswer;
pub use wire::{RlsCodec, RlsDecoder, RlsEncoder, RlsRequest, RlsServer};

impl WireEntry for rate_limit_descriptor::Entry {
    fn key(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.value
    }
}

impl WireDescriptor for RateLimitDescriptor {
    type Entry = rate_limit_descriptor::Entry;
    fn entries(&self) -> &[Self::Entry] {
        &self.entries
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// The RLS service over a [`Decider`].
#[derive(Debug, Clone)]
pub struct RlsService {
    decider: Arc<Decider>,
}

impl RlsService {
    /// A service deciding with `decider`.
    pub fn new(decider: Arc<Decider>) -> Self {
        RlsService { decider }
    }

    /// The tonic server for this service, whose decoder refuses non-UTF-8 strings as OVER_LIMIT
    /// instead of erring ([`RlsServer`]).
    pub fn into_server(self) -> RlsServer {
        RlsServer::new(self)
    }

    /// Answers one decoded `ShouldRateLimit` body; invalid input (including a string field that
    /// is not UTF-8) is OVER_LIMIT with the reason ([`refused_invalid`]), never an error.
    ///
    /// # Errors
    /// A [`Status`] only when the agent itself fails (not for anything the caller sent).
    pub async fn answer(&self, request: RlsRequest) -> Result<RlsAnswer, Status> {
        match request {
            RlsRequest::Valid(r) => self.answer_decoded(&r).await,
            RlsRequest::NotUtf8 { field, descriptors } => {
                self.decider.count_invalid();
                let e = ApiError::Malformed(format!("{field} is not UTF-8"));
                Ok(RlsAnswer::Built(refused_invalid(descriptors, &e)))
            }
        }
    }

    /// [`Self::decide_answer`], with invalid input refused as OVER_LIMIT instead of returned:
    /// the whole translation from a decoded request to the answer the server encodes, which
    /// allocates nothing for a valid request of a known domain (`tests/allocations.rs`).
    ///
    /// # Errors
    /// As [`answer`](Self::answer).
    pub async fn answer_decoded(&self, r: &RateLimitRequest) -> Result<RlsAnswer, Status> {
        match self.decide_answer(r).await {
            Ok(a) => Ok(a),
            // Fail closed: an error would let the request through Envoy (issue 10 item 16).
            Err(e) if e.is_invalid_argument() => {
                Ok(RlsAnswer::Built(refused_invalid(r.descriptors.len(), &e)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Decides one request and translates the answer; an unknown domain is OK with no limits.
    ///
    /// # Errors
    /// [`ApiError`] for malformed input (nothing spent).
    pub async fn decide(&self, r: &RateLimitRequest) -> Result<RateLimitResponse, ApiError> {
        Ok(self.decide_answer(r).await?.to_response())
    }

    /// [`decide`](Self::decide), answering with an [`RlsAnswer`] (encoded without building
    /// the response message).
    async fn decide_answer(&self, r: &RateLimitRequest) -> Result<RlsAnswer, ApiError> {
        if let Some(i) = r.descriptors.iter().position(|d| d.is_negative_hits) {
            self.decider.count_invalid();
            return Err(ApiError::Malformed(format!(
                "descriptors[{i}].is_negative_hits is not supported: hits are only ever spent"
            )));
        }
        let hits = request_cost("hits_addend", u64::from(r.hits_addend))
            .inspect_err(|_| self.decider.count_invalid())?;
        let entries =
            borrow_entries(&r.descriptors).inspect_err(|_| self.decider.count_invalid())?;
        let descriptors = borrow_descriptors(&r.descriptors, &entries);
        let req = Request {
            domain: &r.domain,
            descriptors: &descriptors,
            hits_addend: hits,
        };
        match self.decider.check(&req, None).await {
            Ok(v) => Ok(RlsAnswer::Decided(v)),
            Err(ApiError::Invalid(RequestError::UnknownDomain(_))) => {
                Ok(RlsAnswer::UnknownDomain(r.descriptors.len()))
            }
            Err(e) => Err(e),
        }
    }
}

/// The answer for a domain no config names: OK, one status per descriptor without a limit (as
/// envoyproxy/ratelimit answers a domain it does not know).
fn unknown_domain(descriptors: usize) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: rate_limit_response::Code::Ok as i32,
        statuses: (0..descriptors)
            .map(|_| PbStatus {
                code: rate_limit_response::Code::Ok as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// The answer for a request the agent cannot decide because its input is invalid (`e`, already
/// counted): OVER_LIMIT on every descriptor with no `retry-after` and the reason as a JSON
/// `raw_body`, never an RLS error (Envoy lets a request through on one by default).
fn refused_invalid(descriptors: usize, e: &ApiError) -> RateLimitResponse {
    let over = rate_limit_response::Code::OverLimit as i32;
    let body = serde_json::json!({"error": "invalid_argument", "message": e.to_string()});
    RateLimitResponse {
        overall_code: over,
        statuses: (0..descriptors)
            .map(|_| PbStatus {
                code: over,
                ..Default::default()
            })
            .collect(),
        response_headers_to_add: vec![HeaderValue {
            key: "content-type".to_string(),
            value: "application/json".to_string(),
            raw_value: Vec::new(),
        }],
        raw_body: body.to_string().into_bytes(),
        ..Default::default()
    }
}

/// Envoy's unit for a configured unit.
fn unit(u: Unit) -> PbUnit {
    match u {
        Unit::Second => PbUnit::Second,
        Unit::Minute => PbUnit::Minute,
        Unit::Hour => PbUnit::Hour,
        Unit::Day => PbUnit::Day,
    }
}

fn code(c: Code) -> rate_limit_response::Code {
    match c {
        Code::Ok => rate_limit_response::Code::Ok,
        Code::OverLimit => rate_limit_response::Code::OverLimit,
    }
}

/// Nanoseconds as a protobuf Duration (exact).
fn duration(ns: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(ns / NANOS_PER_SEC).unwrap_or(i64::MAX),
        nanos: (ns % NANOS_PER_SEC) as i32,
    }
}

/// Translates a verdict into Envoy's response.
pub fn response(v: &Verdict) -> RateLimitResponse {
    let statuses = v
        .statuses
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let limit = s.limit.and(v.rule(i)).and_then(|r| {
                let (rpu, u, _) = rule_limit(r)?;
                Some(PbLimit {
                    name: r.name.clone(),
                    requests_per_unit: u32::try_from(rpu).unwrap_or(u32::MAX),
                    unit: unit(u) as i32,
                })
            });
            PbStatus {
                code: code(s.code) as i32,
                limit_remaining: if limit.is_some() {
                    u32::try_from(s.remaining).unwrap_or(u32::MAX)
                } else {
                    0
                },
                duration_until_reset: limit.as_ref().map(|_| duration(s.reset_after)),
                current_limit: limit,
                quota: None,
            }
        })
        .collect();
    RateLimitResponse {
        overall_code: code(v.outcome.code) as i32,
        statuses,
        response_headers_to_add: rate_limit_headers(v)
            .into_iter()
            .map(|(k, val)| HeaderValue {
                key: k.to_string(),
                value: val,
                raw_value: Vec::new(),
            })
            .collect(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: TonicRequest<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let answer = self.answer_decoded(request.get_ref()).await?;
        Ok(Response::new(answer.to_response()))
    }
}
