//! One key, no lookup: an algorithm and its state in a [`StateCell`], for a Rust caller that
//! owns a single limit (and for benchmarks against other single-key limiters).

use crate::algorithm::RateAlgorithm;
use crate::cell::{Packs, StateCell, WordHint};
use crate::clock::Clock;
use crate::decision::Decision;
use crate::units::Micros;

/// A single-key limiter: `decide` is check-and-spend in one compare-and-swap of the packed
/// state when the algorithm's numbers pack ([`RateAlgorithm::pack`]: a token bucket or GCRA
/// whose `capacity × rate.per_ns` fits in 64 bits, as for a rate in lowest terms from
/// [`Rate::new`](crate::algorithm::Rate::new)), else under a mutex; concurrent callers never
/// spend the same token either way.
pub struct DirectLimiter<A: RateAlgorithm, C: Clock> {
    alg: A,
    clock: C,
    cell: StateCell<A::State, WordHint>,
}

impl<A: RateAlgorithm + std::fmt::Debug, C: Clock> std::fmt::Debug for DirectLimiter<A, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectLimiter")
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// A state packs with its algorithm.
impl<A: RateAlgorithm> Packs<A> for A::State {
    #[inline]
    fn pack(&self, alg: &A) -> Option<u128> {
        alg.pack(self)
    }

    #[inline]
    fn unpack(&mut self, alg: &A, word: u128) {
        if let Some(s) = alg.unpack(word) {
            *self = s;
        }
    }
}

impl<A: RateAlgorithm, C: Clock> DirectLimiter<A, C> {
    /// A limiter whose state starts fresh at the clock's now.
    pub fn new(alg: A, clock: C) -> Self {
        let cell = StateCell::new(alg.initial_state(clock.now()), &alg);
        DirectLimiter { alg, clock, cell }
    }

    /// Decides `cost` microtokens at the clock's now, spending when allowed.
    #[inline]
    pub fn decide(&self, cost: Micros) -> Decision {
        let now = self.clock.now();
        let alg = &self.alg;
        let packed = self.cell.update(|w| alg.decide_word(w, now, cost));
        if let Some(d) = packed {
            return d;
        }
        let mut g = self.cell.lock(alg);
        alg.decide(&mut g, now, cost)
    }

    /// The algorithm.
    pub fn algorithm(&self) -> &A {
        &self.alg
    }
}
