//! The leased keys of a rule are capped at its `max_keys` (issue 10 item 11; seed §3: memory
//! stays bounded however random the client-chosen keys are).
//!
//! A new key is admitted to the table while it holds fewer than `max_keys` keys. When it is
//! full, idle keys — holding no allocation, with no allocator call in flight and unused for
//! [`SWEEP_BACKOFF_NS`] — are evicted by one sweep, at most
//! one sweep per [`SWEEP_BACKOFF_NS`] per agent, so a flood of new keys costs O(1) amortised per
//! decision. A key that still finds no place is refused: denied with a Retry-After of
//! [`TABLE_FULL_RETRY_NS`], counted in the lease counters' `key_refusals`. An evicted key holds nothing, so
//! forgetting it loses no token and no report.

use super::book::KeyLease;
use allot_common::global::GlobalKey;
use allot_common::keyed::{Keyed, ShardedTable, SWEEP_BACKOFF_NS};
use allot_common::units::Nanos;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use allot_common::limiter::TABLE_FULL_RETRY_NS;

/// The cap's bookkeeping for one agent.
#[derive(Debug, Default)]
pub struct KeyCap {
    /// When the last sweep of a full table ran, ns (0: never).
    last_sweep: AtomicU64,
}

impl KeyCap {
    /// Calls `f` with the state of `key` in its rule's `table`, creating it with `make` while
    /// the table holds fewer than the rule's `max_keys` keys; `None` when it is full of keys
    /// that are not idle (the caller refuses the decision).
    pub fn with_key<R>(
        &self,
        table: &ShardedTable<KeyLease>,
        key: &GlobalKey<'_>,
        now: Nanos,
        make: impl Fn() -> KeyLease,
        f: impl FnOnce(&Arc<Keyed<KeyLease>>) -> R,
    ) -> Option<R> {
        let (entries, max) = (key.entries, key.rule.max_keys);
        let hash = table.hash(entries);
        // The hot path: a known key, under its shard's read lock.
        let f = match table.try_with(entries, hash, f) {
            Ok(r) => return Some(r),
            Err(f) => f,
        };
        if let Some(kl) = table.get_or_insert_capped(entries, hash, max, &make) {
            return Some(f(&kl));
        }
        if self.sweep_due(now) {
            table.retain(|k| !idle(&k.value, now));
            if let Some(kl) = table.get_or_insert_capped(entries, hash, max, &make) {
                return Some(f(&kl));
            }
        }
        None
    }

    /// Claims the next sweep when none ran in the last [`SWEEP_BACKOFF_NS`].
    fn sweep_due(&self, now: Nanos) -> bool {
        let last = self.last_sweep.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= SWEEP_BACKOFF_NS)
            && self
                .last_sweep
                .compare_exchange(last, now.max(1), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }
}

/// A key that can be forgotten at `now` without losing a token, a report or a call's answer.
fn idle(v: &KeyLease, now: Nanos) -> bool {
    v.allocations().is_empty()
        && !v.protocol.call_in_flight()
        && now.saturating_sub(v.last_used.load(Ordering::Relaxed)) >= SWEEP_BACKOFF_NS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_are_at_most_one_per_backoff() {
        let c = KeyCap::default();
        assert!(c.sweep_due(5));
        assert!(!c.sweep_due(5 + SWEEP_BACKOFF_NS - 1));
        assert!(c.sweep_due(5 + SWEEP_BACKOFF_NS));
        assert!(!c.sweep_due(5 + SWEEP_BACKOFF_NS));
        assert!(c.sweep_due(u64::MAX));
        assert!(!c.sweep_due(u64::MAX));
        // Time 0 is a time like any other.
        let z = KeyCap::default();
        assert!(z.sweep_due(0));
        assert!(!z.sweep_due(0));
    }
}
