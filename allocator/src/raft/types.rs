//! The openraft type configuration and the log payload.
//!
//! `openraft::declare_raft_types!` only declares non-generic configs, while the Raft layer is
//! generic over the replicated [`App`]; [`AllotRaft`] therefore implements
//! [`openraft::RaftTypeConfig`] by hand with the same choices the macro would make for a
//! `D = Stamped<A::Command>, R = Option<A::Response>` config.

use std::cmp::Ordering;
use std::fmt;
use std::io::Cursor;
use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

use super::app::App;

/// Raft node id.
pub type NodeId = u64;

/// The Raft log payload: an application command with the time the leader stamped on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamped<C> {
    /// Ledger time of the entry, Unix milliseconds: the proposing leader's wall clock, held to
    /// the real time elapsed since the stamps that node applied ([`super::ledger_time`]). The
    /// state machine clamps it so the time it applies never goes backwards.
    pub now_ms: u64,
    /// The application command.
    pub cmd: C,
}

/// openraft type configuration for application `A`: node ids are `u64`, nodes are
/// [`openraft::BasicNode`] (the gRPC address), entries carry [`Stamped`] commands and the
/// response of an entry is `Some(A::Response)` for application entries and `None` for blank and
/// membership entries.
pub struct AllotRaft<A>(PhantomData<fn() -> A>);

impl<A> fmt::Debug for AllotRaft<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AllotRaft")
    }
}
impl<A> Clone for AllotRaft<A> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A> Copy for AllotRaft<A> {}
impl<A> Default for AllotRaft<A> {
    fn default() -> Self {
        Self(PhantomData)
    }
}
impl<A> PartialEq for AllotRaft<A> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<A> Eq for AllotRaft<A> {}
impl<A> PartialOrd for AllotRaft<A> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<A> Ord for AllotRaft<A> {
    fn cmp(&self, _: &Self) -> Ordering {
        Ordering::Equal
    }
}

impl<A: App> openraft::RaftTypeConfig for AllotRaft<A> {
    type D = Stamped<A::Command>;
    type R = Option<A::Response>;
    type NodeId = NodeId;
    type Node = openraft::BasicNode;
    type Entry = openraft::Entry<Self>;
    type SnapshotData = Cursor<Vec<u8>>;
    type AsyncRuntime = openraft::TokioRuntime;
    type Responder = openraft::impls::OneshotResponder<Self>;
}

/// Aliases of openraft types instantiated for [`AllotRaft`].
pub mod typ {
    use super::{AllotRaft, NodeId};
    use openraft::BasicNode;

    /// The Raft handle.
    pub type Raft<A> = openraft::Raft<AllotRaft<A>>;
    /// A log entry.
    pub type Entry<A> = openraft::Entry<AllotRaft<A>>;
    /// A snapshot with its data.
    pub type Snapshot<A> = openraft::Snapshot<AllotRaft<A>>;
    /// A log id.
    pub type LogId = openraft::LogId<NodeId>;
    /// A vote.
    pub type Vote = openraft::Vote<NodeId>;
    /// Snapshot metadata.
    pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, BasicNode>;
    /// Membership with the log id that set it.
    pub type StoredMembership = openraft::StoredMembership<NodeId, BasicNode>;
    /// A storage error.
    pub type StorageError = openraft::StorageError<NodeId>;
    /// An error of a Raft API call, with API-specific error `E`.
    pub type RaftError<E = openraft::error::Infallible> = openraft::error::RaftError<NodeId, E>;
    /// An error of an outgoing RPC.
    pub type RpcError<E = openraft::error::Infallible> =
        openraft::error::RPCError<NodeId, BasicNode, RaftError<E>>;
    /// An error of a client write.
    pub type ClientWriteError = openraft::error::ClientWriteError<NodeId, BasicNode>;
    /// A fatal Raft error: the node stopped.
    pub type Fatal = openraft::error::Fatal<NodeId>;
}
