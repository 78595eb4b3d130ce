//! Central decisions for the long tail, leases for the hot head, and one call for many keys
//! (issue 9 items 2 and 3, agent side), against the fake allocator serving `Batch` and
//! `Decide` as the allocator's contract (`proto/allot/v1/allocator.proto`) defines them.

use crate::support::*;
use allot_agent::api::Decider;
use allot_agent::lease::{AllocatorLink, HeldAllocation, LeaseBook, LeaseManager, LeaseSettings};
use allot_agent::Enforcer;
use allot_common::clock::{Clock, ManualClock};
use allot_common::config::ConfigSet;
use allot_common::limiter::Code;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Decides one request of one token for `tenant=value`.
async fn decide(g: &Decider, value: &str) -> Code {
    decide_tenant(g, value, None).await.code
}

/// [`Served`] by a fake allocator with `pool` tokens that serves `Batch` and `Decide`.
async fn served_fully(pool: u64) -> Served {
    let fake = FakeAllocator::new(pool, 1_000);
    fake.serve_batch.store(true, Ordering::SeqCst);
    fake.serve_decide.store(true, Ordering::SeqCst);
    served(fake).await
}

fn counters(r: &Rig) -> &allot_agent::lease::book::LeaseCounters {
    &r.decider.enforcer().book().counters
}

/// A lone request of a sparse key pays one round trip: one `Batch` carrying one `Decide`,
/// sent at once (no waiting for a tick), and nothing is leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_sparse_request_is_one_central_decision_in_one_call() {
    let s = served_fully(1_000).await;
    assert_eq!(decide(&s.rig.decider, "sparse").await, Code::Ok);
    assert_eq!(s.fake.decides.load(Ordering::SeqCst), 1);
    assert_eq!(s.fake.batches.load(Ordering::SeqCst), 1);
    assert_eq!(s.fake.acquires.load(Ordering::SeqCst), 0, "nothing leased");
    let c = counters(&s.rig);
    assert_eq!(c.central_admits.load(Ordering::SeqCst), 1);
    assert_eq!(
        s.rig.decider.enforcer().book().overshoot_bound(),
        0,
        "a central decision adds nothing to the overshoot bound"
    );
}

/// 200 sparse tenants, one request each, all at once: every one admitted (as the ideal
/// central counter admits them), by 200 `Decide`s that travel in far fewer calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sparse_requests_share_batches_and_match_the_central_counter() {
    let s = served_fully(1_000).await;
    let mut tasks = Vec::new();
    for i in 0..200 {
        let g = s.rig.decider.clone();
        tasks.push(tokio::spawn(
            async move { decide(&g, &format!("t{i}")).await },
        ));
    }
    let mut admitted = 0;
    for t in tasks {
        if t.await.unwrap() == Code::Ok {
            admitted += 1;
        }
    }
    // The ideal central counter: one bucket per tenant, one request each.
    let ideal: usize = (0..200)
        .map(|_| ideal_admitted(TENANT, &[s.rig.clock.now()]))
        .sum();
    assert_eq!((admitted, ideal), (200, 200));
    assert_eq!(s.fake.decides.load(Ordering::SeqCst), 200);
    assert_eq!(s.fake.acquires.load(Ordering::SeqCst), 0);
    let batches = s.fake.batches.load(Ordering::SeqCst);
    assert!(batches <= 20, "{batches} calls for 200 decisions");
}

