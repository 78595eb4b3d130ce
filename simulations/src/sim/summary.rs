//! Many runs summed up: runs, faults injected by kind, violations, worst overshoot over the
//! bound, false-rejection rate; and the one-run report with its replay command.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::faults::FaultKind;
use super::run::RunReport;

/// Totals over runs.
#[derive(Debug, Default)]
pub struct Summary {
    /// Runs.
    pub runs: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Runs with a violation under faults the design tolerates.
    pub failed: Vec<u64>,
    /// Runs with a violation under faults beyond the design's tolerance.
    pub excused: Vec<u64>,
    /// Violations by invariant, over failed runs.
    pub violations: BTreeMap<&'static str, u64>,
    /// Worst overshoot over B + r·Δ as a fraction of the bound, ppm, and its seed.
    pub worst_overshoot: (u64, u64),
    /// Requests and admissions.
    pub requests: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Ideal admits in reachable time, and Allot's denials of them.
    pub ideal_admits: u64,
    /// False rejections.
    pub false_rejections: u64,
    /// Ledger invariant checks run.
    pub invariant_checks: u64,
}

impl Summary {
    /// Adds one run.
    pub fn add(&mut self, r: &RunReport) {
        self.runs += 1;
        for f in &r.faults {
            *self.faults.entry(f.kind).or_default() += 1;
        }
        if r.failed() {
            self.failed.push(r.seed);
            for v in &r.violations {
                *self.violations.entry(v.kind).or_default() += 1;
            }
        } else if !r.violations.is_empty() {
            self.excused.push(r.seed);
        }
        if r.worst_overshoot_ppm > self.worst_overshoot.0 {
            self.worst_overshoot = (r.worst_overshoot_ppm, r.seed);
        }
        self.requests += r.requests;
        self.admitted += r.admitted;
        self.ideal_admits += r.ideal_admits_reachable;
        self.false_rejections += r.false_rejections;
        self.invariant_checks += r.invariant_checks;
    }

    /// The printed summary.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "runs: {}", self.runs);
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let _ = writeln!(s, "faults injected: {}", faults.join(", "));
        let _ = writeln!(
            s,
            "violations: {} failed run(s) {:?}; by invariant: {:?}",
            self.failed.len(),
            self.failed,
            self.violations
        );
        let _ = writeln!(
            s,
            "under faults beyond the bound (reported, not failures): {} run(s) {:?}",
            self.excused.len(),
            self.excused
        );
        let _ = writeln!(
            s,
            "worst overshoot over B + r·Δ: {} of the reported bound (seed {})",
            percent(self.worst_overshoot.0, 1_000_000),
            self.worst_overshoot.1
        );
        let _ = writeln!(
            s,
            "requests: {}, admitted {}; false rejections {} of {} the ideal counter admits in \
             allocator-reachable time ({})",
            self.requests,
            self.admitted,
            self.false_rejections,
            self.ideal_admits,
            percent(self.false_rejections, self.ideal_admits)
        );
        let _ = writeln!(s, "ledger invariant checks: {}", self.invariant_checks);
        s
    }
}

/// `n / d` as a percentage with two decimals, exact integer arithmetic.
fn percent(n: u64, d: u64) -> String {
    if d == 0 {
        return "n/a".into();
    }
    let bp = u128::from(n) * 10_000 / u128::from(d);
    format!("{}.{:02}%", bp / 100, bp % 100)
}

/// One run's report: its faults and figures, and for a failing run the violations, the command
/// that replays it alone and the events that led to the first violation.
pub fn one(r: &RunReport, replay: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "seed {} workload {} trace {:016x}",
        r.seed,
        r.workload.name(),
        r.trace_hash
    );
    for f in &r.faults {
        let _ = writeln!(s, "  fault {f}");
    }
    let _ = writeln!(
        s,
        "  requests {} admitted {} false rejections {}/{} worst overshoot {} of bound \
         (largest bound reported {} tokens)",
        r.requests,
        r.admitted,
        r.false_rejections,
        r.ideal_admits_reachable,
        percent(r.worst_overshoot_ppm, 1_000_000),
        r.max_bound / allot_common::units::MICROS_PER_TOKEN
    );
    if !r.violations.is_empty() {
        let what = if r.failed() {
            "VIOLATED"
        } else {
            "violated under a fault beyond the bound"
        };
        let _ = writeln!(s, "  {what}: {} violation(s)", r.violations.len());
        for v in r.violations.iter().take(5) {
            let _ = writeln!(
                s,
                "    at {}ms {}: {}",
                v.at_ns / 1_000_000,
                v.kind,
                v.detail
            );
        }
        let _ = writeln!(s, "  replay: {replay}");
        let _ = writeln!(s, "  events leading to the first violation:");
        for (t, e) in r.trace_to_violation(40) {
            let _ = writeln!(
                s,
                "    {:>6}.{:03}ms {e}",
                t / 1_000_000,
                (t / 1_000) % 1_000
            );
        }
    }
    s
}
