//! Raw YAML → validated [`DomainConfig`], with a precise error for every bad value.

use super::raw::{RawDescriptorNode, RawDomain, RawRateLimit, RawRegion, Scalar};
use super::{
    CalendarPeriod, CalendarQuota, Children, ConfigError, DomainConfig, FailureMode, Node,
    RegionShare, Rule, RuleLease, RuleLimit, Scope, SharesMode, Unit, DEFAULT_MAX_ALLOCATIONS,
    DEFAULT_MAX_HOLDERS, DEFAULT_MAX_KEYS, DEFAULT_MAX_REGIONS, MAX_SLIDING_LOG_LIMIT,
    MAX_TABLE_CAP, PPM,
};
use crate::algorithm::{AlgorithmKind, LimitParams};
use crate::descriptor::MAX_PART_BYTES;
use crate::units::{ppm_in, tokens_to_micros, MAX_PERIOD_NS, MAX_TOKENS, MICROS_PER_TOKEN};
use std::path::Path;

/// Deepest descriptor nesting accepted (a request descriptor has at most this many entries).
const MAX_DEPTH: usize = crate::descriptor::MAX_ENTRIES;

struct Ctx<'a> {
    file: &'a Path,
}

impl Ctx<'_> {
    fn invalid(
        &self,
        path: &str,
        value: Option<&Scalar>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_path_buf(),
            path: path.to_string(),
            value: value.map_or_else(|| "<missing>".to_string(), Scalar::shown),
            message: message.into(),
        }
    }

    fn text<'s>(&self, path: &str, v: Option<&'s Scalar>) -> Result<Option<&'s str>, ConfigError> {
        match v {
            None => Ok(None),
            Some(Scalar::Text(s)) => {
                if s.is_empty() {
                    Err(self.invalid(path, v, "must not be empty"))
                } else if s.len() > MAX_PART_BYTES {
                    Err(self.invalid(path, v, format!("longer than {MAX_PART_BYTES} bytes")))
                } else {
                    Ok(Some(s))
                }
            }
            // YAML reads `value: 200` as a number; Envoy compares it as the text "200".
            Some(other @ (Scalar::Unsigned(_) | Scalar::Signed(_))) => {
                let _ = other;
                Err(self.invalid(path, v, "must be a string (quote numbers: \"200\")"))
            }
            Some(_) => Err(self.invalid(path, v, "must be a string")),
        }
    }

    fn boolean(&self, path: &str, v: Option<&Scalar>) -> Result<Option<bool>, ConfigError> {
        match v {
            None => Ok(None),
            Some(Scalar::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.invalid(path, v, "must be true or false")),
        }
    }

    fn positive(
        &self,
        path: &str,
        v: Option<&Scalar>,
        max: u64,
    ) -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(Scalar::Unsigned(n)) if *n >= 1 && *n <= max => Ok(Some(*n)),
            Some(Scalar::Unsigned(_) | Scalar::Signed(_)) => {
                Err(self.invalid(path, v, format!("must be a whole number from 1 to {max}")))
            }
            Some(_) => Err(self.invalid(path, v, "must be a positive whole number")),
        }
    }
}

/// The parser's message on one line ("line L column C: what"): its first line without the
/// parser's own "error: " prefix. The source snippet it appends (several lines naming
/// `<input>`) would break line-based logs, and the file is named by the caller.
fn parser_message(full: &str) -> String {
    let first = full.lines().next().unwrap_or(full).trim();
    first.strip_prefix("error: ").unwrap_or(first).to_string()
}

/// Parses and validates one domain file.
pub(crate) fn domain(text: &str, file: &Path) -> Result<DomainConfig, ConfigError> {
    let raw: RawDomain = serde_saphyr::from_str(text).map_err(|e| ConfigError::Syntax {
        file: file.to_path_buf(),
        message: parser_message(&e.to_string()),
    })?;
    let cx = Ctx { file };
    let domain = cx
        .text("domain", raw.domain.as_ref())?
        .ok_or_else(|| cx.invalid("domain", None, "is required"))?
        .to_string();
    let mut out = DomainConfig {
        domain: domain.clone(),
        source: file.to_path_buf(),
        rules: Vec::new(),
        nodes: vec![Node::default()],
    };
    let id = escape(&domain);
    descriptors(&cx, &mut out, 0, &raw.descriptors, "descriptors", &id, 1)?;
    Ok(out)
}

