//! `allot-sim`: the deterministic simulation (issue 12). `--seeds N` runs seeds 0..N and prints
//! a summary; `--seed N` runs one and prints its report, the same every time.

use allot_simulations::sim::faults::FaultKind;
use allot_simulations::sim::summary::{one, Summary};
use allot_simulations::sim::workload::Workload;
use allot_simulations::sim::{run, SimConfig};
use anyhow::{bail, Result};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Deterministic simulation of Allot under faults (issue 12)")]
struct Args {
    /// Run seeds 0..N and print a summary.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// Run this seed alone and print its report.
    #[arg(long)]
    seed: Option<u64>,
    /// First seed of a sweep.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Simulated length of a run, ms.
    #[arg(long, default_value_t = 12_000)]
    duration_ms: u64,
    /// When traffic and faults start, ms (the cluster has a leader by then).
    #[arg(long, default_value_t = 2_000)]
    traffic_from_ms: u64,
    /// Allocator nodes (3 or 5).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// No faults.
    #[arg(long)]
    no_faults: bool,
    /// One workload only: acme-burst, quiet, regional-skew, zipf-1000.
    #[arg(long)]
    workload: Option<String>,
    /// Only faults of these kinds (repeatable; e.g. state-loss, node-crash).
    #[arg(long)]
    only: Vec<String>,
    /// Print every run's report in a sweep.
    #[arg(long)]
    verbose: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let workload = match args.workload.as_deref() {
        None => None,
        Some(name) => match Workload::ALL.iter().find(|w| w.name() == name) {
            Some(w) => Some(*w),
            None => bail!("unknown workload {name:?}"),
        },
    };
    let mut only = Vec::new();
    for name in &args.only {
        match FaultKind::ALL.iter().find(|k| k.to_string() == *name) {
            Some(k) => only.push(*k),
            None => bail!("unknown fault kind {name:?}"),
        }
    }
    if ![3, 5].contains(&args.nodes) {
        bail!("--nodes must be 3 or 5");
    }
    let config = SimConfig {
        duration_ms: args.duration_ms,
        traffic_from_ms: args.traffic_from_ms,
        nodes: args.nodes,
        faults: !args.no_faults,
        workload,
        only,
    };
    let replay = |seed: u64| {
        let mut c = format!(
            "cargo run --release -p allot-simulations --bin allot-sim -- --seed {seed} \
             --duration-ms {} --traffic-from-ms {} --nodes {}",
            args.duration_ms, args.traffic_from_ms, args.nodes
        );
        if args.no_faults {
            c.push_str(" --no-faults");
        }
        if let Some(w) = &args.workload {
            c.push_str(&format!(" --workload {w}"));
        }
        for k in &args.only {
            c.push_str(&format!(" --only {k}"));
        }
        c
    };
    if let Some(seed) = args.seed {
        let r = run(seed, &config)?;
        print!("{}", one(&r, &replay(seed)));
        if r.failed() {
            std::process::exit(1);
        }
        return Ok(());
    }
    let mut summary = Summary::default();
    for seed in args.from..args.from + args.seeds {
        let r = run(seed, &config)?;
        if args.verbose || !r.violations.is_empty() {
            print!("{}", one(&r, &replay(seed)));
        }
        summary.add(&r);
    }
    print!("{}", summary.text());
    if !summary.failed.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
