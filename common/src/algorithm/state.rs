//! Runtime dispatch over the five algorithms, and policy-change transitions (design §10 "Config
//! versions").

use super::{
    AlgorithmKind, FixedWindow, FixedWindowState, Gcra, GcraState, LimitParams, RateAlgorithm,
    SlidingLog, SlidingLogState, SlidingWindow, SlidingWindowState, TokenBucket, TokenBucketState,
};
use crate::decision::Decision;
use crate::units::{Micros, Nanos};

/// The state of one key under whichever algorithm its limit uses.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LimitState {
    /// See [`TokenBucket`].
    TokenBucket(TokenBucketState),
    /// See [`Gcra`].
    Gcra(GcraState),
    /// See [`FixedWindow`].
    FixedWindow(FixedWindowState),
    /// See [`SlidingWindow`].
    SlidingWindow(SlidingWindowState),
    /// See [`SlidingLog`].
    SlidingLog(SlidingLogState),
}

impl LimitState {
    /// The algorithm this state belongs to.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            LimitState::TokenBucket(_) => AlgorithmKind::TokenBucket,
            LimitState::Gcra(_) => AlgorithmKind::Gcra,
            LimitState::FixedWindow(_) => AlgorithmKind::FixedWindow,
            LimitState::SlidingWindow(_) => AlgorithmKind::SlidingWindow,
            LimitState::SlidingLog(_) => AlgorithmKind::SlidingLog,
        }
    }

    /// Latest time the key has seen, in ns.
    pub fn last(&self) -> Nanos {
        match self {
            LimitState::TokenBucket(s) => s.last,
            LimitState::Gcra(s) => s.last,
            LimitState::FixedWindow(s) => s.last,
            LimitState::SlidingWindow(s) => s.last,
            LimitState::SlidingLog(s) => s.last,
        }
    }
}

/// Applies `$body` with `$alg` bound to the algorithm and `$st` to its state, or evaluates
/// `$mismatch` when the state belongs to another algorithm.
macro_rules! dispatch {
    ($params:expr, $state:expr, |$alg:ident, $st:ident| $body:expr, $mismatch:expr) => {
        match ($params, $state) {
            (LimitParams::TokenBucket { capacity, rate }, LimitState::TokenBucket($st)) => {
                let $alg = TokenBucket {
                    capacity: *capacity,
                    rate: *rate,
                };
                $body
            }
            (LimitParams::Gcra { capacity, rate }, LimitState::Gcra($st)) => {
                let $alg = Gcra {
                    capacity: *capacity,
                    rate: *rate,
                };
                $body
            }
            (LimitParams::FixedWindow(w), LimitState::FixedWindow($st)) => {
                let $alg = FixedWindow(*w);
                $body
            }
            (LimitParams::SlidingWindow(w), LimitState::SlidingWindow($st)) => {
                let $alg = SlidingWindow(*w);
                $body
            }
            (LimitParams::SlidingLog(w), LimitState::SlidingLog($st)) => {
                let $alg = SlidingLog(*w);
                $body
            }
            _ => $mismatch,
        }
    };
}

impl LimitParams {
    /// A new key's state at `now`.
    pub fn initial_state(&self, now: Nanos) -> LimitState {
        match self {
            LimitParams::TokenBucket { capacity, rate } => LimitState::TokenBucket(
                TokenBucket {
                    capacity: *capacity,
                    rate: *rate,
                }
                .initial_state(now),
            ),
            LimitParams::Gcra { capacity, rate } => LimitState::Gcra(
                Gcra {
                    capacity: *capacity,
                    rate: *rate,
                }
                .initial_state(now),
            ),
            LimitParams::FixedWindow(w) => {
                LimitState::FixedWindow(FixedWindow(*w).initial_state(now))
            }
            LimitParams::SlidingWindow(w) => {
                LimitState::SlidingWindow(SlidingWindow(*w).initial_state(now))
            }
            LimitParams::SlidingLog(w) => LimitState::SlidingLog(SlidingLog(*w).initial_state(now)),
        }
    }

