//! Central decisions (Decide) and batches: all-or-nothing debits of every source, exact
//! retry-after, "never" above capacity, idempotence by (holder, request id), and a batch being
//! exactly its commands applied in order at one time.

use super::tests::{acquire, granted, key, ledger, regional_cap, ACME, REGIONAL, T0};
use super::*;
use allot_common::units::{MAX_TOKENS, MICROS_PER_TOKEN as T};

fn decide_cmd(region: &str, holder: &str, cost: u64, id: &str) -> Command {
    Command::Decide(Decide {
        key: key("acme"),
        region: region.into(),
        holder: holder.into(),
        cost,
        request_id: id.into(),
    })
}

fn decide(l: &mut Ledger, t: u64, region: &str, cost: u64, id: &str) -> Decided {
    decide_as(l, t, region, "gw1", cost, id)
}

/// A central decision of `cost` for `holder` in `region` at `t` (request id `id`).
fn decide_as(l: &mut Ledger, t: u64, region: &str, holder: &str, cost: u64, id: &str) -> Decided {
    match l.apply_at(&decide_cmd(region, holder, cost, id), t) {
        Response::Decided(d) => d,
        other => panic!("expected a decision, got {other:?}"),
    }
}

fn bucket(l: &Ledger, t: u64) -> u64 {
    l.status(&key("acme"), t).expect("status").bucket_tokens
}

#[test]
fn decide_debits_all_or_nothing_exactly_and_is_idempotent() {
    let mut l = ledger(ACME);
    let d = decide(&mut l, T0, "eu", 30 * T, "d1");
    assert!(d.allowed && !d.never);
    assert_eq!(
        (d.remaining, d.retry_after_ms, d.policy_version),
        (10 * T, 0, 1)
    );
    // A retry gets the same answer and is charged once: 10 left plus 1 ms of refill at 10/s.
    assert_eq!(decide(&mut l, T0 + 1, "eu", 30 * T, "d1"), d);
    assert_eq!(bucket(&l, T0 + 1), 10 * T + T / 100);
    // 9.99 tokens short at 10 tokens/s: exactly 999 ms; nothing debited.
    let no = decide(&mut l, T0 + 1, "eu", 20 * T, "d2");
    assert!(!no.allowed && !no.never, "{no:?}");
    assert_eq!((no.retry_after_ms, no.remaining), (999, 10 * T + T / 100));
    assert!(no.reason.contains("bucket"), "{no:?}");
    // Above the capacity (burst 40): never, no retry time, nothing debited.
    let never = decide(&mut l, T0 + 1, "eu", 41 * T, "d3");
    assert!(
        !never.allowed && never.never && never.retry_after_ms == 0,
        "{never:?}"
    );
    assert!(never.reason.contains("capacity"), "{never:?}");
    assert_eq!(bucket(&l, T0 + 1), 10 * T + T / 100);
    // The denial is remembered too: its retry after the refill still answers the denial.
    assert_eq!(decide(&mut l, T0 + 2_000, "eu", 20 * T, "d2"), no);
    // The whole capacity at once passes once the bucket is full again.
    assert!(decide(&mut l, T0 + 5_000, "eu", 40 * T, "d4").allowed);
    assert_eq!(bucket(&l, T0 + 5_000), 0);
}

#[test]
fn decide_debits_the_region_part_and_the_global_bucket() {
    // Shares as caps: a region never takes beyond its part.
    let mut l = ledger(&regional_cap());
    // eu-west holds 50 % of 1000: a part of 500 (rate 500/s) inside the global 1000.
    let d = decide(&mut l, T0, "eu-west", 400 * T, "a");
    assert_eq!((d.allowed, d.remaining), (true, 100 * T));
    let no = decide(&mut l, T0, "eu-west", 200 * T, "b");
    assert!(!no.allowed && !no.never, "{no:?}");
    // 100 tokens short of the region's part at 500/s: 200 ms.
    assert_eq!(no.retry_after_ms, 200);
    assert!(no.reason.contains("region share"), "{no:?}");
    let never = decide(&mut l, T0, "eu-west", 600 * T, "c");
    assert!(
        never.never && never.reason.contains("region's part"),
        "{never:?}"
    );
    // us-east (40 %) draws on the same global bucket: 600 left globally, 400 in its part.
    let d = decide(&mut l, T0, "us-east", 300 * T, "d");
    assert_eq!((d.allowed, d.remaining), (true, 100 * T));
    // ap-south (10 %): its whole part; the global bucket goes to 200, the part to 0.
    let d = decide(&mut l, T0, "ap-south", 100 * T, "e");
    assert_eq!((d.allowed, d.remaining), (true, 0));
    assert_eq!(bucket(&l, T0), 200 * T);
    // A region without a share is unknown, and refused without a change.
    let before = l.snapshot();
    let r = l.apply_at(&decide_cmd("mars", "gw1", T, "f"), T0);
    assert!(
        matches!(r, Response::Rejected(LedgerError::UnknownRegion { .. })),
        "{r:?}"
    );
    assert_eq!(l.snapshot(), before);
}

