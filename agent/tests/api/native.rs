//! The native `allot.v1.Agent` service: Check decisions, Reserve/Settle idempotency and expiry,
//! concurrency slots with Done, Settle and expiry.

use crate::support::*;
use allot_agent::api::native::NativeService;
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::agent_client::AgentClient;
use allot_proto::allot::v1::agent_server::Agent;
use tonic::Request;

async fn check(
    svc: &NativeService,
    descs: Vec<pb::RequestDescriptor>,
    cost: u64,
    id: &str,
) -> pb::Decision {
    try_check(svc, descs, cost, id).await.unwrap()
}

async fn try_check(
    svc: &NativeService,
    descs: Vec<pb::RequestDescriptor>,
    cost: u64,
    id: &str,
) -> Result<pb::Decision, tonic::Status> {
    svc.check(Request::new(pb::CheckRequest {
        domain: "edge".into(),
        descriptors: descs,
        cost,
        request_id: id.into(),
    }))
    .await
    .map(|r| r.into_inner().decision.unwrap())
}

async fn reserve(
    svc: &NativeService,
    max: u64,
    id: &str,
    ttl_ms: u64,
) -> Result<pb::ReserveResponse, tonic::Status> {
    svc.reserve(Request::new(pb::ReserveRequest {
        domain: "edge".into(),
        descriptors: vec![desc(&[("tokens", "t")], None)],
        max_cost: max,
        request_id: id.into(),
        ttl_ms,
    }))
    .await
    .map(|r| r.into_inner())
}

async fn settle(
    svc: &NativeService,
    id: &str,
    actual: u64,
) -> Result<pb::SettleResponse, tonic::Status> {
    svc.settle(Request::new(pb::SettleRequest {
        reservation_id: id.into(),
        actual_cost: actual,
    }))
    .await
    .map(|r| r.into_inner())
}

async fn done(svc: &NativeService, id: &str) -> u64 {
    svc.done(Request::new(pb::DoneRequest {
        request_id: id.into(),
    }))
    .await
    .unwrap()
    .into_inner()
    .released_slots
}

/// Tokens left of `tokens=t`, by a check that spends nothing.
async fn tokens_left(svc: &NativeService) -> u64 {
    check(svc, vec![desc(&[("tokens", "t")], Some(0))], 0, "")
        .await
        .remaining
        .unwrap()
}

const OK: i32 = pb::DecisionCode::Ok as i32;
const OVER: i32 = pb::DecisionCode::OverLimit as i32;

#[tokio::test]
async fn check_answers_reason_policy_version_remaining_and_retry() {
    let r = rig(LOCAL);
    let svc = NativeService::new(r.decider.clone());
    for left in [2, 1, 0] {
        let d = check(&svc, vec![desc(&[("client", "c")], None)], 0, "").await;
        assert_eq!((d.code, d.remaining), (OK, Some(left)));
        assert_eq!(d.reason, pb::DecisionReason::WithinLimit as i32);
        assert_eq!((d.policy.as_str(), d.policy_version), ("per-client", 1));
        assert_eq!(d.retry_after_ms, None);
    }
    let d = check(
        &svc,
        vec![
            desc(&[("client", "c")], None),
            desc(&[("tokens", "t")], None),
        ],
        0,
        "",
    )
    .await;
    assert_eq!(d.code, OVER);
    assert_eq!(d.reason, pb::DecisionReason::OverLimit as i32);
    assert_eq!(d.policy, "per-client");
    assert_eq!(d.retry_after_ms, Some(20_000));
    assert_eq!(d.reset_after_ms, 60_000);
    let t = &d.descriptors[1];
    assert_eq!(
        (t.code, t.reason),
        (OK, pb::DecisionReason::OtherDescriptor as i32)
    );
    assert_eq!(
        (t.remaining, t.requests_per_unit, t.unit.as_str()),
        (Some(100), 100, "MINUTE")
    );
    assert_eq!(
        tokens_left(&svc).await,
        100,
        "all-or-nothing: the denial spent nothing"
    );
}

