//! The simulated deployment: allocator nodes (the production [`Daemon`]: ledger, openraft, sled,
//! group commit, the allocator API) and agents (the production [`Enforcer`], [`LeaseBook`] and
//! [`LeaseManager`] over an [`AllocatorLink`]) as turmoil hosts, the gateways' requests sent
//! in-process to each agent's enforcer. The driver steps the simulation 1 ms at a time, turns
//! faults on and off, and hands what it observes to the [`Checker`](super::check::Checker).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use allot_agent::enforce::Enforcer;
use allot_agent::lease::{AllocatorLink, LeaseBook, LeaseManager, LeaseSettings};
use allot_allocator::daemon::{Daemon, DaemonConfig, DaemonIo, PolicyFile};
use allot_allocator::ledger::Ledger;
use allot_allocator::raft::{Flush, GroupCommitConfig, Node, NodeConfig, NodeStorage, RaftTimings};
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request};
use allot_common::limiter::Code;
use anyhow::{Context, Result};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use super::clock::{true_ns, AgentClock, SimNodeClock};
use super::net;
use super::workload::DOMAIN;
use crate::arrivals::{Arrival, Key, Record, RequestAnswer};

/// Unix time of the simulation's start: 2025-12-01 12:00 UTC (noon, so a daily quota's period
/// does not roll over during a run).
pub const EPOCH_MS: u64 = 1_764_590_400_000;
/// The port every allocator serves Raft and the allocator API on.
const PORT: u16 = 7700;
/// Regions of the allocator nodes, by index, when they are spread over the regions.
const NODE_REGIONS: [&str; 5] = ["eu-west", "us-east", "eu-west", "us-east", "eu-west"];
/// Regions of the agents, by index.
pub const AGENT_REGIONS: [&str; 4] = ["eu-west", "eu-west", "us-east", "us-east"];
/// The regions, by index (a region cut names one).
pub const REGIONS: [&str; 2] = ["eu-west", "us-east"];

/// A control message to an allocator host.
#[derive(Debug, Clone, Copy)]
pub enum Control {
    /// Start an election now (the simulation plays Raft's failure detector).
    Elect,
}

/// What the driver can see of a running allocator node.
#[derive(Default)]
pub struct NodeSlot {
    /// The node, while its host runs.
    pub node: Option<Arc<Node<Ledger>>>,
    /// Its control channel.
    pub control: Option<mpsc::UnboundedSender<Control>>,
}

/// What the driver can see of a running agent.
#[derive(Default)]
pub struct AgentSlot {
    /// Its lease book, while its host runs.
    pub book: Option<Arc<LeaseBook>>,
}

impl AgentSlot {
    /// The allocator calls its lease book counted (none without a book).
    pub fn calls(&self) -> Calls {
        let Some(b) = &self.book else {
            return Calls::default();
        };
        let c = &b.counters;
        let n = |x: &std::sync::atomic::AtomicU64| x.load(Ordering::Relaxed);
        Calls {
            calls: n(&c.calls),
            acquires: n(&c.acquires),
            reports: n(&c.reports),
            releases: n(&c.releases),
            decides: n(&c.decides),
        }
    }
}

/// Allocator calls agents sent (the lease book's counters): the coordination a strategy costs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    /// RPCs sent (a Batch of several items, or one single call).
    pub calls: u64,
    /// Acquire items.
    pub acquires: u64,
    /// Report items.
    pub reports: u64,
    /// Release items.
    pub releases: u64,
    /// Decide items (central decisions).
    pub decides: u64,
}

impl Calls {
    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &Calls) {
        self.calls += other.calls;
        self.acquires += other.acquires;
        self.reports += other.reports;
        self.releases += other.releases;
        self.decides += other.decides;
    }

    /// Items sent: acquires, reports, releases and decides.
    pub fn items(&self) -> u64 {
        self.acquires + self.reports + self.releases + self.decides
    }
}

/// One allocator node's fixed parts.
#[derive(Clone)]
pub struct NodeSpec {
    /// Raft id (1-based).
    pub id: u64,
    /// Host name.
    pub name: String,
    /// Data directory.
    pub dir: PathBuf,
    /// Its wall clock's step, ms (changed by clock faults).
    pub step_ms: Arc<AtomicI64>,
    /// Its oscillator's drift, ppm.
    pub ppm: i64,
    /// Its region.
    pub region: &'static str,
    /// The policy document it installs (YAML).
    pub policy: Arc<str>,
}

/// One agent's fixed parts.
#[derive(Clone)]
pub struct AgentSpec {
    /// Host name and agent id.
    pub name: String,
    /// Region.
    pub region: &'static str,
    /// Oscillator drift, ppm (a drift fault sets it for the run).
    pub ppm: i64,
}

/// Requests answered so far, by arrival index (shared by every agent host and the driver).
pub type Answers = Arc<Mutex<Vec<Option<Record>>>>;

