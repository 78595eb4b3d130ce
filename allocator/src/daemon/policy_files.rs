//! Policy documents loaded from a folder at startup (and again on SIGHUP) and installed through
//! Raft the first time this node leads after that, so a cluster started from files serves them
//! without an operator.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use allot_common::config::{policy_paths, ConfigSet};
use tokio::task::JoinHandle;

use crate::ledger::{Command, Ledger, LedgerError, Response};
use crate::raft::{ClientError, Node};

/// One policy document read from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyFile {
    /// Where it was read from (for logs).
    pub path: PathBuf,
    /// Its domain.
    pub domain: String,
    /// The document as read.
    pub yaml: String,
}

/// Why a policy folder could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyFilesError {
    /// The folder or one of its files could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The folder or file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A document fails the decision core's validation (the message names file and field).
    #[error("{0}")]
    Invalid(String),
    /// Two files define the same domain.
    #[error("domain {domain:?} is defined twice: {first} and {second}")]
    Duplicate {
        /// The domain.
        domain: String,
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
    },
}

/// Reads every `*.yaml` / `*.yml` file of `dir` (or `dir` itself when it is a file), sorted by
/// name, and validates each with the decision core.
///
/// # Errors
/// [`PolicyFilesError::Io`] for unreadable paths, [`PolicyFilesError::Invalid`] for a document
/// that fails validation, [`PolicyFilesError::Duplicate`] when two files share a domain.
pub fn load_policy_files(dir: &Path) -> Result<Vec<PolicyFile>, PolicyFilesError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PolicyFilesError::Io { path, source }
    };
    let paths = policy_paths(dir).map_err(io(dir))?;
    let mut files: Vec<PolicyFile> = Vec::with_capacity(paths.len());
    for path in paths {
        let yaml = std::fs::read_to_string(&path).map_err(io(&path))?;
        let domain = ConfigSet::parse_domain(&yaml, &path)
            .map_err(|e| PolicyFilesError::Invalid(e.to_string()))?
            .domain;
        if let Some(first) = files.iter().find(|f| f.domain == domain) {
            return Err(PolicyFilesError::Duplicate {
                domain,
                first: first.path.clone(),
                second: path,
            });
        }
        files.push(PolicyFile { path, domain, yaml });
    }
    Ok(files)
}

/// Pause between attempts while an install fails for a transient reason.
const RETRY: Duration = Duration::from_millis(200);

/// Spawns the installer: the first time this node is leader after it started, each file whose
/// document is not already in force is proposed as `PutPolicy` on top of the current version;
/// then the task ends. The folder is thus the desired state at startup: a node restarted with
/// changed files applies them when it leads, while a plain failover never reverts a version put
/// later with `allotctl policy put`. Rejected documents are logged and skipped; transient
/// failures are retried while this node leads.
pub fn spawn_installer(node: Arc<Node<Ledger>>, files: Vec<PolicyFile>) -> JoinHandle<()> {
    tokio::spawn(async move {
        if files.is_empty() {
            return;
        }
        let mut metrics = node.raft().metrics();
        loop {
            let leader = metrics.borrow_and_update().current_leader == Some(node.id());
            if leader {
                if install_all(&node, &files).await {
                    return;
                }
                // Not finished (no quorum yet, a race, or leadership lost): look again shortly.
                tokio::time::sleep(RETRY).await;
                continue;
            }
            if metrics.changed().await.is_err() {
                return; // Raft stopped.
            }
        }
    })
}

/// Spawns an install of `files` now, if this node leads (an operator's SIGHUP after editing the
/// folder): every document not in force is proposed on top of the current version, transient
/// failures retried while this node leads (for [`NOW_ATTEMPTS`] × [`RETRY`] at most). A
/// follower installs nothing and says so: SIGHUP to the leader installs, and a follower
/// that already led keeps no old files to install at some later failover, over a version put
/// since with `allotctl policy put`.
pub fn spawn_install_now(node: Arc<Node<Ledger>>, files: Vec<PolicyFile>) -> JoinHandle<()> {
    tokio::spawn(async move {
        for attempt in 0..NOW_ATTEMPTS {
            let leader = node.raft().metrics().borrow().current_leader;
            if leader != Some(node.id()) {
                if attempt == 0 {
                    tracing::info!(
                        ?leader,
                        "policies not installed: this node does not lead (SIGHUP the leader)"
                    );
                } else {
                    tracing::warn!(
                        ?leader,
                        "leadership moved during the policy install: the folder may be partly \
                         installed; SIGHUP the new leader"
                    );
                }
                return;
            }
            if install_all(&node, &files).await {
                return;
            }
            tokio::time::sleep(RETRY).await;
        }
        tracing::warn!("policy install gave up: no quorum to commit it");
    })
}

/// Attempts of [`spawn_install_now`] (10 s at [`RETRY`] apart).
const NOW_ATTEMPTS: u32 = 50;

/// Installs every file not yet in force; `false` when it should be retried (when this node
/// leads again).
async fn install_all(node: &Node<Ledger>, files: &[PolicyFile]) -> bool {
    // The local state must include everything committed before it is compared with the files.
    if let Err(e) = node.ensure_linearizable().await {
        tracing::debug!(error = %e, "policy install waits for a confirmed leadership");
        return false;
    }
    for f in files {
        let (in_force, version) = node.state().read(|l| {
            (
                l.policy_yaml(&f.domain) == Some(f.yaml.as_str()),
                l.policy_version(&f.domain),
            )
        });
        if in_force {
            continue;
        }
        let cmd = Command::PutPolicy {
            yaml: f.yaml.clone(),
            expected_version: version,
            request_id: String::new(),
        };
        match node.propose(cmd).await {
            Ok(Response::PolicyPut { domain, version }) => {
                tracing::info!(%domain, version, file = %f.path.display(), "policy installed");
            }
            Ok(Response::Rejected(e @ LedgerError::PolicyVersionMismatch { .. })) => {
                // Another writer changed the version in between: compare again.
                tracing::info!(file = %f.path.display(), reason = %e, "policy install raced");
                return false;
            }
            Ok(other) => {
                tracing::error!(file = %f.path.display(), response = ?other, "policy refused");
            }
            Err(ClientError::NotLeader { .. }) => return false,
            Err(e) => {
                tracing::warn!(file = %f.path.display(), error = %e, "policy install failed");
                return false;
            }
        }
    }
    true
}
