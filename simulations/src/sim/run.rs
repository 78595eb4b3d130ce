//! One seeded run: build the deployment, step it millisecond by millisecond while the fault
//! schedule plays, observe and check, then judge the whole run's answers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allot_agent::lease::LeaseBook;
use allot_allocator::ledger::Ledger;
use allot_allocator::raft::Node;
use allot_common::clock::Clock as _;
use allot_common::config::{ConfigSet, Scope};
use allot_common::units::Micros;
use anyhow::{Context, Result};
use parking_lot::Mutex;

use super::check::{Checker, HeldView, Violation};
use super::clock::set_driver_now;
use super::faults::{schedule, Fault, FaultKind, Shape};
use super::workload::{lease_life_ms, traffic, Workload, POLICY};
use super::world::{
    epoch, node_specs, run_agent, run_node, set_step, AgentSlot, AgentSpec, AgentWorld, Answers,
    Calls, Control, LeaseTuning, NodeSlot, AGENT_REGIONS, REGIONS,
};
use crate::arrivals::{Record, RequestAnswer};
use crate::ideal;

/// Nanoseconds per millisecond.
const NS_PER_MS: u64 = 1_000_000;
/// Message latency on a healthy link: uniform-ish in [0, 3] ms (turmoil's distribution).
const BASE_LATENCY: Duration = Duration::from_millis(3);
/// After a fault that cuts agents off ends, how long before false rejections count again.
const SETTLE_MS: u64 = 3_000;

/// The simulated network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    /// Allocator nodes spread over the regions; every message takes 0–3 ms (turmoil's
    /// exponential distribution): the fault sweep's network.
    Jittered,
    /// The allocator lives in one region (every node in `REGIONS[0]`); a message takes half the
    /// round trip of its link, fixed: `in_region_rtt_us` between hosts of one region,
    /// `across_rtt_us` between regions.
    Regions {
        /// Round trip between two hosts of one region, µs.
        in_region_rtt_us: u64,
        /// Round trip between hosts of different regions, µs.
        across_rtt_us: u64,
    },
}

/// How a run is shaped.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Simulated length of the run, ms.
    pub duration_ms: u64,
    /// When traffic (and faults) start, ms: the cluster has elected a leader by then.
    pub traffic_from_ms: u64,
    /// Allocator nodes (3 or 5).
    pub nodes: usize,
    /// Draw a fault schedule from the seed (else a fault-free run).
    pub faults: bool,
    /// The workload; `None` cycles through them by seed.
    pub workload: Option<Workload>,
    /// Draw faults of these kinds only (empty: any).
    pub only: Vec<FaultKind>,
    /// Play this fault schedule instead of one drawn from the seed (`faults` and `only` are
    /// then ignored).
    pub schedule: Option<Vec<Fault>>,
    /// The policy document (YAML) the allocator installs: the contract the checks and the
    /// ideal counter hold the run to.
    pub policy: String,
    /// What the agents enforce instead of `policy` (a strategy's own document).
    pub agent_policy: Option<String>,
    /// Every rule the agents enforce gets this scope (`Scope::Local`: each agent decides on
    /// its own, no allocator).
    pub agent_scope: Option<Scope>,
    /// Agent lease settings other than production's defaults.
    pub tuning: LeaseTuning,
    /// The network.
    pub network: Network,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            duration_ms: 12_000,
            traffic_from_ms: 2_000,
            nodes: 3,
            faults: true,
            workload: None,
            only: Vec::new(),
            schedule: None,
            policy: POLICY.to_string(),
            agent_policy: None,
            agent_scope: None,
            tuning: LeaseTuning::default(),
            network: Network::Jittered,
        }
    }
}

