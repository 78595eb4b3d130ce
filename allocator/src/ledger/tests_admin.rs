//! Idempotent admin writes (issue 10 item 15): PutPolicy and SetShares retried with their
//! request id answer their first success and apply once; the same id with other content is
//! refused; an empty id keeps the old behaviour; retention is bounded.

use super::tests::{ACME, REGIONAL, T0};
use super::*;

fn put(yaml: &str, expected_version: u64, id: &str) -> Command {
    Command::PutPolicy {
        yaml: yaml.into(),
        expected_version,
        request_id: id.into(),
    }
}

fn set(ap_south_ppm: u32, config_version: u64, id: &str) -> Command {
    Command::SetShares {
        policy: "global-1000".into(),
        shares: vec![ShareSpec {
            region: "ap-south".into(),
            share: Share::Ppm(ap_south_ppm),
        }],
        config_version,
        request_id: id.into(),
    }
}

/// Applies `cmd` at `t` and checks every invariant.
fn step(l: &mut Ledger, cmd: &Command, t: u64) -> Response {
    let r = l.apply_at(cmd, t);
    l.check_invariants().unwrap();
    r
}

fn put_ok(version: u64) -> Response {
    Response::PolicyPut {
        domain: "api".into(),
        version,
    }
}

#[test]
fn a_put_policy_retried_with_its_id_answers_its_first_success_applied_once() {
    let mut l = Ledger::default();
    assert_eq!(step(&mut l, &put(ACME, 0, "p1"), T0), put_ok(1));
    // The answer was lost; the retry (same id, same content, same precondition) gets it again
    // and changes nothing.
    let before = l.snapshot();
    assert_eq!(step(&mut l, &put(ACME, 0, "p1"), T0), put_ok(1));
    assert_eq!(l.snapshot(), before, "a retry applies nothing");
    // Another write moves on; a late retry of the first still answers the first's success.
    let v2 = ACME.replace("burst: 40", "burst: 30");
    assert_eq!(step(&mut l, &put(&v2, 1, "p2"), T0 + 1), put_ok(2));
    assert_eq!(step(&mut l, &put(ACME, 0, "p1"), T0 + 2), put_ok(1));
    assert_eq!(l.policy_version("api"), 2);
    assert_eq!(l.policy_yaml("api"), Some(v2.as_str()));
    // A new id with the stale precondition is refused as before.
    assert!(matches!(
        step(&mut l, &put(ACME, 0, "p3"), T0 + 3),
        Response::Rejected(LedgerError::PolicyVersionMismatch { actual: 2, .. })
    ));
    // The same id with other content is refused precisely, and changes nothing.
    let before = l.snapshot();
    assert_eq!(
        step(&mut l, &put(&v2, 2, "p1"), T0 + 3),
        Response::Rejected(LedgerError::AdminRequestIdReused {
            request_id: "p1".into()
        })
    );
    assert_eq!(l.snapshot(), before);
}

#[test]
fn set_shares_retried_with_its_id_answers_its_first_success_applied_once() {
    let mut l = Ledger::default();
    assert_eq!(step(&mut l, &put(REGIONAL, 0, "p"), T0), put_ok(1));
    let ok = Response::SharesSet { config_version: 2 };
    assert_eq!(step(&mut l, &set(50_000, 2, "s1"), T0), ok);
    let before = l.snapshot();
    assert_eq!(step(&mut l, &set(50_000, 2, "s1"), T0), ok);
    assert_eq!(l.snapshot(), before, "a retry applies nothing");
    // Without the id the same write fails its version precondition, as it always did.
    assert!(matches!(
        step(&mut l, &set(50_000, 2, ""), T0),
        Response::Rejected(LedgerError::SharesVersionNotNewer { current: 2, .. })
    ));
    // An id is one write: reused for another write (even of another kind) it is refused.
    for other in [
        set(60_000, 2, "s1"),
        set(50_000, 3, "s1"),
        put(REGIONAL, 1, "s1"),
    ] {
        assert!(
            matches!(
                step(&mut l, &other, T0),
                Response::Rejected(LedgerError::AdminRequestIdReused { .. })
            ),
            "{other:?}"
        );
    }
    assert_eq!(l.snapshot(), before);
}

#[test]
fn refusals_are_not_remembered_and_ids_are_checked() {
    let mut l = Ledger::default();
    // A refused write changed nothing: its id stays free, so the corrected write can use it.
    let r = step(&mut l, &put("domain: api\ndescriptors: 7\n", 0, "p1"), T0);
    assert!(
        matches!(r, Response::Rejected(LedgerError::BadInput { .. })),
        "{r:?}"
    );
    assert_eq!(step(&mut l, &put(ACME, 0, "p1"), T0), put_ok(1));
    // An id over MAX_ID_BYTES is bad input; nothing changes.
    let before = l.snapshot();
    let long = "x".repeat(MAX_ID_BYTES + 1);
    let r = step(&mut l, &put(ACME, 1, &long), T0);
    assert!(
        matches!(&r, Response::Rejected(LedgerError::BadInput { field, .. }) if field == "request_id"),
        "{r:?}"
    );
    assert_eq!(l.snapshot(), before);
    // An empty id: no deduplication, today's behaviour.
    assert_eq!(step(&mut l, &put(ACME, 1, ""), T0), put_ok(2));
    assert!(matches!(
        step(&mut l, &put(ACME, 1, ""), T0),
        Response::Rejected(LedgerError::PolicyVersionMismatch { .. })
    ));
}

#[test]
fn admin_answers_are_kept_for_their_retention_and_at_most_the_cap() {
    let mut l = Ledger::default();
    assert_eq!(step(&mut l, &put(REGIONAL, 0, "p"), T0), put_ok(1));
    // Past the retention a retry is judged afresh (its precondition now fails).
    let later = T0 + ADMIN_RETENTION_MS;
    assert!(matches!(
        step(&mut l, &put(REGIONAL, 0, "p"), later),
        Response::Rejected(LedgerError::PolicyVersionMismatch { .. })
    ));
    let extra = 10u64;
    let n = MAX_REMEMBERED_ADMIN as u64 + extra;
    for v in 1..=n {
        // Alternate between two shares: each write changes something.
        let ppm = if v % 2 == 0 { 50_000 } else { 100_000 };
        let r = l.apply_at(&set(ppm, v + 1, &format!("s{v}")), later);
        assert_eq!(
            r,
            Response::SharesSet {
                config_version: v + 1
            }
        );
    }
    step(&mut l, &Command::Tick, later);
    let u = l
        .tables()
        .into_iter()
        .find(|u| u.table == TableKind::AdminRequests)
        .unwrap();
    assert_eq!(u.entries, MAX_REMEMBERED_ADMIN as u64);
    assert_eq!(u.counters.evicted, extra);
}
