//! The agent's allocations per policy key, and the hot path that spends them (seed §19–23, §26).
//!
//! [`LeaseBook`] implements the decision core's [`GlobalLimits`]: a `scope: global` descriptor is
//! admitted by spending its cost from one of the key's unexpired allocations with a single
//! compare-and-swap. No lock is held across the decision, nothing is allocated once the key is
//! known, and nothing touches the network: acquiring, reporting and releasing happen in the
//! [`manager`](super::manager), signalled through a channel.

use super::allocation::HeldAllocation;
use super::charge::ChargeLog;
use super::demand::{DemandWindow, Thresholds};
use super::key_cap::{KeyCap, TABLE_FULL_RETRY_NS};
use super::key_rule::{FollowingBucket, KeyRule, LeaseSizing};
use super::protocol::{KeyProtocol, Standing};
use super::settings::LeaseSettings;
use crate::metrics::WaitHistogram;
use allot_common::algorithm::{LimitParams, RateAlgorithm, TokenBucket};
use allot_common::clock::Clock;
use allot_common::config::{FailureMode, Rule, RuleLimit, Scope};
use allot_common::decision::{Decision, RetryAfter};
use allot_common::descriptor::Entry;
use allot_common::global::{GlobalDecision, GlobalKey, GlobalLimits};
use allot_common::keyed::{Keyed, ShardedTable};
use allot_common::limiter::Snapshot;
use allot_common::name::NameIndex;
use allot_common::units::{ppm_of, Micros, Nanos, MICROS_PER_TOKEN};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// What the lease manager is asked to do.
#[derive(Debug)]
pub enum LeaseEvent {
    /// The key needs an allocation (cold, exhausted, or below the low watermark).
    Acquire(Arc<Keyed<KeyLease>>),
    /// A central decision of the cost (µtokens) for a waiting request of a central key; the
    /// sender is dropped (or signalled) once the answer is recorded on the key.
    Decide(Arc<Keyed<KeyLease>>, Micros, oneshot::Sender<()>),
}

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
    /// `admitted` at the previous maintenance pass.
    pub prev_admitted: AtomicU64,
    /// Recent demand, microtokens per second (measured each maintenance pass).
    pub demand_per_s: AtomicU64,
    /// Microtokens admitted in emergency (out of the allocations' reserves, so already in
    /// their spend and the overshoot bound), for status pages.
    pub emergency_admitted: AtomicU64,
    emergency: FollowingBucket,
    /// State of the rule's local fuse, when configured.
    fuse: FollowingBucket,
    /// Last decision time, ns (idle eviction).
    pub last_used: AtomicU64,
    /// The window in which promotion and demotion are measured ([`demand`](super::demand)).
    pub demand: DemandWindow,
}

impl KeyLease {
    /// Microtokens this agent can still spend for the key at `now`.
    pub fn remaining(&self, now: Nanos) -> Micros {
        self.allocations().iter().map(|a| a.remaining(now)).sum()
    }

    /// Σ(granted − reported) over held allocations (seed §23).
    pub fn unreported(&self) -> Micros {
        self.allocations().iter().map(|a| a.unreported()).sum()
    }

    /// The allocation list, oldest first.
    pub fn allocations(&self) -> Arc<Vec<Arc<HeldAllocation>>> {
        self.protocol.allocations()
    }
}

/// A reservation made by [`LeaseBook::reserve`], returned by [`LeaseBook::cancel`].
#[derive(Debug)]
pub enum LeaseReservation {
    /// Spent from an allocation; the key is given when its fuse was spent too.
    Allocation(Arc<HeldAllocation>, Micros, Option<Arc<Keyed<KeyLease>>>),
    /// Admitted from the key's central credit (the allocator's `Decide`); whether the fuse
    /// was spent too.
    Central(Arc<Keyed<KeyLease>>, Micros, bool),
}