/// What one run found.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The seed.
    pub seed: u64,
    /// The workload.
    pub workload: Workload,
    /// The faults injected.
    pub faults: Vec<Fault>,
    /// Broken invariants.
    pub violations: Vec<Violation>,
    /// Whether a fault beyond the design's tolerance was injected (its violations are
    /// reported, not counted as failures).
    pub beyond_bound: bool,
    /// Worst overshoot over B + r·Δ as a fraction of the reported bound, ppm.
    pub worst_overshoot_ppm: u64,
    /// Requests sent, admitted, and answered at all.
    pub requests: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests the ideal central counter admits, sent in allocator-reachable time.
    pub ideal_admits_reachable: u64,
    /// Of those, the ones Allot denied.
    pub false_rejections: u64,
    /// Ledger invariant checks run.
    pub invariant_checks: u64,
    /// The largest bound a node reported for one key, µtokens.
    pub max_bound: u64,
    /// Hash of the run's event trace (FNV-1a 64).
    pub trace_hash: u64,
    /// The event trace: (ns, event).
    pub trace: Vec<(u64, String)>,
    /// Every request's answer, in arrival order (an agent that was down answers `Error`).
    pub records: Vec<Record>,
    /// Whether the ideal central counter admits each of `records`.
    pub ideal: Vec<bool>,
    /// Allocator calls the agents sent, summed over agents and their incarnations.
    pub calls: Calls,
    /// Tokens the ledger counts as stranded (unreported when their allocation expired), summed
    /// over keys, regions and cluster generations, µtokens.
    pub stranded: Micros,
    /// Per key, the largest bound the most advanced node reported, µtokens.
    pub max_bound_by_key: Vec<Micros>,
    /// The largest spend the agents had made and not yet reported to the most advanced
    /// ledger, summed over agents at one instant, µtokens.
    pub max_unreported: Micros,
    /// Raft log entries at the end of the run (the highest last log index of a live node; a
    /// state loss starts the log again).
    pub log_entries: u64,
}

impl RunReport {
    /// Whether the run counts as failed: a violation under faults the design tolerates.
    pub fn failed(&self) -> bool {
        !self.violations.is_empty() && !self.beyond_bound
    }

