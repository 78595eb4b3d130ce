//! Integration tests of the allocator, in one test binary.
//!
//! - `suite`: openraft's storage conformance suite on the sled log store and state machine.
//! - `failover`: the Raft layer with a test app on a 3-node loopback cluster: commit, leader
//!   failover, whole-cluster restart, snapshot install.
//! - `snapshots`: voters build their snapshots in turn, never two at the same index.
//! - `ledger_failover`: the real ledger through the gRPC API on a 3-node cluster: grants
//!   commit, leader killed under load, B + r·t, stale epochs, whole-cluster restart.
//! - `redirect`: follower forwarding and leader hints; bad input gets precise codes and changes
//!   nothing.
//! - `admin_retry`: admin writes retried with their request id after a leader change answer
//!   their first success.
//! - `daemon`: a complete node as the binary runs it: init, policy files, the leader's tick.
//! - `batch`: Batch and Decide with group commit: per-item answers, forwarding, a leader change
//!   under batched load, overload and deadlines.
//! - `ledger_time`: nodes with their own manual clocks: a new leader whose clock is ahead (3 s,
//!   a day) neither refills early, nor expires live allocations, nor freezes ledger time.

#[path = "cluster/support.rs"]
mod support;

#[path = "cluster/ledger_support.rs"]
mod ledger_support;

#[path = "cluster/suite.rs"]
mod suite;

#[path = "cluster/failover.rs"]
mod failover;

#[path = "cluster/snapshots.rs"]
mod snapshots;

#[path = "cluster/ledger_failover.rs"]
mod ledger_failover;

#[path = "cluster/redirect.rs"]
mod redirect;

#[path = "cluster/admin_retry.rs"]
mod admin_retry;

#[path = "cluster/daemon.rs"]
mod daemon;

#[path = "cluster/batch.rs"]
mod batch;

#[path = "cluster/ledger_time.rs"]
mod ledger_time;
