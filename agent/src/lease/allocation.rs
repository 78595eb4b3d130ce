//! One allocation held by the agent: a batch of spendable microtokens, spent with atomics on the
//! hot path (seed §21, §31 step 6), closed before its final spend is read (issue 10 item 3).

use super::pace::Pace;
use allot_common::algorithm::Rate;
use allot_common::units::{Micros, Nanos};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Set in the spend word once the allocation is closed: every later spend fails in the same
/// compare-and-swap that spends, because `spent | CLOSED` exceeds any grant.
const CLOSED: u64 = 1 << 63;

/// Accrual starts this long after the grant was received, ns: the allocator stamps grants in
/// whole milliseconds, so the holder's accrual never starts before the ledger's (design §9).
pub const ACCRUAL_DELAY_NS: Nanos = 1_000_000;

/// What `rate_per_s` µtok/s accrues over `ns` nanoseconds, rounded down (saturating).
fn accrued(rate_per_s: u64, ns: Nanos) -> Micros {
    Rate::per_second(rate_per_s).produced(ns)
}

/// The largest grant an allocation holds, microtokens (the top bit of the spend word is the
/// closed flag). A larger grant is held as this much: the agent spends less than it was granted,
/// never more.
pub const MAX_HELD_GRANT: Micros = CLOSED - 1;

/// A granted allocation as the agent holds it.
///
/// `spent` only grows on the hot path (one compare-and-swap per spend). Spend that was read for a
/// report or a release is *committed*: [`HeldAllocation::unspend`] (a cancelled reservation, a
/// settled refund) gives back only spend above it, so `reported ≤ committed ≤ spent ≤ granted`
/// holds at every step (asserted in debug builds) and no give-back can wrap.
/// [`HeldAllocation::close`] ends spending atomically with respect to
/// [`HeldAllocation::try_spend`] and returns the final spend a Release carries.
#[derive(Debug)]
pub struct HeldAllocation {
    /// Allocator's id for it (never reused).
    pub id: u64,
    /// Its epoch (fencing token for reports).
    pub epoch: u64,
    /// Incarnation of the allocator's ledger that granted it (0: not told): sent back with
    /// every report and release, so an allocator recreated empty after losing its state, whose
    /// ids start again at 1, refuses them instead of applying them to its own allocation of the
    /// same id (design §3).
    pub incarnation: u64,
    /// Most microtokens it may ever spend (at most [`MAX_HELD_GRANT`]): the base, plus what
    /// its rate can accrue until the local deadline (design §9).
    pub granted: Micros,
    /// Microtokens granted at once.
    pub base: Micros,
    /// Rate accrued, microtokens per second (0: none).
    pub rate_per_s: u64,
    /// The agent's own pace of spending the grant, if any (see [`paced`](Self::paced)).
    pub pace: Option<Pace>,
    /// When accrual starts, ns on the agent's clock: 1 ms after the grant was received, so
    /// it never starts before the allocator's millisecond stamp of the grant.
    pub accrual_start: Nanos,
    /// Local deadline on the agent's monotonic clock, ns: the time the Acquire was *sent* + ttl
    /// − drift margin. Past it the agent never spends from this allocation.
    pub deadline: Nanos,
    /// Allocator-stamped expiry, Unix ms (for status pages).
    pub expires_at_unix_ms: u64,
    /// Policy version it was granted under.
    pub policy_version: u64,
    /// The emergency reserve, microtokens (≤ `granted`): the top of the grant, spent only by
    /// [`try_spend_emergency`](Self::try_spend_emergency) while the allocator is unreachable
    /// for the key (failure mode `emergency`, issue 10 item 4). Part of the grant, so counted
    /// in the overshoot bound and charged to the bucket like any spend; returned at the
    /// Release when unused. Set to 0 by [`unlock_reserve`](Self::unlock_reserve) once a newer
    /// allocation of the key holds the reserve, so only the newest grant's waits.
    reserve: AtomicU64,
    /// When accrual ends, ns: the local deadline, or earlier once a later Acquire of the key
    /// was sent (the allocator ends it then, design §9).
    accrual_end: AtomicU64,
    /// Spent microtokens, with [`CLOSED`] set once closed.
    spent: AtomicU64,
    /// Highest cumulative spend the allocator acknowledged.
    reported: AtomicU64,
    /// Spend committed to the allocator (read for a report or a release, or acknowledged):
    /// never given back. Changes, like every decrease of `spent`, only under this lock, which
    /// the hot path never takes.
    committed: Mutex<Micros>,
}