    /// Makes `state` one of this algorithm's: a state of another algorithm (the rule changed
    /// algorithm) is replaced by a fresh one at `now`, so the dispatch below always pairs
    /// parameters with their own state. A state of the right kind is left untouched.
    #[inline]
    fn adopt(&self, state: &mut LimitState, now: Nanos) {
        if self.kind() != state.kind() {
            *state = self.initial_state(now);
        }
    }

    /// [`RateAlgorithm::check`] on whichever algorithm these parameters select. A state of
    /// another algorithm is replaced by a fresh one first.
    #[inline]
    pub fn check(&self, state: &mut LimitState, now: Nanos, cost: Micros) -> Decision {
        self.adopt(state, now);
        dispatch!(
            self,
            state,
            |alg, s| alg.check(s, now, cost),
            unreachable_mismatch()
        )
    }

    /// [`RateAlgorithm::decide`] (check, then spend when allowed) on whichever algorithm these
    /// parameters select; a state of another algorithm is replaced by a fresh one first.
    #[inline]
    pub fn decide(&self, state: &mut LimitState, now: Nanos, cost: Micros) -> Decision {
        self.adopt(state, now);
        dispatch!(
            self,
            state,
            |alg, s| alg.decide(s, now, cost),
            unreachable_mismatch()
        )
    }

    /// [`RateAlgorithm::spend`]; a no-op on a state of another algorithm (check replaces it).
    #[inline]
    pub fn spend(&self, state: &mut LimitState, now: Nanos, cost: Micros) {
        dispatch!(self, state, |alg, s| alg.spend(s, now, cost), ())
    }

    /// [`RateAlgorithm::pack`] on whichever algorithm these parameters select; `None` for a
    /// window or a log, and for a state of another algorithm.
    #[inline]
    pub fn pack(&self, state: &LimitState) -> Option<u128> {
        dispatch!(self, state, |alg, s| alg.pack(s), None)
    }

    /// [`RateAlgorithm::unpack`] on whichever algorithm these parameters select.
    #[inline]
    pub fn unpack(&self, word: u128) -> Option<LimitState> {
        match *self {
            LimitParams::TokenBucket { capacity, rate } => TokenBucket { capacity, rate }
                .unpack(word)
                .map(LimitState::TokenBucket),
            LimitParams::Gcra { capacity, rate } => {
                Gcra { capacity, rate }.unpack(word).map(LimitState::Gcra)
            }
            _ => None,
        }
    }

    /// [`RateAlgorithm::decide_word`] on whichever algorithm these parameters select: the
    /// same as [`unpack`](Self::unpack), [`decide`](Self::decide) and [`pack`](Self::pack);
    /// `None` for a window or a log.
    #[inline]
    pub fn decide_word(&self, word: u128, now: Nanos, cost: Micros) -> Option<(Decision, u128)> {
        match *self {
            LimitParams::TokenBucket { capacity, rate } => {
                TokenBucket { capacity, rate }.decide_word(word, now, cost)
            }
            LimitParams::Gcra { capacity, rate } => {
                Gcra { capacity, rate }.decide_word(word, now, cost)
            }
            _ => None,
        }
    }

    /// [`RateAlgorithm::is_idle`]; a state of another algorithm is idle (it will be replaced).
    pub fn is_idle(&self, state: &LimitState, now: Nanos) -> bool {
        dispatch!(self, state, |alg, s| alg.is_idle(s, now), true)
    }

