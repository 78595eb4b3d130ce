//! The gateway-facing APIs: Envoy's rate limit service ([`rls`]), the native gRPC service
//! ([`native`]) and HTTP ([`http`]). They only translate wire formats: every decision goes
//! through [`Gateway`], which calls the one [`Enforcer`] and keeps what outlives a decision
//! (reservations and concurrency slots, by request id) and the metrics.

pub mod http;
pub mod native;
pub mod refund;
pub mod rls;

use crate::enforce::Enforcer;
use crate::inflight::{Begin, InFlight, InFlightError, OwnedRequest, Reservation};
use crate::lease::Charged;
use crate::metrics::Metrics;
use allot_common::config::{ConfigSet, Rule, RuleLimit};
use allot_common::descriptor::{
    Descriptor, Entry, Request, RequestError, MAX_COST_TOKENS, MAX_DESCRIPTORS, MAX_ENTRIES,
};
use allot_common::limiter::{Code, DescriptorStatus, Outcome, Reason, Snapshot};
use allot_common::units::{millis_to_nanos, Nanos};
use allot_common::RetryAfter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Settings of the gateway layer (request tracking), in milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewaySettings {
    /// A reservation's lifetime when the Reserve does not say, ms (default 30 000).
    pub default_reserve_ttl_ms: u64,
    /// Longest lifetime a Reserve may ask for, ms (default 3 600 000).
    pub max_reserve_ttl_ms: u64,
    /// How long a checked request's concurrency slots are held without a `Done`, ms (default
    /// 60 000): a gateway that forgets a request cannot leak its slots for longer.
    pub slot_ttl_ms: u64,
    /// How long a settled or expired reservation is remembered (repeated Settles get the same
    /// answer), ms (default 300 000).
    pub tombstone_ms: u64,
    /// Most requests tracked at once (memory bound; default 100 000).
    pub max_tracked: usize,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            default_reserve_ttl_ms: 30_000,
            max_reserve_ttl_ms: 3_600_000,
            slot_ttl_ms: 60_000,
            tombstone_ms: 300_000,
            max_tracked: 100_000,
        }
    }
}

/// Why a gateway call was refused. Nothing is spent for any of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed (sizes, emptiness, costs, unknown domain).
    #[error("{0}")]
    Invalid(#[from] RequestError),
    /// A field could not be read (wire-format problem), with the field named.
    #[error("{0}")]
    Malformed(String),
    /// Reservations and in-flight tracking.
    #[error(transparent)]
    InFlight(#[from] InFlightError),
}

impl ApiError {
    /// Whether the caller sent something invalid (INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_argument(&self) -> bool {
        matches!(
            self,
            ApiError::Invalid(_)
                | ApiError::Malformed(_)
                | ApiError::InFlight(InFlightError::NotAReservation(_))
        )
    }
}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> Self {
        let msg = e.to_string();
        match e {
            _ if e.is_invalid_argument() => tonic::Status::invalid_argument(msg),
            ApiError::InFlight(InFlightError::NotFound(_)) => tonic::Status::not_found(msg),
            ApiError::InFlight(InFlightError::Expired(_)) => {
                tonic::Status::failed_precondition(msg)
            }
            ApiError::InFlight(InFlightError::InProgress(_)) => tonic::Status::aborted(msg),
            ApiError::InFlight(InFlightError::TooMany { .. }) => {
                tonic::Status::resource_exhausted(msg)
            }
            _ => tonic::Status::internal(msg),
        }
    }
}

/// A descriptor as a wire format carries it; implemented by each adapter's message type.
pub trait WireDescriptor {
    /// The entry type.
    type Entry: WireEntry;
    /// Entries, outermost first.
    fn entries(&self) -> &[Self::Entry];
    /// Its own cost, tokens, when given.
    fn hits_addend(&self) -> Option<u64>;
}

/// A descriptor entry as a wire format carries it.
pub trait WireEntry {
    /// Key.
    fn key(&self) -> &str;
    /// Value.
    fn value(&self) -> &str;
}

