//! Issue 10 item 15: admin writes are idempotent by client request id across a leader change.
//! A PutPolicy / SetShares that committed, whose answer the client lost (its leader stepped
//! down), retried with the same id against another node, answers the original success instead
//! of FAILED_PRECONDITION; the same id with other content is refused precisely.

use allot_proto::allot::v1 as pb;
use tonic::Code;

use crate::ledger_support::{exclusive, LedgerCluster, API_POLICY, REGIONAL_POLICY};

fn put(yaml: &str, expected_version: u64, request_id: &str) -> pb::PutPolicyRequest {
    pb::PutPolicyRequest {
        yaml: yaml.into(),
        expected_version,
        request_id: request_id.into(),
    }
}

fn shares(eu_ppm: u32, config_version: u64, request_id: &str) -> pb::SetSharesRequest {
    let share = |region: &str, ppm| pb::RegionShare {
        region: region.into(),
        share: Some(pb::region_share::Share::FractionPpm(ppm)),
    };
    pb::SetSharesRequest {
        policy: "regional-tenant".into(),
        shares: vec![
            share("eu-west", eu_ppm),
            share("us-east", 1_000_000 - eu_ppm),
        ],
        config_version,
        request_id: request_id.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_writes_retried_after_a_leader_change_answer_their_first_success() {
    let _exclusive = exclusive().await;
    let mut cluster = LedgerCluster::start(&[1, 2, 3]).await;
    let old = cluster.leader().await;
    let mut c = cluster.client(old);
    let first = c
        .put_policy(put(API_POLICY, 0, "put-api-1"))
        .await
        .expect("put commits")
        .into_inner();
    assert_eq!((first.policy.as_str(), first.version), ("api", 1));
    c.put_policy(put(REGIONAL_POLICY, 0, "put-regional-1"))
        .await
        .expect("put commits");
    let set = c
        .set_shares(shares(600_000, 2, "shares-1"))
        .await
        .expect("shares commit")
        .into_inner();
    assert_eq!(set.config_version, 2);

    // The leader steps down before the client sees its answers: the client retries elsewhere,
    // at the new leader and at a follower (which forwards).
    cluster.stop(old).await;
    let new = cluster.leader().await;
    assert_ne!(new, old);
    let other = *cluster
        .daemons
        .keys()
        .find(|&&id| id != new)
        .expect("a follower");
    for node in [new, other] {
        let mut c = cluster.client(node);
        let again = c
            .put_policy(put(API_POLICY, 0, "put-api-1"))
            .await
            .expect("a retried put answers its first success")
            .into_inner();
        assert_eq!(again, first, "node {node}");
        let again = c
            .set_shares(shares(600_000, 2, "shares-1"))
            .await
            .expect("a retried set answers its first success")
            .into_inner();
        assert_eq!(again, set, "node {node}");
    }
    let mut c = cluster.client(new);
    // Applied once: the domain is still at version 1, so a new write with another id is
    // refused as its precondition says.
    let e = c
        .put_policy(put(API_POLICY, 0, "put-api-2"))
        .await
        .expect_err("version 0 is stale");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(cluster.ledger(new, |l| l.policy_version("api")).await, 1);
    // The same id with other content is refused with a precise error.
    let e = c
        .set_shares(shares(700_000, 2, "shares-1"))
        .await
        .expect_err("an id reused for other content");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("shares-1"), "{e:?}");
    cluster.stop_all().await;
}