#[test]
fn decide_and_acquire_draw_from_the_same_sources() {
    let mut l = ledger(ACME);
    assert_eq!(
        granted(&acquire(&mut l, T0, "eu", "gw2", 20 * T, "g1")).granted,
        20 * T
    );
    let no = decide(&mut l, T0, "eu", 30 * T, "d1");
    assert_eq!((no.allowed, no.retry_after_ms), (false, 1_000));
    let d = decide(&mut l, T0, "eu", 20 * T, "d2");
    assert_eq!((d.allowed, d.remaining), (true, 0));
    match acquire(&mut l, T0, "eu", "gw2", 5 * T, "g2") {
        Response::Denied(x) => assert_eq!(x.retry_after_ms, 100),
        other => panic!("{other:?}"),
    }
}

#[test]
fn decide_respects_the_calendar_quota() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000, quota: {limit: 50, period: month}, lease: {max_grant: 30}}\n";
    let mut l = ledger(yaml);
    let d = decide(&mut l, T0, "eu", 30 * T, "a");
    assert_eq!((d.allowed, d.remaining), (true, 20 * T));
    let dec_1 = 1_796_083_200_000; // 2026-12-01T00:00:00Z
    let no = decide(&mut l, T0 + 1_000, "eu", 30 * T, "b");
    assert!(!no.allowed && !no.never, "{no:?}");
    assert_eq!(no.retry_after_ms, dec_1 - (T0 + 1_000));
    assert!(no.reason.contains("calendar"), "{no:?}");
    assert!(decide(&mut l, T0 + 1_000, "eu", 51 * T, "c").never);
    assert!(decide(&mut l, dec_1, "eu", 30 * T, "d").allowed);
}

#[test]
fn bad_decides_are_refused_and_change_nothing() {
    let mut l = ledger(ACME);
    granted(&acquire(&mut l, T0, "eu", "gw1", 5 * T, "used-by-acquire"));
    assert!(decide(&mut l, T0, "eu", T, "used-by-decide").allowed);
    let before = l.snapshot();
    let long = "x".repeat(MAX_ID_BYTES + 1);
    let cases = [
        decide_cmd("eu", "gw1", 0, "z"),
        decide_cmd("eu", "gw1", u64::MAX, "z"),
        decide_cmd("eu", "gw1", MAX_TOKENS * T + 1, "z"),
        decide_cmd("eu", "", T, "z"),
        decide_cmd("", "gw1", T, "z"),
        decide_cmd("eu", "gw1", T, ""),
        decide_cmd("eu", "gw1", T, &long),
        // An id already answered for another kind of request.
        decide_cmd("eu", "gw1", T, "used-by-acquire"),
        Command::Acquire(Acquire {
            key: key("acme"),
            region: "eu".into(),
            holder: "gw1".into(),
            want: T,
            demand_per_s: 0,
            want_rate_per_s: 0,
            request_id: "used-by-decide".into(),
        }),
    ];
    for cmd in cases {
        match l.apply_at(&cmd, T0) {
            Response::Rejected(
                LedgerError::BadInput { .. } | LedgerError::RequestIdReused { .. },
            ) => {}
            other => panic!("{cmd:?} was not refused: {other:?}"),
        }
    }
    assert_eq!(l.snapshot(), before, "refused decisions changed state");
    // The largest valid cost is simply above the capacity.
    assert!(decide(&mut l, T0, "eu", MAX_TOKENS * T, "max").never);
}