/// Borrows the entries of `descs` as the decision core's [`Entry`]s (no string is copied).
/// Counts are checked here, before anything is collected, so an oversized request costs no
/// more than its own decoding.
///
/// # Errors
/// [`RequestError::TooManyDescriptors`] or [`RequestError::TooManyEntries`].
pub fn borrow_entries<D: WireDescriptor>(descs: &[D]) -> Result<Vec<Entry<'_>>, RequestError> {
    if descs.len() > MAX_DESCRIPTORS {
        return Err(RequestError::TooManyDescriptors {
            got: descs.len(),
            max: MAX_DESCRIPTORS,
        });
    }
    let mut total = 0;
    for (i, d) in descs.iter().enumerate() {
        if d.entries().len() > MAX_ENTRIES {
            return Err(RequestError::TooManyEntries {
                descriptor: i,
                got: d.entries().len(),
                max: MAX_ENTRIES,
            });
        }
        total += d.entries().len();
    }
    let mut out = Vec::with_capacity(total);
    for d in descs {
        out.extend(d.entries().iter().map(|e| Entry {
            key: e.key(),
            value: e.value(),
        }));
    }
    Ok(out)
}

/// The decision core's descriptors over `entries` (from [`borrow_entries`] of the same `descs`).
pub fn borrow_descriptors<'a, D: WireDescriptor>(
    descs: &[D],
    entries: &'a [Entry<'a>],
) -> Vec<Descriptor<'a>> {
    let mut out = Vec::with_capacity(descs.len());
    let mut at = 0;
    for d in descs {
        let n = d.entries().len();
        out.push(Descriptor {
            entries: &entries[at..at + n],
            hits_addend: d.hits_addend(),
        });
        at += n;
    }
    out
}

/// A request-level cost from a wire field where 0 means 1.
///
/// # Errors
/// [`ApiError::Malformed`] when it exceeds `u32` (Envoy's `hits_addend` range).
pub fn request_cost(field: &str, cost: u64) -> Result<Option<u64>, ApiError> {
    if cost > MAX_COST_TOKENS {
        return Err(ApiError::Malformed(format!(
            "{field} is {cost}; at most {MAX_COST_TOKENS} is accepted"
        )));
    }
    Ok((cost > 0).then_some(cost))
}

/// A decided request: the core's outcome and per-descriptor statuses, with the config snapshot
/// to name the rules that decided.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Overall outcome.
    pub outcome: Outcome,
    /// One status per request descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// The config that decided (for rule names).
    pub snapshot: Arc<Snapshot>,
    /// The request's domain.
    pub domain: String,
    /// What each admitted leased descriptor charged (kept for a reservation's settlement; empty
    /// for a plain check).
    pub charges: Vec<Charged>,
}

impl Verdict {
    /// Whether the request may proceed.
    pub fn is_ok(&self) -> bool {
        self.outcome.code == Code::Ok
    }

    /// The descriptor that decided: on OVER_LIMIT the enforced denial with the longest wait;
    /// otherwise the most restrictive limit (fewest tokens left, then the longest reset).
    /// `None` when no limit applied.
    pub fn deciding(&self) -> Option<usize> {
        let limited = self
            .statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.limit.is_some() || s.reason == Reason::ConcurrencyLimit);
        if self.is_ok() {
            limited
                .min_by(|(_, a), (_, b)| {
                    a.remaining
                        .cmp(&b.remaining)
                        .then(b.reset_after.cmp(&a.reset_after))
                })
                .map(|(i, _)| i)
        } else {
            limited
                .filter(|(_, s)| s.code == Code::OverLimit)
                .max_by(|(ia, a), (ib, b)| {
                    wait_order(a.retry_after)
                        .cmp(&wait_order(b.retry_after))
                        .then(ib.cmp(ia))
                })
                .map(|(i, _)| i)
        }
    }

    /// The rule of descriptor `i`, if one matched.
    pub fn rule(&self, i: usize) -> Option<&Rule> {
        let ri = self.statuses.get(i)?.rule_index?;
        self.snapshot
            .domain(&self.domain)?
            .config
            .rules
            .get(ri as usize)
    }

    /// `"<rule name>-v<policy version>"` of the deciding rule; `"-v<version>"` alone when no
    /// rule decided.
    pub fn policy_label(&self) -> String {
        let name = self
            .deciding()
            .and_then(|i| self.rule(i))
            .map_or("", |r| r.name.as_str());
        format!("{name}-v{}", self.outcome.policy_version)
    }

    /// On OVER_LIMIT: the wait until this request could pass, ns. `None` when OK, and when it
    /// can never pass (a cost above a limit's capacity): then no Retry-After is given, as in the
    /// decision core's answer.
    pub fn retry_after_ns(&self) -> Option<Nanos> {
        match (self.outcome.code, self.outcome.retry_after) {
            (Code::Ok, _) | (_, RetryAfter::Never) => None,
            (_, RetryAfter::After(ns)) => Some(ns),
            // `Now` cannot deny; answer the shortest wait if it ever did.
            (_, RetryAfter::Now) => Some(0),
        }
    }

    /// Whether the request is denied and can never pass (a cost above a limit's capacity): an
    /// OVER_LIMIT answer, never an error, so a gateway that lets requests through on errors
    /// (Envoy's default `failure_mode_deny: false`) still refuses it (issue 10 item 16).
    pub fn never_passes(&self) -> bool {
        self.outcome.code == Code::OverLimit && self.outcome.retry_after == RetryAfter::Never
    }
}

