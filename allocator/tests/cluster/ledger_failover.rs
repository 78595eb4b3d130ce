//! The real ledger on a 3-node loopback cluster, driven through the gRPC API: grants commit on
//! every replica; the leader is killed while clients acquire and report, and a new leader
//! continues with no allocation id reused, no epoch going back and no more granted than
//! B + r·t; a stale-epoch report is refused and changes nothing; a whole-cluster restart from
//! the sled directories loses nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::ledger::{Allocation, AllocationState};
use allot_allocator::raft::{NodeClock, SystemNodeClock};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use tonic::transport::Channel;
use tonic::{Code, Response, Status};

use crate::ledger_support::{
    acquire, client_of, exclusive, grant, key, leader_hint, retryable, LedgerCluster, API_BURST,
    API_POLICY, API_RATE_PER_S, WAIT,
};

const T: u64 = 1_000_000;
const CLIENTS: usize = 4;

/// Calls `f` until it gets an answer that is not "try elsewhere or later", moving to the
/// hinted leader or the next node in between, for at most [`WAIT`].
async fn call<T, F, Fut>(
    clients: &[AllocatorClient<Channel>],
    addrs: &[String],
    target: &mut usize,
    mut f: F,
) -> Result<T, Status>
where
    F: FnMut(AllocatorClient<Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<Response<T>, Status>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match f(clients[*target].clone()).await {
            Ok(r) => return Ok(r.into_inner()),
            // INTERNAL also covers an HTTP/2 stream torn down with the killed leader's
            // connections; retrying is safe (Report is idempotent, Acquire is deduplicated by
            // request id), so it is retried like the agent does, and shown.
            Err(s)
                if (retryable(&s) || s.code() == Code::Internal)
                    && tokio::time::Instant::now() < deadline =>
            {
                if s.code() == Code::Internal {
                    eprintln!("retrying after {s:?}");
                }
                let hinted = leader_hint(&s)
                    .and_then(|h| addrs.iter().position(|a| *a == h.leader_addr))
                    .filter(|&i| i != *target);
                *target = hinted.unwrap_or((*target + 1) % clients.len());
                // Paces retries while an election runs.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => return Err(s),
        }
    }
}

/// What one load client saw.
#[derive(Default)]
struct Seen {
    /// (request id, grant), in the order acquired.
    grants: Vec<(String, pb::Grant)>,
    reports_ok: u64,
}

/// One agent-like client: Acquire 5 tokens, Report half of them, repeat until `stop`; every
/// call is retried with the same request until it has a definitive answer.
async fn load_client(
    n: usize,
    addrs: Vec<String>,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
) -> Seen {
    let clients: Vec<_> = addrs.iter().map(|a| client_of(a)).collect();
    let mut target = n % clients.len();
    let mut seen = Seen::default();
    let holder = format!("gw-{n}");
    let mut seq = 0;
    while !stop.load(Ordering::SeqCst) {
        seq += 1;
        let rid = format!("c{n}-{seq}");
        let req = acquire("acme", &holder, 5 * T, &rid);
        let r = call(&clients, &addrs, &mut target, |mut c| {
            let req = req.clone();
            async move { c.acquire(req).await }
        })
        .await
        .expect("acquire gets an answer");
        match r.outcome {
            Some(pb::acquire_response::Outcome::Grant(g)) => {
                seen.grants.push((rid, g));
                count.fetch_add(1, Ordering::SeqCst);
                let rep = pb::ReportRequest {
                    incarnation: 0,
                    allocation_id: g.allocation_id,
                    epoch: g.epoch,
                    cumulative_spend: g.granted / 2,
                    holder: holder.clone(),
                };
                match call(&clients, &addrs, &mut target, |mut c| {
                    let rep = rep.clone();
                    async move { c.report(rep).await }
                })
                .await
                {
                    Ok(r) => {
                        assert_eq!(r.recorded_spend, g.granted / 2);
                        seen.reports_ok += 1;
                    }
                    // The allocation may have expired while the cluster elected a leader.
                    Err(s) if s.code() == Code::FailedPrecondition => {}
                    Err(s) => panic!("report failed: {s:?}"),
                }
            }
            Some(pb::acquire_response::Outcome::Denial(d)) => {
                tokio::time::sleep(Duration::from_millis(d.retry_after_ms.clamp(1, 50))).await;
            }
            None => panic!("empty acquire response"),
        }
    }
    seen
}

