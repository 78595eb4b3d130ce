//! Raw YAML → validated [`DomainConfig`], with a precise error for every bad value.

use super::raw::{RawDescriptor, RawDomain, RawRateLimit, Scalar};
use super::{
    Children, ConfigError, DomainConfig, FailureMode, Node, Rule, RuleLimit, Scope, Unit,
    DEFAULT_MAX_KEYS, MAX_SLIDING_LOG_LIMIT,
};
use crate::algorithm::{AlgorithmKind, LimitParams};
use crate::descriptor::MAX_PART_BYTES;
use crate::units::{MAX_PERIOD_NS, MAX_TOKENS};
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

/// Parses and validates one domain file.
pub(crate) fn domain(text: &str, file: &Path) -> Result<DomainConfig, ConfigError> {
    let raw: RawDomain = serde_saphyr::from_str(text).map_err(|e| ConfigError::Syntax {
        file: file.to_path_buf(),
        message: e.to_string(),
    })?;
    let cx = Ctx { file };
    let domain = cx
        .text("domain", raw.domain.as_ref())?
        .ok_or_else(|| cx.invalid("domain", None, "is required"))?
        .to_string();
    let mut out = DomainConfig {
        domain: domain.clone(),
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
    list: &[RawDescriptor],
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
            .entry(key.to_string())
            .or_default();
        let slot = match value {
            Some(v) => children.by_value.entry(v.to_string()).or_insert(usize::MAX),
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

fn rule(
    cx: &Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
    id: &str,
    shadow: bool,
) -> Result<Rule, ConfigError> {
    let f = |field: &str| format!("{path}.{field}");
    let name = cx.text(&f("name"), rl.name.as_ref())?.map(str::to_string);
    let scope = match cx.text(&f("scope"), rl.scope.as_ref())? {
        None | Some("global") => Scope::Global,
        Some("local") => Scope::Local,
        Some(_) => {
            return Err(cx.invalid(&f("scope"), rl.scope.as_ref(), "must be global or local"))
        }
    };
    let failure_mode = match cx.text(&f("failure_mode"), rl.failure_mode.as_ref())? {
        None | Some("deny") => FailureMode::Deny,
        Some("emergency") => FailureMode::Emergency,
        Some(_) => {
            return Err(cx.invalid(
                &f("failure_mode"),
                rl.failure_mode.as_ref(),
                "must be deny or emergency",
            ))
        }
    };
    let max_keys = cx
        .positive(&f("max_keys"), rl.max_keys.as_ref(), 1 << 32)?
        .unwrap_or(DEFAULT_MAX_KEYS);
    let unlimited = cx
        .boolean(&f("unlimited"), rl.unlimited.as_ref())?
        .unwrap_or(false);
    let limit = if unlimited {
        RuleLimit::Unlimited
    } else {
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
        let kind = match cx.text(&f("algorithm"), rl.algorithm.as_ref())? {
            None => AlgorithmKind::TokenBucket,
            Some(s) => AlgorithmKind::parse(s).ok_or_else(|| {
                cx.invalid(
                    &f("algorithm"),
                    rl.algorithm.as_ref(),
                    "unknown algorithm; expected one of token_bucket, gcra, fixed_window, sliding_window, sliding_log",
                )
            })?,
        };
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
        RuleLimit::Limited {
            params,
            requests_per_unit: rpu,
            unit,
            unit_multiplier: mult,
        }
    };
    Ok(Rule {
        id: id.to_string(),
        name: name.unwrap_or_else(|| id.to_string()),
        limit,
        shadow_mode: shadow,
        scope,
        failure_mode,
        max_keys,
        source: cx.file.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(yaml: &str) -> String {
        domain(yaml, Path::new("t.yaml")).unwrap_err().to_string()
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
}
