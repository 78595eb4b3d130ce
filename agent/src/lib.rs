//! # allot-agent: the gateway sidecar
//!
//! Answers "may this request in?" locally, from allocations leased from the allocator
//! (seed §19–23, §26, §31): [`enforce::Enforcer`] is the one decision core behind every API;
//! [`lease`] holds, spends, acquires, reports and releases allocations and computes the
//! overshoot bound; [`slots`] holds concurrency slots (seed §25).
//!
//! The gateway-facing APIs in [`api`] (Envoy's RLS v3, native gRPC `allot.v1.Agent`, HTTP) only
//! translate wire formats and call [`api::Decider`], which decides with the one enforcer and
//! tracks reservations and held concurrency slots by request id ([`tracked`]); [`metrics`]
//! exports Prometheus text through OpenTelemetry; [`server`] assembles and runs it all (the
//! `allot-agent` binary).
//!
//! The decision path, file by file, is walked in [`lease::book::decision_path`].

#![warn(missing_docs)]

pub mod api;
pub mod enforce;
pub mod lease;
pub mod metrics;
pub mod reload;
pub mod server;
pub mod slots;
pub mod tracked;

pub use enforce::Enforcer;