/// Polls `f` until it holds, for at most [`WAIT`].
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Allocation fields that never change once granted.
fn identity(a: &Allocation) -> (u64, u64, String, u64, u64, u64, u64) {
    (
        a.id,
        a.epoch,
        a.holder.to_string(),
        a.granted,
        a.issued_at_ms,
        a.expires_at_ms,
        a.policy_version,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_survives_failover_under_load_and_full_restart() {
    let _exclusive = exclusive().await;
    let mut cluster = LedgerCluster::start(&[1, 2, 3]).await;
    let leader = cluster.leader().await;
    let put = cluster
        .client(leader)
        .put_policy(pb::PutPolicyRequest {
            yaml: API_POLICY.into(),
            expected_version: 0,
            request_id: String::new(),
        })
        .await
        .expect("policy accepted")
        .into_inner();
    assert_eq!((put.policy.as_str(), put.version), ("api", 1));

    // A grant commits: every replica holds the allocation once the leader answered.
    let g = grant(
        cluster
            .client(leader)
            .acquire(acquire("first", "gw-x", 3 * T, "x1"))
            .await
            .expect("acquire")
            .into_inner(),
    );
    assert_eq!((g.granted, g.epoch, g.policy_version), (3 * T, 1, 1));
    for id in [1, 2, 3] {
        let a = cluster
            .ledger(id, |l| l.allocation(g.allocation_id).cloned())
            .await
            .expect("replicated");
        assert_eq!((a.granted, a.epoch), (g.granted, g.epoch), "node {id}");
    }

    // Load: concurrent clients acquire and report against every node.
    let addrs: Vec<String> = cluster.addrs.values().cloned().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(load_client(n, addrs.clone(), stop.clone(), count.clone())))
        .collect();
    until("grants before the failover", || {
        count.load(Ordering::SeqCst) >= 12
    })
    .await;

    // Kill the leader under load; the others elect a new one that keeps granting.
    let old_leader = cluster.leader().await;
    cluster.stop(old_leader).await;
    let killed_at_ms = SystemNodeClock.now_ms();
    let at_kill = count.load(Ordering::SeqCst);
    let new_leader = cluster.leader().await;
    assert_ne!(new_leader, old_leader);
    until("grants after the failover", || {
        count.load(Ordering::SeqCst) >= at_kill + 12
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut seen = Vec::new();
    for c in clients {
        seen.push(c.await.expect("client task"));
    }

    // What the clients were granted is exactly what the ledger holds for acme.
    let allocations: Vec<Allocation> = cluster
        .ledger(new_leader, |l| {
            l.allocations()
                .filter(|a| a.holder.starts_with("gw-") && a.holder != "gw-x")
                .cloned()
                .collect()
        })
        .await;
    let mut by_id: BTreeMap<u64, &pb::Grant> = BTreeMap::new();
    let mut request_ids = BTreeSet::new();
    for s in &seen {
        for (rid, g) in &s.grants {
            assert!(
                request_ids.insert(rid.clone()),
                "request id {rid} seen twice"
            );
            assert!(
                by_id.insert(g.allocation_id, g).is_none(),
                "allocation id {} granted to two requests",
                g.allocation_id
            );
        }
        // Epochs of one holder strictly increase, across the failover too.
        for w in s.grants.windows(2) {
            assert!(w[1].1.epoch > w[0].1.epoch, "epoch went back: {w:?}");
            assert!(w[1].1.allocation_id > w[0].1.allocation_id);
        }
        assert!(s.reports_ok > 0);
    }
    assert_eq!(by_id.len(), allocations.len(), "client grants vs ledger");
    for a in &allocations {
        let g = by_id
            .get(&a.id)
            .expect("every ledger allocation reached a client");
        assert_eq!((a.epoch, a.granted), (g.epoch, g.granted));
    }
    assert!(
        allocations.iter().any(|a| a.issued_at_ms > killed_at_ms),
        "the new leader granted"
    );

    // Total granted ≤ B + r·t, exact in microtokens, t from the first to the last grant
    // (the key's bucket was created full at the first grant; nothing was released).
    let first = allocations
        .iter()
        .map(|a| a.issued_at_ms)
        .min()
        .expect("grants");
    let last = allocations
        .iter()
        .map(|a| a.issued_at_ms)
        .max()
        .expect("grants");
    let total: u128 = allocations.iter().map(|a| u128::from(a.granted)).sum();
    let bound =
        u128::from(API_BURST) + u128::from(API_RATE_PER_S) * u128::from(last - first) / 1000;
    eprintln!(
        "failover {old_leader} → {new_leader}: {} grants ({} after the kill), {total} µtokens granted ≤ {bound} over {} ms",
        allocations.len(),
        allocations.iter().filter(|a| a.issued_at_ms > killed_at_ms).count(),
        last - first
    );
    assert!(total <= bound, "granted {total} > B + r·t = {bound}");
    assert!(
        total > u128::from(API_BURST),
        "the bucket refilled and was granted again"
    );

    // A stale-epoch report is refused and changes nothing.
    let leader = cluster.leader().await;
    let mut c = cluster.client(leader);
    let a1 = grant(
        c.acquire(acquire("fence", "gw-f", 2 * T, "f1"))
            .await
            .expect("a1")
            .into_inner(),
    );
    let a2 = grant(
        c.acquire(acquire("fence", "gw-f", 2 * T, "f2"))
            .await
            .expect("a2")
            .into_inner(),
    );
    // An allocation's epoch is its id (never reused), so a holder's epochs strictly increase.
    assert_eq!((a1.epoch, a2.epoch), (a1.allocation_id, a2.allocation_id));
    assert!(a2.epoch > a1.epoch);
    let status = |c: &mut AllocatorClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.status(pb::StatusRequest {
                key: Some(key("api", "fence")),
            })
            .await
            .expect("status")
            .into_inner()
            .regions
        }
    };
    let before = status(&mut c).await;
    let before_ledger = cluster
        .ledger(leader, |l| {
            (
                l.allocation(a1.allocation_id).cloned(),
                l.allocation(a2.allocation_id).cloned(),
                l.violations(),
            )
        })
        .await;
    for (id, epoch) in [(a2.allocation_id, a1.epoch), (a1.allocation_id, a2.epoch)] {
        let s = c
            .report(pb::ReportRequest {
                incarnation: 0,
                allocation_id: id,
                epoch,
                cumulative_spend: T,
                holder: "gw-f".into(),
            })
            .await
            .expect_err("stale epoch");
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
        assert!(s.message().contains("stale"), "{s:?}");
        assert!(
            leader_hint(&s).is_none(),
            "a ledger refusal, not a redirect"
        );
        let d = allot_proto::error_detail::of(&s).expect("a typed detail");
        assert_eq!(d.reason, pb::ErrorReason::StaleEpoch as i32, "{d:?}");
    }
    assert_eq!(status(&mut c).await, before);
    let after_ledger = cluster
        .ledger(leader, |l| {
            (
                l.allocation(a1.allocation_id).cloned(),
                l.allocation(a2.allocation_id).cloned(),
                l.violations(),
            )
        })
        .await;
    assert_eq!(after_ledger, before_ledger);

    // Whole-cluster restart from the sled directories, the old leader included.
    let (allocs_before, versions_before, max_epoch, max_id) = cluster
        .ledger(leader, |l| {
            let allocs: Vec<Allocation> = l.allocations().cloned().collect();
            let max_epoch = allocs
                .iter()
                .filter(|a| a.holder == "gw-0")
                .map(|a| a.epoch)
                .max();
            let max_id = allocs.iter().map(|a| a.id).max();
            (allocs, l.policy_version("api"), max_epoch, max_id)
        })
        .await;
    cluster.stop_all().await;
    for id in [1, 2, 3] {
        cluster.restart(id).await;
    }
    let leader = cluster.leader().await;
    for id in [1, 2, 3] {
        let (allocs, version) = cluster
            .ledger(id, |l| {
                (
                    l.allocations().cloned().collect::<Vec<_>>(),
                    l.policy_version("api"),
                )
            })
            .await;
        assert_eq!(version, versions_before, "node {id}");
        assert_eq!(allocs.len(), allocs_before.len(), "node {id}");
        for (a, b) in allocs.iter().zip(&allocs_before) {
            assert_eq!(identity(a), identity(b), "node {id}");
            assert!(a.reported >= b.reported);
            // Time passed: a live allocation may have expired meanwhile, nothing else.
            assert!(
                a.state == b.state
                    || (b.state == AllocationState::Live && a.state == AllocationState::Expired),
                "node {id}: {:?} → {:?}",
                b.state,
                a.state
            );
        }
    }
    // Epochs and ids continue where they were; the policy version continues too.
    let mut c = cluster.client(leader);
    let mut attempt = 0;
    let next = loop {
        attempt += 1;
        let r = c
            .acquire(acquire(
                "acme",
                "gw-0",
                T,
                &format!("after-restart-{attempt}"),
            ))
            .await
            .expect("acquire after restart")
            .into_inner();
        match r.outcome {
            Some(pb::acquire_response::Outcome::Grant(g)) => break g,
            Some(pb::acquire_response::Outcome::Denial(d)) => {
                // Bucket still empty from the load: wait the time it names (pacing only).
                tokio::time::sleep(Duration::from_millis(d.retry_after_ms.clamp(1, 200))).await;
            }
            None => panic!("empty response"),
        }
    };
    // Epochs are allocation ids: gw-0's continue above its last one, with no gap in the ids.
    assert!(Some(next.epoch) > max_epoch && next.epoch == next.allocation_id);
    assert_eq!(Some(next.allocation_id - 1), max_id);
    let put = c
        .put_policy(pb::PutPolicyRequest {
            yaml: API_POLICY.into(),
            expected_version: versions_before,
            request_id: String::new(),
        })
        .await
        .expect("policy update on top of the restored version")
        .into_inner();
    assert_eq!(put.version, versions_before + 1);

    cluster.stop_all().await;
}
