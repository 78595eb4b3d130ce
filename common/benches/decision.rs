//! Decision-core micro-benchmarks against `governor`, measured in the same run (issue 2,
//! "Benchmark"). Run with:
//!
//! ```text
//! cargo bench -p allot-common --bench decision
//! ```
//!
//! Every case is measured for Allot's token bucket, Allot's GCRA and governor (GCRA, its only
//! algorithm), once with real clocks (our `MonotonicClock`, governor's default `QuantaClock`) and
//! once with manual clocks (our `ManualClock`, governor's `FakeRelativeClock`) so that the cost of
//! reading the time is separated from the cost of deciding:
//!
//! * `clock_now`: the clock read alone;
//! * `single_allow`: one thread, one key, a huge rate and burst so that every decision passes;
//! * `single_deny`: one thread, one key, an exhausted bucket so that every decision is denied;
//! * `threads2_allow`: two threads deciding on one key (ns per decision = wall time / decisions);
//! * `keyed10k_allow`: 10,000 distinct keys visited round-robin: our `Limiter::decide` on a one-rule
//!   config (request validation, rule match, key lookup, decision, statuses) against governor's
//!   keyed `RateLimiter` (`DefaultKeyedStateStore`, i.e. DashMap) with pre-built `String` keys.
//!
//! After criterion has run, the bench prints a table of median ns per decision and the ratio
//! ours / governor, read back from the estimates criterion wrote in this same run (results older
//! than this process are never used). The recorded results are in `docs/benchmarks.md`.

use allot_common::algorithm::{Gcra, Rate, RateAlgorithm, TokenBucket};
use allot_common::direct::DirectLimiter;
use allot_common::units::{tokens_to_micros, NANOS_PER_SEC};
use allot_common::{Clock, Code, Limiter, ManualClock, MonotonicClock};
use criterion::{BenchmarkId, Criterion};
use governor::clock::{DefaultClock, FakeRelativeClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant, SystemTime};

mod keyed;
use keyed::KEYS;

/// One token, in microtokens.
const ONE: u64 = 1_000_000;
/// "Huge" rate of the allowing cases: 10^9 per second (governor: 1 ns per cell).
const HUGE: u64 = 1_000_000_000;
/// Burst of the allowing cases: with the manual clocks time never advances, so this many
/// decisions must pass on one key before it would start denying (a full run makes < 10^9).
const BURST: u32 = 4_000_000_000;

type GovDirect<C> =
    RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<<C as governor::clock::Clock>::Instant>>;
type GovKeyed<C> = RateLimiter<
    String,
    DefaultKeyedStateStore<String>,
    C,
    NoOpMiddleware<<C as governor::clock::Clock>::Instant>,
>;

/// 10^9 cells per second (one per ns) with a burst of [`BURST`].
fn huge_quota() -> Quota {
    Quota::with_period(Duration::from_nanos(1))
        .unwrap()
        .allow_burst(NonZeroU32::new(BURST).unwrap())
}

/// One token per hour, burst 1: denies everything after the first decision.
fn tiny_quota() -> Quota {
    Quota::per_hour(NonZeroU32::new(1).unwrap())
}

/// `tokens` per `per_ns`, in lowest terms as the config builds every rate (`Rate::new`): the
/// same rate as the unreduced terms, for which every answer is the same, and whose full level
/// fits the packed 128-bit state.
fn rate(tokens: u64, per_ns: u64) -> Rate {
    Rate::new(tokens_to_micros(tokens), per_ns).expect("positive rate")
}

fn tb_huge() -> TokenBucket {
    TokenBucket {
        capacity: tokens_to_micros(BURST as u64),
        rate: rate(HUGE, NANOS_PER_SEC),
    }
}

fn gcra_huge() -> Gcra {
    Gcra {
        capacity: tokens_to_micros(BURST as u64),
        rate: rate(HUGE, NANOS_PER_SEC),
    }
}

fn tb_tiny() -> TokenBucket {
    TokenBucket {
        capacity: ONE,
        rate: rate(1, 3_600 * NANOS_PER_SEC),
    }
}

fn gcra_tiny() -> Gcra {
    Gcra {
        capacity: ONE,
        rate: rate(1, 3_600 * NANOS_PER_SEC),
    }
}

/// The two clock pairings.
#[derive(Clone, Copy)]
enum Clocks {
    /// Our `MonotonicClock` and governor's `DefaultClock` (quanta).
    Real,
    /// Our `ManualClock` and governor's `FakeRelativeClock`, never advanced.
    Manual,
}

impl Clocks {
    fn name(self) -> &'static str {
        match self {
            Clocks::Real => "real_clock",
            Clocks::Manual => "manual_clock",
        }
    }
}

const CLOCKS: [Clocks; 2] = [Clocks::Real, Clocks::Manual];

/// A limiter under test, object-safe enough to share the bench loops.
trait Decider: Sync {
    /// One decision of cost 1; true when allowed.
    fn decide(&self) -> bool;
}

