//! A local deployment on real processes: a 3-node allocator cluster and gateway agents on
//! loopback ports, with data under one folder. Used by `allot-local` and the end-to-end tests.

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};
use tonic::transport::Endpoint;

/// One allocator node process.
#[derive(Debug)]
pub struct AllocatorProc {
    /// Raft node id.
    pub id: u64,
    /// gRPC address (Raft and the Allocator API).
    pub addr: String,
    /// Data folder.
    pub data_dir: PathBuf,
    child: Option<Child>,
}

/// One agent process.
#[derive(Debug)]
pub struct AgentProc {
    /// Agent id (holder).
    pub id: String,
    /// Region.
    pub region: String,
    /// Envoy RLS (and native `allot.v1.Agent`) gRPC address.
    pub rls: String,
    /// HTTP address (`/v1/check`, `/healthz`, `/v1/status`, `/metrics`).
    pub http: String,
    child: Option<Child>,
}

/// One Envoy proxy in front of an agent (`--gateways envoy`).
#[derive(Debug)]
pub struct GatewayProc {
    /// The agent it calls for rate-limit decisions.
    pub agent: String,
    /// Region of that agent.
    pub region: String,
    /// HTTP address clients send requests to.
    pub http: String,
    child: Option<Child>,
}

/// Where the deployment's endpoints are, for printing and `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct Endpoints {
    /// Allocator nodes: (id, address).
    pub allocators: Vec<(u64, String)>,
    /// Agents: (id, region, rls address, http address).
    pub agents: Vec<(String, String, String, String)>,
    /// Envoy gateways: (agent id, http address).
    pub gateways: Vec<(String, String)>,
    /// Data folder.
    pub data_dir: String,
}

/// The running deployment.
#[derive(Debug)]
pub struct Deployment {
    /// Allocator nodes.
    pub allocators: Vec<AllocatorProc>,
    /// Agents.
    pub agents: Vec<AgentProc>,
    /// Envoy gateways (empty unless asked for).
    pub gateways: Vec<GatewayProc>,
    /// Root data folder.
    pub data_dir: PathBuf,
    bin_dir: PathBuf,
    policies: PathBuf,
    logs: PathBuf,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Folder holding `allot-allocator` and `allot-agent`.
    pub bin_dir: PathBuf,
    /// Folder of policy YAML files (or one file).
    pub policies: PathBuf,
    /// Root data folder (created).
    pub data_dir: PathBuf,
    /// Agents to start: (region, count).
    pub agents: Vec<(String, usize)>,
    /// Put a real Envoy proxy (this binary) in front of each agent of `gateway_regions`.
    pub envoy: Option<PathBuf>,
    /// Regions whose agents get an Envoy gateway.
    pub gateway_regions: Vec<String>,
}

/// A free loopback port (bound then released; the process binds it right after).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn log_file(dir: &Path, name: &str) -> Result<std::fs::File> {
    std::fs::create_dir_all(dir)?;
    std::fs::File::create(dir.join(format!("{name}.log")))
        .with_context(|| format!("log for {name}"))
}

/// Sends SIGTERM so the process releases its allocations / flushes its data.
fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on a pid we spawned and have not reaped yet; no memory is touched.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
}

async fn wait_exit(child: &mut Child, within: Duration) -> Result<std::process::ExitStatus> {
    match tokio::time::timeout(within, child.wait()).await {
        Ok(r) => Ok(r?),
        Err(_) => {
            child.kill().await?;
            bail!("did not exit within {within:?} after SIGTERM; killed")
        }
    }
}

