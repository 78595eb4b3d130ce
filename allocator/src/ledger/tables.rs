//! Bounded client-keyed tables (issue 10 item 11; design §10 "Keys": state per key must be
//! bounded).
//!
//! Clients choose key strings, region names and holder names, so every ledger table keyed by
//! them has a cap:
//! * policy keys per rule: the rule's `max_keys`. At the cap one idle key (no live allocation,
//!   buckets full, no calendar usage of the current period: evicting it loses nothing) is
//!   evicted to make room, else the new key is refused;
//! * regions per policy key: `lease.max_regions`; holders whose recent asks are kept per key and
//!   region: `lease.max_holders` (asks older than the idle window do not count); live
//!   allocations per key and region: `lease.max_allocations` (each Acquire of a new request id
//!   can make one; ended ones are forgotten within bounds, [`super::MAX_ENDED_KEPT`]);
//! * remembered answers of Acquire / Decide: [`super::MAX_REMEMBERED_REQUESTS`], and of admin
//!   writes: [`super::MAX_REMEMBERED_ADMIN`] (caches: the oldest are forgotten first, counted as
//!   evicted when before their retention ended).
//!
//! A refused insert answers [`LedgerError::TableFull`] naming the full table (RESOURCE_EXHAUSTED
//! on the wire) and changes no state; each refusal is counted ([`TableStats`], shown by
//! `allotctl cluster status`).
//!
//! Eviction costs O(log keys), never a scan: [`KeyIndex`] keeps every key without a live
//! allocation ordered by the time it becomes idle (`KeyState::idle_at_ms`, computed from the
//! applied state whenever the key changes, so the same on every replica and kept in snapshots),
//! and `make_room` looks at no more than [`EVICTION_PROBES`] of its first entries.

use super::calendar::period_bounds;
use super::{KeyBytes, KeyId, KeyState, Ledger, LedgerError, Name, RegionKeyState, Table};
use allot_common::config::Rule;
use allot_common::decision::RetryAfter;
use allot_common::units::{millis_to_nanos, nanos_to_millis_ceil};
use std::collections::{BTreeMap, BTreeSet};

/// Most entries of the idle index `make_room` looks at for one new key. The first is the key
/// that became idle earliest; more are looked at only when a policy change made an entry's idle
/// time stale (it is filed again at its new time).
pub const EVICTION_PROBES: u64 = 4;

/// How long the ledger keeps a key after it became idle ([`is_idle`]: nothing live, buckets
/// full, no calendar usage of the current period) before forgetting it on its own, ms, at
/// least: a rule whose lease TTL plus drift is longer keeps its keys that long (its holders'
/// asks count that long). A forgotten key is recreated as new at its next request, with full
/// buckets, exactly the state it had (issue 13 item 3: without this the table grows to
/// `max_keys` with every key ever seen).
pub const IDLE_KEY_RETENTION_MS: u64 = 60_000;

/// Most idle keys forgotten at one check ([`Ledger::forget_idle_keys`]), bounding the work of
/// the command that runs it.
pub const MAX_FORGOTTEN_PER_CHECK: usize = 1_024;

/// A table the ledger caps, for counting (a refusal names the full table itself, with its
/// policy and region: [`Table`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TableKind {
    /// Policy keys of one rule (`max_keys`).
    Keys,
    /// Regions of one policy key (`lease.max_regions`).
    Regions,
    /// Holders asking for one policy key in one region (`lease.max_holders`).
    Holders,
    /// Live allocations of one policy key in one region (`lease.max_allocations`).
    Allocations,
    /// Remembered Acquire and Decide answers, by (holder, request id).
    Requests,
    /// Remembered admin write answers, by request id.
    AdminRequests,
}

impl TableKind {
    /// Every table, in the order they are reported.
    pub const ALL: [TableKind; 6] = [
        TableKind::Keys,
        TableKind::Regions,
        TableKind::Holders,
        TableKind::Allocations,
        TableKind::Requests,
        TableKind::AdminRequests,
    ];

