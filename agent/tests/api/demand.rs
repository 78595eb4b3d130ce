//! Quota follows demand at the agent (issue 9 item 1): a key that holds nothing to spend waits
//! for the allocator instead of answering 429; only the allocator's (remembered) denial or an
//! unreachable allocator for that very key produce a 429. Admissions are compared with the
//! ideal central counter: the decision core replaying the same arrivals with the policy's
//! bucket held in one place.

use crate::support::*;
use allot_common::limiter::{Code, Outcome};
use std::sync::atomic::Ordering;

/// [`Served`] by a fake allocator with `pool` tokens and 1 s leases, serving neither `Batch`
/// nor `Decide` (as an allocator older than those calls): every key is leased.
async fn demand(pool: u64) -> Served {
    served(FakeAllocator::new(pool, 1_000)).await
}

/// Decides one request of `cost` tokens for `tenant=value`.
async fn check(r: &Rig, value: &str, cost: u64) -> Outcome {
    decide_tenant(&r.decider, value, Some(cost)).await
}

fn counter(r: &Rig, f: impl Fn(&allot_agent::lease::book::LeaseCounters) -> u64) -> u64 {
    f(&r.decider.enforcer().book().counters)
}

/// A quiet tenant (one request every 3 s, leases of 1 s): every allocation has expired by the
/// next request, so every request is the first after an idle longer than the lease. Each one
/// waits for one Acquire and is admitted, as the ideal central counter admits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_key_is_admitted_after_every_idle_longer_than_the_lease() {
    let d = demand(1_000).await;
    let r = &d.rig;
    let mut arrivals = Vec::new();
    let mut admitted = 0;
    for i in 0..6 {
        use allot_common::clock::Clock;
        arrivals.push(r.clock.now());
        let o = check(r, "quiet", 1).await;
        assert_eq!(o.code, Code::Ok, "request {i} after {} s idle", 3 * i);
        admitted += 1;
        r.clock.advance(3 * S);
    }
    assert_eq!(
        admitted,
        ideal_admitted(TENANT, &arrivals),
        "as the central counter"
    );
    assert_eq!(counter(r, |c| c.cold_waits.load(Ordering::Relaxed)), 6);
    assert_eq!(counter(r, |c| c.wait_time.count()), 6, "every wait timed");
    assert_eq!(counter(r, |c| c.wait_timeouts.load(Ordering::Relaxed)), 0);
    // One Acquire per request, and at most one prefetch after it (the low watermark).
    let acquires = d.fake.acquires.load(Ordering::Relaxed);
    assert!((6..=12).contains(&acquires), "{acquires} Acquires");
    // This fake serves neither Batch nor Decide (an older allocator): Batch was tried once,
    // then single calls; Decide once, then every key leased.
    assert_eq!(d.fake.batches.load(Ordering::Relaxed), 1);
    assert_eq!(d.fake.decides.load(Ordering::Relaxed), 1);
    let metrics = r.decider.metrics().encode().expect("metrics");
    assert!(
        metrics.contains("allot_agent_lease_wait_seconds_count 6"),
        "{metrics}"
    );
}

/// An exhausted warm key (allocation spent, no denial) is not denied at once: the request
/// waits for the next allocation, which the low watermark may already have asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_key_waits_for_its_next_allocation_instead_of_429() {
    let d = demand(1_000).await;
    let r = &d.rig;
    // Grants of 20 tokens; 45 requests in a row at one instant of the agent's clock stay
    // within what the allocator can grant, so each one is admitted, however the prefetches
    // and the requests interleave.
    for i in 0..45 {
        assert_eq!(check(r, "busy", 1).await.code, Code::Ok, "request {i}");
    }
    assert!(d.fake.acquires.load(Ordering::Relaxed) >= 3);
    assert_eq!(counter(r, |c| c.failure_denials.load(Ordering::Relaxed)), 0);
}

/// Concurrent requests of one cold key share one Acquire: 8 requests arrive while the first
/// call is held by the allocator; one call answers them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_of_a_key_share_one_call() {
    let d = demand(1_000).await;
    let hold = d.fake.gate.write().await;
    let decider = d.rig.decider.clone();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let g = decider.clone();
        tasks.push(tokio::spawn(async move {
            decide_tenant(&g, "shared", None).await.code
        }));
    }
    let book = d.rig.decider.enforcer().book().clone();
    assert!(eventually(10, || book.counters.cold_waits.load(Ordering::Relaxed) == 8).await);
    drop(hold);
    for t in tasks {
        assert_eq!(t.await.unwrap(), Code::Ok);
    }
    assert_eq!(d.fake.acquires.load(Ordering::Relaxed), 1, "one call for 8");
}

