//! Shared rigs: a gateway on a manual clock, loopback servers, a fake allocator.

use allot_agent::api::{Decider, TrackingSettings};
use allot_agent::lease::LeaseSettings;
use allot_agent::server::{serve_grpc, serve_http, Agent};
use allot_common::clock::{Clock, ManualClock};
use allot_common::config::ConfigSet;
use allot_common::units::{MICROS_PER_TOKEN, NANOS_PER_MILLI};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_server::{Allocator, AllocatorServer};
use allot_proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor, RateLimitDescriptor,
};
use allot_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

pub const MS: u64 = NANOS_PER_MILLI;
pub const S: u64 = 1_000 * MS;
pub const T: u64 = MICROS_PER_TOKEN;

/// Local policies (no allocator needed).
pub const LOCAL: &str = "domain: edge
descriptors:
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 3, scope: local, name: per-client}
  - key: path
    value: /slow
    rate_limit: {unit: second, requests_per_unit: 100, scope: local, max_in_flight: 2, name: slow-path}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, scope: local, name: shadowed}
  - key: free
    rate_limit: {unlimited: true}
  - key: tokens
    rate_limit: {unit: minute, requests_per_unit: 100, scope: local, name: llm-tokens}
  - key: window
    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: fixed_window, scope: local, name: windowed}
";

/// A gateway on a manual clock (t = 1 000 s) with `policy` and no allocator.
pub struct Rig {
    pub clock: ManualClock,
    pub decider: Arc<Decider>,
    pub agent: Agent,
}

pub fn rig(policy: &str) -> Rig {
    rig_with(policy, &[], |_| {})
}

pub fn rig_with(policy: &str, allocators: &[String], tune: impl FnOnce(&mut LeaseSettings)) -> Rig {
    let clock = ManualClock::new(1_000 * S);
    let config = ConfigSet::from_yaml(policy, Path::new("policy.yaml")).expect("policy");
    let mut lease = LeaseSettings::new("gw-1", "eu");
    tune(&mut lease);
    let agent = Agent::build(
        config,
        lease,
        TrackingSettings {
            slot_ttl_ms: 5_000,
            ..TrackingSettings::default()
        },
        allocators,
        Arc::new(clock.clone()) as Arc<dyn Clock>,
    )
    .expect("agent");
    Rig {
        clock,
        decider: agent.decider.clone(),
        agent,
    }
}

/// Loopback servers (gRPC and HTTP) over a gateway; stopped on drop.
pub struct Servers {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Servers {
    pub async fn start(decider: Arc<Decider>) -> Servers {
        let (stop, shutdown) = watch::channel(false);
        let g = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let h = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (grpc, http) = (g.local_addr().unwrap(), h.local_addr().unwrap());
        let (g1, g2) = (decider.clone(), decider);
        let (s1, s2) = (shutdown.clone(), shutdown);
        let tasks = vec![
            tokio::spawn(async move {
                let _ = serve_grpc(g, g1, s1).await;
            }),
            tokio::spawn(async move {
                let _ = serve_http(h, g2, s2).await;
            }),
        ];
        Servers {
            grpc,
            http,
            stop,
            tasks,
        }
    }

    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// An RLS request with one descriptor per entry list.
pub fn rls(domain: &str, descs: &[&[(&str, &str)]], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descs.iter().map(|es| rls_desc(es, None)).collect(),
        hits_addend: hits,
    }
}

pub fn rls_desc(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| rate_limit_descriptor::Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        limit: None,
        hits_addend: hits,
        is_negative_hits: false,
    }
}

/// A native descriptor.
pub fn desc(entries: &[(&str, &str)], hits: Option<u64>) -> pb::RequestDescriptor {
    pb::RequestDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| pb::DescriptorEntry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        hits_addend: hits,
    }
}

/// The ledger incarnation every grant of [`FakeAllocator`] carries.
pub const FAKE_INCARNATION: u64 = 1_700_000_000_123;

