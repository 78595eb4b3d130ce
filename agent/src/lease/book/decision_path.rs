//! The decision path: how a `scope: global` descriptor is admitted or denied (seed §19–23, §26).
//!
//! A request, file by file:
//! 1. An adapter (`api/rls/`, `api/native.rs`, `api/http.rs`) translates its wire format into
//!    the core's `Request` and calls the API facade (`api/`), which calls
//!    `Enforcer::decide_with_slots` (`enforce.rs`).
//! 2. The enforcer loads one config snapshot with its lease tables and decides through the
//!    decision core (`common/src/limiter/`, `Snapshot::decide_with`); the core asks the
//!    [`GlobalLimits`](allot_common::global::GlobalLimits) backend, [`LeaseView`](super::LeaseView)
//!    (`view.rs`), for every leased descriptor: reserve, commit, peek or cancel.
//! 3. Here, `LeaseBook::decide` finds or creates the key ([`KeyLease`], `key.rs`, under the
//!    rule's key cap) and takes the **hot path**: a warm key without a fuse spends its cost from
//!    one unexpired allocation with one compare-and-swap, `HeldAllocation::try_spend`
//!    (`lease/allocation.rs`). No lock is held, nothing is allocated, nothing touches the network.
//! 4. Anything else is `decide_slow`: the rule's fuse, the key's allocations, its central
//!    credit, the emergency reserve under a standing denial, then — nothing held covers the cost —
//!    where the key stands with the allocator (`KeyProtocol::standing`, `lease/protocol.rs`): a
//!    remembered denial denies at once, an unreachable allocator applies the failure mode, and
//!    otherwise the decision joins the key's next allocator call and is answered "waiting".
//! 5. The enforcer waits (at most `cold_wait_ms`) for that call — the key's Acquire, or this
//!    request's own `Decide` when the key is central (`lease/demand.rs`) — which the lease
//!    manager (`lease/manager.rs`) queues and `lease/dispatch.rs` sends, and decides again.
//! 6. The core's outcome goes back through the facade (which keeps reservations and
//!    concurrency slots by request id, and records metrics) to the adapter, which answers.

use super::{ms, AcquireWhy, KeyLease, LeaseBook, LeaseReservation, LeaseTables};
use crate::lease::allocation::{total_remaining, HeldAllocation};
use crate::lease::key_rule::KeyRule;
use crate::lease::protocol::Standing;
use allot_common::algorithm::{LimitParams, RateAlgorithm};
use allot_common::config::{FailureMode, RuleLimit};
use allot_common::decision::{Decision, RetryAfter};
use allot_common::global::{GlobalDecision, GlobalKey};
use allot_common::keyed::Keyed;
use allot_common::units::{Micros, Nanos};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a lease decision may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Spend and keep what a cancel needs.
    Reserve,
    /// Spend for good (nothing can cancel it).
    Commit,
    /// Only say whether it would pass.
    Peek,
}

impl LeaseBook {
    #[inline]
    pub(super) fn decide(
        &self,
        tables: &LeaseTables,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        // Capacity from the rule as configured now: a cost that can never pass is refused
        // before any allocation is looked at, warm key or cold.
        let capacity = match key.rule.limit {
            RuleLimit::Limited { params, .. } => params.capacity(),
            RuleLimit::Unlimited => Micros::MAX,
        };
        // Every setting comes from the rule deciding now (seed §28), not from the config the
        // key was first seen under.
        let rule = KeyRule::of(key.rule);
        self.with_key(tables, &key, now, |kl| {
            if cost > capacity {
                kl.value.last_used.store(now, Ordering::Relaxed);
                return denied(kl.value.remaining(now), RetryAfter::Never, false);
            }
            self.decide_key(kl, &rule, cost, now, mode)
        })
    }

    /// The hot path: a warm key without a fuse whose allocations cover the cost. Everything
    /// else (cold keys, the fuse, exhausted allocations, failure modes) is [`decide_slow`].
    #[inline]
    fn decide_key(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        if mode != Mode::Peek && rule.fuse.is_none() {
            let allocs = v.protocol.held();
            if let Some(a) = allocs.iter().find(|a| a.try_spend(cost, now)) {
                v.last_used.store(now, Ordering::Relaxed);
                return self.admitted(kl, rule, &allocs, a, cost, now, mode, false);
            }
        }
        self.decide_slow(kl, rule, cost, now, mode)
    }

