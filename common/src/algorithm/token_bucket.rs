//! Token bucket with lazy refill (design §10 "Algorithms"):
//! `T = min(B, T + r·(t − t_last))`, allow when `T ≥ c`.

use super::{Rate, RateAlgorithm};
use crate::decision::{Decision, RetryAfter};
use crate::units::{div_ceil_u128, div_u128, sat_u64, Micros, Nanos};

/// `x / d` rounded down; `d` must be > 0. No division when `d` is 1: a rate in lowest terms
/// often has `per_ns` or `micros` equal to 1 (10⁹/s is 10⁶ µ per 1 ns, 1/s is 1 µ per 1000 ns).
#[inline(always)]
fn div_u64(x: u64, d: u64) -> u64 {
    if d == 1 {
        x
    } else {
        x / d
    }
}

/// `x / d` rounded up; `d` must be > 0. No division when `d` is 1 (see [`div_u64`]).
#[inline(always)]
fn div_ceil_u64(x: u64, d: u64) -> u64 {
    if d == 1 {
        x
    } else {
        x.div_ceil(d)
    }
}

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

/// [`bucket_decision`] with the refill before it, on a bucket's packed numbers: `debt` units
/// (microtokens × `rate.per_ns`) below `full` (= capacity × `rate.per_ns`) as of `last`, which
/// must be ≤ `full`. Returns the decision and the new (debt, last).
///
/// The same answers as the state form (refill to `min(full, level + dt × micros)`, then spend
/// when allowed) in 64-bit arithmetic: a debt only shrinks by the refill and grows by at most
/// `full − debt`, so it stays within `full`.
///
/// The compare-and-swap that stores the result waits for every step from the clock read to
/// the new word, and that wait adds to each decision (the clock read does not overlap it), so
/// the time enters through as few steps as can be: a bucket refilled to the top, as a key
/// under its limit is, is decided apart with a debt of 0, and its new word then waits for the
/// time alone, not for the refill's multiply and compare.
#[inline(always)]
pub(crate) fn bucket_decide_debt(
    debt: u64,
    last: Nanos,
    full: u64,
    capacity: Micros,
    rate: Rate,
    now: Nanos,
    cost: Micros,
) -> (Decision, u64, Nanos) {
    debug_assert!(debt <= full);
    if now > last {
        let gained = u128::from(now - last) * u128::from(rate.micros);
        if gained >= u128::from(debt) {
            return debt_decision(0, now, full, capacity, rate, cost);
        }
        // gained < debt ≤ u64::MAX: it fits.
        return debt_decision(debt - gained as u64, now, full, capacity, rate, cost);
    }
    debt_decision(debt, last, full, capacity, rate, cost)
}

