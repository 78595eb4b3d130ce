//! `allot-bench memory` (issue 13 item 3): resident memory per key of the agent and the
//! allocator, measured on real processes.
//!
//! Each part starts its own deployment (one allocator node, a cluster of one, and one agent;
//! [`crate::local`]), reads both processes' `VmRSS` once they answer (the baseline), drives
//! keys through the agent's Envoy RLS API and reads `VmRSS` again. Bytes per key is the growth
//! over the baseline divided by the keys the processes report holding (the agent's
//! `allot_agent_lease_keys`, the allocator's `keys` table), so a key that was refused or
//! forgotten is not counted as measured.
//!
//! * **idle**: one request per key with the default settings (a key seen once is decided
//!   centrally, by the allocator's `Decide`), then no traffic for longer than the lease TTL +
//!   drift and until the agent holds no allocation: the agent's cost of a key it remembers but
//!   holds nothing for. Idle keys are kept for the measurement (`idle_evict_ms` 1 h; by default
//!   they are forgotten after 60 s).
//! * **leased**: the same with a 15-minute lease (`memory-leased.yaml`) and no early return, so
//!   every key holds one live allocation at once: the allocator's cost of a key with a live
//!   allocation (the agent's is reported too).
//! * **steady**: default agent settings (central decisions for the tail, leases for the head,
//!   idle keys forgotten after 60 s), Zipf(1.1) over the keys at a fixed rate; both RSS sampled
//!   every `sample` for `duration`: the series, the growth over the run and over its second
//!   half, and the second half's trend (Theil–Sen, robust to the samples that fall in a
//!   snapshot build), on which "no growth" is judged.

use crate::local::{allocator_client, assemble_policies, Deployment, Plan};
use crate::rls::{run_load, Keys, LoadReport};
use crate::zipf::Zipf;
use allot_proto::allot::v1 as pb;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The parts, in the order they run.
pub const PARTS: [&str; 3] = ["idle", "leased", "steady"];

/// Target of issue 13: bytes per idle key in the agent (1 KB, read as 1,000 bytes).
pub const AGENT_IDLE_TARGET: f64 = 1_000.0;
/// Target of issue 13: bytes per key with a live allocation in the allocator (2 KB).
pub const ALLOCATOR_LEASED_TARGET: f64 = 2_000.0;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Folder of `allot-allocator` and `allot-agent`.
    pub bin_dir: PathBuf,
    /// Root data folder (one subfolder a part).
    pub data_dir: PathBuf,
    /// Distinct keys.
    pub keys: u32,
    /// Requests per second while keys are made known (one request a key).
    pub fill_rate: u64,
    /// Requests per second of the steady part.
    pub steady_rate: u64,
    /// Length of the steady part.
    pub duration: Duration,
    /// Time between two samples of the steady part.
    pub sample: Duration,
    /// Parts to run (all when empty).
    pub parts: Vec<String>,
    /// Times the idle and leased parts run (each on a fresh deployment; the steady part runs
    /// once); at least 1.
    pub rounds: u32,
}

/// Resident memory of the two processes, bytes.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Rss {
    /// The agent's VmRSS.
    pub agent: u64,
    /// The allocator's VmRSS.
    pub allocator: u64,
}

/// What the processes said they hold when a sample was read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Held {
    /// Keys of leased rules the agent remembers (`allot_agent_lease_keys`).
    pub agent_keys: u64,
    /// Allocations the agent holds (`allot_agent_allocations_held`).
    pub agent_allocations: u64,
    /// The allocator's capped tables: name → entries (`keys`, `allocations`, `requests`, …).
    pub allocator_tables: BTreeMap<String, u64>,
}

/// One measured part.
#[derive(Debug, Clone, Serialize)]
pub struct PartReport {
    /// Part name.
    pub part: String,
    /// Which run of the part this is, from 1 (see [`Options::rounds`]).
    pub round: u32,
    /// What was done.
    pub what: String,
    /// RSS right after start-up.
    pub baseline: Rss,
    /// RSS at the measurement (idle, leased) or the samples (steady: seconds since the load
    /// started, RSS, what was held).
    pub samples: Vec<(u64, Rss, Held)>,
    /// The load that made the keys known (or the steady load, summed).
    pub load: LoadSummary,
    /// Processes that did not stop cleanly after the part (after its figures were read).
    pub unclean_exits: Vec<String>,
}