/// What a lease decision may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Spend and keep what a cancel needs.
    Reserve,
    /// Spend for good (nothing can cancel it).
    Commit,
    /// Only say whether it would pass.
    Peek,
}

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
    /// Decisions denied from the allocator's remembered denial, without a call.
    pub denials_held: AtomicU64,
    /// Acquire RPCs sent.
    pub acquires: AtomicU64,
    /// Report RPCs sent.
    pub reports: AtomicU64,
    /// Release RPCs sent.
    pub releases: AtomicU64,
    /// Allocator calls that failed (timeout, unavailable).
    pub rpc_errors: AtomicU64,
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

/// Per domain, per rule index: the rule's lease key table (`None` for rules that are not
/// leased). Built by [`LeaseBook::apply`] from one config snapshot.
#[derive(Debug, Default)]
pub struct LeaseTables(NameIndex<Vec<Option<Arc<ShardedTable<KeyLease>>>>>);

impl LeaseTables {
    fn table(&self, domain: &str, rule_index: u32) -> Option<&Arc<ShardedTable<KeyLease>>> {
        self.0.get(domain)?.get(rule_index as usize)?.as_ref()
    }

    /// The lease state of key `entries` of rule `rule_index` in `domain`, if it exists.
    pub fn existing(
        &self,
        domain: &str,
        rule_index: u32,
        entries: &[Entry<'_>],
    ) -> Option<Arc<Keyed<KeyLease>>> {
        let table = self.table(domain, rule_index)?;
        table.get(entries, table.hash(entries))
    }
}

/// The book as seen with one [`LeaseTables`]: the [`GlobalLimits`] a decision made with the
/// snapshot those tables were built from uses, so the snapshot and the tables come from one
/// load (see `Enforcer`).
#[derive(Debug, Clone, Copy)]
pub struct LeaseView<'a> {
    book: &'a LeaseBook,
    tables: &'a LeaseTables,
    charges: Option<&'a ChargeLog>,
}

impl<'a> LeaseView<'a> {
    /// `book` deciding with `tables`.
    pub fn new(book: &'a LeaseBook, tables: &'a LeaseTables) -> Self {
        LeaseView {
            book,
            tables,
            charges: None,
        }
    }

    /// As [`new`](Self::new), recording in `charges` what each admitted leased descriptor
    /// charged, for a decision that may be refunded later (issue 10 item 5).
    pub fn recording(book: &'a LeaseBook, tables: &'a LeaseTables, charges: &'a ChargeLog) -> Self {
        LeaseView {
            book,
            tables,
            charges: Some(charges),
        }
    }

    /// Decides in `mode`, recording the charge when asked to (a commit is then decided as a
    /// reservation, so what it charged is known).
    fn decide_recorded(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        let Some(log) = self.charges else {
            return self.book.decide(self.tables, key, cost, now, mode);
        };
        let d = self.book.decide(self.tables, key, cost, now, Mode::Reserve);
        if let Some(r) = &d.reservation {
            if let Some(kl) = self
                .tables
                .existing(key.domain, key.rule_index, key.entries)
            {
                log.record(key.entries, kl, r);
            }
        }
        d
    }
}

