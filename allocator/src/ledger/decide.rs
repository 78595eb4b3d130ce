//! Central decisions (design §2): the allocator decides one request itself, debiting its cost
//! from the policy key's global bucket, the region's part (when the policy has regional shares)
//! and the calendar quota at once, all or nothing, at the entry's stamped time. No allocation is
//! made, so a central decision adds nothing to the overshoot bound. Agents use it for keys too
//! sparse at their gateway for a lease to pay off (issue 9 item 2).
//!
//! Idempotent like Acquire: the answer is remembered by (holder, request id) for
//! [`super::REQUEST_RETENTION_MS`], so a retry (after a leader change, say) gets the same answer
//! and is charged once.

use super::division::{sooner, Demand};
use super::rates::rated_retry_ms;
use super::sources::{
    available, check_id, debit, wait_for, Available, Draw, OverCapacity, Prepared,
};

use super::{Decide, Decided, KeyState, Ledger, LedgerError, Response};
use allot_common::decision::RetryAfter;
use allot_common::units::{nanos_to_millis_ceil, MAX_TOKENS, MICROS_PER_TOKEN};

impl Ledger {
    /// Applies a [`Decide`] at `now` (Unix ms): [`Response::Decided`], or
    /// [`Response::Rejected`] for bad input (nothing changes then).
    pub(super) fn decide(&mut self, d: &Decide, now: u64) -> Response {
        if let Some(r) = self.recall(&d.holder, &d.request_id, "a Decide", |r| {
            matches!(r, Response::Decided(_))
        }) {
            return r;
        }
        match self.try_decide(d, now) {
            Ok(x) => {
                let r = Response::Decided(x);
                self.remember(&d.holder, &d.request_id, now, &r);
                r
            }
            Err(e) => Response::Rejected(e),
        }
    }

    fn try_decide(&mut self, d: &Decide, now: u64) -> Result<Decided, LedgerError> {
        check_id("region", &d.region)?;
        check_id("holder", &d.holder)?;
        check_id("request_id", &d.request_id)?;
        let max_cost = MAX_TOKENS * MICROS_PER_TOKEN;
        if d.cost == 0 || d.cost > max_cost {
            return Err(LedgerError::BadInput {
                field: "cost".into(),
                reason: format!("must be from 1 to {max_cost} microtokens, got {}", d.cost),
            });
        }
        // A decision is demand too: its cost, and its holder's rate of decisions as the ledger
        // measures it (`division::decided_demand`).
        let demand = Demand {
            holder: &d.holder,
            want: d.cost,
            demand_per_s: 0,
            allocates: false,
        };
        let t = self.prepare(&d.key, &d.region, &demand, now)?;
        let r = self.decide_prepared(d, &t, now);
        if matches!(r, Ok(Decided { allowed: true, .. })) {
            self.note_served(&t.kid, &d.region, &demand, t.rule.lease.ttl_ms);
        }
        self.reindex_key(&t.kid, now);
        r
    }

    /// The decision on `d` for the key `prepare` readied as `t`: debit and admit when the
    /// pool covers the cost, else the [`refusal`] (nothing debited).
    fn decide_prepared(
        &mut self,
        d: &Decide,
        t: &Prepared,
        now: u64,
    ) -> Result<Decided, LedgerError> {
        let version = t.version;
        if let Some((retry_after_ms, reason)) = t.no_part(&d.region) {
            self.note_denied(&t.kid, &d.region, &d.holder, now);
            return Ok(Refusal::later(retry_after_ms, reason, 0, true).into_decided(version));
        }
        let (part, lend) = self.draw_for(t, now);
        let draw = Draw {
            part,
            lend: lend.as_ref(),
        };
        let ks = self.key_mut(&t.kid)?;
        let avail = available(ks, &d.region, &t.rule, now, draw);
        let pool = avail.pool();
        if d.cost <= pool {
            debit(ks, &d.region, &t.rule, &avail, now, d.cost);
            debug_assert!(
                available(ks, &d.region, &t.rule, now, draw).global == avail.global - d.cost,
                "a decision debits the global bucket by its cost"
            );
            return Ok(Decided {
                allowed: true,
                remaining: pool - d.cost,
                retry_after_ms: 0,
                never: false,
                reason: String::new(),
                policy_version: version,
                handoff_ms: 0,
            });
        }
        let mut r = refusal(ks, d, t, &avail, now);
        if r.counts_as_demand {
            // What another region lends once it settles, asked before this denial counts.
            let handoff = self.handoff_for(t, &d.region, now);
            r.handoff_ms = sooner(handoff, r.retry_after_ms, avail.calendar < d.cost);
            self.note_denied(&t.kid, &d.region, &d.holder, now);
        }
        Ok(r.into_decided(version))
    }
}