/// Answers of the load of a part.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LoadSummary {
    /// Requests sent.
    pub sent: u64,
    /// Admitted.
    pub ok: u64,
    /// Denied.
    pub over_limit: u64,
    /// Failed.
    pub errors: u64,
}

impl LoadSummary {
    fn add(&mut self, r: &LoadReport) {
        self.sent += r.sent;
        self.ok += r.ok;
        self.over_limit += r.over_limit;
        self.errors += r.errors;
    }
}

/// The keys the allocator reports holding (its `policy_keys` table; 0 when not reported).
fn allocator_keys(held: &Held) -> u64 {
    held.allocator_tables
        .get("policy_keys")
        .copied()
        .unwrap_or(0)
}

/// Growth of `after` over `before` divided by `n`, bytes (negative when it shrank).
pub fn per_key(before: u64, after: u64, n: u64) -> f64 {
    (after as f64 - before as f64) / n.max(1) as f64
}

impl PartReport {
    /// The last sample.
    fn last(&self) -> Option<&(u64, Rss, Held)> {
        self.samples.last()
    }

    /// Rows of the summary table: (figure, measured, target, met).
    pub fn rows(&self) -> Vec<[String; 4]> {
        let mut rows = Vec::new();
        let Some((_, rss, held)) = self.last() else {
            return rows;
        };
        let b = &self.baseline;
        let alloc_keys = allocator_keys(held);
        let alloc_live = held
            .allocator_tables
            .get("allocations")
            .copied()
            .unwrap_or(0);
        let (agent, allocator) = self.bytes_per_key().unwrap_or_default();
        let mb = |x: u64| format!("{:.1} MB", x as f64 / 1e6);
        match self.part.as_str() {
            "idle" => {
                rows.push([
                    format!(
                        "agent, idle key ({} keys, {} allocations held)",
                        held.agent_keys, held.agent_allocations
                    ),
                    format!("{agent:.0} B/key ({} → {})", mb(b.agent), mb(rss.agent)),
                    "≤ 1,000 B".into(),
                    yes(agent <= AGENT_IDLE_TARGET),
                ]);
                rows.push([
                    format!("allocator, key with no live allocation ({alloc_keys} keys, {alloc_live} live)"),
                    format!("{allocator:.0} B/key ({} → {})", mb(b.allocator), mb(rss.allocator)),
                    "-".into(),
                    "-".into(),
                ]);
            }
            "leased" => {
                rows.push([
                    format!("allocator, key with a live allocation ({alloc_keys} keys, {alloc_live} live)"),
                    format!("{allocator:.0} B/key ({} → {})", mb(b.allocator), mb(rss.allocator)),
                    "≤ 2,000 B".into(),
                    yes(allocator <= ALLOCATOR_LEASED_TARGET),
                ]);
                rows.push([
                    format!(
                        "agent, key with a live allocation ({} keys, {} held)",
                        held.agent_keys, held.agent_allocations
                    ),
                    format!("{agent:.0} B/key ({} → {})", mb(b.agent), mb(rss.agent)),
                    "-".into(),
                    "-".into(),
                ]);
            }
            _ => {
                for (who, pick) in [
                    ("agent", (|r: &Rss| r.agent) as fn(&Rss) -> u64),
                    ("allocator", |r: &Rss| r.allocator),
                ] {
                    let g = self.growth(pick);
                    rows.push([
                        format!(
                            "{who} RSS growth, first sample → last / middle → last / \
                             second half's trend (Theil–Sen)"
                        ),
                        format!(
                            "{:+.1} MB ({:+.1}%) / {:+.1} MB ({:+.1}%) / {:+.1}%",
                            g.whole as f64 / 1e6,
                            g.whole_pct,
                            g.second_half as f64 / 1e6,
                            g.second_half_pct,
                            g.second_half_trend_pct
                        ),
                        "no growth (second half's trend ≤ +1%)".into(),
                        yes(g.second_half_trend_pct <= 1.0),
                    ]);
                }
            }
        }
        rows
    }

    /// The part's targeted figure, (what, bytes per key, target bytes): the agent's idle key
    /// (idle), the allocator's key with a live allocation (leased); `None` for the steady part
    /// or a part without a sample.
    pub fn targeted(&self) -> Option<(&'static str, f64, f64)> {
        let (agent, allocator) = self.bytes_per_key()?;
        match self.part.as_str() {
            "idle" => Some(("agent, idle key", agent, AGENT_IDLE_TARGET)),
            "leased" => Some((
                "allocator, key with a live allocation",
                allocator,
                ALLOCATOR_LEASED_TARGET,
            )),
            _ => None,
        }
    }