/// Escapes `|` and `=` so the rule id stays unambiguous whatever the keys contain.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace('=', "\\=")
}

fn descriptors(
    cx: &Ctx<'_>,
    out: &mut DomainConfig,
    parent: usize,
    list: &[RawDescriptorNode],
    path: &str,
    id_prefix: &str,
    depth: usize,
) -> Result<(), ConfigError> {
    for (i, d) in list.iter().enumerate() {
        let here = format!("{path}[{i}]");
        if depth > MAX_DEPTH {
            return Err(cx.invalid(
                &here,
                None,
                format!("descriptors nest deeper than {MAX_DEPTH} levels"),
            ));
        }
        let key = cx
            .text(&format!("{here}.key"), d.key.as_ref())?
            .ok_or_else(|| cx.invalid(&format!("{here}.key"), None, "is required"))?;
        let value = cx.text(&format!("{here}.value"), d.value.as_ref())?;
        let id = match value {
            Some(v) => format!("{id_prefix}|{}={}", escape(key), escape(v)),
            None => format!("{id_prefix}|{}", escape(key)),
        };
        let node = out.nodes.len();
        let children: &mut Children = out.nodes[parent]
            .children
            .get_or_insert_with(key, Children::default);
        let slot = match value {
            Some(v) => children.by_value.get_or_insert_with(v, || usize::MAX),
            None => children.any.get_or_insert(usize::MAX),
        };
        if *slot != usize::MAX {
            return Err(cx.invalid(
                &format!("{here}.key"),
                d.key.as_ref(),
                format!(
                    "duplicates a sibling descriptor with the same key and {}",
                    value.map_or("no value".to_string(), |v| format!("value {v:?}"))
                ),
            ));
        }
        *slot = node;
        out.nodes.push(Node::default());
        let shadow = cx
            .boolean(&format!("{here}.shadow_mode"), d.shadow_mode.as_ref())?
            .unwrap_or(false);
        if let Some(rl) = &d.rate_limit {
            let rule = rule(cx, rl, &format!("{here}.rate_limit"), &id, shadow)?;
            out.nodes[node].rule = Some(out.rules.len());
            out.rules.push(rule);
        } else if d.shadow_mode.is_some() && d.descriptors.is_empty() {
            return Err(cx.invalid(
                &format!("{here}.shadow_mode"),
                d.shadow_mode.as_ref(),
                "is set on a descriptor without rate_limit",
            ));
        }
        descriptors(
            cx,
            out,
            node,
            &d.descriptors,
            &format!("{here}.descriptors"),
            &id,
            depth + 1,
        )?;
    }
    Ok(())
}

/// Envoy's `replaces` (a limit that removes named limits from a request's decision) is refused
/// rather than parsed and ignored: every configured limit applies to every descriptor it
/// matches, so accepting it would silently enforce limits the operator meant to drop.
///
/// # Errors
/// [`ConfigError::Invalid`] at `path` when the list is present (even empty: it would be a no-op
/// that reads as if it did something).
fn refuse_replaces(cx: &Ctx<'_>, rl: &RawRateLimit, path: &str) -> Result<(), ConfigError> {
    let Some(list) = &rl.replaces else {
        return Ok(());
    };
    let names: Vec<String> = list
        .iter()
        .filter_map(|r| r.name.as_ref().map(Scalar::shown))
        .collect();
    Err(ConfigError::Invalid {
        file: cx.file.to_path_buf(),
        path: path.to_string(),
        value: format!("[{}]", names.join(", ")),
        message: "is not supported: every limit applies to each descriptor it matches; remove the \
                  replaced limits from the config instead"
            .to_string(),
    })
}

/// `path.field`, the location of a field of the rule at `path` in an error.
fn field(path: &str, name: &str) -> String {
    format!("{path}.{name}")
}