    /// The table's name in status (and in `ErrorDetail.table` for the tables that refuse).
    pub fn name(self) -> &'static str {
        match self {
            TableKind::Keys => "policy_keys",
            TableKind::Regions => "regions",
            TableKind::Holders => "holders",
            TableKind::Allocations => "allocations",
            TableKind::Requests => "requests",
            TableKind::AdminRequests => "admin_requests",
        }
    }
}

/// What happened to one table since this node started (node-local metrics: not in snapshots).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableCounters {
    /// Inserts refused because the table was full (RESOURCE_EXHAUSTED).
    pub refused: u64,
    /// Entries dropped to make room: idle keys evicted, remembered answers forgotten before
    /// their retention ended.
    pub evicted: u64,
}

/// One table's size and counters, for status and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableUsage {
    /// Which table.
    pub table: TableKind,
    /// Entries held now (for holders: asks held, fresh or not yet dropped).
    pub entries: u64,
    /// Its counters.
    pub counters: TableCounters,
}

/// Counters of every capped table, plus the eviction work done.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableStats {
    by_table: BTreeMap<TableKind, TableCounters>,
    /// Idle-index entries looked at by `make_room`, in total: at most [`EVICTION_PROBES`] per
    /// new key, whatever the number of keys.
    pub eviction_probes: u64,
}

impl TableStats {
    /// The counters of `t`.
    pub fn counters(&self, t: TableKind) -> TableCounters {
        self.by_table.get(&t).copied().unwrap_or_default()
    }

    pub(super) fn refused(&mut self, t: TableKind) {
        let c = self.by_table.entry(t).or_default();
        c.refused = c.refused.saturating_add(1);
    }

    pub(super) fn evicted(&mut self, t: TableKind) {
        let c = self.by_table.entry(t).or_default();
        c.evicted = c.evicted.saturating_add(1);
    }
}

/// Indexes derived from the ledger's keys (not in snapshots: rebuilt on restore from
/// `KeyState::idle_at_ms`, so a restored replica evicts exactly as one that never restarted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct KeyIndex {
    /// Keys per rule id.
    per_rule: BTreeMap<Name, u64>,
    /// Keys without a live allocation: (rule id, idle at ms, canonical key).
    idle: BTreeSet<(Name, u64, KeyBytes)>,
    /// Σ regions over keys.
    regions: u64,
    /// Σ asks over (key, region).
    asks: u64,
}

impl KeyIndex {
    /// The index of `keys` and `demands` as they are.
    pub(super) fn of(keys: &imbl::OrdMap<KeyId, Box<KeyState>>, asks: u64) -> KeyIndex {
        let mut ix = KeyIndex {
            asks,
            ..KeyIndex::default()
        };
        for (kid, ks) in keys {
            ix.inserted(kid, ks);
        }
        ix
    }

    fn inserted(&mut self, kid: &KeyId, ks: &KeyState) {
        *self.per_rule.entry(kid.0.clone()).or_default() += 1;
        self.regions = self.regions.saturating_add(ks.regions.len() as u64);
        if let Some(at) = ks.idle_at_ms {
            self.idle.insert((kid.0.clone(), at, kid.1.clone()));
        }
    }

