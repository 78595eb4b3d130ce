//! N threads × M decisions on one key admit exactly the capacity, through the keyed
//! [`Limiter`] and through [`DirectLimiter`]; multi-descriptor requests stay all-or-nothing under
//! contention.

use crate::support::{ask, d, dh, limiter, S, TOK};
use allot_common::algorithm::{
    AlgorithmKind, FixedWindow, Gcra, Rate, RateAlgorithm, SlidingLog, SlidingWindow, TokenBucket,
    WindowParams,
};
use allot_common::clock::ManualClock;
use allot_common::direct::DirectLimiter;
use allot_common::Code;
use std::sync::atomic::{AtomicU64, Ordering};

const THREADS: u64 = 4;
const PER_THREAD: u64 = 1000;

fn yaml_one(kind: AlgorithmKind, rpu: u64) -> String {
    let burst = if kind.is_bucket() {
        format!(", burst: {rpu}")
    } else {
        String::new()
    };
    format!(
        "domain: c\ndescriptors:\n  - key: k\n    rate_limit: {{unit: day, requests_per_unit: {rpu}, algorithm: {kind}{burst}}}\n"
    )
}

#[test]
fn keyed_limiter_admits_exactly_capacity_across_threads() {
    for kind in AlgorithmKind::ALL {
        let l = limiter(&yaml_one(kind, 1000), 0);
        let admitted = AtomicU64::new(0);
        std::thread::scope(|sc| {
            for th in 0..THREADS {
                let l = &l;
                let admitted = &admitted;
                sc.spawn(move || {
                    for i in 0..PER_THREAD {
                        // Times wobble inside the first millisecond (some go backwards across
                        // threads): 1 ms refills 0.0116 tokens at 1000/day, never a whole one.
                        let now = (i * 997 + th * 131) % 1_000_000;
                        let (out, st) = ask(l, "c", &[d(&[("k", "x")])], None, now).unwrap();
                        assert_eq!(out.code == Code::Ok, st[0].code == Code::Ok);
                        if out.code == Code::Ok {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 1000, "{kind}");
        let (_, st) = ask(&l, "c", &[dh(&[("k", "x")], 0)], None, 1_000_000).unwrap();
        assert_eq!(st[0].remaining, 0, "{kind}");
    }
}

fn direct_race<A>(alg: A) -> u64
where
    A: RateAlgorithm + Sync,
    A::State: Send,
{
    let clock = ManualClock::new(S);
    let lim = DirectLimiter::new(alg, clock.clone());
    let admitted = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..THREADS {
            sc.spawn(|| {
                for _ in 0..PER_THREAD {
                    if lim.decide(TOK).allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    // Nothing refills while the clock stands still.
    assert!(!lim.decide(TOK).allowed);
    admitted.load(Ordering::Relaxed)
}

#[test]
fn direct_limiter_admits_exactly_capacity_across_threads() {
    let rate = Rate {
        micros: TOK,
        per_ns: 86_400 * S,
    };
    let w = WindowParams {
        limit: 1000 * TOK,
        period_ns: 86_400 * S,
    };
    let cap = 1000 * TOK;
    assert_eq!(
        direct_race(TokenBucket {
            capacity: cap,
            rate
        }),
        1000
    );
    assert_eq!(
        direct_race(Gcra {
            capacity: cap,
            rate
        }),
        1000
    );
    assert_eq!(direct_race(FixedWindow(w)), 1000);
    assert_eq!(direct_race(SlidingWindow(w)), 1000);
    assert_eq!(direct_race(SlidingLog(w)), 1000);
}

const TWO: &str = "domain: m
descriptors:
  - key: a
    rate_limit: {unit: day, requests_per_unit: 300, algorithm: fixed_window}
  - key: b
    rate_limit: {unit: day, requests_per_unit: 500, burst: 500}
";

fn remaining(l: &allot_common::Limiter, key: &str) -> u64 {
    let (_, st) = ask(l, "m", &[dh(&[(key, "v")], 0)], None, 1).unwrap();
    st[0].remaining
}

#[test]
fn multi_descriptor_all_or_nothing_under_contention() {
    // Every request carries both descriptors: exactly the smaller capacity passes, and the
    // denied ones spend nothing on the larger limit.
    let l = limiter(TWO, 0);
    let admitted = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..THREADS {
            sc.spawn(|| {
                for _ in 0..PER_THREAD {
                    let (out, st) =
                        ask(&l, "m", &[d(&[("a", "v")]), d(&[("b", "v")])], None, 1).unwrap();
                    if out.code == Code::Ok {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        // Only `a` denies; `b` reports its unspent view.
                        assert_eq!(st[0].code, Code::OverLimit);
                        assert_eq!(st[1].code, Code::Ok);
                    }
                }
            });
        }
    });
    assert_eq!(admitted.load(Ordering::Relaxed), 300);
    assert_eq!(remaining(&l, "a"), 0);
    assert_eq!(remaining(&l, "b"), 200);
}

#[test]
fn multi_descriptor_mixed_traffic_spends_only_on_admitted_requests() {
    // Half the threads send (a, b), half send b alone: b is exhausted, and a has spent exactly
    // the (a, b) requests that were admitted.
    let l = limiter(TWO, 0);
    let both = AtomicU64::new(0);
    let only_b = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for th in 0..THREADS {
            let (l, both, only_b) = (&l, &both, &only_b);
            sc.spawn(move || {
                for _ in 0..PER_THREAD {
                    if th % 2 == 0 {
                        let (out, _) =
                            ask(l, "m", &[d(&[("a", "v")]), d(&[("b", "v")])], None, 1).unwrap();
                        if out.code == Code::Ok {
                            both.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        let (out, _) = ask(l, "m", &[d(&[("b", "v")])], None, 1).unwrap();
                        if out.code == Code::Ok {
                            only_b.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    let both = both.load(Ordering::Relaxed);
    let only_b = only_b.load(Ordering::Relaxed);
    assert_eq!(both + only_b, 500);
    assert!(both <= 300);
    assert_eq!(remaining(&l, "a"), 300 - both);
    assert_eq!(remaining(&l, "b"), 0);
}

#[test]
fn key_cap_holds_under_concurrent_new_keys() {
    let yaml = "domain: cap\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1, max_keys: 100}\n";
    for round in 0..100u64 {
        let l = limiter(yaml, 0);
        let admitted = AtomicU64::new(0);
        std::thread::scope(|sc| {
            for th in 0..THREADS {
                let (l, admitted) = (&l, &admitted);
                sc.spawn(move || {
                    for i in 0..100u64 {
                        let key = format!("{round}-{th}-{i}");
                        let (o, _) = ask(l, "cap", &[d(&[("user", &key)])], None, 1).unwrap();
                        if o.code == Code::Ok {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let len = l.snapshot().domain("cap").unwrap().table(0).len();
        // Every admitted key holds state (none is idle within the hour): exactly the cap.
        assert_eq!(len, 100, "round {round}");
        assert_eq!(admitted.load(Ordering::Relaxed), 100, "round {round}");
    }
}

#[test]
fn concurrency_limiter_never_exceeds_its_cap_and_never_overflows() {
    use allot_common::concurrency::{ConcurrencyError, ConcurrencyLimiter};
    let l = ConcurrencyLimiter::new(u64::MAX);
    let all = l.try_acquire(u64::MAX).unwrap();
    assert_eq!(
        l.try_acquire(1).unwrap_err(),
        ConcurrencyError::Full {
            in_flight: u64::MAX,
            max: u64::MAX,
            wanted: 1
        }
    );
    drop(all);
    assert_eq!(l.in_flight(), 0);
    let l = ConcurrencyLimiter::new(3);
    let held = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..THREADS {
            sc.spawn(|| {
                for _ in 0..PER_THREAD {
                    if let Ok(p) = l.try_acquire(2) {
                        let now = held.fetch_add(2, Ordering::SeqCst) + 2;
                        assert!(now <= 3, "{now} slots held");
                        held.fetch_sub(2, Ordering::SeqCst);
                        drop(p);
                    }
                }
            });
        }
    });
    assert_eq!(l.in_flight(), 0);
}

/// A cap moves only forward in config generations: a decision still on an older config cannot
/// set it back; slots held across a change stay counted, above a lowered cap too.
#[test]
fn a_cap_moves_only_to_newer_generations_and_keeps_held_slots() {
    use allot_common::concurrency::{ConcurrencyError, ConcurrencyLimiter};
    let l = ConcurrencyLimiter::at_generation(3, 1);
    let held: Vec<_> = (0..3).map(|_| l.try_acquire(1).expect("free")).collect();
    l.set_max(1, 2);
    assert_eq!((l.max(), l.generation()), (1, 2));
    l.set_max(3, 1);
    assert_eq!(l.max(), 1, "an older generation does not move the cap back");
    assert!(matches!(
        l.try_acquire(1),
        Err(ConcurrencyError::Full {
            in_flight: 3,
            max: 1,
            wanted: 1
        })
    ));
    drop(held);
    assert_eq!(l.in_flight(), 0);
    let _p = l.try_acquire(1).expect("below the new cap");
    assert!(l.try_acquire(1).is_err());
}