/// Validates one `rate_limit` at `path` into the rule `id`, phase by phase in the order its
/// fields are reported: the refused `replaces`, name, scope and failure mode, key caps, the
/// limit, fuse, quota, lease, regions and shares mode. The first bad field is the error.
///
/// # Errors
/// [`ConfigError::Invalid`] naming the file, the field's path, its value and what is expected.
fn rule(
    cx: &Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
    id: &str,
    shadow: bool,
) -> Result<Rule, ConfigError> {
    refuse_replaces(cx, rl, &field(path, "replaces"))?;
    let name = cx.text(&field(path, "name"), rl.name.as_ref())?;
    let name = name.map_or_else(|| id.to_string(), str::to_string);
    let (scope, failure_mode) = modes(cx, rl, path)?;
    let max_keys = cx
        .positive(&field(path, "max_keys"), rl.max_keys.as_ref(), 1 << 32)?
        .unwrap_or(DEFAULT_MAX_KEYS);
    let max_in_flight = cx.positive(
        &field(path, "max_in_flight"),
        rl.max_in_flight.as_ref(),
        1 << 32,
    )?;
    let limit = rule_limit(cx, rl, path)?;
    let fuse = fuse(cx, rl, path, &limit)?;
    let quota = quota(cx, rl, path)?;
    let lease = lease(cx, rl, path, &limit)?;
    let regions = regions(cx, rl, path, &limit)?;
    if regions.len() as u64 > lease.max_regions {
        return Err(cx.invalid(
            &format!("{}.max_regions", field(path, "lease")),
            rl.lease.as_ref().and_then(|l| l.max_regions.as_ref()),
            format!("must be at least the {} configured regions", regions.len()),
        ));
    }
    let shares_mode = shares_mode(cx, rl, path)?;
    Ok(Rule {
        shares_mode,
        max_in_flight,
        fuse,
        quota,
        lease,
        regions,
        id: id.to_string(),
        name,
        limit,
        shadow_mode: shadow,
        scope,
        failure_mode,
        max_keys,
        source: cx.file.to_path_buf(),
    })
}

/// `scope` (default global) and `failure_mode` (default deny).
fn modes(cx: &Ctx<'_>, rl: &RawRateLimit, path: &str) -> Result<(Scope, FailureMode), ConfigError> {
    let scope = match cx.text(&field(path, "scope"), rl.scope.as_ref())? {
        None | Some("global") => Scope::Global,
        Some("local") => Scope::Local,
        Some(_) => {
            return Err(cx.invalid(
                &field(path, "scope"),
                rl.scope.as_ref(),
                "must be global or local",
            ))
        }
    };
    let failure_mode = match cx.text(&field(path, "failure_mode"), rl.failure_mode.as_ref())? {
        None | Some("deny") => FailureMode::Deny,
        Some("emergency") => FailureMode::Emergency,
        Some(_) => {
            return Err(cx.invalid(
                &field(path, "failure_mode"),
                rl.failure_mode.as_ref(),
                "must be deny or emergency",
            ))
        }
    };
    Ok((scope, failure_mode))
}

/// `unlimited: true`, or the limit from unit, requests_per_unit, unit_multiplier, algorithm
/// and burst.
fn rule_limit(cx: &Ctx<'_>, rl: &RawRateLimit, path: &str) -> Result<RuleLimit, ConfigError> {
    let f = |name: &str| field(path, name);
    let unlimited = cx
        .boolean(&f("unlimited"), rl.unlimited.as_ref())?
        .unwrap_or(false);
    if unlimited {
        return Ok(RuleLimit::Unlimited);
    }
    let unit_text = cx
        .text(&f("unit"), rl.unit.as_ref())?
        .ok_or_else(|| cx.invalid(&f("unit"), None, "is required unless unlimited: true"))?;
    let unit = Unit::parse(unit_text).ok_or_else(|| {
        cx.invalid(
            &f("unit"),
            rl.unit.as_ref(),
            "must be one of second, minute, hour, day",
        )
    })?;
    let rpu = cx
        .positive(
            &f("requests_per_unit"),
            rl.requests_per_unit.as_ref(),
            MAX_TOKENS,
        )?
        .ok_or_else(|| cx.invalid(&f("requests_per_unit"), None, "is required"))?;
    let max_mult = MAX_PERIOD_NS / unit.nanos();
    let mult = cx
        .positive(&f("unit_multiplier"), rl.unit_multiplier.as_ref(), max_mult)?
        .unwrap_or(1);
    let kind = algorithm(cx, rl, path)?;
    let burst = cx.positive(&f("burst"), rl.burst.as_ref(), MAX_TOKENS)?;
    if burst.is_some() && !kind.is_bucket() {
        return Err(cx.invalid(
            &f("burst"),
            rl.burst.as_ref(),
            format!("applies only to token_bucket and gcra, not {kind}"),
        ));
    }
    if kind == AlgorithmKind::SlidingLog && rpu > MAX_SLIDING_LOG_LIMIT {
        return Err(cx.invalid(
            &f("requests_per_unit"),
            rl.requests_per_unit.as_ref(),
            format!(
                "sliding_log keeps every event, so it is limited to {MAX_SLIDING_LOG_LIMIT} per window; use sliding_window for larger limits"
            ),
        ));
    }
    let params = LimitParams::new(kind, rpu, unit.nanos() * mult, burst)
        .map_err(|e| cx.invalid(path, None, e.to_string()))?;
    Ok(RuleLimit::Limited {
        params,
        requests_per_unit: rpu,
        unit,
        unit_multiplier: mult,
    })
}

