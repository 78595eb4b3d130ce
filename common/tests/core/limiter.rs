//! The keyed limiter: shadow mode, duplicate descriptors, matching, invalid requests, costs.

use crate::support::{ask, d, dh, limiter, D, MS, S};
use allot_common::descriptor::{RequestError, MAX_DESCRIPTORS, MAX_ENTRIES, MAX_PART_BYTES};
use allot_common::limiter::Reason;
use allot_common::{Code, Limiter, RetryAfter};

fn bucket_yaml(shadow: bool) -> String {
    format!(
        "domain: s\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 1, burst: 2}}\n    shadow_mode: {shadow}\n"
    )
}

/// (overall code, status code, remaining, reset_after, shadow_over_limit, outcome retry)
type Row = (Code, Code, u64, u64, bool, RetryAfter);

fn row(l: &Limiter, domain: &str, descs: &[D], now: u64) -> Row {
    let (o, st) = ask(l, domain, descs, None, now).unwrap();
    (
        o.code,
        st[0].code,
        st[0].remaining,
        st[0].reset_after,
        st[0].shadow_over_limit,
        o.retry_after,
    )
}

#[test]
fn shadow_mode_counts_exactly_like_enforcement() {
    let shadow = limiter(&bucket_yaml(true), 0);
    let enforced = limiter(&bucket_yaml(false), 0);
    let k = || dh(&[("k", "x")], 1);
    let k2 = || dh(&[("k", "x")], 2);
    // (descriptor, time) sequence: 1 passes, 2 is denied (spends nothing), 1 passes, 1 denied,
    // after 1 s one token is back.
    let seq = [(k(), 0), (k2(), 0), (k(), 0), (k(), 0), (k(), S)];
    let got_shadow: Vec<Row> = seq
        .iter()
        .map(|(x, t)| row(&shadow, "s", std::slice::from_ref(x), *t))
        .collect();
    let got_enf: Vec<Row> = seq
        .iter()
        .map(|(x, t)| row(&enforced, "s", std::slice::from_ref(x), *t))
        .collect();
    use Code::*;
    let now = RetryAfter::Now;
    assert_eq!(
        got_enf,
        vec![
            (Ok, Ok, 1, S, false, now),
            (OverLimit, OverLimit, 1, S, false, RetryAfter::After(S)),
            (Ok, Ok, 0, 2 * S, false, now),
            (OverLimit, OverLimit, 0, 2 * S, false, RetryAfter::After(S)),
            (Ok, Ok, 0, 2 * S, false, now),
        ]
    );
    assert_eq!(
        got_shadow,
        vec![
            (Ok, Ok, 1, S, false, now),
            (Ok, Ok, 1, S, true, now),
            (Ok, Ok, 0, 2 * S, false, now),
            (Ok, Ok, 0, 2 * S, true, now),
            (Ok, Ok, 0, 2 * S, false, now),
        ]
    );
    let (_, st) = ask(&shadow, "s", &[k()], None, S).unwrap();
    assert!(st[0].shadow_mode);
    assert_eq!(st[0].reason, Reason::OverLimit);
    assert_eq!(st[0].retry_after, RetryAfter::After(S));
}

const L3: &str = "domain: dup
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: fixed_window}
  - key: free
    rate_limit: {unlimited: true}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: fixed_window}
    descriptors:
      - key: op
        value: search
        rate_limit: {unit: minute, requests_per_unit: 1, algorithm: fixed_window}
";

fn left(l: &Limiter, entries: &[(&str, &str)], now: u64) -> u64 {
    let (o, st) = ask(l, "dup", &[dh(entries, 0)], None, now).unwrap();
    assert_eq!(o.code, Code::Ok, "a cost-0 query always passes");
    st[0].remaining
}

