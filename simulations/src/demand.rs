//! Quota follows demand (issue 9, "How it is measured"): parts that send recorded traffic
//! through the agents and compare what Allot admitted with what the ideal central counter
//! ([`crate::ideal`]) admits for the very same arrivals. Every row shows ideal admitted, Allot
//! admitted, their ratio, Allot's overshoot over the ideal against the allocator's bound, the
//! part's target and whether it is met. The harness reports; it does not decide what passes.

use crate::arrivals::{drive, paced, Arrival, Key, Record, RequestAnswer};
use crate::local::{allocator_client, Deployment};
use crate::memory::rss_bytes;
use crate::table::column_width;
use crate::zipf::{SplitMix64, Zipf};
use allot_common::config::{ConfigSet, Scope};
use allot_common::Limiter;
use allot_proto::allot::v1 as pb;
use anyhow::{Context, Result};
use serde::Serialize;
use shortfall::Shortfall;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

mod denials;
mod parts;
mod shortfall;
mod skew;

pub use parts::PARTS;

/// How long the timed parts run.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Quiet tenant: one request every 3 s for this long, s.
    pub quiet_s: u64,
    /// Only eu-west busy at 15/s, s.
    pub eu_busy_s: u64,
    /// Many tenants at 3,000 req/s, s.
    pub tenants_s: u64,
    /// Part c: the skew (eu-west 650/s, us-east 300/s, ap-south idle), s.
    pub skew_s: u64,
    /// Part c: ap-south resumes at 100/s for this long, s.
    pub resume_s: u64,
    /// Lease traffic, each rate, s.
    pub lease_s: u64,
}

impl Timing {
    /// The durations of issue 9.
    pub const FULL: Timing = Timing {
        quiet_s: 30,
        eu_busy_s: 30,
        tenants_s: 60,
        skew_s: 15,
        resume_s: 10,
        lease_s: 10,
    };
    /// Shortened, for tests.
    pub const SHORT: Timing = Timing {
        quiet_s: 12,
        eu_busy_s: 8,
        tenants_s: 10,
        skew_s: 8,
        resume_s: 6,
        lease_s: 5,
    };
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Part name (`--part`).
    pub part: String,
    /// What was sent.
    pub what: String,
    /// Requests sent.
    pub sent: u64,
    /// What the ideal central counter admits for the same arrivals.
    pub ideal: u64,
    /// What Allot admitted.
    pub allot: u64,
    /// Allot over ideal (1 when the ideal admits nothing and neither does Allot).
    pub ratio: f64,
    /// Requests that failed (transport error, timeout).
    pub errors: u64,
    /// Σ over the part's keys of Allot's admitted tokens above the ideal's since the run began.
    pub overshoot: u64,
    /// The allocator's bound Σ(granted − reported) for the keys that overshoot, plus the refill
    /// during the slowest answer (the agent decides after the recorded send time), tokens.
    pub bound: f64,
    /// Overshoot ≤ bound, and no request failed.
    pub within: bool,
    /// Further figures (latency, allocator memory, Raft entries, handoff times).
    pub measured: String,
    /// The part's target (issue 9).
    pub target: String,
    /// Whether the target is met.
    pub target_met: bool,
    /// Raw figures of the part.
    pub figures: serde_json::Map<String, serde_json::Value>,
}

/// The scenario's result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// One row per part, in run order.
    pub rows: Vec<Row>,
}

impl Report {
    /// Whether every row is within its invariant (overshoot ≤ bound, no errors).
    pub fn all_within(&self) -> bool {
        self.rows.iter().all(|r| r.within)
    }