/// A key is promoted after P = 4 tokens within one lease period, stays leased while a period
/// admits at least D = 2 (the hysteresis band between), and is demoted below D; demoted, it
/// is decided centrally again once what it held has expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promotion_and_demotion_follow_demand_with_hysteresis() {
    let s = served_fully(1_000).await;
    let (g, c) = (&s.rig.decider, counters(&s.rig));
    for i in 0..4 {
        assert_eq!(decide(g, "hot").await, Code::Ok, "central request {i}");
    }
    assert_eq!(s.fake.decides.load(Ordering::SeqCst), 4);
    assert_eq!(c.promotions.load(Ordering::SeqCst), 1, "promoted at 4");
    // Leased now: one Acquire, then local decisions.
    for _ in 0..3 {
        assert_eq!(decide(g, "hot").await, Code::Ok);
    }
    assert_eq!(s.fake.acquires.load(Ordering::SeqCst), 1);
    assert_eq!(s.fake.decides.load(Ordering::SeqCst), 4);
    // A lease period with 3 tokens: below P, not below D: stays leased. The tick that looks
    // at the period also releases the allocation it has outlived, so a release means the look
    // has happened.
    let releases = s.fake.releases.load(Ordering::SeqCst);
    s.rig.clock.advance(1_000 * MS);
    assert!(eventually(10, || s.fake.releases.load(Ordering::SeqCst) > releases).await);
    // The release sends back the incarnation its grant carried (design §3).
    let seen = s.fake.incarnations.lock().unwrap().clone();
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|&i| i == FAKE_INCARNATION), "{seen:?}");
    assert_eq!(c.demotions.load(Ordering::SeqCst), 0, "3 ≥ D: kept");
    // A period with 1 token: demoted.
    assert_eq!(decide(g, "hot").await, Code::Ok);
    s.rig.clock.advance(1_000 * MS);
    assert!(eventually(10, || c.demotions.load(Ordering::SeqCst) == 1).await);
    // Demoted, it asks for no more allocations and spends what it holds (a prefetch may have
    // been sent just before); once that has expired and been released, the next request is
    // a central decision.
    s.rig.clock.advance(1_000 * MS);
    let book = g.enforcer().book().clone();
    tenant_request!(req, "hot", None);
    let kl = book
        .existing("api", 0, req.descriptors[0].entries)
        .expect("key");
    assert!(eventually(10, || kl.value.allocations().is_empty()).await);
    let decides = s.fake.decides.load(Ordering::SeqCst);
    assert_eq!(decide(g, "hot").await, Code::Ok);
    assert_eq!(
        s.fake.decides.load(Ordering::SeqCst),
        decides + 1,
        "{}",
        allot_agent::api::http::status(g)
    );
}

/// A leased key denied under scarcity is still in demand: demotion reads the offered load
/// (admitted and denied), so periods in which the allocator has nothing to give keep the key
/// leased, asking again at its renewals, instead of turning each request into a `Decide`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_key_denied_under_scarcity_is_not_demoted() {
    let s = served_fully(1_000).await;
    let (g, c) = (&s.rig.decider, counters(&s.rig));
    for _ in 0..4 {
        assert_eq!(decide(g, "scarce").await, Code::Ok);
    }
    assert_eq!(c.promotions.load(Ordering::SeqCst), 1);
    // Leased: its first Acquire is granted; then the pool runs dry and it spends what it holds.
    assert_eq!(decide(g, "scarce").await, Code::Ok);
    s.fake.pool.store(0, Ordering::SeqCst);
    let mut spent = 0;
    while decide(g, "scarce").await == Code::Ok {
        spent += 1;
        assert!(spent < 50, "an allocation of the pool's size at most");
    }
    let (decides, acquires) = (
        s.fake.decides.load(Ordering::SeqCst),
        s.fake.acquires.load(Ordering::SeqCst),
    );
    // Three lease periods of 5 requests each, every one denied (the allocator's remembered
    // denial, 2 s, then a new Acquire denied again): admitted 0 in each, offered 5 ≥ D. After
    // each period the background maintenance (every 50 ms of real time, reading the manual
    // clock) gets a few passes to look at it; a pass that demoted the key would turn the next
    // request after the denial into a `Decide`.
    for period in 0..3 {
        for _ in 0..5 {
            assert_eq!(
                decide(g, "scarce").await,
                Code::OverLimit,
                "period {period}"
            );
        }
        s.rig.clock.advance(1_000 * MS);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(decide(g, "scarce").await, Code::OverLimit);
    assert_eq!(
        c.demotions.load(Ordering::SeqCst),
        0,
        "in demand: kept leased"
    );
    assert!(
        s.fake.acquires.load(Ordering::SeqCst) > acquires,
        "asked again as a lease"
    );
    assert_eq!(
        s.fake.decides.load(Ordering::SeqCst),
        decides,
        "no Decide per request"
    );
}