/// A fake `allot.v1.Allocator`: grants from one pool of tokens, at most `want` each time.
#[derive(Debug, Clone)]
pub struct FakeAllocator {
    pub pool: Arc<AtomicU64>,
    pub ttl_ms: u64,
    pub acquires: Arc<AtomicU64>,
    pub reports: Arc<AtomicU64>,
    pub releases: Arc<AtomicU64>,
    pub released_spend: Arc<AtomicU64>,
    /// Stopped: every call fails as UNAVAILABLE, as a dead node's would.
    pub down: Arc<std::sync::atomic::AtomicBool>,
    /// The `want` of every Acquire, in arrival order.
    pub wants: Arc<Mutex<Vec<u64>>>,
    /// Held for writing by a test: every Acquire waits (after being counted) until released.
    pub gate: Arc<tokio::sync::RwLock<()>>,
    /// Descriptor values whose Acquires and Decides fail as UNAVAILABLE (reachability is per
    /// key).
    pub failing: Arc<Mutex<HashSet<String>>>,
    /// Serves `Batch` (else UNIMPLEMENTED, as an allocator older than the call).
    pub serve_batch: Arc<std::sync::atomic::AtomicBool>,
    /// Serves `Decide` from the pool (else UNIMPLEMENTED).
    pub serve_decide: Arc<std::sync::atomic::AtomicBool>,
    /// `Batch` calls answered (served or not).
    pub batches: Arc<AtomicU64>,
    /// Decide items and calls answered (served or not).
    pub decides: Arc<AtomicU64>,
    /// The `incarnation` of every Report and Release, in arrival order.
    pub incarnations: Arc<Mutex<Vec<u64>>>,
    /// Taken by the next Acquire denial: (hint ms, tokens): the denial carries `handoff_ms` =
    /// hint, and the tokens join the pool, as another region's part lent once it settles.
    pub handoff: Arc<Mutex<Option<(u64, u64)>>>,
    next_id: Arc<AtomicU64>,
}

impl FakeAllocator {
    pub fn new(pool_tokens: u64, ttl_ms: u64) -> Self {
        FakeAllocator {
            pool: Arc::new(AtomicU64::new(pool_tokens * T)),
            ttl_ms,
            acquires: Arc::default(),
            reports: Arc::default(),
            releases: Arc::default(),
            released_spend: Arc::default(),
            down: Arc::default(),
            wants: Arc::default(),
            gate: Arc::default(),
            failing: Arc::default(),
            serve_batch: Arc::default(),
            serve_decide: Arc::default(),
            batches: Arc::default(),
            incarnations: Arc::default(),
            decides: Arc::default(),
            handoff: Arc::default(),
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Stops it: open HTTP/2 connections outlive an aborted accept loop, so every call on them
    /// fails from now on, and the accept loop is aborted.
    pub fn stop(&self, server: &JoinHandle<()>) {
        self.down.store(true, Ordering::SeqCst);
        server.abort();
    }

    fn check_up(&self) -> Result<(), Status> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Status::unavailable("allocator stopped"));
        }
        Ok(())
    }

    /// Serves on an ephemeral loopback port.
    pub async fn serve(&self) -> (SocketAddr, JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.serve_on(l).await
    }

    pub async fn serve_on(&self, l: TcpListener) -> (SocketAddr, JoinHandle<()>) {
        let addr = l.local_addr().unwrap();
        let svc = AllocatorServer::new(self.clone());
        let h = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
                .await;
        });
        (addr, h)
    }
}

fn unimplemented_admin() -> Status {
    Status::unimplemented("the fake allocator serves the lease path only")
}

