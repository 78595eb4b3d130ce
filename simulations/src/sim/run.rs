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
use allot_common::config::ConfigSet;
use anyhow::{Context, Result};
use parking_lot::Mutex;

use super::check::{Checker, HeldView, Violation};
use super::clock::set_driver_now;
use super::faults::{schedule, Fault, FaultKind, Shape};
use super::workload::{traffic, Workload, POLICY};
use super::world::{
    epoch, node_region, node_specs, run_agent, run_node, set_step, AgentSlot, AgentSpec,
    AgentWorld, Control, NodeSlot, AGENT_REGIONS, REGIONS,
};
use crate::arrivals::{Record, RequestAnswer};
use crate::ideal;

/// Nanoseconds per millisecond.
const NS_PER_MS: u64 = 1_000_000;
/// Message latency on a healthy link: uniform-ish in [0, 3] ms (turmoil's distribution).
const BASE_LATENCY: Duration = Duration::from_millis(3);
/// After a fault that cuts agents off ends, how long before false rejections count again.
const SETTLE_MS: u64 = 3_000;

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

    fn hosts_in(&self, region: &str) -> (Vec<String>, Vec<String>) {
        let mut inside = Vec::new();
        let mut outside = Vec::new();
        for (i, n) in self.node_names.iter().enumerate() {
            if node_region(i) == region {
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

fn run_in(seed: u64, config: &SimConfig, dir: &std::path::Path) -> Result<RunReport> {
    let workload = config
        .workload
        .unwrap_or(Workload::ALL[(seed % Workload::ALL.len() as u64) as usize]);
    let from = Duration::from_millis(config.traffic_from_ms);
    let until = Duration::from_millis(config.duration_ms.saturating_sub(500));
    let t = traffic(workload, &AGENT_REGIONS, from, until, seed);
    let shape = Shape {
        nodes: config.nodes,
        agents: AGENT_REGIONS.len(),
        regions: REGIONS.len(),
    };
    let faults = if config.faults {
        schedule(
            seed,
            shape,
            config.traffic_from_ms,
            config.duration_ms,
            &config.only,
        )
    } else {
        Vec::new()
    };
    let policies = ConfigSet::from_yaml(POLICY, std::path::Path::new("sim.yaml"))?;

    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_millis(config.duration_ms + 60_000))
        .tick_duration(Duration::from_millis(1))
        .epoch(epoch())
        .min_message_latency(Duration::ZERO)
        .max_message_latency(BASE_LATENCY)
        .repair_rate(0.05)
        .tcp_capacity(4_096)
        .build();

    let specs = node_specs(config.nodes, dir);
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

    let answers = Arc::new(Mutex::new(vec![None; t.arrivals.len()]));
    let keys = Arc::new(t.keys.clone());
    let arrivals = Arc::new(t.arrivals.clone());
    let mut agent_slots = Vec::new();
    let mut agent_clocks = Vec::new();
    let mut agent_names = Vec::new();
    for (i, region) in AGENT_REGIONS.iter().enumerate() {
        let ppm = faults
            .iter()
            .filter(|f| {
                matches!(f.kind, FaultKind::AgentDrift | FaultKind::AgentDriftBeyond)
                    && f.target == i
            })
            .map(|f| f.amount)
            .next_back()
            .unwrap_or(0);
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
            policies: policies.clone(),
            keys: keys.clone(),
            arrivals: arrivals.clone(),
            answers: answers.clone(),
            slot: slot.clone(),
            seed,
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
    };

    let mut checker = Checker::new(t.keys.len());
    let mut trace: Vec<(u64, String)> = Vec::new();
    let mut net = NetState::default();
    let mut last_leader = None;
    for ms in 0..config.duration_ms {
        let now = ms * NS_PER_MS;
        set_driver_now(now);
        for f in &faults {
            if f.at_ms == ms {
                trace.push((now, format!("fault on: {f}")));
                start_fault(&mut sim, &d, f, &mut checker, &t.keys, now)?;
            }
            if f.until_ms == ms {
                trace.push((now, format!("fault off: {f}")));
                end_fault(&mut sim, &d, f);
            }
        }
        net.apply(&mut sim, &d, &faults, ms);
        if ms % 10 == 0 {
            observe_agents(&d, &mut checker, now);
            let leader = leader_of(&d);
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
                n.state().read(|l| checker.sample_bounds(now, &t.keys, l));
            }
        }
        if let Err(e) = sim.step() {
            checker.violations.push(Violation {
                at_ns: now,
                kind: "host-failed",
                detail: e.to_string(),
            });
            break;
        }
    }
    set_driver_now(config.duration_ms * NS_PER_MS);
    for (i, n) in d.nodes() {
        n.state()
            .read(|l| checker.observe_ledger(config.duration_ms * NS_PER_MS, &d.node_names[i], l));
    }
    drop(sim);

    let records: Vec<Option<Record>> = answers.lock().clone();
    judge(
        seed, workload, faults, &t, policies, records, checker, trace,
    )
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
            *d.agent_slots[f.target].lock() = AgentSlot::default();
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
            *d.agent_slots[f.target].lock() = AgentSlot::default();
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
            Some(n) => n
                .state()
                .read(|l| checker.observe_agent(now, i, name, agent_now, &held, Some(l))),
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
#[allow(clippy::too_many_arguments)]
fn judge(
    seed: u64,
    workload: Workload,
    faults: Vec<Fault>,
    t: &super::workload::Traffic,
    policies: ConfigSet,
    records: Vec<Option<Record>>,
    mut checker: Checker,
    mut trace: Vec<(u64, String)>,
) -> Result<RunReport> {
    // A request its agent never answered (it was down) is a gateway error.
    let records: Vec<Record> = records
        .into_iter()
        .zip(t.arrivals.iter())
        .map(|(r, a)| {
            r.unwrap_or(Record {
                sent_ns: u64::try_from(a.at.as_nanos()).unwrap_or(u64::MAX),
                agent: a.agent,
                key: a.key,
                cost: a.cost,
                answer: RequestAnswer::Error,
                latency_us: 0,
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
