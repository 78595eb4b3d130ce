//! Ledger unit tests: pure, deterministic, manual time (Unix ms passed to `apply_at`).

use super::*;
use crate::ledger::Ended;

impl Ledger {
    /// The state as bytes (bincode 2, as in a Raft snapshot), to compare states in tests.
    /// A snapshot's copy is completed first, as the state machine's encoding does.
    pub(super) fn snapshot(&self) -> Vec<u8> {
        let l = self.whole();
        bincode::serde::encode_to_vec((&*l, l.incarnation), bincode::config::standard())
            .expect("encodes")
    }

    /// A ledger decoded from [`Self::snapshot`] bytes, its policies parsed again.
    pub(super) fn restore(bytes: &[u8]) -> Result<Ledger, String> {
        let ((mut l, incarnation), _): ((Ledger, u64), usize) =
            bincode::serde::decode_from_slice(bytes, bincode::config::standard())
                .map_err(|e| e.to_string())?;
        l.restore_incarnation(Some(incarnation));
        l.rebuild_derived().map_err(|e| e.to_string())?;
        Ok(l)
    }
}
use allot_common::units::MICROS_PER_TOKEN as T;

pub(super) const T0: u64 = 1_795_988_100_000; // 2026-11-29T21:35:00Z

pub(super) const ACME: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 10
      burst: 40
      name: acme-search
      lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}
";

