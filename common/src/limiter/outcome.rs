//! The answer types of a decision and how one limit's [`Decision`] becomes a descriptor's status.

use crate::algorithm::{AlgorithmKind, LimitParams};
use crate::config::{Rule, RuleLimit, Unit};
use crate::decision::{Decision, RetryAfter};
use crate::units::{Nanos, MICROS_PER_TOKEN, NANOS_PER_SEC};

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
    /// The rule's key table is full of active keys (memory bound, design §10 "Keys").
    KeyTableFull,
    /// Every concurrency slot of the key is taken (`max_in_flight`, design §10 "Concurrency"). Set
    /// by an agent, which holds the slots; the limiter itself never answers it.
    ConcurrencyLimit,
    /// Denied by the rule's failure mode (design §7): the agent could not reach the allocator
    /// for the key (`failure_mode: deny`; `emergency`: its reserve spent or its pace reached).
    /// Says nothing about the contract; set from an agent's lease answer.
    AllocatorUnreachable,
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
    pub(super) fn unlimited(reason: Reason, rule_index: Option<u32>) -> Self {
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

impl Outcome {
    /// OK with no wait, decided by config version `policy_version`.
    #[inline]
    pub(super) fn ok(policy_version: u64) -> Self {
        Outcome {
            code: Code::Ok,
            retry_after: RetryAfter::Now,
            policy_version,
            awaiting_lease: false,
        }
    }
}

/// The status of a limited descriptor of `rule` (index `rule_index`, parameters `params`):
/// from its decision, or, when `decided` is `None`, denied because the rule's key table is full.
pub(super) fn limited_status(
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
