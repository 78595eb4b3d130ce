//! `allot-bench rls --target ADDR --rate N --duration S`: an open-loop load generator for any
//! Envoy rate limit service (v3), reporting throughput and latency percentiles measured from
//! each request's scheduled time. `allot-bench memory`: resident memory per key of a release
//! agent and allocator (issue 13 item 3). `allot-bench h2load`: the agent's RLS tail and
//! throughput with h2load as the client, against a do-nothing server (issue 13 items 1–2).

use allot_simulations::rls::{run_load, Keys};
use allot_simulations::zipf::Zipf;
use allot_simulations::{h2load, memory};
use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "allot-bench",
    version,
    about = "Load generator for rate limit services"
)]
struct Cli {
    /// Runtime worker threads of this load generator (the pacing thread is one more). One leaves
    /// the most CPU to the server under test on a small machine.
    #[arg(long, global = true, default_value_t = 1)]
    threads: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drive envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit.
    Rls {
        /// Server address, host:port.
        #[arg(long)]
        target: String,
        /// Requests per second (open loop).
        #[arg(long)]
        rate: u64,
        /// Seconds to run.
        #[arg(long)]
        duration: u64,
        /// Seconds of the same load sent first and not measured (connections set up, keys
        /// warm: a leased key's first allocation is the cold wait, reported by the agent).
        #[arg(long, default_value_t = 0)]
        warmup: u64,
        /// Domain of the requests.
        #[arg(long, default_value = "bench")]
        domain: String,
        /// Descriptor entries, key=value (repeatable; the last one's value is varied over --keys).
        #[arg(long = "entry", default_values_t = vec!["tenant=t".to_string()])]
        entries: Vec<String>,
        /// Distinct values of the last entry (1: one hot key).
        #[arg(long, default_value_t = 1)]
        keys: u32,
        /// Draw the last entry's value by popularity, Zipf with this exponent over --keys (e.g.
        /// 1.1: a hot head and a long tail) instead of in turn.
        #[arg(long)]
        zipf: Option<f64>,
        /// Seed of the --zipf draws (the same seed sends the same key sequence).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Most requests outstanding at once.
        #[arg(long, default_value_t = 512)]
        max_in_flight: usize,
        /// First run the same load against a do-nothing RLS server started in-process (the
        /// transport's own cost) and print the target's latency as a ratio of it.
        #[arg(long, conflicts_with = "baseline_target")]
        baseline: bool,
        /// As --baseline, against a do-nothing server already running at this address (e.g.
        /// `allot-bench noop` in a process of its own, as the target is).
        #[arg(long)]
        baseline_target: Option<String>,
        /// Measured runs (each after its own warm-up, each paired with a baseline run); the
        /// report shows every run and details the one with the median p99.
        #[arg(long, default_value_t = 1)]
        repeat: u32,
        /// Print one JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Serve a do-nothing RLS (always OK) on --listen, as a baseline process.
    Noop {
        /// Address to listen on, host:port (port 0: one the system picks).
        #[arg(long)]
        listen: String,
        /// Write "grpc HOST:PORT" (the bound address) to this file once listening.
        #[arg(long)]
        ready_file: Option<std::path::PathBuf>,
    },
    /// Steady load through an agent, counting the allocator RPCs it made (from its /v1/status)
    /// per 1000 admitted decisions.
    Steady {
        /// The agent's RLS address, host:port.
        #[arg(long)]
        target: String,
        /// The agent's HTTP address, host:port (for /v1/status).
        #[arg(long)]
        http: String,
        /// Requests per second.
        #[arg(long)]
        rate: u64,
        /// Seconds to run (after a warm-up of 3 s that is not counted).
        #[arg(long)]
        duration: u64,
        /// Domain of the requests.
        #[arg(long)]
        domain: String,
        /// Descriptor entries, key=value (repeatable).
        #[arg(long = "entry")]
        entries: Vec<String>,
    },
    /// Resident memory per key of the agent and the allocator (issue 13 item 3): starts one
    /// allocator node and one agent per part (binaries from --bin-dir), makes --keys keys known
    /// and reads each process's VmRSS against its baseline after start-up. Parts: idle (agent,
    /// keys that hold nothing), leased (allocator, every key holding a live allocation), steady
    /// (Zipf load, RSS sampled every --sample-s for --duration-s).
    Memory {
        /// Distinct keys.
        #[arg(long, default_value_t = 100_000)]
        keys: u32,
        /// Requests per second while the keys are made known (one request a key).
        #[arg(long, default_value_t = 2_000)]
        fill_rate: u64,
        /// Requests per second of the steady part.
        #[arg(long, default_value_t = 2_000)]
        steady_rate: u64,
        /// Seconds of the steady part.
        #[arg(long, default_value_t = 600)]
        duration_s: u64,
        /// Seconds between two samples of the steady part.
        #[arg(long, default_value_t = 60)]
        sample_s: u64,
        /// Run only this part (repeatable): idle, leased, steady.
        #[arg(long = "part")]
        parts: Vec<String>,
        /// Times the idle and leased parts run, each on a fresh deployment; the table gives
        /// every round and the median with its range (one round's RSS growth varies by about
        /// ±12 % here).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=99))]
        rounds: u32,
        /// Folder of allot-allocator and allot-agent [default: $ALLOT_BIN_DIR, else this
        /// binary's folder].
        #[arg(long)]
        bin_dir: Option<std::path::PathBuf>,
        /// Data folder [default: a new temporary folder, removed at exit].
        #[arg(long)]
        data_dir: Option<std::path::PathBuf>,
        /// Print one JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The agent's Envoy RLS p50/p99/p99.9 and throughput with h2load (Debian `nghttp2-client`)
    /// as the client, alternating with a do-nothing RLS server (`allot-bench noop`) in the same
    /// run (issue 13 items 1–2): starts one allocator node and one agent (binaries from
    /// --bin-dir) with `simulations/policies/transport/`, one hot key per case.
    H2load {
        /// Requests per second over all connections in the latency runs.
        #[arg(long, default_value_t = 5_000)]
        rate: u64,
        /// h2load connections.
        #[arg(long, default_value_t = 4)]
        clients: u32,
        /// Most requests outstanding on one connection (h2load's -m). With more than one,
        /// h2load's own latency grows (a no-op server's mean went from 0.14 to 1.1 ms here).
        #[arg(long, default_value_t = 1)]
        streams: u32,
        /// Most requests outstanding on one connection in the throughput runs (closed loop):
        /// with few outstanding, the slowest path's latency sets the rate instead of the
        /// server's capacity.
        #[arg(long, default_value_t = 16)]
        throughput_streams: u32,
        /// Measured seconds of each run.
        #[arg(long, default_value_t = 10)]
        duration_s: u64,
        /// Seconds of the same load before each latency run, not measured.
        #[arg(long, default_value_t = 3)]
        warmup_s: u64,
        /// Rounds; each runs every case against the agent and the no-op server.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Run only this case (repeatable): local, leased.
        #[arg(long = "case")]
        cases: Vec<String>,
        /// Also measure closed-loop throughput (agent against no-op).
        #[arg(long)]
        throughput: bool,
        /// The h2load binary.
        #[arg(long, default_value = "h2load")]
        h2load: std::path::PathBuf,
        /// Many keys through a real Envoy: h2load sends GETs of paths drawn from Zipf(--zipf)
        /// over --keys tenants to an Envoy whose rate-limit filter calls the agent (or, in the
        /// other arm, the no-op server through an Envoy of the same config).
        #[arg(long)]
        via_envoy: bool,
        /// The Envoy binary (--via-envoy) [default: $ENVOY, else `envoy` on PATH].
        #[arg(long)]
        envoy: Option<std::path::PathBuf>,
        /// Distinct tenants per rule (--via-envoy).
        #[arg(long, default_value_t = 10_000)]
        keys: u32,
        /// Zipf exponent of the tenants' popularity (--via-envoy).
        #[arg(long, default_value_t = 1.1)]
        zipf: f64,
        /// Paths in h2load's URI file, used in order by every connection (--via-envoy).
        #[arg(long, default_value_t = 100_000)]
        uris: usize,
        /// Seed of the tenant draws (--via-envoy).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Envoy's worker threads (--via-envoy). With one, Envoy itself (RLS call plus the
        /// upstream hop) saturated below 5,000 req/s on a 2-core guest.
        #[arg(long, default_value_t = 2)]
        envoy_concurrency: u32,
        /// Folder of allot-allocator and allot-agent [default: $ALLOT_BIN_DIR, else this
        /// binary's folder].
        #[arg(long)]
        bin_dir: Option<std::path::PathBuf>,
        /// Data folder (policies, logs, h2load's per-request logs) [default: a new temporary
        /// folder, removed at exit].
        #[arg(long)]
        data_dir: Option<std::path::PathBuf>,
        /// Print one JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn bin_dir_or_default(bin_dir: Option<std::path::PathBuf>) -> Result<std::path::PathBuf> {
    let bin_dir = match bin_dir.or_else(|| std::env::var_os("ALLOT_BIN_DIR").map(Into::into)) {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_default(),
    };
    if !memory::has_binaries(&bin_dir) {
        bail!(
            "allot-allocator and allot-agent not found in {}: cargo build --release -p allot-allocator -p allot-agent",
            bin_dir.display()
        );
    }
    Ok(bin_dir)
}

/// Removes the run's temporary data folder, then prints its report as JSON or as its table.
fn report<R: serde::Serialize>(
    r: Result<R>,
    temp_dir: Option<&std::path::Path>,
    json: bool,
    table: impl Fn(&R) -> String,
) -> Result<()> {
    if let Some(d) = temp_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    let r = r?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", table(&r));
    }
    Ok(())
}

fn parse_entries(entries: Vec<String>) -> Result<Vec<(String, String)>> {
    let mut es = Vec::new();
    for e in entries {
        let Some((k, v)) = e.split_once('=') else {
            bail!("--entry {e:?} is not key=value");
        };
        es.push((k.to_string(), v.to_string()));
    }
    Ok(es)
}

async fn rpc_count(http: &str) -> Result<u64> {
    let v: serde_json::Value = reqwest::get(format!("http://{http}/v1/status"))
        .await?
        .json()
        .await?;
    let c = &v["counters"];
    Ok(["acquires", "reports", "releases"]
        .iter()
        .map(|k| c[k].as_u64().unwrap_or(0))
        .sum())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.threads.max(1))
        .enable_all()
        .build()?
        .block_on(run(cli.command))
}

async fn run(command: Command) -> Result<()> {
    match command {
        Command::Rls {
            target,
            rate,
            duration,
            warmup,
            domain,
            entries,
            keys,
            zipf,
            seed,
            max_in_flight,
            baseline,
            baseline_target,
            repeat,
            json,
        } => {
            if rate == 0 || duration == 0 {
                bail!("--rate and --duration must be positive");
            }
            let es = parse_entries(entries)?;
            let key_choice = match zipf {
                Some(s) => Keys::Zipf {
                    dist: Zipf::new(keys, s)?,
                    seed,
                },
                None => Keys::RoundRobin(keys),
            };
            let base_addr = match (baseline, baseline_target) {
                (true, _) => Some((allot_simulations::noop::spawn().await?, "in-process")),
                (false, Some(a)) => Some((a, "own process")),
                (false, None) => None,
            };
            let measure = |addr: String| {
                let (domain, es, key_choice) = (domain.clone(), es.clone(), key_choice.clone());
                async move {
                    let run = |secs| {
                        run_load(
                            &addr,
                            &domain,
                            &es,
                            key_choice.clone(),
                            rate,
                            Duration::from_secs(secs),
                            max_in_flight,
                        )
                    };
                    if warmup > 0 {
                        run(warmup).await?;
                    }
                    run(duration).await
                }
            };
            // Baseline and target alternate, so each pair saw the same machine conditions.
            let mut runs = Vec::new();
            for _ in 0..repeat.max(1) {
                let base = match &base_addr {
                    Some((addr, _)) => Some(measure(addr.clone()).await?),
                    None => None,
                };
                runs.push((measure(target.clone()).await?, base));
            }
            // The run whose target p99 (from send) is the median of the repeats.
            let mut order: Vec<usize> = (0..runs.len()).collect();
            order.sort_by_key(|&i| runs[i].0.svc_p99_us);
            let (r, base) = &runs[order[order.len() / 2]];
            if json {
                let all: Vec<_> = runs
                    .iter()
                    .map(|(t, b)| serde_json::json!({"target": t, "baseline": b}))
                    .collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &serde_json::json!({"target": r, "baseline": base, "runs": all})
                    )?
                );
                return Ok(());
            }
            let popularity =
                zipf.map_or("in turn".to_string(), |s| format!("Zipf({s}), seed {seed}"));
            println!(
                "target {target}  rate {rate}/s  duration {duration} s  warm-up {warmup} s  keys {keys} ({popularity})  runs {}",
                runs.len()
            );
            let place = base_addr.as_ref().map_or("", |(_, p)| *p);
            for (k, (t, b)) in runs.iter().enumerate() {
                let mut line = format!(
                    "run {}: target p50 {} µs  p99 {} µs from send, p99 {} µs from schedule",
                    k + 1,
                    t.svc_p50_us,
                    t.svc_p99_us,
                    t.p99_us
                );
                if let Some(b) = b {
                    line += &format!(
                        " | no-op baseline ({place}) p50 {} µs  p99 {} µs from send, p99 {} µs from schedule | p99 from send {:.2}x",
                        b.svc_p50_us,
                        b.svc_p99_us,
                        b.p99_us,
                        t.svc_p99_us as f64 / b.svc_p99_us.max(1) as f64
                    );
                }
                println!("{line}");
            }
            println!("median run (by target p99 from send):");
            println!(
                "sent {}  admitted {}  denied {}  errors {}  admitted ratio {:.4}",
                r.sent, r.ok, r.over_limit, r.errors, r.admitted_ratio
            );
            println!("throughput {:.0}/s", r.throughput);
            println!(
                "latency µs from send      p50 {}  p99 {}  p99.9 {}",
                r.svc_p50_us, r.svc_p99_us, r.svc_p999_us
            );
            println!(
                "latency µs from schedule  p50 {}  p99 {}  p99.9 {}  max {}",
                r.p50_us, r.p99_us, r.p999_us, r.max_us
            );
            Ok(())
        }
        Command::Memory {
            keys,
            fill_rate,
            steady_rate,
            duration_s,
            sample_s,
            parts,
            rounds,
            bin_dir,
            data_dir,
            json,
        } => {
            let bin_dir = bin_dir_or_default(bin_dir)?;
            let (data_dir, temp) = match data_dir {
                Some(d) => (d, false),
                None => (memory::temp_dir(), true),
            };
            let o = memory::Options {
                bin_dir,
                data_dir: data_dir.clone(),
                keys,
                fill_rate,
                steady_rate,
                duration: Duration::from_secs(duration_s),
                sample: Duration::from_secs(sample_s),
                parts,
                rounds,
            };
            let r = memory::run(&o, |line| eprintln!("{line}")).await;
            report(r, temp.then_some(data_dir.as_path()), json, |r| {
                memory::table(r)
            })
        }
        Command::H2load {
            rate,
            clients,
            streams,
            throughput_streams,
            duration_s,
            warmup_s,
            rounds,
            cases,
            throughput,
            h2load: h2load_bin,
            via_envoy,
            envoy,
            keys,
            zipf,
            uris,
            seed,
            envoy_concurrency,
            bin_dir,
            data_dir,
            json,
        } => {
            let (data_dir, temp) = match data_dir {
                Some(d) => (d, false),
                None => (
                    std::env::temp_dir().join(format!("allot-h2load-{}", std::process::id())),
                    true,
                ),
            };
            let o = h2load::Options {
                h2load: h2load_bin,
                bin_dir: bin_dir_or_default(bin_dir)?,
                bench_exe: std::env::current_exe()?,
                data_dir: data_dir.clone(),
                rate,
                clients,
                streams,
                throughput_streams,
                duration: Duration::from_secs(duration_s),
                warmup: Duration::from_secs(warmup_s),
                rounds,
                cases,
                throughput,
                via_envoy: via_envoy.then(|| h2load::ViaEnvoy {
                    envoy: envoy
                        .or_else(|| std::env::var_os("ENVOY").map(Into::into))
                        .unwrap_or_else(|| "envoy".into()),
                    keys,
                    zipf,
                    uris,
                    seed,
                    concurrency: envoy_concurrency,
                }),
            };
            let r = h2load::run(&o, |line| eprintln!("{line}")).await;
            report(r, temp.then_some(data_dir.as_path()), json, h2load::table)
        }
        Command::Noop { listen, ready_file } => {
            allot_simulations::noop::serve(&listen, ready_file.as_deref()).await
        }
        Command::Steady {
            target,
            http,
            rate,
            duration,
            domain,
            entries,
        } => {
            let es = parse_entries(entries)?;
            // Warm-up: cold keys acquire, demand estimates settle.
            let one = || Keys::RoundRobin(1);
            run_load(
                &target,
                &domain,
                &es,
                one(),
                rate,
                Duration::from_secs(3),
                1024,
            )
            .await?;
            let before = rpc_count(&http).await?;
            let r = run_load(
                &target,
                &domain,
                &es,
                one(),
                rate,
                Duration::from_secs(duration),
                1024,
            )
            .await?;
            let after = rpc_count(&http).await?;
            let rpcs = after - before;
            println!(
                "steady {rate}/s for {duration} s: ok {}  over_limit {}  errors {}",
                r.ok, r.over_limit, r.errors
            );
            println!(
                "latency µs from send  p50 {}  p99 {}  p99.9 {}",
                r.svc_p50_us, r.svc_p99_us, r.svc_p999_us
            );
            println!(
                "allocator RPCs {rpcs} (acquire + report + release) = {:.2} per 1000 admitted",
                rpcs as f64 * 1000.0 / r.ok.max(1) as f64
            );
            Ok(())
        }
    }
}
