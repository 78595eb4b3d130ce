//! Property tests: [`RateAlgorithm::decide_word`] (and [`LimitParams::decide_word`]) answers
//! exactly as unpack → decide → pack ([`decide_word_via_state`]) for every input — random
//! capacities and rates up to the extremes, reachable and arbitrary words, times forwards and
//! backwards, costs around the capacity — step by step, the word carried forward.

use super::{decide_word_via_state, Gcra, LimitParams, Rate, RateAlgorithm, TokenBucket};
use crate::decision::Decision;
use crate::units::{Micros, Nanos};
use proptest::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

type Answer = Option<(Decision, u128)>;

/// `f`'s answer, or `Err` when it panics (an overflow in u128 arithmetic on the state path for
/// numbers far beyond any configuration): the two paths must then both panic.
fn answer(f: impl FnOnce() -> Answer) -> Result<Answer, ()> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|_| ())
}

/// A rate term: 1, small, arbitrary, or at the top of u64.
fn term() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(1u64),
        1u64..=1_000,
        1u64..=1_000_000_000,
        1u64..=u64::MAX,
        (u64::MAX - 16)..=u64::MAX,
    ]
}

/// (capacity, rate): the capacity 0, 1, small, arbitrary, at the top of u64, or with
/// `capacity × per_ns` just at, below or above u64::MAX (the edge of the 64-bit path).
fn limit() -> impl Strategy<Value = (Micros, Rate)> {
    (term(), term(), 0u8..9, any::<u64>()).prop_map(|(micros, per_ns, mode, x)| {
        let edge = u64::MAX / per_ns;
        let capacity = match mode {
            0 => 1,
            1 => x % 10_000_000,
            2 => x,
            3 => u64::MAX - (x % 4),
            4 => edge,
            5 => edge.saturating_sub(x % 3),
            6 => edge.saturating_add(1),
            7 => 0,
            _ => x % (edge.saturating_add(1)).max(1),
        };
        (capacity, Rate { micros, per_ns })
    })
}

/// A starting word: a reachable one (a level or debt within `capacity × per_ns`, when that
/// fits), one with a low half around that bound, or any u128 at all.
fn word(capacity: Micros, rate: Rate) -> impl Strategy<Value = u128> {
    let full = capacity.checked_mul(rate.per_ns);
    let last = prop_oneof![
        any::<u64>(),
        Just(0u64),
        Just(u64::MAX),
        (u64::MAX - 4)..=u64::MAX,
        0u64..1_000
    ];
    let low = (0u8..8, any::<u64>()).prop_map(move |(mode, x)| {
        let f = full.unwrap_or(u64::MAX);
        match mode {
            0..=2 => x % f.saturating_add(1).max(1),
            3 => f,
            4 => f.saturating_sub(1),
            5 => f.saturating_add(1),
            6 => u64::MAX - (x % 2),
            _ => x,
        }
    });
    prop_oneof![
        3 => (low, last).prop_map(|(lo, hi)| u128::from(lo) | (u128::from(hi) << 64)),
        1 => any::<u128>(),
        1 => Just(u128::MAX),
        1 => Just(u128::MAX - 1),
    ]
}

/// One step: how the time moves (`kind`, `x`) and the cost (`cost_kind`, `y`).
type Step = (u8, u64, u8, u64);

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec((0u8..8, any::<u64>(), 0u8..9, any::<u64>()), 1..48)
}

/// The next time from `t`: a little or a lot later, unchanged, earlier, anywhere, the end.
fn next_time(t: Nanos, kind: u8, x: u64) -> Nanos {
    match kind {
        0 | 1 => t.saturating_add(x % 1_000),
        2 => t.saturating_add(x % 10_000_000_000),
        3 => t,
        4 => t.saturating_sub(x % 1_000),
        5 => x,
        6 => u64::MAX,
        _ => t.saturating_add(x),
    }
}

fn cost(capacity: Micros, kind: u8, y: u64) -> Micros {
    match kind {
        0 => 0,
        1 => 1,
        2 => capacity,
        3 => capacity.saturating_add(1),
        4 => u64::MAX,
        5 => capacity.saturating_sub(1),
        6 | 7 => y % capacity.saturating_add(1),
        _ => y,
    }
}

/// Runs `steps` from `word` on both paths of `alg`, and of `params`, comparing every answer
/// and carrying the word forward.
fn run<A: RateAlgorithm>(
    alg: &A,
    params: LimitParams,
    capacity: Micros,
    mut word: u128,
    steps: &[Step],
) -> Result<(), TestCaseError> {
    let mut t = (word >> 64) as u64;
    for (i, &(tk, x, ck, y)) in steps.iter().enumerate() {
        t = next_time(t, tk, x);
        let c = cost(capacity, ck, y);
        let fast = answer(|| alg.decide_word(word, t, c));
        let slow = answer(|| decide_word_via_state(alg, word, t, c));
        prop_assert_eq!(
            fast,
            slow,
            "step {}: word {:#x} now {} cost {}",
            i,
            word,
            t,
            c
        );
        let pfast = answer(|| params.decide_word(word, t, c));
        let pslow = answer(|| {
            let mut s = params.unpack(word)?;
            let d = params.decide(&mut s, t, c);
            Some((d, params.pack(&s)?))
        });
        prop_assert_eq!(pfast, pslow, "params, step {}", i);
        prop_assert_eq!(pfast, fast, "params vs algorithm, step {}", i);
        if let Ok(Some((_, w))) = fast {
            word = w;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3_000, ..ProptestConfig::default() })]

    #[test]
    fn token_bucket_word_path_is_the_state_path(
        (capacity, rate, word, steps) in limit().prop_flat_map(|(c, r)| {
            (Just(c), Just(r), word(c, r), steps())
        })
    ) {
        let alg = TokenBucket { capacity, rate };
        run(&alg, LimitParams::TokenBucket { capacity, rate }, capacity, word, &steps)?;
    }

    #[test]
    fn gcra_word_path_is_the_state_path(
        (capacity, rate, word, steps) in limit().prop_flat_map(|(c, r)| {
            (Just(c), Just(r), word(c, r), steps())
        })
    ) {
        let alg = Gcra { capacity, rate };
        run(&alg, LimitParams::Gcra { capacity, rate }, capacity, word, &steps)?;
    }

    /// Rates in lowest terms as configurations make them ([`Rate::new`]), from a fresh bucket.
    #[test]
    fn reduced_rates_from_a_fresh_bucket(
        capacity in prop_oneof![Just(1u64), 1u64..=10_000_000_000, any::<u64>()],
        micros in prop_oneof![Just(1u64), 1u64..=10_000_000_000],
        per_ns in prop_oneof![Just(1u64), 1u64..=100_000_000_000],
        start in any::<u64>(),
        steps in steps(),
    ) {
        let rate = Rate::new(micros, per_ns).unwrap();
        let tb = TokenBucket { capacity, rate };
        if let Some(w) = tb.pack(&tb.initial_state(start)) {
            run(&tb, LimitParams::TokenBucket { capacity, rate }, capacity, w, &steps)?;
        }
        let g = Gcra { capacity, rate };
        if let Some(w) = g.pack(&g.initial_state(start)) {
            run(&g, LimitParams::Gcra { capacity, rate }, capacity, w, &steps)?;
        }
    }
}
