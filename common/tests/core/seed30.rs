//! Seed §30 items 1–7 for every algorithm, with exact numbers: empty / full / exactly depleted,
//! fractional refill and long idle, time equal or backwards, concurrent requests for one token,
//! fixed-window reset edges, sliding-log expiry at the exact boundary, cost above capacity; plus
//! exact retry_after / reset_after and the overflow paths.

use crate::support::{decide, params, peek, MS, S, TOK};
use allot_common::algorithm::{
    AlgorithmKind, FixedWindow, Gcra, LimitParams, Rate, RateAlgorithm, SlidingLog, SlidingWindow,
    TokenBucket, WindowParams,
};
use allot_common::clock::ManualClock;
use allot_common::direct::DirectLimiter;
use allot_common::units::{MAX_PERIOD_NS, MAX_TOKENS};
use allot_common::{Decision, RetryAfter};
use std::sync::atomic::{AtomicU64, Ordering};

const BUCKETS: [AlgorithmKind; 2] = [AlgorithmKind::TokenBucket, AlgorithmKind::Gcra];
const ALL: [AlgorithmKind; 5] = AlgorithmKind::ALL;

fn dec(
    allowed: bool,
    remaining_micros: u64,
    reset_after: u64,
    retry_after: RetryAfter,
) -> Decision {
    Decision {
        allowed,
        remaining_micros,
        reset_after,
        retry_after,
    }
}

fn ok(remaining_micros: u64, reset_after: u64) -> Decision {
    dec(true, remaining_micros, reset_after, RetryAfter::Now)
}

fn no(remaining_micros: u64, reset_after: u64, wait: u64) -> Decision {
    dec(
        false,
        remaining_micros,
        reset_after,
        RetryAfter::After(wait),
    )
}

// ---- item 1: empty, full, exactly depleted -------------------------------------------------

#[test]
fn buckets_full_exactly_depleted_and_empty() {
    for kind in BUCKETS {
        // B = 10, r = 10/s: one token every 100 ms.
        let p = params(kind, 10, S, None);
        let mut s = p.initial_state(0);
        assert_eq!(peek(&p, &s, 0), ok(10 * TOK, 0), "{kind} full");
        for k in 1..=10u64 {
            assert_eq!(
                decide(&p, &mut s, 0, TOK),
                ok((10 - k) * TOK, k * 100 * MS),
                "{kind} spend {k}"
            );
        }
        // Exactly depleted: the 11th is denied and waits exactly one token's refill.
        assert_eq!(decide(&p, &mut s, 0, TOK), no(0, S, 100 * MS), "{kind}");
        assert_eq!(decide(&p, &mut s, 0, 0), ok(0, S), "{kind} cost 0 on empty");
        // One nanosecond early: 999_999.99 microtokens, floor 999_999; full in 900_000_001 ns.
        assert_eq!(
            decide(&p, &mut s, 100 * MS - 1, TOK),
            no(999_999, 900_000_001, 1),
            "{kind}"
        );
        assert_eq!(decide(&p, &mut s, 100 * MS, TOK), ok(0, S), "{kind}");
        assert_eq!(
            decide(&p, &mut s, 100 * MS, TOK),
            no(0, S, 100 * MS),
            "{kind}"
        );
        // Weighted waits: cost 3 waits 300 ms, cost 10 waits a full second.
        assert_eq!(decide(&p, &mut s, 100 * MS, 3 * TOK), no(0, S, 300 * MS));
        assert_eq!(decide(&p, &mut s, 100 * MS, 10 * TOK), no(0, S, S));
        // Cost 10 passes exactly one second later and empties the bucket again.
        assert_eq!(decide(&p, &mut s, 1100 * MS, 10 * TOK), ok(0, S), "{kind}");
    }
}

#[test]
fn fixed_window_full_exactly_depleted_and_empty() {
    let p = params(AlgorithmKind::FixedWindow, 10, S, None);
    let mut s = p.initial_state(0);
    assert_eq!(peek(&p, &s, 0), ok(10 * TOK, S));
    for k in 1..=10u64 {
        assert_eq!(
            decide(&p, &mut s, 250 * MS, TOK),
            ok((10 - k) * TOK, 750 * MS)
        );
    }
    assert_eq!(decide(&p, &mut s, 250 * MS, TOK), no(0, 750 * MS, 750 * MS));
    assert_eq!(decide(&p, &mut s, 250 * MS, 0), ok(0, 750 * MS));
    assert_eq!(decide(&p, &mut s, S - 1, TOK), no(0, 1, 1));
    assert_eq!(decide(&p, &mut s, S, TOK), ok(9 * TOK, S));
}