/// Raft timings of node `id`: fixed election timeouts, distinct per node (openraft draws the
/// timeout from `[min, max)` with an unseeded generator; a range of one value makes the draw
/// deterministic, and distinct values avoid endless split votes).
pub fn timings(id: u64) -> RaftTimings {
    let min = 600 + 250 * id;
    RaftTimings {
        heartbeat_ms: 100,
        election_timeout_min_ms: min,
        election_timeout_max_ms: min + 1,
        snapshot_every_logs: 300,
        stagger_snapshots: true,
        logs_kept_after_snapshot: 50,
    }
}

/// Opens `dir`'s sled database now, waiting in real time (not simulated time) while a crashed
/// incarnation still holds its lock. No background flusher: the stores flush inline.
fn open_db_now(dir: &Path) -> Result<sled::Db> {
    for _ in 0..1_000 {
        match sled::Config::new().path(dir).flush_every_ms(None).open() {
            Err(sled::Error::Io(e)) if e.to_string().contains("could not acquire lock") => {
                std::thread::sleep(Duration::from_millis(5));
            }
            r => return r.with_context(|| format!("open {}", dir.display())),
        }
    }
    anyhow::bail!("{} stays locked", dir.display())
}

/// The software of allocator `spec` in a cluster of `members`: the production daemon on
/// simulated TCP and inline-flushed sled, published in `slot`, then serving control messages.
pub async fn run_node(
    spec: NodeSpec,
    members: BTreeMap<u64, String>,
    slot: Arc<Mutex<NodeSlot>>,
) -> turmoil::Result {
    let db = open_db_now(&spec.dir).map_err(|e| e.to_string())?;
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
    let config = DaemonConfig {
        node: NodeConfig {
            id: spec.id,
            advertise_addr: format!("{}:{PORT}", spec.name),
            data_dir: spec.dir.clone(),
            cluster_name: "sim".into(),
            timings: timings(spec.id),
        },
        members,
        init: spec.id == 1,
        tick_every: Duration::from_millis(250),
        policies: vec![PolicyFile {
            path: PathBuf::from("sim.yaml"),
            domain: DOMAIN.into(),
            yaml: spec.policy.to_string(),
        }],
    };
    let clock = SimNodeClock::new(EPOCH_MS, spec.ppm, spec.step_ms.clone());
    let io = DaemonIo {
        incoming: net::incoming(listener),
        channels: Arc::new(net::SimChannels {
            connect_timeout: Duration::from_millis(500),
        }),
        storage: Some(NodeStorage {
            db,
            flush: Flush::Inline,
        }),
    };
    let daemon = Daemon::start_on(
        config,
        Arc::new(clock),
        io,
        Some(GroupCommitConfig::default()),
    )
    .await
    .map_err(|e| e.to_string())?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    {
        let mut s = slot.lock();
        s.node = Some(daemon.node().clone());
        s.control = Some(tx);
    }
    while let Some(c) = rx.recv().await {
        match c {
            Control::Elect => {
                let _ = daemon.node().raft().trigger().elect().await;
            }
        }
    }
    // The driver dropped the control channel: it is about to crash this host.
    std::future::pending::<()>().await;
    Ok(())
}

/// Everything an agent host needs, shared by its incarnations.
#[derive(Clone)]
pub struct AgentWorld {
    /// Its fixed parts.
    pub spec: AgentSpec,
    /// Its index.
    pub index: usize,
    /// The allocator endpoints ("host:port").
    pub endpoints: Vec<String>,
    /// The policies it enforces.
    pub policies: ConfigSet,
    /// The keys of the run.
    pub keys: Arc<Vec<Key>>,
    /// The arrivals of the run (every agent's; each sends its own).
    pub arrivals: Arc<Vec<Arrival>>,
    /// Where answers go.
    pub answers: Answers,
    /// The driver's view of it.
    pub slot: Arc<Mutex<AgentSlot>>,
    /// Backoff seed.
    pub seed: u64,
    /// Lease settings that differ from production's defaults.
    pub tuning: LeaseTuning,
}

/// Agent lease settings a run sets instead of production's defaults (`None`: the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseTuning {
    /// `report_interval_ms`: period of spend reports and lease maintenance, ms.
    pub report_interval_ms: Option<u64>,
    /// `promote_tokens`: tokens within one lease period that promote a key to leases
    /// (`u64::MAX`: never, every decision is central).
    pub promote_tokens: Option<u64>,
    /// `demote_tokens`: tokens within a lease period below which a leased key is demoted.
    pub demote_tokens: Option<u64>,
    /// `rate_leases`: ask rate-carrying allocations (design §9).
    pub rate_leases: Option<bool>,
    /// `settled_rates`: ask a rate for a key whose scarcity has settled (on by default).
    pub settled_rates: Option<bool>,
}

