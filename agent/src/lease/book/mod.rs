//! The agent's allocations per policy key, and the hot path that spends them (seed §19–23, §26).
//!
//! [`LeaseBook`], through [`LeaseView`], implements the decision core's
//! [`GlobalLimits`](allot_common::global::GlobalLimits): a `scope: global` descriptor is
//! admitted by spending its cost from one of the key's unexpired allocations with a single
//! compare-and-swap. No lock is held across the decision, nothing is allocated once the key is
//! known, and nothing touches the network: acquiring, reporting and releasing happen in the
//! [`manager`](super::manager), signalled through a channel.
//!
//! One concept per file: the book itself (here); what it asks of the manager (`event.rs`); a
//! key's state (`key.rs`); the tables of one config snapshot (`tables.rs`); the view the
//! decision core calls (`view.rs`); the decision itself ([`decision_path`], whose doc walks a
//! request from the adapter to the answer); what a reservation holds (`reservation.rs`); and
//! the counters (`counters.rs`).

mod counters;
pub mod decision_path;
mod event;
mod key;
mod reservation;
mod tables;
mod view;

pub use counters::{AcquireWhy, LeaseCounters};
pub use event::LeaseEvent;
pub use key::KeyLease;
pub use reservation::LeaseReservation;
pub use tables::{leased, LeaseTables};
pub use view::LeaseView;

use crate::lease::demand::Thresholds;
use crate::lease::key_cap::{KeyCap, TABLE_FULL_RETRY_NS};
use crate::lease::key_rule::KeyRule;
use crate::lease::settings::LeaseSettings;
use allot_common::algorithm::{LimitParams, TokenBucket};
use allot_common::clock::Clock;
use allot_common::decision::RetryAfter;
use allot_common::descriptor::Entry;
use allot_common::global::{GlobalDecision, GlobalKey};
use allot_common::keyed::{Keyed, ShardedTable};
use allot_common::limiter::Snapshot;
use allot_common::name::NameIndex;
use allot_common::units::{ppm_of, Micros, Nanos, MICROS_PER_TOKEN};
use arc_swap::ArcSwap;
use decision_path::denied;
use key::new_key;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// The agent's leases: per rule, per key.
pub struct LeaseBook {
    /// Per domain, per rule index: the rule's key table (`None` for rules that are not leased).
    tables: ArcSwap<LeaseTables>,
    by_rule: Mutex<HashMap<String, Arc<ShardedTable<KeyLease>>>>,
    /// Tables of rules a newer config no longer leases (removed, `scope: local`, another key
    /// path): their keys' allocations are closed and released by the lease manager, then the
    /// tables are dropped ([`retired_tables`](Self::retired_tables)).
    retired: Mutex<Vec<Arc<ShardedTable<KeyLease>>>>,
    events: mpsc::UnboundedSender<LeaseEvent>,
    reachable: AtomicBool,
    /// Central decisions are off: the settings lease every key, or the allocator does not
    /// serve `Decide` (an older version).
    central_off: AtomicBool,
    /// The lease manager has stopped serving calls (shutdown): nothing is asked any more.
    stopping: AtomicBool,
    thresholds: Thresholds,
    clock: Arc<dyn Clock>,
    settings: LeaseSettings,
    /// Counters for metrics.
    pub counters: LeaseCounters,
    /// Sweeps of full leased-key tables.
    key_cap: KeyCap,
}

impl std::fmt::Debug for LeaseBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseBook")
            .field("reachable", &self.is_reachable())
            .finish()
    }
}

impl LeaseBook {
    /// A book sending lease work to `events`.
    pub fn new(
        clock: Arc<dyn Clock>,
        settings: LeaseSettings,
        events: mpsc::UnboundedSender<LeaseEvent>,
    ) -> Self {
        LeaseBook {
            tables: ArcSwap::from_pointee(LeaseTables::default()),
            by_rule: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            events,
            reachable: AtomicBool::new(true),
            central_off: AtomicBool::new(settings.thresholds().always_leased()),
            stopping: AtomicBool::new(false),
            thresholds: settings.thresholds(),
            clock,
            settings,
            counters: LeaseCounters::default(),
            key_cap: KeyCap::default(),
        }
    }