impl AllocatorProc {
    fn spawn(
        &mut self,
        bin: &Path,
        peers: &[(u64, String)],
        policies: &Path,
        init: bool,
        logs: &Path,
    ) -> Result<()> {
        let mut cmd = Command::new(bin.join("allot-allocator"));
        cmd.arg("--node-id")
            .arg(self.id.to_string())
            .arg("--listen")
            .arg(&self.addr)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--policies")
            .arg(policies)
            .args([
                "--heartbeat-ms",
                "100",
                "--election-timeout-min-ms",
                "400",
                "--election-timeout-max-ms",
                "800",
            ]);
        for (id, addr) in peers {
            cmd.arg("--peer").arg(format!("{id}={addr}"));
        }
        if init {
            cmd.arg("--init");
        }
        let log = log_file(logs, &format!("allocator-{}", self.id))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        self.child = Some(cmd.spawn().context("cannot start allot-allocator")?);
        Ok(())
    }

    /// Kills the node abruptly (SIGKILL): a crash.
    pub async fn crash(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().await?;
        }
        Ok(())
    }

    /// Whether the process runs.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl AgentProc {
    fn spawn(
        &mut self,
        bin: &Path,
        allocators: &[String],
        policies: &Path,
        logs: &Path,
    ) -> Result<()> {
        let mut cmd = Command::new(bin.join("allot-agent"));
        cmd.arg("--agent-id")
            .arg(&self.id)
            .arg("--region")
            .arg(&self.region)
            .arg("--grpc-listen")
            .arg(&self.rls)
            .arg("--http-listen")
            .arg(&self.http)
            .arg("--policies")
            .arg(policies);
        for a in allocators {
            cmd.arg("--allocator").arg(a);
        }
        let log = log_file(logs, &format!("agent-{}", self.id))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        self.child = Some(cmd.spawn().context("cannot start allot-agent")?);
        Ok(())
    }
}

/// A client of one allocator node.
pub fn allocator_client(addr: &str) -> Result<AllocatorClient<tonic::transport::Channel>> {
    let ch = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(3))
        .connect_lazy();
    Ok(AllocatorClient::new(ch))
}

impl Deployment {
    /// Starts the allocators (node 1 initialises the cluster), waits for a leader, then starts
    /// the agents and waits until every one answers `/healthz`.
    ///
    /// # Errors
    /// A binary that cannot start, or a process not healthy within 30 s (its log is named).
    pub async fn start(plan: &Plan) -> Result<Deployment> {
        std::fs::create_dir_all(&plan.data_dir)?;
        let logs = plan.data_dir.join("logs");
        let mut allocators = Vec::new();
        for id in 1..=3u64 {
            allocators.push(AllocatorProc {
                id,
                addr: format!("127.0.0.1:{}", free_port()?),
                data_dir: plan.data_dir.join(format!("allocator-{id}")),
                child: None,
            });
        }
        let peers: Vec<(u64, String)> = allocators.iter().map(|a| (a.id, a.addr.clone())).collect();
        for a in allocators.iter_mut() {
            let init = a.id == 1;
            a.spawn(&plan.bin_dir, &peers, &plan.policies, init, &logs)?;
        }
        let mut d = Deployment {
            allocators,
            agents: Vec::new(),
            gateways: Vec::new(),
            data_dir: plan.data_dir.clone(),
            bin_dir: plan.bin_dir.clone(),
            policies: plan.policies.clone(),
            logs,
        };
        d.wait_leader(Duration::from_secs(30)).await?;
        let endpoints: Vec<String> = d.allocators.iter().map(|a| a.addr.clone()).collect();
        for (region, n) in &plan.agents {
            for i in 1..=*n {
                let mut a = AgentProc {
                    id: format!("gw-{region}-{i}"),
                    region: region.clone(),
                    rls: format!("127.0.0.1:{}", free_port()?),
                    http: format!("127.0.0.1:{}", free_port()?),
                    child: None,
                };
                a.spawn(&d.bin_dir, &endpoints, &d.policies, &d.logs)?;
                d.agents.push(a);
            }
        }
        d.wait_agents(Duration::from_secs(30)).await?;
        if let Some(envoy) = &plan.envoy {
            d.start_gateways(envoy, &plan.gateway_regions).await?;
        }
        Ok(d)
    }

