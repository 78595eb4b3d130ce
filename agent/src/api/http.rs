//! HTTP (axum): `POST /v1/check` and the reservation calls, `GET /healthz`, `GET /v1/status`
//! and `GET /metrics`.
//!
//! `POST /v1/check` takes `{"domain", "descriptors": [{"entries": [{"key", "value"}],
//! "hits_addend"?}], "cost"?, "request_id"?}` and answers 200 with the decision as JSON, or 429
//! with `Retry-After` (whole seconds), `Cache-Control: no-store` and
//! `{"error":"rate_limit_exceeded","policy":"<rule name>-v<version>"}`; both carry the RateLimit
//! headers. Malformed JSON or invalid input is 400 with `{"error":"invalid_argument",
//! "message": "..."}` naming the problem; nothing is spent.

use super::native::{DecisionFields, DescriptorFields};
use super::{
    rate_limit_header_values, ApiError, Decider, Verdict, WireDescriptor, WireEntry, WireRequest,
};
use crate::metrics::allocations_held;
use crate::tracked::TrackingError;
use allot_common::descriptor::{RequestError, MAX_DESCRIPTORS, MAX_ENTRIES};
use allot_common::units::{Micros, MICROS_PER_TOKEN, NANOS_PER_MILLI};
use allot_proto::allot::v1 as pb;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use smallvec::SmallVec;
use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One descriptor entry of the JSON API. Its strings borrow from the request body unless
/// they hold JSON escapes (then they are unescaped into their own).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonEntry<'a> {
    /// Key.
    #[serde(borrow)]
    pub key: Cow<'a, str>,
    /// Value.
    #[serde(borrow)]
    pub value: Cow<'a, str>,
}

/// Entries of one descriptor held inline, without allocating (issue 13 item 5).
pub const INLINE_JSON_ENTRIES: usize = 4;
/// Descriptors of a request held inline, without allocating.
pub const INLINE_JSON_DESCRIPTORS: usize = 4;

/// One descriptor of the JSON API.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonDescriptor<'a> {
    /// Entries, outermost first; more than [`MAX_ENTRIES`] are refused while reading.
    #[serde(borrow, deserialize_with = "bounded_entries")]
    pub entries: SmallVec<[JsonEntry<'a>; INLINE_JSON_ENTRIES]>,
    /// Its own cost, tokens.
    #[serde(default)]
    pub hits_addend: Option<u64>,
}

impl WireEntry for JsonEntry<'_> {
    fn key(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.value
    }
}