    fn removed(&mut self, kid: &KeyId, ks: &KeyState) {
        if let Some(n) = self.per_rule.get_mut(&kid.0) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_rule.remove(&kid.0);
            }
        }
        self.regions = self.regions.saturating_sub(ks.regions.len() as u64);
        if let Some(at) = ks.idle_at_ms {
            self.idle.remove(&(kid.0.clone(), at, kid.1.clone()));
        }
    }

    /// Moves `kid`'s idle entry from `old` to `new`.
    fn refiled(&mut self, kid: &KeyId, old: Option<u64>, new: Option<u64>) {
        if old == new {
            return;
        }
        if let Some(at) = old {
            self.idle.remove(&(kid.0.clone(), at, kid.1.clone()));
        }
        if let Some(at) = new {
            self.idle.insert((kid.0.clone(), at, kid.1.clone()));
        }
    }

    /// Keys of rule `rule_id`.
    pub(super) fn count(&self, rule_id: &str) -> u64 {
        self.per_rule.get(rule_id).copied().unwrap_or(0)
    }

    /// The idle entry of `kid`, if any (a scan of its rule's entries: for a broken index only).
    fn first_of(&self, kid: &KeyId) -> Option<&(Name, u64, KeyBytes)> {
        self.idle
            .range((kid.0.clone(), 0, KeyBytes::default())..)
            .take_while(|(r, _, _)| *r == kid.0)
            .find(|(_, _, k)| *k == kid.1)
    }

    /// The key of `rule_id` that becomes idle first, with that time.
    fn first_idle(&self, rule_id: &str) -> Option<(u64, KeyBytes)> {
        let (r, at, key) = self
            .idle
            .range((Name::from(rule_id), 0, KeyBytes::default())..)
            .next()?;
        (*r == *rule_id).then(|| (*at, key.clone()))
    }

    /// Counts a region added to a key.
    pub(super) fn region_added(&mut self) {
        self.regions = self.regions.saturating_add(1);
    }

    /// Adjusts the number of asks held by `after - before`.
    pub(super) fn asks_changed(&mut self, before: usize, after: usize) {
        self.asks = self
            .asks
            .saturating_add(after as u64)
            .saturating_sub(before as u64);
    }
}

/// When `ks` becomes idle (see [`is_idle`]) if nothing touches it, Unix ms: `None` while it has
/// a live allocation, else the latest of the times its buckets are full again (from the
/// decision core's exact refill, rounded up to a whole ms) and the end of a calendar period it
/// used.
pub(super) fn idle_at(ks: &KeyState, rule: &Rule, now_ms: u64) -> Option<u64> {
    if ks.live > 0 || ks.regions.values().any(|r| r.live > 0) {
        return None;
    }
    let now_ns = millis_to_nanos(now_ms);
    let full_at = |b: &super::Bucket| {
        let mut st = b.state.clone();
        match b
            .params
            .check(&mut st, now_ns, b.params.capacity())
            .retry_after
        {
            RetryAfter::Now => now_ms,
            RetryAfter::After(ns) => now_ms.saturating_add(nanos_to_millis_ceil(ns)),
            RetryAfter::Never => u64::MAX,
        }
    };
    let mut at = full_at(&ks.global);
    for b in ks.regions.values().filter_map(|r| r.bucket.as_ref()) {
        at = at.max(full_at(b));
    }
    if let (Some((start, used)), Some(q)) = (ks.calendar, rule.quota) {
        if used > 0 && period_bounds(q.period, now_ms).0 == start {
            at = at.max(period_bounds(q.period, start).1);
        }
    }
    Some(at)
}

/// Whether a key holds nothing that evicting it would lose: no live allocation, full buckets,
/// and no calendar usage of the current period (usage of an ended period no longer limits
/// anything, issue 10 item 9).
pub(super) fn is_idle(ks: &KeyState, rule: &Rule, now_ns: u64) -> bool {
    let now_ms = now_ns / 1_000_000;
    let calendar_idle = |(start, used): (u64, u64)| {
        used == 0
            || rule
                .quota
                .is_none_or(|q| period_bounds(q.period, now_ms).0 != start)
    };
    let region_idle = |r: &RegionKeyState| {
        r.live == 0
            && r.bucket
                .as_ref()
                .is_none_or(|b| b.params.is_idle(&b.state, now_ns))
    };
    ks.live == 0
        && ks.calendar.is_none_or(calendar_idle)
        && ks.global.params.is_idle(&ks.global.state, now_ns)
        && ks.regions.values().all(region_idle)
}

/// The counted table of a refusal's table.
pub(super) fn kind_of(t: &Table) -> TableKind {
    match t {
        Table::PolicyKeys { .. } => TableKind::Keys,
        Table::Regions { .. } => TableKind::Regions,
        Table::Holders { .. } => TableKind::Holders,
        Table::Allocations { .. } => TableKind::Allocations,
    }
}

