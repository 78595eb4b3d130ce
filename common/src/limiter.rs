//! The keyed limiter: one decision function that the replay, the agent and any Rust gateway call.
//!
//! A request is decided all-or-nothing (seed §18): every descriptor is matched to its rule and
//! key, the keys' slots are locked in address order (no deadlock, no lock held by anyone else),
//! every limit is checked, and only when every enforced limit allows does anything spend. Shadow
//! rules (seed §29) are decided and counted exactly like enforced ones but never deny.
//! Config changes (seed §28) swap an immutable snapshot; per-key state of a rule whose key shape
//! is unchanged carries over and is transitioned lazily at the snapshot's activation time.

use crate::algorithm::{AlgorithmKind, LimitParams};
use crate::config::{ConfigSet, DomainConfig, Rule, RuleLimit, Scope, Unit};
use crate::decision::{Decision, RetryAfter};
use crate::descriptor::{Request, RequestError, MAX_DESCRIPTORS};
use crate::global::{GlobalDecision, GlobalKey, GlobalLimits};
use crate::keyed::{KeyTable, Slot, SlotState, TableFull};
use crate::name::NameIndex;
use crate::units::{tokens_to_micros, Micros, Nanos, MICROS_PER_TOKEN, NANOS_PER_SEC};
use arc_swap::ArcSwap;
use arrayvec::ArrayVec;
use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// How long a request denied because its rule's key table is full should wait.
pub const TABLE_FULL_RETRY_NS: Nanos = NANOS_PER_SEC;

/// Envoy's per-descriptor and overall code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// Within limits (or not limited).
    Ok,
    /// Over a limit.
    OverLimit,
}

/// Why a descriptor got its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No rule matches the descriptor: not limited.
    NoRule,
    /// The rule says `unlimited: true`.
    Unlimited,
    /// Within the limit.
    WithinLimit,
    /// Over the limit.
    OverLimit,
    /// The cost exceeds the limit's capacity: it can never pass.
    CostExceedsCapacity,
    /// The rule's key table is full of active keys (memory bound, seed §3).
    KeyTableFull,
    /// Every concurrency slot of the key is taken (`max_in_flight`, seed §25). Set by an agent,
    /// which holds the slots; the limiter itself never answers it.
    ConcurrencyLimit,
}

/// The limit that applied to a descriptor, as configured (Envoy's `current_limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitInfo {
    /// Index of the rule in its domain's [`DomainConfig::rules`] of the snapshot that decided.
    pub rule_index: u32,
    /// `requests_per_unit`.
    pub requests_per_unit: u64,
    /// `unit`.
    pub unit: Unit,
    /// `unit_multiplier`.
    pub unit_multiplier: u64,
    /// The algorithm.
    pub algorithm: AlgorithmKind,
    /// Capacity in whole tokens (burst for buckets, L for windows).
    pub capacity: u64,
}

/// One descriptor's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// OK or OVER_LIMIT. A shadow rule's would-be denial is OK with `shadow_over_limit`.
    pub code: Code,
    /// Why.
    pub reason: Reason,
    /// The limit, or `None` when no limit applies (no rule, or unlimited).
    pub limit: Option<LimitInfo>,
    /// Index of the matched rule even when unlimited; `None` when no rule matched.
    pub rule_index: Option<u32>,
    /// Whole tokens left after this request (floor); as before it when nothing was spent.
    pub remaining: u64,
    /// Nanoseconds until this limit fully resets.
    pub reset_after: Nanos,
    /// When this descriptor alone would let the request pass.
    pub retry_after: RetryAfter,
    /// A shadow rule would have denied.
    pub shadow_over_limit: bool,
    /// The rule is in shadow mode.
    pub shadow_mode: bool,
}

impl DescriptorStatus {
    fn unlimited(reason: Reason, rule_index: Option<u32>) -> Self {
        DescriptorStatus {
            code: Code::Ok,
            reason,
            limit: None,
            rule_index,
            remaining: 0,
            reset_after: 0,
            retry_after: RetryAfter::Now,
            shadow_over_limit: false,
            shadow_mode: false,
        }
    }
}