impl<A: RateAlgorithm + Sync, C: Clock> Decider for DirectLimiter<A, C>
where
    A::State: Send,
{
    #[inline]
    fn decide(&self) -> bool {
        DirectLimiter::decide(self, ONE).allowed
    }
}

impl<C> Decider for GovDirect<C>
where
    C: governor::clock::Clock + Sync,
    C::Instant: Sync,
{
    #[inline]
    fn decide(&self) -> bool {
        self.check().is_ok()
    }
}

/// The three contenders of a direct (one-key) case, in table order.
fn direct_limiters(clocks: Clocks, allow: bool) -> Vec<(&'static str, Box<dyn Decider>)> {
    fn ours<A: RateAlgorithm + Sync + 'static>(a: A, clocks: Clocks) -> Box<dyn Decider>
    where
        A::State: Send + 'static,
    {
        match clocks {
            Clocks::Real => Box::new(DirectLimiter::new(a, MonotonicClock::new())),
            Clocks::Manual => Box::new(DirectLimiter::new(a, ManualClock::new(1_000))),
        }
    }
    let quota = if allow { huge_quota() } else { tiny_quota() };
    let gov: Box<dyn Decider> = match clocks {
        Clocks::Real => Box::new(GovDirect::<DefaultClock>::direct(quota)),
        Clocks::Manual => Box::new(GovDirect::direct_with_clock(
            quota,
            FakeRelativeClock::default(),
        )),
    };
    let (tb, gcra) = if allow {
        (ours(tb_huge(), clocks), ours(gcra_huge(), clocks))
    } else {
        (ours(tb_tiny(), clocks), ours(gcra_tiny(), clocks))
    };
    let all = vec![
        ("allot_token_bucket", tb),
        ("allot_gcra", gcra),
        ("governor", gov),
    ];
    // Sanity: the case decides the way its name says (and the deny case gets exhausted here).
    for (name, l) in &all {
        let first: Vec<bool> = (0..3).map(|_| l.decide()).collect();
        let expect = if allow {
            vec![true; 3]
        } else {
            vec![true, false, false]
        };
        assert_eq!(first, expect, "{name}: unexpected decisions");
    }
    all
}

/// The cost of reading the time alone, to separate it from the decisions.
fn bench_clock(c: &mut Criterion) {
    let mut g = c.benchmark_group("clock_now");
    let ours = MonotonicClock::new();
    g.bench_function("allot_monotonic", |b| b.iter(|| black_box(ours.now())));
    let manual = ManualClock::new(1_000);
    g.bench_function("allot_manual", |b| b.iter(|| black_box(manual.now())));
    let gov = DefaultClock::default();
    g.bench_function("governor_default", |b| {
        b.iter(|| black_box(governor::clock::Clock::now(&gov)))
    });
    let fake = FakeRelativeClock::default();
    g.bench_function("governor_fake", |b| {
        b.iter(|| black_box(governor::clock::Clock::now(&fake)))
    });
    g.finish();
}

/// After a case: its limiter still decides as the case's name says (an allowing case whose
/// burst ran out would have measured denials).
fn check_still(name: &str, l: &dyn Decider, allow: bool) {
    if l.decide() != allow {
        eprintln!(
            "WARNING: {name} no longer {}",
            if allow { "allows" } else { "denies" }
        );
    }
}

fn bench_single(c: &mut Criterion) {
    for allow in [true, false] {
        let mut g = c.benchmark_group(if allow { "single_allow" } else { "single_deny" });
        for clocks in CLOCKS {
            for (name, l) in direct_limiters(clocks, allow) {
                g.bench_function(BenchmarkId::new(name, clocks.name()), |b| {
                    b.iter(|| black_box(l.decide()))
                });
                check_still(name, l.as_ref(), allow);
            }
        }
        g.finish();
    }
}

/// `iters` decisions on each of `THREADS` threads, started together; returns wall time divided
/// by the thread count, so criterion's time per iteration is wall time per decision.
fn contended(l: &dyn Decider, iters: u64) -> Duration {
    const THREADS: usize = 2;
    let barrier = Barrier::new(THREADS);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        black_box(l.decide());
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().unwrap();
    let end = spans.iter().map(|s| s.1).max().unwrap();
    (end - start) / THREADS as u32
}

fn bench_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads2_allow");
    for clocks in CLOCKS {
        for (name, l) in direct_limiters(clocks, true) {
            g.bench_function(BenchmarkId::new(name, clocks.name()), |b| {
                b.iter_custom(|iters| contended(l.as_ref(), iters))
            });
            check_still(name, l.as_ref(), true);
        }
    }
    g.finish();
}

