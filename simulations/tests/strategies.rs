//! The strategy table in small (issue 12 item 4): the qualitative facts that must hold on the
//! acme burst under the same faults, and a document that the same seed writes identically.

use allot_common::units::MICROS_PER_TOKEN;
use allot_simulations::sim::faults::{Fault, FaultKind};
use allot_simulations::sim::workload::{Workload, ACME};
use allot_simulations::sim::{run, SimConfig};
use allot_simulations::strategy::compare::Cell;
use allot_simulations::strategy::measure::measure;
use allot_simulations::strategy::{doc, Strategy};

/// The allocator partition of the short runs, ms.
const PARTITION_MS: (u64, u64) = (3_500, 4_500);

/// A short run of `s` on the acme burst (traffic 1.5–5.5 s, the burst at 2.5 s), the allocator
/// partitioned from every agent for a second: the debug build simulates about a second per
/// second.
fn short(s: Strategy) -> SimConfig {
    let schedule = (0..4)
        .map(|agent| Fault {
            kind: FaultKind::PartitionAgent,
            at_ms: PARTITION_MS.0,
            until_ms: PARTITION_MS.1,
            target: agent,
            amount: 0,
        })
        .collect();
    SimConfig {
        duration_ms: 6_000,
        traffic_from_ms: 1_500,
        schedule: Some(schedule),
        ..s.config(Workload::AcmeBurst)
    }
}

fn cell(s: Strategy) -> (Cell, bool) {
    let r = run(3, &short(s)).expect("run");
    let cell = Cell {
        strategy: s,
        workload: Workload::AcmeBurst,
        measured: measure(&r, &[ACME], PARTITION_MS),
        trace_hash: r.trace_hash,
    };
    (cell, r.violations.is_empty())
}

#[test]
fn local_buckets_overshoot_central_does_not_and_leases_stay_within_their_bound() {
    let (local, _) = cell(Strategy::LocalWhole);
    let (central, central_clean) = cell(Strategy::Central);
    let (leases, leases_clean) = cell(Strategy::Leases);
    let t = MICROS_PER_TOKEN;
    // Four gateways with a whole bucket each let the burst and 3× the rate through.
    assert!(
        local.measured.overshoot.micros > ACME.burst,
        "{:?}",
        local.measured.overshoot
    );
    assert_eq!(
        local.measured.calls_per_1000, 0.0,
        "local buckets never call"
    );
    // An exact central counter: less than one token (the allocator decides a request up to
    // 35 ms after it left us-east, so on send times a fraction of a token can show).
    assert!(
        central.measured.overshoot.micros < t,
        "{:?}",
        central.measured
    );
    assert!(central_clean && central.measured.max_bound == 0);
    assert_eq!(
        central.measured.partition.1, 0,
        "nothing decided while cut off"
    );
    // Leases: within the bound they reported, no invariant broken, fewer calls than central.
    assert!(leases_clean, "{:?}", leases.measured);
    assert!(leases.measured.overshoot.micros <= leases.measured.reported_bound);
    assert!(leases.measured.calls_per_1000 < central.measured.calls_per_1000);
    assert!(
        local.measured.latency[1].p99_us < central.measured.latency[1].p50_us,
        "central decisions from us-east pay the 70 ms round trip"
    );

    // The same seed writes the same document and plots.
    let (again, _) = cell(Strategy::Leases);
    assert_eq!(again.trace_hash, leases.trace_hash);
    let dirs = ["a", "b"]
        .map(|d| std::env::temp_dir().join(format!("allot-strategies-{}-{d}", std::process::id())));
    doc::write(&dirs[0], 3, &[local.clone(), central.clone(), leases], &[]).expect("doc a");
    doc::write(&dirs[1], 3, &[local, central, again], &[]).expect("doc b");
    let mut files: Vec<_> = std::fs::read_dir(&dirs[0])
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    files.sort();
    assert!(files.len() >= 2, "{files:?}");
    for f in &files {
        let a = std::fs::read(dirs[0].join(f)).expect("read a");
        let b = std::fs::read(dirs[1].join(f)).expect("read b");
        assert!(a == b, "{f:?} differs between two runs of seed 3");
    }
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}