    /// The events up to and including the first violation, at most the last `n`.
    pub fn trace_to_violation(&self, n: usize) -> &[(u64, String)] {
        let end = match self.violations.first() {
            Some(v) => self.trace.partition_point(|(t, _)| *t <= v.at_ns),
            None => self.trace.len(),
        };
        &self.trace[end.saturating_sub(n)..end]
    }
}

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh directory for one run's node data: on tmpfs where there is one (the nodes flush
/// inline, and fsync there costs nothing).
fn run_dir(seed: u64) -> PathBuf {
    let base = PathBuf::from("/dev/shm");
    let base = if base.is_dir() {
        base
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "allot-sim-{}-{seed}-{}",
        std::process::id(),
        RUN_COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Runs seed `seed` shaped by `config`.
///
/// # Errors
/// The run could not be set up (data directory, policy); everything the system under test does
/// wrong is a [`Violation`] in the report instead.
pub fn run(seed: u64, config: &SimConfig) -> Result<RunReport> {
    let dir = run_dir(seed);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let result = run_in(seed, config, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The driver's handles on the deployment.
struct Deployment {
    node_names: Vec<String>,
    node_slots: Vec<Arc<Mutex<NodeSlot>>>,
    node_specs: Vec<super::world::NodeSpec>,
    agent_names: Vec<String>,
    agent_slots: Vec<Arc<Mutex<AgentSlot>>>,
    agent_clocks: Vec<super::clock::AgentClock>,
    /// Calls of agent incarnations that crashed.
    crashed_calls: Mutex<Calls>,
}

impl Deployment {
    fn nodes(&self) -> Vec<(usize, Arc<Node<Ledger>>)> {
        self.node_slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.lock().node.clone().map(|n| (i, n)))
            .collect()
    }

    /// The live node that applied the most (ties: the lowest index).
    fn most_advanced(&self) -> Option<Arc<Node<Ledger>>> {
        self.nodes()
            .into_iter()
            .max_by_key(|(i, n)| (n.state().last_applied_index(), std::cmp::Reverse(*i)))
            .map(|(_, n)| n)
    }

    /// Forgets agent `i`'s incarnation (it crashed), keeping the count of its calls.
    fn forget_agent(&self, i: usize) {
        let old = std::mem::take(&mut *self.agent_slots[i].lock());
        self.crashed_calls.lock().add(&old.calls());
    }

    /// Calls of every agent incarnation so far.
    fn calls(&self) -> Calls {
        let mut total = *self.crashed_calls.lock();
        for s in &self.agent_slots {
            total.add(&s.lock().calls());
        }
        total
    }

    /// Every host's name and region.
    fn hosts(&self) -> Vec<(String, &'static str)> {
        let nodes = self.node_names.iter().zip(&self.node_specs);
        let agents = self.agent_names.iter().zip(AGENT_REGIONS);
        nodes
            .map(|(n, s)| (n.clone(), s.region))
            .chain(agents.map(|(a, r)| (a.clone(), r)))
            .collect()
    }

    fn hosts_in(&self, region: &str) -> (Vec<String>, Vec<String>) {
        let mut inside = Vec::new();
        let mut outside = Vec::new();
        for (i, n) in self.node_names.iter().enumerate() {
            if self.node_specs[i].region == region {
                &mut inside
            } else {
                &mut outside
            }
            .push(n.clone());
        }
        for (i, a) in self.agent_names.iter().enumerate() {
            if AGENT_REGIONS[i] == region {
                &mut inside
            } else {
                &mut outside
            }
            .push(a.clone());
        }
        (inside, outside)
    }
}

/// What a run is made of before it starts: the traffic, the faults and the policies.
struct Plan {
    workload: Workload,
    traffic: super::workload::Traffic,
    faults: Vec<Fault>,
    /// The contract (the allocator's document).
    policies: ConfigSet,
    /// What the agents enforce.
    agent_policies: ConfigSet,
}

fn plan(seed: u64, config: &SimConfig) -> Result<Plan> {
    let workload = config
        .workload
        .unwrap_or(Workload::ALL[(seed % Workload::ALL.len() as u64) as usize]);
    let from = Duration::from_millis(config.traffic_from_ms);
    let until = Duration::from_millis(config.duration_ms.saturating_sub(500));
    let mut t = traffic(workload, &AGENT_REGIONS, from, until, seed);
    let shape = Shape {
        nodes: config.nodes,
        agents: AGENT_REGIONS.len(),
        regions: REGIONS.len(),
    };
    let faults = match &config.schedule {
        Some(s) => s.clone(),
        None if config.faults => schedule(
            seed,
            shape,
            config.traffic_from_ms,
            config.duration_ms,
            &config.only,
        ),
        None => Vec::new(),
    };
    let file = std::path::Path::new("sim.yaml");
    let policies = ConfigSet::from_yaml(&config.policy, file)?;
    let agent_yaml = config.agent_policy.as_deref().unwrap_or(&config.policy);
    let mut agent_policies = ConfigSet::from_yaml(agent_yaml, file)?;
    if let Some(scope) = config.agent_scope {
        agent_policies = agent_policies.with_scope(scope);
    }
    for (c, k) in t.contracts.iter_mut().zip(&t.keys) {
        if let Some(ms) = lease_life_ms(&policies, k) {
            c.lease_life_ms = ms;
        }
    }
    Ok(Plan {
        workload,
        traffic: t,
        faults,
        policies,
        agent_policies,
    })
}

/// The turmoil simulation of a run: its seed, steps and network.
///
/// Steps are 1 ms: a host's step is a tokio sleep of one step on its paused clock, and tokio's
/// timer rounds sleeps up to whole milliseconds, so a finer step would run the hosts' clocks
/// faster than the network's. A message whose latency is below 1 ms is delivered at the next
/// step.
fn simulation(seed: u64, config: &SimConfig) -> turmoil::Sim<'static> {
    turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_millis(config.duration_ms + 60_000))
        .tick_duration(Duration::from_millis(1))
        .epoch(epoch())
        .min_message_latency(Duration::ZERO)
        .max_message_latency(BASE_LATENCY)
        .repair_rate(0.05)
        .tcp_capacity(4_096)
        .build()
}

/// Adds the allocator nodes and the agents to `sim`; returns the driver's handles and the
/// answers' slots.
fn deploy(
    sim: &mut turmoil::Sim<'_>,
    seed: u64,
    config: &SimConfig,
    p: &Plan,
    dir: &std::path::Path,
) -> (Deployment, Answers) {
    let home = match config.network {
        Network::Jittered => None,
        Network::Regions { .. } => Some(REGIONS[0]),
    };
    let policy: Arc<str> = config.policy.as_str().into();
    let specs = node_specs(config.nodes, dir, &policy, home);
    let members: BTreeMap<u64, String> = specs
        .iter()
        .map(|s| (s.id, format!("{}:7700", s.name)))
        .collect();
    let endpoints: Vec<String> = members.values().cloned().collect();
    let node_slots: Vec<Arc<Mutex<NodeSlot>>> = specs.iter().map(|_| Arc::default()).collect();
    for (spec, slot) in specs.iter().zip(&node_slots) {
        let (spec, slot, members) = (spec.clone(), slot.clone(), members.clone());
        sim.host(spec.name.clone(), move || {
            run_node(spec.clone(), members.clone(), slot.clone())
        });
    }
    let t = &p.traffic;
    let answers: Answers = Arc::new(Mutex::new(vec![None; t.arrivals.len()]));
    let keys = Arc::new(t.keys.clone());
    let arrivals = Arc::new(t.arrivals.clone());
    let mut agent_slots = Vec::new();
    let mut agent_clocks = Vec::new();
    let mut agent_names = Vec::new();
    for (i, region) in AGENT_REGIONS.iter().enumerate() {
        let ppm = agent_drift(&p.faults, i);
        let name = format!("g{}", i + 1);
        let slot: Arc<Mutex<AgentSlot>> = Arc::default();
        let w = AgentWorld {
            spec: AgentSpec {
                name: name.clone(),
                region,
                ppm,
            },
            index: i,
            endpoints: endpoints.clone(),
            policies: p.agent_policies.clone(),
            keys: keys.clone(),
            arrivals: arrivals.clone(),
            answers: answers.clone(),
            slot: slot.clone(),
            seed,
            tuning: config.tuning,
        };
        sim.host(name.clone(), move || run_agent(w.clone()));
        agent_slots.push(slot);
        agent_clocks.push(super::clock::AgentClock::new(
            super::world::EPOCH_MS * NS_PER_MS,
            ppm,
        ));
        agent_names.push(name);
    }
    let d = Deployment {
        node_names: specs.iter().map(|s| s.name.clone()).collect(),
        node_slots,
        node_specs: specs,
        agent_names,
        agent_slots,
        agent_clocks,
        crashed_calls: Mutex::default(),
    };
    if let Network::Regions {
        in_region_rtt_us,
        across_rtt_us,
    } = config.network
    {
        set_link_latencies(sim, &d, in_region_rtt_us, across_rtt_us);
    }
    (d, answers)
}

/// The drift of agent `i`'s oscillator for the whole run, ppm: the last drift fault's on it.
fn agent_drift(faults: &[Fault], i: usize) -> i64 {
    faults
        .iter()
        .filter(|f| {
            matches!(f.kind, FaultKind::AgentDrift | FaultKind::AgentDriftBeyond) && f.target == i
        })
        .map(|f| f.amount)
        .next_back()
        .unwrap_or(0)
}

/// Every link's one-way latency: half its region pair's round trip (below 1 ms: one step).
fn set_link_latencies(sim: &mut turmoil::Sim<'_>, d: &Deployment, in_rtt_us: u64, across_us: u64) {
    let hosts = d.hosts();
    for (i, (a, ra)) in hosts.iter().enumerate() {
        for (b, rb) in &hosts[i + 1..] {
            let rtt = if ra == rb { in_rtt_us } else { across_us };
            sim.set_link_latency(a.as_str(), b.as_str(), Duration::from_nanos(rtt * 500));
        }
    }
}

fn run_in(seed: u64, config: &SimConfig, dir: &std::path::Path) -> Result<RunReport> {
    let p = plan(seed, config)?;
    let mut sim = simulation(seed, config);
    let (d, answers) = deploy(&mut sim, seed, config, &p, dir);
    let mut checker = Checker::new(p.traffic.keys.len());
    checker.lease_life_ns = p
        .traffic
        .contracts
        .iter()
        .map(|c| c.lease_life_ms * NS_PER_MS)
        .max()
        .unwrap_or(0);
    let mut trace: Vec<(u64, String)> = Vec::new();
    drive(&mut sim, config, &p, &d, &mut checker, &mut trace)?;
    let end = config.duration_ms * NS_PER_MS;
    set_driver_now(end);
    for (i, n) in d.nodes() {
        n.state()
            .read(|l| checker.observe_ledger(end, &d.node_names[i], l));
    }
    if let Some(n) = d.most_advanced() {
        n.state()
            .read(|l| checker.read_stranded(&p.traffic.keys, l));
    }
    let calls = d.calls();
    let log_entries = d
        .nodes()
        .iter()
        .filter_map(|(_, n)| n.raft().metrics().borrow().last_log_index)
        .max()
        .unwrap_or(0);
    drop(sim);
    let records: Vec<Option<Record>> = answers.lock().clone();
    let mut report = judge(seed, p, records, checker, trace)?;
    report.calls = calls;
    report.log_entries = log_entries;
    Ok(report)
}

/// Steps the simulation through the run, millisecond by millisecond: faults on and off, the
/// network's state, observations of agents and ledgers, then the steps of that millisecond.
fn drive(
    sim: &mut turmoil::Sim<'_>,
    config: &SimConfig,
    p: &Plan,
    d: &Deployment,
    checker: &mut Checker,
    trace: &mut Vec<(u64, String)>,
) -> Result<()> {
    let keys = &p.traffic.keys;
    let mut net = NetState::default();
    let mut last_leader = None;
    for ms in 0..config.duration_ms {
        let now = ms * NS_PER_MS;
        set_driver_now(now);
        checker.observe_logs(
            d.nodes()
                .iter()
                .filter_map(|(_, n)| n.raft().metrics().borrow().last_log_index),
        );
        for f in &p.faults {
            if f.at_ms == ms {
                trace.push((now, format!("fault on: {f}")));
                start_fault(sim, d, f, checker, keys, now)?;
            }
            if f.until_ms == ms {
                trace.push((now, format!("fault off: {f}")));
                end_fault(sim, d, f);
            }
        }
        net.apply(sim, d, &p.faults, ms);
        if ms % 10 == 0 {
            observe_agents(d, checker, now);
            let leader = leader_of(d);
            if leader != last_leader {
                trace.push((now, format!("leader: {leader:?}")));
                last_leader = leader;
            }
        }
        if ms % 50 == 0 {
            for (i, n) in d.nodes() {
                n.state()
                    .read(|l| checker.observe_ledger(now, &d.node_names[i], l));
            }
        }
        if ms % 100 == 0 {
            if let Some(n) = d.most_advanced() {
                n.state().read(|l| checker.sample_bounds(now, keys, l));
            }
        }
        if let Err(e) = sim.step() {
            checker.violations.push(Violation {
                at_ns: now,
                kind: "host-failed",
                detail: e.to_string(),
            });
            return Ok(());
        }
    }
    Ok(())
}

/// The network's wanted state from the faults on at a given ms: cut pairs, held pairs, latency
/// and link failures; applied as differences.
#[derive(Default)]
struct NetState {
    cut: BTreeSet<(String, String)>,
    held: BTreeSet<(String, String)>,
    delay_ms: Option<i64>,
    flaky: bool,
}

impl NetState {
    fn apply(&mut self, sim: &mut turmoil::Sim<'_>, d: &Deployment, faults: &[Fault], ms: u64) {
        let on: Vec<&Fault> = faults
            .iter()
            .filter(|f| f.at_ms <= ms && ms < f.until_ms)
            .collect();
        let mut cut = BTreeSet::new();
        let mut held = BTreeSet::new();
        let pair = |a: &str, b: &str| {
            if a < b {
                (a.to_string(), b.to_string())
            } else {
                (b.to_string(), a.to_string())
            }
        };
        for f in &on {
            match f.kind {
                FaultKind::PartitionAgent | FaultKind::Hold => {
                    let a = &d.agent_names[f.target];
                    let set = if f.kind == FaultKind::Hold {
                        &mut held
                    } else {
                        &mut cut
                    };
                    for n in &d.node_names {
                        set.insert(pair(a, n));
                    }
                }
                FaultKind::PartitionNode => {
                    let a = &d.node_names[f.target];
                    for n in d.node_names.iter().filter(|n| *n != a) {
                        cut.insert(pair(a, n));
                    }
                }
                FaultKind::RegionCut => {
                    let (inside, outside) = d.hosts_in(REGIONS[f.target]);
                    for a in &inside {
                        for b in &outside {
                            cut.insert(pair(a, b));
                        }
                    }
                }
                _ => {}
            }
        }
        for p in self.cut.difference(&cut) {
            sim.repair(p.0.as_str(), p.1.as_str());
        }
        for p in cut.difference(&self.cut) {
            sim.partition(p.0.as_str(), p.1.as_str());
        }
        for p in self.held.difference(&held) {
            sim.release(p.0.as_str(), p.1.as_str());
        }
        for p in held.difference(&self.held) {
            sim.hold(p.0.as_str(), p.1.as_str());
        }
        self.cut = cut;
        self.held = held;
        let delay = on
            .iter()
            .filter(|f| f.kind == FaultKind::Delay)
            .map(|f| f.amount)
            .max();
        if delay != self.delay_ms {
            let d = delay.map_or(BASE_LATENCY, |ms| Duration::from_millis(ms.unsigned_abs()));
            sim.set_max_message_latency(d);
            self.delay_ms = delay;
        }
        let flaky = on.iter().any(|f| f.kind == FaultKind::FlakyLinks);
        if flaky != self.flaky {
            sim.set_fail_rate(if flaky { 0.002 } else { 0.0 });
            self.flaky = flaky;
        }
    }
}

/// The current leader as the most advanced node sees it: (id, term).
fn leader_of(d: &Deployment) -> Option<(u64, u64)> {
    let n = d.most_advanced()?;
    let m = n.raft().metrics().borrow().clone();
    m.current_leader.map(|l| (l, m.current_term))
}

/// Crashes allocator node `i`: the driver lets go of it first (so its database closes with its
/// runtime), then turmoil drops the host's runtime.
fn crash_node(sim: &mut turmoil::Sim<'_>, d: &Deployment, i: usize) {
    *d.node_slots[i].lock() = NodeSlot::default();
    // Overlapping faults may crash a host that is down already.
    if sim.is_host_running(d.node_names[i].as_str()) {
        sim.crash(d.node_names[i].as_str());
    }
}

/// Restarts allocator node `i` from its data (bouncing a running host crashes it first).
fn restart_node(sim: &mut turmoil::Sim<'_>, d: &Deployment, i: usize) {
    *d.node_slots[i].lock() = NodeSlot::default();
    sim.bounce(d.node_names[i].as_str());
}

fn start_fault(
    sim: &mut turmoil::Sim<'_>,
    d: &Deployment,
    f: &Fault,
    checker: &mut Checker,
    keys: &[crate::arrivals::Key],
    now: u64,
) -> Result<()> {
    match f.kind {
        FaultKind::NodeCrash => crash_node(sim, d, f.target),
        FaultKind::LeaderChange => {
            let leader = leader_of(d).map(|(id, _)| id);
            // A follower's detector fires first: the lowest-indexed live follower.
            let follower = d
                .node_slots
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(d.node_specs[*i].id) != leader)
                .find_map(|(_, s)| s.lock().control.clone());
            if let Some(c) = follower {
                let _ = c.send(Control::Elect);
            }
        }
        FaultKind::ClockStep | FaultKind::ClockStepBeyond => {
            set_step(&d.node_specs[f.target].step_ms, f.amount);
        }
        FaultKind::AgentCrash => {
            d.forget_agent(f.target);
            if sim.is_host_running(d.agent_names[f.target].as_str()) {
                sim.crash(d.agent_names[f.target].as_str());
            }
        }
        FaultKind::StateLoss => {
            // The bound just before the loss, then every node loses its data.
            if let Some(n) = d.most_advanced() {
                n.state().read(|l| checker.sample_bounds(now, keys, l));
            }
            checker.state_lost(now);
            for i in 0..d.node_names.len() {
                crash_node(sim, d, i);
            }
            for s in &d.node_specs {
                // The lock is released with the last handle (no flusher thread), so the
                // directory can go now; a stale lock would only delay the reopen.
                std::fs::remove_dir_all(&s.dir)
                    .with_context(|| format!("wipe {}", s.dir.display()))?;
            }
            for i in 0..d.node_names.len() {
                restart_node(sim, d, i);
            }
        }
        _ => {}
    }
    Ok(())
}

