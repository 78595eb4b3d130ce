//! The leaky-bucket shaper (design §10 "Algorithms"): exact delays, a full queue rejects with an
//! exact retry_after, a cost above the whole queue can never be accepted.

use crate::support::{MS, S, TOK};
use allot_common::algorithm::{Rate, Shaped, Shaper};
use allot_common::RetryAfter;

fn shaper(per_sec: u64, queue: u64) -> Shaper {
    Shaper {
        rate: Rate {
            micros: per_sec * TOK,
            per_ns: S,
        },
        queue: queue * TOK,
    }
}

fn rejected(ns: u64) -> Shaped {
    Shaped::Rejected {
        retry_after: RetryAfter::After(ns),
    }
}

#[test]
fn delays_are_exact_and_a_full_queue_rejects_with_the_exact_wait() {
    let sh = shaper(10, 3);
    let mut s = sh.initial_state(0);
    assert_eq!(sh.offer(&mut s, 0, TOK), Shaped::Delay(0));
    assert_eq!(sh.offer(&mut s, 0, TOK), Shaped::Delay(100 * MS));
    assert_eq!(sh.offer(&mut s, 0, TOK), Shaped::Delay(200 * MS));
    assert_eq!(sh.queued(&s, 0), 3 * TOK);
    assert_eq!(sh.offer(&mut s, 0, TOK), rejected(100 * MS));
    assert_eq!(sh.offer(&mut s, 100 * MS - 1, TOK), rejected(1));
    // Nothing was queued by the rejections.
    assert_eq!(sh.queued(&s, 100 * MS), 2 * TOK);
    assert_eq!(sh.offer(&mut s, 100 * MS, TOK), Shaped::Delay(200 * MS));
    assert_eq!(sh.offer(&mut s, 100 * MS, 2 * TOK), rejected(200 * MS));
    // Time moving backwards is treated as the latest time seen.
    assert_eq!(sh.offer(&mut s, 0, 2 * TOK), rejected(200 * MS));
    assert_eq!(sh.offer(&mut s, 300 * MS, 2 * TOK), Shaped::Delay(100 * MS));
    assert_eq!(sh.queued(&s, 300 * MS), 3 * TOK);
    assert_eq!(sh.queued(&s, 600 * MS), 0);
}

#[test]
fn cost_above_the_queue_is_never_and_queues_nothing() {
    let sh = shaper(10, 3);
    let mut s = sh.initial_state(0);
    let before = s;
    assert_eq!(
        sh.offer(&mut s, 0, 3 * TOK + 1),
        Shaped::Rejected {
            retry_after: RetryAfter::Never
        }
    );
    assert_eq!(
        sh.offer(&mut s, 0, u64::MAX),
        Shaped::Rejected {
            retry_after: RetryAfter::Never
        }
    );
    assert_eq!(s, before);
    // Exactly the queue fits an empty queue at once.
    assert_eq!(sh.offer(&mut s, 0, 3 * TOK), Shaped::Delay(0));
    assert_eq!(sh.offer(&mut s, 0, 0), Shaped::Delay(300 * MS));
}

#[test]
fn fractional_rate_delays_round_up_and_never_drift() {
    // 3 per second: the k-th item waits ceil(k / 3 s).
    let sh = shaper(3, 10);
    let mut s = sh.initial_state(0);
    for k in 0..10u64 {
        assert_eq!(sh.offer(&mut s, 0, TOK), Shaped::Delay((k * S).div_ceil(3)));
    }
    assert_eq!(sh.offer(&mut s, 0, TOK), rejected(333_333_334));
    // After exactly 1 s three items have drained: three more fit, the fourth waits 1/3 s.
    for k in 0..3u64 {
        assert_eq!(
            sh.offer(&mut s, S, TOK),
            Shaped::Delay(((7 + k) * S).div_ceil(3))
        );
    }
    assert_eq!(sh.offer(&mut s, S, TOK), rejected(333_333_334));
    assert_eq!(sh.queued(&s, S), 10 * TOK);
    assert_eq!(sh.queued(&s, 4 * S), TOK);
}

#[test]
fn shaper_at_the_end_of_time_does_not_overflow() {
    let sh = shaper(1_000_000, 1_000_000_000_000);
    let mut s = sh.initial_state(u64::MAX - 1);
    assert_eq!(sh.offer(&mut s, u64::MAX, TOK), Shaped::Delay(0));
    assert_eq!(sh.offer(&mut s, u64::MAX, TOK), Shaped::Delay(1_000));
    assert_eq!(sh.queued(&s, u64::MAX), 2 * TOK);
}