pub(super) const REGIONAL: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 1000
      burst: 1000
      name: global-1000
      lease: {ttl_ms: 2000, max_grant: 1000, max_drift_ms: 100}
      regions:
        - {region: eu-west, share: \"50%\"}
        - {region: us-east, share: \"40%\"}
        - {region: ap-south, share: \"10%\"}
";

/// REGIONAL with today's hard split: shares are caps only an operator moves.
pub(super) fn regional_cap() -> String {
    REGIONAL.replace(
        "      regions:\n",
        "      shares_mode: cap\n      regions:\n",
    )
}

pub(super) fn key(tenant: &str) -> PolicyKey {
    PolicyKey {
        domain: "api".into(),
        entries: vec![("tenant".into(), tenant.into())],
    }
}

pub(super) fn ledger(yaml: &str) -> Ledger {
    let mut l = Ledger::default();
    let r = l.apply_at(
        &Command::PutPolicy {
            yaml: yaml.into(),
            expected_version: 0,
            request_id: String::new(),
        },
        T0,
    );
    assert_eq!(
        r,
        Response::PolicyPut {
            domain: "api".into(),
            version: 1
        }
    );
    l
}

/// An Acquire of `want` microtokens for `tenant` by `holder` in `region`, with request id `id`.
pub(super) fn acquire_cmd(
    tenant: &str,
    region: &str,
    holder: &str,
    want: u64,
    id: &str,
) -> Command {
    Command::Acquire(Acquire {
        key: key(tenant),
        region: region.into(),
        holder: holder.into(),
        want,
        demand_per_s: 0,
        want_rate_per_s: 0,
        request_id: id.into(),
    })
}

pub(super) fn acquire(
    l: &mut Ledger,
    t: u64,
    region: &str,
    holder: &str,
    want: u64,
    id: &str,
) -> Response {
    l.apply_at(&acquire_cmd("acme", region, holder, want, id), t)
}

/// One whole token for `tenant`, from holder "gw" in region "eu" (key-cap and idleness tests).
fn acquire_one(l: &mut Ledger, tenant: &str, t: u64, id: &str) -> Response {
    l.apply_at(&acquire_cmd(tenant, "eu", "gw", T, id), t)
}

pub(super) fn granted(r: &Response) -> Grant {
    match r {
        Response::Granted(g) => *g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[test]
fn grant_is_capped_debited_and_idempotent() {
    let mut l = ledger(ACME);
    let g = granted(&acquire(&mut l, T0, "eu", "gw1", 30 * T, "r1"));
    assert_eq!((g.granted, g.epoch, g.allocation_id), (20 * T, 1, 1));
    assert_eq!(g.expires_at_ms, T0 + 5000);
    // A retry with the same request id returns the same grant and charges nothing.
    let again = granted(&acquire(&mut l, T0 + 1, "eu", "gw1", 30 * T, "r1"));
    assert_eq!(again, g);
    let s = l.status(&key("acme"), T0 + 1).unwrap();
    // 20 left, plus 1 ms of refill at 10/s.
    assert_eq!(s.bucket_tokens, 20 * T + T / 100);
    // A new request id is a new grant: the rest of the burst, capped at max_grant.
    let g2 = granted(&acquire(&mut l, T0 + 1, "eu", "gw1", 30 * T, "r2"));
    assert_eq!((g2.granted, g2.allocation_id, g2.epoch), (20 * T, 2, 2));
    // 0.01 token left: one token is 99 ms of refill away.
    match acquire(&mut l, T0 + 1, "eu", "gw1", 5 * T, "r3") {
        Response::Denied(d) => assert_eq!(d.retry_after_ms, 99),
        other => panic!("{other:?}"),
    }
    // The same id from another holder is another request (it is denied, not answered from
    // gw1's cache).
    assert!(matches!(
        acquire(&mut l, T0 + 1, "eu", "gw2", 30 * T, "r1"),
        Response::Denied(_)
    ));
}

#[test]
fn total_granted_never_exceeds_burst_plus_rate_times_time() {
    let mut l = ledger(ACME);
    let mut total = 0u64;
    let mut t = T0;
    for i in 0..2_000u64 {
        t += 7 + i % 13;
        if let Response::Granted(g) = acquire(
            &mut l,
            t,
            "eu",
            &format!("gw{}", i % 6),
            9 * T,
            &format!("q{i}"),
        ) {
            total += g.granted;
            // Spend nothing is reported: the worst case for the bound.
        }
        let elapsed_ms = t - T0;
        let bound = 40 * T + 10 * T * elapsed_ms / 1000;
        assert!(
            total <= bound,
            "granted {total} > bound {bound} at {elapsed_ms} ms"
        );
    }
    assert!(total > 40 * T, "the bucket refilled and was granted again");
}

/// Issue 12 (allot-sim seeds 35, 791): a ledger recreated empty after its state was lost grants
/// ids from 1 again. A Report or Release of the lost ledger's allocation with the same id,
/// epoch and holder carries the other incarnation: refused, nothing changed. The same ids with
/// the right incarnation (or none, an older agent) work.
#[test]
fn reports_and_releases_of_another_incarnation_are_refused() {
    let mut lost = ledger(ACME);
    assert_eq!(lost.incarnation(), T0, "the first command's stamp");
    let old = granted(&acquire(&mut lost, T0, "eu", "gw1", 10 * T, "r1"));
    assert_eq!(old.incarnation, T0);
    // Recreated empty a minute later: the same holder is granted id 1 again.
    let t1 = T0 + 60_000;
    let mut l = Ledger::default();
    assert_eq!(l.incarnation(), 0, "not set before the first command");
    let put = Command::PutPolicy {
        yaml: ACME.into(),
        expected_version: 0,
        request_id: String::new(),
    };
    assert!(matches!(l.apply_at(&put, t1), Response::PolicyPut { .. }));
    let g = granted(&acquire(&mut l, t1, "eu", "gw1", 10 * T, "r1"));
    assert_eq!((g.allocation_id, g.epoch), (old.allocation_id, old.epoch));
    assert_eq!((g.incarnation, l.incarnation()), (t1, t1));
    let report = |spend| Command::Report {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw1".into(),
        cumulative_spend: spend,
    };
    let release = |spend| Command::Release {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw1".into(),
        final_spend: spend,
    };
    let from = |incarnation, cmd| Command::InIncarnation {
        incarnation,
        command: Box::new(cmd),
    };
    let refused = Response::Rejected(LedgerError::StaleIncarnation {
        id: g.allocation_id,
        have: t1,
        got: T0,
    });
    let before = l.snapshot();
    for cmd in [from(T0, report(3 * T)), from(T0, release(T))] {
        assert_eq!(l.apply_at(&cmd, t1), refused);
        assert_eq!(l.snapshot(), before, "{cmd:?} changed nothing");
        l.check_invariants().unwrap();
    }
    let batch = Command::Batch(vec![from(T0, release(0))]);
    assert_eq!(
        l.apply_at(&batch, t1),
        Response::Batch(vec![refused.clone()])
    );
    assert_eq!(l.snapshot(), before);
    assert_eq!(
        l.allocation(g.allocation_id).unwrap().state,
        AllocationState::Live
    );
    // The right incarnation is applied as a plain report; none (0, an older agent) too.
    let recorded = |r| Response::Reported {
        recorded: r,
        expires_at_ms: g.expires_at_ms,
    };
    assert_eq!(l.apply_at(&from(t1, report(2 * T)), t1), recorded(2 * T));
    l.check_invariants().unwrap();
    assert_eq!(l.apply_at(&from(0, report(3 * T)), t1), recorded(3 * T));
    l.check_invariants().unwrap();
    assert_eq!(l.apply_at(&report(4 * T), t1), recorded(4 * T));
    l.check_invariants().unwrap();
    assert!(matches!(
        l.apply_at(&from(t1, release(4 * T)), t1 + 1),
        Response::Released { .. }
    ));
    l.check_invariants().unwrap();
    assert!(matches!(
        l.allocation(g.allocation_id).unwrap().state,
        AllocationState::Released { .. }
    ));
    // Only a report or a release carries an incarnation.
    assert!(matches!(
        l.apply_at(&from(t1, Command::Tick), t1 + 1),
        Response::Rejected(LedgerError::BadInput { .. })
    ));
    // Later commands and a snapshot keep it.
    assert_eq!(l.incarnation(), t1);
    assert_eq!(Ledger::restore(&l.snapshot()).unwrap().incarnation(), t1);
}

#[test]
fn reports_are_fenced_max_merged_and_clamped() {
    let mut l = ledger(ACME);
    let g = granted(&acquire(&mut l, T0, "eu", "gw1", 10 * T, "r1"));
    let before = l.snapshot();
    let stale = l.apply_at(
        &Command::Report {
            allocation_id: g.allocation_id,
            epoch: g.epoch + 1,
            holder: "gw1".into(),
            cumulative_spend: T,
        },
        T0 + 1,
    );
    assert!(matches!(
        stale,
        Response::Rejected(LedgerError::StaleEpoch { .. })
    ));
    let unknown = l.apply_at(
        &Command::Report {
            allocation_id: 999,
            epoch: 1,
            holder: "gw1".into(),
            cumulative_spend: T,
        },
        T0 + 1,
    );
    assert!(matches!(
        unknown,
        Response::Rejected(LedgerError::UnknownAllocation { id: 999 })
    ));
    assert_eq!(l.snapshot(), {
        let mut c = Ledger::restore(&before).unwrap();
        c.last_ms = T0 + 1;
        c.snapshot()
    });
    let rep = |l: &mut Ledger, s: u64| {
        l.apply_at(
            &Command::Report {
                allocation_id: g.allocation_id,
                epoch: g.epoch,
                holder: "gw1".into(),
                cumulative_spend: s,
            },
            T0 + 2,
        )
    };
    assert_eq!(
        rep(&mut l, 4 * T),
        Response::Reported {
            recorded: 4 * T,
            expires_at_ms: g.expires_at_ms
        }
    );
    // Cumulative: an older, smaller report changes nothing.
    assert_eq!(
        rep(&mut l, 2 * T),
        Response::Reported {
            recorded: 4 * T,
            expires_at_ms: g.expires_at_ms
        }
    );
    // Beyond the grant: clamped and counted.
    assert_eq!(
        rep(&mut l, 15 * T),
        Response::Reported {
            recorded: 10 * T,
            expires_at_ms: g.expires_at_ms
        }
    );
    assert_eq!(
        l.violations(),
        Violations {
            count: 1,
            excess: 5 * T
        }
    );
    let s = l.status(&key("acme"), T0 + 2).unwrap();
    assert_eq!(
        (
            s.regions[0].granted,
            s.regions[0].reported,
            s.regions[0].overshoot_bound
        ),
        (10 * T, 10 * T, 0)
    );
}

#[test]
fn release_returns_unspent_tokens_never_above_capacity() {
    let mut l = ledger(ACME);
    let g = granted(&acquire(&mut l, T0, "eu", "gw1", 20 * T, "r1"));
    let r = l.apply_at(
        &Command::Release {
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            holder: "gw1".into(),
            final_spend: 5 * T,
        },
        T0 + 100,
    );
    assert_eq!(r, Response::Released { returned: 15 * T });
    // 20 left + 1 refilled in 100 ms + 15 returned = 36.
    assert_eq!(
        l.status(&key("acme"), T0 + 100).unwrap().bucket_tokens,
        36 * T
    );
    // A retried release gets the same answer; a different final spend is refused.
    let again = l.apply_at(
        &Command::Release {
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            holder: "gw1".into(),
            final_spend: 5 * T,
        },
        T0 + 101,
    );
    assert_eq!(again, Response::Released { returned: 15 * T });
    let other = l.apply_at(
        &Command::Release {
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            holder: "gw1".into(),
            final_spend: 6 * T,
        },
        T0 + 101,
    );
    assert!(matches!(
        other,
        Response::Rejected(LedgerError::AllocationEnded {
            how: Ended::Released,
            ..
        })
    ));
    // Releasing after a long idle never lifts the bucket above capacity.
    let g2 = granted(&acquire(&mut l, T0 + 200, "eu", "gw1", 20 * T, "r2"));
    let r = l.apply_at(
        &Command::Release {
            allocation_id: g2.allocation_id,
            epoch: g2.epoch,
            holder: "gw1".into(),
            final_spend: 0,
        },
        T0 + 4_000,
    );
    assert_eq!(r, Response::Released { returned: 20 * T });
    assert_eq!(
        l.status(&key("acme"), T0 + 4_000).unwrap().bucket_tokens,
        40 * T
    );
}

#[test]
fn expired_allocations_strand_their_unreported_tokens() {
    let mut l = ledger(ACME);
    let g = granted(&acquire(&mut l, T0, "eu", "gw1", 20 * T, "r1"));
    l.apply_at(
        &Command::Report {
            allocation_id: g.allocation_id,
            epoch: 1,
            holder: "gw1".into(),
            cumulative_spend: 6 * T,
        },
        T0 + 10,
    );
    let s = l.status(&key("acme"), T0 + 10).unwrap();
    assert_eq!(s.regions[0].overshoot_bound, 14 * T);
    assert_eq!(l.overshoot_bound(), 14 * T);
    // Still live at expires_at + drift − 1 ms.
    l.apply_at(&Command::Tick, g.expires_at_ms + 499);
    assert_eq!(
        l.allocation(g.allocation_id).unwrap().state,
        AllocationState::Live
    );
    l.apply_at(&Command::Tick, g.expires_at_ms + 500);
    assert_eq!(
        l.allocation(g.allocation_id).unwrap().state,
        AllocationState::Expired
    );
    let s = l.status(&key("acme"), g.expires_at_ms + 500).unwrap();
    assert_eq!(
        (
            s.regions[0].live_allocations,
            s.regions[0].stranded,
            s.regions[0].overshoot_bound
        ),
        (0, 14 * T, 0)
    );
    // Dead allocations take no reports or releases.
    let r = l.apply_at(
        &Command::Report {
            allocation_id: g.allocation_id,
            epoch: 1,
            holder: "gw1".into(),
            cumulative_spend: 7 * T,
        },
        T0 + 6000,
    );
    assert!(matches!(
        r,
        Response::Rejected(LedgerError::AllocationEnded {
            how: Ended::Expired,
            ..
        })
    ));
}

#[test]
fn epochs_increase_and_ids_are_never_reused() {
    let mut l = ledger(ACME);
    let mut last_id = 0;
    let mut last_epoch = 0;
    for i in 0..20u64 {
        let t = T0 + i * 3_000;
        let g = granted(&acquire(&mut l, t, "eu", "gw1", T, &format!("r{i}")));
        assert!(g.allocation_id > last_id && g.epoch > last_epoch);
        last_id = g.allocation_id;
        last_epoch = g.epoch;
    }
}

#[test]
fn scarce_quota_is_divided_fairly_not_first_come() {
    let mut l = ledger(ACME);
    // Six gateways each want the whole burst: after the first three the pool is shared.
    let mut grants = Vec::new();
    for i in 0..6 {
        let r = acquire(
            &mut l,
            T0,
            "eu",
            &format!("gw{i}"),
            40 * T,
            &format!("r{i}"),
        );
        grants.push(match r {
            Response::Granted(g) => g.granted,
            _ => 0,
        });
    }
    // gw0: min(20 max grant, 40) = 20; gw1: fair half of 20 = 10; gw2: a third of 10 → 3; …
    // and gw5's part (5/6 of a token) rounds up to one whole token while the pool has one:
    // rounded down to nothing, the last tokens would go to nobody while all six keep asking.
    assert_eq!(grants, vec![20 * T, 10 * T, 3 * T, T, T, T]);
    assert!(grants.iter().sum::<u64>() <= 40 * T);
}

#[test]
fn the_last_whole_tokens_go_to_a_holder_while_several_ask() {
    let mut l = ledger(ACME);
    // Burst 40, grants of at most 20: one holder alone takes 20, then 19; one token is left.
    assert_eq!(
        granted(&acquire(&mut l, T0, "eu", "gw0", 20 * T, "a0")).granted,
        20 * T
    );
    assert_eq!(
        granted(&acquire(&mut l, T0, "eu", "gw0", 19 * T, "a1")).granted,
        19 * T
    );
    // A second holder asks while the first still does: the fair part of one token between two
    // holders is half a token, no whole token. It gets the token (rounded down to nothing, the
    // token went to nobody while both kept asking, each denial saying "retry in 1 ms").
    assert_eq!(
        granted(&acquire(&mut l, T0, "eu", "gw1", 20 * T, "b0")).granted,
        T
    );
    // Now the pool is empty: the denial names the bucket's refill time (one token at 10/s).
    match acquire(&mut l, T0, "eu", "gw0", 20 * T, "a2") {
        Response::Denied(d) => assert_eq!(d.retry_after_ms, 100),
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// An Acquire of 20 tokens for acme from `holder` in region "eu" measuring `demand` tokens/s.
fn acquire_measured(l: &mut Ledger, t: u64, holder: &str, demand: u64, id: &str) -> Response {
    l.apply_at(
        &Command::Acquire(Acquire {
            key: key("acme"),
            region: "eu".into(),
            holder: holder.into(),
            want: 20 * T,
            demand_per_s: demand * T,
            want_rate_per_s: 0,
            request_id: id.into(),
        }),
        t,
    )
}

fn retry_ms(r: &Response) -> u64 {
    match r {
        Response::Denied(d) => d.retry_after_ms,
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// A flooded key (its holders' measured demand above twice its rate): each denial's wait is
/// sized for one token per hungry holder, so the holders come back when there is a token for
/// each of them, not all at the next token for one of them (issue 9, the `flood` part: every
/// holder asked again at each refilled token, a Raft entry each, 135 a second for one key). At
/// or near its rate every denial names the next token, as before.
#[test]
fn a_flooded_keys_denials_space_its_hungry_holders_out() {
    for (demand, waits) in [(100, [100, 200, 300, 300]), (3, [100, 100, 100, 100])] {
        let mut l = ledger(ACME);
        // gw0 empties the bucket (40 tokens, 10/s).
        for id in ["a0", "a1"] {
            assert_eq!(
                granted(&acquire_measured(&mut l, T0, "gw0", demand, id)).granted,
                20 * T
            );
        }
        let seen = [
            retry_ms(&acquire_measured(&mut l, T0, "gw1", demand, "b0")),
            retry_ms(&acquire_measured(&mut l, T0, "gw2", demand, "c0")),
            retry_ms(&acquire_measured(&mut l, T0, "gw0", demand, "a2")),
            // Asking again at once changes nothing: three hungry holders.
            retry_ms(&acquire_measured(&mut l, T0, "gw1", demand, "b1")),
        ];
        assert_eq!(seen, waits, "{demand} tokens/s per holder");
        l.check_invariants().expect("invariants");
    }
}

/// The wait for a token per hungry holder is the bucket's: a calendar quota with fewer tokens
/// left than the holders is not "spent" (a holder would keep that denial until the period's
/// end, locked out of what the quota still holds).
#[test]
fn a_floods_longer_wait_never_reads_the_calendar_quota_as_spent() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, \
                requests_per_unit: 10, burst: 40, quota: {limit: 42, period: month}, lease: \
                {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}}\n";
    let mut l = ledger(yaml);
    for id in ["a0", "a1"] {
        granted(&acquire_measured(&mut l, T0, "gw0", 100, id));
    }
    // Two tokens of the quota left, the bucket empty, three hungry holders.
    let mut last = None;
    for (holder, id) in [("gw1", "b0"), ("gw2", "c0"), ("gw0", "a2")] {
        last = Some(acquire_measured(&mut l, T0, holder, 100, id));
    }
    match last.expect("asked") {
        Response::Denied(d) => {
            assert_eq!(d.retry_after_ms, 300, "{d:?}");
            assert!(d.reason.contains("bucket"), "{d:?}");
        }
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// Contention counts only recent denials: a holder denied longer ago than
/// `CONTENTION_WINDOW_MS` (it left, or has been served since) no longer lengthens the others'
/// waits, and unknown demand (0) is no flood.
#[test]
fn only_recent_denials_and_measured_demand_make_a_flood() {
    let mut l = ledger(ACME);
    for id in ["a0", "a1"] {
        granted(&acquire_measured(&mut l, T0, "gw0", 100, id));
    }
    assert_eq!(
        retry_ms(&acquire_measured(&mut l, T0, "gw1", 100, "b0")),
        100
    );
    assert_eq!(
        retry_ms(&acquire_measured(&mut l, T0, "gw2", 100, "c0")),
        200
    );
    // 1.5 s later gw1's and gw2's denials are old; gw0, asking now, contends alone. (The
    // bucket has refilled 15 tokens meanwhile: gw0 takes them, then is denied.)
    let later = T0 + 1_500;
    let denial = (2..20)
        .map(|i| acquire_measured(&mut l, later, "gw0", 100, &format!("a{i}")))
        .find(|r| matches!(r, Response::Denied(_)))
        .expect("the bucket runs dry");
    assert_eq!(retry_ms(&denial), 100);
    // Unknown demand: no flood, whatever the holders.
    let mut l = ledger(ACME);
    for id in ["a0", "a1"] {
        granted(&acquire_measured(&mut l, T0, "gw0", 0, id));
    }
    for (holder, id) in [("gw1", "b0"), ("gw2", "c0"), ("gw0", "a2")] {
        assert_eq!(retry_ms(&acquire_measured(&mut l, T0, holder, 0, id)), 100);
    }
}

#[test]
fn versioned_handoff_moves_share_only_after_old_allocations_end() {
    let mut l = ledger(&regional_cap());
    let ap = granted(&acquire(&mut l, T0, "ap-south", "ap1", 100 * T, "a1"));
    assert_eq!(ap.granted, 100 * T); // 10% of 1000
    let eu = granted(&acquire(&mut l, T0, "eu-west", "eu1", 1000 * T, "e1"));
    assert_eq!(eu.granted, 500 * T); // 50% of 1000
                                     // Lower ap-south to 0 and raise eu-west to 60%.
    let r = l.apply_at(
        &Command::SetShares {
            policy: "global-1000".into(),
            shares: vec![
                ShareSpec {
                    region: "ap-south".into(),
                    share: Share::Ppm(0),
                },
                ShareSpec {
                    region: "eu-west".into(),
                    share: Share::Rate(600),
                },
            ],
            config_version: 1,
            request_id: String::new(),
        },
        T0 + 1,
    );
    assert_eq!(r, Response::SharesSet { config_version: 1 });
    let share = |l: &Ledger, region: &str, t: u64| {
        l.status(&key("acme"), t)
            .unwrap()
            .regions
            .iter()
            .find(|r| r.region == region)
            .and_then(|r| r.share_ppm)
    };
    assert_eq!(
        share(&l, "eu-west", T0 + 1),
        Some(500_000),
        "ap-south still holds its allocation"
    );
    assert_eq!(
        share(&l, "ap-south", T0 + 1),
        Some(0),
        "renewals stop at once"
    );
    match acquire(&mut l, T0 + 2, "ap-south", "ap1", T, "a2") {
        Response::Denied(d) => assert!(d.reason.contains("no share"), "{d:?}"),
        other => panic!("{other:?}"),
    }
    // A stale share version is refused.
    let r = l.apply_at(
        &Command::SetShares {
            policy: "global-1000".into(),
            shares: vec![],
            config_version: 1,
            request_id: String::new(),
        },
        T0 + 2,
    );
    assert!(matches!(
        r,
        Response::Rejected(LedgerError::SharesVersionNotNewer { .. })
    ));
    // ap-south releases with its final spend: the share moves.
    l.apply_at(
        &Command::Release {
            allocation_id: ap.allocation_id,
            epoch: ap.epoch,
            holder: "ap1".into(),
            final_spend: 40 * T,
        },
        T0 + 3,
    );
    assert_eq!(share(&l, "eu-west", T0 + 3), Some(600_000));
    // The next eu-west grant is in a greater epoch and may use the larger share.
    let eu2 = granted(&acquire(
        &mut l,
        T0 + 1_000,
        "eu-west",
        "eu1",
        1000 * T,
        "e2",
    ));
    assert!(eu2.epoch > eu.epoch);
    // Shares above 100% are refused and change nothing.
    let r = l.apply_at(
        &Command::SetShares {
            policy: "global-1000".into(),
            shares: vec![ShareSpec {
                region: "us-east".into(),
                share: Share::Ppm(500_000),
            }],
            config_version: 2,
            request_id: String::new(),
        },
        T0 + 1_001,
    );
    assert!(
        matches!(r, Response::Rejected(LedgerError::SharesOverfull { .. })),
        "{r:?}"
    );
}

#[test]
fn handoff_also_completes_when_the_old_allocation_expires() {
    let mut l = ledger(&regional_cap());
    let ap = granted(&acquire(&mut l, T0, "ap-south", "ap1", 100 * T, "a1"));
    l.apply_at(
        &Command::SetShares {
            policy: "global-1000".into(),
            shares: vec![
                ShareSpec {
                    region: "ap-south".into(),
                    share: Share::Ppm(0),
                },
                ShareSpec {
                    region: "eu-west".into(),
                    share: Share::Ppm(600_000),
                },
            ],
            config_version: 1,
            request_id: String::new(),
        },
        T0 + 1,
    );
    let eu_share = |l: &Ledger, t| {
        l.status(&key("acme"), t)
            .unwrap()
            .regions
            .iter()
            .find(|r| r.region == "eu-west")
            .and_then(|r| r.share_ppm)
    };
    acquire(&mut l, T0 + 2, "eu-west", "eu1", T, "e1");
    // The status shows the handoff in progress: ap-south's part is 0 and its configured share 0,
    // with its old 10 % still held back for its live allocation.
    let status = l.status(&key("acme"), T0 + 2).unwrap();
    let ap_row = status
        .regions
        .iter()
        .find(|r| r.region == "ap-south")
        .unwrap();
    assert_eq!(
        (ap_row.share_ppm, ap_row.guarantee_ppm, ap_row.reserved_ppm),
        (Some(0), Some(0), 100_000)
    );
    let eu_row = status
        .regions
        .iter()
        .find(|r| r.region == "eu-west")
        .unwrap();
    assert_eq!(
        (eu_row.share_ppm, eu_row.guarantee_ppm, eu_row.reserved_ppm),
        (Some(500_000), Some(600_000), 0)
    );
    l.apply_at(&Command::Tick, ap.expires_at_ms + 99);
    assert_eq!(eu_share(&l, ap.expires_at_ms + 99), Some(500_000));
    l.apply_at(&Command::Tick, ap.expires_at_ms + 100);
    assert_eq!(eu_share(&l, ap.expires_at_ms + 100), Some(600_000));
}

#[test]
fn fixed_window_allocations_never_outlive_their_window() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 100, algorithm: fixed_window, lease: {ttl_ms: 30000, max_grant: 100}}\n";
    let mut l = ledger(yaml);
    // T0 is 21:35:00.000: the minute window ends at 21:36:00.
    let t = T0 + 45_000;
    let g = granted(&acquire(&mut l, t, "eu", "gw", 80 * T, "r1"));
    assert_eq!(g.expires_at_ms, T0 + 60_000);
    let g2 = granted(&acquire(&mut l, t, "eu", "gw", 80 * T, "r2"));
    assert_eq!(g2.granted, 20 * T);
    assert!(
        matches!(acquire(&mut l, t, "eu", "gw3", T, "r3"), Response::Denied(ref d) if d.retry_after_ms == 15_000)
    );
}

#[test]
fn sliding_algorithms_cannot_be_leased_globally() {
    let mut l = Ledger::default();
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_log, name: logins}\n";
    let r = l.apply_at(
        &Command::PutPolicy {
            yaml: yaml.into(),
            expected_version: 0,
            request_id: String::new(),
        },
        T0,
    );
    match r {
        Response::Rejected(LedgerError::BadInput { field, reason: m }) => assert!(
            field == "yaml"
                && m.contains("logins")
                && m.contains("sliding_log")
                && m.contains("global"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(l.policy_version("api"), 0);
    let local = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_log, scope: local}\n";
    let r = l.apply_at(
        &Command::PutPolicy {
            yaml: local.into(),
            expected_version: 0,
            request_id: String::new(),
        },
        T0,
    );
    assert!(matches!(r, Response::PolicyPut { version: 1, .. }));
    let r = acquire(&mut l, T0, "eu", "gw", T, "r1");
    assert!(
        matches!(r, Response::Rejected(LedgerError::ScopeLocal { .. })),
        "{r:?}"
    );
}

#[test]
fn bad_input_is_refused_precisely_and_changes_nothing() {
    let mut l = ledger(REGIONAL);
    let before = l.snapshot();
    let cases: Vec<(Command, &str)> = vec![
        (Command::Acquire(Acquire { key: key("acme"), region: "eu-west".into(), holder: "h".into(), want: 0, demand_per_s: 0, want_rate_per_s: 0, request_id: "x".into() }), "BadInput"),
        (Command::Acquire(Acquire { key: key("acme"), region: "mars".into(), holder: "h".into(), want: T, demand_per_s: 0, want_rate_per_s: 0, request_id: "x".into() }), "UnknownRegion"),
        (Command::Acquire(Acquire { key: PolicyKey { domain: "nope".into(), entries: vec![("tenant".into(), "a".into())] }, region: "eu-west".into(), holder: "h".into(), want: T, demand_per_s: 0, want_rate_per_s: 0, request_id: "x".into() }), "UnknownDomain"),
        (Command::Acquire(Acquire { key: PolicyKey { domain: "api".into(), entries: vec![("tenant".into(), String::new())] }, region: "eu-west".into(), holder: "h".into(), want: T, demand_per_s: 0, want_rate_per_s: 0, request_id: "x".into() }), "BadInput"),
        (Command::Acquire(Acquire { key: PolicyKey { domain: "api".into(), entries: vec![("user".into(), "u".into())] }, region: "eu-west".into(), holder: "h".into(), want: T, demand_per_s: 0, want_rate_per_s: 0, request_id: "x".into() }), "NoMatchingLimit"),
        (Command::Acquire(Acquire { key: key("acme"), region: "eu-west".into(), holder: String::new(), want: T, demand_per_s: 0, want_rate_per_s: 0, request_id: "x".into() }), "BadInput"),
        (Command::PutPolicy { yaml: "domain: api\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 0}}]\n".into(), expected_version: 1, request_id: String::new(), }, "BadInput"),
        (Command::PutPolicy { yaml: REGIONAL.into(), expected_version: 7, request_id: String::new(), }, "PolicyVersionMismatch"),
        (Command::SetShares { policy: "nope".into(), shares: vec![], config_version: 1, request_id: String::new(), }, "UnknownPolicy"),
        (Command::Release { allocation_id: 12, epoch: 1, holder: "h".into(), final_spend: 0 }, "UnknownAllocation"),
    ];
    for (cmd, want) in cases {
        let r = l.apply_at(&cmd, T0);
        match &r {
            Response::Rejected(e) => assert!(format!("{e:?}").starts_with(want), "{cmd:?}: {e:?}"),
            other => panic!("{cmd:?} was not refused: {other:?}"),
        }
    }
    assert_eq!(l.snapshot(), before, "refused commands changed state");
}

#[test]
fn calendar_quota_limits_grants_and_resets_next_month() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000, quota: {limit: 50, period: month}, lease: {max_grant: 30}}\n";
    let mut l = ledger(yaml);
    assert_eq!(
        granted(&acquire(&mut l, T0, "eu", "gw", 30 * T, "r1")).granted,
        30 * T
    );
    assert_eq!(
        granted(&acquire(&mut l, T0, "eu", "gw", 30 * T, "r2")).granted,
        20 * T
    );
    let dec_1 = 1_796_083_200_000; // 2026-12-01T00:00:00Z
    match acquire(&mut l, T0 + 1000, "eu", "gw", 30 * T, "r3") {
        Response::Denied(d) => {
            assert_eq!(d.retry_after_ms, dec_1 - (T0 + 1000));
            assert!(d.reason.contains("calendar"), "{d:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        granted(&acquire(&mut l, dec_1, "eu", "gw", 30 * T, "r4")).granted,
        30 * T
    );
}

#[test]
fn idle_keys_are_evicted_at_the_cap_active_ones_are_not() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 10, max_keys: 2}\n";
    let mut l = ledger(yaml);
    let a = granted(&acquire_one(&mut l, "a", T0, "1"));
    granted(&acquire_one(&mut l, "b", T0, "2"));
    let r = acquire_one(&mut l, "c", T0, "3");
    assert!(
        matches!(r, Response::Rejected(LedgerError::TableFull { .. })),
        "{r:?}"
    );
    l.apply_at(
        &Command::Release {
            allocation_id: a.allocation_id,
            epoch: a.epoch,
            holder: "gw".into(),
            final_spend: T,
        },
        T0 + 10,
    );
    // "a" has no live allocation but its bucket is not full yet: still not idle.
    assert!(matches!(
        acquire_one(&mut l, "c", T0 + 10, "4"),
        Response::Rejected(LedgerError::TableFull { .. })
    ));
    // After refill "a" is idle and makes room.
    granted(&acquire_one(&mut l, "c", T0 + 200, "5"));
    assert_eq!(l.key_count(), 2);
}

#[test]
fn stamped_time_never_goes_back_and_snapshots_round_trip() {
    let mut l = ledger(ACME);
    let g = granted(&acquire(&mut l, T0 + 1000, "eu", "gw1", 20 * T, "r1"));
    // An entry stamped earlier is applied at the latest time seen.
    let g2 = granted(&acquire(&mut l, T0, "eu", "gw2", 20 * T, "r2"));
    assert_eq!(g2.issued_at_ms, T0 + 1000);
    assert_eq!(l.last_ms(), T0 + 1000);
    let bytes = l.snapshot();
    let r = Ledger::restore(&bytes).unwrap();
    assert_eq!(r.snapshot(), bytes);
    assert_eq!(r.allocation(g.allocation_id), l.allocation(g.allocation_id));
    assert!(Ledger::restore(&bytes[..bytes.len() / 2]).is_err());
}

fn release_cmd(g: &Grant, holder: &str, final_spend: u64) -> Command {
    Command::Release {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: holder.into(),
        final_spend,
    }
}

#[test]
fn finished_allocations_are_forgotten_and_snapshots_stay_bounded() {
    let mut l = ledger(ACME);
    let mut t = T0;
    let mut first = None;
    for i in 0..100_000u64 {
        t += 10;
        let holder = format!("gw{}", i % 7);
        let g = granted(&acquire(&mut l, t, "eu", &holder, T, &format!("c{i}")));
        first.get_or_insert(g);
        let r = l.apply_at(&release_cmd(&g, &holder, 0), t);
        assert_eq!(r, Response::Released { returned: T });
        assert!(l.allocation_count() <= MAX_ENDED_KEPT);
    }
    // Within the retention a retried release gets its same answer.
    let last = l
        .allocations()
        .last()
        .cloned()
        .expect("recent allocation kept");
    let retry = Command::Release {
        allocation_id: last.id,
        epoch: last.epoch,
        holder: last.holder.to_string(),
        final_spend: 0,
    };
    assert_eq!(l.apply_at(&retry, t), Response::Released { returned: T });
    // A day later one Tick forgets every ended allocation and every remembered answer.
    let day = t + 86_400_000;
    l.apply_at(&Command::Tick, day);
    assert_eq!(l.allocation_count(), 0);
    let size = l.snapshot().len();
    assert!(
        size < 4 * 1024,
        "snapshot of {size} bytes after 100,000 cycles"
    );
    // A forgotten id answers "ended"; an id never granted "not found"; nothing changes.
    let before = l.snapshot();
    match l.apply_at(&release_cmd(&first.unwrap(), "gw0", 0), day) {
        Response::Rejected(
            e @ LedgerError::AllocationEnded {
                how: Ended::Forgotten,
                ..
            },
        ) => {
            assert!(e.to_string().contains("ended"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let never = Command::Report {
        allocation_id: 100_005,
        epoch: 100_005,
        holder: "gw0".into(),
        cumulative_spend: 0,
    };
    assert!(matches!(
        l.apply_at(&never, day),
        Response::Rejected(LedgerError::UnknownAllocation { .. })
    ));
    assert_eq!(l.snapshot(), before);
    // Epochs still increase for a holder whose earlier allocations are all forgotten.
    let g = granted(&acquire(&mut l, day, "eu", "gw0", T, "after"));
    assert!(g.epoch > 100_000 && g.allocation_id == g.epoch, "{g:?}");
}

#[test]
fn reports_and_releases_from_another_holder_are_refused() {
    let mut l = ledger(ACME);
    let g = granted(&acquire(&mut l, T0, "eu", "gw1", 10 * T, "r1"));
    let before = l.snapshot();
    let report = Command::Report {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw2".into(),
        cumulative_spend: 10 * T,
    };
    for cmd in [report, release_cmd(&g, "gw2", 0)] {
        match l.apply_at(&cmd, T0) {
            Response::Rejected(e @ LedgerError::NotHolder { .. }) => {
                assert!(e.to_string().contains("not held by \"gw2\""), "{e}")
            }
            other => panic!("{cmd:?}: {other:?}"),
        }
    }
    assert_eq!(l.snapshot(), before, "a foreign holder changed state");
    assert_eq!(
        l.apply_at(&release_cmd(&g, "gw1", 0), T0),
        Response::Released { returned: 10 * T }
    );
}

pub(super) const HUGE: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 1000000000000
      burst: 1000000000000
      lease: {ttl_ms: 60000, max_grant: 1000000000000, max_drift_ms: 60000}
";

#[test]
fn totals_stay_exact_at_extreme_policies() {
    // 10¹² tokens/s with 60 s leases: 19 full grants of 10¹⁸ microtokens would overflow u64.
    let mut l = ledger(HUGE);
    let want = allot_common::units::MAX_TOKENS * T;
    let mut last = None;
    let mut totals = Vec::new();
    for (tenant, base) in [("a", T0), ("b", T0 + 25_000)] {
        let mut total: u128 = 0;
        for s in 0..25u64 {
            let r = l.apply_at(
                &Command::Acquire(Acquire {
                    key: key(tenant),
                    region: "eu".into(),
                    holder: "gw".into(),
                    want,
                    demand_per_s: 0,
                    want_rate_per_s: 0,
                    request_id: format!("{tenant}{s}"),
                }),
                base + s * 1_000,
            );
            if let Response::Granted(g) = r {
                total += u128::from(g.granted);
                last = Some(g);
            }
        }
        assert!(
            total <= u128::from(u64::MAX) && total > 18 * u128::from(want),
            "{tenant}: {total}"
        );
        let st = l.status(&key(tenant), base + 24_000).unwrap();
        assert_eq!(u128::from(st.regions[0].granted), total);
        totals.push(total);
    }
    // The ledger-wide bound saturates instead of wrapping.
    assert_eq!(l.overshoot_bound(), u64::MAX);
    // Claims far beyond a grant are clamped and their excess saturates.
    let g = last.unwrap();
    for _ in 0..2 {
        l.apply_at(
            &Command::Report {
                allocation_id: g.allocation_id,
                epoch: g.epoch,
                holder: "gw".into(),
                cumulative_spend: u64::MAX,
            },
            T0 + 49_000,
        );
    }
    assert_eq!(l.violations().count, 2);
    assert_eq!(l.violations().excess, u64::MAX);
    // Everything expires: a's tokens were never reported and stay stranded, the live totals
    // go to 0.
    l.apply_at(&Command::Tick, T0 + 200_000);
    let st = l.status(&key("a"), T0 + 200_000).unwrap();
    assert_eq!(
        (
            u128::from(st.regions[0].stranded),
            st.regions[0].granted,
            st.regions[0].live_allocations
        ),
        (totals[0], 0, 0)
    );
    assert_eq!(l.overshoot_bound(), 0);
}

#[test]
fn a_release_refunds_only_into_what_its_grant_was_charged() {
    // A calendar quota added after the grant: the release must not refund into it.
    let v1 = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 40, lease: {max_grant: 20}}\n";
    let v2 = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 40, quota: {limit: 100, period: month}, lease: {max_grant: 20}}\n";
    let put = |l: &mut Ledger, yaml: &str, v: u64, t: u64| {
        let r = l.apply_at(
            &Command::PutPolicy {
                yaml: yaml.into(),
                expected_version: v,
                request_id: String::new(),
            },
            t,
        );
        assert!(matches!(r, Response::PolicyPut { .. }), "{r:?}");
    };
    let mut l = ledger(v1);
    let old = granted(&acquire(&mut l, T0, "eu", "gw", 20 * T, "r1"));
    put(&mut l, v2, 1, T0 + 1);
    assert_eq!(
        granted(&acquire(&mut l, T0 + 2, "eu", "gw", 10 * T, "r2")).granted,
        10 * T
    );
    l.apply_at(&release_cmd(&old, "gw", 0), T0 + 3);
    let st = l.status(&key("acme"), T0 + 3).unwrap();
    assert_eq!(st.calendar_remaining, Some(90 * T));

    // An algorithm-family change (token bucket → fixed window) between grant and release.
    let fw = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 40, algorithm: fixed_window, lease: {ttl_ms: 30000, max_grant: 40}}\n";
    let mut l = ledger(v1);
    let old = granted(&acquire(&mut l, T0, "eu", "gw", 20 * T, "r1"));
    put(&mut l, fw, 1, T0 + 1);
    let mut window_total = 0;
    for i in 0..3 {
        if let Response::Granted(g) = acquire(&mut l, T0 + 2, "eu", "gw", 40 * T, &format!("w{i}"))
        {
            window_total += g.granted;
        }
    }
    l.apply_at(&release_cmd(&old, "gw", 0), T0 + 3);
    for i in 3..6 {
        if let Response::Granted(g) = acquire(&mut l, T0 + 4, "eu", "gw", 40 * T, &format!("w{i}"))
        {
            window_total += g.granted;
        }
    }
    assert!(
        window_total <= 40 * T,
        "granted {window_total} in a 40-token window"
    );
}

#[test]
fn fixed_window_grants_inside_the_drift_margin_are_not_made() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 100, algorithm: fixed_window, lease: {ttl_ms: 30000, max_grant: 100, max_drift_ms: 500}}\n";
    let mut l = ledger(yaml);
    // The minute window ends at T0 + 60 s: 300 ms before it, a grant would arrive unusable.
    match acquire(&mut l, T0 + 59_700, "eu", "gw", 10 * T, "r1") {
        Response::Denied(d) => {
            assert_eq!(d.retry_after_ms, 300);
            assert!(d.reason.contains("drift margin"), "{d:?}");
        }
        other => panic!("{other:?}"),
    }
    // In the next window the whole limit is there.
    assert_eq!(
        granted(&acquire(&mut l, T0 + 60_000, "eu", "gw", 100 * T, "r2")).granted,
        100 * T
    );
}

#[test]
fn calendar_keys_become_idle_when_their_period_ends() {
    let yaml = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 10, max_keys: 1, quota: {limit: 1000, period: day}}\n";
    let mut l = ledger(yaml);
    let a = granted(&acquire_one(&mut l, "a", T0, "1"));
    l.apply_at(&release_cmd(&a, "gw", T), T0 + 10);
    // Same day, bucket full again: "a" still holds this day's calendar usage.
    assert!(matches!(
        acquire_one(&mut l, "b", T0 + 5_000, "2"),
        Response::Rejected(LedgerError::TableFull { .. })
    ));
    // The next day "a"'s usage limits nothing: it is idle and makes room.
    let next_day = (T0 / 86_400_000 + 1) * 86_400_000;
    granted(&acquire_one(&mut l, "b", next_day, "3"));
    assert_eq!(l.key_count(), 1);
}

/// Issue 10 item 10: a region share below one whole token of capacity (5 % of burst 10) could
/// never be granted anything; it is refused where it is set, and nothing changes.
#[test]
fn a_share_below_one_token_is_refused_where_it_is_set() {
    let tiny = ACME.replace(
        "      lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}\n",
        "      lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}\n      regions:\n        - {region: eu-west, share: \"5%\"}\n        - {region: us-east, share: \"95%\"}\n",
    )
    .replace("burst: 40", "burst: 10");
    let mut l = Ledger::default();
    let r = l.apply_at(
        &Command::PutPolicy {
            yaml: tiny,
            expected_version: 0,
            request_id: String::new(),
        },
        T0,
    );
    let Response::Rejected(e @ LedgerError::NeverGrantable { .. }) = r else {
        panic!("expected a refusal, got {r:?}");
    };
    let m = e.to_string();
    assert!(
        m.contains("eu-west") && m.contains("5.0000%") && m.contains("10.0000%"),
        "{m}"
    );
    assert_eq!(l.policy_version("api"), 0, "nothing was installed");

    // The same through `shares set` on an installed policy (burst 40: 2.5 % holds one token).
    let mut l = ledger(&ACME.replace(
        "      lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}\n",
        "      lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}\n      regions:\n        - {region: eu-west, share: \"50%\"}\n        - {region: us-east, share: \"50%\"}\n",
    ));
    let before = l.snapshot();
    let set = |ppm| Command::SetShares {
        policy: "acme-search".into(),
        shares: vec![ShareSpec {
            region: "eu-west".into(),
            share: Share::Ppm(ppm),
        }],
        config_version: 2,
        request_id: String::new(),
    };
    // At the time of the last entry, so only the refusal itself could change anything.
    let r = l.apply_at(&set(20_000), T0);
    assert!(
        matches!(&r, Response::Rejected(e @ LedgerError::NeverGrantable { .. }) if e.to_string().contains("2.5000%")),
        "{r:?}"
    );
    assert_eq!(l.snapshot(), before, "a refused share changes nothing");
    // Exactly one token, and 0, are accepted.
    assert!(matches!(
        l.apply_at(&set(25_000), T0 + 2),
        Response::SharesSet { .. }
    ));
}
