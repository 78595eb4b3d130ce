//! Token bucket with lazy refill (design §10 "Algorithms"):
//! `T = min(B, T + r·(t − t_last))`, allow when `T ≥ c`.

use super::{Rate, RateAlgorithm};
use crate::decision::{Decision, RetryAfter};
use crate::units::{div_ceil_u128, div_u128, sat_u64, Micros, Nanos};

/// A token bucket of capacity B refilled at rate r.
///
/// The level is kept in units of `1 / rate.per_ns` microtokens, so a refill of `dt` nanoseconds
/// adds exactly `dt × rate.micros` units: no fraction of a microtoken is ever dropped, however
/// many small steps time advances in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// B in microtokens.
    pub capacity: Micros,
    /// r.
    pub rate: Rate,
}

/// Per-key state of a [`TokenBucket`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenBucketState {
    /// Tokens × `rate.per_ns`, in microtokens × ns-per-period (≤ capacity × per_ns).
    pub(crate) level: u128,
    /// Latest time this key has seen, in ns.
    pub(crate) last: Nanos,
}

impl TokenBucketState {
    /// Microtokens in the bucket as of the last decision, rounded down.
    pub fn micros(&self, rate: Rate) -> Micros {
        sat_u64(self.level / rate.per_ns as u128)
    }
}

impl TokenBucket {
    fn full(&self) -> u128 {
        self.capacity as u128 * self.rate.per_ns as u128
    }

    /// Refills for the time since `state.last`; returns the effective time.
    #[inline]
    fn refill(&self, state: &mut TokenBucketState, now: Nanos) -> Nanos {
        if now > state.last {
            let full = self.full();
            if state.level < full {
                let gained = (now - state.last) as u128 * self.rate.micros as u128;
                state.level = state.level.saturating_add(gained).min(full);
            }
            state.last = now;
        }
        state.last
    }

    /// Builds a state holding `micros` microtokens at `now` (clamped to capacity); used by policy
    /// transitions and by the allocator when it restores a bucket.
    pub fn state_with(&self, micros: Micros, now: Nanos) -> TokenBucketState {
        TokenBucketState {
            level: micros.min(self.capacity) as u128 * self.rate.per_ns as u128,
            last: now,
        }
    }

    /// Microtokens available at `now` without changing the state (rounded down).
    pub fn available(&self, state: &TokenBucketState, now: Nanos) -> Micros {
        let mut s = *state;
        self.refill(&mut s, now);
        s.micros(self.rate)
    }

    /// Adds `micros` back (a refund or a released allocation), never above capacity (design §10
    /// "Refunds").
    pub fn refund(&self, state: &mut TokenBucketState, now: Nanos, micros: Micros) {
        self.refill(state, now);
        let add = micros as u128 * self.rate.per_ns as u128;
        state.level = state.level.saturating_add(add).min(self.full());
    }
}

/// The decision for a bucket holding `level` units (microtokens × `rate.per_ns`) of `full`.
/// Shared by the token bucket and GCRA, which keep the same envelope in different state.
// Always inlined: returned through memory, its 40 bytes are stored in 8-byte parts and
// reloaded in 16-byte ones, a store-forwarding stall that cost more than the decision.
#[inline(always)]
pub(crate) fn bucket_decision(level: u128, capacity: Micros, rate: Rate, cost: Micros) -> Decision {
    let per = rate.per_ns as u128;
    let r = rate.micros as u128;
    let full = capacity as u128 * per;
    let need = cost as u128 * per;
    let until_full = |lvl: u128| sat_u64(div_ceil_u128(full.saturating_sub(lvl), r));
    if cost > capacity {
        return Decision {
            allowed: false,
            remaining_micros: sat_u64(div_u128(level, per)),
            reset_after: until_full(level),
            retry_after: RetryAfter::Never,
        };
    }
    if level >= need {
        let after = level - need;
        Decision {
            allowed: true,
            remaining_micros: sat_u64(div_u128(after, per)),
            reset_after: until_full(after),
            retry_after: RetryAfter::Now,
        }
    } else {
        Decision {
            allowed: false,
            remaining_micros: sat_u64(div_u128(level, per)),
            reset_after: until_full(level),
            retry_after: RetryAfter::After(sat_u64(div_ceil_u128(need - level, r))),
        }
    }
}

impl RateAlgorithm for TokenBucket {
    type State = TokenBucketState;

    fn initial_state(&self, now: Nanos) -> TokenBucketState {
        TokenBucketState {
            level: self.full(),
            last: now,
        }
    }

    #[inline]
    fn check(&self, state: &mut TokenBucketState, now: Nanos, cost: Micros) -> Decision {
        self.refill(state, now);
        bucket_decision(state.level, self.capacity, self.rate, cost)
    }

    #[inline]
    fn spend(&self, state: &mut TokenBucketState, now: Nanos, cost: Micros) {
        self.refill(state, now);
        state.level = state
            .level
            .saturating_sub(cost as u128 * self.rate.per_ns as u128);
    }

    /// `check` then `spend` with the refill done once (same result as the default).
    // Always inlined: see `bucket_decision`.
    #[inline(always)]
    fn decide(&self, state: &mut TokenBucketState, now: Nanos, cost: Micros) -> Decision {
        self.refill(state, now);
        let d = bucket_decision(state.level, self.capacity, self.rate, cost);
        if d.allowed {
            state.level = state
                .level
                .saturating_sub(cost as u128 * self.rate.per_ns as u128);
        }
        d
    }

    fn is_idle(&self, state: &TokenBucketState, now: Nanos) -> bool {
        let mut s = *state;
        self.refill(&mut s, now);
        s.level >= self.full()
    }

    fn capacity(&self) -> Micros {
        self.capacity
    }

    /// (level, last) when the level fits in 64 bits: always, for every state of a bucket whose
    /// `capacity × rate.per_ns` does (the level never exceeds it).
    #[inline]
    fn pack(&self, state: &TokenBucketState) -> Option<u128> {
        super::pack_words(state.level, state.last)
    }

    #[inline]
    fn unpack(&self, word: u128) -> Option<TokenBucketState> {
        let (level, last) = super::unpack_words(word);
        Some(TokenBucketState { level, last })
    }
}