#[test]
fn sliding_window_full_exactly_depleted_and_empty() {
    let p = params(AlgorithmKind::SlidingWindow, 10, S, None);
    let mut s = p.initial_state(0);
    assert_eq!(peek(&p, &s, 0), ok(10 * TOK, 0));
    for k in 1..=10u64 {
        // Fully reset once this window's count has faded out of the next one: at 2 s.
        assert_eq!(
            decide(&p, &mut s, 250 * MS, TOK),
            ok((10 - k) * TOK, 1750 * MS)
        );
    }
    // Next window: estimate = 10 × (1 − e/P) must drop to 9, at e = 100 ms → 750 + 100 ms.
    assert_eq!(
        decide(&p, &mut s, 250 * MS, TOK),
        no(0, 1750 * MS, 850 * MS)
    );
    // 1 ns early: estimate 9.00000001, so 0.99999999 tokens left (999_999 microtokens).
    assert_eq!(
        decide(&p, &mut s, 1100 * MS - 1, TOK),
        no(999_999, 900 * MS + 1, 1)
    );
    // At 1.1 s the estimate is exactly 9: the request fits and leaves floor(10 − 10) = 0.
    assert_eq!(decide(&p, &mut s, 1100 * MS, TOK), ok(0, 1900 * MS));
}

#[test]
fn sliding_log_full_exactly_depleted_and_empty() {
    let p = params(AlgorithmKind::SlidingLog, 10, S, None);
    let mut s = p.initial_state(0);
    assert_eq!(peek(&p, &s, 0), ok(10 * TOK, 0));
    for k in 1..=10u64 {
        assert_eq!(decide(&p, &mut s, 250 * MS, TOK), ok((10 - k) * TOK, S));
    }
    assert_eq!(decide(&p, &mut s, 250 * MS, TOK), no(0, S, S));
    assert_eq!(decide(&p, &mut s, 250 * MS, 0), ok(0, S));
    assert_eq!(decide(&p, &mut s, 1250 * MS - 1, TOK), no(0, 1, 1));
    assert_eq!(decide(&p, &mut s, 1250 * MS, TOK), ok(9 * TOK, S));
}

// ---- item 2: fractional refill and long idle ------------------------------------------------

#[test]
fn buckets_rate_3_per_second_in_1000_steps_of_1ms_yield_exactly_3_tokens() {
    for kind in BUCKETS {
        let p = params(kind, 3, S, None);
        // Status queries only: the level after each 1 ms step is exact.
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 3 * TOK).allowed);
        for ms in 1..=1000u64 {
            let d = decide(&p, &mut s, ms * MS, 0);
            assert_eq!(d.remaining_micros, 3_000 * ms, "{kind} at {ms} ms");
        }
        assert_eq!(peek(&p, &s, S), ok(3 * TOK, 0), "{kind}");
        // Spending one token whenever one is there: admitted at exactly 334, 667 and 1000 ms,
        // and nothing is left over (no fraction lost or gained).
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 3 * TOK).allowed);
        let mut admitted = Vec::new();
        for ms in 1..=1000u64 {
            if decide(&p, &mut s, ms * MS, TOK).allowed {
                admitted.push(ms);
            }
        }
        assert_eq!(admitted, vec![334, 667, 1000], "{kind}");
        assert_eq!(peek(&p, &s, S).remaining_micros, 0, "{kind}");
    }
}

#[test]
fn buckets_rate_7_per_minute_lose_and_gain_nothing() {
    for kind in BUCKETS {
        let p = params(kind, 7, 60 * S, None);
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 7 * TOK).allowed);
        let mut admitted = Vec::new();
        for ms in 1..=60_000u64 {
            if decide(&p, &mut s, ms * MS, TOK).allowed {
                admitted.push(ms);
            }
        }
        // ceil(k × 60000 / 7) ms for k = 1..7.
        assert_eq!(
            admitted,
            vec![8572, 17143, 25715, 34286, 42858, 51429, 60000],
            "{kind}"
        );
        assert_eq!(peek(&p, &s, 60 * S).remaining_micros, 0, "{kind}");
        // Status-only steps: exactly 3.5 tokens at 30 s and 7 at 60 s.
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 7 * TOK).allowed);
        for ms in 1..=60_000u64 {
            let d = decide(&p, &mut s, ms * MS, 0);
            if ms == 30_000 {
                assert_eq!(d.remaining_micros, 3_500_000, "{kind}");
                assert_eq!(d.reset_after, 30 * S, "{kind}");
            }
        }
        assert_eq!(peek(&p, &s, 60 * S), ok(7 * TOK, 0), "{kind}");
    }
}