    /// Carries a key's state from `old` parameters to these ones at time `at` (design §10 "Config
    /// versions"): refill or age the state under `old` up to `at`; then
    /// * buckets (token bucket or GCRA, either way): lowering capacity clamps the tokens, raising
    ///   it adds the increase at once, the new rate applies from `at`;
    /// * windows and logs of the same algorithm keep their used counts and events;
    /// * a change between families starts a fresh state (there is no meaningful conversion).
    ///
    /// Converting a bucket between rates rounds its level down to a whole microtoken.
    pub fn transition_from(
        &self,
        old: &LimitParams,
        mut state: LimitState,
        at: Nanos,
    ) -> LimitState {
        if old == self {
            return state;
        }
        let at = at.max(state.last());
        old.check(&mut state, at, 0);
        match (self, old, &state) {
            (
                LimitParams::TokenBucket { capacity, .. } | LimitParams::Gcra { capacity, .. },
                LimitParams::TokenBucket {
                    capacity: old_cap,
                    rate: old_rate,
                }
                | LimitParams::Gcra {
                    capacity: old_cap,
                    rate: old_rate,
                },
                LimitState::TokenBucket(_) | LimitState::Gcra(_),
            ) => {
                let tokens = match &state {
                    LimitState::TokenBucket(s) => s.micros(*old_rate),
                    LimitState::Gcra(s) => Gcra {
                        capacity: *old_cap,
                        rate: *old_rate,
                    }
                    .available_micros(s),
                    _ => 0,
                };
                let tokens = if capacity > old_cap {
                    tokens.saturating_add(capacity - old_cap)
                } else {
                    tokens
                };
                let tokens = tokens.min(*capacity);
                match self {
                    LimitParams::TokenBucket { capacity, rate } => LimitState::TokenBucket(
                        TokenBucket {
                            capacity: *capacity,
                            rate: *rate,
                        }
                        .state_with(tokens, at),
                    ),
                    LimitParams::Gcra { capacity, rate } => LimitState::Gcra(
                        Gcra {
                            capacity: *capacity,
                            rate: *rate,
                        }
                        .state_with(tokens, at),
                    ),
                    _ => self.initial_state(at),
                }
            }
            (
                LimitParams::FixedWindow(w),
                LimitParams::FixedWindow(_),
                LimitState::FixedWindow(s),
            ) => LimitState::FixedWindow(FixedWindow(*w).state_with(s.used, at)),
            (
                LimitParams::SlidingWindow(w),
                LimitParams::SlidingWindow(ow),
                LimitState::SlidingWindow(s),
            ) => {
                if w.period_ns == ow.period_ns {
                    state
                } else {
                    LimitState::SlidingWindow(SlidingWindow(*w).state_with(s.cur, s.prev, at))
                }
            }
            (LimitParams::SlidingLog(_), LimitParams::SlidingLog(_), LimitState::SlidingLog(_)) => {
                state
            }
            _ => self.initial_state(at),
        }
    }
}

impl LimitParams {
    /// Returns `micros` that were spent at `spent_at` but turned out unused (a released lease, a
    /// settled reservation; design §10 "Refunds"). Never lifts a bucket above capacity; a window
    /// only gets them back while the window they were spent in is still counted; a log is left as
    /// is (logs are never leased).
    pub fn refund(&self, state: &mut LimitState, now: Nanos, micros: Micros, spent_at: Nanos) {
        match (self, state) {
            (LimitParams::TokenBucket { capacity, rate }, LimitState::TokenBucket(s)) => {
                TokenBucket {
                    capacity: *capacity,
                    rate: *rate,
                }
                .refund(s, now, micros)
            }
            (LimitParams::Gcra { rate, .. }, LimitState::Gcra(s)) => {
                // TAT ≥ now keeps the tokens at or below capacity.
                s.last = s.last.max(now);
                let t = s.last as u128 * rate.micros as u128;
                let back = micros as u128 * rate.per_ns as u128;
                s.tat = s.tat.saturating_sub(back).max(t);
            }
            (LimitParams::FixedWindow(w), LimitState::FixedWindow(s))
                if s.start == spent_at - spent_at % w.period_ns =>
            {
                s.used = s.used.saturating_sub(micros);
            }
            (LimitParams::SlidingWindow(w), LimitState::SlidingWindow(s)) => {
                let start = spent_at - spent_at % w.period_ns;
                if s.start == start {
                    s.cur = s.cur.saturating_sub(micros);
                } else if s.start == start.saturating_add(w.period_ns) {
                    s.prev = s.prev.saturating_sub(micros);
                }
            }
            _ => {}
        }
    }
}

/// Unreachable once `check` has replaced a mismatched state; denies (the safe answer) if a
/// future edit ever makes it reachable.
#[cold]
fn unreachable_mismatch() -> Decision {
    Decision {
        allowed: false,
        remaining_micros: 0,
        reset_after: 0,
        retry_after: crate::decision::RetryAfter::After(0),
    }
}

impl Gcra {
    /// Microtokens available as of the state's latest time (rounded down).
    pub fn available_micros(&self, s: &GcraState) -> Micros {
        let mut c = *s;
        let d = self.check(&mut c, s.last, 0);
        d.remaining_micros
    }
}
