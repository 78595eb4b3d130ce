//! The one enforcement core behind every gateway-facing API (RLS, native gRPC, HTTP, library).
//!
//! Decisions are local: `scope: local` rules are decided by the decision core's own state;
//! `scope: global` rules spend the key's allocations ([`LeaseBook`]). The only wait on the
//! network is for a key that holds nothing to spend and has no standing denial (cold or
//! exhausted): the request waits for that key's allocator call, bounded by `cold_wait_ms`,
//! counted, and its duration recorded.

use crate::lease::{
    ChargeLog, Charged, KeyLease, LeaseBook, LeaseSettings, LeaseTables, LeaseView, Standing,
};
use crate::slots::{SlotOutcome, SlotTables, Slots};
use allot_common::clock::Clock;
use allot_common::concurrency::Permit;
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Request, RequestError, MAX_DESCRIPTORS};
use allot_common::keyed::Keyed;
use allot_common::limiter::{Code, DescriptorStatus, Limiter, Outcome, Reason, Snapshot};
use allot_common::units::{tokens_to_micros, Micros, Nanos, NANOS_PER_MILLI};
use allot_common::RetryAfter;
use arc_swap::ArcSwap;
use arrayvec::ArrayVec;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How a round of waiting for the allocator ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waited {
    /// Every call waited for was answered: decide again.
    Answered,
    /// The wait bound passed first: decide once more, for the last time.
    TimedOut,
    /// Nothing to wait for changes the outcome (a local limit denied; the agent is stopping).
    Final,
}

/// Most rounds of waiting for allocator answers and deciding again within one request's wait.
const MAX_WAIT_ROUNDS: usize = 8;

/// Decides requests for one agent.
pub struct Enforcer {
    limiter: Limiter,
    book: Arc<LeaseBook>,
    clock: Arc<dyn Clock>,
    slots: Slots,
    /// The snapshot decisions use with the lease and slot tables built from it: one load per
    /// decision, and everything a decision does (spend, cold wait, slots, refund, the rule names
    /// of its answer) uses that one config version.
    current: ArcSwap<Current>,
    /// Serialises [`Enforcer::apply`], so the pair stored last is the newest.
    applying: Mutex<()>,
}

/// A config snapshot and the lease and slot tables built from it.
struct Current {
    snapshot: Arc<Snapshot>,
    leases: Arc<LeaseTables>,
    slots: Arc<SlotTables>,
}

impl std::fmt::Debug for Enforcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enforcer").finish_non_exhaustive()
    }
}

impl Enforcer {
    /// An enforcer deciding with `config`, leasing global limits through `book`.
    pub fn new(config: ConfigSet, book: Arc<LeaseBook>) -> Self {
        let clock = book.clock().clone();
        let limiter = Limiter::new(config, clock.now());
        let snapshot = limiter.snapshot();
        let leases = book.apply(&snapshot);
        let slots = Slots::default();
        let slot_tables = slots.apply(&snapshot);
        Enforcer {
            limiter,
            book,
            clock,
            slots,
            current: ArcSwap::from_pointee(Current {
                snapshot,
                leases,
                slots: slot_tables,
            }),
            applying: Mutex::new(()),
        }
    }

    /// Makes `config` current (seed §28); returns its version.
    pub fn apply(&self, config: ConfigSet) -> u64 {
        let _one_at_a_time = self.applying.lock();
        let v = self.limiter.apply(config, self.clock.now());
        let snapshot = self.limiter.snapshot();
        let leases = self.book.apply(&snapshot);
        let slots = self.slots.apply(&snapshot);
        self.current.store(Arc::new(Current {
            snapshot,
            leases,
            slots,
        }));
        v
    }

    /// Concurrency slots of capped rules (`max_in_flight`).
    pub fn slots(&self) -> &Slots {
        &self.slots
    }

