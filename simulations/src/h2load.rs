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
//! **Throughput**: h2load closed loop (`clients` × `streams` outstanding) for `duration`, the
//! agent against the no-op server, same alternation.
//!
//! h2load sees HTTP only: a gRPC error is an HTTP 200 with a `grpc-status` trailer. So the
//! agent's own counter of requests answered OK (`allot_agent_requests{code="ok"}`) is read
//! around every run, and a run in which fewer requests were answered OK than h2load completed
//! is an error, as is any request h2load counts as failed.

use crate::local::{assemble_policies, parse_ready, Deployment, Plan};
use crate::rls::request;
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
    /// Most requests outstanding on one connection.
    pub streams: u32,
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

/// h2load's arguments for one run against `addr` ("host:port"): a paced latency run with
/// `rps_per_client` and a warm-up, or a closed-loop run when `rps_per_client` is `None`.
pub fn args(
    o: &Options,
    addr: &str,
    body: &Path,
    log: Option<&Path>,
    rps_per_client: Option<u64>,
) -> Vec<String> {
    let mut a = vec![
        format!("--clients={}", o.clients),
        format!("--max-concurrent-streams={}", o.streams),
        "--threads=1".into(),
        format!("--data={}", body.display()),
        "--header=content-type: application/grpc".into(),
        "--header=te: trailers".into(),
    ];
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
    a.push(format!("http://{addr}{RLS_PATH}"));
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
}

impl Servers {
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
    body: &Path,
    log: Option<&Path>,
    rps: Option<u64>,
) -> Result<(Summary, Option<Latency>)> {
    let addr = if server == "agent" { &s.agent } else { &s.noop };
    let ok_before = if server == "agent" { s.ok().await? } else { 0 };
    let from_us = now_us() + u64::try_from(o.warmup.as_micros()).unwrap_or(u64::MAX);
    let out = tokio::process::Command::new(&o.h2load)
        .args(args(o, addr, body, log, rps))
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
    let body = o.data_dir.join(format!("{case}.body"));
    let entries = [("tenant".to_string(), case.to_string())];
    std::fs::write(&body, grpc_body(&request("bench", &entries, 1)))?;
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
            let (summary, latency) = one_run(o, s, server, &body, log, rps).await?;
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
    if o.rounds == 0 || o.rate == 0 || o.clients == 0 || o.duration.is_zero() {
        bail!("--rounds, --rate, --clients and --duration-s must be positive");
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
            let r = run_cases(o, &d, &noop.addr, version, &mut progress).await;
            noop.stop().await;
            r
        }
        Err(e) => Err(e),
    };
    d.shutdown().await;
    r
}

async fn run_cases(
    o: &Options,
    d: &Deployment,
    noop: &str,
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
    };
    let load_before = load_average();
    let mut cases = Vec::new();
    for case in CASES {
        if !o.cases.is_empty() && !o.cases.iter().any(|c| c == case) {
            continue;
        }
        cases.push(case_runs(o, &s, case, "latency", progress).await?);
        if o.throughput {
            cases.push(case_runs(o, &s, case, "throughput", progress).await?);
        }
    }
    Ok(Report {
        h2load: version,
        settings: format!(
            "{} connections, up to {} streams each, one h2load thread; latency runs: {} req/s \
             in all for {} s after {} s of warm-up; throughput runs: closed loop for {} s; {} \
             rounds, the order of agent and no-op flipped each round",
            o.clients,
            o.streams,
            o.rate,
            o.duration.as_secs(),
            o.warmup.as_secs(),
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
}
