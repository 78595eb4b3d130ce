//! Policy documents, regional shares and the versioned handoff (design §5, design §10 "Config
//! versions").

use super::{
    KeyBytes, KeyId, Ledger, LedgerError, Name, PolicyDoc, PolicyKey, PolicyShares,
    RegionShareState, Response, Share, ShareSpec,
};
use allot_common::algorithm::AlgorithmKind;
use allot_common::config::{ConfigSet, DomainConfig, Rule, RuleLimit, Scope, PPM};
use allot_common::descriptor::{encode_key, Descriptor, Entry, Request};
use allot_common::units::{ppm_in, ppm_in_ceil, ppm_of, MICROS_PER_TOKEN};
use std::path::Path;

/// A policy key matched to its rule: the rule, the key id (rule id, canonical key) and the
/// policy document's version.
pub(super) type Resolved<'a> = (&'a Rule, KeyId, u64);

/// Parses and validates a policy document for the allocator: the decision core's validation, plus
/// the rule that sliding windows and logs cannot be leased (design §10 "Algorithms": a log is exact
/// only where it is decided in one place).
pub(super) fn parse(yaml: &str) -> Result<DomainConfig, String> {
    let d = ConfigSet::parse_domain(yaml, Path::new("policy")).map_err(|e| e.to_string())?;
    for r in &d.rules {
        if let RuleLimit::Limited { params, .. } = r.limit {
            let kind = params.kind();
            if r.scope == Scope::Global
                && matches!(
                    kind,
                    AlgorithmKind::SlidingWindow | AlgorithmKind::SlidingLog
                )
            {
                return Err(format!(
                    "limit {}: {kind} cannot be enforced with global scope (it is exact only where every decision is made in one place); use scope: local, or token_bucket, gcra or fixed_window",
                    r.name
                ));
            }
        }
    }
    Ok(d)
}

impl Ledger {
    pub(super) fn put_policy(&mut self, yaml: &str, expected: u64, now: u64) -> Response {
        let d = match parse(yaml) {
            Ok(d) => d,
            Err(reason) => {
                return Response::Rejected(LedgerError::BadInput {
                    field: "yaml".into(),
                    reason,
                })
            }
        };
        let current = self.policy_version(&d.domain);
        if current != expected {
            return Response::Rejected(LedgerError::PolicyVersionMismatch {
                domain: d.domain,
                expected,
                actual: current,
            });
        }
        for r in &d.rules {
            let clash = self
                .parsed
                .iter()
                .filter(|(dom, _)| **dom != d.domain)
                .flat_map(|(_, other)| other.rules.iter())
                .any(|o| o.name == r.name);
            if clash {
                return Response::Rejected(LedgerError::LimitNameTaken {
                    name: r.name.clone(),
                });
            }
        }
        for r in &d.rules {
            for sh in &r.regions {
                if let Err(e) = check_grantable(r, &sh.region, sh.share_ppm) {
                    return Response::Rejected(e);
                }
            }
        }
        let version = current + 1;
        for r in &d.rules {
            let targets: Vec<ShareSpec> = r
                .regions
                .iter()
                .map(|s| ShareSpec {
                    region: s.region.clone(),
                    share: Share::Ppm(s.share_ppm),
                })
                .collect();
            match self.shares.get(&r.id) {
                None => {
                    let mut ps = PolicyShares::default();
                    for s in &r.regions {
                        ps.regions.insert(
                            s.region.clone(),
                            RegionShareState {
                                target_ppm: s.share_ppm,
                            },
                        );
                    }
                    self.shares.insert(r.id.clone(), ps);
                }
                Some(ps) => {
                    let changed = r.regions.iter().any(|s| {
                        ps.regions.get(&s.region).map(|x| x.target_ppm) != Some(s.share_ppm)
                    });
                    if changed {
                        let next = ps.config_version + 1;
                        self.apply_shares(&r.id, r, &targets, next);
                    }
                }
            }
        }
        self.docs.insert(
            d.domain.clone(),
            PolicyDoc {
                yaml: yaml.to_string(),
                version,
                activated_at_ms: now,
            },
        );
        let domain = d.domain.clone();
        let rule_ids: Vec<String> = d.rules.iter().map(|r| r.id.clone()).collect();
        self.parsed.insert(domain.clone(), d);
        // A new document may change shares or the shares mode: every key re-divides.
        for id in rule_ids {
            self.rebalance_rule(&id, now);
        }
        Response::PolicyPut { domain, version }
    }

