//! # allot-agent: the gateway sidecar
//!
//! Answers "may this request in?" locally, from allocations leased from the allocator
//! (seed §19–23, §26, §31): [`enforce::Enforcer`] is the one decision core behind every API;
//! [`lease`] holds, spends, acquires, reports and releases allocations and computes the
//! overshoot bound.

#![warn(missing_docs)]

pub mod enforce;
pub mod lease;

pub use enforce::Enforcer;