#[test]
fn duplicate_descriptors_share_one_counter() {
    let l = limiter(L3, 0);
    let kv = || d(&[("k", "v")]);
    let (o, st) = ask(&l, "dup", &[kv(), kv()], None, 0).unwrap();
    assert_eq!(o.code, Code::Ok);
    assert_eq!((st[0].remaining, st[1].remaining), (1, 1));
    // Two more do not fit in the one left: denied as a whole, nothing spent.
    let (o, st) = ask(&l, "dup", &[kv(), kv()], None, 0).unwrap();
    assert_eq!(o.code, Code::OverLimit);
    assert_eq!(o.retry_after, RetryAfter::After(60 * S));
    assert_eq!((st[0].code, st[1].code), (Code::OverLimit, Code::OverLimit));
    assert_eq!((st[0].remaining, st[1].remaining), (1, 1));
    assert_eq!(left(&l, &[("k", "v")], 0), 1);
    let (o, st) = ask(&l, "dup", &[kv()], None, 0).unwrap();
    assert_eq!((o.code, st[0].remaining), (Code::Ok, 0));
    // Weighted duplicates add up: 2 + 1 = 3 fits a fresh window exactly.
    let (o, st) = ask(
        &l,
        "dup",
        &[dh(&[("k", "v")], 2), dh(&[("k", "v")], 1)],
        None,
        60 * S,
    )
    .unwrap();
    assert_eq!((o.code, st[0].remaining, st[1].remaining), (Code::Ok, 0, 0));
}

#[test]
fn invalid_requests_and_unknown_domains_spend_nothing() {
    let l = limiter(L3, 0);
    let ok = d(&[("k", "v")]);
    let err = |r: Result<_, RequestError>| r.expect_err("an error");
    assert_eq!(
        err(ask(&l, "nope", std::slice::from_ref(&ok), None, 0)),
        RequestError::UnknownDomain("nope".into())
    );
    assert_eq!(
        err(ask(&l, "", std::slice::from_ref(&ok), None, 0)),
        RequestError::EmptyDomain
    );
    assert_eq!(
        err(ask(&l, "dup", &[], None, 0)),
        RequestError::NoDescriptors
    );
    assert_eq!(
        err(ask(&l, "dup", &[ok.clone(), d(&[("k", "")])], None, 0)),
        RequestError::EmptyPart {
            descriptor: 1,
            entry: 0,
            field: "value"
        }
    );
    assert_eq!(
        err(ask(&l, "dup", &[ok.clone(), d(&[("", "v")])], None, 0)),
        RequestError::EmptyPart {
            descriptor: 1,
            entry: 0,
            field: "key"
        }
    );
    assert!(matches!(
        err(ask(&l, "dup", &[ok.clone(), d(&[])], None, 0)),
        RequestError::NoEntries { descriptor: 1 }
    ));
    let many = vec![ok.clone(); MAX_DESCRIPTORS + 1];
    assert!(matches!(
        err(ask(&l, "dup", &many, None, 0)),
        RequestError::TooManyDescriptors { got: 33, max: 32 }
    ));
    let deep: Vec<(&str, &str)> = vec![("k", "v"); MAX_ENTRIES + 1];
    assert!(matches!(
        err(ask(&l, "dup", &[ok.clone(), d(&deep)], None, 0)),
        RequestError::TooManyEntries { descriptor: 1, .. }
    ));
    let long = "v".repeat(MAX_PART_BYTES + 1);
    assert!(matches!(
        err(ask(&l, "dup", &[ok.clone(), d(&[("k", &long)])], None, 0)),
        RequestError::TooLong { .. }
    ));
    assert_eq!(
        err(ask(
            &l,
            "dup",
            &[ok.clone(), dh(&[("k", "v")], u32::MAX as u64 + 1)],
            None,
            0
        )),
        RequestError::CostTooLarge {
            descriptor: 1,
            got: u32::MAX as u64 + 1,
            max: u32::MAX as u64
        }
    );
    assert!(matches!(
        err(ask(&l, "dup", std::slice::from_ref(&ok), Some(u64::MAX), 0)),
        RequestError::CostTooLarge { .. }
    ));
    // None of that spent anything.
    assert_eq!(left(&l, &[("k", "v")], 0), 3);
}