/// The allocator's denial is remembered until its retry time: a rejected flood is answered
/// 429 at once with the allocator's Retry-After and sends it nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_remembered_and_a_rejected_flood_sends_no_calls() {
    // 5 tokens in all: one grant of 5, then the fake denies with a retry of 2 s.
    let d = demand(5).await;
    let r = &d.rig;
    for _ in 0..5 {
        assert_eq!(check(r, "flood", 1).await.code, Code::Ok);
    }
    // The grant of 5 was short of the 20 asked (all the allocator had): the key stands denied
    // until the rate refills one token (100 ms at 10/s); after that the sixth request waits for
    // the (low-watermark or own) Acquire and gets the allocator's denial.
    r.clock.advance(100 * MS);
    let o = check(r, "flood", 1).await;
    assert_eq!(o.code, Code::OverLimit);
    let calls = d.fake.acquires.load(Ordering::Relaxed);
    for _ in 0..200 {
        let o = check(r, "flood", 1).await;
        assert_eq!(o.code, Code::OverLimit);
        assert!(!o.awaiting_lease);
        assert_eq!(
            o.retry_after,
            allot_common::RetryAfter::After(2_000 * MS),
            "the allocator's retry, on the agent's (stopped) clock"
        );
    }
    assert_eq!(
        d.fake.acquires.load(Ordering::Relaxed),
        calls,
        "no call while the denial stands"
    );
    assert!(counter(r, |c| c.denials_held.load(Ordering::Relaxed)) >= 200);
    assert_eq!(counter(r, |c| c.failure_denials.load(Ordering::Relaxed)), 0);
}

/// Reachability is per key: one key's calls failing puts that key (only) in its failure mode;
/// another key of the same policy keeps being served by the same allocator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reachability_is_decided_per_key() {
    let d = demand(1_000).await;
    let r = &d.rig;
    d.fake.failing.lock().unwrap().insert("broken".into());
    let o = check(r, "broken", 1).await;
    assert_eq!(
        o.code,
        Code::OverLimit,
        "its call failed: failure mode deny"
    );
    assert_eq!(
        o.retry_after,
        allot_common::RetryAfter::After(500 * MS),
        "the error backoff"
    );
    assert_eq!(counter(r, |c| c.failure_denials.load(Ordering::Relaxed)), 1);
    // The other key is served, and the broken one stays in its failure mode meanwhile.
    for _ in 0..5 {
        assert_eq!(check(r, "fine", 1).await.code, Code::Ok);
    }
    assert_eq!(check(r, "broken", 1).await.code, Code::OverLimit);
    assert_eq!(counter(r, |c| c.failure_denials.load(Ordering::Relaxed)), 2);
    // Fixed, and the backoff over: it is served again.
    d.fake.failing.lock().unwrap().clear();
    r.clock.advance(500 * MS);
    assert_eq!(check(r, "broken", 1).await.code, Code::Ok);
}

/// The allocator denies with a handoff hint within the wait bound (another region's unused
/// part is lent once that region settles; issue 9, skewed part a): the request that waited
/// asks again at the hint and is admitted, where a denial without a hint would be final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_asks_again_at_the_allocators_handoff_hint() {
    let d = demand(0).await;
    let r = &d.rig;
    *d.fake.handoff.lock().unwrap() = Some((30, 5));
    assert_eq!(check(r, "lent", 1).await.code, Code::Ok);
    assert_eq!(counter(r, |c| c.handoff_waits.load(Ordering::Relaxed)), 1);
    assert!(d.fake.acquires.load(Ordering::SeqCst) >= 2, "asked again");
    assert_eq!(counter(r, |c| c.wait_timeouts.load(Ordering::Relaxed)), 0);
    let metrics = r.decider.metrics().encode().expect("metrics");
    assert!(
        metrics.contains("allot_agent_lease_handoff_waits_total 1"),
        "{metrics}"
    );
}

/// A handoff hint beyond the wait bound (`cold_wait_ms`) changes nothing: the denial is final
/// at once and nothing more is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_hint_beyond_the_wait_bound_is_a_denial() {
    let d = demand(0).await;
    let r = &d.rig;
    *d.fake.handoff.lock().unwrap() = Some((60_000, 5));
    assert_eq!(check(r, "far", 1).await.code, Code::OverLimit);
    assert_eq!(counter(r, |c| c.handoff_waits.load(Ordering::Relaxed)), 0);
    assert_eq!(d.fake.acquires.load(Ordering::SeqCst), 1);
}

