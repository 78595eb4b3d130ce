//! Rate-carrying allocations (design §9, issue 9 item 4): a grant's rate is diverted from the
//! buckets' refill, Σ live rates stay below the policy's rate, a holder's next Acquire ends its
//! earlier accrual, and Release and expiry settle base and accrual exactly.

use super::rates::MAX_RATE_PPM;
use super::tests::{granted, key, ledger, ACME, HUGE, T0};
use super::*;
use allot_common::algorithm::Rate;
use allot_common::units::{MICROS_PER_TOKEN as T, NANOS_PER_SEC};

/// An Acquire of `want` µtok now and `rate` µtok/s over the lease, for tenant `tenant`.
fn acquire_rate(
    l: &mut Ledger,
    t: u64,
    tenant: &str,
    holder: &str,
    (want, rate): (u64, u64),
    id: &str,
) -> Response {
    l.apply_at(
        &Command::Acquire(Acquire {
            key: key(tenant),
            region: "eu".into(),
            holder: holder.into(),
            want,
            demand_per_s: 0,
            want_rate_per_s: rate,
            request_id: id.into(),
        }),
        t,
    )
}

fn release(l: &mut Ledger, t: u64, g: &Grant, holder: &str, spend: u64) -> Response {
    l.apply_at(
        &Command::Release {
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            holder: holder.into(),
            final_spend: spend,
        },
        t,
    )
}

/// Acquires for `holder` at `t` until denied (at most 100 times); whether it was denied.
fn drain(l: &mut Ledger, t: u64, tenant: &str, holder: &str) -> bool {
    (0..100).any(|i| {
        matches!(
            acquire_rate(l, t, tenant, holder, (40 * T, 0), &format!("drain-{t}-{i}")),
            Response::Denied(_)
        )
    })
}

fn bucket_tokens(l: &Ledger, tenant: &str, t: u64) -> u64 {
    l.status(&key(tenant), t).unwrap().bucket_tokens
}

/// The global bucket's refill rate now.
fn bucket_rate(l: &Ledger, tenant: &str) -> Rate {
    let kid = l.resolve(&key(tenant)).unwrap().1;
    l.keys[&kid].global.params.refill_rate()
}

fn per_s(micros: u64) -> Rate {
    Rate::new(micros, NANOS_PER_SEC).unwrap()
}

#[test]
fn a_rate_is_diverted_from_the_bucket_counted_in_the_bound_and_settled_at_release() {
    let mut l = ledger(ACME);
    let g = granted(&acquire_rate(&mut l, T0, "a", "gw1", (20 * T, 5 * T), "r1"));
    // Base 20 of the burst of 40 now, and 5/s for the 5 s lease: 25 more at most.
    assert_eq!(
        (g.granted, g.rate_per_s, g.promised),
        (20 * T, 5 * T, 25 * T)
    );
    assert_eq!(l.allocation(g.allocation_id).unwrap().granted, 45 * T);
    assert_eq!(
        l.status(&key("a"), T0).unwrap().regions[0].overshoot_bound,
        45 * T
    );
    // The bucket refills at the 5/s the rate leaves.
    assert_eq!(bucket_rate(&l, "a"), per_s(5 * T));
    assert_eq!(bucket_tokens(&l, "a", T0 + 1_000), 25 * T);
    // Released after 1 s having spent the base and 3 of the 5 accrued: 2 come back, and the
    // bucket refills at the whole 10/s again.
    assert_eq!(
        release(&mut l, T0 + 1_000, &g, "gw1", 23 * T),
        Response::Released { returned: 2 * T }
    );
    assert_eq!(bucket_rate(&l, "a"), per_s(10 * T));
    assert_eq!(bucket_tokens(&l, "a", T0 + 1_000), 27 * T);
    assert_eq!(bucket_tokens(&l, "a", T0 + 2_000), 37 * T);
    assert_eq!(l.overshoot_bound(), 0);
    // A retry gets the same answer and changes nothing.
    assert_eq!(
        release(&mut l, T0 + 1_500, &g, "gw1", 23 * T),
        Response::Released { returned: 2 * T }
    );
    assert_eq!(bucket_tokens(&l, "a", T0 + 2_000), 37 * T);
    l.check_invariants().unwrap();
}

