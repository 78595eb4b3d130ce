//! `allot-sim`: the deterministic simulation (issue 12). `--seeds N` runs seeds 0..N and prints
//! a summary; `--seed N` runs one and prints its report, the same every time; `strategies
//! --out docs/` writes the strategy table and the lease sweep (`docs/strategies.md`).

use allot_simulations::sim::faults::FaultKind;
use allot_simulations::sim::summary::{one, Summary};
use allot_simulations::sim::workload::Workload;
use allot_simulations::sim::{run, LeaseTuning, SimConfig};
use allot_simulations::strategy::{compare, doc, sweep, Strategy};
use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Deterministic simulation of Allot under faults (issue 12)")]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
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
    /// With --seed: write every request's answer and the ideal counter's to this CSV file
    /// (`sent_ms,agent,key,cost,answer,ideal_admits`), to read false rejections per key.
    #[arg(long)]
    records: Option<std::path::PathBuf>,
    /// Agents ask rate-carrying allocations (`lease.rate_leases: true`, design §9).
    #[arg(long)]
    rate_leases: bool,
    /// Agents never ask a rate for a key whose scarcity has settled (`lease.settled_rates:
    /// false`): lumps only, as before 2026-12-07.
    #[arg(long)]
    no_settled_rates: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the strategy table and the lease sweep (issue 12 items 4-5) and write
    /// `strategies.md` and its SVG plots into OUT.
    Strategies {
        /// Folder to write into.
        #[arg(long, default_value = "docs/")]
        out: PathBuf,
        /// The seed of every run (traffic, network randomness).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Skip the sweep.
        #[arg(long)]
        no_sweep: bool,
        /// Run one cell of the table alone, STRATEGY/WORKLOAD (e.g. leases/acme-burst), and
        /// print its report and whole trace instead of writing the document.
        #[arg(long)]
        cell: Option<String>,
        /// With --cell: play no faults (to tell a fault's effect from the strategy's).
        #[arg(long)]
        cell_no_faults: bool,
    },
}

/// Runs one cell of the strategy table and prints its report and trace.
fn cell(name: &str, seed: u64, no_faults: bool) -> Result<()> {
    let Some((s, w)) = name.split_once('/') else {
        bail!("--cell takes STRATEGY/WORKLOAD, got {name:?}");
    };
    let Some(strategy) = Strategy::ALL.iter().find(|x| x.name() == s) else {
        bail!("unknown strategy {s:?}");
    };
    let Some(workload) = Workload::ALL.iter().find(|x| x.name() == w) else {
        bail!("unknown workload {w:?}");
    };
    let mut config = strategy.config(*workload);
    if no_faults {
        config.schedule = Some(Vec::new());
    }
    let r = run(seed, &config)?;
    print!(
        "{}",
        one(
            &r,
            &format!("allot-sim strategies --seed {seed} --cell {name}")
        )
    );
    for (t, e) in &r.trace {
        println!("{:>6}.{:03}ms {e}", t / 1_000_000, (t / 1_000) % 1_000);
    }
    Ok(())
}

/// The strategy table and the sweep, written to `out`.
fn strategies(out: &std::path::Path, seed: u64, with_sweep: bool) -> Result<()> {
    let started = Instant::now();
    let cells = compare::compare(seed, &Workload::ALL, &Strategy::ALL, |c| {
        eprintln!(
            "{:>14} {:<16} admitted {:>5}/{:<5} overshoot {:>6.1} tok  calls/1000 {:>6.0}  [{:.0} s]",
            c.workload.name(),
            c.strategy.name(),
            c.measured.admitted,
            c.measured.ideal_admitted,
            c.measured.overshoot.micros as f64 / 1e6,
            c.measured.calls_per_1000,
            started.elapsed().as_secs_f64()
        );
    })?;
    let points = if with_sweep {
        let workloads = [Workload::AcmeBurst, Workload::RegionalSkew];
        sweep::sweep(seed, &workloads, &sweep::grid(), |p| {
            eprintln!(
                "{:>14} b {:>2} Δ {:>4} ttl {:>5}: bound {:>5.1} unreported {:>5.1} calls/1000 {:>5.0}  [{:.0} s]",
                p.workload.name(),
                p.max_grant,
                p.report_ms,
                p.ttl_ms,
                p.measured.max_bound as f64 / 1e6,
                p.max_unreported as f64 / 1e6,
                p.measured.calls_per_1000,
                started.elapsed().as_secs_f64()
            );
        })?
    } else {
        Vec::new()
    };
    doc::write(out, seed, &cells, &points)?;
    eprintln!(
        "wrote {} in {:.0} s",
        out.join("strategies.md").display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(Command::Strategies {
        out,
        seed,
        no_sweep,
        cell: one_cell,
        cell_no_faults,
    }) = &args.command
    {
        return match one_cell {
            Some(name) => cell(name, *seed, *cell_no_faults),
            None => strategies(out, *seed, !no_sweep),
        };
    }
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
        tuning: LeaseTuning {
            rate_leases: args.rate_leases.then_some(true),
            settled_rates: args.no_settled_rates.then_some(false),
            ..LeaseTuning::default()
        },
        ..SimConfig::default()
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
        if args.rate_leases {
            c.push_str(" --rate-leases");
        }
        if args.no_settled_rates {
            c.push_str(" --no-settled-rates");
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
        if let Some(path) = &args.records {
            write_records(path, &r)?;
        }
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

/// Writes `r`'s requests, Allot's answer and the ideal central counter's, as CSV.
fn write_records(path: &std::path::Path, r: &allot_simulations::sim::RunReport) -> Result<()> {
    use std::io::Write;
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(w, "sent_ms,agent,key,cost,answer,ideal_admits")?;
    for (x, ok) in r.records.iter().zip(&r.ideal) {
        let answer = format!("{:?}", x.answer).to_lowercase();
        let ms = x.sent_ns / 1_000_000;
        writeln!(w, "{ms},{},{},{},{answer},{ok}", x.agent, x.key, x.cost)?;
    }
    w.flush()?;
    Ok(())
}