/// `algorithm`, default token_bucket.
fn algorithm(cx: &Ctx<'_>, rl: &RawRateLimit, path: &str) -> Result<AlgorithmKind, ConfigError> {
    let at = field(path, "algorithm");
    match cx.text(&at, rl.algorithm.as_ref())? {
        None => Ok(AlgorithmKind::TokenBucket),
        Some(s) => AlgorithmKind::parse(s).ok_or_else(|| {
            cx.invalid(
                &at,
                rl.algorithm.as_ref(),
                "unknown algorithm; expected one of token_bucket, gcra, fixed_window, sliding_window, sliding_log",
            )
        }),
    }
}

/// The local `fuse`: a token bucket over the limit's period; only on a limited rule.
fn fuse(
    cx: &Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
    limit: &RuleLimit,
) -> Result<Option<LimitParams>, ConfigError> {
    let fp = field(path, "fuse");
    let period = match *limit {
        RuleLimit::Limited {
            unit,
            unit_multiplier,
            ..
        } => Some(unit.nanos() * unit_multiplier),
        RuleLimit::Unlimited => None,
    };
    let (fz, period) = match (&rl.fuse, period) {
        (None, _) => return Ok(None),
        (Some(_), None) => {
            return Err(cx.invalid(
                &fp,
                None,
                "needs a limited rate_limit (unit and requests_per_unit)",
            ))
        }
        (Some(fz), Some(period)) => (fz, period),
    };
    let rpu_at = format!("{fp}.requests_per_unit");
    let rpu = cx
        .positive(&rpu_at, fz.requests_per_unit.as_ref(), MAX_TOKENS)?
        .ok_or_else(|| cx.invalid(&rpu_at, None, "is required"))?;
    let burst = cx.positive(&format!("{fp}.burst"), fz.burst.as_ref(), MAX_TOKENS)?;
    LimitParams::new(AlgorithmKind::TokenBucket, rpu, period, burst)
        .map(Some)
        .map_err(|e| cx.invalid(&fp, None, e.to_string()))
}

/// The calendar `quota`: a limit in whole tokens per day or month.
fn quota(
    cx: &Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
) -> Result<Option<CalendarQuota>, ConfigError> {
    let Some(q) = &rl.quota else {
        return Ok(None);
    };
    let qp = field(path, "quota");
    let limit = cx
        .positive(&format!("{qp}.limit"), q.limit.as_ref(), MAX_TOKENS)?
        .ok_or_else(|| cx.invalid(&format!("{qp}.limit"), None, "is required"))?;
    let period = match cx.text(&format!("{qp}.period"), q.period.as_ref())? {
        Some("month") => CalendarPeriod::Month,
        Some("day") => CalendarPeriod::Day,
        Some(_) => {
            return Err(cx.invalid(
                &format!("{qp}.period"),
                q.period.as_ref(),
                "must be day or month",
            ))
        }
        None => return Err(cx.invalid(&format!("{qp}.period"), None, "is required")),
    };
    Ok(Some(CalendarQuota {
        limit: tokens_to_micros(limit),
        period,
    }))
}