fn wait_order(r: RetryAfter) -> u128 {
    match r {
        RetryAfter::Now => 0,
        RetryAfter::After(n) => u128::from(n) + 1,
        RetryAfter::Never => u128::MAX,
    }
}

/// An admitted (or repeated) reservation.
#[derive(Debug, Clone)]
pub struct Reserved {
    /// Id to settle; empty when denied.
    pub reservation_id: String,
    /// The decision.
    pub verdict: Arc<Verdict>,
    /// Until it expires, ns (0 when denied or already settled).
    pub expires_in: Nanos,
}

/// A settlement's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Tokens given back per descriptor that spent the maximum.
    pub refunded: u64,
    /// The actual cost recorded (by the first settlement).
    pub actual_cost: u64,
    /// This repeats an earlier settlement.
    pub already_settled: bool,
}

/// What every adapter calls: the one enforcer, request tracking and metrics.
#[derive(Debug)]
pub struct Gateway {
    enforcer: Arc<Enforcer>,
    inflight: InFlight<Arc<Verdict>>,
    metrics: Arc<Metrics>,
    settings: GatewaySettings,
    seq: AtomicU64,
}

impl Gateway {
    /// A gateway deciding with `enforcer`, counting into `metrics`.
    pub fn new(enforcer: Arc<Enforcer>, metrics: Arc<Metrics>, settings: GatewaySettings) -> Self {
        metrics.apply(&enforcer.snapshot());
        Gateway {
            inflight: InFlight::new(settings.max_tracked, millis_to_nanos(settings.tombstone_ms)),
            enforcer,
            metrics,
            settings,
            seq: AtomicU64::new(0),
        }
    }