#[test]
fn live_rates_never_reach_the_policy_rate() {
    let mut l = ledger(ACME);
    // One holder asking for everything gets all but the bucket's 1 ppm.
    let g1 = granted(&acquire_rate(
        &mut l,
        T0,
        "a",
        "gw1",
        (20 * T, 10 * T),
        "r1",
    ));
    assert_eq!(g1.rate_per_s, 10 * T * u64::from(MAX_RATE_PPM) / 1_000_000);
    assert_eq!(bucket_rate(&l, "a"), per_s(10), "1 ppm of 10/s");
    // Nothing is left for another holder's rate; its base still comes from the bucket.
    let g2 = granted(&acquire_rate(&mut l, T0, "a", "gw2", (20 * T, 5 * T), "r2"));
    assert_eq!((g2.rate_per_s, g2.promised), (0, 0));
    assert!(g2.granted > 0);
    // Drained by gw2, the bucket denies a base, and the rate is taken.
    assert!(drain(&mut l, T0, "a", "gw2"));
    assert!(matches!(
        acquire_rate(&mut l, T0, "a", "gw3", (20 * T, 5 * T), "r3"),
        Response::Denied(_)
    ));
    // Its denial says when a rate can free up (a quarter lease), not when the 1 ppm the
    // bucket keeps would refill a token (a day).
    match acquire_rate(&mut l, T0, "a", "gw4", (20 * T, 0), "r3b") {
        Response::Denied(d) => assert_eq!(d.retry_after_ms, 5_000 / 4),
        other => panic!("{other:?}"),
    }
    // A rate only (no base) is a grant: gw1 renews while the bucket is empty. Its rate is now
    // its max-min fair part: gw2, gw3 and gw4 asked within the lease (20 tokens each, 4/s over
    // the 5 s lease, more than a quarter), so they have claims too, whether or not they asked
    // rates (the bucket's refill serves their lumps). Their wants exceed the rate, so a
    // quarter of it stays pooled in the bucket (`POOLED_PPM`): a quarter of the 750,000 ppm
    // left of the 999,999 to divide (the pooled 249,999 rounded down).
    let renewed = granted(&acquire_rate(
        &mut l,
        T0 + 10,
        "a",
        "gw1",
        (T, 10 * T),
        "r4",
    ));
    assert_eq!(renewed.rate_per_s, 10 * T * 187_500 / 1_000_000);
    assert!(renewed.rate_per_s < g1.rate_per_s);
    assert_eq!(renewed.granted, 0, "the bucket holds 10 µtok");
    l.check_invariants().unwrap();
}

#[test]
fn the_holders_next_acquire_ends_its_earlier_accrual_granted_or_denied() {
    let mut l = ledger(ACME);
    let g1 = granted(&acquire_rate(&mut l, T0, "a", "gw1", (40 * T, 5 * T), "r1"));
    assert_eq!(g1.granted, 20 * T, "max grant");
    // Another holder's Acquire leaves gw1's accrual alone.
    let _ = acquire_rate(&mut l, T0 + 500, "a", "gw2", (T, 0), "r2");
    assert_eq!(l.allocation(g1.allocation_id).unwrap().granted, 45 * T);
    // gw1's next Acquire, 2 s in: its first allocation keeps base + 2 s of 5/s.
    let g3 = granted(&acquire_rate(
        &mut l,
        T0 + 2_000,
        "a",
        "gw1",
        (T, 5 * T),
        "r3",
    ));
    let first = l.allocation(g1.allocation_id).unwrap();
    assert_eq!(
        (first.granted, first.rate_ppm, first.accrual_end_ms),
        (30 * T, 0, T0 + 2_000)
    );
    assert_eq!(g3.rate_per_s, 5 * T);
    // Released at 3 s having spent 22: entitled to 30 (its accrual ended at 2 s): 8 back.
    assert_eq!(
        release(&mut l, T0 + 3_000, &g1, "gw1", 22 * T),
        Response::Released { returned: 8 * T }
    );
    // A denied Acquire supersedes too: the bucket is drained first (by another holder, which
    // leaves gw1's rate alone).
    assert!(drain(&mut l, T0 + 3_000, "a", "gw2"));
    assert_eq!(l.allocation(g3.allocation_id).unwrap().rate_ppm, 500_000);
    let r = acquire_rate(&mut l, T0 + 3_000, "a", "gw1", (40 * T, 0), "r6");
    assert!(matches!(r, Response::Denied(_)), "{r:?}");
    let third = l.allocation(g3.allocation_id).unwrap();
    assert_eq!((third.rate_ppm, third.granted), (0, third.base + 5 * T));
    assert_eq!(bucket_rate(&l, "a"), per_s(10 * T));
    l.check_invariants().unwrap();
}

