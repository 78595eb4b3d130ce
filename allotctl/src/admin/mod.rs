//! Allocator administration over gRPC (`allot.v1.Allocator`): cluster membership, policies,
//! region shares and per-key status. Every command talks to one node (`--addr`); a follower
//! forwards writes to the leader, and when it cannot, the error shows the leader hint.
//! `policy put` and `shares set` send a fresh request id and retry with it across leader
//! changes until `--timeout-ms` ([`retry`]): a write applies once, and a retry of one that
//! committed answers its success.

mod parse;
mod render;
pub mod retry;

use std::path::PathBuf;
use std::time::Duration;

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use tonic::transport::{Channel, Endpoint};

/// An error answered by the allocator (as opposed to a local one): printed with its gRPC code.
#[derive(Debug)]
pub struct RemoteError(pub tonic::Status);

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&render::status_error(&self.0))
    }
}

impl std::error::Error for RemoteError {}

/// The node to talk to.
#[derive(Args, Debug, Clone)]
pub struct Target {
    /// Allocator node address, HOST:PORT (any node; a follower forwards to the leader).
    #[arg(long)]
    addr: String,
    /// Give up on a call after this many milliseconds (writes: with every retry).
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
}

/// `allotctl cluster …`
#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Initialise a new cluster with these voters (send to one of them, once).
    Init {
        #[command(flatten)]
        target: Target,
        /// A voter, ID=HOST:PORT; repeat for each.
        #[arg(long = "member", required = true)]
        members: Vec<pb::Member>,
    },
    /// Add a non-voting member that replicates the log (returns once it has caught up).
    AddLearner {
        #[command(flatten)]
        target: Target,
        /// The new node, ID=HOST:PORT.
        #[arg(long)]
        member: pb::Member,
    },
    /// Replace the set of voters (each must already be a member, e.g. a learner).
    ChangeMembership {
        #[command(flatten)]
        target: Target,
        /// A voter id; repeat for each.
        #[arg(long = "voter", required = true)]
        voters: Vec<u64>,
        /// Keep removed voters as learners.
        #[arg(long)]
        retain: bool,
    },
    /// Raft state as seen by the node at --addr.
    Status {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `allotctl policy …`
#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Install a new version of a policy document (YAML).
    Put {
        #[command(flatten)]
        target: Target,
        /// The policy document.
        #[arg(long)]
        file: PathBuf,
        /// Version being replaced; 0 for a new domain.
        #[arg(long, default_value_t = 0)]
        expected_version: u64,
    },
}

/// `allotctl shares …`
#[derive(Subcommand, Debug)]
pub enum SharesCommand {
    /// Set region shares of a policy: guaranteed minimums and weights of the division by demand
    /// (hard caps with `shares_mode: cap`). Every key's parts move by versioned handoff: a
    /// lowered part is held back until the allocations granted under it are released or expire.
    Set {
        #[command(flatten)]
        target: Target,
        /// Policy (limit) name.
        #[arg(long)]
        policy: String,
        /// REGION=PERCENT% (e.g. eu-west=50%) or REGION=RATE (requests per the policy's
        /// unit, e.g. us-east=400); repeat for each region.
        #[arg(long = "share", value_parser = parse::share, required = true)]
        shares: Vec<pb::RegionShare>,
        /// Share configuration version; must exceed the current one.
        #[arg(long)]
        config_version: u64,
    },
}

/// `allotctl status …`: per-region allocations of one policy key.
#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    target: Target,
    /// Rate limit domain.
    #[arg(long)]
    domain: String,
    /// Descriptor entry KEY=VALUE, outermost first; repeat for each.
    #[arg(long = "entry", value_parser = parse::entry, required = true)]
    entries: Vec<pb::DescriptorEntry>,
    /// Print JSON with raw microtokens instead of a table in tokens.
    #[arg(long)]
    json: bool,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

async fn connect(t: &Target) -> Result<AllocatorClient<Channel>> {
    connect_to(&t.addr, t.timeout_ms).await
}

async fn connect_to(addr: &str, timeout_ms: u64) -> Result<AllocatorClient<Channel>> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let channel = Endpoint::from_shared(uri)
        .with_context(|| format!("bad address {addr:?}"))?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_millis(timeout_ms))
        .connect()
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    Ok(AllocatorClient::new(channel))
}