    /// Starts an upstream and one Envoy per agent of `regions`, with Envoy's HTTP rate-limit
    /// filter (domain `acme`, descriptor tenant from `x-tenant`, operation=search) calling that
    /// agent's RLS; waits until each Envoy accepts connections.
    async fn start_gateways(&mut self, envoy: &Path, regions: &[String]) -> Result<()> {
        let upstream = std::net::TcpListener::bind("127.0.0.1:0")?;
        let upstream_port = upstream.local_addr()?.port();
        upstream.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(upstream)?;
        let app = axum::Router::new().route("/search", axum::routing::get(|| async { "ok\n" }));
        tokio::spawn(async move {
            // The upstream lives as long as the launcher; an error ends it and the gateways
            // then answer 503, which the scenario counts as errors.
            let _ = axum::serve(listener, app).await;
        });
        let tmpl = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/envoy/envoy.yaml.tmpl"
        ))
        .context("Envoy config template")?;
        for a in self.agents.iter().filter(|a| regions.contains(&a.region)) {
            let listen = free_port()?;
            let admin = free_port()?;
            let agent_port = a.rls.rsplit(':').next().unwrap_or_default().to_string();
            let cfg = tmpl
                .replace("@listen_port@", &listen.to_string())
                .replace("@admin_port@", &admin.to_string())
                .replace("@agent_port@", &agent_port)
                .replace("@upstream_port@", &upstream_port.to_string())
                .replace("@domain@", "acme")
                .replace("@failure_mode_deny@", "true");
            let path = self.data_dir.join(format!("envoy-{}.yaml", a.id));
            std::fs::write(&path, cfg)?;
            let log = log_file(&self.logs, &format!("envoy-{}", a.id))?;
            let child = Command::new(envoy)
                .arg("-c")
                .arg(&path)
                .args([
                    "--base-id",
                    &admin.to_string(),
                    "--log-level",
                    "warn",
                    "--concurrency",
                    "1",
                ])
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .context("cannot start envoy")?;
            self.gateways.push(GatewayProc {
                agent: a.id.clone(),
                region: a.region.clone(),
                http: format!("127.0.0.1:{listen}"),
                child: Some(child),
            });
        }
        let t0 = Instant::now();
        for g in &self.gateways {
            while tokio::net::TcpStream::connect(&g.http).await.is_err() {
                if t0.elapsed() > Duration::from_secs(30) {
                    bail!(
                        "envoy for {} not listening; see {}",
                        g.agent,
                        self.logs.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// The current leader's (id, address), asking every running node.
    pub async fn leader(&self) -> Option<(u64, String)> {
        for a in self.allocators.iter().filter(|a| a.is_running()) {
            let Ok(mut c) = allocator_client(&a.addr) else {
                continue;
            };
            if let Ok(r) = c.cluster_status(pb::ClusterStatusRequest {}).await {
                let r = r.into_inner();
                if let Some(id) = r.leader_id {
                    if !r.leader_addr.is_empty()
                        && self.allocators.iter().any(|x| x.id == id && x.is_running())
                    {
                        return Some((id, r.leader_addr));
                    }
                }
            }
        }
        None
    }

    /// Waits until a running node leads and the policies are installed.
    ///
    /// # Errors
    /// None within `within`.
    pub async fn wait_leader(&self, within: Duration) -> Result<(u64, String)> {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            if let Some(l) = self.leader().await {
                return Ok(l);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "no allocator leader within {within:?}; see {}",
            self.logs.display()
        )
    }

    async fn wait_agents(&self, within: Duration) -> Result<()> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()?;
        let t0 = Instant::now();
        for a in &self.agents {
            loop {
                let ok = http
                    .get(format!("http://{}/healthz", a.http))
                    .send()
                    .await
                    .map(|r| r.status().is_success())
                    .unwrap_or(false);
                if ok {
                    break;
                }
                if t0.elapsed() > within {
                    bail!(
                        "agent {} not healthy within {within:?}; see {}",
                        a.id,
                        self.logs.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// Restarts a crashed allocator node from its data folder.
    ///
    /// # Errors
    /// When it cannot be spawned.
    pub fn restart_allocator(&mut self, id: u64) -> Result<()> {
        let peers: Vec<(u64, String)> = self
            .allocators
            .iter()
            .map(|a| (a.id, a.addr.clone()))
            .collect();
        let (bin, pol, logs) = (
            self.bin_dir.clone(),
            self.policies.clone(),
            self.logs.clone(),
        );
        if let Some(a) = self.allocators.iter_mut().find(|a| a.id == id) {
            a.spawn(&bin, &peers, &pol, false, &logs)?;
        }
        Ok(())
    }

    /// Waits until node `id` answers (e.g. after a restart: it must own its signal handlers
    /// before it can be stopped cleanly).
    ///
    /// # Errors
    /// Not answering within `within`.
    pub async fn wait_node(&self, id: u64, within: Duration) -> Result<()> {
        let Some(a) = self.allocators.iter().find(|a| a.id == id) else {
            bail!("no allocator node {id}");
        };
        let t0 = Instant::now();
        let mut c = allocator_client(&a.addr)?;
        while c.cluster_status(pb::ClusterStatusRequest {}).await.is_err() {
            if t0.elapsed() > within {
                bail!(
                    "allocator node {id} not answering within {within:?}; see {}",
                    self.logs.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Endpoints, for printing.
    pub fn endpoints(&self) -> Endpoints {
        Endpoints {
            allocators: self
                .allocators
                .iter()
                .map(|a| (a.id, a.addr.clone()))
                .collect(),
            agents: self
                .agents
                .iter()
                .map(|a| {
                    (
                        a.id.clone(),
                        a.region.clone(),
                        a.rls.clone(),
                        a.http.clone(),
                    )
                })
                .collect(),
            gateways: self
                .gateways
                .iter()
                .map(|g| (g.agent.clone(), g.http.clone()))
                .collect(),
            data_dir: self.data_dir.display().to_string(),
        }
    }

    /// Stops everything cleanly: agents first (they release their allocations), then the
    /// allocators (they flush). Returns the processes that did not exit cleanly.
    pub async fn shutdown(mut self) -> Vec<String> {
        let mut unclean = Vec::new();
        for g in self.gateways.iter() {
            if let Some(c) = &g.child {
                terminate(c);
            }
        }
        for g in self.gateways.iter_mut() {
            if let Some(mut c) = g.child.take() {
                match wait_exit(&mut c, Duration::from_secs(10)).await {
                    Ok(s) if s.success() => {}
                    Ok(s) => unclean.push(format!("envoy for {} exited with {s}", g.agent)),
                    Err(e) => unclean.push(format!("envoy for {}: {e}", g.agent)),
                }
            }
        }
        for a in self.agents.iter() {
            if let Some(c) = &a.child {
                terminate(c);
            }
        }
        for a in self.agents.iter_mut() {
            if let Some(mut c) = a.child.take() {
                match wait_exit(&mut c, Duration::from_secs(10)).await {
                    Ok(s) if s.success() => {}
                    Ok(s) => unclean.push(format!("agent {} exited with {s}", a.id)),
                    Err(e) => unclean.push(format!("agent {}: {e}", a.id)),
                }
            }
        }
        for a in self.allocators.iter() {
            if let Some(c) = &a.child {
                terminate(c);
            }
        }
        for a in self.allocators.iter_mut() {
            if let Some(mut c) = a.child.take() {
                match wait_exit(&mut c, Duration::from_secs(10)).await {
                    Ok(s) if s.success() => {}
                    Ok(s) => unclean.push(format!("allocator {} exited with {s}", a.id)),
                    Err(e) => unclean.push(format!("allocator {}: {e}", a.id)),
                }
            }
        }
        unclean
    }
}
