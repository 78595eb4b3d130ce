//! The ideal central counter (seed §13): every recorded request decided, in send order and at
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