fn end_fault(sim: &mut turmoil::Sim<'_>, d: &Deployment, f: &Fault) {
    match f.kind {
        FaultKind::NodeCrash => restart_node(sim, d, f.target),
        FaultKind::AgentCrash => {
            d.forget_agent(f.target);
            sim.bounce(d.agent_names[f.target].as_str());
        }
        FaultKind::ClockStep | FaultKind::ClockStepBeyond => {
            set_step(&d.node_specs[f.target].step_ms, 0);
        }
        _ => {}
    }
}

/// What each agent holds, checked against the most advanced ledger.
fn observe_agents(d: &Deployment, checker: &mut Checker, now: u64) {
    let node = d.most_advanced();
    for (i, slot) in d.agent_slots.iter().enumerate() {
        let Some(book) = slot.lock().book.clone() else {
            continue;
        };
        let held = held_by(&book);
        let agent_now = d.agent_clocks[i].now();
        let name = &d.agent_names[i];
        match &node {
            Some(n) => {
                let applied = n.state().last_applied_index().unwrap_or(0);
                n.state().read(|l| {
                    checker.observe_agent(now, i, name, agent_now, &held, Some((l, applied)));
                });
            }
            None => checker.observe_agent(now, i, name, agent_now, &held, None),
        }
    }
}

