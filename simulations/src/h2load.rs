//! `allot-bench h2load` (issue 13 items 1–2): the agent's Envoy RLS tail and throughput measured
//! with an independent client, h2load (Debian `nghttp2-client`), against a do-nothing RLS
//! server in the same run.
//!
//! Our own load generator ([`crate::rls`]) has a p99 of about 1 ms even against a server that
//! does nothing, which hides a gap of a few hundred microseconds; h2load is a C client built for
//! this. One release allocator node and one agent are started ([`crate::local`]) with the
//! policies of `simulations/policies/transport/`, and `allot-bench noop` in a process of its
//! own (two runtime workers, as the agent has) is the baseline. Each case is one hot key whose
//! gRPC body (a length-prefixed `RateLimitRequest`) h2load sends on every request:
//!
//! * **local**: a `scope: local` rule, decided by the agent's own bucket;
//! * **leased**: a leased rule, spent from an allocation the agent holds.
//!
//! **Latency**: h2load paces each of `clients` connections at `rate / clients` requests per
//! second (`--rps`, up to `streams` outstanding on a connection: with one, the default, a
//! request due while the previous one is outstanding waits for it, and h2load measures from
//! the actual send) for `warmup + duration`; the latencies are read from its per-request log
//! (`--log-file`: start, HTTP status, µs to the end of the response), keeping the requests
//! started after the warm-up. The agent and the no-op server are measured alternately, the
//! order flipped every round, and each figure is the median over the rounds.
//!
//! **Throughput**: h2load closed loop (`clients` × `throughput_streams` outstanding) for
//! `duration`, the agent against the no-op server, same alternation. Enough requests must be
//! outstanding that the slowest path's latency does not set the rate: with 10,000 Zipf keys
//! about a quarter of the leased rule's requests are sparse keys decided by the allocator
//! (one round trip each), and 4 × 1 outstanding held the agent at ≈ 880 req/s.
//!
//! h2load sees HTTP only: a gRPC error is an HTTP 200 with a `grpc-status` trailer. So the
//! agent's own counter of requests answered OK (`allot_agent_requests{code="ok"}`) is read
//! around every run, and a run in which fewer requests were answered OK than h2load completed
//! is an error, as is any request h2load counts as failed.
//!
//! **Many keys through a real Envoy** (`--via-envoy`): h2load sends the same body on every
//! request, so it cannot spread requests over keys by itself. With `--via-envoy` it instead
//! sends plain `GET`s to a real Envoy whose HTTP rate-limit filter calls the RLS server under
//! test, the descriptor taken from the request (`rule` from the route, `tenant` = the path, see
//! `simulations/envoy/h2load.yaml.tmpl` and `policies/transport/bench-envoy.yaml`), and a direct
//! response from a second listener of the same Envoy (on a Unix socket) is the upstream. h2load
//! reads its paths from a file (`--input-file`, used in order by every connection and wrapped
//! around): `uris` paths whose tenants are drawn, seeded, from Zipf(`zipf`) over `keys` keys.
//! Each arm has an Envoy of its own from the same template (the agent's, the no-op server's),
//! so the ratio isolates the RLS server; Envoy's own cost is in both. Every run also checks
//! Envoy's counters: its rate-limit filter got an OK for at least every request h2load
//! completed, and answered no 4xx or 5xx (`failure_mode_deny` is on, so an RLS error would be a
//! 500, and a denial a 429).

use crate::local::{assemble_policies, parse_ready, Deployment, Plan};
use crate::rls::request;
use crate::zipf::{SplitMix64, Zipf};
use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use prost::Message;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The gRPC path of Envoy's `ShouldRateLimit`.
pub const RLS_PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Target of issue 13 item 1: the agent's p99 at most this many times the no-op server's.
pub const P99_TARGET: f64 = 1.15;
/// Target of issue 13 item 2: the agent's throughput at least this share of the no-op server's.
pub const THROUGHPUT_TARGET: f64 = 0.95;

/// The cases: (name, value of the `tenant` entry in `policies/transport/bench.yaml`).
pub const CASES: [&str; 2] = ["local", "leased"];

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The h2load binary.
    pub h2load: PathBuf,
    /// Folder of `allot-allocator` and `allot-agent`.
    pub bin_dir: PathBuf,
    /// This program (started as `allot-bench noop` for the baseline).
    pub bench_exe: PathBuf,
    /// Data folder (created; policies, logs, bodies).
    pub data_dir: PathBuf,
    /// Requests per second over all connections (latency runs).
    pub rate: u64,
    /// h2load connections.
    pub clients: u32,
    /// Most requests outstanding on one connection in the latency runs.
    pub streams: u32,
    /// Most requests outstanding on one connection in the throughput runs: a closed loop with
    /// few requests outstanding measures the latency of the slowest path, not the maximum
    /// throughput (4 × 1 outstanding capped the leased rule at ≈ 880 req/s, 2026-12-06).
    pub throughput_streams: u32,
    /// Measured time of one run.
    pub duration: Duration,
    /// Time of the same load before each latency run, not measured.
    pub warmup: Duration,
    /// Rounds: each measures every case against the target and the baseline.
    pub rounds: u32,
    /// Cases to run (all when empty): local, leased.
    pub cases: Vec<String>,
    /// Also measure closed-loop throughput.
    pub throughput: bool,
    /// Through a real Envoy, many keys (`--via-envoy`); `None`: h2load calls the RLS directly.
    pub via_envoy: Option<ViaEnvoy>,
}

