//! A policy key's lease state: its allocations, where it stands with the allocator, and its
//! demand.

use crate::lease::allocation::{total_remaining, HeldAllocation};
use crate::lease::cost_mix::CostMix;
use crate::lease::demand::DemandWindow;
use crate::lease::key_rule::{FollowingBucket, KeyRule, LeaseSizing};
use crate::lease::protocol::KeyProtocol;
use allot_common::algorithm::Rate;
use allot_common::global::GlobalKey;
use allot_common::units::{Micros, Nanos};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Allocations and lease bookkeeping of one policy key.
#[derive(Debug)]
pub struct KeyLease {
    /// Domain of the key.
    pub domain: String,
    /// Descriptor entries of the key.
    pub entries: Vec<(String, String)>,
    /// Rule id (`domain|key=value…`).
    pub rule_id: String,
    /// Rule name (policy id in answers).
    pub rule_name: String,
    /// Max grant and TTL of the newest rule seen for the key, for the lease manager (a
    /// decision reads its own rule: [`KeyRule`]).
    pub sizing: LeaseSizing,
    /// Where the key stands with the allocator: allocations, call in flight, denial,
    /// reachability, waiting cost ([`KeyProtocol`]).
    pub protocol: KeyProtocol,
    /// Microtokens admitted for this key in total (allocations and emergency), for demand.
    pub admitted: AtomicU64,
    /// Microtokens of final denials for this key (the allocator's standing denial, the
    /// failure mode, a rate not yet accrued; not the fuse, nor a request waiting for a call):
    /// with `admitted`, the load offered here, which is what demand measures. Admissions alone
    /// would measure only what the last grant allowed, and a key short of tokens would never
    /// ask for more.
    pub denied_cost: AtomicU64,
    /// Whether the key's denied requests differ in cost (see [`CostMix`]).
    pub denied_mix: CostMix,
    /// `admitted + denied_cost` at the previous maintenance pass.
    pub prev_offered: AtomicU64,
    /// `denied_cost` at the previous maintenance pass.
    pub prev_denied: AtomicU64,
    /// Consecutive maintenance passes in which the key was hot, kept short by the allocator
    /// and denied nothing here (`manager::settled_scarcity`).
    pub settled_passes: AtomicU64,
    /// Recent demand, microtokens per second: the offered load, measured each maintenance
    /// pass, taken at once when it rises and decaying over a lease when it falls.
    pub demand_per_s: AtomicU64,
    /// Microtokens admitted in emergency (out of the allocations' reserves, so already in
    /// their spend and the overshoot bound), for status pages.
    pub emergency_admitted: AtomicU64,
    pub(super) emergency: FollowingBucket,
    /// State of the rule's local fuse, when configured.
    pub(super) fuse: FollowingBucket,
    /// Last decision time, ns (idle eviction).
    pub last_used: AtomicU64,
    /// The window in which promotion and demotion are measured ([`demand`](crate::lease::demand)).
    pub demand: DemandWindow,
}

impl KeyLease {
    /// Microtokens the key's recent demand ([`demand_per_s`](Self::demand_per_s)) spends over
    /// `ns` nanoseconds, rounded down: what it will want until the next maintenance pass.
    pub fn demand_over(&self, ns: Nanos) -> Micros {
        Rate::per_second(self.demand_per_s.load(Ordering::Relaxed)).produced(ns)
    }

    /// Microtokens this agent can still spend for the key at `now`.
    pub fn remaining(&self, now: Nanos) -> Micros {
        total_remaining(&self.allocations(), now)
    }

    /// Σ(granted − reported) over held allocations (seed §23).
    pub fn unreported(&self) -> Micros {
        self.allocations().iter().map(|a| a.unreported()).sum()
    }

    /// Microtokens offered for this key so far: admitted plus finally denied.
    pub fn offered(&self) -> Micros {
        self.admitted
            .load(Ordering::Relaxed)
            .saturating_add(self.denied_cost.load(Ordering::Relaxed))
    }

    /// Counts a final denial of `cost` (see [`KeyLease::denied_cost`]).
    pub fn note_denied(&self, cost: Micros) {
        self.denied_cost.fetch_add(cost, Ordering::Relaxed);
        self.denied_mix.note(cost);
    }

    /// The allocation list, oldest first.
    pub fn allocations(&self) -> Arc<Vec<Arc<HeldAllocation>>> {
        self.protocol.allocations()
    }
}

pub(super) fn new_key(key: &GlobalKey<'_>, now: Nanos) -> KeyLease {
    KeyLease {
        domain: key.domain.to_string(),
        entries: key
            .entries
            .iter()
            .map(|e| (e.key.to_string(), e.value.to_string()))
            .collect(),
        rule_id: key.rule.id.clone(),
        rule_name: key.rule.name.clone(),
        sizing: LeaseSizing::new(&KeyRule::of(key.rule)),
        protocol: KeyProtocol::default(),
        admitted: AtomicU64::new(0),
        denied_cost: AtomicU64::new(0),
        denied_mix: CostMix::default(),
        prev_offered: AtomicU64::new(0),
        prev_denied: AtomicU64::new(0),
        settled_passes: AtomicU64::new(0),
        demand_per_s: AtomicU64::new(0),
        emergency_admitted: AtomicU64::new(0),
        emergency: FollowingBucket::default(),
        fuse: FollowingBucket::default(),
        last_used: AtomicU64::new(now),
        demand: {
            let w = DemandWindow::default();
            w.restart(now, 0);
            w
        },
    }
}