/// The `lease` settings over their defaults (5 s TTL, a quarter of the capacity in whole
/// tokens and at least one per grant, 500 ms drift).
fn lease(
    cx: &Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
    limit: &RuleLimit,
) -> Result<RuleLease, ConfigError> {
    let capacity = match limit {
        RuleLimit::Limited { params, .. } => params.capacity(),
        RuleLimit::Unlimited => 0,
    };
    let mut lease = RuleLease {
        ttl_ms: 5_000,
        max_grant: (capacity / 4 / MICROS_PER_TOKEN * MICROS_PER_TOKEN).max(MICROS_PER_TOKEN),
        max_drift_ms: 500,
        max_regions: DEFAULT_MAX_REGIONS,
        max_holders: DEFAULT_MAX_HOLDERS,
        max_allocations: DEFAULT_MAX_ALLOCATIONS,
    };
    let Some(l) = &rl.lease else {
        return Ok(lease);
    };
    let lp = field(path, "lease");
    if let Some(v) = cx.positive(&format!("{lp}.ttl_ms"), l.ttl_ms.as_ref(), 86_400_000)? {
        lease.ttl_ms = v;
    }
    if let Some(v) = cx.positive(&format!("{lp}.max_grant"), l.max_grant.as_ref(), MAX_TOKENS)? {
        lease.max_grant = tokens_to_micros(v);
    }
    match l.max_drift_ms.as_ref() {
        Some(Scalar::Unsigned(v)) if *v <= 60_000 => lease.max_drift_ms = *v,
        None => {}
        other => {
            return Err(cx.invalid(
                &format!("{lp}.max_drift_ms"),
                other,
                "must be a whole number of milliseconds from 0 to 60000",
            ))
        }
    }
    let (regions, holders) = (l.max_regions.as_ref(), l.max_holders.as_ref());
    if let Some(v) = cx.positive(&format!("{lp}.max_regions"), regions, MAX_TABLE_CAP)? {
        lease.max_regions = v;
    }
    if let Some(v) = cx.positive(&format!("{lp}.max_holders"), holders, MAX_TABLE_CAP)? {
        lease.max_holders = v;
    }
    let allocations = l.max_allocations.as_ref();
    if let Some(v) = cx.positive(&format!("{lp}.max_allocations"), allocations, MAX_TABLE_CAP)? {
        lease.max_allocations = v;
    }
    Ok(lease)
}

/// The `regions` list: each region once, its share as a percentage or a rate, the shares
/// adding up to at most 100%.
fn regions(
    cx: &Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
    limit: &RuleLimit,
) -> Result<Vec<RegionShare>, ConfigError> {
    let rpu = match *limit {
        RuleLimit::Limited {
            requests_per_unit, ..
        } => requests_per_unit,
        RuleLimit::Unlimited => 0,
    };
    let mut regions: Vec<RegionShare> = Vec::new();
    let mut total_ppm: u64 = 0;
    for (i, r) in rl.regions.iter().flatten().enumerate() {
        let rp = format!("{}[{i}]", field(path, "regions"));
        let region = cx
            .text(&format!("{rp}.region"), r.region.as_ref())?
            .ok_or_else(|| cx.invalid(&format!("{rp}.region"), None, "is required"))?;
        if regions.iter().any(|x| x.region == region) {
            return Err(cx.invalid(
                &format!("{rp}.region"),
                r.region.as_ref(),
                "is listed twice",
            ));
        }
        let share_ppm = region_share_ppm(cx, r, &rp, rpu)?;
        total_ppm += u64::from(share_ppm);
        if total_ppm > u64::from(PPM) {
            // Tenths of a percent, rounded up: above 100.0 as the total is.
            let tenths = total_ppm.div_ceil(1_000);
            let (whole, tenth) = (tenths / 10, tenths % 10);
            return Err(cx.invalid(
                &rp,
                r.share.as_ref().or(r.rate.as_ref()),
                format!(
                    "region shares add up to more than 100%: {whole}.{tenth}% of the policy's \
                     {rpu} per unit with this region's share"
                ),
            ));
        }
        regions.push(RegionShare {
            region: region.to_string(),
            share_ppm,
        });
    }
    Ok(regions)
}

