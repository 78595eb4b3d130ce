//! The agent's own pace of spending a grant (issue 9, weighted costs): some microtokens at
//! once, the rest released evenly over a time, all of it at the end. A key over its limit
//! spends a grant that is the allocator's refill since its last ask this way, as the ideal
//! central counter hands its refill out as it comes (see `HeldAllocation::paced`).

use allot_common::algorithm::Rate;
use allot_common::units::{Micros, Nanos, NANOS_PER_SEC};

/// A pace: `at_once` microtokens from `start`, then `per_s` until `end`, when everything is
/// released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Microtokens released at `start`.
    pub at_once: Micros,
    /// Microtokens released per second after `start` (rounded up, saturating: whatever it
    /// falls short of is released at `end`).
    pub per_s: u64,
    /// When the pace starts, ns on the agent's clock.
    pub start: Nanos,
    /// When everything is released, ns on the agent's clock.
    pub end: Nanos,
}

impl Pace {
    /// The pace releasing `total` microtokens: `at_once` (at most `total`) at `start` (ns),
    /// the rest evenly over the next `pace_ns` ns. `None` when there is no rest or no time
    /// (everything is spendable at once).
    pub fn new(total: Micros, at_once: Micros, start: Nanos, pace_ns: Nanos) -> Option<Pace> {
        let at_once = at_once.min(total);
        let rest = total - at_once;
        if rest == 0 || pace_ns == 0 {
            return None;
        }
        // ⌈rest / pace⌉ per second: the whole rest is released by `end`.
        let per_s = (u128::from(rest) * u128::from(NANOS_PER_SEC)).div_ceil(u128::from(pace_ns));
        Some(Pace {
            at_once,
            per_s: u64::try_from(per_s).unwrap_or(u64::MAX),
            start,
            end: start.saturating_add(pace_ns),
        })
    }

    /// Microtokens released by `now`, rounded down (`u64::MAX` from the end on).
    pub fn released(&self, now: Nanos) -> Micros {
        if now >= self.end {
            return u64::MAX;
        }
        let grown = Rate::per_second(self.per_s).produced(now.saturating_sub(self.start));
        self.at_once.saturating_add(grown)
    }

    /// The first ns at which `total` microtokens are released (the end at the latest).
    pub fn release_at(&self, total: Micros) -> Nanos {
        let need = total.saturating_sub(self.at_once);
        let t = Rate::per_second(self.per_s).time_for(need);
        self.start.saturating_add(t).min(self.end)
    }

    /// Whether it still releases at `now`.
    pub fn releasing(&self, now: Nanos) -> bool {
        now < self.end
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_common::units::MICROS_PER_TOKEN as T;

    const MS: Nanos = 1_000_000;

    #[test]
    fn a_pace_releases_evenly_rounding_down_and_everything_at_its_end() {
        let p = Pace::new(8 * T, T, 10 * MS, 125 * MS).expect("a rest and a time");
        assert_eq!(
            (p.at_once, p.per_s, p.end),
            (T, 56 * T, 135 * MS),
            "7 over 125 ms"
        );
        assert_eq!(p.released(0), T, "before its start, what it gives at once");
        assert_eq!(p.released(10 * MS), T);
        // One token takes 1/56 s = 17,857,142.86 ns: released at the next ns, not before.
        assert_eq!(p.released(10 * MS + 17_857_142), 2 * T - 1);
        assert_eq!(p.released(10 * MS + 17_857_143), 2 * T);
        assert_eq!(p.release_at(2 * T), 10 * MS + 17_857_143);
        assert_eq!(p.release_at(T), 10 * MS, "the part at once");
        assert_eq!(p.release_at(8 * T), 135 * MS, "the rest at the end");
        assert!(p.releasing(135 * MS - 1));
        assert!(!p.releasing(135 * MS));
        assert_eq!(p.released(135 * MS), u64::MAX);
    }

    #[test]
    fn no_pace_without_a_rest_or_a_time_and_none_overflows() {
        assert_eq!(Pace::new(T, T, 0, MS), None);
        assert_eq!(
            Pace::new(T, 2 * T, 0, MS),
            None,
            "at once is at most the total"
        );
        assert_eq!(Pace::new(8 * T, T, 0, 0), None);
        // A rate past u64 saturates; the end releases what it falls short of.
        let big = Pace::new(u64::MAX, 0, 0, 1).expect("paced");
        assert_eq!(
            (big.per_s, big.released(0), big.released(1)),
            (u64::MAX, 0, u64::MAX)
        );
        assert_eq!(big.release_at(u64::MAX), 1);
        // A start at the top of the clock: the end saturates there, nothing wraps.
        let late = Pace::new(8 * T, T, u64::MAX - 1, NANOS_PER_SEC).expect("paced");
        assert_eq!(late.end, u64::MAX);
        assert_eq!(late.released(u64::MAX - 1), T);
        assert_eq!(late.release_at(8 * T), u64::MAX);
    }
}