#[tokio::test]
async fn reservations_settle_idempotently_and_refund_the_unused_cost() {
    let r = rig(LOCAL);
    let svc = NativeService::new(r.decider.clone());
    let res = reserve(&svc, 10, "job-1", 0).await.unwrap();
    assert_eq!(res.reservation_id, "job-1");
    assert_eq!(res.expires_in_ms, 30_000);
    assert_eq!(res.decision.as_ref().unwrap().remaining, Some(90));
    // A repeated Reserve answers the same and spends nothing more.
    let again = reserve(&svc, 10, "job-1", 0).await.unwrap();
    assert_eq!(
        (again.reservation_id.as_str(), again.decision),
        ("job-1", res.decision)
    );
    assert_eq!(tokens_left(&svc).await, 90);

    let s = settle(&svc, "job-1", 3).await.unwrap();
    assert_eq!(
        (s.refunded, s.already_settled, s.actual_cost),
        (7, false, 3)
    );
    assert_eq!(tokens_left(&svc).await, 97);
    let s = settle(&svc, "job-1", 1).await.unwrap();
    assert_eq!((s.refunded, s.already_settled, s.actual_cost), (7, true, 3));
    assert_eq!(
        tokens_left(&svc).await,
        97,
        "a repeated settle refunds nothing"
    );

    // Settling above the maximum charges the maximum.
    reserve(&svc, 5, "job-2", 0).await.unwrap();
    let s = settle(&svc, "job-2", 50).await.unwrap();
    assert_eq!(s.refunded, 0);
    assert_eq!(tokens_left(&svc).await, 92);

    let e = settle(&svc, "nobody", 1).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn a_refund_never_lifts_a_bucket_above_capacity() {
    let r = rig(LOCAL);
    let svc = NativeService::new(r.decider.clone());
    reserve(&svc, 40, "big", 120_000).await.unwrap();
    assert_eq!(tokens_left(&svc).await, 60);
    // A minute later the bucket is full again; the refund of 40 finds no room.
    r.clock.advance(60 * S);
    assert_eq!(tokens_left(&svc).await, 100);
    let s = settle(&svc, "big", 0).await.unwrap();
    assert_eq!(s.refunded, 40);
    assert_eq!(tokens_left(&svc).await, 100);
    let d = check(&svc, vec![desc(&[("tokens", "t")], Some(100))], 0, "").await;
    assert_eq!((d.code, d.remaining), (OK, Some(0)));
    let d = check(&svc, vec![desc(&[("tokens", "t")], Some(1))], 0, "").await;
    assert_eq!(d.code, OVER, "no token beyond capacity was created");
}

#[tokio::test]
async fn abandoned_reservations_expire_and_their_cost_stays_spent() {
    let r = rig(LOCAL);
    let svc = NativeService::new(r.decider.clone());
    let res = reserve(&svc, 30, "lost", 1_000).await.unwrap();
    assert_eq!(res.expires_in_ms, 1_000);
    r.clock.advance(1_001 * MS);
    r.decider.sweep();
    let e = settle(&svc, "lost", 0).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().contains("expired"), "{}", e.message());
    // 1 s of refill at 100/min is 1.67 tokens: 70 + 1 (floor) — the 30 were not refunded.
    assert_eq!(tokens_left(&svc).await, 71);
    let e = reserve(&svc, 30, "lost", 1_000).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    // Without a sweep, a late Settle finds it expired just the same.
    reserve(&svc, 10, "late", 500).await.unwrap();
    r.clock.advance(600 * MS);
    assert_eq!(
        settle(&svc, "late", 0).await.unwrap_err().code(),
        tonic::Code::FailedPrecondition
    );
}

