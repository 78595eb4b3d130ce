//! The `allot-allocator` configuration file (YAML). Every field is optional: command-line flags
//! override the file, and built-in defaults fill the rest.
//!
//! ```yaml
//! node_id: 1
//! listen: 127.0.0.1:7701        # address the gRPC server binds
//! advertise: 127.0.0.1:7701     # address peers and clients use (defaults to listen)
//! data_dir: ./data/node-1
//! cluster_name: allot
//! peers:                        # every voter, this node included: id: "host:port"
//!   1: 127.0.0.1:7701
//!   2: 127.0.0.1:7702
//!   3: 127.0.0.1:7703
//! policies: ./policies          # optional folder of policy YAML files
//! tick_ms: 250
//! raft:
//!   heartbeat_ms: 150
//!   election_timeout_min_ms: 750
//!   election_timeout_max_ms: 1500
//!   snapshot_every_logs: 5000
//!   stagger_snapshots: true      # voters build their snapshots in turn, not all at once
//!   logs_kept_after_snapshot: 1000
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The configuration file's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// This node's Raft id.
    pub node_id: Option<u64>,
    /// Address the gRPC server binds, "host:port".
    pub listen: Option<String>,
    /// Address peers and clients reach this node at, "host:port".
    pub advertise: Option<String>,
    /// Directory of the sled database.
    pub data_dir: Option<PathBuf>,
    /// Name shared by the cluster's nodes.
    pub cluster_name: Option<String>,
    /// Voters of the cluster: id → "host:port".
    #[serde(default)]
    pub peers: BTreeMap<u64, String>,
    /// Folder (or file) of policy documents installed when this node leads.
    pub policies: Option<PathBuf>,
    /// Period of the leader's tick, ms.
    pub tick_ms: Option<u64>,
    /// Raft timings.
    #[serde(default)]
    pub raft: FileTimings,
}

/// Raft timings in the file, each optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTimings {
    /// Leader heartbeat period, ms.
    pub heartbeat_ms: Option<u64>,
    /// Lower bound of the election timeout, ms.
    pub election_timeout_min_ms: Option<u64>,
    /// Upper bound of the election timeout, ms.
    pub election_timeout_max_ms: Option<u64>,
    /// Snapshot after this many entries.
    pub snapshot_every_logs: Option<u64>,
    /// Whether voters take turns to build their snapshots.
    pub stagger_snapshots: Option<bool>,
    /// Entries kept behind a snapshot.
    pub logs_kept_after_snapshot: Option<u64>,
}

/// Why the configuration file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not match the schema (unknown field, wrong type…).
    #[error("{path}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message, with the location.
        message: String,
    },
}

impl FileConfig {
    /// Parses a configuration document; `path` only names it in errors.
    ///
    /// # Errors
    /// [`ConfigFileError::Syntax`] when the document does not match the schema.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigFileError> {
        serde_saphyr::from_str(text).map_err(|e| ConfigFileError::Syntax {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Reads and parses the file at `path`.
    ///
    /// # Errors
    /// [`ConfigFileError::Io`] or [`ConfigFileError::Syntax`].
    pub fn load(path: &Path) -> Result<Self, ConfigFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let doc = include_str!("config_file.rs")
            .lines()
            .skip_while(|l| !l.starts_with("//! ```yaml"))
            .skip(1)
            .take_while(|l| !l.starts_with("//! ```"))
            .map(|l| l.strip_prefix("//! ").unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        let c = FileConfig::parse(&doc, Path::new("example")).expect("example parses");
        assert_eq!(c.node_id, Some(1));
        assert_eq!(c.peers.len(), 3);
        assert_eq!(c.peers[&2], "127.0.0.1:7702");
        assert_eq!(c.raft.heartbeat_ms, Some(150));
        assert_eq!(c.raft.stagger_snapshots, Some(true));
        assert_eq!(c.tick_ms, Some(250));
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = FileConfig::parse("node_id: 1\nlisten_addr: x\n", Path::new("c.yaml"))
            .expect_err("typo is an error");
        assert!(e.to_string().contains("c.yaml"), "{e}");
    }
}
