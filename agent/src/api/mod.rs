//! The gateway-facing APIs: Envoy's rate limit service ([`rls`]), the native gRPC service
//! ([`native`]) and HTTP ([`http`]). They only translate wire formats: every decision goes
//! through [`Decider`], which calls the one [`Enforcer`](crate::enforce::Enforcer) and keeps
//! what outlives a decision (reservations and held concurrency slots, by request id:
//! [`tracked`](crate::tracked)) and the metrics.

mod decider;
mod error;
mod headers;
pub mod http;
pub mod native;
pub mod pool;
mod proto_out;
pub mod refund;
pub mod rls;
mod settings;
mod verdict;
mod wire;

pub use decider::Decider;
pub use error::ApiError;
pub use headers::{ms_ceil, rate_limit_header_values, rate_limit_headers, rule_limit};
pub use settings::TrackingSettings;
pub use verdict::{Reserved, Settled, Verdict};
pub use wire::{
    borrow_descriptors, borrow_entries, request_cost, WireDescriptor, WireEntry, WireRequest,
};