    /// The table for humans.
    pub fn table(&self) -> String {
        let wp = column_width(&self.rows, |r| &r.part, 4);
        let ww = column_width(&self.rows, |r| &r.what, 4);
        let wm = column_width(&self.rows, |r| &r.measured, 8);
        let wt = column_width(&self.rows, |r| &r.target, 6);
        let mut s = format!(
            "{:<wp$}  {:<ww$}  {:>6}  {:>6}  {:>6}  {:>9}  {:>10}  within  {:<wm$}  {:<wt$}  target met\n",
            "part", "what", "ideal", "allot", "ratio", "overshoot", "bound", "measured", "target"
        );
        for r in &self.rows {
            s.push_str(&format!(
                "{:<wp$}  {:<ww$}  {:>6}  {:>6}  {:>6.3}  {:>9}  {:>10.1}  {:<6}  {:<wm$}  {:<wt$}  {}\n",
                r.part,
                r.what,
                r.ideal,
                r.allot,
                r.ratio,
                r.overshoot,
                r.bound,
                if r.within { "yes" } else { "NO" },
                r.measured,
                r.target,
                if r.target_met { "yes" } else { "no" },
            ));
        }
        s
    }
}

/// What a part measured besides the counts, and its target.
pub(crate) struct Extra {
    /// Further figures, one line.
    pub measured: String,
    /// The target.
    pub target: String,
    /// Whether the target is met, given the ratio.
    pub met: Box<dyn Fn(f64) -> bool + Send>,
    /// Raw figures.
    pub figures: serde_json::Map<String, serde_json::Value>,
}

/// One run of parts on one deployment: the keys, the ideal counter (fed each part's records
/// after the part, so its state carries over exactly as Allot's does) and the totals per key.
pub struct Run<'a> {
    pub(crate) d: &'a Deployment,
    pub(crate) origin: Instant,
    keys: Vec<Key>,
    index: HashMap<Key, usize>,
    ideal: Limiter,
    /// Per key: (Allot admitted tokens, ideal admitted tokens) since the run began.
    totals: Vec<(u64, u64)>,
    /// Contract rate per key, tokens/s (for the latency refill allowance).
    rates: Vec<u64>,
    /// What the agents counted as denials by cause during the last `send`.
    denials: denials::Denials,
    pub(crate) rows: Vec<Row>,
}

impl<'a> Run<'a> {
    /// A run on `d`, whose agents and allocators load the policies at `policies`.
    ///
    /// # Errors
    /// The policies cannot be loaded.
    pub fn new(d: &'a Deployment, policies: &Path) -> Result<Self> {
        let set = ConfigSet::load(policies).context("policies for the ideal counter")?;
        Ok(Run {
            d,
            origin: Instant::now(),
            keys: Vec::new(),
            index: HashMap::new(),
            ideal: Limiter::new(set.with_scope(Scope::Local), 0),
            totals: Vec::new(),
            rates: Vec::new(),
            denials: denials::Denials::default(),
            rows: Vec::new(),
        })
    }

    /// The index of a key (added on first use) with its contract rate, tokens/s.
    pub(crate) fn key(&mut self, domain: &str, entries: &[(&str, &str)], rate: u64) -> usize {
        let k = Key {
            domain: domain.to_string(),
            entries: entries
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        };
        if let Some(&i) = self.index.get(&k) {
            return i;
        }
        self.keys.push(k.clone());
        self.totals.push((0, 0));
        self.rates.push(rate);
        self.index.insert(k, self.keys.len() - 1);
        self.keys.len() - 1
    }

    /// Indexes of the agents of `regions`, in deployment order.
    pub(crate) fn agents_of(&self, regions: &[&str]) -> Vec<usize> {
        (0..self.d.agents.len())
            .filter(|&i| regions.contains(&self.d.agents[i].region.as_str()))
            .collect()
    }

    /// Sends `arrivals` now and returns their records (send order); the agents' denials by
    /// cause while they ran are kept for [`Run::finish`].
    pub(crate) async fn send(&mut self, arrivals: &[Arrival]) -> Result<Vec<Record>> {
        let agents: Vec<String> = self.d.agents.iter().map(|a| a.rls.clone()).collect();
        let before = denials::scrape(self.d).await?;
        let start = Instant::now() + Duration::from_millis(20);
        let records = drive(&agents, &self.keys, arrivals, self.origin, start).await?;
        self.denials = denials::scrape(self.d).await?.since(before);
        Ok(records)
    }

