//! Deterministic simulation of the whole system (issue 12 items 1–3): the production allocator
//! (ledger, openraft, sled, group commit, the allocator API) on 3 or 5 nodes and the
//! production agent lease path, on turmoil's simulated time and network, driven by one seed.
//!
//! - [`world`]: the hosts — the allocator daemon and the agent with its gateway's requests;
//! - [`net`]: tonic over turmoil's TCP;
//! - [`clock`]: drifting and stepped clocks through production's clock seams;
//! - [`workload`]: the policy and the traffic (Acme burst, quiet tenant, regional skew, Zipf);
//! - [`faults`]: the fault schedule drawn from the seed;
//! - [`check`]: the invariants;
//! - [`run`]: one run, from seed to [`RunReport`]; [`summary`]: many runs.

pub mod check;
pub mod clock;
pub mod faults;
pub mod net;
pub mod run;
pub mod summary;
pub mod workload;
pub mod world;

pub use run::{run, Network, RunReport, SimConfig};
pub use world::{Calls, LeaseTuning};
