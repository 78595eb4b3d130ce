//! `allot-bench rls --target ADDR --rate N --duration S`: an open-loop load generator for any
//! Envoy rate limit service (v3), reporting throughput and latency percentiles measured from
//! each request's scheduled time.

use allot_simulations::rls::run_load;
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
        /// Domain of the requests.
        #[arg(long, default_value = "bench")]
        domain: String,
        /// Descriptor entries, key=value (repeatable; the last one's value is varied over --keys).
        #[arg(long = "entry", default_values_t = vec!["tenant=t".to_string()])]
        entries: Vec<String>,
        /// Distinct values of the last entry (1: one hot key).
        #[arg(long, default_value_t = 1)]
        keys: u32,
        /// Most requests outstanding at once.
        #[arg(long, default_value_t = 512)]
        max_in_flight: usize,
        /// First run the same load against a do-nothing RLS server started in-process (the
        /// transport's own cost) and print the target's latency as a ratio of it.
        #[arg(long)]
        baseline: bool,
        /// Print one JSON document instead of a table.
        #[arg(long)]
        json: bool,
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

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Rls {
            target,
            rate,
            duration,
            domain,
            entries,
            keys,
            max_in_flight,
            baseline,
            json,
        } => {
            if rate == 0 || duration == 0 {
                bail!("--rate and --duration must be positive");
            }
            let es = parse_entries(entries)?;
            let base = if baseline {
                let addr = allot_simulations::noop::spawn().await?;
                Some(
                    run_load(
                        &addr,
                        &domain,
                        &es,
                        keys,
                        rate,
                        Duration::from_secs(duration),
                        max_in_flight,
                    )
                    .await?,
                )
            } else {
                None
            };
            let r = run_load(
                &target,
                &domain,
                &es,
                keys,
                rate,
                Duration::from_secs(duration),
                max_in_flight,
            )
            .await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &serde_json::json!({"target": r, "baseline": base})
                    )?
                );
            } else {
                if let Some(b) = &base {
                    println!(
                        "baseline (no-op RLS in-process): throughput {:.0}/s  from send: p50 {} µs  p99 {} µs  p99.9 {} µs",
                        b.throughput, b.svc_p50_us, b.svc_p99_us, b.svc_p999_us
                    );
                    println!(
                        "target / baseline, from send: p50 {:.2}x  p99 {:.2}x",
                        r.svc_p50_us as f64 / b.svc_p50_us.max(1) as f64,
                        r.svc_p99_us as f64 / b.svc_p99_us.max(1) as f64
                    );
                }
                println!("target {target}  rate {rate}/s  duration {duration} s  keys {keys}");
                println!(
                    "sent {}  ok {}  over_limit {}  errors {}",
                    r.sent, r.ok, r.over_limit, r.errors
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
            }
            Ok(())
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
            run_load(&target, &domain, &es, 1, rate, Duration::from_secs(3), 1024).await?;
            let before = rpc_count(&http).await?;
            let r = run_load(
                &target,
                &domain,
                &es,
                1,
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
