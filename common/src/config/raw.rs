//! The envoyproxy/ratelimit YAML as written, before validation.
//!
//! Scalars that need a precise error (numbers, enums) are read loosely here and checked in
//! [`validate`](super::validate), so a bad value is reported with its field path and value rather
//! than as a type mismatch. Unknown fields are refused: a misspelt field must not be ignored.

use serde::Deserialize;

/// One config file: one domain.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDomain {
    pub domain: Option<Scalar>,
    #[serde(default)]
    pub descriptors: Vec<RawDescriptorNode>,
}

/// A node of the descriptor tree.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDescriptorNode {
    pub key: Option<Scalar>,
    pub value: Option<Scalar>,
    pub rate_limit: Option<RawRateLimit>,
    pub shadow_mode: Option<Scalar>,
    #[serde(default)]
    pub descriptors: Vec<RawDescriptorNode>,
    /// Envoy: emit per-value metrics. Accepted for compatibility; Allot's metrics stay bounded.
    #[allow(dead_code)]
    pub detailed_metric: Option<Scalar>,
    /// Envoy: include the value in the metric key. Accepted for compatibility, as above.
    #[allow(dead_code)]
    pub value_to_metric: Option<Scalar>,
}

/// `rate_limit` of a node, with Allot's additions.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRateLimit {
    pub unit: Option<Scalar>,
    pub unit_multiplier: Option<Scalar>,
    pub requests_per_unit: Option<Scalar>,
    pub algorithm: Option<Scalar>,
    pub burst: Option<Scalar>,
    pub unlimited: Option<Scalar>,
    pub name: Option<Scalar>,
    /// Envoy: names of limits this one replaces. Refused by the validator with a precise error.
    pub replaces: Option<Vec<RawReplaces>>,
    pub scope: Option<Scalar>,
    pub failure_mode: Option<Scalar>,
    pub max_keys: Option<Scalar>,
    pub max_in_flight: Option<Scalar>,
    pub fuse: Option<RawFuse>,
    pub quota: Option<RawQuota>,
    pub lease: Option<RawLease>,
    pub regions: Option<Vec<RawRegion>>,
    pub shares_mode: Option<Scalar>,
}

/// `rate_limit.quota`: a calendar budget the allocator's grants also draw from.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawQuota {
    pub limit: Option<Scalar>,
    pub period: Option<Scalar>,
}

/// `rate_limit.lease`: how the allocator leases a global limit.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLease {
    pub ttl_ms: Option<Scalar>,
    pub max_grant: Option<Scalar>,
    pub max_drift_ms: Option<Scalar>,
    pub max_regions: Option<Scalar>,
    pub max_holders: Option<Scalar>,
    pub max_allocations: Option<Scalar>,
}

/// `rate_limit.fuse`: a loose local bucket an agent checks before the lease path.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFuse {
    pub requests_per_unit: Option<Scalar>,
    pub burst: Option<Scalar>,
}

/// One entry of `rate_limit.regions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRegion {
    pub region: Option<Scalar>,
    pub share: Option<Scalar>,
    pub rate: Option<Scalar>,
}

/// An entry of Envoy's `replaces` list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawReplaces {
    pub name: Option<Scalar>,
}

/// Any YAML scalar, kept with its type so validation can say what was wrong with it.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum Scalar {
    Bool(bool),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Text(String),
}

impl Scalar {
    /// The value as the user would recognise it in an error message.
    pub fn shown(&self) -> String {
        match self {
            Scalar::Bool(b) => b.to_string(),
            Scalar::Unsigned(n) => n.to_string(),
            Scalar::Signed(n) => n.to_string(),
            Scalar::Float(f) => f.to_string(),
            Scalar::Text(s) => format!("{s:?}"),
        }
    }
}