    /// Bookkeeping of a decision that spent `cost` from `a` (one of `allocs`, the key's list).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn admitted(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        allocs: &[Arc<HeldAllocation>],
        a: &Arc<HeldAllocation>,
        cost: Micros,
        now: Nanos,
        mode: Mode,
        fused: bool,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        v.admitted.fetch_add(cost, Ordering::Relaxed);
        self.counters.leased_admits.fetch_add(1, Ordering::Relaxed);
        let remaining = total_remaining(allocs, now);
        // Below the watermark the key renews at the next maintenance pass, in that pass's one
        // `Batch` (issue 9: one Raft entry per agent per tick); it asks now only when what is
        // left will not last until then. A key whose rate still accrues (or whose paced grant
        // still releases) renews at the pass (design §9): what it spends as it accrues never
        // drives it into an Acquire per token.
        if remaining < percent_of(rule.max_grant, self.settings.low_watermark_pct)
            && remaining < self.need_soon(v, cost)
            && !allocs.iter().any(|a| a.accrues(now))
        {
            v.sizing.follow(rule);
            self.request_lease(kl, now, AcquireWhy::RunningLow);
        }
        GlobalDecision {
            decision: allowed(remaining, &rule.params),
            reservation: (mode == Mode::Reserve)
                .then(|| LeaseReservation::Allocation(a.clone(), cost, fused.then(|| kl.clone()))),
            cold: false,
            unreachable: false,
        }
    }

    /// What the key will spend, at its measured demand, before an Acquire sent now should be
    /// answered, at least one more request of `cost`, microtokens: until the next maintenance
    /// pass; after a grant short of its ask, only over an eighth of the pass interval.
    ///
    /// A short grant says the allocator's bucket was what it had, and asking again while the
    /// key still holds most of that finds the bucket nearly as empty: at the contract's own
    /// rate (lease-1000) each agent made about six Acquires a second so, a Raft entry for a
    /// few tokens each. Asking only when what is left covers an eighth of an interval still
    /// asks before the key runs dry (a decision then waits for the call, a round trip), and a
    /// key far over its limit, whose short grants last less than that, asks as before.
    fn need_soon(&self, v: &KeyLease, cost: Micros) -> Micros {
        let interval = ms(self.settings.report_interval_ms);
        let horizon = match v.protocol.last_grant_short() {
            true => interval / 8,
            false => interval,
        };
        v.demand_over(horizon).max(cost)
    }

    /// Everything but the hot path: the fuse, then the key's allocations, then — nothing held
    /// covers the cost — where the key stands with the allocator ([`Standing`]): a standing
    /// denial denies at once, an unreachable allocator applies the failure mode, and otherwise
    /// the decision joins the key's next call and is answered `cold` so the caller waits for it
    /// (issue 9 item 1: no 429 only because this agent holds nothing).
    #[cold]
    #[inline(never)]
    fn decide_slow(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        let take = mode != Mode::Peek;
        let v = &kl.value;
        v.last_used.store(now, Ordering::Relaxed);
        v.sizing.follow(rule);
        // The fuse first: a flood is rejected here, before it can drain allocations or ask
        // the allocator for more.
        let fused = match (rule.fuse, take) {
            (Some(f), true) => {
                let d = v.fuse.with(f, now, |f, st| f.decide(st, now, cost));
                if !d.allowed {
                    self.counters.fuse_rejects.fetch_add(1, Ordering::Relaxed);
                    return denied(v.remaining(now), d.retry_after, false);
                }
                true
            }
            _ => false,
        };
        let allocs = v.allocations();
        if take {
            if let Some(a) = allocs.iter().find(|a| a.try_spend(cost, now)) {
                return self.admitted(kl, rule, &allocs, a, cost, now, mode, fused);
            }
        } else if allocs.iter().any(|a| a.remaining(now) >= cost) {
            let remaining = total_remaining(&allocs, now);
            return GlobalDecision {
                decision: allowed(remaining, &rule.params),
                reservation: None,
                cold: false,
                unreachable: false,
            };
        }
        if let Some(left) = take.then(|| v.protocol.take_credit(cost, now)).flatten() {
            return self.admitted_centrally(kl, rule, (cost, left), now, mode, fused);
        }
        if take && now < v.protocol.denied_until() {
            // The allocator has said it has no more for this key now: the emergency reserve
            // of what it already granted is spendable like the rest. Those tokens are inside
            // the grants (so inside the overshoot bound, design §6); holding them back while
            // the allocator is reachable would only turn granted tokens into false rejections
            // at the contract's edge.
            if let Some(a) = allocs.iter().find(|a| a.try_spend_emergency(cost, now)) {
                return self.admitted(kl, rule, &allocs, a, cost, now, mode, fused);
            }
        }
        if fused {
            // Not admitted after all: the fuse gets its token back.
            self.refund_fuse(v, cost);
        }
        let remaining = total_remaining(&allocs, now);
        self.nothing_held(kl, rule, remaining, cost, now, take)
    }

    /// A decision for which the key holds nothing spendable: decided by where the key stands
    /// with the allocator.
    fn nothing_held(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        remaining: Micros,
        cost: Micros,
        now: Nanos,
        take: bool,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        if self.stopping.load(Ordering::Acquire) {
            self.counters
                .failure_denials
                .fetch_add(1, Ordering::Relaxed);
            let wait = self.settings.retry_floor_ns();
            return denied(remaining, RetryAfter::After(wait), false);
        }
        let accrual = match v.protocol.last_grant_short() {
            true => accrual_wait(&v.allocations(), cost, now),
            false => None,
        };
        if let Some(wait) = accrual {
            // The allocator's last grant was short of the ask: the key's rate is all it gets
            // now, so its next tokens come from it, not from another call (the maintenance
            // pass renews it). After a full grant a decision it does not cover asks instead:
            // the demand grew past what the last grant was sized for (design §9).
            self.counters
                .accrual_denials
                .fetch_add(1, Ordering::Relaxed);
            let wait = wait.max(1);
            if take {
                v.note_denied(cost);
            }
            return denied(remaining, RetryAfter::After(wait), false);
        }
        match v.protocol.standing(now, ms(self.settings.cold_wait_ms)) {
            Standing::Denied(until) => {
                // The allocator's own Retry-After (from its bucket), counting down.
                self.counters.denials_held.fetch_add(1, Ordering::Relaxed);
                if take {
                    v.note_denied(cost);
                }
                denied(remaining, RetryAfter::After(until - now), false)
            }
            Standing::Unreachable(until) => {
                if take {
                    v.note_denied(cost);
                }
                self.unreachable(kl, rule, remaining, cost, now, take, until)
            }
            Standing::Ask if self.is_central(v) => {
                // The waiting request asks the allocator itself (`Enforcer`): one `Decide` of
                // its own cost. A request already denied elsewhere (a peek) asks nothing.
                denied(remaining, self.ask_wait(rule, cost), take)
            }
            Standing::Ask => {
                // Join the key's next call: it asks for at least the waiting decisions' costs.
                self.counters.cold_misses.fetch_add(1, Ordering::Relaxed);
                v.protocol.add_waiting(cost);
                self.request_lease(kl, now, AcquireWhy::Cold);
                denied(remaining, self.ask_wait(rule, cost), true)
            }
        }
    }

    /// The allocator is unreachable until `until`: the rule's failure mode decides (design
    /// §7) — the emergency reserve of what this agent holds, or a denial.
    #[allow(clippy::too_many_arguments)]
    fn unreachable(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        remaining: Micros,
        cost: Micros,
        now: Nanos,
        take: bool,
        until: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        if rule.failure_mode == FailureMode::Emergency {
            if let Some(d) = self.emergency(kl, rule, cost, now, take) {
                return d;
            }
        } else {
            self.counters
                .failure_denials
                .fetch_add(1, Ordering::Relaxed);
        }
        let wait = until
            .saturating_sub(now)
            .max(self.settings.retry_floor_ns());
        GlobalDecision {
            unreachable: true,
            ..denied(remaining, RetryAfter::After(wait), false)
        }
    }

    /// The Retry-After of a decision waiting for the allocator, should the wait end without an
    /// answer: the time the rule's rate takes to refill `cost`, at least the retry floor.
    fn ask_wait(&self, rule: &KeyRule, cost: Micros) -> RetryAfter {
        RetryAfter::After(
            rule.params
                .time_for(cost)
                .max(self.settings.retry_floor_ns()),
        )
    }

    /// Bookkeeping of a decision admitted from the key's central credit (the allocator debited
    /// it already: nothing enters the overshoot bound); promotes the key when its demand here
    /// makes a lease worthwhile ([`demand`](super::demand)).
    fn admitted_centrally(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        (cost, left): (Micros, Micros),
        now: Nanos,
        mode: Mode,
        fused: bool,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        v.admitted.fetch_add(cost, Ordering::Relaxed);
        self.counters.central_admits.fetch_add(1, Ordering::Relaxed);
        // Demand is the offered load (admitted and finally denied), as for lease sizing.
        let offered = v.offered();
        let period = ms(rule.ttl_ms.max(1));
        if v.demand
            .promote_due(now, period, offered, cost, self.thresholds)
            && v.protocol.set_leased(true)
        {
            v.demand.restart(now, offered);
            self.counters.promotions.fetch_add(1, Ordering::Relaxed);
        }
        GlobalDecision {
            // What the allocator's pool held after admitting it (and credit not yet used):
            // the global figure, as an ideal central counter would report it.
            decision: allowed(left, &rule.params),
            reservation: (mode == Mode::Reserve)
                .then(|| LeaseReservation::Central(kl.clone(), cost, fused)),
            cold: false,
            unreachable: false,
        }
    }

    /// Failure mode `emergency` (issue 10 item 4): while the allocator is unreachable for the
    /// key, the emergency reserve of its allocations (the top of each grant, kept when it was
    /// installed) admits at the pace of the emergency bucket (a fraction of the policy's rate
    /// and burst). The reserve is part of the grants: every emergency admission is inside the
    /// overshoot bound and charged to the bucket when its allocation is reported or released,
    /// so N gateways admit at most the reserves the allocator granted them, however long the
    /// outage. `None` when no reserve covers the cost (the failure-mode denial follows).
    fn emergency(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        take: bool,
    ) -> Option<GlobalDecision<LeaseReservation>> {
        let v = &kl.value;
        let bucket = self.settings.emergency_bucket(&rule.params)?;
        let allocs = v.allocations();
        if !allocs.iter().any(|a| a.emergency_remaining(now) >= cost) {
            return None;
        }
        let (d, spent) = v.emergency.with(bucket, now, |b, st| {
            let d = b.check(st, now, cost);
            if !d.allowed || !take {
                return (d, None);
            }
            let a = allocs
                .iter()
                .find(|a| a.try_spend_emergency(cost, now))
                .cloned();
            if a.is_some() {
                b.spend(st, now, cost);
            }
            (d, a)
        });
        let Some(a) = spent else {
            // A peek or the emergency pace's denial answers as the bucket does (a denial of the
            // outage's pace, not of the contract); a reserve taken by a racing decision leaves
            // the failure-mode denial.
            return (!take || !d.allowed).then_some(GlobalDecision {
                decision: d,
                reservation: None,
                cold: false,
                unreachable: !d.allowed,
            });
        };
        v.emergency_admitted.fetch_add(cost, Ordering::Relaxed);
        v.admitted.fetch_add(cost, Ordering::Relaxed);
        self.counters
            .emergency_admits
            .fetch_add(1, Ordering::Relaxed);
        Some(GlobalDecision {
            decision: d,
            reservation: Some(LeaseReservation::Allocation(a, cost, None)),
            cold: false,
            unreachable: false,
        })
    }

    pub(super) fn refund_fuse(&self, v: &KeyLease, cost: Micros) {
        v.fuse.refund(self.clock.now(), cost);
    }
}

