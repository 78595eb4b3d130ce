//! In-process agent decisions, ns per decision: `Enforcer::decide_now` for a `scope: local` key
//! and for a leased key spending a held allocation, against the decision core's own
//! `Limiter::decide` on the same local rule, measured in the same run as the baseline.
//!
//! Run: `cargo bench -p allot-agent --bench decide`. The ratio table is printed at the end.

use allot_agent::lease::{HeldAllocation, LeaseBook, LeaseSettings};
use allot_agent::Enforcer;
use allot_common::clock::{Clock, MonotonicClock};
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request};
use allot_common::limiter::{Code, Limiter};
use criterion::{criterion_group, Criterion};
use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const POLICY: &str = "domain: bench
descriptors:
  - key: tenant
    value: local
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 4000000000, scope: local}
  - key: tenant
    value: leased
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 4000000000, lease: {max_grant: 4000000000}}
";

fn enforcer() -> Enforcer {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    // Lease events are not served here: the leased key gets one large allocation by hand.
    std::mem::forget(rx);
    let book = Arc::new(LeaseBook::new(clock, LeaseSettings::new("bench", "eu"), tx));
    let config = ConfigSet::from_yaml(POLICY, Path::new("bench.yaml")).unwrap();
    Enforcer::new(config, book)
}

fn bench(c: &mut Criterion) {
    let e = enforcer();
    let local = [Entry {
        key: "tenant",
        value: "local",
    }];
    let leased = [Entry {
        key: "tenant",
        value: "leased",
    }];
    let dl = [Descriptor {
        entries: &local,
        hits_addend: None,
    }];
    let dg = [Descriptor {
        entries: &leased,
        hits_addend: None,
    }];
    let rl = Request {
        domain: "bench",
        descriptors: &dl,
        hits_addend: None,
    };
    let rg = Request {
        domain: "bench",
        descriptors: &dg,
        hits_addend: None,
    };
    let mut st = Vec::with_capacity(4);

    // Make the leased key warm: see it once, then hand it a big allocation.
    let _ = e.decide_now(&rg, &mut st);
    let kl = e.book().existing("bench", 1, &leased).expect("leased key");
    let now = e.clock().now();
    let warm = Arc::new(HeldAllocation::new(
        1,
        1,
        u64::MAX / 2,
        now + 3_600_000_000_000,
        0,
        1,
    ));
    kl.value.protocol.install(warm);
    assert_eq!(e.decide_now(&rg, &mut st).unwrap().code, Code::Ok);

    let limiter = Limiter::new(
        ConfigSet::from_yaml(POLICY, Path::new("bench.yaml")).unwrap(),
        MonotonicClock::new().now(),
    );
    let clock = MonotonicClock::new();
    let mut g = c.benchmark_group("agent_decide");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    g.bench_function("core_limiter_local", |b| {
        b.iter(|| black_box(limiter.decide(&rl, clock.now(), &mut st).unwrap().code))
    });
    g.bench_function("agent_local", |b| {
        b.iter(|| black_box(e.decide_now(&rl, &mut st).unwrap().code))
    });
    g.bench_function("agent_leased", |b| {
        b.iter(|| black_box(e.decide_now(&rg, &mut st).unwrap().code))
    });
    g.finish();
    assert_eq!(e.decide_now(&rg, &mut st).unwrap().code, Code::Ok);
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    report();
}

/// Prints the medians and the ratios to the core limiter from criterion's estimates of this run.
fn report() {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("criterion/agent_decide");
    let median = |case: &str| -> Option<f64> {
        let text = std::fs::read_to_string(dir.join(case).join("new/estimates.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v["median"]["point_estimate"].as_f64()
    };
    let base = median("core_limiter_local");
    println!("\n| case | median ns/decision | / core limiter |\n| --- | ---: | ---: |");
    for case in ["core_limiter_local", "agent_local", "agent_leased"] {
        if let Some(m) = median(case) {
            let ratio = base.map_or(String::from("-"), |b| format!("{:.2}x", m / b));
            println!("| {case} | {m:.1} | {ratio} |");
        }
    }
}
