//! `allot-allocator`: one node of the Allot allocator cluster.
//!
//! Serves the Raft transport and the `allot.v1.Allocator` API on one gRPC address. Settings
//! come from an optional YAML file (`--config`, see [`allot_allocator::daemon::config_file`]),
//! overridden by flags. Logs go to stderr (`RUST_LOG` filters them). SIGINT or SIGTERM stop the
//! node gracefully: Raft stops, the server drains, and sled is flushed. SIGHUP reads the
//! `--policies` folder again; the leader installs what changed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::daemon::config_file::FileConfig;
use allot_allocator::daemon::{load_policy_files, Daemon, DaemonConfig};
use allot_allocator::raft::{NodeConfig, RaftTimings, SystemNodeClock};
use allot_common::process::{stop_signal, write_ready_file};
use allot_proto::allot::v1::Member;
use anyhow::{bail, Context, Result};
use clap::Parser;
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    name = "allot-allocator",
    version,
    about = "One node of the Allot allocator cluster"
)]
struct Cli {
    /// YAML configuration file; flags override its fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// This node's Raft id (unique, stable across restarts).
    #[arg(long)]
    node_id: Option<u64>,
    /// Address to bind, "host:port" [default: 127.0.0.1:7701]. Port 0 lets the system pick a
    /// free port: the node then advertises the address it bound (see --ready-file).
    #[arg(long)]
    listen: Option<String>,
    /// Address peers and clients use, "host:port" [default: the listen address; the bound
    /// address when listening on port 0].
    #[arg(long)]
    advertise: Option<String>,
    /// Once the node serves, write "grpc HOST:PORT" (its advertised address) to this file,
    /// atomically, so a launcher that started it on port 0 learns where it is.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Directory of the node's sled database [default: ./data/node-<id>].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Cluster name [default: allot].
    #[arg(long)]
    cluster_name: Option<String>,
    /// A voter of the cluster, ID=HOST:PORT; repeat for each (this node included).
    #[arg(long = "peer")]
    peers: Vec<Member>,
    /// Folder (or file) of policy YAML documents, installed (when changed) the first time this
    /// node leads after it starts; read again on SIGHUP and installed at once by the leader.
    #[arg(long)]
    policies: Option<PathBuf>,
    /// Initialise a new cluster of the listed peers if this node's log is empty.
    #[arg(long)]
    init: bool,
    /// Period of the leader's tick, ms [default: 250].
    #[arg(long)]
    tick_ms: Option<u64>,
    /// Raft heartbeat period, ms [default: 150].
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// Lower bound of the Raft election timeout, ms [default: 750].
    #[arg(long)]
    election_timeout_min_ms: Option<u64>,
    /// Upper bound of the Raft election timeout, ms [default: 1500].
    #[arg(long)]
    election_timeout_max_ms: Option<u64>,
    /// Build a snapshot after this many log entries [default: 5000].
    #[arg(long)]
    snapshot_every_logs: Option<u64>,
}

/// The configuration file named by `--config`, or none.
fn load_file(cli: &Cli) -> Result<FileConfig> {
    Ok(match &cli.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    })
}

/// The address to bind: the flag, else the file, else the default.
fn listen_addr(cli: &Cli, file: &FileConfig) -> String {
    cli.listen
        .clone()
        .or(file.listen.clone())
        .unwrap_or_else(|| "127.0.0.1:7701".into())
}

/// The address peers and clients dial: the flag, else the file, else the listen address as
/// written, except that a port-0 listen address advertises the port the system picked.
fn advertise_addr(cli: &Cli, file: &FileConfig, listen: &str, bound: SocketAddr) -> String {
    let picked = matches!(listen.parse::<SocketAddr>(), Ok(sa) if sa.port() == 0);
    cli.advertise
        .clone()
        .or(file.advertise.clone())
        .unwrap_or_else(|| {
            if picked {
                bound.to_string()
            } else {
                listen.to_string()
            }
        })
}