impl<'a> WireDescriptor for JsonDescriptor<'a> {
    type Entry = JsonEntry<'a>;
    fn entries(&self) -> &[JsonEntry<'a>] {
        &self.entries
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// Body of `POST /v1/check` and `POST /v1/reserve`, borrowed from the request's bytes: a body
/// of up to [`INLINE_JSON_DESCRIPTORS`] descriptors of up to [`INLINE_JSON_ENTRIES`] entries
/// without escapes is read without allocating.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckBody<'a> {
    /// Domain.
    #[serde(borrow)]
    pub domain: Cow<'a, str>,
    /// Descriptors; more than [`MAX_DESCRIPTORS`] are refused while reading.
    #[serde(borrow, deserialize_with = "bounded_descriptors")]
    pub descriptors: SmallVec<[JsonDescriptor<'a>; INLINE_JSON_DESCRIPTORS]>,
    /// Cost of descriptors without their own (tokens; absent or 0 means 1). For a reserve: the
    /// maximum cost.
    #[serde(default, alias = "max_cost")]
    pub cost: Option<u64>,
    /// Request id (holds concurrency slots; idempotency key of a reserve).
    #[serde(default, borrow, deserialize_with = "borrowed_str")]
    pub request_id: Option<Cow<'a, str>>,
    /// Reservation lifetime, ms (reserve only).
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// An optional string borrowed from the body like the others (serde borrows a bare
/// `Cow<str>` on its own, not one inside an `Option`).
fn borrowed_str<'de: 'a, 'a, D: Deserializer<'de>>(d: D) -> Result<Option<Cow<'a, str>>, D::Error> {
    #[derive(Deserialize)]
    struct Borrowed<'a>(#[serde(borrow)] Cow<'a, str>);
    Ok(Option::<Borrowed<'a>>::deserialize(d)?.map(|b| b.0))
}

fn bounded_descriptors<'de: 'a, 'a, D: Deserializer<'de>>(
    d: D,
) -> Result<SmallVec<[JsonDescriptor<'a>; INLINE_JSON_DESCRIPTORS]>, D::Error> {
    d.deserialize_seq(Bounded {
        max: MAX_DESCRIPTORS,
        too_many: |got, max| RequestError::TooManyDescriptors { got, max }.to_string(),
        items: PhantomData,
    })
}

fn bounded_entries<'de: 'a, 'a, D: Deserializer<'de>>(
    d: D,
) -> Result<SmallVec<[JsonEntry<'a>; INLINE_JSON_ENTRIES]>, D::Error> {
    d.deserialize_seq(Bounded {
        max: MAX_ENTRIES,
        too_many: |got, max| format!("a descriptor has {got} entries; at most {max} are accepted"),
        items: PhantomData,
    })
}

/// Reads a JSON array of at most `max` items: past it, the rest is skipped unread (only
/// counted, for the message) and the body refused, so a body of a million empty descriptors
/// costs its bytes, not a million descriptors' worth of memory (the limits the decision core
/// would refuse anyway, design §10 "Keys").
struct Bounded<A> {
    max: usize,
    too_many: fn(usize, usize) -> String,
    items: PhantomData<A>,
}

impl<'de, A> Visitor<'de> for Bounded<A>
where
    A: smallvec::Array,
    A::Item: Deserialize<'de>,
{
    type Value = SmallVec<A>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "an array of at most {} items", self.max)
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        let mut out = SmallVec::new();
        while let Some(item) = seq.next_element()? {
            if out.len() == self.max {
                let mut got = self.max.saturating_add(1);
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    got = got.saturating_add(1);
                }
                return Err(de::Error::custom((self.too_many)(got, self.max)));
            }
            out.push(item);
        }
        Ok(out)
    }
}

/// Body of `POST /v1/settle`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleBody {
    /// The reservation.
    pub reservation_id: String,
    /// Actual cost, tokens.
    pub actual_cost: u64,
}

/// Body of `POST /v1/done`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DoneBody {
    /// The finished request.
    pub request_id: String,
}

fn code_name(c: i32) -> &'static str {
    if c == pb::DecisionCode::OverLimit as i32 {
        "OVER_LIMIT"
    } else {
        "OK"
    }
}

/// The proto reason's name without its prefix, in lower case (`within_limit`, `over_limit`…).
fn reason_name(r: i32) -> &'static str {
    use pb::DecisionReason as R;
    match R::try_from(r).unwrap_or(R::Unspecified) {
        R::Unspecified => "unspecified",
        R::NoRule => "no_rule",
        R::Unlimited => "unlimited",
        R::WithinLimit => "within_limit",
        R::OverLimit => "over_limit",
        R::CostExceedsCapacity => "cost_exceeds_capacity",
        R::KeyTableFull => "key_table_full",
        R::ConcurrencyLimit => "concurrency_limit",
        R::OtherDescriptor => "other_descriptor",
        R::AllocatorUnreachable => "allocator_unreachable",
    }
}

/// A verdict's JSON answer (the native `Decision`), serialized straight from the verdict: no
/// intermediate message and no string copied (issue 13 item 5). Fields: `code` (`OK` or
/// `OVER_LIMIT`), `reason`, `policy` (the deciding rule's name), `policy_version`,
/// `descriptors` (per descriptor: `code`, `reason`, `policy`, `remaining` whole tokens and with
/// it `requests_per_unit` and `unit`, `reset_after_ms`, `shadow_over_limit`, `max_in_flight`),
/// `retry_after_ms` (on OVER_LIMIT), `reset_after_ms` and `remaining` of the deciding limit.
#[derive(Debug, Clone, Copy)]
pub struct JsonAnswer<'a>(pub &'a Verdict);

