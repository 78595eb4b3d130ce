//! Bounded client-keyed tables (issue 10 item 11): floods of distinct keys, regions, holders
//! and request ids stay within their caps, refusals are counted and change nothing, eviction
//! looks at a bounded number of entries, and the idle index survives a snapshot.

use super::tests::{acquire_cmd as ask, key, ledger, T0};
use super::*;
use allot_common::units::MICROS_PER_TOKEN as T;

/// One limit of 10/s, burst 10, with the given caps.
fn capped(max_keys: u64, max_regions: u64, max_holders: u64) -> Ledger {
    ledger(&format!(
        "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {{unit: second, requests_per_unit: 10, burst: 10, max_keys: {max_keys}, lease: {{ttl_ms: 5000, max_grant: 10, max_drift_ms: 500, max_regions: {max_regions}, max_holders: {max_holders}}}}}\n"
    ))
}

/// Applies `cmd` at `t`, checks every invariant, and returns the answer.
fn step(l: &mut Ledger, cmd: &Command, t: u64) -> Response {
    let r = l.apply_at(cmd, t);
    l.check_invariants().unwrap();
    r
}

/// Applies `cmd` at `t` (no later than the ledger's last time, so nothing else can change)
/// and asserts it is refused as `table` full, leaving the replicated state unchanged.
fn refused_unchanged(l: &mut Ledger, cmd: &Command, t: u64, table: TableKind) {
    let before = l.snapshot();
    let refused = l.table_stats().counters(table).refused;
    match step(l, cmd, t) {
        Response::Rejected(LedgerError::TableFull { table: full, .. }) => {
            assert_eq!(full.name(), table.name(), "{full}")
        }
        other => panic!("expected {table:?} to be full, got {other:?}"),
    }
    assert_eq!(l.snapshot(), before, "a refused insert changes nothing");
    assert_eq!(l.table_stats().counters(table).refused, refused + 1);
}

fn usage(l: &Ledger, table: TableKind) -> TableUsage {
    l.tables().into_iter().find(|u| u.table == table).unwrap()
}

#[test]
fn a_flood_of_busy_keys_stops_at_max_keys_and_each_refusal_is_counted() {
    let mut l = capped(8, 4, 4);
    for i in 0..8 {
        let r = step(
            &mut l,
            &ask(&format!("k{i}"), "eu", "gw", T, &format!("r{i}")),
            T0,
        );
        assert!(matches!(r, Response::Granted(_)), "{r:?}");
    }
    for i in 8..1_000 {
        let cmd = ask(&format!("k{i}"), "eu", "gw", T, &format!("r{i}"));
        refused_unchanged(&mut l, &cmd, T0, TableKind::Keys);
    }
    assert_eq!(l.key_count(), 8);
    let u = usage(&l, TableKind::Keys);
    assert_eq!(
        (u.entries, u.counters.refused, u.counters.evicted),
        (8, 992, 0)
    );
    // No key is evictable (each holds a live allocation): nothing was looked at.
    assert_eq!(l.table_stats().eviction_probes, 0);
}

#[test]
fn a_flood_of_regions_stops_at_max_regions_per_key() {
    let mut l = capped(100, 4, 100);
    for i in 0..4 {
        let r = step(
            &mut l,
            &ask("acme", &format!("r{i}"), "gw", T, &format!("a{i}")),
            T0,
        );
        assert!(matches!(r, Response::Granted(_)), "{r:?}");
    }
    for i in 4..200 {
        let cmd = ask("acme", &format!("r{i}"), "gw", T, &format!("a{i}"));
        refused_unchanged(&mut l, &cmd, T0, TableKind::Regions);
    }
    // A known region still gets its grant; another key has its own regions.
    assert!(matches!(
        step(&mut l, &ask("acme", "r0", "gw", T, "again"), T0),
        Response::Granted(_)
    ));
    assert!(matches!(
        step(&mut l, &ask("other", "r9", "gw", T, "other"), T0),
        Response::Granted(_)
    ));
    let u = usage(&l, TableKind::Regions);
    assert_eq!((u.entries, u.counters.refused), (5, 196));
}

