//! Agent-side safety of the overshoot bound (issue 10): allocations closed before their final
//! spend is read, refunds only into what was charged, expired allocations released.

use crate::support::*;
use allot_agent::api::rls::RlsService;
use allot_agent::lease::HeldAllocation;
use allot_common::clock::Clock;
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request};
use allot_common::limiter::Code as CoreCode;
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_server::{Allocator, AllocatorServer};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

const LEASED: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100, lease: {ttl_ms: 60000, max_grant: 20}, name: tenant-rps}
  - key: tokens
    rate_limit: {unit: minute, requests_per_unit: 100, scope: local, name: llm-tokens}
  - key: bulk
    rate_limit: {unit: second, requests_per_unit: 1000000, lease: {ttl_ms: 60000, max_grant: 1000000}, name: bulk}
  - key: capped
    rate_limit: {unit: second, requests_per_unit: 100, max_keys: 3, name: capped}
  - key: fleet
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100, failure_mode: emergency, lease: {ttl_ms: 60000, max_grant: 20}, name: fleet}
";

/// The fake allocator whose Releases wait at a gate: each signals when it arrives and answers
/// only once the test opens the gate, so decisions are certain to run while a Release is on
/// its way (no timing involved).
#[derive(Clone)]
struct GatedRelease {
    inner: FakeAllocator,
    arrived: Arc<AtomicBool>,
    open: Arc<tokio::sync::Semaphore>,
}

#[tonic::async_trait]
impl Allocator for GatedRelease {
    async fn acquire(
        &self,
        r: tonic::Request<pb::AcquireRequest>,
    ) -> Result<tonic::Response<pb::AcquireResponse>, tonic::Status> {
        self.inner.acquire(r).await
    }
    async fn report(
        &self,
        r: tonic::Request<pb::ReportRequest>,
    ) -> Result<tonic::Response<pb::ReportResponse>, tonic::Status> {
        self.inner.report(r).await
    }
    async fn release(
        &self,
        r: tonic::Request<pb::ReleaseRequest>,
    ) -> Result<tonic::Response<pb::ReleaseResponse>, tonic::Status> {
        self.arrived.store(true, Ordering::Release);
        let _pass = self.open.acquire().await;
        self.inner.release(r).await
    }
    async fn decide(
        &self,
        r: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        self.inner.decide(r).await
    }
    async fn batch(
        &self,
        r: tonic::Request<pb::BatchRequest>,
    ) -> Result<tonic::Response<pb::BatchResponse>, tonic::Status> {
        self.inner.batch(r).await
    }
    async fn status(
        &self,
        r: tonic::Request<pb::StatusRequest>,
    ) -> Result<tonic::Response<pb::StatusResponse>, tonic::Status> {
        self.inner.status(r).await
    }
    async fn put_policy(
        &self,
        r: tonic::Request<pb::PutPolicyRequest>,
    ) -> Result<tonic::Response<pb::PutPolicyResponse>, tonic::Status> {
        self.inner.put_policy(r).await
    }
    async fn set_shares(
        &self,
        r: tonic::Request<pb::SetSharesRequest>,
    ) -> Result<tonic::Response<pb::SetSharesResponse>, tonic::Status> {
        self.inner.set_shares(r).await
    }
    async fn cluster_init(
        &self,
        r: tonic::Request<pb::ClusterInitRequest>,
    ) -> Result<tonic::Response<pb::ClusterInitResponse>, tonic::Status> {
        self.inner.cluster_init(r).await
    }
    async fn add_learner(
        &self,
        r: tonic::Request<pb::AddLearnerRequest>,
    ) -> Result<tonic::Response<pb::AddLearnerResponse>, tonic::Status> {
        self.inner.add_learner(r).await
    }
    async fn change_membership(
        &self,
        r: tonic::Request<pb::ChangeMembershipRequest>,
    ) -> Result<tonic::Response<pb::ChangeMembershipResponse>, tonic::Status> {
        self.inner.change_membership(r).await
    }
    async fn cluster_status(
        &self,
        r: tonic::Request<pb::ClusterStatusRequest>,
    ) -> Result<tonic::Response<pb::ClusterStatusResponse>, tonic::Status> {
        self.inner.cluster_status(r).await
    }
}