impl HeldAllocation {
    /// A fresh allocation with nothing spent; `granted` is held as at most [`MAX_HELD_GRANT`].
    pub fn new(
        id: u64,
        epoch: u64,
        granted: Micros,
        deadline: Nanos,
        expires_at_unix_ms: u64,
        policy_version: u64,
    ) -> Self {
        let granted = granted.min(MAX_HELD_GRANT);
        HeldAllocation {
            id,
            epoch,
            incarnation: 0,
            granted,
            base: granted,
            rate_per_s: 0,
            pace: None,
            accrual_start: deadline,
            deadline,
            expires_at_unix_ms,
            policy_version,
            reserve: AtomicU64::new(0),
            accrual_end: AtomicU64::new(deadline),
            spent: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            committed: Mutex::new(0),
        }
    }

    /// The same allocation accruing `rate_per_s` µtok/s from `received` + 1 ms to its deadline,
    /// never more than `promised` (what the allocator counts for the rate): its `granted` grows
    /// by what can accrue in that time (design §9).
    pub fn with_rate(mut self, rate_per_s: u64, received: Nanos, promised: Micros) -> Self {
        debug_assert!(self.pace.is_none(), "a rate is granted before any pace");
        let start = received.saturating_add(ACCRUAL_DELAY_NS);
        self.rate_per_s = rate_per_s;
        self.accrual_start = start;
        let most = accrued(rate_per_s, self.deadline.saturating_sub(start)).min(promised);
        self.granted = self.base.saturating_add(most).min(MAX_HELD_GRANT);
        self
    }

    /// The same allocation spent at a pace ([`Pace`]): `at_once` microtokens from `received`
    /// (ns), the rest of the grant released evenly over the next `pace_ns` ns, all of it at the
    /// pace's end. Unchanged without a rest or a pace, with a rate (the allocator's rate paces
    /// it already), or when the pace would outlast the local deadline (what it had not released
    /// by then would never be spent).
    ///
    /// For a grant short of its ask after an answer that was short too (`manager`): the key is
    /// over its limit, and such a grant is mostly what the allocator's bucket refilled since
    /// the last ask. The ideal central counter hands that refill out as it comes, so its cheap
    /// requests get in between the dear ones; spent at once, the same tokens went to whatever
    /// arrived first (weighted costs 1/2/4/8: as many tokens as the ideal, 3 % fewer
    /// requests). The allocator counts the grant whole and nothing it knows of changes (base,
    /// rate, reports, the overshoot bound); what is unspent goes back with the Release.
    pub fn paced(mut self, received: Nanos, pace_ns: Nanos, at_once: Micros) -> Self {
        if self.rate_per_s > 0 || received.saturating_add(pace_ns) > self.deadline {
            return self;
        }
        self.pace = Pace::new(self.granted, at_once, received, pace_ns);
        self
    }

    /// The same allocation, granted by the ledger incarnation `incarnation`.
    pub fn with_incarnation(mut self, incarnation: u64) -> Self {
        self.incarnation = incarnation;
        self
    }

    /// The same allocation with the top `reserve` microtokens of its base kept for emergency
    /// admissions (at most the whole base).
    pub fn with_reserve(self, reserve: Micros) -> Self {
        self.reserve
            .store(reserve.min(self.base), Ordering::Relaxed);
        self
    }

    /// Most it may have spent by `now`: the base plus what its rate accrued until `now` (or
    /// the accrual's end), or what its pace released by `now`; never more than `granted`.
    /// Integer ns, rounded down.
    #[inline]
    pub fn limit_at(&self, now: Nanos) -> Micros {
        if let Some(p) = &self.pace {
            return p.released(now).min(self.granted);
        }
        if self.rate_per_s == 0 {
            return self.granted;
        }
        let end = now.min(self.accrual_end.load(Ordering::Acquire));
        let grown = accrued(self.rate_per_s, end.saturating_sub(self.accrual_start));
        self.base.saturating_add(grown).min(self.granted)
    }