#[test]
fn admitted_never_exceeds_burst_plus_rate_times_time_and_retries_charge_once() {
    let mut l = ledger(ACME);
    let mut admitted = 0u64;
    let mut answers: BTreeMap<String, Decided> = BTreeMap::new();
    let mut t = T0;
    for i in 0..3_000u64 {
        t += 3 + i % 11;
        // Every fifth call retries an earlier id: same answer, charged once.
        let id = if i % 5 == 4 {
            format!("d{}", i - 3)
        } else {
            format!("d{i}")
        };
        let cost = (1 + i % 7) * T / 2;
        let d = decide(&mut l, t, "eu", cost, &id);
        match answers.get(&id) {
            Some(first) => assert_eq!(&d, first, "retry of {id} answered differently"),
            None => {
                if d.allowed {
                    admitted += cost;
                }
                answers.insert(id, d);
            }
        }
        let bound = 40 * T + 10 * T * (t - T0) / 1000;
        assert!(admitted <= bound, "admitted {admitted} > {bound}");
    }
    assert!(
        admitted > 40 * T,
        "the bucket refilled and was decided again"
    );
}

#[test]
fn a_batch_is_its_commands_in_order_at_one_time() {
    let mut l = ledger(ACME);
    let items = vec![
        decide_cmd("eu", "gw1", 30 * T, "d1"),
        decide_cmd("eu", "gw1", 20 * T, "d2"),
        Command::Acquire(Acquire {
            key: key("acme"),
            region: "eu".into(),
            holder: "gw2".into(),
            want: 5 * T,
            demand_per_s: 0,
            want_rate_per_s: 0,
            request_id: "a1".into(),
        }),
        Command::Batch(vec![Command::Tick]),
        Command::Report {
            allocation_id: 1,
            epoch: 1,
            holder: "gw2".into(),
            cumulative_spend: 2 * T,
        },
        decide_cmd("eu", "gw1", 30 * T, "d1"),
    ];
    let mut sequential = Ledger::restore(&l.snapshot()).expect("restore");
    let Response::Batch(got) = l.apply_at(&Command::Batch(items.clone()), T0 + 7) else {
        panic!("a batch answers with a batch");
    };
    let want: Vec<Response> = items
        .iter()
        .map(|c| match c {
            Command::Batch(_) => Response::Rejected(LedgerError::BadInput {
                field: "batch".into(),
                reason: "a batch cannot contain a batch".into(),
            }),
            c => sequential.apply_at(c, T0 + 7),
        })
        .collect();
    assert_eq!(got, want);
    assert_eq!(l.snapshot(), sequential.snapshot());
    assert!(matches!(&got[0], Response::Decided(d) if d.allowed));
    assert!(matches!(&got[1], Response::Decided(d) if !d.allowed));
    assert!(matches!(&got[2], Response::Granted(g) if g.granted == 5 * T));
    assert!(matches!(got[4], Response::Reported { recorded, .. } if recorded == 2 * T));
    assert_eq!(
        got[5], got[0],
        "the retried id in the same batch is charged once"
    );
    // An empty batch is a valid entry that changes nothing but time.
    assert_eq!(
        l.apply_at(&Command::Batch(Vec::new()), T0 + 8),
        Response::Batch(Vec::new())
    );
}

/// Weighted shares are guarantees, not caps (design §5 "Borrowing"): a region takes beyond its
/// part what the global bucket holds and the other regions' holders did not ask for; a region
/// whose holders asked keeps up to that much, and every token still comes from the global
/// bucket.
#[test]
fn a_weighted_region_borrows_what_the_other_regions_do_not_keep() {
    let mut l = ledger(REGIONAL);
    // us-east's holder spends its whole part of 400.
    assert_eq!(
        granted(&acquire(&mut l, T0, "us-east", "us1", 100 * T, "u1")).granted,
        100 * T
    );
    let r = acquire(&mut l, T0, "us-east", "us1", 300 * T, "u2");
    assert_eq!(granted(&r).granted, 300 * T);
    l.check_invariants().unwrap();
    // The global bucket holds 600; us-east keeps what its bucket holds, 0 now, and ap-south
    // asked nothing: eu-west (part 500) may take all 600.
    let d = decide(&mut l, T0, "eu-west", 550 * T, "e1");
    assert_eq!((d.allowed, d.remaining), (true, 50 * T), "{d:?}");
    assert_eq!(bucket(&l, T0), 50 * T);
    l.check_invariants().unwrap();
    // Nothing beyond the global bucket, ever: 50 left, a cost of 60 waits for 10 at 1000/s.
    let no = decide(&mut l, T0, "eu-west", 60 * T, "e2");
    assert!(!no.allowed && !no.never, "{no:?}");
    assert_eq!(no.retry_after_ms, 10);
    assert_eq!(bucket(&l, T0), 50 * T, "a denial debits nothing");
}