impl Serialize for JsonAnswer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_struct("Decision", 8)?;
        decision_fields(&mut m, self.0)?;
        m.end()
    }
}

/// The members of a verdict's [`JsonAnswer`], in order.
fn decision_fields<M: SerializeStruct>(m: &mut M, v: &Verdict) -> Result<(), M::Error> {
    let f = DecisionFields::of(v);
    m.serialize_field("code", code_name(f.code))?;
    m.serialize_field("reason", reason_name(f.reason))?;
    m.serialize_field("policy", f.policy)?;
    m.serialize_field("policy_version", &f.policy_version)?;
    m.serialize_field("descriptors", &JsonDescriptorAnswers(v))?;
    optional(m, "retry_after_ms", f.retry_after_ms)?;
    m.serialize_field("reset_after_ms", &f.reset_after_ms)?;
    optional(m, "remaining", f.remaining)
}

/// The body of an HTTP answer to a check or a reserve, written straight from the verdict
/// (allocating nothing, issue 13 item 5): allowed, the [`JsonAnswer`] members followed, for a
/// reserve, by `reservation_id` and `expires_in_ms`; denied (429),
/// `{"error":"rate_limit_exceeded","policy":"<rule name>-v<version>"}` with `"reason":"never"`
/// when waiting cannot help (a cost above the limit's capacity: no Retry-After then), or
/// `"reason":"allocator_unreachable"` when only a failure mode denied (design §7).
#[derive(Debug, Clone, Copy)]
pub struct HttpAnswer<'a> {
    /// The decision.
    pub verdict: &'a Verdict,
    /// A reserve's reservation id and lifetime, ms.
    pub reservation: Option<(&'a str, u64)>,
}

impl HttpAnswer<'_> {
    /// 200 when allowed, else 429.
    pub fn status(&self) -> StatusCode {
        if self.verdict.is_ok() {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        }
    }
}

impl Serialize for HttpAnswer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.verdict;
        if v.is_ok() {
            let mut m = s.serialize_struct("Decision", 10)?;
            decision_fields(&mut m, v)?;
            if let Some((id, expires_in_ms)) = self.reservation {
                m.serialize_field("reservation_id", id)?;
                m.serialize_field("expires_in_ms", &expires_in_ms)?;
            }
            return m.end();
        }
        let mut m = s.serialize_struct("RateLimited", 3)?;
        m.serialize_field("error", "rate_limit_exceeded")?;
        let (name, version) = v.policy_label_parts();
        m.serialize_field("policy", &Label(name, version))?;
        if v.never_passes() {
            // No Retry-After: waiting does not help, the cost is above the limit's capacity.
            m.serialize_field("reason", "never")?;
        } else if v.denied_unreachable() {
            // Not the contract: the limiter could not reach its control plane (failure mode).
            m.serialize_field("reason", "allocator_unreachable")?;
        }
        m.end()
    }
}

/// `<name>-v<version>` written where it goes, without building the string.
struct Label<'a>(&'a str, u64);

impl Serialize for Label<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{}-v{}", self.0, self.1))
    }
}

/// `field` when given, else skipped (absent from the JSON, as in the native answer).
fn optional<M: SerializeStruct>(
    m: &mut M,
    field: &'static str,
    v: Option<u64>,
) -> Result<(), M::Error> {
    match v {
        Some(x) => m.serialize_field(field, &x),
        None => m.skip_field(field),
    }
}

/// The per-descriptor answers of a verdict, in request order.
struct JsonDescriptorAnswers<'a>(&'a Verdict);

