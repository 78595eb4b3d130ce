//! Robustness: random bytes and YAML-ish text as config never panic; random requests and times
//! never panic and never admit beyond capacity; the per-rule key cap holds and evicts only idle
//! keys; canonical descriptor keys are injective and decode back.

use crate::support::{ask, limiter, Rng, D, S};
use allot_common::config::ConfigSet;
use allot_common::descriptor::{decode_key, encode_key, key_matches, Entry};
use allot_common::limiter::Reason;
use allot_common::{Code, RetryAfter};
use proptest::prelude::*;
use std::collections::HashMap;
use std::path::Path;

fn parse(text: &str) -> Result<ConfigSet, String> {
    ConfigSet::from_yaml(text, Path::new("fuzz.yaml")).map_err(|e| e.to_string())
}

/// A parsed config must be usable: build a limiter and decide one request on each domain.
fn exercise(set: ConfigSet) {
    let names: Vec<String> = set.domains().map(|d| d.domain.clone()).collect();
    let l = allot_common::Limiter::new(set, 0);
    for n in names {
        let r = ask(&l, &n, &[crate::support::d(&[("k", "v")])], None, 0);
        let (o, st) = r.expect("a valid request on a configured domain decides");
        assert_eq!(st.len(), 1);
        assert_eq!(o.code, Code::Ok, "one request on a fresh limiter passes");
    }
}

// ---- config ---------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Y {
    Scalar(String),
    Map(Vec<(String, Y)>),
    Seq(Vec<Y>),
}

fn render(y: &Y, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match y {
        Y::Scalar(s) => {
            out.push(' ');
            out.push_str(s);
            out.push('\n');
        }
        Y::Map(kv) => {
            out.push('\n');
            for (k, v) in kv {
                out.push_str(&pad);
                out.push_str(k);
                out.push(':');
                render(v, indent + 2, out);
            }
        }
        Y::Seq(items) => {
            out.push('\n');
            for v in items {
                out.push_str(&pad);
                out.push('-');
                match v {
                    Y::Map(kv) if !kv.is_empty() => {
                        // "- key: value" form: first pair on the dash line.
                        let mut s = String::new();
                        render(v, indent + 2, &mut s);
                        out.push(' ');
                        out.push_str(s.trim_start());
                    }
                    _ => render(v, indent + 2, out),
                }
            }
        }
    }
}

const KEYS: &[&str] = &[
    "domain",
    "descriptors",
    "key",
    "value",
    "rate_limit",
    "unit",
    "unit_multiplier",
    "requests_per_unit",
    "algorithm",
    "burst",
    "unlimited",
    "shadow_mode",
    "name",
    "scope",
    "failure_mode",
    "max_keys",
    "replaces",
    "detailed_metric",
    "bogus",
    "\"key\"",
];
const SCALARS: &[&str] = &[
    "second",
    "minute",
    "hour",
    "day",
    "SECOND",
    "fortnight",
    "0",
    "1",
    "-1",
    "3",
    "7",
    "100000",
    "100001",
    "1000000000000",
    "1000000000001",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "1e3",
    "2.5",
    ".nan",
    ".inf",
    "true",
    "false",
    "null",
    "~",
    "\"\"",
    "''",
    "token_bucket",
    "gcra",
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "leaky",
    "[]",
    "{}",
    "\"é\"",
    "'a|b=c'",
    "d",
    "k",
    "v",
    "global",
    "local",
    "deny",
    "emergency",
    "&a x",
    "*a",
    "!!str 5",
    "\"\\u0000\"",
    "[1, [2]]",
    "{unit: second, requests_per_unit: 1}",
    "|",
    ">",
    "0x10",
    "0o7",
    "+5",
    "4294967296",
];

fn yaml_tree() -> impl Strategy<Value = Y> {
    let leaf = prop::sample::select(SCALARS).prop_map(|s| Y::Scalar(s.to_string()));
    leaf.prop_recursive(5, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec((prop::sample::select(KEYS), inner.clone()), 0..6)
                .prop_map(|kv| Y::Map(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
            prop::collection::vec(inner, 0..4).prop_map(Y::Seq),
        ]
    })
}

