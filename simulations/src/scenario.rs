//! The Acme story (the README's; design §3, §5, §6) on a running deployment, driven through the
//! agents' Envoy RLS API with real gRPC clients. Every row prints what the contract allows next to
//! what was measured; the bound is the allocator's Σ(granted − reported) over live allocations.

use crate::local::{allocator_client, Deployment};
use crate::rls::{client, request};
use crate::table::column_width;
use allot_proto::allot::v1 as pb;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use anyhow::{Context, Result};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Story part (a–d).
    pub part: String,
    /// What was done.
    pub what: String,
    /// What the contract allows.
    pub allowed: String,
    /// What was measured.
    pub measured: String,
    /// Whether the measurement is within what the contract (plus the computed bound) allows.
    pub within: bool,
}

/// The scenario's result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The rows, in story order.
    pub rows: Vec<Row>,
    /// Raw figures, for tests and `--json`.
    pub figures: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    /// Whether every row is within its contract.
    pub fn all_within(&self) -> bool {
        self.rows.iter().all(|r| r.within)
    }

    /// The table for humans.
    pub fn table(&self) -> String {
        let (w1, w2, w3) = (
            column_width(&self.rows, |r| &r.what, 4),
            column_width(&self.rows, |r| &r.allowed, 15),
            column_width(&self.rows, |r| &r.measured, 8),
        );
        let mut s = format!(
            "{:<4}  {:<w1$}  {:<w2$}  {:<w3$}  within\n",
            "part", "what", "contract allows", "measured"
        );
        for r in &self.rows {
            s.push_str(&format!(
                "{:<4}  {:<w1$}  {:<w2$}  {:<w3$}  {}\n",
                r.part,
                r.what,
                r.allowed,
                r.measured,
                if r.within { "yes" } else { "NO" }
            ));
        }
        s
    }
}

/// How long each timed part runs.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Part b: sustained overload, s (the story: 30).
    pub sustained_s: u64,
    /// Part c: longest wait for the handoff, s.
    pub skew_timeout_s: u64,
    /// Part d: load after killing the leader, s.
    pub failover_s: u64,
}

impl Timing {
    /// The story's durations.
    pub const FULL: Timing = Timing {
        sustained_s: 30,
        skew_timeout_s: 20,
        failover_s: 6,
    };
    /// A shortened run for tests.
    pub const SHORT: Timing = Timing {
        sustained_s: 5,
        skew_timeout_s: 15,
        failover_s: 4,
    };
}

fn acme_entries() -> Vec<(String, String)> {
    vec![
        ("tenant".into(), "acme".into()),
        ("operation".into(), "search".into()),
    ]
}

fn search_entries() -> Vec<(String, String)> {
    vec![("cluster".into(), "search".into())]
}

fn micros_to_tokens(m: u64) -> f64 {
    m as f64 / 1_000_000.0
}

/// Σ over regions of the allocator's overshoot bound for a key, in tokens, and the regions'
/// live allocations, read from the leader (0 for a key the allocator does not know).
pub(crate) async fn bound(
    d: &Deployment,
    domain: &str,
    entries: &[(String, String)],
) -> Result<(f64, u64)> {
    let (_, leader) = d.wait_leader(Duration::from_secs(10)).await?;
    let mut c = allocator_client(&leader)?;
    let r = c
        .status(pb::StatusRequest {
            key: Some(pb::PolicyKey {
                domain: domain.into(),
                entries: entries
                    .iter()
                    .map(|(k, v)| pb::DescriptorEntry {
                        key: k.clone(),
                        value: v.clone(),
                    })
                    .collect(),
            }),
        })
        .await;
    match r {
        Ok(r) => {
            let r = r.into_inner();
            let b: u64 = r.regions.iter().map(|x| x.overshoot_bound).sum();
            let live: u64 = r.regions.iter().map(|x| x.live_allocations).sum();
            Ok((micros_to_tokens(b), live))
        }
        Err(s) if s.code() == tonic::Code::NotFound => Ok((0.0, 0)),
        Err(s) => Err(s).context("allocator status"),
    }
}

/// RLS addresses of the agents in `regions`.
fn rls_of(d: &Deployment, regions: &[&str]) -> Vec<String> {
    d.agents
        .iter()
        .filter(|a| regions.contains(&a.region.as_str()))
        .map(|a| a.rls.clone())
        .collect()
}

/// Counts of one paced load, per time slot.
struct Slots {
    width: Duration,
    ok: Vec<AtomicU64>,
    over: AtomicU64,
    errors: AtomicU64,
}

impl Slots {
    fn new(width: Duration, total: Duration) -> Arc<Self> {
        let n = (total.as_nanos() / width.as_nanos()) as usize + 2;
        Arc::new(Slots {
            width,
            ok: (0..n).map(|_| AtomicU64::new(0)).collect(),
            over: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        })
    }