#[tonic::async_trait]
impl Allocator for FakeAllocator {
    async fn acquire(
        &self,
        r: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        self.check_up()?;
        self.acquires.fetch_add(1, Ordering::Relaxed);
        let want = r.get_ref().want;
        self.wants.lock().unwrap().push(want);
        drop(self.gate.read().await);
        let fails = r.get_ref().key.as_ref().is_some_and(|k| {
            let failing = self.failing.lock().unwrap();
            k.entries.iter().any(|e| failing.contains(&e.value))
        });
        if fails {
            return Err(Status::unavailable("this key's calls fail"));
        }
        let got = self
            .pool
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| {
                Some(p - p.min(want))
            })
            .map(|p| p.min(want))
            .unwrap_or(0);
        let outcome = if got == 0 {
            let (handoff_ms, lent) = self.handoff.lock().unwrap().take().unwrap_or((0, 0));
            self.pool.fetch_add(lent * T, Ordering::SeqCst);
            pb::acquire_response::Outcome::Denial(pb::Denial {
                retry_after_ms: 2_000,
                reason: "bucket empty".into(),
                policy_version: 1,
                handoff_ms,
            })
        } else {
            pb::acquire_response::Outcome::Grant(pb::Grant {
                allocation_id: self.next_id.fetch_add(1, Ordering::Relaxed),
                epoch: 1,
                granted: got,
                expires_at_unix_ms: 0,
                ttl_ms: self.ttl_ms,
                policy_version: 1,
                incarnation: FAKE_INCARNATION,
                ..Default::default()
            })
        };
        Ok(Response::new(pb::AcquireResponse {
            outcome: Some(outcome),
        }))
    }

    async fn report(
        &self,
        r: Request<pb::ReportRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.check_up()?;
        self.reports.fetch_add(1, Ordering::Relaxed);
        self.incarnations
            .lock()
            .unwrap()
            .push(r.get_ref().incarnation);
        Ok(Response::new(pb::ReportResponse {
            recorded_spend: r.get_ref().cumulative_spend,
            expires_at_unix_ms: 0,
        }))
    }

    async fn release(
        &self,
        r: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.check_up()?;
        self.releases.fetch_add(1, Ordering::Relaxed);
        self.incarnations
            .lock()
            .unwrap()
            .push(r.get_ref().incarnation);
        self.released_spend
            .fetch_add(r.get_ref().final_spend, Ordering::Relaxed);
        Ok(Response::new(pb::ReleaseResponse { returned: 0 }))
    }

    async fn decide(
        &self,
        r: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        self.check_up()?;
        self.decides.fetch_add(1, Ordering::Relaxed);
        if !self.serve_decide.load(Ordering::SeqCst) {
            return Err(Status::unimplemented("Decide: not served"));
        }
        let fails = r.get_ref().key.as_ref().is_some_and(|k| {
            let failing = self.failing.lock().unwrap();
            k.entries.iter().any(|e| failing.contains(&e.value))
        });
        if fails {
            return Err(Status::unavailable("this key's calls fail"));
        }
        let cost = r.get_ref().cost;
        let allowed = self
            .pool
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| p.checked_sub(cost))
            .is_ok();
        Ok(Response::new(pb::DecideResponse {
            allowed,
            remaining: self.pool.load(Ordering::SeqCst),
            retry_after_ms: if allowed { 0 } else { 2_000 },
            never: false,
            reason: if allowed {
                String::new()
            } else {
                "bucket empty".into()
            },
            policy_version: 1,
            handoff_ms: 0,
        }))
    }

    async fn batch(
        &self,
        r: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        self.check_up()?;
        self.batches.fetch_add(1, Ordering::Relaxed);
        if !self.serve_batch.load(Ordering::SeqCst) {
            return Err(Status::unimplemented("Batch: not served"));
        }
        use pb::batch_item::Op;
        use pb::batch_result::Outcome;
        let mut results = Vec::new();
        for item in r.into_inner().items {
            let outcome = match item.op {
                Some(Op::Acquire(a)) => self
                    .acquire(Request::new(a))
                    .await
                    .map(|r| Outcome::Acquire(r.into_inner())),
                Some(Op::Report(a)) => self
                    .report(Request::new(a))
                    .await
                    .map(|r| Outcome::Report(r.into_inner())),
                Some(Op::Release(a)) => self
                    .release(Request::new(a))
                    .await
                    .map(|r| Outcome::Release(r.into_inner())),
                Some(Op::Decide(a)) => self
                    .decide(Request::new(a))
                    .await
                    .map(|r| Outcome::Decide(r.into_inner())),
                None => Err(Status::invalid_argument("empty item")),
            };
            let outcome = outcome.unwrap_or_else(|s| {
                // Per item, a failing key reads as an overloaded allocator: retry later.
                let reason = match s.code() {
                    tonic::Code::Unavailable => pb::ErrorReason::Overloaded,
                    _ => pb::ErrorReason::BadInput,
                };
                Outcome::Error(pb::ErrorDetail {
                    reason: reason as i32,
                    message: s.message().to_string(),
                    ..Default::default()
                })
            });
            results.push(pb::BatchResult {
                outcome: Some(outcome),
            });
        }
        Ok(Response::new(pb::BatchResponse { results }))
    }

    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        Err(unimplemented_admin())
    }

    async fn put_policy(
        &self,
        _: Request<pb::PutPolicyRequest>,
    ) -> Result<Response<pb::PutPolicyResponse>, Status> {
        Err(unimplemented_admin())
    }

    async fn set_shares(
        &self,
        _: Request<pb::SetSharesRequest>,
    ) -> Result<Response<pb::SetSharesResponse>, Status> {
        Err(unimplemented_admin())
    }

    async fn cluster_init(
        &self,
        _: Request<pb::ClusterInitRequest>,
    ) -> Result<Response<pb::ClusterInitResponse>, Status> {
        Err(unimplemented_admin())
    }

    async fn add_learner(
        &self,
        _: Request<pb::AddLearnerRequest>,
    ) -> Result<Response<pb::AddLearnerResponse>, Status> {
        Err(unimplemented_admin())
    }

    async fn change_membership(
        &self,
        _: Request<pb::ChangeMembershipRequest>,
    ) -> Result<Response<pb::ChangeMembershipResponse>, Status> {
        Err(unimplemented_admin())
    }

    async fn cluster_status(
        &self,
        _: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        Err(unimplemented_admin())
    }
}

