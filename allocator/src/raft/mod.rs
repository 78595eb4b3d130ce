//! Raft replication for the allocator: openraft 0.9 (`storage-v2`) over sled and tonic.
//!
//! - [`app`]: the [`App`] trait the replicated application (the ledger) implements; no openraft
//!   type appears in it.
//! - [`types`]: the openraft type configuration ([`AllotRaft`]), the leader-stamped log payload
//!   ([`Stamped`]) and aliases in [`types::typ`].
//! - [`log_store`]: the Raft log and vote in sled ([`SledLogStore`]).
//! - [`state_machine`]: the state machine ([`SledStateMachine`]), its latest snapshot in a file
//!   ([`snapshot_file`]).
//! - [`network_out`] / [`network_in`]: the gRPC transport, client and server halves.
//! - [`node`]: one allocator node tying the above together ([`Node`]).
//! - [`group_commit`]: the leader's group commit, many commands per entry ([`GroupCommit`]).
//! - [`clock`]: the injected wall and monotonic clocks.
//! - [`flush`]: how the sled stores make writes durable (background, or inline for simulations).
//! - [`ledger_time`]: the stamp a node proposes, never ahead of real time ([`LedgerTime`]).
//! - [`skew`]: this node's wall clock against ledger time, warned about and counted.
//! - `ledger_app`: the glue making the pure [`Ledger`](crate::ledger::Ledger) the replicated
//!   [`App`] (apply at the stamped time, snapshot encoding, group commit batching).
//! - `test_app` (tests, or the `testing` feature): a tiny [`App`] used to exercise this layer
//!   without the ledger.

pub mod app;
mod codec;
pub mod flush;
pub mod group_commit;
mod ledger_app;
pub mod ledger_time;
pub mod log_store;
pub mod network_in;
pub mod network_out;
pub mod node;
pub mod node_clock;
pub mod skew;
pub mod snapshot_file;
mod snapshot_schedule;
pub mod state_machine;
#[cfg(any(test, feature = "testing"))]
pub mod test_app;
pub mod types;

pub use app::{App, AppError};
pub use flush::Flush;
pub use group_commit::{Batching, CommitError, FlushHold, GroupCommit, GroupCommitConfig};
pub use ledger_time::LedgerTime;
pub use log_store::SledLogStore;
pub use network_in::RaftServiceHandler;
pub use network_out::{ChannelFactory, GrpcNetworkFactory, LazyTcpChannels};
pub use node::{
    open_db, AlreadyServing, ClientError, Node, NodeConfig, NodeError, NodeStorage, RaftTimings,
};
pub use node_clock::{ManualNodeClock, NodeClock, SystemNodeClock};
pub use skew::{SkewCheck, SkewStatus};
pub use state_machine::{SledStateMachine, StateMachineHandle};
pub use types::{AllotRaft, NodeId, Stamped};