#[test]
fn long_idle_refills_to_exactly_capacity_or_resets_windows() {
    let idle = 10 * 86_400 * S;
    for kind in ALL {
        let p = params(kind, 10, S, None);
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 10 * TOK).allowed, "{kind}");
        let t = idle + 250 * MS;
        let expect_reset = match kind {
            AlgorithmKind::FixedWindow => 750 * MS,
            _ => 0,
        };
        assert_eq!(peek(&p, &s, t), ok(10 * TOK, expect_reset), "{kind}");
        let admitted = (0..25)
            .filter(|_| decide(&p, &mut s, t, TOK).allowed)
            .count();
        assert_eq!(
            admitted, 10,
            "{kind}: exactly capacity after idle, not more"
        );
    }
}

// ---- item 3: time that stays equal or moves backwards ---------------------------------------

#[test]
fn buckets_treat_earlier_time_as_latest_seen() {
    for kind in BUCKETS {
        let p = params(kind, 10, S, None);
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 10 * S, 10 * TOK).allowed);
        // Equal time: nothing refills, however often it is asked.
        for _ in 0..100 {
            assert_eq!(
                decide(&p, &mut s, 10 * S, TOK),
                no(0, S, 100 * MS),
                "{kind}"
            );
        }
        // Earlier times are treated as 10 s: same answer, nothing created.
        for t in [10 * S - 1, 5 * S, 0] {
            assert_eq!(
                decide(&p, &mut s, t, TOK),
                no(0, S, 100 * MS),
                "{kind} at {t}"
            );
        }
        // 100 ms after the latest time seen: exactly one token (not 5.1 s worth).
        assert_eq!(
            decide(&p, &mut s, 10 * S + 100 * MS, TOK),
            ok(0, S),
            "{kind}"
        );
        assert_eq!(
            decide(&p, &mut s, 10 * S + 100 * MS, TOK),
            no(0, S, 100 * MS),
            "{kind}"
        );
        // Going back again after that still creates nothing.
        assert_eq!(decide(&p, &mut s, 3 * S, TOK), no(0, S, 100 * MS), "{kind}");
    }
}

#[test]
fn windows_treat_earlier_time_as_latest_seen() {
    // Fixed window: a time in the previous window must not reopen it.
    let p = params(AlgorithmKind::FixedWindow, 10, S, None);
    let mut s = p.initial_state(0);
    assert!(decide(&p, &mut s, 10_500 * MS, 10 * TOK).allowed);
    for t in [10_500 * MS, 9_900 * MS, 0] {
        assert_eq!(
            decide(&p, &mut s, t, TOK),
            no(0, 500 * MS, 500 * MS),
            "at {t}"
        );
    }
    assert_eq!(decide(&p, &mut s, 11 * S - 1, TOK), no(0, 1, 1));
    assert_eq!(decide(&p, &mut s, 11 * S, TOK), ok(9 * TOK, S));
    assert_eq!(decide(&p, &mut s, 10 * S, TOK), ok(8 * TOK, S));

    // Sliding-window counter: the estimate is taken at the latest time seen.
    let p = params(AlgorithmKind::SlidingWindow, 10, S, None);
    let mut s = p.initial_state(0);
    assert!(decide(&p, &mut s, 10_500 * MS, 10 * TOK).allowed);
    for t in [10_500 * MS, 9 * S, 0] {
        assert_eq!(
            decide(&p, &mut s, t, TOK),
            no(0, 1500 * MS, 600 * MS),
            "at {t}"
        );
    }
    assert_eq!(decide(&p, &mut s, 11_100 * MS, TOK), ok(0, 1900 * MS));
    assert_eq!(decide(&p, &mut s, 10 * S, TOK), no(0, 1900 * MS, 100 * MS));

    // Sliding log: an earlier time neither expires nor adds events out of order.
    let p = params(AlgorithmKind::SlidingLog, 10, S, None);
    let mut s = p.initial_state(0);
    assert!(decide(&p, &mut s, 10_500 * MS, 10 * TOK).allowed);
    for t in [10_500 * MS, 10 * S, 0] {
        assert_eq!(decide(&p, &mut s, t, TOK), no(0, S, S), "at {t}");
    }
    assert_eq!(decide(&p, &mut s, 11_500 * MS, TOK), ok(9 * TOK, S));
    // Earlier time again: recorded at 11.5 s, so it leaves with the other one.
    assert_eq!(decide(&p, &mut s, 11 * S, TOK), ok(8 * TOK, S));
    assert_eq!(peek(&p, &s, 12_500 * MS - 1), ok(8 * TOK, 1));
    assert_eq!(peek(&p, &s, 12_500 * MS), ok(10 * TOK, 0));
}

