//! Shared helpers: exact unit constants, parameter builders and request builders.

#![allow(dead_code)]

use allot_common::algorithm::{AlgorithmKind, LimitParams, LimitState};
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request, RequestError};
use allot_common::units::{Micros, Nanos, MICROS_PER_TOKEN, NANOS_PER_SEC};
use allot_common::{Decision, DescriptorStatus, Limiter, Outcome};
use std::path::Path;

/// One whole token in microtokens.
pub const TOK: Micros = MICROS_PER_TOKEN;
/// One second in ns.
pub const S: Nanos = NANOS_PER_SEC;
/// One millisecond in ns.
pub const MS: Nanos = 1_000_000;

/// Validated parameters; panics on invalid numbers (tests pass valid ones).
pub fn params(kind: AlgorithmKind, rpu: u64, period_ns: Nanos, burst: Option<u64>) -> LimitParams {
    LimitParams::new(kind, rpu, period_ns, burst).expect("valid params")
}

/// Check then spend when allowed, on the runtime-dispatched state.
pub fn decide(p: &LimitParams, s: &mut LimitState, now: Nanos, cost: Micros) -> Decision {
    let d = p.check(s, now, cost);
    if d.allowed {
        p.spend(s, now, cost);
    }
    d
}

/// The state's view at `now` without spending (a cost-0 check on a clone).
pub fn peek(p: &LimitParams, s: &LimitState, now: Nanos) -> Decision {
    let mut c = s.clone();
    p.check(&mut c, now, 0)
}

/// A limiter from one YAML document, deciding from `now`.
pub fn limiter(yaml: &str, now: Nanos) -> Limiter {
    Limiter::new(config(yaml), now)
}

/// A validated config set from one YAML document.
pub fn config(yaml: &str) -> ConfigSet {
    ConfigSet::from_yaml(yaml, Path::new("test.yaml")).expect("valid config")
}

/// An owned descriptor: entries and optional own cost.
#[derive(Debug, Clone)]
pub struct D {
    pub entries: Vec<(String, String)>,
    pub hits: Option<u64>,
}

/// A descriptor of `(key, value)` entries with no own cost.
pub fn d(entries: &[(&str, &str)]) -> D {
    D {
        entries: entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        hits: None,
    }
}

/// A descriptor with its own `hits_addend`.
pub fn dh(entries: &[(&str, &str)], hits: u64) -> D {
    D {
        hits: Some(hits),
        ..d(entries)
    }
}

/// Decides an owned request (built into the borrowed form the limiter takes).
pub fn ask(
    l: &Limiter,
    domain: &str,
    descs: &[D],
    hits: Option<u64>,
    now: Nanos,
) -> Result<(Outcome, Vec<DescriptorStatus>), RequestError> {
    let entries: Vec<Vec<Entry<'_>>> = descs
        .iter()
        .map(|x| {
            x.entries
                .iter()
                .map(|(k, v)| Entry { key: k, value: v })
                .collect()
        })
        .collect();
    let descriptors: Vec<Descriptor<'_>> = entries
        .iter()
        .zip(descs)
        .map(|(e, x)| Descriptor {
            entries: e,
            hits_addend: x.hits,
        })
        .collect();
    let req = Request {
        domain,
        descriptors: &descriptors,
        hits_addend: hits,
    };
    let mut statuses = Vec::new();
    let out = l.decide(&req, now, &mut statuses)?;
    Ok((out, statuses))
}

/// A tiny deterministic PRNG (xorshift64*), for reproducible "random" keys without proptest.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