    fn ok_total(&self) -> u64 {
        self.ok.iter().map(|x| x.load(Ordering::Relaxed)).sum()
    }

    fn ok_at(&self, i: usize) -> u64 {
        self.ok.get(i).map_or(0, |x| x.load(Ordering::Relaxed))
    }
}

/// Sends `rate` requests/s to the RLS at `addr` from `t0` for `dur`, counting answers into
/// `slots` by the slot of their send time.
async fn pace(
    addr: String,
    domain: &'static str,
    entries: Vec<(String, String)>,
    rate: u64,
    t0: Instant,
    dur: Duration,
    slots: Arc<Slots>,
) -> Result<()> {
    let c = client(&addr)?;
    let n = (u128::from(rate) * dur.as_nanos() / 1_000_000_000) as u64;
    let step = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let due = t0 + step * i as u32;
        tokio::time::sleep_until(due.into()).await;
        let mut c = c.clone();
        let req = request(domain, &entries, 1);
        let slots = slots.clone();
        tasks.spawn(async move {
            let slot = (due.duration_since(t0).as_nanos() / slots.width.as_nanos()) as usize;
            match c.should_rate_limit(req).await {
                Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => {
                    if let Some(s) = slots.ok.get(slot) {
                        s.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(_) => {
                    slots.over.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    slots.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Part a: 80 requests almost at once over the acme agents of two regions.
async fn burst(
    d: &Deployment,
    rows: &mut Vec<Row>,
    fig: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let agents = rls_of(d, &["eu-west", "us-east"]);
    let clients = agents
        .iter()
        .map(|a| client(a))
        .collect::<Result<Vec<_>>>()?;
    let via_envoy = !d.gateways.is_empty();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let gateways: Vec<String> = d.gateways.iter().map(|g| g.http.clone()).collect();
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..80usize {
        if via_envoy {
            // The batch job's HTTP requests, through real Envoy proxies.
            let url = format!("http://{}/search", gateways[i % gateways.len()]);
            let http = http.clone();
            tasks.spawn(async move {
                matches!(http.get(url).header("x-tenant", "acme").send().await,
                    Ok(r) if r.status() == reqwest::StatusCode::OK)
            });
            continue;
        }
        let mut c = clients[i % clients.len()].clone();
        tasks.spawn(async move {
            matches!(c.should_rate_limit(request("acme", &acme_entries(), 1)).await,
                Ok(r) if r.get_ref().overall_code == Code::Ok as i32)
        });
    }
    let mut admitted = 0u64;
    while let Some(r) = tasks.join_next().await {
        if matches!(r, Ok(true)) {
            admitted += 1;
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let (b, _) = bound(d, "acme", &acme_entries()).await?;
    let allows = 40.0 + 10.0 * elapsed;
    let overshoot = (admitted as f64 - allows).max(0.0);
    rows.push(Row {
        part: "a".into(),
        what: format!(
            "09:00 burst: 80 {} over {} gateways, 2 regions",
            if via_envoy {
                "HTTP requests via Envoy"
            } else {
                "RLS requests"
            },
            agents.len()
        ),
        allowed: format!("≤ {allows:.1} (burst 40 + 10/s × {elapsed:.2} s)"),
        measured: format!("{admitted} admitted, {} denied", 80 - admitted),
        within: admitted as f64 <= allows + b,
    });
    rows.push(Row {
        part: "a".into(),
        what: "  overshoot vs computed bound Σ(granted − reported)".into(),
        allowed: format!("≤ {b:.1} tokens (bound)"),
        measured: format!("{overshoot:.1} tokens"),
        within: overshoot <= b,
    });
    fig.insert("a_admitted".into(), admitted.into());
    fig.insert("a_seconds".into(), elapsed.into());
    fig.insert("a_bound_tokens".into(), b.into());
    fig.insert("a_overshoot_tokens".into(), overshoot.into());
    Ok(())
}

/// Part b: 15 req/s against the 10/s contract.
async fn sustained(
    d: &Deployment,
    t: Timing,
    rows: &mut Vec<Row>,
    fig: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let agents = rls_of(d, &["eu-west", "us-east"]);
    let dur = Duration::from_secs(t.sustained_s);
    let slots = Slots::new(Duration::from_secs(1), dur);
    let t0 = Instant::now() + Duration::from_millis(50);
    // 15/s in total: spread evenly, each agent offset so requests interleave.
    let mut tasks = tokio::task::JoinSet::new();
    let per = 15.0 / agents.len() as f64;
    let step = Duration::from_secs_f64(1.0 / 15.0);
    for (i, a) in agents.iter().enumerate() {
        let (a, slots) = (a.clone(), slots.clone());
        let start = t0 + step * i as u32;
        let rate = per;
        tasks.spawn(async move {
            // Sub-1/s per-agent rates: pace by period instead of a per-second count.
            let period = Duration::from_secs_f64(1.0 / rate);
            let c = client(&a)?;
            let mut k = 0u32;
            loop {
                let due = start + period * k;
                if due >= t0 + dur {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
                let mut c = c.clone();
                let ok = matches!(c.should_rate_limit(request("acme", &acme_entries(), 1)).await,
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32);
                let slot = (due.duration_since(t0).as_secs()) as usize;
                if ok {
                    if let Some(s) = slots.ok.get(slot) {
                        s.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    slots.over.fetch_add(1, Ordering::Relaxed);
                }
                k += 1;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let secs = t.sustained_s as f64;
    let admitted = slots.ok_total();
    let rate = admitted as f64 / secs;
    let (b, _) = bound(d, "acme", &acme_entries()).await?;
    let allows = 40.0 + 10.0 * secs;
    rows.push(Row {
        part: "b".into(),
        what: format!("{} s of 15 req/s against the 10/s contract", t.sustained_s),
        allowed: format!("10/s sustained (≤ {allows:.0} incl. burst)"),
        measured: format!("{rate:.2}/s ({admitted} admitted)"),
        within: admitted as f64 <= allows + b,
    });
    fig.insert("b_admitted".into(), admitted.into());
    fig.insert("b_rate".into(), rate.into());
    Ok(())
}

/// Part c: eu-west rises to 650/s while ap-south idles; shares move by versioned handoff.
async fn skew(
    d: &Deployment,
    t: Timing,
    rows: &mut Vec<Row>,
    fig: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let eu = rls_of(d, &["eu-west"]);
    let us = rls_of(d, &["us-east"]);
    let baseline = Duration::from_secs(4);
    let total = baseline + Duration::from_secs(t.skew_timeout_s);
    let width = Duration::from_millis(250);
    let (eu_slots, us_slots) = (Slots::new(width, total), Slots::new(width, total));
    let t0 = Instant::now() + Duration::from_millis(100);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, a) in eu.iter().enumerate() {
        // 650/s in total, split exactly (217 + 217 + 216 for three agents).
        let n = eu.len() as u64;
        let rate = 650 / n + u64::from((i as u64) < 650 % n);
        tasks.spawn(pace(
            a.clone(),
            "search",
            search_entries(),
            rate,
            t0,
            total,
            eu_slots.clone(),
        ));
    }
    for a in &us {
        let rate = 300 / us.len() as u64;
        tasks.spawn(pace(
            a.clone(),
            "search",
            search_entries(),
            rate,
            t0,
            total,
            us_slots.clone(),
        ));
    }
    tokio::time::sleep_until((t0 + baseline).into()).await;
    // The operator's rebalance: eu-west 65%, us-east 35%, ap-south (idle) 0%.
    let (_, leader) = d.wait_leader(Duration::from_secs(5)).await?;
    let mut c = allocator_client(&leader)?;
    let share = |region: &str, ppm: u32| pb::RegionShare {
        region: region.into(),
        share: Some(pb::region_share::Share::FractionPpm(ppm)),
    };
    let set_at = Instant::now();
    c.set_shares(pb::SetSharesRequest {
        policy: "search-cluster".into(),
        shares: vec![
            share("eu-west", 650_000),
            share("us-east", 350_000),
            share("ap-south", 0),
        ],
        config_version: 1,
        request_id: "acme-story-rebalance".into(),
    })
    .await
    .context("set shares")?;
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    // Rolling one-second eu-west rate after the handoff.
    let per_s = (Duration::from_secs(1).as_nanos() / width.as_nanos()) as usize;
    let first = (set_at.duration_since(t0).as_nanos() / width.as_nanos()) as usize;
    // The last full window ends with the load (the final slot is partial).
    let last = (total.as_nanos() / width.as_nanos()) as usize;
    let windows = last.saturating_sub(per_s);
    let eu_rate = |i: usize| -> u64 { (i..i + per_s).map(|j| eu_slots.ok_at(j)).sum() };
    let mut max_global = 0u64;
    for i in 0..=windows {
        let us_rate: u64 = (i..i + per_s).map(|j| us_slots.ok_at(j)).sum();
        max_global = max_global.max(eu_rate(i) + us_rate);
    }
    // Sustained, not a one-off: the first 1 s window that starts 2 s of windows all ≥ 640/s
    // (the capacity a raised share adds at once could lift a single window on its own).
    let hold = 2 * per_s;
    let reached = (first..=windows.saturating_sub(hold))
        .find(|&i| (i..=i + hold).all(|j| eu_rate(j) >= 640))
        .map(|i| ((i + per_s) - first) as f64 * width.as_secs_f64());
    let tail = eu_rate(windows);
    let (b, _) = bound(d, "search", &search_entries()).await?;
    rows.push(Row {
        part: "c".into(),
        what: "skew: eu-west 650/s, us-east 300/s, ap-south idle; shares 500/400/100 → 650/350/0"
            .into(),
        allowed: "eu-west ≥ 640/s once the handoff completes".into(),
        measured: match reached {
            Some(s) => format!("≥ 640/s for 2 s from {s:.2} s on (last 1 s: {tail}/s)"),
            None => format!(
                "not sustained in {} s (last 1 s: {tail}/s)",
                t.skew_timeout_s
            ),
        },
        within: reached.is_some(),
    });
    rows.push(Row {
        part: "c".into(),
        what: "  global admitted rate, worst 1 s window".into(),
        allowed: format!("≤ 1000/s (+ burst 1000 + bound {b:.0})"),
        measured: format!("{max_global}/s"),
        within: max_global as f64 <= 1000.0 + 1000.0 + b,
    });
    fig.insert("c_eu_last_second".into(), tail.into());
    fig.insert(
        "c_seconds_to_640".into(),
        reached.map_or(serde_json::Value::Null, Into::into),
    );
    fig.insert("c_max_global_per_s".into(), max_global.into());
    Ok(())
}

/// Part d: kill the allocator leader under load.
async fn failover(
    d: &mut Deployment,
    t: Timing,
    rows: &mut Vec<Row>,
    fig: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let agents = rls_of(d, &["eu-west", "us-east"]);
    let before = Duration::from_secs(2);
    let total = before + Duration::from_secs(t.failover_s);
    let width = Duration::from_millis(100);
    let slots = Slots::new(width, total);
    let t0 = Instant::now() + Duration::from_millis(100);
    let mut tasks = tokio::task::JoinSet::new();
    for a in &agents {
        tasks.spawn(pace(
            a.clone(),
            "search",
            search_entries(),
            300 / agents.len() as u64,
            t0,
            total,
            slots.clone(),
        ));
    }
    tokio::time::sleep_until((t0 + before).into()).await;
    let (leader_id, _) = d.wait_leader(Duration::from_secs(5)).await?;
    let killed_at = Instant::now();
    if let Some(a) = d.allocators.iter_mut().find(|a| a.id == leader_id) {
        a.crash().await?;
    }
    let (new_leader, _) = d.wait_leader(Duration::from_secs(15)).await?;
    let election = killed_at.elapsed().as_secs_f64();
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    // Longest run of 100 ms slots with nothing admitted, after the kill.
    let first = (killed_at.duration_since(t0).as_nanos() / width.as_nanos()) as usize;
    let last = (total.as_nanos() / width.as_nanos()) as usize;
    let (mut gap, mut run) = (0usize, 0usize);
    for i in first..last {
        if slots.ok_at(i) == 0 {
            run += 1;
            gap = gap.max(run);
        } else {
            run = 0;
        }
    }
    let admitted = slots.ok_total();
    let secs = total.as_secs_f64();
    let (b, _) = bound(d, "search", &search_entries()).await?;
    let allows = 1000.0 + 1000.0 * secs;
    rows.push(Row {
        part: "d".into(),
        what: format!("kill allocator leader (node {leader_id}) under 300 req/s"),
        allowed: "decisions continue from allocations".into(),
        measured: format!(
            "new leader node {new_leader} after {election:.2} s; longest gap {} ms",
            gap * width.as_millis() as usize
        ),
        within: gap * (width.as_millis() as usize) < 1_000 * t.failover_s as usize,
    });
    rows.push(Row {
        part: "d".into(),
        what: "  admitted during the run vs contract".into(),
        allowed: format!("≤ {allows:.0} + bound {b:.0}"),
        measured: format!(
            "{admitted} admitted, {} errors",
            slots.errors.load(Ordering::Relaxed)
        ),
        within: admitted as f64 <= allows + b,
    });
    fig.insert("d_election_s".into(), election.into());
    fig.insert(
        "d_gap_ms".into(),
        ((gap as u64) * width.as_millis() as u64).into(),
    );
    fig.insert("d_admitted".into(), admitted.into());
    // The crashed node rejoins from its data folder.
    d.restart_allocator(leader_id)?;
    d.wait_node(leader_id, Duration::from_secs(30)).await?;
    Ok(())
}

/// Runs parts a–d.
///
/// # Errors
/// When the deployment stops answering.
pub async fn acme(d: &mut Deployment, t: Timing) -> Result<Report> {
    let mut rows = Vec::new();
    let mut fig = serde_json::Map::new();
    burst(d, &mut rows, &mut fig).await?;
    sustained(d, t, &mut rows, &mut fig).await?;
    skew(d, t, &mut rows, &mut fig).await?;
    failover(d, t, &mut rows, &mut fig).await?;
    Ok(Report { rows, figures: fig })
}
