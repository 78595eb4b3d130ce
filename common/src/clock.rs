//! Injected time (design §10 "Units and time"): algorithms never read a clock themselves; callers
//! pass `now` from a [`Clock`], so tests drive a [`ManualClock`] and never sleep.

use crate::units::Nanos;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of `now` in nanoseconds from a fixed origin.
///
/// Implementations must be monotonic for a single caller (a later call never returns less than an
/// earlier one). Concurrent callers may still observe slightly different values and reach a
/// limiter in a different order; the algorithms treat an earlier `now` as the latest time the key
/// has seen, so this never creates tokens.
pub trait Clock: Send + Sync {
    /// Nanoseconds since this clock's origin.
    fn now(&self) -> Nanos;
}

/// The production clock: monotonic, anchored at the Unix time read once at construction, so
/// windows align to UTC boundaries (a per-day limit resets at 00:00 UTC) while wall-clock steps
/// after start cannot move time backwards or create tokens.
///
/// Reads go through `quanta` (the invariant TSC where the CPU has one, else the OS monotonic
/// clock): a read costs about a third of `Instant::now()` here, and every decision reads it.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    /// The clock's raw reading at construction (TSC ticks, or ns without a TSC).
    start_raw: u64,
    anchor_unix_ns: Nanos,
}

impl MonotonicClock {
    /// A clock whose origin is the Unix epoch as read from the system clock now.
    pub fn new() -> Self {
        let anchor = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self::with_anchor(anchor)
    }

    /// A clock that reads `anchor_ns` now and advances monotonically from there.
    pub fn with_anchor(anchor_ns: Nanos) -> Self {
        let clock = quanta::Clock::new();
        MonotonicClock {
            start_raw: clock.raw(),
            clock,
            anchor_unix_ns: anchor_ns,
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> Nanos {
        // Scaling only the delta since construction (one multiply and shift) skips the
        // `Duration` round trip; a reading at or before the start counts as no time elapsed.
        let elapsed = self.clock.delta_as_nanos(self.start_raw, self.clock.raw());
        self.anchor_unix_ns.saturating_add(elapsed)
    }
}

/// A clock moved only by its owner: for tests, simulations and trace replay.
///
/// Clones share one time value, so a test can hold one handle and give another to the code under
/// test. It may be set backwards on purpose, to test how algorithms handle that.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A manual clock reading `start_ns`.
    pub fn new(start_ns: Nanos) -> Self {
        ManualClock {
            now: Arc::new(AtomicU64::new(start_ns)),
        }
    }

    /// Sets the time (may move it backwards).
    pub fn set(&self, ns: Nanos) {
        self.now.store(ns, Ordering::SeqCst);
    }

    /// Moves the time forward by `ns`, saturating at `u64::MAX`.
    pub fn advance(&self, ns: Nanos) {
        let _ = self
            .now
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(ns))
            });
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new(5);
        let b = a.clone();
        a.advance(10);
        assert_eq!(b.now(), 15);
        b.set(3);
        assert_eq!(a.now(), 3);
        a.advance(u64::MAX);
        assert_eq!(a.now(), u64::MAX);
    }

    #[test]
    fn monotonic_clock_does_not_go_back() {
        let c = MonotonicClock::with_anchor(1_000);
        let a = c.now();
        let b = c.now();
        assert!(a >= 1_000 && b >= a);
    }
}
