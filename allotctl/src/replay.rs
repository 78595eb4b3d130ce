//! `allotctl replay`: recorded traffic against a candidate policy, on a virtual clock.
//!
//! Contract: `../shared/acceptance/README.md`. One JSON line per request on stdout; a config
//! switch line changes the policy from its time on; per-limit counts go to stderr (or a file).

use crate::wire::{parse_request, OwnedRequest};
use allot_common::config::ConfigSet;
use allot_common::limiter::{Code, DescriptorStatus, Limiter};
use allot_common::units::{
    millis_to_nanos, nanos_to_millis_ceil, nanos_to_retry_after_secs, Nanos,
};
use allot_common::RetryAfter;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};

/// One output line for a decided request.
#[derive(Serialize)]
struct DecisionLine<'a> {
    t_ms: u64,
    overall_code: &'static str,
    statuses: &'a [StatusLine],
    retry_after_s: Option<u64>,
    policy_version: u64,
}

/// One descriptor's answer in the output.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct StatusLine {
    /// `OK` or `OVER_LIMIT`.
    pub code: &'static str,
    /// The limit as configured; absent when no limit applies (or the API does not carry it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_limit: Option<CurrentLimit>,
    /// Whole tokens left; absent when no limit applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_remaining: Option<u64>,
    /// Milliseconds until the limit is fully reset (rounded up); absent when no limit applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_until_reset_ms: Option<u64>,
    /// A shadow-mode limit would have denied.
    pub shadow_over_limit: bool,
    /// The limit's name; absent when no rule matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

/// `current_limit` of a status line.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct CurrentLimit {
    /// `requests_per_unit`.
    pub requests_per_unit: u64,
    /// `SECOND`, `MINUTE`, `HOUR` or `DAY`.
    pub unit: &'static str,
    /// `unit_multiplier`.
    pub unit_multiplier: u64,
    /// The algorithm's name.
    pub algorithm: &'static str,
}

/// A decided request, whichever way it was decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecidedRequest {
    /// The whole request's code.
    pub code: Code,
    /// Seconds to wait on OVER_LIMIT (at least 1); `None` when OK or when it can never pass.
    pub retry_after_s: Option<u64>,
    /// The config version that decided.
    pub policy_version: u64,
    /// One per request descriptor, in order.
    pub statuses: Vec<StatusLine>,
}

/// What decides a trace's requests: the decision core itself, or an agent's APIs
/// ([`crate::through_agent`]).
pub trait Decider {
    /// Makes `set` the config from `now_ns` on.
    fn apply(&mut self, set: ConfigSet, now_ns: Nanos) -> Result<()>;
    /// Decides `req` at `now_ns`; `Err` carries an invalid-argument message (nothing spent).
    fn decide(&mut self, req: &OwnedRequest, now_ns: Nanos) -> Result<DecidedRequest, String>;
}

/// The decision core (`Limiter`) on the replay clock.
pub struct CoreDecider {
    limiter: Limiter,
    statuses: Vec<DescriptorStatus>,
}

impl CoreDecider {
    /// A limiter deciding with `set` from time 0.
    pub fn new(set: ConfigSet) -> Self {
        CoreDecider {
            limiter: Limiter::new(set, 0),
            statuses: Vec::with_capacity(8),
        }
    }
}

impl Decider for CoreDecider {
    fn apply(&mut self, set: ConfigSet, now_ns: Nanos) -> Result<()> {
        self.limiter.apply(set, now_ns);
        Ok(())
    }

