//! What one algorithm answers for one key (design §10 "Algorithms" and "Rejections").

use crate::units::{micros_to_tokens_floor, Micros, Nanos};

/// When a denied request could pass if no other traffic arrived.
///
/// "Not yet" ([`RetryAfter::After`]) is distinct from "never" ([`RetryAfter::Never`]): a cost
/// above the limit's capacity can never pass, and such a request changes no state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryAfter {
    /// The request passes now (every allowed decision).
    Now,
    /// The request would pass after this many nanoseconds.
    After(Nanos),
    /// The request can never pass under this limit (cost above capacity).
    Never,
}

impl RetryAfter {
    /// The later of two waits; `Never` dominates.
    pub fn max(self, other: RetryAfter) -> RetryAfter {
        match (self, other) {
            (RetryAfter::Never, _) | (_, RetryAfter::Never) => RetryAfter::Never,
            (RetryAfter::Now, x) | (x, RetryAfter::Now) => x,
            (RetryAfter::After(a), RetryAfter::After(b)) => RetryAfter::After(a.max(b)),
        }
    }

    /// The earlier of two waits; `Never` only when both are.
    pub fn min(self, other: RetryAfter) -> RetryAfter {
        match (self, other) {
            (RetryAfter::Never, x) | (x, RetryAfter::Never) => x,
            (RetryAfter::Now, _) | (_, RetryAfter::Now) => RetryAfter::Now,
            (RetryAfter::After(a), RetryAfter::After(b)) => RetryAfter::After(a.min(b)),
        }
    }

    /// The wait in nanoseconds, `None` for never, `Some(0)` for now.
    pub fn as_nanos(self) -> Option<Nanos> {
        match self {
            RetryAfter::Now => Some(0),
            RetryAfter::After(n) => Some(n),
            RetryAfter::Never => None,
        }
    }
}

/// One algorithm's answer for one key at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the cost fits within the limit now.
    pub allowed: bool,
    /// Microtokens left after this decision (after spending, when allowed and spent).
    pub remaining_micros: Micros,
    /// Nanoseconds until the limit is fully reset: a bucket full again, a window over, a log empty.
    pub reset_after: Nanos,
    /// When a denied request could pass; [`RetryAfter::Now`] when allowed.
    pub retry_after: RetryAfter,
}

impl Decision {
    /// Whole tokens left, rounded down (Envoy's `limit_remaining`).
    pub fn remaining_tokens(&self) -> u64 {
        micros_to_tokens_floor(self.remaining_micros)
    }
}
