//! Counters of the lease path, for metrics.

use crate::metrics::WaitHistogram;
use std::sync::atomic::AtomicU64;

/// Counters of the lease path, for metrics.
#[derive(Debug, Default)]
pub struct LeaseCounters {
    /// Decisions that found nothing to spend (cold or exhausted key, no standing denial) and
    /// joined the key's next allocator call.
    pub cold_misses: AtomicU64,
    /// Requests that waited for an allocator call (cold or exhausted key).
    pub cold_waits: AtomicU64,
    /// Requests whose wait reached `cold_wait_ms` without an answer (then denied).
    pub wait_timeouts: AtomicU64,
    /// How long requests waited for an allocator call (Prometheus histogram).
    pub wait_time: WaitHistogram,
    /// Waiting requests that the allocator denied with a handoff hint within their wait bound,
    /// and that waited for it to ask again (another region's unused part about to be lent).
    pub handoff_waits: AtomicU64,
    /// Decisions denied from the allocator's remembered denial, without a call.
    pub denials_held: AtomicU64,
    /// Acquire RPCs sent.
    pub acquires: AtomicU64,
    /// Acquires queued by the maintenance pass: what a key holds will not last until the next
    /// pass, or its allocations end soon.
    pub acquires_prefetch: AtomicU64,
    /// Acquires queued by a decision that left the key below its low watermark and short of
    /// what it will spend before an answer could arrive (renewal between passes).
    pub acquires_running_low: AtomicU64,
    /// Acquires queued by a decision that found nothing to spend (it waits for the answer).
    pub acquires_cold: AtomicU64,
    /// Report RPCs sent.
    pub reports: AtomicU64,
    /// Release RPCs sent.
    pub releases: AtomicU64,
    /// Allocator calls that failed (timeout, unavailable).
    pub rpc_errors: AtomicU64,
    /// Times the allocator went from answering to not answering (each outage once).
    pub unreachable_episodes: AtomicU64,
    /// Decisions admitted from an emergency bucket.
    pub emergency_admits: AtomicU64,
    /// Decisions denied because the allocator was unreachable and the failure mode is deny.
    pub failure_denials: AtomicU64,
    /// Decisions admitted from allocations.
    pub leased_admits: AtomicU64,
    /// Decisions denied because the key's rate had not accrued their cost yet (design §9).
    pub accrual_denials: AtomicU64,
    /// Decisions rejected by a rule's local fuse (no allocator work at all).
    pub fuse_rejects: AtomicU64,
    /// New keys refused because their rule already holds `max_keys` keys, none idle.
    pub key_refusals: AtomicU64,
    /// Central decisions asked of the allocator (`Decide`, one per waiting request).
    pub decides_asked: AtomicU64,
    /// Decide items sent (in a Batch or alone).
    pub decides: AtomicU64,
    /// Decisions admitted by the allocator's central decision.
    pub central_admits: AtomicU64,
    /// Keys promoted from central decisions to leases.
    pub promotions: AtomicU64,
    /// Keys demoted from leases to central decisions.
    pub demotions: AtomicU64,
    /// Allocator calls sent (a Batch, or one single call of the fallback).
    pub calls: AtomicU64,
}

/// Why an Acquire was queued (`allot_agent_acquires_queued{why}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireWhy {
    /// The maintenance pass's prefetch.
    Prefetch,
    /// A decision left the key short before the next pass.
    RunningLow,
    /// A decision found nothing to spend.
    Cold,
}

impl LeaseCounters {
    /// Counts one Acquire queued for `why`.
    pub fn acquire_queued(&self, why: AcquireWhy) {
        let c = match why {
            AcquireWhy::Prefetch => &self.acquires_prefetch,
            AcquireWhy::RunningLow => &self.acquires_running_low,
            AcquireWhy::Cold => &self.acquires_cold,
        };
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}