/// The allocator's central denial is remembered: a flood of a central key after the pool is
/// empty sends nothing more while the denial stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_denial_is_remembered() {
    let s = served_fully(2).await;
    let g = &s.rig.decider;
    // Two admitted, then denied; the pool holds 2 tokens.
    assert_eq!(decide(g, "a").await, Code::Ok);
    assert_eq!(decide(g, "b").await, Code::Ok);
    assert_eq!(decide(g, "a").await, Code::OverLimit);
    let decides = s.fake.decides.load(Ordering::SeqCst);
    for _ in 0..50 {
        assert_eq!(decide(g, "a").await, Code::OverLimit);
    }
    assert_eq!(s.fake.decides.load(Ordering::SeqCst), decides);
}

/// One maintenance pass with spend to report on 1 500 keys: two `Batch` calls (1 024 items
/// at most each), not 1 500 Report calls; every spend is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_reports_every_key_in_one_batch_per_1024_keys() {
    let fake = FakeAllocator::new(1_000_000, 60_000);
    fake.serve_batch.store(true, Ordering::SeqCst);
    let (addr, _server) = fake.serve().await;
    let clock = ManualClock::new(1_000 * S);
    let (tx, _events) = tokio::sync::mpsc::unbounded_channel();
    let mut settings = LeaseSettings::new("gw", "eu");
    settings.promote_tokens = 0;
    let book = Arc::new(LeaseBook::new(Arc::new(clock.clone()), settings, tx));
    let config = ConfigSet::from_yaml(TENANT, Path::new("p.yaml")).unwrap();
    let enforcer = Enforcer::new(config, book.clone());
    let link = AllocatorLink::new(&[addr.to_string()], Duration::from_secs(5)).unwrap();
    let manager = LeaseManager::new(book.clone(), Arc::new(link));
    let mut held = Vec::new();
    for i in 0..1_500u64 {
        let v = format!("k{i}");
        tenant_request!(req, &v, None);
        let mut st = Vec::new();
        enforcer.decide_now(&req, &mut st).unwrap();
        let kl = book
            .existing("api", 0, req.descriptors[0].entries)
            .expect("seen");
        let a = Arc::new(HeldAllocation::new(i + 1, 1, 5 * T, u64::MAX, 0, 1));
        kl.value.protocol.install(a.clone());
        assert_eq!(enforcer.decide_now(&req, &mut st).unwrap().code, Code::Ok);
        held.push(a);
    }
    manager.maintain().await;
    assert_eq!(fake.batches.load(Ordering::SeqCst), 2);
    assert_eq!(fake.reports.load(Ordering::SeqCst), 1_500);
    assert_eq!(book.counters.calls.load(Ordering::SeqCst), 2);
    assert!(held.iter().all(|a| a.reported() == T));
    // Nothing new to report: the next pass sends nothing.
    manager.maintain().await;
    assert_eq!(fake.batches.load(Ordering::SeqCst), 2);
}

/// Reachability is per key for central keys too: a key whose `Decide`s fail (here, an
/// OVERLOADED item of a served Batch) follows its failure mode for the error backoff, while
/// another key's Decides in the same calls are admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_key_whose_decides_fail_follows_its_failure_mode_alone() {
    let s = served_fully(1_000).await;
    let g = &s.rig.decider;
    s.fake.failing.lock().unwrap().insert("down".into());
    let o = decide_tenant(g, "down", None).await;
    assert_eq!(o.code, Code::OverLimit);
    assert_eq!(
        o.retry_after,
        allot_common::RetryAfter::After(500 * MS),
        "the error backoff"
    );
    assert_eq!(counters(&s.rig).failure_denials.load(Ordering::SeqCst), 1);
    assert_eq!(decide(g, "up").await, Code::Ok);
    // While its backoff stands, the failing key is denied without a call.
    let decides = s.fake.decides.load(Ordering::SeqCst);
    assert_eq!(decide(g, "down").await, Code::OverLimit);
    assert_eq!(s.fake.decides.load(Ordering::SeqCst), decides);
    // Recovered and the backoff over: decided centrally again.
    s.fake.failing.lock().unwrap().clear();
    s.rig.clock.advance(500 * MS);
    assert_eq!(decide(g, "down").await, Code::Ok);
}