/// The agent's leases: per rule, per key.
pub struct LeaseBook {
    /// Per domain, per rule index: the rule's key table (`None` for rules that are not leased).
    tables: ArcSwap<LeaseTables>,
    by_rule: Mutex<HashMap<String, Arc<ShardedTable<KeyLease>>>>,
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
    /// whose id is unchanged keep their allocations.
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
        *by_rule = next_by_rule;
        let tables = Arc::new(LeaseTables(tables));
        self.tables.store(tables.clone());
        tables
    }

    /// Every leased key table.
    pub fn tables(&self) -> Vec<Arc<ShardedTable<KeyLease>>> {
        self.by_rule.lock().values().cloned().collect()
    }

    /// Whether the last allocator call succeeded.
    pub fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Records whether the allocator answered.
    pub fn set_reachable(&self, up: bool) {
        self.reachable.store(up, Ordering::Relaxed);
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

    /// Asks the manager for an allocation unless the key is central, a call for it is in
    /// flight, or a denial or failure backoff stands.
    pub fn request_lease(&self, kl: &Arc<Keyed<KeyLease>>, now: Nanos) {
        if !self.is_central(&kl.value)
            && kl.value.protocol.begin_call(now)
            && self.events.send(LeaseEvent::Acquire(kl.clone())).is_err()
        {
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
        for t in self.tables() {
            t.for_each(|k| total = total.saturating_add(k.value.unreported()));
        }
        total
    }

    #[inline]
    fn decide(
        &self,
        tables: &LeaseTables,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        // Capacity from the rule as configured now: a cost that can never pass is refused
        // before any allocation is looked at, warm key or cold.
        let capacity = match key.rule.limit {
            RuleLimit::Limited { params, .. } => params.capacity(),
            RuleLimit::Unlimited => Micros::MAX,
        };
        // Every setting comes from the rule deciding now (seed §28), not from the config the
        // key was first seen under.
        let rule = KeyRule::of(key.rule);
        self.with_key(tables, &key, now, |kl| {
            if cost > capacity {
                kl.value.last_used.store(now, Ordering::Relaxed);
                return denied(kl.value.remaining(now), RetryAfter::Never, false);
            }
            self.decide_key(kl, &rule, cost, now, mode)
        })
    }

    /// The hot path: a warm key without a fuse whose allocations cover the cost. Everything
    /// else (cold keys, the fuse, exhausted allocations, failure modes) is [`decide_slow`].
    #[inline]
    fn decide_key(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        if mode != Mode::Peek && rule.fuse.is_none() {
            let allocs = v.protocol.held();
            if let Some(a) = allocs.iter().find(|a| a.try_spend(cost, now)) {
                v.last_used.store(now, Ordering::Relaxed);
                return self.admitted(kl, rule, &allocs, a, cost, now, mode, false);
            }
        }
        self.decide_slow(kl, rule, cost, now, mode)
    }

    /// Bookkeeping of a decision that spent `cost` from `a` (one of `allocs`, the key's list).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn admitted(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        allocs: &[Arc<HeldAllocation>],
        a: &Arc<HeldAllocation>,
        cost: Micros,
        now: Nanos,
        mode: Mode,
        fused: bool,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        v.admitted.fetch_add(cost, Ordering::Relaxed);
        self.counters.leased_admits.fetch_add(1, Ordering::Relaxed);
        let remaining: Micros = allocs.iter().map(|a| a.remaining(now)).sum();
        // A key whose rate still accrues renews at the maintenance pass (design §9): what it
        // spends as it accrues never drives it below the watermark into an Acquire per token.
        if remaining < percent_of(rule.max_grant, self.settings.low_watermark_pct)
            && !allocs.iter().any(|a| a.accrues(now))
        {
            v.sizing.follow(rule);
            self.request_lease(kl, now);
        }
        GlobalDecision {
            decision: allowed(remaining, &rule.params),
            reservation: (mode == Mode::Reserve)
                .then(|| LeaseReservation::Allocation(a.clone(), cost, fused.then(|| kl.clone()))),
            cold: false,
        }
    }

    /// Everything but the hot path: the fuse, then the key's allocations, then — nothing held
    /// covers the cost — where the key stands with the allocator ([`Standing`]): a standing
    /// denial denies at once, an unreachable allocator applies the failure mode, and otherwise
    /// the decision joins the key's next call and is answered `cold` so the caller waits for it
    /// (issue 9 item 1: no 429 only because this agent holds nothing).
    #[cold]
    #[inline(never)]
    fn decide_slow(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        let take = mode != Mode::Peek;
        let v = &kl.value;
        v.last_used.store(now, Ordering::Relaxed);
        v.sizing.follow(rule);
        // The fuse first: a flood is rejected here, before it can drain allocations or ask
        // the allocator for more.
        let fused = match (rule.fuse, take) {
            (Some(f), true) => {
                let d = v.fuse.with(f, now, |f, st| f.decide(st, now, cost));
                if !d.allowed {
                    self.counters.fuse_rejects.fetch_add(1, Ordering::Relaxed);
                    return denied(v.remaining(now), d.retry_after, false);
                }
                true
            }
            _ => false,
        };
        let allocs = v.allocations();
        if take {
            if let Some(a) = allocs.iter().find(|a| a.try_spend(cost, now)) {
                return self.admitted(kl, rule, &allocs, a, cost, now, mode, fused);
            }
        } else if allocs.iter().any(|a| a.remaining(now) >= cost) {
            let remaining: Micros = allocs.iter().map(|a| a.remaining(now)).sum();
            return GlobalDecision {
                decision: allowed(remaining, &rule.params),
                reservation: None,
                cold: false,
            };
        }
        if take && v.protocol.take_credit(cost, now) {
            return self.admitted_centrally(kl, rule, cost, now, mode, fused);
        }
        if take && now < v.protocol.denied_until() {
            // The allocator has said it has no more for this key now: the emergency reserve
            // of what it already granted is spendable like the rest. Those tokens are inside
            // the grants (so inside the overshoot bound, design §6); holding them back while
            // the allocator is reachable would only turn granted tokens into false rejections
            // at the contract's edge.
            if let Some(a) = allocs.iter().find(|a| a.try_spend_emergency(cost, now)) {
                return self.admitted(kl, rule, &allocs, a, cost, now, mode, fused);
            }
        }
        if fused {
            // Not admitted after all: the fuse gets its token back.
            self.refund_fuse(v, cost);
        }
        let remaining: Micros = allocs.iter().map(|a| a.remaining(now)).sum();
        self.nothing_held(kl, rule, remaining, cost, now, take)
    }

    /// A decision for which the key holds nothing spendable: decided by where the key stands
    /// with the allocator.
    fn nothing_held(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        remaining: Micros,
        cost: Micros,
        now: Nanos,
        take: bool,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        if self.stopping.load(Ordering::Acquire) {
            self.counters
                .failure_denials
                .fetch_add(1, Ordering::Relaxed);
            let wait = self.settings.retry_floor_ns();
            return denied(remaining, RetryAfter::After(wait), false);
        }
        if let Some(wait) = accrual_wait(&v.allocations(), cost, now) {
            // The key's rate still accrues: its next tokens come from it, not from another
            // call (the allocator already divided the rate; the maintenance pass renews it).
            self.counters
                .accrual_denials
                .fetch_add(1, Ordering::Relaxed);
            let wait = wait.max(1);
            return denied(remaining, RetryAfter::After(wait), false);
        }
        match v.protocol.standing(now, ms(self.settings.cold_wait_ms)) {
            Standing::Denied(until) => {
                // The allocator's own Retry-After (from its bucket), counting down.
                self.counters.denials_held.fetch_add(1, Ordering::Relaxed);
                denied(remaining, RetryAfter::After(until - now), false)
            }
            Standing::Unreachable(until) => {
                if rule.failure_mode == FailureMode::Emergency {
                    if let Some(d) = self.emergency(kl, rule, cost, now, take) {
                        return d;
                    }
                } else {
                    self.counters
                        .failure_denials
                        .fetch_add(1, Ordering::Relaxed);
                }
                let wait = until
                    .saturating_sub(now)
                    .max(self.settings.retry_floor_ns());
                denied(remaining, RetryAfter::After(wait), false)
            }
            Standing::Ask if self.is_central(v) => {
                // The waiting request asks the allocator itself (`Enforcer`): one `Decide` of
                // its own cost. A request already denied elsewhere (a peek) asks nothing.
                let wait = rule
                    .params
                    .time_for(cost)
                    .max(self.settings.retry_floor_ns());
                denied(remaining, RetryAfter::After(wait), take)
            }
            Standing::Ask => {
                // Join the key's next call: it asks for at least the waiting decisions' costs.
                self.counters.cold_misses.fetch_add(1, Ordering::Relaxed);
                v.protocol.add_waiting(cost);
                self.request_lease(kl, now);
                let wait = rule
                    .params
                    .time_for(cost)
                    .max(self.settings.retry_floor_ns());
                denied(remaining, RetryAfter::After(wait), true)
            }
        }
    }

    /// Bookkeeping of a decision admitted from the key's central credit (the allocator debited
    /// it already: nothing enters the overshoot bound); promotes the key when its demand here
    /// makes a lease worthwhile ([`demand`](super::demand)).
    fn admitted_centrally(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        mode: Mode,
        fused: bool,
    ) -> GlobalDecision<LeaseReservation> {
        let v = &kl.value;
        let total = v
            .admitted
            .fetch_add(cost, Ordering::Relaxed)
            .saturating_add(cost);
        self.counters.central_admits.fetch_add(1, Ordering::Relaxed);
        let period = ms(rule.ttl_ms.max(1));
        if v.demand
            .promote_due(now, period, total, cost, self.thresholds)
            && v.protocol.set_leased(true)
        {
            v.demand.restart(now, total);
            self.counters.promotions.fetch_add(1, Ordering::Relaxed);
        }
        GlobalDecision {
            decision: allowed(0, &rule.params),
            reservation: (mode == Mode::Reserve)
                .then(|| LeaseReservation::Central(kl.clone(), cost, fused)),
            cold: false,
        }
    }

    /// Failure mode `emergency` (issue 10 item 4): while the allocator is unreachable for the
    /// key, the emergency reserve of its allocations (the top of each grant, kept when it was
    /// installed) admits at the pace of the emergency bucket (a fraction of the policy's rate
    /// and burst). The reserve is part of the grants: every emergency admission is inside the
    /// overshoot bound and charged to the bucket when its allocation is reported or released,
    /// so N gateways admit at most the reserves the allocator granted them, however long the
    /// outage. `None` when no reserve covers the cost (the failure-mode denial follows).
    fn emergency(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        rule: &KeyRule,
        cost: Micros,
        now: Nanos,
        take: bool,
    ) -> Option<GlobalDecision<LeaseReservation>> {
        let v = &kl.value;
        let bucket = self.settings.emergency_bucket(&rule.params)?;
        let allocs = v.allocations();
        if !allocs.iter().any(|a| a.emergency_remaining(now) >= cost) {
            return None;
        }
        let (d, spent) = v.emergency.with(bucket, now, |b, st| {
            let d = b.check(st, now, cost);
            if !d.allowed || !take {
                return (d, None);
            }
            let a = allocs
                .iter()
                .find(|a| a.try_spend_emergency(cost, now))
                .cloned();
            if a.is_some() {
                b.spend(st, now, cost);
            }
            (d, a)
        });
        let Some(a) = spent else {
            // A peek or the emergency pace's denial answers as the bucket does; a reserve
            // taken by a racing decision leaves the failure-mode denial.
            return (!take || !d.allowed).then_some(GlobalDecision {
                decision: d,
                reservation: None,
                cold: false,
            });
        };
        v.emergency_admitted.fetch_add(cost, Ordering::Relaxed);
        v.admitted.fetch_add(cost, Ordering::Relaxed);
        self.counters
            .emergency_admits
            .fetch_add(1, Ordering::Relaxed);
        Some(GlobalDecision {
            decision: d,
            reservation: Some(LeaseReservation::Allocation(a, cost, None)),
            cold: false,
        })
    }

    fn refund_fuse(&self, v: &KeyLease, cost: Micros) {
        v.fuse.refund(self.clock.now(), cost);
    }
}