/// Mostly well-formed documents: a domain with descriptors whose fields mix valid and invalid
/// values, so validation paths past parsing are reached.
fn config_doc() -> impl Strategy<Value = String> {
    let field = (
        prop::sample::select(&KEYS[5..16]),
        prop::sample::select(SCALARS),
    );
    let desc = (
        prop::sample::select(vec!["k", "k", "t", "\"\"", "é", "1"]),
        prop::option::of(prop::sample::select(vec!["v", "\"v\"", "200", "\"\""])),
        prop::collection::vec(field, 0..6),
        any::<bool>(),
    );
    (
        prop::collection::vec(desc, 0..5),
        prop::sample::select(vec!["d", "\"\"", "5", "é"]),
    )
        .prop_map(|(descs, domain)| {
            let mut s = format!("domain: {domain}\ndescriptors:\n");
            for (i, (k, v, fields, nested)) in descs.iter().enumerate() {
                let ind = if *nested && i > 0 { "    " } else { "" };
                if *nested && i > 0 {
                    s.push_str("    descriptors:\n");
                }
                s.push_str(&format!("{ind}  - key: {k}\n"));
                if let Some(v) = v {
                    s.push_str(&format!("{ind}    value: {v}\n"));
                }
                if !fields.is_empty() {
                    s.push_str(&format!("{ind}    rate_limit:\n"));
                    for (f, val) in fields {
                        s.push_str(&format!("{ind}      {f}: {val}\n"));
                    }
                }
            }
            s
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_as_config_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let text = String::from_utf8_lossy(&bytes);
        match parse(&text) {
            Ok(set) => exercise(set),
            Err(e) => prop_assert!(e.contains("fuzz.yaml"), "error does not name the file: {}", e),
        }
    }

    #[test]
    fn random_yaml_trees_as_config_never_panic(tree in yaml_tree()) {
        let mut text = String::new();
        render(&tree, 0, &mut text);
        match parse(&text) {
            Ok(set) => exercise(set),
            Err(e) => prop_assert!(e.contains("fuzz.yaml"), "{}", e),
        }
    }

    #[test]
    fn random_config_documents_validate_or_name_the_problem(doc in config_doc()) {
        match parse(&doc) {
            Ok(set) => {
                prop_assert_eq!(set.domains().count(), 1);
                exercise(set)
            }
            Err(e) => prop_assert!(e.contains("fuzz.yaml"), "{}", e),
        }
    }
}

#[test]
fn deeply_nested_config_is_refused_without_overflowing_the_stack() {
    for depth in [17usize, 100, 2_000] {
        let mut s = String::from("domain: d\ndescriptors:\n");
        for i in 0..depth {
            let pad = "  ".repeat(2 * i);
            s.push_str(&format!("{pad}- key: k\n{pad}  descriptors:\n"));
        }
        let e = parse(&s).expect_err("too deep");
        assert!(e.contains("fuzz.yaml"), "{e}");
    }
    // 16 levels are accepted.
    let mut s = String::from("domain: d\ndescriptors:\n");
    for i in 0..16 {
        let pad = "  ".repeat(2 * i);
        s.push_str(&format!("{pad}- key: k{i}\n"));
        if i < 15 {
            s.push_str(&format!("{pad}  descriptors:\n"));
        } else {
            s.push_str(&format!(
                "{pad}  rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            ));
        }
    }
    let set = parse(&s).unwrap();
    assert_eq!(set.domain("d").unwrap().rules.len(), 1);
    for text in [
        "[".repeat(100_000),
        "{a: ".repeat(50_000),
        "- ".repeat(50_000),
    ] {
        let e = parse(&text).expect_err("not a config");
        assert!(e.contains("fuzz.yaml"), "{e}");
    }
}

// ---- requests -------------------------------------------------------------------------------

const RULES: &str = r#"domain: r
descriptors:
  - key: tb
    rate_limit: {unit: day, requests_per_unit: 5, burst: 7}
  - key: gc
    rate_limit: {unit: day, requests_per_unit: 5, burst: 3, algorithm: gcra}
  - key: fw
    rate_limit: {unit: day, requests_per_unit: 4, algorithm: fixed_window}
  - key: sw
    rate_limit: {unit: day, requests_per_unit: 6, algorithm: sliding_window}
  - key: sl
    rate_limit: {unit: day, requests_per_unit: 2, algorithm: sliding_log}
  - key: nest
    rate_limit: {unit: day, requests_per_unit: 3, algorithm: fixed_window}
    descriptors:
      - key: sub
        rate_limit: {unit: day, requests_per_unit: 2}
      - key: sub
        value: "é"
        rate_limit: {unit: day, requests_per_unit: 1, algorithm: sliding_log}
  - key: "ünï"
    rate_limit: {unit: day, requests_per_unit: 2, algorithm: gcra}
  - key: free
    rate_limit: {unlimited: true}
"#;

fn part() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(vec!["tb", "gc", "fw", "sw", "sl", "nest", "sub", "ünï", "free", "a", "b", "é", "e\u{301}", "\0"])
            .prop_map(str::to_string),
        1 => Just(String::new()),
        1 => Just("x".repeat(1100)),
        1 => Just("y".repeat(1024)),
        1 => any::<String>().prop_map(|s| s.chars().take(8).collect()),
    ]
}

fn cost() -> impl Strategy<Value = Option<u64>> {
    prop::sample::select(vec![
        None,
        None,
        None,
        Some(0),
        Some(1),
        Some(2),
        Some(3),
        Some(8),
        Some(u32::MAX as u64),
        Some(u32::MAX as u64 + 1),
        Some(u64::MAX),
    ])
}

fn descriptor() -> impl Strategy<Value = D> {
    (prop::collection::vec((part(), part()), 0..4), cost())
        .prop_map(|(entries, hits)| D { entries, hits })
}

fn request() -> impl Strategy<Value = (String, Vec<D>, Option<u64>)> {
    (
        prop_oneof![8 => Just("r".to_string()), 1 => Just(String::new()), 1 => Just("other".to_string()), 1 => Just("r".repeat(1025))],
        prop::collection::vec(descriptor(), 0..5),
        cost(),
    )
}

fn cost_of(d: &D, req_hits: Option<u64>) -> u64 {
    match d.hits {
        Some(h) => h,
        None => match req_hits {
            None | Some(0) => 1,
            Some(h) => h,
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Within the first second every limit (per day) can admit at most its capacity: a bucket
    /// refills less than one token, every window is the first one.
    #[test]
    fn random_requests_never_panic_nor_admit_beyond_capacity(
        reqs in prop::collection::vec((request(), 0u64..S), 1..200),
    ) {
        let l = limiter(RULES, 0);
        let mut admitted: HashMap<(u32, Box<[u8]>), u64> = HashMap::new();
        for ((domain, descs, hits), now) in &reqs {
            let Ok((o, st)) = ask(&l, domain, descs, *hits, *now) else { continue };
            prop_assert_eq!(st.len(), descs.len());
            let any_denied = st.iter().any(|s| s.code == Code::OverLimit);
            prop_assert_eq!(o.code == Code::OverLimit, any_denied);
            if st.iter().any(|s| s.code == Code::OverLimit && s.retry_after == RetryAfter::Never) {
                prop_assert_eq!(o.retry_after, RetryAfter::Never);
            }
            if o.code != Code::Ok {
                continue;
            }
            for (s, d) in st.iter().zip(descs) {
                let Some(info) = s.limit else { continue };
                let entries: Vec<Entry<'_>> =
                    d.entries.iter().map(|(k, v)| Entry { key: k, value: v }).collect();
                let n = admitted.entry((info.rule_index, encode_key(&entries))).or_default();
                *n += cost_of(d, *hits);
                prop_assert!(*n <= info.capacity, "rule {} admitted {} > {}", info.rule_index, n, info.capacity);
                prop_assert!(s.remaining <= info.capacity - (*n).min(info.capacity));
            }
        }
    }

    #[test]
    fn random_requests_at_wild_times_never_panic(
        reqs in prop::collection::vec(
            (request(), prop_oneof![Just(0u64), Just(u64::MAX), Just(u64::MAX - 1), any::<u64>(), 0u64..S]),
            1..100,
        ),
    ) {
        let l = limiter(RULES, 0);
        let mut st = Vec::new();
        for ((domain, descs, hits), now) in &reqs {
            if let Ok((o, s)) = ask(&l, domain, descs, *hits, *now) {
                prop_assert_eq!(s.len(), descs.len());
                prop_assert_eq!(o.code == Code::Ok, s.iter().all(|x| x.code == Code::Ok));
                st = s;
            }
        }
        prop_assert!(st.len() <= 4);
    }
}

// ---- key cap --------------------------------------------------------------------------------

#[test]
fn key_cap_holds_and_only_idle_keys_are_evicted() {
    let yaml = "domain: cap\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1, max_keys: 100}\n";
    let l = limiter(yaml, 0);
    let table = || l.snapshot().domain("cap").unwrap().table(0).len();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut hot_admitted = Vec::new();
    let (mut fresh_ok, mut full) = (0u64, 0u64);
    for i in 0..10_000u64 {
        let now = i * 10_000_000; // 10 ms steps: 100 s in all
                                  // The hot key spends its one token whenever it has it: exactly once per second.
        let (o, st) = ask(
            &l,
            "cap",
            &[crate::support::d(&[("user", "hot")])],
            None,
            now,
        )
        .unwrap();
        if o.code == Code::Ok {
            hot_admitted.push(now);
        } else {
            assert_eq!(
                st[0].reason,
                Reason::OverLimit,
                "the hot key is never refused for space"
            );
        }
        // A random new key: admitted fresh (one token, none left) or refused for space.
        let len = 1 + rng.below(40) as usize;
        let mut key: String = (0..len)
            .map(|_| char::from_u32(0x20 + rng.below(0x2FF) as u32).unwrap_or('?'))
            .collect();
        key.push_str(&format!("#{i}")); // distinct keys
        let (o, st) = ask(
            &l,
            "cap",
            &[crate::support::d(&[("user", &key)])],
            None,
            now,
        )
        .unwrap();
        match st[0].reason {
            Reason::WithinLimit => {
                assert_eq!((o.code, st[0].remaining), (Code::Ok, 0));
                fresh_ok += 1;
            }
            Reason::KeyTableFull => {
                assert_eq!(o.code, Code::OverLimit);
                assert_eq!(o.retry_after, RetryAfter::After(S));
                full += 1;
            }
            r => panic!("unexpected {r:?} for a new key"),
        }
        assert!(table() <= 100, "table holds {} keys", table());
    }
    let expected: Vec<u64> = (0..100).map(|k| k * S).collect();
    assert_eq!(hot_admitted, expected, "the active key's state was reset");
    // Cycles of 199 steps: 99 new keys fill the table (the hot key holds the 100th slot); a
    // sweep then finds nothing idle for 1 s of backoff (100 refusals); the next sweep evicts the
    // 99 keys whose single token has refilled. 50 cycles (4950 + 5000) and 50 more admitted.
    assert_eq!((fresh_ok, full), (5_000, 5_000));
}

// ---- canonical keys -------------------------------------------------------------------------

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec![
            'a', 'b', '_', '=', '|', '\\', '\0', '\u{1}', 'é', '\u{301}', ':',
        ]),
        0..4,
    )
    .prop_map(String::from_iter)
}

fn entry_list() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec((text(), text()), 0..4)
}

fn entries(v: &[(String, String)]) -> Vec<Entry<'_>> {
    v.iter().map(|(k, x)| Entry { key: k, value: x }).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn canonical_keys_are_injective_and_decode_back(x in entry_list(), y in entry_list()) {
        let (ex, ey) = (entries(&x), entries(&y));
        let (kx, ky) = (encode_key(&ex), encode_key(&ey));
        prop_assert_eq!(kx == ky, x == y);
        prop_assert_eq!(decode_key(&kx), Some(x.clone()));
        prop_assert_eq!(key_matches(&ex, &kx), true);
        prop_assert_eq!(key_matches(&ey, &kx), x == y);
        let expected_len: usize = x.iter().map(|(k, v)| 8 + k.len() + v.len()).sum();
        prop_assert_eq!(kx.len(), expected_len);
    }
}
