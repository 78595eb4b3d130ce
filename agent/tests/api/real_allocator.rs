//! Agents against REAL allocator nodes, all in-process: [`Daemon`]s (Raft, sled in temp dirs,
//! the `allot.v1.Allocator` API) on loopback ports, and agents built as the binary builds them
//! ([`Agent::build`] + its lease manager), deciding through the enforcer, the gateway and the
//! native gRPC API.
//!
//! - one node: decisions are local after the first Acquire; Retry-After is the allocator
//!   bucket's exact refill time; cumulative spend is reported and the final spend released;
//! - two agents in two regions share one global budget, with and without regional shares:
//!   Σ admitted = B (+ ⌊r·t⌋, which is 0 here), never more; two agents of one region spend
//!   the burst to its last whole token;
//! - three nodes: the node the agent talks to (the leader) is stopped mid-run: the agent admits
//!   exactly what its allocations still held, then `deny` (exact Retry-After) or `emergency`
//!   (exactly the reserve of its grant, inside the overshoot bound); an agent that knows every node
//!   keeps deciding through the stop and is granted by the new leader; the node restarts from
//!   its data directory and the first agent recovers;
//! - reservations settle idempotently, and the allocator gets back exactly max − actual, once.
//!
//! Where a test needs exact numbers, the allocator's clock (the time the leader stamps into
//! proposals) and the agent's clock are manual: Raft itself always runs in real time.

use crate::support::{desc, eventually, MS, S, T};
use allot_agent::api::native::decision;
use allot_agent::api::{rate_limit_headers, Decider, TrackingSettings};
use allot_agent::lease::{HeldAllocation, LeaseBook, LeaseSettings};
use allot_agent::server::{serve_grpc, Agent};
use allot_allocator::daemon::{Daemon, DaemonConfig, PolicyFile};
use allot_allocator::ledger::{AllocationState, Ledger, PolicyKey};
use allot_allocator::raft::{
    ManualNodeClock as AllocatorManualClock, NodeClock as AllocatorClock, NodeConfig, RaftTimings,
    SystemNodeClock,
};
use allot_common::clock::{Clock, ManualClock, MonotonicClock};
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request};
use allot_common::limiter::{Code, DescriptorStatus, Outcome};
use allot_common::RetryAfter;
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::agent_client::AgentClient;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Longest wait for any cluster or lease progress.
const WAIT: Duration = Duration::from_secs(15);

/// Allocator Unix time the manual allocator clocks start at, ms.
const T0_MS: u64 = 1_750_000_000_000;

// ---------------------------------------------------------------------------------------------
// Allocator nodes
// ---------------------------------------------------------------------------------------------

/// Short Raft timings: a failover within about a second.
fn timings() -> RaftTimings {
    RaftTimings {
        heartbeat_ms: 50,
        election_timeout_min_ms: 300,
        election_timeout_max_ms: 600,
        snapshot_every_logs: 500,
        stagger_snapshots: true,
        logs_kept_after_snapshot: 100,
    }
}

/// Complete allocator nodes on fixed loopback addresses; their sled directories outlive
/// restarts. `policies` are installed by the first node that leads.
struct Allocators {
    root: TempDir,
    addrs: BTreeMap<u64, String>,
    daemons: BTreeMap<u64, Daemon>,
    clock: Arc<dyn AllocatorClock>,
    policies: Vec<PolicyFile>,
}

impl Allocators {
    /// Starts `n` nodes (ids 1..=n); node 1 initialises the cluster. Returns once a leader has
    /// applied every policy.
    async fn start(n: u64, policies: &[(&str, &str)], clock: Arc<dyn AllocatorClock>) -> Self {
        let mut listeners = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for id in 1..=n {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            addrs.insert(id, l.local_addr().expect("addr").to_string());
            listeners.insert(id, l);
        }
        let mut a = Allocators {
            root: tempfile::tempdir().expect("tempdir"),
            addrs,
            daemons: BTreeMap::new(),
            clock,
            policies: policies
                .iter()
                .map(|(domain, yaml)| PolicyFile {
                    path: PathBuf::from(format!("{domain}.yaml")),
                    domain: (*domain).to_string(),
                    yaml: (*yaml).to_string(),
                })
                .collect(),
        };
        for (id, l) in listeners {
            a.spawn(id, l).await;
        }
        let leader = a.leader().await;
        let domains: Vec<String> = a.policies.iter().map(|p| p.domain.clone()).collect();
        a.until(leader, "policies installed", |l| {
            domains.iter().all(|d| l.policy_version(d) == 1)
        })
        .await;
        a
    }

    async fn spawn(&mut self, id: u64, listener: TcpListener) {
        let config = DaemonConfig {
            node: NodeConfig {
                id,
                advertise_addr: self.addrs[&id].clone(),
                data_dir: self.root.path().join(format!("node-{id}")),
                cluster_name: "agent-real-allocator".into(),
                timings: timings(),
            },
            members: self.addrs.clone(),
            // Node 1 initialises; on a restart its log is not empty and this is ignored.
            init: id == 1,
            tick_every: Duration::from_millis(50),
            policies: self.policies.clone(),
        };
        let d = Daemon::start(config, self.clock.clone(), listener)
            .await
            .expect("allocator node starts");
        self.daemons.insert(id, d);
    }

    fn addr(&self, id: u64) -> String {
        self.addrs[&id].clone()
    }

    fn all_addrs(&self) -> Vec<String> {
        self.addrs.values().cloned().collect()
    }