// ---- item 4: many concurrent requests for one token -----------------------------------------

fn race_for_one<A>(alg: A) -> u64
where
    A: RateAlgorithm + Sync,
    A::State: Send,
{
    let clock = ManualClock::new(7 * S);
    let lim = DirectLimiter::new(alg, clock.clone());
    let admitted = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..8 {
            sc.spawn(|| {
                for _ in 0..200 {
                    if lim.decide(TOK).allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    admitted.load(Ordering::Relaxed)
}

#[test]
fn many_threads_racing_for_one_token_admit_exactly_one() {
    let rate = Rate {
        micros: TOK,
        per_ns: 3600 * S,
    };
    let w = WindowParams {
        limit: TOK,
        period_ns: 3600 * S,
    };
    assert_eq!(
        race_for_one(TokenBucket {
            capacity: TOK,
            rate
        }),
        1
    );
    assert_eq!(
        race_for_one(Gcra {
            capacity: TOK,
            rate
        }),
        1
    );
    assert_eq!(race_for_one(FixedWindow(w)), 1);
    assert_eq!(race_for_one(SlidingWindow(w)), 1);
    assert_eq!(race_for_one(SlidingLog(w)), 1);
}

// ---- item 5: fixed window immediately before and after reset ---------------------------------

#[test]
fn fixed_window_one_nanosecond_before_and_at_reset() {
    let p = params(AlgorithmKind::FixedWindow, 5, S, None);
    let mut s = p.initial_state(0);
    for k in 1..=5u64 {
        assert_eq!(decide(&p, &mut s, S - 1, TOK), ok((5 - k) * TOK, 1));
    }
    assert_eq!(decide(&p, &mut s, S - 1, TOK), no(0, 1, 1));
    for k in 1..=5u64 {
        assert_eq!(decide(&p, &mut s, S, TOK), ok((5 - k) * TOK, S));
    }
    assert_eq!(decide(&p, &mut s, S, TOK), no(0, S, S));
    // The documented boundary burst: 10 admitted within 2 ns, never 11.
    assert_eq!(decide(&p, &mut s, 2 * S - 1, TOK), no(0, 1, 1));
    assert_eq!(decide(&p, &mut s, 2 * S, 5 * TOK), ok(0, S));
}

#[test]
fn sliding_window_counter_smooths_the_reset_edge() {
    let p = params(AlgorithmKind::SlidingWindow, 5, S, None);
    let mut s = p.initial_state(0);
    assert_eq!(decide(&p, &mut s, S - 1, 5 * TOK), ok(0, S + 1));
    // At the reset the previous window still weighs fully: 5 × (1 − 0) = 5.
    // One more fits when 5 × (1 − e/P) ≤ 4, i.e. e = 200 ms.
    assert_eq!(decide(&p, &mut s, S, TOK), no(0, S, 200 * MS));
    assert_eq!(
        decide(&p, &mut s, 1200 * MS - 1, TOK),
        no(999_999, 800 * MS + 1, 1)
    );
    assert_eq!(decide(&p, &mut s, 1200 * MS, TOK), ok(0, 1800 * MS));
}

// ---- item 6: sliding-log expiry at the exact boundary ----------------------------------------

#[test]
fn sliding_log_event_expires_exactly_one_period_later() {
    let p = params(AlgorithmKind::SlidingLog, 2, S, None);
    let mut s = p.initial_state(0);
    assert_eq!(decide(&p, &mut s, 0, TOK), ok(TOK, S));
    assert_eq!(decide(&p, &mut s, 500 * MS, TOK), ok(0, S));
    // (now − P, now]: the event at 0 still counts at 1 s − 1 ns ...
    assert_eq!(decide(&p, &mut s, S - 1, TOK), no(0, 500 * MS + 1, 1));
    // ... and has left at exactly 1 s (timestamps ≤ now − window are removed).
    assert_eq!(decide(&p, &mut s, S, TOK), ok(0, S));
    assert_eq!(
        decide(&p, &mut s, 1500 * MS - 1, TOK),
        no(0, 500 * MS + 1, 1)
    );
    assert_eq!(decide(&p, &mut s, 1500 * MS, TOK), ok(0, S));
    // A cost of 2 must wait for both events: the later one leaves at 2.5 s.
    assert_eq!(decide(&p, &mut s, 1500 * MS, 2 * TOK), no(0, S, S));
    assert_eq!(peek(&p, &s, 2500 * MS), ok(2 * TOK, 0));
}

// ---- item 7: weighted requests larger than capacity -----------------------------------------

#[test]
fn cost_above_capacity_is_never_and_changes_nothing() {
    for kind in ALL {
        let p = params(kind, 10, S, None);
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 4 * TOK).allowed);
        let t = 150 * MS;
        let before = peek(&p, &s, t);
        let mut reference = s.clone();
        p.check(&mut reference, t, 0);
        for cost in [10 * TOK + 1, 11 * TOK, u64::MAX / 2, u64::MAX] {
            let d = decide(&p, &mut s, t, cost);
            assert_eq!(d.retry_after, RetryAfter::Never, "{kind} cost {cost}");
            assert!(!d.allowed, "{kind}");
            assert_eq!(d.remaining_micros, before.remaining_micros, "{kind}");
            assert_eq!(d.reset_after, before.reset_after, "{kind}");
            assert_eq!(
                s, reference,
                "{kind}: a never-passing cost changed the state"
            );
        }
        // Exactly capacity is not "never": it waits (or passes when the limit is fresh).
        let d = decide(&p, &mut s, t, 10 * TOK);
        assert!(!d.allowed, "{kind}");
        let expected = match kind {
            // 4 spent at 0, 1.5 refilled: 7.5 of 10, 2.5 tokens more take 250 ms.
            AlgorithmKind::TokenBucket | AlgorithmKind::Gcra => RetryAfter::After(250 * MS),
            AlgorithmKind::FixedWindow => RetryAfter::After(850 * MS),
            // Next window, estimate 4 × (1 − e/P) must reach 0: e = P → 850 ms + 1 s.
            AlgorithmKind::SlidingWindow => RetryAfter::After(1850 * MS),
            AlgorithmKind::SlidingLog => RetryAfter::After(850 * MS),
        };
        assert_eq!(d.retry_after, expected, "{kind}");
        let fresh = params(kind, 10, S, None);
        let mut f = fresh.initial_state(0);
        assert!(decide(&fresh, &mut f, 0, 10 * TOK).allowed, "{kind}");
    }
}

// ---- overflow paths -------------------------------------------------------------------------

#[test]
fn time_at_u64_max_admits_no_more_than_capacity() {
    for kind in ALL {
        let p = params(kind, 10, S, None);
        // Spent just before the end of time: u64::MAX is in the same window / log period.
        let mut s = p.initial_state(u64::MAX - 10);
        assert!(
            decide(&p, &mut s, u64::MAX - 10, 10 * TOK).allowed,
            "{kind}"
        );
        let admitted = (0..1000)
            .filter(|_| decide(&p, &mut s, u64::MAX, TOK).allowed)
            .count();
        assert_eq!(admitted, 0, "{kind}: admitted beyond capacity at u64::MAX");
        // A fresh key at u64::MAX admits exactly its capacity there.
        let mut s = p.initial_state(u64::MAX);
        let admitted = (0..1000)
            .filter(|_| decide(&p, &mut s, u64::MAX, TOK).allowed)
            .count();
        assert_eq!(admitted, 10, "{kind} fresh at u64::MAX");
    }
}

#[test]
fn time_at_u64_max_reports_exact_waits() {
    // Windows aligned to 0: the window holding u64::MAX starts at u64::MAX − 709_551_615 and
    // would end 290_448_385 ns after u64::MAX.
    let into = u64::MAX % S;
    assert_eq!(into, 709_551_615);
    let p = params(AlgorithmKind::FixedWindow, 10, S, None);
    let mut s = p.initial_state(u64::MAX);
    assert_eq!(decide(&p, &mut s, u64::MAX, 10 * TOK), ok(0, S - into));
    assert_eq!(decide(&p, &mut s, u64::MAX, TOK), no(0, S - into, S - into));

    let p = params(AlgorithmKind::SlidingLog, 10, S, None);
    let mut s = p.initial_state(0);
    assert_eq!(decide(&p, &mut s, u64::MAX - 10, 10 * TOK), ok(0, S));
    assert_eq!(decide(&p, &mut s, u64::MAX, TOK), no(0, S - 10, S - 10));

    for kind in BUCKETS {
        let p = params(kind, 10, S, None);
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, u64::MAX - 10, 10 * TOK).allowed);
        // 10 ns at 10/s refills 0.1 microtoken: 99_999_990 ns more make the first token.
        assert_eq!(
            decide(&p, &mut s, u64::MAX, TOK),
            no(0, S - 10, 99_999_990),
            "{kind}"
        );
        // From 0 straight to u64::MAX: exactly full.
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, 10 * TOK).allowed);
        assert_eq!(peek(&p, &s, u64::MAX), ok(10 * TOK, 0), "{kind}");
    }
}

