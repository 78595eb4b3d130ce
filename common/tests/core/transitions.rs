//! Config changes through `Limiter::apply` (design §10 "Config versions", acceptance "Config
//! change"), exact numbers: lowering capacity clamps, raising adds the increase at once, a rate
//! change refills at the old rate up to the change, windows keep their count, a change of family
//! starts fresh.

use crate::support::{ask, config, d, dh, limiter, params, peek, S, TOK};
use allot_common::algorithm::AlgorithmKind;
use allot_common::{Code, Limiter, RetryAfter};

fn rl(body: &str) -> String {
    format!("domain: t\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, {body}}}\n")
}

fn query(l: &Limiter, now: u64) -> (u64, u64) {
    let (o, st) = ask(l, "t", &[dh(&[("k", "v")], 0)], None, now).unwrap();
    assert_eq!(o.code, Code::Ok);
    (st[0].remaining, st[0].reset_after)
}

fn hit(l: &Limiter, cost: u64, now: u64) -> (Code, u64, RetryAfter) {
    let (o, st) = ask(l, "t", &[dh(&[("k", "v")], cost)], None, now).unwrap();
    (o.code, st[0].remaining, o.retry_after)
}

#[test]
fn lowering_capacity_clamps_and_raising_adds_the_increase() {
    let l = limiter(&rl("requests_per_unit: 1, burst: 10"), 0);
    assert_eq!(hit(&l, 2, 0), (Code::Ok, 8, RetryAfter::Now));
    // At 1 s the bucket holds 9; the new capacity is 4.
    assert_eq!(l.apply(config(&rl("requests_per_unit: 1, burst: 4")), S), 2);
    assert_eq!(query(&l, S), (4, 0));
    assert_eq!(hit(&l, 1, S), (Code::Ok, 3, RetryAfter::Now));
    // Raising to 15 adds 11 at once: 3 + 11 = 14.
    assert_eq!(
        l.apply(config(&rl("requests_per_unit: 1, burst: 15")), S),
        3
    );
    assert_eq!(query(&l, S), (14, S));
    let (o, _) = ask(&l, "t", &[d(&[("k", "v")])], None, S).unwrap();
    assert_eq!(o.policy_version, 3);
}

#[test]
fn rate_change_refills_at_the_old_rate_up_to_the_change() {
    let l = limiter(&rl("requests_per_unit: 1, burst: 10"), 0);
    assert_eq!(hit(&l, 10, 0), (Code::Ok, 0, RetryAfter::Now));
    l.apply(config(&rl("requests_per_unit: 2, burst: 10")), 2 * S);
    // 2 tokens at 1/s up to 2 s, then 2 more at 2/s by 3 s; 6 more take 3 s.
    assert_eq!(query(&l, 3 * S), (4, 3 * S));
    assert_eq!(
        hit(&l, 5, 3 * S),
        (Code::OverLimit, 4, RetryAfter::After(500_000_000))
    );
}

#[test]
fn successive_changes_each_apply_from_their_own_time() {
    // The key is idle across two changes: 1/s until 2 s, 2/s until 4 s, 4/s after.
    let l = limiter(&rl("requests_per_unit: 1, burst: 100"), 0);
    assert_eq!(hit(&l, 100, 0), (Code::Ok, 0, RetryAfter::Now));
    l.apply(config(&rl("requests_per_unit: 2, burst: 100")), 2 * S);
    l.apply(config(&rl("requests_per_unit: 4, burst: 100")), 4 * S);
    assert_eq!(query(&l, 5 * S).0, 2 + 4 + 4);
    // Capacity 10 → 5 → 10 with the key idle: clamped to 5 at the first change, +5 at the second.
    let l = limiter(&rl("requests_per_unit: 1, burst: 10"), 0);
    assert_eq!(hit(&l, 1, 0), (Code::Ok, 9, RetryAfter::Now));
    l.apply(config(&rl("requests_per_unit: 1, burst: 5")), 0);
    l.apply(config(&rl("requests_per_unit: 1, burst: 10")), 0);
    assert_eq!(query(&l, 0).0, 10);
}