    /// The config snapshot decisions use now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load().snapshot.clone()
    }

    /// The lease book.
    pub fn book(&self) -> &Arc<LeaseBook> {
        &self.book
    }

    /// Lease settings.
    pub fn settings(&self) -> &LeaseSettings {
        self.book.settings()
    }

    /// The clock decisions use.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Decides now without waiting for anything (a cold key is denied, its Acquire started).
    ///
    /// # Errors
    /// [`RequestError`] for invalid input or an unknown domain; nothing is spent.
    pub fn decide_now(
        &self,
        req: &Request<'_>,
        statuses: &mut Vec<DescriptorStatus>,
    ) -> Result<Outcome, RequestError> {
        self.decide_in(&self.current.load(), req, statuses, None)
    }

    /// Decides with `current`; with `charges`, records what each leased descriptor charged.
    fn decide_in(
        &self,
        current: &Current,
        req: &Request<'_>,
        statuses: &mut Vec<DescriptorStatus>,
        charges: Option<&ChargeLog>,
    ) -> Result<Outcome, RequestError> {
        let leases = match charges {
            Some(log) => LeaseView::recording(&self.book, &current.leases, log),
            None => LeaseView::new(&self.book, &current.leases),
        };
        current
            .snapshot
            .decide_with(req, self.clock.now(), statuses, &leases)
    }

    /// Gives back `unused[i]` microtokens of descriptor `i` of an admitted request that was
    /// spent at `spent_at` (seed §24: settle a reservation). Buckets never rise above capacity.
    /// Leased descriptors get nothing back here: only the allocation a decision charged may take
    /// tokens back, through the charges [`decide_with_slots`](Self::decide_with_slots) recorded
    /// ([`Charged::refund`]).
    ///
    /// # Errors
    /// [`RequestError`] for invalid input or an unknown domain; nothing changes.
    pub fn refund(
        &self,
        req: &Request<'_>,
        unused: &[allot_common::units::Micros],
        spent_at: allot_common::units::Nanos,
    ) -> Result<(), RequestError> {
        self.refund_in(&self.current.load(), req, unused, spent_at)
    }

    fn refund_in(
        &self,
        current: &Current,
        req: &Request<'_>,
        unused: &[allot_common::units::Micros],
        spent_at: allot_common::units::Nanos,
    ) -> Result<(), RequestError> {
        let leases = LeaseView::new(&self.book, &current.leases);
        current
            .snapshot
            .refund(req, unused, spent_at, self.clock.now(), Some(&leases))
    }

    /// Decides `req`. When a leased descriptor's key holds nothing to spend and no denial of
    /// the allocator stands (cold or exhausted), waits for that key's allocator call and decides
    /// again, for at most `cold_wait_ms` in all (issue 9 item 1). The wait is counted and its
    /// duration recorded.
    ///
    /// # Errors
    /// As [`decide_now`](Self::decide_now).
    pub async fn decide(
        &self,
        req: &Request<'_>,
        statuses: &mut Vec<DescriptorStatus>,
    ) -> Result<Outcome, RequestError> {
        Ok(self.decide_current(req, statuses, None).await?.0)
    }

    /// [`decide`](Self::decide), returning the config it decided with too; with `charges`,
    /// records what the admitted leased descriptors charged.
    async fn decide_current(
        &self,
        req: &Request<'_>,
        statuses: &mut Vec<DescriptorStatus>,
        charges: Option<&ChargeLog>,
    ) -> Result<(Outcome, Arc<Current>), RequestError> {
        let mut current = self.current.load_full();
        let mut outcome = self.decide_in(&current, req, statuses, charges)?;
        if !outcome.awaiting_lease {
            return Ok((outcome, current));
        }
        let counters = &self.book.counters;
        counters.cold_waits.fetch_add(1, Ordering::Relaxed);
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_millis(self.settings().cold_wait_ms);
        // Each round waits for one allocator answer per key; the rounds are bounded too, so a
        // key whose calls cannot be sent (the agent is stopping) never spins until the deadline.
        for _ in 0..MAX_WAIT_ROUNDS {
            let waited = if outcome.awaiting_lease {
                self.wait_for_calls(&current, req, statuses, deadline).await
            } else if outcome.code == Code::OverLimit {
                // The allocator denied, but another region's unused part may be lent soon
                // (its handoff hint): a request that waited already waits for that too.
                self.wait_for_handoff(&current, req, statuses, deadline)
                    .await
            } else {
                Waited::Final
            };
            if waited == Waited::Final {
                break;
            }
            if waited == Waited::TimedOut {
                counters.wait_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            // The config may have changed while waiting: decide with the one current now.
            current = self.current.load_full();
            if let Some(log) = charges {
                log.clear();
            }
            // After a timeout this decision is the last: the keys whose calls are outstanding
            // past the wait now stand as unreachable (their failure mode applies).
            outcome = self.decide_in(&current, req, statuses, charges)?;
            if waited == Waited::TimedOut {
                break;
            }
        }
        let waited = started.elapsed().as_nanos();
        counters
            .wait_time
            .record(u64::try_from(waited).unwrap_or(u64::MAX));
        Ok((outcome, current))
    }

    /// Waits for the allocator on behalf of every denied descriptor of `req` that waiting can
    /// change: a central key's request sends its own `Decide` (all of them in one `Batch`);
    /// a leased key's waits for the key's call in flight. A central key whose `Decide` is not
    /// answered by `deadline` is recorded as unreachable (its own call is outstanding past the
    /// wait bound, as a leased key's is by [`Standing`]).
    async fn wait_for_calls(
        &self,
        current: &Current,
        req: &Request<'_>,
        statuses: &[DescriptorStatus],
        deadline: tokio::time::Instant,
    ) -> Waited {
        let now = self.clock.now();
        let bound = self.settings().cold_wait_ms.saturating_mul(NANOS_PER_MILLI);
        let mut asked: ArrayVec<_, MAX_DESCRIPTORS> = ArrayVec::new();
        let mut calling: ArrayVec<_, MAX_DESCRIPTORS> = ArrayVec::new();
        let Some(denied) = enforced_denials(current, req, statuses) else {
            return Waited::Final; // a local limit denied: no answer changes that
        };
        for (i, kl) in denied {
            if kl.value.protocol.standing(now, bound) != Standing::Ask {
                // Answered since the decision (a denial, or the failure mode): deciding again
                // gives the final answer.
                continue;
            }
            if self.book.is_central(&kl.value) {
                let cost = tokens_to_micros(req.cost_tokens(i));
                match self.book.decide_centrally(&kl, cost) {
                    Some(rx) => asked.push((kl, rx)),
                    None => return Waited::Final, // stopping: nothing will be asked
                }
            } else {
                calling.push(kl);
            }
        }
        let mut waited = Waited::Answered;
        for (kl, rx) in asked {
            if tokio::time::timeout_at(deadline, rx).await.is_err() {
                let backoff = self.settings().error_backoff_ms;
                let until = self
                    .clock
                    .now()
                    .saturating_add(backoff.saturating_mul(NANOS_PER_MILLI));
                kl.value.protocol.record_failure(until);
                waited = Waited::TimedOut;
            }
        }
        for kl in calling {
            let p = &kl.value.protocol;
            // Register for the wake-up before checking, so a finish in between is not missed.
            let finished = p.finished();
            if p.call_in_flight() && tokio::time::timeout_at(deadline, finished).await.is_err() {
                waited = Waited::TimedOut;
            }
        }
        waited
    }

    /// Waits until every enforced denied descriptor of `req` may ask again by its key's handoff
    /// hint ([`KeyProtocol::handoff_at`]), when that is before `deadline`: `Answered` then
    /// (decide again: the keys ask the allocator anew), else `Final` (the denial stands: a
    /// local limit, a refill denial, or a hint beyond the wait bound).
    ///
    /// [`KeyProtocol::handoff_at`]: crate::lease::protocol::KeyProtocol::handoff_at
    async fn wait_for_handoff(
        &self,
        current: &Current,
        req: &Request<'_>,
        statuses: &[DescriptorStatus],
        deadline: tokio::time::Instant,
    ) -> Waited {
        let now = self.clock.now();
        let mut until: Nanos = 0;
        let mut keys: ArrayVec<_, MAX_DESCRIPTORS> = ArrayVec::new();
        let Some(denied) = enforced_denials(current, req, statuses) else {
            return Waited::Final; // a local limit denied
        };
        for (_, kl) in denied {
            let Some(at) = kl.value.protocol.handoff_at(now) else {
                return Waited::Final; // the refill's denial, or the failure mode
            };
            until = until.max(at);
            keys.push((kl, at));
        }
        let wake = tokio::time::Instant::now() + Duration::from_nanos(until.saturating_sub(now));
        if keys.is_empty() || wake >= deadline {
            return Waited::Final;
        }
        self.book
            .counters
            .handoff_waits
            .fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep_until(wake).await;
        for (kl, at) in keys {
            kl.value.protocol.handoff_due(at);
        }
        Waited::Answered
    }

    /// Decides `req` as [`decide`](Self::decide) and returns the config snapshot that decided
    /// (for rule names), then takes one concurrency slot per admitted
    /// descriptor whose rule has `max_in_flight` (seed §25), into `permits` (cleared first;
    /// dropping a permit frees its slot). All-or-nothing: when an enforced key has no free slot
    /// the request is denied with [`Reason::ConcurrencyLimit`] on that descriptor, the slots
    /// taken so far are freed and the rate cost just spent is refunded at once (exactly, for
    /// local state at the same instant; a leased allocation gets back what is not reported yet).
    /// A shadow-mode rule's full key only sets `shadow_over_limit`.
    ///
    /// The Retry-After of a concurrency denial is the lease settings' `retry_floor_ms`: when a
    /// slot frees depends on other requests finishing, which the agent cannot foresee.
    ///
    /// With `record` (a reservation, to be refunded later) the result carries what each admitted
    /// leased descriptor charged; it is empty otherwise.
    ///
    /// # Errors
    /// As [`decide_now`](Self::decide_now).
    pub async fn decide_with_slots(
        &self,
        req: &Request<'_>,
        statuses: &mut Vec<DescriptorStatus>,
        permits: &mut Vec<Permit>,
        record: bool,
    ) -> Result<(Outcome, Arc<Snapshot>, Vec<Charged>), RequestError> {
        permits.clear();
        // A capped domain may undo the spend at once (a full slot), which needs the charges too.
        let log =
            (record || self.current.load().slots.any_capped(req.domain)).then(ChargeLog::default);
        let (mut outcome, current) = self.decide_current(req, statuses, log.as_ref()).await?;
        let charges = log.map(|l| l.take(req)).unwrap_or_default();
        let snapshot = current.snapshot.clone();
        if outcome.code != Code::Ok || !current.slots.any_capped(req.domain) {
            return Ok((outcome, snapshot, charges));
        }
        let now = self.clock.now();
        let mut full = None;
        for (i, d) in req.descriptors.iter().enumerate() {
            let Some(s) = statuses.get_mut(i) else { break };
            let Some(ri) = s.rule_index else { continue };
            match current.slots.acquire(req.domain, ri, d.entries) {
                SlotOutcome::Uncapped => {}
                SlotOutcome::Held(p) => permits.push(p),
                SlotOutcome::Full { .. } if s.shadow_mode => s.shadow_over_limit = true,
                SlotOutcome::Full { .. } => {
                    full = Some(i);
                    break;
                }
            }
        }
        let Some(denied) = full else {
            return Ok((outcome, snapshot, charges));
        };
        permits.clear();
        // Undo the rate spend of every descriptor that spent (allowed with a limit).
        let mut unused: ArrayVec<Micros, MAX_DESCRIPTORS> = ArrayVec::new();
        for (i, s) in statuses.iter_mut().enumerate() {
            let spent = s.limit.is_some() && s.reason == Reason::WithinLimit;
            let cost = if spent { req.cost_tokens(i) } else { 0 };
            if cost > 0 {
                // Report the unspent view, as for any denial.
                let cap = s.limit.map_or(u64::MAX, |l| l.capacity);
                s.remaining = s.remaining.saturating_add(cost).min(cap);
            }
            unused.push(tokens_to_micros(cost));
        }
        if unused.iter().any(|u| *u > 0) {
            self.refund_in(&current, req, &unused, now)?;
        }
        for c in &charges {
            c.refund(c.micros, now);
        }
        let wait = RetryAfter::After(self.settings().retry_floor_ns());
        if let Some(s) = statuses.get_mut(denied) {
            s.code = Code::OverLimit;
            s.reason = Reason::ConcurrencyLimit;
            s.retry_after = wait;
        }
        outcome.code = Code::OverLimit;
        outcome.retry_after = wait;
        Ok((outcome, snapshot, Vec::new()))
    }
}

/// The enforced (not shadow-mode) denied descriptors of `req` with their keys' leases, by
/// descriptor index; `None` when one of them was denied by a local limit (no key of the
/// allocator's: no answer of it changes that denial).
fn enforced_denials(
    current: &Current,
    req: &Request<'_>,
    statuses: &[DescriptorStatus],
) -> Option<ArrayVec<(usize, Arc<Keyed<KeyLease>>), MAX_DESCRIPTORS>> {
    let mut out = ArrayVec::new();
    for (i, d) in req.descriptors.iter().enumerate() {
        let Some(s) = statuses.get(i) else { break };
        if s.code != Code::OverLimit || s.shadow_mode {
            continue;
        }
        let kl = s
            .rule_index
            .and_then(|ri| current.leases.existing(req.domain, ri, d.entries))?;
        out.push((i, kl));
    }
    Some(out)
}