/// Sends one admin write with retries ([`retry::with_retries`]): `send` makes one attempt
/// with a client of the node it is given and the time left.
async fn write<T, F, Fut>(t: &Target, send: F) -> Result<T>
where
    F: Fn(AllocatorClient<Channel>, Duration) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let timeout_ms = t.timeout_ms;
    retry::with_retries(&t.addr, Duration::from_millis(timeout_ms), |addr, left| {
        let send = &send;
        async move {
            let c = connect_to(&addr, timeout_ms)
                .await
                .map_err(retry::Failure::Connect)?;
            send(c, left)
                .await
                .map(tonic::Response::into_inner)
                .map_err(retry::Failure::Remote)
        }
    })
    .await
    .map_err(retry::Failure::into_error)
}

/// `body` as one attempt's request, given the time left.
fn attempt<T>(body: T, left: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(body);
    r.set_timeout(left);
    r
}

fn remote(s: tonic::Status) -> anyhow::Error {
    RemoteError(s).into()
}

/// Runs a `cluster` subcommand.
///
/// # Errors
/// A [`RemoteError`] for the allocator's refusals; other errors for connection failures.
pub fn cluster(cmd: ClusterCommand) -> Result<()> {
    runtime()?.block_on(async {
        match cmd {
            ClusterCommand::Init { target, members } => {
                let n = members.len();
                connect(&target)
                    .await?
                    .cluster_init(pb::ClusterInitRequest { members })
                    .await
                    .map_err(remote)?;
                println!("cluster initialised with {n} voters");
            }
            ClusterCommand::AddLearner { target, member } => {
                let id = member.node_id;
                let r = connect(&target)
                    .await?
                    .add_learner(pb::AddLearnerRequest {
                        member: Some(member),
                    })
                    .await
                    .map_err(remote)?
                    .into_inner();
                println!("node {id} added as a learner (log index {})", r.log_index);
            }
            ClusterCommand::ChangeMembership {
                target,
                voters,
                retain,
            } => {
                let r = connect(&target)
                    .await?
                    .change_membership(pb::ChangeMembershipRequest {
                        voter_ids: voters.clone(),
                        retain,
                    })
                    .await
                    .map_err(remote)?
                    .into_inner();
                println!("voters are now {voters:?} (log index {})", r.log_index);
            }
            ClusterCommand::Status { target, json } => {
                let r = connect(&target)
                    .await?
                    .cluster_status(pb::ClusterStatusRequest {})
                    .await
                    .map_err(remote)?
                    .into_inner();
                if json {
                    println!("{}", render::cluster_status_json(&r));
                } else {
                    print!("{}", render::cluster_status_text(&r));
                }
            }
        }
        Ok(())
    })
}

/// Runs a `policy` subcommand.
///
/// # Errors
/// As [`cluster`], plus an unreadable file.
pub fn policy(cmd: PolicyCommand) -> Result<()> {
    let PolicyCommand::Put {
        target,
        file,
        expected_version,
    } = cmd;
    let yaml = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let body = pb::PutPolicyRequest {
        yaml,
        expected_version,
        request_id: retry::fresh_request_id(),
    };
    runtime()?.block_on(async {
        let r = write(&target, |mut c, left| {
            let req = attempt(body.clone(), left);
            async move { c.put_policy(req).await }
        })
        .await?;
        println!("policy {} is at version {}", r.policy, r.version);
        Ok(())
    })
}

/// Runs a `shares` subcommand.
///
/// # Errors
/// As [`cluster`].
pub fn shares(cmd: SharesCommand) -> Result<()> {
    let SharesCommand::Set {
        target,
        policy,
        shares,
        config_version,
    } = cmd;
    let body = pb::SetSharesRequest {
        policy: policy.clone(),
        shares,
        config_version,
        request_id: retry::fresh_request_id(),
    };
    runtime()?.block_on(async {
        let r = write(&target, |mut c, left| {
            let req = attempt(body.clone(), left);
            async move { c.set_shares(req).await }
        })
        .await?;
        println!(
            "shares of {policy} set (config version {})",
            r.config_version
        );
        Ok(())
    })
}

/// Runs `status`.
///
/// # Errors
/// As [`cluster`].
pub fn status(args: StatusArgs) -> Result<()> {
    runtime()?.block_on(async {
        let r = connect(&args.target)
            .await?
            .status(pb::StatusRequest {
                key: Some(pb::PolicyKey {
                    domain: args.domain,
                    entries: args.entries,
                }),
            })
            .await
            .map_err(remote)?
            .into_inner();
        if args.json {
            println!("{}", render::key_status_json(&r));
        } else {
            print!("{}", render::key_status_text(&r));
        }
        Ok(())
    })
}
