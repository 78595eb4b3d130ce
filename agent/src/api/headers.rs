//! The RateLimit response headers of a verdict, shared by the adapters.

use super::Verdict;
use allot_common::config::{Rule, RuleLimit};
use arrayvec::ArrayVec;

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
/// applied and the request is allowed. Each value is a decimal number: given as the number,
/// so that an adapter writes it where it goes without building a string (issue 13 item 5).
pub fn rate_limit_header_values(v: &Verdict) -> ArrayVec<(&'static str, u64), 4> {
    let mut out = ArrayVec::new();
    if let Some(i) = v.deciding() {
        if let (Some(s), Some((rpu, _, _))) = (v.statuses.get(i), v.rule(i).and_then(rule_limit)) {
            out.push(("RateLimit-Limit", rpu));
            out.push(("RateLimit-Remaining", s.remaining));
            out.push((
                "RateLimit-Reset",
                s.reset_after.div_ceil(allot_common::units::NANOS_PER_SEC),
            ));
        }
    }
    if let Some(ns) = v.retry_after_ns() {
        out.push((
            "retry-after",
            allot_common::units::nanos_to_retry_after_secs(ns),
        ));
    }
    out
}

/// [`rate_limit_header_values`] with the values as strings.
pub fn rate_limit_headers(v: &Verdict) -> Vec<(&'static str, String)> {
    rate_limit_header_values(v)
        .into_iter()
        .map(|(k, n)| (k, n.to_string()))
        .collect()
}
