//! The general decision path: any number of descriptors, decided all or nothing (design §10 "All or
//! nothing").
//!
//! [`Snapshot::decide_inner`] dispatches a one-descriptor request to the fast path in `single`
//! and everything else here. One attempt ([`Snapshot::try_decide`]) runs these phases in order,
//! each a function below: look every descriptor up ([`lookup`]), lock each distinct slot once
//! in address order ([`lock_in_order`]; a slot behind this config version is first moved to it
//! with nothing locked, [`Snapshot::advance_items`], and the attempt retried), total the costs
//! per slot ([`total_costs`]), check every local limit ([`check_slots`], [`local_verdict`]),
//! reserve or peek the leased ones ([`decide_leased`], [`cancel_leased`] on a denial), spend
//! all or nothing ([`settle_slots`]), and write the statuses ([`push_statuses`]).

use super::outcome::limited_status;
use super::single::decide_one;
use super::TABLE_FULL_RETRY_NS;
use super::{Code, DescriptorStatus, Outcome, Reason, Snapshot, SnapshotDomain};
use crate::algorithm::LimitParams;
use crate::cell::CellGuard;
use crate::config::{Rule, RuleLimit, Scope};
use crate::decision::{Decision, RetryAfter};
use crate::descriptor::{Request, RequestError, MAX_DESCRIPTORS};
use crate::global::{GlobalDecision, GlobalKey, GlobalLimits};
use crate::keyed::{Slot, SlotState};
use crate::units::{tokens_to_micros, Micros, Nanos};
use arrayvec::ArrayVec;
use std::sync::Arc;

/// Most lock attempts before a request gives up racing eviction (it then retries from lookup).
const MAX_RETRIES: usize = 8;

/// One value per descriptor (or per locked slot); never allocates.
type PerItem<T> = ArrayVec<T, MAX_DESCRIPTORS>;

/// The locked slots in address order: (slot address, first item using it, guard).
type Guards<'a> = PerItem<(usize, usize, CellGuard<'a, SlotState>)>;

/// What a descriptor of the request is decided by.
enum Target<'s> {
    NoRule,
    Unlimited(u32),
    Limited(Item<'s>),
    /// A `scope: global` rule decided by a [`GlobalLimits`] backend.
    Global(Item<'s>),
}

/// A limited descriptor: its rule, cost and (local rules only) key slot.
struct Item<'s> {
    rule: &'s Rule,
    rule_index: u32,
    cost: Micros,
    /// `None` for a leased descriptor, or a local one whose key table is full.
    slot: Option<Arc<Slot>>,
    params: LimitParams,
}

/// The request's verdict so far, over its enforced (non-shadow) descriptors.
struct Verdict {
    code: Code,
    retry: RetryAfter,
    awaiting_lease: bool,
}

impl Snapshot {
    /// Decides `req` at `now` with this config version, as [`Limiter::decide_with`] does with
    /// the current one: for a caller that keeps a snapshot together with state of its own
    /// built from it (an agent's lease tables), so both come from one load.
    ///
    /// [`Limiter::decide_with`]: super::Limiter::decide_with
    ///
    /// # Errors
    /// As [`Limiter::decide`](super::Limiter::decide).
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