    /// Waits until every running node names the same running leader; returns it.
    async fn leader(&self) -> u64 {
        let deadline = Instant::now() + WAIT;
        loop {
            let seen: Vec<Option<u64>> = self
                .daemons
                .values()
                .map(|d| d.node().raft().metrics().borrow().current_leader)
                .collect();
            if let Some(Some(l)) = seen.first() {
                if self.daemons.contains_key(l) && seen.iter().all(|s| *s == Some(*l)) {
                    return *l;
                }
            }
            assert!(Instant::now() < deadline, "no agreed leader: {seen:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Reads node `id`'s applied ledger.
    fn read<R>(&self, id: u64, f: impl FnOnce(&Ledger) -> R) -> R {
        self.daemons[&id].node().state().read(f)
    }

    /// Polls node `id`'s applied ledger until `f` holds.
    async fn until(&self, id: u64, what: &str, f: impl Fn(&Ledger) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !self.read(id, &f) {
            assert!(Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops node `id` gracefully (Raft, server, flush); its data stays on disk.
    async fn stop(&mut self, id: u64) {
        let d = self.daemons.remove(&id).expect("running node");
        d.shutdown().await.expect("clean shutdown");
    }

    /// Restarts node `id` on its old address and data directory.
    async fn restart(&mut self, id: u64) {
        let l = TcpListener::bind(&self.addrs[&id]).await.expect("rebind");
        self.spawn(id, l).await;
    }

    async fn stop_all(&mut self) {
        let ids: Vec<u64> = self.daemons.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }
}

/// The ledger's key `domain`/`key`=`value`.
fn policy_key(domain: &str, key: &str, value: &str) -> PolicyKey {
    PolicyKey {
        domain: domain.into(),
        entries: vec![(key.into(), value.into())],
    }
}

// ---------------------------------------------------------------------------------------------
// Agents
// ---------------------------------------------------------------------------------------------

/// A real agent: gateway, enforcer, lease book and lease manager, as `allot-agent` runs them.
struct RealAgent {
    decider: Arc<Decider>,
    stop: watch::Sender<bool>,
    background: Option<JoinHandle<()>>,
}

impl RealAgent {
    fn start(
        policy: &str,
        id: &str,
        region: &str,
        allocators: &[String],
        clock: Arc<dyn Clock>,
        tune: impl FnOnce(&mut LeaseSettings),
    ) -> Self {
        let config = ConfigSet::from_yaml(policy, Path::new("policy.yaml")).expect("policy");
        let mut lease = LeaseSettings::new(id, region);
        lease.report_interval_ms = 50;
        lease.cold_wait_ms = 5_000;
        lease.call_timeout_ms = 1_000;
        // These tests exercise the lease path against real allocators: every key is leased
        // from first sight (central decisions are tested against the fake, `demand.rs`).
        lease.promote_tokens = 0;
        tune(&mut lease);
        let mut agent = Agent::build(
            config,
            lease,
            TrackingSettings::default(),
            allocators,
            clock,
        )
        .expect("agent builds");
        let (stop, shutdown) = watch::channel(false);
        let background = agent.spawn_background(shutdown);
        RealAgent {
            decider: agent.decider.clone(),
            stop,
            background: Some(background),
        }
    }

    fn book(&self) -> &Arc<LeaseBook> {
        self.decider.enforcer().book()
    }

    fn counter(&self, f: impl Fn(&allot_agent::lease::book::LeaseCounters) -> &AtomicU64) -> u64 {
        f(&self.book().counters).load(Ordering::SeqCst)
    }

    /// Decides one request `domain` / `key`=`value` (cost 1) through the enforcer.
    async fn decide(&self, domain: &str, key: &str, value: &str) -> Outcome {
        decide_on(&self.decider, domain, key, value).await
    }

    /// The allocations held for `domain` / rule `rule_index` / `key`=`value`.
    fn held(
        &self,
        domain: &str,
        rule_index: u32,
        key: &str,
        value: &str,
    ) -> Vec<Arc<HeldAllocation>> {
        self.book()
            .existing(domain, rule_index, &[Entry { key, value }])
            .map(|k| k.value.allocations().to_vec())
            .unwrap_or_default()
    }

    /// Stops the agent gracefully: the manager releases every allocation with its final spend.
    async fn shutdown(&mut self) {
        let _ = self.stop.send(true);
        if let Some(b) = self.background.take() {
            tokio::time::timeout(WAIT, b)
                .await
                .expect("agent stops in time")
                .expect("agent task");
        }
    }
}

impl Drop for RealAgent {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn decide_on(g: &Decider, domain: &str, key: &str, value: &str) -> Outcome {
    decide_with_statuses(g, domain, key, value).await.0
}

/// [`decide_on`], with the descriptor statuses (remaining, reset) of the answer.
async fn decide_with_statuses(
    g: &Decider,
    domain: &str,
    key: &str,
    value: &str,
) -> (Outcome, Vec<DescriptorStatus>) {
    let entries = [Entry { key, value }];
    let ds = [Descriptor {
        entries: &entries,
        hits_addend: None,
    }];
    let req = Request {
        domain,
        descriptors: &ds,
        hits_addend: None,
    };
    let mut statuses = Vec::new();
    let o = g
        .enforcer()
        .decide(&req, &mut statuses)
        .await
        .expect("valid request");
    (o, statuses)
}

/// Decides through the gateway (what RLS, native gRPC and HTTP call) and returns the verdict's
/// Retry-After in ns, the native API's `retry_after_ms` and the RLS/HTTP `retry-after` header.
async fn retry_after_everywhere(
    g: &Decider,
    domain: &str,
    key: &str,
    value: &str,
) -> (Option<u64>, Option<u64>, Option<String>) {
    let entries = [Entry { key, value }];
    let ds = [Descriptor {
        entries: &entries,
        hits_addend: None,
    }];
    let req = Request {
        domain,
        descriptors: &ds,
        hits_addend: None,
    };
    let v = g.check(&req, None).await.expect("valid request");
    let header = rate_limit_headers(&v)
        .into_iter()
        .find(|(k, _)| *k == "retry-after")
        .map(|(_, v)| v);
    (v.retry_after_ns(), decision(&v).retry_after_ms, header)
}

fn after(o: &Outcome) -> Option<u64> {
    match (o.code, o.retry_after) {
        (Code::OverLimit, RetryAfter::After(ns)) => Some(ns),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// 1. One node: local decisions, exact Retry-After, reports and releases
// ---------------------------------------------------------------------------------------------

const ONE: &str = "domain: one
descriptors:
  - key: bulk
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 100, name: one-bulk, lease: {ttl_ms: 600000, max_grant: 50, max_drift_ms: 100}}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 5, name: one-tenant, lease: {ttl_ms: 600000, max_grant: 5, max_drift_ms: 100}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_decides_locally_with_exact_retry_after() {
    let alloc_clock = AllocatorManualClock::new(T0_MS);
    let mut nodes = Allocators::start(1, &[("one", ONE)], Arc::new(alloc_clock.clone())).await;
    let clock = ManualClock::new(1_000 * S);
    let mut agent = RealAgent::start(
        ONE,
        "gw-one",
        "eu",
        &[nodes.addr(1)],
        Arc::new(clock.clone()),
        |_| {},
    );

    // 30 decisions: the first waits for one Acquire (50 tokens); the other 29 never touch the
    // network.
    for i in 0..30 {
        let o = agent.decide("one", "bulk", "a").await;
        assert_eq!(o.code, Code::Ok, "decision {i}");
    }
    assert_eq!(
        agent.counter(|c| &c.acquires),
        1,
        "one Acquire for 30 decisions"
    );
    assert_eq!(agent.counter(|c| &c.cold_waits), 1);
    assert_eq!(agent.counter(|c| &c.leased_admits), 30);
    assert_eq!(agent.counter(|c| &c.rpc_errors), 0);
    let held = agent.held("one", 0, "bulk", "a");
    assert_eq!(held.len(), 1);
    assert_eq!((held[0].granted, held[0].spent()), (50 * T, 30 * T));
    let bulk_id = held[0].id;
    // The allocator debited the grant at once and learns the cumulative spend from a report.
    let status = nodes.read(1, |l| l.status(&policy_key("one", "bulk", "a"), T0_MS));
    assert_eq!(status.expect("status").bucket_tokens, 50 * T);
    nodes
        .until(1, "spend of 30 reported", |l| {
            l.allocation(bulk_id).is_some_and(|a| a.reported == 30 * T)
        })
        .await;
    let rpcs = agent.counter(|c| &c.acquires)
        + agent.counter(|c| &c.reports)
        + agent.counter(|c| &c.releases);
    assert!(
        rpcs <= 3,
        "30 local decisions cost {rpcs} allocator RPCs (1 Acquire, 1-2 Reports)"
    );

    // Burst 5, one token a minute, grants of at most 5. The first decision takes the whole
    // burst in one grant at allocator time T0.
    assert_eq!(agent.decide("one", "tenant", "t").await.code, Code::Ok);
    // 12.345 s later (allocator time) the bucket holds 12345/60000 of a token; the next whole
    // token is 47.655 s away. Decisions 2-5 spend the grant; below the low watermark (25% of 5)
    // the agent asks for more and the allocator denies with exactly that wait.
    alloc_clock.advance(12_345);
    for i in 2..=5 {
        assert_eq!(
            agent.decide("one", "tenant", "t").await.code,
            Code::Ok,
            "decision {i}"
        );
    }
    let kl = agent
        .book()
        .existing(
            "one",
            1,
            &[Entry {
                key: "tenant",
                value: "t",
            }],
        )
        .expect("key");
    assert!(
        eventually(15, || kl.value.protocol.denied_until() > 0).await,
        "the allocator's denial never arrived"
    );
    let o = agent.decide("one", "tenant", "t").await;
    assert_eq!(o.code, Code::OverLimit);
    assert_eq!(
        after(&o),
        Some(47_655 * MS),
        "the allocator bucket's refill time"
    );
    assert_eq!(
        retry_after_everywhere(&agent.decider, "one", "tenant", "t").await,
        (Some(47_655 * MS), Some(47_655), Some("48".to_string()))
    );
    // It counts down on the agent's clock.
    clock.advance(7_655 * MS);
    assert_eq!(
        retry_after_everywhere(&agent.decider, "one", "tenant", "t").await,
        (Some(40_000 * MS), Some(40_000), Some("40".to_string()))
    );
    assert_eq!(
        agent.counter(|c| &c.acquires),
        3,
        "bulk 1, tenant 2 (the grant, the denial): a denied key does not hammer the allocator"
    );

    // Exactly at the Retry-After (both clocks), the bucket holds exactly one token: the agent
    // leases it and admits exactly one more request: 6 = B + r·t over 60 s.
    alloc_clock.advance(47_655);
    clock.advance(40_000 * MS);
    let deadline = Instant::now() + WAIT;
    loop {
        if agent.decide("one", "tenant", "t").await.code == Code::Ok {
            break;
        }
        assert!(Instant::now() < deadline, "no grant after the Retry-After");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let o = agent.decide("one", "tenant", "t").await;
    assert_eq!(o.code, Code::OverLimit, "one token a minute, and no more");
    assert!(
        eventually(15, || !kl.value.protocol.call_in_flight()
            && kl.value.protocol.denied_until() > clock.now())
        .await
    );
    // The allocator's bucket is empty again at T0 + 60 s: the next token is a minute away.
    assert_eq!(
        after(&agent.decide("one", "tenant", "t").await),
        Some(60_000 * MS)
    );
    let granted: u64 = nodes.read(1, |l| {
        l.allocations()
            .filter(|a| a.holder == "gw-one" && *a.key != *bulk_key_bytes())
            .map(|a| a.granted)
            .sum()
    });
    assert_eq!(
        granted,
        6 * T,
        "the ledger granted exactly B + r·t = 5 + 1 tokens"
    );
    // The last grant (1 token) was short of what was asked, i.e. all the bucket had: the key
    // stood denied for one token's refill (the same minute) without a fourth tenant Acquire.
    assert_eq!(
        agent.counter(|c| &c.acquires),
        4,
        "bulk 1, tenant 3 (the short grant denies without asking)"
    );
    assert_eq!(agent.counter(|c| &c.rpc_errors), 0);

    // Graceful shutdown releases the bulk allocation with its final spend of 30: 20 come back.
    agent.shutdown().await;
    nodes
        .until(1, "bulk released", |l| {
            l.allocation(bulk_id).is_some_and(|a| {
                a.state == AllocationState::Released { returned: 20 * T } && a.reported == 30 * T
            })
        })
        .await;
    // 100 − 50 granted + 1 refilled in 60 s + 20 returned.
    let status = nodes.read(1, |l| {
        l.status(&policy_key("one", "bulk", "a"), T0_MS + 60_000)
    });
    assert_eq!(status.expect("status").bucket_tokens, 71 * T);
    nodes.stop_all().await;
}

/// The ledger's canonical key bytes of `one`/bulk=a (to tell its allocations apart).
fn bulk_key_bytes() -> Vec<u8> {
    allot_common::descriptor::encode_key(&[Entry {
        key: "bulk",
        value: "a",
    }])
    .into_vec()
}

// ---------------------------------------------------------------------------------------------
// 2. Two agents in two regions share one global budget
// ---------------------------------------------------------------------------------------------

/// Burst 20 at one token a minute: within this test (t < 60 s) ⌊r·t⌋ = 0, so the contract
/// allows exactly 20 admissions in total. `team` splits it 75% / 25% between the regions.
const SHARED: &str = "domain: shared
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 20, name: shared-tenant, lease: {ttl_ms: 10000, max_grant: 4, max_drift_ms: 100}}
  - key: team
    rate_limit:
      unit: minute
      requests_per_unit: 1
      burst: 20
      name: shared-team
      lease: {ttl_ms: 10000, max_grant: 4, max_drift_ms: 100}
      regions:
        - {region: eu, share: \"75%\"}
        - {region: us, share: \"25%\"}
";

/// Hammers `domain`/`key`=`value` from `tasks` tasks until `stop`; counts admissions.
fn hammer(
    g: &Arc<Decider>,
    tasks: usize,
    domain: &'static str,
    key: &'static str,
    value: &'static str,
    stop: &Arc<AtomicBool>,
    admitted: &Arc<AtomicU64>,
) -> Vec<JoinHandle<()>> {
    (0..tasks)
        .map(|_| {
            let (g, stop, admitted) = (g.clone(), stop.clone(), admitted.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    if decide_on(&g, domain, key, value).await.code == Code::Ok {
                        admitted.fetch_add(1, Ordering::SeqCst);
                    } else {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_share_one_global_budget() {
    let mut nodes = Allocators::start(1, &[("shared", SHARED)], Arc::new(SystemNodeClock)).await;
    let real = || Arc::new(MonotonicClock::new()) as Arc<dyn Clock>;
    let tune = |s: &mut LeaseSettings| s.error_backoff_ms = 100;
    let eu = RealAgent::start(SHARED, "gw-eu", "eu", &[nodes.addr(1)], real(), tune);
    let us = RealAgent::start(SHARED, "gw-us", "us", &[nodes.addr(1)], real(), tune);
    let started = Instant::now();

    // Both agents are admitted first (each waits for its own first grant), then both hammer.
    let counts: Vec<Arc<AtomicU64>> = (0..4).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let (eu_tenant, us_tenant, eu_team, us_team) = (&counts[0], &counts[1], &counts[2], &counts[3]);
    for (a, key, n) in [
        (&eu, "tenant", eu_tenant),
        (&us, "tenant", us_tenant),
        (&eu, "team", eu_team),
        (&us, "team", us_team),
    ] {
        assert_eq!(a.decide("shared", key, "acme").await.code, Code::Ok);
        n.fetch_add(1, Ordering::SeqCst);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    tasks.extend(hammer(
        &eu.decider,
        2,
        "shared",
        "tenant",
        "acme",
        &stop,
        eu_tenant,
    ));
    tasks.extend(hammer(
        &us.decider,
        2,
        "shared",
        "tenant",
        "acme",
        &stop,
        us_tenant,
    ));
    tasks.extend(hammer(
        &eu.decider,
        1,
        "shared",
        "team",
        "acme",
        &stop,
        eu_team,
    ));
    tasks.extend(hammer(
        &us.decider,
        1,
        "shared",
        "team",
        "acme",
        &stop,
        us_team,
    ));
    let load = |c: &AtomicU64| c.load(Ordering::SeqCst);
    let done = eventually(15, || {
        load(eu_tenant) + load(us_tenant) >= 20 && load(eu_team) >= 15 && load(us_team) >= 5
    })
    .await;
    // Keep hammering a little: nothing more may pass.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("hammer task");
    }
    let t_s = started.elapsed().as_secs();
    let (a, b, c, d) = (
        load(eu_tenant),
        load(us_tenant),
        load(eu_team),
        load(us_team),
    );
    assert!(t_s < 60, "the test assumes r·t < 1 token");
    let extra = t_s / 60; // ⌊r·t⌋ at one token a minute
    assert!(
        a + b <= 20 + extra && c + d <= 20 + extra,
        "beyond B + r·t: tenant {a}+{b}, team {c}+{d}"
    );
    assert!(
        done,
        "the budget was not spent in time: tenant eu {a} us {b}, team eu {c} us {d}"
    );
    // Exactly the contract: the whole burst and nothing more, and each region its share.
    assert_eq!(a + b, 20, "tenant: eu {a} + us {b}");
    assert!(a >= 1 && b >= 1, "both regions drew from the one budget");
    assert_eq!((c, d), (15, 5), "team: 75% / 25% of 20");
    // The agents' own counts agree with what the callers saw.
    assert_eq!(eu.counter(|x| &x.leased_admits), a + c);
    assert_eq!(us.counter(|x| &x.leased_admits), b + d);
    // And the ledger granted exactly that.
    let granted = |holder: &str| {
        nodes.read(1, |l| {
            l.allocations()
                .filter(|x| x.holder == holder)
                .map(|x| x.granted)
                .sum::<u64>()
        })
    };
    assert_eq!(granted("gw-eu") + granted("gw-us"), 40 * T);
    assert_eq!(granted("gw-eu"), (a + 15) * T);
    nodes.stop_all().await;
}

// ---------------------------------------------------------------------------------------------
// 3. Three nodes: the node the agent talks to stops mid-run, then comes back
// ---------------------------------------------------------------------------------------------

/// `tenant` denies when the allocator is gone; `fleet` falls back to the emergency reserve of
/// its allocation (10% of the grant), paced by a bucket of 10% of its burst and rate.
const FAILOVER: &str = "domain: fo
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1, burst: 100, name: fo-tenant, lease: {ttl_ms: 600000, max_grant: 10, max_drift_ms: 100}}
  - key: fleet
    rate_limit: {unit: second, requests_per_unit: 10, burst: 100, failure_mode: emergency, name: fo-fleet, lease: {ttl_ms: 600000, max_grant: 10, max_drift_ms: 100}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_leader_stopped_failure_modes_then_recovery() {
    let mut nodes = Allocators::start(3, &[("fo", FAILOVER)], Arc::new(SystemNodeClock)).await;
    let leader = nodes.leader().await;
    // Agent A knows only the leader, on a manual clock (its numbers are exact); agent B, in
    // another region, knows every node and runs on the real clock.
    let clock = ManualClock::new(1_000 * S);
    let a = RealAgent::start(
        FAILOVER,
        "gw-a",
        "eu",
        &[nodes.addr(leader)],
        Arc::new(clock.clone()),
        |s| {
            s.error_backoff_ms = 500;
            s.call_timeout_ms = 500;
        },
    );
    let b = RealAgent::start(
        FAILOVER,
        "gw-b",
        "us",
        &nodes.all_addrs(),
        Arc::new(MonotonicClock::new()),
        |s| {
            s.error_backoff_ms = 100;
            s.call_timeout_ms = 500;
        },
    );
    for _ in 0..3 {
        assert_eq!(a.decide("fo", "tenant", "x").await.code, Code::Ok);
        assert_eq!(a.decide("fo", "fleet", "x").await.code, Code::Ok);
    }
    assert_eq!(b.decide("fo", "tenant", "y").await.code, Code::Ok);
    // A's spend reaches the allocator; then A is idle, so nothing changes at the stop.
    let (tenant_a, fleet_a) = (
        a.held("fo", 0, "tenant", "x"),
        a.held("fo", 1, "fleet", "x"),
    );
    assert_eq!((tenant_a.len(), fleet_a.len()), (1, 1));
    assert!(
        eventually(15, || tenant_a[0].reported() == 3 * T
            && fleet_a[0].reported() == 3 * T)
        .await,
        "spend never reported"
    );

    // B keeps deciding (50 a second) through the stop and the election.
    let b_stop = Arc::new(AtomicBool::new(false));
    let b_admitted = Arc::new(AtomicU64::new(1));
    let b_task = {
        let (g, stop, n) = (b.decider.clone(), b_stop.clone(), b_admitted.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if decide_on(&g, "fo", "tenant", "y").await.code == Code::Ok {
                    n.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    // Stop the leader mid-run.
    let outages = a.counter(|c| &c.unreachable_episodes);
    nodes.stop(leader).await;
    let stopped_at_ms = SystemNodeClock.now_ms();
    // 10 granted − 3 reported on each key: what A may have admitted beyond the allocator's view.
    assert_eq!(a.book().overshoot_bound(), 14 * T);

    // `deny`: exactly the 7 tokens still held, then OVER_LIMIT with the error backoff (A's clock
    // stands still, so the wait is exactly error_backoff_ms).
    let mut admitted = 0;
    let deadline = Instant::now() + WAIT;
    loop {
        let o = a.decide("fo", "tenant", "x").await;
        if o.code == Code::Ok {
            admitted += 1;
            assert!(admitted <= 7, "admitted beyond the allocation held");
            continue;
        }
        if a.counter(|c| &c.failure_denials) > 0 {
            assert_eq!(after(&o), Some(500 * MS));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent never noticed the allocator was gone"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(admitted, 7, "every token held stays spendable");
    assert!(!a.book().is_reachable());
    assert_eq!(
        a.counter(|c| &c.unreachable_episodes),
        outages + 1,
        "one outage, counted once however many calls failed"
    );
    assert_eq!(
        retry_after_everywhere(&a.decider, "fo", "tenant", "x").await,
        (Some(500 * MS), Some(500), Some("1".to_string()))
    );

    // `emergency` (issue 10 item 4): the 6 tokens held below the grant's emergency reserve,
    // then the reserve (10% of the grant of 10: one token) at the emergency bucket's pace, then
    // OVER_LIMIT with the error backoff: never beyond what was granted, however long the
    // allocator stays away.
    let mut admitted = 0;
    let fleet = a
        .book()
        .existing(
            "fo",
            1,
            &[Entry {
                key: "fleet",
                value: "x",
            }],
        )
        .expect("the fleet key is known");
    let denial = loop {
        let timeouts = a.counter(|c| &c.wait_timeouts);
        let o = a.decide("fo", "fleet", "x").await;
        if o.code != Code::Ok && a.counter(|c| &c.wait_timeouts) > timeouts {
            // The key ran low and its Acquire was still queued behind the agent's error
            // backoff (the tenant's failures began it, and it grows) when the decision's wait
            // (`cold_wait_ms`) ran out. On a real clock the wait bound has then passed since
            // the call was sent, and the decision after the wait follows the failure mode; A's
            // clock stands still, so the call stays "not late". Once it has failed the key
            // stands unreachable, as on a real clock: decide again.
            assert!(
                eventually(20, || !fleet.value.protocol.call_in_flight()).await,
                "the fleet key's call never ended"
            );
            continue;
        }
        if o.code != Code::Ok {
            break o;
        }
        admitted += 1;
        assert!(admitted <= 7, "admitted beyond the allocation held");
    };
    assert_eq!(admitted, 6 + 1);
    assert_eq!(after(&denial), Some(500 * MS));
    assert_eq!(a.counter(|c| &c.emergency_admits), 1);
    assert_eq!(
        a.book().overshoot_bound(),
        14 * T,
        "the emergency admission is spend of the granted reserve: inside the overshoot bound"
    );
    let status = allot_agent::api::http::status(&a.decider);
    assert_eq!(status["overshoot_bound_micros"], (14 * T));
    assert_eq!(status["allocator_reachable"], false);

    // B knows the other nodes: once they elect a leader, B is granted again.
    let new_leader = nodes.leader().await;
    assert_ne!(new_leader, leader);
    nodes
        .until(new_leader, "B granted by the new leader", |l| {
            l.allocations()
                .any(|x| x.holder == "gw-b" && x.issued_at_ms >= stopped_at_ms)
        })
        .await;
    let before = b_admitted.load(Ordering::SeqCst);
    assert!(
        eventually(15, || b_admitted.load(Ordering::SeqCst) > before).await,
        "B admits again"
    );
    b_stop.store(true, Ordering::SeqCst);
    b_task.await.expect("B's task");
    let b_granted: u64 = nodes.read(new_leader, |l| {
        l.allocations()
            .filter(|x| x.holder == "gw-b")
            .map(|x| x.granted)
            .sum()
    });
    let b_admitted = b_admitted.load(Ordering::SeqCst);
    assert_eq!(b.counter(|c| &c.leased_admits), b_admitted);
    assert!(
        b_admitted * T <= b_granted,
        "B admitted {b_admitted} with {b_granted} µtokens granted"
    );

    // The stopped node restarts from its data directory and rejoins; A's Retry-After passes.
    nodes.restart(leader).await;
    let leader_now = nodes.leader().await;
    let applied = nodes.read(leader_now, |l| l.last_ms());
    nodes
        .until(leader, "restarted node caught up", |l| {
            l.last_ms() >= applied
        })
        .await;
    clock.advance(500 * MS);
    let deadline = Instant::now() + WAIT;
    for key in ["tenant", "fleet"] {
        loop {
            if a.decide("fo", key, "x").await.code == Code::Ok {
                break;
            }
            assert!(Instant::now() < deadline, "A did not recover on {key}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(
        a.counter(|c| &c.emergency_admits),
        1,
        "recovered from allocations, not the emergency reserve"
    );
    // The allocations A spent while the allocator was gone are released with their final
    // spend: exactly their grant, nothing returned.
    let (t_id, f_id) = (tenant_a[0].id, fleet_a[0].id);
    nodes
        .until(leader_now, "A's old allocations released", |l| {
            [t_id, f_id].iter().all(|id| {
                l.allocation(*id).is_some_and(|x| {
                    x.state == AllocationState::Released { returned: 0 } && x.reported == 10 * T
                })
            })
        })
        .await;
    assert!(eventually(15, || a.book().is_reachable()).await);
    drop(a);
    drop(b);
    nodes.stop_all().await;
}

// ---------------------------------------------------------------------------------------------
// 4. Reservations settle idempotently
// ---------------------------------------------------------------------------------------------

const RESERVE: &str = "domain: res
descriptors:
  - key: llm
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 100, name: res-llm, lease: {ttl_ms: 600000, max_grant: 50, max_drift_ms: 100}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_settle_idempotently_against_the_allocator() {
    let alloc_clock = AllocatorManualClock::new(T0_MS);
    let mut nodes = Allocators::start(1, &[("res", RESERVE)], Arc::new(alloc_clock)).await;
    let clock = ManualClock::new(1_000 * S);
    // No periodic report between Reserve and Settle: the refund goes back into the allocation
    // (a reported spend stays spent); the final spend reaches the allocator on release.
    let mut agent = RealAgent::start(
        RESERVE,
        "gw-res",
        "eu",
        &[nodes.addr(1)],
        Arc::new(clock.clone()),
        |s| s.report_interval_ms = 3_600_000,
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, shutdown) = watch::channel(false);
    let server = tokio::spawn(serve_grpc(listener, agent.decider.clone(), shutdown));
    let mut client = AgentClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let reserve = |id: &str| pb::ReserveRequest {
        domain: "res".into(),
        descriptors: vec![desc(&[("llm", "acme")], None)],
        max_cost: 10,
        request_id: id.into(),
        ttl_ms: 60_000,
    };
    let spent = |a: &RealAgent| -> u64 {
        a.held("res", 0, "llm", "acme")
            .iter()
            .map(|x| x.spent())
            .sum()
    };

    let r = client
        .reserve(reserve("job-1"))
        .await
        .expect("reserve")
        .into_inner();
    assert_eq!(r.reservation_id, "job-1");
    assert_eq!(
        r.decision.expect("decision").code,
        pb::DecisionCode::Ok as i32
    );
    assert_eq!(spent(&agent), 10 * T, "the maximum is spent at once");
    // Reserve retried with the same id: the same reservation, nothing more spent.
    let again = client
        .reserve(reserve("job-1"))
        .await
        .expect("reserve")
        .into_inner();
    assert_eq!(again.reservation_id, "job-1");
    assert_eq!(spent(&agent), 10 * T);

    let settle = |actual| pb::SettleRequest {
        reservation_id: "job-1".into(),
        actual_cost: actual,
    };
    let s = client.settle(settle(3)).await.expect("settle").into_inner();
    assert_eq!(
        (s.refunded, s.actual_cost, s.already_settled),
        (7, 3, false)
    );
    assert_eq!(spent(&agent), 3 * T, "max − actual came back");
    // Settled again (even with another cost): the first answer, nothing more refunded.
    for actual in [3, 9, 0] {
        let s = client
            .settle(settle(actual))
            .await
            .expect("settle")
            .into_inner();
        assert_eq!((s.refunded, s.actual_cost, s.already_settled), (7, 3, true));
        assert_eq!(spent(&agent), 3 * T);
    }
    // The next check sees the refunded tokens: 50 granted − 3 − 1.
    let c = client
        .check(pb::CheckRequest {
            domain: "res".into(),
            descriptors: vec![desc(&[("llm", "acme")], None)],
            cost: 1,
            request_id: String::new(),
        })
        .await
        .expect("check")
        .into_inner()
        .decision
        .expect("decision");
    assert_eq!(c.code, pb::DecisionCode::Ok as i32);
    assert_eq!(c.remaining, Some(46));
    assert_eq!(agent.counter(|x| &x.acquires), 1);

    // The allocator learns the final spend (3 + 1) on release and gets back exactly the rest.
    let id = agent.held("res", 0, "llm", "acme")[0].id;
    let _ = stop.send(true);
    let _ = server.await;
    agent.shutdown().await;
    nodes
        .until(1, "released", |l| {
            l.allocation(id).is_some_and(|a| {
                a.state == AllocationState::Released { returned: 46 * T } && a.reported == 4 * T
            })
        })
        .await;
    let status = nodes.read(1, |l| l.status(&policy_key("res", "llm", "acme"), T0_MS));
    assert_eq!(
        status.expect("status").bucket_tokens,
        96 * T,
        "100 − 50 granted + 46 returned"
    );
    nodes.stop_all().await;
}

/// Two agents of one region, burst 5, grants of at most 4: the first agent's grant takes 4; the
/// last whole token must still go to the second while both ask (the ledger used to round the
/// second's fair part, half a token, down to nothing: the token went to nobody and every denial
/// said "retry in 1 ms", an Acquire storm through Raft).
const ODD: &str = "domain: odd
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 5, name: odd-tenant, lease: {ttl_ms: 10000, max_grant: 4, max_drift_ms: 100}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_of_one_region_spend_the_last_token() {
    let mut nodes = Allocators::start(1, &[("odd", ODD)], Arc::new(SystemNodeClock)).await;
    let real = || Arc::new(MonotonicClock::new()) as Arc<dyn Clock>;
    let tune = |s: &mut LeaseSettings| s.error_backoff_ms = 100;
    let one = RealAgent::start(ODD, "gw-1", "eu", &[nodes.addr(1)], real(), tune);
    let two = RealAgent::start(ODD, "gw-2", "eu", &[nodes.addr(1)], real(), tune);
    let counts: Vec<Arc<AtomicU64>> = (0..2).map(|_| Arc::new(AtomicU64::new(0))).collect();
    // gw-1 is granted 4 of the 5; then gw-2 asks while gw-1's demand stands.
    for (i, a) in [&one, &two].into_iter().enumerate() {
        let o = a.decide("odd", "tenant", "acme").await;
        assert_eq!(o.code, Code::Ok, "first decision of gw-{}: {o:?}", i + 1);
        counts[i].fetch_add(1, Ordering::SeqCst);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = hammer(&one.decider, 1, "odd", "tenant", "acme", &stop, &counts[0]);
    tasks.extend(hammer(
        &two.decider,
        1,
        "odd",
        "tenant",
        "acme",
        &stop,
        &counts[1],
    ));
    let total = || counts.iter().map(|c| c.load(Ordering::SeqCst)).sum::<u64>();
    let done = eventually(5, || total() >= 5).await;
    // Keep hammering a little: nothing more may pass, and the allocator is not stormed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("hammer task");
    }
    let acquires = one.counter(|c| &c.acquires) + two.counter(|c| &c.acquires);
    let seen: Vec<u64> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    assert!(
        done,
        "admitted {seen:?} of the burst of 5; {acquires} Acquires"
    );
    assert_eq!(seen, vec![4, 1], "gw-1 its grant of 4, gw-2 the last token");
    assert!(acquires <= 6, "{acquires} Acquires for 5 tokens");
    nodes.stop_all().await;
}

// ---------------------------------------------------------------------------------------------
// Central decisions and promotion against a real allocator (issue 9 items 2–3)
// ---------------------------------------------------------------------------------------------

/// With the default thresholds, a sparse key is decided by the real allocator's `Decide`
/// (sent in a `Batch`): each admission debits exactly its cost from the global bucket, adds
/// nothing to the agent's overshoot bound, and no allocation exists; at 4 tokens within one
/// lease period the key is promoted and leases (one Acquire), deciding locally after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_keys_are_decided_centrally_then_promoted_to_leases() {
    let alloc_clock = AllocatorManualClock::new(T0_MS);
    let nodes = Allocators::start(1, &[("one", ONE)], Arc::new(alloc_clock.clone())).await;
    let clock = ManualClock::new(1_000 * S);
    let agent = RealAgent::start(
        ONE,
        "gw-central",
        "eu",
        &[nodes.addr(1)],
        Arc::new(clock.clone()),
        |s| s.promote_tokens = 4,
    );
    for i in 0..3 {
        // Each answer reports what the allocator's bucket holds after it (burst 100), as a
        // central counter would: not 0 (what this agent holds) nor its own share.
        let (o, st) = decide_with_statuses(&agent.decider, "one", "bulk", "c").await;
        assert_eq!((o.code, st[0].remaining), (Code::Ok, 99 - i), "{i}");
    }
    assert_eq!(agent.counter(|c| &c.central_admits), 3);
    assert_eq!(agent.counter(|c| &c.acquires), 0);
    assert!(
        agent.counter(|c| &c.calls) <= 3,
        "one call per lone request"
    );
    assert!(agent.held("one", 0, "bulk", "c").is_empty());
    assert_eq!(agent.book().overshoot_bound(), 0);
    let status = nodes.read(1, |l| l.status(&policy_key("one", "bulk", "c"), T0_MS));
    assert_eq!(
        status.expect("status").bucket_tokens,
        97 * T,
        "burst 100, exactly 3 debited"
    );
    // The fourth central admission promotes; the fifth request leases.
    assert_eq!(agent.decide("one", "bulk", "c").await.code, Code::Ok);
    assert_eq!(agent.counter(|c| &c.promotions), 1);
    for _ in 0..10 {
        assert_eq!(agent.decide("one", "bulk", "c").await.code, Code::Ok);
    }
    assert_eq!(agent.counter(|c| &c.acquires), 1);
    assert_eq!(agent.counter(|c| &c.central_admits), 4);
    assert_eq!(agent.held("one", 0, "bulk", "c").len(), 1);
}

/// A config change at the agent that stops leasing a rule (here the rule is removed) releases
/// the key's allocation to a real allocator with its final spend at the next maintenance pass:
/// the ledger returns the unspent tokens to the key's bucket now, not when the ten-minute lease
/// would have expired, and counts exactly what was spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_removed_by_a_reload_gives_its_unspent_tokens_back() {
    let alloc_clock = AllocatorManualClock::new(T0_MS);
    let nodes = Allocators::start(1, &[("one", ONE)], Arc::new(alloc_clock.clone())).await;
    let clock = ManualClock::new(1_000 * S);
    let agent = RealAgent::start(
        ONE,
        "gw-reload",
        "eu",
        &[nodes.addr(1)],
        Arc::new(clock.clone()),
        |_| {},
    );
    for _ in 0..3 {
        assert_eq!(agent.decide("one", "bulk", "r").await.code, Code::Ok);
    }
    let held = agent.held("one", 0, "bulk", "r");
    assert_eq!(held.len(), 1);
    assert_eq!((held[0].granted, held[0].spent()), (50 * T, 3 * T));
    let bucket = || {
        nodes
            .read(1, |l| l.status(&policy_key("one", "bulk", "r"), T0_MS))
            .expect("status")
    };
    assert_eq!(bucket().bucket_tokens, 50 * T, "burst 100, one grant of 50");

    let without_bulk: String = ONE
        .lines()
        .filter(|l| !l.contains("key: bulk") && !l.contains("one-bulk"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(!without_bulk.contains("bulk") && without_bulk.contains("one-tenant"));
    agent
        .decider
        .apply(ConfigSet::from_yaml(&without_bulk, Path::new("p2.yaml")).expect("valid"));
    assert!(
        eventually(15, || {
            let s = bucket();
            s.bucket_tokens == 97 * T && s.regions.iter().all(|r| r.live_allocations == 0)
        })
        .await,
        "released with its spend of 3: {:?}",
        bucket()
    );
    assert!(held[0].is_closed());
    assert_eq!(agent.book().overshoot_bound(), 0);
}

/// Typed errors across the allocator↔agent seam (issue 11 item 4), end to end: a Report with a
/// stale epoch and one from another holder are refused by a real allocator and classified by
/// the agent as exactly that (not one as the other, not as a leader hint), unary and in a Batch;
/// a released allocation reads as ended, how included; the refusals change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_epochs_and_foreign_holders_are_classified_as_such_by_the_agent() {
    use allot_agent::lease::dispatch::{Answer, Dispatcher};
    use allot_agent::lease::{AllocatorLink, CallError, Fence};
    use pb::batch_item::Op;
    use pb::batch_result::Outcome;

    let alloc_clock = AllocatorManualClock::new(T0_MS);
    let mut nodes = Allocators::start(1, &[("one", ONE)], Arc::new(alloc_clock)).await;
    let link = Arc::new(AllocatorLink::new(&[nodes.addr(1)], Duration::from_secs(5)).unwrap());
    let acquire = pb::AcquireRequest {
        key: Some(pb::PolicyKey {
            domain: "one".into(),
            entries: vec![pb::DescriptorEntry {
                key: "tenant".into(),
                value: "t".into(),
            }],
        }),
        region: "eu".into(),
        holder: "gw-1".into(),
        want: 2 * T,
        demand_per_s: 0,
        want_rate_per_s: 0,
        request_id: "r1".into(),
    };
    let granted = link
        .call(|mut c| {
            let r = acquire.clone();
            async move { c.acquire(r).await }
        })
        .await
        .expect("acquire answered");
    let Some(pb::acquire_response::Outcome::Grant(g)) = granted.outcome else {
        panic!("expected a grant, got {granted:?}");
    };
    let report = |epoch: u64, holder: &str| pb::ReportRequest {
        incarnation: 0,
        allocation_id: g.allocation_id,
        epoch,
        holder: holder.into(),
        cumulative_spend: T,
    };
    let unary = |r: pb::ReportRequest| {
        let link = link.clone();
        async move {
            link.call(|mut c| {
                let r = r.clone();
                async move { c.report(r).await }
            })
            .await
        }
    };
    let before = nodes.read(1, |l| l.allocation(g.allocation_id).cloned());

    // Unary: the status details carry the reason.
    let stale = unary(report(g.epoch + 1, "gw-1")).await.expect_err("stale");
    assert!(
        matches!(
            &stale,
            CallError::Fenced {
                why: Fence::StaleEpoch,
                ..
            }
        ),
        "{stale:?}"
    );
    let foreign = unary(report(g.epoch, "gw-2")).await.expect_err("foreign");
    assert!(
        matches!(
            &foreign,
            CallError::Fenced {
                why: Fence::NotHolder,
                ..
            }
        ),
        "{foreign:?}"
    );

    // In one Batch, next to an item that succeeds.
    let dispatcher = Dispatcher::new(link.clone(), Duration::from_secs(5));
    let (answers, up) = dispatcher
        .send(&[
            Op::Report(report(g.epoch + 1, "gw-1")),
            Op::Report(report(g.epoch, "gw-2")),
            Op::Report(report(g.epoch, "gw-1")),
        ])
        .await;
    assert!(up);
    assert!(
        matches!(
            &answers[0],
            Answer::Failed(CallError::Fenced {
                why: Fence::StaleEpoch,
                ..
            })
        ),
        "{answers:?}"
    );
    assert!(
        matches!(
            &answers[1],
            Answer::Failed(CallError::Fenced {
                why: Fence::NotHolder,
                ..
            })
        ),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[2], Answer::Done(Outcome::Report(r)) if r.recorded_spend == T),
        "{answers:?}"
    );
    let after = nodes.read(1, |l| l.allocation(g.allocation_id).cloned());
    assert_eq!(
        after.map(|a| (a.reported, a.state)),
        before.map(|a| (T, a.state)),
        "only the holder's own report was recorded"
    );

    // Released: a later report reads as ended, and how.
    let release = pb::ReleaseRequest {
        incarnation: 0,
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw-1".into(),
        final_spend: T,
    };
    link.call(|mut c| {
        let r = release.clone();
        async move { c.release(r).await }
    })
    .await
    .expect("released");
    let ended = unary(report(g.epoch, "gw-1")).await.expect_err("ended");
    assert_eq!(
        ended,
        CallError::Fenced {
            why: Fence::Ended {
                how: "released".into()
            },
            message: format!("allocation {} has ended: released", g.allocation_id),
        }
    );
    nodes.stop_all().await;
}
