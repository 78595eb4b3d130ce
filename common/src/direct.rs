//! One key, no lookup: an algorithm and its state behind a mutex, for a Rust caller that owns a
//! single limit (and for benchmarks against other single-key limiters).

use crate::algorithm::RateAlgorithm;
use crate::clock::Clock;
use crate::decision::Decision;
use crate::units::Micros;
use parking_lot::Mutex;

/// A single-key limiter: `decide` is check-and-spend under one uncontended-in-the-common-case
/// mutex, so concurrent callers never spend the same token.
#[derive(Debug)]
pub struct DirectLimiter<A: RateAlgorithm, C: Clock> {
    alg: A,
    clock: C,
    state: Mutex<A::State>,
}

impl<A: RateAlgorithm, C: Clock> DirectLimiter<A, C> {
    /// A limiter whose state starts fresh at the clock's now.
    pub fn new(alg: A, clock: C) -> Self {
        let state = Mutex::new(alg.initial_state(clock.now()));
        DirectLimiter { alg, clock, state }
    }

    /// Decides `cost` microtokens at the clock's now, spending when allowed.
    #[inline]
    pub fn decide(&self, cost: Micros) -> Decision {
        let now = self.clock.now();
        self.alg.decide(&mut self.state.lock(), now, cost)
    }

    /// The algorithm.
    pub fn algorithm(&self) -> &A {
        &self.alg
    }
}