#[test]
fn an_expired_rate_strands_its_unreported_part_and_frees_its_rate() {
    let mut l = ledger(ACME);
    let g = granted(&acquire_rate(&mut l, T0, "a", "gw1", (20 * T, 5 * T), "r1"));
    let r = l.apply_at(
        &Command::Report {
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            holder: "gw1".into(),
            cumulative_spend: 30 * T,
        },
        T0 + 2_000,
    );
    assert!(matches!(r, Response::Reported { recorded, .. } if recorded == 30 * T));
    // Dead at expiry + drift (5.5 s): the unreported 15 of base + promise stay spent.
    l.apply_at(&Command::Tick, T0 + 5_500);
    assert_eq!(
        l.allocation(g.allocation_id).unwrap().state,
        AllocationState::Expired
    );
    let st = l.status(&key("a"), T0 + 5_500).unwrap();
    assert_eq!(
        (st.regions[0].stranded, st.regions[0].overshoot_bound),
        (15 * T, 0)
    );
    assert_eq!(bucket_rate(&l, "a"), per_s(10 * T));
    l.check_invariants().unwrap();
}

#[test]
fn rates_at_the_extremes_stay_exact() {
    // 10¹² tokens/s with 60 s leases: a whole rate's promise (6·10¹⁹ µtok) leaves u64.
    let mut l = ledger(HUGE);
    let want = allot_common::units::MAX_TOKENS * T;
    let g = granted(&acquire_rate(
        &mut l,
        T0,
        "x",
        "gw1",
        (want, u64::MAX),
        "r1",
    ));
    let a = l.allocation(g.allocation_id).unwrap().clone();
    assert!(g.rate_per_s > 0);
    assert_eq!(a.granted, g.granted + g.promised);
    assert_eq!(g.promised, g.rate_per_s * 60, "60 s of the rate, exactly");
    // The totals are full: whatever else is granted still fits them.
    let g2 = acquire_rate(&mut l, T0, "x", "gw2", (want, u64::MAX), "r2");
    if let Response::Granted(g2) = g2 {
        assert!(
            u128::from(g2.granted) + u128::from(g2.promised) <= u128::from(u64::MAX - a.granted)
        );
    }
    l.check_invariants().unwrap();
    // Released at once with nothing spent: the base and 1 ms of the rate come back.
    let r = release(&mut l, T0 + 1, &g, "gw1", 0);
    assert_eq!(
        r,
        Response::Released {
            returned: g.granted + g.rate_per_s / 1000
        }
    );
    // A rate of 1 µtok/s is below 1 ppm of 10¹⁸: no rate.
    let g3 = granted(&acquire_rate(&mut l, T0 + 2, "y", "gw", (T, 1), "r3"));
    assert_eq!((g3.rate_per_s, g3.promised), (0, 0));
    l.check_invariants().unwrap();
}

/// One step of a random demand sequence.
#[derive(Debug, Clone)]
enum Step {
    /// Holder h asks for `want` tokens and `rate` tokens/s (tenths).
    Acquire {
        h: usize,
        want: u64,
        rate_tenths: u64,
    },
    /// Holder h releases its oldest allocation having spent `pct` % of what it may by now.
    Release { h: usize, pct: u64 },
    /// Time passes, ms.
    Wait(u64),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (0..4usize, 0..30u64, 0..150u64).prop_map(|(h, want, rate_tenths)| Step::Acquire {
            h,
            want,
            rate_tenths
        }),
        (0..4usize, 0..=100u64).prop_map(|(h, pct)| Step::Release { h, pct }),
        (1..3_000u64).prop_map(Step::Wait),
    ]
}

