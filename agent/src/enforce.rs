//! The one enforcement core behind every gateway-facing API (RLS, native gRPC, HTTP, library).
//!
//! Decisions are local: `scope: local` rules are decided by the decision core's own state;
//! `scope: global` rules spend the key's allocations ([`LeaseBook`]). The only wait on the
//! network is a key's first allocation (cold), bounded by `cold_wait_ms` and counted.

use crate::lease::{LeaseBook, LeaseSettings};
use allot_common::clock::Clock;
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Request, RequestError};
use allot_common::limiter::{DescriptorStatus, Limiter, Outcome, Snapshot};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Decides requests for one agent.
pub struct Enforcer {
    limiter: Limiter,
    book: Arc<LeaseBook>,
    clock: Arc<dyn Clock>,
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
        book.apply(&limiter.snapshot());
        Enforcer {
            limiter,
            book,
            clock,
        }
    }

    /// Makes `config` current (seed §28); returns its version.
    pub fn apply(&self, config: ConfigSet) -> u64 {
        let v = self.limiter.apply(config, self.clock.now());
        self.book.apply(&self.limiter.snapshot());
        v
    }

    /// The current config snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.limiter.snapshot()
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
        self.limiter
            .decide_with(req, self.clock.now(), statuses, self.book.as_ref())
    }

    /// Gives back `unused[i]` microtokens of descriptor `i` of an admitted request that was
    /// spent at `spent_at` (seed §24: settle a reservation). Buckets never rise above capacity;
    /// leased descriptors get back only what has not been reported yet.
    ///
    /// # Errors
    /// [`RequestError`] for invalid input or an unknown domain; nothing changes.
    pub fn refund(
        &self,
        req: &Request<'_>,
        unused: &[allot_common::units::Micros],
        spent_at: allot_common::units::Nanos,
    ) -> Result<(), RequestError> {
        self.limiter.refund(
            req,
            unused,
            spent_at,
            self.clock.now(),
            Some(self.book.as_ref()),
        )
    }

    /// Decides `req`. When a leased descriptor's key has no allocation yet, waits (at most
    /// `cold_wait_ms`) for its first Acquire to finish and decides again.
    ///
    /// # Errors
    /// As [`decide_now`](Self::decide_now).
    pub async fn decide(
        &self,
        req: &Request<'_>,
        statuses: &mut Vec<DescriptorStatus>,
    ) -> Result<Outcome, RequestError> {
        let first = self.decide_now(req, statuses)?;
        if !first.awaiting_lease {
            return Ok(first);
        }
        self.book
            .counters
            .cold_waits
            .fetch_add(1, Ordering::Relaxed);
        let wait = Duration::from_millis(self.settings().cold_wait_ms);
        let deadline = tokio::time::Instant::now() + wait;
        for (i, d) in req.descriptors.iter().enumerate() {
            let Some(ri) = statuses.get(i).and_then(|s| s.rule_index) else {
                continue;
            };
            let Some(kl) = self.book.existing(req.domain, ri, d.entries) else {
                continue;
            };
            // Register for the wake-up before checking, so a finish in between is not missed.
            let notified = kl.value.ready.notified();
            if kl.value.answered.load(Ordering::Acquire) {
                continue;
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
        self.decide_now(req, statuses)
    }
}