/// Issue 10 item 3: requests decided while the agent shuts down race the Release of an
/// allocation far from exhausted: 300 decisions run while the Release is held at the gate.
/// Every allocation is closed before its final spend is read, so what was admitted equals what
/// the Releases carried: not one token spent after its allocation's final spend was taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spends_racing_the_shutdown_releases_never_exceed_the_final_spends() {
    let fake = FakeAllocator::new(1_000_000, 60_000);
    let gated = GatedRelease {
        inner: fake.clone(),
        arrived: Arc::default(),
        open: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = AllocatorServer::new(gated.clone());
    let _allocator = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
            .await;
    });
    let mut rig = rig_with(LEASED, &[addr.to_string()], |s| {
        s.report_interval_ms = 20;
        s.cold_wait_ms = 300;
        s.call_timeout_ms = 30_000;
    });
    let (stop, shutdown) = watch::channel(false);
    let background = rig.agent.spawn_background(shutdown);
    let (admitted, attempts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let done = Arc::new(AtomicBool::new(false));
    let mut deciders = Vec::new();
    for _ in 0..3 {
        let svc = RlsService::new(rig.decider.clone());
        let (admitted, attempts, done) = (admitted.clone(), attempts.clone(), done.clone());
        deciders.push(tokio::spawn(async move {
            while !done.load(Ordering::Acquire) {
                let resp = svc
                    .should_rate_limit(tonic::Request::new(rls("api", &[&[("bulk", "b")]], 0)))
                    .await
                    .unwrap()
                    .into_inner();
                if resp.overall_code == Code::Ok as i32 {
                    admitted.fetch_add(T, Ordering::Relaxed);
                }
                attempts.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        }));
    }
    assert!(
        eventually(10, || admitted.load(Ordering::Relaxed) >= 100 * T).await,
        "the deciders are admitted"
    );
    let _ = stop.send(true);
    assert!(
        eventually(10, || gated.arrived.load(Ordering::Acquire)).await,
        "a Release arrives"
    );
    // A decision that finds nothing to spend now waits for an Acquire nobody serves; past the
    // wait bound the key counts as unreachable and decisions are answered at once.
    rig.clock.advance(1_000 * MS);
    let seen = attempts.load(Ordering::Relaxed);
    assert!(
        eventually(10, || attempts.load(Ordering::Relaxed) >= seen + 300).await,
        "decisions run while the Release waits"
    );
    gated.open.add_permits(1_000);
    tokio::time::timeout(std::time::Duration::from_secs(20), background)
        .await
        .expect("background tasks stop")
        .unwrap();
    done.store(true, Ordering::Release);
    for d in deciders {
        d.await.unwrap();
    }
    assert_eq!(
        fake.released_spend.load(Ordering::Relaxed),
        admitted.load(Ordering::Relaxed),
        "the Releases carry every admitted token and nothing more"
    );
}

/// An agent leasing from the allocator at `addr`, its background tasks running until the
/// returned sender says stop (cold wait 5 s, call timeout 2 s, then `tune`).
fn running(
    addr: std::net::SocketAddr,
    tune: impl FnOnce(&mut allot_agent::lease::LeaseSettings),
) -> (Rig, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let mut rig = rig_with(LEASED, &[addr.to_string()], |s| {
        s.cold_wait_ms = 5_000;
        s.call_timeout_ms = 2_000;
        tune(s);
    });
    let (stop, shutdown) = watch::channel(false);
    let background = rig.agent.spawn_background(shutdown);
    (rig, stop, background)
}

/// A rig on a manual clock whose allocations are installed by hand (no allocator answers).
fn manual() -> Rig {
    rig_with(LEASED, &["127.0.0.1:9".to_string()], |s| s.cold_wait_ms = 0)
}

fn entries<'a>(pairs: &[(&'a str, &'a str)]) -> Vec<Entry<'a>> {
    pairs
        .iter()
        .map(|&(key, value)| Entry { key, value })
        .collect()
}

/// Installs an allocation of `granted` tokens for `tenant=value`, usable for `ttl_ms`.
async fn install(r: &Rig, value: &str, id: u64, granted: u64, ttl_ms: u64) -> Arc<HeldAllocation> {
    let e = entries(&[("tenant", value)]);
    let kl = r
        .decider
        .enforcer()
        .book()
        .existing("api", 0, &e)
        .expect("key seen");
    let a = Arc::new(HeldAllocation::new(
        id,
        1,
        granted * T,
        r.clock.now() + ttl_ms * MS,
        0,
        1,
    ));
    kl.value.protocol.install(a.clone());
    a
}

/// Checks `key=value` at `cost` tokens, or reserves it under `reservation` when given.
async fn decide(r: &Rig, key: &str, value: &str, cost: u64, reservation: Option<&str>) -> CoreCode {
    let e = entries(&[(key, value)]);
    let d = [Descriptor {
        entries: &e,
        hits_addend: None,
    }];
    let req = Request {
        domain: "api",
        descriptors: &d,
        hits_addend: Some(cost),
    };
    let verdict = match reservation {
        Some(id) => {
            r.decider
                .reserve(&req, Some(id), 600_000)
                .await
                .unwrap()
                .verdict
        }
        None => Arc::new(r.decider.check(&req, None).await.unwrap()),
    };
    verdict.outcome.code
}

async fn check(r: &Rig, key: &str, value: &str, cost: u64) -> CoreCode {
    decide(r, key, value, cost, None).await
}

async fn reserve(r: &Rig, key: &str, value: &str, cost: u64, id: &str) -> CoreCode {
    decide(r, key, value, cost, Some(id)).await
}

/// Issue 10 items 5 and 8: a settled refund goes back only into the allocation its reservation
/// spent from, and only while that allocation is live. A reservation spent from A and settled
/// after A expired gives nothing to the newer B, which therefore admits no more than it was
/// granted; settled while A is live, A gets back what it has not reported.
#[tokio::test]
async fn a_settled_refund_goes_only_into_the_live_allocation_it_charged() {
    let r = manual();
    // The first decision makes the key known (cold, denied); then allocations are installed.
    assert_eq!(check(&r, "tenant", "a", 1).await, CoreCode::OverLimit);
    let a = install(&r, "a", 1, 10, 1_000).await;
    assert_eq!(reserve(&r, "tenant", "a", 6, "res-1").await, CoreCode::Ok);
    assert_eq!(a.spent(), 6 * T);
    r.clock.advance(1_000 * MS);
    let b = install(&r, "a", 2, 10, 60_000).await;
    assert_eq!(check(&r, "tenant", "a", 4).await, CoreCode::Ok);
    assert_eq!(b.spent(), 4 * T);
    let s = r.decider.settle("res-1", 0).unwrap();
    assert_eq!(s.refunded, 6, "the reservation is settled at 0");
    assert_eq!(b.spent(), 4 * T, "B was never charged: it gets nothing");
    assert_eq!(a.spent(), 6 * T, "A expired: its spend stands");
    // B admits exactly what is left of its grant, not a token more.
    assert_eq!(check(&r, "tenant", "a", 6).await, CoreCode::Ok);
    assert_eq!(check(&r, "tenant", "a", 1).await, CoreCode::OverLimit);
    assert_eq!(b.spent(), 10 * T);

    // A live allocation gets back the unused part, but never reported spend.
    assert_eq!(check(&r, "tenant", "c", 1).await, CoreCode::OverLimit);
    let c = install(&r, "c", 3, 10, 60_000).await;
    assert_eq!(reserve(&r, "tenant", "c", 8, "res-2").await, CoreCode::Ok);
    c.set_reported(5 * T);
    r.decider.settle("res-2", 1).unwrap();
    assert_eq!(
        c.spent(),
        5 * T,
        "3 of the 7 unused tokens were not reported yet"
    );
    // Repeating the settlement gives nothing more (the spend never wraps).
    r.decider.settle("res-2", 0).unwrap();
    assert_eq!(c.spent(), 5 * T);
}

/// Tokens left of the local `tokens=value`, by a decision that spends nothing.
fn tokens_left(r: &Rig, value: &str) -> u64 {
    let e = entries(&[("tokens", value)]);
    let d = [Descriptor {
        entries: &e,
        hits_addend: Some(0),
    }];
    let req = Request {
        domain: "api",
        descriptors: &d,
        hits_addend: None,
    };
    let mut st = Vec::new();
    r.decider.enforcer().decide_now(&req, &mut st).unwrap();
    st[0].remaining
}

/// Issue 10 item 13 (agent side): a local descriptor's refund goes into its key's state only
/// while the rule that charged it decides it with an algorithm of the same family; after a
/// change of family the state deciding now was never charged, so it gets nothing back.
#[tokio::test]
async fn a_refund_after_an_algorithm_change_goes_nowhere() {
    let r = manual();
    assert_eq!(reserve(&r, "tokens", "t", 60, "res-l").await, CoreCode::Ok);
    let changed = LEASED.replace(
        "requests_per_unit: 100, scope: local",
        "requests_per_unit: 100, algorithm: gcra, scope: local",
    );
    r.decider
        .apply(ConfigSet::from_yaml(&changed, Path::new("p2.yaml")).unwrap());
    let before = tokens_left(&r, "t");
    r.decider.settle("res-l", 0).unwrap();
    assert_eq!(
        tokens_left(&r, "t"),
        before,
        "nothing refunded into the GCRA state"
    );

    // The same rule and limit: the refund comes back.
    assert_eq!(reserve(&r, "tokens", "u", 60, "res-m").await, CoreCode::Ok);
    let before = tokens_left(&r, "u");
    r.decider.settle("res-m", 0).unwrap();
    assert!(
        tokens_left(&r, "u") > before,
        "refunded under the same rule"
    );
}

/// Issue 10 item 14 (agent side): an expired allocation whose spend was fully reported is
/// released (the allocator returns unspent tokens only at a Release), not dropped when a newer
/// allocation is installed.
#[tokio::test]
async fn expired_fully_reported_allocations_are_released() {
    let fake = FakeAllocator::new(1_000, 400);
    let (addr, _allocator) = fake.serve().await;
    let (rig, stop, background) = running(addr, |s| {
        s.report_interval_ms = 10_000;
        s.drift_margin_ms = 100;
    });
    assert_eq!(check(&rig, "tenant", "x", 1).await, CoreCode::Ok);
    let e = entries(&[("tenant", "x")]);
    let kl = rig
        .decider
        .enforcer()
        .book()
        .existing("api", 0, &e)
        .unwrap();
    let first = kl.value.allocations()[0].clone();
    first.set_reported(first.spent());
    // Past the first allocation's deadline the next decision acquires a second one.
    rig.clock.advance(400 * MS);
    let _ = check(&rig, "tenant", "x", 1).await;
    assert!(
        eventually(10, || kl
            .value
            .allocations()
            .iter()
            .any(|a| a.id != first.id))
        .await,
        "a second allocation"
    );
    assert!(
        kl.value.allocations().iter().any(|a| a.id == first.id),
        "the expired allocation is kept until it is released"
    );
    let spent: u64 = kl.value.allocations().iter().map(|a| a.spent()).sum();
    let _ = stop.send(true);
    tokio::time::timeout(std::time::Duration::from_secs(10), background)
        .await
        .expect("background tasks stop")
        .unwrap();
    assert_eq!(fake.releases.load(Ordering::Relaxed), 2, "both released");
    assert_eq!(fake.released_spend.load(Ordering::Relaxed), spent);
}

/// Issue 10 item 12: a busy key decides with the settings of the config deciding now (seed
/// §28), not those it was first seen under: after a change under load, the new fuse rejects a
/// flood the old config let through, the new failure mode applies, and the lease manager sizes
/// the next Acquire by the new max grant and TTL.
#[tokio::test]
async fn a_config_change_reaches_busy_keys() {
    let r = manual();
    assert_eq!(check(&r, "tenant", "busy", 1).await, CoreCode::OverLimit);
    assert_eq!(check(&r, "tenant", "down", 1).await, CoreCode::OverLimit);
    let a = install(&r, "busy", 1, 50, 60_000).await;
    for _ in 0..5 {
        assert_eq!(check(&r, "tenant", "busy", 1).await, CoreCode::Ok);
    }
    let changed = LEASED.replace(
        "lease: {ttl_ms: 60000, max_grant: 20}, name: tenant-rps}",
        "lease: {ttl_ms: 30000, max_grant: 7}, name: tenant-rps, failure_mode: emergency, \
         fuse: {requests_per_unit: 1, burst: 2}}",
    );
    assert_ne!(changed, LEASED);
    r.decider
        .apply(ConfigSet::from_yaml(&changed, Path::new("p2.yaml")).unwrap());
    // The fuse of the new config: 2 tokens, then rejected, though the allocation holds 45.
    assert_eq!(check(&r, "tenant", "busy", 1).await, CoreCode::Ok);
    assert_eq!(check(&r, "tenant", "busy", 1).await, CoreCode::Ok);
    assert_eq!(check(&r, "tenant", "busy", 1).await, CoreCode::OverLimit);
    assert_eq!(a.spent(), 7 * T);
    // The new lease sizing reaches keys the change found.
    let e = entries(&[("tenant", "busy")]);
    let kl = r.decider.enforcer().book().existing("api", 0, &e).unwrap();
    assert_eq!(
        (kl.value.sizing.max_grant(), kl.value.sizing.ttl_ms()),
        (7 * T, 30_000)
    );
    // The new failure mode: a grant installed now keeps an emergency reserve (10%), which
    // admits while the allocator is unreachable for the key (the old `deny` would refuse).
    let e = entries(&[("tenant", "down")]);
    let kl = r.decider.enforcer().book().existing("api", 0, &e).unwrap();
    let reserve = kl.value.sizing.emergency_reserve(10 * T, 100_000);
    assert_eq!(reserve, T);
    let d = Arc::new(
        HeldAllocation::new(5, 1, 10 * T, r.clock.now() + 60_000 * MS, 0, 1).with_reserve(reserve),
    );
    kl.value.protocol.install(d.clone());
    for _ in 0..9 {
        // One a second, under the new fuse.
        r.clock.advance(1_000 * MS);
        assert_eq!(check(&r, "tenant", "down", 1).await, CoreCode::Ok);
    }
    kl.value
        .protocol
        .record_failure(r.clock.now() + 10_000 * MS);
    r.clock.advance(1_000 * MS);
    assert_eq!(check(&r, "tenant", "down", 1).await, CoreCode::Ok);
    assert_eq!(kl.value.emergency_admitted.load(Ordering::Relaxed), T);
    r.clock.advance(1_000 * MS);
    assert_eq!(check(&r, "tenant", "down", 1).await, CoreCode::OverLimit);
    assert_eq!(d.spent(), 10 * T);
}

/// Issue 10 item 11 (agent side): the leased keys of a rule are capped at its `max_keys`. A new
/// key beyond the cap is refused (denied, counted) while every held key is busy; once keys are
/// idle, one sweep makes room. A key holding an allocation is never evicted.
#[tokio::test]
async fn leased_keys_are_capped_at_max_keys() {
    let r = manual();
    let book = r.decider.enforcer().book().clone();
    let keys = || book.tables().iter().map(|t| t.len()).sum::<u64>();
    for k in ["k1", "k2", "k3"] {
        assert_eq!(check(&r, "capped", k, 1).await, CoreCode::OverLimit, "cold");
    }
    assert_eq!(keys(), 3);
    assert_eq!(check(&r, "capped", "k4", 1).await, CoreCode::OverLimit);
    assert_eq!(keys(), 3, "the fourth key found no place");
    assert_eq!(book.counters.key_refusals.load(Ordering::Relaxed), 1);
    // k1 holds an allocation; k2 and k3 hold nothing and their calls are over.
    let e = entries(&[("capped", "k1")]);
    let k1 = book.existing("api", 3, &e).unwrap();
    k1.value
        .protocol
        .install(Arc::new(HeldAllocation::new(9, 1, 5 * T, u64::MAX, 0, 1)));
    for k in ["k2", "k3"] {
        let e = entries(&[("capped", k)]);
        book.existing("api", 3, &e)
            .unwrap()
            .value
            .protocol
            .abandon_call();
    }
    r.clock.advance(1_000 * MS);
    assert_eq!(
        check(&r, "capped", "k4", 1).await,
        CoreCode::OverLimit,
        "cold"
    );
    assert_eq!(keys(), 2, "k2 and k3 were evicted, k4 took a place");
    assert!(book.existing("api", 3, &e).is_some(), "k1 is kept");
    assert_eq!(book.counters.key_refusals.load(Ordering::Relaxed), 1);
    assert_eq!(check(&r, "capped", "k1", 1).await, CoreCode::Ok);
}

/// Issue 10 item 4: emergency admissions are bounded by what the allocator granted, whatever
/// the number of gateways and the length of the outage. Three gateways hold grants of 20 whose
/// top 10% is their emergency reserve (the newest grant's only); through an outage of 20 s (the emergency pace alone
/// would allow 10 tokens and more every second, per gateway) they admit no more than they were
/// granted, and in emergency no more than Σ reserves; after recovery the Releases carry every
/// admission, emergency ones included, so the allocator's bucket is charged for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_through_an_outage_admit_at_most_their_granted_reserves() {
    let fake = FakeAllocator::new(1_000, 60_000);
    let (addr, _allocator) = fake.serve().await;
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(running(addr, |s| {
            s.report_interval_ms = 20;
            s.error_backoff_ms = 100;
        }));
    }
    let mut admitted = 0;
    for (rig, _, _) in &gateways {
        for _ in 0..18 {
            assert_eq!(check(rig, "fleet", "f", 1).await, CoreCode::Ok);
            admitted += 1;
        }
    }
    fake.down.store(true, Ordering::SeqCst);
    // A gateway may have prefetched a second grant (20 tokens) before the outage began: 45
    // checks, one a second, exhaust both grants and the reserve well within the 60 s lease.
    for (rig, _, _) in &gateways {
        for _ in 0..45 {
            rig.clock.advance(1_000 * MS);
            if check(rig, "fleet", "f", 1).await == CoreCode::Ok {
                admitted += 1;
            }
        }
    }
    let granted = 1_000 * T - fake.pool.load(Ordering::SeqCst);
    let emergency: u64 = gateways
        .iter()
        .map(|(r, _, _)| {
            r.decider
                .enforcer()
                .book()
                .counters
                .emergency_admits
                .load(Ordering::Relaxed)
        })
        .sum();
    assert!(emergency > 0, "the reserves were used");
    // Only the newest grant of each gateway holds a reserve: at most 10% of 20 each.
    assert!(emergency <= 3 * 2, "{emergency} emergency admissions");
    assert!(
        emergency * T <= granted / 10,
        "{emergency} emergency admissions beyond the reserves of {granted} µtokens granted"
    );
    assert!(
        admitted * T <= granted,
        "{admitted} admitted, {granted} granted"
    );
    // Recovery: the Releases carry the final spend, emergency admissions included.
    fake.down.store(false, Ordering::SeqCst);
    for (_, stop, background) in gateways {
        let _ = stop.send(true);
        tokio::time::timeout(std::time::Duration::from_secs(10), background)
            .await
            .expect("background tasks stop")
            .unwrap();
    }
    assert_eq!(
        fake.released_spend.load(Ordering::Relaxed),
        admitted * T,
        "every admission, emergency ones included, is charged"
    );
}