    /// The clock decisions and deadlines use.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Lease settings.
    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    /// Rebuilds the per-rule tables for a new config snapshot and returns them; keys of rules
    /// whose id is unchanged keep their allocations. The tables of rules the snapshot no longer
    /// leases are retired: nothing decides from them once the snapshot is current, and the
    /// lease manager releases what their keys hold ([`retired_tables`](Self::retired_tables)),
    /// so their unspent tokens go back to the allocator instead of waiting for expiry.
    pub fn apply(&self, snap: &Snapshot) -> Arc<LeaseTables> {
        let mut by_rule = self.by_rule.lock();
        let mut next_by_rule = HashMap::new();
        let mut tables = NameIndex::default();
        for d in snap.domains() {
            let v = d
                .config
                .rules
                .iter()
                .map(|r| {
                    leased(r).then(|| {
                        let t: Arc<ShardedTable<KeyLease>> =
                            by_rule.get(&r.id).cloned().unwrap_or_default();
                        // Keys kept across the change size their leases by the new rule.
                        let rule = KeyRule::of(r);
                        t.for_each(|k| k.value.sizing.follow(&rule));
                        next_by_rule.insert(r.id.clone(), t.clone());
                        t
                    })
                })
                .collect();
            tables.insert(&d.config.domain, v);
        }
        let gone = by_rule
            .iter()
            .filter(|(id, _)| !next_by_rule.contains_key(*id))
            .map(|(_, t)| t.clone());
        self.retired.lock().extend(gone);
        *by_rule = next_by_rule;
        let tables = Arc::new(LeaseTables(tables));
        self.tables.store(tables.clone());
        tables
    }

    /// Every leased key table.
    pub fn tables(&self) -> Vec<Arc<ShardedTable<KeyLease>>> {
        self.by_rule.lock().values().cloned().collect()
    }

    /// Tables of rules no longer leased that may still hold something, after dropping the
    /// keys and tables that cannot: a table an older config's tables still refer to is kept
    /// whole (a decision on that config can still create a key in it and start a call); once
    /// none does, a key is dropped when no call is in flight and it holds no allocation (in that
    /// order: an answer installs its allocation before it ends the call), and an empty table
    /// with it.
    pub fn retired_tables(&self) -> Vec<Arc<ShardedTable<KeyLease>>> {
        let mut retired = self.retired.lock();
        retired.retain(|t| {
            if Arc::strong_count(t) > 1 {
                return true;
            }
            t.retain(|k| k.value.protocol.call_in_flight() || !k.value.allocations().is_empty());
            !t.is_empty()
        });
        retired.clone()
    }

    /// Every table that may hold an allocation: the current rules' and the retired ones
    /// ([`retired_tables`](Self::retired_tables)), without dropping anything.
    pub fn all_tables(&self) -> Vec<Arc<ShardedTable<KeyLease>>> {
        let mut all = self.tables();
        all.extend(self.retired.lock().iter().cloned());
        all
    }

    /// Whether the last allocator call succeeded.
    pub fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Records whether the allocator answered. A change is logged (a warning when it stops
    /// answering: global rules then follow their failure modes, and a `deny` rule's 429 looks
    /// like any other to clients) and an outage is counted (`unreachable_episodes`).
    pub fn set_reachable(&self, up: bool) {
        match (self.reachable.swap(up, Ordering::Relaxed), up) {
            (true, false) => {
                self.counters
                    .unreachable_episodes
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "allocator unreachable: global rules follow their failure modes until it answers"
                );
            }
            (false, true) => tracing::info!("allocator reachable again"),
            _ => {}
        }
    }

    /// Calls `f` with the key's lease state (created on first sight, under the rule's
    /// `max_keys`) while its shard's read lock is held, so the hot path touches no reference
    /// count. A rule that is not leased never reaches here, and a key refused by a full table
    /// ([`KeyCap`]) is denied: never admitted unlimited.
    #[inline]
    fn with_key(
        &self,
        tables: &LeaseTables,
        key: &GlobalKey<'_>,
        now: Nanos,
        f: impl FnOnce(&Arc<Keyed<KeyLease>>) -> GlobalDecision<LeaseReservation>,
    ) -> GlobalDecision<LeaseReservation> {
        let Some(table) = tables.table(key.domain, key.rule_index) else {
            return denied(0, RetryAfter::After(self.settings.retry_floor_ns()), false);
        };
        // Created as used now, so the manager's idle eviction cannot take it before it is.
        self.key_cap
            .with_key(table, key, now, || new_key(key, now), f)
            .unwrap_or_else(|| {
                self.counters.key_refusals.fetch_add(1, Ordering::Relaxed);
                denied(0, RetryAfter::After(TABLE_FULL_RETRY_NS), false)
            })
    }

