//! How an agent leases: identities, intervals, timeouts and the emergency bucket.

use super::backoff::seed_for;
use super::book::{emergency_params, ms};
use super::demand::Thresholds;
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
    /// Failure mode `emergency`: parts per million of each grant kept as its emergency reserve
    /// (spent only while the allocator is unreachable for the key), and of the policy's rate
    /// and capacity for the bucket pacing those admissions (default 100 000 = 10%).
    pub emergency_ppm: u32,
    /// Smallest Retry-After given when the allocator has not said better, ms (default 100).
    pub retry_floor_ms: u64,
    /// Wait before asking again after a failed Acquire, ms (default 500).
    pub error_backoff_ms: u64,
    /// A key with no allocation unused this long is forgotten, ms (default 60 000).
    pub idle_evict_ms: u64,
    /// A leased key that decided nothing for this long returns what it holds early: its
    /// allocations are closed and released with their final spend, so the unspent tokens are
    /// grantable elsewhere before the leases expire (issue 9 item 6), ms (default 1 000; 0:
    /// never, allocations are then released only when spent or past their deadline).
    pub idle_return_ms: u64,
    /// Ask the allocator for rate-carrying allocations (design §9): a leased key with measured
    /// demand asks for its rate and one report interval of tokens now, instead of a whole
    /// lease of tokens (default false: measured in `docs/design.md` §9, not yet on by default).
    pub rate_leases: bool,
    /// Without `rate_leases`, still ask for a rate for a hot key the allocator keeps short while
    /// nothing of it is denied here (see `manager::settled_scarcity`; default true).
    pub settled_rates: bool,
    /// A central key is promoted to leases when it admits this many tokens within one lease
    /// period at this agent (default 4; 0: every key is leased from first sight). See
    /// [`demand`](super::demand).
    pub promote_tokens: u64,
    /// A leased key is demoted to central decisions when a whole lease period admits fewer
    /// tokens than this at this agent (default 2; below `promote_tokens`).
    pub demote_tokens: u64,
    /// Seed of the jitter of the backoff after failed allocator calls (default: a hash of
    /// `agent_id`, so agents of one fleet back off differently; tests fix it).
    pub backoff_seed: u64,
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
            idle_return_ms: 1_000,
            rate_leases: false,
            settled_rates: true,
            promote_tokens: 4,
            demote_tokens: 2,
            backoff_seed: 0,
        }
        .seeded()
    }

    /// The default backoff seed for this agent's id.
    fn seeded(mut self) -> Self {
        self.backoff_seed = seed_for(&self.agent_id);
        self
    }

    /// Promotion and demotion thresholds.
    pub fn thresholds(&self) -> Thresholds {
        Thresholds::from_tokens(self.promote_tokens, self.demote_tokens)
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