proptest::proptest! {
    /// For random demand sequences from four holders: Σ live rates stay below the policy's rate
    /// (`check_invariants` after every step), and what the holders can have admitted since the
    /// start — released spend, plus everything live allocations were entitled to by now, plus
    /// every expired allocation's whole grant — stays within B + r·Δt (the bound at the start
    /// is 0: a fresh key).
    #[test]
    fn admitted_stays_within_burst_plus_rate_times_time(steps in proptest::collection::vec(step(), 1..60)) {
        let mut l = ledger(ACME);
        let mut now = T0;
        let mut held: Vec<Vec<Grant>> = vec![Vec::new(); 4];
        let mut released: u128 = 0;
        for (i, s) in steps.iter().enumerate() {
            match *s {
                Step::Acquire { h, want, rate_tenths } => {
                    let r = acquire_rate(&mut l, now, "p", &format!("gw{h}"), (want * T + 1, rate_tenths * T / 10), &format!("q{i}"));
                    if let Response::Granted(g) = r {
                        held[h].push(g);
                    }
                }
                Step::Release { h, pct } => {
                    if let Some(g) = held[h].first().copied() {
                        let may = l.allocation(g.allocation_id).map_or(0, |a| a.entitled_at(now));
                        let spend = may / 100 * pct;
                        if let Response::Released { .. } = release(&mut l, now, &g, &format!("gw{h}"), spend) {
                            released += u128::from(spend);
                            held[h].remove(0);
                        }
                    }
                }
                Step::Wait(ms) => {
                    now += ms;
                    l.apply_at(&Command::Tick, now);
                }
            }
            l.check_invariants().map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
            let kid_live: u64 = l.keys.values().map(|k| super::rates::key_rate_ppm(k)).max().unwrap_or(0);
            proptest::prop_assert!(kid_live <= u64::from(MAX_RATE_PPM));
        }
        // Whatever is still held could all have been spent by now; an expired one, all of it.
        let mut may: u128 = released;
        for g in held.iter().flatten() {
            if let Some(a) = l.allocation(g.allocation_id) {
                may += u128::from(match a.state {
                    AllocationState::Live => a.entitled_at(now),
                    AllocationState::Expired => a.granted,
                    AllocationState::Released { .. } => 0,
                });
            }
        }
        let contract = 40 * u128::from(T) + u128::from(now - T0) * 10 * u128::from(T) / 1000;
        proptest::prop_assert!(may <= contract, "{} > {}", may, contract);
    }
}

/// A rate's promise is spendable before the holder reports, so the calendar quota counts it at
/// grant: without that a holder could spend base + accrual against a quota charged only the
/// base. Superseding the rate and releasing give back exactly what was not spent.
#[test]
fn a_rate_promise_is_charged_to_the_calendar_quota_and_refunded_when_unspent() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 40, quota: {limit: 100, period: month}, lease: {max_grant: 20}}\n";
    let mut l = ledger(yaml);
    let left = |l: &Ledger, t: u64| l.status(&key("a"), t).unwrap().calendar_remaining;
    let g = granted(&acquire_rate(&mut l, T0, "a", "gw1", (20 * T, 5 * T), "r1"));
    assert_eq!((g.granted, g.promised), (20 * T, 25 * T));
    assert_eq!(left(&l, T0), Some(55 * T), "base 20 and promise 25 charged");
    l.check_invariants().unwrap();
    // The next Acquire at +2 s ends the accrual: 10 of the 25 accrued, 15 come back.
    let g2 = granted(&acquire_rate(&mut l, T0 + 2000, "a", "gw1", (T, 0), "r2"));
    assert_eq!(g2.promised, 0);
    assert_eq!(left(&l, T0 + 2000), Some(70 * T - g2.granted));
    l.check_invariants().unwrap();
    // Released having spent 12 of its 30: 18 go back to the quota.
    release(&mut l, T0 + 2500, &g, "gw1", 12 * T);
    assert_eq!(left(&l, T0 + 2500), Some(88 * T - g2.granted));
    l.check_invariants().unwrap();
}

/// Near the end of a calendar quota, a promise is cut to what the quota has left.
#[test]
fn a_rate_promise_never_exceeds_what_the_calendar_quota_has_left() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 40, quota: {limit: 30, period: month}, lease: {max_grant: 20}}\n";
    let mut l = ledger(yaml);
    let g = granted(&acquire_rate(&mut l, T0, "a", "gw1", (20 * T, 5 * T), "r1"));
    assert_eq!(g.granted, 20 * T);
    assert!(g.promised <= 10 * T, "{g:?}");
    let st = l.status(&key("a"), T0).unwrap();
    assert_eq!(st.calendar_remaining, Some(10 * T - g.promised));
    l.check_invariants().unwrap();
}