    /// The enforcer.
    pub fn enforcer(&self) -> &Arc<Enforcer> {
        &self.enforcer
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Requests tracked now (reservations, held slots, tombstones).
    pub fn tracked(&self) -> usize {
        self.inflight.len()
    }

    /// Makes `config` current; returns its version.
    pub fn apply(&self, config: ConfigSet) -> u64 {
        let v = self.enforcer.apply(config);
        self.metrics.apply(&self.enforcer.snapshot());
        v
    }

    /// Counts an invalid request (for adapters refusing before the gateway is called).
    pub fn count_invalid(&self) {
        self.metrics.invalid();
    }

    /// Decides `req` once, taking concurrency slots. A cost beyond a limit's capacity is an
    /// OVER_LIMIT verdict that can never pass ([`Verdict::never_passes`]), not an error.
    ///
    /// With `record` (a reservation) the verdict keeps what each leased descriptor charged, so a
    /// settlement refunds exactly there.
    async fn decide(
        &self,
        req: &Request<'_>,
        permits: &mut Vec<allot_common::concurrency::Permit>,
        record: bool,
    ) -> Result<Verdict, ApiError> {
        let started = Instant::now();
        let mut statuses = Vec::with_capacity(req.descriptors.len());
        let mut outcome = self
            .enforcer
            .decide_with_slots(req, &mut statuses, permits, record)
            .await;
        // A full key may be full of requests the gateway forgot to finish: expire what is due
        // and decide once more (the denial spent nothing, so deciding again is exact).
        if let Ok((o, _, _)) = &outcome {
            let concurrency = statuses
                .iter()
                .any(|s| s.reason == Reason::ConcurrencyLimit);
            if o.code == Code::OverLimit
                && concurrency
                && self.inflight.sweep(self.enforcer.clock().now()) > 0
            {
                outcome = self
                    .enforcer
                    .decide_with_slots(req, &mut statuses, permits, record)
                    .await;
            }
        }
        let (outcome, snapshot, charges) = match outcome {
            Ok(o) => o,
            Err(e) => {
                self.metrics.invalid();
                return Err(e.into());
            }
        };
        self.metrics.record(
            req.domain,
            &outcome,
            &statuses,
            started.elapsed().as_secs_f64(),
        );
        Ok(Verdict {
            outcome,
            statuses,
            snapshot,
            domain: req.domain.to_string(),
            charges,
        })
    }

    /// Decides `req` (Check). With a `request_id`, the concurrency slots of capped rules are
    /// held until [`done`](Self::done) or the slot timeout; without one, a capped key is only
    /// checked for a free slot.
    ///
    /// # Errors
    /// [`ApiError`] for invalid input or too many tracked requests;
    /// nothing is spent.
    pub async fn check(
        &self,
        req: &Request<'_>,
        request_id: Option<&str>,
    ) -> Result<Verdict, ApiError> {
        let id = request_id.filter(|s| !s.is_empty());
        if id.is_some() && self.enforcer.slots().any_capped(req.domain) {
            self.inflight.has_room()?;
        }
        let mut permits = Vec::new();
        let verdict = self.decide(req, &mut permits, false).await?;
        if let (Some(id), false) = (id, permits.is_empty()) {
            let until = self
                .enforcer
                .clock()
                .now()
                .saturating_add(millis_to_nanos(self.settings.slot_ttl_ms));
            self.inflight.hold(id, permits, until);
        }
        Ok(verdict)
    }

    /// Reserves `req`, whose cost is the maximum (seed §24). A repeated `request_id` returns the
    /// same reservation and spends nothing more. `ttl_ms` 0 means the default; it is capped at
    /// `max_reserve_ttl_ms`.
    ///
    /// # Errors
    /// As [`check`](Self::check), plus [`InFlightError::InProgress`] when the same id is being
    /// decided and [`InFlightError::Expired`] when its reservation expired.
    pub async fn reserve(
        &self,
        req: &Request<'_>,
        request_id: Option<&str>,
        ttl_ms: u64,
    ) -> Result<Reserved, ApiError> {
        let generated;
        let id = match request_id.filter(|s| !s.is_empty()) {
            Some(id) => id,
            None => {
                generated = format!(
                    "{}-r{}",
                    self.enforcer.settings().agent_id,
                    self.seq.fetch_add(1, Ordering::Relaxed)
                );
                generated.as_str()
            }
        };
        // Validate before tracking anything, so a bad request leaves no trace.
        req.validate().inspect_err(|_| self.metrics.invalid())?;
        let now = self.enforcer.clock().now();
        let ttl = if ttl_ms == 0 {
            self.settings.default_reserve_ttl_ms
        } else {
            ttl_ms.min(self.settings.max_reserve_ttl_ms)
        };
        // A decision waits at most the cold wait; a pending mark outliving that by far was lost.
        let give_up = now.saturating_add(millis_to_nanos(
            self.enforcer.settings().cold_wait_ms.saturating_mul(4) + 10_000,
        ));
        match self.inflight.begin_reserve(id, now, give_up)? {
            Begin::Existing(r, left) => {
                return Ok(Reserved {
                    reservation_id: id.to_string(),
                    verdict: r.answer.clone(),
                    expires_in: left,
                })
            }
            Begin::New => {}
        }
        // Clears the pending mark unless the reservation is admitted (also when this future is
        // dropped mid-decision: then nothing was spent after the last await either).
        struct Pending<'g> {
            inflight: &'g InFlight<Arc<Verdict>>,
            id: &'g str,
            armed: bool,
        }
        impl Drop for Pending<'_> {
            fn drop(&mut self) {
                if self.armed {
                    self.inflight.abandon(self.id);
                }
            }
        }
        let mut pending = Pending {
            inflight: &self.inflight,
            id,
            armed: true,
        };
        let mut permits = Vec::new();
        let verdict = Arc::new(self.decide(req, &mut permits, true).await?);
        if !verdict.is_ok() {
            return Ok(Reserved {
                reservation_id: String::new(),
                verdict,
                expires_in: 0,
            });
        }
        let spent = verdict
            .statuses
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if s.limit.is_some() && s.reason == Reason::WithinLimit {
                    req.cost_tokens(i)
                } else {
                    0
                }
            })
            .collect();
        let spent_at = self.enforcer.clock().now();
        let expires_in = millis_to_nanos(ttl);
        self.inflight.admit(
            id,
            Arc::new(Reservation {
                request: OwnedRequest::from_request(req),
                spent,
                spent_at,
                answer: verdict.clone(),
            }),
            permits,
            spent_at.saturating_add(expires_in),
        );
        pending.armed = false;
        Ok(Reserved {
            reservation_id: id.to_string(),
            verdict,
            expires_in,
        })
    }

    /// Settles reservation `id` at `actual_cost` tokens: refunds `max − actual` to each
    /// descriptor that spent (never lifting a bucket above capacity) and frees its slots.
    /// Idempotent: a repeat answers as the first settlement did and refunds nothing.
    ///
    /// # Errors
    /// [`InFlightError::NotFound`], [`InFlightError::Expired`] (its cost stays spent),
    /// [`InFlightError::InProgress`], [`InFlightError::NotAReservation`].
    pub fn settle(&self, id: &str, actual_cost: u64) -> Result<Settled, ApiError> {
        let now = self.enforcer.clock().now();
        let s = self.inflight.settle(id, actual_cost, now)?;
        if !s.repeated && s.unused.iter().any(|u| *u > 0) {
            let r = &s.reservation;
            // The request was valid when reserved; the only way it fails now is a config change
            // that removed its domain, and then there is no limit left to refund into.
            if let Err(e) = r.request.with_request(|req| {
                let unused = refund::settle_charges(&self.enforcer, &r.answer, req, &s.unused, now);
                self.enforcer.refund(req, &unused, r.spent_at)
            }) {
                tracing::debug!(reservation = id, error = %e, "nothing to refund into");
            }
        }
        Ok(Settled {
            refunded: s.refunded,
            actual_cost: s.actual,
            already_settled: s.repeated,
        })
    }

    /// The request `id` finished: frees its concurrency slots; returns how many. Idempotent.
    pub fn done(&self, id: &str) -> u64 {
        self.inflight.done(id)
    }

    /// Expires abandoned reservations and forgotten slots, forgets old tombstones and idle slot
    /// limiters. Run periodically (see [`crate::server::spawn_sweeper`]).
    pub fn sweep(&self) {
        self.inflight.sweep(self.enforcer.clock().now());
        self.enforcer.slots().sweep();
    }
}