impl Serialize for JsonDescriptorAnswers<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        let mut seq = s.serialize_seq(Some(v.statuses.len()))?;
        for i in 0..v.statuses.len() {
            seq.serialize_element(&JsonDescriptorAnswer(DescriptorFields::of(v, i)))?;
        }
        seq.end()
    }
}

struct JsonDescriptorAnswer<'a>(DescriptorFields<'a>);

impl Serialize for JsonDescriptorAnswer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let x = &self.0;
        let mut m = s.serialize_struct("DescriptorDecision", 9)?;
        m.serialize_field("code", code_name(x.code))?;
        m.serialize_field("reason", reason_name(x.reason))?;
        m.serialize_field("policy", x.policy)?;
        optional(&mut m, "remaining", x.remaining)?;
        // The limit's size goes with what is left of it: both or neither.
        optional(
            &mut m,
            "requests_per_unit",
            x.remaining.map(|_| x.requests_per_unit),
        )?;
        match x.remaining {
            Some(_) => m.serialize_field("unit", x.unit)?,
            None => m.skip_field("unit")?,
        }
        m.serialize_field("reset_after_ms", &x.reset_after_ms)?;
        m.serialize_field("shadow_over_limit", &x.shadow_over_limit)?;
        optional(&mut m, "max_in_flight", x.max_in_flight)?;
        m.end()
    }
}

/// An error answer: status code and `{"error", "message"}`.
fn error_response(e: &ApiError) -> Response {
    let (status, kind) = match e {
        _ if e.is_invalid_argument() => (StatusCode::BAD_REQUEST, "invalid_argument"),
        ApiError::Tracking(TrackingError::NotFound(_)) => (StatusCode::NOT_FOUND, "not_found"),
        ApiError::Tracking(TrackingError::Expired(_)) => (StatusCode::GONE, "expired"),
        ApiError::Tracking(TrackingError::InProgress(_)) => (StatusCode::CONFLICT, "in_progress"),
        ApiError::Tracking(TrackingError::TooMany { .. }) => {
            (StatusCode::SERVICE_UNAVAILABLE, "too_many_in_flight")
        }
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    };
    (
        status,
        Json(json!({"error": kind, "message": e.to_string()})),
    )
        .into_response()
}

// The error is the finished 400 response, returned at once: boxing it would buy nothing.
#[allow(clippy::result_large_err)]
fn parse<'a, T: Deserialize<'a>>(g: &Decider, body: &'a [u8]) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        g.count_invalid();
        error_response(&ApiError::Malformed(format!("malformed JSON body: {e}")))
    })
}

/// `status` with `value` as its JSON body (`Content-Type: application/json`).
fn json_body(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(bytes) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            bytes,
        )
            .into_response(),
        // Unreachable for these types (serde_json fails only on non-string map keys); said
        // rather than panicking.
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "internal", "message": format!("answer not encoded: {e}")})),
        )
            .into_response(),
    }
}

