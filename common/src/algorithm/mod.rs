//! The five admission algorithms (design §10 "Algorithms") behind one trait, and the leaky-bucket
//! shaper (§9).
//!
//! Every algorithm is a pure state machine over fixed-point integers: `now` is passed in, tokens
//! are microtokens, products are formed in `u128` and never overflow for configurations within
//! [`MAX_TOKENS`](crate::units::MAX_TOKENS) and [`MAX_PERIOD_NS`](crate::units::MAX_PERIOD_NS).
//! An earlier `now` than the key has seen is treated as the latest time seen: it creates no
//! tokens and moves no window backwards.
//!
//! A decision is split into [`RateAlgorithm::check`] (may normalise the state for elapsed time,
//! never spends) and [`RateAlgorithm::spend`] so a multi-descriptor request can check every
//! descriptor before it spends on any (all-or-nothing).

mod fixed_window;
mod gcra;
mod params;
mod shaper;
mod sliding_log;
mod sliding_window;
mod state;
mod token_bucket;
#[cfg(test)]
mod word_props;

pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraState};
pub use params::{AlgorithmKind, LimitParams, ParamsError, Rate, WindowParams};
pub use shaper::{Shaped, Shaper, ShaperState};
pub use sliding_log::{SlidingLog, SlidingLogState};
pub use sliding_window::{SlidingWindow, SlidingWindowState};
pub use state::LimitState;
pub use token_bucket::{TokenBucket, TokenBucketState};

use crate::decision::Decision;
use crate::units::{Micros, Nanos};

/// One admission algorithm for one key.
///
/// Contract shared by every implementation:
/// * `check` at `now` answers whether `cost` microtokens fit; it may update the state for the time
///   elapsed (refill, window rotation, log expiry) but never spends.
/// * `spend` debits `cost`; it is called only right after a `check` at the same `now` that allowed
///   it, with the key's lock still held.
/// * A cost above [`capacity`](RateAlgorithm::capacity) is denied with
///   [`RetryAfter::Never`](crate::decision::RetryAfter::Never) and changes nothing.
/// * A cost of 0 is always allowed and spends nothing (a pure status query).
pub trait RateAlgorithm {
    /// Per-key state.
    type State;

    /// State of a key first seen at `now`: buckets start full, windows and logs start empty.
    fn initial_state(&self, now: Nanos) -> Self::State;

    /// Whether `cost` microtokens fit at `now`; see the trait docs.
    fn check(&self, state: &mut Self::State, now: Nanos, cost: Micros) -> Decision;

    /// Debits `cost` microtokens after an allowing `check` at the same `now`.
    fn spend(&self, state: &mut Self::State, now: Nanos, cost: Micros);

    /// True when the state at `now` is indistinguishable from [`initial_state`]: dropping it
    /// changes no future decision, so an idle key may be evicted.
    ///
    /// [`initial_state`]: RateAlgorithm::initial_state
    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool;

    /// Largest cost that can ever pass, in microtokens (B for buckets, L for windows and logs).
    fn capacity(&self) -> Micros;

    /// `check` then, when allowed, `spend`: one decision for a single-key request.
    #[inline]
    fn decide(&self, state: &mut Self::State, now: Nanos, cost: Micros) -> Decision {
        let d = self.check(state, now, cost);
        if d.allowed {
            self.spend(state, now, cost);
        }
        d
    }

    /// The state as one 128-bit word, so that a decision can replace it with one
    /// compare-and-swap instead of a lock ([`StateCell`](crate::cell::StateCell)); `None` when
    /// this algorithm or these numbers have no such form (the default; windows and logs), or
    /// the word would be [`SLOW`](crate::cell::SLOW). For a word `w` that this returns,
    /// [`unpack`](Self::unpack)`(w)` is a state that answers every later call exactly as
    /// `state` does.
    fn pack(&self, _state: &Self::State) -> Option<u128> {
        None
    }

    /// The state of a word [`pack`](Self::pack) returned; `None` when this algorithm has no
    /// packed form (never for a word it packed).
    fn unpack(&self, _word: u128) -> Option<Self::State> {
        None
    }

    /// [`decide`](Self::decide) on a packed word: `Some((decision, new word))`, the same as
    /// [`unpack`](Self::unpack), `decide` and [`pack`](Self::pack) give (the default does
    /// exactly that), `None` when either of those does (nothing decided: the caller locks
    /// the state instead).
    #[inline]
    fn decide_word(&self, word: u128, now: Nanos, cost: Micros) -> Option<(Decision, u128)> {
        decide_word_via_state(self, word, now, cost)
    }
}

/// [`RateAlgorithm::decide_word`] through the state: unpack, decide, pack.
#[inline]
pub(crate) fn decide_word_via_state<A: RateAlgorithm + ?Sized>(
    alg: &A,
    word: u128,
    now: Nanos,
    cost: Micros,
) -> Option<(Decision, u128)> {
    let mut s = alg.unpack(word)?;
    let d = alg.decide(&mut s, now, cost);
    Some((d, alg.pack(&s)?))
}

/// A packed bucket word: the low 64 bits are a level (or debt) in the algorithm's units, the
/// high 64 bits the latest time the key has seen, ns; `None` when the level does not fit or
/// the word would be the reserved [`SLOW`](crate::cell::SLOW) value.
#[inline]
pub(crate) fn pack_words(level: u128, last: Nanos) -> Option<u128> {
    let low = u64::try_from(level).ok()?;
    let w = u128::from(low) | (u128::from(last) << 64);
    (w != crate::cell::SLOW).then_some(w)
}

/// The (level, last) halves of a word of [`pack_words`].
#[inline]
pub(crate) fn unpack_words(word: u128) -> (u128, Nanos) {
    (u128::from(word as u64), (word >> 64) as u64)
}
