//! Central decisions for the long tail, leases for the hot head (issue 9 item 2), per key and
//! agent, from the demand this agent measures.
//!
//! A key starts **central**: each request is one `Decide` round trip, exact (the allocator
//! debits before the agent admits, so it adds nothing to the overshoot bound), and nothing is
//! stranded at an agent that saw the key once. It is **promoted** to leases when its demand
//! here makes a lease worthwhile, and **demoted** when it cools. With `period` the rule's lease
//! ttl, `offered` the tokens this agent was asked for the key in the current period (admitted
//! plus finally denied: [`KeyLease::offered`](super::book::KeyLease::offered)), and the
//! settings `promote_tokens` = P (default 4) and `demote_tokens` = D (default 2, D < P):
//!
//! - promote when `offered ≥ P` within one lease period (checked at each central admission);
//! - demote when a whole lease period of a leased key offered `< D` (checked each tick).
//!
//! Offered, not admitted: a leased key denied under scarcity (its region's part or the bucket
//! spent) still has its demand, and demoting it would turn each of its requests into a
//! `Decide` exactly when the allocator has least to give.
//!
//! Why: a lease costs about two calls per period (an Acquire and a Release; reports ride the
//! per-tick Batch) and puts its grant in the overshoot bound; central decisions cost one call
//! per request. Leasing pays from about `2 · 2 = 4` requests per period, and a key is sent back
//! only below 2, where central decisions cost no more calls than the lease did: the gap P − D
//! and a full period's dwell after each move are the hysteresis. A demoted key keeps spending
//! what it holds; its allocations are released when spent or expired, by the usual fencing.
//! `promote_tokens: 0` leases every key from first sight (central decisions off).

use allot_common::units::{Micros, Nanos, MICROS_PER_TOKEN};
use std::sync::atomic::{AtomicU64, Ordering};

/// Thresholds of promotion and demotion, microtokens per lease period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Promote at this many admitted within one period (0: always leased).
    pub promote: Micros,
    /// Demote below this many admitted over a whole period.
    pub demote: Micros,
}

impl Thresholds {
    /// From the settings, in tokens (saturating).
    pub fn from_tokens(promote: u64, demote: u64) -> Self {
        Thresholds {
            promote: promote.saturating_mul(MICROS_PER_TOKEN),
            demote: demote.saturating_mul(MICROS_PER_TOKEN),
        }
    }

    /// Whether central decisions are off (every key leased).
    pub fn always_leased(&self) -> bool {
        self.promote == 0
    }
}

/// The current measuring window of one key: when it started and the key's admitted total then.
#[derive(Debug, Default)]
pub struct DemandWindow {
    start: AtomicU64,
    base: AtomicU64,
}

impl DemandWindow {
    /// Starts a new window at `now` with the key's `admitted` total.
    pub fn restart(&self, now: Nanos, admitted: Micros) {
        self.start.store(now, Ordering::Relaxed);
        self.base.store(admitted, Ordering::Relaxed);
    }

    /// At a central admission of `cost` at `now` (the key's total, `admitted`, includes it):
    /// whether the key reached the promotion threshold within one `period` (ns). A window
    /// older than the period starts over first, with this admission as its first.
    pub fn promote_due(
        &self,
        now: Nanos,
        period: Nanos,
        admitted: Micros,
        cost: Micros,
        t: Thresholds,
    ) -> bool {
        if now.saturating_sub(self.start.load(Ordering::Relaxed)) >= period {
            self.restart(now, admitted.saturating_sub(cost));
        }
        let within = admitted.saturating_sub(self.base.load(Ordering::Relaxed));
        within >= t.promote
    }

    /// Each tick for a leased key: when a whole `period` has passed, whether it admitted less
    /// than the demotion threshold in it (the window then starts over).
    pub fn demote_due(&self, now: Nanos, period: Nanos, admitted: Micros, t: Thresholds) -> bool {
        if now.saturating_sub(self.start.load(Ordering::Relaxed)) < period {
            return false;
        }
        let within = admitted.saturating_sub(self.base.load(Ordering::Relaxed));
        self.restart(now, admitted);
        within < t.demote
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Micros = MICROS_PER_TOKEN;
    const PERIOD: Nanos = 1_000;

    #[test]
    fn promoted_at_p_tokens_within_one_period_only() {
        let th = Thresholds::from_tokens(4, 2);
        let w = DemandWindow::default();
        w.restart(0, 0);
        // Three tokens in a period: not yet; the fourth in the same period: promoted.
        assert!(!w.promote_due(10, PERIOD, T, T, th));
        assert!(!w.promote_due(20, PERIOD, 2 * T, T, th));
        assert!(!w.promote_due(30, PERIOD, 3 * T, T, th));
        assert!(w.promote_due(40, PERIOD, 4 * T, T, th));
        // Sparse: one token per period never promotes.
        let w = DemandWindow::default();
        w.restart(0, 0);
        for i in 1..=20 {
            assert!(
                !w.promote_due(i * PERIOD, PERIOD, i * T, T, th),
                "token {i}"
            );
        }
    }

    #[test]
    fn demoted_below_d_over_a_whole_period_with_hysteresis() {
        let th = Thresholds::from_tokens(4, 2);
        let w = DemandWindow::default();
        w.restart(0, 0);
        // Not before a whole period has passed, whatever the demand.
        assert!(!w.demote_due(PERIOD - 1, PERIOD, 0, th));
        // 3 tokens in the period: below P but not below D: stays leased (the hysteresis band).
        assert!(!w.demote_due(PERIOD, PERIOD, 3 * T, th));
        // 2 more in the next: still not below D.
        assert!(!w.demote_due(2 * PERIOD, PERIOD, 5 * T, th));
        // 1 in the next: demoted.
        assert!(w.demote_due(3 * PERIOD, PERIOD, 6 * T, th));
    }

    #[test]
    fn thresholds_saturate_and_zero_means_always_leased() {
        assert!(Thresholds::from_tokens(0, 0).always_leased());
        let big = Thresholds::from_tokens(u64::MAX, u64::MAX);
        assert_eq!((big.promote, big.demote), (u64::MAX, u64::MAX));
        let w = DemandWindow::default();
        assert!(!w.promote_due(u64::MAX, u64::MAX, u64::MAX - 1, 1, big));
        let fresh = DemandWindow::default();
        let one = Thresholds::from_tokens(1, 0);
        assert!(fresh.promote_due(0, 1, u64::MAX, u64::MAX, one));
    }
}