    fn decide(&mut self, req: &OwnedRequest, now_ns: Nanos) -> Result<DecidedRequest, String> {
        let statuses = &mut self.statuses;
        let outcome = req
            .with_request(|r| self.limiter.decide(r, now_ns, statuses))
            .map_err(|e| e.to_string())?;
        let snap = self.limiter.snapshot();
        let dom = snap.domain(&req.domain);
        let lines = self
            .statuses
            .iter()
            .map(|s| {
                let name = s
                    .rule_index
                    .and_then(|i| dom.map(|d| d.config.rules[i as usize].name.clone()));
                StatusLine {
                    code: code_str(s.code),
                    current_limit: s.limit.map(|l| CurrentLimit {
                        requests_per_unit: l.requests_per_unit,
                        unit: l.unit.envoy_name(),
                        unit_multiplier: l.unit_multiplier,
                        algorithm: l.algorithm.as_str(),
                    }),
                    limit_remaining: s.limit.map(|_| s.remaining),
                    duration_until_reset_ms: s.limit.map(|_| nanos_to_millis_ceil(s.reset_after)),
                    shadow_over_limit: s.shadow_over_limit,
                    policy: name,
                }
            })
            .collect();
        Ok(DecidedRequest {
            code: outcome.code,
            retry_after_s: match (outcome.code, outcome.retry_after) {
                (Code::Ok, _) | (_, RetryAfter::Never) => None,
                (_, RetryAfter::Now) => Some(1),
                (_, RetryAfter::After(ns)) => Some(nanos_to_retry_after_secs(ns)),
            },
            policy_version: outcome.policy_version,
            statuses: lines,
        })
    }
}

#[derive(Serialize)]
struct ErrorLine {
    t_ms: Option<u64>,
    error: &'static str,
    message: String,
}

/// Counts per limit, for the operator's summary.
#[derive(Default, Serialize, Clone, Copy)]
pub struct LimitCounts {
    /// Requests this limit let through (the whole request was allowed).
    pub allowed: u64,
    /// Requests this limit denied.
    pub denied: u64,
    /// Requests this shadow limit would have denied.
    pub shadow_denied: u64,
    /// Requests this limit allowed but another descriptor denied (nothing spent).
    pub denied_by_other: u64,
}

/// Totals of a replay.
#[derive(Default, Serialize)]
pub struct Summary {
    /// Request lines decided.
    pub requests: u64,
    /// Requests allowed.
    pub allowed: u64,
    /// Requests denied.
    pub denied: u64,
    /// Request lines refused as invalid.
    pub invalid: u64,
    /// Config switches applied.
    pub config_changes: u64,
    /// Per limit, keyed by the limit's name (`rate_limit.name`, else its id `domain|key=value…`).
    pub limits: BTreeMap<String, LimitCounts>,
}

impl Summary {
    /// Adds one decided request.
    fn count(&mut self, d: &DecidedRequest) {
        self.requests += 1;
        match d.code {
            Code::Ok => self.allowed += 1,
            Code::OverLimit => self.denied += 1,
        }
        // Per limit: the descriptors a limit applied to (unlimited rules have no count).
        for s in d.statuses.iter().filter(|s| s.limit_remaining.is_some()) {
            let Some(name) = &s.policy else { continue };
            let c = self.limits.entry(name.clone()).or_default();
            match (d.code, s.code) {
                (Code::Ok, _) => c.allowed += 1,
                (Code::OverLimit, "OVER_LIMIT") => c.denied += 1,
                (Code::OverLimit, _) => c.denied_by_other += 1,
            }
            if s.shadow_over_limit {
                c.shadow_denied += 1;
            }
        }
    }

    /// A table for humans.
    pub fn table(&self) -> String {
        let mut s = format!(
            "replay: {} requests, {} allowed, {} denied, {} invalid, {} config changes\n",
            self.requests, self.allowed, self.denied, self.invalid, self.config_changes
        );
        let w = self
            .limits
            .keys()
            .map(|k| k.len())
            .max()
            .unwrap_or(5)
            .max(5);
        s.push_str(&format!(
            "{:<w$}  {:>9}  {:>9}  {:>13}  {:>15}\n",
            "limit", "allowed", "denied", "shadow_denied", "denied_by_other"
        ));
        for (k, c) in &self.limits {
            s.push_str(&format!(
                "{:<w$}  {:>9}  {:>9}  {:>13}  {:>15}\n",
                k, c.allowed, c.denied, c.shadow_denied, c.denied_by_other
            ));
        }
        s
    }
}

/// Resolves a config path named in a trace: relative to the trace's folder when it exists there.
fn resolve(trace: &Path, name: &str) -> PathBuf {
    let p = Path::new(name);
    if p.is_absolute() {
        return p.to_path_buf();
    }
    let beside = trace.parent().map(|d| d.join(p));
    match beside {
        Some(b) if b.exists() => b,
        _ => p.to_path_buf(),
    }
}