#[test]
fn a_flood_of_holders_stops_at_max_holders_until_their_asks_age_out() {
    let mut l = capped(100, 4, 3);
    for i in 0..3 {
        let r = step(&mut l, &ask("acme", "eu", &format!("h{i}"), T, "1"), T0);
        assert!(matches!(r, Response::Granted(_)), "{r:?}");
    }
    for i in 3..300 {
        let cmd = ask("acme", "eu", &format!("h{i}"), T, "1");
        refused_unchanged(&mut l, &cmd, T0, TableKind::Holders);
    }
    // A holder already counted asks again; another region has its own holders.
    let r = step(&mut l, &ask("acme", "eu", "h0", T, "2"), T0);
    assert!(matches!(r, Response::Granted(_)), "{r:?}");
    let r = step(&mut l, &ask("acme", "us", "h7", T, "1"), T0);
    assert!(matches!(r, Response::Granted(_)), "{r:?}");
    assert_eq!(usage(&l, TableKind::Holders).entries, 4);
    // Asks older than a lease plus the drift no longer count: a new holder gets in, and the
    // stale asks are dropped.
    let later = T0 + 5_000 + 500 + 1;
    let r = step(&mut l, &ask("acme", "eu", "h9", T, "1"), later);
    assert!(!matches!(r, Response::Rejected(_)), "{r:?}");
    assert_eq!(usage(&l, TableKind::Holders).entries, 2);
    assert_eq!(usage(&l, TableKind::Holders).counters.refused, 297);
}

#[test]
fn a_flood_of_request_ids_keeps_the_answer_cache_bounded() {
    let mut l = capped(100, 4, 4);
    let extra = 10u64;
    let total = MAX_REMEMBERED_REQUESTS as u64 + extra;
    // Central decisions of 1 microtoken: remembered like Acquires, with no allocation to keep.
    for i in 0..total {
        let d = Command::Decide(Decide {
            key: key("acme"),
            region: "eu".into(),
            holder: "gw".into(),
            cost: 1,
            request_id: i.to_string(),
        });
        let r = l.apply_at(&d, T0 + i / 1_000);
        assert!(
            matches!(r, Response::Decided(Decided { allowed: true, .. })),
            "{r:?}"
        );
    }
    l.apply_at(&Command::Tick, T0 + total / 1_000);
    l.check_invariants().unwrap();
    l.check_answer_index().unwrap();
    let u = usage(&l, TableKind::Requests);
    assert_eq!(u.entries, MAX_REMEMBERED_REQUESTS as u64);
    // Forgotten within their retention to keep the cap: counted.
    assert_eq!(u.counters.evicted, extra);
}

/// Keys with a live allocation are not in the idle index at all, and the key that became idle
/// first is the first entry: however many keys there are, making room looks at one entry.
#[test]
fn making_room_looks_at_a_bounded_number_of_entries_whatever_the_key_count() {
    let n = 2_000u64;
    let mut l = capped(n, 4, 4);
    let mut t = T0;
    // One key that will be idle, then n − 1 keys each holding a live allocation.
    let g = match step(&mut l, &ask("idle", "eu", "gw", T, "i"), t) {
        Response::Granted(g) => g,
        other => panic!("{other:?}"),
    };
    let release = Command::Release {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw".into(),
        final_spend: T,
    };
    assert!(matches!(
        step(&mut l, &release, t),
        Response::Released { .. }
    ));
    for i in 1..n {
        let r = l.apply_at(
            &ask(&format!("busy{i}"), "eu", "gw", T, &format!("b{i}")),
            t,
        );
        assert!(matches!(r, Response::Granted(_)), "{r:?}");
    }
    l.check_invariants().unwrap();
    assert_eq!(l.key_count() as u64, n);
    // Once "idle" refilled (0.1 s for one token), a new key evicts it, looking at one entry.
    t += 100;
    let probes = l.table_stats().eviction_probes;
    let r = step(&mut l, &ask("new", "eu", "gw", T, "n"), t);
    assert!(matches!(r, Response::Granted(_)), "{r:?}");
    assert_eq!(l.table_stats().eviction_probes - probes, 1);
    assert_eq!(usage(&l, TableKind::Keys).counters.evicted, 1);
    assert_eq!(l.key_count() as u64, n);
    // The next new key finds no idle key: refused after looking at no entry.
    let probes = l.table_stats().eviction_probes;
    refused_unchanged(
        &mut l,
        &ask("newer", "eu", "gw", T, "m"),
        t,
        TableKind::Keys,
    );
    assert_eq!(l.table_stats().eviction_probes, probes);
}

/// A long flood through a small cap, keys cycling between busy and idle: every new key looks
/// at no more than [`EVICTION_PROBES`] entries, and the table never exceeds its cap.
#[test]
fn eviction_work_per_command_is_bounded_under_churn() {
    let mut l = capped(50, 4, 4);
    let mut t = T0;
    for i in 0..5_000u64 {
        t += 7;
        let probes = l.table_stats().eviction_probes;
        let r = step(
            &mut l,
            &ask(&format!("k{i}"), "eu", "gw", T, &format!("r{i}")),
            t,
        );
        assert!(l.table_stats().eviction_probes - probes <= EVICTION_PROBES);
        assert!(l.key_count() <= 50);
        if let Response::Granted(g) = r {
            let release = Command::Release {
                allocation_id: g.allocation_id,
                epoch: g.epoch,
                holder: "gw".into(),
                final_spend: T,
            };
            step(&mut l, &release, t);
        }
    }
    let u = usage(&l, TableKind::Keys);
    assert!(u.counters.evicted > 4_000, "{u:?}");
    assert_eq!(u.counters.evicted + u.counters.refused + 50, 5_000, "{u:?}");
}

