//! The Allot allocator: owns each policy's global quota and hands it out as epoch-fenced,
//! expiring allocations, replicated with Raft.
//!
//! - [`ledger`]: the pure lease ledger (policies, buckets, allocations), an [`raft::App`];
//! - [`raft`]: openraft 0.9 with a sled-backed log and state machine, a tonic transport, and a
//!   [`raft::Node`] that proposes commands of any [`raft::App`];
//! - [`service`]: the `allot.v1.Allocator` gRPC API over a `Node<Ledger>`;
//! - [`heap`]: handing freed heap memory back to the system;
//! - [`daemon`]: one complete node as the `allot-allocator` binary runs it (API and Raft on one
//!   server, the leader's tick, policy files), also used by the tests and the benchmark.

#![warn(missing_docs)]

pub mod daemon;
pub mod heap;
pub mod ledger;
pub mod raft;
pub mod service;