/// One region's share in ppm: exactly one of `share` (a percentage) or `rate` (requests per
/// unit, at most the rule's `rpu`, converted exactly and rounded down).
fn region_share_ppm(cx: &Ctx<'_>, r: &RawRegion, rp: &str, rpu: u64) -> Result<u32, ConfigError> {
    match (&r.share, &r.rate) {
        (Some(sh), None) => parse_percent(sh).ok_or_else(|| {
            cx.invalid(
                &format!("{rp}.share"),
                Some(sh),
                "must be a percentage from 0% to 100%, e.g. \"50%\" or \"12.5%\"",
            )
        }),
        (None, Some(rate)) => {
            if rpu == 0 {
                return Err(cx.invalid(
                    &format!("{rp}.rate"),
                    Some(rate),
                    "needs a limited rate_limit",
                ));
            }
            match rate {
                // v ≤ rpu, so the share is at most PPM and fits in u32.
                Scalar::Unsigned(v) if *v <= rpu => Ok(ppm_in(*v, rpu) as u32),
                _ => Err(cx.invalid(
                    &format!("{rp}.rate"),
                    Some(rate),
                    format!("must be a whole number of requests per unit from 0 to {rpu}"),
                )),
            }
        }
        _ => Err(cx.invalid(rp, None, "needs exactly one of share or rate")),
    }
}

/// `shares_mode`, default weighted.
fn shares_mode(cx: &Ctx<'_>, rl: &RawRateLimit, path: &str) -> Result<SharesMode, ConfigError> {
    match cx.text(&field(path, "shares_mode"), rl.shares_mode.as_ref())? {
        None | Some("weighted") => Ok(SharesMode::Weighted),
        Some("cap") => Ok(SharesMode::Cap),
        Some(_) => Err(cx.invalid(
            &field(path, "shares_mode"),
            rl.shares_mode.as_ref(),
            "must be weighted or cap",
        )),
    }
}

