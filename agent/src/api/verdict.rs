//! The answers of the API facade: a decided request, a reservation, a settlement.

use super::pool::Pooled;
use crate::lease::Charged;
use allot_common::config::Rule;
use allot_common::limiter::{Code, DescriptorStatus, Outcome, Reason, Snapshot};
use allot_common::units::Nanos;
use allot_common::RetryAfter;
use std::sync::Arc;

/// A decided request: the core's outcome and per-descriptor statuses, with the config snapshot
/// to name the rules that decided.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Overall outcome.
    pub outcome: Outcome,
    /// One status per request descriptor, in order (a reused buffer).
    pub statuses: Pooled<Vec<DescriptorStatus>>,
    /// The config that decided (for rule names).
    pub snapshot: Arc<Snapshot>,
    /// The request's domain (a reused buffer).
    pub domain: Pooled<String>,
    /// What each admitted leased descriptor charged (kept for a reservation's settlement; empty
    /// for a plain check).
    pub charges: Vec<Charged>,
}

impl Verdict {
    /// Whether the request may proceed.
    pub fn is_ok(&self) -> bool {
        self.outcome.code == Code::Ok
    }

    /// The descriptor that decided: on OVER_LIMIT the enforced denial with the longest wait;
    /// otherwise the most restrictive limit (fewest tokens left, then the longest reset).
    /// `None` when no limit applied.
    pub fn deciding(&self) -> Option<usize> {
        let limited = self
            .statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.limit.is_some() || s.reason == Reason::ConcurrencyLimit);
        if self.is_ok() {
            limited
                .min_by(|(_, a), (_, b)| {
                    a.remaining
                        .cmp(&b.remaining)
                        .then(b.reset_after.cmp(&a.reset_after))
                })
                .map(|(i, _)| i)
        } else {
            limited
                .filter(|(_, s)| s.code == Code::OverLimit)
                .max_by(|(ia, a), (ib, b)| {
                    wait_order(a.retry_after)
                        .cmp(&wait_order(b.retry_after))
                        .then(ib.cmp(ia))
                })
                .map(|(i, _)| i)
        }
    }

    /// The rule of descriptor `i`, if one matched.
    pub fn rule(&self, i: usize) -> Option<&Rule> {
        let ri = self.statuses.get(i)?.rule_index?;
        self.snapshot
            .domain(&self.domain)?
            .config
            .rules
            .get(ri as usize)
    }

    /// `"<rule name>-v<policy version>"` of the deciding rule; `"-v<version>"` alone when no
    /// rule decided.
    pub fn policy_label(&self) -> String {
        let (name, version) = self.policy_label_parts();
        format!("{name}-v{version}")
    }

    /// The parts of [`policy_label`](Self::policy_label): the deciding rule's name ("" when none
    /// decided) and the config version.
    pub fn policy_label_parts(&self) -> (&str, u64) {
        let name = self
            .deciding()
            .and_then(|i| self.rule(i))
            .map_or("", |r| r.name.as_str());
        (name, self.outcome.policy_version)
    }

    /// On OVER_LIMIT: the wait until this request could pass, ns. `None` when OK, and when it
    /// can never pass (a cost above a limit's capacity): then no Retry-After is given, as in the
    /// decision core's answer.
    pub fn retry_after_ns(&self) -> Option<Nanos> {
        match (self.outcome.code, self.outcome.retry_after) {
            (Code::Ok, _) | (_, RetryAfter::Never) => None,
            (_, RetryAfter::After(ns)) => Some(ns),
            // `Now` cannot deny; answer the shortest wait if it ever did.
            (_, RetryAfter::Now) => Some(0),
        }
    }

    /// Whether the request is denied and can never pass (a cost above a limit's capacity): an
    /// OVER_LIMIT answer, never an error, so a gateway that lets requests through on errors
    /// (Envoy's default `failure_mode_deny: false`) still refuses it (issue 10 item 16).
    pub fn never_passes(&self) -> bool {
        self.outcome.code == Code::OverLimit && self.outcome.retry_after == RetryAfter::Never
    }

    /// Whether the request is denied only because a `scope: global` descriptor's failure mode
    /// denied while the allocator was unreachable (design §7): every descriptor over its limit
    /// is so. A gateway or client can tell it from a spent contract; it is still OVER_LIMIT.
    pub fn denied_unreachable(&self) -> bool {
        let mut over = self
            .statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit)
            .peekable();
        self.outcome.code == Code::OverLimit
            && over.peek().is_some()
            && over.all(|s| s.reason == Reason::AllocatorUnreachable)
    }
}

fn wait_order(r: RetryAfter) -> u128 {
    match r {
        RetryAfter::Now => 0,
        RetryAfter::After(n) => u128::from(n) + 1,
        RetryAfter::Never => u128::MAX,
    }
}

/// An admitted (or repeated) reservation.
#[derive(Debug, Clone)]
pub struct Reserved {
    /// Id to settle; empty when denied.
    pub reservation_id: String,
    /// The decision.
    pub verdict: Arc<Verdict>,
    /// Until it expires, ns (0 when denied or already settled).
    pub expires_in: Nanos,
}

/// A settlement's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Tokens given back per descriptor that spent the maximum.
    pub refunded: u64,
    /// The actual cost recorded (by the first settlement).
    pub actual_cost: u64,
    /// This repeats an earlier settlement.
    pub already_settled: bool,
}