#[test]
fn max_tokens_capacity_and_longest_period_do_not_overflow() {
    let cap = MAX_TOKENS * TOK;
    for kind in ALL {
        let p = LimitParams::new(kind, MAX_TOKENS, MAX_PERIOD_NS, Some(MAX_TOKENS)).unwrap();
        assert_eq!(p.capacity(), cap);
        let mut s = p.initial_state(0);
        let d = decide(&p, &mut s, 0, cap);
        assert!(d.allowed, "{kind}");
        assert_eq!(d.remaining_micros, 0, "{kind}");
        let reset = match kind {
            // Spent at the start of a window: faded out of the next one only 2P later.
            AlgorithmKind::SlidingWindow => 2 * MAX_PERIOD_NS,
            _ => MAX_PERIOD_NS,
        };
        assert_eq!(d.reset_after, reset, "{kind}");
        let d = decide(&p, &mut s, 0, 1);
        assert!(!d.allowed, "{kind}");
        let wait = match kind {
            // One microtoken at 10^18 microtokens per 400 days: under 1 ns, rounded up.
            AlgorithmKind::TokenBucket | AlgorithmKind::Gcra => 1,
            AlgorithmKind::FixedWindow | AlgorithmKind::SlidingLog => MAX_PERIOD_NS,
            // The estimate cap × (1 − e/P) ≤ cap − 1 µ first holds at e = ceil(P / cap) = 1 ns.
            AlgorithmKind::SlidingWindow => MAX_PERIOD_NS + 1,
        };
        assert_eq!(d.retry_after, RetryAfter::After(wait), "{kind}");
        assert_eq!(d.retry_after.as_nanos(), Some(wait));
        assert_eq!(d.retry_after.max(RetryAfter::Never), RetryAfter::Never);
        assert_eq!(
            decide(&p, &mut s, 0, u64::MAX).retry_after,
            RetryAfter::Never
        );
        // At the end of time everything is available again, exactly.
        let d = peek(&p, &s, u64::MAX);
        assert_eq!(d.remaining_micros, cap, "{kind}");
    }
}