    /// Whether a rate-carrying allocation whose accrual ended (superseded by a later Acquire)
    /// has spent everything it ever can: nothing is left to keep it for (design §9).
    pub fn spent_all_it_can(&self, now: Nanos) -> bool {
        self.rate_per_s > 0 && !self.accrues(now) && self.remaining_by(now, u64::MAX) == 0
    }

    /// Whether its rate still accrues at `now` (a rate, before the accrual's end), or its
    /// pace still releases it; never once closed (nothing it accrues can be spent then, so a
    /// key must not wait for it, nor a denial be told to retry when it would have accrued).
    pub fn accrues(&self, now: Nanos) -> bool {
        if self.is_closed() {
            return false;
        }
        if let Some(p) = &self.pace {
            return p.releasing(now);
        }
        self.rate_per_s > 0 && now < self.accrual_end.load(Ordering::Acquire)
    }

    /// Ends the accrual at `now` at the latest: the agent is about to send an Acquire for the
    /// key, which ends this allocation's rate at the allocator (design §9).
    pub fn freeze_accrual(&self, now: Nanos) {
        self.accrual_end.fetch_min(now, Ordering::AcqRel);
    }

    /// How long until `cost` more microtokens can be spent from what accrues or the pace
    /// releases (`None`: never, the accrual ends or the deadline comes first, or there is no
    /// rate nor pace).
    pub fn accrual_wait(&self, cost: Micros, now: Nanos) -> Option<Nanos> {
        if !self.accrues(now) {
            return None;
        }
        let used = self
            .spent()
            .saturating_add(self.reserve())
            .saturating_add(cost);
        if let Some(p) = &self.pace {
            let at = p.release_at(used);
            return (at < self.deadline && used <= self.granted).then(|| at.saturating_sub(now));
        }
        let need = used.saturating_sub(self.base);
        // The first ns at which ⌊rate · t / 10⁹⌋ ≥ need, counted from the accrual's start.
        let t = Rate::per_second(self.rate_per_s).time_for(need);
        let at = self.accrual_start.saturating_add(t);
        // What has accrued at the accrual's end is spendable then (`limit_at`), before the
        // deadline.
        let by_end = at <= self.accrual_end.load(Ordering::Acquire) && at < self.deadline;
        (by_end && used <= self.granted).then(|| at.saturating_sub(now))
    }

    /// The emergency reserve still held back, microtokens.
    pub fn reserve(&self) -> Micros {
        self.reserve.load(Ordering::Relaxed)
    }

    /// Makes the reserve spendable normally: a newer allocation of the key holds one now, so
    /// keeping this one back too would only slow the key down (the emergency bound is the
    /// newest grant's reserve, and every token stays inside what was granted).
    pub fn unlock_reserve(&self) {
        self.reserve.store(0, Ordering::Relaxed);
    }

    /// Spends `cost` if it fits below the emergency reserve, the allocation is open and still
    /// usable at `now`. Lock-free: one compare-and-swap.
    #[inline]
    pub fn try_spend(&self, cost: Micros, now: Nanos) -> bool {
        let limit = self.limit_at(now).saturating_sub(self.reserve());
        self.spend_within(cost, now, limit)
    }

    /// Spends `cost` out of the whole grant, the emergency reserve included (the allocator is
    /// unreachable for the key and its failure mode is `emergency`).
    pub fn try_spend_emergency(&self, cost: Micros, now: Nanos) -> bool {
        self.spend_within(cost, now, self.limit_at(now))
    }

