//! # allot-simulations
//!
//! Tools that drive a running Allot from outside, over its real APIs:
//! * [`rls`]: an Envoy rate-limit-service client and an open-loop load generator
//!   (`allot-bench rls`), usable against any RLS server;
//! * [`local`]: a local deployment on real processes (3 allocators, N agents);
//! * [`scenario`]: the Acme story (burst, sustained overload, regional skew, leader failover);
//! * [`demand`]: quota follows demand — parts whose recorded arrivals are replayed through the
//!   [`ideal`] central counter, with [`arrivals`] the recorded traffic and [`zipf`] key
//!   popularity;
//! * [`memory`]: resident memory per key of the agent and the allocator (`allot-bench memory`);
//! * [`h2load`]: the agent's RLS tail and throughput with h2load as the client, against a
//!   do-nothing server (`allot-bench h2load`);
//! * [`sim`]: the deterministic simulation of the whole system under seeded faults
//!   (`allot-sim`);
//! * [`strategy`]: the strategy table and the lease sweep built on it (`allot-sim strategies`).

#![warn(missing_docs)]

pub mod arrivals;
pub mod demand;
pub mod h2load;
pub mod ideal;
pub mod local;
pub mod memory;
pub mod noop;
pub mod rls;
pub mod scenario;
pub mod sim;
pub mod strategy;
mod table;
pub mod zipf;
