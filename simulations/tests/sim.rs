//! The deterministic simulation (issue 12): a seed replays bit for bit, and a short sweep of
//! seeds with random fault schedules breaks no invariant. `allot-sim --seeds 1000` is the long
//! sweep; seeds that once failed stay here as regressions, a release-build test (`#[ignore]`d
//! in the debug run; `scripts/test.sh` step 4 runs it with `cargo test --release --workspace
//! --test sim -- --ignored`).

use allot_simulations::sim::summary::{one, Summary};
use allot_simulations::sim::workload::Workload;
use allot_simulations::sim::{run, SimConfig};

/// Short runs: the debug build simulates about 1 s per real second on a loaded machine.
fn short() -> SimConfig {
    SimConfig {
        duration_ms: 6_000,
        traffic_from_ms: 1_500,
        ..SimConfig::default()
    }
}

#[test]
fn one_seed_replays_bit_for_bit() {
    // Seed 0 injects a region cut, an agent's drifting clock and a leader change.
    let config = short();
    let a = run(0, &config).expect("run");
    let b = run(0, &config).expect("run again");
    assert!(a.requests > 0 && a.trace.len() as u64 > a.requests);
    assert_eq!(a.trace_hash, b.trace_hash, "{}", one(&a, "seed 0"));
    assert_eq!(a.trace, b.trace);
}

#[test]
fn a_short_sweep_breaks_no_invariant() {
    let config = SimConfig {
        // The Zipf workload's 1,000 keys take minutes in a debug build: `allot-sim` runs it.
        workload: None,
        ..short()
    };
    let mut summary = Summary::default();
    let mut reports = String::new();
    for seed in 0..40 {
        let config = SimConfig {
            workload: Some(
                [Workload::AcmeBurst, Workload::Quiet, Workload::RegionalSkew][seed as usize % 3],
            ),
            ..config.clone()
        };
        let r = run(seed, &config).expect("run");
        if !r.violations.is_empty() {
            let replay = format!(
                "cargo run --release -p allot-simulations --bin allot-sim -- --seed {seed} \
                 --duration-ms 6000 --traffic-from-ms 1500 --workload {}",
                r.workload.name()
            );
            reports.push_str(&one(&r, &replay));
        }
        summary.add(&r);
    }
    println!("{reports}{}", summary.text());
    assert!(summary.requests > 0 && summary.invariant_checks > 0);
    assert!(summary.failed.is_empty(), "{reports}{}", summary.text());
}

#[test]
#[ignore = "minutes in a debug build: scripts/test.sh runs it in release (-- --ignored)"]
fn seeds_that_once_failed_stay_fixed() {
    // Found by `allot-sim --seeds 200` (default 12 s runs), both checker bugs around a state
    // loss: seed 12, a grant the lost cluster made just before the loss, answered after it,
    // was taken for a grant the new cluster lost; seed 80, a sample at the loss's instant did
    // not allow the recreated bucket's fresh quota. (Seeds 55 and 164 failed the same ways;
    // 55 is a Zipf run, minutes in a debug build.)
    //
    // Found by `allot-sim --seeds 1000` (default 12 s runs; Zipf workloads, a few seconds each
    // in a release build: run this test with `--release`): seed 115, a production bug in ledger
    // time (design §6 "Clocks"): a node crashed and came back leader with its downtime uncounted,
    // stamping 2.3 s behind real time; the follower elected after it was still anchored before
    // the crash and stamped real time again, so ledger time jumped 2.4 s at once and expired
    // allocations their holders could still spend for a lease (`ended-behind-holder`). The
    // anchor now starts afresh at each leader term.
    //
    // Seeds 35 and 791 (and 7), a production bug (issue 12): after a state loss the recreated
    // ledger counted allocation ids from 1 again, so an agent's Release of the lost cluster's
    // allocation 9 ended the new allocation 9 of the same holder (`ended-behind-holder`), and
    // an old Report was recorded against a new allocation (`stale-report-accepted`); seed 7
    // admitted beyond the bound after its state loss. Grants now carry the ledger's
    // incarnation, and a Report or Release of another incarnation is refused (design §3, §4).
    //
    // Found by `allot-sim --seeds 1000` on 721b3f6, both checker bugs: seed 484 (acme-burst,
    // delayed leader) counted an admission at its send time, 5397.2 ms, though it waited 80 ms
    // for tokens the ledger debited at 5400 ms: 0.028 tokens "over" B + r·Δ with a bound of 0.
    // An admission now counts in the windows it surely falls in (sent after t₁, answered by
    // t₂). Seed 863 (zipf-1000) crashed the leader just after it answered a grant: the
    // survivors held the entry but applied it only once a new leader committed, 1.75 s later,
    // and the grant was called lost after 1 s. A grant is now lost only when a ledger that
    // applied past every log index it can sit at does not know it.
    for seed in [12, 80, 115, 35, 791, 7, 484, 863] {
        let r = run(seed, &SimConfig::default()).expect("run");
        assert!(
            r.violations.is_empty(),
            "{}",
            one(&r, &format!("seed {seed}"))
        );
    }
}