/// The configured limit of `rule` as Envoy names it: (requests_per_unit, unit).
pub fn rule_limit(rule: &Rule) -> Option<(u64, allot_common::config::Unit, u64)> {
    match rule.limit {
        RuleLimit::Limited {
            requests_per_unit,
            unit,
            unit_multiplier,
            ..
        } => Some((requests_per_unit, unit, unit_multiplier)),
        RuleLimit::Unlimited => None,
    }
}

/// Nanoseconds → milliseconds rounded up: the units conversion, under the name the API uses.
pub use allot_common::units::nanos_to_millis_ceil as ms_ceil;

/// The RateLimit response headers (draft-ietf-httpapi-ratelimit-headers) for a verdict, from
/// its deciding descriptor: `RateLimit-Limit` (requests per unit), `RateLimit-Remaining` (whole
/// tokens left), `RateLimit-Reset` (seconds until the limit is fully reset, rounded up); plus
/// `Retry-After` (whole seconds, rounded up, at least 1) on OVER_LIMIT. Empty when no limit
/// applied and the request is allowed.
pub fn rate_limit_headers(v: &Verdict) -> Vec<(&'static str, String)> {
    let mut out = Vec::with_capacity(4);
    if let Some(i) = v.deciding() {
        if let (Some(s), Some((rpu, _, _))) = (v.statuses.get(i), v.rule(i).and_then(rule_limit)) {
            out.push(("RateLimit-Limit", rpu.to_string()));
            out.push(("RateLimit-Remaining", s.remaining.to_string()));
            out.push((
                "RateLimit-Reset",
                s.reset_after
                    .div_ceil(allot_common::units::NANOS_PER_SEC)
                    .to_string(),
            ));
        }
    }
    if let Some(ns) = v.retry_after_ns() {
        out.push((
            "retry-after",
            allot_common::units::nanos_to_retry_after_secs(ns).to_string(),
        ));
    }
    out
}