    /// (agent, allocator) bytes per key at the last sample: RSS growth over the baseline per key
    /// each process reports holding; `None` without a sample.
    fn bytes_per_key(&self) -> Option<(f64, f64)> {
        let (_, rss, held) = self.last()?;
        let b = &self.baseline;
        Some((
            per_key(b.agent, rss.agent, held.agent_keys),
            per_key(b.allocator, rss.allocator, allocator_keys(held)),
        ))
    }

    /// Growth of one process's RSS over the samples.
    pub fn growth(&self, pick: fn(&Rss) -> u64) -> Growth {
        let s: Vec<(u64, u64)> = self.samples.iter().map(|(t, r, _)| (*t, pick(r))).collect();
        growth(&s)
    }
}

/// Growth of a series of RSS samples, bytes and percent.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Growth {
    /// Last sample minus the first.
    pub whole: i64,
    /// `whole` as a percentage of the first.
    pub whole_pct: f64,
    /// Last sample minus the middle one (index len / 2).
    pub second_half: i64,
    /// `second_half` as a percentage of the middle one.
    pub second_half_pct: f64,
    /// The second half's trend: the Theil–Sen slope of the samples from the middle one on
    /// (the median of the slopes between every pair of them), times the second half's
    /// duration, as a percentage of those samples' median. One or two samples taken while the
    /// allocator copies its ledger for a snapshot (a peak of about twice the resting size)
    /// move the middle → last figure by tens of percent; they barely move this one (the
    /// median ignores up to about 29 % of outlying samples).
    pub second_half_trend_pct: f64,
}

/// Growth of `samples`, (seconds since the start, bytes) in time order (no growth for fewer
/// than two).
pub fn growth(samples: &[(u64, u64)]) -> Growth {
    let (Some(&(_, first)), Some(&(_, last))) = (samples.first(), samples.last()) else {
        return Growth {
            whole: 0,
            whole_pct: 0.0,
            second_half: 0,
            second_half_pct: 0.0,
            second_half_trend_pct: 0.0,
        };
    };
    let half = &samples[samples.len() / 2..];
    let mid = half[0].1;
    let pct = |from: u64, to: u64| (to as f64 - from as f64) * 100.0 / from.max(1) as f64;
    Growth {
        whole: last as i64 - first as i64,
        whole_pct: pct(first, last),
        second_half: last as i64 - mid as i64,
        second_half_pct: pct(mid, last),
        second_half_trend_pct: trend_pct(half),
    }
}

/// The Theil–Sen trend of `samples` over their duration, percent of their median; 0 for
/// fewer than two samples or no time between them.
fn trend_pct(samples: &[(u64, u64)]) -> f64 {
    let mut slopes = Vec::new();
    for (i, &(ti, yi)) in samples.iter().enumerate() {
        for &(tj, yj) in &samples[i + 1..] {
            if tj > ti {
                slopes.push((yj as f64 - yi as f64) / (tj - ti) as f64);
            }
        }
    }
    let mut ys: Vec<f64> = samples.iter().map(|&(_, y)| y as f64).collect();
    let (Some(slope), Some(level)) = (median(&mut slopes), median(&mut ys)) else {
        return 0.0;
    };
    let span = samples.last().map_or(0, |s| s.0) - samples.first().map_or(0, |s| s.0);
    slope * span as f64 * 100.0 / level.max(1.0)
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
fn median(v: &mut [f64]) -> Option<f64> {
    spread(v).map(|(_, mid, _)| mid)
}

fn yes(b: bool) -> String {
    if b { "yes" } else { "no" }.to_string()
}

/// How long the idle part waits after its last request: the lease TTL (5 s) + drift (500 ms)
/// + one report interval (1 s) + a margin.
const IDLE_WAIT: Duration = Duration::from_millis(7_500);

/// The agent settings of a part (`None`: the defaults).
fn agent_settings(part: &str) -> Option<&'static str> {
    match part {
        // Default decisions (a key seen once is decided centrally); idle keys kept for the
        // measurement.
        "idle" => Some("lease: {idle_evict_ms: 3600000}\n"),
        // As idle, and allocations kept until their (15-minute) lease ends.
        "leased" => Some("lease: {promote_tokens: 0, idle_evict_ms: 3600000, idle_return_ms: 0}\n"),
        _ => None,
    }
}

