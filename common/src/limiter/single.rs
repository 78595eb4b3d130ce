//! The single-descriptor fast path: the same answer as the general path in `decide` (a property
//! test compares the two step by step), without its bookkeeping for several slots.

use super::outcome::limited_status;
use super::{Code, DescriptorStatus, Outcome, Reason, Snapshot, SnapshotDomain};
use crate::config::{RuleLimit, Scope};
use crate::decision::RetryAfter;
use crate::descriptor::Request;
use crate::global::{GlobalKey, GlobalLimits};
use crate::keyed::TableFull;
use crate::units::{tokens_to_micros, Nanos};

/// The decision of a request of exactly one descriptor: the same answer as the
/// general path (a property test compares the two), without its bookkeeping for several slots.
/// Its slot is lent under the shard's read lock (no reference count touched) and a leased
/// descriptor is committed, not reserved, since nothing can cancel it. `None` when the slot was
/// evicted under us (only possible for a slot created just now); the general path then retries.
#[inline]
pub(super) fn decide_one<G: GlobalLimits>(
    snap: &Snapshot,
    dom: &SnapshotDomain,
    req: &Request<'_>,
    now: Nanos,
    statuses: &mut Vec<DescriptorStatus>,
    global: Option<&G>,
) -> Option<Outcome> {
    let ok = Outcome::ok(snap.version);
    let entries = req.descriptors[0].entries;
    let Some(ri) = dom.config.match_entries(entries) else {
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
    let mut unreachable = false;
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
            unreachable = r.unreachable && !r.decision.allowed;
            Some(r.decision)
        }
        _ => {
            let table = &dom.tables[ri];
            let hash = table.hash(entries);
            let at = snap.activated_at;
            match table.decide(entries, hash, &params, snap.version, at, now, cost) {
                Ok(Some(d)) => Some(d),
                Ok(None) => return None,
                Err(TableFull { .. }) => None,
            }
        }
    };
    let mut status = limited_status(rule, ri as u32, &params, decided);
    if unreachable {
        status.reason = Reason::AllocatorUnreachable;
    }
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