    /// The rule named `policy` (its `name`, or its id).
    fn rule_named(&self, policy: &str) -> Option<&Rule> {
        self.parsed
            .values()
            .flat_map(|d| d.rules.iter())
            .find(|r| r.name == policy || r.id == policy)
    }

    pub(super) fn set_shares(
        &mut self,
        policy: &str,
        shares: &[ShareSpec],
        version: u64,
        now: u64,
    ) -> Response {
        let Some(rule) = self.rule_named(policy).cloned() else {
            return Response::Rejected(LedgerError::UnknownPolicy {
                policy: policy.to_string(),
            });
        };
        let current = self.shares.get(&rule.id).map_or(0, |s| s.config_version);
        if version <= current {
            return Response::Rejected(LedgerError::SharesVersionNotNewer {
                policy: rule.name,
                current,
                got: version,
            });
        }
        if let Err(e) = self.check_shares(&rule, shares) {
            return Response::Rejected(e);
        }
        self.apply_shares(&rule.id, &rule, shares, version);
        self.rebalance_rule(&rule.id, now);
        Response::SharesSet {
            config_version: version,
        }
    }

    fn check_shares(&self, rule: &Rule, shares: &[ShareSpec]) -> Result<(), LedgerError> {
        let RuleLimit::Limited {
            requests_per_unit, ..
        } = rule.limit
        else {
            return Err(LedgerError::Unlimited {
                policy: rule.name.clone(),
            });
        };
        let mut total: u64 = 0;
        let mut seen = std::collections::BTreeSet::new();
        let current = self.shares.get(&rule.id);
        for s in shares {
            if s.region.is_empty() || s.region.len() > 256 {
                return Err(LedgerError::BadInput {
                    field: "region".into(),
                    reason: "a region name must be 1 to 256 bytes".into(),
                });
            }
            if !seen.insert(s.region.as_str()) {
                return Err(LedgerError::BadInput {
                    field: "shares".into(),
                    reason: format!("region {:?} is listed twice", s.region),
                });
            }
            let ppm = to_ppm(s.share, requests_per_unit).ok_or_else(|| LedgerError::BadInput {
                field: "shares".into(),
                reason: format!(
                    "share of {:?} is out of range (at most 100% or {requests_per_unit} per unit)",
                    s.region
                ),
            })?;
            check_grantable(rule, &s.region, ppm)?;
            total += u64::from(ppm);
        }
        if let Some(ps) = current {
            total += ps
                .regions
                .iter()
                .filter(|(r, _)| !seen.contains(r.as_str()))
                .map(|(_, s)| u64::from(s.target_ppm))
                .sum::<u64>();
        }
        if total > u64::from(PPM) {
            return Err(LedgerError::SharesOverfull {
                policy: rule.name.clone(),
                total_ppm: total,
            });
        }
        Ok(())
    }

    /// Records new targets (guarantees and weights, or caps): each key's parts move toward them
    /// through the versioned handoff when it is next rebalanced (see [`Self::rebalance_rule`]).
    fn apply_shares(&mut self, rule_id: &str, rule: &Rule, shares: &[ShareSpec], version: u64) {
        let rpu = match rule.limit {
            RuleLimit::Limited {
                requests_per_unit, ..
            } => requests_per_unit,
            RuleLimit::Unlimited => return,
        };
        let ps = self.shares.entry(rule_id.to_string()).or_default();
        ps.config_version = version;
        for s in shares {
            let Some(ppm) = to_ppm(s.share, rpu) else {
                continue;
            };
            ps.regions.entry(s.region.clone()).or_default().target_ppm = ppm;
        }
    }

    /// Re-divides every key of a rule (after its shares or its document changed). Lowered
    /// parts apply to new grants at once; what they free moves when the older allocations end.
    fn rebalance_rule(&mut self, rule_id: &str, now: u64) {
        let kids: Vec<KeyId> = self
            .keys
            .range((Name::from(rule_id), KeyBytes::default())..)
            .take_while(|((r, _), _)| *r == *rule_id)
            .map(|(k, _)| k.clone())
            .collect();
        for kid in kids {
            self.rebalance_key(&kid, now);
        }
    }