impl Ledger {
    /// Adds a new key's state (the caller made room) and indexes it.
    pub(super) fn insert_key(&mut self, kid: KeyId, ks: KeyState) {
        self.index.inserted(&kid, &ks);
        self.keys.insert(kid, Box::new(ks));
    }

    /// Files `kid` again in the idle index after its state changed at `now` (Unix ms).
    pub(super) fn reindex_key(&mut self, kid: &KeyId, now: u64) {
        let Some(rule) = self.rule_by_id(&kid.0).cloned() else {
            return;
        };
        let Some(ks) = self.keys.get_mut(kid) else {
            return;
        };
        let old = ks.idle_at_ms;
        ks.idle_at_ms = idle_at(ks, &rule, now);
        let new = ks.idle_at_ms;
        self.index.refiled(kid, old, new);
    }

    /// Makes room for one more key of `rule` at `now` (Unix ms): below the cap nothing happens;
    /// at the cap the key that became idle first is evicted, looking at no more than
    /// [`EVICTION_PROBES`] index entries.
    ///
    /// # Errors
    /// [`LedgerError::TableFull`] when no key of the rule is idle (counted; nothing evicted).
    pub(super) fn make_room(&mut self, rule: &Rule, now: u64) -> Result<(), LedgerError> {
        for _ in 0..EVICTION_PROBES {
            if self.index.count(&rule.id) < rule.max_keys {
                return Ok(());
            }
            let Some((at, key)) = self.index.first_idle(&rule.id) else {
                break;
            };
            self.stats.eviction_probes = self.stats.eviction_probes.saturating_add(1);
            if at > now {
                break;
            }
            let kid = (Name::from(rule.id.as_str()), key);
            if self.drop_if_idle(&kid, rule, now) {
                self.stats.evicted(TableKind::Keys);
            }
        }
        if self.index.count(&rule.id) < rule.max_keys {
            return Ok(());
        }
        self.stats.refused(TableKind::Keys);
        Err(LedgerError::TableFull {
            table: Table::PolicyKeys {
                policy: rule.name.clone(),
            },
            cap: rule.max_keys,
        })
    }

    /// Drops `kid` with its asks when it is idle at `now` (Unix ms) and returns true; else its
    /// idle entry went stale (the policy changed since it was filed) and is filed again at its
    /// time under the state as it is, never at or before now, so this command does not look at
    /// it again.
    fn drop_if_idle(&mut self, kid: &KeyId, rule: &Rule, now: u64) -> bool {
        let now_ns = millis_to_nanos(now);
        if self
            .keys
            .get(kid)
            .is_some_and(|ks| is_idle(ks, rule, now_ns))
        {
            self.drop_key(kid);
            return true;
        }
        let at = self
            .keys
            .get(kid)
            .and_then(|ks| idle_at(ks, rule, now))
            .map(|t| t.max(now.saturating_add(1)));
        if let Some(ks) = self.keys.get_mut(kid) {
            let old = std::mem::replace(&mut ks.idle_at_ms, at);
            self.index.refiled(kid, old, at);
            return false;
        }
        // An index entry without its key cannot be: drop it rather than look at it again.
        let orphan = self.index.first_of(kid).map(|e| e.1);
        if let Some(at) = orphan {
            self.index.idle.remove(&(kid.0.clone(), at, kid.1.clone()));
        }
        false
    }

    /// Drops a key with its asks: O(log keys + its regions).
    fn drop_key(&mut self, kid: &KeyId) {
        let Some(ks) = self.keys.remove(kid) else {
            return;
        };
        self.index.removed(kid, &ks);
        for region in ks.regions.keys() {
            if let Some(m) = self.demands.remove(&(kid.clone(), region.clone())) {
                self.index.asks_changed(m.len(), 0);
            }
        }
    }