    /// Decides `records` with the ideal counter, adds both sides to the per-key totals, reads
    /// the bound of every key that overshoots and appends the part's row.
    pub(crate) async fn finish(
        &mut self,
        part: &str,
        what: String,
        records: &[Record],
        extra: Extra,
    ) -> Result<()> {
        let ideal = crate::ideal::admitted_with(&self.ideal, &self.keys, records)?;
        let mut touched: Vec<usize> = records.iter().map(|r| r.key).collect();
        touched.sort_unstable();
        touched.dedup();
        let (mut allot, mut ideal_n, mut errors, mut worst_us) = (0u64, 0u64, 0u64, 0u64);
        let (mut allot_tokens, mut ideal_tokens) = (0u64, 0u64);
        let mut false_rejections = 0u64;
        let mut shortfall = Shortfall::default();
        for (r, ok) in records.iter().zip(&ideal) {
            false_rejections += u64::from(*ok && r.answer != RequestAnswer::Admitted);
            shortfall.add(r, *ok);
            let t = &mut self.totals[r.key];
            if r.answer == RequestAnswer::Admitted {
                allot += 1;
                allot_tokens = allot_tokens.saturating_add(u64::from(r.cost));
                t.0 = t.0.saturating_add(u64::from(r.cost));
                worst_us = worst_us.max(r.latency_us);
            }
            if *ok {
                ideal_n += 1;
                ideal_tokens = ideal_tokens.saturating_add(u64::from(r.cost));
                t.1 = t.1.saturating_add(u64::from(r.cost));
            }
            errors += u64::from(r.answer == RequestAnswer::Error);
        }
        let over: HashMap<usize, u64> = touched
            .iter()
            .map(|&k| (k, self.totals[k].0.saturating_sub(self.totals[k].1)))
            .filter(|(_, o)| *o > 0)
            .collect();
        let overshoot: u64 = over.values().sum();
        // Every key's bound when there are few, else those of the keys that overshoot.
        let read: Vec<usize> = if touched.len() <= MAX_BOUND_READS {
            touched
        } else {
            over.keys().copied().take(MAX_BOUND_READS).collect()
        };
        let mut bound = 0.0;
        let mut within = errors == 0 && over.keys().all(|k| read.contains(k));
        for k in read {
            let b = self.bound_of(k).await? + self.rates[k] as f64 * worst_us as f64 / 1e6;
            bound += b;
            within &= over.get(&k).is_none_or(|&o| o as f64 <= b);
        }
        let ratio = if ideal_n == 0 {
            if allot == 0 {
                1.0
            } else {
                f64::INFINITY
            }
        } else {
            allot as f64 / ideal_n as f64
        };
        let mut figures = extra.figures;
        figures.insert("max_latency_us".into(), worst_us.into());
        figures.insert("allot_tokens".into(), allot_tokens.into());
        figures.insert("ideal_tokens".into(), ideal_tokens.into());
        let d = self.denials;
        figures.insert("false_rejections".into(), false_rejections.into());
        figures.insert("wait_timeouts".into(), d.wait_timeouts.into());
        figures.insert("failure_mode_denials".into(), d.failure_mode.into());
        figures.insert("rpc_errors".into(), d.rpc_errors.into());
        let (limited, unlimited) = shortfall.by_kind();
        figures.insert("shortfall_limited_keys".into(), limited.into());
        figures.insert("shortfall_unlimited_keys".into(), unlimited.into());
        figures.insert("denials_held".into(), d.held.into());
        figures.insert("accrual_denials".into(), d.accrual.into());
        for (name, v) in d.work.figures() {
            figures.insert(name.into(), v.into());
        }
        let mut measured = extra.measured;
        if false_rejections > 0 {
            // Each false rejection read against the agents' causes (the rest: the allocator's
            // own denial, e.g. a region's part or a hold after a short grant).
            let sep = if measured.is_empty() { "" } else { "; " };
            measured = format!(
                "{measured}{sep}{false_rejections} false rejections: {} wait timeouts, {} \
                 failure mode ({} RPC errors), {} held denials, {} accrual denials",
                d.wait_timeouts, d.failure_mode, d.rpc_errors, d.held, d.accrual
            );
        }
        self.rows.push(Row {
            part: part.to_string(),
            what,
            sent: records.len() as u64,
            ideal: ideal_n,
            allot,
            ratio,
            errors,
            overshoot,
            bound,
            within,
            measured,
            target: extra.target,
            target_met: (extra.met)(ratio),
            figures,
        });
        Ok(())
    }

