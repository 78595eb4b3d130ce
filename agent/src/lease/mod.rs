//! Enforcement of `scope: global` limits: allocations held per key, spent on the hot path with
//! atomics ([`book`]; the decision itself, walked from adapter to answer, is
//! [`book::decision_path`]); where each key stands with the allocator ([`protocol`]); central
//! decisions for sparse keys and leases for busy ones ([`demand`]); acquired, reported,
//! released and decided in the background ([`manager`]) from a two-lane queue ([`queue`]), in
//! `Batch` calls, a few in flight ([`dispatch`]), backing off with jitter ([`backoff`]).

pub mod allocation;
pub mod backoff;
pub mod book;
pub mod charge;
pub mod client;
pub mod close;
pub mod cost_mix;
pub mod demand;
pub mod dispatch;
pub mod key_cap;
pub mod key_rule;
pub mod manager;
pub mod pace;
pub mod protocol;
pub mod queue;
pub mod settings;

pub use allocation::HeldAllocation;
pub use book::{KeyLease, LeaseBook, LeaseEvent, LeaseReservation, LeaseTables, LeaseView};
pub use charge::{ChargeLog, Charged};
pub use client::{AllocatorLink, CallError, Fence, LinkError};
pub use manager::LeaseManager;
pub use protocol::{KeyProtocol, Standing};
pub use settings::LeaseSettings;

#[cfg(test)]
mod tests;