#[test]
fn windows_keep_their_count_across_changes() {
    let fw = |n: u64| {
        rl(&format!(
            "requests_per_unit: {n}, unit_multiplier: 60, algorithm: fixed_window"
        ))
    };
    let l = limiter(&fw(5), 0);
    assert_eq!(hit(&l, 3, S), (Code::Ok, 2, RetryAfter::Now));
    l.apply(config(&fw(10)), 2 * S);
    assert_eq!(query(&l, 3 * S), (7, 57 * S));
    l.apply(config(&fw(2)), 4 * S);
    assert_eq!(
        hit(&l, 1, 5 * S),
        (Code::OverLimit, 0, RetryAfter::After(55 * S))
    );
    // A status query (cost 0) still passes while the kept count is above the new limit.
    assert_eq!(query(&l, 5 * S), (0, 55 * S));
    assert_eq!(hit(&l, 2, 60 * S), (Code::Ok, 0, RetryAfter::Now));

    let sl = |n: u64| {
        rl(&format!(
            "requests_per_unit: {n}, unit_multiplier: 60, algorithm: sliding_log"
        ))
    };
    let l = limiter(&sl(5), 0);
    assert_eq!(hit(&l, 3, S), (Code::Ok, 2, RetryAfter::Now));
    l.apply(config(&sl(4)), 2 * S);
    assert_eq!(hit(&l, 1, 3 * S), (Code::Ok, 0, RetryAfter::Now));
    // The 3 spent at 1 s leave at 61 s.
    assert_eq!(
        hit(&l, 1, 3 * S),
        (Code::OverLimit, 0, RetryAfter::After(58 * S))
    );
    l.apply(config(&sl(2)), 4 * S);
    assert_eq!(query(&l, 4 * S).0, 0);

    let sw = |n: u64| {
        rl(&format!(
            "requests_per_unit: {n}, unit_multiplier: 60, algorithm: sliding_window"
        ))
    };
    let l = limiter(&sw(5), 0);
    assert_eq!(hit(&l, 4, S), (Code::Ok, 1, RetryAfter::Now));
    l.apply(config(&sw(8)), 2 * S);
    assert_eq!(query(&l, 2 * S).0, 4);
    l.apply(config(&sw(2)), 3 * S);
    assert_eq!(query(&l, 3 * S).0, 0);
    assert_eq!(hit(&l, 1, 3 * S).0, Code::OverLimit);
}

#[test]
fn a_change_of_algorithm_family_starts_fresh_and_buckets_convert() {
    let l = limiter(&rl("requests_per_unit: 5"), 0);
    assert_eq!(hit(&l, 5, 0), (Code::Ok, 0, RetryAfter::Now));
    l.apply(
        config(&rl("requests_per_unit: 5, algorithm: fixed_window")),
        0,
    );
    assert_eq!(query(&l, 0), (5, S));
    assert_eq!(hit(&l, 4, 0), (Code::Ok, 1, RetryAfter::Now));
    l.apply(
        config(&rl("requests_per_unit: 5, algorithm: sliding_log")),
        0,
    );
    assert_eq!(query(&l, 0), (5, 0));
    // Token bucket ↔ GCRA is the same envelope: the tokens carry over.
    let l = limiter(&rl("requests_per_unit: 5"), 0);
    assert_eq!(hit(&l, 3, 0), (Code::Ok, 2, RetryAfter::Now));
    l.apply(config(&rl("requests_per_unit: 5, algorithm: gcra")), 0);
    assert_eq!(query(&l, 0), (2, 600_000_000));
    assert_eq!(
        hit(&l, 3, 0),
        (Code::OverLimit, 2, RetryAfter::After(200_000_000))
    );
}

#[test]
fn a_different_key_shape_does_not_share_state() {
    let l = limiter(&rl("requests_per_unit: 5"), 0);
    assert_eq!(hit(&l, 5, 0), (Code::Ok, 0, RetryAfter::Now));
    let other = "domain: t\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: second, requests_per_unit: 5}\n";
    l.apply(config(other), 0);
    assert_eq!(query(&l, 0), (5, 0));
}

#[test]
fn lowered_window_limits_still_answer_status_queries() {
    // The algorithm contract: a cost of 0 is always allowed, even above a lowered limit.
    for kind in [
        AlgorithmKind::FixedWindow,
        AlgorithmKind::SlidingWindow,
        AlgorithmKind::SlidingLog,
    ] {
        let old = params(kind, 5, 60 * S, None);
        let new = params(kind, 2, 60 * S, None);
        let mut s = old.initial_state(0);
        assert!(crate::support::decide(&old, &mut s, S, 4 * TOK).allowed);
        let s = new.transition_from(&old, s, 2 * S);
        let q = peek(&new, &s, 3 * S);
        assert!(q.allowed, "{kind}: {q:?}");
        assert_eq!(q.remaining_micros, 0, "{kind}");
        let mut s2 = s.clone();
        let d = new.check(&mut s2, 3 * S, TOK);
        assert!(!d.allowed, "{kind}");
    }
}