    /// The allocator's Σ(granted − reported) over the regions of key `k`, tokens (0 when the
    /// allocator does not know the key).
    async fn bound_of(&self, k: usize) -> Result<f64> {
        let key = &self.keys[k];
        let (tokens, _) = crate::scenario::bound(self.d, &key.domain, &key.entries).await?;
        Ok(tokens)
    }

    /// The leader's last log index (Raft entries so far).
    pub(crate) async fn raft_index(&self) -> Result<u64> {
        let (_, leader) = self.d.wait_leader(Duration::from_secs(10)).await?;
        let s = allocator_client(&leader)?
            .cluster_status(pb::ClusterStatusRequest {})
            .await
            .context("cluster status")?
            .into_inner();
        Ok(s.last_log_index.unwrap_or(0))
    }

    /// The largest resident memory of the allocator processes, bytes.
    pub(crate) fn allocator_rss(&self) -> u64 {
        self.d
            .allocators
            .iter()
            .filter_map(|a| a.pid())
            .filter_map(rss_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// Most keys whose bound is read after one part.
const MAX_BOUND_READS: usize = 50;

/// Runs the parts named in `only` (all when empty) in the order of [`PARTS`].
///
/// # Errors
/// An unknown part name, or a deployment that stops answering.
pub async fn run(d: &Deployment, policies: &Path, t: Timing, only: &[String]) -> Result<Report> {
    for name in only {
        if !PARTS.contains(&name.as_str()) {
            anyhow::bail!("unknown part {name:?}; the parts are {}", PARTS.join(", "));
        }
    }
    let mut run = Run::new(d, policies)?;
    for part in PARTS {
        if only.is_empty() || only.iter().any(|n| n == part) {
            parts::run_part(&mut run, part, t).await?;
        }
    }
    Ok(Report { rows: run.rows })
}

/// Evenly spaced arrivals at `rate`/s for `secs` over `agents`, to `key`.
pub(crate) fn at_rate(rate: u64, secs: u64, agents: &[usize], key: usize) -> Vec<Arrival> {
    let n = rate.saturating_mul(secs);
    paced(
        n,
        Duration::from_nanos(1_000_000_000 / rate.max(1)),
        Duration::ZERO,
        agents,
        key,
    )
}

/// `n` keys' worth of arrivals at `rate`/s for `secs`, keys drawn Zipf(`s`) from `keys`,
/// agents in turn.
pub(crate) fn zipf_arrivals(
    rate: u64,
    secs: u64,
    agents: &[usize],
    keys: &[usize],
    s: f64,
    seed: u64,
) -> Result<Vec<Arrival>> {
    let z = Zipf::new(u32::try_from(keys.len()).context("too many keys")?, s)?;
    let mut rng = SplitMix64::new(seed);
    let mut out = at_rate(rate, secs, agents, 0);
    for a in &mut out {
        a.key = keys[z.sample(&mut rng)];
    }
    Ok(out)
}
