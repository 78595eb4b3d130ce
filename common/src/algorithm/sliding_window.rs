//! Sliding-window counter with two buckets (design §10 "Algorithms"):
//! `estimate = current + previous × (1 − p)`, p the elapsed fraction of the current window.
//!
//! Computed exactly in integers scaled by the period: `estimate × P = cur × P + prev × (P − e)`.

use super::{RateAlgorithm, WindowParams};
use crate::decision::{Decision, RetryAfter};
use crate::units::{sat_u64, Micros, Nanos};

/// At most `limit` microtokens in the estimated trailing window of `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow(pub WindowParams);

/// Per-key state of [`SlidingWindow`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlidingWindowState {
    /// Start of the current aligned window, in ns.
    pub(crate) start: Nanos,
    /// Microtokens admitted in the current window.
    pub(crate) cur: Micros,
    /// Microtokens admitted in the previous window.
    pub(crate) prev: Micros,
    /// Latest time this key has seen, in ns.
    pub(crate) last: Nanos,
}

impl SlidingWindow {
    #[inline]
    fn advance(&self, s: &mut SlidingWindowState, now: Nanos) -> Nanos {
        let p = self.0.period_ns;
        s.last = s.last.max(now);
        let t = s.last;
        // Compared as elapsed time: `start + 2P` may not fit in u64 near the end of time.
        let e = t - s.start;
        if e >= p.saturating_mul(2) {
            s.prev = 0;
            s.cur = 0;
            s.start = t - t % p;
        } else if e >= p {
            s.prev = s.cur;
            s.cur = 0;
            s.start += p;
        }
        t
    }

    /// `estimate × P` at elapsed `e` into the current window.
    #[inline]
    fn estimate_scaled(&self, s: &SlidingWindowState, e: Nanos) -> u128 {
        let p = self.0.period_ns as u128;
        s.cur as u128 * p + s.prev as u128 * (p - e as u128)
    }

    /// Smallest elapsed time `e'` (ns into a window) at which `w × (P − e') ≤ room × P`.
    fn first_fit(&self, weight: Micros, room: u128) -> Option<Nanos> {
        let p = self.0.period_ns as u128;
        if weight == 0 {
            return Some(0);
        }
        let slack = room * p / weight as u128;
        if slack >= p {
            Some(0)
        } else {
            Some(sat_u64(p - slack))
        }
    }

    /// Builds a state with `cur` and `prev` microtokens in the windows around `now`.
    pub fn state_with(&self, cur: Micros, prev: Micros, now: Nanos) -> SlidingWindowState {
        let p = self.0.period_ns;
        SlidingWindowState {
            start: now - now % p,
            cur,
            prev,
            last: now,
        }
    }
}

impl RateAlgorithm for SlidingWindow {
    type State = SlidingWindowState;

    fn initial_state(&self, now: Nanos) -> SlidingWindowState {
        self.state_with(0, 0, now)
    }

    fn check(&self, s: &mut SlidingWindowState, now: Nanos, cost: Micros) -> Decision {
        let t = self.advance(s, now);
        let p = self.0.period_ns;
        let p128 = p as u128;
        let limit = self.0.limit;
        let e = t - s.start;
        let est = self.estimate_scaled(s, e);
        let lim = limit as u128 * p128;
        let need = cost as u128 * p128;
        // Until the current window ends (exact, even where its end does not fit in u64).
        let to_end = p - e;
        // Once something is counted in the current window, it fades out one period after it.
        let reset_cur = to_end.saturating_add(p);
        let reset_after = if s.cur > 0 {
            reset_cur
        } else if s.prev > 0 {
            to_end
        } else {
            0
        };
        let remaining = |used: u128| sat_u64(lim.saturating_sub(used) / p128);
        if cost > limit {
            return Decision {
                allowed: false,
                remaining_micros: remaining(est),
                reset_after,
                retry_after: RetryAfter::Never,
            };
        }
        // A cost of 0 is a status query: always allowed, even above a lowered limit (§28).
        if cost == 0 || est + need <= lim {
            return Decision {
                allowed: true,
                remaining_micros: remaining(est + need),
                reset_after: if cost > 0 { reset_cur } else { reset_after },
                retry_after: RetryAfter::Now,
            };
        }
        // Later in this window the previous count fades; failing that, the next window starts
        // with this window's count fading from full weight.
        let in_this = if s.cur + cost <= limit {
            self.first_fit(s.prev, (limit - s.cur - cost) as u128)
                .filter(|&e2| e2 < p)
        } else {
            None
        };
        let wait = match in_this {
            Some(e2) => e2 - e,
            None => {
                let e3 = self.first_fit(s.cur, (limit - cost) as u128).unwrap_or(0);
                to_end.saturating_add(e3)
            }
        };
        Decision {
            allowed: false,
            remaining_micros: remaining(est),
            reset_after,
            retry_after: RetryAfter::After(wait),
        }
    }

    fn spend(&self, s: &mut SlidingWindowState, now: Nanos, cost: Micros) {
        self.advance(s, now);
        s.cur = s.cur.saturating_add(cost);
    }

    fn is_idle(&self, s: &SlidingWindowState, now: Nanos) -> bool {
        let mut c = *s;
        self.advance(&mut c, now);
        c.cur == 0 && c.prev == 0
    }

    fn capacity(&self) -> Micros {
        self.0.limit
    }
}
