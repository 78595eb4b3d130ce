//! What every adapter calls: the one enforcer, request tracking and metrics.

use super::pool::Pooled;
use super::{refund, ApiError, Reserved, Settled, TrackingSettings, Verdict};
use crate::enforce::Enforcer;
use crate::metrics::Metrics;
use crate::tracked::{Begin, OwnedRequest, Reservation, TrackedRequests};
use allot_common::concurrency::Permit;
use allot_common::config::ConfigSet;
use allot_common::descriptor::Request;
use allot_common::limiter::{Code, DescriptorStatus, Reason};
use allot_common::units::{millis_to_nanos, Nanos};
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What every adapter calls: the one enforcer, request tracking and metrics.
#[derive(Debug)]
pub struct Decider {
    enforcer: Arc<Enforcer>,
    tracked: TrackedRequests<Arc<Verdict>>,
    metrics: Arc<Metrics>,
    settings: TrackingSettings,
    seq: AtomicU64,
    /// Serializes [`apply`](Self::apply).
    applying: parking_lot::Mutex<()>,
}

impl Decider {
    /// A decider deciding with `enforcer`, tracking requests by `settings`, counting into
    /// `metrics`.
    pub fn new(enforcer: Arc<Enforcer>, metrics: Arc<Metrics>, settings: TrackingSettings) -> Self {
        metrics.apply(&enforcer.snapshot());
        Decider {
            tracked: TrackedRequests::new(
                settings.max_tracked,
                millis_to_nanos(settings.tombstone_ms),
            ),
            enforcer,
            metrics,
            settings,
            seq: AtomicU64::new(0),
            applying: parking_lot::Mutex::new(()),
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
        self.tracked.len()
    }

    /// Makes `config` current; returns its version.
    pub fn apply(&self, config: ConfigSet) -> u64 {
        // One change at a time, the metrics' map after the enforcer's: the map never stays on
        // an older version than the one deciding.
        let _one_at_a_time = self.applying.lock();
        let v = self.enforcer.apply(config);
        self.metrics.apply(&self.enforcer.snapshot());
        v
    }

    /// Counts an invalid request (for adapters refusing before the decider is called).
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
        permits: &mut Vec<Permit>,
        record: bool,
    ) -> Result<Verdict, ApiError> {
        let started = Instant::now();
        let mut statuses = Pooled::<Vec<DescriptorStatus>>::take();
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
                && self.tracked.sweep(self.enforcer.clock().now()) > 0
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
            &snapshot,
            req.domain,
            &outcome,
            &statuses,
            started.elapsed(),
        );
        let mut domain = Pooled::<String>::take();
        domain.push_str(req.domain);
        Ok(Verdict {
            outcome,
            statuses,
            snapshot,
            domain,
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
            self.tracked.has_room()?;
        }
        let mut permits = Vec::new();
        let verdict = self.decide(req, &mut permits, false).await?;
        if let (Some(id), false) = (id, permits.is_empty()) {
            let until = self
                .enforcer
                .clock()
                .now()
                .saturating_add(millis_to_nanos(self.settings.slot_ttl_ms));
            self.tracked.hold(id, permits, until);
        }
        Ok(verdict)
    }

