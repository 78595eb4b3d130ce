//! `allot-agent`: the gateway sidecar. Serves Envoy's rate limit service v3 and the native
//! `allot.v1.Agent` gRPC service on one port and the HTTP API on another, deciding locally from
//! allocations leased from the allocator. SIGINT or SIGTERM stops it gracefully: the servers stop
//! accepting, and every allocation is released with its final spend before the process exits.
//! SIGHUP (and, every `--policy-reload-ms`, a change of the files) reloads the policies.

use allot_agent::reload::{hangup_signal, PolicyFiles};
use allot_agent::server::{serve_grpc, serve_http, Agent, AgentFile};
use allot_common::clock::MonotonicClock;
use allot_common::config::{read_policy_documents, ConfigSet};
use allot_common::process::{stop_signal, write_ready_file};
use anyhow::{bail, Context, Result};
use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Command line; every flag overrides the settings file.
#[derive(Debug, Parser)]
#[command(name = "allot-agent", version, about = "Allot gateway agent")]
struct Cli {
    /// Settings file (YAML): agent_id, region, allocators, listen, policies, lease, gateway.
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// This agent's id (default: the host name, else "agent").
    #[arg(long)]
    agent_id: Option<String>,
    /// Region the agent runs in (default "default").
    #[arg(long)]
    region: Option<String>,
    /// Allocator node `host:port`; repeat for each node.
    #[arg(long = "allocator")]
    allocators: Vec<String>,
    /// gRPC listen address for RLS and the native API (default 127.0.0.1:8081); port 0 lets
    /// the system pick a free port (see --ready-file).
    #[arg(long)]
    grpc_listen: Option<String>,
    /// HTTP listen address (default 127.0.0.1:8080); port 0 lets the system pick one.
    #[arg(long)]
    http_listen: Option<String>,
    /// Once both servers listen, write the addresses they bound ("grpc HOST:PORT" and
    /// "http HOST:PORT", one a line) to this file, atomically, so a launcher that started the
    /// agent on port 0 learns where it is.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Policy YAML file or folder. Read again on SIGHUP and every --policy-reload-ms; a
    /// changed, valid set becomes current without a restart, an invalid one is refused.
    #[arg(long)]
    policies: Option<PathBuf>,
    /// How often the policies are read again, ms (default 5000); 0: only on SIGHUP.
    #[arg(long)]
    policy_reload_ms: Option<u64>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a terminal: a log file or collector gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run(cli))
}

/// Default of `--policy-reload-ms`: a changed policy file is in force within 5 s.
const DEFAULT_POLICY_RELOAD_MS: u64 = 5_000;

/// What the command line and the settings file resolve to (a flag wins over the file).
struct Resolved {
    file: AgentFile,
    agent_id: String,
    region: String,
    allocators: Vec<String>,
    policy_path: PathBuf,
    policy_reload: Option<Duration>,
    grpc_addr: String,
    http_addr: String,
    ready_file: Option<PathBuf>,
}

impl Resolved {
    /// Reads the settings file (if any) and applies the flags over it.
    ///
    /// # Errors
    /// An unreadable settings file, or no policies given.
    fn of(cli: Cli) -> Result<Self> {
        let file = match &cli.config {
            Some(p) => AgentFile::load(p)?,
            None => AgentFile::default(),
        };
        let Some(policy_path) = cli.policies.or(file.policies.clone()) else {
            bail!(
                "no policies given: pass --policies FILE_OR_DIR or set `policies` in the settings \
                 file"
            );
        };
        Ok(Resolved {
            agent_id: cli
                .agent_id
                .or(file.agent_id.clone())
                .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
                .unwrap_or_else(|| "agent".to_string()),
            region: cli
                .region
                .or(file.region.clone())
                .unwrap_or_else(|| "default".to_string()),
            allocators: if cli.allocators.is_empty() {
                file.allocators.clone()
            } else {
                cli.allocators
            },
            policy_path,
            policy_reload: match cli.policy_reload_ms.or(file.policy_reload_ms) {
                Some(0) => None,
                ms => Some(Duration::from_millis(
                    ms.unwrap_or(DEFAULT_POLICY_RELOAD_MS),
                )),
            },
            grpc_addr: cli
                .grpc_listen
                .or(file.listen.grpc.clone())
                .unwrap_or_else(|| "127.0.0.1:8081".to_string()),
            http_addr: cli
                .http_listen
                .or(file.listen.http.clone())
                .unwrap_or_else(|| "127.0.0.1:8080".to_string()),
            ready_file: cli.ready_file,
            file,
        })
    }
}