/// File settings overridden by flags, with defaults filled in; `advertise` is where this node
/// is reached (see [`advertise_addr`]).
fn resolve(
    cli: Cli,
    file: FileConfig,
    advertise: String,
) -> Result<(DaemonConfig, Option<PathBuf>)> {
    let id = cli
        .node_id
        .or(file.node_id)
        .context("a node id is required (--node-id or node_id in the config file)")?;
    // Peers and clients dial the advertised address (leader hints carry it): a wildcard bind
    // address cannot be dialled.
    if let Ok(sa) = advertise.parse::<SocketAddr>() {
        if sa.ip().is_unspecified() {
            bail!("advertise address {advertise} is a wildcard; set --advertise to a reachable host:port");
        }
    }
    let data_dir = cli
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| PathBuf::from(format!("data/node-{id}")));
    let mut members: BTreeMap<u64, String> = file.peers;
    for peer in cli.peers {
        members.insert(peer.node_id, peer.addr);
    }
    if let Some(own) = members.get(&id) {
        if *own != advertise {
            bail!("peer {id} is listed at {own}, but this node advertises {advertise}");
        }
    } else if !members.is_empty() {
        members.insert(id, advertise.clone());
    }
    if cli.init && members.is_empty() {
        members.insert(id, advertise.clone());
    }
    let defaults = RaftTimings::default();
    let t = file.raft;
    let timings = RaftTimings {
        heartbeat_ms: cli
            .heartbeat_ms
            .or(t.heartbeat_ms)
            .unwrap_or(defaults.heartbeat_ms),
        election_timeout_min_ms: cli
            .election_timeout_min_ms
            .or(t.election_timeout_min_ms)
            .unwrap_or(defaults.election_timeout_min_ms),
        election_timeout_max_ms: cli
            .election_timeout_max_ms
            .or(t.election_timeout_max_ms)
            .unwrap_or(defaults.election_timeout_max_ms),
        snapshot_every_logs: cli
            .snapshot_every_logs
            .or(t.snapshot_every_logs)
            .unwrap_or(defaults.snapshot_every_logs),
        stagger_snapshots: t.stagger_snapshots.unwrap_or(defaults.stagger_snapshots),
        logs_kept_after_snapshot: t
            .logs_kept_after_snapshot
            .unwrap_or(defaults.logs_kept_after_snapshot),
    };
    let policy_dir = cli.policies.or(file.policies);
    let policies = match &policy_dir {
        Some(dir) => load_policy_files(dir)?,
        None => Vec::new(),
    };
    let config = DaemonConfig {
        node: NodeConfig {
            id,
            advertise_addr: advertise,
            data_dir,
            cluster_name: cli
                .cluster_name
                .or(file.cluster_name)
                .unwrap_or_else(|| "allot".into()),
            timings,
        },
        members,
        init: cli.init,
        tick_every: Duration::from_millis(cli.tick_ms.or(file.tick_ms).unwrap_or(250)),
        policies,
    };
    Ok((config, policy_dir))
}

/// SIGHUP: reads the policy folder again and has the daemon install what changed, now if this
/// node leads ([`Daemon::reinstall_policies`]); a folder that no longer loads, or holds no
/// policy file, is logged and changes nothing.
fn reload_policies(daemon: &mut Daemon, dir: Option<&Path>) {
    let Some(dir) = dir else {
        tracing::info!("SIGHUP: no policy folder configured; nothing to reload");
        return;
    };
    match load_policy_files(dir) {
        Ok(files) if files.is_empty() => {
            tracing::error!(policies = %dir.display(), "SIGHUP: no policy file in the folder; nothing changed")
        }
        Ok(files) => {
            tracing::info!(policies = %dir.display(), files = files.len(), "SIGHUP: policies re-read");
            daemon.reinstall_policies(files);
        }
        Err(e) => {
            tracing::error!(policies = %dir.display(), error = %e, "SIGHUP: policies not reloaded; nothing changed")
        }
    }
}

/// mimalloc, not glibc's allocator: see `allot_allocator::heap`.
#[global_allocator]
static GLOBAL: allot_allocator::heap::ProcessAllocator = allot_allocator::heap::PROCESS_ALLOCATOR;

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("allot-allocator: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain; no backtrace for an operator's mistake.
            eprintln!("allot-allocator: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,openraft=warn")),
        )
        .init();
    let cli = Cli::parse();
    let file = load_file(&cli)?;
    let listen = listen_addr(&cli, &file);
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let bound = listener.local_addr().context("no local address")?;
    let advertise = advertise_addr(&cli, &file, &listen, bound);
    let ready_file = cli.ready_file.clone();
    let (config, policy_dir) = resolve(cli, file, advertise)?;
    tracing::info!(
        node = config.node.id,
        %listen,
        %bound,
        advertise = %config.node.advertise_addr,
        data_dir = %config.node.data_dir.display(),
        policies = config.policies.len(),
        "starting"
    );
    let advertise = config.node.advertise_addr.clone();
    // Installed before the node starts (and so before the ready file): from then on SIGHUP
    // re-reads the policy folder instead of ending the process, its default action.
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot watch SIGHUP")?;
    let mut daemon = Daemon::start(config, Arc::new(SystemNodeClock), listener).await?;
    if let Some(path) = &ready_file {
        // Written only now: the server accepts connections and the address is final.
        write_ready_file(path, &format!("grpc {advertise}\n"))
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }
    let stop = stop_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            r = &mut stop => break r?,
            _ = hangup.recv() => reload_policies(&mut daemon, policy_dir.as_deref()),
        }
    }
    tracing::info!("stopping");
    daemon.shutdown().await?;
    tracing::info!("stopped; data flushed");
    Ok(())
}
