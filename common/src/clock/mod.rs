//! Injected time (design §10 "Units and time"): algorithms never read a clock themselves; callers
//! pass `now` from a [`Clock`], so tests drive a [`ManualClock`] and never sleep.

mod scale;

use crate::units::{cold, Nanos};
use scale::TickScale;
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
/// Ticks become nanoseconds by quanta's own calibration, taken once at construction as a
/// fixed-point ratio (`clock/scale.rs`): per read, one multiply (and for a counter of up to
/// 1 GHz a constant shift) that give the nanoseconds quanta gives, saturating where quanta's
/// would wrap.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    /// The clock's raw reading at construction (TSC ticks, or ns without a TSC).
    start_raw: u64,
    scale: TickScale,
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
        let probe_ns = clock.delta_as_nanos(0, 1 << scale::PROBE_TICKS_LOG2);
        MonotonicClock {
            start_raw: clock.raw(),
            scale: TickScale::from_probe(probe_ns),
            clock,
            anchor_unix_ns: anchor_ns,
        }
    }

    /// The time of raw reading `raw`: a reading at or before the start counts as no time
    /// elapsed (so an earlier counter on another core never reads before the anchor), and
    /// the sum saturates at `u64::MAX` (it never wraps to an earlier time).
    #[inline]
    fn at_raw(&self, raw: u64) -> Nanos {
        // Branches, not conditional moves, for the two limits (never reached in practice): the
        // decision's compare-and-swap waits for this time, so each step on the way adds to
        // every decision.
        let Some(ticks) = raw.checked_sub(self.start_raw) else {
            cold();
            return self.anchor_unix_ns;
        };
        let elapsed = self.scale.nanos(ticks);
        match self.anchor_unix_ns.checked_add(elapsed) {
            Some(t) => t,
            None => {
                cold();
                u64::MAX
            }
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
        self.at_raw(self.clock.raw())
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
        let mut prev = c.now();
        assert!(prev >= 1_000);
        for _ in 0..100_000 {
            let t = c.now();
            assert!(t >= prev, "{t} after {prev}");
            prev = t;
        }
    }

    /// The clock as built, with its start, scale and anchor replaced.
    fn clock_at(start_raw: u64, scale: TickScale, anchor_unix_ns: Nanos) -> MonotonicClock {
        MonotonicClock {
            start_raw,
            scale,
            anchor_unix_ns,
            ..MonotonicClock::with_anchor(0)
        }
    }

    #[test]
    fn a_reading_before_the_start_is_the_anchor() {
        let c = clock_at(1_000, TickScale::IDENTITY, 5_000);
        assert_eq!(c.at_raw(0), 5_000);
        assert_eq!(c.at_raw(999), 5_000);
        assert_eq!(c.at_raw(1_000), 5_000);
        assert_eq!(c.at_raw(1_001), 5_001);
    }

    #[test]
    fn the_time_saturates_at_the_end_of_u64() {
        // Anchor near the end: the sum stops at u64::MAX and stays there.
        let c = clock_at(0, TickScale::IDENTITY, u64::MAX - 10);
        assert_eq!(c.at_raw(0), u64::MAX - 10);
        assert_eq!(c.at_raw(10), u64::MAX);
        assert_eq!(c.at_raw(11), u64::MAX);
        assert_eq!(c.at_raw(u64::MAX), u64::MAX);
        // The largest raw reading from the start of time.
        let c = clock_at(0, TickScale::IDENTITY, 0);
        assert_eq!(c.at_raw(u64::MAX), u64::MAX);
        // A slow counter (41.7 ns per tick): u64::MAX ticks saturate rather than wrap.
        let slow = TickScale::from_probe(43_690_667u64 << (scale::PROBE_TICKS_LOG2 - 20));
        let c = clock_at(7, slow, 1);
        assert_eq!(c.at_raw(u64::MAX), u64::MAX);
        assert!(c.at_raw(u64::MAX / 64) < u64::MAX);
    }

    #[test]
    fn later_readings_are_never_earlier_times() {
        let fast = TickScale::from_probe(13_700_000u64 << (scale::PROBE_TICKS_LOG2 - 25));
        for (start, anchor) in [
            (0, 0),
            (12_345, 1_700_000_000_000_000_000),
            (u64::MAX - 5, 3),
        ] {
            let c = clock_at(start, fast, anchor);
            let mut prev = c.at_raw(0);
            let mut raws: Vec<u64> = (0..64).flat_map(|s| [(1u64 << s) - 1, 1 << s]).collect();
            raws.extend([
                start.saturating_sub(1),
                start,
                start.saturating_add(1),
                u64::MAX,
            ]);
            raws.sort_unstable();
            for raw in raws {
                let t = c.at_raw(raw);
                assert!(t >= prev && t >= anchor, "raw {raw}: {t} after {prev}");
                prev = t;
            }
        }
    }

    #[test]
    fn the_scale_gives_quantas_nanoseconds() {
        let q = quanta::Clock::new();
        let c = MonotonicClock::with_anchor(0);
        for ticks in [0u64, 1, 1_000, 1 << 20, 1 << 32, 1 << 40] {
            let raw = c.start_raw.saturating_add(ticks);
            assert_eq!(
                c.at_raw(raw),
                q.delta_as_nanos(c.start_raw, raw),
                "{ticks} ticks"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 10_000, ..Default::default() })]

        /// `at_raw` is the anchor plus quanta's `delta_as_nanos` on a counter of ratio (f, s)
        /// (s ≤ 32), saturating, and never goes back as the raw reading grows.
        #[test]
        fn at_raw_is_the_anchor_plus_quantas_delta_and_monotone(
            s in 0u32..=32,
            fx in proptest::prelude::any::<u64>(),
            start in proptest::prelude::any::<u64>(),
            anchor in proptest::prop_oneof![proptest::prelude::any::<u64>(), 0u64..2_000_000_000_000_000_000],
            a in proptest::prelude::any::<u64>(),
            d in proptest::prop_oneof![0u64..1_000_000, proptest::prelude::any::<u64>()],
        ) {
            let f = fx % ((1u64 << s) << 16).max(1); // under 2^16 ns per tick
            let probe = ((u128::from(1u64 << scale::PROBE_TICKS_LOG2) * u128::from(f)) >> s) as u64;
            let c = clock_at(start, TickScale::from_probe(probe), anchor);
            let delta = |raw: u64| if raw <= start { 0 } else { (u128::from(raw - start) * u128::from(f)) >> s };
            let want = |raw: u64| u64::try_from(u128::from(anchor) + delta(raw)).unwrap_or(u64::MAX);
            let b = a.saturating_add(d);
            proptest::prop_assert_eq!(c.at_raw(a), want(a), "f {} s {} start {} raw {}", f, s, start, a);
            proptest::prop_assert_eq!(c.at_raw(b), want(b));
            proptest::prop_assert!(c.at_raw(b) >= c.at_raw(a));
            proptest::prop_assert!(c.at_raw(a) >= anchor);
        }
    }
}