/// The whole request's answer; per-descriptor statuses go to the caller's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// OVER_LIMIT when any enforced descriptor is over its limit.
    pub code: Code,
    /// On OVER_LIMIT: the wait until this same request would pass with no other traffic
    /// (the longest of its descriptors' waits; [`RetryAfter::Never`] when it never can).
    /// [`RetryAfter::Now`] on OK.
    pub retry_after: RetryAfter,
    /// The config version that decided.
    pub policy_version: u64,
    /// An enforced leased descriptor was denied only because its key holds no allocation yet;
    /// an Acquire is under way. An agent may wait for it (bounded) and decide again.
    pub awaiting_lease: bool,
}

/// A domain of a snapshot with its rules' key tables.
#[derive(Debug)]
pub struct SnapshotDomain {
    /// The validated config.
    pub config: DomainConfig,
    tables: Vec<Arc<KeyTable>>,
}

impl SnapshotDomain {
    /// The key table of rule `i`.
    pub fn table(&self, i: usize) -> &Arc<KeyTable> {
        &self.tables[i]
    }
}

/// An immutable config version.
#[derive(Debug)]
pub struct Snapshot {
    /// Increases by one with every applied config, from 1.
    pub version: u64,
    /// When it took effect, in ns; state changes of this version start here.
    pub activated_at: Nanos,
    domains: NameIndex<SnapshotDomain>,
}

impl Snapshot {
    /// The domain named `name`.
    pub fn domain(&self, name: &str) -> Option<&SnapshotDomain> {
        self.domains.get(name)
    }

    /// All domains.
    pub fn domains(&self) -> impl Iterator<Item = &SnapshotDomain> {
        self.domains.values()
    }
}

/// The keyed limiter. Cheap to share (`Arc<Limiter>`); every method takes `&self`.
#[derive(Debug)]
pub struct Limiter {
    current: ArcSwap<Snapshot>,
    /// Key tables by rule id across versions; only touched when a config is applied.
    tables: Mutex<Map<String, Arc<KeyTable>>>,
}

enum Target<'s> {
    NoRule,
    Unlimited(u32),
    Limited(Item<'s>),
    /// A `scope: global` rule decided by a [`GlobalLimits`] backend.
    Global(Item<'s>),
}

struct Item<'s> {
    rule: &'s Rule,
    rule_index: u32,
    cost: Micros,
    slot: Option<Arc<Slot>>,
    params: LimitParams,
}

/// Most lock attempts before a request gives up racing eviction (it then retries from lookup).
const MAX_RETRIES: usize = 8;

impl Limiter {
    /// A limiter deciding with `config` from `now` on.
    pub fn new(config: ConfigSet, now: Nanos) -> Self {
        let l = Limiter {
            current: ArcSwap::from_pointee(Snapshot {
                version: 0,
                activated_at: now,
                domains: NameIndex::default(),
            }),
            tables: Mutex::new(Map::default()),
        };
        l.apply(config, now);
        l
    }

    /// Makes `config` the current version at `now`; returns its version number. State of rules
    /// with the same id (same key shape) carries over; other state is dropped.
    pub fn apply(&self, config: ConfigSet, now: Nanos) -> u64 {
        let mut tables = self.tables.lock();
        let old = self.current.load();
        let version = old.version + 1;
        let mut next: Map<String, Arc<KeyTable>> = Map::default();
        let mut domains = NameIndex::default();
        for d in config.domains() {
            let mut ts = Vec::with_capacity(d.rules.len());
            for r in &d.rules {
                let t = tables
                    .get(&r.id)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(KeyTable::new(r.max_keys)));
                t.set_max_keys(r.max_keys);
                if let RuleLimit::Limited { params, .. } = r.limit {
                    t.transition_all(&params, version, now);
                }
                next.insert(r.id.clone(), t.clone());
                ts.push(t);
            }
            domains.insert(
                &d.domain,
                SnapshotDomain {
                    config: d.clone(),
                    tables: ts,
                },
            );
        }
        *tables = next;
        self.current.store(Arc::new(Snapshot {
            version,
            activated_at: now,
            domains,
        }));
        version
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Decides `req` at `now`, writing one status per descriptor into `statuses` (cleared first;
    /// reuse the buffer and the hot path allocates nothing once every key exists).
    ///
    /// # Errors
    /// [`RequestError`] for an invalid request or unknown domain; nothing is spent then.
    pub fn decide(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
    ) -> Result<Outcome, RequestError> {
        self.decide_inner::<NoGlobal>(req, now, statuses, None)
    }

    /// As [`decide`](Self::decide), but descriptors whose rule has `scope: global` are decided
    /// by `global` (an agent's leased allocations) instead of local state. Their reservations
    /// are cancelled when any enforced descriptor denies, so the request stays all-or-nothing.
    ///
    /// # Errors
    /// As [`decide`](Self::decide).
    pub fn decide_with<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: &G,
    ) -> Result<Outcome, RequestError> {
        self.decide_inner(req, now, statuses, Some(global))
    }