    /// Forgets the keys idle for their retention ([`IDLE_KEY_RETENTION_MS`], or the rule's lease
    /// TTL plus drift when longer), oldest first, at most [`MAX_FORGOTTEN_PER_CHECK`]. Runs at
    /// the first command of each ledger second (`prev_ms` the ledger time before it, `now` its
    /// time): decided by ledger time alone, so every replica, restored from a snapshot or not,
    /// forgets the same keys at the same command. Forgetting loses nothing: an idle key is
    /// recreated at its next request exactly as it was (full buckets, nothing live); allocation
    /// ids are never reused and ended allocations are kept on their own terms, so fencing is
    /// unchanged.
    pub(super) fn forget_idle_keys(&mut self, prev_ms: u64, now: u64) {
        if now / 1_000 == prev_ms / 1_000 {
            return;
        }
        let mut budget = MAX_FORGOTTEN_PER_CHECK;
        let mut next_rule = self.index.idle.first().map(|(r, _, _)| r.clone());
        while let Some(rule_id) = next_rule.take() {
            if let Some(rule) = self.rule_by_id(&rule_id).cloned() {
                let keep = IDLE_KEY_RETENTION_MS.max(super::division::idle_after_ms(&rule));
                while budget > 0 {
                    let Some((at, key)) = self.index.first_idle(&rule_id) else {
                        break;
                    };
                    if at.saturating_add(keep) > now {
                        break;
                    }
                    budget -= 1;
                    self.drop_if_idle(&(rule_id.clone(), key), &rule, now);
                }
            }
            if budget == 0 {
                return;
            }
            // The next rule with idle entries: the first entry after every one of this rule.
            next_rule = self
                .index
                .idle
                .range((Name::from(format!("{rule_id}\0")), 0, KeyBytes::default())..)
                .next()
                .map(|(r, _, _)| r.clone());
        }
    }

    /// The refusal a request of `holder` in `region` for an existing key meets, checked before
    /// anything changes: the key's regions are at `lease.max_regions`, `lease.max_holders`
    /// holders asked in the region within the idle window, or (when it would make an
    /// allocation) the region's live allocations are at `lease.max_allocations`.
    pub(super) fn table_full(
        &self,
        kid: &KeyId,
        rule: &Rule,
        (region, holder): (&str, &str),
        allocates: bool,
        now: u64,
    ) -> Option<LedgerError> {
        let ks = self.keys.get(kid)?;
        let policy = rule.name.clone();
        if !ks.regions.contains_key(region) && ks.regions.len() as u64 >= rule.lease.max_regions {
            return Some(LedgerError::TableFull {
                table: Table::Regions { policy },
                cap: rule.lease.max_regions,
            });
        }
        let live = ks.regions.get(region).map_or(0, |r| r.live);
        if allocates && live >= rule.lease.max_allocations {
            let region = region.to_string();
            return Some(LedgerError::TableFull {
                table: Table::Allocations { policy, region },
                cap: rule.lease.max_allocations,
            });
        }
        let asks = self.demands.get(&(kid.clone(), Name::from(region)))?;
        let cap = rule.lease.max_holders;
        if asks.contains_key(holder) || (asks.len() as u64) < cap {
            return None;
        }
        let idle = super::division::idle_after_ms(rule);
        let fresh = asks
            .values()
            .filter(|x| x.at_ms.saturating_add(idle) > now)
            .count();
        let region = region.to_string();
        ((fresh as u64) >= cap).then_some(LedgerError::TableFull {
            table: Table::Holders { policy, region },
            cap,
        })
    }

    /// Every capped table's size and counters (node-local: counters restart at 0 with the
    /// process).
    pub fn tables(&self) -> Vec<TableUsage> {
        TableKind::ALL
            .iter()
            .map(|&t| TableUsage {
                table: t,
                entries: match t {
                    TableKind::Keys => self.keys.len() as u64,
                    TableKind::Regions => self.index.regions,
                    TableKind::Holders => self.index.asks,
                    TableKind::Allocations => self.deadlines.len() as u64,
                    TableKind::Requests => self.requests.len() as u64,
                    TableKind::AdminRequests => self.admin.len() as u64,
                },
                counters: self.stats.counters(t),
            })
            .collect()
    }

    /// The table counters and eviction work since this ledger was built or restored.
    pub fn table_stats(&self) -> &TableStats {
        &self.stats
    }
}