/// The soonest any of `allocs` accrues `cost` more at `now`, ns; `None` when none still accrues
/// (or none ever covers it before its accrual ends).
fn accrual_wait(allocs: &[Arc<HeldAllocation>], cost: Micros, now: Nanos) -> Option<Nanos> {
    allocs
        .iter()
        .filter_map(|a| a.accrual_wait(cost, now))
        .min()
}

/// `pct` percent of `m`, rounded down, saturating at `u64::MAX`; a 64-bit product when it fits.
fn percent_of(m: Micros, pct: u32) -> Micros {
    match m.checked_mul(u64::from(pct)) {
        Some(p) => p / 100,
        None => u64::try_from(u128::from(m) * u128::from(pct) / 100).unwrap_or(u64::MAX),
    }
}

pub(super) fn allowed(remaining: Micros, params: &LimitParams) -> Decision {
    Decision {
        allowed: true,
        remaining_micros: remaining,
        reset_after: params.time_for(params.capacity().saturating_sub(remaining)),
        retry_after: RetryAfter::Now,
    }
}

pub(super) fn denied(
    remaining: Micros,
    retry: RetryAfter,
    cold: bool,
) -> GlobalDecision<LeaseReservation> {
    GlobalDecision {
        decision: Decision {
            allowed: false,
            remaining_micros: remaining,
            reset_after: match retry {
                RetryAfter::After(n) => n,
                _ => 0,
            },
            retry_after: retry,
        },
        reservation: None,
        cold,
        unreachable: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_of_is_exact_across_the_64_bit_boundary() {
        assert_eq!(percent_of(400, 25), 100);
        assert_eq!(percent_of(399, 25), 99);
        assert_eq!(percent_of(u64::MAX, 100), u64::MAX);
        assert_eq!(percent_of(u64::MAX, 25), u64::MAX / 4);
        assert_eq!(percent_of(u64::MAX, 50), u64::MAX / 2);
        // Above 100 % the product leaves u64: saturate, never wrap.
        assert_eq!(percent_of(u64::MAX, 200), u64::MAX);
        assert_eq!(percent_of(u64::MAX / 2, u32::MAX), u64::MAX);
    }
}
