//! Integration tests of the allocator's Raft layer, in one test binary.
//!
//! - `suite`: openraft's storage conformance suite on the sled log store and state machine.
//! - `failover`: a 3-node cluster on loopback: commit, leader failover, whole-cluster restart.

#[path = "cluster/support.rs"]
mod support;

#[path = "cluster/suite.rs"]
mod suite;

#[path = "cluster/failover.rs"]
mod failover;