/// Runs the parts and returns their reports; `progress` gets a line at each step.
///
/// # Errors
/// An unknown part, a deployment that does not start, or processes whose memory cannot be read.
pub async fn run(o: &Options, mut progress: impl FnMut(&str)) -> Result<Vec<PartReport>> {
    for p in &o.parts {
        if !PARTS.contains(&p.as_str()) {
            bail!("unknown part {p:?}; the parts are {}", PARTS.join(", "));
        }
    }
    let mut out = Vec::new();
    for part in PARTS {
        if !o.parts.is_empty() && !o.parts.iter().any(|p| p == part) {
            continue;
        }
        let rounds = if part == "steady" { 1 } else { o.rounds.max(1) };
        for round in 1..=rounds {
            if rounds > 1 {
                progress(&format!("{part}: round {round} of {rounds}"));
            }
            let mut r = run_once(o, part, &mut progress).await?;
            r.round = round;
            out.push(r);
        }
    }
    Ok(out)
}

/// One run of `part` on a deployment of its own.
async fn run_once(o: &Options, part: &str, progress: &mut impl FnMut(&str)) -> Result<PartReport> {
    let dir = o.data_dir.join(part);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let policies = dir.join("policies");
    assemble_policies(
        &[PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/policies/memory"
        ))],
        &policies,
    )?;
    let settings = match agent_settings(part) {
        Some(text) => {
            let f = dir.join("agent.yaml");
            std::fs::write(&f, text)?;
            Some(f)
        }
        None => None,
    };
    let plan = Plan {
        bin_dir: o.bin_dir.clone(),
        policies,
        data_dir: dir.clone(),
        agents: vec![("eu-west".into(), 1)],
        envoy: None,
        gateway_regions: Vec::new(),
        allocator_nodes: 1,
        agent_settings: settings,
    };
    progress(&format!("{part}: starting 1 allocator and 1 agent"));
    let d = Deployment::start(&plan).await?;
    let r = run_part(&d, part, o, progress).await;
    let unclean = d.shutdown().await;
    let mut r = r?;
    // Reported, not fatal: the figures were read before the shutdown (an agent releasing
    // 100,000 allocations on a loaded machine can outlast the launcher's 10 s).
    r.unclean_exits = unclean;
    Ok(r)
}