/// A config change that stops leasing a rule (here it turns `scope: local`; a removed rule or
/// another key path is the same) releases what the rule's keys hold, with their final spend,
/// at the next maintenance pass: the allocator gets the unspent tokens back now instead of at
/// expiry, and the spend since the last Report is not lost. Decisions then follow the new rule.
/// The allocation is closed by its Release, so no decision still running on the previous
/// config can spend from it afterwards.
#[tokio::test]
async fn a_rule_no_longer_leased_releases_its_allocations() {
    let fake = FakeAllocator::new(1_000, 60_000);
    let (addr, _allocator) = fake.serve().await;
    let (rig, stop, background) = running(addr, |s| s.report_interval_ms = 20);
    for _ in 0..3 {
        assert_eq!(check(&rig, "tenant", "x", 1).await, CoreCode::Ok);
    }
    let e = entries(&[("tenant", "x")]);
    let kl = rig
        .decider
        .enforcer()
        .book()
        .existing("api", 0, &e)
        .unwrap();
    let a = kl.value.allocations()[0].clone();
    assert_eq!(a.spent(), 3 * T);

    let local = LEASED.replace(
        "burst: 100, lease: {ttl_ms: 60000, max_grant: 20}, name: tenant-rps}",
        "burst: 100, scope: local, name: tenant-rps}",
    );
    assert_ne!(local, LEASED);
    rig.decider
        .apply(ConfigSet::from_yaml(&local, Path::new("p2.yaml")).unwrap());
    assert!(
        eventually(10, || fake.releases.load(Ordering::Relaxed) == 1).await,
        "the allocation is released"
    );
    assert_eq!(fake.released_spend.load(Ordering::Relaxed), 3 * T);
    assert!(a.is_closed(), "closed by its Release");
    assert!(
        eventually(10, || kl.value.allocations().is_empty()).await,
        "and forgotten once the allocator answered"
    );
    // The key now decides locally (a full local bucket of 100), asking the allocator nothing.
    let acquires = fake.acquires.load(Ordering::Relaxed);
    assert_eq!(check(&rig, "tenant", "x", 1).await, CoreCode::Ok);
    assert_eq!(fake.acquires.load(Ordering::Relaxed), acquires);

    let _ = stop.send(true);
    tokio::time::timeout(std::time::Duration::from_secs(10), background)
        .await
        .expect("background tasks stop")
        .unwrap();
    assert_eq!(fake.releases.load(Ordering::Relaxed), 1, "released once");
}