/// A busy region whose asks were all met keeps its whole part only while it may be in the
/// middle of a burst (it asked within the settle window); once quiet it keeps what its holders
/// asked for last and lends the rest, and a denial in between says when (issue 9, skewed
/// part a).
#[test]
fn a_met_region_lends_its_unasked_part_once_it_settles() {
    let mut l = ledger(REGIONAL);
    let r = acquire(&mut l, T0, "us-east", "us1", 100 * T, "u1");
    assert_eq!(granted(&r).granted, 100 * T);
    // At once, us-east keeps all of its 300 left: eu-west gets 600 of the global 900.
    let no = decide(&mut l, T0, "eu-west", 800 * T, "e1");
    assert!(!no.allowed && !no.never, "{no:?}");
    // us-east settles in 50 ms, sooner than the refill: the denial says so.
    assert_eq!(no.handoff_ms, division::SETTLE_MS, "{no:?}");
    assert!(no.retry_after_ms > no.handoff_ms, "{no:?}");
    // 50 ms later: the global bucket refilled to 950, us-east keeps its last want (100), so
    // eu-west may take 850 and not a token more.
    let at = T0 + division::SETTLE_MS;
    let no = decide(&mut l, at, "eu-west", 851 * T, "e2");
    assert!(!no.allowed, "{no:?}");
    assert_eq!(no.handoff_ms, 0, "us-east lends already: {no:?}");
    let d = decide(&mut l, at, "eu-west", 850 * T, "e3");
    assert_eq!((d.allowed, d.remaining), (true, 0), "{d:?}");
    assert_eq!(bucket(&l, at), 100 * T);
    l.check_invariants().unwrap();
    // What us-east kept covers a repeat of its ask; the next one is denied, and a denied
    // region keeps all of its bucket again: eu-west borrows nothing more.
    let r = acquire(&mut l, at, "us-east", "us1", 100 * T, "u2");
    assert_eq!(granted(&r).granted, 100 * T);
    let r = acquire(&mut l, at, "us-east", "us1", 100 * T, "u3");
    assert!(matches!(r, Response::Denied(_)), "{r:?}");
    // Met, us-east would settle 50 ms after its last ask; denied, it does not.
    let later = at + 10;
    let no = decide(&mut l, later, "eu-west", 100 * T, "e4");
    assert!(!no.allowed, "{no:?}");
    assert_eq!(no.handoff_ms, 0, "a denied region does not settle: {no:?}");
    l.check_invariants().unwrap();
}

#[test]
fn a_busy_weighted_region_keeps_its_whole_part() {
    let mut l = ledger(REGIONAL);
    // us-east's holder asks for 100 of its part of 400: busy, it keeps the 300 left in it.
    let r = acquire(&mut l, T0, "us-east", "us1", 100 * T, "u1");
    assert_eq!(granted(&r).granted, 100 * T);
    // The global bucket holds 900: eu-west (part 500) may take 900 − 300 = 600, ap-south's
    // idle part of 100 included, never us-east's guarantee.
    let no = decide(&mut l, T0, "eu-west", 601 * T, "e1");
    assert!(!no.allowed, "{no:?}");
    let d = decide(&mut l, T0, "eu-west", 600 * T, "e2");
    assert_eq!((d.allowed, d.remaining), (true, 0), "{d:?}");
    assert_eq!(bucket(&l, T0), 300 * T);
    l.check_invariants().unwrap();
    // What us-east kept is still there for it.
    let r = acquire(&mut l, T0, "us-east", "us1", 300 * T, "u2");
    assert_eq!(granted(&r).granted, 300 * T);
    l.check_invariants().unwrap();
    // Once us-east has been idle for the idle window (a lease and the drift), its part is
    // lendable: at T0 + 2.1 s the buckets refilled, and eu-west may take beyond its part.
    let later = T0 + 2_200;
    let d = decide(&mut l, later, "eu-west", 700 * T, "e3");
    assert!(d.allowed, "{d:?}");
    l.check_invariants().unwrap();
}

