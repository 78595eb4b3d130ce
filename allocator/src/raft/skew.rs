//! This node's wall clock against ledger time (issue 10 item 2): measured, warned about and
//! counted, so a host whose clock is off is found before it matters.
//!
//! Ledger time no longer follows a wall clock that runs ahead ([`super::ledger_time`]), so a
//! skewed host cannot refill buckets early or expire allocations early; but its skew still
//! means something is wrong with the host (NTP down, a stepped clock), and a ledger that started
//! ahead (the first stamp of a fresh cluster comes from a wall clock) waits for wall clocks to
//! reach it. The allowed drift is the policies' `max_drift_ms`, the same margin the ledger
//! grants agents' clocks.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use super::ledger_time::LedgerTime;

/// Least time between two skew warnings of one node, monotonic ns (one minute).
pub const WARN_EVERY_NS: u64 = 60_000_000_000;

/// Marks "never warned" in [`SkewMonitor::last_warn_ns`].
const NEVER: u64 = u64::MAX;

/// The outcome of one [`SkewMonitor::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkewCheck {
    /// The node applied no stamp yet: there is no ledger time to compare with.
    Unknown,
    /// |wall − ledger time| ≤ the allowed drift.
    Within {
        /// Wall clock minus ledger time, ms.
        skew_ms: i64,
    },
    /// |wall − ledger time| > the allowed drift.
    Beyond {
        /// Wall clock minus ledger time, ms.
        skew_ms: i64,
        /// Whether this check logged the warning (at most one per [`WARN_EVERY_NS`]).
        warned: bool,
    },
}

/// What a node reports about its clock (the `ClusterStatus` fields).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SkewStatus {
    /// The last measured wall clock minus ledger time, ms (a gauge); `None` before the first
    /// measurement with ledger time known.
    pub skew_ms: Option<i64>,
    /// How many checks found the skew beyond the allowed drift (a counter).
    pub beyond_max: u64,
}

/// Skew gauge, counter and warning rate limit of one node.
#[derive(Debug)]
pub struct SkewMonitor {
    skew_ms: AtomicI64,
    measured: AtomicBool,
    beyond_max: AtomicU64,
    last_warn_ns: AtomicU64,
}

impl Default for SkewMonitor {
    fn default() -> Self {
        Self {
            skew_ms: AtomicI64::new(0),
            measured: AtomicBool::new(false),
            beyond_max: AtomicU64::new(0),
            last_warn_ns: AtomicU64::new(NEVER),
        }
    }
}

impl SkewMonitor {
    /// Measures `time`'s skew (wall − ledger time, ms) now, records it, and when its magnitude
    /// exceeds `max_ms` counts it and logs a warning unless one was logged less than
    /// [`WARN_EVERY_NS`] ago (on `time`'s monotonic clock).
    pub fn check(&self, time: &LedgerTime, max_ms: u64) -> SkewCheck {
        let Some(skew_ms) = time.skew_ms() else {
            return SkewCheck::Unknown;
        };
        self.skew_ms.store(skew_ms, Ordering::Relaxed);
        self.measured.store(true, Ordering::Release);
        if skew_ms.unsigned_abs() <= max_ms {
            return SkewCheck::Within { skew_ms };
        }
        self.beyond_max.fetch_add(1, Ordering::Relaxed);
        let warned = self.claim_warning(time.clock().monotonic_ns());
        if warned {
            tracing::warn!(
                skew_ms,
                max_drift_ms = max_ms,
                wall_ms = time.clock().now_ms(),
                ledger_ms = time.now_ms(),
                "this node's wall clock is off ledger time by more than the policies' max drift \
                 (positive: ahead); ledger time does not follow it, check the host's time sync"
            );
        }
        SkewCheck::Beyond { skew_ms, warned }
    }

    /// The last measurement and the count of checks beyond the allowed drift.
    pub fn status(&self) -> SkewStatus {
        let measured = self.measured.load(Ordering::Acquire);
        SkewStatus {
            skew_ms: measured.then(|| self.skew_ms.load(Ordering::Relaxed)),
            beyond_max: self.beyond_max.load(Ordering::Relaxed),
        }
    }

    /// Whether a warning may be logged at monotonic `now_ns`; if so, records it (one caller
    /// wins when several race).
    fn claim_warning(&self, now_ns: u64) -> bool {
        let last = self.last_warn_ns.load(Ordering::Acquire);
        warning_due(last, now_ns)
            && self
                .last_warn_ns
                .compare_exchange(last, now_ns, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }
}

/// Whether a warning last logged at `last_ns` ([`NEVER`]: never) may be repeated at `now_ns`.
fn warning_due(last_ns: u64, now_ns: u64) -> bool {
    last_ns == NEVER || now_ns.saturating_sub(last_ns) >= WARN_EVERY_NS
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::raft::ManualNodeClock;

    #[test]
    fn skew_beyond_the_drift_is_counted_every_time_and_warned_once_a_minute() {
        let clock = ManualNodeClock::with_monotonic(10_000, 0);
        let time = LedgerTime::new(Arc::new(clock.clone()));
        let monitor = SkewMonitor::default();
        assert_eq!(monitor.check(&time, 100), SkewCheck::Unknown);
        assert_eq!(monitor.status(), SkewStatus::default());

        time.applied(10_000);
        clock.advance_wall(100);
        assert_eq!(
            monitor.check(&time, 100),
            SkewCheck::Within { skew_ms: 100 }
        );
        clock.advance_wall(2_900);
        let beyond = |warned| SkewCheck::Beyond {
            skew_ms: 3_000,
            warned,
        };
        assert_eq!(monitor.check(&time, 100), beyond(true));
        assert_eq!(monitor.check(&time, 100), beyond(false));
        // Real time passes on both clocks: the skew stays, the warning comes back after a minute.
        clock.advance(59_999);
        assert_eq!(monitor.check(&time, 100), beyond(false));
        clock.advance(1);
        assert_eq!(monitor.check(&time, 100), beyond(true));
        assert_eq!(
            monitor.status(),
            SkewStatus {
                skew_ms: Some(3_000),
                beyond_max: 4
            }
        );
        // Behind counts the same as ahead.
        clock.set(0);
        assert!(matches!(
            monitor.check(&time, u64::MAX - 1),
            SkewCheck::Within { skew_ms } if skew_ms < 0
        ));
        assert!(matches!(
            monitor.check(&time, 0),
            SkewCheck::Beyond { skew_ms, warned: false } if skew_ms < 0
        ));
    }

    #[test]
    fn the_warning_rate_limit_holds_at_the_extremes() {
        assert!(warning_due(NEVER, 0));
        assert!(!warning_due(0, WARN_EVERY_NS - 1));
        assert!(warning_due(0, WARN_EVERY_NS));
        assert!(
            !warning_due(u64::MAX - 1, 0),
            "a reading before the last one waits"
        );
        assert!(warning_due(0, u64::MAX));
    }
}