/// Parses `"50%"`, `"12.5%"` or `"0.0001%"` into parts per million, exactly (no floating point).
fn parse_percent(v: &Scalar) -> Option<u32> {
    let Scalar::Text(s) = v else { return None };
    let num = s.trim().strip_suffix('%')?.trim();
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || frac.len() > 4
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let int: u64 = int.parse().ok()?;
    let frac_ppm: u64 = if frac.is_empty() {
        0
    } else {
        frac.parse::<u64>().ok()? * 10u64.pow(4 - frac.len() as u32)
    };
    let ppm = int.checked_mul(10_000)?.checked_add(frac_ppm)?;
    (ppm <= u64::from(PPM)).then_some(ppm as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(yaml: &str) -> String {
        domain(yaml, Path::new("t.yaml")).unwrap_err().to_string()
    }

    #[test]
    fn replaces_is_refused_with_the_names_it_lists() {
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: other}]}\n");
        assert!(
            e.contains("t.yaml")
                && e.contains("descriptors[0].rate_limit.replaces")
                && e.contains("other")
                && e.contains("not supported"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: []}\n");
        assert!(e.contains("replaces"), "{e}");
    }

    /// A syntax error is one line naming the file, the line and the column.
    #[test]
    fn syntax_errors_are_one_line_with_line_and_column() {
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2\n");
        assert!(!e.contains('\n'), "{e}");
        assert!(e.starts_with("t.yaml: line 4 column"), "{e}");
    }

    /// Overfull regional shares name the total against the policy's rate, not only the last
    /// region's own rate (which read like a contradiction: "more than 100% (got 100)").
    #[test]
    fn overfull_region_shares_name_the_total() {
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 900, regions: [{region: a, rate: 500}, {region: b, rate: 400}, {region: c, rate: 100}]}\n");
        assert!(
            e.contains("rate_limit.regions[2]")
                && e.contains("111.2% of the policy's 900 per unit")
                && e.contains("(got 100)"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_file_field_and_value() {
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky_token}\n");
        assert!(
            e.contains("t.yaml")
                && e.contains("descriptors[0].rate_limit.algorithm")
                && e.contains("leaky_token"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 0}\n");
        assert!(
            e.contains("descriptors[0].rate_limit.burst") && e.contains("(got 0)"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -3}\n");
        assert!(e.contains("requests_per_unit") && e.contains("-3"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 3}\n");
        assert!(e.contains(".unit") && e.contains("fortnight"), "{e}");
        let e =
            err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 3}\n");
        assert!(e.contains(".unit") && e.contains("<missing>"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n");
        assert!(
            e.contains("requests_per_unit") && e.contains("required"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2.5}\n");
        assert!(e.contains("requests_per_unit") && e.contains("2.5"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 3, algorithm: fixed_window, burst: 4}\n");
        assert!(e.contains("burst") && e.contains("fixed_window"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 3, reqests: 4}\n");
        assert!(e.contains("t.yaml") && e.contains("reqests"), "{e}");
        let e = err("descriptors: []\n");
        assert!(e.contains("domain") && e.contains("required"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n  - key: k\n");
        assert!(
            e.contains("descriptors[1].key") && e.contains("duplicates"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    value: 200\n");
        assert!(
            e.contains("descriptors[0].value") && e.contains("200"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: ''\n");
        assert!(
            e.contains("descriptors[0].key") && e.contains("empty"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1000001, algorithm: sliding_log}\n");
        assert!(e.contains("sliding_log"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 1}\n");
        assert!(e.contains("unit_multiplier") && e.contains("1000"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, scope: regional}\n");
        assert!(e.contains("scope") && e.contains("regional"), "{e}");
    }

    #[test]
    fn lease_quota_and_regions_parse_exactly() {
        let d = domain(
            "domain: acme\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: second\n      requests_per_unit: 1000\n      burst: 40\n      quota: {limit: 20000000, period: month}\n      lease: {ttl_ms: 2000, max_grant: 20, max_drift_ms: 100}\n      regions:\n        - {region: eu-west, share: \"50%\"}\n        - {region: us-east, rate: 400}\n        - {region: ap-south, share: \"9.5%\"}\n",
            Path::new("t.yaml"),
        )
        .unwrap();
        let r = &d.rules[0];
        assert_eq!(
            r.quota,
            Some(CalendarQuota {
                limit: 20_000_000 * MICROS_PER_TOKEN,
                period: CalendarPeriod::Month
            })
        );
        assert_eq!(
            r.lease,
            RuleLease {
                ttl_ms: 2000,
                max_grant: 20 * MICROS_PER_TOKEN,
                max_drift_ms: 100,
                max_regions: DEFAULT_MAX_REGIONS,
                max_holders: DEFAULT_MAX_HOLDERS,
                max_allocations: DEFAULT_MAX_ALLOCATIONS,
            }
        );
        let shares: Vec<(&str, u32)> = r
            .regions
            .iter()
            .map(|x| (x.region.as_str(), x.share_ppm))
            .collect();
        assert_eq!(
            shares,
            vec![
                ("eu-west", 500_000),
                ("us-east", 400_000),
                ("ap-south", 95_000)
            ]
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, regions: [{region: a, share: \"60%\"}, {region: b, share: \"50%\"}]}\n");
        assert!(e.contains("regions[1]") && e.contains("100%"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, regions: [{region: a, share: \"half\"}]}\n");
        assert!(e.contains("regions[0].share") && e.contains("half"), "{e}");
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, quota: {limit: 5, period: year}}\n");
        assert!(e.contains("quota.period") && e.contains("year"), "{e}");
        // Table caps: explicit values, at least the configured regions, at most MAX_TABLE_CAP.
        let d = domain("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2, lease: {max_regions: 2, max_holders: 3, max_allocations: 5}}\n", Path::new("t.yaml")).unwrap();
        assert_eq!(d.rules[0].lease.max_allocations, 5);
        assert_eq!(
            (d.rules[0].lease.max_regions, d.rules[0].lease.max_holders),
            (2, 3)
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, lease: {max_regions: 1}, regions: [{region: a, share: \"50%\"}, {region: b, share: \"50%\"}]}\n");
        assert!(
            e.contains("lease.max_regions") && e.contains("2 configured regions"),
            "{e}"
        );
        let e = err("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, lease: {max_holders: 0}}\n");
        assert!(
            e.contains("lease.max_holders") && e.contains("65536"),
            "{e}"
        );
        // Default lease: a quarter of the capacity, whole tokens, at least one.
        let d = domain("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n", Path::new("t.yaml")).unwrap();
        assert_eq!(d.rules[0].lease.max_grant, MICROS_PER_TOKEN);
    }

    #[test]
    fn shares_mode_defaults_to_weighted_and_rejects_unknown_values() {
        let yaml = |mode: &str| {
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 10, {mode}regions: [{{region: a, share: \"60%\"}}]}}\n")
        };
        let d = domain(&yaml(""), Path::new("t.yaml")).unwrap();
        assert_eq!(d.rules[0].shares_mode, SharesMode::Weighted);
        let d = domain(&yaml("shares_mode: cap, "), Path::new("t.yaml")).unwrap();
        assert_eq!(d.rules[0].shares_mode, SharesMode::Cap);
        let d = domain(&yaml("shares_mode: weighted, "), Path::new("t.yaml")).unwrap();
        assert_eq!(d.rules[0].shares_mode, SharesMode::Weighted);
        let e = err(&yaml("shares_mode: hard, "));
        assert!(
            e.contains("shares_mode") && e.contains("hard") && e.contains("weighted or cap"),
            "{e}"
        );
        let e = err(&yaml("shares_mode: 1, "));
        assert!(e.contains("shares_mode"), "{e}");
    }

    #[test]
    fn matching_prefers_exact_value_and_requires_every_entry() {
        let d = domain(
            "domain: d\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 1}\n    descriptors:\n      - key: op\n        value: search\n        rate_limit: {unit: second, requests_per_unit: 2}\n      - key: op\n        rate_limit: {unit: second, requests_per_unit: 3}\n",
            Path::new("t.yaml"),
        )
        .unwrap();
        let rpu = |i: usize| match d.rules[i].limit {
            RuleLimit::Limited {
                requests_per_unit, ..
            } => requests_per_unit,
            RuleLimit::Unlimited => 0,
        };
        assert_eq!(d.match_rule([("tenant", "a")]).map(rpu), Some(1));
        assert_eq!(
            d.match_rule([("tenant", "a"), ("op", "search")]).map(rpu),
            Some(2)
        );
        assert_eq!(
            d.match_rule([("tenant", "a"), ("op", "list")]).map(rpu),
            Some(3)
        );
        assert_eq!(
            d.match_rule([("tenant", "a"), ("op", "list"), ("x", "y")]),
            None
        );
        assert_eq!(d.match_rule([("other", "a")]), None);
        assert_eq!(d.match_rule(std::iter::empty()), None);
        assert_eq!(d.rules[1].id, "d|tenant|op=search");
    }

    /// `match_entries` (the decision path's walk over the entries in line, with its shortcut
    /// for keys without valued children) answers as `match_rule` does, for every combination
    /// of up to three entries drawn from keys and values the tree has and has not.
    #[test]
    fn match_entries_answers_as_match_rule() {
        use crate::descriptor::Entry;
        let d = domain(
            "domain: d
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: op
        value: search
        rate_limit: {unit: second, requests_per_unit: 2}
      - key: op
        rate_limit: {unit: second, requests_per_unit: 3}
      - key: plan
        value: gold
        descriptors:
          - key: region
            rate_limit: {unit: second, requests_per_unit: 4}
  - key: ip
    value: 10.0.0.1
    rate_limit: {unit: second, requests_per_unit: 5}
",
            Path::new("t.yaml"),
        )
        .unwrap();
        let parts = [
            ("tenant", "a"),
            ("op", "search"),
            ("op", "list"),
            ("plan", "gold"),
            ("plan", "free"),
            ("region", "eu"),
            ("ip", "10.0.0.1"),
            ("ip", "10.0.0.2"),
            ("x", "y"),
        ];
        let mut walks: Vec<Vec<(&str, &str)>> = vec![vec![]];
        for _ in 0..3 {
            let longer: Vec<_> = walks
                .iter()
                .flat_map(|w| parts.iter().map(move |p| [w.clone(), vec![*p]].concat()))
                .collect();
            walks.extend(longer.into_iter().filter(|w| w.len() <= 3));
            walks.sort();
            walks.dedup();
        }
        let mut matched = 0;
        for w in &walks {
            let entries: Vec<Entry<'_>> =
                w.iter().map(|&(key, value)| Entry { key, value }).collect();
            let want = d.match_rule(w.iter().copied());
            assert_eq!(d.match_entries(&entries), want, "{w:?}");
            matched += usize::from(want.is_some());
        }
        assert_eq!(walks.len(), 1 + 9 + 81 + 729);
        assert!(matched >= 5, "every rule is reached by some walk");
    }
}