/// The RateLimit headers (and on a denial `Retry-After` and `Cache-Control: no-store`).
fn with_headers(mut resp: Response, v: &Verdict) -> Response {
    let h = resp.headers_mut();
    for (k, n) in rate_limit_header_values(v) {
        if let Some(k) = header_name(k) {
            h.insert(k, HeaderValue::from(n));
        }
    }
    if !v.is_ok() {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    resp
}

/// The header named `k` (one of [`rate_limit_header_values`]'s names), without parsing or
/// copying the name on every answer: HTTP names are case-insensitive and sent in lower case.
fn header_name(k: &'static str) -> Option<HeaderName> {
    Some(match k {
        "RateLimit-Limit" => HeaderName::from_static("ratelimit-limit"),
        "RateLimit-Remaining" => HeaderName::from_static("ratelimit-remaining"),
        "RateLimit-Reset" => HeaderName::from_static("ratelimit-reset"),
        "retry-after" => header::RETRY_AFTER,
        other => return HeaderName::from_bytes(other.as_bytes()).ok(),
    })
}

/// 200 with the decision, or 429 with the rate-limit body ([`HttpAnswer`]), and the headers.
fn decided(v: &Verdict, reservation: Option<(&str, u64)>) -> Response {
    let answer = HttpAnswer {
        verdict: v,
        reservation,
    };
    with_headers(json_body(answer.status(), &answer), v)
}

/// A check or reserve body read for the core, its cost named `cost_field`; an invalid one is
/// counted and answered with 400.
fn read_wire<'b, 'a>(
    g: &Decider,
    b: &'b CheckBody<'a>,
    cost_field: &str,
) -> Result<WireRequest<'b, JsonDescriptor<'a>>, Box<Response>> {
    WireRequest::read(&b.domain, &b.descriptors, cost_field, b.cost.unwrap_or(0)).map_err(|e| {
        g.count_invalid();
        Box::new(error_response(&e))
    })
}

async fn check(State(g): State<Arc<Decider>>, body: Bytes) -> Response {
    let b: CheckBody = match parse(&g, &body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let w = match read_wire(&g, &b, "cost") {
        Ok(w) => w,
        Err(r) => return *r,
    };
    let descriptors = w.descriptors();
    let req = w.request(&descriptors);
    match g.check(&req, b.request_id.as_deref()).await {
        Ok(v) => decided(&v, None),
        Err(e) => error_response(&e),
    }
}

async fn reserve(State(g): State<Arc<Decider>>, body: Bytes) -> Response {
    let b: CheckBody = match parse(&g, &body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let w = match read_wire(&g, &b, "max_cost") {
        Ok(w) => w,
        Err(r) => return *r,
    };
    let descriptors = w.descriptors();
    let req = w.request(&descriptors);
    match g
        .reserve(&req, b.request_id.as_deref(), b.ttl_ms.unwrap_or(0))
        .await
    {
        Ok(res) => decided(
            &res.verdict,
            Some((&res.reservation_id, res.expires_in / NANOS_PER_MILLI)),
        ),
        Err(e) => error_response(&e),
    }
}

async fn settle(State(g): State<Arc<Decider>>, body: Bytes) -> Response {
    let b: SettleBody = match parse(&g, &body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match g.settle(&b.reservation_id, b.actual_cost) {
        Ok(s) => Json(json!({
            "refunded": s.refunded,
            "actual_cost": s.actual_cost,
            "already_settled": s.already_settled,
        }))
        .into_response(),
        Err(e) => error_response(&e),
    }
}

async fn done(State(g): State<Arc<Decider>>, body: Bytes) -> Response {
    let b: DoneBody = match parse(&g, &body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    Json(json!({"released_slots": g.done(&b.request_id)})).into_response()
}

async fn healthz() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

fn tokens(m: Micros) -> f64 {
    m as f64 / MICROS_PER_TOKEN as f64
}

/// The `/v1/status` document: allocations held per key (microtokens), the overshoot bound,
/// whether the allocator is reachable, concurrency slots in use, tracked requests.
pub fn status(g: &Decider) -> Value {
    let e = g.enforcer();
    let book = e.book();
    let now = e.clock().now();
    let mut keys = Vec::new();
    for t in book.tables() {
        for k in t.snapshot() {
            let v = &k.value;
            let allocations: Vec<Value> = v
                .allocations()
                .iter()
                .map(|a| {
                    json!({
                        "id": a.id,
                        "epoch": a.epoch,
                        "granted_micros": a.granted,
                        "spent_micros": a.spent(),
                        "reported_micros": a.reported(),
                        "deadline_in_ms": a.deadline.saturating_sub(now) / NANOS_PER_MILLI,
                        "expired": a.is_expired(now),
                        "expires_at_unix_ms": a.expires_at_unix_ms,
                        "policy_version": a.policy_version,
                    })
                })
                .collect();
            keys.push(json!({
                "domain": v.domain,
                "entries": v.entries.iter().map(|(k, val)| json!({"key": k, "value": val})).collect::<Vec<_>>(),
                "policy": v.rule_name,
                "allocations": allocations,
                "remaining_micros": v.remaining(now),
                "emergency_admitted_micros": v.emergency_admitted.load(Ordering::Relaxed),
            }));
        }
    }
    let bound = book.overshoot_bound();
    let c = &book.counters;
    json!({
        "agent_id": e.settings().agent_id,
        "region": e.settings().region,
        "policy_version": e.snapshot().version,
        "allocator_reachable": book.is_reachable(),
        "overshoot_bound_micros": bound,
        "overshoot_bound_tokens": tokens(bound),
        "allocations_held": allocations_held(book),
        "keys": keys,
        "concurrency": e.slots().usage().into_iter().map(|(policy, keys, in_flight)| json!({
            "policy": policy, "keys": keys, "in_flight": in_flight,
        })).collect::<Vec<_>>(),
        "tracked_requests": g.tracked(),
        "counters": {
            "cold_waits": c.cold_waits.load(Ordering::Relaxed),
            "wait_timeouts": c.wait_timeouts.load(Ordering::Relaxed),
            "handoff_waits": c.handoff_waits.load(Ordering::Relaxed),
            "denials_held": c.denials_held.load(Ordering::Relaxed),
            "accrual_denials": c.accrual_denials.load(Ordering::Relaxed),
            "acquires": c.acquires.load(Ordering::Relaxed),
            "reports": c.reports.load(Ordering::Relaxed),
            "releases": c.releases.load(Ordering::Relaxed),
            "rpc_errors": c.rpc_errors.load(Ordering::Relaxed),
            "unreachable_episodes": c.unreachable_episodes.load(Ordering::Relaxed),
            "emergency_admits": c.emergency_admits.load(Ordering::Relaxed),
            "failure_denials": c.failure_denials.load(Ordering::Relaxed),
            "fuse_rejects": c.fuse_rejects.load(Ordering::Relaxed),
            "key_refusals": c.key_refusals.load(Ordering::Relaxed),
            "decides": c.decides.load(Ordering::Relaxed),
            "central_admits": c.central_admits.load(Ordering::Relaxed),
            "promotions": c.promotions.load(Ordering::Relaxed),
            "demotions": c.demotions.load(Ordering::Relaxed),
            "calls": c.calls.load(Ordering::Relaxed),
        },
    })
}

async fn status_page(State(g): State<Arc<Decider>>) -> Response {
    Json(status(&g)).into_response()
}

async fn metrics(State(g): State<Arc<Decider>>) -> Response {
    match g.metrics().encode() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The HTTP routes over `decider`.
pub fn router(decider: Arc<Decider>) -> Router {
    Router::new()
        .route("/v1/check", post(check))
        .route("/v1/reserve", post(reserve))
        .route("/v1/settle", post(settle))
        .route("/v1/done", post(done))
        .route("/v1/status", get(status_page))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        // After the routes: it applies to those registered before it.
        .method_not_allowed_fallback(wrong_method)
        .fallback(unknown_path)
        .with_state(decider)
}

/// 404 for a path the agent does not serve, in the JSON of every other error answer
/// (`{"error", "message"}`) rather than an empty body.
async fn unknown_path(uri: Uri) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({
            "error": "not_found",
            "message": format!("no such path: {}", uri.path()),
        })),
    )
        .into_response()
}

/// 405 for a served path asked with another method, as JSON; axum adds the `Allow` header
/// naming the methods the path serves.
async fn wrong_method(method: Method, uri: Uri) -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(json!({
            "error": "method_not_allowed",
            "message": format!("{method} is not served on {}", uri.path()),
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_names_are_the_ones_parsing_would_give() {
        for k in [
            "RateLimit-Limit",
            "RateLimit-Remaining",
            "RateLimit-Reset",
            "retry-after",
            "X-Other",
        ] {
            assert_eq!(
                header_name(k),
                HeaderName::from_bytes(k.as_bytes()).ok(),
                "{k}"
            );
        }
        assert_eq!(header_name("not a name"), None);
    }
}