/// A grant below what the Acquire asked is all the allocator had: the requests that waited
/// for it and are not covered are denied at once (the allocator's bucket is empty, as the
/// central counter's is), without asking again and without waiting out `cold_wait_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_grant_denies_the_waiters_it_does_not_cover_without_asking_again() {
    // 20 tokens for the first key's first Acquire (the max grant), 3 left for the next.
    let d = demand(23).await;
    let r = &d.rig;
    assert_eq!(check(r, "warm", 1).await.code, Code::Ok);
    let acquires = d.fake.acquires.load(Ordering::SeqCst);
    let waits = counter(r, |c| c.cold_waits.load(Ordering::Relaxed));
    let gate = d.fake.gate.write().await;
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let g = r.decider.clone();
        tasks.push(tokio::spawn(async move {
            decide_tenant(&g, "short", Some(1)).await.code
        }));
    }
    // All five wait for the one Acquire held at the gate.
    assert!(
        eventually(10, || {
            d.fake.acquires.load(Ordering::SeqCst) == acquires + 1
                && counter(r, |c| c.cold_waits.load(Ordering::Relaxed)) == waits + 5
        })
        .await
    );
    drop(gate);
    let mut codes = Vec::new();
    for t in tasks {
        codes.push(t.await.expect("request task"));
    }
    let ok = codes.iter().filter(|c| **c == Code::Ok).count();
    assert_eq!((ok, codes.len() - ok), (3, 2), "{codes:?}");
    assert_eq!(
        d.fake.acquires.load(Ordering::SeqCst),
        acquires + 1,
        "the uncovered requests did not ask again"
    );
    assert_eq!(counter(r, |c| c.wait_timeouts.load(Ordering::Relaxed)), 0);
}

/// [`TENANT`] at 1000/s (burst 1000, leases of 1 s, grants of at most 200): one token refills
/// every 1 ms, so the short-grant hold (an eighth of the 50-ms report interval: 6.25 ms)
/// refills 6.25 tokens.
const FAST: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000, lease: {ttl_ms: 1000, max_grant: 200}}
";

/// Requests of one token admitted right after a grant short again of `refill` tokens, and as
/// its pace passes: the key's first grant (3 of a larger ask) is short, the key is then denied
/// requests of `costs`, and after the hold the pool holds `refill` tokens for its next ask.
async fn after_a_second_short_grant(costs: &[u64], refill: u64) -> (usize, usize) {
    let d = served_with(FakeAllocator::new(3, 1_000), FAST).await;
    let r = &d.rig;
    for _ in 0..3 {
        assert_eq!(check(r, "mix", 1).await.code, Code::Ok);
    }
    for &c in costs {
        assert_eq!(check(r, "mix", c).await.code, Code::OverLimit);
    }
    d.fake.pool.store(refill * T, Ordering::SeqCst);
    r.clock.advance(7 * MS);
    let mut at_once = 0;
    while check(r, "mix", 1).await.code == Code::Ok {
        at_once += 1;
        assert!(at_once <= refill as usize, "never more than the grant");
    }
    let mut later = 0;
    for _ in 0..2 {
        r.clock.advance(4 * MS);
        while check(r, "mix", 1).await.code == Code::Ok {
            later += 1;
        }
    }
    let wants = d.fake.wants.lock().unwrap().clone();
    assert!(
        wants.iter().all(|&w| w > refill * T),
        "every ask was larger than what the pool held: {wants:?}"
    );
    (at_once, later)
}

/// A key over its limit whose requests differ in cost spends a grant short again at a pace
/// (one hold's refill over the short-grant hold, the rest at once), as the ideal central
/// counter hands out its refill, so its cheap requests get in between the dear ones
/// (`allot-local --scenario demand --part weighted`: 0.97 → 0.99 of the ideal's requests). A
/// grant beyond one hold's refill (gathered over a pause) is spendable at once beyond it, as
/// the central counter's stock is; and a key whose requests all cost the same spends its
/// grants at once (a pace would change which requests get in for nothing and delay the tokens
/// by one hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_short_again_is_paced_only_for_a_key_whose_costs_differ() {
    // 6 tokens, 6.25 a hold: 1 at once, 3 more by 4 ms (1 + 5 · 4/6.25), the rest at the end.
    assert_eq!(after_a_second_short_grant(&[8, 2], 6).await, (1, 5));
    // 50 tokens: 43.75 at once, 6.25 over the hold.
    assert_eq!(after_a_second_short_grant(&[8, 2], 50).await, (43, 7));
    assert_eq!(after_a_second_short_grant(&[1, 1], 6).await, (6, 0));
}
