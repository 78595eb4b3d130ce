//! How an agent leases: identities, intervals, timeouts and the emergency bucket.

use super::book::{emergency_params, ms};
use allot_common::algorithm::{LimitParams, TokenBucket};
use allot_common::units::Nanos;

/// Lease settings of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSettings {
    /// This agent's id (the allocator's "holder"); unique within its region.
    pub agent_id: String,
    /// Region the agent runs in.
    pub region: String,
    /// Period of spend reports and lease maintenance, ms (default 1 000).
    pub report_interval_ms: u64,
    /// Timeout of one allocator call, ms (default 500).
    pub call_timeout_ms: u64,
    /// Longest a decision on a cold key waits for its first allocation, ms (default 250).
    pub cold_wait_ms: u64,
    /// Subtracted from each allocation's ttl for the local deadline (allocator and agent clocks
    /// may drift; the lease must end here first), ms (default 250).
    pub drift_margin_ms: u64,
    /// Prefetch when what is left falls below this percentage of the policy's max grant.
    pub low_watermark_pct: u32,
    /// Emergency bucket (failure mode `emergency`): parts per million of the policy's rate and
    /// capacity (default 100 000 = 10%).
    pub emergency_ppm: u32,
    /// Smallest Retry-After given when the allocator has not said better, ms (default 100).
    pub retry_floor_ms: u64,
    /// Wait before asking again after a failed Acquire, ms (default 500).
    pub error_backoff_ms: u64,
    /// A key with no allocation unused this long is forgotten, ms (default 60 000).
    pub idle_evict_ms: u64,
}

impl LeaseSettings {
    /// Defaults for `agent_id` in `region`.
    pub fn new(agent_id: impl Into<String>, region: impl Into<String>) -> Self {
        LeaseSettings {
            agent_id: agent_id.into(),
            region: region.into(),
            report_interval_ms: 1_000,
            call_timeout_ms: 500,
            cold_wait_ms: 250,
            drift_margin_ms: 250,
            low_watermark_pct: 25,
            emergency_ppm: 100_000,
            retry_floor_ms: 100,
            error_backoff_ms: 500,
            idle_evict_ms: 60_000,
        }
    }

    /// `retry_floor_ms` in ns.
    pub fn retry_floor_ns(&self) -> Nanos {
        ms(self.retry_floor_ms)
    }

    /// The emergency bucket for a policy, or `None` when disabled.
    pub fn emergency_bucket(&self, p: &LimitParams) -> Option<TokenBucket> {
        emergency_params(p, self.emergency_ppm)
    }
}