/// Why a Decide is denied and when to ask again.
struct Refusal {
    retry_after_ms: u64,
    /// The cost can never pass (above the capacity, the calendar quota or the region's part).
    never: bool,
    reason: String,
    /// What the pool holds now, microtokens.
    remaining: u64,
    /// Whether the denial is demand the division should see (an empty bucket or a part
    /// waiting for its handoff), not a request that can never pass or a spent calendar.
    counts_as_demand: bool,
    /// See [`Decided::handoff_ms`].
    handoff_ms: u64,
}

impl Refusal {
    fn later(retry_after_ms: u64, reason: String, remaining: u64, counts: bool) -> Self {
        Refusal {
            retry_after_ms,
            never: false,
            reason,
            remaining,
            counts_as_demand: counts,
            handoff_ms: 0,
        }
    }

    fn never(reason: String, remaining: u64) -> Self {
        Refusal {
            retry_after_ms: 0,
            never: true,
            reason,
            remaining,
            counts_as_demand: false,
            handoff_ms: 0,
        }
    }

    fn into_decided(self, policy_version: u64) -> Decided {
        Decided {
            allowed: false,
            remaining: self.remaining,
            retry_after_ms: self.retry_after_ms,
            never: self.never,
            reason: self.reason,
            policy_version,
            handoff_ms: self.handoff_ms,
        }
    }
}

/// The denial of `d`, whose cost the pool in `avail` does not cover: when could this cost pass
/// if no other traffic came, or never.
fn refusal(ks: &mut KeyState, d: &Decide, t: &Prepared, avail: &Available, now: u64) -> Refusal {
    let (rule, pool) = (&t.rule, avail.pool());
    if rule.quota.is_some_and(|q| d.cost > q.limit) {
        return Refusal::never(
            format!("cost is above the calendar quota of {}", rule.name),
            pool,
        );
    }
    let wait = wait_for(
        ks,
        &d.region,
        now,
        d.cost,
        OverCapacity::Never,
        t.borrows,
        avail,
    );
    let wait_ms = match wait {
        RetryAfter::Never => {
            let what = if d.cost > t.params.capacity() {
                "the capacity"
            } else {
                "its region's part"
            };
            return Refusal::never(format!("cost is above {what} of {}", rule.name), pool);
        }
        RetryAfter::Now => 1,
        RetryAfter::After(ns) => nanos_to_millis_ceil(ns).max(1),
    };
    // Live rates take the refill; one frees up within a lease (design §9).
    let wait_ms = rated_retry_ms(ks, rule.lease.ttl_ms, wait_ms);
    if avail.calendar < d.cost {
        let reason = format!(
            "calendar quota of {} is spent until {} (Unix ms)",
            rule.name, avail.period_end
        );
        let until_period_end = avail.period_end.saturating_sub(now);
        return Refusal::later(wait_ms.max(until_period_end), reason, pool, false);
    }
    let what = if avail.region_is_tighter() {
        "region share"
    } else {
        "bucket"
    };
    Refusal::later(
        wait_ms,
        format!("{what} of {} is empty", rule.name),
        pool,
        true,
    )
}