    /// Reserves `req`, whose cost is the maximum (seed §24). A repeated `request_id` returns the
    /// same reservation and spends nothing more. `ttl_ms` 0 means the default; it is capped at
    /// `max_reserve_ttl_ms`.
    ///
    /// # Errors
    /// As [`check`](Self::check), plus [`TrackingError::InProgress`](crate::tracked::TrackingError::InProgress) when the same id is being
    /// decided and [`TrackingError::Expired`](crate::tracked::TrackingError::Expired) when its reservation expired.
    pub async fn reserve(
        &self,
        req: &Request<'_>,
        request_id: Option<&str>,
        ttl_ms: u64,
    ) -> Result<Reserved, ApiError> {
        let id = self.reservation_id(request_id);
        let id = id.as_ref();
        // Validate before tracking anything, so a bad request leaves no trace.
        req.validate().inspect_err(|_| self.metrics.invalid())?;
        if let Some(existing) = self.begin_reserve(id)? {
            return Ok(existing);
        }
        // Clears the pending mark unless the reservation is admitted (also when this future is
        // dropped mid-decision: then nothing was spent after the last await either).
        let pending = PendingMark {
            tracked: &self.tracked,
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
        let expires_in = millis_to_nanos(self.reserve_ttl_ms(ttl_ms));
        self.admit_reservation(id, req, &verdict, permits, expires_in);
        pending.disarm();
        Ok(Reserved {
            reservation_id: id.to_string(),
            verdict,
            expires_in,
        })
    }

    /// The caller's request id, or a fresh one (`<agent id>-r<n>`) when it gave none.
    fn reservation_id<'r>(&self, request_id: Option<&'r str>) -> Cow<'r, str> {
        match request_id.filter(|s| !s.is_empty()) {
            Some(id) => Cow::Borrowed(id),
            None => Cow::Owned(format!(
                "{}-r{}",
                self.enforcer.settings().agent_id,
                self.seq.fetch_add(1, Ordering::Relaxed)
            )),
        }
    }

    /// A reservation's lifetime, ms: `ttl_ms`, the default when 0, capped at
    /// `max_reserve_ttl_ms`.
    fn reserve_ttl_ms(&self, ttl_ms: u64) -> u64 {
        if ttl_ms == 0 {
            self.settings.default_reserve_ttl_ms
        } else {
            ttl_ms.min(self.settings.max_reserve_ttl_ms)
        }
    }

    /// Marks `id` pending (`None`: decide it now), or repeats its existing reservation.
    ///
    /// # Errors
    /// As [`TrackedRequests::begin_reserve`].
    fn begin_reserve(&self, id: &str) -> Result<Option<Reserved>, ApiError> {
        let now = self.enforcer.clock().now();
        // A decision waits at most the cold wait; a pending mark outliving that by far was lost.
        let give_up = now.saturating_add(millis_to_nanos(
            self.enforcer.settings().cold_wait_ms.saturating_mul(4) + 10_000,
        ));
        Ok(match self.tracked.begin_reserve(id, now, give_up)? {
            Begin::Existing(r, left) => Some(Reserved {
                reservation_id: id.to_string(),
                verdict: r.answer.clone(),
                expires_in: left,
            }),
            Begin::New => None,
        })
    }

    /// Tracks the admitted reservation `id` of `req` (with its held slots) for `expires_in` ns.
    fn admit_reservation(
        &self,
        id: &str,
        req: &Request<'_>,
        verdict: &Arc<Verdict>,
        permits: Vec<Permit>,
        expires_in: Nanos,
    ) {
        let spent_at = self.enforcer.clock().now();
        self.tracked.admit(
            id,
            Arc::new(Reservation {
                request: OwnedRequest::from_request(req),
                spent: spent_tokens(verdict, req),
                spent_at,
                answer: verdict.clone(),
            }),
            permits,
            spent_at.saturating_add(expires_in),
        );
    }

    /// Settles reservation `id` at `actual_cost` tokens: refunds `max − actual` to each
    /// descriptor that spent (never lifting a bucket above capacity) and frees its slots.
    /// Idempotent: a repeat answers as the first settlement did and refunds nothing.
    ///
    /// # Errors
    /// [`TrackingError::NotFound`](crate::tracked::TrackingError::NotFound), [`TrackingError::Expired`](crate::tracked::TrackingError::Expired) (its cost stays spent),
    /// [`TrackingError::InProgress`](crate::tracked::TrackingError::InProgress), [`TrackingError::NotAReservation`](crate::tracked::TrackingError::NotAReservation).
    pub fn settle(&self, id: &str, actual_cost: u64) -> Result<Settled, ApiError> {
        let now = self.enforcer.clock().now();
        let s = self.tracked.settle(id, actual_cost, now)?;
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
        self.tracked.done(id)
    }

    /// Expires abandoned reservations and forgotten slots, forgets old tombstones and idle slot
    /// limiters. Run periodically (see [`crate::server::spawn_sweeper`]).
    pub fn sweep(&self) {
        self.tracked.sweep(self.enforcer.clock().now());
        self.enforcer.slots().sweep();
    }
}

/// Tokens a reservation spent per descriptor: its cost where a limit admitted it, else 0 (no
/// limit, or a shadow denial).
fn spent_tokens(verdict: &Verdict, req: &Request<'_>) -> Vec<u64> {
    verdict
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
        .collect()
}

/// A reservation's pending mark, cleared on drop unless disarmed (the reservation was admitted):
/// also when the reserving future is dropped mid-decision, when nothing was spent after its
/// last await either.
struct PendingMark<'g> {
    tracked: &'g TrackedRequests<Arc<Verdict>>,
    id: &'g str,
    armed: bool,
}

impl PendingMark<'_> {
    /// The reservation was admitted: keep its entry.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for PendingMark<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.tracked.abandon(self.id);
        }
    }
}
