//! Instructions per keyed decision, Allot against governor, counted by valgrind's callgrind in
//! the same run (issue 13 item 4). Run with:
//!
//! ```text
//! cargo bench -p allot-common --bench instructions
//! ```
//!
//! The `keyed10k_allow` case of the `decision` bench (10,000 keys visited round-robin, a huge
//! rate so that every decision passes, manual clocks: our `ManualClock`, governor's
//! `FakeRelativeClock`), but counted instead of timed. Instruction counts repeat within a few
//! (the hash seeds are random), where this 2-core guest's timings move by 2× between runs, so a
//! change to the decision path can be judged by them first; they are not time (cache misses
//! and atomic read-modify-writes cost far more than their one instruction), so `decision`
//! stays the measure of the target.
//!
//! Each case runs this same binary under `valgrind --tool=callgrind` twice, with 0 and with N
//! decisions after the same setup (every key created first), and reports the difference / N.
//! Needs valgrind on the `PATH` (Debian `valgrind`); without it, it says so and exits 0.

use allot_common::{Clock, Limiter, ManualClock};
use governor::clock::FakeRelativeClock;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

mod keyed;
use keyed::KEYS;

/// Decisions counted per case.
const DECISIONS: usize = 200_000;
/// Set in the child: which case to run, and how many decisions.
const CASE_ENV: &str = "ALLOT_INSTRUCTIONS_CASE";
const N_ENV: &str = "ALLOT_INSTRUCTIONS_N";
/// The cases: (name, argument of the child).
const CASES: [(&str, &str); 3] = [
    ("allot_token_bucket", "token_bucket"),
    ("allot_gcra", "gcra"),
    ("governor", "governor"),
];

fn main() {
    if let Ok(case) = std::env::var(CASE_ENV) {
        let n = std::env::var(N_ENV)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        run_case(&case, n);
        return;
    }
    // `cargo test --benches` runs bench targets without `--bench`: nothing to count then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("valgrind not found: install it (Debian `valgrind`) to count instructions");
        return;
    }
    let me = std::env::current_exe().expect("own path");
    let mut rows = Vec::new();
    for (name, arg) in CASES {
        let base = instructions(&me, arg, 0);
        let with = instructions(&me, arg, DECISIONS);
        assert!(
            with > base,
            "{name}: {with} instructions with the decisions, {base} without"
        );
        let per = (with - base) as f64 / DECISIONS as f64;
        rows.push((name, per));
    }
    let gov = rows.iter().find(|r| r.0 == "governor").map(|r| r.1);
    println!();
    println!("Instructions per decision, keyed10k_allow, manual clocks ({DECISIONS} decisions, callgrind)");
    println!();
    println!("| case | instructions | / governor |");
    println!("| --- | ---: | ---: |");
    for (name, per) in &rows {
        let ratio = gov.map_or("-".into(), |g| format!("{:.2}x", per / g));
        println!("| {name} | {per:.1} | {ratio} |");
    }
}

/// Total instructions callgrind counted for the child running `n` decisions of `case`.
fn instructions(me: &Path, case: &str, n: usize) -> u64 {
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(me)
        .env(CASE_ENV, case)
        .env(N_ENV, n.to_string())
        .output()
        .expect("run valgrind");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "valgrind failed: {text}");
    // "==pid== Collected : N" is callgrind's total of the one event it counts by default (Ir).
    text.lines()
        .find_map(|l| {
            l.split_once("Collected :")
                .map(|(_, n)| n.trim().replace(',', ""))
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no instruction total in valgrind's output: {text}"))
}

/// The child: every key created, then `n` decisions round-robin over the keys.
fn run_case(case: &str, n: usize) {
    let values = keyed::values();
    if case == "governor" {
        let quota = Quota::with_period(Duration::from_nanos(1))
            .expect("1 ns")
            .allow_burst(NonZeroU32::new(4_000_000_000).expect("non-zero"));
        let l: RateLimiter<
            String,
            DefaultKeyedStateStore<String>,
            FakeRelativeClock,
            NoOpMiddleware<_>,
        > = RateLimiter::new(
            quota,
            DefaultKeyedStateStore::default(),
            FakeRelativeClock::default(),
        );
        for k in &values {
            assert!(l.check_key(k).is_ok());
        }
        for i in 0..n {
            black_box(l.check_key(&values[i % KEYS]).is_ok());
        }
        return;
    }
    let entries = keyed::entries(&values);
    let descriptors = keyed::descriptors(&entries);
    let requests = keyed::requests(&descriptors);
    let limiter_config = keyed::config(case);
    let clock = ManualClock::new(1_000);
    let limiter = Limiter::new(limiter_config, clock.now());
    let mut statuses = Vec::with_capacity(4);
    for r in &requests {
        limiter
            .decide(r, clock.now(), &mut statuses)
            .expect("valid");
    }
    for i in 0..n {
        let r = &requests[i % KEYS];
        black_box(
            limiter
                .decide(r, clock.now(), &mut statuses)
                .expect("valid")
                .code,
        );
    }
}