#[test]
fn a_snapshot_keeps_the_idle_index_and_replicas_evict_alike() {
    let mut l = capped(20, 4, 4);
    let mut t = T0;
    let mut cmds = Vec::new();
    for i in 0..60u64 {
        // Every grant lives 5.5 s: keys become evictable as the flood goes on.
        cmds.push((
            ask(&format!("k{i}"), "eu", "gw", 3 * T, &format!("r{i}")),
            t,
        ));
        t += 400;
    }
    let (first, rest) = cmds.split_at(30);
    for (c, at) in first {
        step(&mut l, c, *at);
    }
    let mut restored = Ledger::restore(&l.snapshot()).unwrap();
    assert_eq!(restored.index, l.index, "the index is rebuilt as it was");
    restored.check_invariants().unwrap();
    for (c, at) in rest {
        assert_eq!(step(&mut l, c, *at), step(&mut restored, c, *at));
    }
    assert_eq!(restored.snapshot(), l.snapshot());
    assert!(usage(&l, TableKind::Keys).counters.evicted > 0);
}

/// Each Acquire of a new request id can make an allocation (a grant of a fraction of a token
/// costs one microtoken): live allocations per key and region stop at `lease.max_allocations`
/// until one ends; central decisions, which make none, still pass.
#[test]
fn a_flood_of_tiny_acquires_stops_at_max_allocations_per_key_and_region() {
    let mut l = ledger("domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 10, lease: {ttl_ms: 5000, max_grant: 10, max_allocations: 3}}\n");
    let mut grants = Vec::new();
    for i in 0..3 {
        match step(&mut l, &ask("acme", "eu", "gw", 1, &format!("a{i}")), T0) {
            Response::Granted(g) => grants.push(g),
            other => panic!("{other:?}"),
        }
    }
    for i in 3..500 {
        let cmd = ask("acme", "eu", "gw", 1, &format!("a{i}"));
        refused_unchanged(&mut l, &cmd, T0, TableKind::Allocations);
    }
    // Another region of the key has its own allocations; a decision makes none.
    assert!(matches!(
        step(&mut l, &ask("acme", "us", "gw", 1, "us"), T0),
        Response::Granted(_)
    ));
    let decide = Command::Decide(Decide {
        key: key("acme"),
        region: "eu".into(),
        holder: "gw".into(),
        cost: 1,
        request_id: "d".into(),
    });
    assert!(matches!(
        step(&mut l, &decide, T0),
        Response::Decided(Decided { allowed: true, .. })
    ));
    let u = usage(&l, TableKind::Allocations);
    assert_eq!((u.entries, u.counters.refused), (4, 497));
    // A released allocation makes room for one more.
    let g = grants[0];
    let release = Command::Release {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw".into(),
        final_spend: 1,
    };
    assert!(matches!(
        step(&mut l, &release, T0),
        Response::Released { .. }
    ));
    assert!(matches!(
        step(&mut l, &ask("acme", "eu", "gw", 1, "after"), T0),
        Response::Granted(_)
    ));
    refused_unchanged(
        &mut l,
        &ask("acme", "eu", "gw", 1, "more"),
        T0,
        TableKind::Allocations,
    );
}

/// A central decision of `tokens` for `tenant` by "gw" with request id `id`.
fn decide(tenant: &str, tokens: u64, id: &str) -> Command {
    Command::Decide(Decide {
        key: key(tenant),
        region: "eu".into(),
        holder: "gw".into(),
        cost: tokens * T,
        request_id: id.into(),
    })
}