/// The soonest any of `allocs` accrues `cost` more at `now`, ns; `None` when none still accrues
/// (or none ever covers it before its accrual ends).
fn accrual_wait(allocs: &[Arc<HeldAllocation>], cost: Micros, now: Nanos) -> Option<Nanos> {
    allocs
        .iter()
        .filter_map(|a| a.accrual_wait(cost, now))
        .min()
}

/// `pct` percent of `m`, rounded down, saturating at `u64::MAX`; a 64-bit product when it fits.
fn percent_of(m: Micros, pct: u32) -> Micros {
    match m.checked_mul(u64::from(pct)) {
        Some(p) => p / 100,
        None => u64::try_from(u128::from(m) * u128::from(pct) / 100).unwrap_or(u64::MAX),
    }
}

/// Whether an agent leases this rule from the allocator.
pub fn leased(r: &Rule) -> bool {
    r.scope == Scope::Global && matches!(r.limit, RuleLimit::Limited { .. })
}

fn new_key(key: &GlobalKey<'_>, now: Nanos) -> KeyLease {
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
        prev_admitted: AtomicU64::new(0),
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

fn allowed(remaining: Micros, params: &LimitParams) -> Decision {
    Decision {
        allowed: true,
        remaining_micros: remaining,
        reset_after: params.time_for(params.capacity().saturating_sub(remaining)),
        retry_after: RetryAfter::Now,
    }
}

fn denied(remaining: Micros, retry: RetryAfter, cold: bool) -> GlobalDecision<LeaseReservation> {
    GlobalDecision {
        decision: Decision {
            allowed: false,
            remaining_micros: remaining,
            reset_after: match retry {
                RetryAfter::After(n) => n,
                _ => 0,
            },
            retry_after: retry,
        },
        reservation: None,
        cold,
    }
}

impl GlobalLimits for LeaseView<'_> {
    type Reservation = LeaseReservation;

    #[inline]
    fn reserve(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        self.decide_recorded(key, cost, now, Mode::Reserve)
    }

    #[inline]
    fn commit(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        self.decide_recorded(key, cost, now, Mode::Commit)
    }

    fn peek(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        self.book.decide(self.tables, key, cost, now, Mode::Peek)
    }

    fn cancel(&self, r: LeaseReservation) {
        if let Some(log) = self.charges {
            log.forget(&r);
        }
        self.book.cancel(r)
    }

    /// A refund that does not say which allocation was charged goes nowhere: only the charged
    /// allocation may take tokens back, and only while it is live (issue 10 item 5). Refunds of
    /// leased descriptors go through what their decision recorded
    /// ([`Charged::refund`](super::charge::Charged::refund)).
    fn refund(&self, _key: GlobalKey<'_>, _micros: Micros, _now: Nanos) {}
}

impl LeaseBook {
    /// Returns a reservation's tokens: to its allocation (an emergency admission's included)
    /// or central credit, and to the fuse.
    fn cancel(&self, r: LeaseReservation) {
        match r {
            LeaseReservation::Allocation(a, cost, fused) => {
                a.unspend(cost);
                if let Some(kl) = fused {
                    self.refund_fuse(&kl.value, cost);
                }
            }
            LeaseReservation::Central(kl, cost, fused) => {
                // Back to the credit (still void at its time: never used late).
                kl.value.protocol.add_credit(cost, 0);
                kl.value.admitted.fetch_sub(cost, Ordering::Relaxed);
                if fused {
                    self.refund_fuse(&kl.value, cost);
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_of_is_exact_across_the_64_bit_boundary() {
        assert_eq!(percent_of(400, 25), 100);
        assert_eq!(percent_of(399, 25), 99);
        assert_eq!(percent_of(u64::MAX, 100), u64::MAX);
        assert_eq!(percent_of(u64::MAX, 25), u64::MAX / 4);
        assert_eq!(percent_of(u64::MAX, 50), u64::MAX / 2);
        // Above 100 % the product leaves u64: saturate, never wrap.
        assert_eq!(percent_of(u64::MAX, 200), u64::MAX);
        assert_eq!(percent_of(u64::MAX / 2, u32::MAX), u64::MAX);
    }
}
