//! `allotctl`: Allot's operators' CLI.
//!
//! * `allotctl replay --config FILE|DIR --trace FILE.jsonl [--through core|agent]`: decide a
//!   recorded trace against a policy on a virtual clock (contract:
//!   `shared/acceptance/README.md`), by the decision core or through an agent's APIs;
//! * `allotctl validate --config FILE|DIR`: check a policy before rollout;
//! * `allotctl cluster init | add-learner | change-membership | status`, `allotctl policy put`,
//!   `allotctl shares set`, `allotctl status`: administer an allocator cluster over gRPC.
//!
//! Exit codes: 0 success, 1 the allocator refused (the gRPC code and message are printed, with
//! the leader's address when a follower named it), 2 any other error.

mod admin;
mod replay;
mod through_agent;
mod wire;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "allotctl", version, about = "Allot operators' CLI")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum SummaryFormat {
    /// A table on stderr.
    Text,
    /// One JSON document on stderr.
    Json,
    /// No summary.
    None,
}

#[derive(Clone, Copy, ValueEnum)]
enum Through {
    /// `Limiter::decide`.
    Core,
    /// An agent's `allot.v1.Agent/Check` and `ShouldRateLimit` handlers.
    Agent,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a JSONL trace of Envoy RateLimitRequests against a policy on a virtual clock.
    ///
    /// Prints one JSON decision per request line to stdout and per-limit counts of allowed,
    /// denied and shadow-denied requests to stderr.
    Replay {
        /// A config file, or a folder of them (one domain each).
        #[arg(long)]
        config: PathBuf,
        /// The trace: one {"t_ms", "request"} or {"t_ms", "config"} object per line.
        #[arg(long)]
        trace: PathBuf,
        /// Summary format.
        #[arg(long, value_enum, default_value = "text")]
        summary: SummaryFormat,
        /// What decides: the decision core, or an agent's gateway APIs in process (native
        /// Check, cross-checked field by field against Envoy RLS; every rule `scope: local`).
        #[arg(long, value_enum, default_value = "core")]
        through: Through,
    },
    /// Validate a config file or folder; exits non-zero with the file, field and value at fault.
    Validate {
        /// A config file, or a folder of them (also accepted as `--config PATH`).
        #[arg(
            value_name = "PATH",
            required_unless_present = "config",
            conflicts_with = "config"
        )]
        path: Option<PathBuf>,
        /// A config file, or a folder of them.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Allocator cluster membership and Raft state.
    #[command(subcommand)]
    Cluster(admin::ClusterCommand),
    /// Allocator policy documents.
    #[command(subcommand)]
    Policy(admin::PolicyCommand),
    /// Region shares of an allocator policy.
    #[command(subcommand)]
    Shares(admin::SharesCommand),
    /// Per-region allocations of one policy key: live, granted, reported, stranded and the
    /// overshoot bound.
    Status(admin::StatusArgs),
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("allotctl: error: {e:#}");
            if e.downcast_ref::<admin::RemoteError>().is_some() {
                ExitCode::from(1)
            } else {
                ExitCode::from(2)
            }
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Replay {
            config,
            trace,
            summary,
            through,
        } => {
            let stdout = std::io::stdout();
            let mut lock = stdout.lock();
            let s = match through {
                Through::Core => replay::run(&config, &trace, &mut lock)?,
                Through::Agent => {
                    let set = replay::load(&config, &trace)?;
                    let mut agent = through_agent::AgentDecider::new(set)?;
                    replay::run_with(&mut agent, &trace, &mut lock)?
                }
            };
            match summary {
                SummaryFormat::Text => eprint!("{}", s.table()),
                SummaryFormat::Json => eprintln!("{}", serde_json::to_string(&s)?),
                SummaryFormat::None => {}
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Validate { path, config } => {
            let Some(config) = path.or(config) else {
                anyhow::bail!("give the config file or folder to validate");
            };
            let set = allot_common::config::ConfigSet::load(&config)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut domains: Vec<_> = set.domains().collect();
            domains.sort_by(|a, b| a.domain.cmp(&b.domain));
            for d in domains {
                println!("ok: domain {:?}: {} rules", d.domain, d.rules.len());
                for r in &d.rules {
                    println!("  {}", describe(r));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(c) => admin::cluster(c).map(|()| ExitCode::SUCCESS),
        Command::Policy(c) => admin::policy(c).map(|()| ExitCode::SUCCESS),
        Command::Shares(c) => admin::shares(c).map(|()| ExitCode::SUCCESS),
        Command::Status(a) => admin::status(a).map(|()| ExitCode::SUCCESS),
    }
}

fn describe(r: &allot_common::config::Rule) -> String {
    use allot_common::config::RuleLimit;
    let what = match r.limit {
        RuleLimit::Unlimited => "unlimited".to_string(),
        RuleLimit::Limited {
            params,
            requests_per_unit,
            unit,
            unit_multiplier,
        } => format!(
            "{} {} per {}×{} (capacity {})",
            params.kind(),
            requests_per_unit,
            unit_multiplier,
            unit.envoy_name().to_lowercase(),
            params.capacity() / allot_common::units::MICROS_PER_TOKEN
        ),
    };
    format!(
        "{}: {}{}",
        r.name,
        what,
        if r.shadow_mode { " [shadow]" } else { "" }
    )
}
