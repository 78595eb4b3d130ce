//! Exact sliding log (design §10 "Algorithms"): an admitted event at time `e` counts while
//! `e > now − P`.
//!
//! Memory per key is O(events in the window); events at the same nanosecond are merged, so with
//! whole-token costs a key holds at most L entries. The config layer caps L for this algorithm.
//! Growing the log allocates: the one algorithm whose hot path may allocate.

use super::{RateAlgorithm, WindowParams};
use crate::decision::{Decision, RetryAfter};
use crate::units::{Micros, Nanos};
use std::collections::VecDeque;

/// At most `limit` microtokens in any trailing window `(now − P, now]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingLog(pub WindowParams);

/// Per-key state of [`SlidingLog`]: admitted (time, cost) events, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlidingLogState {
    pub(crate) events: VecDeque<(Nanos, Micros)>,
    /// Sum of the costs in `events`.
    pub(crate) sum: u128,
    /// Latest time this key has seen, in ns.
    pub(crate) last: Nanos,
}

impl SlidingLogState {
    /// Number of stored events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no event is stored.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

impl SlidingLog {
    /// Nanoseconds from `t` until an event at `e ≤ t` still in the window leaves it.
    #[inline]
    fn left_in(&self, e: Nanos, t: Nanos) -> Nanos {
        self.0.period_ns - (t - e)
    }

    fn advance(&self, s: &mut SlidingLogState, now: Nanos) -> Nanos {
        s.last = s.last.max(now);
        let t = s.last;
        while let Some(&(e, c)) = s.events.front() {
            // Elapsed since the event, so `e + P` beyond u64 still compares exactly.
            if t - e < self.0.period_ns {
                break;
            }
            s.events.pop_front();
            s.sum -= c as u128;
        }
        t
    }
}

impl RateAlgorithm for SlidingLog {
    type State = SlidingLogState;

    fn initial_state(&self, now: Nanos) -> SlidingLogState {
        SlidingLogState {
            events: VecDeque::new(),
            sum: 0,
            last: now,
        }
    }

    fn check(&self, s: &mut SlidingLogState, now: Nanos, cost: Micros) -> Decision {
        let t = self.advance(s, now);
        let limit = self.0.limit as u128;
        let reset_after = s.events.back().map_or(0, |&(e, _)| self.left_in(e, t));
        let left = |sum: u128| u64::try_from(limit.saturating_sub(sum)).unwrap_or(u64::MAX);
        if cost as u128 > limit {
            return Decision {
                allowed: false,
                remaining_micros: left(s.sum),
                reset_after,
                retry_after: RetryAfter::Never,
            };
        }
        // A cost of 0 is a status query: always allowed, even above a lowered limit (§28).
        if cost == 0 || s.sum + cost as u128 <= limit {
            return Decision {
                allowed: true,
                remaining_micros: left(s.sum + cost as u128),
                reset_after: if cost > 0 {
                    self.0.period_ns
                } else {
                    reset_after
                },
                retry_after: RetryAfter::Now,
            };
        }
        // The oldest events leave first; find the one whose departure makes room.
        let mut freed = 0u128;
        let mut wait = reset_after;
        for &(e, c) in &s.events {
            freed += c as u128;
            if s.sum - freed + cost as u128 <= limit {
                wait = self.left_in(e, t);
                break;
            }
        }
        Decision {
            allowed: false,
            remaining_micros: left(s.sum),
            reset_after,
            retry_after: RetryAfter::After(wait),
        }
    }

    fn spend(&self, s: &mut SlidingLogState, now: Nanos, cost: Micros) {
        let t = self.advance(s, now);
        if cost == 0 {
            return;
        }
        match s.events.back_mut() {
            Some((e, c)) if *e == t => *c = c.saturating_add(cost),
            _ => s.events.push_back((t, cost)),
        }
        s.sum += cost as u128;
    }

    fn is_idle(&self, s: &SlidingLogState, now: Nanos) -> bool {
        let t = s.last.max(now);
        s.events.iter().all(|&(e, _)| t - e >= self.0.period_ns)
    }

    fn capacity(&self) -> Micros {
        self.0.limit
    }
}