/// `--via-envoy`: h2load → Envoy (rate-limit filter → the RLS server under test) → a direct
/// response.
#[derive(Debug, Clone)]
pub struct ViaEnvoy {
    /// The Envoy binary.
    pub envoy: PathBuf,
    /// Distinct tenants (keys) per rule.
    pub keys: u32,
    /// Zipf exponent of their popularity.
    pub zipf: f64,
    /// Paths in h2load's URI file.
    pub uris: usize,
    /// Seed of the draws.
    pub seed: u64,
    /// Envoy's worker threads (`--concurrency`).
    pub concurrency: u32,
}

/// The policy domain of `--via-envoy` (`policies/transport/bench-envoy.yaml`).
pub const ENVOY_DOMAIN: &str = "bench-envoy";

/// The Envoy config template of `--via-envoy`.
pub const ENVOY_TEMPLATE: &str = include_str!("../envoy/h2load.yaml.tmpl");

/// The path of a request for tenant `index` (0 the most popular) under `case`'s route; Envoy
/// sends the whole path as the `tenant` entry.
pub fn tenant_path(case: &str, index: usize) -> String {
    format!("/{case}/t{index}")
}

/// h2load's URI file for `case`: `n` paths, one a line, the tenant of each drawn from `dist`
/// with a generator started from `seed` (the same arguments, the same file).
pub fn uri_file(case: &str, dist: &Zipf, n: usize, seed: u64) -> String {
    let mut rng = SplitMix64::new(seed);
    let mut out = String::with_capacity(n * (case.len() + 10));
    for _ in 0..n {
        out += &tenant_path(case, dist.sample(&mut rng));
        out.push('\n');
    }
    out
}

/// The Envoy config of one arm: its rate-limit filter calls the RLS server on loopback port
/// `rls_port`; its upstream listener is the Unix socket `pipe`.
pub fn envoy_config(rls_port: u16, pipe: &Path) -> String {
    ENVOY_TEMPLATE
        .replace("@rls_port@", &rls_port.to_string())
        .replace("@upstream_pipe@", &pipe.display().to_string())
        .replace("@domain@", ENVOY_DOMAIN)
}

/// The Envoy counters a run is checked against (its admin `/stats`, plain text).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EnvoyCounters {
    /// Rate-limit filter: RLS answered OK.
    pub rl_ok: u64,
    /// Rate-limit filter: RLS answered OVER_LIMIT.
    pub rl_over_limit: u64,
    /// Rate-limit filter: RLS call failed.
    pub rl_error: u64,
    /// Rate-limit filter: RLS call failed and the request was let through.
    pub rl_failure_mode_allowed: u64,
    /// Downstream answers 2xx.
    pub rq_2xx: u64,
    /// Downstream answers 4xx.
    pub rq_4xx: u64,
    /// Downstream answers 5xx.
    pub rq_5xx: u64,
}

impl EnvoyCounters {
    /// The counters in Envoy's plain-text `/stats` (`name: value` lines).
    pub fn parse(stats: &str) -> EnvoyCounters {
        let mut c = EnvoyCounters::default();
        for line in stats.lines() {
            let Some((name, value)) = line.split_once(": ") else {
                continue;
            };
            let Ok(v) = value.trim().parse::<u64>() else {
                continue;
            };
            let slot = match name.trim() {
                "cluster.upstream.ratelimit.ok" => &mut c.rl_ok,
                "cluster.upstream.ratelimit.over_limit" => &mut c.rl_over_limit,
                "cluster.upstream.ratelimit.error" => &mut c.rl_error,
                "cluster.upstream.ratelimit.failure_mode_allowed" => &mut c.rl_failure_mode_allowed,
                "http.ingress.downstream_rq_2xx" => &mut c.rq_2xx,
                "http.ingress.downstream_rq_4xx" => &mut c.rq_4xx,
                "http.ingress.downstream_rq_5xx" => &mut c.rq_5xx,
                _ => continue,
            };
            *slot = v;
        }
        c
    }

    /// What changed from `before` to `self`.
    pub fn since(&self, before: &EnvoyCounters) -> EnvoyCounters {
        EnvoyCounters {
            rl_ok: self.rl_ok.saturating_sub(before.rl_ok),
            rl_over_limit: self.rl_over_limit.saturating_sub(before.rl_over_limit),
            rl_error: self.rl_error.saturating_sub(before.rl_error),
            rl_failure_mode_allowed: self
                .rl_failure_mode_allowed
                .saturating_sub(before.rl_failure_mode_allowed),
            rq_2xx: self.rq_2xx.saturating_sub(before.rq_2xx),
            rq_4xx: self.rq_4xx.saturating_sub(before.rq_4xx),
            rq_5xx: self.rq_5xx.saturating_sub(before.rq_5xx),
        }
    }

    /// Why a run whose Envoy counters moved by `self` (h2load completed `succeeded`) is not a
    /// clean one: anything limited, failed or not decided by the RLS server; `None` when clean.
    pub fn problem(&self, succeeded: u64) -> Option<String> {
        if self.rl_over_limit + self.rl_error + self.rl_failure_mode_allowed > 0
            || self.rq_4xx + self.rq_5xx > 0
            || self.rl_ok < succeeded
            || self.rq_2xx < succeeded
        {
            Some(format!(
                "Envoy's counters over the run: {self:?}, h2load completed {succeeded}"
            ))
        } else {
            None
        }
    }
}

/// Latency of one run, µs, from h2load's per-request log.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Latency {
    /// Requests measured (HTTP 200, started after the warm-up).
    pub n: u64,
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Slowest.
    pub max_us: u64,
}