fn held_by(book: &LeaseBook) -> Vec<HeldView> {
    let mut out = Vec::new();
    for table in book.tables() {
        for kl in table.snapshot() {
            for a in kl.value.allocations().iter() {
                out.push(HeldView {
                    id: a.id,
                    epoch: a.epoch,
                    granted: a.granted,
                    base: a.base,
                    spent: a.spent(),
                    deadline: a.deadline,
                    closed: a.is_closed(),
                });
            }
        }
    }
    out.sort_by_key(|h| (h.id, h.deadline));
    out
}

/// Judges the run's answers: the admission bound per key, false rejections against the ideal
/// central counter in allocator-reachable time, and the trace and its hash.
fn judge(
    seed: u64,
    p: Plan,
    records: Vec<Option<Record>>,
    mut checker: Checker,
    mut trace: Vec<(u64, String)>,
) -> Result<RunReport> {
    let Plan {
        workload,
        traffic: t,
        faults,
        policies,
        ..
    } = p;
    // A request its agent never answered (it was down) is a gateway error.
    let records: Vec<Record> = records
        .into_iter()
        .zip(t.arrivals.iter())
        .map(|(r, a)| {
            let sent_ns = u64::try_from(a.at.as_nanos()).unwrap_or(u64::MAX);
            r.unwrap_or(Record {
                sent_ns,
                agent: a.agent,
                key: a.key,
                cost: a.cost,
                answer: RequestAnswer::Error,
                latency_us: 0,
                answered_ns: sent_ns,
            })
        })
        .collect();
    let mut worst = 0;
    let mut by_key: Vec<Vec<&Record>> = vec![Vec::new(); t.keys.len()];
    for r in &records {
        by_key[r.key].push(r);
    }
    for (k, rs) in by_key.iter().enumerate() {
        if !rs.is_empty() {
            worst = worst.max(checker.check_bounds(k, t.contracts[k], rs));
        }
    }
    let ideal = ideal::admitted(policies, &t.keys, &records)?;
    let reachable = |ns: u64| {
        let ms = ns / NS_PER_MS;
        !faults
            .iter()
            .any(|f| f.kind.cuts_allocator() && f.at_ms <= ms && ms < f.until_ms + SETTLE_MS)
    };
    let mut ideal_admits = 0;
    let mut false_rejections = 0;
    for (r, ok) in records.iter().zip(&ideal) {
        if *ok && reachable(r.sent_ns) && r.answer != RequestAnswer::Error {
            ideal_admits += 1;
            if r.answer == RequestAnswer::Denied {
                false_rejections += 1;
            }
        }
        trace.push((
            r.sent_ns,
            format!(
                "g{} key {} cost {} {:?}",
                r.agent + 1,
                r.key,
                r.cost,
                r.answer
            ),
        ));
    }
    for v in &checker.violations {
        trace.push((v.at_ns, format!("VIOLATION {}: {}", v.kind, v.detail)));
    }
    trace.sort_by_key(|(t, _)| *t);
    let trace_hash = fnv1a(&trace);
    let stranded = checker.stranded();
    Ok(RunReport {
        seed,
        workload,
        beyond_bound: faults.iter().any(|f| f.kind.beyond_bound()),
        faults,
        violations: checker.violations,
        worst_overshoot_ppm: worst,
        requests: records.len() as u64,
        admitted: records
            .iter()
            .filter(|r| r.answer == RequestAnswer::Admitted)
            .count() as u64,
        ideal_admits_reachable: ideal_admits,
        false_rejections,
        invariant_checks: checker.invariant_checks,
        max_bound: checker.max_bound,
        trace_hash,
        trace,
        records,
        ideal,
        calls: Calls::default(),
        log_entries: 0,
        max_unreported: checker.max_unreported,
        stranded,
        max_bound_by_key: checker.max_bound_by_key,
    })
}

/// FNV-1a 64 over the trace's times and texts.
fn fnv1a(trace: &[(u64, String)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (t, s) in trace {
        for b in t.to_le_bytes().iter().chain(s.as_bytes()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
