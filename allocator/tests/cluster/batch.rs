//! Batch and Decide through a 3-node cluster: items answered in order with per-item errors,
//! follower forwarding, a leader change under batched load losing and duplicating no decision
//! (retried request ids get the same answer and are charged once), and the group commit's
//! overload and deadline refusals, both unapplied.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::ledger::Ledger;
use allot_allocator::raft::{GroupCommit, GroupCommitConfig};
use allot_proto::allot::v1 as pb;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use tonic::{Code, Request, Status};

use crate::ledger_support::{
    client_of, exclusive, key, leader_hint, retryable, LedgerCluster, WAIT,
};

const T: u64 = 1_000_000;

/// A million tokens refilled at one a day: over a test, the bucket only drains, so what it lost
/// is what was admitted (to within one token of refill).
const CENTRAL_POLICY: &str = "domain: central
descriptors:
  - key: tenant
    rate_limit:
      unit: day
      requests_per_unit: 1
      burst: 1000000
      name: central-tenant
      lease: {ttl_ms: 600000, max_grant: 10, max_drift_ms: 100}
";
const CENTRAL_BURST: u64 = 1_000_000 * T;

fn decide(holder: &str, cost: u64, id: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        key: Some(key("central", "acme")),
        region: "eu-west".into(),
        holder: holder.into(),
        cost,
        request_id: id.into(),
    }
}

fn item(op: Op) -> pb::BatchItem {
    pb::BatchItem { op: Some(op) }
}

fn decided(r: &pb::BatchResult) -> &pb::DecideResponse {
    match &r.outcome {
        Some(Outcome::Decide(d)) => d,
        other => panic!("expected a decision, got {other:?}"),
    }
}