#[test]
fn cost_above_capacity_is_never_and_dominates_the_overall_wait() {
    let l = limiter(L3, 0);
    // tenant limit 2: spend 2, so a cost of 1 waits for the window; k is asked for 4 > 3.
    assert_eq!(
        ask(&l, "dup", &[dh(&[("tenant", "t")], 2)], None, 0)
            .unwrap()
            .0
            .code,
        Code::Ok
    );
    let (o, st) = ask(
        &l,
        "dup",
        &[d(&[("tenant", "t")]), dh(&[("k", "v")], 4)],
        None,
        10 * S,
    )
    .unwrap();
    assert_eq!(o.code, Code::OverLimit);
    assert_eq!(o.retry_after, RetryAfter::Never);
    assert_eq!(st[0].retry_after, RetryAfter::After(50 * S));
    assert_eq!(st[1].retry_after, RetryAfter::Never);
    assert_eq!(st[1].reason, Reason::CostExceedsCapacity);
    assert_eq!(st[1].remaining, 3);
    // Without the never-passing part, the wait is the tenant's.
    let (o, _) = ask(
        &l,
        "dup",
        &[d(&[("tenant", "t")]), d(&[("k", "v")])],
        None,
        10 * S,
    )
    .unwrap();
    assert_eq!(o.retry_after, RetryAfter::After(50 * S));
    assert_eq!(left(&l, &[("k", "v")], 10 * S), 3);
    // Request-level hits_addend applies to descriptors without their own; 0 there means 1.
    let (o, st) = ask(&l, "dup", &[d(&[("k", "v")])], Some(0), 10 * S).unwrap();
    assert_eq!((o.code, st[0].remaining), (Code::Ok, 2));
    let (o, st) = ask(&l, "dup", &[d(&[("k", "v")])], Some(2), 10 * S).unwrap();
    assert_eq!((o.code, st[0].remaining), (Code::Ok, 0));
}

#[test]
fn matching_no_rule_unlimited_and_most_specific() {
    let l = limiter(L3, 0);
    let (o, st) = ask(
        &l,
        "dup",
        &[
            d(&[("other", "x")]),
            d(&[("free", "x")]),
            d(&[("k", "v"), ("deeper", "x")]),
        ],
        Some(1000),
        0,
    )
    .unwrap();
    assert_eq!(o.code, Code::Ok);
    assert_eq!(st[0].reason, Reason::NoRule);
    assert_eq!(st[0].limit, None);
    assert_eq!(st[1].reason, Reason::Unlimited);
    assert_eq!(st[1].rule_index, Some(1));
    assert_eq!(st[1].limit, None);
    assert_eq!(st[2].reason, Reason::NoRule);
    // tenant + op=search matches the value rule (limit 1); op=list matches no rule; the
    // wildcard tenant keeps one counter per tenant value.
    let search = || d(&[("tenant", "a"), ("op", "search")]);
    let (o, st) = ask(&l, "dup", &[search()], None, 0).unwrap();
    assert_eq!((o.code, st[0].remaining), (Code::Ok, 0));
    assert_eq!(st[0].limit.unwrap().requests_per_unit, 1);
    assert_eq!(
        ask(&l, "dup", &[search()], None, 0).unwrap().0.code,
        Code::OverLimit
    );
    let (o, st) = ask(&l, "dup", &[d(&[("tenant", "a"), ("op", "list")])], None, 0).unwrap();
    assert_eq!((o.code, st[0].reason), (Code::Ok, Reason::NoRule));
    assert_eq!(left(&l, &[("tenant", "a")], 0), 2);
    let (_, st) = ask(&l, "dup", &[d(&[("tenant", "a")])], None, 30 * S).unwrap();
    assert_eq!((st[0].remaining, st[0].reset_after), (1, 30 * S));
    assert_eq!(left(&l, &[("tenant", "b")], 30 * S + 5 * MS), 2);
    // Values compare byte for byte: composed and decomposed é are different tenants.
    let (_, st) = ask(&l, "dup", &[d(&[("tenant", "\u{e9}")])], None, 31 * S).unwrap();
    assert_eq!(st[0].remaining, 1);
    let (_, st) = ask(&l, "dup", &[d(&[("tenant", "e\u{301}")])], None, 31 * S).unwrap();
    assert_eq!(st[0].remaining, 1);
}