/// ACME with the story's regions: 50 % each, weighted (the default), lease 2 s, grants of at
/// most `max_grant` tokens.
fn acme_two_regions(max_grant: u64) -> String {
    ACME.replace(
        "      lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}\n",
        &format!("      lease: {{ttl_ms: 2000, max_grant: {max_grant}, max_drift_ms: 250}}\n      regions:\n        - {{region: eu-west, share: \"50%\"}}\n        - {{region: us-east, share: \"50%\"}}\n"),
    )
}

/// One token decided centrally for `holder` in `region` at `t` (request id `id`).
fn decide_one(l: &mut Ledger, region: &str, holder: &str, t: u64, id: &str) -> Decided {
    decide_as(l, t, region, holder, T, id)
}

/// Story part a, skewed (issue 9), at `T0`: 9 decisions in us-east over three gateways and 20
/// in eu-west, mostly on e1; every one admitted (29 of the burst of 40).
fn skewed_burst(l: &mut Ledger) {
    let mut n = 0;
    for (region, holder, count) in [
        ("us-east", "u1", 3),
        ("us-east", "u2", 3),
        ("us-east", "u3", 3),
        ("eu-west", "e1", 13),
        ("eu-west", "e2", 4),
        ("eu-west", "e3", 3),
    ] {
        for _ in 0..count {
            n += 1;
            let d = decide_one(l, region, holder, T0, &format!("d{n}"));
            assert!(d.allowed, "{region}/{holder}: {d:?}");
        }
    }
    l.check_invariants().expect("invariants");
}

#[test]
fn an_admitted_decision_reserves_nothing_when_another_holder_borrows() {
    // Every decision of the burst was admitted and its cost debited at once, so it is demand
    // that has been served: neither its region's keep (us-east) nor its holder's slot inside
    // eu-west may hold tokens back from the gateway that asks next.
    let mut l = ledger(&acme_two_regions(8));
    skewed_burst(&mut l);
    // 57 ms later (us-east settled): 40 − 29 + 0.57 refilled = 11.57 tokens in the bucket.
    let at = T0 + 57;
    assert_eq!(bucket(&l, at), 11 * T + 57 * T / 100);
    let g = granted(&acquire(&mut l, at, "eu-west", "e1", 8 * T, "a1"));
    assert_eq!(g.granted, 8 * T, "{g:?}");
    l.check_invariants().expect("invariants");
}

#[test]
fn a_region_that_only_decided_gets_its_guarantee_back_after_one_denial() {
    // The price of the rule above: settled us-east, whose holders only decided centrally,
    // keeps one token, so eu-west may borrow the rest of the global bucket. us-east's next
    // decision past that token is denied, and from that denial on it keeps all of its own
    // bucket again: what refills next goes to us-east, not to the borrower.
    let mut l = ledger(&acme_two_regions(20));
    skewed_burst(&mut l);
    let at = T0 + 57;
    let g = granted(&acquire(&mut l, at, "eu-west", "e1", 20 * T, "a1"));
    assert_eq!(g.granted, 10 * T, "all but us-east's one kept token: {g:?}");
    assert!(decide_one(&mut l, "us-east", "u1", at, "u1-a").allowed);
    let no = decide_one(&mut l, "us-east", "u2", at, "u2-a");
    assert!(!no.allowed && !no.never, "{no:?}");
    l.check_invariants().expect("invariants");
    // 200 ms later two tokens have refilled globally; us-east's own part (5/s) holds plenty.
    // The borrower asks first and gets nothing beyond eu-west's own part (1 token refilled
    // at 5/s); us-east's decision after it is admitted.
    let later = at + 200;
    let r = acquire(&mut l, later, "eu-west", "e1", 20 * T, "a2");
    let lent = match r {
        Response::Granted(g) => g.granted,
        Response::Denied(_) => 0,
        other => panic!("{other:?}"),
    };
    assert!(
        lent <= T,
        "eu-west borrowed past us-east's guarantee: {lent}"
    );
    let d = decide_one(&mut l, "us-east", "u2", later, "u2-b");
    assert!(d.allowed, "us-east's guarantee after its denial: {d:?}");
    l.check_invariants().expect("invariants");
}