    /// Gives back unused cost of an admitted request (seed §24: reserve the maximum, settle the
    /// actual): `unused[i]` microtokens to descriptor `i`'s limit, which was spent at `spent_at`.
    /// A bucket never rises above capacity; a window gets them back only while it is current.
    /// Leased descriptors are refunded through `global` when given.
    ///
    /// # Errors
    /// [`RequestError`] for an invalid request or unknown domain (nothing changes).
    pub fn refund<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        unused: &[Micros],
        spent_at: Nanos,
        now: Nanos,
        global: Option<&G>,
    ) -> Result<(), RequestError> {
        self.current
            .load()
            .refund(req, unused, spent_at, now, global)
    }

    fn decide_inner<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Result<Outcome, RequestError> {
        self.current.load().decide_inner(req, now, statuses, global)
    }
}

impl Snapshot {
    /// Decides `req` at `now` with this config version, as [`Limiter::decide_with`] does with
    /// the current one: for a caller that keeps a snapshot together with state of its own
    /// built from it (an agent's lease tables), so both come from one load.
    ///
    /// # Errors
    /// As [`Limiter::decide`].
    #[inline]
    pub fn decide_with<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: &G,
    ) -> Result<Outcome, RequestError> {
        self.decide_inner(req, now, statuses, Some(global))
    }

    /// Validates `req` and finds its domain.
    #[inline]
    fn domain_of(&self, req: &Request<'_>) -> Result<&SnapshotDomain, RequestError> {
        req.validate()?;
        self.domains
            .get(req.domain)
            .ok_or_else(|| RequestError::UnknownDomain(req.domain.to_string()))
    }

    /// [`Limiter::refund`] with this config version, for a caller that decided with
    /// [`decide_with`](Self::decide_with): gives back `unused[i]` microtokens to descriptor
    /// `i`'s limit, which was spent at `spent_at` (seed §24). A bucket never rises above
    /// capacity; a window gets them back only while it is current. Leased descriptors are
    /// refunded through `global` when given.
    ///
    /// # Errors
    /// [`RequestError`] for an invalid request or unknown domain (nothing changes).
    pub fn refund<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        unused: &[Micros],
        spent_at: Nanos,
        now: Nanos,
        global: Option<&G>,
    ) -> Result<(), RequestError> {
        let dom = self.domain_of(req)?;
        for (i, d) in req.descriptors.iter().enumerate() {
            let micros = unused.get(i).copied().unwrap_or(0);
            if micros == 0 {
                continue;
            }
            let Some(ri) = dom
                .config
                .match_rule(d.entries.iter().map(|e| (e.key, e.value)))
            else {
                continue;
            };
            let rule = &dom.config.rules[ri];
            let RuleLimit::Limited { params, .. } = rule.limit else {
                continue;
            };
            match global {
                Some(g) if rule.scope == Scope::Global => g.refund(
                    GlobalKey {
                        domain: req.domain,
                        rule,
                        rule_index: ri as u32,
                        entries: d.entries,
                    },
                    micros,
                    now,
                ),
                _ => {
                    let table = &dom.tables[ri];
                    let hash = table.hash(d.entries);
                    if let Ok(slot) = table.slot(d.entries, hash, &params, self.version, now) {
                        let mut g = slot.value.lock();
                        if !g.evicted {
                            let p = g.params;
                            p.refund(&mut g.state, now, micros, spent_at);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn decide_inner<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Result<Outcome, RequestError> {
        let dom = self.domain_of(req)?;
        statuses.clear();
        if req.descriptors.len() == 1 {
            if let Some(outcome) = decide_one(self, dom, req, now, statuses, global) {
                return Ok(outcome);
            }
            statuses.clear();
        }
        Ok(self.decide_general_in(dom, req, now, statuses, global))
    }

    /// Any number of descriptors: lock every slot, check every limit, spend all or nothing;
    /// retries when eviction raced the lookup.
    fn decide_general_in<G: GlobalLimits>(
        &self,
        dom: &SnapshotDomain,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Outcome {
        for _ in 0..MAX_RETRIES {
            if let Some(outcome) = Self::try_decide(self, dom, req, now, statuses, global) {
                return outcome;
            }
            statuses.clear();
        }
        // Eviction raced us every time (a table at its cap churning): deny conservatively.
        for _ in req.descriptors {
            let mut s = DescriptorStatus::unlimited(Reason::KeyTableFull, None);
            s.code = Code::OverLimit;
            s.retry_after = RetryAfter::After(TABLE_FULL_RETRY_NS);
            statuses.push(s);
        }
        Outcome {
            code: Code::OverLimit,
            retry_after: RetryAfter::After(TABLE_FULL_RETRY_NS),
            policy_version: self.version,
            awaiting_lease: false,
        }
    }

    /// One attempt; `None` when a slot was evicted under us and the lookup must be redone.
    fn try_decide<G: GlobalLimits>(
        snap: &Snapshot,
        dom: &SnapshotDomain,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Option<Outcome> {
        let mut items: ArrayVec<Target<'_>, MAX_DESCRIPTORS> = ArrayVec::new();
        for (i, d) in req.descriptors.iter().enumerate() {
            let entries = d.entries;
            let matched = dom
                .config
                .match_rule(entries.iter().map(|e| (e.key, e.value)));
            let Some(ri) = matched else {
                items.push(Target::NoRule);
                continue;
            };
            let rule = &dom.config.rules[ri];
            let RuleLimit::Limited { params, .. } = rule.limit else {
                items.push(Target::Unlimited(ri as u32));
                continue;
            };
            if global.is_some() && rule.scope == Scope::Global {
                items.push(Target::Global(Item {
                    rule,
                    rule_index: ri as u32,
                    cost: tokens_to_micros(req.cost_tokens(i)),
                    slot: None,
                    params,
                }));
                continue;
            }
            let table = &dom.tables[ri];
            // `None`: the key table is full (TableFull).
            let slot = table
                .slot(entries, table.hash(entries), &params, snap.version, now)
                .ok();
            items.push(Target::Limited(Item {
                rule,
                rule_index: ri as u32,
                cost: tokens_to_micros(req.cost_tokens(i)),
                slot,
                params,
            }));
        }

        // Lock each distinct slot once, in address order.
        let mut order: ArrayVec<(usize, usize), MAX_DESCRIPTORS> = ArrayVec::new();
        for (i, it) in items.iter().enumerate() {
            if let Target::Limited(Item { slot: Some(s), .. }) = it {
                order.push((Arc::as_ptr(s) as usize, i));
            }
        }
        order.sort_unstable();
        // (slot address, first item using it, guard)
        let mut guards: ArrayVec<(usize, usize, MutexGuard<'_, SlotState>), MAX_DESCRIPTORS> =
            ArrayVec::new();
        for &(addr, i) in &order {
            if guards.last().is_some_and(|(a, _, _)| *a == addr) {
                continue;
            }
            let Target::Limited(Item { slot: Some(s), .. }) = &items[i] else {
                continue;
            };
            let g = s.value.lock();
            if g.evicted {
                return None;
            }
            guards.push((addr, i, g));
        }
        let guard_of = |addr: usize| guards.binary_search_by_key(&addr, |(a, _, _)| *a).ok();

        // Transition state to this version's parameters and total the cost per slot.
        let mut totals: ArrayVec<Micros, MAX_DESCRIPTORS> = ArrayVec::new();
        totals.extend(std::iter::repeat_n(0, guards.len()));
        let mut slot_of: ArrayVec<Option<usize>, MAX_DESCRIPTORS> = ArrayVec::new();
        for it in items.iter() {
            let g = match it {
                Target::Limited(it @ Item { slot: Some(s), .. }) => {
                    let gi = guard_of(Arc::as_ptr(s) as usize);
                    if let Some(gi) = gi {
                        totals[gi] = totals[gi].saturating_add(it.cost);
                    }
                    gi
                }
                _ => None,
            };
            slot_of.push(g);
        }
        for (_, first, g) in guards.iter_mut() {
            let Target::Limited(it) = &items[*first] else {
                continue;
            };
            g.advance(&it.params, snap.version, snap.activated_at);
        }

        // Check every limit.
        let mut decisions: ArrayVec<Decision, MAX_DESCRIPTORS> = ArrayVec::new();
        for (gi, (_, _, g)) in guards.iter_mut().enumerate() {
            let params = g.params;
            decisions.push(params.check(&mut g.state, now, totals[gi]));
        }
        let mut code = Code::Ok;
        let mut retry = RetryAfter::Now;
        for (i, it) in items.iter().enumerate() {
            let Target::Limited(it) = it else { continue };
            if it.rule.shadow_mode {
                continue;
            }
            let (allowed, wait) = match slot_of[i] {
                Some(gi) => (decisions[gi].allowed, decisions[gi].retry_after),
                None => (false, RetryAfter::After(TABLE_FULL_RETRY_NS)),
            };
            retry = retry.max(wait);
            if !allowed {
                code = Code::OverLimit;
            }
        }

        // Leased descriptors: reserve while every enforced limit so far allows, else only peek.
        let mut leased: ArrayVec<Option<GlobalDecision<G::Reservation>>, MAX_DESCRIPTORS> =
            ArrayVec::new();
        let mut awaiting_lease = false;
        for (i, it) in items.iter().enumerate() {
            let (Target::Global(it), Some(g)) = (it, global) else {
                leased.push(None);
                continue;
            };
            let key = GlobalKey {
                domain: req.domain,
                rule: it.rule,
                rule_index: it.rule_index,
                entries: req.descriptors[i].entries,
            };
            let r = if code == Code::Ok {
                g.reserve(key, it.cost, now)
            } else {
                g.peek(key, it.cost, now)
            };
            if !it.rule.shadow_mode {
                retry = retry.max(r.decision.retry_after);
                if !r.decision.allowed {
                    code = Code::OverLimit;
                    awaiting_lease |= r.cold;
                }
            }
            leased.push(Some(r));
        }
        if code == Code::OverLimit {
            for (r, it) in leased.iter_mut().zip(items.iter()) {
                let (Some(r), Target::Global(it)) = (r, it) else {
                    continue;
                };
                if let Some(res) = r.reservation.take() {
                    if let Some(g) = global {
                        g.cancel(res);
                    }
                    // Nothing was taken after all: report what the key still holds.
                    r.decision.remaining_micros =
                        r.decision.remaining_micros.saturating_add(it.cost);
                }
            }
        }

        // Spend all or nothing; shadow would-be denials spend nothing either way.
        if code == Code::Ok {
            for (gi, (_, _, g)) in guards.iter_mut().enumerate() {
                if decisions[gi].allowed {
                    let params = g.params;
                    params.spend(&mut g.state, now, totals[gi]);
                }
            }
        } else {
            // Nothing was spent: report the unspent view of the limits that would have allowed.
            for (gi, (_, _, g)) in guards.iter_mut().enumerate() {
                if decisions[gi].allowed {
                    let params = g.params;
                    decisions[gi] = params.check(&mut g.state, now, 0);
                }
            }
        }
        // Unlock every slot; `clear` drops the guards in place (`drop(guards)` would first move
        // the whole ArrayVec, a memcpy of ~800 bytes per request).
        guards.clear();

        for (i, it) in items.iter().enumerate() {
            let it = match it {
                Target::NoRule => {
                    statuses.push(DescriptorStatus::unlimited(Reason::NoRule, None));
                    continue;
                }
                Target::Unlimited(ri) => {
                    statuses.push(DescriptorStatus::unlimited(Reason::Unlimited, Some(*ri)));
                    continue;
                }
                Target::Limited(it) | Target::Global(it) => it,
            };
            let decided = match (&leased[i], slot_of[i]) {
                (Some(r), _) => Some(r.decision),
                (None, Some(gi)) => Some(decisions[gi]),
                (None, None) => None,
            };
            let status = limited_status(it.rule, it.rule_index, &it.params, decided);
            statuses.push(status);
        }
        Some(Outcome {
            code,
            retry_after: if code == Code::Ok {
                RetryAfter::Now
            } else {
                retry
            },
            policy_version: snap.version,
            awaiting_lease,
        })
    }
}

/// [`Limiter::decide_inner`] for a request of exactly one descriptor: the same answer as the
/// general path (a property test compares the two), without its bookkeeping for several slots.
/// Its slot is lent under the shard's read lock (no reference count touched) and a leased
/// descriptor is committed, not reserved, since nothing can cancel it. `None` when the slot was
/// evicted under us (only possible for a slot created just now); the general path then retries.
#[inline]
fn decide_one<G: GlobalLimits>(
    snap: &Snapshot,
    dom: &SnapshotDomain,
    req: &Request<'_>,
    now: Nanos,
    statuses: &mut Vec<DescriptorStatus>,
    global: Option<&G>,
) -> Option<Outcome> {
    let ok = Outcome {
        code: Code::Ok,
        retry_after: RetryAfter::Now,
        policy_version: snap.version,
        awaiting_lease: false,
    };
    let entries = req.descriptors[0].entries;
    let Some(ri) = dom
        .config
        .match_rule(entries.iter().map(|e| (e.key, e.value)))
    else {
        statuses.push(DescriptorStatus::unlimited(Reason::NoRule, None));
        return Some(ok);
    };
    let rule = &dom.config.rules[ri];
    let RuleLimit::Limited { params, .. } = rule.limit else {
        statuses.push(DescriptorStatus::unlimited(
            Reason::Unlimited,
            Some(ri as u32),
        ));
        return Some(ok);
    };
    let cost = tokens_to_micros(req.cost_tokens(0));
    let mut awaiting_lease = false;
    let decided = match global {
        Some(g) if rule.scope == Scope::Global => {
            let key = GlobalKey {
                domain: req.domain,
                rule,
                rule_index: ri as u32,
                entries,
            };
            let r = g.commit(key, cost, now);
            awaiting_lease = r.cold && !r.decision.allowed;
            Some(r.decision)
        }
        _ => {
            let table = &dom.tables[ri];
            let hash = table.hash(entries);
            let decided = table.with_slot(entries, hash, &params, snap.version, now, |slot| {
                let mut g = slot.value.lock();
                if g.evicted {
                    return None;
                }
                // The slot's parameters after the move to this version (or a newer one's).
                let p = g.advance(&params, snap.version, snap.activated_at);
                let d = p.check(&mut g.state, now, cost);
                if d.allowed {
                    p.spend(&mut g.state, now, cost);
                }
                Some(d)
            });
            match decided {
                Ok(Some(d)) => Some(d),
                Ok(None) => return None,
                Err(TableFull { .. }) => None,
            }
        }
    };
    let status = limited_status(rule, ri as u32, &params, decided);
    statuses.push(status);
    if rule.shadow_mode || status.code == Code::Ok {
        return Some(ok);
    }
    Some(Outcome {
        code: Code::OverLimit,
        retry_after: status.retry_after.max(RetryAfter::Now),
        policy_version: snap.version,
        awaiting_lease: awaiting_lease && !rule.shadow_mode,
    })
}

/// The status of a limited descriptor of `rule` (index `rule_index`, parameters `params`):
/// from its decision, or, when `decided` is `None`, denied because the rule's key table is full.
fn limited_status(
    rule: &Rule,
    rule_index: u32,
    params: &LimitParams,
    decided: Option<Decision>,
) -> DescriptorStatus {
    let (requests_per_unit, unit, unit_multiplier) = match rule.limit {
        RuleLimit::Limited {
            requests_per_unit,
            unit,
            unit_multiplier,
            ..
        } => (requests_per_unit, unit, unit_multiplier),
        // Callers pass limited rules only; an unlimited one has no limit to report.
        RuleLimit::Unlimited => {
            return DescriptorStatus::unlimited(Reason::Unlimited, Some(rule_index))
        }
    };
    let info = LimitInfo {
        rule_index,
        requests_per_unit,
        unit,
        unit_multiplier,
        algorithm: params.kind(),
        capacity: params.capacity() / MICROS_PER_TOKEN,
    };
    let shadow = rule.shadow_mode;
    match decided {
        Some(dec) => {
            let reason = match (dec.allowed, dec.retry_after) {
                (true, _) => Reason::WithinLimit,
                (false, RetryAfter::Never) => Reason::CostExceedsCapacity,
                (false, _) => Reason::OverLimit,
            };
            DescriptorStatus {
                code: if dec.allowed || shadow {
                    Code::Ok
                } else {
                    Code::OverLimit
                },
                reason,
                limit: Some(info),
                rule_index: Some(rule_index),
                remaining: dec.remaining_tokens(),
                reset_after: dec.reset_after,
                retry_after: dec.retry_after,
                shadow_over_limit: shadow && !dec.allowed,
                shadow_mode: shadow,
            }
        }
        None => DescriptorStatus {
            code: if shadow { Code::Ok } else { Code::OverLimit },
            reason: Reason::KeyTableFull,
            limit: Some(info),
            rule_index: Some(rule_index),
            remaining: 0,
            reset_after: 0,
            retry_after: RetryAfter::After(TABLE_FULL_RETRY_NS),
            shadow_over_limit: shadow,
            shadow_mode: shadow,
        },
    }
}

/// The backend of [`Limiter::decide`]: no rule is leased, so it is never called.
struct NoGlobal;

impl GlobalLimits for NoGlobal {
    type Reservation = ();

    fn reserve(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) -> GlobalDecision<()> {
        unreachable_global()
    }

    fn peek(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) -> GlobalDecision<()> {
        unreachable_global()
    }

    fn cancel(&self, _: ()) {}

    fn refund(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) {}
}

/// `decide` passes no backend, so no item is ever `Target::Global` there; deny if that changes.
#[cold]
fn unreachable_global() -> GlobalDecision<()> {
    GlobalDecision {
        decision: Decision {
            allowed: false,
            remaining_micros: 0,
            reset_after: 0,
            retry_after: RetryAfter::After(TABLE_FULL_RETRY_NS),
        },
        reservation: None,
        cold: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{Descriptor, Entry};
    use crate::units::MICROS_PER_TOKEN;
    use proptest::prelude::*;
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::path::Path;

    const POLICY: &str = "domain: p
descriptors:
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 3, burst: 5, scope: local}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 2, burst: 3, algorithm: gcra, scope: local}
  - key: fw
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: fixed_window, scope: local}
  - key: sw
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: sliding_window, scope: local}
  - key: sl
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_log, scope: local}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1, burst: 2, scope: local}
  - key: few
    rate_limit: {unit: second, requests_per_unit: 1, burst: 1, max_keys: 2, scope: local}
  - key: free
    rate_limit: {unlimited: true}
  - key: global
    rate_limit: {unit: second, requests_per_unit: 1, burst: 4}
  - key: gshadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1, burst: 4}
";

    /// A leased backend that holds a fixed number of microtokens per key (never refilled).
    #[derive(Default)]
    struct FakeGlobal {
        left: RefCell<HashMap<String, Micros>>,
    }

    impl FakeGlobal {
        fn decide(
            &self,
            key: GlobalKey<'_>,
            cost: Micros,
            take: bool,
        ) -> GlobalDecision<(String, Micros)> {
            let name = format!("{}={}", key.entries[0].key, key.entries[0].value);
            let mut left = self.left.borrow_mut();
            let l = left.entry(name.clone()).or_insert(3 * MICROS_PER_TOKEN);
            let allowed = *l >= cost;
            if allowed && take {
                *l -= cost;
            }
            GlobalDecision {
                decision: Decision {
                    allowed,
                    remaining_micros: *l,
                    reset_after: 7,
                    retry_after: if allowed {
                        RetryAfter::Now
                    } else {
                        RetryAfter::After(11)
                    },
                },
                reservation: (allowed && take).then_some((name, cost)),
                cold: !allowed,
            }
        }
    }

    impl GlobalLimits for FakeGlobal {
        type Reservation = (String, Micros);
        fn reserve(
            &self,
            key: GlobalKey<'_>,
            cost: Micros,
            _: Nanos,
        ) -> GlobalDecision<Self::Reservation> {
            self.decide(key, cost, true)
        }
        fn peek(
            &self,
            key: GlobalKey<'_>,
            cost: Micros,
            _: Nanos,
        ) -> GlobalDecision<Self::Reservation> {
            self.decide(key, cost, false)
        }
        fn cancel(&self, (name, cost): Self::Reservation) {
            *self.left.borrow_mut().get_mut(&name).expect("reserved") += cost;
        }
        fn refund(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) {}
    }

    /// The general path alone, for the tests that hold [`decide_one`] to it.
    fn general_path<G: GlobalLimits>(
        snap: &Snapshot,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Result<Outcome, RequestError> {
        let dom = snap.domain_of(req)?;
        statuses.clear();
        Ok(snap.decide_general_in(dom, req, now, statuses, global))
    }

    fn config(burst: u32) -> ConfigSet {
        let yaml = format!(
            "domain: p\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 1, burst: {burst}}}\n"
        );
        ConfigSet::from_yaml(&yaml, Path::new("p.yaml")).expect("valid")
    }

    /// A decision that loaded the snapshot before a config change (as one in flight does)
    /// decides with the newer parameters the key already moved to; it never moves the key
    /// back, which would undo a lowered burst and then raise it again.
    #[test]
    fn a_stale_snapshot_never_moves_a_key_back() {
        let l = Limiter::new(config(10), 0);
        let entries = [Entry {
            key: "k",
            value: "a",
        }];
        let descriptors = [Descriptor {
            entries: &entries,
            hits_addend: None,
        }];
        let req = Request {
            domain: "p",
            descriptors: &descriptors,
            hits_addend: None,
        };
        let mut st = Vec::new();
        // The key exists: 10 - 1 = 9 left.
        assert_eq!(l.decide(&req, 0, &mut st).unwrap().code, Code::Ok);
        let old = l.snapshot();
        // Burst lowered to 5 at t = 1 µs: the key is clamped to 5; every decision below, with
        // the old snapshot or the new, spends from those 5.
        l.apply(config(5), 1_000);
        for (snap, left) in [(&old, 4), (&l.snapshot(), 2)] {
            let o = general_path(snap, &req, 1_000, &mut st, None::<&NoGlobal>).unwrap();
            assert_eq!((o.code, st[0].remaining), (Code::Ok, left));
            let o = snap
                .decide_inner(&req, 1_000, &mut st, None::<&NoGlobal>)
                .unwrap();
            assert_eq!((o.code, st[0].remaining), (Code::Ok, left - 1));
        }
    }

    const KEYS: [&str; 11] = [
        "tb", "gcra", "fw", "sw", "sl", "shadow", "few", "free", "global", "gshadow", "none",
    ];

    proptest! {
        /// The single-descriptor path answers exactly as the general path does, step by step,
        /// for every algorithm, shadow mode, a full key table, unlimited and unmatched rules,
        /// and leased descriptors, with costs from 0 to beyond capacity.
        #[test]
        fn single_descriptor_path_equals_the_general_path(
            ops in proptest::collection::vec((0..KEYS.len(), 0..4usize, 0u64..7, 0u64..700_000_000), 1..60),
        ) {
            let config = || ConfigSet::from_yaml(POLICY, Path::new("p.yaml")).expect("valid");
            let (fast, general) = (Limiter::new(config(), 0), Limiter::new(config(), 0));
            let (gf, gg) = (FakeGlobal::default(), FakeGlobal::default());
            let values = ["a", "b", "c", "d"];
            let (mut sf, mut sg) = (Vec::new(), Vec::new());
            let mut now = 0;
            for (k, v, cost, dt) in ops {
                now += dt;
                let entries = [Entry { key: KEYS[k], value: values[v] }];
                let descriptors = [Descriptor { entries: &entries, hits_addend: Some(cost) }];
                let req = Request { domain: "p", descriptors: &descriptors, hits_addend: None };
                let a = fast.decide_with(&req, now, &mut sf, &gf);
                let b = general_path(&general.snapshot(), &req, now, &mut sg, Some(&gg));
                prop_assert_eq!(a, b);
                prop_assert_eq!(&sf, &sg);
            }
            // Only the two leased rules reached the backend.
            prop_assert!(gf.left.borrow().keys().all(|k| k.starts_with("global=") || k.starts_with("gshadow=")));
        }
    }
}