    /// The dispatcher: the fast path for one descriptor, else (or when its slot was evicted
    /// under it) the general path.
    #[inline]
    pub(super) fn decide_inner<G: GlobalLimits>(
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
    pub(super) fn decide_general_in<G: GlobalLimits>(
        &self,
        dom: &SnapshotDomain,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Outcome {
        for _ in 0..MAX_RETRIES {
            if let Some(outcome) = self.try_decide(dom, req, now, statuses, global) {
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

    /// One attempt, phase by phase; `None` when a slot was evicted under us and the lookup
    /// must be redone (nothing was spent then).
    fn try_decide<G: GlobalLimits>(
        &self,
        dom: &SnapshotDomain,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Option<Outcome> {
        let items = self.lookup(dom, req, now, global.is_some());
        let mut guards = Guards::new();
        if !lock_in_order(&items, &mut guards) {
            return None;
        }
        if guards.iter().any(|(_, _, g)| g.version < self.version) {
            // A slot is still at an older config version: it moves under its shard's write
            // lock, which must not be waited for while holding a cell's lock (`keyed`).
            guards.clear();
            self.advance_items(dom, &items);
            return None;
        }
        let (totals, slot_of) = total_costs(&items, &guards);
        let mut decisions = check_slots(&mut guards, &totals, now);
        let mut verdict = local_verdict(&items, &slot_of, &decisions);
        let mut leased = decide_leased(req, &items, global, now, &mut verdict);
        if verdict.code == Code::OverLimit {
            cancel_leased(&items, &mut leased, global);
        }
        settle_slots(&mut guards, &mut decisions, &totals, verdict.code, now);
        // Unlock every slot; `clear` drops the guards in place (`drop(guards)` would first move
        // the whole ArrayVec, a memcpy of ~800 bytes per request).
        guards.clear();
        push_statuses(&items, &leased, &slot_of, &decisions, statuses);
        Some(Outcome {
            code: verdict.code,
            retry_after: if verdict.code == Code::Ok {
                RetryAfter::Now
            } else {
                verdict.retry
            },
            policy_version: self.version,
            awaiting_lease: verdict.awaiting_lease,
        })
    }

    /// Phase 1: each descriptor's rule, cost and (for a local limit) key slot, created if
    /// needed. A leased rule is a [`Target::Global`] only when a backend decides it.
    fn lookup<'s>(
        &self,
        dom: &'s SnapshotDomain,
        req: &Request<'_>,
        now: Nanos,
        has_global: bool,
    ) -> PerItem<Target<'s>> {
        let mut items = PerItem::new();
        for (i, d) in req.descriptors.iter().enumerate() {
            let entries = d.entries;
            let Some(ri) = dom.config.match_entries(entries) else {
                items.push(Target::NoRule);
                continue;
            };
            let rule = &dom.config.rules[ri];
            let RuleLimit::Limited { params, .. } = rule.limit else {
                items.push(Target::Unlimited(ri as u32));
                continue;
            };
            let mut item = Item {
                rule,
                rule_index: ri as u32,
                cost: tokens_to_micros(req.cost_tokens(i)),
                slot: None,
                params,
            };
            if has_global && rule.scope == Scope::Global {
                items.push(Target::Global(item));
                continue;
            }
            let table = &dom.tables[ri];
            // `None`: the key table is full (TableFull).
            item.slot = table
                .slot(entries, table.hash(entries), &params, self.version, now)
                .ok();
            items.push(Target::Limited(item));
        }
        items
    }

    /// Phase 2b, when a locked slot was behind this version: moves every slot of `items` to
    /// this version's parameters (nothing is locked then; the attempt is retried).
    fn advance_items(&self, dom: &SnapshotDomain, items: &[Target<'_>]) {
        for it in items {
            if let Target::Limited(
                it @ Item {
                    slot: Some(slot), ..
                },
            ) = it
            {
                dom.tables[it.rule_index as usize].advance(
                    slot,
                    &it.params,
                    self.version,
                    self.activated_at,
                );
            }
        }
    }
}

/// Phase 3: totals the cost of the descriptors sharing each locked slot; returns the totals per
/// guard and each item's guard.
fn total_costs(
    items: &[Target<'_>],
    guards: &Guards<'_>,
) -> (PerItem<Micros>, PerItem<Option<usize>>) {
    let mut totals: PerItem<Micros> = PerItem::new();
    totals.extend(std::iter::repeat_n(0, guards.len()));
    let mut slot_of = PerItem::new();
    for it in items {
        let g = match it {
            Target::Limited(it @ Item { slot: Some(s), .. }) => {
                let addr = Arc::as_ptr(s) as usize;
                let gi = guards.binary_search_by_key(&addr, |(a, _, _)| *a).ok();
                if let Some(gi) = gi {
                    totals[gi] = totals[gi].saturating_add(it.cost);
                }
                gi
            }
            _ => None,
        };
        slot_of.push(g);
    }
    (totals, slot_of)
}

/// Phase 2: locks each distinct slot once, in address order (no deadlock between requests).
/// `false` when a slot was evicted under us: the caller redoes the lookup.
fn lock_in_order<'a>(items: &'a [Target<'_>], guards: &mut Guards<'a>) -> bool {
    let mut order: PerItem<(usize, usize)> = PerItem::new();
    for (i, it) in items.iter().enumerate() {
        if let Target::Limited(Item { slot: Some(s), .. }) = it {
            order.push((Arc::as_ptr(s) as usize, i));
        }
    }
    order.sort_unstable();
    for &(addr, i) in &order {
        if guards.last().is_some_and(|(a, _, _)| *a == addr) {
            continue;
        }
        let Target::Limited(Item { slot: Some(s), .. }) = &items[i] else {
            continue;
        };
        let g = s.value.lock();
        if g.evicted {
            return false;
        }
        guards.push((addr, i, g));
    }
    true
}

/// Phase 4a: checks every locked slot's limit for its total cost, spending nothing.
fn check_slots(guards: &mut Guards<'_>, totals: &[Micros], now: Nanos) -> PerItem<Decision> {
    let mut decisions = PerItem::new();
    for (gi, (_, _, g)) in guards.iter_mut().enumerate() {
        let params = g.params;
        decisions.push(params.check(&mut g.state, now, totals[gi]));
    }
    decisions
}

/// Phase 4b: the verdict of the enforced local limits; a descriptor whose key table is full
/// denies, shadow rules never do.
fn local_verdict(
    items: &[Target<'_>],
    slot_of: &[Option<usize>],
    decisions: &[Decision],
) -> Verdict {
    let mut verdict = Verdict {
        code: Code::Ok,
        retry: RetryAfter::Now,
        awaiting_lease: false,
    };
    for (i, it) in items.iter().enumerate() {
        let Target::Limited(it) = it else { continue };
        if it.rule.shadow_mode {
            continue;
        }
        let (allowed, wait) = match slot_of[i] {
            Some(gi) => (decisions[gi].allowed, decisions[gi].retry_after),
            None => (false, RetryAfter::After(TABLE_FULL_RETRY_NS)),
        };
        verdict.retry = verdict.retry.max(wait);
        if !allowed {
            verdict.code = Code::OverLimit;
        }
    }
    verdict
}

/// Phase 5: leased descriptors reserve while every enforced limit so far allows, else only
/// peek; an enforced denial updates `verdict`. One entry per item (`None`: not leased).
fn decide_leased<G: GlobalLimits>(
    req: &Request<'_>,
    items: &[Target<'_>],
    global: Option<&G>,
    now: Nanos,
    verdict: &mut Verdict,
) -> PerItem<Option<GlobalDecision<G::Reservation>>> {
    let mut leased = PerItem::new();
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
        let r = if verdict.code == Code::Ok {
            g.reserve(key, it.cost, now)
        } else {
            g.peek(key, it.cost, now)
        };
        if !it.rule.shadow_mode {
            verdict.retry = verdict.retry.max(r.decision.retry_after);
            if !r.decision.allowed {
                verdict.code = Code::OverLimit;
                verdict.awaiting_lease |= r.cold;
            }
        }
        leased.push(Some(r));
    }
    leased
}

/// Phase 5, on a denial: cancels every leased reservation taken, so the request stays all or
/// nothing, and reports what each key still holds.
fn cancel_leased<G: GlobalLimits>(
    items: &[Target<'_>],
    leased: &mut [Option<GlobalDecision<G::Reservation>>],
    global: Option<&G>,
) {
    for (r, it) in leased.iter_mut().zip(items.iter()) {
        let (Some(r), Target::Global(it)) = (r, it) else {
            continue;
        };
        if let Some(res) = r.reservation.take() {
            if let Some(g) = global {
                g.cancel(res);
            }
            // Nothing was taken after all: report what the key still holds.
            r.decision.remaining_micros = r.decision.remaining_micros.saturating_add(it.cost);
        }
    }
}

/// Phase 6: spends every allowing slot's total when the request passes; otherwise spends
/// nothing and re-reads the unspent view of the limits that would have allowed. Shadow
/// would-be denials spend nothing either way.
fn settle_slots(
    guards: &mut Guards<'_>,
    decisions: &mut [Decision],
    totals: &[Micros],
    code: Code,
    now: Nanos,
) {
    for (gi, (_, _, g)) in guards.iter_mut().enumerate() {
        if !decisions[gi].allowed {
            continue;
        }
        let params = g.params;
        if code == Code::Ok {
            params.spend(&mut g.state, now, totals[gi]);
        } else {
            decisions[gi] = params.check(&mut g.state, now, 0);
        }
    }
}

/// Phase 7: one status per descriptor, in request order.
fn push_statuses<R>(
    items: &[Target<'_>],
    leased: &[Option<GlobalDecision<R>>],
    slot_of: &[Option<usize>],
    decisions: &[Decision],
    statuses: &mut Vec<DescriptorStatus>,
) {
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
        let mut status = limited_status(it.rule, it.rule_index, &it.params, decided);
        if leased[i]
            .as_ref()
            .is_some_and(|r| r.unreachable && !r.decision.allowed)
        {
            status.reason = Reason::AllocatorUnreachable;
        }
        statuses.push(status);
    }
}
