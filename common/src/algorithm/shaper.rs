//! Leaky-bucket shaper, the queue form (design §10 "Algorithms"): accepted work leaves a bounded
//! queue at a constant rate. Instead of admitting or rejecting at once it answers *when* the work
//! may start; when the queue would overflow it rejects.
//!
//! Kept as a virtual schedule (the time the queue drains, in the same scaled units as GCRA), so a
//! caller sleeps for the returned delay rather than parking the work in memory here.

use super::Rate;
use crate::decision::RetryAfter;
use crate::units::{div_ceil_u128, sat_u64, Micros, Nanos};

/// Drains `rate`; holds at most `queue` microtokens of accepted work not yet drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaper {
    /// Drain rate.
    pub rate: Rate,
    /// Queue bound in microtokens (including the work being offered).
    pub queue: Micros,
}

/// Per-key state of a [`Shaper`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShaperState {
    /// When the queue drains, in ns × `rate.micros`.
    drained_at: u128,
    last: Nanos,
}

/// What the shaper answers for one piece of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shaped {
    /// Accepted: start it after this many nanoseconds (0 when the queue is empty).
    Delay(Nanos),
    /// The queue is full; `retry_after` is when this work would fit ([`RetryAfter::Never`] when
    /// it exceeds the whole queue). Nothing was queued.
    Rejected {
        /// When the same work would be accepted with no other arrivals.
        retry_after: RetryAfter,
    },
}

impl Shaper {
    /// An empty queue at `now`.
    pub fn initial_state(&self, now: Nanos) -> ShaperState {
        ShaperState {
            drained_at: now as u128 * self.rate.micros as u128,
            last: now,
        }
    }

    /// Offers `cost` microtokens of work at `now`; queues it unless the queue would overflow.
    pub fn offer(&self, s: &mut ShaperState, now: Nanos, cost: Micros) -> Shaped {
        s.last = s.last.max(now);
        let per = self.rate.per_ns as u128;
        let r = self.rate.micros as u128;
        let t = s.last as u128 * r;
        let start = s.drained_at.max(t);
        let backlog = start - t;
        let need = cost as u128 * per;
        let room = self.queue as u128 * per;
        if cost > self.queue {
            return Shaped::Rejected {
                retry_after: RetryAfter::Never,
            };
        }
        if backlog + need > room {
            let wait = div_ceil_u128(backlog + need - room, r);
            return Shaped::Rejected {
                retry_after: RetryAfter::After(sat_u64(wait)),
            };
        }
        s.drained_at = start + need;
        Shaped::Delay(sat_u64(div_ceil_u128(backlog, r)))
    }

    /// Microtokens of accepted work not yet drained at `now` (rounded up).
    pub fn queued(&self, s: &ShaperState, now: Nanos) -> Micros {
        let t = s.last.max(now) as u128 * self.rate.micros as u128;
        sat_u64(div_ceil_u128(
            s.drained_at.saturating_sub(t),
            self.rate.per_ns as u128,
        ))
    }
}
