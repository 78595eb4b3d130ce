//! The RateLimit response headers of a verdict, shared by the adapters.

use super::Verdict;
use allot_common::config::{Rule, RuleLimit};

/// The configured limit of `rule` as Envoy names it: (requests_per_unit, unit).
pub fn rule_limit(rule: &Rule) -> Option<(u64, allot_common::config::Unit, u64)> {
    match rule.limit {
        RuleLimit::Limited {
            requests_per_unit,
            unit,
            unit_multiplier,
            ..
        } => Some((requests_per_unit, unit, unit_multiplier)),
        RuleLimit::Unlimited => None,
    }
}

/// Nanoseconds → milliseconds rounded up: the units conversion, under the name the API uses.
pub use allot_common::units::nanos_to_millis_ceil as ms_ceil;

/// The RateLimit response headers (draft-ietf-httpapi-ratelimit-headers) for a verdict, from
/// its deciding descriptor: `RateLimit-Limit` (requests per unit), `RateLimit-Remaining` (whole
/// tokens left), `RateLimit-Reset` (seconds until the limit is fully reset, rounded up); plus
/// `Retry-After` (whole seconds, rounded up, at least 1) on OVER_LIMIT. Empty when no limit
/// applied and the request is allowed.
pub fn rate_limit_headers(v: &Verdict) -> Vec<(&'static str, String)> {
    let mut out = Vec::with_capacity(4);
    if let Some(i) = v.deciding() {
        if let (Some(s), Some((rpu, _, _))) = (v.statuses.get(i), v.rule(i).and_then(rule_limit)) {
            out.push(("RateLimit-Limit", rpu.to_string()));
            out.push(("RateLimit-Remaining", s.remaining.to_string()));
            out.push((
                "RateLimit-Reset",
                s.reset_after
                    .div_ceil(allot_common::units::NANOS_PER_SEC)
                    .to_string(),
            ));
        }
    }
    if let Some(ns) = v.retry_after_ns() {
        out.push((
            "retry-after",
            allot_common::units::nanos_to_retry_after_secs(ns).to_string(),
        ));
    }
    out
}