/// h2load's own summary of a run.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Summary {
    /// Requests completed (`done`).
    pub done: u64,
    /// Requests answered 2xx (`succeeded`).
    pub succeeded: u64,
    /// Requests answered with another status, errored or timed out.
    pub failed: u64,
    /// Requests per second over the measured time (`finished in …, N req/s`).
    pub rps: f64,
}

/// One h2load run against one server.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Round (1-based).
    pub round: u32,
    /// "agent" or "noop".
    pub server: &'static str,
    /// h2load's summary.
    pub summary: Summary,
    /// Latency (latency runs only).
    pub latency: Option<Latency>,
}

/// The runs of one case and figure.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// Case name (local, leased).
    pub case: String,
    /// "latency" or "throughput".
    pub figure: &'static str,
    /// Every run, in the order they ran.
    pub runs: Vec<Run>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// h2load's version line.
    pub h2load: String,
    /// The settings, as text.
    pub settings: String,
    /// 1-minute load average before and after.
    pub load: (String, String),
    /// Per case and figure.
    pub cases: Vec<CaseReport>,
}

/// A gRPC request body: the message prefixed by the uncompressed flag (0) and its length as a
/// big-endian u32 (gRPC over HTTP/2, "Length-Prefixed-Message").
pub fn grpc_body(message: &impl Message) -> Vec<u8> {
    let m = message.encode_to_vec();
    let mut out = Vec::with_capacity(5 + m.len());
    out.push(0);
    out.extend_from_slice(&u32::try_from(m.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&m);
    out
}

/// What h2load sends.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// This gRPC body, `POST`ed to the RLS method on every request.
    Body(&'a Path),
    /// `GET`s of the paths of this file, in order (`--via-envoy`).
    Uris(&'a Path),
}

/// h2load's arguments for one run against `addr` ("host:port"): a paced latency run with
/// `rps_per_client` and a warm-up, or a closed-loop run when `rps_per_client` is `None`.
pub fn args(
    o: &Options,
    addr: &str,
    input: Input<'_>,
    log: Option<&Path>,
    rps_per_client: Option<u64>,
) -> Vec<String> {
    let mut a = vec![
        format!("--clients={}", o.clients),
        format!(
            "--max-concurrent-streams={}",
            if rps_per_client.is_some() {
                o.streams
            } else {
                o.throughput_streams
            }
        ),
        "--threads=1".into(),
    ];
    match input {
        Input::Body(body) => {
            a.push(format!("--data={}", body.display()));
            a.push("--header=content-type: application/grpc".into());
            a.push("--header=te: trailers".into());
        }
        Input::Uris(file) => {
            a.push(format!("--input-file={}", file.display()));
            a.push(format!("--base-uri=http://{addr}"));
        }
    }
    match rps_per_client {
        Some(r) => {
            a.push(format!("--rps={r}"));
            // No h2load warm-up here: the whole run is logged and the log filter decides what
            // is measured (requests started after the warm-up; see [`latency`]).
            a.push(format!("--duration={}s", (o.warmup + o.duration).as_secs()));
        }
        None => {
            // h2load's own warm-up: connections set up and the key warm before its req/s count.
            a.push(format!("--warm-up-time={}s", o.warmup.as_secs().max(1)));
            a.push(format!("--duration={}s", o.duration.as_secs()));
        }
    }
    if let Some(l) = log {
        a.push(format!("--log-file={}", l.display()));
    }
    if let Input::Body(_) = input {
        a.push(format!("http://{addr}{RLS_PATH}"));
    }
    a
}

/// Reads h2load's summary from its standard output.
///
/// # Errors
/// When the `requests:` or `finished in` line is missing or malformed.
pub fn parse_summary(stdout: &str) -> Result<Summary> {
    let req = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("requests:"))
        .context("h2load printed no `requests:` line")?;
    let count = |what: &str| -> Result<u64> {
        req.split(',')
            .find_map(|p| p.trim().strip_suffix(what))
            .with_context(|| format!("no `{what}` in h2load's `requests:` line {req:?}"))?
            .trim()
            .parse()
            .with_context(|| format!("`{what}` in {req:?}"))
    };
    let fin = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("finished in"))
        .context("h2load printed no `finished in` line")?;
    let rps = fin
        .split(',')
        .find_map(|p| p.trim().strip_suffix("req/s"))
        .context("no req/s in h2load's `finished in` line")?
        .trim()
        .parse()
        .with_context(|| format!("req/s in {fin:?}"))?;
    Ok(Summary {
        done: count(" done")?,
        succeeded: count(" succeeded")?,
        failed: count(" failed")? + count(" errored")? + count(" timeout")?,
        rps,
    })
}

/// Percentiles of the requests in h2load's log (start µs since the epoch, HTTP status, µs to
/// the end of the response; tab-separated) that started at or after `from_us` and got a 200.
///
/// # Errors
/// A malformed line, or no request to measure.
pub fn latency(log: &str, from_us: u64) -> Result<Latency> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split('\t').map(str::trim);
        let mut next = |what: &str| -> Result<u64> {
            f.next()
                .with_context(|| format!("no {what} in h2load log line {line:?}"))?
                .parse()
                .with_context(|| format!("{what} in h2load log line {line:?}"))
        };
        let (start, status, us) = (next("start")?, next("status")?, next("latency")?);
        if start >= from_us && status == 200 {
            h.saturating_record(us.max(1));
        }
    }
    if h.is_empty() {
        bail!("no request in h2load's log started after the warm-up with status 200");
    }
    Ok(Latency {
        n: h.len(),
        p50_us: h.value_at_quantile(0.50),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        max_us: h.max(),
    })
}

