//! Follower forwarding and leader hints, and bad input: each gets its precise gRPC code, and
//! nothing in the ledger changes.

use allot_allocator::ledger::Allocation;
use allot_proto::allot::v1 as pb;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request};

use allot_allocator::service::FORWARDED_HEADER;

use crate::ledger_support::{
    acquire, exclusive, grant, key, leader_hint, LedgerCluster, API_POLICY, REGIONAL_POLICY,
};

const T: u64 = 1_000_000;

fn forwarded<T>(body: T) -> Request<T> {
    let mut r = Request::new(body);
    r.metadata_mut()
        .insert(FORWARDED_HEADER, MetadataValue::from_static("1"));
    r
}

/// What bad input must not change.
#[derive(Debug, PartialEq)]
struct Observed {
    allocations: Vec<Allocation>,
    api_version: u64,
    regional_version: u64,
    api_yaml: Option<String>,
    keys: usize,
}

async fn observe(cluster: &LedgerCluster, id: u64) -> Observed {
    cluster
        .ledger(id, |l| Observed {
            allocations: l.allocations().cloned().collect(),
            api_version: l.policy_version("api"),
            regional_version: l.policy_version("regional"),
            api_yaml: l.policy_yaml("api").map(str::to_string),
            keys: l.key_count(),
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_forwards_hints_and_bad_input_changes_nothing() {
    let _exclusive = exclusive().await;
    let mut cluster = LedgerCluster::start(&[1, 2, 3]).await;
    let leader = cluster.leader().await;
    let follower = cluster.follower().await;
    let mut f = cluster.client(follower);

    // Writes and reads sent to a follower are forwarded to the leader. Leases outlive the test,
    // so that time alone changes nothing in what is compared below.
    let api_policy = API_POLICY.replace("ttl_ms: 1000", "ttl_ms: 600000");
    for (yaml, domain) in [(api_policy.as_str(), "api"), (REGIONAL_POLICY, "regional")] {
        let put = f
            .put_policy(pb::PutPolicyRequest {
                yaml: yaml.into(),
                expected_version: 0,
                request_id: String::new(),
            })
            .await
            .expect("forwarded put")
            .into_inner();
        assert_eq!((put.policy.as_str(), put.version), (domain, 1));
    }
    let g = grant(
        f.acquire(acquire("acme", "gw-1", 4 * T, "r1"))
            .await
            .expect("forwarded acquire")
            .into_inner(),
    );
    assert_eq!((g.granted, g.epoch), (4 * T, 1));
    let st = f
        .status(pb::StatusRequest {
            key: Some(key("api", "acme")),
        })
        .await
        .expect("forwarded status")
        .into_inner();
    assert_eq!(st.policy_version, 1);
    assert_eq!(st.regions.len(), 1);
    assert_eq!(
        (st.regions[0].live_allocations, st.regions[0].granted),
        (1, 4 * T)
    );
    assert_eq!(st.regions[0].overshoot_bound, 4 * T);
    let cs = f
        .cluster_status(pb::ClusterStatusRequest {})
        .await
        .expect("cluster status")
        .into_inner();
    assert_eq!(cs.node_id, follower);
    assert_eq!(cs.leader_id, Some(leader));
    assert_eq!(cs.leader_addr, cluster.addrs[&leader]);
    assert_eq!(cs.voters.len(), 3);

    // A call already forwarded once is refused by a follower, naming the leader's address.
    let before = observe(&cluster, leader).await;
    let s = f
        .acquire(forwarded(acquire("acme", "gw-1", 4 * T, "r2")))
        .await
        .expect_err("not forwarded twice");
    let hint = leader_hint(&s).expect("a leader hint in the details");
    assert_eq!(hint.leader_id, Some(leader));
    assert_eq!(hint.leader_addr, cluster.addrs[&leader]);
    let s = f
        .status(forwarded(pb::StatusRequest {
            key: Some(key("api", "acme")),
        }))
        .await
        .expect_err("not forwarded twice");
    assert_eq!(
        leader_hint(&s).map(|h| h.leader_addr),
        Some(cluster.addrs[&leader].clone())
    );
    assert_eq!(observe(&cluster, leader).await, before);

    // Bad input, through the follower and directly to the leader: precise codes, no change.
    let mut l = cluster.client(leader);
    for c in [&mut f, &mut l] {
        let code = |r: Result<tonic::Response<pb::AcquireResponse>, tonic::Status>| {
            r.expect_err("refused").code()
        };
        assert_eq!(
            code(c.acquire(acquire("acme", "gw-1", 0, "w0")).await),
            Code::InvalidArgument,
            "want 0"
        );
        let mut unknown_domain = acquire("acme", "gw-1", T, "d0");
        unknown_domain.key = Some(key("nope", "acme"));
        assert_eq!(code(c.acquire(unknown_domain).await), Code::NotFound);
        let mut unknown_region = acquire("acme", "gw-1", T, "g0");
        unknown_region.key = Some(key("regional", "acme"));
        unknown_region.region = "mars".into();
        assert_eq!(code(c.acquire(unknown_region).await), Code::NotFound);
        let mut no_key = acquire("acme", "gw-1", T, "k0");
        no_key.key = None;
        assert_eq!(code(c.acquire(no_key).await), Code::InvalidArgument);
        let mut no_entries = acquire("acme", "gw-1", T, "k1");
        no_entries.key = Some(pb::PolicyKey {
            domain: "api".into(),
            entries: vec![],
        });
        assert_eq!(code(c.acquire(no_entries).await), Code::InvalidArgument);
        let mut empty_holder = acquire("acme", "", T, "h0");
        empty_holder.holder = String::new();
        assert_eq!(code(c.acquire(empty_holder).await), Code::InvalidArgument);

        let put = |yaml: &str, expected_version| pb::PutPolicyRequest {
            yaml: yaml.into(),
            expected_version,
            request_id: String::new(),
        };
        let s = c
            .put_policy(put("domain: [", 0))
            .await
            .expect_err("bad yaml");
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        let sliding = API_POLICY.replace(
            "      name: api-tenant",
            "      name: api-tenant\n      algorithm: sliding_window",
        );
        let s = c
            .put_policy(put(&sliding, 1))
            .await
            .expect_err("global sliding");
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        let s = c
            .put_policy(put(&api_policy, 7))
            .await
            .expect_err("stale version");
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");

        let s = c
            .report(pb::ReportRequest {
                incarnation: 0,
                allocation_id: 999_999,
                epoch: 1,
                cumulative_spend: 1,
                holder: "gw-1".into(),
            })
            .await
            .expect_err("unknown allocation");
        assert_eq!(s.code(), Code::NotFound, "{s:?}");
        let s = c
            .release(pb::ReleaseRequest {
                incarnation: 0,
                allocation_id: g.allocation_id,
                epoch: g.epoch + 1,
                final_spend: 0,
                holder: "gw-1".into(),
            })
            .await
            .expect_err("stale release");
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");

        let share = |region: &str, ppm| pb::RegionShare {
            region: region.into(),
            share: Some(pb::region_share::Share::FractionPpm(ppm)),
        };
        let shares = |policy: &str, shares, config_version| pb::SetSharesRequest {
            policy: policy.into(),
            shares,
            config_version,
            request_id: String::new(),
        };
        let s = c
            .set_shares(shares(
                "regional-tenant",
                vec![share("eu-west", 900_000)],
                5,
            ))
            .await
            .expect_err("more than 100%");
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        let s = c
            .set_shares(shares("nope", vec![share("eu-west", 1)], 5))
            .await
            .expect_err("unknown policy");
        assert_eq!(s.code(), Code::NotFound, "{s:?}");
        let s = c
            .set_shares(shares(
                "regional-tenant",
                vec![pb::RegionShare {
                    region: "eu-west".into(),
                    share: None,
                }],
                5,
            ))
            .await
            .expect_err("missing share");
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        let s = c
            .status(pb::StatusRequest {
                key: Some(key("api", "never-seen")),
            })
            .await
            .expect_err("no state");
        assert_eq!(s.code(), Code::NotFound, "{s:?}");
    }
    assert_eq!(observe(&cluster, leader).await, before);
    for id in [1, 2, 3] {
        assert_eq!(observe(&cluster, id).await, before, "node {id}");
    }

    cluster.stop_all().await;
}