    /// The key's lease state if it exists (no creation).
    pub fn existing(
        &self,
        domain: &str,
        rule_index: u32,
        entries: &[Entry<'_>],
    ) -> Option<Arc<Keyed<KeyLease>>> {
        self.tables.load().existing(domain, rule_index, entries)
    }

    /// Whether requests of `v` are decided centrally by the allocator (not leased).
    #[inline]
    pub fn is_central(&self, v: &KeyLease) -> bool {
        !v.protocol.is_leased() && !self.central_off.load(Ordering::Relaxed)
    }

    /// The lease manager stops serving calls (the agent shuts down): from now on a decision
    /// that finds nothing to spend is denied at once, never waiting for a call that will not
    /// be made, and never admitted by an emergency bucket (no Release would carry it).
    pub fn stop_leasing(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// The allocator does not serve `Decide`: every key is leased from now on.
    pub fn central_unsupported(&self) {
        if !self.central_off.swap(true, Ordering::AcqRel) {
            tracing::info!("the allocator does not serve Decide; every key is leased");
        }
    }

    /// Promotion and demotion thresholds.
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// Asks the allocator to decide `cost` for a waiting request of the central key `kl`;
    /// the receiver completes when the answer is recorded on the key (`None`: the agent is
    /// stopping and nothing will be asked).
    pub fn decide_centrally(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        cost: Micros,
    ) -> Option<oneshot::Receiver<()>> {
        let (tx, rx) = oneshot::channel();
        self.counters.decides_asked.fetch_add(1, Ordering::Relaxed);
        self.events
            .send(LeaseEvent::Decide(kl.clone(), cost, tx))
            .ok()
            .map(|_| rx)
    }

    /// Claims the key's next allocator call for an Acquire at `now`: false when the key is
    /// central, a call for it is in flight, or a denial or failure backoff stands. The caller
    /// that wins queues the Acquire ([`request_lease`](Self::request_lease) through the
    /// manager's events; the manager's own pass straight into the batch it is composing).
    pub(crate) fn claim_acquire(&self, kl: &Arc<Keyed<KeyLease>>, now: Nanos) -> bool {
        !self.is_central(&kl.value) && kl.value.protocol.begin_call(now)
    }

    /// Asks the manager for an allocation unless the key is central, a call for it is in
    /// flight, or a denial or failure backoff stands; counts it under `why` when asked.
    pub fn request_lease(&self, kl: &Arc<Keyed<KeyLease>>, now: Nanos, why: AcquireWhy) {
        if !self.claim_acquire(kl, now) {
            return;
        }
        self.counters.acquire_queued(why);
        if self.events.send(LeaseEvent::Acquire(kl.clone())).is_err() {
            // A closed channel means the agent is shutting down: nothing more to lease, and
            // no decision may wait for a call that will never be made.
            kl.value.protocol.abandon_call();
        }
    }

    /// Σ over every key of the unreported allocation tokens: the most this agent can have
    /// admitted beyond what the allocator knows (seed §23), microtokens. Emergency admissions
    /// are spend of the allocations' reserves, so they are inside it.
    pub fn overshoot_bound(&self) -> Micros {
        let mut total = 0u64;
        for t in self.all_tables() {
            t.for_each(|k| total = total.saturating_add(k.value.unreported()));
        }
        total
    }
}

/// Milliseconds → ns (saturating), under the short name the lease code uses.
pub(crate) use allot_common::units::millis_to_nanos as ms;

/// The emergency bucket's parameters: `ppm` of the policy's rate and capacity (at least one token
/// of capacity), or `None` when the policy is not a bucket or the fraction is 0.
pub(crate) fn emergency_params(p: &LimitParams, ppm: u32) -> Option<TokenBucket> {
    if ppm == 0 {
        return None;
    }
    Some(TokenBucket {
        capacity: ppm_of(p.capacity(), ppm).max(MICROS_PER_TOKEN),
        rate: p.refill_rate().scaled(ppm)?,
    })
}
