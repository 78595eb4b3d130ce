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
    fn decide(&self, state: &mut Self::State, now: Nanos, cost: Micros) -> Decision {
        let d = self.check(state, now, cost);
        if d.allowed {
            self.spend(state, now, cost);
        }
        d
    }
}
