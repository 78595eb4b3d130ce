//! Settling a reservation: its unused cost goes back only to state it charged (seed §24; issue
//! 10 items 5 and 13).
//!
//! A leased descriptor is refunded into the allocation (or emergency bucket) its reservation
//! spent from, while that allocation is live, and nowhere else. A local descriptor is refunded
//! into its key's state only when the rule deciding it now is the rule that charged it, with an
//! algorithm of the same family: after a change of family the state is not the one charged.

use super::Verdict;
use crate::enforce::Enforcer;
use crate::lease::book::leased;
use allot_common::config::{Rule, RuleLimit};
use allot_common::descriptor::Request;
use allot_common::units::{Micros, Nanos};

/// Refunds the leased descriptors of the reservation answered by `verdict` into what they
/// charged, and returns what the local descriptors may still get back through the decision core
/// (`unused[i]` microtokens per descriptor of `req`, 0 where nothing may be refunded that way).
pub fn settle_charges(
    enforcer: &Enforcer,
    verdict: &Verdict,
    req: &Request<'_>,
    unused: &[Micros],
    now: Nanos,
) -> Vec<Micros> {
    let snapshot = enforcer.snapshot();
    let domain = snapshot.domain(req.domain);
    unused
        .iter()
        .enumerate()
        .map(|(i, &micros)| {
            if micros == 0 {
                return 0;
            }
            if let Some(c) = verdict.charges.iter().find(|c| c.descriptor == i) {
                c.refund(micros, now);
                return 0;
            }
            let (Some(charged), Some(d), Some(dom)) =
                (verdict.rule(i), req.descriptors.get(i), domain)
            else {
                return 0;
            };
            let current = dom
                .config
                .match_entries(d.entries)
                .and_then(|ri| dom.config.rules.get(ri));
            match current {
                Some(rule) if same_charge(charged, rule) => micros,
                _ => 0,
            }
        })
        .collect()
}

/// Whether a local refund for a spend under `charged` may go into the state `now` decides with:
/// the same rule and scope, with a limit of the same algorithm family (a change within a family
/// carries the charged state over; a change of family starts state that was never charged). A
/// leased rule never qualifies here: its charge is the allocation, which the reservation
/// recorded.
fn same_charge(charged: &Rule, now: &Rule) -> bool {
    let family = |r: &Rule| match r.limit {
        RuleLimit::Limited { params, .. } => Some(std::mem::discriminant(&params)),
        RuleLimit::Unlimited => None,
    };
    !leased(charged)
        && charged.id == now.id
        && charged.scope == now.scope
        && family(charged).is_some()
        && family(charged) == family(now)
}