impl LeaseTuning {
    /// `settings` with these values set.
    pub fn apply(&self, settings: &mut LeaseSettings) {
        if let Some(ms) = self.report_interval_ms {
            settings.report_interval_ms = ms;
        }
        if let Some(p) = self.promote_tokens {
            settings.promote_tokens = p;
        }
        if let Some(d) = self.demote_tokens {
            settings.demote_tokens = d;
        }
        if let Some(r) = self.rate_leases {
            settings.rate_leases = r;
        }
        if let Some(r) = self.settled_rates {
            settings.settled_rates = r;
        }
    }
}

/// The software of an agent: the production lease path on simulated TCP and a drifting clock,
/// and its gateway sending the run's arrivals for this agent from now on (a restarted agent
/// starts empty: what it held was abandoned with the crash).
pub async fn run_agent(w: AgentWorld) -> turmoil::Result {
    let mut settings = LeaseSettings::new(w.spec.name.clone(), w.spec.region);
    settings.backoff_seed = w.seed ^ (w.index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    w.tuning.apply(&mut settings);
    let timeout = Duration::from_millis(settings.call_timeout_ms);
    let clock = Arc::new(AgentClock::new(EPOCH_MS * 1_000_000, w.spec.ppm));
    let (tx, rx) = mpsc::unbounded_channel();
    let book = Arc::new(LeaseBook::new(clock, settings, tx));
    let enforcer = Arc::new(Enforcer::new(w.policies.clone(), book.clone()));
    let link = AllocatorLink::with_connect(&w.endpoints, timeout, net::agent_connect())
        .map_err(|e| e.to_string())?;
    let manager = LeaseManager::new(book.clone(), Arc::new(link));
    // Never signalled: an agent stops only by crashing (allocations abandoned).
    let (_stop, stop_rx) = watch::channel(false);
    tokio::spawn(manager.run(rx, stop_rx));
    w.slot.lock().book = Some(book);

    let start = true_ns();
    for (i, a) in w.arrivals.iter().enumerate() {
        let at = u64::try_from(a.at.as_nanos()).unwrap_or(u64::MAX);
        if a.agent != w.index || at < start {
            continue;
        }
        let now = true_ns();
        if at > now {
            tokio::time::sleep(Duration::from_nanos(at - now)).await;
        }
        let (enforcer, keys, answers, a) =
            (enforcer.clone(), w.keys.clone(), w.answers.clone(), *a);
        tokio::spawn(async move {
            // From when the gateway's request reaches the enforcer: the arrival waited for the
            // next 1 ms step before (simulation resolution, not decision latency).
            let issued = true_ns();
            let answer = decide(&enforcer, &keys[a.key], a.cost).await;
            let answered_ns = true_ns();
            answers.lock()[i] = Some(Record {
                sent_ns: at,
                agent: a.agent,
                key: a.key,
                cost: a.cost,
                answer,
                latency_us: answered_ns.saturating_sub(issued) / 1_000,
                answered_ns,
            });
        });
    }
    std::future::pending::<()>().await;
    Ok(())
}

/// One gateway request through the agent's enforcer, as its RLS API would send it.
async fn decide(enforcer: &Enforcer, key: &Key, cost: u32) -> RequestAnswer {
    let entries: Vec<Entry<'_>> = key
        .entries
        .iter()
        .map(|(k, v)| Entry { key: k, value: v })
        .collect();
    let descriptors = [Descriptor {
        entries: &entries,
        hits_addend: None,
    }];
    let req = Request {
        domain: &key.domain,
        descriptors: &descriptors,
        hits_addend: Some(u64::from(cost)),
    };
    let mut statuses = Vec::with_capacity(1);
    match enforcer.decide(&req, &mut statuses).await {
        Ok(o) if o.code == Code::Ok => RequestAnswer::Admitted,
        Ok(_) => RequestAnswer::Denied,
        Err(_) => RequestAnswer::Error,
    }
}

/// The node specs of a cluster of `n` nodes with data under `root`, installing `policy`, all
/// in region `home` or (`None`) spread over the regions.
pub fn node_specs(
    n: usize,
    root: &Path,
    policy: &Arc<str>,
    home: Option<&'static str>,
) -> Vec<NodeSpec> {
    (1..=n as u64)
        .map(|id| NodeSpec {
            id,
            name: format!("a{id}"),
            dir: root.join(format!("a{id}")),
            step_ms: Arc::new(AtomicI64::new(0)),
            ppm: 0,
            region: home.unwrap_or(NODE_REGIONS[(id as usize - 1) % NODE_REGIONS.len()]),
            policy: policy.clone(),
        })
        .collect()
}

/// The Unix epoch of the simulation, for turmoil's own clock.
pub fn epoch() -> std::time::SystemTime {
    UNIX_EPOCH + Duration::from_millis(EPOCH_MS)
}

/// Sets `step` to `ms` (a clock fault).
pub fn set_step(step: &AtomicI64, ms: i64) {
    step.store(ms, Ordering::SeqCst);
}