#[tokio::test]
async fn concurrency_slots_are_taken_denied_and_released() {
    let r = rig(LOCAL);
    let svc = NativeService::new(r.decider.clone());
    let slow = || vec![desc(&[("path", "/slow")], None)];
    let d = check(&svc, slow(), 0, "a").await;
    assert_eq!((d.code, d.descriptors[0].max_in_flight), (OK, Some(2)));
    assert_eq!(check(&svc, slow(), 0, "b").await.code, OK);
    let d = check(&svc, slow(), 0, "c").await;
    assert_eq!(d.code, OVER);
    assert_eq!(d.reason, pb::DecisionReason::ConcurrencyLimit as i32);
    assert_eq!(d.policy, "slow-path");
    assert_eq!(d.retry_after_ms, Some(100), "the retry floor");
    // The denied request's rate cost was refunded: 2 spent of 100.
    assert_eq!(d.descriptors[0].remaining, Some(98));
    // Without an id a capped key is only checked: denied now, and it holds nothing.
    assert_eq!(check(&svc, slow(), 0, "").await.code, OVER);

    assert_eq!(done(&svc, "a").await, 1);
    assert_eq!(done(&svc, "a").await, 0, "Done is idempotent");
    assert_eq!(check(&svc, slow(), 0, "").await.code, OK);
    assert_eq!(check(&svc, slow(), 0, "c").await.code, OK);
    assert_eq!(check(&svc, slow(), 0, "d").await.code, OVER);

    // A reservation holds a slot until it is settled.
    done(&svc, "b").await;
    let res = svc
        .reserve(Request::new(pb::ReserveRequest {
            domain: "edge".into(),
            descriptors: slow(),
            max_cost: 1,
            request_id: "r".into(),
            ttl_ms: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(res.decision.unwrap().code, OK);
    assert_eq!(check(&svc, slow(), 0, "e").await.code, OVER);
    settle(&svc, "r", 1).await.unwrap();
    assert_eq!(check(&svc, slow(), 0, "e").await.code, OK);

    // Forgotten requests ("c", "e") give their slots back after the slot timeout (5 s here).
    assert_eq!(check(&svc, slow(), 0, "f").await.code, OVER);
    r.clock.advance(5_001 * MS);
    assert_eq!(check(&svc, slow(), 0, "f").await.code, OK);
}

#[tokio::test]
async fn invalid_input_spends_nothing() {
    let r = rig(LOCAL);
    let svc = NativeService::new(r.decider.clone());
    let e = try_check(&svc, vec![desc(&[("tokens", "t")], None)], 1 << 33, "")
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("cost is 8589934592"),
        "{}",
        e.message()
    );
    // A cost above the capacity can never pass: a denial (never an error, which a gateway may
    // let through), with the reason and no Retry-After, and nothing spent (issue 10 item 16).
    let d = check(&svc, vec![desc(&[("tokens", "t")], None)], 500, "").await;
    assert_eq!(d.code, pb::DecisionCode::OverLimit as i32);
    assert_eq!(d.reason, pb::DecisionReason::CostExceedsCapacity as i32);
    assert_eq!((d.policy.as_str(), d.retry_after_ms), ("llm-tokens", None));
    let res = reserve(&svc, 101, "x", 0).await.unwrap();
    let d = res.decision.unwrap();
    assert_eq!(d.code, pb::DecisionCode::OverLimit as i32);
    assert_eq!((res.reservation_id.as_str(), d.retry_after_ms), ("", None));
    // The refused Reserve left no trace: the same id can reserve now.
    assert_eq!(reserve(&svc, 1, "x", 0).await.unwrap().reservation_id, "x");
    assert_eq!(tokens_left(&svc).await, 99);
    let e = settle(&svc, "", 1).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn over_loopback_grpc() {
    let r = rig(LOCAL);
    let servers = Servers::start(r.decider.clone()).await;
    let mut c = AgentClient::connect(servers.grpc_url()).await.unwrap();
    let res = c
        .reserve(pb::ReserveRequest {
            domain: "edge".into(),
            descriptors: vec![desc(&[("tokens", "t")], None)],
            max_cost: 20,
            request_id: "net".into(),
            ttl_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(res.decision.unwrap().remaining, Some(80));
    let s = c
        .settle(pb::SettleRequest {
            reservation_id: "net".into(),
            actual_cost: 5,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((s.refunded, s.already_settled), (15, false));
    let d = c
        .check(pb::CheckRequest {
            domain: "edge".into(),
            descriptors: vec![desc(&[("tokens", "t")], Some(0))],
            cost: 0,
            request_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap();
    assert_eq!(d.remaining, Some(95));
}