/// The median of `values` (the lower middle for an even count); 0 when empty.
pub fn median<T: Copy + PartialOrd + Default>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    match values.len() {
        0 => T::default(),
        n => values[(n - 1) / 2],
    }
}

/// The sum of the agent's `allot_agent_requests{code="ok"}` samples (with or without the
/// `_total` suffix) in a Prometheus text
/// exposition (the exporter may add a `_total` suffix and scope labels).
pub fn ok_requests(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            let name = l.split(['{', ' ']).next().unwrap_or("");
            (name == "allot_agent_requests" || name == "allot_agent_requests_total")
                && l.contains("code=\"ok\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The servers under comparison.
struct Servers {
    agent: String,
    agent_metrics: String,
    noop: String,
    http: reqwest::Client,
    /// `--via-envoy`: the Envoy in front of the agent and the one in front of the no-op server.
    envoys: Option<(Envoy, Envoy)>,
}

impl Servers {
    /// The Envoy in front of `server` ("agent" or "noop"), with `--via-envoy`.
    fn envoy(&self, server: &str) -> Option<&Envoy> {
        self.envoys
            .as_ref()
            .map(|(a, n)| if server == "agent" { a } else { n })
    }

    async fn envoy_counters(&self, e: &Envoy) -> Result<EnvoyCounters> {
        let text = self
            .http
            .get(format!("http://{}/stats", e.admin))
            .send()
            .await?
            .text()
            .await?;
        Ok(EnvoyCounters::parse(&text))
    }

    async fn ok(&self) -> Result<u64> {
        let text = self
            .http
            .get(&self.agent_metrics)
            .send()
            .await?
            .text()
            .await?;
        Ok(ok_requests(&text))
    }
}

/// Runs h2load once; for the agent, checks that it answered every completed request OK.
async fn one_run(
    o: &Options,
    s: &Servers,
    server: &'static str,
    input: Input<'_>,
    log: Option<&Path>,
    rps: Option<u64>,
) -> Result<(Summary, Option<Latency>)> {
    let envoy = s.envoy(server);
    let addr = match envoy {
        Some(e) => &e.ingress,
        None if server == "agent" => &s.agent,
        None => &s.noop,
    };
    let ok_before = if server == "agent" { s.ok().await? } else { 0 };
    let envoy_before = match envoy {
        Some(e) => Some(s.envoy_counters(e).await?),
        None => None,
    };
    let from_us = now_us() + u64::try_from(o.warmup.as_micros()).unwrap_or(u64::MAX);
    let out = tokio::process::Command::new(&o.h2load)
        .args(args(o, addr, input, log, rps))
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", o.h2load.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "h2load exited with {}: {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let summary = parse_summary(&stdout)?;
    if summary.failed > 0 || summary.succeeded == 0 {
        bail!("h2load against {server} ({addr}): {summary:?}\n{stdout}");
    }
    if server == "agent" {
        let ok = s.ok().await? - ok_before;
        if ok < summary.succeeded {
            bail!(
                "the agent answered {ok} requests OK but h2load completed {}: gRPC errors or \
                 denials hidden behind HTTP 200",
                summary.succeeded
            );
        }
    }
    if let (Some(e), Some(before)) = (envoy, envoy_before) {
        let moved = s.envoy_counters(e).await?.since(&before);
        if let Some(p) = moved.problem(summary.succeeded) {
            bail!("through Envoy to {server}: {p}");
        }
    }
    let latency = match log {
        Some(l) => Some(latency(&std::fs::read_to_string(l)?, from_us)?),
        None => None,
    };
    Ok((summary, latency))
}

/// The runs of one case and figure: `rounds` pairs, the order flipped each round.
async fn case_runs(
    o: &Options,
    s: &Servers,
    case: &str,
    figure: &'static str,
    progress: &mut impl FnMut(&str),
) -> Result<CaseReport> {
    let file = match &o.via_envoy {
        None => {
            let body = o.data_dir.join(format!("{case}.body"));
            let entries = [("tenant".to_string(), case.to_string())];
            std::fs::write(&body, grpc_body(&request("bench", &entries, 1)))?;
            body
        }
        Some(v) => {
            let uris = o.data_dir.join(format!("{case}.uris"));
            let dist = Zipf::new(v.keys, v.zipf)?;
            std::fs::write(&uris, uri_file(case, &dist, v.uris, v.seed))?;
            uris
        }
    };
    let input = match o.via_envoy {
        None => Input::Body(&file),
        Some(_) => Input::Uris(&file),
    };
    let rps = (figure == "latency").then(|| o.rate.div_ceil(u64::from(o.clients.max(1))));
    let mut runs = Vec::new();
    for round in 1..=o.rounds {
        let order: [&'static str; 2] = if round % 2 == 1 {
            ["agent", "noop"]
        } else {
            ["noop", "agent"]
        };
        for server in order {
            let log = o
                .data_dir
                .join(format!("{case}-{figure}-{round}-{server}.log"));
            let log = rps.is_some().then_some(log.as_path());
            let (summary, latency) = one_run(o, s, server, input, log, rps).await?;
            progress(&format!(
                "{case} {figure} round {round} {server}: {:.0} req/s{}",
                summary.rps,
                latency
                    .map(|l| format!(
                        ", p50 {} µs, p99 {} µs, p99.9 {} µs",
                        l.p50_us, l.p99_us, l.p999_us
                    ))
                    .unwrap_or_default()
            ));
            runs.push(Run {
                round,
                server,
                summary,
                latency,
            });
        }
    }
    Ok(CaseReport {
        case: case.to_string(),
        figure,
        runs,
    })
}

/// Starts the deployment and the baseline, runs every case and returns the report.
///
/// # Errors
/// An unknown case, h2load missing or failing, a deployment that does not start, or a run in
/// which a server did not answer every request OK.
pub async fn run(o: &Options, mut progress: impl FnMut(&str)) -> Result<Report> {
    for c in &o.cases {
        if !CASES.contains(&c.as_str()) {
            bail!("unknown case {c:?}; the cases are {}", CASES.join(", "));
        }
    }
    if o.rounds == 0
        || o.rate == 0
        || o.clients == 0
        || o.streams == 0
        || o.throughput_streams == 0
        || o.duration.is_zero()
    {
        bail!(
            "--rounds, --rate, --clients, --streams, --throughput-streams and --duration-s must \
             be positive"
        );
    }
    if let Some(v) = &o.via_envoy {
        if v.keys == 0 || v.uris == 0 || v.concurrency == 0 {
            bail!("--keys, --uris and --envoy-concurrency must be positive");
        }
        Zipf::new(v.keys, v.zipf)?;
    }
    let version = std::process::Command::new(&o.h2load)
        .arg("--version")
        .output()
        .with_context(|| {
            format!(
                "{} not found: install Debian's nghttp2-client",
                o.h2load.display()
            )
        })?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    std::fs::create_dir_all(&o.data_dir)?;
    // A data folder used before: start its deployment afresh.
    for sub in ["policies", "deployment"] {
        let dir = o.data_dir.join(sub);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
    }
    let policies = o.data_dir.join("policies");
    assemble_policies(
        &[PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/policies/transport"
        ))],
        &policies,
    )?;
    let plan = Plan {
        bin_dir: o.bin_dir.clone(),
        policies,
        data_dir: o.data_dir.join("deployment"),
        agents: vec![("eu-west".into(), 1)],
        envoy: None,
        gateway_regions: Vec::new(),
        allocator_nodes: 1,
        agent_settings: None,
    };
    progress("starting 1 allocator, 1 agent and the no-op server");
    let d = Deployment::start(&plan).await?;
    let noop = Noop::start(o).await;
    let r = match noop {
        Ok(noop) => {
            let r = with_envoys(o, &d, &noop.addr, version, &mut progress).await;
            noop.stop().await;
            r
        }
        Err(e) => Err(e),
    };
    d.shutdown().await;
    r
}

/// With `--via-envoy`, starts an Envoy in front of the agent and one in front of the no-op
/// server, then runs the cases; stops them after.
async fn with_envoys(
    o: &Options,
    d: &Deployment,
    noop: &str,
    version: String,
    progress: &mut impl FnMut(&str),
) -> Result<Report> {
    let Some(v) = &o.via_envoy else {
        return run_cases(o, d, noop, None, version, progress).await;
    };
    let agent = d.agents.first().context("no agent")?;
    progress(&format!(
        "starting an Envoy ({}) in front of the agent and one in front of the no-op server",
        v.envoy.display()
    ));
    let a = Envoy::start(o, v, "agent", &agent.rls).await?;
    let n = match Envoy::start(o, v, "noop", noop).await {
        Ok(n) => n,
        Err(e) => {
            a.stop().await;
            return Err(e);
        }
    };
    let version = format!("{version}; {}", envoy_version(&v.envoy));
    run_cases(o, d, noop, Some((a, n)), version, progress).await
}

fn envoy_version(envoy: &Path) -> String {
    std::process::Command::new(envoy)
        .arg("--version")
        .output()
        .map(|out| {
            let text = String::from_utf8_lossy(&out.stdout);
            // "<path>  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
            let number = text
                .split("version:")
                .nth(1)
                .and_then(|v| v.split('/').nth(1))
                .map(str::to_string)
                .unwrap_or_else(|| text.trim().to_string());
            format!("Envoy {number}")
        })
        .unwrap_or_else(|_| "Envoy (version unknown)".into())
}

/// One Envoy of `--via-envoy`, started from [`ENVOY_TEMPLATE`].
struct Envoy {
    child: tokio::process::Child,
    /// Its ingress listener, "host:port".
    ingress: String,
    /// Its admin server, "host:port".
    admin: String,
}

impl Envoy {
    /// Starts the Envoy of arm `name` in front of the RLS server at `rls` ("host:port") and
    /// waits until its ingress listens and a request of each case is answered 200 through it.
    async fn start(o: &Options, v: &ViaEnvoy, name: &str, rls: &str) -> Result<Envoy> {
        let rls_port: u16 = rls
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .with_context(|| format!("no port in the RLS address {rls:?}"))?;
        let pipe = o.data_dir.join(format!("envoy-{name}.sock"));
        let _ = std::fs::remove_file(&pipe);
        let cfg = o.data_dir.join(format!("envoy-{name}.yaml"));
        std::fs::write(&cfg, envoy_config(rls_port, &pipe))?;
        let admin_file = o.data_dir.join(format!("envoy-{name}.admin"));
        let _ = std::fs::remove_file(&admin_file);
        let log = std::fs::File::create(o.data_dir.join(format!("envoy-{name}.log")))?;
        let child = crate::local::spawn_envoy(&v.envoy, &cfg, &admin_file, log, v.concurrency)?;
        let mut e = Envoy {
            child,
            ingress: String::new(),
            admin: String::new(),
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()?;
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            if let Some(addr) = crate::local::envoy_listener(&http, &admin_file).await {
                e.ingress = addr;
                e.admin = std::fs::read_to_string(&admin_file)?.trim().to_string();
                break;
            }
            if let Ok(Some(status)) = e.child.try_wait() {
                bail!(
                    "Envoy ({name}) exited with {status}; see its log in {}",
                    o.data_dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if e.ingress.is_empty() {
            bail!("Envoy ({name}) not listening within 30 s");
        }
        // The policies reach the agent from the allocator: wait until each case is admitted.
        for case in CASES {
            let url = format!("http://{}{}", e.ingress, tenant_path(case, 0));
            let mut last = String::new();
            let ok = loop {
                match http.get(&url).send().await {
                    Ok(r) if r.status().as_u16() == 200 => break true,
                    Ok(r) => last = r.status().to_string(),
                    Err(err) => last = err.to_string(),
                }
                if t0.elapsed() > Duration::from_secs(30) {
                    break false;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            if !ok {
                bail!("through Envoy ({name}), {url} was not answered 200 within 30 s: {last}");
            }
        }
        Ok(e)
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

async fn run_cases(
    o: &Options,
    d: &Deployment,
    noop: &str,
    envoys: Option<(Envoy, Envoy)>,
    version: String,
    progress: &mut impl FnMut(&str),
) -> Result<Report> {
    let agent = d.agents.first().context("no agent")?;
    let s = Servers {
        agent: agent.rls.clone(),
        agent_metrics: format!("http://{}/metrics", agent.http),
        noop: noop.to_string(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()?,
        envoys,
    };
    let r = measure(o, &s, version, progress).await;
    if let Some((a, n)) = s.envoys {
        a.stop().await;
        n.stop().await;
    }
    r
}

async fn measure(
    o: &Options,
    s: &Servers,
    version: String,
    progress: &mut impl FnMut(&str),
) -> Result<Report> {
    let load_before = load_average();
    let mut cases = Vec::new();
    for case in CASES {
        if !o.cases.is_empty() && !o.cases.iter().any(|c| c == case) {
            continue;
        }
        cases.push(case_runs(o, s, case, "latency", progress).await?);
        if o.throughput {
            cases.push(case_runs(o, s, case, "throughput", progress).await?);
        }
    }
    let via = match &o.via_envoy {
        None => "h2load calls the RLS server directly, one key per rule; ".to_string(),
        Some(v) => format!(
            "through Envoy (one per arm, same config, {} worker(s)): {} keys per rule, \
             Zipf({}), {} paths per rule in h2load's URI file (seed {}); ",
            v.concurrency, v.keys, v.zipf, v.uris, v.seed
        ),
    };
    Ok(Report {
        h2load: version,
        settings: format!(
            "{via}{} connections, one h2load thread; latency runs: {} req/s in all, up to {} \
             streams per connection, for {} s after {} s of warm-up; throughput runs: closed loop \
             with up to {} streams per connection for {} s; {} rounds, the order of agent and \
             no-op flipped each round",
            o.clients,
            o.rate,
            o.streams,
            o.duration.as_secs(),
            o.warmup.as_secs(),
            o.throughput_streams,
            o.duration.as_secs(),
            o.rounds
        ),
        load: (load_before, load_average()),
        cases,
    })
}

/// `allot-bench noop` in a process of its own.
struct Noop {
    child: tokio::process::Child,
    addr: String,
}

impl Noop {
    async fn start(o: &Options) -> Result<Noop> {
        let ready = o.data_dir.join("noop.ready");
        let _ = std::fs::remove_file(&ready);
        let child = tokio::process::Command::new(&o.bench_exe)
            .args(["--threads", "2", "noop", "--listen", "127.0.0.1:0"])
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} noop", o.bench_exe.display()))?;
        for _ in 0..100 {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                if let Some(addr) = parse_ready(&text)?.get("grpc") {
                    return Ok(Noop {
                        child,
                        addr: addr.clone(),
                    });
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("the no-op server did not report its address within 10 s")
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The figures of one case: medians over the rounds of (agent, no-op).
fn medians(c: &CaseReport, pick: fn(&Run) -> f64) -> (f64, f64) {
    let of = |server| {
        median(
            c.runs
                .iter()
                .filter(|r| r.server == server)
                .map(pick)
                .collect(),
        )
    };
    (of("agent"), of("noop"))
}

/// One percentile of a run's latency, µs (0 for a throughput run).
fn percentile(r: &Run, f: fn(&Latency) -> u64) -> f64 {
    r.latency.as_ref().map(f).unwrap_or(0) as f64
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::INFINITY
    }
}

/// The report as text: every run, then per case the medians, their ratio and the target.
pub fn table(r: &Report) -> String {
    let mut out = format!(
        "{}\n{}\nload average (1, 5, 15 min) before: {}, after: {}\n",
        r.h2load, r.settings, r.load.0, r.load.1
    );
    for c in &r.cases {
        out += &format!("\n## {} rule, {}\n", c.case, c.figure);
        for run in &c.runs {
            out += &match &run.latency {
                Some(l) => format!(
                    "round {} {:<5}  {:>6.0} req/s  p50 {:>5} µs  p99 {:>5} µs  p99.9 {:>6} µs  max {:>6} µs  ({} measured)\n",
                    run.round, run.server, run.summary.rps, l.p50_us, l.p99_us, l.p999_us, l.max_us, l.n
                ),
                None => format!(
                    "round {} {:<5}  {:>6.0} req/s ({} requests)\n",
                    run.round, run.server, run.summary.rps, run.summary.done
                ),
            };
        }
        if c.figure == "latency" {
            for (name, pick) in [
                (
                    "p50",
                    (|r: &Run| percentile(r, |l| l.p50_us)) as fn(&Run) -> f64,
                ),
                ("p99", |r: &Run| percentile(r, |l| l.p99_us)),
                ("p99.9", |r: &Run| percentile(r, |l| l.p999_us)),
            ] {
                let (a, n) = medians(c, pick);
                let target = if name == "p99" {
                    let x = ratio(a, n);
                    format!(
                        "  target ≤ {P99_TARGET:.2}x: {}",
                        if x <= P99_TARGET { "met" } else { "not met" }
                    )
                } else {
                    String::new()
                };
                out += &format!(
                    "median {name:<5}  agent {a:.0} µs  no-op {n:.0} µs  agent / no-op {:.2}x{target}\n",
                    ratio(a, n)
                );
            }
        } else {
            let (a, n) = medians(c, |r| r.summary.rps);
            let x = ratio(a, n);
            out += &format!(
                "median throughput  agent {a:.0} req/s  no-op {n:.0} req/s  agent / no-op {x:.2}x  target ≥ {THROUGHPUT_TARGET:.2}x: {}\n",
                if x >= THROUGHPUT_TARGET { "met" } else { "not met" }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_proto::envoy::service::ratelimit::v3::RateLimitRequest;

    /// The share of the lines of a URI file whose tenant is one of the `top` most popular
    /// (`t0` … `t{top-1}`), and the number of distinct tenants in it.
    fn head_share(uris: &str, top: usize) -> (f64, usize) {
        let mut seen = std::collections::HashSet::new();
        let (mut total, mut head) = (0u64, 0u64);
        for line in uris.lines().filter(|l| !l.is_empty()) {
            total += 1;
            let index = line
                .rsplit_once("/t")
                .and_then(|(_, i)| i.parse::<usize>().ok());
            if let Some(i) = index {
                seen.insert(i);
                if i < top {
                    head += 1;
                }
            }
        }
        let share = if total == 0 {
            0.0
        } else {
            head as f64 / total as f64
        };
        (share, seen.len())
    }

    #[test]
    fn a_grpc_body_is_the_flag_the_length_and_the_message() {
        let req = request("bench", &[("tenant".into(), "leased".into())], 1);
        let body = grpc_body(&req);
        assert_eq!(body[0], 0, "uncompressed");
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        assert_eq!(len, body.len() - 5);
        assert_eq!(RateLimitRequest::decode(&body[5..]).unwrap(), req);
    }

    #[test]
    fn h2load_summary_is_read_from_its_output() {
        let out = "starting benchmark...\n\
            finished in 13.00s, 5000.12 req/s, 1.02MB/s\n\
            requests: 65000 total, 65000 started, 64990 done, 64980 succeeded, 7 failed, 2 errored, 1 timeout\n\
            status codes: 64990 2xx, 0 3xx, 0 4xx, 0 5xx\n";
        assert_eq!(
            parse_summary(out).unwrap(),
            Summary {
                done: 64990,
                succeeded: 64980,
                failed: 10,
                rps: 5000.12
            }
        );
        assert!(parse_summary("finished in 1s, 1 req/s\n").is_err());
        assert!(parse_summary("requests: 1 total, 1 done, 1 succeeded\n").is_err());
    }

    #[test]
    fn latency_keeps_200s_started_after_the_warm_up() {
        let mut log = String::new();
        // Warm-up (start < 1000): slow, not measured.
        for i in 0..100 {
            log += &format!("{}\t200\t900000\n", 500 + i);
        }
        // 1,000 measured: 1..=1000 µs; one 503 that is not.
        for i in 1..=1000u64 {
            log += &format!("{}\t200\t{i}\n", 1000 + i);
        }
        log += "5000\t503\t777777\n";
        let l = latency(&log, 1000).unwrap();
        assert_eq!(l.n, 1000);
        assert_eq!(l.p50_us, 500);
        assert_eq!(l.p99_us, 990);
        assert_eq!(l.p999_us, 999);
        assert_eq!(l.max_us, 1000);
        assert!(latency(&log, 10_000).is_err(), "nothing after the warm-up");
        assert!(latency("1\t200\n", 0).is_err(), "a line without latency");
        assert!(latency("x\t200\t5\n", 0).is_err(), "a malformed start");
    }

    #[test]
    fn median_is_the_middle_or_the_lower_middle() {
        assert_eq!(median(vec![3, 1, 2]), 2);
        assert_eq!(median(vec![4, 1, 3, 2]), 2);
        assert_eq!(median(Vec::<u64>::new()), 0);
        assert_eq!(median(vec![2.5, 0.5, 1.0]), 1.0);
    }

    #[test]
    fn ok_requests_sums_the_ok_samples_only() {
        let m = "# TYPE allot_agent_requests_total counter\n\
            allot_agent_requests_total{code=\"ok\",otel_scope_name=\"allot-agent\"} 1200\n\
            allot_agent_requests_total{code=\"over_limit\",otel_scope_name=\"allot-agent\"} 7\n\
            allot_agent_requests_other{code=\"ok\"} 5\n\
            other{code=\"ok\"} 9\n";
        assert_eq!(ok_requests(m), 1200);
        assert_eq!(ok_requests(""), 0);
    }

    #[test]
    fn the_uri_file_is_seeded_and_its_zipf_head_has_the_expected_share() {
        let dist = Zipf::new(10_000, 1.1).unwrap();
        let file = uri_file("leased", &dist, 100_000, 1);
        assert_eq!(
            file,
            uri_file("leased", &dist, 100_000, 1),
            "same seed, same file"
        );
        assert_ne!(file, uri_file("leased", &dist, 100_000, 2));
        assert_eq!(file.lines().count(), 100_000);
        assert!(file
            .lines()
            .all(|l| l.starts_with("/leased/t") && l[9..].parse::<u32>().unwrap() < 10_000));
        // The head's share is what Zipf(1.1) over 10,000 keys gives: about 15.1 % for the most
        // popular key, about 41 % for the top 10 and about 65 % for the top 100.
        for top in [1usize, 10, 100] {
            let expected: f64 = (0..top).map(|i| dist.probability(i)).sum();
            let (share, _) = head_share(&file, top);
            assert!(
                (share - expected).abs() < 0.01,
                "top {top}: {share} vs {expected}"
            );
        }
        assert!(
            (dist.probability(0) - 0.151).abs() < 0.002,
            "{}",
            dist.probability(0)
        );
        // The tail is reached: thousands of distinct tenants, not a handful.
        let (_, distinct) = head_share(&file, 1);
        assert!(
            (4_000..10_000).contains(&distinct),
            "{distinct} distinct tenants"
        );
        assert_eq!(head_share("", 1), (0.0, 0));
    }

    #[test]
    fn the_envoy_config_has_every_placeholder_filled() {
        let cfg = envoy_config(4321, Path::new("/tmp/x/envoy-agent.sock"));
        for p in ["@rls_port@", "@upstream_pipe@", "@domain@"] {
            assert!(!cfg.contains(p), "{p} left in the config");
        }
        assert!(cfg.contains("port_value: 4321"));
        assert_eq!(cfg.matches("path: \"/tmp/x/envoy-agent.sock\"").count(), 2);
        assert!(cfg.contains(&format!("domain: {ENVOY_DOMAIN}")));
        // Both listeners and the admin bind port 0 or a socket; only the RLS port is given.
        assert_eq!(cfg.matches("port_value: 0").count(), 2);
        // The descriptor: rule from the route, tenant from the path; errors are not let through.
        for case in CASES {
            assert!(cfg.contains(&format!("descriptor_key: rule, descriptor_value: {case}")));
            assert!(cfg.contains(&format!("prefix: \"/{case}/\"")));
        }
        assert!(cfg.contains("header_name: \":path\", descriptor_key: tenant"));
        assert!(cfg.contains("failure_mode_deny: true"));
        assert!(tenant_path("local", 7).starts_with("/local/"));
    }

    #[test]
    fn the_policy_has_a_rule_per_case_for_any_tenant() {
        let policy = include_str!("../policies/transport/bench-envoy.yaml");
        assert!(policy.contains(&format!("domain: {ENVOY_DOMAIN}")));
        for case in CASES {
            assert!(policy.contains(&format!("value: {case}")));
        }
    }

    #[test]
    fn h2load_reads_paths_from_the_file_against_the_envoy_address() {
        let o = Options {
            h2load: "h2load".into(),
            bin_dir: "bin".into(),
            bench_exe: "allot-bench".into(),
            data_dir: "d".into(),
            rate: 5000,
            clients: 4,
            streams: 1,
            throughput_streams: 16,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(3),
            rounds: 3,
            cases: Vec::new(),
            throughput: false,
            via_envoy: None,
        };
        let a = args(
            &o,
            "127.0.0.1:9",
            Input::Uris(Path::new("d/local.uris")),
            None,
            Some(1250),
        );
        assert!(a.contains(&"--input-file=d/local.uris".to_string()));
        assert!(a.contains(&"--base-uri=http://127.0.0.1:9".to_string()));
        assert!(a.contains(&"--rps=1250".to_string()));
        assert!(a.contains(&"--duration=13s".to_string()));
        // Latency runs keep one stream per connection; closed-loop runs keep 16 outstanding.
        assert!(a.contains(&"--max-concurrent-streams=1".to_string()));
        assert!(!a
            .iter()
            .any(|x| x.starts_with("--data") || x.starts_with("http")));
        let b = args(&o, "127.0.0.1:9", Input::Body(Path::new("d/b")), None, None);
        assert_eq!(b.last().unwrap(), &format!("http://127.0.0.1:9{RLS_PATH}"));
        assert!(b.contains(&"--data=d/b".to_string()));
        assert!(b.contains(&"--max-concurrent-streams=16".to_string()));
    }

    #[test]
    fn envoy_counters_are_read_and_a_run_with_a_denial_or_error_is_refused() {
        let before = EnvoyCounters::parse(
            "cluster.upstream.ratelimit.ok: 10\n\
             http.ingress.downstream_rq_2xx: 10\n\
             cluster.rls.upstream_rq_total: 99\n\
             histogram: P0(nan,1)\n",
        );
        assert_eq!(before.rl_ok, 10);
        assert_eq!(before.rq_2xx, 10);
        let after = EnvoyCounters::parse(
            "cluster.upstream.ratelimit.ok: 110\n\
             cluster.upstream.ratelimit.over_limit: 0\n\
             cluster.upstream.ratelimit.error: 0\n\
             http.ingress.downstream_rq_2xx: 110\n\
             http.ingress.downstream_rq_4xx: 0\n\
             http.ingress.downstream_rq_5xx: 0\n",
        );
        let moved = after.since(&before);
        assert_eq!(moved.rl_ok, 100);
        assert_eq!(moved.problem(100), None);
        assert!(moved.problem(101).is_some(), "fewer RLS OKs than requests");
        for bad in [
            EnvoyCounters {
                rl_over_limit: 1,
                ..moved
            },
            EnvoyCounters {
                rl_error: 1,
                ..moved
            },
            EnvoyCounters {
                rl_failure_mode_allowed: 1,
                ..moved
            },
            EnvoyCounters { rq_4xx: 1, ..moved },
            EnvoyCounters { rq_5xx: 1, ..moved },
        ] {
            assert!(bad.problem(100).is_some(), "{bad:?}");
        }
    }
}
