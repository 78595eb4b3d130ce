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
        /// Print one JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
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
            json,
        } => {
            if rate == 0 || duration == 0 {
                bail!("--rate and --duration must be positive");
            }
            let mut es = Vec::new();
            for e in entries {
                let Some((k, v)) = e.split_once('=') else {
                    bail!("--entry {e:?} is not key=value");
                };
                es.push((k.to_string(), v.to_string()));
            }
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
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("target {target}  rate {rate}/s  duration {duration} s  keys {keys}");
                println!(
                    "sent {}  ok {}  over_limit {}  errors {}",
                    r.sent, r.ok, r.over_limit, r.errors
                );
                println!("throughput {:.0}/s", r.throughput);
                println!(
                    "latency µs  p50 {}  p99 {}  p99.9 {}  max {}",
                    r.p50_us, r.p99_us, r.p999_us, r.max_us
                );
            }
            Ok(())
        }
    }
}