async fn run(cli: Cli) -> Result<()> {
    let r = Resolved::of(cli)?;
    let loading = || format!("loading policies from {}", r.policy_path.display());
    let documents = read_policy_documents(&r.policy_path).with_context(loading)?;
    let policies = ConfigSet::from_documents(&documents).with_context(loading)?;
    let lease = r.file.lease_settings(&r.agent_id, &r.region);
    let mut agent = Agent::build(
        policies,
        lease,
        r.file.tracking_settings(),
        &r.allocators,
        Arc::new(MonotonicClock::new()),
    )?;
    let grpc = bind(&r.grpc_addr, "gRPC").await?;
    let http = bind(&r.http_addr, "HTTP").await?;
    let (grpc_bound, http_bound) = (grpc.local_addr()?, http.local_addr()?);
    tracing::info!(
        agent_id = r.agent_id,
        region = r.region,
        grpc = %grpc_bound,
        http = %http_bound,
        allocators = ?r.allocators,
        policies = %r.policy_path.display(),
        "allot-agent listening"
    );

    // Two stop signals, in order (issue 10 item 3): the servers drain first, so no request is
    // being decided when the lease manager closes and releases the allocations.
    let (stop_serving, serving) = watch::channel(false);
    let (stop_background, background_shutdown) = watch::channel(false);
    let background = agent.spawn_background(background_shutdown.clone());
    let files = PolicyFiles::new(
        r.policy_path.clone(),
        documents,
        !r.allocators.is_empty(),
        agent.decider.clone(),
    );
    // Installed before the ready file is written: a SIGHUP from then on reloads, never kills.
    tokio::spawn(Arc::new(files).watch(hangup_signal(), r.policy_reload, background_shutdown));
    let grpc_task = tokio::spawn(serve_grpc(grpc, agent.decider.clone(), serving.clone()));
    let http_task = tokio::spawn(serve_http(http, agent.decider.clone(), serving));
    if let Some(path) = &r.ready_file {
        // Both listeners are bound (connections queue until the servers accept them).
        write_ready_file(path, &format!("grpc {grpc_bound}\nhttp {http_bound}\n"))
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }

    stop_signal().await?;
    tracing::info!("shutting down: draining requests");
    let _ = stop_serving.send(true);
    drained("gRPC", grpc_task).await;
    drained("HTTP", http_task).await;
    tracing::info!("releasing allocations");
    let _ = stop_background.send(true);
    // Allocations are closed, then released; bounded so a dead allocator cannot hold us forever
    // (the allocator expires what is not released anyway). A server that did not drain in time
    // cannot spend past the close.
    if tokio::time::timeout(Duration::from_secs(10), background)
        .await
        .is_err()
    {
        tracing::warn!("releasing allocations timed out; the allocator will expire them");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Binds the `what` listener (gRPC or HTTP) at `addr`.
async fn bind(addr: &str, what: &str) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} ({what})"))
}

/// Waits (at most 5 s) for the `what` server to stop after the stop signal, logging how it did.
async fn drained<E: std::fmt::Display>(what: &str, task: JoinHandle<Result<(), E>>) {
    match tokio::time::timeout(Duration::from_secs(5), task).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "{what} server stopped with an error"),
        Err(_) => tracing::warn!("{what} server did not stop in time"),
        _ => {}
    }
}