fn error(r: &pb::BatchResult) -> &pb::ErrorDetail {
    match &r.outcome {
        Some(Outcome::Error(e)) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

fn reason(e: &pb::ErrorDetail) -> pb::ErrorReason {
    pb::ErrorReason::try_from(e.reason).expect("a known reason")
}

async fn install(cluster: &LedgerCluster, node: u64) {
    cluster
        .client(node)
        .put_policy(pb::PutPolicyRequest {
            yaml: CENTRAL_POLICY.into(),
            expected_version: 0,
            request_id: String::new(),
        })
        .await
        .expect("policy installed");
}

/// Less than this much refill (a day's token × 864 s) blurs what [`consumed`] sees in a test.
const REFILL_SLACK: u64 = T / 100;

/// Microtokens the central bucket lost as of a minute after the first call (the same instant
/// on every replica, whatever each applied last), as every replica sees it: they must agree.
async fn consumed(cluster: &LedgerCluster) -> u64 {
    static AT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let at = *AT.get_or_init(|| {
        use allot_allocator::raft::NodeClock;
        allot_allocator::raft::SystemNodeClock.now_ms() + 60_000
    });
    let mut seen = Vec::new();
    for &id in cluster.daemons.keys() {
        let k = allot_allocator::ledger::PolicyKey {
            domain: "central".into(),
            entries: vec![("tenant".into(), "acme".into())],
        };
        let left = cluster
            .ledger(id, |l| l.status(&k, at).expect("status").bucket_tokens)
            .await;
        seen.push(CENTRAL_BURST - left);
    }
    assert!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "replicas disagree: {seen:?}"
    );
    seen[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_and_decide_through_a_follower_answer_every_item_in_order() {
    let _exclusive = exclusive().await;
    let mut cluster = LedgerCluster::start(&[1, 2, 3]).await;
    let follower = cluster.follower().await;
    install(&cluster, follower).await;
    let mut f = cluster.client(follower);

    // A unary Decide on a follower is forwarded; a retry gets the same answer, charged once.
    let d = f
        .decide(decide("gw1", 3 * T, "u1"))
        .await
        .expect("decide")
        .into_inner();
    assert!(d.allowed && !d.never && d.policy_version == 1, "{d:?}");
    assert_eq!(d.remaining, CENTRAL_BURST - 3 * T);
    let again = f
        .decide(decide("gw1", 3 * T, "u1"))
        .await
        .expect("retry")
        .into_inner();
    assert_eq!(again, d);

    let acquire = pb::AcquireRequest {
        key: Some(key("central", "acme")),
        region: "eu-west".into(),
        holder: "gw1".into(),
        want: 5 * T,
        demand_per_s: 0,
        want_rate_per_s: 0,
        request_id: "a1".into(),
    };
    let no_key = pb::DecideRequest {
        key: None,
        ..decide("gw1", T, "nk")
    };
    let items = vec![
        item(Op::Acquire(acquire)),
        item(Op::Decide(decide("gw1", 2 * T, "d1"))),
        item(Op::Report(pb::ReportRequest {
            incarnation: 0,
            allocation_id: 999,
            epoch: 1,
            cumulative_spend: T,
            holder: "gw1".into(),
        })),
        pb::BatchItem { op: None },
        item(Op::Decide(no_key)),
        item(Op::Decide(decide("gw1", 2 * CENTRAL_BURST, "big"))),
        item(Op::Decide(decide("gw1", 0, "zero"))),
    ];
    let r = f
        .batch(pb::BatchRequest { items })
        .await
        .expect("batch through a follower")
        .into_inner()
        .results;
    assert_eq!(r.len(), 7);
    let g = match &r[0].outcome {
        Some(Outcome::Acquire(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Grant(g)),
        })) => *g,
        other => panic!("expected a grant, got {other:?}"),
    };
    assert_eq!(g.granted, 5 * T);
    // Items apply in order: the decision sees the grant's debit (and a little refill).
    let left = decided(&r[1]).remaining;
    let want = CENTRAL_BURST - 10 * T;
    assert!(left >= want && left - want < REFILL_SLACK, "{left}");
    assert_eq!(reason(error(&r[2])), pb::ErrorReason::UnknownAllocation);
    assert_eq!(
        (reason(error(&r[3])), error(&r[3]).field.as_str()),
        (pb::ErrorReason::BadInput, "op")
    );
    assert_eq!(
        (reason(error(&r[4])), error(&r[4]).field.as_str()),
        (pb::ErrorReason::BadInput, "key")
    );
    let big = decided(&r[5]);
    assert!(
        !big.allowed && big.never && big.retry_after_ms == 0,
        "{big:?}"
    );
    assert_eq!(reason(error(&r[6])), pb::ErrorReason::BadInput);

    let report = |epoch: u64, spend: u64| {
        item(Op::Report(pb::ReportRequest {
            incarnation: 0,
            allocation_id: g.allocation_id,
            epoch,
            cumulative_spend: spend,
            holder: "gw1".into(),
        }))
    };
    let release = item(Op::Release(pb::ReleaseRequest {
        incarnation: 0,
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        final_spend: 3 * T,
        holder: "gw1".into(),
    }));
    let items = vec![
        report(g.epoch, 2 * T),
        release,
        report(g.epoch + 1, 4 * T),
        report(g.epoch, 4 * T),
    ];
    let r = f
        .batch(pb::BatchRequest { items })
        .await
        .expect("batch")
        .into_inner()
        .results;
    assert!(
        matches!(&r[0].outcome, Some(Outcome::Report(x)) if x.recorded_spend == 2 * T),
        "{r:?}"
    );
    assert!(
        matches!(&r[1].outcome, Some(Outcome::Release(x)) if x.returned == 2 * T),
        "{r:?}"
    );
    assert_eq!(reason(error(&r[2])), pb::ErrorReason::StaleEpoch);
    let ended = error(&r[3]);
    assert_eq!(
        (reason(ended), ended.ended.as_str()),
        (pb::ErrorReason::AllocationEnded, "released")
    );
    // 3 + 2 decided, 3 spent of the grant (2 returned): every replica agrees.
    let spent = consumed(&cluster).await;
    assert!(spent <= 8 * T && 8 * T - spent < REFILL_SLACK, "{spent}");
    cluster.stop_all().await;
}

/// What one batching client saw: the final answer to every request id.
type Answers = BTreeMap<String, pb::DecideResponse>;

/// Sends batches of 8 decisions of one token until `stop`, each retried with the same request
/// ids (on the hinted leader or the next node) until it has an answer.
async fn batch_client(
    n: usize,
    addrs: Vec<String>,
    stop: Arc<AtomicBool>,
    calls: Arc<AtomicU64>,
) -> Answers {
    let clients: Vec<_> = addrs.iter().map(|a| client_of(a)).collect();
    let mut target = n % clients.len();
    let mut answers = Answers::new();
    let mut seq = 0;
    while !stop.load(Ordering::Acquire) {
        seq += 1;
        let ids: Vec<String> = (0..8).map(|i| format!("c{n}-{seq}-{i}")).collect();
        let items: Vec<_> = ids
            .iter()
            .map(|id| item(Op::Decide(decide(&format!("gw{n}"), T, id))))
            .collect();
        let deadline = tokio::time::Instant::now() + WAIT;
        let results = loop {
            let r = clients[target]
                .clone()
                .batch(pb::BatchRequest {
                    items: items.clone(),
                })
                .await;
            match r {
                Ok(r) => break r.into_inner().results,
                // INTERNAL also covers an HTTP/2 stream torn down with the stopped leader.
                Err(s)
                    if (retryable(&s) || s.code() == Code::Internal)
                        && tokio::time::Instant::now() < deadline =>
                {
                    let hinted = leader_hint(&s)
                        .and_then(|h| addrs.iter().position(|a| *a == h.leader_addr))
                        .filter(|&i| i != target);
                    target = hinted.unwrap_or((target + 1) % clients.len());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(s) => panic!("batch failed: {s:?}"),
            }
        };
        for (id, r) in ids.into_iter().zip(&results) {
            answers.insert(id, decided(r).clone());
        }
        calls.fetch_add(1, Ordering::AcqRel);
    }
    answers
}

async fn wait_for_calls(calls: &AtomicU64, at_least: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while calls.load(Ordering::Acquire) < at_least {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the clients made too few calls"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_change_under_batches_loses_and_duplicates_no_decision() {
    let _exclusive = exclusive().await;
    let mut cluster = LedgerCluster::start(&[1, 2, 3]).await;
    let leader = cluster.leader().await;
    install(&cluster, leader).await;
    let addrs: Vec<String> = cluster.addrs.values().cloned().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|n| tokio::spawn(batch_client(n, addrs.clone(), stop.clone(), calls.clone())))
        .collect();
    wait_for_calls(&calls, 40).await;
    // The leader stops with batches queued and in flight.
    cluster.stop(leader).await;
    let after = calls.load(Ordering::Acquire);
    wait_for_calls(&calls, after + 40).await;
    stop.store(true, Ordering::Release);
    let mut answers = Answers::new();
    for t in tasks {
        answers.extend(t.await.expect("client task"));
    }
    assert!(
        answers.values().all(|d| d.allowed),
        "the bucket never runs dry here"
    );
    let admitted = answers.len() as u64 * T;
    let lost = consumed(&cluster).await;
    // Each answered decision was applied exactly once: neither lost (less consumed) nor
    // duplicated (more consumed); a little refill blurs the figure.
    assert!(
        lost <= admitted,
        "duplicated: {lost} consumed for {admitted} admitted"
    );
    assert!(
        admitted - lost < REFILL_SLACK,
        "lost: {lost} consumed for {admitted} admitted"
    );

    // Asking every id again on the new leader: the same answers, charged nothing more.
    let new_leader = cluster.leader().await;
    let mut c = cluster.client(new_leader);
    let all: Vec<(&String, &pb::DecideResponse)> = answers.iter().collect();
    for chunk in all.chunks(500) {
        let items = chunk
            .iter()
            .map(|(id, _)| {
                let n = id[1..].split('-').next().expect("client number");
                item(Op::Decide(decide(&format!("gw{n}"), T, id)))
            })
            .collect();
        let r = c
            .batch(pb::BatchRequest { items })
            .await
            .expect("retry batch")
            .into_inner();
        for ((id, first), again) in chunk.iter().zip(&r.results) {
            assert_eq!(decided(again), *first, "retry of {id} answered differently");
        }
    }
    assert!(
        consumed(&cluster).await <= lost,
        "retries were charged again"
    );
    cluster.stop_all().await;
}

/// The ErrorDetail in a failed call's status details.
fn status_detail(s: &Status) -> pb::ErrorDetail {
    allot_proto::error_detail::of(s).expect("an ErrorDetail in the details")
}

/// A 3-node cluster grouping with `commit`, the central policy installed: the cluster, its
/// leader and the leader's commit queue.
async fn with_policy_and_queue(
    commit: GroupCommitConfig,
) -> (LedgerCluster, u64, GroupCommit<Ledger>) {
    let cluster = LedgerCluster::start_with(&[1, 2, 3], commit).await;
    let leader = cluster.leader().await;
    install(&cluster, leader).await;
    let queue = cluster.daemons[&leader]
        .group_commit()
        .expect("grouped")
        .clone();
    (cluster, leader, queue)
}

/// Waits until `queue` holds exactly `n` commands.
async fn queued_is(queue: &GroupCommit<Ledger>, n: usize) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while queue.queued() != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue never held {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_and_passed_deadlines_are_refused_unapplied() {
    let _exclusive = exclusive().await;
    let commit = GroupCommitConfig {
        queue_items: 1,
        max_in_flight: 1,
        ..GroupCommitConfig::default()
    };
    let (mut cluster, leader, queue) = with_policy_and_queue(commit).await;
    let c = cluster.client(leader);
    let queued_is = |n: usize| queued_is(&queue, n);

    // The flush is held and the one-command queue holds a decision: the next ones are refused.
    let hold = queue.hold();
    let mut a = c.clone();
    let first = tokio::spawn(async move { a.decide(decide("gw1", T, "a")).await });
    queued_is(1).await;
    let s = c
        .clone()
        .decide(decide("gw1", T, "b"))
        .await
        .expect_err("overloaded");
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(reason(&status_detail(&s)), pb::ErrorReason::Overloaded);
    let items = vec![
        item(Op::Decide(decide("gw1", T, "c1"))),
        item(Op::Decide(decide("gw1", T, "c2"))),
    ];
    let r = c
        .clone()
        .batch(pb::BatchRequest { items })
        .await
        .expect("batch")
        .into_inner();
    assert!(
        r.results
            .iter()
            .all(|x| reason(error(x)) == pb::ErrorReason::Overloaded),
        "{r:?}"
    );
    drop(hold);
    let d = first
        .await
        .expect("task")
        .expect("the queued decision commits")
        .into_inner();
    assert!(d.allowed);
    let once = consumed(&cluster).await;
    assert!(
        T - once < REFILL_SLACK,
        "only the queued decision was applied: {once}"
    );

    // A decision whose caller's deadline passes while the flush is held is dropped unapplied.
    let hold = queue.hold();
    let mut late = Request::new(decide("gw1", 5 * T, "late"));
    late.set_timeout(Duration::from_millis(200));
    let s = c
        .clone()
        .decide(late)
        .await
        .expect_err("the deadline passes");
    assert!(
        matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{s:?}"
    );
    // The server counts the 200 ms from when it received the call, which is before the client
    // saw its error: 200 ms after that error the server's deadline has certainly passed too.
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(hold);
    // The flusher drops the late call (the one-command queue is free again), then a decision
    // after it commits: the ledger read below sees everything the late call could have done.
    queued_is(0).await;
    let d = c
        .clone()
        .decide(decide("gw1", T, "after"))
        .await
        .expect("decide")
        .into_inner();
    assert!(d.allowed);
    let twice = consumed(&cluster).await;
    assert!(
        twice <= 2 * T && 2 * T - twice < REFILL_SLACK,
        "the late decision was not applied: {twice}"
    );
    cluster.stop_all().await;
}

/// Load shedding (issue 9 item 3): while the leader's commit queue is nearly full, every write
/// of the data plane (a Batch as a whole, a unary call, one forwarded by a follower) is refused
/// RESOURCE_EXHAUSTED with an ErrorDetail OVERLOADED before its body is decoded, and nothing of
/// it is applied; the follower then sheds the next write itself; reads go through, and the
/// queued calls commit once the flush resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nearly_full_queue_sheds_writes_whole_and_unapplied() {
    let _exclusive = exclusive().await;
    // Shed above 8 - min(2, 8 / 4) = 6 queued commands; a follower told so by the leader sheds
    // for longer than the test, so that what it does next does not depend on the machine's
    // speed (the default hold is 20 ms).
    let commit = GroupCommitConfig {
        queue_items: 8,
        max_entry_items: 2,
        max_in_flight: 1,
        follower_shed_hold: Duration::from_secs(600),
        ..GroupCommitConfig::default()
    };
    let (mut cluster, leader, queue) = with_policy_and_queue(commit).await;
    let c = cluster.client(leader);
    // One decision first, so that the key has a state to read and to compare with.
    let first = c
        .clone()
        .decide(decide("gw1", T, "first"))
        .await
        .expect("decide")
        .into_inner();
    assert!(first.allowed);
    let before = consumed(&cluster).await;

    // The flush is held and a Batch of 7 decisions waits in the queue: one above the threshold.
    let hold = queue.hold();
    let items: Vec<_> = (0..7)
        .map(|i| item(Op::Decide(decide("gw1", T, &format!("q{i}")))))
        .collect();
    let mut a = c.clone();
    let queued = tokio::spawn(async move { a.batch(pb::BatchRequest { items }).await });
    queued_is(&queue, 7).await;
    assert_eq!(queue.shed(), 0, "nothing shed below the threshold");

    let shed = |s: Status| {
        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        let d = status_detail(&s);
        assert_eq!(reason(&d), pb::ErrorReason::Overloaded, "{d:?}");
        assert!(d.message.contains("shedding"), "{d:?}");
    };
    let items = vec![
        item(Op::Decide(decide("gw1", T, "s1"))),
        item(Op::Decide(decide("gw1", T, "s2"))),
    ];
    shed(
        c.clone()
            .batch(pb::BatchRequest { items })
            .await
            .expect_err("a Batch is shed as a whole"),
    );
    shed(
        c.clone()
            .decide(decide("gw1", T, "s3"))
            .await
            .expect_err("a unary write is shed"),
    );
    let follower = *cluster
        .daemons
        .keys()
        .find(|&&id| id != leader)
        .expect("a follower");
    shed(
        cluster
            .client(follower)
            .decide(decide("gw1", T, "s4"))
            .await
            .expect_err("a forwarded write is shed by the leader"),
    );
    assert_eq!(queue.shed(), 3);
    // The follower, told so by the leader, sheds the next write itself, without forwarding it.
    let follower_queue = cluster.daemons[&follower]
        .group_commit()
        .expect("grouped")
        .clone();
    assert_eq!(follower_queue.shed(), 0);
    shed(
        cluster
            .client(follower)
            .decide(decide("gw1", T, "s5"))
            .await
            .expect_err("shed by the follower"),
    );
    assert_eq!(follower_queue.shed(), 1, "shed by the follower itself");
    assert_eq!(queue.shed(), 3, "not forwarded to the leader");
    // A call another node forwarded is not shed for the leader's refusal: this follower answers
    // where the leader is, as it would without the hold.
    let mut forwarded = Request::new(decide("gw1", T, "s6"));
    forwarded.metadata_mut().insert(
        allot_allocator::service::FORWARDED_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    let s = cluster
        .client(follower)
        .decide(forwarded)
        .await
        .expect_err("a follower does not forward twice");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert_eq!(reason(&status_detail(&s)), pb::ErrorReason::NotLeader);
    assert_eq!(follower_queue.shed(), 1, "not shed for the hold");
    assert_eq!(queue.queued(), 7, "shed calls never entered the queue");
    // A read is not shed.
    c.clone()
        .status(pb::StatusRequest {
            key: Some(key("central", "acme")),
        })
        .await
        .expect("a status read goes through while writes are shed");

    drop(hold);
    let r = queued
        .await
        .expect("task")
        .expect("the queued batch commits")
        .into_inner();
    assert_eq!(r.results.len(), 7);
    assert!(r.results.iter().all(|x| decided(x).allowed), "{r:?}");
    let after = consumed(&cluster).await;
    assert!(
        after - before <= 7 * T && 7 * T - (after - before) < REFILL_SLACK,
        "only the 7 queued decisions were applied: {}",
        after - before
    );
    // The queue drained below the threshold: writes go through again.
    let d = c
        .clone()
        .decide(decide("gw1", T, "after"))
        .await
        .expect("a write after the backlog drained")
        .into_inner();
    assert!(d.allowed);
    cluster.stop_all().await;
}