async fn run_part(
    d: &Deployment,
    part: &str,
    o: &Options,
    progress: &mut impl FnMut(&str),
) -> Result<PartReport> {
    let m = Meter::of(d)?;
    // Let start-up settle (policy install, first ticks) before the baseline.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let baseline = m.rss()?;
    let rls = &d.agents[0].rls;
    let tenant = [("tenant".to_string(), "t".to_string())];
    let mut load = LoadSummary::default();
    let mut samples = Vec::new();
    let what;
    match part {
        "idle" | "leased" => {
            let domain = if part == "idle" {
                "memory"
            } else {
                "memory-leased"
            };
            let secs = u64::from(o.keys).div_ceil(o.fill_rate.max(1));
            let rate = u64::from(o.keys).div_ceil(secs.max(1));
            progress(&format!(
                "{part}: {} keys, one request each at {rate}/s",
                o.keys
            ));
            let r = run_load(
                rls,
                domain,
                &tenant,
                Keys::RoundRobin(o.keys),
                rate,
                Duration::from_secs(secs),
                4096,
            )
            .await?;
            load.add(&r);
            let t0 = Instant::now();
            let held = if part == "idle" {
                // Idle for longer than the lease TTL + drift (5.5 s) plus a report interval,
                // and until the agent holds nothing.
                tokio::time::sleep(IDLE_WAIT).await;
                let h = m
                    .wait_until(Duration::from_secs(60), |h| h.agent_allocations == 0)
                    .await?;
                what = format!(
                    "{} keys, one request each (default settings: decided centrally), then idle until the agent holds no allocation ({:.0} s)",
                    o.keys,
                    t0.elapsed().as_secs_f64()
                );
                h
            } else {
                // Wait until every acquire is granted (the last answers of the load).
                let h = m
                    .wait_until(Duration::from_secs(60), |h| {
                        h.allocator_tables.get("allocations").copied().unwrap_or(0)
                            >= u64::from(o.keys)
                    })
                    .await;
                let h = match h {
                    Ok(h) => h,
                    Err(_) => m.held().await?,
                };
                tokio::time::sleep(Duration::from_secs(2)).await;
                what = format!(
                    "{} keys leased once each (promote_tokens 0, 15 min TTL, no early return): every key holds a live allocation",
                    o.keys
                );
                h
            };
            let rss = m.rss()?;
            // What is held is read again after the RSS (the reads allocate a little).
            let after = m.held().await?;
            samples.push((t0.elapsed().as_secs(), rss, merge(held, after)));
        }
        _ => {
            let dist = Zipf::new(o.keys, 1.1)?;
            let chunk = o.sample.max(Duration::from_secs(1));
            let n = (o.duration.as_secs() / chunk.as_secs()).max(1);
            what = format!(
                "{}/s, Zipf(1.1) over {} keys, default agent settings, {} samples every {} s",
                o.steady_rate,
                o.keys,
                n,
                chunk.as_secs()
            );
            let t0 = Instant::now();
            for i in 0..n {
                let r = run_load(
                    rls,
                    "memory",
                    &tenant,
                    Keys::Zipf {
                        dist: dist.clone(),
                        seed: i + 1,
                    },
                    o.steady_rate,
                    chunk,
                    4096,
                )
                .await?;
                load.add(&r);
                let rss = m.rss()?;
                let held = m.held().await?;
                progress(&format!(
                    "steady: {:>4} s  agent {:.1} MB  allocator {:.1} MB  agent keys {}  allocator keys {}",
                    t0.elapsed().as_secs(),
                    rss.agent as f64 / 1e6,
                    rss.allocator as f64 / 1e6,
                    held.agent_keys,
                    held.allocator_tables.get("policy_keys").copied().unwrap_or(0)
                ));
                samples.push((t0.elapsed().as_secs(), rss, held));
            }
        }
    }
    Ok(PartReport {
        part: part.to_string(),
        round: 1,
        what,
        baseline,
        samples,
        load,
        unclean_exits: Vec::new(),
    })
}

/// The key counts of `before` (read when the state was reached) with anything `after` adds.
fn merge(before: Held, after: Held) -> Held {
    Held {
        agent_keys: after.agent_keys.max(before.agent_keys),
        agent_allocations: after.agent_allocations,
        allocator_tables: after.allocator_tables,
    }
}

/// Reads the two processes' memory and what they hold.
struct Meter {
    agent_pid: u32,
    allocator_pid: u32,
    metrics_url: String,
    allocator: String,
    http: reqwest::Client,
}