    #[inline]
    fn spend_within(&self, cost: Micros, now: Nanos, limit: Micros) -> bool {
        if now >= self.deadline {
            return false;
        }
        let mut cur = self.spent.load(Ordering::Relaxed);
        loop {
            // A closed word carries the top bit, so it never fits under a grant.
            let Some(next) = cur.checked_add(cost).filter(|n| *n <= limit) else {
                return false;
            };
            match self
                .spent
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Gives back up to `cost` microtokens spent by a request that was cancelled or settled below
    /// its reservation; returns how many came back. Only spend not yet committed to the allocator
    /// comes back, and nothing once closed, so a give-back never wraps nor undoes a reported spend
    /// (issue 10 item 8).
    pub fn unspend(&self, cost: Micros) -> Micros {
        let committed = self.committed.lock();
        let mut cur = self.spent.load(Ordering::Acquire);
        loop {
            if cur & CLOSED != 0 {
                return 0;
            }
            let back = cost.min(cur.saturating_sub(*committed));
            if back == 0 {
                return 0;
            }
            match self.spent.compare_exchange_weak(
                cur,
                cur - back,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.assert_pairs(*committed);
                    return back;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Microtokens spent so far (cumulative).
    pub fn spent(&self) -> Micros {
        self.spent.load(Ordering::Acquire) & !CLOSED
    }

    /// The cumulative spend a Report carries: read and committed at once, so no give-back can
    /// lower the spend below what the allocator is about to record.
    pub fn spend_to_report(&self) -> Micros {
        let mut committed = self.committed.lock();
        let s = self.spent();
        *committed = (*committed).max(s);
        self.assert_pairs(*committed);
        s
    }

    /// Closes the allocation — no spend succeeds afterwards — and returns its final spend, which
    /// every spend that succeeded is part of (issue 10 item 3). Idempotent: a retried Release
    /// carries the same final spend.
    pub fn close(&self) -> Micros {
        let mut committed = self.committed.lock();
        let s = self.spent.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED;
        *committed = (*committed).max(s);
        self.assert_pairs(*committed);
        s
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.spent.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Microtokens left to spend below the emergency reserve (0 past the deadline or once
    /// closed).
    pub fn remaining(&self, now: Nanos) -> Micros {
        self.left_within(now, self.limit_at(now).saturating_sub(self.reserve()))
    }

    /// Microtokens left to spend by `now + horizon` (ns) below the emergency reserve, counting
    /// what its rate accrues meanwhile (0 past the deadline or once closed).
    pub fn remaining_by(&self, now: Nanos, horizon: Nanos) -> Micros {
        let later = now.saturating_add(horizon);
        self.left_within(now, self.limit_at(later).saturating_sub(self.reserve()))
    }

    /// Microtokens left to spend with the emergency reserve (0 past the deadline or once
    /// closed).
    pub fn emergency_remaining(&self, now: Nanos) -> Micros {
        self.left_within(now, self.limit_at(now))
    }

    fn left_within(&self, now: Nanos, limit: Micros) -> Micros {
        if now >= self.deadline {
            0
        } else {
            // A closed word exceeds the grant: nothing left.
            limit.saturating_sub(self.spent.load(Ordering::Acquire))
        }
    }

    /// Whether the deadline has passed.
    pub fn is_expired(&self, now: Nanos) -> bool {
        now >= self.deadline
    }

    /// Whether the allocation can still be refunded into at `now`: open and before its deadline
    /// (issue 10 item 5: a refund into a finished allocation would be granted again elsewhere).
    pub fn is_live(&self, now: Nanos) -> bool {
        !self.is_expired(now) && !self.is_closed()
    }

    /// Highest cumulative spend the allocator acknowledged.
    pub fn reported(&self) -> Micros {
        self.reported.load(Ordering::Acquire)
    }

    /// Records an acknowledged report (max-merged, like the allocator). An acknowledgement above
    /// what was spent (not something this agent sent) counts as the spend, so the overshoot
    /// bound never shrinks below the truth.
    pub fn set_reported(&self, v: Micros) {
        let mut committed = self.committed.lock();
        let v = v.min(self.spent());
        *committed = (*committed).max(v);
        self.reported.fetch_max(v, Ordering::AcqRel);
        self.assert_pairs(*committed);
    }

    /// Granted but not yet reported: this allocation's share of the overshoot bound (seed §23).
    pub fn unreported(&self) -> Micros {
        self.granted.saturating_sub(self.reported())
    }

    /// `reported ≤ committed ≤ spent ≤ granted` (debug builds), with the commit lock held so no
    /// decrease of `spent` races the check.
    #[inline]
    fn assert_pairs(&self, committed: Micros) {
        let (reported, spent) = (self.reported(), self.spent());
        debug_assert!(
            reported <= committed && committed <= spent && spent <= self.granted,
            "allocation {}: reported {reported} ≤ committed {committed} ≤ spent {spent} ≤ \
             granted {} broken",
            self.id,
            self.granted
        );
    }
}

/// Σ [`remaining`](HeldAllocation::remaining) over `allocs` at `now`: what a key holding them
/// can still spend, below the emergency reserves (the `remaining` of a decision's answer).
#[inline]
pub fn total_remaining(allocs: &[std::sync::Arc<HeldAllocation>], now: Nanos) -> Micros {
    allocs.iter().map(|a| a.remaining(now)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn spends_never_exceed_the_grant_even_concurrently() {
        let a = std::sync::Arc::new(HeldAllocation::new(1, 1, 1000, 10, 0, 1));
        let ok = std::sync::Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let a = a.clone();
                let ok = ok.clone();
                s.spawn(move || {
                    for _ in 0..1000 {
                        if a.try_spend(3, 5) {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(ok.load(Ordering::Relaxed), 333);
        assert_eq!(a.spent(), 999);
        assert_eq!(a.remaining(5), 1);
    }

    #[test]
    fn deadline_stops_spending_and_unspend_restores() {
        let a = HeldAllocation::new(1, 1, 10, 100, 0, 1);
        assert!(a.try_spend(4, 99));
        assert!(!a.try_spend(1, 100));
        assert_eq!(a.remaining(100), 0);
        assert_eq!(a.unspend(4), 4);
        assert_eq!(a.spent(), 0);
        assert!(!a.try_spend(u64::MAX, 0));
        assert!(a.try_spend(6, 0));
        a.set_reported(6);
        a.set_reported(2);
        assert_eq!((a.reported(), a.unreported()), (6, 4));
    }

    /// Issue 10 item 8: a settle's refund and a cancel of the same tokens give back at most what
    /// was spent and not committed; the spend never wraps.
    #[test]
    fn give_backs_never_wrap_nor_undo_committed_spend() {
        let a = HeldAllocation::new(1, 1, 10, 100, 0, 1);
        assert!(a.try_spend(5, 0));
        assert_eq!(a.unspend(5), 5);
        assert_eq!(a.unspend(5), 0, "the same tokens twice: nothing more");
        assert_eq!(a.spent(), 0);
        assert!(a.try_spend(8, 0));
        assert_eq!(a.spend_to_report(), 8);
        assert!(a.try_spend(2, 0));
        assert_eq!(
            a.unspend(u64::MAX),
            2,
            "only the spend after the report comes back"
        );
        assert_eq!(a.unspend(u64::MAX), 0);
        assert_eq!(a.spent(), 8);
        // An acknowledgement beyond the spend counts as the spend.
        a.set_reported(u64::MAX);
        assert_eq!((a.reported(), a.unreported()), (8, 2));
    }

    #[test]
    fn extremes_of_grant_and_cost() {
        let a = HeldAllocation::new(1, 1, u64::MAX, u64::MAX, 0, 1);
        assert_eq!(a.granted, MAX_HELD_GRANT);
        assert!(!a.try_spend(u64::MAX, 0));
        assert!(a.try_spend(MAX_HELD_GRANT, 0));
        assert_eq!(a.remaining(0), 0);
        assert!(!a.try_spend(1, 0));
        assert_eq!(a.close(), MAX_HELD_GRANT);
        assert_eq!(a.spent(), MAX_HELD_GRANT);
        assert_eq!(a.unspend(u64::MAX), 0);
        let z = HeldAllocation::new(2, 1, 0, u64::MAX, 0, 1);
        assert!(z.try_spend(0, 0));
        assert!(!z.try_spend(1, 0));
        assert_eq!((z.close(), z.unspend(0), z.remaining(0)), (0, 0, 0));
    }

    /// Issue 10 item 4: the reserve is spent only as an emergency, and never beyond the grant.
    #[test]
    fn the_emergency_reserve_is_the_top_of_the_grant() {
        let a = HeldAllocation::new(1, 1, 10, 100, 0, 1).with_reserve(3);
        assert!(a.try_spend(7, 0));
        assert!(!a.try_spend(1, 0), "the reserve is not spent normally");
        assert_eq!((a.remaining(0), a.emergency_remaining(0)), (0, 3));
        assert!(a.try_spend_emergency(3, 0));
        assert!(!a.try_spend_emergency(1, 0));
        assert_eq!((a.spent(), a.emergency_remaining(0)), (10, 0));
        assert!(!a.try_spend_emergency(1, 100), "not past the deadline");
        // Unlocked (a newer allocation holds the reserve): spendable normally.
        let b = HeldAllocation::new(4, 1, 10, 100, 0, 1).with_reserve(3);
        assert_eq!(b.remaining(0), 7);
        b.unlock_reserve();
        assert_eq!((b.reserve(), b.remaining(0)), (0, 10));
        assert!(b.try_spend(10, 0));
        // Extremes: a reserve above the grant is the whole grant; none at all is no reserve.
        let all = HeldAllocation::new(2, 1, 5, 100, 0, 1).with_reserve(u64::MAX);
        assert_eq!(
            (all.reserve(), all.remaining(0), all.emergency_remaining(0)),
            (5, 0, 5)
        );
        assert!(!all.try_spend(1, 0));
        let none = HeldAllocation::new(3, 1, u64::MAX, 100, 0, 1).with_reserve(0);
        assert_eq!(none.remaining(0), none.emergency_remaining(0));
        assert_eq!(none.close(), 0);
        assert_eq!(none.emergency_remaining(0), 0);
    }

    #[test]
    fn a_closed_allocation_spends_nothing_and_keeps_its_final_spend() {
        let a = HeldAllocation::new(1, 1, 10, 100, 0, 1);
        assert!(a.try_spend(3, 0));
        assert!(a.is_live(0));
        assert_eq!(a.close(), 3);
        assert!(!a.is_live(0));
        assert!(!a.try_spend(1, 0));
        assert_eq!(a.remaining(0), 0);
        assert_eq!(a.unspend(3), 0, "a cancel after the close keeps the spend");
        assert_eq!(a.close(), 3, "idempotent");
        assert_eq!(a.spent(), 3);
    }

    /// Issue 10 item 3: spends racing a close either land before it (and are in the final
    /// spend) or fail; none lands afterwards.
    #[test]
    fn spends_racing_a_close_never_exceed_the_final_spend() {
        for round in 0..50u64 {
            let a = Arc::new(HeldAllocation::new(round, 1, 1_000_000, u64::MAX, 0, 1));
            let admitted = Arc::new(AtomicU64::new(0));
            let go = Arc::new(AtomicBool::new(false));
            let final_spend = std::thread::scope(|s| {
                for _ in 0..3 {
                    let (a, admitted, go) = (a.clone(), admitted.clone(), go.clone());
                    s.spawn(move || {
                        while !go.load(Ordering::Acquire) {
                            std::hint::spin_loop();
                        }
                        for _ in 0..2_000 {
                            if a.try_spend(7, 0) {
                                admitted.fetch_add(7, Ordering::Relaxed);
                            }
                        }
                    });
                }
                go.store(true, Ordering::Release);
                for _ in 0..(round * 10) {
                    std::hint::spin_loop();
                }
                a.close()
            });
            assert_eq!(
                admitted.load(Ordering::Relaxed),
                final_spend,
                "round {round}"
            );
            assert_eq!(a.spent(), final_spend);
        }
    }
}

/// Rate-carrying allocations (design §9): accrual is exact in integer ns, starts 1 ms after the
/// grant was received, stops at the local deadline or the freeze, and never exceeds the grant;
/// and paced grants (the agent's own pace, `pace.rs`).
#[cfg(test)]
mod accrual_tests {
    use super::*;
    use allot_common::units::{MICROS_PER_TOKEN as T, NANOS_PER_SEC};

    const S: Nanos = NANOS_PER_SEC;

    /// 2 tokens now, 3 tokens/s from t = 10 s (received) + 1 ms until the deadline at 12 s.
    fn rated() -> HeldAllocation {
        HeldAllocation::new(1, 1, 2 * T, 12 * S, 0, 1).with_rate(3 * T, 10 * S, 100 * T)
    }

    #[test]
    fn accrual_is_exact_and_starts_after_the_grant_was_received() {
        let a = rated();
        let start = 10 * S + ACCRUAL_DELAY_NS;
        assert_eq!(a.accrual_start, start);
        // 3/s over 1.999 s: 5.997 tokens, the most it can ever spend beyond the base.
        assert_eq!(a.granted, 2 * T + 5_997_000);
        assert_eq!(a.limit_at(10 * S), 2 * T, "nothing before the start");
        // One token takes 333 333 333⅓ ns at 3/s: whole at the next ns, not before.
        let third = S / 3 + 1;
        assert_eq!(a.limit_at(start + third), 3 * T, "exactly 1 token");
        assert_eq!(
            a.limit_at(start + third - 1),
            3 * T - 1,
            "rounded down, never up"
        );
        assert!(a.try_spend(3 * T, start + third));
        assert!(!a.try_spend(1, start + third), "all of it spent");
        assert_eq!(a.accrual_wait(T, start + third), Some(S / 3));
        assert!(!a.try_spend(T, start + 2 * third - 2));
        assert!(a.try_spend(T, start + 2 * third - 1));
        // Past the deadline nothing is spent, whatever accrued.
        assert_eq!(a.remaining(12 * S), 0);
        assert!(!a.try_spend(1, 12 * S));
        assert_eq!(a.limit_at(u64::MAX), a.granted, "never beyond the grant");
    }

    #[test]
    fn a_frozen_accrual_stops_at_the_freeze_and_looks_ahead_only_until_it() {
        let a = rated();
        let start = a.accrual_start;
        assert!(a.accrues(start));
        assert_eq!(
            a.remaining_by(start, S),
            5 * T,
            "2 now + 3 over the next second"
        );
        a.freeze_accrual(start + S);
        a.freeze_accrual(start + 2 * S);
        assert_eq!(
            a.limit_at(start + 2 * S),
            5 * T,
            "frozen at the earlier time"
        );
        assert!(!a.accrues(start + S));
        assert_eq!(a.accrual_wait(T, start + S), None);
        // What accrued by the freeze is spendable at it: 2 + 3 tokens at exactly 1 s.
        assert_eq!(a.accrual_wait(5 * T, start + S / 2), Some(S / 2));
        assert_eq!(a.accrual_wait(5 * T + 1, start + S / 2), None);
        assert_eq!(a.accrual_wait(T, start), Some(0), "the base covers it");
        assert!(!a.spent_all_it_can(start + S));
        assert!(a.try_spend(5 * T, start + S));
        assert!(a.spent_all_it_can(start + S), "released at the next pass");
        assert!(!rated().spent_all_it_can(start), "still accruing");
        assert_eq!(
            a.accrual_wait(T, start),
            None,
            "nothing more before the freeze"
        );
    }

    #[test]
    fn accrual_at_the_extremes_saturates_and_respects_the_promise() {
        // The allocator's promise caps what the agent's clock could accrue.
        let a = HeldAllocation::new(1, 1, 0, u64::MAX, 0, 1).with_rate(u64::MAX, 0, 7);
        assert_eq!(a.granted, 7);
        assert_eq!(a.limit_at(u64::MAX - 1), 7);
        let b =
            HeldAllocation::new(1, 1, u64::MAX, u64::MAX, 0, 1).with_rate(u64::MAX, 0, u64::MAX);
        assert_eq!(b.granted, MAX_HELD_GRANT);
        assert_eq!(b.limit_at(u64::MAX), MAX_HELD_GRANT);
        // A received time at the top of the clock never wraps.
        let c = HeldAllocation::new(1, 1, T, u64::MAX, 0, 1).with_rate(T, u64::MAX, T);
        assert_eq!((c.granted, c.limit_at(u64::MAX)), (T, T));
        // No rate: the grant is spendable at once, as before.
        let d = HeldAllocation::new(1, 1, T, 5, 0, 1).with_rate(0, 0, 0);
        assert_eq!((d.limit_at(0), d.accrual_wait(1, 0)), (T, None));
    }

    /// A paced grant: 1 token at once, the other 7 evenly over 125 ms from its receipt; the
    /// whole grant is spendable at the pace's end, a later Acquire does not end the pace, and
    /// what the allocator knows of the grant (granted, base, rate) never changes.
    #[test]
    fn a_paced_grant_releases_its_rest_evenly_over_the_pace() {
        let ms = S / 1000;
        let t0 = 10 * S;
        let a = HeldAllocation::new(1, 1, 8 * T, 15 * S, 0, 1).paced(t0, 125 * ms, T);
        assert_eq!((a.granted, a.base, a.rate_per_s), (8 * T, 8 * T, 0));
        let p = a.pace.expect("paced");
        assert_eq!((p.at_once, p.per_s), (T, 56 * T), "7 tokens over 125 ms");
        assert_eq!(a.limit_at(t0), T);
        assert!(a.try_spend(T, t0));
        assert!(!a.try_spend(T, t0), "the next token is released first");
        assert_eq!(a.accrual_wait(T, t0), Some(S / 56 + 1));
        assert_eq!(
            a.accrual_wait(7 * T, t0),
            Some(125 * ms),
            "the rest at the end"
        );
        assert_eq!(a.accrual_wait(8 * T, t0), None, "more than the grant");
        // 3.5 tokens released at 62.5 ms: 4.5 in all, rounded down.
        assert_eq!(a.limit_at(t0 + 62 * ms + ms / 2), 4 * T + T / 2);
        // A later Acquire of the key (the freeze) leaves the pace alone.
        a.freeze_accrual(t0 + 63 * ms);
        assert!(a.accrues(t0 + 100 * ms));
        assert_eq!(
            a.limit_at(t0 + 125 * ms),
            8 * T,
            "all of it at the pace's end"
        );
        assert!(!a.accrues(t0 + 125 * ms));
        assert!(a.try_spend(7 * T, t0 + 125 * ms));
        assert_eq!(a.limit_at(u64::MAX), 8 * T);
    }

    #[test]
    fn a_closed_allocation_accrues_nothing_more_and_gives_no_wait() {
        let ms = S / 1000;
        let t0 = 7 * S;
        let paced = HeldAllocation::new(1, 1, 8 * T, t0 + 5 * S, 0, 1).paced(t0, 125 * ms, T);
        let rated = HeldAllocation::new(2, 1, T, t0 + 5 * S, 0, 1).with_rate(10 * T, t0, 4 * T);
        for a in [&paced, &rated] {
            assert!(a.accrues(t0 + ms));
            assert!(a.accrual_wait(2 * T, t0).is_some());
            a.close();
            assert!(
                !a.accrues(t0 + ms),
                "closed: nothing it accrues is spendable"
            );
            assert_eq!(a.accrual_wait(2 * T, t0), None);
            assert!(!a.try_spend(T, t0 + 100 * ms));
        }
    }

    #[test]
    fn a_pace_changes_nothing_without_a_rest_or_with_a_rate_and_stops_at_the_deadline() {
        let ms = S / 1000;
        // One token, or no pace: spendable at once.
        let one = HeldAllocation::new(1, 1, T, 5 * S, 0, 1).paced(0, 125 * ms, T);
        assert_eq!((one.pace, one.limit_at(0)), (None, T));
        let none = HeldAllocation::new(1, 1, 8 * T, 5 * S, 0, 1).paced(0, 0, T);
        assert_eq!((none.pace, none.limit_at(0)), (None, 8 * T));
        // The allocator's rate is left as granted.
        let r = rated().paced(10 * S, 125 * ms, T);
        assert_eq!((r.pace, r.base, r.rate_per_s), (None, 2 * T, 3 * T));
        // A pace that would outlast the lease is none: the grant is spendable at once.
        let d = HeldAllocation::new(1, 1, 10 * T, 100 * ms, 0, 1).paced(0, 200 * ms, 0);
        assert_eq!((d.pace, d.limit_at(0)), (None, 10 * T));
        let fits = HeldAllocation::new(1, 1, 10 * T, 100 * ms, 0, 1).paced(0, 100 * ms, 0);
        assert_eq!(fits.limit_at(99 * ms), 9 * T + 900_000);
        // The largest grant over 1 ns: all of it at the end.
        let big = HeldAllocation::new(1, 1, u64::MAX, u64::MAX, 0, 1).paced(0, 1, 0);
        assert_eq!((big.limit_at(0), big.limit_at(1)), (0, MAX_HELD_GRANT));
        assert_eq!(big.accrual_wait(MAX_HELD_GRANT, 0), Some(1));
    }
}