    /// The share `region` has of a rule: `None` when the rule has no regional shares (every
    /// region draws from the global bucket only).
    ///
    /// # Errors
    /// [`LedgerError::UnknownRegion`] when the rule has shares and `region` is not among them.
    pub(super) fn region_share(
        &self,
        rule_id: &str,
        region: &str,
    ) -> Result<Option<u32>, LedgerError> {
        let Some(ps) = self.shares.get(rule_id) else {
            return Ok(None);
        };
        if ps.regions.is_empty() {
            return Ok(None);
        }
        ps.regions
            .get(region)
            .map(|r| Some(r.target_ppm))
            .ok_or_else(|| LedgerError::UnknownRegion {
                policy: rule_id.to_string(),
                region: region.to_string(),
            })
    }

    /// Matches a policy key to its rule. Returns the rule, the key id and the doc version.
    pub(super) fn resolve(&self, key: &PolicyKey) -> Result<Resolved<'_>, LedgerError> {
        let entries: Vec<Entry<'_>> = key
            .entries
            .iter()
            .map(|(k, v)| Entry { key: k, value: v })
            .collect();
        let desc = [Descriptor {
            entries: &entries,
            hits_addend: None,
        }];
        Request {
            domain: &key.domain,
            descriptors: &desc,
            hits_addend: None,
        }
        .validate()
        .map_err(|e| LedgerError::BadInput {
            field: "key".into(),
            reason: e.to_string(),
        })?;
        let d = self
            .parsed
            .get(&key.domain)
            .ok_or_else(|| LedgerError::UnknownDomain {
                domain: key.domain.clone(),
            })?;
        let ri = d
            .match_entries(&entries)
            .ok_or_else(|| LedgerError::NoMatchingLimit {
                domain: key.domain.clone(),
            })?;
        let rule = &d.rules[ri];
        Ok((
            rule,
            (
                Name::from(rule.id.as_str()),
                KeyBytes::from(encode_key(&entries).into_vec()),
            ),
            self.policy_version(&key.domain),
        ))
    }

    /// When the policy document of `domain` took effect, Unix ms.
    pub(super) fn activated_at(&self, domain: &str) -> u64 {
        self.docs.get(domain).map_or(0, |d| d.activated_at_ms)
    }
}

/// A share in parts per million; `None` when out of range.
/// Refuses a non-zero region share whose part of the limit's capacity is below one whole token
/// (issue 10 item 10): agents spend whole tokens, so such a region could never be granted
/// anything, and its holders would ask again every millisecond for as long as they had traffic.
/// A share of 0 (nothing for the region) is always accepted.
///
/// # Errors
/// [`LedgerError::NeverGrantable`] naming the region, its share and the smallest share that
/// holds one token.
fn check_grantable(rule: &Rule, region: &str, ppm: u32) -> Result<(), LedgerError> {
    let RuleLimit::Limited { params, .. } = rule.limit else {
        return Ok(());
    };
    let capacity = params.capacity();
    if ppm == 0 || ppm_of(capacity, ppm) >= MICROS_PER_TOKEN {
        return Ok(());
    }
    Err(LedgerError::NeverGrantable {
        policy: rule.name.clone(),
        region: region.to_string(),
        share_ppm: ppm,
        // The smallest share whose part holds one whole token, rounded up to a whole ppm.
        least_ppm: ppm_in_ceil(MICROS_PER_TOKEN, capacity),
        capacity_tokens: capacity / MICROS_PER_TOKEN,
    })
}

fn to_ppm(s: Share, requests_per_unit: u64) -> Option<u32> {
    match s {
        Share::Ppm(p) if p <= PPM => Some(p),
        // r ≤ requests_per_unit, so the share is at most PPM and fits in u32.
        Share::Rate(r) if r <= requests_per_unit && requests_per_unit > 0 => {
            u32::try_from(ppm_in(r, requests_per_unit)).ok()
        }
        _ => None,
    }
}
