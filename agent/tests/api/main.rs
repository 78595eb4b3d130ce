//! The agent's gateway-facing APIs, called directly (service structs, the axum router) and over
//! loopback: Envoy's RLS v3, the native `allot.v1.Agent` service and HTTP, for local policies
//! and for policies leased from an in-process fake allocator (`leased`) or from real allocator
//! nodes, one or three, run in-process (`real_allocator`).

mod support;

mod batching;
mod demand;
mod http;
mod idle_return;
mod leased;
mod native;
mod real_allocator;
mod rls;
mod safety;
