//! The gateway-facing APIs: Envoy's rate limit service ([`rls`]), the native gRPC service
//! ([`native`]) and HTTP ([`http`]). They only translate wire formats: every decision goes
//! through [`Gateway`], which calls the one [`Enforcer`](crate::enforce::Enforcer) and keeps what outlives a decision
//! (reservations and concurrency slots, by request id) and the metrics.

mod error;
mod gateway;
mod headers;
pub mod http;
pub mod native;
pub mod refund;
pub mod rls;
mod settings;
mod verdict;
mod wire;

pub use error::ApiError;
pub use gateway::Gateway;
pub use headers::{ms_ceil, rate_limit_headers, rule_limit};
pub use settings::GatewaySettings;
pub use verdict::{Reserved, Settled, Verdict};
pub use wire::{borrow_descriptors, borrow_entries, request_cost, WireDescriptor, WireEntry};
