//! One allocation held by the agent: a batch of spendable microtokens, spent with atomics on the
//! hot path (seed §21, §31 step 6).

use allot_common::units::{Micros, Nanos};
use std::sync::atomic::{AtomicU64, Ordering};

/// A granted allocation as the agent holds it.
///
/// `spent` only grows on the hot path (one compare-and-swap per spend); a cancelled
/// all-or-nothing reservation gives its tokens back with [`HeldAllocation::unspend`].
#[derive(Debug)]
pub struct HeldAllocation {
    /// Allocator's id for it (never reused).
    pub id: u64,
    /// Its epoch (fencing token for reports).
    pub epoch: u64,
    /// Microtokens granted.
    pub granted: Micros,
    /// Local deadline on the agent's monotonic clock, ns: the time the Acquire was *sent* + ttl
    /// − drift margin. Past it the agent never spends from this allocation.
    pub deadline: Nanos,
    /// Allocator-stamped expiry, Unix ms (for status pages).
    pub expires_at_unix_ms: u64,
    /// Policy version it was granted under.
    pub policy_version: u64,
    spent: AtomicU64,
    reported: AtomicU64,
}

impl HeldAllocation {
    /// A fresh allocation with nothing spent.
    pub fn new(
        id: u64,
        epoch: u64,
        granted: Micros,
        deadline: Nanos,
        expires_at_unix_ms: u64,
        policy_version: u64,
    ) -> Self {
        HeldAllocation {
            id,
            epoch,
            granted,
            deadline,
            expires_at_unix_ms,
            policy_version,
            spent: AtomicU64::new(0),
            reported: AtomicU64::new(0),
        }
    }

    /// Spends `cost` if it fits and the allocation is still usable at `now`. Lock-free.
    #[inline]
    pub fn try_spend(&self, cost: Micros, now: Nanos) -> bool {
        if now >= self.deadline {
            return false;
        }
        let mut cur = self.spent.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(cost).filter(|n| *n <= self.granted) else {
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

    /// Gives back `cost` spent by a reservation that was then cancelled (all-or-nothing).
    #[inline]
    pub fn unspend(&self, cost: Micros) {
        self.spent.fetch_sub(cost, Ordering::AcqRel);
    }

    /// Microtokens spent so far (cumulative, what reports carry).
    pub fn spent(&self) -> Micros {
        self.spent.load(Ordering::Acquire)
    }

    /// Microtokens left to spend (0 past the deadline).
    pub fn remaining(&self, now: Nanos) -> Micros {
        if now >= self.deadline {
            0
        } else {
            self.granted.saturating_sub(self.spent())
        }
    }

    /// Whether the deadline has passed.
    pub fn is_expired(&self, now: Nanos) -> bool {
        now >= self.deadline
    }

    /// Highest cumulative spend the allocator acknowledged.
    pub fn reported(&self) -> Micros {
        self.reported.load(Ordering::Acquire)
    }

    /// Records an acknowledged report (max-merged, like the allocator).
    pub fn set_reported(&self, v: Micros) {
        self.reported.fetch_max(v, Ordering::AcqRel);
    }

    /// Granted but not yet reported: this allocation's share of the overshoot bound (seed §23).
    pub fn unreported(&self) -> Micros {
        self.granted.saturating_sub(self.reported())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        a.unspend(4);
        assert_eq!(a.spent(), 0);
        assert!(!a.try_spend(u64::MAX, 0));
        a.set_reported(6);
        a.set_reported(2);
        assert_eq!((a.reported(), a.unreported()), (6, 4));
    }
}