/// The decision for a bucket `debt` (≤ `full`) units below full at `last`, and its new (debt,
/// last): [`bucket_decision`] in the debt's terms.
#[inline(always)]
fn debt_decision(
    debt: u64,
    last: Nanos,
    full: u64,
    capacity: Micros,
    rate: Rate,
    cost: Micros,
) -> (Decision, u64, Nanos) {
    let (per, r) = (rate.per_ns, rate.micros);
    let level = full - debt;
    if cost > capacity {
        let d = Decision {
            allowed: false,
            remaining_micros: div_u64(level, per),
            reset_after: div_ceil_u64(debt, r),
            retry_after: RetryAfter::Never,
        };
        return (d, debt, last);
    }
    // cost ≤ capacity, so need ≤ full: no overflow.
    let need = cost * per;
    let room = full - need;
    if debt <= room {
        let after = debt + need;
        let d = Decision {
            allowed: true,
            remaining_micros: div_u64(full - after, per),
            reset_after: div_ceil_u64(after, r),
            retry_after: RetryAfter::Now,
        };
        (d, after, last)
    } else {
        let d = Decision {
            allowed: false,
            remaining_micros: div_u64(level, per),
            reset_after: div_ceil_u64(debt, r),
            retry_after: RetryAfter::After(div_ceil_u64(debt - room, r)),
        };
        (d, debt, last)
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

    /// On the word's numbers directly ([`bucket_decide_debt`], the debt being full − level)
    /// when the full level fits in 64 bits and the word's level is within it; else through
    /// the state.
    #[inline(always)]
    fn decide_word(&self, word: u128, now: Nanos, cost: Micros) -> Option<(Decision, u128)> {
        let (level, last) = (word as u64, (word >> 64) as u64);
        match self.capacity.checked_mul(self.rate.per_ns) {
            Some(full) if level <= full => {
                let (d, debt, last) = bucket_decide_debt(
                    full - level,
                    last,
                    full,
                    self.capacity,
                    self.rate,
                    now,
                    cost,
                );
                Some((d, super::pack_words(u128::from(full - debt), last)?))
            }
            _ => super::decide_word_via_state(self, word, now, cost),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decide_word_via_state, Gcra};
    use super::*;

    #[test]
    fn division_fast_paths_are_exact_at_the_extremes() {
        for x in [0, 1, 2, 999, u64::MAX - 1, u64::MAX] {
            for d in [1, 2, 3, 1_000, u64::MAX - 1, u64::MAX] {
                assert_eq!(div_u64(x, d), x / d, "{x} / {d}");
                assert_eq!(div_ceil_u64(x, d), x.div_ceil(d), "{x} / {d} up");
            }
        }
    }

    /// Words around every boundary of a bucket of `full` units: empty, one unit, full, just
    /// above full (not a state the bucket makes: decided through the state), the top of u64.
    fn lows(full: u64) -> Vec<u64> {
        let mut v = vec![
            0,
            1,
            full / 2,
            full.saturating_sub(1),
            full,
            full.saturating_add(1),
        ];
        v.extend([u64::MAX - 1, u64::MAX]);
        v
    }

    const TIMES: [u64; 7] = [0, 1, 2, 1_000, 1 << 62, u64::MAX - 1, u64::MAX];

    /// Every combination of the extremes: the word path gives what unpack, decide and pack give.
    fn word_path_matches_state_path<A: RateAlgorithm>(alg: &A, full: Option<u64>, costs: &[u64]) {
        let lows = lows(full.unwrap_or(u64::MAX));
        for &low in &lows {
            for last in TIMES {
                let word = u128::from(low) | (u128::from(last) << 64);
                for now in TIMES
                    .into_iter()
                    .chain([last.saturating_add(1), last.saturating_sub(1)])
                {
                    for &cost in costs {
                        assert_eq!(
                            alg.decide_word(word, now, cost),
                            decide_word_via_state(alg, word, now, cost),
                            "low {low} last {last} now {now} cost {cost}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_word_path_decides_as_the_state_at_the_extremes() {
        // (capacity, micros, per_ns): whole tokens at 10⁹/s (per 1), 1/s (micros 1), odd
        // terms, a full level of exactly u64::MAX, one beyond 64 bits (always through the
        // state), the largest rates.
        let cases: [(u64, u64, u64); 9] = [
            (4_000_000_000_000_000, 1_000_000, 1),
            (1_000_000, 1, 1_000),
            (7_000_000, 3, 7),
            (u64::MAX, 1, 1),
            (u64::MAX / 3, 5, 3),
            (u64::MAX, 2, 2),
            (1, u64::MAX / 2, 1),
            (1, 1, u64::MAX),
            (0, 1, 1),
        ];
        for (capacity, micros, per_ns) in cases {
            let rate = Rate { micros, per_ns };
            let full = capacity.checked_mul(per_ns);
            let mut costs = vec![0, 1, capacity / 2, capacity, capacity.saturating_add(1)];
            costs.extend([capacity.saturating_sub(1), u64::MAX]);
            word_path_matches_state_path(&TokenBucket { capacity, rate }, full, &costs);
            word_path_matches_state_path(&Gcra { capacity, rate }, full, &costs);
        }
    }

    #[test]
    fn a_refilled_bucket_and_a_bucket_in_debt_decide_as_the_state_does() {
        // 1 token per 10 ns, burst 3 (per_ns 10 after reduction: micros 1).
        let tb = TokenBucket {
            capacity: 3_000_000,
            rate: Rate::new(1_000_000, 10).unwrap(),
        };
        let full = 3_000_000 * tb.rate.per_ns;
        let mut word = u128::from(full) | (100u128 << 64);
        let mut s = tb.unpack(word).unwrap();
        // Spend the burst at once, then one every 5 ns (half the rate): it runs dry, denies,
        // refills partly and to the top.
        for (i, now) in (0..20u64).map(|i| (i, 100 + i.saturating_sub(3) * 5)) {
            let (d, w) = tb.decide_word(word, now, 1_000_000).unwrap();
            assert_eq!(d, tb.decide(&mut s, now, 1_000_000), "step {i}");
            assert_eq!(w, tb.pack(&s).unwrap(), "step {i}");
            word = w;
        }
        let (d, _) = tb.decide_word(word, 10_000, 1_000_000).unwrap();
        assert!(d.allowed);
        assert_eq!(d.remaining_micros, 2_000_000);
    }
}
