//! The Allot allocator: owns each policy's global quota and hands it out as epoch-fenced,
//! expiring allocations, replicated with Raft.
//!
//! This crate currently holds the replication layer ([`raft`]): openraft 0.9 with a sled-backed
//! log and state machine, a tonic transport, and a [`raft::Node`] that proposes commands of any
//! [`raft::App`]. The lease ledger is a separate pure module that implements [`raft::App`].

#![warn(missing_docs)]

pub mod ledger;
pub mod raft;
pub mod service;