fn bench_keyed(c: &mut Criterion) {
    let values = keyed::values();
    let entries = keyed::entries(&values);
    let descriptors = keyed::descriptors(&entries);
    let requests = keyed::requests(&descriptors);
    let gov_keys: Vec<String> = values.clone();

    let mut g = c.benchmark_group("keyed10k_allow");
    for clocks in CLOCKS {
        let real = MonotonicClock::new();
        let manual = ManualClock::new(1_000);
        let now = || match clocks {
            Clocks::Real => real.now(),
            Clocks::Manual => manual.now(),
        };
        for (name, alg) in [
            ("allot_token_bucket", "token_bucket"),
            ("allot_gcra", "gcra"),
        ] {
            let limiter = Limiter::new(keyed::config(alg), now());
            let mut statuses = Vec::with_capacity(4);
            // Create every key before measuring: the steady state is lookups of existing keys.
            for r in &requests {
                let out = limiter.decide(r, now(), &mut statuses).unwrap();
                assert_eq!(out.code, Code::Ok);
            }
            let mut i = 0usize;
            g.bench_function(BenchmarkId::new(name, clocks.name()), |b| {
                b.iter(|| {
                    let r = &requests[i];
                    i += 1;
                    if i == KEYS {
                        i = 0;
                    }
                    black_box(limiter.decide(r, now(), &mut statuses).unwrap().code)
                })
            });
        }
        let gov_check: Box<dyn Fn(&String) -> bool> = match clocks {
            Clocks::Real => {
                let l = GovKeyed::<DefaultClock>::keyed(huge_quota());
                Box::new(move |k| l.check_key(k).is_ok())
            }
            Clocks::Manual => {
                let l = GovKeyed::new(
                    huge_quota(),
                    DefaultKeyedStateStore::<String>::default(),
                    FakeRelativeClock::default(),
                );
                Box::new(move |k| l.check_key(k).is_ok())
            }
        };
        for k in &gov_keys {
            assert!(gov_check(k));
        }
        let mut i = 0usize;
        g.bench_function(BenchmarkId::new("governor", clocks.name()), |b| {
            b.iter(|| {
                let k = &gov_keys[i];
                i += 1;
                if i == KEYS {
                    i = 0;
                }
                black_box(gov_check(k))
            })
        });
    }
    g.finish();
}

/// Where criterion writes its results: `$CRITERION_HOME`, else `<target dir>/criterion`, where
/// the target dir is the one holding this executable (`<target>/<profile>/deps/decision-…`).
fn criterion_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(h);
    }
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors()
        .nth(3)
        .map(|t| t.join("criterion"))
        .unwrap_or_else(|| PathBuf::from("target/criterion"))
}

/// Median ns per iteration of benchmark `id` (`group/function[/parameter]`), if it was measured
/// by this process.
fn median_ns(dir: &Path, id: &str, since: SystemTime) -> Option<f64> {
    let path = dir.join(id).join("new/estimates.json");
    let modified = std::fs::metadata(&path).ok()?.modified().ok()?;
    if modified < since {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
    v["median"]["point_estimate"].as_f64()
}

fn print_report(since: SystemTime) {
    let dir = criterion_dir();
    let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".to_string(),
    };
    println!();
    println!(
        "Median ns per decision; ratio = Allot / governor, both measured in this run ({}).",
        dir.display()
    );
    println!();
    println!(
        "| case | clocks | Allot token bucket | Allot GCRA | governor | TB / gov | GCRA / gov |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
    for group in [
        "single_allow",
        "single_deny",
        "threads2_allow",
        "keyed10k_allow",
    ] {
        for clocks in CLOCKS {
            let get =
                |name: &str| median_ns(&dir, &format!("{group}/{name}/{}", clocks.name()), since);
            let (tb, gcra, gov) = (
                get("allot_token_bucket"),
                get("allot_gcra"),
                get("governor"),
            );
            if tb.is_none() && gcra.is_none() && gov.is_none() {
                continue;
            }
            println!(
                "| {group} | {} | {} | {} | {} | {} | {} |",
                clocks.name(),
                cell(tb),
                cell(gcra),
                cell(gov),
                ratio(tb, gov),
                ratio(gcra, gov)
            );
        }
    }
    let clock = |name: &str| median_ns(&dir, &format!("clock_now/{name}"), since);
    let (mono, manual, quanta, fake) = (
        clock("allot_monotonic"),
        clock("allot_manual"),
        clock("governor_default"),
        clock("governor_fake"),
    );
    if [mono, manual, quanta, fake].iter().any(Option::is_some) {
        println!();
        println!("| clock read alone | Allot | governor | Allot / gov |");
        println!("| --- | ---: | ---: | ---: |");
        println!(
            "| real (MonotonicClock / QuantaClock) | {} | {} | {} |",
            cell(mono),
            cell(quanta),
            ratio(mono, quanta)
        );
        println!(
            "| manual (ManualClock / FakeRelativeClock) | {} | {} | {} |",
            cell(manual),
            cell(fake),
            ratio(manual, fake)
        );
    }
}

fn main() {
    // Criterion's file times can be coarser than the clock; allow a little slack.
    let since = SystemTime::now() - Duration::from_secs(1);
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
        .configure_from_args();
    bench_clock(&mut c);
    bench_single(&mut c);
    bench_threads(&mut c);
    bench_keyed(&mut c);
    c.final_summary();
    print_report(since);
}
