//! The ideal central counter (design §2): every recorded request decided, in send order and at
//! its recorded time, by one in-process decision core holding one bucket per key — what a
//! single, infinitely fast, always-reachable rate limiter would have admitted for the same
//! arrivals. No wall clock: the records' times are the counter's clock.

use crate::arrivals::{Key, Record};
use allot_common::config::{ConfigSet, Scope};
use allot_common::descriptor::{Descriptor, Entry, Request};
use allot_common::{Code, Limiter};
use anyhow::{Context, Result};

/// Whether the ideal counter admits each record (same order as `records`, which must be in
/// send order). Global rules are decided as one central bucket (`Scope::Local` in a single
/// process is the whole contract); regional shares do not apply to the global contract.
///
/// # Errors
/// A record whose request the decision core refuses as invalid (unknown domain, bad entries).
pub fn admitted(policies: ConfigSet, keys: &[Key], records: &[Record]) -> Result<Vec<bool>> {
    admitted_with(
        &Limiter::new(policies.with_scope(Scope::Local), 0),
        keys,
        records,
    )
}

/// As [`admitted`], on a counter that already holds state (earlier records of the same run);
/// `records` must come after those in time.
///
/// # Errors
/// As [`admitted`].
pub fn admitted_with(limiter: &Limiter, keys: &[Key], records: &[Record]) -> Result<Vec<bool>> {
    let mut statuses = Vec::with_capacity(1);
    let mut out = Vec::with_capacity(records.len());
    for r in records {
        let k = &keys[r.key];
        let entries: Vec<Entry<'_>> = k
            .entries
            .iter()
            .map(|(key, value)| Entry { key, value })
            .collect();
        let descriptors = [Descriptor {
            entries: &entries,
            hits_addend: None,
        }];
        let req = Request {
            domain: &k.domain,
            descriptors: &descriptors,
            hits_addend: Some(u64::from(r.cost)),
        };
        let outcome = limiter
            .decide(&req, r.sent_ns, &mut statuses)
            .with_context(|| format!("the ideal counter refuses {k:?}"))?;
        out.push(outcome.code == Code::Ok);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arrivals::RequestAnswer;
    use std::path::Path;

    const POLICY: &str = "domain: t\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 40, scope: global, lease: {ttl_ms: 2000, max_grant: 8}, regions: [{region: a, share: \"50%\"}, {region: b, share: \"50%\"}]}\n";

    fn rec(sent_ns: u64, key: usize, agent: usize) -> Record {
        Record {
            sent_ns,
            agent,
            key,
            cost: 1,
            answer: RequestAnswer::Denied,
            latency_us: 0,
            answered_ns: sent_ns,
        }
    }

    fn keys() -> Vec<Key> {
        ["x", "y"]
            .iter()
            .map(|v| Key {
                domain: "t".into(),
                entries: vec![("tenant".into(), (*v).into())],
            })
            .collect()
    }

    fn set() -> ConfigSet {
        ConfigSet::from_yaml(POLICY, Path::new("t.yaml")).expect("policy")
    }

    #[test]
    fn a_burst_gets_the_whole_global_bucket_whatever_the_agent_or_region() {
        // 80 at once over many agents: one central bucket of 40, shares ignored.
        let recs: Vec<Record> = (0..80).map(|i| rec(0, 0, i % 6)).collect();
        let ok = admitted(set(), &keys(), &recs).expect("decided");
        assert_eq!(ok.iter().filter(|x| **x).count(), 40);
        assert!(ok[..40].iter().all(|x| *x), "first come, first served");
    }

    #[test]
    fn the_recorded_times_are_the_clock_and_keys_are_separate() {
        let limiter = Limiter::new(set().with_scope(Scope::Local), 0);
        let first: Vec<Record> = (0..40).map(|_| rec(0, 0, 0)).collect();
        assert!(admitted_with(&limiter, &keys(), &first)
            .expect("decided")
            .iter()
            .all(|x| *x));
        // Empty now; 100 ms later one token has refilled; the other key is untouched.
        let later = [
            rec(1, 0, 0),
            rec(100_000_000, 0, 0),
            rec(100_000_000, 0, 0),
            rec(1, 1, 0),
        ];
        let ok = admitted_with(&limiter, &keys(), &later).expect("decided");
        assert_eq!(ok, [false, true, false, true]);
        // Far in the future the bucket is full again, never above its burst.
        let far: Vec<Record> = (0..41).map(|_| rec(u64::MAX / 2, 0, 0)).collect();
        let ok = admitted_with(&limiter, &keys(), &far).expect("decided");
        assert_eq!(ok.iter().filter(|x| **x).count(), 40);
    }

    #[test]
    fn an_unknown_domain_is_an_error_not_a_denial() {
        let bad = [Key {
            domain: "nope".into(),
            entries: vec![("tenant".into(), "x".into())],
        }];
        assert!(admitted(set(), &bad, &[rec(0, 0, 0)]).is_err());
    }
}