/// Polls `cond` every 10 ms for up to `secs` seconds.
pub async fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..secs * 100 {
        if cond() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    cond()
}

/// Binds `$req` to a one-descriptor request of domain `api` for `tenant=$value` costing
/// `$cost` (`Option<u64>` tokens); the entries live in the caller's scope.
macro_rules! tenant_request {
    ($req:ident, $value:expr, $cost:expr) => {
        let entries = [allot_common::descriptor::Entry {
            key: "tenant",
            value: $value,
        }];
        let ds = [allot_common::descriptor::Descriptor {
            entries: &entries,
            hits_addend: $cost,
        }];
        let $req = allot_common::descriptor::Request {
            domain: "api",
            descriptors: &ds,
            hits_addend: None,
        };
    };
}
pub(crate) use tenant_request;

/// 10/s, burst 10, on `tenant`; leases of 1 s (the fakes' ttl) and at most 20 tokens.
pub const TENANT: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 10, lease: {ttl_ms: 1000, max_grant: 20}, name: tenant-rps}
";

/// An agent on a manual clock with policy [`TENANT`], its background running, and the fake
/// allocator it leases from; stopped on drop.
pub struct Served {
    pub rig: Rig,
    pub fake: FakeAllocator,
    _allocator: JoinHandle<()>,
    stop: watch::Sender<bool>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// [`Served`] by `fake` (reports every 50 ms, waits up to 5 s, calls time out after 2 s).
pub async fn served(fake: FakeAllocator) -> Served {
    served_with(fake, TENANT).await
}

/// [`served`] with `policy` instead of [`TENANT`].
pub async fn served_with(fake: FakeAllocator, policy: &str) -> Served {
    let (addr, allocator) = fake.serve().await;
    let mut rig = rig_with(policy, &[addr.to_string()], |s| {
        s.report_interval_ms = 50;
        s.cold_wait_ms = 5_000;
        s.call_timeout_ms = 2_000;
    });
    let (stop, shutdown) = watch::channel(false);
    rig.agent.spawn_background(shutdown);
    Served {
        rig,
        fake,
        _allocator: allocator,
        stop,
    }
}

/// Decides one request of `cost` tokens for `tenant=value` through the gateway's enforcer.
pub async fn decide_tenant(
    g: &Decider,
    value: &str,
    cost: Option<u64>,
) -> allot_common::limiter::Outcome {
    tenant_request!(req, value, cost);
    let mut statuses = Vec::new();
    g.enforcer()
        .decide(&req, &mut statuses)
        .await
        .expect("valid request")
}

/// How many requests of one token for one tenant, arriving at `arrivals` (ns), the ideal
/// central counter admits: the decision core with the policy's bucket held in one place.
pub fn ideal_admitted(policy: &str, arrivals: &[u64]) -> usize {
    let config = ConfigSet::from_yaml(policy, Path::new("p.yaml")).expect("policy");
    let limiter =
        allot_common::limiter::Limiter::new(config, arrivals.first().copied().unwrap_or(0));
    tenant_request!(req, "ideal", None);
    let mut st = Vec::new();
    arrivals
        .iter()
        .filter(|t| {
            let o = limiter.decide(&req, **t, &mut st).expect("valid");
            o.code == allot_common::limiter::Code::Ok
        })
        .count()
}
