//! GCRA (design §10 "Algorithms"): one theoretical arrival time (TAT) per key.
//!
//! Emission interval I = 1/r, burst tolerance τ = (B − 1)·I. A request of cost c at time t
//! conforms when `max(TAT, t) + c·I − t ≤ B·I` (for c = 1 this is the usual `t ≥ TAT − τ`), and
//! then `TAT = max(TAT, t) + c·I`. It admits exactly what a token bucket of capacity B admits.

use super::token_bucket::{bucket_decide_debt, bucket_decision};
use super::{Rate, RateAlgorithm};
use crate::decision::Decision;
use crate::units::{Micros, Nanos};

/// GCRA with rate r and burst B.
///
/// Time is scaled by `rate.micros` (one scaled unit is `1 / rate.micros` ns), so the emission
/// interval of one microtoken is exactly `rate.per_ns` units: no rounding, for any rational rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// B in microtokens.
    pub capacity: Micros,
    /// r.
    pub rate: Rate,
}

/// Per-key state of [`Gcra`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GcraState {
    /// Theoretical arrival time in scaled units (ns × `rate.micros`).
    pub(crate) tat: u128,
    /// Latest time this key has seen, in ns.
    pub(crate) last: Nanos,
}

impl Gcra {
    #[inline]
    fn scaled(&self, t: Nanos) -> u128 {
        t as u128 * self.rate.micros as u128
    }

    /// Level in the token bucket's units (microtokens × `per_ns`) at the effective time.
    #[inline]
    fn level(&self, state: &mut GcraState, now: Nanos) -> (u128, u128) {
        state.last = state.last.max(now);
        let t = self.scaled(state.last);
        let debt = state.tat.saturating_sub(t);
        let full = self.capacity as u128 * self.rate.per_ns as u128;
        (full.saturating_sub(debt), t)
    }

    /// Builds a state holding `micros` microtokens at `now` (clamped to capacity).
    pub fn state_with(&self, micros: Micros, now: Nanos) -> GcraState {
        let per = self.rate.per_ns as u128;
        let debt = (self.capacity - micros.min(self.capacity)) as u128 * per;
        GcraState {
            tat: self.scaled(now) + debt,
            last: now,
        }
    }
}

impl RateAlgorithm for Gcra {
    type State = GcraState;

    fn initial_state(&self, now: Nanos) -> GcraState {
        GcraState {
            tat: self.scaled(now),
            last: now,
        }
    }

    #[inline]
    fn check(&self, state: &mut GcraState, now: Nanos, cost: Micros) -> Decision {
        let (level, _) = self.level(state, now);
        bucket_decision(level, self.capacity, self.rate, cost)
    }

    #[inline]
    fn spend(&self, state: &mut GcraState, now: Nanos, cost: Micros) {
        let (_, t) = self.level(state, now);
        state.tat = state.tat.max(t) + cost as u128 * self.rate.per_ns as u128;
    }

    /// `check` then `spend` with the level computed once (same result as the default).
    // Always inlined: see `bucket_decision`.
    #[inline(always)]
    fn decide(&self, state: &mut GcraState, now: Nanos, cost: Micros) -> Decision {
        let (level, t) = self.level(state, now);
        let d = bucket_decision(level, self.capacity, self.rate, cost);
        if d.allowed {
            state.tat = state.tat.max(t) + cost as u128 * self.rate.per_ns as u128;
        }
        d
    }

    fn is_idle(&self, state: &GcraState, now: Nanos) -> bool {
        state.tat <= self.scaled(state.last.max(now))
    }

    fn capacity(&self) -> Micros {
        self.capacity
    }

    /// (debt, last), the debt being how far the TAT is ahead of `last` in scaled units (0 when
    /// it is behind): every method reads the TAT only against a time at or after `last`, where
    /// a TAT behind `last` means a full bucket however far behind, so the debt answers exactly
    /// as the TAT does. It fits in 64 bits whenever `capacity × rate.per_ns` does (the debt
    /// never exceeds it).
    #[inline]
    fn pack(&self, state: &GcraState) -> Option<u128> {
        let debt = state.tat.saturating_sub(self.scaled(state.last));
        super::pack_words(debt, state.last)
    }

    #[inline]
    fn unpack(&self, word: u128) -> Option<GcraState> {
        let (debt, last) = super::unpack_words(word);
        Some(GcraState {
            tat: self.scaled(last) + debt,
            last,
        })
    }

    /// On the word's (debt, last) directly ([`bucket_decide_debt`]: the TAT ahead of a later
    /// time is the debt less the time's scaled advance, saturating at 0) when
    /// `capacity × rate.per_ns` fits in 64 bits and the debt is within it; else through the
    /// state.
    #[inline(always)]
    fn decide_word(&self, word: u128, now: Nanos, cost: Micros) -> Option<(Decision, u128)> {
        let (debt, last) = (word as u64, (word >> 64) as u64);
        match self.capacity.checked_mul(self.rate.per_ns) {
            Some(full) if debt <= full => {
                let (d, debt, last) =
                    bucket_decide_debt(debt, last, full, self.capacity, self.rate, now, cost);
                Some((d, super::pack_words(u128::from(debt), last)?))
            }
            _ => super::decide_word_via_state(self, word, now, cost),
        }
    }
}