/// Loads every config the trace switches to, before anything is decided: a policy that would
/// be refused mid-way refuses the whole replay, as a rollout would be refused.
fn preload(trace: &Path) -> Result<()> {
    let file = std::fs::File::open(trace)
        .with_context(|| format!("{}: cannot open trace", trace.display()))?;
    for line in std::io::BufReader::new(file).lines() {
        let line = line.with_context(|| format!("{}: unreadable", trace.display()))?;
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if let Some(name) = v.get("config").and_then(Value::as_str) {
            ConfigSet::load(&resolve(trace, name)).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
    }
    Ok(())
}

/// Runs the replay through the decision core, writing decisions to `out`. Returns the summary.
///
/// # Errors
/// An unreadable trace, or a config (initial or switched to) that fails to load or validate:
/// nothing further is decided then.
pub fn run(config: &Path, trace: &Path, out: &mut dyn Write) -> Result<Summary> {
    run_with(&mut CoreDecider::new(load(config, trace)?), trace, out)
}

/// Loads the config and every config the trace switches to (see [`run`]).
///
/// # Errors
/// As [`run`].
pub fn load(config: &Path, trace: &Path) -> Result<ConfigSet> {
    let set = ConfigSet::load(config).map_err(|e| anyhow::anyhow!("{e}"))?;
    preload(trace)?;
    Ok(set)
}

/// Replays `trace` through `decider` (already holding the initial config), writing one line
/// per request to `out`.
///
/// # Errors
/// As [`run`], and when the decider refuses a config.
pub fn run_with(decider: &mut dyn Decider, trace: &Path, out: &mut dyn Write) -> Result<Summary> {
    let file = std::fs::File::open(trace)
        .with_context(|| format!("{}: cannot open trace", trace.display()))?;
    let mut out = BufWriter::new(out);
    let mut clock_ms: Option<u64> = None;
    let mut summary = Summary::default();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}: line {}", trace.display(), n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                summary.invalid += 1;
                write_error(&mut out, None, format!("line {}: not JSON: {e}", n + 1))?;
                continue;
            }
        };
        let t_ms = v.get("t_ms").and_then(Value::as_u64);
        if let Some(name) = v.get("config") {
            let Some(name) = name.as_str() else {
                bail!(
                    "{}: line {}: config must be a file name",
                    trace.display(),
                    n + 1
                );
            };
            let Some(t) = t_ms else {
                bail!(
                    "{}: line {}: t_ms must be a whole number ≥ 0",
                    trace.display(),
                    n + 1
                );
            };
            let now = *clock_ms.insert(clock_ms.map_or(t, |c| c.max(t)));
            let path = resolve(trace, name);
            let set = ConfigSet::load(&path).map_err(|e| anyhow::anyhow!("{e}"))?;
            decider.apply(set, millis_to_nanos(now))?;
            summary.config_changes += 1;
            continue;
        }
        let Some(t) = t_ms else {
            summary.invalid += 1;
            write_error(
                &mut out,
                None,
                format!("line {}: t_ms must be a whole number ≥ 0", n + 1),
            )?;
            continue;
        };
        let now = *clock_ms.insert(clock_ms.map_or(t, |c| c.max(t)));
        let owned: OwnedRequest = match v.get("request").map(parse_request) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                summary.invalid += 1;
                write_error(&mut out, Some(t), e)?;
                continue;
            }
            None => {
                summary.invalid += 1;
                write_error(
                    &mut out,
                    Some(t),
                    format!("line {}: neither request nor config", n + 1),
                )?;
                continue;
            }
        };
        let d = match decider.decide(&owned, millis_to_nanos(now)) {
            Ok(d) => d,
            Err(e) => {
                summary.invalid += 1;
                write_error(&mut out, Some(t), e)?;
                continue;
            }
        };
        summary.count(&d);
        let line = DecisionLine {
            t_ms: t,
            overall_code: code_str(d.code),
            statuses: &d.statuses,
            retry_after_s: d.retry_after_s,
            policy_version: d.policy_version,
        };
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(summary)
}

/// Envoy's name of a code.
pub fn code_str(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

fn write_error(out: &mut impl Write, t_ms: Option<u64>, message: String) -> Result<()> {
    serde_json::to_writer(
        &mut *out,
        &ErrorLine {
            t_ms,
            error: "invalid_argument",
            message,
        },
    )?;
    out.write_all(b"\n")?;
    Ok(())
}
