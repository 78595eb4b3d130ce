//! Shared rigs: a gateway on a manual clock, loopback servers, a fake allocator.

use allot_agent::api::{Gateway, GatewaySettings};
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
    pub gateway: Arc<Gateway>,
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
        GatewaySettings {
            slot_ttl_ms: 5_000,
            ..GatewaySettings::default()
        },
        allocators,
        Arc::new(clock.clone()) as Arc<dyn Clock>,
    )
    .expect("agent");
    Rig {
        clock,
        gateway: agent.gateway.clone(),
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
    pub async fn start(gateway: Arc<Gateway>) -> Servers {
        let (stop, shutdown) = watch::channel(false);
        let g = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let h = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (grpc, http) = (g.local_addr().unwrap(), h.local_addr().unwrap());
        let (g1, g2) = (gateway.clone(), gateway);
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
    /// Descriptor values whose Acquires fail as UNAVAILABLE (reachability is per key).
    pub failing: Arc<Mutex<HashSet<String>>>,
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
            pb::acquire_response::Outcome::Denial(pb::Denial {
                retry_after_ms: 2_000,
                reason: "bucket empty".into(),
                policy_version: 1,
            })
        } else {
            pb::acquire_response::Outcome::Grant(pb::Grant {
                allocation_id: self.next_id.fetch_add(1, Ordering::Relaxed),
                epoch: 1,
                granted: got,
                expires_at_unix_ms: 0,
                ttl_ms: self.ttl_ms,
                policy_version: 1,
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
        self.released_spend
            .fetch_add(r.get_ref().final_spend, Ordering::Relaxed);
        Ok(Response::new(pb::ReleaseResponse { returned: 0 }))
    }

    async fn decide(
        &self,
        _req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        Err(Status::unimplemented("Decide: not yet served"))
    }

    async fn batch(
        &self,
        _req: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        Err(Status::unimplemented("Batch: not yet served"))
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