#[test]
fn an_idle_key_is_forgotten_after_its_retention_and_comes_back_as_it_was() {
    let mut l = capped(100, 4, 4);
    let r = step(&mut l, &decide("a", 1, "d1"), T0);
    assert!(
        matches!(r, Response::Decided(Decided { allowed: true, .. })),
        "{r:?}"
    );
    let Response::Granted(g) = step(&mut l, &ask("b", "eu", "gw", T, "a1"), T0) else {
        panic!("no grant");
    };
    let release = Command::Release {
        allocation_id: g.allocation_id,
        epoch: g.epoch,
        holder: "gw".into(),
        final_spend: 0,
    };
    // "a" is idle from T0 + 100 ms (one token back at 10/s); "b" once its allocation is dead
    // (expiry + drift, T0 + 5.5 s), from the command that ends it (the allocator ticks every
    // 250 ms): here T0 + 6 s.
    step(&mut l, &Command::Tick, T0 + 6_000);
    step(&mut l, &Command::Tick, T0 + 30_000);
    assert_eq!(
        l.key_count(),
        2,
        "nothing is forgotten before its retention"
    );
    let stale_before = step(&mut l, &release, T0 + 30_000);
    step(&mut l, &Command::Tick, T0 + 60_099);
    assert_eq!(l.key_count(), 2, "a: idle for 59.999 s");
    step(&mut l, &Command::Tick, T0 + 61_000);
    assert_eq!(l.key_count(), 1, "a is forgotten 60 s after it became idle");
    step(&mut l, &Command::Tick, T0 + 66_000);
    assert_eq!(l.key_count(), 0);
    // Fencing is unchanged: the stale release gets the answer it got while the key existed,
    // and the next grant has a new id.
    assert_eq!(step(&mut l, &release, T0 + 66_000), stale_before);
    let Response::Granted(g2) = step(&mut l, &ask("b", "eu", "gw", T, "a2"), T0 + 66_000) else {
        panic!("no grant");
    };
    assert!(g2.allocation_id > g.allocation_id);
    // "a" comes back with its whole burst, as it had when forgotten.
    let r = step(&mut l, &decide("a", 10, "d2"), T0 + 66_000);
    assert!(
        matches!(r, Response::Decided(Decided { allowed: true, .. })),
        "{r:?}"
    );
    let r = step(&mut l, &decide("a", 1, "d3"), T0 + 66_000);
    assert!(
        matches!(r, Response::Decided(Decided { allowed: false, .. })),
        "{r:?}"
    );
}

#[test]
fn a_key_with_a_live_allocation_or_a_long_lease_is_kept() {
    // A 2-minute lease: its key is not idle while the allocation lives, and its holders' asks
    // count for the TTL plus the drift after that, so it is kept that long.
    let mut l = ledger(
        "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 10, lease: {ttl_ms: 120000, max_grant: 10, max_drift_ms: 500}}\n",
    );
    let r = step(&mut l, &ask("b", "eu", "gw", T, "a1"), T0);
    assert!(matches!(r, Response::Granted(_)), "{r:?}");
    step(&mut l, &Command::Tick, T0 + 110_000);
    assert_eq!(l.key_count(), 1, "live allocation");
    // Dead at T0 + 120.5 s, ended by the tick at T0 + 121 s (its bucket long full again): kept
    // 120.5 s more.
    step(&mut l, &Command::Tick, T0 + 121_000);
    step(&mut l, &Command::Tick, T0 + 241_000);
    assert_eq!(l.key_count(), 1, "within TTL + drift of becoming idle");
    step(&mut l, &Command::Tick, T0 + 242_000);
    assert_eq!(l.key_count(), 0);
}

#[test]
fn replicas_restored_from_a_snapshot_forget_the_same_keys_at_the_same_command() {
    let mut a = capped(100_000, 4, 4);
    let mut t = T0;
    for i in 0..300u64 {
        t += 400;
        step(
            &mut a,
            &decide(&format!("k{}", i % 150), 1, &format!("d{i}")),
            t,
        );
    }
    let mut b = Ledger::restore(&a.snapshot()).expect("restores");
    for i in 0..400u64 {
        // Some keys come back, most stay away; the clock passes several retentions.
        t += 777;
        let cmd = decide(&format!("k{}", (i * 7) % 40), 1, &format!("e{i}"));
        assert_eq!(step(&mut a, &cmd, t), step(&mut b, &cmd, t));
        assert_eq!(a.snapshot(), b.snapshot());
    }
    assert!(
        a.key_count() < 150,
        "keys were forgotten: {}",
        a.key_count()
    );
}

#[test]
fn forgetting_work_per_check_is_bounded() {
    let mut l = capped(100_000, 4, 4);
    let n = MAX_FORGOTTEN_PER_CHECK as u64 + 100;
    for i in 0..n {
        step(&mut l, &decide(&format!("k{i}"), 1, &format!("d{i}")), T0);
    }
    // All idle from T0 + 100 ms: one check forgets at most its budget, the next the rest.
    l.apply_at(&Command::Tick, T0 + 61_000);
    assert_eq!(l.key_count() as u64, 100);
    l.apply_at(&Command::Tick, T0 + 61_500);
    assert_eq!(l.key_count() as u64, 100, "one check a ledger second");
    step(&mut l, &Command::Tick, T0 + 62_000);
    assert_eq!(l.key_count(), 0);
}