#[test]
fn fastest_rate_over_all_of_time_does_not_overflow() {
    for kind in BUCKETS {
        // 10^12 tokens per nanosecond, idle from 0 to u64::MAX.
        let p = LimitParams::new(kind, MAX_TOKENS, 1, Some(MAX_TOKENS)).unwrap();
        let mut s = p.initial_state(0);
        assert_eq!(decide(&p, &mut s, 0, MAX_TOKENS * TOK), ok(0, 1), "{kind}");
        assert_eq!(peek(&p, &s, u64::MAX), ok(MAX_TOKENS * TOK, 0), "{kind}");
    }
}

#[test]
fn three_hours_idle_at_a_million_per_second() {
    for kind in BUCKETS {
        let p = params(kind, 1_000_000, S, None);
        let mut s = p.initial_state(0);
        assert_eq!(decide(&p, &mut s, 0, 1_000_000 * TOK), ok(0, S), "{kind}");
        let t = 3 * 3600 * S;
        assert_eq!(peek(&p, &s, t), ok(1_000_000 * TOK, 0), "{kind}");
        // A burst far above the 3 h refill: 10.8e9 tokens refilled, capped by B = 10^12.
        let p = params(kind, 1_000_000, S, Some(MAX_TOKENS));
        let mut s = p.initial_state(0);
        assert!(decide(&p, &mut s, 0, MAX_TOKENS * TOK).allowed);
        let d = peek(&p, &s, t);
        assert_eq!(d.remaining_micros, 10_800_000_000 * TOK, "{kind}");
        // The rest (989_200_000_000 tokens) refills in 989_200 s.
        assert_eq!(d.reset_after, 989_200 * S, "{kind}");
    }
}