impl Meter {
    fn of(d: &Deployment) -> Result<Self> {
        let agent = d.agents.first().context("no agent")?;
        let node = d.allocators.first().context("no allocator")?;
        Ok(Meter {
            agent_pid: agent.pid().context("agent not running")?,
            allocator_pid: node.pid().context("allocator not running")?,
            metrics_url: format!("http://{}/metrics", agent.http),
            allocator: node.addr.clone(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
        })
    }

    fn rss(&self) -> Result<Rss> {
        let read = |pid| rss_bytes(pid).with_context(|| format!("VmRSS of process {pid}"));
        Ok(Rss {
            agent: read(self.agent_pid)?,
            allocator: read(self.allocator_pid)?,
        })
    }

    async fn held(&self) -> Result<Held> {
        let text = self
            .http
            .get(&self.metrics_url)
            .send()
            .await?
            .text()
            .await?;
        let s = allocator_client(&self.allocator)?
            .cluster_status(pb::ClusterStatusRequest {})
            .await
            .context("cluster status")?
            .into_inner();
        Ok(Held {
            agent_keys: gauge(&text, "allot_agent_lease_keys").unwrap_or(0),
            agent_allocations: gauge(&text, "allot_agent_allocations_held").unwrap_or(0),
            allocator_tables: s.tables.into_iter().map(|t| (t.table, t.entries)).collect(),
        })
    }

    /// Polls every second until `done`; the last reading when it never is within `within`
    /// is an error.
    async fn wait_until(&self, within: Duration, done: impl Fn(&Held) -> bool) -> Result<Held> {
        let t0 = Instant::now();
        loop {
            let h = self.held().await?;
            if done(&h) {
                return Ok(h);
            }
            if t0.elapsed() > within {
                bail!("not reached within {within:?}: {h:?}");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// The value of an unlabelled gauge `name` in a Prometheus text exposition.
pub fn gauge(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = match rest.strip_prefix('{') {
            Some(labels) => labels.split_once('}')?.1,
            None => rest,
        };
        if !rest.starts_with(' ') {
            return None;
        }
        let v: f64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(v as u64)
    })
}

/// VmRSS of process `pid`, bytes (Linux; None elsewhere).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// The reports as a text table: per part, what was done, then its figures; then the steady
/// part's series.
pub fn table(reports: &[PartReport]) -> String {
    let mut out = String::new();
    let mut rows: Vec<[String; 5]> = vec![[
        "part".into(),
        "figure".into(),
        "measured".into(),
        "target".into(),
        "met".into(),
    ]];
    let several = |part: &str| reports.iter().filter(|r| r.part == part).count() > 1;
    for r in reports {
        let label = match several(&r.part) {
            true => format!("{} #{}", r.part, r.round),
            false => r.part.clone(),
        };
        for [a, b, c, d] in r.rows() {
            rows.push([label.clone(), a, b, c, d]);
        }
    }
    for part in PARTS.iter().filter(|p| several(p)) {
        rows.extend(median_row(reports.iter().filter(|r| r.part == *part)));
    }
    let widths: Vec<usize> = (0..5)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for r in reports {
        let l = r.load;
        out += &format!(
            "{}: {} (load: {} sent, {} admitted, {} denied, {} failed)\n",
            r.part, r.what, l.sent, l.ok, l.over_limit, l.errors
        );
        for u in &r.unclean_exits {
            out += &format!("{}: after the measurement, unclean exit: {u}\n", r.part);
        }
    }
    out.push('\n');
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        out += cells.join("  ").trim_end();
        out.push('\n');
    }
    for r in reports.iter().filter(|r| r.part == "steady") {
        out += &format!(
            "\nsteady series (baseline: agent {:.1} MB, allocator {:.1} MB)\n",
            r.baseline.agent as f64 / 1e6,
            r.baseline.allocator as f64 / 1e6
        );
        out += "     s  agent MB  allocator MB  agent keys  allocator keys  allocator allocations  allocator requests\n";
        for (s, rss, h) in &r.samples {
            let t = |n: &str| h.allocator_tables.get(n).copied().unwrap_or(0);
            out += &format!(
                "{s:>6}  {:>8.1}  {:>12.1}  {:>10}  {:>14}  {:>21}  {:>18}\n",
                rss.agent as f64 / 1e6,
                rss.allocator as f64 / 1e6,
                h.agent_keys,
                t("policy_keys"),
                t("allocations"),
                t("requests"),
            );
        }
    }
    out
}

/// The median over the rounds of one part of its targeted figure, with the range; `met`
/// judged on the median. `None` without a targeted figure.
fn median_row<'a>(rounds: impl Iterator<Item = &'a PartReport>) -> Option<[String; 5]> {
    let mut part = String::new();
    let mut what = "";
    let mut target = 0.0;
    let mut v: Vec<f64> = Vec::new();
    for r in rounds {
        let (w, x, t) = r.targeted()?;
        (part, what, target) = (r.part.clone(), w, t);
        v.push(x);
    }
    let (lo, mid, hi) = spread(&mut v)?;
    Some([
        format!("{part} median"),
        format!("{what}, median of {} rounds", v.len()),
        format!("{mid:.0} B/key (range {lo:.0}–{hi:.0})"),
        format!("≤ {target:.0} B"),
        yes(mid <= target),
    ])
}

/// (min, median, max) of `v` (sorted in place; the median of an even count is the mean of the
/// middle two); `None` when empty.
fn spread(v: &mut [f64]) -> Option<(f64, f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let mid = match n {
        0 => return None,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    Some((v[0], mid, v[n - 1]))
}

/// Where a part's data goes when none is given: a new temporary folder.
pub fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("allot-memory-{}", std::process::id()))
}

