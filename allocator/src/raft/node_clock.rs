//! The clocks a node reads, injectable so tests control time: the wall clock (Unix ms, may jump
//! either way) and a monotonic clock (ns, only ever moves forward at real rate). Together they
//! bound the time a node stamps into proposals (see [`super::ledger_time`], design §6 "Clocks").
//!
//! Not the decision core's `allot_common::clock::Clock` (one monotonic reading in ns that every
//! decision takes as `now`): a node needs the wall clock and the monotonic clock as a pair, and
//! the ledger itself reads neither (it takes its time from the log entry).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Source of this node's time: a wall clock and a monotonic clock.
pub trait NodeClock: Send + Sync + 'static {
    /// Wall-clock now, in milliseconds since the Unix epoch (UTC). May step backwards or
    /// forwards when the host's clock is set; never used alone to advance ledger time.
    fn now_ms(&self) -> u64;

    /// Monotonic now, in nanoseconds since an arbitrary origin fixed for this process. Never
    /// goes backwards and runs at real rate; only differences of two readings mean anything.
    fn monotonic_ns(&self) -> u64;
}

/// The system clocks: [`SystemTime`] for the wall clock, [`Instant`] for the monotonic one.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemNodeClock;

/// The monotonic origin shared by every [`SystemNodeClock`] of this process.
fn monotonic_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl NodeClock for SystemNodeClock {
    fn now_ms(&self) -> u64 {
        // A clock before 1970 is a broken host; 0 is then the least harmful stamp because the
        // stamp never goes below the last applied one (see `ledger_time`).
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    fn monotonic_ns(&self) -> u64 {
        // u64 nanoseconds last 584 years past the process's first reading.
        u64::try_from(monotonic_origin().elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock that only moves when told to; clones share the same time. Its wall and monotonic
/// readings move together with [`ManualNodeClock::advance`] (real time passing) and apart with
/// [`ManualNodeClock::set`] / [`ManualNodeClock::advance_wall`] (the wall clock stepped) or
/// [`ManualNodeClock::advance_monotonic`] (a wall clock that stands still).
///
/// A daemon on this clock ticks only when the monotonic clock has moved a whole tick period
/// past the last entry that moved ledger time (`daemon::ticker`): a test that waits for an
/// allocation to expire on an idle cluster must advance it by at least one period.
#[derive(Debug, Clone, Default)]
pub struct ManualNodeClock {
    now_ms: Arc<AtomicU64>,
    mono_ns: Arc<AtomicU64>,
}

impl ManualNodeClock {
    /// A clock whose wall reads `start_ms` (Unix milliseconds) and whose monotonic clock reads 0.
    pub fn new(start_ms: u64) -> Self {
        Self::with_monotonic(start_ms, 0)
    }

    /// A clock whose wall reads `start_ms` (Unix ms) and whose monotonic clock reads `mono_ns`
    /// (each node of a test cluster has its own origin, as real processes do).
    pub fn with_monotonic(start_ms: u64, mono_ns: u64) -> Self {
        Self {
            now_ms: Arc::new(AtomicU64::new(start_ms)),
            mono_ns: Arc::new(AtomicU64::new(mono_ns)),
        }
    }

    /// Real time passes: both clocks move forward by `ms` milliseconds (saturating).
    pub fn advance(&self, ms: u64) {
        self.advance_wall(ms);
        self.advance_monotonic(ms);
    }

    /// Only the wall clock moves forward by `ms` milliseconds (saturating): a forward step.
    pub fn advance_wall(&self, ms: u64) {
        add(&self.now_ms, ms);
    }

    /// Only the monotonic clock moves forward by `ms` milliseconds (saturating): real time
    /// passes while the wall clock stands still.
    pub fn advance_monotonic(&self, ms: u64) {
        add(&self.mono_ns, ms.saturating_mul(1_000_000));
    }

    /// Sets the wall clock to `ms` (Unix milliseconds); it may go backwards, as real clocks do.
    /// The monotonic clock does not move.
    pub fn set(&self, ms: u64) {
        self.now_ms.store(ms, Ordering::SeqCst);
    }
}

/// Adds `by` to `cell`, saturating at `u64::MAX`.
fn add(cell: &AtomicU64, by: u64) {
    let _ = cell.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
        Some(t.saturating_add(by))
    });
}

impl NodeClock for ManualNodeClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn monotonic_ns(&self) -> u64 {
        self.mono_ns.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_wall_and_monotonic_together_or_apart_and_saturates() {
        let c = ManualNodeClock::with_monotonic(1_000, 5);
        c.advance(2);
        assert_eq!((c.now_ms(), c.monotonic_ns()), (1_002, 2_000_005));
        c.advance_wall(10);
        c.set(0);
        assert_eq!((c.now_ms(), c.monotonic_ns()), (0, 2_000_005));
        c.advance_monotonic(1);
        assert_eq!((c.now_ms(), c.monotonic_ns()), (0, 3_000_005));
        c.advance(u64::MAX);
        assert_eq!((c.now_ms(), c.monotonic_ns()), (u64::MAX, u64::MAX));
        let clone = c.clone();
        clone.set(7);
        assert_eq!(c.now_ms(), 7, "clones share one time");
    }

    #[test]
    fn system_monotonic_clock_never_goes_back() {
        let a = SystemNodeClock.monotonic_ns();
        let b = SystemNodeClock.monotonic_ns();
        assert!(b >= a);
        assert!(SystemNodeClock.now_ms() > 0);
    }
}
