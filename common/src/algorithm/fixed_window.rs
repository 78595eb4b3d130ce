//! Fixed window (design §10 "Algorithms"): one counter per window aligned to the clock origin.
//!
//! Admits at most L per aligned window; a short interval across a boundary may see up to 2L
//! (the known boundary burst).

use super::{RateAlgorithm, WindowParams};
use crate::decision::{Decision, RetryAfter};
use crate::units::{Micros, Nanos};

/// At most `limit` microtokens per aligned window of `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow(pub WindowParams);

/// Per-key state of [`FixedWindow`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FixedWindowState {
    /// Start of the window `used` belongs to, in ns (a multiple of the period).
    pub(crate) start: Nanos,
    /// Microtokens admitted in that window.
    pub(crate) used: Micros,
    /// Latest time this key has seen, in ns.
    pub(crate) last: Nanos,
}

impl FixedWindowState {
    /// Microtokens admitted in the current window as of the last decision.
    pub fn used(&self) -> Micros {
        self.used
    }
}

impl FixedWindow {
    #[inline]
    fn align(&self, t: Nanos) -> Nanos {
        t - t % self.0.period_ns
    }

    #[inline]
    fn advance(&self, state: &mut FixedWindowState, now: Nanos) -> Nanos {
        state.last = state.last.max(now);
        let t = state.last;
        // Compared as an elapsed time: `start + period` may not fit in u64 near the end of time.
        if t - state.start >= self.0.period_ns {
            state.start = self.align(t);
            state.used = 0;
        }
        t
    }

    /// Builds a state in which `used` microtokens are spent in the window containing `now`.
    pub fn state_with(&self, used: Micros, now: Nanos) -> FixedWindowState {
        FixedWindowState {
            start: self.align(now),
            used,
            last: now,
        }
    }
}

impl RateAlgorithm for FixedWindow {
    type State = FixedWindowState;

    fn initial_state(&self, now: Nanos) -> FixedWindowState {
        self.state_with(0, now)
    }

    #[inline]
    fn check(&self, state: &mut FixedWindowState, now: Nanos, cost: Micros) -> Decision {
        let t = self.advance(state, now);
        let limit = self.0.limit;
        let reset_after = self.0.period_ns - (t - state.start);
        let left = limit.saturating_sub(state.used);
        if cost > limit {
            return Decision {
                allowed: false,
                remaining_micros: left,
                reset_after,
                retry_after: RetryAfter::Never,
            };
        }
        if cost <= left {
            Decision {
                allowed: true,
                remaining_micros: left - cost,
                reset_after,
                retry_after: RetryAfter::Now,
            }
        } else {
            // The next window starts empty and cost ≤ L, so it passes then.
            Decision {
                allowed: false,
                remaining_micros: left,
                reset_after,
                retry_after: RetryAfter::After(reset_after),
            }
        }
    }

    #[inline]
    fn spend(&self, state: &mut FixedWindowState, now: Nanos, cost: Micros) {
        self.advance(state, now);
        state.used = state.used.saturating_add(cost);
    }

    fn is_idle(&self, state: &FixedWindowState, now: Nanos) -> bool {
        state.used == 0 || state.last.max(now) - state.start >= self.0.period_ns
    }

    fn capacity(&self) -> Micros {
        self.0.limit
    }
}