/// Whether `dir` holds the binaries.
pub fn has_binaries(dir: &Path) -> bool {
    ["allot-allocator", "allot-agent"]
        .iter()
        .all(|b| dir.join(b).exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spread_of_rounds_is_min_median_max() {
        assert_eq!(spread(&mut []), None);
        assert_eq!(spread(&mut [5.0]), Some((5.0, 5.0, 5.0)));
        assert_eq!(spread(&mut [3.0, 1.0, 2.0]), Some((1.0, 2.0, 3.0)));
        assert_eq!(spread(&mut [4.0, 1.0, 2.0, 3.0]), Some((1.0, 2.5, 4.0)));
    }

    #[test]
    fn several_rounds_get_a_median_row_judged_on_the_median() {
        let report = |round, allocator: u64| {
            let mut held = Held::default();
            held.allocator_tables.insert("policy_keys".into(), 1_000);
            PartReport {
                part: "leased".into(),
                round,
                what: "w".into(),
                baseline: Rss::default(),
                samples: vec![(
                    0,
                    Rss {
                        agent: 0,
                        allocator,
                    },
                    held,
                )],
                load: LoadSummary::default(),
                unclean_exits: Vec::new(),
            }
        };
        // 2,500, 1,900 and 1,800 B per key: the median, 1,900, meets 2,000.
        let rs = [
            report(1, 2_500_000),
            report(2, 1_900_000),
            report(3, 1_800_000),
        ];
        let row = median_row(rs.iter()).expect("a targeted figure");
        assert_eq!(row[0], "leased median");
        assert_eq!(row[2], "1900 B/key (range 1800–2500)");
        assert_eq!(row[4], yes(true));
        let t = table(&rs);
        assert!(t.contains("leased #3"), "{t}");
        assert!(t.contains("median of 3 rounds"), "{t}");
    }

    #[test]
    fn a_gauge_is_read_with_or_without_labels_and_not_by_prefix() {
        let text = "# HELP x\nallot_agent_lease_keys_other 7\nallot_agent_lease_keys{otel_scope_name=\"a\"} 100000\nallot_agent_allocations_held 3\n";
        assert_eq!(gauge(text, "allot_agent_lease_keys"), Some(100_000));
        assert_eq!(gauge(text, "allot_agent_allocations_held"), Some(3));
        assert_eq!(gauge(text, "allot_agent_missing"), None);
    }

    /// `v` as samples taken every 60 s from 0.
    fn every_minute(v: &[u64]) -> Vec<(u64, u64)> {
        v.iter()
            .enumerate()
            .map(|(i, &y)| (60 * i as u64, y))
            .collect()
    }

    #[test]
    fn growth_compares_the_last_sample_with_the_first_and_the_middle() {
        let g = growth(&every_minute(&[100, 150, 200, 200, 202]));
        assert_eq!(g.whole, 102);
        assert_eq!(g.second_half, 2);
        assert!((g.second_half_pct - 1.0).abs() < 1e-9);
        assert_eq!(growth(&[]).whole, 0);
        assert_eq!(growth(&[(0, 5)]).second_half, 0);
        assert_eq!(growth(&[(0, 5)]).second_half_trend_pct, 0.0);
        assert_eq!(growth(&every_minute(&[10, 5])).whole, -5);
    }

    #[test]
    fn the_trend_ignores_snapshot_peaks_and_sees_a_steady_rise() {
        // Flat at 100 in the second half with two peaks, one of them the last sample: the
        // middle → last figure reads +50 %, the trend nothing.
        let mut v = vec![90; 10];
        v.extend([100, 100, 160, 100, 100, 100, 100, 100, 100, 100, 150]);
        let g = growth(&every_minute(&v));
        assert!((g.second_half_pct - 50.0).abs() < 1e-9, "{g:?}");
        assert!(g.second_half_trend_pct.abs() < 1e-9, "{g:?}");
        // A rise of 1 per minute over 4 minutes from 100: 4 % of the median (102).
        let g = growth(&every_minute(&[50, 60, 70, 80, 100, 101, 102, 103, 104]));
        assert!(
            (g.second_half_trend_pct - 400.0 / 102.0).abs() < 1e-9,
            "{g:?}"
        );
        // Uneven sample times are taken into account: 2 per 60 s over 120 s.
        let g = growth(&[(0, 100), (60, 102), (180, 106)]);
        assert!((g.second_half_trend_pct - 2.0 / 60.0 * 120.0 * 100.0 / 104.0).abs() < 1e-9);
    }

    #[test]
    fn per_key_divides_the_growth_and_never_by_zero() {
        assert_eq!(per_key(1_000, 101_000, 100), 1_000.0);
        assert_eq!(per_key(1_000, 500, 0), -500.0);
    }
}
