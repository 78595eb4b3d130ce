//! Leased enforcement of `scope: global` limits: allocations held per key, spent on the hot path
//! with atomics ([`book`]), acquired, reported and released in the background ([`manager`]).

pub mod allocation;
pub mod book;
pub mod charge;
pub mod client;
pub mod close;
pub mod manager;
pub mod protocol;
pub mod settings;

pub use allocation::HeldAllocation;
pub use book::{KeyLease, LeaseBook, LeaseEvent, LeaseReservation, LeaseTables, LeaseView};
pub use charge::{ChargeLog, Charged};
pub use client::{AllocatorLink, LinkError};
pub use manager::LeaseManager;
pub use protocol::{KeyProtocol, Standing};
pub use settings::LeaseSettings;

#[cfg(test)]
mod tests;
